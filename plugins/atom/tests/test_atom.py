"""kvcore-atom: ATOM's per-layer MLA latent and DSA index caches, allocated as ATOM's
``allocate_kv_cache_tensors`` does and read back through aiter's writers' addressing
(restated independently of the plugin's plane builder)."""

from __future__ import annotations

import pytest
import torch
from kvcore_atom import INDEX_FORMAT, LATENT_FORMAT, allocate

import kvcore


def test_latent_caches_are_mla_rows():
    kv = allocate("latent", num_layers=3, num_blocks=4, block_size=16, dtype=torch.bfloat16)
    for i, t in enumerate(kv):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape).remainder(251) + 300 * i)
    lay = kvcore.detect(kv, "atom")
    assert (lay.format.name, lay.num_layers, lay.num_blocks, lay.block_size, lay.head_size, lay.kv_size) == (
        LATENT_FORMAT,
        3,
        4,
        16,
        576,
        1,
    )
    out = kvcore.gather(lay, torch.tensor([0, 37, -1]))
    # concat_and_cache_mla: slot s at row s of kv_cache[layer].view(num_slots, 1, 576)
    assert torch.equal(out[0, 2, 1], kv[2].reshape(-1, 576)[37])
    assert torch.count_nonzero(out[0, :, 2]) == 0
    # LMCache's ATOM registration hands a dict of layer views; the runner's whole tensor works too
    assert kvcore.detect({f"layer.{i}.latent": t for i, t in enumerate(kv)}, "atom").num_layers == 3
    whole = torch.zeros(3, 4, 16, 576, dtype=torch.bfloat16)  # the runner's kv_cache (num_layers, NB, BS, 576)
    assert kvcore.detect(whole, "atom").num_layers == 3


def _aiter_tile_offset(block, token, byte, bs, d, width):
    """indexer_k_quant_and_cache_kernel, preshuffle: dst = block*BS*stride + (t//16)*16*d + (e//16)*256 + (t%16)*16 + e%16."""
    return block * bs * width + (token // 16) * 16 * d + (byte // 16) * 256 + (token % 16) * 16 + byte % 16


@pytest.mark.parametrize("bs", [16, 32, 64])
def test_index_pages_gather_the_tiles_aiter_writes(bs):
    nb, nl, d, w = 3, 2, 128, 144
    kv = allocate("index", num_layers=nl, num_blocks=nb, block_size=bs, dtype=torch.float8_e4m3fnuz)
    for i, t in enumerate(kv):
        t.view(torch.uint8).copy_((torch.arange(t.numel()).view(t.shape) * 7 + 13 * i).remainder(256).to(torch.uint8))
    lay = kvcore.detect(kv, "atom")
    assert lay.format.name == INDEX_FORMAT
    assert (lay.num_layers, lay.num_blocks, lay.block_size) == (nl, nb, bs)
    assert lay.staging_shapes(2) == {"K": (nl, 2, d), "KS": (nl, 2, 4)}
    slots = torch.tensor([bs + 17 if bs > 16 else bs + 3, 2 * bs + 5])
    out = kvcore.gather(lay, slots)
    for li in range(nl):
        flat = kv[li].view(torch.uint8).reshape(-1)
        for i, s in enumerate(slots.tolist()):
            b, t = divmod(s, bs)
            want_k = torch.stack([flat[_aiter_tile_offset(b, t, e, bs, d, w)] for e in range(d)])
            want_s = flat[b * bs * w + bs * d + t * 4 : b * bs * w + bs * d + t * 4 + 4]
            assert torch.equal(out["K"][li, i], want_k) and torch.equal(out["KS"][li, i], want_s)


def test_hints_and_refusals():
    idx = allocate("index", num_layers=2, num_blocks=2, block_size=16, dtype=torch.float8_e4m3fn)
    assert kvcore.detect(idx, "atom", {"index_head_dim": 128, "kind": "index"}).format.name == INDEX_FORMAT
    with pytest.raises(kvcore.DetectionError, match="index_head_dim=64 gives rows of"):
        kvcore.detect(idx, "atom", {"index_head_dim": 64})
    with pytest.raises(kvcore.DetectionError, match="block_size=32"):
        kvcore.detect(idx, "atom", {"block_size": 32})
    # a 144-wide fp8 tensor said to be a latent is read as one (the caller's statement of what it is)
    assert kvcore.detect(idx, "atom", {"kind": "latent"}).format.name == LATENT_FORMAT
    small = allocate("index", num_layers=2, num_blocks=32, block_size=1, dtype=torch.float8_e4m3fn)
    with pytest.raises(kvcore.DetectionError, match="16-token tiles"):
        kvcore.detect(small, "atom")
    with pytest.raises(kvcore.DetectionError, match="unknown hint"):
        kvcore.detect(idx, "atom", {"kv_layout": "NHD"})
    with pytest.raises(kvcore.DetectionError, match="per layer"):
        kvcore.detect([torch.zeros(2, 16, 4, 576)], "atom")
