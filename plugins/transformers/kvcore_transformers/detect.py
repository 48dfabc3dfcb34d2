"""Detection for ``engine="transformers"``.

Accepted inputs (the plugin answers only for ``engine == "transformers"``):

* a cache object: ``DynamicCache`` / ``StaticCache`` (both API generations) or a
  continuous-batching ``PagedAttentionCache`` (see :mod:`kvcore_transformers.caches`);
* what :func:`kvcore_transformers.kv_caches` returns: a list of per-layer ``(K, V)``
  pairs of ``[batch, NH, seq, HS]`` → ``NL_X_TWO_X_NB_NH_BS_HS`` (while the pairs are still
  attention's ``transpose(1, 2)`` views, tokens outside heads in memory, the physical name
  ``NL_X_TWO_X_NB_BS_NH_HS`` over views permuted back); or one 6-D
  ``[NB, NL, 2, page_size, NH, HS]`` paged view → ``NB_NL_TWO_BS_NH_HS``;
* ``[K list, V list]`` (the 4.53 ``key_cache``/``value_cache`` lists as they are): two
  lists of n != 2 tensors can only be that; two lists of two tensors also read as two
  ``[K, V]`` layers, so they need ``hints={"container": "kv_lists"}`` (or ``"layer_pairs"``)
  and raise :class:`~kvcore.AmbiguousLayoutError` without it. Tuples are always pairs;
* the paged cache's raw 1-D ``torch.uint8`` tensor with hints ``num_layers`` (layers of
  the group), ``num_kv_heads``, ``head_size``, ``page_size`` (alias ``block_size``) and
  ``dtype`` — the bytes alone do not say their geometry.

Hints: ``attention_type`` (paged group: ``full_attention`` / ``sliding_attention``),
``container`` (``layer_pairs`` / ``kv_lists``), ``transformers_version`` (refuse tensors
from a version outside the supported range), and the paged geometry above.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import Candidate, Detection, DetectionError, memory_ordered, resolve
from kvcore.detection import physical_permutation, tensor_order

from .caches import (
    LAYER_PAIRS_FORMAT,
    LAYER_PAIRS_NHD_FORMAT,
    PAGED_FORMAT,
    CachePair,
    as_dtype,
    is_layered_cache,
    is_legacy_cache,
    is_paged_cache,
    layer_pairs,
    paged_groups,
    paged_view,
    select_group,
)
from .versions import check_version

__all__ = ["detect", "HINTS"]

HINTS = (
    "attention_type",
    "container",
    "transformers_version",
    "num_layers",
    "num_kv_heads",
    "head_size",
    "page_size",
    "block_size",
    "dtype",
    "tensor_order",  # kvcore's generic hint: transformers' tensors are contiguous, their axes in memory order
)


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} stride {list(t.stride())} {str(t.dtype).replace('torch.', '')}"


def detect(kv_caches: Any, hints: dict[str, Any]) -> Detection | None:
    """Recognise a transformers cache (see the module docstring).

    Returns:
        a Detection, or None when the input is nothing transformers allocates.
    Raises:
        DetectionError: a transformers cache this plugin cannot describe, with the reason
            (unsupported version, quantized, empty, K and V head sizes that differ, layers
            of different lengths, missing paged hints).
        AmbiguousLayoutError: a paged cache with several attention-type groups and no
            ``attention_type`` hint.
    """
    unknown = sorted(set(hints) - set(HINTS))
    if unknown:
        raise DetectionError(f"engine 'transformers' does not know the hints {unknown}; it reads {', '.join(HINTS)}")
    tensor_order(hints)  # validated; transformers' caches read the same either way (contiguous, in memory order)
    if hints.get("transformers_version") is not None:
        check_version("cache", version=str(hints["transformers_version"]))
    if is_paged_cache(kv_caches):
        group = select_group(paged_groups(kv_caches), hints.get("attention_type"))
        det = _paged_detection(group.view, f"PagedAttentionCache group {group.attention_type!r}, model layers {list(group.layer_ids)}")
        det.layer_ids = group.layer_ids
        return det
    if is_layered_cache(kv_caches) or is_legacy_cache(kv_caches) or type(kv_caches).__module__.startswith("transformers."):
        # any other transformers object gets layer_pairs' message (encoder-decoder, unknown cache class)
        return _pairs_detection(layer_pairs(kv_caches), f"{type(kv_caches).__name__} layers", hints)
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() == 6 and kv_caches.shape[2] == 2:
            return _paged_detection(kv_caches, "6-D [NB, NL, 2, page_size, NH, HS] paged view")
        if kv_caches.dim() == 1 and kv_caches.dtype == torch.uint8:
            return _raw_paged(kv_caches, hints)
        return None
    if isinstance(kv_caches, (list, tuple)):
        container = hints.get("container") or _container_of(kv_caches)
        if container is None:
            return None
        if container == "kv_lists":
            if len(kv_caches) != 2 or not all(isinstance(x, (list, tuple)) for x in kv_caches):
                raise DetectionError("container='kv_lists' expects [K list, V list] (cache.key_cache, cache.value_cache)")
            if len(kv_caches[0]) != len(kv_caches[1]):
                raise DetectionError(f"the K list has {len(kv_caches[0])} layers but the V list {len(kv_caches[1])}")
            pairs = list(zip(kv_caches[0], kv_caches[1]))
        elif container == "layer_pairs":
            pairs = list(kv_caches)
        else:
            raise DetectionError(f"hint container={container!r}: use 'layer_pairs' ([(K, V), ...]) or 'kv_lists' ([K list, V list])")
        ok = [
            p is None or (isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in p))
            for p in pairs
        ]
        if not all(ok):
            return None
        return _pairs_detection(pairs, "per-layer (K, V) pairs", hints)
    return None


def _container_of(x: list | tuple) -> str | None:
    """``layer_pairs`` or ``kv_lists`` when the nesting says which, else raise.

    Tuples are (K, V) pairs (what :func:`kvcore_transformers.kv_caches` returns). Two lists
    of n != 2 tensors can only be [K list, V list]. Two lists of two tensors read both ways
    (2 layers as [K list, V list], or 2 layers of [K, V]), and the bytes cannot tell.
    """
    seqs = [e for e in x if isinstance(e, (list, tuple))]
    if (
        len(x) == 2
        and len(seqs) == 2
        and all(isinstance(e, list) for e in seqs)
        and all(isinstance(t, torch.Tensor) for e in seqs for t in e)
    ):
        n = {len(e) for e in seqs}
        if len(n) == 1 and n != {2}:
            return "kv_lists"
        if n == {2}:
            from kvcore import AmbiguousLayoutError

            raise AmbiguousLayoutError(
                "two lists of two tensors are either 2 layers given as [K list, V list] or 2 layers given as [K, V] pairs; "
                "pass hints={'container': 'kv_lists'} or {'container': 'layer_pairs'} (kvcore_transformers.kv_caches(cache) "
                "returns (K, V) tuples, which need no hint)",
                candidates=[f"{LAYER_PAIRS_FORMAT} [kv_lists]", f"{LAYER_PAIRS_FORMAT} [layer_pairs]"],
                hints=["container"],
            )
    return "layer_pairs"


def _paged_detection(view: torch.Tensor, note: str) -> Detection:
    # the layout's layers are the group's, in block order (PagedGroup.layer_ids: the model's)
    return Detection(format=PAGED_FORMAT, kv_caches=view, note=f"transformers {note}")


def _raw_paged(buf: torch.Tensor, hints: dict[str, Any]) -> Detection:
    need = ["num_layers", "num_kv_heads", "head_size", "dtype"]
    ps = hints.get("page_size", hints.get("block_size"))
    missing = [k for k in need if hints.get(k) is None] + ([] if ps is not None else ["page_size"])
    if missing:
        raise DetectionError(
            f"a 1-D uint8 tensor ({buf.numel()} bytes) is a transformers continuous-batching cache only with its geometry: "
            f"pass hints {missing} (num_layers = layers of the attention-type group), or pass the PagedAttentionCache itself"
        )
    view = paged_view(
        buf,
        num_layers=hints["num_layers"],
        num_kv_heads=hints["num_kv_heads"],
        head_size=hints["head_size"],
        page_size=ps,
        dtype=as_dtype(hints["dtype"]),
    )
    return _paged_detection(view, "uint8 paged buffer viewed with the given hints")


def _pairs_detection(entries: list, note: str, hints: dict[str, Any]) -> Detection:
    """Per-layer (K, V) pairs; ``None`` entries are layers without per-token KV (left out,
    ``layer_ids`` says which layers the layout covers).

    Pairs read out of a cache object (:class:`~kvcore_transformers.caches.CachePair`) are
    as transformers allocated them. Plain contiguous tensors can also be a transposed
    allocation someone permuted into memory order; when that reading's geometry differs
    (heads and sequence swapped) ``num_kv_heads`` or ``tensor_order`` decides
    (:class:`kvcore.AmbiguousLayoutError` without them: never a guess)."""
    ids = [i for i, p in enumerate(entries) if p is not None]
    if not ids:
        return Detection(format=None, excluded="these layers hold no per-token KV (DummyLayer / linear-attention state)")
    pairs = [entries[i] for i in ids]
    for i, (k, v) in zip(ids, pairs):
        if k.shape[-1] != v.shape[-1]:
            raise DetectionError(
                f"layer {i}: K head size {k.shape[-1]} differs from V head size {v.shape[-1]} (keys {_shape(k)}, values {_shape(v)}); "
                "kvcore's staging layout [2, NL, T, NH*HS] needs one head size. Describe K and V as two key-only layouts instead: "
                "kvcore.build_layout('NL_X_NB_NH_BS_HS', [p[0] for p in kvcore_transformers.kv_caches(cache) if p]) and the same for the values"
            )
        if k.shape != v.shape:
            raise DetectionError(
                f"layer {i}: keys {_shape(k)} and values {_shape(v)} differ in shape; transformers stores both [batch, NH, seq, HS]"
            )
    sig = [(tuple(k.shape), tuple(k.stride()), tuple(v.stride()), k.dtype, str(k.device)) for k, v in pairs]
    if len(set(sig)) > 1:
        groups: dict[tuple, list[int]] = {}
        for i, s in zip(ids, sig):
            groups.setdefault(s, []).append(i)
        desc = "; ".join(f"layers {ids}: {list(s[0])} stride {list(s[1])} {str(s[3]).replace('torch.', '')}" for s, ids in groups.items())
        raise DetectionError(
            f"the layers of this transformers cache are not one layout ({desc}): sliding-window layers keep fewer tokens. "
            "Use kvcore.detect_per_layer(kvcore_transformers.kv_caches(cache), engine='transformers') for one layout per group"
        )
    left_out = [i for i, p in enumerate(entries) if p is None]
    if left_out:
        note += f"; layers {left_out} hold no per-token KV and are left out"
    # a name is the physical order: pairs that are still attention's transpose(1, 2) views
    # keep tokens outside heads in memory (4.53 DynamicCache.update after a prefill)
    note = f"transformers {note}; block = batch row, slot = b * seq + position"
    k0, v0 = pairs[0]
    orders = {tuple(physical_permutation(k0)), tuple(physical_permutation(v0))}
    views = [tuple(p) for p in pairs]
    own = all(isinstance(p, CachePair) for p in pairs)
    if len(orders) > 1:
        raise DetectionError(
            f"the keys ({_shape(k0)}) and values ({_shape(v0)}) of this transformers cache lie in memory in different orders; "
            "describe them as two key-only layouts (kvcore.build_layout on the keys and on the values)"
        )
    if orders == {(0, 2, 1, 3)}:  # [batch, NH, seq, HS] over [batch, seq, NH, HS] memory: read through the strides
        t_views = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in pairs]
        cands = [
            Candidate(
                LAYER_PAIRS_NHD_FORMAT,
                t_views,
                note=f"{note}; keys and values are still attention's transposed views: tokens outside heads in memory",
                label="as allocated [batch, NH, seq, HS], tokens outside heads in memory",
                order="allocated",
            )
        ]
        heads = {LAYER_PAIRS_NHD_FORMAT: 2}
    else:
        # read as transformers allocates them: [batch, NH, seq, HS]
        ordered = all(memory_ordered(t) for p in views for t in p)
        cands = [
            Candidate(
                LAYER_PAIRS_FORMAT, views, note=note, label="as allocated [batch, NH, seq, HS]", order=None if ordered else "allocated"
            )
        ]
        heads = {LAYER_PAIRS_FORMAT: 1, LAYER_PAIRS_NHD_FORMAT: 2}
        if ordered and not own:
            # plain tensors in memory order may also be a transposed allocation (4.53's first update keeps the
            # transposed key_states view, memory [batch, seq, NH, HS]) someone permuted into memory order
            cands.append(
                Candidate(
                    LAYER_PAIRS_NHD_FORMAT,
                    views,
                    note=f"{note}; the tensors read as [batch, seq, NH, HS] already in memory order",
                    label="[batch, seq, NH, HS] in memory order",
                    order="physical",
                )
            )
    nh = hints.get("num_kv_heads")
    if nh is not None:
        cands = [c for c in cands if int(c.kv_caches[0][0].shape[heads[c.format]]) == nh]
        if not cands:
            raise DetectionError(f"hint num_kv_heads={nh} but these tensors {_shape(k0)} hold another number of heads")
    det = resolve(cands, engine="transformers", hints=hints, geometry_hints={"num_heads": "num_kv_heads"}, required=True)
    det.layer_ids = tuple(ids) if left_out else None
    return det
