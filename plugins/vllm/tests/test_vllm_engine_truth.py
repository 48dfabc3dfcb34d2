"""Engine truth: every cache vLLM's own code allocates is detected and gathered bit-exactly
against the backend's own reading (``kvcore_vllm.fixtures.kv_view``), across geometries
(NH 1, 2, 8; BS 16, 64; NB 2 and 3), and the issue-10 classes each have a named test:
the silent wrong bytes (CPU 0.24/0.26 rows, ROCm split_kv_cache, 0.11 ROCm default, 0.11
TORCH_SDPA with and without IPEX) and the caches that were refused (cross-layer pools, MLA
cross-layer, 0.26 HND cross with one KV head, DeepSeek-V3.2 under BL*, head_size 576 with
fp8_ds_mla, a manager block split into kernel blocks, 0.24/0.26 ROCM_ATTN)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from kvcore_vllm import fixtures
from kvcore_vllm.fixtures import (
    MATRIX,
    MLA_BACKENDS,
    SLOT_BACKEND_LIMITS,
    SPLIT_K,
    allocate,
    allocate_dsv32,
    blocked_views,
    case_name,
    fixture_hints,
    kv_view,
    slot_row,
)

import kvcore

GEOMS = [(nh, bs, nb) for nh in (1, 2, 8) for bs in (16, 64) for nb in (2, 3) if not (bs == 64 and nb == 3)]


def _head_size(backend: str, extra: dict | None = None) -> int:
    """576 for an MLA latent, the smallest head size B12X / ROCM_SEGMENTED_ATTN take (64), 32 for
    CPU_ATTN's AMX path (head_size % 32), else 16."""
    if (extra or {}).get("cpu_attn_isa") == "amx":
        return 32
    return 576 if backend in MLA_BACKENDS else 64 if backend in SLOT_BACKEND_LIMITS else 16


def _engine_refuses(row, bs: int, nb: int) -> str | None:
    """Why vLLM never allocates ``row`` at this geometry (the fixture raises GeometryError), or None."""
    version, backend, *_, extra = row
    if extra.get("cpu_attn_isa") == "amx" and bs % 32:
        return "vLLM CPU_ATTN takes its AMX path for block sizes that are multiples of 32 only (cpu_attn.py::_get_attn_isa)"
    if backend == "B12X" and bs not in SLOT_BACKEND_LIMITS["B12X"]["block_sizes"]:
        return "B12X runs kernel blocks of 64 or 128 tokens (b12x.py _B12X_SUPPORTED_PAGE_SIZES)"
    if extra.get("mamba_hybrid") and nb == 2 and version[:4] in ("0.11", "0.13"):
        return "_update_hybrid_attention_mamba_layout asserts shape[1] != 2: NB == 2 beside Mamba layers does not start"
    return None


def _alloc(row, nh, bs, nb, dtype=torch.bfloat16, layers=2):
    version, backend, layout, cross, fmt, extra = row
    why = _engine_refuses(row, bs, nb)
    if why:
        with pytest.raises(kvcore.GeometryError):  # the fixture refuses it as vLLM does
            allocate(version, backend, layout, num_layers=layers, num_blocks=nb, block_size=bs, num_kv_heads=nh,
                     head_size=_head_size(backend, extra), dtype=dtype, **extra)  # fmt: skip
        pytest.skip(why)
    kw = dict(extra)
    block = kw.pop("block_size", bs)
    if kw.get("kernel_block_size"):
        kw["kernel_block_size"] = bs
        block = bs * 4
    mla = backend in MLA_BACKENDS
    hs = _head_size(backend, extra)
    kv = allocate(
        version, backend, layout, num_layers=layers, num_blocks=nb, block_size=block, num_kv_heads=1 if mla else nh,
        head_size=hs, dtype=dtype, cross_layer=cross, **kw,
    )  # fmt: skip
    h = fixture_hints(version, backend, layout, "auto", dtype, extra)
    h.update(block_size=block, num_kv_heads=1 if mla else nh, head_size=hs)
    return kv, h


ROWS = [pytest.param(r, id=case_name(*r[:4], r[5])) for r in MATRIX]


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize(("nh", "bs", "nb"), GEOMS, ids=lambda v: str(v))
def test_every_row_every_geometry(row, nh, bs, nb, semantic):
    if row[1] in MLA_BACKENDS and nh != 1:
        pytest.skip("an MLA latent has one head")
    kv, h = _alloc(row, nh, bs, nb)
    lay = kvcore.detect(kv, "vllm", h)
    assert lay.format.name == row[4]
    assert (lay.num_layers, lay.block_size) == (2, bs)
    assert lay.num_blocks == nb * (4 if row[5].get("kernel_block_size") else 1)
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))


# -- the oracle is independent of detection ------------------------------------------------


def test_fixtures_import_nothing_from_detection():
    tree = ast.parse(inspect.getsource(fixtures))
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    # kvcore_vllm.writers is vLLM's own writer op (engine code), not a reading of kvcore_vllm's
    mine = {m for m in mods if m and (m.startswith("kvcore_vllm") or m.startswith("kvcore.detection") or m == "kvcore.spec")}
    assert not mine - {"kvcore_vllm.writers"}


@pytest.mark.parametrize(
    ("version", "backend", "layout", "physical"),
    [
        # physical order = (L,) + get_kv_cache_shape permuted by get_kv_cache_stride_order(True)
        ("0.13.0", "FLASH_ATTN", "NHD", ("NB", "L", "2", "BS", "NH", "HS")),
        ("0.13.0", "FLASH_ATTN", "HND", ("NB", "NH", "L", "2", "BS", "HS")),
        ("0.24.0", "FLASHINFER", "NHD", ("NB", "L", "2", "BS", "NH", "HS")),
        ("0.24.0", "FLASHINFER", "HND", ("NB", "2", "NH", "L", "BS", "HS")),
        ("0.24.0", "TRITON_ATTN", "HND", ("NB", "NH", "L", "2", "BS", "HS")),
        ("0.24.0", "FLEX_ATTENTION", "NHD", ("NB", "L", "BS", "2", "NH", "HS")),
        ("0.26.0", "FLASH_ATTN", "HND", ("NB", "NH", "L", "BS", "CS")),
        ("0.26.0", "FLASHMLA", "NHD", ("NB", "L", "BS", "HS")),
    ],
)
def test_cross_layer_physical_orders(version, backend, layout, physical):
    """Distinct sizes per axis make the buffer's physical order readable from the strides."""
    mla = backend in MLA_BACKENDS
    g = dict(num_layers=3, num_blocks=5, block_size=32, num_kv_heads=1 if mla else 4, head_size=576 if mla else 8)
    kv = allocate(version, backend, layout, cross_layer=True, **g)
    t = next(iter(kv.values()))
    size = {"NB": 5, "BS": 32, "NH": 4, "HS": 8, "2": 2, "CS": 16}
    if mla:
        size["HS"] = 576
    logical = [str(int(n)) if n == 2 else next(k for k, v in size.items() if v == n) for n in t.shape]
    by_stride = [ax for _, ax in sorted(zip(t.stride(), logical), reverse=True)]
    layer_stride = list(kv.values())[1].data_ptr() - t.data_ptr()
    pos = sum(1 for s in t.stride() if s * t.element_size() > layer_stride)
    by_stride.insert(pos, "L")
    assert tuple(by_stride) == physical


def test_use_uniform_kv_cache_refusals():
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=8)
    for version, backend in (
        ("0.11.0", "FLASH_ATTN"),
        ("0.13.0", "TRITON_ATTN"),
        ("0.13.0", "FLEX_ATTENTION"),
        ("0.24.0", "ROCM_AITER_FA"),
    ):
        with pytest.raises(kvcore.GeometryError, match="use_uniform_kv_cache"):
            allocate(version, backend, "NHD", cross_layer=True, **g)
    with pytest.raises(kvcore.GeometryError, match="use_uniform_kv_cache"):  # MLACommonBackend keeps layers first
        allocate(
            "0.24.0", "ROCM_AITER_MLA", "NHD", cross_layer=True, num_layers=2, num_blocks=3, block_size=16, num_kv_heads=1, head_size=576
        )


# -- silent wrong bytes ---------------------------------------------------------------------


def _random_fill(kv):
    g = torch.Generator().manual_seed(7)
    seen = set()
    for t in kv.values():
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        st = t.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(st)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def _slot_rows_match(lay, kv, slots, kvs=2):
    """gather == the backend's own view at each slot, row by row."""
    out = kvcore.gather(lay, torch.tensor(slots))
    for li in range(lay.num_layers):
        for k in range(kvs):
            v = kv_view(kv, li, k)
            for i, s in enumerate(slots):
                want = slot_row(v, s)
                assert torch.equal(out[k, li, i].view(torch.int16), want.view(torch.int16)), (li, k, s)


@pytest.mark.parametrize("version", ["0.24.0", "0.26.0"])
def test_cpu_attn_rows_issue_geometry(version):
    """(NB, NH, BS, 2*HS) is only the container ``view(NB, NH, 2*BS, HS).chunk(2, dim=2)`` hands the
    kernel; vLLM's CPU kernel stores per (block, head) K column-major ([HS, BS]) then V row-major
    (cpu_attn_vec.hpp; proven by vLLM's writer in tests/engine). Block size 16 takes the vec16 path
    (no AMX), so no kernel-path hint is needed. 2 layers, NB 3, BS 16, NH 2, HS 64, bf16, random bytes."""
    kv = allocate(version, "CPU_ATTN", "HND", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    _random_fill(kv)
    lay = kvcore.detect(kv, "vllm", {"device_type": "cpu", "vllm_version": version, "dtype": "bfloat16"})
    assert lay.format.name == fixtures.CPU_VEC
    _slot_rows_match(lay, kv, list(range(48)))


def test_rocm_033_split_kv_cache_issue_geometry():
    kv = allocate("0.33.0", "ROCM_ATTN", "LBHNC", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    _random_fill(kv)
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "ROCM_ATTN", "num_kv_heads": 2})
    assert lay.format.name == SPLIT_K
    _slot_rows_match(lay, kv, [5, 0, 47, 16, 31])


@pytest.mark.parametrize("version", ["0.13.0", "0.24.0", "0.26.0"])
def test_rocm_attn_split_before_033(version, semantic):
    kv = allocate(version, "ROCM_ATTN", "NHD", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    _random_fill(kv)
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "ROCM_ATTN", "vllm_version": version})
    assert lay.format.name == SPLIT_K
    _slot_rows_match(lay, kv, [5, 0, 47, 16, 31])


def test_rocm_011_default_is_unbind_and_the_variable_decides(monkeypatch, semantic):
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    monkeypatch.delenv("VLLM_V1_USE_PREFILL_DECODE_ATTENTION", raising=False)
    hints = {"attention_backend": "ROCM_ATTN", "vllm_version": "0.11.0"}
    kv = allocate("0.11.0", "ROCM_ATTN", "NHD", **g)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", hints)
    assert "VLLM_V1_USE_PREFILL_DECODE_ATTENTION" in ei.value.hints and "VLLM_V1_USE_PREFILL_DECODE_ATTENTION" in str(ei.value)
    assert {"NL_X_TWO_NB_BS_NH_HS", SPLIT_K} <= set(ei.value.candidates)
    for flag, fmt in (
        (False, "NL_X_TWO_NB_BS_NH_HS"),
        ("0", "NL_X_TWO_NB_BS_NH_HS"),
        (True, SPLIT_K),
        ("1", SPLIT_K),
    ):
        kv = allocate("0.11.0", "ROCM_ATTN", "NHD", prefill_decode_attention=flag in (True, "1"), **g)
        lay = kvcore.detect(kv, "vllm", {**hints, "VLLM_V1_USE_PREFILL_DECODE_ATTENTION": flag})
        assert lay.format.name == fmt
        semantic(lay, kv, kv_view)
    monkeypatch.setenv("VLLM_V1_USE_PREFILL_DECODE_ATTENTION", "1")  # the engine's own setting, read from its environment
    assert kvcore.detect(kv, "vllm", hints).format.name == SPLIT_K
    # vLLM's envs.py: value.lower() in ("true", "1"); anything else is False (test_prefill_decode_flag_parsed_as_vllm_does)
    assert kvcore.detect(kv, "vllm", {**hints, "VLLM_V1_USE_PREFILL_DECODE_ATTENTION": "maybe"}).format.name == "NL_X_TWO_NB_BS_NH_HS"


def test_torch_sdpa_ipex_or_not_is_never_guessed(semantic):
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    hints = {"device_type": "cpu", "vllm_version": "0.11.0", "block_size": 16, "num_kv_heads": 2}
    kv = allocate("0.11.0", "TORCH_SDPA", "NHD", **g)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", hints)
    assert "use_ipex" in ei.value.hints and "use_ipex" in str(ei.value)
    for ipex, fmt in ((True, "NL_X_TWO_NB_NH_BS_HS"), (False, SPLIT_K)):
        kv = allocate("0.11.0", "TORCH_SDPA", "NHD", use_ipex=ipex, **g)
        _random_fill(kv)
        lay = kvcore.detect(kv, "vllm", {**hints, "use_ipex": ipex})
        assert lay.format.name == fmt
        _slot_rows_match(lay, kv, [5, 0, 47, 16])
        semantic(lay, kv, kv_view)
    # vLLM refuses an fp8 cache without IPEX: the cache dtype decides
    fp8 = allocate("0.11.0", "TORCH_SDPA", "NHD", use_ipex=True, cache_dtype="fp8_e4m3", **g)
    lay = kvcore.detect(fp8, "vllm", {**hints, "cache_dtype": "fp8_e4m3"})
    assert (lay.format.name, lay.dtype) == ("NL_X_TWO_NB_NH_BS_HS", torch.float8_e4m3fn)
    semantic(lay, fp8, kv_view)


@pytest.mark.parametrize("ipex", [True, False])
@pytest.mark.parametrize(
    "given",
    [
        ("num_kv_heads", "head_size"),
        ("block_size", "head_size"),
        ("block_size", "num_kv_heads"),
        ("block_size", "num_kv_heads", "head_size"),
    ],
    ids=lambda g: "+".join(g),
)
@pytest.mark.parametrize(("bs", "nh", "hs"), [(16, 4, 32), (1, 2, 64), (3, 1, 16)])
def test_torch_sdpa_flat_row_any_two_of_three(ipex, given, bs, nh, hs, semantic):
    """0.11 TORCH_SDPA's (2, NB, BS*NH*HS): any two of block_size, num_kv_heads, head_size fix the
    third (cpu_attn.py::_PagedAttention.get_kv_cache_shape); the split is the one vLLM reads."""
    kv = allocate("0.11.0", "TORCH_SDPA", "NHD", use_ipex=ipex, num_layers=2, num_blocks=5, block_size=bs, num_kv_heads=nh, head_size=hs)
    _random_fill(kv)
    geo = {"block_size": bs, "num_kv_heads": nh, "head_size": hs}
    hints = {"vllm_version": "0.11.0", "attention_backend": "TORCH_SDPA", "use_ipex": ipex, **{k: geo[k] for k in given}}
    lay = kvcore.detect(kv, "vllm", hints)
    assert lay.format.name == ("NL_X_TWO_NB_NH_BS_HS" if ipex else SPLIT_K)
    assert (lay.block_size, lay.num_heads, lay.head_size) == (bs, nh, hs)
    _slot_rows_match(lay, kv, [0, bs * 5 - 1, bs * 2 + bs // 2])
    semantic(lay, kv, kv_view)


def test_torch_sdpa_flat_row_refuses_what_does_not_divide():
    kv = allocate("0.11.0", "TORCH_SDPA", "NHD", use_ipex=True, num_layers=2, num_blocks=5, block_size=16, num_kv_heads=4, head_size=32)
    base = {"vllm_version": "0.11.0", "attention_backend": "TORCH_SDPA", "use_ipex": True}
    with pytest.raises(kvcore.DetectionError, match=r"num_kv_heads=3 \* head_size=32 = 96 does not divide the 2048") as ei:
        kvcore.detect(kv, "vllm", {**base, "num_kv_heads": 3, "head_size": 32})
    assert "block_size" in str(ei.value) and not isinstance(ei.value, kvcore.AmbiguousLayoutError)
    with pytest.raises(kvcore.DetectionError, match="does not divide"):
        kvcore.detect(kv, "vllm", {**base, "block_size": 24, "head_size": 32})
    with pytest.raises(kvcore.DetectionError, match=r"block_size=16 \* num_kv_heads=4 \* head_size=16 = 1024, but each block holds 2048"):
        kvcore.detect(kv, "vllm", {**base, "block_size": 16, "num_kv_heads": 4, "head_size": 16})
    with pytest.raises(kvcore.DetectionError, match="needs block_size or num_kv_heads"):  # one of three: not enough
        kvcore.detect(kv, "vllm", {**base, "head_size": 32})


# -- real caches that were refused ------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "backend", "layout", "fmt"),
    [
        ("0.24.0", "FLASHINFER", "NHD", "NB_NL_TWO_BS_NH_HS"),
        ("0.24.0", "FLASHINFER", "HND", "NB_TWO_NH_NL_BS_HS"),
        ("0.24.0", "TRITON_ATTN", "NHD", "NB_NL_TWO_BS_NH_HS"),
        ("0.24.0", "TRITON_ATTN", "HND", "NB_NH_NL_TWO_BS_HS"),
        ("0.24.0", "FLEX_ATTENTION", "NHD", "NB_NL_BS_TWO_NH_HS"),
        ("0.13.0", "FLASHMLA", "NHD", "NB_NL_BS_HS"),
        ("0.24.0", "TRITON_MLA", "NHD", "NB_NL_BS_HS"),
        ("0.26.0", "CUTLASS_MLA", "NHD", "NB_NL_BS_HS"),
        ("0.26.0", "FLASH_ATTN", "HND", "NB_NH_NL_BS_CS"),
    ],
)
@pytest.mark.parametrize("nh", [1, 2, 8])
def test_cross_layer_pools_with_the_engines_hints(version, backend, layout, fmt, nh, semantic):
    mla = backend in MLA_BACKENDS
    if mla and nh != 1:
        pytest.skip("MLA: one head")
    kv = allocate(version, backend, layout, cross_layer=True, num_layers=3, num_blocks=3, block_size=16, num_kv_heads=nh,
                  head_size=576 if mla else 16)  # fmt: skip
    hints = {"vllm_version": version, "attention_backend": backend}
    if not mla:
        hints["kv_cache_layout"] = layout  # the engine's get_kv_cache_layout(): never a contradiction, also at NH = 1
    lay = kvcore.detect(kv, "vllm", hints)
    assert (lay.format.name, lay.num_layers, lay.num_heads) == (fmt, 3, nh)
    assert lay.format.container == "cross_layer"
    semantic(lay, kv, kv_view)
    # from the strides alone (at NH = 1 the NHD and HND names move the same bytes: either is right)
    bare = kvcore.detect(kv, "vllm", {"vllm_version": version} if not mla else None)
    assert bare.format.name == fmt or nh == 1
    semantic(bare, kv, kv_view, seed=2)


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla"])
def test_dsv32_mla_and_indexer_share_one_buffer(layout, cache_dtype, semantic):
    mla, idx = allocate_dsv32(layout, num_layers=3, num_blocks=2, block_size=64, cache_dtype=cache_dtype)
    assert next(iter(mla.values())).untyped_storage().data_ptr() == next(iter(idx.values())).untyped_storage().data_ptr()
    _random_fill(mla)
    # the engine's own hints: model_config.get_head_size() is 576 also for the 656 B fp8_ds_mla record
    h = {"vllm_version": "0.33.0", "attention_backend": "FLASHMLA_SPARSE", "kv_cache_layout": layout, "head_size": 576,
         "cache_dtype": cache_dtype, "block_size": 64}  # fmt: skip
    lay = kvcore.detect(mla, "vllm", h)
    assert lay.format.name == ("NB_NL_BS_HS" if layout[0] == "B" else "NL_X_NB_BS_HS")
    assert lay.head_size == (656 if cache_dtype == "fp8_ds_mla" else 576)
    semantic(lay, mla, kv_view)
    ilay = kvcore.detect(idx, "vllm", {"vllm_version": "0.33.0", "attention_backend": "FLASHMLA_SPARSE", "kv_cache_layout": layout})
    assert ilay.format.name == ("NB_NL_BSV_BSS" if layout[0] == "B" else "NL_X_NB_BSV_BSS")
    out = kvcore.gather(ilay, torch.tensor([3, 64, 127]))
    for li in range(3):
        vals, scales = blocked_views(idx, li)
        for i, s in enumerate([3, 64, 127]):
            assert torch.equal(out[0, li, i], torch.cat([vals[s // 64, s % 64], scales[s // 64, s % 64]]))
    # both groups in one dict, as the runner keeps them
    per = kvcore.detect_per_layer(
        {**mla, **idx}, "vllm", hints={"vllm_version": "0.33.0", "attention_backend": "FLASHMLA_SPARSE", "cache_dtype": cache_dtype}
    )
    assert list(per) == [*mla, *idx]  # a dict in: the same keys out
    assert {x.format.name for x in per.values()} == {lay.format.name, ilay.format.name}


@pytest.mark.parametrize("version", ["0.11.0", "0.33.0"])
def test_fp8_ds_mla_head_size_576_is_the_engines_truth(version, semantic):
    layout = "LBNHC" if version == "0.33.0" else "NHD"
    kv = allocate(version, "FLASHMLA_SPARSE", layout, num_layers=2, num_blocks=2, block_size=64, num_kv_heads=1, head_size=576,
                  cache_dtype="fp8_ds_mla")  # fmt: skip
    lay = kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_ds_mla", "head_size": 576, "vllm_version": version})
    assert (lay.format.name, lay.head_size, lay.dtype) == ("NL_X_NB_BS_HS", 656, torch.uint8)
    semantic(lay, kv, kv_view)
    with pytest.raises(kvcore.DetectionError):  # 576 with a plain cache dtype is not a 656 B record
        kvcore.detect(kv, "vllm", {"cache_dtype": "auto", "head_size": 576, "vllm_version": version, "attention_backend": "FLASHMLA"})


@pytest.mark.parametrize(
    ("version", "backend", "layout", "fmt"),
    [
        ("0.33.0", "FLASH_ATTN", "LBNHC", "NL_X_NB_BS_NH_CS"),
        ("0.33.0", "FLASH_ATTN", "LBHNC", "NL_X_NB_NH_BS_CS"),
        ("0.33.0", "CPU_ATTN", "LBHNC", fixtures.CPU_VEC),
        ("0.24.0", "FLASH_ATTN", "NHD", "NL_X_NB_TWO_BS_NH_HS"),
        ("0.26.0", "FLASH_ATTN", "HND", "NL_X_NB_NH_BS_CS"),
    ],
)
def test_manager_block_size_split_into_kernel_blocks(version, backend, layout, fmt, semantic):
    kv = allocate(version, backend, layout, num_layers=2, num_blocks=2, block_size=64, kernel_block_size=16, num_kv_heads=2, head_size=16)
    hints = {"vllm_version": version, "attention_backend": backend, "kv_cache_layout": layout, "block_size": 64}
    if backend == "CPU_ATTN":
        hints.update(device_type="cpu", cpu_attn_isa="vec16")  # bfloat16 blocks of 16: vec16 (Arm's BFMMLA tiles otherwise)
    lay = kvcore.detect(kv, "vllm", hints)  # cache_config.block_size 64: the kernel reads blocks of 16
    assert (lay.format.name, lay.block_size, lay.num_blocks) == (fmt, 16, 8)
    assert "kernel" in lay.note or "manager" in lay.note
    semantic(lay, kv, kv_view)


def test_kernel_blocks_need_dense_pages():
    with pytest.raises(kvcore.GeometryError, match="dense"):
        allocate(
            "0.33.0", "FLASH_ATTN", "BLNHC", num_layers=2, num_blocks=2, block_size=64, kernel_block_size=16, num_kv_heads=2, head_size=16
        )


# -- multi-plane names: K and V of different orders ---------------------------------------------


SPLIT_ROWS = [pytest.param(r, id=case_name(*r[:4], r[5])) for r in MATRIX if r[4] == SPLIT_K]


def test_the_cpu_kernel_rows():
    """vLLM CPU_ATTN rows are named by the kernel's packing, per kernel path, from 0.13."""
    rows = {case_name(*r[:4], r[5]): r[4] for r in MATRIX if r[1] == "CPU_ATTN"}
    assert set(rows.values()) == {fixtures.CPU_VEC, fixtures.CPU_AMX}
    assert {n.split("-")[1] for n in rows} == {"0.13", "0.24", "0.26", "0.29"}


def test_the_split_rows():
    """0.11 ROCM_ATTN with the variable on, ROCM_ATTN 0.13 / 0.24 / 0.26, 0.33 LBHNC and LHBNC,
    0.11 TORCH_SDPA without IPEX: every allocation vLLM reads through split_kv_cache; and those of
    them that sit beside Mamba layers restrided (0.11 / 0.13 every (2, NB, ...) tensor, 0.24 / 0.26
    ROCM_ATTN, whose block dim is 1). 0.33 ROCM_SEGMENTED_ATTN shares ROCM_ATTN's head slots but
    reads them token-major: not a split row."""
    ids = {case_name(*r[:4], r[5]) for r in MATRIX if r[4] == SPLIT_K}
    assert ids == {
        "vllm-0.11-ROCM_ATTN-NHD-prefill_decode",
        "vllm-0.13-ROCM_ATTN-NHD",
        "vllm-0.24-ROCM_ATTN-NHD",
        "vllm-0.26-ROCM_ATTN-NHD",
        "vllm-0.29-ROCM_ATTN-LBHNC",
        "vllm-0.29-ROCM_ATTN-LHBNC",
        "vllm-0.11-TORCH_SDPA-NHD-noipex",
        "vllm-0.11-ROCM_ATTN-NHD-prefill_decode-mamba",
        "vllm-0.11-TORCH_SDPA-NHD-noipex-mamba",
        "vllm-0.13-ROCM_ATTN-NHD-mamba",
        "vllm-0.24-ROCM_ATTN-NHD-mamba",
        "vllm-0.26-ROCM_ATTN-NHD-mamba",
    }


@pytest.mark.parametrize("row", SPLIT_ROWS)
@pytest.mark.parametrize(("nh", "bs", "nb"), [(1, 16, 2), (2, 16, 3), (8, 64, 2)], ids=lambda v: str(v))
def test_split_k_layouts_get_multi_plane_names(row, nh, bs, nb, semantic):
    """Detection builds K ``(B, NH, HS/x, N, x)`` and V ``(B, NH, HS, N)`` from the engine's own
    tensors (views, never copies), stages classic ``[2, NL, T, NH*HS]``, and every byte is the
    one vLLM's split_kv_cache reads (random bytes, row by row, and the semantic check)."""
    kv, h = _alloc(row, nh, bs, nb)
    lay = kvcore.detect(kv, "vllm", h)
    assert lay.format.name == SPLIT_K and lay.format.container == "planes"
    assert [p.role for p in lay.planes] == ["K", "V"] and lay.classic_staging
    assert (lay.num_heads, lay.head_size, lay.block_size, lay.num_blocks, lay.kv_size) == (nh, 16, bs, nb, 2)
    x = 16 // 2  # bf16: 16-byte K chunks of 8 elements
    k0, v0 = lay.kv_caches["K"][0], lay.kv_caches["V"][0]
    assert tuple(k0.shape) == (nb, nh, 16 // x, bs, x) and tuple(v0.shape) == (nb, nh, 16, bs)
    storages = {t.untyped_storage().data_ptr() for t in kv.values()}
    assert all(t.untyped_storage().data_ptr() in storages for r in ("K", "V") for t in lay.kv_caches[r])
    assert lay.staging_shapes(5) == {"kv": (2, 2, 5, nh * 16)}  # classic: one [2, NL, T, NH*HS] buffer
    _random_fill(kv)
    _slot_rows_match(lay, kv, [0, bs - 1, bs, nb * bs - 1, 3])
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8], ids=str)
def test_split_k_chunk_follows_the_element_size(dtype, semantic):
    """x = 16 // element_size: 8 fp16, 4 fp32, 16 uint8 (fp8 storage) elements per K chunk."""
    cd = "fp8_e4m3" if dtype == torch.uint8 else "auto"
    kv = allocate("0.24.0", "ROCM_ATTN", "NHD", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=32,
                  dtype=dtype, cache_dtype=cd)  # fmt: skip
    h = {"attention_backend": "ROCM_ATTN", "vllm_version": "0.24", "cache_dtype": cd}
    if dtype == torch.uint8:
        h["dtype"] = "float8_e4m3fnuz"  # the platform's fp8 (gfx94x), as vLLM's RocmPlatform.fp8_dtype() gives it
    lay = kvcore.detect(kv, "vllm", h)
    x = 16 // torch.empty(0, dtype=dtype).element_size()
    assert lay.format.name == SPLIT_K and lay.kv_caches["K"][0].shape[-1] == x
    assert lay.dtype == (torch.float8_e4m3fnuz if dtype == torch.uint8 else dtype)
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p, dtype=lay.dtype))


def test_split_k_refuses_a_head_the_chunks_do_not_divide():
    # vLLM's view(num_blocks, num_kv_heads, head_size // x, -1, x) needs x | head_size: bf16 x = 8, head_size 12
    kv = allocate("0.24.0", "ROCM_ATTN", "NHD", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=12)
    with pytest.raises(kvcore.DetectionError):
        kvcore.detect(kv, "vllm", {"attention_backend": "ROCM_ATTN", "vllm_version": "0.24"})


def test_rocm_033_byte_views_need_the_element_dtype(semantic):
    """0.33 int8 byte views: V's tokens are one element apart, so the split reading needs the
    element size (``dtype``); with it, the planes are the element-dtype views of the caller's bytes."""
    kv = allocate("0.33.0", "ROCM_ATTN", "LHBNC", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=16,
                  byte_views=True)  # fmt: skip
    assert next(iter(kv.values())).dtype == torch.int8
    h = {"attention_backend": "ROCM_ATTN", "num_kv_heads": 2}
    with pytest.raises(kvcore.DetectionError, match="dtype"):
        kvcore.detect(kv, "vllm", h)
    lay = kvcore.detect(kv, "vllm", {**h, "dtype": "bfloat16"})
    assert (lay.format.name, lay.dtype, lay.head_size) == (SPLIT_K, torch.bfloat16, 16)
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))


def test_split_k_tensors_on_a_rocm_build_need_the_backend(monkeypatch):
    """Tensors of a ROCm process (torch.version.hip): a (2, NB, BS, NH, HS) cache is ROCM_ATTN's
    split layout or an AITER/FlashAttention unbind: the backend decides, never a guess."""
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    kv = allocate("0.13.0", "ROCM_ATTN", "NHD", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=16)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", {"vllm_version": "0.13", "kv_cache_layout": "NHD"})
    assert SPLIT_K in ei.value.candidates and "attention_backend" in ei.value.hints
    assert kvcore.detect(kv, "vllm", {"vllm_version": "0.13", "attention_backend": "ROCM_ATTN"}).format.name == SPLIT_K


@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize(("nh", "hs"), [(1, 8), (3, 16)])
def test_split_k_one_or_odd_tokens_per_block(bs, nh, hs, semantic):
    """0.11 TORCH_SDPA takes any block size: one token per block (the K chunks and the V column
    are then contiguous) and odd block sizes move the bytes split_kv_cache reads."""
    kv = allocate("0.11.0", "TORCH_SDPA", "NHD", num_layers=2, num_blocks=5, block_size=bs, num_kv_heads=nh, head_size=hs)
    h = {"device_type": "cpu", "use_ipex": False, "block_size": bs, "num_kv_heads": nh, "vllm_version": "0.11"}
    lay = kvcore.detect(kv, "vllm", h)
    assert (lay.format.name, lay.block_size, lay.num_heads, lay.head_size) == (SPLIT_K, bs, nh, hs)
    semantic(lay, kv, kv_view)
