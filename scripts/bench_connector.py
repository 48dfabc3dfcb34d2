#!/usr/bin/env python3
"""Speed of KvcoreConnector's data path on the CPU: save and load through the connector's
worker (``kvcore_vllm.connector.worker.WorkerSide``: slot checks, runs, ``kvcore.gather`` /
``kvcore.scatter`` straight between vLLM's cache and the store) against per-layer torch
indexing of whole blocks between the same cache and the same store memory, in the same run.

The cache is allocated as vLLM 0.32's CPU_ATTN allocates it (``kvcore_vllm.fixtures.allocate``,
``LBHNC``; ``--isa vec``: K column-major, ``--isa amx``: AMX tiles) and its layout detected by
kvcore with vLLM's own facts as hints. Requests take shuffled blocks (a served engine's blocks
are never contiguous). The store is allocated once and reused (its pages touched by a warm-up
round), as the connector keeps it.

Per case (tokens T, direction): median seconds over ``--repeats``, tokens per second, GB/s
(``T * bytes per token`` / seconds: the bytes a request's KV takes, K and V of every layer) and
the ratio to the torch baseline's GB/s. The baseline is what an offloader without a layout
engine does: per layer, ``index_select`` / ``index_copy_`` of whole blocks (memcpy-class, and
correct only in whole blocks: it cannot serve a partial last block).

Usage::

    python scripts/bench_connector.py                      # Llama-3-8B geometry, both ISAs
    python scripts/bench_connector.py --tokens 256,4096 --isa vec --repeats 7 --json out.json
    python scripts/bench_connector.py --threads 2 --clock cpu   # both cores; CPU seconds on a loaded host
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from kvcore_vllm.connector.config import GroupPlan, StorePlan
from kvcore_vllm.connector.plan import ChunkOp, Transfer, engine_slots
from kvcore_vllm.connector.worker import WorkerSide
from kvcore_vllm.fixtures import allocate

import kvcore


def _case(isa: str, tokens: int, a: argparse.Namespace) -> list[dict]:
    bs, nl, nh, hs = a.block_size, a.layers, a.heads, a.head_size
    dtype = getattr(torch, a.dtype)
    nblk = -(-tokens // bs)
    num_blocks = 2 * nblk + 1
    caches = allocate(
        "0.32.0",
        "CPU_ATTN",
        "LBHNC",
        num_layers=nl,
        num_blocks=num_blocks,
        block_size=bs,
        num_kv_heads=nh,
        head_size=hs,
        dtype=dtype,
        cpu_attn_isa=isa,
    )
    tensors = list(caches.values())
    g = torch.Generator().manual_seed(0)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    hints = {
        "vllm_version": "0.32.0",
        "attention_backend": "CPU_ATTN",
        "cpu_attn_isa": isa,
        "device_type": "cpu",
        "block_size": bs,
        "num_kv_heads": nh,
        "head_size": hs,
    }
    layout = kvcore.detect(tensors, engine="vllm", hints=hints)
    bpt = nl * 2 * nh * hs * tensors[0].element_size()
    chunk = bs
    slots_needed = nblk
    plan = StorePlan((GroupPlan(0, "attention", bs, nl, bpt),), chunk, slots_needed, bpt)
    worker = WorkerSide(plan)
    worker.register([layout])
    arena = worker.arena
    blocks = torch.randperm(num_blocks - 1, generator=g)[:nblk].add_(1).tolist()  # block 0 is vLLM's null block
    es = engine_slots(blocks, bs, 0, tokens)
    ops = [ChunkOp(k, bytes([k % 256]) * 32, 0, min(chunk, tokens - k * chunk)) for k in range(nblk)]
    save = Transfer(ops, [es])
    load = Transfer(ops, [es], req_id="bench")
    nbytes = tokens * bpt

    # the baseline: the same cache, the same store memory (as raw whole blocks per layer)
    store_raw = next(iter(arena.groups[0].buffers.values())).view(-1).view(torch.uint8)
    per_layer_block = tensors[0][0].numel() * tensors[0].element_size()
    raw = store_raw[: nl * nblk * per_layer_block].view(nl, nblk, per_layer_block)
    flat = [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]
    idx = torch.tensor(blocks, dtype=torch.int64)

    def torch_save():
        for li in range(nl):
            torch.index_select(flat[li], 0, idx, out=raw[li])

    def torch_load():
        for li in range(nl):
            flat[li].index_copy_(0, idx, raw[li])

    def conn_save():
        rep = worker.save(save)
        if not rep.saved or rep.failed:
            raise SystemExit(f"save failed: {rep}")

    def conn_load():
        why = worker.load(load)
        if why:
            raise SystemExit(f"load failed: {why}")

    # correctness first: a load after garbage gives back the bytes saved
    conn_save()
    before = [t.clone() for t in tensors]
    want = kvcore.gather(layout, es)
    for t in tensors:
        t.view(t.shape[0], -1)[idx] = 0
    conn_load()
    if not torch.equal(kvcore.gather(layout, es), want):
        raise SystemExit("the connector's load did not restore the saved rows")
    for t, b in zip(tensors, before):
        t.copy_(b)

    fns = [
        ("save", "connector", conn_save),
        ("load", "connector", conn_load),
        ("save", "torch blocks", torch_save),
        ("load", "torch blocks", torch_load),
    ]
    for _, _, fn in fns:
        fn()  # warm: pages touched, plans cached
    times: dict[int, list[float]] = {i: [] for i in range(len(fns))}
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    for _ in range(a.repeats):  # interleaved, so a shared machine's drift hits every path alike
        for i, (_, _, fn) in enumerate(fns):
            t0 = clock()
            fn()
            times[i].append(clock() - t0)
    rows = []
    for i, (name, path, _) in enumerate(fns):
        s = statistics.median(times[i])
        rows.append(dict(isa=isa, tokens=tokens, direction=name, path=path, seconds=s, tokens_per_s=tokens / s, gbps=nbytes / s / 1e9))
    for r in rows:
        if r["path"] == "connector":
            base = next(x for x in rows if x["path"] != "connector" and x["direction"] == r["direction"])
            r["vs_torch"] = r["gbps"] / base["gbps"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="256,4096")
    ap.add_argument("--isa", default="vec,amx", help="vLLM CPU_ATTN kernel paths (comma-separated)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch's (and kvcore's) CPU threads (default 1: a shared host's fair measure)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall clock, or this process's CPU seconds (a loaded host)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads; {a.layers} layers x {a.heads} KV heads x {a.head_size}, {a.dtype}, block {a.block_size}"
    )
    print("| ISA | tokens | direction | path | ms | tokens/s | GB/s | vs torch |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for isa in a.isa.split(","):
        for t in (int(x) for x in a.tokens.split(",")):
            for r in _case(isa, t, a):
                rows.append(r)
                vs = f"{r['vs_torch']:.2f}" if "vs_torch" in r else ""
                print(
                    f"| {isa} | {t} | {r['direction']} | {r['path']} | {r['seconds'] * 1e3:.2f} | {r['tokens_per_s']:,.0f} | {r['gbps']:.2f} | {vs} |",
                    flush=True,
                )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
