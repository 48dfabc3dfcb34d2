"""vLLM's CPU_ATTN backend (0.13+): the ``(block, head)`` runs its kernels pack, per kernel path
(vec / vec16 column-major K, AMX tiles), and the Arm NEON BFMMLA path kvcore does not read."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore import DetectionError
from kvcore.dtypes import is_fp8
from kvcore_vllm.hints import VllmHints
from kvcore_vllm.releases import LAYOUT_ERA, version_tuple
from kvcore_vllm.rules.rule import Rule, _o, _src
from kvcore_vllm.rules.sources import _CPU, HYBRID_SOURCE
from kvcore_vllm.rules.views import _BYTE_DTYPES

#: vLLM CPU_ATTN's kernel paths and the planes each packs a (block, head) run into: the
#: column-major K of every non-AMX path (``csrc/cpu/cpu_attn_vec.hpp``, inherited by vec16 and the
#: other ISAs' ``reshape_and_cache``), and AMX's tiles (``csrc/cpu/cpu_attn_amx.hpp``). Proven by
#: vLLM's writer op (``plugins/vllm/tests/engine``).
CPU_VEC = "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
CPU_AMX = "K=NL_X_NB_NH_BSC_HSC_BSE_HSE+V=NL_X_NB_NH_HSC_BSC_HSE_BSE"
_CPU_PATHS = (
    ("vec/vec16 (K column-major)", CPU_VEC, "cpu_vec", False, "csrc/cpu/cpu_attn_vec.hpp::reshape_and_cache (K [HS, BS], V [BS, HS])"),
    (
        "amx (AMX tiles)",
        CPU_AMX,
        "cpu_amx",
        True,
        "csrc/cpu/cpu_attn_amx.hpp::reshape_and_cache (K [BS/16, HS/2, 16, 2], V [HS/16, BS/2, 16, 2])",
    ),
)

CPU_RULES: tuple[Rule, ...] = (
    *(
        Rule(
            label=f"CPU 0.13 (2, NB, NH, BS, HS), {path}",
            eras=("0.13",),
            families=("CPU",),
            rank=5,
            logical=_o("TWO NB NH BS HS"),
            # beside Mamba layers: CPUModelRunner inherits GPUModelRunner._update_hybrid_attention_mamba_layout
            # (platforms/cpu.py support_hybrid_kv_cache() is True): strides (hidden, 2*hidden, BS*HS, HS, 1); the
            # kernel packs each (block, head) run of the K and V halves as below either way
            layouts={"HND": planes, "HND/mamba": planes},
            sources=(
                _src("0.13.0", _CPU + "::CPUAttentionBackend.get_kv_cache_shape (2, NB, NH, BS, HS); forward unbind(0)"),
                _src("0.13.0", _CPU + "::_get_attn_isa; " + kernel),
                _src("0.13.0", HYBRID_SOURCE + "; v1/worker/cpu_model_runner.py::CPUModelRunner(GPUModelRunner)"),
            ),
            gate="cpu",
            backends_label=("CPU_ATTN",),
            planes=builder,
            requires=(("cpu_amx", amx),),
        )
        for path, planes, builder, amx, kernel in _CPU_PATHS
    ),
    *(
        Rule(
            label=f"CPU 0.24+ [NB, NH, BS, 2*HS] (per block and head: K, then V), {path}",
            eras=("0.24", "0.26", LAYOUT_ERA),
            families=("CPU",),
            rank=4,
            logical=_o("NB NH TWO BS HS"),
            layouts={"HND": planes},
            sources=(
                _src(
                    "0.24.0",
                    _CPU + "::CPUAttentionBackend.get_kv_cache_shape (NB, NH, BS, 2*HS); forward view(NB, NH, 2*BS, -1).chunk(2, "
                    "dim=2) (the container the kernel packs into)",
                ),
                _src("0.32.0", _CPU + "::_get_attn_isa; " + kernel),
                _src("0.33.0", _CPU + "; supported_kv_cache_layouts() = (LBHNC,)"),
            ),
            transform="kv_rows",
            gate="cpu",
            backends_label=("CPU_ATTN",),
            planes=builder,
            requires=(("cpu_amx", amx),),
        )
        for path, planes, builder, amx, kernel in _CPU_PATHS
    ),
)


def _t_kv_rows(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.33 CPU: [B, H, N, C] viewed as [B, H, 2N, C/2] and chunk(2, dim=2) -> [B, H, 2, N, C/2]
    b, nh, n, c = t.shape
    if c % 2 or t.stride(3) != 1 or (n > 1 and t.stride(2) != c):
        return None
    d = c // 2
    return torch.as_strided(t, (b, nh, 2, n, d), (t.stride(0), t.stride(1), n * d, d, 1), t.storage_offset())


def _kv_regions(v: torch.Tensor, tokens: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The K and V regions of a CPU_ATTN view (``TWO`` among ``tokens``, the rest
    ``NB NH BS HS``): each ``[NB, NH, BS, HS]`` with one tight ``BS*HS`` run per (block, head),
    the container vLLM's CPU kernel packs into. None when a region is not tight."""
    two = list(tokens).index("TWO")
    k, val = v.select(two, 0), v.select(two, 1)
    for x in (k, val):
        _, _, bs, hs = x.shape
        if (hs > 1 and x.stride(3) != 1) or (bs > 1 and x.stride(2) != hs):
            return None
    return k, val


def _p_cpu_vec(v: torch.Tensor, tokens: Sequence[str], h: VllmHints) -> dict[str, torch.Tensor] | None:
    """vLLM CPU_ATTN's vec / vec16 / neon / vsx / vxe / rvv kernels (0.13-0.33,
    ``csrc/cpu/cpu_attn_vec.hpp`` ``AttentionImpl<ISA::VEC>::reshape_and_cache``: "reshape K
    as column-major and V as row-major"): per (block, head), K is ``[HS, BS]`` (a token's
    elements ``BS`` apart), V ``[BS, HS]``. Proven by vLLM's writer
    (``vllm._custom_ops.cpu_attn_reshape_and_cache``, ``tests/engine``)."""
    r = _kv_regions(v, tokens)
    if r is None:
        return None
    k, val = r
    if h.cpu_attn_isa == "neon" and (k.dtype == torch.bfloat16 or h.dtype == torch.bfloat16):
        raise DetectionError(
            "vLLM CPU_ATTN on Arm with a bfloat16 model runs the NEON BFMMLA kernel (csrc/cpu/cpu_attn_neon_bfmmla.hpp), "
            "which packs K and V in BFMMLA tiles kvcore-vllm does not read (not claimed); float16 and float32 caches on "
            "Arm (neon) are read"
        )
    nb, nh, bs, hs = k.shape
    key = torch.as_strided(k, (nb, nh, hs, bs), (k.stride(0), k.stride(1), bs, 1), k.storage_offset())
    return {"K": key, "V": val}


#: vLLM CPU AMX tiles (``csrc/cpu/cpu_attn_amx.hpp``): K in tiles of 16 tokens x 2 elements
#: (the VNNI pair), V in tiles of 2 tokens x 16 elements.
AMX_K_TOKENS, AMX_K_ELEMS = 16, 2
AMX_V_TOKENS, AMX_V_ELEMS = 2, 16
#: the block and head sizes vLLM's ``_get_attn_isa`` chooses AMX for (``block_size % 32``;
#: 0.26+ ``head_size % 32``: smaller multiples of 16 take ``vec16``)
AMX_MULTIPLE = 32


def _p_cpu_amx(v: torch.Tensor, tokens: Sequence[str], h: VllmHints) -> dict[str, torch.Tensor] | None:
    """vLLM CPU_ATTN's AMX kernel (``cpu_attn.py::_get_attn_isa`` returns ``amx`` for a
    bfloat16 model with ``block_size % 32 == 0`` on a CPU with AMX tiles;
    ``csrc/cpu/cpu_attn_amx.hpp`` ``reshape_and_cache``): per (block, head), K is
    ``[BS/16, HS/2, 16, 2]`` (VNNI pairs of elements, 16 tokens a tile), V
    ``[HS/16, BS/2, 16, 2]`` (pairs of tokens, 16 elements a tile); an fp8 cache keeps the same
    element order. Proven by vLLM's writer (``tests/engine``). None where vLLM would not
    choose AMX (not bfloat16, or a block or head size that is no multiple of 32)."""
    r = _kv_regions(v, tokens)
    if r is None:
        return None
    k, val = r
    nb, nh, bs, hs = k.shape
    if bs % AMX_MULTIPLE or hs % AMX_MULTIPLE:
        return None
    if k.dtype in _BYTE_DTYPES or is_fp8(k.dtype):
        model = h.dtype if h.dtype is not None and not is_fp8(h.dtype) else None
        if model is not None and model != torch.bfloat16:
            return None
    elif k.dtype != torch.bfloat16:
        return None
    sb, sh = k.stride(0), k.stride(1)
    key = torch.as_strided(
        k,
        (nb, nh, bs // AMX_K_TOKENS, hs // AMX_K_ELEMS, AMX_K_TOKENS, AMX_K_ELEMS),
        (sb, sh, AMX_K_TOKENS * hs, AMX_K_TOKENS * AMX_K_ELEMS, AMX_K_ELEMS, 1),
        k.storage_offset(),
    )
    value = torch.as_strided(
        val,
        (nb, nh, hs // AMX_V_ELEMS, bs // AMX_V_TOKENS, AMX_V_ELEMS, AMX_V_TOKENS),
        (sb, sh, AMX_V_ELEMS * bs, AMX_V_ELEMS * AMX_V_TOKENS, AMX_V_TOKENS, 1),
        val.storage_offset(),
    )
    return {"K": key, "V": value}


#: the layout a bfloat16 CPU_ATTN cache may be when its kernel path is not given
NEON_BF16 = (
    "vLLM CPU_ATTN's NEON BFMMLA tiles (an Arm host with a bfloat16 model: csrc/cpu/cpu_attn_neon_bfmmla.hpp; not claimed by kvcore)"
)


def _neon_bf16(rule: Rule, v: torch.Tensor, h: VllmHints) -> str | None:
    """A bfloat16 CPU_ATTN cache whose kernel path is not given may have been written on an Arm
    host by the NEON BFMMLA kernel (``cpu_attn.py::_get_attn_isa`` picks ``neon`` on Arm; its
    bfloat16 path packs tiles), which kvcore does not read: only ``cpu_attn_isa`` tells."""
    if rule.planes != "cpu_vec" or h.cpu_attn_isa is not None or v.dtype != torch.bfloat16:
        return None
    if v.shape[-2] % AMX_MULTIPLE and not _neon_any_block(h):
        return None  # up to 0.30 Arm takes neon only for blocks of multiples of 32 (else vec16, read here)
    return NEON_BF16


def _neon_any_block(h: VllmHints) -> bool:
    """vLLM 0.31+ ``_get_attn_isa`` sends Arm to ``neon`` whatever the block size (0.24-0.30:
    only ``block_size % 32 == 0``); True where the release may be 0.31 or later."""
    return h.vllm_version is None or version_tuple(h.vllm_version)[:2] >= (0, 31)
