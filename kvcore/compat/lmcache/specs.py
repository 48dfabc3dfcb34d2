"""LMCache's ``kv_format/specs``: :class:`KVFormatSpec`, one subclass per format name, and
the per-layer layouts its accessors answer from."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvcore import registry
from kvcore.compat.lmcache.formats import (
    _BLOCKED_SCALE_RECORDS,
    _LMCACHE_ALLOCATORS,
    _LMCACHE_ENGINE,
    FACTS,
    LMCACHE_FORMATS,
    DiscoverableKVCache,
    EngineKVFormat,
    _fmt,
)
from kvcore.detection import tensors_in
from kvcore.errors import FormatError, GeometryError
from kvcore.grammar import render_concrete, render_symbolic
from kvcore.layout import KVLayout, build_layout


def _params_for(f: EngineKVFormat, kv_caches: Any) -> dict[str, Any] | None:
    """The format's params; for blocked-scale records without a scale width, LMCache's
    record table gives it from the record width."""
    params = dict(f.params)
    if f.syntax.blocked_scale and "scale_bytes" not in params:
        leaves = tensors_in(kv_caches)
        if leaves and leaves[0].dim() >= 1:
            w = int(leaves[0].shape[-1]) * leaves[0].element_size()
            if w in _BLOCKED_SCALE_RECORDS:
                params["scale_bytes"] = _BLOCKED_SCALE_RECORDS[w]
    return params or None


def _layout(kv_caches: Any, fmt: Any) -> KVLayout:
    f = _fmt(fmt)
    return build_layout(str(f), kv_caches, dtype=f.dtype, params=_params_for(f, kv_caches))


def _entries(kv_caches: Any, f: EngineKVFormat) -> int:
    """Layers in a per-layer or K/V-list container, checking the nesting (not the geometry).

    Raises:
        GeometryError: a multi-plane format (LMCache's accessors describe one width and
            dtype per layout; kvcore's layout API describes each plane), or a container not
            nested as the format says.
    """
    c = f.syntax.container
    if c == "planes":
        raise GeometryError(
            f"format {f} is a multi-plane layout (planes {', '.join(p.role for p in f.syntax.planes)}, each with its own "
            "tensors, width and dtype): LMCache's spec accessors describe one width per layout, so they do not answer for "
            "it. Use kvcore's layout: layout = kvcore.build_layout(fmt, kv_caches) (layout.num_layers, layout.planes, "
            "layout.staging_shapes(T), kvcore.gather(layout, slot_mapping))"
        )
    try:
        if c == "kv_list":
            if len(kv_caches) != 2 or not isinstance(kv_caches[0], (list, tuple)) or not isinstance(kv_caches[1], (list, tuple)):
                raise TypeError
            if len(kv_caches[0]) != len(kv_caches[1]):
                raise GeometryError(f"format {f}: the K list has {len(kv_caches[0])} layers but the V list {len(kv_caches[1])}")
            n = len(kv_caches[0])
        else:
            if not isinstance(kv_caches, (list, tuple)):
                raise TypeError
            n = len(kv_caches)
    except (TypeError, KeyError):
        raise GeometryError(f"format {f}: kv_caches is not nested as {f.syntax.symbolic()} ({type(kv_caches).__name__})") from None
    if n == 0:
        raise GeometryError(f"format {f}: kv_caches holds no layers")
    return n


def _layer_layout(kv_caches: Any, fmt: Any, layer_idx: int) -> KVLayout:
    """The layout of one layer (LMCache's per-layer accessors read ``kv_caches[layer_idx]``,
    so mixed-geometry lists answer per layer). A cross-layer format ignores ``layer_idx``."""
    f = _fmt(fmt)
    if f.syntax.container == "cross_layer":
        return _layout(kv_caches, f)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise GeometryError(f"layer_idx must be an int, got {layer_idx!r}")
    n = _entries(kv_caches, f)
    if not (0 <= layer_idx < n):
        raise GeometryError(f"layer_idx {layer_idx} is out of range: kv_caches has {n} layers (0..{n - 1})")
    if f.syntax.container == "kv_list":
        sub = [[kv_caches[0][layer_idx]], [kv_caches[1][layer_idx]]]
    else:
        sub = [kv_caches[layer_idx]]
    return build_layout(str(f), sub, dtype=f.dtype, params=_params_for(f, sub))


def _select(kv_caches: Any, f: EngineKVFormat, layer_indices: Sequence[int]) -> Any:
    if f.syntax.container == "kv_list":
        return [[kv_caches[0][i] for i in layer_indices], [kv_caches[1][i] for i in layer_indices]]
    return [kv_caches[i] for i in layer_indices]


# -- specs (LMCache kv_format/specs) ---------------------------------------------------------


class _AttentionBackends:
    """``attention_backends`` on a spec class: the registering plugin's backends, else who
    allocates the LMCache member; read when asked, so plugins loaded later are seen."""

    def __get__(self, obj: Any, cls: type | None = None) -> tuple[str, ...]:
        cls = cls if cls is not None else type(obj)
        fmt = getattr(cls, "engine_kv_format", None)
        return _attention_backends(fmt) if fmt is not None else ()


def _attention_backends(fmt: Any) -> tuple[str, ...]:
    """The labels of ``fmt``, the representative first. For an LMCache member: the backends
    the declaration of LMCache's engine for it lists (its own plugin's first), else
    LMCache's label, then every other declaration's; so the first entry is the same
    whatever else is installed (a third party declaring vLLM's name, another engine's
    plugin sharing it). For another name: the registry's merged labels (its owner's first)."""

    name = str(fmt)
    try:
        registry.get_format(name)
        decls = registry.declarations(name)
    except FormatError:
        decls = {}
    engine = _LMCACHE_ENGINE.get(name)
    out: list[str] = []

    def add(labels: Sequence[str]) -> None:
        out.extend(b for b in labels if b not in out)

    if engine is not None:
        mine = sorted(
            (p for p, d in decls.items() if engine in {e.lower() for e in d.engines}),
            key=lambda p: p.lower() != engine,  # the engine's own plugin first, then others declaring it for the engine
        )
        for p in mine:
            add(decls[p].attention_backends)
        add(_LMCACHE_ALLOCATORS.get(name, ()))
    for d in decls.values():
        add(d.attention_backends)
    return tuple(out)


class KVFormatSpec:
    """Geometry of one format's ``kv_caches`` (LMCache ``kv_format/specs/base.py::KVFormatSpec``).

    Get one with :func:`get_spec` (or ``get_spec_class(fmt)(kv_caches)``). Every format has
    its own subclass (``NL_X_TWO_NB_BS_NH_HS_Spec``...), whose class attributes are the
    format's static facts, read off its name:

    * ``engine_kv_format``: the format (:class:`EngineKVFormat`);
    * ``attention_backends``: non-empty for every format a plugin registers or LMCache has a
      member for; the first is what :func:`get_attention_backend` returns;
    * structure (exactly one true): ``is_cross_layer``, ``is_kv_list``, ``is_layer_list``;
    * modifiers: ``is_mla``, ``is_hnd``, ``is_fused_packed``, ``is_two_major``,
      ``is_pbs_fused``, ``is_kv_second_tuple``, ``is_single_kv``.

    Accessors answer from kvcore's layout of the tensors (:func:`kvcore.build_layout`): the
    per-layer ones (``layer_idx``) read that layer alone, so lists whose layers differ answer
    per layer; ``num_blocks``, ``page_buffer_size``, ``tokens_per_layer`` and
    ``elements_per_layer`` read layer 0, as LMCache's do. Sizes are in elements of
    :meth:`dtype`. The spec borrows ``kv_caches``; build one per question.

    Raises (from the accessors): GeometryError (a ``ValueError``) when the tensors do not
    fit the format, for ``num_blocks``/``block_size`` of a fused NBBS format, or for a
    ``layer_idx`` out of range.
    """

    engine_kv_format: ClassVar[EngineKVFormat]
    attention_backends: ClassVar[tuple[str, ...]] = _AttentionBackends()  # type: ignore[assignment]
    is_cross_layer: ClassVar[bool] = False
    is_kv_list: ClassVar[bool] = False
    is_layer_list: ClassVar[bool] = False
    is_mla: ClassVar[bool] = False
    is_hnd: ClassVar[bool] = False
    is_fused_packed: ClassVar[bool] = False
    is_two_major: ClassVar[bool] = False
    is_pbs_fused: ClassVar[bool] = False
    is_kv_second_tuple: ClassVar[bool] = False
    is_single_kv: ClassVar[bool] = False

    def __init__(self, kv_caches: DiscoverableKVCache, engine_kv_format: Any = None):
        """Args:
            kv_caches: the normalised container (as :func:`detect_format` returns it).
            engine_kv_format: the detected value when it carries more than the name (a
                byte view's dtype); default the class's format.

        Raises:
            FormatError: ``engine_kv_format`` names another format than this class's.
        """
        fmt = type(self).engine_kv_format if engine_kv_format is None else _fmt(engine_kv_format)
        if str(fmt) != str(type(self).engine_kv_format):
            raise FormatError(f"{type(self).__name__} describes {type(self).engine_kv_format}, not {fmt}")
        self.kv_caches = kv_caches
        self._fmt = fmt

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._fmt})"

    @classmethod
    def paged_layer_shape(cls, nb: int, bs: int, nh: int, hs: int) -> tuple[int, ...]:
        """The shape of one layer's paged tensor for these sizes (``hs``: the element axis,
        the packed K|V width for CS formats; ``nb * bs`` for a fused NBBS axis).

        Raises:
            FormatError: the format has no single tensor per layer (cross-layer, K/V lists,
                per-layer tuples), or a size is not a positive int.
        """
        fmt = cls.engine_kv_format
        syn = fmt.syntax
        if syn.container != "layer_list":
            raise FormatError(f"{fmt!r} does not have one paged tensor per layer ({syn.symbolic()})")
        for k, v in (("nb", nb), ("bs", bs), ("nh", nh), ("hs", hs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FormatError(f"paged_layer_shape: {k} must be a positive int, got {v!r}")
        if syn.blocked_scale:  # records [NB, BS, W]
            return (nb, bs, hs)
        sizes = {"NB": nb, "BS": bs, "NBBS": nb * bs, "NH": nh, "HS": hs, "CS": hs, "TWO": 2, "ONE": 1}
        return tuple(sizes[t] for t in syn.axes)

    # -- accessors -----------------------------------------------------------------------
    def _layer(self, layer_idx: int = 0) -> KVLayout:
        return _layer_layout(self.kv_caches, self._fmt, layer_idx)

    def num_layers(self) -> int:
        """Layers (list entries; the NL axis of a cross-layer tensor)."""
        if self._fmt.syntax.container == "cross_layer":
            return _layout(self.kv_caches, self._fmt).num_layers
        n = _entries(self.kv_caches, self._fmt)
        self._layer(0)  # the entries are this format's tensors
        return n

    def num_blocks(self) -> int:
        """Blocks per layer. Raises GeometryError (ValueError) for a fused NBBS axis."""
        return self._layer(0).num_blocks

    def block_size(self, layer_idx: int = 0) -> int:
        """Tokens per block of ``layer_idx``. Raises GeometryError for a fused NBBS axis."""
        return self._layer(layer_idx).block_size

    def page_buffer_size(self) -> int:
        """Token slots per layer: ``num_blocks * block_size``, or the fused NBBS axis."""
        return self._layer(0).page_buffer_size

    def kv_size(self) -> int:
        """2 when K and V are both stored (a TWO axis, or packed in CS), 1 for MLA."""
        return self._layer(0).kv_size

    def num_heads(self, layer_idx: int = 0) -> int:
        """KV heads of ``layer_idx`` (1 for MLA)."""
        return self._layer(layer_idx).num_heads

    def hidden_dim(self, layer_idx: int = 0) -> int:
        """``num_heads * head_size`` of ``layer_idx``: one token's K (or V) row."""
        return self._layer(layer_idx).hidden_dim

    def head_size(self, layer_idx: int = 0) -> int:
        """Head size of ``layer_idx`` (the K head size of packed K|V; 576 for DeepSeek MLA)."""
        return self._layer(layer_idx).head_size

    def tokens_per_layer(self) -> int:
        """Token slots per layer (``num_blocks * block_size``)."""
        return self._layer(0).tokens_per_layer

    def elements_per_layer(self) -> int:
        """Elements one layer holds, K and V together (``kv_size * slots * NH * HS``)."""
        return self._layer(0).elements_per_layer

    def dtype(self, layer_idx: int = 0) -> torch.dtype:
        """Element dtype of ``layer_idx`` (a byte view's carried dtype)."""
        return self._layer(layer_idx).dtype

    def data_ptrs(self, layer_indices: Sequence[int] | None = None) -> list[int]:
        """Device pointers in kernel order for ``layer_indices`` (default: every layer): one
        per layer for layer lists; all K then all V for K/V lists; K0, V0, K1, V1... for
        per-layer tuples; one base for a cross-layer tensor.

        Raises:
            GeometryError: a layer index out of range or repeated.
        """
        f = self._fmt
        if f.syntax.container == "cross_layer":
            return _layout(self.kv_caches, f).data_ptrs(None if layer_indices is None else list(layer_indices))
        n = _entries(self.kv_caches, f)
        sel = list(range(n)) if layer_indices is None else _layer_indices(layer_indices, n)
        if not sel:
            return []
        sub = _select(self.kv_caches, f, sel)
        leaves = tensors_in(sub)
        if all(t.shape == leaves[0].shape and t.stride() == leaves[0].stride() and t.dtype == leaves[0].dtype for t in leaves):
            return build_layout(str(f), sub, dtype=f.dtype, params=_params_for(f, sub)).data_ptrs()
        per = [self._layer(i).data_ptrs() for i in sel]  # layers that differ: one at a time
        if f.syntax.container == "kv_list":
            return [p[0] for p in per] + [p[1] for p in per]
        return [x for p in per for x in p]

    def concrete_shape_str(self) -> str:
        """The symbolic shape with this cache's sizes, e.g. ``80 x [2, 2048, 16, 8, 128]``
        (layer 0's sizes for a per-layer list)."""
        f = self._fmt
        if f.syntax.container == "cross_layer":
            return _layout(self.kv_caches, f).describe()
        sizes = self._layer(0).sizes()
        sizes["NL"] = self.num_layers()
        return render_concrete(f.syntax, sizes)


def _layer_indices(layer_indices: Sequence[int], n: int) -> list[int]:
    try:
        sel = list(layer_indices)
    except TypeError:
        raise GeometryError(f"layer_indices must be a sequence of layer indices, got {layer_indices!r}") from None
    out = []
    for i in sel:
        try:
            j = operator.index(i)
        except TypeError:
            j = None
        if j is None or isinstance(i, bool) or not (0 <= j < n):
            raise GeometryError(f"layer index {i!r} is out of range: kv_caches has {n} layers (0..{n - 1})")
        out.append(j)
    if len(set(out)) != len(out):
        raise GeometryError(f"layer indices {out} repeat a layer")
    return out


_SPEC_CLASSES: dict[str, type[KVFormatSpec]] = {}


def get_spec_class(fmt: Any) -> type[KVFormatSpec]:
    """The :class:`KVFormatSpec` subclass of ``fmt``, the owner of its static facts
    (LMCache ``kv_format.get_spec_class``). Every name the grammar parses has one (LMCache's
    members and the kvcore formats detection returns); the class is built from the name.

    Raises:
        FormatError: ``fmt`` is not a format name ("Unknown Engine KV Format").
    """
    try:
        f = _fmt(fmt)
    except FormatError as e:
        raise FormatError(f"Unknown Engine KV Format: {fmt!r} ({e})") from None
    name = str(f)
    cls = _SPEC_CLASSES.get(name)
    if cls is None:
        member = getattr(EngineKVFormat, name, None) if name in LMCACHE_FORMATS else EngineKVFormat(name)
        attrs = {
            "engine_kv_format": member,
            **{fact: getattr(member, fact) for fact in FACTS},
            "__doc__": f"Geometry of {name}: {render_symbolic(name)}.",
            "__module__": __name__,
        }
        cls = _SPEC_CLASSES.setdefault(name, type(f"{name}_Spec", (KVFormatSpec,), attrs))
    return cls


def get_spec(kv_caches: DiscoverableKVCache, fmt: Any) -> KVFormatSpec:
    """A spec wrapping ``kv_caches`` of format ``fmt`` (LMCache ``kv_format.get_spec``).

    Raises:
        FormatError: ``fmt`` is not a format name.
    """
    return get_spec_class(fmt)(kv_caches, fmt)
