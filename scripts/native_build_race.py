"""Two processes make the first use of kvcore's native op library at once, on a fresh cache.

Usage (from the repository root; on a GPU machine this builds the CUDA op too)::

    python3 scripts/native_build_race.py [--out OUTDIR] [--procs 2]

Each process calls ``kvcore.kernels._build.load()`` at the same moment with
``KVCORE_BUILD_DIR`` pointing at an empty folder. Expected: every process loads the library
(``loaded``; ``cuda`` where torch has CUDA and nvcc is found), exactly one says
"compiling", the others say "waiting" or nothing, the cache holds one entry and no
temporary folder, and a process started afterwards loads without compiling. Writes
``build_race.json`` into OUTDIR (default: $OUT, else the current folder); exit 0 when all
of that held.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, time
t = time.time()
from kvcore.kernels import _build
st = _build.load()
print(json.dumps({"loaded": st.loaded, "cuda": st.cuda, "reason": st.reason, "seconds": round(time.time() - t, 1)}))
"""


def _run_all(n: int, env: dict) -> list[dict]:
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=1800)
        row = json.loads(o.strip().splitlines()[-1]) if p.returncode == 0 and o.strip() else {"loaded": False, "error": e[-2000:]}
        row["rc"], row["stderr"] = p.returncode, e.strip()
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="kvcore-build-race-"))
    env = {**os.environ, "KVCORE_BUILD_DIR": str(cache)}
    t0 = time.time()
    first = _run_all(args.procs, env)
    later = _run_all(1, env)
    entries = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    compiled = sum("kvcore: compiling" in r["stderr"] for r in first)
    ok = (
        all(r.get("loaded") for r in first + later)
        and compiled == 1
        and "compiling" not in later[0]["stderr"]
        and len(entries) == 1
        and not any(".building-" in e for e in entries)
    )
    report = {
        "ok": ok,
        "cache": str(cache),
        "entries": entries,
        "compiled": compiled,
        "first": first,
        "later": later,
        "seconds": round(time.time() - t0, 1),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "build_race.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({k: report[k] for k in ("ok", "entries", "compiled", "seconds")}))
    for r in first + later:
        print(f"  loaded={r.get('loaded')} cuda={r.get('cuda')} {r.get('seconds')}s  {r['stderr'][:200]!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
