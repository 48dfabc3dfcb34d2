"""``kvcore formats``: every registered layout with its shape, facts, engines, source and
plugin; the facts and JSON record of a format (``kvcore describe`` shows them too)."""

from __future__ import annotations

import argparse
from typing import Any

import kvcore
from kvcore import registry
from kvcore.cli.output import EXIT_OK, add_json_flag, clip, examples_epilog, print_json, table
from kvcore.cli.plugins import load_plugins_capturing
from kvcore.tensor_description import UsageError

#: ``kvcore --help``'s line for the command, and its own help's text above and below the options
HELP = "every registered layout: shape, facts, engines, source, plugin"
DESCRIPTION = (
    "Table of the registered formats: name, symbolic shape, kv_size, derived facts (container, MLA, "
    "HND/NHD, fused K/V, fused NBBS, K/V-major), the engines and attention backends that allocate it, where that "
    "fact comes from (engine version file), and the plugin that registers it."
)
EPILOG = examples_epilog(examples=("kvcore formats", "kvcore formats --engine vllm", "kvcore formats --json"))


def format_facts(fmt: Any) -> list[str]:
    syn = fmt.syntax
    facts = [syn.container]
    if syn.is_mla:
        facts.append("MLA")
    facts.append("HND" if syn.is_hnd else ("NHD" if syn.has("NH") and syn.has("BS") else "-"))
    if syn.fused_kv:
        facts.append("fused-KV")
    if syn.fused_nbbs:
        facts.append("NBBS")
    if syn.two_major:
        facts.append("KV-major")
    if syn.blocked_scale:
        facts.append("blocked-scale")
    return facts


def format_dict(fmt: Any) -> dict[str, Any]:
    try:
        owner = registry.format_owner(fmt.name)
    except KeyError:
        owner = None
    return {
        "name": fmt.name,
        "symbolic": fmt.symbolic,
        "kv_size": fmt.kv_size,
        "is_mla": fmt.is_mla,
        "container": fmt.container,
        "is_hnd": fmt.is_hnd,
        "fused_kv": fmt.fused_kv,
        "fused_nbbs": fmt.fused_nbbs,
        "two_major": fmt.two_major,
        "engines": list(fmt.engines),
        "attention_backends": list(fmt.attention_backends),
        "description": fmt.description,
        "sources": [{"engine": s.engine, "version": s.version, "file": s.file} for s in fmt.sources],
        "plugin": owner,
        "plugins": list(registry.declarations(fmt.name)),
    }


def cmd_formats(args: argparse.Namespace) -> int:
    load_plugins_capturing()
    fmts = kvcore.formats()
    if args.engine:
        known = sorted({e for f in fmts for e in f.engines})
        fmts = registry.formats_for_engine(args.engine)  # declared for it, or returned for it by its fixtures
        if not fmts:
            raise UsageError(f"no registered format names engine {args.engine!r}; engines with formats: {', '.join(known) or 'none'}")
    if args.json:
        print_json([format_dict(f) for f in fmts])
        return EXIT_OK
    if not fmts:
        if not args.engine:
            print("no formats are registered: install an engine plugin (e.g. kvcore-vllm); `kvcore plugins` shows what loaded")
        return EXIT_OK
    rows = []
    for f in fmts:
        d = format_dict(f)
        src = str(f.sources[0]) if f.sources else "-"
        if len(f.sources) > 1:
            src += f" (+{len(f.sources) - 1} more)"
        eng = ",".join(f.engines) or "-"
        if f.attention_backends:
            eng += " / " + ",".join(f.attention_backends)
        if not args.wide:
            eng, src = clip(eng, 44), clip(src, 72)
        rows.append([f.name, f.symbolic, f.kv_size, " ".join(format_facts(f)), eng, src, ", ".join(d["plugins"]) or d["plugin"]])
    print(table(rows, ["name", "shape", "kv", "facts", "engines / backends", "source", "plugins"]))
    if not args.wide:
        print("\n(engines and sources clipped: --wide shows them whole, --json gives every source)")
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", help="only the formats this engine's detector can return (declared for it, or by its fixtures)")
    p.add_argument("--wide", action="store_true", help="do not clip the engines and source columns")
    add_json_flag(p)
