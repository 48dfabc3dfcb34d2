"""Detection and geometry of every SGLang allocation, ambiguity and refusals."""

from __future__ import annotations

import kvcore_sglang
import pytest
import torch
from kvcore_sglang import fixtures as fx
from kvcore_sglang.fixtures import CASES

import kvcore

DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.uint8)


#: the classic-staging cases ([kv_size, NL, T, NH*HS]); multi-plane cases (K/V of two head sizes) are proven by
#: the conformance suite (kvcore check sglang) and test_v_head_size_different_from_k_is_two_planes
CLASSIC = [c for c in CASES if "=" not in c.format]


@pytest.mark.parametrize("case", CLASSIC, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_fixture_detects_with_declared_geometry(case, dtype):
    if dtype not in case.dtypes:
        pytest.skip(f"{case.name} holds only {case.dtypes}")
    caches, hints = case.make(dict(case.sizes), dtype, "cpu")
    lay = kvcore.detect(caches, "sglang", hints)
    s = case.sizes
    assert lay.format.name == case.format
    assert lay.dtype == dtype
    assert lay.num_layers == s["num_layers"]
    assert lay.num_heads == s["num_heads"]
    assert lay.head_size == s["head_size"]
    assert lay.page_buffer_size == s["num_blocks"] * s["block_size"]
    if lay.format.fused_nbbs:
        with pytest.raises(kvcore.GeometryError):
            _ = lay.num_blocks
    else:
        assert (lay.num_blocks, lay.block_size) == (s["num_blocks"], s["block_size"])


def test_053_pool_geometry_counts_the_padded_page():
    k, v = fx.alloc_mha_053(num_layers=4, size=60, page_size=1, head_num=8, head_dim=16)
    lay = kvcore.detect([k, v], "sglang")
    assert lay.format.name == "TWO_X_NL_X_NBBS_NH_HS"
    assert lay.describe() == "2 x 4 x [61, 8, 16]"
    assert (lay.num_layers, lay.num_heads, lay.head_size, lay.hidden_dim, lay.kv_size) == (4, 8, 16, 128, 2)
    assert lay.page_buffer_size == 61  # size + page_size rows
    assert lay.elements_per_layer == 2 * 61 * 128
    assert lay.data_ptrs() == [t.data_ptr() for t in k + v]
    d = lay.shape_desc()
    assert (d.kv_size, d.nl, d.nb, d.bs, d.nh, d.hs, d.element_size, d.block_stride_elems) == (2, 4, 61, 1, 8, 16, 2, 0)


def test_page_size_hint_splits_rows_into_pages_as_views():
    k, v = fx.alloc_mha_053(num_layers=3, size=64, page_size=16, head_num=4, head_dim=8)
    lay = kvcore.detect([k, v], "sglang", {"page_size": 16})
    assert lay.format.name == "TWO_X_NL_X_NB_BS_NH_HS"
    assert (lay.num_blocks, lay.block_size) == (5, 16)
    assert lay.kv_caches[0][1].data_ptr() == k[1].data_ptr()  # a view, not a copy
    assert kvcore.detect([k, v], "sglang", {"tokens_per_block": 16}).format.name == "TWO_X_NL_X_NB_BS_NH_HS"
    with pytest.raises(kvcore.DetectionError, match="not whole pages of page_size 7"):
        kvcore.detect([k, v], "sglang", {"page_size": 7})


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_0523_fused_halves_share_storage_and_report_pointers(layout):
    k, v = fx.alloc_mha_0523(num_layers=3, size=12, page_size=4, head_num=2, head_dim=8, layout=layout)
    k_data_ptrs = [t.data_ptr() for t in k]  # SGLang's MHATokenToKVPool.k_data_ptrs
    v_data_ptrs = [t.data_ptr() for t in v]
    hints = {"page_size": 4, "layout": layout}
    lay = kvcore.detect([k, v], "sglang", hints)
    assert lay.format.name == ("TWO_X_NL_X_NB_NH_BS_HS" if layout == "HND" else "TWO_X_NL_X_NB_BS_NH_HS")
    assert lay.data_ptrs() == k_data_ptrs + v_data_ptrs
    tb = lay.stride_table()
    plane_bytes = 16 * 2 * 8 * 2  # rows * NH * HS * bf16
    for layer in range(3):
        (tk, ok), (tv, ov) = tb.bases[layer]
        assert tk.untyped_storage().data_ptr() == tv.untyped_storage().data_ptr()  # one buffer per layer
        assert ov - ok == plane_bytes  # V is buf[1]: one plane after K
        assert tb.ptrs()[layer].tolist() == [k_data_ptrs[layer], v_data_ptrs[layer]]
    p = tb.planes[0]
    if layout == "HND":
        assert (p.block, p.token, p.head) == (2 * 4 * 8 * 2, 8 * 2, 4 * 8 * 2)
    else:
        assert (p.block, p.token, p.head) == (4 * 2 * 8 * 2, 2 * 8 * 2, 8 * 2)


def test_0523_padded_rows_buffer_is_read_through_each_views_offset():
    k, v = fx.alloc_mha_0523(num_layers=2, size=8, page_size=1, head_num=2, head_dim=4, padded_rows=16)
    lay = kvcore.detect([k, v], "sglang")
    assert lay.page_buffer_size == 9
    (tk, ok), (tv, ov) = lay.stride_table().bases[1]
    assert ov - ok == 16 * 2 * 4 * 2  # V starts at buf[1, 0], past the padded K half


def test_pairs_reading_for_detect_per_layer_entries():
    k, v = fx.alloc_mha_053(num_layers=3, size=8, page_size=1, head_num=2, head_dim=4)
    lay = kvcore.detect([(a, b) for a, b in zip(k, v)], "sglang")
    assert lay.format.name == "TWO_X_NL_X_NBBS_NH_HS"
    assert lay.data_ptrs() == [t.data_ptr() for t in k + v]


def test_two_layer_lists_nested_vs_pairs_is_ambiguous_unless_storage_or_hint_decides():
    k, v = fx.alloc_mha_053(num_layers=2, size=8, page_size=1, head_num=2, head_dim=4)
    with pytest.raises(kvcore.AmbiguousLayoutError, match="Pass one of these hints to decide: kv_list_layout$"):
        kvcore.detect([list(k), list(v)], "sglang")
    lay = kvcore.detect([list(k), list(v)], "sglang", {"kv_list_layout": "nested"})
    assert lay.data_ptrs() == [t.data_ptr() for t in k + v]
    # 0.5.23: each layer's K and V are halves of one buffer, which decides the reading
    k2, v2 = fx.alloc_mha_0523(num_layers=2, size=8, page_size=1, head_num=2, head_dim=4)
    assert kvcore.detect([list(k2), list(v2)], "sglang").data_ptrs() == [t.data_ptr() for t in k2 + v2]
    assert kvcore.detect([[k2[0], v2[0]], [k2[1], v2[1]]], "sglang").data_ptrs() == [t.data_ptr() for t in k2 + v2]
    # SGLang's (k, v) pairs are tuples; k_buffer / v_buffer are lists
    assert kvcore.detect([(k[0], v[0]), (k[1], v[1])], "sglang").data_ptrs() == [t.data_ptr() for t in k + v]


def test_one_head_flat_list_is_ambiguous_mla_vs_mha_and_a_hint_decides():
    ts = [torch.zeros(9, 1, 16, dtype=torch.bfloat16) for _ in range(4)]
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(ts, "sglang")
    assert set(ei.value.candidates) == {"NL_X_NBBS_ONE_HS", "TWO_X_NL_X_NBBS_NH_HS"}
    assert "is_mla" in ei.value.hints and "kv_list_layout" in ei.value.hints
    mla = kvcore.detect(ts, "sglang", {"is_mla": True})
    assert (mla.format.name, mla.num_layers, mla.kv_size) == ("NL_X_NBBS_ONE_HS", 4, 1)
    mha = kvcore.detect(ts, "sglang", {"kv_list_layout": "k_v"})
    assert (mha.format.name, mha.num_layers, mha.kv_size, mha.num_heads) == ("TWO_X_NL_X_NBBS_NH_HS", 2, 2, 1)
    assert mha.data_ptrs() == [t.data_ptr() for t in ts]
    assert kvcore.detect(ts, "sglang", {"is_mla": False}).format.name == "TWO_X_NL_X_NBBS_NH_HS"
    # an odd count cannot be K and V lists: MLA without a hint
    assert kvcore.detect(ts[:3], "sglang").format.name == "NL_X_NBBS_ONE_HS"


def test_deepseek_v3_mla_pool_geometry():
    kv = fx.alloc_mla(num_layers=61, size=63, page_size=1, kv_cache_dim=576)
    lay = kvcore.detect(kv, "sglang")
    assert lay.format.name == "NL_X_NBBS_ONE_HS"
    assert (lay.num_layers, lay.num_heads, lay.head_size, lay.kv_size, lay.page_buffer_size) == (61, 1, 576, 1, 64)
    assert lay.describe() == "61 x [64, 1, 576]"
    paged = kvcore.detect(kv, "sglang", {"page_size": 64, "is_mla": True})
    assert (paged.format.name, paged.num_blocks, paged.block_size) == ("NL_X_NB_BS_ONE_HS", 1, 64)


def test_hnd_vs_nhd_when_page_size_equals_num_heads():
    k, v = fx.alloc_mha_0523(num_layers=2, size=12, page_size=4, head_num=4, head_dim=8, layout="HND")
    with pytest.raises(kvcore.AmbiguousLayoutError, match="layout") as ei:
        kvcore.detect([k, v], "sglang", {"page_size": 4, "num_kv_heads": 4})
    assert set(ei.value.candidates) == {"TWO_X_NL_X_NB_NH_BS_HS", "TWO_X_NL_X_NB_BS_NH_HS"}
    assert kvcore.detect([k, v], "sglang", {"layout": "HND"}).format.name == "TWO_X_NL_X_NB_NH_BS_HS"
    assert kvcore.detect([k, v], "sglang", {"layout": "nhd"}).format.name == "TWO_X_NL_X_NB_BS_NH_HS"
    # page_size != NH: the page_size hint alone decides
    k2, v2 = fx.alloc_mha_0523(num_layers=2, size=16, page_size=8, head_num=2, head_dim=8, layout="HND")
    lay = kvcore.detect([k2, v2], "sglang", {"page_size": 8})
    assert (lay.format.name, lay.block_size, lay.num_heads) == ("TWO_X_NL_X_NB_NH_BS_HS", 8, 2)


def test_v_head_size_different_from_k_is_two_planes():
    # MHATokenToKVPool._create_buffers: v_buffer (size + page_size, head_num, v_head_dim)
    k, v = fx.alloc_mha_053(num_layers=2, size=8, page_size=1, head_num=2, head_dim=16, v_head_dim=8)
    for layer in range(2):
        k[layer].copy_(torch.arange(k[layer].numel(), dtype=torch.float32).view(k[layer].shape) + 1000 * layer)
        v[layer].copy_(-torch.arange(v[layer].numel(), dtype=torch.float32).view(v[layer].shape) - 1000 * layer)
    for hints in ({}, {"v_head_size": 8}, {"head_size": 16, "v_head_dim": 8}):
        lay = kvcore.detect([k, v], "sglang", hints)
        assert lay.format.name == "K=NL_X_NBBS_NH_HS+V=NL_X_NBBS_NH_HS"
        assert lay.staging_shapes(3) == {"K": (2, 3, 32), "V": (2, 3, 16)}
    out = kvcore.gather(lay, torch.tensor([3, 7]))
    assert torch.equal(out["K"][1, 0], k[1][3].reshape(-1)) and torch.equal(out["V"][0, 1], v[0][7].reshape(-1))
    want = (-torch.arange(48, 64, dtype=torch.float32) - 1000).to(v[1].dtype)  # V row 3 of layer 1: its own 2 x 8 values
    assert torch.equal(out["V"][1, 0], want)
    kvcore.scatter(lay, torch.tensor([5, 6]), out)  # into other rows: each plane at its own width
    assert torch.equal(v[1][5], v[1][3]) and torch.equal(k[0][6], k[0][7])
    paged = kvcore.detect([k, v], "sglang", {"page_size": 1})
    assert paged.format.name == "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS" and paged.block_size == 1
    with pytest.raises(kvcore.DetectionError, match="v_head_size hint 4 but the V tensors' head size is 8"):
        kvcore.detect([k, v], "sglang", {"v_head_size": 4})


def test_hints_that_contradict_the_tensors_are_errors():
    k, v = fx.alloc_mha_053(num_layers=2, size=8, page_size=1, head_num=2, head_dim=4)
    with pytest.raises(kvcore.DetectionError, match="num_kv_heads hint 8"):
        kvcore.detect([k, v], "sglang", {"num_kv_heads": 8})
    with pytest.raises(kvcore.DetectionError, match="head_size hint 64"):
        kvcore.detect([k, v], "sglang", {"head_dim": 64})
    with pytest.raises(kvcore.DetectionError, match="HND"):
        kvcore.detect([k, v], "sglang", {"layout": "HND"})
    with pytest.raises(kvcore.DetectionError, match="dtype hint says torch.float8_e4m3fn"):
        kvcore.detect([k, v], "sglang", {"kv_cache_dtype": "fp8_e4m3"})  # bf16 tensors, not uint8


def test_bad_hints_name_the_accepted_ones():
    k, v = fx.alloc_mha_053(num_layers=1, size=4, page_size=1, head_num=2, head_dim=4)
    with pytest.raises(kvcore.DetectionError, match="page_sise.*Accepted hints: .*page_size/tokens_per_block"):
        kvcore.detect([k, v], "sglang", {"page_sise": 4})
    with pytest.raises(kvcore.DetectionError, match="mem_layout"):
        kvcore.detect([k, v], "sglang", {"mem_layout": "page_last"})
    assert kvcore.detect([k, v], "sglang", {"page_size": 5, "tokens_per_block": 5}).block_size == 5
    with pytest.raises(kvcore.DetectionError, match="different values"):
        kvcore.detect([k, v], "sglang", {"page_size": 5, "tokens_per_block": 1})
    with pytest.raises(kvcore.DetectionError, match="fp4"):
        kvcore.detect([k, v], "sglang", {"kv_cache_dtype": "fp4_e2m1"})


def test_other_engines_are_not_answered():
    k, v = fx.alloc_mha_053(num_layers=1, size=4, page_size=1, head_num=2, head_dim=4)
    from kvcore_sglang import plugin

    assert plugin.kvcore_detect(kv_caches=[k, v], engine="vllm", hints={}) is None


def test_host_pool_layouts_are_ambiguous_when_size_equals_layers():
    buf = fx.alloc_host_mha("page_first", num_layers=8, size=8, page_size=1, head_num=2, head_dim=4)
    with pytest.raises(kvcore.AmbiguousLayoutError, match="mem_layout"):
        kvcore.detect(buf, "sglang")
    assert kvcore.detect(buf, "sglang", {"mem_layout": "page_first"}).format.name == "TWO_NBBS_NL_NH_HS"
    assert kvcore.detect(buf, "sglang", {"hicache_mem_layout": "layer_first"}).format.name == "TWO_NL_NBBS_NH_HS"
    buf2 = fx.alloc_host_mha("page_first", num_layers=4, size=16, page_size=4, head_num=2, head_dim=4)
    lay = kvcore.detect(buf2, "sglang", {"num_layers": 4})
    assert (lay.format.name, lay.num_layers, lay.page_buffer_size) == ("TWO_NBBS_NL_NH_HS", 4, 16)
    direct = fx.alloc_host_mha("page_first_direct", num_layers=3, size=16, page_size=4, head_num=2, head_dim=4)
    lay = kvcore.detect(direct, "sglang", {"num_layers": 3})
    assert (lay.format.name, lay.num_blocks, lay.block_size, lay.num_heads) == ("TWO_NB_NL_BS_NH_HS", 4, 4, 2)
    head = fx.alloc_host_mha("page_head", num_layers=3, size=16, page_size=4, head_num=2, head_dim=4)
    lay = kvcore.detect(head, "sglang", {"num_kv_heads": 2})
    assert (lay.format.name, lay.num_layers, lay.num_heads) == ("TWO_NB_NH_BS_NL_HS", 3, 2)
    with pytest.raises(kvcore.DetectionError, match="not a HiCache host pool"):
        kvcore.detect(torch.zeros(3, 4, 5), "sglang")


def test_indexer_pool_detection_and_geometry():
    bufs = fx.alloc_indexer(num_layers=2, size=127, page_size=64)
    assert tuple(bufs[0].shape) == (3, 64 * 132)
    with pytest.raises(kvcore.AmbiguousLayoutError, match="index_page_size") as e:
        kvcore.detect(bufs, "sglang")  # 0.5.23 may split rows into kernel pages under DCP: the tensors cannot show it
    assert {"index_page_size", "attn_dcp_size"} <= set(e.value.hints)
    lay = kvcore.detect(bufs, "sglang", {"sglang_version": "0.5.3"})  # 0.5.3 NSATokenToKVPool: one page per row
    assert lay.format.name == "NL_X_NB_BSV_BSS"
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size, lay.kv_size) == (3, 64, 1, 132, 1)
    assert lay.describe() == "2 x [3, 64x128, 64x4]"
    assert lay.data_ptrs() == [b.data_ptr() for b in bufs]
    p, sc = lay.stride_table().planes
    assert (p.block, p.token, p.chunk_bytes) == (64 * 132, 128, 128)
    assert (sc.token, sc.chunk_bytes, sc.staging.offset) == (4, 4, 128)
    assert [off for _, off in sc.bases] == [off + 64 * 128 for _, off in p.bases]
    with pytest.raises(kvcore.DetectionError, match="not page_size 32 records"):
        kvcore.detect(bufs, "sglang", {"page_size": 32})
    for deciding in ({"index_page_size": 64}, {"attn_dcp_size": 1}, {"attn_dcp_size": 4, "dcp_replicated": False}):
        assert kvcore.detect(bufs, "sglang", deciding).describe() == "2 x [3, 64x128, 64x4]"
    with pytest.raises(kvcore.DetectionError, match="index_page_size=48 does not divide"):
        kvcore.detect(bufs, "sglang", {"index_page_size": 48})
    with pytest.raises(kvcore.DetectionError, match="contradicts"):
        kvcore.detect(bufs, "sglang", {"index_page_size": 64, "attn_dcp_size": 2, "dcp_replicated": True})
    with pytest.raises(kvcore.DetectionError, match="index_kpool=2"):
        kvcore.detect(bufs, "sglang", {"index_kpool": 2, "index_page_size": 32})
    with pytest.raises(kvcore.AmbiguousLayoutError, match="dcp_replicated"):
        kvcore.detect(bufs, "sglang", {"attn_dcp_size": 2})  # the split needs dcp_replicated (a draft worker)
    with pytest.raises(kvcore.DetectionError, match="not a DSA/NSA indexer pool"):
        kvcore.detect([torch.zeros(3, 64 * 130, dtype=torch.uint8)], "sglang")


def test_bf16_indexer_pool_needs_page_size_and_reads_per_token_keys():
    bufs = [torch.randn(3, 4 * 16).to(torch.bfloat16) for _ in range(2)]  # (num_pages, page_size * index_head_dim)
    with pytest.raises(kvcore.DetectionError, match="page_size hint"):
        kvcore.detect(bufs, "sglang")
    lay = kvcore.detect(bufs, "sglang", {"page_size": 4})
    assert (lay.format.name, lay.num_blocks, lay.block_size, lay.head_size) == ("NL_X_NB_BS_ONE_HS", 3, 4, 16)
    out = kvcore.gather(lay, torch.tensor([6]))  # page 1, token 2
    assert torch.equal(out[0, 1, 0], bufs[1][1, 2 * 16 : 3 * 16])


def test_flat_k_then_v_list_is_sglangs_data_ptrs_order():
    k, v = fx.alloc_mha_053(num_layers=3, size=8, page_size=4, head_num=2, head_dim=4)
    lay = kvcore.detect(k + v, "sglang", kvcore_sglang.SGLangHints(page_size=4))
    assert (lay.format.name, lay.num_layers, lay.block_size) == ("TWO_X_NL_X_NB_BS_NH_HS", 3, 4)
    assert lay.data_ptrs() == [t.data_ptr() for t in k + v]  # SGLang: data_ptrs = cat(k_data_ptrs, v_data_ptrs)
    with pytest.raises(kvcore.DetectionError, match="2\\*NL tensors"):
        kvcore.detect(k + v[:2], "sglang")
    with pytest.raises(kvcore.DetectionError, match="kv_list_layout='nested'"):
        kvcore.detect(k + v, "sglang", {"kv_list_layout": "nested"})


def test_a_reading_whose_strides_do_not_fit_says_why():
    k, v = fx.alloc_mha_053(num_layers=2, size=7, page_size=1, head_num=2, head_dim=8)
    k[1] = torch.zeros(16, 2, 8, dtype=torch.bfloat16)[::2]  # a layer with other strides
    with pytest.raises(kvcore.DetectionError, match=r"stride=\(32, 8, 1\)"):
        kvcore.detect([k, v], "sglang", {"kv_list_layout": "nested"})


def test_ascend_cross_layer_pool_from_the_tensor_or_its_halves():
    buf = fx.alloc_ascend(num_layers=3, size=12, page_size=4, head_num=2, head_dim=8)
    lay = kvcore.detect(buf, "sglang", {"layout": "ascend"})
    assert (lay.format.name, lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads) == ("TWO_NL_NB_BS_NH_HS", 3, 4, 4, 2)
    # AscendTokenToKVPool.k_buffer / v_buffer are kv_buffer[0] / kv_buffer[1]
    halves = kvcore.detect([buf[0], buf[1]], "sglang")
    assert halves.stride_table().signature() == lay.stride_table().signature()
    # without a hint the 6-D tensor also reads as host page_first_direct / page_head pools
    with pytest.raises(kvcore.AmbiguousLayoutError, match="layout"):
        kvcore.detect(buf, "sglang")
    with pytest.raises(kvcore.DetectionError, match="kv_buffer\\[0\\], kv_buffer\\[1\\]"):
        kvcore.detect([buf[0].clone(), buf[1].clone()], "sglang")


def test_lmcache_unified_component_views_are_one_entry_per_component():
    # LMCache's unified connector: [*k_buffer, *v_buffer] each .view(NB, page_size, NH, HS) (_to_wire_block_tensor)
    k, v = fx.alloc_mha_053(num_layers=2, size=12, page_size=4, head_num=2, head_dim=8)
    for i, t in enumerate([*k, *v]):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i)
    views = [t.view(4, 4, 2, 8) for t in [*k, *v]]
    lay = kvcore.detect(views, "sglang", {"kv_list_layout": "unified"})
    assert (lay.format.name, lay.num_layers, lay.kv_size, lay.num_blocks, lay.block_size) == ("NL_X_NB_BS_NH_HS", 4, 1, 4, 4)
    out = kvcore.gather(lay, torch.tensor([6]))  # SGLang token slot 6 = page 1, offset 2
    assert [torch.equal(out[0, i, 0], t[6].reshape(-1)) for i, t in enumerate([*k, *v])] == [True] * 4
    mla = [t.view(4, 4, 16) for t in fx.alloc_mla(3, size=12, page_size=4, kv_cache_dim=16)]
    assert kvcore.detect(mla, "sglang", {"kv_list_layout": "unified"}).format.name == "NL_X_NB_BS_HS"
    with pytest.raises(kvcore.DetectionError, match="page_size hint 8"):
        kvcore.detect(views, "sglang", {"kv_list_layout": "unified", "page_size": 8})
    with pytest.raises(kvcore.DetectionError, match="contiguous"):
        kvcore.detect([t.transpose(1, 2) for t in views], "sglang", {"kv_list_layout": "unified"})
