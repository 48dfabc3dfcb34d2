"""Point-to-point messages on ``torch.distributed``: posting (module-level, so tests can
interpose ``_isend`` / ``_irecv``), coalesced NCCL groups, and waiting with a deadline."""

from __future__ import annotations

import datetime
import os
import time

import torch

from kvcore.distributed.channels import _Group
from kvcore.errors import TransferError

_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _timeout(timeout) -> float:
    if timeout is None:
        if _ENV_DATA is not None and b"KVCORE_P2P_TIMEOUT" not in _ENV_DATA:
            return 300.0
        env = os.environ.get("KVCORE_P2P_TIMEOUT", "").strip()
        try:
            return float(env) if env else 300.0
        except ValueError:
            raise TransferError(f"KVCORE_P2P_TIMEOUT must be a number of seconds, got {env!r}") from None
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise TransferError(f"timeout must be a positive number of seconds (or a timedelta), got {timeout!r}")
    return float(timeout)


def _isend(tensor: torch.Tensor, peer: int, group, tag: int):
    import torch.distributed as dist

    return dist.isend(tensor, peer, group=group, tag=tag)


def _irecv(tensor: torch.Tensor, peer: int, group, tag: int):
    import torch.distributed as dist

    return dist.irecv(tensor, peer, group=group, tag=tag)


class _FailedWork:
    """An operation the backend refused to post (the peer's connection is already gone)."""

    _kvcore_poll = True

    def __init__(self, msg: str):
        self.msg = msg

    def is_completed(self) -> bool:
        return True

    def wait(self, *a) -> None:
        raise RuntimeError(self.msg)


def _post(send: bool, tensor: torch.Tensor, peer: int, group, tag: int):
    try:
        work = (_isend if send else _irecv)(tensor, peer, group, tag)
    except RuntimeError as e:
        return _FailedWork(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    if work is not None and tensor.is_cuda:
        try:
            work._kvcore_poll = True  # NCCL: completion is a CUDA event, polled without blocking
        except AttributeError:
            return _Polled(work)
    return work


class _Polled:
    """A work whose completion is polled (when the backend's Work takes no attributes)."""

    _kvcore_poll = True

    def __init__(self, work):
        self.work = work

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, *a) -> None:
        self.work.wait(*a)


class _PeerLost(Exception):
    """A message did not complete: ``reason`` says how (timeout or the backend's error)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _wait(work, timeout: float) -> None:
    """Wait for ``work`` with a deadline; the backend's own error, if any, is raised as
    :class:`_PeerLost`. NCCL works answer ``is_completed`` (a CUDA event query): they are
    polled, so that a lost peer cannot hang the host. Other backends' point-to-point works
    (Gloo) complete only inside ``wait``, which takes the deadline itself."""
    if work is None:
        return
    if not getattr(work, "_kvcore_poll", False):
        try:
            work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise _PeerLost(_reason(e, timeout)) from None
        return
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        try:
            done = work.is_completed()
        except RuntimeError as e:  # the backend reports a failed operation
            raise _PeerLost(_reason(e, timeout)) from None
        if done:
            try:
                work.wait()
            except RuntimeError as e:
                raise _PeerLost(_reason(e, timeout)) from None
            return
        if time.monotonic() > deadline:
            raise _PeerLost(f"nothing arrived within {timeout:g} s")
        if pause:
            time.sleep(pause)
        pause = min(0.001, pause * 2 if pause else 1e-5)


def _poll(work, timeout: float) -> None:
    """Wait on the host for a GPU work (polled: a NCCL work's ``wait`` only orders streams)."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        try:
            if work.is_completed():
                return
        except RuntimeError as e:
            raise _PeerLost(_reason(e, timeout)) from None
        if time.monotonic() > deadline:
            raise _PeerLost(f"nothing arrived within {timeout:g} s")
        if pause:
            time.sleep(pause)
        pause = min(0.001, pause * 2 if pause else 1e-5)


def _reason(e: BaseException, timeout: float) -> str:
    text = " ".join(str(e).split())
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"nothing arrived within {timeout:g} s ({text[:200]})"
    return f"the connection failed ({text[:300]})"


class _Works:
    """Several works as one (a batch posted op by op). With ``timeout`` (host waits,
    emulation) ``wait`` blocks with that deadline and raises :class:`_PeerLost`."""

    def __init__(self, works, timeout: float | None = None):
        self.works = [w for w in works if w is not None]
        self.timeout = timeout
        self.done = False

    def wait(self, *a):
        if self.timeout is None:
            for w in self.works:
                w.wait()
            return
        if not self.done:
            for w in self.works:
                _wait(w, self.timeout)
            self.done = True

    def is_completed(self) -> bool:
        if self.timeout is not None:
            return self.done
        return all(w.is_completed() for w in self.works)


def _coalesced(g: _Group, pg, device, gpeer: int, ops, tag: int):
    """Post ``ops`` ((send?, tensor), ...) to the peer as one NCCL group; one work."""
    if g.coalesce:
        pg._start_coalescing(device)
        try:
            for send, t in ops:
                (pg.send if send else pg.recv)([t], gpeer, tag)
        finally:
            work = pg._end_coalescing(device)
        return work
    import torch.distributed as dist

    peer = g.ranks[gpeer]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if s else dist.irecv, t, peer, group=pg, tag=tag) for s, t in ops])
    return _Works(works)


def _exchange(g, pg, peer, wdev, ops, tag, tmo) -> None:
    """Post ``ops`` and wait for them on the host (the slow path)."""
    if wdev.type == "cuda":
        work = _coalesced(g, pg, wdev, g.index[peer], ops, tag)
        try:
            work._kvcore_poll = True
        except AttributeError:
            work = _Polled(work)
        _wait(work, tmo)
        return
    works = [_post(snd, t, peer, pg, tag) for snd, t in ops]
    for w in works:
        _wait(w, tmo)
