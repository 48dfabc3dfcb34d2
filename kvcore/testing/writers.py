"""Writer oracles: the engine's own code that writes K/V rows into its cache.

A fixture's ``kv_view`` is an independent reading of the engine's cache, but it is still a
reading someone here wrote: if it restates the same misreading as the detector, every
semantic check confirms the misreading. A :class:`Writer` removes that: it is the
**engine's own** write path (vLLM's ``reshape_and_cache`` op, SGLang's pool
``set_kv_buffer``, transformers' ``Cache.update``, LMDeploy's fill kernel), run on the
fixture's cache. The suite then checks

* ``writer_view``: the fixture's ``kv_view`` reads exactly what the engine's writer wrote
  (so every other semantic check stands on the engine's truth, not on a restatement);
* ``writer_gather``: kvcore's gather of the detected layout returns exactly the rows the
  engine's writer wrote, at the slots it wrote them;
* ``writer_scatter``: kvcore's scatter leaves the cache byte-identical to the engine's
  writer writing the same rows into the same slots (from the same starting bytes), and the
  engine's read-back (:attr:`Writer.read`, when given) returns the scattered rows.

A fixture declares its writer as ``FixtureCase(..., writer=Writer(...))``; a fixture whose
engine's writer cannot run on this machine says why with ``writer="reason"`` (the suite
reports a skipped ``writer`` record carrying the reason), and a writer whose engine package
is not importable here (``requires``) is skipped the same way, naming the module and the
import error. ``kvcore check`` counts, per plugin, the formats a writer proved.

The rows the suite hands a writer: ``rows = {"K": Tensor[NL, T, NH, HS], "V": ...}`` (an
MLA latent, kv_size 1: ``{"K": ...}`` only) in the cache's element dtype, on the cache's
device; ``slots`` is int64 ``[T]``, unique and non-negative (the engine's own slot
numbering, ``block_id * block_size + offset``; padding rows are kvcore's business, never
handed to a writer). For a record whose parts live apart, ``HS`` is the whole record row.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Writer", "WriterUnsupported", "ORIGINS"]

#: ``engine``: the engine's own code, imported and run. ``transcribed``: the engine cannot run
#: here, so its kernel's addressing is transcribed from the cited source -- evidence of a
#: weaker kind, reported as such (``kvcore check`` counts the two apart).
ORIGINS = ("engine", "transcribed")


class WriterUnsupported(Exception):
    """Raised by a writer for a slot set its engine cannot write in one call (a prefill-only
    cache that appends, a static cache written at whole positions); the suite then uses a
    slot set the writer accepts, or skips that part with the message."""


@dataclass(frozen=True)
class Writer:
    """The engine's own write path for a fixture's cache (see the module docstring).

    Attributes:
        name: what runs, as the engine names it (``"vllm._custom_ops.cpu_attn_reshape_and_cache"``).
        write: ``write(kv_caches, slots, rows, *, hints) -> None | kv_caches``: write ``rows``
            (``{"K": [NL, T, NH, HS], "V": ...}``) at ``slots`` into the cache ``make``
            returned, the way the engine does, for every layer. Return None when it wrote in
            place; return a new container when the engine's writer allocates (a cache that
            grows by appending): the suite then detects that container with ``make``'s hints.
            Raise :class:`WriterUnsupported` for a slot set the engine cannot write.
        source: engine, version and ``file::function`` of the write path.
        requires: modules the writer imports (``("sglang.srt.mem_cache.memory_pool",)``); when
            one does not import here, the writer checks are skipped naming it and the error.
        devices: device types the writer runs on.
        read: optional ``read(kv_caches, slots, *, hints) -> {"K": [NL, T, NH, HS], ...}``:
            the engine's own read-back of those slots (what its attention consumes).
        all_slots: the writer writes only every slot at once (``slots`` is then a permutation
            of all the cache's slots); scatter is then checked against all slots.
        origin: ``"engine"`` (the engine's code, run) or ``"transcribed"`` (its kernel's
            addressing transcribed from ``source`` because the engine cannot run here).
        ready: optional ``() -> reason or None``: a further condition the writer needs here
            (a Triton kernel on a machine without a GPU needs ``TRITON_INTERPRET=1``).
    """

    name: str
    write: Callable[..., Any]
    source: str = ""
    requires: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    read: Callable[..., Any] | None = None
    all_slots: bool = False
    origin: str = "engine"
    ready: Callable[[], str | None] | None = None

    def unavailable(self) -> str | None:
        """Why the writer cannot run in this environment (a module in :attr:`requires` does
        not import), or None."""
        for mod in self.requires:
            try:
                importlib.import_module(mod)
            except BaseException as e:  # noqa: BLE001 - an engine import may raise anything (SystemExit included)
                if isinstance(e, KeyboardInterrupt):
                    raise
                return f"{mod} does not import here ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
        return self.ready() if self.ready is not None else None

    def run(self, kv_caches: Any, slots: torch.Tensor, rows: dict[str, torch.Tensor], hints: dict) -> Any:
        """Call :attr:`write`; the container the engine's cache is in afterwards."""
        out = self.write(kv_caches, slots, rows, hints=dict(hints))
        return kv_caches if out is None else out
