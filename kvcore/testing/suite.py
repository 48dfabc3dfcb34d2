"""The conformance suite: the checks, the plan that pairs them with plugins, and the runner.

Importable (pandas / fsspec style)::

    from kvcore.testing import suite
    results = suite.run_checks(["trtllm"])            # list[Result]
    for r in results:
        print(r.line())
    failed = [r for r in results if r.status == "FAIL"]

or per fixture and kernel::

    for task in suite.fixture_tasks(case, plugin="mine"):
        print(task.run().line())

Checks (one :class:`Result` per plugin, format, fixture, kernel and check):

* per format a plugin registers: ``grammar`` (the name parses and renders, its derived
  facts agree with its declared labels) and ``fixtures_exist`` (at least one fixture);
* per fixture: ``fixture_contract`` (make/kv_view honour the contract), ``detect``
  (detection of the engine's allocation returns the fixture's format), ``render`` (the
  concrete rendering is the tensors' real shape), ``geometry`` (every accessor equals the
  declared sizes), ``ambiguity[...]`` (look-alike geometries NH=1, NH=2, BS=NH, NB=2,
  NL=2 answer right or raise AmbiguousLayoutError);
* per fixture, kernel and device: ``semantic_gather``, ``semantic_scatter``,
  ``roundtrip[dtype]``, ``negative_slots``, ``empty_slots``, ``padded_pool``,
  ``invalid[...]`` (TransferError and a byte-identical cache), ``staging_views`` and
  ``agrees_with_reference`` (hypothesis, random geometries).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import random
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import registry
from kvcore.detection import detect
from kvcore.errors import AmbiguousLayoutError, GeometryError, KVCoreError, TransferError
from kvcore.grammar import parse, render_concrete, render_symbolic
from kvcore.layout import KVLayout
from kvcore.testing import oracle
from kvcore.testing.fixtures import FixtureCase
from kvcore.transfer import gather, gather_blocks, scatter, slots_for_blocks

__all__ = [
    "Result",
    "Task",
    "CheckFailure",
    "CheckSkip",
    "Options",
    "plan",
    "run_checks",
    "fixture_tasks",
    "format_tasks",
    "devices",
    "forced_kernel",
    "CHECKS",
]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: every check name, in report order (``roundtrip``, ``ambiguity`` and ``invalid`` take a ``[...]`` suffix)
CHECKS = (
    "load",
    "grammar",
    "fixtures_exist",
    "fixture_contract",
    "detect",
    "render",
    "geometry",
    "ambiguity",
    "semantic_gather",
    "semantic_scatter",
    "roundtrip",
    "negative_slots",
    "empty_slots",
    "padded_pool",
    "invalid",
    "staging_views",
    "agrees_with_reference",
)


class CheckFailure(Exception):
    """A check found a defect; ``detail`` carries the first wrong element, when there is one."""

    def __init__(self, message: str, detail: dict | None = None):
        super().__init__(message)
        self.detail = detail or {}


class CheckSkip(Exception):
    """A check does not apply (with the reason)."""


@dataclass
class Result:
    """One line of the report.

    Attributes:
        plugin: the plugin whose format or kernel is checked.
        format: the format name ("" for plugin-level checks).
        fixture: the fixture's name ("" for format-level checks).
        kernel: ``name@device`` for checks that move data, "-" otherwise.
        check: the check name, e.g. ``semantic_gather`` or ``roundtrip[bfloat16]``.
        status: PASS, FAIL or SKIP.
        message: why it failed or was skipped, or a note.
        detail: for a wrong element, its coordinates (layer, kv, token, slot, head,
            element) and the expected and actual bits.
        seconds: wall time.
    """

    plugin: str
    format: str
    fixture: str
    kernel: str
    check: str
    status: str
    message: str = ""
    detail: dict = field(default_factory=dict)
    seconds: float = 0.0

    def line(self, widths: Sequence[int] = (0, 0, 0, 0, 0)) -> str:
        cols = [self.plugin, self.format or "-", self.fixture or "-", self.kernel, self.check]
        head = f"{self.status}  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
        if self.message and self.status != PASS:
            head += "\n      " + self.message.replace("\n", "\n      ")
        elif self.message:
            head += f"  ({self.message})"
        return head

    def as_dict(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin,
            "format": self.format,
            "fixture": self.fixture,
            "kernel": self.kernel,
            "check": self.check,
            "status": self.status,
            "message": self.message,
            "detail": self.detail,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class Options:
    """Knobs of a run. Every random choice (slot mappings, bits, hypothesis examples) is
    seeded from the fixture's name, so a run is reproducible.

    Attributes:
        examples: hypothesis examples per kernel agreement check.
        devices: device types to run on (None: every device present).
    """

    examples: int = 8
    devices: tuple[str, ...] | None = None


@dataclass
class Task:
    """One check, ready to run: ``task.run() -> Result``."""

    plugin: str
    format: str
    fixture: str
    kernel: str
    check: str
    fn: Callable[[], str | None]

    @property
    def id(self) -> str:
        return "::".join([self.plugin, self.format or "-", self.fixture or "-", self.kernel, self.check])

    def run(self) -> Result:
        with single_thread():
            return self._run()

    def _run(self) -> Result:
        t0 = time.perf_counter()
        status, msg, detail = PASS, "", {}
        try:
            note = self.fn()
            msg = note or ""
        except CheckFailure as e:
            status, msg, detail = FAIL, str(e), e.detail
        except CheckSkip as e:
            status, msg = SKIP, str(e)
        except Exception as e:  # noqa: BLE001 - a crash is a failure of the thing checked, reported
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
            status, msg = FAIL, f"crashed with {type(e).__name__}: {e}{where}"
        return Result(self.plugin, self.format, self.fixture, self.kernel, self.check, status, msg, detail, time.perf_counter() - t0)


# -- helpers -----------------------------------------------------------------------------


def devices() -> list[torch.device]:
    """Every device present: the CPU, then each accelerator torch sees."""
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out.append(torch.device("cuda", 0))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        out.append(torch.device("xpu", 0))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append(torch.device("mps"))
    return out


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One torch CPU thread for the block: the suite's tensors are tiny, and thread-pool
    hand-offs would cost more than the copies (much more on a loaded machine)."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


@contextlib.contextmanager
def forced_kernel(name: str | None) -> Iterator[None]:
    """Route every transfer in the block to kernel ``name`` (``KVCORE_KERNEL``)."""
    old = os.environ.get("KVCORE_KERNEL")
    if name:
        os.environ["KVCORE_KERNEL"] = name
    else:
        os.environ.pop("KVCORE_KERNEL", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVCORE_KERNEL", None)
        else:
            os.environ["KVCORE_KERNEL"] = old


def _seed(*parts: Any) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _widest(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    return max(dtypes, key=lambda d: (_esize(d), d.is_floating_point))


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sizes_str(sizes: dict) -> str:
    short = {"num_layers": "NL", "num_blocks": "NB", "block_size": "BS", "num_heads": "NH", "head_size": "HS"}
    return ", ".join(f"{short.get(k, k)}={v}" for k, v in sizes.items())


def _make(case: FixtureCase, sizes: dict, dtype: torch.dtype, device: torch.device) -> tuple[Any, dict]:
    try:
        kv, hints = case.make(dict(sizes), dtype, device)
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(
            f"fixture {case.name}: make({_sizes_str(sizes)}, {_dname(dtype)}, {device}) raised {type(e).__name__}: {e}"
        ) from None
    return kv, dict(hints or {})


def _detect(case: FixtureCase, kv: Any, hints: dict, what: str = "") -> KVLayout:
    try:
        layout = detect(kv, case.engine, hints)
    except KVCoreError as e:
        raise CheckFailure(f"detect(engine={case.engine!r}, hints={hints}){what} raised {type(e).__name__}: {e}") from None
    if layout.format.name != case.format:
        raise CheckFailure(
            f"detect(engine={case.engine!r}, hints={hints}){what} returned {layout.format.name} "
            f"({layout.describe()}); the fixture says the engine allocated {case.format}"
        )
    return layout


def _encoding(layout: KVLayout) -> oracle.Encoding:
    return oracle.Encoding(
        layout.num_layers, layout.kv_size, layout.page_buffer_size, layout.num_heads, layout.head_size, layout.element_size
    )


def _planes(case: FixtureCase, kv: Any, layout: KVLayout, hints: dict) -> list[list[oracle.Plane]]:
    try:
        pl = oracle.planes(lambda c, layer, k: case.view(c, layer, k, hints), kv, layout.num_layers, layout.kv_size)
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(f"fixture {case.name}: kv_view raised {type(e).__name__}: {e}") from None
    for layer, row in enumerate(pl):
        for k, v in enumerate(row):
            a, b, nh, hs = v.shape
            if a * b != layout.page_buffer_size or nh != layout.num_heads or hs != layout.head_size:
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, kv={k}) is [{a}, {b}, {nh}, {hs}]; the contract is "
                    f"[NB, BS, NH, *elem] (or [PBS, 1, NH, *elem]) = {layout.page_buffer_size} slots, {layout.num_heads} heads, "
                    f"{layout.head_size} elements per head for this layout"
                )
    return pl


def _filled(case: FixtureCase, kv: Any, layout: KVLayout, hints: dict) -> tuple[list[list[torch.Tensor]], oracle.Encoding]:
    """Fill the cache with codes through the engine's view, and prove the views disjoint."""
    pl = _planes(case, kv, layout, hints)
    enc = _encoding(layout)
    oracle.fill_codes(pl, enc)
    for layer, row in enumerate(pl):
        for k, v in enumerate(row):
            if not torch.equal(v.unsigned(), enc.plane(layer, k, v.shape)):
                raise CheckFailure(
                    f"fixture {case.name}: after writing every plane through kv_view, layer {layer} kv {k} does not read back "
                    "its own values: two kv_view planes overlap, so the fixture's oracle is not a layout"
                )
    return pl, enc


def _slots(layout: KVLayout, seed: int, *, count: int = 24, negatives: int = 2) -> torch.Tensor:
    """A shuffled slot mapping: first and last slot included, unique, with -1 padding rows."""
    n = layout.page_buffer_size
    rng = random.Random(seed)
    pick = {0, n - 1}
    others = list(range(1, n - 1))
    rng.shuffle(others)
    pick.update(others[: max(0, min(count, n) - 2)])
    slots = list(pick)
    rng.shuffle(slots)
    for i in range(negatives):
        slots.insert(min(len(slots), 1 + 3 * i), -1)
    return torch.tensor(slots, dtype=torch.int64)


def _sentinel_like(layout: KVLayout, t: int, layers=None, byte: int = 0xA5) -> torch.Tensor:
    out = torch.empty(layout.staging_shape(t, layers), dtype=layout.dtype, device=layout.device)
    if out.numel():
        out.view(torch.uint8).fill_(byte)
    return out


def _staged(out: torch.Tensor) -> torch.Tensor:
    u = oracle.to_unsigned(oracle.int_view(out)).cpu()
    return u if u.dim() == 4 else u.unsqueeze(1)


def _expect_gather(enc: oracle.Encoding, layers: Sequence[int], slots: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    rows = enc.rows(layers, slots)
    keep = (slots >= 0).view(1, 1, -1, 1)
    return torch.where(keep, rows, before)


def _compare(what: str, actual: torch.Tensor, expected: torch.Tensor, layers, slots, layout: KVLayout, enc) -> None:
    mm = oracle.first_mismatch(actual, expected, layers=layers, slots=slots, head_size=layout.head_size, enc=enc, width=layout.element_size)
    if mm is not None:
        raise CheckFailure(f"{what}: {mm.describe(layout.kv_size)}", mm.as_dict())


def _kname(kernel: Any, device: torch.device) -> str:
    return f"{kernel.name}@{device.type}"


def _kernel_guard(kernel: Any, layout: KVLayout) -> None:
    sup = getattr(kernel, "supports", None)
    if sup is not None and not sup(layout.stride_table()):
        raise CheckSkip(f"kernel {kernel.name} declines this stride table (supports() is false); another kernel serves it")


def _change_where(snap: oracle.Snapshot, pl, enc) -> str:
    """Where the cache differs from ``snap``, in (layer, K/V, slot, head, element) terms
    when the engine addresses the changed byte. Leaves the cache restored to ``snap``."""
    ch = snap.first_change()
    after = _copies(pl)
    snap.restore()
    mm = oracle.plane_mismatch(pl, after, enc)
    if mm is not None:
        return mm.describe(len(pl[0]))
    if ch is None:
        return "no byte changed"
    i, off, was, now = ch
    return f"byte {off} of storage {i} (outside every (layer, K/V, slot, head) the engine addresses) changed 0x{was:02x} -> 0x{now:02x}"


def _copies(pl: list[list[oracle.Plane]]) -> list[list[oracle.Plane]]:
    return [[v.clone() for v in row] for row in pl]


# -- format-level checks -----------------------------------------------------------------


def check_grammar(fmt) -> str:
    syn = parse(fmt.name)
    if syn.name != fmt.name:
        raise CheckFailure(f"parse({fmt.name!r}).name is {syn.name!r}")
    sym = render_symbolic(syn)
    n_axes = sym.split("[", 1)[1].rstrip("]").count(",") + 1
    if n_axes != len(syn.axes) or sym.count(" x ") != len(syn.list_levels):
        raise CheckFailure(
            f"{fmt.name} renders as {sym!r}, which does not show its {len(syn.axes)} axes and {len(syn.list_levels)} list levels"
        )
    facts = {
        "kv_size": (fmt.kv_size, syn.kv_size),
        "is_mla": (fmt.is_mla, syn.is_mla),
        "container": (fmt.container, syn.container),
        "is_hnd": (fmt.is_hnd, syn.is_hnd),
        "fused_kv": (fmt.fused_kv, syn.fused_kv),
        "fused_nbbs": (fmt.fused_nbbs, syn.fused_nbbs),
    }
    bad = {k: v for k, v in facts.items() if v[0] != v[1]}
    if bad:
        raise CheckFailure(f"{fmt.name}: declared facts disagree with the name: {bad}")
    text = " ".join([fmt.description, *fmt.attention_backends]).upper()
    if syn.has("NH") and syn.has("BS") and not syn.fused_kv:
        other = "NHD" if syn.is_hnd else "HND"
        if f" {other}" in f" {text}" and ("HND" if syn.is_hnd else "NHD") not in text:
            raise CheckFailure(
                f"{fmt.name} is {'HND' if syn.is_hnd else 'NHD'} by its name but its description says {other}: {fmt.description!r}"
            )
    if not fmt.sources or not any(s.file for s in fmt.sources):
        raise CheckFailure(f"{fmt.name} cites no source file: register it with sources=[Source(engine, version, file)]")
    if not fmt.engines:
        raise CheckFailure(f"{fmt.name} names no engine (KVFormat.engines)")
    return sym


# -- fixture-level checks ----------------------------------------------------------------


def check_fixture_contract(case: FixtureCase) -> str | None:
    fmt_names = {f.name for f in registry.formats()}
    if case.format not in fmt_names:
        raise CheckFailure(f"fixture {case.name} claims format {case.format}, which no loaded plugin registers")
    fmt = registry.get_format(case.format)
    notes = []
    if fmt.engines and case.engine not in fmt.engines:
        owner = registry.format_owner(case.format)
        notes.append(f"{case.format} (registered by {owner}) lists engines {fmt.engines}, not {case.engine!r}")
    for k in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"):
        if k not in case.sizes:
            raise CheckFailure(f"fixture {case.name}: sizes lacks {k!r} (declared sizes: {case.sizes})")
    if not case.dtypes:
        raise CheckFailure(f"fixture {case.name} allows no dtype")
    if not case.source:
        raise CheckFailure(f"fixture {case.name} cites no source (engine, version, file the allocation follows)")
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, torch.device("cpu"))
    nl, nh, hs = case.sizes["num_layers"], case.sizes["num_heads"], case.sizes["head_size"]
    tensors = oracle.leaves(kv)
    try:
        tensors += oracle.leaves(detect(kv, case.engine, hints).kv_caches)  # an engine object: the tensors detection found
    except KVCoreError:
        pass  # the detect check reports it
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    for layer in range(nl):
        for k in range(fmt.kv_size):
            try:
                v = case.view(kv, layer, k, hints)
            except Exception as e:  # noqa: BLE001
                raise CheckFailure(f"fixture {case.name}: kv_view(layer={layer}, kv={k}) raised {type(e).__name__}: {e}") from None
            parts = list(v) if isinstance(v, (tuple, list)) else [v]
            if not parts or not all(isinstance(p, torch.Tensor) and p.dim() >= 4 for p in parts):
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, kv={k}) is not a tensor [NB, BS, NH, *elem] "
                    f"(or a tuple of segment tensors): {v!r:.80}"
                )
            if any(p.dtype != dtype for p in parts):
                raise CheckFailure(f"fixture {case.name}: kv_view is {[p.dtype for p in parts]}; it must be the element dtype {dtype}")
            width = sum(math.prod(int(s) for s in p.shape[3:]) for p in parts)
            if any(int(p.shape[2]) != nh for p in parts) or width != hs:
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, kv={k}) has shape(s) {[tuple(p.shape) for p in parts]}; expected "
                    f"NH={nh} heads of HS={hs} elements at axes 2.."
                )
            if any(p.untyped_storage().data_ptr() not in storages for p in parts):
                raise CheckFailure(f"fixture {case.name}: kv_view(layer={layer}, kv={k}) is a copy, not a view of the cache")
    return "; ".join(notes) or None


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


def check_ambiguity(case: FixtureCase, probe: str, device: torch.device) -> str | None:
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
        if len(e.candidates) < 2:
            raise CheckFailure(
                f"AmbiguousLayoutError names {len(e.candidates)} candidate(s); it must name every fitting format: {e}"
            ) from None
        return f"ambiguous as it should be unless hinted: {', '.join(e.candidates)} (hints {', '.join(e.hints) or '-'})"
    except KVCoreError as e:
        raise CheckFailure(f"probe {_sizes_str(sizes)}: detect raised {type(e).__name__}: {e}") from None
    # any answer must move the bytes the engine's view says
    pl, enc = _filled(case, kv, layout, hints)
    slots = _slots(layout, _seed(case.name, probe), count=16, negatives=1)
    out = _sentinel_like(layout, len(slots))
    before = _staged(out)
    gather(layout, slots, out)
    layers = list(range(layout.num_layers))
    _compare(
        f"probe {_sizes_str(sizes)} detected as {layout.format.name} {layout.describe()}, and its gather is wrong",
        _staged(out),
        _expect_gather(enc, layers, slots, before),
        layers,
        slots,
        layout,
        enc,
    )
    same = "" if layout.format.name == case.format else f" as {layout.format.name} (same bytes)"
    return f"answered {layout.describe()}{same}"


# -- kernel checks -------------------------------------------------------------------------


class _Ctx:
    """A fresh cache of the fixture on one device, detected and filled with codes."""

    def __init__(self, case: FixtureCase, device: torch.device, kernel: Any, *, dtype=None, sizes=None, fill=True):
        self.case = case
        self.dtype = dtype or _widest(case.dtypes)
        self.sizes = dict(sizes or case.sizes)
        self.kv, self.hints = _make(case, self.sizes, self.dtype, device)
        self.layout = _detect(case, self.kv, self.hints)
        _kernel_guard(kernel, self.layout)
        self.kernel = kernel
        if fill:
            self.pl, self.enc = _filled(case, self.kv, self.layout, self.hints)
        else:
            self.pl, self.enc = _planes(case, self.kv, self.layout, self.hints), _encoding(self.layout)
        self.base = self.snapshot()

    def snapshot(self) -> oracle.Snapshot:
        """Bytes of every storage the cache lives in: the engine's container and the
        detected layout's tensors (an engine object need not be a list of tensors)."""
        return oracle.Snapshot([self.kv, self.layout.kv_caches])

    def reset(self) -> _Ctx:
        """Back to the state right after construction (codes everywhere)."""
        self.base.restore()
        return self

    @property
    def layers(self) -> list[int]:
        return list(range(self.layout.num_layers))

    def gather(self, slots, out, **kw):
        with forced_kernel(self.kernel.name):
            return gather(self.layout, slots, out, **kw)

    def scatter(self, slots, src, **kw):
        with forced_kernel(self.kernel.name):
            return scatter(self.layout, slots, src, **kw)

    def src_rows(self, slots: torch.Tensor, layers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer of source codes for ``slots`` (padding rows carry codes too:
        they must land nowhere), and its int64 rows."""
        layers = self.layers if layers is None else layers
        rows = self.enc.rows(layers, slots.clamp(min=0), src=True)
        src = torch.empty(self.layout.staging_shape(len(slots), layers), dtype=self.dtype, device=self.layout.device)
        iv = oracle.int_view(src)
        iv.copy_(oracle.from_unsigned(rows, iv.dtype).reshape(iv.shape).to(iv.device))
        return src, rows

    def oracle_scatter(self, snap: oracle.Snapshot, slots, rows, layers=None) -> tuple[oracle.Snapshot, list]:
        """What the engine's own writes produce: restore ``snap``, write through kv_view."""
        after_kernel = self.snapshot()
        planes_kernel = _copies(self.pl)
        snap.restore()
        oracle.write_rows(self.pl, self.layers if layers is None else layers, slots, rows)
        return after_kernel, planes_kernel


def _run_scatter(ctx: _Ctx, what: str, slots: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, *, layers=None, call=None) -> None:
    snap = ctx.snapshot()
    (call or (lambda: ctx.scatter(slots, src, layers=layers)))()
    after_kernel, planes_kernel = ctx.oracle_scatter(
        snap, slots, rows, None if layers is None else ([layers] if isinstance(layers, int) else layers)
    )
    after_oracle = ctx.snapshot()
    mm = oracle.plane_mismatch(_copies(ctx.pl), planes_kernel, ctx.enc)
    if mm is not None:
        raise CheckFailure(f"{what}: {mm.describe(ctx.layout.kv_size)}", mm.as_dict())
    diff = after_kernel.same_as(after_oracle)
    if diff is not None:
        i, off, want, got = diff
        raise CheckFailure(
            f"{what}: byte {off} of storage {i}, which no (layer, K/V, slot, head) of the engine's view covers, "
            f"is 0x{got:02x} but must stay 0x{want:02x} (padding or another tensor's memory was written)"
        )


def check_semantic_gather(ctx: _Ctx) -> str:
    lay = ctx.layout
    slots = _slots(lay, _seed(ctx.case.name, "gather"))
    out = _sentinel_like(lay, len(slots))
    before = _staged(out)
    ctx.gather(slots, out)
    _compare("gather", _staged(out), _expect_gather(ctx.enc, ctx.layers, slots, before), ctx.layers, slots, lay, ctx.enc)
    notes = [f"{len(slots)} tokens"]
    if lay.num_layers > 1:
        sub = [lay.num_layers - 1, 0]
        out = _sentinel_like(lay, len(slots), sub)
        before = _staged(out)
        ctx.gather(slots, out, layers=sub)
        _compare(f"gather(layers={sub})", _staged(out), _expect_gather(ctx.enc, sub, slots, before), sub, slots, lay, ctx.enc)
        one = lay.num_layers - 1
        out = _sentinel_like(lay, len(slots), one)
        before = _staged(out)
        ctx.gather(slots, out, layers=one)
        _compare(f"gather(layers={one})", _staged(out), _expect_gather(ctx.enc, [one], slots, before), [one], slots, lay, ctx.enc)
        notes.append("layer subsets")
    if not lay.format.fused_nbbs:
        blocks = torch.tensor([lay.num_blocks - 1, -1, 0], dtype=torch.int64)
        bslots = slots_for_blocks(lay, blocks).cpu()
        out = _sentinel_like(lay, len(bslots))
        before = _staged(out)
        with forced_kernel(ctx.kernel.name):
            gather_blocks(lay, blocks, out)
        _compare(
            f"gather_blocks({blocks.tolist()})",
            _staged(out),
            _expect_gather(ctx.enc, ctx.layers, bslots, before),
            ctx.layers,
            bslots,
            lay,
            ctx.enc,
        )
        notes.append("blocks")
    return ", ".join(notes)


def check_semantic_scatter(ctx: _Ctx) -> str:
    lay = ctx.layout
    slots = _slots(lay, _seed(ctx.case.name, "scatter"))
    src, rows = ctx.src_rows(slots)
    _run_scatter(ctx, "scatter", slots, src, rows)
    notes = [f"{len(slots)} tokens"]
    if lay.num_layers > 1:
        one = lay.num_layers - 1
        src1, rows1 = ctx.src_rows(slots, [one])
        _run_scatter(ctx, f"scatter(layers={one})", slots, src1[:, 0], rows1, layers=one)
        sub = [lay.num_layers - 1, 0]
        src2, rows2 = ctx.src_rows(slots, sub)
        _run_scatter(ctx, f"scatter(layers={sub})", slots, src2, rows2, layers=sub)
        notes.append("layer subsets")
    return ", ".join(notes)


def check_roundtrip(case: FixtureCase, device: torch.device, kernel: Any, dtype: torch.dtype) -> str:
    ctx = _Ctx(case, device, kernel, dtype=dtype, fill=False)
    lay = ctx.layout
    if lay.dtype != dtype:
        raise CheckFailure(f"a {_dname(dtype)} cache was detected as {_dname(lay.dtype)}")
    gen = torch.Generator().manual_seed(_seed(case.name, dtype))
    for row in ctx.pl:  # random bits everywhere the engine addresses
        for v in row:
            v.fill(oracle.random_bits(v.shape, lay.element_size, gen))
    slots = _slots(lay, _seed(case.name, "roundtrip", dtype))
    t = len(slots)
    bits = oracle.random_bits(lay.staging_shape(t), lay.element_size, gen)
    pats = torch.tensor(oracle.special_patterns(dtype), dtype=torch.int64)
    flat = bits.view(-1)
    flat[: min(flat.numel(), 4 * pats.numel())] = pats.repeat(4)[: min(flat.numel(), 4 * pats.numel())]
    # whole rows of one special pattern, too (a row of -0 or NaN in one token)
    for i in range(min(t, pats.numel())):
        bits[:, :, (i * 3) % t, :] = pats[i]
    src = torch.empty(lay.staging_shape(t), dtype=dtype, device=lay.device)
    oracle.int_view(src).copy_(oracle.from_unsigned(bits, oracle.int_view(src).dtype).to(lay.device))
    _run_scatter(ctx, f"scatter of {_dname(dtype)} bits", slots, src, bits)
    ctx.scatter(slots, src)
    out = _sentinel_like(lay, t)
    before = _staged(out)
    ctx.gather(slots, out)
    keep = (slots >= 0).view(1, 1, -1, 1)
    _compare(f"gather after scatter ({_dname(dtype)})", _staged(out), torch.where(keep, bits, before), ctx.layers, slots, lay, None)
    return f"{len(pats)} special patterns"


def check_negative_slots(ctx: _Ctx) -> str:
    lay = ctx.layout
    t = 5
    slots = torch.full((t,), -1, dtype=torch.int64)
    out = _sentinel_like(lay, t)
    before = _staged(out)
    ctx.gather(slots, out)
    _compare("gather of only padding slots (-1)", _staged(out), before, ctx.layers, slots, lay, ctx.enc)
    src, rows = ctx.src_rows(slots)
    _run_scatter(ctx, "scatter of only padding slots (-1)", slots, src, rows)
    # skip_prefix: the first rows are the engine's, left alone in both directions
    slots = _slots(lay, _seed(ctx.case.name, "prefix"), count=8, negatives=1)
    out = _sentinel_like(lay, len(slots))
    before = _staged(out)
    ctx.gather(slots, out, skip_prefix=2)
    masked = slots.clone()
    masked[:2] = -1
    _compare("gather(skip_prefix=2)", _staged(out), _expect_gather(ctx.enc, ctx.layers, masked, before), ctx.layers, masked, lay, ctx.enc)
    src, rows = ctx.src_rows(slots)
    _run_scatter(ctx, "scatter(skip_prefix=2)", masked, src, rows, call=lambda: ctx.scatter(slots, src, skip_prefix=2))
    return "all -1, and skip_prefix"


def check_empty_slots(ctx: _Ctx) -> str:
    lay = ctx.layout
    empty = torch.empty(0, dtype=torch.int64)
    snap = ctx.snapshot()
    out = ctx.gather(empty, None)
    if tuple(out.shape) != lay.staging_shape(0) or out.dtype != lay.dtype:
        raise CheckFailure(f"gather of no slots returned {tuple(out.shape)} {out.dtype}; expected {lay.staging_shape(0)} {lay.dtype}")
    ctx.scatter(empty, torch.empty(lay.staging_shape(0), dtype=lay.dtype, device=lay.device))
    ch = snap.first_change()
    if ch is not None:
        raise CheckFailure(f"an empty slot mapping changed byte {ch[1]} of storage {ch[0]}: 0x{ch[2]:02x} -> 0x{ch[3]:02x}")
    return "no-op"


def check_padded_pool(case: FixtureCase, device: torch.device, kernel: Any) -> str:
    if not case.supports_padding:
        raise CheckSkip(f"fixture {case.name} does not model a padded pool (supports_padding=False)")
    dtype = _widest(case.dtypes)
    pad = 2 * max(16, _esize(dtype))
    ctx = _Ctx(case, device, kernel, sizes={**case.sizes, "block_padding": pad})
    tight = _Ctx(case, device, kernel)
    if ctx.layout.stride_table().planes[0].block == tight.layout.stride_table().planes[0].block:
        raise CheckFailure(f"make(block_padding={pad}) did not pad the block axis: the block stride is the tight one")
    check_semantic_gather(ctx)
    check_semantic_scatter(ctx)
    return f"{pad} bytes per block"


def _expect_refusal(ctx: _Ctx, what: str, call: Callable[[], Any], staging: torch.Tensor | None = None) -> None:
    snap = ctx.snapshot()
    st_before = staging.view(torch.uint8).clone() if staging is not None and staging.device.type != "meta" and staging.numel() else None
    try:
        call()
    except TransferError:
        pass
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(f"{what}: raised {type(e).__name__} ({e}); it must raise kvcore.TransferError") from None
    else:
        raise CheckFailure(f"{what}: accepted; it must raise kvcore.TransferError")
    if snap.first_change() is not None:
        raise CheckFailure(f"{what}: raised TransferError but changed the cache first: {_change_where(snap, ctx.pl, ctx.enc)}")
    if st_before is not None and not torch.equal(staging.view(torch.uint8), st_before):
        raise CheckFailure(f"{what}: raised TransferError but wrote the staging buffer")


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    same = [d for d in (torch.float16, torch.bfloat16, torch.int16, torch.float32, torch.int32, torch.uint8, torch.int8) if d != dtype]
    for d in same:
        if _esize(d) == _esize(dtype):
            return d
    return same[0]


def _other_device(lay: KVLayout) -> torch.device:
    for d in devices():
        if d.type != lay.device.type and not (lay.device.type == "cuda" and d.type == "cpu"):
            return d
    return torch.device("meta")


INVALID = ("slot_out_of_range", "dtype", "device", "shape", "duplicate_slots", "layers")


def check_invalid(ctx: _Ctx, kind: str) -> str:
    lay = ctx.layout
    n, t = lay.page_buffer_size, 4
    good = torch.tensor([0, n - 1, -1, 1 % n], dtype=torch.int64)
    if n < 3:
        good = torch.tensor([0, -1], dtype=torch.int64)
        t = 2
    src, _ = ctx.src_rows(good)

    def both(label, slots, staging_g, staging_s, **kw):
        _expect_refusal(ctx, f"gather with {label}", lambda: ctx.gather(slots, staging_g, **kw), staging_g)
        _expect_refusal(ctx, f"scatter with {label}", lambda: ctx.scatter(slots, staging_s, **kw))

    if kind == "slot_out_of_range":
        for bad in (n, n + lay.block_size if not lay.format.fused_nbbs else n + 1, 2**40):
            s = good.clone()
            s[-1] = bad
            both(f"slot {bad} (valid 0..{n - 1})", s, _sentinel_like(lay, t), src)
        return f"slots >= {n} refused"
    if kind == "dtype":
        od = _other_dtype(lay.dtype)
        both(
            f"a {_dname(od)} staging buffer",
            good,
            torch.zeros(lay.staging_shape(t), dtype=od, device=lay.device),
            src.view(torch.uint8).view(od)
            if _esize(od) == lay.element_size
            else torch.zeros(lay.staging_shape(t), dtype=od, device=lay.device),
        )
        _expect_refusal(ctx, "gather with a float slot_mapping", lambda: ctx.gather(good.to(torch.float32), _sentinel_like(lay, t)))
        return f"{_dname(od)} refused"
    if kind == "device":
        dev = _other_device(lay)
        wrong = torch.empty(lay.staging_shape(t), dtype=lay.dtype, device=dev)
        both(f"a staging buffer on {dev}", good, wrong, wrong)
        return f"{dev} refused"
    if kind == "shape":
        shapes = [
            lay.staging_shape(t + 1),
            (lay.kv_size, lay.num_layers + 1, t, lay.hidden_dim),
            (lay.kv_size, lay.num_layers, t, lay.hidden_dim + 1),
            (3 - lay.kv_size, lay.num_layers, t, lay.hidden_dim),
            (lay.kv_size, lay.num_layers * t, lay.hidden_dim),
        ]
        for shp in shapes:
            st = torch.zeros(shp, dtype=lay.dtype, device=lay.device)
            both(f"staging shape {tuple(shp)} (expected {lay.staging_shape(t)})", good, st, st)
        return f"{len(shapes)} shapes refused"
    if kind == "duplicate_slots":
        if n < 2:
            raise CheckSkip("one slot only")
        dup = torch.tensor([1, 0, 1, -1], dtype=torch.int64)
        d_src, _ = ctx.src_rows(dup)
        _expect_refusal(ctx, "scatter with slot 1 twice", lambda: ctx.scatter(dup, d_src))
        return "refused"
    if kind == "layers":
        nl = lay.num_layers
        sub_src = torch.zeros(lay.staging_shape(t, [0, 0]), dtype=lay.dtype, device=lay.device)
        both(
            f"layers=[{nl}] (valid 0..{nl - 1})",
            good,
            torch.zeros(lay.staging_shape(t, [nl]), dtype=lay.dtype, device=lay.device),
            torch.zeros(lay.staging_shape(t, [nl]), dtype=lay.dtype, device=lay.device),
            layers=[nl],
        )
        both("layers=[0, 0]", good, sub_src, sub_src, layers=[0, 0])
        return "refused"
    raise CheckSkip(f"unknown invalid-call kind {kind!r}")


def check_staging_views(ctx: _Ctx) -> str:
    """Valid but unusual staging buffers: rows strided inside a wider buffer, a buffer whose
    start is only element-aligned, and (CUDA caches) host and pinned host buffers. The kernel
    must move them exactly, or refuse with TransferError and change nothing."""
    lay = ctx.layout
    slots = _slots(lay, _seed(ctx.case.name, "views"), count=8, negatives=1)
    t = len(slots)
    shp = lay.staging_shape(t)
    wide = torch.empty((*shp[:-1], 2 * shp[-1]), dtype=lay.dtype, device=lay.device)
    flat = torch.empty(math.prod(shp) + 1, dtype=lay.dtype, device=lay.device)
    views = {"row-strided": lambda: wide[..., : shp[-1]], "offset by one element": lambda: flat[1:].view(shp)}
    if lay.device.type == "cuda":  # offloading moves to and from host memory
        views["host memory"] = lambda: torch.empty(shp, dtype=lay.dtype)
        views["pinned host memory"] = lambda: torch.empty(shp, dtype=lay.dtype, pin_memory=True)
    notes = []
    base = ctx.snapshot()
    for label, mk in views.items():
        base.restore()
        out = mk()
        (out if out.is_contiguous() else wide).view(torch.uint8).fill_(0x5A)
        before = _staged(out)
        snap = ctx.snapshot()
        try:
            ctx.gather(slots, out)
        except TransferError as e:
            if snap.first_change() is not None:
                raise CheckFailure(f"gather into a {label} buffer raised TransferError after changing the cache: {e}") from None
            if not torch.equal(_staged(out), before):
                raise CheckFailure(f"gather into a {label} buffer raised TransferError ({e}) after writing part of the buffer") from None
            notes.append(f"{label}: refused cleanly")
            continue
        _compare(
            f"gather into a {label} staging buffer",
            _staged(out),
            _expect_gather(ctx.enc, ctx.layers, slots, before),
            ctx.layers,
            slots,
            lay,
            ctx.enc,
        )
        src = mk()
        rows = ctx.enc.rows(ctx.layers, slots.clamp(min=0), src=True)
        oracle.int_view(src).copy_(oracle.from_unsigned(rows, oracle.int_view(src).dtype).reshape(src.shape).to(src.device))
        snap = ctx.snapshot()
        try:
            ctx.scatter(slots, src)
        except TransferError as e:
            if snap.first_change() is not None:
                raise CheckFailure(
                    f"scatter from a {label} buffer raised TransferError ({e}) after changing the cache: "
                    f"{_change_where(snap, ctx.pl, ctx.enc)}"
                ) from None
            notes.append(f"{label}: scatter refused cleanly")
            continue
        snap.restore()
        _run_scatter(ctx, f"scatter from a {label} staging buffer", slots, src, rows)
        notes.append(label)
    return ", ".join(notes)


_SHAPE_KEYS = ("num_layers", "num_blocks", "block_size", "num_heads", "head_size")


def _random_sizes(case: FixtureCase, draw_int: Callable[[int, int], int], draw_from: Callable[[Sequence], Any]) -> dict:
    c = case.size_constraints
    fmt = registry.get_format(case.format)
    s = dict(case.sizes)
    s["num_layers"] = draw_int(1, 3)
    s["num_blocks"] = draw_int(2, 5)
    if "block_size_choices" in c:
        s["block_size"] = draw_from(list(c["block_size_choices"]))
    elif "block_size_multiple" in c:
        s["block_size"] = int(c["block_size_multiple"]) * draw_int(1, 2)
    else:
        s["block_size"] = draw_from([1, 2, 3, 4, 8, 16])
    if fmt.syntax.has("NH") and "num_heads" not in c.get("fixed", ()):
        s["num_heads"] = draw_from(list(c["num_heads_choices"])) if "num_heads_choices" in c else draw_int(1, 4)
    if "head_size" not in c.get("fixed", ()):
        if "head_size_choices" in c:
            s["head_size"] = draw_from(list(c["head_size_choices"]))
        elif "head_size_multiple" in c:
            s["head_size"] = int(c["head_size_multiple"]) * draw_int(1, 3)
        else:
            s["head_size"] = draw_from([1, 2, 3, 8, 16, 24, 64])
    for k in c.get("fixed", ()):
        s[k] = case.sizes[k]
    return s


def check_agrees_with_reference(case: FixtureCase, device: torch.device, kernel: Any, examples: int) -> str:
    from kvcore.kernels.reference import REFERENCE

    if kernel.name == REFERENCE.name:
        raise CheckSkip("this is the reference kernel")
    state = {"ran": 0, "declined": 0, "last": None}

    def one(sizes: dict, dtype: torch.dtype, picks: list[int], seed: int) -> None:
        try:
            kv, hints = case.make(dict(sizes), dtype, device)
        except GeometryError:
            return
        state["last"] = f"{_sizes_str(sizes)}, {_dname(dtype)}"
        try:
            layout = detect(kv, case.engine, hints)  # a degenerate geometry may read as an equivalent format
        except KVCoreError as e:
            raise CheckFailure(
                f"the engine's allocation for {_sizes_str(sizes)} is not detected ({type(e).__name__}: {e}); "
                "if the engine never allocates it, the fixture's make should raise GeometryError (or declare size_constraints)"
            ) from None
        sup = getattr(kernel, "supports", None)
        if sup is not None and not sup(layout.stride_table()):
            state["declined"] += 1
            return
        n = layout.page_buffer_size
        slots = torch.tensor(sorted(set(p % (n + 1) - 1 for p in picks), key=lambda x: (x * 7919 + seed) % 104729), dtype=torch.int64)
        gen = torch.Generator().manual_seed(seed)
        for st in oracle.Snapshot([kv, layout.kv_caches]).views:
            st.copy_(torch.randint(0, 256, st.shape, generator=gen, dtype=torch.uint8).to(st.device))
        base = oracle.Snapshot([kv, layout.kv_caches])
        outs = []
        for name in (kernel.name, REFERENCE.name):
            with forced_kernel(name):
                outs.append(gather(layout, slots, _sentinel_like(layout, len(slots))))
        if not torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)):
            a, b = _staged(outs[0]), _staged(outs[1])
            mm = oracle.first_mismatch(
                a, b, layers=list(range(layout.num_layers)), slots=slots, head_size=layout.head_size, enc=None, width=layout.element_size
            )
            raise CheckFailure(
                f"gather differs from the reference for {state['last']}, slots {slots.tolist()}: {mm.describe(layout.kv_size)}",
                mm.as_dict(),
            )
        src = torch.empty(layout.staging_shape(len(slots)), dtype=dtype, device=layout.device)
        if src.numel():
            src.view(torch.uint8).copy_(torch.randint(0, 256, src.view(torch.uint8).shape, generator=gen, dtype=torch.uint8).to(src.device))
        after = []
        for name in (kernel.name, REFERENCE.name):
            base.restore()
            with forced_kernel(name):
                scatter(layout, slots, src)
            after.append(oracle.Snapshot([kv, layout.kv_caches]))
        d = after[0].same_as(after[1])
        if d is not None:
            raise CheckFailure(
                f"scatter differs from the reference for {state['last']}, slots {slots.tolist()}: byte {d[1]} of storage {d[0]} is "
                f"0x{d[3]:02x}, the reference wrote 0x{d[2]:02x}"
            )
        state["ran"] += 1

    try:
        import hypothesis
        from hypothesis import strategies as st
    except ImportError:  # pragma: no cover - hypothesis is a test extra
        rng = random.Random(_seed(case.name, kernel.name))
        for _ in range(examples):
            sizes = _random_sizes(case, rng.randint, rng.choice)
            one(sizes, rng.choice(list(case.dtypes)), [rng.randint(0, 400) for _ in range(rng.randint(0, 12))], rng.randint(0, 2**30))
    else:

        @hypothesis.settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate, hypothesis.Phase.shrink],
        )
        @hypothesis.given(data=st.data())
        def prop(data):
            sizes = _random_sizes(case, lambda a, b: data.draw(st.integers(a, b)), lambda xs: data.draw(st.sampled_from(xs)))
            dtype = data.draw(st.sampled_from(list(case.dtypes)))
            picks = data.draw(st.lists(st.integers(0, 400), max_size=12))
            one(sizes, dtype, picks, data.draw(st.integers(0, 2**30)))

        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # hypothesis reports to stdout
            prop()
    if state["ran"] == 0 and state["declined"]:
        raise CheckSkip(f"kernel {kernel.name} declines this format's stride tables (supports() is false); another kernel serves them")
    if state["ran"] == 0:
        raise CheckFailure(
            f"no random geometry was accepted by fixture {case.name}'s make (GeometryError each time); check size_constraints"
        )
    return f"{state['ran']} random geometries"


# -- the plan ------------------------------------------------------------------------------


def format_tasks(plugin: str, fmt) -> list[Task]:
    """``grammar`` for one format."""
    return [Task(plugin, fmt.name, "", "-", "grammar", lambda: check_grammar(fmt))]


def _kernels_for(fmt_name: str, device: torch.device) -> list[Any]:
    out = []
    for k in registry.kernels():
        if device.type not in tuple(k.device_types):
            continue
        fm = getattr(k, "formats", None)
        if fm is not None and fmt_name not in fm:
            continue
        out.append(k)
    return sorted(out, key=lambda k: (-int(getattr(k, "priority", 0)), k.name))


_SHARED: dict[str, Any] = {}


def kernel_tasks(plugin: str, case: FixtureCase, kernel: Any, device: torch.device, opts: Options) -> list[Task]:
    """Every data-moving check of one fixture with one kernel on one device."""
    kn = _kname(kernel, device)

    def T(check: str, fn: Callable[[], str | None]) -> Task:
        def guarded() -> str | None:
            # asked only when the check runs: a native kernel may build on its first availability question
            if not kernel.available():
                raise CheckSkip(f"kernel {kernel.name} is not available here: {kernel.why()}")
            return fn()

        return Task(plugin, case.format, case.name, kn, check, guarded)

    key = (id(case), case.name, str(device), kernel.name)

    def ctx() -> _Ctx:
        # the checks of one (fixture, kernel, device) share one cache, reset between checks
        if _SHARED.get("key") != key:
            _SHARED.clear()
            _SHARED["ctx"] = _Ctx(case, device, kernel)
            _SHARED["key"] = key
            return _SHARED["ctx"]
        return _SHARED["ctx"].reset()

    def with_ctx(fn):
        return lambda: fn(ctx())

    tasks = [
        T("semantic_gather", with_ctx(check_semantic_gather)),
        T("semantic_scatter", with_ctx(check_semantic_scatter)),
    ]
    for dt in case.dtypes:
        tasks.append(T(f"roundtrip[{_dname(dt)}]", lambda dt=dt: check_roundtrip(case, device, kernel, dt)))
    tasks += [
        T("negative_slots", with_ctx(check_negative_slots)),
        T("empty_slots", with_ctx(check_empty_slots)),
        T("padded_pool", lambda: check_padded_pool(case, device, kernel)),
    ]
    for kind in INVALID:
        tasks.append(T(f"invalid[{kind}]", lambda kind=kind: check_invalid(ctx(), kind)))
    tasks += [
        T("staging_views", with_ctx(check_staging_views)),
        T("agrees_with_reference", lambda: check_agrees_with_reference(case, device, kernel, opts.examples)),
    ]
    return tasks


def fixture_tasks(case: FixtureCase, plugin: str = "", opts: Options | None = None, kernels: Sequence[Any] | None = None) -> list[Task]:
    """Every check of one fixture: detection, geometry, ambiguity probes, then the data
    checks for each kernel that serves its format on each device present."""
    opts = opts or Options()
    cpu = torch.device("cpu")

    def T(check: str, fn: Callable[[], str | None]) -> Task:
        return Task(plugin, case.format, case.name, "-", check, fn)

    tasks = [
        T("fixture_contract", lambda: check_fixture_contract(case)),
        T("detect", lambda: check_detect(case, cpu)),
        T("render", lambda: check_render(case)),
        T("geometry", lambda: check_geometry(case)),
    ]
    for probe in PROBES:
        tasks.append(T(f"ambiguity[{probe}]", lambda probe=probe: check_ambiguity(case, probe, cpu)))
    for dev in _devices(opts):
        ks = kernels if kernels is not None else _kernels_for(case.format, dev)
        for k in ks:
            if dev.type in tuple(k.device_types):
                tasks += kernel_tasks(plugin, case, k, dev, opts)
    return tasks


def _devices(opts: Options) -> list[torch.device]:
    devs = devices()
    if opts.devices:
        devs = [d for d in devs if d.type in opts.devices]
    return devs


def _fixtures_by_plugin() -> tuple[dict[str, list[FixtureCase]], dict[str, str]]:
    """Each plugin's fixtures, and the error of each plugin whose fixture hook raised."""
    from kvcore.testing.fixtures import fixtures

    h = registry.host()
    out: dict[str, list[FixtureCase]] = {}
    errors: dict[str, str] = {}
    for p in h.pm.get_plugins():
        name = h.pm.get_name(p)
        try:
            cases = fixtures(name)
        except Exception as e:  # noqa: BLE001 - one broken plugin must not hide the others' results
            errors[name] = f"kvcore_register_fixtures raised {type(e).__name__}: {e}"
            cases = []
        bad = [c for c in cases if not isinstance(c, FixtureCase)]
        if bad:
            errors[name] = f"kvcore_register_fixtures registered {bad[0]!r:.80}, not a kvcore.testing.FixtureCase"
            cases = [c for c in cases if isinstance(c, FixtureCase)]
        out[name] = cases
    return out, errors


def plan(plugins: Sequence[str] | None = None, opts: Options | None = None) -> list[Task]:
    """The tasks for ``plugins`` (default: every loaded plugin).

    For a plugin: ``grammar`` and ``fixtures_exist`` per format it registers; every
    fixture check of its fixtures, with every kernel serving the format; and its own
    kernels against every fixture (of any plugin) whose format they serve.

    Raises:
        kvcore.PluginError: a name that is not a loaded plugin (the message lists them).
    """
    from kvcore.errors import PluginError

    opts = opts or Options()
    h = registry.host()
    infos = {i.name: i for i in registry.plugins()}
    names = list(plugins) if plugins else sorted(infos)
    unknown = [n for n in names if n not in infos]
    if unknown:
        raise PluginError(
            f"no kvcore plugin named {', '.join(map(repr, unknown))} is loaded; loaded plugins: {', '.join(sorted(infos)) or 'none'}"
        )
    by_plugin, fixture_errors = _fixtures_by_plugin()
    tasks: list[Task] = []
    seen: set[str] = set()

    def add(ts: list[Task]) -> None:
        for t in ts:
            key = "::".join([t.fixture or t.format, t.kernel, t.check])
            if t.fixture and key in seen:
                continue
            seen.add(key)
            tasks.append(t)

    for name in names:
        info = infos[name]
        if info.error:
            err = info.error
            add([Task(name, "", "", "-", "load", lambda err=err: (_ for _ in ()).throw(CheckFailure(f"plugin failed to load: {err}")))])
            continue
        cases = by_plugin.get(name, [])
        if name in fixture_errors:
            err = fixture_errors[name]
            add([Task(name, "", "", "-", "fixtures", lambda err=err: (_ for _ in ()).throw(CheckFailure(err)))])
        for fname in sorted(f for f, o in h.format_owner.items() if o == name):
            fmt = h.formats[fname]
            mine = [c.name for c in cases if c.format == fname]

            def exists(fname=fname, mine=mine, name=name):
                if not mine:
                    raise CheckFailure(
                        f"{fname} is registered but {name} supplies no FixtureCase for it (kvcore_register_fixtures); "
                        "an untested format is not supported"
                    )
                return f"{len(mine)} fixture(s)"

            add(format_tasks(name, fmt) + [Task(name, fname, "", "-", "fixtures_exist", exists)])
        for case in cases:
            add(fixture_tasks(case, name, opts))
        own = [k for k in registry.kernels() if h.kernel_owner.get(id(k)) == name]
        present = {d.type for d in _devices(opts)}
        for k in own:
            if not present & set(k.device_types):
                why = f"no {'/'.join(k.device_types)} device here (devices: {', '.join(sorted(present))}); run kvcore check on a machine that has one"
                add([Task(name, "", "", f"{k.name}@-", "device", lambda why=why: (_ for _ in ()).throw(CheckSkip(why)))])
        if own:
            for owner, others in sorted(by_plugin.items()):
                for case in others:
                    for dev in _devices(opts):
                        for k in own:
                            if dev.type in tuple(k.device_types) and (getattr(k, "formats", None) is None or case.format in k.formats):
                                add(kernel_tasks(owner, case, k, dev, opts))
    return tasks


def select(tasks: Sequence[Task], *, formats=None, fixtures=None, kernels=None, checks=None) -> list[Task]:
    """Filter tasks by glob patterns on format, fixture, kernel (``name`` or ``name@device``;
    checks that move no data are kept) and check (``invalid`` matches every ``invalid[...]``)."""

    def ok(value: str, pats) -> bool:
        return not pats or any(
            fnmatch.fnmatchcase(value, p) or fnmatch.fnmatchcase(value.split("@")[0], p) or fnmatch.fnmatchcase(value.split("[")[0], p)
            for p in pats
        )

    return [
        t
        for t in tasks
        if ok(t.format, formats) and ok(t.fixture, fixtures) and (t.kernel == "-" or ok(t.kernel, kernels)) and ok(t.check, checks)
    ]


def run_checks(plugins: Sequence[str] | None = None, opts: Options | None = None, **filters) -> list[Result]:
    """Plan and run; ``filters`` as in :func:`select`."""
    return [t.run() for t in select(plan(plugins, opts), **filters)]
