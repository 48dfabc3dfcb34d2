"""The continuous-batching paged cache, written by transformers' own allocator code.

A hybrid cache (full-attention and sliding-window groups over one uint8 tensor, sectors of
``lcm(bytes_per_block of both groups, 128)`` as ``PagedAttentionCache.__init__`` computes
them) is filled through transformers' ``allocator.update(...)`` at the physical indices of
``get_write_indices`` for a request's block table; kvcore's gather of that request's slots
must return exactly the K/V transformers wrote, for both groups (the sliding one is a ring).
"""

from __future__ import annotations

from math import lcm
from types import SimpleNamespace

import pytest
import torch
from kvcore_transformers import PAGED_FORMAT, detect_paged, kv_caches, paged_groups, request_slots
from kvcore_transformers.versions import installed_version, parse_version

import kvcore

NH, HS, PS = 2, 8, 4
FULL_LAYERS, SLIDING_LAYERS = [1, 3], [0, 2, 4]
WINDOW = 6


def _hybrid_cache(dtype=torch.float32, num_sectors=6):
    from transformers.generation.continuous_batching.cache_allocators import (
        CachePool,
        FullAttentionCacheAllocator,
        SlidingAttentionCacheAllocator,
    )

    cfg = SimpleNamespace(head_dim=HS, sliding_window=WINDOW)
    kw = dict(config=cfg, num_key_value_heads=NH, cache_dtype=dtype, page_size=PS, allow_block_sharing=False)
    allocs = {
        "sliding_attention": SlidingAttentionCacheAllocator(index=0, layer_indices=SLIDING_LAYERS, **kw),
        "full_attention": FullAttentionCacheAllocator(index=1, layer_indices=FULL_LAYERS, **kw),
    }
    sector = lcm(*(a.bytes_per_block for a in allocs.values()), 128)
    non_trash = num_sectors * sector
    tensor = torch.zeros(non_trash + 2 * sector, dtype=torch.uint8)
    pool = CachePool(num_sectors, len(allocs))
    for a in allocs.values():
        a.register_cache_tensor(sector, non_trash, tensor, pool)
    return SimpleNamespace(cache_tensor=tensor, cache_allocators=allocs, pool=pool)


def _states_arg(k, v):
    """``allocator.update`` takes ``[seqlen, NH, HS]`` states from 5.19 on, ``[1, NH, seqlen, HS]`` in 5.18."""
    if parse_version(installed_version()) < (5, 19, 0):
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    return k, v


def _write_request(cache, rid, n, seed):
    """Allocate and write ``n`` tokens of request ``rid`` with transformers' own code;
    returns {model_layer: (K [n, NH, HS], V [n, NH, HS])}."""
    g = torch.Generator().manual_seed(seed)
    written = {}
    for a in cache.cache_allocators.values():
        while cache.pool.count_free_blocks(a.index) < a.needs_new_blocks(rid, 0, n):
            cache.pool.allocate_sector(a.index)
        a.allocate_cache_to_request(rid, 0, n)
        write = torch.tensor(a.get_write_indices(rid, 0, n), dtype=torch.long)
        for layer in a.layer_indices:
            k = torch.randn(n, NH, HS, generator=g).to(a.cache_dtype)
            v = torch.randn(n, NH, HS, generator=g).to(a.cache_dtype)
            a.update(*_states_arg(k, v), layer, torch.empty(0, dtype=torch.long), write)
            written[layer] = (k, v)
    return written


def test_hybrid_groups_geometry():
    cache = _hybrid_cache()
    layouts = detect_paged(cache)
    assert list(layouts) == ["sliding_attention", "full_attention"]
    total = cache.cache_tensor.numel()
    for name, ids in (("sliding_attention", SLIDING_LAYERS), ("full_attention", FULL_LAYERS)):
        lay = layouts[name]
        assert lay.format.name == PAGED_FORMAT
        assert lay.layer_ids == tuple(ids)
        bpb = len(ids) * 2 * PS * NH * HS * 4
        assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (len(ids), total // bpb, PS, NH, HS)
        assert lay.data_ptrs() == [cache.cache_tensor.data_ptr()]
    # the sliding group's block is 3 layers, the full group's 2: a sector holds 2 and 3 of them
    assert layouts["full_attention"].num_blocks * 2 == layouts["sliding_attention"].num_blocks * 3


def test_detect_needs_the_group_when_there_are_two():
    cache = _hybrid_cache()
    with pytest.raises(kvcore.AmbiguousLayoutError) as e:
        kvcore.detect(cache, engine="transformers")
    assert "attention_type" in str(e.value) and e.value.hints == ["attention_type"]
    lay = kvcore.detect(cache, engine="transformers", hints={"attention_type": "sliding_attention"})
    assert lay.num_layers == len(SLIDING_LAYERS)
    assert lay.layer_ids == tuple(SLIDING_LAYERS)  # the model's layers of the group, not 0..NL-1
    with pytest.raises(kvcore.DetectionError, match="groups"):
        kvcore.detect(cache, engine="transformers", hints={"attention_type": "chunked_attention"})
    # kv_caches(cache, group) hands out the group's 6-D view; detecting it addresses the same bytes
    view = kv_caches(cache, "sliding_attention")
    assert list(view.shape) == [lay.num_blocks, len(SLIDING_LAYERS), 2, PS, NH, HS]
    assert kvcore.detect(view, engine="transformers").stride_table().signature() == lay.stride_table().signature()
    with pytest.raises(kvcore.AmbiguousLayoutError):
        kv_caches(cache)


@pytest.mark.parametrize("n", [3, 4, 11])
def test_gather_returns_what_transformers_wrote(n):
    cache = _hybrid_cache()
    _write_request(cache, "other", 5, seed=7)  # a neighbour whose blocks must not leak in
    written = _write_request(cache, "r", n, seed=n)
    groups = paged_groups(cache)
    layouts = detect_paged(cache)
    for name, group in groups.items():
        lay = layouts[name]
        slots = request_slots(group, num_tokens=n, request_id="r")
        staged = kvcore.gather(lay, slots)
        stored = slots >= 0
        if group.sliding_window is None:
            assert bool(stored.all())
        else:  # only the last `window` positions live in the ring
            assert int(stored.sum()) == min(n, WINDOW)
        for i, layer in enumerate(group.layer_ids):
            k, v = written[layer]
            if group.sliding_window is not None and n > WINDOW:
                continue  # transformers wrote the first n - window tokens to the write trash
            assert torch.equal(staged[0, i][stored], k.reshape(n, NH * HS)[stored]), f"{name} layer {layer} K"
            assert torch.equal(staged[1, i][stored], v.reshape(n, NH * HS)[stored]), f"{name} layer {layer} V"


def test_sliding_ring_positions():
    """Position p of a sliding request is ring slot p % window (transformers' own read path agrees)."""
    cache = _hybrid_cache()
    group = paged_groups(cache)["sliding_attention"]
    alloc = group.allocator
    n = 4
    _write_request(cache, "r", n, seed=1)
    # a second update of 5 tokens wraps the ring: positions 4..8
    g = torch.Generator().manual_seed(2)
    while cache.pool.count_free_blocks(alloc.index) < alloc.needs_new_blocks("r", n, 5):
        cache.pool.allocate_sector(alloc.index)
    alloc.allocate_cache_to_request("r", n, 5)
    write = torch.tensor(alloc.get_write_indices("r", n, 5), dtype=torch.long)
    new = {layer: (torch.randn(5, NH, HS, generator=g), torch.randn(5, NH, HS, generator=g)) for layer in alloc.layer_indices}
    for layer, (k, v) in new.items():
        alloc.update(*_states_arg(k, v), layer, torch.empty(0, dtype=torch.long), write)
    slots = request_slots(group, num_tokens=9, request_id="r")
    assert slots[:3].tolist() == [-1, -1, -1]  # 9 tokens, window 6: positions 0..2 slid out
    lay = detect_paged(cache)["sliding_attention"]
    staged = kvcore.gather(lay, slots[4:])
    for i, layer in enumerate(alloc.layer_indices):
        assert torch.equal(staged[0, i], new[layer][0].reshape(5, NH * HS))
        assert torch.equal(staged[1, i], new[layer][1].reshape(5, NH * HS))
    # transformers' read indices for the next step address the same slots as kvcore's
    read = alloc.get_read_indices("r", 9, 1)[:-1]  # the last entry is the sentinel for the new token
    assert sorted(read) == sorted(((s // PS) * alloc.block_physical_stride + s % PS) for s in slots[4:].tolist())


def test_offload_restore_blocks_into_other_blocks_bit_exact():
    cache = _hybrid_cache(torch.bfloat16)
    written = _write_request(cache, "r", 7, seed=3)
    group = paged_groups(cache)["full_attention"]
    lay = detect_paged(cache)["full_attention"]
    blocks = list(group.allocator.block_table["r"])
    before = kvcore.gather(lay, request_slots(group, blocks, 7))
    staged = kvcore.gather_blocks(lay, blocks)
    snapshot = cache.cache_tensor.clone()
    group.view[blocks] = 0
    while cache.pool.count_free_blocks(group.allocator.index) < len(blocks):
        cache.pool.allocate_sector(group.allocator.index)
    new_blocks = cache.pool.get_free_blocks(group.allocator.index, len(blocks))
    assert not set(new_blocks) & set(blocks)
    kvcore.scatter_blocks(lay, new_blocks, staged)
    assert torch.equal(
        group.view[new_blocks].view(torch.uint8), snapshot.view(torch.bfloat16).view(group.view.shape)[blocks].view(torch.uint8)
    )
    after = kvcore.gather(lay, request_slots(group, new_blocks, 7))
    assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))
    k, _ = written[FULL_LAYERS[0]]
    assert torch.equal(after[0, 0], k.reshape(7, NH * HS))


def test_raw_buffer_needs_hints_and_then_matches_the_object():
    cache = _hybrid_cache()
    alloc = cache.cache_allocators["full_attention"]
    with pytest.raises(kvcore.DetectionError, match="num_kv_heads"):
        kvcore.detect(cache.cache_tensor, engine="transformers")
    hints = {"num_layers": len(FULL_LAYERS), "num_kv_heads": NH, "head_size": HS, "page_size": PS, "dtype": "float32"}
    raw = kvcore.detect(cache.cache_tensor, engine="transformers", hints=hints)
    obj = kvcore.detect(cache, engine="transformers", hints={"attention_type": "full_attention"})
    assert raw.stride_table().signature() == obj.stride_table().signature()
    assert alloc.bytes_per_block == raw.stride_table().planes[0].block
    with pytest.raises(kvcore.DetectionError, match="whole number of blocks"):
        kvcore.detect(cache.cache_tensor[:-4], engine="transformers", hints=hints)
    with pytest.raises(kvcore.DetectionError, match="unknown hint dtype .float64x."):
        kvcore.detect(cache.cache_tensor, engine="transformers", hints={**hints, "dtype": "float64x"})
