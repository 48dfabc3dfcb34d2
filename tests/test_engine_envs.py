"""scripts/engine_envs.py: the engine environments whose own writers the suite runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("engine_envs", ROOT / "scripts" / "engine_envs.py")
engine_envs = importlib.util.module_from_spec(_spec)
sys.modules["engine_envs"] = engine_envs  # dataclasses look their module up
_spec.loader.exec_module(engine_envs)


def test_creation_is_idempotent_and_a_changed_entry_rebuilds(tmp_path, capsys):
    env = engine_envs.EngineEnv(name="toy", requirements=(), post_install=('echo "$PY" > "$ROOT/made"',))
    assert engine_envs.main([], envs=(env,), root=tmp_path) == 0
    made = (tmp_path / "made").read_text().strip()
    assert made == str(tmp_path / ".venvs" / "toy" / "bin" / "python")
    stamp = json.loads((tmp_path / ".venvs" / "toy" / engine_envs.STAMP).read_text())
    assert stamp == {"name": "toy", "digest": env.digest()}
    (tmp_path / "made").unlink()
    assert engine_envs.main([], envs=(env,), root=tmp_path) == 0
    assert not (tmp_path / "made").exists() and "toy: up to date" in capsys.readouterr().out
    changed = engine_envs.EngineEnv(name="toy", requirements=(), post_install=('echo again > "$ROOT/made"',))
    assert engine_envs.main(["--dry-run"], envs=(changed,), root=tmp_path) == 0
    out = capsys.readouterr().out
    assert "venv -q --clear" in out and "echo again" in out and not (tmp_path / "made").exists()
    assert engine_envs.main(["--list"], envs=(changed,), root=tmp_path) == 0
    assert "toy: missing or stale" in capsys.readouterr().out
    assert engine_envs.main(["--only", "nope"], envs=(changed,), root=tmp_path) == 2


def test_the_script_runs_with_the_declared_envs():
    out = subprocess.run(["python3", str(ROOT / "scripts" / "engine_envs.py"), "--list"], capture_output=True, text=True, check=True).stdout
    for env in engine_envs.ENVS:
        assert env.name in out


@pytest.mark.parametrize("env", engine_envs.ENVS, ids=lambda e: e.name)
def test_each_engine_env_proves_its_plugin_by_writer(env):
    if not engine_envs.up_to_date(env):
        pytest.skip(f".venvs/{env.name} is missing or stale: run python scripts/engine_envs.py (the README's test command does)")
    kv = engine_envs.venv_dir(env) / "bin" / "kvcore"
    r = subprocess.run(
        [str(kv), "check", *env.check], cwd=ROOT, env={**__import__("os").environ, **env.env}, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    proved = [line for line in r.stdout.splitlines() if line.strip().startswith("writers:")]
    assert proved and all(" 0 of " not in line for line in proved), proved
