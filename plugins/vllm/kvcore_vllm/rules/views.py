"""Tensor helpers the readings share: memory order, byte ranges, layer stacking and the
element dtype of vLLM's int8 / uint8 storage."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore import DetectionError, memory_ordered
from kvcore.dtypes import is_fp8
from kvcore_vllm.hints import VllmHints
from kvcore_vllm.rules.rule import Rule


def _element_view(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    """A 0.29+ int8 byte view as the cache's element dtype (the split reading's V has tokens
    one *element* apart, so it cannot be read in bytes); other tensors unchanged. None when
    the element dtype is unknown or the view impossible."""
    if t.dtype != torch.int8:
        return t
    el = h.element_dtype()
    if el is None:
        return None
    esz = torch.empty(0, dtype=el).element_size()
    if esz == 1:
        return t
    if t.stride(-1) != 1 or t.shape[-1] % esz:
        return None
    return t.view(el)


def _ordered(t: torch.Tensor) -> bool:
    """Strides of the axes longer than 1 do not increase: the view follows memory order."""
    return memory_ordered(t)


def _byte_range(t: torch.Tensor) -> tuple[int, int, int]:
    isz = t.element_size()
    start = t.storage_offset() * isz
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) * isz + isz
    return t.untyped_storage().data_ptr(), start, start + span


def _layers_separate(views: Sequence[torch.Tensor]) -> bool:
    """Each layer's bytes are its own (or exactly another layer's: shared KV, aliased
    groups); layers whose pages interleave are a cross-layer buffer instead."""
    if any(v.is_meta for v in views):
        return True  # no addresses to compare
    ranges = sorted({_byte_range(v) for v in views})
    for (p0, _s0, e0), (p1, s1, _e1) in zip(ranges, ranges[1:]):
        if p0 == p1 and s1 < e0:
            return False
    return True


def stack_layers(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Per-layer views of one buffer with a uniform layer stride -> one ``[NL, *view]``
    view (no copy), or None when they are not that (different storage, shapes, strides,
    or a non-uniform or non-positive layer step)."""
    v0 = views[0]
    ptr = v0.untyped_storage().data_ptr()
    for v in views:
        if v.untyped_storage().data_ptr() != ptr or v.shape != v0.shape or v.stride() != v0.stride() or v.dtype != v0.dtype:
            return None
    offs = [v.storage_offset() for v in views]
    step = offs[1] - offs[0] if len(offs) > 1 else 0
    if len(offs) > 1 and (step <= 0 or any(b - a != step for a, b in zip(offs, offs[1:]))):
        return None
    if len(offs) == 1:
        step = max((n * s for n, s in zip(v0.shape, v0.stride())), default=1)
    return torch.as_strided(v0, (len(views), *v0.shape), (step, *v0.stride()), offs[0])


_BYTE_DTYPES = (torch.int8, torch.uint8)


def _element_dtype(t: torch.Tensor, h: VllmHints, rule: Rule) -> tuple[torch.dtype | None, int]:
    """(dtype for the spec or None, element size) for tensors of ``t``'s storage dtype.

    int8 tensors are 0.29+ byte views of the one int8 buffer (``allocate_kv_cache``): they
    carry the cache's element dtype (fp8 for fp8 cache dtypes, else the model dtype).
    uint8 tensors are fp8 storage (``STR_DTYPE_TO_TORCH_DTYPE``) or opaque records
    (fp8_ds_mla, indexer): only an fp8 cache_dtype reinterprets them, never the model dtype.
    """
    if rule.blocked:
        return None, 1
    want = h.element_dtype()
    if t.dtype == torch.uint8:
        want = want if is_fp8(want) else None
    if t.dtype in _BYTE_DTYPES:
        if want is not None and want != t.dtype:
            return want, torch.empty(0, dtype=want).element_size()
        return None, 1
    if want is not None and want != t.dtype and is_fp8(want) and is_fp8(t.dtype):
        # an fp8 cache stored as real float8 tensors (TPU's Pallas cache; fp8_inc is float8_e4m3fn in
        # STR_DTYPE_TO_TORCH_DTYPE): the tensor's own fp8 answers when it is the cache dtype's kind
        if ("e4m3" in str(t.dtype)) == ("e4m3" in str(want)):
            return None, t.element_size()
    if want is not None and want != t.dtype and is_fp8(want):
        raise DetectionError(
            f"vLLM: cache_dtype={h.cache_dtype!r} stores the KV cache as uint8 bytes of {str(want).replace('torch.', '')} "
            f"(vllm/utils/torch_utils.py::STR_DTYPE_TO_TORCH_DTYPE; a real float8 tensor of that kind on TPU), but these "
            f"tensors are {str(t.dtype).replace('torch.', '')}: they are not an fp8 cache. Drop cache_dtype (or pass "
            f"'auto'), or pass the fp8 cache's tensors"
        )
    if want is not None and want != t.dtype:
        raise DetectionError(
            f"vLLM: the KV cache tensors are {t.dtype} but the hints say the cache holds {want} "
            f"(dtype={h.dtype}, cache_dtype={h.cache_dtype}); fix the hint or pass the right tensors"
        )
    return None, t.element_size()
