"""LMDeploy's block ids: the block manager's blocks vs the tensors' (kernel) blocks.

From 0.14.0 ``CacheConfig.kernel_block_size`` may be smaller than ``block_size``:
``CacheEngine.allocate_caches`` allocates ``num_blocks * (block_size // kernel_block_size)``
blocks of ``kernel_block_size`` tokens, while the ``BlockManager`` (and everything a
caller sees: a sequence's block table, ``num_gpu_blocks``) counts blocks of ``block_size``
tokens. ``engine/inputs_maker.py::InputsMakerAsync._map_to_kernel_block_offsets`` maps
manager block ``m`` to the kernel blocks ``m * r .. m * r + r - 1`` (``r = block_size //
kernel_block_size``) before any kernel runs.

A layout detected from those tensors counts what the tensors hold: ``layout.block_size``
is the kernel block, ``layout.num_blocks`` the kernel blocks, and
:func:`kvcore.gather_blocks` / :func:`kvcore.scatter_blocks` take **kernel** block ids (the
detection note says so when ``block_size`` is a multiple of the tensors' block). Slot
mappings are not affected: ``slot = m * block_size + t`` is the same slot as
``(m * r + t // kernel_block_size) * kernel_block_size + t % kernel_block_size``.

This module takes the manager's ids:

* :func:`kernel_block_ids` -- LMDeploy's mapping, for any ids;
* :func:`gather_manager_blocks` / :func:`scatter_manager_blocks` -- whole manager blocks,
  staged as ``[kv_size, NL, len(ids) * block_size, NH*HS]`` (one buffer per plane for a
  multi-plane layout), manager block ``i`` at rows ``i * block_size .. (i + 1) * block_size``.
"""

from __future__ import annotations

from typing import Any

import torch

import kvcore
from kvcore import GeometryError, TransferError

__all__ = ["kernel_block_ids", "gather_manager_blocks", "scatter_manager_blocks"]


def kernel_block_ids(manager_ids: Any, block_size: int, kernel_block_size: int) -> torch.Tensor:
    """The kernel block ids of manager blocks, in order: ``m -> m*r, ..., m*r + r-1``
    (``r = block_size // kernel_block_size``), as 0.14.0
    ``inputs_maker.py::_map_to_kernel_block_offsets`` expands a block table. A negative id
    (padding) becomes ``r`` ids of -1 (skipped by kvcore's block transfers).

    Args:
        manager_ids: block ids of the ``BlockManager`` (a sequence or an integer tensor; 1-D).
        block_size: ``CacheConfig.block_size`` (tokens per manager block).
        kernel_block_size: ``CacheConfig.kernel_block_size`` (tokens per allocated block).
    Returns:
        int64 ``[len(manager_ids) * r]`` on the ids' device.
    Raises:
        GeometryError: ``block_size`` not a positive multiple of ``kernel_block_size``, or
            ids that are not a 1-D integer sequence.
    """
    if kernel_block_size < 1 or block_size < kernel_block_size or block_size % kernel_block_size:
        raise GeometryError(
            f"block_size {block_size} is not a multiple of kernel_block_size {kernel_block_size} (0.14.0 "
            "CacheEngine.allocate_caches requires block_size % kernel_block_size == 0)"
        )
    ids = manager_ids if isinstance(manager_ids, torch.Tensor) else torch.as_tensor(list(manager_ids), dtype=torch.int64)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise GeometryError(f"manager block ids must be a 1-D integer sequence, got {tuple(ids.shape)} {ids.dtype}")
    ids = ids.to(torch.int64)
    r = block_size // kernel_block_size
    out = ids[:, None] * r + torch.arange(r, dtype=torch.int64, device=ids.device)[None, :]
    return torch.where(ids[:, None] < 0, torch.full_like(out, -1), out).reshape(-1)


def _kernel_ids(layout: kvcore.KVLayout, manager_ids: Any, block_size: int) -> torch.Tensor:
    kb = layout.block_size
    if block_size < kb or block_size % kb:
        raise TransferError(
            f"block_size={block_size} is not a multiple of the layout's block ({kb} tokens): the tensors' blocks are "
            "LMDeploy's kernel blocks, and a manager block is block_size // kernel_block_size of them"
        )
    try:
        return kernel_block_ids(manager_ids, block_size, kb)
    except GeometryError as e:
        raise TransferError(str(e)) from None


def gather_manager_blocks(layout: kvcore.KVLayout, manager_ids: Any, block_size: int, out: Any = None, **kwargs: Any) -> Any:
    """:func:`kvcore.gather_blocks` by the block manager's ids: manager block ``i`` of
    ``manager_ids`` lands at rows ``i * block_size .. (i + 1) * block_size`` of the staging
    (``[kv_size, NL, len(manager_ids) * block_size, NH*HS]``, or a dict per plane), its
    tokens in order. ``kwargs`` are :func:`kvcore.gather_blocks`'s (``layers``,
    ``validate``, ...).

    Raises:
        TransferError: ``block_size`` not a multiple of ``layout.block_size``, or anything
            :func:`kvcore.gather_blocks` refuses (a block past the cache, ...), before any
            byte moves.
    """
    return kvcore.gather_blocks(layout, _kernel_ids(layout, manager_ids, block_size), out, **kwargs)


def scatter_manager_blocks(layout: kvcore.KVLayout, manager_ids: Any, block_size: int, src: Any, **kwargs: Any) -> None:
    """:func:`kvcore.scatter_blocks` by the block manager's ids (the inverse of
    :func:`gather_manager_blocks`).

    Raises:
        TransferError: as :func:`gather_manager_blocks`, and a staging buffer of the wrong
            shape, dtype or device.
    """
    kvcore.scatter_blocks(layout, _kernel_ids(layout, manager_ids, block_size), src, **kwargs)
