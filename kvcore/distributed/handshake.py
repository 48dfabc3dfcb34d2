"""The slow path: the handshake that agrees a channel's geometry, token count and chunking
(D and R0, then the receiver's status), and completing a peer's fast transfer refused."""

from __future__ import annotations

import torch

from kvcore.distributed.channels import _STATS, _Agreement
from kvcore.distributed.engine import _cuda
from kvcore.distributed.rings import _host_ring
from kvcore.distributed.sides import _Side, _side
from kvcore.distributed.transport import _exchange, _PeerLost
from kvcore.distributed.wire import (
    _F_EPOCH,
    _F_MODE,
    _F_VERDICT,
    CTL_BYTES,
    FAST,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL,
    SLOW,
    STATUS_BYTES,
    _chunk_tokens,
    _ctl_record,
    _message,
    _mismatch,
    _read,
    _slot_list,
    _src_desc,
)
from kvcore.errors import TransferError
from kvcore.layout import KVLayout
from kvcore.layout_copy import _check_slots, head_range


def _header(layout: KVLayout, side: _Side, heads, t: int, ct: int, me: int) -> dict:
    return {
        "kvcore": PROTOCOL,
        "ok": True,
        "format": layout.format.name,
        "describe": layout.describe(),
        "rank": me,
        "tokens": t,
        "layers": side.table.num_layers,
        "heads": list(head_range(heads, "heads") or (0, layout.num_heads)),
        "planes": [list(p) for p in side.sig],
        "chunk_tokens": ct,
        "token_bytes": side.wire.token_bytes,
    }


def _send_slow(ch, g, pg, dst, wdev, layout, side, s, t, heads, chunk_bytes, err, tmo, tag) -> _Agreement:
    """The handshake: D and R0 read on both hosts, then the receiver's status. Returns the
    new agreement, or raises (after completing the receiver's transfer when it is fast)."""
    _STATS["handshakes"] += 1
    ag = ch.agreement
    epoch = (ag.epoch + 1) if ag is not None else 1
    head: dict
    if err is None:
        try:
            _check_slots(layout, s, "slots", False)
        except TransferError as e:
            err = e
    if err is None:
        ct = _chunk_tokens(side.wire.token_bytes, t, chunk_bytes, layout.device.type)
        head = _header(layout, side, heads, t, ct, g.me)
    else:
        ct = 1
        head = {"kvcore": PROTOCOL, "ok": False, "rank": g.me, "error": str(err)}
    d = _message(_ctl_record(MAGIC, SLOW, epoch, t, 0 if err is None else 1), head, HEADER_BYTES).to(wdev)
    r0 = torch.zeros(CTL_BYTES, dtype=torch.uint8, device=wdev)
    what = f"kvcore.send to rank {dst}"
    try:
        _exchange(g, pg, dst, wdev, [(True, d), (False, r0)], tag, tmo)
    except _PeerLost as e:
        if err is not None:
            raise err from None
        raise TransferError(f"{what}: the receiver did not answer the header: {e.reason}; nothing was sent") from None
    rec, _ = _read(r0, "answer", False)
    if rec[_F_MODE] == FAST:
        # the receiver repeats the agreed transfer: this call does not match it
        if ag is None or rec[_F_EPOCH] != ag.epoch:
            raise TransferError(
                f"{what}: the receiver's channel state is out of step with this side's; destroy and re-create the process group"
            )
        _complete_refused_send(g, pg, dst, wdev, ag, tag, tmo)
        if err is not None:
            raise err  # the receiver's gate refused the transfer: it raises too
        why, _ = _mismatch(head, ag.sig, ag.layers, ag.tokens, _src_desc(head), f"rank {dst}'s {ag.peer_desc}", "the receiver")
        why = why or "this call differs from the transfer this channel agreed on"
        raise TransferError(
            f"{what}: the receiver refused and wrote nothing: {why} (the receiver repeats the transfer this channel agreed on, "
            f"{ag.tokens} token rows; the two calls do not match, both sides raise)"
        )
    if err is not None:
        raise err
    status = torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=wdev)
    try:
        _exchange(g, pg, dst, wdev, [(False, status)], tag, tmo)
    except _PeerLost as e:
        raise TransferError(f"{what}: the receiver did not answer: {e.reason}; nothing was sent") from None
    _, st = _read(status, "status", True)
    if not st.get("ok"):
        raise TransferError(f"{what}: the receiver refused and wrote nothing: {st.get('error')}")
    new = _Agreement(side.sig, side.table.num_layers, t, ct, side.wire.token_bytes, epoch, peer_desc=st.get("describe", ""))
    new.dfast = _message(_ctl_record(MAGIC, FAST, epoch, t, 0), None, HEADER_BYTES).to(wdev)
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).synchronize()  # sent from the side stream, which does not wait for this one
    ch.agreement = new
    return new


def _recv_slow(ch, g, pg, src, wdev, layout, side, s, t, layers, heads, err, tmo, tag):
    _STATS["handshakes"] += 1
    ag = ch.agreement
    what = f"kvcore.recv from rank {src}"
    if err is None:
        try:
            _check_slots(layout, s, "slots", True)
        except TransferError as e:
            err = e
    d = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=wdev)
    r0 = _ctl_record(MAGIC, SLOW, ag.epoch if ag is not None else 0, t, 0 if err is None else 1).to(wdev)
    try:
        _exchange(g, pg, src, wdev, [(False, d), (True, r0)], tag, tmo)
    except _PeerLost as e:
        where = f"; destination slots {_slot_list(s.cpu())} were not written" if s is not None else ""
        raise TransferError(f"{what}: no header arrived: {e.reason}{where}") from None
    rec, head = _read(d, "header", True)
    if rec[_F_MODE] == FAST:
        # the sender repeats the agreed transfer: this call does not match it
        if ag is None or rec[_F_EPOCH] != ag.epoch:
            raise TransferError(
                f"{what}: the sender's channel state is out of step with this side's; destroy and re-create the process group"
            )
        if err is None:
            mine = f"this {layout.format.name} ({layout.describe()})"
            why, _ = _mismatch(
                {"planes": [list(p) for p in ag.sig], "layers": ag.layers, "tokens": ag.tokens, "heads": None},
                side.sig,
                side.table.num_layers,
                t,
                ag.peer_desc,
                mine,
            )
            err = TransferError(
                f"{what}: {why or 'this call differs from the transfer this channel agreed on'} (the sender repeats the transfer this "
                f"channel agreed on, {ag.tokens} token rows; the two calls do not match, both sides raise, nothing was written)"
            )
        _complete_refused_recv(g, pg, src, wdev, ag, tag, tmo)
        raise err
    if not head.get("ok") or rec[_F_VERDICT]:
        raise TransferError(f"{what}: the sender refused and sent nothing: {head.get('error')}")
    planes = tuple(tuple(p) for p in head.get("planes") or ())
    if err is None:
        why, order = _mismatch(
            head, side.sig, side.table.num_layers, t, _src_desc(head), f"this {layout.format.name} ({layout.describe()})"
        )
        if why is not None:
            err = TransferError(why)
        else:
            side = _side(layout, layers, heads, "heads", tuple(p[0] for p in planes))
            if side.wire.token_bytes != head.get("token_bytes"):
                err = TransferError(f"the sender's rows are {head.get('token_bytes')} bytes per token, this side's {side.wire.token_bytes}")
    status = {"kvcore": PROTOCOL, "ok": err is None, "rank": g.me}
    if err is not None:
        status["error"] = f"rank {g.me}: {err}"
    else:
        status["describe"] = f"{layout.format.name} ({layout.describe()})"
    try:
        _exchange(g, pg, src, wdev, [(True, _message(_ctl_record(MAGIC), status, STATUS_BYTES).to(wdev))], tag, tmo)
    except _PeerLost as e:
        if err is None:
            raise TransferError(f"{what}: the status could not be returned: {e.reason}; nothing was written") from None
    if err is not None:
        raise err
    new = _Agreement(
        planes, int(head["layers"]), t, int(head["chunk_tokens"]), int(head["token_bytes"]), rec[_F_EPOCH], peer_desc=_src_desc(head)
    )
    new.r0fast = _ctl_record(MAGIC, FAST, new.epoch, t).to(wdev)
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).synchronize()  # sent from the side stream, which does not wait for this one
    ch.agreement = new
    return new, side


def _wire_groups(ag: _Agreement, bounds, buf: torch.Tensor, sending: bool, v: torch.Tensor) -> list[list[tuple[bool, torch.Tensor]]]:
    """The point-to-point groups of one agreed transfer, as ``(send?, tensor)`` ops: chunk
    ``i`` from ``buf`` (the header prefix only with the first), and the receiver's verdict
    ``v`` travelling the other way with the last chunk (alone when there are no chunks).
    ``sending``: this side sends the chunks (and receives ``v``)."""
    groups = []
    for i, (a, b) in enumerate(bounds):
        lo = 0 if i == 0 else ag.prefix_bytes
        groups.append([(sending, buf[lo : ag.prefix_bytes + (b - a) * ag.token_bytes])])
    if groups:
        groups[-1].append((not sending, v))
    else:
        groups.append([(not sending, v)])
    return groups


def _complete_refused_send(g, pg, dst, wdev, ag: _Agreement, tag, tmo) -> None:
    """Feed a fast receiver the agreed transfer's messages (refused: the D it read says slow)."""
    ring = _host_ring(True, wdev) if wdev.type == "cpu" else _cuda(wdev).rings[True]
    need = ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes
    ring.ensure(need)
    v = torch.zeros(CTL_BYTES, dtype=torch.uint8, device=wdev)
    bounds = ag.bounds()
    buf = ring.bufs[0]
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).wait_stream(_cuda(wdev).xs)
        for w in ring.work:
            if w is not None:
                w.wait()
    buf[:CTL_BYTES].copy_(_ctl_record(MAGIC, 0, ag.epoch, ag.tokens, 8).to(wdev))
    for ops in _wire_groups(ag, bounds, buf, True, v):
        try:
            _exchange(g, pg, dst, wdev, ops, tag, tmo)
        except _PeerLost:
            return


def _complete_refused_recv(g, pg, src, wdev, ag: _Agreement, tag, tmo) -> None:
    """Take a fast sender's agreed transfer without landing it, and answer it refused."""
    ring = _host_ring(False, wdev) if wdev.type == "cpu" else _cuda(wdev).rings[False]
    ring.ensure(ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes)
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).wait_stream(_cuda(wdev).xs)
        for e in ring.free:
            if e is not None:
                e.synchronize()
    buf = ring.bufs[0]
    v = _ctl_record(MAGIC, 0, ag.epoch, ag.tokens, 8).to(wdev)
    bounds = ag.bounds()
    for ops in _wire_groups(ag, bounds, buf, False, v):
        try:
            _exchange(g, pg, src, wdev, ops, tag, tmo)
        except _PeerLost:
            return
