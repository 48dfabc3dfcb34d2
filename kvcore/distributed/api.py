"""``kvcore.send`` / ``kvcore.recv`` and ``release_staging``: the arguments checked, the
channel's agreement kept (fast) or made again (slow)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.distributed.channels import _GROUPS, _STATS, _Agreement, _Channel, _channel, _group, _step
from kvcore.distributed.engine import _CUDA, _dev_engine, _EmuEngine, _emulate, _surface
from kvcore.distributed.fast_device import _recv_fast_dev, _send_fast_dev
from kvcore.distributed.fast_host import _recv_fast_host, _send_fast_host
from kvcore.distributed.handshake import _recv_slow, _send_slow
from kvcore.distributed.rings import _HOST_RINGS
from kvcore.distributed.sides import _check_layout, _device_of, _recv_side, _Side, _side, _slots_arg, _wire_device
from kvcore.distributed.transport import _timeout
from kvcore.errors import TransferError
from kvcore.layout import KVLayout


def send(
    layout: KVLayout,
    slots,
    dst: int,
    *,
    heads=None,
    layers: Sequence[int] | int | None = None,
    group=None,
    chunk_bytes: int | None = None,
    timeout=None,
    tag: int = 0,
) -> None:
    """Send the tokens at ``slots`` to rank ``dst``, which calls :func:`recv`.

    Row ``i`` of ``slots`` lands in row ``i`` of the receiver's slots, in the receiver's
    own layout. See the module docstring for the protocol. On a GPU with NCCL a call that
    repeats its channel's agreed geometry and token count only enqueues work and returns;
    the current stream is ordered after the packing (the cache may be changed afterwards).

    Args:
        layout: the sender's cache (from :func:`kvcore.detect`); on a GPU with NCCL, on the
            CPU with Gloo (a GPU cache with Gloo is packed into pinned host chunks).
        slots: int64 ``[T]``; a negative slot is padding: the receiver leaves that row alone.
        dst: the receiver's global rank.
        heads: ``(start, stop)``: send only KV heads ``start..stop-1`` (a TP split: each
            decode rank receives its share of the heads).
        layers: the sender's layers to send (default all), in the order they land.
        group: the process group (default: the world).
        chunk_bytes: bytes per staging chunk (two are kept; a chunk holds at least one
            token), agreed in the handshake that opens the channel or changes its geometry
            or token count. Default: half of the transfer (CPU: a quarter), at least 16 MiB
            (CPU: 2 MiB) and at most 256 MiB (CPU: 8 MiB).
        timeout: seconds (or a timedelta) each message may take (default
            ``KVCORE_P2P_TIMEOUT`` or 300).
        tag: the point-to-point tag: one channel per tag (Gloo also tells concurrent
            transfers apart by it).

    Raises:
        TransferError: the sender's own arguments are bad (a slot out of range, a head
            range past its heads, a bad rank; the receiver is told and raises too), the
            receiver refused (its message is included: other planes, head counts, widths,
            dtypes, layer or token counts, its own bad slots), the two calls do not match,
            or the receiver disappeared (the token rows not delivered are named). On a GPU
            a refusal found on a device is raised by the next kvcore CUDA call or
            :func:`kvcore.synchronize` (module docstring).
    """
    with _device_of(layout):
        _send(layout, slots, dst, heads, layers, group, chunk_bytes, timeout, tag)


def recv(
    layout: KVLayout,
    slots,
    src: int,
    *,
    heads=None,
    layers: Sequence[int] | int | None = None,
    group=None,
    timeout=None,
    tag: int = 0,
) -> None:
    """Receive tokens from rank ``src`` (which calls :func:`send`) into ``slots`` of this cache.

    On a GPU with NCCL a call that repeats its channel's agreed geometry and token count
    only enqueues work and returns; the current stream is ordered after the unpacking.

    Args:
        layout: the receiver's cache (from :func:`kvcore.detect`), in its own layout.
        slots: int64 ``[T]``: row ``i`` of the sender lands in ``slots[i]``; a negative slot
            (here or on the sender) leaves the row untouched.
        src: the sender's global rank.
        heads: ``(start, stop)``: land the incoming heads in this cache's KV heads
            ``start..stop-1`` (a TP merge: a cache with more heads than the sender sends).
        layers: this cache's layers to fill (default all), in the sender's order.
        group, timeout, tag: as :func:`send`.

    Raises:
        TransferError: this side's arguments are bad (a slot out of range or repeated; the
            sender is told and raises too), the sender's header cannot land here (other
            planes, head counts without ``heads=``, widths, dtypes, layer or token
            counts: both sides raise, nothing is written), the sender refused, the two
            calls do not match, or the sender disappeared (the destination slots of the
            unfinished chunk are named: they and all later rows were not written; earlier
            chunks were landed). On a GPU a refusal found on a device is raised by the
            next kvcore CUDA call or :func:`kvcore.synchronize` (module docstring).
    """
    with _device_of(layout):
        _recv(layout, slots, src, heads, layers, group, timeout, tag)


def _send(layout, slots, dst, heads, layers, group, chunk_bytes, timeout, tag) -> None:
    tmo = _timeout(timeout)
    g, pg = _group(group, dst, "dst")
    err: TransferError | None = None
    wdev = torch.device("cpu")
    side = s = None
    t = 0
    try:
        _check_layout(layout, "sending")
        wdev = _wire_device(layout, g)
        side = _side(layout, layers, heads, "heads")
        s = _slots_arg(slots, layout, "slots")
        t = int(s.shape[0])
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
            raise TransferError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    except TransferError as e:
        err = e
        if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in g.backend:
            wdev = layout.device
    if wdev.type == "cuda":
        _surface(wdev)
    ch = _channel(g, dst, tag, True)
    ch.check(f"kvcore.send to rank {dst}")
    ag = ch.agreement
    if err is None and ag is not None and ag.sig == side.sig and ag.layers == side.table.num_layers and ag.tokens == t:
        _send_fast(ch, ag, g, pg, dst, wdev, side, s, tmo, tag)
        return
    ag = _send_slow(ch, g, pg, dst, wdev, layout, side, s, t, heads, chunk_bytes, err, tmo, tag)
    _send_fast(ch, ag, g, pg, dst, wdev, side, s, tmo, tag)


def _recv(layout, slots, src, heads, layers, group, timeout, tag) -> None:
    tmo = _timeout(timeout)
    g, pg = _group(group, src, "src")
    err: TransferError | None = None
    wdev = torch.device("cpu")
    s = None
    t = 0
    ch = _channel(g, src, tag, False)
    ch.check(f"kvcore.recv from rank {src}")
    ag = ch.agreement
    side = None
    try:
        _check_layout(layout, "receiving")
        wdev = _wire_device(layout, g)
        s = _slots_arg(slots, layout, "slots")
        t = int(s.shape[0])
        side = _recv_side(ch, layout, layers, heads, ag)
    except TransferError as e:
        err = e
        if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in g.backend:
            wdev = layout.device
    if wdev.type == "cuda":
        _surface(wdev)
    if err is None and ag is not None and side.sig == ag.sig and side.table.num_layers == ag.layers and ag.tokens == t:
        _recv_fast(ch, ag, g, pg, src, wdev, side, s, tmo, tag)
        return
    ag, side = _recv_slow(ch, g, pg, src, wdev, layout, side, s, t, layers, heads, err, tmo, tag)
    _recv_fast(ch, ag, g, pg, src, wdev, side, s, tmo, tag)


def _fast(sending: bool, ch: _Channel, ag: _Agreement, g, pg, peer, wdev, side: _Side, s: torch.Tensor, tmo: float, tag: int) -> None:
    """A fast transfer under the channel's agreement (counted; a failure before all its
    messages were posted breaks the channel: :class:`_step`)."""
    ch.calls += 1
    _STATS["fast"] += 1
    with _step(ch):
        _fast_any(sending, ch, ag, g, pg, peer, wdev, side, s, tmo, tag)


def _fast_any(sending: bool, ch, ag, g, pg, peer, wdev, side, s, tmo, tag) -> None:
    """The fast transfer on the engine that serves it: the GPU engine (NCCL and a native
    table), its CPU emulation (``KVCORE_P2P_EMULATE=1``), else every message waited for on
    the host."""
    if wdev.type == "cuda" and side.native() is not None:
        eng = _dev_engine(ch, wdev, g, pg, peer, tag, tmo)
    elif wdev.type == "cpu" and _emulate() and side.layout.device.type == "cpu" and side.native(emulate=True) is not None:
        eng = _EmuEngine(g, pg, peer, tag, tmo, sending)
    else:
        (_send_fast_host if sending else _recv_fast_host)(ch, ag, g, pg, peer, wdev, side, s, tmo, tag)
        return
    (_send_fast_dev if sending else _recv_fast_dev)(eng, ch, ag, peer, side, s)


def _send_fast(ch, ag, g, pg, dst, wdev, side, s, tmo, tag) -> None:
    _fast(True, ch, ag, g, pg, dst, wdev, side, s, tmo, tag)


def _recv_fast(ch, ag, g, pg, src, wdev, side, s, tmo, tag) -> None:
    _fast(False, ch, ag, g, pg, src, wdev, side, s, tmo, tag)


def _send_fast_any(ch, ag, g, pg, dst, wdev, side, s, tmo, tag) -> None:
    _fast_any(True, ch, ag, g, pg, dst, wdev, side, s, tmo, tag)


def _recv_fast_any(ch, ag, g, pg, src, wdev, side, s, tmo, tag) -> None:
    _fast_any(False, ch, ag, g, pg, src, wdev, side, s, tmo, tag)


def release_staging() -> None:
    """Free the staging chunks kvcore.send / kvcore.recv keep between calls (they are
    allocated again by the next transfer). Waits for the transfers in flight."""
    for st in list(_CUDA.values()):
        _surface(st.device, block=True)
        torch.cuda.synchronize(st.device)
        for r in st.rings.values():
            r.bufs, r.cap, r.retired = [], 0, []
            r.work, r.free = [None, None], [None, None]
            r.gen += 1
    for g in _GROUPS.values():
        for wg in g.graphs.values():
            wg.clear()
    _HOST_RINGS.clear()
