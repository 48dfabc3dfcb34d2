"""``kvcore check lmdeploy`` under pytest, the checks this plugin's claims are about: every
fixture (each generation, NHD/HND, MACA 0.6.2, Ascend 910 and 310P NZ, fp8, MLA plain /
fp8 / int8 / int4, int8, int4, TurboQuant, per layer, cross-layer and the pool) passes the detection checks and, with the reference kernel, the semantic,
padding and bad-input checks; the multi-plane ones run the per-plane data and bad-input
checks.

The whole suite over every kernel (native agreement, hypothesis geometries, ...) runs once
per pytest session in ``tests/test_conformance_meta.py`` (every in-tree plugin) and in
CI's ``kvcore check``; repeating it here cost ~20 s for nothing."""

from __future__ import annotations

from kvcore_lmdeploy import formats as F

from kvcore.testing import suite

CHECKS = [
    "semantic_gather",
    "semantic_scatter",
    "negative_slots",
    "invalid",
    "roundtrip",
    "staging_views",
    "engine_scoped",
    "hints_declared",
    "physical_order",
    "detect",
    "geometry",
]


def test_the_conformance_suite_passes():
    results = suite.run_checks(["lmdeploy"], suite.Options(examples=3), kernels=["reference"], checks=CHECKS)
    failed = [r.line() for r in results if r.status == "FAIL"]
    assert not failed, "\n".join(failed)
    passed = {(r.fixture, r.check) for r in results if r.status == "PASS" and (r.kernel or "").startswith("reference")}
    fixtures = {r.fixture for r in results if r.fixture}
    assert len(fixtures) == 28
    for fx in fixtures:
        for check in ("semantic_gather", "semantic_scatter", "negative_slots", "invalid[dtype]", "invalid[shape]"):
            assert (fx, check) in passed, (fx, check)
    quant = {r.fixture for r in results if r.format in (F.QUANT, F.TURBO, F.X_QUANT, F.X_TURBO, F.MLA_QUANT, F.X_MLA_QUANT) and r.fixture}
    assert len(quant) == 12
    for fx in quant:
        for check in ("invalid[missing_plane]", "invalid[extra_plane]", "roundtrip[uint8]", "staging_views"):
            assert (fx, check) in passed, (fx, check)
    checked = {r.check for r in results if r.status == "PASS"}
    assert {"engine_scoped", "hints_declared", "physical_order", "detect", "geometry"} <= checked
