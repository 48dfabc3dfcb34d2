"""The rows as markdown tables: each figure its median and, in parentheses, its lowest and
highest over the repeats; a noisy baseline's ratios marked."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.bench.matrix import Row
from kvcore.bench.small import SmallRow


def _cell(v: float | None, fmt: str = "{:.1f}", rng: Sequence[float] | None = None, scale: float = 1.0, unit: str = "") -> str:
    """``median<unit> (lowest–highest)`` of a figure, or the median alone, or ``-``."""
    if v is None:
        return "-"
    out = fmt.format(v * scale) + unit
    return out if rng is None else f"{out} ({fmt.format(rng[0] * scale)}–{fmt.format(rng[1] * scale)})"


def _spread_cell(spread: float | None, noisy: bool | None) -> str:
    return "-" if spread is None else f"{100 * spread:.1f}%" + (" noisy" if noisy else "")


def format_table(rows: list[Row]) -> str:
    """A markdown table of ``rows``: each figure its median over the repeats and, in
    parentheses, its lowest and highest; ``baseline spread`` the baseline's interquartile range
    over its median, ``noisy`` above :data:`NOISE_LIMIT` (its ratios are then marked ``*``)."""
    head = (
        "| layout | dtype | BS | T | direction | staging | kernel | MB | µs | GB/s | baseline GB/s | vs baseline | reference GB/s "
        "| vs reference | public API µs | public / kernel | graph µs | graph vs copy | public graph µs | public vs baseline "
        "| slots | baseline spread |\n"
        "| --- | --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | --- | ---: |"
    )
    lines = [head]
    for r in rows:
        mark = " *" if r.baseline_noisy else ""
        vr = "-" if r.vs_reference is None else f"{r.vs_reference:.2f}x"
        lines.append(
            f"| {r.layout} | {r.dtype} | {r.block_size} | {r.tokens} | {r.direction} | {r.staging} | {r.kernel} | {r.mbytes:.1f} | "
            f"{r.seconds * 1e6:.1f} | {_cell(r.gbps, rng=r.gbps_range)} | {_cell(r.baseline_gbps, rng=r.baseline_gbps_range)} | "
            f"{_cell(r.vs_copy, '{:.1f}', r.vs_copy_range, 100, '%')}{mark} | {_cell(r.reference_gbps, rng=r.reference_gbps_range)} | {vr} | "
            f"{_cell(r.public_seconds, rng=r.public_seconds_range, scale=1e6)} | {_cell(r.public_vs_kernel, '{:.3f}x')} | "
            + ("- | - |" if r.graph_seconds is None else f"{r.graph_seconds * 1e6:.1f} | {100 * r.graph_vs_copy:.1f}% |")
            + f" {_cell(r.public_graph_seconds, scale=1e6)} | "
            + ("-" if r.public_vs_copy is None else _cell(r.public_vs_copy, "{:.1f}", r.public_vs_copy_range, 100, "%") + mark)
            + f" | {r.slots}{'' if r.clock == 'wall' else ', cpu clock'} | {_spread_cell(r.baseline_spread, r.baseline_noisy)} |"
        )
    return "\n".join(lines)


def format_small(rows: list[SmallRow]) -> str:
    """A markdown table of the small-transfer ``rows``, each time its median (lowest–highest)."""
    lines = [
        "| layout | T | NB | direction | MB | public API µs | kernel µs | baseline | baseline µs | public / baseline | threads "
        "| baseline spread |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mark = " *" if r.baseline_noisy else ""
        lines.append(
            f"| {r.layout} | {r.tokens} | {r.num_blocks} | {r.direction} | {r.mbytes:.2f} | {_cell(r.public_us, rng=r.public_us_range)} | "
            f"{_cell(r.kernel_us, rng=r.kernel_us_range)} | {r.baseline} | {_cell(r.baseline_us, rng=r.baseline_us_range)} | "
            f"{r.public_vs_baseline:.2f}x{mark} | {r.threads} | {_spread_cell(r.baseline_spread, r.baseline_noisy)} |"
        )
    return "\n".join(lines)
