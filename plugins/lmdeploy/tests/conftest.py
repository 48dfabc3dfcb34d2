"""Helpers for the LMDeploy plugin tests: byte-exact comparisons against LMDeploy's own
addressing (the ``engine_side`` fixture).

``rows(view, layer, plane, slots, block)`` reads, through an engine-side oracle view
(:mod:`kvcore_lmdeploy.fixtures`: ``[NB, BS, NH, *elem]`` as LMDeploy's kernels index the
tensors), the rows of ``slots`` (``block`` tokens per allocated block), flattened to
``[T, NH * W]`` and reinterpreted as bytes. Nothing here asks kvcore how the cache is laid
out: the views index LMDeploy's tensors the way ``fill_kv_cache`` / ``paged_attention_fwd``
(and, for Ascend 310P, ``nd_to_nz_spec``) do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import kvcore


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(*t.shape[:-1], -1).view(torch.uint8) if t.numel() else t.view(torch.uint8)


def rows(view: Callable[..., torch.Tensor], layer: int, plane: int, slots: Sequence[int], block: int) -> torch.Tensor:
    """``[T, NH * W]`` bytes of ``slots`` read through the oracle ``view(layer, plane)``."""
    v = view(layer, plane)
    out = [v[s // block, s % block].reshape(-1) for s in slots]
    return as_bytes(torch.stack(out))


def fill_random(tensors: Sequence[torch.Tensor], seed: int) -> None:
    """Every byte of ``tensors`` random (shared storages are filled once per view, fine)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        if t.numel():
            b = t.view(torch.uint8) if t.dim() else t
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def staged_rows(layout: kvcore.KVLayout, staged: Any, plane: int, role: str, layer: int) -> torch.Tensor:
    """One layer's staged rows of one plane, as bytes ``[T, row bytes]``."""
    if isinstance(staged, dict):
        return as_bytes(staged[role][layer])
    return as_bytes(staged[plane, layer])


def check_gather_scatter(
    layout: kvcore.KVLayout,
    dst_layout: kvcore.KVLayout,
    src_view: Callable[..., torch.Tensor],
    dst_view: Callable[..., torch.Tensor],
    roles: Sequence[str],
    block: int,
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
    dst_tensors: Sequence[torch.Tensor],
) -> None:
    """Gather ``src_slots`` from ``layout`` and check every plane's staged rows are the bytes
    LMDeploy's kernels address there; scatter them into ``dst_slots`` of ``dst_layout``
    (whose ``dst_tensors`` start zeroed) and check the destination reads the same bytes
    there and nothing else changed."""
    staged = kvcore.gather(layout, torch.tensor(list(src_slots)))
    for p, role in enumerate(roles):
        for layer in range(layout.num_layers):
            want = rows(src_view, layer, p, src_slots, block)
            got = staged_rows(layout, staged, p, role, layer)
            assert torch.equal(got, want), f"gather: plane {role}, layer {layer}"
    before = sum(int(t.view(torch.uint8).count_nonzero()) for t in dst_tensors if t.numel())
    assert before == 0
    kvcore.scatter(dst_layout, torch.tensor(list(dst_slots)), staged)
    written = 0
    for p, role in enumerate(roles):
        for layer in range(layout.num_layers):
            want = rows(src_view, layer, p, src_slots, block)
            got = rows(dst_view, layer, p, dst_slots, block)
            assert torch.equal(got, want), f"scatter: plane {role}, layer {layer}"
            written += int(got.count_nonzero())
    after = sum(int(t.view(torch.uint8).count_nonzero()) for t in dst_tensors if t.numel())
    assert after == written, "scatter wrote outside the requested slots"


@pytest.fixture
def engine_side():
    """The helpers above, as a namespace (``engine_side.rows(...)``, ...)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        as_bytes=as_bytes, rows=rows, fill_random=fill_random, staged_rows=staged_rows, check_gather_scatter=check_gather_scatter
    )
