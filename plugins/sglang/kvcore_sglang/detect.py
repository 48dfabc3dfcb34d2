"""Detection of SGLang's KV pools (engine name ``"sglang"``).

Every way the tensors can be read is a :class:`kvcore.Candidate` (format + views of
the caller's tensors, never copies); hints drop the readings they contradict
(:mod:`kvcore_sglang.hints`), and :func:`kvcore.resolve` keeps the readings that build
and raises :class:`kvcore.AmbiguousLayoutError` when two of them place bytes
differently. Inputs (after :func:`kvcore.detect` turned dicts into lists):

=============================================  ==========================================
input                                          readings
=============================================  ==========================================
``[k_buffer, v_buffer]`` (two lists)            MHA device pool (0.5.3 separate tensors;
                                               0.5.23 halves of one ``(2, rows, NH, HS)``
                                               buffer per layer)
``[(k0, v0), (k1, v1), ...]``                   MHA, one pair per layer (detect_per_layer)
flat ``k_buffer + v_buffer`` (``2*NL``)          MHA, K layers then V layers (``k_v``)
flat ``kv_buffer`` ``(rows, 1, D)``              MLA; with an even count and no hint also
                                               one-head MHA ``k_v``: ambiguous
flat 2-D uint8 ``(pages, page_size * 132)``     DSA/NSA indexer pool
one tensor                                     HiCache host pool (``mem_layout``), or the
                                               Ascend cross-layer pool (``layout="ascend"``)
``[kv_buffer[0], kv_buffer[1]]`` (5-D)          Ascend pool halves, re-viewed as one tensor
:class:`~kvcore_sglang.pools.MambaState`        excluded: not KV
=============================================  ==========================================

Per-layer tensors: 3-D ``(rows, NH, HS)`` are NHD token rows (``rows = size +
page_size``, SGLang 0.5.3 ``memory_pool.py::MHATokenToKVPool._create_buffers``);
4-D ``(P, A, B, HS)`` are HND page rows ``(num_pages, NH, page_size, HS)`` (0.5.23
``MHATokenToKVPool._kv_buffer_shapes``, ``use_hnd``) or page-split NHD views
``(NB, BS, NH, HS)`` (LMCache's MP path): ``layout``, ``page_size`` or
``num_kv_heads`` decide.

This module takes the input apart (lists, nesting, one tensor, fp8 variants); the readers
live beside it, one a module: :mod:`~kvcore_sglang.device_pools` (MHA and MLA device pools),
:mod:`~kvcore_sglang.indexer_pool`, :mod:`~kvcore_sglang.host_pools` (HiCache host pools,
Ascend), :mod:`~kvcore_sglang.fp8_variants` (ROCm fp8 names) and
:mod:`~kvcore_sglang.deciding` (what they share).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import AmbiguousLayoutError, Candidate, Detection, DetectionError
from kvcore.dtypes import dtype_name
from kvcore_sglang.deciding import _GIVEN, _check, _decide, _one_storage, _same
from kvcore_sglang.device_pools import _mha_candidates, _mla_candidates
from kvcore_sglang.fp8_variants import _dtype_variants
from kvcore_sglang.hints import SGLangHints, element_dtype, parse_hints
from kvcore_sglang.host_pools import _ascend_from_halves, _host_candidates
from kvcore_sglang.indexer_pool import _indexer
from kvcore_sglang.pools import MambaState, NoCache

__all__ = ["detect_sglang"]

# the names this module held before its readers moved out, still importable from it
import contextvars  # noqa: F401, E402

from kvcore import KVCoreError, build_layout, resolve  # noqa: F401, E402
from kvcore.detection import physical_permutation  # noqa: F401, E402
from kvcore.dtypes import fp8_dtype, rocm_build  # noqa: F401, E402
from kvcore_sglang.deciding import _GEOMETRY, ENGINE  # noqa: F401, E402
from kvcore_sglang.device_pools import _as_kv_planes, _mha_readings  # noqa: F401, E402
from kvcore_sglang.formats import HOST_FORMATS, INDEXER_FORMAT  # noqa: F401, E402
from kvcore_sglang.fp8_variants import FP8_DTYPE_SINCE, _gfx94_of_tensors, _on_gpu, _rocm_fp8  # noqa: F401, E402
from kvcore_sglang.host_pools import _ascend_candidates  # noqa: F401, E402
from kvcore_sglang.indexer import RECORD_SCALE_BYTES, index_page_view  # noqa: F401, E402
from kvcore_sglang.indexer_pool import _SKIP_TOPK_REASON, _indexer_rows, _kernel_pages_per_row  # noqa: F401, E402

_MAMBA_REASON = (
    "SGLang recurrent (Mamba / linear-attention) state: MambaPool conv/temporal state tensors are indexed by request slot, "
    "not by token (0.5.3 memory_pool.py::MambaPool), so they are not KV; kvcore moves KV tokens only"
)


def detect_sglang(kv_caches: Any, hints: dict[str, Any] | None) -> Detection:
    """Recognise an SGLang KV pool (see the module docstring for the inputs).

    Returns:
        a :class:`kvcore.Detection` (``format=None`` with ``excluded`` for Mamba state).
    Raises:
        kvcore.DetectionError: nothing fits (the message says why each reading failed);
            a hint contradicts the tensors; K and V head sizes differ.
        kvcore.AmbiguousLayoutError: two readings fit and no hint decides.
    """
    h = parse_hints(hints)
    variants, deciding = _dtype_variants(h, kv_caches)
    if len(variants) == 1:
        return _detect_as(kv_caches, variants[0][0])
    found = []
    for hv, label in variants:  # SGLang's fp8 string where the platform / version / GPU does not tell
        det = _detect_as(kv_caches, hv)
        found.append(f"{det.format} as {dtype_name(hv.dtype)} ({label})")
    raise AmbiguousLayoutError(
        f"sglang: kv_cache_dtype={h.dtype!r} names a platform-dependent fp8 dtype: the OCP type off ROCm; on ROCm (is_hip()) "
        f"up to 0.5.6.post1 ModelRunner.init_memory_pool picks float8_{h.dtype[4:]}fnuz, from 0.5.6.post2 both fp8 names "
        "are fp8_kernel.fp8_dtype (float8_e4m3fnuz on gfx94x, float8_e4m3fn otherwise). Nothing given decides these "
        f"tensors: {'; '.join(found)}. Pass {', '.join(deciding)} (those that apply), or the exact dtype",
        candidates=found,
        hints=[*deciding, "dtype"],
    )


def _detect_as(kv_caches: Any, h: SGLangHints) -> Detection:
    token = _GIVEN.set(h.model_dump(exclude_none=True))
    try:
        return _detect(kv_caches, h)
    finally:
        _GIVEN.reset(token)


def _detect(kv_caches: Any, h: SGLangHints) -> Detection:
    if isinstance(kv_caches, torch.Tensor):
        return _decide(_host_candidates(kv_caches, h), "host pool", ["mem_layout", "layout", "num_layers", "num_kv_heads", "is_mla"])
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise DetectionError(
            f"sglang: expected a list of per-layer tensors, [k_buffer, v_buffer] or a host pool tensor, got {type(kv_caches).__name__}"
        )
    entries = list(kv_caches)
    if any(isinstance(e, (MambaState, NoCache)) for e in entries):
        if all(isinstance(e, NoCache) for e in entries):
            return Detection(
                format=None,
                excluded="layers that hold no cache (a hybrid model's MoE-only / MLP layers, which SGLang's global layer ids "
                "skip: HybridLinearKVPool.full_attention_layer_id_mapping): not KV",
            )
        if all(isinstance(e, MambaState) for e in entries):
            return Detection(format=None, excluded=_MAMBA_REASON)
        raise DetectionError("sglang: this list mixes Mamba state and KV layers; use kvcore.detect_per_layer (one entry per layer)")
    if all(isinstance(e, torch.Tensor) for e in entries):
        return _flat(entries, h)
    if all(isinstance(e, (list, tuple)) for e in entries):
        return _nested(entries, h)
    raise DetectionError("sglang: a list whose entries mix tensors and lists; pass [k_buffer, v_buffer], kv_buffer, or one entry per layer")


# -- lists ------------------------------------------------------------------------------


def _flat(ts: list[torch.Tensor], h: SGLangHints) -> Detection:
    ranks = sorted({t.dim() for t in ts})
    if len(ranks) != 1:
        raise DetectionError(f"sglang: per-layer tensors of ranks {ranks} in one list; use kvcore.detect_per_layer to detect each group")
    if h.kv_list_layout in ("nested", "pairs"):
        raise DetectionError(
            f"sglang: kv_list_layout={h.kv_list_layout!r} but the input is a flat list of tensors; "
            "use kv_list_layout='k_v' (K layers then V layers) or pass [k_buffer, v_buffer]"
        )
    rank = ranks[0]
    if h.kv_list_layout == "unified":
        return _unified(ts, h)
    if rank == 2:
        return _indexer(ts, h)
    if rank == 5:
        return _decide(_ascend_from_halves(ts, h), "device pool", ["layout"])
    ref = _same(ts, "kv_caches")
    reasons: list[str] = []
    cands: list[Candidate] = []
    one_head = (rank == 3 and ref.shape[1] == 1) or (rank == 4 and ref.shape[2] == 1)
    mla_ok = _check(reasons, h.is_mla is not False, "is_mla=False excludes MLA") and _check(
        reasons, h.kv_list_layout != "k_v", "kv_list_layout='k_v' says MHA K/V lists, not MLA"
    )
    if one_head and mla_ok:
        cands += _mla_candidates(ts, h, reasons)
    elif not one_head:
        reasons.append(f"MLA pools are (rows, 1, D) per layer; these are {tuple(ref.shape)}")
    n = len(ts)
    if _check(reasons, h.is_mla is not True, "is_mla=True excludes MHA") and _check(
        reasons, n % 2 == 0, f"a flat MHA list holds 2*NL tensors (K layers then V layers); this one holds {n}"
    ):
        cands += _mha_candidates(
            ts[: n // 2], ts[n // 2 :], h, reasons, {"kv_list_layout": "k_v", "is_mla": False}, "MHA k_buffer + v_buffer"
        )
    return _decide(
        cands, "device pool", ["is_mla", "kv_list_layout"] + (["layout", "page_size", "num_kv_heads"] if rank == 4 else []), reasons
    )


def _nested(entries: list[Any], h: SGLangHints) -> Detection:
    if not all(all(isinstance(x, torch.Tensor) for x in e) for e in entries):
        raise DetectionError("sglang: a nested input holds tensors one level down: [k_buffer, v_buffer] or [(k, v), ...]")
    # per-layer tuples of state tensors of different ranks (conv vs temporal state): not KV
    if all(len({x.dim() for x in e}) > 1 for e in entries):
        return Detection(format=None, excluded=_MAMBA_REASON)
    if h.kv_list_layout == "k_v":
        raise DetectionError(
            "sglang: kv_list_layout='k_v' means a flat list of 2*NL tensors, but the input nests lists; drop the hint or flatten it"
        )
    if h.is_mla:
        raise DetectionError(
            "sglang: is_mla=True but the input is a nested K/V container; an MLA pool is one list kv_buffer of (rows, 1, D) tensors"
        )
    reasons: list[str] = []
    readings: list[tuple[str, list[torch.Tensor], list[torch.Tensor]]] = []
    if h.kv_list_layout in (None, "nested"):
        # SGLang keeps k_buffer and v_buffer as Python lists of equal length
        if len(entries) == 2 and all(isinstance(e, list) for e in entries) and len(entries[0]) == len(entries[1]):
            readings.append(("nested", list(entries[0]), list(entries[1])))
        else:
            reasons.append("[k_buffer, v_buffer] is two Python lists of equal length (SGLang's k_buffer / v_buffer)")
    if h.kv_list_layout in (None, "pairs"):
        # one (k, v) per layer, as SGLang's get_kv_buffer(layer_id) returns it
        if all(len(e) == 2 for e in entries):
            readings.append(("pairs", [e[0] for e in entries], [e[1] for e in entries]))
        else:
            reasons.append("one (k, v) pair per layer needs exactly two tensors per entry")
    if len(readings) == 2:
        # 0.5.23 allocates a layer's K and V as halves of one buffer: only the reading that
        # pairs each layer's K with its own V pairs tensors of one storage
        shared = [r for r in readings if all(_one_storage(k, v) for k, v in zip(r[1], r[2]))]
        if len(shared) == 1:
            readings = shared
    cands: list[Candidate] = []
    for name, ks, vs in readings:
        cands += _mha_candidates(ks, vs, h, reasons, {"kv_list_layout": name}, f"MHA {name}")
    four_d = any(r[1] and r[1][0].dim() == 4 for r in readings)
    return _decide(cands, "device pool", ["kv_list_layout"] + (["layout", "page_size", "num_kv_heads"] if four_d else []), reasons)


#: LMCache 0.5.6's SGLang connector for SGLang's unified radix cache, which pages SGLang's own buffers
UNIFIED_SOURCE = (
    "LMCache 0.5.6 lmcache/integration/sglang/unified_kv_adapter.py::SGLangUnifiedKVAdapter._resolve_pool_tensors "
    "([*k_buffer, *v_buffer] of an NHD MHATokenToKVPool, or kv_buffer) and unified_lmcache_mp_connector.py::"
    "_to_wire_block_tensor (tensor.view(num_blocks, page_size, *shape[1:]) / .view(num_blocks, page_size, -1)), "
    "registered with layout_hints={'kv_list_layout': 'unified'}"
)


def _unified(ts: list[torch.Tensor], h: SGLangHints) -> Detection:
    """LMCache's unified per-component views of SGLang's buffers: each entry one paged
    component (see :data:`UNIFIED_SOURCE`). Rank 4 ``[NB, BS, NH, HS]`` (an MHA pool's K
    or V buffer of one layer) is ``NL_X_NB_BS_NH_HS``; rank 3 ``[NB, BS, D]`` (an MLA
    ``kv_buffer``) ``NL_X_NB_BS_HS``. The connector allows contiguous NHD / MLA buffers
    only.

    Raises:
        kvcore.DetectionError: another rank, entries that differ, permuted strides, or
            hints the views contradict.
    """
    ref = _same(ts, "kv_caches")
    if ref.dim() not in (3, 4):
        raise DetectionError(
            f"sglang: kv_list_layout='unified' entries are paged components [NB, page_size, NH, HS] (MHA K or V) or "
            f"[NB, page_size, D] (MLA) ({UNIFIED_SOURCE}); got {ref.dim()}-D {tuple(ref.shape)}"
        )
    if not all(t.is_contiguous() for t in ts):
        raise DetectionError(
            "sglang: kv_list_layout='unified' views are contiguous NHD / MLA pages (the connector refuses others: "
            "'LMCache MP currently requires contiguous SGLang NHD/MLA tensors'); these strides are permuted"
        )
    bs = int(ref.shape[1])
    if h.page_size not in (None, bs):
        raise DetectionError(f"sglang: page_size hint {h.page_size} but the unified views hold pages of {bs} tokens")
    if ref.dim() == 4:
        nh, hs = int(ref.shape[2]), int(ref.shape[3])
        if h.is_mla is True or h.num_kv_heads not in (None, nh) or h.head_size not in (None, hs):
            raise DetectionError(
                f"sglang: unified MHA component views [NB, {bs}, {nh}, {hs}] but the hints say is_mla={h.is_mla}, "
                f"num_kv_heads={h.num_kv_heads}, head_size={h.head_size}"
            )
        fmt, what = "NL_X_NB_BS_NH_HS", "MHA K/V component"
    else:
        if h.is_mla is False or h.head_size not in (None, int(ref.shape[2])):
            raise DetectionError(
                f"sglang: unified MLA views [NB, {bs}, {ref.shape[2]}] but the hints say is_mla={h.is_mla}, head_size={h.head_size}"
            )
        fmt, what = "NL_X_NB_BS_HS", "MLA latent"
    return Detection(
        format=fmt,
        kv_caches=list(ts),
        dtype=element_dtype(ref.dtype, h),
        note=f"SGLang unified {what} views, one list entry per component ({UNIFIED_SOURCE})",
    )
