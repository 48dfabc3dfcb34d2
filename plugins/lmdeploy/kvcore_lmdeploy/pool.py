"""LMDeploy 0.11.1+'s memory pool: one uint8 ``[NL, NB, bytes]`` tensor cut as
``CacheEngine.allocate_caches`` cuts it (:func:`carve_pool`)."""

from __future__ import annotations

from typing import Any

import torch

from kvcore import Candidate, DetectionError, memory_ordered
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.block_orders import _readings
from kvcore_lmdeploy.checks import _FP8, _block_note, _resolve
from kvcore_lmdeploy.hints import LMDeployHints
from kvcore_lmdeploy.release_window import _version, _window


def _esize(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


def _plan(h: LMDeployHints, policy: int, order: str, block: int | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype, int, int]]:
    """``(role, block shape, dtype, byte offset, bytes)`` of each slice of one (layer, block)
    of the pool, for ``policy``, ``order`` and ``block`` tokens per allocated (kernel) block
    (default: ``kernel_block_size``, else ``block_size``): K, V, then the side planes, each
    starting at the previous one's size rounded up to 256 bytes (``CacheDesc.aligned_size``;
    MLA's V desc has size 0 and takes no bytes)."""
    kd, vd, nh = h.k_dim(), h.v_dim(), h.num_kv_heads
    bs = block if block is not None else h.kernel_block_size if h.kernel_block_size is not None else h.block_size
    if policy in (4, 42):
        kd //= 2
    vd = vd // 2 if policy == 4 else vd // 4 if policy == 42 else vd
    vdt = _FP8.get(policy) or (torch.uint8 if policy in (4, 8, 42) else h.dtype)

    def blk(d: int) -> tuple[int, ...]:
        return (bs, nh, d) if order == "NHD" else (nh, bs, d)

    parts = [("K", blk(kd), vdt), ("V", blk(vd), vdt)]
    if policy in (4, 8, 42):
        roles = F.TURBO_ROLES if policy == 42 else F.INT_ROLES
        parts += [(roles[2], blk(2), h.dtype), (roles[3], blk(1 if policy == 42 else 2), h.dtype)]
    out, off = [], 0
    for role, shape, dt in parts:
        size = shape[0] * shape[1] * shape[2] * _esize(dt)
        out.append((role, shape, dt, off, size))
        off += -(-size // 256) * 256
    return out


def _plan_bytes(plan: list[tuple[str, tuple[int, ...], torch.dtype, int, int]]) -> int:
    return sum(-(-p[4] // 256) * 256 for p in plan)


def carve_pool(pool: torch.Tensor, h: LMDeployHints, policy: int, order: str, block: int | None = None) -> dict[str, torch.Tensor] | None:
    """The pool's planes as cross-layer views ``{role: [NL, NB, *block_shape]}`` for
    ``policy``, ``order`` and ``block`` tokens per allocated block (default: the hints'
    ``kernel_block_size``, else ``block_size``), or None when the pool's bytes per block
    are not that plan's. An MLA pool (``v_head_dim`` 0) has no ``V`` entry."""
    plan = _plan(h, policy, order, block)
    if int(pool.shape[2]) != _plan_bytes(plan):
        return None
    out = {}
    for role, shape, dt, off, size in plan:
        if size == 0:
            continue  # MLA's V: CacheDesc of size 0, an empty view
        out[role] = pool[:, :, off : off + size].view(dt).unflatten(2, shape)
    return out


def _kernel_blocks(h: LMDeployHints, order: str) -> list[int]:
    """Tokens per allocated block the pool may hold under the hints, for ``order``.

    0.14.0 ``CacheEngine.allocate_caches`` allocates ``kernel_block_size`` blocks;
    ``PytorchEngineConfig.__post_init__`` defaults it to ``block_size`` and requires a power
    of 2, at least 16, dividing ``block_size``; camb (HND) forces both to 16. Before 0.14
    the allocated block is ``block_size``. With ``kernel_block_size`` given that is the
    one reading; with only ``block_size`` (the manager's block) every kernel block it
    allows is a reading (the pool's bytes per block may fit several: the caller's
    ``kernel_block_size`` decides)."""
    if h.kernel_block_size is not None:
        kb = h.kernel_block_size
        if h.block_size is not None and h.block_size != kb and (h.block_size % kb or kb < 16 or kb & (kb - 1)):
            raise DetectionError(
                f"lmdeploy: hints block_size={h.block_size} and kernel_block_size={kb} disagree: LMDeploy 0.14's kernel block "
                "is a power of 2, at least 16, dividing block_size (PytorchEngineConfig.__post_init__)"
            )
        return [kb]
    bs = int(h.block_size)
    v = _version(h)
    if order == "HND" or (v is not None and v < (0, 14, 0)):
        return [bs]
    return [bs] + [p for p in (1 << k for k in range(4, bs.bit_length())) if p < bs and bs % p == 0][::-1]


def _pool(pool: torch.Tensor, h: LMDeployHints) -> Any:
    """0.11.1+ ``CacheEngine.full_gpu_cache``: ``torch.zeros((NL, NB, mem_pool_size), uint8)``."""
    if pool.dim() != 3 or pool.dtype != torch.uint8:
        raise DetectionError(
            f"lmdeploy: one tensor is read as the 0.11.1+ memory pool (NL, NB, bytes) of uint8; got {tuple(pool.shape)} {pool.dtype}"
        )
    if pool.stride(-1) != 1 or not memory_ordered(pool):
        raise DetectionError(f"lmdeploy: the memory pool must be as CacheEngine allocates it (contiguous bytes); strides {pool.stride()}")
    missing = [
        name
        for name, val in (
            ("num_kv_heads", h.num_kv_heads),
            ("head_dim (or k_head_dim and v_head_dim)", h.k_dim() if h.v_dim() is not None else None),
            ("block_size (or kernel_block_size)", h.kernel_block_size or h.block_size),
            ("dtype", h.dtype),
        )
        if val is None
    ]
    if missing:
        raise DetectionError(
            f"lmdeploy: the memory pool {tuple(pool.shape)} is bytes: its slices follow from the model, pass the hints "
            f"{', '.join(missing)} (CacheEngine.allocate_caches cuts it from ModelConfig and CacheConfig)"
        )
    window = _window(h, "memory pool")
    mla = h.v_dim() == 0
    if mla and h.num_kv_heads != 1:
        raise DetectionError(
            f"lmdeploy: v_head_dim=0 is MLA, whose latent is one KV head per rank (configurations/deepseek_v2.py), but "
            f"num_kv_heads={h.num_kv_heads}"
        )
    if not mla and h.k_dim() != h.v_dim():
        raise DetectionError(f"lmdeploy: k_head_dim {h.k_dim()} != v_head_dim {h.v_dim()}: not described by kvcore-lmdeploy")
    v = _version(h)
    # QuantPolicy (lmdeploy/messages.py): 4 / 8 from 0.6.2, fp8 (16, 17) and TurboQuant (42) from 0.14.0
    known = [0, 4, 8, 16, 17, 42] if v is None or v >= (0, 14, 0) else [0, 4, 8]
    if mla:
        known = [p for p in known if p != 42]  # 0.14.0 paged_attention_fwd: quant_policy 42 does not support shared_kv
        if h.quant_policy == 42:
            raise DetectionError("lmdeploy: TurboQuant (quant_policy 42) with MLA (v_head_dim 0): LMDeploy's paged attention refuses it")
    policies = [h.quant_policy] if h.quant_policy is not None else known
    orders = list(dict.fromkeys(o for o, _ in _readings(pool, h, window)))
    several = h.kernel_block_size is None and any(len(_kernel_blocks(h, o)) > 1 for o in orders)
    cands, tried = [], []
    for policy in policies:
        for order in orders:
            if policy in (4, 8, 42) and order == "HND":
                continue  # LMDeploy quantises on cuda / ascend only
            if policy in _FP8 and order == "HND":
                continue  # fp8 KV is CUDA only (0.14.0 CacheEngine.__init__)
            if mla and order != "NHD":
                continue  # an MLA latent is one head: (block_size, 1, D)
            if policy == 4 and h.k_dim() % 2 or policy == 42 and h.k_dim() % 4:
                tried.append(f"quant_policy {policy}: head_dim {h.k_dim()} cannot be packed")
                continue
            for block in _kernel_blocks(h, order):
                planes = carve_pool(pool, h, policy, order, block)
                need = _plan_bytes(_plan(h, policy, order, block))
                what = f"quant_policy {policy} {order}, {block}-token blocks"
                if planes is None:
                    tried.append(f"{what}: {need} bytes per block, the pool has {pool.shape[2]}")
                    continue
                kv: Any = planes
                if mla and policy in (4, 8):
                    name, kv = F.X_MLA_QUANT, {"KV": planes["K"], "KSZ": planes["KSZ"], "VSZ": planes["VSZ"]}
                elif mla:
                    name, kv = F.X_MLA, planes["K"]
                elif policy == 42:
                    name = F.X_TURBO
                elif policy in (4, 8):
                    name = F.X_QUANT
                else:
                    name = F.X_NHD if order == "NHD" else F.X_HND
                dev = "camb" if order == "HND" else "cuda"
                decided: dict[str, Any] = {"quant_policy": policy, "device_type": dev}
                if several:
                    decided["kernel_block_size"] = block
                cands.append(
                    Candidate(
                        name,
                        kv,
                        note=f"LMDeploy 0.11.1+ memory pool{' (MLA)' if mla else ''}, {what}, cut at 256-byte-aligned slices"
                        + _block_note(h, block),
                        decided_by=decided,
                        label=what,
                    )
                )
    if not cands:
        raise DetectionError(
            "lmdeploy: the memory pool's bytes per block fit no reading of the hints (extra ModelConfig.cache_shapes slices "
            "are not described):\n" + "\n".join(f"  - {t}" for t in tried)
        )
    return _resolve(cands, h)
