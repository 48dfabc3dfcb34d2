"""``roundtrip[dtype]``: random bits and every special pattern of the dtype (NaNs, -0, inf,
subnormals) scatter and gather back bit-exactly, per fixture, kernel, device and dtype."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _compare,
    _dname,
    _seed,
    _sentinel_like,
    _slots,
    _staged,
)
from kvcore.testing.checks.context import _Ctx, _run_scatter
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure


def check_roundtrip(case: FixtureCase, device: torch.device, kernel: Any, dtype: torch.dtype) -> str:
    ctx = _Ctx(case, device, kernel, dtype=dtype, fill=False)
    lay = ctx.layout
    if lay.dtype != dtype:
        raise CheckFailure(f"a {_dname(dtype)} cache was detected as {_dname(lay.dtype)}")
    gen = torch.Generator().manual_seed(_seed(case.name, dtype))
    for row in ctx.pl:  # random bits everywhere the engine addresses
        for v in row:
            v.fill(oracle.random_bits(v.shape, lay.element_size, gen))
    slots = _slots(lay, _seed(case.name, "roundtrip", dtype))
    t = len(slots)
    bits = oracle.random_bits(lay.staging_shape(t), lay.element_size, gen)
    pats = torch.tensor(oracle.special_patterns(dtype), dtype=torch.int64)
    flat = bits.view(-1)
    flat[: min(flat.numel(), 4 * pats.numel())] = pats.repeat(4)[: min(flat.numel(), 4 * pats.numel())]
    # whole rows of one special pattern, too (a row of -0 or NaN in one token)
    for i in range(min(t, pats.numel())):
        bits[:, :, (i * 3) % t, :] = pats[i]
    src = torch.empty(lay.staging_shape(t), dtype=dtype, device=lay.device)
    oracle.int_view(src).copy_(oracle.from_unsigned(bits, oracle.int_view(src).dtype).to(lay.device))
    _run_scatter(ctx, f"scatter of {_dname(dtype)} bits", slots, src, bits)
    ctx.scatter(slots, src)
    out = _sentinel_like(lay, t)
    before = _staged(out)
    ctx.gather(slots, out)
    keep = (slots >= 0).view(1, 1, -1, 1)
    _compare(f"gather after scatter ({_dname(dtype)})", _staged(out), torch.where(keep, bits, before), ctx.layers, slots, lay, None)
    return f"{len(pats)} special patterns"
