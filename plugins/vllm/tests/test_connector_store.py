"""The KvcoreConnector's parts that need no engine: configuration, keys, the store's index, the
scheduler's planning (vLLM's objects stood in by plain ones with the same attributes) and the
worker's data path over caches allocated as vLLM 0.32's CPU_ATTN allocates them.

The connector in a real vLLM: ``tests/engine/test_connector.py`` (run inside the engine venv).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvcore_vllm.connector.config import ConnectorConfig, ConnectorConfigError, GroupPlan, StorePlan, plan_store
from kvcore_vllm.connector.index import StoreIndex
from kvcore_vllm.connector.keys import ROOT, RequestKeys, chunk_key
from kvcore_vllm.connector.plan import ChunkOp, Transfer, WorkerReport, engine_slots
from kvcore_vllm.connector.scheduler import SchedulerSide
from kvcore_vllm.connector.worker import WorkerSide
from kvcore_vllm.fixtures import allocate

import kvcore

C = 4  # chunk size of the planning tests
REPO = Path(__file__).resolve().parents[3]


def _spec(kind: str, **kw):
    """A stand-in for vLLM's KVCacheSpec classes: the connector reads their class name and
    block_size / page sizes."""
    return type(kind, (), {})() if not kw else type(kind, (), kw)()


def _kv_cache_config(*groups):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=names) for s, names in groups])


def _attn(bs=C, page=None):
    return _spec("FullAttentionSpec", block_size=bs, real_page_size_bytes=page or bs * 512, page_size_bytes=page or bs * 512)


# -- configuration ------------------------------------------------------------------------


def test_config_defaults_and_refusals():
    cfg = ConnectorConfig.parse(None)
    assert (cfg.capacity_bytes, cfg.chunk_size, cfg.token_granular, cfg.save_decode) == (4 << 30, None, True, True)
    with pytest.raises(ConnectorConfigError, match="capacity_gb"):
        ConnectorConfig.parse({"capacity_gb": 4})
    for bad in ({"capacity_bytes": -1}, {"capacity_bytes": "4GB"}, {"chunk_size": 0}, {"token_granular": "yes"}):
        with pytest.raises(ConnectorConfigError, match=next(iter(bad))):
            ConnectorConfig.parse(bad)
    assert isinstance(ConnectorConfigError("x"), kvcore.KVCoreError)


def test_plan_store_counts_slots_from_the_specs():
    kvc = _kv_cache_config(
        (_attn(16, 16 * 1024), ["a.0", "a.1"]), (_spec("SlidingWindowSpec", block_size=16, page_size_bytes=16 * 1024), ["s.0"])
    )
    plan = plan_store(ConnectorConfig.parse({"capacity_bytes": 10 * 16 * 3072}), kvc, block_size=16)
    assert plan.bytes_per_token == 3 * 1024  # three layers of 1024 bytes per token
    assert (plan.chunk_size, plan.num_slots, plan.disabled) == (16, 10, "")
    assert [g.kind for g in plan.kv_groups] == ["attention", "attention"]
    with pytest.raises(ConnectorConfigError, match="holds no chunk"):
        plan_store(ConnectorConfig.parse({"capacity_bytes": 1000}), kvc, block_size=16)


def test_plan_store_refuses_recurrent_state():
    kvc = _kv_cache_config((_spec("MambaSpec", block_size=1024, page_size_bytes=4096), ["m.0"]), (_attn(), ["a.1"]))
    plan = plan_store(ConnectorConfig.parse({}), kvc, block_size=C)
    assert plan.num_slots == 0 and "recurrent state" in plan.disabled and "MambaSpec" in plan.disabled
    side = SchedulerSide(ConnectorConfig.parse({}), plan)
    assert side.get_num_new_matched_tokens(_request("r", list(range(40))), 0) == (0, False)


# -- keys ---------------------------------------------------------------------------------


def test_keys_chain_like_vllm_block_hashes():
    a, b = RequestKeys(C), RequestKeys(C)
    ta = list(range(10, 22))
    tb = [99] + ta[1:]
    a.update(ta)
    b.update(tb)
    assert len(a) == 3
    assert a.full(0) == chunk_key(ROOT, ta[:4]) and a.full(1) == chunk_key(a.full(0), ta[4:8])
    assert all(a.full(k) != b.full(k) for k in range(3))  # one earlier token changes every later key
    salted = RequestKeys(C, extra_of=lambda s, e: ("lora", "adapter-1"))
    salted.update(ta)
    assert salted.full(2) != a.full(2)
    assert a.partial(3, [1, 2]) != a.partial(3, [1, 2, 3]) != chunk_key(a.full(2), [1, 2, 3, 4])


# -- index --------------------------------------------------------------------------------


def _store(index: StoreIndex, tokens: list[int], upto: int | None = None) -> list:
    keys = RequestKeys(index.chunk_size)
    keys.update(tokens)
    out = []
    n = len(tokens) if upto is None else upto
    for k in range(n // index.chunk_size):
        e = index.reserve(keys.full(k), keys.parent(k), tokens[k * C : (k + 1) * C], None)
        index.confirm(e.key, e.slot)
        out.append(e)
    tail = tokens[(n // C) * C : n]
    if tail:
        e = index.reserve(keys.partial(n // C, tail), keys.parent(n // C), tail, None)
        index.confirm(e.key, e.slot)
        out.append(e)
    return out


def test_match_serves_whole_chunks_then_a_prefix_of_a_stored_chunk():
    idx = StoreIndex(16, C)
    p = list(range(100, 110))  # chunks [0,4) [4,8) and a partial [8,10)
    _store(idx, p)
    keys = RequestKeys(C)
    assert idx.match(keys, p, len(p)).num_tokens == 10
    r = p[:9] + [7, 7, 7]
    m = idx.match(RequestKeys(C), r, len(r))
    assert m.counts == (4, 4, 1)  # one token of the stored partial chunk [8, 10)
    assert idx.match(RequestKeys(C), r, len(r), partial=False).num_tokens == 8
    assert idx.match(RequestKeys(C), [5] + p[1:], 10).num_tokens == 0
    limited = idx.match(RequestKeys(C), p, 6)
    assert limited.counts == (4, 2)  # a prefix of a whole chunk serves a shorter limit


def test_only_ready_chunks_are_served_and_failed_saves_are_forgotten():
    idx = StoreIndex(4, C)
    p = list(range(8))
    keys = RequestKeys(C)
    keys.update(p)
    e0 = idx.reserve(keys.full(0), ROOT, p[:4], None)
    assert idx.match(RequestKeys(C), p, 8).num_tokens == 0  # saved by no worker yet
    idx.confirm(e0.key, e0.slot + 1)  # a report for another slot confirms nothing
    assert idx.match(RequestKeys(C), p, 8).num_tokens == 0
    idx.confirm(e0.key, e0.slot)
    assert idx.match(RequestKeys(C), p, 8).num_tokens == 4
    e1 = idx.reserve(keys.full(1), keys.full(0), p[4:], None)
    idx.drop(e1.key, e1.slot)
    assert e1.key not in idx and idx.used_slots == 1 and idx.stats.failed_saves == 1


def test_lru_evicts_leaves_first_and_never_pinned_chunks():
    idx = StoreIndex(4, C)
    p = list(range(12))
    chain = _store(idx, p)  # 3 chunks
    idx.touch(chain)
    q = list(range(50, 54))
    (qe,) = _store(idx, q)  # the 4th slot
    keys = RequestKeys(C)
    keys.update(list(range(80, 84)))
    idx.pin([qe])
    got = idx.reserve(keys.full(0), ROOT, list(range(80, 84)), None)
    assert got is not None and chain[2].key not in idx and chain[0].key in idx  # P's leaf went, its root stayed
    assert idx.match(RequestKeys(C), p, 12).num_tokens == 8
    idx.pin(idx._lru.values())  # noqa: SLF001 - every chunk pinned
    assert idx.reserve(b"x" * 32, ROOT, [1], None) is None and idx.stats.store_full == 1


# -- scheduler planning -------------------------------------------------------------------


def _request(rid: str, tokens: list[int], prompt: int | None = None):
    return SimpleNamespace(
        request_id=rid, all_token_ids=list(tokens), num_tokens=len(tokens), num_prompt_tokens=prompt or len(tokens), prompt_embeds=None
    )


def _output(new=(), cached=(), finished=()):
    """A SchedulerOutput stand-in: ``new`` = [(req_id, block_ids, computed, scheduled)],
    ``cached`` = [(req_id, new_block_ids or None, computed, scheduled)]."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=c) for r, b, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached],
            resumed_req_ids=set(),
            new_block_ids=[b for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
        ),
        num_scheduled_tokens={r: n for r, _, _, n in list(new) + list(cached)},
        finished_req_ids=set(finished),
    )


def _side(slots=64, groups=((0, C),), **cfg) -> SchedulerSide:
    plan = StorePlan(tuple(GroupPlan(i, "attention", bs, 2, 512) for i, bs in groups), C, slots, 512 * len(groups))
    return SchedulerSide(ConnectorConfig.parse(cfg), plan)


def _confirm(side: SchedulerSide, plan) -> None:
    side.on_report(WorkerReport(saved={(op.slot, op.key) for op in plan.saves.ops}), None)


def test_a_prompt_is_stored_by_chunk_and_its_partial_tail_and_served_to_the_next():
    side = _side()
    p = list(range(200, 210))  # 2 whole chunks + 2 tokens
    a = _request("a", p)
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    side.update_state_after_alloc(a, None, 0)
    step = side.build_plan(_output(new=[("a", ([7, 3, 9],), 0, 10)]))
    assert [(op.count, op.first) for op in step.saves.ops] == [(4, 0), (4, 0), (2, 0)]
    assert step.saves.engine_slots[0].tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37]
    _confirm(side, step)
    side.forget("a")

    b = _request("b", p[:9] + [1, 2, 3], prompt=12)
    n, is_async = side.get_num_new_matched_tokens(b, 0)
    assert (n, is_async) == (9, True)
    side.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([5, 6, 8],)), 9)
    step = side.build_plan(_output(new=[("b", ([5, 6, 8],), 9, 3)]))
    (load,) = step.loads
    assert [(op.first, op.count) for op in load.ops] == [(0, 4), (0, 4), (0, 1)]
    assert load.engine_slots[0].tolist() == [20, 21, 22, 23, 24, 25, 26, 27, 32]
    # b shared a's two whole chunks and stores only its own tail [8, 12)
    assert [(op.count) for op in step.saves.ops] == [4]
    assert side.index.stats.shared_chunks == 2
    # its load pinned what it reads until the worker reports the load done
    assert all(e.pins == 1 for e in side._inflight["b"])  # noqa: SLF001
    side.on_report(None, {"b"})
    assert all(e.pins == 0 for e in side.index._by_key.values() if e.ready)  # noqa: SLF001


def test_a_request_that_asks_for_no_cached_prefix_gets_none():
    side = _side()
    p = list(range(8))
    side.get_num_new_matched_tokens(_request("a", p), 0)
    _confirm(side, side.build_plan(_output(new=[("a", ([1, 2],), 0, 8)])))
    b = _request("b", p)
    assert side.get_num_new_matched_tokens(b, 0) == (8, True)
    b.skip_reading_prefix_cache = True  # SamplingParams(skip_reading_prefix_cache=True); vLLM 0.28 leaves it to the connector
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)


def test_a_failed_load_is_not_retried_from_the_store():
    """A worker that found a slot no longer holding its chunk reports it: the chunk is
    forgotten and the request, which vLLM retries, is not served again (no loop of loads)."""
    side = _side()
    p = list(range(8))
    side.get_num_new_matched_tokens(_request("a", p), 0)
    _confirm(side, side.build_plan(_output(new=[("a", ([1, 2],), 0, 8)])))
    b = _request("b", p)
    assert side.get_num_new_matched_tokens(b, 0) == (8, True)
    side.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([3, 4],)), 8)
    (load,) = side.build_plan(_output()).loads
    bad = (load.ops[1].slot, load.ops[1].key)
    side.on_report(WorkerReport(unusable={bad}, failed_loads={"b"}), {"b"})
    assert bad[1] not in side.index and side.index.stats.unusable_chunks == 1
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)
    assert side.get_num_new_matched_tokens(_request("c", p), 0) == (4, True)  # the chunk still held serves others


def test_a_load_vllm_did_not_plan_is_refused_not_guessed():
    side = _side()
    p = list(range(8))
    side.get_num_new_matched_tokens(_request("a", p), 0)
    _confirm(side, side.build_plan(_output(new=[("a", ([1, 2],), 0, 8)])))
    b = _request("b", p)
    assert side.get_num_new_matched_tokens(b, 0) == (8, True)
    side.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([3, 4],)), 12)  # more than matched
    (load,) = side.build_plan(_output()).loads
    assert "matched 8" in load.refused and not load.ops


def test_sliding_window_tokens_vllm_released_are_not_stored():
    side = _side(groups=((0, C), (1, C)))
    p = list(range(12))
    side.get_num_new_matched_tokens(_request("a", p), 0)
    # group 1 (sliding window) already gave block 0 back: vLLM's null block
    step = side.build_plan(_output(new=[("a", ([1, 2, 3], [0, 5, 6]), 0, 12)]))
    assert step.saves.ops == [] and "no longer all held" in side._reqs["a"].stop  # noqa: SLF001


def test_a_chunk_partly_outside_a_sliding_window_is_not_stored():
    """Without vLLM's own block table (0.28 gives the scheduler output's only), a chunk whose
    first token a sliding window may already have released is not read."""
    plan = StorePlan((GroupPlan(0, "attention", C, 2, 512), GroupPlan(1, "attention", C, 2, 512, sliding_window=2)), C, 64, 1024)
    side = SchedulerSide(ConnectorConfig.parse({}), plan)
    p = list(range(8))
    side.get_num_new_matched_tokens(_request("a", p, prompt=3), 0)
    step = side.build_plan(_output(new=[("a", ([1, 2], [3, 4]), 0, 3)]))  # prefill of 3: its partial chunk, all held
    assert [op.count for op in step.saves.ops] == [3]
    step = side.build_plan(_output(cached=[("a", None, 3, 1)]))  # token 3 completes chunk [0, 4); token 0 left the window
    assert step.saves.ops == [] and "window" in side._reqs["a"].stop  # noqa: SLF001
    wide = StorePlan((GroupPlan(0, "attention", C, 2, 512, sliding_window=4),), C, 64, 512)
    side = SchedulerSide(ConnectorConfig.parse({}), wide)
    side.get_num_new_matched_tokens(_request("a", p, prompt=3), 0)
    side.build_plan(_output(new=[("a", ([1, 2],), 0, 3)]))
    assert [op.count for op in side.build_plan(_output(cached=[("a", None, 3, 1)])).saves.ops] == [4]


def test_engine_slots():
    assert engine_slots([4, 0, 2], 4, 2, 10).tolist() == [18, 19, -1, -1, -1, -1, 8, 9]
    with pytest.raises(IndexError, match="does not reach token 12"):
        engine_slots([4, 1, 2], 4, 0, 13)


# -- the worker's data path ---------------------------------------------------------------


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_worker_moves_rows_between_caches_exactly(isa):
    """Save rows of one vLLM CPU_ATTN cache into the store, load them into another cache at
    other slots: kvcore reads there exactly the rows it read at the source."""
    geo = dict(num_layers=2, num_blocks=6, block_size=32, num_kv_heads=2, head_size=32, cpu_attn_isa=isa)
    hints = {"vllm_version": "0.32.0", "attention_backend": "CPU_ATTN", "cpu_attn_isa": isa, "device_type": "cpu", "block_size": 32}
    src = allocate("0.32.0", "CPU_ATTN", "LBHNC", **geo)
    dst = allocate("0.32.0", "CPU_ATTN", "LBHNC", **geo)
    g = torch.Generator().manual_seed(0)
    for t in list(src.values()) + list(dst.values()):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    ls, ld = (kvcore.detect(list(c.values()), engine="vllm", hints=hints) for c in (src, dst))
    bpt = 2 * 2 * 2 * 32 * 2
    plan = StorePlan((GroupPlan(0, "attention", 32, 2, bpt),), 32, 4, bpt)
    w = WorkerSide(plan)
    w.register([ls])
    sslots = engine_slots([3, 1], 32, 0, 37)  # 37 tokens: a whole chunk and 5 of the next
    k0, k1 = b"k0" * 16, b"k1" * 16
    rep = w.save(Transfer([ChunkOp(2, k0, 0, 32), ChunkOp(3, k1, 0, 5)], [sslots]))
    assert rep.saved == {(2, k0), (3, k1)} and not rep.failed
    want = kvcore.gather(ls, sslots)

    w.arena.groups[0].layout = ld  # the same store, loaded into the other cache (as another request's blocks)
    dslots = engine_slots([5, 2], 32, 0, 37)
    before = kvcore.gather(ld, dslots[36:])
    assert w.load(Transfer([ChunkOp(2, k0, 0, 32), ChunkOp(3, k1, 0, 4)], [dslots[:36]], req_id="r")) == ""
    assert torch.equal(kvcore.gather(ld, dslots[:36]), want[:, :, :36])
    assert torch.equal(kvcore.gather(ld, dslots[36:]), before)  # the 37th row was not asked for: untouched

    # a slot that no longer holds the planned chunk, or an op outside the store: refused, nothing written
    snapshot = [t.clone() for t in dst.values()]
    assert "no longer holds" in w.load(Transfer([ChunkOp(2, b"zz" * 16, 0, 4)], [dslots[:4]], req_id="r"))
    assert "no longer holds" in w.load(Transfer([ChunkOp(3, k1, 0, 6)], [dslots[:6]], req_id="r"))  # more than was stored
    assert "outside the store" in w.load(Transfer([ChunkOp(9, k0, 0, 4)], [dslots[:4]], req_id="r"))
    assert "do not match" in w.load(Transfer([ChunkOp(2, k0, 0, 4)], [dslots[:3]], req_id="r"))
    assert all(torch.equal(t, s) for t, s in zip(dst.values(), snapshot))
    assert w.totals.failed_loads == 4 and w.totals.loaded_tokens == 36


def test_the_benchmark_runs_and_checks_its_own_loads(tmp_path):
    """scripts/bench_connector.py at a tiny size: it first checks that a load gives back the
    saved rows, then times both paths (docs/benchmarks.md has the full-size numbers)."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_connector.py"), "--layers", "2", "--heads", "2", "--head-size", "32"]
    cmd += ["--block-size", "32", "--tokens", "40,64", "--repeats", "1", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["isa"], r["tokens"], r["direction"], r["path"]) for r in rows} >= {
        ("vec", 40, "load", "connector"),
        ("amx", 64, "save", "torch blocks"),
    }
    assert all(r["gbps"] > 0 and (r["path"] != "connector" or r["vs_torch"] > 0) for r in rows)
