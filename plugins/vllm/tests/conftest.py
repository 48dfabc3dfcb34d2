"""Helpers for the vLLM plugin tests: a value encoder and a semantic gather/scatter check.

Every element gets an integer bit pattern that encodes (layer, K/V, slot, head, element),
written through vLLM's own views (``kvcore_vllm.fixtures.kv_view``: unbind, split,
chunk... as the attention forward does), so a swapped K/V, a transposed head or a wrong
layer shows up as a wrong value, not only as a failed round trip.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.testing import TokenGroups

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_dtype(dtype: torch.dtype) -> torch.dtype:
    return INT_OF_SIZE[torch.empty(0, dtype=dtype).element_size()]


def encode(
    num_layers: int, kv_size: int, num_slots: int, num_heads: int, head_size: int, dtype: torch.dtype, salt: int = 0
) -> torch.Tensor:
    """int ``[NL, kv_size, slots, NH, HS]`` of ``int_dtype(dtype)``: a mixed hash of the index."""
    idt = int_dtype(dtype)
    bits = torch.iinfo(idt).bits
    idx = torch.arange(num_layers * kv_size * num_slots * num_heads * head_size, dtype=torch.int64)
    v = (idx * 2654435761 + 40503 * (idx >> 7) + 97 + salt * 7919) & ((1 << bits) - 1)
    if idt != torch.uint8:
        v = v - ((v >> (bits - 1)) << bits)
    return v.to(idt).view(num_layers, kv_size, num_slots, num_heads, head_size)


def engine_view(view_fn, kv_caches, layer: int, kv: int) -> torch.Tensor:
    """The engine's view of one plane; a :class:`kvcore.testing.TokenGroups` answer (a block's
    tokens in groups, ``[NB, BSC, BSE, NH, *elem]``) unwrapped: its rows still flatten
    row-major to ``[slot, NH, HS]``."""
    v = view_fn(kv_caches, layer, kv)
    return v.view if isinstance(v, TokenGroups) else v


def fill(kv_caches, view_fn, codes: torch.Tensor) -> None:
    """Write ``codes[layer, kv]`` through the engine view ``view_fn(kv_caches, layer, kv)``."""
    nl, kvs = codes.shape[:2]
    for layer in range(nl):
        for kv in range(kvs):
            v = engine_view(view_fn, kv_caches, layer, kv)
            iv = v.view(INT_OF_SIZE[v.element_size()])
            iv.copy_(codes[layer, kv].reshape(iv.shape))


def read(kv_caches, view_fn, nl: int, kvs: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    for layer in range(nl):
        for kv in range(kvs):
            v = engine_view(view_fn, kv_caches, layer, kv)
            out[layer, kv] = v.view(INT_OF_SIZE[v.element_size()]).reshape(out[layer, kv].shape)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def staged_expected(codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """codes ``[NL, kv, S, NH, HS]`` -> staging ``[kv, NL, T, NH*HS]`` (zeros at negative slots)."""
    nl, kvs, _, nh, hs = codes.shape
    t = slots.numel()
    out = torch.zeros((kvs, nl, t, nh * hs), dtype=codes.dtype)
    ok = slots >= 0
    out[:, :, ok] = codes[:, :, slots[ok]].permute(1, 0, 2, 3, 4).reshape(kvs, nl, int(ok.sum()), nh * hs)
    return out


def check_semantic(layout, kv_caches, view_fn, *, seed: int = 0) -> None:
    """Fill through the engine view, gather a random slot mapping with padding, compare
    exactly; then scatter fresh values to other slots and read them back through the
    engine view (semantic scatter), and gather them again (bit-exact round trip)."""
    g = torch.Generator().manual_seed(seed)
    nl, kvs, nh, hs = layout.num_layers, layout.kv_size, layout.num_heads, layout.head_size
    s = layout.page_buffer_size
    probe = engine_view(view_fn, kv_caches, 0, 0)
    codes = encode(nl, kvs, s, nh, hs * layout.element_size // probe.element_size(), probe.dtype, salt=seed)
    fill(kv_caches, view_fn, codes)
    perm = torch.randperm(s, generator=g)
    t = min(s // 2, 11)
    slots = perm[:t].clone()
    slots[1] = -1
    staged = kvcore.gather(layout, slots)
    assert staged.shape == (kvs, nl, t, nh * hs)
    assert staged.dtype == layout.dtype
    assert torch.equal(as_bytes(staged), as_bytes(staged_expected(codes, slots)))
    # scatter other values to other slots, read through the engine's own view
    dst = perm[t : 2 * t].clone()
    src_codes = encode(nl, kvs, s, nh, codes.shape[-1], probe.dtype, salt=seed + 1)
    src = staged_expected(src_codes, torch.arange(t)).contiguous().view(torch.uint8).view(layout.dtype)
    src = src.view(kvs, nl, t, nh * hs)
    kvcore.scatter(layout, dst, src)
    after = read(kv_caches, view_fn, nl, kvs, codes)
    want = codes.clone()
    want[:, :, dst] = src_codes[:, :, :t]
    assert torch.equal(after, want), "scatter wrote other bytes than the engine's view expects"
    back = kvcore.gather(layout, dst)
    assert torch.equal(as_bytes(back), as_bytes(src))


@pytest.fixture
def semantic():
    return check_semantic
