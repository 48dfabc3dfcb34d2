"""Each figure's spread over the repeats, and whether a same-run baseline was steady enough
to divide by (:func:`baseline_spread`, :data:`NOISE_LIMIT`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

#: A same-run baseline is too noisy to trust when the middle half of its samples spans more
#: than this fraction of their median (interquartile range / median, :func:`baseline_spread`):
#: the ratios divided by it could then be off by more than about half that (+-5 %), so they
#: are flagged rather than quoted. An idle machine's copies spread by 0-3 %.
NOISE_LIMIT = 0.10


def span(samples: Sequence[float]) -> tuple[float, float]:
    """The lowest and highest of ``samples``."""
    return (min(samples), max(samples))


def baseline_spread(samples: Sequence[float]) -> float | None:
    """How much a baseline's samples (seconds per call, one per repeat) disagree: their
    interquartile range over their median (quartiles by linear interpolation,
    ``statistics.quantiles(method="inclusive")``: with 2 or 3 samples half their range, with 5
    the second to the fourth, so one disturbed repeat of five does not count). None for fewer
    than two samples (no spread to see)."""
    if len(samples) < 2:
        return None
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def too_noisy(spread: float | None) -> bool | None:
    """Whether a baseline whose :func:`baseline_spread` is ``spread`` is too noisy to trust
    (above :data:`NOISE_LIMIT`); None when the spread is unknown (one repeat)."""
    return None if spread is None else spread > NOISE_LIMIT


def _gbps_span(nbytes: float, seconds: Sequence[float]) -> tuple[float, float]:
    """GB/s of ``nbytes`` per call at the slowest and the fastest of ``seconds``."""
    return (nbytes / max(seconds) / 1e9, nbytes / min(seconds) / 1e9)


def _ratio_span(samples: dict[str, list[float]], base: str, key: str) -> tuple[float, float] | None:
    """Lowest and highest ``base`` time / ``key`` time over the repeats (sample ``i`` of the
    two ran back to back); None when ``key`` was not timed."""
    if key not in samples:
        return None
    return span([b / x for b, x in zip(samples[base], samples[key])])


def _us_span(seconds: Sequence[float]) -> tuple[float, float]:
    lo, hi = span(seconds)
    return (lo * 1e6, hi * 1e6)


def _spreads(samples: dict[str, list[float]], base: str, direction: str, nbytes: float, reference: bool = False) -> dict[str, Any]:
    """A row's spreads beyond the kernel's own: the baseline's GB/s range, its spread and
    noise verdict (:func:`baseline_spread`, :func:`too_noisy`), the reference kernel's GB/s
    range (the kernel's own when it is the reference) and the public call's seconds."""
    ref = samples.get("ref-" + direction, samples[direction] if reference else None)
    pub = samples.get("pub-" + direction)
    spread = baseline_spread(samples[base])
    return {
        "baseline_gbps_range": _gbps_span(nbytes, samples[base]),
        "baseline_spread": spread,
        "baseline_noisy": too_noisy(spread),
        "reference_gbps_range": None if ref is None else _gbps_span(nbytes, ref),
        "public_seconds_range": None if pub is None else span(pub),
        "repeats": len(samples[base]),
    }


def noise_notes(rows: Sequence[Any]) -> list[str]:
    """What the figures' spreads say, one line each: the rows whose same-run baseline was
    too noisy to trust (:func:`too_noisy`), and rows measured once (no spread to see)."""
    notes = []
    noisy = [r for r in rows if r.baseline_noisy]
    if noisy:
        lo, hi = (f"{100 * x:.0f}%" for x in span([r.baseline_spread for r in noisy]))
        notes.append(
            f"* {len(noisy)} of {len(rows)} rows: the same-run baseline was too noisy to trust (its samples' interquartile "
            f"range was {lo if lo == hi else f'{lo}–{hi}'} of their median; the limit is {100 * NOISE_LIMIT:.0f}%), so "
            "the ratios to it (marked *) are not measurements: rerun on an idle machine, with more --repeats, or with --clock cpu"
        )
    once = sum(1 for r in rows if r.repeats == 1)
    if once:
        notes.append(
            f"{once} of {len(rows)} rows were measured once: no spread, and no telling a noisy baseline (give --repeats 3 or more)"
        )
    return notes


def _noise_meta(rows: Sequence[Any], notes: list[str]) -> dict[str, Any]:
    """The JSON meta's ``noise``: how noise is judged, how many rows' baselines were too
    noisy to trust, and the notes the text output prints."""
    judged = [r for r in rows if r.baseline_noisy is not None]
    noisy = sum(1 for r in judged if r.baseline_noisy)
    return {
        "measure": "the same-run baseline's interquartile range / median over the repeats (row: baseline_spread)",
        "limit": NOISE_LIMIT,
        "rows": len(rows),
        "judged_rows": len(judged),
        "noisy_rows": noisy,
        "baseline_trusted": None if not judged else noisy == 0,
        "notes": notes,
    }
