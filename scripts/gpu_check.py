"""Build, check and benchmark kvcore's CUDA kernel on a GPU machine, in one run.

Usage (on the GPU machine, from the repository root)::

    python3 scripts/gpu_check.py --out OUTDIR [--quick] [--skip-bench]

Stages, each reported even when an earlier one fails:

1. build the op library with its CUDA op (``kvcore.kernels._build``; nvcc, sm_90 + PTX);
2. ceilings: a large device-to-device copy (bytes read + written) and single large pinned
   memcpys in both directions;
3. conformance: ``tests/test_native_kernels.py`` with the ``cuda`` cases (semantic gather
   against a logical cache laid out through torch views, bit-exact scatter against the
   reference over whole storages, negative slots, padded pools and byte views, layer
   subsets and skip_prefix, validation before write, random geometries, pinned and
   pageable host staging both directions), then the bench geometries at full size
   (native vs reference, bit-exact, device and pinned staging);
4. ``kvcore bench --device cuda`` over the full matrix, JSON and markdown into OUTDIR.

Exit code: 0 when the build and every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ceilings(torch) -> dict:
    dev = torch.device("cuda")
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 256)
    b = torch.empty_like(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        ts.sort()
        return ts[len(ts) // 2]

    t = timed(lambda: b.copy_(a), 9)
    out = {"copy_2GiB_GBps_rw": 2 * n / t / 1e9}
    h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    d = a[: 1 << 30]
    out["pinned_D2H_1GiB_GBps"] = (1 << 30) / timed(lambda: h.copy_(d, non_blocking=True), 5) / 1e9
    out["pinned_H2D_1GiB_GBps"] = (1 << 30) / timed(lambda: d.copy_(h, non_blocking=True), 5) / 1e9
    return out


def full_size_agreement(torch) -> list[str]:
    """The bench geometries at full size: native CUDA vs reference, bit-exact."""
    import kvcore
    from kvcore.bench import CASES, block_slots, random_fill
    from kvcore.kernels import TransferPlan
    from kvcore.kernels.native import CUDA_KERNEL
    from kvcore.kernels.reference import REFERENCE

    dev = torch.device("cuda")
    fails = []
    for case in CASES.values():
        for bs in (16, 256):
            T = 8192
            nblk = -(-T // bs)
            from kvcore.grammar import parse

            axes = parse(case.format).axes
            nb = 2 * nblk
            shape = [{"TWO": 2, "NB": nb, "BS": bs, "NH": case.num_heads, "HS": case.head_size}[a] for a in axes]
            caches = [random_fill(torch.empty(shape, dtype=case.storage_dtype, device=dev)) for _ in range(case.num_layers)]
            lay = kvcore.build_layout(case.format, caches, dtype=case.dtype if case.dtype != case.storage_dtype else None)
            tb = lay.stride_table()
            perm = torch.randperm(nb)[:nblk]
            slots = block_slots(T, bs, perm).to(dev)
            slots[::97] = -1
            nv = int((slots >= 0).sum())
            a = torch.empty(lay.staging_shape(T), dtype=lay.dtype, device=dev)
            a.view(torch.uint8).fill_(0xA5)
            b = a.clone()
            CUDA_KERNEL.gather(TransferPlan(tb, slots, a, nv))
            REFERENCE.gather(TransferPlan(tb, slots, b, nv))
            ok_g = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            hp = torch.empty(lay.staging_shape(T), dtype=lay.dtype, pin_memory=True)
            hp.view(torch.uint8).fill_(0xA5)
            CUDA_KERNEL.gather(TransferPlan(tb, slots, hp, nv))
            torch.cuda.synchronize()
            ok_h = torch.equal(hp.view(torch.uint8), b.view(torch.uint8).cpu())
            # scatter back into other caches: native from device and from pinned, reference
            src = random_fill(torch.empty_like(a))
            srch = src.cpu().pin_memory()
            outs = []
            for kern, stg in ((CUDA_KERNEL, src), (CUDA_KERNEL, srch), (REFERENCE, src)):
                cc = [c.clone() for c in caches]
                ll = kvcore.build_layout(case.format, cc, dtype=case.dtype if case.dtype != case.storage_dtype else None)
                kern.scatter(TransferPlan(ll.stride_table(), slots, stg, nv))
                torch.cuda.synchronize()
                outs.append(torch.stack([c.view(torch.uint8).flatten() for c in cc]))
                del cc, ll
            ok_s = torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
            tag = f"{case.label} BS={bs} T={T}"
            log(
                f"full-size {tag}: gather {'ok' if ok_g else 'MISMATCH'}, pinned gather {'ok' if ok_h else 'MISMATCH'}, scatter {'ok' if ok_s else 'MISMATCH'}"
            )
            if not (ok_g and ok_h and ok_s):
                fails.append(tag)
            del caches, outs, a, b, hp, src, srch
            torch.cuda.empty_cache()
    return fails


def tune(torch, bench) -> dict:
    """Loads in flight per thread (4 or 8), for device and for pinned-host staging: time
    both on a few geometries and keep the better for the benchmark."""
    from kvcore.kernels.native import _ops

    _ops()
    dev = torch.device("cuda")
    res: dict = {}
    for d_un, h_un in ((4, 8), (8, 4)):
        torch.ops.kvcore.set_cuda_unroll(d_un, h_un)
        rows = []
        for lay, t, host in (
            ("NHD", 8192, True),
            ("HND", 8192, False),
            ("NHD", 256, False),
            ("MLA-fp8", 256, False),
            ("MLA-bf16", 8192, False),
        ):
            rows += bench.bench_case(bench.CASES[lay], 16, t, dev, repeats=5, with_reference=False, host=host)
        dv = [r.vs_copy for r in rows if r.staging == "device"]
        gv = [r.graph_vs_copy for r in rows if r.staging == "device" and r.graph_vs_copy]
        hv = [r.vs_copy for r in rows if r.staging == "pinned"]
        res[f"{d_un},{h_un}"] = {
            "device_vs_copy": [round(x, 4) for x in dv],
            "device_graph_vs_copy": [round(x, 4) for x in gv],
            "host_vs_memcpy": [round(x, 4) for x in hv],
        }
        log(f"tuning unroll device={d_un} host={h_un}: {res[f'{d_un},{h_un}']}")
        torch.cuda.empty_cache()

    def mean(xs):
        return sum(xs) / max(1, len(xs))

    best_dev = max((4, 8), key=lambda u: mean(res["4,8" if u == 4 else "8,4"]["device_vs_copy"]))
    best_host = max((8, 4), key=lambda u: mean(res["4,8" if u == 8 else "8,4"]["host_vs_memcpy"]))
    torch.ops.kvcore.set_cuda_unroll(best_dev, best_host)
    res["chosen"] = {"device": best_dev, "host": best_host}
    log(f"tuning: chose unroll device={best_dev} host={best_host}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--bench-seconds", type=float, default=240)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"ok": False}
    import torch

    log(f"torch {torch.__version__} cuda {torch.version.cuda}; {torch.cuda.get_device_name(0)}; python {sys.version.split()[0]}")
    os.environ.setdefault("KVCORE_BUILD_DIR", "/tmp/kvcore_build")
    os.environ["KVCORE_BUILD_VERBOSE"] = "0"
    from kvcore.kernels import _build

    t0 = time.time()
    st = _build.load()
    summary["build"] = {"loaded": st.loaded, "cuda": st.cuda, "reason": st.reason, "log": st.log, "seconds": round(time.time() - t0, 1)}
    log(f"build: {summary['build']}")
    if not (st.loaded and st.cuda):
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return 1
    try:
        summary["ceilings"] = ceilings(torch)
        torch.cuda.empty_cache()
        log(f"ceilings: {summary['ceilings']}")
    except Exception:  # noqa: BLE001
        log("ceilings failed:\n" + traceback.format_exc())
    ok = True
    if not args.skip_tests:
        env = dict(os.environ, KVCORE_HYPOTHESIS_EXAMPLES="80" if not args.quick else "20")
        results = {}
        for tag, sel, unroll in (("cuda", "cuda", ""), ("cuda_u84", "cuda", "8,4"), ("rest", "not cuda", "")):
            cmd = [sys.executable, "-m", "pytest", "tests/test_native_kernels.py", "-v", "-p", "no:cacheprovider", "-rfEs", "-k", sel]
            t0 = time.time()
            r = subprocess.run(cmd, cwd=ROOT, env=dict(env, KVCORE_CUDA_UNROLL=unroll), capture_output=True, text=True)
            text = r.stdout + r.stderr
            (out / f"conformance_{tag}.txt").write_text(text)
            npass = text.count(" PASSED")
            nfail = text.count(" FAILED")
            results[tag] = {"rc": r.returncode, "passed": npass, "failed": nfail, "seconds": round(time.time() - t0, 1)}
            log(f"conformance [{sel}] rc={r.returncode} passed={npass} failed={nfail} in {results[tag]['seconds']} s\n{text[-2500:]}")
            ok = ok and r.returncode == 0
        summary["conformance"] = results
        try:
            fails = full_size_agreement(torch)
            summary["full_size_failures"] = fails
            ok = ok and not fails
        except Exception:  # noqa: BLE001
            ok = False
            summary["full_size_failures"] = ["exception: " + traceback.format_exc()[-1500:]]
            log("full-size agreement failed:\n" + traceback.format_exc())
    if not args.skip_bench:
        from kvcore import bench

        try:
            summary["tuning"] = tune(torch, bench)
        except Exception:  # noqa: BLE001
            log("tuning failed:\n" + traceback.format_exc())

        argv = ["--device", "cuda", "--output", str(out / "bench_gpu.json"), "--max-seconds", str(args.bench_seconds)]
        if args.quick:
            argv.append("--quick")
        t0 = time.time()
        try:
            rc = bench.main(argv)
            summary["bench"] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
            data = json.loads((out / "bench_gpu.json").read_text())
            rows = [bench.Row(**r) for r in data["rows"]]
            (out / "bench_gpu.md").write_text(bench.format_table(rows) + "\n")
        except Exception:  # noqa: BLE001
            ok = False
            summary["bench"] = {"error": traceback.format_exc()[-2000:]}
            log("bench failed:\n" + traceback.format_exc())
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"summary: ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
