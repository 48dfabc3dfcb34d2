"""Raw-storage views the torch kernels (transfer and copy) index: one cache plane's rows as
fixed-width integers, so every dtype moves bit-exactly (NaN payloads, negative zero)."""

from __future__ import annotations

import torch

from kvcore.spec import Plane

#: integer dtype of each unit width in bytes
UNIT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def storage_units(t: torch.Tensor, w: int, cache: dict) -> torch.Tensor:
    """A 1-D view of ``t``'s whole storage as ``w``-byte integers (one per storage and width)."""
    st = t.untyped_storage()
    key = (t.device, st.data_ptr(), st.nbytes(), w)
    v = cache.get(key)
    if v is None:
        v = cache[key] = torch.empty(0, dtype=UNIT[w], device=t.device).set_(st, 0, (st.nbytes() // w,), (1,))
    return v


def cache_rows_view(p: Plane, t: torch.Tensor, off: int, nblocks: int, block_size: int, w: int, cache: dict) -> torch.Tensor:
    """``[blocks, (token groups,) tokens, heads, chunks, sub-runs, units]`` of one (layer,
    plane) of a cache at byte offset ``off`` of ``t``'s storage, as ``w``-byte integers; a
    head's staged bytes are in (chunk, sub-run, unit) order (:class:`kvcore.spec.PlaneStrides`)."""
    s = p.strides
    units = storage_units(t, w, cache)
    head = ((p.num_heads, s.head // w), (s.n_chunks, s.chunk // w), (s.n_sub, s.sub // w), (s.chunk_bytes // w, 1))
    if s.token_group and s.token_group < block_size:
        g = s.token_group
        tok: tuple[tuple[int, int], ...] = ((block_size // g, s.token_group_stride // w), (g, s.token // w))
    else:
        tok = ((block_size, s.token // w),)
    axes = ((nblocks, s.block // w), *tok, *head)
    return torch.as_strided(units, tuple(n for n, _ in axes), tuple(st for _, st in axes), off // w)
