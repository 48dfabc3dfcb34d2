"""Fixture checks, per fixture (on the CPU).

* ``fixture_contract``: a fixture's ``make`` and ``kv_view`` honour the contract of
  :mod:`kvcore.testing.fixtures` (declared sizes, dtypes, a source; ``kv_view`` planes are
  views of the cache of the right shape and dtype).
* ``hints_declared``: every hint ``make`` returns is declared for the fixture's engine
  (``kvcore_register_hints``), with a value the declaration accepts.
"""

from __future__ import annotations

import math

import torch

from kvcore import registry
from kvcore.detection import detect
from kvcore.errors import KVCoreError
from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _describe_value,
    _make,
    _widest,
)
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure


def check_fixture_contract(case: FixtureCase) -> str | None:
    fmt_names = {f.name for f in registry.formats()}
    if case.format not in fmt_names:
        raise CheckFailure(f"fixture {case.name} claims format {case.format}, which no loaded plugin registers")
    fmt = registry.get_format(case.format)
    notes = []
    if fmt.engines and case.engine not in fmt.engines:
        owner = registry.format_owner(case.format)
        notes.append(f"{case.format} (registered by {owner}) lists engines {fmt.engines}, not {case.engine!r}")
    for k in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"):
        if k not in case.sizes:
            raise CheckFailure(f"fixture {case.name}: sizes lacks {k!r} (declared sizes: {case.sizes})")
    if not case.dtypes:
        raise CheckFailure(f"fixture {case.name} allows no dtype")
    if not case.source:
        raise CheckFailure(f"fixture {case.name} cites no source (engine, version, file the allocation follows)")
    dtype = _widest(case.dtypes)
    kv, hints = _make(case, case.sizes, dtype, torch.device("cpu"))
    nl, nh, hs = case.sizes["num_layers"], case.sizes["num_heads"], case.sizes["head_size"]
    tensors = oracle.leaves(kv)
    try:
        tensors += oracle.leaves(detect(kv, case.engine, hints).kv_caches)  # an engine object: the tensors detection found
    except KVCoreError:
        pass  # the detect check reports it
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    for layer in range(nl):
        for k in range(fmt.kv_size):
            try:
                v = case.view(kv, layer, k, hints)
            except Exception as e:  # noqa: BLE001
                raise CheckFailure(f"fixture {case.name}: kv_view(layer={layer}, kv={k}) raised {type(e).__name__}: {e}") from None
            parts = list(v) if isinstance(v, (tuple, list)) else [v]
            if not parts or not all(isinstance(p, torch.Tensor) and p.dim() >= 4 for p in parts):
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, kv={k}) is not a tensor [NB, BS, NH, *elem] "
                    f"(or a tuple of segment tensors): it is {_describe_value(v)}"
                )
            if any(p.dtype != dtype for p in parts):
                raise CheckFailure(f"fixture {case.name}: kv_view is {[p.dtype for p in parts]}; it must be the element dtype {dtype}")
            width = sum(math.prod(int(s) for s in p.shape[3:]) for p in parts)
            if any(int(p.shape[2]) != nh for p in parts) or width != hs:
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, kv={k}) has shape(s) {[tuple(p.shape) for p in parts]}; expected "
                    f"NH={nh} heads of HS={hs} elements at axes 2.."
                )
            if any(p.untyped_storage().data_ptr() not in storages for p in parts):
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, kv={k}) is not a view of the cache (a copy): writing it would not "
                    "write the cache, so it cannot be the oracle"
                )
    return "; ".join(notes) or None


def check_hints_declared(case: FixtureCase) -> str:
    _, hints = _make(case, case.sizes, _widest(case.dtypes), torch.device("cpu"))
    if not hints:
        return "no hints"
    declared = {}
    for plugin, h in registry.hints(case.engine):
        for key in (h.name, *h.aliases):
            declared.setdefault(key, (plugin, h))
    missing = sorted(k for k in hints if k not in declared)
    if missing:
        known = ", ".join(sorted(declared)) or "none"
        raise CheckFailure(
            f"fixture {case.name} detects with hint(s) {', '.join(missing)}, which no plugin declares for engine {case.engine!r} "
            f"(declared: {known}); declare each with kvcore_register_hints, register(kvcore.Hint(engine=..., name=..., "
            f"meaning=..., values=[...])), so `kvcore hints {case.engine}` tells users what to pass"
        )
    for key, value in hints.items():
        plugin, h = declared[key]
        if h.values and isinstance(value, str) and value.lower() not in {v.lower() for v in h.values}:
            raise CheckFailure(
                f"fixture {case.name} passes {key}={value!r}, but {plugin}'s declaration of hint {h.name!r} accepts only "
                f"{', '.join(h.values)}: add the value to the declaration"
            )
    return f"{len(hints)} hint(s), all declared"
