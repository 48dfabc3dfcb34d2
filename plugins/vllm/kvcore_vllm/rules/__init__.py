"""vLLM's KV cache layouts as data: one :class:`Rule` per (era, backend family, shape).

A rule says what vLLM hands out and where its bytes live:

* ``logical``: the axis tokens of the per-layer tensor as vLLM's
  ``get_kv_cache_shape`` (<= 0.28) or ``create_kv_cache_views`` (0.29+) gives it, after an
  optional zero-copy ``transform`` (e.g. 0.29+ CPU's ``[B, H, N, C]`` -> ``[B, H, 2, N, D]``);
* ``layouts``: per layout key, the **physical** axis order of the whole cache, ``NL``
  included. The key is ``NHD``/``HND`` (+ ``/cross`` for 0.13-0.2x cross-layer buffers,
  ``/mamba`` for 0.11 / 0.13 ``(2, NB, ...)`` attention caches restrided beside Mamba layers:
  :data:`HYBRID_SOURCE`; ``*`` for a backend with one physical order) for <= 0.28, a
  ``KVCacheLayout`` member for 0.29+ (the era :data:`kvcore_vllm.releases.LAYOUT_ERA`). The physical order *is* the kvcore
  format name: ``NL`` first gives a layer list ``NL_X_...``; ``NL`` inside gives the one
  cross-layer tensor (``NB_NL_TWO_BS_NH_HS``), rebuilt from the per-layer views that
  share one buffer with a uniform layer stride.

:func:`candidates` turns every rule consistent with the hints and the tensors into
:class:`kvcore.Candidate`\\ s (views only; a candidate's views must follow its physical
order, so strides decide NHD vs HND and layer- vs block-outermost wherever they can);
:func:`kvcore.resolve` then merges readings that place bytes identically and raises
:class:`kvcore.AmbiguousLayoutError` for the rest.

Heads-outermost 0.29+ layouts are named by their physical order too: ``LHBNC`` is a layer
list of ``[NH, NB, BS, CS]`` tensors (``NL_X_NH_NB_BS_CS``), ``BHLNC`` the one tensor
``NB_NH_NL_BS_CS``. (kvcore's generic spec reads strides, so the per-layer view
``NL_X_NB_NH_BS_CS`` with a head stride larger than its block stride would move the same
bytes; the name just would not say where they are.)

Facts: each rule's docstring cites vLLM's file and function per release; ``SOURCES.md``
in this plugin lists them all.

The package, one job a module (the rule families in detection order first):

* :mod:`.classic` 0.11 - 0.25 GPU backends; :mod:`.packed` 0.26 - 0.28; :mod:`.kv_cache_layout`
  0.29+ ``KVCacheLayout`` views; :mod:`.paged` ``split_kv_cache`` readings (0.11 CPU, ROCm);
  :mod:`.head_slots` 0.29+ K/V head slots (ROCm, B12X); :mod:`.cpu` CPU_ATTN kernel paths;
  :mod:`.tpu` Pallas; :mod:`.mla` MLA latents and byte records;
* :mod:`.rule` the :class:`Rule` record, :mod:`.sources` the vLLM paths the rules cite,
  :mod:`.table` the ordered table and its named transforms and plane builders;
* :mod:`.platform` which platform wrote a cache, :mod:`.steering` which layout a family
  allocates under the layout hints, :mod:`.match` whether a rule fits the hints and sizes,
  :mod:`.views` tensor helpers, :mod:`.readings` rules -> candidates.

Every name of the former single module stays importable from ``kvcore_vllm.rules``.
"""

# ruff: noqa: F401  (a facade: it re-exports every name of the former single module)
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import Candidate, DetectionError, GeometryError, Source, build_layout, memory_ordered
from kvcore.dtypes import is_fp8, rocm_build
from kvcore.grammar import parse
from kvcore_vllm.hints import BACKEND_FAMILY, KV_CACHE_LAYOUTS, LAYOUT_ALIASES, LAYOUT_FAMILY, MLA_CACHE_DTYPES, VllmHints
from kvcore_vllm.releases import ERAS, KV_CACHE_LAYOUT_ORDERS, LAYOUT_ERA, layout_physical_order, version_tuple
from kvcore_vllm.rules.classic import CLASSIC_RULES
from kvcore_vllm.rules.cpu import (
    _CPU_PATHS,
    AMX_K_ELEMS,
    AMX_K_TOKENS,
    AMX_MULTIPLE,
    AMX_V_ELEMS,
    AMX_V_TOKENS,
    CPU_AMX,
    CPU_RULES,
    CPU_VEC,
    NEON_BF16,
    _kv_regions,
    _neon_any_block,
    _neon_bf16,
    _p_cpu_amx,
    _p_cpu_vec,
    _t_kv_rows,
)
from kvcore_vllm.rules.head_slots import SLOT_RULES, _slot_heads, _t_head_slots, _t_head_slots_nhd
from kvcore_vllm.rules.kv_cache_layout import LAYOUT_RULES
from kvcore_vllm.rules.match import _record_hints_ok, _rule_ok, _sizes, _sizes_ok
from kvcore_vllm.rules.mla import (
    MLA_RULES,
    MLA_WIDTHS,
    ROCM_INDEXER,
    ROCM_INDEXER_CROSS,
    _aiter_pages,
    _p_rocm_tiles,
    _t_squeeze_head,
)
from kvcore_vllm.rules.packed import PACKED_RULES
from kvcore_vllm.rules.paged import (
    K_CHUNK_BYTES,
    PAGED_RULES,
    SPLIT_KV,
    _missing_hints,
    _p_split_kv,
    _t_paged,
    _t_paged5,
    _t_paged_ipex,
    flat_geometry,
    flat_misfit,
)
from kvcore_vllm.rules.platform import CPU_ONLY_BACKENDS, NOT_ROCM_BACKENDS, ROCM_ONLY_BACKENDS, platform_cpu, platform_rocm
from kvcore_vllm.rules.readings import (
    MAX_BARE_LAYERS,
    Reading,
    _bare_view,
    _candidates,
    _fmt_tokens,
    _planes,
    _reading,
    backends_label,
    bare_candidates,
    candidates,
)
from kvcore_vllm.rules.rule import GPU_FAMILIES, Rule, _o, _src, physical_name
from kvcore_vllm.rules.sources import (
    _B12X,
    _CPU,
    _FA,
    _FI,
    _FLEX,
    _IDX,
    _MLA,
    _PALLAS,
    _RIDX,
    _ROCM,
    _RSEG,
    _SPLIT,
    _TR,
    _V4,
    _V33,
    _XL,
    HYBRID_SOURCE,
)
from kvcore_vllm.rules.steering import LAYOUT_OVERRIDES, LAYOUT_READERS, XPU_FORCES_NHD, _key_fits, _rule_families, layout_families
from kvcore_vllm.rules.table import PLANE_BUILDERS, RULES, TRANSFORMS
from kvcore_vllm.rules.tpu import TPU_RULES, _t_pallas
from kvcore_vllm.rules.views import _BYTE_DTYPES, _byte_range, _element_dtype, _element_view, _layers_separate, _ordered, stack_layers
from kvcore_vllm.specs import BLOCKED_SCALE_RECORDS, RECORDS, ROCM_TILE_BYTES, ROCM_TILE_TOKENS

__all__ = [
    "Rule",
    "RULES",
    "candidates",
    "bare_candidates",
    "layout_families",
    "stack_layers",
    "MLA_WIDTHS",
    "MAX_BARE_LAYERS",
    "LAYOUT_READERS",
    "LAYOUT_OVERRIDES",
    "XPU_FORCES_NHD",
    "physical_name",
    "platform_rocm",
    "platform_cpu",
    "SPLIT_KV",
]
