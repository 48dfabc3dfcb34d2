"""Never guess: the core's rules for tensors that read two ways (``kvcore.resolve`` with
``Candidate.order`` / ``against`` and the generic ``tensor_order`` hint), the reasons of
rejected readings, hints named only when they would decide, layer aliases, and
``detect_per_layer`` keeping the input's order and keys.

The toy engine ``twin`` allocates per layer ``[2, NB, BS, NH, HS]`` (NHD) by default, or
with strides that put heads outside tokens (HND, like vLLM <= 0.23's FlashAttention):
the tensors keep the logical NHD shape, the strides show the memory order.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import AmbiguousLayoutError, Candidate, DetectionError, hookimpl, resolve
from kvcore.detection import TENSOR_ORDER, memory_ordered, split_aliases, tensor_order

NB, HS = 5, 8
NHD, HND = "NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"
PERM = (0, 1, 3, 2, 4)  # NHD <-> HND axes


def allocate(layout: str, nl=2, bs=4, nh=2, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """The engine's allocation: logical [2, NB, BS, NH, HS]; HND memory is [2, NB, NH, BS, HS]."""
    if layout == "NHD":
        return [torch.zeros(2, NB, bs, nh, HS, dtype=dtype) for _ in range(nl)]
    return [torch.zeros(2, NB, nh, bs, HS, dtype=dtype).permute(PERM) for _ in range(nl)]


class Twin:
    """Reads [2, NB, X, Y, HS] the way the vLLM plugin does: the logical NHD shape through
    its strides (NHD or HND memory), or the tensor already in memory order as HND."""

    @hookimpl
    def kvcore_register_formats(self, register):
        for name in (NHD, HND):
            register(kvcore.KVFormat(name=name, engines=["twin"]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != "twin":
            return None
        ts = list(kv_caches)
        want = hints.get("kv_cache_layout")
        cands = []
        for key, fmt, perm in (("NHD", NHD, (0, 1, 2, 3, 4)), ("HND", HND, PERM)):
            views = [t.permute(perm) for t in ts]
            if not all(memory_ordered(v) for v in views):
                continue
            order = None if perm == (0, 1, 2, 3, 4) else "allocated"
            against = {"kv_cache_layout": want} if want and want != key else {}
            cands.append(
                Candidate(fmt, views, decided_by={"kv_cache_layout": key}, label=f"{key} as allocated", order=order, against=against)
            )
        if all(memory_ordered(t) for t in ts):  # the tensor read as already in memory order: HND
            against = {"kv_cache_layout": want} if want and want != "HND" else {}
            cands.append(
                Candidate(HND, ts, decided_by={"kv_cache_layout": "HND"}, label="HND in memory order", order="physical", against=against)
            )
        nh = hints.get("num_kv_heads")
        if nh is not None:
            cands = [c for c in cands if c.kv_caches[0].shape[3 if c.format == NHD else 2] == nh]
        return resolve(cands, engine="twin", deciding_hints=["kv_cache_layout"])


@pytest.fixture
def twin(core_only):
    kvcore.register_plugin(Twin(), name="twin-plugin")
    yield


def test_a_permuted_allocation_is_decided_by_its_strides(twin):
    lay = kvcore.detect(allocate("HND"), "twin")
    assert lay.format.name == HND and (lay.block_size, lay.num_heads) == (4, 2)


def test_a_contiguous_twin_is_ambiguous_and_names_the_deciding_hints(twin):
    kv = allocate("NHD", bs=4, nh=2)
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "twin")
    e = ei.value
    assert e.candidates == [NHD, HND]
    assert e.hints == ["kv_cache_layout", "block_size", "num_kv_heads", TENSOR_ORDER]
    msg = str(e)
    assert "BS=4, NH=2" in msg and "BS=2, NH=4" in msg and "tensor_order='allocated'" in msg
    # each of them decides
    assert kvcore.detect(kv, "twin", {"kv_cache_layout": "NHD"}).format.name == NHD
    assert kvcore.detect(kv, "twin", {TENSOR_ORDER: "allocated"}).format.name == NHD
    assert kvcore.detect(kv, "twin", {"num_kv_heads": 2}).num_heads == 2
    lay = kvcore.detect(kv, "twin", {"num_kv_heads": 4})
    assert (lay.format.name, lay.block_size, lay.num_heads) == (HND, 2, 4)
    lay = kvcore.detect(kv, "twin", {TENSOR_ORDER: "physical", "kv_cache_layout": "HND"})
    assert (lay.format.name, lay.block_size, lay.num_heads) == (HND, 2, 4)


def test_bs_equal_nh_is_ambiguous_without_a_layout_hint(twin):
    kv = allocate("NHD", bs=4, nh=4)
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "twin")
    assert ei.value.hints == ["kv_cache_layout", TENSOR_ORDER]  # the geometry is the same both ways: no size hint decides


def test_a_layout_hint_that_contradicts_the_strides_is_an_error_naming_both(twin):
    kv = allocate("NHD", bs=4, nh=2)  # memory says NHD
    with pytest.raises(DetectionError) as ei:
        kvcore.detect(kv, "twin", {"kv_cache_layout": "HND"})
    msg = str(ei.value)
    assert not isinstance(ei.value, AmbiguousLayoutError)
    assert "kv_cache_layout='HND'" in msg and f"{NHD} [NHD as allocated]" in msg and "BS=4, NH=2" in msg
    assert "tensor_order='physical'" in msg  # the way out when the tensor really is HND in memory order
    # an HND allocation given an NHD hint: the strides show HND, and nothing else reads
    with pytest.raises(DetectionError, match="kv_cache_layout='NHD'.*NL_X_TWO_NB_NH_BS_HS"):
        kvcore.detect(allocate("HND"), "twin", {"kv_cache_layout": "NHD"})


def test_tensor_order_contradicting_the_strides_is_an_error(twin):
    with pytest.raises(DetectionError, match="tensor_order='physical' says the tensors' axes are in memory order"):
        kvcore.detect(allocate("HND"), "twin", {TENSOR_ORDER: "physical"})
    # resolve says the same to a plugin whose readings are all of the other order
    views = [t.permute(PERM) for t in allocate("HND")]
    c = Candidate(HND, views, order="allocated")
    with pytest.raises(DetectionError, match="tensor_order='physical' says the tensors' axes are already in memory order"):
        resolve([c], engine="twin", hints={TENSOR_ORDER: "physical"})
    with pytest.raises(DetectionError, match="tensor_order='sideways' is not known"):
        kvcore.detect(allocate("NHD"), "twin", {TENSOR_ORDER: "sideways"})
    assert tensor_order({TENSOR_ORDER: "memory"}) == "physical" and tensor_order({}) is None


def test_given_hints_are_never_named_as_deciding(twin):
    kv = allocate("NHD", bs=4, nh=4)
    with pytest.raises(AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "twin", {"block_size": 4})  # given, and it cannot decide (BS == NH)
    assert "block_size" not in ei.value.hints and "hints given: block_size=4" in str(ei.value)


def test_resolve_keeps_the_reasons_of_readings_that_do_not_fit(core_only):
    t = torch.zeros(NB, 4, HS)

    class Picky:
        @hookimpl
        def kvcore_detect(self, kv_caches, engine, hints):
            return resolve([Candidate(NHD, list(kv_caches), label="paged K/V")], engine="picky")

    kvcore.register_plugin(Picky(), name="picky")
    with pytest.raises(DetectionError) as ei:
        kvcore.detect([t], "picky")
    msg = str(ei.value)
    assert "readings tried, and why they do not fit" in msg and "NL_X_TWO_NB_BS_NH_HS [paged K/V]" in msg and "expects 5-D" in msg
    with pytest.raises(DetectionError, match="fit none of the layouts tried:\n  - NL_X_TWO_NB_BS_NH_HS: format"):
        resolve([Candidate(NHD, [t])], engine="x", required=True)


def test_resolve_separates_readings_of_different_element_dtypes(core_only):
    t = torch.zeros(NB, 4, 2, HS, dtype=torch.uint8)
    a = Candidate("NL_X_NB_BS_NH_HS", [t], dtype=torch.float8_e4m3fn, decided_by={"dtype": "float8_e4m3fn"})
    b = Candidate("NL_X_NB_BS_NH_HS", [t], dtype=torch.float8_e4m3fnuz, decided_by={"dtype": "float8_e4m3fnuz"})
    with pytest.raises(AmbiguousLayoutError) as ei:
        resolve([a, b], engine="x")
    assert ei.value.hints == ["dtype"] and "dtype=float8_e4m3fnuz" in str(ei.value)
    # a candidate of one dtype alone is the answer
    assert resolve([b], engine="x").dtype is torch.float8_e4m3fnuz


def test_messages_that_teach(twin):
    a = torch.zeros(2, NB, 4, 2, HS)
    b = torch.zeros(2, NB, 4, 2, 2 * HS)
    with pytest.raises(DetectionError, match="detect_per_layer"):
        kvcore.detect([a, b], "nobody-knows")
    with pytest.raises(kvcore.GeometryError, match="the pool has 0 blocks"):
        kvcore.build_layout(NHD, [torch.zeros(2, 0, 4, 2, HS)])
    with pytest.raises(DetectionError, match="the pool has 0 blocks") as ei:
        kvcore.detect([torch.zeros(2, 0, 4, 2, HS)], "twin", {TENSOR_ORDER: "allocated"})
    assert "a pool with 0 blocks" in str(ei.value)


# -- aliases: identical entries stay one layer each --------------------------------------------


def test_identical_entries_keep_one_layer_each_and_report_aliases(twin):
    a, b = allocate("NHD", nl=2)
    entries = [a, b, a, a]  # KV sharing: layers 2 and 3 use layer 0's cache
    distinct, aliases = split_aliases(entries)
    assert aliases == {2: 0, 3: 0} and len(distinct) == 2 and distinct[0] is a
    lay = kvcore.build_layout(NHD, distinct, aliases=aliases)
    assert lay.num_layers == 4 and lay.aliases == {2: 0, 3: 0} and lay.describe().startswith("4 x")
    assert lay.data_ptrs() == [a.data_ptr(), b.data_ptr(), a.data_ptr(), a.data_ptr()]
    assert lay.summary()["aliases"] == {"2": 0, "3": 0}
    # gather reads the shared memory for every layer that has it
    a.view(-1).copy_(torch.arange(a.numel()))
    b.view(-1).copy_(-torch.arange(b.numel()))
    slots = torch.tensor([0, 5, 19])
    g = kvcore.gather(lay, slots)
    assert torch.equal(g[:, 0], g[:, 2]) and torch.equal(g[:, 0], g[:, 3]) and not torch.equal(g[:, 0], g[:, 1])
    assert torch.equal(g[0, 0, 1], a[0, 1, 1].flatten())  # slot 5 = block 1, offset 1
    # scatter writes shared memory once, from the first of its layers in the selection
    src = torch.stack([torch.full((2, 3, 2 * HS), float(v)) for v in (1, 2, 3, 4)], 1).to(a.dtype)
    kvcore.scatter(lay, slots, src)
    assert float(a[0, 1, 1, 0, 0]) == 1.0 and float(b[0, 1, 1, 0, 0]) == 2.0
    kvcore.scatter(lay, slots, src[:, [3, 1]], layers=[3, 1])  # layer 3 first in this selection: its rows win
    assert float(a[0, 1, 1, 0, 0]) == 4.0
    # the layer count never changes silently: detection keeps all four
    with pytest.raises(kvcore.GeometryError, match="aliases"):
        kvcore.build_layout(NHD, distinct, aliases={1: 3})


# -- detect_per_layer keeps the input's order and keys ------------------------------------------


def test_detect_per_layer_keys_and_orders_results_as_the_input(twin):
    a, a2 = allocate("HND", nl=2)
    (bigger,) = allocate("HND", nl=1, bs=8)
    kv = {"model.layers.0.self_attn.attn": a, "model.layers.1.self_attn.attn": a2, "draft_model.model.layers.0.self_attn.attn": bigger}
    res = kvcore.detect_per_layer(kv, "twin")
    assert list(res) == list(kv)
    for name, t in kv.items():  # zip(kv_caches, result) pairs each entry with its own layout
        lay = res[name]
        pos = lay.layer_names.index(name)
        assert lay.data_ptrs()[pos] == t.data_ptr()
    assert res["draft_model.model.layers.0.self_attn.attn"].block_size == 8
    assert res["model.layers.1.self_attn.attn"].block_size == 4 and res["model.layers.1.self_attn.attn"].layer_ids == (0, 1)
    # a list in: a list in input order; layer_groups index that order (or, for a dict, name its keys)
    lst = kvcore.detect_per_layer([bigger, a, a2], "twin")
    assert [x.block_size for x in lst] == [8, 4, 4] and lst[1].layer_ids == (1, 2)
    res = kvcore.detect_per_layer(kv, "twin", layer_groups=[["model.layers.1.self_attn.attn"], [0]])
    assert res["model.layers.1.self_attn.attn"].layer_ids == (1,) and res["model.layers.0.self_attn.attn"].layer_ids == (0,)
    with pytest.raises(DetectionError, match="or its keys"):
        kvcore.detect_per_layer(kv, "twin", layer_groups=[["model.layers.9"]])


def test_dtype_names_are_one_table():
    from kvcore.dtypes import parse_dtype

    assert parse_dtype("float8_e4m3fnuz") is torch.float8_e4m3fnuz and parse_dtype("fp8_e5m2fnuz") is torch.float8_e5m2fnuz
    assert parse_dtype("torch.BF16") is torch.bfloat16 and parse_dtype(torch.half) is torch.float16
    with pytest.raises(DetectionError, match="unknown dtype 'fp9'"):
        parse_dtype("fp9")
    # 0x40 is 2.0 as OCP e4m3 and 1.0 as FNUZ e4m3: the name matters
    byte = torch.tensor([0x40], dtype=torch.uint8)
    assert float(byte.view(torch.float8_e4m3fn)) == 2.0 and float(byte.view(torch.float8_e4m3fnuz)) == 1.0


def test_platform_evidence_comes_only_from_this_process_memory():
    from kvcore.dtypes import described_tensors, rocm_build

    real = torch.zeros(2, dtype=torch.uint8)
    assert rocm_build([real]) is (getattr(torch.version, "hip", None) is not None)
    assert rocm_build([torch.empty(2, device="meta")]) is None  # a description from a log
    with described_tensors():  # what `kvcore detect` builds from JSON: no evidence either
        assert rocm_build([real]) is None
    assert rocm_build([real]) is not None


def test_tensor_order_physical_on_a_permuted_view_is_an_error_for_every_engine(core_only):
    permuted = torch.zeros(2, NB, 2, 4, HS).permute(PERM)  # HND memory, NHD shape
    for call in (kvcore.detect, kvcore.detect_per_layer):
        with pytest.raises(DetectionError, match=r"tensor 0 \(shape \[2, 5, 4, 2, 8\].*permuted view"):
            call([permuted], "any-engine", hints={TENSOR_ORDER: "physical"})
