"""Deliberately broken kvcore plugins: the conformance suite must catch each of them.

They describe "toyllm", a made-up engine that allocates one tensor per layer,
``[1, 2, NB, BS, NH, HS]`` (a singleton axis, then K and V), so the format name
``NL_X_ONE_TWO_NB_BS_NH_HS`` collides with no real engine's. Each plugin is a class
instance (pluggy accepts any object with hook methods); register one at a time::

    import kvcore
    kvcore.register_plugin(SwappedKV(), name="toy-swapped")
    ...
    kvcore.unregister_plugin("toy-swapped")

* :class:`ToyPlugin` — correct: the control, every check passes.
* :class:`SwappedKV` — the engine stores V before K; the plugin says K first. Shapes,
  geometry and scatter-then-gather round trips are all fine; only the semantic oracle
  sees that gather returns V where K belongs.
* :class:`TransposedHeads` — the engine writes HND blocks ``[NB, NH, BS, HS]``; the plugin
  ``view``s the same memory as NHD ``[NB, BS, NH, HS]`` (the shapes still multiply out).
  Again only the semantic oracle sees it.
* :class:`EagerKernel` — a correct layout with a kernel that copies first and validates
  afterwards: it refuses a row-strided staging buffer with TransferError, but only after
  it has written the cache (scatter) or the buffer (gather).
* :class:`GuessesOrder` — the engine allocates HND memory and hands out the NHD-shaped
  view (permuted strides, as vLLM <= 0.23 does); the plugin reads whatever it gets by its
  shape. The allocation itself detects right; handed over already permuted into memory
  order (as some connectors do), the plugin answers with block size and heads swapped
  instead of saying it cannot tell: ``ambiguity[memory order]`` catches it.
* :class:`NamesGivenHint` — raises AmbiguousLayoutError for ``BS == NH`` naming the
  ``kv_cache_layout`` hint as deciding, although the caller gave it: ``ambiguity[BS=NH]``
  catches it (name only hints that would decide).
* :class:`LogicalName` — the engine writes HND blocks; the plugin hands back the engine's
  logical NHD view (a correct ``permute``) under the NHD name. Every byte moves right, but
  a name is the physical order: ``physical_order`` fails (the name must say HND).
* :class:`IgnoresEngine` — a correct detector that never checks ``engine``: it answers for
  every engine (``engine_scoped`` fails).
* :class:`UndeclaredHints` — a fixture that detects with a hint the plugin never declares
  (``hints_declared`` fails: ``kvcore hints toyllm`` could not tell a user about it).
* :class:`PairsAsLists` — the engine keeps a K list and a V list of per-layer tensors; the
  detector reads any two-item container as ``[K list, V list]``. Handed two per-layer
  ``(K, V)`` pairs (``detect_per_layer``, a dict of layers), it takes layer 0's V for layer
  1's K. The fixture's own container (three layers) and ``ambiguity[NL=2]`` pass; the
  ``containers[...]`` checks, which hand the same cache over per layer with two layers, fail.
* :class:`SharedMisreading` — the engine's own writer stores V before K; the plugin's
  detector *and* its fixture's ``kv_view`` both read K first (one reading, restated twice),
  so every check built on ``kv_view`` passes. Only the writer oracle, the engine's write
  path, sees it: ``writer_view`` and ``writer_gather`` fail.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import Detection, KVFormat, Source, TransferError, hookimpl
from kvcore.testing import FixtureCase, Writer

FORMAT = "NL_X_ONE_TWO_NB_BS_NH_HS"
SOURCE = Source(engine="toyllm", version="0", file="examples/broken/broken_plugins.py::ToyPlugin.allocate")


class ToyPlugin:
    """The correct toy plugin (the control)."""

    engine = "toyllm"
    v_first = False  # the engine's truth: V stored before K
    hnd = False  # the engine's truth: heads outside tokens in a block

    # -- the engine ------------------------------------------------------------------
    def allocate(self, sizes: dict, dtype: torch.dtype, device: Any) -> tuple[list[torch.Tensor], dict]:
        nb, bs, nh, hs = sizes["num_blocks"], sizes["block_size"], sizes["num_heads"], sizes["head_size"]
        shape = (1, 2, nb, nh, bs, hs) if self.hnd else (1, 2, nb, bs, nh, hs)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(sizes["num_layers"])], {}

    def engine_view(self, kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
        """How the engine's attention reads K (kv=0) or V (kv=1): ``[NB, BS, NH, HS]``."""
        t = kv_caches[layer][0, (1 - kv) if self.v_first else kv]
        return t.transpose(1, 2) if self.hnd else t

    def store(self, kv_caches: Any, slots: torch.Tensor, rows: dict, *, hints: dict) -> None:
        """toyllm's own write path (its ``reshape_and_cache``), the fixture's writer oracle:
        token ``slot`` of layer ``l`` goes to block ``slot // BS``, offset ``slot % BS`` of
        ``kv_caches[l][0, K or V]``, V at index 0 when the engine stores V first."""
        for layer, t in enumerate(kv_caches):
            for role, idx in (("K", 1 if self.v_first else 0), ("V", 0 if self.v_first else 1)):
                plane = t[0, idx].transpose(1, 2) if self.hnd else t[0, idx]  # [NB, BS, NH, HS]
                bs = plane.shape[1]
                plane[slots // bs, slots % bs] = rows[role][layer]

    # -- the plugin ------------------------------------------------------------------
    def normalise(self, kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(kv_caches)

    @hookimpl
    def kvcore_register_formats(self, register):
        register(KVFormat(name=FORMAT, engines=[self.engine], description="toyllm per-layer [1, 2, NB, BS, NH, HS]", sources=[SOURCE]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != self.engine:
            return None
        return Detection(format=FORMAT, kv_caches=self.normalise(kv_caches), note="toyllm")

    @hookimpl
    def kvcore_register_fixtures(self, register):
        register(
            FixtureCase(
                name=f"{self.engine}-{type(self).__name__}",
                engine=self.engine,
                format=FORMAT,
                make=self.allocate,
                kv_view=self.engine_view,
                sizes={"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_heads": 2, "head_size": 8},
                dtypes=(torch.float32, torch.bfloat16, torch.float8_e5m2),
                source=str(SOURCE),
                writer=Writer(name="toyllm.store", write=self.store, source="examples/broken/broken_plugins.py::ToyPlugin.store"),
            )
        )


class SwappedKV(ToyPlugin):
    """Broken: the engine stores V first, the plugin's format says K first."""

    v_first = True


class TransposedHeads(ToyPlugin):
    """Broken: the engine writes HND blocks; the plugin reinterprets the memory as NHD."""

    hnd = True

    def normalise(self, kv_caches):
        out = []
        for t in kv_caches:
            one, two, nb, nh, bs, hs = t.shape
            out.append(t.view(one, two, nb, bs, nh, hs))  # the bug: a view is not a permute
        return out


class _EagerReference:
    """A kernel that moves the rows first and checks its input afterwards."""

    name = "eager"
    device_types = ("cpu",)
    formats = (FORMAT,)
    priority = 50

    def available(self) -> bool:
        return True

    def why(self) -> str:
        return "broken example: validates after writing"

    def _check(self, plan) -> None:
        if not plan.staging.is_contiguous():
            raise TransferError("eager kernel: the staging buffer must be contiguous")

    def gather(self, plan) -> None:
        from kvcore.kernels.reference import REFERENCE

        REFERENCE.gather(plan)
        self._check(plan)  # the bug: too late

    def scatter(self, plan) -> None:
        from kvcore.kernels.reference import REFERENCE

        REFERENCE.scatter(plan)
        self._check(plan)


class EagerKernel(ToyPlugin):
    """Broken: a correct layout, served by a kernel that writes before validating."""

    @hookimpl
    def kvcore_register_kernels(self, register):
        register(_EagerReference())


class GuessesOrder(ToyPlugin):
    """Broken: reads a tensor by its shape alone, so a cache handed over in memory order is
    misread (heads and block size swapped) instead of being an ambiguity."""

    def allocate(self, sizes, dtype, device):
        nb, bs, nh, hs = sizes["num_blocks"], sizes["block_size"], sizes["num_heads"], sizes["head_size"]
        # HND memory, exposed with the logical NHD shape (the strides show it)
        layers = [torch.zeros((1, 2, nb, nh, bs, hs), dtype=dtype, device=device).transpose(3, 4) for _ in range(sizes["num_layers"])]
        return layers, {}


class NamesGivenHint(ToyPlugin):
    """Broken: an ambiguity that names a hint the caller already gave as the one that decides."""

    def allocate(self, sizes, dtype, device):
        kv, _ = super().allocate(sizes, dtype, device)
        return kv, {"kv_cache_layout": "NHD"}

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        from kvcore import AmbiguousLayoutError

        if engine != self.engine:
            return None
        t = kv_caches[0]
        if t.shape[3] == t.shape[4]:  # BS == NH
            raise AmbiguousLayoutError(
                "toyllm: BS == NH, pass kv_cache_layout", candidates=[FORMAT, "NL_X_ONE_TWO_NB_NH_BS_HS"], hints=["kv_cache_layout"]
            )
        return Detection(format=FORMAT, kv_caches=list(kv_caches), note="toyllm")


class LogicalName(ToyPlugin):
    """Broken: HND memory under the NHD name (the views are right, the name is not physical)."""

    hnd = True

    def normalise(self, kv_caches):
        return [t.transpose(3, 4) for t in kv_caches]  # [1, 2, NB, BS, NH, HS] over [1, 2, NB, NH, BS, HS] memory


class IgnoresEngine(ToyPlugin):
    """Broken: the detector answers whatever engine the caller names."""

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        return Detection(format=FORMAT, kv_caches=self.normalise(kv_caches), note="toyllm")  # the bug: no engine check


class UndeclaredHints(ToyPlugin):
    """Broken: the fixture detects with a hint nothing declares for the engine."""

    def allocate(self, sizes, dtype, device):
        kv, _ = super().allocate(sizes, dtype, device)
        return kv, {"toy_layout": "NHD"}


PAIRS_FORMAT = "TWO_X_NL_X_ONE_NB_BS_NH_HS"


class PairsAsLists(ToyPlugin):
    """Broken: two per-layer ``(K, V)`` pairs are read as a K list and a V list."""

    def allocate(self, sizes, dtype, device):
        nb, bs, nh, hs = sizes["num_blocks"], sizes["block_size"], sizes["num_heads"], sizes["head_size"]
        k = [torch.zeros((1, nb, bs, nh, hs), dtype=dtype, device=device) for _ in range(sizes["num_layers"])]
        v = [torch.zeros((1, nb, bs, nh, hs), dtype=dtype, device=device) for _ in range(sizes["num_layers"])]
        return [k, v], {}

    def engine_view(self, kv_caches, layer, kv):
        return kv_caches[kv][layer][0]

    @hookimpl
    def kvcore_register_formats(self, register):
        register(
            KVFormat(
                name=PAIRS_FORMAT, engines=[self.engine], description="toyllm K list and V list of [1, NB, BS, NH, HS]", sources=[SOURCE]
            )
        )

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != self.engine:
            return None
        if len(kv_caches) == 2:  # the bug: two per-layer (K, V) pairs look just like [K list, V list]
            k, v = kv_caches
        else:
            k, v = [p[0] for p in kv_caches], [p[1] for p in kv_caches]
        return Detection(format=PAIRS_FORMAT, kv_caches=[list(k), list(v)], note="toyllm")

    @hookimpl
    def kvcore_register_fixtures(self, register):
        register(
            FixtureCase(
                name=f"{self.engine}-{type(self).__name__}",
                engine=self.engine,
                format=PAIRS_FORMAT,
                make=self.allocate,
                kv_view=self.engine_view,
                sizes={"num_layers": 3, "num_blocks": 3, "block_size": 4, "num_heads": 2, "head_size": 8},
                dtypes=(torch.float32, torch.bfloat16),
                source=str(SOURCE),
            )
        )


class SharedMisreading(ToyPlugin):
    """Broken: the engine stores V first; detector and kv_view share the K-first misreading."""

    v_first = True  # the engine's truth: its writer (ToyPlugin.store) puts V at index 0

    def engine_view(self, kv_caches, layer, kv):
        return kv_caches[layer][0, kv]  # the bug: K at index 0, the detector's own reading restated


__all__ = [
    "FORMAT",
    "ToyPlugin",
    "SwappedKV",
    "TransposedHeads",
    "EagerKernel",
    "GuessesOrder",
    "NamesGivenHint",
    "LogicalName",
    "IgnoresEngine",
    "UndeclaredHints",
    "PAIRS_FORMAT",
    "PairsAsLists",
    "SharedMisreading",
]
