"""Release boundaries re-derived from each vLLM wheel (0.24.0 - 0.33.0): every release reads as
the era whose rules hold for it, every backend name a release reports is accepted (or refused
with the reason kvcore does not read it), the 0.29+ layout names are accepted from 0.29 and
refused before, and the MLA runner tensor ``[NB, 1, BS, 576]`` of 0.29 - 0.33 reads as MLA.
Facts: ``plugins/vllm/SOURCES.md`` ("Release boundaries")."""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm import fixtures
from kvcore_vllm.fixtures import MATRIX, MLA_BACKENDS, allocate, fixture_hints, kv_view
from kvcore_vllm.hints import VllmHints, parse_hints
from kvcore_vllm.releases import (
    BACKEND_FAMILY,
    BACKEND_RELEASES,
    ENV_LAYOUTS,
    ERAS,
    KV_CACHE_LAYOUT_ORDERS,
    KV_CACHE_LAYOUTS,
    LAYOUT_FAMILY,
    READ_RELEASES,
    UNCLAIMED_BACKENDS,
    backend_in_release,
    era_of,
    layout_physical_order,
)
from kvcore_vllm.rules import Rule

import kvcore

#: each read release -> the era whose rules hold for it (SOURCES.md, "Release boundaries")
RELEASE_ERA = {
    "0.11.0": "0.11",
    "0.13.0": "0.13",
    "0.24.0": "0.24",
    "0.25.0": "0.24",  # flash_attn.py get_kv_cache_shape (NB, 2, BS, NH, HS), as 0.24.0
    "0.25.1": "0.24",
    "0.26.0": "0.26",
    "0.27.0": "0.26",  # get_kv_cache_shape (NB, NH, BS, 2*HS) and stride orders as 0.26.0
    "0.27.1": "0.26",
    "0.28.0": "0.26",
    "0.29.0": "0.29",  # first wheel with vllm/v1/kv_cache_layout.py and create_kv_cache_views
    "0.30.0": "0.29",
    "0.31.0": "0.29",
    "0.32.0": "0.29",
    "0.33.0": "0.29",
}


def test_every_read_release_has_its_era():
    assert set(RELEASE_ERA) == set(READ_RELEASES)
    for version, era in RELEASE_ERA.items():
        assert era_of(version) == era, version
        assert fixtures.era_of(version) == era, version  # the oracle reads the same boundaries
        assert VllmHints(vllm_version=version).era == era
    assert era_of("v0.32.0+cpu") == "0.29" and era_of("0.28.9") == "0.26" and era_of("0.40") == "0.29"
    assert ERAS == ("0.11", "0.13", "0.24", "0.26", "0.29")


def test_layout_tables_are_derived_from_vllms_permutations():
    # kv_cache_layout.py::KVCacheLayout values, as the oracle restates them on its own
    assert KV_CACHE_LAYOUT_ORDERS == fixtures.LAYOUT_ORDERS
    assert set(KV_CACHE_LAYOUTS) == {"LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert {m for m, f in LAYOUT_FAMILY.items() if f == "NHD"} == {"LBNHC", "BLNHC"}
    assert layout_physical_order("LHBNC") == ("NL", "NH", "NB", "BS", "CS")
    assert layout_physical_order("BHLNC") == ("NB", "NH", "NL", "BS", "CS")
    assert layout_physical_order("HND") == ("NL", "NB", "NH", "BS", "CS")  # the compat alias of LBHNC
    assert layout_physical_order("BHLNC", ("NL", "NB", "", "BS", "HS")) == ("NB", "NL", "BS", "HS")  # MLA: no head axis
    assert ENV_LAYOUTS["0.29"] == ("LBNHC", "LBHNC", "LHBNC", "NHD", "HND", "BLHNC", "BLNHC", "BHLNC")
    assert all(ENV_LAYOUTS[e] == ("NHD", "HND") for e in ERAS[:-1])


def test_rules_name_only_real_eras():
    with pytest.raises(ValueError, match="not layout eras"):
        Rule(label="x", eras=("0.33",), families=("FLASH_ATTN",), rank=4, logical=("NB",), layouts={}, sources=())


# -- backend names -------------------------------------------------------------------------

ISSUE_NAMES = (
    "CPU_MLA",
    "AMX_MLA",
    "TOKENSPEED_MLA",
    "FLASH_ATTN_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM120",
    "FLASHINFER_MLA_SPARSE_SM90",
    "TRITON_FLASH_ATTN",
)


def test_the_names_vllm_032_reports_are_accepted_with_their_family():
    for name in ISSUE_NAMES:
        h = VllmHints(attention_backend=name, vllm_version="0.32.0")
        assert h.attention_backend == name
        assert h.family == ("FLASH_ATTN" if name == "TRITON_FLASH_ATTN" else "MLA")
    assert VllmHints(attention_backend="TRITON_FLASHINFER", vllm_version="0.32.0").family == "FLASHINFER"
    assert VllmHints(attention_backend="ROCM_SEGMENTED_ATTN", vllm_version="0.32.0").family == "ROCM_SEGMENTED"


@pytest.mark.parametrize("name", sorted(BACKEND_FAMILY))
def test_every_read_backend_name_is_accepted_in_its_releases(name):
    assert VllmHints(attention_backend=name.lower()).attention_backend == name
    first, last = BACKEND_RELEASES[name]
    for version in READ_RELEASES:
        inside = first <= version <= last if version[:4] != "0.11" else first[:4] == "0.11"
        if inside:
            assert VllmHints(attention_backend=name, vllm_version=version).family == BACKEND_FAMILY[name]
        elif backend_in_release(name, version) is False:
            with pytest.raises(kvcore.DetectionError, match=f"not a backend of vLLM {version}"):
                VllmHints(attention_backend=name, vllm_version=version)


def test_every_name_has_a_release_range_and_a_family_or_a_reason():
    assert set(BACKEND_FAMILY) | set(UNCLAIMED_BACKENDS) == set(BACKEND_RELEASES)
    assert not set(BACKEND_FAMILY) & set(UNCLAIMED_BACKENDS)


@pytest.mark.parametrize("name", sorted(UNCLAIMED_BACKENDS))
def test_unclaimed_backend_names_are_refused_with_the_reason(name):
    with pytest.raises(kvcore.DetectionError, match="does not read this backend's cache") as e:
        parse_hints({"attention_backend": name})
    assert UNCLAIMED_BACKENDS[name] in str(e.value)


@pytest.mark.parametrize(
    ("name", "version", "has"),
    [
        ("B12X", "0.29.0", False),  # b12x.py first ships in 0.30.0
        ("B12X", "0.30.0", True),
        ("ROCM_SEGMENTED_ATTN", "0.31.0", False),
        ("ROCM_SEGMENTED_ATTN", "0.32.0", True),
        ("CPU_MLA", "0.27.1", False),  # platforms/cpu.py: MLA on CPU from 0.28
        ("CPU_MLA", "0.28.0", True),
        ("AMX_MLA", "0.28.0", False),
        ("AMX_MLA", "0.29.0", True),
        ("FLASH_ATTN_MLA_SPARSE", "0.24.0", False),
        ("FLASH_ATTN_MLA_SPARSE", "0.25.0", True),
        ("PALLAS", "0.13.0", True),
        ("PALLAS", "0.20", None),  # between two read releases, one without it: not known
        ("PALLAS", "0.24.0", False),
        ("TORCH_SDPA", "0.33.0", True),
        ("FLASH_ATTN", "0.40", True),  # still in the newest read release
        ("TRITON_FLASH_ATTN", "0.40", True),
    ],
)
def test_backend_release_ranges(name, version, has):
    assert backend_in_release(name, version) is has


def test_a_backend_the_release_lacks_is_refused_by_detection():
    kv = allocate("0.30.0", "B12X", "LBHNC", num_layers=2, num_blocks=3, block_size=64, num_kv_heads=2, head_size=64)
    with pytest.raises(kvcore.DetectionError, match="B12X"):
        kvcore.detect(kv, "vllm", {"vllm_version": "0.29.0", "attention_backend": "B12X"})
    with pytest.raises(kvcore.GeometryError, match="B12X"):  # the oracle refuses it too
        allocate("0.29.0", "B12X", "LBHNC", num_layers=2, num_blocks=3, block_size=64, num_kv_heads=2, head_size=64)


# -- layout names per era --------------------------------------------------------------------


@pytest.mark.parametrize("version", [v for v in READ_RELEASES if v >= "0.24"])
def test_layout_names_per_release(version, monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    layout_era = era_of(version) == "0.29"
    for name in KV_CACHE_LAYOUTS:
        if layout_era:
            assert VllmHints(kv_cache_layout=name, vllm_version=version).layout33 == name
            assert parse_hints({"VLLM_KV_CACHE_LAYOUT": name, "vllm_version": version}).env_kv_cache_layout == name
        else:
            with pytest.raises(kvcore.DetectionError, match="KVCacheLayout member"):
                VllmHints(kv_cache_layout=name, vllm_version=version)
            with pytest.raises(kvcore.DetectionError, match="not a value vLLM"):
                parse_hints({"VLLM_KV_CACHE_LAYOUT": name, "vllm_version": version})
    for name in ("NHD", "HND"):
        assert VllmHints(kv_cache_layout=name, vllm_version=version).layout_family == name
        assert parse_hints({"VLLM_KV_CACHE_LAYOUT": name, "vllm_version": version}).env_kv_cache_layout == name


# -- every matrix row of an era, allocated as each release of that era allocates it ------------


def _rows_per_release():
    out = []
    for version in READ_RELEASES:
        era = era_of(version)
        for row in MATRIX:
            if era_of(row[0]) != era or row[0] == version:
                continue  # the era's own release is the matrix's row (test_vllm_engine_truth.py)
            if row[1] == "B12X" and version < "0.30" or row[1] == "ROCM_SEGMENTED_ATTN" and version < "0.32":
                continue  # not in that wheel (test_a_backend_the_release_lacks_is_refused_by_detection)
            out.append(pytest.param(version, row, id=f"{version}-{fixtures.case_name(*row[:4], row[5])}"))
    return out


@pytest.mark.parametrize(("version", "row"), _rows_per_release())
def test_each_release_reads_as_its_era(version, row, semantic):
    _, backend, layout, cross, fmt, extra = row
    mla = backend in MLA_BACKENDS
    g = dict(num_layers=2, num_blocks=3, num_kv_heads=1 if mla else 2, head_size=576 if mla else 64)
    bs = 64 if backend == "B12X" else 16
    if extra.get("cpu_attn_isa") == "amx":
        bs = 32  # _get_attn_isa: AMX for block sizes that are multiples of 32
    kw = dict(extra)
    block = kw.pop("block_size", bs)
    if kw.get("kernel_block_size"):
        kw["kernel_block_size"], block = bs, bs * 4
    kv = allocate(version, backend, layout, block_size=block, cross_layer=cross, dtype=torch.bfloat16, **g, **kw)
    h = fixture_hints(version, backend, layout, "auto", torch.bfloat16, extra)
    h.update(block_size=block, num_kv_heads=g["num_kv_heads"], head_size=g["head_size"])
    lay = kvcore.detect(kv, "vllm", h)
    assert lay.format.name == fmt
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))


# -- the MLA runner tensor [NB, 1, BS, 576] of 0.29 - 0.33 ---------------------------------------


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
def test_mla_runner_tensor_reads_as_mla(version, layout, semantic):
    kv = allocate(version, "TRITON_MLA", layout, num_layers=2, num_blocks=3, block_size=16, num_kv_heads=1, head_size=576)
    t = next(iter(kv.values()))
    assert tuple(t.shape) == (3, 1, 16, 576)  # what runner.kv_caches holds: create_kv_cache_views' [B, H=1, N, C]
    backends = ["TRITON_MLA", "FLASHMLA", "TOKENSPEED_MLA", "FLASH_ATTN_MLA_SPARSE"]
    if version >= "0.28":
        backends.append("CPU_MLA")
    if version >= "0.29":
        backends.append("AMX_MLA")
    want = "NB_NL_BS_HS" if layout.startswith("B") else "NL_X_NB_BS_HS"
    for backend in backends:
        lay = kvcore.detect(kv, "vllm", {"vllm_version": version, "attention_backend": backend})
        assert (lay.format.name, lay.kv_size, lay.num_heads, lay.head_size) == (want, 1, 1, 576), backend
        semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))
    for hints in ({"kv_cache_spec": "mla"}, {"head_size": 576}):
        lay = kvcore.detect(kv, "vllm", {"vllm_version": version, **hints})
        assert (lay.format.name, lay.kv_size, lay.head_size) == (want, 1, 576)


def test_mla_runner_tensor_is_never_read_as_kv_halves_without_a_deciding_hint():
    # [NB, 1, 16, 576] is also one KV head of 288 packed K|V (Triton / Flex accept head size 288): a decision
    # only a hint makes, never K and V halves by default
    kv = allocate("0.32.0", "TRITON_MLA", "LBNHC", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=1, head_size=576)
    with pytest.raises(kvcore.AmbiguousLayoutError) as e:
        kvcore.detect(kv, "vllm", {"vllm_version": "0.32.0"})
    assert "attention_backend" in e.value.hints
    assert any("NB_BS_HS" in c for c in e.value.candidates)
