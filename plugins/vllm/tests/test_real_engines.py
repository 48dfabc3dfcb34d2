"""The real vLLM engines' suites (``plugins/vllm/tests/engine``), run from the main test run.

Each vLLM release kvcore proves against its running engine lives in its own virtualenv
(``scripts/engine_envs.py``: ``.venvs/vllm-0.32``, ``.venvs/vllm-0.28``; the README's test
command makes them). This module runs the engine suite inside each of them, all at once (each
engine process is mostly single-threaded), and fails with the inner run's report when one
fails. Run one by hand with ``.venvs/vllm-0.32/bin/python -m pytest plugins/vllm/tests/engine``.

A missing env is a skip here (a developer who has not made it); with ``KVCORE_REQUIRE_ENGINES=1``
(CI sets it) it is a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("engine_envs", ROOT / "scripts" / "engine_envs.py")
engine_envs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("engine_envs", engine_envs)
_spec.loader.exec_module(engine_envs)

VLLM_ENVS = [e for e in engine_envs.ENVS if e.name.startswith("vllm-")]
REQUIRED = os.environ.get("KVCORE_REQUIRE_ENGINES", "") not in ("", "0")
#: the inner runs' limit: a hung engine must not hang the suite
TIMEOUT_S = 1500


class _Runs:
    """The engine suites, started together on first use."""

    def __init__(self) -> None:
        self.procs: dict[str, tuple[subprocess.Popen, float]] = {}
        self.results: dict[str, tuple[int, str, float]] = {}

    def start(self) -> None:
        if self.procs or self.results:
            return
        for env in VLLM_ENVS:
            if not engine_envs.up_to_date(env):
                continue
            py = engine_envs.venv_dir(env) / "bin" / "python"
            cmd = [str(py), "-m", "pytest", "plugins/vllm/tests/engine", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
            p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.procs[env.name] = (p, time.monotonic())

    def result(self, name: str) -> tuple[int, str, float]:
        if name not in self.results:
            p, t0 = self.procs[name]
            try:
                out, _ = p.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += f"\n[killed after {TIMEOUT_S} s]"
            self.results[name] = (p.returncode, out, time.monotonic() - t0)
        return self.results[name]


_RUNS = _Runs()


@pytest.mark.parametrize("env", VLLM_ENVS, ids=lambda e: e.name)
def test_engine_suite_passes_inside_the_real_engine(env):
    if not engine_envs.up_to_date(env):
        msg = f".venvs/{env.name} is missing or stale: run python3 scripts/engine_envs.py (the README's test command does)"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    _RUNS.start()
    rc, out, secs = _RUNS.result(env.name)
    tail = "\n".join(out.splitlines()[-60:])
    assert rc == 0, f"{env.name}: the engine suite failed (rc {rc}, {secs:.0f} s):\n{tail}"
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) >= 40, f"{env.name}: the engine suite ran too few tests:\n{tail}"
    assert " failed" not in out.splitlines()[-1]
