"""Quantised LMDeploy caches: int4 / int8 / TurboQuant ``(k, v, k_scales_zeros, v_scales_zeros)``,
MLA included."""

from __future__ import annotations

from typing import Any

import torch

from kvcore import AmbiguousLayoutError, Candidate, DetectionError
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.block_orders import _readings
from kvcore_lmdeploy.checks import _block_note, _bs_nh, _fits, _head_check, _mla_head_check, _resolve
from kvcore_lmdeploy.hints import LMDeployHints
from kvcore_lmdeploy.plain_caches import _INT_WHY, _mla_block
from kvcore_lmdeploy.release_window import _kernel_blocks_possible


def _side_checks(s1: torch.Tensor, s2: torch.Tensor, h: LMDeployHints) -> tuple[int, int]:
    w1, w2 = int(s1.shape[-1]), int(s2.shape[-1])
    if (w1, w2) not in ((2, 2), (2, 1)):
        raise DetectionError(
            f"lmdeploy: the side tensors end in {w1} and {w2} elements; int4/int8 keep (scale, zero) pairs (2, 2), TurboQuant "
            "(mse_norm, qjl_norm) for K and one norm for V (2, 1) -- CacheEngine.get_quant_cache_descs"
        )
    if s1.dtype != s2.dtype or not s1.dtype.is_floating_point or s1.element_size() < 2:
        raise DetectionError(
            f"lmdeploy: the scale/zero tensors are {s1.dtype} and {s2.dtype}; CacheEngine keeps both in the model dtype "
            "(bfloat16, float16 or float32)"
        )
    if h.dtype is not None and s1.dtype != h.dtype:
        raise DetectionError(f"lmdeploy: hint dtype={h.dtype} but the scale/zero tensors are {s1.dtype} (they hold the model dtype)")
    if h.quant_policy in (0, 16, 17):
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} keeps no scale/zero tensors, but each layer holds four tensors with "
            f"uint8 K/V; with quant_policy {h.quant_policy} the extra tensors would be ModelConfig.cache_shapes (custom "
            "caches), which kvcore-lmdeploy does not describe"
        )
    return w1, w2


def _int_backends_check(k: torch.Tensor, h: LMDeployHints) -> None:
    """CUDA stores int4 / int8 / TurboQuant codes as uint8 (``CacheEngine.__init__``; 0.11.1+
    ``get_k_cache_desc``): int8 codes are Ascend's (<= 0.11.0)."""
    if k.dtype == torch.int8 and (h.device_type == "cuda" or (h.device_type is None and k.device.type == "cuda")):
        raise DetectionError(
            "lmdeploy: the codes are int8, but LMDeploy's CUDA backend stores them as uint8 (CacheEngine.__init__: int8 is "
            "Ascend's, up to 0.11.0)"
        )


def _quant_readings(k: torch.Tensor, h: LMDeployHints, window: tuple) -> list[tuple[str, dict]]:
    """Block orders of a quantised cache: CUDA (uint8) or Ascend (int8 up to 0.11.0, uint8
    in the 0.11.1+ pool descs); a CPU copy's dtype names which. Ascend 310P NZ blocks are
    possible for int8 codes only (0.8.0-0.11.0, where Ascend stores int8)."""
    _int_backends_check(k, h)
    found = _readings(k, h, window, allowed=("cuda", "ascend"), what="a quantised cache", why=_INT_WHY)
    if k.dtype == torch.int8:
        found = [(o, d) for o, d in found if d["device_type"] != "cuda"] or found
    else:
        found = [(o, d) for o, d in found if o != "NZ"]
    return found


def _quant(planes: dict[str, list], refs: list[torch.Tensor], h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """int4 / int8 ((scale, zero) pairs) or TurboQuant (norms) values and side planes."""
    k, v, s1, s2 = refs
    lead = 1 if cross else 0
    if v.dtype != k.dtype:
        raise DetectionError(f"lmdeploy: quantised K is {k.dtype} but V is {v.dtype}; CacheEngine stores both as uint8 (ascend: int8)")
    w1, w2 = _side_checks(s1, s2, h)
    if window[1] <= (0, 6, 2):
        raise DetectionError(
            f"lmdeploy: a quantised cache (codes with scale/zero tensors), but the hint lmdeploy_version={h.lmdeploy_version!r}: "
            "the PyTorch engine quantises the KV cache from 0.6.2"
        )
    if int(v.shape[-1]) == 0:
        return _mla_quant(planes, refs, h, cross=cross, window=window)
    turbo = (w1, w2) == (2, 1)
    if h.quant_policy is not None and (h.quant_policy == 42) != turbo:
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} but the side tensors end in ({w1}, {w2}) elements "
            f"({'TurboQuant' if turbo else 'int4/int8'} keeps that)"
        )
    if turbo and window[1] <= (0, 14, 0):
        raise DetectionError(
            f"lmdeploy: TurboQuant side tensors (norms ending in 2 and 1 elements), but the hint lmdeploy_version="
            f"{h.lmdeploy_version!r}: TurboQuant (quant_policy 42) is 0.14.0's"
        )
    # every plane addresses the same blocks, tokens and heads (the block shape's first two axes)
    shapes = {r: tuple(int(x) for x in t.shape[: lead + 3]) for r, t in zip(("K", "V", "S1", "S2"), refs)}
    roles = F.TURBO_ROLES if turbo else F.INT_ROLES
    named = dict(zip(("K", "V", "S1", "S2"), roles))
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{named[r]} {s}" for r, s in shapes.items())
        raise DetectionError(
            f"lmdeploy: the planes disagree on {'layers, ' if cross else ''}blocks, block size or heads ({listed}); "
            "CacheEngine allocates the scale/zero tensors as block_shape[:-1] + [2] beside K and V"
        )
    readings = _quant_readings(k, h, window)
    if any(o == "NZ" for o, _ in readings) and int(k.shape[-1]) == 16:
        others = [F.X_TURBO if turbo else F.X_QUANT] if cross else [F.TURBO if turbo else F.QUANT]
        if all(o == "NZ" for o, _ in readings):
            raise DetectionError(
                "lmdeploy: a quantised cache in Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0: codes ((NH*HS+15)//16, BS, 16) "
                "with scale/zero tensors ((NH*HS+15)//16, BS, 2)) is not described by kvcore-lmdeploy"
            )
        raise AmbiguousLayoutError(
            f"lmdeploy: these int8 codes [.., {k.shape[lead + 1]}, {k.shape[lead + 2]}, 16] fit Ascend 910 blocks (block_size "
            f"{k.shape[lead + 1]}, {k.shape[lead + 2]} heads of 16) and Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0: "
            "((NH*HS+15)//16, BS, 16), not described by kvcore-lmdeploy; 0.7.x allocates (BS, NH, HS) on every chip); pass "
            + " or ".join(k for k in ("soc_version (e.g. 'Ascend910B3')", "lmdeploy_version") if getattr(h, k.split()[0]) is None)
            + " to decide",
            candidates=others + ["Ascend 310P NZ quantised blocks (not described)"],
            hints=[k for k in ("soc_version", "lmdeploy_version") if getattr(h, k) is None],
        )
    policy = h.quant_policy
    if policy is None and turbo:
        policy = 42
    if policy is not None:
        _head_check(h, int(k.shape[-1]), int(v.shape[-1]), policy)
    elif h.k_dim() is not None:
        # int4 or int8: the tensors move the same bytes either way; head_dim (HS vs 2 * stored bytes) names which
        try:
            _head_check(h, int(k.shape[-1]), int(v.shape[-1]), 8)
            policy = 8
        except DetectionError:
            _head_check(h, int(k.shape[-1]), int(v.shape[-1]), 4)
            policy = 4
    if not turbo and int(k.shape[-1]) != int(v.shape[-1]):
        raise DetectionError(f"lmdeploy: int4/int8 K holds {k.shape[-1]} bytes per head but V {v.shape[-1]}; they pack alike")
    if turbo and int(k.shape[-1]) != 2 * int(v.shape[-1]):
        raise DetectionError(
            f"lmdeploy: TurboQuant packs K in head_dim/2 bytes and V in head_dim/4, but K holds {k.shape[-1]} and V {v.shape[-1]}"
        )
    bs, nh = _bs_nh(k.shape[lead + 1 : lead + 3], "NHD")
    reasons: list[str] = []
    if not _fits(h, "NHD", bs, nh, reasons, "the quantised planes", _kernel_blocks_possible(window)):
        raise DetectionError("lmdeploy: " + "; ".join(reasons))
    name = (F.X_TURBO if turbo else F.X_QUANT) if cross else (F.TURBO if turbo else F.QUANT)
    kv = {named[r]: (cols[0] if cross else list(cols)) for r, cols in planes.items()}
    what = "TurboQuant" if turbo else {4: "int4", 8: "int8"}.get(policy or 0, "int4/int8")
    c = Candidate(
        name,
        kv,
        note=f"LMDeploy {what} KV with per-token-head side planes ({'cross-layer' if cross else 'per layer'})" + _block_note(h, bs),
    )
    return _resolve([c], h)


def _mla_quant(planes: dict[str, list], refs: list[torch.Tensor], h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """DeepSeek MLA with int8 / int4 (quant_policy 8 / 4, 0.6.2+): CacheEngine allocates the
    latent codes K ``[.., BS, 1, D]`` (int4: ``D/2`` bytes), an empty V ``[.., BS, 1, 0]`` and
    both ``(*block_shape[:-1], 2)`` scale/zero tensors. ``models/deepseek_v2.py::
    DeepseekV2Attention.forward`` passes ``k_cache = past_key_value[0]``, ``v_cache =
    past_key_value[0][..., :kv_lora_rank]`` and ``k_scales_zeros`` / ``v_scales_zeros`` =
    ``past_key_value[2]`` / ``[3]``; ``fill_kv_cache`` writes K codes and ``k_scales_zeros``
    (``BLOCK_DV = 0``: V shares K's memory), the attention kernels read V as the latent
    codes with ``v_scales_zeros``. So the record is three planes: ``KV`` (the latent codes),
    ``KSZ``, ``VSZ`` -- all cache memory the engine reads, moved byte for byte."""
    k, v, s1, s2 = refs
    lead = 1 if cross else 0
    if (int(s1.shape[-1]), int(s2.shape[-1])) == (2, 1) or h.quant_policy == 42:
        raise DetectionError(
            "lmdeploy: TurboQuant (quant_policy 42) with MLA (V of head size 0): LMDeploy 0.14.0's paged attention asserts "
            "'quant_policy==42 does not support shared_kv' (pagedattention.py::paged_attention_fwd); not an LMDeploy cache"
        )
    shapes = {r: tuple(int(x) for x in t.shape[: lead + 3]) for r, t in (("KV", k), ("V", v), ("KSZ", s1), ("VSZ", s2))}
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{r} {s}" for r, s in shapes.items())
        raise DetectionError(
            f"lmdeploy: the MLA planes disagree on {'layers, ' if cross else ''}blocks, block size or heads ({listed}); "
            "CacheEngine allocates V and the scale/zero tensors with K's block shape"
        )
    _mla_block(k, h, window, lead, allowed=("cuda", "ascend"), what="a quantised cache", why=_INT_WHY)
    _int_backends_check(k, h)
    width = int(k.shape[-1])
    policy = h.quant_policy
    if policy is not None:
        _mla_head_check(h, width, policy)
    elif h.k_dim() is not None:
        try:
            _mla_head_check(h, width, 8)
            policy = 8
        except DetectionError:
            _mla_head_check(h, width, 4)
            policy = 4
    else:
        _mla_head_check(h, width, None)
    reasons: list[str] = []
    bs = int(k.shape[lead + 1])
    if not _fits(h, "NHD", bs, 1, reasons, "the MLA planes", _kernel_blocks_possible(window)):
        raise DetectionError("lmdeploy: " + "; ".join(reasons))
    name = F.X_MLA_QUANT if cross else F.MLA_QUANT
    cols = {"KV": planes["K"], "KSZ": planes["S1"], "VSZ": planes["S2"]}
    kv = {r: (c[0] if cross else list(c)) for r, c in cols.items()}
    what = {4: "int4", 8: "int8"}.get(policy or 0, "int4/int8")
    c = Candidate(
        name,
        kv,
        note=f"LMDeploy MLA {what}: latent codes KV with k/v (scale, zero) planes KSZ, VSZ ({'cross-layer' if cross else 'per layer'}; "
        "V is read as the latent's first kv_lora_rank codes with VSZ)" + _block_note(h, bs),
        label="MLA " + what,
    )
    return _resolve([c], h)
