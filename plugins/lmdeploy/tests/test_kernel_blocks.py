"""LMDeploy 0.14's kernel blocks: the tensors hold ``kernel_block_size``-token blocks while the
block manager (a sequence's block table, ``num_gpu_blocks``) counts ``block_size``-token
blocks; ``inputs_maker.py::InputsMakerAsync._map_to_kernel_block_offsets`` maps manager block
``m`` to kernel blocks ``m*r .. m*r+r-1``. The layout says which unit its block ids are, and
:mod:`kvcore_lmdeploy.blocks` takes the manager's ids.

The expected rows are read from LMDeploy's tensors with that mapping written out here
(kernel block ``m*r + t // kernel_block_size``, token ``t % kernel_block_size``)."""

from __future__ import annotations

import pytest
import torch
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.allocation import CacheConfig, allocate
from kvcore_lmdeploy.blocks import gather_manager_blocks, kernel_block_ids, scatter_manager_blocks

import kvcore
from kvcore import GeometryError, TransferError

BS, KB = 64, 16  # manager block, kernel block: r = 4


def _manager_rows(t: torch.Tensor, m: int) -> torch.Tensor:
    """Manager block ``m``'s 64 token rows of a per-layer ``[NB_kernel, KB, NH, W]`` tensor,
    as LMDeploy's kernels find them (block table expanded by _map_to_kernel_block_offsets)."""
    r = BS // KB
    return torch.stack([t[m * r + tok // KB, tok % KB].reshape(-1) for tok in range(BS)])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_kernel_block_ids_is_lmdeploys_mapping():
    # the docstring example of 0.14.0 _map_to_kernel_block_offsets: manager 32, kernel 16
    assert kernel_block_ids([0, 1, 3], 32, 16).tolist() == [0, 1, 2, 3, 6, 7]
    assert kernel_block_ids(torch.tensor([2, -1, 0]), 64, 16).tolist() == [8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3]
    assert kernel_block_ids([5], 16, 16).tolist() == [5]
    for bad in ((64, 24), (16, 32), (64, 0)):
        with pytest.raises(GeometryError, match="not a multiple"):
            kernel_block_ids([0], *bad)
    with pytest.raises(GeometryError, match="1-D integer"):
        kernel_block_ids(torch.tensor([[0]]), 64, 16)
    with pytest.raises(GeometryError, match="1-D integer"):
        kernel_block_ids(torch.tensor([0.5]), 64, 16)


@pytest.mark.parametrize("holder", ["gpu_cache", "pool"])
def test_layout_block_ids_are_kernel_blocks_and_the_note_says_so(holder, engine_side):
    """D6: the layout counts kernel blocks (12 of 16 tokens for 3 manager blocks of 64);
    kvcore.gather_blocks([1]) is kernel block 1 (slots 16..31) -- the note tells the unit --,
    gather_manager_blocks([1], 64) is manager block 1 (slots 64..127)."""
    alloc = allocate("0.14.0", CacheConfig(2, 3, BS, 2, 8, kernel_block_size=KB))
    engine_side.fill_random([alloc.full], seed=4)
    if holder == "gpu_cache":
        layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"device_type": "cuda", "block_size": BS})
    else:
        hints = {"device_type": "cuda", "block_size": BS, "kernel_block_size": KB, "num_kv_heads": 2, "head_dim": 8, "dtype": "bfloat16"}
        layout = kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "quant_policy": 0})
    assert (layout.block_size, layout.num_blocks) == (KB, 12)
    assert "KERNEL blocks" in layout.note and "m*4..m*4+3" in layout.note
    kernel_one = kvcore.gather_blocks(layout, torch.tensor([1]))
    assert kernel_one.shape[2] == KB
    k1 = alloc.gpu_cache[1][0]
    assert torch.equal(_bytes(kernel_one[0, 1]), _bytes(k1[1].reshape(KB, -1)))
    staged = gather_manager_blocks(layout, [1, -1, 2], BS)
    assert tuple(staged.shape) == (2, 2, 3 * BS, 16)
    for layer in range(2):
        for kv in range(2):
            t = alloc.gpu_cache[layer][kv]
            assert torch.equal(_bytes(staged[kv, layer, :BS]), _bytes(_manager_rows(t, 1)))
            assert torch.equal(_bytes(staged[kv, layer, 2 * BS :]), _bytes(_manager_rows(t, 2)))
    # slots are one numbering for both: manager block 1 token 37 is slot 64 + 37 either way
    by_slot = kvcore.gather(layout, torch.arange(BS, 2 * BS))
    assert torch.equal(_bytes(by_slot), _bytes(staged[:, :, :BS]))


def test_scatter_manager_blocks_writes_those_blocks_only():
    src = allocate("0.14.0", CacheConfig(2, 3, BS, 2, 8, kernel_block_size=KB, quant_policy=8))
    g = torch.Generator().manual_seed(9)
    src.full.copy_(torch.randint(0, 256, src.full.shape, dtype=torch.uint8, generator=g))
    dst = allocate("0.14.0", CacheConfig(2, 4, BS, 2, 8, kernel_block_size=KB, quant_policy=8))
    hints = {"device_type": "cuda", "block_size": BS, "quant_policy": 8}
    a = kvcore.detect(src.gpu_cache, engine="lmdeploy", hints=hints)
    b = kvcore.detect(dst.gpu_cache, engine="lmdeploy", hints=hints)
    assert a.format.name == F.QUANT and "KERNEL blocks" in a.note
    staged = gather_manager_blocks(a, [2, 0], BS)  # one buffer per plane
    assert staged["K"].shape == (2, 2 * BS, 16) and staged["KSZ"].shape == (2, 2 * BS, 4)
    scatter_manager_blocks(b, [3, 1], BS, staged)
    for layer in range(2):
        for p in range(4):
            s, d = src.gpu_cache[layer][p], dst.gpu_cache[layer][p]
            assert torch.equal(_bytes(_manager_rows(d, 3)), _bytes(_manager_rows(s, 2)))
            assert torch.equal(_bytes(_manager_rows(d, 1)), _bytes(_manager_rows(s, 0)))
            for m in (0, 2):  # the pool was zeros; nothing else was written
                assert int(_bytes(_manager_rows(d, m)).count_nonzero()) == 0


def test_manager_block_ids_refused_before_any_byte_moves():
    alloc = allocate("0.14.0", CacheConfig(1, 2, BS, 1, 8, kernel_block_size=KB))
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"device_type": "cuda", "block_size": BS})
    with pytest.raises(TransferError, match="not a multiple of the layout's block"):
        gather_manager_blocks(layout, [0], 24)
    with pytest.raises(TransferError):
        gather_manager_blocks(layout, [2], BS)  # manager blocks 0, 1 only: kernel blocks 8..11 are past the cache
    before = alloc.full.clone()
    staged = gather_manager_blocks(layout, [0], BS)
    with pytest.raises(TransferError):
        scatter_manager_blocks(layout, [0, 1], BS, staged)  # staging for one block, two asked
    assert torch.equal(before, alloc.full)
    # a layout whose block is the manager's: manager ids are its block ids
    plain = allocate("0.14.0", CacheConfig(1, 2, 16, 1, 8))
    pl = kvcore.detect(plain.gpu_cache, engine="lmdeploy", hints={"device_type": "cuda", "block_size": 16})
    assert "KERNEL" not in pl.note
    assert torch.equal(gather_manager_blocks(pl, [1], 16), kvcore.gather_blocks(pl, torch.tensor([1])))
