"""The cache the data-moving checks share: :class:`_Ctx` (a fixture's cache on one device,
detected and filled with codes, with the kernel under test forced) and :func:`_run_scatter`
(a scatter compared with the engine's own writes, byte for byte)."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _copies,
    _detect,
    _encoding,
    _filled,
    _kernel_guard,
    _make,
    _planes,
    _widest,
    forced_kernel,
)
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure
from kvcore.transfer import gather, scatter


class _Ctx:
    """A fresh cache of the fixture on one device, detected and filled with codes."""

    def __init__(self, case: FixtureCase, device: torch.device, kernel: Any, *, dtype=None, sizes=None, fill=True):
        self.case = case
        self.dtype = dtype or _widest(case.dtypes)
        self.sizes = dict(sizes or case.sizes)
        self.kv, self.hints = _make(case, self.sizes, self.dtype, device)
        self.layout = _detect(case, self.kv, self.hints)
        _kernel_guard(kernel, self.layout)
        self.kernel = kernel
        if fill:
            self.pl, self.enc = _filled(case, self.kv, self.layout, self.hints)
        else:
            self.pl, self.enc = _planes(case, self.kv, self.layout, self.hints), _encoding(self.layout)
        self.base = self.snapshot()

    def snapshot(self) -> oracle.Snapshot:
        """Bytes of every storage the cache lives in: the engine's container and the
        detected layout's tensors (an engine object need not be a list of tensors)."""
        return oracle.Snapshot([self.kv, self.layout.kv_caches])

    def reset(self) -> _Ctx:
        """Back to the state right after construction (codes everywhere)."""
        self.base.restore()
        return self

    @property
    def layers(self) -> list[int]:
        return list(range(self.layout.num_layers))

    def gather(self, slots, out, **kw):
        with forced_kernel(self.kernel.name):
            return gather(self.layout, slots, out, **kw)

    def scatter(self, slots, src, **kw):
        with forced_kernel(self.kernel.name):
            return scatter(self.layout, slots, src, **kw)

    def src_rows(self, slots: torch.Tensor, layers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer of source codes for ``slots`` (padding rows carry codes too:
        they must land nowhere), and its int64 rows."""
        layers = self.layers if layers is None else layers
        rows = self.enc.rows(layers, slots.clamp(min=0), src=True)
        src = torch.empty(self.layout.staging_shape(len(slots), layers), dtype=self.dtype, device=self.layout.device)
        iv = oracle.int_view(src)
        iv.copy_(oracle.from_unsigned(rows, iv.dtype).reshape(iv.shape).to(iv.device))
        return src, rows

    def oracle_scatter(self, snap: oracle.Snapshot, slots, rows, layers=None) -> tuple[oracle.Snapshot, list]:
        """What the engine's own writes produce: restore ``snap``, write through kv_view."""
        after_kernel = self.snapshot()
        planes_kernel = _copies(self.pl)
        snap.restore()
        oracle.write_rows(self.pl, self.layers if layers is None else layers, slots, rows)
        return after_kernel, planes_kernel


def _run_scatter(ctx: _Ctx, what: str, slots: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, *, layers=None, call=None) -> None:
    snap = ctx.snapshot()
    (call or (lambda: ctx.scatter(slots, src, layers=layers)))()
    after_kernel, planes_kernel = ctx.oracle_scatter(
        snap, slots, rows, None if layers is None else ([layers] if isinstance(layers, int) else layers)
    )
    after_oracle = ctx.snapshot()
    mm = oracle.plane_mismatch(_copies(ctx.pl), planes_kernel, ctx.enc)
    if mm is not None:
        raise CheckFailure(f"{what}: {mm.describe(ctx.layout.kv_size)}", mm.as_dict())
    diff = after_kernel.same_as(after_oracle)
    if diff is not None:
        i, off, want, got = diff
        raise CheckFailure(
            f"{what}: byte {off} of storage {i}, which no (layer, K/V, slot, head) of the engine's view covers, "
            f"is 0x{got:02x} but must stay 0x{want:02x} (padding or another tensor's memory was written)"
        )
