"""KvcoreConnector in a real vLLM (CPU) with a store too small for a prompt: what does not fit
is recomputed, what is evicted is recomputed, and the output never changes.

Capacity of 4 chunks of 32 tokens, token budget 128 (so a run that loads 4 chunks computes the
rest in the same steps as the undisturbed run: bit-exact logprobs). ``P`` (300 tokens) keeps
its first 4 chunks -- a logged "store full", the request keeps running -- and a later ``P``
loads them and computes the rest; another prompt evicts them (least recently used) and ``P``
then recomputes everything. Its own module: vLLM's KV connector is a process-wide singleton,
so one engine lives at a time, and a module's engines are closed when it ends.
"""

from __future__ import annotations

import logging

from .connector_harness import BLOCK, connector_llm, external_hits, garble, generate, sides, store_stats
from .harness import close, prompt

P_LEN = 300


def test_small_store_evicts_and_recomputes(tmp_path_factory, caplog):
    """Capacity of 4 chunks: P keeps its first 4 (store full, logged), a later P loads them and
    recomputes the rest; another prompt evicts them and P recomputes everything; the output
    never changes."""
    chunk_bytes = BLOCK * 2 * 2 * 2 * 64 * 2  # tiny Llama: 2 layers, K and V, 2 KV heads of 64, bf16
    llm = connector_llm(tmp_path_factory, "llama", "bfloat16", "auto", capacity=4 * chunk_bytes, budget=4 * BLOCK)
    try:
        sched, worker = sides(llm)
        assert sched.store_plan.num_slots == 4
        p, x = prompt(P_LEN, seed=1), prompt(P_LEN, seed=9)
        caplog.set_level(logging.INFO, logger="kvcore_vllm.connector")
        want = generate(llm, p)
        s = store_stats(llm)
        assert s["chunks"] == 4 and s["store_full"] >= 1
        assert any("store full" in r.getMessage() for r in caplog.records), "a full store was not logged"
        hits = external_hits(llm)
        garble(llm, 1)
        assert generate(llm, p) == want  # 128 tokens loaded, 172 computed, in the same steps as the first run
        assert external_hits(llm) - hits == 4 * BLOCK
        generate(llm, x)  # evicts P's chunks: the least recently used
        assert store_stats(llm)["evicted_chunks"] >= 4
        hits = external_hits(llm)
        garble(llm, 2)
        assert generate(llm, p) == want
        assert external_hits(llm) == hits  # nothing of P left: recomputed
    finally:
        close(llm)
