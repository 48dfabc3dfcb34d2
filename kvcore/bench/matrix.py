"""One case of the matrix: a layout at a block size and token count, both directions,
against a same-run copy (and on CUDA pinned host rows against a pinned memcpy)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kvcore
from kvcore import kernels
from kvcore.bench.cases import _L2_ROTATE_BYTES, Case, _payload_per_token, _pinned, _pinned_like, _setup, block_slots, random_fill
from kvcore.bench.stats import _gbps_span, _ratio_span, _spreads
from kvcore.bench.timing import _graph_times, _median_times, _sample_times
from kvcore.kernels import TransferPlan
from kvcore.kernels.reference import REFERENCE


@dataclass
class Row:
    device: str
    layout: str
    format: str
    dtype: str
    block_size: int
    tokens: int
    direction: str
    staging: str  # "device" or "pinned"
    kernel: str
    mbytes: float  # payload bytes (one copy), MB
    seconds: float
    gbps: float
    baseline: str
    baseline_gbps: float
    vs_copy: float
    reference_gbps: float | None
    vs_reference: float | None
    graph_seconds: float | None = None  # cuda device rows: per call, replaying a captured CUDA graph
    graph_gbps: float | None = None
    graph_vs_copy: float | None = None  # against the eager copy (a copy captured in a graph becomes a DMA node: slower)
    graph_copy_seconds: float | None = None
    public_seconds: float | None = None  # kvcore.gather / kvcore.scatter per call (validate default), same run
    public_vs_kernel: float | None = None  # public time / kernel-entry time (1.00 = no overhead)
    public_graph_seconds: float | None = None  # cuda: the public call captured in a CUDA graph, per call
    clock: str = "wall"  # CPU rows: "wall" seconds, or "cpu" (the process's CPU seconds, every thread)
    slots: str = "blocks"  # the slot mapping: "blocks" (whole blocks in random order) or "random" (a random permutation of slots)
    gbps_range: tuple[float, float] | None = None  # kernel GB/s, lowest and highest over the repeats
    vs_copy_range: tuple[float, float] | None = None  # per repeat: copy time / kernel time of that repeat (they ran back to back)
    public_vs_copy: float | None = None  # the public call against the same-run copy (median copy time / median public time)
    public_vs_copy_range: tuple[float, float] | None = None  # per repeat, as vs_copy_range
    baseline_gbps_range: tuple[float, float] | None = None  # the baseline's GB/s, lowest and highest over the repeats
    baseline_spread: float | None = None  # the baseline's interquartile range / median over the repeats (baseline_spread)
    baseline_noisy: bool | None = None  # baseline_spread above NOISE_LIMIT: the ratios to the baseline are not to be trusted
    reference_gbps_range: tuple[float, float] | None = None  # the reference kernel's GB/s, lowest and highest
    public_seconds_range: tuple[float, float] | None = None  # the public call's seconds, lowest and highest
    repeats: int | None = None  # samples behind each median and range


def _kernels(device: torch.device):
    return REFERENCE, kernels.select_kernel


def bench_case(
    case: Case,
    block_size: int,
    tokens: int,
    device: torch.device,
    *,
    repeats: int,
    with_reference: bool,
    host: bool,
    host_reference: bool = True,
    seed: int = 0,
    sample_bytes: float = 400e6,
    slots: str = "blocks",
    clock: str = "wall",
) -> list[Row]:
    """Benchmark one layout/geometry; returns the rows (both directions, and the pinned
    host rows when ``host``). On CPU one timed sample repeats the call until about
    ``sample_bytes`` bytes moved (at most 20 calls): ~100 ms by default, less for
    ``--quick``. ``slots``: ``"blocks"`` (whole blocks in random order, a request's
    consecutive slots) or ``"random"`` (a random permutation of the pool's slots).
    ``clock``: ``"wall"``, or ``"cpu"`` (CPU device: the process's CPU seconds, see
    :func:`_timer`)."""
    reference, select_kernel = _kernels(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    payload_token = _payload_per_token(case)
    payload = payload_token * tokens
    nblk = -(-tokens // block_size)
    sets = max(1, min(8, math.ceil(_L2_ROTATE_BYTES / payload))) if device.type == "cuda" else 1
    num_blocks = (sets + 1) * nblk
    layout, table, new_staging = _setup(case, block_size, num_blocks, device)
    if slots == "random":  # disjoint sets: consecutive pieces of one permutation of every slot
        perm = torch.randperm(num_blocks * block_size, generator=gen)
        slot_sets = [perm[i * tokens : (i + 1) * tokens].contiguous().to(device) for i in range(sets)]
    else:
        perm = torch.randperm(num_blocks, generator=gen)
        slot_sets = [block_slots(tokens, block_size, perm[i * nblk : (i + 1) * nblk]).to(device) for i in range(sets)]
    staging = [new_staging(tokens, device) for _ in range(sets)]
    plans = [TransferPlan(table=table, slots=slot_sets[i], staging=staging[i], num_valid=tokens) for i in range(sets)]
    kernel = kernels.select_kernel(device.type, case.format, device.type, table)
    # CPU: enough calls that one sample lasts ~100 ms, so a preempted thread is a small error
    calls = 20 if device.type == "cuda" else max(1, min(20, int(sample_bytes // (2 * payload))))
    src = [torch.empty(payload, dtype=torch.uint8, device=device) for _ in range(sets)]
    for s in src:
        random_fill(s)
    dst = [torch.empty(payload, dtype=torch.uint8, device=device) for _ in range(sets)]

    fns: dict[str, Callable[[int], None]] = {"copy": lambda i: dst[i % sets].copy_(src[i % sets])}
    for d in ("gather", "scatter"):
        fns[d] = lambda i, d=d: getattr(kernel, d)(plans[i % sets])
        if layout is not None:  # the public API, as a user calls it (validation on, the default)
            fns["pub-" + d] = lambda i, d=d: getattr(kvcore, d)(layout, slot_sets[i % sets], staging[i % sets])
        if with_reference and kernel is not reference:
            fns["ref-" + d] = lambda i, d=d: getattr(reference, d)(plans[i % sets])
    samples = _sample_times(fns, device, repeats, calls, clock if device.type == "cpu" else "wall")
    tm = {k: statistics.median(v) for k, v in samples.items()}
    copy_s = tm["copy"]

    def ratio_range(key: str) -> tuple[float, float] | None:
        return _ratio_span(samples, "copy", key)

    gt: dict[str, float] = {}
    if device.type == "cuda" and kernel is not reference:
        gt = _graph_times(
            {k: fns[k] for k in ("copy", "gather", "scatter", "pub-gather", "pub-scatter") if k in fns}, device, repeats, calls
        )
    rows = []
    what = dict(layout=case.label, format=case.format, dtype=str(case.dtype).replace("torch.", ""), block_size=block_size, tokens=tokens)
    what.update(mbytes=payload / 1e6, slots=slots)  # every row of the case
    for direction in ("gather", "scatter"):
        sec = tm[direction]
        ref_s = tm.get("ref-" + direction, sec if kernel is reference else None)
        rows.append(
            Row(
                **what,
                device=str(device.type),
                direction=direction,
                staging="device",
                kernel=kernel.name,
                seconds=sec,
                gbps=2 * payload / sec / 1e9,
                baseline="copy",
                baseline_gbps=2 * payload / copy_s / 1e9,
                vs_copy=copy_s / sec,
                reference_gbps=None if ref_s is None else 2 * payload / ref_s / 1e9,
                vs_reference=None if ref_s is None else ref_s / sec,
                graph_seconds=gt.get(direction),
                graph_gbps=2 * payload / gt[direction] / 1e9 if direction in gt else None,
                graph_vs_copy=copy_s / gt[direction] if direction in gt else None,
                graph_copy_seconds=gt.get("copy"),
                public_seconds=tm.get("pub-" + direction),
                public_vs_kernel=tm["pub-" + direction] / sec if "pub-" + direction in tm else None,
                public_graph_seconds=gt.get("pub-" + direction),
                clock=clock if device.type == "cpu" else "wall",
                gbps_range=_gbps_span(2 * payload, samples[direction]),
                vs_copy_range=ratio_range(direction),
                public_vs_copy=copy_s / tm["pub-" + direction] if "pub-" + direction in tm else None,
                public_vs_copy_range=ratio_range("pub-" + direction),
                **_spreads(samples, "copy", direction, 2 * payload, reference=kernel is reference),
            )
        )
    if host and device.type == "cuda":
        hstage = _pinned_like(staging[0], payload)
        hplan = TransferPlan(table=table, slots=slot_sets[0], staging=hstage, num_valid=tokens)
        hk = kernels.select_kernel(device.type, case.format, "cpu", table)
        hbuf = _pinned("memcpy", payload)
        dbuf = src[0]
        hcalls = 3 if payload > (64 << 20) else 10
        hfns = {
            "d2h": lambda i: hbuf.copy_(dbuf, non_blocking=True),
            "h2d": lambda i: dbuf.copy_(hbuf, non_blocking=True),
            "gather": lambda i: hk.gather(hplan),
            "scatter": lambda i: hk.scatter(hplan),
        }
        if layout is not None:
            hfns["pub-gather"] = lambda i: kvcore.gather(layout, slot_sets[0], hstage)
            hfns["pub-scatter"] = lambda i: kvcore.scatter(layout, slot_sets[0], hstage)
        hsamples = _sample_times(hfns, device, repeats, hcalls)
        tm = {k: statistics.median(v) for k, v in hsamples.items()}
        d2h, h2d = tm["d2h"], tm["h2d"]
        tref = {}
        if with_reference and host_reference:
            tref = _median_times({d: (lambda i, d=d: getattr(reference, d)(hplan)) for d in ("gather", "scatter")}, device, 1, 1)
        for direction, base, base_s in (("gather", "d2h", d2h), ("scatter", "h2d", h2d)):
            sec = tm[direction]
            ref_s = tref.get(direction)
            rows.append(
                Row(
                    **what,
                    device="cuda",
                    direction=direction,
                    staging="pinned",
                    kernel=hk.name,
                    seconds=sec,
                    gbps=payload / sec / 1e9,
                    baseline="pinned memcpy " + ("D2H" if direction == "gather" else "H2D"),
                    baseline_gbps=payload / base_s / 1e9,
                    vs_copy=base_s / sec,
                    reference_gbps=None if ref_s is None else payload / ref_s / 1e9,
                    vs_reference=None if ref_s is None else ref_s / sec,
                    public_seconds=tm.get("pub-" + direction),
                    public_vs_kernel=tm["pub-" + direction] / sec if "pub-" + direction in tm else None,
                    gbps_range=_gbps_span(payload, hsamples[direction]),
                    vs_copy_range=_ratio_span(hsamples, base, direction),
                    **_spreads(hsamples, base, direction, payload),
                )
            )
    return rows
