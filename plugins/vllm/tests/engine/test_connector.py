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

A hybrid model (GraniteMoeHybrid: Mamba2 + attention) is served nothing: its Mamba state at a
token cannot be rebuilt from per-token KV, so the connector refuses (and says so) and every
request recomputes, with the same output.
"""

from __future__ import annotations

import pytest

from .connector_harness import BLOCK, connector_llm, corrupt_row, external_hits, garble, generate, sides, store_stats, wrong_layout
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
