"""Moving tokens and blocks between a paged KV cache and a staging buffer.

Staging layout (the "memory object" offloading systems store; LMCache's ``KV_2LTD``):
``[kv_size, NL, T, NH*HS]`` — K/V major, then layer, then token — in the layout's
element dtype; MLA ``[1, NL, T, HS]``; one layer (``layers=i``) ``[kv_size, T, NH*HS]``.

``slot_mapping`` is int64 (or int32) ``[T]`` with ``slot = block_id * block_size +
offset``. A negative slot is engine padding: that row is not moved in either
direction, and the destination row is left as it was. ``skip_prefix=n`` leaves the
first n rows alone the same way (the engine already holds those tokens).

A layout that stages one buffer per plane (a multi-plane record that is not exactly K
and V of one dtype and width: quantised values beside their scales, K and V of different
widths; ``layout.classic_staging`` is False) stages a dict ``{role: [NL, T, NH_p*HS_p]}``
(one layer: ``{role: [T, NH_p*HS_p]}``), each in its plane's dtype
(``layout.staging_shapes``, ``layout.allocate_staging``).

Everything is validated before the first byte moves: a bad call raises
:class:`~kvcore.TransferError` and leaves the cache (and the staging buffer) unchanged.
A transfer allocates memory proportional to the tokens it moves, never to the cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvcore.errors import (
    GeometryError,  # noqa: F401 - names this module had before the generic path moved out
    TransferError,
)
from kvcore.inputs import plain_integers  # noqa: F401
from kvcore.kernels import TransferPlan, check_storages, select_kernel, staging_conflict  # noqa: F401
from kvcore.layout import KVLayout
from kvcore.layout_plan import _plan_for
from kvcore.transfer_path import (  # noqa: F401 - the generic path's names stay importable from here
    _INT_DTYPES,
    _byte_range,
    _check_dense,
    _check_plane_staging,
    _check_staging,
    _first_bad_index,
    _index_tensor,
    _layers,
    _resolve_neg_conj,
    _run,
    _run_planes,
    _scalar_layer,
    _slots,
    _write_once,
    slots_for_blocks,
)

__all__ = ["gather", "scatter", "gather_blocks", "scatter_blocks", "slots_for_blocks"]


def gather(
    layout: KVLayout,
    slot_mapping,
    out: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    *,
    layers: Sequence[int] | int | None = None,
    skip_prefix: int = 0,
    validate: str | None = None,
) -> torch.Tensor | Mapping[str, torch.Tensor]:
    """Copy the tokens at ``slot_mapping`` from the paged cache into a staging buffer.

    Args:
        layout: from :func:`kvcore.detect`.
        slot_mapping: int64 ``[T]``; negative = padding (row left untouched).
        out: ``[kv_size, NL, T, NH*HS]`` (``[kv_size, T, NH*HS]`` when ``layers`` is an
            int) of ``layout.dtype``, on the cache's device (or pinned host memory for a
            CUDA cache). Allocated when None. A layout that stages one buffer per plane
            (``layout.classic_staging`` False) takes a dict ``{role: [NL, T, NH_p*HS_p]}``
            (``{role: [T, NH_p*HS_p]}`` for one layer) holding exactly its planes, each in
            the plane's dtype (``layout.staging_shapes``, ``layout.allocate_staging``).
        layers: a layer subset (staging order follows it), or one layer index.
        skip_prefix: leave the first n rows untouched.
        validate: ``"device"`` (default), ``"sync"`` or ``"none"``: where slot values are
            checked and when their error surfaces on a CUDA cache (:mod:`kvcore.layout_plan`).
    Returns:
        the staging buffer (``out`` when given): a tensor, or the dict of per-plane tensors.
    Raises:
        TransferError: before anything is written, for a slot >= page_buffer_size, a
            bad shape, dtype or device, or a bad layer index; for per-plane staging also
            a plane missing from the dict, a key that is no plane, a tensor where a dict
            is needed (and the reverse), or two entries sharing memory; a staging buffer
            that shares memory with the cache or whose rows share memory; a cache storage
            freed, reallocated or replaced since detection. On CUDA with
            ``validate="device"`` a bad slot value is found on the GPU: nothing is written
            and the error is raised by the next kvcore CUDA transfer or
            :func:`kvcore.synchronize`.
    """
    return _plan_for(layout, layers).gather(slot_mapping, out, skip_prefix=skip_prefix, validate=validate)


def scatter(
    layout: KVLayout,
    slot_mapping,
    src: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    layers: Sequence[int] | int | None = None,
    skip_prefix: int = 0,
    validate: str | None = None,
) -> None:
    """Copy staged tokens into the paged cache at ``slot_mapping`` (the inverse of
    :func:`gather`). Negative slots and the first ``skip_prefix`` rows are not written.
    ``src`` is shaped as :func:`gather` returns it: one tensor, or for per-plane staging a
    dict ``{role: [NL, T, NH_p*HS_p]}``. Layers that share memory (``layout.aliases``) are
    written once, from the rows of the first of them in ``layers``; the rows of the others
    are not read. A ``src`` carrying torch's negative/conjugate bit is read as its values.

    Raises:
        TransferError: before anything is written, for a slot out of range, a slot that
            appears twice, or a bad shape, dtype, device or layer index (per-plane: of any
            entry), or a plane missing from (or extra in) the dict; a ``src`` that shares
            memory with the cache (a view of the rows being written); a cache storage
            freed, reallocated or replaced since detection. On CUDA with
            ``validate="device"`` (default) slot values are checked on the GPU: a refused
            call writes nothing and its error is raised by the next kvcore CUDA transfer or
            :func:`kvcore.synchronize`.
    """
    if src is None:
        raise TransferError(
            "scatter needs src, a staging buffer [kv_size, NL, T, NH*HS] (per-plane staging: a dict {role: [NL, T, NH_p*HS_p]})"
        )
    _plan_for(layout, layers).scatter(slot_mapping, src, skip_prefix=skip_prefix, validate=validate)


def gather_blocks(
    layout: KVLayout, block_ids, out: torch.Tensor | None = None, *, layers=None, skip_prefix: int = 0, validate: str | None = None
) -> torch.Tensor:
    """Gather whole blocks: staging ``[kv_size, NL, len(block_ids)*BS, NH*HS]``, block
    ``i`` at rows ``i*BS..(i+1)*BS``. Negative block ids are skipped. See :func:`gather`
    (on CUDA with ``validate="device"`` a block id past the cache is refused on the device,
    as its slots).

    Block ids are in the layout's own blocks: ``layout.block_size`` tokens each, block ``b``
    holding slots ``b*BS .. b*BS+BS-1``. Where the engine splits its manager blocks into
    smaller kernel blocks (vLLM 0.33 ``create_kv_cache_views`` with a manager ``block_size``
    a multiple of the kernel's; LMDeploy 0.14 ``kernel_block_size``), the layout's blocks are
    the kernel blocks, and a manager block ``m`` of ``r`` kernel blocks is ``m*r .. m*r+r-1``
    -- pass those ids, or use :func:`gather` with the slot mapping, which is the same in
    both units."""
    return _plan_for(layout, layers).gather_blocks(block_ids, out, skip_prefix=skip_prefix, validate=validate)


def scatter_blocks(
    layout: KVLayout, block_ids, src: torch.Tensor, *, layers=None, skip_prefix: int = 0, validate: str | None = None
) -> None:
    """Scatter whole blocks (the inverse of :func:`gather_blocks`; block ids in the layout's
    own, possibly kernel-sized, blocks as there)."""
    if src is None:
        raise TransferError("scatter needs src, a staging buffer [kv_size, NL, T, NH*HS]")
    _plan_for(layout, layers).scatter_blocks(block_ids, src, skip_prefix=skip_prefix, validate=validate)
