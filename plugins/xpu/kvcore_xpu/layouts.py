"""What vLLM and SGLang allocate on Intel GPUs, per version, with sources: the same
layouts the vLLM and SGLang plugins register, at XPU geometries and dtypes.

This plugin therefore registers **no format**. It registers fixtures (allocations as the
engines make them on XPU) so that detection and every kernel are proven on the block
sizes, page sizes and dtypes the XPU paths use. Each fixture reuses the engine plugin's
own allocation code and oracle view (``kvcore_vllm.fixtures`` / ``kvcore_sglang.fixtures``)
and changes only what the XPU path changes.

vLLM (read from the released wheels' ``.py`` files):

* **0.11.0** ``vllm/platforms/xpu.py::XPUPlatform``: ``get_attn_backend_cls`` returns
  ``FlashAttentionBackend`` (default) or ``TritonAttentionBackend``; ``check_and_update_config``
  sets ``block_size = 64`` when unset and calls ``set_kv_cache_layout("NHD")`` ("only NHD
  layout is supported by XPU attention kernels"); ``is_kv_cache_dtype_supported``: fp8 KV
  only with ``TRITON_ATTN``; ``fp8_dtype()`` is ``float8_e5m2``. The runner is
  ``vllm/v1/worker/xpu_model_runner.py::XPUModelRunner(GPUModelRunner)``: the GPU runner's
  allocation (one int8 buffer per layer, viewed as the dtype, shaped by the backend), so
  the layouts are FlashAttention's ``(2, NB, BS, NH, HS)`` (``NL_X_TWO_NB_BS_NH_HS``) and
  Triton's ``(NB, 2, BS, NH, HS)`` (``NL_X_NB_TWO_BS_NH_HS``). The kernels come from IPEX
  (``vllm/_ipex_ops.py::ipex_ops.reshape_and_cache_flash`` / ``flash_attn_varlen_func``)
  and read those same tensors.
* **0.24.0** ``platforms/xpu.py``: NHD still forced (in ``get_attn_backend_cls``); MLA
  models get ``TRITON_MLA`` (``(NB, BS, 576)``, ``NL_X_NB_BS_HS``), sparse MLA
  ``XPU_MLA_SPARSE`` (``mla/xpu_mla_sparse.py::get_kv_cache_shape`` ``(NB, BS, 576)``).
* **0.26.0 - 0.33.0** ``platforms/xpu.py`` (read in 0.26.0, 0.29.0, 0.31.0, 0.33.0): NHD is
  no longer forced; 0.33's layout comes from vLLM's generic ``KVCacheLayout`` resolution
  (``v1/attention/backends/utils.py::resolve_kv_cache_layout``, default ``LBNHC``).
* **0.33.0**: ``flash_attn.py::FlashAttentionBackend.get_supported_kernel_block_sizes``
  is ``MultipleOf(64)`` on XPU and ``get_preferred_block_size`` at least 64;
  ``mla/flashattn_mla.py::XPUFlashAttnMLABackend`` (head size 576, ``MultipleOf(64)``);
  ``mla/xpu_mla_sparse.py::XPUMLASparseBackend`` (576, bf16/fp16 only, blocks aligned to
  rows); ``fp8_dtype()`` is ``float8_e4m3fn``. Kernels from ``vllm._xpu_ops``
  (vllm-xpu-kernels), whose caches are ``[num_block, block_size, heads, head_size]``.

SGLang:

* **0.5.3**: no XPU-specific pool; ``MHATokenToKVPool`` / ``MLATokenToKVPool`` as on CUDA.
* **0.5.23** ``srt/arg_groups/overrides.py::_intel_xpu_page_constraint``: the
  ``intel_xpu`` attention backend takes page sizes 64 or 128 (MLA also 16, 32), else 128;
  ``srt/layers/attention/xpu_backend.py`` views the token pools as
  ``[-1, page_size, H, D]``; ``srt/mem_cache/memory_pool.py`` writes them with
  ``sgl_kernel.store_cache_xpu`` (same rows) and lets the DSA indexer pool use pages of 64
  or 128 tokens on XPU (64 elsewhere).

Not covered: vLLM before 0.11 (the V0 ``IPEX`` backend's legacy paged-attention cache
``(2, NB, BS*NH*HS)`` with K ``(NB, NH, HS/x, BS, x)`` and V ``(NB, NH, HS, BS)`` -- the
physical layout of vLLM 0.11's CPU ``TORCH_SDPA`` cache without IPEX, ``K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS`` in the
vLLM plugin), and an IPEX-LLM downstream ``ipex_attn.py`` that no vLLM release contains.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvcore.testing import FixtureCase

__all__ = ["xpu_fixture_cases"]

# (base fixture of the engine plugin, XPU name, sizes, dtypes, size constraints, source)
_VLLM = (
    (
        "vllm-0.11-FLASH_ATTN-NHD",
        "xpu-vllm-0.11-FLASH_ATTN",
        {"block_size": 64, "num_blocks": 3},
        (torch.bfloat16, torch.float16),
        {"block_size_choices": (64, 128)},
        "vllm 0.11.0 vllm/platforms/xpu.py::XPUPlatform (FLASH_ATTN, NHD forced, block_size 64)",
    ),
    (
        "vllm-0.11-TRITON_ATTN-NHD",
        "xpu-vllm-0.11-TRITON_ATTN-fp8",
        {"block_size": 64, "num_blocks": 3},
        (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn),
        {"block_size_choices": (64, 128)},
        "vllm 0.11.0 vllm/platforms/xpu.py::XPUPlatform.is_kv_cache_dtype_supported (fp8 KV only with TRITON_ATTN; fp8_dtype e5m2)",
    ),
    (
        "vllm-0.29-FLASH_ATTN-LBNHC",  # the vLLM plugin names cases by era (0.29: 0.29 - 0.33)
        "xpu-vllm-0.33-FLASH_ATTN-LBNHC",
        {"block_size": 64, "num_blocks": 3},
        (torch.bfloat16, torch.float16, torch.float8_e4m3fn),
        {"block_size_multiple": 64, "block_size_choices": (64, 128)},
        "vllm 0.33.0 vllm/v1/attention/backends/flash_attn.py::get_supported_kernel_block_sizes (XPU: MultipleOf(64))",
    ),
)

_SGLANG = (
    (
        "sglang-0.5.23-mha-nhd-fused-paged",
        "xpu-sglang-0.5.23-intel_xpu-mha-page128",
        {"block_size": 128, "num_blocks": 3},
        {"block_size_choices": (64, 128)},
        "sglang 0.5.23 srt/arg_groups/overrides.py::_intel_xpu_page_constraint (page 64/128)",
    ),
    (
        "sglang-mla-paged",
        "xpu-sglang-0.5.23-intel_xpu-mla-page32",
        {"block_size": 32, "num_blocks": 3},
        {"block_size_choices": (16, 32, 64, 128)},
        "sglang 0.5.23 srt/arg_groups/overrides.py::_intel_xpu_page_constraint (MLA: page 16/32/64/128)",
    ),
    (
        "sglang-0.5.3-dsa-indexer",
        "xpu-sglang-0.5.23-dsa-indexer-page128",
        {"block_size": 128, "num_blocks": 3},
        {"fixed": ("num_heads", "head_size"), "block_size_choices": (64, 128)},
        "sglang 0.5.23 srt/mem_cache/memory_pool.py::DSATokenToKVPool (XPU DSA pages of 64 or 128 tokens)",
    ),
)


def _on_xpu(make, forced_nhd: bool):
    """The engine plugin's allocation, with the hints vLLM's XPU platform implies: the
    device type, and -- where the platform forces NHD (before 0.33) -- no layout hint."""

    def make_xpu(sizes: dict, dtype: torch.dtype, device: Any):
        kv, hints = make(sizes, dtype, device)
        hints = dict(hints)
        if forced_nhd:
            hints.pop("kv_cache_layout", None)
        hints["device_type"] = "xpu"
        return kv, hints

    return make_xpu


def xpu_fixture_cases() -> list[FixtureCase]:
    """The XPU allocation fixtures whose engine plugin is installed (a missing engine
    plugin means no fixture for that engine, not an error)."""
    out: list[FixtureCase] = []
    try:
        from kvcore_vllm.fixtures import fixture_cases as vllm_cases
    except ImportError:
        vllm_cases = None
    if vllm_cases is not None:
        base = {c.name: c for c in vllm_cases()}
        for src, name, sizes, dtypes, cons, source in _VLLM:
            c = base.get(src)
            if c is not None:
                out.append(
                    replace(
                        c,
                        name=name,
                        make=_on_xpu(c.make, forced_nhd=not src.startswith("vllm-0.29")),
                        sizes={**c.sizes, **sizes},
                        dtypes=dtypes,
                        size_constraints={**c.size_constraints, **cons},
                        source=source,
                    )
                )
    try:
        from kvcore_sglang.fixtures import CASES as sglang_cases
    except ImportError:
        sglang_cases = None
    if sglang_cases is not None:
        base = {c.name: c for c in sglang_cases}
        for src, name, sizes, cons, source in _SGLANG:
            c = base.get(src)
            if c is not None:
                out.append(
                    replace(c, name=name, sizes={**c.sizes, **sizes}, size_constraints={**c.size_constraints, **cons}, source=source)
                )
    return out
