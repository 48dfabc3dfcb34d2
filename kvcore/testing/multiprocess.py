"""Run one function on several processes joined by ``torch.distributed`` (tests, demos, benchmarks).

``run_ranks("pkg.module:function", world_size=2)`` starts ``world_size`` fresh processes
(``spawn``), joins them in a process group (Gloo by default; NCCL for GPU runs, one GPU
per rank), and calls ``function(rank, world_size, *args)`` in each. The target is named by
a dotted path or by a file (``"/path/to/file.py:function"``), so functions in test files
imported by pytest's ``importlib`` mode can run too.

Returns one :class:`RankResult` per rank: its exit code, its return value (pickled back
through a file) or the traceback of what it raised. A rank that exits early (a test
simulating a peer that dies) simply has no value. Ranks still running after ``timeout``
seconds are killed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["run_ranks", "RankResult", "load_target"]


@dataclass
class RankResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def load_target(target: str):
    """``"pkg.mod:fn"`` or ``"/path/file.py:fn"`` -> the function."""
    mod_name, _, fn = target.rpartition(":")
    if not mod_name or not fn:
        raise ValueError(f"target must be 'module:function' or 'file.py:function', got {target!r}")
    if mod_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_kvcore_rank_target_{Path(mod_name).stem}", mod_name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(mod_name)
    return getattr(mod, fn)


def _child(rank: int, world: int, target: str, args: tuple, backend: str, init_file: str, out_dir: str, env: dict, pg_timeout: float):
    os.environ.update(env)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("KVCORE_RANK_THREADS", "1"))))
    if backend == "nccl":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        value = load_target(target)(rank, world, *args)
        out.write_bytes(pickle.dumps(("ok", value)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise SystemExit(1) from None
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer may already be gone
        pass


def run_ranks(
    target: str,
    world_size: int = 2,
    *,
    args: tuple = (),
    backend: str = "gloo",
    timeout: float = 120.0,
    env: dict | None = None,
    pg_timeout: float = 60.0,
) -> list[RankResult]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` processes; see the module docstring."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvcore-ranks-") as tmp:
        init_file = os.path.join(tmp, "init")
        env = dict(env or {})
        procs = [
            ctx.Process(target=_child, args=(r, world_size, target, args, backend, init_file, tmp, env, pg_timeout), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(5)
                results.append(RankResult(r, None, error=f"rank {r} still running after {timeout:g} s: killed"))
                continue
            f = Path(tmp) / f"rank{r}.pkl"
            if f.exists():
                kind, val = pickle.loads(f.read_bytes())
                results.append(RankResult(r, p.exitcode, value=val if kind == "ok" else None, error=val if kind == "error" else None))
            else:
                results.append(RankResult(r, p.exitcode))
        return results
