"""Tests of the conformance suite itself: deliberately broken plugins must be caught, with
the first wrong element's coordinates, and the correct control plugin must pass."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import kvcore
import kvcore.testing
from kvcore.testing import check, suite

ROOT = Path(__file__).resolve().parents[1]


def _load_examples():
    spec = importlib.util.spec_from_file_location("kvcore_broken_examples", ROOT / "examples" / "broken" / "broken_plugins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


broken = _load_examples()


@pytest.fixture
def registered(request):
    """Register ``request.param`` (a plugin class) as 'toy', unregister afterwards."""
    name = "toy"
    kvcore.register_plugin(request.param(), name=name)
    try:
        yield name
    finally:
        kvcore.unregister_plugin(name)


def _run(name: str, **filters) -> dict[str, suite.Result]:
    results = suite.run_checks([name], suite.Options(examples=3), **filters)
    return {f"{r.kernel}::{r.check}": r for r in results}


def _plain_round_trip(name: str) -> None:
    """scatter then gather through the broken layout returns what went in: a round trip alone
    cannot see a wrong layout."""
    case = next(c for c in kvcore.testing.registered_fixtures(name))
    kv, hints = case.make(case.sizes, torch.float32, "cpu")
    layout = kvcore.detect(kv, case.engine, hints)
    slots = torch.tensor([5, 0, -1, 11])
    src = torch.randn(layout.staging_shape(4))
    kvcore.scatter(layout, slots, src)
    back = kvcore.gather(layout, slots)
    assert torch.equal(back[:, :, [0, 1, 3]], src[:, :, [0, 1, 3]])


def _status(results: dict[str, suite.Result], check_name: str, kernel: str = "reference@cpu") -> str:
    return results[f"{kernel}::{check_name}"].status


@pytest.mark.parametrize("registered", [broken.ToyPlugin], indirect=True)
def test_the_correct_toy_plugin_passes_everything(registered):
    results = _run(registered)
    failed = [r.line() for r in results.values() if r.status == suite.FAIL]
    assert failed == []
    assert _status(results, "semantic_gather") == suite.PASS
    assert _status(results, "semantic_scatter") == suite.PASS
    assert _status(results, "detect", kernel="-") == suite.PASS
    # every check ran: the toy plugin has one format, one fixture, and the reference kernel
    checks = {k.split("::")[1] for k in results}
    assert {
        "grammar",
        "fixtures_exist",
        "geometry",
        "ambiguity[NH=1]",
        "roundtrip[float8_e5m2]",
        "invalid[device]",
        "staging_views",
    } <= checks


@pytest.mark.parametrize("registered", [broken.SwappedKV], indirect=True)
def test_swapped_k_and_v_is_caught_by_the_semantic_oracle_only(registered):
    _plain_round_trip(registered)  # a plain round trip cannot see it ...
    results = _run(registered, kernels=["reference*"])
    assert _status(results, "geometry", kernel="-") == suite.PASS
    # ... the oracle does, and says where the value came from
    r = results["reference@cpu::semantic_gather"]
    assert r.status == suite.FAIL
    assert r.detail["kv"] == "K" and r.detail["layer"] == 0 and r.detail["head"] == 0 and r.detail["element"] == 0
    assert r.detail["token"] == 0 and r.detail["slot"] >= 0
    slot = r.detail["slot"]
    assert r.detail["expected_means"] == f"the cache value of layer 0, K, slot {slot}, head 0, element 0"
    assert r.detail["actual_means"] == f"the cache value of layer 0, V, slot {slot}, head 0, element 0"
    assert results["reference@cpu::semantic_scatter"].status == suite.FAIL
    # the suite's round trip also checks where the scattered bytes landed
    assert results["reference@cpu::roundtrip[float32]"].status == suite.FAIL


@pytest.mark.parametrize("registered", [broken.TransposedHeads], indirect=True)
def test_transposed_heads_are_caught(registered):
    _plain_round_trip(registered)
    results = _run(registered, kernels=["reference*"])
    assert _status(results, "geometry", kernel="-") == suite.PASS  # the sizes look right
    r = results["reference@cpu::semantic_gather"]
    assert r.status == suite.FAIL
    # a token's first head, element 0 is right by accident only for token 0 of a block: the
    # first wrong element is a real (layer, K/V, token, head, element) with a decoded origin
    assert {"layer", "kv", "token", "slot", "head", "element", "expected", "actual"} <= set(r.detail)
    assert r.detail["expected"] != r.detail["actual"]
    assert "the cache value of layer" in r.detail["actual_means"]
    # NH = 1 makes HND and NHD the same bytes: that probe must pass
    assert _status(results, "ambiguity[NH=1]", kernel="-") == suite.PASS


@pytest.mark.parametrize("registered", [broken.EagerKernel], indirect=True)
def test_a_kernel_that_writes_before_validating_is_caught(registered):
    results = _run(registered, kernels=["eager*"])
    assert _status(results, "semantic_gather", kernel="eager@cpu") == suite.PASS
    r = results["eager@cpu::staging_views"]
    assert r.status == suite.FAIL
    assert "raised TransferError" in r.message and ("after" in r.message)


@pytest.mark.parametrize("registered", [broken.SwappedKV], indirect=True)
def test_kvcore_check_report_and_exit_code(registered, capsys):
    rc = check.main([registered, "--check", "semantic_gather", "--kernel", "reference"])
    out = capsys.readouterr().out
    assert rc == 1
    line = next(x for x in out.splitlines() if x.startswith("FAIL") and "reference@cpu" in x)
    assert "toy" in line and broken.FORMAT in line and "semantic_gather" in line
    assert "layer 0, K, token 0" in out and "expected 0x" in out and "actual 0x" in out
    # the look-alike probes' gathers are data checks too, filed under semantic_gather[PROBE]
    assert any(x.startswith("FAIL") and "semantic_gather[NH=1]" in x for x in out.splitlines())
    rc = check.main([registered, "--check", "semantic_gather", "--kernel", "reference", "--json"])
    rows = [r for r in json.loads(capsys.readouterr().out) if r["kernel"] != "-"]
    assert rc == 1 and [r["status"] for r in rows] == ["FAIL"]
    assert rows[0]["detail"]["kv"] == "K"


@pytest.mark.parametrize("registered", [broken.ToyPlugin], indirect=True)
def test_kvcore_check_passes_and_lists(registered, capsys):
    assert check.main([registered, "--check", "semantic_*", "-q"]) == 0
    assert "0 failed" in capsys.readouterr().out
    assert check.main([registered, "--list", "--check", "detect"]) == 0
    assert capsys.readouterr().out.split() == [f"toy::{broken.FORMAT}::toyllm-ToyPlugin::-::detect"]


def test_kvcore_check_unknown_plugin_is_a_usage_error(capsys):
    assert check.main(["no-such-plugin"]) == 2
    assert "no kvcore plugin named 'no-such-plugin'" in capsys.readouterr().err


def test_a_plugin_that_failed_to_load_is_a_failure_line():
    h = kvcore.registry.host()
    h.info["ghost"] = kvcore.registry.PluginInfo(
        name="ghost", distribution="kvcore-ghost", version="0.1", error="import failed: ImportError: no module named ghost_engine"
    )
    try:
        [r] = suite.run_checks(["ghost"])
    finally:
        del h.info["ghost"]
    assert (r.status, r.check) == (suite.FAIL, "load")
    assert "import failed: ImportError: no module named ghost_engine" in r.message


class _FixtureHookRaises(broken.ToyPlugin):
    @kvcore.hookimpl
    def kvcore_register_fixtures(self, register):
        raise RuntimeError("fixture module missing")


@pytest.mark.parametrize("registered", [_FixtureHookRaises], indirect=True)
def test_a_fixture_hook_that_raises_fails_its_plugin_and_leaves_its_format_unproven(registered):
    results = suite.run_checks([registered])
    by_check = {r.check: r for r in results}
    assert by_check["fixtures"].status == suite.FAIL and "RuntimeError: fixture module missing" in by_check["fixtures"].message
    assert by_check["fixtures_exist"].status == suite.FAIL
    assert by_check["grammar"].status == suite.PASS


@pytest.mark.parametrize("registered", [broken.GuessesOrder], indirect=True)
def test_a_plugin_that_guesses_the_order_of_a_memory_ordered_cache_is_caught(registered):
    results = _run(registered, kernels=["reference*"], checks=["detect", "semantic_gather", "ambiguity*"])
    assert _status(results, "detect", kernel="-") == suite.PASS  # the allocation itself reads right
    assert _status(results, "semantic_gather") == suite.PASS
    r = results["-::ambiguity[memory order]"]
    assert r.status == suite.FAIL and "the allocation in memory order (as handed over) detected as" in r.message
    assert "which is not the engine's cache" in r.message


@pytest.mark.parametrize("registered", [broken.NamesGivenHint], indirect=True)
def test_an_ambiguity_naming_a_given_hint_is_caught(registered):
    results = _run(registered, kernels=["reference*"], checks=["ambiguity*"])
    r = results["-::ambiguity[BS=NH]"]
    assert r.status == suite.FAIL and "the caller gave them (kv_cache_layout='NHD')" in r.message
    assert _status(results, "ambiguity[NB=2]", kernel="-") == suite.PASS


@pytest.mark.parametrize("registered", [broken.LogicalName], indirect=True)
def test_a_logical_name_over_physical_memory_is_caught_by_physical_order(registered):
    results = _run(registered, kernels=["reference*"])
    assert _status(results, "semantic_gather") == suite.PASS  # every byte moves right ...
    r = results["-::physical_order"]
    assert r.status == suite.FAIL  # ... but the name is not the memory order
    assert "names BS before NH" in r.message and "physical (memory) order" in r.message
    assert "memory order is NL_X_ONE_TWO_NB_NH_BS_HS" in r.message


@pytest.mark.parametrize("registered", [broken.IgnoresEngine], indirect=True)
def test_a_detector_that_ignores_the_engine_is_caught_by_engine_scoped(registered):
    results = _run(registered, checks=["engine_scoped", "detect"])
    assert _status(results, "detect", kernel="-") == suite.PASS
    r = results["-::engine_scoped"]
    assert r.status == suite.FAIL and "kvcore-check-not-an-engine" in r.message and "check `engine` first" in r.message


@pytest.mark.parametrize("registered", [broken.ToyPlugin], indirect=True)
def test_a_detector_that_checks_the_engine_passes_engine_scoped(registered):
    r = _run(registered, checks=["engine_scoped"])["-::engine_scoped"]
    assert r.status == suite.PASS and "fixture caches" in r.message


@pytest.mark.parametrize("registered", [broken.UndeclaredHints], indirect=True)
def test_an_undeclared_hint_is_caught_by_hints_declared(registered):
    r = _run(registered, checks=["hints_declared"])["-::hints_declared"]
    assert r.status == suite.FAIL and "toy_layout" in r.message and "kvcore_register_hints" in r.message


class _DeclaresHints(broken.UndeclaredHints):
    @kvcore.hookimpl
    def kvcore_register_hints(self, register):
        register(kvcore.Hint(engine="toyllm", name="toy_layout", meaning="toyllm's block order", values=["HND"]))


@pytest.mark.parametrize("registered", [_DeclaresHints], indirect=True)
def test_a_hint_value_outside_its_declaration_is_caught(registered):
    r = _run(registered, checks=["hints_declared"])["-::hints_declared"]
    assert r.status == suite.FAIL and "toy_layout='NHD'" in r.message and "accepts only HND" in r.message


class _WrongRankView(broken.ToyPlugin):
    def engine_view(self, kv_caches, layer, kv):
        return kv_caches[layer][0, kv, :, :, 0]  # [NB, BS, HS]: a head axis short


class _CopiedView(broken.ToyPlugin):
    def engine_view(self, kv_caches, layer, kv):
        return super().engine_view(kv_caches, layer, kv).clone()


@pytest.mark.parametrize("registered", [_WrongRankView], indirect=True)
def test_a_kv_view_of_the_wrong_rank_is_described_by_shape_not_values(registered):
    r = _run(registered, checks=["fixture_contract"])["-::fixture_contract"]
    assert r.status == suite.FAIL and "it is Tensor[3, 4, 8] float32" in r.message and "tensor([" not in r.message


@pytest.mark.parametrize("registered", [_CopiedView], indirect=True)
def test_a_kv_view_that_copies_is_not_a_view_of_the_cache(registered):
    r = _run(registered, checks=["fixture_contract"])["-::fixture_contract"]
    assert r.status == suite.FAIL and "is not a view of the cache" in r.message


# -- containers and writers -------------------------------------------------------------------


@pytest.mark.parametrize("registered", [broken.PairsAsLists], indirect=True)
def test_per_layer_pairs_read_as_k_and_v_lists_are_caught_by_the_container_checks(registered, capsys):
    results = _run(registered, kernels=["reference*"])
    # the fixture's own container, the two-layer probe of it and every data check pass ...
    for name in ("detect", "ambiguity[NL=2]"):
        assert _status(results, name, kernel="-") == suite.PASS
    assert _status(results, "semantic_gather") == suite.PASS
    # ... handed the same cache per layer, two layers read as [K list, V list] fail
    for shape in ("dict", "layer list", "per_layer", "per_layer dict", "per_layer groups"):
        r = results[f"-::containers[{shape}]"]
        assert r.status == suite.FAIL, (shape, r.line())
    r = results["-::containers[per_layer]"]
    assert "NL=2" in r.message and r.detail["layer"] == 1 and r.detail["kv"] == "K"
    assert r.detail["actual_means"].startswith("the cache value of layer 0, V")
    # kvcore check fails the plugin, naming the check
    assert check.main([registered, "--check", "containers*", "-q"]) == 1
    out = capsys.readouterr().out
    assert "containers[per_layer]" in out and "FAIL  toy  TWO_X_NL_X_ONE_NB_BS_NH_HS" in out


@pytest.mark.parametrize("registered", [broken.SharedMisreading], indirect=True)
def test_a_misreading_shared_by_detector_and_kv_view_is_caught_only_by_the_writer(registered, capsys):
    results = _run(registered, kernels=["reference*"])
    fails = sorted(k for k, r in results.items() if r.status == suite.FAIL)
    assert fails == ["-::writer_view", "reference@cpu::writer_gather", "reference@cpu::writer_scatter"]
    r = results["-::writer_view"]
    assert "kv_view disagrees with the engine's writer toyllm.store" in r.message
    assert r.detail["kv"] == "K" and r.detail["actual_means"].startswith("the row the engine's writer wrote for layer 0, V")
    g = results["reference@cpu::writer_gather"]
    assert g.detail["expected_means"].startswith("the row the engine's writer wrote for layer 0, K")
    assert check.main([registered, "--kernel", "reference", "-q"]) == 1
    out = capsys.readouterr().out
    assert "writers: toy: 0 of 1 format(s) proved by the engine's own writer" in out


@pytest.mark.parametrize("registered", [broken.ToyPlugin], indirect=True)
def test_the_control_is_proved_by_its_writer_and_the_report_counts_it(registered, capsys):
    results = _run(registered, kernels=["reference*"], checks=["writer*", "containers*"])
    assert {k: r.status for k, r in results.items() if "writer" in k} == {
        "-::writer_view": suite.PASS,
        "reference@cpu::writer_gather": suite.PASS,
        "reference@cpu::writer_scatter": suite.PASS,
    }
    assert "byte-identical" in results["reference@cpu::writer_scatter"].message
    assert all(r.status != suite.FAIL for r in results.values())
    assert check.main([registered, "--kernel", "reference", "--check", "writer*"]) == 0
    assert "writers: toy: 1 of 1 format(s) proved by the engine's own writer" in capsys.readouterr().out


class _NoWriterReason(broken.ToyPlugin):
    @kvcore.hookimpl
    def kvcore_register_fixtures(self, register):
        import dataclasses

        case = kvcore.testing.FixtureCase(
            name="toyllm-nowriter",
            engine="toyllm",
            format=broken.FORMAT,
            make=self.allocate,
            kv_view=self.engine_view,
            sizes={"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 2, "head_size": 8},
            source="toy",
            writer="toyllm's store is a CUDA kernel",
        )
        register(case)
        register(
            dataclasses.replace(
                case,
                name="toyllm-missing-engine",
                writer=kvcore.testing.Writer(name="toyllm_engine.store", write=self.store, requires=("toyllm_engine_not_installed",)),
            )
        )


@pytest.mark.parametrize("registered", [_NoWriterReason], indirect=True)
def test_a_format_with_no_runnable_writer_gets_a_skipped_writer_record_with_the_reason(registered):
    results = suite.run_checks([registered], suite.Options(examples=2), kernels=["reference*"], checks=["writer*"])
    by = {(r.fixture, r.check): r for r in results}
    r = by[("toyllm-nowriter", "writer")]
    assert r.status == suite.SKIP and "toyllm's store is a CUDA kernel" in r.message
    for name in ("writer_view", "writer_gather", "writer_scatter"):
        r = by[("toyllm-missing-engine", name)]
        assert r.status == suite.SKIP and "toyllm_engine_not_installed does not import here (ModuleNotFoundError" in r.message
    assert check.writer_summary(results) == ["  writers: toy: 0 of 1 format(s) proved by the engine's own writer"]


def test_the_guide_counts_the_broken_examples_truly():
    guide = (ROOT / "docs" / "plugins.md").read_text()
    n = len([c for c in broken.__all__ if isinstance(getattr(broken, c), type) and c != "ToyPlugin"])
    words = {8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    assert f"shows {words.get(n, n)}\nplugins the suite rejects" in guide
