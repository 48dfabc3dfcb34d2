"""Benchmarks of issue 15: layout-to-layout copy and prefill/decode transfer, in one run.

Usage (repository root)::

    # two GPUs (e.g. two H200s of one host): NCCL between two processes, one GPU each
    NCCL_NVLS_ENABLE=0 python3 scripts/gpu_pd_bench.py --out $OUT
    NCCL_NVLS_ENABLE=0 python3 scripts/gpu_pd_bench.py --out $OUT --p2p-modes eager,graph   # and from CUDA graphs
    # CPU only (Gloo between two processes)
    python3 scripts/gpu_pd_bench.py --device cpu --out OUTDIR

Geometry: a Llama-3-8B chunk, bf16 (32 layers, 8 KV heads, head size 128: 128 KiB per token),
at 256 tokens (33.6 MB) and 8192 tokens (1.07 GB) (``--device cpu``: 256 and 2048). Slot
mappings are whole blocks in random order from pools twice the size; caches hold random
bytes.

Stages (each reported even when an earlier one fails):

1. build the native op library (C++ CPU and, on a GPU, CUDA; ``csrc/``);
2. (GPU) correctness: ``pytest tests/test_copy.py -k cuda`` (every conversion class on the
   GPU, device <-> pinned host, the pageable fallback, TP split), when pytest is installed;
3. ``kvcore.copy`` on one device: NHD block 16 -> HND block 32 against a same-run
   contiguous ``copy_`` of the same bytes (GB/s = bytes read + bytes written), and (GPU)
   device -> pinned host against a pinned ``copy_`` of the same bytes (GB/s = bytes over
   the link). ``kernel`` rows time the copy kernel on a validated plan (CUDA events around
   back-to-back calls; 256-token rows rotate among 8 disjoint slot sets and buffers so the
   working set is past the L2); ``api`` rows time ``kvcore.copy`` itself, validation
   included (one host synchronisation per call);
4. two processes (rank 0 = prefill GPU, rank 1 = decode GPU): NCCL (Gloo) send/recv of
   contiguous bytes — the ceiling — for the whole chunk and for one TP rank's half; the
   naive per-layer ``index_select`` -> send -> ``index_copy_`` (NHD -> NHD, no conversion);
   ``kvcore.send`` / ``kvcore.recv`` NHD block 16 TP 1 -> HND block 32 TP 2: rank 0 sends
   heads 0..3 to decode cache A and heads 4..7 to decode cache B, both on rank 1 ("both
   halves", the same bytes as the ceiling of the whole chunk) and one half alone against
   the ceiling of half the bytes; a chunk-size sweep. Each transfer time is the slower
   rank's wall clock over back-to-back repetitions between barriers; median of repeats.
   The decode caches are verified against the prefill cache after the timed runs.

Writes ``OUTDIR/pd_bench.json`` and prints a table with each target met or missed.
Exit code 0 when everything ran and every correctness check passed (targets are reported,
not enforced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (shared hosts: see the device README)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NL, NH, HS, DT_BYTES = 32, 8, 128, 2
TOKEN_BYTES = NL * 2 * NH * HS * DT_BYTES  # 128 KiB per token, all layers, K and V
PREFILL_BS, DECODE_BS = 16, 32


def log(msg: str) -> None:
    print(f"[pd_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- caches ------------------------------------------------------------------------------


def _blocks_slots(num_tokens: int, block_size: int, pool_blocks: int, gen, device):
    import torch

    nb = -(-num_tokens // block_size)
    blocks = torch.randperm(pool_blocks, generator=gen)[:nb]
    t = torch.arange(num_tokens)
    return (blocks[t // block_size] * block_size + t % block_size).to(device)


def _random_(t):
    import torch

    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=b.device))
    return t


def prefill_cache(num_tokens: int, device, sets: int = 1, heads: int = NH):
    """NHD block 16 ``NL x [2, NB, 16, NH, HS]`` bf16 with a pool of twice the tokens (x sets)."""
    import torch

    import kvcore

    nb = 2 * sets * (-(-num_tokens // PREFILL_BS))
    caches = [_random_(torch.empty(2, nb, PREFILL_BS, heads, HS, dtype=torch.bfloat16, device=device)) for _ in range(NL)]
    return kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches), nb


def decode_cache(num_tokens: int, device, heads: int, sets: int = 1, pin: bool = False):
    """HND block 32 ``NL x [2, NB, NH, 32, HS]`` bf16 with a pool of twice the tokens (x sets)."""
    import torch

    import kvcore

    nb = 2 * sets * (-(-num_tokens // DECODE_BS))
    caches = [torch.zeros(2, nb, heads, DECODE_BS, HS, dtype=torch.bfloat16, device=device, pin_memory=pin) for _ in range(NL)]
    return kvcore.build_layout("NL_X_TWO_NB_NH_BS_HS", caches), nb


# -- stage 3: kvcore.copy on one device ----------------------------------------------------------


def _time_cuda(fns, reps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``reps`` back-to-back calls (rotating ``fns``)."""
    import torch

    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for f in fns:
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        s.record()
        for i in range(reps):
            fns[i % len(fns)]()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / 1e3 / reps)
    return statistics.median(out)


def _time_cpu(fns, min_s: float, repeats: int) -> float:
    for f in fns:
        f()
    out = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fns[n % len(fns)]()
            n += 1
            if time.perf_counter() - t0 > min_s:
                break
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def copy_bench(device_type: str, tokens: list[int], quick: bool) -> list[dict]:
    import torch

    dev = torch.device("cuda" if device_type == "cuda" else "cpu")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for t in tokens:
        rows += _copy_one(dev, t, gen, quick)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _copy_one(dev, t: int, gen, quick: bool) -> list[dict]:
    import torch

    import kvcore
    from kvcore.kernels.copy_kernels import REFERENCE_COPY, select_copy_kernel
    from kvcore.layout_copy import plan_copy

    rows = []
    sets = 8 if (dev.type == "cuda" and t <= 512) else 1
    src, snb = prefill_cache(t, dev, sets)
    dst, dnb = decode_cache(t, dev, NH, sets)
    n = t * TOKEN_BYTES
    plans, ss_all, ds_all = [], [], []
    for _ in range(sets):
        # each set: distinct blocks drawn from the whole pool (sets may share blocks: they only rotate the working set)
        ss = _blocks_slots(t, PREFILL_BS, snb, gen, dev)
        ds = _blocks_slots(t, DECODE_BS, dnb, gen, dev)
        plans.append(plan_copy(src, ss, dst, ds))
        ss_all.append(ss)
        ds_all.append(ds)
    kernel = select_copy_kernel(plans[0])
    a = [_random_(torch.empty(n, dtype=torch.uint8, device=dev)) for _ in range(sets)]
    b = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(sets)]
    copy_fns = [lambda i=i: b[i].copy_(a[i]) for i in range(sets)]
    kern_fns = [lambda p=p: kernel.copy(p) for p in plans]
    api_fns = [lambda i=i: kvcore.copy(src, ss_all[i], dst, ds_all[i]) for i in range(sets)]
    none_fns = [lambda i=i: kvcore.copy(src, ss_all[i], dst, ds_all[i], validate="none") for i in range(sets)]
    host = None
    if dev.type == "cuda":
        reps = 20 if t <= 512 else 5
        tc = _time_cuda(copy_fns, reps, 5)
        tk = _time_cuda(kern_fns, reps, 5)
        ta = _time_cuda(api_fns, reps, 5)
        tn = _time_cuda(none_fns, reps, 3)
        tr = _time_cuda([lambda: REFERENCE_COPY.copy(plans[0])], 2, 2)
        # host time of one public call (no synchronisation: what the host spends to enqueue it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(20):
            api_fns[i % sets]()
        host = (time.perf_counter() - t0) / 20
        torch.cuda.synchronize()
    else:
        tc = _time_cpu(copy_fns, 0.1 if quick else 0.3, 3)
        tk = _time_cpu(kern_fns, 0.1 if quick else 0.3, 3)
        ta = _time_cpu(api_fns, 0.1 if quick else 0.3, 3)
        tn = _time_cpu(none_fns, 0.1, 3)
        tr = _time_cpu([lambda: REFERENCE_COPY.copy(plans[0])], 0.05, 1)
    base = {"what": "copy NHD bs16 -> HND bs32", "staging": "device", "tokens": t, "MB": round(n / 1e6, 1), "kernel": kernel.name}
    for kind, tt in (("kernel", tk), ("api", ta), ("api-validate-none", tn)):
        rows.append(
            dict(
                base,
                timing=kind,
                us=round(tt * 1e6, 1),
                GBps=round(2 * n / tt / 1e9, 1),
                baseline_GBps=round(2 * n / tc / 1e9, 1),
                vs_baseline=round(tc / tt, 4),
                reference_GBps=round(2 * n / tr / 1e9, 2),
                vs_kernel=round(tk / tt, 4),
                host_us=round(host * 1e6, 1) if (host is not None and kind == "api") else None,
            )
        )
    # semantic spot check of the benchmark plan (the pytest stage checks every class). The sets
    # share destination blocks and the timing loops end on other sets: copy set 0 again first
    kvcore.copy(src, ss_all[0], dst, ds_all[0])
    p0 = plans[0]
    got = kvcore.gather(dst, p0.dst_slots[:64])
    want = kvcore.gather(src, p0.src_slots[:64])
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        raise RuntimeError(f"copy bench at {t} tokens: the copied rows differ from the source rows")
    a.clear()
    b.clear()
    if dev.type == "cuda":
        rows.append(_pinned_one(dev, t, gen, src, ss_all[0], base))
    log(
        f"copy {t} tokens: "
        + "; ".join(f"{r['staging']} {r['timing']} {r['GBps']} GB/s ({100 * r['vs_baseline']:.1f}% of copy_)" for r in rows)
    )
    return rows


def _pinned_one(dev, t: int, gen, src, ss, base: dict) -> dict:
    """Device -> pinned host, the conversion fused (the destination HND block 32 in pinned memory)."""
    import torch

    import kvcore
    from kvcore.kernels.copy_kernels import select_copy_kernel
    from kvcore.layout_copy import plan_copy

    n = t * TOKEN_BYTES
    hdst, hnb = decode_cache(t, "cpu", NH, 1, pin=True)
    hds = _blocks_slots(t, DECODE_BS, hnb, gen, dev)
    hplan = plan_copy(src, ss, hdst, hds)
    hk = select_copy_kernel(hplan)
    hbuf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dbuf = _random_(torch.empty(n, dtype=torch.uint8, device=dev))
    reps = 5 if t <= 512 else 2
    tc = _time_cuda([lambda: hbuf.copy_(dbuf, non_blocking=True)], reps, 5)
    tk = _time_cuda([lambda: hk.copy(hplan)], reps, 5)
    got = kvcore.gather(hdst, hds[:64].cpu())
    want = kvcore.gather(src, ss[:64]).cpu()
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        raise RuntimeError(f"pinned copy bench at {t} tokens: the copied rows differ from the source rows")
    return dict(
        base,
        staging="device->pinned",
        kernel=hk.name,
        timing="kernel",
        us=round(tk * 1e6, 1),
        GBps=round(n / tk / 1e9, 1),
        baseline_GBps=round(n / tc / 1e9, 1),
        vs_baseline=round(tc / tk, 4),
        reference_GBps=None,
    )


# -- stage 4: two processes ------------------------------------------------------------


def _p2p_rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank}") if cfg["device"] == "cuda" else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    out: dict = {"rank": rank, "rows": []}

    def timed(fn, reps: int, repeats: int) -> float:
        fn()
        sync()
        dist.barrier()
        ts = []
        for _ in range(repeats):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            dist.barrier()
            ts.append((time.perf_counter() - t0) / reps)
        return statistics.median(ts)

    for t in cfg["tokens"]:
        out["rows"].append(_p2p_one(rank, dev, t, cfg, gen, timed))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _p2p_one(rank: int, dev, t: int, cfg: dict, gen, timed) -> dict:
    import torch
    import torch.distributed as dist

    import kvcore

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    half = NH // 2
    reps = 10 if t <= 512 else 3
    repeats = 5 if t <= 512 else 3
    if cfg["quick"]:
        reps, repeats = max(2, reps // 3), 2
    n_full, n_half = t * TOKEN_BYTES, t * TOKEN_BYTES // 2
    rec: dict = {"tokens": t, "MB_full": round(n_full / 1e6, 1), "MB_half": round(n_half / 1e6, 1)}
    # ceiling: contiguous bytes
    for key, n in (("ceiling_full", n_full), ("ceiling_half", n_half)):
        buf = torch.empty(n, dtype=torch.uint8, device=dev)

        def xfer(buf=buf):
            (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)

        rec[key] = timed(xfer, reps, repeats)
        del buf
    # prefill (rank 0) / decode (rank 1) caches
    if rank == 0:
        src, snb = prefill_cache(t, dev)
        ss = _blocks_slots(t, PREFILL_BS, snb, gen, dev)
    else:
        dsts = [decode_cache(t, dev, half)[0] for _ in range(2)]
        dnb = dsts[0].num_blocks
        ds = _blocks_slots(t, DECODE_BS, dnb, gen, dev)
        naive_dst, nnb = prefill_cache(t, dev)
        nds = _blocks_slots(t, PREFILL_BS, nnb, gen, dev)
    # naive per layer: index_select -> send -> index_copy_ (NHD -> NHD, no conversion)
    rows_buf = torch.empty(2, t, NH * HS, dtype=torch.bfloat16, device=dev)

    def naive():
        for layer in range(NL):
            if rank == 0:
                flat = src.kv_caches[layer].view(2, -1, NH * HS)
                torch.index_select(flat, 1, ss, out=rows_buf)
                dist.send(rows_buf, 1)
            else:
                dist.recv(rows_buf, 0)
                naive_dst.kv_caches[layer].view(2, -1, NH * HS).index_copy_(1, nds, rows_buf)

    rec["naive"] = timed(naive, reps, repeats)
    # kvcore: NHD bs16 TP1 -> HND bs32 TP2
    # each chunk size on a channel of its own (a tag): the chunking is agreed in a channel's handshake;
    # each mode (eager groups, or groups replayed from CUDA graphs: KVCORE_P2P_GRAPH=1) on channels of its own
    sweep = [None] if cfg["quick"] else [None, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
    for mode_i, mode in enumerate(cfg.get("modes") or ["eager"]):
        os.environ["KVCORE_P2P_GRAPH"] = "1" if mode == "graph" else "0"
        suffix = "" if mode == "eager" else "_graph"
        _kvcore_rows(
            rank,
            rec,
            src if rank == 0 else None,
            ss if rank == 0 else None,
            dsts if rank == 1 else None,
            ds if rank == 1 else None,
            half,
            sweep,
            100 * mode_i,
            suffix,
            reps,
            repeats,
            timed,
            sync,
        )
    os.environ.pop("KVCORE_P2P_GRAPH", None)
    from kvcore import distributed as _d

    rec["handshakes"] = _d._STATS["handshakes"]
    rec["fast_calls"] = _d._STATS["fast"]
    wgs = [wg for g in _d._GROUPS.values() for wg in getattr(g, "graphs", {}).values()]
    rec["graph_captures"] = sum(w.captures for w in wgs)
    rec["graph_replays"] = sum(w.replays for w in wgs)
    rec["graph_failed"] = "; ".join(w.failed for w in wgs if w.failed)
    # verify: rank 0 sends its gathered rows, rank 1 compares both decode halves
    ref = torch.empty(2, NL, t, NH * HS, dtype=torch.bfloat16, device=dev)
    if rank == 0:
        kvcore.gather(src, ss, ref)
        dist.send(ref, 1)
    else:
        dist.recv(ref, 0)
        if dev.type == "cuda":
            kvcore.synchronize(dev)  # refusals found on the device surface here
        ok = True
        for r in range(2):
            got = kvcore.gather(dsts[r], ds).view(2, NL, t, half, HS)
            want = ref.view(2, NL, t, NH, HS)[:, :, :, r * half : r * half + half]
            ok = ok and torch.equal(got.view(torch.int16), want.reshape(got.shape).view(torch.int16))
        rec["verified"] = ok
    return rec


def _kvcore_rows(rank, rec, src, ss, dsts, ds, half, sweep, tag0, suffix, reps, repeats, timed, sync) -> None:
    """kvcore.send / recv rows of one mode (``suffix``) into ``rec``: both halves and one half per chunk size."""
    import torch.distributed as dist

    import kvcore

    for n_cb, cb in enumerate(sweep):

        def both(cb=cb, tag=tag0 + 2 * n_cb):
            for r in range(2):
                if rank == 0:
                    kvcore.send(src, ss, 1, heads=(r * half, r * half + half), chunk_bytes=cb, tag=tag)
                else:
                    kvcore.recv(dsts[r], ds, 0, tag=tag)

        def one(cb=cb, tag=tag0 + 2 * n_cb + 1):
            if rank == 0:
                kvcore.send(src, ss, 1, heads=(0, half), chunk_bytes=cb, tag=tag)
            else:
                kvcore.recv(dsts[0], ds, 0, tag=tag)

        name = "default" if cb is None else f"{cb >> 20}MiB"
        for _ in range(16):  # warm: a handshake per channel; with graphs, every (staging buffer, control slot) group captured
            both()
            one()
        sync()
        dist.barrier()
        rec[f"kvcore_both_{name}{suffix}"] = timed(both, reps, repeats)
        rec[f"kvcore_one_{name}{suffix}"] = timed(one, reps, repeats)
        if cb is None:
            # host time of one fast call (no synchronisation): enqueueing only
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                one()
            rec[f"host_us_one{suffix}"] = (time.perf_counter() - t0) / reps * 1e6
            sync()
            dist.barrier()


def p2p_bench(device_type: str, tokens: list[int], quick: bool, timeout: float, modes: list[str] | None = None) -> list[dict]:
    from kvcore.testing.multiprocess import run_ranks

    backend = "nccl" if device_type == "cuda" else "gloo"
    cfg = {"device": device_type, "tokens": tokens, "quick": quick, "modes": modes or ["eager"]}
    env = {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS") if k in os.environ}
    if device_type == "cpu":
        env["KVCORE_RANK_THREADS"] = "1"
    res = run_ranks(f"{__file__}:_p2p_rank", 2, args=(cfg,), backend=backend, timeout=timeout, env=env, pg_timeout=600)
    for r in res:
        if not r.ok:
            raise RuntimeError(f"rank {r.rank} failed (exit {r.exitcode}):\n{r.error}")
    rows = []
    for a, b in zip(res[0].value["rows"], res[1].value["rows"]):
        row = {k: (max(a[k], b[k]) if isinstance(a.get(k), float) else a.get(k)) for k in a}
        for k in ("host_us_one", "host_us_one_graph", "handshakes", "fast_calls", "graph_captures", "graph_replays", "graph_failed"):
            if k in a:
                row[k] = {
                    "sender": round(a[k], 1) if isinstance(a[k], float) else a[k],
                    "receiver": round(b[k], 1) if isinstance(b[k], float) else b[k],
                }
        row["verified"] = b.get("verified")
        for k in list(row):
            if k.startswith(("ceiling", "naive", "kvcore")) and isinstance(row[k], float):
                n = row["MB_half"] if ("half" in k or "_one_" in k) else row["MB_full"]
                row[k + "_GBps"] = round(n * 1e6 / row[k] / 1e9, 1)
        rows.append(row)
        log(
            f"p2p {row['tokens']} tokens: ceiling {row['ceiling_full_GBps']} GB/s (half {row['ceiling_half_GBps']}), naive "
            f"{row['naive_GBps']}, kvcore both halves {row['kvcore_both_default_GBps']}, one half {row['kvcore_one_default_GBps']}"
            + (
                f"; from CUDA graphs: both halves {row['kvcore_both_default_graph_GBps']}, one half {row['kvcore_one_default_graph_GBps']}"
                if "kvcore_both_default_graph_GBps" in row
                else ""
            )
            + f"; verified {row['verified']}"
        )
    return rows


# -- main --------------------------------------------------------------------------------


def targets(device_type: str, copy_rows: list[dict], p2p_rows: list[dict]) -> list[dict]:
    out = []

    def add(name, value, goal):
        out.append({"target": name, "value": value, "goal": goal, "met": value is not None and value >= goal})

    for r in p2p_rows:
        goal = 0.90 if r["tokens"] >= 8192 else 0.75
        for suffix, how in (("", "eager groups"), ("_graph", "groups from CUDA graphs")):
            if device_type != "cuda" or f"kvcore_both_default{suffix}_GBps" not in r:
                continue
            best_both = max(
                v for k, v in r.items() if k.startswith("kvcore_both_") and k.endswith(f"{suffix}_GBps") and ("_graph" in k) == bool(suffix)
            )
            add(
                f"kvcore.send/recv NHD->HND TP1->2 both halves vs NCCL ceiling, {r['tokens']} tokens (default chunks, {how})",
                round(r[f"kvcore_both_default{suffix}_GBps"] / r["ceiling_full_GBps"], 4),
                goal,
            )
            add("  same, best chunk size of the sweep", round(best_both / r["ceiling_full_GBps"], 4), goal)
            add(
                f"  one TP half vs NCCL ceiling of half the bytes, {r['tokens']} tokens",
                round(r[f"kvcore_one_default{suffix}_GBps"] / r["ceiling_half_GBps"], 4),
                goal,
            )
    for r in copy_rows:
        if device_type == "cuda" and r["timing"] == "api":
            add(
                f"kvcore.copy public call vs its kernel entry, {r['tokens']} tokens (time ratio kernel/api)",
                r["vs_kernel"],
                0.97 if r["tokens"] >= 8192 else 0.90,
            )
        # the targets are the call a user makes: kvcore.copy ("api"); the pinned row has one timing
        # ("kernel": the public call's plan on pinned memory). The raw kernel entry re-checks both
        # caches in Python per call (copy_kernels.check_tables), so it is not the fast path
        public = r["timing"] == "api" if r["staging"] == "device" else r["timing"] == "kernel"
        if device_type == "cuda" and r["tokens"] >= 8192 and public:
            goal = 0.90 if r["staging"] == "device->pinned" else 0.85
            add(f"kvcore.copy {r['staging']} NHD bs16 -> HND bs32, {r['tokens']} tokens vs copy_", r["vs_baseline"], goal)
        if r["timing"] != "kernel":
            continue
        if device_type == "cpu":
            add(f"CPU kvcore.copy NHD bs16 -> HND bs32, {r['tokens']} tokens vs copy_", r["vs_baseline"], 0.75)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default $OUT)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when two GPUs are visible, else cpu")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, no chunk sweep")
    ap.add_argument("--skip-tests", action="store_true", help="skip the pytest stage")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 256,8192; cpu 256,2048)")
    ap.add_argument("--p2p-timeout", type=float, default=1200.0, help="seconds before the two p2p ranks are stopped")
    ap.add_argument(
        "--p2p-modes",
        default="eager",
        help="comma-separated: eager (groups posted through the backend), graph (groups replayed from CUDA graphs: KVCORE_P2P_GRAPH=1)",
    )
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu")
    tokens = [int(x) for x in args.tokens.split(",")] if args.tokens else ([256, 8192] if device == "cuda" else [256, 2048])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": device, "tokens": tokens, "torch": torch.__version__, "stages": {}, "ok": True}
    if device == "cuda":
        report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        report["cpu_threads"] = torch.get_num_threads()

    def stage(name, fn):
        log(f"stage {name} ...")
        t0 = time.perf_counter()
        try:
            val = fn()
            report["stages"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1)}
            return val
        except Exception as e:  # noqa: BLE001 - every stage reports
            report["ok"] = False
            report["stages"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            log(f"stage {name} FAILED: {type(e).__name__}: {e}")
            return None

    def build():
        from kvcore.kernels import _build

        st = _build.load()
        report["build"] = {"loaded": st.loaded, "cuda": st.cuda, "reason": st.reason, "log": st.log}
        if not st.loaded:
            raise RuntimeError(st.reason)
        return st

    stage("build", build)

    def tests():
        try:
            import pytest  # noqa: F401
        except ImportError:
            report["tests"] = "skipped: pytest is not installed"
            return None
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_copy.py"), "-k", "cuda"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        report["tests"] = {"returncode": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
        log("pytest: " + (p.stdout.strip().splitlines() or ["?"])[-1])
        if p.returncode != 0:
            raise RuntimeError("CUDA copy tests failed")
        return p.returncode

    if device == "cuda" and not args.skip_tests:
        stage("tests", tests)
    copy_rows = stage("copy", lambda: copy_bench(device, tokens, args.quick)) or []
    modes = [m for m in args.p2p_modes.split(",") if m]
    p2p_rows = stage("p2p", lambda: p2p_bench(device, tokens, args.quick, timeout=args.p2p_timeout, modes=modes)) or []
    if any(r.get("verified") is False for r in p2p_rows):
        report["ok"] = False
    report["copy"] = copy_rows
    report["p2p"] = p2p_rows
    report["targets"] = targets(device, copy_rows, p2p_rows)
    path = out_dir / ("pd_bench.json" if device == "cuda" else "pd_bench_cpu.json")
    path.write_text(json.dumps(report, indent=2, default=str))
    print()
    for t in report["targets"]:
        print(f"{'met   ' if t['met'] else 'MISSED'}  {t['target']}: {100 * t['value']:.1f}% (goal {100 * t['goal']:.0f}%)")
    print(f"\nwrote {path}; {'all stages ran, every check passed' if report['ok'] else 'SOME STAGE FAILED (see the JSON)'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
