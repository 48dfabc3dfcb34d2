"""The conformance suite's layout: ``kvcore.testing.suite`` keeps every name the single-module
suite had, and each check lives in the one family module that documents it."""

from __future__ import annotations

import importlib
import pkgutil

from kvcore.testing import checks, suite

# every top-level name of the single-module suite (kvcore/testing/suite.py before the split)
OLD_NAMES = """PASS FAIL SKIP CHECKS CheckFailure CheckSkip Result Options Task devices single_thread forced_kernel
_seed _esize _widest _dname _sizes_str _make _detect _encoding _planes _filled _slots _sentinel_like _staged
_expect_gather _compare _kname _kernel_guard _change_where _copies check_grammar check_fixture_contract check_detect
check_render check_geometry PROBES check_ambiguity _Ctx _run_scatter check_semantic_gather check_semantic_scatter
check_roundtrip check_negative_slots check_empty_slots check_padded_pool _expect_refusal _other_dtype _other_device
INVALID check_invalid check_staging_views _SHAPE_KEYS _random_sizes check_agrees_with_reference format_tasks
_kernels_for _SHARED kernel_tasks fixture_tasks _devices _fixtures_by_plugin plan select run_checks""".split()


def test_the_suite_module_keeps_every_name():
    missing = [n for n in OLD_NAMES if not hasattr(suite, n)]
    assert missing == []
    assert all(hasattr(suite, n) for n in suite.__all__)
    assert callable(suite.plan) and callable(suite.run_checks) and suite.Result.__module__ == "kvcore.testing.results"


def _families() -> dict[str, object]:
    # ``planes`` holds the multi-plane variant of every family (the planner picks it for
    # multi-plane fixtures), so it is no family of its own
    return {
        m.name: importlib.import_module(f"kvcore.testing.checks.{m.name}")
        for m in pkgutil.iter_modules(checks.__path__)
        if m.name not in ("common", "context", "planes")
    }


def test_each_check_is_in_the_one_family_module_that_documents_it():
    fams = _families()
    assert set(fams) == {"format", "fixture", "detection", "containers", "writer", "semantic", "roundtrip", "invalid", "staging", "random"}
    for name in suite.CHECKS:
        if name == "load":  # plugin-level: the planner reports a plugin that failed to load
            continue
        documented = [f for f, mod in fams.items() if f"``{name}" in (mod.__doc__ or "")]
        assert len(documented) == 1, f"check {name} is documented in {documented}; exactly one family module must hold it"
        mod = fams[documented[0]]
        fn = getattr(mod, f"check_{name}", None)
        assert callable(fn) and getattr(suite, f"check_{name}") is fn, f"check_{name} is not defined in {mod.__name__}"


def test_kvcore_testing_fixtures_is_the_module_not_a_function():
    import kvcore.testing
    import kvcore.testing.fixtures as mod

    assert kvcore.testing.fixtures is mod and not callable(kvcore.testing.fixtures)
    assert callable(kvcore.testing.registered_fixtures)


def test_fixture_hooks_are_called_through_pluggy_including_specname(core_only):
    import kvcore
    from kvcore.testing import FixtureCase, registered_fixtures

    def case(name):
        return FixtureCase(name, "e", "NL_X_NB_BS_HS", lambda *a: ([], {}), lambda *a: None, sizes={})

    class TwoHooks:
        @kvcore.hookimpl
        def kvcore_register_fixtures(self, register):
            register(case("first"))

        @kvcore.hookimpl(specname="kvcore_register_fixtures")
        def more_fixtures(self, register):
            register(case("second"))

    kvcore.register_plugin(TwoHooks(), name="two")
    assert sorted(c.name for c in registered_fixtures("two")) == ["first", "second"]
    by_plugin, _ = suite._fixtures_by_plugin()
    assert sorted(c.name for c in by_plugin["two"]) == ["first", "second"]
