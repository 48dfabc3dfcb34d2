"""kvcore.send / kvcore.recv: the agreement, the fast path and mismatches, over Gloo.

Two processes run one list of scenarios twice: with the host engine (Gloo, every message
waited for in the call, the torch reference kernels) and with the GPU engine's fast path
emulated on the CPU (``KVCORE_P2P_EMULATE=1``: the same messages as on NCCL — the D / R0
exchange with the first chunk, the answer V with the last — the native control functions
and the gated unpacking kernel). Every landed cache is compared element by element with
the sender's rows (codes unique to layer, K/V, slot, head and element); refused transfers
must leave the receiver untouched, and the channel must stay usable afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch


def _helpers():
    """The caches and checks of test_distributed.py (tests are loaded by path, not as a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_kvcore_p2p_test_helpers", Path(__file__).with_name("test_distributed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_h = _helpers()
DS, SS, Cache, _err, _verify = _h.DS, _h.SS, _h.Cache, _h._err, _h._verify


def _scenarios(rank: int, world: int, out_dir: str):
    import kvcore
    from kvcore import distributed

    out = Path(out_dir) / f"rank{rank}.json"
    res: dict = {"emulated": distributed._emulate()}

    def save():
        out.write_text(json.dumps(res))

    stats = distributed._STATS
    rows3 = 3 * 2 * 2 * 2 * 4 * 4  # bytes of 3 token rows of a 2-layer, 2-head K/V int32 cache
    # 1. a handshake, then the same geometry and token count again and again: fast, new slot values each time
    sets = [(SS, DS), ([4, 6, 8, 10, 12, 14, 16, 18, -1, 20, 22], [1, 2, 3, 4, 5, 6, 7, 8, 9, -1, 11]), (SS[::-1], DS[::-1])]
    h0 = stats["handshakes"]
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 4)
        res["repeat"] = [_err(lambda ss=ss: kvcore.send(src.layout, ss, 1, heads=(2, 4), chunk_bytes=rows3, tag=1)) for ss, _ in sets]
    else:
        errs = []
        for r, (ss, ds) in enumerate(sets):
            dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=10 + r)
            before = dst.snapshot()
            errs.append(_err(lambda d=dst, ds=ds: kvcore.recv(d.layout, ds, 0, tag=1)))
            errs.append(_verify(dst, before, None, ss, ds, heads=(2, 4)))
        res["repeat"] = errs
    res["repeat_handshakes"] = stats["handshakes"] - h0
    save()
    # 2. refusals inside the agreement: the sender's slot out of range, a receiver's slot twice
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 4)
        res["refuse"] = [
            _err(lambda: kvcore.send(src.layout, SS[:-1] + [999], 1, heads=(2, 4), tag=1)),
            _err(lambda: kvcore.send(src.layout, SS, 1, heads=(2, 4), tag=1)),
            _err(lambda: kvcore.send(src.layout, SS, 1, heads=(2, 4), tag=1)),
        ]
    else:
        dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=30)
        before = dst.snapshot()
        errs = [
            _err(lambda: kvcore.recv(dst.layout, DS, 0, tag=1)),
            _err(lambda: kvcore.recv(dst.layout, DS[:-1] + [40], 0, tag=1)),
        ]
        errs.append(all(torch.equal(a, b) for a, b in zip(dst.snapshot(), before)))
        errs.append(_err(lambda: kvcore.recv(dst.layout, DS, 0, tag=1)))  # the channel still works
        errs.append(_verify(dst, before, None, SS, DS, heads=(2, 4)))
        res["refuse"] = errs
    save()
    # 3. mismatches: only one side changed its token count (both raise, nothing written), then a matching call
    h0 = stats["handshakes"]
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 4)
        res["mismatch"] = [
            _err(lambda: kvcore.send(src.layout, SS[:5], 1, heads=(2, 4), tag=1)),  # the sender changed
            _err(lambda: kvcore.send(src.layout, SS, 1, heads=(2, 4), tag=1)),  # the receiver changed
            _err(lambda: kvcore.send(src.layout, SS[:5], 1, heads=(2, 4), tag=1)),  # both changed: a new agreement
        ]
    else:
        dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=40)
        before = dst.snapshot()
        errs = [_err(lambda: kvcore.recv(dst.layout, DS, 0, tag=1)), _err(lambda: kvcore.recv(dst.layout, DS[:5], 0, tag=1))]
        errs.append(all(torch.equal(a, b) for a, b in zip(dst.snapshot(), before)))
        errs.append(_err(lambda: kvcore.recv(dst.layout, DS[:5], 0, tag=1)))
        errs.append(_verify(dst, before, None, SS[:5], DS[:5], heads=(2, 4)))
        res["mismatch"] = errs
    res["mismatch_handshakes"] = stats["handshakes"] - h0
    save()
    # 4. no tokens: a handshake, then the fast exchange of the control messages alone
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 2)
        res["empty"] = [_err(lambda: kvcore.send(src.layout, torch.empty(0, dtype=torch.int64), 1, tag=2)) for _ in range(2)]
    else:
        dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=50)
        before = dst.snapshot()
        res["empty"] = [_err(lambda: kvcore.recv(dst.layout, [], 0, tag=2)) for _ in range(2)]
        res["empty"].append(all(torch.equal(a, b) for a, b in zip(dst.snapshot(), before)))
    save()
    # 5. the sender dies in the middle of a fast transfer
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 2)
        kvcore.send(src.layout, SS, 1, chunk_bytes=2 * 2 * 2 * 2 * 4 * 4, tag=3)  # the agreement: two rows per chunk
        real, sent = distributed._isend, []

        def dying(tensor, peer, group, tag):
            if len(sent) >= 3:  # D, chunks 0 and 1 went out: die before chunk 2
                sent[-1].wait()
                save()
                os._exit(0)
            w = real(tensor, peer, group, tag)
            sent.append(w)
            return w

        distributed._isend = dying
        kvcore.send(src.layout, SS, 1, tag=3)
        res["died"] = "the sender survived"
        save()
    else:
        dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=60)
        kvcore.recv(dst.layout, DS, 0, tag=3)
        before = dst.snapshot()
        res["died"] = _err(lambda: kvcore.recv(dst.layout, DS, 0, timeout=15, tag=3))
        res["died_check"] = _verify(dst, before, None, SS, DS, heads=(0, 2), rows_landed=4)
    save()
    return res


@pytest.fixture(scope="module", params=["host", "emulated"])
def outcome(request, tmp_path_factory):
    from kvcore.testing.multiprocess import run_ranks

    env = {"KVCORE_NATIVE": "0"}
    if request.param == "emulated":
        from kvcore.kernels import _build

        st = _build.load()
        if not st.loaded or not hasattr(_build.MODULE, "p2p_gate"):
            pytest.skip(f"the native op library is not available: {st.reason}")
        env = {"KVCORE_P2P_EMULATE": "1"}
        for k in ("KVCORE_BUILD_DIR",):
            if k in os.environ:
                env[k] = os.environ[k]
    d = tmp_path_factory.mktemp(f"p2p-{request.param}")
    results = run_ranks(f"{__file__}:_scenarios", 2, args=(str(d),), timeout=240, env=env, pg_timeout=60)
    for r in results:
        assert r.error is None, f"rank {r.rank} raised:\n{r.error}"
    out = [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]
    assert out[1]["emulated"] is (request.param == "emulated")
    return out


def test_repeated_transfers_run_without_a_handshake(outcome):
    send, recv = outcome
    assert send["repeat"] == [None, None, None]
    assert recv["repeat"] == [None] * 6  # each landed, each compared element by element
    assert send["repeat_handshakes"] == 1 and recv["repeat_handshakes"] == 1  # only the first call shook hands


def test_refusals_inside_the_agreement(outcome):
    send, recv = outcome
    s_bad, s_dup, s_ok = send["refuse"]
    r_bad, r_dup, untouched, r_ok, check = recv["refuse"]
    assert "slots[10] = 999 is out of range" in s_bad and "40 slots per layer" in s_bad
    assert "the sender refused and sent nothing" in r_bad and "999" in r_bad
    assert "destination slot 40 appears more than once" in r_dup and "wrote nothing" in r_dup
    assert "destination slot 40 appears more than once" in s_dup and "rank 1" in s_dup
    assert untouched
    assert s_ok is None and r_ok is None and check is None


def test_only_one_side_changed_both_raise_and_nothing_is_written(outcome):
    send, recv = outcome
    s1, s2, s3 = send["mismatch"]
    r1, r2, untouched, r3, check = recv["mismatch"]
    # the sender changed its token count, the receiver repeated the agreed transfer
    assert "sends 5 token rows" in s1 and "the receiver refused and wrote nothing" in s1
    assert "5 token rows" in r1 and ("the two calls do not match" in r1)
    # the receiver changed, the sender repeated
    assert "sends 11 token rows but this side has 5 slots" in r2 and "the two calls do not match" in r2
    assert "was called with 5 token rows" in s2 and "nothing was written" in s2
    assert untouched
    assert s3 is None and r3 is None and check is None  # both changed: a new agreement, landed
    # the changed side shakes hands each time; the side that repeats does not
    assert send["mismatch_handshakes"] == 2 and recv["mismatch_handshakes"] == 2


def test_no_tokens(outcome):
    send, recv = outcome
    assert send["empty"] == [None, None]
    assert recv["empty"] == [None, None, True]


def test_sender_dying_in_a_fast_transfer(outcome):
    send, recv = outcome
    assert "died" not in send
    msg = recv["died"]
    assert msg is not None and "chunk 2 of 6 (rows 4..5) did not arrive" in msg, msg
    assert "Destination slots [12, 13] (that chunk) were not written" in msg and "rows 6..10" in msg
    assert "chunks 0..1 (rows 0..3) were landed" in msg
    assert recv["died_check"] is None


def test_native_control_functions_match_the_host_checks():
    """The CPU build of the GPU engine's control functions (csrc/kvcore_copy.cpp; the CUDA
    kernels share their decisions) against the semantics the host engine implements."""
    from kvcore.distributed import CTL_BYTES, FAST, MAGIC, _check_values
    from kvcore.kernels import _build

    if not _build.load().loaded or not hasattr(_build.MODULE, "p2p_gate"):
        pytest.skip("the native op library is not available")
    mod = _build.MODULE
    flag = torch.zeros(1, dtype=torch.int32)
    rep = torch.zeros(CTL_BYTES, dtype=torch.uint8)
    cases = [
        (torch.tensor([3, -1, 7, 2]), 8),  # fine
        (torch.tensor([3, 9, 7, 12]), 8),  # out of range at row 1
        (torch.tensor([3, 5, 3, -1]), 8),  # 3 twice
        (torch.tensor([-1, -1]), 8),
        (torch.empty(0, dtype=torch.int64), 8),
    ]
    for s, n in cases:
        mask = torch.zeros(max(1, s.numel()), dtype=torch.uint8)
        # the sender: range and the padding mask
        k = mod.p2p_check(s, n, None, 0, None, flag, rep, MAGIC, FAST, 7, mask, 3, 1, 1)
        want = _check_values(s, n, None, 0)
        rec = rep.view(torch.int64).tolist()
        assert (k, rec[4:8]) == (want[0], list(want)), (s, k, rec)
        assert rec[:4] == [MAGIC, FAST, 7, s.numel()] and int(flag) == k
        assert mask[: s.numel()].tolist() == (s >= 0).to(torch.uint8).tolist()
        # the receiver: range and repeats
        k = mod.p2p_check(None, 0, s, n, torch.zeros(1, dtype=torch.int32), flag, rep, MAGIC, FAST, 7, None, 4, 1, 0)
        want = _check_values(None, 0, s, n)
        assert (k, rep.view(torch.int64).tolist()[4:7]) == (want[0], list(want[:3])), (s, k)
    # the gate: lands only under the agreement, with the sender's verdict clean and this side's own
    T = 4
    slots = torch.tensor([5, 6, 7, 8])
    eff = torch.empty(T, dtype=torch.int64)
    gate = torch.zeros(1, dtype=torch.int32)

    def rec(*f):
        t = torch.zeros(8, dtype=torch.int64)
        t[: len(f)] = torch.tensor(f)
        return t.view(torch.uint8)

    def prefix(verdict=0, mask=(1, 0, 1, 1)):
        return torch.cat(
            [rec(MAGIC, 0, 7, T, verdict, 2, 99, 8), torch.tensor(mask, dtype=torch.uint8), torch.zeros(12, dtype=torch.uint8)]
        )

    own = torch.zeros(1, dtype=torch.int32)
    assert mod.p2p_gate(rec(MAGIC, FAST, 7, T), prefix(), own, MAGIC, 7, T, slots, eff, gate, 1, 0) == 0
    assert eff.tolist() == [5, -1, 7, 8] and int(gate) == 0
    for d, p, o, want in [
        (rec(MAGIC, 2, 7, T), prefix(), 0, 8),  # the sender is slow: it changed
        (rec(MAGIC, FAST, 6, T), prefix(), 0, 8),  # another epoch
        (rec(MAGIC, FAST, 7, T), prefix(1), 0, 7),  # the sender's slots were refused
        (rec(1, FAST, 7, T), prefix(), 0, 9),  # not a kvcore message
        (rec(MAGIC, FAST, 7, T), prefix(), 2, 100),  # this side's own refusal
    ]:
        own.fill_(o)
        k = mod.p2p_gate(d, p, own, MAGIC, 7, T, slots, eff, gate, 1, 0)
        assert k == want and int(gate) != 0 and eff.tolist() == [-1] * T, (k, want)
    msg = (mod.p2p_gate(rec(MAGIC, FAST, 7, T), prefix(1), own.fill_(0), MAGIC, 7, T, slots, eff, gate, 1, 0), mod.copy_last_error())
    assert msg[0] == 7 and "its slots[2] = 99 is out of range: its cache has 8 slots per layer" in msg[1]
    # the sender's reading of the answers
    assert mod.p2p_verdict(rec(MAGIC, FAST, 7, T), rec(MAGIC, 0, 7, T, 0), MAGIC, 7, T, None, 1, 1) == 0
    assert mod.p2p_verdict(rec(MAGIC, 2, 7, 5), rec(MAGIC, 0, 7, T, 0), MAGIC, 7, T, None, 1, 1) == 6
    assert "was called with 5 token rows" in mod.copy_last_error()
    assert mod.p2p_verdict(rec(MAGIC, FAST, 7, T), rec(MAGIC, 0, 7, T, 2, -1, 40, 64), MAGIC, 7, T, None, 1, 1) == 5
    assert "destination slot 40 appears more than once in its slots" in mod.copy_last_error()
