"""Measure the native CPU kernel's thread grain: one thread vs every thread, by size.

Usage::

    python scripts/cpu_grain.py [--repeats 9] [--load N]

For Llama-3-8B NHD (32 layers, 8 KV heads x 128, bf16, block 16) gathers and scatters of
8 ... 4096 tokens (1 MB ... 1 GB), it times the native kernel with the grain forced to one
thread and forced to all threads (``set_cpu_grain``), the two taking turns, and prints the
median ms and the ratio. ``--load N`` starts N busy processes for the duration (a serving
host's engine threads keep the cores busy); they are stopped by process id at the end.
The crossover is where ``torch.get_num_threads()`` threads start to pay for waking the pool.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _spin(stop) -> None:  # pragma: no cover - a load generator
    x = 0
    while not stop.is_set():
        x += 1


def main() -> int:
    import torch

    import kvcore
    from kvcore.bench import CASES, _setup, block_slots
    from kvcore.kernels import TransferPlan
    from kvcore.kernels.native import CPU_KERNEL, _ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--load", type=int, default=0)
    ap.add_argument("--tokens", default="8,16,32,64,128,256,1024,4096")
    a = ap.parse_args()
    mod = _ops()
    default = mod.cpu_grain()
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.load)]
    for p in procs:
        p.start()
    try:
        case = CASES["NHD"]
        dev = torch.device("cpu")
        print(f"# {torch.get_num_threads()} threads, load generators {a.load}, kvcore {kvcore.__version__}")
        print("| T | MB | direction | 1 thread ms | all threads ms | all / 1 |")
        print("| ---: | ---: | --- | ---: | ---: | ---: |")
        for t in (int(x) for x in a.tokens.split(",")):
            nb = max(8, 2 * (-(-t // 16)))
            lay, table, new_staging = _setup(case, 16, nb, dev)
            slots = block_slots(t, 16, torch.randperm(nb)[: -(-t // 16)])
            plan = TransferPlan(table, slots, new_staging(t, dev), t)
            mb = t * 32 * 2 * 8 * 128 * 2 / 1e6
            calls = max(1, int(50e6 / (mb * 1e6)))
            for d in ("gather", "scatter"):
                fn = getattr(CPU_KERNEL, d)
                samples = {1: [], 2: []}
                for _ in range(a.repeats):
                    for which, grain in ((1, 1 << 62), (2, 1)):
                        mod.set_cpu_grain(grain)
                        fn(plan)
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            fn(plan)
                        samples[which].append((time.perf_counter() - t0) / calls)
                one, many = statistics.median(samples[1]), statistics.median(samples[2])
                print(f"| {t} | {mb:.1f} | {d} | {one * 1e3:.3f} | {many * 1e3:.3f} | {many / one:.2f} |", flush=True)
            del lay, table, plan
    finally:
        mod.set_cpu_grain(default)
        stop.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
