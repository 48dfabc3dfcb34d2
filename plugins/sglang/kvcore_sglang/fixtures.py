"""Allocation fixtures: SGLang's pools allocated exactly as SGLang's own code does.

Each ``alloc_*`` function repeats one SGLang allocation (shapes, strides, dtype, the
extra page, shared storage) without importing SGLang; :data:`CASES` wraps them as
:class:`kvcore.testing.FixtureCase` for the conformance suite, each with an oracle view
``kv_view`` built the way SGLang's attention code indexes the pool (``k_buffer[l][loc]``,
``kv_buffer[:, loc, l]`` for page_first host pools, ...), independently of kvcore.

Sources (SGLang's ``python/sglang/srt/mem_cache/``, wheels 0.5.3 and 0.5.23):

* 0.5.3 ``memory_pool.py::MHATokenToKVPool._create_buffers``: per layer
  ``torch.zeros((size + page_size, head_num, head_dim), dtype=store_dtype)`` for K and
  for V (``v_head_dim``), two separate lists.
* 0.5.23 ``memory_pool.py::MHATokenToKVPool._kv_buffer_shapes`` / ``_create_buffers_normal``:
  when K and V shapes match, one ``(2, padded_rows, H, D)`` buffer per layer with
  ``k_buffer[l] = buf[0, :rows]`` and ``v_buffer[l] = buf[1, :rows]``; HND
  (``SGLANG_USE_HND_KVCACHE``) ``(num_pages, H, page_size, D)`` per K/V, fused the same way.
* ``memory_pool.py::MLATokenToKVPool``: ``kv_buffer[l]`` ``(size + page_size, 1,
  kv_lora_rank + qk_rope_head_dim)``.
* 0.5.3 ``memory_pool.py::NSATokenToKVPool.__init__``: ``index_k_with_scale_buffer[l]``
  uint8 ``((size + page_size + 1) // page_size, page_size * (128 + 4))``.
* ``memory_pool_host.py`` (0.5.3) / ``pool_host/{mha,mla}.py`` (0.5.23)
  ``init_kv_buffer``: one tensor per host pool, dims per ``--hicache-mem-layout``;
  ``page_num = size // page_size``.
* fp8 KV is stored as ``torch.uint8`` (``store_dtype``, 0.5.3 ``memory_pool.py::KVCache``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcore import GeometryError
from kvcore.testing import FixtureCase
from kvcore_sglang.formats import HOST_FORMATS, INDEXER_FORMAT

__all__ = [
    "store_dtype",
    "alloc_mha_053",
    "alloc_mha_0523",
    "alloc_ascend",
    "alloc_mla",
    "alloc_indexer",
    "alloc_host_mha",
    "alloc_host_mla",
    "indexer_token_records",
    "alloc_indexer_dcp",
    "indexer_kernel_view",
    "indexer_segment_views",
    "CASES",
]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """SGLang's ``store_dtype``: fp8 KV is kept as ``torch.uint8``."""
    return torch.uint8 if dtype in _FP8 else dtype


def _hints_for(dtype: torch.dtype) -> dict[str, Any]:
    return {"kv_cache_dtype": dtype} if dtype in _FP8 else {}


def alloc_mha_053(
    num_layers: int,
    size: int,
    page_size: int,
    head_num: int,
    head_dim: int,
    dtype=torch.bfloat16,
    device="cpu",
    v_head_dim: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGLang 0.5.3 ``MHATokenToKVPool``: ``(k_buffer, v_buffer)``, separate tensors."""
    rows, st = size + page_size, store_dtype(dtype)
    k = [torch.zeros((rows, head_num, head_dim), dtype=st, device=device) for _ in range(num_layers)]
    v = [torch.zeros((rows, head_num, v_head_dim or head_dim), dtype=st, device=device) for _ in range(num_layers)]
    return k, v


def alloc_mha_0523(
    num_layers: int,
    size: int,
    page_size: int,
    head_num: int,
    head_dim: int,
    dtype=torch.bfloat16,
    device="cpu",
    layout: str = "NHD",
    padded_rows: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGLang 0.5.23 ``MHATokenToKVPool``: K and V are the two halves of one buffer per
    layer. NHD: ``buf (2, padded_rows, H, D)``, ``k = buf[0, :rows]``, ``v = buf[1, :rows]``
    (``padded_rows`` defaults to ``rows = size + page_size``); HND: ``buf (2, num_pages,
    H, page_size, D)``, ``k = buf[0]``, ``v = buf[1]``."""
    rows, st = size + page_size, store_dtype(dtype)
    k, v = [], []
    for _ in range(num_layers):
        if layout == "HND":
            buf = torch.zeros((2, rows // page_size, head_num, page_size, head_dim), dtype=st, device=device)
            k.append(buf[0])
            v.append(buf[1])
        else:
            buf = torch.zeros((2, padded_rows or rows, head_num, head_dim), dtype=st, device=device)
            k.append(buf[0, :rows])
            v.append(buf[1, :rows])
    return k, v


def alloc_ascend(
    num_layers: int, size: int, page_size: int, head_num: int, head_dim: int, dtype=torch.bfloat16, device="cpu"
) -> torch.Tensor:
    """SGLang 0.5.3 ``AscendTokenToKVPool``: one tensor ``(2, layer_num, size // page_size + 1,
    page_size, head_num, head_dim)``; ``k_buffer = kv_buffer[0]``, ``v_buffer = kv_buffer[1]``."""
    return torch.zeros((2, num_layers, size // page_size + 1, page_size, head_num, head_dim), dtype=store_dtype(dtype), device=device)


def alloc_mla(
    num_layers: int, size: int, page_size: int, kv_cache_dim: int = 576, dtype=torch.bfloat16, device="cpu"
) -> list[torch.Tensor]:
    """SGLang ``MLATokenToKVPool.kv_buffer``: per layer ``(size + page_size, 1, kv_cache_dim)``."""
    return [torch.zeros((size + page_size, 1, kv_cache_dim), dtype=store_dtype(dtype), device=device) for _ in range(num_layers)]


def alloc_indexer(num_layers: int, size: int, page_size: int = 64, device="cpu", index_head_dim: int = 128) -> list[torch.Tensor]:
    """SGLang 0.5.3 ``NSATokenToKVPool.index_k_with_scale_buffer``: per layer uint8
    ``((size + page_size + 1) // page_size, page_size * (index_head_dim + index_head_dim // 128 * 4))``."""
    width = page_size * (index_head_dim + index_head_dim // 128 * 4)
    return [torch.zeros(((size + page_size + 1) // page_size, width), dtype=torch.uint8, device=device) for _ in range(num_layers)]


def alloc_indexer_dcp(num_layers: int, num_pages: int, page_size: int, attn_dcp_size: int, device="cpu") -> list[torch.Tensor]:
    """SGLang 0.5.23 ``IndexKeyCache.buffer`` of a ``DSATokenToKVPool(dcp_replicated=True)``
    with ``index_kpool`` 1: per layer uint8 ``(num_pages, page_size * 132)``
    (``_buffer_shape``); SGLang addresses it through :func:`indexer_kernel_view` with
    ``index_page_size = page_size // attn_dcp_size``."""
    if page_size % attn_dcp_size:
        raise GeometryError(f"page_size {page_size} is not a multiple of attn_dcp_size {attn_dcp_size}")
    return [torch.zeros((num_pages, page_size * 132), dtype=torch.uint8, device=device) for _ in range(num_layers)]


def indexer_kernel_view(buf: torch.Tensor, kernel_pages_per_row: int) -> torch.Tensor:
    """SGLang 0.5.23 ``IndexKeyCache._kernel_view``: ``buffer.view(-1, row // kernel_pages_per_row)``;
    kernel page ``loc // index_page_size`` holds token ``loc % index_page_size``'s key
    bytes in its first ``index_page_size * 128`` bytes, its scale after them (``move``)."""
    return buf.view(-1, buf.shape[1] // kernel_pages_per_row)


def indexer_token_records(buf: torch.Tensor, page_size: int, index_head_dim: int = 128) -> torch.Tensor:
    """The engine-side reading of an indexer buffer: ``[num_pages, page_size, 132]`` bytes,
    token ``t`` of page ``p`` = ``buf[p, t*128:(t+1)*128]`` (fp8 key) followed by
    ``buf[p, page_size*128 + t*4 : ... + 4]`` (fp32 scale), as SGLang's
    ``index_buf_accessor`` / the comment in ``NSATokenToKVPool.__init__`` reads it.
    A copy (the two parts live in different regions of the page)."""
    vals = buf[:, : page_size * index_head_dim].reshape(buf.shape[0], page_size, index_head_dim)
    scales = buf[:, page_size * index_head_dim :].reshape(buf.shape[0], page_size, -1)
    return torch.cat([vals, scales], dim=-1)


def indexer_segment_views(buf: torch.Tensor, page_size: int, index_head_dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer buffer's two per-token regions as **views** ``([NP, BS, 1, 128] keys,
    [NP, BS, 1, 4] scale bytes)``: concatenated on the last axis they are a staged row.
    (For an oracle that accepts a row made of several views; writes go to the cache.)"""
    vals = buf[:, : page_size * index_head_dim].unflatten(1, (page_size, 1, index_head_dim))
    scales = buf[:, page_size * index_head_dim :].unflatten(1, (page_size, 1, -1))
    return vals, scales


def alloc_host_mha(
    mem_layout: str, num_layers: int, size: int, page_size: int, head_num: int, head_dim: int, dtype=torch.bfloat16, device="cpu"
) -> torch.Tensor:
    """SGLang ``MHATokenToKVPoolHost.init_kv_buffer``: one tensor, dims by ``mem_layout``
    (``size`` host token slots, ``page_num = size // page_size``)."""
    pages = size // page_size
    dims = {
        "layer_first": (2, num_layers, size, head_num, head_dim),
        "page_first": (2, size, num_layers, head_num, head_dim),
        "page_first_direct": (2, pages, num_layers, page_size, head_num, head_dim),
        "page_head": (2, pages, head_num, page_size, num_layers, head_dim),
    }[mem_layout]
    return torch.zeros(dims, dtype=store_dtype(dtype), device=device)


def alloc_host_mla(
    mem_layout: str, num_layers: int, size: int, page_size: int, kv_cache_dim: int = 576, dtype=torch.bfloat16, device="cpu"
) -> torch.Tensor:
    """SGLang ``MLATokenToKVPoolHost.init_kv_buffer``: one tensor, dims by ``mem_layout``."""
    pages = size // page_size
    dims = {
        "layer_first": (num_layers, size, 1, kv_cache_dim),
        "page_first": (size, num_layers, 1, kv_cache_dim),
        "page_first_direct": (pages, num_layers, page_size, 1, kv_cache_dim),
    }[mem_layout]
    return torch.zeros(dims, dtype=store_dtype(dtype), device=device)


# -- oracle views (SGLang-side indexing), shape [NB, BS, NH, HS] or [PBS, 1, NH, HS] ------------


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype != dtype else t


def host_kv_view(buf: torch.Tensor, mem_layout: str, layer: int, kv: int, mla: bool = False) -> torch.Tensor:
    """One layer's K (kv=0) or V (kv=1) plane of a host pool, SGLang-indexed:
    ``[PBS, 1, NH, HS]`` (layer_first / page_first) or ``[NB, BS, NH, HS]``."""
    if mla:
        if kv != 0:
            raise IndexError("an MLA host pool has one latent plane (kv=0)")
        if mem_layout == "layer_first":
            return buf[layer].unsqueeze(1)
        if mem_layout == "page_first":
            return buf[:, layer].unsqueeze(1)
        return buf[:, layer]
    if mem_layout == "layer_first":
        return buf[kv, layer].unsqueeze(1)
    if mem_layout == "page_first":
        return buf[kv, :, layer].unsqueeze(1)
    if mem_layout == "page_first_direct":
        return buf[kv, :, layer]
    return buf[kv, :, :, :, layer].permute(0, 2, 1, 3)


# -- fixture cases -------------------------------------------------------------------------


def _geom(sizes: dict) -> tuple[int, int, int, int, int]:
    nl, nb, bs, nh, hs = (int(sizes[k]) for k in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"))
    return nl, nb, bs, nh, hs


def _mha_case(name: str, fmt: str, version: str, paged: bool, layout: str = "NHD", src: str = "", v_extra: int = 0) -> FixtureCase:
    """``v_extra``: V's head size is ``head_dim + v_extra`` (``v_head_dim``; 0.5.3 separate
    buffers, 0.5.23 HND page rows ``(num_pages, head_num, page_size, v_head_dim)``)."""

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, nh, hs = _geom(sizes)
        size = (nb - 1) * bs  # SGLang: size + page_size rows; slot 0's page is the padded page
        if v_extra and layout == "HND":
            st = store_dtype(dtype)
            k = [torch.zeros((nb, nh, bs, hs), dtype=st, device=device) for _ in range(nl)]
            v = [torch.zeros((nb, nh, bs, hs + v_extra), dtype=st, device=device) for _ in range(nl)]
        elif version == "0.5.3":
            k, v = alloc_mha_053(nl, size, bs, nh, hs, dtype, device, v_head_dim=hs + v_extra if v_extra else None)
        else:
            k, v = alloc_mha_0523(nl, size, bs, nh, hs, dtype, device, layout=layout)
        hints = {**_hints_for(dtype), "sglang_version": version}
        if nl == 2 and version == "0.5.3":
            # [k_buffer, v_buffer] of 2 separate layers reads as 2 (k, v) pairs too
            hints["kv_list_layout"] = "nested"
        if paged:
            hints["page_size"] = bs
        if layout == "HND":
            hints["layout"] = "HND"
        if v_extra:
            hints["v_head_size"] = hs + v_extra
        return [k, v], hints

    def kv_view(kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
        t = kv_caches[kv][layer]
        if layout == "HND":
            return t.permute(0, 2, 1, 3)
        if paged:
            return t.unflatten(0, (-1, _page_of(kv_caches)))
        return t.unsqueeze(1)

    return _case(name, fmt, make, kv_view, {"block_size": 4 if paged else 1}, src)


class FixturePool(list):
    """The list a fixture's ``make`` returns: SGLang's own list, plus the page size and
    element dtype the oracle view needs (a plain ``list`` subclass: kvcore sees a list)."""

    page_size: int = 1
    dtype: torch.dtype | None = None


def _tag(caches: Any, page_size: int, dtype: torch.dtype) -> Any:
    if isinstance(caches, list):
        caches = FixturePool(caches)
    caches.page_size = page_size  # tensors and FixturePool both take attributes
    caches.dtype_ = dtype
    return caches


def _page_of(kv_caches: Any) -> int:
    return int(kv_caches.page_size)


def _case(name: str, fmt: str, make: Callable, kv_view: Callable, over: dict, src: str, **kw: Any) -> FixtureCase:
    sizes = {"num_layers": 3, "num_blocks": 6, "block_size": 1, "num_heads": 2, "head_size": 8, **over}

    def make_tagged(sz: dict, dtype: torch.dtype, device: Any):
        caches, hints = make(sz, dtype, device)
        return _tag(caches, int(sz["block_size"]), dtype), hints

    def view_typed(kv_caches: Any, layer: int, kv: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        v = kv_view(kv_caches, layer, kv)
        if isinstance(v, tuple):  # segment views (indexer records): each in the element dtype
            return tuple(_as(p, kv_caches.dtype_) for p in v)
        return _as(v, kv_caches.dtype_)

    return FixtureCase(name=name, engine="sglang", format=fmt, make=make_tagged, kv_view=view_typed, sizes=sizes, source=src, **kw)


def _mla_case(name: str, fmt: str, paged: bool) -> FixtureCase:
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, _, hs = _geom(sizes)
        kv = alloc_mla(nl, (nb - 1) * bs, bs, hs, dtype, device)
        hints = {**_hints_for(dtype), "is_mla": True}
        if paged:
            hints["page_size"] = bs
        return kv, hints

    def kv_view(kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
        t = kv_caches[layer]
        return t.unflatten(0, (-1, _page_of(kv_caches))) if paged else t.unsqueeze(1)

    return _case(
        name,
        fmt,
        make,
        kv_view,
        {"num_heads": 1, "head_size": 72, "block_size": 4 if paged else 1},
        "sglang memory_pool.py::MLATokenToKVPool",
    )


def _host_case(mem: str, mla: bool) -> FixtureCase:
    fmt = HOST_FORMATS[mem][1 if mla else 0]
    direct = mem in ("page_first_direct", "page_head")

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, nh, hs = _geom(sizes)
        if mla:
            buf = alloc_host_mla(mem, nl, nb * bs, bs, hs, dtype, device)
        else:
            buf = alloc_host_mha(mem, nl, nb * bs, bs, nh, hs, dtype, device)
        hints = {**_hints_for(dtype), "mem_layout": mem, "is_mla": mla}
        return buf, hints

    def kv_view(buf: Any, layer: int, kv: int) -> torch.Tensor:
        return host_kv_view(buf, mem, layer, kv, mla)

    over: dict[str, int] = {"block_size": 4 if direct else 1, "num_blocks": 5 if direct else 20}
    if mla:
        over.update(num_heads=1, head_size=72)
    src = (
        "sglang pool_host/mla.py::MLATokenToKVPoolHost.init_kv_buffer"
        if mla
        else "sglang pool_host/mha.py::MHATokenToKVPoolHost.init_kv_buffer"
    )
    return _case(f"sglang-host-{'mla' if mla else 'mha'}-{mem}", fmt, make, kv_view, over, src)


def _ascend_case() -> FixtureCase:
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, nh, hs = _geom(sizes)
        return alloc_ascend(nl, (nb - 1) * bs, bs, nh, hs, dtype, device), {**_hints_for(dtype), "layout": "ascend"}

    def kv_view(buf: Any, layer: int, kv: int) -> torch.Tensor:
        return buf[kv, layer]  # k_buffer = kv_buffer[0]: (NL, pages, page_size, NH, HS)

    return _case(
        "sglang-0.5.3-ascend", "TWO_NL_NB_BS_NH_HS", make, kv_view, {"block_size": 4}, "sglang 0.5.3 memory_pool.py::AscendTokenToKVPool"
    )


def _indexer_fixture(name: str, make: Any, kv_view: Any, num_blocks: int, source: str) -> FixtureCase:
    """A DSA indexer pool case: uint8 pages, one head of 132 bytes (index_head_dim 128 fp8 + one fp32
    scale); SGLang's page count (size + page_size + 1) // page_size is num_blocks only for
    page_size >= 2."""
    return _case(
        name,
        INDEXER_FORMAT,
        make,
        kv_view,
        {"num_layers": 2, "num_blocks": num_blocks, "block_size": 64, "num_heads": 1, "head_size": 132},
        source,
        dtypes=(torch.uint8,),
        size_constraints={"fixed": ("num_heads", "head_size"), "block_size_choices": (2, 4, 8, 64)},
    )


def _indexer_case() -> FixtureCase:
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, _, _ = _geom(sizes)
        return alloc_indexer(nl, (nb - 1) * bs, bs, device), {"page_size": bs, "sglang_version": "0.5.3"}

    def kv_view(kv_caches: Any, layer: int, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        # a token's 128 key bytes and 4 scale bytes live in two regions of the page: the oracle
        # is the pair of segment views (keys [NP, BS, 1, 128], scales [NP, BS, 1, 4])
        return indexer_segment_views(kv_caches[layer], _page_of(kv_caches))

    return _indexer_fixture("sglang-0.5.3-dsa-indexer", make, kv_view, 3, "sglang 0.5.3 memory_pool.py::NSATokenToKVPool.__init__")


def _indexer_dcp_case() -> FixtureCase:
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, _, _ = _geom(sizes)
        if nb % 2:
            raise GeometryError("a dcp 2 indexer pool has 2 kernel pages per buffer row: num_blocks is even")
        bufs = alloc_indexer_dcp(nl, nb // 2, 2 * bs, attn_dcp_size=2, device=device)
        return bufs, {"page_size": 2 * bs, "attn_dcp_size": 2, "dcp_replicated": True}

    def kv_view(kv_caches: Any, layer: int, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        return indexer_segment_views(indexer_kernel_view(kv_caches[layer], 2), _page_of(kv_caches))

    return _indexer_fixture(
        "sglang-0.5.23-dsa-indexer-dcp2",
        make,
        kv_view,
        4,
        "sglang 0.5.23 memory_pool.py::DSATokenToKVPool.__init__ (dcp_replicated), index_key_cache.py::IndexKeyCache",
    )


def _flat_kv_case() -> FixtureCase:
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, nh, hs = _geom(sizes)
        k, v = alloc_mha_053(nl, (nb - 1) * bs, bs, nh, hs, dtype, device)
        return k + v, {**_hints_for(dtype), "kv_list_layout": "k_v", "page_size": bs}

    def kv_view(kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
        nl = len(kv_caches) // 2
        return kv_caches[kv * nl + layer].unflatten(0, (-1, _page_of(kv_caches)))

    return _case(
        "sglang-mp-k_v-flat", "TWO_X_NL_X_NB_BS_NH_HS", make, kv_view, {"block_size": 4}, "LMCache MP path over sglang 0.5.3 pools"
    )


def _unified_case(mla: bool) -> FixtureCase:
    """LMCache's unified connector views (``_to_wire_block_tensor``) over SGLang 0.5.3 pools:
    ``[*k_buffer, *v_buffer]`` each ``.view(NB, page_size, NH, HS)``, or MLA ``kv_buffer``
    each ``.view(NB, page_size, D)``; the oracle is SGLang's own buffer addressed by token
    slot (``set_kv_buffer``: ``buffer[loc]``), unflattened by page."""

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        nl, nb, bs, nh, hs = _geom(sizes)
        if mla:
            bufs = alloc_mla(nl, (nb - 1) * bs, bs, hs, dtype, device)
            views = [b.view(nb, bs, -1) for b in bufs]
        else:
            # nl components: the K buffers then the V buffers of (nl + 1) // 2 layers (an odd count leaves out the
            # last V: the suite's random geometries draw any count)
            k, v = alloc_mha_053((nl + 1) // 2, (nb - 1) * bs, bs, nh, hs, dtype, device)
            views = [b.view(nb, bs, *b.shape[1:]) for b in [*k, *v]][:nl]
        return views, {**_hints_for(dtype), "kv_list_layout": "unified"}

    def kv_view(kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
        t = kv_caches[layer]
        rows = t.reshape(-1, *(t.shape[2:] if not mla else (1, t.shape[-1])))  # SGLang's buffer, one row per token slot
        return rows.unflatten(0, (t.shape[0], t.shape[1]))

    return _case(
        f"sglang-unified-{'mla' if mla else 'mha'}",
        "NL_X_NB_BS_HS" if mla else "NL_X_NB_BS_NH_HS",
        make,
        kv_view,
        {"block_size": 4, "num_layers": 4, **({"num_heads": 1} if mla else {})},
        f"sglang 0.5.3 memory_pool.py pools viewed by {UNIFIED_VIEW_SOURCE}",
    )


UNIFIED_VIEW_SOURCE = "LMCache 0.5.6 lmcache/integration/sglang/unified_lmcache_mp_connector.py::_to_wire_block_tensor"


CASES: list[FixtureCase] = [
    _mha_case(
        "sglang-0.5.3-mha-nhd", "TWO_X_NL_X_NBBS_NH_HS", "0.5.3", False, src="sglang 0.5.3 memory_pool.py::MHATokenToKVPool._create_buffers"
    ),
    _mha_case(
        "sglang-0.5.3-mha-nhd-paged",
        "TWO_X_NL_X_NB_BS_NH_HS",
        "0.5.3",
        True,
        src="sglang 0.5.3 memory_pool.py::MHATokenToKVPool._create_buffers",
    ),
    _mha_case(
        "sglang-0.5.23-mha-nhd-fused", "TWO_X_NL_X_NBBS_NH_HS", "0.5.23", False, src="sglang 0.5.23 memory_pool.py::_create_buffers_normal"
    ),
    _mha_case(
        "sglang-0.5.23-mha-nhd-fused-paged",
        "TWO_X_NL_X_NB_BS_NH_HS",
        "0.5.23",
        True,
        src="sglang 0.5.23 memory_pool.py::_create_buffers_normal",
    ),
    _mha_case(
        "sglang-0.5.23-mha-hnd",
        "TWO_X_NL_X_NB_NH_BS_HS",
        "0.5.23",
        True,
        "HND",
        src="sglang 0.5.23 memory_pool.py::_kv_buffer_shapes (use_hnd)",
    ),
    *[
        _mha_case(
            f"sglang-{ver}-mha-v_head_dim-{what}",
            f"K=NL_X_{t}+V=NL_X_{t}",
            ver,
            paged,
            lay,
            src=f"sglang {ver} memory_pool.py::MHATokenToKVPool (v_head_dim != head_dim)",
            v_extra=8,
        )
        for ver, what, t, paged, lay in (
            ("0.5.3", "nhd", "NBBS_NH_HS", False, "NHD"),
            ("0.5.3", "nhd-paged", "NB_BS_NH_HS", True, "NHD"),
            ("0.5.23", "hnd", "NB_NH_BS_HS", True, "HND"),
        )
    ],
    _mla_case("sglang-mla", "NL_X_NBBS_ONE_HS", False),
    _mla_case("sglang-mla-paged", "NL_X_NB_BS_ONE_HS", True),
    _ascend_case(),
    _indexer_case(),
    _indexer_dcp_case(),
    _flat_kv_case(),
    _unified_case(False),
    _unified_case(True),
    *[_host_case(m, False) for m in ("layer_first", "page_first", "page_first_direct", "page_head")],
    *[_host_case(m, True) for m in ("layer_first", "page_first", "page_first_direct")],
]


def fill_random(view: torch.Tensor, seed: int) -> None:
    """Write seeded random bytes through ``view`` (an engine-side view of the cache; its
    last axis must be contiguous). Random bytes tell every (layer, K/V, slot, head,
    element) apart with overwhelming probability, NaN and -0 patterns included."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = view.view(torch.uint8)
    b.copy_(torch.randint(0, 256, tuple(b.shape), generator=g, dtype=torch.uint8).to(b.device))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in row-major order, as a flat uint8 copy (bit-exact comparisons)."""
    return t.contiguous().view(torch.uint8).reshape(-1).clone()
