"""What the store holds, as the scheduler sees it: chunks by key, slots, LRU order.

The scheduler owns every decision about the store -- which chunk goes into which slot,
which chunk is evicted, which chunks a request loads -- and the workers only execute them
(:mod:`.worker`), so the index needs no message from a worker to answer a lookup. A chunk
becomes *ready* (servable) only when every worker has reported its save done
(:meth:`StoreIndex.confirm`); a chunk being saved or loaded is *pinned* and never evicted,
so a slot is never reused under a transfer that reads or writes it.

Eviction is least recently used, per chunk. A request touches its chunks from the last to
the first, so a prefix is always more recent than what continues it and evictions take
leaves first: a chain stays reachable from its root as long as any of it is stored.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .keys import RequestKeys

__all__ = ["Entry", "Match", "StoreIndex", "IndexStats"]


@dataclass(eq=False)
class Entry:
    """One stored chunk.

    Attributes:
        key: its key (:mod:`.keys`).
        parent: the key of the chunk before it.
        tokens: its token ids (``chunk_size`` of them, fewer for a partial chunk).
        extra: its extra keys (compared on partial hits).
        slot: the store slot holding its bytes on every worker.
        ready: every worker saved it.
        pins: transfers in flight that read or write its slot.
    """

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    extra: Any
    slot: int
    ready: bool = False
    pins: int = 0


@dataclass(frozen=True)
class Match:
    """A lookup's answer: ``entries[i]`` serves its first ``counts[i]`` tokens, chunk ``i``
    of the request (tokens ``[i*C, i*C + counts[i])``); ``num_tokens`` in all."""

    entries: tuple[Entry, ...] = ()
    counts: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


@dataclass
class IndexStats:
    """Counters since the index was made (chunks and tokens)."""

    lookups: int = 0
    hit_tokens: int = 0
    stored_chunks: int = 0
    stored_tokens: int = 0
    shared_chunks: int = 0
    evicted_chunks: int = 0
    failed_saves: int = 0
    unusable_chunks: int = 0
    store_full: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class StoreIndex:
    """The scheduler's map of the store.

    Args:
        num_slots: chunks the store holds (:func:`.config.plan_store`).
        chunk_size: tokens per chunk.
    """

    def __init__(self, num_slots: int, chunk_size: int):
        self.num_slots = num_slots
        self.chunk_size = chunk_size
        self._by_key: dict[bytes, Entry] = {}
        self._children: dict[bytes, dict[bytes, Entry]] = {}
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()  # least recent first
        self._free = list(range(num_slots))  # a heap: the lowest free slot first keeps chains contiguous
        self.stats = IndexStats()

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def get(self, key: bytes) -> Entry | None:
        return self._by_key.get(key)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    # -- lookup -----------------------------------------------------------------------
    def match(self, keys: RequestKeys, tokens: Sequence[int], limit: int, *, partial: bool = True) -> Match:
        """The longest prefix of ``tokens[:limit]`` the store can serve, from ready chunks.

        Whole chunks are followed by key; then, with ``partial``, the chunk after them is
        served from any ready chunk under the same parent whose tokens start with the
        request's next tokens (its extra keys equal), as many tokens as agree. Touches
        nothing (vLLM may ask again; :meth:`touch` when a load is committed).
        """
        c = self.chunk_size
        limit = min(limit, len(tokens))
        keys.update(tokens, limit)
        entries: list[Entry] = []
        counts: list[int] = []
        k = 0
        while (k + 1) * c <= limit and k < len(keys):
            e = self._by_key.get(keys.full(k))
            if e is None or not e.ready:
                break
            entries.append(e)
            counts.append(c)
            k += 1
        if partial and k * c < limit:
            want = tuple(tokens[k * c : min(limit, (k + 1) * c)])
            best, best_n = None, 0
            for e in self._children.get(keys.parent(k), {}).values():
                if not e.ready:
                    continue
                n = _common_prefix(e.tokens, want)
                if n > best_n and e.extra == keys.extra(k * c, k * c + len(e.tokens)):
                    best, best_n = e, n
            if best is not None:
                entries.append(best)
                counts.append(best_n)
        return Match(tuple(entries), tuple(counts))

    def touch(self, chain: Sequence[Entry]) -> None:
        """Mark a request's chunks (first to last) used: the first becomes the most recent."""
        for e in reversed(chain):
            if e.key in self._lru:
                self._lru.move_to_end(e.key)

    def pin(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            e.pins += 1

    def unpin(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            e.pins = max(0, e.pins - 1)

    # -- saving -----------------------------------------------------------------------
    def covering(self, parent: bytes, tokens: Sequence[int], extra: Any) -> Entry | None:
        """A stored chunk under ``parent`` whose tokens start with ``tokens`` (same extra
        keys): saving ``tokens`` again would store nothing new."""
        want = tuple(tokens)
        for e in self._children.get(parent, {}).values():
            if len(e.tokens) >= len(want) and e.tokens[: len(want)] == want and e.extra == extra:
                return e
        return None

    def reserve(self, key: bytes, parent: bytes, tokens: Sequence[int], extra: Any) -> Entry | None:
        """A slot for a new chunk, evicting the least recently used unpinned chunks if the
        store is full; the chunk is pinned and not ready until :meth:`confirm`. None when
        every slot is pinned (the chunk is not stored; the request keeps running)."""
        if key in self._by_key:
            raise KeyError("chunk already stored")  # the caller checks first: a duplicate is a bug, never a second slot
        if not self._free and not self._evict_one():
            self.stats.store_full += 1
            return None
        slot = heapq.heappop(self._free)
        e = Entry(key, parent, tuple(tokens), extra, slot, ready=False, pins=1)
        self._by_key[key] = e
        self._children.setdefault(parent, {})[key] = e
        self._lru[key] = e
        self.stats.stored_chunks += 1
        self.stats.stored_tokens += len(e.tokens)
        return e

    def confirm(self, key: bytes, slot: int) -> None:
        """Every worker saved ``key`` into ``slot``: it may be served."""
        e = self._by_key.get(key)
        if e is not None and e.slot == slot:
            e.ready = True
            e.pins = max(0, e.pins - 1)

    def drop(self, key: bytes, slot: int | None = None, *, unusable: bool = False) -> None:
        """Forget a chunk: a failed save, or (``unusable``) one a worker's load found its slot
        no longer holding; its slot is free again."""
        e = self._by_key.get(key)
        if e is None or (slot is not None and e.slot != slot):
            return
        self._remove(e)
        if unusable:
            self.stats.unusable_chunks += 1
        else:
            self.stats.failed_saves += 1

    def _evict_one(self) -> bool:
        for e in self._lru.values():
            if e.pins == 0:
                self._remove(e)
                self.stats.evicted_chunks += 1
                return True
        return False

    def _remove(self, e: Entry) -> None:
        del self._by_key[e.key]
        self._lru.pop(e.key, None)
        sib = self._children.get(e.parent)
        if sib is not None:
            sib.pop(e.key, None)
            if not sib:
                del self._children[e.parent]
        heapq.heappush(self._free, e.slot)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
