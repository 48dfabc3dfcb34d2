"""kvcore.send / kvcore.recv between two processes over Gloo, checked semantically.

One spawn of two processes runs every scenario in order (rank 0 sends, rank 1 receives,
except the merge, where rank 0 sends from two tensor-parallel caches); each scenario's
outcome comes back to the test that checks it. Every receiving cache is written with a
code unique to (layer, K/V, slot, head, element) through plain torch views; after a
transfer every element must hold its source row's code (moved rows) or its own old value.
The last scenario kills the sender in the middle of a transfer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

HS = 4


def _code(layer, kv, slot, head, elem, seed=0):
    return ((((layer + seed) * 2 + kv) * 4096 + slot) * 64 + head) * HS + elem + 1


FAMILIES = {
    "NL_X_TWO_NB_BS_NH_HS": (
        lambda nl, nb, bs, nh: [torch.zeros(2, nb, bs, nh, HS, dtype=torch.int32) for _ in range(nl)],
        lambda c, ly, k: c[ly][k],
    ),
    "NL_X_TWO_NB_NH_BS_HS": (
        lambda nl, nb, bs, nh: [torch.zeros(2, nb, nh, bs, HS, dtype=torch.int32) for _ in range(nl)],
        lambda c, ly, k: c[ly][k].transpose(1, 2),
    ),
    "NB_NL_TWO_BS_NH_HS": (lambda nl, nb, bs, nh: torch.zeros(nb, nl, 2, bs, nh, HS, dtype=torch.int32), lambda c, ly, k: c[:, ly, k]),
    "NL_X_NB_NH_BS_CS": (
        lambda nl, nb, bs, nh: [torch.zeros(nb, nh, bs, 2 * HS, dtype=torch.int32) for _ in range(nl)],
        lambda c, ly, k: c[ly][..., k * HS : (k + 1) * HS].transpose(1, 2),
    ),
    "NL_X_NB_BS_HS": (
        lambda nl, nb, bs, nh: [torch.zeros(nb, bs, HS, dtype=torch.int32) for _ in range(nl)],
        lambda c, ly, k: c[ly].unsqueeze(2),
    ),
    "NL_X_NBBS_ONE_HS": (
        lambda nl, nb, bs, nh: [torch.zeros(nb * bs, 1, HS, dtype=torch.int32) for _ in range(nl)],
        lambda c, ly, k: c[ly].unsqueeze(1),
    ),
}


class Cache:
    def __init__(self, name, nl, nb, bs, nh, seed=0, dtype=None):
        import kvcore

        alloc, self._view = FAMILIES[name]
        self.name, self.nl, self.nb, self.bs, self.nh = name, nl, nb, bs, nh
        self.kv = 1 if name in ("NL_X_NB_BS_HS", "NL_X_NBBS_ONE_HS") else 2
        self.caches = alloc(nl, nb, bs, nh)
        for ly in range(nl):
            for k in range(self.kv):
                v = self.view(ly, k)
                slot = torch.arange(nb * bs).view(nb, bs, 1, 1)
                h = torch.arange(nh).view(1, 1, nh, 1)
                e = torch.arange(HS).view(1, 1, 1, HS)
                v.copy_(_code(ly, k, slot, h, e, seed).to(torch.int32).view(v.shape))
        if dtype is not None:  # the same bytes read as another dtype
            self.caches = [t.view(dtype) for t in self.caches]
        self.layout = kvcore.build_layout(name, self.caches)

    def view(self, ly, k):
        v = self._view(self.caches, ly, k)
        return v.view(torch.int32) if v.dtype != torch.int32 else v

    def rows(self, ly, k):
        return self.view(ly, k).reshape(self.nb * self.bs, self.nh, HS)

    def snapshot(self):
        return [self.rows(ly, k).clone() for ly in range(self.nl) for k in range(self.kv)]


def _verify(dst: Cache, before, src_codes, ss, ds, heads=(None, None), dst_heads=None, layers=None, seed=0, rows_landed=None):
    """First mismatch between ``dst`` and the expected content, or None."""
    h0, h1 = heads
    d0, d1 = dst_heads or (0, dst.nh)
    layers = layers or list(range(dst.nl))
    i = 0
    for ly in range(dst.nl):
        for k in range(dst.kv):
            want = before[i].clone()
            i += 1
            if ly < len(layers):
                sl = layers[ly]
                for r, (a, b) in enumerate(zip(ss, ds)):
                    if a < 0 or b < 0 or (rows_landed is not None and r >= rows_landed):
                        continue
                    hs = torch.arange(h0, h1).view(-1, 1)
                    e = torch.arange(HS).view(1, -1)
                    want[b, d0:d1] = _code(sl, k, a, hs, e, seed).to(torch.int32)
            got = dst.rows(ly, k)
            if not torch.equal(got, want):
                bad = torch.nonzero(got != want)[0].tolist()
                return f"layer {ly} kv {k} at {bad}: got {int(got[tuple(bad)])}, want {int(want[tuple(bad)])}"
    return None


def _err(fn):
    import kvcore

    try:
        fn()
    except kvcore.TransferError as e:
        return str(e)
    return None


SS = [5, 17, -1, 2, 30, 31, 8, 9, 22, 3, 12]  # sender slots (one padding row)
DS = [40, 3, 7, -1, 12, 13, 60, 61, 33, 0, 50]  # receiver slots (one padding row)


def _scenarios(rank: int, world: int, out_dir: str):
    import kvcore
    from kvcore import distributed

    out = Path(out_dir) / f"rank{rank}.json"
    res: dict = {}

    def save():
        out.write_text(json.dumps(res))

    small = 3 * 2 * 2 * 4 * HS * 4  # bytes of 3 token rows of a 2-layer, 4-head K/V cache: many chunks
    # 1. NHD BS 4 TP 1 -> HND BS 8 TP 2 (two receiving caches), padding on both sides, several chunks
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 4)
        res["split"] = [_err(lambda r=r: kvcore.send(src.layout, SS, 1, heads=(2 * r, 2 * r + 2), chunk_bytes=small)) for r in range(2)]
    else:
        errs = []
        for r in range(2):
            dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=50 + r)
            before = dst.snapshot()
            errs.append(_err(lambda d=dst: kvcore.recv(d.layout, DS, 0)))
            errs.append(_verify(dst, before, None, SS, DS, heads=(2 * r, 2 * r + 2)))
        res["split"] = errs
    save()
    # 2. TP merge: two caches of 2 heads (one per prefill rank) into one of 4 heads
    if rank == 0:
        parts = [Cache("NL_X_TWO_NB_NH_BS_HS", 2, 10, 4, 2, seed=0) for _ in range(2)]
        res["merge"] = [_err(lambda p=p: kvcore.send(p.layout, SS, 1)) for p in parts]
    else:
        dst = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 16, 4, 4, seed=70)
        before = dst.snapshot()
        errs = [_err(lambda r=r: kvcore.recv(dst.layout, DS, 0, heads=(2 * r, 2 * r + 2))) for r in range(2)]
        # both parts carry head codes 0..1 of the sender's 2-head cache
        mid = [t.clone() for t in before]
        for i in range(len(mid)):
            ly, k = divmod(i, 2)
            for a, b in zip(SS, DS):
                if a >= 0 and b >= 0:
                    hs = torch.arange(0, 2).view(-1, 1)
                    e = torch.arange(HS).view(1, -1)
                    c = _code(ly, k, a, hs, e).to(torch.int32)
                    mid[i][b, 0:2] = c
                    mid[i][b, 2:4] = c
        got = dst.snapshot()
        errs.append(None if all(torch.equal(a, b) for a, b in zip(got, mid)) else "merge mismatch")
        res["merge"] = errs
    save()
    # 3. MLA latent, cross-layer -> packed HND with a layer subset
    if rank == 0:
        mla = Cache("NL_X_NB_BS_HS", 3, 8, 4, 1)
        cross = Cache("NB_NL_TWO_BS_NH_HS", 3, 8, 4, 2)
        res["mla_cross"] = [_err(lambda: kvcore.send(mla.layout, SS, 1)), _err(lambda: kvcore.send(cross.layout, SS, 1, layers=[2, 0]))]
    else:
        mla = Cache("NL_X_NBBS_ONE_HS", 3, 16, 4, 1, seed=80)
        before = mla.snapshot()
        errs = [_err(lambda: kvcore.recv(mla.layout, DS, 0)), _verify(mla, before, None, SS, DS, heads=(0, 1))]
        packed = Cache("NL_X_NB_NH_BS_CS", 2, 8, 8, 2, seed=90)
        before = packed.snapshot()
        errs += [_err(lambda: kvcore.recv(packed.layout, DS, 0)), _verify(packed, before, None, SS, DS, heads=(0, 2), layers=[2, 0])]
        res["mla_cross"] = errs
    save()
    # 4. refusals: every one raises on both sides and writes nothing
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 4)
        f32 = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 2, dtype=torch.float32)
        res["refuse"] = {
            "heads": _err(lambda: kvcore.send(src.layout, SS, 1)),
            "dtype": _err(lambda: kvcore.send(f32.layout, SS, 1)),
            "overlap": _err(lambda: kvcore.send(src.layout, SS, 1, heads=(0, 2))),
            "sender_slots": _err(lambda: kvcore.send(src.layout, SS[:-1] + [999], 1, heads=(0, 2))),
            "tokens": _err(lambda: kvcore.send(src.layout, SS[:5], 1, heads=(0, 2))),
        }
    else:
        dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=60)
        before = dst.snapshot()
        res["refuse"] = {
            "heads": _err(lambda: kvcore.recv(dst.layout, DS, 0)),
            "dtype": _err(lambda: kvcore.recv(dst.layout, DS, 0)),
            "overlap": _err(lambda: kvcore.recv(dst.layout, DS[:-1] + [40], 0)),
            "sender_slots": _err(lambda: kvcore.recv(dst.layout, DS, 0)),
            "tokens": _err(lambda: kvcore.recv(dst.layout, DS, 0)),
            "untouched": all(torch.equal(a, b) for a, b in zip(dst.snapshot(), before)),
        }
    save()
    # 5. the sender dies after two chunks: the receiver names the unfinished chunk's slots
    if rank == 0:
        src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 10, 4, 2)
        real, works = distributed._isend, []

        def dying(tensor, peer, group, tag):
            if tensor.numel() != distributed.HEADER_BYTES and tensor.numel() != len(SS) and len(works) >= 4:
                works[-1].wait()  # chunk 1 (kvcore.send already waited for the others: a Gloo work is waited once)
                save()
                os._exit(0)
            w = real(tensor, peer, group, tag)
            works.append(w)
            return w

        distributed._isend = dying
        # a channel of its own (tag 5): its handshake agrees on two rows per chunk
        kvcore.send(src.layout, SS, 1, chunk_bytes=2 * 2 * 2 * 2 * HS * 4, tag=5)
        res["died"] = "the sender survived"
        save()
    else:
        dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 8, 8, 2, seed=40)
        before = dst.snapshot()
        res["died"] = _err(lambda: kvcore.recv(dst.layout, DS, 0, timeout=20, tag=5))
        # header, mask, chunks 0 and 1 (rows 0..3) arrived; rows 4.. must be untouched
        res["died_check"] = _verify(dst, before, None, SS, DS, heads=(0, 2), rows_landed=4)
    save()
    return res


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    from kvcore.testing.multiprocess import run_ranks

    d = tmp_path_factory.mktemp("p2p")
    results = run_ranks(f"{__file__}:_scenarios", 2, args=(str(d),), timeout=240, env={"KVCORE_NATIVE": "0"}, pg_timeout=60)
    for r in results:
        assert r.error is None, f"rank {r.rank} raised:\n{r.error}"
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]


def test_nhd_to_hnd_tp_split(outcome):
    send, recv = outcome
    assert send["split"] == [None, None]
    assert recv["split"] == [None, None, None, None]  # no error, then the semantic check passed, per TP rank


def test_tp_merge(outcome):
    send, recv = outcome
    assert send["merge"] == [None, None]
    assert recv["merge"] == [None, None, None]


def test_mla_and_cross_layer_to_packed(outcome):
    send, recv = outcome
    assert send["mla_cross"] == [None, None]
    assert recv["mla_cross"] == [None, None, None, None]


def test_mismatched_heads_raise_on_both_sides(outcome):
    send, recv = outcome
    assert "sends 4 KV head(s)" in recv["refuse"]["heads"] and "takes 2" in recv["refuse"]["heads"]
    assert "the receiver refused and wrote nothing" in send["refuse"]["heads"] and "heads=(start, stop)" in send["refuse"]["heads"]
    assert recv["refuse"]["untouched"]


def test_dtype_mismatch_names_both(outcome):
    send, recv = outcome
    for msg in (send["refuse"]["dtype"], recv["refuse"]["dtype"]):
        assert "sends float32" in msg and "holds int32" in msg


def test_overlapping_destination_slots(outcome):
    send, recv = outcome
    assert "destination slot 40 appears more than once" in recv["refuse"]["overlap"]
    assert "destination slot 40 appears more than once" in send["refuse"]["overlap"]


def test_sender_refusal_reaches_the_receiver(outcome):
    send, recv = outcome
    assert "slots[10] = 999 is out of range" in send["refuse"]["sender_slots"]
    assert "the sender refused and sent nothing" in recv["refuse"]["sender_slots"] and "999" in recv["refuse"]["sender_slots"]
    assert "sends 5 token rows but this side has 11 slots" in recv["refuse"]["tokens"]
    assert "sends 5 token rows" in send["refuse"]["tokens"]


def test_peer_dying_mid_transfer(outcome):
    send, recv = outcome
    assert "died" not in send  # the sender process ended inside kvcore.send
    msg = recv["died"]
    assert msg is not None and "chunk 2 of 6 (rows 4..5) did not arrive" in msg
    assert "Destination slots [12, 13] (that chunk) were not written" in msg and "rows 6..10" in msg
    assert "chunks 0..1 (rows 0..3) were landed" in msg
    assert recv["died_check"] is None


# -- in-process pieces of the protocol -----------------------------------------------------


def test_wire_bytes_are_the_planes_one_after_another():
    """A classic table's staging chunk [kv, NL, n, row] is byte for byte the per-plane wire
    form (each plane [NL, n, row], in order), so a classic sender and a multi-plane receiver
    (or the other way round) agree."""
    from kvcore.distributed import _wire
    from kvcore.kernels import TransferPlan
    from kvcore.kernels.reference import REFERENCE

    c = Cache("NL_X_TWO_NB_NH_BS_HS", 3, 4, 4, 4)
    table = c.layout.stride_table().select_heads(1, 3)
    slots = torch.tensor([3, 9, -1, 14])
    bufs = []
    for per_plane in (False, True):
        w = _wire(table, per_plane=per_plane)
        assert w.classic is not per_plane and w.token_bytes == 3 * 2 * 2 * HS * 4
        buf = torch.zeros(4 * w.token_bytes, dtype=torch.uint8)
        REFERENCE.gather(TransferPlan(table=w.table, slots=slots, staging=w.views(buf, 4), num_valid=3))
        bufs.append(buf)
    assert torch.equal(bufs[0], bufs[1]) and bool(bufs[0].any())


def test_chunk_sizes():
    from kvcore.distributed import _chunk_tokens

    tb = 64 << 10  # one TP half of a Llama-3-8B token
    assert _chunk_tokens(tb, 256, None, "cuda") == 256  # 16.8 MB: one chunk (at least 16 MiB)
    assert _chunk_tokens(tb, 8192, None, "cuda") == 4096  # 537 MB: two chunks of 256 MiB
    assert _chunk_tokens(2 * tb, 8192, None, "cuda") == 2048  # 1.07 GB: four chunks of 256 MiB
    assert _chunk_tokens(tb, 256, None, "cpu") == 64  # a quarter, at least 2 MiB
    assert _chunk_tokens(tb, 256, 1, "cuda") == 1  # explicit: exact, at least one token
    assert _chunk_tokens(tb, 3, 64 << 20, "cuda") == 3


class _FakeWork:
    _kvcore_poll = True

    def __init__(self, polls_left=0, error=None):
        self.polls_left, self.error, self.waited = polls_left, error, 0

    def is_completed(self):
        if self.polls_left is None:
            return False
        self.polls_left -= 1
        return self.polls_left < 0

    def wait(self, *a):
        self.waited += 1
        if self.error:
            raise RuntimeError(self.error)


def test_wait_polls_with_a_deadline():
    from kvcore.distributed import _PeerLost, _wait

    w = _FakeWork(polls_left=3)
    _wait(w, 5.0)
    assert w.waited == 1
    with pytest.raises(_PeerLost, match="nothing arrived within 0.05 s"):
        _wait(_FakeWork(polls_left=None), 0.05)
    with pytest.raises(_PeerLost, match="the connection failed .*NCCL communicator was aborted"):
        _wait(_FakeWork(error="NCCL communicator was aborted"), 1.0)


def test_send_and_recv_need_a_process_group():
    import kvcore

    c = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 2, 4, 2)
    with pytest.raises(kvcore.TransferError, match="torch.distributed is not initialised"):
        kvcore.send(c.layout, [0], 1)
    with pytest.raises(kvcore.TransferError, match="torch.distributed is not initialised"):
        kvcore.recv(c.layout, [0], 0)
