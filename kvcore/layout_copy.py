"""Layout-to-layout copy: token rows from one detected KV cache straight into another.

``kvcore.copy(src_layout, src_slots, dst_layout, dst_slots)`` moves, for every row ``i``,
the K/V (or latent, or any plane's) bytes of source slot ``src_slots[i]`` into destination
slot ``dst_slots[i]``, for every layer, in one pass and without a staging buffer. Both
caches are read through their own stride tables, so any two layouts with the same
per-token content convert on the way: NHD <-> HND, FlashInfer <-> FlashAttention,
blocks-first <-> K/V-first, per-layer <-> cross-layer, packed K|V <-> separate K and V,
different block sizes and pool sizes, on one device or between a GPU and (pinned) host
memory.

Tensor parallelism: ``heads=(start, stop)`` copies only source KV heads ``start..stop-1``
(a TP split: a decode rank of TP 2 takes half a prefill rank's heads);
``dst_heads=(start, stop)`` lands the rows in destination heads ``start..stop-1`` (a TP
merge into a destination with more heads). A head range is a derived stride table
(:meth:`kvcore.StrideTable.select_heads`). An MLA latent has one head and is copied whole.

Planes are paired by role (``K``, ``V``, ``KV`` for an MLA latent, ``KS``...); each pair
must agree on head count, head width and dtype — bytes move unchanged.

Everything is validated before the first byte moves: a bad call raises
:class:`~kvcore.TransferError` and leaves both caches untouched. That includes caches that
changed since their layouts were built (a storage freed, resized or replaced; a tensor
reshaped in place; the caller's tensor re-pointed with ``set_`` under the views detection
made, which would otherwise be written while the caller's tensor no longer shows them).

One memory on both sides (a copy within one cache, two layouts of one buffer, a cache and
a view of part of it): a copy never reads a byte it writes. Rows whose source bytes meet
another (or the same) row's destination bytes are refused, naming the rows and slots, like
torch's refusal of partially overlapping ``index_put_``; the caller splits the copy or goes
through a staging buffer (:func:`kvcore.gather`, then :func:`kvcore.scatter`). When both
sides read the shared memory the same way this is a comparison of slot values (on a GPU
done by the device check); otherwise the rows' byte runs are compared on the host
(:func:`byte_overlap`; on a GPU one read-back of the slots).
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.errors import GeometryError, TransferError
from kvcore.inputs import plain_integers
from kvcore.kernels import _build, plane_span
from kvcore.kernels.copy_kernels import NATIVE_CPU_COPY, NATIVE_CUDA_COPY, CopyPlan, check_tables, prepare_native, select_copy_kernel
from kvcore.kernels.native import RC_REFUSED
from kvcore.layout import KVLayout
from kvcore.layout_plan import _dense
from kvcore.spec import StrideTable
from kvcore.transfer import _index_tensor, _layers

__all__ = ["copy", "plan_copy", "CopyPlan", "CopyLayoutPlan", "Overlap", "byte_overlap", "head_range", "overlap", "pair_tables"]


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def head_range(rng, what: str, layout: KVLayout | None = None) -> tuple[int, int] | None:
    """``None`` or a validated ``(start, stop)`` pair of ints (numpy/torch integer scalars accepted).

    Raises:
        TransferError: not a pair of integers with ``0 <= start < stop``, or past ``layout``'s heads.
    """
    if rng is None:
        return None
    rng = plain_integers(rng, what, TransferError)
    if isinstance(rng, (list, tuple)) and len(rng) == 2:
        rng = tuple(plain_integers(x, f"{what}[{i}]", TransferError) for i, x in enumerate(rng))
    try:
        start, stop = rng
        start, stop = operator.index(start), operator.index(stop)
    except (TypeError, ValueError):
        raise TransferError(f"{what} must be None or (start, stop), two integers, got {rng!r}") from None
    if isinstance(rng[0], bool) or isinstance(rng[1], bool) or not 0 <= start < stop:
        raise TransferError(f"{what}=({rng[0]!r}, {rng[1]!r}) is not a head range: it needs 0 <= start < stop")
    if layout is not None and stop > layout.num_heads:
        extra = " (an MLA latent has no head axis: it is copied whole, pass None)" if layout.is_mla else ""
        raise TransferError(
            f"{what}=({start}, {stop}) reaches past the {layout.num_heads} KV head(s) of {layout.format.name}{extra}; "
            f"valid ranges lie in 0..{layout.num_heads}"
        )
    return (start, stop)


def _select(table: StrideTable, rng: tuple[int, int] | None, what: str) -> StrideTable:
    if rng is None:
        return table
    try:
        return table.select_heads(*rng)
    except GeometryError as e:
        raise TransferError(f"{what}={rng}: {e}") from None


def pair_tables(src: StrideTable, dst: StrideTable, src_name: str, dst_name: str, *, ranges_given: bool) -> StrideTable:
    """``dst`` with its planes reordered to pair with ``src``'s by role, after checking that
    each pair agrees on head count, head width and dtype.

    Raises:
        TransferError: the two record different planes (roles), or a pair disagrees (the
            message names both sides' values; a head-count mismatch says to pass ``heads=``
            / ``dst_heads=`` when no range was given).
    """
    sroles = [p.role for p in src.planes]
    droles = [p.role for p in dst.planes]
    if sorted(sroles) != sorted(droles) or len(set(sroles)) != len(sroles):
        raise TransferError(
            f"the source ({src_name}) records planes {'+'.join(sroles)} per token but the destination ({dst_name}) records "
            f"{'+'.join(droles)}; a copy pairs planes by role and both sides need the same ones"
        )
    by_role = {p.role: p for p in dst.planes}
    planes = []
    for ps in src.planes:
        pd = by_role[ps.role]
        if ps.num_heads != pd.num_heads:
            hint = (
                f"; pass heads=(start, stop) to take {pd.num_heads} of the source's heads (a tensor-parallel split, e.g. "
                f"heads=(0, {pd.num_heads})), or dst_heads=(start, stop) to fill {ps.num_heads} of the destination's heads "
                "(a merge)"
                if not ranges_given
                else ""
            )
            raise TransferError(
                f"plane {ps.role}: the source ({src_name}) moves {ps.num_heads} KV head(s) but the destination ({dst_name}) "
                f"takes {pd.num_heads}{hint}"
            )
        if ps.head_bytes != pd.head_bytes:
            raise TransferError(
                f"plane {ps.role}: a source head is {ps.head_bytes} bytes ({src_name}, {_dt(ps.dtype)}) but a destination head "
                f"is {pd.head_bytes} bytes ({dst_name}, {_dt(pd.dtype)}); head sizes must match"
            )
        if ps.dtype != pd.dtype:
            raise TransferError(
                f"plane {ps.role}: the source ({src_name}) holds {_dt(ps.dtype)} but the destination ({dst_name}) holds "
                f"{_dt(pd.dtype)}; bytes move unchanged, so the dtypes must match"
            )
        planes.append(pd)
    if [p.role for p in planes] == droles:
        return dst
    # reorder the planes (and keep the buffers: staging is irrelevant to a copy)
    from dataclasses import replace

    return replace(dst, planes=tuple(planes))


def _check_slots(layout: KVLayout, slots, what: str, check_duplicates: bool) -> torch.Tensor:
    """The slots as a validated int64 ``[T]`` CPU tensor, -1 for padding. Slots on a device
    are read back once (one synchronisation) and checked on the host.

    Raises:
        TransferError: not a 1-D integer tensor, a slot past the cache's slots, or (for a
            destination) a slot that appears twice.
    """
    s = _index_tensor(slots, what)
    if s.dim() != 1:
        raise TransferError(f"{what} must be 1-D [T], got shape {tuple(s.shape)}")
    s = s.to(device="cpu", dtype=torch.int64)
    n = layout.page_buffer_size
    if s.numel():
        hi = int(s.max())
        if hi >= n:
            i = int(torch.nonzero(s >= n)[0])
            raise TransferError(
                f"{what}[{i}] = {int(s[i])} is out of range: {layout.format.name} has {n} slots per layer "
                f"(valid 0..{n - 1}; negative slots are padding and are skipped)"
            )
    if check_duplicates:
        valid = s[s >= 0]
        if valid.numel() > 1:
            srt, _ = torch.sort(valid)
            same = srt[1:] == srt[:-1]
            if bool(same.any()):
                dup = int(srt[1:][same][0])
                rows = torch.nonzero(s == dup).flatten().tolist()[:4]
                raise TransferError(
                    f"destination slot {dup} appears more than once in {what} (rows {rows}); overlapping destination slots "
                    "would be written twice"
                )
    return torch.where(s < 0, torch.full_like(s, -1), s)


def _check_device(layout: KVLayout, what: str) -> None:
    if layout.device.type == "meta":
        raise TransferError(
            f"the {what} layout describes tensors on the meta device (shapes without memory): it can be described but not moved"
        )


def _layer_lists(src: KVLayout, dst: KVLayout, layers, dst_layers) -> tuple[list[int], list[int]]:
    ssel = _layers(src, layers)
    if dst_layers is None:
        if layers is None:
            dsel = list(range(dst.num_layers))
        else:
            bad = [i for i in ssel if i >= dst.num_layers]
            if bad:
                raise TransferError(
                    f"layers={ssel} names layer {bad[0]}, but the destination has {dst.num_layers} layers; pass dst_layers= "
                    "(the destination layers the selected source layers land in, in order)"
                )
            dsel = list(ssel)
    else:
        try:
            dsel = _layers(dst, dst_layers)
        except TransferError as e:
            raise TransferError(f"dst_layers: {e}") from None
    if len(ssel) != len(dsel):
        raise TransferError(
            f"the copy moves {len(ssel)} source layer(s) into {len(dsel)} destination layer(s) "
            f"(source {src.format.name} has {src.num_layers}, destination {dst.format.name} has {dst.num_layers}); "
            "select equal numbers with layers= and dst_layers="
        )
    # destination layers that are one memory (layout.aliases: KV-sharing layers) are written
    # once, from the source layer paired with the first of them (as kvcore.scatter does):
    # two writes of one memory from different source layers would race
    seen, keep = set(), []
    for i, d in enumerate(dsel):
        mem = dst.layer_map[d]
        if mem not in seen:
            seen.add(mem)
            keep.append(i)
    if len(keep) != len(dsel):
        ssel, dsel = [ssel[i] for i in keep], [dsel[i] for i in keep]
    return ssel, dsel


_PAIRS: OrderedDict[tuple, tuple[weakref.ref, weakref.ref, StrideTable, StrideTable, Overlap]] = OrderedDict()
_MAX_PAIRS = 64
_PAIRS_LOCK = threading.Lock()


def _fresh(table: StrideTable) -> bool:
    t, _ = table.planes[0].bases[0]
    return t.untyped_storage().nbytes() > 0


def _tables(src: KVLayout, dst: KVLayout, ssel, dsel, heads, dst_heads) -> tuple[StrideTable, StrideTable, Overlap]:
    """The two tables of a copy (layers selected, head ranges applied, planes paired) and
    how they share memory (:class:`Overlap`); cached per (layouts, selection)."""
    key = (id(src), id(dst), tuple(ssel), tuple(dsel), heads, dst_heads)
    with _PAIRS_LOCK:
        hit = _PAIRS.get(key)
        if hit is not None and hit[0]() is src and hit[1]() is dst:
            _PAIRS.move_to_end(key)
    if hit is not None and hit[0]() is src and hit[1]() is dst and _fresh(hit[2]) and _fresh(hit[3]):
        return hit[2], hit[3], hit[4]
    st_full = src.stride_table(None if ssel == list(range(src.num_layers)) else ssel)
    dt_full = dst.stride_table(None if dsel == list(range(dst.num_layers)) else dsel)
    st = _select(st_full, heads, "heads")
    dt = _select(dt_full, dst_heads, "dst_heads")
    dt = pair_tables(st, dt, src.format.name, dst.format.name, ranges_given=heads is not None or dst_heads is not None)
    check_tables(st, dt)  # a freed or replaced storage: refused here, before its addresses are read
    ov = overlap(st, dt, st_full, dt_full, (heads or (0, 0))[0], (dst_heads or (0, 0))[0])
    with _PAIRS_LOCK:
        _PAIRS[key] = (weakref.ref(src), weakref.ref(dst), st, dt, ov)
        while len(_PAIRS) > _MAX_PAIRS:
            _PAIRS.popitem(last=False)
    return st, dt, ov


def _exec_device(src: KVLayout, dst: KVLayout) -> torch.device:
    a, b = src.device, dst.device
    if a.type != "cpu" and b.type != "cpu" and a != b:
        raise TransferError(
            f"the source is on {a} and the destination on {b}: kvcore.copy moves within one device or between a device and "
            "host memory; between two GPUs use kvcore.send / kvcore.recv"
        )
    return a if a.type != "cpu" else b


# -- memory shared by the source and the destination ---------------------------------------


@dataclass(frozen=True)
class Overlap:
    """How the bytes a copy may read meet the bytes it may write (source and destination
    over one memory: one cache, two layouts of one cache, overlapping caches).

    Attributes:
        mode: ``"none"``: no source (layer, plane) region shares a byte with a destination
            one (or only a region read through disjoint head ranges): nothing to check.
            ``"slots"``: every shared region is the same memory read the same way on both
            sides (same base, strides, block size, heads and width: one cache, or two
            layouts of it), so a row's bytes are read and another row's written exactly
            when a slot is both a source and a destination slot; the slot values are
            compared (on a GPU by the device check). ``"bytes"``: the sides read shared
            memory differently (another block size, NHD vs HND, a cache and a view of part
            of it...): the byte ranges of the rows are compared on the host.
        pairs: ``(src layer, src plane, dst layer, dst plane)`` (table indices) of the
            region pairs whose byte ranges meet (``"bytes"``: the ones to compare).
    """

    mode: str
    pairs: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def shared(self) -> bool:
        return self.mode != "none"


def _hulls(table: StrideTable) -> list[tuple[str, int, int, int, int]]:
    """``(device, first byte, one past the last, layer, plane)`` of every (layer, plane) region."""
    out = []
    for pi, p in enumerate(table.planes):
        span = plane_span(table, p)
        if not span:
            continue
        for li, (t, off) in enumerate(p.bases):
            if t.device.type == "meta":
                continue
            lo = t.untyped_storage().data_ptr() + off
            out.append((str(t.device), lo, lo + span, li, pi))
    return out


def overlap(st: StrideTable, dt: StrideTable, st_full: StrideTable, dt_full: StrideTable, h0s: int, h0d: int) -> Overlap:
    """How a copy's two tables share memory (see :class:`Overlap`). ``st``/``dt`` are the
    tables the copy moves (head ranges applied, ``dt`` paired with ``st``); ``*_full`` the
    same layers before the head ranges; ``h0s``/``h0d`` the first selected head of each side."""
    hs, hd = _hulls(st), _hulls(dt)
    if not hs or not hd:
        return Overlap("none")
    meet = []
    for dev in {h[0] for h in hs} & {h[0] for h in hd}:
        a = [h for h in hs if h[0] == dev]
        b = [h for h in hd if h[0] == dev]
        alo, ahi = torch.tensor([h[1] for h in a]), torch.tensor([h[2] for h in a])
        blo, bhi = torch.tensor([h[1] for h in b]), torch.tensor([h[2] for h in b])
        m = (alo[:, None] < bhi[None, :]) & (blo[None, :] < ahi[:, None])
        for i, j in torch.nonzero(m).tolist():
            meet.append((a[i][3], a[i][4], b[j][3], b[j][4]))
    if not meet:
        return Overlap("none")
    fs = {p.role: p for p in st_full.planes}
    fd = {p.role: p for p in dt_full.planes}
    same_reading, pairs = True, []
    for ls, ps_i, ld, pd_i in meet:
        ps, pd = st.planes[ps_i], dt.planes[pd_i]
        qs, qd = fs[ps.role], fd[pd.role]
        (ts, os_), (td, od) = qs.bases[ls], qd.bases[ld]
        identical = (
            st_full.block_size == dt_full.block_size
            and qs.strides == qd.strides
            and qs.num_heads == qd.num_heads
            and qs.head_bytes == qd.head_bytes
            and ts.untyped_storage().data_ptr() + os_ == td.untyped_storage().data_ptr() + od
        )
        if identical and not (h0s < h0d + pd.num_heads and h0d < h0s + ps.num_heads):
            continue  # one memory read the same way, through disjoint head ranges: no byte in common
        same_reading = same_reading and identical
        pairs.append((ls, ps_i, ld, pd_i))
    if not pairs:
        return Overlap("none")
    return Overlap("slots" if same_reading else "bytes", tuple(pairs))


_MAX_RUNS = 1 << 22  # byte runs compared exactly per side; more: the rows are taken to overlap (refused)


def _row_addrs(table: StrideTable, p, li: int, slots: torch.Tensor) -> torch.Tensor:
    """Absolute address of each slot's row start (head 0, chunk 0) in plane ``p``, layer ``li``."""
    t, off = p.bases[li]
    bs = table.block_size
    blk = torch.div(slots, bs, rounding_mode="floor")
    o = slots - blk * bs
    s = p.strides
    if s.token_group and s.token_group < bs:
        tok = torch.div(o, s.token_group, rounding_mode="floor") * s.token_group_stride + (o % s.token_group) * s.token
    else:
        tok = o * s.token
    return t.untyped_storage().data_ptr() + off + blk * s.block + tok


def _pattern(p) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte runs of one row of plane ``p`` relative to its start: (offsets, lengths),
    sorted, adjacent runs merged."""
    s = p.strides
    if p.row_contiguous:
        return torch.tensor([0]), torch.tensor([p.num_heads * p.head_bytes])
    h, c, j = torch.meshgrid(torch.arange(p.num_heads), torch.arange(s.n_chunks), torch.arange(s.n_sub), indexing="ij")
    offs, _ = torch.sort((h * s.head + c * s.chunk + j * s.sub).flatten())
    ends = offs + s.chunk_bytes
    keep = torch.ones_like(offs, dtype=torch.bool)
    keep[1:] = offs[1:] != ends[:-1]  # a run starting where the previous ended continues it
    starts = offs[keep]
    group = torch.cumsum(keep.long(), 0) - 1
    run_end = torch.zeros_like(starts).scatter_reduce(0, group, ends, reduce="amax", include_self=False)
    return starts, run_end - starts


def _meets(a0: torch.Tensor, a1: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
    """For each interval ``[a0, a1)``: whether it meets any interval ``[b0, b1)``."""
    if not b0.numel() or not a0.numel():
        return torch.zeros(a0.shape, dtype=torch.bool)
    order = torch.argsort(b0)
    starts = b0[order]
    reach = torch.cummax(b1[order], 0).values
    idx = torch.searchsorted(starts, a1) - 1  # the last interval starting before a1 ends ...
    return (idx >= 0) & (reach[idx.clamp(min=0)] > a0)  # ... past a0 for some interval up to it


def _hull_runs(table: StrideTable, regions, slots: torch.Tensor, rows: torch.Tensor):
    """One hull per (row, region): ``(starts, ends, row, region index)``, int64 ``[n]``."""
    out = ([], [], [], [])
    for k, (li, pi) in enumerate(regions):
        p = table.planes[pi]
        offs, lens = _pattern(p)
        addr = _row_addrs(table, p, li, slots[rows])
        for acc, v in zip(out, (addr, addr + int((offs + lens).max()), rows, torch.full_like(rows, k))):
            acc.append(v)
    return tuple(torch.cat(v) for v in out)


def _exact_runs(table: StrideTable, regions, starts: torch.Tensor, rows: torch.Tensor, reg: torch.Tensor):
    """Every byte run of the hulls (``starts``, ``rows``, ``reg``) selected: ``(starts, ends,
    row, region index)``."""
    out = ([], [], [], [])
    for k, (_, pi) in enumerate(regions):
        m = reg == k
        if not bool(m.any()):
            continue
        offs, lens = _pattern(table.planes[pi])
        a0 = (starts[m][:, None] + offs[None, :]).reshape(-1)
        for acc, v in zip(out, (a0, a0 + lens.repeat(int(m.sum())), rows[m].repeat_interleave(offs.numel()), torch.full_like(a0, k))):
            acc.append(v)
    return tuple(torch.cat(v) for v in out)


def _run_count(table: StrideTable, regions, reg: torch.Tensor) -> int:
    counts = torch.bincount(reg, minlength=len(regions)).tolist()
    return sum(c * _pattern(table.planes[pi])[0].numel() for c, (_, pi) in zip(counts, regions))


def byte_overlap(st: StrideTable, dt: StrideTable, ov: Overlap, ss: torch.Tensor, ds: torch.Tensor) -> tuple | None:
    """A source row whose bytes meet a destination row's bytes (the first found), or None.

    ``ss``/``ds``: validated CPU int64 ``[T]`` slots, -1 on both sides where a row is
    skipped. Exact (byte runs, heads, chunks and token groups included): every row's hull
    in every region of ``ov.pairs`` is compared first (one sort per side); only the hulls
    that meet are compared run by run. When those hulls hold more than ``_MAX_RUNS`` runs
    on a side (rows of two different readings interleaving at element granularity), the
    rows are taken to overlap, as NumPy does when proving memory disjoint is too much work:
    a refusal, never a wrong copy. Returns ``(row read, row written, (src layer, src
    plane), (dst layer, dst plane), exact)`` (table indices; ``exact`` False for such a
    presumed overlap)."""
    rows = torch.nonzero(ss >= 0).flatten()
    if not rows.numel() or not ov.pairs:
        return None
    sreg = sorted({(ls, pi) for ls, pi, _, _ in ov.pairs})
    dreg = sorted({(ld, pj) for _, _, ld, pj in ov.pairs})
    a0, a1, ar, ak = _hull_runs(st, sreg, ss, rows)
    b0, b1, br, bk = _hull_runs(dt, dreg, ds, rows)
    ca = _meets(a0, a1, b0, b1)
    if not bool(ca.any()):
        return None
    cb = _meets(b0, b1, a0, a1)
    a0, a1, ar, ak = a0[ca], a1[ca], ar[ca], ak[ca]
    b0, b1, br, bk = b0[cb], b1[cb], br[cb], bk[cb]
    if _run_count(st, sreg, ak) > _MAX_RUNS or _run_count(dt, dreg, bk) > _MAX_RUNS:
        j = int(torch.nonzero((b0 < a1[0]) & (b1 > a0[0]))[0])
        return int(ar[0]), int(br[j]), sreg[int(ak[0])], dreg[int(bk[j])], False
    r0, r1, rr, rk = _exact_runs(st, sreg, a0, ar, ak)
    w0, w1, wr, wk = _exact_runs(dt, dreg, b0, br, bk)
    hit = _meets(r0, r1, w0, w1)
    if not bool(hit.any()):
        return None
    i = int(torch.nonzero(hit)[0])
    j = int(torch.nonzero((w0 < r1[i]) & (w1 > r0[i]))[0])
    return int(rr[i]), int(wr[j]), sreg[int(rk[i])], dreg[int(wk[j])], True


def plan_copy(
    src_layout: KVLayout,
    src_slots,
    dst_layout: KVLayout,
    dst_slots,
    *,
    heads=None,
    dst_heads=None,
    layers: Sequence[int] | int | None = None,
    dst_layers: Sequence[int] | int | None = None,
) -> CopyPlan:
    """Validate a copy and return its :class:`CopyPlan` (what :func:`copy` runs). Arguments
    as :func:`copy`.

    Raises:
        TransferError: see :func:`copy`.
    """
    for lay, what in ((src_layout, "source"), (dst_layout, "destination")):
        if not isinstance(lay, KVLayout):
            raise TransferError(f"the {what} must be a KVLayout (from kvcore.detect), got {type(lay).__name__}")
        _check_device(lay, what)
    dev = _exec_device(src_layout, dst_layout)
    heads = head_range(heads, "heads", src_layout)
    dst_heads = head_range(dst_heads, "dst_heads", dst_layout)
    ssel, dsel = _layer_lists(src_layout, dst_layout, layers, dst_layers)
    st, dt, ov = _tables(src_layout, dst_layout, ssel, dsel, heads, dst_heads)
    check_tables(st, dt)
    ss = _check_slots(src_layout, src_slots, "src_slots", False)
    ds = _check_slots(dst_layout, dst_slots, "dst_slots", True)
    if ss.numel() != ds.numel():
        raise TransferError(f"src_slots has {ss.numel()} rows but dst_slots has {ds.numel()}; row i moves src_slots[i] to dst_slots[i]")
    valid = (ss >= 0) & (ds >= 0)
    ss = torch.where(valid, ss, torch.full_like(ss, -1))
    ds = torch.where(valid, ds, torch.full_like(ds, -1))
    nv = int(valid.sum()) if ss.numel() else 0
    if nv and ov.mode == "slots":
        both = torch.isin(ss, ds) & valid
        if bool(both.any()):
            i = int(torch.nonzero(both)[0])
            s = int(ss[i])
            j = int(torch.nonzero(ds == s)[0])
            raise TransferError(
                f"the source and destination share memory and slot {s} is both read and written (read by row {i}, written by "
                f"row {j}); copy within one cache needs disjoint source and destination slots (a copy never reads what it "
                "writes: split it into calls whose slots do not meet, or go through a staging buffer: kvcore.gather, then "
                "kvcore.scatter)"
            )
    elif nv and ov.mode == "bytes":
        hit = byte_overlap(st, dt, ov, ss, ds)
        if hit is not None:
            i, j, (ls, pi), (ld, pj), exact = hit
            where = (
                f"row {i} reads source slot {int(ss[i])} (layer {ssel[ls]}, plane {st.planes[pi].role}) and row {j} writes "
                f"destination slot {int(ds[j])} (layer {dsel[ld]}, plane {dt.planes[pj].role})"
            )
            how = (
                f"{where} over the same bytes"
                if exact
                else f"the rows' byte ranges interleave (e.g. {where}) in more than {_MAX_RUNS} byte runs, too many to prove "
                "them disjoint run by run, so they are taken to overlap"
            )
            raise TransferError(
                f"the source and destination share memory and the copy would read bytes it writes: {how} "
                f"({src_layout.format.name} and {dst_layout.format.name} read one memory differently); nothing was moved. A "
                "copy never reads what it writes: split it into calls whose rows do not meet (smaller calls), or go through a "
                "staging buffer (kvcore.gather, then kvcore.scatter)"
            )
    return CopyPlan(src=st, dst=dt, src_slots=ss.to(dev), dst_slots=ds.to(dev), num_valid=nv)


_Tensor = torch.Tensor
_INT64 = torch.int64
_VALIDATE = {"device": 1, "sync": 2, "none": 0}
_MAX_PLANS_PER_LAYOUT = 64
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _forced() -> tuple:
    if _ENV_DATA is not None:
        return (_ENV_DATA.get(b"KVCORE_COPY_KERNEL"), _ENV_DATA.get(b"KVCORE_KERNEL"))
    return (os.environ.get("KVCORE_COPY_KERNEL"), os.environ.get("KVCORE_KERNEL"))


class CopyLayoutPlan:
    """The per-call work of :func:`copy` done once per (source, destination, heads, layers):
    the layouts checked, the layer selections and head ranges applied, the planes paired,
    the kernel chosen and (native kernels) the op's prepared plan built, which re-checks
    the caches' storages and validates the slots on every call. :func:`copy` keeps one per
    (source layout, destination layout, arguments).

    Raises:
        TransferError: as :func:`copy`, for everything but the slot mappings.
    """

    def __init__(self, src_layout, dst_layout, heads=None, dst_heads=None, layers=None, dst_layers=None):
        for lay, what in ((src_layout, "source"), (dst_layout, "destination")):
            if not isinstance(lay, KVLayout):
                raise TransferError(f"the {what} must be a KVLayout (from kvcore.detect), got {type(lay).__name__}")
            _check_device(lay, what)
        self.device = _exec_device(src_layout, dst_layout)
        self._cuda = self.device.type == "cuda"
        self.heads = head_range(heads, "heads", src_layout)
        self.dst_heads = head_range(dst_heads, "dst_heads", dst_layout)
        self.layers, self.dst_layers = layers, dst_layers
        ssel, dsel = _layer_lists(src_layout, dst_layout, layers, dst_layers)
        self.src, self.dst, self.overlap = _tables(src_layout, dst_layout, ssel, dsel, self.heads, self.dst_heads)
        self.shared = self.overlap.shared
        self.src_layout = src_layout
        self._dst_ref = weakref.ref(dst_layout)
        empty = torch.empty(0, dtype=torch.int64)
        self.kernel = select_copy_kernel(CopyPlan(src=self.src, dst=self.dst, src_slots=empty, dst_slots=empty, num_valid=0))
        self._native = None

        if self.kernel is NATIVE_CPU_COPY or self.kernel is NATIVE_CUDA_COPY:
            # the op compares slot values when one memory is read the same way on both sides; any
            # other sharing is compared byte by byte on the host (run)
            self._native = prepare_native(self.src, self.dst, self.overlap.mode == "slots")

    def run(self, src_slots, dst_slots, validate: str | None = None) -> None:
        """Copy the rows (see :func:`copy`); ``validate`` as :func:`kvcore.gather`."""
        nat = self._native
        if nat is None:
            if validate is not None:
                _validate(validate)
            self._generic(src_slots, dst_slots)
            return
        ss, ds = src_slots, dst_slots
        cuda = self._cuda
        # the op reads the slot tensors' bytes: anything whose bytes are not its values (torch's
        # lazy negation bit, sparse, nested) goes through _index_tensor first
        if ss.__class__ is not _Tensor or ss.dtype is not _INT64 or ss.is_cuda is not cuda or not _dense(ss):
            ss = self._slots_in(ss, "src_slots")
        if ds.__class__ is not _Tensor or ds.dtype is not _INT64 or ds.is_cuda is not cuda or not _dense(ds):
            ds = self._slots_in(ds, "dst_slots")
        v = 1 if validate is None else _validate(validate)
        if self.overlap.mode == "bytes" and (v or not cuda):
            self._host_checked(src_slots, dst_slots)
        rc = nat.run(ss, ds, v)
        if rc:
            self._failed(rc, src_slots, dst_slots)

    def _host_checked(self, src_slots, dst_slots) -> None:
        """Every check of :func:`plan_copy` on the host, the byte-range comparison of
        memory shared differently by the two sides included (on a GPU: one read-back of
        the slots, so not while a CUDA graph is being captured)."""
        if self._cuda and torch.cuda.is_current_stream_capturing():
            raise TransferError(
                "kvcore.copy: the source and destination read one memory differently, so the rows' byte ranges are compared "
                "on the host before the copy, which cannot be captured in a CUDA graph; capture with validate='none' (the "
                "overlap is then not checked) or copy between layouts that do not share memory"
            )
        self._plan(src_slots, dst_slots)

    def _slots_in(self, slots, what: str) -> torch.Tensor:
        s = _index_tensor(slots, what)
        if s.dim() != 1:
            raise TransferError(f"{what} must be 1-D [T], got shape {tuple(s.shape)}")
        return s.to(device=self.device, dtype=torch.int64).contiguous()

    def _generic(self, src_slots, dst_slots) -> None:
        plan = self._plan(src_slots, dst_slots)
        if plan.num_valid:
            self.kernel.copy(plan)

    def _plan(self, src_slots, dst_slots) -> CopyPlan:
        dst = self._dst_ref()
        return plan_copy(
            self.src_layout,
            src_slots,
            dst,
            dst_slots,
            heads=self.heads,
            dst_heads=self.dst_heads,
            layers=self.layers,
            dst_layers=self.dst_layers,
        )

    def _failed(self, rc: int, src_slots, dst_slots) -> None:
        """The op refused before moving a byte: raise the Python layer's message for the
        same input (host checks, worded as every kvcore error) or the op's own."""

        msg = _build.MODULE.copy_last_error()
        if rc == RC_REFUSED:
            self._plan(src_slots, dst_slots)  # raises the canonical message for a host-visible refusal
        raise TransferError(msg)


def _validate(validate) -> int:
    v = _VALIDATE.get(validate) if isinstance(validate, str) else None
    if v is None:
        raise TransferError(f"validate must be one of 'device', 'sync', 'none' (or None for the default), got {validate!r}")
    return v


def _layers_key(layers):
    if layers is None or layers.__class__ is int:
        return layers
    if isinstance(layers, (list, tuple, range)):
        return ("L", *layers)
    return _UNCACHED


_UNCACHED = object()


def _copy_plan(src_layout, dst_layout, heads, dst_heads, layers, dst_layers) -> CopyLayoutPlan:
    """The cached plan of :func:`copy` for these arguments (built on first use)."""
    try:
        cache = src_layout._kvcore_copy_plans
    except AttributeError:
        if not isinstance(src_layout, KVLayout):
            return CopyLayoutPlan(src_layout, dst_layout, heads, dst_heads, layers, dst_layers)
        cache = src_layout._kvcore_copy_plans = {}
    lk, dk = _layers_key(layers), _layers_key(dst_layers)
    if lk is _UNCACHED or dk is _UNCACHED:
        return CopyLayoutPlan(src_layout, dst_layout, heads, dst_heads, layers, dst_layers)
    try:
        key = (id(dst_layout), heads, dst_heads, lk, dk, _forced())
        p = cache.get(key)
    except TypeError:  # unhashable head ranges: validated (and refused or used) uncached
        return CopyLayoutPlan(src_layout, dst_layout, heads, dst_heads, layers, dst_layers)
    if p is None or p._dst_ref() is not dst_layout:
        p = CopyLayoutPlan(src_layout, dst_layout, heads, dst_heads, layers, dst_layers)
        if len(cache) >= _MAX_PLANS_PER_LAYOUT:
            cache.clear()
        cache[key] = p
    return p


def copy(
    src_layout: KVLayout,
    src_slots,
    dst_layout: KVLayout,
    dst_slots,
    *,
    heads=None,
    dst_heads=None,
    layers: Sequence[int] | int | None = None,
    dst_layers: Sequence[int] | int | None = None,
    validate: str | None = None,
) -> None:
    """Copy token rows from one detected cache into another, converting the layout on the way.

    Row ``i`` moves every selected layer's K and V (MLA: the latent; multi-plane records:
    every plane, paired by role) of source slot ``src_slots[i]`` into destination slot
    ``dst_slots[i]``. One pass, no staging buffer; on a GPU one kernel launch for all
    layers and planes. The layouts, head ranges and layer selections are checked once per
    (source, destination, arguments) and the prepared plan is kept (:class:`CopyLayoutPlan`);
    each call then checks its slot mappings and launches.

    Args:
        src_layout, dst_layout: from :func:`kvcore.detect`; any two layouts whose token rows
            hold the same planes of the same dtype (NHD/HND, block sizes, pool sizes, packed
            or separate K/V, per-layer or cross-layer all differ freely). Same device, or a
            GPU and host memory (pinned host memory is read or written in place by the GPU;
            pageable host memory goes through a temporary of the moved rows).
        src_slots, dst_slots: int64 ``[T]`` slot mappings (``block * block_size + offset``)
            of equal length, on the device that runs the copy (the GPU when either cache is
            on one; others are moved there). A negative slot on either side is padding: that
            row is skipped and the destination row left as it was.
        heads: ``(start, stop)``: copy only source KV heads ``start..stop-1`` (TP split).
        dst_heads: ``(start, stop)``: land the rows in destination heads ``start..stop-1``
            (TP merge). Without either, both sides must have the same head count.
        layers: source layer indices (default: all), in the order they pair with the
            destination's layers.
        dst_layers: destination layer indices (default: the same indices as ``layers``, or
            all layers when ``layers`` is None); as many as the source layers. A destination
            layer that is the same memory as an earlier one of the selection
            (``dst_layout.aliases``: KV-sharing layers) is written once, from the source
            layer paired with the first of them (as :func:`kvcore.scatter`).
        validate: ``"device"`` (default), ``"sync"`` or ``"none"``, as for
            :func:`kvcore.gather` (:mod:`kvcore.layout_plan`): on a GPU with ``"device"`` the slot
            values are checked on the device, in a one-block kernel before the copy on the
            same stream; the host never waits. A refused copy writes nothing, and its
            :class:`~kvcore.TransferError` is raised by the next kvcore CUDA call or
            :func:`kvcore.synchronize`. ``"sync"`` waits and raises before returning;
            ``"none"`` skips the value checks (slots out of range are still skipped, a
            repeated destination slot is written twice in an unspecified order, rows that
            read what others write are not looked for). On the CPU, and for the reference
            and plugin kernels, slots are checked before the copy whatever ``validate``
            says. Source and destination that read one memory differently (see below) are
            checked on the host: on a GPU one read-back of the slots, and such a copy cannot
            be captured in a CUDA graph unless ``validate="none"``.

    One memory on both sides: a copy never reads a byte it writes. Any source row whose
    bytes (any selected layer, plane, head) meet a destination row's bytes is refused
    before any byte moves, the message naming both rows and slots: within one cache (or
    two layouts reading one memory the same way) a slot that is both a source and a
    destination slot (unless the head ranges are disjoint); between two readings of one
    memory (another block size, NHD and HND, a cache and a view of part of it) the rows'
    byte runs, exactly (rows interleaving in more than 4M byte runs a side are taken to
    overlap: refused, saying so). Split such a copy into calls whose rows do not meet, or go through a staging
    buffer (:func:`kvcore.gather`, then :func:`kvcore.scatter`). Copies from several threads
    into disjoint destination slots are safe.

    Raises:
        TransferError: before any byte moves, for: a slot out of range on either side; a
            destination slot that appears twice; slot mappings of different lengths;
            head counts that differ without ``heads=``/``dst_heads=``; a head range past
            a side's heads (an MLA latent has one head: it is copied whole); planes of
            different roles, head widths or dtypes (naming both sides); different layer
            counts; two different GPUs (use :func:`kvcore.send`); a meta-device layout;
            rows that read bytes the copy writes (above); a cache storage freed,
            reallocated, resized or replaced since detection, a cache tensor reshaped in
            place (``resize_``, ``as_strided_``, ``set_``), or the caller's tensor that a
            layout's view was made from re-pointed to other memory (naming the side,
            layer and plane: detect again). On a GPU with ``validate="device"`` a bad slot
            value is found on the device: nothing is written and the error is raised
            later (above).
    """
    _copy_plan(src_layout, dst_layout, heads, dst_heads, layers, dst_layers).run(src_slots, dst_slots, validate)
