"""docs/plugins.md shows what ``kvcore check tinyllm`` prints for the guide's own example
plugin: this test runs that plugin through the CLI, as a fresh install sees it (kvcore and
the example only), and holds the sample to the real output -- the header's and summary's
counts exactly, each shown line verbatim and in order (``...`` stands for lines left out;
the run time is the only free figure)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import kvcore
from kvcore import cli
from kvcore.kernels import _build

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()


def _sample() -> list[str]:
    m = re.search(r"kvcore check tinyllm +# one line per[^\n]*\n```\n\n```text\n(.*?)```", GUIDE, re.S)
    assert m, "docs/plugins.md lost the sample output of `kvcore check tinyllm`"
    return m.group(1).rstrip("\n").split("\n")


def _timeless(line: str) -> str:
    return re.sub(r"in \d+\.\d s$", "in N s", line)


def _follows(sample: list[str], real: list[str]) -> str | None:
    """None when ``sample`` is ``real`` with runs of lines replaced by ``...``; else why not."""
    i, skipping = 0, False
    for n, want in enumerate(sample):
        if want == "...":
            skipping = True
            continue
        want = _timeless(want)
        if skipping:
            while i < len(real) and _timeless(real[i]) != want:
                i += 1
        if i >= len(real) or _timeless(real[i]) != want:
            got = real[i] if i < len(real) else "<end of output>"
            return f"sample line {n + 1} {want!r} is not in the real output in this place (real: {got!r})"
        i, skipping = i + 1, False
    if i != len(real) and not skipping:
        return f"the real output goes on after the sample's last line: {real[i : i + 3]}"
    return None


def test_the_guide_sample_is_the_real_output_of_kvcore_check(core_only, capsys, tmp_path):
    if not _build.load().loaded:
        pytest.skip(f"the sample shows native-cpu; native kernels unavailable here ({_build.status().reason})")
    block = re.search(r"```python\n# file: kvcore-tinyllm/tinyllm_kvcore/plugin.py\n(.*?)```", GUIDE, re.S)
    path = tmp_path / "tinyllm_plugin.py"
    path.write_text(block.group(1))
    spec = importlib.util.spec_from_file_location("tinyllm_plugin_for_sample", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tinyllm_plugin_for_sample"] = mod
    try:
        spec.loader.exec_module(mod)
        kvcore.register_plugin(mod, name="tinyllm")
        capsys.readouterr()
        assert cli.main(["check", "tinyllm"]) == 0
        real = capsys.readouterr().out.rstrip("\n").split("\n")
    finally:
        sys.modules.pop("tinyllm_plugin_for_sample", None)
    sample = _sample()
    assert sample[0] == real[0] and sample[0].startswith("kvcore check: ")  # the check count and kernels
    assert _timeless(sample[-1]) == _timeless(real[-1]) and " passed, 0 failed, " in real[-1]
    why = _follows(sample, real)
    assert why is None, why + "\nreal output:\n" + "\n".join(real)


def test_the_sample_matcher_fails_on_a_stale_sample():
    real = ["kvcore check: 3 checks", "", "PASS a", "PASS b", "SKIP c", "", "2 passed, 0 failed, 1 skipped in 1.0 s"]
    assert _follows(["kvcore check: 3 checks", "", "PASS a", "...", "SKIP c", "", "2 passed, 0 failed, 1 skipped in 9.9 s"], real) is None
    assert _follows(["kvcore check: 3 checks", "", "...", "PASS b", "PASS a", "...", "2 passed, 0 failed, 1 skipped in 1.0 s"], real)
    assert _follows(["kvcore check: 2 checks", "...", "2 passed, 0 failed, 1 skipped in 1.0 s"], real)
    assert _follows(["kvcore check: 3 checks", "", "PASS a", "PASS b"], real)  # stops short without "..."
    assert _follows(["kvcore check: 3 checks", "...", "3 passed, 0 failed, 0 skipped in 1.0 s"], real)
