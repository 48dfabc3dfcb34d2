"""``kvcore demo``: run a plugin's registered end-to-end demo; every argument but
``--engine``/``--list`` goes to the demo's own parser."""

from __future__ import annotations

import argparse
from typing import Any

from kvcore import registry
from kvcore.cli.output import EXIT_OK, EXIT_USAGE, Formatter, err
from kvcore.cli.plugins import load_plugins_capturing
from kvcore.cli_args import OneLineParser

DEMO_HELP = """\
usage: kvcore demo [--engine NAME] [--list] [-h] [DEMO ARGS ...]

Run a plugin's end-to-end demo: allocate an engine's KV cache exactly as the engine does,
fill it with values that encode (layer, K/V, token, head, element), detect it, offload
requests by slot mapping, restore them into other blocks, verify bit-exact and semantically,
and print a table with the transfer speed. Exit 1 on any mismatch.

options:
  --engine NAME   which registered demo to run (default: vllm)
  --list          list the registered demos
  -h, --help      show this help (a demo's own options: kvcore demo --engine NAME --help)
  ...             everything else goes to the demo

examples:
  kvcore demo                                      # vLLM: Llama-3-8B NHD/HND and DeepSeek-V3 MLA
  kvcore demo --engine vllm --json --num-blocks 64
  kvcore demo --engine vllm --pd                   # prefill/decode between two processes
  kvcore demo --engine sglang
  kvcore demo --engine vllm --help                 # the vLLM demo's own options
  kvcore demo --list"""


def _demo_listing(demos: dict) -> str:
    if not demos:
        return "  (none: install an engine plugin that registers one, e.g. kvcore-vllm)"
    return "\n".join(f"  {n:<12} {h or ''}  [plugin {p}]" for n, (_, h, p) in sorted(demos.items()))


def run_demo(argv: list[str]) -> int:
    """``kvcore demo [--engine NAME] [--list] [DEMO ARGS...]``: everything except
    ``--engine``/``--list`` goes to the demo's own ``run(argv)``."""

    p = OneLineParser(prog="kvcore demo", add_help=False)
    p.add_argument("--engine", default=None)
    p.add_argument("--list", action="store_true")
    try:
        ns, rest = p.parse_known_args(argv)
    except SystemExit as e:  # "--engine" without a value
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    load_plugins_capturing()
    demos = registry.demos()
    if ns.list or (ns.engine is None and any(a in ("-h", "--help") for a in rest)):
        print(DEMO_HELP)
        print("\nregistered demos:\n" + _demo_listing(demos))
        return EXIT_OK
    engine = ns.engine or "vllm"
    if engine not in demos:
        err(
            f"no demo named {engine!r} is registered: demos come from plugins, and no installed plugin "
            f"registers {engine!r} (install the plugin for that engine; in a kvcore checkout "
            f"`python3 scripts/setup_venv.py --test` installs every in-tree plugin). "
            f"Registered demos:\n{_demo_listing(demos)}"
        )
        return EXIT_USAGE
    run, _, plugin = demos[engine]
    try:
        rc = run(list(rest))
    except SystemExit as e:  # the demo's own argparse
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    return int(rc or 0)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """``demo`` in ``kvcore --help``; ``kvcore demo`` itself runs :func:`run_demo`, which hands
    the arguments to the demo unparsed."""
    return sub.add_parser(
        "demo",
        help="run a plugin's end-to-end demo (default: vllm)",
        add_help=False,
        formatter_class=Formatter,
        description=DEMO_HELP,
    )
