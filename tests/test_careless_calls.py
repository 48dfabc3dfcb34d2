"""Calls an adversarial or careless user makes end in a kvcore error (or a warning naming
what was wrong), never a raw torch/Python exception, and never a write.

The class: every integer argument that may arrive as a tensor (``layers=``, ``skip_prefix=``,
``heads=``, ``layer_indices``) refuses a meta tensor (no values to read); the ``engine``
argument of detection is one engine name; a plugin name to disable that no installed
plugin has is named in a warning."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import kvcore
from kvcore import registry
from kvcore.errors import DetectionError, GeometryError, KVCoreError, TransferError
from kvcore.registry import KVCorePluginWarning

META = torch.device("meta")


def _layout():
    caches = [torch.arange(2 * 4 * 4 * 2 * 8, dtype=torch.float32).view(2, 4, 4, 2, 8) + 1000 * i for i in range(3)]
    return caches, kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)


def _snapshot(caches):
    return [c.clone() for c in caches]


@pytest.mark.parametrize(
    "call",
    [
        lambda lay, s: kvcore.gather(lay, s, layers=torch.tensor(1, device=META)),
        lambda lay, s: kvcore.gather(lay, s, layers=torch.tensor([0, 2], device=META)),
        lambda lay, s: kvcore.gather(lay, s, layers=[torch.tensor(0, device=META)]),
        lambda lay, s: kvcore.gather(lay, s, skip_prefix=torch.tensor(1, device=META)),
        lambda lay, s: kvcore.scatter(lay, s, torch.zeros(2, 3, s.numel(), 16), skip_prefix=torch.tensor(1, device=META)),
        lambda lay, s: kvcore.scatter(lay, s, torch.zeros(2, 1, s.numel(), 16), layers=torch.tensor([1], device=META)),
        lambda lay, s: kvcore.gather_blocks(lay, torch.tensor([1]), skip_prefix=torch.tensor(2, device=META)),
        lambda lay, s: kvcore.gather_blocks(lay, torch.tensor([1]), layers=torch.tensor([0], device=META)),
        lambda lay, s: kvcore.plan(lay, torch.tensor([0, 1], device=META)),
        lambda lay, s: kvcore.plan(lay).gather(s, skip_prefix=torch.tensor(0, device=META)),
        lambda lay, s: kvcore.copy(lay, s, lay, s + 8, heads=(torch.tensor(0, device=META), 1)),
        lambda lay, s: kvcore.copy(lay, s, lay, s + 8, heads=torch.tensor([0, 1], device=META)),
    ],
)
def test_meta_tensors_as_integer_arguments_are_transfer_errors_and_write_nothing(call):
    caches, lay = _layout()
    before = _snapshot(caches)
    slots = torch.tensor([1, 2, 3])
    with pytest.raises(TransferError, match="meta device"):
        call(lay, slots)
    assert all(torch.equal(a, b) for a, b in zip(before, caches))


def test_integer_tensors_on_the_cpu_still_select_layers_and_skip_rows():
    caches, lay = _layout()
    slots = torch.tensor([1, 6])
    out = kvcore.gather(lay, slots, layers=torch.tensor([2, 0]), skip_prefix=torch.tensor(1))
    # staging [2, NL=2, T, NH*HS]: layer 2 then layer 0; row 0 skipped (left zero), row 1 = slot 6 (block 1, offset 2)
    assert out.shape == (2, 2, 2, 16)
    assert torch.equal(out[:, :, 0], torch.zeros(2, 2, 16))
    assert torch.equal(out[1, 0, 1], caches[0][1, 1, 2].flatten() + 2000)
    assert torch.equal(out[0, 1, 1], caches[0][0, 1, 2].flatten())


def test_layout_data_ptrs_refuse_a_meta_layer_index():
    caches, lay = _layout()
    with pytest.raises(GeometryError, match="meta device"):
        lay.data_ptrs(torch.tensor([0], device=META))
    assert lay.data_ptrs(torch.tensor([2])) == [caches[2].data_ptr()]


@pytest.mark.parametrize(
    "engine, says",
    [
        (["vllm"], "pass engine='vllm'"),
        (("sglang",), "pass engine='sglang'"),
        ({"vllm": 1}, "got dict"),
        (None, "got NoneType"),
        ("", "got str"),
        (3, "got int"),
    ],
)
def test_engine_must_be_one_name(engine, says):
    caches, _ = _layout()
    for fn in (kvcore.detect, kvcore.detect_per_layer):
        with pytest.raises(DetectionError, match="engine must be one engine name") as e:
            fn(caches, engine)
        assert says in str(e.value)
        assert isinstance(e.value, KVCoreError)


def test_an_enum_member_whose_value_is_the_engine_name_is_that_engine(core_only):
    import enum

    class Engine(enum.Enum):
        MINE = "lmtest-engine"

    class P:
        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_TWO_NB_BS_NH_HS", engines=["lmtest-engine"]))

        @kvcore.hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            if engine != "lmtest-engine":
                return None
            return kvcore.Detection(format="NL_X_TWO_NB_BS_NH_HS", kv_caches=kv_caches)

    kvcore.register_plugin(P(), name="lmtest")
    caches, _ = _layout()
    assert kvcore.detect(caches, Engine.MINE).num_layers == 3


def _plugin_module(name):
    import types

    mod = types.ModuleType(name)

    class _P:
        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_NB_BS_HS", engines=[name]))

    mod.plugin = _P()
    mod.kvcore_register_formats = mod.plugin.kvcore_register_formats
    return mod


def test_a_misspelt_plugin_to_disable_is_named_in_a_warning(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_vllmish", _plugin_module("kvcore_test_vllmish"))
    fake_entry_points([("vllm", "kvcore_test_vllmish")])
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", "vlm")
    with pytest.warns(KVCorePluginWarning, match=r"KVCORE_DISABLE_PLUGINS names 'vlm'.*did you mean 'vllm'") as rec:
        names = {p.name for p in kvcore.plugins()}
    assert "vllm" in names  # nothing was disabled by the typo, and the user is told so
    assert "Installed plugins (entry point names): vllm" in str(rec[0].message)


def test_a_correct_plugin_to_disable_warns_nothing(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_vllmish2", _plugin_module("kvcore_test_vllmish2"))
    fake_entry_points([("vllm", "kvcore_test_vllmish2")])
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", "vllm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {p.name for p in kvcore.plugins()} == {"kvcore"}


def test_disable_plugins_api_warns_about_an_unknown_name(fake_entry_points, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcore_test_sgl", _plugin_module("kvcore_test_sgl"))
    fake_entry_points([("sglang", "kvcore_test_sgl")])
    with pytest.warns(KVCorePluginWarning, match=r"disable_plugins names 'sglan'.*'sglang'"):
        kvcore.disable_plugins("sglan")
    assert "sglang" in {p.name for p in kvcore.plugins()}
    assert "sglan" in registry.disabled_plugins()  # kept: a plugin registered later under it stays disabled
