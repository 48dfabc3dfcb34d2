"""GPU check of multi-plane records (branch planes): run on a CUDA machine.

    python scripts/planes_gpu_check.py            # writes $OUT/planes_gpu.json (or ./planes_gpu.json)
    PLANES_DEVICE=cpu python scripts/planes_gpu_check.py   # the same on the CPU (a dry run)

For each case it allocates an engine-shaped cache on the GPU, fills it with random bits,
and checks gather (device staging, and pinned host staging) and scatter against views of
the engine-shaped tensors built by plain indexing, with every kernel that serves the
layout (``native-cuda`` takes the classic ROCm split-K table; per-plane staging goes to the
reference kernel), then the conformance-style refusals (a plane missing from a staging dict,
a plane of the wrong dtype) leave the cache byte-identical.

Cases: ROCm split K ``K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS`` (classic staging),
int8 K/V with bf16 per-token-head scales and zeros (per-plane staging), K and V of
different widths, token groups (``V=NL_X_NB_NH_BSC_HS_BSE``). Exit status 1 on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import kvcore

NL, NB, BS, NH, HS = 4, 64, 16, 8, 128


def cases(dev):
    bf = torch.bfloat16
    x = 8
    out = {}
    k = [torch.zeros(NB, NH, HS // x, BS, x, dtype=bf, device=dev) for _ in range(NL)]
    v = [torch.zeros(NB, NH, HS, BS, dtype=bf, device=dev) for _ in range(NL)]
    out["rocm_split_k"] = (
        "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS",
        {"K": k, "V": v},
        lambda kv, r, li, s: kv["K"][li][s // BS, :, :, s % BS, :] if r == "K" else kv["V"][li][s // BS, :, :, s % BS],
    )
    q = {r: [torch.zeros(NB, BS, NH, HS, dtype=torch.int8, device=dev) for _ in range(NL)] for r in ("K", "V")}
    for r in ("KS", "KZ", "VS", "VZ"):
        q[r] = [torch.zeros(NB, BS, NH, dtype=bf, device=dev) for _ in range(NL)]
    out["int8_scales_zeros"] = (
        "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH+KZ=NL_X_NB_BS_NH+VS=NL_X_NB_BS_NH+VZ=NL_X_NB_BS_NH",
        q,
        lambda kv, r, li, s: kv[r][li][s // BS, s % BS],
    )
    w = {
        "K": [torch.zeros(NB, NH, BS, 192, dtype=bf, device=dev) for _ in range(NL)],
        "V": [torch.zeros(NB, BS, NH, 128, dtype=bf, device=dev) for _ in range(NL)],
    }
    out["different_widths"] = (
        "K=NL_X_NB_NH_BS_HS+V=NL_X_NB_BS_NH_HS",
        w,
        lambda kv, r, li, s: kv["K"][li][s // BS, :, s % BS] if r == "K" else kv["V"][li][s // BS, s % BS],
    )
    g = {
        "K": [torch.zeros(NB, NH, HS // x, BS, x, dtype=bf, device=dev) for _ in range(NL)],
        "V": [torch.zeros(NB, NH, BS // x, HS, x, dtype=bf, device=dev) for _ in range(NL)],
    }
    out["token_groups"] = (
        "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_BSC_HS_BSE",
        g,
        lambda kv, r, li, s: kv["K"][li][s // BS, :, :, s % BS, :] if r == "K" else kv["V"][li][s // BS, :, (s % BS) // x, :, (s % BS) % x],
    )
    return out


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _bytes(t):
    return t.contiguous().view(torch.uint8).reshape(-1).cpu()


def _row(st, info, li, i):
    return st[info.staging_index, li, i] if info.staging_index is not None else st[info.role][li, i]


def main() -> int:
    if not torch.cuda.is_available() and "PLANES_DEVICE" not in os.environ:
        print("no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(os.environ.get("PLANES_DEVICE", "cuda:0"))
    report, ok = {}, True
    for name, (fmt, kv, row) in cases(dev).items():
        for t in [t for ts in kv.values() for t in ts]:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, device=dev))
        lay = kvcore.build_layout(fmt, kv)
        slots = torch.randperm(NB * BS, device=dev)[:777]
        slots[::50] = -1
        res = {"classic_staging": lay.classic_staging, "staging": {k: list(v) for k, v in lay.staging_shapes(777).items()}}
        kernel = kvcore.kernels.select_kernel(dev.type, fmt, dev.type, table=lay.stride_table()).name
        res["kernel"] = kernel
        for where in ("device", "pinned"):
            out = lay.allocate_staging(
                777, device="cpu" if where == "pinned" else None, pin_memory=where == "pinned" and dev.type == "cuda"
            )
            kvcore.gather(lay, slots, out)
            _sync(dev)
            bad = 0
            sl = slots.tolist()
            for info in lay.planes:
                for li in range(NL):
                    for i, s in enumerate(sl[:200]):
                        if s >= 0 and not torch.equal(_bytes(_row(out, info, li, i)), _bytes(row(kv, info.role, li, s))):
                            bad += 1
            res[f"gather_{where}_mismatches"] = bad
            ok &= bad == 0
        # scatter: write staged rows into other slots, read back through the engine's views
        src = lay.allocate_staging(200)
        for b in [src] if isinstance(src, torch.Tensor) else src.values():
            b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, device=dev))
        dst = torch.randperm(NB * BS, device=dev)[:200]
        kvcore.scatter(lay, dst, src)
        _sync(dev)
        bad = 0
        for info in lay.planes:
            for li in range(NL):
                for i, s in enumerate(dst.tolist()):
                    if not torch.equal(_bytes(_row(src, info, li, i)), _bytes(row(kv, info.role, li, s))):
                        bad += 1
        res["scatter_mismatches"] = bad
        ok &= bad == 0
        if not lay.classic_staging:
            before = [t.clone() for ts in kv.values() for t in ts]
            st = lay.allocate_staging(4)
            st.pop(next(iter(st)))
            try:
                kvcore.scatter(lay, [0, 1, 2, 3], st)
                res["missing_plane"] = "accepted (BUG)"
                ok = False
            except kvcore.TransferError as e:
                res["missing_plane"] = f"refused: {str(e)[:80]}"
            same = all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(before, [t for ts in kv.values() for t in ts]))
            res["cache_unchanged_after_refusal"] = same
            ok &= same
        report[name] = res
        print(name, json.dumps(res))
    path = os.path.join(os.environ.get("OUT", "."), "planes_gpu.json")
    with open(path, "w") as f:
        json.dump({"ok": ok, "cases": report, "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else str(dev)}, f, indent=1)
    print("OK" if ok else "MISMATCH", "->", path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
