"""``KVLayout``: a detected KV cache, its geometry, and what kernels need to move it."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from kvcore.errors import FormatError, GeometryError, KVCoreError
from kvcore.formats import KVFormat
from kvcore.grammar import parse
from kvcore.spec import Spec, StrideTable

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


@dataclass
class Detection:
    """What a ``kvcore_detect`` hook returns.

    Attributes:
        format: the format name.
        kv_caches: the container normalised to the format's nesting (views of the
            caller's tensors, never copies).
        dtype: the element dtype when the tensors are a byte view of it, else None.
        params: facts the name cannot carry (``head_size`` of a packed CS axis, ...).
        note: one line on how it was decided (shown by ``kvcore detect``).
        excluded: set (with the reason) for tensors that are not KV (Mamba state);
            then ``format`` is None.
        layer_ids: the model's layer indices of the layout's layers, when the plugin
            knows them and they are not 0..NL-1 (one attention-type group of a hybrid
            model's cache); None: 0..NL-1.
    """

    format: str | None
    kv_caches: Any = None
    dtype: torch.dtype | None = None
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    excluded: str | None = None
    layer_ids: tuple[int, ...] | None = None


class KVLayout:
    """A KV cache whose layout is known. Built by :func:`kvcore.detect`.

    Geometry is uniform across the layout's layers (hybrid models get one layout per
    group from :func:`kvcore.detect_per_layer`).

    Attributes:
        format: the :class:`KVFormat`.
        kv_caches: the normalised container (views of the engine's tensors).
        layer_ids: the model's layer indices this layout covers, in order.
        layer_names: the engine's layer names when the input was a dict, else None.
        note: how detection decided.
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
    ):
        self.format = format
        self.spec = spec
        self.kv_caches = spec.kv_caches
        self.layer_ids = tuple(layer_ids) if layer_ids is not None else tuple(range(spec.num_layers))
        self.layer_names = tuple(layer_names) if layer_names is not None else None
        self.note = note
        self.engine = engine

    # -- geometry --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

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
        """Elements per head, per K or V (576 for DeepSeek MLA latents)."""
        return self.spec.head_size

    @property
    def hidden_dim(self) -> int:
        """``num_heads * head_size``: one token's K (or V) row in elements."""
        return self.spec.num_heads * self.spec.head_size

    @property
    def kv_size(self) -> int:
        return self.spec.kv_size

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype (may differ from the tensors' storage dtype, e.g. int8 views)."""
        return self.spec.dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.spec.storage_dtype

    @property
    def element_size(self) -> int:
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
        """Elements one layer holds, K and V together: ``kv_size * slots * NH * HS``."""
        return self.kv_size * self.page_buffer_size * self.hidden_dim

    @property
    def is_mla(self) -> bool:
        return self.format.is_mla

    def staging_shape(self, num_tokens: int, layers: Sequence[int] | int | None = None) -> tuple[int, ...]:
        """Staging buffer shape: ``[kv_size, NL, T, NH*HS]``; for one layer (an int)
        ``[kv_size, T, NH*HS]``. MLA: kv_size 1, NH*HS = HS."""
        if isinstance(layers, int):
            return (self.kv_size, num_tokens, self.hidden_dim)
        nl = self.num_layers if layers is None else len(layers)
        return (self.kv_size, nl, num_tokens, self.hidden_dim)

    # -- kernels ---------------------------------------------------------------------
    def stride_table(self, layers: Sequence[int] | None = None) -> StrideTable:
        """The byte stride table kernels use, for ``layers`` in the order given (default: all).

        Raises:
            GeometryError: a layer index out of range or repeated.
        """
        t = self.spec.stride_table()
        return t if layers is None else t.subset(self._layer_selection(layers))

    def _layer_selection(self, layer_indices: Sequence[int] | None) -> list[int]:
        n = self.num_layers
        if layer_indices is None:
            return list(range(n))
        sel = list(layer_indices)
        out = []
        for i in sel:
            try:
                j = operator.index(i)
            except TypeError:
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
        ``KVFormatSpec.data_ptrs`` (``lmcache_kv_format.md`` §2.2).

        Raises:
            GeometryError: a layer index out of range or repeated.
        """
        sel = self._layer_selection(layer_indices)
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
        leaves = [(path, t) for li in sel for (path, t) in by_layer.get(li, [])]
        if kv_outer:
            leaves.sort(key=lambda pt: pt[0][0])  # stable: K of the selected layers, then V
        return [int(t.data_ptr()) for _, t in leaves]

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
        """The format's axis sizes as the tensors hold them (``NB``, ``BS``, ``CS``...)."""
        return dict(self.spec.axis_sizes)

    def describe(self) -> str:
        """Concrete shape, e.g. ``32 x [2, 2048, 16, 8, 128]``."""
        return self.format.concrete(self.spec.axis_sizes)

    def summary(self) -> dict[str, Any]:
        """A JSON-able summary (``kvcore detect`` prints it)."""
        d: dict[str, Any] = {
            "format": self.format.name,
            "symbolic": self.format.symbolic,
            "concrete": self.describe(),
            "num_layers": self.num_layers,
            "kv_size": self.kv_size,
            "num_heads": self.num_heads,
            "head_size": self.head_size,
            "hidden_dim": self.hidden_dim,
            "dtype": str(self.dtype).replace("torch.", ""),
            "storage_dtype": str(self.storage_dtype).replace("torch.", ""),
            "device": str(self.device),
            "page_buffer_size": self.page_buffer_size,
            "is_hnd": self.format.is_hnd,
            "layer_ids": list(self.layer_ids),
            "note": self.note,
        }
        try:
            d["num_blocks"], d["block_size"] = self.num_blocks, self.block_size
        except GeometryError:
            d["num_blocks"], d["block_size"] = None, None
        return d

    def __repr__(self) -> str:
        return f"KVLayout({self.format.name}, {self.describe()}, dtype={self.dtype}, device={self.device})"


def build_layout(
    format: KVFormat | str,
    kv_caches: Any,
    *,
    dtype: torch.dtype | None = None,
    params: dict[str, Any] | None = None,
    layer_ids: Sequence[int] | None = None,
    layer_names: Sequence[str] | None = None,
    note: str = "",
    engine: str | None = None,
) -> KVLayout:
    """Describe ``kv_caches`` as ``format`` without asking any detector.

    The spec comes from the ``kvcore_spec`` hook (a plugin's, for exotic formats) or
    the core's generic :class:`~kvcore.spec.Spec`.

    Raises:
        FormatError: a malformed format name (naming the bad token).
        GeometryError: the tensors do not fit the format (wrong nesting, rank, literal
            axis size, zero-size axis, aliasing strides, geometry past the storage), are
            quantized tensors (``torch.quint8``...), or a plugin's spec failed on them.
        PluginError: a ``kvcore_spec`` hook raised or returned something that is not a
            Spec subclass (the message names the plugin).
    """
    from kvcore import registry

    if isinstance(format, str):
        try:
            fmt = registry.get_format(format)
        except FormatError:
            parse(format)  # a malformed name raises here, naming the token
            fmt = KVFormat(name=format, description="(not registered by any plugin)")
    else:
        fmt = format
    registry.refuse_quantized(kv_caches, "kv_caches", GeometryError)
    spec_cls = registry.spec_for(fmt) or Spec  # a plugin's bad answer is a PluginError naming it
    try:
        spec = spec_cls(fmt, kv_caches, dtype=dtype, params=params)
    except KVCoreError:
        raise
    except Exception as e:  # noqa: BLE001 - tensors a spec cannot read are a geometry error, not a crash
        raise GeometryError(f"format {fmt.name}: {spec_cls.__name__} could not read these tensors: {type(e).__name__}: {e}") from e
    return KVLayout(fmt, spec, layer_ids=layer_ids, layer_names=layer_names, note=note, engine=engine)
