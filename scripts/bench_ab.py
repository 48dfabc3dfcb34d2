"""A/B: ``kvcore bench`` of two source trees, case by case, in one run.

Usage::

    python scripts/bench_ab.py --base /path/to/other/checkout [--device cpu] \\
        [--layouts NHD,HND] [--block-sizes 16] [--tokens 256,2048] [--rounds 2] [--out ab.json]

For every case it runs the base tree's bench and this tree's bench in turn (base, new, new,
base, ... ``--rounds`` times each, in separate processes with separate native build
directories), so drift of a shared machine affects both alike, and prints per case the
median GB/s of each and the ratio new / base, for gather and scatter (the kernel entry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(tree: Path, build: str, device: str, layout: str, bs: int, tokens: int, repeats: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=str(tree), KVCORE_BUILD_DIR=build)
    cmd = [sys.executable, "-m", "kvcore.bench", "--device", device, "--layouts", layout, "--block-sizes", str(bs)]
    cmd += ["--tokens", str(tokens), "--repeats", str(repeats), "--no-reference", "--no-host", "--output", out]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = json.loads(Path(out).read_text())["rows"]
    os.unlink(out)
    return {r["direction"]: (r["gbps"], r["vs_copy"]) for r in rows if r["staging"] == "device"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layouts", default="NHD,HND,FlashInfer,MLA-bf16,MLA-fp8")
    ap.add_argument("--block-sizes", default="16")
    ap.add_argument("--tokens", default="256,2048")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    trees = {"base": (Path(a.base).resolve(), "/tmp/kvbuild-ab-base"), "new": (ROOT, "/tmp/kvbuild-ab-new")}
    results = []
    print("| layout | BS | T | direction | base GB/s | new GB/s | new/base | base vs copy | new vs copy |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for lay in a.layouts.split(","):
        for bs in (int(x) for x in a.block_sizes.split(",")):
            for t in (int(x) for x in a.tokens.split(",")):
                samples: dict = {"base": [], "new": []}
                order = ["base", "new", "new", "base"] * a.rounds
                for which in order[: 2 * a.rounds]:
                    tree, build = trees[which]
                    samples[which].append(one(tree, build, a.device, lay, bs, t, a.repeats))
                for d in ("gather", "scatter"):
                    b = statistics.median(s[d][0] for s in samples["base"])
                    n = statistics.median(s[d][0] for s in samples["new"])
                    bc = statistics.median(s[d][1] for s in samples["base"])
                    nc = statistics.median(s[d][1] for s in samples["new"])
                    results.append(
                        {"layout": lay, "bs": bs, "tokens": t, "direction": d, "base": b, "new": n, "base_vs_copy": bc, "new_vs_copy": nc}
                    )
                    print(f"| {lay} | {bs} | {t} | {d} | {b:.1f} | {n:.1f} | {n / b:.3f} | {100 * bc:.1f}% | {100 * nc:.1f}% |", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
