"""The Triton program: one stride-table row copy, gather or scatter (imports triton).

Kept apart from :mod:`kvcore_xpu.kernel` so that loading the plugin never imports
triton; :func:`jitted` builds the program the first time a transfer needs it, compiled
(XPU, CUDA) or for Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), as the
environment says at that moment.

The program knows nothing of formats. Its inputs (all addresses and strides in bytes):

- ``desc`` int64 ``[P, NF]``, one row per plane staged into this launch's buffer (the
  fields are :data:`FIELDS`);
- ``bases`` int64 ``[NL, P]``: the address where each (layer, plane) starts;
- ``slots`` int64 ``[T]`` (negative: skip the row);
- the staging buffer's address and its byte strides over the K/V index, the layer and
  the token.

The work is split in *segments*: the longest runs that are contiguous on both sides (a
whole token row of all heads for NHD-like planes, one head for HND-like planes, one chunk
for chunked heads). Item ``r`` of a (layer, plane) is token ``r // n_segs``, segment
``r % n_segs``; a program moves ``BLOCK_R`` items, ``BLOCK_E`` units of ``W`` bytes at a
time. ``ALIGN`` (bytes) divides every address and segment length the launch computes, so
the compiler may use vector loads and stores of up to 16 bytes. Which address terms exist
(several segments per row, token groups, chunked heads) are compile-time constants: the
common layouts compile to a few integer operations per row.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the columns of ``desc`` (bytes unless said)
FIELDS = (
    "block",  # block stride
    "token",  # token stride inside a block (inside a token group when grouped)
    "token_group",  # tokens per group (block_size when the tokens are not grouped)
    "token_group_stride",  # bytes between token groups
    "head",  # cache-side head stride
    "chunk",  # cache-side chunk stride
    "n_chunks",  # chunks per head (1: a head is one run)
    "chunk_bytes",  # bytes of one chunk (staging-side step between chunks)
    "n_segs",  # segments per token row
    "seg_bytes",  # bytes of one segment
    "stage_index",  # the plane's index on the staging buffer's K/V axis (0 for a plane's own buffer)
    "stage_offset",  # the plane's byte offset inside a staged row
    "stage_head",  # staging-side head stride
)
NF = 16  # row width of ``desc`` (padded)


def _copy_rows(
    slots_ptr,
    T,
    bases_ptr,
    desc_ptr,
    num_planes,
    n_tiles,
    pair0,
    stage_addr,
    s_index,
    s_layer,
    s_token,
    block_size,
    GATHER: tl.constexpr,
    UT: tl.constexpr,
    W: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NFC: tl.constexpr,
    ONE_SEG: tl.constexpr,
    GROUPED: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    pair = pair0 + pid // n_tiles
    tile = pid % n_tiles
    layer = pair // num_planes
    j = pair % num_planes
    d = desc_ptr + j * NFC
    blk_stride = tl.load(d + 0)
    tok_stride = tl.load(d + 1)
    head = tl.load(d + 4)
    cb = tl.load(d + 7)
    s_idx = tl.load(d + 10)
    s_off = tl.load(d + 11)
    s_head = tl.load(d + 12)
    # every segment length is a multiple of ALIGN bytes (the host checked): say so, so
    # that the mask below stays constant over whole vectors
    seg_units = tl.multiple_of(tl.load(d + 9) // W, ALIGN // W)
    base = tl.load(bases_ptr + layer * num_planes + j)

    r = tile * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    if ONE_SEG:  # one segment per token row (NHD-like rows, MLA): item = token
        t = r
        h = r * 0
    else:
        n_segs = tl.load(d + 8)
        t = r // n_segs
        h = r - t * n_segs  # the segment; a head unless the heads are chunked
    in_range = t < T
    slot = tl.load(slots_ptr + t, mask=in_range, other=-1)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    o = slot - blk * block_size
    if GROUPED:  # the block's tokens split in groups (BSC/BSE)
        tg = tl.load(d + 2)
        g = o // tg
        tokoff = g * tl.load(d + 3) + (o - g * tg) * tok_stride
    else:
        tokoff = o * tok_stride
    cache_row = base + blk * blk_stride + tokoff
    stage_row = stage_addr + s_idx * s_index + layer * s_layer + t * s_token + s_off
    if CHUNKED:  # a head's run split in chunks strided apart (x-split K, transposed V)
        nc = tl.load(d + 6)
        s = h
        h = s // nc
        c = s - h * nc
        cache_row += h * head + c * tl.load(d + 5)
        stage_row += h * s_head + c * cb
    else:
        cache_row += h * head
        stage_row += h * s_head
    # rows past T or of skipped slots are masked; their addresses stay aligned (slot 0)
    stage_row = tl.where(in_range, stage_row, stage_addr)
    cache_row = tl.multiple_of(cache_row, ALIGN)
    stage_row = tl.multiple_of(stage_row, ALIGN)
    cp = cache_row.to(tl.pointer_type(UT))
    sp = stage_row.to(tl.pointer_type(UT))
    for e0 in range(0, seg_units, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        m = valid[:, None] & (e < seg_units)[None, :]
        if GATHER:
            v = tl.load(cp[:, None] + e[None, :], mask=m)
            tl.store(sp[:, None] + e[None, :], v, mask=m)
        else:
            v = tl.load(sp[:, None] + e[None, :], mask=m)
            tl.store(cp[:, None] + e[None, :], v, mask=m)


_DO_NOT_SPECIALIZE = ("T", "num_planes", "n_tiles", "pair0", "stage_addr", "s_index", "s_layer", "s_token", "block_size")
_JITTED: dict[bool, object] = {}

UNIT_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


def jitted(interpret: bool):
    """The program, compiled for the device (``interpret`` False) or run by Triton's
    interpreter (True; ``TRITON_INTERPRET=1`` must be set while it is built and run)."""
    fn = _JITTED.get(interpret)
    if fn is None:
        fn = _JITTED[interpret] = triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)(_copy_rows)
    return fn
