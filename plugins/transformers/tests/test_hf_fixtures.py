"""Detection, geometry and semantic gather/scatter for every transformers fixture.

The oracle: random bytes written through the engine's own view (``kv_view``: the cache's
``layers[i].keys`` / ``key_cache[i]`` / transformers' page views), then kvcore's gather
must put the bytes of (layer, K/V, slot, head, element) at ``staging[kv, layer, slot,
head * HS + element]`` — a swapped K/V, transposed heads or a wrong slot order fails.
"""

from __future__ import annotations

import pytest
import torch
from kvcore_transformers import kv_caches
from kvcore_transformers.fixtures import OBJECT_BUILDERS, fixture_cases, make_paged_object

import kvcore

CASES = {c.name: c for c in fixture_cases()}
DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8]


def _fill(case, kvc, hints, layout, seed):
    """Random bytes through the engine view; returns {(layer, kv): [NB*BS, NH*HS] expected rows}."""
    g = torch.Generator().manual_seed(seed)
    want = {}
    for layer in range(layout.num_layers):
        for kv in range(2):
            view = case.view(kvc, layer, kv, hints)  # [NB, BS, NH, HS]
            raw = torch.randint(0, 256, (*view.shape[:-1], view.shape[-1] * view.element_size()), dtype=torch.uint8, generator=g)
            view.copy_(raw.view(view.dtype))
            want[(layer, kv)] = raw.reshape(view.shape[0] * view.shape[1], -1)
    return want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_detect_geometry_and_semantic_gather(name, dtype):
    case = CASES[name]
    kvc, hints = case.make(dict(case.sizes), dtype, "cpu")
    layout = kvcore.detect(kvc, engine="transformers", hints=hints)
    s = case.sizes
    assert layout.format.name == case.format
    assert (layout.num_layers, layout.num_blocks, layout.block_size, layout.num_heads, layout.head_size) == (
        s["num_layers"],
        s["num_blocks"],
        s["block_size"],
        s["num_heads"],
        s["head_size"],
    )
    assert layout.kv_size == 2 and layout.dtype == dtype
    assert layout.hidden_dim == s["num_heads"] * s["head_size"]
    want = _fill(case, kvc, hints, layout, seed=len(name))
    # every slot, in a scrambled order, plus padding slots that must be skipped
    n = layout.page_buffer_size
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    slots = torch.cat([perm, torch.tensor([-1, -1])])
    out = torch.full(layout.staging_shape(n + 2), 0, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else None
    staged = kvcore.gather(layout, slots, out)
    for (layer, kv), rows in want.items():
        got = staged[kv, layer, :n].view(torch.uint8)
        assert torch.equal(got, rows[perm]), f"layer {layer} {'KV'[kv]}: gathered bytes differ from the engine's"
    # scatter the first half's rows into the second half's slots: the engine view must show them
    half = n // 2
    src = kvcore.gather(layout, torch.arange(half))
    dst = torch.arange(n - half, n)
    kvcore.scatter(layout, dst, src)
    for (layer, kv), rows in want.items():
        view = case.view(kvc, layer, kv, hints)
        now = view.reshape(n, -1).view(torch.uint8)
        assert torch.equal(now[n - half :], rows[:half])
        assert torch.equal(now[: n - half], rows[: n - half]), "scatter wrote outside its slots"


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_object_and_its_tensors_agree(name):
    """kvcore.detect(cache object) and kvcore.detect(the fixture's tensors) address the same bytes."""
    case = CASES[name]
    sizes = dict(case.sizes)
    if name in OBJECT_BUILDERS:
        obj = OBJECT_BUILDERS[name](sizes, torch.float16, "cpu")
        tensors, hints = kv_caches(obj), {}
    else:
        obj = make_paged_object(sizes, torch.float16)
        tensors = obj.cache_tensor
        hints = {"num_layers": sizes["num_layers"], "num_kv_heads": sizes["num_heads"], "head_size": sizes["head_size"]}
        hints.update(page_size=sizes["block_size"], dtype=torch.float16)
    a = kvcore.detect(obj, engine="transformers")
    b = kvcore.detect(tensors, engine="transformers", hints=hints)
    assert a.format.name == b.format.name == case.format
    assert a.stride_table().signature() == b.stride_table().signature()


def test_legacy_prefill_is_a_strided_view_read_without_copy():
    """4.53 keeps the attention's transposed key_states: head stride HS, token stride NH*HS."""
    case = CASES["transformers-4.53-DynamicCache-prefill"]
    kvc = OBJECT_BUILDERS[case.name](dict(case.sizes), torch.bfloat16, "cpu")
    k = kvc.key_cache[0]
    assert not k.is_contiguous()
    layout = kvcore.detect(kvc, engine="transformers")
    plane = layout.stride_table().planes[0]
    nh, hs = case.sizes["num_heads"], case.sizes["head_size"]
    assert (plane.head, plane.token) == (hs * 2, nh * hs * 2)
    assert layout.stride_table().bases[0][0][0].data_ptr() == k.data_ptr()


def test_sliding_window_keeps_a_view_with_a_wider_block_stride():
    case = CASES["transformers-5.24-DynamicSlidingWindowLayer"]
    kvc, _ = case.make(dict(case.sizes), torch.float32, "cpu")
    layout = kvcore.detect(kvc, engine="transformers")
    s = case.sizes
    full = s["block_size"] + 3  # the fixture fed window + 2 tokens; the layer keeps window - 1 = block_size
    assert layout.stride_table().planes[0].block == s["num_heads"] * full * s["head_size"] * 4
