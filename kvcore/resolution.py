"""Deciding between a plugin's candidate readings (:func:`resolve`): each
:class:`Candidate` is built into a layout; readings whose stride tables are identical
move the same bytes and are one answer; readings that address memory differently are a
real ambiguity, and :class:`~kvcore.AmbiguousLayoutError` names them and the hints that
would decide (never a hint the caller already gave). See :mod:`kvcore.detection` for
the tensor-order rules."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.containers import describe_input, tensors_in
from kvcore.detect_context import _CALL, GEOMETRY_HINTS, TENSOR_ORDER, tensor_order
from kvcore.detection_decl import Detection
from kvcore.errors import AmbiguousLayoutError, DetectionError, GeometryError
from kvcore.layout import KVLayout, _build_layout

__all__ = ["Candidate", "resolve"]

log = logging.getLogger("kvcore.detection")  # one logger for detection, whichever module of it speaks


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
