"""The vLLM demo (``kvcore demo --engine vllm``): it passes on a small cache, and its checks
are not vacuous (a flipped byte, swapped K/V or a shifted head make it fail with exit 1)."""

from __future__ import annotations

import json

import pytest
import torch
from kvcore_vllm import demo

import kvcore
from kvcore.cli import main as cli_main

SMALL = ["--num-blocks", "8", "--json", "--quiet"]


@pytest.fixture(autouse=True)
def _one_thread():
    """The demo's tensors are tiny at 8 blocks: one intra-op thread is faster (and does not
    spin against the rest of the suite on a 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _report(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out)


def test_demo_through_the_cli_passes_every_check(capsys):
    rc = cli_main(["demo", "--engine", "vllm", *SMALL])
    rep = _report(capsys)
    assert rc == 0, rep
    assert rep["passed"] is True
    by_case = {c["case"]: c for c in rep["cases"]}
    assert set(by_case) == {"llama-nhd", "llama-hnd", "deepseek-mla"}
    assert by_case["llama-nhd"]["format"] == "NL_X_TWO_NB_BS_NH_HS"
    assert by_case["llama-nhd"]["describe"] == "32 x [2, 8, 16, 8, 128]"
    assert by_case["llama-hnd"]["format"] == "NL_X_TWO_NB_NH_BS_HS"
    assert by_case["llama-hnd"]["describe"] == "32 x [2, 8, 8, 16, 128]"
    assert by_case["deepseek-mla"]["format"] == "NL_X_NB_BS_HS"
    assert by_case["deepseek-mla"]["describe"] == "61 x [8, 64, 576]"
    for c in rep["cases"]:
        assert c["verified"] is True and c["errors"] == []
        assert c["checks"] == {
            "detect": True,
            "geometry": True,
            "gather_semantic": True,
            "bit_exact": True,
            "cache_semantic": True,
        }
        # bytes moved = tokens x kv_size x layers x heads x head_size x 2 bytes (bf16)
        row = 2 * 32 * 8 * 128 * 2 if c["case"].startswith("llama") else 1 * 61 * 576 * 2
        assert c["bytes_moved"] == c["tokens"] * row
        assert c["gather_gbps"] > 0 and c["scatter_gbps"] > 0
        bs = 64 if c["case"] == "deepseek-mla" else 16
        lengths = [r["tokens"] for r in c["requests"]]
        assert sum(lengths) == c["tokens"] and len(lengths) == 4
        assert any(n % bs for n in lengths), "one request must end inside a block"
        assert any(r["padding_slots"] > 0 for r in c["requests"]), "one request must carry padding slots"


def test_a_flipped_byte_after_restore_fails(capsys):
    rc = demo.run([*SMALL, "--case", "llama-hnd", "--self-test-corrupt"])
    rep = _report(capsys)
    assert rc == 1
    assert rep["passed"] is False
    (c,) = rep["cases"]
    assert c["verified"] is False
    assert c["checks"]["bit_exact"] is False
    assert c["checks"]["cache_semantic"] is False
    assert c["checks"]["gather_semantic"] is True  # the offload itself was right
    assert any("1 wrong values" in e for e in c["errors"])


def test_swapped_k_and_v_in_the_offload_is_caught(capsys, monkeypatch):
    real = kvcore.gather

    def swapped(layout, slot_mapping, out=None, **kw):
        st = real(layout, slot_mapping, out, **kw)
        st.copy_(st.flip(0))  # K rows <-> V rows
        return st

    monkeypatch.setattr(kvcore, "gather", swapped)
    rc = demo.run([*SMALL, "--case", "llama-nhd"])
    rep = _report(capsys)
    assert rc == 1
    (c,) = rep["cases"]
    assert c["checks"]["gather_semantic"] is False
    # the restore put V where K was: the engine-side view of the cache shows it
    assert c["checks"]["cache_semantic"] is False


def test_a_head_shift_in_the_restore_is_caught(capsys, monkeypatch):
    real = kvcore.scatter

    def shifted(layout, slot_mapping, src, **kw):
        nh, hs = layout.num_heads, layout.head_size
        rolled = src.view(*src.shape[:-1], nh, hs).roll(1, dims=-2).reshape(src.shape)
        return real(layout, slot_mapping, rolled, **kw)

    monkeypatch.setattr(kvcore, "scatter", shifted)
    rc = demo.run([*SMALL, "--case", "llama-hnd"])
    rep = _report(capsys)
    assert rc == 1
    (c,) = rep["cases"]
    assert c["checks"]["bit_exact"] is False and c["checks"]["cache_semantic"] is False


@pytest.mark.parametrize("argv", [["--num-blocks", "4"], ["--case", "nope"], ["--device", "no-such-device"]])
def test_bad_options_exit_2(argv, capsys):
    assert demo.run(argv) == 2


def test_unknown_demo_engine_lists_the_registered_ones(capsys):
    assert cli_main(["demo", "--engine", "no-such-engine"]) == 2
    err = capsys.readouterr().err
    assert "no demo named 'no-such-engine'" in err and "vllm" in err


def test_requests_cover_the_mixed_cases():
    for nb, bs in [(8, 16), (64, 16), (9, 64), (256, 16)]:
        reqs = demo.make_requests(nb, bs, seed=3)
        src = [b for r in reqs for b in r.src_blocks]
        dst = [b for r in reqs for b in r.dst_blocks]
        assert len(set(src)) == len(src) and len(set(dst)) == len(dst)
        assert not set(src) & set(dst), "restored into *other* blocks"
        assert all(0 <= b < nb for b in src + dst)
        lengths = [r.length for r in reqs]
        assert lengths[0] % bs == 0 and lengths[1] % bs != 0
        padded = reqs[3]
        assert padded.pad > 0 and bool((padded.src_slots[-padded.pad :] == -1).all())
        for r in reqs:
            valid = r.src_slots[r.src_slots >= 0]
            assert valid.numel() == r.length
            # slot = block_id * block_size + offset, through the request's block table
            t = torch.arange(r.length)
            table = torch.tensor(r.src_blocks)
            assert torch.equal(valid, table[t // bs] * bs + t % bs)


def test_encoding_changes_with_every_coordinate():
    enc = demo.Encoder(torch.bfloat16, 8, 128, torch.device("cpu"))
    slots = torch.arange(64)
    base = enc.encode(3, 0, slots)
    assert base.dtype == torch.int16 and base.shape == (64, 8, 128)
    assert bool((base != enc.encode(3, 1, slots)).all())  # K vs V
    assert bool((base != enc.encode(4, 0, slots)).all())  # layer
    assert bool((base != enc.encode(3, 0, slots + 1)).all())  # slot
    assert bool((base[:, 1:] != base[:, :-1]).all())  # head
    assert bool((base[:, :, 1:] != base[:, :, :-1]).all())  # element
    st = enc.encode_staging(torch.tensor([5, -1, 7]), num_layers=2, kv_size=2)
    assert st.shape == (2, 2, 3, 8, 128)
    assert torch.equal(st[1, 0, 2], enc.encode(0, 1, torch.tensor([7]))[0])
    assert bool((st[:, :, 1] == 0).all())
