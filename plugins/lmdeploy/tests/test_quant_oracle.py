"""The dequantising oracle: a float reference is quantised the way LMDeploy's fill kernel
does and written through LMDeploy's own per-layer caches (kernel addressing, not kvcore's
stride table); kvcore gathers the int8/int4 codes and the (scale, zero) planes; the staged
planes are dequantised the way LMDeploy's attention kernels read them and must give the
reference back within the quantisation step -- and exactly what the engine-side cache
dequantises to. Then scatter into other blocks of another cache of another generation, and
the engine reads the same values there."""

from __future__ import annotations

import pytest
import torch
from kvcore_lmdeploy.allocation import CacheConfig, allocate
from kvcore_lmdeploy.fixtures import view_per_layer
from kvcore_lmdeploy.quant import dequantize, dequantize_staged, quantize, tolerance

import kvcore
from kvcore import GeometryError, TransferError


def _reference(nl, nslots, nh, hd, seed):
    g = torch.Generator().manual_seed(seed)
    # per-head offsets and spreads so scales and zeros differ by layer, token and head
    x = torch.randn(2, nl, nslots, nh, hd, generator=g)
    return x * torch.rand(2, nl, nslots, nh, 1, generator=g).add(0.2) * 3 + torch.randn(2, nl, nslots, nh, 1, generator=g)


def _write_engine_side(alloc, ref, policy, scale_dtype):
    """Quantise ``ref`` [2, NL, slots, NH, HD] and store codes and (scale, zero) through
    ``gpu_cache[layer][plane]`` indexed as fill_kv_cache does ([block, token, head, d])."""
    view = view_per_layer("cuda")
    for layer in range(ref.shape[1]):
        for kv in range(2):
            codes, sz = quantize(ref[kv, layer], policy, scale_dtype)
            cv, szv = view(alloc.gpu_cache, layer, kv), view(alloc.gpu_cache, layer, 2 + kv)
            cv.copy_(codes.view(cv.shape))
            szv.copy_(sz.view(szv.shape))


def _engine_read(alloc, policy, layer, kv):
    """What LMDeploy's kernels dequantise for every slot of ``layer``: [slots, NH, HD] float32."""
    view = view_per_layer("cuda")
    cv, szv = view(alloc.gpu_cache, layer, kv), view(alloc.gpu_cache, layer, 2 + kv)
    return dequantize(cv.flatten(0, 1), szv.flatten(0, 1), policy)


CASES = [
    ("0.6.2", 8, torch.bfloat16),
    ("0.9.2", 8, torch.float16),
    ("0.14.0", 8, torch.bfloat16),
    ("0.6.2", 4, torch.float32),
    ("0.9.2", 4, torch.bfloat16),
    ("0.14.0", 4, torch.float16),
]


@pytest.mark.parametrize(("version", "policy", "scale_dtype"), CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_staged_planes_dequantise_to_the_reference(version, policy, scale_dtype):
    nl, nb, bs, nh, hd = 3, 5, 4, 3, 32
    alloc = allocate(version, CacheConfig(nl, nb, bs, nh, hd, dtype=scale_dtype, quant_policy=policy))
    ref = _reference(nl, nb * bs, nh, hd, seed=policy * 100 + len(version))
    _write_engine_side(alloc, ref, policy, scale_dtype)
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"quant_policy": policy, "device_type": "cuda"})
    assert [p.role for p in layout.planes] == ["K", "V", "KSZ", "VSZ"]
    assert layout.head_size == (hd if policy == 8 else hd // 2)  # the stored width in bytes
    slots = torch.tensor([0, 7, 19, -1, 12, 3])
    staged = kvcore.gather(layout, slots)
    assert set(staged) == {"K", "V", "KSZ", "VSZ"}
    assert staged["K"].dtype == torch.uint8 and staged["KSZ"].dtype == scale_dtype
    assert tuple(staged["KSZ"].shape) == (nl, len(slots), nh * 2)
    got = dequantize_staged(layout, staged, policy)
    keep = slots >= 0
    for kv, role in enumerate(("K", "V")):
        want = ref[kv][:, slots[keep]]  # [NL, T, NH, HD]
        out = got[role][:, keep]
        _, sz = quantize(want, policy, scale_dtype)
        err = (out - want).abs()
        tol = tolerance(want, sz)
        assert bool((err <= tol).all()), f"{role}: max error {float(err.max())} beyond the quantisation step"
        # the quantisation is real: codes carry the values to within a step, not exactly
        assert float(err.max()) > 0
        # and what the engine itself reads at those slots, bit for bit
        for layer in range(nl):
            assert torch.equal(out[layer], _engine_read(alloc, policy, layer, kv)[slots[keep]])


@pytest.mark.parametrize("policy", [8, 4])
def test_the_oracle_fails_when_a_plane_is_read_wrong(policy):
    """Swapped K and V scale planes, or heads of a scale plane reversed, leave the
    quantisation step: the oracle can fail."""
    nl, nb, bs, nh, hd = 2, 3, 4, 2, 16
    alloc = allocate("0.14.0", CacheConfig(nl, nb, bs, nh, hd, quant_policy=policy))
    ref = _reference(nl, nb * bs, nh, hd, seed=5)
    _write_engine_side(alloc, ref, policy, torch.bfloat16)
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"quant_policy": policy, "device_type": "cuda"})
    slots = torch.arange(nb * bs)
    staged = kvcore.gather(layout, slots)
    _, sz = quantize(ref[0], policy, torch.bfloat16)
    tol = tolerance(ref[0], sz)
    swapped = dequantize_staged(layout, {**staged, "KSZ": staged["VSZ"], "VSZ": staged["KSZ"]}, policy)
    assert not bool(((swapped["K"] - ref[0]).abs() <= tol).all())
    flipped = dict(staged, KSZ=staged["KSZ"].unflatten(-1, (nh, 2)).flip(-2).flatten(-2))
    assert not bool(((dequantize_staged(layout, flipped, policy)["K"] - ref[0]).abs() <= tol).all())


def test_scatter_into_another_generation_reads_the_same_values():
    """0.9.2 cross-layer views -> 0.14.0 pool slices (other blocks): what LMDeploy's kernels
    read at the destination equals what they read at the source."""
    nl, nb, bs, nh, hd = 2, 4, 8, 2, 16
    src = allocate("0.9.2", CacheConfig(nl, nb, bs, nh, hd, quant_policy=4))
    dst = allocate("0.14.0", CacheConfig(nl, nb, bs, nh, hd, quant_policy=4))
    _write_engine_side(src, _reference(nl, nb * bs, nh, hd, seed=9), 4, torch.bfloat16)
    hints = {"quant_policy": 4, "device_type": "cuda"}
    a = kvcore.detect(src.gpu_cache, engine="lmdeploy", hints=hints)
    b = kvcore.detect(dst.gpu_cache, engine="lmdeploy", hints=hints)
    src_slots = torch.tensor([8, 9, 10, 30, 31])
    dst_slots = torch.tensor([0, 1, 2, 17, 25])
    kvcore.scatter(b, dst_slots, kvcore.gather(a, src_slots))
    for layer in range(nl):
        for kv in range(2):
            assert torch.equal(_engine_read(dst, 4, layer, kv)[dst_slots], _engine_read(src, 4, layer, kv)[src_slots])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[dst_slots] = False
    k_dst = view_per_layer()(dst.gpu_cache, 0, 0).flatten(0, 1)
    assert int(k_dst[untouched].count_nonzero()) == 0  # the pool was zeros; nothing else was written


def test_int4_nibbles_follow_lmdeploys_packing():
    """Byte j holds element j (low nibble) and element j + HS/2 (high nibble)."""
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 15.0, 14.0, 13.0, 12.0]])
    codes, sz = quantize(x, 4, torch.float32)
    assert sz[0, 0].item() == pytest.approx(1.0) and sz[0, 1].item() == pytest.approx(0.0)
    assert codes.tolist() == [[0 + 16 * 15, 1 + 16 * 14, 2 + 16 * 13, 3 + 16 * 12]]
    assert dequantize(codes, sz, 4).tolist() == x.tolist()


def test_bad_dequantisation_inputs_are_refused():
    with pytest.raises(GeometryError, match="odd"):
        quantize(torch.zeros(1, 3), 4, torch.bfloat16)
    with pytest.raises(GeometryError, match="quant_policy 42"):
        quantize(torch.zeros(1, 4), 42, torch.bfloat16)
    with pytest.raises(GeometryError, match="uint8"):
        dequantize(torch.zeros(1, 4), torch.zeros(1, 2), 8)
    alloc = allocate("0.14.0", CacheConfig(1, 2, 2, 1, 8, quant_policy=8))
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"device_type": "cuda"})
    staged = kvcore.gather(layout, torch.tensor([0]))
    with pytest.raises(GeometryError, match="lacks plane"):
        dequantize_staged(layout, {k: v for k, v in staged.items() if k != "VSZ"}, 8)
    # a staging plane of the wrong dtype is refused before any write
    bad = dict(staged, KSZ=staged["KSZ"].float())
    before = [t.clone() for t in alloc.gpu_cache[0]]
    with pytest.raises(TransferError, match="KSZ"):
        kvcore.scatter(layout, torch.tensor([1]), bad)
    assert all(torch.equal(a, b) for a, b in zip(before, alloc.gpu_cache[0]))
