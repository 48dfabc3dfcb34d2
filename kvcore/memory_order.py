"""A tensor's axes in memory order: whether its shape already is its memory order
(:func:`memory_ordered`) and the permutation that puts it there
(:func:`physical_permutation`). Plugins use them to tell an as-allocated reading from
one already permuted into memory order (see :mod:`kvcore.detection`)."""

from __future__ import annotations

import torch


def memory_ordered(t: torch.Tensor) -> bool:
    """True when ``t``'s axes are in memory order: the strides of the axes longer than 1
    do not increase from the outermost axis in. Such a tensor may have been handed over
    as allocated or already permuted into memory order; a tensor that is not memory
    ordered was certainly not permuted into memory order."""
    prev = None
    for n, s in zip(t.shape, t.stride()):
        if n <= 1:
            continue
        if prev is not None and s > prev:
            return False
        prev = s
    return True


def physical_permutation(t: torch.Tensor) -> list[int]:
    """The axis order that makes ``t``'s memory order outermost-first: axes sorted by
    decreasing stride; ties (size-1 axes) keep their given order."""
    return sorted(range(t.dim()), key=lambda i: (-t.stride(i) if t.shape[i] > 1 else _size1_rank(t, i), i))


def _size1_rank(t: torch.Tensor, i: int) -> int:
    # a size-1 axis sits where its neighbour to the right is: it changes no address
    for j in range(i + 1, t.dim()):
        if t.shape[j] > 1:
            return -t.stride(j)
    return 0
