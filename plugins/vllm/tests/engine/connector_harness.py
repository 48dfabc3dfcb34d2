"""What the connector tests share: an engine with KvcoreConnector loaded as a user loads it,
generation with logprobs, garbage over every engine block, and vLLM's and the store's counters."""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer import get_kv_transfer_group

import kvcore

from .harness import SamplingParams, make_llm, runner_of, scheduler_of, tiny_model

BLOCK = 32


def kv_transfer_config(capacity_bytes: int) -> dict:
    return {
        "kv_connector": "KvcoreConnector",
        "kv_connector_module_path": "kvcore_vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"capacity_bytes": capacity_bytes},
        "kv_load_failure_policy": "recompute",
    }


def connector_llm(tmp_path_factory, fam: str, dt: str, kvd: str, *, capacity: int, budget: int):
    path = tiny_model(tmp_path_factory.mktemp("models"), fam, dt)
    return make_llm(
        path,
        dtype=dt,
        block_size=BLOCK,
        kv_cache_dtype=kvd,
        max_num_batched_tokens=budget,
        kv_transfer_config=kv_transfer_config(capacity),
        disable_log_stats=False,
    )


def generate(llm, tokens: list[int], *, skip_store: bool = False, salt: str | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs; ``skip_store``: vLLM's per-request switch that keeps
    the connector (and the prefix cache) from serving the request; ``salt``: the prompt's
    ``cache_salt`` (one of vLLM's extra keys of a block)."""
    return generate_batch(llm, [tokens], skip_store=skip_store, salt=salt)[0]


def generate_batch(
    llm, prompts: list[list[int]], *, skip_store: bool = False, salt: str | None = None
) -> list[tuple[list[int], list[float]]]:
    """:func:`generate` for several prompts submitted together (vLLM batches them, in order)."""
    params = SamplingParams(
        max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=0, skip_reading_prefix_cache=skip_store
    )
    inputs = [{"prompt_token_ids": t} | ({"cache_salt": salt} if salt is not None else {}) for t in prompts]
    got = []
    for r in llm.generate(inputs, params, use_tqdm=False):
        out = r.outputs[0]
        got.append((list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]))
    return got


def garble(llm, seed: int) -> None:
    """Every block of every engine cache (KV and Mamba state) overwritten with finite garbage:
    stale bytes of an earlier run cannot rescue a load that missed a row."""
    g = torch.Generator().manual_seed(seed)
    seen: set[tuple[int, int]] = set()
    caches = runner_of(llm).kv_caches
    for t in caches.values() if isinstance(caches, dict) else caches:
        for x in t if isinstance(t, (list, tuple)) else [t]:
            if x.numel() == 0 or (x.data_ptr(), x.numel()) in seen:
                continue
            seen.add((x.data_ptr(), x.numel()))
            junk = torch.randn(x.shape, generator=g) * 4
            x.copy_(junk.to(torch.float8_e4m3fn).view(torch.uint8) if x.dtype == torch.uint8 else junk.to(x.dtype))


def external_hits(llm) -> int:
    """vLLM's own count of tokens a KV connector served (``vllm:external_prefix_cache_hits``)."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits"))


def sides(llm):
    """(the scheduler's connector, this process's worker connector)."""
    return scheduler_of(llm).connector, get_kv_transfer_group()


def store_stats(llm) -> dict[str, int]:
    return sides(llm)[0].get_kv_connector_stats_scheduler()


def corrupt_row(llm, tokens: list[int], token: int) -> None:
    """Change one stored token row (every KV group, layer, K and V) of the chunk of ``tokens``
    holding ``token``: found by the scheduler's index, changed in the worker's store."""
    sched, worker = sides(llm)
    k = token // BLOCK
    chunk = tuple(tokens[k * BLOCK : min(len(tokens), (k + 1) * BLOCK)])
    (slot,) = [e.slot for e in sched.scheduler_side.index._by_key.values() if e.tokens == chunk]  # noqa: SLF001
    row = slot * BLOCK + token % BLOCK
    for ga in worker.worker_side.arena.groups:
        for buf in ga.buffers.values():
            r = buf.narrow(-2, row, 1)
            f = r.view(torch.float8_e4m3fn) if r.dtype == torch.uint8 else r  # fp8 may be staged as bytes
            f.copy_((f.float() + 1.5).to(f.dtype))


def wrong_layout(llm):
    """The reading vLLM's Python view suggests and its CPU kernel does not use (per block and
    head, K then V rows of ``[BS, HS]``), over the same caches: a load through it must change
    the output."""
    runner = runner_of(llm)
    tensors = []
    for name in runner.kv_cache_config.kv_cache_groups[0].layer_names:
        kv = runner.compilation_config.static_forward_context[name].kv_cache
        tensors.append(kv[0] if isinstance(kv, (list, tuple)) else kv)
    return kvcore.build_layout("NL_X_NB_NH_TWO_BS_HS", [t.view(t.shape[0], t.shape[1], 2, BLOCK, -1) for t in tensors])
