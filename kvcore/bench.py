"""``kvcore bench``: transfer benchmarks of the native and reference kernels.

For each layout × geometry × block size × token count, in both directions (gather:
paged cache → staging; scatter: staging → paged cache), it reports:

- GB/s, counting bytes read **plus** bytes written (device memory traffic), for the
  kernel that serves the device (native when built, else the reference);
- the ratio to a plain contiguous copy of the same number of bytes (``torch.Tensor.copy_``
  between two contiguous buffers), measured in the same run;
- the ratio to the torch reference kernel.

With ``--device cuda`` it adds the host rows: gather straight into pinned host memory and
scatter straight from it (no GPU staging buffer), against one large pinned ``copy_`` of
the same bytes in the same direction (GB/s there count the bytes crossing the link once).

Timing: medians of repeated runs (``--repeats``), after a warm-up; CUDA runs are timed
with CUDA events around a batch of back-to-back calls, so host work per call (argument
preparation, the op dispatch) is included whenever it is slower than the GPU. Small
transfers rotate among several disjoint slot mappings and staging buffers so that the
working set exceeds the GPU's L2 (the copy baseline rotates the same way). The slot
mapping is whole blocks in random order, as an engine hands out blocks. Cache contents
are random bytes. Validation in :func:`kvcore.gather` (one slot-range reduction) is not
timed: the kernels receive an already validated :class:`~kvcore.kernels.TransferPlan`.

Geometries (the shapes LMCache's own kernel tests and harness use: ``tests/v1/`` and
``benchmarks/``, LMCache 0.5.6):
Llama-3-8B per tensor-parallel rank, 32 layers × 8 KV heads × head size 128, bf16;
DeepSeek MLA latent, 61 layers × head size 576 (bf16, and fp8 e4m3 stored as uint8).
Layouts by grammar name (the core names no engine): NHD ``NL_X_TWO_NB_BS_NH_HS``, HND
``NL_X_TWO_NB_NH_BS_HS``, FlashInfer ``NL_X_NB_TWO_BS_NH_HS``, MLA ``NL_X_NB_BS_HS``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvcore.cli_args import OneLineParser, float_range, int_list, int_range
from kvcore.tensor_description import UsageError

__all__ = ["add_arguments", "run", "CASES", "make_cache", "random_fill", "block_slots", "Case", "quantised_table"]


@dataclass(frozen=True)
class Case:
    """One benchmarked layout: a label, a grammar name, sizes, storage dtype and the
    element dtype it carries."""

    label: str
    format: str
    num_layers: int
    num_heads: int
    head_size: int
    storage_dtype: torch.dtype
    dtype: torch.dtype
    kind: str = "classic"  # "quant": int8 K/V values + bf16 per-(token, head) scales, four planes;
    # "shared": a two-plane name whose planes are views of one per-layer tensor (_shared_planes)
    tiles: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()  # "shared": per plane role its BSE / HSE sizes


_LLAMA = dict(num_layers=32, num_heads=8, head_size=128)
#: the quantised case's multi-plane name: int8 K and V values, bf16 per-(token, head) scales
QUANT_FORMAT = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH+VS=NL_X_NB_BS_NH"
_MLA = dict(num_layers=61, num_heads=1, head_size=576)

#: two planes in one per-layer tensor ``[NB, NH, 2 * BS * HS]`` (per block and head: the K
#: plane's ``BS * HS`` elements, then V's), K not head-contiguous: column-major ``[HS, BS]``
#: (``KT``), or tiles of 16 tokens x 4 bytes of elements ``[BS/16, HS/p, 16, p]`` (``Ktile``,
#: p = 4 / element size: VNNI pairs of bf16); V row-major ``[BS, HS]``
KT_FORMAT = "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
KTILE_FORMAT = "K=NL_X_NB_NH_BSC_HSC_BSE_HSE+V=NL_X_NB_NH_BS_HS"
#: tokens per tile (BSE) of the ``Ktile`` case
TILE_TOKENS = 16
#: both planes in AMX tiles (``AMX``, ``AMX-fp8``): K ``[BS/16, HS/2, 16, 2]`` (16 tokens x a
#: pair of elements), V ``[HS/16, BS/2, 16, 2]`` (16 elements x a pair of tokens: a token's
#: elements of a 16-element chunk two elements apart, a second strided level of the head),
#: in elements of the storage dtype (fp8 keeps the bf16 element order)
AMX_FORMAT = "K=NL_X_NB_NH_BSC_HSC_BSE_HSE+V=NL_X_NB_NH_HSC_BSC_HSE_BSE"
AMX_TILES = (("K", (("BSE", 16), ("HSE", 2))), ("V", (("HSE", 16), ("BSE", 2))))

CASES: dict[str, Case] = {
    "NHD": Case("NHD", "NL_X_TWO_NB_BS_NH_HS", **_LLAMA, storage_dtype=torch.bfloat16, dtype=torch.bfloat16),
    "HND": Case("HND", "NL_X_TWO_NB_NH_BS_HS", **_LLAMA, storage_dtype=torch.bfloat16, dtype=torch.bfloat16),
    "FlashInfer": Case("FlashInfer", "NL_X_NB_TWO_BS_NH_HS", **_LLAMA, storage_dtype=torch.bfloat16, dtype=torch.bfloat16),
    "MLA-bf16": Case("MLA-bf16", "NL_X_NB_BS_HS", **_MLA, storage_dtype=torch.bfloat16, dtype=torch.bfloat16),
    "MLA-fp8": Case("MLA-fp8", "NL_X_NB_BS_HS", **_MLA, storage_dtype=torch.uint8, dtype=torch.float8_e4m3fn),
    "Q-int8": Case("Q-int8", QUANT_FORMAT, **_LLAMA, storage_dtype=torch.int8, dtype=torch.int8, kind="quant"),
    "KT": Case("KT", KT_FORMAT, **_LLAMA, storage_dtype=torch.bfloat16, dtype=torch.bfloat16, kind="shared"),
    "KT-fp8": Case("KT-fp8", KT_FORMAT, **_LLAMA, storage_dtype=torch.uint8, dtype=torch.float8_e4m3fn, kind="shared"),
    "Ktile": Case("Ktile", KTILE_FORMAT, **_LLAMA, storage_dtype=torch.bfloat16, dtype=torch.bfloat16, kind="shared"),
    "AMX": Case("AMX", AMX_FORMAT, **_LLAMA, storage_dtype=torch.bfloat16, dtype=torch.bfloat16, kind="shared", tiles=AMX_TILES),
    "AMX-fp8": Case("AMX-fp8", AMX_FORMAT, **_LLAMA, storage_dtype=torch.uint8, dtype=torch.float8_e4m3fn, kind="shared", tiles=AMX_TILES),
}

BLOCK_SIZES = (16, 64, 256)
TOKENS = (256, 8192)
_L2_ROTATE_BYTES = 256 << 20  # rotate inputs until the working set is past any L2


# -- allocation helpers (also used by the tests and scripts/gpu_check.py) ----------------


def _expand(tok: str) -> list[str]:
    return {"TWO": ["KV"], "CS": ["KV", "HS"], "NBBS": ["NB", "BS"], "ONE": []}.get(tok, [tok])


def make_cache(
    name: str,
    logical: torch.Tensor,
    *,
    pad: bool = False,
    storage_dtype: torch.dtype | None = None,
) -> Any:
    """Lay a logical cache out as format ``name`` says, through torch views only.

    Args:
        name: a grammar name built from NL NB BS NBBS NH HS CS TWO ONE and ``_X_`` list
            levels NL / TWO.
        logical: ``[NL, kv_size, NB, BS, NH, HS]``: element ``(l, k, b, o, h, e)`` is
            element ``e`` of head ``h`` of K (k=0) or V (k=1) of slot ``b*BS+o`` in layer ``l``.
        pad: allocate one extra entry on each tensor's first axis (the view starts past
            it: a non-zero storage offset) and 8 extra elements on the last axis (rows
            padded past their tight stride).
        storage_dtype: reinterpret the bytes as this dtype (e.g. ``torch.int8`` for an int8
            buffer carrying bf16; the last axis scales by the size ratio).
    Returns:
        the container nested as the format's list levels (lists of tensors), or a tensor.
    Raises:
        kvcore.FormatError: a malformed name. kvcore.GeometryError: the logical cache
            does not fit the name (a K/V or head axis the format has no place for).
    """
    from kvcore.errors import GeometryError
    from kvcore.grammar import parse

    syn = parse(name)
    nl, kv, nb, bs, nh, hs = logical.shape
    dims = ["NL", "KV", "NB", "BS", "NH", "HS"]

    def render(t: torch.Tensor, names: list[str]) -> torch.Tensor:
        order: list[str] = []
        for tok in syn.axes:
            order += _expand(tok)
        for n in list(names):
            if n not in order:
                i = names.index(n)
                if t.shape[i] != 1:
                    raise GeometryError(f"{name}: logical axis {n} of size {t.shape[i]} has no place in the format")
                t = t.squeeze(i)
                names = names[:i] + names[i + 1 :]
        t = t.permute([names.index(n) for n in order]).contiguous()
        shape = []
        for tok in syn.axes:
            if tok == "ONE":
                shape.append(1)
            elif tok == "CS":
                shape.append(kv * hs)
            elif tok == "NBBS":
                shape.append(nb * bs)
            else:
                shape.append(t.shape[order.index(_expand(tok)[0])] if tok != "TWO" else 2)
        t = t.reshape(shape)
        if pad:
            big = torch.empty((shape[0] + 1, *shape[1:-1], shape[-1] + 8), dtype=t.dtype, device=t.device)
            big.view(torch.uint8).fill_(0x5A)
            view = big[1:, ..., : shape[-1]]
            view.copy_(t)
            t = view
        if storage_dtype is not None and storage_dtype != t.dtype:
            t = t.view(storage_dtype)
        return t

    lv = syn.list_levels
    if lv == ():
        return render(logical, dims)
    if lv == ("NL",):
        return [render(logical[i], dims[1:]) for i in range(nl)]
    if lv == ("TWO", "NL"):
        return [[render(logical[i, k], dims[2:]) for i in range(nl)] for k in range(kv)]
    if lv == ("NL", "TWO"):
        return [[render(logical[i, k], dims[2:]) for k in range(kv)] for i in range(nl)]
    raise GeometryError(f"{name}: list levels {lv} are not supported by make_cache")


def random_fill(t: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` with random bytes in place (every bit pattern: NaN payloads, -0, ...)."""
    b = t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.uint8)
    if b.is_contiguous():
        flat = b.view(-1)
        flat.random_(0, 256, generator=gen) if gen is not None else flat.random_(0, 256)
    else:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=b.device, generator=gen))
    return t


def quantised_table(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    device,
    gen: torch.Generator | None = None,
):
    """A quantised KV cache as a hand-built multi-plane stride table: int8 K and V values
    ``[NB, BS, NH, HS]`` per layer with bf16 per-(token, head) scales ``[NB, BS, NH]`` in
    sibling tensors (the int8 KV layout of LMDeploy's PyTorch engine, 0.6-0.11, without its
    zeros), four planes ``K, V, KS, VS`` each staged into its own buffer
    ``{role: [NL, T, NH * width]}`` in its dtype. Contents are random bytes.

    Returns:
        ``(table, {role: [tensor per layer]})``.
    """
    from kvcore.spec import Plane, PlaneStrides, StagingBuffer, StagingTarget, StrideTable

    dev = torch.device(device)
    planes, buffers, tensors = [], [], {}
    for role, dt, width in (
        ("K", torch.int8, head_size),
        ("V", torch.int8, head_size),
        ("KS", torch.bfloat16, 1),
        ("VS", torch.bfloat16, 1),
    ):
        esz = torch.empty(0, dtype=dt).element_size()
        shape = (num_blocks, block_size, num_heads, head_size) if width > 1 else (num_blocks, block_size, num_heads)
        layers = [random_fill(torch.empty(shape, dtype=dt, device=dev), gen) for _ in range(num_layers)]
        tensors[role] = layers
        hb = width * esz
        planes.append(
            Plane(
                role=role,
                strides=PlaneStrides(block=block_size * num_heads * hb, token=num_heads * hb, head=hb, chunk=0, chunk_bytes=hb, n_chunks=1),
                num_heads=num_heads,
                head_bytes=hb,
                dtype=dt,
                bases=tuple((t, 0) for t in layers),
                staging=StagingTarget(buffer=role, index=None, offset=0, head_stride=hb),
            )
        )
        buffers.append(StagingBuffer(key=role, kv_size=None, row_bytes=num_heads * hb, dtype=dt))
    table = StrideTable(
        num_layers=num_layers,
        block_size=block_size,
        num_slots=num_blocks * block_size,
        device=dev,
        planes=tuple(planes),
        buffers=tuple(buffers),
    )
    return table, tensors


def shared_planes(
    name: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device,
    tiles: dict[str, dict[str, int]] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """Per layer one tensor ``[NB, NH, 2 * BS * HS]`` of ``dtype`` (random bytes) whose two
    halves per (block, head) are the planes of the two-plane ``name`` (first plane first),
    each viewed in its template's order of the axes after ``NB_NH``: ``HS``, ``BS``, and
    ``BSC``/``BSE``, ``HSC``/``HSE`` (tiles: by default :data:`TILE_TOKENS` tokens and 4
    bytes of elements; ``tiles`` gives a plane role its own ``BSE`` / ``HSE``, e.g.
    :data:`AMX_TILES`).

    Returns:
        ``{role: [view per layer]}`` for :func:`kvcore.build_layout`.
    Raises:
        kvcore.GeometryError: a name that is not two planes ``NL_X_NB_NH_...``, or a block
            or head size its tiles do not divide.
    """
    from kvcore.errors import GeometryError
    from kvcore.grammar import parse

    syn = parse(name)
    if len(syn.planes) != 2:
        raise GeometryError(f"{name}: shared_planes lays out two planes")
    esz = torch.empty(0, dtype=dtype).element_size()
    pair = max(1, 4 // esz)
    half = block_size * head_size
    out: dict[str, list[torch.Tensor]] = {p.role: [] for p in syn.planes}
    shapes = []
    for p in syn.planes:
        if p.syntax.axes[:2] != ("NB", "NH") or p.syntax.list_levels != ("NL",):
            raise GeometryError(f"{name}: plane {p.role} is not NL_X_NB_NH_...")
        own = {"BSE": TILE_TOKENS, "HSE": pair, **(tiles or {}).get(p.role, {})}
        for whole, inner in (("BS", "BSE"), ("HS", "HSE")):
            n = block_size if whole == "BS" else head_size
            if p.syntax.has(inner) and n % own[inner]:
                raise GeometryError(f"{name}: plane {p.role}: {whole} {n} is not a multiple of {inner} {own[inner]}")
        sizes = {"HS": head_size, "BS": block_size, "BSE": own["BSE"], "BSC": block_size // own["BSE"]}
        sizes.update(HSE=own["HSE"], HSC=head_size // own["HSE"])
        shapes.append(tuple(sizes[a] for a in p.syntax.axes[2:]))
    for _ in range(num_layers):
        t = random_fill(torch.empty(num_blocks, num_heads, 2 * half, dtype=dtype, device=device))
        for i, p in enumerate(syn.planes):
            out[p.role].append(t[:, :, i * half : (i + 1) * half].unflatten(2, shapes[i]))
    return out


def random_slots(num_tokens: int, num_slots: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """int64 ``[num_tokens]``: distinct slots of ``[0, num_slots)`` in random order."""
    return torch.randperm(num_slots, generator=gen)[:num_tokens].contiguous()


def block_slots(num_tokens: int, block_size: int, block_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[num_tokens]``: whole blocks ``block_ids`` in order, ``id*BS + [0, BS)``."""
    s = (block_ids[:, None].to(torch.int64) * block_size + torch.arange(block_size, device=block_ids.device)[None, :]).flatten()
    return s[:num_tokens].contiguous()


# -- timing ------------------------------------------------------------------------------


def _timer(device: torch.device, calls: int, clock: str = "wall") -> Callable[[Callable[[int], None]], float]:
    """Returns ``time(fn)``: the seconds of one call of ``fn(i)``, over ``calls`` calls.
    ``clock="cpu"`` (CPU device): the process's CPU seconds (every thread's), not wall time:
    on a shared host a preempted call is not charged for the time it did not run."""
    if device.type == "cuda":

        def t_cuda(fn: Callable[[int], None]) -> float:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(calls):
                fn(i)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / calls

        return t_cuda

    now = time.process_time if clock == "cpu" else time.perf_counter

    def t_cpu(fn: Callable[[int], None]) -> float:
        t0 = now()
        for i in range(calls):
            fn(i)
        return (now() - t0) / calls

    return t_cpu


def _median_time(fn: Callable[[int], None], device: torch.device, repeats: int, calls: int) -> float:
    return _median_times({"x": fn}, device, repeats, calls)["x"]


def _median_times(fns: dict[str, Callable[[int], None]], device: torch.device, repeats: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each function; the functions take turns within every
    repeat, so a machine whose speed drifts (other load, clocks) affects them alike."""
    return {k: statistics.median(v) for k, v in _sample_times(fns, device, repeats, calls).items()}


def _sample_times(
    fns: dict[str, Callable[[int], None]], device: torch.device, repeats: int, calls: int, clock: str = "wall"
) -> dict[str, list[float]]:
    """Seconds per call of each function in every repeat (``repeats`` samples each, the
    functions taking turns within a repeat: sample ``i`` of two functions ran back to back)."""
    timer = _timer(device, calls, clock)
    for fn in fns.values():
        fn(0)  # warm-up (also builds the native library, uploads pointer tables)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k].append(timer(fn))
    return samples


def _graph_times(fns: dict[str, Callable[[int], None]], device: torch.device, repeats: int, calls: int) -> dict[str, float]:
    """Median seconds per call when ``calls`` calls are captured in one CUDA graph and
    replayed: the device time without the host's launch overhead (METHOD: many small
    launches). Functions that cannot be captured are left out."""
    graphs = {}
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for fn in fns.values():
            fn(0)
    torch.cuda.current_stream(device).wait_stream(side)
    for k, fn in fns.items():
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                for i in range(calls):
                    fn(i)
        except Exception:  # noqa: BLE001 - a path that syncs cannot be captured; it is timed eagerly
            continue
        graphs[k] = g
    out: dict[str, list[float]] = {k: [] for k in graphs}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for k, g in graphs.items():
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            out[k].append(a.elapsed_time(b) / 1e3 / calls)
    return {k: statistics.median(v) for k, v in out.items()}


_PINNED: dict[str, torch.Tensor] = {}


def _pinned(tag: str, nbytes: int) -> torch.Tensor:
    """A reusable pinned host buffer of at least ``nbytes`` (pinning is slow: reuse it)."""
    buf = _PINNED.get(tag)
    if buf is None or buf.numel() < nbytes:
        _PINNED.pop(tag, None)
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        _PINNED[tag] = buf
    return buf[:nbytes]


# -- one case -----------------------------------------------------------------------------


@dataclass
class Row:
    device: str
    layout: str
    format: str
    dtype: str
    block_size: int
    tokens: int
    direction: str
    staging: str  # "device" or "pinned"
    kernel: str
    mbytes: float  # payload bytes (one copy), MB
    seconds: float
    gbps: float
    baseline: str
    baseline_gbps: float
    vs_copy: float
    reference_gbps: float | None
    vs_reference: float | None
    graph_seconds: float | None = None  # cuda device rows: per call, replaying a captured CUDA graph
    graph_gbps: float | None = None
    graph_vs_copy: float | None = None  # against the eager copy (a copy captured in a graph becomes a DMA node: slower)
    graph_copy_seconds: float | None = None
    public_seconds: float | None = None  # kvcore.gather / kvcore.scatter per call (validate default), same run
    public_vs_kernel: float | None = None  # public time / kernel-entry time (1.00 = no overhead)
    public_graph_seconds: float | None = None  # cuda: the public call captured in a CUDA graph, per call
    clock: str = "wall"  # CPU rows: "wall" seconds, or "cpu" (the process's CPU seconds, every thread)
    slots: str = "blocks"  # the slot mapping: "blocks" (whole blocks in random order) or "random" (a random permutation of slots)
    gbps_range: tuple[float, float] | None = None  # kernel GB/s, lowest and highest over the repeats
    vs_copy_range: tuple[float, float] | None = None  # per repeat: copy time / kernel time of that repeat (they ran back to back)
    public_vs_copy: float | None = None  # the public call against the same-run copy (median copy time / median public time)
    public_vs_copy_range: tuple[float, float] | None = None  # per repeat, as vs_copy_range


def _kernels(device: torch.device):
    from kvcore.kernels import select_kernel
    from kvcore.kernels.reference import REFERENCE

    return REFERENCE, select_kernel


def bench_case(
    case: Case,
    block_size: int,
    tokens: int,
    device: torch.device,
    *,
    repeats: int,
    with_reference: bool,
    host: bool,
    host_reference: bool = True,
    seed: int = 0,
    sample_bytes: float = 400e6,
    slots: str = "blocks",
    clock: str = "wall",
) -> list[Row]:
    """Benchmark one layout/geometry; returns the rows (both directions, and the pinned
    host rows when ``host``). On CPU one timed sample repeats the call until about
    ``sample_bytes`` bytes moved (at most 20 calls): ~100 ms by default, less for
    ``--quick``. ``slots``: ``"blocks"`` (whole blocks in random order, a request's
    consecutive slots) or ``"random"`` (a random permutation of the pool's slots).
    ``clock``: ``"wall"``, or ``"cpu"`` (CPU device: the process's CPU seconds, see
    :func:`_timer`)."""
    import kvcore
    from kvcore.kernels import TransferPlan

    reference, select_kernel = _kernels(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    payload_token = _payload_per_token(case)
    payload = payload_token * tokens
    nblk = -(-tokens // block_size)
    sets = max(1, min(8, math.ceil(_L2_ROTATE_BYTES / payload))) if device.type == "cuda" else 1
    num_blocks = (sets + 1) * nblk
    layout, table, new_staging = _setup(case, block_size, num_blocks, device)
    if slots == "random":  # disjoint sets: consecutive pieces of one permutation of every slot
        perm = torch.randperm(num_blocks * block_size, generator=gen)
        slot_sets = [perm[i * tokens : (i + 1) * tokens].contiguous().to(device) for i in range(sets)]
    else:
        perm = torch.randperm(num_blocks, generator=gen)
        slot_sets = [block_slots(tokens, block_size, perm[i * nblk : (i + 1) * nblk]).to(device) for i in range(sets)]
    staging = [new_staging(tokens, device) for _ in range(sets)]
    plans = [TransferPlan(table=table, slots=slot_sets[i], staging=staging[i], num_valid=tokens) for i in range(sets)]
    kernel = select_kernel(device.type, case.format, device.type, table)
    # CPU: enough calls that one sample lasts ~100 ms, so a preempted thread is a small error
    calls = 20 if device.type == "cuda" else max(1, min(20, int(sample_bytes // (2 * payload))))
    src = [torch.empty(payload, dtype=torch.uint8, device=device) for _ in range(sets)]
    for s in src:
        random_fill(s)
    dst = [torch.empty(payload, dtype=torch.uint8, device=device) for _ in range(sets)]

    fns: dict[str, Callable[[int], None]] = {"copy": lambda i: dst[i % sets].copy_(src[i % sets])}
    for d in ("gather", "scatter"):
        fns[d] = lambda i, d=d: getattr(kernel, d)(plans[i % sets])
        if layout is not None:  # the public API, as a user calls it (validation on, the default)
            fns["pub-" + d] = lambda i, d=d: getattr(kvcore, d)(layout, slot_sets[i % sets], staging[i % sets])
        if with_reference and kernel is not reference:
            fns["ref-" + d] = lambda i, d=d: getattr(reference, d)(plans[i % sets])
    samples = _sample_times(fns, device, repeats, calls, clock if device.type == "cpu" else "wall")
    tm = {k: statistics.median(v) for k, v in samples.items()}
    copy_s = tm["copy"]

    def ratio_range(key: str) -> tuple[float, float] | None:
        if key not in samples:
            return None
        r = [c / x for c, x in zip(samples["copy"], samples[key])]
        return (min(r), max(r))

    gt: dict[str, float] = {}
    if device.type == "cuda" and kernel is not reference:
        gt = _graph_times(
            {k: fns[k] for k in ("copy", "gather", "scatter", "pub-gather", "pub-scatter") if k in fns}, device, repeats, calls
        )
    rows = []
    for direction in ("gather", "scatter"):
        sec = tm[direction]
        ref_s = tm.get("ref-" + direction, sec if kernel is reference else None)
        rows.append(
            Row(
                device=str(device.type),
                layout=case.label,
                format=case.format,
                dtype=str(case.dtype).replace("torch.", ""),
                block_size=block_size,
                tokens=tokens,
                direction=direction,
                staging="device",
                kernel=kernel.name,
                mbytes=payload / 1e6,
                seconds=sec,
                gbps=2 * payload / sec / 1e9,
                baseline="copy",
                baseline_gbps=2 * payload / copy_s / 1e9,
                vs_copy=copy_s / sec,
                reference_gbps=None if ref_s is None else 2 * payload / ref_s / 1e9,
                vs_reference=None if ref_s is None else ref_s / sec,
                graph_seconds=gt.get(direction),
                graph_gbps=2 * payload / gt[direction] / 1e9 if direction in gt else None,
                graph_vs_copy=copy_s / gt[direction] if direction in gt else None,
                graph_copy_seconds=gt.get("copy"),
                public_seconds=tm.get("pub-" + direction),
                public_vs_kernel=tm["pub-" + direction] / sec if "pub-" + direction in tm else None,
                public_graph_seconds=gt.get("pub-" + direction),
                slots=slots,
                clock=clock if device.type == "cpu" else "wall",
                gbps_range=(2 * payload / max(samples[direction]) / 1e9, 2 * payload / min(samples[direction]) / 1e9),
                vs_copy_range=ratio_range(direction),
                public_vs_copy=copy_s / tm["pub-" + direction] if "pub-" + direction in tm else None,
                public_vs_copy_range=ratio_range("pub-" + direction),
            )
        )
    if host and device.type == "cuda":
        hstage = _pinned_like(staging[0], payload)
        hplan = TransferPlan(table=table, slots=slot_sets[0], staging=hstage, num_valid=tokens)
        hk = select_kernel(device.type, case.format, "cpu", table)
        hbuf = _pinned("memcpy", payload)
        dbuf = src[0]
        hcalls = 3 if payload > (64 << 20) else 10
        hfns = {
            "d2h": lambda i: hbuf.copy_(dbuf, non_blocking=True),
            "h2d": lambda i: dbuf.copy_(hbuf, non_blocking=True),
            "gather": lambda i: hk.gather(hplan),
            "scatter": lambda i: hk.scatter(hplan),
        }
        if layout is not None:
            hfns["pub-gather"] = lambda i: kvcore.gather(layout, slot_sets[0], hstage)
            hfns["pub-scatter"] = lambda i: kvcore.scatter(layout, slot_sets[0], hstage)
        tm = _median_times(hfns, device, repeats, hcalls)
        d2h, h2d = tm["d2h"], tm["h2d"]
        tref = {}
        if with_reference and host_reference:
            tref = _median_times({d: (lambda i, d=d: getattr(reference, d)(hplan)) for d in ("gather", "scatter")}, device, 1, 1)
        for direction, base_s in (("gather", d2h), ("scatter", h2d)):
            sec = tm[direction]
            ref_s = tref.get(direction)
            rows.append(
                Row(
                    device="cuda",
                    layout=case.label,
                    format=case.format,
                    dtype=str(case.dtype).replace("torch.", ""),
                    block_size=block_size,
                    tokens=tokens,
                    direction=direction,
                    staging="pinned",
                    kernel=hk.name,
                    mbytes=payload / 1e6,
                    seconds=sec,
                    gbps=payload / sec / 1e9,
                    baseline="pinned memcpy " + ("D2H" if direction == "gather" else "H2D"),
                    baseline_gbps=payload / base_s / 1e9,
                    vs_copy=base_s / sec,
                    reference_gbps=None if ref_s is None else payload / ref_s / 1e9,
                    vs_reference=None if ref_s is None else ref_s / sec,
                    public_seconds=tm.get("pub-" + direction),
                    public_vs_kernel=tm["pub-" + direction] / sec if "pub-" + direction in tm else None,
                    slots=slots,
                )
            )
    return rows


def _payload_per_token(case: Case) -> int:
    """Bytes one token moves (all layers, every plane)."""
    if case.kind == "quant":
        return case.num_layers * 2 * case.num_heads * (case.head_size + 2)
    kv = 1 if case.num_heads == 1 and "TWO" not in case.format else 2
    esz = torch.empty(0, dtype=case.dtype).element_size()
    return kv * case.num_layers * case.num_heads * case.head_size * esz


def _fill_staging(staging):
    for t in staging.values() if isinstance(staging, dict) else [staging]:
        random_fill(t)
    return staging


def _setup(case: Case, block_size: int, num_blocks: int, device: torch.device):
    """``(layout or None, stride table, new_staging(T, device))`` for one case, the cache
    allocated in the format's own tensors (random bytes). The quantised case is built from
    its multi-plane name when the core's grammar has multi-plane names, else as a hand-built
    table (then there is no layout, and no public-API column)."""
    import kvcore

    torch.manual_seed(1234)  # the same bytes for the same case (checks compare two caches)
    if case.kind == "quant":
        table, tensors = quantised_table(
            num_layers=case.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_heads=case.num_heads,
            head_size=case.head_size,
            device=device,
        )
        layout = None
        try:
            layout = kvcore.build_layout(case.format, tensors)
            table = layout.stride_table()
        except kvcore.KVCoreError:
            pass

        def new_staging(t: int, dev):
            return _fill_staging({b.key: torch.empty(b.shape(case.num_layers, t), dtype=b.dtype, device=dev) for b in table.buffers})

        return layout, table, new_staging
    if case.kind == "shared":
        planes = shared_planes(
            case.format,
            num_layers=case.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_heads=case.num_heads,
            head_size=case.head_size,
            dtype=case.storage_dtype,
            device=device,
            tiles={role: dict(sz) for role, sz in case.tiles},
        )
        layout = kvcore.build_layout(case.format, planes, dtype=case.dtype if case.dtype != case.storage_dtype else None)

        def new_staging_shared(t: int, dev):
            return _fill_staging(torch.empty(layout.staging_shape(t), dtype=case.dtype, device=dev))

        return layout, layout.stride_table(), new_staging_shared
    from kvcore.grammar import parse

    syn = parse(case.format)
    per_layer = [int({"TWO": 2, "NB": num_blocks, "BS": block_size, "NH": case.num_heads, "HS": case.head_size}[t]) for t in syn.axes]
    caches = [random_fill(torch.empty(per_layer, dtype=case.storage_dtype, device=device)) for _ in range(case.num_layers)]
    layout = kvcore.build_layout(case.format, caches, dtype=case.dtype if case.dtype != case.storage_dtype else None)

    def new_staging_classic(t: int, dev):
        return _fill_staging(torch.empty(layout.staging_shape(t), dtype=case.dtype, device=dev))

    return layout, layout.stride_table(), new_staging_classic


def _pinned_like(staging, nbytes: int):
    """A pinned host copy of ``staging`` (tensor or dict) carved from one reusable buffer."""
    buf = _pinned("staging", nbytes)
    items = staging.items() if isinstance(staging, dict) else [("kv", staging)]
    out, off = {}, 0
    for k, t in items:
        n = t.numel() * t.element_size()
        h = buf[off : off + n].view(t.dtype).view(t.shape)
        h.view(torch.uint8).view(-1).copy_(t.contiguous().view(torch.uint8).view(-1))
        out[k] = h
        off += n
    return out if isinstance(staging, dict) else out["kv"]


# -- CLI ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kvcore bench``'s options to ``parser``."""
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="device of the cache (default: cuda when available)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small, fast matrix (seconds on an idle CPU): NHD, HND, MLA-bf16; block 16; T=256; 3 repeats of short samples; "
        "the reference kernel timed on the first case only",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    parser.add_argument("--layouts", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument(
        "--block-sizes",
        type=int_list(1, MAX_BLOCK_SIZE),
        default=None,
        help=f"comma-separated block sizes, 1..{MAX_BLOCK_SIZE} (default 16,64,256)",
    )
    parser.add_argument(
        "--tokens", type=int_list(1, MAX_TOKENS), default=None, help=f"comma-separated token counts, 1..{MAX_TOKENS} (default 256,8192)"
    )
    parser.add_argument(
        "--repeats",
        type=int_range(1, MAX_REPEATS),
        default=None,
        help=f"timed repeats per measurement, 1..{MAX_REPEATS}; the median is reported",
    )
    parser.add_argument(
        "--slots",
        choices=["blocks", "random"],
        default="blocks",
        help="the slot mapping: whole blocks in random order (a request's consecutive slots; the default) or a random "
        "permutation of the pool's slots",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="CPU rows: time by the wall clock (default) or by the process's CPU seconds (every thread's; on a shared host "
        "a call is not charged for time other processes ran; GB/s are then per CPU second)",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch reference kernel")
    parser.add_argument("--no-host", action="store_true", help="cuda: skip the pinned-host rows")
    parser.add_argument("--output", default=None, help="also write the JSON rows to this file (updated after every case)")
    parser.add_argument(
        "--max-seconds",
        type=float_range(0, 1e7),
        default=None,
        help="stop the matrix after this many seconds (partial table); a number above 0",
    )
    parser.add_argument(
        "--small",
        type=int_list(1, MAX_SMALL_TOKENS, allow_empty=True),
        default=(16,),
        help=f"token counts of the small-transfer rows, 1..{MAX_SMALL_TOKENS} (public API vs kernel vs per-layer "
        "index_select/index_copy_; '' for none)",
    )


#: bounds of the numeric options: a block of 64K tokens and 4M tokens in one transfer are far
#: beyond any engine's; what fits memory is checked per case before allocating (:func:`_fits`)
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKENS = 1 << 22
MAX_REPEATS = 100_000
#: the small-transfer rows use a 64-block pool of 16 tokens (:func:`bench_small`)
MAX_SMALL_TOKENS = 64 * 16


def _ints(s: str | tuple[int, ...] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """A list option's values (already parsed by :func:`kvcore.cli_args.int_list`; a string
    from code that builds the namespace itself is parsed the same way)."""
    if s is None or s == "":
        return default
    if isinstance(s, str):
        try:
            return int_list(1, MAX_TOKENS)(s)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"bench: {e}") from None
    return tuple(s)


def _case_bytes(case: Case, block_size: int, tokens: int, device: torch.device) -> int:
    """About the bytes :func:`bench_case` allocates for one case: the cache
    (``(sets + 1) * ceil(T / BS)`` blocks), the staging buffers and (CUDA) a pinned copy."""
    payload_token = _payload_per_token(case)
    nblk = -(-tokens // block_size)
    sets = max(1, min(8, math.ceil(_L2_ROTATE_BYTES / (payload_token * tokens)))) if device.type == "cuda" else 1
    cache = (sets + 1) * nblk * block_size * payload_token
    staging = sets * tokens * payload_token
    return cache + 2 * staging


def _available_bytes(device: torch.device) -> int | None:
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def format_table(rows: list[Row]) -> str:
    """A markdown table of ``rows``."""
    head = (
        "| layout | dtype | BS | T | direction | staging | kernel | MB | µs | GB/s | baseline GB/s | vs baseline | reference GB/s "
        "| vs reference | public API µs | public / kernel | graph µs | graph vs copy | public graph µs | slots | GB/s spread "
        "| vs baseline spread | public vs baseline (spread) |\n"
        "| --- | --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- | ---: | ---: | ---: |"
    )
    lines = [head]

    def num(v, fmt="{:.1f}", scale=1.0):
        return "-" if v is None else fmt.format(v * scale)

    def span(v, fmt, scale=1.0):  # lowest–highest over the repeats
        return "-" if v is None else f"{fmt.format(v[0] * scale)}–{fmt.format(v[1] * scale)}"

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    for r in rows:
        ref = "-" if r.reference_gbps is None else f"{r.reference_gbps:.1f}"
        vr = "-" if r.vs_reference is None else f"{r.vs_reference:.2f}x"
        lines.append(
            f"| {r.layout} | {r.dtype} | {r.block_size} | {r.tokens} | {r.direction} | {r.staging} | {r.kernel} | {r.mbytes:.1f} | "
            f"{r.seconds * 1e6:.1f} | {r.gbps:.1f} | {r.baseline_gbps:.1f} | {100 * r.vs_copy:.1f}% | {ref} | {vr} | "
            f"{num(r.public_seconds, scale=1e6)} | {num(r.public_vs_kernel, '{:.3f}x')} | "
            + ("- | - |" if r.graph_seconds is None else f"{r.graph_seconds * 1e6:.1f} | {100 * r.graph_vs_copy:.1f}% |")
            + f" {num(r.public_graph_seconds, scale=1e6)} | {r.slots}{'' if r.clock == 'wall' else ', cpu clock'} | {span(r.gbps_range, '{:.1f}')} | "
            f"{span(r.vs_copy_range, '{:.1f}%', 100)} | {pct(r.public_vs_copy)}"
            + ("" if r.public_vs_copy_range is None else f" ({span(r.public_vs_copy_range, '{:.1f}', 100)})")
            + " |"
        )
    return "\n".join(lines)


@dataclass
class SmallRow:
    """A small transfer (a few tokens of every layer, as an offloading connector makes per
    step): the public API, the kernel entry and a per-layer torch baseline, µs per call."""

    device: str
    layout: str
    tokens: int
    num_blocks: int
    direction: str
    mbytes: float
    public_us: float
    kernel_us: float
    baseline: str
    baseline_us: float
    public_vs_baseline: float  # public time / baseline time (target on CPU: <= 1.5)
    threads: int


def bench_small(
    device: torch.device, *, tokens: int = 16, num_blocks: int = 64, repeats: int = 7, calls: int | None = None
) -> list[SmallRow]:
    """Llama-3-8B NHD (32 layers, 8 KV heads, head size 128, bf16, block 16): ``tokens``
    tokens gathered and scattered through ``kvcore.gather`` / ``kvcore.scatter`` (validation
    on), through the kernel entry, and through a per-layer ``index_select`` /
    ``index_copy_`` of the same rows (one torch call per layer over its ``[2, slots, NH*HS]``
    view), in one run, the functions taking turns."""
    import kvcore
    from kvcore.kernels import TransferPlan, select_kernel

    case = CASES["NHD"]
    bs = 16
    layout, table, new_staging = _setup(case, bs, num_blocks, device)
    gen = torch.Generator(device="cpu").manual_seed(3)
    slots = block_slots(tokens, bs, torch.randperm(num_blocks, generator=gen)[: -(-tokens // bs)]).to(device)
    out = new_staging(tokens, device)
    plan = TransferPlan(table=table, slots=slots, staging=out, num_valid=tokens)
    kernel = select_kernel(device.type, case.format, device.type, table)
    views = [c.view(2, num_blocks * bs, case.num_heads * case.head_size) for c in layout.kv_caches]
    per_layer = torch.empty(case.num_layers, 2, tokens, case.num_heads * case.head_size, dtype=case.dtype, device=device)
    random_fill(per_layer)

    def sel(i):
        for li, v in enumerate(views):
            torch.index_select(v, 1, slots, out=per_layer[li])

    def cpy(i):
        for li, v in enumerate(views):
            v.index_copy_(1, slots, per_layer[li])

    fns = {
        "pub-gather": lambda i: kvcore.gather(layout, slots, out),
        "pub-scatter": lambda i: kvcore.scatter(layout, slots, out),
        "gather": lambda i: kernel.gather(plan),
        "scatter": lambda i: kernel.scatter(plan),
        "index_select": sel,
        "index_copy_": cpy,
    }
    n = calls or (200 if device.type == "cuda" else 50)
    tm = _median_times(fns, device, repeats, n)
    mb = _payload_per_token(case) * tokens / 1e6
    rows = []
    for d, base in (("gather", "index_select"), ("scatter", "index_copy_")):
        rows.append(
            SmallRow(
                device=device.type,
                layout=case.label,
                tokens=tokens,
                num_blocks=num_blocks,
                direction=d,
                mbytes=mb,
                public_us=tm["pub-" + d] * 1e6,
                kernel_us=tm[d] * 1e6,
                baseline=f"per-layer {base}",
                baseline_us=tm[base] * 1e6,
                public_vs_baseline=tm["pub-" + d] / tm[base],
                threads=torch.get_num_threads(),
            )
        )
    return rows


def format_small(rows: list[SmallRow]) -> str:
    lines = [
        "| layout | T | NB | direction | MB | public API µs | kernel µs | baseline | baseline µs | public / baseline | threads |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.layout} | {r.tokens} | {r.num_blocks} | {r.direction} | {r.mbytes:.2f} | {r.public_us:.1f} | {r.kernel_us:.1f} | "
            f"{r.baseline} | {r.baseline_us:.1f} | {r.public_vs_baseline:.2f}x | {r.threads} |"
        )
    return "\n".join(lines)


#: ``--quick``: a matrix that runs in seconds (on CPU, ~10x less work than the defaults:
#: T=256 only, 3 repeats, ~20 ms samples; the reference kernel timed on the first case only)
QUICK = {
    "layouts": ("NHD", "HND", "MLA-bf16"),
    "block_sizes": (16,),
    "tokens": (256,),
    "repeats": 3,
    "sample_bytes": 40e6,
    "small_calls": 10,
}


class _Progress:
    """One line per finished case on stderr (CI logs, pipes), or a tqdm bar on a terminal."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="kvcore bench", unit="case", file=sys.stderr)
            except ImportError:  # pragma: no cover - tqdm is a dependency
                self.bar = None
        if self.bar is None:
            print(f"kvcore bench: {total} cases ({what})", file=sys.stderr, flush=True)

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def finished(self, label: str, rows: int, seconds: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(f"kvcore bench: [{self.done}/{self.total}] {label}: {rows} rows in {seconds:.1f} s", file=sys.stderr, flush=True)

    def note(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(f"kvcore bench: {msg}", file=sys.stderr)
        else:
            print(f"kvcore bench: {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        print(f"kvcore bench: done in {time.monotonic() - self.t0:.1f} s", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark matrix; exit code 0, or 2 for a usage error. Progress goes to
    stderr (one line per case when stderr is not a terminal), the table / JSON to stdout."""
    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_name == "cuda" and not torch.cuda.is_available():
        print("kvcore bench: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(dev_name)
    if args.quick:
        layouts = list(QUICK["layouts"])
        bss, toks = QUICK["block_sizes"], QUICK["tokens"]
    else:
        layouts = list(CASES)
        bss, toks = BLOCK_SIZES, TOKENS
    if args.layouts:
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        bad = [x for x in layouts if x not in CASES]
        if bad:
            print(f"kvcore bench: unknown layout(s) {bad}; choose from {', '.join(CASES)}", file=sys.stderr)
            return 2
    bss = _ints(args.block_sizes, bss)
    toks = _ints(args.tokens, toks)
    repeats = args.repeats or (QUICK["repeats"] if args.quick else 5)
    sample_bytes = QUICK["sample_bytes"] if args.quick else 400e6
    combos = [(CASES[lay], b, t) for lay in layouts for b in bss for t in toks]
    avail = _available_bytes(device)
    if avail is not None and combos:
        need, case, b, t = max(((_case_bytes(c, b, t, device), c, b, t) for c, b, t in combos), key=lambda x: x[0])
        if need > 0.8 * avail:
            raise UsageError(
                f"{case.label} with block size {b} and {t} tokens needs about {need / 2**30:.1f} GiB of {device.type} "
                f"memory, more than the {avail / 2**30:.1f} GiB available; give fewer --tokens (or --layouts / --block-sizes)"
            )
    rows: list[Row] = []
    meta = _meta(device)
    if args.quick:
        meta["quick"] = f"--quick: {repeats} repeats of ~{sample_bytes / 1e6:.0f} MB samples" + (
            "" if args.no_reference else "; the reference kernel timed on the first case only"
        )
    progress = _Progress(len(combos), f"{device.type}{', --quick' if args.quick else ''}, {repeats} repeats")
    if args.quick and not args.no_reference:
        progress.note("--quick: the reference kernel is timed on the first case only (other rows show '-')")
    t_start = time.monotonic()
    for i, (case, b, t) in enumerate(combos):
        if args.max_seconds and time.monotonic() - t_start > args.max_seconds:
            meta["truncated"] = f"stopped after {args.max_seconds} s (--max-seconds): {len(rows)} rows"
            progress.note(meta["truncated"])
            break
        label = f"{case.label} BS={b} T={t}"
        progress.start(label)
        t_case = time.monotonic()
        new = bench_case(
            case,
            b,
            t,
            device,
            repeats=repeats,
            with_reference=not args.no_reference and (i == 0 or not args.quick),
            host=not args.no_host,
            host_reference=(b == bss[0]),
            sample_bytes=sample_bytes,
            slots=getattr(args, "slots", "blocks"),
            clock=getattr(args, "clock", "wall"),
        )
        rows += new
        progress.finished(label, len(new), time.monotonic() - t_case)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.output:  # keep what is measured so far
            with open(args.output, "w") as f:
                json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    small: list[SmallRow] = []
    for t in _ints(args.small, ()):
        t_case = time.monotonic()
        got = bench_small(device, tokens=t, repeats=repeats, calls=QUICK["small_calls"] if args.quick else None)
        small += got
        progress.note(f"small transfers T={t}: {len(got)} rows in {time.monotonic() - t_case:.1f} s")
    progress.close()
    meta["loadavg_end"] = _loadavg()
    meta["clock"] = getattr(args, "clock", "wall") if device.type == "cpu" else "wall"
    data = [asdict(r) for r in rows]
    sdata = [asdict(r) for r in small]
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "rows": data, "small": sdata}, f, indent=1)
    if args.json:
        print(json.dumps({"meta": meta, "rows": data, "small": sdata}, indent=1))
    else:
        load = "" if meta["loadavg_start"] is None else f" | load average {meta['loadavg_start'][0]} -> {meta['loadavg_end'][0]}"
        print(f"# {meta['device_name']} | torch {meta['torch']} | {meta['threads']} threads{load}")
        if "quick" in meta:
            print(f"# {meta['quick']}")
        print(format_table(rows))
        if small:
            print()
            print(format_small(small))
    return 0


def _meta(device: torch.device) -> dict:
    from kvcore.kernels import _build

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    st = _build.status()
    return {
        "device": device.type,
        "device_name": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "native": {"loaded": st.loaded, "cuda": st.cuda, "reason": st.reason},
        "gbps_counts": "device rows: bytes read + bytes written; pinned rows: bytes crossing the host link once",
        "loadavg_start": _loadavg(),
        "cpu_model": _cpu_model() if device.type == "cpu" else None,
    }


def _cpu_model() -> str | None:
    """The CPU's model name (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _loadavg() -> list[float] | None:
    """The host's 1, 5 and 15 minute load averages (None where the OS has none): a shared
    machine's other work, to read CPU rows by."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="kvcore bench")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
