"""LMCache's KV-format utilities, as a thin facade over kvcore.

Code written against LMCache's ``lmcache/v1/gpu_connector/utils.py`` and the ``kv_format``
package it fronts (``get_spec``, ``get_spec_class``, ``detect_format``, the spec classes,
``types.LayoutHints``, ``contiguity.attempt_permute_to_contiguous_view``) moves over by
changing its imports to this one module::

    # from lmcache.v1.gpu_connector.utils import normalize_kv_and_discover_format, get_num_layers
    # from lmcache.v1.gpu_connector.kv_format import get_spec
    # import lmcache.lmcache_native as lmcache_native
    from kvcore.compat.lmcache import normalize_kv_and_discover_format, get_num_layers, get_spec
    import kvcore.compat.lmcache as lmcache_native   # EngineKVFormat, is_mla, is_layer_list, ...

    fmt, kv = normalize_kv_and_discover_format(kv_caches, EngineType.VLLM, {"kv_layout": "HND"})
    spec = get_spec(kv, fmt)
    spec.num_layers(), spec.block_size(), spec.concrete_shape_str(), get_num_heads(kv, fmt, 3)

Names, argument order, return values and the format facts follow LMCache 0.5.6 (its
``kv_format/specs/base.py`` ``KVFormatSpec``, ``specs/registry.py``, ``detection.py``,
``contiguity.py``, ``types.py`` and ``gpu_connector/utils.py``; the ``EngineKVFormat`` enum of
``csrc/engine_kv_format.h``), read from the released sdist of ``lmcache==0.5.6``.
``scripts/lmcache_facade_check.py`` runs LMCache's own unit tests for those modules against
this facade with only the imports changed.

Deliberate differences
----------------------

Everything not in this table behaves as LMCache does on LMCache's inputs.

=============================  ==========================================  ==========================================
what                           LMCache                                     here, and why
=============================  ==========================================  ==========================================
the format value               a pybind ``EngineKVFormat`` enum member     :class:`EngineKVFormat`, a ``str`` equal to
                                                                           the name, with LMCache's members as class
                                                                           attributes, their ``value`` and facts. It
                                                                           carries what detection decided beyond the
                                                                           name (the element dtype of byte views,
                                                                           ``params``). Detection returns LMCache's
                                                                           member when one names the same bytes
                                                                           (:func:`_as_lmcache`), else kvcore's name
                                                                           (``TWO_X_NL_X_NB_NH_BS_HS``...)
errors                         ``ValueError`` / ``AssertionError`` /       kvcore's exceptions, each a ``ValueError``
                               ``TypeError``, LMCache's wording            (``FormatError``, ``DetectionError``,
                                                                           ``GeometryError``, ``TransferError``) in
                                                                           kvcore's (or the plugin's) words; no
                                                                           ``assert``
packed K|V (``CS``, the        ``kv_size`` 1, ``head_size`` ``CS`` (or     ``kv_size`` 2, ``head_size`` the K head
deprecated ``TWO_HS``)         ``2*HS``), ``hidden_dim`` ``NH*CS``         size, ``hidden_dim`` ``NH*HS``: kvcore
                                                                           stages K and V apart (``[2, NL, T, NH*HS]``,
                                                                           what :func:`kvcore.gather` produces)
``TWO_HS`` specs               ``DeprecationWarning`` on construction      no warning: kvcore's vLLM plugin detects
                                                                           ``NL_X_NB_BS_NH_TWO_HS`` (TPU Pallas) as a
                                                                           current layout
detection                      a shape rule per engine, for any sizes;     the engine's kvcore plugin, which never
                               strided views refused unless dim-0          guesses: it detects what the engine
                               padded; tight per-layer tensors accepted    allocates (a vLLM 0.33 per-layer view is
                               under a blocks-first hint                   ``[NB, NH, BS, C]``: a BLNHC hint on
                                                                           ``[NB, BS, NH, CS]`` views, or a blocks-
                                                                           first hint on tight per-layer tensors,
                                                                           contradicts the strides and raises);
                                                                           strided views are described. LMCache's
                                                                           contract is followed: ``kv_layout`` names
                                                                           the tensors' memory order (they are
                                                                           permuted into it, as LMCache's contiguity
                                                                           recovery does); the platform is the one
                                                                           LMCache states (below)
device (vLLM)                  ``torch_device_type`` (the platform) only   the platform stated (``torch_device_type``
                               picks the default ``kv_layout``; every      in ``layout_hints`` or this module's
                               cache is read as a GPU backend's            ``torch_device_type``) reaches kvcore-vllm
                                                                           as ``device_type``; unstated, a GPU
                                                                           backend's (LMCache's reading). ``"cpu"``
                                                                           reads vLLM CPU's own layouts: CPU_ATTN's
                                                                           ``[NB, NH, BS, 2*HS]`` holds a block's BS
                                                                           K rows, then its BS V rows per head
                                                                           (``NL_X_NB_NH_TWO_BS_HS``), which LMCache's
                                                                           ``NL_X_NB_NH_BS_CS`` misreads
singleton-head pages (vLLM     ``NL_X_NB_NH_BS_CS`` with NH 1 (kv_size     ``NL_X_NB_BS_HS`` over the squeezed views:
0.33 ``[NB, 1, BS, W]``, an    1, head W): one W-wide row per token        LMCache's geometry and rows (kvcore's CS is
HND-family ``kv_layout``, no                                               packed K|V); the 132 B indexer page is
``kv_cache_spec``)                                                         ``NL_X_NB_BSV_BSS`` as in LMCache; V4's
                                                                           584 B blocked page (and MXFP4 68 B), which
                                                                           LMCache reads as rows (wrong for
                                                                           ``fp8_ds_mla`` V4: vLLM's
                                                                           ``_rope_quant_insert_kernel`` writes a
                                                                           block's values, then its scales), stays
                                                                           kvcore's AmbiguousLayoutError naming
                                                                           ``cache_dtype``
plane tuples                   accessors over the planes' summed byte      detected as kvcore-vllm's multi-plane
(``NL_X_NP_X_NB_BS_ONE_HS``)   width (``hidden_dim`` in plane 0's          layouts (vllm-ascend (nope, rope), (k, v,
                               elements)                                   dsa_k[, dsa_k_scale]), (k_cache,)) and
                                                                           returned under LMCache's name with the
                                                                           tuples as lists; the spec accessors raise
                                                                           :class:`~kvcore.GeometryError` for ``NP``
                                                                           (a sum of widths is no head size): use
                                                                           ``kvcore.detect(kv, "vllm")``, whose layout
                                                                           stages each plane at its own width
``attention_backends``         the spec file's own labels                  LMCache's engine for the member first: the
                                                                           backends of that engine's kvcore plugin
                                                                           (else LMCache's label), then other plugins'
                                                                           labels; the first entry
                                                                           (:func:`get_attention_backend`) does not
                                                                           change with what else is installed
``block_stride_elems``         ``stride(0)`` for an allow-list of six      for every format whose dim 0 is the block
                               formats, ``ValueError`` for dim-0 padding   axis (NB or NBBS): kvcore's kernels read
                               elsewhere                                   the stride table
per-layer formats              a layer in no group gets an arbitrary       ``None`` for a layer a plugin says is not
                               detected format                             KV (Mamba state)
``..._from_shape_desc``        ``"Unknown"`` for CS formats                answers them (CS is ``hs`` for a
                                                                           ``kv_size`` 1 descriptor, else ``2*hs``)
``PageBufferShapeDesc``        pybind struct, any value                    fields validated on assignment
                                                                           (non-negative ints; ``dtype`` a
                                                                           ``torch.dtype``)
=============================  ==========================================  ==========================================

Layout hints
------------

``layout_hints`` takes LMCache's ``LayoutHints`` keys, translated per engine into the
vocabulary of the engine's kvcore plugin (a kvcore key passes unchanged; a key given in both
spellings must agree):

* ``vllm``: ``kv_layout`` -> ``kv_cache_layout``, ``tokens_per_block`` -> ``block_size``,
  ``head_dim`` -> ``head_size``, ``torch_device_type`` -> ``device_type``; ``kv_list_layout``
  (an SGLang key LMCache's vLLM detector ignores) is dropped. As LMCache 0.5.6 applies them
  (``detection.py::detect_format``, ``detectors/vllm.py``): with ``kv_layout`` the tensors
  are permuted into memory order and read with ``tensor_order="physical"`` (``kv_layout``
  names that order); the device is the one stated, else a GPU backend's (the table's
  "device" row). vllm-ascend's tuples keep their container (the tuple says they are
  attention caches, a list Mamba state).
* ``sglang``: ``tokens_per_block`` -> ``page_size``, ``head_dim`` -> ``head_size``,
  ``kv_layout`` -> ``layout``; ``torch_device_type`` is dropped. LMCache 0.5.6
  (``detectors/sglang.py``) reads a flat list of ``(rows, 1, D)`` tensors without
  ``kv_list_layout="k_v"`` as the MLA pool: detected with ``is_mla=True``, its rows split
  into pages by ``tokens_per_block`` (``NL_X_NB_BS_HS``; rows that are not whole pages
  raise) and fused without it (``NL_X_NBBS_ONE_HS``). ``kv_list_layout="unified"`` (LMCache's
  SGLang unified connector: one paged component per entry) is ``NL_X_NB_BS_NH_HS`` /
  ``NL_X_NB_BS_HS``, read by kvcore-sglang.
* ``trtllm``: unchanged (the plugin reads ``num_kv_heads``, ``tokens_per_block``,
  ``head_dim``, ``kv_layout`` by these names). LMCache's already-viewed 6-D pool
  ``[NB, NL, 2, NH, BS, HS]`` is handed to the plugin as the 4-D pool it allocates, with
  ``num_kv_heads``/``tokens_per_block``/``head_dim`` read off its axes.
* any other engine: the generic kvcore names (``kv_cache_layout``, ``block_size``,
  ``head_size``, ``device_type``).

``inference_engine_logical_block_size`` is dropped for every engine, as LMCache's
``GPUCacheContext`` removes it before detection.

Like LMCache's specs, a :class:`KVFormatSpec` borrows the tensors it is given and keeps no
other reference: build one per question (``get_spec(kv, fmt).num_layers()``).

The package, one job a module (imports flow down this list)::

    formats      LMCache's member table, EngineKVFormat, EngineType, LayoutHints, is_* predicates
    specs        KVFormatSpec, get_spec, get_spec_class: geometry from kvcore's layout
    contiguity   attempt_permute_to_contiguous_view (LMCache's contiguity recovery)
    hints        layout_hints and the stated platform, as each engine's plugin reads them
    detection    normalize_kv_and_discover_format, per-layer formats, shape keys
    accessors    utils.get_* and the shape strings
    transfer     PageBufferShapeDesc and the kernel group's block stride
    connectors   the GPU connectors' configuration, class and format checks

Every name is imported from this package, as before the split.
"""

from __future__ import annotations

import logging
import sys
import types

from kvcore.compat.lmcache import hints
from kvcore.compat.lmcache.accessors import (
    concrete_shape,
    describe_shape,
    get_attention_backend,
    get_block_size,
    get_concrete_engine_kv_shape,
    get_concrete_engine_kv_shape_from_shape_desc,
    get_data_ptrs,
    get_device,
    get_dtype,
    get_elements_per_layer,
    get_engine_kv_shape_description,
    get_group_data_ptrs,
    get_head_size,
    get_hidden_dim,
    get_hidden_dim_size,
    get_kv_size,
    get_num_blocks,
    get_num_heads,
    get_num_layers,
    get_page_buffer_size,
    get_tokens_per_layer,
    legible_print_engine_kv_format,
)
from kvcore.compat.lmcache.connectors import (  # noqa: F401 - importable here before the split
    _VLLM_MLA,
    _VLLM_NON_MLA,
    LAYERWISE_CONNECTORS,
    _vllm_per_layer,
    assert_is_vllm_flash_attn_or_flash_infer,
    assert_is_vllm_mla_or_flash_attn_or_flash_infer,
    assert_layerwise_gpu_connector,
    need_gpu_interm_buffer,
)
from kvcore.compat.lmcache.contiguity import (  # noqa: F401 - importable here before the split
    _dim0_padding,
    _expected_shape,
    _memory_ordered_views,
    attempt_permute_to_contiguous_view,
)
from kvcore.compat.lmcache.detection import (  # noqa: F401 - importable here before the split
    _ASCEND_PLANE_TUPLES,
    _as_lmcache,
    _from_layout,
    _lmcache_reading,
    _per_layer,
    _plane_tuples,
    _single_head_tuples,
    _structure_key,
    detect_format,
    extract_kv_cache_shapes,
    get_shape_and_dtype,
    normalize_and_discover_per_layer_formats,
    normalize_kv_and_discover_format,
)
from kvcore.compat.lmcache.formats import (  # noqa: F401 - importable here before the split
    _BLOCKED_SCALE_RECORDS,
    _LMCACHE_ALLOCATORS,
    _LMCACHE_ENGINE,
    LMCACHE_FORMATS,
    DiscoverableKVCache,
    EngineKVFormat,
    EngineType,
    LayoutHints,
    _fmt,
    is_cross_layer,
    is_fused_packed,
    is_hnd,
    is_kv_list,
    is_kv_second_tuple,
    is_layer_list,
    is_mla,
    is_pbs_fused,
    is_two_major,
)
from kvcore.compat.lmcache.hints import _ENGINE_HINTS, _GENERIC_HINTS, _engine, _hints, _prepare, _trtllm_pool, _vllm_device  # noqa: F401 - importable here before the split
from kvcore.compat.lmcache.specs import (  # noqa: F401 - importable here before the split
    _SPEC_CLASSES,
    KVFormatSpec,
    _attention_backends,
    _AttentionBackends,
    _entries,
    _layer_indices,
    _layer_layout,
    _layout,
    _params_for,
    _select,
    get_spec,
    get_spec_class,
)
from kvcore.compat.lmcache.transfer import (  # noqa: F401 - importable here before the split
    _DESC_FIELDS,
    PageBufferShapeDesc,
    _probe_tensor,
    assert_contiguous,
    make_page_buffer_shape_desc,
    resolve_block_stride_and_log_layout,
)
from kvcore.errors import AmbiguousLayoutError, DetectionError, FormatError, GeometryError, KVCoreError, TransferError  # noqa: F401

__all__ = [
    # values and types
    "EngineKVFormat",
    "EngineType",
    "LayoutHints",
    "DiscoverableKVCache",
    "PageBufferShapeDesc",
    # kv_format: specs
    "KVFormatSpec",
    "get_spec",
    "get_spec_class",
    "describe_shape",
    "concrete_shape",
    # kv_format: detection and contiguity
    "detect_format",
    "normalize_kv_and_discover_format",
    "normalize_and_discover_per_layer_formats",
    "extract_kv_cache_shapes",
    "get_shape_and_dtype",
    "attempt_permute_to_contiguous_view",
    # utils: geometry
    "get_num_layers",
    "get_num_blocks",
    "get_block_size",
    "get_page_buffer_size",
    "get_kv_size",
    "get_num_heads",
    "get_hidden_dim_size",
    "get_hidden_dim",
    "get_head_size",
    "get_tokens_per_layer",
    "get_elements_per_layer",
    "get_dtype",
    "get_device",
    "get_group_data_ptrs",
    "get_data_ptrs",
    # utils: strings
    "get_engine_kv_shape_description",
    "get_concrete_engine_kv_shape",
    "get_concrete_engine_kv_shape_from_shape_desc",
    "get_attention_backend",
    "legible_print_engine_kv_format",
    # utils: kernel descriptors and checks
    "make_page_buffer_shape_desc",
    "resolve_block_stride_and_log_layout",
    "assert_contiguous",
    "need_gpu_interm_buffer",
    "assert_layerwise_gpu_connector",
    "assert_is_vllm_flash_attn_or_flash_infer",
    "assert_is_vllm_mla_or_flash_attn_or_flash_infer",
    # lmcache_native: format facts
    "is_mla",
    "is_cross_layer",
    "is_kv_list",
    "is_layer_list",
    "is_hnd",
    "is_fused_packed",
    "is_two_major",
    "is_pbs_fused",
    "is_kv_second_tuple",
]

logger = logging.getLogger("kvcore.compat.lmcache")


class _Facade(types.ModuleType):
    """This package, whose ``torch_device_type`` is the one :mod:`kvcore.compat.lmcache.hints`
    reads: LMCache's tests (and callers) set ``kvcore.compat.lmcache.torch_device_type``."""

    @property
    def torch_device_type(self) -> str | None:
        return hints.torch_device_type

    @torch_device_type.setter
    def torch_device_type(self, value: str | None) -> None:
        hints.torch_device_type = value


sys.modules[__name__].__class__ = _Facade
