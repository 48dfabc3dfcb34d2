"""The conformance suite as an opt-in pytest plugin (run in-process with pytester)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import kvcore
import kvcore.testing.pytest_plugin  # noqa: F401 - imported before pytester snapshots sys.modules,
import kvcore.testing.suite  # noqa: F401 - so the in-process runs do not re-import them (and what they load)

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvcore_broken_examples_pt", ROOT / "examples" / "broken" / "broken_plugins.py")
broken = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(broken)


@pytest.fixture
def toy(request):
    kvcore.register_plugin(request.param(), name="toy")
    try:
        yield "toy"
    finally:
        kvcore.unregister_plugin("toy")


@pytest.mark.parametrize("toy", [broken.SwappedKV], indirect=True)
def test_items_fail_with_the_first_wrong_element(pytester, toy):
    res = pytester.runpytest_inprocess(
        "-p",
        "kvcore.testing.pytest_plugin",
        "--kvcore-plugin",
        toy,
        "--kvcore-check",
        "semantic_*",
        "--kvcore-kernel",
        "reference",
        "-p",
        "no:cacheprovider",
    )
    res.assert_outcomes(failed=7)  # semantic_gather and _scatter of the kernel, and the five probes' gathers
    res.stdout.fnmatch_lines(
        ["*semantic_gather failed for toy NL_X_ONE_TWO_NB_BS_NH_HS toyllm-SwappedKV reference@cpu*", "*layer 0, K, token 0*V, slot*"]
    )


@pytest.mark.parametrize("toy", [broken.ToyPlugin], indirect=True)
def test_package_alias_passes_and_skips_with_reasons(pytester, toy):
    res = pytester.runpytest_inprocess(
        "-p",
        "kvcore.testing",
        "--kvcore-plugin",
        toy,
        "--kvcore-check",
        "detect",
        "--kvcore-check",
        "padded_pool",
        "--kvcore-kernel",
        "reference",
        "-rs",
        "-p",
        "no:cacheprovider",
    )
    res.assert_outcomes(passed=1, skipped=1)
    res.stdout.fnmatch_lines(["*does not model a padded pool*"])


def test_not_loaded_unless_asked(pytester):
    res = pytester.runpytest_inprocess("--kvcore-plugin", "toy", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*unrecognized arguments: --kvcore-plugin*"])


def test_unknown_plugin_is_a_usage_error(pytester):
    res = pytester.runpytest_inprocess(
        "-p", "kvcore.testing.pytest_plugin", "--kvcore-plugin", "no-such-plugin", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"
    )
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*no kvcore plugin named 'no-such-plugin'*"])
