"""Semantic checks, per fixture, kernel and device: the kernel moves exactly the elements the
engine's own view addresses.

* ``semantic_gather`` / ``semantic_scatter``: shuffled slots with padding, layer subsets,
  whole blocks; a scatter writes nothing the engine's view does not cover.
  ``semantic_gather[PROBE]``: the gather of an answer to a look-alike geometry (the
  detection family's probes) moves the bytes the engine's view says.
* ``negative_slots``: all-padding mappings and ``skip_prefix``.
* ``empty_slots``: an empty mapping is a no-op.
* ``padded_pool``: the same on a pool whose block axis is padded.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.testing.checks.common import (
    _compare,
    _esize,
    _expect_gather,
    _seed,
    _sentinel_like,
    _slots,
    _staged,
    _widest,
    forced_kernel,
)
from kvcore.testing.checks.context import _Ctx, _run_scatter
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure, CheckSkip
from kvcore.transfer import gather_blocks, slots_for_blocks


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
