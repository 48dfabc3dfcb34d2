"""The SGLang demo, run small; and a corrupted transfer makes it fail."""

from __future__ import annotations

import json

import torch
from kvcore_sglang import demo

import kvcore

SMALL = ["--layers", "2", "--pool-tokens", "320", "--tokens", "70"]


def test_demo_runs_small_and_passes(capsys):
    assert demo.run(SMALL) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    for name in ("llama3-8b-mha-page1", "llama3-8b-mha-page64", "deepseek-v3-mla-page64"):
        assert name in out


def test_demo_json_reports_formats(capsys):
    assert demo.run(SMALL + ["--json", "--dtype", "fp8_e4m3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] is True
    assert all(r["tokens"] == 70 for r in res["results"])
    by = {r["scenario"]: r for r in res["results"]}
    assert by["llama3-8b-mha-page1"]["device_format"] == "TWO_X_NL_X_NBBS_NH_HS"
    assert by["llama3-8b-mha-page64"]["device_shape"] == "2 x 2 x [6, 64, 8, 128]"
    assert by["deepseek-v3-mla-page64"]["host_format"] == "NBBS_NL_ONE_HS"
    assert by["deepseek-v3-mla-page64"]["storage_dtype"] == "uint8" and by["deepseek-v3-mla-page64"]["dtype"] == "float8_e4m3fn"


def test_demo_exits_1_when_a_transfer_swaps_k_and_v(monkeypatch, capsys):
    real = kvcore.gather

    def swapped(layout, slots, *a, **kw):
        out = real(layout, slots, *a, **kw)
        return torch.flip(out, dims=[0]) if out.shape[0] == 2 else out

    monkeypatch.setattr(demo.kvcore, "gather", swapped)
    assert demo.run(SMALL + ["--scenario", "llama3-8b-mha-page1"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_demo_rejects_bad_options():
    assert demo.run(["--tokens", "0"]) == 2
    assert demo.run(["--scenario", "nope"]) == 2
