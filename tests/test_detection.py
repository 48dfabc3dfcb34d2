"""The detection driver, with a throwaway engine plugin: container normalisation, the
DetectionError message, ``kvcore.resolve`` and ``detect_per_layer``."""

from __future__ import annotations

import warnings

import pydantic
import pytest
import torch

import kvcore
from kvcore import AmbiguousLayoutError, Candidate, Detection, DetectionError, hookimpl, resolve
from kvcore.detection import normalize_container, physical_permutation

NB, BS, NH, HS = 6, 4, 2, 8


class ToyEngine:
    """Detects engine ``toy``: rank-5 ``[2, NB, X, Y, HS]`` pages (NHD or HND, decided by
    the ``kv_cache_layout`` hint), rank-3 MLA pages, and 2-D Mamba state (not KV)."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def kvcore_register_formats(self, register):
        for name in ("NL_X_NB_BS_HS", "NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"):
            register(kvcore.KVFormat(name=name, engines=["toy"]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != "toy":
            return None
        self.calls.append((type(kv_caches).__name__, len(kv_caches), dict(hints)))
        t0 = kv_caches[0]
        if not isinstance(t0, torch.Tensor):
            return None
        if t0.dim() == 2:
            return Detection(format=None, excluded="Mamba conv state (2-D), not KV")
        if t0.dim() == 3:
            return Detection(format="NL_X_NB_BS_HS", kv_caches=list(kv_caches), note="rank-3: MLA latent")
        if t0.dim() == 5 and t0.shape[0] == 2:
            cands = [
                Candidate("NL_X_TWO_NB_BS_NH_HS", list(kv_caches), decided_by={"kv_cache_layout": "NHD"}, label="NHD"),
                Candidate("NL_X_TWO_NB_NH_BS_HS", list(kv_caches), decided_by={"kv_cache_layout": "HND"}, label="HND"),
            ]
            want = hints.get("kv_cache_layout")
            if want:
                cands = [c for c in cands if c.decided_by["kv_cache_layout"] == want]
            return resolve(cands, engine=engine, deciding_hints=["kv_cache_layout"])
        return None


@pytest.fixture
def toy(core_only):
    plugin = ToyEngine()
    kvcore.register_plugin(plugin, name="toy-plugin")
    yield plugin


def _pages(n, dtype=torch.bfloat16, hs=HS):
    return [torch.zeros(2, NB, BS, NH, hs, dtype=dtype) for _ in range(n)]


def test_list_and_tuple_input(toy):
    kv = _pages(3)
    lay = kvcore.detect(kv, "toy", {"kv_cache_layout": "NHD"})
    assert lay.format.name == "NL_X_TWO_NB_BS_NH_HS"
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads) == (3, NB, BS, NH)
    assert lay.engine == "toy" and lay.layer_names is None
    assert lay.data_ptrs() == [t.data_ptr() for t in kv]
    # no copy: the layout's tensors are the caller's
    assert all(a is b for a, b in zip(lay.kv_caches, kv))
    hnd = kvcore.detect(tuple(kv), "toy", {"kv_cache_layout": "HND"})
    assert hnd.format.name == "NL_X_TWO_NB_NH_BS_HS" and (hnd.num_heads, hnd.block_size) == (BS, NH)
    assert toy.calls[1][0] == "tuple"


def test_dict_input_keeps_layer_order_by_index(toy):
    kv = _pages(12)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(12)]
    shuffled = {names[i]: kv[i] for i in [10, 9, 0, 11, 1, 2, 3, 4, 5, 6, 7, 8]}
    lay = kvcore.detect(shuffled, "toy", {"kv_cache_layout": "NHD"})
    assert lay.layer_names == tuple(names)
    assert lay.layer_names.index("model.layers.10.self_attn.attn") == lay.layer_names.index("model.layers.9.self_attn.attn") + 1
    assert lay.data_ptrs() == [t.data_ptr() for t in kv]
    # names with no layer index keep insertion order
    plain = {"b": kv[1], "a": kv[0]}
    lay = kvcore.detect(plain, "toy", {"kv_cache_layout": "NHD"})
    assert lay.layer_names == ("b", "a") and lay.data_ptrs() == [kv[1].data_ptr(), kv[0].data_ptr()]


def test_normalize_container():
    kv = _pages(2)
    assert normalize_container({"layers.1": kv[1], "layers.0": kv[0]}) == ([kv[0], kv[1]], ["layers.0", "layers.1"])
    c, names = normalize_container(tuple(kv))
    assert c == tuple(kv) and names is None
    for bad, match in [({}, "empty dict"), ([], "empty"), ((), "empty"), ([1, 2], "no torch.Tensor"), ("x", "no torch.Tensor")]:
        with pytest.raises(DetectionError, match=match):
            normalize_container(bad)


def test_hints_as_a_pydantic_model(toy):
    class Hints(pydantic.BaseModel):
        kv_cache_layout: str | None = None
        block_size: int | None = None

    lay = kvcore.detect(_pages(2), "toy", Hints(kv_cache_layout="HND"))
    assert lay.format.name == "NL_X_TWO_NB_NH_BS_HS"
    assert toy.calls[-1][2] == {"kv_cache_layout": "HND"}  # None values dropped
    with pytest.raises(DetectionError, match="hints must be a dict"):
        kvcore.detect(_pages(2), "toy", ["HND"])


def test_detection_error_says_shapes_dtypes_strides_engine_and_plugins(toy):
    t = torch.zeros(7, 3, 5, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(DetectionError) as ei:
        kvcore.detect([t, t], "nope", {"block_size": 16})
    msg = str(ei.value)
    assert "'nope'" in msg
    assert "shape=[7, 5, 3]" in msg and "stride=[15, 1, 5]" in msg and "dtype=float16" in msg and "device=cpu" in msg
    assert "kv_caches[0] .. (2 entries)" in msg
    assert "plugins asked: toy-plugin" in msg
    assert "block_size" in msg  # the hints it was given
    # a rank the toy plugin does not know, for its own engine
    with pytest.raises(DetectionError, match="shape=\\[2, 3, 4, 5\\]"):
        kvcore.detect([torch.zeros(2, 3, 4, 5)], "toy")


def test_detection_error_with_no_engine_plugin(core_only):
    with pytest.raises(DetectionError, match="plugins asked: none"):
        kvcore.detect([torch.zeros(2, NB, BS, NH, HS)], "vllm")


def test_not_kv_is_a_detection_error_for_detect(toy):
    with pytest.raises(DetectionError, match="not a KV cache: Mamba conv state"):
        kvcore.detect([torch.zeros(4, 4)], "toy")


def test_ambiguity_names_both_and_the_hint_then_the_hint_resolves(toy):
    kv = [torch.zeros(2, NB, 4, 4, HS) for _ in range(2)]  # BS == NH: both readings fit
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "toy")
    e = ei.value
    assert e.candidates == ["NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"]
    assert e.hints == ["kv_cache_layout"]
    msg = str(e)
    assert "NL_X_TWO_NB_BS_NH_HS [NHD]" in msg and "NL_X_TWO_NB_NH_BS_HS [HND]" in msg
    assert "kv_cache_layout='NHD'" in msg and "kv_cache_layout='HND'" in msg
    assert "toy:" in msg
    assert isinstance(e, DetectionError)
    assert kvcore.detect(kv, "toy", {"kv_cache_layout": "HND"}).format.name == "NL_X_TWO_NB_NH_BS_HS"


def test_resolve_collapses_identical_stride_tables(core_only):
    # vLLM-RBLN's [2, NB, NH, 1, BS, HS] moves exactly the bytes of [2, NB, NH, BS, HS]
    t = torch.zeros(2, NB, NH, 1, BS, HS)
    det = resolve(
        [Candidate("NL_X_TWO_NB_NH_ONE_BS_HS", [t], note="rbln"), Candidate("NL_X_TWO_NB_NH_BS_HS", [t.squeeze(3)], note="hnd")],
        engine="x",
    )
    assert det.format == "NL_X_TWO_NB_NH_ONE_BS_HS" and det.note == "rbln"
    # one head: NHD [NB, BS, 1, HS] and its HND view [NB, 1, BS, HS] are one answer,
    # whatever stride the size-1 head axis carries
    u = torch.zeros(NB, BS, 1, HS)
    v = u.view(NB, 1, BS, HS)
    assert u.stride(2) != v.stride(1)
    det = resolve([Candidate("NL_X_NB_BS_NH_HS", [u]), Candidate("NL_X_NB_NH_BS_HS", [v])], engine="x")
    assert det.format == "NL_X_NB_BS_NH_HS"


def test_resolve_different_tables_raise_naming_both_and_the_hints(core_only):
    t = torch.zeros(NB, 2, BS, NH, HS)
    c1 = Candidate("NL_X_NB_TWO_BS_NH_HS", [t], decided_by={"attention_backend": "FLASHINFER"})
    c2 = Candidate("NL_X_NB_TWO_NH_BS_HS", [t], decided_by={"kv_cache_layout": "HND"})
    with pytest.raises(AmbiguousLayoutError) as ei:
        resolve([c1, c2], engine="eng", deciding_hints=["kv_cache_layout"])
    assert ei.value.candidates == ["NL_X_NB_TWO_BS_NH_HS", "NL_X_NB_TWO_NH_BS_HS"]
    # the geometry hints decide too: the readings swap block size (4) and heads (2)
    assert ei.value.hints == ["kv_cache_layout", "attention_backend", "block_size", "num_kv_heads"]
    assert "[6, 2, 4, 2, 8]" in str(ei.value) and "BS=4, NH=2" in str(ei.value) and "BS=2, NH=4" in str(ei.value)


def test_resolve_drops_candidates_that_do_not_fit(core_only):
    t = torch.zeros(NB, BS, HS)
    det = resolve([Candidate("NL_X_TWO_NB_BS_NH_HS", [t]), Candidate("NL_X_NB_BS_HS", [t], dtype=None)], engine="x")
    assert det.format == "NL_X_NB_BS_HS"
    assert resolve([Candidate("NL_X_TWO_NB_BS_NH_HS", [t])], engine="x") is None
    assert resolve([], engine="x") is None


def test_detect_per_layer_groups_hybrid_models(toy):
    attn = _pages(1)[0], _pages(1)[0]
    wide = torch.zeros(2, NB, BS, NH, 2 * HS, dtype=torch.bfloat16)  # a head size twice as big
    mla = torch.zeros(NB, BS, 576, dtype=torch.bfloat16)  # rank-3 indexer beside rank-5 attention
    mamba = torch.zeros(NB, 32, dtype=torch.bfloat16)
    kv = {
        "model.layers.0.attn": attn[0],
        "model.layers.1.indexer": mla,
        "model.layers.2.attn": attn[1],
        "model.layers.3.mamba": mamba,
        "model.layers.4.attn": wide,
    }
    res = kvcore.detect_per_layer(kv, "toy", hints={"kv_cache_layout": "NHD"})
    assert isinstance(res, dict) and list(res) == list(kv)  # a dict in: a dict out, the same keys in the same order
    out = list(res.values())
    assert out[0] is out[2]
    assert out[0].format.name == "NL_X_TWO_NB_BS_NH_HS" and out[0].layer_ids == (0, 2) and out[0].head_size == HS
    assert out[0].layer_names == ("model.layers.0.attn", "model.layers.2.attn")
    assert out[0].data_ptrs() == [attn[0].data_ptr(), attn[1].data_ptr()]
    assert out[1].format.name == "NL_X_NB_BS_HS" and out[1].layer_ids == (1,) and out[1].head_size == 576
    assert out[3] is None
    assert out[4].layer_ids == (4,) and out[4].head_size == 2 * HS
    # the engine's groups split like layers apart
    out = kvcore.detect_per_layer([attn[0], attn[1], mla], "toy", layer_groups=[[1], [0]], hints={"kv_cache_layout": "NHD"})
    assert out[0] is not out[1] and out[0].layer_ids == (0,) and out[1].layer_ids == (1,) and out[2].layer_ids == (2,)
    with pytest.raises(DetectionError, match="more than one group"):
        kvcore.detect_per_layer([attn[0], attn[1]], "toy", layer_groups=[[0, 1], [1]])
    with pytest.raises(DetectionError, match="names layers \\[5\\]"):
        kvcore.detect_per_layer([attn[0], attn[1]], "toy", layer_groups=[[0, 5]])
    with pytest.raises(DetectionError, match="layers \\[0\\]"):
        kvcore.detect_per_layer([torch.zeros(2, 2, 2, 2)], "toy")
    with pytest.raises(AmbiguousLayoutError):
        kvcore.detect_per_layer([attn[0]], "toy")


def test_physical_permutation():
    t = torch.zeros(2, 3, 4).permute(2, 0, 1)  # strides (1, 12, 4)
    assert physical_permutation(t) == [1, 2, 0]
    u = torch.zeros(5, 1, 3)
    assert physical_permutation(u) == [0, 1, 2]
    hnd_as_nhd = torch.zeros(2, NB, NH, BS, HS).transpose(2, 3)  # vLLM <= 0.23 HND, NHD shape
    assert physical_permutation(hnd_as_nhd) == [0, 1, 3, 2, 4]


def test_exceptions_are_importable_from_kvcore():
    for name in ("KVCoreError", "FormatError", "DetectionError", "AmbiguousLayoutError", "GeometryError", "TransferError", "PluginError"):
        cls = getattr(kvcore, name)
        assert issubclass(cls, kvcore.KVCoreError) and name in kvcore.__all__
    assert issubclass(kvcore.AmbiguousLayoutError, kvcore.DetectionError)
    from kvcore.errors import AmbiguousLayoutError as A

    assert A is kvcore.AmbiguousLayoutError


def test_a_crashing_or_misbehaving_detect_hook_is_a_detection_error(core_only):
    class Crash:
        @hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            return kv_caches[0].shape[7]  # IndexError on these tensors

    kvcore.register_plugin(Crash(), name="crash")
    t = torch.zeros(2, 3)
    with pytest.warns(kvcore.KVCorePluginWarning, match="'crash' misbehaved"):
        with pytest.raises(DetectionError, match=r"crash: kvcore_detect\(engine='e'\) raised IndexError") as ei:
            kvcore.detect([t], "e")
    assert "shape=[2, 3]" in str(ei.value)
    with pytest.raises(DetectionError, match="IndexError"):
        kvcore.detect_per_layer([t], "e")
    kvcore.unregister_plugin("crash")

    class Wrong:
        @hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            return "NL_X_NB_BS_HS"

    kvcore.register_plugin(Wrong(), name="wrong")
    with pytest.warns(kvcore.KVCorePluginWarning), pytest.raises(DetectionError, match="wrong: .*must return a kvcore.Detection"):
        kvcore.detect([t], "e")


def test_a_detection_whose_tensors_do_not_fit_is_a_detection_error(core_only):
    class Liar:
        @hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_TWO_NB_BS_NH_HS"))

        @hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            return Detection(format="NL_X_TWO_NB_BS_NH_HS", kv_caches=list(kv_caches))  # these are rank 3

    kvcore.register_plugin(Liar(), name="liar")
    t = torch.zeros(NB, BS, HS)
    for i, call in enumerate((lambda: kvcore.detect([t], "e"), lambda: kvcore.detect_per_layer([t], "e"))):
        # the plugin's answer is unusable: it is named and skipped (a warning, once), and with
        # no other answer the error names it, says why, and lists the tensors
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            with pytest.raises(DetectionError, match="liar: .*detected NL_X_TWO_NB_BS_NH_HS but the tensors do not fit it") as ei:
                call()
        assert [str(w.message)[:37] for w in rec] == (["kvcore plugin 'liar' misbehaved and w"] if i == 0 else [])
        assert "shape=[6, 4, 8]" in str(ei.value)
        assert isinstance(ei.value.__cause__.__cause__, kvcore.GeometryError)


# -- review item 9: a {role: container} dict keeps its roles ----------------------------------

KV_PLANES = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS"


class _PlanesEngine:
    """Detects engine ``pl``: a multi-plane cache handed over as ``{role: per-layer list}``."""

    def __init__(self):
        self.got = []

    @hookimpl
    def kvcore_register_formats(self, register):
        register(kvcore.KVFormat(name=KV_PLANES, engines=["pl"]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != "pl":
            return None
        self.got.append((type(kv_caches).__name__, list(kv_caches) if hasattr(kv_caches, "keys") else len(kv_caches)))
        if not isinstance(kv_caches, kvcore.Planes):
            raise DetectionError("pl: pass the planes as a dict {role: per-layer list}")
        return Detection(format=KV_PLANES, kv_caches={"K": kv_caches["K"], "V": kv_caches["V"]})


@pytest.mark.parametrize("wrap", ["dict", "dict-V-first", "Planes"])
def test_a_dict_of_plane_roles_reaches_the_detector_as_roles_never_as_layer_names(core_only, wrap):
    """Review item 9: ``{"V": V, "K": K}`` was turned into a list of two 'layers' named V and
    K (a plugin could only guess K from position, and staged V as K). A dict whose keys are
    plane roles reaches kvcore_detect as a kvcore.Planes mapping, roles intact; no layer
    names; the staged K plane holds K's values."""
    plugin = _PlanesEngine()
    kvcore.register_plugin(plugin, name="planes-plugin")
    k = [torch.full((NB, BS, NH, HS), 1.0 + i) for i in range(2)]
    v = [torch.full((NB, BS, NH, HS), 10.0 + i) for i in range(2)]
    cache = {"dict": {"K": k, "V": v}, "dict-V-first": {"V": v, "K": k}, "Planes": kvcore.Planes(V=v, K=k)}[wrap]
    lay = kvcore.detect(cache, "pl")
    assert plugin.got == [("Planes", list(cache))]
    assert lay.layer_names is None and lay.num_layers == 2
    staged = kvcore.gather(lay, torch.tensor([0, 5]))
    assert staged[0, 1, 1, 0].item() == 2.0 and staged[1, 0, 0, 0].item() == 10.0  # K is K, V is V
    assert kvcore.detect_per_layer(cache, "pl")[0].format.name == KV_PLANES


def test_layer_name_dicts_stay_layers_and_roles_with_digits_need_planes(core_only):
    plugin = _PlanesEngine()
    kvcore.register_plugin(plugin, name="planes-plugin")
    k = [torch.zeros(NB, BS, NH, HS) for _ in range(2)]
    # layer names (they carry a number) are layers, never roles
    with pytest.raises(DetectionError, match="pass the planes"):
        kvcore.detect({"layers.0": k[0], "layers.1": k[1]}, "pl")
    assert plugin.got[-1] == ("Layers", 2)  # a kvcore.Layers: a list whose items are layers
    # a role with a digit reads as a layer name in a plain dict; kvcore.Planes says it is a role
    with pytest.raises(DetectionError, match="pass the planes"):
        kvcore.detect({"K": k, "K2": k}, "pl")
    assert plugin.got[-1] == ("Layers", 2)  # a kvcore.Layers: a list whose items are layers
    with pytest.warns(kvcore.KVCorePluginWarning, match="KeyError: 'V'"), pytest.raises(DetectionError):
        kvcore.detect(kvcore.Planes(K=k, K2=k), "pl")  # the plugin gets the roles (and has no V plane to read)
    assert plugin.got[-1] == ("Planes", ["K", "K2"])
    with pytest.raises(DetectionError, match="'k' is not one"):
        kvcore.detect(kvcore.Planes(k=k), "pl")


@pytest.mark.parametrize("keys", [("k", "v"), ("key", "value"), ("key_cache", "value_cache"), ("Keys", "Values", "Scales"), ("V", "k")])
def test_a_dict_of_containers_keyed_neither_by_role_nor_by_layer_number_is_refused(core_only, keys):
    """Review item 9, the rest of the class: ``{"k": [...], "v": [...]}`` read as two layers
    named k and v paired layer 0's K with layer 1's K (wrong bytes, silently). Keys that are
    not all upper-case roles and carry no layer number say nothing about what they are: the
    door refuses them, naming both ways to say it, before any plugin is asked."""
    plugin = _PlanesEngine()
    kvcore.register_plugin(plugin, name="planes-plugin")
    lists = {k: [torch.zeros(NB, BS, NH, HS) for _ in range(2)] for k in keys}
    for call in (lambda: kvcore.detect(lists, "pl"), lambda: kvcore.detect_per_layer(lists, "pl")):
        with pytest.raises(DetectionError, match="carry no layer number: each key reads either as a plane role or as a layer name"):
            call()
    assert plugin.got == []
    # the same tensors under numbered layer names, or as upper-case roles, are read as such
    with pytest.raises(DetectionError, match="pass the planes"):
        kvcore.detect({f"layers.{i}": v for i, v in enumerate(lists.values())}, "pl")
    assert plugin.got == [("Layers", len(keys))]
    # a dict of tensors (not containers) without layer numbers stays a dict of layers, in order
    assert normalize_container({"attn": torch.zeros(2, NB, BS, NH, HS), "cross": torch.zeros(2, NB, BS, NH, HS)})[1] == [
        "attn",
        "cross",
    ]


# -- review item 10: the ambiguity error says truthfully what decides -------------------------


class _FourWays:
    """Four readings of one contiguous ``[4, 4, 4, HS]`` tensor: (backend A or B) x (layout
    NHD or HND), each placing bytes differently; versions as alternatives ("1/2" selects
    both backends' readings, "3" only B's)."""

    NAMES = {
        ("A", "NHD"): "NL_X_NB_BS_NH_HS",
        ("A", "HND"): "NL_X_NB_NH_BS_HS",
        ("B", "NHD"): "NL_X_BS_NB_NH_HS",
        ("B", "HND"): "NL_X_NH_NB_BS_HS",
    }

    @hookimpl
    def kvcore_register_formats(self, register):
        for name in self.NAMES.values():
            register(kvcore.KVFormat(name=name, engines=["four"]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != "four":
            return None
        cands = []
        for (backend, layout), fmt in self.NAMES.items():
            sel = {"version": "1/2" if backend == "A" else "1/2/3", "backend": backend, "layout": layout}
            if all(hints.get(h) is None or str(hints[h]) in str(val).split("/") for h, val in sel.items()):
                cands.append(Candidate(fmt, list(kv_caches), decided_by=sel, label=f"{backend} {layout}"))
        return resolve(cands, engine="four", geometry_hints={})


def test_the_ambiguity_error_names_only_hints_that_decide_and_says_when_they_must_go_together(core_only):
    """Review item 10: with more than two candidates "pass one of these hints" was untrue:
    after naming version, backend and layout, passing layout alone still left 2, backend
    alone 4. The error now says which hints decide alone, else which decide together (and
    the values that select each reading), never a hint the caller gave; following it
    decides."""
    kvcore.register_plugin(_FourWays(), name="four")
    t = [torch.zeros(4, 4, 4, 8)]  # NB = BS = NH: every reading fits
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(t, "four")
    msg = str(ei.value)
    assert "No one hint decides between these 4 layouts; pass these hints together: backend, layout" in msg
    assert "Pass one of these" not in msg and ei.value.decide == [["backend", "layout"]]
    assert set(ei.value.hints) == {"version", "backend", "layout"}
    # the advice is true: backend and layout together decide, whatever the pair
    for backend in "AB":
        for layout in ("NHD", "HND"):
            lay = kvcore.detect(t, "four", {"backend": backend, "layout": layout})
            assert lay.format.name == _FourWays.NAMES[backend, layout]
    # with layout given, two readings are left and backend alone decides; version does not
    # (version 1 selects both), so it is not offered
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(t, "four", {"layout": "NHD"})
    assert str(ei.value).endswith("Pass one of these hints to decide: backend") and ei.value.decide == [["backend"]]
    assert "layout" not in ei.value.hints
    # with backend given, two readings are left; layout decides
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(t, "four", {"backend": "B"})
    assert str(ei.value).endswith("Pass one of these hints to decide: layout")
    # version 3 selects only B's readings: the error says layout then
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(t, "four", {"version": "3"})
    assert str(ei.value).endswith("Pass one of these hints to decide: layout")


class _Table:
    """Readings of one contiguous ``[4, 4, 4, HS]`` tensor (NB = BS = NH: every template
    fits), each selected by hint values (``"a/b"``: either); a reading stays while every
    hint given is one of its values."""

    def __init__(self, engine, readings):
        self.engine, self.readings = engine, readings

    @hookimpl
    def kvcore_register_formats(self, register):
        for fmt, _ in self.readings:
            register(kvcore.KVFormat(name=fmt, engines=[self.engine]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != self.engine:
            return None
        cands = [
            Candidate(fmt, list(kv_caches), decided_by=sel, label=fmt)
            for fmt, sel in self.readings
            if all(hints.get(h) is None or str(hints[h]) in str(v).split("/") for h, v in sel.items())
        ]
        return resolve(cands, engine=engine, geometry_hints={})


_TABLES = {
    # vLLM 0.26's packed K|V: two readings share backends ("FA"), the CPU one shares the layout
    "overlapping-alternatives": (
        [
            ("NL_X_NB_BS_NH_HS", {"backend": "FA/FLEX", "layout": "NHD"}),
            ("NL_X_NB_NH_BS_HS", {"backend": "FA/AITER", "layout": "HND"}),
            ("NL_X_BS_NB_NH_HS", {"backend": "CPU", "layout": "HND"}),
        ],
        [["backend", "layout"]],
    ),
    "one-hint-three-values": (
        [
            ("NL_X_NB_BS_NH_HS", {"layout": "NHD", "version": "1/2"}),
            ("NL_X_NB_NH_BS_HS", {"layout": "HND", "version": "2/3"}),
            ("NL_X_BS_NB_NH_HS", {"layout": "BNHD", "version": "3"}),
        ],
        [["layout"]],
    ),
    "two-hints-each-alone": (
        [
            ("NL_X_NB_BS_NH_HS", {"layout": "NHD", "backend": "A"}),
            ("NL_X_NB_NH_BS_HS", {"layout": "HND", "backend": "B"}),
            ("NL_X_BS_NB_NH_HS", {"layout": "BNHD", "backend": "C"}),
        ],
        [["layout"], ["backend"]],
    ),
    "three-hints-together": (
        [
            ("NL_X_NB_BS_NH_HS", {"a": "1", "b": "1", "c": "1"}),
            ("NL_X_NB_NH_BS_HS", {"a": "2", "b": "1", "c": "1"}),
            ("NL_X_BS_NB_NH_HS", {"a": "1", "b": "2", "c": "1"}),
            ("NL_X_NH_NB_BS_HS", {"a": "1", "b": "1", "c": "2"}),
        ],
        [["a", "b", "c"]],
    ),
    "nothing-decides": (
        [
            ("NL_X_NB_BS_NH_HS", {"a": "1/2"}),
            ("NL_X_NB_NH_BS_HS", {"a": "2/3"}),
            ("NL_X_BS_NB_NH_HS", {"a": "3/1"}),
        ],
        [],
    ),
}


def _values(sel, key):
    return str(sel[key]).split("/") if key in sel else []


@pytest.mark.parametrize("table", list(_TABLES))
def test_the_ambiguity_advice_is_true_for_every_value_a_reading_accepts(core_only, table):
    """Review item 10, the whole class: whatever the readings' values (alternatives that
    overlap, one hint with many values, hints that decide only together, hints that never
    decide), the error's claim holds for *every* value that selects a reading: a hint said to
    decide alone leaves exactly that reading whichever of its values is passed; hints said
    to decide together do so for every combination; a hint not offered as deciding alone
    has a value that leaves two readings; and when nothing decides, the error says so."""
    import itertools

    readings, want = _TABLES[table]
    kvcore.register_plugin(_Table("tbl", readings), name="tbl")
    t = [torch.zeros(4, 4, 4, 8)]
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(t, "tbl")
    err, msg = ei.value, str(ei.value)
    assert err.decide == want, msg
    last = msg.splitlines()[-1]
    if not want:
        assert last.startswith("These hints narrow it down but do not tell all 3 layouts apart, even together"), last
    elif len(want[0]) == 1:
        assert last == f"Pass one of these hints to decide: {', '.join(d[0] for d in want)}"
    else:
        assert last.startswith(
            f"No one hint decides between these {len(readings)} layouts; pass these hints together: {', '.join(want[0])}"
        )
    for keys in want:
        for fmt, sel in readings:
            for combo in itertools.product(*(_values(sel, k) for k in keys)):
                assert kvcore.detect(t, "tbl", dict(zip(keys, combo))).format.name == fmt, (keys, combo)
    alone = {d[0] for d in want if len(d) == 1}
    for key in set(err.hints) - alone:  # not offered alone: some value of it leaves two readings
        vals = {v for _, sel in readings for v in _values(sel, key)}
        assert any(sum(v in _values(sel, key) for _, sel in readings) > 1 for v in vals), key
