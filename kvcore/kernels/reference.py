"""The reference transfer kernel, in torch, for any device and every format.

For each plane of the record and each layer it builds two ``as_strided`` views of raw
storage — the cache side ``[blocks, (token groups,) tokens, heads, chunks, units]`` and the
staging side ``[T, heads, units]`` — and moves whole token rows with one
advanced-indexing copy. Data moves as integers of the widest width (8, 4, 2 or 1 bytes)
that every offset and stride allows, so every dtype, NaN payloads and negative zero
included, is bit-exact. One copy per (layer, plane): correct everywhere, fast enough on
a CPU, slow on a GPU at small token counts (see the native kernels).
"""

from __future__ import annotations

import math

import torch

from kvcore.kernels import TransferPlan, check_storages, single_threaded
from kvcore.kernels.views import UNIT as _UNIT
from kvcore.kernels.views import cache_rows_view
from kvcore.kernels.views import storage_units as _storage_units
from kvcore.spec import Plane, StrideTable


def _byte_offset(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def _unit_width(table: StrideTable, buffers: dict[str, torch.Tensor]) -> int:
    g = 8
    vals: list[int] = []
    for p in table.planes:
        s = p.strides
        vals += [s.block, s.token, s.head, s.chunk, s.chunk_bytes, s.token_group_stride, s.sub, p.head_bytes]
        vals += [p.staging.offset, p.staging.head_stride]
        vals += [off for _, off in p.bases]
    for b in buffers.values():
        esz = b.element_size()
        vals += [_byte_offset(b)] + [st * esz for st in b.stride()[:-1]]
    for v in vals:
        if v:
            g = math.gcd(g, int(v))
    return g if g in _UNIT else 1


def _staging_view(p: Plane, buf: torch.Tensor, layer: int, w: int, cache: dict) -> torch.Tensor:
    """``[T, heads, units]`` of one plane of one layer inside its staging buffer."""
    esz = buf.element_size()
    units = _storage_units(buf, w, cache)
    if p.staging.index is None:  # [NL, T, row]
        start = _byte_offset(buf) + layer * buf.stride(0) * esz
        s_tok = buf.stride(1) * esz
        t = buf.shape[1]
    else:  # [kv, NL, T, row]
        start = _byte_offset(buf) + p.staging.index * buf.stride(0) * esz + layer * buf.stride(1) * esz
        s_tok = buf.stride(2) * esz
        t = buf.shape[2]
    return torch.as_strided(
        units, (t, p.num_heads, p.head_bytes // w), (s_tok // w, p.staging.head_stride // w, 1), (start + p.staging.offset) // w
    )


class ReferenceKernel:
    """Torch reference kernel: every device type, every format, priority 0."""

    name = "reference"
    device_types = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "npu", "privateuseone")
    formats = None
    priority = 0

    def available(self) -> bool:
        return True

    def why(self) -> str:
        return "torch indexing, one copy per (layer, plane); always available"

    def accepts(self, staging_device_type: str | None) -> bool:
        return True

    def _run(self, plan: TransferPlan, gather: bool) -> None:
        table = plan.table
        check_storages(table)  # a freed or re-created cache storage is a TransferError, never a raw error
        if plan.num_valid == 0:
            return
        nbytes = plan.num_valid * table.num_layers * sum(p.row_bytes for p in table.planes)
        # small CPU transfers stay on the calling thread: each indexing op below would wake
        # the intra-op pool, which on a busy host costs milliseconds per op (issue 12)
        with single_threaded(table.device, nbytes):
            self._move(plan, gather)

    def _move(self, plan: TransferPlan, gather: bool) -> None:
        table = plan.table
        buffers = plan.buffers
        dev = table.device
        slots = plan.slots
        sel = torch.nonzero(slots >= 0).flatten()
        s = slots[sel]
        blk = torch.div(s, table.block_size, rounding_mode="floor")
        off = s - blk * table.block_size
        w = _unit_width(table, buffers)
        nblocks = -(-table.num_slots // table.block_size)
        nv = sel.numel()
        views: dict = {}
        for p in table.planes:
            buf = buffers[p.staging.buffer]
            host = buf.device != dev
            sel_b = sel.to(buf.device) if host else sel
            grouped = bool(p.strides.token_group) and p.strides.token_group < table.block_size
            if grouped:
                g = p.strides.token_group
                idx = (blk, torch.div(off, g, rounding_mode="floor"), off % g)
            else:
                idx = (blk, off)
            for li, (t, base) in enumerate(p.bases):
                cv = cache_rows_view(p, t, base, nblocks, table.block_size, w, views)
                sv = _staging_view(p, buf, li, w, views)
                if gather:
                    rows = cv[idx].reshape(nv, p.num_heads, -1)
                    sv[sel_b] = rows.to(buf.device) if host else rows
                else:
                    rows = sv[sel_b]
                    cv[idx] = (rows.to(dev) if host else rows).reshape(cv[idx].shape)

    def gather(self, plan: TransferPlan) -> None:
        self._run(plan, True)

    def scatter(self, plan: TransferPlan) -> None:
        self._run(plan, False)


REFERENCE = ReferenceKernel()
