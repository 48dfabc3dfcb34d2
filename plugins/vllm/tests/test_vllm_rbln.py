"""vllm-rbln's per-layer caches ``(2, NB, NH, 1, BS, HS)`` (``RBLNFlashAttentionBackend.
get_kv_cache_shape``; allocation :func:`kvcore_vllm.rbln.allocate_rbln`), read back through
the engine's own view (:func:`kvcore_vllm.rbln.rbln_view`)."""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.rbln import RBLN_FORMAT, allocate_rbln, rbln_view

import kvcore


@pytest.mark.parametrize("hints", [{}, {"kv_cache_layout": "NHD"}, {"kv_cache_layout": "HND"}, {"block_size": 16, "num_kv_heads": 3}])
def test_rbln_caches_detect_and_gather_what_the_engine_reads(hints):
    kv = allocate_rbln(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=3, head_size=8, dtype=torch.float32)
    for i, t in enumerate(kv.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 10000 * i)
    lay = kvcore.detect(kv, "vllm", hints)
    assert lay.format.name == RBLN_FORMAT
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (2, 5, 16, 3, 8)
    slots = torch.tensor([0, 21, 79])
    out = kvcore.gather(lay, slots)
    for layer in range(2):
        for kvi in range(2):
            view = rbln_view(kv, layer, kvi)  # [NB, BS, NH, HS]
            for i, s in enumerate(slots.tolist()):
                assert torch.equal(out[kvi, layer, i], view[s // 16, s % 16].reshape(-1))
    # token 21 of layer 1's V: block 1, offset 5, head 2 lives at kv_cache[1, 1, 2, 0, 5]
    assert torch.equal(out[1, 1, 1, 16:24], list(kv.values())[1][1, 1, 2, 0, 5])


def test_rbln_refuses_what_vllm_rbln_never_allocates():
    kv = allocate_rbln(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=3, head_size=8)
    with pytest.raises(kvcore.DetectionError, match="block_size=32 \\(the tensors hold 16\\)"):
        kvcore.detect(kv, "vllm", {"block_size": 32})
    with pytest.raises(kvcore.DetectionError, match="kv_cache_layout='BLHNC'"):
        kvcore.detect(kv, "vllm", {"kv_cache_layout": "BLHNC"})
    permuted = [t.transpose(1, 2) for t in kv.values()]
    with pytest.raises(kvcore.DetectionError):
        kvcore.detect(permuted, "vllm")
