"""scripts/setup_venv.py, the README's two commands and CI: the demo's install is the light one,
the test command after it installs only the rest, and an unchanged requirements file is not
installed again."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("setup_venv", ROOT / "scripts" / "setup_venv.py")
setup_venv = importlib.util.module_from_spec(_spec)
sys.modules["setup_venv"] = setup_venv
_spec.loader.exec_module(setup_venv)


def _fake_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "pyproject.toml").write_text('[project]\nname = "pkg"\ndependencies = ["a"]\n')
    (root / "requirements.txt").write_text("torch==2.13.0\n-e pkg\n")
    (root / "requirements-test.txt").write_text("pytest>=8\n")
    (root / "requirements-dev.txt").write_text("-r requirements.txt\n-r requirements-test.txt\n")
    (root / ".venv").mkdir()
    return root


def test_an_unchanged_file_is_installed_once_and_a_change_is_seen(tmp_path, monkeypatch):
    root = _fake_checkout(tmp_path)
    venv = root / ".venv"
    ran: list[list[str]] = []
    monkeypatch.setattr(setup_venv, "_venv_python", lambda v: "3.11.7")
    monkeypatch.setattr(setup_venv.subprocess, "run", lambda cmd, **kw: ran.append(cmd))

    def pip_runs(req: str) -> int:
        before = len(ran)
        setup_venv.install(venv, req, root=root)
        return len(ran) - before

    assert pip_runs("requirements.txt") == 1
    assert ran[-1][-3:] == ["install", "-r", "requirements.txt"]
    assert pip_runs("requirements.txt") == 0  # the demo command again: nothing
    assert pip_runs("requirements-test.txt") == 1  # the test command after it: only the rest
    assert pip_runs("requirements.txt") == 0 and pip_runs("requirements-test.txt") == 0
    assert set(json.loads((venv / setup_venv.STAMP).read_text())) == {"requirements.txt", "requirements-test.txt"}

    (root / "pkg" / "pyproject.toml").write_text('[project]\nname = "pkg"\ndependencies = ["a", "b"]\n')
    assert pip_runs("requirements.txt") == 1  # an editable path's dependencies changed
    assert pip_runs("requirements-test.txt") == 0
    (root / "requirements-test.txt").write_text("pytest>=8\nhypothesis\n")
    assert pip_runs("requirements-test.txt") == 1
    monkeypatch.setattr(setup_venv, "_venv_python", lambda v: "3.12.1")
    assert pip_runs("requirements.txt") == 1  # another interpreter: installed again
    assert setup_venv.install(venv, "requirements.txt", root=root, force=True)


def test_the_digest_follows_included_files(tmp_path):
    root = _fake_checkout(tmp_path)
    dev = root / "requirements-dev.txt"
    inputs = {p.relative_to(root).as_posix() for p in setup_venv._inputs(dev.resolve())}
    assert inputs == {"requirements-dev.txt", "requirements.txt", "requirements-test.txt", "pkg/pyproject.toml"}
    before = setup_venv.digest(dev, "3.11.7", root)
    (root / "requirements-test.txt").write_text("pytest>=9\n")
    assert setup_venv.digest(dev, "3.11.7", root) != before


def _requirements(name: str) -> tuple[set[str], set[str]]:
    """(requirement names, editable paths) of ``name``, through its includes."""
    names, paths = set(), set()
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            n, p = _requirements(line[3:])
            names, paths = names | n, paths | p
        elif line.startswith("-e "):
            paths.add(line[3:])
        elif line:
            names.add(re.split(r"[<>=!~\[ ]", line, maxsplit=1)[0].lower())
    return names, paths


def _closure(name: str) -> set[str]:
    """The requirement names ``name`` installs directly and through its editable paths' pyproject."""
    names, paths = _requirements(name)
    for p in paths:
        deps = tomllib.loads((ROOT / p / "pyproject.toml").read_text())["project"].get("dependencies", [])
        names |= {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in deps}
    return names


def test_the_demo_install_is_the_light_one_and_dev_is_both():
    demo, demo_paths = _requirements("requirements.txt")
    assert demo_paths == {".", "plugins/vllm"}
    assert not _closure("requirements.txt") & {"triton", "pytest", "hypothesis", "ruff", "uv", "transformers"}
    test, test_paths = _requirements("requirements-test.txt")
    assert "triton" in test and not demo_paths & test_paths
    assert _requirements("requirements-dev.txt") == (demo | test, demo_paths | test_paths)


def test_the_readme_commands_come_first_and_ci_follows_the_test_command():
    readme = (ROOT / "README.md").read_text()
    bash = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    demo, tests = bash[0], bash[1]
    assert demo == "python3 scripts/setup_venv.py && .venv/bin/kvcore demo"
    assert tests == "python3 scripts/setup_venv.py --test && .venv/bin/python -m pytest"
    assert readme.index(demo) < readme.index(tests) < readme.index("```python")
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [line for line in ci.splitlines() if line and not line.startswith("#")]
    assert "python3 scripts/setup_venv.py --test" in steps
    assert steps[-1].endswith(".venv/bin/python -m pytest")
    assert steps.index("python3 scripts/setup_venv.py --test") < len(steps) - 1
