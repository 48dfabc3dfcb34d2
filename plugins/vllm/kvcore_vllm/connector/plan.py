"""What the scheduler tells the workers to do in one step, and what they answer.

Everything here is plain data (ints, bytes, int64 tensors) so vLLM can send it from the
scheduler process to each worker inside its connector metadata, and back inside the worker
metadata. Token ``i`` of an operation lives in store row ``slot * chunk_size + first + i``
and, in KV-cache group ``g``, in the engine slot ``engine_slots[g][offset + i]`` (a vLLM slot:
``block_id * block_size + offset``; -1 where vLLM holds no block for the token, which
kvcore skips).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ChunkOp", "Transfer", "StepPlan", "WorkerReport", "engine_slots"]


@dataclass(frozen=True)
class ChunkOp:
    """Tokens ``[first, first + count)`` of the chunk ``key`` in store slot ``slot``."""

    slot: int
    key: bytes
    first: int
    count: int


@dataclass
class Transfer:
    """Chunks of one request (a load) or of one step (the saves), with their engine slots.

    Attributes:
        ops: the chunks, in the order their tokens appear in ``engine_slots``.
        engine_slots: one int64 tensor per KV-cache group holding KV (in
            ``StorePlan.kv_groups`` order), ``sum(op.count)`` slots each.
        req_id: the request a load is for ("" for saves).
        refused: why a load cannot be done ("" when it can): the worker reports it failed
            and writes nothing.
        block_ids: a load's blocks in KV-cache group 0, to name if it fails where vLLM takes
            failures as block ids (0.28: ``get_block_ids_with_load_errors``).
    """

    ops: list[ChunkOp]
    engine_slots: list[torch.Tensor]
    req_id: str = ""
    refused: str = ""
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(op.count for op in self.ops)


@dataclass
class StepPlan:
    """The connector metadata's content for one step: loads run before saves."""

    loads: list[Transfer] = field(default_factory=list)
    saves: Transfer | None = None

    def __bool__(self) -> bool:
        return bool(self.loads) or bool(self.saves and self.saves.ops)


@dataclass
class WorkerReport:
    """A worker's answer for one step: which saves landed (``(slot, key)``) and which failed,
    the chunks a load found its slot no longer holding (``unusable``) and the requests whose
    load failed. Several workers' reports combine so a save counts only if every worker made
    it, and a chunk or a load any worker could not use is not used again."""

    saved: set[tuple[int, bytes]] = field(default_factory=set)
    failed: set[tuple[int, bytes]] = field(default_factory=set)
    unusable: set[tuple[int, bytes]] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)

    def combine(self, other: WorkerReport) -> WorkerReport:
        """Two workers' reports of one step."""
        failed = self.failed | other.failed
        return WorkerReport(
            saved=(self.saved & other.saved) - failed,
            failed=failed,
            unusable=self.unusable | other.unusable,
            failed_loads=self.failed_loads | other.failed_loads,
        )

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Two reports of one worker (loads and saves of a step)."""
        failed = self.failed | other.failed
        return WorkerReport(
            saved=(self.saved | other.saved) - failed,
            failed=failed,
            unusable=self.unusable | other.unusable,
            failed_loads=self.failed_loads | other.failed_loads,
        )

    def __bool__(self) -> bool:
        return bool(self.saved or self.failed or self.unusable or self.failed_loads)


def engine_slots(block_ids: list[int], block_size: int, start: int, end: int, null_block: int = 0) -> torch.Tensor:
    """vLLM slots of tokens ``[start, end)`` of a request in one KV-cache group.

    Args:
        block_ids: the request's block table in the group (vLLM's manager blocks).
        block_size: the group's (manager) block size. A kernel block size that divides it
            gives the same slot numbers (``vllm/v1/worker/block_table.py``), so the kvcore
            layout of the group reads them directly.
        start, end: the token range.
        null_block: vLLM's null block id (``BlockPool.null_block``, 0): a sliding-window
            group's blocks outside the window; their tokens get slot -1.

    Raises:
        IndexError: the block table does not reach ``end`` (a caller bug, never silently
            clipped).
    """
    if end <= start:
        return torch.empty(0, dtype=torch.int64)
    need = (end - 1) // block_size + 1
    if need > len(block_ids):
        raise IndexError(f"block table of {len(block_ids)} blocks of {block_size} does not reach token {end - 1}")
    tok = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.tensor(block_ids[:need], dtype=torch.int64)[tok // block_size]
    slots = blocks * block_size + tok % block_size
    return torch.where(blocks == null_block, torch.full_like(slots, -1), slots)
