"""Hints in vLLM's own vocabulary: normalisation, unknown values, vLLM objects, the
environment, precedence, and the device defaults."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch
from kvcore_vllm.fixtures import allocate
from kvcore_vllm.hints import BACKENDS, KV_CACHE_LAYOUTS, VllmHints, era_of, parse_hints

import kvcore


def test_layout_aliases_and_members():
    assert VllmHints(kv_cache_layout="nhd").layout33 == "LBNHC"
    assert VllmHints(kv_cache_layout="HND").layout33 == "LBHNC"
    for m in KV_CACHE_LAYOUTS:
        assert VllmHints(kv_cache_layout=m).layout33 == m
    assert VllmHints(kv_cache_layout="BLNHC").layout_family == "NHD"
    assert VllmHints(kv_cache_layout="BHLNC").layout_family == "HND"

    class KVCacheLayout(enum.Enum):  # vLLM 0.33 passes an enum member
        BLHNC = (1, 0, 2, 3, 4)

    assert VllmHints(kv_cache_layout=KVCacheLayout.BLHNC).kv_cache_layout == "BLHNC"


@pytest.mark.parametrize(
    ("field", "value", "listed"),
    [
        ("kv_cache_layout", "NDH", "LBHNC"),
        ("attention_backend", "FLASH", "FLASHINFER"),
        ("cache_dtype", "fp4", "fp8_e4m3"),
        ("dtype", "bfloat17", "bfloat16"),
        ("device_type", "npu9", "xpu"),
        ("vllm_version", "latest", "0.11.0"),
        ("vllm_version", "0.9.2", "0.11"),
        ("block_size", 0, "positive"),
        ("num_kv_heads", "8", "positive"),
    ],
)
def test_unknown_values_raise_detection_error_listing_accepted(field, value, listed):
    with pytest.raises(kvcore.DetectionError, match=listed):
        VllmHints(**{field: value})
    kv = allocate("0.11.0", "FLASH_ATTN", "NHD", num_layers=1, num_blocks=3, block_size=16, num_kv_heads=2, head_size=8)
    with pytest.raises(kvcore.DetectionError):
        kvcore.detect(kv, "vllm", {field: value})


def test_unknown_hint_key():
    with pytest.raises(kvcore.DetectionError, match="kv_cache_layout"):
        parse_hints({"kv_layout": "NHD"})


def test_every_backend_name_is_accepted():
    for b in BACKENDS:
        assert VllmHints(attention_backend=b.lower()).attention_backend == b


def test_eras():
    # 0.29 is the first release with vllm/v1/kv_cache_layout.py (0.32 was read as 0.26 before: wrong)
    assert [era_of(v) for v in ("0.11.0", "0.12.1", "0.13.0", "0.23.9", "0.24.0", "0.25", "0.26.1", "0.32", "0.33.0", "1.2")] == [
        "0.11", "0.11", "0.13", "0.13", "0.24", "0.24", "0.26", "0.29", "0.29", "0.29",
    ]  # fmt: skip


def test_element_dtypes():
    assert VllmHints(cache_dtype="fp8").element_dtype() == torch.float8_e4m3fn
    assert VllmHints(cache_dtype="fp8_e5m2", dtype="bfloat16").element_dtype() == torch.float8_e5m2
    assert VllmHints(cache_dtype="auto", dtype="half").element_dtype() == torch.float16
    assert VllmHints(dtype=torch.float32).element_dtype() == torch.float32
    assert VllmHints(cache_dtype="fp8_ds_mla").is_mla is True
    assert VllmHints(attention_backend="TRITON_ATTN").is_mla is False
    assert VllmHints(device_type="xpu").default_block_size == 64 and VllmHints().default_block_size == 16


def test_cache_config_object_env_and_precedence(monkeypatch):
    cfg = SimpleNamespace(cache_dtype="fp8_e4m3", block_size=32, kv_cache_layout="HND")
    h = parse_hints({"cache_config": cfg})
    assert (h.cache_dtype, h.block_size, h.kv_cache_layout) == ("fp8_e4m3", 32, "HND")
    h = parse_hints({"cache_config": cfg, "kv_cache_layout": "NHD", "block_size": 16})  # explicit hints win
    assert (h.kv_cache_layout, h.block_size, h.cache_dtype) == ("NHD", 16, "fp8_e4m3")
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    # env only when nothing else gave a layout, and kept apart: it steers only the backends that read it
    assert (parse_hints({}).kv_cache_layout, parse_hints({}).env_kv_cache_layout) == (None, "BLHNC")
    assert (parse_hints({"cache_config": cfg}).kv_cache_layout, parse_hints({"cache_config": cfg}).env_kv_cache_layout) == ("HND", None)
    assert parse_hints({"kv_cache_layout": "LBNHC"}).kv_cache_layout == "LBNHC"
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    hnd = allocate("0.11.0", "FLASHINFER", "HND", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=8)
    assert kvcore.detect(hnd, "vllm").format.name == "NL_X_NB_TWO_NH_BS_HS"
    with pytest.raises(kvcore.DetectionError, match="strides show"):
        kvcore.detect(hnd, "vllm", {"cache_config": SimpleNamespace(kv_cache_layout="NHD")})


def test_vllm_config_object():
    mc = SimpleNamespace(dtype=torch.float16, get_head_size=lambda: 576)
    vc = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8_ds_mla", block_size=64, kv_cache_layout=None), model_config=mc)
    h = parse_hints({"vllm_config": vc})
    assert (h.dtype, h.head_size, h.cache_dtype, h.block_size, h.is_mla) == (torch.float16, 576, "fp8_ds_mla", 64, True)
    assert parse_hints({"vllm_config": vc, "head_size": 128}).head_size == 128


def test_hints_model_instance_accepted():
    kv = allocate("0.24.0", "FLASH_ATTN", "HND", num_layers=2, num_blocks=2, block_size=16, num_kv_heads=2, head_size=8)
    lay = kvcore.detect(kv, "vllm", VllmHints(vllm_version="0.24.0", kv_cache_layout="HND"))
    assert lay.format.name == "NL_X_NB_TWO_NH_BS_HS" and lay.num_blocks == 2


def test_xpu_forces_nhd_and_defaults_block_64(semantic):
    from kvcore_vllm.fixtures import kv_view

    g = dict(num_layers=2, num_blocks=3, block_size=64, num_kv_heads=64, head_size=8)
    kv = allocate("0.11.0", "FLASH_ATTN", "NHD", **g)  # BS == NH: ambiguous without a layout...
    with pytest.raises(kvcore.AmbiguousLayoutError):
        kvcore.detect(kv, "vllm")
    lay = kvcore.detect(kv, "vllm", {"device_type": "xpu"})  # ...but XPU only has NHD
    assert (lay.format.name, lay.block_size) == ("NL_X_TWO_NB_BS_NH_HS", 64)
    semantic(lay, kv, kv_view)


def test_pallas_padded_head_needs_head_size():
    kv = allocate("0.11.0", "PALLAS", num_layers=1, num_blocks=3, block_size=16, num_kv_heads=2, head_size=80)
    t = next(iter(kv.values()))
    assert t.shape == (3, 16, 4, 128)
    lay = kvcore.detect(kv, "vllm", {"device_type": "tpu", "head_size": 80})
    assert (lay.format.name, lay.head_size, lay.num_heads) == ("NL_X_NB_BS_NH_TWO_HS", 80, 2)
    p = lay.stride_table().planes[0]
    assert (p.head, p.token) == (2 * 128 * 2, 4 * 128 * 2)
    assert int(lay.stride_table().ptrs()[0, 1] - lay.stride_table().ptrs()[0, 0]) == 128 * 2  # V: one head slot after K
    assert kvcore.detect(kv, "vllm", {"device_type": "tpu"}).head_size == 128  # without the hint: the padded width


def test_flex_attention_033_is_lbnhc_only():
    kv = allocate("0.33.0", "FLASH_ATTN", "LBHNC", num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8)
    assert kvcore.detect(kv, "vllm", {"attention_backend": "FLASH_ATTN", "tensor_order": "allocated"}).format.name == "NL_X_NB_NH_BS_CS"
    flex = {"attention_backend": "FLEX_ATTENTION", "vllm_version": "0.33.0"}
    with pytest.raises(kvcore.DetectionError):  # FlexAttention 0.33 supports only LBNHC (flex_attention.py l.130)
        kvcore.detect(kv, "vllm", {**flex, "tensor_order": "allocated"})
    # the only FlexAttention reading of a contiguous [NB, X, Y, C] is an LBNHC cache already in memory order
    lay = kvcore.detect(kv, "vllm", flex)
    assert (lay.format.name, lay.block_size, lay.num_heads) == ("NL_X_NB_BS_NH_CS", 2, 4)
    nhd = allocate("0.33.0", "FLEX_ATTENTION", "LBNHC", num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8)
    assert kvcore.detect(nhd, "vllm", {"attention_backend": "FLEX_ATTENTION"}).format.name == "NL_X_NB_BS_NH_CS"
