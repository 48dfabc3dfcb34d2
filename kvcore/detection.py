"""The detection driver, and the helpers plugins use to decide between candidates.

``detect`` turns the caller's container into nested lists (a dict keyed by layer name
becomes a list in layer order), asks the engine's plugin (``kvcore_detect``), and builds
the :class:`~kvcore.layout.KVLayout`. Nothing is copied: detection and normalisation are
views.

Plugins decide with :func:`resolve`: each candidate (format + normalised views) is
built into a layout; candidates whose stride tables are identical move the same bytes
and are one answer; candidates that address memory differently are a real ambiguity,
and :class:`~kvcore.AmbiguousLayoutError` names them and the hints that would decide
(never a hint the caller already gave).

Tensor order: as allocated, or already in memory order
------------------------------------------------------
A format name is the **physical** (memory) order of the cache. Tensors reach kvcore in
one of two ways: **as the engine allocated them** (the engine's logical shape; when the
engine permuted its allocation, the strides show it, e.g. vLLM's HND caches) or **already
permuted into memory order** by the caller (some connectors do: the shape's order is the
memory order). A tensor whose strides are permuted can only be the first. A contiguous
tensor can be either, and when the two readings give different geometry (an NHD
allocation ``[.., BS, NH, HS]`` is also an HND cache ``[.., NH, BS, HS]`` handed over in
memory order, with BS and NH swapped) nothing in the bytes decides: a hint must.

Plugins mark each :class:`Candidate` with ``order``: ``None`` (the reading holds either
way: its views are the tensor's own axes and those are in memory order), ``"allocated"``
(a reading of the engine's logical axes through permuted strides) or ``"physical"`` (the
tensor read as already in memory order). The generic hint :data:`TENSOR_ORDER`
(``hints={"tensor_order": "allocated"}`` or ``"physical"``), which every engine accepts,
states which one the caller passed. Without it:

* readings of both kinds that place bytes differently raise
  :class:`~kvcore.AmbiguousLayoutError` (naming ``tensor_order`` and the geometry hints
  that decide, e.g. ``num_kv_heads``, ``block_size``);
* when only an in-memory-order reading fits the hints, while the strides show an
  as-allocated reading that a hint rules out (a plugin passes it as a candidate with
  ``against={hint: value}``), the hint contradicts the strides: :class:`~kvcore.DetectionError`
  naming both (``tensor_order="physical"`` says the in-memory-order reading is meant).
"""

from __future__ import annotations

import contextvars
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import registry
from kvcore.containers import _LAYER_RE, _ROLE_RE, Layers, Planes, _is_planes, _layer_key, describe_input, normalize_container, tensors_in  # noqa: F401
from kvcore.errors import AmbiguousLayoutError, DetectionError, GeometryError
from kvcore.format_decl import KVFormat
from kvcore.grammar import parse
from kvcore.inputs import check_container, tensor_paths  # noqa: F401 (check_container: re-exported)
from kvcore.layout import Detection, KVLayout, _build_layout
from kvcore.spec import record_callers

__all__ = [
    "detect",
    "detect_per_layer",
    "normalize_container",
    "Planes",
    "tensors_in",
    "Candidate",
    "resolve",
    "physical_permutation",
    "memory_ordered",
    "split_aliases",
    "tensor_order",
    "describe_input",
    "TENSOR_ORDER",
    "TENSOR_ORDERS",
    "GEOMETRY_HINTS",
]

log = logging.getLogger("kvcore.detection")

#: The hint every engine accepts that states how the tensors' axes relate to memory.
TENSOR_ORDER = "tensor_order"
#: Its values: ``"allocated"`` (as the engine allocated them: its logical shape, strides
#: show any permutation) and ``"physical"`` (already permuted into memory order).
TENSOR_ORDERS = ("allocated", "physical")
_ORDER_ALIASES = {
    "allocated": "allocated",
    "as_allocated": "allocated",
    "logical": "allocated",
    "physical": "physical",
    "memory": "physical",
    "memory_order": "physical",
}
#: Default names of the hints that fix a layout's geometry (layout attribute -> hint).
GEOMETRY_HINTS: dict[str, str] = {"block_size": "block_size", "num_heads": "num_kv_heads", "head_size": "head_size"}


def _hints_dict(hints: Any) -> dict[str, Any]:
    if hints is None:
        return {}
    if hasattr(hints, "model_dump"):
        return {k: v for k, v in hints.model_dump().items() if v is not None}
    if isinstance(hints, Mapping):
        return {k: v for k, v in hints.items() if v is not None}
    raise DetectionError(f"hints must be a dict or a pydantic model, got {type(hints).__name__}")


def tensor_order(hints: Mapping[str, Any] | None) -> str | None:
    """The value of the generic :data:`TENSOR_ORDER` hint: ``"allocated"``, ``"physical"``
    or None (not given). Also accepts ``"logical"`` / ``"as_allocated"`` and ``"memory"``
    / ``"memory_order"``.

    Raises:
        DetectionError: any other value.
    """
    if not hints or hints.get(TENSOR_ORDER) is None:
        return None
    v = hints[TENSOR_ORDER]
    key = str(v).strip().lower() if isinstance(v, str) else None
    if key not in _ORDER_ALIASES:
        raise DetectionError(
            f"hint {TENSOR_ORDER}={v!r} is not known: use 'allocated' (the tensors as the engine allocated them; their strides "
            "show the memory order) or 'physical' (the tensors were already permuted so that their axes are in memory order)"
        )
    return _ORDER_ALIASES[key]


# -- one detect() call's context: the caller's hints and the readings plugins rejected ------


@dataclass
class _Call:
    hints: dict[str, Any]
    rejected: list[str] = field(default_factory=list)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("kvcore_detect_call", default=None)


def _detectors() -> list[str]:
    h = registry.host()
    return sorted(getattr(i, "plugin_name", None) or h.pm.get_name(i.plugin) for i in h.pm.hook.kvcore_detect.get_hookimpls())


def _ask(
    host: Any, container: Any, engine: str, hints: dict[str, Any], what: str = ""
) -> tuple[Detection | None, KVLayout | None, list[str]]:
    """Ask the plugins' ``kvcore_detect`` hooks, one plugin at a time: one that crashes,
    returns garbage, returns copies, or returns a detection that does not build (a format
    that does not parse or is not registered, tensors that do not fit it) is named and
    skipped, and the others answer (:func:`kvcore.registry.ask_detect`).

    Returns:
        (the detection or None, its layout (None when the detection excludes the tensors),
        the readings the plugins tried that did not fit, with why: :func:`resolve` records
        them for this call).
    """
    call = _Call(hints=dict(hints))
    built: dict[str, Any] = {}

    def build(det: Detection, plugin: str) -> KVLayout:
        _check_registered(det.format)
        # the tensors are listed once, by the final error, not in every plugin's refusal
        lay = _build(det, engine, None, what or f"it detected {det.format}")
        lay.plugin = plugin
        built["layout"] = lay
        return lay

    token = _CALL.set(call)
    try:
        det = registry.ask_detect(container, engine, hints, build=build)
    finally:
        _CALL.reset(token)
    layout = built.get("layout") if det is not None and det.format is not None else None
    return det, layout, call.rejected


def _check_registered(fmt: Any) -> None:
    """A detection's format must be a name some loaded plugin declares: a name nobody
    registered carries no engine, labels or sources, and a plugin answering with one would
    pre-empt the plugin that knows the cache.

    Raises:
        FormatError: a malformed name (naming the token).
        DetectionError: not a format name, or a name no loaded plugin registers.
    """

    name = fmt.name if isinstance(fmt, KVFormat) else fmt
    if not isinstance(name, str):
        raise DetectionError(f"its format must be a format name (a str), got {type(fmt).__name__} {fmt!r:.80}")
    if name in registry.host().formats:
        return
    parse(name)  # a malformed name: FormatError naming the token
    raise DetectionError(
        f"it detected {name}, a format no loaded plugin registers: a detection names a format its plugin declares "
        "(kvcore_register_formats), so kvcore knows its engines and sources"
    )


def _advice(container: Any, rejected: Sequence[str]) -> str:
    """What the caller can do about a cache nothing recognised: the readings tried and why
    they failed, layers that differ (-> detect_per_layer), an empty pool."""
    lines: list[str] = []
    if rejected:
        shown = list(dict.fromkeys(rejected))
        lines.append("readings tried, and why they do not fit:")
        lines += [f"  - {r}" for r in shown[:8]]
        if len(shown) > 8:
            lines.append(f"  ... and {len(shown) - 8} more")
    if isinstance(container, (list, tuple)) and len(container) > 1:
        sigs = {_signature(x) for x in container}
        if len(sigs) > 1:
            lines.append(
                f"the {len(container)} entries are not alike ({len(sigs)} different shapes, strides or dtypes): a model whose "
                "layers differ (hybrid attention, an MLA indexer beside the latent cache, per-group head sizes, Mamba layers) "
                "is detected group by group with kvcore.detect_per_layer(kv_caches, engine, hints=...)"
            )
    empty = sorted({tuple(t.shape) for t in tensors_in(container) if t.numel() == 0})
    if empty:
        lines.append(
            f"tensors of shape {list(empty[0])} hold no elements: a pool with 0 blocks (or 0 tokens, heads or elements) is not "
            "a KV cache kvcore can describe; detect it after the engine allocated its blocks"
        )
    return ("\n" + "\n".join(lines)) if lines else ""


def _engine_name(engine: Any) -> str:
    """The engine argument of :func:`detect` / :func:`detect_per_layer`: one engine name.

    Raises:
        DetectionError: not a non-empty ``str`` (a list of engines, None, an enum member
            without a string value...), naming the engines the installed plugins declare.
    """
    if isinstance(engine, str) and engine.strip():
        return engine
    v = getattr(engine, "value", None)  # an enum member whose value is the engine's name
    if isinstance(v, str) and v.strip() and not isinstance(engine, (list, tuple, set, dict)):
        return v
    shown = f"{type(engine).__name__} {engine!r:.80}"
    hint = ""
    if isinstance(engine, (list, tuple, set, frozenset)) and len(engine) == 1 and isinstance(next(iter(engine)), str):
        hint = f"; pass engine={next(iter(engine))!r} (a cache comes from one engine)"
    raise DetectionError(
        f"engine must be one engine name (a str), got {shown}{hint}. Engines the installed plugins declare: "
        f"{', '.join(known_engines()) or 'none'}"
    )


def detect(kv_caches: Any, engine: str, hints: Any = None) -> KVLayout:
    """Recognise an engine's KV cache and describe it.

    Args:
        kv_caches: the engine's cache: a list or tuple (nested as the engine keeps it),
            or a dict keyed by layer name (vLLM; put in layer order, see
            :func:`normalize_container`), of ``torch.Tensor``; or one tensor (a
            cross-layer pool), or an engine's cache object its plugin unwraps.
        engine: ``"vllm"``, ``"sglang"``, ``"transformers"``, ... — the plugin that answers.
        hints: a dict or pydantic model of facts the tensors cannot show (the engine's
            documented precedence applies; see each plugin's docs). Every engine also
            accepts :data:`TENSOR_ORDER` (``"allocated"`` / ``"physical"``).
    Returns:
        a :class:`KVLayout` over views of the caller's tensors (no copies). Entries that
        are one memory (vLLM's KV-sharing layers) stay one layer each;
        ``layout.aliases`` says which layer shares which one's memory.
    Raises:
        DetectionError: no plugin recognises it (the message lists the tensors' shapes,
            strides and dtypes, the engine, the plugins asked and the readings they tried
            with why each failed), a hint contradicts the strides, or a plugin's
            ``kvcore_detect`` crashed or returned something that is not a Detection.
        AmbiguousLayoutError: two formats fit and no hint decides (names both and the hints).
    """
    engine = _engine_name(engine)
    container, names = normalize_container(kv_caches)
    h = _hints_dict(hints)
    _check_order_statement(container, h)
    host = registry.host()
    det, layout, rejected = _ask(host, container, engine, h)
    if det is None:
        asked = ", ".join(_detectors()) or "none (no engine plugin is installed)"
        raise DetectionError(
            f"{_unknown_engine(engine)}no kvcore plugin recognises this KV cache for engine {engine!r} (hints {h or 'none'}).\n"
            f"tensors:\n{describe_input(container)}\n"
            f"plugins asked: {asked}. Check the engine name, add hints (kv_cache_layout, attention_backend, "
            "block_size, num_kv_heads...), or install the engine's plugin." + _advice(container, rejected)
        )
    if det.format is None:
        raise DetectionError(f"these tensors are not a KV cache: {det.excluded or det.note}\ntensors:\n{describe_input(container)}")
    layout = page_split(layout, det, h, engine)
    _check_distinct_aliases(engine, det, container, [f"layer {n!r}" for n in names] if names is not None else None, False)
    # the caller's own tensors (often views themselves): a transfer refuses once one is re-pointed or reshaped
    record_callers(layout.spec.stride_table(), tensor_paths(kv_caches))
    if names is not None:
        if det.layer_ids is not None and all(0 <= i < len(names) for i in layout.layer_ids):
            layout.layer_names = tuple(names[i] for i in layout.layer_ids)
        elif det.layer_ids is None and len(names) == layout.num_layers:
            layout.layer_names = tuple(names)
    log.debug("detected %s %s for engine %s (%s)", layout.format.name, layout.describe(), engine, det.note)
    return layout


#: the generic hints that split a fused NBBS axis into blocks (:func:`page_split`)
PAGE_HINTS = ("block_size", "page_size")


def split_name(name: str) -> str:
    """The format name with each fused ``NBBS`` axis split into ``NB_BS`` (every plane of a
    multi-plane name)."""
    parts = []
    for plane in name.split("+"):
        role, eq, tpl = plane.rpartition("=")
        toks = ["NB_BS" if t == "NBBS" else t for t in tpl.split("_")]
        parts.append(f"{role}{eq}{'_'.join(toks)}")
    return "+".join(parts)


def _page_hint(hints: Mapping[str, Any]) -> tuple[str, int] | None:
    given = {k: hints[k] for k in PAGE_HINTS if k in hints and hints[k] is not None}
    if not given:
        return None
    bad = {k: v for k, v in given.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0}
    if bad:
        raise DetectionError(f"hint {', '.join(f'{k}={v!r}' for k, v in bad.items())}: the tokens per block must be a positive int")
    if len(set(given.values())) > 1:
        raise DetectionError(f"hints {given} disagree on the tokens per block; give one")
    k, v = next(iter(given.items()))
    return k, v


def _unflatten(node: Any, depth: int, axis: int, bs: int) -> Any:
    if depth == 0:
        pbs = int(node.shape[axis])
        if pbs % bs:
            raise DetectionError(
                f"the hint block_size/page_size={bs} does not divide the fused NBBS axis of {pbs} rows (tensor {tuple(node.shape)}): "
                "the pool is no whole number of blocks of that size"
            )
        return node.unflatten(axis, (pbs // bs, bs))
    items = [_unflatten(x, depth - 1, axis, bs) for x in node]
    return tuple(items) if isinstance(node, tuple) else items


def page_split(layout: KVLayout, det: Detection, hints: Mapping[str, Any], engine: str) -> KVLayout:
    """A fused ``NBBS`` layout split into blocks of the caller's ``block_size`` / ``page_size``
    hint: the same bytes and slot numbering (slot = row = ``block * BS + offset``), with
    ``num_blocks``, ``block_size`` and block transfers (``gather_blocks``). The split format is
    the name with ``NBBS`` -> ``NB_BS``: the one a plugin registers, else derived from the fused
    declaration (its engines and sources). Without the hint, or for a format that is not fused
    or has a plugin's own spec, the layout is returned as it is.

    Raises:
        DetectionError: the hint is not a positive int, two hints disagree, or the hint does
            not divide the fused axis.
    """

    fmt = layout.format
    page = _page_hint(hints)
    if page is None or not fmt.fused_nbbs or registry.spec_for(fmt) is not None:
        return layout
    key, bs = page
    name = split_name(fmt.name)
    syn = fmt.syntax
    if syn.multi_plane:
        kv = {
            p.role: _unflatten(det.kv_caches[p.role], len(p.syntax.list_levels), p.syntax.axes.index("NBBS"), bs)
            if "NBBS" in p.syntax.axes
            else det.kv_caches[p.role]
            for p in syn.planes
        }
    else:
        kv = _unflatten(det.kv_caches, len(syn.list_levels), syn.axes.index("NBBS"), bs)
    if name in registry.host().formats:
        split: Any = name
    else:
        split = KVFormat(
            name=name,
            engines=list(fmt.engines),
            attention_backends=list(fmt.attention_backends),
            description=f"{fmt.description} (page-split by the {key} hint)".strip(),
            sources=list(fmt.sources),
        )
    try:
        out = _build_layout(
            split,
            kv,
            dtype=det.dtype,
            params=det.params,
            note=f"{det.note}; fused NBBS axis split into blocks of {bs} ({key} hint)".lstrip("; "),
            engine=engine,
            layer_ids=det.layer_ids,
            aliases=det.aliases,
        )
    except GeometryError as e:
        raise DetectionError(f"{fmt.name} split into blocks of {bs} by the {key} hint does not build: {e}") from e
    out.plugin = getattr(layout, "plugin", None)
    return out


def _check_order_statement(container: Any, hints: Mapping[str, Any]) -> None:
    """``tensor_order="physical"`` says every tensor's axes are in memory order: a tensor
    whose strides are permuted contradicts it, whatever the engine (a DetectionError
    naming the tensor). A bad value of the hint is an error too."""
    if tensor_order(hints) != "physical":
        return
    for i, t in enumerate(tensors_in(container)):
        if not memory_ordered(t):
            raise DetectionError(
                f"the hint {TENSOR_ORDER}='physical' says the tensors' axes are in memory order, but tensor {i} "
                f"(shape {list(t.shape)}, stride {list(t.stride())}) is a permuted view: its memory order is axes "
                f"{physical_permutation(t)}. Drop the hint (the strides say how the engine allocated it), or permute the "
                "tensors into memory order first"
            )


def _build(det: Detection, engine: str, shown: Any, what: str) -> KVLayout:
    try:
        return _build_layout(
            det.format,
            det.kv_caches,
            dtype=det.dtype,
            params=det.params,
            note=det.note,
            engine=engine,
            layer_ids=det.layer_ids,
            aliases=det.aliases,
        )
    except GeometryError as e:
        listing = f"\ntensors:\n{describe_input(shown)}" if shown is not None else ""
        raise DetectionError(f"{what} but the tensors do not fit it: {e}{listing}") from e


def known_engines() -> list[str]:
    """The engines the installed plugins declare (a format listing it, or a demo of its name), sorted."""
    return sorted({e for f in registry.formats() for e in f.engines} | set(registry.demos()))


def _unknown_engine(engine: str) -> str:
    """A first line for the error when no installed plugin declares ``engine`` at all."""
    known = known_engines()
    if engine in known:
        return ""
    return f"no installed plugin declares engine {engine!r} (engines they declare: {', '.join(known) or 'none'}); "


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return ("L", tuple(_signature(y) for y in x))
    return ("?", type(x).__name__)


def detect_per_layer(
    kv_caches: Any,
    engine: str,
    layer_groups: Sequence[Sequence[int | str]] | None = None,
    hints: Any = None,
) -> list[KVLayout | None] | dict[Any, KVLayout | None]:
    """Detect a hybrid model's cache: one :class:`KVLayout` per entry, in the input's order.

    The result has the input's shape: **a dict in gives a dict out** with the same keys in
    the same order (``result[name]`` is the layout holding layer ``name``); a list or tuple
    in gives a list in input order (``zip(kv_caches, result)`` pairs each entry with its
    layout). Nothing is sorted or dropped: an entry that is not KV is ``None``.

    Layers are grouped by the engine's groups when given (``layer_groups``: lists of
    entry positions in the input's order -- for a dict, positions in its order or its
    keys), then by tensor shape, stride and dtype; each group is detected on its own, so
    mixed head sizes, rank-3 indexer caches beside rank-5 attention caches, and per-group
    block sizes each get their own format. Layers of one group share one layout:
    ``layout.layer_ids`` lists their input positions and, for a dict, ``layout.layer_names``
    their keys. Entries that are the same memory (KV-sharing layers that point several
    names at one tensor) stay one layer each; ``layout.aliases`` says which layer shares
    which one's memory. Entries a plugin recognises as not KV (Mamba state) are ``None``,
    with the reason logged.

    Raises:
        DetectionError / AmbiguousLayoutError: for a group nothing recognises (or
            recognises twice), a plugin that crashed, or ``layer_groups`` naming an entry
            that does not exist or putting one in two groups.
    """
    engine = _engine_name(engine)
    as_dict = isinstance(kv_caches, Mapping)
    keys = list(kv_caches.keys()) if as_dict else None
    container, names = normalize_container(kv_caches, sort_dicts=False)
    if not isinstance(container, (list, tuple)):  # one multi-plane cache (Planes), or an engine's cache object
        return [detect(container, engine, hints)]
    n = len(container)
    groups = _groups(layer_groups, n, keys)
    out: list[KVLayout | None] = [None] * n
    h = _hints_dict(hints)
    _check_order_statement(container, h)
    host = registry.host()
    for g in groups:
        by_sig: OrderedDict[Any, list[int]] = OrderedDict()
        for i in g:
            by_sig.setdefault(_signature(container[i]), []).append(i)
        for idxs in by_sig.values():
            sub = Layers(container[i] for i in idxs)
            det, layout, rejected = _ask(host, sub, engine, h)
            if det is None:
                asked = ", ".join(_detectors()) or "none"
                raise DetectionError(
                    f"{_unknown_engine(engine)}no kvcore plugin recognises layers {idxs} for engine {engine!r}.\n"
                    f"tensors:\n{describe_input(sub)}\nplugins asked: {asked}" + _advice(sub, rejected)
                )
            if det.format is None:
                log.info("layers %s excluded: %s", idxs, det.excluded or det.note)
                continue
            layout = page_split(layout, det, h, engine)
            _check_distinct_aliases(
                engine, det, sub, [f"kv_caches[{keys[i]!r}]" if as_dict else f"kv_caches[{i}]" for i in idxs], layer_groups is not None
            )
            ids = list(det.layer_ids) if det.layer_ids is not None else list(range(len(idxs)))
            if len(ids) != layout.num_layers or not all(0 <= j < len(idxs) for j in ids):
                raise DetectionError(
                    f"engine {engine!r}: layers {idxs} detected as {det.format} with {layout.num_layers} layers, but the plugin "
                    f"says they are entries {ids} of the {len(idxs)} it was given"
                )
            layout.layer_ids = tuple(idxs[j] for j in ids)
            record_callers(
                layout.spec.stride_table(),
                [(p, t) for i in idxs for p, t in tensor_paths(container[i], f"kv_caches[{keys[i]!r}]" if as_dict else f"kv_caches[{i}]")],
            )
            if names is not None:
                layout.layer_names = tuple(names[i] for i in layout.layer_ids)
            for i in layout.layer_ids:
                out[i] = layout
    if as_dict:
        return dict(zip(keys, out))
    return out


def _groups(layer_groups: Any, n: int, keys: list[Any] | None) -> list[list[int]]:
    if layer_groups is None:
        return [list(range(n))]
    pos = {k: i for i, k in enumerate(keys)} if keys is not None else {}
    try:
        groups = [list(g) for g in layer_groups]
    except TypeError:
        raise DetectionError(
            f"layer_groups must be a list of lists of layer positions (the engine's KV cache groups), got {layer_groups!r}"
        ) from None
    out: list[list[int]] = []
    bad: list[Any] = []
    for g in groups:
        row = []
        for i in g:
            if keys is not None and not isinstance(i, int) and i in pos:
                row.append(pos[i])
            elif isinstance(i, bool) or not isinstance(i, int) or not (0 <= i < n):
                bad.append(i)
            else:
                row.append(i)
        out.append(row)
    if bad:
        what = f"kv_caches has {n} entries (positions 0..{n - 1}" + (", or its keys)" if keys is not None else ")")
        raise DetectionError(f"layer_groups names layers {bad} but {what}")
    seen = [i for g in out for i in g]
    twice = sorted({i for i in seen if seen.count(i) > 1})
    if twice:
        raise DetectionError(f"layer_groups puts layers {twice} in more than one group; each layer belongs to one group")
    rest = [i for i in range(n) if i not in set(seen)]
    if rest:
        out.append(rest)
    return out


# -- helpers for plugins -------------------------------------------------------------


@dataclass
class Candidate:
    """One way to read the tensors: a format, the views that match it, and which hint
    value selects it (for the ambiguity message).

    Attributes:
        format: the format name.
        kv_caches: views of the caller's tensors nested as the format says.
        dtype: the element dtype when the tensors are a byte view of it.
        params: facts the name cannot carry (``head_size`` of a packed CS axis, ...).
        note: how this reading was reached (the layout's ``note``).
        decided_by: hint name -> the value that selects this reading.
        label: a short human name for messages.
        order: ``None`` (the reading holds whether the tensors are as allocated or in
            memory order), ``"allocated"`` (it reads the engine's logical axes through
            permuted strides) or ``"physical"`` (it reads the tensors as already permuted
            into memory order); see the module docstring.
        against: hint name -> the caller's value, for a reading the strides show but that
            hint rules out. Such a candidate is evidence, never an answer: when nothing
            else fits, :func:`resolve` raises a DetectionError naming the hint and this
            reading.
    """

    format: str
    kv_caches: Any  # multi-plane formats: {role: container}
    dtype: torch.dtype | dict[str, torch.dtype] | None = None  # multi-plane formats: one dtype or {role: dtype}
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    decided_by: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    order: str | None = None
    against: dict[str, Any] = field(default_factory=dict)

    def detection(self) -> Detection:
        return Detection(format=self.format, kv_caches=self.kv_caches, dtype=self.dtype, params=self.params, note=self.note)

    def name(self) -> str:
        return f"{self.format} [{self.label}]" if self.label else self.format


def _geometry(lay: KVLayout, attr: str) -> Any:
    try:
        return getattr(lay, attr)
    except GeometryError:
        return None


def _geometry_line(lay: KVLayout) -> str:
    parts = [f"NL={lay.num_layers}"]
    for short, attr in (("NB", "num_blocks"), ("BS", "block_size"), ("NH", "num_heads"), ("HS", "head_size")):
        v = _geometry(lay, attr)
        if v is not None:
            parts.append(f"{short}={v}")
    if lay.dtype != lay.storage_dtype:
        parts.append(f"dtype={str(lay.dtype).replace('torch.', '')}")
    return ", ".join(parts)


def _order_note(c: Candidate) -> str:
    if c.order == "physical" and "memory order" not in c.label and "physical order" not in c.label:
        return " (if the tensors were already permuted into memory order)"
    return ""


def resolve(
    candidates: Sequence[Candidate],
    *,
    engine: str,
    deciding_hints: Sequence[str] = (),
    hints: Mapping[str, Any] | None = None,
    geometry_hints: Mapping[str, str] | None = None,
    required: bool = False,
) -> Detection | None:
    """Pick the one meaning of the tensors among ``candidates``.

    Candidates that do not build (their geometry does not fit the tensors) drop out; the
    reason of each is kept and shown in the final error (``required=True`` here, else in
    :func:`detect`'s "nothing recognises" message). The ``tensor_order`` hint (see the
    module docstring) drops the readings of the other order. Those left are grouped by
    what they move (stride table, K/V count and element dtype): one group means one answer
    (the first candidate of it). Several groups mean the same tensors can be read two ways
    that move different bytes: :class:`AmbiguousLayoutError`, naming the candidates and
    the hints that would decide -- ``deciding_hints``, the ``decided_by`` keys whose values
    differ, the geometry hints (``geometry_hints``) whose values differ between the
    readings, and ``tensor_order`` when it would decide -- minus every hint the caller
    already gave.

    Args:
        candidates: the readings, in order of preference among byte-identical ones.
        engine: for messages.
        deciding_hints: hints the plugin knows decide between these candidates.
        hints: the caller's hints as the plugin understands them (names it accepts);
            default: the hints of the current :func:`detect` call.
        geometry_hints: layout attribute (``block_size``, ``num_heads``, ``head_size``,
            ``num_layers``, ``num_blocks``) -> the plugin's hint for it; default
            :data:`GEOMETRY_HINTS`.
        required: raise instead of returning None when no candidate fits.
    Returns:
        a Detection, or None when no candidate fits.
    Raises:
        AmbiguousLayoutError: see above.
        DetectionError: a hint contradicts the strides (a candidate with ``against`` is
            all the strides allow), ``tensor_order`` contradicts them, or (``required``)
            nothing fits.
    """
    call = _CALL.get()
    given = dict(hints) if hints is not None else (dict(call.hints) if call is not None else {})
    given = {k: v for k, v in given.items() if v is not None}
    order = tensor_order(given)
    geo = dict(GEOMETRY_HINTS if geometry_hints is None else geometry_hints)
    built: list[tuple[Candidate, KVLayout]] = []
    rejected: list[str] = []
    for c in candidates:
        try:
            lay = _build_layout(c.format, c.kv_caches, dtype=c.dtype, params=c.params)
        except GeometryError as e:
            log.debug("candidate %s rejected: %s", c.format, e)
            rejected.append(f"{c.name()}: {e}")
            continue
        built.append((c, lay))
    if call is not None:
        call.rejected.extend(rejected)
    live = [(c, lay) for c, lay in built if not c.against]
    evidence = [(c, lay) for c, lay in built if c.against]
    if order is not None:
        fits = [(c, lay) for c, lay in live if c.order in (None, order)]
        if live and not fits:
            raise _order_contradiction(engine, order, live)
        live = fits
        evidence = [(c, lay) for c, lay in evidence if c.order in (None, order)]
    if not live:
        if evidence:
            raise _hint_contradiction(engine, evidence, [])
        if required:
            why = "\n".join(f"  - {r}" for r in rejected) or "  - no candidate reading was offered"
            raise DetectionError(f"{engine}: these tensors fit none of the layouts tried:\n{why}")
        return None
    if order is None and all(c.order == "physical" for c, _ in live):
        shown = [(c, lay) for c, lay in evidence if c.order != "physical"]
        if shown:
            raise _hint_contradiction(engine, shown, live)
    groups: OrderedDict[tuple, list[tuple[Candidate, KVLayout]]] = OrderedDict()
    for c, lay in live:
        sig = (lay.kv_size, lay.dtype, lay.stride_table().signature())
        groups.setdefault(sig, []).append((c, lay))
    if len(groups) == 1:
        return live[0][0].detection()
    raise _ambiguity(engine, list(groups.values()), deciding_hints, given, geo, order)


def _alternatives(v: Any) -> frozenset[str] | None:
    """The hint values a ``decided_by`` entry (or a geometry value) accepts: a list, tuple or
    set lists alternatives, as does a string ``"a/b/c"``; None: any value (no constraint)."""
    if v is None:
        return None
    if isinstance(v, (list, tuple, set, frozenset)):
        return frozenset(str(x) for x in v)
    if isinstance(v, str) and "/" in v:
        return frozenset(x.strip() for x in v.split("/") if x.strip())
    return frozenset([str(v)])


def _separates(k: str, a: Mapping[str, frozenset[str] | None], b: Mapping[str, frozenset[str] | None]) -> bool:
    """Hint ``k`` tells two readings apart: each constrains it and no value selects both
    (a reading that accepts any value of ``k`` stays whatever value is given)."""
    va, vb = a.get(k), b.get(k)
    return va is not None and vb is not None and not (va & vb)


def _deciding_sets(keys: Sequence[str], values: Sequence[Mapping[str, frozenset[str] | None]], opaque: Sequence[str]):
    """``(singles, together)``. A set of hints decides when, whatever true values the caller
    gives for them, at most one reading is left: every pair of readings is told apart by
    one of the hints (:func:`_separates`). ``singles``: the hints that decide alone
    (``opaque`` ones -- a plugin's ``deciding_hints`` with no per-reading value -- are taken
    at the plugin's word between two readings); when none does, ``together``: the smallest
    set that decides (None when even all of them do not tell every reading apart)."""
    import itertools

    n = len(values)
    pairs = list(itertools.combinations(range(n), 2))
    known = [k for k in keys if k not in opaque]

    def decides(combo: Sequence[str]) -> bool:
        return all(any(_separates(k, values[i], values[j]) for k in combo) for i, j in pairs)

    singles = [k for k in keys if (k in opaque and n == 2) or (k in known and decides([k]))]
    if singles:
        return singles, None
    useful = [k for k in known if any(_separates(k, values[i], values[j]) for i, j in pairs)]
    tried = 0
    for size in range(2, len(useful) + 1):
        for combo in itertools.combinations(useful, size):
            tried += 1
            if tried > 4096:  # a plugin naming dozens of hints: say all of them, if they decide
                return [], (list(useful) if decides(useful) else None)
            if decides(combo):
                return [], list(combo)
    return [], None


def _ambiguity(
    engine: str,
    groups: list[list[tuple[Candidate, KVLayout]]],
    deciding_hints: Sequence[str],
    given: Mapping[str, Any],
    geo: Mapping[str, str],
    order: str | None,
) -> AmbiguousLayoutError:
    """The error for readings that place bytes differently. It names every candidate with the
    hint values that select it, and says truthfully what decides: the hints that decide
    alone ("Pass one of these hints to decide"), else the smallest set that decides only
    together ("pass these hints together"), else that the hints narrow it but do not tell
    every reading apart. It never names a hint the caller gave. ``error.hints`` lists every
    hint that bears on the choice; ``error.decide`` the sets that decide (one per entry)."""
    firsts = [g[0] for g in groups]
    keys: list[str] = list(deciding_hints)
    all_keys = list(dict.fromkeys(k for c, _ in firsts for k in c.decided_by))
    for k in all_keys:
        if len({repr(c.decided_by.get(k)) for c, _ in firsts}) > 1:
            keys.append(k)
    geo_keys: dict[str, str] = {}
    for attr, hint in geo.items():
        if len({_geometry(lay, attr) for _, lay in firsts}) > 1:
            keys.append(hint)
            geo_keys[hint] = attr
    by_order: dict[int, str] = {}  # group -> the tensor_order value that leaves it alone
    only: dict[int, str] = {}  # group -> the one tensor order all its readings need
    if order is None:
        for i, g in enumerate(groups):
            orders = {c.order for c, _ in g}
            if None not in orders and len(orders) == 1:
                only[i] = orders.pop()
        alloc = [i for i in range(len(groups)) if only.get(i) != "physical"]
        phys = [i for i in range(len(groups)) if only.get(i) != "allocated"]
        if len(alloc) == 1 and alloc != phys:
            by_order[alloc[0]] = "allocated"
        if len(phys) == 1 and alloc != phys:
            by_order[phys[0]] = "physical"
        n = len(groups)
        phys_only = sum(1 for v in only.values() if v == "physical")
        alloc_only = sum(1 for v in only.values() if v == "allocated")
        if 0 < phys_only < n or 0 < alloc_only < n:  # a value of tensor_order rules out some readings, not all
            keys.append(TENSOR_ORDER)
    keys = [k for k in dict.fromkeys(keys) if k not in given]
    # per candidate, the values of each hint that select it (None: any value keeps it)
    values: list[dict[str, frozenset[str] | None]] = []
    for i, (c, lay) in enumerate(firsts):
        row: dict[str, frozenset[str] | None] = {}
        for k in keys:
            if k in c.decided_by:
                row[k] = _alternatives(c.decided_by[k])
            elif k in geo_keys:
                row[k] = _alternatives(_geometry(lay, geo_keys[k]))
            elif k == TENSOR_ORDER:
                row[k] = frozenset([only[i]]) if i in only else None
            else:
                row[k] = None
        values.append(row)
    opaque = [k for k in deciding_hints if k in keys and all(v.get(k) is None for v in values)]
    singles, together = _deciding_sets(keys, values, opaque)
    lines = []
    for i, (c, lay) in enumerate(firsts):
        sel = {k: v for k, v in c.decided_by.items() if k not in given}
        if TENSOR_ORDER in keys and (i in by_order or i in only):
            sel[TENSOR_ORDER] = by_order.get(i, only.get(i))
        for k in geo_keys:  # the geometry hints that differ between the readings, by the plugin's names
            if k in keys and values[i].get(k) is not None:
                sel.setdefault(k, _geometry(lay, geo_keys[k]))
        dec = ", ".join(f"{k}={v!r}" for k, v in sel.items())
        lines.append(f"  {c.name()}: {lay.describe()} ({_geometry_line(lay)}){_order_note(c)}" + (f"; selected by {dec}" if dec else ""))
    said = f" (hints given: {', '.join(f'{k}={v!r}' for k, v in given.items())})" if given else ""
    also = [k for k in opaque if k not in singles]
    if singles:
        advice = f"Pass one of these hints to decide: {', '.join(singles)}"
        decide = [[k] for k in singles]
    elif together:
        advice = (
            f"No one hint decides between these {len(firsts)} layouts; pass these hints together: {', '.join(together)} "
            "(the values that select each layout are listed with it)"
        )
        decide = [together]
    elif keys:
        advice = (
            f"These hints narrow it down but do not tell all {len(firsts)} layouts apart, even together: {', '.join(keys)}; "
            "see the plugin's docs for what else decides"
        )
        decide = []
    else:
        advice = "Pass one of these hints to decide: (none of the hints this plugin knows decides; see its docs)"
        decide = []
    if also:
        advice += f"; the plugin also names {', '.join(also)} as deciding (its docs give the values)"
    needs_physical = [firsts[i][0].name() for i, o in only.items() if o == "physical"]
    if needs_physical and TENSOR_ORDER not in given and not any(TENSOR_ORDER in d for d in decide):
        # a hint that rules out the allocated-order reading leaves it only when the caller says so
        advice += (
            f". {' and '.join(needs_physical)} {'reads' if len(needs_physical) == 1 else 'read'} the tensors as already permuted "
            f"into memory order: for {'it' if len(needs_physical) == 1 else 'them'} pass {TENSOR_ORDER}='physical' too"
        )
    err = AmbiguousLayoutError(
        f"{engine}: these tensors fit {len(firsts)} layouts that place bytes differently, and no hint given decides{said}:\n"
        + "\n".join(lines)
        + f"\n{advice}",
        candidates=[c.format for c, _ in firsts],
        hints=keys,
    )
    err.decide = decide
    return err


def _describe_candidates(items: Sequence[tuple[Candidate, KVLayout]]) -> str:
    return "; ".join(f"{c.name()} {lay.describe()} ({_geometry_line(lay)})" for c, lay in items)


def _hint_contradiction(
    engine: str, evidence: Sequence[tuple[Candidate, KVLayout]], physical: Sequence[tuple[Candidate, KVLayout]]
) -> DetectionError:
    said = dict(p for c, _ in evidence for p in c.against.items())
    hint = ", ".join(f"{k}={v!r}" for k, v in said.items())
    msg = f"{engine}: the hints say {hint}, but the tensors' strides show {_describe_candidates(evidence)}, which {hint} rules out."
    if physical:
        msg += (
            f" Read as already permuted into memory order they would fit the hints as {_describe_candidates(physical)}:"
            f" if that is what you passed, add the hint {TENSOR_ORDER}='physical'."
        )
    msg += " Otherwise fix the hint, or pass the tensors as the engine allocated them."
    tensors = [t for c, _ in evidence[:1] for t in tensors_in(c.kv_caches)]
    if tensors:
        msg += f"\ntensors:\n{describe_input(tensors)}"
    return DetectionError(msg)


def _order_contradiction(engine: str, order: str, live: Sequence[tuple[Candidate, KVLayout]]) -> DetectionError:
    other = "physical" if order == "allocated" else "allocated"
    if order == "physical":
        what = "the tensors' axes are already in memory order, but their strides are permuted"
    else:
        what = "the tensors are as the engine allocated them, but no reading of the engine's allocation fits"
    return DetectionError(
        f"{engine}: the hint {TENSOR_ORDER}={order!r} says {what}; they read only as {TENSOR_ORDER}={other!r}: "
        f"{_describe_candidates(live)}. Drop or fix the hint."
    )


def memory_ordered(t: torch.Tensor) -> bool:
    """True when ``t``'s axes are in memory order: the strides of the axes longer than 1
    do not increase from the outermost axis in. Such a tensor may have been handed over
    as allocated or already permuted into memory order; a tensor that is not memory
    ordered was certainly not permuted into memory order."""
    prev = None
    for n, s in zip(t.shape, t.stride()):
        if n <= 1:
            continue
        if prev is not None and s > prev:
            return False
        prev = s
    return True


def _same_objects(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the very same tensor objects (lists compared leaf by leaf)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_objects(x, y) for x, y in zip(a, b))
    return a is b


def _check_distinct_aliases(engine: str, det: Detection, entries: Any, labels: Sequence[str] | None, groups_given: bool) -> None:
    """Entries a plugin reports as one memory (``det.aliases``) must be the same tensor
    objects, unless the caller gave ``layer_groups``. KV-sharing layers point several names
    at one tensor (vLLM: ``kv_caches[name] = kv_caches[target]``); distinct tensors over the
    same bytes are also what vLLM 0.33's hybrid KV-cache groups are (full attention and
    sliding window aliasing one buffer, each read through its own block table: one slot
    mapping does not serve both). The two readings move different bytes: never guess.

    Raises:
        AmbiguousLayoutError: naming the entries and the hint ``layer_groups``."""
    if groups_given or not det.aliases or not isinstance(entries, (list, tuple)):
        return
    for i, j in det.aliases.items():
        if not (0 <= i < len(entries) and 0 <= j < len(entries)) or _same_objects(entries[i], entries[j]):
            continue

        def who(k: int) -> str:
            return labels[k] if labels is not None and k < len(labels) else f"entry {k}"

        raise AmbiguousLayoutError(
            f"{engine}: {who(i)} and {who(j)} are distinct tensors over the same memory. That is either KV sharing (one "
            "cache under two layer names: pass the same tensor object for both) or two KV-cache groups aliasing one buffer "
            "(vLLM's hybrid groups: full attention and sliding window, each read through its own block table), and the "
            "two place bytes differently for a slot. Pass layer_groups to kvcore.detect_per_layer (the engine's KV cache "
            "groups: layers of one group share memory as KV sharing), or the shared layer's own tensor object",
            candidates=["KV sharing (one layout, aliased layers)", "separate KV-cache groups (one layout per group)"],
            hints=["layer_groups"],
            decide=[["layer_groups"]],
        )


def split_aliases(entries: Sequence[Any]) -> tuple[list[Any], dict[int, int]]:
    """Entries that are the very same memory as an earlier one (the same tensor, or the
    same view: storage, offset, shape, stride, dtype; nested lists compared leaf by leaf),
    as KV-sharing layers register one cache under several names.

    Returns:
        (the distinct entries in order, ``{entry index: index of the earlier entry it
        repeats}``) -- what a plugin returns as ``Detection(kv_caches=distinct, aliases=...)``
        so that the layout keeps one layer per entry.
    """

    def key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_meta:  # meta tensors have no addresses: only the same object is the same memory
                return ("object", id(x))
            return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
        if isinstance(x, (list, tuple)):
            return ("L", tuple(key(y) for y in x))
        return ("object", id(x))

    seen: dict[Any, int] = {}
    distinct: list[Any] = []
    aliases: dict[int, int] = {}
    for i, e in enumerate(entries):
        k = key(e)
        if k in seen:
            aliases[i] = seen[k]
            continue
        seen[k] = i
        distinct.append(e)
    return distinct, aliases


def physical_permutation(t: torch.Tensor) -> list[int]:
    """The axis order that makes ``t``'s memory order outermost-first: axes sorted by
    decreasing stride; ties (size-1 axes) keep their given order."""
    return sorted(range(t.dim()), key=lambda i: (-t.stride(i) if t.shape[i] > 1 else _size1_rank(t, i), i))


def _size1_rank(t: torch.Tensor, i: int) -> int:
    # a size-1 axis sits where its neighbour to the right is: it changes no address
    for j in range(i + 1, t.dim()):
        if t.shape[j] > 1:
            return -t.stride(j)
    return 0
