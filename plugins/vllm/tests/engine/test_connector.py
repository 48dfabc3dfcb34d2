"""KvcoreConnector in a real vLLM (CPU): every request served from the store continues exactly
as if it had computed its whole prompt.

Each case runs vLLM in-process on a tiny model (:mod:`.harness`) with the connector loaded the
way a user loads it (``kv_transfer_config`` with ``kv_connector_module_path``), prefix caching
off, and:

1. runs a prompt ``P`` of 300 tokens (9 chunks of 32 and a partial chunk of 12): the
   undisturbed run, which the connector stores;
2. overwrites every block of every engine cache with finite garbage, and runs ``P`` again:
   vLLM's connector stats count 300 external tokens, the connector loaded them, and the greedy
   tokens *and* their logprobs equal the first run's bit for bit;
3. garbage again, then ``R = P[:299] + Q``: the store serves 299 tokens -- 9 whole chunks and
   11 of the 12 tokens of ``P``'s partial chunk -- and ``R`` equals ``R`` computed without the
   store (``skip_reading_prefix_cache``); ``R`` stored only its own last chunk and shared the
   9 chunks of ``P``;
4. a negative control: one stored token row of ``P`` changed, ``P`` served from the store
   differs from the undisturbed run (the comparison can see one wrong row); for CPU_ATTN, a
   load through the reading of the Python view the kernel does not use differs too;
5. a store slot made to forget the chunk it holds: the worker refuses the load (writing
   nothing), vLLM is told, and ``P`` recomputes, with the same output; the scheduler forgets
   the chunk, so the retry is not served from it again.

Bit-exact logprobs need the same arithmetic on both sides: the token budget is ``len(P) - 1``
so the undisturbed run computes ``P``'s last token alone, as vLLM does after a full hit (it
recomputes the last token to sample from it), and ``R``'s reference computes its first 299
tokens in one step, as ``P`` did when the stored KV was made.

Two requests that share a 256-token prefix, submitted together, store that prefix once: the
second is served the first's 8 chunks within the batch and stores only its own 44 tokens, and
later served from them equals its computed run bit for bit. The same tokens under another
``cache_salt`` (one of vLLM's extra keys) are not served from those bytes: they miss, recompute
and are stored under their own keys.

A hybrid model (GraniteMoeHybrid: Mamba2 + attention) is served nothing: its Mamba state at a
token cannot be rebuilt from per-token KV, so the connector refuses (and says so) and every
request recomputes, with the same output.
"""

from __future__ import annotations

import pytest

from .connector_harness import (
    BLOCK,
    connector_llm,
    corrupt_row,
    external_hits,
    garble,
    generate,
    generate_batch,
    sides,
    store_stats,
    wrong_layout,
)
from .harness import VERSION, close, prompt

MLA_RUNS = VERSION >= (0, 32)
P_LEN = 300

# (family, model dtype, kv cache dtype)
CASES = [
    ("llama", "bfloat16", "auto"),
    ("llama", "bfloat16", "fp8_e4m3"),
    ("qwen3", "bfloat16", "auto"),
    ("qwen2", "float16", "auto"),
    ("gemma2", "bfloat16", "auto"),
    ("granitehybrid", "bfloat16", "auto"),
]
if MLA_RUNS:
    CASES.append(("deepseek_v2", "bfloat16", "auto"))


def _id(c) -> str:
    return "-".join(c)


@pytest.fixture(scope="module", params=CASES, ids=_id)
def engine(request, tmp_path_factory):
    llm = connector_llm(tmp_path_factory, *request.param, capacity=64 << 20, budget=P_LEN - 1)
    yield llm, request.param
    close(llm)


# -- the tests ----------------------------------------------------------------------------


def test_every_request_restored_exactly(engine):
    llm, (fam, dt, kvd) = engine
    sched, worker = sides(llm)
    p = prompt(P_LEN, seed=1)
    q = prompt(10, seed=2)
    if q[0] == p[P_LEN - 1]:
        q[0] = (q[0] + 1) % 500 + 3
    r = p[: P_LEN - 1] + q

    want_p = generate(llm, p)  # undisturbed: nothing stored yet
    hybrid = fam == "granitehybrid"
    if hybrid:
        assert "recurrent state" in sched.store_plan.disabled
        assert worker.worker_side.arena is None
    else:
        s = store_stats(llm)
        assert (s["stored_chunks"], s["stored_tokens"]) == (10, P_LEN)  # 9 whole chunks and the partial 12

    hits0, loaded0 = external_hits(llm), worker.worker_side.totals.loaded_tokens
    garble(llm, 1)
    got_p = generate(llm, p)
    assert got_p == want_p, "P served from the store differs from the undisturbed run"
    if hybrid:
        assert external_hits(llm) == hits0 and worker.worker_side.totals.loaded_tokens == 0
        return
    assert external_hits(llm) - hits0 == P_LEN  # vLLM counted every token as served (it recomputes the last)
    assert worker.worker_side.totals.loaded_tokens - loaded0 == P_LEN

    before = store_stats(llm)
    garble(llm, 2)
    got_r = generate(llm, r)
    assert external_hits(llm) - hits0 == P_LEN + P_LEN - 1  # 9 chunks and 11 tokens of P's partial chunk
    after = store_stats(llm)
    assert after["stored_chunks"] - before["stored_chunks"] == 1  # R's own last chunk [288, 309)
    assert after["shared_chunks"] - before["shared_chunks"] >= 9  # P's 9 whole chunks, stored once
    assert after["used_slots"] == 11
    garble(llm, 3)
    assert got_r == generate(llm, r, skip_store=True), "R served from P's chunks differs from R computed"

    # negative controls: the comparison sees one wrong stored row, and a wrong reading
    if fam == "llama" and kvd == "auto" and dt == "bfloat16":
        g0 = worker.worker_side.arena.groups[0]
        right = g0.layout
        g0.layout = wrong_layout(llm)
        try:
            garble(llm, 4)
            assert generate(llm, p) != want_p, "a load through the wrong layout did not change the output"
        finally:
            g0.layout = right
    corrupt_row(llm, p, P_LEN - 5)
    garble(llm, 5)
    assert generate(llm, p) != want_p, "one changed stored row did not change the output: the test could not see a bad load"

    # last: a store slot that no longer holds the chunk the scheduler planned: the worker refuses the
    # load (nothing written), vLLM is told (0.32: a failed receive; 0.28: the request's blocks),
    # and with kv_load_failure_policy "recompute" the request recomputes, with the same output
    if VERSION >= (0, 32) or len(sched.store_plan.groups) == 1:
        arena = worker.worker_side.arena
        slot = next(e.slot for e in sched.scheduler_side.index._by_key.values() if e.tokens == tuple(p[:BLOCK]))  # noqa: SLF001
        arena.forget(slot)
        failed = worker.worker_side.totals.failed_loads
        garble(llm, 6)
        assert generate(llm, p) == want_p, "a refused load did not fall back to recomputing the request"
        assert worker.worker_side.totals.failed_loads == failed + 1
        assert store_stats(llm)["unusable_chunks"] == 1  # the scheduler forgot the chunk: no second failed load


def test_requests_sharing_a_prefix_share_stored_chunks(engine):
    llm, (fam, dt, kvd) = engine
    sched, worker = sides(llm)
    if sched.store_plan.disabled:
        pytest.skip("a Mamba hybrid stores nothing (test_every_request_restored_exactly proves it recomputes)")
    shared = 8 * BLOCK
    s = prompt(shared, seed=11)
    a, b = s + prompt(P_LEN - shared, seed=12), s + prompt(P_LEN - shared, seed=13)
    if a[shared] == b[shared]:
        b[shared] = (b[shared] + 1) % 500 + 3

    # one batch: A's prefill fills the first step and stores its chunks; B, scheduled after it,
    # is served the 8 shared chunks from A's bytes and stores only what follows them
    before, hits = store_stats(llm), external_hits(llm)
    generate_batch(llm, [a, b])
    after = store_stats(llm)
    assert external_hits(llm) - hits == shared
    # A: 9 whole chunks and its partial 12 tokens; B: [256, 288) and its partial [288, 300)
    assert after["stored_chunks"] - before["stored_chunks"] == 12
    assert after["stored_tokens"] - before["stored_tokens"] == 2 * P_LEN - shared
    assert after["shared_chunks"] - before["shared_chunks"] == 8
    assert after["used_slots"] - before["used_slots"] == 12
    index = sched.scheduler_side.index._by_key.values()  # noqa: SLF001
    for k in range(shared // BLOCK):
        chunk = tuple(s[k * BLOCK : (k + 1) * BLOCK])
        assert len([e for e in index if e.tokens == chunk]) == 1, f"chunk {k} of the shared prefix is stored twice"

    # B served from A's 8 chunks and its own 44 tokens equals B computed alone without the store
    # (not the batched run: a batch of another shape rounds differently in bf16, store or not)
    hits = external_hits(llm)
    garble(llm, 7)
    got_b = generate(llm, b)
    assert external_hits(llm) - hits == P_LEN
    garble(llm, 8)
    ref_b = generate(llm, b, skip_store=True)
    if sched.store_plan.kv_groups[0].kind == "mla":
        # B's own 44 tokens were computed in the batch after a 256-token context, which vLLM's MLA
        # attends through another path than a fresh prefill (``_compute_prefill_context`` and
        # ``merge_attn_states``, vllm 0.32 ``model_executor/layers/attention/mla_attention.py``):
        # their stored latents differ from a fresh run's in the last bits. MLA served from stored
        # chunks computed like its reference is bit-exact (test_every_request_restored_exactly).
        assert got_b[0][:1] == ref_b[0][:1]
        return
    assert got_b == ref_b, "B served from A's chunks differs from B computed"

    if fam == "llama" and kvd == "auto" and dt == "bfloat16":
        # another cache_salt: vLLM keys the first block by it, so none of B's stored bytes are its own
        before, hits = store_stats(llm), external_hits(llm)
        garble(llm, 9)
        assert generate(llm, b, salt="tenant-2") == ref_b  # a miss: recomputed
        assert external_hits(llm) == hits
        assert store_stats(llm)["stored_chunks"] - before["stored_chunks"] == 10  # stored under its own keys
        garble(llm, 10)
        assert generate(llm, b, salt="tenant-2") == ref_b  # now served from its own chunks
        assert external_hits(llm) - hits == P_LEN
