"""transformers' own write paths, the conformance suite's writer oracles
(:class:`kvcore.testing.Writer`).

Every write below is transformers 5.24 code run on the fixture's cache, never a restatement:

* ``DynamicCache`` (``cache_utils.py::DynamicLayer.update``): the prefill's key/value states
  are appended with ``torch.cat``, so the writer *allocates*: it builds a new cache with
  ``cache.update(key_states, value_states, layer_idx)`` from the rows the suite hands it.
* ``DynamicSlidingWindowLayer`` (``DynamicSlidingWindowLayer.update``): the same through
  ``DynamicCache(ddp_cache_data=...)``, fed three more tokens than the window keeps, so
  the layer keeps the strided view ``full[:, :, -sliding_window + 1:, :]``.
* ``StaticCache`` (``StaticLayer.reset`` then ``StaticLayer.update``: ``index_copy_`` at
  ``cumulative_length``) writes in place, every position of every batch row at once.
* The continuous-batching paged cache
  (``generation/continuous_batching/cache_allocators/full_attention.py``):
  ``FullAttentionCacheAllocator.register_cache_tensor`` over the fixture's tensor, one
  request per slot (its block table holds the slot's block; ``get_write_indices`` with
  ``past_length`` = the offset gives the physical index), then
  ``FullAttentionCacheAllocator.update`` (``index_copy_``) writes in place.

Read-backs are the engine's too: ``layer.update`` with zero new tokens returns the states
attention reads; the paged allocator's ``update`` returns ``index_select`` of
``get_read_indices``.
"""

from __future__ import annotations

from math import lcm
from types import SimpleNamespace
from typing import Any

import torch

from kvcore.testing import Writer, WriterUnsupported

__all__ = ["EnginePairs", "dynamic_writer", "sliding_writer", "static_writer", "paged_writer", "LEGACY_NO_WRITER"]

SRC = "transformers 5.24.0 src/transformers"

#: why the 4.53 fixtures have no writer
LEGACY_NO_WRITER = (
    "transformers 4.53 cannot be installed beside 5.24 (one transformers per environment); the fixture's Legacy453 "
    "classes restate 4.53.3's storage rules, they are not its code"
)


class EnginePairs(list):
    """Per-layer ``(K, V)`` pairs (what ``make`` hands ``kvcore.detect``) that remember the
    transformers cache object they are the tensors of, so the writer runs that object's own
    ``update``."""

    def __init__(self, pairs=(), cache: Any = None):  # list(...)-compatible: containers are rebuilt as type(x)(items)
        super().__init__(pairs)
        self.cache = cache


def _batch_seq(pairs: list, slots: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """``(B, S, order)``: the cache's batch and sequence sizes, and the order that sorts
    ``slots`` into ``b * S + s``; refuses a slot set that is not every slot."""
    b, _, s, _ = pairs[0][0].shape
    order = torch.argsort(slots.cpu())
    if slots.numel() != b * s or not torch.equal(slots.cpu()[order], torch.arange(b * s)):
        raise WriterUnsupported(f"transformers' update writes whole prefills: every slot of the {b} x {s} cache at once")
    return b, s, order


def _states(rows: torch.Tensor, order: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """Rows ``[T, NH, HS]`` (slot order given by ``order``) as attention's states ``[B, NH, S, HS]``
    (a ``transpose(1, 2)`` view, as ``proj(x).view(B, S, NH, HS).transpose(1, 2)`` makes them)."""
    r = rows[order.to(rows.device)]
    return r.reshape(b, s, r.shape[-2], r.shape[-1]).transpose(1, 2)


def _read_pairs(kv: EnginePairs, slots: torch.Tensor, *, hints: dict) -> dict[str, torch.Tensor]:
    """The states attention reads: ``layer.update`` with zero new tokens returns them."""
    ks, vs = [], []
    for layer in kv.cache.layers:
        k0, v0 = layer.keys, layer.values
        k, v = layer.update(k0[:, :, :0], v0[:, :, :0])
        s = k.shape[2]
        b_idx, s_idx = (slots // s).to(k.device), (slots % s).to(k.device)
        ks.append(k[b_idx, :, s_idx])
        vs.append(v[b_idx, :, s_idx])
    return {"K": torch.stack(ks), "V": torch.stack(vs)}


def _write_dynamic(kv: Any, slots: torch.Tensor, rows: dict, *, hints: dict) -> EnginePairs:
    from transformers import DynamicCache

    from .caches import layer_pairs

    b, s, order = _batch_seq(kv, slots)
    cache = DynamicCache()
    for i in range(len(kv)):
        cache.update(_states(rows["K"][i], order, b, s), _states(rows["V"][i], order, b, s), i)
    return EnginePairs(layer_pairs(cache), cache)


def _write_sliding(kv: Any, slots: torch.Tensor, rows: dict, *, hints: dict) -> EnginePairs:
    from transformers import DynamicCache

    from .caches import layer_pairs

    b, s, order = _batch_seq(kv, slots)
    data = []
    for i in range(len(kv)):
        k, v = _states(rows["K"][i], order, b, s), _states(rows["V"][i], order, b, s)
        pad = torch.zeros((b, k.shape[1], 3, k.shape[3]), dtype=k.dtype, device=k.device)
        # three tokens before the window: the layer keeps only the last sliding_window - 1 = s
        data.append((torch.cat([pad, k], dim=2), torch.cat([pad, v], dim=2), torch.tensor(s + 1)))
    cache = DynamicCache(ddp_cache_data=data)
    return EnginePairs(layer_pairs(cache), cache)


def _write_static(kv: EnginePairs, slots: torch.Tensor, rows: dict, *, hints: dict) -> None:
    b, s, order = _batch_seq(kv, slots)
    for i, layer in enumerate(kv.cache.layers):
        layer.reset()  # zero the static tensors, cumulative_length 0: the next update writes positions 0..S-1
        layer.update(_states(rows["K"][i], order, b, s), _states(rows["V"][i], order, b, s))


def dynamic_writer() -> Writer:
    return Writer(
        name="transformers DynamicCache.update",
        write=_write_dynamic,
        read=_read_pairs,
        all_slots=True,
        requires=("transformers",),
        source=f"{SRC}/cache_utils.py::DynamicLayer.update (torch.cat of the prefill's states)",
    )


def sliding_writer() -> Writer:
    return Writer(
        name="transformers DynamicSlidingWindowLayer.update",
        write=_write_sliding,
        read=_read_pairs,
        all_slots=True,
        requires=("transformers",),
        source=f"{SRC}/cache_utils.py::DynamicSlidingWindowLayer.update (keys = full[:, :, -sliding_window + 1:, :])",
    )


def static_writer() -> Writer:
    return Writer(
        name="transformers StaticLayer.update",
        write=_write_static,
        read=_read_pairs,
        all_slots=True,
        requires=("transformers",),
        source=f"{SRC}/cache_utils.py::StaticLayer.update (index_copy_ along the sequence axis at cumulative_length)",
    )


# -- the continuous-batching paged cache ----------------------------------------------------------


def register_allocator(tensor: torch.Tensor, num_layers: int, page_size: int, num_heads: int, head_size: int, dtype: torch.dtype):
    """transformers' ``FullAttentionCacheAllocator`` registered over ``tensor`` (uint8, the whole
    cache) as ``PagedAttentionCache.__init__`` does: sector = ``lcm(bytes_per_block, 128)``, the
    first two sectors trash. Returns ``(allocator, bytes_per_sector, non_trash_bytes, pool)``."""
    from transformers.generation.continuous_batching.cache_allocators import CachePool, FullAttentionCacheAllocator

    alloc = FullAttentionCacheAllocator(
        index=0,
        config=SimpleNamespace(head_dim=head_size),
        num_key_value_heads=num_heads,
        cache_dtype=dtype,
        page_size=page_size,
        layer_indices=list(range(num_layers)),
        allow_block_sharing=True,
    )
    bytes_per_sector = lcm(alloc.bytes_per_block, 128)
    non_trash = tensor.numel() - 2 * bytes_per_sector
    pool = CachePool(non_trash // bytes_per_sector, 1)
    alloc.register_cache_tensor(bytes_per_sector, non_trash, tensor, pool)
    return alloc, bytes_per_sector, non_trash, pool


def _paged(tensor: torch.Tensor, hints: dict):
    return register_allocator(
        tensor, hints["num_layers"], hints["page_size"], hints["num_kv_heads"], hints["head_size"], getattr(torch, hints["dtype"])
    )[0]


def _physical(alloc: Any, slots: torch.Tensor, *, read: bool) -> torch.Tensor:
    """The allocator's own indices of ``slots``: one request per slot whose block table holds
    the slot's block, ``past_length`` = the slot's offset in it."""
    ps = alloc.tokens_per_page
    out = []
    for i, s in enumerate(slots.tolist()):
        req = f"kvcore-slot-{i}"
        alloc.block_table[req] = [s // ps]
        idx = alloc.get_read_indices(req, s % ps, 1)[-1] if read else alloc.get_write_indices(req, s % ps, 1)[0]
        del alloc.block_table[req]
        out.append(idx)
    return torch.tensor(out, dtype=torch.int64)


def _write_paged(tensor: torch.Tensor, slots: torch.Tensor, rows: dict, *, hints: dict) -> None:
    alloc = _paged(tensor, hints)
    write = _physical(alloc, slots, read=False).to(tensor.device)
    empty = torch.empty(0, dtype=torch.int64, device=tensor.device)
    for layer in range(hints["num_layers"]):
        alloc.update(rows["K"][layer], rows["V"][layer], layer, empty, write)


def _read_paged(tensor: torch.Tensor, slots: torch.Tensor, *, hints: dict) -> dict[str, torch.Tensor]:
    alloc = _paged(tensor, hints)
    read = _physical(alloc, slots, read=True).to(tensor.device)
    write = torch.empty(0, dtype=torch.int64, device=tensor.device)
    ks, vs = [], []
    for layer in range(hints["num_layers"]):
        k0, v0 = alloc._kv_token_views[layer]
        k, v = alloc.update(k0[:0], v0[:0], layer, read, write)
        ks.append(k)
        vs.append(v)
    return {"K": torch.stack(ks), "V": torch.stack(vs)}


def paged_writer() -> Writer:
    return Writer(
        name="transformers FullAttentionCacheAllocator.update",
        write=_write_paged,
        read=_read_paged,
        requires=("transformers.generation.continuous_batching.cache_allocators",),
        source=(
            f"{SRC}/generation/continuous_batching/cache_allocators/full_attention.py::FullAttentionCacheAllocator.update "
            "(index_copy_ at get_write_indices)"
        ),
    )
