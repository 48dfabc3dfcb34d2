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

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcore import registry
from kvcore.containers import _LAYER_RE, _ROLE_RE, Layers, Planes, _is_planes, _layer_key, describe_input, normalize_container, tensors_in  # noqa: F401
from kvcore.detect_context import _CALL, _ORDER_ALIASES, GEOMETRY_HINTS, TENSOR_ORDER, TENSOR_ORDERS, _Call, _hints_dict, tensor_order  # noqa: F401
from kvcore.errors import AmbiguousLayoutError, DetectionError, GeometryError
from kvcore.format_decl import KVFormat
from kvcore.grammar import parse
from kvcore.inputs import check_container, tensor_paths  # noqa: F401 (check_container: re-exported)
from kvcore.layout import Detection, KVLayout, _build_layout
from kvcore.memory_order import _size1_rank, memory_ordered, physical_permutation  # noqa: F401
from kvcore.resolution import (  # noqa: F401 - resolution's names stay importable from here
    Candidate,
    _alternatives,
    _ambiguity,
    _deciding_sets,
    _describe_candidates,
    _geometry,
    _geometry_line,
    _hint_contradiction,
    _order_contradiction,
    _order_note,
    _separates,
    resolve,
)
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
