"""Timing: seconds per call of several functions taking turns within every repeat (the
wall clock, the process's CPU clock, CUDA events, CUDA graph replay)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _timer(device: torch.device, calls: int, clock: str = "wall") -> Callable[[Callable[[int], None]], float]:
    """Returns ``time(fn)``: the seconds of one call of ``fn(i)``, over ``calls`` calls.
    ``clock="cpu"`` (CPU device): the process's CPU seconds (every thread's), not wall time:
    on a shared host a preempted call is not charged for the time it did not run."""
    if device.type == "cuda":

        def t_cuda(fn: Callable[[int], None]) -> float:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(calls):
                fn(i)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / calls

        return t_cuda

    now = time.process_time if clock == "cpu" else time.perf_counter

    def t_cpu(fn: Callable[[int], None]) -> float:
        t0 = now()
        for i in range(calls):
            fn(i)
        return (now() - t0) / calls

    return t_cpu


def _median_time(fn: Callable[[int], None], device: torch.device, repeats: int, calls: int) -> float:
    return _median_times({"x": fn}, device, repeats, calls)["x"]


def _median_times(fns: dict[str, Callable[[int], None]], device: torch.device, repeats: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each function; the functions take turns within every
    repeat, so a machine whose speed drifts (other load, clocks) affects them alike."""
    return {k: statistics.median(v) for k, v in _sample_times(fns, device, repeats, calls).items()}


def _sample_times(
    fns: dict[str, Callable[[int], None]], device: torch.device, repeats: int, calls: int, clock: str = "wall"
) -> dict[str, list[float]]:
    """Seconds per call of each function in every repeat (``repeats`` samples each, the
    functions taking turns within a repeat: sample ``i`` of two functions ran back to back)."""
    timer = _timer(device, calls, clock)
    for fn in fns.values():
        fn(0)  # warm-up (also builds the native library, uploads pointer tables)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k].append(timer(fn))
    return samples


def _graph_times(fns: dict[str, Callable[[int], None]], device: torch.device, repeats: int, calls: int) -> dict[str, float]:
    """Median seconds per call when ``calls`` calls are captured in one CUDA graph and
    replayed: the device time without the host's launch overhead (METHOD: many small
    launches). Functions that cannot be captured are left out."""
    graphs = {}
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for fn in fns.values():
            fn(0)
    torch.cuda.current_stream(device).wait_stream(side)
    for k, fn in fns.items():
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                for i in range(calls):
                    fn(i)
        except Exception:  # noqa: BLE001 - a path that syncs cannot be captured; it is timed eagerly
            continue
        graphs[k] = g
    out: dict[str, list[float]] = {k: [] for k in graphs}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for k, g in graphs.items():
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            out[k].append(a.elapsed_time(b) / 1e3 / calls)
    return {k: statistics.median(v) for k, v in out.items()}
