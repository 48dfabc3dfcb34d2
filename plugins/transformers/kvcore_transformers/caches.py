"""Reading transformers' cache objects as tensors kvcore can describe (views, never copies).

Three kinds of cache, each read the way transformers itself lays it out:

* **Continuous-batching paged cache** (``PagedAttentionCache``; transformers 5.18 - 5.24,
  ``generation/continuous_batching/cache.py`` and ``cache_allocators/full_attention.py``).
  ``PagedAttentionCache.__init__`` allocates **one** ``torch.uint8`` tensor,
  ``torch.zeros(non_trash_bytes + 2 * bytes_per_sector)``: two never-allocated trash
  sectors, then the data sectors. Each attention type (``full_attention``,
  ``sliding_attention``) has one allocator that carves *sectors* into *blocks* of
  ``bytes_per_block = pages_per_block * bytes_per_page`` bytes, where
  ``pages_per_block`` is the number of layers of that type and
  ``FullAttentionCacheAllocator.get_bytes_per_page = 2 * NH * HS * itemsize * page_size``.
  ``register_cache_tensor`` views the bytes as ``[total_tokens, 2, NH, HS]`` of the model
  dtype and builds, per layer ``i`` of the group, K rows at ``(2i) * page_size`` and V rows
  at ``(2i + 1) * page_size`` inside each block (``_kv_token_views``), so a block is
  ``[L0 K page | L0 V page | L1 K page | L1 V page | ...]`` with each page
  ``[page_size, NH, HS]``. kvcore reads one group as ``[NB, NL_group, 2, page_size, NH, HS]``
  = format ``NB_NL_TWO_BS_NH_HS`` over the **whole** tensor, so ``num_blocks`` counts the
  trash sectors' blocks too and transformers' block ids (``allocator.block_table``, which
  start after the trash sectors: ``cache_pool.py::CachePool.reset``) are kvcore block ids.
  Sectors are ``lcm(bytes_per_block of every group, 128)`` bytes (``cache.py``), so every
  group's block size divides the tensor. The sliding-window group stores a request as a
  ring (``sliding_attention.py::_token_indices_to_physical_indices``: position ``p`` lives
  in slot ``p % sliding_window``).
* **DynamicCache / StaticCache, 5.x and 4.54+** (``cache_utils.py``): ``cache.layers[i]``
  holds ``.keys`` / ``.values`` ``[batch, NH, seq, HS]``. ``DynamicLayer.update`` grows
  them with ``torch.cat(dim=-2)`` (5.24.0 l.136); ``DynamicSlidingWindowLayer`` keeps the
  slice ``full[:, :, -sliding_window + 1:, :]`` (l.246, a strided view);
  ``StaticLayer.lazy_initialization`` allocates ``torch.zeros((batch, NH, max_cache_len,
  HS))`` for K and the same with the V head dim (l.439/l.444).
* **DynamicCache / StaticCache, 4.53 and earlier** (4.53.3 ``cache_utils.py``): the lists
  ``cache.key_cache`` / ``cache.value_cache``, same per-layer shape. Custom caches shipped
  with remote-code models still use these two lists.

Dynamic and static caches are read as format ``NL_X_TWO_X_NB_NH_BS_HS`` (per-layer
``(K, V)`` pairs): the batch row is the *block* and the sequence axis the *token in the
block*, so ``num_blocks = batch``, ``block_size = seq`` (the cache's current length, or
``max_cache_len`` for a static cache) and a slot is ``b * seq + position`` — kvcore's own
``slot = block_id * block_size + offset``, with no batch special case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcore import DetectionError
from kvcore.dtypes import parse_dtype

from .versions import check_version

__all__ = [
    "PAGED_FORMAT",
    "LAYER_PAIRS_FORMAT",
    "LAYER_PAIRS_NHD_FORMAT",
    "PagedGroup",
    "is_paged_cache",
    "is_layered_cache",
    "is_legacy_cache",
    "paged_groups",
    "paged_view",
    "layer_pairs",
    "CachePair",
    "kv_caches",
]

#: one attention-type group of the continuous-batching cache: ``[NB, NL, 2, BS, NH, HS]``.
PAGED_FORMAT = "NB_NL_TWO_BS_NH_HS"
#: DynamicCache / StaticCache: NL ``(K, V)`` pairs of ``[batch, NH, seq, HS]``.
LAYER_PAIRS_FORMAT = "NL_X_TWO_X_NB_NH_BS_HS"
#: the same pairs while they are still attention's ``key_states.transpose(1, 2)`` views (4.53
#: ``DynamicCache.update`` after a prefill): memory ``[batch, seq, NH, HS]``, a name being the
#: physical order.
LAYER_PAIRS_NHD_FORMAT = "NL_X_TWO_X_NB_BS_NH_HS"


def as_dtype(x: Any, what: str = "dtype") -> torch.dtype:
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float16"``,
    ``"bf16"``, ``"float8_e4m3fnuz"``), read through kvcore's one table (:mod:`kvcore.dtypes`).

    Raises:
        DetectionError: an unknown name (listing the accepted ones).
    """
    return parse_dtype(x, what=f"hint {what}")


# -- the continuous-batching paged cache ------------------------------------------------


@dataclass(frozen=True)
class PagedGroup:
    """One attention-type group of a ``PagedAttentionCache``, read as ``NB_NL_TWO_BS_NH_HS``.

    Attributes:
        attention_type: transformers' group name (``"full_attention"``, ``"sliding_attention"``).
        layer_ids: the model's layer indices in this group, in block order (``allocator.layer_indices``).
        view: ``[NB, NL_group, 2, page_size, NH, HS]`` view of the cache's uint8 tensor in
            the cache dtype; ``NB = tensor bytes // bytes_per_block`` (trash sectors included).
        page_size: tokens per page (kvcore's block_size).
        sliding_window: the group's window (sliding group), else None.
        allocator: the transformers allocator (``block_table`` maps request id -> block ids).
    """

    attention_type: str
    layer_ids: tuple[int, ...]
    view: torch.Tensor
    page_size: int
    sliding_window: int | None
    allocator: Any = None


def is_paged_cache(obj: Any) -> bool:
    """True for a continuous-batching ``PagedAttentionCache`` (duck-typed: a uint8
    ``cache_tensor`` and a ``cache_allocators`` dict)."""
    t = getattr(obj, "cache_tensor", None)
    return isinstance(t, torch.Tensor) and isinstance(getattr(obj, "cache_allocators", None), dict)


def paged_view(
    buffer: torch.Tensor, *, num_layers: int, num_kv_heads: int, head_size: int, page_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """View a continuous-batching byte buffer as ``[NB, num_layers, 2, page_size, NH, HS]``.

    Args:
        buffer: the cache's 1-D ``torch.uint8`` tensor (``PagedAttentionCache.cache_tensor``).
        num_layers: layers of the group (``allocator.pages_per_block``).
        num_kv_heads, head_size, page_size: the group's geometry; dtype: the cache dtype.
    Returns:
        a view (no copy) of ``dtype`` covering every whole block of the buffer.
    Raises:
        DetectionError: the buffer is not 1-D contiguous uint8, or does not hold a whole
            number of blocks (``2 * NH * HS * itemsize * page_size * num_layers`` bytes each).
    """
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_size", head_size), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise DetectionError(f"{name} must be a positive int for a transformers paged cache, got {v!r}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise DetectionError(
            f"a transformers continuous-batching cache is one contiguous 1-D torch.uint8 tensor "
            f"(PagedAttentionCache.cache_tensor); got shape {tuple(buffer.shape)} stride {tuple(buffer.stride())} dtype {buffer.dtype}"
        )
    itemsize = torch.empty(0, dtype=dtype).element_size()
    bytes_per_block = 2 * num_kv_heads * head_size * itemsize * page_size * num_layers
    total = buffer.numel()
    if total == 0 or total % bytes_per_block:
        raise DetectionError(
            f"the paged cache buffer holds {total} bytes, not a whole number of blocks of {bytes_per_block} bytes "
            f"(2 x NH={num_kv_heads} x HS={head_size} x {itemsize} B x page_size={page_size} x {num_layers} layers); "
            "check num_layers (layers of this attention type), num_kv_heads (per TP rank), head_size, page_size and dtype"
        )
    nb = total // bytes_per_block
    return buffer.view(dtype).view(nb, num_layers, 2, page_size, num_kv_heads, head_size)


def paged_groups(cache: Any) -> dict[str, PagedGroup]:
    """Every attention-type group of a ``PagedAttentionCache``, in transformers' group order.

    Raises:
        DetectionError: transformers outside :data:`~kvcore_transformers.versions.PAGED_RANGE`,
            or an allocator whose page size disagrees with ``2 * NH * HS * itemsize * page_size``
            (a layout this plugin does not know).
    """
    check_version("continuous-batching paged cache", paged=True)
    out: dict[str, PagedGroup] = {}
    for name, alloc in cache.cache_allocators.items():
        try:
            nh, hs, dt = int(alloc.num_key_value_heads), int(alloc.head_dim), alloc.cache_dtype
            ps, nl = int(alloc.tokens_per_page), int(alloc.pages_per_block)
            layers = tuple(int(i) for i in alloc.layer_indices)
            bpp = int(alloc.bytes_per_page)
        except AttributeError as e:
            raise DetectionError(
                f"transformers allocator {name!r} ({type(alloc).__name__}) lacks {e.name!r}: not the cache_allocators layout of transformers 5.18-5.24"
            ) from None
        itemsize = torch.empty(0, dtype=dt).element_size()
        if bpp != 2 * nh * hs * itemsize * ps:
            raise DetectionError(
                f"transformers allocator {name!r} has {bpp} bytes per page, but a K page then a V page of "
                f"[page_size={ps}, NH={nh}, HS={hs}] {dt} is {2 * nh * hs * itemsize * ps}; this allocator's layout is unknown to kvcore-transformers"
            )
        view = paged_view(cache.cache_tensor, num_layers=nl, num_kv_heads=nh, head_size=hs, page_size=ps, dtype=dt)
        out[name] = PagedGroup(
            attention_type=name,
            layer_ids=layers,
            view=view,
            page_size=ps,
            sliding_window=getattr(alloc, "sliding_window", None),
            allocator=alloc,
        )
    if not out:
        raise DetectionError("this PagedAttentionCache has no cache allocators (no attention layers to read)")
    return out


# -- DynamicCache / StaticCache ------------------------------------------------------------


def is_layered_cache(obj: Any) -> bool:
    """True for a transformers >= 4.54 ``Cache`` (a ``layers`` list of cache-layer objects)."""
    layers = getattr(obj, "layers", None)
    return isinstance(layers, (list, tuple)) and not isinstance(getattr(obj, "key_cache", None), list)


def holds_no_kv(layer: Any) -> str | None:
    """Why a cache layer holds no per-token KV by design, else None.

    5.24 ``cache_utils.py``: ``DummyLayer`` ("layers that do not need any cache ... or
    shared-cache layers that consume cache produced by other layers", keys/values None) and
    ``LinearAttentionLayer`` (a recurrent / conv state, no ``keys``). The hybrid
    ``LinearAttentionAnd*AttentionLayer`` classes do hold keys/values and are read.
    """
    cls = type(layer).__name__
    if cls == "DummyLayer":
        return "DummyLayer (no attention cache, or a KV-shared layer reading another layer's cache)"
    if not hasattr(layer, "keys"):
        return f"{cls} (recurrent / linear-attention state, no per-token KV)"
    return None


def is_legacy_cache(obj: Any) -> bool:
    """True for a transformers <= 4.53 cache (``key_cache`` and ``value_cache`` lists)."""
    return isinstance(getattr(obj, "key_cache", None), list) and isinstance(getattr(obj, "value_cache", None), list)


def _empty(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or t.numel() == 0


def layer_pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per-layer ``(K, V)`` tensors of a DynamicCache / StaticCache (either API generation).

    Returns:
        ``[(keys_i, values_i), ...]`` in layer order, each ``[batch, NH, seq, HS]`` (the
        cache's own tensors, no copies); ``None`` for a layer that holds no per-token KV
        by design (:func:`holds_no_kv`: ``DummyLayer``, linear-attention state), so that
        list positions stay the model's layer indices.
    Raises:
        DetectionError: transformers outside the supported range; a quantized cache (its
            tensors are only the full-precision residual); an encoder-decoder cache (pick
            ``self_attention_cache`` or ``cross_attention_cache``); a layer that holds no KV
            yet (run a forward pass first) or is not 4-D; no layer with KV at all.
    """
    check_version(type(cache).__name__)
    name = type(cache).__name__
    if hasattr(cache, "self_attention_cache") and hasattr(cache, "cross_attention_cache"):
        raise DetectionError(
            f"{name} holds two caches; pass cache.self_attention_cache or cache.cross_attention_cache (each is read on its own)"
        )
    pairs: list[tuple[Any, Any] | None]
    if is_layered_cache(cache):
        layers = list(cache.layers)
        for i, layer in enumerate(layers):
            if "Quantized" in type(layer).__name__ or hasattr(layer, "_quantized_keys"):
                raise DetectionError(
                    f"layer {i} of this {name} is a {type(layer).__name__}: its keys/values tensors are only the full-precision "
                    "residual, the rest is quantized; kvcore-transformers reads unquantized caches only"
                )
        pairs = [None if holds_no_kv(layer) else (getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in layers]
    elif is_legacy_cache(cache):
        if "Quantized" in name:
            raise DetectionError(f"{name} keeps most tokens quantized; kvcore-transformers reads unquantized caches only")
        if len(cache.key_cache) != len(cache.value_cache):
            raise DetectionError(f"{name} has {len(cache.key_cache)} key_cache entries but {len(cache.value_cache)} value_cache entries")
        pairs = list(zip(cache.key_cache, cache.value_cache))
    else:
        raise DetectionError(
            f"{name} is not a transformers cache kvcore-transformers knows: expected cache.layers[i].keys/.values "
            "(transformers >= 4.54), cache.key_cache/.value_cache lists (<= 4.53) or a PagedAttentionCache"
        )
    if not pairs:
        raise DetectionError(f"this {name} has no layers yet; run a forward pass (or build it with config=) first")
    empty = [i for i, p in enumerate(pairs) if p is not None and (_empty(p[0]) or _empty(p[1]))]
    if empty:
        raise DetectionError(
            f"layers {empty} of this {name} hold no KV yet (keys/values are None or empty): run a forward pass first, "
            "or pass the filled layers only"
        )
    if all(p is None for p in pairs):
        raise DetectionError(f"no layer of this {name} holds per-token KV ({holds_no_kv(cache.layers[0])}, ...)")
    for i, p in enumerate(pairs):
        if p is not None and (p[0].dim() != 4 or p[1].dim() != 4):
            raise DetectionError(
                f"layer {i} of this {name} has keys {tuple(p[0].shape)} and values {tuple(p[1].shape)}; transformers stores [batch, NH, seq, HS]"
            )
    return [None if p is None else CachePair(p) for p in pairs]


class CachePair(tuple):
    """One layer's ``(keys, values)`` read out of a transformers cache object by
    :func:`layer_pairs`: the tensors as transformers allocated them (``[batch, NH, seq, HS]``,
    strides as the cache made them). Detection reads such pairs as allocated; plain tuples
    could also be tensors someone permuted into memory order (see
    :mod:`kvcore_transformers.detect`)."""

    __slots__ = ()


def kv_caches(cache: Any, attention_type: str | None = None) -> Any:
    """The tensors of a transformers cache, nested for :func:`kvcore.detect` /
    :func:`kvcore.detect_per_layer` with ``engine="transformers"``.

    Args:
        cache: a ``DynamicCache`` / ``StaticCache`` (either API generation) or a
            continuous-batching ``PagedAttentionCache``.
        attention_type: for a paged cache with several groups, which one
            (``"full_attention"`` / ``"sliding_attention"``).
    Returns:
        DynamicCache / StaticCache: ``[(K_0, V_0), (K_1, V_1), ...]``, each ``[batch, NH, seq, HS]``
        (format ``NL_X_TWO_X_NB_NH_BS_HS``; ``None`` for a layer without per-token KV;
        sliding-window layers are shorter, so pass the list to ``kvcore.detect_per_layer``,
        which reports the ``None`` layers as not KV). Paged: the group's
        ``[NB, NL_group, 2, page_size, NH, HS]`` view (format ``NB_NL_TWO_BS_NH_HS``).
    Raises:
        DetectionError: see :func:`layer_pairs` and :func:`paged_groups`; several paged
            groups and no ``attention_type``, or an unknown one.
    """
    if is_paged_cache(cache):
        return select_group(paged_groups(cache), attention_type).view
    return layer_pairs(cache)


def select_group(groups: dict[str, PagedGroup], attention_type: str | None) -> PagedGroup:
    """The group named ``attention_type``; the only group when None.

    Raises:
        AmbiguousLayoutError: several groups and no ``attention_type`` (names them).
        DetectionError: an ``attention_type`` the cache does not have.
    """
    from kvcore import AmbiguousLayoutError

    if attention_type is None:
        if len(groups) == 1:
            return next(iter(groups.values()))
        desc = [f"{n} (layers {list(g.layer_ids)}, {list(g.view.shape)})" for n, g in groups.items()]
        raise AmbiguousLayoutError(
            "this transformers paged cache holds one layout per attention type, laid over the same bytes: "
            + "; ".join(desc)
            + ". Pass hints={'attention_type': ...} to pick one, or use kvcore_transformers.detect_paged(cache) for all of them",
            candidates=[f"{PAGED_FORMAT} [{n}]" for n in groups],
            hints=["attention_type"],
        )
    if attention_type not in groups:
        raise DetectionError(f"attention_type={attention_type!r}: this paged cache has the groups {sorted(groups)}")
    return groups[attention_type]
