"""Prove and benchmark the Triton kernel (kvcore-xpu's ``triton-xpu``) on a CUDA GPU.

No Intel GPU is available to the project; the same Triton program compiles for NVIDIA
GPUs, so this script forces it on ``cuda`` (``KVCORE_KERNEL=triton-xpu``) and:

1. **conformance**: the conformance suite (``kvcore check xpu`` in-process) with the
   Triton kernel on CUDA against every fixture of every plugin found in the repository
   (vLLM, SGLang, transformers, the TRT-LLM example and the XPU fixtures);
2. **agreement**: the benchmark geometries at full size (8192 tokens, Llama-3-8B NHD/HND
   and DeepSeek MLA, BS 16 and 64), a multi-plane record staged into one buffer per plane
   (four widths and dtypes), and the partial last chunk (37 tokens through 16-token
   non-contiguous views) -- gather and scatter byte-identical to the reference kernel,
   with device, pinned-host and pageable-host staging;
3. **tuning**: tile bytes x warps on a few geometries; the best mean ratio to ``copy_``
   is kept for the benchmark;
4. **benchmark**: NHD, HND, MLA (bf16), BS 16 and 64, 256 and 8192 tokens, both
   directions: the Triton kernel beside the CUDA kernel (``native-cuda``, built here when
   nvcc is found) and a same-run ``copy_`` of the same bytes; eager (CUDA events around 20
   back-to-back calls, host launch cost included) and replayed from a CUDA graph, with the
   host time per call (100 calls queued without synchronising) and how many timed calls
   missed the kernel's launch cache. Targets: >= 85 % of ``copy_`` at 8192 tokens,
   >= 70 % at 256.

Usage, from the repository root on the GPU machine (kvcore importable, e.g.
``PYTHONPATH=$PWD`` with pydantic installed)::

    python3 scripts/gpu_triton_check.py --out "$OUT" [--quick] [--skip-conformance] [--skip-bench]
        [--tune 8192x4,16384x4] [--conformance-last] [--conformance-triton-only] [--deadline S]

Order: conformance (unless ``--conformance-last``), agreement on the benchmark
geometries, tuning and benchmark, agreement on the multi-plane record and the partial
chunk, then conformance when ``--conformance-last`` (no check starts after
``--deadline`` seconds: a time-boxed run keeps what it finished).

Writes ``triton_summary.json`` (versions, every stage's result, the targets met or missed)
and ``triton_bench.json`` (the rows) into ``--out``; prints a log. Exit 0 when every
conformance and agreement check passed (speed targets are reported, not enforced).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for sub in ("", "plugins/xpu", "plugins/vllm", "plugins/sglang", "plugins/transformers", "examples/kvcore-trtllm"):
    p = str(ROOT / sub) if sub else str(ROOT)
    if p not in sys.path:
        sys.path.insert(0, p)

NAME = "triton-xpu"
T0 = time.time()
# --smoke: the whole script on CPU tensors in Triton's interpreter at tiny sizes (to check
# the script itself on a machine without a GPU); otherwise CUDA at the sizes above
SMOKE = False
BIG, SMALL = 8192, 256


def device():
    import torch

    return torch.device("cpu" if SMOKE else "cuda")


def cases():
    """The benchmark layouts (kvcore.bench.CASES; tiny under --smoke)."""
    from dataclasses import replace

    from kvcore.bench import CASES

    if not SMOKE:
        return CASES
    return {k: replace(c, num_layers=2, num_heads=min(c.num_heads, 2), head_size=16 if c.num_heads > 1 else 40) for k, c in CASES.items()}


def sync():
    import torch

    if not SMOKE:
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[gpu_triton_check {time.time() - T0:7.1f}s] {msg}", flush=True)


def register_repo_plugins() -> dict[str, str]:
    """Register the repository's plugins that are not installed (no entry points on the
    GPU machine): returns ``{name: "entry point" | "registered" | "unavailable: why"}``."""
    import kvcore

    loaded = {i.name for i in kvcore.plugins() if not i.error}
    out = {}
    for name, mod in (
        ("xpu", "kvcore_xpu.plugin"),
        ("vllm", "kvcore_vllm.plugin"),
        ("sglang", "kvcore_sglang.plugin"),
        ("transformers", "kvcore_transformers.plugin"),
        ("trtllm", "kvcore_trtllm.plugin"),
    ):
        if name in loaded:
            out[name] = "entry point"
            continue
        try:
            kvcore.register_plugin(importlib.import_module(mod), name=name)
            out[name] = "registered"
        except Exception as e:  # noqa: BLE001 - an engine plugin missing its engine is reported
            out[name] = f"unavailable: {type(e).__name__}: {e}"[:300]
    return out


# -- 1. conformance -------------------------------------------------------------------------


def conformance(examples: int, deadline: float | None = None, only_triton: bool = False) -> dict:
    """The conformance suite with the Triton kernel forced on the device, task by task
    (``only_triton``: the Triton kernel's checks and those that move no data), stopping
    at ``deadline`` (``time.time()``) with what ran so far."""
    from kvcore.testing import suite
    from kvcore.testing.runner import plan, select

    if not SMOKE:
        os.environ.pop("TRITON_INTERPRET", None)
    t = time.time()
    dt = device().type
    filters = {"fixtures": ["vllm-0.11-FLASH_ATTN-HND", "xpu-sglang-0.5.23-dsa-indexer-page128"]} if SMOKE else {}
    if only_triton:
        filters["kernels"] = [f"{NAME}@{dt}"]
    tasks = select(plan(["xpu"], suite.Options(examples=examples, devices=(dt,))), **filters)
    results, left = [], 0
    for i, task in enumerate(tasks):
        if deadline is not None and time.time() > deadline:
            left = len(tasks) - i
            break
        results.append(task.run())
    mine = [r for r in results if r.kernel == f"{NAME}@{dt}"]
    fails = [r for r in results if r.status == "FAIL"]
    by = {}
    for r in mine:
        by.setdefault(r.check.split("[")[0], {"PASS": 0, "FAIL": 0, "SKIP": 0})[r.status] += 1
    out = {
        "seconds": round(time.time() - t, 1),
        "checks": len(results),
        "not_run_deadline": left,
        "triton_checks": len(mine),
        "passed": sum(r.status == "PASS" for r in results),
        "failed": len(fails),
        "skipped": sum(r.status == "SKIP" for r in results),
        "fixtures": len({r.fixture for r in mine}),
        "by_check": by,
        "failures": [r.line() for r in fails[:40]],
    }
    log(
        f"conformance: {out['passed']} passed, {out['failed']} failed, {out['skipped']} skipped; {out['triton_checks']} with {NAME}@{dt} over "
        f"{out['fixtures']} fixtures in {out['seconds']} s" + (f"; {left} checks not run (deadline)" if left else "")
    )
    for line in out["failures"][:10]:
        log("  " + line.replace("\n", "\n    "))
    return out


# -- 2. agreement at full size ----------------------------------------------------------------


def _same(a, b) -> bool:
    import torch

    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _storage_bytes(tensors):
    import torch

    out = []
    for t in tensors:
        st = t.untyped_storage()
        out.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,)).clone())
    return out


def agreement(main: bool = True, extras: bool = True) -> dict:
    """``main``: the benchmark geometries at full size; ``extras``: the multi-plane record
    and the partial last chunk."""
    import torch
    from kvcore_xpu import KERNEL

    import kvcore
    from kvcore.bench import block_slots, random_fill
    from kvcore.kernels import TransferPlan
    from kvcore.kernels.reference import REFERENCE

    dev = device()
    CASES = cases()
    res: dict = {"cases": [], "failures": []}

    def record(tag, ok, detail=""):
        res["cases"].append({"case": tag, "ok": bool(ok), "detail": detail})
        if not ok:
            res["failures"].append(tag)
        log(f"agreement {tag}: {'ok' if ok else 'MISMATCH'} {detail}")

    for label in ("NHD", "HND", "MLA-bf16") if main else ():
        case = CASES[label]
        for bs in (16, 64):
            T = BIG
            nblk = -(-T // bs)
            nb = 2 * nblk
            syn = kvcore.parse_format(case.format)
            shape = [{"TWO": 2, "NB": nb, "BS": bs, "NH": case.num_heads, "HS": case.head_size}[a] for a in syn.axes]
            caches = [random_fill(torch.empty(shape, dtype=case.storage_dtype, device=dev)) for _ in range(case.num_layers)]
            lay = kvcore.build_layout(case.format, caches)
            tb = lay.stride_table()
            slots = block_slots(T, bs, torch.randperm(nb)[:nblk]).to(dev)
            slots[::97] = -1
            nv = int((slots >= 0).sum())
            a = torch.empty(lay.staging_shape(T), dtype=lay.dtype, device=dev)
            a.view(torch.uint8).fill_(0xA5)
            b = a.clone()
            KERNEL.gather(TransferPlan(tb, slots, a, nv))
            REFERENCE.gather(TransferPlan(tb, slots, b, nv))
            ok_g = _same(a, b)
            ok_h = ok_p = True
            src = random_fill(torch.empty_like(a))
            stagings = [(KERNEL, src)]
            if not SMOKE:  # host staging of a CUDA cache: pinned (zero-copy) and pageable
                hp = torch.empty(lay.staging_shape(T), dtype=lay.dtype, pin_memory=True)
                hp.view(torch.uint8).fill_(0xA5)
                KERNEL.gather(TransferPlan(tb, slots, hp, nv))
                sync()
                ok_h = _same(hp, b.cpu())
                pg = torch.empty(lay.staging_shape(T), dtype=lay.dtype)
                pg.view(torch.uint8).fill_(0xA5)
                KERNEL.gather(TransferPlan(tb, slots, pg, nv))
                ok_p = _same(pg, b.cpu())
                del hp, pg
                stagings += [(KERNEL, src.cpu().pin_memory()), (KERNEL, src.cpu())]
            outs = []
            for kern, stg in stagings + [(REFERENCE, src)]:
                cc = [c.clone() for c in caches]
                ll = kvcore.build_layout(case.format, cc)
                kern.scatter(TransferPlan(ll.stride_table(), slots, stg, nv))
                sync()
                outs.append(torch.cat([c.view(torch.uint8).flatten() for c in cc]))
                del cc, ll
            ok_s = all(torch.equal(o, outs[-1]) for o in outs[:-1])
            record(
                f"{label} BS={bs} T={T}",
                ok_g and ok_h and ok_p and ok_s,
                f"gather device/pinned/pageable {ok_g}/{ok_h}/{ok_p}, scatter device/pinned/pageable {ok_s}",
            )
            del caches, a, b, src, outs
            if not SMOKE:
                torch.cuda.empty_cache()

    if not extras:
        return res
    # a multi-plane record: four planes of four widths and dtypes, one buffer each
    # (its table's device is torch.device("cuda"), no index: the current device)
    try:
        from kvcore.spec import Plane, PlaneStrides, StagingBuffer, StagingTarget, StrideTable

        NL, NB, BS, NH, hk, hv = (4, 64, 16, 8, 128, 64) if not SMOKE else (2, 8, 16, 2, 16, 8)
        gen = torch.Generator(device="cpu").manual_seed(0)

        def mk(shape, dtype):
            t = torch.empty(shape, dtype=dtype, device=dev)
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen).to(dev))
            return t

        k = [mk((NB, BS, NH, hk), torch.uint8) for _ in range(NL)]
        ks = [mk((NB, BS, NH), torch.float16) for _ in range(NL)]
        v = [mk((NB, NH, BS, hv), torch.bfloat16) for _ in range(NL)]
        vz = [mk((NB, NH, BS), torch.float32) for _ in range(NL)]

        def pl(role, st, hb, dt, ts, hs):
            return Plane(role, st, NH, hb, dt, tuple((t, 0) for t in ts), StagingTarget(role, None, 0, hs))

        planes = (
            pl("K", PlaneStrides(NH * hk * BS, NH * hk, hk, 0, hk, 1), hk, torch.uint8, k, hk),
            pl("KS", PlaneStrides(NH * 2 * BS, NH * 2, 2, 0, 2, 1), 2, torch.float16, ks, 2),
            pl("V", PlaneStrides(NH * BS * hv * 2, hv * 2, BS * hv * 2, 0, hv * 2, 1), hv * 2, torch.bfloat16, v, hv * 2),
            pl("VZ", PlaneStrides(NH * BS * 4, 4, BS * 4, 0, 4, 1), 4, torch.float32, vz, 4),
        )
        bufs = (
            StagingBuffer("K", None, NH * hk, torch.uint8),
            StagingBuffer("KS", None, NH * 2, torch.float16),
            StagingBuffer("V", None, NH * hv * 2, torch.bfloat16),
            StagingBuffer("VZ", None, NH * 4, torch.float32),
        )
        tb = StrideTable(NL, BS, NB * BS, dev, planes, bufs)
        T = 300 if not SMOKE else 30
        slots = torch.randperm(NB * BS, generator=gen)[:T].to(dev)
        slots[::7] = -1
        nv = int((slots >= 0).sum())

        def staging(fill):
            out = {}
            for b_ in bufs:
                x = torch.empty(b_.shape(NL, T), dtype=b_.dtype, device=dev)
                x.view(torch.uint8).fill_(fill)
                out[b_.key] = x
            return out

        g1, g2 = staging(0x5A), staging(0x5A)
        KERNEL.gather(TransferPlan(tb, slots, g1, nv))
        REFERENCE.gather(TransferPlan(tb, slots, g2, nv))
        ok_g = all(_same(g1[key], g2[key]) for key in g1)
        tensors = k + ks + v + vz
        before = _storage_bytes(tensors)
        src = staging(0)
        for x in src.values():
            x.view(torch.uint8).copy_(torch.randint(0, 256, x.view(torch.uint8).shape, dtype=torch.uint8, generator=gen).to(dev))
        uslots = slots.clone()
        KERNEL.scatter(TransferPlan(tb, uslots, src, nv))
        after_k = _storage_bytes(tensors)
        for t, b_ in zip(tensors, before):
            st = t.untyped_storage()
            torch.empty(0, dtype=torch.uint8, device=dev).set_(st, 0, (st.nbytes(),), (1,)).copy_(b_)
        REFERENCE.scatter(TransferPlan(tb, uslots, src, nv))
        ok_s = all(torch.equal(x, y) for x, y in zip(after_k, _storage_bytes(tensors)))
        record("multi-plane K/KS/V/VZ (uint8/fp16/bf16/fp32)", ok_g and ok_s, f"gather {ok_g}, scatter {ok_s}")
    except Exception:  # noqa: BLE001
        record("multi-plane", False, traceback.format_exc()[-1500:])

    # the partial last chunk through non-contiguous staging views
    try:
        os.environ["KVCORE_KERNEL"] = NAME
        case = CASES["NHD"]
        nb, bs, chunk, T = 64, 16, 16, 37
        caches = [random_fill(torch.empty((2, nb, bs, case.num_heads, case.head_size), dtype=case.dtype, device=dev)) for _ in range(2)]
        lay = kvcore.build_layout(case.format, caches)
        slots = torch.randperm(nb * bs)[:T].to(dev)
        os.environ["KVCORE_KERNEL"] = "reference"
        whole = kvcore.gather(lay, slots)
        os.environ["KVCORE_KERNEL"] = NAME
        buf = torch.empty(lay.staging_shape(chunk), dtype=case.dtype, device=dev)
        ok = True
        for start in range(0, T, chunk):
            n = min(chunk, T - start)
            buf.view(torch.uint8).fill_(0x5A)
            kvcore.gather(lay, slots[start : start + n], buf[:, :, :n])
            ok = ok and _same(buf[:, :, :n], whole[:, :, start : start + n]) and bool((buf[:, :, n:].view(torch.uint8) == 0x5A).all())
        record("partial last chunk NHD T=37 through [:, :, :n] views", ok)
    except Exception:  # noqa: BLE001
        record("partial last chunk", False, traceback.format_exc()[-1500:])
    finally:
        os.environ.pop("KVCORE_KERNEL", None)
    return res


# -- 3 and 4. tuning and benchmark ----------------------------------------------------------


def bench_one(label: str, bs: int, tokens: int, native, repeats: int, graphs: bool = True) -> list[dict]:
    import torch
    from kvcore_xpu import KERNEL

    import kvcore
    from kvcore.bench import _L2_ROTATE_BYTES, _graph_times, _median_times, block_slots, random_fill
    from kvcore.kernels import TransferPlan

    dev = device()
    case = cases()[label]
    gen = torch.Generator(device="cpu").manual_seed(0)
    syn = kvcore.parse_format(case.format)
    kv = 1 if "TWO" not in syn.axes else 2
    esz = torch.empty(0, dtype=case.dtype).element_size()
    payload = kv * case.num_layers * tokens * case.num_heads * case.head_size * esz
    nblk = -(-tokens // bs)
    sets = max(1, min(8, math.ceil(_L2_ROTATE_BYTES / payload)))
    nb = (sets + 1) * nblk
    per_layer = [{"TWO": 2, "NB": nb, "BS": bs, "NH": case.num_heads, "HS": case.head_size}[t] for t in syn.axes]
    caches = [random_fill(torch.empty(per_layer, dtype=case.storage_dtype, device=dev)) for _ in range(case.num_layers)]
    lay = kvcore.build_layout(case.format, caches, dtype=case.dtype if case.dtype != case.storage_dtype else None)
    table = lay.stride_table()
    perm = torch.randperm(nb, generator=gen)
    slot_sets = [block_slots(tokens, bs, perm[i * nblk : (i + 1) * nblk]).to(dev) for i in range(sets)]
    staging = [random_fill(torch.empty(lay.staging_shape(tokens), dtype=case.dtype, device=dev)) for _ in range(sets)]
    plans = [TransferPlan(table=table, slots=slot_sets[i], staging=staging[i], num_valid=tokens) for i in range(sets)]
    src = [random_fill(torch.empty(payload, dtype=torch.uint8, device=dev)) for _ in range(sets)]
    dst = [torch.empty(payload, dtype=torch.uint8, device=dev) for _ in range(sets)]
    fns = {"copy": lambda i: dst[i % sets].copy_(src[i % sets])}
    for d in ("gather", "scatter"):
        fns[f"triton-{d}"] = lambda i, d=d: getattr(KERNEL, d)(plans[i % sets])
        if native is not None:
            fns[f"native-{d}"] = lambda i, d=d: getattr(native, d)(plans[i % sets])
    calls = 2 if SMOKE else 20
    tm = _median_times(fns, dev, repeats, calls)
    gt = _graph_times(fns, dev, repeats, calls) if graphs and not SMOKE else {}
    host, slow = host_times(fns, sets, 2 if SMOKE else 100)
    rows = []
    for d in ("gather", "scatter"):
        row = {
            "layout": label,
            "dtype": str(case.dtype).replace("torch.", ""),
            "block_size": bs,
            "tokens": tokens,
            "direction": d,
            "mbytes": round(payload / 1e6, 2),
            "copy_us": round(tm["copy"] * 1e6, 2),
            "copy_gbps": round(2 * payload / tm["copy"] / 1e9, 1),
            "triton_us": round(tm[f"triton-{d}"] * 1e6, 2),
            "triton_gbps": round(2 * payload / tm[f"triton-{d}"] / 1e9, 1),
            "triton_vs_copy": round(tm["copy"] / tm[f"triton-{d}"], 4),
            # host time per call (launches queued, no synchronisation): what an eager call
            # costs the CPU; above the device time, the eager figure is the host's
            "triton_host_us": round(host[f"triton-{d}"] * 1e6, 2),
            "copy_host_us": round(host["copy"] * 1e6, 2),
            "triton_slow_path_calls": slow[f"triton-{d}"],
        }
        if native is not None:
            row["native_us"] = round(tm[f"native-{d}"] * 1e6, 2)
            row["native_vs_copy"] = round(tm["copy"] / tm[f"native-{d}"], 4)
            row["triton_vs_native"] = round(tm[f"native-{d}"] / tm[f"triton-{d}"], 4)
        if gt:
            row["graph_copy_us"] = round(gt["copy"] * 1e6, 2) if "copy" in gt else None
            row["graph_triton_us"] = round(gt[f"triton-{d}"] * 1e6, 2) if f"triton-{d}" in gt else None
            row["graph_triton_vs_copy"] = round(tm["copy"] / gt[f"triton-{d}"], 4) if f"triton-{d}" in gt else None
            if native is not None and f"native-{d}" in gt:
                row["graph_native_us"] = round(gt[f"native-{d}"] * 1e6, 2)
        target = 0.85 if tokens >= BIG else 0.70 if tokens <= SMALL else None
        if target is not None:
            row["target"] = target
            row["target_met"] = row["triton_vs_copy"] >= target
        rows.append(row)
    return rows


def host_times(fns: dict, sets: int, n: int) -> tuple[dict, dict]:
    """Seconds of host time per call of each function (``n`` calls, launches queued, one
    synchronisation after), and how many of the Triton kernel's calls took its checked
    (first-call) path instead of the launch cache."""
    from kvcore_xpu import KERNEL

    slow = {"n": 0}
    real = type(KERNEL)._run_checked

    def counting(plan, gather):
        slow["n"] += 1
        return real(KERNEL, plan, gather)

    host, slow_calls = {}, {}
    for k, fn in fns.items():
        for i in range(sets):  # every plan once: first calls are not timed
            fn(i)
        sync()
        KERNEL._run_checked = counting
        slow["n"] = 0
        try:
            t = time.perf_counter()
            for i in range(n):
                fn(i)
            host[k] = (time.perf_counter() - t) / n
        finally:
            del KERNEL._run_checked
        slow_calls[k] = slow["n"]
        sync()
    return host, slow_calls


def tune(native, repeats: int, combos=None) -> dict:
    from kvcore_xpu import kernel as km

    res = {}
    geoms = (("NHD", 16, BIG), ("HND", 16, BIG), ("MLA-bf16", 64, BIG), ("NHD", 16, SMALL), ("HND", 64, SMALL))
    best, best_score = (km._TILE_BYTES, km._NUM_WARPS), -1.0
    for tile, warps in combos or [(t, w) for t in (8192, 16384, 32768) for w in (4, 8)]:
        if True:
            km._TILE_BYTES, km._NUM_WARPS = tile, warps
            ratios = []
            for label, bs, t in geoms:
                for r in bench_one(label, bs, t, None, repeats, graphs=False):
                    ratios.append(r["triton_vs_copy"])
            score = sum(ratios) / len(ratios)
            res[f"tile={tile},warps={warps}"] = [round(x, 3) for x in ratios]
            log(f"tuning tile={tile} warps={warps}: mean vs copy {score:.3f} ({', '.join(f'{x:.2f}' for x in ratios)})")
            if score > best_score:
                best, best_score = (tile, warps), score
    km._TILE_BYTES, km._NUM_WARPS = best
    res["chosen"] = {"tile_bytes": best[0], "num_warps": best[1], "mean_vs_copy": round(best_score, 4)}
    log(f"tuning: chose tile={best[0]} warps={best[1]}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--quick", action="store_true", help="fewer examples and repeats, no tuning sweep")
    ap.add_argument("--skip-conformance", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--no-native", action="store_true", help="do not build the CUDA kernel for the comparison")
    ap.add_argument("--examples", type=int, default=None, help="hypothesis examples per agreement check (default 6, quick 3)")
    ap.add_argument("--smoke", action="store_true", help="check this script on CPU in Triton's interpreter, tiny sizes")
    ap.add_argument("--tune", default=None, help="tile sweep as TILExWARPS,... (default: the full sweep unless --quick)")
    ap.add_argument("--conformance-last", action="store_true", help="run the conformance suite after the benchmark")
    ap.add_argument("--conformance-triton-only", action="store_true", help="only the Triton kernel's conformance checks")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from start after which no further conformance check starts")
    args = ap.parse_args()
    global SMOKE, BIG, SMALL
    if args.smoke:
        SMOKE, BIG, SMALL = True, 40, 16
        os.environ["TRITON_INTERPRET"] = "1"
        args.no_native = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"ok": False}

    def save():
        (out / "triton_summary.json").write_text(json.dumps(summary, indent=1, default=str))

    import torch

    try:
        import triton

        tv = triton.__version__
    except Exception as e:  # noqa: BLE001
        tv = f"unavailable: {e}"
    summary["versions"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": tv,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "smoke": SMOKE,
    }
    log(f"versions: {summary['versions']}")
    if (not SMOKE and not torch.cuda.is_available()) or tv.startswith("unavailable"):
        summary["error"] = "needs a CUDA GPU and triton"
        save()
        return 1
    summary["plugins"] = register_repo_plugins()
    log(f"plugins: {summary['plugins']}")
    from kvcore_xpu import KERNEL

    summary["kernel"] = {"available": KERNEL.available(), "why": KERNEL.why()}
    native = None
    if not args.no_native:
        os.environ.setdefault("KVCORE_BUILD_DIR", "/tmp/kvcore_build")
        os.environ["KVCORE_BUILD_VERBOSE"] = "0"
        from kvcore.kernels import _build
        from kvcore.kernels.native import CUDA_KERNEL

        t = time.time()
        st = _build.load()
        summary["native_build"] = {"loaded": st.loaded, "cuda": st.cuda, "reason": st.reason, "seconds": round(time.time() - t, 1)}
        log(f"native build: {summary['native_build']}")
        native = CUDA_KERNEL if (st.loaded and st.cuda) else None
    save()
    ok = True
    examples = args.examples or (3 if args.quick else 6)

    def run_agreement(tag: str, **which) -> None:
        nonlocal ok
        try:
            res = agreement(**which)
            ok = ok and not res["failures"]
        except Exception:  # noqa: BLE001
            ok = False
            res = {"error": traceback.format_exc()[-3000:], "failures": [tag]}
            log(f"agreement ({tag}) raised:\n" + traceback.format_exc())
        summary.setdefault("agreement", {})[tag] = res
        save()

    def run_conformance() -> None:
        nonlocal ok
        deadline = T0 + args.deadline if args.deadline else None
        try:
            summary["conformance"] = conformance(examples, deadline, args.conformance_triton_only)
            ok = ok and summary["conformance"]["failed"] == 0 and summary["conformance"]["triton_checks"] > 0
        except Exception:  # noqa: BLE001
            ok = False
            summary["conformance"] = {"error": traceback.format_exc()[-3000:]}
            log("conformance raised:\n" + traceback.format_exc())
        save()

    # the order keeps the benchmark's figures safe: the geometries it moves are checked
    # first, then timed; the other checks follow (a device fault there cannot lose them)
    if not args.skip_conformance and not args.conformance_last:
        run_conformance()
    run_agreement("benchmark geometries", main=True, extras=False)
    if not args.skip_bench:
        repeats = 1 if SMOKE else 3 if args.quick else 7
        try:
            combos = [tuple(int(x) for x in c.split("x")) for c in args.tune.split(",")] if args.tune else None
            if (combos or not args.quick) and not SMOKE:
                summary["tuning"] = tune(native, 3, combos)
                save()
            rows = []
            for label in ("NHD", "HND", "MLA-bf16"):
                for bs in (16, 64):
                    for t in (SMALL, BIG):
                        rows += bench_one(label, bs, t, native, repeats)
                        if not SMOKE:
                            torch.cuda.empty_cache()
                        for r in rows[-2:]:
                            log(
                                f"bench {r['layout']} BS={r['block_size']} T={r['tokens']} {r['direction']}: triton {r['triton_gbps']} GB/s = "
                                f"{100 * r['triton_vs_copy']:.1f}% of copy_ ({r['copy_gbps']} GB/s)"
                                + (f", native {100 * r['native_vs_copy']:.1f}%" if "native_vs_copy" in r else "")
                                + (f"; graph {100 * r['graph_triton_vs_copy']:.1f}%" if r.get("graph_triton_vs_copy") else "")
                                + f"; host {r['triton_host_us']} us/call (copy_ {r['copy_host_us']}), slow path {r['triton_slow_path_calls']}"
                            )
                        (out / "triton_bench.json").write_text(json.dumps({"versions": summary["versions"], "rows": rows}, indent=1))
            met = [r for r in rows if r.get("target_met")]
            missed = [
                f"{r['layout']} BS={r['block_size']} T={r['tokens']} {r['direction']}: {100 * r['triton_vs_copy']:.1f}%"
                for r in rows
                if r.get("target_met") is False
            ]
            summary["bench"] = {"rows": len(rows), "targets_met": len(met), "targets_missed": missed}
            log(f"targets: {len(met)} of {len(rows)} met; missed: {missed}")
        except Exception:  # noqa: BLE001
            summary["bench"] = {"error": traceback.format_exc()[-3000:]}
            log("bench raised:\n" + traceback.format_exc())
        save()
    run_agreement("multi-plane and partial chunk", main=False, extras=True)
    if not args.skip_conformance and args.conformance_last:
        run_conformance()
    summary["ok"] = ok
    summary["seconds"] = round(time.time() - T0, 1)
    save()
    log(f"done: ok={ok} in {summary['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
