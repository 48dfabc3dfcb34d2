"""The Triton program: one stride-table copy, gather or scatter (imports triton).

Kept apart from :mod:`kvcore_xpu.kernel` so that loading the plugin never imports
triton; :func:`jitted` builds the program the first time a transfer needs it, compiled
(XPU, CUDA) or for Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), as the
environment says at that moment.

The program knows nothing of formats. A launch moves the planes of one staging buffer
that share one *segment shape* (how many segments a token row has and how long each
is); its inputs (all addresses and strides in bytes):

- ``desc`` int64 ``[P, NFC]``, one row per plane of the launch (the fields are
  :data:`FIELDS`, padded to ``NFC``);
- ``bases`` int64 ``[NL, P]``: the address where each (layer, plane) starts;
- ``segs`` int64 ``[P, 2, n_segs]``: each segment's byte offset from its token's row,
  on the cache side (row 0: ``head * head_stride + chunk * chunk_stride``) and on the
  staging side (row 1), computed once per stride table;
- ``slots`` int64 ``[T]`` (negative: skip the row);
- the staging buffer's address and its byte strides over the K/V index, the layer and
  the token; the block size (and its log2 when it is a power of two).

A *segment* is the longest run contiguous on both sides: a whole token row of all heads
for NHD-like planes and MLA (one segment), one head for HND-like planes, one chunk for
chunked heads. The grid is ``(token tiles, (layer, plane) pairs)``; a program moves
``BLOCK_T`` tokens, each as a ``[NSEG, units]`` tile (``NSEG`` segments at a time), so
a per-head run layout (HND) moves as a 2-D tile of (token, head) runs whose contiguous
inner dimension is the run, and no address needs a division: the block and offset of a
slot are a shift and a mask (a division only for block sizes that are not powers of
two), the segment offsets come from ``segs``. A segment is covered by ``n_full`` pieces
of ``EA`` units and one masked piece of ``EB`` units (``EA``, ``EB`` powers of two; a
1152-byte MLA row is 128 + 16 units of 8 bytes). ``ALIGN`` (bytes) divides every
address and every run length the launch forms, and the row pointers are declared
multiples of it, so accesses are vectors of up to 16 bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the columns of ``desc`` (bytes unless said)
FIELDS = (
    "block",  # block stride
    "token",  # token stride inside a block (inside a token group when grouped)
    "token_group",  # tokens per group (block_size when the tokens are not grouped)
    "token_group_stride",  # bytes between token groups (0 when not grouped)
    "stage_index",  # the plane's index on the staging buffer's K/V axis (0 for a plane's own buffer)
    "stage_offset",  # the plane's byte offset inside a staged row
)


def _copy_rows(
    slots_ptr,
    T,
    bases_ptr,
    desc_ptr,
    segs_ptr,
    num_planes,
    pair0,
    stage_addr,
    s_index,
    s_layer,
    s_token,
    block_size,
    bs_shift,
    n_segs,
    seg_vecs,
    n_full,
    GATHER: tl.constexpr,
    UT: tl.constexpr,
    W: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NSEG: tl.constexpr,
    EA: tl.constexpr,
    EB: tl.constexpr,
    NFC: tl.constexpr,
    SEGS: tl.constexpr,
    BS_POW2: tl.constexpr,
    GROUPED: tl.constexpr,
):
    pair = pair0 + tl.program_id(1)
    layer = pair // num_planes
    j = pair - layer * num_planes
    d = desc_ptr + j * NFC
    blk_stride = tl.load(d + 0)
    tok_stride = tl.load(d + 1)
    s_idx = tl.load(d + 4)
    s_off = tl.load(d + 5)
    base = tl.load(bases_ptr + pair)
    # a segment is a whole number of ALIGN-byte vectors (the host checked): counting it
    # in vectors tells the compiler so, and the tail piece's mask stays constant over
    # whole vectors
    seg_units = seg_vecs * (ALIGN // W)

    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = t < T
    slot = tl.load(slots_ptr + t, mask=in_range, other=-1)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    if BS_POW2:
        blk = slot >> bs_shift
        o = slot & (block_size - 1)
    else:
        blk = slot // block_size
        o = slot - blk * block_size
    if GROUPED:  # the block's tokens split in groups (BSC/BSE)
        tg = tl.load(d + 2)
        g = o // tg
        tokoff = g * tl.load(d + 3) + (o - g * tg) * tok_stride
    else:
        tokoff = o * tok_stride
    crow = base + blk * blk_stride + tokoff
    srow = stage_addr + s_idx * s_index + layer.to(tl.int64) * s_layer + s_off + t.to(tl.int64) * s_token
    # the rows as pointers declared ALIGN-byte aligned: the hint goes on the pointers (it
    # does not survive an int -> pointer cast), and on 1-D values only (Triton folds a
    # tile of one element into a scalar and keeps the hint, whose rank must then fit)
    cp_row = tl.multiple_of(crow.to(tl.pointer_type(UT)), ALIGN)
    sp_row = tl.multiple_of(srow.to(tl.pointer_type(UT)), ALIGN)
    for s0 in range(0, n_segs, NSEG):  # one step unless a row has more than NSEG segments
        s = s0 + tl.arange(0, NSEG)
        sm = s < n_segs
        if SEGS:  # several segments per token row: a (token, segment) tile of runs
            sb = segs_ptr + j * 2 * n_segs
            coff = tl.multiple_of(tl.load(sb + s, mask=sm, other=0) // W, ALIGN // W)
            soff = tl.multiple_of(tl.load(sb + n_segs + s, mask=sm, other=0) // W, ALIGN // W)
            cp = cp_row[:, None, None] + coff[None, :, None]
            sp = sp_row[:, None, None] + soff[None, :, None]
        else:  # one segment per token row (NHD-like rows, MLA)
            cp = cp_row[:, None, None]
            sp = sp_row[:, None, None]
        m = (valid[:, None] & sm[None, :])[:, :, None]
        for i in range(0, n_full):  # whole pieces of EA units
            e = (i * EA + tl.arange(0, EA))[None, None, :]
            if GATHER:
                tl.store(sp + e, tl.load(cp + e, mask=m), mask=m)
            else:
                tl.store(cp + e, tl.load(sp + e, mask=m), mask=m)
        if EB > 0:  # the rest of the segment: a piece of EB units, masked
            e = (n_full * EA + tl.arange(0, EB))[None, None, :]
            me = m & (e < seg_units)
            if GATHER:
                tl.store(sp + e, tl.load(cp + e, mask=me), mask=me)
            else:
                tl.store(cp + e, tl.load(sp + e, mask=me), mask=me)


_DO_NOT_SPECIALIZE = (
    "T",
    "num_planes",
    "pair0",
    "stage_addr",
    "s_index",
    "s_layer",
    "s_token",
    "block_size",
    "bs_shift",
    "n_segs",
    "seg_vecs",
    "n_full",
)
_JITTED: dict[bool, object] = {}

UNIT_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


def jitted(interpret: bool):
    """The program, compiled for the device (``interpret`` False) or run by Triton's
    interpreter (True; ``TRITON_INTERPRET=1`` must be set while it is built and run)."""
    fn = _JITTED.get(interpret)
    if fn is None:
        fn = _JITTED[interpret] = triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)(_copy_rows)
    return fn
