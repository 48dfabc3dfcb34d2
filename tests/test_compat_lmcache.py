"""kvcore.compat.lmcache: LMCache's utility names over kvcore, checked with real values.

A small test plugin (engine ``lmcompat``) recognises a few layouts so these tests do not
depend on an engine plugin; it records the hints it receives."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

import kvcore
from kvcore.compat import lmcache as L
from kvcore.errors import AmbiguousLayoutError, DetectionError, FormatError, GeometryError

ENGINE = "lmcompat"
SEEN_HINTS: list[dict] = []


class _Plugin:
    """Rules: a list of 5-D tensors with dim 0 == 2 is FlashAttention K/V-major (HND when the
    hint says so, given as a permuted view of HND memory); 3-D is MLA ``[NB, BS, HS]``; int8
    3-D tensors with hint ``dtype`` carry that dtype; ``[K list, V list]`` of 3-D is
    ``TWO_X_NL_X_NBBS_NH_HS``; one 6-D tensor is cross-layer; 2-D tensors are "Mamba state"."""

    @kvcore.hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != ENGINE:
            return None
        SEEN_HINTS.append(dict(hints))
        if isinstance(kv_caches, torch.Tensor):
            return kvcore.Detection(format="NB_NL_TWO_BS_NH_HS", kv_caches=kv_caches, note="cross-layer")
        first = kv_caches[0]
        if isinstance(first, (list, tuple)):
            return kvcore.Detection(format="TWO_X_NL_X_NBBS_NH_HS", kv_caches=kv_caches, note="K list, V list")
        if first.dim() == 2:
            return kvcore.Detection(format=None, excluded="Mamba state: not KV")
        if first.dim() == 5:
            if hints.get("kv_cache_layout") == "HND":
                return kvcore.Detection(format="NL_X_TWO_NB_NH_BS_HS", kv_caches=[t.transpose(2, 3) for t in kv_caches], note="HND")
            if "kv_cache_layout" not in hints and first.shape[2] == first.shape[3]:
                raise AmbiguousLayoutError(
                    "BS == NH: NHD or HND?", candidates=["NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"], hints=["kv_cache_layout"]
                )
            return kvcore.Detection(format="NL_X_TWO_NB_BS_NH_HS", kv_caches=kv_caches, note="NHD")
        if first.dim() == 3:
            dt = hints.get("dtype")
            return kvcore.Detection(format="NL_X_NB_BS_HS", kv_caches=kv_caches, dtype=getattr(torch, dt) if dt else None, note="MLA")
        return None


@pytest.fixture(autouse=True)
def plugin():
    name = kvcore.register_plugin(_Plugin(), "lmcompat-test")
    SEEN_HINTS.clear()
    yield
    kvcore.unregister_plugin(name)


def _fa_nhd(nl=3, nb=5, bs=4, nh=2, hs=8, dtype=torch.bfloat16):
    return [torch.zeros(2, nb, bs, nh, hs, dtype=dtype) for _ in range(nl)]


def _fa_hnd_as_vllm(nl=3, nb=5, bs=4, nh=2, hs=8, dtype=torch.bfloat16):
    # memory (2, NB, NH, BS, HS), exposed as the logical (2, NB, BS, NH, HS) (vLLM <= 0.23 HND)
    return [torch.zeros(2, nb, nh, bs, hs, dtype=dtype).transpose(2, 3) for _ in range(nl)]


# -- detection -----------------------------------------------------------------------------


def test_normalize_returns_a_format_string_with_lmcache_facts_and_views():
    kv = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(_fa_nhd())}
    fmt, norm = L.normalize_kv_and_discover_format(kv, ENGINE)
    assert fmt == "NL_X_TWO_NB_BS_NH_HS" and isinstance(fmt, str) and isinstance(fmt, L.EngineKVFormat)
    assert fmt.name == "NL_X_TWO_NB_BS_NH_HS"
    assert (fmt.is_layer_list, fmt.is_cross_layer, fmt.is_kv_list, fmt.is_mla, fmt.is_hnd, fmt.is_two_major) == (
        True,
        False,
        False,
        False,
        False,
        True,
    )
    assert isinstance(norm, list) and len(norm) == 3
    for i, t in enumerate(norm):  # views of the caller's tensors, in layer order
        assert t.data_ptr() == kv[f"model.layers.{i}.self_attn.attn"].data_ptr()


def test_hnd_view_is_normalised_and_geometry_reads_it():
    kv = _fa_hnd_as_vllm(nl=2, nb=6, bs=4, nh=3, hs=8)
    fmt, norm = L.normalize_kv_and_discover_format(kv, ENGINE, {"kv_layout": "HND"})
    assert fmt == "NL_X_TWO_NB_NH_BS_HS" and fmt.is_hnd
    assert norm[0].shape == (2, 6, 3, 4, 8) and norm[0].is_contiguous()
    assert SEEN_HINTS[-1] == {"kv_cache_layout": "HND"}  # LMCache's kv_layout key, translated
    assert L.get_num_layers(norm, fmt) == 2
    assert L.get_num_blocks(norm, fmt) == 6
    assert L.get_block_size(norm, fmt) == 4
    assert L.get_num_heads(norm, fmt) == 3
    assert L.get_head_size(norm, fmt) == 8
    assert L.get_hidden_dim_size(norm, fmt) == 24 == L.get_hidden_dim(norm, fmt, 1)
    assert L.get_kv_size(norm, fmt) == 2
    assert L.get_page_buffer_size(norm, fmt) == 24 == L.get_tokens_per_layer(norm, fmt)
    assert L.get_elements_per_layer(norm, fmt) == 2 * 24 * 3 * 8
    assert L.get_dtype(norm, fmt) == torch.bfloat16
    assert L.get_device(norm) == torch.device("cpu")
    assert L.get_concrete_engine_kv_shape(norm, fmt) == "2 x [2, 6, 3, 4, 8]"


def test_hint_translation_and_conflicts():
    L.normalize_kv_and_discover_format(
        _fa_nhd(),
        ENGINE,
        {
            "tokens_per_block": 4,
            "head_dim": 8,
            "num_kv_heads": 2,
            "torch_device_type": "cpu",
            "inference_engine_logical_block_size": 64,
            "kv_list_layout": None,
        },
    )
    assert SEEN_HINTS[-1] == {"block_size": 4, "head_size": 8, "num_kv_heads": 2, "device_type": "cpu"}
    with pytest.raises(DetectionError, match="kv_layout='HND' and kv_cache_layout='NHD'"):
        L.normalize_kv_and_discover_format(_fa_nhd(), ENGINE, {"kv_layout": "HND", "kv_cache_layout": "NHD"})
    with pytest.raises(DetectionError, match="layout_hints must be a dict"):
        L.normalize_kv_and_discover_format(_fa_nhd(), ENGINE, ["HND"])


def test_engine_type_members_and_unknown_engines():
    class EngineType:  # LMCache's enum members carry a name / value
        name = "LMCOMPAT"
        value = 7

    fmt, _ = L.normalize_kv_and_discover_format(_fa_nhd(), EngineType())
    assert fmt == "NL_X_TWO_NB_BS_NH_HS"
    with pytest.raises(DetectionError, match="no-such-engine"):
        L.normalize_kv_and_discover_format(_fa_nhd(), "no-such-engine")
    with pytest.raises(DetectionError, match="engine name"):
        L.normalize_kv_and_discover_format(_fa_nhd(), 3)


def test_ambiguity_is_kvcores_error_and_a_value_error():
    kv = _fa_nhd(bs=4, nh=4)
    with pytest.raises(AmbiguousLayoutError) as ei:
        L.normalize_kv_and_discover_format(kv, ENGINE)
    assert ei.value.hints == ["kv_cache_layout"] and isinstance(ei.value, ValueError)
    fmt, _ = L.normalize_kv_and_discover_format(kv, ENGINE, {"kv_layout": "NHD"})
    assert fmt == "NL_X_TWO_NB_BS_NH_HS"


def test_byte_views_carry_their_dtype_through_the_format():
    nb, bs, hs = 4, 8, 16
    raw = [torch.zeros(nb, bs, hs * 2, dtype=torch.int8) for _ in range(2)]  # bf16 rows as bytes
    fmt, norm = L.normalize_kv_and_discover_format(raw, ENGINE, {"dtype": "bfloat16"})
    assert fmt == "NL_X_NB_BS_HS" and fmt.dtype == torch.bfloat16 and fmt.is_mla
    assert L.get_dtype(norm, fmt) == torch.bfloat16
    assert L.get_head_size(norm, fmt) == hs  # 32 bytes = 16 bf16 elements
    assert L.get_num_heads(norm, fmt) == 1 and L.get_kv_size(norm, fmt) == 1
    # a plain string rebuilds the layout from the tensors alone: int8 elements
    assert L.get_head_size(norm, "NL_X_NB_BS_HS") == 2 * hs
    # pickling keeps what detection decided
    again = pickle.loads(pickle.dumps(fmt))
    assert again == fmt and again.dtype == torch.bfloat16
    desc = L.make_page_buffer_shape_desc(norm, fmt, 0, 2, nb, bs)
    assert (desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs, desc.element_size, desc.block_stride_elems) == (
        1,
        2,
        nb,
        bs,
        1,
        hs,
        2,
        0,
    )


def test_kv_list_pointers_are_all_k_then_all_v_and_cross_layer_is_one_base():
    k = [torch.zeros(12, 2, 8) for _ in range(3)]
    v = [torch.zeros(12, 2, 8) for _ in range(3)]
    fmt, norm = L.normalize_kv_and_discover_format([k, v], ENGINE)
    assert fmt == "TWO_X_NL_X_NBBS_NH_HS" and fmt.is_kv_list and fmt.is_pbs_fused
    assert L.get_data_ptrs(norm, fmt) == [t.data_ptr() for t in k + v]
    assert L.get_group_data_ptrs(norm, fmt, [2, 0]) == [k[2].data_ptr(), k[0].data_ptr(), v[2].data_ptr(), v[0].data_ptr()]
    assert L.get_page_buffer_size(norm, fmt) == 12 and L.get_num_layers(norm, fmt) == 3
    with pytest.raises(GeometryError, match="NBBS"):
        L.get_num_blocks(norm, fmt)
    with pytest.raises(ValueError):  # LMCache callers catch ValueError
        L.get_block_size(norm, fmt)
    assert L.get_concrete_engine_kv_shape(norm, fmt) == "2 x 3 x [12, 2, 8]"

    cross = torch.zeros(5, 4, 2, 16, 2, 8)
    fmt, norm = L.normalize_kv_and_discover_format(cross, ENGINE)
    assert fmt == "NB_NL_TWO_BS_NH_HS" and fmt.is_cross_layer
    assert L.get_data_ptrs(norm, fmt) == [cross.data_ptr()]
    assert (L.get_num_layers(norm, fmt), L.get_num_blocks(norm, fmt), L.get_block_size(norm, fmt, 3)) == (4, 5, 16)
    assert L.resolve_block_stride_and_log_layout(norm, fmt, 0, 0) == 4 * 2 * 16 * 2 * 8


def test_per_layer_accessors_answer_for_mixed_layers():
    kv = [torch.zeros(6, 16, 576), torch.zeros(6, 64, 128)]
    fmt = L.EngineKVFormat("NL_X_NB_BS_HS")
    assert [L.get_block_size(kv, fmt, i) for i in range(2)] == [16, 64]
    assert [L.get_head_size(kv, fmt, i) for i in range(2)] == [576, 128]
    with pytest.raises(GeometryError, match="out of range"):
        L.get_head_size(kv, fmt, 2)
    # as LMCache: the layer count is the entries, the whole-layer sizes are layer 0's
    assert L.get_num_layers(kv, fmt) == 2
    assert (L.get_num_blocks(kv, fmt), L.get_page_buffer_size(kv, fmt), L.get_elements_per_layer(kv, fmt)) == (6, 96, 96 * 576)
    assert L.get_concrete_engine_kv_shape(kv, fmt) == "2 x [6, 16, 576]"
    # a group's pointers read only its layers
    assert L.get_group_data_ptrs(kv, fmt, [1, 0]) == [kv[1].data_ptr(), kv[0].data_ptr()]
    assert L.get_concrete_engine_kv_shape([torch.zeros(6, 16)], fmt) == "Unknown (NL_X_NB_BS_HS)"


def test_per_layer_formats_for_a_hybrid_model():
    attn = [torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    mla = torch.zeros(5, 4, 32, dtype=torch.bfloat16)
    mamba = torch.zeros(5, 100)
    kv = [attn[0], mla, mamba, attn[1]]
    norm, fmts = L.normalize_and_discover_per_layer_formats(kv, [[0, 1, 3], [2]], ENGINE)
    assert fmts == ["NL_X_TWO_NB_BS_NH_HS", "NL_X_NB_BS_HS", None, "NL_X_TWO_NB_BS_NH_HS"]
    assert norm[2] is mamba
    assert [t.data_ptr() for t in (norm[0], norm[1], norm[3])] == [attn[0].data_ptr(), mla.data_ptr(), attn[1].data_ptr()]
    assert L.get_num_blocks([norm[1]], fmts[1]) == 5 and L.get_head_size([norm[1]], fmts[1]) == 32
    # one shape: the whole cache is detected once
    norm, fmts = L.normalize_and_discover_per_layer_formats(_fa_nhd(nl=4), None, ENGINE)
    assert fmts == ["NL_X_TWO_NB_BS_NH_HS"] * 4 and len(norm) == 4
    k = [torch.zeros(12, 2, 8) for _ in range(2)]
    norm, fmts = L.normalize_and_discover_per_layer_formats([k, [torch.zeros(12, 2, 8) for _ in range(2)]], [], ENGINE)
    assert fmts == ["TWO_X_NL_X_NBBS_NH_HS"] * 2 and norm[0][0] is k[0]


# -- descriptors and block strides -------------------------------------------------------------


def test_block_stride_of_a_padded_mla_pool():
    nb, bs, hs, row = 6, 4, 32, 48  # rows padded to 48 elements per token in a shared pool
    pool = torch.zeros(nb * bs * row, dtype=torch.bfloat16)
    views = [pool.as_strided((nb, bs, hs), (bs * row, row, 1))]
    with pytest.raises(GeometryError):  # padding inside the block is not dim-0 padding
        L.resolve_block_stride_and_log_layout(views, "NL_X_NB_BS_HS", 0, 0)
    padded = [torch.zeros(nb * (bs * hs + 40), dtype=torch.bfloat16).as_strided((nb, bs, hs), (bs * hs + 40, hs, 1)) for _ in range(2)]
    assert L.resolve_block_stride_and_log_layout(padded, "NL_X_NB_BS_HS", 1, 3) == bs * hs + 40
    tight = [torch.zeros(nb, bs, hs, dtype=torch.bfloat16)]
    assert L.resolve_block_stride_and_log_layout(tight, "NL_X_NB_BS_HS", 0, 0) == bs * hs
    desc = L.make_page_buffer_shape_desc(padded, "NL_X_NB_BS_HS", 0, 2, nb, bs, bs * hs + 40)
    assert desc.block_stride_elems == bs * hs + 40 and desc.nh == 1 and desc.hs == hs
    assert L.get_concrete_engine_kv_shape_from_shape_desc(desc, "NL_X_NB_BS_HS") == f"2 x [{nb}, {bs}, {hs}]"


def test_block_stride_of_a_padded_block_first_pool_for_any_format():
    # LMCache allows dim-0 padding for two formats; the grammar answers it for every block-first one
    nb, nh, bs, hs, pad = 4, 2, 8, 16, 64
    per_block = 2 * bs * nh * hs + pad
    kv = [torch.zeros(nb * per_block, dtype=torch.float16).as_strided((nb, 2, bs, nh, hs), (per_block, bs * nh * hs, nh * hs, hs, 1))]
    assert L.resolve_block_stride_and_log_layout(kv, "NL_X_NB_TWO_BS_NH_HS", 0, 0) == per_block
    # K/V-major: dim 0 is the K/V axis, its padding is not a block stride
    kv = [
        torch.zeros(2 * (nb * bs * nh * hs + pad), dtype=torch.float16).as_strided(
            (2, nb, bs, nh, hs), (nb * bs * nh * hs + pad, bs * nh * hs, nh * hs, hs, 1)
        )
    ]
    with pytest.raises(GeometryError):
        L.resolve_block_stride_and_log_layout(kv, "NL_X_TWO_NB_BS_NH_HS", 0, 0)
    assert L.resolve_block_stride_and_log_layout(_fa_nhd(), "NL_X_TWO_NB_BS_NH_HS", 0, 0) is None


def test_resolve_block_stride_logs_an_audit_line(caplog):
    with caplog.at_level(logging.INFO, logger="kvcore.compat.lmcache"):
        L.resolve_block_stride_and_log_layout([torch.zeros(3, 4, 8)], "NL_X_NB_BS_HS", 0, 5)
    assert "Group 5 first-layer tensor" in caplog.text and "shape=(3, 4, 8)" in caplog.text


def test_make_page_buffer_shape_desc_validates():
    kv = _fa_nhd(nl=2, nb=5, bs=4, nh=2, hs=8)
    d = L.make_page_buffer_shape_desc(kv, "NL_X_TWO_NB_BS_NH_HS", 1, 2, 5, 4)
    assert (d.kv_size, d.nl, d.nb, d.bs, d.nh, d.hs, d.element_size, d.block_stride_elems) == (2, 2, 5, 4, 2, 8, 2, 0)
    for bad in [dict(num_blocks=0), dict(block_size=-1), dict(num_layers_in_group=True)]:
        args = dict(layer_idx=0, num_layers_in_group=2, num_blocks=5, block_size=4) | bad
        with pytest.raises(GeometryError):
            L.make_page_buffer_shape_desc(kv, "NL_X_TWO_NB_BS_NH_HS", **args)
    with pytest.raises(GeometryError, match="out of range"):
        L.make_page_buffer_shape_desc(kv, "NL_X_TWO_NB_BS_NH_HS", 7, 2, 5, 4)


def test_the_facade_feeds_kvcore_transfers():
    kv = _fa_hnd_as_vllm(nl=2, nb=4, bs=4, nh=2, hs=8, dtype=torch.float32)
    for li, t in enumerate(kv):  # value = layer*1000 + kv*100 + slot*10 + head, per element
        for k in range(2):
            for b in range(4):
                for o in range(4):
                    for h in range(2):
                        t[k, b, o, h] = li * 1000 + k * 100 + (b * 4 + o) * 10 + h
    fmt, norm = L.normalize_kv_and_discover_format(kv, ENGINE, {"kv_layout": "HND"})
    lay = kvcore.build_layout(fmt, norm, dtype=fmt.dtype)
    st = kvcore.gather(lay, torch.tensor([5, 14]))
    assert st.shape == (2, 2, 2, L.get_hidden_dim_size(norm, fmt))
    assert st[1, 1, 0, 8].item() == 1000 + 100 + 50 + 1  # V, layer 1, slot 5, head 1
    assert st[0, 0, 1, 0].item() == 140


# -- names, facts and strings ----------------------------------------------------------------

LMCACHE_FACTS = {  # lmcache_kv_format.md §1.3, newest header; (cross, kv_list, layer_list, mla, hnd, two_major, tuple)
    "NB_NL_TWO_BS_NH_HS": (1, 0, 0, 0, 0, 0, 0),
    "NL_X_TWO_NB_BS_NH_HS": (0, 0, 1, 0, 0, 1, 0),
    "NL_X_NB_TWO_BS_NH_HS": (0, 0, 1, 0, 0, 0, 0),
    "NL_X_NB_BS_HS": (0, 0, 1, 1, 0, 0, 0),
    "TWO_X_NL_X_NBBS_NH_HS": (0, 1, 0, 0, 0, 0, 0),
    "NL_X_NBBS_ONE_HS": (0, 0, 1, 1, 0, 0, 0),
    "NL_X_TWO_NB_NH_BS_HS": (0, 0, 1, 0, 1, 1, 0),
    "NL_X_NB_TWO_NH_BS_HS": (0, 0, 1, 0, 1, 0, 0),
    "NB_NL_TWO_NH_BS_HS": (1, 0, 0, 0, 1, 0, 0),
    "TWO_X_NL_X_NB_BS_NH_HS": (0, 1, 0, 0, 0, 0, 0),
    "NL_X_NB_NH_BS_CS": (0, 0, 1, 0, 1, 0, 0),
    "NL_X_NB_BS_NH_CS": (0, 0, 1, 0, 0, 0, 0),
    "NL_X_NB_BSV_BSS": (0, 0, 1, 1, 0, 0, 0),
    "NL_X_TWO_NB_NH_ONE_BS_HS": (0, 0, 1, 0, 1, 1, 0),
    "NL_X_TWO_X_NB_BS_NH_HS": (0, 0, 1, 0, 0, 0, 1),
    "NL_X_NP_X_NB_BS_ONE_HS": (0, 0, 1, 1, 0, 0, 1),
}


@pytest.mark.parametrize("name", sorted(LMCACHE_FACTS))
def test_predicates_match_lmcaches_format_facts(name):
    want = tuple(bool(x) for x in LMCACHE_FACTS[name])
    got = (
        L.is_cross_layer(name),
        L.is_kv_list(name),
        L.is_layer_list(name),
        L.is_mla(name),
        L.is_hnd(name),
        L.is_two_major(name),
        L.is_kv_second_tuple(name),
    )
    assert got == want
    assert L.is_fused_packed(name) == name.endswith("_CS")


def test_strings_for_logging():
    assert L.describe_shape("TWO_X_NL_X_NBBS_NH_HS") == "2 x NL x [PBS, NH, HS]"
    assert L.get_engine_kv_shape_description("NL_X_NOPE") == "Unknown (NL_X_NOPE)"
    sizes = {"NL": 80, "NB": 2048, "BS": 128, "NH": 8, "HS": 128}
    assert L.concrete_shape("NL_X_TWO_NB_NH_BS_HS", sizes.__getitem__) == "80 x [2, 2048, 8, 128, 128]"
    with pytest.raises(KeyError):
        L.concrete_shape("NL_X_NBBS_ONE_HS", sizes.__getitem__)  # no PBS: the size_fn's KeyError
    desc = kvcore.PageBufferShapeDesc(kv_size=2, nl=4, nb=10, bs=16, nh=2, hs=64, element_size=2)
    assert L.get_concrete_engine_kv_shape_from_shape_desc(desc, "NL_X_NB_NH_BS_CS") == "4 x [10, 2, 16, 128]"
    assert L.get_concrete_engine_kv_shape_from_shape_desc(desc, "TWO_X_NL_X_NBBS_NH_HS") == "2 x 4 x [160, 2, 64]"
    assert L.get_attention_backend("NL_X_NB_NH_BS_NH_HS_BAD") == "Unknown (NL_X_NB_NH_BS_NH_HS_BAD)"
    assert L.get_attention_backend("NB_NL_NH_BS_TWO_HS") == "Unknown (NB_NL_NH_BS_TWO_HS)"  # parses, nobody registers it
    with pytest.raises(FormatError, match="unknown token 'NOPE'"):
        L.EngineKVFormat("NL_X_NOPE")
    with pytest.raises(FormatError):
        L.is_mla(42)
    assert repr(L.EngineKVFormat("NL_X_NB_BS_HS")) == "EngineKVFormat.NL_X_NB_BS_HS"
    fmt = kvcore.KVFormat(name="NL_X_NB_BS_HS")
    assert L.is_mla(fmt)


def test_assert_contiguous_raises_kvcore_errors():
    L.assert_contiguous(torch.zeros(4, 4))
    with pytest.raises(GeometryError, match="storage_offset 0"):
        L.assert_contiguous(torch.zeros(4, 4)[1:])
    with pytest.raises(GeometryError, match="not contiguous"):
        L.assert_contiguous(torch.zeros(4, 4).t())
    with pytest.raises(ValueError):
        L.assert_contiguous("not a tensor")


def test_extract_shapes_and_legible_print(caplog):
    assert L.extract_kv_cache_shapes({"a": torch.zeros(2, 3), "b": [torch.zeros(2, 3), (torch.zeros(4),)]}) == {
        torch.Size([2, 3]),
        torch.Size([4]),
    }
    with caplog.at_level(logging.INFO, logger="kvcore.compat.lmcache"):
        L.legible_print_engine_kv_format("NL_X_NB_BS_HS")
        L.legible_print_engine_kv_format("BAD")
    assert "NL x [NB, BS, HS]" in caplog.text and "Unknown Engine KV Format: BAD" in caplog.text


def test_with_the_vllm_plugin_byte_views_and_0_33_geometry():
    """Integration with a real engine plugin (skipped without kvcore-vllm): vLLM 0.33 keeps
    per-layer int8 views of one buffer; the format carries bf16 so the accessors report
    element geometry, and the pointers are the per-layer views' bases."""
    fixtures = pytest.importorskip("kvcore_vllm.fixtures")
    kv = fixtures.allocate(
        "0.33.0", "FLASH_ATTN", "NHD", num_layers=3, num_blocks=6, block_size=16, num_kv_heads=2, head_size=8, byte_views=True
    )
    fmt, norm = L.normalize_kv_and_discover_format(kv, "vllm", {"vllm_version": "0.33.0", "dtype": "bfloat16"})
    assert fmt == "NL_X_NB_BS_NH_CS" and fmt.is_fused_packed and fmt.dtype == torch.bfloat16
    assert all(t.dtype == torch.int8 for t in norm)
    assert (L.get_num_layers(norm, fmt), L.get_num_blocks(norm, fmt), L.get_block_size(norm, fmt)) == (3, 6, 16)
    assert (L.get_num_heads(norm, fmt), L.get_head_size(norm, fmt), L.get_kv_size(norm, fmt)) == (2, 8, 2)
    assert L.get_dtype(norm, fmt, 2) == torch.bfloat16
    assert L.get_concrete_engine_kv_shape(norm, fmt) == "3 x [6, 16, 2, 32]"  # the tensors as they are: CS in bytes
    assert L.get_data_ptrs(norm, fmt) == [t.data_ptr() for t in norm]
    assert L.resolve_block_stride_and_log_layout(norm, fmt, 1, 0) == 16 * 2 * 16
