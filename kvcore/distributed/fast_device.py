"""The fast transfer on the GPU engine (or its CPU emulation): slot checks, packing and
gated unpacking on the current stream, one NCCL group per chunk."""

from __future__ import annotations

import time

import torch

from kvcore.distributed.channels import _Done
from kvcore.distributed.engine import _NO_GATE, _InFlight, _lost_error
from kvcore.distributed.programs import _native_module, _program
from kvcore.distributed.rings import _done
from kvcore.distributed.transport import _PeerLost
from kvcore.distributed.wire import _OP_RECV, _OP_SEND, FAST, MAGIC
from kvcore.errors import TransferError


def _send_fast_dev(eng, ch, ag, dst, side, s) -> None:
    """The sender's fast transfer on the GPU engine (or its CPU emulation): per chunk the
    slot check (first chunk), the packing and one group; the receiver's answers read on a
    side stream."""
    mod = _native_module()
    ring = eng.ring(True)
    ring.ensure(ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes)
    prog = _program(ag, side, ring, side.native(emulate=eng.emulated), eng.emulated, True, dst)
    xs, plan, K, calls = eng.xs, prog.plan, prog.K, ch.calls
    ctl = eng.ctl(ch)
    works = []
    errors = []
    try:
        if K == 0:  # no tokens: the D / R0 / V exchange alone
            with eng.on(xs):
                eng.xs_after_main()
                if ctl.work is not None:
                    eng.wait_event(xs, ctl.ev)
                works.append((eng.post(*prog.group(0, -1, ctl)), -1, 0, 0))
        for i in range(K):
            a, b = prog.bounds[i]
            k = ring.next()
            if ring.work[k] is not None:
                eng.after(ring.work[k])  # the current stream waits until the chunk buffer's last send read it
            if i == 0:
                rep, mask = prog.head(k)
                rc = mod.p2p_check(s, side.num_slots, None, 0, None, ctl.flag, rep, MAGIC, FAST, ag.epoch, mask, _OP_SEND, calls, dst)
                if rc < 0:
                    raise TransferError(mod.copy_last_error())
                if rc > 0:  # the CPU answers at once (a GPU records a refusal on the device)
                    errors.append(mod.copy_last_error())
            rc = plan.run_gated(True, s if K == 1 else s[a:b], prog.chunk(k, i)[1], _NO_GATE)
            if rc:
                raise TransferError(f"{prog.what}: packing chunk {i} was refused: {mod.last_error()}")
            with eng.on(xs):
                eng.xs_after_main()
                if i == 0 and ctl.work is not None:
                    eng.wait_event(xs, ctl.ev)  # the last reader of this control slot's R0 / V
                w = eng.post(*prog.group(k, i, ctl))
            ring.work[k] = w
            works.append((w, i, a, b))
        # the receiver's answers, read on a side stream: the current stream does not wait for the wire
        w_last = works[-1][0]
        with eng.on(eng.ks):
            for w, *_ in works if eng.emulated else works[-1:]:
                eng.after(w)  # GPU: the last group (the NCCL stream runs them in order)
            rc = mod.p2p_verdict(ctl.r0, ctl.v, MAGIC, ag.epoch, ag.tokens, None, calls, dst)
            eng.record(ctl.ev, eng.ks)
        if rc < 0:
            raise TransferError(mod.copy_last_error())
        if rc > 0:
            errors.append(mod.copy_last_error())
    except _PeerLost as e:  # emulation: a host wait ran out
        i, a, b = next(((i, a, b) for w, i, a, b in works if not _done(w)), (-1, 0, 0))
        f = _InFlight(prog.what, True, works, K, ag.tokens, 0.0, eng.tmo, None, ())
        raise _lost_error(f, i, a, b, e.reason) from None
    ctl.work = w_last
    eng.keep(_InFlight(prog.what, True, works, K, ag.tokens, time.monotonic() + eng.tmo, eng.tmo, None, (ag.dfast, s)))
    if errors:
        raise _Done(errors[0])


def _recv_fast_dev(eng, ch, ag, src, side, s) -> None:
    """The receiver's fast transfer on the GPU engine (or its CPU emulation): its slot check,
    then per chunk one group (two in flight) and the gated unpacking; the first chunk's gate
    decides whether anything lands."""
    mod = _native_module()
    ring = eng.ring(False)
    ring.ensure(ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes)
    prog = _program(ag, side, ring, side.native(emulate=eng.emulated), eng.emulated, False, src)
    main, xs, plan, K, T, calls = eng.main, eng.xs, prog.plan, prog.K, prog.T, ch.calls
    ctl = eng.ctl(ch)
    dev = s.device
    if side.bitmap is None:
        side.bitmap = torch.zeros(max(1, (side.num_slots + 31) // 32), dtype=torch.int32, device=dev)
    if ctl.work is not None:
        eng.after(ctl.work)  # the current stream waits until this control slot's V was sent
    errors = []
    rc = mod.p2p_check(None, 0, s, side.num_slots, side.bitmap, ctl.flag, ctl.v, MAGIC, FAST, ag.epoch, None, _OP_RECV, calls, src)
    if rc < 0:
        raise TransferError(mod.copy_last_error())
    own = mod.copy_last_error() if rc > 0 else None
    ev_check = ctl.ev_check
    eng.record(ev_check, main)
    eff = torch.empty(T, dtype=torch.int64, device=dev)
    works: list = []
    slot_of: list[int] = []
    bounds = prog.bounds

    def post(i: int):
        k = ring.next()
        slot_of.append(k)
        with eng.on(xs):
            eng.wait_event(xs, ring.free[k])  # the last unpacking of this chunk buffer
            if i == 0 and ctl.work is not None:
                eng.wait_event(xs, ctl.ev)  # the last gate that read this control slot's D
            if i == K - 1:
                eng.wait_event(xs, ev_check)  # V (with the last chunk) is written by the check
            w = eng.post(*prog.group(k, i, ctl))
        ring.work[k] = w
        works.append((w, i, *bounds[i]))

    def land(i: int):
        a, b = bounds[i]
        k = slot_of[i]
        eng.after(works[i][0])  # the current stream waits for the chunk
        if i == 0:
            rc = mod.p2p_gate(ctl.d, prog.head(k), ctl.flag, MAGIC, ag.epoch, T, s, eff, ctl.gate, calls, src)
            if rc < 0:
                raise TransferError(mod.copy_last_error())
            if 0 < rc < 100:
                errors.append(mod.copy_last_error())
            eng.record(ctl.ev, main)
        rc = plan.run_gated(False, eff if K == 1 else eff[a:b], prog.chunk(k, i)[1], ctl.gate)
        if rc:
            raise TransferError(f"{prog.what}: unpacking chunk {i} was refused: {mod.last_error()}")
        if ring.free[k] is None:
            ring.free[k] = eng.event()
        eng.record(ring.free[k], main)

    try:
        if K == 0:
            with eng.on(xs):
                if ctl.work is not None:
                    eng.wait_event(xs, ctl.ev)
                eng.wait_event(xs, ev_check)
                w = eng.post(*prog.group(0, -1, ctl))
            works.append((w, -1, 0, 0))
            eng.after(w)
            eng.record(ctl.ev, main)
        else:
            post(0)
            if K > 1:
                post(1)
            for i in range(K):
                land(i)
                if i + 2 < K:
                    post(i + 2)
    except _PeerLost as e:  # emulation: a host wait ran out
        i, a, b = next(((i, a, b) for w, i, a, b in works if not _done(w)), (-1, 0, 0))
        f = _InFlight(prog.what, False, works, K, T, 0.0, eng.tmo, s, ())
        raise _lost_error(f, i, a, b, e.reason) from None
    ctl.work = works[-1][0]
    eng.keep(_InFlight(prog.what, False, works, K, T, time.monotonic() + eng.tmo, eng.tmo, s, (ag.r0fast, eff)))
    if errors:
        raise _Done(errors[0])
    if own:
        raise _Done(own)
