"""The aliasing proofs: no two addresses of one plane, and no two (layer, plane) regions
of a stride table, share a byte (a scatter to one would overwrite the other).

:func:`_check_no_alias` proves one tensor's axes nest (each axis steps past everything
inside it); :func:`_check_disjoint` proves the regions of a :class:`~kvcore.strides.StrideTable`
disjoint, solving the bounded integer equation of two strided regions exactly
(:func:`_meet`) within a budget, and refusing when undecided. Both raise
:class:`~kvcore.GeometryError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcore.errors import GeometryError
from kvcore.strides import StrideTable


def _describe_tensor(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)} stride={tuple(t.stride())} dtype={t.dtype}"


def _check_no_alias(name: str, extents: list[tuple[str, int, int]], inner_bytes: int, ref: torch.Tensor) -> None:
    """Axes (size, byte stride) of one tensor must nest without overlap: sorted by stride,
    each stride must step over everything inside it."""
    axes = sorted([(s, n, a) for (a, n, s) in extents if n > 1], key=lambda x: x[0])
    extent = inner_bytes
    inner_name = "one element run"
    for stride, n, axis in axes:
        if stride < extent:
            raise GeometryError(
                f"format {name}: axis {axis} steps {stride} bytes but {inner_name} inside it spans {extent} bytes, so two "
                f"addresses alias ({_describe_tensor(ref)}); these strides are not this format's layout"
            )
        extent = stride * (n - 1) + extent
        inner_name = f"the {axis} axis"


# -- (layer, plane) regions must not share a byte ---------------------------------------

_MEET_BUDGET = 200_000


@dataclass(frozen=True)
class _Region:
    key: Any  # the address space: a device, or one meta storage
    lo: int  # first byte
    hi: int  # one past the last byte
    axes: tuple[tuple[int, int], ...]  # (byte stride, count) of the index axes, count > 1
    run: int  # contiguous bytes at each index point
    layer: int
    role: str
    tensor: int  # id() of the tensor the region was read from


def _regions(table: StrideTable) -> list[_Region]:
    out = []
    bs = table.block_size
    nblocks = -(-table.num_slots // bs)
    last_tok = min(bs, table.num_slots) - 1
    for p in table.planes:
        s = p.strides
        axes = [(s.block, nblocks)]
        if s.token_group and s.token_group < bs:
            axes += [(s.token_group_stride, -(-bs // s.token_group)), (s.token, s.token_group)]
        else:
            axes.append((s.token, bs))
        axes += [(s.head, p.num_heads), (s.chunk, s.n_chunks), (s.sub, s.n_sub)]
        ax = tuple((abs(st), n) for st, n in axes if n > 1 and st != 0)
        span = (nblocks - 1) * s.block + s.max_token_offset(last_tok) + (p.num_heads - 1) * s.head + s.head_span
        for li, (t, off) in enumerate(p.bases):
            st = t.untyped_storage()
            if st.nbytes() == 0:
                continue
            if t.device.type == "meta":
                key, addr = ("meta", st._cdata), off
            else:
                key, addr = str(t.device), st.data_ptr() + off
            out.append(_Region(key, addr, addr + span, ax, s.chunk_bytes, li, p.role, id(t)))
    return out


def _meet(a: _Region, b: _Region, budget: list[int]) -> bool:
    """Whether ``a`` and ``b`` share a byte: is there ``sum(i_k * s_k) - sum(j_k * t_k) + u
    == b.lo - a.lo`` with every index in its range and ``u = r_a - r_b`` of the two runs?
    Axes of equal stride merge; a depth-first search over the axes, largest stride first,
    keeps only index values the remaining axes can still compensate (so nested layouts
    take one or two values per axis) and solves the last axis directly."""
    want = b.lo - a.lo
    merged: dict[int, list[int]] = {}
    for s, n in a.axes:
        r = merged.setdefault(s, [0, 0])
        r[1] += n - 1
    for s, n in b.axes:
        r = merged.setdefault(s, [0, 0])
        r[0] -= n - 1
    axes = sorted(((s, lo, hi) for s, (lo, hi) in merged.items()), reverse=True)
    u_lo, u_hi = -(b.run - 1), a.run - 1
    k = len(axes)
    mins, maxs = [0] * (k + 1), [0] * (k + 1)
    mins[k], maxs[k] = u_lo, u_hi
    for i in range(k - 1, -1, -1):
        s, lo, hi = axes[i]
        mins[i], maxs[i] = mins[i + 1] + lo * s, maxs[i + 1] + hi * s

    def rec(i: int, rem: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Undecided
        if rem < mins[i] or rem > maxs[i]:
            return False
        if i == k:
            return True
        s, lo, hi = axes[i]
        first = max(lo, -((maxs[i + 1] - rem) // s))  # ceil((rem - maxs) / s)
        last = min(hi, (rem - mins[i + 1]) // s)
        if i == k - 1:
            return first <= last
        return any(rec(i + 1, rem - x * s) for x in range(first, last + 1))

    return rec(0, want)


class _Undecided(Exception):
    pass


def _check_disjoint(name: str, table: StrideTable, proven: Any = None, one_tensor_proven: bool = False) -> None:
    """Raise GeometryError when two (layer, plane) regions of ``table`` share a byte (see
    :meth:`Spec._check_disjoint_planes`). ``proven(a, b)``: the pair was already proved
    disjoint by the spec's in-tensor alias check (regions of one tensor differing only along
    its own axes) and is skipped; ``one_tensor_proven``: every pair of one tensor was."""
    by_key: dict[Any, list[_Region]] = {}
    for r in _regions(table):
        by_key.setdefault(r.key, []).append(r)
    budget = [_MEET_BUDGET]
    memo: dict[tuple, bool] = {}

    for regions in by_key.values():
        if len(regions) < 2:
            continue
        if one_tensor_proven and len({r.tensor for r in regions}) == 1:
            continue  # one tensor whose every axis the spec checked
        regions.sort(key=lambda r: (r.lo, r.hi))
        active: list[_Region] = []
        for r in regions:
            active = [a for a in active if a.hi > r.lo]
            for a in active:
                if proven is not None and proven(a, r):
                    continue
                mk = (a.axes, a.run, r.axes, r.run, r.lo - a.lo)
                hit = memo.get(mk)
                if hit is None:
                    try:
                        hit = memo[mk] = _meet(a, r, budget)
                    except _Undecided:
                        raise GeometryError(
                            f"format {name}: could not decide whether layer {a.layer} {a.role} and layer {r.layer} {r.role} share "
                            "memory (their strides interleave too finely to check); kvcore refuses rather than risk a scatter "
                            "overwriting another plane"
                        ) from None
                if hit:
                    what = "start at the same address" if a.lo == r.lo else f"overlap ({r.lo - a.lo} bytes apart, their bytes interleave)"
                    raise GeometryError(
                        f"format {name}: layer {a.layer} {a.role} and layer {r.layer} {r.role} {what}, so they alias: a scatter to one "
                        "would overwrite the other (is one tensor registered twice, or do per-layer views of one buffer overlap?); "
                        "every (layer, plane) needs its own memory"
                    )
            active.append(r)
