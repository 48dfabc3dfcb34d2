"""Reliability under concurrent and hostile use (issue 17): plugins load once under a lock
and every thread sees the loaded host; a plugin that crashes, returns garbage, returns
copies, or breaks its spec or kernel is named and skipped (an error under strict mode) while
the others answer; every error leaving kvcore is a KVCoreError."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import types
import warnings

import pytest
import torch

import kvcore
from kvcore import Candidate, Detection, KVCorePluginWarning, KVFormat, hookimpl, registry, resolve
from kvcore.errors import DetectionError, KVCoreError, PluginError, TransferError

FMT = "NL_X_TWO_NB_BS_NH_HS"
NL, NB, BS, NH, HS = 2, 4, 4, 2, 8


def _cache():
    return [torch.arange(2 * NB * BS * NH * HS, dtype=torch.float32).view(2, NB, BS, NH, HS) + 1000 * i for i in range(NL)]


def _good_plugin(engine: str = "good") -> types.ModuleType:
    mod = types.ModuleType(f"kvcore_test_{engine}")

    @hookimpl
    def kvcore_register_formats(register):
        register(KVFormat(name=FMT, engines=[engine]))

    @hookimpl
    def kvcore_detect(kv_caches, engine: str, hints):  # noqa: A002 - the hook's argument name
        if engine != mod.ENGINE:
            return None
        return resolve([Candidate(FMT, kv_caches)], engine=engine)

    mod.ENGINE = engine
    mod.kvcore_register_formats, mod.kvcore_detect = kvcore_register_formats, kvcore_detect
    return mod


class _Detects:
    """A plugin whose kvcore_detect answers every engine with ``answer(kv_caches)``; it
    declares a format for ``declares`` (so kvcore asks it among that engine's plugins)."""

    def __init__(self, answer, declares: str | None = None):
        self.answer, self.declares = answer, declares

    @hookimpl
    def kvcore_register_formats(self, register):
        if self.declares:
            register(KVFormat(name="NL_X_NB_BS_HS", engines=[self.declares]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        return self.answer(kv_caches)


# -- item 4: loading is thread-safe ----------------------------------------------------------


def test_the_first_questions_from_8_threads_at_once_all_see_the_loaded_host(fake_entry_points, monkeypatch):
    slow = _good_plugin("slowengine")
    fast = slow.kvcore_register_formats

    @hookimpl
    def kvcore_register_formats(register):
        time.sleep(0.2)  # a plugin whose registration takes a while: the others must wait for it
        fast(register=register)

    slow.kvcore_register_formats = kvcore_register_formats
    monkeypatch.setitem(sys.modules, "kvcore_test_slowengine", slow)
    calls = fake_entry_points([("slowengine", "kvcore_test_slowengine")])
    barrier = threading.Barrier(8)
    results: list = [None] * 8

    def ask(i: int) -> None:
        barrier.wait()
        try:
            if i % 2:
                results[i] = [f.name for f in kvcore.formats()]
            else:
                results[i] = kvcore.detect(_cache(), "slowengine").format.name
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            results[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [FMT, [FMT]] * 4
    assert calls["n"] == 1  # the entry points were read once


def test_the_first_detect_of_a_fresh_process_from_8_threads_succeeds():
    """The real plugins, a fresh interpreter: 8 threads make the process's first
    ``kvcore.detect`` / ``kvcore.formats()`` at once."""
    script = textwrap.dedent(
        """
        import threading, torch, kvcore
        from kvcore_vllm import fixtures
        caches = fixtures.allocate("0.11.0", "FLASH_ATTN", "HND", num_layers=2, num_blocks=4, block_size=16,
                                   num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
        barrier, out = threading.Barrier(8), [None] * 8
        def ask(i):
            barrier.wait()
            try:
                out[i] = kvcore.detect(caches, engine="vllm").format.name if i % 2 else len(kvcore.formats())
            except Exception as e:
                out[i] = f"{type(e).__name__}: {e}"
        ts = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print(out)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own script's list literal
    n = len(kvcore.formats())
    assert out == [n, "NL_X_TWO_NB_NH_BS_HS"] * 4


# -- item 5: one bad plugin never breaks the others -------------------------------------------


def _detect_with(core_only, bad, engine="good"):
    kvcore.register_plugin(_good_plugin(), name="good")
    kvcore.register_plugin(bad, name="bad")  # registered last: pluggy would ask it first
    return kvcore.detect(_cache(), engine)


@pytest.mark.parametrize(
    "answer, why",
    [
        (lambda kv: 1 / 0, "raised ZeroDivisionError"),
        (lambda kv: {"format": FMT}, "returned {'format'"),
        (lambda kv: Detection(format=FMT, kv_caches=[t.clone() for t in kv]), "not a view of the cache"),
        (lambda kv: Detection(format=FMT, kv_caches=[torch.zeros(2, NB, BS, NH, HS) for _ in kv]), "not a view of the cache"),
    ],
    ids=["raises", "not-a-detection", "copies", "its-own-zeros"],
)
def test_a_misbehaving_detector_is_named_and_skipped_and_the_right_plugin_answers(core_only, monkeypatch, answer, why):
    with pytest.warns(KVCorePluginWarning) as rec:
        layout = _detect_with(core_only, _Detects(answer, declares="good"))
    assert layout.format.name == FMT
    msgs = [str(r.message) for r in rec]
    assert any("'bad' misbehaved and was skipped" in m and why in m for m in msgs), msgs
    assert not any("KVCORE_DISABLE_PLUGINS=good" in m for m in msgs)
    # strict mode: the same is an error naming the plugin
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=f"'bad' misbehaved.*{why[:12]}"):
        kvcore.detect(_cache(), "good")


def test_the_right_plugins_answer_is_a_view_of_the_callers_tensors(core_only):
    cache = _cache()
    with pytest.warns(KVCorePluginWarning):
        kvcore.register_plugin(_good_plugin(), name="good")
        kvcore.register_plugin(_Detects(lambda kv: Detection(format=FMT, kv_caches=[t.clone() for t in kv]), "good"), name="bad")
        layout = kvcore.detect(cache, "good")
    assert [t.data_ptr() for t in layout.kv_caches] == [t.data_ptr() for t in cache]


def test_the_engines_own_plugins_are_asked_before_the_others(core_only):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the crashing plugin declares nothing for the engine: never reached
        assert _detect_with(core_only, _Detects(lambda kv: 1 / 0)).format.name == FMT


def test_when_every_answer_is_refused_the_error_names_the_plugin_and_why(core_only):
    kvcore.register_plugin(_Detects(lambda kv: Detection(format=FMT, kv_caches=[t.clone() for t in kv])), name="copier")
    with pytest.warns(KVCorePluginWarning), pytest.raises(DetectionError, match="copier: .*not a view of the cache"):
        kvcore.detect(_cache(), "anything")


def test_a_detector_that_raises_for_an_engine_it_does_not_declare_does_not_pre_empt_the_right_one(core_only):
    def nosy(kv):
        raise DetectionError("nosy: expected 3-D tensors")

    assert _detect_with(core_only, _Detects(nosy)).format.name == FMT
    kvcore.unregister_plugin("good")
    with pytest.raises(DetectionError, match="nosy: expected 3-D"):  # alone, its error is the answer
        kvcore.detect(_cache(), "good")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_detection_over_quantized_tensors_is_refused_at_the_door(core_only):
    kvcore.register_plugin(_good_plugin(), name="good")
    q = [torch.quantize_per_tensor(torch.rand(2, NB, BS, NH, HS), 0.1, 0, torch.quint8) for _ in range(NL)]
    with pytest.raises(DetectionError, match=r"quantized tensor \(quint8.*int_repr\(\)"):
        kvcore.detect(q, "good")
    with pytest.raises(DetectionError, match="quantized tensor"):
        kvcore.detect_per_layer(q, "good")
    with pytest.raises(kvcore.GeometryError, match="quantized tensor"):
        kvcore.build_layout(FMT, q)
    for dtype in (torch.qint8, torch.qint32):  # the class, not the one example
        q8 = [torch.quantize_per_tensor(torch.rand(2, NB, BS, NH, HS), 0.1, 0, dtype)]
        with pytest.raises(DetectionError, match=str(dtype).replace("torch.", "")):
            kvcore.detect(q8, "good")


def test_a_raising_or_wrong_spec_hook_is_a_plugin_error_naming_the_plugin(core_only):
    class Raising:
        @hookimpl
        def kvcore_register_formats(self, register):
            register(KVFormat(name="NL_X_NB_BS_HS", engines=["x"]))

        @hookimpl
        def kvcore_spec(self, format):
            raise ValueError("spec table missing")

    kvcore.register_plugin(Raising(), name="raising")
    with pytest.raises(PluginError, match=r"'raising': kvcore_spec\(format=NL_X_NB_BS_HS\) raised ValueError: spec table missing"):
        kvcore.build_layout("NL_X_NB_BS_HS", [torch.zeros(NB, BS, HS)])


def test_a_raising_kernel_is_a_plugin_error_naming_the_plugin_and_a_raising_available_falls_back(core_only):
    from kvcore.kernels import select_kernel

    class Kernel:
        name, device_types, formats, priority = "flaky", ("cpu",), None, 1000

        def __init__(self, available):
            self._available = available

        def available(self):
            return self._available()

        def why(self):
            raise RuntimeError("no why")

        def gather(self, plan):
            raise RuntimeError("CUDA error: an illegal memory access")

        scatter = gather

    class P:
        def __init__(self, k):
            self.k = k

        @hookimpl
        def kvcore_register_kernels(self, register):
            register(self.k)

    kvcore.register_plugin(P(Kernel(lambda: True)), name="flaky")
    lay = kvcore.build_layout(FMT, _cache())
    with pytest.raises(PluginError, match="kernel 'flaky' of plugin 'flaky' failed in gather: RuntimeError: CUDA error"):
        kvcore.gather(lay, [0, 1])
    assert "why() raised RuntimeError" in next(k for k in registry.kernels() if k.name == "flaky").why()
    kvcore.unregister_plugin("flaky")

    def boom():
        raise OSError("driver not loaded")

    kvcore.register_plugin(P(Kernel(boom)), name="flaky")
    with pytest.warns(KVCorePluginWarning, match="'flaky'.*available\\(\\) raised OSError"):
        assert select_kernel("cpu", FMT).name != "flaky"
    out = kvcore.gather(lay, torch.tensor([0, 5]))  # another kernel serves
    assert torch.equal(out[0, 1, 1], _cache()[1][0, 1, 1].flatten())


def test_every_error_leaving_a_bad_plugin_path_is_a_kvcore_error(core_only):
    """The class: whatever a plugin's hook raises, the caller sees a KVCoreError."""
    for exc in (ValueError("v"), KeyError("k"), RuntimeError("r"), TypeError("t"), AttributeError("a"), IndexError("i")):

        def answer(kv, exc=exc):
            raise exc

        registry.reset()
        kvcore.register_plugin(_Detects(answer), name="bad")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KVCorePluginWarning)
            with pytest.raises(KVCoreError):
                kvcore.detect(_cache(), "good")


def test_kernel_errors_that_are_refusals_stay_transfer_errors(core_only):
    class Refusing:
        name, device_types, formats, priority = "refusing", ("cpu",), None, 1000

        def available(self):
            return True

        def why(self):
            return "refuses"

        def gather(self, plan):
            raise TransferError("refused: the plan is too large")

        scatter = gather

    class P:
        @hookimpl
        def kvcore_register_kernels(self, register):
            register(Refusing())

    kvcore.register_plugin(P(), name="refusing")
    with pytest.raises(TransferError, match="too large"):
        kvcore.gather(kvcore.build_layout(FMT, _cache()), [0])


class _EngineCache:
    """An engine's own cache object: the tensors live in its attributes."""

    def __init__(self):
        self.layers = [types.SimpleNamespace(kv=t) for t in _cache()]


def test_views_of_an_engine_objects_tensors_are_accepted_and_copies_refused(core_only):
    def unwrap(copy):
        def answer(obj):
            if not isinstance(obj, _EngineCache):
                return None
            return Detection(format=FMT, kv_caches=[(layer.kv.clone() if copy else layer.kv[:]) for layer in obj.layers])

        return answer

    kvcore.register_plugin(_Detects(unwrap(copy=False), "eng"), name="views")
    cache = _EngineCache()
    layout = kvcore.detect(cache, "eng")
    assert [t.data_ptr() for t in layout.kv_caches] == [layer.kv.data_ptr() for layer in cache.layers]
    kvcore.unregister_plugin("views")
    kvcore.register_plugin(_Detects(unwrap(copy=True), "eng"), name="copies")
    with pytest.warns(KVCorePluginWarning), pytest.raises(DetectionError, match="copies: .*not a view of the cache"):
        kvcore.detect(_EngineCache(), "eng")
