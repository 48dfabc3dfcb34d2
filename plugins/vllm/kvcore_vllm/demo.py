"""``kvcore demo`` for vLLM: detect, offload and restore a vLLM KV cache of a real model's geometry.

What it does, per case (default: three cases):

==================  ===========================================================================
Llama-3-8B NHD      32 layers, 8 KV heads, head size 128, bf16, block 16, vLLM FlashAttention,
                    ``(2, num_blocks, block_size, num_kv_heads, head_size)`` (vLLM 0.11.0
                    ``vllm/v1/attention/backends/flash_attn.py::FlashAttentionBackend.get_kv_cache_shape``)
Llama-3-8B HND      the same logical shape, memory in stride order ``(0, 1, 3, 2, 4)``
                    (vLLM 0.11.0 ``flash_attn.py::get_kv_cache_stride_order``, selected by
                    ``VLLM_KV_CACHE_LAYOUT=HND``, ``vllm/v1/attention/backends/utils.py::get_kv_cache_layout``)
DeepSeek-V3 MLA     61 layers, latent 576 (kv_lora_rank 512 + qk_rope 64), bf16, block 64 (FlashMLA),
                    ``(num_blocks, block_size, head_size)`` (vLLM 0.11.0
                    ``vllm/v1/attention/backends/mla/common.py::MLACommonBackend.get_kv_cache_shape``)
==================  ===========================================================================

Geometries: Llama-3-8B (32 layers, 8 KV heads, head_dim 128; its ``config.json``) and
DeepSeek-V3 (61 layers, 576-wide latent: ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64);
vLLM's default block size 16 (``vllm/config/cache.py``), FlashMLA's kernels need 64
(vLLM's ``flashmla.py`` backend; see ``SOURCES.md``).

1. allocate the cache as vLLM does (``kvcore_vllm.fixtures.allocate``: one flat int8 buffer per
   layer, viewed as the dtype and the stride-ordered shape, permuted back; a dict keyed by layer name);
2. write every slot, through the engine's own per-layer K/V views (``kvcore_vllm.fixtures.kv_view``,
   built as vLLM's attention forward splits the tensor), with integer bit patterns that encode
   (layer, K/V, slot, head, element): ``(A*layer + B*kv + C*slot + D*head + element) mod P``
   (P the largest prime below 2**bits of the element), so a swapped K/V, head, token or layer
   shows up as a wrong value;
3. ``kvcore.detect`` it and print the layout;
4. offload four requests of mixed lengths by slot mapping (``kvcore.gather``): one a whole number
   of blocks, one not a multiple of the block size, one short, one with padding slots ``-1``
   (engine padding, skipped in both directions: ``../shared/DESIGN.md``); the blocks are scattered (shuffled
   block tables, as a paged allocator hands them out);
5. wipe the requests' blocks, then load each request into *other* blocks (``kvcore.scatter``);
6. verify: the staged rows equal the encoding of their source slots (semantic gather) and padded
   rows stay untouched; gathering the restored slots gives the staged bytes back (bit-exact);
   every element of every layer's K and V plane, read through the engine's views, equals what it
   must (restored slots: the encoding of the *original* (layer, K/V, slot, head, element); wiped
   blocks: zero; everything else: its own encoding, untouched).

Prints a table (format, describe(), tokens, bytes moved, gather GB/s, scatter GB/s, verified) or
``--json``; progress bars go to stderr. Exit code 0 when every check passed, 1 on any mismatch,
2 on bad options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.cli_args import OneLineParser, int_range

__all__ = ["run", "CASES", "DemoCase"]

VLLM_VERSION = "0.11.0"


@dataclass(frozen=True)
class DemoCase:
    """One demo cache: a model geometry in one vLLM backend and layout."""

    key: str
    model: str
    backend: str
    layout: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int  # default; --num-blocks overrides
    version: str = VLLM_VERSION
    dtype: torch.dtype = torch.bfloat16

    @property
    def is_mla(self) -> bool:
        return self.num_kv_heads == 1 and self.head_size == 576

    @property
    def kv_size(self) -> int:
        return 1 if self.is_mla else 2


# Llama-3-8B: one block of all 32 layers = 2 * 16 * 8 * 128 * 2 B * 32 = 2 MiB -> 256 blocks = 512 MiB.
# DeepSeek-V3: one block of all 61 layers = 64 * 576 * 2 B * 61 = 4.3 MiB -> 64 blocks = 275 MiB.
# Sized so the three cases run in well under a minute on 2 CPU cores; --num-blocks scales them.
CASES: tuple[DemoCase, ...] = (
    DemoCase("llama-nhd", "Llama-3-8B", "FLASH_ATTN", "NHD", 32, 8, 128, 16, 256),
    DemoCase("llama-hnd", "Llama-3-8B", "FLASH_ATTN", "HND", 32, 8, 128, 16, 256),
    DemoCase("deepseek-mla", "DeepSeek-V3", "FLASHMLA", "NHD", 61, 1, 576, 64, 64),
)

# Encoding multipliers: odd, so a shift of any one coordinate changes the value (mod 2**bits).
_A_LAYER, _B_KV, _C_SLOT, _D_HEAD, _E_ELEM = 40503, 30011, 1031, 257, 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# -- the value oracle ------------------------------------------------------------------------


class Encoder:
    """Integer bit patterns encoding (layer, K/V, slot, head, element) for one element width.

    ``value = (A*layer + B*kv + C*slot + D*head + E*element) mod 2**bits``, in the element's
    integer view (int16 for bf16). The multipliers are odd, so a wrong layer, K/V, slot, head or
    element alone always changes the value. The sum is formed in the view dtype, whose
    arithmetic wraps mod 2**bits, so one pass writes a whole plane with no temporary.
    """

    def __init__(self, dtype: torch.dtype, num_heads: int, head_size: int, device: torch.device):
        from kvcore import GeometryError

        esz = torch.empty(0, dtype=dtype).element_size()
        if esz not in _INT_VIEW:
            raise GeometryError(f"the demo encodes 1-, 2- or 4-byte elements; {dtype} has {esz}")
        self.int_dtype = _INT_VIEW[esz]
        self.bits = 8 * esz
        h = torch.arange(num_heads, device=device, dtype=torch.int64)
        e = torch.arange(head_size, device=device, dtype=torch.int64)
        self.he = self._wrap(_D_HEAD * h[:, None] + _E_ELEM * e[None, :])  # [NH, HS]

    def _wrap(self, x: torch.Tensor) -> torch.Tensor:
        """int64 -> the view dtype, modulo 2**bits (two's complement for signed views)."""
        x = x & ((1 << self.bits) - 1)
        if self.int_dtype != torch.uint8:
            x = torch.where(x >= (1 << (self.bits - 1)), x - (1 << self.bits), x)
        return x.to(self.int_dtype)

    def token_term(self, layer: int, kv: int, slots: torch.Tensor) -> torch.Tensor:
        """``[T]``: the (layer, kv, slot) part of the value."""
        return self._wrap(_A_LAYER * layer + _B_KV * kv + _C_SLOT * slots.to(torch.int64))

    def encode_staging(self, slots: torch.Tensor, num_layers: int, kv_size: int) -> torch.Tensor:
        """``[kv_size, NL, T, NH, HS]``: what a gather of ``slots`` must stage; rows of negative
        (padding) slots are 0, as the staging buffer was."""
        layer = torch.arange(num_layers, device=slots.device, dtype=torch.int64)
        kv = torch.arange(kv_size, device=slots.device, dtype=torch.int64)
        s64 = slots.to(torch.int64)
        tok = self._wrap(_A_LAYER * layer[None, :, None] + _B_KV * kv[:, None, None] + _C_SLOT * s64[None, None, :])
        out = tok[..., None, None] + self.he
        out[:, :, s64 < 0] = 0
        return out

    def encode(self, layer: int, kv: int, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, NH, HS]`` values (or written into ``out``, any view broadcastable to that shape)."""
        tok = self.token_term(layer, kv, slots)
        if out is None:
            return tok[:, None, None] + self.he[None]
        return torch.add(tok.view(*out.shape[:-2], 1, 1), self.he, out=out)


# -- requests --------------------------------------------------------------------------------


@dataclass
class Request:
    name: str
    length: int  # valid tokens
    src_blocks: list[int]
    dst_blocks: list[int]
    pad: int = 0  # trailing -1 slots
    src_slots: torch.Tensor = field(default=None)  # type: ignore[assignment]
    dst_slots: torch.Tensor = field(default=None)  # type: ignore[assignment]


def _slot_mapping(blocks: list[int], length: int, block_size: int, pad: int) -> torch.Tensor:
    t = torch.arange(length, dtype=torch.int64)
    table = torch.tensor(blocks, dtype=torch.int64)
    slots = table[t // block_size] * block_size + t % block_size
    if pad:
        slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64)])
    return slots


def make_requests(num_blocks: int, block_size: int, seed: int) -> list[Request]:
    """Four requests over shuffled blocks: sources from one half of the pool, destinations
    from the other half. Lengths: whole blocks; not a multiple of the block size; short;
    and one whose slot mapping ends in padding slots (-1)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    half = num_blocks // 2
    src_pool, dst_pool = perm[:half], perm[half : 2 * half]
    shares = [0.45, 0.30, 0.15, 0.10]
    counts = [max(1, int(half * s)) for s in shares]
    while sum(counts) > half:
        counts[counts.index(max(counts))] -= 1
    bs = block_size
    lengths = [
        counts[0] * bs,  # a whole number of blocks
        (counts[1] - 1) * bs + bs // 2 + 1,  # ends inside a block
        counts[2] * bs - 1,
        max(1, counts[3] * bs - 3),  # with padding slots after it
    ]
    names = ["full-blocks", "partial-block", "short", "padded"]
    pads = [0, 0, 0, 5 + (-(counts[3] * bs - 3)) % 8]
    reqs, i = [], 0
    for n, c, ln, pad in zip(names, counts, lengths, pads):
        r = Request(n, ln, src_pool[i : i + c], dst_pool[i : i + c], pad)
        r.src_slots = _slot_mapping(r.src_blocks, ln, bs, pad)
        r.dst_slots = _slot_mapping(r.dst_blocks, ln, bs, pad)
        reqs.append(r)
        i += c
    return reqs


# -- one case --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":  # pragma: no cover - no XPU here
        torch.xpu.synchronize(device)


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=True if quiet else None, unit="plane")


def _first_mismatch(got: torch.Tensor, want: torch.Tensor) -> tuple[int, tuple[int, ...], int, int]:
    bad = got != want
    n = int(bad.sum())
    idx = tuple(int(i) for i in torch.nonzero(bad)[0])
    return n, idx, int(got[idx]), int(want[idx])


def run_case(case: DemoCase, num_blocks: int, device: torch.device, seed: int, corrupt: bool, quiet: bool, log) -> dict[str, Any]:
    """Run one case; returns its JSON record (``verified`` false on any mismatch)."""
    import kvcore
    from kvcore_vllm import fixtures

    rec: dict[str, Any] = {
        "case": case.key,
        "model": case.model,
        "backend": case.backend,
        "layout": case.layout,
        "vllm_version": case.version,
        "num_blocks": num_blocks,
        "checks": {},
        "errors": [],
    }
    checks: dict[str, bool] = rec["checks"]

    def fail(check: str, msg: str) -> None:
        checks[check] = False
        rec["errors"].append(f"{check}: {msg}")

    kw = dict(version=case.version, backend=case.backend, layout=case.layout)
    t0 = time.perf_counter()
    kv_caches = fixtures.allocate(
        case.version,
        case.backend,
        case.layout,
        num_layers=case.num_layers,
        num_blocks=num_blocks,
        block_size=case.block_size,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        dtype=case.dtype,
        device=device,
    )
    enc = Encoder(case.dtype, case.num_kv_heads, case.head_size, device)
    nslots = num_blocks * case.block_size
    all_slots = torch.arange(nslots, device=device)
    planes = [(layer, kv) for layer in range(case.num_layers) for kv in range(case.kv_size)]

    def plane(layer: int, kv: int) -> torch.Tensor:
        v = fixtures.kv_view(kv_caches, layer, kv, **kw)
        return v.view(enc.int_dtype)  # [NB, BS, NH, HS], a view into the cache

    with _progress(len(planes), f"{case.key}: write", quiet) as bar:
        for layer, kv in planes:
            enc.encode(layer, kv, all_slots, out=plane(layer, kv))
            bar.update()
    rec["fill_s"] = round(time.perf_counter() - t0, 3)

    # detect, as a connector would: the hints vLLM's config exposes
    hints = {"attention_backend": case.backend, "kv_cache_layout": case.layout, "vllm_version": case.version}
    try:
        layout = kvcore.detect(kv_caches, "vllm", hints)
    except kvcore.KVCoreError as e:
        fail("detect", f"{type(e).__name__}: {e}")
        rec["verified"] = False
        return rec
    rec.update(format=layout.format.name, describe=layout.describe(), note=layout.note)
    want_geo = dict(
        num_layers=case.num_layers,
        num_blocks=num_blocks,
        block_size=case.block_size,
        num_heads=case.num_kv_heads,
        head_size=case.head_size,
        kv_size=case.kv_size,
        dtype=case.dtype,
    )
    got_geo = {k: getattr(layout, k) for k in want_geo}
    checks["detect"] = True
    checks["geometry"] = got_geo == want_geo
    if not checks["geometry"]:
        fail("geometry", f"detected {got_geo}, expected {want_geo}")
    log(f"\n{case.model} / vLLM {case.version} {case.backend} " + ("MLA latent" if case.is_mla else case.layout))
    log(f"  format   {layout.format.name}  ({layout.format.symbolic})")
    log(f"  shape    {layout.describe()}, {str(layout.dtype).replace('torch.', '')} on {layout.device}")
    log(
        f"  geometry {layout.num_layers} layers, {layout.num_blocks} blocks x {layout.block_size} tokens, "
        f"{layout.num_heads} x {layout.head_size}, kv_size {layout.kv_size}"
    )
    if layout.note:
        log(f"  decided  {layout.note}")

    reqs = make_requests(num_blocks, case.block_size, seed)
    row_bytes = layout.kv_size * layout.num_layers * layout.hidden_dim * layout.element_size
    tokens = sum(r.length for r in reqs)
    rec["requests"] = [{"name": r.name, "tokens": r.length, "padding_slots": r.pad, "blocks": len(r.src_blocks)} for r in reqs]
    rec["tokens"] = tokens
    rec["bytes_moved"] = tokens * row_bytes

    # offload
    # staging buffers allocated up front, as an offloading system keeps its memory objects
    staged = [torch.zeros(layout.staging_shape(r.src_slots.numel()), dtype=layout.dtype, device=device) for r in reqs]
    src_maps = [r.src_slots.to(device) for r in reqs]
    dst_maps = [r.dst_slots.to(device) for r in reqs]
    # warm-up outside the timing: the first transfer selects (and may build) the kernel;
    # slot 0's row is gathered and written back unchanged
    probe = torch.zeros(1, dtype=torch.int64, device=device)
    kvcore.scatter(layout, probe, kvcore.gather(layout, probe))
    _sync(device)
    t = time.perf_counter()
    for m, st in zip(src_maps, staged):
        kvcore.gather(layout, m, st)
    _sync(device)
    t_gather = time.perf_counter() - t

    # semantic check of the staged rows (independent of the restore): row t of layer l, K/V k
    # must hold the encoding of (l, k, source slot of token t, head, element); padding rows stay 0
    ok = True
    for r, st in zip(reqs, staged):
        want = enc.encode_staging(r.src_slots.to(device), case.num_layers, case.kv_size)
        got = st.view(enc.int_dtype).view(want.shape)
        if not torch.equal(got, want):
            n, idx, g, w = _first_mismatch(got, want)
            what = "a padding row was written" if int(r.src_slots[idx[2]]) < 0 else "wrong value"
            fail(
                "gather_semantic",
                f"request {r.name}: {n} wrong values; first ({what}) at K/V {idx[0]} layer {idx[1]} token {idx[2]} "
                f"head {idx[3]} element {idx[4]}: got {g}, expected {w}",
            )
            ok = False
    checks.setdefault("gather_semantic", ok)

    # wipe the source blocks (through the engine's views), then restore into other blocks
    src_blocks = torch.tensor([b for r in reqs for b in r.src_blocks], dtype=torch.int64, device=device)
    for layer, kv in planes:
        plane(layer, kv)[src_blocks] = 0
    _sync(device)
    t = time.perf_counter()
    for m, st in zip(dst_maps, staged):
        kvcore.scatter(layout, m, st)
    _sync(device)
    t_scatter = time.perf_counter() - t

    if corrupt:  # the hidden self-test: one flipped byte after restore must fail verification
        r = reqs[1]
        s = int(r.dst_slots[r.length // 2])
        p = plane(case.num_layers - 1, case.kv_size - 1)
        p[s // case.block_size, s % case.block_size, 0, 0] ^= 0x5A
        log(f"  (self-test: flipped bits of one byte at layer {case.num_layers - 1}, slot {s})")

    # bit-exact: gathering the restored slots gives the staged bytes back
    ok = True
    for r, st in zip(reqs, staged):
        back = kvcore.gather(layout, r.dst_slots.to(device))
        if not torch.equal(back.view(torch.uint8), st.view(torch.uint8)):
            n = int((back.view(torch.uint8) != st.view(torch.uint8)).sum())
            fail("bit_exact", f"request {r.name}: {n} bytes differ between the offloaded and the restored rows")
            ok = False
    checks.setdefault("bit_exact", ok)

    # every element of the cache, through the engine's views
    expected_src = torch.cat([r.src_slots[r.src_slots >= 0] for r in reqs]).to(device)
    expected_dst = torch.cat([r.dst_slots[r.dst_slots >= 0] for r in reqs]).to(device)
    wiped = (src_blocks[:, None] * case.block_size + torch.arange(case.block_size, device=device)[None]).flatten()
    ok = True
    want = torch.empty(nslots, case.num_kv_heads, case.head_size, dtype=enc.int_dtype, device=device)
    with _progress(len(planes), f"{case.key}: verify", quiet) as bar:
        for layer, kv in planes:
            enc.encode(layer, kv, all_slots, out=want)
            want[wiped] = 0
            want[expected_dst] = enc.encode(layer, kv, expected_src)
            got = plane(layer, kv).reshape(nslots, case.num_kv_heads, case.head_size)
            if not torch.equal(got, want):
                n, idx, g, w = _first_mismatch(got, want)
                s = idx[0]
                what = "restored" if bool((expected_dst == s).any()) else ("wiped" if bool((wiped == s).any()) else "untouched")
                fail(
                    "cache_semantic",
                    f"layer {layer} {'KV'[kv] if case.kv_size == 2 else 'latent'}: {n} wrong values; first at slot {s} ({what}) "
                    f"head {idx[1]} element {idx[2]}: got {g}, expected {w}",
                )
                ok = False
            bar.update()
    checks.setdefault("cache_semantic", ok)

    rec["gather_s"] = round(t_gather, 4)
    rec["scatter_s"] = round(t_scatter, 4)
    rec["gather_gbps"] = round(rec["bytes_moved"] / t_gather / 1e9, 3) if t_gather > 0 else None
    rec["scatter_gbps"] = round(rec["bytes_moved"] / t_scatter / 1e9, 3) if t_scatter > 0 else None
    rec["verified"] = all(checks.values())
    rec["total_s"] = round(time.perf_counter() - t0, 3)
    return rec


# -- entry point -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="kvcore demo --engine vllm",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Detect, offload and restore vLLM KV caches of Llama-3-8B (FlashAttention NHD and HND) and "
        "DeepSeek-V3 (MLA) geometry, and verify every value bit-exactly and semantically.",
        epilog="examples:\n  kvcore demo\n  kvcore demo --num-blocks 64 --json\n  kvcore demo --case llama-hnd --device cuda\n"
        "  kvcore demo --engine vllm --pd   # prefill NHD TP 1 -> decode HND TP 2 between two processes",
    )
    p.add_argument("--json", action="store_true", help="print a JSON report instead of the table")
    p.add_argument("--device", default="cpu", help="device to allocate the caches on (default cpu)")
    p.add_argument(
        "--num-blocks",
        type=int_range(8, 1 << 20),
        default=None,
        help="blocks per cache for every case (default: 256 for Llama-3-8B = 512 MiB, 64 for DeepSeek-V3 = 275 MiB); at least 8",
    )
    p.add_argument("--case", action="append", choices=[c.key for c in CASES], help="run only this case (repeatable)")
    p.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="seed of the block shuffling")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--self-test-corrupt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pd", action="store_true", help="run the prefill/decode demo instead (kvcore demo --engine vllm --pd --help)")
    return p


def _table(rows: list[list[str]], headers: list[str]) -> str:
    cells = [headers] + rows
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = ["  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in cells]
    out.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(out)


def _load_kernels(device: torch.device) -> None:
    """Build or load the kernel that serves ``device`` before anything is timed."""
    from kvcore.kernels import select_kernel

    kernel = select_kernel(device.type, "NL_X_TWO_NB_BS_NH_HS", device.type)
    kernel.available()


def run(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (0 all verified, 1 a mismatch, 2 bad options).
    ``--pd`` runs the prefill/decode demo instead (:mod:`kvcore_vllm.pd_demo`)."""
    if argv and "--pd" in argv:
        from kvcore_vllm.pd_demo import run as run_pd

        return run_pd([a for a in argv if a != "--pd"])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2): an exit code, not an exception
        return e.code if isinstance(e.code, int) else 0
    if args.num_blocks is not None and args.num_blocks < 8:
        print(
            f"kvcore demo: --num-blocks must be at least 8 (four requests, source and destination blocks), got {args.num_blocks}",
            file=sys.stderr,
        )
        return 2
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, ValueError) as e:
        print(f"kvcore demo: device {args.device!r} is not usable here: {e}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    cases = [c for c in CASES if not args.case or c.key in args.case]
    records = []
    _load_kernels(device)  # a first use compiles the native kernels: not part of the demo's time
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        nb = args.num_blocks or case.num_blocks
        corrupt = args.self_test_corrupt and i == 0
        records.append(run_case(case, nb, device, args.seed, corrupt, args.quiet, log))
    passed = all(r.get("verified") for r in records)
    report = {"passed": passed, "device": str(device), "seconds": round(time.perf_counter() - t0, 2), "cases": records}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        rows = []
        for r in records:
            rows.append(
                [
                    r.get("format", "-"),
                    r.get("describe", "-"),
                    str(r.get("tokens", "-")),
                    f"{r['bytes_moved'] / 2**20:.1f} MiB" if "bytes_moved" in r else "-",
                    f"{r['gather_gbps']:.2f}" if r.get("gather_gbps") is not None else "-",
                    f"{r['scatter_gbps']:.2f}" if r.get("scatter_gbps") is not None else "-",
                    "yes" if r.get("verified") else "NO",
                ]
            )
        print()
        print(_table(rows, ["format", "describe()", "tokens", "bytes moved", "gather GB/s", "scatter GB/s", "verified"]))
        print(f"\n{len(records)} cases on {device} in {report['seconds']} s: " + ("all checks passed" if passed else "MISMATCH"))
    for r in records:
        for e in r["errors"]:
            print(f"kvcore demo: {r['case']}: {e}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(sys.argv[1:]))
