"""Attention caches beside Mamba layers, restrided by vLLM's runner.

vLLM 0.11 / 0.13 ``v1/worker/gpu_model_runner.py::_update_hybrid_attention_mamba_layout`` restrides
every attention tensor whose ``shape[0] == 2`` to strides ``(hidden, 2*hidden, *strides[2:])`` (a
block's K and V sides adjacent); ``cpu_model_runner.py::CPUModelRunner`` inherits it and every
platform's ``support_hybrid_kv_cache()`` is True, so vLLM CPU's caches (0.11 TORCH_SDPA's ``(2, NB,
BS*NH*HS)``, 0.13 CPU_ATTN's ``(2, NB, NH, BS, HS)``) are restrided as FlashAttention's are. 0.24 /
0.26 restride only backends whose ``get_kv_cache_block_dim`` is 1 (``ROCM_ATTN``); 0.33 has no
such step. The engine side is :func:`kvcore_vllm.fixtures.kv_view` (the backends' ``unbind(0)`` /
``split_kv_cache`` / ``view(...)`` of the restrided tensor).
"""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import (
    _ERA_BACKENDS,
    CPU_AMX,
    CPU_VEC,
    MLA_BACKENDS,
    SPLIT_K,
    allocate,
    fixture_hints,
    kv_cache_stride_order,
    kv_view,
)

import kvcore

G = dict(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=4, head_size=32)


def _random_fill(kv) -> None:
    g = torch.Generator().manual_seed(5)
    for st in {id(t.untyped_storage()): t.untyped_storage() for t in kv.values()}.values():
        raw = torch.empty(0, dtype=torch.uint8).set_(st)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def _rows_match(lay, kv, slots) -> None:
    """gather == the backend's own reading, row by row (random bytes), and scatter lands there."""
    out = kvcore.gather(lay, torch.tensor(slots))
    for li in range(lay.num_layers):
        for p in (0, 1):
            v = kv_view(kv, li, p)
            bs = v.shape[1]
            for i, s in enumerate(slots):
                want = v[s // bs, s % bs].reshape(-1).contiguous().view(torch.uint8)
                assert torch.equal(out[p, li, i].view(torch.uint8), want), (li, p, s)
    fresh = torch.empty_like(out)
    fresh.view(torch.uint8).copy_(torch.randint(0, 256, fresh.view(torch.uint8).shape, dtype=torch.uint8))
    kvcore.scatter(lay, torch.tensor(slots[::-1]), fresh)
    for li in range(lay.num_layers):
        for p in (0, 1):
            v = kv_view(kv, li, p)
            bs = v.shape[1]
            for i, s in enumerate(slots[::-1]):
                got = v[s // bs, s % bs].reshape(-1).contiguous().view(torch.uint8)
                assert torch.equal(got, fresh[p, li, i].view(torch.uint8)), (li, p, s)


def _variants():
    """Every per-layer allocation of 0.11-0.26 the fixture knows (MLA and Pallas aside: no
    (2, NB, ...) tensor, no GPU runner), with each run-time setting that changes the reading."""
    out = []
    for version, era in (("0.11.0", "0.11"), ("0.13.0", "0.13"), ("0.24.0", "0.24"), ("0.26.0", "0.26")):
        for backend in sorted(_ERA_BACKENDS[era]):
            if backend in MLA_BACKENDS or backend in ("PALLAS", "INDEXER"):
                continue
            # a backend whose get_kv_cache_stride_order does not read get_kv_cache_layout() (none, or a fixed
            # one: 0.24 / 0.26 FlexAttention) allocates one physical order, whatever the layout says
            ordered = kv_cache_stride_order(era, backend, "HND", False) != kv_cache_stride_order(era, backend, "NHD", False)
            for layout in ("NHD", "HND") if ordered else ("*",):
                extras = [{}]
                if backend == "TORCH_SDPA":
                    extras = [{"use_ipex": True}, {"use_ipex": False}]
                if backend == "ROCM_ATTN" and era == "0.11":
                    extras = [{"prefill_decode_attention": True}, {"prefill_decode_attention": False}]
                out += [pytest.param(version, backend, layout, x, id=f"{version}-{backend}-{layout}-{x}") for x in extras]
    return out


@pytest.mark.parametrize(("version", "backend", "layout", "extra"), _variants())
def test_every_allocation_beside_mamba_reads_as_the_engine(version, backend, layout, extra):
    """The whole class: every version/backend/layout allocated beside Mamba layers is detected with
    the hints vLLM knows and moves exactly the bytes the backend reads (restrided or not)."""
    lay_name = "NHD" if layout == "*" else layout
    kv = allocate(version, backend, lay_name, mamba_hybrid=True, **G, **extra)
    plain = allocate(version, backend, lay_name, **G, **extra)
    t, p = next(iter(kv.values())), next(iter(plain.values()))
    restrided = t.stride() != p.stride()
    era = version[:4]
    # vLLM restrides (2, NB, ...) in 0.11 / 0.13; from 0.24 only a block dim of 1 (ROCM_ATTN)
    assert restrided == (t.shape[0] == 2 if era in ("0.11", "0.13") else backend == "ROCM_ATTN")
    if restrided:
        hidden = t[0, 0].numel()
        assert t.stride()[:2] == (hidden, 2 * hidden)
    _random_fill(kv)
    h = fixture_hints(version, backend, lay_name, "auto", torch.bfloat16, extra)
    if layout == "*":
        del h["kv_cache_layout"]  # the backend's get_kv_cache_shape order is its only one
    h.update(block_size=G["block_size"], num_kv_heads=G["num_kv_heads"], head_size=G["head_size"])
    lay = kvcore.detect(kv, "vllm", h)
    if restrided and lay.format.name not in (SPLIT_K, CPU_VEC, CPU_AMX):  # the CPU kernel packs each side its own way
        assert lay.format.name.startswith("NL_X_NB_TWO_")  # a block's K side, then its V side
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (5, 16, 4, 32)
    _rows_match(lay, kv, [0, 15, 16, 79, 41])


def test_cpu_attn_013_beside_mamba_is_never_read_as_flash_attention():
    """The review's case: 0.13 CPU_ATTN (2, NB, NH, BS, HS) restrided has FlashAttention-beside-Mamba's
    strides with heads and tokens swapped. A CPU tensor may be either: without a hint that decides,
    an AmbiguousLayoutError naming them; each one decides, and the answer is the engine's bytes."""
    # float16: no tiled CPU path (AMX, NEON BFMMLA) can have packed it, so the platform alone decides
    kv = allocate(
        "0.13.0", "CPU_ATTN", "HND", num_layers=3, num_blocks=5, block_size=16, num_kv_heads=4, head_size=32, mamba_hybrid=True,
        dtype=torch.float16,
    )  # fmt: skip
    t = next(iter(kv.values()))
    assert tuple(t.shape) == (2, 5, 4, 16, 32) and t.stride() == (2048, 4096, 512, 32, 1)
    _random_fill(kv)
    for hints in ({}, {"vllm_version": "0.13.0"}):
        with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
            kvcore.detect(kv, "vllm", hints)
        assert {"NL_X_NB_TWO_BS_NH_HS", CPU_VEC} == set(ei.value.candidates)
        assert {"attention_backend", "device_type", "num_kv_heads", "block_size"} <= set(ei.value.hints)
    for hints in ({"device_type": "cpu"}, {"attention_backend": "CPU_ATTN"}, {"vllm_version": "0.13.0", "num_kv_heads": 4},
                  {"block_size": 16}):  # fmt: skip
        lay = kvcore.detect(kv, "vllm", hints)
        assert (lay.format.name, lay.block_size, lay.num_heads) == (CPU_VEC, 16, 4), hints  # K column-major per side
        _rows_match(lay, kv, [0, 17, 33, 79, 64, 3])
    # the GPU's reading is a different cache: the platform says so, never the shape
    fa = kvcore.detect(kv, "vllm", {"device_type": "cuda"})
    assert (fa.format.name, fa.block_size, fa.num_heads) == ("NL_X_NB_TWO_BS_NH_HS", 4, 16)


def test_torch_sdpa_ipex_beside_mamba():
    """0.11 TORCH_SDPA with IPEX beside Mamba layers: per block the K side's (NH, BS, HS), then the
    V side's. Without use_ipex the split_kv_cache reading (which reads the restrided strides too) fits."""
    g = dict(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=4, head_size=32)
    hints = {"device_type": "cpu", "vllm_version": "0.11.0", "num_kv_heads": 4, "head_size": 32}
    for ipex, fmt in ((True, "NL_X_NB_TWO_NH_BS_HS"), (False, SPLIT_K)):
        kv = allocate("0.11.0", "TORCH_SDPA", "NHD", mamba_hybrid=True, use_ipex=ipex, **g)
        _random_fill(kv)
        with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
            kvcore.detect(kv, "vllm", hints)
        assert "use_ipex" in ei.value.hints
        lay = kvcore.detect(kv, "vllm", {**hints, "use_ipex": ipex})
        assert lay.format.name == fmt
        _rows_match(lay, kv, [0, 15, 16, 79])


def test_rocm_011_unified_beside_mamba():
    kv = allocate("0.11.0", "ROCM_ATTN", "NHD", mamba_hybrid=True, prefill_decode_attention=False, **G)
    _random_fill(kv)
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "ROCM_ATTN", "vllm_version": "0.11", "VLLM_V1_USE_PREFILL_DECODE_ATTENTION": "0"})
    assert lay.format.name == "NL_X_NB_TWO_BS_NH_HS"
    _rows_match(lay, kv, [0, 15, 16, 79])


def test_the_fixture_restrides_only_where_vllm_does():
    with pytest.raises(kvcore.GeometryError, match=r"shape\[1\] != 2"):  # vLLM's assert: NB == 2 is (2, 2, ...)
        allocate("0.13.0", "CPU_ATTN", "HND", mamba_hybrid=True, **{**G, "num_blocks": 2})
    with pytest.raises(kvcore.GeometryError, match="create_kv_cache_views"):
        allocate("0.33.0", "CPU_ATTN", "LBHNC", mamba_hybrid=True, **G)
    with pytest.raises(kvcore.GeometryError):
        allocate("0.13.0", "FLASH_ATTN", "NHD", mamba_hybrid=True, cross_layer=True, **G)
    fi = allocate("0.24.0", "FLASHINFER", "NHD", mamba_hybrid=True, **G)  # (NB, 2, ...): block dim 0, untouched
    assert next(iter(fi.values())).is_contiguous()
    # 0.24 ROCM_ATTN's (2, NB, ...) is restrided even with NB == 2 (get_kv_cache_block_dim, no assert)
    rocm = allocate("0.24.0", "ROCM_ATTN", "NHD", mamba_hybrid=True, **{**G, "num_blocks": 2})
    t = next(iter(rocm.values()))
    assert t.stride()[:2] == (t[0, 0].numel(), 2 * t[0, 0].numel())
