"""``KvcoreConnector``: vLLM's ``KVConnectorBase_V1`` over kvcore -- CPU KV offloading.

Load it with ``kv_transfer_config={"kv_connector": "KvcoreConnector",
"kv_connector_module_path": "kvcore_vllm.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}`` (keys: :mod:`.config`). vLLM builds one instance per
role (``vllm/distributed/kv_transfer/kv_connector/factory.py::KVConnectorFactory``,
0.28-0.32): the scheduler's (:class:`.scheduler.SchedulerSide`) decides; each worker's
(:class:`.worker.WorkerSide`) holds the bytes and moves them with kvcore. They share nothing
but vLLM's connector metadata (scheduler -> workers, :class:`KvcoreConnectorMetadata`) and
worker metadata (workers -> scheduler, :class:`KvcoreWorkerMetadata`), so they may live in
different processes.

Hooks and what they do here, with the vLLM 0.32 signatures of
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``:

==================================  ==========================================================
scheduler                           ``get_num_new_matched_tokens`` (asynchronous loads),
                                    ``update_state_after_alloc``, ``build_connector_meta``,
                                    ``update_connector_output``, ``request_finished`` /
                                    ``request_finished_all_groups`` (hybrid allocator),
                                    ``get_loaded_kv_cache_group_ids`` -> ``()`` (vLLM zeroes
                                    new blocks before the load writes them)
worker                              ``register_kv_caches`` (:func:`kvcore_vllm.detect_engine`),
                                    ``start_load_kv`` (loads), ``wait_for_save`` (saves),
                                    ``get_finished`` / ``get_transfer_results`` (loads done or
                                    failed), ``build_connector_worker_meta``,
                                    ``get_kv_connector_stats``
==================================  ==========================================================
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcore import TransferError

from ..engine import detect_engine
from .config import ConnectorConfig, StorePlan, plan_store
from .plan import StepPlan, WorkerReport
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

try:  # vLLM 0.32: where a connector's hits came from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST = CacheHitSource.HOST
except ImportError:  # vLLM 0.28
    CacheHitSource = None
    _HOST = None

try:  # vLLM 0.32: failed receives reported by request (any number of KV-cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.28
    KVConnectorTransferResults = None

__all__ = ["KvcoreConnector", "KvcoreConnectorMetadata", "KvcoreWorkerMetadata", "KvcoreConnectorStats"]

log = logging.getLogger("kvcore_vllm.connector")


class KvcoreConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`.plan.StepPlan`, sent by vLLM from the scheduler to every worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


class KvcoreWorkerMetadata(KVConnectorWorkerMetadata):
    """One worker's :class:`.plan.WorkerReport`; vLLM aggregates the workers' (a save counts
    only when every worker made it)."""

    def __init__(self, report: WorkerReport):
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvcoreWorkerMetadata):
            return self
        return KvcoreWorkerMetadata(self.report.combine(other.report))

    def __bool__(self) -> bool:
        return bool(self.report)


class KvcoreConnectorStats(KVConnectorStats):
    """The connector's counters, summed over workers and over a logging interval: tokens and
    bytes loaded and saved, seconds spent, failed loads and saves (worker side); lookups,
    hit tokens, stored, shared and evicted chunks (scheduler side)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out = dict(self.data)
        secs = out.get("load_seconds", 0.0)
        if secs:
            out["load_GBps"] = round(out.get("loaded_bytes", 0) / secs / 1e9, 3)
        secs = out.get("save_seconds", 0.0)
        if secs:
            out["save_GBps"] = round(out.get("saved_bytes", 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _extra_keys(request: Any, start: int, end: int) -> Any:
    """vLLM's extra keys of tokens ``[start, end)`` (``vllm/v1/core/kv_cache_utils.py::
    generate_block_hash_extra_keys``: LoRA name, multimodal inputs, cache_salt, prompt
    embeddings), the same that key vLLM's prefix cache."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    return keys


class KvcoreConnector(KVConnectorBase_V1, SupportsHMA):
    """CPU KV offloading through kvcore, for vLLM's V1 engine (0.32; 0.28 too -- see the
    vLLM plugin README). Errors: :class:`.config.ConnectorConfigError` for a bad
    ``kv_connector_extra_config``; :class:`kvcore.DetectionError` when the engine's caches
    cannot be read (both at engine start)."""

    if _HOST is not None:
        _cache_hit_source = _HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.store_plan: StorePlan = plan_store(self.config, kv_cache_config, vllm_config.cache_config.block_size)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.config, self.store_plan, extra_keys=_extra_keys)
        else:
            self.worker_side = WorkerSide(self.store_plan)
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._invalid: set[int] = set()
        self._report = WorkerReport()

    @property
    def requires_kv_delivery(self) -> bool:
        # a best-effort cache: a dropped save is a later miss, never a lost hand-off
        return False

    # ==============================  worker  ==============================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.worker_side is None:
            return
        if self.store_plan.disabled:
            self.worker_side.register([])
            return
        engine = detect_engine(vllm_config=self._vllm_config, kv_caches=kv_caches, kv_cache_config=self._kv_cache_config)
        self.worker_side.register([engine.groups[g.index].layout for g in self.store_plan.kv_groups])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker_side is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for t in meta.plan.loads:
            why = self.worker_side.load(t, self._report)
            if not why:
                self._loaded.add(t.req_id)
            elif KVConnectorTransferResults is not None:
                self._failed.add(t.req_id)  # 0.32: a failed receive, by request
            elif len(self._kv_cache_config.kv_cache_groups) == 1:
                self._loaded.add(t.req_id)  # 0.28: done, and its blocks named invalid: vLLM recomputes them
                self._invalid.update(t.block_ids)
            else:
                raise TransferError(
                    f"KvcoreConnector: the load for request {t.req_id} failed ({why}) and vLLM 0.28 cannot be told so "
                    f"for a model with {len(self._kv_cache_config.kv_cache_groups)} KV-cache groups (its invalid-block path "
                    "reads one group); stopping rather than letting the request run on blocks the load did not write"
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the request is scheduled again

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves run in wait_for_save, once every layer wrote this step's KV

    def wait_for_save(self) -> None:
        if self.worker_side is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if meta.plan.saves is not None and meta.plan.saves.ops:
            self._report = self._report.merge(self.worker_side.save(meta.plan.saves))

    def _take_finished(self) -> tuple[set[str], set[str]]:
        done, failed = self._loaded | self._failed, self._failed
        self._loaded, self._failed = set(), set()
        return done, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, _ = self._take_finished()
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # vLLM 0.32: a failed load is reported by request id (valid for any number of
        # KV-cache groups); vLLM recomputes it or fails it (kv_load_failure_policy)
        done, failed = self._take_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, self._report = self._report, WorkerReport()
        return KvcoreWorkerMetadata(report) if report else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is not None:
            s = self.worker_side.take_stats()
            return KvcoreConnectorStats(data=s.as_dict()) if s else None
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvcoreConnectorStats(data=dict(data or {}))

    # ============================  scheduler  =============================
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self.scheduler_side is not None:
            null = getattr(gpu_block_pool, "null_block", None)
            self.scheduler_side.null_block = int(getattr(null, "block_id", 0) or 0)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler_side is None:
            return 0, False
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # Every group is zeroed by vLLM before the load writes the loaded tokens: the rest of
        # a partially loaded block then holds zeros, not a previous request's bytes.
        return ()

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        plan = self.scheduler_side.build_plan(scheduler_output) if self.scheduler_side is not None else StepPlan()
        return KvcoreConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler_side is None:
            return
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        report = meta.report if isinstance(meta, KvcoreWorkerMetadata) else None
        self.scheduler_side.on_report(report, connector_output.finished_recving)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler_side is not None:
            self.scheduler_side.forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def get_kv_connector_stats_scheduler(self) -> dict[str, int]:
        """The scheduler's store counters (:class:`.index.IndexStats`) and occupancy."""
        if self.scheduler_side is None:
            return {}
        idx = self.scheduler_side.index
        s = dict(idx.stats.__dict__)
        s.pop("extra", None)
        s.update(used_slots=idx.used_slots, num_slots=idx.num_slots, chunks=len(idx))
        return s
