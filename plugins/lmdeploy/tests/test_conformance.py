"""``kvcore check lmdeploy`` under pytest: every fixture (each generation, NHD/HND, fp8, MLA,
int8, int4, TurboQuant, per layer and cross-layer) passes every check, and the multi-plane
ones run the per-plane data and bad-input checks."""

from __future__ import annotations

from kvcore_lmdeploy import formats as F

from kvcore.testing import suite


def test_the_conformance_suite_passes():
    results = suite.run_checks(["lmdeploy"], suite.Options(examples=3))
    failed = [r.line() for r in results if r.status == "FAIL"]
    assert not failed, "\n".join(failed)
    passed = {(r.fixture, r.check) for r in results if r.status == "PASS" and (r.kernel or "").startswith("reference")}
    fixtures = {r.fixture for r in results if r.fixture}
    assert len(fixtures) == 17
    for fx in fixtures:
        for check in ("semantic_gather", "semantic_scatter", "negative_slots", "invalid[dtype]", "invalid[shape]"):
            assert (fx, check) in passed, (fx, check)
    quant = {r.fixture for r in results if r.format in (F.QUANT, F.TURBO, F.X_QUANT, F.X_TURBO) and r.fixture}
    assert len(quant) == 8
    for fx in quant:
        for check in ("invalid[missing_plane]", "invalid[extra_plane]", "roundtrip[uint8]", "staging_views"):
            assert (fx, check) in passed, (fx, check)
    checked = {r.check for r in results if r.status == "PASS"}
    assert {"engine_scoped", "hints_declared", "physical_order", "detect", "geometry", "agrees_with_reference"} <= checked
