"""The fast transfer with every message waited for on the host (Gloo; a GPU cache packs into
pinned host chunks)."""

from __future__ import annotations

import torch

from kvcore.distributed.channels import _Done
from kvcore.distributed.gates import _check_values, _gate_host
from kvcore.distributed.rings import _host_ring
from kvcore.distributed.transport import _PeerLost, _post, _wait
from kvcore.distributed.wire import (
    _F_EPOCH,
    _F_INDEX,
    _F_MAGIC,
    _F_MODE,
    _F_NUM,
    _F_TOKENS,
    _F_VALUE,
    _F_VERDICT,
    CTL_BYTES,
    FAST,
    HEADER_BYTES,
    MAGIC,
    _ctl_record,
    _slot_list,
)
from kvcore.errors import TransferError
from kvcore.kernels import TransferPlan


def _send_fast_host(ch, ag, g, pg, dst, wdev, side, s, tmo, tag) -> None:
    """The fast transfer with every message waited for on the host (Gloo; a GPU cache packs
    into pinned host chunks)."""
    layout = side.layout
    cuda_cache = layout.device.type == "cuda"
    host_s = s.cpu() if s.is_cuda else s
    P, tb = ag.prefix_bytes, ag.token_bytes
    ring = _host_ring(True, wdev, pin=cuda_cache and wdev.type == "cpu")
    ring.ensure(P + ag.chunk_tokens * tb)
    kind, index, value, num = _check_values(host_s, side.num_slots, None, 0)
    what = f"kvcore.send to rank {dst}"
    kernel = side.kernel(wdev.type)
    r0 = torch.zeros(CTL_BYTES, dtype=torch.uint8)
    v = torch.zeros(CTL_BYTES, dtype=torch.uint8)
    bounds = ag.bounds()
    pending: list = [None, None]
    first_err = None

    def lost(i, a, b, e):
        return TransferError(
            f"{what}: chunk {i} of {len(bounds)} (token rows {a}..{b - 1}) was not delivered: {e.reason}. The receiver's slots for "
            f"token rows {a}..{ag.tokens - 1} were not written by this call; destroy and re-create the process group before the next "
            "transfer"
        )

    for i, (a, b) in enumerate(bounds):
        k = i % 2
        if pending[k] is not None:
            for w, (pi, pa, pb) in pending[k]:
                try:
                    _wait(w, tmo)
                except _PeerLost as e:
                    raise lost(pi, pa, pb, e) from None
            pending[k] = None
        buf = ring.bufs[k]
        if i == 0:
            buf[:CTL_BYTES] = _ctl_record(MAGIC, 0, ag.epoch, ag.tokens, kind, index, value, num)
            buf[CTL_BYTES : CTL_BYTES + ag.tokens] = (host_s >= 0).to(torch.uint8)
        valid = s[a:b] >= 0 if kind == 0 else None
        n_valid = int(valid.sum()) if valid is not None else 0
        if n_valid:
            kernel.gather(TransferPlan(table=side.wire.table, slots=s[a:b], staging=side.wire.views(buf[P:], b - a), num_valid=n_valid))
            if cuda_cache:
                torch.cuda.current_stream(layout.device).synchronize()  # Gloo reads the pinned chunk from the host
        if i == 0:
            ops = [(True, ag.dfast), (False, r0), (True, buf[: P + (b - a) * tb])]
        else:
            ops = [(True, buf[P : P + (b - a) * tb])]
        if i == len(bounds) - 1:
            ops.append((False, v))  # the receiver posts it with the last chunk (one chunk: alone); Gloo matches in order
        pending[k] = [(_post(snd, t, dst, pg, tag), (i, a, b)) for snd, t in ops]
    if not bounds:
        pending[0] = [(_post(snd, t, dst, pg, tag), (-1, 0, 0)) for snd, t in [(True, ag.dfast), (False, r0), (False, v)]]
    for part in pending:
        for w, (pi, pa, pb) in part or ():
            try:
                _wait(w, tmo)
            except _PeerLost as e:
                if pi < 0:
                    raise TransferError(f"{what}: the receiver did not answer: {e.reason}") from None
                raise lost(pi, pa, pb, e) from None
    if kind:
        raise _Done(
            f"{what} was refused and wrote nothing: slots[{index}] = {value} is out of range: this cache has {num} slots per layer "
            f"(valid 0..{num - 1}; negative slots are padding and are skipped); the receiver wrote nothing and raises too"
        )
    rr = r0.view(torch.int64).tolist()
    vv = v.view(torch.int64).tolist()
    if rr[_F_MAGIC] != MAGIC or vv[_F_MAGIC] != MAGIC:
        first_err = f"{what}: the receiver's answer is not kvcore's: both sides must call kvcore.send / kvcore.recv in the same order"
    elif rr[_F_MODE] != FAST or rr[_F_EPOCH] != ag.epoch or rr[_F_TOKENS] != ag.tokens:
        first_err = (
            f"{what}: the receiver (rank {dst}) was called with {rr[_F_TOKENS]} token rows or another geometry than this channel agreed "
            f"on ({ag.tokens} rows), so it did not take this transfer; both sides raise, nothing was written"
        )
    elif vv[_F_VERDICT]:
        vk, vi, vval, vn = vv[_F_VERDICT], vv[_F_INDEX], vv[_F_VALUE], vv[_F_NUM]
        why = (
            f"destination slot {vval} appears more than once in its slots"
            if vk == 2
            else f"its slots[{vi}] = {vval} is out of range: it has {vn} slots per layer"
        )
        first_err = f"{what}: the receiver (rank {dst}) refused and wrote nothing: {why}"
    if first_err:
        raise _Done(first_err)


def _recv_fast_host(ch, ag, g, pg, src, wdev, side, s, tmo, tag) -> None:
    layout = side.layout
    cuda_cache = layout.device.type == "cuda"
    host_s = s.cpu() if s.is_cuda else s
    P, tb, T = ag.prefix_bytes, ag.token_bytes, ag.tokens
    ring = _host_ring(False, wdev, pin=cuda_cache and wdev.type == "cpu")
    ring.ensure(P + ag.chunk_tokens * tb)
    what = f"kvcore.recv from rank {src}"
    own = _check_values(None, 0, host_s, side.num_slots)
    v = _ctl_record(MAGIC, FAST, ag.epoch, T, *own)
    d = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    kernel = side.kernel(wdev.type)
    bounds = ag.bounds()
    K = len(bounds)
    works: list = [None] * K
    verdict = None
    eff = None

    def post(i):
        a, b = bounds[i]
        buf = ring.bufs[i % 2]
        ops = [(False, d), (True, ag.r0fast), (False, buf[: P + (b - a) * tb])] if i == 0 else [(False, buf[P : P + (b - a) * tb])]
        if i == K - 1:
            ops.append((True, v))
        works[i] = [_post(snd, t, src, pg, tag) for snd, t in ops]

    if K == 0:
        for w in [_post(snd, t, src, pg, tag) for snd, t in [(False, d), (True, ag.r0fast), (True, v)]]:
            try:
                _wait(w, tmo)
            except _PeerLost as e:
                raise TransferError(f"{what}: the sender was lost: {e.reason}; nothing was written") from None
        return
    post(0)
    if K > 1:
        post(1)
    for i, (a, b) in enumerate(bounds):
        for w in works[i]:
            try:
                _wait(w, tmo)
            except _PeerLost as e:
                landed = f"chunks 0..{i - 1} (rows 0..{a - 1}) were landed; " if (i and verdict == 0) else "no chunk was landed; "
                raise TransferError(
                    f"{what}: chunk {i} of {K} (rows {a}..{b - 1}) did not arrive: {e.reason}. Destination slots "
                    f"{_slot_list(host_s[a:b])} (that chunk) were not written, nor the slots of rows "
                    f"{b}..{T - 1}; {landed}nothing else was touched. Destroy and re-create the process group before the next transfer"
                ) from None
        buf = ring.bufs[i % 2]
        if i == 0:
            verdict, eff = _gate_host(d, buf, own[0], ag, host_s, what, layout, side, src)
        if verdict == 0:
            es = eff[a:b]
            n_valid = int((es >= 0).sum())
            if n_valid:
                plan = TransferPlan(
                    table=side.wire.table, slots=es.to(layout.device), staging=side.wire.views(buf[P:], b - a), num_valid=n_valid
                )
                kernel.scatter(plan)
                if cuda_cache:
                    torch.cuda.current_stream(layout.device).synchronize()  # the pinned chunk is reused by Gloo next
        if i + 2 < K:
            post(i + 2)
    if own[0]:
        kind, index, value, num = own
        if kind == 2:
            raise _Done(
                f"{what} was refused and wrote nothing: destination slot {value} appears more than once in slots; it would be written "
                "twice (the sender is told and raises too)"
            )
        raise _Done(
            f"{what} was refused and wrote nothing: slots[{index}] = {value} is out of range: this cache has {num} slots per layer "
            f"(valid 0..{num - 1}; negative slots are padding and are skipped); the sender is told and raises too"
        )
    if verdict:
        raise _Done(str(verdict))
