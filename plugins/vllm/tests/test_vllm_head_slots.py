"""vLLM 0.33 K/V head slots read token-major: B12X (CUDA SM 12.x) and ROCM_SEGMENTED_ATTN (ROCm RDNA).

Both publish ``num_head_slots=2`` with ``state_content_bytes = NH*HS*itemsize`` (``b12x.py::
B12xPagedAttentionBackend.customize_spec``; ``rocm_segmented_attn.py`` inherits ``rocm_attn.py::
RocmAttentionBackend.customize_spec``), so a layer's view is ``[NB, 2, BS, NH*HS]``: the same
tensors as two K|V-packed heads (FlashAttention & co.) and as ROCM_ATTN's split_kv_cache slots.
They read slot 0 as K and slot 1 as V, each ``.unflatten(-1, (NH, HS))`` (``B12xPagedAttentionImpl.
_kv_cache_views``: ``kv_cache.unbind(1)``; ``RocmSegmentedAttentionImpl._split_kv_cache``:
``kv_cache[:, 0]`` / ``kv_cache[:, 1]``). The engine side is :func:`kvcore_vllm.fixtures.kv_view`
(those very operations); every check below is byte-for-byte against it on random bytes.
"""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import SPLIT_K, allocate, kv_view
from kvcore_vllm.hints import VllmHints

import kvcore

TOKEN_MAJOR = {"LBHNC": "NL_X_NB_TWO_BS_NH_HS", "BLHNC": "NB_NL_TWO_BS_NH_HS", "LHBNC": "NL_X_TWO_NB_BS_NH_HS"}
PACKED = {"LBHNC": "NL_X_NB_NH_BS_CS", "BLHNC": "NB_NL_NH_BS_CS", "LHBNC": "NL_X_NH_NB_BS_CS"}


def _random_fill(kv) -> None:
    g = torch.Generator().manual_seed(11)
    for st in {id(t.untyped_storage()): t.untyped_storage() for t in kv.values()}.values():
        raw = torch.empty(0, dtype=torch.uint8).set_(st)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def _rows_match(lay, kv, slots, **view_kw) -> None:
    """gather == the backend's own reading at each slot (K and V, every layer), and a scatter of
    fresh bytes lands where that reading finds them."""
    out = kvcore.gather(lay, torch.tensor(slots))
    for li in range(lay.num_layers):
        for p in (0, 1):
            v = kv_view(kv, li, p, **view_kw)
            bs = v.shape[1]
            for i, s in enumerate(slots):
                want = v[s // bs, s % bs].reshape(-1)
                assert torch.equal(out[p, li, i].view(torch.uint8), want.contiguous().view(torch.uint8)), (li, p, s)
    fresh = torch.empty_like(out)
    fresh.view(torch.uint8).copy_(torch.randint(0, 256, fresh.view(torch.uint8).shape, dtype=torch.uint8))
    dst = list(reversed(slots))
    kvcore.scatter(lay, torch.tensor(dst), fresh)
    for li in range(lay.num_layers):
        for p in (0, 1):
            v = kv_view(kv, li, p, **view_kw)
            bs = v.shape[1]
            for i, s in enumerate(dst):
                got = v[s // bs, s % bs].reshape(-1).contiguous().view(torch.uint8)
                assert torch.equal(got, fresh[p, li, i].view(torch.uint8)), (li, p, s)


# -- D1: B12X ------------------------------------------------------------------------------------


def test_b12x_is_an_accepted_backend():
    assert VllmHints(attention_backend="b12x").attention_backend == "B12X"
    assert VllmHints(attention_backend="ROCM_SEGMENTED_ATTN").family == "ROCM_SEGMENTED"
    declared = {h.name: h for _plugin, h in kvcore.registry.hints("vllm")}
    assert {"B12X", "ROCM_SEGMENTED_ATTN"} <= set(declared["attention_backend"].values)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize(("nh", "hs", "bs"), [(1, 64, 64), (2, 64, 128), (4, 128, 64), (8, 64, 64)])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_b12x_reads_as_the_engine(layout, nh, hs, bs, cache_dtype):
    kv = allocate("0.33.0", "B12X", layout, num_layers=3, num_blocks=4, block_size=bs, num_kv_heads=nh, head_size=hs,
                  cache_dtype=cache_dtype)  # fmt: skip
    t = next(iter(kv.values()))
    assert tuple(t.shape) == (4, 2, bs, nh * hs)  # create_kv_cache_views: [B, H=2 slots, N, C = NH*HS]
    _random_fill(kv)
    hints = {"vllm_version": "0.33.0", "attention_backend": "B12X", "kv_cache_layout": layout, "num_kv_heads": nh,
             "cache_dtype": cache_dtype}  # fmt: skip
    lay = kvcore.detect(kv, "vllm", hints)
    assert lay.format.name == TOKEN_MAJOR[layout]
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (3, 4, bs, nh, hs)
    assert lay.dtype == (torch.float8_e4m3fn if cache_dtype == "fp8" else torch.bfloat16)  # CUDA: OCP fp8
    _rows_match(lay, kv, [0, bs - 1, bs, 4 * bs - 1, 2 * bs + 5])


def test_b12x_without_the_head_count_moves_the_same_bytes():
    """attention_backend alone: the slot's row is one head of NH*HS elements (how it splits into
    heads does not move a byte); num_kv_heads or head_size give the head geometry."""
    kv = allocate("0.33.0", "B12X", "LBHNC", num_layers=2, num_blocks=3, block_size=64, num_kv_heads=4, head_size=64)
    _random_fill(kv)
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "B12X"})
    assert (lay.format.name, lay.num_heads, lay.head_size) == ("NL_X_NB_TWO_BS_NH_HS", 1, 256)
    _rows_match(lay, kv, [1, 70, 190])
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "B12X", "head_size": 64})
    assert (lay.num_heads, lay.head_size) == (4, 64)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("backend", ["B12X", "FLASH_ATTN"])
def test_two_heads_fit_b12x_and_packed_heads(layout, backend):
    """NH == 2: B12X's [NB, 2, BS, 2*HS] is also two K|V-packed heads of HS; with every geometry hint
    given only attention_backend decides. Either allocation raises; the backend picks its reading."""
    kv = allocate("0.33.0", backend, layout, num_layers=2, num_blocks=3, block_size=64, num_kv_heads=2, head_size=64)
    _random_fill(kv)
    full = {"vllm_version": "0.33.0", "kv_cache_layout": layout, "num_kv_heads": 2, "head_size": 64, "block_size": 64,
            "device_type": "cuda"}  # fmt: skip
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", full)
    assert ei.value.hints == ["attention_backend"]
    assert {TOKEN_MAJOR[layout], PACKED[layout]} <= set(ei.value.candidates)
    assert "B12X" in str(ei.value)
    lay = kvcore.detect(kv, "vllm", {**full, "attention_backend": backend})
    assert lay.format.name == (TOKEN_MAJOR if backend == "B12X" else PACKED)[layout]
    _rows_match(lay, kv, [0, 63, 64, 191, 100])


def test_without_the_head_count_num_kv_heads_decides_too():
    kv = allocate("0.33.0", "B12X", "BLHNC", num_layers=2, num_blocks=3, block_size=64, num_kv_heads=4, head_size=64)
    _random_fill(kv)
    base = {"vllm_version": "0.33.0", "kv_cache_layout": "BLHNC", "device_type": "cuda"}
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", base)
    assert {"attention_backend", "num_kv_heads"} <= set(ei.value.hints)
    assert {"NB_NL_TWO_BS_NH_HS", "NB_NL_NH_BS_CS"} <= set(ei.value.candidates)
    lay = kvcore.detect(kv, "vllm", {**base, "num_kv_heads": 4})  # packed heads would be 2: only B12X fits
    assert (lay.format.name, lay.num_heads, lay.head_size) == ("NB_NL_TWO_BS_NH_HS", 4, 64)
    _rows_match(lay, kv, [3, 64, 150])


def test_b12x_block_sizes_keep_other_caches_decided():
    """B12X runs kernel blocks of 64 or 128 tokens only: a packed cache of block size 16 is not a B12X
    reading, and stays decided without attention_backend."""
    kv = allocate("0.33.0", "FLASH_ATTN", "LBHNC", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    lay = kvcore.detect(kv, "vllm", {"vllm_version": "0.33.0", "kv_cache_layout": "LBHNC", "num_kv_heads": 2, "device_type": "cuda"})
    assert lay.format.name == "NL_X_NB_NH_BS_CS"
    with pytest.raises(kvcore.GeometryError, match="64, 128"):
        allocate("0.33.0", "B12X", "LBHNC", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    with pytest.raises(kvcore.GeometryError, match="head"):
        allocate("0.33.0", "B12X", "LBHNC", num_layers=2, num_blocks=3, block_size=64, num_kv_heads=2, head_size=96)
    with pytest.raises(kvcore.GeometryError, match="supported_kv_cache_layouts"):
        allocate("0.33.0", "B12X", "LBNHC", num_layers=2, num_blocks=3, block_size=64, num_kv_heads=2, head_size=64)


def test_b12x_is_not_a_rocm_reading():
    kv = allocate("0.33.0", "B12X", "LBHNC", num_layers=2, num_blocks=3, block_size=64, num_kv_heads=4, head_size=64)
    with pytest.raises(kvcore.DetectionError):
        kvcore.detect(kv, "vllm", {"attention_backend": "B12X", "device_type": "rocm"})


@pytest.mark.parametrize("form", ["vllm", "split"])
def test_b12x_blhnc_bare_cross_layer_tensor(form):
    """One tensor of all layers, as vLLM's 5-D BLHNC view holds them ([NB, NL, 2, BS, NH*HS]) or
    split into heads ([NB, NL, 2, BS, NH, HS], kvcore's normal form)."""
    kv = allocate("0.33.0", "B12X", "BLHNC", num_layers=3, num_blocks=4, block_size=64, num_kv_heads=2, head_size=128)
    _random_fill(kv)
    t0 = next(iter(kv.values()))
    nb, two, bs, c = t0.shape
    bare = torch.as_strided(t0, (nb, 3, two, bs, c), (t0.stride(0), two * bs * c, *t0.stride()[1:]), t0.storage_offset())
    if form == "split":
        bare = bare.unflatten(-1, (2, 128))
    lay = kvcore.detect(bare, "vllm", {"attention_backend": "B12X", "num_kv_heads": 2})
    assert (lay.format.name, lay.num_layers, lay.num_heads, lay.head_size) == ("NB_NL_TWO_BS_NH_HS", 3, 2, 128)
    out = kvcore.gather(lay, torch.tensor([0, 77, 255]))
    for li in range(3):
        for p in (0, 1):
            v = kv_view(kv, li, p)
            for i, s in enumerate([0, 77, 255]):
                assert torch.equal(out[p, li, i].view(torch.int16), v[s // 64, s % 64].reshape(-1).view(torch.int16))


# -- D2: ROCM_SEGMENTED_ATTN ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize(("nh", "hs", "bs"), [(1, 64, 16), (2, 128, 32), (4, 64, 16), (8, 256, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rocm_segmented_reads_as_the_engine(layout, nh, hs, bs, dtype):
    kv = allocate("0.33.0", "ROCM_SEGMENTED_ATTN", layout, num_layers=2, num_blocks=5, block_size=bs, num_kv_heads=nh,
                  head_size=hs, dtype=dtype)  # fmt: skip
    _random_fill(kv)
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "ROCM_SEGMENTED_ATTN", "num_kv_heads": nh, "vllm_version": "0.33"})
    assert lay.format.name == TOKEN_MAJOR[layout]
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size, lay.dtype) == (5, bs, nh, hs, dtype)
    _rows_match(lay, kv, [0, bs - 1, bs, 5 * bs - 1, 3 * bs + 2])


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize("backend", ["ROCM_SEGMENTED_ATTN", "ROCM_ATTN"])
@pytest.mark.parametrize("nh", [2, 4])
def test_rocm_head_slots_token_major_or_split_kv_cache(layout, backend, nh):
    """On ROCm one [NB, 2, BS, NH*HS] allocation is read two ways: ROCM_ATTN through
    split_kv_cache (K in 16-byte chunks, V token-innermost), ROCM_SEGMENTED_ATTN token-major.
    Every geometry and layout hint given, the backend alone decides; each answer is its backend's bytes."""
    kv = allocate("0.33.0", backend, layout, num_layers=2, num_blocks=3, block_size=16, num_kv_heads=nh, head_size=64)
    _random_fill(kv)
    full = {"vllm_version": "0.33.0", "device_type": "rocm", "kv_cache_layout": layout, "num_kv_heads": nh, "head_size": 64,
            "block_size": 16}  # fmt: skip
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", full)
    # (LHBNC: the token-major reading permutes the view's axes, so tensor_order="physical" would rule it out too)
    assert "attention_backend" in ei.value.hints and set(ei.value.hints) <= {"attention_backend", "tensor_order"}
    assert {SPLIT_K, TOKEN_MAJOR[layout]} <= set(ei.value.candidates)
    assert "ROCM_SEGMENTED_ATTN" in str(ei.value) and "ROCM_ATTN" in str(ei.value)
    lay = kvcore.detect(kv, "vllm", {**full, "attention_backend": backend})
    assert lay.format.name == (TOKEN_MAJOR[layout] if backend == "ROCM_SEGMENTED_ATTN" else SPLIT_K)
    _rows_match(lay, kv, [0, 15, 16, 47, 20])


def test_rocm_segmented_in_a_rocm_process_needs_the_backend(monkeypatch):
    """Tensors of a ROCm build of torch and no hint at all: the same ambiguity, never split_kv_cache by default."""
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    kv = allocate("0.33.0", "ROCM_SEGMENTED_ATTN", "LHBNC", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=4, head_size=64)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", {"num_kv_heads": 4})
    assert "attention_backend" in ei.value.hints and {SPLIT_K, "NL_X_TWO_NB_BS_NH_HS"} <= set(ei.value.candidates)


def test_rocm_segmented_fp8_is_ocp():
    """ROCM_SEGMENTED_ATTN runs on RDNA and takes fp8 on gfx12 only, whose fp8 is OCP e4m3fn
    (platforms/rocm.py fp8_dtype: FNUZ is gfx94x's): no OCP/FNUZ ambiguity on ROCm, unlike ROCM_ATTN."""
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64, cache_dtype="fp8")
    kv = allocate("0.33.0", "ROCM_SEGMENTED_ATTN", "LBHNC", **g)
    _random_fill(kv)
    hints = {"attention_backend": "ROCM_SEGMENTED_ATTN", "cache_dtype": "fp8", "num_kv_heads": 2, "device_type": "rocm"}
    lay = kvcore.detect(kv, "vllm", hints)
    assert (lay.format.name, lay.dtype) == ("NL_X_NB_TWO_BS_NH_HS", torch.float8_e4m3fn)
    _rows_match(lay, kv, [0, 17, 40])
    split = allocate("0.33.0", "ROCM_ATTN", "LBHNC", **g)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:  # ROCM_ATTN also runs on gfx94x (FNUZ)
        kvcore.detect(split, "vllm", {"attention_backend": "ROCM_ATTN", "cache_dtype": "fp8", "num_kv_heads": 2})
    assert "dtype" in ei.value.hints
