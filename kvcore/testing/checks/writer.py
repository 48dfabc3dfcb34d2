"""Writer checks: the layout proved by what the engine's own writer wrote
(:mod:`kvcore.testing.writers`).

* ``writer`` (per fixture, no writer to run): skipped, with the reason the fixture gives or
  the import that failed.
* ``writer_view`` (per fixture, CPU): the engine's writer writes a code at every slot; the
  fixture's ``kv_view`` must read exactly those codes -- else the oracle every other
  semantic check uses restates a wrong reading of the engine.
* ``writer_gather`` (per fixture, kernel and device): kvcore's gather of the detected layout
  returns exactly the rows the engine's writer wrote (every slot, then a shuffled subset
  gathered with padding rows).
* ``writer_scatter`` (per fixture, kernel and device): from the same starting bytes, kvcore's
  scatter and the engine's writer leave every storage byte-identical; and the engine's
  read-back, when the fixture gives one, returns the scattered rows. A writer that
  allocates (a cache that appends) is compared through its read-back only.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from kvcore.errors import KVCoreError
from kvcore.layout import KVLayout
from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _compare,
    _copies,
    _detect,
    _encoding,
    _kernel_guard,
    _make,
    _planes,
    _seed,
    _sentinel_like,
    _staged,
    _widest,
    forced_kernel,
)
from kvcore.testing.checks.planes import is_multi_plane
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure, CheckSkip
from kvcore.testing.writers import Writer, WriterUnsupported
from kvcore.transfer import gather, scatter

_UNAVAILABLE: dict[int, str | None] = {}

WROTE = "the row the engine's writer wrote for"


def no_writer_reason(case: FixtureCase) -> str:
    """Why a fixture has no writer to run (its ``writer`` is a reason string or None)."""
    if isinstance(case.writer, str) and case.writer.strip():
        return f"no engine writer runs for fixture {case.name}: {case.writer}"
    return (
        f"fixture {case.name} carries no engine writer (FixtureCase.writer): its layout is proved only by kv_view, a reading "
        "written here -- give the engine's own write path (kvcore.testing.Writer), or a string saying why it cannot run"
    )


def check_writer(case: FixtureCase) -> str:
    """The ``writer`` record of a fixture with no writer to run: always a skip, with the reason."""
    raise CheckSkip(no_writer_reason(case))


def _writer(case: FixtureCase, device: torch.device) -> Writer:
    w = case.writer
    if not isinstance(w, Writer):
        raise CheckSkip(no_writer_reason(case))
    if id(w) not in _UNAVAILABLE:
        _UNAVAILABLE[id(w)] = w.unavailable()
    why = _UNAVAILABLE[id(w)]
    if why:
        raise CheckSkip(f"writer {w.name} cannot run in this environment: {why}")
    if device.type not in w.devices:
        raise CheckSkip(f"writer {w.name} runs on {'/'.join(w.devices)}, not {device.type}")
    return w


def _background(kv: Any, seed: int) -> oracle.Snapshot:
    """Fill every byte of every storage the cache lives in with seeded random bytes; the
    snapshot of that state."""
    snap = oracle.Snapshot(kv)
    g = torch.Generator().manual_seed(seed)
    for v in snap.views:
        v.copy_(torch.randint(0, 256, (v.numel(),), generator=g, dtype=torch.uint8).to(v.device))
    return oracle.Snapshot(kv)


def _rows(enc: oracle.Encoding, layout: KVLayout, slots: torch.Tensor, *, src: bool) -> dict[str, torch.Tensor]:
    """The writer's rows ``{"K": [NL, T, NH, HS], "V": ...}`` of codes, in the cache's dtype."""
    codes = enc.rows(list(range(layout.num_layers)), slots, src=src)  # [kv, NL, T, NH*HS]
    it = oracle.INT_OF_SIZE[layout.element_size]
    out = {}
    for kv, role in enumerate(("K", "V")[: layout.kv_size]):
        bits = oracle.from_unsigned(codes[kv], it).view(layout.dtype)
        out[role] = bits.reshape(layout.num_layers, len(slots), layout.num_heads, layout.head_size).to(layout.device)
    return out


def _all_slots(layout: KVLayout, seed: int) -> torch.Tensor:
    perm = list(range(layout.page_buffer_size))
    random.Random(seed).shuffle(perm)
    return torch.tensor(perm, dtype=torch.int64)


def _some_slots(layout: KVLayout, seed: int) -> torch.Tensor:
    """A shuffled half of the slots (first and last included), with two padding rows."""
    n = layout.page_buffer_size
    rng = random.Random(seed)
    pick = {0, n - 1} | set(rng.sample(range(n), max(1, n // 2)))
    slots = sorted(pick)
    rng.shuffle(slots)
    slots.insert(min(1, len(slots)), -1)
    slots.insert(min(4, len(slots)), -1)
    return torch.tensor(slots, dtype=torch.int64)


def _valid(slots: torch.Tensor) -> torch.Tensor:
    return slots[slots >= 0]


class _Written:
    """A fixture's cache written by the engine's writer: ``kv`` the container after the
    write, ``layout`` its detection, ``enc`` the codes."""

    def __init__(self, case: FixtureCase, device: torch.device, slots_of, *, what: str):
        self.case = case
        self.writer = _writer(case, device)
        self.dtype = _widest(case.dtypes)
        self.kv0, self.hints = _make(case, case.sizes, self.dtype, device)
        self.layout0 = _detect(case, self.kv0, self.hints, " (before the engine's writer ran)")
        if is_multi_plane(case) and not self.layout0.classic_staging:
            raise CheckSkip(
                f"writer {self.writer.name}: the writer checks move K/V rows; a record whose planes stage apart "
                "(values beside scales, unequal K/V widths) is not covered yet"
            )
        self.enc = _encoding(self.layout0)
        self.base = _background(self.kv0, _seed(case.name, what, "background"))
        self.slots = slots_of(self.layout0)
        self.rows = _rows(self.enc, self.layout0, _valid(self.slots), src=False)
        self.kv = self.write(self.kv0, _valid(self.slots), self.rows)
        self.allocated = self.kv is not self.kv0
        self.layout = self.layout0 if not self.allocated else _detect(case, self.kv, self.hints, " (the engine writer's cache)")

    def write(self, kv: Any, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> Any:
        try:
            return self.writer.run(kv, slots, rows, self.hints)
        except WriterUnsupported:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's code failing is the fixture's defect, reported
            raise CheckFailure(
                f"the engine's writer {self.writer.name} raised {type(e).__name__}: {str(e)[:300]} "
                f"(writing {len(slots)} slots of fixture {self.case.name})"
            ) from None


def _written(case: FixtureCase, device: torch.device, slots_of, what: str) -> _Written:
    try:
        return _Written(case, device, slots_of, what=what)
    except WriterUnsupported as e:
        raise CheckFailure(f"the engine's writer {case.writer.name} refused to write every slot of the cache: {e}") from None


def _say(text: str) -> str:
    return text.replace("the cache value of", WROTE)


def _said(detail: dict) -> dict:
    return {k: _say(v) if isinstance(v, str) else v for k, v in detail.items()}


def check_writer_view(case: FixtureCase) -> str:
    w = _written(case, torch.device("cpu"), lambda lay: _all_slots(lay, _seed(case.name, "writer_view")), "view")
    pl = _planes(case, w.kv, w.layout, w.hints)
    for layer, row in enumerate(pl):
        for k, v in enumerate(row):
            got, want = v.unsigned(), w.enc.plane(layer, k, v.shape)
            diff = got != want
            if bool(diff.any()):
                a, b, h, e = (int(x) for x in torch.nonzero(diff)[0])
                mm = oracle.Mismatch(
                    layer=layer,
                    kv=k,
                    token=None,
                    slot=a * v.shape[1] + b,
                    head=h,
                    element=e,
                    expected=int(want[a, b, h, e]),
                    actual=int(got[a, b, h, e]),
                    width=v.element_size,
                    expected_means=w.enc.decode(int(want[a, b, h, e])),
                    actual_means=w.enc.decode(int(got[a, b, h, e])),
                )
                raise CheckFailure(
                    _say(
                        f"the fixture's kv_view disagrees with the engine's writer {w.writer.name}: kv_view reads "
                        f"{mm.describe(w.layout.kv_size)}. The oracle of the other semantic checks restates a reading the engine "
                        "does not write: fix kv_view (and whatever detection shares its reading)"
                    ),
                    _said(mm.as_dict()),
                )
    return f"{w.writer.name} ({w.writer.origin}): kv_view reads every slot it wrote"


def _gather_and_compare(w: _Written, kernel: Any, slots: torch.Tensor, what: str) -> None:
    lay = w.layout
    out = _sentinel_like(lay, len(slots))
    before = _staged(out)
    with forced_kernel(kernel.name):
        gather(lay, slots, out)
    layers = list(range(lay.num_layers))
    rows = w.enc.rows(layers, slots)
    expected = torch.where((slots >= 0).view(1, 1, -1, 1), rows, before)
    try:
        _compare(what, _staged(out), expected, layers, slots, lay, w.enc)
    except CheckFailure as e:
        raise CheckFailure(_say(str(e)), _said(e.detail)) from None


def check_writer_gather(case: FixtureCase, device: torch.device, kernel: Any) -> str:
    w = _written(case, device, lambda lay: _all_slots(lay, _seed(case.name, "writer_gather")), "gather")
    _kernel_guard(kernel, w.layout)
    _gather_and_compare(w, kernel, w.slots, f"gather of every slot the engine's writer {w.writer.name} wrote")
    notes = [f"{w.writer.name} ({w.writer.origin}): {len(w.slots)} slots"]
    if w.writer.all_slots:
        notes.append("the writer writes whole caches only")
        return ", ".join(notes)
    try:
        part = _Written(case, device, lambda lay: _some_slots(lay, _seed(case.name, "writer_gather", "some")), what="gather some")
    except WriterUnsupported as e:
        notes.append(f"a subset of slots: not written ({e})")
        return ", ".join(notes)
    _gather_and_compare(
        part, kernel, part.slots, f"gather of a subset of slots (with padding rows) the engine's writer {w.writer.name} wrote"
    )
    notes.append(f"then {int((part.slots >= 0).sum())} shuffled slots with padding")
    return ", ".join(notes)


def _staging(w: _Written, layout: KVLayout, slots: torch.Tensor) -> torch.Tensor:
    """kvcore's staging rows of the scatter source codes (padding rows carry codes too)."""
    layers = list(range(layout.num_layers))
    codes = w.enc.rows(layers, slots.clamp(min=0), src=True)
    src = torch.empty(layout.staging_shape(len(slots)), dtype=layout.dtype, device=layout.device)
    iv = oracle.int_view(src)
    iv.copy_(oracle.from_unsigned(codes, iv.dtype).reshape(iv.shape).to(iv.device))
    return src


def _read_back(w: _Written, kv: Any, slots: torch.Tensor, want: dict[str, torch.Tensor], what: str) -> None:
    reader = w.writer.read
    try:
        got = reader(kv, slots, hints=dict(w.hints))
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(f"the engine's read-back of {w.writer.name} raised {type(e).__name__}: {str(e)[:300]}") from None
    for kv_i, role in enumerate(want):
        g = oracle.to_unsigned(oracle.int_view(got[role].contiguous())).cpu().reshape(len(want[role]), len(slots), -1)
        e = oracle.to_unsigned(oracle.int_view(want[role].contiguous())).cpu().reshape(g.shape)
        if not torch.equal(g, e):
            layers = list(range(g.shape[0]))
            actual = torch.zeros((w.layout.kv_size, *g.shape), dtype=torch.int64)
            expected = actual.clone()
            actual[kv_i], expected[kv_i] = g, e
            try:
                _compare(what, actual, expected, layers, slots, w.layout, w.enc)
            except CheckFailure as err:
                raise CheckFailure(_say(str(err)), _said(err.detail)) from None


def check_writer_scatter(case: FixtureCase, device: torch.device, kernel: Any) -> str:
    writer = _writer(case, device)
    seed = _seed(case.name, "writer_scatter")
    if writer.all_slots:
        w = _written(case, device, lambda lay: _all_slots(lay, seed), "scatter")
    else:
        w = _written(case, device, lambda lay: _some_slots(lay, seed), "scatter")
    _kernel_guard(kernel, w.layout)
    if w.allocated:
        return _scatter_by_read_back(w, kernel, seed)
    # in place: the engine wrote its rows (cache codes) into the background; now the same
    # from the same bytes with the scatter's source codes, once by the engine, once by kvcore
    slots = w.slots
    src_rows = _rows(w.enc, w.layout, _valid(slots), src=True)
    w.base.restore()
    w.write(w.kv, _valid(slots), src_rows)
    by_engine = oracle.Snapshot(w.kv)
    engine_planes = _copies(_planes(case, w.kv, w.layout, w.hints))
    w.base.restore()
    staged = _staging(w, w.layout, slots)
    with forced_kernel(kernel.name):
        scatter(w.layout, slots, staged)
    by_kvcore = oracle.Snapshot(w.kv)
    diff = by_kvcore.same_as(by_engine)
    if diff is not None:
        mm = oracle.plane_mismatch(engine_planes, _copies(_planes(case, w.kv, w.layout, w.hints)), w.enc)
        where = f"; through kv_view: {mm.describe(w.layout.kv_size)}" if mm is not None else ""
        i, off, want, got = diff
        raise CheckFailure(
            _say(
                f"scatter of {int((slots >= 0).sum())} slots differs from the engine's writer {writer.name} writing the same rows: "
                f"byte {off} of storage {i} is 0x{got:02x} after kvcore's scatter, 0x{want:02x} after the engine's write{where}"
            ),
            mm.as_dict() if mm is not None else {},
        )
    notes = [f"{writer.name} ({writer.origin}): byte-identical over {int((slots >= 0).sum())} slots"]
    if writer.read is not None:
        _read_back(w, w.kv, _valid(slots), src_rows, "the engine's read-back after kvcore's scatter")
        notes.append("engine read-back agrees")
    return ", ".join(notes)


def _scatter_by_read_back(w: _Written, kernel: Any, seed: int) -> str:
    writer = w.writer
    if writer.read is None:
        raise CheckSkip(
            f"the engine's writer {writer.name} allocates a new cache (it appends), so its bytes cannot be compared with a "
            "scatter in place, and the fixture gives no read-back (Writer.read) to compare through"
        )
    slots = _some_slots(w.layout, seed)
    staged = _staging(w, w.layout, slots)
    with forced_kernel(kernel.name):
        try:
            scatter(w.layout, slots, staged)
        except KVCoreError as e:
            raise CheckFailure(f"scatter into the engine writer's cache raised {type(e).__name__}: {e}") from None
    every = torch.arange(w.layout.page_buffer_size, dtype=torch.int64)
    hit = set(_valid(slots).tolist())
    written = _rows(w.enc, w.layout, every, src=False)
    moved = _rows(w.enc, w.layout, every, src=True)
    mask = torch.tensor([s in hit for s in every.tolist()]).view(1, -1, 1, 1).to(w.layout.device)
    want = {r: torch.where(mask, moved[r], written[r]) for r in written}
    _read_back(w, w.kv, every, want, "the engine's read-back of every slot after kvcore's scatter")
    return f"{writer.name} ({writer.origin}, allocating): the engine reads back the {len(hit)} scattered rows and every other row it wrote"
