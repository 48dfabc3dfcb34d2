"""A misbehaving plugin is named and skipped, whatever it raises (review D6/D7):

- a ``BaseException`` that is not an ``Exception`` (``SystemExit``, a custom subclass) from a
  plugin's import or any hook is contained like any exception (``KeyboardInterrupt`` and
  ``GeneratorExit`` pass through);
- a plugin's ``DetectionError`` is its answer, and the message names the plugin; which
  plugin is asked first is the documented order (the engine's own, then load order);
- a kernel name is one kernel: a plugin registering a taken name is skipped;
- a plugin kernel that fails a transfer is marked broken and the transfer is redone by the
  next kernel, with values equal to the reference's (not under strict mode or KVCORE_KERNEL).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings

import pytest
import torch

import kvcore
from kvcore import Candidate, KVCorePluginWarning, KVFormat, hookimpl, registry, resolve
from kvcore.errors import AmbiguousLayoutError, DetectionError, PluginError, TransferError
from kvcore.kernels import select_kernel
from kvcore.kernels.reference import REFERENCE

FMT = "NL_X_TWO_NB_BS_NH_HS"
NL, NB, BS, NH, HS = 2, 4, 4, 2, 8


def _cache():
    return [torch.arange(2 * NB * BS * NH * HS, dtype=torch.float32).view(2, NB, BS, NH, HS) + 1000 * i for i in range(NL)]


def _expected(cache, slots):
    """[2, NL, T, NH*HS] read straight from the tensors (slot s: block s // BS, offset s % BS)."""
    return torch.stack(
        [torch.stack([torch.stack([cache[li][kv, s // BS, s % BS].reshape(-1) for s in slots]) for li in range(NL)]) for kv in range(2)]
    )


class _Plugin:
    """Declares FMT for ``engine`` and answers its detection with ``answer(kv_caches)``."""

    def __init__(self, answer, engine="myeng"):
        self.answer, self.engine = answer, engine

    @hookimpl
    def kvcore_register_formats(self, register):
        register(KVFormat(name=FMT, engines=[self.engine]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        return self.answer(kv_caches) if engine == self.engine else None


def _good(kv):
    return resolve([Candidate(FMT, kv)], engine="myeng")


class _Custom(BaseException):
    pass


# -- D6: BaseException from a plugin ----------------------------------------------------------


@pytest.mark.parametrize("exc", [SystemExit(3), _Custom("custom base exception")], ids=["SystemExit", "BaseException-subclass"])
def test_a_detector_raising_a_base_exception_is_named_and_skipped(core_only, monkeypatch, exc):
    def bad(kv):
        raise exc

    kvcore.register_plugin(_Plugin(bad), name="bad")  # registered first: asked first
    kvcore.register_plugin(_Plugin(_good), name="good")
    with pytest.warns(KVCorePluginWarning) as rec:
        layout = kvcore.detect(_cache(), engine="myeng")
    assert layout.format.name == FMT and layout.plugin == "good"
    msgs = [str(r.message) for r in rec]
    assert any("'bad' misbehaved and was skipped" in m and f"raised {type(exc).__name__}: {exc}" in m for m in msgs), msgs
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=f"'bad' misbehaved: kvcore_detect.*raised {type(exc).__name__}") as ei:
        kvcore.detect(_cache(), engine="myeng")
    assert isinstance(ei.value.__cause__.__cause__, type(exc))  # the original is kept


@pytest.mark.parametrize("exc", [KeyboardInterrupt, GeneratorExit])
def test_keyboard_interrupt_and_generator_exit_pass_through(core_only, exc):
    def bad(kv):
        raise exc()

    kvcore.register_plugin(_Plugin(bad), name="bad")
    with pytest.raises(exc):
        kvcore.detect(_cache(), engine="myeng")


def test_a_registration_hook_raising_system_exit_is_a_plugin_error(core_only):
    class Bad:
        @hookimpl
        def kvcore_register_formats(self, register):
            raise SystemExit(4)

    with pytest.raises(PluginError, match="'bad' failed while registering: SystemExit: 4"):
        kvcore.register_plugin(Bad(), name="bad")
    assert "bad" not in {p.name for p in kvcore.plugins()}


def test_an_entry_point_whose_import_exits_is_skipped_and_the_rest_load(fake_entry_points, monkeypatch, tmp_path):
    (tmp_path / "kvcore_test_exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "kvcore_test_exits_in_hook.py").write_text(
        "import sys\nfrom kvcore import hookimpl\n@hookimpl\ndef kvcore_register_hints(register):\n    sys.exit(5)\n"
    )
    good = types.ModuleType("kvcore_test_ep_fine")
    good.kvcore_register_formats = hookimpl(lambda register: register(KVFormat(name="NL_X_NB_BS_HS", engines=["x"])))
    monkeypatch.setitem(sys.modules, "kvcore_test_ep_fine", good)
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_entry_points(
        [("aaa_exits", "kvcore_test_exits_on_import"), ("bbb_exits", "kvcore_test_exits_in_hook"), ("fine", "kvcore_test_ep_fine")]
    )
    with pytest.warns(KVCorePluginWarning) as rec:
        names = [f.name for f in kvcore.formats()]
    assert names == ["NL_X_NB_BS_HS"]
    msgs = " | ".join(str(r.message) for r in rec)
    assert "'aaa_exits'" in msgs and "import failed: SystemExit: 3" in msgs
    assert "'bbb_exits'" in msgs and "registration failed: SystemExit: 5" in msgs
    info = {p.name: p for p in kvcore.plugins()}
    assert info["aaa_exits"].error == "import failed: SystemExit: 3" and info["fine"].error is None
    # strict: the same load is a PluginError naming the first culprit, never a raw SystemExit
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    registry.reset()
    with pytest.raises(PluginError, match="'aaa_exits'.*SystemExit: 3"):
        kvcore.formats()


def test_a_fixtures_hook_raising_system_exit_is_reported_per_plugin(core_only):
    from kvcore.testing.fixtures import fixtures_by_plugin

    class Bad:
        @hookimpl
        def kvcore_register_fixtures(self, register):
            raise SystemExit(6)

    kvcore.register_plugin(Bad(), name="bad")
    _, errors = fixtures_by_plugin(["bad"])
    assert isinstance(errors["bad"], registry.PluginAbort) and isinstance(errors["bad"].original, SystemExit)


# -- D6: a plugin's DetectionError names it; which plugin answers ------------------------------


@pytest.mark.parametrize("exc", [DetectionError("nope"), AmbiguousLayoutError("two fit", candidates=["A", "B"], hints=["h"])])
def test_a_serving_plugins_detection_error_is_its_answer_and_names_it(core_only, exc):
    def refuses(kv):
        raise exc

    kvcore.register_plugin(_Plugin(refuses), name="refuser")  # first in load order: its answer decides
    kvcore.register_plugin(_Plugin(_good), name="good")
    orig = str(exc)
    with pytest.raises(type(exc)) as ei:
        kvcore.detect(_cache(), engine="myeng")
    assert str(ei.value) == f"kvcore plugin 'refuser': {orig}"
    with pytest.raises(type(exc)) as ei:  # asked again: named once, not twice
        kvcore.detect(_cache(), engine="myeng")
    assert str(ei.value) == f"kvcore plugin 'refuser': {orig}"
    if isinstance(exc, AmbiguousLayoutError):  # the same exception: attributes kept
        assert ei.value.candidates == ["A", "B"] and ei.value.decide == [["h"]]


def test_a_newcomers_detection_error_does_not_pre_empt_a_plugin_already_serving_the_engine(core_only):
    """Load order: the reviewer's case (good registered before the refusing plugin)."""
    kvcore.register_plugin(_Plugin(_good), name="good")
    kvcore.register_plugin(_Plugin(lambda kv: (_ for _ in ()).throw(DetectionError("nope"))), name="bad2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout = kvcore.detect(_cache(), engine="myeng")
    assert layout.plugin == "good"


def test_the_engines_own_plugin_answers_before_any_other(core_only):
    def nope(kv):
        raise DetectionError("nope")

    kvcore.register_plugin(_Plugin(nope), name="early")  # first loaded, but not named after the engine
    kvcore.register_plugin(_Plugin(_good), name="myeng")
    assert kvcore.detect(_cache(), engine="myeng").plugin == "myeng"
    kvcore.unregister_plugin("myeng")
    with pytest.raises(DetectionError, match="^kvcore plugin 'early': nope$"):
        kvcore.detect(_cache(), engine="myeng")


# -- D7: kernel names are unique ----------------------------------------------------------


class _Kernel:
    device_types, formats, priority = ("cpu",), None, 1000

    def __init__(self, name="evil", gather=None, scatter=None):
        self.name, self.calls = name, []
        self._gather, self._scatter = gather, scatter

    def available(self):
        return True

    def why(self):
        return ""

    def gather(self, plan):
        self.calls.append("gather")
        self._gather(plan)

    def scatter(self, plan):
        self.calls.append("scatter")
        self._scatter(plan)


class _KernelPlugin:
    def __init__(self, *kernels):
        self.kernels = kernels

    @hookimpl
    def kvcore_register_kernels(self, register):
        for k in self.kernels:
            register(k)


@pytest.mark.parametrize("taken", ["native-cpu", "reference"])
def test_a_plugin_kernel_under_a_built_in_name_is_refused(core_only, taken):
    with pytest.raises(PluginError, match=f"'impostor' registers a kernel named '{taken}', and plugin 'kvcore' registered it first"):
        kvcore.register_plugin(_KernelPlugin(_Kernel(taken)), name="impostor")
    owners = {registry.host().kernel_owner[id(k)] for k in registry.kernels() if k.name == taken}
    assert owners == {"kvcore"}
    assert "impostor" not in {p.name for p in kvcore.plugins()}


def test_a_plugin_registering_one_kernel_name_twice_is_refused(core_only):
    with pytest.raises(PluginError, match="'twice' registers a kernel named 'k1', and registers it twice"):
        kvcore.register_plugin(_KernelPlugin(_Kernel("k1"), _Kernel("k1")), name="twice")
    assert not [k for k in registry.kernels() if k.name == "k1"]


def test_a_duplicate_kernel_name_from_an_entry_point_skips_the_newcomer(fake_entry_points, monkeypatch):
    first, second = types.ModuleType("kvcore_test_k_first"), types.ModuleType("kvcore_test_k_second")
    k1, k2 = _Kernel("fast"), _Kernel("fast")
    first.kvcore_register_kernels = hookimpl(lambda register: register(k1))
    second.kvcore_register_kernels = hookimpl(lambda register: register(k2))
    monkeypatch.setitem(sys.modules, "kvcore_test_k_first", first)
    monkeypatch.setitem(sys.modules, "kvcore_test_k_second", second)
    fake_entry_points([("aaa", "kvcore_test_k_first"), ("bbb", "kvcore_test_k_second")])
    with pytest.warns(KVCorePluginWarning, match="'bbb'.*registers a kernel named 'fast', and plugin 'aaa' registered it first"):
        fast = [k for k in registry.kernels() if k.name == "fast"]
    assert len(fast) == 1 and fast[0].kernel is k1
    assert {p.name: bool(p.error) for p in kvcore.plugins()}["bbb"] is True
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    registry.reset()
    with pytest.raises(PluginError, match="'bbb'.*'fast'.*'aaa' registered it first"):
        kvcore.formats()


# -- D7: a failing plugin kernel ------------------------------------------------------------


def _garbage_then_raise(what):
    """A kernel that writes garbage over the whole destination of the request, then raises."""

    def gather(plan):
        for b in plan.buffers.values():
            b.fill_(-7.0)
        raise RuntimeError(f"boom {what}")

    def scatter(plan):  # writes the request's rows from a garbage source, then raises
        REFERENCE.scatter(dataclasses.replace(plan, staging=torch.full_like(plan.staging, -9.0)))
        raise RuntimeError(f"boom {what}")

    return gather if what == "gather" else scatter


def test_a_raising_plugin_kernel_is_marked_broken_and_the_transfer_is_redone(core_only):
    k = _Kernel("evil", gather=_garbage_then_raise("gather"), scatter=_garbage_then_raise("scatter"))
    kvcore.register_plugin(_KernelPlugin(k), name="evilplug")
    cache = _cache()
    lay = kvcore.build_layout(FMT, cache)
    assert select_kernel("cpu", FMT).name == "evil"
    slots = [0, 5, 13]
    out = torch.zeros(2, NL, 3, NH * HS)
    with pytest.warns(
        KVCorePluginWarning, match="'evilplug'.*kernel 'evil' of plugin 'evilplug' failed in gather: RuntimeError: boom"
    ) as rec:
        kvcore.gather(lay, slots, out=out)
    assert torch.equal(out, _expected(cache, slots))  # the garbage was overwritten by the redo
    assert "redone" in str(rec[0].message)
    assert k.calls == ["gather"]
    # broken for the rest of the process: not asked again, not selected, why() says so
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        src = torch.randn(2, NL, 2, NH * HS)
        kvcore.scatter(lay, [3, 9], src)
        assert torch.equal(kvcore.gather(lay, [3, 9]), src)
    assert k.calls == ["gather"]
    assert select_kernel("cpu", FMT).name != "evil"
    broken = next(x for x in registry.kernels() if x.name == "evil")
    assert not broken.available() and broken.why() == "marked broken in this process: gather() raised RuntimeError: boom gather"


def test_a_scatter_that_wrote_then_raised_is_redone_and_touches_nothing_else(core_only):
    k = _Kernel("evil", gather=_garbage_then_raise("gather"), scatter=_garbage_then_raise("scatter"))
    kvcore.register_plugin(_KernelPlugin(k), name="evilplug")
    cache = _cache()
    before = [c.clone() for c in cache]
    lay = kvcore.build_layout(FMT, cache)
    src = torch.randn(2, NL, 2, NH * HS)
    with pytest.warns(KVCorePluginWarning, match="failed in scatter: RuntimeError: boom scatter"):
        kvcore.scatter(lay, [2, 6], src)
    assert k.calls == ["scatter"]
    assert torch.equal(_expected(cache, [2, 6]), src)  # the request's rows hold src, not the garbage
    for li in range(NL):  # every other row is as it was
        for s in range(NB * BS):
            if s not in (2, 6):
                assert torch.equal(cache[li][:, s // BS, s % BS], before[li][:, s // BS, s % BS])


def test_a_plan_made_before_the_kernel_broke_falls_back_too(core_only):
    k = _Kernel("evil", gather=_garbage_then_raise("gather"), scatter=_garbage_then_raise("scatter"))
    kvcore.register_plugin(_KernelPlugin(k), name="evilplug")
    cache = _cache()
    plan = kvcore.plan(kvcore.build_layout(FMT, cache))
    with pytest.warns(KVCorePluginWarning, match="kernel 'evil'"):
        assert torch.equal(plan.gather([1, 2]), _expected(cache, [1, 2]))
    assert torch.equal(plan.gather([4]), _expected(cache, [4]))
    assert k.calls == ["gather"]


def test_a_failing_plugin_kernel_is_a_plugin_error_under_strict_mode_or_when_forced(core_only, monkeypatch):
    k = _Kernel("evil", gather=_garbage_then_raise("gather"), scatter=_garbage_then_raise("scatter"))
    kvcore.register_plugin(_KernelPlugin(k), name="evilplug")
    lay = kvcore.build_layout(FMT, _cache())
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="'evilplug' misbehaved: kernel 'evil' of plugin 'evilplug' failed in gather: RuntimeError: boom"):
        kvcore.gather(lay, [0])
    monkeypatch.delenv("KVCORE_STRICT_PLUGINS")
    k2 = _Kernel("evil2", gather=_garbage_then_raise("gather"), scatter=_garbage_then_raise("scatter"))
    kvcore.register_plugin(_KernelPlugin(k2), name="evil2plug")
    monkeypatch.setenv("KVCORE_KERNEL", "evil2")
    with pytest.raises(PluginError, match="kernel 'evil2' of plugin 'evil2plug' failed in gather.*forced by KVCORE_KERNEL"):
        kvcore.gather(lay, [0])
    with pytest.raises(TransferError, match="KVCORE_KERNEL=evil2 is not available here: marked broken"):
        kvcore.gather(lay, [0])


def test_a_plugin_kernels_refusal_propagates_unchanged_and_does_not_break_it(core_only):
    def refuse(plan):
        raise TransferError("evil refuses: too many slots")

    k = _Kernel("picky", gather=refuse, scatter=refuse)
    kvcore.register_plugin(_KernelPlugin(k), name="pickyplug")
    lay = kvcore.build_layout(FMT, _cache())
    for _ in range(2):
        with pytest.raises(TransferError, match="^evil refuses: too many slots$"):
            kvcore.gather(lay, [0])
    assert k.calls == ["gather", "gather"] and select_kernel("cpu", FMT).name == "picky"


def test_built_in_kernels_refusals_are_unchanged(core_only):
    lay = kvcore.build_layout(FMT, _cache())
    with pytest.raises(TransferError, match="slot") as ei:
        kvcore.gather(lay, [NB * BS])  # one past the last slot
    assert not isinstance(ei.value, PluginError) and "kvcore plugin" not in str(ei.value)


def test_a_kernel_raising_system_exit_is_contained(core_only):
    def exits(plan):
        raise SystemExit(9)

    kvcore.register_plugin(_KernelPlugin(_Kernel("exits", gather=exits, scatter=exits)), name="exitplug")
    cache = _cache()
    with pytest.warns(KVCorePluginWarning, match="failed in gather: SystemExit: 9"):
        out = kvcore.gather(kvcore.build_layout(FMT, cache), [7])
    assert torch.equal(out, _expected(cache, [7]))
