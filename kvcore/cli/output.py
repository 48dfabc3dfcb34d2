"""What every ``kvcore`` subcommand prints with: exit codes, JSON, text tables, wrapped
lines, one-line errors on stderr, and the help formatter and subcommand parser they share."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain left-aligned text table."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def fill(text: str, width: int = 100, **kw: Any) -> str:
    """``textwrap.fill`` that never breaks a word or at a hyphen: a path, a file name or a
    command stays on one line whole (copy-paste), even past ``width``."""
    return textwrap.fill(text, width=width, break_long_words=False, break_on_hyphens=False, **kw)


def err(msg: str) -> None:
    print(f"kvcore: {msg}", file=sys.stderr)


def dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


class Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def examples_epilog(examples: Sequence[str], note: str = "") -> str:
    """A subcommand help's epilog: ``examples`` one command a line, then ``note``."""
    return "examples:\n" + "\n".join(f"  {e}" for e in examples) + (f"\n\n{note}" if note else "")


def add_command(sub: Any, name: str, command: Any) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` under ``sub``, from its module ``command``: its
    ``HELP`` line, ``DESCRIPTION`` and ``EPILOG``, and its ``add_arguments``."""
    p = sub.add_parser(name, help=command.HELP, formatter_class=Formatter, description=command.DESCRIPTION, epilog=command.EPILOG)
    command.add_arguments(p)
    return p


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
