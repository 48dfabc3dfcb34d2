"""vLLM's MLA latents and byte records: the latent ``(NB, BS, W)`` (576 for DeepSeek), the 0.29+
squeezed views, the blocked-scale pages (DSA indexer keys, DeepSeek-V4 records) and ROCm's
tiled indexer page; aiter's MXFP4 pages are named, not read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore_vllm.hints import KV_CACHE_LAYOUTS, VllmHints
from kvcore_vllm.releases import ERAS, KV_CACHE_LAYOUT_ORDERS, LAYOUT_ERA
from kvcore_vllm.rules.rule import Rule, _o, _src, member_layouts
from kvcore_vllm.rules.sources import _IDX, _MLA, _RIDX, _V4, _V33, _XL
from kvcore_vllm.rules.views import _BYTE_DTYPES
from kvcore_vllm.specs import BLOCKED_SCALE_RECORDS, RECORDS, ROCM_TILE_BYTES, ROCM_TILE_TOKENS

#: MLA latent widths vLLM's MLA backends accept: ``get_supported_head_sizes() == [576]``
#: (0.11 ``mla/common.py``). A rank-3 ``[NB, BS, W]`` cache of any other width is a latent
#: too (``NL_X_NB_BS_HS``, kv_size 1): MiniMax-M3 on 0.26 keeps rank-3 indexer key caches
#: ``(NB, 128, 128)`` bf16 beside its packed GQA caches. A uint8 width that is one of vLLM's
#: byte records (:data:`kvcore_vllm.specs.RECORDS`) is read as vLLM writes that record: per
#: token (656, 528, 352, 288) or as a blocked-scale page (584, 132, 68).
MLA_WIDTHS = (576,)

#: ROCm's DSA indexer page (vLLM 0.24+, block_size > 1): the block's fp8 keys in tiles of 16
#: tokens x 16 bytes (``K``), then each token's 4-byte scale (``KS``).
ROCM_INDEXER = "K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS"
ROCM_INDEXER_CROSS = "K=NB_NL_BSC_HSC_BSE_HSE+KS=NB_NL_BS_HS"

#: what the rules of each kind share: the MLA latent (vLLM's MLA backends), the blocked-scale
#: records (the sparse MLA backend and the DSA indexer) and ROCm's tiled indexer page.
_LATENT: dict[str, Any] = dict(
    families=("MLA",),
    logical=_o("NB BS HS"),
    gate="",
    mla=True,
    backends_label=("FLASHMLA", "FLASHMLA_SPARSE", "TRITON_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA"),
)
_BLOCKED: dict[str, Any] = dict(
    families=("MLA",), logical=_o("NB BS HS"), gate="", mla=True, blocked=True, backends_label=("FLASHMLA_SPARSE", "indexer")
)
_ROCM_TILED: dict[str, Any] = dict(
    families=("MLA",),
    logical=_o("NB BS HS"),
    gate="rocm?",
    mla=True,
    blocked=True,
    backends_label=("ROCM_AITER_MLA_SPARSE", "indexer"),
    planes="rocm_tiles",
)
#: the 0.29+ views: ``[NB, 1, BS, W]`` squeezed to the latent (``bind_kv_cache``'s ``squeeze(1)``), and
#: the bound view ``(NB, BS, W)`` a layer holds (a whole cross-layer buffer under a block-outermost member).
_SQUEEZED_VIEW: dict[str, Any] = dict(eras=(LAYOUT_ERA,), rank=4, transform="squeeze_head")
_BOUND_VIEW: dict[str, Any] = dict(eras=(LAYOUT_ERA,), rank=3)

MLA_RULES: tuple[Rule, ...] = (
    Rule(
        label="MLA latent (NB, BS, W): 576 for DeepSeek, any width",
        eras=ERAS,
        rank=3,
        layouts={"*": _o("NL NB BS HS"), "*/cross": _o("NB NL BS HS")},
        sources=(
            _src("0.11.0", _MLA + " (l.284)"),
            _src("0.13.0", _XL + "; MLA stride order (1,0,2,3) over (L, NB, BS, 576) (0.13-0.26)"),
            _src("0.11.0", "vllm/v1/attention/backends/mla/flashmla_sparse.py::get_kv_cache_shape (l.74) fp8_ds_mla (NB, BS, 656) uint8"),
            _src("0.33.0", "vllm/model_executor/layers/attention/mla_attention.py::MLAAttention.bind_kv_cache (l.748) squeeze(1)"),
            _src("0.33.0", "mla_attention.py l.1371: state_content_bytes 656 (fp8_ds_mla), 352 (nvfp4_ds_mla) per stored state"),
            _src("0.33.0", _V4 + "::_rope_quant_insert_mxfp8_kernel (528 B) / _rope_quant_insert_nvfp4_kernel (288 B): per-token records"),
        ),
        **_LATENT,
    ),
    Rule(
        label="0.29+ MLA view [NB, 1, BS, C]",
        **_SQUEEZED_VIEW,
        # MLA's one head is squeezed (MLAAttention.bind_kv_cache): each member's order without H
        layouts=member_layouts(KV_CACHE_LAYOUTS, ("NL", "NB", "", "BS", "HS")),
        sources=(
            _src(
                "0.29.0", "vllm/model_executor/layers/attention/mla_attention.py::MLAAttention.bind_kv_cache squeeze(1) (0.29.0 - 0.33.0)"
            ),
            _src("0.33.0", _V33 + "; MLAAttentionSpec.head_size_v = 0 (C = 576 * dtype_size)"),
        ),
        **_LATENT,
    ),
    Rule(
        label="blocked-scale pages (NB, BS, W) uint8 (DSA indexer keys 132 / MXFP4 68; DeepSeek-V4 fp8_ds_mla 584)",
        eras=ERAS,
        rank=3,
        layouts={"*": _o("NL NB BSV BSS")},
        sources=(
            _src("0.11.0", _IDX + " (l.36); head_size 128 + 4 = 132, uint8"),
            _src(
                "0.24.0",
                "vllm/models/deepseek_v4/common/ops/cache_utils.py::quantize_and_insert_k_kernel (584 B: 576 B rows, then 8 B scales)",
            ),
            _src("0.33.0", _V4 + "::_rope_quant_insert_kernel (584); vllm/models/deepseek_v41/common/ops/indexer_k_store.py (132, 68)"),
        ),
        **_BLOCKED,
    ),
    Rule(
        label="0.29+ blocked-scale view [NB, 1, BS, W]",
        **_SQUEEZED_VIEW,
        layouts=member_layouts(KV_CACHE_LAYOUTS, ("NL", "NB", "", "BSV", "BSS")),
        sources=(_src("0.33.0", _V33 + "; MLAAttentionSpec state_content_bytes (mla_attention.py l.1371)"),),
        **_BLOCKED,
    ),
    Rule(
        label="0.29+ blocked-scale bound view (NB, BS, W) of a block-outermost layout",
        **_BOUND_VIEW,
        # the 4-D [NB, 1, BS, W] view squeezed by the layer's bind_kv_cache (what attn.kv_cache holds): under
        # BLHNC / BLNHC / BHLNC the layers' pages interleave per block, one cross-layer buffer
        layouts={"*/cross": _o("NB NL BSV BSS")},
        sources=(
            _src(
                "0.33.0",
                "vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache.bind_kv_cache (kv_cache.squeeze(1)); " + _V33,
            ),
        ),
        **_BLOCKED,
    ),
    Rule(
        label="ROCm DSA indexer page (NB, BS, 132) uint8: 16x16-byte key tiles, then the scales",
        eras=("0.24", "0.26", LAYOUT_ERA),
        rank=3,
        layouts={"*": ROCM_INDEXER},
        sources=(
            _src("0.24.0", _RIDX),
            _src("0.33.0", _RIDX + "; vllm/models/deepseek_v32/amd/rocm.py::DeepseekV32ROCmIndexerCache.uses_shuffled_layout"),
        ),
        **_ROCM_TILED,
    ),
    Rule(
        label="ROCm 0.29+ DSA indexer view [NB, 1, BS, 132]: 16x16-byte key tiles, then the scales",
        **_SQUEEZED_VIEW,
        # block-outermost members (B first) interleave the layers' pages per block: one cross-layer buffer
        layouts={m: ROCM_INDEXER_CROSS if KV_CACHE_LAYOUT_ORDERS[m][0] == 1 else ROCM_INDEXER for m in KV_CACHE_LAYOUTS},
        sources=(_src("0.33.0", _V33 + "; " + _RIDX),),
        **_ROCM_TILED,
    ),
    Rule(
        label="ROCm 0.29+ DSA indexer bound view (NB, BS, 132) of a block-outermost layout: key tiles, then the scales",
        **_BOUND_VIEW,
        layouts={"*/cross": ROCM_INDEXER_CROSS},
        sources=(
            _src(
                "0.33.0",
                "vllm/models/deepseek_v32/amd/rocm.py::DeepseekV32ROCmIndexerCache (bind_kv_cache inherited from "
                "deepseek_v2.py::DeepseekV32IndexerCache: squeeze(1)); " + _V33 + "; " + _RIDX,
            ),
        ),
        **_ROCM_TILED,
    ),
)


def _t_squeeze_head(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.29+ MLA: [B, 1, N, C] -> [B, N, C] (MLAAttention.bind_kv_cache squeezes dim 1)
    return t.squeeze(1) if t.shape[1] == 1 else None


def _p_rocm_tiles(v: torch.Tensor, tokens: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """ROCm's DSA indexer page (vLLM 0.24+ ``rocm_aiter_mla_sparse.py::
    indexer_k_quant_and_cache_triton``, ``LAYOUT == "SHUFFLE"``): one block's ``BS*W`` bytes
    are the values ``[BS/16, HV/16, 16 tokens, 16 bytes]`` (HV = W - scale bytes), then each
    token's scale bytes. ``v`` is one layer's ``[NB, BS, W]`` uint8."""
    nb, bs, w = v.shape
    s = BLOCKED_SCALE_RECORDS.get(w)
    if s is None:
        return None
    hv = w - s
    bt, ht = ROCM_TILE_TOKENS, ROCM_TILE_BYTES
    if bs <= 1 or bs % bt or hv % ht or v.stride(2) != 1 or v.stride(1) != w:
        return None  # kv_cache.view(num_blocks, -1): each block one contiguous BS*W run
    sb, off = v.stride(0), v.storage_offset()
    key = torch.as_strided(v, (nb, bs // bt, hv // ht, bt, ht), (sb, bt * hv, bt * ht, ht, 1), off)
    scale = torch.as_strided(v, (nb, bs, s), (sb, s, 1), off + bs * hv)
    return {"K": key, "KS": scale}


def _aiter_pages(rule: Rule, v: torch.Tensor, h: VllmHints, rocm: bool | None) -> str | None:
    """A description of the layout this tensor may be and kvcore does not read: vLLM 0.33 on
    ROCm gfx950 stores the DSA indexer's MXFP4 keys (68 B records) in aiter's preshuffled
    pages, whose tile sizes aiter's ``cache_format()`` reports at run time
    (``v1/attention/ops/rocm_paged_mxfp4_indexer.py::rocm_paged_mxfp4_cache_layout``)."""
    if not rule.blocked or rule.planes or rocm is False or h.era not in (None, LAYOUT_ERA):
        return None
    if v.dtype not in _BYTE_DTYPES or v.shape[-1] not in RECORDS or RECORDS[v.shape[-1]].rocm != "aiter":
        return None
    return (
        f"vLLM 0.33 ROCm (gfx950) MXFP4 indexer pages [NB, BS, {v.shape[-1]}] in aiter's preshuffled order "
        "(rocm_paged_mxfp4_indexer.py: tile sizes from aiter's cache_format() at run time; not claimed by kvcore)"
    )
