"""The ``kvcore`` command line.

Subcommands (``kvcore COMMAND --help`` explains each, with examples)::

    kvcore plugins  [--json]                      what loaded, from where, what it registered
    kvcore formats  [--json] [--engine E]         every registered layout, with its source
    kvcore hints    [ENGINE] [--json]             the hints an engine's plugins read
    kvcore describe NAME [--sizes NL=32,...]      parse any layout name, render its shape
    kvcore detect   FILE|- [--engine E] [--hints JSON] [--json] [--per-layer]
                                                  detect a cache described in JSON (from a log)
    kvcore doctor   [--json]                      versions, devices, kernels, compilers
    kvcore demo     [--engine vllm] [ARGS...]     run a plugin's end-to-end demo
    kvcore bench    ...                           transfer benchmarks (kvcore.bench)
    kvcore check    ...                           the conformance suite (kvcore.testing.check)

Exit codes: 0 success; 1 the question was understood but the answer is a failure
(nothing recognises the cache, a demo or check found a mismatch); 2 a usage error (bad
arguments, a malformed format name, an unreadable input file, an unknown demo, a missing
optional module). ``--json`` output goes to stdout alone; diagnostics go to stderr.

The package: this module parses the command line and dispatches (``bench`` and ``check``
to their optional modules); each subcommand is its own module (``plugins``, ``formats``,
``hints``, ``describe``, ``detect``, ``doctor``, ``demo``): its ``cmd_*`` function and its
parser (``HELP``, ``DESCRIPTION``, ``EPILOG``, ``add_arguments``: the protocol of ``bench``
and ``check``), over ``output`` (printing, exit codes, the parser's formatter).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import kvcore

# the names marked F401 were importable from kvcore.cli when it was one module, and stay so
from kvcore.cli import demo, describe, detect, doctor, formats, hints, plugins
from kvcore.cli.demo import DEMO_HELP, _demo_listing, run_demo  # noqa: F401
from kvcore.cli.describe import _CHUNK_BYTES, _SIZE_KEYS, _axis_value, _complete_sizes, _missing_note, cmd_describe, parse_sizes  # noqa: F401
from kvcore.cli.detect import (  # noqa: F401
    _check_engine,
    _detect_and_print,
    _detect_result,
    _layout_dict,
    _leaves_device,
    _parse_hints,
    _print_layout,
    _read_json,
    _usage_hints,
    cmd_detect,
)
from kvcore.cli.doctor import _devices, _serving_kernel  # noqa: F401
from kvcore.cli.formats import cmd_formats
from kvcore.cli.formats import format_dict as _format_dict  # noqa: F401
from kvcore.cli.formats import format_facts as _format_facts  # noqa: F401
from kvcore.cli.hints import cmd_hints  # noqa: F401
from kvcore.cli.output import EXIT_FAIL, EXIT_OK, EXIT_USAGE, Formatter, add_command, err, examples_epilog, fill  # noqa: F401
from kvcore.cli.output import Formatter as _Formatter  # noqa: F401
from kvcore.cli.output import clip as _clip  # noqa: F401
from kvcore.cli.output import dtype_name as _dtype_name  # noqa: F401
from kvcore.cli.output import err as _err  # noqa: F401
from kvcore.cli.output import fill as _fill  # noqa: F401
from kvcore.cli.output import human_bytes as _human_bytes  # noqa: F401
from kvcore.cli.output import print_json as _print_json  # noqa: F401
from kvcore.cli.output import table as _table  # noqa: F401
from kvcore.cli.plugins import cmd_plugins
from kvcore.cli.plugins import load_plugins_capturing as _load_plugins_capturing  # noqa: F401
from kvcore.cli_args import OneLineParser
from kvcore.errors import KVCoreError
from kvcore.tensor_description import UsageError, load_tensor_description
from kvcore.tensor_description import parse_dtype as _parse_dtype  # noqa: F401

__all__ = ["main", "build_parser", "load_tensor_description", "parse_sizes", "UsageError"]


def cmd_doctor(args: argparse.Namespace) -> int:
    """``kvcore doctor`` (:func:`kvcore.cli.doctor.cmd_doctor`) with this module's device probe,
    ``kvcore.cli._devices``: a test presents a device this host lacks by replacing it."""
    return doctor.cmd_doctor(args, probe=_devices)


# -- bench, check: dispatch to optional modules ----------------------------------------------


def _optional_module(name: str) -> Any:
    """Import an optional command module; ``None`` when it is absent (not when it is broken)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name or (e.name and name.startswith(e.name + ".")):
            return None
        raise


_DISPATCH = {
    "bench": ("kvcore.bench", "transfer benchmarks"),
    "check": ("kvcore.testing.check", "the conformance suite"),
}


_DISPATCH_EXAMPLES = {
    "bench": (
        "kvcore bench --device cpu --quick",
        "kvcore bench --device cuda --json --output bench.json",
    ),
    "check": ("kvcore check", "kvcore check vllm -q", "kvcore check trtllm --json"),
}


# -- the parser ------------------------------------------------------------------------------


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvcore`` parser. ``command``: the subcommand about to run; only then are the
    optional modules (bench, check) imported to add their arguments."""
    top = OneLineParser(
        prog="kvcore",
        formatter_class=Formatter,
        description=(
            "kvcore: know how every LLM serving engine lays out its KV cache, and move it fast.\n"
            "A layout's name is its shape template (NL_X_TWO_NB_BS_NH_HS = NL x [2, NB, BS, NH, HS]);\n"
            "engines and devices are plugins."
        ),
        epilog=(
            "examples:\n"
            "  kvcore formats --engine vllm\n"
            "  kvcore describe NL_X_TWO_NB_NH_BS_HS --sizes NL=32,NB=2048,BS=16,NH=8,HS=128\n"
            '  kvcore detect cache.json --engine vllm --hints \'{"kv_cache_layout": "HND"}\'\n'
            "  kvcore demo\n\n"
            "exit codes: 0 ok, 1 failure (not recognised, mismatch), 2 usage error"
        ),
    )
    top.add_argument("--version", action="version", version=f"kvcore {_version()}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")

    # the cmd_* functions are this module's names, looked up when the parser is built
    for name, cmd_module, func in (
        ("plugins", plugins, cmd_plugins),
        ("formats", formats, cmd_formats),
        ("hints", hints, cmd_hints),
        ("describe", describe, cmd_describe),
        ("detect", detect, cmd_detect),
        ("doctor", doctor, cmd_doctor),
    ):
        add_command(sub, name, cmd_module).set_defaults(func=func)
    demo.add_parser(sub)

    for name, (module, what) in _DISPATCH.items():
        p = sub.add_parser(
            name,
            help=f"{what} ({module})",
            formatter_class=Formatter,
            description=f"Dispatches to {module}; `kvcore {name} --help` lists its options when it is installed.",
            epilog=examples_epilog(_DISPATCH_EXAMPLES[name]),
        )
        p.set_defaults(func=None, module=module)
        if command == name:
            mod = _optional_module(module)
            if mod is None:
                p.set_defaults(missing=True)
            else:
                mod.add_arguments(p)
                if p.description and "\n" not in p.description:  # a module's one-paragraph description
                    p.description = fill(p.description, width=100)
                p.set_defaults(func=mod.run, missing=False)
    return top


def _version() -> str:
    return kvcore.__version__


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "demo":
        return run_demo(argv[1:])
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command in _DISPATCH:
        module = _DISPATCH[command][0]
        if _optional_module(module) is None:
            err(f"`kvcore {command}` needs {module}, which is not installed in this kvcore build")
            return EXIT_USAGE
    parser = build_parser(command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:  # pragma: no cover - guarded above
        err(f"`kvcore {args.command}` is not available")
        return EXIT_USAGE
    return int(func(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvcore`` console script. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except UsageError as e:
        err(str(e))
        return EXIT_USAGE
    except KVCoreError as e:
        err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except BrokenPipeError:  # `kvcore formats | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - report, don't dump a traceback on users
        if os.environ.get("KVCORE_DEBUG"):
            traceback.print_exc()
        else:
            err(f"internal error: {type(e).__name__}: {e} (set KVCORE_DEBUG=1 for the traceback, and please report it)")
        return EXIT_FAIL
