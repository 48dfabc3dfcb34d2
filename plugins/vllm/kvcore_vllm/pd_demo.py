"""``kvcore demo --engine vllm --pd``: prefill/decode disaggregation between two processes.

Rank 0 is a prefill engine, rank 1 a decode engine; they talk through ``torch.distributed``
(Gloo between CPU processes; NCCL between two GPUs with ``--device cuda``):

==========  ==================================================================================
prefill     Llama-3-8B geometry (32 layers, 8 KV heads, head size 128, bf16), TP 1, vLLM
            0.11.0 FlashAttention **NHD**, block size **16**:
            ``(2, num_blocks, block_size, num_kv_heads, head_size)``
            (``vllm/v1/attention/backends/flash_attn.py::FlashAttentionBackend.get_kv_cache_shape``)
decode      the same model at **TP 2**: two caches of 4 KV heads each (one per decode rank,
            both held by rank 1 here), FlashAttention **HND** (stride order ``(0, 1, 3, 2, 4)``,
            ``flash_attn.py::get_kv_cache_stride_order`` with ``VLLM_KV_CACHE_LAYOUT=HND``),
            block size **32**
==========  ==================================================================================

Both caches are allocated exactly as vLLM does (``kvcore_vllm.fixtures.allocate``). The
prefill cache is written through vLLM's own per-layer K/V views (``fixtures.kv_view``) with
bit patterns that encode (layer, K/V, slot, head, element); the decode caches start zeroed.
Both sides ``kvcore.detect`` their caches; then, per request (mixed lengths, shuffled block
tables, one request ending in padding slots), rank 0 calls ``kvcore.send(layout, slots, 1,
heads=(4*r, 4*r + 4))`` for decode rank r and rank 1 ``kvcore.recv`` into rank r's cache: the
NHD -> HND, block 16 -> 32 and TP 1 -> 2 conversions happen inside the transfer.

Verification (rank 1), every byte, through vLLM's views of the decode caches: each slot a
request landed in holds the encoding of (layer, K/V, the prefill slot of that token, the
*global* head ``4*r + h``, element); every other slot is still zero.

Exit code 0 when every check passed, 1 on a mismatch or a failed rank, 2 on bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from kvcore.cli_args import OneLineParser, float_range, int_range

__all__ = ["run", "prefill_cache", "decode_caches", "verify"]

VERSION = "0.11.0"
BACKEND = "FLASH_ATTN"
NUM_LAYERS, NUM_HEADS, HEAD_SIZE = 32, 8, 128
PREFILL_BS, DECODE_BS, DECODE_TP = 16, 32, 2


def _decode_blocks(num_blocks: int) -> int:
    """Decode blocks of 32 per TP rank: room for every request, plus slack that must stay untouched."""
    return -(-num_blocks * PREFILL_BS // DECODE_BS) + 4


def _requests(num_blocks: int, seed: int) -> list[dict[str, Any]]:
    """Token counts and slot mappings on both sides: prefill blocks of 16 from a shuffled pool,
    decode blocks of 32 from another shuffled pool; the last request ends in padding slots."""
    g = torch.Generator().manual_seed(seed)
    cap = num_blocks * PREFILL_BS
    lengths = [cap * 3 // 8, cap // 4 + 7, cap // 8 - 5, 37]
    pads = [0, 0, 0, 3]
    p_perm = torch.randperm(num_blocks, generator=g).tolist()
    d_blocks = _decode_blocks(num_blocks)
    d_perm = torch.randperm(d_blocks, generator=g).tolist()
    out, pi, di = [], 0, 0
    for n, pad in zip(lengths, pads):
        pb = -(-n // PREFILL_BS)
        db = -(-n // DECODE_BS)
        t = torch.arange(n)
        ptab = torch.tensor(p_perm[pi : pi + pb])
        dtab = torch.tensor(d_perm[di : di + db])
        pi, di = pi + pb, di + db
        ps = ptab[t // PREFILL_BS] * PREFILL_BS + t % PREFILL_BS
        ds = dtab[t // DECODE_BS] * DECODE_BS + t % DECODE_BS
        if pad:
            ps = torch.cat([ps, torch.full((pad,), -1)])
            ds = torch.cat([ds, torch.full((pad,), -1)])
        out.append({"tokens": n, "padding": pad, "prefill_slots": ps, "decode_slots": ds})
    return out


def _ensure_plugin() -> None:
    """Register this plugin when it was not found through its entry point (the package is on
    ``PYTHONPATH`` but not installed, as on a bare GPU machine)."""
    import kvcore

    if not any(p.name == "vllm" and not getattr(p, "error", None) for p in kvcore.plugins()):
        from kvcore_vllm import plugin

        kvcore.register_plugin(plugin, name="vllm")


def prefill_cache(num_blocks: int, device, enc):
    """The prefill engine's cache (NHD, block 16, 8 heads), every slot written through vLLM's views
    with the encoding of (layer, K/V, slot, head, element). Returns ``(kv_caches, layout)``."""
    import kvcore
    from kvcore_vllm import fixtures

    caches = fixtures.allocate(
        VERSION, BACKEND, "NHD", num_layers=NUM_LAYERS, num_blocks=num_blocks, block_size=PREFILL_BS,
        num_kv_heads=NUM_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    slots = torch.arange(num_blocks * PREFILL_BS, device=device)
    for layer in range(NUM_LAYERS):
        for kv in range(2):
            enc.encode(layer, kv, slots, out=fixtures.kv_view(caches, layer, kv).view(enc.int_dtype))
    hints = {"attention_backend": BACKEND, "vllm_version": VERSION, "kv_cache_layout": "NHD"}
    _ensure_plugin()
    return caches, kvcore.detect(caches, "vllm", hints)


def decode_caches(num_blocks: int, device) -> list:
    """The decode engine's caches, one per TP rank (HND, block 32, 4 heads), zeroed.
    Returns ``[(kv_caches, layout), ...]``."""
    import kvcore
    from kvcore_vllm import fixtures

    _ensure_plugin()
    out = []
    for _tp in range(DECODE_TP):
        c = fixtures.allocate(
            VERSION, BACKEND, "HND", num_layers=NUM_LAYERS, num_blocks=_decode_blocks(num_blocks), block_size=DECODE_BS,
            num_kv_heads=NUM_HEADS // DECODE_TP, head_size=HEAD_SIZE, dtype=torch.bfloat16, device=device,
        )  # fmt: skip
        hints = {"attention_backend": BACKEND, "vllm_version": VERSION, "kv_cache_layout": "HND"}
        out.append((c, kvcore.detect(c, "vllm", hints)))
    return out


def verify(decode: list, reqs: list[dict], enc, num_blocks: int, device) -> tuple[list[str], int]:
    """Every element of every decode cache, read through vLLM's views: a slot a request landed in
    holds the encoding of (layer, K/V, the token's prefill slot, global head ``tp*4 + h``,
    element); every other slot is zero. Returns ``(errors, elements checked)``."""
    from kvcore_vllm import fixtures

    h = NUM_HEADS // DECODE_TP
    nslots = _decode_blocks(num_blocks) * DECODE_BS
    src = torch.cat([r["prefill_slots"] for r in reqs])
    dst = torch.cat([r["decode_slots"] for r in reqs])
    keep = (src >= 0) & (dst >= 0)
    src, dst = src[keep].to(device), dst[keep].to(device)
    errors, checked = [], 0
    for tp, (caches, _) in enumerate(decode):
        for layer in range(NUM_LAYERS):
            for kv in range(2):
                got = fixtures.kv_view(caches, layer, kv).view(enc.int_dtype).reshape(nslots, h, HEAD_SIZE)
                want = torch.zeros_like(got)
                want[dst] = enc.encode(layer, kv, src)[:, tp * h : tp * h + h]
                checked += got.numel()
                if not torch.equal(got, want):
                    bad = torch.nonzero(got != want)[0].tolist()
                    s = bad[0]
                    what = "a landed slot" if bool((dst == s).any()) else "a slot no request uses (must stay zero)"
                    errors.append(
                        f"decode rank {tp} layer {layer} {'KV'[kv]}: {int((got != want).sum())} wrong values; first at slot {s} "
                        f"({what}), head {bad[1]} (global {tp * h + bad[1]}), element {bad[2]}: got {int(got[tuple(bad)])}, "
                        f"expected {int(want[tuple(bad)])}"
                    )
    return errors, checked


def _rank_main(rank: int, world: int, opts: dict) -> dict:
    import kvcore
    from kvcore_vllm.demo import Encoder

    dev = torch.device(f"cuda:{rank}") if opts["device"] == "cuda" else torch.device("cpu")
    reqs = _requests(opts["num_blocks"], opts["seed"])
    enc = Encoder(torch.bfloat16, NUM_HEADS, HEAD_SIZE, dev)
    rec: dict[str, Any] = {"rank": rank, "device": str(dev)}
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    h = NUM_HEADS // DECODE_TP
    if rank == 0:
        _, layout = prefill_cache(opts["num_blocks"], dev, enc)
        rec.update(format=layout.format.name, describe=layout.describe())
        sync()
        t0 = time.perf_counter()
        moved = 0
        for r in reqs:
            for tp in range(DECODE_TP):
                kvcore.send(layout, r["prefill_slots"], 1, heads=(tp * h, tp * h + h), chunk_bytes=opts["chunk_bytes"])
                moved += r["tokens"] * NUM_LAYERS * 2 * h * HEAD_SIZE * 2
        sync()
        rec["seconds"] = time.perf_counter() - t0
        rec["bytes"] = moved
        return rec
    decode = decode_caches(opts["num_blocks"], dev)
    rec.update(format=decode[0][1].format.name, describe=decode[0][1].describe())
    sync()
    t0 = time.perf_counter()
    for r in reqs:
        for tp in range(DECODE_TP):
            kvcore.recv(decode[tp][1], r["decode_slots"], 0)
    sync()
    rec["seconds"] = time.perf_counter() - t0
    rec["errors"], rec["elements_checked"] = verify(decode, reqs, enc, opts["num_blocks"], dev)
    rec["verified"] = not rec["errors"]
    return rec


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="kvcore demo --engine vllm --pd",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prefill (vLLM NHD, TP 1, block 16) -> decode (vLLM HND, TP 2, block 32) over torch.distributed between two "
        "processes, with kvcore.send / kvcore.recv; every byte verified through vLLM's views.",
        epilog="examples:\n  kvcore demo --engine vllm --pd\n  kvcore demo --engine vllm --pd --device cuda   # NCCL, GPUs 0 and 1",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: Gloo; cuda: NCCL, rank r on cuda:r (needs 2 GPUs)")
    p.add_argument(
        "--num-blocks", type=int_range(32, 1 << 20), default=64, help="prefill blocks of 16 tokens (default 64 = 128 MiB); at least 32"
    )
    p.add_argument(
        "--chunk-bytes", type=int_range(1, 1 << 40), default=None, help="largest staging chunk of kvcore.send (default: kvcore's)"
    )
    p.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0)
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--timeout", type=float_range(0, 7 * 86400), default=600.0, help="seconds before the ranks are stopped")
    return p


def run(argv: list[str] | None = None) -> int:
    """Run the P/D demo; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    if args.num_blocks < 32:
        print(
            f"kvcore demo --pd: --num-blocks must be at least 32 (four requests of mixed lengths), got {args.num_blocks}", file=sys.stderr
        )
        return 2
    backend = "gloo"
    if args.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            print("kvcore demo --pd --device cuda needs two visible GPUs", file=sys.stderr)
            return 2
        backend = "nccl"
    from kvcore.testing.multiprocess import run_ranks

    opts = {"device": args.device, "num_blocks": args.num_blocks, "seed": args.seed, "chunk_bytes": args.chunk_bytes}
    env = {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "KVCORE_RANK_THREADS": os.environ.get("KVCORE_RANK_THREADS", "1"),
    }
    t0 = time.perf_counter()
    results = run_ranks("kvcore_vllm.pd_demo:_rank_main", 2, args=(opts,), backend=backend, timeout=args.timeout, env=env)
    wall = time.perf_counter() - t0
    failed = [r for r in results if not r.ok or r.value is None]
    pre, dec = (results[0].value or {}), (results[1].value or {})
    passed = not failed and bool(dec.get("verified"))
    reqs = _requests(args.num_blocks, args.seed)
    report = {
        "passed": passed,
        "backend": backend,
        "seconds": round(wall, 2),
        "prefill": pre,
        "decode": dec,
        "requests": [{"tokens": r["tokens"], "padding_slots": r["padding"]} for r in reqs],
        "rank_errors": [f"rank {r.rank} (exit {r.exitcode}): {r.error or 'no result'}" for r in failed],
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(
            f"prefill rank 0: {pre.get('format', '-')}  {pre.get('describe', '-')}  (vLLM {VERSION} {BACKEND} NHD, TP 1, block {PREFILL_BS})"
        )
        print(f"decode  rank 1: {dec.get('format', '-')}  {dec.get('describe', '-')}  x {DECODE_TP} TP ranks (HND, block {DECODE_BS})")
        toks = sum(r["tokens"] for r in reqs)
        print(f"requests: {len(reqs)} ({', '.join(str(r['tokens']) for r in reqs)} tokens; the last ends in padding slots), {toks} tokens")
        if pre.get("seconds"):
            gbps = pre["bytes"] / max(dec.get("seconds", pre["seconds"]), pre["seconds"]) / 1e9
            print(f"moved {pre['bytes'] / 2**20:.1f} MiB over {backend} in {pre['seconds']:.3f} s ({gbps:.2f} GB/s, conversion included)")
        if dec.get("elements_checked"):
            print(f"verified {dec['elements_checked']} elements of both decode caches through vLLM's views")
        print("all checks passed" if passed else "MISMATCH")
    for e in report["rank_errors"] + dec.get("errors", []):
        print(f"kvcore demo --pd: {e}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(sys.argv[1:]))
