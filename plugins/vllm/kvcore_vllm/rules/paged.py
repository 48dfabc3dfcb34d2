"""vLLM's paged-attention readings (``PagedAttention.split_kv_cache``; 0.11 TORCH_SDPA with and
without IPEX; ROCm prefill-decode and paged attention up to 0.28): the rules, their view
transforms and the split-K plane builder."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore_vllm.hints import VllmHints
from kvcore_vllm.rules.rule import Rule, _o, _src
from kvcore_vllm.rules.sources import _CPU, _ROCM, _SPLIT, HYBRID_SOURCE

#: vLLM's paged-attention reading (``PagedAttention.split_kv_cache``): K ``(NB, NH, HS/x,
#: BS, x)`` with ``x = 16 // element_size``, V ``(NB, NH, HS, BS)`` -- K and V differ, so
#: one plane each.
SPLIT_KV = "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS"
#: the paged kernels' K chunk, in bytes (``x = 16 // element_size``).
K_CHUNK_BYTES = 16

PAGED_RULES: tuple[Rule, ...] = (
    Rule(
        label="CPU 0.11 TORCH_SDPA without IPEX (2, NB, BS*NH*HS) read by split_kv_cache",
        eras=("0.11",),
        families=("CPU",),
        rank=3,
        logical=_o("TWO NB NH HS BS"),
        layouts={"*": SPLIT_KV},
        sources=(
            _src("0.11.0", _CPU + "::_PagedAttention.get_kv_cache_shape / split_kv_cache (K (NB, NH, HS/x, BS, x), V (NB, NH, HS, BS))"),
        ),
        transform="paged",
        gate="cpu",
        requires=(("use_ipex", False),),
        backends_label=("TORCH_SDPA",),
        planes="split_kv",
    ),
    Rule(
        label="CPU 0.11 TORCH_SDPA with IPEX (2, NB, BS*NH*HS) viewed (NB, NH, BS, HS)",
        eras=("0.11",),
        families=("CPU",),
        rank=3,
        logical=_o("TWO NB NH BS HS"),
        # beside Mamba layers: CPUModelRunner inherits GPUModelRunner's restride (platforms/cpu.py
        # support_hybrid_kv_cache() is True): per block the K side's (NH, BS, HS), then the V side's
        layouts={"*": _o("NL TWO NB NH BS HS"), "*/mamba": _o("NL NB TWO NH BS HS")},
        sources=(
            _src("0.11.0", _CPU + "::_IPEXPagedAttention.split_kv_cache: view(num_blocks, num_kv_heads, -1, head_size)"),
            _src("0.11.0", HYBRID_SOURCE + "; v1/worker/cpu_model_runner.py::CPUModelRunner(GPUModelRunner)"),
        ),
        transform="paged_ipex",
        gate="cpu",
        requires=(("use_ipex", True),),
        backends_label=("TORCH_SDPA",),
    ),
    Rule(
        label="ROCm prefill-decode paged (2, NB, BS, NH, HS) read by split_kv_cache",
        eras=("0.11",),
        families=("ROCM_ATTN",),
        rank=5,
        logical=_o("TWO NB NH HS BS"),
        layouts={"*": SPLIT_KV},
        sources=(_src("0.11.0", _ROCM + "::RocmAttentionImpl.forward with VLLM_V1_USE_PREFILL_DECODE_ATTENTION=1: " + _SPLIT),),
        transform="paged5",
        gate="rocm",
        requires=(("prefill_decode_attention", True),),
        backends_label=("ROCM_ATTN",),
        planes="split_kv",
    ),
    Rule(
        label="ROCm paged (2, NB, BS, NH, HS) read by split_kv_cache",
        eras=("0.13", "0.24", "0.26"),
        families=("ROCM_ATTN",),
        rank=5,
        logical=_o("TWO NB NH HS BS"),
        layouts={"*": SPLIT_KV},
        sources=(
            _src("0.13.0", _ROCM + "::RocmAttentionImpl.forward: " + _SPLIT),
            _src("0.24.0", _ROCM + "; v1/attention/ops/paged_attn.py::PagedAttention.split_kv_cache"),
            _src("0.26.0", _ROCM + "; v1/attention/ops/paged_attn.py::PagedAttention.split_kv_cache"),
        ),
        transform="paged5",
        gate="rocm",
        backends_label=("ROCM_ATTN",),
        planes="split_kv",
    ),
)


def flat_geometry(flat: int, h: VllmHints) -> tuple[int, int, int] | None:
    """``(block_size, num_kv_heads, head_size)`` of vLLM 0.11 TORCH_SDPA's flat row
    (``cpu_attn.py::_PagedAttention.get_kv_cache_shape``: ``(2, NB, BS*NH*HS)``, ``flat``
    elements per block and side) from the hints: any two of the three fix the third
    (``flat`` divided by their product). None when fewer than two are given, when the third
    is not a whole number, or when all three are given and their product is not ``flat``
    (:func:`flat_misfit` says which)."""
    n, nh, d = h.block_size, h.num_kv_heads, h.head_size
    if sum(x is not None for x in (n, nh, d)) < 2:
        return None
    if n is None:
        n, rest = divmod(flat, nh * d)
    elif nh is None:
        nh, rest = divmod(flat, n * d)
    elif d is None:
        d, rest = divmod(flat, n * nh)
    else:
        rest = flat - n * nh * d
    if rest or not (n and nh and d):
        return None
    return n, nh, d


def flat_misfit(flat: int, h: VllmHints) -> str | None:
    """Why the hints cannot split 0.11 TORCH_SDPA's flat row of ``flat`` elements (two or
    three of block_size, num_kv_heads, head_size given), or None."""
    given = {k: v for k, v in (("block_size", h.block_size), ("num_kv_heads", h.num_kv_heads), ("head_size", h.head_size)) if v}
    if len(given) < 2 or flat_geometry(flat, h) is not None:
        return None
    said = " * ".join(f"{k}={v}" for k, v in given.items())
    prod = 1
    for v in given.values():
        prod *= v
    if len(given) == 3:
        return f"{said} = {prod}, but each block holds {flat} elements per side (block_size*num_kv_heads*head_size); fix a hint"
    other = next(k for k in ("block_size", "num_kv_heads", "head_size") if k not in given)
    return f"{said} = {prod} does not divide the {flat} elements per block and side (block_size*num_kv_heads*head_size): no whole {other} fits; fix a hint"


def _t_paged(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.11 CPU: (2, B, N*H*D) -> V's view (2, B, H, D, N); needs two of block_size, num_kv_heads, head_size
    two, b, flat = t.shape
    g = flat_geometry(flat, h)
    if g is None or t.stride(2) != 1:
        return None
    n, nh, d = g
    return torch.as_strided(t, (two, b, nh, d, n), (t.stride(0), t.stride(1), d * n, n, 1), t.storage_offset())


def _t_paged5(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # ROCm <= 0.2x: (2, NB, BS, NH, HS) allocated contiguous, read as the paged layout -> V's view (2, NB, NH, HS, BS)
    two, b, n, nh, d = t.shape
    if (d > 1 and t.stride(4) != 1) or (nh > 1 and t.stride(3) != d) or (n > 1 and t.stride(2) != nh * d):
        return None
    return torch.as_strided(t, (two, b, nh, d, n), (t.stride(0), t.stride(1), d * n, n, 1), t.storage_offset())


def _t_paged_ipex(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.11 CPU with IPEX: (2, B, N*H*D) -> (2, B, H, N, D) (_IPEXPagedAttention.split_kv_cache)
    two, b, flat = t.shape
    g = flat_geometry(flat, h)
    if g is None or t.stride(2) != 1:
        return None
    n, nh, d = g
    return torch.as_strided(t, (two, b, nh, n, d), (t.stride(0), t.stride(1), n * d, d, 1), t.storage_offset())


def _p_split_kv(v: torch.Tensor, tokens: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """``PagedAttention.split_kv_cache`` (vLLM 0.11 ``attention/ops/paged_attn.py``, 0.24+
    ``v1/attention/ops/paged_attn.py``; 0.11 CPU ``cpu_attn.py::_PagedAttention``): the K slot's
    ``NH*HS*BS`` run per block viewed ``(NH, HS/x, BS, x)``, x = 16 // element_size, the V slot's
    ``(NH, HS, BS)``. ``v`` is the V-shaped view of both slots (``TWO`` among ``tokens``, the
    rest ``NB NH HS BS``) in the element dtype."""
    two = list(tokens).index("TWO")
    k, val = v.select(two, 0), v.select(two, 1)
    nb, nh, hs, bs = k.shape
    x = K_CHUNK_BYTES // v.element_size()
    if x < 1 or hs % x:
        return None  # vLLM's view(num_blocks, num_kv_heads, head_size // x, -1, x) needs x | head_size
    sb, sh, sd, sn = k.stride()
    if (bs > 1 and sn != 1) or (hs > 1 and sd != bs):
        return None
    key = torch.as_strided(k, (nb, nh, hs // x, bs, x), (sb, sh, bs * x, x, 1), k.storage_offset())
    return {"K": key, "V": val}


def _missing_hints(rule: Rule, t: torch.Tensor, h: VllmHints) -> list[str]:
    """The hints a rule's transform needs and did not get (only the flat CPU layouts need any:
    0.11 TORCH_SDPA's ``(2, NB, BS*NH*HS)``, with or without IPEX: two of block_size,
    num_kv_heads and head_size, :func:`flat_geometry`)."""
    if rule.transform not in ("paged", "paged_ipex") or t.shape[0] != 2:
        return []
    names = ("block_size", "num_kv_heads", "head_size")
    missing = [k for k in names if getattr(h, k) is None]
    if len(missing) <= 1:
        return []
    return [f"{' or '.join(missing)} (two of block_size, num_kv_heads, head_size split the flat BS*NH*HS row)"]
