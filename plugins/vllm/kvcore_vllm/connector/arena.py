"""The store's memory on one worker: one kvcore staging buffer per KV-cache group, long
enough for every chunk, allocated once (host memory; pinned for a CUDA cache) and reused by
every save and load.

A group's buffer is the staging kvcore's transfers fill (``layout.staging_buffers``:
``[kv_size, NL, T, NH*HS]``, MLA ``[1, NL, T, HS]``, or one ``[NL, T, row]`` per plane) with
``T = num_slots * chunk_size``: store slot ``s`` is rows ``[s*C, (s+1)*C)`` of the token axis,
so a run of consecutive slots is one strided view and one :func:`kvcore.gather` /
:func:`kvcore.scatter` call moves it. The rows hold exactly what kvcore stages -- LMCache's
``KV_2LTD`` order -- whatever the engine's own layout.

Each slot remembers the key it holds; a load checks it before reading (a slot's bytes are
served only to the chunk that put them there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GroupArena", "Arena"]


class GroupArena:
    """One KV-cache group's share of the store.

    Args:
        layout: the group's :class:`kvcore.Layout` (from :func:`kvcore_vllm.detect_engine`).
        num_tokens: rows (``num_slots * chunk_size``).
    """

    def __init__(self, layout: Any, num_tokens: int):
        self.layout = layout
        self.classic = layout.classic_staging
        self.buffers: dict[str, torch.Tensor] = {}
        pin = layout.device.type == "cuda"  # kvcore moves a CUDA cache's rows to and from pinned host memory
        for b in layout.staging_buffers:
            shape = layout.staging_shapes(num_tokens)[b.key]
            # torch.empty: pages are touched by the first save that lands in them, not here
            self.buffers[b.key] = torch.empty(shape, dtype=b.dtype, device="cpu", pin_memory=pin)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def bytes_per_token(self) -> int:
        return sum(t.numel() * t.element_size() // t.shape[-2] for t in self.buffers.values() if t.shape[-2])

    def rows(self, start: int, stop: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Rows ``[start, stop)`` as kvcore staging (a view, no copy): the token axis is the
        second to last of every staging buffer."""
        views = {k: t.narrow(-2, start, stop - start) for k, t in self.buffers.items()}
        return views["kv"] if self.classic else views


class Arena:
    """Every KV group's buffer plus what each slot holds.

    Args:
        layouts: one layout per KV group, in ``StorePlan.kv_groups`` order.
        num_slots, chunk_size: the store's geometry.
    """

    def __init__(self, layouts: Sequence[Any], num_slots: int, chunk_size: int):
        self.chunk_size = chunk_size
        self.num_slots = num_slots
        self.groups = [GroupArena(lay, num_slots * chunk_size) for lay in layouts]
        self._held: list[tuple[bytes, int] | None] = [None] * num_slots

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def holds(self, slot: int, key: bytes, upto: int) -> bool:
        """Whether ``slot`` holds chunk ``key`` with at least ``upto`` tokens."""
        if not 0 <= slot < self.num_slots:
            return False
        got = self._held[slot]
        return got is not None and got[0] == key and got[1] >= upto

    def forget(self, slot: int) -> None:
        if 0 <= slot < self.num_slots:
            self._held[slot] = None

    def mark(self, slot: int, key: bytes, count: int) -> None:
        self._held[slot] = (key, count)
