"""Every code block of README.md, docs/*.md and plugins/*/README.md runs (the convention:
tests/docs_blocks.py). The plugin guide's plugin is made from its own blocks and installed
into a fresh venv by its own steps."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

_spec = importlib.util.spec_from_file_location("kvcore_docs_blocks", Path(__file__).with_name("docs_blocks.py"))
_db = importlib.util.module_from_spec(_spec)
sys.modules["kvcore_docs_blocks"] = _db  # dataclasses look their module up
_spec.loader.exec_module(_db)
ROOT, SKIP_WORDS, TAGS, Block, blocks, documents = _db.ROOT, _db.SKIP_WORDS, _db.TAGS, _db.Block, _db.blocks, _db.documents

DOCS = documents()


def _all() -> list[Block]:
    return [b for d in DOCS for b in blocks(d)]


def test_every_block_follows_the_convention():
    bad = []
    for b in _all():
        if b.tag not in TAGS:
            bad.append(f"{b.id}: tag {b.tag!r} (tag every fence: {', '.join(TAGS)})")
        if b.skip is not None and not any(w in b.skip.lower() for w in (*SKIP_WORDS, "excerpt", "setup", "benchmark")):
            bad.append(f"{b.id}: skip reason {b.skip!r} names no GPU, live engine, processes, checkout, setup, excerpt or benchmark")
        if b.skip == "":
            bad.append(f"{b.id}: a skip marker without its reason")
        if b.tag == "text" and (b.skip or b.file):
            bad.append(f"{b.id}: a text block is never run; it needs no marker")
        if b.file and b.tag not in ("toml", "python"):
            bad.append(f"{b.id}: a file marker on a {b.tag} block")
    assert not bad, "\n".join(bad)


def test_the_collector_reads_markers_and_refuses_malformed_documents(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(
        "text\n\n<!-- docs: skip needs a GPU -->\n```bash\nnvidia-smi\n```\n\n<!-- docs: file a/b.toml -->\n```toml\nx = 1\n```\n"
        "```python\n# file: a/c.py\nX = 1\n```\n```text\nout\n```\n"
    )
    got = [(b.tag, b.skip, b.file, b.line) for b in blocks(doc)]
    assert got == [
        ("bash", "needs a GPU", None, 4),
        ("toml", None, "a/b.toml", 9),
        ("python", None, "a/c.py", 12),
        ("text", None, None, 16),
    ]
    for bad, why in (
        ("```python\nx = 1\n", "unclosed fence"),
        ("<!-- docs: skip needs a GPU -->\n\n```bash\nx\n```\n", "right before a fence"),
        ("  ```python\nx\n  ```\n", "indented fence"),
    ):
        doc.write_text(bad)
        with pytest.raises(ValueError, match=why):
            blocks(doc)


def _editable_installed(req: str = "requirements-dev.txt") -> set[str]:
    """The paths requirements-dev.txt installs editable, through the files it includes with
    ``-r`` (what the test venv already has)."""
    out = set()
    for line in (ROOT / req).read_text().splitlines():
        if line.startswith("-e "):
            out.add(line[3:].strip().split("[")[0].rstrip("/") or ".")
        elif line.startswith("-r "):
            out |= _editable_installed(line[3:].strip())
    return out


def _already_done(cmd: str) -> bool:
    """Two kinds of line the test venv has already run (checked, not repeated): ``pip install -e
    PATH ...`` of paths requirements-dev.txt installs editable, and ``pytest PATH`` of test paths
    the suite itself collects."""
    words = shlex.split(cmd)
    if words[:3] == ["pip", "install", "-e"]:
        paths = [w.split("[")[0].rstrip("/") for w in words[2:] if w != "-e" and not w.startswith("-")]
        missing = [x for x in paths if x not in _editable_installed()]
        assert not missing, f"`{cmd}`: {missing} are not installed editable by requirements-dev.txt"
        return True
    if words[:3] == ["python", "-m", "pytest"] or words[:1] == ["pytest"]:
        paths = [w for w in words if "/" in w and not w.startswith("-")]
        if paths:
            assert all((ROOT / x).exists() for x in paths), f"`{cmd}`: a test path does not exist"
            return True
    return False


def _bash(code: str, cwd: Path, env: dict, *, fresh: bool = False) -> None:
    for line in code.replace("\\\n", " ").split("\n"):  # a trailing backslash continues the command
        cmd = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not cmd or (not fresh and _already_done(cmd)):
            continue
        r = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"`{cmd}` exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _write(b: Block, scratch: Path) -> None:
    path = scratch / b.file
    path.parent.mkdir(parents=True, exist_ok=True)
    body = b.code.split("\n", 1)[1] if b.code.startswith("# file: ") else b.code
    path.write_text(body + "\n")


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "plugins.md"], ids=lambda d: str(d.relative_to(ROOT)))
def test_the_document_runs(doc, tmp_path, monkeypatch):
    """Python blocks run in order in one namespace; bash blocks in the checkout with this
    venv's bin first on PATH; toml blocks parse."""
    ran = 0
    ns: dict = {"__name__": "__docs__"}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    monkeypatch.chdir(ROOT)
    for b in blocks(doc):
        if b.skip is not None or b.tag == "text":
            continue
        if b.tag == "toml":
            tomllib.loads(b.code)
        elif b.tag == "python":
            exec(compile(b.code, b.id, "exec"), ns)  # noqa: S102 - the documents' own code
        elif b.tag == "bash":
            _bash(b.code, ROOT, env)
        ran += 1
    if ran == 0:
        pytest.skip(f"{doc.name}: every block is marked (each marker says why)")


def test_the_plugin_guide_runs_in_a_fresh_venv(tmp_path):
    """docs/plugins.md: the files its blocks give make the plugin; its own steps install kvcore
    and the plugin into a fresh venv, list and check it; its python blocks run there. The
    fresh venv sees this venv's third-party packages through a .pth (torch is 2 GB); kvcore
    and the plugin are installed into it by the guide's commands."""
    guide = ROOT / "docs" / "plugins.md"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    )
    Path(site.stdout.strip(), "_main_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", KVCORE_SRC=str(ROOT))
    scratch = tmp_path / "work"
    scratch.mkdir()
    ran = []
    for b in blocks(guide):
        if b.skip is not None or b.tag == "text":
            continue
        if b.file:
            _write(b, scratch)
        elif b.tag == "toml":
            tomllib.loads(b.code)
        elif b.tag == "bash":
            _bash(b.code, scratch, env, fresh=True)
        elif b.tag == "python":
            r = subprocess.run([str(py), "-c", b.code], cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"{b.id}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        ran.append(b.id)
    assert (scratch / "kvcore-tinyllm" / "pyproject.toml").exists()
    show = subprocess.run([str(py), "-m", "pip", "show", "kvcore-tinyllm"], capture_output=True, text=True, env=env)
    assert "Requires: kvcore" in show.stdout, show.stdout + show.stderr
    assert len(ran) >= 5
