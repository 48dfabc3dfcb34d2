"""The checks of multi-plane formats (``ROLE=TEMPLATE(+ROLE=TEMPLATE)*``), per plane buffer.

A multi-plane record's planes have their own widths and dtypes, so the single
``[kv_size, NL, T, NH*HS]`` code grid of the other families does not fit them. These checks
fill every plane through the fixture's ``kv_view(kv_caches, layer, plane_index)`` with codes
of that plane's own width (:class:`~kvcore.testing.oracle.PlanesEncoding`), and compare
each plane's staged rows — at its index of the classic buffer, or in its own buffer
``[NL, T, NH_p*HS_p]`` — with them. The check names are the other families' (the planner
picks these for multi-plane fixtures): ``fixture_contract``, ``render``, ``geometry``,
``ambiguity[...]``, ``semantic_gather``, ``semantic_scatter``, ``roundtrip[dtype]``,
``negative_slots``, ``empty_slots``, ``padded_pool``, ``invalid[...]`` (plus
``[missing_plane]`` and ``[extra_plane]``), ``staging_views``, ``agrees_with_reference``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore import registry
from kvcore.detection import detect
from kvcore.errors import AmbiguousLayoutError, GeometryError, KVCoreError, TransferError
from kvcore.grammar import VALUE_ROLES, parse
from kvcore.kernels.reference import REFERENCE
from kvcore.layout import KVLayout
from kvcore.layout_plan import synchronize
from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _detect,
    _dname,
    _esize,
    _kernel_guard,
    _make,
    _seed,
    _sizes_str,
    _slots,
    _widest,
    devices,
    forced_kernel,
)
from kvcore.testing.checks.detection import PROBES, _ambiguity_ok
from kvcore.testing.checks.random import _random_sizes
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure, CheckSkip
from kvcore.transfer import gather, gather_blocks, scatter, slots_for_blocks

#: the ``invalid[...]`` kinds of multi-plane fixtures
PLANE_INVALID = ("slot_out_of_range", "duplicate_slots", "layers", "dtype", "device", "shape", "missing_plane", "extra_plane")


def is_multi_plane(case: FixtureCase) -> bool:
    """Whether the fixture's format is a multi-plane name."""
    try:
        return parse(case.format).multi_plane
    except KVCoreError:
        return False


# -- the engine's views, codes and staged rows ------------------------------------------------


def _views(case: FixtureCase, kv: Any, layout: KVLayout, hints: dict) -> list[list[oracle.Plane]]:
    """``[layer][plane]`` engine views, checked against the layout's planes."""
    out = []
    for layer in range(layout.num_layers):
        row = []
        for p, info in enumerate(layout.planes):
            where = f"kv_view(layer={layer}, plane={p} ({info.role}))"
            try:
                v = case.view(kv, layer, p, hints)
            except Exception as e:  # noqa: BLE001
                raise CheckFailure(f"fixture {case.name}: {where} raised {type(e).__name__}: {e}") from None
            grouped = isinstance(v, oracle.TokenGroups)
            if grouped:
                v = v.view
            parts = list(v) if isinstance(v, (tuple, list)) else [v]
            lead = 4 if grouped else 3
            if not parts or not all(isinstance(x, torch.Tensor) and x.dim() >= lead for x in parts):
                want = "TokenGroups([NB, BSC, BSE, NH_p, *elem])" if grouped else "a tensor [NB, BS, NH_p, *elem] (or a tuple of them)"
                raise CheckFailure(f"fixture {case.name}: {where} is not {want}: {v!r:.80}")
            parts = [x.unsqueeze(-1) if x.dim() == lead else x for x in parts]
            try:
                pl = oracle.Plane(parts, token_groups=grouped)
            except KVCoreError as e:
                raise CheckFailure(f"fixture {case.name}: {where}: {e}") from None
            a, b, nh, hs = pl.shape
            if a * b != layout.page_buffer_size or nh != info.num_heads or hs != info.head_size or pl.element_size != _esize(info.dtype):
                raise CheckFailure(
                    f"fixture {case.name}: {where} is [{a}, {b}, {nh}, {hs}] of {pl.element_size}-byte elements; the contract is "
                    f"[NB, BS, NH_p, *elem] = {layout.page_buffer_size} slots, {info.num_heads} heads, {info.head_size} elements "
                    f"per head of {info.dtype} for plane {info.role} of this layout"
                )
            row.append(pl)
        out.append(row)
    return out


def _encoding(layout: KVLayout) -> oracle.PlanesEncoding:
    shapes = [oracle.PlaneShape(i.role, i.num_heads, i.head_size, _esize(i.dtype)) for i in layout.planes]
    return oracle.PlanesEncoding(layout.num_layers, layout.page_buffer_size, shapes)


def _fill(case: FixtureCase, views: list[list[oracle.Plane]], enc: oracle.PlanesEncoding) -> None:
    for layer, row in enumerate(views):
        for p, v in enumerate(row):
            v.fill(enc.plane(p, layer, v.shape))
    for layer, row in enumerate(views):
        for p, v in enumerate(row):
            if not torch.equal(v.unsigned(), enc.plane(p, layer, v.shape)):
                raise CheckFailure(
                    f"fixture {case.name}: after writing every plane through kv_view, layer {layer} plane {enc.planes[p].role} does not "
                    "read back its own values: two kv_view planes overlap, so the fixture's oracle is not a layout"
                )


def _plane_view(layout: KVLayout, st: Any, p: int, single: bool) -> torch.Tensor:
    """Plane ``p``'s part of a staging buffer as ``[L, T, NH_p*HS_p]`` (a view)."""
    info = layout.planes[p]
    x = st[info.staging_index] if info.staging_index is not None else st[info.role]
    return x.unsqueeze(0) if single else x


def _rows(layout: KVLayout, st: Any, p: int, single: bool) -> torch.Tensor:
    return oracle.to_unsigned(oracle.int_view(_plane_view(layout, st, p, single))).cpu()


def _put(layout: KVLayout, st: Any, p: int, single: bool, rows: torch.Tensor) -> None:
    x = oracle.int_view(_plane_view(layout, st, p, single))
    x.copy_(oracle.from_unsigned(rows, x.dtype).reshape(x.shape).to(x.device))


def _buffers(st: Any) -> list[torch.Tensor]:
    return [st] if isinstance(st, torch.Tensor) else list(st.values())


def _sentinel(layout: KVLayout, t: int, layers=None, *, device=None, byte: int = 0xA5) -> Any:
    st = layout.allocate_staging(t, layers, device=device)
    for b in _buffers(st):
        if b.numel():
            b.view(torch.uint8).fill_(byte)
    return st


def _first_diff(what: str, layout: KVLayout, enc: oracle.PlanesEncoding, p: int, actual, expected, layers, slots) -> None:
    diff = actual != expected
    if not bool(diff.any()):
        return
    li, t, col = (int(x) for x in torch.nonzero(diff)[0])
    info = layout.planes[p]
    a, e = int(actual[li, t, col]), int(expected[li, t, col])
    w = 2 * _esize(info.dtype)
    s = int(slots[t])
    ed, ad = enc.decode(p, e), enc.decode(p, a)
    if not enc.exact(p):  # a narrow plane hashes its codes: say where they belong all the same
        head, elem = col // info.head_size, col % info.head_size
        if s >= 0 and e == int(enc.rows(p, [layers[li]], torch.tensor([s]))[0, 0, col]):
            ed = enc.describe_at(p, layers[li], s, head, elem)
        ad = ad or enc.where(p, a) or "no cache value of this plane: bytes from elsewhere (another plane, padding, or outside the cache)"
    raise CheckFailure(
        f"{what}: plane {info.role}, layer {layers[li]}, token {t}"
        + (f" (slot {s})" if s >= 0 else "")
        + f", head {col // info.head_size}, element {col % info.head_size}: expected 0x{e:0{w}x}"
        + (f" ({ed})" if ed else "")
        + f", actual 0x{a:0{w}x}"
        + (f" ({ad})" if ad else ""),
        {
            "plane": info.role,
            "layer": layers[li],
            "token": t,
            "slot": s,
            "head": col // info.head_size,
            "element": col % info.head_size,
            "expected": e,
            "actual": a,
            "expected_means": ed,
            "actual_means": ad,
        },
    )


def _plane_change(before: list[list[torch.Tensor]], after: list[list[torch.Tensor]], layout: KVLayout, enc) -> str | None:
    for layer, (rb, ra) in enumerate(zip(before, after)):
        for p, (b, a) in enumerate(zip(rb, ra)):
            d = a != b
            if bool(d.any()):
                i0, i1, h, e = (int(x) for x in torch.nonzero(d)[0])
                ev, av = int(b[i0, i1, h, e]), int(a[i0, i1, h, e])
                w = 2 * _esize(layout.planes[p].dtype)
                ed, ad = enc.decode(p, ev), enc.decode(p, av)
                if not enc.exact(p):
                    ad = ad or enc.where(p, av)
                return (
                    f"plane {layout.planes[p].role}, layer {layer}, slot {i0 * b.shape[1] + i1}, head {h}, element {e}: "
                    f"expected 0x{ev:0{w}x}" + (f" ({ed})" if ed else "") + f", actual 0x{av:0{w}x}" + (f" ({ad})" if ad else "")
                )
    return None


class PCtx:
    """A fresh multi-plane cache of the fixture on one device, detected and filled with codes."""

    def __init__(self, case: FixtureCase, device: torch.device, kernel: Any, *, dtype=None, sizes=None, fill: bool = True):
        self.case, self.kernel = case, kernel
        self.dtype = dtype or _widest(case.dtypes)
        self.sizes = dict(sizes or case.sizes)
        self.kv, self.hints = _make(case, self.sizes, self.dtype, device)
        self.layout = _detect(case, self.kv, self.hints)
        _kernel_guard(kernel, self.layout)
        self.views = _views(case, self.kv, self.layout, self.hints)
        self.enc = _encoding(self.layout)
        if fill:
            _fill(case, self.views, self.enc)
        self.base = self.snapshot()

    @property
    def layers(self) -> list[int]:
        return list(range(self.layout.num_layers))

    @property
    def n(self) -> int:
        return len(self.layout.planes)

    def snapshot(self) -> oracle.Snapshot:
        return oracle.Snapshot([self.kv, self.layout.kv_caches])

    def reset(self) -> PCtx:
        self.base.restore()
        return self

    def unsigned(self) -> list[list[torch.Tensor]]:
        return [[v.unsigned() for v in row] for row in self.views]

    def gather(self, slots, out=None, **kw):
        with forced_kernel(self.kernel.name):
            return gather(self.layout, slots, out, **kw)

    def scatter(self, slots, src, **kw):
        with forced_kernel(self.kernel.name):
            return scatter(self.layout, slots, src, **kw)

    def src(self, slots: torch.Tensor, layers=None, *, device=None) -> tuple[Any, list[torch.Tensor]]:
        """Staging of source codes for ``slots`` (padding rows carry codes too: they must
        land nowhere), and each plane's int64 rows."""
        single = isinstance(layers, int)
        lay_list = [layers] if single else (self.layers if layers is None else list(layers))
        st = self.layout.allocate_staging(len(slots), layers, device=device)
        rows = []
        for p in range(self.n):
            r = self.enc.rows(p, lay_list, slots.clamp(min=0), src=True)
            _put(self.layout, st, p, single, r)
            rows.append(r)
        return st, rows

    def engine_write(self, layers: Sequence[int], slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """The engine's own scatter: rows written through kv_view at the valid slots."""
        keep = torch.nonzero(slots.cpu() >= 0).flatten()
        s = slots.cpu()[keep]
        for p in range(self.n):
            for li, layer in enumerate(layers):
                self.views[layer][p].write(s, rows[p][li, keep])


def _layer_cases(nl: int) -> list[tuple[Any, list[int]]]:
    out: list[tuple[Any, list[int]]] = [(None, list(range(nl)))]
    if nl > 1:
        out.append((list(range(nl - 1, -1, -1)), list(range(nl - 1, -1, -1))))
    out.append((nl - 1, [nl - 1]))
    return out


def _check_gather_into(ctx: PCtx, what: str, slots: torch.Tensor, out: Any, layers_arg, layers: list[int]) -> None:
    single = isinstance(layers_arg, int)
    before = [_rows(ctx.layout, out, p, single) for p in range(ctx.n)]
    ctx.gather(slots, out, layers=layers_arg)
    keep = (slots.cpu() >= 0).view(1, -1, 1)
    for p in range(ctx.n):
        want = torch.where(keep, ctx.enc.rows(p, layers, slots), before[p])
        _first_diff(what, ctx.layout, ctx.enc, p, _rows(ctx.layout, out, p, single), want, layers, slots)


def _check_scatter_from(
    ctx: PCtx, what: str, slots: torch.Tensor, layers_arg, call: Callable[[Any], Any] | None = None, *, device=None
) -> None:
    single = isinstance(layers_arg, int)
    layers = [layers_arg] if single else (ctx.layers if layers_arg is None else list(layers_arg))
    src, rows = ctx.src(slots, layers_arg, device=device)
    snap = ctx.snapshot()
    (call or (lambda s: ctx.scatter(slots, s, layers=layers_arg)))(src)
    after_kernel, kplanes = ctx.snapshot(), ctx.unsigned()
    snap.restore()
    ctx.engine_write(layers, slots, rows)
    after_engine, eplanes = ctx.snapshot(), ctx.unsigned()
    where = _plane_change(eplanes, kplanes, ctx.layout, ctx.enc)
    if where is not None:
        raise CheckFailure(f"{what}: {where}")
    diff = after_kernel.same_as(after_engine)
    if diff is not None:
        i, off, want, got = diff
        raise CheckFailure(
            f"{what}: byte {off} of storage {i}, which no (layer, plane, slot, head) of the engine's views covers, is 0x{got:02x} "
            f"but must stay 0x{want:02x} (padding or another tensor's memory was written)"
        )


# -- fixture-level checks -------------------------------------------------------------------


def check_fixture_contract(case: FixtureCase) -> str | None:
    fmt = registry.get_format(case.format)
    if not case.dtypes:
        raise CheckFailure(f"fixture {case.name} allows no dtype")
    if not case.source:
        raise CheckFailure(f"fixture {case.name} cites no source (engine, version, file the allocation follows)")
    for k in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"):
        if k not in case.sizes:
            raise CheckFailure(f"fixture {case.name}: sizes lacks {k!r} (declared sizes: {case.sizes})")
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, torch.device("cpu"))
    tensors = oracle.leaves(kv)
    try:
        layout = detect(kv, case.engine, hints)
    except KVCoreError as e:
        raise CheckSkip(f"detection fails (the detect check reports it: {type(e).__name__}), so plane shapes cannot be checked") from None
    tensors += oracle.leaves(layout.kv_caches)
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    views = _views(case, kv, layout, hints)
    for layer, row in enumerate(views):
        for p, v in enumerate(row):
            info = layout.planes[p]
            if info.role in VALUE_ROLES and info.dtype != dtype:
                raise CheckFailure(f"fixture {case.name}: make(dtype={_dname(dtype)}) gave value plane {info.role} dtype {info.dtype}")
            if any(x.untyped_storage().data_ptr() not in storages for x in v.parts):
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, plane={p} ({info.role})) is a copy, not a view of the cache"
                )
    if case.sizes["head_size"] not in {i.head_size for i in layout.planes if i.role in VALUE_ROLES} | {layout.spec.head_size}:
        raise CheckFailure(f"fixture {case.name}: sizes['head_size'] = {case.sizes['head_size']} is no value plane's head size")
    return f"{len(fmt.syntax.planes)} planes: " + ", ".join(
        f"{i.role} {_dname(i.dtype)} {i.num_heads}x{i.head_size}" for i in layout.planes
    )


def check_render(case: FixtureCase) -> str:
    kv, hints = _make(case, case.sizes, _widest(case.dtypes), torch.device("cpu"))
    layout = _detect(case, kv, hints)
    syn = layout.format.syntax
    parts = []
    for ps in syn.planes:
        node = layout.kv_caches[ps.role]
        real = []
        for _ in ps.syntax.list_levels:
            real.append(str(len(node)))
            node = node[0]
        parts.append(f"{ps.role}: " + " x ".join(real + ["[" + ", ".join(str(int(s)) for s in node.shape) + "]"]))
    want, shown = " + ".join(parts), layout.describe()
    if shown != want:
        raise CheckFailure(f"describe() renders {shown!r} but the normalised tensors are {want!r}")
    return shown


def check_geometry(case: FixtureCase) -> str | None:
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, torch.device("cpu"))
    layout = _detect(case, kv, hints)
    s, bad, notes = case.sizes, [], []
    for key in ("num_layers", "num_blocks", "block_size", "num_heads", "page_buffer_size"):
        if key not in s:
            continue
        try:
            got = getattr(layout, key)
        except GeometryError:
            if layout.format.fused_nbbs and key in ("num_blocks", "block_size"):
                continue
            raise
        if got != s[key]:
            bad.append(f"{key}: declared {s[key]}, layout says {got}")
    values = [i for i in layout.planes if i.role in VALUE_ROLES]
    if values and s["head_size"] not in {i.head_size for i in values}:
        bad.append(f"head_size: declared {s['head_size']}, value planes say {[(i.role, i.head_size) for i in values]}")
    try:
        if layout.head_size != s["head_size"]:
            bad.append(f"head_size: declared {s['head_size']}, layout says {layout.head_size}")
    except GeometryError as e:
        notes.append(str(e).split(";")[0])
    want_slots = layout.page_buffer_size
    derived = {
        "kv_size": (layout.kv_size, layout.format.kv_size),
        "device": (layout.device.type, "cpu"),
        "tokens_per_layer": (layout.tokens_per_layer, want_slots),
        "elements_per_layer": (layout.elements_per_layer, sum(want_slots * i.num_heads * i.head_size for i in layout.planes)),
        "planes": (tuple(i.role for i in layout.planes), layout.format.syntax.roles),
    }
    if not layout.format.fused_nbbs:
        derived["page_buffer_size"] = (want_slots, layout.num_blocks * layout.block_size)
    shapes = layout.staging_shapes(5)
    for i in layout.planes:
        if i.staging_index is None:
            derived[f"staging_shapes()[{i.role}]"] = (shapes.get(i.role), (layout.num_layers, 5, i.num_heads * i.head_size))
        else:
            derived[f"staging_shapes()['kv'] for {i.role}"] = (shapes["kv"][1:], (layout.num_layers, 5, i.num_heads * i.head_size))
    bad += [f"{k}: {a} != {b}" for k, (a, b) in derived.items() if a != b]
    ptrs = layout.data_ptrs()
    if not ptrs or not all(isinstance(p, int) and p > 0 for p in ptrs):
        bad.append(f"data_ptrs() = {ptrs!r}")
    try:
        json.dumps(layout.summary())
    except TypeError as e:
        bad.append(f"summary() is not JSON-able: {e}")
    if bad:
        raise CheckFailure(f"{layout.format.name} {layout.describe()}: " + "; ".join(bad))
    staging = "classic [kv_size, NL, T, NH*HS]" if layout.classic_staging else "one buffer per plane"
    return "; ".join([staging, *notes])


def check_ambiguity(case: FixtureCase, probe: str, device: torch.device, gather_too: bool = False) -> str | None:
    """Per plane: ``ambiguity[PROBE]`` and, with ``gather_too``, ``semantic_gather[PROBE]``
    (:func:`kvcore.testing.checks.detection.check_ambiguity`)."""

    fmt = registry.get_format(case.format)
    if (probe.startswith("NH") or probe == "BS=NH") and not fmt.syntax.has("NH"):
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
    if not gather_too:
        return f"answered {layout.describe()}"
    views = _views(case, kv, layout, hints)
    enc = _encoding(layout)
    _fill(case, views, enc)
    slots = _slots(layout, _seed(case.name, probe), count=16, negatives=1)
    out = _sentinel(layout, len(slots))
    layers = list(range(layout.num_layers))
    before = [_rows(layout, out, p, False) for p in range(len(layout.planes))]
    gather(layout, slots, out)
    keep = (slots >= 0).view(1, -1, 1)
    for p in range(len(layout.planes)):
        want = torch.where(keep, enc.rows(p, layers, slots), before[p])
        _first_diff(
            f"probe {_sizes_str(sizes)} detected as {layout.format.name}, and its gather is wrong",
            layout,
            enc,
            p,
            _rows(layout, out, p, False),
            want,
            layers,
            slots,
        )
    return f"gathered right at {layout.describe()}"


# -- data checks ----------------------------------------------------------------------------


def check_semantic_gather(ctx: PCtx) -> str:
    lay = ctx.layout
    slots = _slots(lay, _seed(ctx.case.name, "gather"))
    for layers_arg, layers in _layer_cases(lay.num_layers):
        out = _sentinel(lay, len(slots), layers_arg)
        _check_gather_into(ctx, f"gather(layers={layers_arg})", slots, out, layers_arg, layers)
    if not lay.format.fused_nbbs:
        blocks = torch.tensor([lay.num_blocks - 1, 0])
        with forced_kernel(ctx.kernel.name):
            out = gather_blocks(lay, blocks)
        bslots = slots_for_blocks(lay, blocks).cpu()
        for p in range(ctx.n):
            _first_diff(
                "gather_blocks", lay, ctx.enc, p, _rows(lay, out, p, False), ctx.enc.rows(p, ctx.layers, bslots), ctx.layers, bslots
            )
    return f"{len(slots)} tokens, layer subsets, blocks; planes {', '.join(i.role for i in lay.planes)}"


def check_semantic_scatter(ctx: PCtx) -> str:
    slots = _slots(ctx.layout, _seed(ctx.case.name, "scatter"))
    for layers_arg, _ in _layer_cases(ctx.layout.num_layers):
        ctx.reset()
        _check_scatter_from(ctx, f"scatter(layers={layers_arg})", slots, layers_arg)
    return f"{len(slots)} tokens, one layer, layer subsets"


def check_roundtrip(case: FixtureCase, device: torch.device, kernel: Any, dtype: torch.dtype) -> str:
    ctx = PCtx(case, device, kernel, dtype=dtype, fill=False)
    lay = ctx.layout
    slots = _slots(lay, _seed(case.name, "roundtrip", _dname(dtype)))
    gen = torch.Generator().manual_seed(_seed(case.name, _dname(dtype)))
    src = lay.allocate_staging(len(slots))
    for p, info in enumerate(lay.planes):
        x = oracle.int_view(_plane_view(lay, src, p, False))
        bits = oracle.random_bits(x.shape, _esize(info.dtype), gen)
        pats = oracle.special_patterns(info.dtype)
        flat = bits.view(-1)
        flat[: min(len(pats) * 3, flat.numel())] = torch.tensor(pats * 3, dtype=torch.int64)[: min(len(pats) * 3, flat.numel())]
        x.copy_(oracle.from_unsigned(bits, x.dtype).to(x.device))
    ctx.scatter(slots, src)
    back = ctx.gather(slots)
    keep = torch.nonzero(slots >= 0).flatten()
    for p in range(ctx.n):
        want, got = _rows(lay, src, p, False), _rows(lay, back, p, False)
        _first_diff(f"scatter then gather ({_dname(dtype)})", lay, ctx.enc, p, got[:, keep], want[:, keep], ctx.layers, slots[keep])
        for layer in ctx.layers:  # and the bits landed where the engine reads them
            landed = ctx.views[layer][p].read(slots[keep])
            if not torch.equal(landed, want[layer, keep]):
                raise CheckFailure(
                    f"scatter ({_dname(dtype)}): plane {lay.planes[p].role} layer {layer} holds other bits than were staged where kv_view reads"
                )
    return f"{len(keep)} tokens, every plane's bits"


def check_negative_slots(ctx: PCtx) -> str:
    lay = ctx.layout
    pad = torch.full((5,), -1, dtype=torch.int64)
    out = _sentinel(lay, 5)
    before = [b.clone() for b in _buffers(out)]
    ctx.gather(pad, out)
    if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(_buffers(out), before)):
        raise CheckFailure("gather of an all-padding slot mapping wrote the staging buffer")
    snap = ctx.snapshot()
    src, _ = ctx.src(pad)
    ctx.scatter(pad, src)
    if snap.first_change() is not None:
        raise CheckFailure("scatter of an all-padding slot mapping changed the cache")
    slots = _slots(lay, _seed(ctx.case.name, "skip"), count=8, negatives=0)
    out = _sentinel(lay, len(slots))
    ctx.gather(slots, out, skip_prefix=2)
    masked = slots.clone()
    masked[:2] = -1
    for p in range(ctx.n):
        want = torch.where(
            (masked >= 0).view(1, -1, 1), ctx.enc.rows(p, ctx.layers, masked), _rows(lay, _sentinel(lay, len(slots)), p, False)
        )
        _first_diff("gather(skip_prefix=2)", lay, ctx.enc, p, _rows(lay, out, p, False), want, ctx.layers, masked)
    ctx.reset()
    _check_scatter_from(ctx, "scatter(skip_prefix=2)", masked, None, call=lambda s: ctx.scatter(slots, s, skip_prefix=2))
    return "all-padding and skip_prefix rows untouched both ways"


def check_empty_slots(ctx: PCtx) -> str:
    lay = ctx.layout
    empty = torch.empty(0, dtype=torch.int64)
    out = ctx.gather(empty)
    shapes = lay.staging_shapes(0)
    got = {"kv": tuple(out.shape)} if isinstance(out, torch.Tensor) else {k: tuple(v.shape) for k, v in out.items()}
    if got != shapes:
        raise CheckFailure(f"gather of no slots returned {got}; expected {shapes}")
    snap = ctx.snapshot()
    ctx.scatter(empty, lay.allocate_staging(0))
    if snap.first_change() is not None:
        raise CheckFailure("scatter of no slots changed the cache")
    return f"no-op, staging {shapes}"


def check_padded_pool(case: FixtureCase, device: torch.device, kernel: Any) -> str:
    if not case.supports_padding:
        raise CheckSkip(f"fixture {case.name} does not model a padded pool (supports_padding=False)")
    pad = 2 * max(16, _esize(_widest(case.dtypes)))
    ctx = PCtx(case, device, kernel, sizes={**case.sizes, "block_padding": pad})
    check_semantic_gather(ctx)
    ctx.reset()
    check_semantic_scatter(ctx)
    return f"{pad} bytes per block"


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    same = [d for d in (torch.float16, torch.bfloat16, torch.int16, torch.float32, torch.int32, torch.uint8, torch.int8) if d != dtype]
    return next((d for d in same if _esize(d) == _esize(dtype)), same[0])


def _expect_refusal(ctx: PCtx, what: str, call: Callable[[], Any], staging: Any = None) -> None:
    snap = ctx.snapshot()
    bufs = (
        [b for b in _buffers(staging) if isinstance(b, torch.Tensor) and b.device.type != "meta" and b.numel()]
        if staging is not None
        else []
    )
    before = [b.reshape(-1).view(torch.uint8).clone() if b.is_contiguous() else b.clone() for b in bufs]
    try:
        call()
        # a CUDA refusal validated on the device surfaces at kvcore.synchronize()
        synchronize(ctx.layout.device)
    except TransferError:
        pass
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(f"{what}: raised {type(e).__name__} ({e}); it must raise kvcore.TransferError") from None
    else:
        raise CheckFailure(f"{what}: accepted; it must raise kvcore.TransferError (immediately, or at kvcore.synchronize())")
    if snap.first_change() is not None:
        raise CheckFailure(f"{what}: raised TransferError but changed the cache first")
    for b, c in zip(bufs, before):
        now = b.reshape(-1).view(torch.uint8) if b.is_contiguous() else b
        if not torch.equal(now, c):
            raise CheckFailure(f"{what}: raised TransferError but wrote the staging buffer")


def check_invalid(ctx: PCtx, kind: str) -> str:
    lay = ctx.layout
    t = min(4, lay.page_buffer_size)
    good = torch.arange(t, dtype=torch.int64)

    def both(label: str, slots, make: Callable[[], Any], **kw) -> None:
        st = make()
        _expect_refusal(ctx, f"gather with {label}", lambda: ctx.gather(slots, st, **kw), st)
        st = make()
        _expect_refusal(ctx, f"scatter with {label}", lambda: ctx.scatter(slots, st, **kw), st)

    def swapped(key: str, fn: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        def make():
            st = lay.allocate_staging(t)
            if isinstance(st, torch.Tensor):
                return fn(st)
            st[key] = fn(st[key])
            return st

        return make

    keys = [b.key for b in lay.staging_buffers]
    if kind == "slot_out_of_range":
        both(f"slot {lay.page_buffer_size}", torch.tensor([0, lay.page_buffer_size]), lambda: lay.allocate_staging(2))
    elif kind == "duplicate_slots":
        st = lay.allocate_staging(2)
        _expect_refusal(ctx, "scatter of one slot twice", lambda: ctx.scatter(torch.tensor([1, 1]), st), st)
    elif kind == "layers":
        nl = lay.num_layers
        both(f"layers=[{nl}]", good, lambda: lay.allocate_staging(t, [0]), layers=[nl])
        if nl > 0:
            both("layers=[0, 0]", good, lambda: lay.allocate_staging(t, [0, 0]) if nl > 1 else lay.allocate_staging(t, [0]), layers=[0, 0])
    elif kind == "dtype":
        for k in keys:
            both(
                f"staging {k!r} of the wrong dtype",
                good,
                swapped(k, lambda b: b.view(torch.uint8).view(_other_dtype(b.dtype)) if b.numel() else b.to(_other_dtype(b.dtype))),
            )
    elif kind == "device":
        other = next((d for d in devices() if d.type != lay.device.type), torch.device("meta"))
        if other.type == "cpu" and lay.device.type == "cuda":
            other = torch.device("meta")
        for k in keys:
            both(f"staging {k!r} on {other}", good, swapped(k, lambda b: torch.empty(b.shape, dtype=b.dtype, device=other)))
    elif kind == "shape":
        for k in keys:
            both(
                f"staging {k!r} one element too wide",
                good,
                swapped(k, lambda b: torch.zeros((*b.shape[:-1], b.shape[-1] + 1), dtype=b.dtype, device=b.device)),
            )
            both(
                f"staging {k!r} for one token more",
                good,
                swapped(k, lambda b: torch.zeros((*b.shape[:-2], b.shape[-2] + 1, b.shape[-1]), dtype=b.dtype, device=b.device)),
            )
    elif kind == "missing_plane":
        if lay.classic_staging:
            both("a dict where one tensor is staged", good, lambda: {"kv": lay.allocate_staging(t)})
        else:
            for k in keys:
                both(f"plane {k!r} missing", good, lambda k=k: {kk: v for kk, v in lay.allocate_staging(t).items() if kk != k})
            both("one tensor where a dict of planes is staged", good, lambda: torch.zeros(lay.num_layers, t, 8, dtype=lay.planes[0].dtype))
    elif kind == "extra_plane":
        if lay.classic_staging:
            raise CheckSkip("classic staging: one tensor [kv_size, NL, T, NH*HS], no plane dict to add to")
        both("an extra plane 'EXTRA'", good, lambda: {**lay.allocate_staging(t), "EXTRA": torch.zeros(lay.num_layers, t, 1)})
    else:
        raise CheckFailure(f"unknown invalid kind {kind!r}")
    return "TransferError, nothing written"


def check_staging_views(ctx: PCtx) -> str:
    """Every buffer (one at a time) as a row-strided view inside a wider buffer and as a
    buffer whose start is only element-aligned; CUDA caches: host and pinned host staging."""
    lay = ctx.layout
    slots = _slots(lay, _seed(ctx.case.name, "views"), count=8, negatives=1)
    t = len(slots)
    notes = []
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "row-strided": lambda b: torch.empty((*b.shape[:-1], 2 * b.shape[-1]), dtype=b.dtype, device=b.device)[..., : b.shape[-1]],
        "offset by one element": lambda b: torch.empty(b.numel() + 1, dtype=b.dtype, device=b.device)[1:].view(b.shape),
    }
    for key in [b.key for b in lay.staging_buffers]:
        for label, mk in variants.items():
            ctx.reset()

            def make(mk=mk, key=key):
                st = _sentinel(lay, t)
                if isinstance(st, torch.Tensor):
                    v = mk(st)
                    v.copy_(st)
                    return v
                v = mk(st[key])
                v.copy_(st[key])
                st[key] = v
                return st

            what = f"{label} staging {key!r}"
            try:
                _check_gather_into(ctx, f"gather into {what}", slots, make(), None, ctx.layers)
            except TransferError as e:
                notes.append(f"{what}: refused ({e})")
                continue

            def call(src, mk=mk, key=key):
                if isinstance(src, torch.Tensor):
                    v = mk(src)
                    v.copy_(src)
                    return ctx.scatter(slots, v)
                v = mk(src[key])
                v.copy_(src[key])
                return ctx.scatter(slots, {**src, key: v})

            _check_scatter_from(ctx, f"scatter from {what}", slots, None, call=call)
    if lay.device.type == "cuda":
        ctx.reset()
        out = _sentinel(lay, t, device="cpu")
        _check_gather_into(ctx, "gather into host staging", slots, out, None, ctx.layers)
        _check_scatter_from(ctx, "scatter from host staging", slots, None, device="cpu")
    return "; ".join(notes) or "row-strided and offset buffers of every plane"


def check_agrees_with_reference(case: FixtureCase, device: torch.device, kernel: Any, examples: int) -> str:
    if kernel is REFERENCE or kernel.name == REFERENCE.name:
        raise CheckSkip("this is the reference kernel")
    rng = random.Random(_seed(case.name, kernel.name, "planes"))
    done = 0
    for _ in range(max(1, examples)):
        sizes = _random_sizes(case, rng.randint, rng.choice)
        dtype = rng.choice(list(case.dtypes))
        try:
            kv, hints = case.make(dict(sizes), dtype, device)
            layout = detect(kv, case.engine, hints)
        except (GeometryError, AmbiguousLayoutError):
            continue
        except KVCoreError as e:
            raise CheckFailure(f"{_sizes_str(sizes)} {_dname(dtype)}: detect raised {type(e).__name__}: {e}") from None
        sup = getattr(kernel, "supports", None)
        if sup is not None and not sup(layout.stride_table()):
            continue
        n = layout.page_buffer_size
        slots = torch.tensor([rng.randrange(-1, n) for _ in range(rng.randint(1, 12))], dtype=torch.int64)
        snap = oracle.Snapshot([kv, layout.kv_caches])
        for b in snap.views:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8).to(b.device))
        outs = []
        for k in (kernel.name, REFERENCE.name):
            out = _sentinel(layout, len(slots))
            with forced_kernel(k):
                gather(layout, slots, out)
            outs.append([b.view(torch.uint8).cpu() for b in _buffers(out)])
        if not all(torch.equal(a, b) for a, b in zip(*outs)):
            raise CheckFailure(f"gather differs from the reference for {_sizes_str(sizes)} {_dname(dtype)}, slots {slots.tolist()}")
        uniq = torch.unique(slots[slots >= 0])
        src = layout.allocate_staging(len(uniq))
        for b in _buffers(src):
            b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8).to(b.device))
        base = oracle.Snapshot([kv, layout.kv_caches])
        results = []
        for k in (kernel.name, REFERENCE.name):
            base.restore()
            with forced_kernel(k):
                scatter(layout, uniq, src)
            results.append(oracle.Snapshot([kv, layout.kv_caches]))
        diff = results[0].same_as(results[1])
        if diff is not None:
            raise CheckFailure(
                f"scatter differs from the reference for {_sizes_str(sizes)} {_dname(dtype)}: storage {diff[0]} byte {diff[1]}"
            )
        done += 1
    if not done:
        raise CheckSkip("no random geometry of this fixture was served by this kernel")
    return f"{done} random geometries"
