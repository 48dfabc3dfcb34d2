"""The benchmarked layouts (:data:`CASES`: a label, a grammar name, a model's sizes) and how
their caches, staging buffers and slot mappings are allocated (random bytes, the format's
own tensors; also used by the tests and ``scripts/gpu_check.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import kvcore
from kvcore import grammar
from kvcore.errors import GeometryError
from kvcore.spec import Plane, PlaneStrides, StagingBuffer, StagingTarget, StrideTable


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
    syn = grammar.parse(name)
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
    syn = grammar.parse(name)
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

    syn = grammar.parse(case.format)
    per_layer = [int({"TWO": 2, "NB": num_blocks, "BS": block_size, "NH": case.num_heads, "HS": case.head_size}[t]) for t in syn.axes]
    caches = [random_fill(torch.empty(per_layer, dtype=case.storage_dtype, device=device)) for _ in range(case.num_layers)]
    layout = kvcore.build_layout(case.format, caches, dtype=case.dtype if case.dtype != case.storage_dtype else None)

    def new_staging_classic(t: int, dev):
        return _fill_staging(torch.empty(layout.staging_shape(t), dtype=case.dtype, device=dev))

    return layout, layout.stride_table(), new_staging_classic


def _case_bytes(case: Case, block_size: int, tokens: int, device: torch.device) -> int:
    """About the bytes :func:`bench_case` allocates for one case: the cache
    (``(sets + 1) * ceil(T / BS)`` blocks), the staging buffers and (CUDA) a pinned copy."""
    payload_token = _payload_per_token(case)
    nblk = -(-tokens // block_size)
    sets = max(1, min(8, math.ceil(_L2_ROTATE_BYTES / (payload_token * tokens)))) if device.type == "cuda" else 1
    cache = (sets + 1) * nblk * block_size * payload_token
    staging = sets * tokens * payload_token
    return cache + 2 * staging


_PINNED: dict[str, torch.Tensor] = {}


def _pinned(tag: str, nbytes: int) -> torch.Tensor:
    """A reusable pinned host buffer of at least ``nbytes`` (pinning is slow: reuse it)."""
    buf = _PINNED.get(tag)
    if buf is None or buf.numel() < nbytes:
        _PINNED.pop(tag, None)
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        _PINNED[tag] = buf
    return buf[:nbytes]


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
