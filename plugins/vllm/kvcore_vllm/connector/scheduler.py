"""The connector's scheduler side: what each request loads, and what each step stores.

Runs where vLLM's scheduler runs (``KVConnectorRole.SCHEDULER``) and decides everything about
the store (:class:`.index.StoreIndex`); the workers only execute its :class:`.plan.StepPlan`,
which reaches them inside vLLM's connector metadata. The hooks, in vLLM's order per step
(``vllm/v1/core/sched/scheduler.py::Scheduler.schedule``, 0.28-0.32):

* ``get_num_new_matched_tokens`` (a waiting request, nothing computed yet): the longest
  prefix of its tokens the store can serve, from *ready* chunks; the load is asynchronous
  (the request waits one step, ``WAITING_FOR_REMOTE_KVS``), so a load that a worker cannot
  do is reported as a failed receive instead of letting the request run on bytes that are
  not its own;
* ``update_state_after_alloc``: the blocks vLLM gave the request; the load is planned
  token by token into them (a partial last chunk included) and its chunks pinned;
* ``build_connector_meta``: the step's plan: the loads, then the saves -- every chunk a
  request completes in this step (its tokens' KV is in vLLM's blocks by the end of the step's
  forward), and a prompt's partial last chunk when its prefill ends, unless the store already
  holds it (then the request shares the stored chunk);
* ``update_connector_output``: workers' reports make saved chunks ready and unpin loads.

Nothing here imports vLLM: the vLLM objects are read by attribute (``Request``,
``SchedulerOutput``, ``KVCacheBlocks``), so the logic is tested without an engine too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import ConnectorConfig, StorePlan
from .index import Entry, Match, StoreIndex
from .keys import RequestKeys
from .plan import ChunkOp, StepPlan, Transfer, WorkerReport, engine_slots

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvcore_vllm.connector")


@dataclass
class _Req:
    request: Any
    keys: RequestKeys
    block_ids: list[list[int]] = field(default_factory=list)
    computed: int = 0  # tokens computed before the step being planned
    next_chunk: int = 0  # chunks [0, next_chunk) are stored (or were found stored)
    chain: list[Entry] = field(default_factory=list)  # its stored chunks 0 .. next_chunk - 1
    stop: str = ""  # why this request stores nothing more
    bypass: str = ""  # why the store neither serves nor stores this request
    lookup: tuple[int, Match] | None = None


class SchedulerSide:
    """The scheduler half of :class:`~kvcore_vllm.connector.KvcoreConnector`.

    Args:
        config: the connector's configuration.
        plan: the store's geometry (:func:`.config.plan_store`).
        extra_keys: ``extra_keys(request, start, end)`` -> the extra keys of tokens
            ``[start, end)`` as vLLM's prefix caching computes them, or None.
        null_block: vLLM's null block id.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        plan: StorePlan,
        *,
        extra_keys: Callable[[Any, int, int], Any] | None = None,
        null_block: int = 0,
    ):
        self.config = config
        self.plan = plan
        self.index = StoreIndex(plan.num_slots, plan.chunk_size)
        self.null_block = null_block
        self._extra_keys = extra_keys
        self._reqs: dict[str, _Req] = {}
        self._loads: dict[str, tuple[Transfer, list[Entry]]] = {}
        self._inflight: dict[str, list[Entry]] = {}
        if plan.disabled:
            log.warning("kvcore connector: storing and loading nothing: %s", plan.disabled)

    # -- requests ---------------------------------------------------------------------
    def _state(self, request: Any) -> _Req:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            extra = None
            if self._extra_keys is not None:
                extra = lambda a, b, r=request: self._extra_keys(r, a, b)  # noqa: E731
            st = _Req(request, RequestKeys(self.plan.chunk_size, extra))
            if getattr(request, "prompt_embeds", None) is not None:
                st.bypass = "prompt embeddings: no token ids to key the store by"
            self._reqs[rid] = st
        return st

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    # -- loads ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the store serves, and True (loaded
        asynchronously: the request waits for the worker's report). Up to every token of
        the request: on a full hit vLLM recomputes the last one to sample from it."""
        if self.plan.disabled:
            return 0, False
        st = self._state(request)
        if st.bypass or getattr(request, "skip_reading_prefix_cache", False):
            # the request asked for no cached prefix (SamplingParams.skip_reading_prefix_cache);
            # vLLM 0.32's scheduler enforces it too, 0.28's does not for connectors
            return 0, False
        tokens = request.all_token_ids
        m = self.index.match(st.keys, tokens, request.num_tokens, partial=self.config.token_granular)
        self.index.stats.lookups += 1
        if m.num_tokens <= num_computed_tokens:
            st.lookup = None
            return 0, False
        st.lookup = (num_computed_tokens, m)
        return m.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` tokens into the request's blocks."""
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            if st is not None:
                st.lookup = None
            return
        block_ids = [list(b) for b in blocks.get_block_ids()]
        st.block_ids = block_ids
        rid = request.request_id
        start = st.lookup[0] if st.lookup is not None else 0
        end = start + num_external_tokens
        bs0 = self.plan.groups[0].block_size if self.plan.groups else 1
        # the blocks vLLM marks to recompute if the load fails (its single-group invalid-blocks path)
        first_group = block_ids[0][start // bs0 : (end - 1) // bs0 + 1] if block_ids else []

        def refuse(why: str) -> None:
            self._loads[rid] = (Transfer([], [], rid, refused=why, block_ids=first_group), [])

        if st.lookup is None:
            refuse("no lookup preceded the allocation")
            return
        m = st.lookup[1]
        st.lookup = None
        if end > m.num_tokens:
            refuse(f"vLLM asked for {end} tokens, the store matched {m.num_tokens}")
            return
        c = self.plan.chunk_size
        ops: list[ChunkOp] = []
        used: list[Entry] = []
        for i, (e, n) in enumerate(zip(m.entries, m.counts)):
            lo, hi = max(i * c, start), min(i * c + n, end)
            if lo < hi:
                ops.append(ChunkOp(e.slot, e.key, lo - i * c, hi - lo))
                used.append(e)
        try:
            slots = [engine_slots(block_ids[g.index], g.block_size, start, end, self.null_block) for g in self.plan.kv_groups]
        except IndexError as exc:
            refuse(f"block table: {exc}")
            return
        self.index.pin(used)
        self.index.touch(m.entries)
        self.index.stats.hit_tokens += end - start
        self._loads[rid] = (Transfer(ops, slots, rid, block_ids=first_group), used)

    # -- the step's plan ----------------------------------------------------------------
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """The loads planned since the last step, then this step's saves."""
        self._track(scheduler_output)
        plan = StepPlan()
        for rid, (t, used) in self._loads.items():
            plan.loads.append(t)
            self._inflight[rid] = used
        self._loads.clear()
        if not self.plan.disabled:
            plan.saves = self._plan_saves(scheduler_output)
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._reqs.pop(rid, None)
        return plan

    def _track(self, so: Any) -> None:
        """Each scheduled request's block table and computed tokens, from the scheduler
        output (new requests carry their table; running ones the blocks added, resumed
        ones their whole table again)."""
        for nr in so.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is not None:
                st.block_ids = [list(b) for b in nr.block_ids]
                st.computed = nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            st.computed = cached.num_computed_tokens[i]
            new = cached.new_block_ids[i]
            if new is None:
                continue
            if rid in resumed or not st.block_ids:
                st.block_ids = [list(b) for b in new]
            else:
                for g, b in enumerate(new):
                    st.block_ids[g].extend(b)

    def _block_ids(self, so: Any, rid: str, st: _Req) -> list[list[int]]:
        state = getattr(so, "kv_connector_block_state", None)  # vLLM 0.32: the manager's table, null blocks included
        if state is not None:
            got = state.get_block_ids(rid)
            if got is not None:
                return [list(b) for b in got]
        return st.block_ids

    def _plan_saves(self, so: Any) -> Transfer:
        c = self.plan.chunk_size
        groups = self.plan.kv_groups
        ops: list[ChunkOp] = []
        parts: list[list[torch.Tensor]] = [[] for _ in groups]
        for rid, n in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None or st.stop or st.bypass:
                continue
            req = st.request
            tokens = req.all_token_ids
            done = min(st.computed + n, len(tokens))
            prompt = req.num_prompt_tokens
            upto = done if self.config.save_decode else min(done, prompt)
            st.keys.update(tokens, upto)
            blocks = self._block_ids(so, rid, st)
            tail_entry: list[Entry] = []
            grew = False
            own = list(st.chain)
            self.index.pin(own)  # a request never evicts its own prefix to store what continues it
            while (st.next_chunk + 1) * c <= upto:
                k = st.next_chunk
                key = st.keys.full(k)
                e = self.index.get(key)
                if e is None:
                    e = self._reserve(st, blocks, key, k, tokens[k * c : (k + 1) * c], ops, parts)
                    if e is None:
                        break
                else:
                    self.index.stats.shared_chunks += 1
                grew = True
                st.chain.append(e)
                st.next_chunk += 1
            if self.config.token_granular and not st.stop and st.computed < prompt <= done and prompt % c and st.next_chunk == prompt // c:
                k = prompt // c
                tail = tokens[k * c : prompt]
                extra = st.keys.extra(k * c, prompt)
                have = self.index.covering(st.keys.parent(k), tail, extra)
                if have is not None:
                    self.index.stats.shared_chunks += 1
                    tail_entry.append(have)
                else:
                    key = st.keys.partial(k, tail)
                    e = self._reserve(st, blocks, key, k, tail, ops, parts)
                    if e is not None:
                        tail_entry.append(e)
            self.index.unpin(own)
            if grew or tail_entry:
                self.index.touch(st.chain + tail_entry)
        slots = [torch.cat(p) if p else torch.empty(0, dtype=torch.int64) for p in parts]
        return Transfer(ops, slots)

    def _reserve(
        self,
        st: _Req,
        blocks: list[list[int]],
        key: bytes,
        k: int,
        tokens: Sequence[int],
        ops: list[ChunkOp],
        parts: list[list[torch.Tensor]],
    ) -> Entry | None:
        c = self.plan.chunk_size
        a, b = k * c, k * c + len(tokens)
        for g in self.plan.kv_groups:
            if a < g.first_held(st.computed):
                # a sliding-window (or local) group may have released the block of token a before
                # this step: its bytes may be another request's by now
                st.stop = f"token {a} is outside KV-cache group {g.index}'s window"
                return None
        try:
            sl = [engine_slots(blocks[g.index], g.block_size, a, b, self.null_block) for g in self.plan.kv_groups]
        except IndexError as exc:
            st.stop = f"block table: {exc}"
            return None
        if any(bool((s < 0).any()) for s in sl):
            # a sliding-window group already released a block of this chunk: it cannot be stored whole
            st.stop = f"tokens [{a}, {b}) are no longer all held by vLLM"
            return None
        e = self.index.reserve(key, st.keys.parent(k), tokens, st.keys.extra(a, b))
        if e is None:
            st.stop = "the store is full of chunks in transfer"
            log.info("kvcore connector: store full, request %s stores no more chunks", st.request.request_id)
            return None
        ops.append(ChunkOp(e.slot, key, 0, len(tokens)))
        for g, s in enumerate(sl):
            parts[g].append(s)
        return e

    # -- reports ----------------------------------------------------------------------
    def on_report(self, report: WorkerReport | None, finished_recving: set[str] | None) -> None:
        """Workers' reports: saved chunks become ready; failed and unusable ones are
        forgotten; a request whose load failed is not served again (vLLM recomputes it); the
        chunks of finished loads are unpinned."""
        if report is not None:
            for slot, key in report.saved:
                self.index.confirm(key, slot)
            for slot, key in report.failed:
                self.index.drop(key, slot)
            for slot, key in report.unusable:
                self.index.drop(key, slot, unusable=True)
            for rid in report.failed_loads:
                st = self._reqs.get(rid)
                if st is not None:  # vLLM recomputes it (or fails it): it is not served again
                    st.bypass = "its load failed"
        for rid in finished_recving or ():
            used = self._inflight.pop(rid, None)
            if used:
                self.index.unpin(used)
