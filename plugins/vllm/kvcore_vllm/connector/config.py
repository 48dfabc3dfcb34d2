"""The connector's configuration (``kv_connector_extra_config``) and the store's size.

Both sides of the connector -- the scheduler, which decides what the store holds, and each
worker, which holds the bytes -- read the same configuration and the same ``KVCacheConfig``,
and compute the same number of store slots from them (:func:`plan_store`), so the slot
numbers the scheduler hands out address the same memory on every worker.

Keys (all optional):

=====================  =========================================================================
``capacity_bytes``     CPU memory each worker may hold, in bytes (default 4 GiB). The store
                       holds ``capacity_bytes // (chunk_size * bytes_per_token)`` chunks.
``chunk_size``         tokens per stored chunk (default: vLLM's ``block_size``): the unit of
                       keys, LRU eviction and sharing between requests.
``token_granular``     store a prompt's partial last chunk and serve hits that end inside a
                       chunk (default true); false: whole chunks only.
``save_decode``        store chunks filled by generated tokens too (default true).
=====================  =========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvcore import KVCoreError

__all__ = ["ConnectorConfigError", "ConnectorConfig", "GroupPlan", "StorePlan", "plan_store", "spec_kind"]

DEFAULT_CAPACITY_BYTES = 4 << 30

#: vLLM ``KVCacheSpec`` class names that hold per-token KV (everything else -- ``MambaSpec``
#: and other recurrent state -- holds one state per request, not per token)
_KV_SPECS = {
    "FullAttentionSpec": "attention",
    "SlidingWindowSpec": "attention",
    "ChunkedLocalAttentionSpec": "attention",
    "SinkFullAttentionSpec": "attention",
    "MLAAttentionSpec": "mla",
}


class ConnectorConfigError(KVCoreError, ValueError):
    """The connector's configuration is invalid, or the engine's cache cannot be stored as
    configured (a capacity below one chunk). The message names the key."""


class ConnectorConfig(BaseModel):
    """``kv_transfer_config["kv_connector_extra_config"]`` of :class:`KvcoreConnector`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    capacity_bytes: int = Field(DEFAULT_CAPACITY_BYTES, gt=0)
    chunk_size: int | None = Field(None, gt=0)
    token_granular: bool = True
    save_decode: bool = True

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``.

        Raises:
            ConnectorConfigError: an unknown key (named, with the known ones), or a value
                of the wrong type or range.
        """
        extra = dict(extra or {})
        try:
            return cls(**extra)
        except ValidationError as e:
            bad = "; ".join(f"{'.'.join(map(str, err['loc'])) or '?'}: {err['msg']}" for err in e.errors())
            raise ConnectorConfigError(
                f"kv_connector_extra_config for KvcoreConnector is invalid ({bad}); keys: {', '.join(cls.model_fields)}"
            ) from None


def spec_kind(spec: Any) -> str:
    """``attention``, ``mla``, or the spec's class name for a group that holds state, not
    per-token KV (``MambaSpec``). A ``UniformTypeKVCacheSpecs`` group is classified by its
    layers' specs (all must hold KV for the group to)."""
    name = type(spec).__name__
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        kinds = {spec_kind(s) for s in inner.values()}
        return kinds.pop() if len(kinds) == 1 else name
    return _KV_SPECS.get(name, name)


@dataclass(frozen=True)
class GroupPlan:
    """One vLLM KV-cache group as the store sees it.

    Attributes:
        index: the group's index in ``kv_cache_config.kv_cache_groups``.
        kind: :func:`spec_kind` of its spec.
        block_size: vLLM's (manager's) block size for the group, in tokens.
        num_layers: layers in the group.
        bytes_per_token: bytes one token of the group takes over all its layers (K and V),
            from the spec (``real_page_size_bytes / block_size``); 0 for state groups.
        sliding_window: the spec's ``sliding_window`` (tokens; None for full attention).
        attention_chunk_size: the spec's ``attention_chunk_size`` (chunked local attention).
    """

    index: int
    kind: str
    block_size: int
    num_layers: int
    bytes_per_token: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def first_held(self, num_computed_tokens: int) -> int:
        """The first token whose block vLLM still holds for a request with
        ``num_computed_tokens`` computed: a sliding window frees the blocks wholly before
        ``num_computed - window + 1``, chunked local attention those before the current chunk
        (``SlidingWindowManager`` / ``ChunkedLocalAttentionManager.remove_skipped_blocks``,
        vLLM 0.28-0.32 ``v1/core/single_type_kv_cache_manager.py``); full attention holds all."""
        first = 0
        if self.sliding_window:
            first = max(first, num_computed_tokens - self.sliding_window + 1)
        if self.attention_chunk_size:
            first = max(first, num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size)
        return first

    @property
    def holds_kv(self) -> bool:
        return self.kind in ("attention", "mla")


@dataclass(frozen=True)
class StorePlan:
    """The store both sides agree on.

    Attributes:
        groups: every KV-cache group of the engine, in vLLM's order.
        chunk_size: tokens per chunk.
        num_slots: chunks the store holds.
        bytes_per_token: sum over the KV groups.
        disabled: why the connector stores and loads nothing ("" when it works): a model
            with recurrent state groups (Mamba), whose state at a token cannot be
            restored from per-token KV.
    """

    groups: tuple[GroupPlan, ...]
    chunk_size: int
    num_slots: int
    bytes_per_token: int
    disabled: str = ""

    @property
    def kv_groups(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if g.holds_kv)

    @property
    def slot_bytes(self) -> int:
        return self.chunk_size * self.bytes_per_token


def plan_store(config: ConnectorConfig, kv_cache_config: Any, block_size: int) -> StorePlan:
    """The store's geometry from vLLM's ``KVCacheConfig`` (``kv_cache_groups[i].kv_cache_spec``
    and ``.layer_names``, vLLM 0.28-0.32 ``vllm/v1/kv_cache_interface.py``).

    Args:
        config: the connector's configuration.
        kv_cache_config: vLLM's ``KVCacheConfig`` (both connector roles receive it).
        block_size: ``cache_config.block_size``, the default chunk size.

    Raises:
        ConnectorConfigError: the capacity holds less than one chunk (the message gives the
            bytes one chunk needs).
    """
    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = spec_kind(spec)
        bs = int(spec.block_size)
        nl = len(g.layer_names)
        per_layer = 0
        if kind in ("attention", "mla"):
            page = getattr(spec, "real_page_size_bytes", None) or spec.page_size_bytes
            per_layer = int(page) // bs
        window = getattr(spec, "sliding_window", None)
        local = getattr(spec, "attention_chunk_size", None)
        groups.append(
            GroupPlan(
                i,
                kind,
                bs,
                nl,
                per_layer * nl,
                int(window) if isinstance(window, int) else None,
                int(local) if isinstance(local, int) else None,
            )
        )
    chunk = config.chunk_size or int(block_size)
    state = [g for g in groups if not g.holds_kv]
    disabled = ""
    if state:
        disabled = (
            f"KV-cache group(s) {', '.join(f'{g.index} ({g.kind})' for g in state)} hold recurrent state, not per-token KV: "
            "a request cannot start from stored KV without that state at the same token, so every request recomputes"
        )
    bpt = sum(g.bytes_per_token for g in groups)
    if disabled or bpt == 0:
        return StorePlan(tuple(groups), chunk, 0, bpt, disabled or "the engine has no KV-cache group that holds KV")
    slots = config.capacity_bytes // (chunk * bpt)
    if slots < 1:
        raise ConnectorConfigError(
            f"capacity_bytes={config.capacity_bytes} holds no chunk: one chunk of {chunk} tokens takes {chunk * bpt} bytes "
            f"({bpt} bytes per token over {sum(g.num_layers for g in groups)} layers); raise capacity_bytes or lower chunk_size"
        )
    return StorePlan(tuple(groups), chunk, slots, bpt)
