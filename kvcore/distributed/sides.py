"""One side of a transfer: its cache's stride table, wire form and kernels (cached per layout,
layers and heads), and the checks of its arguments."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from kvcore.distributed.channels import _Agreement, _Channel, _Group
from kvcore.distributed.wire import _sig, _wire
from kvcore.errors import TransferError
from kvcore.kernels import _build, native, select_kernel
from kvcore.layout import KVLayout
from kvcore.layout_copy import _select, head_range
from kvcore.layout_plan import _dense
from kvcore.spec import StrideTable
from kvcore.transfer import _index_tensor, _layers


class _Side:
    """One cache's table, wire form and kernels for sending or receiving."""

    def __init__(self, layout: KVLayout, table: StrideTable):
        self.layout = layout
        self.table = table
        self.wire = _wire(table)
        self.sig = _sig(table)
        self.num_slots = layout.page_buffer_size
        self.prep = None
        self.bitmap = None
        self._views: dict = {}
        self._kernels: dict = {}

    def kernel(self, wire_device_type: str):
        k = self._kernels.get(wire_device_type)
        if k is None:
            k = self._kernels[wire_device_type] = select_kernel(
                self.layout.device.type, self.layout.format.name, wire_device_type, table=self.wire.table
            )
        return k

    def native(self, emulate: bool = False):
        """The prepared native plan of the wire table (the GPU engine; ``emulate``: its CPU
        emulation), or None when the native op library does not serve this table."""
        if self.prep is None:
            want = native.CPU_KERNEL if emulate else native.CUDA_KERNEL
            dev_type = "cpu" if emulate else "cuda"
            if self.kernel(dev_type) is want and _build.MODULE is not None and hasattr(_build.MODULE, "p2p_gate"):
                self.prep = native.prepare(self.wire.table)
            else:
                self.prep = False
        return self.prep or None

    def views(self, buf: torch.Tensor, offset: int, n: int):
        key = (buf.data_ptr(), offset, n)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 8:
                self._views.clear()
            v = self._views[key] = self.wire.views(buf[offset:], n)
        return v


def _side(layout: KVLayout, layers, heads, what: str, roles: tuple | None = None) -> _Side:
    """The side of ``layout`` for these layers and heads (receiver: planes in ``roles`` order),
    cached on the layout.

    Raises:
        TransferError: a bad layer selection or head range.
    """
    lk = layers if (layers is None or layers.__class__ is int) else (("L", *layers) if isinstance(layers, (list, tuple, range)) else None)
    try:
        key = (lk, heads, roles) if lk is not None or layers is None else None
        hash(key)
    except TypeError:
        key = None
    cache = getattr(layout, "_kvcore_p2p_sides", None)
    if cache is None:
        cache = layout._kvcore_p2p_sides = {}
    if key is not None:
        s = cache.get(key)
        if s is not None:
            return s
    sel = _layers(layout, layers)
    table = layout.stride_table(None if sel == list(range(layout.num_layers)) else sel)
    table = _select(table, head_range(heads, what, layout), what)
    if roles is not None:
        by_role = {p.role: p for p in table.planes}
        ordered = tuple(by_role[r] for r in roles)
        if ordered != table.planes:
            table = replace(table, planes=ordered)
    s = _Side(layout, table)
    if key is not None:
        if len(cache) > 32:
            cache.clear()
        cache[key] = s
    return s


def _recv_side(ch: _Channel, layout, layers, heads, ag: _Agreement | None) -> _Side:
    """The receiving side of ``layout``, its planes in the sender's order when the agreement
    has the same roles (remembered per channel for the same arguments and agreement)."""
    m = ch.side_memo
    if m is not None and m[0] is layout and m[1] is ag and m[2] is layers and m[3] == heads:
        return m[4]
    roles = tuple(p[0] for p in ag.sig) if ag is not None else None
    base = _side(layout, layers, heads, "heads")
    side = base
    if roles is not None and sorted(roles) == sorted(p.role for p in base.table.planes):
        side = _side(layout, layers, heads, "heads", roles)
    ch.side_memo = (layout, ag, layers, heads, side)
    return side


def _device_of(layout):
    if isinstance(layout, KVLayout) and layout.device.type == "cuda":
        return torch.cuda.device(layout.device)
    return contextlib.nullcontext()


def _check_layout(layout, what: str) -> None:
    if not isinstance(layout, KVLayout):
        raise TransferError(f"the {what} cache must be a KVLayout (from kvcore.detect), got {type(layout).__name__}")
    if layout.device.type == "meta":
        raise TransferError(f"the {what} layout describes tensors on the meta device (shapes without memory): it cannot be moved")


def _wire_device(layout, g: _Group) -> torch.device:
    backend = g.backend
    if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in backend:
        return layout.device
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        if not isinstance(layout, KVLayout) or layout.device.type != "cuda":
            raise TransferError(f"the process group's backend is {backend}, which moves CUDA tensors only, but this cache is on the CPU")
    return torch.device("cpu")


def _slots_arg(slots, layout: KVLayout, what: str) -> torch.Tensor:
    """The slots as a 1-D int64 tensor on the cache's device (no value checks)."""
    s = slots
    if s.__class__ is torch.Tensor and s.dtype is torch.int64 and s.device == layout.device and _dense(s) and s.dim() == 1:
        return s
    s = _index_tensor(slots, what)
    if s.dim() != 1:
        raise TransferError(f"{what} must be 1-D [T], got shape {tuple(s.shape)}")
    return s.to(device=layout.device, dtype=torch.int64).contiguous()
