"""Detection checks, per fixture (on the CPU).

* ``detect``: detection of the engine's allocation returns the fixture's format.
* ``physical_order``: the detected tensors' axes, in the name's order, are their memory
  order (a name is the physical order: a logical NHD name over HND memory fails).
* ``render``: the concrete rendering is the normalised tensors' real shape.
* ``geometry``: every accessor equals the declared sizes.
* ``ambiguity[PROBE]``: look-alike geometries (:data:`PROBES`) answer or raise
  AmbiguousLayoutError naming every candidate and the hints that decide -- never a hint the
  fixture's hints already give. An answer's gather is checked too, under the semantic family's
  check (:mod:`kvcore.testing.checks.semantic`, with the probe in brackets): it moves the bytes
  the engine's view says (a wrong value is reported with where it belongs and where it came from).
* ``ambiguity[memory order]``: the allocation handed over already permuted into memory order
  (as some connectors do), detected with the fixture's hints and once more with
  ``tensor_order="physical"``: each answer is right, or a refusal (DetectionError), or an
  AmbiguousLayoutError as above -- never a layout with the geometry swapped.

And per plugin with a ``kvcore_detect`` hook:

* ``engine_scoped``: the hook returns None for an engine that is not its own, on every
  fixture's cache (a detector that ignores ``engine`` would answer for every engine).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvcore import registry
from kvcore.detection import TENSOR_ORDER, detect, normalize_container, physical_permutation, tensors_in
from kvcore.errors import AmbiguousLayoutError, DetectionError, GeometryError, KVCoreError
from kvcore.grammar import render_concrete
from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _compare,
    _detect,
    _esize,
    _expect_gather,
    _filled,
    _make,
    _seed,
    _sentinel_like,
    _sizes_str,
    _slots,
    _staged,
    _widest,
)
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure, CheckSkip
from kvcore.transfer import gather


def check_detect(case: FixtureCase, device: torch.device) -> str:
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, device)
    layout = _detect(case, kv, hints)
    return layout.describe()


def check_render(case: FixtureCase) -> str:
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, torch.device("cpu"))
    layout = _detect(case, kv, hints)
    syn = layout.format.syntax
    node = layout.kv_caches
    real = []
    for _ in syn.list_levels:
        real.append(str(len(node)))
        node = node[0]
    shown = layout.describe()
    dims = [str(int(s)) for s in node.shape]
    if syn.blocked_scale:
        # a block's value and scale records render as BSxVALS, BSxSCALES: compare the axes before them
        k = syn.axes.index("BSV")
        head = shown.rsplit("[", 1)[1].rstrip("]").split(", ")[:k]
        if shown.rsplit("[", 1)[0] != " x ".join(real + [""]) or head != dims[:k]:
            raise CheckFailure(
                f"describe() renders {shown!r} but the normalised tensors are {' x '.join(real + ['[' + ', '.join(dims) + ']'])!r}"
            )
        return shown
    want = " x ".join(real + ["[" + ", ".join(dims) + "]"])
    if shown != want:
        raise CheckFailure(f"describe() renders {shown!r} but the normalised tensors are {want!r}")
    concrete = render_concrete(syn, layout.sizes())
    if concrete != shown:
        raise CheckFailure(f"render_concrete gives {concrete!r}, describe() {shown!r}")
    return shown


def check_geometry(case: FixtureCase) -> str | None:
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, torch.device("cpu"))
    layout = _detect(case, kv, hints)
    s = case.sizes
    got: dict[str, Any] = {}
    bad = []
    for key in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size", "page_buffer_size"):
        if key not in s:
            continue
        try:
            got[key] = getattr(layout, key)
        except GeometryError:
            if layout.format.fused_nbbs and key in ("num_blocks", "block_size"):
                continue  # a fused NBBS axis has no blocks; page_buffer_size answers
            raise
        if got[key] != s[key]:
            bad.append(f"{key}: declared {s[key]}, layout says {got[key]}")
    derived = {
        "kv_size": (layout.kv_size, layout.format.kv_size),
        "hidden_dim": (layout.hidden_dim, layout.num_heads * layout.head_size),
        "dtype": (layout.dtype, dtype),
        "device": (layout.device.type, "cpu"),
        "tokens_per_layer": (layout.tokens_per_layer, layout.page_buffer_size),
        "elements_per_layer": (layout.elements_per_layer, layout.kv_size * layout.page_buffer_size * layout.hidden_dim),
    }
    if not layout.format.fused_nbbs:
        derived["page_buffer_size"] = (layout.page_buffer_size, layout.num_blocks * layout.block_size)
    bad += [f"{k}: {a} != {b}" for k, (a, b) in derived.items() if a != b]
    notes = []
    try:
        d = layout.shape_desc()
    except GeometryError as e:
        d = None
        notes.append(f"no PageBufferShapeDesc ({str(e).split(';')[0]})")
    want_d = {
        "kv_size": layout.kv_size,
        "nl": layout.num_layers,
        "nh": layout.num_heads,
        "hs": layout.head_size,
        "element_size": _esize(dtype),
    }
    if d is not None:
        bad += [f"shape_desc().{k}: {getattr(d, k)} != {v}" for k, v in want_d.items() if getattr(d, k) != v]
    if d is not None and d.nb * d.bs != layout.page_buffer_size:
        bad.append(f"shape_desc() nb*bs = {d.nb * d.bs} != page_buffer_size {layout.page_buffer_size}")
    ptrs = layout.data_ptrs()
    if not ptrs or not all(isinstance(p, int) and p > 0 for p in ptrs):
        bad.append(f"data_ptrs() = {ptrs!r}")
    try:
        json.dumps(layout.summary())
    except TypeError as e:
        bad.append(f"summary() is not JSON-able: {e}")
    if bad:
        raise CheckFailure(f"{layout.format.name} {layout.describe()}: " + "; ".join(bad))
    return "; ".join(notes) or None


PROBES: dict[str, Callable[[dict], dict | None]] = {
    "NH=1": lambda s: {**s, "num_heads": 1},
    "NH=2": lambda s: {**s, "num_heads": 2},
    "BS=NH": lambda s: {**s, "num_heads": s["block_size"]},
    "NB=2": lambda s: {**s, "num_blocks": 2},
    "NL=2": lambda s: {**s, "num_layers": 2},
}


def check_ambiguity(case: FixtureCase, probe: str, device: torch.device, gather_too: bool = False) -> str | None:
    """``ambiguity[PROBE]`` (detection answers or names the deciding hints) and, with
    ``gather_too``, ``semantic_gather[PROBE]`` (an answer's gather moves the engine's bytes; a
    probe detection declines is skipped there, its record is the ambiguity check's)."""
    fmt = registry.get_format(case.format)
    if probe.startswith("NH") or probe == "BS=NH":
        if not fmt.syntax.has("NH"):
            raise CheckSkip(f"{case.format} has no head axis (NH is 1 by construction)")
    sizes = PROBES[probe](dict(case.sizes))
    if probe == "BS=NH" and sizes["num_heads"] > 64:
        raise CheckSkip(f"block_size {case.sizes['block_size']} is too many heads for a quick probe")
    dtype = _widest(case.dtypes)
    try:
        kv, hints = case.make(dict(sizes), dtype, device)
    except GeometryError as e:
        raise CheckSkip(f"the engine does not allocate {_sizes_str(sizes)}: {e}") from None
    try:
        layout = detect(kv, case.engine, hints)
    except AmbiguousLayoutError as e:
        if gather_too:
            raise CheckSkip(f"probe {_sizes_str(sizes)} is ambiguous: no answer to gather (see ambiguity[{probe}])") from None
        return _ambiguity_ok(e, hints)
    except KVCoreError as e:
        if gather_too:
            raise CheckSkip(f"probe {_sizes_str(sizes)}: detect declined (see ambiguity[{probe}])") from None
        raise CheckFailure(f"probe {_sizes_str(sizes)}: detect raised {type(e).__name__}: {e}") from None
    same = "" if layout.format.name == case.format else f" as {layout.format.name} (same bytes)"
    if not gather_too:
        return f"answered {layout.describe()}{same}"
    _answers_right(case, kv, layout, hints, f"probe {_sizes_str(sizes)}", _seed(case.name, probe))
    return f"gathered right at {layout.describe()}{same}"


def _ambiguity_ok(e: AmbiguousLayoutError, given: dict) -> str:
    """An AmbiguousLayoutError must name every fitting format (two at least) and the hints
    that would decide, none of which the caller gave (a given hint did not decide)."""
    if len(e.candidates) < 2:
        raise CheckFailure(f"AmbiguousLayoutError names {len(e.candidates)} candidate(s); it must name every fitting format: {e}")
    if not e.hints:
        raise CheckFailure(f"AmbiguousLayoutError names no hint that decides; it must say which hint the caller can pass: {e}")
    named = sorted(set(e.hints) & set(given))
    if named:
        raise CheckFailure(
            f"AmbiguousLayoutError names hint(s) {named} as deciding, but the caller gave them ({', '.join(f'{k}={given[k]!r}' for k in named)}); "
            f"name only hints that would decide: {e}"
        )
    return f"ambiguous as it should be unless hinted: {', '.join(e.candidates)} (hints {', '.join(e.hints)})"


def _answers_right(case: FixtureCase, kv: Any, layout: Any, hints: dict, what: str, seed: int) -> None:
    """Any answer must move the bytes the engine's view of ``kv`` says."""
    try:
        pl, enc = _filled(case, kv, layout, hints)
    except CheckFailure as e:  # the answer's geometry is not the engine's: a wrong answer, said as such
        raise CheckFailure(f"{what} detected as {layout.format.name} {layout.describe()}, which is not the engine's cache: {e}") from None
    slots = _slots(layout, seed, count=16, negatives=1)
    out = _sentinel_like(layout, len(slots))
    before = _staged(out)
    gather(layout, slots, out)
    layers = list(range(layout.num_layers))
    _compare(
        f"{what} detected as {layout.format.name} {layout.describe()}, and its gather is wrong",
        _staged(out),
        _expect_gather(enc, layers, slots, before),
        layers,
        slots,
        layout,
        enc,
    )


def _in_memory_order(node: Any) -> Any:
    """The container with every tensor permuted into memory order (views, no copies), as a
    connector that hands caches over in physical order does."""
    if isinstance(node, torch.Tensor):
        return node.permute(physical_permutation(node))
    if isinstance(node, Mapping):
        return {k: _in_memory_order(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_in_memory_order(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_in_memory_order(v) for v in node)
    raise CheckSkip(f"the fixture hands over a {type(node).__name__}, not tensors: no memory-order view of it to take")


def check_memory_order(case: FixtureCase, device: torch.device) -> str:
    """``ambiguity[memory order]``: see the module docstring."""
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, device)
    phys = _in_memory_order(kv)
    permuted = any(list(physical_permutation(t)) != list(range(t.dim())) for t in tensors_in(kv))
    notes = []
    for label, hs in (("as handed over", dict(hints)), ("with tensor_order='physical'", {**hints, TENSOR_ORDER: "physical"})):
        try:
            layout = detect(phys, case.engine, hs)
        except AmbiguousLayoutError as e:
            notes.append(f"{label}: {_ambiguity_ok(e, hs)}")
            continue
        except DetectionError as e:
            notes.append(f"{label}: refused ({str(e).splitlines()[0][:120]})")
            continue
        except KVCoreError as e:
            raise CheckFailure(f"the allocation in memory order, {label}: detect raised {type(e).__name__}: {e}") from None
        _answers_right(case, kv, layout, hs, f"the allocation in memory order ({label})", _seed(case.name, "memory order", label))
        notes.append(f"{label}: {layout.format.name} {layout.describe()}")
    return ("permuted into memory order; " if permuted else "already in memory order; ") + "; ".join(notes)


def check_physical_order(case: FixtureCase) -> str:
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, torch.device("cpu"))
    layout = _detect(case, kv, hints)
    syn = layout.format.syntax
    axes = list(getattr(syn, "axes", ()))
    for i, t in enumerate(oracle.leaves(layout.kv_caches)):
        named = t.dim() == len(axes)  # a single-plane name: its tokens label the axes
        names = axes if named else [f"axis {d}" for d in range(t.dim())]
        dims = [d for d in range(t.dim()) if t.shape[d] > 1]
        for a, b in zip(dims, dims[1:]):
            if t.stride(a) < t.stride(b):
                perm = physical_permutation(t)
                prefix = "".join(f"{lv}_X_" for lv in getattr(syn, "list_levels", ()))
                memory = prefix + "_".join(names[d] for d in perm) if named else f"axes {perm}"
                raise CheckFailure(
                    f"{layout.format.name} names {names[a]} before {names[b]}, but in the tensors detection returned (tensor {i}, "
                    f"shape {list(t.shape)}, stride {list(t.stride())}) {names[b]} is outside {names[a]} in memory: a format name is "
                    f"the physical (memory) order, outermost first. These tensors' memory order is {memory}: detect to the name "
                    "of that order, with the views permuted into it (HND memory is an HND name even when the engine's tensor "
                    "shows it as NHD)"
                )
    return f"{layout.format.name}: name order is memory order"


#: an engine name no plugin serves: every detector must return None for it
FOREIGN_ENGINE = "kvcore-check-not-an-engine"


def check_engine_scoped(plugin: str, cases: list[FixtureCase]) -> str:
    impls = [i for i in registry.host().pm.hook.kvcore_detect.get_hookimpls() if i.plugin_name == plugin]
    if not impls:
        raise CheckSkip(f"{plugin} has no kvcore_detect hook")
    tried = 0
    for case in cases:
        try:
            kv, hints = case.make(dict(case.sizes), _widest(case.dtypes), torch.device("cpu"))
            container, _ = normalize_container(kv)
        except Exception:  # noqa: BLE001 - the fixture's own checks report a make that fails
            continue
        args = {"kv_caches": container, "engine": FOREIGN_ENGINE, "hints": dict(hints or {})}
        for impl in impls:
            where = f"on fixture {case.name}'s cache (engine {case.engine!r})"
            try:
                answer = impl.function(*[args[a] for a in impl.argnames])
            except Exception as e:  # noqa: BLE001
                raise CheckFailure(
                    f"kvcore_detect(engine={FOREIGN_ENGINE!r}) raised {type(e).__name__}: {e} {where}; a detector must return None "
                    "for an engine that is not its own (check `engine` first), or it pre-empts the engine's own plugin"
                ) from None
            if answer is not None:
                raise CheckFailure(
                    f"kvcore_detect(engine={FOREIGN_ENGINE!r}) answered {answer!r:.100} {where}; a detector must return None for an "
                    "engine that is not its own (check `engine` first), or it answers for every engine"
                )
        tried += 1
    if not tried:
        raise CheckSkip("no fixture's make succeeded on the CPU")
    return f"None for engine {FOREIGN_ENGINE!r} on {tried} fixture caches of {len({c.engine for c in cases})} engine(s)"
