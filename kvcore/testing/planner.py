"""The plan: which checks run for which plugin, format, fixture, kernel and device.

:func:`plan` pairs every loaded plugin's formats and fixtures with the check families in
:mod:`kvcore.testing.checks`, and each plugin's kernels with every fixture whose format they
serve; :data:`CHECKS` is the report order."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore import registry
from kvcore.errors import PluginError
from kvcore.testing.checks import planes as plane_checks
from kvcore.testing.checks.common import (
    _dname,
    _kname,
    devices,
)
from kvcore.testing.checks.containers import SHAPES, check_containers
from kvcore.testing.checks.context import _Ctx
from kvcore.testing.checks.detection import (
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
from kvcore.testing.checks.invalid import INVALID, check_invalid
from kvcore.testing.checks.random import check_agrees_with_reference
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
from kvcore.testing.fixtures import FixtureCase, fixtures_by_plugin
from kvcore.testing.results import CheckFailure, CheckSkip, Options, Task
from kvcore.testing.writers import Writer

#: every check name, in report order (``roundtrip``, ``ambiguity`` and ``invalid`` take a ``[...]`` suffix)
CHECKS = (
    "load",
    "engine_scoped",
    "grammar",
    "fixtures_exist",
    "fixture_contract",
    "hints_declared",
    "detect",
    "physical_order",
    "render",
    "geometry",
    "ambiguity",
    "containers",
    "writer",
    "writer_view",
    "writer_gather",
    "writer_scatter",
    "semantic_gather",
    "semantic_scatter",
    "roundtrip",
    "negative_slots",
    "empty_slots",
    "padded_pool",
    "invalid",
    "staging_views",
    "agrees_with_reference",
)


def format_tasks(plugin: str, fmt) -> list[Task]:
    """``grammar`` for one format."""
    return [Task(plugin, fmt.name, "", "-", "grammar", lambda: check_grammar(fmt))]


def _kernels_for(fmt_name: str, device: torch.device) -> list[Any]:
    out = []
    for k in registry.kernels():
        if device.type not in tuple(k.device_types):
            continue
        fm = getattr(k, "formats", None)
        if fm is not None and fmt_name not in fm:
            continue
        out.append(k)
    return sorted(out, key=lambda k: (-int(getattr(k, "priority", 0)), k.name))


_SHARED: dict[str, Any] = {}


def kernel_tasks(plugin: str, case: FixtureCase, kernel: Any, device: torch.device, opts: Options) -> list[Task]:
    """Every data-moving check of one fixture with one kernel on one device."""
    kn = _kname(kernel, device)

    def T(check: str, fn: Callable[[], str | None]) -> Task:
        def guarded() -> str | None:
            # asked only when the check runs: a native kernel may build on its first availability question
            if not kernel.available():
                raise CheckSkip(f"kernel {kernel.name} is not available here: {kernel.why()}")
            return fn()

        return Task(plugin, case.format, case.name, kn, check, guarded)

    key = (id(case), case.name, str(device), kernel.name)
    if plane_checks.is_multi_plane(case):
        return _plane_kernel_tasks(T, case, kernel, device, opts, key)

    def ctx() -> _Ctx:
        # the checks of one (fixture, kernel, device) share one cache, reset between checks
        if _SHARED.get("key") != key:
            _SHARED.clear()
            _SHARED["ctx"] = _Ctx(case, device, kernel)
            _SHARED["key"] = key
            return _SHARED["ctx"]
        return _SHARED["ctx"].reset()

    def with_ctx(fn):
        return lambda: fn(ctx())

    tasks = []
    if isinstance(case.writer, Writer):
        tasks += [
            T("writer_gather", lambda: check_writer_gather(case, device, kernel)),
            T("writer_scatter", lambda: check_writer_scatter(case, device, kernel)),
        ]
    tasks += [
        T("semantic_gather", with_ctx(check_semantic_gather)),
        T("semantic_scatter", with_ctx(check_semantic_scatter)),
    ]
    for dt in case.dtypes:
        tasks.append(T(f"roundtrip[{_dname(dt)}]", lambda dt=dt: check_roundtrip(case, device, kernel, dt)))
    tasks += [
        T("negative_slots", with_ctx(check_negative_slots)),
        T("empty_slots", with_ctx(check_empty_slots)),
        T("padded_pool", lambda: check_padded_pool(case, device, kernel)),
    ]
    for kind in INVALID:
        tasks.append(T(f"invalid[{kind}]", lambda kind=kind: check_invalid(ctx(), kind)))
    tasks += [
        T("staging_views", with_ctx(check_staging_views)),
        T("agrees_with_reference", lambda: check_agrees_with_reference(case, device, kernel, opts.examples)),
    ]
    return tasks


def _plane_kernel_tasks(T, case: FixtureCase, kernel: Any, device: torch.device, opts: Options, key: tuple) -> list[Task]:
    """The data checks of a multi-plane fixture: the same names, per plane buffer
    (:mod:`kvcore.testing.checks.planes`)."""
    pc = plane_checks

    def ctx() -> pc.PCtx:
        if _SHARED.get("key") != key:
            _SHARED.clear()
            _SHARED["ctx"] = pc.PCtx(case, device, kernel)
            _SHARED["key"] = key
            return _SHARED["ctx"]
        return _SHARED["ctx"].reset()

    def with_ctx(fn):
        return lambda: fn(ctx())

    tasks = []
    if isinstance(case.writer, Writer):  # the writer checks skip records whose planes stage apart (writer.py)
        tasks += [
            T("writer_gather", lambda: check_writer_gather(case, device, kernel)),
            T("writer_scatter", lambda: check_writer_scatter(case, device, kernel)),
        ]
    tasks += [T("semantic_gather", with_ctx(pc.check_semantic_gather)), T("semantic_scatter", with_ctx(pc.check_semantic_scatter))]
    for dt in case.dtypes:
        tasks.append(T(f"roundtrip[{_dname(dt)}]", lambda dt=dt: pc.check_roundtrip(case, device, kernel, dt)))
    tasks += [
        T("negative_slots", with_ctx(pc.check_negative_slots)),
        T("empty_slots", with_ctx(pc.check_empty_slots)),
        T("padded_pool", lambda: pc.check_padded_pool(case, device, kernel)),
    ]
    for kind in pc.PLANE_INVALID:
        tasks.append(T(f"invalid[{kind}]", lambda kind=kind: pc.check_invalid(ctx(), kind)))
    tasks += [
        T("staging_views", with_ctx(pc.check_staging_views)),
        T("agrees_with_reference", lambda: pc.check_agrees_with_reference(case, device, kernel, opts.examples)),
    ]
    return tasks


def fixture_tasks(case: FixtureCase, plugin: str = "", opts: Options | None = None, kernels: Sequence[Any] | None = None) -> list[Task]:
    """Every check of one fixture: detection, geometry, ambiguity probes, then the data
    checks for each kernel that serves its format on each device present."""
    opts = opts or Options()
    cpu = torch.device("cpu")

    def T(check: str, fn: Callable[[], str | None]) -> Task:
        return Task(plugin, case.format, case.name, "-", check, fn)

    multi = plane_checks.is_multi_plane(case)
    pc = plane_checks
    tasks = [
        T("fixture_contract", lambda: (pc.check_fixture_contract if multi else check_fixture_contract)(case)),
        T("hints_declared", lambda: check_hints_declared(case)),
        T("detect", lambda: check_detect(case, cpu)),
        T("physical_order", lambda: check_physical_order(case)),
        T("render", lambda: (pc.check_render if multi else check_render)(case)),
        T("geometry", lambda: (pc.check_geometry if multi else check_geometry)(case)),
    ]
    for probe in PROBES:
        amb = pc.check_ambiguity if multi else check_ambiguity
        tasks.append(T(f"ambiguity[{probe}]", lambda probe=probe, amb=amb: amb(case, probe, cpu)))
        tasks.append(T(f"semantic_gather[{probe}]", lambda probe=probe, amb=amb: amb(case, probe, cpu, gather_too=True)))
    if not multi:
        tasks.append(T("ambiguity[memory order]", lambda: check_memory_order(case, cpu)))
    for shape in [x for x in SHAPES if (x == "planes") == multi]:
        tasks.append(T(f"containers[{shape}]", lambda shape=shape: check_containers(case, shape)))
    if isinstance(case.writer, Writer):
        tasks.append(T("writer_view", lambda: check_writer_view(case)))
    else:
        tasks.append(T("writer", lambda: check_writer(case)))
    for dev in _devices(opts):
        ks = kernels if kernels is not None else _kernels_for(case.format, dev)
        for k in ks:
            if dev.type in tuple(k.device_types):
                tasks += kernel_tasks(plugin, case, k, dev, opts)
    return tasks


def _devices(opts: Options) -> list[torch.device]:
    devs = devices()
    if opts.devices:
        devs = [d for d in devs if d.type in opts.devices]
    return devs


def _fixtures_by_plugin() -> tuple[dict[str, list[FixtureCase]], dict[str, str]]:
    """Each plugin's fixtures, and the error of each plugin whose fixture hook raised."""

    out, raised = fixtures_by_plugin()
    errors = {name: f"kvcore_register_fixtures raised {type(e).__name__}: {e}" for name, e in raised.items()}
    for name, cases in out.items():
        bad = [c for c in cases if not isinstance(c, FixtureCase)]
        if bad:
            errors[name] = f"kvcore_register_fixtures registered {bad[0]!r:.80}, not a kvcore.testing.FixtureCase"
            out[name] = [c for c in cases if isinstance(c, FixtureCase)]
    return out, errors


def plan(plugins: Sequence[str] | None = None, opts: Options | None = None) -> list[Task]:
    """The tasks for ``plugins`` (default: every loaded plugin).

    For a plugin: ``grammar`` and ``fixtures_exist`` per format it registers; every
    fixture check of its fixtures, with every kernel serving the format; and its own
    kernels against every fixture (of any plugin) whose format they serve.

    Raises:
        kvcore.PluginError: a name that is not a loaded plugin (the message lists them).
    """

    opts = opts or Options()
    h = registry.host()
    infos = {i.name: i for i in registry.plugins()}
    names = list(plugins) if plugins else sorted(infos)
    unknown = [n for n in names if n not in infos]
    if unknown:
        raise PluginError(
            f"no kvcore plugin named {', '.join(map(repr, unknown))} is loaded; loaded plugins: {', '.join(sorted(infos)) or 'none'}"
        )
    by_plugin, fixture_errors = _fixtures_by_plugin()
    tasks: list[Task] = []
    seen: set[str] = set()

    def add(ts: list[Task]) -> None:
        for t in ts:
            key = "::".join([t.fixture or t.format, t.kernel, t.check])
            if t.fixture and key in seen:
                continue
            seen.add(key)
            tasks.append(t)

    for name in names:
        info = infos[name]
        if info.error:
            err = info.error
            add([Task(name, "", "", "-", "load", lambda err=err: (_ for _ in ()).throw(CheckFailure(f"plugin failed to load: {err}")))])
            continue
        cases = by_plugin.get(name, [])
        if any(i.plugin_name == name for i in h.pm.hook.kvcore_detect.get_hookimpls()):
            every_case = [c for cs in by_plugin.values() for c in cs]
            add([Task(name, "", "", "-", "engine_scoped", functools.partial(check_engine_scoped, name, every_case))])
        if name in fixture_errors:
            err = fixture_errors[name]
            add([Task(name, "", "", "-", "fixtures", lambda err=err: (_ for _ in ()).throw(CheckFailure(err)))])
        for fname in sorted(f for f, d in h.declarations.items() if name in d):
            fmt = h.declarations[fname][name]  # this plugin's own declaration (its sources, engines)
            mine = [c.name for c in cases if c.format == fname]

            exists = functools.partial(check_fixtures_exist, name, fname, mine)
            add(format_tasks(name, fmt) + [Task(name, fname, "", "-", "fixtures_exist", exists)])
        for case in cases:
            add(fixture_tasks(case, name, opts))
        own = [k for k in registry.kernels() if h.kernel_owner.get(id(k)) == name]
        present = {d.type for d in _devices(opts)}
        for k in own:
            if not present & set(k.device_types):
                why = f"no {'/'.join(k.device_types)} device here (devices: {', '.join(sorted(present))}); run kvcore check on a machine that has one"
                add([Task(name, "", "", f"{k.name}@-", "device", lambda why=why: (_ for _ in ()).throw(CheckSkip(why)))])
        if own:
            for owner, others in sorted(by_plugin.items()):
                for case in others:
                    for dev in _devices(opts):
                        for k in own:
                            if dev.type in tuple(k.device_types) and (getattr(k, "formats", None) is None or case.format in k.formats):
                                add(kernel_tasks(owner, case, k, dev, opts))
    return tasks
