"""The continuous-batching paged cache: every group's layout, and a request's slots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore import DetectionError, KVLayout, TransferError, build_layout

from .caches import PAGED_FORMAT, PagedGroup, paged_groups

__all__ = ["detect_paged", "request_slots"]


def detect_paged(cache: Any) -> dict[str, KVLayout]:
    """One :class:`kvcore.KVLayout` per attention-type group of a ``PagedAttentionCache``.

    Each layout is format ``NB_NL_TWO_BS_NH_HS`` over the cache's whole uint8 tensor (the
    groups share its bytes, sector by sector), with ``layout.layer_ids`` the model's
    layer indices of the group in block order (transformers ``allocator.layer_indices``).

    Raises:
        DetectionError: not a paged cache, or one this plugin cannot read (see
            :func:`kvcore_transformers.caches.paged_groups`).
    """
    from .caches import is_paged_cache

    if not is_paged_cache(cache):
        raise DetectionError(f"{type(cache).__name__} is not a transformers PagedAttentionCache (no uint8 cache_tensor / cache_allocators)")
    out = {}
    for name, g in paged_groups(cache).items():
        out[name] = build_layout(
            PAGED_FORMAT, g.view, layer_ids=g.layer_ids, note=f"transformers PagedAttentionCache group {name!r}", engine="transformers"
        )
    return out


def request_slots(
    group: PagedGroup | KVLayout,
    block_ids: Sequence[int] | None = None,
    num_tokens: int = 0,
    *,
    request_id: str | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """kvcore slots of a request's positions ``0 .. num_tokens-1`` in one paged group.

    Full attention (``full_attention.py::get_write_indices``): position ``p`` is in block
    ``block_ids[p // page_size]`` at offset ``p % page_size``. Sliding window
    (``sliding_attention.py::_token_indices_to_physical_indices``): only the last
    ``sliding_window`` positions are stored, position ``p`` at ring slot ``p % sliding_window``;
    older positions get slot -1 (kvcore skips them).

    Args:
        group: a :class:`PagedGroup` (block size and window known) or a layout of this
            format (then pass ``sliding_window`` for a sliding group).
        block_ids: the request's block table; or ``request_id`` to read it from the
            group's allocator (only while transformers holds the request).
        num_tokens: tokens the request has written to the cache.
    Returns:
        int64 ``[num_tokens]``.
    Raises:
        TransferError: no block table, or too few blocks for ``num_tokens``.
    """
    if isinstance(group, PagedGroup):
        ps, window = group.page_size, group.sliding_window
        if block_ids is None and request_id is not None:
            table = getattr(group.allocator, "block_table", {})
            if request_id not in table:
                raise TransferError(f"request {request_id!r} has no block table in group {group.attention_type!r} (finished or unknown)")
            block_ids = table[request_id]
    else:
        ps, window = group.block_size, sliding_window
    if block_ids is None:
        raise TransferError("pass the request's block_ids (or request_id with a PagedGroup)")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise TransferError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    pos = torch.arange(num_tokens, dtype=torch.int64)
    where = pos if window is None else pos % window
    need = int(where.max()) // ps + 1 if num_tokens else 0
    if need > blocks.numel():
        raise TransferError(f"{num_tokens} tokens need {need} blocks of {ps} but the block table has {blocks.numel()}")
    slots = blocks[where // ps] * ps + where % ps if num_tokens else pos
    if window is not None:
        slots = torch.where(pos < num_tokens - window, torch.full_like(slots, -1), slots)
    return slots
