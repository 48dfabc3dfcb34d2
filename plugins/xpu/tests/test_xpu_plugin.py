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


def test_conformance_suite_with_the_triton_kernel_on_every_fixture(monkeypatch):
    """``TRITON_INTERPRET=1 kvcore check xpu``: the Triton kernel (forced, in the
    interpreter, on CPU tensors) against every fixture of every installed plugin --
    semantic gather/scatter against the engine's own views, round trips of every dtype,
    padding, staging views, bad calls refused before writing, and byte-for-byte agreement
    with the reference kernel on random geometries."""
    pytest.importorskip("triton")
    from kvcore.testing import suite

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("KVCORE_KERNEL", raising=False)
    results = suite.run_checks(["xpu"], suite.Options(examples=4))
    mine = [r for r in results if r.kernel == "triton-xpu@cpu"]
    failed = [r for r in results if r.status == "FAIL"]
    assert not failed, "\n".join(r.line() for r in failed[:10])
    fixtures = {r.fixture for r in mine}
    if not fixtures:
        pytest.skip("no installed plugin supplies fixtures")
    passed = {r.fixture for r in mine if r.check == "agrees_with_reference" and r.status == "PASS"}
    assert passed == fixtures, sorted(fixtures - passed)
    assert {r.check.split("[")[0] for r in mine if r.status == "PASS"} >= {
        "semantic_gather",
        "semantic_scatter",
        "roundtrip",
        "negative_slots",
        "empty_slots",
        "invalid",
        "staging_views",
        "agrees_with_reference",
    }


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
