"""The plugin host: register/unregister, duplicate formats, broken entry points, strict
mode, disabling plugins, lazy once-only loading."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

import kvcore
from kvcore import KVCorePluginWarning, KVFormat, PluginError, hookimpl, registry


def _plugin_module(modname: str, *format_names: str, boom: Exception | None = None) -> types.ModuleType:
    """A fake plugin module registering ``format_names`` (or raising ``boom``)."""
    mod = types.ModuleType(modname)

    @hookimpl
    def kvcore_register_formats(register):
        if boom is not None:
            raise boom
        for n in format_names:
            register(KVFormat(name=n, engines=[modname]))

    mod.kvcore_register_formats = kvcore_register_formats
    return mod


class _Plugin:
    def __init__(self, *names):
        self.names = names

    @hookimpl
    def kvcore_register_formats(self, register):
        for n in self.names:
            register(KVFormat(name=n))


def test_register_and_unregister(core_only):
    assert [p.name for p in kvcore.plugins()] == ["kvcore"]
    assert kvcore.formats() == []
    name = kvcore.register_plugin(_Plugin("NL_X_NB_BS_HS", "NL_X_TWO_NB_BS_NH_HS"), name="testplug")
    assert name == "testplug"
    assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS", "NL_X_TWO_NB_BS_NH_HS"]
    assert kvcore.get_format("NL_X_NB_BS_HS").name == "NL_X_NB_BS_HS"
    assert registry.format_owner("NL_X_NB_BS_HS") == "testplug"
    info = {p.name: p for p in kvcore.plugins()}["testplug"]
    assert info.formats == ["NL_X_NB_BS_HS", "NL_X_TWO_NB_BS_NH_HS"]
    assert info.hooks == ["kvcore_register_formats"]
    assert info.error is None
    kvcore.unregister_plugin("testplug")
    assert kvcore.formats() == []
    assert [p.name for p in kvcore.plugins()] == ["kvcore"]
    with pytest.raises(kvcore.FormatError):
        kvcore.get_format("NL_X_NB_BS_HS")


def test_register_a_module_uses_its_name(core_only):
    mod = _plugin_module("kvcore_test_modplug", "NL_X_NB_BS_HS")
    assert kvcore.register_plugin(mod) == "kvcore_test_modplug"
    assert registry.format_owner("NL_X_NB_BS_HS") == "kvcore_test_modplug"


def test_builtin_plugin_registers_the_reference_kernel(core_only):
    info = kvcore.plugins()[0]
    assert info.name == "kvcore" and "reference" in info.kernels
    assert any(k.name == "reference" for k in registry.kernels())


class _SpecPlugin:
    """Declares ``name`` for ``engine`` and gives its own spec for it: a different declaration."""

    def __init__(self, name, engine="other"):
        self.name, self.engine = name, engine

    @hookimpl
    def kvcore_register_formats(self, register):
        register(KVFormat(name=self.name, engines=[self.engine]))

    @hookimpl
    def kvcore_spec(self, format):
        return _OtherSpec if format.name == self.name else None


class _OtherSpec(kvcore.Spec):
    pass


def test_identical_declarations_of_one_name_coexist_and_merge_their_labels(core_only):
    a = _plugin_module("kvcore_test_same_a", "NL_X_NB_BS_HS")
    b = _plugin_module("kvcore_test_same_b", "NL_X_TWO_NB_BS_NH_HS", "NL_X_NB_BS_HS")
    kvcore.register_plugin(a)
    kvcore.register_plugin(b)
    assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS", "NL_X_TWO_NB_BS_NH_HS"]
    assert kvcore.get_format("NL_X_NB_BS_HS").engines == ["kvcore_test_same_a", "kvcore_test_same_b"]
    assert list(registry.declarations("NL_X_NB_BS_HS")) == ["kvcore_test_same_a", "kvcore_test_same_b"]
    assert registry.format_owner("NL_X_NB_BS_HS") == "kvcore_test_same_a"
    assert {p.name: p.formats for p in kvcore.plugins()}["kvcore_test_same_b"] == ["NL_X_TWO_NB_BS_NH_HS", "NL_X_NB_BS_HS"]
    # each works without the other: removing the first declarer leaves the second's
    kvcore.unregister_plugin("kvcore_test_same_a")
    assert kvcore.get_format("NL_X_NB_BS_HS").engines == ["kvcore_test_same_b"]
    assert registry.format_owner("NL_X_NB_BS_HS") == "kvcore_test_same_b"
    kvcore.unregister_plugin("kvcore_test_same_b")
    assert kvcore.formats() == []


def test_a_different_declaration_of_a_taken_name_is_refused_naming_both(core_only):
    kvcore.register_plugin(_Plugin("NL_X_NB_BS_HS"), name="first")
    with pytest.raises(PluginError) as ei:
        kvcore.register_plugin(_SpecPlugin("NL_X_NB_BS_HS"), name="second")
    msg = str(ei.value)
    assert "'second' declares format 'NL_X_NB_BS_HS' differently from plugin 'first'" in msg
    assert "_OtherSpec" in msg and "'first' uses the core's spec" in msg
    assert "KVCORE_DISABLE_PLUGINS=first" not in msg
    # the refused plugin left nothing behind, and the name still means the first's layout
    assert "second" not in {p.name for p in kvcore.plugins()}
    assert list(registry.declarations("NL_X_NB_BS_HS")) == ["first"]
    assert registry.spec_for(kvcore.get_format("NL_X_NB_BS_HS")) is None


def test_a_spec_hook_answers_only_for_names_its_plugin_declares(core_only):
    class Hijack:
        @hookimpl
        def kvcore_spec(self, format):
            return _OtherSpec

    kvcore.register_plugin(_Plugin("NL_X_NB_BS_HS"), name="owner")
    kvcore.register_plugin(Hijack(), name="hijack")
    assert registry.spec_for(kvcore.get_format("NL_X_NB_BS_HS")) is None  # declared by 'owner' only
    # a name nobody declares: a spec never overrides what a name the grammar builds means...
    assert registry.spec_for(KVFormat(name="NL_X_NBBS_ONE_HS")) is None
    # ...and answers for one the grammar cannot build alone (NP plane tuples)
    assert registry.spec_for(KVFormat(name="NL_X_NP_X_NB_BS_ONE_HS")) is _OtherSpec


def test_same_name_twice_and_same_object_twice(core_only):
    p = _Plugin("NL_X_NB_BS_HS")
    kvcore.register_plugin(p, name="a")
    with pytest.raises(PluginError, match="'a' is already registered"):
        kvcore.register_plugin(_Plugin("NL_X_NBBS_ONE_HS"), name="a")
    with pytest.raises(PluginError, match="'b'"):
        kvcore.register_plugin(p, name="b")
    assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS"]


def test_register_plugin_whose_hook_fails(core_only):
    mod = _plugin_module("kvcore_test_failing", boom=RuntimeError("no GPU here"))
    with pytest.raises(PluginError, match="kvcore_test_failing.*RuntimeError: no GPU here"):
        kvcore.register_plugin(mod)
    assert "kvcore_test_failing" not in {p.name for p in kvcore.plugins()}


def test_register_something_that_is_not_a_format(core_only):
    class Bad:
        @hookimpl
        def kvcore_register_formats(self, register):
            register("NL_X_NB_BS_HS")

    with pytest.raises(PluginError, match="register\\(\\) takes a kvcore.KVFormat"):
        kvcore.register_plugin(Bad(), name="bad")


def test_entry_points_load_lazily_and_once(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_ep_a", _plugin_module("kvcore_test_ep_a", "NL_X_NB_BS_HS"))
    calls = fake_entry_points([("epa", "kvcore_test_ep_a")])
    assert calls["n"] == 0  # nothing loaded at reset / import
    assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS"]
    assert calls["n"] == 1
    kvcore.formats()
    kvcore.plugins()
    kvcore.get_format("NL_X_NB_BS_HS")
    assert calls["n"] == 1  # once
    assert registry.format_owner("NL_X_NB_BS_HS") == "epa"
    registry.reset()
    assert calls["n"] == 1
    kvcore.plugins()
    assert calls["n"] == 2


def test_broken_entry_point_warns_and_the_rest_load(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_ep_good", _plugin_module("kvcore_test_ep_good", "NL_X_NB_BS_HS"))
    fake_entry_points([("aaa_broken", "kvcore_test_no_such_module_xyz"), ("good", "kvcore_test_ep_good")])
    with pytest.warns(KVCorePluginWarning) as rec:
        names = [f.name for f in kvcore.formats()]
    assert names == ["NL_X_NB_BS_HS"]
    msg = str(rec[0].message)
    assert "'aaa_broken'" in msg and "ModuleNotFoundError" in msg and "kvcore_test_no_such_module_xyz" in msg
    assert "KVCORE_DISABLE_PLUGINS=aaa_broken" in msg
    info = {p.name: p for p in kvcore.plugins()}
    assert info["aaa_broken"].error.startswith("import failed: ModuleNotFoundError")
    assert info["good"].error is None and info["good"].formats == ["NL_X_NB_BS_HS"]


def test_entry_point_whose_registration_fails_warns(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_ep_boom", _plugin_module("kvcore_test_ep_boom", boom=KeyError("x")))
    monkeypatch.setitem(sys.modules, "kvcore_test_ep_ok", _plugin_module("kvcore_test_ep_ok", "NL_X_NBBS_ONE_HS"))
    fake_entry_points([("boom", "kvcore_test_ep_boom"), ("ok", "kvcore_test_ep_ok")])
    with pytest.warns(KVCorePluginWarning, match="'boom'.*registration failed: KeyError"):
        assert [f.name for f in kvcore.formats()] == ["NL_X_NBBS_ONE_HS"]


def test_strict_mode_raises_and_keeps_raising(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_ep_good2", _plugin_module("kvcore_test_ep_good2", "NL_X_NB_BS_HS"))
    fake_entry_points([("broken", "kvcore_test_no_such_module_xyz"), ("good", "kvcore_test_ep_good2")])
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="'broken'.*ModuleNotFoundError"):
        kvcore.formats()
    # no half-loaded host answers the next question
    with pytest.raises(PluginError, match="'broken'"):
        kvcore.formats()
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "0")
    with pytest.warns(KVCorePluginWarning):
        assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS"]


def test_identical_declarations_between_entry_points_load_without_a_warning(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_dup_a", _plugin_module("kvcore_test_dup_a", "NL_X_NB_BS_HS"))
    monkeypatch.setitem(sys.modules, "kvcore_test_dup_b", _plugin_module("kvcore_test_dup_b", "NL_X_NB_BS_HS"))
    fake_entry_points([("dupa", "kvcore_test_dup_a"), ("dupb", "kvcore_test_dup_b")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS"]
    assert list(registry.declarations("NL_X_NB_BS_HS")) == ["dupa", "dupb"]


@pytest.mark.parametrize("third_party", ["aaa", "zzz"])  # loaded before and after the engine's own plugin
def test_a_third_party_declaring_a_name_differently_is_skipped_and_the_engines_plugin_answers(fake_entry_points, monkeypatch, third_party):
    """The engine's own plugin (named after the engine its declaration lists) keeps the
    name whichever loads first; the other plugin is named, skipped with a warning, and
    the message never advises disabling the engine's plugin."""
    own = _plugin_module("kvcore_test_tiny", "NL_X_NB_BS_HS", "NL_X_NBBS_ONE_HS")
    own.kvcore_register_formats = hookimpl(
        lambda register: [register(KVFormat(name=n, engines=["tiny"])) for n in ("NL_X_NB_BS_HS", "NL_X_NBBS_ONE_HS")]
    )
    evil = types.ModuleType("kvcore_test_evil")
    p = _SpecPlugin("NL_X_NB_BS_HS", engine="evil")
    evil.kvcore_register_formats, evil.kvcore_spec = p.kvcore_register_formats, p.kvcore_spec
    monkeypatch.setitem(sys.modules, "kvcore_test_tiny", own)
    monkeypatch.setitem(sys.modules, "kvcore_test_evil", evil)
    fake_entry_points([(third_party, "kvcore_test_evil"), ("tiny", "kvcore_test_tiny")])
    with pytest.warns(KVCorePluginWarning) as rec:
        names = [f.name for f in kvcore.formats()]
    assert names == ["NL_X_NBBS_ONE_HS", "NL_X_NB_BS_HS"]
    assert registry.declarations("NL_X_NB_BS_HS") == {"tiny": KVFormat(name="NL_X_NB_BS_HS", engines=["tiny"])}
    [w] = [str(r.message) for r in rec]
    assert f"'{third_party}' declares format 'NL_X_NB_BS_HS' differently from plugin 'tiny'" in w
    assert f"KVCORE_DISABLE_PLUGINS={third_party}" in w and "KVCORE_DISABLE_PLUGINS=tiny" not in w
    info = {i.name: i for i in kvcore.plugins()}
    assert info[third_party].error and info["tiny"].error is None
    assert registry.spec_for(kvcore.get_format("NL_X_NB_BS_HS")) is None
    # strict mode: the same conflict is an error naming the third party
    registry.reset()
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=f"'{third_party}' declares format 'NL_X_NB_BS_HS' differently"):
        kvcore.formats()


def test_a_plugin_failing_to_register_is_skipped_and_the_rest_load(fake_entry_points, monkeypatch):
    class Half:
        name = "half"

    bad = types.ModuleType("kvcore_test_halfkernel")
    bad.kvcore_register_kernels = hookimpl(lambda register: register(Half()))
    monkeypatch.setitem(sys.modules, "kvcore_test_halfkernel", bad)
    monkeypatch.setitem(sys.modules, "kvcore_test_fine", _plugin_module("kvcore_test_fine", "NL_X_NB_BS_HS"))
    fake_entry_points([("half", "kvcore_test_halfkernel"), ("fine", "kvcore_test_fine")])
    with pytest.warns(KVCorePluginWarning, match="'half'.*registered a kernel without 'device_types'"):
        assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS"]


def test_disable_by_environment(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_env_a", _plugin_module("kvcore_test_env_a", "NL_X_NB_BS_HS"))
    monkeypatch.setitem(sys.modules, "kvcore_test_env_b", _plugin_module("kvcore_test_env_b", "NL_X_NBBS_ONE_HS"))
    fake_entry_points([("a", "kvcore_test_env_a"), ("b", "kvcore_test_env_b"), ("broken", "kvcore_test_no_such_module_xyz")])
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", " broken, a ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the disabled broken plugin is not even imported
        assert [f.name for f in kvcore.formats()] == ["NL_X_NBBS_ONE_HS"]
    assert sorted(p.name for p in kvcore.plugins()) == ["b", "kvcore"]


def test_disable_by_api(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_api_a", _plugin_module("kvcore_test_api_a", "NL_X_NB_BS_HS"))
    fake_entry_points([("a", "kvcore_test_api_a")])
    assert [f.name for f in kvcore.formats()] == ["NL_X_NB_BS_HS"]
    kvcore.disable_plugins("a")
    assert kvcore.formats() == []
    assert "a" not in {p.name for p in kvcore.plugins()}
    with pytest.raises(PluginError, match="cannot be disabled"):
        kvcore.disable_plugins("kvcore")
    assert any(k.name == "reference" for k in registry.kernels())


def test_plugins_lists_the_core_first(core_only):
    kvcore.register_plugin(_Plugin("NL_X_NB_BS_HS"), name="aaa")
    assert [p.name for p in kvcore.plugins()] == ["kvcore", "aaa"]
    d = kvcore.plugins()[1].as_dict()
    assert d["name"] == "aaa" and d["formats"] == ["NL_X_NB_BS_HS"] and d["error"] is None


def test_a_misspelt_hook_warns(core_only):
    class Typo:
        @hookimpl
        def kvcore_register_format(self, register):  # missing the final "s"
            raise AssertionError("never called")

    with pytest.warns(KVCorePluginWarning, match="'typo' implements kvcore_register_format, which kvcore never calls"):
        kvcore.register_plugin(Typo(), name="typo")
    assert kvcore.formats() == []


def test_kernels_register_and_leave_with_their_plugin(core_only):
    class Kernel:
        name = "toy-kernel"
        device_types = ("cpu",)
        formats = ("NL_X_NB_BS_HS",)
        priority = 10_000

        def available(self):
            return True

        def why(self):
            return "a test kernel"

        def gather(self, plan):
            raise AssertionError("not called here")

        scatter = gather

    class P:
        @hookimpl
        def kvcore_register_kernels(self, register):
            register(Kernel())

    core_kernels = [k.name for k in registry.kernels()]  # the reference (and any native kernels)
    assert "reference" in core_kernels
    kvcore.register_plugin(P(), name="kern")
    assert [k.name for k in registry.kernels()] == core_kernels + ["toy-kernel"]
    assert {p.name: p for p in kvcore.plugins()}["kern"].kernels == ["toy-kernel"]
    from kvcore.kernels import select_kernel

    assert select_kernel("cpu", "NL_X_NB_BS_HS").name == "toy-kernel"  # higher priority, claims the format
    assert select_kernel("cpu", "NL_X_NBBS_ONE_HS").name != "toy-kernel"  # not its format
    kvcore.unregister_plugin("kern")
    assert [k.name for k in registry.kernels()] == core_kernels


def test_a_kernel_without_its_methods_is_refused(core_only):
    class Half:
        name = "half"
        device_types = ("cpu",)

    class P:
        @hookimpl
        def kvcore_register_kernels(self, register):
            register(Half())

    core_kernels = [k.name for k in registry.kernels()]
    with pytest.raises(PluginError, match="'halfplug' registered a kernel without 'gather'"):
        kvcore.register_plugin(P(), name="halfplug")
    assert [k.name for k in registry.kernels()] == core_kernels


def test_duplicate_demo_names_both_plugins(core_only):
    def make(n):
        class D:
            @hookimpl
            def kvcore_register_demos(self, register):
                register("same", lambda argv: 0, f"demo of {n}")

        return D()

    kvcore.register_plugin(make("a"), name="demo-a")
    with pytest.raises(PluginError, match="'same' is registered by two plugins: 'demo-a' and 'demo-b'"):
        kvcore.register_plugin(make("b"), name="demo-b")
    assert registry.demos()["same"][2] == "demo-a"


# -- review: a newcomer never knocks out a plugin serving the name; labels are stable ---------

SHARED = "NL_X_TWO_NB_BS_NH_HS"


def _engine_plugin(modname: str, engine: str, backends: list[str], *, spec=None, extra: tuple[str, ...] = ()) -> types.ModuleType:
    """A plugin module declaring SHARED (and ``extra``) for ``engine`` with ``backends``,
    detecting ``engine``'s caches as SHARED; ``spec``: its own kvcore_spec for SHARED."""
    mod = types.ModuleType(modname)

    @hookimpl
    def kvcore_register_formats(register):
        for n in (SHARED, *extra):
            register(KVFormat(name=n, engines=[engine], attention_backends=backends))

    @hookimpl
    def kvcore_detect(kv_caches, engine: str, hints):  # noqa: A002 - the hook's argument name
        if engine != mod.ENGINE:
            return None
        return kvcore.resolve([kvcore.Candidate(SHARED, kv_caches)], engine=engine)

    mod.ENGINE = engine
    mod.kvcore_register_formats, mod.kvcore_detect = kvcore_register_formats, kvcore_detect
    if spec is not None:
        mod.kvcore_spec = hookimpl(lambda format: spec if format.name == SHARED else None)
    return mod


def _cache():
    import torch

    return [torch.zeros(2, 3, 4, 2, 8) for _ in range(2)]


@pytest.mark.parametrize("newcomer", ["aaa", "zzz"])  # sorts (loads) before and after the engine's plugin
def test_a_newcomer_overriding_a_names_generic_meaning_never_knocks_out_the_engines_plugin(fake_entry_points, monkeypatch, newcomer):
    """The reviewer's case: an entry point ``aaa`` declares vLLM's name for its own engine
    ``aaa`` (so it looks like an engine's own plugin) with a kvcore_spec of its own. It
    overrides what the grammar builds: it is the one skipped, whatever the load order; the
    engine's plugin keeps all its formats and answers; the warning names and advises
    disabling only the newcomer; strict mode raises naming it."""
    eng = _engine_plugin("kvcore_test_eng", "eng", ["ENG_BACKEND"], extra=("NL_X_NB_BS_HS",))
    new = _engine_plugin(f"kvcore_test_{newcomer}", newcomer, ["NEW"], spec=_OtherSpec)
    monkeypatch.setitem(sys.modules, "kvcore_test_eng", eng)
    monkeypatch.setitem(sys.modules, f"kvcore_test_{newcomer}", new)
    fake_entry_points([(newcomer, f"kvcore_test_{newcomer}"), ("eng", "kvcore_test_eng")])
    with pytest.warns(KVCorePluginWarning) as rec:
        names = sorted(f.name for f in kvcore.formats())
    assert names == ["NL_X_NB_BS_HS", SHARED]
    assert list(registry.declarations(SHARED)) == ["eng"] and registry.spec_for(kvcore.get_format(SHARED)) is None
    [w] = [str(r.message) for r in rec]
    assert f"'{newcomer}' declares format '{SHARED}' differently from plugin 'eng'" in w
    assert "overrides the name's generic meaning" in w
    assert f"KVCORE_DISABLE_PLUGINS={newcomer}" in w and "KVCORE_DISABLE_PLUGINS=eng" not in w
    info = {i.name: i for i in kvcore.plugins()}
    assert info[newcomer].error and info["eng"].error is None
    layout = kvcore.detect(_cache(), "eng")
    assert layout.format.name == SHARED and layout.plugin == "eng" and layout.spec.__class__ is kvcore.Spec
    registry.reset()
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError) as ei:
        kvcore.formats()
    assert f"'{newcomer}' declares format" in str(ei.value) and f"KVCORE_DISABLE_PLUGINS={newcomer}" in str(ei.value)
    assert "KVCORE_DISABLE_PLUGINS=eng" not in str(ei.value)


def test_register_plugin_refuses_a_generic_declaration_while_an_override_holds_the_name(core_only):
    """From code, the plugin being registered is refused (nothing is unloaded behind the
    caller's back), naming the overriding plugin in the way."""
    kvcore.register_plugin(_engine_plugin("kvcore_test_x1", "over", ["O"], spec=_OtherSpec), name="over")
    with pytest.raises(PluginError, match=r"'eng' cannot be registered.*'over'.*overrides the name's generic meaning.*unregister 'over'"):
        kvcore.register_plugin(_engine_plugin("kvcore_test_x2", "eng", ["E"]), name="eng")
    assert list(registry.declarations(SHARED)) == ["over"] and "eng" not in {p.name for p in kvcore.plugins()}


def test_two_different_specs_the_engines_own_plugin_then_the_first_loaded_keeps_the_name(core_only):
    class Spec2(kvcore.Spec):
        pass

    kvcore.register_plugin(_engine_plugin("kvcore_test_a", "other", ["A"], spec=_OtherSpec), name="first")
    with pytest.raises(PluginError, match="'first' declared it first"):
        kvcore.register_plugin(_engine_plugin("kvcore_test_b", "nobody", ["B"], spec=Spec2), name="second")
    with pytest.raises(PluginError, match=r"'eng' cannot be registered.*'eng' is the engine's own plugin.*unregister 'first'"):
        kvcore.register_plugin(_engine_plugin("kvcore_test_c", "eng", ["C"], spec=Spec2), name="eng")


@pytest.mark.parametrize("third", ["aaa_third", "zzz_third"])
def test_the_engines_own_plugin_owns_a_shared_name_and_its_labels_come_first(fake_entry_points, monkeypatch, third):
    """A third party re-declaring the engine's name identically (its own engine, backends)
    coexists; whatever it is called (sorting before or after), the owner is the engine's
    plugin, the merged labels list the engine's first, and a detection reports the plugin
    that answered it."""
    eng = _engine_plugin("kvcore_test_eng2", "eng", ["ENG_BACKEND"])
    other = _engine_plugin(f"kvcore_test_{third}", "myeng", ["MY2"])  # named unlike its engine: not the engine's own
    monkeypatch.setitem(sys.modules, "kvcore_test_eng2", eng)
    monkeypatch.setitem(sys.modules, f"kvcore_test_{third}", other)
    fake_entry_points([(third, f"kvcore_test_{third}"), ("eng", "kvcore_test_eng2")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fmt = kvcore.get_format(SHARED)
    assert registry.format_owner(SHARED) == "eng" and list(registry.declarations(SHARED)) == ["eng", third]
    assert fmt.engines == ["eng", "myeng"] and fmt.attention_backends == ["ENG_BACKEND", "MY2"]
    assert kvcore.detect(_cache(), "eng").plugin == "eng"
    assert kvcore.detect(_cache(), "myeng").plugin == third
    import contextlib
    import io
    import json

    from kvcore import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["describe", SHARED, "--json"]) == 0
    d = json.loads(buf.getvalue())
    assert d["plugin"] == "eng" and d["attention_backends"][0] == "ENG_BACKEND"
