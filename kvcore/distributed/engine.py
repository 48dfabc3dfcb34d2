"""The GPU engine (NCCL groups posted from a side stream, kernels on the current stream,
nothing waiting on the host), its CPU emulation for tests, and the transfers in flight:
their deadlines, and the errors they leave for the next call or ``kvcore.synchronize``."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from kvcore import p2p_graph
from kvcore.distributed.channels import _Channel
from kvcore.distributed.rings import _done, _Ring
from kvcore.distributed.transport import _ENV_DATA, _coalesced, _PeerLost, _poll, _post, _Works
from kvcore.distributed.wire import CTL_BYTES, HEADER_BYTES, _slot_list
from kvcore.errors import TransferError
from kvcore.kernels import native
from kvcore.p2p_graph import WireGraphs

_CTL_RING = 8


_NO_GATE = torch.empty(0, dtype=torch.int32)


_CPU = torch.device("cpu")


@dataclass
class _InFlight:
    """A GPU transfer whose NCCL operations may still be running."""

    what: str  # "kvcore.send to rank 1" / "kvcore.recv from rank 0"
    sending: bool
    works: list  # (work, chunk index or -1, first row, end row)
    chunks: int
    tokens: int
    deadline: float
    timeout: float
    slots: torch.Tensor | None
    keep: tuple


class _Cuda:
    """Per-device state of the GPU engine."""

    def __init__(self, device: torch.device):
        self.device = device
        self.xs = torch.cuda.Stream(device)  # NCCL operations are posted from here
        self.ks = torch.cuda.Stream(device)  # the sender reads the receiver's answers here
        self.rings = {True: _Ring(device), False: _Ring(device)}
        self.inflight: deque[_InFlight] = deque()
        self.ev_main = torch.cuda.Event()  # reused: the posting stream waits for the current stream


_CUDA: dict[int, _Cuda] = {}


def _cuda(device: torch.device) -> _Cuda:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    st = _CUDA.get(idx)
    if st is None:
        st = _CUDA[idx] = _Cuda(torch.device("cuda", idx))
    return st


class _Ctl:
    """Per-call control buffers of a channel (a ring per channel): D, R0, V, flags; on a GPU
    the events that guard their reuse (the emulation waits on the host: no events)."""

    __slots__ = ("buf", "d", "r0", "v", "flag", "gate", "ev", "ev_check", "work", "device")

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.device = device
        self.buf = torch.zeros(HEADER_BYTES + 3 * CTL_BYTES, dtype=torch.uint8, device=device)
        if cuda:
            torch.cuda.current_stream(device).synchronize()  # as _Ring.ensure: the NCCL stream writes it unordered
        self.d = self.buf[:HEADER_BYTES]
        self.r0 = self.buf[HEADER_BYTES : HEADER_BYTES + CTL_BYTES]
        self.v = self.buf[HEADER_BYTES + CTL_BYTES : HEADER_BYTES + 2 * CTL_BYTES]
        flags = self.buf[HEADER_BYTES + 2 * CTL_BYTES :].view(torch.int32)
        self.flag, self.gate = flags[0:1], flags[1:2]
        self.ev = torch.cuda.Event() if cuda else _NoEvent()  # the last reader of R0 / V (sender) or D (receiver)
        self.ev_check = torch.cuda.Event() if cuda else _NoEvent()  # receiver: after the check that wrote V
        self.work = None


def _ctl(ch: _Channel, device: torch.device) -> _Ctl:
    if ch.ctl and ch.ctl[0].device != device:  # the channel moved to another device: new control buffers
        ch.ctl, ch.ctl_next = [], 0
    if len(ch.ctl) < _CTL_RING:
        ch.ctl.append(_Ctl(device))
        return ch.ctl[-1]
    c = ch.ctl[ch.ctl_next]
    ch.ctl_next = (ch.ctl_next + 1) % _CTL_RING
    return c


class _NoEvent:
    def query(self) -> bool:
        return True

    def record(self, *a) -> None:
        pass


class _On:
    """Make ``stream`` current, then ``main`` again."""

    __slots__ = ("stream", "main")

    def __init__(self, stream, main):
        self.stream, self.main = stream, main

    def __enter__(self):
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *a):
        torch.cuda.set_stream(self.main)
        return False


class _DevEngine:
    """The GPU engine: NCCL groups posted from a side stream, kernels on the current stream,
    the sender's reading of the answers on a second side stream; nothing waits on the host."""

    emulated = False

    def __init__(self, dev, g, pg, peer, tag, tmo):
        st = _cuda(dev)
        self.st, self.dev, self.g, self.pg, self.gpeer, self.tag, self.tmo = st, dev, g, pg, g.index[peer], tag, tmo
        self.main = torch.cuda.current_stream(dev)
        self.xs, self.ks = st.xs, st.ks

    def ring(self, sending: bool) -> _Ring:
        return self.st.rings[sending]

    def ctl(self, ch: _Channel) -> _Ctl:
        return _ctl(ch, self.dev)

    def on(self, stream):
        return _On(stream, self.main)

    def xs_after_main(self) -> None:
        """The posting stream waits for everything on the current stream so far."""
        ev = self.st.ev_main
        ev.record(self.main)
        self.xs.wait_event(ev)

    def post(self, ops, key=None):
        """Post one group from the current stream (the posting stream); with graphs on
        (``KVCORE_P2P_GRAPH=1``) and a ``key`` (the group's operations, see :class:`_Program`),
        replay its captured graph instead."""
        if key is not None and p2p_graph.enabled():
            wg = self.g.graphs.get(self.dev.index)
            if wg is None:
                wg = self.g.graphs[self.dev.index] = WireGraphs()
            w = wg.post((self.gpeer, self.tag, key), lambda: self._post(ops))
            if w is not None:
                return w
        return self._post(ops)

    def _post(self, ops):
        return _coalesced(self.g, self.pg, self.dev, self.gpeer, ops, self.tag)

    def after(self, work) -> None:
        work.wait()  # the current stream waits for the NCCL group (the host does not)

    def wait_event(self, stream, ev) -> None:
        if ev is not None:
            stream.wait_event(ev)

    def record(self, ev, stream) -> None:
        ev.record(stream)

    def event(self):
        return torch.cuda.Event()

    def keep(self, f: _InFlight) -> None:
        self.st.inflight.append(f)


class _EmuEngine:
    """The GPU engine's fast path on the CPU (tests): the same messages and kernels, posted
    one by one to Gloo, every wait on the host."""

    emulated = True
    _rings: dict = {}

    def __init__(self, g, pg, peer, tag, tmo, sending):
        self.pg, self.peer, self.tag, self.tmo = pg, peer, tag, tmo
        self.main = self.xs = self.ks = None

    def ring(self, sending: bool) -> _Ring:
        r = _EmuEngine._rings.get(sending)
        if r is None:
            r = _EmuEngine._rings[sending] = _Ring(torch.device("cpu"))
        return r

    def ctl(self, ch: _Channel) -> _Ctl:
        return _ctl(ch, _CPU)  # every message of a call is waited for in the call: reuse is safe

    def on(self, stream):
        return contextlib.nullcontext()

    def xs_after_main(self) -> None:
        pass

    def post(self, ops, key=None):
        return _Works([_post(snd, t, self.peer, self.pg, self.tag) for snd, t in ops], self.tmo)

    def after(self, work) -> None:
        work.wait()

    def wait_event(self, stream, ev) -> None:
        pass

    def record(self, ev, stream) -> None:
        pass

    def event(self):
        return _NoEvent()

    def keep(self, f: _InFlight) -> None:
        pass


def _dev_engine(ch: _Channel, wdev, g, pg, peer, tag, tmo) -> _DevEngine:
    """The channel's GPU engine, made current (the current stream and the timeout of this call)."""
    e = ch.eng
    if e is None or e.pg is not pg or e.g is not g or e.dev != wdev:
        e = ch.eng = _DevEngine(wdev, g, pg, peer, tag, tmo)
        return e
    e.main = torch.cuda.current_stream(wdev)
    e.tmo = tmo
    return e


def _emulate() -> bool:
    """``KVCORE_P2P_EMULATE=1``: run the GPU engine's fast path on the CPU over Gloo (the same
    messages, the native CPU control functions and gated kernels, host waits): for tests."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(b"KVCORE_P2P_EMULATE") == b"1"
    return os.environ.get("KVCORE_P2P_EMULATE", "") == "1"


def _surface(device: torch.device, block: bool = False) -> None:
    """Raise what earlier GPU transfers on ``device`` left: a refusal found on the device,
    or a transfer past its deadline. ``block``: wait for every transfer in flight (with its
    deadline)."""
    st = _CUDA.get(device.index if device.index is not None else torch.cuda.current_device())
    if st is not None:
        q = st.inflight
        while q:
            f = q[0]
            pending = [(w, i, a, b) for (w, i, a, b) in f.works if not _done(w)]
            if not pending:
                q.popleft()
                continue
            if not block and time.monotonic() <= f.deadline:
                break
            w, i, a, b = pending[0]
            try:
                _poll(w, max(0.0, f.deadline - time.monotonic()) + 1e-3)
                f.works = [x for x in f.works if x[0] is not w]
                continue
            except _PeerLost as e:
                q.clear()
                raise _lost_error(f, i, a, b, e.reason) from None
    msg = _take_device_error()
    if msg:
        raise TransferError(msg)


def _take_device_error() -> str:
    return native.take_device_error()


def _lost_error(f: _InFlight, i: int, a: int, b: int, reason: str) -> TransferError:
    if f.sending:
        part = f"chunk {i} of {f.chunks} (token rows {a}..{b - 1}) was not delivered" if i >= 0 else "the answer did not arrive"
        return TransferError(
            f"{f.what}: {part}: {reason}. The receiver's slots for token rows {max(a, 0)}..{f.tokens - 1} were not written by this "
            "transfer; destroy and re-create the process group before the next transfer"
        )
    if i < 0:
        return TransferError(f"{f.what}: the last message was not delivered: {reason}; every chunk was landed")
    slots = "unknown"
    if f.slots is not None and not f.slots.is_cuda:
        slots = _slot_list(f.slots[a:b])
    elif f.slots is not None:
        # a side stream: the current stream may wait behind the lost chunk
        with torch.cuda.stream(torch.cuda.Stream(f.slots.device)):
            slots = _slot_list(f.slots[a:b].cpu())
    landed = f"chunks 0..{i - 1} (rows 0..{a - 1}) were landed; " if i else "no chunk was landed; "
    return TransferError(
        f"{f.what}: chunk {i} of {f.chunks} (rows {a}..{b - 1}) did not arrive: {reason}. Destination slots {slots} (that chunk) "
        f"were not written, nor the slots of rows {b}..{f.tokens - 1}; {landed}nothing else was touched. Destroy and re-create the "
        "process group before the next transfer"
    )


def _drain(device=None) -> None:
    """:func:`kvcore.synchronize`'s part: wait for the GPU transfers in flight (deadlines
    enforced) and raise what they left."""
    if not _CUDA:
        return
    devs = list(_CUDA.values()) if device is None else [_cuda(torch.device(device))]
    for st in devs:
        _surface(st.device, block=True)
