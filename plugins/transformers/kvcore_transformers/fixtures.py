"""Allocation fixtures (``kvcore.testing.FixtureCase``) for every cache kind this plugin reads.

Each ``make`` builds the cache with transformers' own classes where the installed
version has them (5.24: ``DynamicCache``, ``DynamicSlidingWindowLayer``, ``StaticCache``,
``FullAttentionCacheAllocator``), so shapes *and* strides are the engine's. The 4.53 API
generation cannot be installed beside 5.x, so its two cases rebuild 4.53.3's storage
rules exactly (``cache_utils.py::DynamicCache.update``: the first update stores the
attention's ``key_states`` as they come — a ``transpose(1, 2)`` view, not a copy — and
later ones ``torch.cat(dim=-2)``; ``StaticCache.__init__``: ``torch.zeros((max_batch_size,
NH, max_cache_len, head_dim))`` per layer) in a class with 4.53's attribute names.

Geometry keys: ``num_layers``, ``num_blocks`` (batch for dynamic/static caches; blocks of
the whole tensor, trash sectors included, for the paged cache), ``block_size`` (sequence
length / ``page_size``), ``num_heads`` (KV heads), ``head_size``.

``make`` returns what ``kvcore.detect`` reads for the suite: the cache's own tensors as
per-layer ``(K, V)`` pairs (``kvcore_transformers.kv_caches(cache)``), and the paged
cache's raw ``cache_tensor`` with the hints giving its geometry. (Detecting the objects
themselves is tested in ``tests/``, with :data:`OBJECT_BUILDERS`.)

``kv_view`` (the oracle) reads the engine's own tensors, never kvcore's stride table: the
layer's ``keys`` / ``values`` (``key_cache[i]`` in 4.53) transposed to ``[batch, seq, NH,
HS]``; for the paged cache, the page views ``full_attention.py::register_cache_tensor``
builds (``_kv_page_views``; page ``2 * NL * b`` is block ``b``), rebuilt from the bytes and
checked against the allocator's own at ``make`` time.
"""

from __future__ import annotations

from math import lcm
from types import SimpleNamespace
from typing import Any

import torch

from kvcore import GeometryError
from kvcore.testing import FixtureCase

from .caches import LAYER_PAIRS_FORMAT, LAYER_PAIRS_NHD_FORMAT, PAGED_FORMAT, layer_pairs
from .writers import LEGACY_NO_WRITER, EnginePairs, dynamic_writer, paged_writer, register_allocator, sliding_writer, static_writer

__all__ = ["fixture_cases", "Legacy453DynamicCache", "Legacy453StaticCache", "make_paged_cache", "make_paged_object", "OBJECT_BUILDERS"]

_DEFAULT = {"num_layers": 3, "num_blocks": 2, "block_size": 7, "num_heads": 2, "head_size": 8}
_PAGED_DEFAULT = {"num_layers": 3, "num_blocks": 6, "block_size": 4, "num_heads": 2, "head_size": 8}


def _states(sizes: dict, dtype: torch.dtype, device: Any, seq: int, seed: int) -> torch.Tensor:
    """Attention's key/value states: ``proj(x).view(B, S, NH, HS).transpose(1, 2)`` (a view)."""
    b, nh, hs = sizes["num_blocks"], sizes["num_heads"], sizes["head_size"]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (b, seq, nh, hs * torch.empty(0, dtype=dtype).element_size()), dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(device).transpose(1, 2)


# -- transformers >= 4.54 (5.24 classes) ------------------------------------------------


def _make_dynamic_object(sizes, dtype, device):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(sizes["num_layers"]):
        cache.update(
            _states(sizes, dtype, device, sizes["block_size"], 2 * i), _states(sizes, dtype, device, sizes["block_size"], 2 * i + 1), i
        )
    return cache


def _make_sliding_object(sizes, dtype, device):
    """All-sliding DynamicCache fed more tokens than the window: each layer keeps the view
    ``full[:, :, -sliding_window + 1:, :]`` (5.24 ``DynamicSlidingWindowLayer.update``)."""
    from transformers import DynamicCache

    window = sizes["block_size"] + 1
    seq = sizes["block_size"] + 3
    data = []
    for i in range(sizes["num_layers"]):
        data.append((_states(sizes, dtype, device, seq, 2 * i), _states(sizes, dtype, device, seq, 2 * i + 1), torch.tensor(window)))
    return DynamicCache(ddp_cache_data=data)


def _make_static_object(sizes, dtype, device):
    from transformers import LlamaConfig, StaticCache

    cfg = LlamaConfig(
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"],
        num_key_value_heads=sizes["num_heads"],
        head_dim=sizes["head_size"],
        hidden_size=sizes["num_heads"] * sizes["head_size"],
    )
    cache = StaticCache(config=cfg, max_cache_len=sizes["block_size"])
    for i in range(sizes["num_layers"]):  # a one-token prefill: lazy_initialization allocates the zeros
        layer = cache.layers[i]
        k, v = _states(sizes, dtype, device, 1, 2 * i), _states(sizes, dtype, device, 1, 2 * i + 1)
        layer.lazy_initialization(k, v)
        layer.keys[:, :, :1] = k
        layer.values[:, :, :1] = v
    return cache


def _pairs(builder):
    """FixtureCase.make: the cache's own tensors as per-layer ``(K, V)`` pairs (what
    :func:`kvcore_transformers.kv_caches` returns; detecting the object itself gives the
    same layout, tested in ``tests/test_hf_fixtures.py``)."""

    def make(sizes, dtype, device):
        cache = builder(sizes, dtype, device)
        return EnginePairs(layer_pairs(cache), cache), {}

    return make


def _view_pairs(pairs, layer: int, kv: int) -> torch.Tensor:
    """The engine's tensor (``layers[i].keys`` / ``key_cache[i]``) ``[B, NH, S, HS]`` as ``[B, S, NH, HS]``."""
    return pairs[layer][kv].transpose(1, 2)


# -- transformers <= 4.53 -------------------------------------------------------------------


class Legacy453DynamicCache:
    """transformers 4.53.3 ``DynamicCache`` storage: ``key_cache`` / ``value_cache`` lists
    (``cache_utils.py::DynamicCache.update``: first update appends ``key_states`` itself,
    later updates ``torch.cat([...], dim=-2)``)."""

    def __init__(self) -> None:
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        if len(self.key_cache) <= layer_idx:
            for _ in range(len(self.key_cache), layer_idx):
                self.key_cache.append(torch.tensor([]))
                self.value_cache.append(torch.tensor([]))
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        elif not self.key_cache[layer_idx].numel():
            self.key_cache[layer_idx] = key_states
            self.value_cache[layer_idx] = value_states
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class Legacy453StaticCache:
    """transformers 4.53.3 ``StaticCache.__init__`` storage: per layer
    ``torch.zeros((max_batch_size, NH, max_cache_len, head_dim))`` for K and for V."""

    def __init__(self, num_layers: int, max_batch_size: int, num_heads: int, max_cache_len: int, head_dim: int, dtype, device=None):
        shape = (max_batch_size, num_heads, max_cache_len, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def _make_legacy_dynamic_object(sizes, dtype, device):
    cache = Legacy453DynamicCache()
    for i in range(sizes["num_layers"]):  # prefill only: the stored tensors are the transposed views
        cache.update(
            _states(sizes, dtype, device, sizes["block_size"], 2 * i), _states(sizes, dtype, device, sizes["block_size"], 2 * i + 1), i
        )
    return cache


def _make_legacy_static_object(sizes, dtype, device):
    cache = Legacy453StaticCache(
        sizes["num_layers"], sizes["num_blocks"], sizes["num_heads"], sizes["block_size"], sizes["head_size"], dtype, device
    )
    return cache


# -- the continuous-batching paged cache (5.18 - 5.24) --------------------------------------


def make_paged_cache(
    num_layers: int, num_blocks: int, page_size: int, num_heads: int, head_size: int, dtype: torch.dtype, device: Any = "cpu"
) -> SimpleNamespace:
    """A ``PagedAttentionCache``-shaped object built on transformers' own
    ``FullAttentionCacheAllocator``: one ``torch.zeros(..., dtype=torch.uint8)`` tensor of
    ``num_blocks`` whole-model blocks (the first ``2 * blocks_per_sector`` are the trash
    sectors), registered with ``register_cache_tensor`` as ``PagedAttentionCache.__init__``
    does (``cache.py``; sector = ``lcm(bytes_per_block, 128)``).

    Raises:
        GeometryError: ``num_blocks`` is not 2 trash sectors plus whole sectors.
    """
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    bpb = FullAttentionCacheAllocator.get_bytes_per_page(num_heads, head_size, dtype, page_size) * num_layers
    bytes_per_sector = lcm(bpb, 128)
    per_sector = bytes_per_sector // bpb
    if num_blocks % per_sector or num_blocks < 2 * per_sector:
        raise GeometryError(f"num_blocks={num_blocks} must be a multiple of {per_sector} blocks per sector, at least 2 sectors")
    tensor = torch.zeros(num_blocks * bpb, dtype=torch.uint8, device=device)
    alloc, _, _, pool = register_allocator(tensor, num_layers, page_size, num_heads, head_size, dtype)
    return SimpleNamespace(cache_tensor=tensor, cache_allocators={"full_attention": alloc}, pool=pool)


def _paged_sizes_ok(sizes: dict, dtype: torch.dtype) -> dict:
    esz = torch.empty(0, dtype=dtype).element_size()
    bpb = 2 * sizes["num_heads"] * sizes["head_size"] * esz * sizes["block_size"] * sizes["num_layers"]
    per = lcm(bpb, 128) // bpb
    nb = max(sizes["num_blocks"], 2 * per)
    return {**sizes, "num_blocks": -(-nb // per) * per}


def _paged_hints(sizes: dict, dtype: torch.dtype) -> dict:
    return {
        "num_layers": sizes["num_layers"],
        "num_kv_heads": sizes["num_heads"],
        "head_size": sizes["head_size"],
        "page_size": sizes["block_size"],
        "dtype": str(dtype).replace("torch.", ""),
    }


def _make_paged(sizes, dtype, device):
    """The raw ``cache_tensor`` of a cache built by transformers' allocator, with the
    hints that give its geometry (the bytes alone do not)."""
    s = _paged_sizes_ok(sizes, dtype)
    if s["num_blocks"] != sizes["num_blocks"]:
        raise GeometryError(
            f"transformers cannot allocate {sizes['num_blocks']} blocks of this geometry (sectors of whole blocks); use {s['num_blocks']}"
        )
    cache = make_paged_cache(s["num_layers"], s["num_blocks"], s["block_size"], s["num_heads"], s["head_size"], dtype, device)
    hints = _paged_hints(sizes, dtype)
    alloc = cache.cache_allocators["full_attention"]
    for layer in range(sizes["num_layers"]):  # the oracle's arithmetic is transformers' own page views
        for kv in range(2):
            mine, theirs = _view_paged(cache.cache_tensor, layer, kv, hints), alloc._kv_page_views[layer][kv]
            if (mine.data_ptr(), mine.stride()[1:], mine.shape[1:]) != (theirs.data_ptr(), theirs.stride()[1:], theirs.shape[1:]):
                raise GeometryError(f"the paged fixture's view of layer {layer} {'KV'[kv]} differs from transformers' _kv_page_views")
    return cache.cache_tensor, hints


def _view_paged(buffer, layer: int, kv: int, hints: dict) -> torch.Tensor:
    """``register_cache_tensor``'s own views, rebuilt from the bytes: the tensor viewed as
    ``[total_tokens * 2, NH, HS]`` rows, layer ``i``'s K rows from ``2i * page_size`` (V from
    ``(2i + 1) * page_size``), cut in pages of ``page_size`` rows; page ``2 * NL * b`` is block ``b``."""
    dtype = getattr(torch, hints["dtype"])
    nl, nh, hs, ps = hints["num_layers"], hints["num_kv_heads"], hints["head_size"], hints["page_size"]
    rows = buffer.view(dtype).view(-1, nh, hs)
    pages = rows[(2 * layer + kv) * ps :]
    pages = pages[: pages.shape[0] // ps * ps].view(-1, ps, nh, hs)
    return pages[:: 2 * nl]


#: fixture name -> the builder of the cache *object* (for tests of ``kvcore.detect(cache)``)
OBJECT_BUILDERS = {
    "transformers-5.24-DynamicCache": _make_dynamic_object,
    "transformers-5.24-DynamicSlidingWindowLayer": _make_sliding_object,
    "transformers-5.24-StaticCache": _make_static_object,
    "transformers-4.53-DynamicCache-prefill": _make_legacy_dynamic_object,
    "transformers-4.53-StaticCache": _make_legacy_static_object,
}


def make_paged_object(sizes: dict, dtype: torch.dtype, device: Any = "cpu") -> SimpleNamespace:
    """The paged fixture's cache object (``cache_tensor`` + ``cache_allocators``)."""
    s = _paged_sizes_ok(sizes, dtype)
    return make_paged_cache(s["num_layers"], s["num_blocks"], s["block_size"], s["num_heads"], s["head_size"], dtype, device)


def fixture_cases() -> list[FixtureCase]:
    """Every fixture of this plugin (5 dynamic/static cases and the paged cache)."""
    src524 = "transformers 5.24.0 src/transformers/cache_utils.py"
    src453 = "transformers 4.53.3 src/transformers/cache_utils.py"
    return [
        FixtureCase(
            name="transformers-5.24-DynamicCache",
            engine="transformers",
            format=LAYER_PAIRS_FORMAT,
            make=_pairs(_make_dynamic_object),
            kv_view=_view_pairs,
            sizes=dict(_DEFAULT),
            source=f"{src524}::DynamicLayer.update (torch.cat on dim -2)",
            writer=dynamic_writer(),
        ),
        FixtureCase(
            name="transformers-5.24-DynamicSlidingWindowLayer",
            engine="transformers",
            format=LAYER_PAIRS_FORMAT,
            make=_pairs(_make_sliding_object),
            kv_view=_view_pairs,
            sizes=dict(_DEFAULT),
            source=f"{src524}::DynamicSlidingWindowLayer.update (keys = full[:, :, -sliding_window + 1:, :], a strided view)",
            writer=sliding_writer(),
        ),
        FixtureCase(
            name="transformers-5.24-StaticCache",
            engine="transformers",
            format=LAYER_PAIRS_FORMAT,
            make=_pairs(_make_static_object),
            kv_view=_view_pairs,
            sizes=dict(_DEFAULT),
            source=f"{src524}::StaticLayer.lazy_initialization (torch.zeros((batch, NH, max_cache_len, HS)))",
            writer=static_writer(),
        ),
        FixtureCase(
            name="transformers-4.53-DynamicCache-prefill",
            engine="transformers",
            format=LAYER_PAIRS_NHD_FORMAT,
            make=_pairs(_make_legacy_dynamic_object),
            kv_view=_view_pairs,
            sizes=dict(_DEFAULT),
            source=f"{src453}::DynamicCache.update (key_cache list; the first update keeps the transposed key_states view)",
            writer=LEGACY_NO_WRITER,
        ),
        FixtureCase(
            name="transformers-4.53-StaticCache",
            engine="transformers",
            format=LAYER_PAIRS_FORMAT,
            make=_pairs(_make_legacy_static_object),
            kv_view=_view_pairs,
            sizes=dict(_DEFAULT),
            source=f"{src453}::StaticCache.__init__ (key_cache list of torch.zeros((max_batch_size, NH, max_cache_len, head_dim)))",
            writer=LEGACY_NO_WRITER,
        ),
        FixtureCase(
            name="transformers-5.24-PagedAttentionCache-full_attention",
            engine="transformers",
            format=PAGED_FORMAT,
            make=_make_paged,
            kv_view=_view_paged,
            sizes=dict(_PAGED_DEFAULT),
            source=(
                "transformers 5.24.0 src/transformers/generation/continuous_batching/cache.py::PagedAttentionCache.__init__ "
                "and cache_allocators/full_attention.py::FullAttentionCacheAllocator.register_cache_tensor"
            ),
            size_constraints={"num_blocks": "2 trash sectors plus whole sectors of lcm(bytes_per_block, 128) bytes"},
            writer=paged_writer(),
        ),
    ]
