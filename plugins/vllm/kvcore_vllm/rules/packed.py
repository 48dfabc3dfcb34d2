"""vLLM 0.26 - 0.28: the packed ``K|V`` row ``(NB, NH, BS, 2*HS)`` of every GPU backend."""

from __future__ import annotations

from kvcore_vllm.rules.rule import GPU_FAMILIES, Rule, _o, _src, stride_layouts
from kvcore_vllm.rules.sources import _FA

PACKED_RULES: tuple[Rule, ...] = (
    Rule(
        label="0.26-0.28 packed K|V (NB, NH, BS, 2*HS)",
        eras=("0.26",),
        families=GPU_FAMILIES + ("ROCM_AITER_FA", "ROCM_AITER_UNIFIED"),
        rank=4,
        logical=_o("NB NH BS CS"),
        layouts=stride_layouts(
            "NB NH BS CS", {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3), "NHD/cross": (1, 0, 3, 2, 4), "HND/cross": (1, 2, 0, 3, 4)}
        ),
        sources=(
            _src(
                "0.26.0",
                _FA + ", stride order NHD (0,2,1,3), HND identity; cross-layer NHD (1,0,3,2,4), HND (1,2,0,3,4); "
                "forward transpose(1, 2).split(head_size, -1)",
            ),
            _src("0.26.0", "rocm_aiter_fa.py / rocm_aiter_unified_attn.py: (NB, NH, BS, 2*HS), no stride order"),
            _src(
                "0.28.0",
                "flash_attn.py / flashinfer.py / triton_attn.py / flex_attention.py / rocm_aiter_*.py: get_kv_cache_shape and "
                "get_kv_cache_stride_order identical in 0.26.0 - 0.28.0 (FlashInfer: nvfp4 only)",
            ),
        ),
        physical_ok=True,
        backends_label=GPU_FAMILIES + ("ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"),
        # 0.26 flex_attention.py::get_kv_cache_stride_order is (0, 2, 1, 3) / layered (1, 0, 3, 2, 4) whatever
        # get_kv_cache_layout() says: NHD only; rocm_aiter_fa.py / rocm_aiter_unified_attn.py define none: the
        # shape's own order (NB, NH, BS, 2*HS), HND, and no cross-layer buffer (use_uniform_kv_cache needs one)
        only={"FLEX_ATTENTION": ("NHD", "NHD/cross"), "ROCM_AITER_FA": ("HND",), "ROCM_AITER_UNIFIED": ("HND",)},
    ),
)
