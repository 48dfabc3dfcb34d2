"""``invalid[KIND]``: an invalid call (:data:`INVALID`) raises TransferError and leaves the
cache and the staging buffer byte-identical, per fixture, kernel and device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcore.errors import TransferError
from kvcore.layout import KVLayout
from kvcore.layout_plan import synchronize
from kvcore.testing.checks.common import (
    _change_where,
    _dname,
    _esize,
    _sentinel_like,
    devices,
)
from kvcore.testing.checks.context import _Ctx
from kvcore.testing.results import CheckFailure, CheckSkip


def _expect_refusal(ctx: _Ctx, what: str, call: Callable[[], Any], staging: torch.Tensor | None = None) -> None:
    snap = ctx.snapshot()
    st_before = staging.view(torch.uint8).clone() if staging is not None and staging.device.type != "meta" and staging.numel() else None
    try:
        call()
        # a CUDA call validated on the device (validate="device", the CUDA default) reports its
        # refusal at the documented point: the next kvcore CUDA call or kvcore.synchronize()
        synchronize(ctx.layout.device)
    except TransferError:
        pass
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(f"{what}: raised {type(e).__name__} ({e}); it must raise kvcore.TransferError") from None
    else:
        raise CheckFailure(f"{what}: accepted; it must raise kvcore.TransferError (immediately, or at kvcore.synchronize())")
    if snap.first_change() is not None:
        raise CheckFailure(f"{what}: raised TransferError but changed the cache first: {_change_where(snap, ctx.pl, ctx.enc)}")
    if st_before is not None and not torch.equal(staging.view(torch.uint8), st_before):
        raise CheckFailure(f"{what}: raised TransferError but wrote the staging buffer")


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    same = [d for d in (torch.float16, torch.bfloat16, torch.int16, torch.float32, torch.int32, torch.uint8, torch.int8) if d != dtype]
    for d in same:
        if _esize(d) == _esize(dtype):
            return d
    return same[0]


def _other_device(lay: KVLayout) -> torch.device:
    for d in devices():
        if d.type != lay.device.type and not (lay.device.type == "cuda" and d.type == "cpu"):
            return d
    return torch.device("meta")


INVALID = ("slot_out_of_range", "dtype", "device", "shape", "duplicate_slots", "layers")


def check_invalid(ctx: _Ctx, kind: str) -> str:
    lay = ctx.layout
    n, t = lay.page_buffer_size, 4
    good = torch.tensor([0, n - 1, -1, 1 % n], dtype=torch.int64)
    if n < 3:
        good = torch.tensor([0, -1], dtype=torch.int64)
        t = 2
    src, _ = ctx.src_rows(good)

    def both(label, slots, staging_g, staging_s, **kw):
        _expect_refusal(ctx, f"gather with {label}", lambda: ctx.gather(slots, staging_g, **kw), staging_g)
        _expect_refusal(ctx, f"scatter with {label}", lambda: ctx.scatter(slots, staging_s, **kw))

    if kind == "slot_out_of_range":
        for bad in (n, n + lay.block_size if not lay.format.fused_nbbs else n + 1, 2**40):
            s = good.clone()
            s[-1] = bad
            both(f"slot {bad} (valid 0..{n - 1})", s, _sentinel_like(lay, t), src)
        return f"slots >= {n} refused"
    if kind == "dtype":
        od = _other_dtype(lay.dtype)
        both(
            f"a {_dname(od)} staging buffer",
            good,
            torch.zeros(lay.staging_shape(t), dtype=od, device=lay.device),
            src.view(torch.uint8).view(od)
            if _esize(od) == lay.element_size
            else torch.zeros(lay.staging_shape(t), dtype=od, device=lay.device),
        )
        _expect_refusal(ctx, "gather with a float slot_mapping", lambda: ctx.gather(good.to(torch.float32), _sentinel_like(lay, t)))
        return f"{_dname(od)} refused"
    if kind == "device":
        dev = _other_device(lay)
        wrong = torch.empty(lay.staging_shape(t), dtype=lay.dtype, device=dev)
        both(f"a staging buffer on {dev}", good, wrong, wrong)
        return f"{dev} refused"
    if kind == "shape":
        shapes = [
            lay.staging_shape(t + 1),
            (lay.kv_size, lay.num_layers + 1, t, lay.hidden_dim),
            (lay.kv_size, lay.num_layers, t, lay.hidden_dim + 1),
            (3 - lay.kv_size, lay.num_layers, t, lay.hidden_dim),
            (lay.kv_size, lay.num_layers * t, lay.hidden_dim),
        ]
        for shp in shapes:
            st = torch.zeros(shp, dtype=lay.dtype, device=lay.device)
            both(f"staging shape {tuple(shp)} (expected {lay.staging_shape(t)})", good, st, st)
        return f"{len(shapes)} shapes refused"
    if kind == "duplicate_slots":
        if n < 2:
            raise CheckSkip("one slot only")
        dup = torch.tensor([1, 0, 1, -1], dtype=torch.int64)
        d_src, _ = ctx.src_rows(dup)
        _expect_refusal(ctx, "scatter with slot 1 twice", lambda: ctx.scatter(dup, d_src))
        return "refused"
    if kind == "layers":
        nl = lay.num_layers
        sub_src = torch.zeros(lay.staging_shape(t, [0, 0]), dtype=lay.dtype, device=lay.device)
        both(
            f"layers=[{nl}] (valid 0..{nl - 1})",
            good,
            torch.zeros(lay.staging_shape(t, [nl]), dtype=lay.dtype, device=lay.device),
            torch.zeros(lay.staging_shape(t, [nl]), dtype=lay.dtype, device=lay.device),
            layers=[nl],
        )
        both("layers=[0, 0]", good, sub_src, sub_src, layers=[0, 0])
        return "refused"
    raise CheckSkip(f"unknown invalid-call kind {kind!r}")
