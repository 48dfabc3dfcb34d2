"""vLLM's KV cache layouts as data: one :class:`Rule` per (era, backend family, shape).

A rule says what vLLM hands out and where its bytes live:

* ``logical``: the axis tokens of the per-layer tensor as vLLM's
  ``get_kv_cache_shape`` (<= 0.28) or ``create_kv_cache_views`` (0.29+) gives it, after an
  optional zero-copy ``transform`` (e.g. 0.29+ CPU's ``[B, H, N, C]`` -> ``[B, H, 2, N, D]``);
* ``layouts``: per layout key, the **physical** axis order of the whole cache, ``NL``
  included. The key is ``NHD``/``HND`` (+ ``/cross`` for 0.13-0.2x cross-layer buffers,
  ``/mamba`` for 0.11 / 0.13 ``(2, NB, ...)`` attention caches restrided beside Mamba layers:
  :data:`HYBRID_SOURCE`; ``*`` for a backend with one physical order) for <= 0.28, a
  ``KVCacheLayout`` member for 0.29+ (the era :data:`kvcore_vllm.releases.LAYOUT_ERA`). The physical order *is* the kvcore
  format name: ``NL`` first gives a layer list ``NL_X_...``; ``NL`` inside gives the one
  cross-layer tensor (``NB_NL_TWO_BS_NH_HS``), rebuilt from the per-layer views that
  share one buffer with a uniform layer stride.

:func:`candidates` turns every rule consistent with the hints and the tensors into
:class:`kvcore.Candidate`\\ s (views only; a candidate's views must follow its physical
order, so strides decide NHD vs HND and layer- vs block-outermost wherever they can);
:func:`kvcore.resolve` then merges readings that place bytes identically and raises
:class:`kvcore.AmbiguousLayoutError` for the rest.

Heads-outermost 0.29+ layouts are named by their physical order too: ``LHBNC`` is a layer
list of ``[NH, NB, BS, CS]`` tensors (``NL_X_NH_NB_BS_CS``), ``BHLNC`` the one tensor
``NB_NH_NL_BS_CS``. (kvcore's generic spec reads strides, so the per-layer view
``NL_X_NB_NH_BS_CS`` with a head stride larger than its block stride would move the same
bytes; the name just would not say where they are.)

Facts: each rule's docstring cites vLLM's file and function per release; ``SOURCES.md``
in this plugin lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import Candidate, DetectionError, GeometryError, Source, build_layout, memory_ordered
from kvcore.dtypes import is_fp8, rocm_build
from kvcore.grammar import parse
from kvcore_vllm.hints import BACKEND_FAMILY, KV_CACHE_LAYOUTS, LAYOUT_ALIASES, LAYOUT_FAMILY, MLA_CACHE_DTYPES, VllmHints
from kvcore_vllm.releases import ERAS, KV_CACHE_LAYOUT_ORDERS, LAYOUT_ERA, layout_physical_order, version_tuple
from kvcore_vllm.specs import BLOCKED_SCALE_RECORDS, RECORDS, ROCM_TILE_BYTES, ROCM_TILE_TOKENS

__all__ = [
    "Rule",
    "RULES",
    "candidates",
    "bare_candidates",
    "layout_families",
    "stack_layers",
    "MLA_WIDTHS",
    "MAX_BARE_LAYERS",
    "LAYOUT_READERS",
    "LAYOUT_OVERRIDES",
    "XPU_FORCES_NHD",
    "physical_name",
    "platform_rocm",
    "platform_cpu",
    "SPLIT_KV",
]

#: MLA latent widths vLLM's MLA backends accept: ``get_supported_head_sizes() == [576]``
#: (0.11 ``mla/common.py``). A rank-3 ``[NB, BS, W]`` cache of any other width is a latent
#: too (``NL_X_NB_BS_HS``, kv_size 1): MiniMax-M3 on 0.26 keeps rank-3 indexer key caches
#: ``(NB, 128, 128)`` bf16 beside its packed GQA caches. A uint8 width that is one of vLLM's
#: byte records (:data:`kvcore_vllm.specs.RECORDS`) is read as vLLM writes that record: per
#: token (656, 528, 352, 288) or as a blocked-scale page (584, 132, 68).
MLA_WIDTHS = (576,)

#: vLLM's paged-attention reading (``PagedAttention.split_kv_cache``): K ``(NB, NH, HS/x,
#: BS, x)`` with ``x = 16 // element_size``, V ``(NB, NH, HS, BS)`` -- K and V differ, so
#: one plane each.
SPLIT_KV = "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS"
#: the paged kernels' K chunk, in bytes (``x = 16 // element_size``).
K_CHUNK_BYTES = 16
#: ROCm's DSA indexer page (vLLM 0.24+, block_size > 1): the block's fp8 keys in tiles of 16
#: tokens x 16 bytes (``K``), then each token's 4-byte scale (``KS``).
ROCM_INDEXER = "K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS"
ROCM_INDEXER_CROSS = "K=NB_NL_BSC_HSC_BSE_HSE+KS=NB_NL_BS_HS"

#: backends that only run on ROCm / never on ROCm (vLLM 0.33 ``platforms/rocm.py``
#: backend selection; FlashMLA, CUTLASS MLA and FlashInfer are NVIDIA libraries).
ROCM_ONLY_BACKENDS = (
    "ROCM_ATTN",
    "ROCM_SEGMENTED_ATTN",
    "ROCM_AITER_FA",
    "ROCM_AITER_UNIFIED_ATTN",
    "ROCM_AITER_MLA",
    "ROCM_AITER_MLA_SPARSE",
    "ROCM_AITER_TRITON_MLA",
    "AITER_TRITON_MLA",
    "ROCM_FLASHMLA_SPARSE_DSV4",
    "ROCM_FLASHMLA_SPARSE_DSV41",
    "DEEPSEEK_V4_ROCM_MXFP4_INDEXER",
    "DEEPSEEK_V41_ROCM_MXFP4_INDEXER",
)
#: backends of vLLM's CPU platform only (``platforms/cpu.py::CpuPlatform.get_attn_backend_cls``).
CPU_ONLY_BACKENDS = ("CPU_ATTN", "TORCH_SDPA", "CPU_MLA", "AMX_MLA", "CPU_V4_MLA_SPARSE", "CPU_V4_INDEXER")
NOT_ROCM_BACKENDS = (
    "B12X",
    "TRITON_FLASHINFER",
    "CPU_MLA",
    "AMX_MLA",
    "FLASHMLA",
    "FLASHMLA_SPARSE",
    "CUTLASS_MLA",
    "FLASHINFER_MLA",
    "FLASH_ATTN_MLA",
    "FLASHINFER",
    "FLASHINFER_VLLM_V1",
    "CPU_ATTN",
    "TORCH_SDPA",
    "PALLAS",
    "PALLAS_VLLM_V1",
)


def platform_rocm(h: VllmHints, tensors: Sequence[torch.Tensor]) -> bool | None:
    """Whether the engine that wrote ``tensors`` ran on ROCm: the ``device_type`` hint, else
    a backend that exists on one platform only, else the torch build of the process holding
    the tensors (:func:`kvcore.dtypes.rocm_build`); None when nothing tells (meta tensors,
    a description from a log)."""
    if h.device_type is not None:
        return h.device_type == "rocm"
    if h.attention_backend in ROCM_ONLY_BACKENDS:
        return True
    if h.attention_backend in NOT_ROCM_BACKENDS:
        return False
    return rocm_build(list(tensors))


def platform_cpu(h: VllmHints, tensors: Sequence[torch.Tensor]) -> bool | None:
    """Whether the engine that wrote ``tensors`` may be vLLM's CPU platform: the
    ``device_type`` hint; else a backend hint (a CPU backend says yes, any other no); else
    ``use_ipex`` (a ``TORCH_SDPA``-only setting) says yes; else the tensors: memory on an
    accelerator (``cuda``, ``xpu``, ...) is no CPU engine's cache, nor is memory of a ROCm
    build of torch (:func:`kvcore.dtypes.rocm_build`); CPU (or meta) tensors of any other
    build may be -- None: the CPU backend's readings are considered beside the GPU ones,
    and where they place bytes differently detection names ``attention_backend`` /
    ``device_type`` (a CPU tensor may also be a GPU cache copied or described, so its
    device does not rule the GPU readings out)."""
    if h.device_type is not None:
        return h.device_type == "cpu"
    if h.attention_backend in CPU_ONLY_BACKENDS:
        return True
    if h.family is not None:
        return h.family == "CPU"
    if h.use_ipex is not None or h.cpu_attn_isa is not None:
        return True
    if any(t.device.type not in ("cpu", "meta") for t in tensors):
        return False
    if rocm_build(list(tensors)):
        return False
    return None


_FA = "vllm/v1/attention/backends/flash_attn.py::FlashAttentionBackend.get_kv_cache_shape"
_FI = "vllm/v1/attention/backends/flashinfer.py::FlashInferBackend.get_kv_cache_shape"
_TR = "vllm/v1/attention/backends/triton_attn.py::TritonAttentionBackend.get_kv_cache_shape"
_FLEX = "vllm/v1/attention/backends/flex_attention.py::FlexAttentionBackend.get_kv_cache_shape"
_MLA = "vllm/v1/attention/backends/mla/common.py::MLACommonBackend.get_kv_cache_shape"
_XL = "vllm/v1/worker/kv_connector_model_runner_mixin.py::allocate_uniform_kv_caches"
_V33 = "vllm/v1/kv_cache_interface.py::create_kv_cache_views; vllm/v1/kv_cache_layout.py::KVCacheLayout"
_CPU = "vllm/v1/attention/backends/cpu_attn.py"
_PALLAS = "vllm/v1/attention/backends/pallas.py::PallasAttentionBackend.get_kv_cache_shape"
_ROCM = "vllm/v1/attention/backends/rocm_attn.py"
_SPLIT = "PagedAttention.split_kv_cache (K (NB, NH, HS/x, BS, x), x = 16 // element_size; V (NB, NH, HS, BS))"
_IDX = "vllm/v1/attention/backends/mla/indexer.py; vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache"
_RIDX = (
    "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py::indexer_k_quant_and_cache_triton / _indexer_k_quant_and_cache_kernel "
    "(LAYOUT SHUFFLE when block_size > 1: [BS/16, 128/16, 16, 16] value tiles, then [BS] fp32 scales)"
)
_V4 = "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py"
_B12X = "vllm/v1/attention/backends/b12x.py"
_RSEG = "vllm/v1/attention/backends/rocm_segmented_attn.py"
#: vLLM 0.11 / 0.13 ``v1/worker/gpu_model_runner.py::_update_hybrid_attention_mamba_layout``, called from
#: ``_reshape_kv_cache_tensors`` when a model has attention and Mamba layers: every attention tensor whose
#: ``shape[0] == 2`` is restrided in place to strides ``(hidden, 2*hidden, *strides[2:])`` (hidden =
#: ``shape[2:].numel()``), so a block's K and V sides are adjacent. vLLM's CPU, ROCm and XPU runners
#: inherit it (each platform's ``support_hybrid_kv_cache()`` is True). 0.24 / 0.26 restride only backends
#: whose ``get_kv_cache_block_dim`` is 1 (``ROCM_ATTN``'s ``(2, NB, ...)``, read by split_kv_cache from the
#: planes' strides); 0.27 / 0.28 likewise; 0.29+ has no restride (``create_kv_cache_views``).
HYBRID_SOURCE = "vllm/v1/worker/gpu_model_runner.py::_update_hybrid_attention_mamba_layout (attention beside Mamba layers)"

GPU_FAMILIES = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")


def _o(s: str) -> tuple[str, ...]:
    return tuple(s.split())


@dataclass(frozen=True)
class Rule:
    """One vLLM allocation: see the module docstring.

    Attributes:
        label: a short human name (shown in notes and ambiguity messages).
        eras: layout eras (:data:`kvcore_vllm.hints.ERAS`) the rule holds for.
        families: backend families (:data:`kvcore_vllm.hints.BACKEND_FAMILY` values).
        rank: rank of the tensor vLLM hands out.
        logical: axis tokens of the per-layer view after ``transform``.
        layouts: layout key -> physical axis order (with ``NL``).
        sources: where the facts come from.
        transform: name of a zero-copy view transform (:data:`TRANSFORMS`), or "".
        gate: "gpu" (excluded when device_type is cpu/tpu), "cpu" (needs device_type cpu
            or a CPU backend), "tpu" (needs device_type tpu or PALLAS), "rocm" (needs
            device_type rocm, ROCM_ATTN, or tensors of a ROCm process: :func:`platform_rocm`),
            "rocm?" (excluded only where the platform is known not to be ROCm), "cuda" (an
            NVIDIA-only backend: excluded for device_type other than cuda and where the platform
            is known to be ROCm), "" (any).
        physical_ok: a tensor already permuted to a layout's physical order (the
            caller's ``tensor_order="physical"``) is a reading of this rule: offered for
            every memory-ordered tensor, marked ``order="physical"`` (the core decides,
            :mod:`kvcore.detection`).
        mla: MLA latent (no K/V axis); blocked: blocked-scale records.
        planes: the name of a plane builder (:data:`PLANE_BUILDERS`) for layouts whose
            parts live apart (K and V of different orders, a tiled value region beside its
            scales): each per-layer view (in ``logical`` order) becomes one view per plane,
            and ``layouts`` maps each key to a multi-plane name (``K=...+V=...``).
        requires: ``(hint field, value)`` pairs: a setting vLLM reads at run time that the
            tensors cannot show (``use_ipex``, ``prefill_decode_attention``); the rule is
            out when the hint says otherwise, and two rules that differ only here make
            detection raise AmbiguousLayoutError naming that hint.
        only: family -> the layout keys that family allocates, where it allocates fewer
            than the rule lists (a backend without ``get_kv_cache_stride_order`` has one
            physical order whatever ``get_kv_cache_layout()`` says: 0.26 FlexAttention is
            NHD only, 0.26 ROCm AITER HND only).
        block_sizes: the tensor block sizes (kernel blocks) the backend runs with, where it
            restricts them (0.33 B12X ``get_supported_kernel_block_sizes() == (64, 128)``);
            empty: any.
        head_sizes: the head sizes the backend accepts (``get_supported_head_sizes()``), checked
            where the head size is known (a ``head_size`` hint, or one derived from
            ``num_kv_heads``); empty: any.
    """

    label: str
    eras: tuple[str, ...]
    families: tuple[str, ...]
    rank: int
    logical: tuple[str, ...]
    layouts: dict[str, tuple[str, ...] | str]
    sources: tuple[Source, ...]
    transform: str = ""
    gate: str = "gpu"
    physical_ok: bool = False
    mla: bool = False
    blocked: bool = False
    backends_label: tuple[str, ...] = field(default=())
    requires: tuple[tuple[str, bool], ...] = ()
    planes: str = ""
    only: dict[str, tuple[str, ...]] = field(default_factory=dict)
    block_sizes: tuple[int, ...] = ()
    head_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # an era label that is not an era would silently match nothing
        unknown = [e for e in self.eras if e not in ERAS]
        if unknown:
            raise ValueError(f"vLLM rule {self.label!r}: eras {unknown} are not layout eras {ERAS} (kvcore_vllm.releases)")


def _src(version: str, file: str) -> Source:
    return Source(engine="vllm", version=version, file=file)


#: vLLM CPU_ATTN's kernel paths and the planes each packs a (block, head) run into: the
#: column-major K of every non-AMX path (``csrc/cpu/cpu_attn_vec.hpp``, inherited by vec16 and the
#: other ISAs' ``reshape_and_cache``), and AMX's tiles (``csrc/cpu/cpu_attn_amx.hpp``). Proven by
#: vLLM's writer op (``plugins/vllm/tests/engine``).
CPU_VEC = "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
CPU_AMX = "K=NL_X_NB_NH_BSC_HSC_BSE_HSE+V=NL_X_NB_NH_HSC_BSC_HSE_BSE"
_CPU_PATHS = (
    ("vec/vec16 (K column-major)", CPU_VEC, "cpu_vec", False, "csrc/cpu/cpu_attn_vec.hpp::reshape_and_cache (K [HS, BS], V [BS, HS])"),
    (
        "amx (AMX tiles)",
        CPU_AMX,
        "cpu_amx",
        True,
        "csrc/cpu/cpu_attn_amx.hpp::reshape_and_cache (K [BS/16, HS/2, 16, 2], V [HS/16, BS/2, 16, 2])",
    ),
)

RULES: tuple[Rule, ...] = (
    Rule(
        label="FlashAttention K/V-major (2, NB, BS, NH, HS)",
        eras=("0.11", "0.13"),
        families=("FLASH_ATTN", "FLEX_ATTENTION", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED"),
        rank=5,
        logical=_o("TWO NB BS NH HS"),
        layouts={
            "NHD": _o("NL TWO NB BS NH HS"),
            "HND": _o("NL TWO NB NH BS HS"),
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
        layouts={"NHD/cross": _o("NB NL TWO BS NH HS"), "HND/cross": _o("NB NH NL TWO BS HS")},
        sources=(_src("0.13.0", _XL + "; FA stride order NHD (2,0,1,3,4,5), HND (2,4,0,1,3,5)"),),
        backends_label=("FLASH_ATTN",),
    ),
    Rule(
        label="FlashInfer blocks-first (NB, 2, BS, NH, HS)",
        eras=("0.11", "0.13", "0.24"),
        families=("FLASHINFER",),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts={"NHD": _o("NL NB TWO BS NH HS"), "HND": _o("NL NB TWO NH BS HS")},
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
        layouts={"NHD/cross": _o("NB NL TWO BS NH HS"), "HND/cross": _o("NB TWO NH NL BS HS")},
        sources=(_src("0.13.0", _XL + "; FlashInfer stride order NHD (1,0,2,3,4,5), HND (1,2,4,0,3,5)"), _src("0.24.0", _FI)),
        backends_label=("FLASHINFER",),
    ),
    Rule(
        label="Triton blocks-first (NB, 2, BS, NH, HS), no stride order",
        eras=("0.11", "0.13"),
        families=("TRITON_ATTN",),
        rank=5,
        logical=_o("NB TWO BS NH HS"),
        layouts={"NHD": _o("NL NB TWO BS NH HS")},
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
        layouts={"NHD": _o("NL NB TWO BS NH HS"), "HND": _o("NL NB TWO NH BS HS")},
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
        layouts={"NHD": _o("NL NB BS TWO NH HS"), "NHD/cross": _o("NB NL BS TWO NH HS")},
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
        layouts={"NHD/cross": _o("NB NL TWO BS NH HS"), "HND/cross": _o("NB NH NL TWO BS HS")},
        sources=(_src("0.24.0", _XL + "; FA and Triton stride order NHD (1,0,2,3,4,5), HND (1,4,0,2,3,5)"),),
        backends_label=("FLASH_ATTN", "TRITON_ATTN"),
    ),
    Rule(
        label="0.26-0.28 packed K|V (NB, NH, BS, 2*HS)",
        eras=("0.26",),
        families=GPU_FAMILIES + ("ROCM_AITER_FA", "ROCM_AITER_UNIFIED"),
        rank=4,
        logical=_o("NB NH BS CS"),
        layouts={
            "NHD": _o("NL NB BS NH CS"),
            "HND": _o("NL NB NH BS CS"),
            "NHD/cross": _o("NB NL BS NH CS"),
            "HND/cross": _o("NB NH NL BS CS"),
        },
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
    Rule(
        label="0.29+ FlexAttention view [NB, NH, BS, C], LBNHC only",
        eras=(LAYOUT_ERA,),
        families=("FLEX_ATTENTION",),
        rank=4,
        logical=_o("NB NH BS CS"),
        layouts={"LBNHC": _o("NL NB BS NH CS")},
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
        layouts={m: layout_physical_order(m) for m in KV_CACHE_LAYOUTS},
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
        layouts={"LBHNC": _o("NL NB NH BS CS"), "LHBNC": _o("NL NH NB BS CS")},
        sources=(_src("0.33.0", "rocm_aiter_fa.py / rocm_aiter_unified_attn.py::supported_kv_cache_layouts (LBHNC, LHBNC)"),),
        backends_label=("ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"),
    ),
    Rule(
        label="CPU 0.11 TORCH_SDPA without IPEX (2, NB, BS*NH*HS) read by split_kv_cache",
        eras=("0.11",),
        families=("CPU",),
        rank=3,
        logical=_o("TWO NB NH HS BS"),
        layouts={"*": SPLIT_KV},
        sources=(
            _src("0.11.0", _CPU + "::_PagedAttention.get_kv_cache_shape / split_kv_cache (K (NB, NH, HS/x, BS, x), V (NB, NH, HS, BS))"),
        ),
        transform="paged",
        gate="cpu",
        requires=(("use_ipex", False),),
        backends_label=("TORCH_SDPA",),
        planes="split_kv",
    ),
    Rule(
        label="CPU 0.11 TORCH_SDPA with IPEX (2, NB, BS*NH*HS) viewed (NB, NH, BS, HS)",
        eras=("0.11",),
        families=("CPU",),
        rank=3,
        logical=_o("TWO NB NH BS HS"),
        # beside Mamba layers: CPUModelRunner inherits GPUModelRunner's restride (platforms/cpu.py
        # support_hybrid_kv_cache() is True): per block the K side's (NH, BS, HS), then the V side's
        layouts={"*": _o("NL TWO NB NH BS HS"), "*/mamba": _o("NL NB TWO NH BS HS")},
        sources=(
            _src("0.11.0", _CPU + "::_IPEXPagedAttention.split_kv_cache: view(num_blocks, num_kv_heads, -1, head_size)"),
            _src("0.11.0", HYBRID_SOURCE + "; v1/worker/cpu_model_runner.py::CPUModelRunner(GPUModelRunner)"),
        ),
        transform="paged_ipex",
        gate="cpu",
        requires=(("use_ipex", True),),
        backends_label=("TORCH_SDPA",),
    ),
    Rule(
        label="ROCm prefill-decode paged (2, NB, BS, NH, HS) read by split_kv_cache",
        eras=("0.11",),
        families=("ROCM_ATTN",),
        rank=5,
        logical=_o("TWO NB NH HS BS"),
        layouts={"*": SPLIT_KV},
        sources=(_src("0.11.0", _ROCM + "::RocmAttentionImpl.forward with VLLM_V1_USE_PREFILL_DECODE_ATTENTION=1: " + _SPLIT),),
        transform="paged5",
        gate="rocm",
        requires=(("prefill_decode_attention", True),),
        backends_label=("ROCM_ATTN",),
        planes="split_kv",
    ),
    Rule(
        label="ROCm paged (2, NB, BS, NH, HS) read by split_kv_cache",
        eras=("0.13", "0.24", "0.26"),
        families=("ROCM_ATTN",),
        rank=5,
        logical=_o("TWO NB NH HS BS"),
        layouts={"*": SPLIT_KV},
        sources=(
            _src("0.13.0", _ROCM + "::RocmAttentionImpl.forward: " + _SPLIT),
            _src("0.24.0", _ROCM + "; v1/attention/ops/paged_attn.py::PagedAttention.split_kv_cache"),
            _src("0.26.0", _ROCM + "; v1/attention/ops/paged_attn.py::PagedAttention.split_kv_cache"),
        ),
        transform="paged5",
        gate="rocm",
        backends_label=("ROCM_ATTN",),
        planes="split_kv",
    ),
    Rule(
        label="ROCm 0.29+ K/V head slots [NB, 2, BS, NH*HS] read by split_kv_cache",
        eras=(LAYOUT_ERA,),
        families=("ROCM_ATTN",),
        rank=4,
        logical=_o("NB TWO NH HS BS"),
        # each plane's own order is (NB, NH, ...) under both layouts: LBHNC puts a block's K and V
        # slots side by side, LHBNC every block's K slot before every V slot (the planes' strides)
        layouts={"LBHNC": SPLIT_KV, "LHBNC": SPLIT_KV},
        sources=(
            _src(
                "0.33.0",
                _ROCM + "::RocmAttentionBackend.customize_spec (num_head_slots=2, C = NH*HS*dtype); forward "
                "split_kv_cache(kv_cache.transpose(0, 1), ...)",
            ),
        ),
        transform="head_slots",
        gate="rocm",
        backends_label=("ROCM_ATTN",),
        planes="split_kv",
    ),
    Rule(
        label="ROCm 0.32+ ROCM_SEGMENTED_ATTN K/V head slots [NB, 2, BS, NH*HS] read token-major",
        eras=(LAYOUT_ERA,),
        families=("ROCM_SEGMENTED",),
        rank=4,
        # RocmSegmentedAttentionImpl._split_kv_cache: kv_cache[:, 0] / kv_cache[:, 1], each .unflatten(-1, (NH, HS)):
        # slot 0 holds the block's K as [BS, NH, HS] rows, slot 1 its V
        logical=_o("NB TWO BS NH HS"),
        # LBHNC: a block's K slot beside its V slot; LHBNC: every block's K slot, then every block's V slot
        layouts={"LBHNC": _o("NL NB TWO BS NH HS"), "LHBNC": _o("NL TWO NB BS NH HS")},
        sources=(
            _src(
                "0.33.0",
                _RSEG + "::RocmSegmentedAttentionBackend(RocmAttentionBackend): inherits rocm_attn.py::customize_spec "
                "(num_head_slots=2, state_content_bytes = NH*HS*dtype size) and supported_kv_cache_layouts (LHBNC, LBHNC); "
                "RocmSegmentedAttentionImpl._split_kv_cache: kv_cache[:, 0].unflatten(-1, (NH, HS)), kv_cache[:, 1] likewise "
                "(do_kv_cache_update: triton_reshape_and_cache_flash)",
            ),
        ),
        transform="head_slots_nhd",
        gate="rocm",
        backends_label=("ROCM_SEGMENTED_ATTN",),
        head_sizes=(64, 128, 256),  # RocmSegmentedAttentionBackend.get_supported_head_sizes
    ),
    Rule(
        label="0.30+ B12X K/V head slots [NB, 2, BS, NH*HS] read token-major",
        eras=(LAYOUT_ERA,),
        families=("B12X",),
        rank=4,
        # B12xPagedAttentionImpl._kv_cache_views: kv_cache.unbind(1), each .unflatten(-1, (NH, HS))
        logical=_o("NB TWO BS NH HS"),
        layouts={"LBHNC": _o("NL NB TWO BS NH HS"), "BLHNC": _o("NB NL TWO BS NH HS")},
        sources=(
            _src(
                "0.33.0",
                _B12X + "::B12xPagedAttentionBackend.customize_spec (num_head_slots=2, state_content_bytes = NH*HS*dtype "
                "size), supported_kv_cache_layouts (LBHNC, BLHNC); B12xPagedAttentionImpl._kv_cache_views: "
                "kv_cache.unbind(1), unflatten(-1, (NH, HS)) (do_kv_cache_update: reshape_and_cache_flash)",
            ),
        ),
        transform="head_slots_nhd",
        gate="cuda",  # supports_compute_capability: SM 12.0 / 12.1 only
        backends_label=("B12X",),
        block_sizes=(64, 128),  # get_supported_kernel_block_sizes() == _B12X_SUPPORTED_PAGE_SIZES
        head_sizes=(64, 128, 192, 256),  # get_supported_head_sizes
    ),
    *(
        Rule(
            label=f"CPU 0.13 (2, NB, NH, BS, HS), {path}",
            eras=("0.13",),
            families=("CPU",),
            rank=5,
            logical=_o("TWO NB NH BS HS"),
            # beside Mamba layers: CPUModelRunner inherits GPUModelRunner._update_hybrid_attention_mamba_layout
            # (platforms/cpu.py support_hybrid_kv_cache() is True): strides (hidden, 2*hidden, BS*HS, HS, 1); the
            # kernel packs each (block, head) run of the K and V halves as below either way
            layouts={"HND": planes, "HND/mamba": planes},
            sources=(
                _src("0.13.0", _CPU + "::CPUAttentionBackend.get_kv_cache_shape (2, NB, NH, BS, HS); forward unbind(0)"),
                _src("0.13.0", _CPU + "::_get_attn_isa; " + kernel),
                _src("0.13.0", HYBRID_SOURCE + "; v1/worker/cpu_model_runner.py::CPUModelRunner(GPUModelRunner)"),
            ),
            gate="cpu",
            backends_label=("CPU_ATTN",),
            planes=builder,
            requires=(("cpu_amx", amx),),
        )
        for path, planes, builder, amx, kernel in _CPU_PATHS
    ),
    *(
        Rule(
            label=f"CPU 0.24+ [NB, NH, BS, 2*HS] (per block and head: K, then V), {path}",
            eras=("0.24", "0.26", LAYOUT_ERA),
            families=("CPU",),
            rank=4,
            logical=_o("NB NH TWO BS HS"),
            layouts={"HND": planes},
            sources=(
                _src(
                    "0.24.0",
                    _CPU + "::CPUAttentionBackend.get_kv_cache_shape (NB, NH, BS, 2*HS); forward view(NB, NH, 2*BS, -1).chunk(2, "
                    "dim=2) (the container the kernel packs into)",
                ),
                _src("0.32.0", _CPU + "::_get_attn_isa; " + kernel),
                _src("0.33.0", _CPU + "; supported_kv_cache_layouts() = (LBHNC,)"),
            ),
            transform="kv_rows",
            gate="cpu",
            backends_label=("CPU_ATTN",),
            planes=builder,
            requires=(("cpu_amx", amx),),
        )
        for path, planes, builder, amx, kernel in _CPU_PATHS
    ),
    Rule(
        label="TPU Pallas (NB, BS, 2*NH, ceil128(HS)), K/V interleaved per head",
        eras=("0.11", "0.13"),
        families=("PALLAS",),
        rank=4,
        logical=_o("NB BS NH TWO HS"),
        layouts={"NHD": _o("NL NB BS NH TWO HS")},
        sources=(_src("0.11.0", _PALLAS + " (l.100); write_to_kv_cache cat([k, v], -1).reshape(-1, 2H, D)"),),
        transform="pallas",
        gate="tpu",
        backends_label=("PALLAS",),
    ),
    Rule(
        label="MLA latent (NB, BS, W): 576 for DeepSeek, any width",
        eras=ERAS,
        families=("MLA",),
        rank=3,
        logical=_o("NB BS HS"),
        layouts={"*": _o("NL NB BS HS"), "*/cross": _o("NB NL BS HS")},
        sources=(
            _src("0.11.0", _MLA + " (l.284)"),
            _src("0.13.0", _XL + "; MLA stride order (1,0,2,3) over (L, NB, BS, 576) (0.13-0.26)"),
            _src("0.11.0", "vllm/v1/attention/backends/mla/flashmla_sparse.py::get_kv_cache_shape (l.74) fp8_ds_mla (NB, BS, 656) uint8"),
            _src("0.33.0", "vllm/model_executor/layers/attention/mla_attention.py::MLAAttention.bind_kv_cache (l.748) squeeze(1)"),
            _src("0.33.0", "mla_attention.py l.1371: state_content_bytes 656 (fp8_ds_mla), 352 (nvfp4_ds_mla) per stored state"),
            _src("0.33.0", _V4 + "::_rope_quant_insert_mxfp8_kernel (528 B) / _rope_quant_insert_nvfp4_kernel (288 B): per-token records"),
        ),
        gate="",
        mla=True,
        backends_label=("FLASHMLA", "FLASHMLA_SPARSE", "TRITON_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA"),
    ),
    Rule(
        label="0.29+ MLA view [NB, 1, BS, C]",
        eras=(LAYOUT_ERA,),
        families=("MLA",),
        rank=4,
        logical=_o("NB BS HS"),
        # MLA's one head is squeezed (MLAAttention.bind_kv_cache): each member's order without H
        layouts={m: layout_physical_order(m, ("NL", "NB", "", "BS", "HS")) for m in KV_CACHE_LAYOUTS},
        sources=(
            _src(
                "0.29.0", "vllm/model_executor/layers/attention/mla_attention.py::MLAAttention.bind_kv_cache squeeze(1) (0.29.0 - 0.33.0)"
            ),
            _src("0.33.0", _V33 + "; MLAAttentionSpec.head_size_v = 0 (C = 576 * dtype_size)"),
        ),
        transform="squeeze_head",
        gate="",
        mla=True,
        backends_label=("FLASHMLA", "FLASHMLA_SPARSE", "TRITON_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA"),
    ),
    Rule(
        label="blocked-scale pages (NB, BS, W) uint8 (DSA indexer keys 132 / MXFP4 68; DeepSeek-V4 fp8_ds_mla 584)",
        eras=ERAS,
        families=("MLA",),
        rank=3,
        logical=_o("NB BS HS"),
        layouts={"*": _o("NL NB BSV BSS")},
        sources=(
            _src("0.11.0", _IDX + " (l.36); head_size 128 + 4 = 132, uint8"),
            _src(
                "0.24.0",
                "vllm/models/deepseek_v4/common/ops/cache_utils.py::quantize_and_insert_k_kernel (584 B: 576 B rows, then 8 B scales)",
            ),
            _src("0.33.0", _V4 + "::_rope_quant_insert_kernel (584); vllm/models/deepseek_v41/common/ops/indexer_k_store.py (132, 68)"),
        ),
        gate="",
        mla=True,
        blocked=True,
        backends_label=("FLASHMLA_SPARSE", "indexer"),
    ),
    Rule(
        label="0.29+ blocked-scale view [NB, 1, BS, W]",
        eras=(LAYOUT_ERA,),
        families=("MLA",),
        rank=4,
        logical=_o("NB BS HS"),
        layouts={m: layout_physical_order(m, ("NL", "NB", "", "BSV", "BSS")) for m in KV_CACHE_LAYOUTS},
        sources=(_src("0.33.0", _V33 + "; MLAAttentionSpec state_content_bytes (mla_attention.py l.1371)"),),
        transform="squeeze_head",
        gate="",
        mla=True,
        blocked=True,
        backends_label=("FLASHMLA_SPARSE", "indexer"),
    ),
    Rule(
        label="0.29+ blocked-scale bound view (NB, BS, W) of a block-outermost layout",
        eras=(LAYOUT_ERA,),
        families=("MLA",),
        rank=3,
        logical=_o("NB BS HS"),
        # the 4-D [NB, 1, BS, W] view squeezed by the layer's bind_kv_cache (what attn.kv_cache holds): under
        # BLHNC / BLNHC / BHLNC the layers' pages interleave per block, one cross-layer buffer
        layouts={"*/cross": _o("NB NL BSV BSS")},
        sources=(
            _src(
                "0.33.0",
                "vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache.bind_kv_cache (kv_cache.squeeze(1)); " + _V33,
            ),
        ),
        gate="",
        mla=True,
        blocked=True,
        backends_label=("FLASHMLA_SPARSE", "indexer"),
    ),
    Rule(
        label="ROCm DSA indexer page (NB, BS, 132) uint8: 16x16-byte key tiles, then the scales",
        eras=("0.24", "0.26", LAYOUT_ERA),
        families=("MLA",),
        rank=3,
        logical=_o("NB BS HS"),
        layouts={"*": ROCM_INDEXER},
        sources=(
            _src("0.24.0", _RIDX),
            _src("0.33.0", _RIDX + "; vllm/models/deepseek_v32/amd/rocm.py::DeepseekV32ROCmIndexerCache.uses_shuffled_layout"),
        ),
        gate="rocm?",
        mla=True,
        blocked=True,
        backends_label=("ROCM_AITER_MLA_SPARSE", "indexer"),
        planes="rocm_tiles",
    ),
    Rule(
        label="ROCm 0.29+ DSA indexer view [NB, 1, BS, 132]: 16x16-byte key tiles, then the scales",
        eras=(LAYOUT_ERA,),
        families=("MLA",),
        rank=4,
        logical=_o("NB BS HS"),
        # block-outermost members (B first) interleave the layers' pages per block: one cross-layer buffer
        layouts={m: ROCM_INDEXER_CROSS if KV_CACHE_LAYOUT_ORDERS[m][0] == 1 else ROCM_INDEXER for m in KV_CACHE_LAYOUTS},
        sources=(_src("0.33.0", _V33 + "; " + _RIDX),),
        transform="squeeze_head",
        gate="rocm?",
        mla=True,
        blocked=True,
        backends_label=("ROCM_AITER_MLA_SPARSE", "indexer"),
        planes="rocm_tiles",
    ),
    Rule(
        label="ROCm 0.29+ DSA indexer bound view (NB, BS, 132) of a block-outermost layout: key tiles, then the scales",
        eras=(LAYOUT_ERA,),
        families=("MLA",),
        rank=3,
        logical=_o("NB BS HS"),
        layouts={"*/cross": ROCM_INDEXER_CROSS},
        sources=(
            _src(
                "0.33.0",
                "vllm/models/deepseek_v32/amd/rocm.py::DeepseekV32ROCmIndexerCache (bind_kv_cache inherited from "
                "deepseek_v2.py::DeepseekV32IndexerCache: squeeze(1)); " + _V33 + "; " + _RIDX,
            ),
        ),
        gate="rocm?",
        mla=True,
        blocked=True,
        backends_label=("ROCM_AITER_MLA_SPARSE", "indexer"),
        planes="rocm_tiles",
    ),
)


def physical_name(order: Sequence[str] | str) -> str:
    """``("NL","TWO","NB",...)`` -> ``NL_X_TWO_NB_...``; ``NL`` inside -> one tensor name; a
    multi-plane name (a plane rule's layout) is itself."""
    if isinstance(order, str):
        return order
    toks = list(order)
    if toks[0] == "NL":
        return "NL_X_" + "_".join(toks[1:])
    return "_".join(toks)


# -- zero-copy view transforms -------------------------------------------------------


def _t_squeeze_head(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.29+ MLA: [B, 1, N, C] -> [B, N, C] (MLAAttention.bind_kv_cache squeezes dim 1)
    return t.squeeze(1) if t.shape[1] == 1 else None


def _t_kv_rows(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.33 CPU: [B, H, N, C] viewed as [B, H, 2N, C/2] and chunk(2, dim=2) -> [B, H, 2, N, C/2]
    b, nh, n, c = t.shape
    if c % 2 or t.stride(3) != 1 or (n > 1 and t.stride(2) != c):
        return None
    d = c // 2
    return torch.as_strided(t, (b, nh, 2, n, d), (t.stride(0), t.stride(1), n * d, d, 1), t.storage_offset())


def flat_geometry(flat: int, h: VllmHints) -> tuple[int, int, int] | None:
    """``(block_size, num_kv_heads, head_size)`` of vLLM 0.11 TORCH_SDPA's flat row
    (``cpu_attn.py::_PagedAttention.get_kv_cache_shape``: ``(2, NB, BS*NH*HS)``, ``flat``
    elements per block and side) from the hints: any two of the three fix the third
    (``flat`` divided by their product). None when fewer than two are given, when the third
    is not a whole number, or when all three are given and their product is not ``flat``
    (:func:`flat_misfit` says which)."""
    n, nh, d = h.block_size, h.num_kv_heads, h.head_size
    if sum(x is not None for x in (n, nh, d)) < 2:
        return None
    if n is None:
        n, rest = divmod(flat, nh * d)
    elif nh is None:
        nh, rest = divmod(flat, n * d)
    elif d is None:
        d, rest = divmod(flat, n * nh)
    else:
        rest = flat - n * nh * d
    if rest or not (n and nh and d):
        return None
    return n, nh, d


def flat_misfit(flat: int, h: VllmHints) -> str | None:
    """Why the hints cannot split 0.11 TORCH_SDPA's flat row of ``flat`` elements (two or
    three of block_size, num_kv_heads, head_size given), or None."""
    given = {k: v for k, v in (("block_size", h.block_size), ("num_kv_heads", h.num_kv_heads), ("head_size", h.head_size)) if v}
    if len(given) < 2 or flat_geometry(flat, h) is not None:
        return None
    said = " * ".join(f"{k}={v}" for k, v in given.items())
    prod = 1
    for v in given.values():
        prod *= v
    if len(given) == 3:
        return f"{said} = {prod}, but each block holds {flat} elements per side (block_size*num_kv_heads*head_size); fix a hint"
    other = next(k for k in ("block_size", "num_kv_heads", "head_size") if k not in given)
    return f"{said} = {prod} does not divide the {flat} elements per block and side (block_size*num_kv_heads*head_size): no whole {other} fits; fix a hint"


def _t_paged(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.11 CPU: (2, B, N*H*D) -> V's view (2, B, H, D, N); needs two of block_size, num_kv_heads, head_size
    two, b, flat = t.shape
    g = flat_geometry(flat, h)
    if g is None or t.stride(2) != 1:
        return None
    n, nh, d = g
    return torch.as_strided(t, (two, b, nh, d, n), (t.stride(0), t.stride(1), d * n, n, 1), t.storage_offset())


def _t_paged5(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # ROCm <= 0.2x: (2, NB, BS, NH, HS) allocated contiguous, read as the paged layout -> V's view (2, NB, NH, HS, BS)
    two, b, n, nh, d = t.shape
    if (d > 1 and t.stride(4) != 1) or (nh > 1 and t.stride(3) != d) or (n > 1 and t.stride(2) != nh * d):
        return None
    return torch.as_strided(t, (two, b, nh, d, n), (t.stride(0), t.stride(1), d * n, n, 1), t.storage_offset())


def _t_head_slots(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # ROCm 0.29+: [NB, 2, BS, C], C = NH*HS; each head slot's BS*C run is read by split_kv_cache as
    # V (NH, HS, BS) (K in 16-byte chunks, the spec's concern) -> V's view [NB, 2, NH, HS, BS].
    # NH by the hints, else one head of C: the bytes of a slot's run do not depend on NH.
    b, two, n, c = t.shape
    if two != 2 or (c > 1 and t.stride(3) != 1) or (n > 1 and t.stride(2) != c):
        return None
    if h.num_kv_heads:
        nh = h.num_kv_heads
    elif h.head_size and c % h.head_size == 0:
        nh = c // h.head_size
    else:
        nh = 1
    if c % nh:
        return None
    d = c // nh
    return torch.as_strided(t, (b, two, nh, d, n), (t.stride(0), t.stride(1), d * n, n, 1), t.storage_offset())


def _slot_heads(t: torch.Tensor, c: int, h: VllmHints) -> int | None:
    """The KV heads of a 0.29+ head slot of ``c`` elements (``C = NH*HS``): ``num_kv_heads``,
    else ``C // head_size``, else one head of ``C`` (the slot's bytes do not depend on how
    its row splits into heads; pass ``num_kv_heads`` for the head geometry). ``head_size``
    is in elements: an int8 byte view divides by the element size of ``dtype``."""
    if h.num_kv_heads:
        return h.num_kv_heads if c % h.num_kv_heads == 0 else None
    if h.head_size:
        el = h.element_dtype() if t.dtype == torch.int8 else None
        width = h.head_size * (torch.empty(0, dtype=el).element_size() if el is not None else 1)
        return c // width if c % width == 0 else None
    return 1


def _t_head_slots_nhd(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.30+ B12X / 0.32+ ROCM_SEGMENTED_ATTN: [NB, 2, BS, C], C = NH*HS, each slot read token-major:
    # kv_cache.unbind(1) (kv_cache[:, i]) then .unflatten(-1, (NH, HS)) -> [NB, 2, BS, NH, HS]
    b, two, n, c = t.shape
    if two != 2 or (c > 1 and t.stride(3) != 1):
        return None
    nh = _slot_heads(t, c, h)
    if nh is None:
        return None
    d = c // nh
    return torch.as_strided(t, (b, two, n, nh, d), (t.stride(0), t.stride(1), t.stride(2), d, 1), t.storage_offset())


def _t_paged_ipex(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.11 CPU with IPEX: (2, B, N*H*D) -> (2, B, H, N, D) (_IPEXPagedAttention.split_kv_cache)
    two, b, flat = t.shape
    g = flat_geometry(flat, h)
    if g is None or t.stride(2) != 1:
        return None
    n, nh, d = g
    return torch.as_strided(t, (two, b, nh, n, d), (t.stride(0), t.stride(1), n * d, d, 1), t.storage_offset())


def _t_pallas(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # (B, N, 2H, P) -> (B, N, H, 2, D): K and V alternate on the head axis; D = head_size (<= P)
    b, n, h2, p = t.shape
    if h2 % 2 or t.stride(3) != 1:
        return None
    d = h.head_size or p
    if d > p:
        return None
    return torch.as_strided(t, (b, n, h2 // 2, 2, d), (t.stride(0), t.stride(1), 2 * t.stride(2), t.stride(2), 1), t.storage_offset())


# -- plane builders: one layer's view -> its planes ------------------------------------


def _p_split_kv(v: torch.Tensor, tokens: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """``PagedAttention.split_kv_cache`` (vLLM 0.11 ``attention/ops/paged_attn.py``, 0.24+
    ``v1/attention/ops/paged_attn.py``; 0.11 CPU ``cpu_attn.py::_PagedAttention``): the K slot's
    ``NH*HS*BS`` run per block viewed ``(NH, HS/x, BS, x)``, x = 16 // element_size, the V slot's
    ``(NH, HS, BS)``. ``v`` is the V-shaped view of both slots (``TWO`` among ``tokens``, the
    rest ``NB NH HS BS``) in the element dtype."""
    two = list(tokens).index("TWO")
    k, val = v.select(two, 0), v.select(two, 1)
    nb, nh, hs, bs = k.shape
    x = K_CHUNK_BYTES // v.element_size()
    if x < 1 or hs % x:
        return None  # vLLM's view(num_blocks, num_kv_heads, head_size // x, -1, x) needs x | head_size
    sb, sh, sd, sn = k.stride()
    if (bs > 1 and sn != 1) or (hs > 1 and sd != bs):
        return None
    key = torch.as_strided(k, (nb, nh, hs // x, bs, x), (sb, sh, bs * x, x, 1), k.storage_offset())
    return {"K": key, "V": val}


def _p_rocm_tiles(v: torch.Tensor, tokens: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """ROCm's DSA indexer page (vLLM 0.24+ ``rocm_aiter_mla_sparse.py::
    indexer_k_quant_and_cache_triton``, ``LAYOUT == "SHUFFLE"``): one block's ``BS*W`` bytes
    are the values ``[BS/16, HV/16, 16 tokens, 16 bytes]`` (HV = W - scale bytes), then each
    token's scale bytes. ``v`` is one layer's ``[NB, BS, W]`` uint8."""
    nb, bs, w = v.shape
    s = BLOCKED_SCALE_RECORDS.get(w)
    if s is None:
        return None
    hv = w - s
    bt, ht = ROCM_TILE_TOKENS, ROCM_TILE_BYTES
    if bs <= 1 or bs % bt or hv % ht or v.stride(2) != 1 or v.stride(1) != w:
        return None  # kv_cache.view(num_blocks, -1): each block one contiguous BS*W run
    sb, off = v.stride(0), v.storage_offset()
    key = torch.as_strided(v, (nb, bs // bt, hv // ht, bt, ht), (sb, bt * hv, bt * ht, ht, 1), off)
    scale = torch.as_strided(v, (nb, bs, s), (sb, s, 1), off + bs * hv)
    return {"K": key, "KS": scale}


def _kv_regions(v: torch.Tensor, tokens: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The K and V regions of a CPU_ATTN view (``TWO`` among ``tokens``, the rest
    ``NB NH BS HS``): each ``[NB, NH, BS, HS]`` with one tight ``BS*HS`` run per (block, head),
    the container vLLM's CPU kernel packs into. None when a region is not tight."""
    two = list(tokens).index("TWO")
    k, val = v.select(two, 0), v.select(two, 1)
    for x in (k, val):
        _, _, bs, hs = x.shape
        if (hs > 1 and x.stride(3) != 1) or (bs > 1 and x.stride(2) != hs):
            return None
    return k, val


def _p_cpu_vec(v: torch.Tensor, tokens: Sequence[str], h: VllmHints) -> dict[str, torch.Tensor] | None:
    """vLLM CPU_ATTN's vec / vec16 / neon / vsx / vxe / rvv kernels (0.13-0.33,
    ``csrc/cpu/cpu_attn_vec.hpp`` ``AttentionImpl<ISA::VEC>::reshape_and_cache``: "reshape K
    as column-major and V as row-major"): per (block, head), K is ``[HS, BS]`` (a token's
    elements ``BS`` apart), V ``[BS, HS]``. Proven by vLLM's writer
    (``vllm._custom_ops.cpu_attn_reshape_and_cache``, ``tests/engine``)."""
    r = _kv_regions(v, tokens)
    if r is None:
        return None
    k, val = r
    if h.cpu_attn_isa == "neon" and (k.dtype == torch.bfloat16 or h.dtype == torch.bfloat16):
        raise DetectionError(
            "vLLM CPU_ATTN on Arm with a bfloat16 model runs the NEON BFMMLA kernel (csrc/cpu/cpu_attn_neon_bfmmla.hpp), "
            "which packs K and V in BFMMLA tiles kvcore-vllm does not read (not claimed); float16 and float32 caches on "
            "Arm (neon) are read"
        )
    nb, nh, bs, hs = k.shape
    key = torch.as_strided(k, (nb, nh, hs, bs), (k.stride(0), k.stride(1), bs, 1), k.storage_offset())
    return {"K": key, "V": val}


#: vLLM CPU AMX tiles (``csrc/cpu/cpu_attn_amx.hpp``): K in tiles of 16 tokens x 2 elements
#: (the VNNI pair), V in tiles of 2 tokens x 16 elements.
AMX_K_TOKENS, AMX_K_ELEMS = 16, 2
AMX_V_TOKENS, AMX_V_ELEMS = 2, 16
#: the block and head sizes vLLM's ``_get_attn_isa`` chooses AMX for (``block_size % 32``;
#: 0.26+ ``head_size % 32``: smaller multiples of 16 take ``vec16``)
AMX_MULTIPLE = 32


def _p_cpu_amx(v: torch.Tensor, tokens: Sequence[str], h: VllmHints) -> dict[str, torch.Tensor] | None:
    """vLLM CPU_ATTN's AMX kernel (``cpu_attn.py::_get_attn_isa`` returns ``amx`` for a
    bfloat16 model with ``block_size % 32 == 0`` on a CPU with AMX tiles;
    ``csrc/cpu/cpu_attn_amx.hpp`` ``reshape_and_cache``): per (block, head), K is
    ``[BS/16, HS/2, 16, 2]`` (VNNI pairs of elements, 16 tokens a tile), V
    ``[HS/16, BS/2, 16, 2]`` (pairs of tokens, 16 elements a tile); an fp8 cache keeps the same
    element order. Proven by vLLM's writer (``tests/engine``). None where vLLM would not
    choose AMX (not bfloat16, or a block or head size that is no multiple of 32)."""
    r = _kv_regions(v, tokens)
    if r is None:
        return None
    k, val = r
    nb, nh, bs, hs = k.shape
    if bs % AMX_MULTIPLE or hs % AMX_MULTIPLE:
        return None
    if k.dtype in _BYTE_DTYPES or is_fp8(k.dtype):
        model = h.dtype if h.dtype is not None and not is_fp8(h.dtype) else None
        if model is not None and model != torch.bfloat16:
            return None
    elif k.dtype != torch.bfloat16:
        return None
    sb, sh = k.stride(0), k.stride(1)
    key = torch.as_strided(
        k,
        (nb, nh, bs // AMX_K_TOKENS, hs // AMX_K_ELEMS, AMX_K_TOKENS, AMX_K_ELEMS),
        (sb, sh, AMX_K_TOKENS * hs, AMX_K_TOKENS * AMX_K_ELEMS, AMX_K_ELEMS, 1),
        k.storage_offset(),
    )
    value = torch.as_strided(
        val,
        (nb, nh, hs // AMX_V_ELEMS, bs // AMX_V_TOKENS, AMX_V_ELEMS, AMX_V_TOKENS),
        (sb, sh, AMX_V_ELEMS * bs, AMX_V_ELEMS * AMX_V_TOKENS, AMX_V_TOKENS, 1),
        val.storage_offset(),
    )
    return {"K": key, "V": value}


PLANE_BUILDERS: dict[str, Callable[[torch.Tensor, Sequence[str], VllmHints], dict[str, torch.Tensor] | None]] = {
    "split_kv": lambda v, tokens, h: _p_split_kv(v, tokens),
    "rocm_tiles": lambda v, tokens, h: _p_rocm_tiles(v, tokens),
    "cpu_vec": _p_cpu_vec,
    "cpu_amx": _p_cpu_amx,
}


def _element_view(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    """A 0.29+ int8 byte view as the cache's element dtype (the split reading's V has tokens
    one *element* apart, so it cannot be read in bytes); other tensors unchanged. None when
    the element dtype is unknown or the view impossible."""
    if t.dtype != torch.int8:
        return t
    el = h.element_dtype()
    if el is None:
        return None
    esz = torch.empty(0, dtype=el).element_size()
    if esz == 1:
        return t
    if t.stride(-1) != 1 or t.shape[-1] % esz:
        return None
    return t.view(el)


TRANSFORMS: dict[str, Callable[[torch.Tensor, VllmHints], torch.Tensor | None]] = {
    "squeeze_head": _t_squeeze_head,
    "kv_rows": _t_kv_rows,
    "paged": _t_paged,
    "pallas": _t_pallas,
    "paged5": _t_paged5,
    "head_slots": _t_head_slots,
    "head_slots_nhd": _t_head_slots_nhd,
    "paged_ipex": _t_paged_ipex,
}


# -- helpers -------------------------------------------------------------------------


def _ordered(t: torch.Tensor) -> bool:
    """Strides of the axes longer than 1 do not increase: the view follows memory order."""
    return memory_ordered(t)


def _byte_range(t: torch.Tensor) -> tuple[int, int, int]:
    isz = t.element_size()
    start = t.storage_offset() * isz
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) * isz + isz
    return t.untyped_storage().data_ptr(), start, start + span


def _layers_separate(views: Sequence[torch.Tensor]) -> bool:
    """Each layer's bytes are its own (or exactly another layer's: shared KV, aliased
    groups); layers whose pages interleave are a cross-layer buffer instead."""
    if any(v.is_meta for v in views):
        return True  # no addresses to compare
    ranges = sorted({_byte_range(v) for v in views})
    for (p0, _s0, e0), (p1, s1, _e1) in zip(ranges, ranges[1:]):
        if p0 == p1 and s1 < e0:
            return False
    return True


def stack_layers(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Per-layer views of one buffer with a uniform layer stride -> one ``[NL, *view]``
    view (no copy), or None when they are not that (different storage, shapes, strides,
    or a non-uniform or non-positive layer step)."""
    v0 = views[0]
    ptr = v0.untyped_storage().data_ptr()
    for v in views:
        if v.untyped_storage().data_ptr() != ptr or v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype:
            return None
    offs = [v.storage_offset() for v in views]
    step = offs[1] - offs[0] if len(offs) > 1 else 0
    if len(offs) > 1 and (step <= 0 or any(b - a != step for a, b in zip(offs, offs[1:]))):
        return None
    if len(offs) == 1:
        step = max((n * s for n, s in zip(v0.shape, v0.stride())), default=1)
    return torch.as_strided(v0, (len(views), *v0.shape), (step, *v0.stride()), offs[0])


_BYTE_DTYPES = (torch.int8, torch.uint8)


def _element_dtype(t: torch.Tensor, h: VllmHints, rule: Rule) -> tuple[torch.dtype | None, int]:
    """(dtype for the spec or None, element size) for tensors of ``t``'s storage dtype.

    int8 tensors are 0.29+ byte views of the one int8 buffer (``allocate_kv_cache``): they
    carry the cache's element dtype (fp8 for fp8 cache dtypes, else the model dtype).
    uint8 tensors are fp8 storage (``STR_DTYPE_TO_TORCH_DTYPE``) or opaque records
    (fp8_ds_mla, indexer): only an fp8 cache_dtype reinterprets them, never the model dtype.
    """
    if rule.blocked:
        return None, 1
    want = h.element_dtype()
    if t.dtype == torch.uint8:
        want = want if is_fp8(want) else None
    if t.dtype in _BYTE_DTYPES:
        if want is not None and want != t.dtype:
            return want, torch.empty(0, dtype=want).element_size()
        return None, 1
    if want is not None and want != t.dtype and is_fp8(want) and is_fp8(t.dtype):
        # an fp8 cache stored as real float8 tensors (TPU's Pallas cache; fp8_inc is float8_e4m3fn in
        # STR_DTYPE_TO_TORCH_DTYPE): the tensor's own fp8 answers when it is the cache dtype's kind
        if ("e4m3" in str(t.dtype)) == ("e4m3" in str(want)):
            return None, t.element_size()
    if want is not None and want != t.dtype and is_fp8(want):
        raise DetectionError(
            f"vLLM: cache_dtype={h.cache_dtype!r} stores the KV cache as uint8 bytes of {str(want).replace('torch.', '')} "
            f"(vllm/utils/torch_utils.py::STR_DTYPE_TO_TORCH_DTYPE; a real float8 tensor of that kind on TPU), but these "
            f"tensors are {str(t.dtype).replace('torch.', '')}: they are not an fp8 cache. Drop cache_dtype (or pass "
            f"'auto'), or pass the fp8 cache's tensors"
        )
    if want is not None and want != t.dtype:
        raise DetectionError(
            f"vLLM: the KV cache tensors are {t.dtype} but the hints say the cache holds {want} "
            f"(dtype={h.dtype}, cache_dtype={h.cache_dtype}); fix the hint or pass the right tensors"
        )
    return None, t.element_size()


@dataclass
class Reading:
    """A candidate with what detection needs to explain it."""

    candidate: Candidate
    rule: Rule
    layout: str
    as_given: bool = False  # the view keeps the tensor's own axis order (tie-break between identical readings)
    families: tuple[str, ...] = ()  # the rule's families that allocate this layout under the hints (default: all)

    def __post_init__(self) -> None:
        if not self.families:
            self.families = self.rule.families


def backends_label(rule: Rule, families: Sequence[str]) -> str:
    """The backend names of ``rule`` that belong to ``families`` (for ``decided_by``)."""
    if tuple(families) == rule.families or not families:
        return "/".join(rule.backends_label or rule.families)
    names = [b for b in rule.backends_label if BACKEND_FAMILY.get(b) in families]
    return "/".join(names or families)


#: per era, the backend families whose allocation reads ``get_kv_cache_layout()`` (their
#: ``get_kv_cache_stride_order``): the ones ``VLLM_KV_CACHE_LAYOUT`` steers. 0.11 / 0.13
#: ``flash_attn.py`` and ``flashinfer.py``; 0.24 - 0.28 also ``triton_attn.py``. FlexAttention
#: (fixed order from 0.24, none before), ROCm AITER / ROCM_ATTN, TORCH_SDPA, Pallas and the MLA
#: backends (one latent order) ignore it; 0.24 - 0.28 CPU_ATTN's ``get_required_kv_cache_layout()``
#: is ``"HND"``, which the selector sets over the variable (``v1/attention/selector.py``). From
#: 0.29 every backend is steered: ``resolve_kv_cache_layout`` (``v1/attention/backends/utils.py``)
#: uses the variable or refuses to start when a backend does not support it.
LAYOUT_READERS: dict[str, tuple[str, ...]] = {
    "0.11": ("FLASH_ATTN", "FLASHINFER"),
    "0.13": ("FLASH_ATTN", "FLASHINFER"),
    "0.24": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"),
    "0.26": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"),
}
#: families whose layout vLLM overrides on some GPUs whatever the variable says: FlashInfer on
#: SM 10.x is HND (0.11 ``platforms/cuda.py`` ``set_kv_cache_layout("HND")``; 0.13-0.28
#: ``FlashInferBackend.get_required_kv_cache_layout``): ``VLLM_KV_CACHE_LAYOUT=NHD`` does not rule
#: its HND cache out.
LAYOUT_OVERRIDES: dict[str, str] = {"FLASHINFER": "HND"}
#: eras whose XPU platform forces NHD (``platforms/xpu.py`` ``set_kv_cache_layout("NHD")`` in
#: 0.11, 0.13 and 0.24 - 0.25; 0.26 and later no longer call it).
XPU_FORCES_NHD = ("0.11", "0.13", "0.24")


def _key_fits(key: str, value: str) -> bool:
    """A rule's layout key (``NHD``, ``HND/cross``, ``*``, a 0.29+ member...) is what the layout
    value ``value`` (``NHD``/``HND`` or a 0.29+ ``KVCacheLayout`` member) names."""
    fam = value if value in LAYOUT_ALIASES else LAYOUT_FAMILY[value]
    specific = value in KV_CACHE_LAYOUTS
    base, _, cross = key.partition("/")
    cross_key = cross == "cross"
    if base == "*":
        return not specific or (value[0] == "B") == cross_key
    if base in KV_CACHE_LAYOUTS:
        if specific:
            return base == value
        return LAYOUT_FAMILY[base] == fam
    if base != fam:
        return False
    return not specific or (value[0] == "B") == cross_key


def _rule_families(rule: Rule, key: str, h: VllmHints) -> tuple[str, ...]:
    """The rule's backend families that allocate layout ``key`` (``Rule.only``), narrowed to
    the ``attention_backend`` hint's family."""
    return tuple(f for f in rule.families if (h.family is None or f == h.family) and key in rule.only.get(f, (key,)))


def layout_families(rule: Rule, key: str, h: VllmHints, layout_source: str = "kv_cache_layout") -> tuple[tuple[str, ...], dict[str, str]]:
    """Which of the rule's families may have allocated layout ``key`` given the layout hints,
    and, when none may, the hint that rules it out (``{hint: value}``, for the contradiction
    message).

    Precedence: an explicit layout (``kv_cache_layout``, ``cache_config``) states the cache's
    layout and binds every family; XPU in 0.11-0.24 forces NHD (:data:`XPU_FORCES_NHD`); the
    environment's ``VLLM_KV_CACHE_LAYOUT`` binds only the families that read
    ``get_kv_cache_layout()`` in that era (:data:`LAYOUT_READERS`), and not FlashInfer's HND
    override (:data:`LAYOUT_OVERRIDES`).
    """
    fams = _rule_families(rule, key, h)
    if not fams:
        return (), {}
    if h.kv_cache_layout is not None:
        return (fams, {}) if _key_fits(key, h.kv_cache_layout) else ((), {layout_source: h.kv_cache_layout})
    eras = (h.era,) if h.era is not None else rule.eras
    if h.device_type == "xpu" and all(e in XPU_FORCES_NHD for e in eras):
        return (fams, {}) if _key_fits(key, "NHD") else ((), {"device_type": "xpu (forces NHD in vLLM 0.11-0.24)"})
    env = h.env_kv_cache_layout
    if env is None:
        return fams, {}
    out = []
    for f in fams:
        steered = any(e == LAYOUT_ERA or f in LAYOUT_READERS.get(e, ()) for e in eras)
        if not steered or _key_fits(key, env) or (f in LAYOUT_OVERRIDES and _key_fits(key, LAYOUT_OVERRIDES[f])):
            out.append(f)
    return tuple(out), ({} if out else {"VLLM_KV_CACHE_LAYOUT": env})


def _rule_ok(rule: Rule, h: VllmHints, rocm: bool | None = None, cpu: bool | None = None) -> bool:
    if h.era is not None and h.era not in rule.eras:
        return False
    fam = h.family
    if fam is not None and fam not in rule.families:
        return False
    if h.is_mla is True and not rule.mla:
        return False
    if h.is_mla is False and rule.mla:
        return False
    if h.use_ipex is not None and not any(k == "use_ipex" for k, _ in rule.requires):
        return False  # use_ipex is a setting of vLLM 0.11 TORCH_SDPA only (cpu_attn.py::_use_ipex): it selects that backend
    if h.cpu_attn_isa is not None and not any(k == "cpu_amx" for k, _ in rule.requires):
        return False  # the kernel path is CPU_ATTN's (0.13+, the layers' isa): it selects that backend
    for key, want in rule.requires:
        got = getattr(h, key)
        if got is not None and got != want:
            return False
        if key == "use_ipex" and want is False and (h.cache_dtype or "").startswith("fp8"):
            return False  # TorchSDPABackendImpl: an FP8 KV cache requires intel_extension_for_pytorch
    dev = h.device_type
    if rule.gate == "gpu" and dev in ("cpu", "tpu"):
        return False
    if rule.gate == "cpu" and not (dev == "cpu" or fam == "CPU" or (dev is None and fam is None and cpu is not False)):
        return False  # the CPU backend's readings stand beside the GPU ones wherever the platform may be CPU (platform_cpu)
    if rule.gate == "tpu" and not (dev == "tpu" or fam == "PALLAS"):
        return False
    # VLLM_V1_USE_PREFILL_DECODE_ATTENTION is read by ROCm's backend only (envs.py; rocm_attn.py): a caller who
    # states it on puts ROCm's readings beside the others wherever the device is not stated
    pda_on = h.prefill_decode_attention is True and dev is None
    if rule.gate == "rocm" and not (dev == "rocm" or fam in ("ROCM_ATTN", "ROCM_SEGMENTED") or (dev is None and rocm) or pda_on):
        return False
    if rule.gate == "cuda" and ((dev is not None and dev != "cuda") or rocm):
        return False
    if rule.gate == "rocm?" and (rocm is False or dev in ("cpu", "tpu")):
        return False
    return True


def _sizes(tokens: Sequence[str], t: torch.Tensor) -> dict[str, int] | None:
    out = {}
    for tok, n in zip(tokens, t.shape):
        if tok == "TWO" and n != 2:
            return None
        if tok == "ONE" and n != 1:
            return None
        out[tok] = int(n)
    return out


def _record_hints_ok(rec, h: VllmHints) -> bool:
    """The hints agree with vLLM's byte record ``rec``: a ``*_ds_mla`` cache dtype must be one
    that writes this width; a head size must be the record's bytes or, with its cache dtype,
    the model's own head size (``model_config.get_head_size()``: 576 for V3.2's 656 B record,
    512 for V4's 584 B page). An indexer's record follows no cache dtype or model head size."""
    if not rec.cache_dtypes:
        return True
    if h.cache_dtype in MLA_CACHE_DTYPES and h.cache_dtype not in rec.cache_dtypes:
        return False
    if h.head_size is not None and h.head_size != rec.width:
        return h.head_size == rec.head_size and h.cache_dtype in rec.cache_dtypes
    return True


def _sizes_ok(
    rule: Rule, sz: dict[str, int], t: torch.Tensor, esz: int, h: VllmHints, kernel_split: bool = False, rocm: bool | None = None
) -> bool:
    isz = t.element_size()
    if rule.block_sizes and sz.get("BS") not in rule.block_sizes:
        return False
    if "BS" in sz and h.block_size is not None and sz["BS"] != h.block_size:
        # 0.13+: the manager's block_size may be split into kernel blocks of the tensor's BS
        # (gpu_model_runner._reshape_kv_cache_tensors, 0.29+ create_kv_cache_views)
        # kernel blocks are multiples of 16 tokens (get_supported_kernel_block_sizes: MultipleOf(16), 32, 64...)
        if not (kernel_split and sz["BS"] % 16 == 0 and h.block_size % sz["BS"] == 0):
            return False
        # vLLM makes num_blocks x (block_size // kernel_block_size) kernel blocks (0.13+
        # gpu_model_runner._reshape_kv_cache_tensors: kernel_num_blocks = num_blocks * num_blocks_per_kv_block;
        # 0.33 create_kv_cache_views likewise): a kernel-block count the ratio does not divide is no such split
        if "NB" in sz and sz["NB"] % (h.block_size // sz["BS"]):
            return False
    if h.num_kv_heads is not None:
        if rule.mla and h.num_kv_heads != 1:
            return False
        if "NH" in sz and sz["NH"] != h.num_kv_heads:
            return False
    last = "CS" if "CS" in sz else "HS"
    width_bytes = sz[last] * isz
    if width_bytes % esz:
        return False
    width = width_bytes // esz
    record = RECORDS.get(sz[last]) if t.dtype in _BYTE_DTYPES and esz == 1 else None
    if rule.blocked:
        if record is None or record.layout != "blocked" or not _record_hints_ok(record, h):
            return False
        # ROCm writes the indexer's value region in tiles once a block holds more than one token
        # (0.24+; 0.13's ROCm indexer blocks hold one token, 0.11 has no ROCm sparse MLA)
        tiles = record.rocm == "tiles" and sz.get("BS", 1) > 1 and h.era not in ("0.11", "0.13")
        if rule.planes == "rocm_tiles":
            return tiles and rocm is not False
        if tiles and rocm:
            return False
        if record.rocm == "aiter" and rocm and h.era in (None, LAYOUT_ERA):
            return False  # aiter's MXFP4 pages on ROCm gfx950: not claimed (see _aiter_pages)
        return True
    if rule.mla:
        # a rank-3 cache is a latent of any width (576 for DeepSeek, 128 for MiniMax-M3's indexer
        # keys, ...); a uint8 width that is one of vLLM's byte records is read as vLLM writes it
        # (the width identifies the record: kvcore_vllm.specs)
        if record is not None:
            return record.layout == "token" and _record_hints_ok(record, h)
        if h.cache_dtype in MLA_CACHE_DTYPES and t.dtype in _BYTE_DTYPES:
            return False  # no vLLM *_ds_mla writer makes a record of this width (kvcore_vllm.specs.RECORDS)
        if h.head_size is not None:
            return width == h.head_size
        return True
    if last == "CS":
        if width % 2:
            return False
        width //= 2
    if h.head_size is not None and width != h.head_size and rule.transform != "pallas":
        return False
    if rule.head_sizes and (h.head_size is not None or h.num_kv_heads is not None) and width not in rule.head_sizes:
        return False
    return True


#: the layout a bfloat16 CPU_ATTN cache may be when its kernel path is not given
NEON_BF16 = (
    "vLLM CPU_ATTN's NEON BFMMLA tiles (an Arm host with a bfloat16 model: csrc/cpu/cpu_attn_neon_bfmmla.hpp; not claimed by kvcore)"
)


def _neon_bf16(rule: Rule, v: torch.Tensor, h: VllmHints) -> str | None:
    """A bfloat16 CPU_ATTN cache whose kernel path is not given may have been written on an Arm
    host by the NEON BFMMLA kernel (``cpu_attn.py::_get_attn_isa`` picks ``neon`` on Arm; its
    bfloat16 path packs tiles), which kvcore does not read: only ``cpu_attn_isa`` tells."""
    if rule.planes != "cpu_vec" or h.cpu_attn_isa is not None or v.dtype != torch.bfloat16:
        return None
    if v.shape[-2] % AMX_MULTIPLE and not _neon_any_block(h):
        return None  # up to 0.30 Arm takes neon only for blocks of multiples of 32 (else vec16, read here)
    return NEON_BF16


def _neon_any_block(h: VllmHints) -> bool:
    """vLLM 0.31+ ``_get_attn_isa`` sends Arm to ``neon`` whatever the block size (0.24-0.30:
    only ``block_size % 32 == 0``); True where the release may be 0.31 or later."""
    return h.vllm_version is None or version_tuple(h.vllm_version)[:2] >= (0, 31)


def _aiter_pages(rule: Rule, v: torch.Tensor, h: VllmHints, rocm: bool | None) -> str | None:
    """A description of the layout this tensor may be and kvcore does not read: vLLM 0.33 on
    ROCm gfx950 stores the DSA indexer's MXFP4 keys (68 B records) in aiter's preshuffled
    pages, whose tile sizes aiter's ``cache_format()`` reports at run time
    (``v1/attention/ops/rocm_paged_mxfp4_indexer.py::rocm_paged_mxfp4_cache_layout``)."""
    if not rule.blocked or rule.planes or rocm is False or h.era not in (None, LAYOUT_ERA):
        return None
    if v.dtype not in _BYTE_DTYPES or v.shape[-1] not in RECORDS or RECORDS[v.shape[-1]].rocm != "aiter":
        return None
    return (
        f"vLLM 0.33 ROCm (gfx950) MXFP4 indexer pages [NB, BS, {v.shape[-1]}] in aiter's preshuffled order "
        "(rocm_paged_mxfp4_indexer.py: tile sizes from aiter's cache_format() at run time; not claimed by kvcore)"
    )


def _reading(
    rule: Rule,
    key: str,
    views: list[torch.Tensor],
    tokens: tuple[str, ...],
    h: VllmHints,
    note: str,
    kernel_split: bool = False,
    rocm: bool | None = None,
    families: tuple[str, ...] = (),
    rejected: list[str] | None = None,
) -> Reading | None:
    """Views in ``rule.logical`` (or a physical) token order -> a candidate for layout ``key``.

    The candidate's ``order`` (see :mod:`kvcore.detection`): ``"physical"`` for a tensor read
    as already in memory order (``tokens`` is the layout's physical order, not the rule's
    logical one), ``"allocated"`` when the views permute the tensor's axes (its strides
    show the engine's permuted allocation), else None (the tensor's own axes, in memory
    order: it reads so whichever way it was handed over).
    """
    order = rule.layouts[key]
    t0 = views[0]
    sz = _sizes(tokens, t0)
    if sz is None:
        return None
    dtype, esz = _element_dtype(t0, h, rule)
    if not _sizes_ok(rule, sz, t0, esz, h, kernel_split, rocm):
        return None
    if kernel_split and "BS" in sz and sz["BS"] != h.block_size:
        note += f" (block_size {h.block_size} is the manager's: the kernel reads blocks of {sz['BS']} tokens)"
    decided = {"vllm_version": "/".join(rule.eras), "attention_backend": backends_label(rule, families)}
    if key not in ("*", "*/mamba"):
        decided["kv_cache_layout"] = key.replace("/cross", " (cross-layer)").replace("/mamba", " (beside Mamba layers)")
    if rule.planes:
        kv = _planes(rule, order, views, tokens, h)
        if kv is None:
            return None
        if rule.gate in ("rocm", "rocm?"):
            decided["device_type"] = "rocm"
        cand = Candidate(
            format=order,
            kv_caches=kv,
            dtype=dtype,
            note=f"vLLM {rule.label}, layout {key}{note}",
            decided_by=decided,
            label=f"{rule.label}, {key}{note}",
        )
        return Reading(cand, rule, key, True, families)
    as_given = False
    if order[0] == "NL":
        perm = [tokens.index(tok) for tok in _fmt_tokens(order[1:])]
        as_given = perm == sorted(perm) and not rule.transform
        pv = [v.permute(perm) for v in views]
        if not all(_ordered(v) for v in pv):
            return None
        if not _layers_separate(pv):
            # interleaved layers are a cross-layer buffer (its own reading); layers whose bytes overlap are no
            # vLLM cache at all: keep build_layout's explanation for the error detection raises
            if rejected is not None:
                try:
                    build_layout(
                        physical_name(order),
                        pv,
                        dtype=dtype,
                        params={"scale_bytes": BLOCKED_SCALE_RECORDS[sz["HS"]]} if rule.blocked else {},
                    )
                except GeometryError as e:
                    why = f"{rule.label}, layout {key}{note}: {e}"
                    if why not in rejected:
                        rejected.append(why)
            return None
        kv = pv
        identity = perm == sorted(perm)
    else:
        stacked = stack_layers(views)
        if stacked is None:
            return None
        full = ("NL",) + tokens
        perm = [full.index(tok) for tok in _fmt_tokens(order)]
        kv = stacked.permute(perm)
        if not _ordered(kv):
            return None
        # per-layer views of one cross-layer buffer: each layer read in its own axis order holds either way
        inner = [i for i in perm if i != 0]
        identity = inner == sorted(inner)
    physical = tokens != rule.logical
    fmt = physical_name(order)
    params = {"scale_bytes": BLOCKED_SCALE_RECORDS[sz["HS"]]} if rule.blocked else {}
    if rule.gate in ("rocm", "rocm?"):
        decided["device_type"] = "rocm"
    cand = Candidate(
        format=fmt,
        kv_caches=kv,
        dtype=dtype,
        params=params,
        note=f"vLLM {rule.label}, layout {key}{note}",
        decided_by=decided,
        label=f"{rule.label}, {key}{note}",
        order="physical" if physical else (None if identity else "allocated"),
    )
    return Reading(cand, rule, key, as_given, families)


def _planes(rule: Rule, name: str, views: list[torch.Tensor], tokens: tuple[str, ...], h: VllmHints) -> dict[str, Any] | None:
    """One layer view per entry (in ``tokens`` order) -> ``{role: container}`` for the
    multi-plane ``name``: a list of per-layer plane views, or, where the name's template
    has ``NL`` inside (0.29+ block-outermost layouts), one view of all layers per plane."""
    per = [PLANE_BUILDERS[rule.planes](v, tokens, h) for v in views]
    if any(p is None for p in per):
        return None
    syntax = parse(name)
    out: dict[str, Any] = {}
    for role in syntax.roles:
        ps = [p[role] for p in per]
        axes = syntax.plane(role).syntax.axes
        if "NL" in axes:
            stacked = stack_layers(ps)
            if stacked is None:
                return None
            at = axes.index("NL")
            perm = list(range(1, at + 1)) + [0] + list(range(at + 1, stacked.dim()))
            x = stacked.permute(perm)
            if not _ordered(x):
                return None
            out[role] = x
        else:
            if not all(_ordered(x) for x in ps) or not _layers_separate(ps):
                return None
            out[role] = ps
    return out


def _fmt_tokens(order: Sequence[str]) -> tuple[str, ...]:
    # BSV_BSS is the element axis of a blocked-scale record; the view's token is HS
    out: list[str] = []
    for tok in order:
        if tok == "BSV":
            out.append("BS")
        elif tok == "BSS":
            out.append("HS")
        else:
            out.append(tok)
    return tuple(out)


def candidates(
    tensors: list[torch.Tensor],
    h: VllmHints,
    *,
    check_layout: bool = True,
    evidence: bool = False,
    layout_source: str = "kv_cache_layout",
    needs: list[str] | None = None,
    unclaimed: list[str] | None = None,
    rejected: list[str] | None = None,
) -> list[Reading]:
    """Every reading of ``tensors`` (one per layer, in layer order) that a rule allows.

    Each rule gives its as-allocated reading (the rule's logical axes, permuted into the
    layout's physical order by the tensors' strides) and, for rules whose layouts can be
    handed over already permuted into memory order (``physical_ok``), the reading of the
    tensors as that physical order (``order="physical"``): the core decides between them
    (:func:`kvcore.resolve`).

    Args:
        check_layout: drop the readings the ``kv_cache_layout`` hint (or XPU's forced NHD)
            rules out. With ``False`` the hint is ignored.
        evidence: keep those readings instead, marked ``against={hint: value}``: they are
            what the strides show when the hint contradicts them.
        layout_source: how the caller gave the layout (``kv_cache_layout``, or
            ``VLLM_KV_CACHE_LAYOUT`` when it came from the environment), for messages.
        needs: when given, rules whose transform cannot apply for want of a hint append
            ``"<rule label>: <hints>"`` here (vLLM 0.11 CPU's flat ``(2, NB, BS*NH*HS)``
            needs ``block_size`` and ``head_size`` or ``num_kv_heads``; the split reading of
            int8 byte views needs ``dtype``).
        unclaimed: when given, layouts these tensors may be that kvcore does not read
            (vLLM 0.33 ROCm's aiter MXFP4 indexer pages) are appended here.
        rejected: when given, readings whose shapes fit but whose memory cannot be a
            vLLM cache are appended here with the reason (per-layer views that overlap:
            :func:`kvcore.build_layout`'s own explanation), for the error detection raises
            when nothing fits.

    The platform comes from :func:`platform_rocm` and :func:`platform_cpu`.

    A ``block_size`` hint is first matched exactly; only when no reading has that block
    size is it read as the manager's block size split into kernel blocks (vLLM 0.13+:
    ``block_size // kernel_block_size`` kernel blocks per block).
    """
    opts = dict(
        check_layout=check_layout,
        evidence=evidence,
        layout_source=layout_source,
        needs=needs,
        unclaimed=unclaimed,
        rejected=rejected,
        rocm=platform_rocm(h, tensors),
        cpu=platform_cpu(h, tensors),
    )
    out = _candidates(tensors, h, False, **opts)
    if not [r for r in out if not r.candidate.against] and h.block_size is not None and h.era != "0.11":
        out = _candidates(tensors, h, True, **opts)
    return out


def _candidates(
    tensors: list[torch.Tensor],
    h: VllmHints,
    kernel_split: bool,
    *,
    check_layout: bool,
    evidence: bool,
    layout_source: str,
    needs: list[str] | None,
    unclaimed: list[str] | None = None,
    rejected: list[str] | None = None,
    rocm: bool | None = None,
    cpu: bool | None = None,
) -> list[Reading]:
    out: list[Reading] = []
    t0 = tensors[0]
    for rule in RULES:
        if t0.dim() != rule.rank or not _rule_ok(rule, h, rocm, cpu):
            continue
        keys = {}
        for key in rule.layouts:
            fams, against = layout_families(rule, key, h, layout_source) if check_layout else (_rule_families(rule, key, h), {})
            if not fams:
                if not against or not evidence:
                    continue
                fams = _rule_families(rule, key, h)
            keys[key] = (fams, against)
        if not keys:
            continue  # no layout of this rule is allowed: it needs no hint either
        # only readings the layout hints rule out: what they would need is beside the point
        rule_needs = None if all(a for _, a in keys.values()) else needs
        src = list(tensors)
        if rule.planes == "split_kv":
            src = [_element_view(t, h) for t in tensors]
            if any(t is None for t in src):
                if rule_needs is not None:
                    rule_needs.append(f"{rule.label}: needs dtype (an int8 byte view: V's tokens are one element apart)")
                continue
        if rule.transform:
            fn = TRANSFORMS[rule.transform]
            views = [fn(t, h) for t in src]
            if any(v is None for v in views):
                missing = _missing_hints(rule, t0, h)
                if rule_needs is not None and missing:
                    rule_needs.append(f"{rule.label}: needs {' and '.join(missing)}")
                misfit = flat_misfit(t0.shape[2], h) if rule.transform in ("paged", "paged_ipex") and t0.shape[0] == 2 else None
                if misfit and rejected is not None and not all(a for _, a in keys.values()):
                    why = f"{rule.label}: {misfit}"
                    if why not in rejected:
                        rejected.append(why)
                continue
        else:
            views = src
        other = _aiter_pages(rule, views[0], h, rocm) or _neon_bf16(rule, views[0], h)
        if other is not None and unclaimed is not None and other not in unclaimed:
            unclaimed.append(other)
        for key, (fams, against) in keys.items():
            found = []
            why = rejected if not against else None  # a reading a hint rules out explains nothing
            r = _reading(rule, key, views, rule.logical, h, "", kernel_split, rocm, fams, why)
            if r is not None:
                found.append(r)
            # the tensor already permuted to this layout's physical order
            order = rule.layouts[key]
            phys = () if rule.planes else tuple(tok for tok in _fmt_tokens(order) if tok != "NL")
            # vLLM 0.29+ reads the compat names NHD / HND as LBNHC / LBHNC exactly (config/cache.py::
            # _LAYOUT_COMPAT_ALIASES): a twin of another member is not what such a hint names
            named = h.kv_cache_layout or h.env_kv_cache_layout
            alias_only = check_layout and named in LAYOUT_ALIASES and key in KV_CACHE_LAYOUTS and key != LAYOUT_ALIASES[named]
            if rule.physical_ok and not rule.planes and "/" not in key and order[0] == "NL" and phys != rule.logical and not alias_only:
                r = _reading(rule, key, views, phys, h, " (tensor already in memory order)", kernel_split, rocm, fams, why)
                if r is not None:
                    found.append(r)
            for r in found:
                r.candidate.against = dict(against)
            out.extend(found)
    # among readings that turn out byte-identical, the first wins: prefer the tensor's own axis order
    out.sort(key=lambda r: not r.as_given)
    return out


def _missing_hints(rule: Rule, t: torch.Tensor, h: VllmHints) -> list[str]:
    """The hints a rule's transform needs and did not get (only the flat CPU layouts need any:
    0.11 TORCH_SDPA's ``(2, NB, BS*NH*HS)``, with or without IPEX: two of block_size,
    num_kv_heads and head_size, :func:`flat_geometry`)."""
    if rule.transform not in ("paged", "paged_ipex") or t.shape[0] != 2:
        return []
    names = ("block_size", "num_kv_heads", "head_size")
    missing = [k for k in names if getattr(h, k) is None]
    if len(missing) <= 1:
        return []
    return [f"{' or '.join(missing)} (two of block_size, num_kv_heads, head_size split the flat BS*NH*HS row)"]


def _bare_view(rule: Rule, order: Sequence[str], t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    """One whole cross-layer tensor ``t`` as the axes of ``order`` (a view, never a copy), or
    None. A rule without a transform takes the tensor as it is; a head-slot rule (0.30+ B12X
    BLHNC) also takes vLLM's ``[NB, NL, 2, BS, NH*HS]`` (the slot's row split into heads as
    :func:`_t_head_slots_nhd` does) beside the split form ``[NB, NL, 2, BS, NH, HS]``."""
    if not rule.transform:
        return t if len(order) == t.dim() else None
    if rule.transform != "head_slots_nhd" or tuple(order[-2:]) != ("NH", "HS"):
        return None
    if t.dim() == len(order):
        return t
    if t.dim() != len(order) - 1 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    c = t.shape[-1]
    nh = _slot_heads(t, c, h)
    return None if nh is None else t.unflatten(-1, (nh, c // nh))


#: The most layers a single tensor is read as (a whole cross-layer buffer, its layer axis one
#: of the tensor's axes). No model vLLM serves has near this many attention layers per
#: pipeline stage (DeepSeek-V3 61, Llama-3.1-405B 126); kvcore's layout holds a row per
#: layer, so a reading whose layer count is an axis of millions of blocks would cost time
#: and memory in proportion to that axis. Such readings are not offered: detection says why
#: when nothing else fits (pass the per-layer tensors as a list instead).
MAX_BARE_LAYERS = 1024


def bare_candidates(
    t: torch.Tensor,
    h: VllmHints,
    *,
    check_layout: bool = True,
    evidence: bool = False,
    layout_source: str = "kv_cache_layout",
    rejected: list[str] | None = None,
) -> list[Reading]:
    """Readings of one tensor that is a whole cross-layer cache, as a cross-layer connector
    is handed it: the buffer vLLM allocates in the layout's physical order before it takes
    per-layer views (0.13-0.2x ``allocate_uniform_kv_caches``: e.g. ``[NB, NL, 2, BS, NH, HS]``
    for FlashAttention NHD; 0.26 - 0.28 ``[NB, NL, BS, NH, 2*HS]``; 0.29+ ``BLHNC`` / ``BLNHC`` /
    ``BHLNC``). The tensor must be in memory order; its axes are then the format's.

    A reading with more than :data:`MAX_BARE_LAYERS` layers is not offered; with
    ``rejected`` given, it is listed there with the reason. Nothing here is proportional
    to a tensor axis: every candidate is the tensor itself."""
    out: list[Reading] = []
    if not _ordered(t):
        return out
    rocm, cpu = platform_rocm(h, [t]), platform_cpu(h, [t])
    for rule in RULES:
        if rule.planes or not _rule_ok(rule, h, rocm, cpu):
            continue
        for key, order in rule.layouts.items():
            if order[0] == "NL":
                continue
            x = _bare_view(rule, order, t, h)
            if x is None:
                continue
            fams, against = layout_families(rule, key, h, layout_source) if check_layout else (_rule_families(rule, key, h), {})
            if not fams:
                if not against or not evidence:
                    continue
                fams = _rule_families(rule, key, h)
            tokens = _fmt_tokens(order)
            sz = _sizes(tokens, x)
            if sz is None:
                continue
            dtype, esz = _element_dtype(x, h, rule)
            if not _sizes_ok(rule, sz, x, esz, h, rocm=rocm):
                continue
            if sz["NL"] > MAX_BARE_LAYERS:
                if rejected is not None and not against:
                    why = (
                        f"{rule.label}, {key}, one cross-layer tensor: its layer axis would hold {sz['NL']} layers, more than "
                        f"the {MAX_BARE_LAYERS} kvcore-vllm reads in one tensor (no vLLM model has that many; pass the "
                        "per-layer tensors as a list)"
                    )
                    if why not in rejected:
                        rejected.append(why)
                continue
            decided = {"vllm_version": "/".join(rule.eras), "attention_backend": backends_label(rule, fams)}
            decided["kv_cache_layout"] = key.replace("/cross", " (cross-layer)")
            params = {"scale_bytes": BLOCKED_SCALE_RECORDS[sz["HS"]]} if rule.blocked else {}
            cand = Candidate(
                format=physical_name(order),
                kv_caches=x,
                dtype=dtype,
                params=params,
                note=f"vLLM {rule.label}, layout {key}: the whole cross-layer buffer",
                decided_by=decided,
                label=f"{rule.label}, {key}, one cross-layer tensor",
                against=against,
            )
            out.append(Reading(cand, rule, key, True, fams))
    return out
