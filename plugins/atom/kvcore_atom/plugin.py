"""The ATOM engine's (``ROCm/ATOM``) MLA KV caches, described for kvcore (engine ``"atom"``).

LMCache 0.5.6 detects ATOM's caches (``lmcache/v1/gpu_connector/kv_format/detectors/atom.py``:
"per-layer paged latent and index cache views", ``[num_blocks, block_size, width]``, all read
as ``NL_X_NB_BS_HS``). What ATOM allocates and writes, read from ATOM's and aiter's source
(ROCm/ATOM main, 2026-08; ROCm/aiter main, 2026-08):

* **Allocation** (``atom/model_ops/attentions/aiter_mla.py::AiterMLAMetadataBuilder.
  allocate_kv_cache_tensors``, called by ``atom/model_engine/model_runner.py::ModelRunner.
  allocate_kv_cache``): one tensor for every layer, ``kv_cache = torch.zeros(total_num_layers,
  num_physical_kvcache_blocks, physical_block_size, 576, dtype=kv_cache_dtype)`` -- the MLA
  latent (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, "single 576-dim paged tensor per
  layer"), bf16 or fp8 -- and for DeepSeek-V3.2 / GLM-5 sparse attention
  ``index_cache = torch.zeros(total_num_layers, num_physical_kvcache_blocks,
  physical_block_size, aligned, dtype=dtypes.fp8)`` with ``aligned = round_up(index_head_dim
  + 4, 16)`` (144 for ``index_head_dim`` 128: "align last dimension to 16 bytes for fp8").
  A layer's caches are ``kv_cache[layer_id]`` / ``index_cache[layer_id]``
  (``build_kv_cache_tensor``; ``atom/config.py::KVCacheTensor.index_cache``: "block-major
  (num_blocks, block_size, aligned_index_dim)").
* **Latent writer**: ``module.kv_cache = kv_cache[layer_id].view(num_slots, 1, 576)`` and
  aiter's ``concat_and_cache_mla`` (``csrc/kernels/cache_kernels.cu::
  concat_and_cache_mla_kernel``): token ``slot`` at ``block_idx * block_stride + block_offset *
  entry_stride`` -- one contiguous 576-element row per token slot: ``NL_X_NB_BS_HS``.
* **Index writer**: ``atom/models/deepseek_v2.py`` views the cache
  ``kv_cache.view(-1, kv_cache_block_size, width)`` and calls aiter's
  ``indexer_k_quant_and_cache(..., preshuffle=True)`` (``cache_kernels.cu::
  indexer_k_quant_and_cache_kernel``): a block's ``BS * width`` bytes hold the fp8 keys in
  16-token x 16-byte tiles (``token_tile * 16 * head_dim + col_tile * 256 + token_in_tile *
  16 + col_in_tile``), then one fp32 scale per token at ``BS * head_dim + token * 4``
  (``quant_block_size == head_dim``), then ``BS * (width - head_dim - 4)`` bytes of padding.
  No single strided row holds a token's key: ``K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS``
  (the name kvcore-vllm gives ROCm's tiled indexer page), planes viewed as bytes and staged
  apart (``{"K": [NL, T, head_dim], "KS": [NL, T, 4]}`` uint8). LMCache reads these pages as
  144-byte rows per token, which moves whole blocks right and single tokens wrong.

Which is which: the latent is 576 wide in any dtype (the builder hard-codes it); the index
cache is fp8 of another width. The hint ``kind`` (``"latent"`` / ``"index"``) says it
outright; ``index_head_dim`` fixes the key width (default: the multiple of 16 that rounds up
to the width with its 4 scale bytes). The index pages need a block size that is a multiple
of 16 (aiter refuses preshuffle otherwise), the writer's ``kv_cache_block_size``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import Detection, DetectionError, GeometryError, Hint, KVFormat, Source, hookimpl
from kvcore.detection import describe_input
from kvcore.testing import FixtureCase, TokenGroups

__all__ = ["LATENT_FORMAT", "INDEX_FORMAT", "LATENT_WIDTH", "allocate", "latent_view", "index_view", "detect_atom"]

ENGINE = "atom"
LATENT_FORMAT = "NL_X_NB_BS_HS"
INDEX_FORMAT = "K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS"
#: ATOM's MLA latent width (kv_lora_rank + qk_rope_head_dim), hard-coded by the builder
LATENT_WIDTH = 576
#: aiter's preshuffle tile: 16 tokens x 16 bytes (indexer_k_quant_and_cache_kernel, TILE = 16)
TILE = 16
SCALE_BYTES = 4  # one fp32 scale per token (quant_block_size == head_dim)

_ALLOC = Source(
    engine="atom", version="main", file="atom/model_ops/attentions/aiter_mla.py::AiterMLAMetadataBuilder.allocate_kv_cache_tensors"
)
_BIND = Source(engine="atom", version="main", file="atom/model_ops/attentions/aiter_mla.py::AiterMLAMetadataBuilder.build_kv_cache_tensor")
_LATENT_W = Source(engine="atom", version="aiter main", file="csrc/kernels/cache_kernels.cu::concat_and_cache_mla_kernel")
_INDEX_W = Source(
    engine="atom",
    version="main / aiter main",
    file="atom/models/deepseek_v2.py (kv_cache.view(-1, kv_cache_block_size, width), preshuffle=True); aiter "
    "csrc/kernels/cache_kernels.cu::indexer_k_quant_and_cache_kernel",
)
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@hookimpl
def kvcore_register_formats(register):
    register(
        KVFormat(
            name=LATENT_FORMAT,
            engines=[ENGINE],
            attention_backends=["ATOM aiter MLA"],
            description="ATOM MLA latent: per layer kv_cache[layer] (num_blocks, block_size, 576), one row per token slot",
            sources=[_ALLOC, _BIND, _LATENT_W],
        )
    )
    register(
        KVFormat(
            name=INDEX_FORMAT,
            engines=[ENGINE],
            attention_backends=["ATOM aiter sparse MLA indexer"],
            description="ATOM DSA index cache: per layer index_cache[layer] (num_blocks, block_size, round16(index_head_dim + 4)) "
            "fp8: a block's keys in 16x16-byte tiles, then its fp32 scales, then padding",
            sources=[_ALLOC, _BIND, _INDEX_W],
        )
    )


@hookimpl
def kvcore_register_hints(register):
    register(
        Hint(
            engine=ENGINE,
            name="kind",
            meaning="which of ATOM's per-layer caches these are: the MLA latent (kv_cache) or the DSA index cache (index_cache)",
            values=["latent", "index"],
            default="576 wide: latent; fp8 of another width: index",
            source=_ALLOC.file,
        )
    )
    register(
        Hint(
            engine=ENGINE,
            name="index_head_dim",
            meaning="the indexer's key width (hf_config.index_head_dim, 128 for DeepSeek-V3.2); the cache row is "
            "round_up(index_head_dim + 4, 16) bytes",
            type="int > 0, a multiple of 16",
            default="the multiple of 16 that rounds up to the row width with its 4 scale bytes",
            source=_ALLOC.file,
        )
    )
    register(
        Hint(
            engine=ENGINE,
            name="block_size",
            aliases=["kv_cache_block_size"],
            meaning="tokens per block of the tensors (ATOM's kv_cache_block_size for the index cache's writer)",
            type="int > 0",
            default="from the shapes",
            source="atom/config.py::Config.kv_cache_block_size",
        )
    )


_KNOWN = {"kind", "index_head_dim", "block_size", "kv_cache_block_size", "tensor_order", "page_size", "tokens_per_block", "layer_groups"}


def _index_head_dim(width: int, hint: Any) -> int:
    if hint is not None:
        if isinstance(hint, bool) or not isinstance(hint, int) or hint <= 0 or hint % TILE:
            raise DetectionError(f"atom: index_head_dim={hint!r} must be a positive multiple of 16 (aiter's preshuffle tiles)")
        if -(-(hint + SCALE_BYTES) // TILE) * TILE != width:
            raise DetectionError(
                f"atom: index_head_dim={hint} gives rows of round_up({hint} + 4, 16) = {-(-(hint + 4) // 16) * 16} bytes, but the "
                f"tensors' rows are {width} bytes"
            )
        return hint
    d = (width - SCALE_BYTES) // TILE * TILE
    if d <= 0 or -(-(d + SCALE_BYTES) // TILE) * TILE != width:
        raise DetectionError(
            f"atom: an index cache row is round_up(index_head_dim + 4, 16) bytes (aiter_mla.py), a multiple of 16; {width} is not"
        )
    return d


@hookimpl
def kvcore_detect(kv_caches: Any, engine: str, hints: dict) -> Any:
    if engine != ENGINE:
        return None
    return detect_atom(kv_caches, hints or {})


def detect_atom(kv_caches: Any, hints: dict) -> Detection:
    """ATOM's per-layer latent or index caches (see the module docstring).

    Raises:
        DetectionError: not a list of rank-3 per-layer tensors of one shape and dtype, an
            unknown hint, a hint the tensors contradict, an index cache of a width no
            ``index_head_dim`` gives, or index pages whose block size is not a multiple of 16.
    """
    unknown = sorted(set(hints) - _KNOWN)
    if unknown:
        raise DetectionError(f"atom: unknown hint(s) {unknown}; accepted: {sorted(_KNOWN - {'layer_groups'})}")
    items = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches) if isinstance(kv_caches, (list, tuple)) else None
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise DetectionError(
            "atom: expected ATOM's per-layer caches, a list of [num_blocks, block_size, width] tensors (kv_cache[layer] or "
            "index_cache[layer])"
        )
    t0 = items[0]
    if t0.dim() == 4 and isinstance(kv_caches, torch.Tensor):
        items = list(t0.unbind(0))  # the runner's whole kv_cache / index_cache (num_layers, NB, BS, W)
        t0 = items[0]
    if any(t.dim() != 3 or t.shape != t0.shape or t.dtype != t0.dtype for t in items):
        raise DetectionError(
            "atom: ATOM's caches are per layer [num_blocks, block_size, width] of one shape and dtype "
            f"({_ALLOC.file}); got:\n{describe_input(items)}"
        )
    nb, bs, w = (int(x) for x in t0.shape)
    given_bs = next(
        (hints[k] for k in ("block_size", "kv_cache_block_size", "page_size", "tokens_per_block") if hints.get(k) is not None), None
    )
    if given_bs is not None and given_bs != bs:
        raise DetectionError(f"atom: block_size={given_bs} but the tensors hold blocks of {bs} tokens")
    kind = hints.get("kind")
    if kind not in (None, "latent", "index"):
        raise DetectionError(f"atom: kind={kind!r}; accepted: 'latent', 'index'")
    if kind is None:
        kind = "latent" if w == LATENT_WIDTH or t0.dtype not in (*_FP8, torch.uint8) else "index"
    for t in items:
        if t.stride(2) != 1 or t.stride(1) != w or t.stride(0) < bs * w:
            raise DetectionError(
                f"atom: ATOM's per-layer caches are contiguous [NB, BS, W] pages (torch.zeros(...)[layer]); strides "
                f"{tuple(t.stride())} are not:\n{describe_input(items)}"
            )
    if kind == "latent":
        if hints.get("index_head_dim") is not None:
            raise DetectionError("atom: index_head_dim describes the index cache, but kind='latent'")
        return Detection(format=LATENT_FORMAT, kv_caches=items, note=f"ATOM MLA latent, {w} wide ({_ALLOC.file})")
    if t0.dtype not in (*_FP8, torch.uint8):
        raise DetectionError(f"atom: ATOM's index cache is fp8 (dtypes.fp8, {_ALLOC.file}); these tensors are {t0.dtype}")
    d = _index_head_dim(w, hints.get("index_head_dim"))
    if bs % TILE:
        raise DetectionError(
            f"atom: index pages are written in 16-token tiles of kv_cache_block_size tokens (aiter preshuffle needs "
            f"cache_block_size % 16 == 0); these views hold blocks of {bs}: view the index cache with the writer's block size"
        )
    keys, scales = [], []
    for t in items:
        b = t.view(torch.uint8)
        sb, off = b.stride(0), b.storage_offset()
        keys.append(torch.as_strided(b, (nb, bs // TILE, d // TILE, TILE, TILE), (sb, TILE * d, TILE * TILE, TILE, 1), off))
        scales.append(torch.as_strided(b, (nb, bs, SCALE_BYTES), (sb, SCALE_BYTES, 1), off + bs * d))
    return Detection(
        format=INDEX_FORMAT,
        kv_caches={"K": keys, "KS": scales},
        note=f"ATOM DSA index cache: {d}-byte fp8 keys in 16x16 tiles, fp32 scales, {bs * (w - d - SCALE_BYTES)} pad bytes per block",
    )


# -- fixtures: allocate as ATOM does, read back as aiter's writers address it ------------------


def allocate(
    kind: str, *, num_layers: int, num_blocks: int, block_size: int, width: int | None = None, dtype=torch.bfloat16, device: Any = "cpu"
) -> list[torch.Tensor]:
    """``[kv_cache[i] for i in range(num_layers)]`` (``kind="latent"``, ``dtype``, width 576 by
    default) or ``[index_cache[i] ...]`` (``kind="index"``, fp8 ``dtype``, width
    ``round_up(128 + 4, 16)`` = 144 by default), each a slice of one
    ``torch.zeros(num_layers, num_blocks, block_size, width)`` as
    ``allocate_kv_cache_tensors`` makes it.

    Raises:
        GeometryError: an unknown kind or a size below 1.
    """
    if kind not in ("latent", "index"):
        raise GeometryError(f"kind must be 'latent' or 'index', got {kind!r}")
    w = width or (LATENT_WIDTH if kind == "latent" else 144)
    if min(num_layers, num_blocks, block_size, w) < 1:
        raise GeometryError("every size of an ATOM cache is at least 1")
    whole = torch.zeros(num_layers, num_blocks, block_size, w, dtype=dtype, device=device)
    return [whole[i] for i in range(num_layers)]


def latent_view(kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
    """What ``concat_and_cache_mla`` writes: ``kv_cache[layer].view(num_slots, 1, 576)``, row
    ``slot`` = the token's latent; as the contract's ``[NB, BS, 1, 576]``."""
    t = kv_caches[layer]
    nb, bs, w = t.shape
    return t.reshape(nb * bs, 1, w).unflatten(0, (nb, bs))


def index_view(kv_caches: Any, layer: int, plane: int) -> Any:
    """aiter's ``indexer_k_quant_and_cache_kernel`` (preshuffle) addressing, restated: the
    keys as :class:`kvcore.testing.TokenGroups` ``[NB, BS/16, 16, 1, d/16, 16]`` -- token t's
    byte e at ``page + (t//16)*16*d + (e//16)*256 + (t%16)*16 + e%16`` -- and the scales
    ``[NB, BS, 1, 4]`` at ``page + BS*d + t*4`` (``page = block * BS * width``)."""
    t = kv_caches[layer].view(torch.uint8)
    nb, bs, w = t.shape
    d = (w - SCALE_BYTES) // TILE * TILE
    page, off = bs * w, t.storage_offset()
    if plane == 0:
        keys = torch.as_strided(t, (nb, bs // TILE, TILE, d // TILE, TILE), (page, TILE * d, TILE, TILE * TILE, 1), off)
        return TokenGroups(keys.unsqueeze(3))
    if plane == 1:
        return torch.as_strided(t, (nb, bs, SCALE_BYTES), (page, SCALE_BYTES, 1), off + bs * d).unsqueeze(2)
    raise GeometryError(f"an ATOM index page has two planes (keys, scales); plane {plane} does not exist")


@hookimpl
def kvcore_register_fixtures(register):
    def make_latent(sizes: dict, dtype: torch.dtype, device: Any):
        return allocate(
            "latent",
            num_layers=sizes["num_layers"],
            num_blocks=sizes["num_blocks"],
            block_size=sizes["block_size"],
            dtype=dtype,
            device=device,
        ), {}

    register(
        FixtureCase(
            name="atom-mla-latent",
            engine=ENGINE,
            format=LATENT_FORMAT,
            make=make_latent,
            kv_view=latent_view,
            sizes={"num_layers": 2, "num_blocks": 3, "block_size": 16, "num_heads": 1, "head_size": LATENT_WIDTH},
            dtypes=(torch.bfloat16, torch.float16, torch.float8_e4m3fnuz, torch.float8_e4m3fn),
            source=f"atom {_ALLOC.file}; aiter {_LATENT_W.file}",
            size_constraints={"fixed": ("num_heads", "head_size")},
        )
    )

    def make_index(sizes: dict, dtype: torch.dtype, device: Any):
        if sizes["block_size"] % TILE:
            raise GeometryError(f"aiter's preshuffled index pages need block_size % 16 == 0, got {sizes['block_size']}")
        kv = allocate(
            "index",
            num_layers=sizes["num_layers"],
            num_blocks=sizes["num_blocks"],
            block_size=sizes["block_size"],
            dtype=torch.float8_e4m3fnuz,
            device=device,
        )
        return [t.view(torch.uint8) for t in kv] if dtype == torch.uint8 else kv, {"index_head_dim": 128}

    register(
        FixtureCase(
            name="atom-dsa-index",
            engine=ENGINE,
            format=INDEX_FORMAT,
            make=make_index,
            kv_view=index_view,
            sizes={"num_layers": 2, "num_blocks": 3, "block_size": 32, "num_heads": 1, "head_size": 128},
            dtypes=(torch.uint8,),
            source=f"atom {_ALLOC.file}; {_INDEX_W.file}",
            size_constraints={"fixed": ("num_heads", "head_size"), "block_size_multiple": 16},
        )
    )
