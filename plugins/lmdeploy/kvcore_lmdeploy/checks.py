"""What every LMDeploy reading shares: dtypes and geometry names, per-layer sameness, block
and head checks against the hints, and the final :func:`kvcore.resolve`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore import Candidate, DetectionError, memory_ordered, resolve
from kvcore_lmdeploy.hints import LMDeployHints

#: LMDeploy's names for the geometry kvcore compares between readings
GEOMETRY_HINTS = {"block_size": "block_size", "num_heads": "num_kv_heads", "head_size": "head_dim"}
_INT_DTYPES = (torch.uint8, torch.int8)  # cuda stores int4/int8 codes as uint8, ascend (<= 0.11.0) as int8 (CacheEngine.__init__)
_FP8 = {16: torch.float8_e4m3fn, 17: torch.float8_e5m2}
_FP8_DTYPES = tuple(_FP8.values())
#: 0.11.1+ ``cache_engine.py::MLA_FP8_HEAD_DIM`` (``use_mla_fp8_cache``: 512 fp8 + 4 fp32 scales + 64 bf16 rope)
MLA_FP8_HEAD_DIM = 656


def _same(ts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """The first tensor, after checking every layer's has its shape, strides, dtype and device."""
    ref = ts[0]
    for i, t in enumerate(ts):
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype or t.device != ref.device or t.stride() != ref.stride():
            raise DetectionError(
                f"lmdeploy: {what} of layer {i} is {tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}, layer 0's "
                f"{tuple(ref.shape)} {ref.dtype} strides {ref.stride()} on {ref.device}: CacheEngine allocates every layer alike"
            )
    return ref


def _bs_nh(shape: Sequence[int], order: str) -> tuple[int, int]:
    """(block_size, num_heads) of a block shape ``(BS, NH, HS)`` / ``(NH, BS, HS)``."""
    a, b = int(shape[0]), int(shape[1])
    return (a, b) if order == "NHD" else (b, a)


def _fits(h: LMDeployHints, order: str, bs: int, nh: int | None, reasons: list[str], what: str, kernel_blocks: bool = True) -> bool:
    if not h.block_fits(bs, kernel_blocks):
        said = f"kernel_block_size={h.kernel_block_size}" if h.kernel_block_size is not None else f"block_size={h.block_size}"
        why = "" if kernel_blocks else f" (lmdeploy_version={h.lmdeploy_version!r} has no kernel blocks: those are 0.14.0's)"
        reasons.append(f"{what} read {order}: {bs} tokens per block, but {said}{why}")
        return False
    if nh is not None and h.num_kv_heads is not None and h.num_kv_heads != nh:
        reasons.append(f"{what} read {order}: {nh} heads, but num_kv_heads={h.num_kv_heads}")
        return False
    return True


def _block_note(h: LMDeployHints, bs: int) -> str:
    """What a block id means when the tensors hold 0.14 kernel blocks."""
    if h.block_size is not None and h.block_size != bs:
        r = h.block_size // bs
        return (
            f"; blocks are {bs}-token KERNEL blocks of LMDeploy's {h.block_size}-token blocks: block ids (gather_blocks, "
            f"num_blocks) count kernel blocks, the block manager's block m is kernel blocks m*{r}..m*{r}+{r - 1} "
            "(0.14.0 inputs_maker.py::_map_to_kernel_block_offsets; kvcore_lmdeploy.blocks takes the manager's ids)"
        )
    if h.kernel_block_size is not None:
        return f"; blocks are {bs}-token kernel blocks (kernel_block_size): block ids count kernel blocks"
    return ""


def _check_memory_order(ts: Sequence[torch.Tensor], what: str) -> None:
    for t in ts:
        if not memory_ordered(t):
            raise DetectionError(
                f"lmdeploy: {what} {tuple(t.shape)} has strides {tuple(t.stride())}, whose memory order is not its axis order; "
                "LMDeploy's CacheEngine allocates block tensors in memory order (torch.empty, or slices of its pool): pass them "
                "as the engine holds them"
            )


def _value_dtype_check(k: torch.Tensor, h: LMDeployHints, what: str, window: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    qp = h.quant_policy
    if qp in _FP8 and k.dtype != _FP8[qp]:
        raise DetectionError(f"lmdeploy: quant_policy={qp} stores K/V as {_FP8[qp]}, but {what} is {k.dtype}")
    if qp == 0 and k.dtype in _FP8_DTYPES:
        raise DetectionError(f"lmdeploy: quant_policy=0 stores K/V in the model dtype, but {what} is {k.dtype} (fp8 is 16 / 17)")
    if qp in (0, 16, 17, None) and k.dtype in _INT_DTYPES:
        raise DetectionError(
            f"lmdeploy: {what} is {k.dtype}: an int4/int8/TurboQuant cache, but its scale/zero tensors are missing "
            "(CacheEngine gives each layer (k, v, k_scales_zeros, v_scales_zeros)); pass the whole per-layer tuples"
        )
    if qp in (0, None) and h.dtype is not None and k.dtype not in (h.dtype, *_FP8_DTYPES):
        raise DetectionError(f"lmdeploy: hint dtype={h.dtype} but {what} is {k.dtype} (an unquantised cache holds the model dtype)")
    if k.dtype in _FP8_DTYPES and window[1] <= (0, 14, 0):
        raise DetectionError(
            f"lmdeploy: {what} is {k.dtype}, an fp8 KV cache (quant_policy 16 / 17), which is 0.14.0's, but the hint "
            f"lmdeploy_version={h.lmdeploy_version!r}"
        )


def _head_check(h: LMDeployHints, kw: int, vw: int, policy: int | None) -> None:
    """The stored widths against ``head_dim`` / ``k_head_dim`` / ``v_head_dim``."""
    kd, vd = h.k_dim(), h.v_dim()
    div_k = {4: 2, 42: 2}.get(policy or 0, 1)
    div_v = {4: 2, 42: 4}.get(policy or 0, 1)
    for name, want, got, div in (("K", kd, kw, div_k), ("V", vd, vw, div_v)):
        if want is None:
            continue
        if want % div or want // div != got:
            pack = f" (quant_policy {policy} stores head_dim/{div} bytes)" if div > 1 else ""
            raise DetectionError(f"lmdeploy: {name} holds {got} elements per head, but the head_dim hints say {want}{pack}")


def _mla_head_check(h: LMDeployHints, width: int, policy: int | None) -> None:
    """An MLA latent's stored width against ``k_head_dim`` / ``head_dim`` (int4 stores half),
    and ``v_head_dim``: DeepSeek's ``ModelConfig`` has ``v_head_dim = 0`` (V is not stored),
    so a ``v_head_dim`` given must be 0; ``head_dim`` / ``k_head_dim`` are the latent's
    ``kv_lora_rank + qk_rope_head_dim`` (``configurations/deepseek_v2.py``)."""
    if h.v_head_dim not in (None, 0):
        raise DetectionError(f"lmdeploy: V has head size 0 (MLA) but the hints say v_head_dim={h.v_head_dim}")
    kd = h.k_dim()
    if kd is None:
        return
    div = 2 if policy == 4 else 1
    if kd % div or kd // div != width:
        pack = f" (quant_policy {policy} stores head_dim/{div} bytes)" if div > 1 else ""
        raise DetectionError(f"lmdeploy: the MLA latent (K) holds {width} elements per head, but the head_dim hints say {kd}{pack}")


def _given(h: LMDeployHints) -> dict:
    return {k: v for k, v in h.model_dump().items() if v is not None}


def _resolve(cands: list[Candidate], h: LMDeployHints) -> Any:
    return resolve(cands, engine="lmdeploy", hints=_given(h), geometry_hints=GEOMETRY_HINTS, required=True)
