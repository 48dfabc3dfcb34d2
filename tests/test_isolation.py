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
    # 'bad' is registered first: among the plugins serving an engine that are not named after
    # it, load order decides, so it is asked before 'goodplug'
    kvcore.register_plugin(bad, name="bad")
    kvcore.register_plugin(_good_plugin(), name="goodplug")
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
    assert not any("KVCORE_DISABLE_PLUGINS=goodplug" in m for m in msgs)
    # strict mode: the same is an error naming the plugin
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=f"'bad' misbehaved.*{why[:12]}"):
        kvcore.detect(_cache(), "good")


def test_the_right_plugins_answer_is_a_view_of_the_callers_tensors(core_only):
    cache = _cache()
    with pytest.warns(KVCorePluginWarning):
        kvcore.register_plugin(_Detects(lambda kv: Detection(format=FMT, kv_caches=[t.clone() for t in kv]), "good"), name="bad")
        kvcore.register_plugin(_good_plugin(), name="goodplug")
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
    kvcore.unregister_plugin("goodplug")
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


def test_a_raising_kernel_is_named_and_the_transfer_redone_and_a_raising_available_falls_back(core_only):
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
    assert "why() raised RuntimeError" in next(k for k in registry.kernels() if k.name == "flaky").why()
    with pytest.warns(KVCorePluginWarning, match="kernel 'flaky' of plugin 'flaky' failed in gather: RuntimeError: CUDA error"):
        out = kvcore.gather(lay, [0, 1])  # redone by the next kernel (tests/test_plugin_robustness.py)
    assert torch.equal(out[0, 1, 1], _cache()[1][0, 0, 1].flatten())
    assert "marked broken" in next(k for k in registry.kernels() if k.name == "flaky").why()
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

    kvcore.register_plugin(_Declares(unwrap(copy=False), "eng"), name="views")
    cache = _EngineCache()
    layout = kvcore.detect(cache, "eng")
    assert [t.data_ptr() for t in layout.kv_caches] == [layer.kv.data_ptr() for layer in cache.layers]
    kvcore.unregister_plugin("views")
    kvcore.register_plugin(_Declares(unwrap(copy=True), "eng"), name="copies")
    with pytest.warns(KVCorePluginWarning), pytest.raises(DetectionError, match="copies: .*not a view of the cache"):
        kvcore.detect(_EngineCache(), "eng")


# -- review: a detection that cannot be used is the plugin's fault, not the caller's ----------


class _Declares(_Detects):
    """Like _Detects, but declares FMT (and NL_X_NB_BS_HS) for the engine (as the reviewer's plugins did for vllm):
    it is asked among the engine's own plugins, first."""

    @hookimpl
    def kvcore_register_formats(self, register):
        for name in (FMT, "NL_X_NB_BS_HS"):
            register(KVFormat(name=name, engines=[self.declares]))


@pytest.mark.parametrize(
    "answer, why",
    [
        (lambda kv: Detection(format="NOT_A_FORMAT_XX", kv_caches=kv), "unknown token 'NOT'"),
        (lambda kv: Detection(format="NL_X_NB_BS_HS", kv_caches=kv), "detected NL_X_NB_BS_HS but the tensors do not fit it"),
        # fits the tensors (an HND reading, other bytes) but no plugin registers it
        (lambda kv: Detection(format="NL_X_TWO_NB_NH_BS_HS", kv_caches=kv), "a format no loaded plugin registers"),
        (lambda kv: Detection(format=42, kv_caches=kv), "must be a format name"),
        (lambda kv: Detection(format="NL_X_TWO_NB_BS_NH_HS", kv_caches=[t._neg_view() for t in kv]), "lazy negation bit"),
    ],
    ids=["unparseable-format", "format-that-does-not-fit", "unregistered-format", "format-not-a-name", "negated-views"],
)
def test_a_detection_that_does_not_build_is_named_and_skipped_and_the_right_plugin_answers(core_only, monkeypatch, answer, why):
    """Review item 2: a plugin serving the engine whose Detection names a format that does
    not parse, or one the tensors do not fit (3-D template for 5-D tensors), used to
    pre-empt the right plugin with a FormatError/DetectionError that did not name it. Now it
    is named and skipped with a warning and the other plugin answers; alone, the error names
    it; under strict mode it is an error naming it."""
    kvcore.register_plugin(_Declares(answer, declares="good"), name="bad")  # registered first: asked first
    kvcore.register_plugin(_good_plugin(), name="goodplug")
    with pytest.warns(KVCorePluginWarning) as rec:
        layout = kvcore.detect(_cache(), "good")
    assert layout.format.name == FMT and layout.plugin == "goodplug"
    assert torch.equal(kvcore.gather(layout, [1])[1, 0, 0], _cache()[0][1, 0, 1].reshape(-1))
    msgs = [str(r.message) for r in rec]
    assert any("'bad' misbehaved and was skipped" in m and why in m for m in msgs), msgs
    assert not any("KVCORE_DISABLE_PLUGINS=goodplug" in m for m in msgs)
    kvcore.unregister_plugin("goodplug")
    with (
        pytest.raises(DetectionError, match=f"no kvcore plugin gave a usable answer.*\\n  bad: .*{why[:20]}"),
    ):
        kvcore.detect(_cache(), "good")
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=f"'bad' misbehaved: .*{why[:20]}"):
        kvcore.detect(_cache(), "good")


def test_each_plugin_gets_its_own_copy_of_the_hints(core_only):
    """Review item 4: a plugin that edits ``hints`` (top level or nested) changes nothing the
    next plugin, or the caller, sees."""
    seen: list = []

    class Meddler:
        @hookimpl
        def kvcore_register_formats(self, register):
            register(KVFormat(name=FMT, engines=["good"]))

        @hookimpl(tryfirst=True)
        def kvcore_detect(self, kv_caches, engine, hints):
            seen.append(("meddler", repr(hints)))
            hints["kv_cache_layout"] = "HND"
            hints["nested"]["x"].append(99)
            hints["nested"]["y"] = {"z"}
            hints["nested"]["t"][0].append(4)  # a list inside a tuple
            hints["nested"]["s"].add(9)
            hints.pop("keep")
            return None

    class Witness:
        @hookimpl
        def kvcore_register_formats(self, register):
            register(KVFormat(name=FMT, engines=["good"]))

        @hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            seen.append(("witness", repr(hints)))
            return None

    kvcore.register_plugin(Witness(), name="witness")
    kvcore.register_plugin(_good_plugin(), name="goodplug")
    kvcore.register_plugin(Meddler(), name="meddler")  # tryfirst: asked first, though registered last

    def fresh():
        return {"keep": 1, "nested": {"x": [1, 2], "t": ([3],), "s": {1}}}

    want = repr(fresh())
    for call in (kvcore.detect, kvcore.detect_per_layer):
        seen.clear()
        hints = fresh()
        call(_cache(), "good", hints=hints)
        assert hints == fresh()
        assert seen == [("meddler", want), ("witness", want)], call.__name__


def _deep(t, n):
    for _ in range(n):
        t = [t]
    return t


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda t: [torch.nested.nested_tensor([t[0, 0], t[0, 1, :2]])], kvcore.GeometryError, "nested tensor"),
        (lambda t: [t.to_sparse()], kvcore.GeometryError, "sparse_coo tensor"),
        (lambda t: [t.to_sparse_csr() if t.dim() == 2 else t.flatten(0, 3).to_sparse_csr()], kvcore.GeometryError, "sparse_csr"),
        (lambda t: [t.flatten(0, 3).to_sparse_bsr((2, 2))], kvcore.GeometryError, "sparse_bsr"),
        (lambda t: [t.to_mkldnn() if torch.backends.mkldnn.is_available() else t.to_sparse()], kvcore.GeometryError, "mkldnn|sparse"),
        (lambda t: kvcore.Planes(K=[t[0]], V=[t[1].to_sparse()]), kvcore.GeometryError, r"kv_caches\['V'\]\[0\] is a sparse_coo"),
        (lambda t: [t._neg_view()], kvcore.GeometryError, "lazy negation bit"),
        (lambda t: [torch.complex(t, t).conj()], kvcore.GeometryError, "lazy conjugation bit"),
        (lambda t: [[[[[t]]]]], DetectionError, "nested more than 4 levels deep"),
        (lambda t: {"model.layers.0": [[[[t]]]]}, DetectionError, "nested more than 4 levels deep"),
        (lambda t: kvcore.Planes(K=[[[[t]]]]), DetectionError, "nested more than 4 levels deep"),
        (lambda t: _deep(t, 10_000), DetectionError, "nested more than 4 levels deep"),
    ],
    ids=[
        "nested",
        "sparse-coo",
        "sparse-csr",
        "sparse-bsr",
        "mkldnn",
        "planes-sparse",
        "neg-view",
        "conj-view",
        "depth-5",
        "dict-depth-5",
        "planes-depth-5",
        "depth-10000",
    ],
)
def test_input_no_layout_describes_is_refused_at_the_door_before_any_plugin(core_only, make, error, words):
    """Review item 3: nested, sparse (any non-strided layout), negated/conjugated views and
    unreasonable nesting are refused before any plugin is asked (a plugin that would crash
    on them is never blamed), with a KVCoreError naming the path and what is wrong."""
    asked = []

    class Fragile:
        @hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            asked.append(engine)
            return kv_caches[0].shape[7]  # would crash on anything

    kvcore.register_plugin(Fragile(), name="fragile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype/beta warnings for nested and sparse CSR tensors
        bad = make(torch.zeros(2, NB, BS, NH, HS))
        for call in (lambda: kvcore.detect(bad, "e"), lambda: kvcore.detect_per_layer(bad, "e")):
            with pytest.raises(error, match=words) as ei:
                call()
            assert "kv_caches" in str(ei.value) and "misbehaved" not in str(ei.value)
        if error is kvcore.GeometryError:  # build_layout refuses the same tensors
            with pytest.raises(kvcore.GeometryError, match=words):
                kvcore.build_layout(FMT, bad)
    assert asked == []


def test_a_container_that_contains_itself_is_refused_at_the_door(core_only):
    t = torch.zeros(2, NB, BS, NH, HS)
    loop: list = [t]
    loop.append(loop)
    looped_dict: dict = {"layers.0": t}
    looped_dict["layers.1"] = looped_dict
    inner: list = [t]
    through_tuple = [inner]
    inner.append((through_tuple,))  # the loop passes through a tuple and two lists
    for bad, where in ((loop, r"kv_caches\[1\]"), (looped_dict, r"kv_caches\['layers.1'\]"), (through_tuple, r"kv_caches\[0\]\[1\]\[0\]")):
        for call in (kvcore.detect, kvcore.detect_per_layer):
            with pytest.raises(DetectionError, match=where + " contains itself"):
                call(bad, "e")
        with pytest.raises(kvcore.GeometryError, match="contains itself"):
            kvcore.build_layout(FMT, bad)


def test_an_engines_bound_layers_three_levels_deep_pass_the_door(core_only):
    """vLLM binds each layer as a list per virtual engine holding a tensor, a (K, V) pair or a
    Mamba state pair: ``{name: [(K, V)]}`` is three levels and reaches the plugins."""
    got = []

    class Sees:
        @hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            got.append(kv_caches)
            return None

    kvcore.register_plugin(Sees(), name="sees")
    k, v = torch.zeros(NB, BS, NH, HS), torch.zeros(NB, BS, NH, HS)
    with pytest.raises(DetectionError, match="no kvcore plugin recognises"):
        kvcore.detect({"model.layers.0.attn": [(k, v)]}, "e")
    assert got == [[[(k, v)]]]
