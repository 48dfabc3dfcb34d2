"""``kvcore demo --engine sglang``: offload SGLang device pools into a HiCache host pool and back.

Three pools, allocated as SGLang allocates them (:mod:`kvcore_sglang.fixtures`):

* Llama-3-8B geometry (32 layers, 8 KV heads, head_dim 128; ``engine_layouts.md`` §6),
  ``MHATokenToKVPool`` as 0.5.23 allocates it (K and V halves of one buffer per layer),
  page size 1 and page size 64;
* DeepSeek-V3 geometry (61 layers, latent 512 + rope 64 = 576), ``MLATokenToKVPool``,
  page size 64.

For each: fill the pool with random bytes, pick a request's token slots
(``out_cache_loc``-style, never the padded page 0), ``kvcore.gather`` them from the
device pool and ``kvcore.scatter`` them into a ``page_first`` host pool
(``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``, SGLang's default
``--hicache-mem-layout``) at host slots; check the host pool through SGLang's own
indexing (``kv_buffer[0, host_indices, layer]`` is the K the device had at
``k_buffer[layer][loc]``); then restore from the host pool into other free device slots
and check those rows bit-exact and every other device row untouched (still zero, as
SGLang's ``torch.zeros`` left it). Exit 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

import kvcore
from kvcore.cli_args import OneLineParser, int_range
from kvcore_sglang import fixtures as fx

__all__ = ["run", "SCENARIOS"]


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    mla: bool
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int


SCENARIOS = [
    Scenario("llama3-8b-mha-page1", "Llama-3-8B", False, 32, 8, 128, 1),
    Scenario("llama3-8b-mha-page64", "Llama-3-8B", False, 32, 8, 128, 64),
    Scenario("deepseek-v3-mla-page64", "DeepSeek-V3", True, 61, 1, 576, 64),
]


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="kvcore demo --engine sglang", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pool-tokens", type=int_range(1, 1 << 22), default=768, help="device pool size (SGLang's max_total_num_tokens), default 768"
    )
    p.add_argument("--tokens", type=int_range(1, 1 << 22), default=256, help="tokens of the request offloaded and restored, default 256")
    p.add_argument("--layers", type=int_range(1, 1024), default=None, help="override every model's layer count (small runs)")
    p.add_argument("--dtype", choices=["bf16", "fp8_e4m3"], default="bf16", help="KV dtype (fp8 is stored as uint8, as SGLang does)")
    p.add_argument("--scenario", action="append", choices=[s.name for s in SCENARIOS], help="run only these (repeatable)")
    p.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _pages(n_pages_total: int, n: int, g: torch.Generator, exclude: set[int]) -> list[int]:
    free = [p for p in torch.randperm(n_pages_total, generator=g).tolist() if p not in exclude]
    return free[:n]


def _slots(pages: list[int], page_size: int, tokens: int) -> torch.Tensor:
    s = (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
    return s[:tokens]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (no copy when it is contiguous, as indexed rows are)."""
    return t.contiguous().view(torch.uint8)


def _nonzero_words(t: torch.Tensor) -> int:
    """Non-zero 8-byte words of ``t`` (rows of whole words) or non-zero bytes."""
    b = _bytes(t)
    return int(torch.count_nonzero(b.view(torch.int64) if b.shape[-1] % 8 == 0 else b))


def _random_rows(t: torch.Tensor, rows: torch.Tensor, g: torch.Generator) -> None:
    """``t[rows] = random bytes`` (generated as int64 words: eight bytes per draw)."""
    shape = (rows.numel(), *t.shape[1:])
    nbytes = torch.Size(shape).numel() * t.element_size()
    words = torch.randint(-(2**63), 2**63 - 1, (-(-nbytes // 8),), generator=g, dtype=torch.int64)
    t[rows] = words.view(torch.uint8)[:nbytes].view(t.dtype).reshape(shape)


def _run_one(sc: Scenario, a: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(a.seed)
    nl = a.layers or sc.num_layers
    ps = sc.page_size
    size = max(ps, a.pool_tokens // ps * ps)  # SGLang rounds the pool down to whole pages
    # the request's pages and the restore pages are disjoint, and neither is the padded page 0
    tokens = min(a.tokens, (size // ps // 2) * ps)
    dtype = torch.float8_e4m3fn if a.dtype == "fp8_e4m3" else torch.bfloat16
    hints: dict[str, Any] = {"page_size": ps} if ps > 1 else {}
    if dtype != torch.bfloat16:
        hints["kv_cache_dtype"] = a.dtype
    # device pool, as SGLang allocates it; random bytes through SGLang's own per-layer tensors
    if sc.mla:
        kv = fx.alloc_mla(nl, size, ps, sc.head_dim, dtype)
        planes = [kv]
        dev_caches: Any = kv
        hints["is_mla"] = True
    else:
        k, v = fx.alloc_mha_0523(nl, size, ps, sc.num_kv_heads, sc.head_dim, dtype)
        planes = [k, v]
        dev_caches = [k, v]
    dev = kvcore.detect(dev_caches, "sglang", hints)
    # HiCache host pool, page_first (SGLang's default --hicache-mem-layout)
    host_size = (2 * tokens + ps - 1) // ps * ps
    if sc.mla:
        host = fx.alloc_host_mla("page_first", nl, host_size, ps, sc.head_dim, dtype)
    else:
        host = fx.alloc_host_mha("page_first", nl, host_size, ps, sc.num_kv_heads, sc.head_dim, dtype)
    host_hints = {"mem_layout": "page_first", "is_mla": sc.mla, "num_layers": nl}
    if dtype != torch.bfloat16:
        host_hints["kv_cache_dtype"] = a.dtype
    hl = kvcore.detect(host, "sglang", host_hints)
    n_pages = (size + ps) // ps
    need = -(-tokens // ps)
    src_pages = _pages(n_pages, need, g, exclude={0})  # page 0 is the padded (dummy) page
    dst_pages = _pages(n_pages, need, g, exclude={0, *src_pages})
    loc, new_loc = _slots(src_pages, ps, tokens), _slots(dst_pages, ps, tokens)
    host_idx = _slots(_pages(host_size // ps, need, g, exclude=set()), ps, tokens)
    # the request's K/V: random bytes written through SGLang's own per-layer tensors
    # (k_buffer[layer][loc] = ..., as set_kv_buffer does); every other row stays zero
    for plane in planes:
        for t in plane:
            _random_rows(t, loc, g)

    t0 = time.perf_counter()
    staged = kvcore.gather(dev, loc)
    kvcore.scatter(hl, host_idx, staged)
    t_off = time.perf_counter() - t0
    # semantic: the host pool, read the way SGLang's host pool code reads it
    semantic = True
    for layer in range(nl):
        for kvi, plane in enumerate(planes):
            got = host[host_idx, layer] if sc.mla else host[kvi, host_idx, layer]
            semantic &= torch.equal(_bytes(got), _bytes(plane[layer][loc]))
    t0 = time.perf_counter()
    restored = kvcore.gather(hl, host_idx)
    kvcore.scatter(dev, new_loc, restored)
    t_back = time.perf_counter() - t0
    bit_exact = torch.equal(_bytes(restored), _bytes(staged))
    untouched = True
    for plane in planes:
        for layer in range(nl):
            t = plane[layer]
            bit_exact &= torch.equal(_bytes(t[new_loc]), _bytes(t[loc]))
            # nothing but the request's rows and the restored rows holds a non-zero byte
            untouched &= _nonzero_words(t) == _nonzero_words(t[loc]) + _nonzero_words(t[new_loc])
    moved = staged.numel() * staged.element_size()
    return {
        "scenario": sc.name,
        "model": sc.model,
        "device_format": dev.format.name,
        "device_shape": dev.describe(),
        "host_format": hl.format.name,
        "host_shape": hl.describe(),
        "dtype": str(dev.dtype).replace("torch.", ""),
        "storage_dtype": str(dev.storage_dtype).replace("torch.", ""),
        "page_size": ps,
        "tokens": int(tokens),
        "bytes_moved": int(moved),
        "offload_ms": round(t_off * 1e3, 2),
        "restore_ms": round(t_back * 1e3, 2),
        "semantic_ok": bool(semantic),
        "bit_exact": bool(bit_exact),
        "untouched_ok": bool(untouched),
        "ok": bool(semantic and bit_exact and untouched),
    }


def run(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every check passed, 1 on any mismatch, 2 on bad options."""
    try:
        a = _parser().parse_args(list(argv or []))
    except SystemExit as e:
        return int(e.code or 0)
    if a.pool_tokens < 1 or a.tokens < 1 or (a.layers is not None and a.layers < 1):
        print("kvcore demo --engine sglang: --pool-tokens, --tokens and --layers must be positive")
        return 2
    chosen = [s for s in SCENARIOS if not a.scenario or s.name in a.scenario]
    t0 = time.perf_counter()
    results = []
    for sc in chosen:
        try:
            results.append(_run_one(sc, a))
        except kvcore.KVCoreError as e:
            results.append({"scenario": sc.name, "ok": False, "error": f"{type(e).__name__}: {e}"})
    ok = all(r["ok"] for r in results)
    if a.json:
        print(json.dumps({"ok": ok, "seconds": round(time.perf_counter() - t0, 2), "results": results}, indent=2))
    else:
        _table(results)
        print(f"\n{'all checks passed' if ok else 'MISMATCH'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


def _table(results: list[dict[str, Any]]) -> None:
    cols = [
        ("scenario", "scenario"),
        ("device_format", "device format"),
        ("device_shape", "device shape"),
        ("host_format", "host format (page_first)"),
        ("dtype", "dtype"),
        ("tokens", "tokens"),
        ("bytes_moved", "MiB"),
        ("offload_ms", "offload ms"),
        ("restore_ms", "restore ms"),
        ("ok", "result"),
    ]

    def cell(r: dict[str, Any], k: str) -> str:
        if k == "bytes_moved" and k in r:
            return f"{r[k] / 2**20:.1f}"
        if k == "ok":
            if "error" in r:
                return "ERROR"
            return "ok" if r["ok"] else "MISMATCH (" + ", ".join(c for c in ("semantic_ok", "bit_exact", "untouched_ok") if not r[c]) + ")"
        return str(r.get(k, "-"))

    rows = [[h for _, h in cols]] + [[cell(r, k) for k, _ in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        if "error" in r:
            print(f"{r['scenario']}: {r['error']}")
