"""kvcore-sglang: SGLang's KV pools (device, HiCache host, MLA, DSA indexer) for kvcore.

``kvcore.detect(pool_tensors, engine="sglang", hints={...})``; see
:mod:`kvcore_sglang.hints` for the hints, :mod:`kvcore_sglang.pools` for turning SGLang
indices (``out_cache_loc``) into kvcore's ``slot_mapping`` and for hybrid pools, and
:mod:`kvcore_sglang.fixtures` for allocations that repeat SGLang's own.
"""

from kvcore_sglang.hints import SGLangHints
from kvcore_sglang.pools import (
    MambaState,
    NoCache,
    hybrid_linear_layer_entries,
    kv_caches_of,
    layer_entries,
    slot_mapping,
    swa_layer_entries,
    swa_pool_layer_entries,
)

__all__ = [
    "SGLangHints",
    "MambaState",
    "NoCache",
    "hybrid_linear_layer_entries",
    "kv_caches_of",
    "layer_entries",
    "slot_mapping",
    "swa_layer_entries",
    "swa_pool_layer_entries",
]
