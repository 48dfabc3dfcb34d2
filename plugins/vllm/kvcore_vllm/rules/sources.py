"""Where the vLLM rules' facts come from: the vLLM source paths the rule families cite."""

from __future__ import annotations

_FA = "vllm/v1/attention/backends/flash_attn.py::FlashAttentionBackend.get_kv_cache_shape"
_FI = "vllm/v1/attention/backends/flashinfer.py::FlashInferBackend.get_kv_cache_shape"
_TR = "vllm/v1/attention/backends/triton_attn.py::TritonAttentionBackend.get_kv_cache_shape"
_FLEX = "vllm/v1/attention/backends/flex_attention.py::FlexAttentionBackend.get_kv_cache_shape"
_MLA = "vllm/v1/attention/backends/mla/common.py::MLACommonBackend.get_kv_cache_shape"
_XL = "vllm/v1/worker/kv_connector_model_runner_mixin.py::allocate_uniform_kv_caches"
_V33 = "vllm/v1/kv_cache_interface.py::create_kv_cache_views; vllm/v1/kv_cache_layout.py::KVCacheLayout"
_CPU = "vllm/v1/attention/backends/cpu_attn.py"
_PALLAS = "vllm/v1/attention/backends/pallas.py::PallasAttentionBackend.get_kv_cache_shape"
_ROCM = "vllm/v1/attention/backends/rocm_attn.py"
_SPLIT = "PagedAttention.split_kv_cache (K (NB, NH, HS/x, BS, x), x = 16 // element_size; V (NB, NH, HS, BS))"
_IDX = "vllm/v1/attention/backends/mla/indexer.py; vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache"
_RIDX = (
    "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py::indexer_k_quant_and_cache_triton / _indexer_k_quant_and_cache_kernel "
    "(LAYOUT SHUFFLE when block_size > 1: [BS/16, 128/16, 16, 16] value tiles, then [BS] fp32 scales)"
)
_V4 = "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py"
_B12X = "vllm/v1/attention/backends/b12x.py"
_RSEG = "vllm/v1/attention/backends/rocm_segmented_attn.py"
#: vLLM 0.11 / 0.13 ``v1/worker/gpu_model_runner.py::_update_hybrid_attention_mamba_layout``, called from
#: ``_reshape_kv_cache_tensors`` when a model has attention and Mamba layers: every attention tensor whose
#: ``shape[0] == 2`` is restrided in place to strides ``(hidden, 2*hidden, *strides[2:])`` (hidden =
#: ``shape[2:].numel()``), so a block's K and V sides are adjacent. vLLM's CPU, ROCm and XPU runners
#: inherit it (each platform's ``support_hybrid_kv_cache()`` is True). 0.24 / 0.26 restride only backends
#: whose ``get_kv_cache_block_dim`` is 1 (``ROCM_ATTN``'s ``(2, NB, ...)``, read by split_kv_cache from the
#: planes' strides); 0.27 / 0.28 likewise; 0.29+ has no restride (``create_kv_cache_views``).
HYBRID_SOURCE = "vllm/v1/worker/gpu_model_runner.py::_update_hybrid_attention_mamba_layout (attention beside Mamba layers)"
