"""kvcore-xpu as a plugin: what it registers, ``kvcore doctor``, disabling it, and the
conformance suite run with its kernel under Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kvcore
from kvcore import cli


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCORE_KERNEL", "KVCORE_DISABLE_PLUGINS")}
    e.update(env)
    return subprocess.run(args, capture_output=True, text=True, env=e, timeout=300)


def test_registers_one_kernel_and_no_format():
    info = next(i for i in kvcore.plugins() if i.name == "xpu")
    assert info.error is None
    assert info.kernels == ["triton-xpu"] and info.formats == []
    assert info.distribution == "kvcore-xpu"


def test_disabled_by_name_and_everything_else_still_works():
    code = (
        "import json, torch, kvcore\n"
        "names = [i.name for i in kvcore.plugins()]\n"
        "kernels = [k.name for k in kvcore.registry.kernels()]\n"
        "caches = [torch.arange(2 * 4 * 16 * 2 * 8, dtype=torch.float32).view(2, 4, 16, 2, 8) + 1000 * i for i in range(3)]\n"
        "lay = kvcore.build_layout('NL_X_TWO_NB_BS_NH_HS', caches)\n"
        "out = kvcore.gather(lay, torch.tensor([5, -1, 17]))\n"
        "ok = torch.equal(out[1, 2, 2], caches[2][1, 1, 1].flatten()) and not out[:, :, 1].any()\n"
        "print(json.dumps({'names': names, 'kernels': kernels, 'ok': bool(ok)}))\n"
    )
    r = _run([sys.executable, "-c", code], KVCORE_DISABLE_PLUGINS="xpu")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert "xpu" not in d["names"] and "triton-xpu" not in d["kernels"]
    assert d["ok"] and "kvcore" in d["names"]


def test_doctor_says_plainly_that_no_xpu_is_present(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVCORE_KERNEL", raising=False)
    assert cli.main(["doctor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    xpu = d["serving"]["xpu"]
    assert xpu["kernel"] is None and "no xpu device present" in xpu["why"] and "triton-xpu" in xpu["why"]
    row = next(k for k in d["kernels"] if k["name"] == "triton-xpu")
    assert "xpu" in row["device_types"] and row["formats"] == "all" and row["priority"] == 5
    if not (torch.cuda.is_available() or getattr(torch, "xpu", None) and torch.xpu.is_available()):
        assert not row["available"] and "no XPU device" in row["why"]
    assert cli.main(["doctor"]) == 0
    assert "xpu    - (no xpu device present; kernels for it: triton-xpu)" in capsys.readouterr().out


def test_doctor_names_the_kernel_serving_a_present_xpu(capsys, monkeypatch):
    """With an XPU (simulated: torch here has none), the Triton kernel serves it, and
    the doctor says which kernel and why."""
    from kvcore_xpu import kernel as km

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVCORE_KERNEL", raising=False)
    monkeypatch.setattr(km, "_xpu_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    real = cli._devices
    monkeypatch.setattr(cli, "_devices", lambda: real() + [{"type": "xpu", "count": 1}])
    assert cli.main(["doctor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["serving"]["xpu"]["kernel"] == "triton-xpu"
    assert "serves xpu x1" in d["serving"]["xpu"]["why"]
    assert d["serving"]["cpu"]["kernel"] != "triton-xpu"


def test_kvcore_check_xpu_without_a_device_says_why():
    """Outside the interpreter, on a machine with neither XPU nor CUDA, the kernel's checks
    are one SKIP line saying why."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the kernel's checks run there")
    r = _run([sys.executable, "-m", "kvcore.cli", "check", "xpu"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SKIP" in r.stdout and "triton-xpu@-" in r.stdout and "no xpu/cuda device here" in r.stdout


def test_kvcore_check_xpu_runs_the_kernel_in_the_interpreter():
    """The CLI path of the CI command, on one fixture: every data check with
    ``triton-xpu@cpu``."""
    pytest.importorskip("triton")
    from kvcore.testing.fixtures import registered_fixtures

    names = (
        [c.name for p in ("vllm", "sglang") for c in registered_fixtures(p)]
        if {"vllm", "sglang"} <= {i.name for i in kvcore.plugins()}
        else []
    )
    if not names:
        pytest.skip("no engine plugin with fixtures is installed")
    fx = "vllm-0.11-FLASH_ATTN-HND" if "vllm-0.11-FLASH_ATTN-HND" in names else names[0]
    r = _run([sys.executable, "-m", "kvcore.cli", "check", "xpu", "--fixture", fx, "--examples", "3"], TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "kernels triton-xpu@cpu" in r.stdout and " 0 failed" in r.stdout


#: ``KVCORE_XPU_INTERPRET_ALL=1``: run the Triton kernel in the interpreter over every fixture of
#: every installed plugin (3 to 4 minutes on 2 cores), not one fixture per stride shape
INTERPRET_ALL = os.environ.get("KVCORE_XPU_INTERPRET_ALL", "") not in ("", "0")

_CHECKS = {
    "semantic_gather",
    "semantic_scatter",
    "roundtrip",
    "negative_slots",
    "empty_slots",
    "invalid",
    "staging_views",
    "agrees_with_reference",
}


def _shape_class(case) -> tuple:
    """What the Triton program distinguishes in a fixture's stride table: per plane, how a
    token row cuts into runs (the whole row, one run per head, or chunks of a head), whether
    heads or tokens are the outer axis, token groups; how the planes are staged (the classic
    ``[kv, NL, T, row]`` buffer, planes sharing a staged row, one buffer per plane); the
    number of planes and whether their dtypes and widths differ. Read from the stride table
    of the fixture's default geometry, never from its name."""
    kv, hints = case.make(dict(case.sizes), case.dtypes[0], torch.device("cpu"))
    t = kvcore.detect(kv, case.engine, hints).stride_table()

    def plane(p) -> tuple:
        s = p.strides
        run = "chunks" if s.n_chunks > 1 else "row" if p.row_contiguous else "heads"
        order = "-" if p.num_heads == 1 or t.block_size == 1 else ("HND" if s.head > s.token else "NHD")
        return (run, order, "groups" if s.token_group else "")

    shared = any(p.staging.offset or p.staging.head_stride != p.head_bytes for p in t.planes)
    staging = "classic" if t.classic else "shared-row" if shared else "per-plane"
    planes = tuple(sorted({plane(p) for p in t.planes}))
    return (staging, len(t.planes), planes, len({p.dtype for p in t.planes}) > 1, len({p.head_bytes for p in t.planes}) > 1)


def _representatives() -> dict[tuple, str]:
    """One fixture per stride-shape class (an XPU fixture where the class has one: the
    XPU's own geometries; else the first by name)."""
    from kvcore.testing.fixtures import registered_fixtures

    classes: dict[tuple, list[str]] = {}
    for c in sorted(registered_fixtures(skip_broken=True), key=lambda c: (not c.name.startswith("xpu-"), c.name)):
        classes.setdefault(_shape_class(c), []).append(c.name)
    return {k: names[0] for k, names in classes.items()}


def _run_triton(monkeypatch, fixtures: list[str] | None):
    from kvcore.testing import suite

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("KVCORE_KERNEL", raising=False)
    filters = {} if fixtures is None else {"fixtures": fixtures, "kernels": ["triton-xpu"]}
    results = suite.run_checks(["xpu"], suite.Options(examples=4), **filters)
    failed = [r for r in results if r.status == "FAIL"]
    assert not failed, "\n".join(r.line() for r in failed[:10])
    mine = [r for r in results if r.kernel == "triton-xpu@cpu"]
    passed = {r.fixture for r in mine if r.check == "agrees_with_reference" and r.status == "PASS"}
    assert {r.check.split("[")[0] for r in mine if r.status == "PASS"} >= _CHECKS
    return {r.fixture for r in mine}, passed


def test_conformance_suite_with_the_triton_kernel_on_one_fixture_per_stride_shape(monkeypatch):
    """``TRITON_INTERPRET=1 kvcore check xpu`` on one fixture of every stride-shape class
    of the installed plugins' fixtures (:func:`_shape_class`): the Triton kernel (forced, in
    the interpreter, on CPU tensors) -- semantic gather/scatter against the engine's own
    views, round trips of every dtype, padding, staging views, bad calls refused before
    writing, and byte-for-byte agreement with the reference kernel on random geometries.
    Every fixture: ``KVCORE_XPU_INTERPRET_ALL=1`` (the next test)."""
    pytest.importorskip("triton")
    reps = _representatives()
    if not reps:
        pytest.skip("no installed plugin supplies fixtures")
    loaded = {i.name for i in kvcore.plugins() if not i.error}
    if {"vllm", "sglang", "lmdeploy"} <= loaded:
        # the shapes the program tells apart, each present once: classic NHD / HND, MLA, packed
        # per-head runs (CS), chunked heads, token groups, blocked-scale rows, multi-plane records
        kinds = {
            "NHD": ("classic", 2, (("row", "NHD", ""),), False, False),
            "HND": ("classic", 2, (("heads", "HND", ""),), False, False),
            "MLA": ("classic", 1, (("row", "-", ""),), False, False),
            "packed CS": ("classic", 2, (("heads", "NHD", ""),), False, False),
            "fused NBBS": ("classic", 2, (("row", "-", ""),), False, False),
        }
        assert {k for k, cls in kinds.items() if cls in reps} == set(kinds), sorted(reps)
        assert any(any(p[0] == "chunks" and p[2] == "" for p in cls[2]) for cls in reps), "chunked heads"
        assert any(any(p[2] == "groups" for p in cls[2]) for cls in reps), "token groups"
        assert any(cls[0] == "shared-row" for cls in reps), "blocked-scale records"
        assert any(cls[0] == "per-plane" and cls[1] == 4 and cls[3] for cls in reps), "multi-plane records"
    assert len(set(reps.values())) == len(reps) < 20
    fixtures, passed = _run_triton(monkeypatch, sorted(reps.values()))
    assert fixtures == passed == set(reps.values()), sorted(set(reps.values()) - passed)


@pytest.mark.skipif(not INTERPRET_ALL, reason="KVCORE_XPU_INTERPRET_ALL=1: every fixture in the interpreter (3 to 4 minutes)")
def test_conformance_suite_with_the_triton_kernel_on_every_fixture(monkeypatch):
    """The same over every fixture of every installed plugin (and every kernel's checks of
    the XPU fixtures): ``TRITON_INTERPRET=1 kvcore check xpu``."""
    pytest.importorskip("triton")
    fixtures, passed = _run_triton(monkeypatch, None)
    if not fixtures:
        pytest.skip("no installed plugin supplies fixtures")
    assert passed == fixtures, sorted(fixtures - passed)


def test_xpu_fixtures_are_the_engine_allocations_at_xpu_geometry():
    """One fixture per XPU path whose engine plugin is installed, each of a format that
    plugin registers, at the XPU block/page sizes and dtypes."""
    from kvcore.testing.fixtures import registered_fixtures

    loaded = {i.name for i in kvcore.plugins() if not i.error}
    cases = {c.name: c for c in registered_fixtures("xpu")}
    want = set()
    if "vllm" in loaded:
        want |= {"xpu-vllm-0.11-FLASH_ATTN", "xpu-vllm-0.11-TRITON_ATTN-fp8", "xpu-vllm-0.33-FLASH_ATTN-LBNHC"}
    if "sglang" in loaded:
        want |= {
            "xpu-sglang-0.5.23-intel_xpu-mha-page128",
            "xpu-sglang-0.5.23-intel_xpu-mla-page32",
            "xpu-sglang-0.5.23-dsa-indexer-page128",
        }
    assert set(cases) == want
    names = {f.name for f in kvcore.formats()}
    for c in cases.values():
        assert c.format in names
        assert c.sizes["block_size"] in (32, 64, 128) and c.source
    if "vllm" in loaded:
        fa = cases["xpu-vllm-0.11-FLASH_ATTN"]
        kv, hints = fa.make(fa.sizes, torch.bfloat16, torch.device("cpu"))
        assert hints["device_type"] == "xpu" and "kv_cache_layout" not in hints  # NHD is the platform's, not a hint
        assert kvcore.detect(kv, "vllm", hints).format.name == fa.format == "NL_X_TWO_NB_BS_NH_HS"
        assert cases["xpu-vllm-0.11-TRITON_ATTN-fp8"].dtypes[2] == torch.float8_e5m2
