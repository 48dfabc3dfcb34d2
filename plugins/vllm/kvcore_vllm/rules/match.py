"""Whether a rule fits the hints (era, family, platform gates, run-time settings) and a tensor's
sizes (block and head sizes, kernel-block splits, byte records)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore_vllm.hints import MLA_CACHE_DTYPES, VllmHints
from kvcore_vllm.releases import LAYOUT_ERA
from kvcore_vllm.rules.rule import Rule
from kvcore_vllm.rules.views import _BYTE_DTYPES
from kvcore_vllm.specs import RECORDS


def _rule_ok(rule: Rule, h: VllmHints, rocm: bool | None = None, cpu: bool | None = None) -> bool:
    if h.era is not None and h.era not in rule.eras:
        return False
    fam = h.family
    if fam is not None and fam not in rule.families:
        return False
    if h.is_mla is True and not rule.mla:
        return False
    if h.is_mla is False and rule.mla:
        return False
    if h.use_ipex is not None and not any(k == "use_ipex" for k, _ in rule.requires):
        return False  # use_ipex is a setting of vLLM 0.11 TORCH_SDPA only (cpu_attn.py::_use_ipex): it selects that backend
    if h.cpu_attn_isa is not None and not any(k == "cpu_amx" for k, _ in rule.requires):
        return False  # the kernel path is CPU_ATTN's (0.13+, the layers' isa): it selects that backend
    for key, want in rule.requires:
        got = getattr(h, key)
        if got is not None and got != want:
            return False
        if key == "use_ipex" and want is False and (h.cache_dtype or "").startswith("fp8"):
            return False  # TorchSDPABackendImpl: an FP8 KV cache requires intel_extension_for_pytorch
    dev = h.device_type
    if rule.gate == "gpu" and dev in ("cpu", "tpu"):
        return False
    if rule.gate == "cpu" and not (dev == "cpu" or fam == "CPU" or (dev is None and fam is None and cpu is not False)):
        return False  # the CPU backend's readings stand beside the GPU ones wherever the platform may be CPU (platform_cpu)
    if rule.gate == "tpu" and not (dev == "tpu" or fam == "PALLAS"):
        return False
    # VLLM_V1_USE_PREFILL_DECODE_ATTENTION is read by ROCm's backend only (envs.py; rocm_attn.py): a caller who
    # states it on puts ROCm's readings beside the others wherever the device is not stated
    pda_on = h.prefill_decode_attention is True and dev is None
    if rule.gate == "rocm" and not (dev == "rocm" or fam in ("ROCM_ATTN", "ROCM_SEGMENTED") or (dev is None and rocm) or pda_on):
        return False
    if rule.gate == "cuda" and ((dev is not None and dev != "cuda") or rocm):
        return False
    if rule.gate == "rocm?" and (rocm is False or dev in ("cpu", "tpu")):
        return False
    return True


def _sizes(tokens: Sequence[str], t: torch.Tensor) -> dict[str, int] | None:
    out = {}
    for tok, n in zip(tokens, t.shape):
        if tok == "TWO" and n != 2:
            return None
        if tok == "ONE" and n != 1:
            return None
        out[tok] = int(n)
    return out


def _record_hints_ok(rec, h: VllmHints) -> bool:
    """The hints agree with vLLM's byte record ``rec``: a ``*_ds_mla`` cache dtype must be one
    that writes this width; a head size must be the record's bytes or, with its cache dtype,
    the model's own head size (``model_config.get_head_size()``: 576 for V3.2's 656 B record,
    512 for V4's 584 B page). An indexer's record follows no cache dtype or model head size."""
    if not rec.cache_dtypes:
        return True
    if h.cache_dtype in MLA_CACHE_DTYPES and h.cache_dtype not in rec.cache_dtypes:
        return False
    if h.head_size is not None and h.head_size != rec.width:
        return h.head_size == rec.head_size and h.cache_dtype in rec.cache_dtypes
    return True


def _sizes_ok(
    rule: Rule, sz: dict[str, int], t: torch.Tensor, esz: int, h: VllmHints, kernel_split: bool = False, rocm: bool | None = None
) -> bool:
    isz = t.element_size()
    if rule.block_sizes and sz.get("BS") not in rule.block_sizes:
        return False
    if "BS" in sz and h.block_size is not None and sz["BS"] != h.block_size:
        # 0.13+: the manager's block_size may be split into kernel blocks of the tensor's BS
        # (gpu_model_runner._reshape_kv_cache_tensors, 0.29+ create_kv_cache_views)
        # kernel blocks are multiples of 16 tokens (get_supported_kernel_block_sizes: MultipleOf(16), 32, 64...)
        if not (kernel_split and sz["BS"] % 16 == 0 and h.block_size % sz["BS"] == 0):
            return False
        # vLLM makes num_blocks x (block_size // kernel_block_size) kernel blocks (0.13+
        # gpu_model_runner._reshape_kv_cache_tensors: kernel_num_blocks = num_blocks * num_blocks_per_kv_block;
        # 0.33 create_kv_cache_views likewise): a kernel-block count the ratio does not divide is no such split
        if "NB" in sz and sz["NB"] % (h.block_size // sz["BS"]):
            return False
    if h.num_kv_heads is not None:
        if rule.mla and h.num_kv_heads != 1:
            return False
        if "NH" in sz and sz["NH"] != h.num_kv_heads:
            return False
    last = "CS" if "CS" in sz else "HS"
    width_bytes = sz[last] * isz
    if width_bytes % esz:
        return False
    width = width_bytes // esz
    record = RECORDS.get(sz[last]) if t.dtype in _BYTE_DTYPES and esz == 1 else None
    if rule.blocked:
        if record is None or record.layout != "blocked" or not _record_hints_ok(record, h):
            return False
        # ROCm writes the indexer's value region in tiles once a block holds more than one token
        # (0.24+; 0.13's ROCm indexer blocks hold one token, 0.11 has no ROCm sparse MLA)
        tiles = record.rocm == "tiles" and sz.get("BS", 1) > 1 and h.era not in ("0.11", "0.13")
        if rule.planes == "rocm_tiles":
            return tiles and rocm is not False
        if tiles and rocm:
            return False
        if record.rocm == "aiter" and rocm and h.era in (None, LAYOUT_ERA):
            return False  # aiter's MXFP4 pages on ROCm gfx950: not claimed (see _aiter_pages)
        return True
    if rule.mla:
        # a rank-3 cache is a latent of any width (576 for DeepSeek, 128 for MiniMax-M3's indexer
        # keys, ...); a uint8 width that is one of vLLM's byte records is read as vLLM writes it
        # (the width identifies the record: kvcore_vllm.specs)
        if record is not None:
            return record.layout == "token" and _record_hints_ok(record, h)
        if h.cache_dtype in MLA_CACHE_DTYPES and t.dtype in _BYTE_DTYPES:
            return False  # no vLLM *_ds_mla writer makes a record of this width (kvcore_vllm.specs.RECORDS)
        if h.head_size is not None:
            return width == h.head_size
        return True
    if last == "CS":
        if width % 2:
            return False
        width //= 2
    if h.head_size is not None and width != h.head_size and rule.transform != "pallas":
        return False
    if rule.head_sizes and (h.head_size is not None or h.num_kv_heads is not None) and width not in rule.head_sizes:
        return False
    return True
