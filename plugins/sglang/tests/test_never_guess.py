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


@pytest.mark.parametrize(
    ("device_type", "want", "value"),
    [("rocm", torch.float8_e4m3fnuz, 1.0), ("hip", torch.float8_e4m3fnuz, 1.0), ("cuda", torch.float8_e4m3fn, 2.0)],
)
def test_fp8_e4m3_is_fnuz_on_rocm(device_type, want, value):
    k, v = _fp8_pool()
    for t in k + v:
        t.fill_(0x40)  # 2.0 as OCP e4m3, 1.0 as FNUZ e4m3
    lay = kvcore.detect([k, v], "sglang", {"kv_cache_dtype": "fp8_e4m3", "device_type": device_type})
    assert lay.dtype == want and lay.storage_dtype == torch.uint8
    assert kvcore.gather(lay, torch.tensor([0, 5])).float().unique().tolist() == [value]


def test_fp8_names_and_platform_evidence():
    k, v = _fp8_pool()
    # tensors of this process, whose torch build is not ROCm: SGLang's is_hip() is False
    assert kvcore.detect([k, v], "sglang", {"kv_cache_dtype": "fp8_e4m3"}).dtype == torch.float8_e4m3fn
    assert kvcore.detect([k, v], "sglang", {"kv_cache_dtype": "fp8_e5m2", "device_type": "rocm"}).dtype == torch.float8_e5m2fnuz
    for name in ("float8_e4m3fnuz", "fp8_e4m3fnuz"):
        assert kvcore.detect([k, v], "sglang", {"dtype": name}).dtype == torch.float8_e4m3fnuz
    meta = [[torch.empty(17, 2, 8, dtype=torch.uint8, device="meta") for _ in range(3)] for _ in range(2)]
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:  # a description: no process to ask
        kvcore.detect(list(meta), "sglang", {"kv_cache_dtype": "fp8_e4m3"})
    assert ei.value.hints == ["device_type", "dtype"] and "float8_e4m3fnuz" in str(ei.value) and "is_hip" in str(ei.value)
    assert kvcore.detect(list(meta), "sglang", {"kv_cache_dtype": "fp8_e4m3", "device_type": "rocm"}).dtype == torch.float8_e4m3fnuz
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
