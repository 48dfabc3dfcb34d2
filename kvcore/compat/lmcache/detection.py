"""LMCache's format discovery (``utils.normalize_kv_and_discover_format``,
``kv_format.detect_format``, per-layer formats, shape keys) over :func:`kvcore.detect`."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from kvcore.compat.lmcache.formats import LMCACHE_FORMATS, EngineKVFormat
from kvcore.compat.lmcache.hints import _engine, _prepare
from kvcore.detection import detect, detect_per_layer, normalize_container, tensors_in
from kvcore.errors import AmbiguousLayoutError, DetectionError, GeometryError
from kvcore.grammar import render_symbolic
from kvcore.layout import KVLayout

# one logger for the whole facade (its name is the one LMCache users filter on)
logger = logging.getLogger("kvcore.compat.lmcache")


def _from_layout(layout: KVLayout) -> EngineKVFormat:
    dt = layout.dtype if layout.dtype != layout.storage_dtype else None
    return EngineKVFormat(layout.format.name, dt, getattr(layout.spec, "params", {}))


def _as_lmcache(layout: KVLayout) -> tuple[EngineKVFormat, Any]:
    """A detected layout in LMCache's vocabulary: its format and container, or, when LMCache
    has no member of that name but one for the same bytes, that member and its views.

    Two exact re-views (zero-copy, every address unchanged) are tried: a cross-layer tensor
    whose layer axis is outermost or directly inside the block axis becomes per-layer views
    (``NB_NL_NH_BS_CS`` -> ``NL_X_NB_NH_BS_CS``: each view's ``stride(0)`` spans the other
    layers' bytes, LMCache's dim-0 padding), and a singleton axis is dropped
    (``NL_X_NB_BS_ONE_HS`` -> ``NL_X_NB_BS_HS``). Otherwise kvcore's name is kept.
    """
    f = _from_layout(layout)
    kv = layout.kv_caches
    if str(f) in LMCACHE_FORMATS:
        return f, kv
    syn = f.syntax
    levels, axes = list(syn.list_levels), list(syn.axes)
    if not levels and "NL" in axes:
        nl = axes.index("NL")
        if nl == 0 or (nl == 1 and axes[0] in ("NB", "NBBS")):
            kv = [kv.select(nl, i) for i in range(kv.shape[nl])]
            levels, axes = ["NL"], axes[:nl] + axes[nl + 1 :]
    if levels == ["NL"] and axes.count("ONE") == 1:
        name = "_X_".join(levels + ["_".join(a for a in axes if a != "ONE")])
        if name in LMCACHE_FORMATS:
            j = axes.index("ONE")
            kv = [t.select(j, 0) for t in kv]
            axes = [a for a in axes if a != "ONE"]
    name = "_X_".join(levels + ["_".join(axes)])
    if name == str(f) or name not in LMCACHE_FORMATS:
        return f, layout.kv_caches
    return EngineKVFormat(name, f.dtype, f.params), kv


# -- detection -------------------------------------------------------------------------------


def normalize_kv_and_discover_format(kv_caches: Any, serving_engine: Any, layout_hints: Any = None) -> tuple[EngineKVFormat, Any]:
    """Detect the format of ``kv_caches`` and return it with the normalised container.

    LMCache ``utils.normalize_kv_and_discover_format`` (= ``kv_format.detect_format``).

    Args:
        kv_caches: the engine's tensors: a list/tuple (nested as the engine keeps it) or a
            dict keyed by layer name.
        serving_engine: ``"vllm"``, ``"sglang"``, ... or :class:`EngineType` (LMCache's).
        layout_hints: LMCache ``LayoutHints`` or kvcore hint keys (module docstring).
    Returns:
        ``(fmt, normalized)``: the format, and the container as the format nests it — views
        of the caller's tensors (never copies). Use ``normalized`` with the accessors.
    Raises:
        DetectionError: nothing recognises the cache (the message lists shapes, strides and
            the plugins asked). AmbiguousLayoutError: two layouts fit; names the deciding hint.
    """
    engine = _engine(serving_engine)
    kv, hints = _prepare(kv_caches, engine, layout_hints)
    try:
        layout = detect(kv, engine, hints)
    except AmbiguousLayoutError as e:
        layout = _lmcache_reading(kv, engine, hints, e)
    fmt, normalized = _plane_tuples(layout, kv) if engine == "vllm" else (None, None)
    if fmt is None:
        fmt, normalized = _as_lmcache(layout)
    logger.info("Engine KV Format: %s %s", fmt, render_symbolic(str(fmt)))
    return fmt, normalized


#: vllm-ascend's tuple layouts (kvcore-vllm ``pairs``) whose planes LMCache names ``NL_X_NP_X_NB_BS_ONE_HS``
_ASCEND_PLANE_TUPLES = (
    "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS",
    "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS",
    "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS+IK=NL_X_NB_BS_NH_HS",
    "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS+IK=NL_X_NB_BS_NH_HS+IKS=NL_X_NB_BS_NH_HS",
    "KV=NL_X_NB_BS_NH_HS",
    "K=NL_X_NB_BS_NH_HS",
    "K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH_HS",
)


def _single_head_tuples(kv: Any) -> bool:
    entries = list(kv.values()) if isinstance(kv, Mapping) else kv
    return (
        isinstance(entries, (list, tuple))
        and bool(entries)
        and all(
            isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] == 1 for t in x) for x in entries
        )
    )


def _plane_tuples(layout: KVLayout, kv: Any) -> tuple[EngineKVFormat | None, Any]:
    """vllm-ascend's single-head plane tuples (MLA (nope, rope), DSA (k, v, dsa_k[, scale]),
    one-plane tuples) under LMCache's name for them, ``NL_X_NP_X_NB_BS_ONE_HS``, with the
    tuples as LMCache returns them (lists, planes in tuple order): the same planes kvcore's
    multi-plane layout reads, named without their roles. (None, None) for anything else."""
    if layout.format.name not in _ASCEND_PLANE_TUPLES or not _single_head_tuples(kv):
        return None, None
    entries = list(kv.values()) if isinstance(kv, Mapping) else list(kv)
    if len(entries[0]) == 2 and entries[0][0].shape[-1] == entries[0][1].shape[-1] and entries[0][0].dtype == entries[0][1].dtype:
        return None, None  # equal-width pairs are (K, V): LMCache's NL_X_TWO_X_NB_BS_NH_HS
    return EngineKVFormat("NL_X_NP_X_NB_BS_ONE_HS"), [list(x) for x in entries]


def _lmcache_reading(kv: Any, engine: str, hints: dict[str, Any], err: AmbiguousLayoutError) -> KVLayout:
    """Where kvcore's plugin names two readings and LMCache's contract picks one that is
    right by the engine's source, that one; else ``err`` is raised.

    * vLLM rank-4 pages with a singleton head axis (``[NB, 1, BS, W]`` HND / ``[NB, BS, 1,
      W]`` NHD, what LMCache's vLLM adapter sends for 0.33 MLA and record pages): LMCache
      reads one head of a ``W``-wide row per token (kv_size 1). That is the MLA reading
      (``kv_cache_spec="mla"``) wherever that reading moves per-token rows or is the DSA
      indexer's blocked page LMCache also reads (132 B); records whose readings differ
      (V4's 584 B blocked page against a packed row) stay kvcore's ambiguity.
    * vllm-ascend single-head tuples whose (nope, rope) / (K, V head_size_v) readings differ
      only in their planes' names: LMCache's plane tuples (the MLA reading's planes).
    """
    if engine != "vllm" or hints.get("kv_cache_spec") is not None:
        raise err
    entries = list(kv.values()) if isinstance(kv, Mapping) else kv if isinstance(kv, (list, tuple)) else [kv]
    if _single_head_tuples(entries):
        return detect(kv, engine, {**hints, "kv_cache_spec": "mla"})
    if not entries or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in entries):
        raise err
    family = str(hints.get("kv_cache_layout") or "").upper()
    axis = 1 if family in ("HND", "LBHNC", "BLHNC") else 2 if family in ("NHD", "LBNHC", "BLNHC") else None
    if axis is None or any(int(t.shape[axis]) != 1 for t in entries):
        raise err
    try:
        lay = detect(kv, engine, {**hints, "kv_cache_spec": "mla"})
    except DetectionError:
        raise err from None
    width = int(entries[0].shape[-1]) * entries[0].element_size()
    if lay.format.name.endswith("NB_BS_HS") or (lay.format.name.endswith("NB_BSV_BSS") and width == 132):
        return lay
    raise err


detect_format = normalize_kv_and_discover_format


def extract_kv_cache_shapes(kv_caches: Any) -> set[torch.Size]:
    """Every leaf tensor's shape (LMCache ``kv_format.extract_kv_cache_shapes``)."""
    return {t.shape for t in tensors_in(kv_caches)}


def _structure_key(entry: Any) -> Hashable:
    if isinstance(entry, (list, tuple)):
        return tuple(_structure_key(x) for x in entry)
    if isinstance(entry, torch.Tensor):
        return (tuple(entry.shape), entry.dtype)
    return None


def get_shape_and_dtype(kv_caches: Any, layer_indices: Sequence[int] | None = None) -> list[Hashable]:
    """Each requested layer's ``(shape, dtype)`` structure, nested as its entry is (LMCache
    ``utils.get_shape_and_dtype``): two layers share a key exactly when their shapes and
    dtypes match.

    Args:
        kv_caches: per-layer entries (tensors or nested sequences of them), or a dict of layers.
        layer_indices: the entries to describe, in this order; None: all.
    Raises:
        GeometryError: a layer index out of range.
    """
    container, _ = normalize_container(kv_caches)
    entries = list(container) if isinstance(container, (list, tuple)) else [container]
    n = len(entries)
    if layer_indices is None:
        sel = list(range(n))
    else:
        sel = []
        for i in layer_indices:
            if isinstance(i, bool) or not isinstance(i, int) or not (0 <= i < n):
                raise GeometryError(f"layer index {i!r} is out of range: kv_caches has {n} entries (0..{n - 1})")
            sel.append(i)
    return [_structure_key(entries[i]) for i in sel]


def normalize_and_discover_per_layer_formats(
    kv_caches: Any,
    layer_index_groups: Sequence[Sequence[int]] | None,
    serving_engine: Any,
    layout_hints: Any = None,
) -> tuple[Any, list[EngineKVFormat | None]]:
    """One format per layer, for hybrid models (LMCache ``utils.normalize_and_discover_per_layer_formats``).

    If every tensor has one shape and the whole cache is a cross-layer tensor or a K/V list,
    that one format is returned for every layer with the normalised container. Otherwise the
    layers are detected per engine group and per tensor shape/stride/dtype
    (:func:`kvcore.detect_per_layer`).

    Args:
        kv_caches: a per-layer list (or dict), or one cross-layer tensor.
        layer_index_groups: layer indices of each engine group; empty/None means one group.
        serving_engine, layout_hints: as :func:`normalize_kv_and_discover_format`.
    Returns:
        ``(normalized_per_layer, formats)``: per-layer views (as each layer's format nests
        them) and one format per layer; ``None`` for a layer the engine's plugin says is not
        KV (Mamba state), whose raw entry is kept.
    Raises:
        DetectionError / AmbiguousLayoutError: for a group nothing (or more than one layout) fits.
    """
    engine = _engine(serving_engine)
    if len(extract_kv_cache_shapes(kv_caches)) == 1:
        kv, hints = _prepare(kv_caches, engine, layout_hints)
        try:
            whole = detect(kv, engine, hints)
        except DetectionError:
            whole = None
        if whole is not None:
            f, norm = _as_lmcache(whole)
            if f.is_layer_list:
                return _per_layer(whole, norm), [f] * whole.num_layers
            return norm, [f] * whole.num_layers
    container, _ = normalize_container(kv_caches)
    if isinstance(container, torch.Tensor):
        raise DetectionError("a single tensor that no plugin reads as a cross-layer cache has no per-layer formats")
    groups = [list(g) for g in layer_index_groups] if layer_index_groups else None
    container, hints = _prepare(container, engine, layout_hints)
    layouts: Any = detect_per_layer(container, engine, layer_groups=groups, hints=hints)
    if isinstance(layouts, Mapping):  # keyed by layer: back to layer order
        layouts = [layouts[k] for k in (range(len(container)) if all(isinstance(k, int) for k in layouts) else layouts)]
    normalized: list[Any] = []
    formats: list[EngineKVFormat | None] = []
    for i, lay in enumerate(layouts):
        if lay is None:
            normalized.append(container[i])
            formats.append(None)
            continue
        f, norm = _as_lmcache(lay)
        pos = list(lay.layer_ids).index(i) if i in lay.layer_ids else None
        if pos is None or not f.is_layer_list:
            normalized.append(container[i])
        else:
            normalized.append(_per_layer(lay, norm)[pos])
        formats.append(f)
    return normalized, formats


def _per_layer(layout: KVLayout, norm: Any) -> list[Any]:
    """One entry per layer of ``layout``: layers that share memory (``layout.aliases``) are
    one entry of the normalised container, repeated for each of its layers."""
    norm = list(norm)
    if len(norm) != layout.num_layers:
        norm = [norm[p] for p in layout.layer_map]
    return norm
