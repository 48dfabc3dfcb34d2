"""kvcore-transformers: Hugging Face transformers' KV cache layouts for kvcore.

Detect any transformers cache with ``kvcore.detect(cache, engine="transformers")``:

* ``DynamicCache`` / ``StaticCache`` (transformers 4.53 ``key_cache``/``value_cache``
  lists and >= 4.54 ``cache.layers[i].keys/.values``): format ``NL_X_TWO_X_NB_NH_BS_HS``,
  ``num_blocks`` = batch, ``block_size`` = sequence length, slot = ``b * seq + position``.
  Sliding-window layers are shorter: ``kvcore.detect_per_layer(kv_caches(cache),
  engine="transformers")`` gives one layout per group.
* the continuous-batching ``PagedAttentionCache`` (5.18 - 5.24): format
  ``NB_NL_TWO_BS_NH_HS`` per attention-type group over the cache's one uint8 tensor;
  :func:`detect_paged` returns every group with its model layer ids.

See :mod:`kvcore_transformers.caches` for the engine facts and their sources.
"""

from __future__ import annotations

from .caches import LAYER_PAIRS_FORMAT, PAGED_FORMAT, PagedGroup, kv_caches, paged_groups
from .paged import detect_paged, request_slots
from .versions import PAGED_RANGE, SUPPORTED_RANGE, check_version

__all__ = [
    "LAYER_PAIRS_FORMAT",
    "PAGED_FORMAT",
    "PAGED_RANGE",
    "SUPPORTED_RANGE",
    "PagedGroup",
    "check_version",
    "detect_paged",
    "kv_caches",
    "paged_groups",
    "request_slots",
]
