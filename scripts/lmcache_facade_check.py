"""Run LMCache's own unit tests for ``gpu_connector/utils.py`` and ``kv_format`` against
``kvcore.compat.lmcache``, with only the imports changed.

LMCache's test code is not part of this repository: the script reads it at run time from
a local LMCache source tree, rewrites each ``lmcache`` import to the facade, writes the
rewritten files into a temporary folder and runs pytest there.

Getting the tests (the released sdist carries ``tests/``; its metadata build fails without
CUDA, so keep pip's unpacked copy)::

    pip download --no-deps --no-binary :all: --no-build-isolation --no-clean lmcache==0.5.6 -d /tmp/lmc
    # pip stops at "Encountered error while generating package metadata"; the unpacked
    # tree stays under /tmp/pip-download-*/lmcache_*/ (a folder holding tests/ and lmcache/)
    python3 scripts/lmcache_facade_check.py /tmp/pip-download-XXXX/lmcache_YYYY

or a git checkout of https://github.com/LMCache/LMCache. ``PATH`` may be the tree's root,
its ``tests/v1/gpu_connector`` folder, or any folder holding the test files.

The import rewrite (one statement for one statement, line numbers kept):

====================================================  ===========================================
LMCache                                               here
====================================================  ===========================================
``lmcache.v1.gpu_connector.utils``                    ``kvcore.compat.lmcache``
``lmcache.v1.gpu_connector.kv_format`` (and its        ``kvcore.compat.lmcache``
``types``, ``contiguity``, ``detection``, ``specs``)
``lmcache.lmcache_native`` / ``lmcache.c_ops``        ``kvcore.compat.lmcache`` (the enum and
                                                      its predicates)
``lmcache.device_ops``, ``lmcache.v1.platform.         ``kvcore.compat.lmcache``
ops_types`` (``PageBufferShapeDesc``)
``lmcache.utils`` (``EngineType``)                    ``kvcore.compat.lmcache``
``lmcache.torch_device_type`` / ``torch_dev``,         ``lmcache_facade_host`` (written next to the
the vLLM detector's ``torch_device_type`` (a           tests: the host's device type; with no
``monkeypatch`` target)                                accelerator the CPU is the device)
any other ``lmcache`` module (layer groups, the MP    a stub: using it skips the test as
transfer context, the torch transfer fallback)         *out of scope* (named in the skip reason)
====================================================  ===========================================

Tests that use a name outside the facade through an in-scope module are listed in
:data:`OUT_OF_SCOPE_TESTS` (deselected, with the reason). Failures named in
:data:`DELIBERATE` are the facade's documented differences (``kvcore.compat.lmcache``'s
docstring table); any other failure is unexpected.

Usage::

    python3 scripts/lmcache_facade_check.py LMCACHE_TREE [--json OUT.json] [--keep DIR] [-- PYTEST_ARGS...]

Exit code 0 when every failure is a documented deliberate difference.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

FACADE = "kvcore.compat.lmcache"
HOST = "lmcache_facade_host"

#: LMCache's unit tests for ``gpu_connector/utils.py`` and the ``kv_format`` package
#: (``tests/v1/gpu_connector/``); files an older tree lacks are skipped.
TEST_FILES = (
    "test_kv_format_classification.py",
    "test_kv_format_specs.py",
    "test_kv_format_detection.py",
    "test_concrete_shape.py",
    "test_utils_shape_desc.py",
    "test_normalize_per_layer_formats.py",
    "test_per_layer_kv_tuple_format.py",
    "test_blocks_first_detection.py",
    "test_blocks_first_cs_kv_format.py",
)

#: LMCache module -> the module it becomes.
MODULE_MAP = {
    "lmcache.v1.gpu_connector.utils": FACADE,
    "lmcache.v1.gpu_connector.kv_format": FACADE,
    "lmcache.v1.gpu_connector.kv_format.types": FACADE,
    "lmcache.v1.gpu_connector.kv_format.contiguity": FACADE,
    "lmcache.v1.gpu_connector.kv_format.detection": FACADE,
    "lmcache.v1.gpu_connector.kv_format.specs": FACADE,
    "lmcache.v1.gpu_connector.kv_format.specs.registry": FACADE,
    "lmcache.lmcache_native": FACADE,
    "lmcache.c_ops": FACADE,
    "lmcache.device_ops": FACADE,
    "lmcache.v1.platform.ops_types": FACADE,
    "lmcache.utils": FACADE,
    # the vLLM detector's module global the tests monkeypatch (torch_device_type): the facade's own
    # (kvcore.compat.lmcache.torch_device_type, the platform LMCache's adapters state)
    "lmcache.v1.gpu_connector.kv_format.detectors.vllm": FACADE,
}
#: names imported from the ``lmcache`` package itself that describe the host.
HOST_NAMES = ("torch_device_type", "torch_dev")

#: tests that reach a name outside the facade through an in-scope module.
OUT_OF_SCOPE_TESTS = {
    "test_blocks_first_cs_kv_format.py::test_multi_layer_block_kv_transfer_roundtrip": (
        "drives LMCache's torch transfer fallback (lmcache.v1.platform.torch_ops) with "
        "lmcache_native.TransferDirection: the transfer kernels, not kv_format"
    ),
}

#: failures that are the facade's documented deliberate differences (the table in
#: kvcore.compat.lmcache's docstring), as a regex on the test id -> the table row and why.
_PACKED = "packed K|V (CS, TWO_HS): head_size is the K head size, kv_size 2, hidden_dim NH*HS (kvcore stages K and V apart)"
DELIBERATE: dict[str, str] = {
    r"test_kv_format_specs\.py::test_scalar_geometry\[NL_X_NB_(NH_BS|BS_NH)_(CS|TWO_HS)\]": _PACKED,
    r"test_blocks_first_cs_kv_format\.py::test_accessors": _PACKED,
    r"test_kv_format_specs\.py::test_deprecated_two_hs_specs_warn": (
        "TWO_HS specs: no DeprecationWarning (kvcore's vLLM plugin detects NL_X_NB_BS_NH_TWO_HS, TPU Pallas, as current)"
    ),
    r"test_blocks_first_detection\.py::test_compact_views_declared_blocks_first_still_classify": (
        "detection: a hint contradicting the strides raises (tight per-layer tensors declared BLHNC: a blocks-first "
        "cache's per-layer views step over every layer's block)"
    ),
    r"test_blocks_first_detection\.py::test_detects_per_layer_format_with_views_unchanged\[BLNHC": (
        "detection: kvcore-vllm reads a vLLM 0.33 per-layer view as [NB, NH, BS, C] (create_kv_cache_views), so these "
        "[NB, BS, NH, CS] views have BLHNC strides and contradict the BLNHC hint"
    ),
    r"test_blocks_first_detection\.py::test_non_tight_inner_dims_rejected": (
        "detection: strided views are described (kvcore reads strides), not refused as 'dim-0 padding only'"
    ),
}

HOST_MODULE = '''"""Host facts LMCache's tests read from the ``lmcache`` package (written by
scripts/lmcache_facade_check.py). With no accelerator the CPU is the device: the tests
that need one only compare pointers and shapes."""
import pytest
import torch

torch_device_type = "cuda" if torch.cuda.is_available() else "cpu"


class _HostDevice:
    @staticmethod
    def is_available():
        return True


torch_dev = torch.cuda if torch.cuda.is_available() else _HostDevice()


class _OutOfScope:
    def __init__(self, name):
        self._name = name

    def _skip(self):
        pytest.skip(f"out of scope: uses {self._name}, which is not part of gpu_connector/utils.py or kv_format")

    def __call__(self, *a, **k):
        self._skip()

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._skip()


def out_of_scope(name):
    return _OutOfScope(name)
'''


def _target(module: str) -> str | None:
    return MODULE_MAP.get(module)


def _rewrite_import(node: ast.stmt) -> str | None:
    """The replacement statement(s) for one ``lmcache`` import, or None when not one."""
    out: list[str] = []
    if isinstance(node, ast.Import):
        if not any(a.name == "lmcache" or a.name.startswith("lmcache.") for a in node.names):
            return None
        for a in node.names:
            if not (a.name == "lmcache" or a.name.startswith("lmcache.")):
                out.append(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
                continue
            tgt = _target(a.name)
            bound = a.asname or a.name.split(".")[0]
            if tgt and a.asname:
                out.append(f"import {tgt} as {a.asname}")
            elif tgt:
                raise SystemExit(f"cannot rewrite 'import {a.name}' without 'as' (it binds the lmcache package)")
            else:
                out.append(f"import {HOST}; {bound} = {HOST}.out_of_scope({a.name!r})")
        return "; ".join(out)
    if isinstance(node, ast.ImportFrom) and node.module and (node.module == "lmcache" or node.module.startswith("lmcache.")):
        for a in node.names:
            bound = a.asname or a.name
            full = f"{node.module}.{a.name}"
            if _target(full):
                out.append(f"import {_target(full)} as {bound}")
            elif _target(node.module):
                out.append(f"from {_target(node.module)} import {a.name}" + (f" as {a.asname}" if a.asname else ""))
            elif node.module == "lmcache" and a.name in HOST_NAMES:
                out.append(f"from {HOST} import {a.name}" + (f" as {a.asname}" if a.asname else ""))
            else:
                out.append(f"import {HOST}; {bound} = {HOST}.out_of_scope({full!r})")
        return "; ".join(out)
    return None


_DOTTED = re.compile(r"""(["'])(lmcache(?:\.[A-Za-z_][A-Za-z0-9_]*)+)\1""")


def _rewrite_dotted(match: re.Match) -> str:
    """A ``"lmcache.a.b.attr"`` string (a monkeypatch target) -> the mapped module's path."""
    q, path = match.group(1), match.group(2)
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        tgt = _target(".".join(parts[:i]))
        if tgt:
            return q + ".".join([tgt] + parts[i:]) + q
    return match.group(0)


def rewrite(source: str) -> str:
    """Rewrite every ``lmcache`` import (any nesting) and dotted ``"lmcache..."`` string;
    nothing else changes, and line numbers stay."""
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            new = _rewrite_import(node)
            if new is not None:
                edits.append((node.lineno, node.end_lineno, node.col_offset, new))
    for start, end, col, new in sorted(edits, reverse=True):
        indent = lines[start - 1][:col]
        blank = ["\n"] * (end - start)
        lines[start - 1 : end] = [indent + new + "\n"] + blank
    return _DOTTED.sub(_rewrite_dotted, "".join(lines))


def _find_tests(root: Path) -> list[Path]:
    for cand in (root / "tests" / "v1" / "gpu_connector", root):
        found = [cand / f for f in TEST_FILES if (cand / f).is_file()]
        if found:
            return found
    raise SystemExit(f"no LMCache kv_format/utils tests under {root} (looked for {', '.join(TEST_FILES)})")


def _classify(nodeid: str) -> str | None:
    for pat, why in DELIBERATE.items():
        if re.search(pat, nodeid):
            return why
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lmcache_tree", type=Path, help="LMCache source tree (or a folder holding its gpu_connector tests)")
    ap.add_argument("--json", type=Path, help="write the per-test results here")
    ap.add_argument("--keep", type=Path, help="write the rewritten tests here (kept) instead of a temporary folder")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)

    files = _find_tests(args.lmcache_tree.resolve())
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="lmcache-facade-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        (work / f"{HOST}.py").write_text(HOST_MODULE)
        for f in files:
            (work / f.name).write_text(rewrite(f.read_text()))
        junit = work / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rN",
            "--continue-on-collection-errors",
            f"--junitxml={junit}",
            f"--rootdir={work}",
        ]
        for tid in OUT_OF_SCOPE_TESTS:
            if (work / tid.split("::")[0]).exists():
                cmd += ["--deselect", tid]
        cmd += [f.name for f in files] + list(args.pytest_args)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        subprocess.run(cmd, cwd=work, env=env, check=False)
        results = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            cls = case.get("classname") or ""
            if cls:
                nodeid = f"{cls.split('.')[-1]}.py::{case.get('name')}"
            else:  # a file that could not be collected
                nodeid = f"{case.get('name')}.py (collection)"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else ""
                    break
            results.append({"test": nodeid, "outcome": outcome, "message": message})
        for tid, why in OUT_OF_SCOPE_TESTS.items():
            if (work / tid.split("::")[0]).exists():
                results.append({"test": tid, "outcome": "out_of_scope", "message": why})
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    counts: dict[str, int] = {}
    unexpected = []
    print("\n== LMCache kv_format / utils tests through kvcore.compat.lmcache ==")
    for r in results:
        o = r["outcome"]
        if o in ("failed", "error"):
            why = _classify(r["test"])
            if why:
                o = r["outcome"] = "deliberate"
                r["message"] = f"{why} | {r['message']}"
            else:
                unexpected.append(r)
        if o == "skipped" and "out of scope" in r["message"]:
            o = r["outcome"] = "out_of_scope"
        counts[o] = counts.get(o, 0) + 1
    for r in results:
        if r["outcome"] in ("deliberate", "out_of_scope", "skipped"):
            print(f"  {r['outcome']:<12} {r['test']}: {r['message']}")
    for r in unexpected:
        print(f"  UNEXPECTED {r['outcome']:<6} {r['test']}: {r['message']}")
    ran = sum(v for k, v in counts.items() if k != "out_of_scope")
    print(f"\n{counts.get('passed', 0)} of {ran} passed; " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "results": results}, indent=1))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
