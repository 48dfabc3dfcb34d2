"""argparse ``type=`` functions for kvcore's command line (and its plugins' demos).

Every numeric option is a bounded value: a value outside the range, or one that is not a
number at all, is a usage error -- argparse prints one line naming the option and the
accepted range, and the command exits 2 -- never an internal error deep in the work.

    parser.add_argument("--tokens", type=int_list(1, 1 << 22), ...)
    parser.add_argument("--repeats", type=int_range(1, 10_000), ...)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["int_range", "int_list", "float_range", "OneLineParser"]


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """``type=`` for one integer in ``[lo, hi]``."""

    def parse(s: str) -> int:
        try:
            v = int(s.strip(), 10)
        except (ValueError, AttributeError):
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer; give an integer from {lo} to {hi}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range; give an integer from {lo} to {hi}")
        return v

    parse.__name__ = f"integer from {lo} to {hi}"
    return parse


def int_list(lo: int, hi: int, *, allow_empty: bool = False) -> Callable[[str], tuple[int, ...]]:
    """``type=`` for comma-separated integers, each in ``[lo, hi]`` (``''``: an empty tuple
    when ``allow_empty``)."""
    one = int_range(lo, hi)

    def parse(s: str) -> tuple[int, ...]:
        parts = [x for x in s.split(",") if x.strip()]
        if not parts:
            if allow_empty:
                return ()
            raise argparse.ArgumentTypeError(f"{s!r} names no value; give comma-separated integers from {lo} to {hi}")
        out = []
        for x in parts:
            try:
                out.append(one(x))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"in {s!r}: {e} (comma-separated)") from None
        return tuple(out)

    parse.__name__ = f"comma-separated integers from {lo} to {hi}"
    return parse


def float_range(lo: float, hi: float, *, lo_open: bool = True) -> Callable[[str], float]:
    """``type=`` for one finite number in ``(lo, hi]`` (``[lo, hi]`` when not ``lo_open``)."""
    what = f"a number {'above' if lo_open else 'from'} {lo:g} {'up to' if lo_open else 'to'} {hi:g}"

    def parse(s: str) -> float:
        try:
            v = float(s)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"{s!r} is not a number; give {what}") from None
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"{s} is out of range; give {what}")
        return v

    parse.__name__ = what
    return parse


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (``prog: error: ...;
    see `prog --help```) and exit 2, like every other kvcore usage error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")
