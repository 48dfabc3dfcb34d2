"""Small transfers (a few tokens of every layer, as an offloading connector makes per step):
the public API, the kernel entry and a per-layer torch baseline."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

import kvcore
from kvcore import kernels
from kvcore.bench.cases import CASES, _payload_per_token, _setup, block_slots, random_fill
from kvcore.bench.stats import _us_span, baseline_spread, too_noisy
from kvcore.bench.timing import _sample_times
from kvcore.kernels import TransferPlan


@dataclass
class SmallRow:
    """A small transfer (a few tokens of every layer, as an offloading connector makes per
    step): the public API, the kernel entry and a per-layer torch baseline, µs per call."""

    device: str
    layout: str
    tokens: int
    num_blocks: int
    direction: str
    mbytes: float
    public_us: float
    kernel_us: float
    baseline: str
    baseline_us: float
    public_vs_baseline: float  # public time / baseline time (target on CPU: <= 1.5)
    threads: int
    public_us_range: tuple[float, float] | None = None  # lowest and highest over the repeats
    kernel_us_range: tuple[float, float] | None = None
    baseline_us_range: tuple[float, float] | None = None
    baseline_spread: float | None = None  # the baseline's interquartile range / median (baseline_spread)
    baseline_noisy: bool | None = None  # baseline_spread above NOISE_LIMIT: public / baseline is not to be trusted
    repeats: int | None = None  # samples behind each median and range


def bench_small(
    device: torch.device, *, tokens: int = 16, num_blocks: int = 64, repeats: int = 7, calls: int | None = None
) -> list[SmallRow]:
    """Llama-3-8B NHD (32 layers, 8 KV heads, head size 128, bf16, block 16): ``tokens``
    tokens gathered and scattered through ``kvcore.gather`` / ``kvcore.scatter`` (validation
    on), through the kernel entry, and through a per-layer ``index_select`` /
    ``index_copy_`` of the same rows (one torch call per layer over its ``[2, slots, NH*HS]``
    view), in one run, the functions taking turns."""
    case = CASES["NHD"]
    bs = 16
    layout, table, new_staging = _setup(case, bs, num_blocks, device)
    gen = torch.Generator(device="cpu").manual_seed(3)
    slots = block_slots(tokens, bs, torch.randperm(num_blocks, generator=gen)[: -(-tokens // bs)]).to(device)
    out = new_staging(tokens, device)
    plan = TransferPlan(table=table, slots=slots, staging=out, num_valid=tokens)
    kernel = kernels.select_kernel(device.type, case.format, device.type, table)
    views = [c.view(2, num_blocks * bs, case.num_heads * case.head_size) for c in layout.kv_caches]
    per_layer = torch.empty(case.num_layers, 2, tokens, case.num_heads * case.head_size, dtype=case.dtype, device=device)
    random_fill(per_layer)

    def sel(i):
        for li, v in enumerate(views):
            torch.index_select(v, 1, slots, out=per_layer[li])

    def cpy(i):
        for li, v in enumerate(views):
            v.index_copy_(1, slots, per_layer[li])

    fns = {
        "pub-gather": lambda i: kvcore.gather(layout, slots, out),
        "pub-scatter": lambda i: kvcore.scatter(layout, slots, out),
        "gather": lambda i: kernel.gather(plan),
        "scatter": lambda i: kernel.scatter(plan),
        "index_select": sel,
        "index_copy_": cpy,
    }
    n = calls or (200 if device.type == "cuda" else 50)
    samples = _sample_times(fns, device, repeats, n)
    tm = {k: statistics.median(v) for k, v in samples.items()}
    mb = _payload_per_token(case) * tokens / 1e6
    rows = []
    for d, base in (("gather", "index_select"), ("scatter", "index_copy_")):
        rows.append(
            SmallRow(
                device=device.type,
                layout=case.label,
                tokens=tokens,
                num_blocks=num_blocks,
                direction=d,
                mbytes=mb,
                public_us=tm["pub-" + d] * 1e6,
                kernel_us=tm[d] * 1e6,
                baseline=f"per-layer {base}",
                baseline_us=tm[base] * 1e6,
                public_vs_baseline=tm["pub-" + d] / tm[base],
                threads=torch.get_num_threads(),
                public_us_range=_us_span(samples["pub-" + d]),
                kernel_us_range=_us_span(samples[d]),
                baseline_us_range=_us_span(samples[base]),
                baseline_spread=baseline_spread(samples[base]),
                baseline_noisy=too_noisy(baseline_spread(samples[base])),
                repeats=repeats,
            )
        )
    return rows
