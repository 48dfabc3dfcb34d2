"""``kvcore bench``: transfer benchmarks of the native and reference kernels.

For each layout × geometry × block size × token count, in both directions (gather:
paged cache → staging; scatter: staging → paged cache), it reports:

- GB/s, counting bytes read **plus** bytes written (device memory traffic), for the
  kernel that serves the device (native when built, else the reference);
- the ratio to a plain contiguous copy of the same number of bytes (``torch.Tensor.copy_``
  between two contiguous buffers), measured in the same run;
- the ratio to the torch reference kernel.

With ``--device cuda`` it adds the host rows: gather straight into pinned host memory and
scatter straight from it (no GPU staging buffer), against one large pinned ``copy_`` of
the same bytes in the same direction (GB/s there count the bytes crossing the link once).

Spread and noise: each figure is the median of ``--repeats`` samples, shown with the lowest
and highest (``median (low–high)``; JSON: ``*_range``). The same-run baseline's own spread,
its interquartile range over its median (``baseline_spread``), says whether the ratios to it
can be trusted: above :data:`NOISE_LIMIT` the row is ``noisy``, its ratios are marked ``*``,
and the run says so under the table, on stderr and in the JSON (``baseline_noisy``,
``meta.noise``).

Timing: medians of repeated runs (``--repeats``), after a warm-up; CUDA runs are timed
with CUDA events around a batch of back-to-back calls, so host work per call (argument
preparation, the op dispatch) is included whenever it is slower than the GPU. Small
transfers rotate among several disjoint slot mappings and staging buffers so that the
working set exceeds the GPU's L2 (the copy baseline rotates the same way). The slot
mapping is whole blocks in random order, as an engine hands out blocks. Cache contents
are random bytes. Validation in :func:`kvcore.gather` (one slot-range reduction) is not
timed: the kernels receive an already validated :class:`~kvcore.kernels.TransferPlan`.

Geometries (the shapes LMCache's own kernel tests and harness use: ``tests/v1/`` and
``benchmarks/``, LMCache 0.5.6):
Llama-3-8B per tensor-parallel rank, 32 layers × 8 KV heads × head size 128, bf16;
DeepSeek MLA latent, 61 layers × head size 576 (bf16, and fp8 e4m3 stored as uint8).
Layouts by grammar name (the core names no engine): NHD ``NL_X_TWO_NB_BS_NH_HS``, HND
``NL_X_TWO_NB_NH_BS_HS``, FlashInfer ``NL_X_NB_TWO_BS_NH_HS``, MLA ``NL_X_NB_BS_HS``.

The package, one job a module (imports flow down this list)::

    cases      the benchmarked layouts (CASES) and the allocation of their caches and slots
    timing     seconds per call of functions taking turns (wall, CPU clock, CUDA events, graphs)
    stats      each figure's spread, and whether a same-run baseline was too noisy to trust
    matrix     one case: Row, bench_case
    small      small transfers: SmallRow, bench_small
    report     the markdown tables
    progress   progress lines on stderr
    host       what a run records about the machine
    (here)     the command line: add_arguments, run, main
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch

# the names marked F401 were importable from kvcore.bench when it was one module, and stay so
from kvcore.bench.cases import (  # noqa: F401
    _L2_ROTATE_BYTES,
    _LLAMA,
    _MLA,
    _PINNED,
    AMX_FORMAT,
    AMX_TILES,
    BLOCK_SIZES,
    CASES,
    KT_FORMAT,
    KTILE_FORMAT,
    QUANT_FORMAT,
    TILE_TOKENS,
    TOKENS,
    Case,
    _case_bytes,
    _expand,
    _fill_staging,
    _payload_per_token,
    _pinned,
    _pinned_like,
    _setup,
    block_slots,
    make_cache,
    quantised_table,
    random_fill,
    random_slots,
    shared_planes,
)
from kvcore.bench.host import _available_bytes, _cpu_model, _loadavg, _meta  # noqa: F401
from kvcore.bench.matrix import Row, _kernels, bench_case  # noqa: F401
from kvcore.bench.progress import _Progress  # noqa: F401
from kvcore.bench.report import _cell, _spread_cell, format_small, format_table  # noqa: F401
from kvcore.bench.small import SmallRow, bench_small  # noqa: F401
from kvcore.bench.stats import (  # noqa: F401
    NOISE_LIMIT,
    _gbps_span,
    _noise_meta,
    _ratio_span,
    _spreads,
    _us_span,
    baseline_spread,
    noise_notes,
    span,
    too_noisy,
)
from kvcore.bench.timing import _graph_times, _median_time, _median_times, _sample_times, _timer  # noqa: F401
from kvcore.cli_args import OneLineParser, float_range, int_list, int_range
from kvcore.tensor_description import UsageError

__all__ = ["add_arguments", "run", "CASES", "make_cache", "random_fill", "block_slots", "Case", "quantised_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvcore bench``'s options to ``parser``."""
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="device of the cache (default: cuda when available)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small, fast matrix (seconds on an idle CPU): NHD, HND, MLA-bf16; block 16; T=256; 3 repeats of short samples; "
        "the reference kernel timed on the first case only",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    parser.add_argument("--layouts", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument(
        "--block-sizes",
        type=int_list(1, MAX_BLOCK_SIZE),
        default=None,
        help=f"comma-separated block sizes, 1..{MAX_BLOCK_SIZE} (default 16,64,256)",
    )
    parser.add_argument(
        "--tokens", type=int_list(1, MAX_TOKENS), default=None, help=f"comma-separated token counts, 1..{MAX_TOKENS} (default 256,8192)"
    )
    parser.add_argument(
        "--repeats",
        type=int_range(1, MAX_REPEATS),
        default=None,
        help=f"timed repeats per measurement, 1..{MAX_REPEATS}; the median is reported",
    )
    parser.add_argument(
        "--slots",
        choices=["blocks", "random"],
        default="blocks",
        help="the slot mapping: whole blocks in random order (a request's consecutive slots; the default) or a random "
        "permutation of the pool's slots",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="CPU rows: time by the wall clock (default) or by the process's CPU seconds (every thread's; on a shared host "
        "a call is not charged for time other processes ran; GB/s are then per CPU second)",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch reference kernel")
    parser.add_argument("--no-host", action="store_true", help="cuda: skip the pinned-host rows")
    parser.add_argument("--output", default=None, help="also write the JSON rows to this file (updated after every case)")
    parser.add_argument(
        "--max-seconds",
        type=float_range(0, 1e7),
        default=None,
        help="stop the matrix after this many seconds (partial table); a number above 0",
    )
    parser.add_argument(
        "--small",
        type=int_list(1, MAX_SMALL_TOKENS, allow_empty=True),
        default=(16,),
        help=f"token counts of the small-transfer rows, 1..{MAX_SMALL_TOKENS} (public API vs kernel vs per-layer "
        "index_select/index_copy_; '' for none)",
    )


#: bounds of the numeric options: a block of 64K tokens and 4M tokens in one transfer are far
#: beyond any engine's; what fits memory is checked per case before allocating (:func:`_fits`)
MAX_BLOCK_SIZE = 1 << 16


MAX_TOKENS = 1 << 22


MAX_REPEATS = 100_000


#: the small-transfer rows use a 64-block pool of 16 tokens (:func:`bench_small`)
MAX_SMALL_TOKENS = 64 * 16


def _ints(s: str | tuple[int, ...] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """A list option's values (already parsed by :func:`kvcore.cli_args.int_list`; a string
    from code that builds the namespace itself is parsed the same way)."""
    if s is None or s == "":
        return default
    if isinstance(s, str):
        try:
            return int_list(1, MAX_TOKENS)(s)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"bench: {e}") from None
    return tuple(s)


#: ``--quick``: a matrix that runs in seconds (on CPU, ~10x less work than the defaults:
#: T=256 only, 3 repeats, ~20 ms samples; the reference kernel timed on the first case only)
QUICK = {
    "layouts": ("NHD", "HND", "MLA-bf16"),
    "block_sizes": (16,),
    "tokens": (256,),
    "repeats": 3,
    "sample_bytes": 40e6,
    "small_calls": 10,
}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark matrix; exit code 0, or 2 for a usage error. Progress goes to
    stderr (one line per case when stderr is not a terminal), the table / JSON to stdout."""
    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_name == "cuda" and not torch.cuda.is_available():
        print("kvcore bench: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(dev_name)
    if args.quick:
        layouts = list(QUICK["layouts"])
        bss, toks = QUICK["block_sizes"], QUICK["tokens"]
    else:
        layouts = list(CASES)
        bss, toks = BLOCK_SIZES, TOKENS
    if args.layouts:
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        bad = [x for x in layouts if x not in CASES]
        if bad:
            print(f"kvcore bench: unknown layout(s) {bad}; choose from {', '.join(CASES)}", file=sys.stderr)
            return 2
    bss = _ints(args.block_sizes, bss)
    toks = _ints(args.tokens, toks)
    repeats = args.repeats or (QUICK["repeats"] if args.quick else 5)
    sample_bytes = QUICK["sample_bytes"] if args.quick else 400e6
    combos = [(CASES[lay], b, t) for lay in layouts for b in bss for t in toks]
    avail = _available_bytes(device)
    if avail is not None and combos:
        need, case, b, t = max(((_case_bytes(c, b, t, device), c, b, t) for c, b, t in combos), key=lambda x: x[0])
        if need > 0.8 * avail:
            raise UsageError(
                f"{case.label} with block size {b} and {t} tokens needs about {need / 2**30:.1f} GiB of {device.type} "
                f"memory, more than the {avail / 2**30:.1f} GiB available; give fewer --tokens (or --layouts / --block-sizes)"
            )
    rows: list[Row] = []
    meta = _meta(device)
    if args.quick:
        meta["quick"] = f"--quick: {repeats} repeats of ~{sample_bytes / 1e6:.0f} MB samples" + (
            "" if args.no_reference else "; the reference kernel timed on the first case only"
        )
    progress = _Progress(len(combos), f"{device.type}{', --quick' if args.quick else ''}, {repeats} repeats")
    if args.quick and not args.no_reference:
        progress.note("--quick: the reference kernel is timed on the first case only (other rows show '-')")
    t_start = time.monotonic()
    for i, (case, b, t) in enumerate(combos):
        if args.max_seconds and time.monotonic() - t_start > args.max_seconds:
            meta["truncated"] = f"stopped after {args.max_seconds} s (--max-seconds): {len(rows)} rows"
            progress.note(meta["truncated"])
            break
        label = f"{case.label} BS={b} T={t}"
        progress.start(label)
        t_case = time.monotonic()
        new = bench_case(
            case,
            b,
            t,
            device,
            repeats=repeats,
            with_reference=not args.no_reference and (i == 0 or not args.quick),
            host=not args.no_host,
            host_reference=(b == bss[0]),
            sample_bytes=sample_bytes,
            slots=getattr(args, "slots", "blocks"),
            clock=getattr(args, "clock", "wall"),
        )
        rows += new
        progress.finished(label, len(new), time.monotonic() - t_case)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.output:  # keep what is measured so far
            with open(args.output, "w") as f:
                json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    small: list[SmallRow] = []
    for t in _ints(args.small, ()):
        t_case = time.monotonic()
        got = bench_small(device, tokens=t, repeats=repeats, calls=QUICK["small_calls"] if args.quick else None)
        small += got
        progress.note(f"small transfers T={t}: {len(got)} rows in {time.monotonic() - t_case:.1f} s")
    notes = noise_notes([*rows, *small])
    for note in notes:
        progress.note(note)
    progress.close()
    meta["loadavg_end"] = _loadavg()
    meta["noise"] = _noise_meta([*rows, *small], notes)
    meta["clock"] = getattr(args, "clock", "wall") if device.type == "cpu" else "wall"
    data = [asdict(r) for r in rows]
    sdata = [asdict(r) for r in small]
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "rows": data, "small": sdata}, f, indent=1)
    if args.json:
        print(json.dumps({"meta": meta, "rows": data, "small": sdata}, indent=1))
    else:
        load = "" if meta["loadavg_start"] is None else f" | load average {meta['loadavg_start'][0]} -> {meta['loadavg_end'][0]}"
        print(f"# {meta['device_name']} | torch {meta['torch']} | {meta['threads']} threads{load}")
        if "quick" in meta:
            print(f"# {meta['quick']}")
        print(format_table(rows))
        if small:
            print()
            print(format_small(small))
        for note in notes:
            print(f"# {note}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="kvcore bench")
    add_arguments(p)
    return run(p.parse_args(argv))
