"""LMDeploy's KV-cache allocation, repeated step by step per generation (for fixtures and tests).

Each function follows the released engine's code path (shapes *and* the buffer / view /
slice steps that give the strides), cited per function; ``SOURCES.md`` has the facts. This
module is the fixtures' ground truth: detection (:mod:`kvcore_lmdeploy.detect`) never
calls it, and the oracle views (:mod:`kvcore_lmdeploy.fixtures`) index what it returns the
way LMDeploy's kernels do.

Generations (``lmdeploy/pytorch/engine/cache_engine.py``):

=============  ==============================================================================
versions       ``CacheEngine`` allocation
=============  ==============================================================================
0.6.0-0.6.3    ``allocate_gpu_cache``: per layer ``torch.empty((num_blocks, *block_shape))`` for
               K and V (0.6.2+: and the ``(*block_shape[:-1], 2)`` scale/zero tensors)
0.6.4-0.11.0   ``_allocate_cache``: one ``torch.empty((num_layers, num_blocks, *shape))`` per
               kind; ``gpu_cache = list(zip(*caches))`` (per-layer views)
0.11.1+        ``allocate_caches``: ``mem_pool = torch.zeros((NL, NB, sum(aligned sizes)),
               uint8)``; each ``CacheDesc`` is ``remain[:, :, :size].view(dtype).view((NL, NB,
               *shape))``, the next starting at the 256-byte-aligned size; 0.14 allocates
               ``kernel_block_size`` blocks (``num_blocks * block_size // kernel_block_size``)
=============  ==============================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import GeometryError

__all__ = ["CacheConfig", "Allocation", "allocate", "generation", "block_shapes", "cache_descs", "nz_310p", "ALIGNMENT", "version_tuple"]

#: ``CacheDesc.alignment`` (0.11.1-0.14.0)
ALIGNMENT = 256


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.9.2"`` -> ``(0, 9, 2)`` (``.postN`` and pre-release tags ignored)."""
    out = []
    for part in str(version).split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    if len(out) < 2:
        raise GeometryError(f"not an LMDeploy version: {version!r} (e.g. '0.9.2')")
    return tuple(out + [0] * (3 - len(out)))


def generation(version: str) -> str:
    """``"per_layer"`` (0.6.0-0.6.3), ``"cross_layer"`` (0.6.4-0.11.0) or ``"pool"`` (0.11.1+).

    0.11.0's ``CacheEngine._allocate_cache`` still allocates one ``torch.empty`` per kind; the
    uint8 pool (``allocate_caches``) is 0.11.1's.

    Raises:
        GeometryError: a version before 0.6.0 (not described here).
    """
    v = version_tuple(version)
    if v < (0, 6, 0):
        raise GeometryError(f"LMDeploy {version}: versions before 0.6.0 are not described by kvcore-lmdeploy")
    if v < (0, 6, 4):
        return "per_layer"
    if v < (0, 11, 1):
        return "cross_layer"
    return "pool"


@dataclass(frozen=True)
class CacheConfig:
    """The facts ``CacheEngine`` allocates from (``CacheConfig`` + ``ModelConfig`` + TP).

    Attributes:
        num_layers: ``ModelConfig.num_layers``.
        num_blocks: ``CacheConfig.num_gpu_blocks`` (manager blocks).
        block_size: ``CacheConfig.block_size`` (tokens per manager block).
        num_kv_heads: KV heads per rank (``num_key_value_heads // world_size``).
        head_dim: ``ModelConfig.head_dim`` (K and V unless ``k_head_dim`` / ``v_head_dim``).
        dtype: ``ModelConfig.dtype``.
        quant_policy: 0, 4, 8 (all), 16, 17, 42 (0.14+).
        device_type: ``cuda`` (NHD blocks), ``camb`` (HND blocks), ``ascend`` (NHD; 310P:
            NZ blocks, 0.8.0-0.11.0) or ``maca`` (0.6.2-0.6.3: HND; 0.10+: NHD).
        k_head_dim, v_head_dim: ``ModelConfig.k_head_dim`` / ``v_head_dim`` (default head_dim).
        kernel_block_size: ``CacheConfig.kernel_block_size`` (0.14+; default block_size).
        soc_version: the Ascend chip (``SocVersion.device_name()``), ``"Ascend910B"`` by default.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    quant_policy: int = 0
    device_type: str = "cuda"
    k_head_dim: int | None = None
    v_head_dim: int | None = None
    kernel_block_size: int | None = None
    soc_version: str = "Ascend910B"

    @property
    def k_dim(self) -> int:
        return self.head_dim if self.k_head_dim is None else self.k_head_dim

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def kernel_block(self) -> int:
        return self.block_size if self.kernel_block_size is None else self.kernel_block_size


def _check(cfg: CacheConfig, version: str) -> None:
    v = version_tuple(version)
    if cfg.quant_policy not in (0, 4, 8, 16, 17, 42):
        raise GeometryError(f"quant_policy {cfg.quant_policy} is not an LMDeploy QuantPolicy")
    if cfg.quant_policy in (16, 17, 42) and v < (0, 14, 0):
        raise GeometryError(f"LMDeploy {version} has no quant_policy {cfg.quant_policy} (fp8 / TurboQuant are 0.14+)")
    if cfg.quant_policy in (4, 8) and v < (0, 6, 2):
        raise GeometryError(f"LMDeploy {version}'s PyTorch engine has no int4/int8 KV cache (0.6.2+)")
    if cfg.device_type not in ("cuda", "camb", "ascend", "maca"):
        raise GeometryError(f"device_type {cfg.device_type!r}: PytorchEngineConfig.device_type is cuda, ascend, maca or camb")
    if cfg.quant_policy and cfg.device_type in ("camb", "maca"):
        raise GeometryError("LMDeploy quantises the KV cache on cuda and ascend only (PytorchEngineConfig.__post_init__)")
    if cfg.quant_policy in (16, 17) and cfg.device_type != "cuda":
        raise GeometryError("LMDeploy 0.14.0 CacheEngine.__init__: FP8 quantization is only supported on CUDA device")
    if cfg.device_type == "camb" and v < (0, 7, 0):
        raise GeometryError(f"LMDeploy {version} has no camb backend")
    if cfg.device_type == "maca" and not ((0, 6, 2) <= v < (0, 6, 4) or v >= (0, 10, 0)):
        raise GeometryError(
            f"LMDeploy {version} on maca: 0.6.4-0.9.x allocate split-K blocks (num_heads, head_size // 16, block_size, 16) "
            "(backends/dlinfer/maca/op_backend.py), not modelled here; 0.6.0-0.6.1 have no maca backend"
        )
    if cfg.device_type == "maca" and v < (0, 6, 4) and cfg.k_dim == 576:
        raise GeometryError("LMDeploy 0.6.2 maca splits a 576-element K (num_heads, 36, block_size, 16): not modelled here")
    if cfg.device_type == "ascend":
        if v < (0, 7, 0):
            raise GeometryError(f"LMDeploy {version} on ascend allocates (block_size, num_heads * head_size) blocks: not modelled here")
        fam = "310P" if cfg.soc_version.startswith("Ascend310P") else "910" if cfg.soc_version.startswith("Ascend910") else None
        if fam is None or (fam == "310P" and v >= (0, 11, 1)):
            raise GeometryError(f"LMDeploy {version}'s ascend backend does not run {cfg.soc_version} (SocVersion)")
    if cfg.kernel_block_size is not None and v < (0, 14, 0):
        raise GeometryError(f"LMDeploy {version} has no kernel_block_size (0.14+)")
    kb = cfg.kernel_block
    if cfg.kernel_block_size is not None and (kb < 16 or kb & (kb - 1)):
        raise GeometryError(f"kernel_block_size {kb} must be >= 16 and a power of 2 (0.14.0 PytorchEngineConfig.__post_init__)")
    if cfg.device_type == "camb" and cfg.kernel_block != cfg.block_size:
        raise GeometryError(
            f"camb: block_size {cfg.block_size} with kernel_block_size {cfg.kernel_block}: 0.14.0 "
            "PytorchEngineConfig.__post_init__ sets both to 16 on camb"
        )
    if cfg.block_size % cfg.kernel_block:
        raise GeometryError(f"block_size {cfg.block_size} must be divisible by kernel_block_size {cfg.kernel_block} (0.14.0)")
    if cfg.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise GeometryError(f"ModelConfig.dtype {cfg.dtype} is not a model dtype LMDeploy runs")


def nz_310p(cfg: CacheConfig, version: str) -> bool:
    """Whether LMDeploy ``version`` allocates Ascend 310P "NZ" blocks for ``cfg``
    (0.8.0-0.11.0 ``AscendOpsBackend.get_k_block_shape``: ``SocVersion.is_Ascend310P()``)."""
    v = version_tuple(version)
    return cfg.device_type == "ascend" and cfg.soc_version.startswith("Ascend310P") and (0, 8, 0) <= v < (0, 11, 1)


def _order(cfg: CacheConfig, version: str) -> str:
    """``NHD``, ``HND`` or ``NZ``: the backend's ``get_k_block_shape`` for ``version``."""
    if cfg.device_type == "camb":
        return "HND"
    if cfg.device_type == "maca" and version_tuple(version) < (0, 6, 4):
        return "HND"  # 0.6.2 MacaOpsBackend.get_k_block_shape: (num_heads, block_size, head_size)
    if nz_310p(cfg, version):
        return "NZ"
    return "NHD"


def block_shapes(cfg: CacheConfig, version: str = "0.14.0") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K and V block shapes: ``CacheEngine._get_key_block_shape_impl`` /
    ``_get_value_block_shape_impl`` (int4 and TurboQuant-K pack ``head_size // 2``;
    TurboQuant-V ``head_size // 4``, 0.14.0) passed to the backend's
    ``get_k_block_shape`` / ``get_v_block_shape``: ``(block_size, num_heads, head_size)``
    on CUDA (``backends/cuda/op_backend.py``), Ascend 910 and MACA 0.10+;
    ``(num_heads, block_size, head_size)`` on Cambricon (``backends/dlinfer/camb/op_backend.py``)
    and MACA 0.6.2; ``((num_heads * head_size + 15) // 16, block_size, 16)`` on Ascend 310P,
    0.8.0-0.11.0 (``backends/dlinfer/ascend/op_backend.py::AscendOpsBackend.get_k_block_shape``).

    Raises:
        GeometryError: a head size the engine's asserts refuse.
    """
    kd, vd = cfg.k_dim, cfg.v_dim
    if cfg.quant_policy in (4, 42):
        if kd % 2:
            raise GeometryError(f"head_size {kd} is odd: quant_policy {cfg.quant_policy} packs two 4-bit codes per byte")
        kd //= 2
    if cfg.quant_policy == 4:
        if vd % 2:
            raise GeometryError(f"head_size {vd} is odd: int4 packs two codes per byte")
        vd //= 2
    if cfg.quant_policy == 42:
        if vd % 4:
            raise GeometryError(f"head_size {vd} is not a multiple of 4: TurboQuant packs four 2-bit V codes per byte")
        vd //= 4
    bs, nh = cfg.kernel_block, cfg.num_kv_heads
    order = _order(cfg, version)
    if order == "HND":
        return (nh, bs, kd), (nh, bs, vd)
    if order == "NZ":
        return ((nh * kd + 15) // 16, bs, 16), ((nh * vd + 15) // 16, bs, 16)
    return (bs, nh, kd), (bs, nh, vd)


def _value_dtype(cfg: CacheConfig, version: str = "0.14.0") -> torch.dtype:
    """``CacheEngine.__init__``'s ``kv_cache_dtype`` (0.11.1+: the K/V ``CacheDesc`` dtype)."""
    if cfg.quant_policy == 16:
        return torch.float8_e4m3fn
    if cfg.quant_policy == 17:
        return torch.float8_e5m2
    if cfg.quant_policy in (4, 8, 42):
        # cuda: uint8; ascend / npu: int8 -- until 0.11.0, whose _allocate_cache uses kv_cache_dtype;
        # 0.11.1+ get_k_cache_desc / get_v_cache_desc use uint8 whatever the device
        if cfg.device_type == "ascend" and version_tuple(version) < (0, 11, 1):
            return torch.int8
        return torch.uint8
    return cfg.dtype


def cache_descs(cfg: CacheConfig, version: str = "0.14.0") -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of each per-block cache, in LMDeploy's order: K, V, then the
    quant descs (``get_quant_cache_descs``: ``shape[:-1] + [2]`` in the model dtype;
    TurboQuant's V ``[1]``; none for fp8)."""
    ks, vs = block_shapes(cfg, version)
    vdt = _value_dtype(cfg, version)
    out = [(ks, vdt), (vs, vdt)]
    if cfg.quant_policy in (4, 8, 42):
        out.append(((*ks[:-1], 2), cfg.dtype))
        out.append(((*vs[:-1], 1 if cfg.quant_policy == 42 else 2), cfg.dtype))
    return out


@dataclass
class Allocation:
    """What ``CacheEngine`` keeps after allocating.

    Attributes:
        gpu_cache: ``CacheEngine.gpu_cache`` -- per layer a tuple ``(k, v[, ksz, vsz])``.
        full: ``CacheEngine.full_gpu_cache`` -- ``None`` (0.6.0-0.6.3), the tuple of
            cross-layer tensors (0.6.4-0.10.x) or the uint8 pool (0.11+).
        caches: the cross-layer tensors (0.6.4+; for 0.11+ the pool slices before
            ``zip``), else ``None``.
        version: the LMDeploy version followed.
        config: the :class:`CacheConfig`.
    """

    gpu_cache: list[tuple[torch.Tensor, ...]]
    full: Any
    caches: list[torch.Tensor] | None
    version: str
    config: CacheConfig
    notes: dict[str, Any] = field(default_factory=dict)


def slice_pool(mem_pool: torch.Tensor, cfg: CacheConfig) -> list[torch.Tensor]:
    """0.11.1-0.14.0 ``CacheEngine.allocate_caches``' slicing loop over ``mem_pool`` (a
    ``CacheDesc`` of size 0 -- MLA's V -- is an empty view and takes no bytes)."""
    num_layers, num_blocks = int(mem_pool.shape[0]), int(mem_pool.shape[1])
    caches = []
    remain_pool = mem_pool
    for shape, dtype in cache_descs(cfg):
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        aligned = ((size + ALIGNMENT - 1) // ALIGNMENT) * ALIGNMENT
        cache = remain_pool[:, :, :size].view(dtype).view((num_layers, num_blocks, *shape))
        remain_pool = remain_pool[:, :, aligned:]
        caches.append(cache)
    return caches


def pool_bytes(cfg: CacheConfig) -> int:
    """``mem_pool_size``: the sum of the descs' 256-aligned sizes (bytes per block and layer)."""
    total = 0
    for shape, dtype in cache_descs(cfg):
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        total += ((size + ALIGNMENT - 1) // ALIGNMENT) * ALIGNMENT
    return total


def allocate(version: str, cfg: CacheConfig, device: Any = "cpu") -> Allocation:
    """Allocate a KV cache exactly as LMDeploy ``version``'s ``CacheEngine`` does.

    Args:
        version: an LMDeploy version (``"0.6.0"`` ... ``"0.14.0"``).
        cfg: the geometry and policies.
        device: where to allocate (LMDeploy's GPU and host caches share the shapes).
    Returns:
        an :class:`Allocation`.
    Raises:
        GeometryError: a combination the engine refuses (int4 with an odd head size, a
            policy the version lacks, quantised camb, ...).
    """
    _check(cfg, version)
    gen = generation(version)
    nl = cfg.num_layers
    descs = cache_descs(cfg, version)
    if gen == "per_layer":  # 0.6.0-0.6.3 CacheEngine.allocate_gpu_cache
        gpu_cache = []
        for _ in range(nl):
            gpu_cache.append(tuple(torch.empty(size=(cfg.num_blocks, *shape), dtype=dtype, device=device) for shape, dtype in descs))
        return Allocation(gpu_cache=gpu_cache, full=None, caches=None, version=version, config=cfg)
    if gen == "cross_layer":  # 0.6.4-0.10.x CacheEngine._allocate_cache + allocate_gpu_cache
        caches = [torch.empty(size=(nl, cfg.num_blocks, *shape), dtype=dtype, device=device) for shape, dtype in descs]
        return Allocation(gpu_cache=list(zip(*caches)), full=tuple(caches), caches=caches, version=version, config=cfg)
    # 0.11+ CacheEngine.allocate_caches (0.14: kernel blocks)
    num_blocks = cfg.num_blocks * (cfg.block_size // cfg.kernel_block)
    mem_pool = torch.zeros((nl, num_blocks, pool_bytes(cfg)), dtype=torch.uint8, device=device)
    caches = slice_pool(mem_pool, cfg)
    return Allocation(gpu_cache=list(zip(*caches)), full=mem_pool, caches=caches, version=version, config=cfg)
