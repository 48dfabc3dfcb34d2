"""LMDeploy's int8 / int4 KV quantisation, as its Triton kernels do it (for tests and tools).

Facts (identical in 0.6.2, 0.9.2, 0.11.1, 0.12.3 and 0.14.0):

* ``fill_kv_cache.py::_quant_int8(val)``: per token and head, over the head's ``HS``
  values: ``scale = (max - min) / 255``, ``zero = -min / scale``, code
  ``uint8(val / scale + zero + 0.5)``.
* ``fill_kv_cache.py::_quant_int4(val1, val2)``: ``val1`` is the head's first ``HS/2``
  values, ``val2`` the last ``HS/2``; min/max over both, ``scale = (max - min) / 15``,
  ``zero = -min / scale``, codes as above, byte ``j`` = ``code1[j] + 16 * code2[j]`` (low
  nibble: element ``j``; high nibble: element ``j + HS/2``).
* The scale is stored at ``[..., 0]``, the zero at ``[..., 1]`` of the ``k_scales_zeros`` /
  ``v_scales_zeros`` tensors, in the model dtype (the tensor's dtype: the fp32 results are
  rounded on store).
* Reading back, ``flatten_kv_cache.py::_flatten_kv_cache_quant`` computes ``code * scale -
  scale * zero`` and ``pagedattention.py::_fwd_grouped_split_quant_kernel`` ``(code - zero) *
  scale`` -- the same value; ``_dequant_int4`` takes byte ``d % (HS/2)`` shifted by
  ``4 * (d // (HS/2))``, masked with ``0xF``.

MLA (DeepSeek, 0.6.2+): the latent ``[.., 1, kv_lora_rank + rope]`` is quantised per token
like one head (``fill_kv_cache``'s K path); V is the latent's first ``kv_lora_rank`` codes
read with ``v_scales_zeros`` (see :func:`dequantize_staged`).

TurboQuant (``quant_policy`` 42) is not reconstructed here: its codes index Lloyd-Max
codebooks in a Hadamard-rotated domain (``kernels/cuda/turbo_quant.py``); kvcore moves its
bytes, planes and norms, and claims nothing about their values.
"""

from __future__ import annotations

import torch

from kvcore import GeometryError

__all__ = ["quantize", "dequantize", "dequantize_staged", "tolerance"]


def quantize(x: torch.Tensor, policy: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` ``[..., HS]`` per row the way ``_quant_int8`` / ``_quant_int4`` do.

    Args:
        x: the values (any float dtype; computed in float32 as the kernels load them).
        policy: 8 (int8) or 4 (int4; ``HS`` even).
        scale_dtype: the model dtype the scales and zeros are stored in.
    Returns:
        ``(codes, scales_zeros)``: uint8 ``[..., HS]`` (int4: ``[..., HS/2]``) and
        ``[..., 2]`` of ``scale_dtype`` (scale, zero).
    Raises:
        GeometryError: a policy other than 4 / 8, or an odd ``HS`` for int4.
    """
    x = x.float()
    if policy == 8:
        lo, hi = x.amin(-1), x.amax(-1)
        scale = (hi - lo) / 255
        zero = -lo / scale
        codes = (x / scale[..., None] + zero[..., None] + 0.5).to(torch.uint8)
    elif policy == 4:
        hs = x.shape[-1]
        if hs % 2:
            raise GeometryError(f"int4 packs two codes per byte: head size {hs} is odd")
        lo, hi = x.amin(-1), x.amax(-1)
        scale = (hi - lo) / 15
        zero = -lo / scale
        q = (x / scale[..., None] + zero[..., None] + 0.5).to(torch.uint8)
        codes = q[..., : hs // 2] + q[..., hs // 2 :] * 16
    else:
        raise GeometryError(f"quant_policy {policy}: only int8 (8) and int4 (4) have a (scale, zero) quantisation")
    return codes, torch.stack([scale, zero], -1).to(scale_dtype)


def dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor, policy: int) -> torch.Tensor:
    """What LMDeploy's kernels read: ``(code - zero) * scale`` per element, float32.

    Args:
        codes: uint8 ``[..., W]`` (int8: ``W = HS``; int4: ``W = HS/2``, two codes per byte).
        scales_zeros: ``[..., 2]`` (scale, zero) in the model dtype.
        policy: 8 or 4.
    Returns:
        float32 ``[..., HS]``.
    Raises:
        GeometryError: codes that are not uint8 (or int8), or another policy.
    """
    if codes.dtype not in (torch.uint8, torch.int8):
        raise GeometryError(f"LMDeploy's int4/int8 codes are uint8, got {codes.dtype}")
    c = codes.view(torch.uint8).to(torch.int32)
    if policy == 4:
        c = torch.cat([c & 0xF, (c >> 4) & 0xF], -1)  # _dequant_int4: low nibble first half, high nibble second
    elif policy != 8:
        raise GeometryError(f"quant_policy {policy}: only int8 (8) and int4 (4) dequantise with (scale, zero)")
    sz = scales_zeros.float()
    scale, zero = sz[..., 0:1], sz[..., 1:2]
    return (c.float() - zero) * scale


def dequantize_staged(layout, staged: dict, policy: int, *, kv_lora_rank: int | None = None) -> dict[str, torch.Tensor]:
    """Dequantise a gathered int4/int8 LMDeploy layout, float32.

    * K/V layouts (planes ``K``, ``V``, ``KSZ``, ``VSZ``): ``{"K": [NL, T, NH, HS], "V": ...}``
      from ``K``/``V`` uint8 ``[NL, T, NH*W]`` and ``KSZ``/``VSZ`` ``[NL, T, NH*2]``.
    * MLA (planes ``KV``, ``KSZ``, ``VSZ``): ``{"KV": [NL, T, 1, HS]}``, the latents read with
      ``k_scales_zeros`` (the attention kernels' K); with ``kv_lora_rank``, also ``"V": [NL,
      T, 1, kv_lora_rank]``: DeepSeek's V is ``k_cache[..., :kv_lora_rank]``
      (``models/deepseek_v2.py``) read with ``v_scales_zeros`` -- the latent codes dequantised
      with ``VSZ`` (int4: the kernel unpacks all the bytes of the view,
      ``flatten_kv_cache.py::_flatten_kv_cache_quant`` with ``HEAD_DIM_V = 2 * bytes``), first
      ``kv_lora_rank`` elements. LMDeploy's ``fill_kv_cache`` never writes ``v_scales_zeros``
      for MLA (``BLOCK_DV = 0``: V shares K's memory), so V holds what that memory holds.

    One layer's staging (no ``NL`` axis) works the same.

    Raises:
        GeometryError: the layout is not LMDeploy's int quantised layout, or a plane is missing.
    """
    roles = {p.role for p in layout.planes}
    if roles == {"KV", "KSZ", "VSZ"}:
        missing = sorted(roles - set(staged))
        if missing:
            raise GeometryError(f"the staging dict lacks plane(s) {missing}")
        codes = staged["KV"].unflatten(-1, (1, -1))
        out = {"KV": dequantize(codes, staged["KSZ"].unflatten(-1, (1, 2)), policy)}
        if kv_lora_rank is not None:
            width = out["KV"].shape[-1]
            if not 0 < kv_lora_rank <= width:
                raise GeometryError(f"kv_lora_rank {kv_lora_rank} is not within the latent's {width} elements")
            out["V"] = dequantize(codes, staged["VSZ"].unflatten(-1, (1, 2)), policy)[..., :kv_lora_rank]
        return out
    if roles != {"K", "V", "KSZ", "VSZ"}:
        raise GeometryError(
            f"dequantize_staged needs the planes K, V, KSZ, VSZ (int4/int8) or KV, KSZ, VSZ (MLA int4/int8); the layout has {sorted(roles)}"
        )
    missing = sorted(roles - set(staged))
    if missing:
        raise GeometryError(f"the staging dict lacks plane(s) {missing}")
    nh = layout.num_heads
    out = {}
    for v, sz in (("K", "KSZ"), ("V", "VSZ")):
        codes = staged[v].unflatten(-1, (nh, -1))
        pairs = staged[sz].unflatten(-1, (nh, 2))
        out[v] = dequantize(codes, pairs, policy)
    return out


def tolerance(x: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The most ``dequantize(quantize(x))`` may differ from ``x``, per element: half a
    quantisation step, plus what rounding the scale and zero to their stored dtype moves
    (relative error at most ``eps`` of that dtype each):
    ``0.5*s + (|x| + |z|*s) * eps`` (``s``, ``z`` as stored)."""
    eps = torch.finfo(scales_zeros.dtype).eps
    sz = scales_zeros.float()
    s, z = sz[..., 0:1], sz[..., 1:2]
    return 0.5 * s + (x.float().abs() + z.abs() * s) * eps + 1e-6
