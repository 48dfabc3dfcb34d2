"""The conformance suite on multi-plane formats: a correct plugin (ROCm-style split K with
classic staging; int8 values with bf16 scale/zero pairs in sibling tensors, staged per plane;
token groups) passes every check per plane buffer, and plugins whose oracle or detector is
wrong in one plane are caught with the plane named."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import Candidate, KVFormat, Source, hookimpl, resolve
from kvcore.testing import FixtureCase, TokenGroups, suite

ROCM = "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS"
QUANT = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KSZ=NL_X_NB_BS_NH_HS+VSZ=NL_X_NB_BS_NH_HS"
GROUPS = "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_BSC_HS_BSE+VS=NL_X_NB_BS_NH"
SRC = Source(engine="planetoy", version="1.0", file="planetoy/cache.py::allocate")


def _x(dtype):
    return max(1, 16 // torch.empty(0, dtype=dtype).element_size())


def make_rocm(s, dtype, device):
    x = _x(dtype)
    nl, nb, bs, nh, hs = (s[k] for k in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"))
    if hs % x:
        raise kvcore.GeometryError(f"head_size {hs} is not a multiple of x={x}")
    k = [torch.zeros(nb, nh, hs // x, bs, x, dtype=dtype, device=device) for _ in range(nl)]
    v = [torch.zeros(nb, nh, hs, bs, dtype=dtype, device=device) for _ in range(nl)]
    return [k, v], {}


def view_rocm(kv, layer, plane):
    if plane == 0:  # K (NB, NH, HS/x, BS, x) -> [NB, BS, NH, HS/x, x]
        return kv[0][layer].permute(0, 3, 1, 2, 4)
    return kv[1][layer].permute(0, 3, 1, 2)  # V (NB, NH, HS, BS) -> [NB, BS, NH, HS]


def make_quant(s, dtype, device):
    nl, nb, bs, nh, hs = (s[k] for k in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"))
    vals = [[torch.zeros(nb, bs, nh, hs, dtype=dtype, device=device) for _ in range(nl)] for _ in range(2)]
    sz = [[torch.zeros(nb, bs, nh, 2, dtype=torch.bfloat16, device=device) for _ in range(nl)] for _ in range(2)]
    return vals + sz, {}


def view_quant(kv, layer, plane):
    return kv[plane][layer]


def make_groups(s, dtype, device):
    x = 2
    nl, nb, bs, nh, hs = (s[k] for k in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"))
    if bs % x or hs % x:
        raise kvcore.GeometryError("block_size and head_size must be even")
    kv = [
        [torch.zeros(nb, nh, hs // x, bs, x, dtype=dtype, device=device) for _ in range(nl)],
        [torch.zeros(nb, nh, bs // x, hs, x, dtype=dtype, device=device) for _ in range(nl)],
        [torch.zeros(nb, bs, nh, dtype=torch.float32, device=device) for _ in range(nl)],
    ]
    return kv, {}


def view_groups(kv, layer, plane):
    if plane == 0:
        return kv[0][layer].permute(0, 3, 1, 2, 4)
    if plane == 1:  # V (NB, NH, BS/x, HS, x): no [NB, BS, NH, HS] view exists; [NB, BS/x, x, NH, HS] does
        return TokenGroups(kv[1][layer].permute(0, 2, 4, 1, 3))
    return kv[2][layer]  # [NB, BS, NH]: one element per head


class PlaneToy:
    """A correct multi-plane plugin; subclasses break one thing each."""

    formats = {ROCM: (make_rocm, view_rocm), QUANT: (make_quant, view_quant), GROUPS: (make_groups, view_groups)}
    dtypes = {ROCM: (torch.bfloat16, torch.float16, torch.float32), QUANT: (torch.int8, torch.uint8), GROUPS: (torch.bfloat16, torch.uint8)}

    @hookimpl
    def kvcore_register_formats(self, register):
        for name in self.formats:
            register(KVFormat(name=name, engines=["planetoy"], description="planetoy multi-plane cache", sources=[SRC]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != "planetoy":
            return None
        # the engine keeps one list of per-layer tensors per plane, in the name's plane order
        name = {2: ROCM, 4: QUANT, 3: GROUPS}.get(len(kv_caches) if isinstance(kv_caches, list) else 0)
        if name is None:
            return None
        roles = kvcore.parse_format(name).roles
        return resolve([Candidate(name, self.detected(dict(zip(roles, kv_caches))))], engine="planetoy")

    def detected(self, kv):
        return kv

    @hookimpl
    def kvcore_register_fixtures(self, register):
        for name, (make, view) in self.formats.items():
            register(
                FixtureCase(
                    name=f"planetoy-{name.split('=')[0]}{len(name)}",
                    engine="planetoy",
                    format=name,
                    make=make,
                    kv_view=self.view(view),
                    sizes={"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 2, "head_size": 16},
                    dtypes=self.dtypes[name],
                    source=str(SRC),
                    size_constraints={"block_size_choices": [2, 4], "head_size_choices": [16, 32]},
                )
            )

    def view(self, fn):
        return fn


class ScalesSwapped(PlaneToy):
    """The oracle reads V's scale/zero pairs where K's are (a wrong plane order)."""

    def view(self, fn):
        if fn is view_quant:
            return lambda kv, layer, plane: view_quant(kv, layer, {2: 3, 3: 2}.get(plane, plane))
        return fn


class HeadsSwapped(PlaneToy):
    """The oracle reads the VS scales with their heads reversed (the engine's attention would
    apply head 0's scale to head 1)."""

    def view(self, fn):
        if fn is view_groups:
            return lambda kv, layer, plane: view_groups(kv, layer, plane) if plane != 2 else kv[2][layer].flip(2)
        return fn


def _results(cls, **filters):
    kvcore.register_plugin(cls(), name="planetoy")
    try:
        return suite.run_checks(["planetoy"], suite.Options(examples=2), **filters)
    finally:
        kvcore.unregister_plugin("planetoy")


@pytest.mark.usefixtures("core_only")
def test_a_correct_multi_plane_plugin_passes_every_check():
    results = _results(PlaneToy)
    failed = [r.line() for r in results if r.status == "FAIL"]
    assert not failed, "\n".join(failed)
    by = {(r.fixture, r.kernel, r.check): r for r in results}
    checks = {r.check for r in results}
    for name in (
        "semantic_gather",
        "semantic_scatter",
        "negative_slots",
        "empty_slots",
        "staging_views",
        "invalid[missing_plane]",
        "invalid[extra_plane]",
        "invalid[dtype]",
        "roundtrip[int8]",
        "roundtrip[bfloat16]",
        "geometry",
        "render",
        "fixture_contract",
        "grammar",
    ):
        assert name in checks, name
    passed = {(f, c) for (f, k, c), r in by.items() if r.status == "PASS" and k.startswith("reference")}
    quant = next(r.fixture for r in results if r.format == QUANT and r.fixture)
    for c in (
        "semantic_gather",
        "semantic_scatter",
        "roundtrip[int8]",
        "invalid[missing_plane]",
        "invalid[extra_plane]",
        "invalid[dtype]",
        "invalid[shape]",
        "staging_views",
    ):
        assert (quant, c) in passed, c
    geo = next(r for r in results if r.format == QUANT and r.check == "geometry")
    assert "one buffer per plane" in geo.message
    geo = next(r for r in results if r.format == ROCM and r.check == "geometry")
    assert "classic" in geo.message
    extra = next(r for r in results if r.format == ROCM and r.check == "invalid[extra_plane]" and r.kernel.startswith("reference"))
    assert extra.status == "SKIP"


@pytest.mark.usefixtures("core_only")
def test_a_wrong_plane_order_in_the_oracle_is_caught_naming_the_plane():
    results = _results(ScalesSwapped, formats=[QUANT], checks=["semantic_gather"], kernels=["reference*"])
    fails = [r for r in results if r.status == "FAIL"]
    assert fails, [r.line() for r in results]
    msg = fails[0].message
    assert "plane KSZ" in msg and "the cache value of plane VSZ" in msg


@pytest.mark.usefixtures("core_only")
def test_a_side_plane_with_reversed_heads_is_caught():
    results = _results(HeadsSwapped, formats=[GROUPS], checks=["semantic_gather", "semantic_scatter"], kernels=["reference*"])
    fails = [r for r in results if r.status == "FAIL"]
    # the kernel's data checks, and the look-alike probes' gathers (semantic_gather[PROBE])
    assert {r.check.split("[")[0] for r in fails} == {"semantic_gather", "semantic_scatter"}, [r.line() for r in results]
    assert {"semantic_gather", "semantic_scatter"} <= {r.check for r in fails}
    assert all("plane VS" in r.message for r in fails)
