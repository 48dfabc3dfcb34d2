"""Container checks, per fixture (on the CPU): every container shape kvcore hands a detector.

A detector sees the caller's container, normalised by kvcore: a dict of layer names becomes
a :class:`kvcore.Layers` list in layer order, and :func:`kvcore.detect_per_layer` hands it
each group of per-layer entries as a :class:`kvcore.Layers`. A fixture's ``make`` gives one
container shape; these checks hand the same cache over in the others, built from its
per-layer entries (a list of layers' tensors: the items; a K list and a V list: per-layer
``(K, V)`` pairs), at the fixture's sizes and with two layers (where ``[(K0, V0), (K1, V1)]``
looks exactly like ``[[K0, K1], [V0, V1]]``):

* ``containers[dict]``: ``kvcore.detect({"model.layers.i.self_attn.attn": entry_i})`` (inserted in
  reverse layer order);
* ``containers[layer list]``: ``kvcore.detect([entry_0, entry_1, ...])`` -- per-layer pairs where
  the fixture hands a K list and a V list;
* ``containers[per_layer]``: ``kvcore.detect_per_layer([entry_0, ...])``;
* ``containers[per_layer dict]``: ``kvcore.detect_per_layer({name: entry})``;
* ``containers[per_layer groups]``: ``kvcore.detect_per_layer(entries, layer_groups=[[0], [1, ...]])``;
* ``containers[planes]``: a multi-plane cache handed as a plain dict of roles and as a
  ``kvcore.Planes``.

Each answer must gather, for every layer it reports (its ``layer_ids`` are the entries'
positions), exactly the values the engine's view of that layer holds; a refusal
(``DetectionError``) is allowed and noted, an ``AmbiguousLayoutError`` must name two
candidates and a hint the caller did not give. A detector that takes layer 0's V for layer
1's K when handed two per-layer pairs fails here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvcore.detection import Planes, detect, detect_per_layer, normalize_container
from kvcore.errors import AmbiguousLayoutError, DetectionError, GeometryError, KVCoreError
from kvcore.layout import KVLayout
from kvcore.testing.checks.common import _compare, _detect, _filled, _make, _seed, _sentinel_like, _sizes_str, _slots, _staged, _widest
from kvcore.testing.checks.detection import _ambiguity_ok
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure, CheckSkip
from kvcore.transfer import gather

#: the container shapes, in report order
SHAPES = ("dict", "layer list", "per_layer", "per_layer dict", "per_layer groups", "planes")


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def per_layer_entries(kv: Any, layout: KVLayout) -> tuple[list[Any] | None, str]:
    """The cache's per-layer entries (layer ``i``'s part of the container, as the caller would
    hand it to ``detect_per_layer``), and how they were taken; None with the reason when the
    container has none (one cross-layer tensor, an engine object, planes)."""
    c, _ = normalize_container(kv)
    nl = layout.num_layers
    if isinstance(c, Planes):
        return None, "a multi-plane cache (planes by role): no per-layer entries"
    if not isinstance(c, (list, tuple)):
        what = "one cross-layer tensor" if isinstance(c, torch.Tensor) else f"an engine object ({type(c).__name__})"
        return None, f"the fixture hands over {what}: no per-layer entries"
    if layout.layer_ids is not None and list(layout.layer_ids) != list(range(nl)):
        return None, f"detection leaves entries out (layer_ids {list(layout.layer_ids)}): the entries are not the layers"
    if layout.aliases:
        return None, "layers share memory (aliases): the entries are not distinct layers"
    levels = tuple(getattr(layout.format.syntax, "list_levels", ()))
    if len(c) == nl and levels[:1] == ("NL",):
        return list(c), "the container's items"
    if levels[:2] == ("TWO", "NL") and len(c) == 2 and all(isinstance(x, (list, tuple)) and len(x) == nl for x in c):
        return [(c[0][i], c[1][i]) for i in range(nl)], "per-layer (K, V) pairs of the K list and the V list"
    if levels[:2] == ("TWO", "NL") and len(c) == 2 * nl and all(isinstance(x, torch.Tensor) for x in c):
        return [(c[i], c[nl + i]) for i in range(nl)], "per-layer (K, V) pairs of the flat K + V list"
    if len(c) == nl:
        return list(c), "the container's items"
    return None, f"a container of {len(c)} items for {nl} layers ({layout.format.name}): no per-layer split known"


def _answer_right(case: FixtureCase, kv: Any, ref: KVLayout, hints: dict, answer: KVLayout, engine_layers: list[int], what: str) -> None:
    """``answer`` must gather, for its layer ``j``, the engine's layer ``engine_layers[j]``."""
    geo = (answer.page_buffer_size, answer.num_heads, answer.head_size, answer.kv_size)
    want = (ref.page_buffer_size, ref.num_heads, ref.head_size, ref.kv_size)
    if geo != want:
        raise CheckFailure(
            f"{what} answered {answer.format.name} {answer.describe()} (slots, heads, head size, kv = {geo}), but the engine's "
            f"cache is {ref.format.name} {ref.describe()} ({want}): a misreading of the container"
        )
    pl, enc = _filled(case, kv, ref, hints)
    slots = _slots(answer, _seed(case.name, what), count=16, negatives=1)
    out = _sentinel_like(answer, len(slots))
    before = _staged(out)
    gather(answer, slots, out)
    rows = enc.rows(engine_layers, slots)
    expected = torch.where((slots >= 0).view(1, 1, -1, 1), rows, before)
    _compare(
        f"{what} answered {answer.format.name} {answer.describe()}, and its gather is wrong",
        _staged(out),
        expected,
        engine_layers,
        slots,
        answer,
        enc,
    )


def _outcome(call: Callable[[], Any], hints: dict, what: str) -> tuple[Any, str | None]:
    """``(answer, None)``, or ``(None, note)`` for an allowed refusal or ambiguity."""
    try:
        return call(), None
    except AmbiguousLayoutError as e:
        return None, f"{what}: {_ambiguity_ok(e, hints)}"
    except DetectionError as e:
        return None, f"{what}: refused ({str(e).splitlines()[0][:100]})"
    except KVCoreError as e:
        raise CheckFailure(f"{what}: raised {type(e).__name__}: {e}") from None


def _sizes_to_try(case: FixtureCase) -> list[dict]:
    out = [dict(case.sizes)]
    if case.sizes.get("num_layers") != 2:
        out.append({**case.sizes, "num_layers": 2})
    return out


def _run_shape(case: FixtureCase, shape: str, sizes: dict) -> str:
    dtype = _widest(case.dtypes)
    cpu = torch.device("cpu")
    if sizes is not case.sizes:
        try:
            kv, hints = case.make(dict(sizes), dtype, cpu)
        except GeometryError as e:
            return f"{_sizes_str(sizes)}: the engine does not allocate it ({e})"
    else:
        kv, hints = _make(case, sizes, dtype, cpu)
    ref = _detect(case, kv, hints)
    at = f"NL={ref.num_layers}"
    if shape == "planes":
        c, _ = normalize_container(kv)
        if not isinstance(c, Planes):
            raise CheckSkip("the fixture's cache is not a dict of plane roles")
        notes = []
        for label, given in (("a plain dict of roles", dict(c)), ("kvcore.Planes", Planes(c))):
            ans, note = _outcome(lambda given=given: detect(given, case.engine, hints), hints, f"{at}, {label}")
            if note:
                notes.append(note)
            elif ans.format.name != case.format:
                raise CheckFailure(f"{at}: the planes as {label} detected as {ans.format.name}, not {case.format}")
            else:
                notes.append(f"{at}, {label}: {ans.format.name}")
        return "; ".join(notes)
    entries, how = per_layer_entries(kv, ref)
    if entries is None:
        raise CheckSkip(how)
    nl = len(entries)
    layers = list(range(nl))
    if shape == "dict":
        given = {layer_name(i): entries[i] for i in reversed(layers)}
        ans, note = _outcome(lambda: detect(given, case.engine, hints), hints, f"{at}, a dict of {how}")
        if ans is not None:
            _answer_right(case, kv, ref, hints, ans, layers, f"{at}, detect(a dict of {how})")
            return f"{at}: {ans.format.name} {ans.describe()}"
        return note
    if shape == "layer list":
        if isinstance(kv, (list, tuple)) and len(kv) == nl and all(a is b for a, b in zip(kv, entries)):
            raise CheckSkip("the fixture already hands over its per-layer entries as a list (the detect check)")
        ans, note = _outcome(lambda: detect(list(entries), case.engine, hints), hints, f"{at}, a list of {how}")
        if ans is not None:
            _answer_right(case, kv, ref, hints, ans, layers, f"{at}, detect(a list of {how})")
            return f"{at}: {ans.format.name} {ans.describe()}"
        return note
    if shape == "per_layer groups" and nl < 2:
        raise CheckSkip("one layer: no groups to split")
    if shape == "per_layer":
        given, groups = list(entries), None
    elif shape == "per_layer dict":
        given, groups = {layer_name(i): entries[i] for i in layers}, None
    else:
        given, groups = list(entries), [[0], list(range(1, nl))]
    ans, note = _outcome(
        lambda: detect_per_layer(given, case.engine, layer_groups=groups, hints=hints), hints, f"{at}, detect_per_layer of {how}"
    )
    if ans is None:
        return note
    found = list(ans.values()) if isinstance(ans, Mapping) else list(ans)
    if len(found) != nl or any(x is None for x in found):
        raise CheckFailure(
            f"{at}: detect_per_layer of {how} returned {len(found)} entries ({sum(x is None for x in found)} None) for {nl} KV layers"
        )
    seen: dict[int, KVLayout] = {id(x): x for x in found}
    for lay in seen.values():
        ids = list(lay.layer_ids) if lay.layer_ids is not None else layers
        _answer_right(
            case,
            kv,
            ref,
            hints,
            lay,
            ids,
            f"{at}, detect_per_layer of {how}{'' if groups is None else f' in groups {groups}'} (layers {ids})",
        )
    return f"{at}: {len(seen)} layout(s), {', '.join(sorted({x.format.name for x in seen.values()}))}"


def check_containers(case: FixtureCase, shape: str) -> str:
    notes = []
    skips = []
    for sizes in _sizes_to_try(case):
        try:
            notes.append(_run_shape(case, shape, sizes))
        except CheckSkip as e:
            skips.append(str(e))
    if not notes:
        raise CheckSkip(skips[0])
    return "; ".join(notes)


__all__ = ["SHAPES", "check_containers", "per_layer_entries", "layer_name"]
