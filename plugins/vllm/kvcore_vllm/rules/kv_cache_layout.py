"""vLLM 0.29+: ``KVCacheLayout`` views ``[NB, NH, BS, C]`` of one int8 buffer
(``create_kv_cache_views``), per backend's ``supported_kv_cache_layouts()``."""

from __future__ import annotations

from kvcore_vllm.hints import KV_CACHE_LAYOUTS
from kvcore_vllm.releases import LAYOUT_ERA
from kvcore_vllm.rules.rule import Rule, _o, _src, member_layouts
from kvcore_vllm.rules.sources import _FLEX, _V33

LAYOUT_RULES: tuple[Rule, ...] = (
    Rule(
        label="0.29+ FlexAttention view [NB, NH, BS, C], LBNHC only",
        eras=(LAYOUT_ERA,),
        families=("FLEX_ATTENTION",),
        rank=4,
        logical=_o("NB NH BS CS"),
        layouts=member_layouts(("LBNHC",)),
        sources=(_src("0.33.0", _FLEX + "; supported_kv_cache_layouts() = (LBNHC,)"),),
        physical_ok=True,
        backends_label=("FLEX_ATTENTION",),
    ),
    Rule(
        label="0.29+ KVCacheLayout views [NB, NH, BS, C]",
        eras=(LAYOUT_ERA,),
        families=("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"),
        rank=4,
        logical=_o("NB NH BS CS"),
        # every KVCacheLayout member: its permutation of [L, B, H, N, C] (kv_cache_layout.py)
        layouts=member_layouts(KV_CACHE_LAYOUTS),
        sources=(
            _src(
                "0.29.0",
                _V33 + "; vllm/v1/worker/utils.py::allocate_kv_cache (both identical in 0.29.0 - 0.33.0 but for 0.30's has_layer_views)",
            ),
            _src("0.33.0", _V33 + "; vllm/v1/worker/utils.py::allocate_kv_cache"),
        ),
        physical_ok=True,
        backends_label=("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"),
    ),
    # after the generic views: among byte-identical readings the first names the group in messages
    Rule(
        label="0.29+ ROCm AITER views [NB, NH, BS, C], LBHNC / LHBNC",
        eras=(LAYOUT_ERA,),
        families=("ROCM_AITER_FA", "ROCM_AITER_UNIFIED"),
        rank=4,
        logical=_o("NB NH BS CS"),
        layouts=member_layouts(("LBHNC", "LHBNC")),
        sources=(_src("0.33.0", "rocm_aiter_fa.py / rocm_aiter_unified_attn.py::supported_kv_cache_layouts (LBHNC, LHBNC)"),),
        backends_label=("ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"),
    ),
)
