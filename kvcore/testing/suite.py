"""The conformance suite: the checks, the plan that pairs them with plugins, and the runner.

Importable (pandas / fsspec style)::

    from kvcore.testing import suite
    results = suite.run_checks(["trtllm"])            # list[Result]
    for r in results:
        print(r.line())
    failed = [r for r in results if r.status == "FAIL"]

or per fixture and kernel::

    for task in suite.fixture_tasks(case, plugin="mine"):
        print(task.run().line())

Checks (one :class:`Result` per plugin, format, fixture, kernel and check):

* per format a plugin registers: ``grammar`` (the name parses and renders, its derived
  facts agree with its declared labels) and ``fixtures_exist`` (at least one fixture);
* per plugin with a detector: ``engine_scoped`` (it returns None for an engine that is
  not its own);
* per fixture: ``fixture_contract`` (make/kv_view honour the contract), ``hints_declared``
  (every hint it passes is declared), ``detect`` (detection of the engine's allocation
  returns the fixture's format), ``physical_order`` (the name is the tensors' memory
  order), ``render`` (the concrete rendering is the tensors' real shape), ``geometry``
  (every accessor equals the declared sizes), ``ambiguity[...]`` (look-alike geometries NH=1, NH=2, BS=NH, NB=2,
  NL=2 answer right or raise AmbiguousLayoutError);
* per fixture, kernel and device: ``semantic_gather``, ``semantic_scatter``,
  ``roundtrip[dtype]``, ``negative_slots``, ``empty_slots``, ``padded_pool``,
  ``invalid[...]`` (TransferError and a byte-identical cache), ``staging_views`` and
  ``agrees_with_reference`` (hypothesis, random geometries).

Where each part lives (this module re-exports them): :mod:`kvcore.testing.results` (Result,
Task, Options, CheckFailure, CheckSkip), :mod:`kvcore.testing.planner` (plan, fixture_tasks,
CHECKS), :mod:`kvcore.testing.runner` (select, run_checks) and the check families in
:mod:`kvcore.testing.checks` (one module each: format, fixture, detection, semantic,
roundtrip, invalid, staging, random).
"""

# ruff: noqa: F401 - this module re-exports the suite's parts; helpers too, for code written against
# the single-module suite (new code imports them from their modules)
from __future__ import annotations

from kvcore.testing.checks.common import (
    _change_where,
    _compare,
    _copies,
    _detect,
    _dname,
    _encoding,
    _esize,
    _expect_gather,
    _filled,
    _kernel_guard,
    _kname,
    _make,
    _planes,
    _seed,
    _sentinel_like,
    _sizes_str,
    _slots,
    _staged,
    _widest,
    devices,
    forced_kernel,
)
from kvcore.testing.checks.containers import SHAPES, check_containers
from kvcore.testing.checks.context import _Ctx, _run_scatter
from kvcore.testing.checks.detection import (
    FOREIGN_ENGINE,
    PROBES,
    check_ambiguity,
    check_detect,
    check_engine_scoped,
    check_geometry,
    check_memory_order,
    check_physical_order,
    check_render,
)
from kvcore.testing.checks.fixture import check_fixture_contract, check_hints_declared
from kvcore.testing.checks.format import check_fixtures_exist, check_grammar
from kvcore.testing.checks.invalid import INVALID, _expect_refusal, _other_device, _other_dtype, check_invalid
from kvcore.testing.checks.random import _SHAPE_KEYS, _random_sizes, check_agrees_with_reference
from kvcore.testing.checks.roundtrip import check_roundtrip
from kvcore.testing.checks.semantic import (
    check_empty_slots,
    check_negative_slots,
    check_padded_pool,
    check_semantic_gather,
    check_semantic_scatter,
)
from kvcore.testing.checks.staging import check_staging_views
from kvcore.testing.checks.writer import check_writer, check_writer_gather, check_writer_scatter, check_writer_view
from kvcore.testing.planner import (
    _SHARED,
    CHECKS,
    _devices,
    _fixtures_by_plugin,
    _kernels_for,
    fixture_tasks,
    format_tasks,
    kernel_tasks,
    plan,
)
from kvcore.testing.results import FAIL, PASS, SKIP, CheckFailure, CheckSkip, Options, Result, Task, single_thread
from kvcore.testing.runner import run_checks, select

__all__ = [
    "Result",
    "Task",
    "CheckFailure",
    "CheckSkip",
    "Options",
    "plan",
    "run_checks",
    "fixture_tasks",
    "format_tasks",
    "devices",
    "forced_kernel",
    "CHECKS",
]
