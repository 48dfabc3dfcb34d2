"""LMCache's KV-format utilities, as a thin facade over kvcore.

Code written against LMCache's ``lmcache/v1/gpu_connector/utils.py`` (and the
``kv_format`` package it fronts) moves over by changing an import::

    # from lmcache.v1.gpu_connector.utils import normalize_kv_and_discover_format, get_num_layers
    from kvcore.compat.lmcache import normalize_kv_and_discover_format, get_num_layers

    fmt, kv = normalize_kv_and_discover_format(kv_caches, "vllm", {"kv_layout": "HND"})
    get_num_layers(kv, fmt), get_block_size(kv, fmt), get_concrete_engine_kv_shape(kv, fmt)

Names, argument order and return shapes follow LMCache (``../shared/reference/lmcache_kv_format.md``
§2.2 the spec accessors and their ``utils.get_*`` wrappers, §3.1 detection, §5.2
``make_page_buffer_shape_desc`` / ``resolve_block_stride_and_log_layout``, §6.1
``normalize_and_discover_per_layer_formats``; signatures as in LMCache
``lmcache/v1/gpu_connector/utils.py``, commit ``02b35f8``). The differences, all deliberate:

* **The format is a string.** LMCache passes an ``EngineKVFormat`` enum member; here it is an
  :class:`EngineKVFormat` — a ``str`` subclass equal to the kvcore format name (which is the
  LMCache member name for every layout both know), with the same fact properties
  (``is_mla``, ``is_cross_layer``, ``is_kv_list``, ...). It also carries what detection
  decided beyond the name (the element dtype of byte views, ``params``), so the accessors
  rebuild exactly the detected layout. A plain string works too.
* **Errors are kvcore's** (:class:`~kvcore.FormatError`, :class:`~kvcore.DetectionError`,
  :class:`~kvcore.GeometryError`); each is also a ``ValueError``, as LMCache's were, so
  ``except ValueError`` handlers keep working. Nothing here ``assert``s.
* **Packed K|V (``CS``) formats keep K and V apart**: kvcore stages them as two planes, so
  ``get_kv_size`` is 2 and ``get_head_size`` is the K head size (LMCache: 1 and ``CS``);
  ``get_hidden_dim_size`` is ``NH * HS`` accordingly. This matches kvcore's staging layout
  ``[kv_size, NL, T, NH*HS]`` that :func:`kvcore.gather` produces.
* **Dim-0 padding is honoured for every format whose dim 0 is the block axis** (LMCache:
  an allow-list of two formats), because kvcore's kernels read the stride table.
* ``normalize_and_discover_per_layer_formats`` gives ``None`` (not an arbitrary fallback
  format) for layers a plugin says are not KV (Mamba state).
* Layout hints use LMCache's ``LayoutHints`` keys or kvcore's: ``kv_layout`` is passed as
  ``kv_cache_layout``, ``tokens_per_block`` as ``block_size``, ``head_dim`` as ``head_size``,
  ``torch_device_type`` as ``device_type`` (unless the kvcore key is given too);
  ``inference_engine_logical_block_size`` is dropped, as LMCache's ``GPUCacheContext``
  removes it before detection. Other keys go to the engine's plugin unchanged.

Like LMCache's specs, nothing here keeps a reference to the tensors: each accessor builds
the layout it needs and lets it go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore.detection import detect, detect_per_layer, normalize_container, tensors_in
from kvcore.errors import DetectionError, FormatError, GeometryError
from kvcore.formats import KVFormat
from kvcore.grammar import TOKENS, parse, render_concrete, render_symbolic
from kvcore.layout import KVLayout, PageBufferShapeDesc, build_layout

__all__ = [
    "EngineKVFormat",
    "normalize_kv_and_discover_format",
    "detect_format",
    "normalize_and_discover_per_layer_formats",
    "extract_kv_cache_shapes",
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
    "describe_shape",
    "concrete_shape",
    "get_engine_kv_shape_description",
    "get_concrete_engine_kv_shape",
    "get_concrete_engine_kv_shape_from_shape_desc",
    "get_attention_backend",
    "legible_print_engine_kv_format",
    "make_page_buffer_shape_desc",
    "resolve_block_stride_and_log_layout",
    "assert_contiguous",
    "is_mla",
    "is_cross_layer",
    "is_kv_list",
    "is_layer_list",
    "is_hnd",
    "is_fused_packed",
    "is_two_major",
    "is_pbs_fused",
    "is_kv_second_tuple",
    "PageBufferShapeDesc",
]

logger = logging.getLogger("kvcore.compat.lmcache")


# -- the format value ------------------------------------------------------------------------


class EngineKVFormat(str):
    """A format name that behaves like LMCache's ``EngineKVFormat`` member.

    It *is* the name (``fmt == "NL_X_TWO_NB_BS_NH_HS"``, hashable, JSON-able) and answers the
    member's fact properties. ``dtype`` / ``params`` carry what detection decided beyond the
    name (element dtype of a byte view, the K head size of a packed axis); the accessors
    rebuild the layout with them.

    Raises:
        FormatError: the name does not parse.
    """

    dtype: torch.dtype | None
    params: dict[str, Any]

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

    @property
    def name(self) -> str:
        return str(self)

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


def _layout(kv_caches: Any, fmt: Any) -> KVLayout:
    f = _fmt(fmt)
    return build_layout(str(f), kv_caches, dtype=f.dtype, params=f.params or None)


def _layer_layout(kv_caches: Any, fmt: Any, layer_idx: int) -> KVLayout:
    """The layout of one layer (LMCache's per-layer accessors read ``kv_caches[layer_idx]``,
    so mixed-geometry lists answer per layer)."""
    f = _fmt(fmt)
    syn = f.syntax
    if syn.container == "cross_layer":
        return _layout(kv_caches, f)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise GeometryError(f"layer_idx must be an int, got {layer_idx!r}")
    try:
        if syn.container == "kv_list":
            n = len(kv_caches[0])
            sub = None if not (0 <= layer_idx < n) else [[kv_caches[0][layer_idx]], [kv_caches[1][layer_idx]]]
        else:
            n = len(kv_caches)
            sub = None if not (0 <= layer_idx < n) else [kv_caches[layer_idx]]
    except (TypeError, IndexError, KeyError):
        raise GeometryError(f"format {f}: kv_caches is not nested as {f.syntax.symbolic()} ({type(kv_caches).__name__})") from None
    if sub is None:
        raise GeometryError(f"layer_idx {layer_idx} is out of range: kv_caches has {n} layers (0..{n - 1})")
    return build_layout(str(f), sub, dtype=f.dtype, params=f.params or None)


def _engine(serving_engine: Any) -> str:
    """``"vllm"``, LMCache's ``EngineType.VLLM`` (by value or name) → ``"vllm"``."""
    if isinstance(serving_engine, str):
        return serving_engine.lower()
    for attr in ("value", "name"):
        v = getattr(serving_engine, attr, None)
        if isinstance(v, str):
            return v.lower()
    raise DetectionError(f"serving_engine must be an engine name such as 'vllm' or 'sglang', got {serving_engine!r}")


_HINT_ALIASES = {
    "kv_layout": "kv_cache_layout",
    "tokens_per_block": "block_size",
    "head_dim": "head_size",
    "torch_device_type": "device_type",
}
_HINTS_DROPPED = ("inference_engine_logical_block_size",)


def _hints(layout_hints: Any) -> dict[str, Any]:
    if layout_hints is None:
        return {}
    if hasattr(layout_hints, "model_dump"):
        layout_hints = layout_hints.model_dump(exclude_none=True)
    if not isinstance(layout_hints, dict):
        raise DetectionError(f"layout_hints must be a dict (LMCache LayoutHints), got {type(layout_hints).__name__}")
    out: dict[str, Any] = {}
    for k, v in layout_hints.items():
        if v is None or k in _HINTS_DROPPED:
            continue
        key = _HINT_ALIASES.get(k, k)
        if key != k and key in layout_hints and layout_hints[key] is not None:
            if layout_hints[key] != v:
                raise DetectionError(f"layout_hints gives {k}={v!r} and {key}={layout_hints[key]!r}; they name one fact, give one")
            continue
        out[key] = v
    return out


# -- detection -------------------------------------------------------------------------------


def normalize_kv_and_discover_format(kv_caches: Any, serving_engine: Any, layout_hints: Any = None) -> tuple[EngineKVFormat, Any]:
    """Detect the format of ``kv_caches`` and return it with the normalised container.

    LMCache ``utils.normalize_kv_and_discover_format`` (= ``kv_format.detect_format``).

    Args:
        kv_caches: the engine's tensors: a list/tuple (nested as the engine keeps it) or a
            dict keyed by layer name.
        serving_engine: ``"vllm"``, ``"sglang"``, ... or LMCache's ``EngineType`` member.
        layout_hints: LMCache ``LayoutHints`` or kvcore hint keys (see the module docstring).
    Returns:
        ``(fmt, normalized)``: the format, and the container as the format nests it — views
        of the caller's tensors (never copies). Use ``normalized`` with the accessors.
    Raises:
        DetectionError: nothing recognises the cache (the message lists shapes, strides and
            the plugins asked). AmbiguousLayoutError: two layouts fit; names the deciding hint.
    """
    layout = detect(kv_caches, _engine(serving_engine), _hints(layout_hints))
    fmt = _from_layout(layout)
    logger.info("Engine KV Format: %s %s", fmt, layout.format.symbolic)
    return fmt, layout.kv_caches


detect_format = normalize_kv_and_discover_format


def extract_kv_cache_shapes(kv_caches: Any) -> set[torch.Size]:
    """Every leaf tensor's shape (LMCache ``kv_format.extract_kv_cache_shapes``)."""
    return {t.shape for t in tensors_in(kv_caches)}


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
    engine, hints = _engine(serving_engine), _hints(layout_hints)
    if len(extract_kv_cache_shapes(kv_caches)) == 1:
        try:
            whole = detect(kv_caches, engine, hints)
        except DetectionError:
            whole = None
        if whole is not None:
            f = _from_layout(whole)
            if whole.format.container in ("layer_list", "per_layer_tuple"):
                return [whole.kv_caches[p] for p in whole.layer_map], [f] * whole.num_layers
            return whole.kv_caches, [f] * whole.num_layers
    container, _ = normalize_container(kv_caches)
    if isinstance(container, torch.Tensor):
        raise DetectionError("a single tensor that no plugin reads as a cross-layer cache has no per-layer formats")
    groups = [list(g) for g in layer_index_groups] if layer_index_groups else None
    layouts = detect_per_layer(container, engine, layer_groups=groups, hints=hints)
    normalized: list[Any] = []
    formats: list[EngineKVFormat | None] = []
    for i, lay in enumerate(layouts):
        if lay is None:
            normalized.append(container[i])
            formats.append(None)
            continue
        pos = list(lay.layer_ids).index(i) if i in lay.layer_ids else None
        if pos is None or lay.format.container not in ("layer_list", "per_layer_tuple"):
            normalized.append(container[i])
        else:
            normalized.append(lay.kv_caches[lay.layer_map[pos]])
        formats.append(_from_layout(lay))
    return normalized, formats


# -- geometry accessors (LMCache utils.get_*) ------------------------------------------------


def get_num_layers(kv_caches: Any, engine_kv_format: Any) -> int:
    """Layers in ``kv_caches``."""
    return _layout(kv_caches, engine_kv_format).num_layers


def get_num_blocks(kv_caches: Any, engine_kv_format: Any) -> int:
    """Blocks per layer. Raises GeometryError for a fused NBBS axis (LMCache: ValueError)."""
    return _layout(kv_caches, engine_kv_format).num_blocks


def get_block_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """Tokens per block of layer ``layer_idx`` (cross-layer formats ignore it).
    Raises GeometryError for a fused NBBS axis or a bad ``layer_idx``."""
    return _layer_layout(kv_caches, engine_kv_format, layer_idx).block_size


def get_page_buffer_size(kv_caches: Any, engine_kv_format: Any) -> int:
    """Token slots per layer: ``num_blocks * block_size``, or the fused NBBS axis."""
    return _layout(kv_caches, engine_kv_format).page_buffer_size


def get_kv_size(kv_caches: Any, engine_kv_format: Any) -> int:
    """2 when K and V are both stored (a TWO axis, or packed in CS), 1 for MLA."""
    return _layout(kv_caches, engine_kv_format).kv_size


def get_num_heads(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """KV heads of layer ``layer_idx`` (1 for MLA)."""
    return _layer_layout(kv_caches, engine_kv_format, layer_idx).num_heads


def get_hidden_dim_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """``num_heads * head_size`` of layer ``layer_idx``: one token's K (or V) row, in elements."""
    return _layer_layout(kv_caches, engine_kv_format, layer_idx).hidden_dim


get_hidden_dim = get_hidden_dim_size


def get_head_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """Head size of layer ``layer_idx`` in elements (576 for DeepSeek MLA latents; the K head
    size of a packed CS axis)."""
    return _layer_layout(kv_caches, engine_kv_format, layer_idx).head_size


def get_tokens_per_layer(kv_caches: Any, engine_kv_format: Any) -> int:
    """Token slots per layer (``num_blocks * block_size``)."""
    return _layout(kv_caches, engine_kv_format).tokens_per_layer


def get_elements_per_layer(kv_caches: Any, engine_kv_format: Any) -> int:
    """Elements one layer holds, K and V together (``kv_size * slots * NH * HS``)."""
    return _layout(kv_caches, engine_kv_format).elements_per_layer


def get_dtype(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> torch.dtype:
    """Element dtype of layer ``layer_idx`` (the carried dtype of byte views, e.g. bf16 in int8 buffers)."""
    return _layer_layout(kv_caches, engine_kv_format, layer_idx).dtype


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

    Raises:
        GeometryError: a layer index out of range or repeated.
    """
    return _layout(kv_caches, engine_kv_format).data_ptrs(list(layer_indices))


def get_data_ptrs(kv_caches: Any, engine_kv_format: Any, layer_indices: Sequence[int] | None = None) -> list[int]:
    """Like :func:`get_group_data_ptrs`; ``layer_indices`` defaults to every layer (the
    spec method ``KVFormatSpec.data_ptrs``)."""
    return _layout(kv_caches, engine_kv_format).data_ptrs(None if layer_indices is None else list(layer_indices))


# -- shape strings ---------------------------------------------------------------------------


def describe_shape(engine_kv_format: Any) -> str:
    """Symbolic shape: ``NL_X_TWO_NB_BS_NH_HS`` → ``NL x [2, NB, BS, NH, HS]``."""
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
    """Concrete shape (``80 x [2, 2048, 128, 8, 128]``), or ``"Unknown (<format>)"`` when the
    tensors do not fit the format (a logging helper: it never raises for that)."""
    try:
        return _layout(kv_caches, engine_kv_format).describe()
    except (FormatError, GeometryError):
        return f"Unknown ({engine_kv_format})"


def get_concrete_engine_kv_shape_from_shape_desc(shape_desc: PageBufferShapeDesc, engine_kv_format: Any) -> str:
    """Concrete shape of one kernel group from its :class:`PageBufferShapeDesc` (``nl`` is the
    group's layer count). Fused NBBS formats use ``nb * bs``; CS is ``2 * hs``. Returns
    ``"Unknown (<format>)"`` for a name that does not parse."""
    sizes = {
        "NB": shape_desc.nb,
        "NL": shape_desc.nl,
        "BS": shape_desc.bs,
        "NH": shape_desc.nh,
        "HS": shape_desc.hs,
        "CS": 2 * shape_desc.hs,
        "PBS": shape_desc.nb * shape_desc.bs,
    }
    try:
        return render_concrete(_fmt(engine_kv_format).syntax, sizes)
    except FormatError:
        return f"Unknown ({engine_kv_format})"


def get_attention_backend(engine_kv_format: Any) -> str:
    """The first attention backend the registering plugin lists for the format, or
    ``"Unknown (<format>)"`` (diagnostic only, as in LMCache)."""
    from kvcore import registry

    try:
        fmt = registry.get_format(str(_fmt(engine_kv_format)))
    except FormatError:
        return f"Unknown ({engine_kv_format})"
    return fmt.attention_backends[0] if fmt.attention_backends else f"Unknown ({engine_kv_format})"


def legible_print_engine_kv_format(engine_kv_format: Any) -> None:
    """Log the format's symbolic shape and a backend that uses it."""
    shape = get_engine_kv_shape_description(engine_kv_format)
    if shape.startswith("Unknown"):
        logger.warning("Unknown Engine KV Format: %s", engine_kv_format)
        return
    logger.info("Engine KV Format: %s", shape)
    logger.info("Currently used by:\n  - %s", get_attention_backend(engine_kv_format))


# -- kernel descriptors ----------------------------------------------------------------------


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

    ``kv_size``, ``nh`` (1 for MLA), ``hs`` and ``element_size`` come from layer
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


# -- format facts (LMCache's C++ predicates) -------------------------------------------------


def is_mla(engine_kv_format: Any) -> bool:
    """No K/V split (kv_size 1)."""
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
    """K and V packed in the element axis (CS)."""
    return _fmt(engine_kv_format).is_fused_packed


def is_two_major(engine_kv_format: Any) -> bool:
    """The K/V axis is outside the block axis."""
    return _fmt(engine_kv_format).is_two_major


def is_pbs_fused(engine_kv_format: Any) -> bool:
    """Blocks and tokens fused in one axis (NBBS)."""
    return _fmt(engine_kv_format).is_pbs_fused
