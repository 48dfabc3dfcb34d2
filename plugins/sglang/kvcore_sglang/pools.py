"""From SGLang's pool objects and indices to what kvcore takes.

Slot mapping — SGLang index to kvcore ``slot_mapping``
-----------------------------------------------------

SGLang addresses KV by **token slot**: ``out_cache_loc`` (the rows a forward pass writes,
``ForwardBatch.out_cache_loc``), ``req_to_token_pool.req_to_token[req, :len]`` (the slots
of a request's tokens) and a HiCache ``host_indices`` are all token slots, and a slot's
page is ``loc // page_size`` (SGLang 0.5.3 ``python/sglang/srt/mem_cache/allocator.py::
PagedTokenToKVPoolAllocator``; ``memory_pool.py::MHATokenToKVPool.set_kv_buffer`` writes
``k_buffer[layer][loc]``). kvcore's slot is ``block_id * block_size + offset``, which for
every SGLang layout kvcore detects is the same number, so::

    slot_mapping = out_cache_loc.to(torch.int64)          # no arithmetic

That holds for the token-row pools (``NBBS``: block_size 1), for the page-split views
(``page_size`` hint: block ``loc // page_size``, offset ``loc % page_size``), for the HND
page-row pool, for the indexer pool (gather by page with ``gather_blocks(layout,
page_ids)``, or by ``loc``) and for HiCache host pools (``host_indices``).

The padded page: every device pool has ``size + page_size`` rows; the first page (slots
``0 .. page_size-1``) absorbs the writes of padded tokens (CUDA-graph padding writes to
slot 0; the allocator hands out pages from 1). **Slot 0 is a real, writable slot in
kvcore**, not a skip marker — gathering it returns the dummy page's bytes, scattering
writes them. kvcore's skip marker is a negative slot: to leave padded tokens alone, map
them to -1 (:func:`slot_mapping` with ``skip_dummy_page=True``).

Example (page_size 4, a request of 6 tokens on pages 3 and 7, 2 padded tokens)::

    out_cache_loc = tensor([12, 13, 14, 15, 28, 29, 0, 0])
    slot_mapping(out_cache_loc)                          # [12, 13, 14, 15, 28, 29, 0, 0]
    slot_mapping(out_cache_loc, page_size=4,
                 skip_dummy_page=True)                   # [12, 13, 14, 15, 28, 29, -1, -1]
    kvcore.gather(layout, slot_mapping(out_cache_loc, page_size=4, skip_dummy_page=True))

Hybrid pools — per-layer entries for :func:`kvcore.detect_per_layer`
--------------------------------------------------------------------

:func:`kvcore.detect_per_layer` takes one entry per model layer: a ``(k, v)`` tuple for
an MHA layer, a tensor for an MLA (or indexer) layer, a :class:`MambaState` for a
recurrent layer (excluded: not KV). :func:`swa_layer_entries` and
:func:`hybrid_linear_layer_entries` build that list from SGLang's sub-pools and return
the ``layer_groups`` to pass with it (one group per sub-pool: the sub-pools have their
own allocators, so one slot mapping addresses one group's layout; the SWA layers' slots
are ``full_to_swa_index_mapping[loc]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcore import DetectionError, TransferError

__all__ = [
    "MambaState",
    "NoCache",
    "slot_mapping",
    "layer_entries",
    "swa_layer_entries",
    "swa_pool_layer_entries",
    "hybrid_linear_layer_entries",
    "kv_caches_of",
]


class MambaState(tuple):
    """A layer's recurrent state tensors (SGLang ``MambaPool``: ``conv`` and
    ``temporal`` state, indexed by request slot, not by token). Not KV: the detector
    excludes it with this reason."""

    def __new__(cls, tensors: Sequence[torch.Tensor]):
        return super().__new__(cls, tuple(tensors))


class NoCache(tuple):
    """A layer that holds no cache at all (a hybrid model's MoE-only or MLP-only layer: SGLang
    numbers layers globally, and ``HybridLinearKVPool`` maps only the attention layers' global
    ids to its full-attention sub-pool). Not KV: the detector excludes it, so
    ``detect_per_layer``'s result is ``None`` at that id."""

    def __new__(cls):
        return super().__new__(cls, ())


def slot_mapping(out_cache_loc: Any, *, page_size: int = 1, skip_dummy_page: bool = False) -> torch.Tensor:
    """kvcore's ``slot_mapping`` for SGLang token slots (``out_cache_loc``,
    ``req_to_token`` rows, HiCache ``host_indices``): the same numbers as int64.

    Args:
        out_cache_loc: int tensor or sequence ``[T]`` of SGLang token slots.
        page_size: SGLang's ``page_size`` (the dummy page is slots ``0..page_size-1``).
        skip_dummy_page: map the dummy page's slots to -1 (kvcore skips them) instead
            of moving the dummy page's bytes.
    Returns:
        int64 ``[T]`` on the input's device.
    Raises:
        kvcore.TransferError: not a 1-D integer index, or page_size < 1.
    """
    loc = out_cache_loc if isinstance(out_cache_loc, torch.Tensor) else torch.as_tensor(out_cache_loc, dtype=torch.int64)
    if loc.dtype.is_floating_point or loc.dtype.is_complex or loc.dtype == torch.bool or loc.dim() != 1:
        raise TransferError(
            f"out_cache_loc must be a 1-D integer tensor of SGLang token slots, got {loc.dtype} of shape {tuple(loc.shape)}"
        )
    if not isinstance(page_size, int) or page_size < 1:
        raise TransferError(f"page_size must be a positive int (SGLang's --page-size), got {page_size!r}")
    s = loc.to(torch.int64)
    if skip_dummy_page:
        s = torch.where(s < page_size, torch.full_like(s, -1), s)
    return s


def layer_entries(k_buffer: Sequence[torch.Tensor], v_buffer: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(k, v)`` tuple per layer from an MHA pool's ``k_buffer`` / ``v_buffer``.

    Raises:
        kvcore.DetectionError: the lists differ in length.
    """
    if len(k_buffer) != len(v_buffer):
        raise DetectionError(
            f"k_buffer has {len(k_buffer)} layers but v_buffer has {len(v_buffer)}; an MHA pool holds one K and one V per layer"
        )
    return [(k, v) for k, v in zip(k_buffer, v_buffer)]


def _pool_entries(pool_kv: Any) -> list[Any]:
    """``[k_buffer, v_buffer]`` (MHA) -> (k, v) tuples; a list of tensors (MLA) -> itself."""
    if isinstance(pool_kv, (list, tuple)) and len(pool_kv) == 2 and all(isinstance(x, (list, tuple)) for x in pool_kv):
        return layer_entries(pool_kv[0], pool_kv[1])
    if isinstance(pool_kv, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in pool_kv):
        return list(pool_kv)
    raise DetectionError("a sub-pool is [k_buffer, v_buffer] (MHA) or kv_buffer, a list of tensors (MLA)")


def swa_layer_entries(
    full_pool: Any, swa_pool: Any, full_layer_ids: Sequence[int], swa_layer_ids: Sequence[int]
) -> tuple[list[Any], list[list[int]]]:
    """Per-layer entries of an SGLang ``SWAKVPool`` (0.5.3 ``memory_pool.py::SWAKVPool``;
    0.5.23 ``swa_memory_pool.py::SWAKVPool``): two independent sub-pools, ``full_kv_pool``
    (size ``size``) for the full-attention layers and ``swa_kv_pool`` (size ``size_swa``)
    for the sliding-window layers, each with its own per-layer lists; SGLang remaps a
    model layer id to its sub-pool's index (``layers_mapping``).

    Args:
        full_pool / swa_pool: each ``[k_buffer, v_buffer]`` (MHA) or ``kv_buffer`` (MLA).
        full_layer_ids / swa_layer_ids: the model layer ids each sub-pool holds, in the
            sub-pool's order.
    Returns:
        ``(entries, layer_groups)`` for ``kvcore.detect_per_layer(entries, "sglang",
        layer_groups=layer_groups)``.
    Raises:
        kvcore.DetectionError: ids that overlap, leave gaps, or do not match the sub-pools' sizes.
    """
    full, swa = _pool_entries(full_pool), _pool_entries(swa_pool)
    return _merge([(full, list(full_layer_ids), "full"), (swa, list(swa_layer_ids), "swa")])


def swa_pool_layer_entries(pool: Any) -> tuple[list[Any], list[list[int]]]:
    """:func:`swa_layer_entries` for an ``SWAKVPool`` object (duck-typed): reads
    ``pool.full_kv_pool``, ``pool.swa_kv_pool`` and ``pool.layers_mapping``
    (``{layer_id: (index_in_sub_pool, is_swa_layer)}``, 0.5.3 ``memory_pool.py::SWAKVPool.__init__``).

    The SWA sub-pool has its own slots: SGLang translates a full-pool slot with
    ``pool.full_to_swa_index_mapping[loc]``, so the slot mapping for the SWA layers'
    layout is ``slot_mapping(pool.full_to_swa_index_mapping[out_cache_loc])``.

    Raises:
        kvcore.DetectionError: the object lacks these attributes or its mapping is inconsistent.
    """
    try:
        mapping = dict(pool.layers_mapping)
        full, swa = kv_caches_of(pool.full_kv_pool), kv_caches_of(pool.swa_kv_pool)
    except AttributeError as e:
        raise DetectionError(
            f"{type(pool).__name__} is not an SGLang SWAKVPool (needs full_kv_pool, swa_kv_pool, layers_mapping): {e}"
        ) from None
    full_ids = [lid for lid, (_, is_swa) in sorted(mapping.items(), key=lambda kv: kv[1][0]) if not is_swa]
    swa_ids = [lid for lid, (_, is_swa) in sorted(mapping.items(), key=lambda kv: kv[1][0]) if is_swa]
    return swa_layer_entries(full, swa, full_ids, swa_ids)


def hybrid_linear_layer_entries(
    full_pool: Any, full_attention_layer_ids: Sequence[int], mamba_states: Mapping[int, Sequence[torch.Tensor]]
) -> tuple[list[Any], list[list[int]]]:
    """Per-layer entries of an SGLang ``HybridLinearKVPool`` (0.5.23 ``memory_pool.py``
    l.4228): a full-attention KV pool for the attention layers; the recurrent layers'
    state lives in ``MambaPool`` (0.5.3: one tensor per state kind,
    ``(num_mamba_layers, size + 1, *shape)``, indexed by request slot). Pass each
    recurrent layer's state tensors in ``mamba_states[layer_id]`` (e.g.
    ``(conv[i], temporal[i])``); they become :class:`MambaState` entries, which
    detection excludes (``None`` in ``detect_per_layer``'s result).

    Layer ids are SGLang's **global** model layer ids: ``HybridLinearKVPool`` takes
    ``full_attention_layer_ids`` and maps each to its sub-pool index
    (``full_attention_layer_id_mapping = {id: i for i, id in enumerate(...)}``), so a
    NemotronH pool holds attention at 3, 8, 14 beside Mamba layers and MoE-only layers
    that hold no cache. The entries span ids ``0..max id``; an id neither list names is
    :class:`NoCache` (excluded like Mamba state), and ``layout.layer_ids`` are the global
    ids.

    Returns / Raises: as :func:`swa_layer_entries`.
    """
    kv = _pool_entries(full_pool)
    ids = sorted(mamba_states)
    states = [MambaState(mamba_states[i]) for i in ids]
    return _merge([(kv, list(full_attention_layer_ids), "full attention"), (states, ids, "mamba")], gaps=True)


def _merge(parts: list[tuple[list[Any], list[int], str]], gaps: bool = False) -> tuple[list[Any], list[list[int]]]:
    """Entries by layer id. ``gaps``: ids are global model layer ids that need not cover
    ``0..max`` (layers without a cache become :class:`NoCache`); else they must partition
    ``0..n-1``."""
    all_ids = [i for _, ids, _ in parts for i in ids]
    for i in all_ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise DetectionError(f"layer id {i!r} is not a layer id (a non-negative int)")
    n = (max(all_ids) + 1 if all_ids else 0) if gaps else len(all_ids)
    out: list[Any] = [None] * n
    for entries, ids, what in parts:
        if len(entries) != len(ids):
            raise DetectionError(f"the {what} sub-pool holds {len(entries)} layers but {len(ids)} layer ids were given for it")
        for e, i in zip(entries, ids):
            if not (0 <= i < n) or out[i] is not None:
                if gaps:
                    raise DetectionError(f"layer id {i} is given twice; each global layer id belongs to one sub-pool")
                raise DetectionError(
                    f"layer id {i} is out of range 0..{n - 1} or given twice; the sub-pools' layer ids must partition 0..{n - 1}"
                )
            out[i] = e
    if gaps:
        out = [NoCache() if e is None else e for e in out]
    return out, [list(ids) for _, ids, _ in parts if ids]


def kv_caches_of(pool: Any) -> Any:
    """The kvcore input for an SGLang pool object (duck-typed, SGLang need not be installed).

    * ``MHATokenToKVPool`` (``k_buffer``, ``v_buffer``) -> ``[k_buffer, v_buffer]``
    * ``NSATokenToKVPool`` / ``DSATokenToKVPool`` -> ``kv_buffer`` (its indexer pool:
      ``pool.index_k_with_scale_buffer``, detected on its own)
    * ``MLATokenToKVPool`` (``kv_buffer`` list) -> ``kv_buffer``
    * ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` / ``AscendTokenToKVPool``
      (``kv_buffer`` tensor) -> the tensor (detect it with ``mem_layout`` / ``layout="ascend"``)

    Raises:
        kvcore.DetectionError: an object with none of these attributes.
    """
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer") and not isinstance(getattr(pool, "kv_buffer", None), torch.Tensor):
        return [list(pool.k_buffer), list(pool.v_buffer)]
    kv = getattr(pool, "kv_buffer", None)
    if isinstance(kv, torch.Tensor):
        return kv
    if isinstance(kv, (list, tuple)):
        return list(kv)
    raise DetectionError(
        f"{type(pool).__name__} is not an SGLang KV pool kvcore knows (expected k_buffer/v_buffer lists, a kv_buffer list, "
        "or a host pool's kv_buffer tensor)"
    )
