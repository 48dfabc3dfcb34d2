"""SGLang's device pools as per-layer tensors: MHA (token rows, HND page rows, page-split views,
K and V of their own head sizes) and MLA latents."""

from __future__ import annotations

from typing import Any

import torch

from kvcore import Candidate, DetectionError
from kvcore.detection import physical_permutation
from kvcore_sglang.deciding import _check, _same
from kvcore_sglang.hints import SGLangHints, element_dtype


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
