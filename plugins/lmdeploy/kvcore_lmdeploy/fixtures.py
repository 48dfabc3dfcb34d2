"""Allocation fixtures: LMDeploy's caches per version, and the engine-side oracle views.

``make`` allocates through :func:`kvcore_lmdeploy.allocation.allocate` (LMDeploy's
``CacheEngine`` code path of that version) and hands over what a caller holds
(``gpu_cache``, the 0.6.4-0.10 ``full_gpu_cache`` tuple, or the 0.11+ uint8 pool). The
``kv_view`` oracles index LMDeploy's own per-layer caches the way its kernels address them
-- never kvcore's stride table:

* ``fill_kv_cache.py::fill_kv_cache`` / ``pagedattention.py::paged_attention_fwd``
  (``kv_layout='bshd'``: ``b_dim, s_dim, h_dim, d_dim = 0, 1, 2, 3``) read
  ``k_caches[block, token, head, d]`` of the layer's tensor, and the scale/zero tensors
  with the same (block, token, head) strides and ``d`` 0 (scale) / 1 (zero);
* the Cambricon backend's ``(NH, BS, HS)`` blocks are ``bhsd`` (``h_dim, s_dim = 1, 2``);
* 0.6.4+ layer ``l``'s tuple is ``(caches[0][l], caches[1][l], ...)`` (``list(zip(*caches))``),
  and for the 0.11+ pool the caches are the pool's slices (``allocate_caches``).

For multi-plane fixtures ``make``'s dtype is the value planes' (``uint8`` for int4 / int8 /
TurboQuant); the scales keep the fixture's model dtype. ``sizes["head_size"]`` is the value
planes' stored width: int4 and TurboQuant-K store ``head_dim // 2`` bytes, so the model's
``head_dim`` is twice it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.testing import FixtureCase
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.allocation import CacheConfig, allocate, generation, slice_pool

__all__ = ["CASES", "config_for", "make_case", "view_per_layer", "view_cross_layer", "view_pool"]

_FP8_POLICY = {torch.float8_e4m3fn: 16, torch.float8_e5m2: 17}
_DNAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)
_PLAIN_FP8 = (*_PLAIN, torch.float8_e4m3fn, torch.float8_e5m2)


def config_for(
    sizes: dict, dtype: torch.dtype, *, kind: str, device_type: str = "cuda", scale_dtype: torch.dtype = torch.bfloat16
) -> CacheConfig:
    """The LMDeploy configuration a fixture's ``sizes`` and value ``dtype`` stand for.

    ``kind``: ``plain`` (model dtype, or fp8 -> quant_policy 16 / 17 over a bf16 model),
    ``int8``, ``int4`` (``head_dim = 2 * head_size``), ``turbo`` (``head_dim = 2 * head_size``)
    or ``mla`` (one head, V of head size 0).
    """
    common = dict(
        num_layers=int(sizes["num_layers"]),
        num_blocks=int(sizes["num_blocks"]),
        block_size=int(sizes["block_size"]),
        num_kv_heads=int(sizes["num_heads"]),
        device_type=device_type,
    )
    hs = int(sizes["head_size"])
    if kind == "plain":
        if dtype in _FP8_POLICY:
            return CacheConfig(head_dim=hs, dtype=scale_dtype, quant_policy=_FP8_POLICY[dtype], **common)
        return CacheConfig(head_dim=hs, dtype=dtype, **common)
    if kind == "mla":
        return CacheConfig(head_dim=hs, k_head_dim=hs, v_head_dim=0, dtype=dtype, **common)
    policy = {"int8": 8, "int4": 4, "turbo": 42}[kind]
    return CacheConfig(head_dim=hs if kind == "int8" else 2 * hs, dtype=scale_dtype, quant_policy=policy, **common)


def _hints(cfg: CacheConfig, pool: bool) -> dict:
    h: dict[str, Any] = {"device_type": cfg.device_type, "quant_policy": cfg.quant_policy}
    if pool:
        h.update(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=cfg.block_size, dtype=_DNAME[cfg.dtype])
    return h


# -- the oracles ---------------------------------------------------------------------------------


def _bshd(t: torch.Tensor, device_type: str) -> torch.Tensor:
    """A ``[NB, *block_shape]`` tensor as the kernels index it: ``[NB, BS, NH, d]``."""
    return t.transpose(1, 2) if device_type == "camb" else t


def view_per_layer(device_type: str = "cuda"):
    """``kv_view`` over ``CacheEngine.gpu_cache``: layer ``l``'s tuple, entry ``p``
    (K, V, then the scale/zero or norm tensors)."""

    def view(kv_caches: Any, layer: int, plane: int) -> torch.Tensor:
        return _bshd(kv_caches[layer][plane], device_type)

    return view


def view_cross_layer(device_type: str = "cuda"):
    """``kv_view`` over 0.6.4-0.10 ``full_gpu_cache``: ``caches[p][l]`` is ``gpu_cache[l][p]``."""

    def view(kv_caches: Any, layer: int, plane: int) -> torch.Tensor:
        return _bshd(kv_caches[plane][layer], device_type)

    return view


def view_pool(kind: str):
    """``kv_view`` over the 0.11+ pool: the pool sliced as ``allocate_caches`` slices it
    (from the engine configuration the hints carry), entry ``p`` of layer ``l``."""

    def view(kv_caches: Any, layer: int, plane: int, *, hints: dict) -> torch.Tensor:
        policy = int(hints["quant_policy"])
        model = getattr(torch, hints["dtype"])
        cfg = CacheConfig(
            num_layers=int(kv_caches.shape[0]),
            num_blocks=int(kv_caches.shape[1]),
            block_size=int(hints["block_size"]),
            num_kv_heads=int(hints["num_kv_heads"]),
            head_dim=int(hints["head_dim"]),
            dtype=model,
            quant_policy=policy,
            device_type=hints["device_type"],
        )
        return _bshd(slice_pool(kv_caches, cfg)[plane][layer], cfg.device_type)

    return view


# -- the cases --------------------------------------------------------------------------------------


def make_case(
    version: str,
    fmt: str,
    kind: str,
    *,
    holder: str = "gpu_cache",
    device_type: str = "cuda",
    scale_dtype: torch.dtype = torch.bfloat16,
    dtypes: tuple[torch.dtype, ...] = _PLAIN,
    sizes: dict | None = None,
    constraints: dict | None = None,
    source: str = "",
) -> FixtureCase:
    """One fixture: LMDeploy ``version``'s allocation of ``kind`` handed over as ``holder``
    (``gpu_cache``, or ``full_gpu_cache``: the cross-layer tuple or the 0.11+ pool)."""
    gen = generation(version)
    pool = holder == "full_gpu_cache" and gen == "pool"

    def make(s: dict, dtype: torch.dtype, device: Any) -> tuple[Any, dict]:
        cfg = config_for(s, dtype, kind=kind, device_type=device_type, scale_dtype=scale_dtype)
        alloc = allocate(version, cfg, device)
        kv = alloc.gpu_cache if holder == "gpu_cache" else alloc.full
        return kv, _hints(cfg, pool)

    if holder == "gpu_cache":
        view = view_per_layer(device_type)
    elif pool:
        view = view_pool(kind)
    else:
        view = view_cross_layer(device_type)
    tag = {"gpu_cache": "", "full_gpu_cache": "-full"}[holder]
    return FixtureCase(
        name=f"lmdeploy-{version}-{device_type}-{kind}{tag}",
        engine="lmdeploy",
        format=fmt,
        make=make,
        kv_view=view,
        sizes=sizes or {"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 2, "head_size": 16},
        dtypes=dtypes,
        source=source,
        size_constraints=constraints or {"block_size_choices": [1, 2, 4, 8, 16]},
    )


def _src(*keys: str) -> str:
    return "; ".join(str(F.SOURCES[k]) for k in keys)


_Q_SIZES = {"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 2, "head_size": 8}
_EVEN = {"block_size_choices": [1, 2, 4, 8, 16], "head_size_multiple": 2}

CASES = [
    # unquantised, per layer: each generation's gpu_cache
    make_case("0.6.0", F.NHD, "plain", source=_src("0.6.0", "cuda")),
    make_case("0.9.2", F.NHD, "plain", source=_src("0.9.2", "cuda")),
    make_case("0.14.0", F.NHD, "plain", dtypes=_PLAIN_FP8, source=_src("0.14.0", "0.11.1", "cuda")),
    make_case("0.9.2", F.HND, "plain", device_type="camb", source=_src("0.9.2", "camb")),
    make_case("0.12.3", F.HND, "plain", device_type="camb", source=_src("0.11.1", "camb")),
    make_case(
        "0.9.2",
        F.MLA,
        "mla",
        sizes={"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 1, "head_size": 576},
        constraints={"block_size_choices": [1, 2, 4, 8, 16], "fixed": ("num_heads",), "head_size_choices": [16, 64, 576]},
        source=_src("mla", "0.9.2"),
    ),
    # quantised, per layer
    make_case("0.6.2", F.QUANT, "int8", dtypes=(torch.uint8,), sizes=_Q_SIZES | {"head_size": 16}, source=_src("0.6.2", "fill")),
    make_case("0.9.2", F.QUANT, "int4", dtypes=(torch.uint8,), scale_dtype=torch.float16, sizes=_Q_SIZES, source=_src("0.9.2", "fill")),
    make_case("0.14.0", F.QUANT, "int8", dtypes=(torch.uint8,), sizes=_Q_SIZES | {"head_size": 16}, source=_src("0.14.0", "fill")),
    make_case("0.14.0", F.QUANT, "int4", dtypes=(torch.uint8,), sizes=_Q_SIZES, source=_src("0.14.0", "fill", "flatten")),
    make_case("0.14.0", F.TURBO, "turbo", dtypes=(torch.uint8,), sizes=_Q_SIZES, constraints=_EVEN, source=_src("0.14.0", "turbo")),
    # cross-layer holders: 0.6.4-0.10 full_gpu_cache, the 0.11+ pool
    make_case("0.9.2", F.X_NHD, "plain", holder="full_gpu_cache", source=_src("0.9.2", "cuda")),
    make_case("0.9.2", F.X_QUANT, "int8", holder="full_gpu_cache", dtypes=(torch.uint8,), sizes=_Q_SIZES, source=_src("0.9.2", "fill")),
    make_case("0.14.0", F.X_NHD, "plain", holder="full_gpu_cache", dtypes=_PLAIN_FP8, source=_src("0.14.0", "0.11.1", "cuda")),
    make_case("0.12.3", F.X_HND, "plain", holder="full_gpu_cache", device_type="camb", source=_src("0.11.1", "camb")),
    make_case("0.14.0", F.X_QUANT, "int4", holder="full_gpu_cache", dtypes=(torch.uint8,), sizes=_Q_SIZES, source=_src("0.14.0", "fill")),
    make_case(
        "0.14.0",
        F.X_TURBO,
        "turbo",
        holder="full_gpu_cache",
        dtypes=(torch.uint8,),
        sizes=_Q_SIZES,
        constraints=_EVEN,
        source=_src("0.14.0", "turbo"),
    ),
]
