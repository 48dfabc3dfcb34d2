"""What every SGLang reading shares: the hints the caller gave (for messages), deciding among
candidates (:func:`kvcore.resolve`), hint checks and tensor sameness."""

from __future__ import annotations

import contextvars

import torch

from kvcore import Candidate, Detection, DetectionError, KVCoreError, build_layout, resolve

ENGINE = "sglang"

_GIVEN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvcore_sglang_given", default=None)


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


def _one_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
