"""The reference transfer kernel, in torch, for any device and every format.

It builds, per (layer, K/V) plane, an ``as_strided`` view of the plane's storage as
``[blocks, block_size, heads, chunks, chunk_units]`` and moves whole token rows with one
advanced-indexing copy. Data moves as integers of the widest width (8, 4, 2 or 1 bytes)
that every offset and stride allows, so every dtype, NaN payloads and negative zero
included, is bit-exact. One copy per (layer, K/V): correct everywhere, fast enough on a
CPU, slow on a GPU at small token counts (see the native kernels).
"""

from __future__ import annotations

import math

import torch

from kvcore.kernels import TransferPlan
from kvcore.spec import StrideTable

_UNIT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _unit_width(table: StrideTable, staging: torch.Tensor) -> int:
    g = 8
    vals = [table.head_bytes, table.row_bytes]
    for p in table.planes:
        vals += [p.block, p.token, p.head, p.chunk, p.chunk_bytes]
        for x in p.extra:
            vals += [x.offset, x.token, x.head, x.nbytes]
    for layer in table.bases:
        for _, off in layer:
            vals.append(off)
    esz = staging.element_size()
    vals += [staging.storage_offset() * esz] + [s * esz for s in staging.stride()[:-1]]
    for v in vals:
        if v:
            g = math.gcd(g, int(v))
    return g if g in _UNIT else 1


class ReferenceKernel:
    """Torch reference kernel: every device type, every format, priority 0."""

    name = "reference"
    device_types = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "npu", "privateuseone")
    formats = None
    priority = 0

    def available(self) -> bool:
        return True

    def why(self) -> str:
        return "torch indexing, one copy per (layer, K/V); always available"

    def accepts(self, staging_device_type: str | None) -> bool:
        return True

    # -- helpers ---------------------------------------------------------------------
    def _planes(self, table: StrideTable, w: int):
        dt = _UNIT[w]
        views: dict[int, torch.Tensor] = {}
        nblocks = -(-table.num_slots // table.block_size)
        for layer in table.bases:
            row = []
            for kv, (t, off) in enumerate(layer):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in views:
                    views[key] = torch.empty(0, dtype=dt, device=t.device).set_(st, 0, (st.nbytes() // w,), (1,))
                p = table.planes[kv]
                parts = [
                    torch.as_strided(
                        views[key],
                        (nblocks, table.block_size, table.num_heads, p.n_chunks * (p.chunk_bytes // w)),
                        (p.block // w, p.token // w, p.head // w, 1),
                        off // w,
                    )
                    if p.n_chunks == 1
                    else torch.as_strided(
                        views[key],
                        (nblocks, table.block_size, table.num_heads, p.n_chunks, p.chunk_bytes // w),
                        (p.block // w, p.token // w, p.head // w, p.chunk // w, 1),
                        off // w,
                    )
                ]
                for x in p.extra:
                    parts.append(
                        torch.as_strided(
                            views[key],
                            (nblocks, table.block_size, table.num_heads, x.nbytes // w),
                            (p.block // w, x.token // w, x.head // w, 1),
                            (off + x.offset) // w,
                        )
                    )
                row.append(parts)
            yield row

    def _run(self, plan: TransferPlan, gather: bool) -> None:
        table, staging = plan.table, plan.staging
        if plan.num_valid == 0:
            return
        dev = table.device
        slots = plan.slots
        sel = torch.nonzero(slots >= 0).flatten()
        s = slots[sel]
        blk = torch.div(s, table.block_size, rounding_mode="floor")
        off = s - blk * table.block_size
        host_staging = staging.device != dev
        w = _unit_width(table, staging)
        dt = _UNIT[w]
        if host_staging:
            # rows for the valid slots only, through a device temp proportional to them
            sel_h = sel.to(staging.device)
            if gather:
                tmp = torch.empty((table.kv_size, table.num_layers, sel.numel(), table.row_bytes // w), dtype=dt, device=dev)
            else:
                tmp = staging.view(torch.uint8).view(dt)[:, :, sel_h].to(dev)
            su = tmp
            idx = None
        else:
            su = staging.view(torch.uint8).view(dt)
            idx = sel
        nv = sel.numel()
        nh = table.num_heads
        for li, planes in enumerate(self._planes(table, w)):
            for kv, parts in enumerate(planes):
                if gather:
                    rows = [part[blk, off].reshape(nv, nh, -1) for part in parts]
                    row = rows[0] if len(rows) == 1 else torch.cat(rows, dim=-1)
                    if idx is None:
                        su[kv, li] = row.reshape(nv, -1)
                    else:
                        su[kv, li, idx] = row.reshape(nv, -1)
                else:
                    src = (su[kv, li] if idx is None else su[kv, li, idx]).reshape(nv, nh, -1)
                    start = 0
                    for part in parts:
                        width = part[0, 0].numel() // nh
                        part[blk, off] = src[:, :, start : start + width].reshape(nv, *part.shape[2:])
                        start += width
        if host_staging and gather:
            staging.view(torch.uint8).view(dt)[:, :, sel_h] = tmp.to(staging.device)

    def gather(self, plan: TransferPlan) -> None:
        self._run(plan, True)

    def scatter(self, plan: TransferPlan) -> None:
        self._run(plan, False)


REFERENCE = ReferenceKernel()
