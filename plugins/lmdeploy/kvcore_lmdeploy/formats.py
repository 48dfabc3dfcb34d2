"""The layouts of LMDeploy's PyTorch engine, as kvcore names (``SOURCES.md`` has the facts).

What a caller holds, per generation (``lmdeploy/pytorch/engine/cache_engine.py``):

* ``CacheEngine.gpu_cache`` (every version): a list over layers of tuples
  ``(k, v[, k_scales_zeros, v_scales_zeros])`` -- the tuple each attention layer receives.
  0.6.0-0.6.3 allocate separate per-layer tensors; 0.6.4-0.10.x take per-layer views of
  cross-layer tensors ``(NL, NB, *block_shape)``; 0.11+ views of one uint8 pool
  ``(NL, NB, bytes)`` cut into 256-byte-aligned slices. The same names describe all three:
  the per-layer bases come from the tensors.
* 0.6.4-0.10.x ``CacheEngine.full_gpu_cache``: the tuple of cross-layer tensors.
* 0.11+ ``CacheEngine.full_gpu_cache``: the uint8 pool itself (``[NL, NB, bytes]``),
  detected with hints (the bytes carry no geometry), cut into cross-layer planes.

Block shapes (``backends/*/op_backend.py::get_k_block_shape``): ``(BS, NH, HS)`` -- NHD --
on CUDA / default / Ascend / MACA (0.10+); ``(NH, BS, HS)`` -- HND -- on Cambricon
(``camb``, 0.9+). Quantised caches (``quant_policy`` 4 / 8, CUDA) store K/V as ``uint8``
(int4: two 4-bit codes per byte, ``HS/2`` bytes per head) with per-token-head
``(scale, zero)`` pairs in sibling tensors of the model dtype, shape ``block_shape[:-1] +
(2,)``; TurboQuant (0.14, ``quant_policy`` 42) stores K 4-bit (``HS/2`` bytes) with
``(mse_norm, qjl_norm)`` and V 2-bit (``HS/4`` bytes) with one norm. fp8 (0.14,
``quant_policy`` 16 / 17) is the unquantised layout with fp8 elements (its scales are
per-tensor attributes of the attention module, not cache memory). MLA models keep K of
``kv_lora_rank + qk_rope_head_dim`` with one head and a V of head size 0: the K latents are
the cache (``NL_X_NB_BS_ONE_HS``; cross-layer ``NL_NB_BS_ONE_HS``); quantised (int8 / int4),
the latent codes ``KV`` beside LMDeploy's ``k_scales_zeros`` (``KSZ``) and
``v_scales_zeros`` (``VSZ``) tensors (V is a view of the latent's first ``kv_lora_rank``
elements, ``models/deepseek_v2.py``; its scales are cache memory the attention kernels read).
Ascend 310P (0.8.0-0.11.0) keeps each block "NZ": ``((NH*HS+15)//16, BS, 16)``, a block's
``[BS, NH*HS]`` rows cut into 16-element column chunks, chunk-major -- for a head size that
is a multiple of 16, ``[NB, NH, HS/16, BS, 16]``: ``K=NL_X_NB_NH_HSC_BS_HSE+V=...``.
"""

from __future__ import annotations

from kvcore import KVFormat, Source

__all__ = [
    "NHD",
    "HND",
    "MLA",
    "QUANT",
    "TURBO",
    "X_NHD",
    "X_HND",
    "X_QUANT",
    "X_TURBO",
    "FORMATS",
    "SOURCES",
    "planes_name",
    "INT_ROLES",
    "TURBO_ROLES",
    "MLA_ROLES",
    "X_MLA",
    "MLA_QUANT",
    "X_MLA_QUANT",
    "NZ",
    "X_NZ",
]

#: side-plane roles: int4/int8 ``(scale, zero)`` pairs; TurboQuant norms (K: mse, qjl; V: one)
INT_ROLES = ("K", "V", "KSZ", "VSZ")
TURBO_ROLES = ("K", "V", "KN", "VN")
#: quantised MLA: the latent codes (``gpu_cache[l][0]``) and the two scale/zero tensors (entries 2, 3)
MLA_ROLES = ("KV", "KSZ", "VSZ")
_BLOCK = {"NHD": "NB_BS_NH_HS", "HND": "NB_NH_BS_HS", "NZ": "NB_NH_HSC_BS_HSE", "MLA": "NB_BS_ONE_HS"}


def planes_name(roles: tuple[str, ...], order: str = "NHD", cross_layer: bool = False) -> str:
    """The multi-plane name of planes ``roles`` (each ``[NB, *block_shape]`` per layer):
    ``K=NL_X_NB_BS_NH_HS+V=...`` (per-layer lists) or ``K=NL_NB_BS_NH_HS+...`` (cross-layer)."""
    prefix = "NL_" if cross_layer else "NL_X_"
    return "+".join(f"{r}={prefix}{_BLOCK[order]}" for r in roles)


NHD = "NL_X_TWO_X_NB_BS_NH_HS"
HND = "NL_X_TWO_X_NB_NH_BS_HS"
MLA = "NL_X_NB_BS_ONE_HS"
QUANT = planes_name(INT_ROLES)
TURBO = planes_name(TURBO_ROLES)
X_NHD = planes_name(("K", "V"), cross_layer=True)
X_HND = planes_name(("K", "V"), "HND", cross_layer=True)
X_QUANT = planes_name(INT_ROLES, cross_layer=True)
X_TURBO = planes_name(TURBO_ROLES, cross_layer=True)
X_MLA = "NL_NB_BS_ONE_HS"
MLA_QUANT = planes_name(MLA_ROLES, "MLA")
X_MLA_QUANT = planes_name(MLA_ROLES, "MLA", cross_layer=True)
NZ = planes_name(("K", "V"), "NZ")
X_NZ = planes_name(("K", "V"), "NZ", cross_layer=True)


def _src(version: str, file: str) -> Source:
    return Source(engine="lmdeploy", version=version, file=file)


_CE = "lmdeploy/pytorch/engine/cache_engine.py::CacheEngine"
SOURCES = {
    "0.6.0": _src("0.6.0", f"{_CE}.allocate_gpu_cache (per-layer torch.empty((num_gpu_blocks, *block_shape)))"),
    "0.6.2": _src("0.6.2", f"{_CE}.allocate_gpu_cache (per layer: key, value, key/value scales_zeros (*block_shape[:-1], 2))"),
    "0.9.2": _src("0.9.2", f"{_CE}._allocate_cache + allocate_gpu_cache (list(zip(*caches)) of (num_layers, num_blocks, *shape))"),
    "0.11.1": _src("0.11.1", f"{_CE}.allocate_caches (uint8 mem_pool (NL, NB, sum of 256-aligned CacheDesc sizes), sliced)"),
    "0.14.0": _src("0.14.0", f"{_CE}.allocate_caches / get_quant_cache_descs (QuantPolicy; kernel_block_size)"),
    "cuda": _src(
        "0.14.0", "lmdeploy/pytorch/backends/cuda/op_backend.py::CudaOpsBackend.get_k_block_shape ((block_size, num_heads, head_size))"
    ),
    "camb": _src(
        "0.12.3",
        "lmdeploy/pytorch/backends/dlinfer/camb/op_backend.py::CambOpsBackend.get_k_block_shape ((num_heads, block_size, head_size))",
    ),
    "fill": _src("0.14.0", "lmdeploy/pytorch/kernels/cuda/fill_kv_cache.py::_fill_page_quant_int8 / _fill_page_quant_int4 / _quant_int4"),
    "flatten": _src("0.14.0", "lmdeploy/pytorch/kernels/cuda/flatten_kv_cache.py::_flatten_kv_cache_quant / _dequant_int4"),
    "turbo": _src("0.14.0", "lmdeploy/pytorch/kernels/cuda/fill_kv_cache.py::_fill_page_quant_turbo_qjl4 / _fill_page_quant_turbo_int2"),
    "mla": _src(
        "0.9.2",
        "lmdeploy/pytorch/configurations/deepseek_v2.py::DeepseekV2ModelConfigBuilder.build (k_head_dim 576, v_head_dim 0, 1 KV head)",
    ),
    "mla_quant": _src(
        "0.9.2",
        "lmdeploy/pytorch/models/deepseek_v2.py::DeepseekV2Attention.forward (k_cache past_key_value[0], v_cache its [..., "
        ":kv_lora_rank], k_scales_zeros / v_scales_zeros past_key_value[2] / [3]); kernels/cuda/fill_kv_cache.py::fill_kv_cache "
        "(BLOCK_DV = 0 when V shares K's memory)",
    ),
    "nz": _src(
        "0.9.2",
        "lmdeploy/pytorch/backends/dlinfer/ascend/op_backend.py::AscendOpsBackend.get_k_block_shape (Ascend310P: "
        "((num_heads * head_size + 15) // 16, block_size, 16)); ascend/utils.py::nd_to_nz_spec (the NZ order)",
    ),
    "maca": _src(
        "0.6.2",
        "lmdeploy/pytorch/backends/dlinfer/maca/op_backend.py::MacaOpsBackend.get_k_block_shape ((num_heads, block_size, head_size))",
    ),
}

FORMATS = [
    KVFormat(
        name=NHD,
        engines=["lmdeploy"],
        attention_backends=["cuda", "default", "ascend", "maca"],
        description="LMDeploy CacheEngine.gpu_cache: per layer (k, v), each [NB, BS, NH, HS] (bf16/fp16/fp32; fp8 from 0.14, CUDA "
        "only); Ascend 910, MACA 0.10+",
        sources=[SOURCES["0.6.0"], SOURCES["0.9.2"], SOURCES["0.11.1"], SOURCES["cuda"]],
    ),
    KVFormat(
        name=HND,
        engines=["lmdeploy"],
        attention_backends=["camb", "maca"],
        description="LMDeploy CacheEngine.gpu_cache on Cambricon (0.7+) and MACA 0.6.2-0.6.3: per layer (k, v), each [NB, NH, BS, HS]",
        sources=[SOURCES["camb"], SOURCES["0.9.2"], SOURCES["maca"]],
    ),
    KVFormat(
        name=MLA,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy MLA (DeepSeek-V2/V3): per layer K [NB, BS, 1, kv_lora_rank+rope] (model dtype; fp8 with "
        "quant_policy 16/17, 0.14); V has head size 0 (not stored)",
        sources=[SOURCES["mla"], SOURCES["0.9.2"]],
    ),
    KVFormat(
        name=X_MLA,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy MLA cross-layer K latents [NL, NB, BS, 1, kv_lora_rank+rope]: 0.6.4-0.11.0 full_gpu_cache[0], "
        "0.11.1+ cut from the uint8 pool (V has head size 0)",
        sources=[SOURCES["mla"], SOURCES["0.9.2"], SOURCES["0.11.1"]],
    ),
    KVFormat(
        name=MLA_QUANT,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy MLA int8/int4 (quant_policy 8/4): per layer uint8 latent codes KV [NB, BS, 1, D or D/2] and "
        "k/v (scale, zero) pairs KSZ, VSZ [NB, BS, 1, 2] in the model dtype (V reads the latent codes with VSZ)",
        sources=[SOURCES["mla"], SOURCES["mla_quant"], SOURCES["0.6.2"], SOURCES["fill"]],
    ),
    KVFormat(
        name=X_MLA_QUANT,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy MLA int8/int4 cross-layer latent codes KV and KSZ, VSZ [NL, NB, BS, 1, *] "
        "(0.6.4-0.11.0 full_gpu_cache, 0.11.1+ the uint8 pool)",
        sources=[SOURCES["mla_quant"], SOURCES["0.9.2"], SOURCES["0.14.0"]],
    ),
    KVFormat(
        name=NZ,
        engines=["lmdeploy"],
        attention_backends=["ascend"],
        description="LMDeploy on Ascend 310P (0.8.0-0.11.0): per layer (k, v), each [NB, (NH*HS+15)//16, BS, 16] NZ blocks, "
        "read per head as [NB, NH, HS/16, BS, 16] (head size a multiple of 16)",
        sources=[SOURCES["nz"], SOURCES["0.9.2"]],
    ),
    KVFormat(
        name=X_NZ,
        engines=["lmdeploy"],
        attention_backends=["ascend"],
        description="LMDeploy on Ascend 310P (0.8.0-0.11.0) cross-layer full_gpu_cache K, V [NL, NB, NH, HS/16, BS, 16]",
        sources=[SOURCES["nz"], SOURCES["0.9.2"]],
    ),
    KVFormat(
        name=QUANT,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy int8/int4 KV (quant_policy 8/4): per layer uint8 K, V [NB, BS, NH, HS or HS/2] and "
        "(scale, zero) pairs KSZ, VSZ [NB, BS, NH, 2] in the model dtype",
        sources=[SOURCES["0.6.2"], SOURCES["0.9.2"], SOURCES["0.14.0"], SOURCES["fill"], SOURCES["flatten"]],
    ),
    KVFormat(
        name=TURBO,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy TurboQuant KV (quant_policy 42): per layer uint8 K [NB, BS, NH, HS/2] (4-bit), V [.., HS/4] "
        "(2-bit), K norms KN [.., 2] (mse, qjl), V norm VN [.., 1] in the model dtype",
        sources=[SOURCES["0.14.0"], SOURCES["turbo"]],
    ),
    KVFormat(
        name=X_NHD,
        engines=["lmdeploy"],
        attention_backends=["cuda", "default", "ascend", "maca"],
        description="LMDeploy cross-layer K, V [NL, NB, BS, NH, HS]: 0.6.4-0.10 full_gpu_cache, 0.11+ cut from the uint8 pool",
        sources=[SOURCES["0.9.2"], SOURCES["0.11.1"], SOURCES["cuda"]],
    ),
    KVFormat(
        name=X_HND,
        engines=["lmdeploy"],
        attention_backends=["camb"],
        description="LMDeploy cross-layer K, V [NL, NB, NH, BS, HS] on Cambricon (full_gpu_cache / the 0.11+ pool)",
        sources=[SOURCES["camb"], SOURCES["0.9.2"], SOURCES["0.11.1"]],
    ),
    KVFormat(
        name=X_QUANT,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy int8/int4 cross-layer uint8 K, V and (scale, zero) KSZ, VSZ [NL, NB, BS, NH, *]",
        sources=[SOURCES["0.9.2"], SOURCES["0.14.0"], SOURCES["fill"]],
    ),
    KVFormat(
        name=X_TURBO,
        engines=["lmdeploy"],
        attention_backends=["cuda"],
        description="LMDeploy TurboQuant cross-layer K, V, KN, VN cut from the 0.14 uint8 pool",
        sources=[SOURCES["0.14.0"], SOURCES["turbo"]],
    ),
]
