"""``kvcore check [PLUGIN ...]``: run the conformance suite and print a report a person reads.

One line per (plugin, format, fixture, kernel, check) with PASS / FAIL / SKIP; a failure
shows, indented under its line, what was wrong — for a wrong element its coordinates
(layer, K/V, token, slot, head, element), the expected and the actual bits, and where the
actual value came from when it is one of the oracle's codes. ``--json`` prints the results
as a JSON list. Exit status: 0 when nothing failed, 1 on any failure, 2 for a usage error
(a plugin that is not loaded).

``kvcore/cli.py`` dispatches here (``add_arguments(parser)``, ``run(args) -> int``);
``python -m kvcore.testing.check`` runs it on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from collections import Counter

from kvcore import registry
from kvcore.cli_args import OneLineParser, int_range
from kvcore.errors import PluginError
from kvcore.testing import suite
from kvcore.testing.checks import common as checks_common

__all__ = ["add_arguments", "run", "main", "writer_proved", "writer_summary", "DESCRIPTION", "EPILOG"]

DESCRIPTION = (
    "Run kvcore's conformance suite on installed plugins: for every format a plugin registers, its fixtures "
    "(allocations made the way the engine makes them) must detect as that format on the engine's real strides, with "
    "the name in the tensors' memory order and every hint declared, report the declared geometry, resolve look-alike geometries (NH=1, NH=2, BS=NH, NB=2, NL=2) or raise "
    "AmbiguousLayoutError, and, with every kernel that serves the format on every device present, gather exactly the "
    "values the engine's own view holds (semantic oracle), scatter exactly where the engine's view says, round-trip "
    "every allowed dtype bit-exactly (NaN, -0), skip negative slots, treat empty slot mappings as no-ops, and refuse "
    "every invalid call with TransferError while leaving the cache byte-identical. Kernels must agree with the "
    "reference kernel on random geometries, and a plugin's detector must answer only for its own engines."
)

EPILOG = """\
examples:
  kvcore check                      every loaded plugin
  kvcore check trtllm               one plugin (its formats, fixtures and kernels)
  kvcore check vllm --format 'NL_X_*' --check 'semantic_*'
  kvcore check --kernel native -q   one kernel, failures only
  kvcore check trtllm --json > report.json
  kvcore check --list               the checks that would run

the same suite under pytest (opt-in, not auto-loaded):
  pytest -p kvcore.testing.pytest_plugin --kvcore-plugin trtllm

exit codes: 0 all passed (or skipped), 1 a check failed, 2 usage error"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvcore check``'s options to ``parser`` (kvcore/cli.py calls this)."""
    parser.description = textwrap.fill(DESCRIPTION, 100)
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("plugins", nargs="*", metavar="PLUGIN", help="plugin names (kvcore plugins lists them); default: all")
    parser.add_argument("--format", dest="formats", action="append", metavar="GLOB", help="only these formats (glob, repeatable)")
    parser.add_argument("--fixture", dest="fixtures", action="append", metavar="GLOB", help="only these fixtures (glob, repeatable)")
    parser.add_argument("--kernel", dest="kernels", action="append", metavar="GLOB", help="only these kernels: name or name@device (glob)")
    parser.add_argument(
        "--check", dest="checks", action="append", metavar="GLOB", help="only these checks, e.g. 'semantic_*' or 'invalid' (glob)"
    )
    parser.add_argument(
        "--device", dest="devices", action="append", metavar="TYPE", help="only these device types (default: every device present)"
    )
    parser.add_argument(
        "--examples",
        type=int_range(1, 10_000),
        default=8,
        help="hypothesis examples per kernel agreement check, 1..10000 (default 8)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only failures and the summary")
    parser.add_argument("--list", action="store_true", help="list the checks that would run, without running them")


def _widths(rows) -> list[int]:
    w = [0] * 5
    for r in rows:
        for i, c in enumerate([r.plugin, r.format or "-", r.fixture or "-", r.kernel, r.check]):
            w[i] = max(w[i], len(c))
    return w


def _kernel_filter_problem(kernels: list[str] | None, devices: list[str] | None, tasks: list) -> str | None:
    """Why ``--kernel`` / ``--device`` is a usage error, or None: a pattern that matches no
    registered kernel (``name`` or ``name@device``), a device type no kernel serves and no
    device here has, or filters that leave no (kernel, device) pair to check -- a typo'd
    filter must never pass green with no transfer checked."""
    import fnmatch

    if not kernels and not devices:
        return None
    regs = registry.kernels()
    names = sorted({str(k.name) for k in regs})
    ids = {f"{k.name}@{d}" for k in regs for d in k.device_types} | set(names)
    here = sorted({d.type for d in checks_common.devices()})  # looked up per call: tests stand in a CPU-only machine
    types = sorted({d for k in regs for d in k.device_types} | set(here))
    for p in kernels or ():
        if not any(fnmatch.fnmatchcase(i, p) for i in ids):
            return (
                f"--kernel {p!r} matches no registered kernel; kernels: {', '.join(names) or 'none'} (name or name@device, globs allowed)"
            )
    for d in devices or ():
        if d not in types:
            return (
                f"--device {d!r} is not a device type any kernel serves; device types: {', '.join(types)} (present here: {', '.join(here)})"
            )
    if not any(t.kernel != "-" for t in tasks):
        return (
            f"--kernel/--device select no kernel on a device present here, so no transfer would be checked (devices here: "
            f"{', '.join(here)}; kernels serving them: {', '.join(sorted(i for i in ids - set(names) if i.split('@')[1] in here))})"
        )
    return None


def run(args: argparse.Namespace) -> int:
    """Run the suite as ``args`` says; print the report; return the exit code."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opts = suite.Options(examples=max(1, args.examples), devices=tuple(args.devices) if args.devices else None)
        try:
            tasks = suite.plan(args.plugins or None, opts)
        except PluginError as e:
            print(f"kvcore check: {e}", file=sys.stderr)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    tasks = suite.select(tasks, formats=args.formats, fixtures=args.fixtures, kernels=args.kernels, checks=args.checks)
    why = _kernel_filter_problem(args.kernels, args.devices, tasks)
    if why:
        print(f"kvcore check: {why}", file=sys.stderr)
        return 2
    if args.list:
        if args.json:
            print(json.dumps([t.id for t in tasks], indent=1))
        else:
            for t in tasks:
                print(t.id)
        return 0
    if not tasks:
        print("kvcore check: nothing to check (no plugin registers a format, fixture or kernel matching the filters)", file=sys.stderr)
        return 1 if (args.plugins or args.formats or args.fixtures or args.kernels or args.checks) else 0
    widths = _widths(tasks)
    if not args.json:
        kernels = sorted({t.kernel for t in tasks if t.kernel != "-"})
        print(
            f"kvcore check: {len(tasks)} checks; plugins {', '.join(sorted({t.plugin for t in tasks}))}; "
            f"kernels {', '.join(kernels) or 'none'}" + ("" if args.quiet else "\n"),
            flush=True,
        )
    results = []
    t0 = time.perf_counter()
    for t in tasks:
        r = t.run()
        results.append(r)
        if not args.json and (not args.quiet or r.status == suite.FAIL):
            print(r.line(widths), flush=True)
    took = time.perf_counter() - t0
    counts = Counter(r.status for r in results)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        plugins = sorted({r.plugin for r in results})
        formats = sorted({r.format for r in results if r.format})
        wlines = writer_summary(results)
        if wlines:
            print(("" if args.quiet else "\n") + "\n".join(wlines))
        print(
            f"{'' if args.quiet and not counts[suite.FAIL] else chr(10)}{counts[suite.PASS]} passed, {counts[suite.FAIL]} failed, {counts[suite.SKIP]} skipped: "
            f"{len(plugins)} plugin(s), {len(formats)} format(s), in {took:.1f} s"
        )
        if counts[suite.FAIL]:
            failed = Counter((r.plugin, r.format or "-") for r in results if r.status == suite.FAIL)
            for (p, f), n in sorted(failed.items()):
                print(f"  FAIL  {p}  {f}: {n} check(s)")
    return 1 if counts[suite.FAIL] else 0


def writer_proved(results) -> dict[str, dict[str, set[str]]]:
    """Per plugin: ``{"formats": every format it was checked on, "engine": formats an engine's
    own writer proved, "transcribed": formats a transcribed writer proved}``. A format is
    proved when one of its fixtures passed ``writer_view`` and, with some kernel, both
    ``writer_gather`` and ``writer_scatter``, and none of its writer checks failed."""

    per: dict[tuple[str, str, str], dict[str, list[str]]] = {}
    out: dict[str, dict[str, set[str]]] = {}
    for r in results:
        if r.format and r.fixture:
            out.setdefault(r.plugin, {"formats": set(), "engine": set(), "transcribed": set()})["formats"].add(r.format)
        if "writer" in r.check and r.fixture:
            per.setdefault((r.plugin, r.format, r.fixture), {}).setdefault(r.check, []).append(r.status)
            origin = "transcribed" if "(transcribed" in r.message else "engine"
            per[(r.plugin, r.format, r.fixture)].setdefault("origin", []).append(origin)
    bad = {(p, f) for (p, f, _), c in per.items() for k, v in c.items() if k != "origin" and suite.FAIL in v}
    for (p, f, _), c in per.items():
        ok = all(suite.PASS in c.get(k, []) for k in ("writer_view", "writer_gather", "writer_scatter"))
        if ok and (p, f) not in bad:
            out.setdefault(p, {"formats": set(), "engine": set(), "transcribed": set()})[c["origin"][0]].add(f)
    for d in out.values():
        d["transcribed"] -= d["engine"]
    return out


def writer_summary(results) -> list[str]:
    """One line per plugin: how many of its formats a writer proved (``kvcore check``'s footer)."""
    lines: list[str] = []
    if not any("writer" in r.check for r in results):
        return lines
    for p, d in sorted(writer_proved(results).items()):
        if not d["formats"]:
            continue
        extra = f", {len(d['transcribed'])} by a transcribed writer (the engine does not run here)" if d["transcribed"] else ""
        lines.append(f"  writers: {p}: {len(d['engine'])} of {len(d['formats'])} format(s) proved by the engine's own writer{extra}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="kvcore check")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
