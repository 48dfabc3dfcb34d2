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
"""

from __future__ import annotations

import enum
import logging
import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Literal, TypedDict, Union

import torch

from kvcore import registry
from kvcore.detection import detect, detect_per_layer, normalize_container, tensors_in
from kvcore.errors import AmbiguousLayoutError, DetectionError, FormatError, GeometryError, KVCoreError, TransferError
from kvcore.format_decl import KVFormat
from kvcore.grammar import TOKENS, parse, render_concrete, render_symbolic
from kvcore.layout import KVLayout, build_layout
from kvcore.layout import PageBufferShapeDesc as _KVCorePageBufferShapeDesc

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


#: LMCache's ``torch_device_type`` (``lmcache/v1/platform``; LMCache 0.5.6's vLLM detector reads
#: it as a module global and its tests monkeypatch it): the platform the caller states. None
#: (the default): not stated -- the facade then reads vLLM caches as LMCache does, as the GPU
#: backends' layouts (LMCache has no other; its platform only picks a default ``kv_layout``),
#: unless the tensors sit on another accelerator. ``"cpu"`` (here, or ``torch_device_type`` in
#: ``layout_hints``) selects vLLM CPU's own layouts (kvcore-vllm's CPU rules).
torch_device_type: str | None = None


def _vllm_device(kv_caches: Any) -> str:
    """The platform LMCache's contract gives a vLLM cache nobody stated one for: the
    tensors' accelerator (ROCm builds: ``rocm``), else a GPU backend's (``cuda``)."""
    if torch_device_type is not None:
        return str(torch_device_type)
    leaves = tensors_in(kv_caches) if not isinstance(kv_caches, torch.Tensor) else [kv_caches]
    dev = leaves[0].device.type if leaves else "cpu"
    if dev == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return dev if dev in ("xpu", "hpu") else "cuda"


#: LMCache 0.5.6's ``EngineKVFormat`` members and their enum values
#: (``csrc/engine_kv_format.h``, ``enum class EngineKVFormat``).
LMCACHE_FORMATS: Mapping[str, int] = MappingProxyType(
    {
        "NB_NL_TWO_BS_NH_HS": 0,
        "NL_X_TWO_NB_BS_NH_HS": 1,
        "NL_X_NB_TWO_BS_NH_HS": 2,
        "NL_X_NB_BS_HS": 3,
        "TWO_X_NL_X_NBBS_NH_HS": 4,
        "NL_X_NBBS_ONE_HS": 5,
        "NL_X_TWO_NB_NH_BS_HS": 6,
        "NL_X_NB_TWO_NH_BS_HS": 7,
        "NB_NL_TWO_NH_BS_HS": 8,
        "TWO_X_NL_X_NB_BS_NH_HS": 9,
        "NL_X_NB_NH_BS_TWO_HS": 10,
        "NL_X_NB_BS_NH_TWO_HS": 11,
        "NL_X_NB_NH_BS_CS": 12,
        "NL_X_NB_BS_NH_CS": 13,
        "NL_X_NB_BSV_BSS": 14,
        "NL_X_TWO_NB_NH_ONE_BS_HS": 15,
        "NL_X_TWO_X_NB_BS_NH_HS": 16,
        "NL_X_NP_X_NB_BS_ONE_HS": 17,
        "NL_X_NB_BS_NH_HS": 18,
    }
)

#: Who allocates each LMCache member, per LMCache's spec files (``specs/<member>.py``,
#: ``attention_backends``) and ``lmcache_kv_format.md`` §1.2: the backend labels for
#: members no installed kvcore plugin registers (a plugin's own list comes first).
_LMCACHE_ALLOCATORS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "NB_NL_TWO_BS_NH_HS": ("vLLM cross-layer KV buffer",),
        "NL_X_TWO_NB_BS_NH_HS": ("vLLM FlashAttention, NHD",),
        "NL_X_NB_TWO_BS_NH_HS": ("vLLM FlashInfer, NHD",),
        "NL_X_NB_BS_HS": ("vLLM MLA latent cache", "SGLang MLA paged by LMCache's MP path"),
        "TWO_X_NL_X_NBBS_NH_HS": ("SGLang MHA token pool",),
        "NL_X_NBBS_ONE_HS": ("SGLang MLA token pool",),
        "NL_X_TWO_NB_NH_BS_HS": ("vLLM FlashAttention, HND",),
        "NL_X_NB_TWO_NH_BS_HS": ("vLLM FlashInfer, HND",),
        "NB_NL_TWO_NH_BS_HS": ("TensorRT-LLM block pool (HND blocks)",),
        "TWO_X_NL_X_NB_BS_NH_HS": ("SGLang MHA pool paged by LMCache's MP path",),
        "NL_X_NB_NH_BS_TWO_HS": ("vLLM blocks-first packed K|V, HND (superseded by NL_X_NB_NH_BS_CS)",),
        "NL_X_NB_BS_NH_TWO_HS": ("vLLM blocks-first packed K|V, NHD (superseded by NL_X_NB_BS_NH_CS)",),
        "NL_X_NB_NH_BS_CS": ("vLLM per-layer packed K|V view, HND",),
        "NL_X_NB_BS_NH_CS": ("vLLM per-layer packed K|V view, NHD",),
        "NL_X_NB_BSV_BSS": ("vLLM DeepSeek blocked-scale pages (indexer, quantised MLA)",),
        "NL_X_TWO_NB_NH_ONE_BS_HS": ("vLLM-RBLN (Rebellions NPU) attention",),
        "NL_X_TWO_X_NB_BS_NH_HS": ("vLLM-Ascend per-layer (K, V) tuples",),
        "NL_X_NP_X_NB_BS_ONE_HS": ("vLLM-Ascend MLA / DSA plane tuples",),
        "NL_X_NB_BS_NH_HS": ("SGLang per-component K or V views (kv_list_layout='unified')",),
    }
)

#: The engine LMCache's spec file of each member is about (its ``attention_backends``), as
#: the kvcore engine name: that engine's plugin gives the member's first backend label.
_LMCACHE_ENGINE: Mapping[str, str] = MappingProxyType(
    {
        name: ("sglang" if labels[0].startswith("SGLang") else "trtllm" if labels[0].startswith("TensorRT-LLM") else "vllm")
        for name, labels in _LMCACHE_ALLOCATORS.items()
    }
)

#: LMCache's blocked-scale record widths -> scale bytes per record
#: (``specs/nl_x_nb_bsv_bss.py::BLOCKED_SCALE_RECORDS``, lmcache_kv_format.md §6.4).
#: Used when an ``NL_X_NB_BSV_BSS`` value carries no ``scale_bytes`` of its own.
_BLOCKED_SCALE_RECORDS: Mapping[int, int] = MappingProxyType({584: 8, 528: 16, 352: 32, 132: 4, 68: 4})


# -- the format value ------------------------------------------------------------------------


class EngineKVFormat(str):
    """A format name that behaves like LMCache's ``EngineKVFormat`` member.

    It *is* the name (``fmt == "NL_X_TWO_NB_BS_NH_HS"``, hashable, JSON-able). LMCache's
    members are class attributes (``EngineKVFormat.NL_X_NB_BS_HS``, ``__members__``) with
    their enum ``value`` (``int(fmt)``); any name the grammar parses is a value too, which is
    how detection returns kvcore formats LMCache has no member for. ``dtype`` / ``params``
    carry what detection decided beyond the name (the element dtype of a byte view, the
    scale width of blocked-scale records); the accessors rebuild the layout with them.

    Raises:
        FormatError: the name does not parse.
    """

    dtype: torch.dtype | None
    params: dict[str, Any]
    __members__: ClassVar[Mapping[str, EngineKVFormat]]

    def __new__(cls, name: str, dtype: torch.dtype | None = None, params: dict[str, Any] | None = None):
        parse(str(name))
        obj = super().__new__(cls, str(name))
        obj.dtype = dtype
        obj.params = dict(params or {})
        return obj

    def __repr__(self) -> str:
        return f"EngineKVFormat.{str(self)}"

    def __reduce__(self):
        return (EngineKVFormat, (str(self), self.dtype, self.params))

    def __int__(self) -> int:
        v = self.value
        if v is None:
            raise FormatError(
                f"{str(self)} is a kvcore format with no LMCache EngineKVFormat value (LMCache's members: {', '.join(LMCACHE_FORMATS)})"
            )
        return v

    @property
    def name(self) -> str:
        return str(self)

    @property
    def value(self) -> int | None:
        """LMCache's enum value of this member, or None for a name LMCache has no member for."""
        return LMCACHE_FORMATS.get(str(self))

    @property
    def syntax(self):
        return parse(str(self))

    @property
    def kv_size(self) -> int:
        return self.syntax.kv_size

    @property
    def is_mla(self) -> bool:
        return self.syntax.is_mla

    @property
    def is_cross_layer(self) -> bool:
        return self.syntax.container == "cross_layer"

    @property
    def is_kv_list(self) -> bool:
        return self.syntax.container == "kv_list"

    @property
    def is_layer_list(self) -> bool:
        """True for per-layer lists, including per-layer tuples (as LMCache's facts)."""
        return self.syntax.container in ("layer_list", "per_layer_tuple")

    @property
    def is_kv_second_tuple(self) -> bool:
        return self.syntax.container == "per_layer_tuple"

    @property
    def is_hnd(self) -> bool:
        return self.syntax.is_hnd

    @property
    def is_fused_packed(self) -> bool:
        return self.syntax.fused_kv

    @property
    def is_two_major(self) -> bool:
        return self.syntax.two_major

    @property
    def is_pbs_fused(self) -> bool:
        return self.syntax.fused_nbbs

    @property
    def is_single_kv(self) -> bool:
        """Each list entry is one K or V tensor with real heads (``NL_X_NB_BS_NH_HS``):
        kv_size 1 with a head axis."""
        syn = self.syntax
        return syn.container == "layer_list" and syn.kv_size == 1 and syn.has("NH")


for _name in LMCACHE_FORMATS:
    setattr(EngineKVFormat, _name, EngineKVFormat(_name))
EngineKVFormat.__members__ = MappingProxyType({n: getattr(EngineKVFormat, n) for n in LMCACHE_FORMATS})
del _name


class EngineType(enum.Enum):
    """LMCache's ``lmcache.utils.EngineType``: the serving engine a cache comes from. Its
    value is the kvcore engine name its plugin answers to."""

    VLLM = "vllm"
    ATOM = "atom"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    MOCK = "mock"


#: LMCache ``kv_format/types.py::DiscoverableKVCache``: a tensor or nested lists/tuples of them.
DiscoverableKVCache = Union[torch.Tensor, list["DiscoverableKVCache"], tuple["DiscoverableKVCache", ...]]


class LayoutHints(TypedDict, total=False):
    """LMCache's ``kv_format/types.py::LayoutHints`` (a plain dict works too).

    Keys: ``kv_layout`` (``"NHD"``, ``"HND"``, ``"BLHNC"``, ``"BLNHC"``: vLLM's physical order),
    ``num_kv_heads``, ``tokens_per_block`` and ``head_dim`` (TensorRT-LLM's pool geometry;
    ``tokens_per_block`` also SGLang's page size), ``kv_list_layout`` (SGLang: ``"k_v"`` for a
    flat list of K layers then V layers). See the module docstring for how each reaches the
    engine's plugin; kvcore plugin hint keys may be given alongside.
    """

    kv_layout: Literal["NHD", "HND", "BLHNC", "BLNHC"]
    num_kv_heads: int
    tokens_per_block: int
    kv_list_layout: Literal["k_v", "unified"]
    head_dim: int


def _fmt(fmt: Any) -> EngineKVFormat:
    if isinstance(fmt, EngineKVFormat):
        return fmt
    if isinstance(fmt, KVFormat):
        return EngineKVFormat(fmt.name)
    name = getattr(fmt, "name", fmt)  # an enum member of LMCache's own EngineKVFormat
    if not isinstance(name, str):
        raise FormatError(f"expected a format name (str), a kvcore.KVFormat or an EngineKVFormat, got {fmt!r}")
    return EngineKVFormat(name)


def _from_layout(layout: KVLayout) -> EngineKVFormat:
    dt = layout.dtype if layout.dtype != layout.storage_dtype else None
    return EngineKVFormat(layout.format.name, dt, getattr(layout.spec, "params", {}))


def _as_lmcache(layout: KVLayout) -> tuple[EngineKVFormat, Any]:
    """A detected layout in LMCache's vocabulary: its format and container, or, when LMCache
    has no member of that name but one for the same bytes, that member and its views.

    Two exact re-views (zero-copy, every address unchanged) are tried: a cross-layer tensor
    whose layer axis is outermost or directly inside the block axis becomes per-layer views
    (``NB_NL_NH_BS_CS`` -> ``NL_X_NB_NH_BS_CS``: each view's ``stride(0)`` spans the other
    layers' bytes, LMCache's dim-0 padding), and a singleton axis is dropped
    (``NL_X_NB_BS_ONE_HS`` -> ``NL_X_NB_BS_HS``). Otherwise kvcore's name is kept.
    """
    f = _from_layout(layout)
    kv = layout.kv_caches
    if str(f) in LMCACHE_FORMATS:
        return f, kv
    syn = f.syntax
    levels, axes = list(syn.list_levels), list(syn.axes)
    if not levels and "NL" in axes:
        nl = axes.index("NL")
        if nl == 0 or (nl == 1 and axes[0] in ("NB", "NBBS")):
            kv = [kv.select(nl, i) for i in range(kv.shape[nl])]
            levels, axes = ["NL"], axes[:nl] + axes[nl + 1 :]
    if levels == ["NL"] and axes.count("ONE") == 1:
        name = "_X_".join(levels + ["_".join(a for a in axes if a != "ONE")])
        if name in LMCACHE_FORMATS:
            j = axes.index("ONE")
            kv = [t.select(j, 0) for t in kv]
            axes = [a for a in axes if a != "ONE"]
    name = "_X_".join(levels + ["_".join(axes)])
    if name == str(f) or name not in LMCACHE_FORMATS:
        return f, layout.kv_caches
    return EngineKVFormat(name, f.dtype, f.params), kv


def _params_for(f: EngineKVFormat, kv_caches: Any) -> dict[str, Any] | None:
    """The format's params; for blocked-scale records without a scale width, LMCache's
    record table gives it from the record width."""
    params = dict(f.params)
    if f.syntax.blocked_scale and "scale_bytes" not in params:
        leaves = tensors_in(kv_caches)
        if leaves and leaves[0].dim() >= 1:
            w = int(leaves[0].shape[-1]) * leaves[0].element_size()
            if w in _BLOCKED_SCALE_RECORDS:
                params["scale_bytes"] = _BLOCKED_SCALE_RECORDS[w]
    return params or None


def _layout(kv_caches: Any, fmt: Any) -> KVLayout:
    f = _fmt(fmt)
    return build_layout(str(f), kv_caches, dtype=f.dtype, params=_params_for(f, kv_caches))


def _entries(kv_caches: Any, f: EngineKVFormat) -> int:
    """Layers in a per-layer or K/V-list container, checking the nesting (not the geometry).

    Raises:
        GeometryError: a multi-plane format (LMCache's accessors describe one width and
            dtype per layout; kvcore's layout API describes each plane), or a container not
            nested as the format says.
    """
    c = f.syntax.container
    if c == "planes":
        raise GeometryError(
            f"format {f} is a multi-plane layout (planes {', '.join(p.role for p in f.syntax.planes)}, each with its own "
            "tensors, width and dtype): LMCache's spec accessors describe one width per layout, so they do not answer for "
            "it. Use kvcore's layout: layout = kvcore.build_layout(fmt, kv_caches) (layout.num_layers, layout.planes, "
            "layout.staging_shapes(T), kvcore.gather(layout, slot_mapping))"
        )
    try:
        if c == "kv_list":
            if len(kv_caches) != 2 or not isinstance(kv_caches[0], (list, tuple)) or not isinstance(kv_caches[1], (list, tuple)):
                raise TypeError
            if len(kv_caches[0]) != len(kv_caches[1]):
                raise GeometryError(f"format {f}: the K list has {len(kv_caches[0])} layers but the V list {len(kv_caches[1])}")
            n = len(kv_caches[0])
        else:
            if not isinstance(kv_caches, (list, tuple)):
                raise TypeError
            n = len(kv_caches)
    except (TypeError, KeyError):
        raise GeometryError(f"format {f}: kv_caches is not nested as {f.syntax.symbolic()} ({type(kv_caches).__name__})") from None
    if n == 0:
        raise GeometryError(f"format {f}: kv_caches holds no layers")
    return n


def _layer_layout(kv_caches: Any, fmt: Any, layer_idx: int) -> KVLayout:
    """The layout of one layer (LMCache's per-layer accessors read ``kv_caches[layer_idx]``,
    so mixed-geometry lists answer per layer). A cross-layer format ignores ``layer_idx``."""
    f = _fmt(fmt)
    if f.syntax.container == "cross_layer":
        return _layout(kv_caches, f)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise GeometryError(f"layer_idx must be an int, got {layer_idx!r}")
    n = _entries(kv_caches, f)
    if not (0 <= layer_idx < n):
        raise GeometryError(f"layer_idx {layer_idx} is out of range: kv_caches has {n} layers (0..{n - 1})")
    if f.syntax.container == "kv_list":
        sub = [[kv_caches[0][layer_idx]], [kv_caches[1][layer_idx]]]
    else:
        sub = [kv_caches[layer_idx]]
    return build_layout(str(f), sub, dtype=f.dtype, params=_params_for(f, sub))


def _select(kv_caches: Any, f: EngineKVFormat, layer_indices: Sequence[int]) -> Any:
    if f.syntax.container == "kv_list":
        return [[kv_caches[0][i] for i in layer_indices], [kv_caches[1][i] for i in layer_indices]]
    return [kv_caches[i] for i in layer_indices]


# -- specs (LMCache kv_format/specs) ---------------------------------------------------------


class _AttentionBackends:
    """``attention_backends`` on a spec class: the registering plugin's backends, else who
    allocates the LMCache member; read when asked, so plugins loaded later are seen."""

    def __get__(self, obj: Any, cls: type | None = None) -> tuple[str, ...]:
        cls = cls if cls is not None else type(obj)
        fmt = getattr(cls, "engine_kv_format", None)
        return _attention_backends(fmt) if fmt is not None else ()


def _attention_backends(fmt: Any) -> tuple[str, ...]:
    """The labels of ``fmt``, the representative first. For an LMCache member: the backends
    the declaration of LMCache's engine for it lists (its own plugin's first), else
    LMCache's label, then every other declaration's; so the first entry is the same
    whatever else is installed (a third party declaring vLLM's name, another engine's
    plugin sharing it). For another name: the registry's merged labels (its owner's first)."""

    name = str(fmt)
    try:
        registry.get_format(name)
        decls = registry.declarations(name)
    except FormatError:
        decls = {}
    engine = _LMCACHE_ENGINE.get(name)
    out: list[str] = []

    def add(labels: Sequence[str]) -> None:
        out.extend(b for b in labels if b not in out)

    if engine is not None:
        mine = sorted(
            (p for p, d in decls.items() if engine in {e.lower() for e in d.engines}),
            key=lambda p: p.lower() != engine,  # the engine's own plugin first, then others declaring it for the engine
        )
        for p in mine:
            add(decls[p].attention_backends)
        add(_LMCACHE_ALLOCATORS.get(name, ()))
    for d in decls.values():
        add(d.attention_backends)
    return tuple(out)


class KVFormatSpec:
    """Geometry of one format's ``kv_caches`` (LMCache ``kv_format/specs/base.py::KVFormatSpec``).

    Get one with :func:`get_spec` (or ``get_spec_class(fmt)(kv_caches)``). Every format has
    its own subclass (``NL_X_TWO_NB_BS_NH_HS_Spec``...), whose class attributes are the
    format's static facts, read off its name:

    * ``engine_kv_format``: the format (:class:`EngineKVFormat`);
    * ``attention_backends``: non-empty for every format a plugin registers or LMCache has a
      member for; the first is what :func:`get_attention_backend` returns;
    * structure (exactly one true): ``is_cross_layer``, ``is_kv_list``, ``is_layer_list``;
    * modifiers: ``is_mla``, ``is_hnd``, ``is_fused_packed``, ``is_two_major``,
      ``is_pbs_fused``, ``is_kv_second_tuple``, ``is_single_kv``.

    Accessors answer from kvcore's layout of the tensors (:func:`kvcore.build_layout`): the
    per-layer ones (``layer_idx``) read that layer alone, so lists whose layers differ answer
    per layer; ``num_blocks``, ``page_buffer_size``, ``tokens_per_layer`` and
    ``elements_per_layer`` read layer 0, as LMCache's do. Sizes are in elements of
    :meth:`dtype`. The spec borrows ``kv_caches``; build one per question.

    Raises (from the accessors): GeometryError (a ``ValueError``) when the tensors do not
    fit the format, for ``num_blocks``/``block_size`` of a fused NBBS format, or for a
    ``layer_idx`` out of range.
    """

    engine_kv_format: ClassVar[EngineKVFormat]
    attention_backends: ClassVar[tuple[str, ...]] = _AttentionBackends()  # type: ignore[assignment]
    is_cross_layer: ClassVar[bool] = False
    is_kv_list: ClassVar[bool] = False
    is_layer_list: ClassVar[bool] = False
    is_mla: ClassVar[bool] = False
    is_hnd: ClassVar[bool] = False
    is_fused_packed: ClassVar[bool] = False
    is_two_major: ClassVar[bool] = False
    is_pbs_fused: ClassVar[bool] = False
    is_kv_second_tuple: ClassVar[bool] = False
    is_single_kv: ClassVar[bool] = False

    def __init__(self, kv_caches: DiscoverableKVCache, engine_kv_format: Any = None):
        """Args:
            kv_caches: the normalised container (as :func:`detect_format` returns it).
            engine_kv_format: the detected value when it carries more than the name (a
                byte view's dtype); default the class's format.

        Raises:
            FormatError: ``engine_kv_format`` names another format than this class's.
        """
        fmt = type(self).engine_kv_format if engine_kv_format is None else _fmt(engine_kv_format)
        if str(fmt) != str(type(self).engine_kv_format):
            raise FormatError(f"{type(self).__name__} describes {type(self).engine_kv_format}, not {fmt}")
        self.kv_caches = kv_caches
        self._fmt = fmt

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._fmt})"

    @classmethod
    def paged_layer_shape(cls, nb: int, bs: int, nh: int, hs: int) -> tuple[int, ...]:
        """The shape of one layer's paged tensor for these sizes (``hs``: the element axis,
        the packed K|V width for CS formats; ``nb * bs`` for a fused NBBS axis).

        Raises:
            FormatError: the format has no single tensor per layer (cross-layer, K/V lists,
                per-layer tuples), or a size is not a positive int.
        """
        fmt = cls.engine_kv_format
        syn = fmt.syntax
        if syn.container != "layer_list":
            raise FormatError(f"{fmt!r} does not have one paged tensor per layer ({syn.symbolic()})")
        for k, v in (("nb", nb), ("bs", bs), ("nh", nh), ("hs", hs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FormatError(f"paged_layer_shape: {k} must be a positive int, got {v!r}")
        if syn.blocked_scale:  # records [NB, BS, W]
            return (nb, bs, hs)
        sizes = {"NB": nb, "BS": bs, "NBBS": nb * bs, "NH": nh, "HS": hs, "CS": hs, "TWO": 2, "ONE": 1}
        return tuple(sizes[t] for t in syn.axes)

    # -- accessors -----------------------------------------------------------------------
    def _layer(self, layer_idx: int = 0) -> KVLayout:
        return _layer_layout(self.kv_caches, self._fmt, layer_idx)

    def num_layers(self) -> int:
        """Layers (list entries; the NL axis of a cross-layer tensor)."""
        if self._fmt.syntax.container == "cross_layer":
            return _layout(self.kv_caches, self._fmt).num_layers
        n = _entries(self.kv_caches, self._fmt)
        self._layer(0)  # the entries are this format's tensors
        return n

    def num_blocks(self) -> int:
        """Blocks per layer. Raises GeometryError (ValueError) for a fused NBBS axis."""
        return self._layer(0).num_blocks

    def block_size(self, layer_idx: int = 0) -> int:
        """Tokens per block of ``layer_idx``. Raises GeometryError for a fused NBBS axis."""
        return self._layer(layer_idx).block_size

    def page_buffer_size(self) -> int:
        """Token slots per layer: ``num_blocks * block_size``, or the fused NBBS axis."""
        return self._layer(0).page_buffer_size

    def kv_size(self) -> int:
        """2 when K and V are both stored (a TWO axis, or packed in CS), 1 for MLA."""
        return self._layer(0).kv_size

    def num_heads(self, layer_idx: int = 0) -> int:
        """KV heads of ``layer_idx`` (1 for MLA)."""
        return self._layer(layer_idx).num_heads

    def hidden_dim(self, layer_idx: int = 0) -> int:
        """``num_heads * head_size`` of ``layer_idx``: one token's K (or V) row."""
        return self._layer(layer_idx).hidden_dim

    def head_size(self, layer_idx: int = 0) -> int:
        """Head size of ``layer_idx`` (the K head size of packed K|V; 576 for DeepSeek MLA)."""
        return self._layer(layer_idx).head_size

    def tokens_per_layer(self) -> int:
        """Token slots per layer (``num_blocks * block_size``)."""
        return self._layer(0).tokens_per_layer

    def elements_per_layer(self) -> int:
        """Elements one layer holds, K and V together (``kv_size * slots * NH * HS``)."""
        return self._layer(0).elements_per_layer

    def dtype(self, layer_idx: int = 0) -> torch.dtype:
        """Element dtype of ``layer_idx`` (a byte view's carried dtype)."""
        return self._layer(layer_idx).dtype

    def data_ptrs(self, layer_indices: Sequence[int] | None = None) -> list[int]:
        """Device pointers in kernel order for ``layer_indices`` (default: every layer): one
        per layer for layer lists; all K then all V for K/V lists; K0, V0, K1, V1... for
        per-layer tuples; one base for a cross-layer tensor.

        Raises:
            GeometryError: a layer index out of range or repeated.
        """
        f = self._fmt
        if f.syntax.container == "cross_layer":
            return _layout(self.kv_caches, f).data_ptrs(None if layer_indices is None else list(layer_indices))
        n = _entries(self.kv_caches, f)
        sel = list(range(n)) if layer_indices is None else _layer_indices(layer_indices, n)
        if not sel:
            return []
        sub = _select(self.kv_caches, f, sel)
        leaves = tensors_in(sub)
        if all(t.shape == leaves[0].shape and t.stride() == leaves[0].stride() and t.dtype == leaves[0].dtype for t in leaves):
            return build_layout(str(f), sub, dtype=f.dtype, params=_params_for(f, sub)).data_ptrs()
        per = [self._layer(i).data_ptrs() for i in sel]  # layers that differ: one at a time
        if f.syntax.container == "kv_list":
            return [p[0] for p in per] + [p[1] for p in per]
        return [x for p in per for x in p]

    def concrete_shape_str(self) -> str:
        """The symbolic shape with this cache's sizes, e.g. ``80 x [2, 2048, 16, 8, 128]``
        (layer 0's sizes for a per-layer list)."""
        f = self._fmt
        if f.syntax.container == "cross_layer":
            return _layout(self.kv_caches, f).describe()
        sizes = self._layer(0).sizes()
        sizes["NL"] = self.num_layers()
        return render_concrete(f.syntax, sizes)


def _layer_indices(layer_indices: Sequence[int], n: int) -> list[int]:
    try:
        sel = list(layer_indices)
    except TypeError:
        raise GeometryError(f"layer_indices must be a sequence of layer indices, got {layer_indices!r}") from None
    out = []
    for i in sel:
        try:
            j = operator.index(i)
        except TypeError:
            j = None
        if j is None or isinstance(i, bool) or not (0 <= j < n):
            raise GeometryError(f"layer index {i!r} is out of range: kv_caches has {n} layers (0..{n - 1})")
        out.append(j)
    if len(set(out)) != len(out):
        raise GeometryError(f"layer indices {out} repeat a layer")
    return out


_SPEC_CLASSES: dict[str, type[KVFormatSpec]] = {}


def get_spec_class(fmt: Any) -> type[KVFormatSpec]:
    """The :class:`KVFormatSpec` subclass of ``fmt``, the owner of its static facts
    (LMCache ``kv_format.get_spec_class``). Every name the grammar parses has one (LMCache's
    members and the kvcore formats detection returns); the class is built from the name.

    Raises:
        FormatError: ``fmt`` is not a format name ("Unknown Engine KV Format").
    """
    try:
        f = _fmt(fmt)
    except FormatError as e:
        raise FormatError(f"Unknown Engine KV Format: {fmt!r} ({e})") from None
    name = str(f)
    cls = _SPEC_CLASSES.get(name)
    if cls is None:
        member = getattr(EngineKVFormat, name, None) if name in LMCACHE_FORMATS else EngineKVFormat(name)
        attrs = {
            "engine_kv_format": member,
            "is_cross_layer": member.is_cross_layer,
            "is_kv_list": member.is_kv_list,
            "is_layer_list": member.is_layer_list,
            "is_mla": member.is_mla,
            "is_hnd": member.is_hnd,
            "is_fused_packed": member.is_fused_packed,
            "is_two_major": member.is_two_major,
            "is_pbs_fused": member.is_pbs_fused,
            "is_kv_second_tuple": member.is_kv_second_tuple,
            "is_single_kv": member.is_single_kv,
            "__doc__": f"Geometry of {name}: {render_symbolic(name)}.",
            "__module__": __name__,
        }
        cls = _SPEC_CLASSES.setdefault(name, type(f"{name}_Spec", (KVFormatSpec,), attrs))
    return cls


def get_spec(kv_caches: DiscoverableKVCache, fmt: Any) -> KVFormatSpec:
    """A spec wrapping ``kv_caches`` of format ``fmt`` (LMCache ``kv_format.get_spec``).

    Raises:
        FormatError: ``fmt`` is not a format name.
    """
    return get_spec_class(fmt)(kv_caches, fmt)


# -- hints -----------------------------------------------------------------------------------


def _engine(serving_engine: Any) -> str:
    """``"vllm"``, LMCache's ``EngineType.VLLM`` (by value or name) → ``"vllm"``."""
    if isinstance(serving_engine, str):
        return serving_engine.lower()
    for attr in ("value", "name"):
        v = getattr(serving_engine, attr, None)
        if isinstance(v, str):
            return v.lower()
    raise DetectionError(f"serving_engine must be an engine name such as 'vllm' or 'sglang', got {serving_engine!r}")


#: LMCache hint key -> the engine plugin's key (None: dropped); keys not listed pass unchanged.
_GENERIC_HINTS: dict[str, str | None] = {
    "kv_layout": "kv_cache_layout",
    "tokens_per_block": "block_size",
    "head_dim": "head_size",
    "torch_device_type": "device_type",
    "inference_engine_logical_block_size": None,
}
_ENGINE_HINTS: dict[str, dict[str, str | None]] = {
    "vllm": {**_GENERIC_HINTS, "kv_list_layout": None},
    "sglang": {
        "kv_layout": "layout",
        "tokens_per_block": "page_size",
        "head_dim": "head_size",
        "torch_device_type": None,
        "inference_engine_logical_block_size": None,
    },
    # kvcore-trtllm reads LMCache's names (KVCacheManager's vocabulary)
    **{e: {"inference_engine_logical_block_size": None} for e in ("trtllm", "tensorrt_llm", "tensorrt-llm")},
}


def _hints(layout_hints: Any, engine: str = "") -> dict[str, Any]:
    """LMCache ``LayoutHints`` (or kvcore keys) -> the hints of ``engine``'s plugin.

    Raises:
        DetectionError: not a dict; two spellings of one hint with different values.
    """
    if layout_hints is None:
        return {}
    if hasattr(layout_hints, "model_dump"):
        layout_hints = layout_hints.model_dump(exclude_none=True)
    if not isinstance(layout_hints, Mapping):
        raise DetectionError(f"layout_hints must be a dict (LMCache LayoutHints), got {type(layout_hints).__name__}")
    table = _ENGINE_HINTS.get(engine, _GENERIC_HINTS)
    out: dict[str, Any] = {}
    for k, v in layout_hints.items():
        if v is None:
            continue
        key = table.get(k, k)
        if key is None:
            continue
        if key != k and layout_hints.get(key) is not None:
            if layout_hints[key] != v:
                raise DetectionError(f"layout_hints gives {k}={v!r} and {key}={layout_hints[key]!r}; they name one fact, give one")
            continue
        out[key] = v
    return out


def _prepare(kv_caches: Any, engine: str, layout_hints: Any) -> tuple[Any, dict[str, Any]]:
    """Hand LMCache's inputs to the engine's plugin as the plugin reads them (see the
    module docstring's "Layout hints")."""
    hints = _hints(layout_hints, engine)
    raw = dict(layout_hints) if isinstance(layout_hints, Mapping) else {}
    if engine == "vllm" and hints.get("device_type") is None:
        # LMCache's adapters always state the platform (torch_device_type); LMCache reads the GPU backends' layouts
        hints["device_type"] = _vllm_device(kv_caches)
    if engine == "vllm" and hints.get("kv_cache_layout") is not None and hints.get("tensor_order") is None:
        # LMCache reads kv_layout as the memory order of the tensors after its contiguity recovery
        # (detection.py::detect_format: attempt_permute_to_contiguous_view, then the detector): the same here
        kv_caches = _memory_ordered_views(kv_caches)
        hints["tensor_order"] = "physical"
    if engine == "sglang" and raw.get("kv_list_layout") not in ("k_v", "unified") and "is_mla" not in hints:
        entries = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else kv_caches
        if (
            isinstance(entries, (list, tuple))
            and entries
            and all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == 1 for t in entries)
        ):
            # LMCache 0.5.6 (detectors/sglang.py) reads a flat list of (rows, 1, D) tensors as the MLA pool, and
            # tokens_per_block splits its rows into pages (NL_X_NB_BS_HS; without it the fused NL_X_NBBS_ONE_HS)
            hints["is_mla"] = True
    if engine in ("trtllm", "tensorrt_llm", "tensorrt-llm"):
        pool = kv_caches[0] if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == 1 else kv_caches
        if isinstance(pool, torch.Tensor) and pool.dim() == 6:
            kv_caches, hints = _trtllm_pool(pool, hints)
    return kv_caches, hints


def _memory_ordered_views(kv_caches: Any) -> Any:
    """Each tensor's axes put in memory order (LMCache's contiguity recovery,
    :func:`attempt_permute_to_contiguous_view`, without re-viewing collapsed strides): a
    permute, never a copy; containers keep their nesting and kind (tuples stay tuples:
    vllm-ascend's container says what its entries are)."""
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() == 0:
            return kv_caches
        st, sh = kv_caches.stride(), kv_caches.shape
        perm = sorted(range(kv_caches.dim()), key=lambda i: (st[i], sh[i] != 1), reverse=True)
        return kv_caches if perm == list(range(kv_caches.dim())) else kv_caches.permute(perm)
    if isinstance(kv_caches, Mapping):
        return {k: _memory_ordered_views(v) for k, v in kv_caches.items()}
    if isinstance(kv_caches, (list, tuple)):
        return type(kv_caches)(_memory_ordered_views(x) for x in kv_caches)
    return kv_caches


def _trtllm_pool(pool: torch.Tensor, hints: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """LMCache's TensorRT-LLM form ``[NB, NL, 2, NH, BS, HS]`` -> the ``[NB, NL, 2, NH*BS*HS]``
    pool TensorRT-LLM allocates, and the hints that factor its last axis (LMCache
    ``detectors/trtllm.py`` takes either)."""
    nb, nl, kvf, nh, bs, hd = (int(x) for x in pool.shape)
    s = pool.stride()
    if s[5] != 1 or s[4] != hd or s[3] != bs * hd:
        raise DetectionError(
            f"trtllm: a 6-D pool view {tuple(pool.shape)} must be the pool [NB, NL, kv_factor, NH*BS*HS] viewed, with its last "
            f"three axes contiguous; got strides {tuple(s)}"
        )
    out = dict(hints)
    for key, v in (("num_kv_heads", nh), ("tokens_per_block", bs), ("head_dim", hd)):
        if out.get(key) is not None and out[key] != v:
            raise DetectionError(f"trtllm: hint {key}={out[key]!r} but the 6-D pool view {tuple(pool.shape)} has {v}")
        out[key] = v
    return pool.flatten(3), out


# -- detection -------------------------------------------------------------------------------


def normalize_kv_and_discover_format(kv_caches: Any, serving_engine: Any, layout_hints: Any = None) -> tuple[EngineKVFormat, Any]:
    """Detect the format of ``kv_caches`` and return it with the normalised container.

    LMCache ``utils.normalize_kv_and_discover_format`` (= ``kv_format.detect_format``).

    Args:
        kv_caches: the engine's tensors: a list/tuple (nested as the engine keeps it) or a
            dict keyed by layer name.
        serving_engine: ``"vllm"``, ``"sglang"``, ... or :class:`EngineType` (LMCache's).
        layout_hints: LMCache ``LayoutHints`` or kvcore hint keys (module docstring).
    Returns:
        ``(fmt, normalized)``: the format, and the container as the format nests it — views
        of the caller's tensors (never copies). Use ``normalized`` with the accessors.
    Raises:
        DetectionError: nothing recognises the cache (the message lists shapes, strides and
            the plugins asked). AmbiguousLayoutError: two layouts fit; names the deciding hint.
    """
    engine = _engine(serving_engine)
    kv, hints = _prepare(kv_caches, engine, layout_hints)
    try:
        layout = detect(kv, engine, hints)
    except AmbiguousLayoutError as e:
        layout = _lmcache_reading(kv, engine, hints, e)
    fmt, normalized = _plane_tuples(layout, kv) if engine == "vllm" else (None, None)
    if fmt is None:
        fmt, normalized = _as_lmcache(layout)
    logger.info("Engine KV Format: %s %s", fmt, render_symbolic(str(fmt)))
    return fmt, normalized


#: vllm-ascend's tuple layouts (kvcore-vllm ``pairs``) whose planes LMCache names ``NL_X_NP_X_NB_BS_ONE_HS``
_ASCEND_PLANE_TUPLES = (
    "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS",
    "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS",
    "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS+IK=NL_X_NB_BS_NH_HS",
    "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS+IK=NL_X_NB_BS_NH_HS+IKS=NL_X_NB_BS_NH_HS",
    "KV=NL_X_NB_BS_NH_HS",
    "K=NL_X_NB_BS_NH_HS",
    "K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH_HS",
)


def _single_head_tuples(kv: Any) -> bool:
    entries = list(kv.values()) if isinstance(kv, Mapping) else kv
    return (
        isinstance(entries, (list, tuple))
        and bool(entries)
        and all(
            isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] == 1 for t in x) for x in entries
        )
    )


def _plane_tuples(layout: KVLayout, kv: Any) -> tuple[EngineKVFormat | None, Any]:
    """vllm-ascend's single-head plane tuples (MLA (nope, rope), DSA (k, v, dsa_k[, scale]),
    one-plane tuples) under LMCache's name for them, ``NL_X_NP_X_NB_BS_ONE_HS``, with the
    tuples as LMCache returns them (lists, planes in tuple order): the same planes kvcore's
    multi-plane layout reads, named without their roles. (None, None) for anything else."""
    if layout.format.name not in _ASCEND_PLANE_TUPLES or not _single_head_tuples(kv):
        return None, None
    entries = list(kv.values()) if isinstance(kv, Mapping) else list(kv)
    if len(entries[0]) == 2 and entries[0][0].shape[-1] == entries[0][1].shape[-1] and entries[0][0].dtype == entries[0][1].dtype:
        return None, None  # equal-width pairs are (K, V): LMCache's NL_X_TWO_X_NB_BS_NH_HS
    return EngineKVFormat("NL_X_NP_X_NB_BS_ONE_HS"), [list(x) for x in entries]


def _lmcache_reading(kv: Any, engine: str, hints: dict[str, Any], err: AmbiguousLayoutError) -> KVLayout:
    """Where kvcore's plugin names two readings and LMCache's contract picks one that is
    right by the engine's source, that one; else ``err`` is raised.

    * vLLM rank-4 pages with a singleton head axis (``[NB, 1, BS, W]`` HND / ``[NB, BS, 1,
      W]`` NHD, what LMCache's vLLM adapter sends for 0.33 MLA and record pages): LMCache
      reads one head of a ``W``-wide row per token (kv_size 1). That is the MLA reading
      (``kv_cache_spec="mla"``) wherever that reading moves per-token rows or is the DSA
      indexer's blocked page LMCache also reads (132 B); records whose readings differ
      (V4's 584 B blocked page against a packed row) stay kvcore's ambiguity.
    * vllm-ascend single-head tuples whose (nope, rope) / (K, V head_size_v) readings differ
      only in their planes' names: LMCache's plane tuples (the MLA reading's planes).
    """
    if engine != "vllm" or hints.get("kv_cache_spec") is not None:
        raise err
    entries = list(kv.values()) if isinstance(kv, Mapping) else kv if isinstance(kv, (list, tuple)) else [kv]
    if _single_head_tuples(entries):
        return detect(kv, engine, {**hints, "kv_cache_spec": "mla"})
    if not entries or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in entries):
        raise err
    family = str(hints.get("kv_cache_layout") or "").upper()
    axis = 1 if family in ("HND", "LBHNC", "BLHNC") else 2 if family in ("NHD", "LBNHC", "BLNHC") else None
    if axis is None or any(int(t.shape[axis]) != 1 for t in entries):
        raise err
    try:
        lay = detect(kv, engine, {**hints, "kv_cache_spec": "mla"})
    except DetectionError:
        raise err from None
    width = int(entries[0].shape[-1]) * entries[0].element_size()
    if lay.format.name.endswith("NB_BS_HS") or (lay.format.name.endswith("NB_BSV_BSS") and width == 132):
        return lay
    raise err


detect_format = normalize_kv_and_discover_format


def extract_kv_cache_shapes(kv_caches: Any) -> set[torch.Size]:
    """Every leaf tensor's shape (LMCache ``kv_format.extract_kv_cache_shapes``)."""
    return {t.shape for t in tensors_in(kv_caches)}


def _structure_key(entry: Any) -> Hashable:
    if isinstance(entry, (list, tuple)):
        return tuple(_structure_key(x) for x in entry)
    if isinstance(entry, torch.Tensor):
        return (tuple(entry.shape), entry.dtype)
    return None


def get_shape_and_dtype(kv_caches: Any, layer_indices: Sequence[int] | None = None) -> list[Hashable]:
    """Each requested layer's ``(shape, dtype)`` structure, nested as its entry is (LMCache
    ``utils.get_shape_and_dtype``): two layers share a key exactly when their shapes and
    dtypes match.

    Args:
        kv_caches: per-layer entries (tensors or nested sequences of them), or a dict of layers.
        layer_indices: the entries to describe, in this order; None: all.
    Raises:
        GeometryError: a layer index out of range.
    """
    container, _ = normalize_container(kv_caches)
    entries = list(container) if isinstance(container, (list, tuple)) else [container]
    n = len(entries)
    if layer_indices is None:
        sel = list(range(n))
    else:
        sel = []
        for i in layer_indices:
            if isinstance(i, bool) or not isinstance(i, int) or not (0 <= i < n):
                raise GeometryError(f"layer index {i!r} is out of range: kv_caches has {n} entries (0..{n - 1})")
            sel.append(i)
    return [_structure_key(entries[i]) for i in sel]


def normalize_and_discover_per_layer_formats(
    kv_caches: Any,
    layer_index_groups: Sequence[Sequence[int]] | None,
    serving_engine: Any,
    layout_hints: Any = None,
) -> tuple[Any, list[EngineKVFormat | None]]:
    """One format per layer, for hybrid models (LMCache ``utils.normalize_and_discover_per_layer_formats``).

    If every tensor has one shape and the whole cache is a cross-layer tensor or a K/V list,
    that one format is returned for every layer with the normalised container. Otherwise the
    layers are detected per engine group and per tensor shape/stride/dtype
    (:func:`kvcore.detect_per_layer`).

    Args:
        kv_caches: a per-layer list (or dict), or one cross-layer tensor.
        layer_index_groups: layer indices of each engine group; empty/None means one group.
        serving_engine, layout_hints: as :func:`normalize_kv_and_discover_format`.
    Returns:
        ``(normalized_per_layer, formats)``: per-layer views (as each layer's format nests
        them) and one format per layer; ``None`` for a layer the engine's plugin says is not
        KV (Mamba state), whose raw entry is kept.
    Raises:
        DetectionError / AmbiguousLayoutError: for a group nothing (or more than one layout) fits.
    """
    engine = _engine(serving_engine)
    if len(extract_kv_cache_shapes(kv_caches)) == 1:
        kv, hints = _prepare(kv_caches, engine, layout_hints)
        try:
            whole = detect(kv, engine, hints)
        except DetectionError:
            whole = None
        if whole is not None:
            f, norm = _as_lmcache(whole)
            if f.is_layer_list:
                return _per_layer(whole, norm), [f] * whole.num_layers
            return norm, [f] * whole.num_layers
    container, _ = normalize_container(kv_caches)
    if isinstance(container, torch.Tensor):
        raise DetectionError("a single tensor that no plugin reads as a cross-layer cache has no per-layer formats")
    groups = [list(g) for g in layer_index_groups] if layer_index_groups else None
    container, hints = _prepare(container, engine, layout_hints)
    layouts: Any = detect_per_layer(container, engine, layer_groups=groups, hints=hints)
    if isinstance(layouts, Mapping):  # keyed by layer: back to layer order
        layouts = [layouts[k] for k in (range(len(container)) if all(isinstance(k, int) for k in layouts) else layouts)]
    normalized: list[Any] = []
    formats: list[EngineKVFormat | None] = []
    for i, lay in enumerate(layouts):
        if lay is None:
            normalized.append(container[i])
            formats.append(None)
            continue
        f, norm = _as_lmcache(lay)
        pos = list(lay.layer_ids).index(i) if i in lay.layer_ids else None
        if pos is None or not f.is_layer_list:
            normalized.append(container[i])
        else:
            normalized.append(_per_layer(lay, norm)[pos])
        formats.append(f)
    return normalized, formats


def _per_layer(layout: KVLayout, norm: Any) -> list[Any]:
    """One entry per layer of ``layout``: layers that share memory (``layout.aliases``) are
    one entry of the normalised container, repeated for each of its layers."""
    norm = list(norm)
    if len(norm) != layout.num_layers:
        norm = [norm[p] for p in layout.layer_map]
    return norm


def _expected_shape(stride: Sequence[int], numel: int) -> tuple[int, ...]:
    shape = [numel // stride[0]]
    for i in range(len(stride) - 1):
        shape.append(stride[i] // stride[i + 1])
    return tuple(shape)


def _dim0_padding(t: torch.Tensor) -> int:
    """Padding per block of a view whose only gap is after each dim-0 row, or GeometryError."""
    shape, stride = tuple(t.shape), tuple(t.stride())

    def fail(reason: str) -> None:
        raise GeometryError(
            f"attempt_permute_to_contiguous_view: the tensor is not contiguous and not a supported (dim-0 padding only) "
            f"layout: {reason}. shape={shape}, stride={stride}, storage_offset={t.storage_offset()}, dtype={t.dtype}; "
            "kvcore.detect describes any strides, LMCache's contiguity recovery only dim-0 padding"
        )

    if t.dim() < 2:
        fail("rank < 2")
    if stride[-1] != 1:
        fail("the innermost axis is not contiguous")
    if stride[-2] != shape[-1]:
        fail("the last two axes are not tightly packed")
    tight = shape[-1]
    for i in range(t.dim() - 2, 0, -1):
        if stride[i] != tight:
            fail(f"axis {i} has stride {stride[i]} where a tight layout has {tight} (interior padding)")
        tight *= shape[i]
    if stride[0] < tight:
        fail(f"dim 0 has stride {stride[0]} < {tight} (overlapping blocks)")
    return stride[0] - tight


def attempt_permute_to_contiguous_view(kv_caches: DiscoverableKVCache) -> DiscoverableKVCache:
    """Views whose shape follows their physical order (LMCache ``kv_format/contiguity.py``).

    Metadata only, never a copy: each tensor's axes are sorted by stride (a size-1 axis tying
    with a neighbour goes innermost); a contiguous result is re-viewed with the tightest
    shape its strides imply (collapsed size-1 strides recover the true extents), a
    dim-0-padded one is returned as it is. Lists and tuples are rebuilt with the same
    nesting (LMCache returns lists for tuples). :func:`normalize_kv_and_discover_format`
    does not need this: kvcore reads strides.

    Raises:
        GeometryError: a view that stays non-contiguous with a gap anywhere but after each
            dim-0 row ("dim-0 padding only"), or a leaf that is not a tensor.
    """
    if isinstance(kv_caches, torch.Tensor):
        t = kv_caches
        if t.dim() == 0:
            return t
        strides, shape = t.stride(), t.shape
        perm = sorted(range(t.dim()), key=lambda i: (strides[i], shape[i] != 1), reverse=True)
        out = t.permute(perm)
        if out.is_contiguous():
            if out.numel() == 0:
                return out
            return out.view(_expected_shape(out.stride(), out.numel()))
        pad = _dim0_padding(out)
        logger.debug("attempt_permute_to_contiguous_view: dim-0 padded view, %d elements per block", pad)
        return out
    if isinstance(kv_caches, (list, tuple)):
        return type(kv_caches)(attempt_permute_to_contiguous_view(x) for x in kv_caches)
    raise GeometryError(f"attempt_permute_to_contiguous_view: expected tensors in lists/tuples, got {type(kv_caches).__name__}")


# -- geometry accessors (LMCache utils.get_*) ------------------------------------------------


def get_num_layers(kv_caches: Any, engine_kv_format: Any) -> int:
    """Layers in ``kv_caches``."""
    return get_spec(kv_caches, engine_kv_format).num_layers()


def get_num_blocks(kv_caches: Any, engine_kv_format: Any) -> int:
    """Blocks per layer (layer 0). Raises GeometryError (a ValueError) for a fused NBBS axis."""
    return get_spec(kv_caches, engine_kv_format).num_blocks()


def get_block_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """Tokens per block of layer ``layer_idx`` (cross-layer formats ignore it).
    Raises GeometryError for a fused NBBS axis or a bad ``layer_idx``."""
    return get_spec(kv_caches, engine_kv_format).block_size(layer_idx)


def get_page_buffer_size(kv_caches: Any, engine_kv_format: Any) -> int:
    """Token slots per layer: ``num_blocks * block_size``, or the fused NBBS axis."""
    return get_spec(kv_caches, engine_kv_format).page_buffer_size()


def get_kv_size(kv_caches: Any, engine_kv_format: Any) -> int:
    """2 when K and V are both stored (a TWO axis, or packed in CS), 1 for MLA."""
    return get_spec(kv_caches, engine_kv_format).kv_size()


def get_num_heads(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """KV heads of layer ``layer_idx`` (1 for MLA)."""
    return get_spec(kv_caches, engine_kv_format).num_heads(layer_idx)


def get_hidden_dim_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """``num_heads * head_size`` of layer ``layer_idx``: one token's K (or V) row, in elements."""
    return get_spec(kv_caches, engine_kv_format).hidden_dim(layer_idx)


get_hidden_dim = get_hidden_dim_size


def get_head_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """Head size of layer ``layer_idx`` in elements (576 for DeepSeek MLA latents; the K head
    size of a packed CS axis)."""
    return get_spec(kv_caches, engine_kv_format).head_size(layer_idx)


def get_tokens_per_layer(kv_caches: Any, engine_kv_format: Any) -> int:
    """Token slots per layer (``num_blocks * block_size``)."""
    return get_spec(kv_caches, engine_kv_format).tokens_per_layer()


def get_elements_per_layer(kv_caches: Any, engine_kv_format: Any) -> int:
    """Elements one layer holds, K and V together (``kv_size * slots * NH * HS``)."""
    return get_spec(kv_caches, engine_kv_format).elements_per_layer()


def get_dtype(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> torch.dtype:
    """Element dtype of layer ``layer_idx`` (the carried dtype of byte views, e.g. bf16 in int8 buffers)."""
    return get_spec(kv_caches, engine_kv_format).dtype(layer_idx)


def get_device(kv_caches: Any) -> torch.device:
    """The device of the first tensor in ``kv_caches`` (LMCache ``utils.get_device``).

    Raises:
        DetectionError: ``kv_caches`` holds no tensor.
    """
    container, _ = normalize_container(kv_caches)
    probe = container
    while isinstance(probe, (list, tuple)):
        probe = probe[0]
    return probe.device


def get_group_data_ptrs(kv_caches: Any, engine_kv_format: Any, layer_indices: Sequence[int]) -> list[int]:
    """Device pointers of ``layer_indices`` in kernel order (one per layer; all K then all V
    for K/V lists; K0, V0, K1, V1 for per-layer tuples; one base for a cross-layer tensor).
    Layers outside ``layer_indices`` are not read, so a group of a hybrid model's cache answers.

    Raises:
        GeometryError: a layer index out of range or repeated.
    """
    return get_spec(kv_caches, engine_kv_format).data_ptrs(list(layer_indices))


def get_data_ptrs(kv_caches: Any, engine_kv_format: Any, layer_indices: Sequence[int] | None = None) -> list[int]:
    """Like :func:`get_group_data_ptrs`; ``layer_indices`` defaults to every layer (the
    spec method ``KVFormatSpec.data_ptrs``)."""
    return get_spec(kv_caches, engine_kv_format).data_ptrs(None if layer_indices is None else list(layer_indices))


# -- shape strings ---------------------------------------------------------------------------


def describe_shape(engine_kv_format: Any) -> str:
    """Symbolic shape: ``NL_X_TWO_NB_BS_NH_HS`` → ``NL x [2, NB, BS, NH, HS]``.

    Raises:
        FormatError: not a format name.
    """
    return render_symbolic(str(_fmt(engine_kv_format)))


def concrete_shape(engine_kv_format: Any, size_fn: Callable[[str], int]) -> str:
    """The shape with ``size_fn(label)`` substituted for each label (NL, NB, BS, NH, HS, PBS,
    CS, NP; literal 2 and 1 stay). ``size_fn`` raising ``KeyError`` propagates (LMCache's
    ``concrete_shape`` contract)."""
    syn = _fmt(engine_kv_format).syntax
    sizes: dict[str, int] = {}
    for tok in syn.tokens:
        t = TOKENS[tok]
        if t.literal is not None or tok in ("BSV", "BSS"):
            continue
        sizes[t.label] = int(size_fn(t.label))
    return render_concrete(syn, sizes)


def get_engine_kv_shape_description(engine_kv_format: Any) -> str:
    """Symbolic shape, or ``"Unknown (<format>)"`` for a name that does not parse."""
    try:
        return describe_shape(engine_kv_format)
    except FormatError:
        return f"Unknown ({engine_kv_format})"


def get_concrete_engine_kv_shape(kv_caches: Any, engine_kv_format: Any) -> str:
    """Concrete shape (``80 x [2, 2048, 128, 8, 128]``; layer 0's sizes for a per-layer list),
    or ``"Unknown (<format>)"`` when the tensors do not fit the format (a logging helper:
    it never raises for that)."""
    try:
        return get_spec(kv_caches, engine_kv_format).concrete_shape_str()
    except (FormatError, GeometryError):
        return f"Unknown ({engine_kv_format})"


def get_concrete_engine_kv_shape_from_shape_desc(shape_desc: Any, engine_kv_format: Any) -> str:
    """Concrete shape of one kernel group from its :class:`PageBufferShapeDesc` (``nl`` is the
    group's layer count). Fused NBBS formats use ``nb * bs``; CS is ``hs`` for a ``kv_size``
    1 descriptor (LMCache's convention), else ``2 * hs``. Returns ``"Unknown (<format>)"``
    for a name that does not parse."""
    sizes = {
        "NB": shape_desc.nb,
        "NL": shape_desc.nl,
        "BS": shape_desc.bs,
        "NH": shape_desc.nh,
        "HS": shape_desc.hs,
        "CS": shape_desc.hs if shape_desc.kv_size == 1 else 2 * shape_desc.hs,
        "PBS": shape_desc.nb * shape_desc.bs,
    }
    try:
        return render_concrete(_fmt(engine_kv_format).syntax, sizes)
    except FormatError:
        return f"Unknown ({engine_kv_format})"


def get_attention_backend(engine_kv_format: Any) -> str:
    """The format's representative attention backend: the first of its spec class's
    ``attention_backends``, or ``"Unknown (<format>)"`` (diagnostic only, as in LMCache)."""
    try:
        backends = get_spec_class(engine_kv_format).attention_backends
    except FormatError:
        return f"Unknown ({engine_kv_format})"
    return backends[0] if backends else f"Unknown ({engine_kv_format})"


def legible_print_engine_kv_format(engine_kv_format: Any) -> None:
    """Log the format's symbolic shape and a backend that uses it."""
    shape = get_engine_kv_shape_description(engine_kv_format)
    if shape.startswith("Unknown"):
        logger.warning("Unknown Engine KV Format: %s", engine_kv_format)
        return
    logger.info("Engine KV Format: %s", shape)
    logger.info("Currently used by:\n  - %s", get_attention_backend(engine_kv_format))


# -- kernel descriptors ----------------------------------------------------------------------

_DESC_FIELDS = ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems")


class PageBufferShapeDesc:
    """LMCache's ``PageBufferShapeDesc`` (``csrc/kv_transfer_plan_types.h``; the Python
    ``device_ops.PageBufferShapeDesc``): default-constructible and mutable, as LMCache's
    callers build one empty and set its fields.

    Fields (ints, default 0): ``kv_size`` (1 or 2 planes), ``nl`` (layers of the kernel
    group), ``nb`` (blocks), ``bs`` (block size), ``nh`` (heads; 1 for MLA), ``hs`` (head
    size in elements), ``element_size`` (bytes), ``block_stride_elems`` (the block axis's
    stride in elements; 0: tight). ``dtype`` (a ``torch.dtype`` or None) tells fp16 from
    bf16, as LMCache's Python side attribute does. :meth:`to_kvcore` gives kvcore's frozen
    :class:`kvcore.PageBufferShapeDesc`.

    Raises:
        GeometryError: a field set to something other than a non-negative int, ``dtype``
            to something other than a ``torch.dtype`` or None.
        AttributeError: a name that is not a field.
    """

    __slots__ = (*_DESC_FIELDS, "dtype")

    def __init__(
        self,
        kv_size: int = 0,
        nl: int = 0,
        nb: int = 0,
        bs: int = 0,
        nh: int = 0,
        hs: int = 0,
        element_size: int = 0,
        block_stride_elems: int = 0,
        dtype: torch.dtype | None = None,
    ):
        for k, v in zip(_DESC_FIELDS, (kv_size, nl, nb, bs, nh, hs, element_size, block_stride_elems)):
            setattr(self, k, v)
        self.dtype = dtype

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _DESC_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise GeometryError(f"PageBufferShapeDesc.{name} must be a non-negative int, got {value!r}")
            value = int(value)
        elif name == "dtype" and value is not None and not isinstance(value, torch.dtype):
            raise GeometryError(f"PageBufferShapeDesc.dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {value!r}")
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PageBufferShapeDesc):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__)
        return f"PageBufferShapeDesc({fields})"

    def to_kvcore(self) -> _KVCorePageBufferShapeDesc:
        """kvcore's frozen :class:`kvcore.PageBufferShapeDesc` with these fields."""
        return _KVCorePageBufferShapeDesc(**{k: getattr(self, k) for k in _DESC_FIELDS})

    @classmethod
    def from_kvcore(cls, desc: _KVCorePageBufferShapeDesc, dtype: torch.dtype | None = None) -> PageBufferShapeDesc:
        """The mutable descriptor of kvcore's :class:`kvcore.PageBufferShapeDesc` (from
        :meth:`kvcore.KVLayout.shape_desc`)."""
        return cls(**{k: getattr(desc, k) for k in _DESC_FIELDS}, dtype=dtype)


def make_page_buffer_shape_desc(
    kv_caches: Any,
    engine_kv_format: Any,
    layer_idx: int,
    num_layers_in_group: int,
    num_blocks: int,
    block_size: int,
    block_stride_elems: int | None = None,
) -> PageBufferShapeDesc:
    """A :class:`PageBufferShapeDesc` for one kernel group, from its representative layer.

    ``kv_size``, ``nh`` (1 for MLA), ``hs``, ``element_size`` and ``dtype`` come from layer
    ``layer_idx``; ``nl``, ``nb``, ``bs`` from the arguments; ``block_stride_elems`` is
    passed through (0 when None: the tight stride), as LMCache ``utils.make_page_buffer_shape_desc``.

    Raises:
        GeometryError: a bad ``layer_idx``, or a count that is not a positive int.
    """
    for name, v in (("num_layers_in_group", num_layers_in_group), ("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GeometryError(f"{name} must be a positive int, got {v!r}")
    if block_stride_elems is not None and (
        isinstance(block_stride_elems, bool) or not isinstance(block_stride_elems, int) or block_stride_elems < 0
    ):
        raise GeometryError(f"block_stride_elems must be a non-negative int or None, got {block_stride_elems!r}")
    lay = _layer_layout(kv_caches, engine_kv_format, layer_idx)
    return PageBufferShapeDesc(
        kv_size=lay.kv_size,
        nl=num_layers_in_group,
        nb=num_blocks,
        bs=block_size,
        nh=1 if lay.is_mla else lay.num_heads,
        hs=lay.head_size,
        element_size=lay.element_size,
        block_stride_elems=int(block_stride_elems) if block_stride_elems else 0,
        dtype=lay.dtype,
    )


def _probe_tensor(kv_caches: Any, fmt: EngineKVFormat, layer_idx: int) -> torch.Tensor:
    c = fmt.syntax.container
    if c == "cross_layer":
        if not isinstance(kv_caches, torch.Tensor):
            raise GeometryError(f"cross-layer format {fmt} expects one backing torch.Tensor, got {type(kv_caches).__name__}")
        return kv_caches
    if c == "kv_list":
        return kv_caches[0][layer_idx]
    if c == "per_layer_tuple":
        return kv_caches[layer_idx][0]
    return kv_caches[layer_idx]


def resolve_block_stride_and_log_layout(kv_caches: Any, engine_kv_format: Any, layer_idx: int, group_idx: int) -> int | None:
    """The ``block_stride_elems`` of a kernel group, and a one-line layout audit log.

    For every format whose tensors have the block axis (NB, or a fused NBBS axis) at dim 0,
    returns ``stride(0)`` of layer ``layer_idx``'s tensor in elements of the format's dtype
    (dim-0 padding shows as a value above the tight stride); otherwise ``None``, the tight
    stride. LMCache ``utils.resolve_block_stride_and_log_layout`` answers this only for an
    allow-list of formats; here the grammar answers it for all.

    Raises:
        GeometryError: a bad ``layer_idx``; padding or permutation a PageBufferShapeDesc
            cannot express (anywhere but a dim-0 block axis). kvcore's own transfers handle
            those through the stride table; only descriptor-based kernels cannot.
    """
    f = _fmt(engine_kv_format)
    lay = _layer_layout(kv_caches, f, layer_idx)
    rep = _probe_tensor(kv_caches, f, layer_idx)
    syn = f.syntax
    block_axis = syn.axis("NBBS" if syn.fused_nbbs else "NB")
    result: int | None
    if block_axis == 0 and rep.dim() > 0:
        result = int(rep.stride(0)) * rep.element_size() // lay.element_size
        lay.shape_desc()  # refuses padding/permutation elsewhere
    else:
        desc = lay.shape_desc()  # raises GeometryError for padding it cannot express
        result = desc.block_stride_elems or None
    inner = 1
    for n in rep.shape[1:]:
        inner *= int(n)
    logger.info(
        "Group %d first-layer tensor: layer_idx=%d format=%s shape=%s stride=%s is_contiguous=%s dtype=%s device=%s "
        "storage_offset=%d numel=%d storage_nbytes=%d padding_per_block=%d",
        group_idx,
        layer_idx,
        f,
        tuple(rep.shape),
        tuple(rep.stride()),
        rep.is_contiguous(),
        rep.dtype,
        rep.device,
        rep.storage_offset(),
        rep.numel(),
        rep.untyped_storage().nbytes(),
        (int(rep.stride(0)) - inner) if rep.dim() else 0,
    )
    return result


def assert_contiguous(tensor: torch.Tensor) -> None:
    """Refuse a tensor that is not contiguous from storage offset 0 (LMCache
    ``utils.assert_contiguous``, without ``assert``).

    Raises:
        GeometryError: a non-zero storage offset, or a non-contiguous tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise GeometryError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.storage_offset() != 0:
        raise GeometryError(f"expected storage_offset 0, got {tensor.storage_offset()} (shape {tuple(tensor.shape)})")
    if not tensor.is_contiguous():
        raise GeometryError(f"tensor is not contiguous: shape {tuple(tensor.shape)} stride {tuple(tensor.stride())}")


def need_gpu_interm_buffer(lmcache_config: Any) -> bool:
    """Whether a GPU connector needs an intermediate device buffer: yes unless the config
    enables prefill/decode disaggregation (LMCache ``utils.need_gpu_interm_buffer``).

    Args:
        lmcache_config: LMCache's ``LMCacheEngineConfig`` (anything with ``enable_pd``).
    Raises:
        KVCoreError: the config has no ``enable_pd``.
    """
    if not hasattr(lmcache_config, "enable_pd"):
        raise KVCoreError(
            f"need_gpu_interm_buffer expects LMCache's LMCacheEngineConfig (an object with enable_pd), got {type(lmcache_config).__name__}"
        )
    return not bool(lmcache_config.enable_pd)


#: LMCache's layerwise GPU connector classes (``utils.assert_layerwise_gpu_connector``:
#: ``gpu_connectors``, ``xpu_connectors``, ``musa_connectors``).
LAYERWISE_CONNECTORS = (
    "VLLMPagedMemLayerwiseGPUConnector",
    "VLLMBufferLayerwiseGPUConnector",
    "SGLangLayerwiseGPUConnector",
    "VLLMPagedMemLayerwiseXPUConnector",
    "VLLMBufferLayerwiseXPUConnector",
    "SGLangLayerwiseXPUConnector",
    "SGLangLayerwiseMUSAConnector",
)


def assert_layerwise_gpu_connector(gpu_connector: Any) -> None:
    """Refuse a GPU connector that is not one of LMCache's layerwise connectors (its class
    or a base class is named in :data:`LAYERWISE_CONNECTORS`; LMCache checks ``isinstance``
    against those classes).

    Raises:
        TransferError: not a layerwise connector (LMCache: ``AssertionError``).
    """
    names = {c.__name__ for c in type(gpu_connector).__mro__}
    if not names & set(LAYERWISE_CONNECTORS):
        raise TransferError(
            f"{type(gpu_connector).__name__} is not a layerwise GPU connector; layerwise transfer needs one of "
            f"{', '.join(LAYERWISE_CONNECTORS)}"
        )


#: Per-layer non-MLA vLLM members LMCache's vLLM connectors accept
#: (``utils.assert_is_vllm_flash_attn_or_flash_infer``).
_VLLM_NON_MLA = (
    "NL_X_TWO_NB_BS_NH_HS",
    "NL_X_NB_TWO_BS_NH_HS",
    "NL_X_TWO_NB_NH_BS_HS",
    "NL_X_NB_TWO_NH_BS_HS",
    "NL_X_NB_NH_BS_TWO_HS",
    "NL_X_NB_BS_NH_TWO_HS",
    "NL_X_NB_NH_BS_CS",
    "NL_X_NB_BS_NH_CS",
)
#: ... and the MLA members added by ``assert_is_vllm_mla_or_flash_attn_or_flash_infer``.
_VLLM_MLA = ("NL_X_NB_BS_HS", "NL_X_NB_BSV_BSS")


def _vllm_per_layer(f: EngineKVFormat, mla: bool) -> bool:
    """A per-layer format kvcore's vLLM plugin registers (detection can return it)."""

    try:
        engines = registry.get_format(str(f)).engines
    except FormatError:
        return False
    # vLLM-RBLN's 6-D pages are the RBLN device ops' alone (LMCache's GPU connectors never take member 15)
    return "vllm" in engines and f.syntax.container == "layer_list" and (mla or not f.is_mla) and str(f) != "NL_X_TWO_NB_NH_ONE_BS_HS"


def assert_is_vllm_flash_attn_or_flash_infer(engine_kv_format: Any) -> None:
    """Refuse a format that is not a per-layer non-MLA vLLM layout: LMCache's list (the
    FlashAttention / FlashInfer members, NHD and HND, and the packed K|V members) or a
    per-layer non-MLA format kvcore's vLLM plugin registers.

    Raises:
        FormatError: any other format (LMCache: ``AssertionError``).
    """
    f = _fmt(engine_kv_format)
    if str(f) not in _VLLM_NON_MLA and not _vllm_per_layer(f, mla=False):
        raise FormatError(
            f"{f} is not a per-layer non-MLA vLLM format; expected one of {', '.join(_VLLM_NON_MLA)} (or another vLLM per-layer layout)"
        )


def assert_is_vllm_mla_or_flash_attn_or_flash_infer(engine_kv_format: Any) -> None:
    """Refuse a format that is not a per-layer vLLM layout: LMCache's list (FlashAttention /
    FlashInfer NHD and HND, MLA latents, blocked-scale pages) or a per-layer format kvcore's
    vLLM plugin registers.

    Raises:
        FormatError: any other format (LMCache: ``AssertionError``).
    """
    f = _fmt(engine_kv_format)
    allowed = _VLLM_NON_MLA[:4] + _VLLM_MLA
    if str(f) not in allowed and not _vllm_per_layer(f, mla=True):
        raise FormatError(f"{f} is not a per-layer vLLM format; expected one of {', '.join(allowed)} (or another vLLM per-layer layout)")


# -- format facts (LMCache's C++ predicates) -------------------------------------------------


def is_mla(engine_kv_format: Any) -> bool:
    """No K/V split and no heads (kv_size 1)."""
    return _fmt(engine_kv_format).is_mla


def is_cross_layer(engine_kv_format: Any) -> bool:
    """One tensor holds every layer."""
    return _fmt(engine_kv_format).is_cross_layer


def is_kv_list(engine_kv_format: Any) -> bool:
    """``[K layers, V layers]``."""
    return _fmt(engine_kv_format).is_kv_list


def is_layer_list(engine_kv_format: Any) -> bool:
    """One entry per layer (including per-layer tuples)."""
    return _fmt(engine_kv_format).is_layer_list


def is_kv_second_tuple(engine_kv_format: Any) -> bool:
    """Each layer entry is a tuple (``NL_X_TWO_X_...``, ``NL_X_NP_X_...``)."""
    return _fmt(engine_kv_format).is_kv_second_tuple


def is_hnd(engine_kv_format: Any) -> bool:
    """Heads outside tokens within a block."""
    return _fmt(engine_kv_format).is_hnd


def is_fused_packed(engine_kv_format: Any) -> bool:
    """K and V packed in the element axis (CS, or TWO directly outside HS)."""
    return _fmt(engine_kv_format).is_fused_packed


def is_two_major(engine_kv_format: Any) -> bool:
    """The K/V axis is outside the block axis."""
    return _fmt(engine_kv_format).is_two_major


def is_pbs_fused(engine_kv_format: Any) -> bool:
    """Blocks and tokens fused in one axis (NBBS)."""
    return _fmt(engine_kv_format).is_pbs_fused
