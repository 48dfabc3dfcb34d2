"""The connector's worker side: execute the scheduler's loads and saves with kvcore.

Runs in each vLLM worker (``KVConnectorRole.WORKER``) and holds the store's bytes
(:class:`.arena.Arena`). vLLM hands it the caches once (``register_kv_caches``): their layout,
per KV-cache group, is read from the engine's own objects (:func:`kvcore_vllm.detect_engine`),
so the store never restates how vLLM packs a block. Per step it receives a
:class:`.plan.StepPlan` and

* loads (``start_load_kv``): checks that every slot still holds the chunk the plan names
  (a slot's bytes go only to the chunk that put them there), then :func:`kvcore.scatter`
  from the store's rows into the request's blocks, one call per run of consecutive slots and
  KV-cache group; a load that fails is reported, never half served;
* saves (``wait_for_save``, after the step's forward wrote the KV): :func:`kvcore.gather`
  from vLLM's blocks straight into the store's rows (the store is the staging buffer: no
  second copy, no allocation per step), then records which chunk each slot holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kvcore
from kvcore import KVCoreError

from .arena import Arena
from .config import StorePlan
from .plan import ChunkOp, Transfer, WorkerReport

__all__ = ["WorkerSide", "TransferStats"]

log = logging.getLogger("kvcore_vllm.connector")


@dataclass
class TransferStats:
    """Counters of one worker since the last :meth:`WorkerSide.take_stats`."""

    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    saved_tokens: int = 0
    saved_bytes: int = 0
    save_seconds: float = 0.0
    failed_loads: int = 0
    failed_saves: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return dict(self.__dict__)

    def __bool__(self) -> bool:
        return any(self.__dict__.values())


def _runs(ops: Sequence[ChunkOp], chunk_size: int) -> list[tuple[int, int, int]]:
    """``(first row, end row, offset into the engine slots)`` of each run of ops whose store
    rows follow each other."""
    runs: list[list[int]] = []
    off = 0
    for op in ops:
        a = op.slot * chunk_size + op.first
        if runs and runs[-1][1] == a:
            runs[-1][1] += op.count
        else:
            runs.append([a, a + op.count, off])
        off += op.count
    return [tuple(r) for r in runs]  # type: ignore[misc]


class WorkerSide:
    """The worker half of :class:`~kvcore_vllm.connector.KvcoreConnector`.

    Args:
        plan: the store's geometry (the same the scheduler computed).
    """

    def __init__(self, plan: StorePlan):
        self.plan = plan
        self.arena: Arena | None = None
        self.layouts: list[Any] = []
        self.stats = TransferStats()
        self.totals = TransferStats()

    def register(self, layouts: Sequence[Any]) -> None:
        """Allocate the store for these layouts (one per KV group, ``plan.kv_groups`` order)."""
        self.layouts = list(layouts)
        if self.plan.disabled:
            return
        self.arena = Arena(self.layouts, self.plan.num_slots, self.plan.chunk_size)
        real = sum(g.bytes_per_token() for g in self.arena.groups)
        if real != self.plan.bytes_per_token:
            log.warning(
                "kvcore connector: the store takes %d bytes per token, vLLM's KV-cache spec says %d; capacity is %d bytes",
                real,
                self.plan.bytes_per_token,
                self.arena.nbytes,
            )

    def take_stats(self) -> TransferStats:
        """The counters since the last call (vLLM's connector stats interval); :attr:`totals`
        keeps the running sums."""
        s, self.stats = self.stats, TransferStats()
        return s

    def _count(self, **counts: float) -> None:
        for st in (self.stats, self.totals):
            for k, v in counts.items():
                setattr(st, k, getattr(st, k) + v)

    def _check(self, t: Transfer) -> str:
        """Why ``t`` cannot be executed ("" when it can)."""
        if self.arena is None:
            return "the store holds nothing (disabled, or register_kv_caches was not called)"
        c = self.plan.chunk_size
        for op in t.ops:
            if not (0 <= op.slot < self.arena.num_slots and op.count > 0 and 0 <= op.first and op.first + op.count <= c):
                return f"operation {op.slot}/{op.first}+{op.count} is outside the store ({self.arena.num_slots} slots of {c})"
        n = t.num_tokens
        if len(t.engine_slots) != len(self.arena.groups) or any(s.numel() != n for s in t.engine_slots):
            return f"engine slots {[s.numel() for s in t.engine_slots]} do not match {n} tokens in {len(self.arena.groups)} groups"
        return ""

    def load(self, t: Transfer, report: WorkerReport | None = None) -> str:
        """Scatter a request's stored chunks into its blocks. Returns "" or why it failed
        (then the request must not run on its blocks: the caller reports it); a failed load
        and the chunks it found unusable are added to ``report``."""
        arena = self.arena
        why = t.refused or self._check(t)
        stale: list[ChunkOp] = []
        if not why and arena is not None:
            stale = [op for op in t.ops if not arena.holds(op.slot, op.key, op.first + op.count)]
            if stale:
                why = f"store slot {stale[0].slot} no longer holds the chunk the scheduler planned ({len(stale)} of {len(t.ops)} chunks)"
        if not why and arena is not None:
            t0 = time.perf_counter()
            try:
                self._move(kvcore.scatter, t)
            except KVCoreError as e:
                why = f"kvcore refused the load: {e}"
            else:
                n = t.num_tokens
                self._count(loaded_tokens=n, loaded_bytes=n * self.plan.bytes_per_token, load_seconds=time.perf_counter() - t0)
                return ""
        self._count(failed_loads=1)
        if report is not None:
            report.failed_loads.add(t.req_id)
            report.unusable.update((op.slot, op.key) for op in stale)
        log.warning("kvcore connector: load for request %s failed, it will not use stored KV: %s", t.req_id, why)
        return why

    def _move(self, op, t: Transfer) -> None:
        """``op`` (``kvcore.gather`` or ``kvcore.scatter``) over every KV-cache group's engine
        slots of ``t`` and the store rows of its chunks, one call per run of consecutive chunks."""
        runs = _runs(t.ops, self.plan.chunk_size)
        for ga, slots in zip(self.arena.groups, t.engine_slots):
            for a, b, off in runs:
                op(ga.layout, slots[off : off + b - a], ga.rows(a, b))

    def save(self, t: Transfer) -> WorkerReport:
        """Gather a step's chunks into the store. Every chunk of the step lands, or none
        does (a kvcore refusal is raised before any byte moves)."""
        report = WorkerReport()
        if not t.ops:
            return report
        done = {(op.slot, op.key) for op in t.ops}
        arena = self.arena
        why = self._check(t)
        if not why and arena is not None:
            for op in t.ops:
                arena.forget(op.slot)  # the slot is reused: its old chunk is gone from here on
            t0 = time.perf_counter()
            try:
                self._move(kvcore.gather, t)
            except KVCoreError as e:
                why = f"kvcore refused the save: {e}"
            else:
                for op in t.ops:
                    arena.mark(op.slot, op.key, op.count)
                n = t.num_tokens
                self._count(saved_tokens=n, saved_bytes=n * self.plan.bytes_per_token, save_seconds=time.perf_counter() - t0)
                report.saved = done
                return report
        self._count(failed_saves=len(t.ops))
        log.warning("kvcore connector: %d chunks not stored: %s", len(t.ops), why)
        report.failed = done
        return report
