"""Staging chunks reused across calls: two per device and direction (``release_staging``
frees them)."""

from __future__ import annotations

import torch


class _Ring:
    """Two staging chunks of one device and direction, reused across calls. Per chunk:
    the NCCL work that last read or wrote it and the event after the kernel that last
    unpacked it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cap = 0
        self.bufs: list[torch.Tensor] = []
        self.work: list = [None, None]
        self.free: list = [None, None]
        self.k = 0
        self.retired: list = []
        self.gen = 0  # bumped whenever the buffers change: precomputed slices of them are stale

    def ensure(self, nbytes: int) -> None:
        if self.retired:
            self.retired = [r for r in self.retired if not _done_all(r)]
        if nbytes <= self.cap:
            return
        if self.bufs:
            self.retired.append((self.bufs, self.work, self.free))
        self.cap = nbytes
        self.gen += 1
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.work = [None, None]
        self.free = [None, None]
        if self.device.type == "cuda":
            # the NCCL stream does not wait for the current stream: the memory's earlier users
            # there (the caching allocator's stream) must be done
            torch.cuda.current_stream(self.device).synchronize()

    def next(self) -> int:
        k = self.k
        self.k ^= 1
        return k


def _done_all(r) -> bool:
    _, works, events = r
    return all(w is None or _done(w) for w in works) and all(e is None or e.query() for e in events)


def _done(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:
        return True


_HOST_RINGS: dict = {}


class _HostRing:
    def __init__(self, pin: bool):
        self.pin = pin
        self.cap = 0
        self.bufs: list[torch.Tensor] = []

    def ensure(self, nbytes: int) -> None:
        if nbytes > self.cap:
            self.cap = nbytes
            self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin) for _ in range(2)]
        self.work = [None, None]


def _host_ring(sending: bool, wdev, pin: bool = False) -> _HostRing:
    key = (sending, pin)
    r = _HOST_RINGS.get(key)
    if r is None:
        r = _HOST_RINGS[key] = _HostRing(pin)
    return r
