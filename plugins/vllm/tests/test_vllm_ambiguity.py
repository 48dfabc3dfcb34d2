"""Shape alone never decides: each pair of layouts that share a shape raises
AmbiguousLayoutError without a deciding hint, and the hint resolves it (checked
semantically: the resolved layout gathers the values vLLM's own view wrote)."""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import CPU_AMX, CPU_VEC, SPLIT_K, allocate, kv_view

import kvcore


def _ambiguous(kv, hints, *names, deciding=()):
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", hints)
    assert set(names) <= set(ei.value.candidates)
    for k in deciding:
        assert k in ei.value.hints
        assert k in str(ei.value)
    return ei.value


def test_nb2_fa_vs_blocks_first(semantic):
    g = dict(num_layers=2, num_blocks=2, block_size=16, num_kv_heads=3, head_size=8)
    fa = allocate("0.11.0", "FLASH_ATTN", "NHD", **g)
    nhd = {"kv_cache_layout": "NHD"}  # the tensors are contiguous: without it an HND cache in memory order fits too
    _ambiguous(fa, nhd, "NL_X_TWO_NB_BS_NH_HS", "NL_X_NB_TWO_BS_NH_HS", deciding=("attention_backend", "vllm_version"))
    # FLASH_ATTN alone is not enough: 0.24's FlashAttention is blocks-first
    _ambiguous(fa, {**nhd, "attention_backend": "FLASH_ATTN"}, "NL_X_TWO_NB_BS_NH_HS", "NL_X_NB_TWO_BS_NH_HS", deciding=("vllm_version",))
    lay = kvcore.detect(fa, "vllm", {**nhd, "attention_backend": "FLASH_ATTN", "vllm_version": "0.11.0"})
    assert lay.format.name == "NL_X_TWO_NB_BS_NH_HS" and lay.num_blocks == 2
    semantic(lay, fa, kv_view)
    fi = allocate("0.11.0", "FLASHINFER", "NHD", **g)
    lay = kvcore.detect(fi, "vllm", {**nhd, "attention_backend": "FLASHINFER"})
    assert lay.format.name == "NL_X_NB_TWO_BS_NH_HS"
    semantic(lay, fi, kv_view)
    v24 = allocate("0.24.0", "FLASH_ATTN", "NHD", **g)
    lay = kvcore.detect(v24, "vllm", {**nhd, "vllm_version": "0.24.1"})
    assert lay.format.name == "NL_X_NB_TWO_BS_NH_HS"
    semantic(lay, v24, kv_view)


def test_nh1_mla_view_vs_one_kv_head(semantic):
    mha = allocate("0.33.0", "FLASH_ATTN", "LBHNC", num_layers=2, num_blocks=5, block_size=4, num_kv_heads=1, head_size=288)
    err = _ambiguous(mha, None, "NL_X_NB_BS_HS", deciding=("attention_backend", "head_size"))
    assert "576" in str(err) and {"NL_X_NB_NH_BS_CS", "NL_X_NB_BS_NH_CS"} & set(err.candidates)
    # head_size decides MLA vs one head; the platform (CUDA here) rules out CPU_ATTN's rows reading of the same shape
    for hints in ({"attention_backend": "FLASH_ATTN"}, {"head_size": 288, "device_type": "cuda"}):
        lay = kvcore.detect(mha, "vllm", {**hints, "kv_cache_layout": "LBHNC"})
        assert (lay.format.name, lay.kv_size, lay.num_heads, lay.head_size) == ("NL_X_NB_NH_BS_CS", 2, 1, 288)
        semantic(lay, mha, kv_view)
    mla = allocate("0.33.0", "FLASHMLA", "LBNHC", num_layers=2, num_blocks=5, block_size=4, num_kv_heads=1, head_size=576)
    _ambiguous(mla, None, "NL_X_NB_BS_HS")
    for hints in ({"attention_backend": "FLASHMLA"}, {"head_size": 576}, {"attention_backend": "TRITON_MLA", "vllm_version": "0.33.0"}):
        lay = kvcore.detect(mla, "vllm", hints)
        assert (lay.format.name, lay.kv_size, lay.num_heads, lay.head_size) == ("NL_X_NB_BS_HS", 1, 1, 576)
        semantic(lay, mla, kv_view)


def test_bs_equals_nh_without_stride_evidence(semantic):
    g = dict(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=16, head_size=8)
    nhd = allocate("0.11.0", "FLASH_ATTN", "NHD", **g)  # contiguous: also an HND tensor already in physical order
    _ambiguous(nhd, None, "NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS", deciding=("kv_cache_layout",))
    lay = kvcore.detect(nhd, "vllm", {"kv_cache_layout": "NHD"})
    assert lay.format.name == "NL_X_TWO_NB_BS_NH_HS"
    semantic(lay, nhd, kv_view)
    # on a GPU an HND hint alone contradicts the strides (they show vLLM's NHD allocation) ...
    with pytest.raises(kvcore.DetectionError, match="tensor_order='physical'"):
        kvcore.detect(nhd, "vllm", {"kv_cache_layout": "HND", "device_type": "cuda"})
    # where the platform may be CPU, vLLM 0.13 CPU_ATTN allocates exactly this (2, NB, NH, BS, HS) HND tensor and its
    # kernel packs K column-major: another placement of the bytes, which the platform decides
    _ambiguous(nhd, {"kv_cache_layout": "HND"}, "NL_X_TWO_NB_NH_BS_HS", CPU_VEC, deciding=("attention_backend", "device_type"))
    cpu = allocate("0.13.0", "CPU_ATTN", "HND", **g)  # the same shape and strides, as vLLM 0.13 CPU allocates it
    # (bfloat16 on Arm may be NEON BFMMLA tiles: the kernel path decides; block 16 is vec16 on x86)
    lay = kvcore.detect(cpu, "vllm", {"kv_cache_layout": "HND", "device_type": "cpu", "cpu_attn_isa": "vec16"})
    assert lay.format.name == CPU_VEC
    semantic(lay, cpu, kv_view)
    # ... or the caller says the tensor was already permuted into memory order (a GPU reading)
    lay = kvcore.detect(nhd, "vllm", {"kv_cache_layout": "HND", "tensor_order": "physical", "device_type": "cuda"})
    assert lay.format.name == "NL_X_TWO_NB_NH_BS_HS"
    assert lay.stride_table().planes[0].head == 16 * 8 * 2  # heads are now the outer axis
    # vLLM's own HND allocation: the strides decide, no hint needed
    hnd = allocate("0.11.0", "FLASH_ATTN", "HND", **g)
    lay = kvcore.detect(hnd, "vllm")
    assert lay.format.name == "NL_X_TWO_NB_NH_BS_HS"
    semantic(lay, hnd, kv_view)


def test_cpu_rows_are_one_layout_from_024_to_033(semantic):
    """vLLM 0.24-0.33 CPU_ATTN: (NB, NH, BS, 2*HS) is the container view(NB, NH, 2*BS, HS).chunk(2,
    dim=2) hands the kernel, which stores K column-major, then V (cpu_attn_vec.hpp): one layout
    per kernel path, never the GPU's packed [K | V] row. Block size 4 rules AMX out: no path hint."""
    g = dict(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8)
    for version in ("0.24.0", "0.26.0"):
        kv = allocate(version, "CPU_ATTN", "HND", **g)
        lay = kvcore.detect(kv, "vllm", {"device_type": "cpu", "cpu_attn_isa": "vec16"})
        assert lay.format.name == CPU_VEC
        semantic(lay, kv, kv_view)
    v33 = allocate("0.33.0", "CPU_ATTN", "LBHNC", **g)
    with pytest.raises(kvcore.AmbiguousLayoutError, match="BFMMLA"):  # bfloat16: Arm's tiles are a possibility
        kvcore.detect(v33, "vllm", {"attention_backend": "CPU_ATTN", "vllm_version": "0.33.0"})
    lay = kvcore.detect(v33, "vllm", {"attention_backend": "CPU_ATTN", "vllm_version": "0.33.0", "cpu_attn_isa": "vec16"})
    assert lay.format.name == CPU_VEC
    semantic(lay, v33, kv_view)
    # a bfloat16 cache with blocks and heads of 32: vLLM's AMX path may have packed it (on a CPU with AMX tiles)
    amx = allocate("0.33.0", "CPU_ATTN", "LBHNC", num_layers=2, num_blocks=3, block_size=32, num_kv_heads=2, head_size=32)
    _ambiguous(amx, {"device_type": "cpu"}, CPU_VEC, CPU_AMX, deciding=("cpu_attn_isa",))
    for isa, name in (("vec", CPU_VEC), ("amx", CPU_AMX)):
        lay = kvcore.detect(amx, "vllm", {"device_type": "cpu", "cpu_attn_isa": isa})
        assert lay.format.name == name
        semantic(lay, amx, lambda k, layer, p, isa=isa: kv_view(k, layer, p, hints={"cpu_attn_isa": isa}))


def test_nh2_packed_gpu_is_not_ambiguous_across_gpu_versions():
    # 0.26 (NB, NH, BS, 2*HS) and 0.33 [NB, NH, BS, C] place bytes identically: one answer
    kv = allocate("0.26.0", "FLASH_ATTN", "HND", num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)
    # contiguous: as allocated, not an NHD cache in memory order; on a GPU (CPU_ATTN reads this shape as K rows, V rows)
    lay = kvcore.detect(kv, "vllm", {"tensor_order": "allocated", "device_type": "cuda"})
    assert (lay.format.name, lay.num_heads, lay.head_size) == ("NL_X_NB_NH_BS_CS", 2, 8)


def test_hint_contradicting_strides_is_an_error():
    hnd = allocate("0.11.0", "FLASHINFER", "HND", num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)
    with pytest.raises(kvcore.DetectionError) as ei:
        kvcore.detect(hnd, "vllm", {"kv_cache_layout": "NHD"})
    assert not isinstance(ei.value, kvcore.AmbiguousLayoutError)
    assert "NHD" in str(ei.value) and "HND" in str(ei.value)
    with pytest.raises(kvcore.DetectionError, match="device_type='xpu \\(forces NHD in vLLM 0.11-0.24\\)'"):
        kvcore.detect(hnd, "vllm", {"device_type": "xpu"})
    v33 = allocate("0.33.0", "FLASH_ATTN", "BLNHC", num_layers=3, num_blocks=4, block_size=4, num_kv_heads=2, head_size=8)
    with pytest.raises(kvcore.DetectionError, match="BLNHC"):
        kvcore.detect(v33, "vllm", {"kv_cache_layout": "LBNHC"})
    assert kvcore.detect(v33, "vllm", {"kv_cache_layout": "NHD"}).format.name == "NB_NL_BS_NH_CS"  # NHD family


def test_physical_order_tensor_needs_a_deciding_hint():
    phys = torch.zeros(2, 5, 2, 16, 8, dtype=torch.bfloat16)  # HND memory (2, NB, NH, BS, HS), contiguous
    fa = {"vllm_version": "0.11.0", "attention_backend": "FLASH_ATTN"}
    err = _ambiguous(
        [phys],
        fa,
        "NL_X_TWO_NB_BS_NH_HS",
        "NL_X_TWO_NB_NH_BS_HS",
        deciding=("kv_cache_layout", "num_kv_heads", "block_size", "tensor_order"),
    )
    assert "vllm_version" not in err.hints and "attention_backend" not in err.hints  # given: never named
    lay = kvcore.detect([phys], "vllm", {**fa, "kv_cache_layout": "HND", "tensor_order": "physical"})
    assert (lay.format.name, lay.block_size, lay.num_heads) == ("NL_X_TWO_NB_NH_BS_HS", 16, 2)
    lay = kvcore.detect([phys], "vllm", {**fa, "block_size": 16, "num_kv_heads": 2})  # the sizes decide too
    assert (lay.format.name, lay.block_size, lay.num_heads) == ("NL_X_TWO_NB_NH_BS_HS", 16, 2)
    lay = kvcore.detect([phys], "vllm", {**fa, "tensor_order": "allocated"})  # as allocated: vLLM's NHD
    assert (lay.format.name, lay.block_size, lay.num_heads) == ("NL_X_TWO_NB_BS_NH_HS", 2, 16)


def test_wrong_size_hint_says_what_fits():
    kv = allocate("0.26.0", "FLASH_ATTN", "HND", num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)
    with pytest.raises(kvcore.DetectionError, match="block_size"):
        kvcore.detect(kv, "vllm", {"block_size": 24})


def test_rocm_paged_vs_flash_attention(semantic):
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=16)
    kv = allocate("0.13.0", "ROCM_ATTN", "NHD", **g)  # same shape as FlashAttention's, bytes in the paged layout
    nhd = {"kv_cache_layout": "NHD"}  # contiguous: without it an HND cache in memory order fits too
    assert kvcore.detect(kv, "vllm", nhd).format.name == "NL_X_TWO_NB_BS_NH_HS"  # no ROCm signal: CUDA FlashAttention
    _ambiguous(kv, {**nhd, "device_type": "rocm"}, "NL_X_TWO_NB_BS_NH_HS", SPLIT_K, deciding=("attention_backend",))
    # without the version, 0.11's ROCM_ATTN (unbind(0) unless VLLM_V1_USE_PREFILL_DECODE_ATTENTION) also fits
    _ambiguous(
        kv,
        {**nhd, "device_type": "rocm", "attention_backend": "ROCM_ATTN"},
        deciding=("vllm_version", "VLLM_V1_USE_PREFILL_DECODE_ATTENTION"),
    )
    lay = kvcore.detect(kv, "vllm", {"device_type": "rocm", "attention_backend": "ROCM_ATTN", "vllm_version": "0.13.0"})
    assert lay.format.name == SPLIT_K
    semantic(lay, kv, kv_view)


def test_nh2_packed_vs_rocm_head_slots(semantic):
    """[NB, 2, BS, C]: two KV heads with K|V packed per head, or ROCm 0.33's K slot and V slot."""
    g = dict(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8)
    packed = allocate("0.33.0", "FLASH_ATTN", "LBHNC", **g)
    _ambiguous(packed, {"device_type": "rocm", "vllm_version": "0.33"}, "NL_X_NB_NH_BS_CS", SPLIT_K, deciding=("attention_backend",))
    lay = kvcore.detect(packed, "vllm", {"device_type": "rocm", "attention_backend": "ROCM_AITER_FA", "kv_cache_layout": "LBHNC"})
    assert (lay.format.name, lay.num_heads, lay.head_size) == ("NL_X_NB_NH_BS_CS", 2, 8)
    semantic(lay, packed, kv_view)
    slots = allocate("0.33.0", "ROCM_ATTN", "LBHNC", num_layers=2, num_blocks=3, block_size=4, num_kv_heads=1, head_size=16)
    assert next(iter(slots.values())).shape == (3, 2, 4, 16)  # one KV head: the same shape as two packed heads of 8
    lay = kvcore.detect(slots, "vllm", {"attention_backend": "ROCM_ATTN", "num_kv_heads": 1})
    assert (lay.format.name, lay.num_heads, lay.head_size) == (SPLIT_K, 1, 16)
    semantic(lay, slots, kv_view)
