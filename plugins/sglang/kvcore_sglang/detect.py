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
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from kvcore import AmbiguousLayoutError, Candidate, Detection, DetectionError, KVCoreError, build_layout, resolve
from kvcore.detection import physical_permutation
from kvcore.dtypes import dtype_name, fp8_dtype, rocm_build
from kvcore_sglang.formats import HOST_FORMATS, INDEXER_FORMAT
from kvcore_sglang.hints import SGLangHints, element_dtype, parse_hints
from kvcore_sglang.indexer import RECORD_SCALE_BYTES, index_page_view
from kvcore_sglang.pools import MambaState, NoCache

__all__ = ["detect_sglang"]

ENGINE = "sglang"
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


_GIVEN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvcore_sglang_given", default=None)

#: the first SGLang release whose ROCm fp8 KV dtype is ``fp8_kernel.fp8_dtype`` for both
#: ``fp8_e4m3`` and ``fp8_e5m2`` (0.5.6.post1 ``model_runner.py::ModelRunner.init_memory_pool``
#: still picks ``float8_e4m3fnuz`` / ``float8_e5m2fnuz``; 0.5.6.post2 and 0.5.7 use ``fp8_dtype``;
#: 0.5.23 moved the choice to ``mem_cache/kv_cache_dtype.py::configure_kv_cache_dtype``)
FP8_DTYPE_SINCE = (0, 5, 6, 2)


def _rocm_fp8(kind: str, unified: bool, gfx94: bool) -> torch.dtype:
    """SGLang's KV dtype for ``--kv-cache-dtype fp8_<kind>`` on ROCm.

    ``unified`` (0.5.6.post2+): ``fp8_dtype`` of ``layers/quantization/fp8_kernel.py``
    (0.5.23: ``kernels/ops/quantization/fp8_kernel.py``): ``float8_e4m3fnuz`` when
    ``is_fp8_fnuz()`` (``"gfx94" in gcnArchName`` of device 0), else ``float8_e4m3fn`` --
    for e5m2 too. Before: ``float8_e4m3fnuz`` / ``float8_e5m2fnuz`` on every ROCm GPU."""
    if unified:
        return torch.float8_e4m3fnuz if gfx94 else torch.float8_e4m3fn
    return fp8_dtype(kind, fnuz=True)


def _gfx94_of_tensors(kv_caches: Any) -> bool | None:
    """``"gfx94" in gcnArchName`` of the ROCm GPU holding the tensors (SGLang's
    ``is_fp8_fnuz``); None when they are not on a ROCm GPU of this process."""
    if not rocm_build(kv_caches):
        return None
    from kvcore.detection import tensors_in

    for t in tensors_in(kv_caches) if not isinstance(kv_caches, torch.Tensor) else [kv_caches]:
        if t.device.type == "cuda":
            try:
                return "gfx94" in torch.cuda.get_device_properties(t.device).gcnArchName
            except Exception:  # noqa: BLE001 - no arch name: unknown, not an error
                return None
    return None


def _on_gpu(kv_caches: Any) -> bool:
    from kvcore.detection import tensors_in

    ts = tensors_in(kv_caches) if not isinstance(kv_caches, torch.Tensor) else [kv_caches]
    return any(t.device.type == "cuda" for t in ts)


def _dtype_variants(h: SGLangHints, kv_caches: Any) -> tuple[list[tuple[SGLangHints, str]], list[str]]:
    """The hints to read the tensors with, one per dtype SGLang's ``fp8_e4m3`` /
    ``fp8_e5m2`` can name here, with a label, and the hints that would decide.

    Off ROCm the OCP type. On ROCm (``device_type='rocm'``, else the torch build of the
    process holding the tensors: SGLang's own ``is_hip()``) it follows ``sglang_version``
    (:data:`FP8_DTYPE_SINCE`) and the GPU (``gcn_arch``, else the ``gcnArchName`` of the
    ROCm GPU holding the tensors); for meta tensors (a description) the platform is open.
    Readings that differ in dtype are returned for the caller to report as an ambiguity.

    Raises:
        DetectionError: a ``gcn_arch`` hint that the GPU holding the tensors contradicts.
    """
    if not isinstance(h.dtype, str):
        return [(h, "")], []
    kind = h.dtype[len("fp8_") :]
    if h.device_type is not None:
        platform: bool | None = h.device_type == "rocm"
        if h.gcn_arch is not None and not platform:
            raise DetectionError(f"sglang: hint gcn_arch={h.gcn_arch!r} names a ROCm GPU, but device_type={h.device_type!r}")
    elif h.gcn_arch is not None:  # the caller says ROCm; a CUDA GPU of this (non-ROCm) process says otherwise
        if rocm_build(kv_caches) is False and _on_gpu(kv_caches):
            raise DetectionError(
                f"sglang: hint gcn_arch={h.gcn_arch!r} names a ROCm GPU, but the tensors are on a GPU of a CUDA (not ROCm) torch build"
            )
        platform = True
    else:
        platform = rocm_build(kv_caches)
    ocp = fp8_dtype(kind, fnuz=False)
    if platform is False:
        return [(h.model_copy(update={"dtype": ocp}), "")], []
    v = h.version()
    versions = [v >= FP8_DTYPE_SINCE] if v is not None else [False, True]
    seen = _gfx94_of_tensors(kv_caches)
    if h.gcn_arch is not None and seen is not None and seen != h.gcn_arch.startswith("gfx94"):
        raise DetectionError(
            f"sglang: hint gcn_arch={h.gcn_arch!r} but the tensors are on a ROCm GPU that is{'' if seen else ' not'} gfx94x"
        )
    gfx94 = h.gcn_arch.startswith("gfx94") if h.gcn_arch is not None else seen
    archs = [gfx94] if gfx94 is not None else [True, False]
    readings: dict[torch.dtype, list[str]] = {}
    if platform is None:
        readings.setdefault(ocp, []).append("CUDA and other non-ROCm platforms")
    for unified in versions:
        for g in archs:
            when = "SGLang >= 0.5.6.post2" if unified else "SGLang <= 0.5.6.post1"
            gpu = ("gfx94x" if g else "not gfx94x") if unified and gfx94 is None else None
            readings.setdefault(_rocm_fp8(kind, unified, g), []).append(f"ROCm, {when}" + (f", {gpu}" if gpu else ""))
    variants = [(h.model_copy(update={"dtype": d}), "; ".join(dict.fromkeys(labels))) for d, labels in readings.items()]
    if len(variants) == 1:
        return variants, []
    deciding = []
    if platform is None:
        deciding.append("device_type")
    if v is None and any(_rocm_fp8(kind, False, g) != _rocm_fp8(kind, True, g) for g in archs):
        deciding.append("sglang_version")
    if gfx94 is None and any(_rocm_fp8(kind, u, True) != _rocm_fp8(kind, u, False) for u in versions):
        deciding.append("gcn_arch")
    return variants, deciding


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


# -- deciding -----------------------------------------------------------------------


#: the SGLang hints that fix a layout's geometry (kvcore.resolve names the ones that differ)
_GEOMETRY = {"block_size": "page_size", "num_heads": "num_kv_heads", "head_size": "head_size", "num_layers": "num_layers"}


def _decide(cands: list[Candidate], what: str, deciding: list[str], reasons: list[str] | None = None) -> Detection:
    reasons = reasons or []
    given = _GIVEN.get() or {}
    det = resolve(cands, engine=ENGINE, deciding_hints=deciding, hints=given, geometry_hints=_GEOMETRY) if cands else None
    if det is None:
        for c in cands:  # say why each reading's geometry did not fit
            try:
                build_layout(c.format, c.kv_caches, dtype=c.dtype, params=c.params)
            except KVCoreError as e:
                reasons.append(f"{c.label or c.format}: {e}")
        why = "\n".join(f"  - {r}" for r in reasons) or "  - no SGLang layout has tensors of this rank and shape"
        tried = ", ".join(dict.fromkeys(c.format for c in cands))
        raise DetectionError(
            f"sglang: these tensors are not an SGLang {what} kvcore knows"
            + (f" (tried {tried}: the geometry did not fit)" if tried else "")
            + f":\n{why}"
        )
    return det


def _check(reasons: list[str], ok: bool, msg: str) -> bool:
    if not ok:
        reasons.append(msg)
    return ok


def _same(ts: list[torch.Tensor], what: str) -> torch.Tensor:
    ref = ts[0]
    for i, t in enumerate(ts):
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype or t.device != ref.device:
            raise DetectionError(
                f"sglang: {what}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device} but {what}[0] is {tuple(ref.shape)} {ref.dtype} on "
                f"{ref.device}; one pool's layers share a geometry (use kvcore.detect_per_layer for hybrid pools)"
            )
    return ref


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


def _one_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


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


# -- MHA ----------------------------------------------------------------------------------


def _mha_candidates(
    ks: list[torch.Tensor], vs: list[torch.Tensor], h: SGLangHints, reasons: list[str], decided: dict[str, Any], label: str
) -> list[Candidate]:
    """The readings of an MHA pool's K and V lists. K and V of different head sizes
    (``MHATokenToKVPool`` with ``v_head_dim != head_dim``: 0.5.3 / 0.5.23
    ``memory_pool.py::MHATokenToKVPool._create_buffers`` allocates ``v_buffer`` with
    ``v_head_dim``) are two planes of their own widths, ``K=NL_X_<t>+V=NL_X_<t>`` for the
    equal-width name ``TWO_X_NL_X_<t>``, staged apart (``{"K": ..., "V": ...}``)."""
    out = _mha_readings(ks, vs, h, reasons, decided, label)
    if out and ks and vs and ks[0].shape[-1] != vs[0].shape[-1]:
        out = [_as_kv_planes(c) for c in out]
    return out


def _as_kv_planes(c: Candidate) -> Candidate:
    rest = c.format.removeprefix("TWO_X_NL_X_")
    ks, vs = c.kv_caches
    return Candidate(
        f"K=NL_X_{rest}+V=NL_X_{rest}",
        {"K": ks, "V": vs},
        c.dtype,
        note=f"{c.note}; K and V of head sizes {ks[0].shape[-1]} and {vs[0].shape[-1]} (v_head_dim): one plane each",
        decided_by=c.decided_by,
        label=f"{c.label}, K/V planes",
        order=c.order,
        against=c.against,
    )


def _mha_readings(
    ks: list[torch.Tensor], vs: list[torch.Tensor], h: SGLangHints, reasons: list[str], decided: dict[str, Any], label: str
) -> list[Candidate]:
    if not ks or len(ks) != len(vs):
        reasons.append(f"{label}: K and V lists must be non-empty and of equal length, got {len(ks)} and {len(vs)}")
        return []
    try:
        k, v = _same(ks, f"{label}: K"), _same(vs, f"{label}: V")
    except DetectionError as e:  # this reading pairs tensors of different shapes: it is not the pool
        reasons.append(str(e).removeprefix("sglang: "))
        return []
    if k.dim() != v.dim() or tuple(k.shape[:-1]) != tuple(v.shape[:-1]) or k.dtype != v.dtype:
        reasons.append(f"{label}: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} differ beyond the head size")
        return []
    if k.dim() not in (3, 4):
        reasons.append(f"{label}: MHA per-layer tensors are 3-D (rows, NH, HS) or 4-D page rows, got {k.dim()}-D {tuple(k.shape)}")
        return []
    hs, vhs = int(k.shape[-1]), int(v.shape[-1])
    if h.v_head_size is not None and h.v_head_size != vhs:
        reasons.append(f"{label}: v_head_size hint {h.v_head_size} but the V tensors' head size is {vhs}")
        return []
    if not _check(reasons, h.head_size in (None, hs), f"{label}: head_size hint {h.head_size} but the tensors' head size is {hs}"):
        return []
    if not _check(reasons, h.layout != "ASCEND", f"{label}: layout='ascend' is one cross-layer tensor (2, NL, pages, page_size, NH, HS)"):
        return []
    dtype = element_dtype(k.dtype, h)
    out: list[Candidate] = []
    ps = h.page_size
    if k.dim() == 3:
        rows, nh = int(k.shape[0]), int(k.shape[1])
        if h.layout == "HND":
            reasons.append(
                f"{label}: layout='HND' pools are 4-D page rows (num_pages, NH, page_size, HS); these are 3-D token rows {tuple(k.shape)}"
            )
            return []
        if not _check(
            reasons, h.num_kv_heads in (None, nh), f"{label}: num_kv_heads hint {h.num_kv_heads} but the tensors hold {nh} heads"
        ):
            return []
        if ps is None:
            out.append(
                Candidate("TWO_X_NL_X_NBBS_NH_HS", [ks, vs], dtype, note=f"SGLang {label}, NHD token rows", decided_by=decided, label=label)
            )
        elif _check(
            reasons,
            rows % ps == 0,
            f"{label}: {rows} rows are not whole pages of page_size {ps} (not divisible; SGLang allocates size + page_size rows)",
        ):
            split = [[t.unflatten(0, (rows // ps, ps)) for t in ks], [t.unflatten(0, (rows // ps, ps)) for t in vs]]
            out.append(
                Candidate(
                    "TWO_X_NL_X_NB_BS_NH_HS",
                    split,
                    dtype,
                    note=f"SGLang {label}, NHD token rows split into pages of {ps}",
                    decided_by=decided,
                    label=label,
                )
            )
        return out
    # 4-D: HND page rows (P, NH, page_size, HS) or page-split NHD views (NB, BS, NH, HS). SGLang allocates both
    # contiguous; a view whose strides are permuted is read through them, and the format names its memory order
    # (kvcore's rule), so the layout hint is checked against the memory, not the shape: a hint the strides
    # contradict is an error (kvcore.resolve, Candidate.against)
    perm = physical_permutation(k)
    if physical_permutation(v) != perm:
        reasons.append(f"{label}: K strides {tuple(k.stride())} and V strides {tuple(v.stride())} put the axes in different orders")
        return out
    for labels, what in ((("NB", "NH", "BS", "HS"), "HND page rows"), (("NB", "BS", "NH", "HS"), "NHD page-split")):
        phys = tuple(labels[i] for i in perm)
        if phys[0] != "NB" or phys[-1] != "HS":
            reasons.append(f"{label} {what}: the strides {tuple(k.stride())} put {phys[0]} outermost / {phys[-1]} innermost")
            continue
        fam = "HND" if phys.index("NH") < phys.index("BS") else "NHD"
        bs, nh = int(k.shape[labels.index("BS")]), int(k.shape[labels.index("NH")])
        if not (
            _check(reasons, ps in (None, bs), f"{label} {what}: page_size {bs}, hint says {ps}")
            and _check(reasons, h.num_kv_heads in (None, nh), f"{label} {what}: {nh} heads, hint says {h.num_kv_heads}")
        ):
            continue
        permuted = list(perm) != [0, 1, 2, 3]
        out.append(
            Candidate(
                "TWO_X_NL_X_" + "_".join(phys),
                [[t.permute(perm) for t in ks], [t.permute(perm) for t in vs]],
                dtype,
                note=f"SGLang {label}, {what}" + (" read through permuted strides" if permuted else ""),
                decided_by={**decided, "layout": fam},
                label=f"{label} {what}" + (f" ({fam} in memory)" if permuted else ""),
                order="allocated" if permuted else None,
                against={"layout": h.layout} if h.layout not in (None, fam) else {},
            )
        )
    return out


# -- MLA ----------------------------------------------------------------------------------


def _mla_candidates(ts: list[torch.Tensor], h: SGLangHints, reasons: list[str]) -> list[Candidate]:
    ref = ts[0]
    d = int(ref.shape[-1])
    if not _check(reasons, h.head_size in (None, d), f"MLA: head_size hint {h.head_size} but kv_cache_dim is {d}"):
        return []
    if not _check(reasons, h.num_layers in (None, len(ts)), f"MLA: num_layers hint {h.num_layers} but the list holds {len(ts)} layers"):
        return []
    dtype = element_dtype(ref.dtype, h)
    decided = {"is_mla": True}
    ps = h.page_size
    if ref.dim() == 3:
        rows = int(ref.shape[0])
        if ps is None:
            return [
                Candidate("NL_X_NBBS_ONE_HS", list(ts), dtype, note="SGLang MLATokenToKVPool kv_buffer", decided_by=decided, label="MLA")
            ]
        if not _check(reasons, rows % ps == 0, f"MLA: {rows} rows are not whole pages of page_size {ps} (not divisible)"):
            return []
        return [
            Candidate(
                "NL_X_NB_BS_ONE_HS",
                [t.unflatten(0, (rows // ps, ps)) for t in ts],
                dtype,
                note=f"SGLang MLATokenToKVPool kv_buffer split into pages of {ps}",
                decided_by=decided,
                label="MLA",
            )
        ]
    if not _check(reasons, ps in (None, int(ref.shape[1])), f"MLA page-split view has page_size {int(ref.shape[1])}, hint says {ps}"):
        return []
    return [Candidate("NL_X_NB_BS_ONE_HS", list(ts), dtype, note="SGLang MLA kv_buffer, page-split view", decided_by=decided, label="MLA")]


# -- indexer ----------------------------------------------------------------------------


_SKIP_TOPK_REASON = (
    "SGLang DSA indexer placeholders: 0-row (0, W) index-K tensors of layers that reuse the previous layer's top-k "
    "(0.5.23 index_key_cache.py::IndexKeyCache._layer_num_pages, skip_topk_layers); they hold no tokens"
)


def _indexer(ts: list[torch.Tensor], h: SGLangHints) -> Detection:
    """A DSA/NSA indexer pool. 0-row layers (skip-top-k placeholders) are left out of the
    layout: ``Detection.layer_ids`` names the layers that hold index keys."""
    keep = [i for i, t in enumerate(ts) if t.shape[0] > 0]
    if not keep:
        return Detection(format=None, excluded=_SKIP_TOPK_REASON)
    det = _indexer_rows([ts[i] for i in keep], h)
    if len(keep) < len(ts):
        det.layer_ids = tuple(keep)
        det.note = f"{det.note}; layers {[i for i in range(len(ts)) if i not in keep]} are 0-row skip-top-k placeholders"
    return det


def _kernel_pages_per_row(row_tokens: int, h: SGLangHints) -> int:
    """How many kernel pages SGLang views one indexer buffer row as (0.5.23
    ``IndexKeyCache._kernel_view``: ``page_size // index_kpool // index_page_size``).

    Raises:
        DetectionError: a hint does not divide the row or contradicts another.
        AmbiguousLayoutError: nothing given decides (a 0.5.23 pool may split rows under
            decode-context parallelism; the tensors cannot show it).
    """
    dcp, repl = h.attn_dcp_size, h.dcp_replicated
    derived = None
    if repl is False or dcp == 1:
        derived = 1
    elif repl and dcp is not None:
        derived = dcp
    if h.index_page_size is not None:
        ips = h.index_page_size
        if row_tokens % ips:
            raise DetectionError(
                f"sglang: hint index_page_size={ips} does not divide the indexer buffer row of {row_tokens} records "
                "(page_size // index_kpool); SGLang's kernel view re-views each row as whole kernel pages"
            )
        if derived is not None and row_tokens // ips != derived:
            raise DetectionError(
                f"sglang: hint index_page_size={ips} contradicts attn_dcp_size={dcp}, dcp_replicated={repl}: those give "
                f"kernel pages of {row_tokens // derived} tokens for rows of {row_tokens} records"
            )
        return row_tokens // ips
    if derived is not None:
        if row_tokens % derived:
            raise DetectionError(
                f"sglang: attn_dcp_size={dcp} does not divide the indexer buffer row of {row_tokens} records; "
                "SGLang's index_page_size = page_size // index_kpool // attn_dcp_size needs it to"
            )
        return derived
    v = h.version() if repl is None else None
    if v is not None and v[:3] <= (0, 5, 3):
        return 1  # 0.5.3 NSATokenToKVPool: one page per row, no kernel-page split
    raise AmbiguousLayoutError(
        f"sglang: a DSA indexer buffer row of {row_tokens} records is one kernel page, or several under decode-context "
        "parallelism (0.5.23 DSATokenToKVPool: index_page_size = page_size // index_kpool, divided by attn_dcp_size when "
        "dcp_replicated; IndexKeyCache._kernel_view), and the tensors cannot show which. Pass index_page_size, or "
        "attn_dcp_size with dcp_replicated, or sglang_version='0.5.3'",
        candidates=[f"{INDEXER_FORMAT} pages of {row_tokens // r} tokens" for r in range(1, row_tokens + 1) if row_tokens % r == 0][:4],
        hints=["index_page_size", "attn_dcp_size", "dcp_replicated", "sglang_version"],
    )


def _indexer_rows(ts: list[torch.Tensor], h: SGLangHints) -> Detection:
    ref = _same(ts, "kv_caches")
    width = int(ref.shape[1])
    if ref.dtype != torch.uint8:
        if h.page_size is None or width % h.page_size:
            raise DetectionError(
                f"sglang: 2-D per-layer tensors {tuple(ref.shape)} {ref.dtype} look like a bf16 DSA indexer pool "
                "(num_pages, page_size * index_head_dim); pass the page_size hint to split its pages"
            )
        ps = h.page_size
        views = [t.unflatten(1, (ps, 1, width // ps)) for t in ts]
        return _decide(
            [
                Candidate(
                    "NL_X_NB_BS_ONE_HS", views, element_dtype(ref.dtype, h), note="SGLang DSA indexer pool (bf16 keys)", label="indexer"
                )
            ],
            "indexer pool",
            [],
        )
    if h.index_kpool not in (None, 1):
        raise DetectionError(
            f"sglang: index_kpool={h.index_kpool} pools one index key per {h.index_kpool} tokens, so token locs do not address "
            "its records (0.5.23 IndexKeyCache.move asserts index_kpool == 1); kvcore moves token-addressed indexer pools only"
        )
    if h.page_size is not None:
        ps = h.page_size
        if width % ps or (width // ps) not in RECORD_SCALE_BYTES:
            raise DetectionError(
                f"sglang: indexer pages of {width} bytes are not page_size {ps} records of "
                f"{' or '.join(map(str, RECORD_SCALE_BYTES))} bytes (index_head_dim 128 fp8 + fp32 scale per token)"
            )
    else:
        fits = [w for w in RECORD_SCALE_BYTES if width % w == 0]
        if not fits:
            raise DetectionError(
                f"sglang: 2-D uint8 tensors {tuple(ref.shape)} are not a DSA/NSA indexer pool: a page holds page_size records of "
                f"{' or '.join(map(str, RECORD_SCALE_BYTES))} bytes; pass page_size if the record width differs"
            )
        ps = width // fits[0]
    r = _kernel_pages_per_row(ps, h)
    ips = ps // r
    if r > 1:
        try:  # IndexKeyCache._kernel_view: buffer.view(-1, row // r), a view of the caller's tensor
            ts = [t.view(-1, width // r) for t in ts]
        except RuntimeError:
            raise DetectionError(
                f"sglang: indexer buffers {tuple(ref.shape)} with strides {tuple(ref.stride())} cannot be re-viewed as kernel pages "
                f"of {ips} tokens (SGLang allocates them contiguous); pass the pool's own tensors"
            ) from None
    views = [index_page_view(t, ips) for t in ts]
    note = f"SGLang DSA/NSA indexer pool: pages of {ips} tokens, fp8 keys then fp32 scales"
    if r > 1:
        note += f" ({r} kernel pages per buffer row of {ps} records)"
    params = {"scale_bytes": RECORD_SCALE_BYTES[width // ps]}
    return _decide([Candidate(INDEXER_FORMAT, views, None, params=params, note=note, label="indexer")], "indexer pool", ["page_size"])


# -- host pools -------------------------------------------------------------------------


def _host_candidates(t: torch.Tensor, h: SGLangHints) -> list[Candidate]:
    dtype = element_dtype(t.dtype, h)
    s = tuple(int(x) for x in t.shape)
    cands: list[Candidate] = []

    def want(mem: str, mla: bool, nl: int, nh: int | None, ps_axis: int | None, rows: int | None) -> bool:
        return (
            h.layout != "ASCEND"
            and h.mem_layout in (None, mem)
            and h.is_mla in (None, mla)
            and h.num_layers in (None, nl)
            and (nh is None or h.num_kv_heads in (None, nh))
            and (ps_axis is None or h.page_size in (None, ps_axis))
            and (rows is None or h.page_size is None or rows % h.page_size == 0)
        )

    def add(mem: str, mla: bool) -> None:
        name = HOST_FORMATS[mem][1 if mla else 0]
        cands.append(
            Candidate(
                name,
                t,
                dtype,
                note=f"SGLang HiCache {'MLA' if mla else 'MHA'} host pool, {mem}",
                decided_by={"mem_layout": mem, "is_mla": mla},
                label=f"{'MLA' if mla else 'MHA'} {mem}",
            )
        )

    if t.dim() == 5 and s[0] == 2:
        if want("layer_first", False, s[1], s[3], None, s[2]):
            add("layer_first", False)
        if want("page_first", False, s[2], s[3], None, s[1]):
            add("page_first", False)
    if t.dim() == 6 and s[0] == 2:
        if want("page_first_direct", False, s[2], s[4], s[3], None):
            add("page_first_direct", False)
        if want("page_head", False, s[4], s[2], s[3], None):
            add("page_head", False)
    if t.dim() == 6 and s[0] == 2:
        cands += _ascend_candidates(t, h)
    if t.dim() == 4 and s[2] == 1:
        if want("layer_first", True, s[0], None, None, s[1]):
            add("layer_first", True)
        if want("page_first", True, s[1], None, None, s[0]):
            add("page_first", True)
    if t.dim() == 5 and s[3] == 1 and want("page_first_direct", True, s[1], None, s[2], None):
        add("page_first_direct", True)
    if not cands:
        raise DetectionError(
            f"sglang: one tensor {list(s)} {t.dtype} is not a HiCache host pool consistent with the hints "
            f"({h.model_dump(exclude_none=True) or 'none'}): MHA layer_first (2, NL, size, NH, HS), page_first (2, size, NL, NH, HS), "
            "page_first_direct (2, pages, NL, page_size, NH, HS), page_head (2, pages, NH, page_size, NL, HS); MLA layer_first "
            "(NL, size, 1, D), page_first (size, NL, 1, D), page_first_direct (pages, NL, page_size, 1, D)"
        )
    return cands


# -- Ascend cross-layer device pool -------------------------------------------------------


def _ascend_candidates(t: torch.Tensor, h: SGLangHints) -> list[Candidate]:
    """SGLang 0.5.3 ``memory_pool.py::AscendTokenToKVPool``: one tensor
    ``(2, layer_num, size // page_size + 1, page_size, head_num, head_dim)``."""
    s = tuple(int(x) for x in t.shape)
    if not (
        h.mem_layout is None
        and h.layout in (None, "ASCEND")
        and h.is_mla is not True
        and h.num_layers in (None, s[1])
        and h.page_size in (None, s[3])
        and h.num_kv_heads in (None, s[4])
    ):
        return []
    return [
        Candidate(
            "TWO_NL_NB_BS_NH_HS",
            t,
            element_dtype(t.dtype, h),
            note="SGLang AscendTokenToKVPool kv_buffer (cross-layer)",
            decided_by={"layout": "ascend"},
            label="Ascend device pool",
        )
    ]


def _ascend_from_halves(ts: list[torch.Tensor], h: SGLangHints) -> list[Candidate]:
    """``[k_buffer, v_buffer]`` of an Ascend pool: ``kv_buffer[0]`` and ``kv_buffer[1]``,
    5-D views of one storage; re-viewed (``as_strided``, no copy) as the 6-D pool."""
    if len(ts) != 2:
        raise DetectionError(f"sglang: {len(ts)} 5-D tensors; an Ascend pool's k_buffer, v_buffer are kv_buffer[0], kv_buffer[1]")
    k, v = ts
    delta = v.storage_offset() - k.storage_offset()
    if (
        not _one_storage(k, v)
        or tuple(k.shape) != tuple(v.shape)
        or tuple(k.stride()) != tuple(v.stride())
        or k.dtype != v.dtype
        or delta <= 0
    ):
        raise DetectionError(
            "sglang: two 5-D tensors are an Ascend pool only as kv_buffer[0], kv_buffer[1] of one "
            "(2, NL, pages, page_size, NH, HS) tensor (one storage, V after K); pass kv_buffer itself"
        )
    base = torch.as_strided(k, (2, *k.shape), (delta, *k.stride()), k.storage_offset())
    return _ascend_candidates(base, h)
