"""``kvcore hints``: the hints an engine's plugins declare, with meaning, accepted values,
default and source."""

from __future__ import annotations

import argparse

from kvcore import registry
from kvcore.cli.output import EXIT_OK, add_json_flag, examples_epilog, fill, print_json, table
from kvcore.cli.plugins import load_plugins_capturing
from kvcore.tensor_description import UsageError

#: ``kvcore --help``'s line for the command, and its own help's text above and below the options
HELP = "the hints an engine's plugins read: meaning, accepted values, default"
DESCRIPTION = (
    "List the hints kvcore.detect(..., engine=ENGINE, hints={...}) understands, as the engine's plugins "
    "declare them (kvcore_register_hints): each hint's meaning, accepted values or type, aliases, default and the engine "
    "source that defines it. Without ENGINE: the engines that declare hints."
)
EPILOG = examples_epilog(
    examples=("kvcore hints", "kvcore hints vllm", "kvcore hints sglang --json"), note="an engine no plugin declares hints for exits 2"
)


def cmd_hints(args: argparse.Namespace) -> int:
    load_plugins_capturing()
    declared = registry.hints()
    engines = sorted({h.engine for _, h in declared})
    if not args.engine:
        if args.json:
            print_json({e: [h.model_dump() | {"plugin": p} for p, h in declared if h.engine == e] for e in engines})
            return EXIT_OK
        if not engines:
            print("no plugin declares hints: install an engine plugin (e.g. kvcore-vllm); `kvcore plugins` shows what loaded")
            return EXIT_OK
        rows = [
            [e, len([1 for _, h in declared if h.engine == e]), ", ".join(sorted({p for p, h in declared if h.engine == e}))]
            for e in engines
        ]
        print(table(rows, ["engine", "hints", "plugins"]))
        print("\n`kvcore hints ENGINE` lists an engine's hints with their meaning and accepted values")
        return EXIT_OK
    mine = [(p, h) for p, h in declared if h.engine.lower() == args.engine.lower()]
    if not mine:
        raise UsageError(
            f"no plugin declares hints for engine {args.engine!r}; engines with declared hints: {', '.join(engines) or 'none'}"
        )
    if args.json:
        print_json([h.model_dump() | {"plugin": p} for p, h in mine])
        return EXIT_OK
    print(f"hints for engine {mine[0][1].engine!r} (kvcore.detect(..., engine={mine[0][1].engine!r}, hints={{...}})):\n")
    for p, h in mine:
        name = h.name + (f" (also {', '.join(h.aliases)})" if h.aliases else "")
        print(f"  {name}")
        print(fill(h.meaning, width=100, initial_indent="      ", subsequent_indent="      "))
        print(fill(f"accepts: {h.accepted()}", width=100, initial_indent="      ", subsequent_indent="          "))
        if h.default:
            print(fill(f"default: {h.default}", width=100, initial_indent="      ", subsequent_indent="          "))
        if h.source:
            print(f"      source:  {h.source}")
        if len({q for q, _ in mine}) > 1:
            print(f"      plugin:  {p}")
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", nargs="?", help="engine name (vllm, sglang, transformers, ...)")
    add_json_flag(p)
