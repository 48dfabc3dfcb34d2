"""The prefill/decode demo (``kvcore demo --engine vllm --pd``): it passes between two Gloo
processes, and its verification is not vacuous (a flipped byte, a head shift or a slot the
requests do not use being written make it fail)."""

from __future__ import annotations

import json

import pytest
import torch
from kvcore_vllm import pd_demo
from kvcore_vllm.demo import Encoder

import kvcore
from kvcore.cli import main as cli_main

NB = 32


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors: one intra-op thread is faster on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_pd_demo_through_the_cli_passes(capsys):
    rc = cli_main(["demo", "--engine", "vllm", "--pd", "--num-blocks", str(NB), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    assert rep["passed"] is True and rep["backend"] == "gloo"
    assert rep["prefill"]["format"] == "NL_X_TWO_NB_BS_NH_HS" and rep["prefill"]["describe"] == f"32 x [2, {NB}, 16, 8, 128]"
    assert rep["decode"]["format"] == "NL_X_TWO_NB_NH_BS_HS" and rep["decode"]["describe"].endswith(", 4, 32, 128]")
    assert rep["decode"]["elements_checked"] == 2 * 32 * 2 * (NB * 16 // 32 + 4) * 32 * 4 * 128


@pytest.fixture(scope="module")
def landed():
    """The decode caches as the transfer leaves them, made here with kvcore.copy (same content)."""
    enc = Encoder(torch.bfloat16, 8, 128, torch.device("cpu"))
    _, pre = pd_demo.prefill_cache(NB, "cpu", enc)
    dec = pd_demo.decode_caches(NB, "cpu")
    reqs = pd_demo._requests(NB, 0)
    for r in reqs:
        for tp, (_, lay) in enumerate(dec):
            kvcore.copy(pre, r["prefill_slots"], lay, r["decode_slots"], heads=(4 * tp, 4 * tp + 4))
    return enc, dec, reqs


def test_verify_accepts_the_landed_caches(landed):
    enc, dec, reqs = landed
    errors, n = pd_demo.verify(dec, reqs, enc, NB, "cpu")
    assert errors == [] and n > 0


@pytest.mark.parametrize("where", ["landed", "unused", "head"])
def test_verify_catches_corruption(landed, where):
    from kvcore_vllm import fixtures

    enc, dec, reqs = landed
    caches = dec[1][0]
    v = fixtures.kv_view(caches, 5, 1).view(torch.int16)  # decode rank 1, layer 5, V: [NB, BS, 4, 128]
    s = int(reqs[1]["decode_slots"][3])
    if where == "landed":
        idx = (s // 32, s % 32, 2, 7)
    elif where == "unused":
        used = set(torch.cat([r["decode_slots"] for r in reqs]).tolist())
        free = next(i for i in range(v.shape[0] * 32) if i not in used)
        idx = (free // 32, free % 32, 0, 0)
    else:  # the rank's heads shifted by one: head 0 holds head 1's values
        idx = (s // 32, s % 32, 0, slice(None))
    old = v[idx].clone()
    try:
        if where == "head":
            v[idx] = v[s // 32, s % 32, 1]
        else:
            v[idx] ^= 0x5A
        errors, _ = pd_demo.verify(dec, reqs, enc, NB, "cpu")
        assert len(errors) == 1 and "decode rank 1 layer 5 V" in errors[0]
        assert ("a slot no request uses" in errors[0]) == (where == "unused")
    finally:
        v[idx] = old
