"""The allocation-fixture contract.

A plugin proves a format right by handing the conformance suite a :class:`FixtureCase`
per format (hook ``kvcore_register_fixtures``):

* ``make(sizes, dtype, device) -> (kv_caches, hints)`` allocates a cache the way the
  engine's own code does (for vLLM <= 0.2x: one flat int8 buffer, viewed as the dtype,
  viewed as the stride-ordered shape, permuted back), and returns the hints to detect it.
  ``sizes`` uses the keys of :attr:`FixtureCase.sizes` (num_layers, num_blocks,
  block_size, num_heads, head_size, and any extra the case declares). When
  ``sizes.get("block_padding")`` is a positive int and ``supports_padding`` is true, the
  block axis is padded by that many bytes per block (a dim-0 padded pool).
* ``kv_view(kv_caches, layer, kv) -> Tensor`` is the **oracle**: the engine's own view of
  one layer's K (kv=0) or V (kv=1) plane (MLA: kv=0 only), built the way the engine's
  attention code splits it (``unbind``, ``split``, ``chunk``, slicing) — independently
  of kvcore's stride table. Shape ``[NB, BS, NH, *elem]`` (fused NBBS formats:
  ``[PBS, 1, NH, *elem]``) where ``*elem`` flattens, row-major, to the head's HS
  elements; dtype is the element dtype; writing into it writes the cache.
  When the tensors do not carry their own geometry (a flat pool whose last axis is
  ``BS*NH*HS``), ``kv_view`` may take a keyword-only ``hints`` argument: the suite passes
  the hints ``make`` returned (the engine's own config), ``kv_view(kv_caches, layer, kv, *,
  hints)``. For records whose parts live apart (a block's values, then its scales: no
  single strided view holds a token's row), ``kv_view`` returns a tuple of segment views
  ``([NB, BS, NH, *elem_0], [NB, BS, NH, *elem_1], ...)`` whose elements, concatenated in
  order, are the head's HS elements (the staged row).
* ``sizes``: the declared geometry for the default case; detection of ``make(sizes)``
  must report exactly these numbers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore.registry import fixtures_by_plugin, registered_fixtures

__all__ = ["FixtureCase", "registered_fixtures", "fixtures_by_plugin"]


@dataclass(frozen=True)
class FixtureCase:
    """One allocation fixture (see the module docstring for the contract).

    Attributes:
        name: a unique id, e.g. ``"vllm-0.11-FLASH_ATTN-HND"``.
        engine: engine name passed to :func:`kvcore.detect`.
        format: the format name detection must return.
        make: ``(sizes, dtype, device) -> (kv_caches, hints)``.
        kv_view: ``(kv_caches, layer, kv) -> Tensor`` engine-side oracle view.
        sizes: default geometry (num_layers, num_blocks, block_size, num_heads, head_size, ...).
        dtypes: element dtypes the format allows (default: bf16, fp16, fp32, fp8 e4m3/e5m2, uint8).
        supports_padding: ``make`` honours ``sizes["block_padding"]`` (bytes per block).
        source: engine, version and file the allocation follows.
        size_constraints: extra rules for random geometries, e.g. ``{"block_size_multiple": 16}``.
        writer: the engine's own write path (:class:`kvcore.testing.Writer`), the oracle
            the ``writer_*`` checks prove the layout with; or a string saying why the
            engine's writer cannot run here (reported on a skipped ``writer`` record).
    """

    name: str
    engine: str
    format: str
    make: Callable[[dict, torch.dtype, Any], tuple[Any, dict]]
    kv_view: Callable[[Any, int, int], torch.Tensor]
    sizes: dict[str, int]
    dtypes: tuple[torch.dtype, ...] = (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
    )
    supports_padding: bool = False
    source: str = ""
    size_constraints: dict[str, Any] = field(default_factory=dict)
    writer: Any = None  # kvcore.testing.Writer | str | None

    def view(self, kv_caches: Any, layer: int, kv: int, hints: dict | None = None) -> torch.Tensor:
        """Call :attr:`kv_view`, passing ``hints`` when it takes them."""
        if _takes_hints(self.kv_view):
            return self.kv_view(kv_caches, layer, kv, hints=dict(hints or {}))
        return self.kv_view(kv_caches, layer, kv)


def _takes_hints(fn: Callable) -> bool:
    try:
        return "hints" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
