"""The project's end-to-end test on real engine output: ``kvcore demo --engine transformers``.

transformers' continuous batching computes and lays out the KV of a small random Llama;
kvcore detects the live paged cache, offloads and restores a finished request's blocks
(bit-exact), and the K/V it gathers equal the same model's DynamicCache (float32, max
abs error <= 1e-5 x the largest |K/V|); a DynamicCache offloaded after prefill and rebuilt by scatter
continues greedy generation with the same tokens as an uninterrupted run.
"""

from __future__ import annotations

import json

from kvcore_transformers.demo import run

import kvcore


def test_demo_end_to_end(capsys):
    rc = run(["--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert out["ok"] is True
    lay = out["layout"]
    assert lay["format"] == "NB_NL_TWO_BS_NH_HS"
    assert (lay["num_layers"], lay["block_size"], lay["num_heads"], lay["head_size"]) == (4, 16, 2, 16)
    assert len(out["requests"]) == 5 and all(len(r["generated"]) == 8 for r in out["requests"].values())
    req = out["request"]
    assert req["tokens_cached"] == 50 + 8 - 1 and len(req["blocks"]) == 4
    off = out["offload"]
    assert off["blocks_bit_exact"] and off["request_tokens_bit_exact"] and off["wiped_blocks_differ"]
    assert not set(off["restored_into"]) & set(req["blocks"])
    o = out["oracle"]
    tol = 1e-5 * o["max_abs_value"]
    assert o["pass"] and o["tolerance"] == tol and o["max_abs_err_K"] <= tol and o["max_abs_err_V"] <= tol
    assert o["wrong_layout_HND_err"] > 1000 * tol and o["wrong_K_V_swapped_err"] > 1000 * tol
    d = out["dynamic"]
    assert d["identical"] and d["rebuilt_bit_exact"] and len(d["uninterrupted"]) == 8
    assert d["from_rebuilt_cache"] == d["uninterrupted"]
    assert len(set(d["uninterrupted"])) > 4  # a continuation that varies, so that "identical" means something


def test_demo_is_registered_for_kvcore_demo():
    demos = kvcore.registry.demos()
    assert "transformers" in demos and demos["transformers"][2] == "transformers"


def test_demo_exits_1_on_any_difference(monkeypatch, capsys):
    """One failed proof is exit code 1 and a FAILED report (the parts are stubbed: the
    real run is test_demo_end_to_end)."""
    import kvcore_transformers.demo as demo

    monkeypatch.setattr(demo, "build_model", lambda seed: None)
    monkeypatch.setattr(demo, "part_paged", lambda model, args, out: False)
    monkeypatch.setattr(demo, "part_dynamic", lambda model, args, out: True)
    assert demo.run([]) == 1
    assert "FAILED" in capsys.readouterr().out
    monkeypatch.setattr(demo, "part_paged", lambda model, args, out: True)
    assert demo.run([]) == 0
