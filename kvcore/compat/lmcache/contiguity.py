"""LMCache's ``kv_format/contiguity.py``: views whose shape follows their memory order."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcore.compat.lmcache.formats import DiscoverableKVCache
from kvcore.errors import GeometryError

# one logger for the whole facade (its name is the one LMCache users filter on)
logger = logging.getLogger("kvcore.compat.lmcache")


def _memory_ordered_views(kv_caches: Any) -> Any:
    """Each tensor's axes put in memory order (LMCache's contiguity recovery,
    :func:`attempt_permute_to_contiguous_view`, without re-viewing collapsed strides): a
    permute, never a copy; containers keep their nesting and kind (tuples stay tuples:
    vllm-ascend's container says what its entries are)."""
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() == 0:
            return kv_caches
        st, sh = kv_caches.stride(), kv_caches.shape
        perm = sorted(range(kv_caches.dim()), key=lambda i: (st[i], sh[i] != 1), reverse=True)
        return kv_caches if perm == list(range(kv_caches.dim())) else kv_caches.permute(perm)
    if isinstance(kv_caches, Mapping):
        return {k: _memory_ordered_views(v) for k, v in kv_caches.items()}
    if isinstance(kv_caches, (list, tuple)):
        return type(kv_caches)(_memory_ordered_views(x) for x in kv_caches)
    return kv_caches


def _expected_shape(stride: Sequence[int], numel: int) -> tuple[int, ...]:
    shape = [numel // stride[0]]
    for i in range(len(stride) - 1):
        shape.append(stride[i] // stride[i + 1])
    return tuple(shape)


def _dim0_padding(t: torch.Tensor) -> int:
    """Padding per block of a view whose only gap is after each dim-0 row, or GeometryError."""
    shape, stride = tuple(t.shape), tuple(t.stride())

    def fail(reason: str) -> None:
        raise GeometryError(
            f"attempt_permute_to_contiguous_view: the tensor is not contiguous and not a supported (dim-0 padding only) "
            f"layout: {reason}. shape={shape}, stride={stride}, storage_offset={t.storage_offset()}, dtype={t.dtype}; "
            "kvcore.detect describes any strides, LMCache's contiguity recovery only dim-0 padding"
        )

    if t.dim() < 2:
        fail("rank < 2")
    if stride[-1] != 1:
        fail("the innermost axis is not contiguous")
    if stride[-2] != shape[-1]:
        fail("the last two axes are not tightly packed")
    tight = shape[-1]
    for i in range(t.dim() - 2, 0, -1):
        if stride[i] != tight:
            fail(f"axis {i} has stride {stride[i]} where a tight layout has {tight} (interior padding)")
        tight *= shape[i]
    if stride[0] < tight:
        fail(f"dim 0 has stride {stride[0]} < {tight} (overlapping blocks)")
    return stride[0] - tight


def attempt_permute_to_contiguous_view(kv_caches: DiscoverableKVCache) -> DiscoverableKVCache:
    """Views whose shape follows their physical order (LMCache ``kv_format/contiguity.py``).

    Metadata only, never a copy: each tensor's axes are sorted by stride (a size-1 axis tying
    with a neighbour goes innermost); a contiguous result is re-viewed with the tightest
    shape its strides imply (collapsed size-1 strides recover the true extents), a
    dim-0-padded one is returned as it is. Lists and tuples are rebuilt with the same
    nesting (LMCache returns lists for tuples). :func:`normalize_kv_and_discover_format`
    does not need this: kvcore reads strides.

    Raises:
        GeometryError: a view that stays non-contiguous with a gap anywhere but after each
            dim-0 row ("dim-0 padding only"), or a leaf that is not a tensor.
    """
    if isinstance(kv_caches, torch.Tensor):
        t = kv_caches
        if t.dim() == 0:
            return t
        strides, shape = t.stride(), t.shape
        perm = sorted(range(t.dim()), key=lambda i: (strides[i], shape[i] != 1), reverse=True)
        out = t.permute(perm)
        if out.is_contiguous():
            if out.numel() == 0:
                return out
            return out.view(_expected_shape(out.stride(), out.numel()))
        pad = _dim0_padding(out)
        logger.debug("attempt_permute_to_contiguous_view: dim-0 padded view, %d elements per block", pad)
        return out
    if isinstance(kv_caches, (list, tuple)):
        return type(kv_caches)(attempt_permute_to_contiguous_view(x) for x in kv_caches)
    raise GeometryError(f"attempt_permute_to_contiguous_view: expected tensors in lists/tuples, got {type(kv_caches).__name__}")
