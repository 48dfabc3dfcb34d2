"""TensorRT-LLM's KV block pool, described for kvcore.

An example of an out-of-tree plugin: it uses only kvcore's public API (``kvcore``,
``kvcore.testing``) and is found through its distribution's ``[project.entry-points.kvcore]``
table. ``kvcore check trtllm`` runs the conformance suite on it.

Engine facts (read from the TensorRT-LLM repository: ``cpp/tensorrt_llm/batch_manager/
kvCacheManager.cpp`` ``WindowBlockManager::allocatePools``, ``cpp/tensorrt_llm/kernels/
kvCacheUtils.h`` ``KVBlockArray::getKVLocalIdx``, ``tensorrt_llm/_torch/pyexecutor/
resource_manager.py`` ``KVCacheManager.get_buffers``):

* The C++ block manager allocates **one tensor per pool holding all of the pool's layers**:
  ``cacheShape = {numPrimaryBlocks, numLayers, kvFactor, blockSize}`` with
  ``blockSize = numKvHeads * sizePerHead * tokensPerBlock``
  (``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp::WindowBlockManager::allocatePools``).
  ``kvFactor`` is 2 (K, V), or 1 for ``CacheType::kSELFKONLY`` (MLA).
* Inside one (block, layer, K|V) chunk the attention kernels address
  ``headIdx * tokensPerBlock * dimsPerHead + localToken * dimsPerHead + channel``
  (``cpp/tensorrt_llm/kernels/kvCacheUtils.h::KVBlockArray::getKVLocalIdx``): heads outside
  tokens, HND. So the pool viewed as ``[NB, NL, 2, NH, BS, HS]`` is ``NB_NL_TWO_NH_BS_HS``.
* MLA: ``num_kv_heads = 1`` and ``head_dim = kv_lora_rank + qk_rope_head_dim`` (576 for
  DeepSeek-V3) with kv_factor 1 (``tensorrt_llm/_torch/pyexecutor/_util.py``), so the pool
  viewed as ``[NB, NL, 1, BS, HS]`` is ``NB_NL_ONE_BS_HS``.
* ``tokens_per_block`` defaults to 32 and must be a power of two greater than 1
  (``tensorrt_llm/llmapi/llm_args.py::KvCacheConfig.tokens_per_block``).
* The pool's dtype is the model dtype or FP8 (e4m3); INT8 KV caches are stored as int8.
  (FP4 keeps a separate block-scale pool: not described here.)

The flat last axis does not show its factors, so detection needs the manager's
``num_kv_heads``, ``tokens_per_block`` and ``head_dim`` as hints (the names
``KVCacheManager`` uses, and LMCache's TRT-LLM detector's hint vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import Candidate, DetectionError, GeometryError, Hint, KVFormat, Source, hookimpl, memory_ordered, resolve
from kvcore.testing import FixtureCase, Writer

ENGINES = ("trtllm", "tensorrt_llm", "tensorrt-llm")
HND = "NB_NL_TWO_NH_BS_HS"
MLA = "NB_NL_ONE_BS_HS"
HINTS = ("num_kv_heads", "tokens_per_block", "head_dim")

_POOL = Source(
    engine="tensorrt_llm", version="main", file="cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp::WindowBlockManager::allocatePools"
)
_HND_SRC = Source(engine="tensorrt_llm", version="main", file="cpp/tensorrt_llm/kernels/kvCacheUtils.h::KVBlockArray::getKVLocalIdx")
_MLA_SRC = Source(
    engine="tensorrt_llm", version="main", file="tensorrt_llm/_torch/pyexecutor/_util.py (CacheType.SELFKONLY, num_kv_heads=1)"
)


@hookimpl
def kvcore_register_formats(register):
    register(
        KVFormat(
            name=HND,
            engines=["trtllm"],
            attention_backends=["TRTLLM"],
            description="TensorRT-LLM block pool [NB, NL, 2, BS*NH*HS], HND inside each (block, layer, K|V) chunk",
            sources=[_POOL, _HND_SRC],
        )
    )
    register(
        KVFormat(
            name=MLA,
            engines=["trtllm"],
            attention_backends=["TRTLLM"],
            description="TensorRT-LLM MLA block pool [NB, NL, 1, BS*HS] (kv_factor 1, one latent head)",
            sources=[_POOL, _MLA_SRC],
        )
    )


@hookimpl
def kvcore_register_hints(register):
    """The KVCacheManager facts the flat pool needs (``kvcore hints trtllm``)."""
    manager = "tensorrt_llm/_torch/pyexecutor/resource_manager.py::KVCacheManager"
    register(
        Hint(
            engine="trtllm", name="num_kv_heads", meaning="KV heads per rank (KVCacheManager.num_kv_heads)", type="int > 0", source=manager
        )
    )
    register(
        Hint(
            engine="trtllm",
            name="tokens_per_block",
            meaning="tokens per block (KvCacheConfig.tokens_per_block, a power of two > 1)",
            type="int > 0",
            default="required: the pool's last axis does not show it",
            source="tensorrt_llm/llmapi/llm_args.py::KvCacheConfig.tokens_per_block",
        )
    )
    register(
        Hint(
            engine="trtllm",
            name="head_dim",
            meaning="elements per head (MLA: kv_lora_rank + qk_rope_head_dim)",
            type="int > 0",
            source=manager,
        )
    )
    register(
        Hint(
            engine="trtllm",
            name="kv_layout",
            meaning="the head order inside a block; this plugin describes the HND blocks TRT-LLM's attention kernels write",
            values=["HND", "NHD"],
            default="HND",
            source="cpp/tensorrt_llm/kernels/kvCacheUtils.h::KVBlockArray::getKVLocalIdx",
        )
    )


def _hint_int(hints: dict, key: str) -> int:
    v = hints.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise DetectionError(f"trtllm: hint {key}={v!r} must be a positive int (KVCacheManager.{key})")
    return v


#: the manager's names for the geometry the core compares between readings
GEOMETRY_HINTS = {"block_size": "tokens_per_block", "num_heads": "num_kv_heads", "head_size": "head_dim"}


@hookimpl
def kvcore_detect(kv_caches: Any, engine: str, hints: dict) -> Any:
    """Recognise the pool tensor ``[NB, NL, kv_factor, BS*NH*HS]``, or its canonical view
    ``[NB, NL, 2, NH, BS, HS]`` / ``[NB, NL, 1, BS, HS]`` (what a detected layout holds:
    detection is idempotent on its own normal form).

    The flat 4-D pool needs the hints ``num_kv_heads``, ``tokens_per_block``, ``head_dim``;
    the canonical view carries them, and hints given with it must agree.

    Raises:
        DetectionError: not one pool, a hint missing or contradicting the shape, the hints
            do not factor the last axis, kv_factor not 1 or 2, kv_factor 1 with more than
            one head, ``kv_layout="NHD"`` with several heads (this plugin describes the HND
            blocks the TRT-LLM attention kernels write), or a canonical view whose strides
            show tokens outside heads (not what those kernels write).
    """
    if engine not in ENGINES:
        return None
    pool = kv_caches
    if isinstance(pool, (list, tuple)):
        if len(pool) != 1:
            raise DetectionError(
                f"trtllm: TensorRT-LLM keeps all layers of a pool in one tensor, got a list of {len(pool)}; pass "
                "KVCacheManager.get_unique_primary_pool() (detect each pool of a VSWA/VGQA model on its own)"
            )
        pool = pool[0]
    if isinstance(pool, torch.Tensor) and pool.dim() in (5, 6):
        return _canonical(pool, hints)
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
        what = f"a {pool.dim()}-D tensor {tuple(pool.shape)}" if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise DetectionError(
            f"trtllm: expected the 4-D block pool [num_blocks, num_layers, kv_factor, tokens*heads*head_dim] (or its canonical "
            f"view [NB, NL, 2, NH, BS, HS] / [NB, NL, 1, BS, HS]), got {what}"
        )
    missing = [k for k in HINTS if k not in hints]
    if missing:
        raise DetectionError(
            f"trtllm: the pool's last axis {pool.shape[-1]} is tokens_per_block * num_kv_heads * head_dim; pass hints "
            f"{', '.join(missing)} (from the KVCacheManager)"
        )
    nh, bs, hd = (_hint_int(hints, k) for k in HINTS)
    nb, nl, kvf, flat = (int(x) for x in pool.shape)
    if nh * bs * hd != flat:
        raise DetectionError(
            f"trtllm: the pool's last axis holds {flat} elements but tokens_per_block*num_kv_heads*head_dim = "
            f"{bs}*{nh}*{hd} = {bs * nh * hd}; the hints do not describe this pool"
        )
    if kvf == 2:
        return _decide(pool.unflatten(-1, (nh, bs, hd)), hints, f"TRT-LLM pool, {nl} layers, HND blocks of {bs} tokens")
    if kvf == 1:
        if nh != 1:
            raise DetectionError(f"trtllm: kv_factor 1 is the MLA (SELFKONLY) pool with one latent head, but num_kv_heads={nh}")
        return _decide(pool.unflatten(-1, (nh, bs, hd)).squeeze(3), hints, f"TRT-LLM MLA pool, {nl} layers, latent {hd}", heads=nh)
    raise DetectionError(f"trtllm: kv_factor (axis 2) is {kvf}; TensorRT-LLM pools have 2 (K, V) or 1 (MLA)")


def _canonical(view: torch.Tensor, hints: dict) -> Any:
    """``[NB, NL, 2, NH, BS, HS]`` or ``[NB, NL, 1, BS, HS]``: the geometry is in the shape;
    given hints must agree with it."""
    if view.dim() == 6:
        _, nl, kvf, nh, bs, hd = (int(x) for x in view.shape)
    else:
        (_, nl, kvf, bs, hd), nh = (int(x) for x in view.shape), 1
    if kvf not in (1, 2) or (view.dim() == 6) != (kvf == 2):
        raise DetectionError(
            f"trtllm: a {view.dim()}-D tensor {tuple(view.shape)} is no TRT-LLM pool view: [NB, NL, 2, NH, BS, HS] (K, V) "
            "or [NB, NL, 1, BS, HS] (MLA)"
        )
    shape = {"num_kv_heads": nh, "tokens_per_block": bs, "head_dim": hd}
    wrong = {k: (hints[k], v) for k, v in shape.items() if k in hints and hints[k] != v}
    if wrong:
        said = ", ".join(f"{k}={given!r} (the view has {v})" for k, (given, v) in wrong.items())
        raise DetectionError(f"trtllm: the hints contradict the pool view {tuple(view.shape)}: {said}")
    what = "HND blocks" if kvf == 2 else "MLA latent"
    return _decide(view, hints, f"TRT-LLM pool view, {nl} layers, {what} of {bs} tokens", heads=nh)


def _decide(view: torch.Tensor, hints: dict, note: str, *, heads: int | None = None) -> Any:
    """The pool view (6-D K/V or 5-D MLA) as this plugin's format. The name is the memory
    order, so the view's strides must follow its axes: a view whose strides put tokens
    outside heads is not what TRT-LLM's kernels write."""
    nh = heads if heads is not None else int(view.shape[3])
    layout = str(hints.get("kv_layout", "HND")).upper()
    if view.dim() == 6 and layout == "NHD" and nh > 1:
        raise DetectionError(
            "trtllm: kv_layout='NHD' reads the pool's blocks as [tokens, heads, dim]; this plugin describes the "
            "HND blocks TensorRT-LLM's attention kernels write (kvCacheUtils.h::KVBlockArray::getKVLocalIdx)"
        )
    if view.dim() == 5 and nh != 1:
        raise DetectionError(f"trtllm: kv_factor 1 is the MLA (SELFKONLY) pool with one latent head, but num_kv_heads={nh}")
    if not memory_ordered(view):
        raise DetectionError(
            f"trtllm: the pool view {tuple(view.shape)} has strides {tuple(view.stride())}, whose memory order is not its axis "
            "order (e.g. tokens outside heads); TensorRT-LLM's pool is one contiguous [NB, NL, kv_factor, NH*BS*HS] tensor, "
            "HND inside each block: pass the pool itself or its canonical view"
        )
    fmt = HND if view.dim() == 6 else MLA
    det = resolve([Candidate(fmt, view, note=note)], engine="trtllm", geometry_hints=GEOMETRY_HINTS, required=True)
    return det


# -- fixtures: allocate as the engine does, and read back as its kernels do -------------------


def _allocate(sizes: dict, dtype: torch.dtype, device: Any, kv_factor: int) -> tuple[torch.Tensor, dict]:
    """``WindowBlockManager::allocatePools``: one pool ``[blocks, layers, kvFactor, blockSize]``."""
    bs = int(sizes["block_size"])
    if bs < 2 or bs & (bs - 1):
        raise GeometryError(f"TensorRT-LLM's tokens_per_block must be a power of two > 1, got {bs}")
    nh = int(sizes["num_heads"])
    if kv_factor == 1 and nh != 1:
        raise GeometryError(f"a TensorRT-LLM MLA pool has one latent head, got num_heads={nh}")
    hs = int(sizes["head_size"])
    pool = torch.empty((sizes["num_blocks"], sizes["num_layers"], kv_factor, bs * nh * hs), dtype=dtype, device=device)
    return pool, {"num_kv_heads": nh, "tokens_per_block": bs, "head_dim": hs}


def _view(pool: torch.Tensor, layer: int, kv: int, *, hints: dict) -> torch.Tensor:
    """``KVBlockArray::getKVLocalIdx``: element (head, token, channel) of a (block, layer,
    K|V) chunk sits at ``head*tokens*dim + token*dim + channel``. Returned as the contract's
    ``[NB, BS, NH, HS]``."""
    nh, bs, hd = hints["num_kv_heads"], hints["tokens_per_block"], hints["head_dim"]
    chunk = pool[:, layer, kv]  # [NB, BS*NH*HS]
    return chunk.unflatten(-1, (nh, bs, hd)).transpose(1, 2)


def _write(pool: torch.Tensor, slots: torch.Tensor, rows: dict, *, hints: dict) -> None:
    """The attention kernels' store, transcribed: element ``(head, token, channel)`` of token
    ``slot`` of a layer's K (V) goes to flat element ``((block * NL + layer) * kvFactor + kv) *
    blockSize + head * tokensPerBlock * dimsPerHead + token * dimsPerHead + channel`` of the
    pool (``kvCacheManager.cpp::WindowBlockManager::allocatePools`` for the chunk,
    ``kvCacheUtils.h::KVBlockArray::getKVLocalIdx`` inside it). Per-element address arithmetic
    on the flat pool, not a view: TensorRT-LLM itself does not run on this machine, so this is
    a transcription of its kernel's addressing, reported as such (``origin="transcribed"``)."""
    nh, bs, hd = hints["num_kv_heads"], hints["tokens_per_block"], hints["head_dim"]
    nb, nl, kvf, block = (int(x) for x in pool.shape)
    flat = pool.reshape(-1)  # the pool is one contiguous allocation
    slot = slots.to(pool.device).view(-1, 1, 1)
    head = torch.arange(nh, device=pool.device).view(1, -1, 1)
    chan = torch.arange(hd, device=pool.device).view(1, 1, -1)
    for layer in range(nl):
        for kv, role in enumerate(("K", "V")[:kvf]):
            base = ((slot // bs * nl + layer) * kvf + kv) * block
            idx = base + head * bs * hd + (slot % bs) * hd + chan
            flat[idx.reshape(-1)] = rows[role][layer].reshape(-1)


WRITER = Writer(
    name="TensorRT-LLM KVBlockArray::getKVLocalIdx",
    write=_write,
    origin="transcribed",
    source="tensorrt_llm main cpp/tensorrt_llm/kernels/kvCacheUtils.h::KVBlockArray::getKVLocalIdx; "
    "cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp::WindowBlockManager::allocatePools",
)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8)


def _case(name: str, fmt: str, kv_factor: int, sizes: dict, source: Source, block_sizes: tuple[int, ...]) -> FixtureCase:
    return FixtureCase(
        name=name,
        engine="trtllm",
        format=fmt,
        make=lambda sizes, dtype, device: _allocate(sizes, dtype, device, kv_factor),
        kv_view=_view,
        sizes=sizes,
        dtypes=_DTYPES,
        source=f"{_POOL}; {source}",
        size_constraints={"block_size_choices": block_sizes},
        writer=WRITER,
    )


@hookimpl
def kvcore_register_fixtures(register):
    register(
        _case(
            "trtllm-pool-HND",
            HND,
            2,
            {"num_layers": 3, "num_blocks": 4, "block_size": 8, "num_heads": 2, "head_size": 16},
            _HND_SRC,
            (2, 4, 8, 16, 32),
        )
    )
    register(
        _case(
            "trtllm-pool-MLA",
            MLA,
            1,
            {"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 1, "head_size": 576},
            _MLA_SRC,
            (2, 4, 8, 32),
        )
    )


__all__ = ["ENGINES", "HND", "MLA", "HINTS", "GEOMETRY_HINTS"]
