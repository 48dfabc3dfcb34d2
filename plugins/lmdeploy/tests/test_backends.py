"""Backends and releases: which block order each LMDeploy backend allocates in which release
(Ascend 310P's NZ blocks, MACA per release, fp8 on CUDA only), the heads a CacheEngine of an
MQA model keeps per rank, and ``lmdeploy_version`` checked against every other hint and the
tensors. Expected bytes come from the fixtures' engine-side views (LMDeploy's addressing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.allocation import CacheConfig, allocate, generation
from kvcore_lmdeploy.fixtures import view_cross_layer, view_per_layer, view_pool

import kvcore
from kvcore import AmbiguousLayoutError, DetectionError, GeometryError


def _tensors(alloc):
    gen = generation(alloc.version)
    return [t for e in alloc.gpu_cache for t in e] if gen == "per_layer" else [alloc.full] if gen == "pool" else list(alloc.full)


def _zeroed(version, cfg):
    alloc = allocate(version, cfg)
    for t in _tensors(alloc):
        t.zero_()
    return alloc


# -- D5: Ascend 310P NZ blocks ------------------------------------------------------------------------


def _nz_cfg(**kw):
    base = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    return CacheConfig(**{**base, "device_type": "ascend", "soc_version": "Ascend310P3", **kw})


def test_310p_blocks_are_nz_as_the_backend_allocates_them():
    """0.8.0-0.11.0 AscendOpsBackend.get_k_block_shape on a 310P: ((NH*HS+15)//16, BS, 16)."""
    for version in ("0.8.0", "0.9.2", "0.10.2", "0.11.0"):
        alloc = allocate(version, _nz_cfg())
        assert tuple(alloc.gpu_cache[0][0].shape) == (3, 8, 16, 16)
    for version in ("0.7.3", "0.11.1", "0.14.0"):  # no 310P branch: 910 blocks, or LMDeploy refuses the chip
        if version == "0.7.3":
            assert tuple(allocate(version, _nz_cfg()).gpu_cache[0][0].shape) == (3, 16, 2, 64)
        else:
            with pytest.raises(GeometryError, match="does not run Ascend310P3"):
                allocate(version, _nz_cfg())


@pytest.mark.parametrize(
    ("version", "holder"), [("0.9.2", "gpu_cache"), ("0.10.2", "full_gpu_cache"), ("0.11.0", "gpu_cache"), ("0.8.0", "full_gpu_cache")]
)
def test_310p_nz_gathers_and_scatters_lmdeploys_bytes(version, holder, engine_side):
    cfg = _nz_cfg()
    alloc = allocate(version, cfg)
    engine_side.fill_random(_tensors(alloc), seed=11)
    hints = {"device_type": "ascend", "soc_version": "Ascend310P3", "head_dim": 64}
    src = alloc.gpu_cache if holder == "gpu_cache" else alloc.full
    layout = kvcore.detect(src, engine="lmdeploy", hints=hints)
    assert layout.format.name == (F.NZ if holder == "gpu_cache" else F.X_NZ)
    assert (layout.num_blocks, layout.block_size, layout.num_heads, layout.head_size) == (3, 16, 2, 64)
    # one element by hand: head 1, element 37 of token 5 of block 2 is chunk (1*64 + 37) // 16 = 6, lane 5
    k = alloc.gpu_cache[1][0]
    staged = kvcore.gather(layout, torch.tensor([2 * 16 + 5]), layers=1)
    assert staged[0, 0, 64 + 37].view(torch.int16) == k[2, 6, 5, 5].view(torch.int16)
    dst = _zeroed(version, cfg)
    dsrc = dst.gpu_cache if holder == "gpu_cache" else dst.full
    dst_layout = kvcore.detect(dsrc, engine="lmdeploy", hints={**hints, "num_kv_heads": 2})
    view = (view_per_layer if holder == "gpu_cache" else view_cross_layer)("ascend", version=version, nz=True)
    engine_side.check_gather_scatter(
        layout,
        dst_layout,
        lambda lay, p: view(src, lay, p, hints=hints),
        lambda lay, p: view(dsrc, lay, p, hints=hints),
        ("K", "V"),
        16,
        src_slots=[0, 5, 17, 47, 31],
        dst_slots=[46, 1, 2, 16, 33],
        dst_tensors=_tensors(dst),
    )


def test_the_reviewers_310p_cache_is_never_read_as_910():
    """[NB, 8, 16, 16] fp16 per layer: 310P NZ of 2 heads x 64 (or 8 x 16, ...), and also 910
    blocks of 8 tokens x 16 heads x 16. Nothing given decides: AmbiguousLayoutError naming
    soc_version; each deciding hint gives the one reading that fits."""
    alloc = allocate("0.9.2", _nz_cfg())
    gc = alloc.gpu_cache
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend"})
    assert "soc_version" in e.value.hints and F.NZ in e.value.candidates and F.NHD in e.value.candidates
    with pytest.raises(AmbiguousLayoutError) as e:  # a CPU copy with no device_type: NHD (cuda/ascend), HND (camb), NZ
        kvcore.detect(gc, engine="lmdeploy")
    assert "device_type" in e.value.hints
    assert kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend", "head_dim": 64}).format.name == F.NZ
    assert kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend", "num_kv_heads": 2}).format.name == F.NZ
    assert kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend", "block_size": 8}).format.name == F.NHD
    as_910 = kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend", "soc_version": "Ascend910B2"})
    assert as_910.format.name == F.NHD and (as_910.block_size, as_910.num_heads) == (8, 16)
    for version in ("0.7.3", "0.11.1", "0.12.3"):  # no 310P NZ blocks in these releases
        assert kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend", "lmdeploy_version": version}).format.name == F.NHD
    with pytest.raises(AmbiguousLayoutError):
        kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend", "lmdeploy_version": "0.10.2"})


def test_310p_refusals():
    gc = allocate("0.9.2", _nz_cfg()).gpu_cache
    with pytest.raises(DetectionError, match="pass num_kv_heads or head_dim"):
        kvcore.detect(gc, engine="lmdeploy", hints={"soc_version": "Ascend310P3", "lmdeploy_version": "0.9.2"})
    with pytest.raises(AmbiguousLayoutError) as e:  # 0.7.3 had no SocVersion: (BS, NH, HS) blocks on a 310P too
        kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "ascend", "soc_version": "Ascend310P3"})
    assert "lmdeploy_version" in e.value.hints and "soc_version" not in e.value.hints
    with pytest.raises(DetectionError, match="does not run soc_version='Ascend310P3'"):
        kvcore.detect(gc, engine="lmdeploy", hints={"soc_version": "Ascend310P3", "head_dim": 64, "lmdeploy_version": "0.12.3"})
    with pytest.raises(DetectionError, match="soc_version is for device_type='ascend'"):
        kvcore.detect(gc, engine="lmdeploy", hints={"soc_version": "Ascend310P3", "device_type": "cuda"})
    with pytest.raises(DetectionError, match="are not num_kv_heads=3 heads"):
        kvcore.detect(gc, engine="lmdeploy", hints={"soc_version": "Ascend310P3", "num_kv_heads": 3})
    with pytest.raises(DetectionError, match="Accepted hints|Ascend910"):
        kvcore.detect(gc, engine="lmdeploy", hints={"soc_version": "Ascend310B1"})
    # a head size that is not a multiple of 16: chunks straddle heads, not described -- and never read as 910 blocks
    odd = allocate("0.9.2", _nz_cfg(num_kv_heads=2, head_dim=24)).gpu_cache  # (2*24+15)//16 = 3 chunks
    assert tuple(odd[0][0].shape) == (3, 3, 16, 16)
    with pytest.raises(DetectionError, match="not a multiple of 16"):
        kvcore.detect(odd, engine="lmdeploy", hints={"soc_version": "Ascend310P3", "head_dim": 24})
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(odd, engine="lmdeploy", hints={"device_type": "ascend"})
    assert "soc_version" in e.value.hints


def test_ascend_int8_codes_name_the_chip():
    """Ascend stores int4/int8 codes as int8 (CacheEngine.__init__, <= 0.11.0); on a 310P
    they sit in NZ blocks (not described). int8 codes [.., X, Y, 16] fit both: never guessed."""
    cfg = CacheConfig(2, 3, 4, 2, 16, quant_policy=8, device_type="ascend", soc_version="Ascend910B")
    alloc = allocate("0.9.2", cfg)
    assert alloc.gpu_cache[0][0].dtype == torch.int8
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy")
    assert e.value.hints == ["soc_version", "lmdeploy_version"]
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"soc_version": "Ascend910B4"})
    assert layout.format.name == F.QUANT and layout.planes[0].dtype == torch.int8
    assert kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"lmdeploy_version": "0.7.3"}).format.name == F.QUANT
    nz = allocate("0.9.2", CacheConfig(2, 3, 4, 2, 16, quant_policy=8, device_type="ascend", soc_version="Ascend310P1"))
    with pytest.raises(DetectionError, match="NZ blocks .* is not described"):
        kvcore.detect(nz.gpu_cache, engine="lmdeploy", hints={"soc_version": "Ascend310P1", "lmdeploy_version": "0.9.2"})
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(nz.gpu_cache, engine="lmdeploy", hints={"soc_version": "Ascend310P1"})
    assert e.value.hints == ["lmdeploy_version"]
    with pytest.raises(DetectionError, match="CUDA backend stores them as uint8"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"device_type": "cuda"})
    # uint8 codes are CUDA's (or the 0.11.1+ pool's, which has no NZ): no chip question
    cuda = allocate("0.9.2", CacheConfig(2, 3, 4, 2, 16, quant_policy=8))
    assert kvcore.detect(cuda.gpu_cache, engine="lmdeploy").format.name == F.QUANT


# -- MACA: the block order depends on the release -------------------------------------------------------


def test_maca_blocks_follow_the_release(engine_side):
    """MacaOpsBackend.get_k_block_shape: 0.6.2 (NH, BS, HS); 0.6.4-0.9.2 split K (not
    described); 0.10.2+ (BS, NH, HS). MACA tensors are torch 'cuda' tensors, so the
    device_type hint is the caller's; without the release, both readings are ambiguous."""
    cfg = CacheConfig(2, 3, 16, 4, 32, device_type="maca")
    old = allocate("0.6.2", cfg)
    assert tuple(old.gpu_cache[0][0].shape) == (3, 4, 16, 32)
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(old.gpu_cache, engine="lmdeploy", hints={"device_type": "maca"})
    assert "lmdeploy_version" in e.value.hints
    layout = kvcore.detect(old.gpu_cache, engine="lmdeploy", hints={"device_type": "maca", "lmdeploy_version": "0.6.2"})
    assert layout.format.name == F.HND and (layout.block_size, layout.num_heads) == (16, 4)
    engine_side.fill_random(_tensors(old), seed=2)
    view = view_per_layer("maca", version="0.6.2")
    staged = kvcore.gather(layout, torch.tensor([7, 40]))
    for layer in range(2):
        assert torch.equal(
            engine_side.as_bytes(staged[1, layer]), engine_side.rows(lambda lay, p: view(old.gpu_cache, lay, p), layer, 1, [7, 40], 16)
        )
    new = allocate("0.14.0", cfg)
    assert tuple(new.gpu_cache[0][0].shape) == (3, 16, 4, 32)
    assert kvcore.detect(new.gpu_cache, engine="lmdeploy", hints={"device_type": "maca", "lmdeploy_version": "0.14.0"}).format.name == F.NHD
    assert kvcore.detect(new.gpu_cache, engine="lmdeploy", hints={"device_type": "maca", "block_size": 16}).format.name == F.NHD
    with pytest.raises(DetectionError, match="split K .* not described"):
        kvcore.detect(new.gpu_cache, engine="lmdeploy", hints={"device_type": "maca", "lmdeploy_version": "0.9.2"})
    with pytest.raises(GeometryError, match="split-K"):
        allocate("0.9.2", cfg)


# -- D2: fp8 is CUDA only -------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "dtype"), [(16, torch.float8_e4m3fn), (17, torch.float8_e5m2)])
def test_fp8_is_cuda_blocks_whatever_holds_it(policy, dtype, engine_side):
    """0.14.0 CacheEngine.__init__ asserts fp8 on CUDA: a CPU copy (host cache) of an fp8
    cache is NHD without device_type, and camb / ascend / maca contradict it."""
    cfg = CacheConfig(2, 3, 16, 2, 8, quant_policy=policy)
    alloc = allocate("0.14.0", cfg)
    engine_side.fill_random(_tensors(alloc), seed=policy)
    for hints in ({}, {"quant_policy": policy}, {"num_kv_heads": 2}, {"lmdeploy_version": "0.14.0"}):
        layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints=hints)
        assert layout.format.name == F.NHD and layout.dtype == dtype and layout.block_size == 16, hints
    view = view_per_layer()
    staged = kvcore.gather(layout, torch.tensor([0, 1, 5, 33]))
    for layer in range(2):
        for kv in range(2):
            want = engine_side.rows(lambda lay, p: view(alloc.gpu_cache, lay, p), layer, kv, [0, 1, 5, 33], 16)
            assert torch.equal(engine_side.as_bytes(staged[kv, layer]), want)
    for device in ("camb", "ascend", "maca"):
        with pytest.raises(DetectionError, match="FP8 quantization is only supported on CUDA"):
            kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"quant_policy": policy, "device_type": device})
        with pytest.raises(DetectionError, match=f"device_type='{device}' does not run an fp8 KV cache"):
            kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"device_type": device})
    pool_hints = {"num_kv_heads": 2, "head_dim": 8, "block_size": 16, "dtype": "bfloat16", "quant_policy": policy}
    pool = kvcore.detect(alloc.full, engine="lmdeploy", hints=pool_hints)  # no device_type: fp8 names CUDA
    assert pool.format.name == F.X_NHD
    pview = view_pool("plain")
    got = kvcore.gather(pool, torch.tensor([3, 47]), layers=1)
    assert torch.equal(
        engine_side.as_bytes(got[0]),
        engine_side.rows(lambda lay, p: pview(alloc.full, lay, p, hints={**pool_hints, "device_type": "cuda"}), 1, 0, [3, 47], 16),
    )
    with pytest.raises(DetectionError, match="FP8 quantization is only supported on CUDA"):
        kvcore.detect(alloc.full, engine="lmdeploy", hints={**pool_hints, "device_type": "camb"})


# -- D3: a CacheEngine's heads per rank follow the release ---------------------------------------------------


def _engine(gc, *, heads, world, mqa=None, version_cfg=None):
    mc = SimpleNamespace(dtype=torch.bfloat16, head_dim=64, k_head_dim=None, v_head_dim=None, num_key_value_heads=heads)
    if mqa is not None:
        mc.multi_query_attention = mqa
    cc = SimpleNamespace(block_size=16, quant_policy=0, device_type="cuda", **(version_cfg or {}))
    return SimpleNamespace(gpu_cache=gc, cache_config=cc, model_config=mc, world_size=world)


def test_cache_engine_heads_per_rank():
    """0.6.0-0.6.4 _get_key_block_shape_impl: `if local and not model_config.multi_query_attention:
    num_heads //= world_size` (Falcon-7B MQA keeps its 1 head on every rank); 0.6.5+ always
    divide (and assert divisibility)."""
    mqa = allocate("0.6.2", CacheConfig(2, 3, 16, 1, 64)).gpu_cache
    assert kvcore.detect(_engine(mqa, heads=1, world=2, mqa=True), engine="lmdeploy").num_heads == 1
    assert kvcore.detect(_engine(mqa, heads=1, world=4, mqa=True), engine="lmdeploy", hints={"lmdeploy_version": "0.6.4"}).num_heads == 1
    with pytest.raises(DetectionError, match="asserts num_heads % world_size == 0"):  # 0.6.5+ divides whatever the field says
        kvcore.detect(_engine(mqa, heads=1, world=2, mqa=True), engine="lmdeploy", hints={"lmdeploy_version": "0.6.5"})
    gqa = allocate("0.6.2", CacheConfig(2, 3, 16, 4, 64)).gpu_cache
    assert kvcore.detect(_engine(gqa, heads=8, world=2, mqa=False), engine="lmdeploy").num_heads == 4
    assert kvcore.detect(_engine(gqa, heads=8, world=2), engine="lmdeploy", hints={"lmdeploy_version": "0.9.2"}).num_heads == 4
    with pytest.raises(DetectionError, match="contradicts the CacheEngine's own num_kv_heads=4"):
        kvcore.detect(_engine(gqa, heads=8, world=2), engine="lmdeploy", hints={"num_kv_heads": 8})
    with pytest.raises(DetectionError, match="8 KV heads and world_size 3"):
        kvcore.detect(_engine(gqa, heads=8, world=3), engine="lmdeploy")
    # a 0.14 CacheConfig before __post_init__ says kernel_block_size=-1: not a fact
    assert kvcore.detect(_engine(gqa, heads=8, world=2, version_cfg={"kernel_block_size": -1}), engine="lmdeploy").block_size == 16


# -- D8: lmdeploy_version against every other hint and the tensors ----------------------------------------------


def _plain(version="0.12.3", **kw):
    return allocate(version, CacheConfig(2, 3, 16, 2, 8, **kw))


CONTRADICTIONS = [
    ("block_size=32, 0.12.3", lambda: _plain().gpu_cache, {"device_type": "cuda", "block_size": 32}, "0.12.3", "has no kernel blocks"),
    (
        "kernel_block_size, 0.12.3",
        lambda: _plain().gpu_cache,
        {"device_type": "cuda", "kernel_block_size": 16},
        "0.12.3",
        "kernel_block_size is 0.14.0's",
    ),
    ("camb, 0.6.0", lambda: _plain().gpu_cache, {"device_type": "camb"}, "0.6.0", "Cambricon backend .* is 0.7"),
    ("fp8 policy, 0.9.2", lambda: _plain("0.14.0", quant_policy=16).gpu_cache, {"quant_policy": 16}, "0.9.2", "quant_policy=16 is 0.14"),
    ("fp8 tensors, 0.9.2", lambda: _plain("0.14.0", quant_policy=16).gpu_cache, {}, "0.9.2", "fp8 KV cache .* 0.14.0's"),
    ("TurboQuant tensors, 0.12.3", lambda: _plain("0.14.0", quant_policy=42).gpu_cache, {}, "0.12.3", "TurboQuant .* 0.14.0's"),
    ("int8 tensors, 0.6.0", lambda: _plain("0.6.2", quant_policy=8).gpu_cache, {}, "0.6.0", "quantises the KV cache from 0.6.2"),
    ("quant_policy 4, 0.6.1", lambda: _plain("0.6.2", quant_policy=4).gpu_cache, {"quant_policy": 4}, "0.6.1", "from 0.6.2"),
    ("cross-layer tuple, 0.6.2", lambda: _plain("0.9.2").full, {"device_type": "cuda"}, "0.6.2", "cross-layer tensors .* 0.6.4"),
    (
        "pool, 0.11.0",
        lambda: _plain("0.14.0").full,
        {"num_kv_heads": 2, "head_dim": 8, "block_size": 16, "dtype": "bfloat16", "device_type": "cuda"},
        "0.11.0",
        "memory pool of 0.11.1",
    ),
    ("310P, 0.14.0", lambda: _plain().gpu_cache, {"soc_version": "Ascend310P3"}, "0.14.0", "does not run soc_version"),
    ("maca, 0.8.0", lambda: _plain().gpu_cache, {"device_type": "maca"}, "0.8.0", "split K"),
    ("maca, 0.6.0", lambda: _plain().gpu_cache, {"device_type": "maca"}, "0.6.0", "has no maca backend"),
    ("0.5.0", lambda: _plain().gpu_cache, {"device_type": "cuda"}, "0.5.0", "before 0.6.0"),
]


@pytest.mark.parametrize(("what", "make", "hints", "version", "match"), CONTRADICTIONS, ids=[c[0] for c in CONTRADICTIONS])
def test_lmdeploy_version_contradictions_are_errors(what, make, hints, version, match):
    kv = make()
    with pytest.raises(DetectionError, match=match) as e:
        kvcore.detect(kv, engine="lmdeploy", hints={**hints, "lmdeploy_version": version})
    assert not isinstance(e.value, AmbiguousLayoutError)


def test_the_same_hints_with_a_release_that_has_them_are_accepted():
    kb = allocate("0.14.0", CacheConfig(2, 3, 32, 2, 8, kernel_block_size=16))
    assert (
        kvcore.detect(
            kb.gpu_cache, engine="lmdeploy", hints={"device_type": "cuda", "block_size": 32, "lmdeploy_version": "0.14.0"}
        ).block_size
        == 16
    )
    fp8 = _plain("0.14.0", quant_policy=16)
    assert kvcore.detect(fp8.gpu_cache, engine="lmdeploy", hints={"quant_policy": 16, "lmdeploy_version": "0.14.0"}).format.name == F.NHD
    camb = allocate("0.7.3", CacheConfig(2, 3, 16, 2, 8, device_type="camb"))
    assert kvcore.detect(camb.gpu_cache, engine="lmdeploy", hints={"device_type": "camb", "lmdeploy_version": "0.7.3"}).format.name == F.HND
    same = _plain()
    assert (
        kvcore.detect(
            same.gpu_cache, engine="lmdeploy", hints={"block_size": 16, "kernel_block_size": 16, "lmdeploy_version": "0.12.3"}
        ).block_size
        == 16
    )


def test_0_11_0_is_still_the_cross_layer_generation():
    """0.11.0 CacheEngine._allocate_cache: torch.empty per kind; the uint8 pool is 0.11.1's."""
    assert generation("0.11.0") == "cross_layer" and generation("0.11.1") == "pool"
    alloc = _plain("0.11.0")
    assert isinstance(alloc.full, tuple) and alloc.full[0].dtype == torch.bfloat16
    assert kvcore.detect(alloc.full, engine="lmdeploy", hints={"device_type": "cuda", "lmdeploy_version": "0.11.0"}).format.name == F.X_NHD
