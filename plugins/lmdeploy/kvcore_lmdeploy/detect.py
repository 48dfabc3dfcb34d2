"""Detection of LMDeploy's PyTorch-engine KV caches (``engine="lmdeploy"``).

Accepted inputs (``lmdeploy/pytorch/engine/cache_engine.py::CacheEngine``):

* ``gpu_cache`` / ``cpu_cache`` -- a list over layers of tuples ``(k, v)`` (unquantised,
  fp8, MLA) or ``(k, v, k_scales_zeros, v_scales_zeros)`` (int4 / int8 / TurboQuant, MLA
  int4 / int8), each tensor ``[NB, *block_shape]``. Every generation hands these out;
  0.6.0-0.6.3 as separate tensors, 0.6.4-0.11.0 as views of cross-layer tensors, 0.11.1+
  as views of one uint8 pool.
* ``full_gpu_cache`` of 0.6.4-0.11.0 -- the tuple of cross-layer tensors ``[NL, NB, *block_shape]``.
* ``full_gpu_cache`` of 0.11.1+ -- the uint8 pool ``[NL, NB, bytes]`` with the hints
  ``num_kv_heads``, ``head_dim`` (or ``k_head_dim`` + ``v_head_dim``; MLA: ``v_head_dim=0``),
  ``block_size`` (or ``kernel_block_size``) and ``dtype``; cut as
  ``CacheEngine.allocate_caches`` cuts it.
* a ``CacheEngine`` itself: its ``gpu_cache``, with its ``cache_config`` / ``model_config``
  as hints (hints given too must agree; heads per rank follow the release's
  ``_get_key_block_shape_impl``).

Block orders (the backend's ``get_k_block_shape``, per release -- ``SOURCES.md``): CUDA
``(BS, NH, HS)``; Cambricon ``(NH, BS, HS)`` (0.7+); Ascend ``(BS, NH, HS)``, but on Ascend
310P in 0.8.0-0.11.0 ``((NH*HS+15)//16, BS, 16)`` "NZ" blocks; MACA ``(NH, BS, HS)`` in
0.6.2-0.6.3, split-K (not described) in 0.6.4-0.9.x, ``(BS, NH, HS)`` from 0.10. Every
reading the tensors, the hints and the release allow is a candidate; two that move
different bytes raise :class:`kvcore.AmbiguousLayoutError` naming the hint that decides
(``device_type``, ``soc_version``, ``lmdeploy_version``, a size).

Normalised to (``kvcore_lmdeploy.formats``): per-layer ``(K, V)`` pairs of one head size
-> ``NL_X_TWO_X_NB_BS_NH_HS`` / ``NL_X_TWO_X_NB_NH_BS_HS``; Ascend 310P NZ -> ``K=NL_X_NB_NH_HSC_BS_HSE+V=...``;
MLA (V of head size 0) -> the K tensors, ``NL_X_NB_BS_ONE_HS`` (cross-layer ``NL_NB_BS_ONE_HS``);
quantised -> ``{role: per-layer list}`` under ``K=NL_X_NB_BS_NH_HS+V=...+KSZ=...+VSZ=...``
(TurboQuant: ``KN``, ``VN``; MLA: ``KV=...+KSZ=...+VSZ=...``); cross-layer tensors and the
pool -> ``{role: tensor}`` under the ``NL_NB_...`` names.

Blocks are the tensors' blocks: with LMDeploy 0.14's ``kernel_block_size`` below
``block_size`` those are kernel blocks (the detection note says so);
:mod:`kvcore_lmdeploy.blocks` maps the block manager's ids.

This module takes the input apart (a ``CacheEngine``, per-layer tuples, cross-layer tensors,
the pool); the readers live beside it, one a module: :mod:`~kvcore_lmdeploy.release_window`
(which releases may have written the cache), :mod:`~kvcore_lmdeploy.block_orders` (``RULES``),
:mod:`~kvcore_lmdeploy.cache_engine`, :mod:`~kvcore_lmdeploy.plain_caches` (pairs, NZ, MLA),
:mod:`~kvcore_lmdeploy.quant_caches`, :mod:`~kvcore_lmdeploy.pool` (:func:`carve_pool`) and
:mod:`~kvcore_lmdeploy.checks` (what they share).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import DetectionError
from kvcore_lmdeploy.cache_engine import _is_cache_engine, _unwrap_engine
from kvcore_lmdeploy.checks import _INT_DTYPES, _check_memory_order, _same
from kvcore_lmdeploy.hints import LMDeployHints, parse_hints
from kvcore_lmdeploy.plain_caches import _plain
from kvcore_lmdeploy.pool import _pool
from kvcore_lmdeploy.quant_caches import _quant
from kvcore_lmdeploy.release_window import _context, _window

__all__ = ["detect_lmdeploy", "GEOMETRY_HINTS", "carve_pool", "RULES", "MLA_FP8_HEAD_DIM"]

# the names this module held before its readers moved out, still importable from it
from collections.abc import Sequence  # noqa: F401, E402
from dataclasses import dataclass  # noqa: F401, E402

from kvcore import AmbiguousLayoutError, Candidate, GeometryError, memory_ordered, resolve  # noqa: F401, E402
from kvcore_lmdeploy import formats as F  # noqa: F401, E402
from kvcore_lmdeploy.block_orders import _OB, RULES, Rule, _backends, _readings  # noqa: F401, E402
from kvcore_lmdeploy.cache_engine import _heads_per_rank  # noqa: F401, E402
from kvcore_lmdeploy.checks import (  # noqa: F401, E402
    _FP8,
    _FP8_DTYPES,
    GEOMETRY_HINTS,
    MLA_FP8_HEAD_DIM,
    _block_note,
    _bs_nh,
    _fits,
    _given,
    _head_check,
    _mla_head_check,
    _resolve,
    _value_dtype_check,
)
from kvcore_lmdeploy.plain_caches import _FP8_WHY, _INT_WHY, _mla, _mla_block, _nz_candidate, _nz_heads  # noqa: F401, E402
from kvcore_lmdeploy.pool import _esize, _kernel_blocks, _plan, _plan_bytes, carve_pool  # noqa: F401, E402
from kvcore_lmdeploy.quant_caches import _int_backends_check, _mla_quant, _quant_readings, _side_checks  # noqa: F401, E402
from kvcore_lmdeploy.release_window import _HOLDERS, _INF, _kernel_blocks_possible, _span, _version, _vstr  # noqa: F401, E402


def detect_lmdeploy(kv_caches: Any, hints: Any) -> Any:
    """Recognise an LMDeploy KV cache (see the module docstring for the inputs).

    Returns:
        a :class:`kvcore.Detection` (through :func:`kvcore.resolve`).
    Raises:
        DetectionError: not an LMDeploy cache, a plane missing, planes disagreeing on
            blocks / tokens / heads, a hint the tensors or another hint contradict (the
            release named by ``lmdeploy_version`` included), or a layout this plugin does
            not claim (custom per-model caches, the 656-byte MLA fp8 records, MACA's split K,
            Ascend's flattened blocks, K/V of different head sizes).
        AmbiguousLayoutError: two readings move different bytes and nothing decides
            (``device_type``, ``soc_version``, ``lmdeploy_version``, a size hint).
    """
    raw = dict(hints or {})
    if _is_cache_engine(kv_caches):
        kv_caches, raw = _unwrap_engine(kv_caches, raw)
    h = parse_hints(raw)
    _context(h)
    if isinstance(kv_caches, torch.Tensor):
        return _pool(kv_caches, h)
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise DetectionError(
            f"lmdeploy: expected CacheEngine.gpu_cache (a list of per-layer tuples), the tuple of cross-layer tensors "
            f"(0.6.4-0.11.0 full_gpu_cache), the uint8 pool (0.11.1+), or a CacheEngine; got {type(kv_caches).__name__}"
        )
    if all(isinstance(e, torch.Tensor) for e in kv_caches):
        if len(kv_caches) == 1 and kv_caches[0].dim() == 3:
            return _pool(kv_caches[0], h)
        return _cross_layer(list(kv_caches), h)
    if all(isinstance(e, (list, tuple)) and e and all(isinstance(t, torch.Tensor) for t in e) for e in kv_caches):
        return _per_layer([tuple(e) for e in kv_caches], h)
    raise DetectionError(
        "lmdeploy: expected a list of per-layer tuples of tensors (CacheEngine.gpu_cache: (k, v) or (k, v, k_scales_zeros, "
        "v_scales_zeros) per layer) or a tuple of cross-layer tensors; got a mix of tensors and containers"
    )


# -- per-layer tuples (CacheEngine.gpu_cache) -----------------------------------------------


def _per_layer(entries: list[tuple], h: LMDeployHints) -> Any:
    window = _window(h, "gpu_cache")
    n = {len(e) for e in entries}
    if len(n) != 1:
        raise DetectionError(f"lmdeploy: the per-layer tuples have different lengths {sorted(n)}; CacheEngine gives every layer alike")
    n = n.pop()
    cols = [[e[i] for e in entries] for i in range(n)]
    refs = [_same(c, f"tensor {i} of the per-layer tuple") for i, c in enumerate(cols)]
    if any(r.dim() != 4 for r in refs):
        raise DetectionError(
            f"lmdeploy: per-layer cache tensors are [num_blocks, *block_shape] (4-D); got {[tuple(r.shape) for r in refs]} "
            "(MACA's split-K blocks of 0.6.4-0.9.x and Ascend's (block_size, num_heads * head_size) blocks of 0.6.x are not "
            "described by this plugin)"
        )
    _check_memory_order(refs, "a per-layer cache tensor")
    k, v = refs[0], refs[1] if n > 1 else None
    if n == 1:
        raise DetectionError("lmdeploy: each layer holds one tensor; CacheEngine gives (k, v[, k_scales_zeros, v_scales_zeros])")
    if n == 2:
        return _plain(cols[0], cols[1], k, v, h, cross=False, window=window)
    if n == 3:
        raise DetectionError(
            "lmdeploy: each layer holds 3 tensors: a quantised cache's plane is missing (CacheEngine gives (k, v, "
            "k_scales_zeros, v_scales_zeros) per layer for quant_policy 4 / 8 / 42)"
        )
    if n == 4 and refs[2].dim() == 4 and refs[0].dtype in _INT_DTYPES:
        return _quant(dict(zip(("K", "V", "S1", "S2"), cols)), refs, h, cross=False, window=window)
    raise DetectionError(
        f"lmdeploy: each layer holds {n} tensors {[(tuple(r.shape), str(r.dtype)) for r in refs]}; beyond (k, v) and the "
        "scale/zero tensors these are ModelConfig.cache_shapes (custom per-model caches, e.g. DeepSeek-V3.2's indexer), "
        "which kvcore-lmdeploy does not describe"
    )


# -- cross-layer tensors (0.6.4-0.11.0 full_gpu_cache) ----------------------------------------------


def _cross_layer(ts: list[torch.Tensor], h: LMDeployHints) -> Any:
    if any(t.dim() != 5 for t in ts):
        raise DetectionError(
            f"lmdeploy: a tuple of tensors is read as CacheEngine.full_gpu_cache (0.6.4-0.11.0): cross-layer tensors "
            f"[num_layers, num_blocks, *block_shape] (5-D); got {[tuple(t.shape) for t in ts]}. For per-layer tensors pass "
            "CacheEngine.gpu_cache (a list of per-layer tuples)"
        )
    window = _window(h, "cross-layer tensors")
    _check_memory_order(ts, "a cross-layer cache tensor")
    if len({int(t.shape[0]) for t in ts}) != 1:
        raise DetectionError(f"lmdeploy: the cross-layer tensors disagree on num_layers: {[int(t.shape[0]) for t in ts]}")
    if len(ts) == 2:
        return _plain([ts[0]], [ts[1]], ts[0], ts[1], h, cross=True, window=window)
    if len(ts) == 4 and ts[0].dtype in _INT_DTYPES:
        return _quant({"K": [ts[0]], "V": [ts[1]], "S1": [ts[2]], "S2": [ts[3]]}, ts, h, cross=True, window=window)
    raise DetectionError(
        f"lmdeploy: {len(ts)} cross-layer tensors; CacheEngine.full_gpu_cache holds (K, V) or, quantised, (K, V, "
        "k_scales_zeros, v_scales_zeros)" + (": a plane is missing" if len(ts) == 3 else "")
    )
