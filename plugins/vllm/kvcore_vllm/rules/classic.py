"""vLLM 0.11 - 0.25 GPU attention: ``get_kv_cache_shape`` plus ``get_kv_cache_stride_order`` per
backend (FlashAttention / FlexAttention / ROCm AITER K/V-major, FlashInfer and Triton
blocks-first, the 0.13 - 0.24 cross-layer buffers, ROCm 0.11 unified attention)."""

from __future__ import annotations

from kvcore_vllm.rules.rule import Rule, _o, _src, stride_layouts
from kvcore_vllm.rules.sources import _FA, _FI, _FLEX, _ROCM, _TR, _XL, HYBRID_SOURCE

CLASSIC_RULES: tuple[Rule, ...] = (
    Rule(
        label="FlashAttention K/V-major (2, NB, BS, NH, HS)",
        eras=("0.11", "0.13"),
        families=("FLASH_ATTN", "FLEX_ATTENTION", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED"),
        rank=5,
        logical=_o("TWO NB BS NH HS"),
        layouts={
            **stride_layouts("TWO NB BS NH HS", {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}),
            # attention beside Mamba: _update_hybrid_attention_mamba_layout restrides (2, NB, ...) to
            # stride (hidden, 2*hidden, ...) so a block's K and V are adjacent
            "NHD/mamba": _o("NL NB TWO BS NH HS"),
            "HND/mamba": _o("NL NB TWO NH BS HS"),
        },
        sources=(
            _src("0.11.0", _FA + ", get_kv_cache_stride_order HND (0,1,3,2,4); forward kv_cache.unbind(0)"),
            _src("0.11.0", _FLEX + "; rocm_aiter_fa.py::AiterFlashAttentionBackend.get_kv_cache_shape (no stride order)"),
            _src("0.13.0", "vllm/v1/attention/backends/rocm_aiter_unified_attn.py::get_kv_cache_shape; forward unbind(0)"),
            _src("0.11.0", HYBRID_SOURCE),
            _src("0.13.0", HYBRID_SOURCE),
        ),
        physical_ok=True,
        backends_label=("FLASH_ATTN", "FLEX_ATTENTION", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "XPU"),
        # no get_kv_cache_stride_order in flex_attention.py / rocm_aiter_fa.py / rocm_aiter_unified_attn.py (0.11, 0.13):
        # the runner keeps get_kv_cache_shape's order, NHD
        only={f: ("NHD", "NHD/mamba") for f in ("FLEX_ATTENTION", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED")},
    ),
    Rule(
        label="ROCm 0.11 unified attention (2, NB, BS, NH, HS) read by unbind(0)",
        eras=("0.11",),
        families=("ROCM_ATTN",),
        rank=5,
        logical=_o("TWO NB BS NH HS"),
        # beside Mamba layers (platforms/rocm.py support_hybrid_kv_cache() is True) the runner restrides the
        # (2, NB, ...) tensor so a block's K and V are adjacent; unbind(0) reads it through the new strides
        layouts={"*": _o("NL TWO NB BS NH HS"), "*/mamba": _o("NL NB TWO BS NH HS")},
        sources=(
            _src(
                "0.11.0",
                _ROCM + "::RocmAttentionImpl.forward: kv_cache.unbind(0) unless VLLM_V1_USE_PREFILL_DECODE_ATTENTION "
                "(also under AITER unified attention)",
            ),
            _src("0.11.0", HYBRID_SOURCE),
        ),
        gate="rocm",
        requires=(("prefill_decode_attention", False),),
        backends_label=("ROCM_ATTN",),
    ),
    Rule(
        label="FlashAttention cross-layer (0.13-0.23)",
        eras=("0.13",),
        families=("FLASH_ATTN",),
        rank=5,
        logical=_o("TWO NB BS NH HS"),
        layouts=stride_layouts("TWO NB BS NH HS", {"NHD/cross": (2, 0, 1, 3, 4, 5), "HND/cross": (2, 4, 0, 1, 3, 5)}),
        sources=(_src("0.13.0", _XL + "; FA stride order NHD (2,0,1,3,4,5), HND (2,4,0,1,3,5)"),),
        backends_label=("FLASH_ATTN",),
    ),
    Rule(
        label="FlashInfer blocks-first (NB, 2, BS, NH, HS)",
        eras=("0.11", "0.13", "0.24"),
        families=("FLASHINFER",),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts=stride_layouts("NB TWO BS NH HS", {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}),
        sources=(_src("0.11.0", _FI + ", HND stride order (0,1,3,2,4); kv_cache[:, 0] / [:, 1]"), _src("0.24.0", _FI)),
        physical_ok=True,
        backends_label=("FLASHINFER",),
    ),
    Rule(
        label="FlashInfer cross-layer (0.13-0.24)",
        eras=("0.13", "0.24"),
        families=("FLASHINFER",),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts=stride_layouts("NB TWO BS NH HS", {"NHD/cross": (1, 0, 2, 3, 4, 5), "HND/cross": (1, 2, 4, 0, 3, 5)}),
        sources=(_src("0.13.0", _XL + "; FlashInfer stride order NHD (1,0,2,3,4,5), HND (1,2,4,0,3,5)"), _src("0.24.0", _FI)),
        backends_label=("FLASHINFER",),
    ),
    Rule(
        label="Triton blocks-first (NB, 2, BS, NH, HS), no stride order",
        eras=("0.11", "0.13"),
        families=("TRITON_ATTN",),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts=stride_layouts("NB TWO BS NH HS", {"NHD": (0, 1, 2, 3, 4)}),
        sources=(_src("0.11.0", _TR + ", no stride order: NHD only; forward unbind(1)"),),
        physical_ok=True,
        backends_label=("TRITON_ATTN",),
    ),
    Rule(
        label="0.24-0.25 blocks-first (NB, 2, BS, NH, HS)",
        eras=("0.24",),
        families=("FLASH_ATTN", "TRITON_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED"),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts=stride_layouts("NB TWO BS NH HS", {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}),
        sources=(
            _src("0.24.0", _FA + ", stride order HND (0,1,3,2,4); forward unbind(1)"),
            _src("0.24.0", _TR + ", stride order HND (0,1,3,2,4)"),
            _src("0.24.0", "rocm_aiter_fa.py / rocm_aiter_unified_attn.py: (NB, 2, BS, NH, HS), no stride order, unbind(1)"),
            _src("0.25.1", _FA + " / get_kv_cache_stride_order identical in 0.24.0 - 0.25.1 (Triton: int4 per-token-head only)"),
        ),
        physical_ok=True,
        backends_label=("FLASH_ATTN", "TRITON_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"),
        # 0.24 rocm_aiter_fa.py / rocm_aiter_unified_attn.py define no get_kv_cache_stride_order: NHD only
        only={"ROCM_AITER_FA": ("NHD",), "ROCM_AITER_UNIFIED": ("NHD",)},
    ),
    Rule(
        label="0.24 FlexAttention (NB, 2, BS, NH, HS), stride order (0,2,1,3,4)",
        eras=("0.24",),
        families=("FLEX_ATTENTION",),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts=stride_layouts("NB TWO BS NH HS", {"NHD": (0, 2, 1, 3, 4), "NHD/cross": (1, 0, 3, 2, 4, 5)}),
        sources=(_src("0.24.0", _FLEX + ", stride order (0,2,1,3,4), cross-layer (1,0,3,2,4,5); forward unbind(1)"),),
        physical_ok=True,
        backends_label=("FLEX_ATTENTION",),
    ),
    Rule(
        label="0.24 cross-layer (FlashAttention, Triton)",
        eras=("0.24",),
        families=("FLASH_ATTN", "TRITON_ATTN"),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts=stride_layouts("NB TWO BS NH HS", {"NHD/cross": (1, 0, 2, 3, 4, 5), "HND/cross": (1, 4, 0, 2, 3, 5)}),
        sources=(_src("0.24.0", _XL + "; FA and Triton stride order NHD (1,0,2,3,4,5), HND (1,4,0,2,3,5)"),),
        backends_label=("FLASH_ATTN", "TRITON_ATTN"),
    ),
)
