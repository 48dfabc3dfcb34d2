"""``kvcore plugins``: what loaded, from which distribution, what each registered; and
the plugin loading every subcommand starts with (a failed plugin is one warning line)."""

from __future__ import annotations

import argparse
import sys
import warnings

import kvcore
from kvcore import registry
from kvcore.cli.output import EXIT_OK, add_json_flag, err, examples_epilog, print_json, table

#: ``kvcore --help``'s line for the command, and its own help's text above and below the options
HELP = "what loaded, from which distribution, and what each registered"
DESCRIPTION = (
    "List kvcore plugins: the distribution and version each came from, the formats, kernels and hooks it "
    "registered, and plugins that failed to load with their error."
)
EPILOG = examples_epilog(
    examples=("kvcore plugins", "kvcore plugins --json | jq '.[] | select(.error)'", "KVCORE_DISABLE_PLUGINS=sglang kvcore plugins")
)


def load_plugins_capturing(report: bool = True) -> list[str]:
    """Load plugins; the warnings loading produced (a plugin that failed to import) are
    returned, and printed to stderr as one line each when ``report``."""

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry.host()
    msgs = [str(w.message) for w in caught]
    if report:
        for m in msgs:
            err(f"warning: {m}")
    return msgs


def cmd_plugins(args: argparse.Namespace) -> int:
    load_plugins_capturing(report=False)
    infos = kvcore.plugins()
    if args.json:
        print_json([i.as_dict() for i in infos])
        return EXIT_OK
    rows = []
    for i in infos:
        dist = f"{i.distribution} {i.version or ''}".strip() if i.distribution else "(registered in code)"
        if i.error:
            rows.append([i.name, dist, "FAILED", "", "", i.error])
        else:
            rows.append(
                [i.name, dist, "ok", len(i.formats), ", ".join(i.kernels) or "-", ", ".join(h.replace("kvcore_", "") for h in i.hooks)]
            )
    print(table(rows, ["plugin", "distribution", "status", "formats", "kernels", "hooks / error"]))
    for i in infos:
        if i.formats and args.verbose:
            print(f"\n{i.name} registers:")
            for f in i.formats:
                print(f"  {f}")
    failed = [i for i in infos if i.error]
    if failed:
        print(
            f"\n{len(failed)} plugin(s) failed to load; fix or uninstall them, or set KVCORE_DISABLE_PLUGINS="
            + ",".join(i.name for i in failed),
            file=sys.stderr,
        )
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_json_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also list each plugin's formats")
