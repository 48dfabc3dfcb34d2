"""Hints checked against what vLLM can produce, and a user's mistake never answered
confidently (issue 24):

* ``cache_dtype="fp8_ds_mla"`` names records vLLM writes 656 (V3.2), 584 (V4) or 528 (V4.1)
  bytes wide (``kvcore_vllm.specs.RECORDS``); other widths contradict it;
* a ``block_size`` larger than the tensors' is the manager's split into kernel blocks only
  when the kernel-block count is ``num_blocks x ratio`` (vLLM ``_reshape_kv_cache_tensors``:
  ``kernel_num_blocks = num_blocks * num_blocks_per_kv_block``);
* the K half of each layer (a 4-D tensor over half of a ``(2, NB, ...)`` allocation) is not
  read as a 0.26 packed K|V cache without a version or backend hint."""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm import fixtures

import kvcore


@pytest.mark.parametrize("width", [512, 576, 352, 288, 600])
def test_fp8_ds_mla_refuses_widths_no_writer_produces(width):
    kv = [torch.zeros(4, 64, width, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(kvcore.DetectionError, match=f"holds? {width}-byte rows") as e:
        kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_ds_mla"})
    assert "656 B" in str(e.value) and "584 B" in str(e.value) and "528 B" in str(e.value)


@pytest.mark.parametrize("width, fmt, bs", [(656, "NL_X_NB_BS_HS", 64), (528, "NL_X_NB_BS_HS", 64), (584, "NL_X_NB_BSV_BSS", 64)])
def test_fp8_ds_mla_reads_the_widths_vllm_writes(width, fmt, bs):
    kv = [torch.zeros(4, 64, width, dtype=torch.uint8) for _ in range(2)]
    lay = kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_ds_mla"})
    assert (lay.format.name, lay.num_blocks, lay.block_size) == (fmt, 4, bs)


def test_nvfp4_ds_mla_has_its_own_widths():
    with pytest.raises(kvcore.DetectionError, match="656-byte rows"):
        kvcore.detect([torch.zeros(4, 16, 656, dtype=torch.uint8)], "vllm", {"cache_dtype": "nvfp4_ds_mla"})
    assert kvcore.detect([torch.zeros(4, 16, 352, dtype=torch.uint8)], "vllm", {"cache_dtype": "nvfp4_ds_mla"}).head_size == 352


@pytest.mark.parametrize(
    "make",
    [
        lambda nb: [torch.zeros(nb, 16, 576, dtype=torch.bfloat16) for _ in range(2)],  # MLA latent
        lambda nb: [torch.zeros(2, nb, 16, 4, 64, dtype=torch.bfloat16) for _ in range(2)],  # FlashAttention
    ],
)
def test_kernel_blocks_must_be_num_blocks_times_the_ratio(make):
    with pytest.raises(kvcore.DetectionError, match="9 blocks of 16 tokens.*multiple of 2"):
        kvcore.detect(make(9), "vllm", {"block_size": 32})
    lay = kvcore.detect(make(10), "vllm", {"block_size": 32, "kv_cache_layout": "NHD"})
    assert (lay.num_blocks, lay.block_size) == (10, 16)  # 5 manager blocks of 32, as 10 kernel blocks
    with pytest.raises(kvcore.DetectionError, match="10 blocks of 16 tokens.*multiple of 4"):
        kvcore.detect(make(10), "vllm", {"block_size": 64})


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_the_k_half_of_each_layer_is_not_answered_confidently(backend):
    caches = fixtures.allocate("0.11.0", backend, "HND", num_layers=3, num_blocks=10, block_size=16, num_kv_heads=8, head_size=64)
    layers = list(caches.values()) if isinstance(caches, dict) else list(caches)
    k_half = [t[0] if backend == "FLASH_ATTN" else t[:, 0] for t in layers]
    with pytest.raises(kvcore.AmbiguousLayoutError, match="exactly half of its storage") as e:
        kvcore.detect(k_half, "vllm")
    assert set(e.value.hints) == {"vllm_version", "attention_backend"}
    # the whole layers are read as what they are
    whole = kvcore.detect(layers, "vllm", {"vllm_version": "0.11.0", "attention_backend": backend})
    assert (whole.num_blocks, whole.block_size, whole.num_heads, whole.head_size) == (10, 16, 8, 64)


def test_a_real_packed_cache_covering_its_storage_is_still_read():
    kv = fixtures.allocate("0.26.0", "FLASH_ATTN", "NHD", num_layers=2, num_blocks=6, block_size=16, num_kv_heads=2, head_size=64)
    layers = list(kv.values()) if isinstance(kv, dict) else list(kv)
    lay = kvcore.detect(layers, "vllm", {"kv_cache_layout": "NHD", "tensor_order": "allocated", "device_type": "cuda"})
    assert (lay.format.name, lay.num_heads, lay.head_size) == ("NL_X_NB_BS_NH_CS", 2, 64)
