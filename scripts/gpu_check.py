"""Build, check and benchmark kvcore's CUDA kernels on a GPU machine, in one run.

Usage (on the GPU machine, from the repository root)::

    python3 scripts/gpu_check.py --out OUTDIR [--quick] [--skip-bench] [--skip-tests] [--bench-seconds S]

Stages, each reported even when an earlier one fails (everything also goes to
OUTDIR/log.txt; at most five files are written: summary.json, log.txt, conformance.txt,
bench_gpu.json, bench_gpu.md):

1. build the op library with its CUDA op (``kvcore.kernels._build``; nvcc, sm_90 + PTX);
2. ceilings: a large device-to-device copy (bytes read + written) and single large pinned
   memcpys in both directions;
3. conformance (pytest, CUDA cases enabled): ``tests/test_native_kernels.py`` (every layout
   family, dtype, padded pools, byte views, layer subsets, validation, pinned and pageable
   host staging), ``tests/test_native_planes.py`` (hand-built multi-plane tables and
   blocked-scale records bit-exact against the reference), ``tests/test_staging_safety.py``
   and ``tests/test_public_path.py`` (device validation: a bad call writes nothing and
   surfaces at the next CUDA transfer or ``kvcore.synchronize()``; ``validate="sync"``;
   CUDA-graph capture and replay with new slot values; stale storage is a TransferError,
   not an illegal access; staging inside the cache refused; concurrent streams),
   ``tests/test_copy.py`` and ``tests/test_copy_safety.py`` (``kvcore.copy`` on the GPU and
   to/from pinned and pageable host memory; a cache changed since detection -- storage freed,
   tensor reshaped, the caller's tensor re-pointed under a view -- refused on either side; two
   readings of one memory refused in the call by the host byte check, the same reading by the
   device check, and a CUDA graph refusing to capture the host check); then the
   CUDA cases again with the other kernel variants (unroll 8/4, no programmatic dependent
   launch);
4. full-size agreement: the bench geometries (T = 8192) native vs reference, bit-exact,
   device and pinned staging, incl. the quantised four-plane case;
5. tuning: loads in flight per thread (4 or 8) and programmatic dependent launch on/off,
   timed on a few geometries through the public API; the better is kept;
6. ``kvcore bench --device cuda``: the device matrix (kernel entry, public API, graph
   replay, same-run copy) and pinned-host rows for a few layouts, JSON and markdown.

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
_LOG = None


def log(msg: str) -> None:
    line = f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()


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


def full_size_agreement(torch, block_sizes=(16, 256)) -> list[str]:
    """The bench geometries at full size: native CUDA vs reference, bit-exact."""
    from kvcore.bench import CASES, _setup, block_slots
    from kvcore.kernels import TransferPlan
    from kvcore.kernels.native import CUDA_KERNEL
    from kvcore.kernels.reference import REFERENCE

    dev = torch.device("cuda")
    fails = []
    for case in CASES.values():
        for bs in block_sizes:
            T = 8192
            nblk = -(-T // bs)
            nb = 2 * nblk
            lay, tb, new_staging = _setup(case, bs, nb, dev)
            perm = torch.randperm(nb)[:nblk]
            slots = block_slots(T, bs, perm).to(dev)
            slots[::97] = -1
            nv = int((slots >= 0).sum())

            def poisoned(where="cuda", pin=False, new_staging=new_staging, T=T):
                st = new_staging(T, where)
                for x in st.values() if isinstance(st, dict) else [st]:
                    x.view(torch.uint8).fill_(0xA5)
                if pin:
                    st = {k: v.pin_memory() for k, v in st.items()} if isinstance(st, dict) else st.pin_memory()
                return st

            def raw(st):
                return [x.view(torch.uint8).cpu() for x in (st.values() if isinstance(st, dict) else [st])]

            a, b = poisoned(), poisoned()
            CUDA_KERNEL.gather(TransferPlan(tb, slots, a, nv))
            REFERENCE.gather(TransferPlan(tb, slots, b, nv))
            ok_g = all(torch.equal(x, y) for x, y in zip(raw(a), raw(b)))
            hp = poisoned("cpu", pin=True)
            CUDA_KERNEL.gather(TransferPlan(tb, slots, hp, nv))
            torch.cuda.synchronize()
            ok_h = all(torch.equal(x, y) for x, y in zip(raw(hp), raw(b)))
            # scatter from device and from pinned staging into fresh caches, and the reference
            src = new_staging(T, "cuda")
            srch = {k: v.cpu().pin_memory() for k, v in src.items()} if isinstance(src, dict) else src.cpu().pin_memory()
            outs = []
            for kern, stg in ((CUDA_KERNEL, src), (CUDA_KERNEL, srch), (REFERENCE, src)):
                _, t2, _ = _setup(case, bs, nb, dev)
                kern.scatter(TransferPlan(t2, slots, stg, nv))
                torch.cuda.synchronize()
                seen, parts = set(), []
                for p in t2.planes:
                    for t, _ in p.bases:
                        st = t.untyped_storage()
                        if st._cdata not in seen:
                            seen.add(st._cdata)
                            parts.append(torch.empty(0, dtype=torch.uint8, device=dev).set_(st).clone())
                outs.append(parts)
                del t2
            ok_s = all(torch.equal(x, z) and torch.equal(y, z) for x, y, z in zip(*outs))
            tag = f"{case.label} BS={bs} T={T}"
            log(
                f"full-size {tag}: gather {'ok' if ok_g else 'MISMATCH'}, pinned gather {'ok' if ok_h else 'MISMATCH'}, scatter {'ok' if ok_s else 'MISMATCH'}"
            )
            if not (ok_g and ok_h and ok_s):
                fails.append(tag)
            del lay, tb, outs, a, b, hp, src, srch
            torch.cuda.empty_cache()
    return fails


def tune(torch, bench) -> dict:
    """Loads in flight per thread (4 or 8) and programmatic dependent launch (PDL) on/off:
    time each on a few geometries (public API, validation on) and keep the better."""
    from kvcore.kernels.native import _ops

    mod = _ops()
    dev = torch.device("cuda")
    res: dict = {}

    def measure(tag):
        rows = []
        for lay, t, host in (
            ("NHD", 8192, True),
            ("HND", 8192, False),
            ("NHD", 256, False),
            ("MLA-fp8", 256, False),
            ("Q-int8", 8192, False),
        ):
            rows += bench.bench_case(bench.CASES[lay], 16, t, dev, repeats=5, with_reference=False, host=host)
        out = {
            "device_vs_copy": [round(r.vs_copy, 4) for r in rows if r.staging == "device"],
            "public_vs_kernel": [round(r.public_vs_kernel, 4) for r in rows if r.staging == "device" and r.public_vs_kernel],
            "public_us": [round(r.public_seconds * 1e6, 1) for r in rows if r.staging == "device" and r.public_seconds],
            "public_graph_us": [round(r.public_graph_seconds * 1e6, 1) for r in rows if r.public_graph_seconds],
            "kernel_graph_us": [round(r.graph_seconds * 1e6, 1) for r in rows if r.graph_seconds],
            "host_vs_memcpy": [round(r.vs_copy, 4) for r in rows if r.staging == "pinned"],
        }
        res[tag] = out
        log(f"tuning {tag}: {out}")
        torch.cuda.empty_cache()
        return out

    def mean(xs):
        return sum(xs) / max(1, len(xs))

    torch.ops.kvcore.set_cuda_unroll(4, 8)
    mod.set_cuda_pdl(True)
    a = measure("unroll 4,8 pdl on")
    mod.set_cuda_pdl(False)
    b = measure("unroll 4,8 pdl off")
    pdl = mean(a["public_us"]) <= mean(b["public_us"])
    mod.set_cuda_pdl(pdl)
    torch.ops.kvcore.set_cuda_unroll(8, 4)
    c = measure(f"unroll 8,4 pdl {'on' if pdl else 'off'}")
    best = a if pdl else b
    dev_u = 8 if mean(c["device_vs_copy"]) > mean(best["device_vs_copy"]) else 4
    host_u = 8  # pinned staging: 8 loads in flight per thread (issue 3's tuning)
    torch.ops.kvcore.set_cuda_unroll(dev_u, host_u)
    res["chosen"] = {"device_unroll": dev_u, "host_unroll": host_u, "pdl": pdl}
    log(f"tuning: chose {res['chosen']}")
    return res


def main() -> int:
    global _LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--bench-seconds", type=float, default=150)
    ap.add_argument("--bench-layouts", default=None, help="comma-separated subset of the bench layouts (default: all)")
    ap.add_argument("--bench-tokens", default=None)
    ap.add_argument("--bench-block-sizes", default=None)
    ap.add_argument("--host-layouts", default="NHD,MLA-bf16,Q-int8", help="layouts of the pinned-host rows ('' for none)")
    ap.add_argument("--full-size-block-sizes", default="16,256", help="block sizes of the full-size agreement ('' for none)")
    ap.add_argument("--second-pass", action="store_true", help="run the CUDA cases again with unroll 8/4 and without PDL")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _LOG = open(out / "log.txt", "w")
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
        files = [
            "tests/test_native_kernels.py",
            "tests/test_native_planes.py",
            "tests/test_native_sub_runs.py",
            "tests/test_staging_safety.py",
            "tests/test_public_path.py",
            "tests/test_copy.py",
            "tests/test_copy_safety.py",
        ]
        env = dict(os.environ, KVCORE_HYPOTHESIS_EXAMPLES="60" if not args.quick else "15")
        results = {}
        conf = open(out / "conformance.txt", "w")
        passes = [("all", None, {})]
        if args.second_pass:
            passes.append(("cuda_u84_nopdl", "cuda", {"KVCORE_CUDA_UNROLL": "8,4", "KVCORE_CUDA_PDL": "0"}))
        for tag, sel, extra in passes:
            cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-rfEs"]
            if sel:
                cmd += ["-k", sel]
            t0 = time.time()
            r = subprocess.run(cmd, cwd=ROOT, env=dict(env, **extra), capture_output=True, text=True)
            text = r.stdout + r.stderr
            conf.write(f"===== {tag} ({' '.join(cmd[3:])}) {extra}\n{text}\n")
            conf.flush()
            last = [ln for ln in text.strip().splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
            results[tag] = {"rc": r.returncode, "summary": last[-1] if last else text[-300:], "seconds": round(time.time() - t0, 1)}
            log(f"conformance [{tag}] rc={r.returncode}: {results[tag]['summary']} in {results[tag]['seconds']} s")
            if r.returncode != 0:
                log(text[-6000:])
            ok = ok and r.returncode == 0
        conf.close()
        summary["conformance"] = results
        try:
            fails = full_size_agreement(torch, [int(x) for x in args.full_size_block_sizes.split(",") if x.strip()])
            summary["full_size_failures"] = fails
            ok = ok and not fails
        except Exception:  # noqa: BLE001
            ok = False
            summary["full_size_failures"] = ["exception: " + traceback.format_exc()[-1500:]]
            log("full-size agreement failed:\n" + traceback.format_exc())
    if not args.skip_bench:
        from kvcore import bench

        if not args.skip_tune:
            try:
                summary["tuning"] = tune(torch, bench)
            except Exception:  # noqa: BLE001
                log("tuning failed:\n" + traceback.format_exc())
        t0 = time.time()
        try:
            rows, small = [], []
            argv = ["--device", "cuda", "--output", str(out / "bench_gpu.json"), "--max-seconds", str(args.bench_seconds)]
            argv += ["--no-reference", "--no-host", "--small", "16,256"]
            if args.quick:
                argv.append("--quick")
            for flag, v in (("--layouts", args.bench_layouts), ("--tokens", args.bench_tokens), ("--block-sizes", args.bench_block_sizes)):
                if v:
                    argv += [flag, v]
            rc = bench.main(argv)
            data = json.loads((out / "bench_gpu.json").read_text())
            rows = [bench.Row(**r) for r in data["rows"]]
            small = [bench.SmallRow(**r) for r in data.get("small", [])]
            dev = torch.device("cuda")
            host_rows = []
            for lay in [x for x in args.host_layouts.split(",") if x.strip()]:
                for t in (256, 8192):
                    host_rows += [
                        r
                        for r in bench.bench_case(bench.CASES[lay], 16, t, dev, repeats=5, with_reference=False, host=True)
                        if r.staging == "pinned"
                    ]
                    torch.cuda.empty_cache()
            rows += host_rows
            data["rows"] += [bench.asdict(r) for r in host_rows]
            data["meta"]["tuning"] = summary.get("tuning", {}).get("chosen")
            (out / "bench_gpu.json").write_text(json.dumps(data, indent=1))
            (out / "bench_gpu.md").write_text(bench.format_table(rows) + "\n\n" + bench.format_small(small) + "\n")
            summary["bench"] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
            log("bench:\n" + bench.format_small(small))
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
