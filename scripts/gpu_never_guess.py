"""GPU check of issue 16's transfer-side change: layers that share memory (``layout.aliases``)
on CUDA, with the native CUDA kernel and the reference kernel.

What it proves on a CUDA device (the CPU suite proves the same for the CPU kernels):

* detection keeps one layer per entry for KV-sharing layers (``[a, b, a]`` -> 3 layers,
  ``aliases == {2: 0}``);
* gather returns the shared memory's values for every layer that has it;
* scatter writes shared memory once, from the first of its layers in the selection (the
  transfer splits the selection into runs, each a strided slice of the staging buffer,
  so the kernels see a staging tensor whose layer stride skips rows);
* an fp8 cache stored as uint8 on a CUDA (not ROCm) build reads as ``float8_e4m3fn``: the
  platform evidence is this process's torch build.

Usage (repository root, GPU machine)::

    python3 scripts/gpu_never_guess.py            # writes $OUT/gpu_never_guess.json (or ./)

Exit code 0 when every check passed on every kernel that serves CUDA.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    import kvcore
    from kvcore.kernels import select_kernel

    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": None, "checks": []}
    if not torch.cuda.is_available():
        results["error"] = "no CUDA device"
        (out_dir / "gpu_never_guess.json").write_text(json.dumps(results, indent=2))
        print("no CUDA device")
        return 1
    dev = torch.device("cuda")
    results["device"] = torch.cuda.get_device_name(0)
    ok = True

    def record(name: str, passed: bool, detail: str = "") -> None:
        nonlocal ok
        ok &= passed
        results["checks"].append({"check": name, "passed": passed, "detail": detail})
        print(("PASS " if passed else "FAIL ") + name + (f": {detail}" if detail else ""), flush=True)

    nb, bs, nh, hs = 64, 16, 8, 128
    a = torch.randn(2, nb, bs, nh, hs, device=dev).to(torch.bfloat16)
    b = torch.randn(2, nb, bs, nh, hs, device=dev).to(torch.bfloat16)
    lay = kvcore.detect({"l0": a, "l1": b, "l2": a}, "vllm", {"kv_cache_layout": "NHD", "vllm_version": "0.11"})
    record("aliases", (lay.num_layers, lay.aliases) == (3, {2: 0}), f"{lay.num_layers} layers, aliases {lay.aliases}")
    slots = torch.randperm(nb * bs, device=dev)[:300]
    for kernel_name in ("native-cuda", "reference"):
        os.environ["KVCORE_KERNEL"] = kernel_name
        try:
            select_kernel("cuda", lay.format.name, "cuda")
        except kvcore.TransferError as e:
            record(f"{kernel_name}: available", False, str(e))
            continue
        g = kvcore.gather(lay, slots)
        same = torch.equal(g[:, 0], g[:, 2]) and not torch.equal(g[:, 0], g[:, 1])
        want0 = a.view(2, nb * bs, nh * hs)[:, slots]
        record(f"{kernel_name}: gather of shared memory", same and torch.equal(g[:, 0], want0))
        src = torch.stack([torch.full((2, len(slots), nh * hs), float(v), device=dev) for v in (1, 2, 3)], 1).to(torch.bfloat16)
        kvcore.scatter(lay, slots, src)
        rows_a = a.view(2, nb * bs, nh * hs)[:, slots]
        rows_b = b.view(2, nb * bs, nh * hs)[:, slots]
        record(f"{kernel_name}: scatter writes shared memory once", bool((rows_a == 1).all() and (rows_b == 2).all()))
        kvcore.scatter(lay, slots, src[:, [2, 1]], layers=[2, 1])
        record(f"{kernel_name}: the first layer of the selection wins", bool((a.view(2, nb * bs, nh * hs)[:, slots] == 3).all()))
    os.environ.pop("KVCORE_KERNEL", None)
    fp8 = torch.zeros(nb, 2, bs, nh, hs, dtype=torch.uint8, device=dev).fill_(0x40)
    hints = {"vllm_version": "0.24", "attention_backend": "FLASHINFER", "kv_cache_layout": "NHD", "cache_dtype": "fp8"}
    try:
        fl = kvcore.detect([fp8], "vllm", hints)
        v = kvcore.gather(fl, torch.tensor([0], device=dev)).float().unique().tolist()
        want = torch.float8_e4m3fnuz if getattr(torch.version, "hip", None) else torch.float8_e4m3fn
        record("fp8 element dtype from the platform", fl.dtype == want, f"{fl.dtype}, 0x40 reads {v}")
    except kvcore.KVCoreError as e:
        record("fp8 element dtype from the platform", False, f"{type(e).__name__}: {e}")
    results["passed"] = ok
    (out_dir / "gpu_never_guess.json").write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
