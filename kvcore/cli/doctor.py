"""``kvcore doctor``: the environment kvcore runs in: versions, devices, plugins, every
transfer kernel and why it is (not) available, the kernel each device type gets, compilers."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import torch

import kvcore
from kvcore import kernels, registry
from kvcore.cli.output import EXIT_OK, add_json_flag, examples_epilog, fill, print_json, table
from kvcore.cli.plugins import load_plugins_capturing
from kvcore.errors import TransferError

#: ``kvcore --help``'s line for the command, and its own help's text above and below the options
HELP = "versions, devices, plugins, which kernel serves each device and why, compilers"
DESCRIPTION = (
    "Report the environment kvcore runs in: Python and torch versions, devices present, plugins (and "
    "failures), every transfer kernel with whether it is available and why, which kernel serves each device type, "
    "and the compilers found for native kernels."
)
EPILOG = examples_epilog(examples=("kvcore doctor", "kvcore doctor --json"))


def _devices() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "cpu", "count": os.cpu_count() or 1, "names": [platform.processor() or platform.machine()]}]
    try:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
            out.append({"type": "cuda", "count": n, "names": [torch.cuda.get_device_name(i) for i in range(n)], "backend": kind})
    except Exception as e:  # noqa: BLE001 - a broken driver is a finding, not a crash
        out.append({"type": "cuda", "count": 0, "error": str(e)})
    for name in ("xpu", "mps"):
        mod = getattr(torch, name, None) if name == "xpu" else getattr(torch.backends, "mps", None)
        try:
            if mod is not None and mod.is_available():
                cnt = mod.device_count() if hasattr(mod, "device_count") else 1
                out.append({"type": name, "count": cnt})
        except Exception as e:  # noqa: BLE001
            out.append({"type": name, "count": 0, "error": str(e)})
    return out


def _serving_kernel(rows: list[dict], device_type: str) -> dict[str, Any] | None:
    """The row of the kernel a transfer on ``device_type`` gets for a format no kernel claims
    specifically (``kvcore.kernels.select_kernel``, so ``KVCORE_KERNEL`` is honoured)."""

    try:
        k = kernels.select_kernel(device_type, "", device_type)
    except TransferError as e:
        return {"name": None, "why": str(e)}
    return next((r for r in rows if r["name"] == k.name), {"name": k.name, "why": k.why()})


def cmd_doctor(args: argparse.Namespace, probe: Callable[[], list[dict[str, Any]]] = _devices) -> int:
    """``kvcore doctor``; ``probe`` lists the devices present (:func:`_devices`; a test stands
    in one this host lacks)."""
    plugin_warnings = load_plugins_capturing(report=False)
    rows = kernels.kernel_report()
    devices = probe()
    serving = {}
    for d in devices:
        k = _serving_kernel(rows, d["type"])
        specific = [r["name"] for r in rows if d["type"] in r["device_types"] and r["formats"] != "all" and r["available"]]
        serving[d["type"]] = {"kernel": k["name"], "why": k["why"], "format_specific": specific}
    # device types a registered kernel claims but no device of is present (the reference kernel
    # claims several): one row each, whichever plugins are installed or disabled
    for dt in sorted({t for r in rows for t in r["device_types"] if t != "meta"} - set(serving)):
        ks = [r["name"] for r in rows if dt in r["device_types"] and r["priority"] > 0]
        fallback = [r["name"] for r in rows if dt in r["device_types"] and r["priority"] <= 0]  # the reference kernel
        why = f"no {dt} device present; kernels for it: {', '.join(ks or fallback)}"
        serving[dt] = {"kernel": None, "why": why, "format_specific": [], "fallback": fallback if ks else []}
    compilers = {}
    for c in ("c++", "g++", "clang++", "nvcc", "hipcc", "icpx", "ninja"):
        p = shutil.which(c)
        if p is None and c == "nvcc" and os.environ.get("CUDA_HOME"):
            cand = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
            p = cand if os.path.exists(cand) else None
        compilers[c] = p
    env = {k: v for k, v in os.environ.items() if k.startswith("KVCORE_")}
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "kvcore": kvcore.__version__,
        "torch": torch.__version__,
        "torch_cuda": getattr(torch.version, "cuda", None),
        "devices": devices,
        "plugins": [i.as_dict() for i in kvcore.plugins()],
        "plugin_warnings": plugin_warnings,
        "disabled_plugins": registry.disabled_plugins(),
        "kernels": rows,
        "serving": serving,
        "compilers": compilers,
        "env": env,
    }
    if args.json:
        print_json(report)
        return EXIT_OK
    print(f"python     {report['python']}  ({report['platform']})")
    print(f"kvcore     {report['kvcore']}")
    print(f"torch      {report['torch']}" + (f"  (CUDA {report['torch_cuda']})" if report["torch_cuda"] else ""))
    # long lines wrap at 100 columns under their label; a path or a command is never broken
    col = " " * 11
    dev_text = "; ".join(f"{d['type']} x{d['count']}" + (f" ({', '.join(d['names'])})" if d.get("names") else "") for d in devices)
    print(fill(dev_text, initial_indent="devices    ", subsequent_indent=col))
    ok = [i for i in kvcore.plugins() if not i.error]
    bad = [i for i in kvcore.plugins() if i.error]
    print(fill(", ".join(f"{i.name} {i.version or ''}".strip() for i in ok), initial_indent="plugins    ", subsequent_indent=col))
    for i in bad:
        print(fill(f"{i.name}: {i.error}", initial_indent="  FAILED   ", subsequent_indent=col))
    off = registry.disabled_plugins()
    if off:
        print(
            fill(
                f"{', '.join(off)} (KVCORE_DISABLE_PLUGINS / kvcore.disable_plugins: not loaded)",
                initial_indent="disabled   ",
                subsequent_indent=col,
            )
        )
    print("\nkernels")
    kernel_table = table(
        [
            [
                r["name"],
                ",".join(r["device_types"]),
                r["formats"] if r["formats"] == "all" else len(r["formats"]),
                r["priority"],
                "yes" if r["available"] else "no",
            ]
            for r in rows
        ],
        ["name", "devices", "formats", "priority", "available"],
    )
    print(textwrap.indent(kernel_table, "  "))
    for r in rows:
        print(fill(f"{r['name']}: {r['why']}", width=100, initial_indent="  ", subsequent_indent="      "))
    print("\nserving (the kernel a transfer on each device type gets, for any format)")
    for dev, sv in serving.items():
        extra = f"; format-specific kernels: {', '.join(sv['format_specific'])}" if sv["format_specific"] else ""
        if sv.get("fallback"):
            extra += f"; also {', '.join(sv['fallback'])} (the fallback for any device)"
        print(fill(f"{sv['kernel'] or '- (' + sv['why'] + ')'}{extra}", initial_indent=f"  {dev:<6} ", subsequent_indent=" " * 9))
    print()
    print(fill(", ".join(f"{c}={'yes' if p else 'no'}" for c, p in compilers.items()), initial_indent="compilers  ", subsequent_indent=col))
    if env:
        print(fill(" ".join(f"{k}={v}" for k, v in env.items()), initial_indent="env        ", subsequent_indent=col))
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_json_flag(p)
