"""SGLang detection never guesses (issue 16): fp8 on ROCm is FNUZ and never assumed,
page views are named by their memory order (a layout hint the strides contradict is an
error), and an ambiguity names only hints the caller did not give."""

from __future__ import annotations

import pytest
import torch
from kvcore_sglang import fixtures as fx

import kvcore

HND_POOL = dict(num_layers=2, size=48, page_size=16, head_num=2, head_dim=8, layout="HND")


def _fp8_pool(device="cpu"):
    k, v = fx.alloc_mha_053(num_layers=3, size=16, page_size=1, head_num=2, head_dim=8, dtype=torch.float8_e4m3fn, device=device)
    assert k[0].dtype == torch.uint8  # SGLang's store_dtype for fp8
    return k, v


# What SGLang's --kv-cache-dtype fp8 names allocate, from its sources:
#   not ROCm: float8_e4m3fn / float8_e5m2 (every release);
#   ROCm <= 0.5.6.post1 (0.5.3 model_runner.py::ModelRunner.init_memory_pool): float8_e4m3fnuz / float8_e5m2fnuz;
#   ROCm >= 0.5.6.post2 (0.5.23 mem_cache/kv_cache_dtype.py::configure_kv_cache_dtype): both names are
#   fp8_kernel.fp8_dtype = float8_e4m3fnuz if "gfx94" in gcnArchName else float8_e4m3fn.
# The byte 0x41 decodes to a different value in each of the four types.
BYTE = 0x41
VALUE = {torch.float8_e4m3fn: 2.25, torch.float8_e5m2: 2.5, torch.float8_e4m3fnuz: 1.125, torch.float8_e5m2fnuz: 1.25}
OLD, NEW = ("0.5.3", "0.5.6", "0.5.6.post1"), ("0.5.6.post2", "0.5.7", "0.5.13", "0.5.23", "0.6.0rc1")


def _sglang_allocates(kind: str, version: str, gfx: str) -> torch.dtype:
    """The table above, for ROCm."""
    if version in OLD:
        return {"e4m3": torch.float8_e4m3fnuz, "e5m2": torch.float8_e5m2fnuz}[kind]
    return torch.float8_e4m3fnuz if gfx.startswith("gfx94") else torch.float8_e4m3fn


def test_the_value_decodes():
    for dt, value in VALUE.items():
        assert torch.tensor([BYTE], dtype=torch.uint8).view(dt).float().item() == value


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_names_on_rocm_follow_the_release_and_the_gpu(kind):
    """Every (release, GPU) known or not: the dtype SGLang allocated, with bytes decoding to
    its values, or AmbiguousLayoutError naming exactly the hints whose values matter."""
    k, v = _fp8_pool()
    for t in k + v:
        t.fill_(BYTE)
    base = {"kv_cache_dtype": f"fp8_{kind}", "device_type": "rocm", "kv_list_layout": "nested"}
    for version, gfx in [(ver, g) for ver in (*OLD, *NEW, None) for g in ("gfx942", "gfx942:sramecc+:xnack-", "gfx950", None)]:
        hints = {**base, **({"sglang_version": version} if version else {}), **({"gcn_arch": gfx} if gfx else {})}
        possible = {
            _sglang_allocates(kind, ver, g)
            for ver in ([version] if version else OLD + NEW)
            for g in ([gfx] if gfx else ("gfx942", "gfx950"))
        }
        if len(possible) == 1:
            lay = kvcore.detect([k, v], "sglang", hints)
            want = possible.pop()
            assert lay.dtype == want and lay.storage_dtype == torch.uint8, hints
            assert kvcore.gather(lay, torch.tensor([0, 5])).float().unique().tolist() == [VALUE[want]]
            continue
        with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
            kvcore.detect([k, v], "sglang", hints)
        by_version = (
            version is None and len({_sglang_allocates(kind, ver, g) for ver in (OLD[0], NEW[0]) for g in ("gfx942", "gfx950")}) > 1
        )
        by_gpu = gfx is None and any(
            _sglang_allocates(kind, ver, "gfx942") != _sglang_allocates(kind, ver, "gfx950") for ver in ([version] if version else NEW)
        )
        assert ei.value.hints == [*(["sglang_version"] if by_version else []), *(["gcn_arch"] if by_gpu else []), "dtype"], hints
        for dt in possible:
            assert f"as {str(dt)[6:]} (" in str(ei.value)
    # the reviewers' case: 0.5.23 on ROCm, GPU unknown: e4m3fnuz (gfx94x) or e4m3fn (gfx950), never e5m2fnuz
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect([k, v], "sglang", {**base, "sglang_version": "0.5.23"})
    assert ei.value.hints == ["gcn_arch", "dtype"] and len(ei.value.candidates) == 2
    assert not any("e5m2" in c for c in ei.value.candidates)


def test_fp8_names_off_rocm_and_platform_evidence():
    k, v = _fp8_pool()
    for t in k + v:
        t.fill_(BYTE)
    # tensors of this process, whose torch build is not ROCm: SGLang's is_hip() is False; any release, any GPU name unused
    for kind, want in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        for extra in ({}, {"device_type": "cuda"}, {"sglang_version": "0.5.23"}, {"sglang_version": "0.5.3"}):
            lay = kvcore.detect([k, v], "sglang", {"kv_cache_dtype": f"fp8_{kind}", **extra})
            assert lay.dtype == want and kvcore.gather(lay, torch.tensor([3])).float().unique().tolist() == [VALUE[want]]
    for name in ("float8_e4m3fnuz", "fp8_e4m3fnuz"):
        assert kvcore.detect([k, v], "sglang", {"dtype": name}).dtype == torch.float8_e4m3fnuz
    meta = [[torch.empty(17, 2, 8, dtype=torch.uint8, device="meta") for _ in range(3)] for _ in range(2)]
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:  # a description: no process to ask
        kvcore.detect(list(meta), "sglang", {"kv_cache_dtype": "fp8_e4m3"})
    assert ei.value.hints == ["device_type", "sglang_version", "gcn_arch", "dtype"]
    assert "float8_e4m3fnuz" in str(ei.value) and "is_hip" in str(ei.value)
    assert kvcore.detect(list(meta), "sglang", {"kv_cache_dtype": "fp8_e4m3", "device_type": "cuda"}).dtype == torch.float8_e4m3fn
    rocm = {"kv_cache_dtype": "fp8_e5m2", "device_type": "rocm"}
    assert kvcore.detect(list(meta), "sglang", {**rocm, "sglang_version": "0.5.3"}).dtype == torch.float8_e5m2fnuz
    assert kvcore.detect(list(meta), "sglang", {**rocm, "sglang_version": "0.5.23", "gfx": "gfx950"}).dtype == torch.float8_e4m3fn
    # gcn_arch says ROCm by itself
    assert kvcore.detect(list(meta), "sglang", {"kv_cache_dtype": "fp8_e4m3", "gcn_arch": "gfx942"}).dtype == torch.float8_e4m3fnuz
    with pytest.raises(kvcore.DetectionError, match="names a ROCm GPU, but device_type='cuda'"):
        kvcore.detect([k, v], "sglang", {"kv_cache_dtype": "fp8_e4m3", "device_type": "cuda", "gcn_arch": "gfx942"})
    with pytest.raises(kvcore.DetectionError, match="not an SGLang release"):
        kvcore.detect([k, v], "sglang", {**rocm, "sglang_version": "main", "gcn_arch": "gfx950"})
    with pytest.raises(kvcore.DetectionError, match="not a ROCm gcnArchName"):
        kvcore.detect([k, v], "sglang", {**rocm, "gcn_arch": "mi300"})
    with pytest.raises(kvcore.DetectionError, match="dtype/kv_cache_dtype"):
        kvcore.detect([k, v], "sglang", {"kv_cache_dtype": "fp9"})


def test_page_views_are_named_by_their_memory_order():
    k, v = fx.alloc_mha_0523(**HND_POOL)  # (pages, NH=2, page=16, HS) contiguous: SGLang's HND
    lay = kvcore.detect([k, v], "sglang", {"layout": "HND"})
    assert (lay.format.name, lay.num_heads, lay.block_size) == ("TWO_X_NL_X_NB_NH_BS_HS", 2, 16)
    # the same memory handed over as an NHD-shaped view (pages, page, NH, HS) with permuted strides
    kt, vt = [t.transpose(1, 2) for t in k], [t.transpose(1, 2) for t in v]
    lay = kvcore.detect([kt, vt], "sglang", {"layout": "HND"})
    assert (lay.format.name, lay.num_heads, lay.block_size) == ("TWO_X_NL_X_NB_NH_BS_HS", 2, 16)
    assert lay.stride_table().signature() == kvcore.detect([k, v], "sglang", {"layout": "HND"}).stride_table().signature()
    with pytest.raises(kvcore.DetectionError) as ei:  # the strides show HND memory
        kvcore.detect([kt, vt], "sglang", {"layout": "NHD", "page_size": 16})
    assert not isinstance(ei.value, kvcore.AmbiguousLayoutError)
    assert "layout='NHD'" in str(ei.value) and "TWO_X_NL_X_NB_NH_BS_HS" in str(ei.value)


def test_a_contiguous_page_pool_is_ambiguous_and_names_only_hints_not_given():
    k, v = fx.alloc_mha_0523(**HND_POOL)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect([k, v], "sglang")
    assert {"layout", "page_size", "num_kv_heads"} <= set(ei.value.hints)
    assert "BS=16, NH=2" in str(ei.value) and "BS=2, NH=16" in str(ei.value)
    sq = fx.alloc_mha_0523(num_layers=2, size=12, page_size=4, head_num=4, head_dim=8, layout="HND")  # page == heads
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(list(sq), "sglang", {"page_size": 4, "num_kv_heads": 4, "sglang_version": "0.5.23"})
    assert ei.value.hints and not {"page_size", "num_kv_heads", "sglang_version"} & set(ei.value.hints)
    assert (
        kvcore.detect(list(sq), "sglang", {"page_size": 4, "layout": "HND", "tensor_order": "allocated"}).format.name
        == "TWO_X_NL_X_NB_NH_BS_HS"
    )
