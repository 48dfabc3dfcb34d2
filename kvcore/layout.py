"""``KVLayout``: a detected KV cache, its geometry, and what kernels need to move it."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from kvcore import registry
from kvcore.detection_decl import Detection
from kvcore.errors import FormatError, GeometryError, KVCoreError
from kvcore.format_decl import KVFormat
from kvcore.grammar import parse
from kvcore.inputs import check_container, plain_integers, tensor_paths
from kvcore.spec import PlaneInfo, Spec, StagingBuffer, StrideTable, record_callers

__all__ = ["PageBufferShapeDesc", "KVLayout", "Detection", "build_layout"]


class PageBufferShapeDesc(BaseModel):
    """The paged buffer's shape as transfer kernels see it (LMCache's
    ``PageBufferShapeDesc``, ``csrc/kv_transfer_plan_types.h``).

    Attributes:
        kv_size: 2 (K, V) or 1 (MLA).
        nl: layers in this group; nb: blocks; bs: block size (for a fused NBBS axis,
            nb is the page buffer size and bs is 1).
        nh: KV heads (1 for MLA); hs: head size in elements.
        element_size: bytes per element.
        block_stride_elems: the block axis's stride in elements when it differs from
            the tight stride (dim-0 padding), else 0.
    """

    model_config = ConfigDict(frozen=True)

    kv_size: int
    nl: int
    nb: int
    bs: int
    nh: int
    hs: int
    element_size: int
    block_stride_elems: int = 0


class KVLayout:
    """A KV cache whose layout is known. Built by :func:`kvcore.detect`.

    Geometry is uniform across the layout's layers (hybrid models get one layout per
    group from :func:`kvcore.detect_per_layer`).

    Layers that are one memory (an engine registering one cache under several layer
    names) stay one layer each: ``aliases`` maps such a layer to the earlier layer whose
    memory it is. A gather reads the shared memory once per layer; a scatter writes it
    once, from the rows of the first of those layers in the selection (the rows of its
    aliases are not written).

    Attributes:
        format: the :class:`KVFormat`.
        kv_caches: the normalised container (views of the engine's tensors; distinct
            memories only when layers alias).
        layer_ids: the model's layer indices this layout covers, in order.
        layer_names: the engine's layer names when the input was a dict, else None.
        aliases: ``{layer: earlier layer with the same memory}`` (empty when none).
        note: how detection decided.
        plugin: the plugin whose ``kvcore_detect`` answered (None for
            :func:`build_layout`).
    """

    def __init__(
        self,
        format: KVFormat,
        spec: Spec,
        *,
        layer_ids: Sequence[int] | None = None,
        layer_names: Sequence[str] | None = None,
        note: str = "",
        engine: str | None = None,
        layer_map: Sequence[int] | None = None,
    ):
        self.format = format
        self.spec = spec
        self.kv_caches = spec.kv_caches
        self.layer_map = tuple(layer_map) if layer_map is not None else tuple(range(spec.num_layers))
        self.layer_ids = tuple(layer_ids) if layer_ids is not None else tuple(range(len(self.layer_map)))
        self.layer_names = tuple(layer_names) if layer_names is not None else None
        self.plugin: str | None = None  # the plugin whose kvcore_detect answered (None: built directly)
        self.note = note
        self.engine = engine

    @property
    def aliases(self) -> dict[int, int]:
        """``{layer: the first earlier layer with the same memory}``; empty when every
        layer has its own memory."""
        first: dict[int, int] = {}
        out: dict[int, int] = {}
        for i, p in enumerate(self.layer_map):
            if p in first:
                out[i] = first[p]
            else:
                first[p] = i
        return out

    # -- geometry --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Layers, one per entry the engine registered (aliased layers included)."""
        return len(self.layer_map)

    @property
    def num_blocks(self) -> int:
        """Blocks (pages) per layer. Raises GeometryError for a fused NBBS axis."""
        return self.spec.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block. Raises GeometryError for a fused NBBS axis."""
        return self.spec.block_size

    @property
    def num_heads(self) -> int:
        """KV heads per token (1 for MLA)."""
        return self.spec.num_heads

    @property
    def head_size(self) -> int:
        """Elements per head, per K or V (576 for DeepSeek MLA latents); for a multi-plane
        layout the value planes' (K, V, or KV) head size.

        Raises:
            GeometryError: a multi-plane layout whose K and V head sizes differ (each
                plane's is in :attr:`planes`).
        """
        hs = self.spec.head_size
        if hs is None:
            raise GeometryError(
                f"format {self.format.name}: its value planes have different head sizes ("
                + ", ".join(f"{p.role} {p.head_size}" for p in self.planes)
                + "); read each plane's from layout.planes"
            )
        return hs

    @property
    def hidden_dim(self) -> int:
        """``num_heads * head_size``: one token's K (or V) row in elements (raises
        GeometryError like :attr:`head_size` when K and V widths differ)."""
        return self.spec.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.spec.kv_size

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype (may differ from the tensors' storage dtype, e.g. int8 views); for
        a multi-plane layout its value planes' (K, V, or KV) dtype.

        Raises:
            GeometryError: a multi-plane layout whose value planes differ in dtype (each
                plane's is in :attr:`planes`).
        """
        dt = self.spec.dtype
        if dt is None:
            raise GeometryError(
                f"format {self.format.name}: its value planes have different dtypes ("
                + ", ".join(f"{p.role} {p.dtype}" for p in self.planes)
                + "); read each plane's from layout.planes"
            )
        return dt

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the tensors holding the values (see :attr:`dtype`)."""
        dt = self.spec.storage_dtype
        if dt is None:
            raise GeometryError(
                f"format {self.format.name}: its value planes are stored in different dtypes ("
                + ", ".join(f"{p.role} {p.storage_dtype}" for p in self.planes)
                + "); read each plane's from layout.planes"
            )
        return dt

    @property
    def planes(self) -> tuple[PlaneInfo, ...]:
        """Every plane of the record, as :class:`~kvcore.spec.PlaneInfo` (role, template,
        dtype, num_heads, head_size, head_bytes, staging buffer): a multi-plane layout's
        planes in its name's order; a single-plane layout's K and V (``KV`` for an MLA
        latent; ``VALS``/``SCALES`` for a blocked-scale record)."""
        return self.spec.plane_info

    @property
    def staging_buffers(self) -> tuple[StagingBuffer, ...]:
        """The staging buffers a transfer of this layout fills: one ``"kv"`` buffer
        ``[kv_size, NL, T, NH*HS]`` (:attr:`classic_staging`), or one per plane, keyed by
        role, ``[NL, T, NH_p * HS_p]`` in the plane's dtype."""
        return self.spec.stride_table().buffers

    @property
    def classic_staging(self) -> bool:
        """True when a transfer stages one tensor ``[kv_size, NL, T, NH*HS]`` (every
        single-plane layout, and multi-plane layouts whose planes are exactly K (and V) of
        one dtype and width); False when it stages a dict ``{role: [NL, T, NH_p*HS_p]}``."""
        b = self.spec.stride_table().buffers
        return len(b) == 1 and b[0].key == "kv" and b[0].kv_size is not None

    @property
    def element_size(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def page_buffer_size(self) -> int:
        """Token slots per layer: ``num_blocks * block_size`` or the fused NBBS axis."""
        return self.spec.page_buffer_size

    @property
    def tokens_per_layer(self) -> int:
        return self.spec.page_buffer_size

    @property
    def elements_per_layer(self) -> int:
        """Elements one layer holds, K and V together: ``kv_size * slots * NH * HS``; for a
        multi-plane layout the sum over its planes of ``slots * NH_p * HS_p`` (each in its
        plane's dtype)."""
        if self.format.syntax.multi_plane:
            return sum(self.page_buffer_size * p.hidden_dim for p in self.planes)
        return self.kv_size * self.page_buffer_size * self.hidden_dim

    @property
    def is_mla(self) -> bool:
        return self.format.is_mla

    def staging_shape(self, num_tokens: int, layers: Sequence[int] | int | None = None) -> tuple[int, ...]:
        """Staging buffer shape: ``[kv_size, NL, T, NH*HS]``; for one layer (an int)
        ``[kv_size, T, NH*HS]``. MLA: kv_size 1, NH*HS = HS.

        Raises:
            GeometryError: the layout stages one buffer per plane (not
                :attr:`classic_staging`): use :meth:`staging_shapes`.
        """
        if not self.classic_staging:
            raise GeometryError(
                f"format {self.format.name} stages one buffer per plane ({', '.join(b.key for b in self.staging_buffers)}), "
                "not one [kv_size, NL, T, NH*HS] tensor: use layout.staging_shapes(num_tokens) or layout.allocate_staging(num_tokens)"
            )
        b = self.spec.stride_table().buffers[0]
        row = b.row_elems
        if isinstance(layers, int):
            return (b.kv_size, num_tokens, row)
        nl = self.num_layers if layers is None else len(layers)
        return (b.kv_size, nl, num_tokens, row)

    def staging_shapes(self, num_tokens: int, layers: Sequence[int] | int | None = None) -> dict[str, tuple[int, ...]]:
        """Every staging buffer's shape, by key: ``{"kv": [kv_size, NL, T, NH*HS]}`` for
        classic staging, else ``{role: [NL, T, NH_p * HS_p]}`` per plane (``NH_p`` 1 for a
        plane without heads, ``HS_p`` 1 for a plane without elements). For one layer (an
        int) the NL axis is left out. Dtypes: :attr:`staging_buffers`."""
        nl = None if isinstance(layers, int) else (self.num_layers if layers is None else len(layers))
        out = {}
        for b in self.spec.stride_table().buffers:
            shp = b.shape(1 if nl is None else nl, num_tokens)
            if nl is None:
                shp = shp[:-3] + shp[-2:]
            out[b.key] = tuple(shp)
        return out

    def allocate_staging(
        self,
        num_tokens: int,
        layers: Sequence[int] | int | None = None,
        *,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Zeroed staging for ``num_tokens`` tokens: one tensor (:attr:`classic_staging`,
        shape :meth:`staging_shape`) or a dict ``{role: tensor}`` (shapes
        :meth:`staging_shapes`), each in its buffer's dtype, on ``device`` (default: the
        cache's), pinned when ``pin_memory`` (host memory for a CUDA cache)."""
        dev = torch.device(device) if device is not None else self.device
        out = {}
        for b in self.spec.stride_table().buffers:
            shp = self.staging_shapes(num_tokens, layers)[b.key]
            out[b.key] = torch.zeros(shp, dtype=b.dtype, device=dev, pin_memory=pin_memory)
        return out["kv"] if self.classic_staging else out

    # -- kernels ---------------------------------------------------------------------
    def stride_table(self, layers: Sequence[int] | None = None) -> StrideTable:
        """The byte stride table kernels use, for ``layers`` in the order given (default: all).

        Raises:
            GeometryError: a layer index out of range or repeated.
        """
        t = self.spec.stride_table()
        if layers is None and self.layer_map == tuple(range(self.spec.num_layers)):
            return t
        return t.subset([self.layer_map[i] for i in self._layer_selection(layers)])

    def _layer_selection(self, layer_indices: Sequence[int] | None) -> list[int]:
        n = self.num_layers
        if layer_indices is None:
            return list(range(n))
        layer_indices = plain_integers(layer_indices, "layer_indices", GeometryError)
        try:
            sel = [layer_indices] if isinstance(layer_indices, int) else list(layer_indices)
        except TypeError:
            raise GeometryError(f"layer_indices must be a list of layer indices, got {layer_indices!r}") from None
        out = []
        for i in sel:
            i = plain_integers(i, "a layer index", GeometryError)
            try:
                j = operator.index(i)
            except (TypeError, RuntimeError):
                j = None
            if j is None or isinstance(i, bool) or not (0 <= j < n):
                raise GeometryError(f"layer index {i!r} is out of range: this layout has {n} layers (0..{n - 1})")
            out.append(j)
        sel = out
        if len(set(sel)) != len(sel):
            raise GeometryError(f"layer indices {sel} repeat a layer")
        return sel

    def data_ptrs(self, layer_indices: Sequence[int] | None = None) -> list[int]:
        """Base addresses (``tensor.data_ptr()``) in kernel order, for ``layer_indices`` in
        the order given (default: all layers): one per layer for layer lists; all K then
        all V for K/V lists (``TWO_X_NL_X_...``); K0, V0, K1, V1, ... for per-layer tuples;
        a single base for one cross-layer tensor. Order as LMCache's
        ``KVFormatSpec.data_ptrs`` (``lmcache_kv_format.md`` §2.2). Multi-plane layouts:
        each plane's pointers in the name's plane order (a layer-list plane: one per
        selected layer; a cross-layer plane: its one tensor).

        Raises:
            GeometryError: a layer index out of range or repeated.
        """
        sel = self._layer_selection(layer_indices)
        if self.format.syntax.multi_plane:
            return self._plane_data_ptrs(sel)
        by_layer: dict[int, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        out = []
        for path, t in self.spec.leaves:
            li = self.spec.leaf_layer(path)
            if li < 0:
                out.append(int(t.data_ptr()))
            else:
                by_layer.setdefault(li, []).append((path, t))
        if out:
            return out
        lv = self.format.syntax.list_levels
        kv_outer = lv.index("NL") > 0  # K list then V list
        leaves = [(path, t) for li in sel for (path, t) in by_layer.get(self.layer_map[li], [])]
        if kv_outer:
            leaves.sort(key=lambda pt: pt[0][0])  # stable: K of the selected layers, then V
        return [int(t.data_ptr()) for _, t in leaves]

    def _plane_data_ptrs(self, sel: list[int]) -> list[int]:
        out = []
        for pi, p in enumerate(self.format.syntax.planes):
            leaves = [(path[1:], t) for path, t in self.spec.leaves if path[0] == pi]
            if "NL" in p.syntax.list_levels:
                out += [int(leaves[li][1].data_ptr()) for li in sel]
            else:
                out += [int(t.data_ptr()) for _, t in leaves]
        return out

    def shape_desc(self, layer_indices: Sequence[int] | None = None) -> PageBufferShapeDesc:
        """A :class:`PageBufferShapeDesc` for ``layer_indices`` (default: all).

        ``block_stride_elems`` is the block axis's stride in elements of ``dtype`` when
        the block axis (NB, or the fused NBBS slot axis) is dim 0 of the tensors and its
        stride is larger than the tight one (dim-0 padding, LMCache's
        ``block_stride_elems``, ``csrc/kv_transfer_plan_types.h``), else 0.

        Raises:
            GeometryError: a bad layer index, or strides a PageBufferShapeDesc cannot say
                (padding or permutation anywhere but the block axis at dim 0); the
                :meth:`stride_table` describes those, and kvcore's kernels use it.
        """
        nl = len(self._layer_selection(layer_indices))
        syn0 = self.format.syntax
        if syn0.multi_plane or syn0.chunked_heads or syn0.token_groups or not self.classic_staging:
            why = (
                "a multi-plane record (each plane its own tensors)"
                if syn0.multi_plane
                else ("chunked heads (HSC/HSE)" if syn0.chunked_heads else "token groups (BSC/BSE)")
            )
            raise GeometryError(
                f"format {self.format.name} has {why}; a PageBufferShapeDesc describes one [kv_size, NB, BS, NH, HS] page "
                "buffer per layer and cannot say it. Use stride_table() and layout.planes, which describe any layout"
            )
        fused = self.format.fused_nbbs
        nb = self.page_buffer_size if fused else self.num_blocks
        bs = 1 if fused else self.block_size
        esz = self.element_size
        syn = self.format.syntax
        block_axis = syn.axis("NBBS" if fused else "NB")
        ref = self.spec.leaves[0][1] if self.spec.leaves else None
        block_stride_elems = 0
        if ref is not None and block_axis is not None and ref.dim() == len(syn.axes):
            isz = ref.element_size()
            tight = 1
            for i in range(ref.dim() - 1, -1, -1):
                n, s = int(ref.shape[i]), int(ref.stride(i))
                if n == 1:
                    continue
                if s != tight:
                    if i == 0 and i == block_axis and s > tight:
                        if (s * isz) % esz:
                            raise GeometryError(
                                f"format {self.format.name}: the block stride ({s * isz} bytes) is not a whole number of "
                                f"{self.dtype} elements; a PageBufferShapeDesc cannot describe it (use stride_table())"
                            )
                        block_stride_elems = s * isz // esz
                        break
                    raise GeometryError(
                        f"format {self.format.name}: axis {i} ({syn.axes[i]}) has stride {s} where a tight layout has {tight} "
                        f"(shape {tuple(ref.shape)}, stride {tuple(ref.stride())}); a PageBufferShapeDesc only describes padding of "
                        "a dim-0 block axis. Use stride_table(), which describes any strides"
                    )
                tight *= n
        return PageBufferShapeDesc(
            kv_size=self.kv_size,
            nl=nl,
            nb=nb,
            bs=bs,
            nh=self.num_heads,
            hs=self.head_size,
            element_size=esz,
            block_stride_elems=block_stride_elems,
        )

    def sizes(self) -> dict[str, int]:
        """The format's axis sizes as the tensors hold them (``NB``, ``BS``, ``CS``...);
        ``NL`` counts every layer, aliased ones included."""
        out = dict(self.spec.axis_sizes)
        if "NL" in out:
            out["NL"] = self.num_layers
        return out

    def describe(self) -> str:
        """Concrete shape, e.g. ``32 x [2, 2048, 16, 8, 128]``."""
        return self.format.concrete(self.sizes())

    def summary(self) -> dict[str, Any]:
        """A JSON-able summary (``kvcore detect`` prints it): the geometry, every plane
        (``planes``: role, template, dtype, heads, head size and bytes, staging buffer) and
        the staging buffers' shapes (``staging``: ``{key: [..., "T", row]}``). A value a
        multi-plane layout does not have as one number (the head size of K and V of
        different widths) is None."""

        def value(get: Any) -> Any:
            try:
                return get()
            except GeometryError:
                return None

        dt, sdt = value(lambda: self.dtype), value(lambda: self.storage_dtype)
        d: dict[str, Any] = {
            "format": self.format.name,
            "symbolic": self.format.symbolic,
            "concrete": self.describe(),
            "num_layers": self.num_layers,
            "kv_size": self.kv_size,
            "num_heads": self.num_heads,
            "head_size": value(lambda: self.head_size),
            "hidden_dim": value(lambda: self.hidden_dim),
            "dtype": str(dt).replace("torch.", "") if dt is not None else None,
            "storage_dtype": str(sdt).replace("torch.", "") if sdt is not None else None,
            "device": str(self.device),
            "page_buffer_size": self.page_buffer_size,
            "is_hnd": self.format.is_hnd,
            "planes": [
                {
                    "role": p.role,
                    "template": p.template,
                    "dtype": str(p.dtype).replace("torch.", ""),
                    "num_heads": p.num_heads,
                    "head_size": p.head_size,
                    "head_bytes": p.head_bytes,
                    "staging": p.staging,
                }
                for p in self.planes
            ],
            "staging": {b.key: list(b.shape(self.num_layers, 0)[:-2]) + ["T", b.row_elems] for b in self.staging_buffers},
            "layer_ids": list(self.layer_ids),
            "aliases": {str(k): v for k, v in self.aliases.items()},
            "note": self.note,
        }
        try:
            d["num_blocks"], d["block_size"] = self.num_blocks, self.block_size
        except GeometryError:
            d["num_blocks"], d["block_size"] = None, None
        return d

    def __repr__(self) -> str:
        dt = self.spec.dtype if self.spec.dtype is not None else {p.role: p.dtype for p in self.planes}
        return f"KVLayout({self.format.name}, {self.describe()}, dtype={dt}, device={self.device})"


def build_layout(
    format: KVFormat | str,
    kv_caches: Any,
    *,
    dtype: torch.dtype | dict[str, torch.dtype] | None = None,
    params: dict[str, Any] | None = None,
    layer_ids: Sequence[int] | None = None,
    layer_names: Sequence[str] | None = None,
    note: str = "",
    engine: str | None = None,
    aliases: dict[int, int] | None = None,
) -> KVLayout:
    """Describe ``kv_caches`` as ``format`` without asking any detector.

    The spec comes from the ``kvcore_spec`` hook (a plugin's, for exotic formats) or
    the core's generic :class:`~kvcore.spec.Spec`. For a multi-plane format
    (``K=...+V=...``) ``kv_caches`` is a dict ``{role: container}`` and ``dtype`` may be a
    dict ``{role: dtype}``.

    ``aliases`` (``{layer: earlier layer}``, over all layers) declares layers that are
    the same memory as an earlier one; ``kv_caches`` then holds the distinct layers in
    order (what :func:`kvcore.detection.split_aliases` returns) and the layout has one
    layer per entry (see :class:`KVLayout`).

    Raises:
        FormatError: a malformed format name (naming the bad token).
        GeometryError: the tensors do not fit the format (wrong nesting, rank, literal
            axis size, zero-size axis, aliasing strides, two (layer, plane) regions sharing
            a byte, geometry past the storage; planes missing, extra or disagreeing on
            layers, blocks or heads), are quantized tensors (``torch.quint8``...), are
            not dense strided memory kvcore can address in place (nested or sparse tensors,
            views carrying torch's lazy negation/conjugation bit: :mod:`kvcore.inputs`),
            are nested deeper than a format's container, or a plugin's spec failed on them.
        PluginError: a ``kvcore_spec`` hook raised or returned something that is not a
            Spec subclass (the message names the plugin).

    Every tensor of ``kv_caches`` that holds bytes the layout addresses is recorded
    (:func:`kvcore.spec.record_callers`): a transfer refuses, before any byte moves, once
    one of them was re-pointed (``set_``, ``.data =``) or reshaped in place, even when it
    is a view of a buffer kvcore's own views keep alive.
    """
    layout = _build_layout(
        format,
        kv_caches,
        dtype=dtype,
        params=params,
        layer_ids=layer_ids,
        layer_names=layer_names,
        note=note,
        engine=engine,
        aliases=aliases,
    )
    record_callers(layout.spec.stride_table(), tensor_paths(kv_caches))
    return layout


def _build_layout(
    format: KVFormat | str,
    kv_caches: Any,
    *,
    dtype: torch.dtype | dict[str, torch.dtype] | None = None,
    params: dict[str, Any] | None = None,
    layer_ids: Sequence[int] | None = None,
    layer_names: Sequence[str] | None = None,
    note: str = "",
    engine: str | None = None,
    aliases: dict[int, int] | None = None,
) -> KVLayout:
    """:func:`build_layout` without recording ``kv_caches`` as the caller's tensors (the
    detectors' candidates are a plugin's views; :func:`kvcore.detect` records the caller's
    own tensors once a reading is chosen)."""
    if isinstance(format, str):
        try:
            fmt = registry.get_format(format)
        except FormatError:
            parse(format)  # a malformed name raises here, naming the token
            fmt = KVFormat(name=format, description="(not registered by any plugin)")
    else:
        fmt = format
    check_container(kv_caches, error=GeometryError, tensor_error=GeometryError)  # nesting, sparse/nested, neg/conj views
    registry.refuse_quantized(kv_caches, "kv_caches", GeometryError)
    spec_cls = registry.spec_for(fmt) or Spec  # a plugin's bad answer is a PluginError naming it
    try:
        spec = spec_cls(fmt, kv_caches, dtype=dtype, params=params)
    except KVCoreError:
        raise
    except Exception as e:  # noqa: BLE001 - tensors a spec cannot read are a geometry error, not a crash
        raise GeometryError(f"format {fmt.name}: {spec_cls.__name__} could not read these tensors: {type(e).__name__}: {e}") from e
    layer_map = _layer_map(fmt.name, spec.num_layers, aliases) if aliases else None
    n = len(layer_map) if layer_map is not None else spec.num_layers
    if layer_ids is not None and len(tuple(layer_ids)) != n:
        raise GeometryError(f"format {fmt.name}: layer_ids {tuple(layer_ids)} name {len(tuple(layer_ids))} layers, the layout has {n}")
    return KVLayout(fmt, spec, layer_ids=layer_ids, layer_names=layer_names, note=note, engine=engine, layer_map=layer_map)


def _layer_map(name: str, distinct: int, aliases: dict[int, int]) -> tuple[int, ...]:
    """``aliases`` over ``distinct + len(aliases)`` layers -> each layer's index among the
    distinct ones (the spec's layers).

    Raises:
        GeometryError: an alias that is not an earlier layer, or counts that disagree.
    """
    n = distinct + len(aliases)
    out: list[int] = []
    k = 0
    for i in range(n):
        if i in aliases:
            j = aliases[i]
            if isinstance(j, bool) or not isinstance(j, int) or not (0 <= j < i):
                raise GeometryError(f"format {name}: aliases[{i}] = {j!r} must be an earlier layer (0..{i - 1})")
            out.append(out[j])
        else:
            out.append(k)
            k += 1
    if k != distinct or any(not isinstance(i, int) or not (0 <= i < n) for i in aliases):
        raise GeometryError(f"format {name}: aliases {aliases} do not fit {distinct} distinct layers ({n} in all)")
    return tuple(out)
