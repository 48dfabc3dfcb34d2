#!/usr/bin/env python3
"""Set up the checkout's virtualenv ``.venv`` (the README's two commands run this first).

    python3 scripts/setup_venv.py          the demo's needs: requirements.txt (torch, kvcore, kvcore-vllm)
    python3 scripts/setup_venv.py --test   and the tests': requirements-test.txt, then the engine
                                           environments (scripts/engine_envs.py, .venvs/)
    python3 scripts/setup_venv.py --force  install again even where nothing changed

Each requirements file is installed once: its digest (the file's text, the text of every
file it includes with ``-r``, the ``pyproject.toml`` of every path it installs editable, the
checkout's path and the venv's Python) is recorded in ``.venv/.kvcore-setup.json``, and a
file whose digest is unchanged is not installed again. pip itself cannot skip that work: it
rebuilds every editable install on every run even when nothing changed (``pip install -r
requirements-dev.txt`` over a complete venv: 41 s of CPU time, 150 s on a loaded 2-core
machine; this script then takes 2.5 s). Editing kvcore's code needs no reinstall (the installs are
editable); editing a requirements file or a ``pyproject.toml`` does, and is seen.

pip runs without ``-q``: what it collects, downloads and builds is printed as it goes; the
unpacking that follows ("Installing collected packages") prints nothing until it ends, so the
script says beforehand what it is waiting for. Standard library only (it runs before the venv
exists).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = ".kvcore-setup.json"
#: what each level installs, in order; --test adds the second
DEMO = "requirements.txt"
TEST = "requirements-test.txt"
#: what to expect while pip is quiet (measured: README, "First run")
NOTE = {
    DEMO: "about 225 MB to download (torch's CPU build 192 MB); pip then unpacks about 1 GB without output: 1-2 minutes",
    TEST: "Triton (about 1 GB) and the other plugins; pip then unpacks them without output; then the engine environments",
}


def _say(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def _inputs(req: Path, seen: set[Path] | None = None) -> list[Path]:
    """The files whose text decides what installing ``req`` does: ``req``, the files it
    includes (``-r``/``-c``, recursively), and each editable path's ``pyproject.toml`` (its
    dependencies and entry points)."""
    seen = set() if seen is None else seen
    if req in seen:
        return []
    seen.add(req)
    out = [req]
    for raw in req.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        for flag in ("-r ", "-c ", "--requirement ", "--constraint "):
            if line.startswith(flag):
                out += _inputs((req.parent / line[len(flag) :].strip()).resolve(), seen)
        for flag in ("-e ", "--editable "):
            if line.startswith(flag):
                path = (req.parent / line[len(flag) :].strip().split("[", 1)[0]).resolve()
                out += [p for p in (path / "pyproject.toml", path / "setup.py", path / "setup.cfg") if p.exists()]
    return out


def digest(req: Path, python: str, root: Path = ROOT) -> str:
    """The digest recorded for ``req`` (see the module docstring)."""
    h = hashlib.sha256(f"{root}\n{python}\n".encode())
    for path in _inputs(req.resolve()):
        h.update(f"{path.relative_to(root) if path.is_relative_to(root) else path}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _venv_python(venv: Path) -> str | None:
    """The venv's ``sys.version`` (None when it has no working interpreter)."""
    py = venv / "bin" / "python"
    try:
        r = subprocess.run([str(py), "-c", "import sys; print(sys.version)"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _load(stamp: Path) -> dict:
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def install(venv: Path, req: str, *, force: bool = False, root: Path = ROOT) -> bool:
    """Install ``root/req`` into ``venv`` unless its recorded digest is current; True when pip ran.

    Raises:
        subprocess.CalledProcessError: pip failed (nothing is recorded then).
    """
    python = _venv_python(venv) or ""
    stamp = venv / STAMP
    key = digest(root / req, python, root)
    if not force and _load(stamp).get(req) == key:
        shown = stamp.relative_to(root) if stamp.is_relative_to(root) else stamp
        _say(f"{req}: unchanged since it was installed (recorded in {shown}): skipped")
        return False
    _say(f"{req}: pip install -r {req}")
    if req in NOTE:
        _say(f"  {NOTE[req]}")
    t0 = time.monotonic()
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-r", req], cwd=root, check=True)
    stamp.write_text(json.dumps({**_load(stamp), req: key}, indent=1, sort_keys=True) + "\n")
    _say(f"{req}: installed in {time.monotonic() - t0:.0f} s")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="setup_venv.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--test", action="store_true", help="also install what the tests need, and the engine environments")
    p.add_argument("--force", action="store_true", help="install again even where nothing changed")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    venv = ROOT / ".venv"
    if _venv_python(venv) is None:
        _say(f"creating {venv.relative_to(ROOT)} ({sys.executable} -m venv)")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    try:
        install(venv, DEMO, force=a.force)
        if a.test:
            install(venv, TEST, force=a.force)
            _say("engine environments: scripts/engine_envs.py (each skipped while its entry is unchanged)")
            subprocess.run([str(venv / "bin" / "python"), "scripts/engine_envs.py"], cwd=ROOT, check=True)
    except subprocess.CalledProcessError as e:
        _say(f"failed: {' '.join(map(str, e.cmd))} exited {e.returncode}")
        return e.returncode or 1
    _say(f"ready in {time.monotonic() - t0:.0f} s: {venv.relative_to(ROOT)}/bin/kvcore, {venv.relative_to(ROOT)}/bin/python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
