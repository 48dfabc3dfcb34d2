"""The project's end-to-end test on real engine output: ``kvcore demo --engine transformers``.

transformers' continuous batching computes and lays out the KV of a small random Llama;
kvcore detects the live paged cache, offloads and restores a finished request's blocks
(bit-exact), and the K/V it gathers equal the same model's DynamicCache (float32, max
abs error <= 1e-5); a DynamicCache offloaded after prefill and rebuilt by scatter
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
    assert o["pass"] and o["max_abs_err_K"] <= 1e-5 and o["max_abs_err_V"] <= 1e-5
    assert o["wrong_layout_HND_err"] > 1e-2 and o["wrong_K_V_swapped_err"] > 1e-2
    d = out["dynamic"]
    assert d["identical"] and d["rebuilt_bit_exact"] and len(d["uninterrupted"]) == 8
    assert d["from_rebuilt_cache"] == d["uninterrupted"]


def test_demo_is_registered_for_kvcore_demo():
    demos = kvcore.registry.demos()
    assert "transformers" in demos and demos["transformers"][2] == "transformers"
