"""Meta-checks: every hook is documented; every format an in-tree plugin registers has
fixtures and passes the conformance suite; every format a detector can return has a kernel
that moves it; the plugin guide's example and the TensorRT-LLM example pass."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

import kvcore
from kvcore import hookspecs, registry
from kvcore.testing import FixtureCase, suite

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "plugins.md").read_text()
OPTS = suite.Options(examples=3)


def _entry_points(pyproject: Path) -> list[str]:
    """Names in a pyproject's ``[project.entry-points.kvcore]`` table."""
    m = re.search(r"^\[project\.entry-points\.kvcore\]\n(.*?)(?:^\[|\Z)", pyproject.read_text(), re.S | re.M)
    return sorted(re.findall(r"^\s*([\w.-]+)\s*=", m.group(1), re.M)) if m else []


IN_TREE = sorted(n for p in (ROOT / "plugins").glob("*/pyproject.toml") for n in _entry_points(p))
HOOKS = sorted(name for name, fn in vars(hookspecs).items() if name.startswith("kvcore_") and callable(fn))


# -- documentation -------------------------------------------------------------------------


def test_the_hookspecs_are_what_the_guide_expects():
    assert {"kvcore_register_formats", "kvcore_detect", "kvcore_spec", "kvcore_register_kernels", "kvcore_register_fixtures"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_with_its_arguments(hook):
    params = list(inspect.signature(getattr(hookspecs, hook)).parameters)
    heading = re.search(rf"^#+ `{hook}\(([^)]*)\)`", GUIDE, re.M)
    assert heading, f"docs/plugins.md has no section '### `{hook}(...)`'"
    assert [p.strip() for p in heading.group(1).split(",") if p.strip()] == params


def test_every_fixture_field_and_check_is_documented():
    for f in dataclasses.fields(FixtureCase):
        assert f"`{f.name}" in GUIDE, f"FixtureCase.{f.name} is not documented in docs/plugins.md"
    for name in suite.CHECKS:
        assert f"`{name}" in GUIDE, f"check {name} is not documented in docs/plugins.md"
    for kind in suite.INVALID:
        assert f"[{kind}]" in GUIDE or f"`invalid[{kind}]`" in GUIDE
    for probe in suite.PROBES:
        assert f"[{probe}]" in GUIDE


# -- the in-tree plugins pass the suite ------------------------------------------------------


@pytest.fixture(scope="module")
def in_tree_results() -> list[suite.Result]:
    loaded = {p.name for p in kvcore.plugins()}
    missing = [n for n in IN_TREE if n not in loaded]
    assert not missing, f"in-tree plugins {missing} are not installed (pip install -e plugins/<name>)"
    return suite.run_checks([*IN_TREE, "kvcore"], OPTS)


@pytest.mark.parametrize("plugin", [*IN_TREE, "kvcore"])
def test_in_tree_plugin_passes_the_suite(plugin, in_tree_results):
    mine = [r for r in in_tree_results if r.plugin == plugin]
    failed = [r.line() for r in mine if r.status == suite.FAIL]
    assert not failed, f"{len(failed)} conformance failure(s) for {plugin}:\n" + "\n".join(failed)


def test_every_registered_format_has_a_fixture():
    h = registry.host()
    by_plugin, errors = suite._fixtures_by_plugin()
    assert not errors, errors
    covered = {(name, c.format) for name, cases in by_plugin.items() for c in cases}
    lacking = sorted(f"{owner}: {fmt}" for fmt, owner in h.format_owner.items() if (owner, fmt) not in covered)
    assert not lacking, "formats registered without a fixture from their plugin:\n" + "\n".join(lacking)


def test_every_detectable_format_has_a_kernel_that_moves_it(in_tree_results):
    """No "detected but cannot transfer": for each fixture's format, some kernel passes the
    semantic gather and scatter on the CPU."""
    by_plugin, _ = suite._fixtures_by_plugin()
    detectable = {c.format for name in IN_TREE for c in by_plugin.get(name, [])}
    assert detectable
    ok: dict[str, set[str]] = {}
    for r in in_tree_results:
        if r.kernel.endswith("@cpu") and r.check in ("semantic_gather", "semantic_scatter") and r.status == suite.PASS:
            ok.setdefault(r.format, set()).add(r.check)
    gaps = sorted(f for f in detectable if ok.get(f) != {"semantic_gather", "semantic_scatter"})
    assert not gaps, f"formats a detector returns that no kernel moves correctly: {gaps}"


# -- the guide's example and the out-of-tree example -------------------------------------------


def _import_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_guide_example_plugin_passes_kvcore_check(tmp_path):
    block = re.search(r"```python\n# file: kvcore-tinyllm/tinyllm_kvcore/plugin.py\n(.*?)```", GUIDE, re.S)
    assert block, "docs/plugins.md lost its runnable example plugin"
    path = tmp_path / "tinyllm_plugin.py"
    path.write_text(block.group(1))
    mod = _import_path("tinyllm_plugin_from_guide", path)
    kvcore.register_plugin(mod, name="tinyllm")
    try:
        results = suite.run_checks(["tinyllm"], OPTS)
        assert [r.line() for r in results if r.status == suite.FAIL] == []
        passed = {(r.kernel, r.check) for r in results if r.status == suite.PASS}
        assert {
            ("-", "detect"),
            ("-", "geometry"),
            ("reference@cpu", "semantic_gather"),
            ("reference@cpu", "roundtrip[float8_e4m3fn]"),
        } <= passed
        kv, _ = mod.allocate({"num_layers": 3, "num_blocks": 5, "block_size": 4, "num_heads": 2, "head_size": 8}, torch.bfloat16, "cpu")
        layout = kvcore.detect(kv, engine="tinyllm")
        assert layout.format.name == "NL_X_NB_NH_BS_TWO_HS" and layout.describe() == "3 x [5, 2, 4, 2, 8]"
    finally:
        kvcore.unregister_plugin("tinyllm")
        sys.modules.pop("tinyllm_plugin_from_guide", None)


def test_the_trtllm_example_plugin_passes_kvcore_check():
    ex = ROOT / "examples" / "kvcore-trtllm"
    assert _entry_points(ex / "pyproject.toml") == ["trtllm"]
    installed = "trtllm" in {p.name for p in kvcore.plugins()}
    if not installed:  # CI installs it; without that, load it from the source tree
        mod = _import_path("kvcore_trtllm_example_plugin", ex / "kvcore_trtllm" / "plugin.py")
        kvcore.register_plugin(mod, name="trtllm")
    try:
        results = suite.run_checks(["trtllm"], OPTS)
        assert [r.line() for r in results if r.status == suite.FAIL] == []
        passed = {(r.format, r.check) for r in results if r.status == suite.PASS}
        for fmt in ("NB_NL_TWO_NH_BS_HS", "NB_NL_ONE_BS_HS"):
            assert {(fmt, "detect"), (fmt, "geometry"), (fmt, "semantic_gather"), (fmt, "semantic_scatter")} <= passed
    finally:
        if not installed:
            kvcore.unregister_plugin("trtllm")
            sys.modules.pop("kvcore_trtllm_example_plugin", None)
