"""``staging_views``: valid but unusual staging buffers (row-strided, element-aligned offsets,
host and pinned host memory for device caches) move exactly or are refused cleanly."""

from __future__ import annotations

import math

import torch

from kvcore.errors import TransferError
from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _change_where,
    _compare,
    _expect_gather,
    _seed,
    _slots,
    _staged,
)
from kvcore.testing.checks.context import _Ctx, _run_scatter
from kvcore.testing.results import CheckFailure


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
