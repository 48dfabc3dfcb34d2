"""CUDA-graph replay of the point-to-point groups of ``kvcore.send`` / ``kvcore.recv``'s fast path.

A fast transfer (``kvcore/distributed.py``) posts, per chunk, one group of point-to-point
operations whose tensors are fixed by the agreement: the channel's control buffers and the
staging chunks, reused call after call. Posting that group through torch's ProcessGroupNCCL
costs tens of µs of host time per call (its per-operation bookkeeping: stream syncs, work
objects, the watchdog queue); the group itself makes no host decision. So the first time a
group with given tensors (direction, address, bytes of each operation) is posted, it is
captured in a CUDA graph on the posting stream, and every later call with the same tensors
replays the graph: one graph launch instead of the backend's bookkeeping. NCCL supports
capturing its point-to-point groups since 2.9 (NCCL user guide, "Using NCCL with CUDA
Graphs"), and ProcessGroupNCCL leaves captured groups out of its watchdog queue
(``ProcessGroupNCCL::endCoalescing``, torch 2.x).

The replay moves whatever the tensors hold when it runs, exactly as the eager group would;
graphs are keyed by the addresses they move, so a graph is replayed only for the tensors it
was captured on. A capture that fails (a backend or NCCL that cannot be captured) turns
graphs off for this cache: the group is posted eagerly, now and afterwards. Captured groups
are not watched by the backend's watchdog: kvcore's own deadlines (``_surface`` in
``kvcore/distributed.py``) still apply.

On or off per process with ``KVCORE_P2P_GRAPH`` (``1`` on; default off until measured on two
GPUs: docs/benchmarks.md).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

import torch

__all__ = ["EventWork", "WireGraphs", "enabled"]


_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None  # ~0.1 us a read, not os.environ's ~1 us


def enabled() -> bool:
    """Whether fast transfers replay their groups from CUDA graphs (``KVCORE_P2P_GRAPH=1``)."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(b"KVCORE_P2P_GRAPH") == b"1"
    return os.environ.get("KVCORE_P2P_GRAPH", "") == "1"


class EventWork:
    """A replayed group's completion: an event recorded on the posting stream after the replay
    (the interface kvcore uses of a backend's work: ``is_completed`` polls, ``wait`` orders
    the current stream after it)."""

    __slots__ = ("ev", "_kvcore_poll")

    def __init__(self, ev: torch.cuda.Event):
        self.ev = ev
        self._kvcore_poll = True

    def is_completed(self) -> bool:
        return self.ev.query()

    def wait(self, *a) -> bool:
        torch.cuda.current_stream().wait_event(self.ev)
        return True


class WireGraphs:
    """The captured groups of one device, keyed by the operations they move.

    ``post(key, post_eager)`` replays the graph of ``key`` on the current stream and returns
    an :class:`EventWork`; the first time, ``post_eager()`` (which posts the group and returns
    the backend's work) is called under capture. Returns None when graphs are off here (a
    capture failed): the caller posts eagerly.
    """

    def __init__(self, limit: int = 64):
        self.graphs: OrderedDict = OrderedDict()
        self.limit = limit
        self.failed: str | None = None  # why a capture failed: graphs are off for this device
        self.captures = 0
        self.replays = 0
        self._pool = None

    def clear(self) -> None:
        self.graphs.clear()

    def post(self, key, post_eager: Callable[[], object]) -> EventWork | None:
        g = self.graphs.get(key)
        if g is None:
            if self.failed is not None:
                return None
            g = self._capture(post_eager)
            if g is None:
                return None
            self.graphs[key] = g
            while len(self.graphs) > self.limit:
                self.graphs.popitem(last=False)
        stream = torch.cuda.current_stream()
        g.replay()
        self.replays += 1
        ev = torch.cuda.Event()
        ev.record(stream)
        return EventWork(ev)

    def _capture(self, post_eager) -> torch.cuda.CUDAGraph | None:
        """``post_eager`` captured on the current stream (which must not be the legacy default
        stream), or None (and graphs off) when the backend cannot be captured."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        try:
            g.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        except RuntimeError as e:
            self.failed = f"capture_begin: {e}"
            return None
        try:
            work = post_eager()
            if work is not None:
                work.wait()  # joins the backend's stream back into the capture
        except Exception as e:  # noqa: BLE001 - any failure turns graphs off; the group is posted eagerly
            self.failed = f"{type(e).__name__}: {str(e)[:300]}"
            try:
                g.capture_end()
            except RuntimeError:
                pass
            return None
        try:
            g.capture_end()
        except RuntimeError as e:
            self.failed = f"capture_end: {str(e)[:300]}"
            return None
        self.captures += 1
        return g
