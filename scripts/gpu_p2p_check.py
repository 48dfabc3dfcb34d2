"""kvcore.send / kvcore.recv over NCCL on two GPUs: the fast path, device-side refusals and
mismatches, checked byte for byte (issue 15; the CPU twin is tests/test_distributed_fast.py).

Usage (repository root, two GPUs)::

    NCCL_NVLS_ENABLE=0 python3 scripts/gpu_p2p_check.py --out $OUT
    NCCL_NVLS_ENABLE=0 python3 scripts/gpu_p2p_check.py --out $OUT --graph   # groups replayed from CUDA graphs

Rank 0 holds a vLLM-style NHD cache (block 16, 8 KV heads), rank 1 an HND cache (block 32, 4
heads: a TP 2 decode rank taking heads 0..3). Scenarios, each on its own tag:

1. ``repeat``: three transfers of one token count with new slots each time (a handshake,
   then two fast transfers), every landed row compared with the sender's;
2. ``recv_dup``: the receiver passes a slot twice inside the agreement: both calls return,
   ``kvcore.synchronize()`` raises on both ranks, the receiving cache is untouched; then a
   good transfer lands;
3. ``send_range``: the sender passes a slot past its cache: as 2;
4. ``sender_changed`` / ``receiver_changed``: only one side changes its token count: the
   changed side raises in its call (the handshake), the other at ``kvcore.synchronize()``;
   nothing is written; then both change and the transfer lands;
5. ``varying``: request lengths changing every other call (a P/D stream), all verified.

Writes ``OUTDIR/p2p_check.json``; exit code 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NL, NH, HS = 4, 8, 128
HALF = NH // 2


def _rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import kvcore

    dev = torch.device(f"cuda:{rank}") if cfg["device"] == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(7)
    out: dict = {}
    if rank == 0:
        caches = [
            torch.randint(-(2**15), 2**15, (2, 64, 16, NH, HS), dtype=torch.int16, device=dev).view(torch.bfloat16) for _ in range(NL)
        ]
        lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)
        n_slots = 64 * 16
    else:
        caches = [torch.zeros(2, 40, HALF, 32, HS, dtype=torch.bfloat16, device=dev) for _ in range(NL)]
        lay = kvcore.build_layout("NL_X_TWO_NB_NH_BS_HS", caches)
        n_slots = 40 * 32

    def slots(t: int, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=gen)[:t].to(dev)

    def err(fn):
        try:
            fn()
        except kvcore.TransferError as e:
            return str(e)
        return None

    def check(ss_or_ds, t: int) -> bool:
        """Rank 0 sends its rows (heads 0..3) for the sender's slots; rank 1 compares them with
        what landed at its slots."""
        if rank == 0:
            ref = kvcore.gather(lay, ss_or_ds).view(2, NL, t, NH, HS)[:, :, :, :HALF].contiguous()
            dist.send(ref, 1)
            return True
        ref = torch.empty(2, NL, t, HALF, HS, dtype=torch.bfloat16, device=dev)
        dist.recv(ref, 0)
        got = kvcore.gather(lay, ss_or_ds).view(2, NL, t, HALF, HS)
        return bool(torch.equal(got.view(torch.int16), ref.view(torch.int16)))

    def snapshot():
        return [c.clone() for c in caches]

    def same(before) -> bool:  # bit patterns: random bf16 bytes hold NaNs
        return all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(caches, before))

    def xfer(sl, tag, t=None):
        if rank == 0:
            kvcore.send(lay, sl, 1, heads=(0, HALF), tag=tag)
        else:
            kvcore.recv(lay, sl, 0, tag=tag)

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - reported
            out[name] = {"exception": traceback.format_exc()[-3000:]}
        out[name + "_s"] = round(time.perf_counter() - t0, 2)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    # 1. repeat
    def repeat():
        res = []
        for _ in range(3):
            sl = slots(300, n_slots)
            xfer(sl, 1)
            kvcore.synchronize(dev)
            res.append(check(sl, 300))
        return res

    step("repeat", repeat)

    # 2. / 3. refusals inside the agreement
    def refusal(bad_rank: int, tag: int):
        sl = slots(300, n_slots)
        xfer(sl, tag)  # the agreement
        kvcore.synchronize(dev)
        ok0 = check(sl, 300)
        before = snapshot()
        sl = slots(300, n_slots)
        if rank == bad_rank:
            sl[7] = sl[3] if rank == 1 else n_slots + 5
        call = err(lambda: xfer(sl, tag))
        surfaced = err(lambda: kvcore.synchronize(dev))
        untouched = same(before) if rank == 1 else None
        sl = slots(300, n_slots)
        after = err(lambda: xfer(sl, tag))
        after_sync = err(lambda: kvcore.synchronize(dev))
        ok1 = check(sl, 300)
        return {
            "first": ok0,
            "call": call,
            "surfaced": surfaced,
            "untouched": untouched,
            "after": after,
            "after_sync": after_sync,
            "landed": ok1,
        }

    step("recv_dup", lambda: refusal(1, 2))
    step("send_range", lambda: refusal(0, 3))

    # 4. mismatches
    def mismatch(changer: int, tag: int):
        sl = slots(200, n_slots)
        xfer(sl, tag)
        kvcore.synchronize(dev)
        ok0 = check(sl, 200)
        before = snapshot()
        t = 120 if rank == changer else 200
        sl = slots(t, n_slots)
        call = err(lambda: xfer(sl, tag))
        surfaced = err(lambda: kvcore.synchronize(dev))
        untouched = same(before) if rank == 1 else None
        sl = slots(120, n_slots)
        after = err(lambda: xfer(sl, tag))
        after_sync = err(lambda: kvcore.synchronize(dev))
        ok1 = check(sl, 120)
        return {
            "first": ok0,
            "call": call,
            "surfaced": surfaced,
            "untouched": untouched,
            "after": after,
            "after_sync": after_sync,
            "landed": ok1,
        }

    step("sender_changed", lambda: mismatch(0, 4))
    step("receiver_changed", lambda: mismatch(1, 5))

    # 5. a P/D stream: new lengths every other call
    def varying():
        res = []
        for t in (17, 17, 300, 300, 1, 1, 64, 64, 999, 999):
            sl = slots(t, n_slots)
            xfer(sl, 6)
            res.append(check(sl, t))
        kvcore.synchronize(dev)
        return res

    step("varying", varying)
    from kvcore import distributed as d

    out["stats"] = dict(d._STATS)
    wgs = [wg for g in d._GROUPS.values() for wg in getattr(g, "graphs", {}).values()]
    out["graphs"] = {
        "captures": sum(w.captures for w in wgs),
        "replays": sum(w.replays for w in wgs),
        "failed": [w.failed for w in wgs if w.failed],
    }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: Gloo, the GPU path emulated (refusals raise in the call)"
    )
    ap.add_argument("--graph", action="store_true", help="the fast path's groups replayed from CUDA graphs (KVCORE_P2P_GRAPH=1)")
    args = ap.parse_args(argv)
    from kvcore.testing.multiprocess import run_ranks

    env = {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS") if k in os.environ}
    env["KVCORE_P2P_GRAPH"] = "1" if args.graph else "0"
    t0 = time.perf_counter()
    if args.device == "cpu":
        env["KVCORE_P2P_EMULATE"] = "1"
        for k in ("KVCORE_BUILD_DIR",):
            if k in os.environ:
                env[k] = os.environ[k]
    backend = "nccl" if args.device == "cuda" else "gloo"
    res = run_ranks(f"{__file__}:_rank", 2, args=({"device": args.device},), backend=backend, timeout=args.timeout, env=env, pg_timeout=120)
    report = {"seconds": round(time.perf_counter() - t0, 1), "ranks": [{"ok": r.ok, "error": r.error, "value": r.value} for r in res]}
    ok = all(r.ok for r in res)
    if ok:
        s, r = res[0].value, res[1].value
        if args.device == "cpu":  # everything is known in the call
            for side in (s, r):
                for k in ("recv_dup", "send_range", "sender_changed", "receiver_changed"):
                    side[k]["surfaced"] = side[k]["surfaced"] or side[k]["call"]
                    side[k]["call"] = side[k]["call"] or side[k]["surfaced"]
        checks = {
            "repeat landed": r["repeat"] == [True, True, True],
            "recv_dup: both raise at synchronize": bool(r["recv_dup"]["surfaced"]) and bool(s["recv_dup"]["surfaced"]),
            "recv_dup: untouched, then lands": r["recv_dup"]["untouched"] and r["recv_dup"]["landed"] and not r["recv_dup"]["after_sync"],
            "send_range: both raise at synchronize": bool(r["send_range"]["surfaced"]) and bool(s["send_range"]["surfaced"]),
            "send_range: untouched, then lands": r["send_range"]["untouched"] and r["send_range"]["landed"],
            "sender_changed: sender raises in the call, receiver at synchronize": bool(s["sender_changed"]["call"])
            and bool(r["sender_changed"]["surfaced"]),
            "sender_changed: untouched, then lands": r["sender_changed"]["untouched"] and r["sender_changed"]["landed"],
            "receiver_changed: receiver raises in the call, sender at synchronize": bool(r["receiver_changed"]["call"])
            and bool(s["receiver_changed"]["surfaced"]),
            "receiver_changed: untouched, then lands": r["receiver_changed"]["untouched"] and r["receiver_changed"]["landed"],
            "varying landed": r["varying"] == [True] * 10,
        }
        if args.graph:  # the fast calls replayed their groups from CUDA graphs on both ranks
            checks["groups replayed from CUDA graphs"] = all(x["graphs"]["replays"] > 0 and not x["graphs"]["failed"] for x in (s, r))
        report["checks"] = checks
        ok = all(bool(v) for v in checks.values())
    report["ok"] = ok
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["graph"] = args.graph
    (out / ("p2p_check_graph.json" if args.graph else "p2p_check.json")).write_text(json.dumps(report, indent=2, default=str))
    for k, v in report.get("checks", {}).items():
        print(f"{'ok  ' if v else 'FAIL'} {k}")
    print(f"p2p check{' (CUDA graphs)' if args.graph else ''}: {'all passed' if ok else 'FAILED'} ({report['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
