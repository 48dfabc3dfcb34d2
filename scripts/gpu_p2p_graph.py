"""Host time per fast call of ``kvcore.send`` / ``kvcore.recv`` on ONE GPU, eager and with the
groups replayed from CUDA graphs (issue 26).

NCCL cannot put two ranks on one GPU, so both ranks run in this process over
``kvcore.testing.loopback`` (the wire: device-to-device copies on kvcore's posting stream;
everything else is the GPU engine as it runs on two GPUs). A Llama-3-8B chunk (32 layers,
8 KV heads, head size 128, bf16), NHD block 16 TP 1 -> HND block 32, one TP half (heads
0..3), at 256 and 8192 tokens:

- ``send_us`` / ``recv_us``: each call's host time (median over back-to-back calls, the GPU
  not waited for: enqueueing only), eager and ``KVCORE_P2P_GRAPH=1``;
- ``pair_us_device``: device time per transfer (both calls; the wire is two extra
  device-to-device copies here, not NVLink), and every landed byte verified;
- the same run's NCCL-free ceilings for those bytes (``ceiling``): one device-to-device
  ``copy_`` of the payload, the four payload copies a loopback transfer makes at the least
  (pack, the wire's two copies, unpack), and ``kvcore.copy`` of the same rows (the layout
  change in one pass, no wire); the loopback's payload GB/s over each;
- the host cost of the pieces a call is made of (an event record, a stream wait, a stream
  switch, a native kernel launch, a small allocation, a graph replay), and of a NCCL
  point-to-point group through ProcessGroupNCCL (a one-rank group sending to itself: two
  sends and two receives, as one fast call posts; then one op), eagerly and replayed from a
  CUDA graph: the part of the two-GPU host time one GPU can measure.

Usage (repository root)::

    python3 scripts/gpu_p2p_graph.py --out $OUT
    python3 scripts/gpu_p2p_graph.py --out $OUT --kvcore-root OTHER_CHECKOUT --tag before   # kvcore from another checkout

Writes ``OUT/p2p_graph[_TAG].json`` and prints a table. Exit code 0 when every byte was verified.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
ROOT = Path(__file__).resolve().parent.parent
NL, NH, HS = 32, 8, 128


def _loopback():
    """This checkout's loopback wire (also when kvcore itself comes from --kvcore-root)."""
    spec = importlib.util.spec_from_file_location("_kvcore_loopback", ROOT / "kvcore" / "testing" / "loopback.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rand_bf16(shape, gen, dev):
    import torch

    return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).to(dev).view(torch.bfloat16)


def _blocks(t: int, bs: int, num_slots: int, gen, dev):
    import torch

    blocks = torch.randperm(num_slots // bs, generator=gen)[: -(-t // bs)]
    i = torch.arange(t)
    return (blocks[i // bs] * bs + i % bs).to(dev)


def _per_call(fn, n: int) -> float:
    """Mean host µs of ``fn`` over ``n`` calls (the GPU not waited for)."""
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1e3


def transfer_rows(dev, tokens: list[int], LoopbackWire, distributed, modes=("eager", "graph")) -> list[dict]:
    rows = []
    for t in tokens:
        rows += _transfer(dev, t, LoopbackWire, distributed, modes)
    os.environ.pop("KVCORE_P2P_GRAPH", None)
    return rows


def _dev_us(fn, n: int, reps: int = 5) -> float:
    """Device µs per ``fn()`` (median over ``reps`` of ``n`` back-to-back calls, CUDA events)."""
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / n)
    return statistics.median(out)


def _profile(send, recv, n: int) -> dict:
    """cProfile of ``n`` back-to-back transfers: per transfer (send + recv), the functions with
    the most own time and the time inside the wire's group posting (the loopback's copies or a
    graph replay), in µs."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        send()
        recv()
    pr.disable()
    st = pstats.Stats(pr)
    rows, total, wire = [], 0.0, {}
    for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():
        total += tt
        label = f"{Path(file).name}:{line}({name})" if file != "~" else name
        rows.append((tt, nc, label))
        if Path(file).name in ("loopback.py", "p2p_graph.py") or (Path(file).name == "distributed.py" and name in ("post", "_post")):
            wire[label] = round(ct / n * 1e6, 1)
    rows.sort(reverse=True)
    return {
        "profiled_us_per_transfer": round(total / n * 1e6, 1),
        "wire_cum_us_per_transfer": wire,
        "top_own_us_per_transfer": [[round(tt / n * 1e6, 2), round(nc / n, 2), label] for tt, nc, label in rows[:15]],
    }


def ceilings(dev, src, ss, dst, ds, half: int, nbytes: int, n: int) -> dict:
    """The same run's NCCL-free ceilings for ``nbytes`` of payload (µs and payload GB/s): one
    ``copy_`` of it, the four copies a loopback transfer makes at the least, and
    ``kvcore.copy`` of the same rows (NHD block 16 -> HND block 32, heads 0..half-1)."""
    import torch

    import kvcore

    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    b, c = torch.empty_like(a), torch.empty_like(a)
    out: dict = {}
    out["copy_us"] = _dev_us(lambda: b.copy_(a), n)

    def four():
        b.copy_(a)
        c.copy_(b)
        b.copy_(c)
        a.copy_(b)

    out["four_copies_us"] = _dev_us(four, n)
    try:
        kvcore.copy(src, ss, dst, ds, heads=(0, half))
        out["kvcore_copy_us"] = _dev_us(lambda: kvcore.copy(src, ss, dst, ds, heads=(0, half)), n)
    except Exception as e:  # noqa: BLE001 - reported, the other ceilings stand
        out["kvcore_copy_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for k in [k for k in out if k.endswith("_us")]:
        out[k.replace("_us", "_GBps")] = round(nbytes / out[k] / 1e3, 1)
        out[k] = round(out[k], 1)
    torch.cuda.synchronize(dev)
    return out


def _transfer(dev, t: int, LoopbackWire, distributed, modes=("eager", "graph")) -> list[dict]:
    """Eager and graph rows of one token count."""
    import torch

    import kvcore

    half = NH // 2
    gen = torch.Generator().manual_seed(t)
    nb_s, nb_d = 2 * -(-t // 16), 2 * -(-t // 32)
    src = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", [_rand_bf16((2, nb_s, 16, NH, HS), gen, dev) for _ in range(NL)])
    dst = kvcore.build_layout(
        "NL_X_TWO_NB_NH_BS_HS", [torch.zeros(2, nb_d, half, 32, HS, dtype=torch.bfloat16, device=dev) for _ in range(NL)]
    )
    ss = _blocks(t, 16, nb_s * 16, gen, dev)
    ds = _blocks(t, 32, nb_d * 32, gen, dev)
    wire = LoopbackWire(dev)
    s_end, r_end = wire.ends
    chunks = wire.agree_tokens(src, dst, t, heads=(0, half), tag=t)

    def send():
        kvcore.send(src, ss, 1, heads=(0, half), group=s_end, tag=t)

    def recv():
        kvcore.recv(dst, ds, 0, group=r_end, tag=t)

    rows = []
    n = 60 if t <= 1024 else 16
    nbytes = t * NL * 2 * half * HS * 2
    try:
        ceil = ceilings(dev, src, ss, dst, ds, half, nbytes, n)
    except Exception as e:  # noqa: BLE001 - reported, the transfer rows stand
        ceil = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"[gpu_p2p_graph] T={t} ceilings: {json.dumps(ceil)}", flush=True)
    for mode in modes:
        os.environ["KVCORE_P2P_GRAPH"] = "1" if mode == "graph" else "0"
        for _ in range(20):  # warm: in graph mode every (staging buffer, control slot) group is captured by now
            send()
            recv()
        kvcore.synchronize(dev)
        hs, hr, cs, cr = [], [], [], []
        for _ in range(n):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            send()
            c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
            recv()
            c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
            hs.append(t1 - t0)
            hr.append(t2 - t1)
            cs.append(c1 - c0)
            cr.append(c2 - c1)
        kvcore.synchronize(dev)
        # one call from an idle GPU: the host's own cost, no launch queue to wait on
        ids, idr = [], []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            send()
            t1 = time.perf_counter_ns()
            kvcore.synchronize(dev)
            t2 = time.perf_counter_ns()
            recv()
            t3 = time.perf_counter_ns()
            kvcore.synchronize(dev)
            ids.append(t1 - t0)
            idr.append(t3 - t2)
        prof = _profile(send, recv, n) if t <= 1024 else None
        kvcore.synchronize(dev)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            send()
            recv()
        e1.record()
        kvcore.synchronize(dev)
        dev_us = e0.elapsed_time(e1) * 1e3 / n
        dst_rows = kvcore.gather(dst, ds).view(torch.int16).view(2, NL, t, half, HS)
        src_rows = kvcore.gather(src, ss).view(torch.int16).view(2, NL, t, NH, HS)[:, :, :, :half]
        ok = bool(torch.equal(dst_rows, src_rows))
        wgs = [wg for pg in wire.ends for wg in getattr(distributed._GROUPS[id(pg)], "graphs", {}).values()]
        row = {
            "tokens": t,
            "mode": mode,
            "chunks": chunks,
            "MB": round(t * NL * 2 * half * HS * 2 / 1e6, 2),
            "send_us": round(statistics.median(hs) / 1e3, 1),
            "recv_us": round(statistics.median(hr) / 1e3, 1),
            "send_cpu_us": round(statistics.median(cs) / 1e3, 1),
            "recv_cpu_us": round(statistics.median(cr) / 1e3, 1),
            "send_us_idle_gpu": round(statistics.median(ids) / 1e3, 1),
            "recv_us_idle_gpu": round(statistics.median(idr) / 1e3, 1),
            "send_us_p10": round(sorted(hs)[len(hs) // 10] / 1e3, 1),
            "recv_us_p10": round(sorted(hr)[len(hr) // 10] / 1e3, 1),
            "pair_us_device": round(dev_us, 1),
            "pair_GBps": round(nbytes / dev_us / 1e3, 1),
            "ceiling": ceil,
            "vs_copy": round(ceil["copy_us"] / dev_us, 3) if "copy_us" in ceil else None,
            "vs_four_copies": round(ceil["four_copies_us"] / dev_us, 3) if "four_copies_us" in ceil else None,
            "vs_kvcore_copy": round(ceil["kvcore_copy_us"] / dev_us, 3) if "kvcore_copy_us" in ceil else None,
            "loopback_groups": wire.groups,
            "graph_captures": sum(w.captures for w in wgs),
            "graph_replays": sum(w.replays for w in wgs),
            "graph_failed": [w.failed for w in wgs if w.failed],
            "verified": ok,
            "profile": prof,
        }
        rows.append(row)
        print(
            f"[gpu_p2p_graph] T={t} {mode}: send {row['send_us']} us, recv {row['recv_us']} us host; device {row['pair_us_device']} us "
            f"per transfer; verified {ok}; graphs {row['graph_captures']} captured / {row['graph_replays']} replayed",
            flush=True,
        )
    return rows


def component_costs(dev) -> dict:
    """Host µs per call of the CUDA pieces a fast call is made of."""
    import torch

    from kvcore.kernels import _build

    out: dict = {}
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    main = torch.cuda.current_stream(dev)
    n = 2000
    out["event_record"] = _per_call(lambda: ev.record(s1), n)
    out["stream_wait_event"] = _per_call(lambda: s2.wait_event(ev), n)
    out["new_event_and_record"] = _per_call(lambda: torch.cuda.Event().record(s1), n)
    out["current_stream"] = _per_call(lambda: torch.cuda.current_stream(dev), n)

    def switch():
        torch.cuda.set_stream(s1)
        torch.cuda.set_stream(main)

    out["set_stream_twice"] = _per_call(switch, n)
    out["empty_256_int64"] = _per_call(lambda: torch.empty(256, dtype=torch.int64, device=dev), n)
    torch.cuda.synchronize(dev)
    mod = _build.MODULE
    s = torch.arange(256, dtype=torch.int64, device=dev)
    bitmap = torch.zeros(64, dtype=torch.int32, device=dev)
    flag = torch.zeros(2, dtype=torch.int32, device=dev)
    rep = torch.zeros(64, dtype=torch.uint8, device=dev)
    out["native_p2p_check_launch"] = _per_call(lambda: mod.p2p_check(None, 0, s, 2048, bitmap, flag[:1], rep, 1, 1, 1, None, 4, 1, 0), 500)
    torch.cuda.synchronize(dev)
    # a captured graph of two small copies: what a replay costs on the host
    a, b = torch.zeros(4096, dtype=torch.uint8, device=dev), torch.zeros(4096, dtype=torch.uint8, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s1):
        b.copy_(a)
        a.copy_(b)
    out["graph_replay_2_copies"] = _per_call(g.replay, n)
    out["eager_2_copies"] = _per_call(lambda: (b.copy_(a), a.copy_(b)), n)
    torch.cuda.synchronize(dev)
    return {k: round(v, 2) for k, v in out.items()}


def nccl_group_costs(dev) -> dict:
    """A one-rank ProcessGroupNCCL sending to itself: host µs per coalesced group (4 ops: the
    fast call's one group; plus a 2-op group: the second group a call posted before),
    eagerly and replayed from a CUDA graph."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return {"skipped": "NCCL is not available"}
    pg = dist.new_group([0], backend="nccl")
    out: dict = {}
    for mb in (16, 512):
        out.update(_nccl_one(dev, pg, mb))
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def _nccl_one(dev, pg, mb: int) -> dict:
    import torch

    from kvcore.p2p_graph import WireGraphs

    small_a, small_b = torch.zeros(4096, dtype=torch.uint8, device=dev), torch.zeros(4096, dtype=torch.uint8, device=dev)
    v_a, v_b = torch.zeros(64, dtype=torch.uint8, device=dev), torch.zeros(64, dtype=torch.uint8, device=dev)
    big_a = torch.randint(0, 256, (mb << 20,), dtype=torch.uint8, device=dev)
    big_b = torch.zeros_like(big_a)
    four = [(True, small_a), (False, small_b), (True, big_a), (False, big_b)]  # self: each send pairs with the next receive
    two = [(True, v_a), (False, v_b)]
    xs = torch.cuda.Stream(dev)
    out: dict = {}

    def group(ops):
        pg._start_coalescing(dev)
        for snd, t in ops:
            (pg.send if snd else pg.recv)([t], 0, 0)
        return pg._end_coalescing(dev)

    wg = WireGraphs()

    def replay():
        return wg.post(("four", mb), lambda: group(four))

    n = 200 if mb <= 16 else 20
    with torch.cuda.stream(xs):
        group(four).wait()  # the communicator exists before any capture
        torch.cuda.synchronize(dev)
        out[f"eager_group_4ops_{mb}MiB"] = _per_call(lambda: group(four), n)
        torch.cuda.synchronize(dev)
        out[f"eager_groups_4ops_plus_2ops_{mb}MiB"] = _per_call(lambda: (group(four), group(two)), n)
        torch.cuda.synchronize(dev)
        if replay() is None:
            out[f"graph_failed_{mb}MiB"] = wg.failed
            return out
        torch.cuda.synchronize(dev)
        big_a.random_(0, 256)
        small_a.random_(0, 256)
        out[f"graph_replay_4ops_{mb}MiB"] = _per_call(replay, n)
        torch.cuda.synchronize(dev)
        out[f"graph_moves_current_bytes_{mb}MiB"] = bool(torch.equal(big_a, big_b) and torch.equal(small_a, small_b))
        for name, fn in (("eager", lambda: group(four)), ("graph", replay)):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(xs)
            for _ in range(n):
                fn()
            e1.record(xs)
            e1.synchronize()
            out[f"{name}_device_us_{mb}MiB"] = e0.elapsed_time(e1) * 1e3 / n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="256,8192")
    ap.add_argument("--kvcore-root", default=None, help="import kvcore from this checkout (default: this one)")
    ap.add_argument("--tag", default="", help="suffix of the output file")
    ap.add_argument("--skip-nccl", action="store_true")
    ap.add_argument("--modes", default="eager,graph", help="eager and/or graph (KVCORE_P2P_GRAPH=1)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.kvcore_root).resolve() if args.kvcore_root else ROOT))
    import datetime
    import tempfile

    import torch
    import torch.distributed as dist

    import kvcore
    from kvcore import distributed
    from kvcore.kernels import _build

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    report: dict = {
        "kvcore": str(Path(kvcore.__file__).parent),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(dev),
        "ok": True,
    }
    st = _build.load()
    report["build"] = {"loaded": st.loaded, "cuda": st.cuda, "reason": st.reason}
    if not st.cuda:
        print(f"the CUDA op library did not load: {st.reason}", file=sys.stderr)
        return 1
    f = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    LoopbackWire = _loopback().LoopbackWire
    for name, fn in (
        (
            "transfers",
            lambda: transfer_rows(dev, [int(x) for x in args.tokens.split(",")], LoopbackWire, distributed, args.modes.split(",")),
        ),
        ("components_us", lambda: component_costs(dev)),
        ("nccl_self_group_us", lambda: {} if args.skip_nccl else nccl_group_costs(dev)),
    ):
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 - every part reports
            report["ok"] = False
            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(f"[gpu_p2p_graph] {name} FAILED: {type(e).__name__}: {e}", flush=True)
    rows = report["transfers"] if isinstance(report["transfers"], list) else []
    if not rows or not all(r["verified"] for r in rows):
        report["ok"] = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"p2p_graph{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nkvcore from {report['kvcore']}")
    print(
        f"{'T':>5} {'mode':6} {'chunks':>6} {'send us':>8} {'recv us':>8} {'send cpu':>8} {'recv cpu':>8} {'device us':>10} "
        f"{'GB/s':>7} {'/copy':>6} {'/4copy':>6} {'/kvcopy':>7} {'idle s/r us':>12} verified"
    )
    for r in rows:
        print(
            f"{r['tokens']:5d} {r['mode']:6} {r['chunks']:6d} {r['send_us']:8.1f} {r['recv_us']:8.1f} {r['send_cpu_us']:8.1f} "
            f"{r['recv_cpu_us']:8.1f} {r['pair_us_device']:10.1f} {r['pair_GBps']:7.1f} {r['vs_copy'] or 0:6.3f} "
            f"{r['vs_four_copies'] or 0:6.3f} {r['vs_kvcore_copy'] or 0:7.3f} {r['send_us_idle_gpu']:>5.1f}/{r['recv_us_idle_gpu']:<6.1f} {r['verified']}"
        )
    print("components (host us per call):", json.dumps(report.get("components_us")))
    print("NCCL one-rank group (host us per call):", json.dumps(report.get("nccl_self_group_us")))
    print(f"wrote {path}; {'every byte verified' if report['ok'] else 'SOMETHING FAILED (see the JSON)'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
