"""LMCache's kernel descriptors (``PageBufferShapeDesc``, the block stride of a kernel
group) and the tensor check its transfer path makes."""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvcore.compat.lmcache.formats import EngineKVFormat, _fmt
from kvcore.compat.lmcache.specs import _layer_layout
from kvcore.errors import GeometryError
from kvcore.layout import PageBufferShapeDesc as _KVCorePageBufferShapeDesc

# one logger for the whole facade (its name is the one LMCache users filter on)
logger = logging.getLogger("kvcore.compat.lmcache")


# -- kernel descriptors ----------------------------------------------------------------------

_DESC_FIELDS = ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems")


class PageBufferShapeDesc:
    """LMCache's ``PageBufferShapeDesc`` (``csrc/kv_transfer_plan_types.h``; the Python
    ``device_ops.PageBufferShapeDesc``): default-constructible and mutable, as LMCache's
    callers build one empty and set its fields.

    Fields (ints, default 0): ``kv_size`` (1 or 2 planes), ``nl`` (layers of the kernel
    group), ``nb`` (blocks), ``bs`` (block size), ``nh`` (heads; 1 for MLA), ``hs`` (head
    size in elements), ``element_size`` (bytes), ``block_stride_elems`` (the block axis's
    stride in elements; 0: tight). ``dtype`` (a ``torch.dtype`` or None) tells fp16 from
    bf16, as LMCache's Python side attribute does. :meth:`to_kvcore` gives kvcore's frozen
    :class:`kvcore.PageBufferShapeDesc`.

    Raises:
        GeometryError: a field set to something other than a non-negative int, ``dtype``
            to something other than a ``torch.dtype`` or None.
        AttributeError: a name that is not a field.
    """

    __slots__ = (*_DESC_FIELDS, "dtype")

    def __init__(
        self,
        kv_size: int = 0,
        nl: int = 0,
        nb: int = 0,
        bs: int = 0,
        nh: int = 0,
        hs: int = 0,
        element_size: int = 0,
        block_stride_elems: int = 0,
        dtype: torch.dtype | None = None,
    ):
        for k, v in zip(_DESC_FIELDS, (kv_size, nl, nb, bs, nh, hs, element_size, block_stride_elems)):
            setattr(self, k, v)
        self.dtype = dtype

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _DESC_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise GeometryError(f"PageBufferShapeDesc.{name} must be a non-negative int, got {value!r}")
            value = int(value)
        elif name == "dtype" and value is not None and not isinstance(value, torch.dtype):
            raise GeometryError(f"PageBufferShapeDesc.dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {value!r}")
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PageBufferShapeDesc):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__)
        return f"PageBufferShapeDesc({fields})"

    def to_kvcore(self) -> _KVCorePageBufferShapeDesc:
        """kvcore's frozen :class:`kvcore.PageBufferShapeDesc` with these fields."""
        return _KVCorePageBufferShapeDesc(**{k: getattr(self, k) for k in _DESC_FIELDS})

    @classmethod
    def from_kvcore(cls, desc: _KVCorePageBufferShapeDesc, dtype: torch.dtype | None = None) -> PageBufferShapeDesc:
        """The mutable descriptor of kvcore's :class:`kvcore.PageBufferShapeDesc` (from
        :meth:`kvcore.KVLayout.shape_desc`)."""
        return cls(**{k: getattr(desc, k) for k in _DESC_FIELDS}, dtype=dtype)


def make_page_buffer_shape_desc(
    kv_caches: Any,
    engine_kv_format: Any,
    layer_idx: int,
    num_layers_in_group: int,
    num_blocks: int,
    block_size: int,
    block_stride_elems: int | None = None,
) -> PageBufferShapeDesc:
    """A :class:`PageBufferShapeDesc` for one kernel group, from its representative layer.

    ``kv_size``, ``nh`` (1 for MLA), ``hs``, ``element_size`` and ``dtype`` come from layer
    ``layer_idx``; ``nl``, ``nb``, ``bs`` from the arguments; ``block_stride_elems`` is
    passed through (0 when None: the tight stride), as LMCache ``utils.make_page_buffer_shape_desc``.

    Raises:
        GeometryError: a bad ``layer_idx``, or a count that is not a positive int.
    """
    for name, v in (("num_layers_in_group", num_layers_in_group), ("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GeometryError(f"{name} must be a positive int, got {v!r}")
    if block_stride_elems is not None and (
        isinstance(block_stride_elems, bool) or not isinstance(block_stride_elems, int) or block_stride_elems < 0
    ):
        raise GeometryError(f"block_stride_elems must be a non-negative int or None, got {block_stride_elems!r}")
    lay = _layer_layout(kv_caches, engine_kv_format, layer_idx)
    return PageBufferShapeDesc(
        kv_size=lay.kv_size,
        nl=num_layers_in_group,
        nb=num_blocks,
        bs=block_size,
        nh=1 if lay.is_mla else lay.num_heads,
        hs=lay.head_size,
        element_size=lay.element_size,
        block_stride_elems=int(block_stride_elems) if block_stride_elems else 0,
        dtype=lay.dtype,
    )


def _probe_tensor(kv_caches: Any, fmt: EngineKVFormat, layer_idx: int) -> torch.Tensor:
    c = fmt.syntax.container
    if c == "cross_layer":
        if not isinstance(kv_caches, torch.Tensor):
            raise GeometryError(f"cross-layer format {fmt} expects one backing torch.Tensor, got {type(kv_caches).__name__}")
        return kv_caches
    if c == "kv_list":
        return kv_caches[0][layer_idx]
    if c == "per_layer_tuple":
        return kv_caches[layer_idx][0]
    return kv_caches[layer_idx]


def resolve_block_stride_and_log_layout(kv_caches: Any, engine_kv_format: Any, layer_idx: int, group_idx: int) -> int | None:
    """The ``block_stride_elems`` of a kernel group, and a one-line layout audit log.

    For every format whose tensors have the block axis (NB, or a fused NBBS axis) at dim 0,
    returns ``stride(0)`` of layer ``layer_idx``'s tensor in elements of the format's dtype
    (dim-0 padding shows as a value above the tight stride); otherwise ``None``, the tight
    stride. LMCache ``utils.resolve_block_stride_and_log_layout`` answers this only for an
    allow-list of formats; here the grammar answers it for all.

    Raises:
        GeometryError: a bad ``layer_idx``; padding or permutation a PageBufferShapeDesc
            cannot express (anywhere but a dim-0 block axis). kvcore's own transfers handle
            those through the stride table; only descriptor-based kernels cannot.
    """
    f = _fmt(engine_kv_format)
    lay = _layer_layout(kv_caches, f, layer_idx)
    rep = _probe_tensor(kv_caches, f, layer_idx)
    syn = f.syntax
    block_axis = syn.axis("NBBS" if syn.fused_nbbs else "NB")
    result: int | None
    if block_axis == 0 and rep.dim() > 0:
        result = int(rep.stride(0)) * rep.element_size() // lay.element_size
        lay.shape_desc()  # refuses padding/permutation elsewhere
    else:
        desc = lay.shape_desc()  # raises GeometryError for padding it cannot express
        result = desc.block_stride_elems or None
    inner = 1
    for n in rep.shape[1:]:
        inner *= int(n)
    logger.info(
        "Group %d first-layer tensor: layer_idx=%d format=%s shape=%s stride=%s is_contiguous=%s dtype=%s device=%s "
        "storage_offset=%d numel=%d storage_nbytes=%d padding_per_block=%d",
        group_idx,
        layer_idx,
        f,
        tuple(rep.shape),
        tuple(rep.stride()),
        rep.is_contiguous(),
        rep.dtype,
        rep.device,
        rep.storage_offset(),
        rep.numel(),
        rep.untyped_storage().nbytes(),
        (int(rep.stride(0)) - inner) if rep.dim() else 0,
    )
    return result


def assert_contiguous(tensor: torch.Tensor) -> None:
    """Refuse a tensor that is not contiguous from storage offset 0 (LMCache
    ``utils.assert_contiguous``, without ``assert``).

    Raises:
        GeometryError: a non-zero storage offset, or a non-contiguous tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise GeometryError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.storage_offset() != 0:
        raise GeometryError(f"expected storage_offset 0, got {tensor.storage_offset()} (shape {tuple(tensor.shape)})")
    if not tensor.is_contiguous():
        raise GeometryError(f"tensor is not contiguous: shape {tuple(tensor.shape)} stride {tuple(tensor.stride())}")
