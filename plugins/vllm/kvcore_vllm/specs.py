"""Engine facts of vLLM's byte-record caches: which record each uint8 width is, and how
vLLM's kernels lay its parts out.

Every vLLM layout is served by kvcore's generic spec (the grammar says it, the tensors'
strides supply the rest); this module only states what the names need from vLLM: the
scale width of the blocked-scale records (``NL_X_NB_BSV_BSS``, passed as
``params={"scale_bytes": S}``) and, per uint8 record width, whether vLLM writes it per
token or per block and where ROCm writes it differently.

A uint8 MLA-style cache ``[NB, BS, W]`` (0.33: ``[NB, 1, BS, W]``) is identified by its
width: vLLM's own writers pick the record from ``k_cache.shape[-1]`` ("the width the
KV-cache spec publishes identifies the record", vLLM 0.33
``vllm/models/deepseek_v41/common/ops/cache_utils.py`` header, and
``vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py::rope_quant_insert``,
which dispatches its kernels on that width). Read from the vLLM 0.33.0 wheel (0.24.0 and
0.26.0 for the eras of each fact):

==== ========= ==================================================================================
W    layout    vLLM writer (0.33 unless said) and where the scales live
==== ========= ==================================================================================
656  per token DeepSeek-V3.2 ``fp8_ds_mla``: 512 fp8 NoPE, 4 fp32 scales, 64 bf16 RoPE per token
               (``v1/attention/backends/mla/flashmla_sparse.py`` module docstring; 0.11+)
584  blocked   DeepSeek-V4 ``fp8_ds_mla`` (and V4.1 off SM100): per block all tokens' 576 B
               (448 fp8 NoPE + 64 bf16 RoPE), then all tokens' 8 B (7 UE8M0 scales + a pad
               byte); the page is rounded up to 576 B (``models/deepseek_v41/common/ops/
               fused_compress_quant_cache.py::_rope_quant_insert_kernel``: values at
               ``page + t*576``, scales at ``page + BS*576 + t*8``; 0.24/0.26
               ``models/deepseek_v4/common/ops/cache_utils.py::quantize_and_insert_k_kernel``)
528  per token DeepSeek-V4.1 ``fp8_ds_mla`` on SM100 (MXFP8): 512 fp8 then 16 UE8M0 scales, each
               token's scales right after its own values (``::_rope_quant_insert_mxfp8_kernel``:
               ``values = page + t*528``, ``scales = values + 512``; 0.33 only)
352  per token DeepSeek-V3.2 ``nvfp4_ds_mla``: 256 B e2m1 NoPE, 64 B fp8 RoPE, 32 B scales
               (``models/deepseek_v32/common/kernels.py``, ``flashmla_sparse.py`` docstring)
288  per token DeepSeek-V4.1 ``nvfp4_ds_mla`` compressed cache: 256 B e2m1, then 32 e4m3 scales
               (``::_rope_quant_insert_nvfp4_kernel``: ``values = page + t*288``)
132  blocked   the DSA lightning indexer's fp8 keys (DeepSeek-V3.2, GLM-5.2, V4, V4.1): per block
               all tokens' 128 B, then all tokens' 4 B scale (``deepseek_v2.py::
               DeepseekV32IndexerCache``, ``models/deepseek_v41/common/ops/indexer_k_store.py``).
               **ROCm, block_size > 1 (0.24+)**: the value region is 16-token x 16-byte tiles
               ``[BS/16, 128/16, 16, 16]`` (``v1/attention/ops/rocm_aiter_mla_sparse.py::
               _indexer_k_quant_and_cache_kernel`` ``LAYOUT == "SHUFFLE"``, chosen by
               ``block_size == 1`` or not; ``DeepseekV32ROCmIndexerCache.uses_shuffled_layout``)
68   blocked   the MXFP4 indexer keys (V4 / V4.1, CUDA Blackwell): 64 B packed e2m1, then 4 UE8M0
               scales per token, per block (``indexer_k_store.py``, ``deepseek_v4/common/ops/
               fused_compress_quant_cache.py``). **ROCm gfx950 (0.33)**: aiter's preshuffled
               MXFP4 pages, whose tile sizes aiter's ``cache_format()`` reports at run time
               (``v1/attention/ops/rocm_paged_mxfp4_indexer.py::RocmPagedMxfp4CacheLayout``):
               not claimed.
==== ========= ==================================================================================

LMCache's table (``specs/nl_x_nb_bsv_bss.py::BLOCKED_SCALE_RECORDS``, lmcache_kv_format.md
§6.4) also lists 528 and 352 as blocked-scale pages (scale 16 and 32): vLLM writes both per
token, so kvcore-vllm does not follow it there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Record", "RECORDS", "BLOCKED_SCALE_RECORDS", "ROCM_TILE_TOKENS", "ROCM_TILE_BYTES"]


@dataclass(frozen=True)
class Record:
    """One uint8 record width vLLM writes (see the module table).

    Attributes:
        width: bytes per stored state (the tensor's last axis).
        layout: ``"token"`` (each token's record is contiguous, scales inside it) or
            ``"blocked"`` (a block's values, then its scales).
        scale_bytes: blocked: each token's scale bytes after the block's values.
        cache_dtypes: the ``cache_dtype`` values under which vLLM writes it (empty: any,
            e.g. the indexer, whose record does not follow the MLA cache dtype).
        head_size: ``model_config.get_head_size()`` of the models that write it (the
            engine's own head size hint; the record width is bytes, not that).
        rocm: ``"tiles"`` (ROCm, block_size > 1, vLLM 0.24+: 16x16-byte value tiles),
            ``"aiter"`` (ROCm gfx950, vLLM 0.33: aiter's run-time layout, not claimed), or "".
        writer: what writes it.
    """

    width: int
    layout: str
    scale_bytes: int = 0
    cache_dtypes: tuple[str, ...] = ()
    head_size: int | None = None
    rocm: str = ""
    writer: str = ""


RECORDS: dict[int, Record] = {
    r.width: r
    for r in (
        Record(656, "token", cache_dtypes=("fp8_ds_mla",), head_size=576, writer="DeepSeek-V3.2 fp8_ds_mla (flashmla_sparse.py)"),
        Record(
            584,
            "blocked",
            8,
            cache_dtypes=("fp8_ds_mla",),
            head_size=512,
            writer="DeepSeek-V4 fp8_ds_mla (fused_compress_quant_cache.py::_rope_quant_insert_kernel)",
        ),
        Record(
            528,
            "token",
            cache_dtypes=("fp8_ds_mla", "nvfp4_ds_mla"),
            head_size=512,
            writer="DeepSeek-V4.1 fp8_ds_mla MXFP8 (fused_compress_quant_cache.py::_rope_quant_insert_mxfp8_kernel)",
        ),
        Record(352, "token", cache_dtypes=("nvfp4_ds_mla",), head_size=576, writer="DeepSeek-V3.2 nvfp4_ds_mla (deepseek_v32 kernels.py)"),
        Record(
            288,
            "token",
            cache_dtypes=("nvfp4_ds_mla",),
            head_size=512,
            writer="DeepSeek-V4.1 nvfp4_ds_mla compressed cache (::_rope_quant_insert_nvfp4_kernel)",
        ),
        Record(132, "blocked", 4, rocm="tiles", writer="DSA indexer fp8 keys (DeepseekV32IndexerCache, indexer_k_store.py)"),
        Record(68, "blocked", 4, rocm="aiter", writer="DSA indexer MXFP4 keys (indexer_k_store.py; ROCm: aiter k_norm_rope_mxfp4_cache)"),
    )
}

#: record bytes per token -> scale bytes per token, for the records vLLM writes blocked.
BLOCKED_SCALE_RECORDS: dict[int, int] = {w: r.scale_bytes for w, r in RECORDS.items() if r.layout == "blocked"}

#: ROCm's tiled indexer value region: tiles of 16 tokens x 16 bytes (vLLM 0.33
#: ``models/deepseek_v32/common/kernels.py`` ``_INDEXER_CACHE_BLOCK_TILE`` /
#: ``_INDEXER_CACHE_HEAD_TILE_BYTES``; ``rocm_aiter_mla_sparse.py::indexer_k_quant_and_cache_triton``
#: ``block_tile_size=16, head_tile_size=16``).
ROCM_TILE_TOKENS = 16
ROCM_TILE_BYTES = 16
