"""Allocation fixtures: LMDeploy's caches per version, and the engine-side oracle views.

``make`` allocates through :func:`kvcore_lmdeploy.allocation.allocate` (LMDeploy's
``CacheEngine`` code path of that version) and hands over what a caller holds
(``gpu_cache``, the 0.6.4-0.11.0 ``full_gpu_cache`` tuple, or the 0.11.1+ uint8 pool). The
``kv_view`` oracles index LMDeploy's own per-layer caches the way its kernels address them
-- never kvcore's stride table, never the detector:

* ``fill_kv_cache.py::fill_kv_cache`` / ``pagedattention.py::paged_attention_fwd``
  (``kv_layout='bshd'``: ``b_dim, s_dim, h_dim, d_dim = 0, 1, 2, 3``) read
  ``k_caches[block, token, head, d]`` of the layer's tensor, and the scale/zero tensors
  with the same (block, token, head) strides and ``d`` 0 (scale) / 1 (zero);
* the Cambricon backend's (and MACA 0.6.2's) ``(NH, BS, HS)`` blocks are ``bhsd``
  (``h_dim, s_dim = 1, 2``);
* Ascend 310P's ``(C, BS, 16)`` blocks are FRACTAL_NZ (``backends/dlinfer/ascend/utils.py::
  nd_to_nz_spec``: the ND rows ``[BS, NH*HS]`` reshaped to ``(BS, C, 16)`` and permuted to
  ``(C, BS, 16)``): the oracle permutes them back, ``[NB, BS, C, 16]``, and splits ``C`` into
  the heads the model has (``head_dim`` from the hints);
* MLA (``models/deepseek_v2.py::DeepseekV2Attention.forward``): the cache is
  ``past_key_value[0]`` (the latents) and, quantised, ``past_key_value[2]`` /
  ``past_key_value[3]`` (k / v scales and zeros); V is ``past_key_value[0][..., :kv_lora_rank]``,
  no memory of its own;
* 0.6.4+ layer ``l``'s tuple is ``(caches[0][l], caches[1][l], ...)`` (``list(zip(*caches))``),
  and for the 0.11.1+ pool the caches are the pool's slices (``allocate_caches``).

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

__all__ = ["CASES", "config_for", "make_case", "view_per_layer", "view_cross_layer", "view_pool", "PLANES"]

_FP8_POLICY = {torch.float8_e4m3fn: 16, torch.float8_e5m2: 17}
_DNAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)
_PLAIN_FP8 = (*_PLAIN, torch.float8_e4m3fn, torch.float8_e5m2)
_MLA_KINDS = ("mla", "mla-int8", "mla-int4")
#: which entry of LMDeploy's per-layer tuple each plane of the format is (in the name's order):
#: quantised MLA's planes KV, KSZ, VSZ are entries 0, 2, 3 (entry 1 is the empty V)
PLANES = {"mla-int8": (0, 2, 3), "mla-int4": (0, 2, 3)}


def config_for(
    sizes: dict,
    dtype: torch.dtype,
    *,
    kind: str,
    device_type: str = "cuda",
    scale_dtype: torch.dtype = torch.bfloat16,
    soc_version: str = "Ascend910B",
) -> CacheConfig:
    """The LMDeploy configuration a fixture's ``sizes`` and value ``dtype`` stand for.

    ``kind``: ``plain`` (model dtype, or fp8 -> quant_policy 16 / 17 over a bf16 model),
    ``int8``, ``int4`` (``head_dim = 2 * head_size``), ``turbo`` (``head_dim = 2 * head_size``),
    ``mla`` (one head, V of head size 0; fp8 -> quant_policy 16 / 17), ``mla-int8``,
    ``mla-int4`` (DeepSeek's latent quantised; int4 ``head_dim = 2 * head_size``).
    """
    common = dict(
        num_layers=int(sizes["num_layers"]),
        num_blocks=int(sizes["num_blocks"]),
        block_size=int(sizes["block_size"]),
        num_kv_heads=int(sizes["num_heads"]),
        device_type=device_type,
        soc_version=soc_version,
    )
    hs = int(sizes["head_size"])
    if kind in ("plain", "mla"):
        mla = dict(k_head_dim=hs, v_head_dim=0) if kind == "mla" else {}
        if dtype in _FP8_POLICY:
            return CacheConfig(head_dim=hs, dtype=scale_dtype, quant_policy=_FP8_POLICY[dtype], **mla, **common)
        return CacheConfig(head_dim=hs, dtype=dtype, **mla, **common)
    if kind in ("mla-int8", "mla-int4"):
        hd = hs if kind == "mla-int8" else 2 * hs
        policy = 8 if kind == "mla-int8" else 4
        return CacheConfig(head_dim=hd, k_head_dim=hd, v_head_dim=0, dtype=scale_dtype, quant_policy=policy, **common)
    policy = {"int8": 8, "int4": 4, "turbo": 42}[kind]
    return CacheConfig(head_dim=hs if kind == "int8" else 2 * hs, dtype=scale_dtype, quant_policy=policy, **common)


def _hints(cfg: CacheConfig, pool: bool, version: str, kind: str) -> dict:
    """What a caller knows from LMDeploy's configuration: the backend and policy; the Ascend
    chip; the model's head sizes where the tensors do not show them (NZ blocks) and for MLA
    (DeepSeek's ModelConfig: head_dim = k_head_dim = the latent, v_head_dim = 0); the release
    where the blocks depend on it (MACA); and for the pool every fact its bytes lack."""
    h: dict[str, Any] = {"device_type": cfg.device_type, "quant_policy": cfg.quant_policy}
    if cfg.device_type == "ascend":
        h["soc_version"] = cfg.soc_version
        h["head_dim"] = cfg.head_dim
    if cfg.device_type == "maca":
        h["lmdeploy_version"] = version
    if kind in _MLA_KINDS:
        h.update(head_dim=cfg.head_dim, k_head_dim=cfg.k_dim, v_head_dim=0)
    if pool:
        h.update(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=cfg.block_size, dtype=_DNAME[cfg.dtype])
    return h


# -- the oracles ---------------------------------------------------------------------------------


def _bshd(t: torch.Tensor, device_type: str, *, version: str = "0.14.0", head_dim: int | None = None, nz: bool = False) -> torch.Tensor:
    """A ``[NB, *block_shape]`` tensor as the kernels index it: ``[NB, BS, NH, *d]``.

    ``bhsd`` blocks (camb; maca 0.6.2) are transposed; NZ blocks ``[NB, C, BS, 16]`` are
    ``nd_to_nz_spec`` undone: ``[NB, BS, C, 16]``, ``C`` split into ``(NH, head_dim / 16)``."""
    if nz:
        c = int(t.shape[1])
        per_head = int(head_dim) // 16
        return t.permute(0, 2, 1, 3).unflatten(2, (c // per_head, per_head))
    from kvcore_lmdeploy.allocation import version_tuple

    if device_type == "camb" or (device_type == "maca" and version_tuple(version) < (0, 6, 4)):
        return t.transpose(1, 2)
    return t


def view_per_layer(device_type: str = "cuda", *, kind: str = "plain", version: str = "0.14.0", nz: bool = False):
    """``kv_view`` over ``CacheEngine.gpu_cache``: layer ``l``'s tuple, entry ``PLANES[kind][p]``
    (K, V, then the scale/zero or norm tensors; quantised MLA: the latents and the two
    scale/zero tensors)."""
    entries = PLANES.get(kind)

    def view(kv_caches: Any, layer: int, plane: int, *, hints: dict | None = None) -> torch.Tensor:
        entry = entries[plane] if entries else plane
        hints = hints or {}
        return _bshd(kv_caches[layer][entry], device_type, version=version, head_dim=hints.get("head_dim"), nz=nz)

    return view


def view_cross_layer(device_type: str = "cuda", *, kind: str = "plain", version: str = "0.9.2", nz: bool = False):
    """``kv_view`` over 0.6.4-0.11.0 ``full_gpu_cache``: ``caches[p][l]`` is ``gpu_cache[l][p]``."""
    entries = PLANES.get(kind)

    def view(kv_caches: Any, layer: int, plane: int, *, hints: dict | None = None) -> torch.Tensor:
        entry = entries[plane] if entries else plane
        hints = hints or {}
        return _bshd(kv_caches[entry][layer], device_type, version=version, head_dim=hints.get("head_dim"), nz=nz)

    return view


def view_pool(kind: str):
    """``kv_view`` over the 0.11.1+ pool: the pool sliced as ``allocate_caches`` slices it
    (from the engine configuration the hints carry), entry ``PLANES[kind][p]`` of layer ``l``."""
    entries = PLANES.get(kind)

    def view(kv_caches: Any, layer: int, plane: int, *, hints: dict) -> torch.Tensor:
        policy = int(hints["quant_policy"])
        model = getattr(torch, hints["dtype"])
        cfg = CacheConfig(
            num_layers=int(kv_caches.shape[0]),
            num_blocks=int(kv_caches.shape[1]),
            block_size=int(hints["block_size"]),
            num_kv_heads=int(hints["num_kv_heads"]),
            head_dim=int(hints["head_dim"]),
            k_head_dim=hints.get("k_head_dim"),
            v_head_dim=hints.get("v_head_dim"),
            dtype=model,
            quant_policy=policy,
            device_type=hints.get("device_type", "cuda"),
        )
        entry = entries[plane] if entries else plane
        return _bshd(slice_pool(kv_caches, cfg)[entry][layer], cfg.device_type)

    return view


# -- the cases --------------------------------------------------------------------------------------


def make_case(
    version: str,
    fmt: str,
    kind: str,
    *,
    holder: str = "gpu_cache",
    device_type: str = "cuda",
    soc_version: str = "Ascend910B",
    scale_dtype: torch.dtype = torch.bfloat16,
    dtypes: tuple[torch.dtype, ...] = _PLAIN,
    sizes: dict | None = None,
    constraints: dict | None = None,
    source: str = "",
) -> FixtureCase:
    """One fixture: LMDeploy ``version``'s allocation of ``kind`` handed over as ``holder``
    (``gpu_cache``, or ``full_gpu_cache``: the cross-layer tuple or the 0.11.1+ pool)."""
    gen = generation(version)
    pool = holder == "full_gpu_cache" and gen == "pool"
    nz = device_type == "ascend" and soc_version.startswith("Ascend310P")

    def make(s: dict, dtype: torch.dtype, device: Any) -> tuple[Any, dict]:
        cfg = config_for(s, dtype, kind=kind, device_type=device_type, scale_dtype=scale_dtype, soc_version=soc_version)
        alloc = allocate(version, cfg, device)
        kv = alloc.gpu_cache if holder == "gpu_cache" else alloc.full
        return kv, _hints(cfg, pool, version, kind)

    if holder == "gpu_cache":
        view = view_per_layer(device_type, kind=kind, version=version, nz=nz)
    elif pool:
        view = view_pool(kind)
    else:
        view = view_cross_layer(device_type, kind=kind, version=version, nz=nz)
    tag = {"gpu_cache": "", "full_gpu_cache": "-full"}[holder]
    dev = f"ascend{soc_version.removeprefix('Ascend')}" if device_type == "ascend" else device_type
    return FixtureCase(
        name=f"lmdeploy-{version}-{dev}-{kind}{tag}",
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
_MLA_SIZES = {"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 1, "head_size": 576}
_MLA_RULES = {"block_size_choices": [1, 2, 4, 8, 16], "fixed": ("num_heads",), "head_size_choices": [16, 64, 576]}
_MLA4_RULES = {"block_size_choices": [1, 2, 4, 8, 16], "fixed": ("num_heads",), "head_size_choices": [8, 32, 288]}
_NZ_SIZES = {"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 2, "head_size": 32}
_NZ_RULES = {"block_size_choices": [1, 2, 4, 8, 16], "head_size_multiple": 16}

CASES = [
    # unquantised, per layer: each generation's gpu_cache
    make_case("0.6.0", F.NHD, "plain", source=_src("0.6.0", "cuda")),
    make_case("0.9.2", F.NHD, "plain", source=_src("0.9.2", "cuda")),
    make_case("0.14.0", F.NHD, "plain", dtypes=_PLAIN_FP8, source=_src("0.14.0", "0.11.1", "cuda")),
    make_case("0.9.2", F.HND, "plain", device_type="camb", source=_src("0.9.2", "camb")),
    make_case("0.12.3", F.HND, "plain", device_type="camb", source=_src("0.11.1", "camb")),
    make_case("0.6.2", F.HND, "plain", device_type="maca", source=_src("0.6.0", "maca")),
    make_case("0.9.2", F.NHD, "plain", device_type="ascend", soc_version="Ascend910B", source=_src("0.9.2", "nz")),
    make_case(
        "0.9.2",
        F.NZ,
        "plain",
        device_type="ascend",
        soc_version="Ascend310P",
        sizes=_NZ_SIZES,
        constraints=_NZ_RULES,
        source=_src("nz", "0.9.2"),
    ),
    # MLA: the latents (with DeepSeek's head_dim / k_head_dim / v_head_dim=0 as hints)
    make_case("0.9.2", F.MLA, "mla", sizes=_MLA_SIZES, constraints=_MLA_RULES, source=_src("mla", "0.9.2")),
    make_case("0.14.0", F.MLA, "mla", dtypes=_PLAIN_FP8, sizes=_MLA_SIZES, constraints=_MLA_RULES, source=_src("mla", "0.14.0")),
    # quantised, per layer
    make_case("0.6.2", F.QUANT, "int8", dtypes=(torch.uint8,), sizes=_Q_SIZES | {"head_size": 16}, source=_src("0.6.2", "fill")),
    make_case("0.9.2", F.QUANT, "int4", dtypes=(torch.uint8,), scale_dtype=torch.float16, sizes=_Q_SIZES, source=_src("0.9.2", "fill")),
    make_case("0.14.0", F.QUANT, "int8", dtypes=(torch.uint8,), sizes=_Q_SIZES | {"head_size": 16}, source=_src("0.14.0", "fill")),
    make_case("0.14.0", F.QUANT, "int4", dtypes=(torch.uint8,), sizes=_Q_SIZES, source=_src("0.14.0", "fill", "flatten")),
    make_case("0.14.0", F.TURBO, "turbo", dtypes=(torch.uint8,), sizes=_Q_SIZES, constraints=_EVEN, source=_src("0.14.0", "turbo")),
    make_case(
        "0.6.2", F.MLA_QUANT, "mla-int8", dtypes=(torch.uint8,), sizes=_MLA_SIZES, constraints=_MLA_RULES, source=_src("mla_quant", "0.6.2")
    ),
    make_case(
        "0.9.2",
        F.MLA_QUANT,
        "mla-int4",
        dtypes=(torch.uint8,),
        scale_dtype=torch.float16,
        sizes=_MLA_SIZES | {"head_size": 288},
        constraints=_MLA4_RULES,
        source=_src("mla_quant", "0.9.2"),
    ),
    # cross-layer holders: 0.6.4-0.11.0 full_gpu_cache, the 0.11.1+ pool
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
    make_case(
        "0.10.2",
        F.X_NZ,
        "plain",
        holder="full_gpu_cache",
        device_type="ascend",
        soc_version="Ascend310P",
        sizes=_NZ_SIZES,
        constraints=_NZ_RULES,
        source=_src("nz"),
    ),
    make_case("0.9.2", F.X_MLA, "mla", holder="full_gpu_cache", sizes=_MLA_SIZES, constraints=_MLA_RULES, source=_src("mla", "0.9.2")),
    make_case(
        "0.14.0",
        F.X_MLA,
        "mla",
        holder="full_gpu_cache",
        dtypes=_PLAIN_FP8,
        sizes=_MLA_SIZES,
        constraints=_MLA_RULES,
        source=_src("mla", "0.14.0"),
    ),
    make_case(
        "0.9.2",
        F.X_MLA_QUANT,
        "mla-int8",
        holder="full_gpu_cache",
        dtypes=(torch.uint8,),
        sizes=_MLA_SIZES,
        constraints=_MLA_RULES,
        source=_src("mla_quant", "0.9.2"),
    ),
    make_case(
        "0.14.0",
        F.X_MLA_QUANT,
        "mla-int4",
        holder="full_gpu_cache",
        dtypes=(torch.uint8,),
        sizes=_MLA_SIZES | {"head_size": 288},
        constraints=_MLA4_RULES,
        source=_src("mla_quant", "0.14.0"),
    ),
]
