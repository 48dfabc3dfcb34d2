"""Which platform wrote a vLLM cache: ROCm, CPU, or unknown (None), from the hints, the backend
name and the tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.dtypes import rocm_build
from kvcore_vllm.hints import VllmHints

#: backends that only run on ROCm / never on ROCm (vLLM 0.33 ``platforms/rocm.py``
#: backend selection; FlashMLA, CUTLASS MLA and FlashInfer are NVIDIA libraries).
ROCM_ONLY_BACKENDS = (
    "ROCM_ATTN",
    "ROCM_SEGMENTED_ATTN",
    "ROCM_AITER_FA",
    "ROCM_AITER_UNIFIED_ATTN",
    "ROCM_AITER_MLA",
    "ROCM_AITER_MLA_SPARSE",
    "ROCM_AITER_TRITON_MLA",
    "AITER_TRITON_MLA",
    "ROCM_FLASHMLA_SPARSE_DSV4",
    "ROCM_FLASHMLA_SPARSE_DSV41",
    "DEEPSEEK_V4_ROCM_MXFP4_INDEXER",
    "DEEPSEEK_V41_ROCM_MXFP4_INDEXER",
)
#: backends of vLLM's CPU platform only (``platforms/cpu.py::CpuPlatform.get_attn_backend_cls``).
CPU_ONLY_BACKENDS = ("CPU_ATTN", "TORCH_SDPA", "CPU_MLA", "AMX_MLA", "CPU_V4_MLA_SPARSE", "CPU_V4_INDEXER")
NOT_ROCM_BACKENDS = (
    "B12X",
    "TRITON_FLASHINFER",
    "CPU_MLA",
    "AMX_MLA",
    "FLASHMLA",
    "FLASHMLA_SPARSE",
    "CUTLASS_MLA",
    "FLASHINFER_MLA",
    "FLASH_ATTN_MLA",
    "FLASHINFER",
    "FLASHINFER_VLLM_V1",
    "CPU_ATTN",
    "TORCH_SDPA",
    "PALLAS",
    "PALLAS_VLLM_V1",
)


def platform_rocm(h: VllmHints, tensors: Sequence[torch.Tensor]) -> bool | None:
    """Whether the engine that wrote ``tensors`` ran on ROCm: the ``device_type`` hint, else
    a backend that exists on one platform only, else the torch build of the process holding
    the tensors (:func:`kvcore.dtypes.rocm_build`); None when nothing tells (meta tensors,
    a description from a log)."""
    if h.device_type is not None:
        return h.device_type == "rocm"
    if h.attention_backend in ROCM_ONLY_BACKENDS:
        return True
    if h.attention_backend in NOT_ROCM_BACKENDS:
        return False
    return rocm_build(list(tensors))


def platform_cpu(h: VllmHints, tensors: Sequence[torch.Tensor]) -> bool | None:
    """Whether the engine that wrote ``tensors`` may be vLLM's CPU platform: the
    ``device_type`` hint; else a backend hint (a CPU backend says yes, any other no); else
    ``use_ipex`` (a ``TORCH_SDPA``-only setting) says yes; else the tensors: memory on an
    accelerator (``cuda``, ``xpu``, ...) is no CPU engine's cache, nor is memory of a ROCm
    build of torch (:func:`kvcore.dtypes.rocm_build`); CPU (or meta) tensors of any other
    build may be -- None: the CPU backend's readings are considered beside the GPU ones,
    and where they place bytes differently detection names ``attention_backend`` /
    ``device_type`` (a CPU tensor may also be a GPU cache copied or described, so its
    device does not rule the GPU readings out)."""
    if h.device_type is not None:
        return h.device_type == "cpu"
    if h.attention_backend in CPU_ONLY_BACKENDS:
        return True
    if h.family is not None:
        return h.family == "CPU"
    if h.use_ipex is not None or h.cpu_attn_isa is not None:
        return True
    if any(t.device.type not in ("cpu", "meta") for t in tensors):
        return False
    if rocm_build(list(tensors)):
        return False
    return None
