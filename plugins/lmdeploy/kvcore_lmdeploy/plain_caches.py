"""Unquantised LMDeploy caches: ``(k, v)`` pairs of one head size, Ascend 310P NZ blocks, and MLA
(V of head size 0)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore import Candidate, DetectionError
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.block_orders import _readings
from kvcore_lmdeploy.checks import (
    _FP8,
    _FP8_DTYPES,
    MLA_FP8_HEAD_DIM,
    _block_note,
    _bs_nh,
    _fits,
    _head_check,
    _mla_head_check,
    _resolve,
    _value_dtype_check,
)
from kvcore_lmdeploy.hints import LMDeployHints
from kvcore_lmdeploy.release_window import _kernel_blocks_possible

_FP8_WHY = "run an fp8 KV cache: LMDeploy 0.14.0 CacheEngine.__init__ asserts 'FP8 quantization is only supported on CUDA device'"
_INT_WHY = "quantise the KV cache (PytorchEngineConfig.__post_init__: cuda and ascend only)"


def _plain(ks: list, vs: list, k: torch.Tensor, v: torch.Tensor, h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """Unquantised / fp8 K and V (and MLA: V of head size 0)."""
    lead = 1 if cross else 0  # the NL axis of a cross-layer tensor
    what = "K (cross-layer)" if cross else "K"
    if h.quant_policy in (4, 8, 42):
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} keeps per-token-head scale/zero tensors beside K and V, but only "
            f"{'K, V' if cross else '(k, v) per layer'} were passed: a plane is missing (pass all four)"
        )
    if int(v.shape[-1]) == 0:  # MLA: ModelConfig.v_head_dim == 0 (deepseek_v2.py)
        return _mla(ks, k, v, h, cross=cross, window=window)
    _value_dtype_check(k, h, what, window)
    if v.dtype != k.dtype or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise DetectionError(
            f"lmdeploy: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} disagree beyond the head size; "
            "CacheEngine allocates them with one dtype, block count, block size and head count"
        )
    if int(v.shape[-1]) != int(k.shape[-1]):
        raise DetectionError(
            f"lmdeploy: K head size {k.shape[-1]} and V head size {v.shape[-1]} differ (k_head_dim != v_head_dim): not "
            "described by kvcore-lmdeploy (no released model allocates it outside MLA)"
        )
    fp8 = k.dtype in _FP8_DTYPES or h.quant_policy in _FP8
    readings = _readings(k, h, window, allowed=("cuda",) if fp8 else None, what=f"{what} is {k.dtype}", why=_FP8_WHY)
    kernel = _kernel_blocks_possible(window)
    cands: list[Candidate] = []
    pseudo: list[Candidate] = []
    reasons: list[str] = []
    seen: set[str] = set()
    for order, dec in readings:
        if order == "NZ" or order in seen:
            continue  # one backend's NHD (or HND) moves the same bytes as another's: the first one stands for both
        seen.add(order)
        bs, nh = _bs_nh(k.shape[lead + 1 : lead + 3], order)
        if not _fits(h, order, bs, nh, reasons, "K, V", kernel):
            continue
        try:
            _head_check(h, int(k.shape[-1]), int(v.shape[-1]), h.quant_policy)
        except DetectionError as e:
            reasons.append(f"K, V read {order}: {str(e).removeprefix('lmdeploy: ')}")
            continue
        dev = dec["device_type"]
        if cross:
            name = F.X_NHD if order == "NHD" else F.X_HND
            kv: Any = {"K": ks[0], "V": vs[0]}
        else:
            name = F.NHD if order == "NHD" else F.HND
            kv = [(a, b) for a, b in zip(ks, vs)]
        cands.append(
            Candidate(
                name,
                kv,
                note=f"LMDeploy {'cross-layer K, V' if cross else 'gpu_cache (k, v) per layer'}, {order} blocks ({dev} backend)"
                + _block_note(h, bs),
                decided_by=dec,
                label=f"{order} ({dev})",
            )
        )
    for order, dec in readings:
        if order == "NZ":
            got = _nz_candidate(ks, vs, k, h, cross=cross, dec=dec, kernel=kernel, reasons=reasons)
            if got is not None:
                cands.append(got[0])
                if got[1]:
                    pseudo.append(got[0])
    if not cands:
        raise DetectionError("lmdeploy: no block order fits the hints: " + "; ".join(reasons))
    if all(any(c is p for p in pseudo) for c in cands):
        raise DetectionError(f"lmdeploy: {cands[0].note}" + ("; other readings: " + "; ".join(reasons) if reasons else ""))
    return _resolve(cands, h)


# -- Ascend 310P NZ blocks (0.8.0-0.11.0) ----------------------------------------------------------


def _nz_heads(h: LMDeployHints, chunks: int, reasons: list[str]) -> tuple[int, int] | str | None:
    """``(num_heads, head_size)`` of NZ blocks of ``chunks`` 16-element chunks per token
    (``(num_heads * head_size + 15) // 16``), from ``num_kv_heads`` / ``head_dim``;
    ``"unknown"`` without them, ``"undescribed"`` for a head size that is not a multiple of
    16 (its chunks straddle heads: no per-head address pattern), None when the hints do not
    fit (the reason appended)."""
    nh, hd = h.num_kv_heads, h.k_dim()
    what = "K, V read as Ascend 310P NZ blocks"
    if h.v_dim() is not None and hd is not None and h.v_dim() != hd:
        reasons.append(f"{what}: k_head_dim {hd} != v_head_dim {h.v_dim()}, but K and V blocks have one shape")
        return None
    if nh is None and hd is None:
        return "unknown"
    if hd is not None and hd % 16:
        if nh is not None and (nh * hd + 15) // 16 != chunks:
            reasons.append(f"{what}: {nh} heads of {hd} make {(nh * hd + 15) // 16} chunks of 16, the tensors hold {chunks}")
            return None
        return "undescribed"
    if hd is None:
        if chunks % nh:
            reasons.append(f"{what}: {chunks} chunks of 16 elements are not num_kv_heads={nh} heads of a multiple of 16")
            return None
        hd = 16 * chunks // nh
    elif nh is None:
        if chunks % (hd // 16):
            reasons.append(f"{what}: {chunks} chunks of 16 elements are not heads of head_dim={hd}")
            return None
        nh = chunks // (hd // 16)
    if (nh * hd + 15) // 16 != chunks:
        reasons.append(f"{what}: {nh} heads of {hd} make {(nh * hd + 15) // 16} chunks of 16, the tensors hold {chunks}")
        return None
    return nh, hd


def _nz_candidate(
    ks: list, vs: list, k: torch.Tensor, h: LMDeployHints, *, cross: bool, dec: dict, kernel: bool, reasons: list[str]
) -> tuple[Candidate, bool] | None:
    """The Ascend 310P reading of 4-D blocks ``[NB, C, BS, 16]``: 0.8.0-0.11.0
    ``AscendOpsBackend.get_k_block_shape`` returns ``((num_heads * head_size + 15) // 16,
    block_size, 16)`` on ``SocVersion.is_Ascend310P()``; the element order is FRACTAL_NZ
    (``ascend/utils.py::nd_to_nz_spec``: a block's ``[BS, NH*HS]`` rows reshaped to
    ``(BS, NH*HS/16, 16)`` and permuted to ``(NH*HS/16, BS, 16)``), so element ``d`` of head
    ``h`` of token ``t`` is ``[(h*HS + d) // 16, t, (h*HS + d) % 16]``. With ``HS`` a multiple
    of 16 that is ``[NB, NH, HS/16, BS, 16]``: the chunk axis unflattened into (head,
    chunk). Returns ``(candidate, placeholder)``: a placeholder (one pseudo-head of all the
    chunks) stands for a reading whose heads the hints do not give, or that is not
    described; it is never an answer (see :func:`_plain`)."""
    lead = 1 if cross else 0
    what = "K, V read as Ascend 310P NZ blocks"
    if int(k.shape[-1]) != 16:
        reasons.append(f"{what}: NZ blocks end in 16 elements, these in {int(k.shape[-1])}")
        return None
    chunks, bs = int(k.shape[lead + 1]), int(k.shape[lead + 2])
    if not _fits(h, "NZ", bs, None, reasons, "K, V", kernel):
        return None
    heads = _nz_heads(h, chunks, reasons)
    if heads is None:
        return None
    fmt = F.X_NZ if cross else F.NZ
    if isinstance(heads, str):
        nh, per_head = 1, chunks
        if heads == "unknown":
            label = "Ascend 310P NZ, heads unknown"
            note = (
                f"these tensors read as Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0, [NB, {chunks}, {bs}, 16]: "
                f"{chunks} chunks of 16 elements per token), whose heads the tensors do not show: pass num_kv_heads or head_dim"
            )
        else:
            label = "Ascend 310P NZ, not described"
            note = (
                f"these tensors read as Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0) of head_dim={h.k_dim()}, not a multiple "
                "of 16: the 16-element chunks straddle heads, which kvcore-lmdeploy does not describe"
            )
        placeholder = True
    else:
        nh, hd = heads
        per_head = hd // 16
        label = "Ascend 310P NZ"
        note = (
            f"LMDeploy Ascend 310P NZ blocks ({'cross-layer K, V' if cross else 'gpu_cache (k, v) per layer'}): "
            f"[NB, {chunks}, {bs}, 16] read as {nh} heads of {hd}" + _block_note(h, bs)
        )
        placeholder = False
    if cross:
        kv: Any = {"K": ks[0].unflatten(2, (nh, per_head)), "V": vs[0].unflatten(2, (nh, per_head))}
    else:
        kv = {"K": [t.unflatten(1, (nh, per_head)) for t in ks], "V": [t.unflatten(1, (nh, per_head)) for t in vs]}
    return Candidate(fmt, kv, note=note, decided_by=dec, label=label), placeholder


# -- MLA (V of head size 0) --------------------------------------------------------------------------


def _mla_block(k: torch.Tensor, h: LMDeployHints, window: tuple, lead: int, *, allowed: Sequence[str] | None, what: str, why: str) -> None:
    """An MLA latent is ``[.., BS, 1, D]``: NHD blocks of one head (CUDA; DeepSeek's
    ``num_key_value_heads = 1``, per rank after ``update_num_kv_heads``)."""
    orders = [o for o, _ in _readings(k, h, window, allowed=allowed, what=what, why=why)]
    if int(k.shape[lead + 2]) != 1 or h.device_type == "camb" or "NHD" not in orders:
        raise DetectionError(
            f"lmdeploy: a V of head size 0 is MLA, whose K is [NB, BS, 1, D] (an NHD block of one head); got K {tuple(k.shape)}"
            + ("" if "NHD" in orders else f" from a backend that allocates {orders} blocks")
        )


def _mla(ks: list, k: torch.Tensor, v: torch.Tensor, h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """DeepSeek MLA: ``ModelConfig`` ``k_head_dim = kv_lora_rank + qk_rope_head_dim``,
    ``v_head_dim = 0``, one KV head (``configurations/deepseek_v2.py::DeepseekV2ModelConfigBuilder.build``):
    K ``[NB, BS, 1, D]`` holds the latents, V ``[NB, BS, 1, 0]`` nothing (the model reads V
    as ``k_cache[..., :kv_lora_rank]``, ``models/deepseek_v2.py``). fp8 (quant_policy 16 /
    17, 0.14) stores the latents as fp8 of the same width; 0.11.1+ ``use_mla_fp8_cache``
    records (``MLA_FP8_HEAD_DIM`` = 656 bytes of fp8 values, fp32 scales and bf16 rope) are
    not described."""
    lead = 1 if cross else 0
    if v.dtype != k.dtype or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise DetectionError(
            f"lmdeploy: MLA K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} disagree beyond the head size; "
            "CacheEngine allocates them alike (V of head size 0)"
        )
    width = int(k.shape[-1])
    if k.dtype == torch.float8_e4m3fn and width == MLA_FP8_HEAD_DIM and h.k_dim() != MLA_FP8_HEAD_DIM:
        raise DetectionError(
            "lmdeploy: an fp8 MLA cache of 656-byte records (0.11+ use_mla_fp8_cache: 512 fp8 values, 4 fp32 scales, 64 bf16 "
            "rope -- cache_engine.py::MLA_FP8_HEAD_DIM) is not described by kvcore-lmdeploy"
        )
    _value_dtype_check(k, h, "the MLA latent (K)", window)
    fp8 = k.dtype in _FP8_DTYPES
    _mla_block(k, h, window, lead, allowed=("cuda",) if fp8 else None, what=f"an MLA latent of {k.dtype}", why=_FP8_WHY)
    _mla_head_check(h, width, h.quant_policy)
    reasons: list[str] = []
    bs = int(k.shape[lead + 1])
    if not _fits(h, "NHD", bs, 1, reasons, "MLA K", _kernel_blocks_possible(window)):
        raise DetectionError("lmdeploy: " + "; ".join(reasons))
    fmt, kv = (F.X_MLA, ks[0]) if cross else (F.MLA, list(ks))
    where = "cross-layer K" if cross else "gpu_cache K per layer"
    c = Candidate(fmt, kv, note=f"LMDeploy MLA: K latents ({where}; V is not stored)" + _block_note(h, bs), label="MLA")
    return _resolve([c], h)
