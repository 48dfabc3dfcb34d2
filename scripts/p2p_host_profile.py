"""Host time per fast call of ``kvcore.send`` / ``kvcore.recv`` on the CPU (issue 26).

Two processes over Gloo repeat one agreed transfer (a Llama-3-8B chunk geometry: 32 layers,
8 KV heads, head size 128, bf16; NHD block 16 TP 1 -> HND block 32, one TP half), in the
two engines the tests use: ``host`` (every message waited for in the call) and ``emulated``
(``KVCORE_P2P_EMULATE=1``: the GPU engine's fast path with the native CPU control functions
and gated kernels). Per call it reports

- ``wall_us``: the call's wall clock (includes waiting for the peer and the wire);
- ``thread_us``: the calling thread's CPU time (Python, the kernels, posting to Gloo; not
  the waits, which sleep);
- ``python_us``: ``thread_us`` less the time in the native kernels and control functions
  and in Gloo's post/wait calls, from a cProfile run: the per-call Python work;
- the top functions of the cProfile run by own time per call.

Usage (repository root)::

    python3 scripts/p2p_host_profile.py --out OUTDIR            # -> OUTDIR/p2p_host_profile.json
    python3 scripts/p2p_host_profile.py --tokens 16,256 --calls 200
    KVCORE_ROOT=/path/to/other/checkout python3 scripts/p2p_host_profile.py --modes canned   # another kvcore

On a GPU the same calls also launch kernels, wait on events and post NCCL groups through
ProcessGroupNCCL: those costs are measured by ``scripts/gpu_p2p_graph.py`` (one GPU) and
``scripts/gpu_pd_bench.py`` (two GPUs), not here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# kvcore from KVCORE_ROOT (another checkout: a before/after comparison; the spawned ranks inherit it), else this one
sys.path.insert(0, os.environ.get("KVCORE_ROOT") or str(ROOT))

NL, NH, HS = 32, 8, 128

# functions whose time is not Python work of kvcore's own (native code, Gloo, waits)
_NATIVE = ("run_gated", "p2p_check", "p2p_gate", "p2p_verdict", "copy_last_error", "take_device_error", "last_error")
_BACKEND = ("_distributed_c10d",)


# -- an in-process wire (mode "loop"): the two ranks are two threads of one process --------


class _Done:
    """A posted message that is complete at once (the canned wire)."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


class _CannedWire:
    """Both ranks in one thread, one after the other: a send completes at once, a receive
    gets the bytes the peer sent in the same position of one recorded fast call (every fast
    call of one agreement carries the same control records; the slots do not change)."""

    def __init__(self):
        self.record = True
        self.msgs: dict = {}  # (src, dst, tag) -> [bytes of one call's messages, in order]
        self.pending: dict = {}  # recording: (src, dst, tag) -> [(tensor, send?)]
        self.pos: dict = {}
        self.copy_ns = [0, 0]

    def post(self, me: int, send: bool, tensor, peer: int, tag: int):
        import torch

        key = (me, peer, tag) if send else (peer, me, tag)
        if self.record:
            # the two sides run one after the other while recording: the sender's messages
            # are kept; the receiver's receives are answered from them, its sends kept too
            if send:
                self.msgs.setdefault(key, []).append(tensor.reshape(-1).view(torch.uint8).clone())
                return _Done()
        lst = self.msgs.get(key)
        if send or not lst:
            return _Done()
        i = self.pos.get(key, 0)
        self.pos[key] = (i + 1) % len(lst)
        t0 = time.thread_time_ns()
        tensor.view(-1).view(torch.uint8).copy_(lst[i])
        self.copy_ns[me] += time.thread_time_ns() - t0
        return _Done()


class _LoopGroup:
    """Stands for a process group (kvcore keys its channels by it)."""


_TLS = __import__("threading").local()


def _run_canned(cfg: dict) -> dict:
    """The emulated engine's fast path, both ranks in this thread over :class:`_CannedWire`:
    the calls' own host time with no peer to wait for."""
    import datetime
    import tempfile
    import weakref

    import torch.distributed as dist

    import kvcore
    from kvcore import distributed

    if not dist.is_initialized():
        f = tempfile.NamedTemporaryFile(delete=False)
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    wire = _CannedWire()
    saved = distributed._group, distributed._isend, distributed._irecv
    sides = {}
    for rank in range(2):
        g = distributed._Group.__new__(distributed._Group)
        pg = _LoopGroup()
        g.ref, g.pg, g.me, g.ranks, g.index, g.backend, g.coalesce = weakref.ref(pg), None, rank, [0, 1], {0: 0, 1: 1}, "gloo", False
        sides[rank] = (g, pg)
    distributed._group = lambda group, peer, what: sides[_TLS.rank]
    distributed._isend = lambda t, peer, group, tag: wire.post(_TLS.rank, True, t, peer, tag)
    distributed._irecv = lambda t, peer, group, tag: wire.post(_TLS.rank, False, t, peer, tag)
    try:
        out = {}
        half = NH // 2
        for t in cfg["tokens"]:
            calls = {r: _caller(r, t, half) for r in range(2)}
            # record: a handshake needs both sides at once; the canned wire cannot do that, so the
            # agreement is installed directly, as both handshakes would have left it
            _agree(distributed, sides, calls, t)
            wire.record = True
            wire.msgs.clear()
            for r in range(2):
                _TLS.rank = r
                try:
                    calls[r]()  # the sender's messages recorded; the receiver lands them, its answers recorded
                except kvcore.TransferError:
                    if r != 0:
                        raise  # the sender read no answers yet: refused, as expected
            wire.record = False
            for r in range(2):
                _TLS.rank = r
                row = _measure_calls(r, t, calls[r], cfg["calls"], wire)
                out.setdefault("sender" if r == 0 else "receiver", {"rows": []})["rows"].append(row)
        return out
    finally:
        distributed._group, distributed._isend, distributed._irecv = saved


def _agree(distributed, sides, calls, t) -> None:
    """Install the agreement a handshake between the two callers would leave."""
    import kvcore

    send_layout, recv_layout = calls[0].layout, calls[1].layout
    half = NH // 2
    s_side = distributed._side(send_layout, None, (0, half), "heads")
    r_side = distributed._side(recv_layout, None, None, "heads", tuple(p[0] for p in s_side.sig))
    ct = distributed._chunk_tokens(s_side.wire.token_bytes, t, None, "cuda")  # the GPU's chunking
    ag = distributed._Agreement(s_side.sig, s_side.table.num_layers, t, ct, s_side.wire.token_bytes, 1, peer_desc="(canned)")
    ag.dfast = distributed._message(distributed._ctl_record(distributed.MAGIC, distributed.FAST, 1, t, 0), None, distributed.HEADER_BYTES)
    rag = distributed._Agreement(r_side.sig, r_side.table.num_layers, t, ct, r_side.wire.token_bytes, 1, peer_desc="(canned)")
    rag.r0fast = distributed._ctl_record(distributed.MAGIC, distributed.FAST, 1, t)
    distributed._channel(sides[0][0], 1, t, True).agreement = ag
    distributed._channel(sides[1][0], 0, t, False).agreement = rag
    del kvcore


def _caller(rank: int, t: int, half: int):
    """One side's call: rank 0 sends heads 0..half-1 of an NHD block-16 cache, rank 1 receives
    them into an HND block-32 cache of ``half`` heads."""
    import torch

    import kvcore

    gen = torch.Generator().manual_seed(t)
    if rank == 0:
        nb = 2 * -(-t // 16)
        caches = [torch.randn(2, nb, 16, NH, HS, generator=gen).to(torch.bfloat16) for _ in range(NL)]
        lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)
        slots = torch.randperm(nb * 16, generator=gen)[:t]
        fn = lambda: kvcore.send(lay, slots, 1, heads=(0, half), tag=t)  # noqa: E731
        fn.layout = lay
        return fn
    nb = 2 * -(-t // 32)
    caches = [torch.zeros(2, nb, half, 32, HS, dtype=torch.bfloat16) for _ in range(NL)]
    lay = kvcore.build_layout("NL_X_TWO_NB_NH_BS_HS", caches)
    slots = torch.randperm(nb * 32, generator=gen)[:t]
    fn = lambda: kvcore.recv(lay, slots, 0, tag=t)  # noqa: E731
    fn.layout = lay
    return fn


def _rank(rank: int, world: int, cfg: dict) -> dict:
    return _measure(rank, cfg)


def _measure(rank: int, cfg: dict) -> dict:
    from kvcore import distributed

    out: dict = {"rank": rank, "emulated": distributed._emulate(), "rows": []}
    for t in cfg["tokens"]:
        call = _caller(rank, t, NH // 2)
        for _ in range(5):  # the handshake, then warm fast calls
            call()
        out["rows"].append(_measure_calls(rank, t, call, cfg["calls"], None))
    return out


def _measure_calls(rank: int, t: int, call, n: int, wire) -> dict:
    """Per call: wall clock and this thread's CPU time (median of ``n``), then a cProfile run."""
    import cProfile
    import pstats

    from kvcore import distributed

    for _ in range(3):
        call()
    walls, cpus = [], []
    copy0 = wire.copy_ns[rank] if wire else 0
    for _ in range(n):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        call()
        walls.append(time.perf_counter_ns() - w0)
        cpus.append(time.thread_time_ns() - c0)
    copy_us = ((wire.copy_ns[rank] - copy0) / n / 1e3) if wire else None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    native = backend = total = 0.0
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in st.stats.items():
        total += tt
        short = name.split(".")[-1].strip("<>'")
        if any(k in name for k in _NATIVE) and ("built-in" in name or "method" in name or file == "~"):
            native += tt
        elif any(k in name for k in _BACKEND) or "_CannedWire" in f"{file}{name}" or (file.endswith("p2p_host_profile.py")):
            backend += tt
        rows.append((tt, nc, f"{Path(file).name}:{line}({short})" if file != "~" else name))
    rows.sort(reverse=True)
    half = NH // 2
    return {
        "tokens": t,
        "MB": round(t * NL * 2 * half * HS * 2 / 1e6, 2),
        "calls": n,
        "wall_us": round(statistics.median(walls) / 1e3, 1),
        "thread_us": round(statistics.median(cpus) / 1e3, 1),
        "thread_us_p10": round(sorted(cpus)[len(cpus) // 10] / 1e3, 1),  # a loaded machine only adds: the low decile is the call's own cost
        "wire_copy_us": None if copy_us is None else round(copy_us, 1),
        "profiled_us": round(total / n * 1e6, 1),
        "native_us": round(native / n * 1e6, 1),
        "backend_us": round(backend / n * 1e6, 1),
        "python_us_profiled": round((total - native - backend) / n * 1e6, 1),
        "top": [{"us": round(tt / n * 1e6, 2), "ncalls_per_call": round(nc / n, 2), "fn": fn} for tt, nc, fn in rows[:25]],
        "handshakes": distributed._STATS["handshakes"],
        "fast": distributed._STATS["fast"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="16,256")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument(
        "--modes",
        default="canned,emulated,host",
        help="canned: the emulated engine, both ranks in this process, no peer to wait for; emulated / host: two processes over Gloo",
    )
    args = ap.parse_args(argv)
    from kvcore.testing.multiprocess import run_ranks

    cfg = {"tokens": [int(x) for x in args.tokens.split(",")], "calls": args.calls}
    import kvcore

    report: dict = {
        "kvcore": str(Path(kvcore.__file__).parent),
        "geometry": f"{NL} layers, {NH} KV heads (one TP half: {NH // 2}), head size {HS}, bf16",
        "modes": {},
    }
    for mode in args.modes.split(","):
        if mode == "canned":
            import torch

            torch.set_num_threads(1)
            os.environ["KVCORE_P2P_EMULATE"] = "1"
            report["modes"][mode] = _run_canned(cfg)
            os.environ.pop("KVCORE_P2P_EMULATE")
            continue
        env = {"KVCORE_RANK_THREADS": "1"}
        if mode == "emulated":
            env["KVCORE_P2P_EMULATE"] = "1"
        else:
            env["KVCORE_NATIVE"] = "0"
        res = run_ranks(f"{__file__}:_rank", 2, args=(cfg,), timeout=900, env=env, pg_timeout=300)
        for r in res:
            if not r.ok:
                print(f"{mode}: rank {r.rank} failed:\n{r.error}", file=sys.stderr)
                return 1
        report["modes"][mode] = {"sender": res[0].value, "receiver": res[1].value}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "p2p_host_profile.json").write_text(json.dumps(report, indent=1))
    print(
        f"{'mode':9} {'side':8} {'T':>5} {'wall us':>9} {'thread us':>10} {'p10 us':>8} {'python us*':>10} {'native us*':>10} {'wire us*':>8}"
    )
    for mode, sides in report["modes"].items():
        for side, v in sides.items():
            for r in v["rows"]:
                print(
                    f"{mode:9} {side:8} {r['tokens']:5d} {r['wall_us']:9.1f} {r['thread_us']:10.1f} {r['thread_us_p10']:8.1f} {r['python_us_profiled']:10.1f} "
                    f"{r['native_us']:10.1f} {r['backend_us']:8.1f}"
                )
    for mode, sides in report["modes"].items():
        for side, v in sides.items():
            r = v["rows"][0]
            print(f"\n{mode} {side}, {r['tokens']} tokens: own time per call (cProfile)")
            for x in r["top"][:12]:
                print(f"  {x['us']:8.2f} us  x{x['ncalls_per_call']:<5} {x['fn']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
