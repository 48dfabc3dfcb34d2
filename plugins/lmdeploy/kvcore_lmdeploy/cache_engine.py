"""An LMDeploy ``CacheEngine`` handed over whole: its ``gpu_cache`` with its configs as hints."""

from __future__ import annotations

from typing import Any

import torch

from kvcore import DetectionError
from kvcore_lmdeploy.hints import parse_hints
from kvcore_lmdeploy.release_window import _version


def _is_cache_engine(x: Any) -> bool:
    return not isinstance(x, (list, tuple, dict, torch.Tensor)) and hasattr(x, "gpu_cache") and hasattr(x, "cache_config")


def _heads_per_rank(mc: Any, world_size: int, version: tuple[int, ...] | None) -> int:
    """KV heads per rank as the release's ``CacheEngine._get_key_block_shape_impl`` computes
    them: 0.6.0-0.6.4 ``if local and not model_config.multi_query_attention: num_heads //=
    world_size`` (an MQA model -- Falcon-7B, DeepSeek-V2 in 0.6.x, ``multi_query_attention=True``
    -- keeps its one head on every rank); 0.6.5+ always divide (the model config builders
    replicate KV heads up to the TP size, ``update_num_kv_heads``). Without a version, a
    ``model_config`` that has the ``multi_query_attention`` field (0.6.0-0.6.4's
    ``ModelConfig``; later ones lack it) follows the 0.6.x rule.

    Raises:
        DetectionError: heads not divisible by the world size (LMDeploy asserts it).
    """
    heads = int(mc.num_key_value_heads)
    mqa = bool(getattr(mc, "multi_query_attention", False))
    if mqa and (version is None or version < (0, 6, 5)):
        return heads
    if heads % world_size:
        raise DetectionError(
            f"lmdeploy: the CacheEngine's model has {heads} KV heads and world_size {world_size}: "
            "CacheEngine._get_key_block_shape_impl asserts num_heads % world_size == 0"
        )
    return heads // world_size


def _unwrap_engine(engine: Any, given: dict) -> tuple[Any, dict]:
    """``CacheEngine.gpu_cache`` and the hints its configs state; a given hint that differs
    is a DetectionError (a hint never overrides the engine's own facts)."""
    cc, mc = engine.cache_config, getattr(engine, "model_config", None)
    facts: dict[str, Any] = {}
    qp = getattr(cc, "quant_policy", None)
    if qp is not None:
        facts["quant_policy"] = int(qp)
    if getattr(cc, "device_type", None) is not None:
        facts["device_type"] = cc.device_type
    kbs = getattr(cc, "kernel_block_size", None)
    if kbs is not None and int(kbs) > 0:  # 0.14 CacheConfig: -1 until __post_init__ sets block_size
        facts["kernel_block_size"] = int(kbs)
    if getattr(cc, "block_size", None) is not None:
        facts["block_size"] = int(cc.block_size)
    if mc is not None:
        for name in ("head_dim", "k_head_dim", "v_head_dim"):
            if getattr(mc, name, None) is not None:
                facts[name] = int(getattr(mc, name))
        if getattr(mc, "num_key_value_heads", None) is not None:
            version = _version(parse_hints({"lmdeploy_version": given.get("lmdeploy_version")}))
            facts["num_kv_heads"] = _heads_per_rank(mc, int(getattr(engine, "world_size", 1) or 1), version)
        if isinstance(getattr(mc, "dtype", None), torch.dtype):
            facts["dtype"] = mc.dtype
    for k, v in facts.items():
        g = given.get(k)
        if g is not None and repr(parse_hints({k: g}).model_dump()[k]) != repr(parse_hints({k: v}).model_dump()[k]):
            raise DetectionError(f"lmdeploy: hint {k}={g!r} contradicts the CacheEngine's own {k}={v!r}")
    return engine.gpu_cache, {**facts, **{k: v for k, v in given.items() if v is not None}}
