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
from kvcore.errors import AmbiguousLayoutError, DetectionError, FormatError, GeometryError, KVCoreError, TransferError

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


# -- LMCache's vocabulary: enum members, engine types, hints -------------------------------------

LMCACHE_MEMBERS = {  # LMCache 0.5.6 csrc/engine_kv_format.h: name -> enum value
    "NB_NL_TWO_BS_NH_HS": 0,
    "NL_X_TWO_NB_BS_NH_HS": 1,
    "NL_X_NB_TWO_BS_NH_HS": 2,
    "NL_X_NB_BS_HS": 3,
    "TWO_X_NL_X_NBBS_NH_HS": 4,
    "NL_X_NBBS_ONE_HS": 5,
    "NL_X_TWO_NB_NH_BS_HS": 6,
    "NL_X_NB_TWO_NH_BS_HS": 7,
    "NB_NL_TWO_NH_BS_HS": 8,
    "TWO_X_NL_X_NB_BS_NH_HS": 9,
    "NL_X_NB_NH_BS_TWO_HS": 10,
    "NL_X_NB_BS_NH_TWO_HS": 11,
    "NL_X_NB_NH_BS_CS": 12,
    "NL_X_NB_BS_NH_CS": 13,
    "NL_X_NB_BSV_BSS": 14,
    "NL_X_TWO_NB_NH_ONE_BS_HS": 15,
    "NL_X_TWO_X_NB_BS_NH_HS": 16,
    "NL_X_NP_X_NB_BS_ONE_HS": 17,
    "NL_X_NB_BS_NH_HS": 18,
}


def test_engine_kv_format_has_exactly_lmcaches_members():
    F = L.EngineKVFormat
    members = {v for v in vars(F).values() if isinstance(v, F)}
    assert members == set(LMCACHE_MEMBERS)
    for name, value in LMCACHE_MEMBERS.items():
        m = getattr(F, name)
        assert m == name and m.name == name and m.value == value and int(m) == value
        assert F.__members__[name] is m
    # kvcore formats LMCache has no member for are values too, without an enum value
    other = F("NB_NL_NH_BS_CS")
    assert other.value is None and not hasattr(F, "NB_NL_NH_BS_CS")
    with pytest.raises(FormatError, match="no LMCache EngineKVFormat value"):
        int(other)
    # a detected value equals (and hashes as) the member
    assert {F("NL_X_NB_BS_HS", torch.bfloat16): 1}[F.NL_X_NB_BS_HS] == 1


def test_engine_type_values_are_engine_names():
    assert [e.value for e in L.EngineType] == ["vllm", "atom", "sglang", "trtllm", "mock"]
    assert L.LayoutHints.__annotations__.keys() == {"kv_layout", "num_kv_heads", "tokens_per_block", "kv_list_layout", "head_dim"}
    with pytest.raises(DetectionError, match="'mock'"):  # no kvcore plugin answers LMCache's mock engine
        L.normalize_kv_and_discover_format(_fa_nhd(), L.EngineType.MOCK)


def test_hints_are_translated_per_engine():
    lm = {
        "kv_layout": "NHD",
        "tokens_per_block": 16,
        "head_dim": 64,
        "num_kv_heads": 2,
        "kv_list_layout": "k_v",
        "torch_device_type": "cuda",
        "inference_engine_logical_block_size": 64,
    }
    assert L._hints(lm, "vllm") == {
        "kv_cache_layout": "NHD",
        "block_size": 16,
        "head_size": 64,
        "num_kv_heads": 2,
        "device_type": "cuda",
    }
    assert L._hints(lm, "sglang") == {"layout": "NHD", "page_size": 16, "head_size": 64, "num_kv_heads": 2, "kv_list_layout": "k_v"}
    # kvcore-trtllm reads LMCache's own names
    assert L._hints(lm, "trtllm") == {k: v for k, v in lm.items() if k != "inference_engine_logical_block_size"}
    # both spellings agree: one key; kvcore keys pass unchanged
    assert L._hints({"tokens_per_block": 16, "page_size": 16, "is_mla": True}, "sglang") == {"page_size": 16, "is_mla": True}
    with pytest.raises(DetectionError, match="tokens_per_block=16 and page_size=32"):
        L._hints({"tokens_per_block": 16, "page_size": 32}, "sglang")


def test_trtllm_plugin_gets_lmcaches_hint_names_and_the_6d_view():
    pytest.importorskip("kvcore_trtllm")
    nb, nl, nh, bs, hd = 6, 3, 2, 16, 64
    pool = torch.zeros(nb, nl, 2, nh * bs * hd, dtype=torch.bfloat16)
    hints = {"num_kv_heads": nh, "tokens_per_block": bs, "head_dim": hd}
    fmt, kv = L.normalize_kv_and_discover_format(pool, L.EngineType.TRTLLM, hints)
    assert fmt == L.EngineKVFormat.NB_NL_TWO_NH_BS_HS and kv.shape == (nb, nl, 2, nh, bs, hd)
    spec = L.get_spec(kv, fmt)
    assert (spec.num_layers(), spec.num_blocks(), spec.block_size(), spec.num_heads(), spec.head_size()) == (nl, nb, bs, nh, hd)
    # LMCache's already-viewed pool: the sizes are read off its axes, the storage is the pool's
    fmt, kv = L.normalize_kv_and_discover_format(pool.view(nb, nl, 2, nh, bs, hd), L.EngineType.TRTLLM)
    assert fmt == "NB_NL_TWO_NH_BS_HS" and kv.data_ptr() == pool.data_ptr() and kv.shape == (nb, nl, 2, nh, bs, hd)
    with pytest.raises(DetectionError, match="head_dim=32"):
        L.normalize_kv_and_discover_format(pool.view(nb, nl, 2, nh, bs, hd), "trtllm", {"head_dim": 32})
    with pytest.raises(DetectionError, match="contiguous"):
        L.normalize_kv_and_discover_format(pool.view(nb, nl, 2, nh, bs, hd).transpose(3, 4), "trtllm")


def test_sglang_mla_pool_is_paged_by_tokens_per_block_as_lmcache_0_5_6():
    # LMCache 0.5.6 detectors/sglang.py: a flat list of (rows, 1, D) tensors is the MLA pool; with tokens_per_block its
    # rows are split into pages (NL_X_NB_BS_HS), without it the fused axis stays (NL_X_NBBS_ONE_HS)
    pytest.importorskip("kvcore_sglang")
    rows, d = 3 * 16, 576
    pool = [torch.zeros(rows, 1, d, dtype=torch.bfloat16) for _ in range(3)]  # the three layers (48, 1, 576)
    for i, t in enumerate(pool):
        t.copy_(torch.arange(rows * d, dtype=torch.float32).view(rows, 1, d).remainder(97) + i)
    fmt, kv = L.normalize_kv_and_discover_format(pool, L.EngineType.SGLANG, {"tokens_per_block": 16})
    assert fmt == L.EngineKVFormat.NL_X_NB_BS_HS
    assert [tuple(t.shape) for t in kv] == [(3, 16, d)] * 3 and [t.data_ptr() for t in kv] == [t.data_ptr() for t in pool]
    spec = L.get_spec(kv, fmt)
    assert (spec.num_layers(), spec.num_blocks(), spec.block_size(), spec.head_size(), spec.kv_size()) == (3, 3, 16, d, 1)
    assert torch.equal(kv[2][1, 5], pool[2][21, 0])  # slot 21 = block 1, offset 5
    fmt, kv = L.normalize_kv_and_discover_format(pool, L.EngineType.SGLANG, {})
    assert fmt == "NL_X_NBBS_ONE_HS" and fmt.is_pbs_fused and L.get_page_buffer_size(kv, fmt) == rows
    by_name = {f"model.layers.{i}.attn": t for i, t in enumerate(pool)}
    fmt, kv = L.normalize_kv_and_discover_format(by_name, "sglang", {"tokens_per_block": 16})
    assert fmt == "NL_X_NB_BS_HS" and [t.data_ptr() for t in kv] == [t.data_ptr() for t in pool]
    with pytest.raises(DetectionError, match="not divisible"):  # LMCache: ValueError 'not divisible by tokens_per_block'
        L.normalize_kv_and_discover_format(pool, "sglang", {"tokens_per_block": 7})
    # LMCache's MP registration: K layers then V layers, split into pages
    flat = [torch.zeros(rows, 1, 128, dtype=torch.bfloat16) for _ in range(4)]
    fmt, kv = L.normalize_kv_and_discover_format(flat, "sglang", {"tokens_per_block": 16, "kv_list_layout": "k_v"})
    assert fmt == "TWO_X_NL_X_NB_BS_NH_HS" and kv[0][0].shape == (3, 16, 1, 128)
    assert L.get_group_data_ptrs(kv, fmt, [1]) == [flat[1].data_ptr(), flat[3].data_ptr()]


def test_vllm_hints_in_lmcache_names_reach_the_plugin():
    pytest.importorskip("kvcore_vllm")
    fa = [torch.zeros(2, 5, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3)]
    # SGLang's kv_list_layout and the logical block size are not for vLLM's detector: dropped
    extra = {"kv_list_layout": "k_v", "inference_engine_logical_block_size": 64}
    fmt, _ = L.normalize_kv_and_discover_format(fa, L.EngineType.VLLM, {"kv_layout": "NHD", "tokens_per_block": 16, **extra})
    assert fmt == "NL_X_TWO_NB_BS_NH_HS"
    with pytest.raises(DetectionError, match="'head_size': 32"):  # head_dim arrives as head_size
        L.normalize_kv_and_discover_format(fa, L.EngineType.VLLM, {"kv_layout": "NHD", "head_dim": 32})
    with pytest.raises(DetectionError, match="block_size=24"):  # tokens_per_block as block_size
        L.normalize_kv_and_discover_format(fa, L.EngineType.VLLM, {"kv_layout": "NHD", "tokens_per_block": 24})


# -- LMCache's names for kvcore's layouts -------------------------------------------------------


class _ViewsPlugin:
    """Engine ``lmviews``: returns the format named by hint ``fmt`` over the tensors as given."""

    @kvcore.hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != "lmviews":
            return None
        return kvcore.Detection(format=hints["fmt"], kv_caches=kv_caches)


@pytest.fixture
def views_plugin():
    name = kvcore.register_plugin(_ViewsPlugin(), "lmviews-test")
    yield
    kvcore.unregister_plugin(name)


def test_a_blocks_first_cross_layer_tensor_comes_back_as_lmcaches_per_layer_views(views_plugin):
    nb, nl, nh, bs, cs = 5, 3, 2, 4, 8
    buf = torch.zeros(nb, nl, nh, bs, cs, dtype=torch.float16)
    fmt, kv = L.normalize_kv_and_discover_format(buf, "lmviews", {"fmt": "NB_NL_NH_BS_CS"})
    assert fmt == L.EngineKVFormat.NL_X_NB_NH_BS_CS and len(kv) == nl
    for i, v in enumerate(kv):  # layer i's view: same bytes, the block step spans every layer
        assert v.shape == (nb, nh, bs, cs) and v.stride() == (nl * nh * bs * cs, bs * cs, cs, 1)
        assert v.data_ptr() == buf.data_ptr() + i * nh * bs * cs * 2
    assert L.resolve_block_stride_and_log_layout(kv, fmt, 2, 0) == nl * nh * bs * cs
    # a singleton head axis is dropped when LMCache names the rest
    mla = [torch.zeros(nb, bs, 1, 32) for _ in range(2)]
    fmt, kv = L.normalize_kv_and_discover_format(mla, "lmviews", {"fmt": "NL_X_NB_BS_ONE_HS"})
    assert fmt == "NL_X_NB_BS_HS" and kv[1].shape == (nb, bs, 32) and kv[1].data_ptr() == mla[1].data_ptr()
    # no LMCache member for these bytes: kvcore's name and container stay
    heads_out = torch.zeros(nb, nh, nl, bs, cs)
    fmt, kv = L.normalize_kv_and_discover_format(heads_out, "lmviews", {"fmt": "NB_NH_NL_BS_CS"})
    assert fmt == "NB_NH_NL_BS_CS" and kv is heads_out
    # LMCache's own members are never re-viewed
    cross = torch.zeros(nb, nl, 2, bs, nh, 16)
    fmt, kv = L.normalize_kv_and_discover_format(cross, "lmviews", {"fmt": "NB_NL_TWO_BS_NH_HS"})
    assert fmt == "NB_NL_TWO_BS_NH_HS" and kv is cross


def test_vllm_blocks_first_views_keep_their_addresses():
    pytest.importorskip("kvcore_vllm")
    nb, nl, nh, bs, cs = 6, 3, 2, 16, 128
    buf = torch.zeros(nb, nl, nh, bs, cs, dtype=torch.bfloat16)
    views = [buf[:, i] for i in range(nl)]
    fmt, kv = L.normalize_kv_and_discover_format(views, L.EngineType.VLLM, {"kv_layout": "BLHNC"})
    assert fmt == L.EngineKVFormat.NL_X_NB_NH_BS_CS
    assert [(v.data_ptr(), v.shape, v.stride()) for v in kv] == [(v.data_ptr(), v.shape, v.stride()) for v in views]
    assert L.resolve_block_stride_and_log_layout(kv, fmt, 0, 0) == buf.stride(0)


# -- spec classes ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LMCACHE_MEMBERS))
def test_every_member_has_a_spec_class_carrying_its_facts(name):
    cls = L.get_spec_class(getattr(L.EngineKVFormat, name))
    assert cls is L.get_spec_class(name) and issubclass(cls, L.KVFormatSpec) and cls.__name__ == f"{name}_Spec"
    assert cls.engine_kv_format == name
    structure = (cls.is_cross_layer, cls.is_kv_list, cls.is_layer_list)
    assert sum(structure) == 1
    if name in LMCACHE_FACTS:  # LMCache's golden facts (cross, kv_list, layer_list, mla, hnd, two_major, tuple)
        want = tuple(bool(x) for x in LMCACHE_FACTS[name])
        assert (*structure, cls.is_mla, cls.is_hnd, cls.is_two_major, cls.is_kv_second_tuple) == want
    assert cls.is_fused_packed == (name.endswith("_CS") or name.endswith("_TWO_HS"))
    assert cls.is_pbs_fused == ("NBBS" in name)
    assert cls.is_single_kv == (name == "NL_X_NB_BS_NH_HS")
    backends = cls.attention_backends
    assert isinstance(backends, tuple) and backends and all(isinstance(b, str) for b in backends)
    assert L.get_attention_backend(name) == backends[0] and L.get_spec(None, name).attention_backends == backends


def test_spec_classes_for_kvcore_formats_and_unknown_names():
    cls = L.get_spec_class("TWO_X_NL_X_NB_NH_BS_HS")  # kvcore's SGLang HND pool: no LMCache member
    assert cls.is_kv_list and cls.is_hnd and not cls.is_mla
    with pytest.raises(FormatError, match="Unknown Engine KV Format") as ei:
        L.get_spec_class("NL_X_NOPE")
    assert isinstance(ei.value, ValueError)
    assert L.get_attention_backend("NL_X_NOPE") == "Unknown (NL_X_NOPE)"
    with pytest.raises(FormatError, match="describes NL_X_NB_BS_HS"):
        L.get_spec_class("NL_X_NB_BS_HS")([torch.zeros(2, 3, 4)], "NL_X_NBBS_ONE_HS")


def _registers(name, engine, backends):
    class Registers:
        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name=name, engines=[engine], attention_backends=backends))

    return Registers()


def test_attention_backends_put_lmcaches_engine_first_whatever_else_is_installed(core_only):
    """An LMCache member's first label is its LMCache engine's: that engine's plugin's
    backend when installed, else LMCache's label; another engine's plugin (or a third
    party) declaring the same name never changes it."""
    name = "NL_X_NB_BS_NH_HS"  # LMCache: SGLang's per-component K or V views
    lmcache_label = L.get_spec_class(name).attention_backends
    assert len(lmcache_label) == 1 and "SGLang" in lmcache_label[0]  # no plugin registers it here
    kvcore.register_plugin(_registers(name, "x", ["XBackend"]), "aaa-x")  # sorts first, another engine
    assert L.get_spec_class(name).attention_backends == (*lmcache_label, "XBackend")
    assert L.get_attention_backend(name) == lmcache_label[0]
    kvcore.register_plugin(_registers(name, "sglang", ["SGLangBackend"]), "sglang")  # the engine's own plugin
    assert L.get_spec_class(name).attention_backends == ("SGLangBackend", *lmcache_label, "XBackend")
    kvcore.unregister_plugin("aaa-x")
    assert L.get_attention_backend(name) == "SGLangBackend"
    # a name no LMCache member has: the registry's owner's labels first
    kvcore.register_plugin(_registers("TWO_X_NL_X_NB_NH_BS_HS", "y", ["YBackend"]), "y")
    assert L.get_attention_backend("TWO_X_NL_X_NB_NH_BS_HS") == "YBackend"
    assert L.get_spec_class("NB_NH_NL_BS_CS").attention_backends == ()  # nobody: empty, "Unknown"
    assert L.get_attention_backend("NB_NH_NL_BS_CS") == "Unknown (NB_NH_NL_BS_CS)"


def test_the_facade_gives_vllms_labels_for_vllm_layouts_shared_with_other_plugins():
    """The in-tree plugins: transformers, LMDeploy and SGLang also declare some of vLLM's
    LMCache members; the facade's label is vLLM's (LMCache's engine for the member)."""
    if "vllm" not in {p.name for p in kvcore.plugins() if p.error is None}:
        pytest.skip("the vLLM plugin is not installed")
    got = {n: L.get_attention_backend(n) for n in ("NB_NL_TWO_BS_NH_HS", "NL_X_TWO_X_NB_BS_NH_HS", "NL_X_NB_BSV_BSS")}
    vllm = {n: kvcore.registry.declarations(n)["vllm"].attention_backends[0] for n in got}
    assert got == vllm
    assert got["NB_NL_TWO_BS_NH_HS"] != "PagedAttentionCache" and got["NL_X_NB_BSV_BSS"] != "NSATokenToKVPool"


@pytest.mark.parametrize(
    "name, shape",
    [
        ("NL_X_TWO_NB_NH_BS_HS", (2, 4, 3, 16, 64)),
        ("NL_X_NB_TWO_BS_NH_HS", (4, 2, 16, 3, 64)),
        ("NL_X_NBBS_ONE_HS", (64, 1, 64)),
        ("NL_X_NB_BS_HS", (4, 16, 64)),
        ("NL_X_NB_NH_BS_CS", (4, 3, 16, 64)),
        ("NL_X_TWO_NB_NH_ONE_BS_HS", (2, 4, 3, 1, 16, 64)),
        ("NL_X_NB_BSV_BSS", (4, 16, 64)),
        ("NL_X_NB_BS_NH_HS", (4, 16, 3, 64)),
    ],
)
def test_paged_layer_shape_builds_one_layers_tensor_shape(name, shape):
    assert L.get_spec_class(name).paged_layer_shape(4, 16, 3, 64) == shape


@pytest.mark.parametrize("name", ["NB_NL_TWO_BS_NH_HS", "TWO_X_NL_X_NBBS_NH_HS", "NL_X_TWO_X_NB_BS_NH_HS", "NL_X_NP_X_NB_BS_ONE_HS"])
def test_paged_layer_shape_refuses_formats_without_one_tensor_per_layer(name):
    with pytest.raises(FormatError, match="one paged tensor per layer") as ei:
        L.get_spec_class(name).paged_layer_shape(4, 16, 3, 64)
    assert isinstance(ei.value, ValueError)


def test_paged_layer_shape_refuses_bad_sizes():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(FormatError, match="positive int"):
            L.get_spec_class("NL_X_NB_BS_HS").paged_layer_shape(4, bad, 1, 64)


NB_, NL_, BS_, NH_, HS_ = 5, 3, 4, 7, 6  # distinct, so a wrong axis shows as a wrong number


def _cache(name, dtype=torch.float16):
    t = lambda *s: torch.zeros(s, dtype=dtype)  # noqa: E731
    return {
        "NB_NL_TWO_NH_BS_HS": lambda: t(NB_, NL_, 2, NH_, BS_, HS_),
        "NL_X_NB_TWO_NH_BS_HS": lambda: [t(NB_, 2, NH_, BS_, HS_) for _ in range(NL_)],
        "TWO_X_NL_X_NB_BS_NH_HS": lambda: [[t(NB_, BS_, NH_, HS_) for _ in range(NL_)] for _ in range(2)],
        "NL_X_TWO_X_NB_BS_NH_HS": lambda: [(t(NB_, BS_, NH_, HS_), t(NB_, BS_, NH_, HS_)) for _ in range(NL_)],
        "NL_X_TWO_NB_NH_ONE_BS_HS": lambda: [t(2, NB_, NH_, 1, BS_, HS_) for _ in range(NL_)],
        "NL_X_NB_BS_NH_HS": lambda: [t(NB_, BS_, NH_, HS_) for _ in range(NL_)],
    }[name]()


SPEC_CASES = {  # name -> (kv_size, num_heads, elements per layer, concrete shape, pointers of layers [2, 0])
    "NB_NL_TWO_NH_BS_HS": (2, NH_, 2 * NB_ * BS_ * NH_ * HS_, f"[{NB_}, {NL_}, 2, {NH_}, {BS_}, {HS_}]", lambda kv: [kv.data_ptr()]),
    "NL_X_NB_TWO_NH_BS_HS": (
        2,
        NH_,
        2 * NB_ * BS_ * NH_ * HS_,
        f"{NL_} x [{NB_}, 2, {NH_}, {BS_}, {HS_}]",
        lambda kv: [kv[2].data_ptr(), kv[0].data_ptr()],
    ),
    "TWO_X_NL_X_NB_BS_NH_HS": (
        2,
        NH_,
        2 * NB_ * BS_ * NH_ * HS_,
        f"2 x {NL_} x [{NB_}, {BS_}, {NH_}, {HS_}]",
        lambda kv: [kv[0][2].data_ptr(), kv[0][0].data_ptr(), kv[1][2].data_ptr(), kv[1][0].data_ptr()],
    ),
    "NL_X_TWO_X_NB_BS_NH_HS": (
        2,
        NH_,
        2 * NB_ * BS_ * NH_ * HS_,
        f"{NL_} x 2 x [{NB_}, {BS_}, {NH_}, {HS_}]",
        lambda kv: [kv[2][0].data_ptr(), kv[2][1].data_ptr(), kv[0][0].data_ptr(), kv[0][1].data_ptr()],
    ),
    "NL_X_TWO_NB_NH_ONE_BS_HS": (
        2,
        NH_,
        2 * NB_ * BS_ * NH_ * HS_,
        f"{NL_} x [2, {NB_}, {NH_}, 1, {BS_}, {HS_}]",
        lambda kv: [kv[2].data_ptr(), kv[0].data_ptr()],
    ),
    "NL_X_NB_BS_NH_HS": (
        1,
        NH_,
        NB_ * BS_ * NH_ * HS_,
        f"{NL_} x [{NB_}, {BS_}, {NH_}, {HS_}]",
        lambda kv: [kv[2].data_ptr(), kv[0].data_ptr()],
    ),
}


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_spec_accessors_read_each_axis(name):
    kv = _cache(name)
    kv_size, nh, elements, concrete, ptrs = SPEC_CASES[name]
    spec = L.get_spec(kv, getattr(L.EngineKVFormat, name))
    assert (spec.num_layers(), spec.num_blocks(), spec.block_size(), spec.page_buffer_size()) == (NL_, NB_, BS_, NB_ * BS_)
    assert (spec.kv_size(), spec.num_heads(), spec.head_size(), spec.hidden_dim()) == (kv_size, nh, HS_, nh * HS_)
    assert (spec.tokens_per_layer(), spec.elements_per_layer(), spec.dtype()) == (NB_ * BS_, elements, torch.float16)
    assert spec.concrete_shape_str() == concrete
    assert spec.data_ptrs([2, 0]) == ptrs(kv) and all(isinstance(p, int) for p in spec.data_ptrs())
    with pytest.raises(GeometryError):
        spec.data_ptrs([0, 0])
    with pytest.raises(GeometryError, match="out of range"):
        spec.data_ptrs([NL_])


def test_fused_nbbs_specs_refuse_blocks_with_a_value_error():
    kv = [[torch.zeros(24, 3, 8) for _ in range(2)] for _ in range(2)]
    spec = L.get_spec(kv, L.EngineKVFormat.TWO_X_NL_X_NBBS_NH_HS)
    for accessor in (spec.num_blocks, spec.block_size):
        with pytest.raises(ValueError, match="NBBS"):
            accessor()
    assert (spec.page_buffer_size(), spec.tokens_per_layer(), spec.elements_per_layer()) == (24, 24, 2 * 24 * 3 * 8)
    assert spec.concrete_shape_str() == "2 x 2 x [24, 3, 8]"


def test_packed_kv_specs_report_kvcores_k_head_size():
    # the documented difference: K|V packed in CS is staged as two planes
    nb, bs, nh, hs = 4, 16, 2, 8
    kv = [torch.zeros(nb, bs, nh, 2 * hs) for _ in range(3)]
    spec = L.get_spec(kv, L.EngineKVFormat.NL_X_NB_BS_NH_CS)
    assert (spec.kv_size(), spec.head_size(), spec.hidden_dim()) == (2, hs, nh * hs)
    assert spec.elements_per_layer() == nb * bs * nh * 2 * hs  # every element of the layer, as LMCache
    assert spec.concrete_shape_str() == f"3 x [{nb}, {bs}, {nh}, {2 * hs}]"


def test_blocked_scale_records_take_their_scale_width_from_lmcaches_table():
    kv = [torch.zeros(4, 64, 132, dtype=torch.uint8) for _ in range(2)]  # DeepSeek-V3.2 indexer: 128 fp8 + 4 scale bytes
    spec = L.get_spec(kv, L.EngineKVFormat.NL_X_NB_BSV_BSS)
    assert (spec.num_blocks(), spec.block_size(), spec.head_size(), spec.num_heads(), spec.kv_size()) == (4, 64, 132, 1, 1)
    with pytest.raises(GeometryError, match="scale_bytes"):  # a record width LMCache's table does not list
        L.get_spec([torch.zeros(4, 64, 100, dtype=torch.uint8)], "NL_X_NB_BSV_BSS").head_size()


# -- PageBufferShapeDesc -----------------------------------------------------------------------


def test_page_buffer_shape_desc_is_built_empty_then_filled():
    sd = L.PageBufferShapeDesc()
    assert [getattr(sd, k) for k in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems")] == [0] * 8
    assert sd.dtype is None
    sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs, sd.element_size = 1, 4, 10, 16, 2, 128, 2
    sd.dtype = torch.bfloat16
    assert L.get_concrete_engine_kv_shape_from_shape_desc(sd, "NL_X_NB_NH_BS_CS") == "4 x [10, 2, 16, 128]"  # kv_size 1: hs is CS
    sd.kv_size, sd.hs = 2, 64
    assert L.get_concrete_engine_kv_shape_from_shape_desc(sd, "NL_X_NB_NH_BS_CS") == "4 x [10, 2, 16, 128]"  # kv_size 2: hs is K's
    k = sd.to_kvcore()
    assert isinstance(k, kvcore.PageBufferShapeDesc) and (k.kv_size, k.nl, k.nb, k.bs, k.nh, k.hs, k.element_size) == (
        2,
        4,
        10,
        16,
        2,
        64,
        2,
    )
    again = L.PageBufferShapeDesc.from_kvcore(k, torch.bfloat16)
    assert again == sd and again is not sd
    assert "nb=10" in repr(sd)


@pytest.mark.parametrize("field, bad", [("nb", -1), ("bs", True), ("hs", 2.0), ("kv_size", "2"), ("dtype", "bfloat16")])
def test_page_buffer_shape_desc_refuses_bad_values(field, bad):
    sd = L.PageBufferShapeDesc()
    with pytest.raises(GeometryError, match=f"PageBufferShapeDesc.{field}"):
        setattr(sd, field, bad)
    with pytest.raises(AttributeError):
        sd.num_blocks = 3  # not a field


def test_make_page_buffer_shape_desc_returns_the_mutable_desc_with_its_dtype():
    kv = [torch.zeros(5, 16, 576, dtype=torch.bfloat16) for _ in range(2)]
    sd = L.make_page_buffer_shape_desc(kv, L.EngineKVFormat.NL_X_NB_BS_HS, 1, 2, 5, 16)
    assert isinstance(sd, L.PageBufferShapeDesc) and sd.dtype == torch.bfloat16 and (sd.nh, sd.hs, sd.element_size) == (1, 576, 2)
    sd.block_stride_elems = 16 * 576 + 64  # callers adjust it after the fact
    assert sd.block_stride_elems == 16 * 576 + 64


# -- contiguity recovery, shape keys, connector checks --------------------------------------------


def test_contiguity_recovery_permutes_views_to_their_physical_order():
    phys = torch.zeros(2, 6, 3, 4, 8)  # [2, NB, NH, BS, HS] memory
    logical = phys.transpose(2, 3)  # exposed as [2, NB, BS, NH, HS]
    out = L.attempt_permute_to_contiguous_view(logical)
    assert out.shape == (2, 6, 3, 4, 8) and out.is_contiguous() and out.data_ptr() == phys.data_ptr()
    nested = L.attempt_permute_to_contiguous_view([[logical, logical], (logical,)])
    assert isinstance(nested, list) and isinstance(nested[0], list) and isinstance(nested[1], tuple)
    assert all(t.shape == (2, 6, 3, 4, 8) for t in (*nested[0], *nested[1]))
    plain = torch.zeros(3, 4)
    assert L.attempt_permute_to_contiguous_view(plain).data_ptr() == plain.data_ptr()


def test_contiguity_recovery_places_a_single_head_inside_the_tokens():
    nb, bs, hs = 4, 16, 8
    for pad in (0, 32):
        step = bs * hs + pad
        base = torch.zeros(nb * step)
        view = base.as_strided((nb, 1, bs, hs), (step, hs, hs, 1))  # head and token strides tie
        out = L.attempt_permute_to_contiguous_view(view)
        assert out.shape == (nb, bs, 1, hs) and out.stride() == (step, hs, hs, 1) and out.data_ptr() == base.data_ptr()
    collapsed = torch.zeros(8 * 32).as_strided((8, 1, 1, 32), (32, 1, 1, 1))
    assert L.attempt_permute_to_contiguous_view(collapsed).shape == (8, 32, 1, 1)


def test_contiguity_recovery_refuses_interior_gaps():
    base = torch.zeros(4 * 64)
    gappy = base.as_strided((4, 4, 8), (64, 16, 1))  # 8 of every 16 elements used inside a block
    with pytest.raises(GeometryError, match="dim-0 padding only") as ei:
        L.attempt_permute_to_contiguous_view([gappy])
    assert isinstance(ei.value, ValueError)


def test_shape_and_dtype_keys_tell_layers_apart():
    a, b = torch.zeros(4, 16, 8, dtype=torch.float16), torch.zeros(4, 16, 8, dtype=torch.bfloat16)
    pair = (torch.zeros(4, 16, 1, 32, dtype=torch.int8), torch.zeros(4, 16, 1, 8))
    keys = L.get_shape_and_dtype([a, a.clone(), b, pair])
    assert keys[0] == keys[1] != keys[2]
    assert keys[3] == (((4, 16, 1, 32), torch.int8), ((4, 16, 1, 8), torch.float32))
    assert L.get_shape_and_dtype([a, b, pair], [2, 0]) == [keys[3], keys[0]]
    with pytest.raises(GeometryError, match="out of range"):
        L.get_shape_and_dtype([a], [1])


def test_need_gpu_interm_buffer_follows_enable_pd():
    class Config:
        def __init__(self, pd):
            self.enable_pd = pd

    assert L.need_gpu_interm_buffer(Config(False)) is True
    assert L.need_gpu_interm_buffer(Config(True)) is False
    with pytest.raises(KVCoreError, match="enable_pd"):
        L.need_gpu_interm_buffer(object())


def test_assert_layerwise_gpu_connector_accepts_lmcaches_layerwise_classes():
    VLLMPagedMemLayerwiseGPUConnector = type("VLLMPagedMemLayerwiseGPUConnector", (), {})
    Mine = type("MyConnector", (VLLMPagedMemLayerwiseGPUConnector,), {})
    L.assert_layerwise_gpu_connector(VLLMPagedMemLayerwiseGPUConnector())
    L.assert_layerwise_gpu_connector(Mine())
    with pytest.raises(TransferError, match="VLLMPagedMemGPUConnectorV2 is not a layerwise"):
        L.assert_layerwise_gpu_connector(type("VLLMPagedMemGPUConnectorV2", (), {})())


def test_vllm_format_checks():
    F = L.EngineKVFormat
    for f in (F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS, F.NL_X_NB_BS_NH_CS, F.NL_X_NB_NH_BS_TWO_HS):
        L.assert_is_vllm_flash_attn_or_flash_infer(f)
    for f in (F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_BS_HS, F.NL_X_NB_BSV_BSS):
        L.assert_is_vllm_mla_or_flash_attn_or_flash_infer(f)
    for check, f in [
        (L.assert_is_vllm_flash_attn_or_flash_infer, F.NL_X_NB_BS_HS),  # MLA
        (L.assert_is_vllm_flash_attn_or_flash_infer, F.TWO_X_NL_X_NBBS_NH_HS),  # SGLang
        (L.assert_is_vllm_mla_or_flash_attn_or_flash_infer, F.NL_X_TWO_NB_NH_ONE_BS_HS),  # vLLM-RBLN
        (L.assert_is_vllm_mla_or_flash_attn_or_flash_infer, F.NB_NL_TWO_BS_NH_HS),  # cross-layer
    ]:
        with pytest.raises(FormatError, match=str(f)):
            check(f)


def test_vllm_format_checks_know_the_vllm_plugins_layouts():
    pytest.importorskip("kvcore_vllm")
    L.assert_is_vllm_flash_attn_or_flash_infer("NL_X_NB_BS_TWO_NH_HS")  # vLLM 0.24 FlexAttention, registered by kvcore-vllm
    with pytest.raises(FormatError):
        L.assert_is_vllm_flash_attn_or_flash_infer("TWO_X_NL_X_NB_NH_BS_HS")  # kvcore-sglang's


def test_layers_that_differ_answer_per_layer_and_point_in_kernel_order():
    k = [torch.zeros(24, 2, 8), torch.zeros(24, 4, 8), torch.zeros(24, 4, 16)]
    v = [torch.zeros_like(t) for t in k]
    spec = L.get_spec([k, v], L.EngineKVFormat.TWO_X_NL_X_NBBS_NH_HS)
    assert [spec.num_heads(i) for i in range(3)] == [2, 4, 4] and [spec.head_size(i) for i in range(3)] == [8, 8, 16]
    assert spec.num_layers() == 3 and spec.hidden_dim(2) == 64
    assert spec.data_ptrs([2, 0]) == [k[2].data_ptr(), k[0].data_ptr(), v[2].data_ptr(), v[0].data_ptr()]
    pairs = [(a, b) for a, b in zip(k, v)]
    spec = L.get_spec([(t.unflatten(0, (6, 4)), u.unflatten(0, (6, 4))) for t, u in pairs], "NL_X_TWO_X_NB_BS_NH_HS")
    assert spec.data_ptrs([2, 1]) == [k[2].data_ptr(), v[2].data_ptr(), k[1].data_ptr(), v[1].data_ptr()]
    assert (spec.block_size(1), spec.num_blocks()) == (4, 6)


def test_plane_tuples_of_different_dtypes_are_refused_not_misread():
    # documented difference: LMCache sums the planes' bytes; one kvcore layout holds one dtype
    kv = [(torch.zeros(4, 16, 1, 512, dtype=torch.int8), torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)) for _ in range(2)]
    spec = L.get_spec(kv, L.EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS)
    with pytest.raises(GeometryError, match="one dtype"):
        spec.head_size()
    assert L.get_concrete_engine_kv_shape(kv, "NL_X_NP_X_NB_BS_ONE_HS") == "Unknown (NL_X_NP_X_NB_BS_ONE_HS)"


def test_every_name_the_facade_docs_and_messages_cite_exists():
    """Review item 16: the facade's docstrings and messages cite kvcore names; every one
    (``kvcore.x.y``, ``:func:`~kvcore.x``` and the facade's own ``:func:`name``` references)
    resolves, so a rename elsewhere cannot leave stale text here."""
    import importlib
    import inspect
    import re

    src = inspect.getsource(L)
    dotted = set(re.findall(r"\bkvcore(?:\.[A-Za-z_][A-Za-z0-9_]*)+", src))
    roles = set(re.findall(r":(?:func|class|data|exc|mod):`~?([A-Za-z_][A-Za-z0-9_.]*)`", src))

    def resolves(name: str) -> bool:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for a in parts[i:]:
                    obj = getattr(obj, a)
                return True
            except AttributeError:
                return False
        obj = L
        try:
            for a in parts:
                obj = getattr(obj, a)
            return True
        except AttributeError:
            return False

    missing = sorted(n for n in dotted | roles if not resolves(n.rstrip(".")))
    assert missing == [] and len(dotted) > 5 and len(roles) > 5


def test_multi_plane_detections_are_refused_by_the_accessors_with_the_way_forward():
    """vllm-ascend pairs of unequal widths detect as multi-plane layouts; LMCache's one-width
    accessors refuse them naming the planes and kvcore's layout API (which describes them)."""
    if "vllm" not in {p.name for p in kvcore.plugins() if p.error is None}:
        pytest.skip("the vLLM plugin is not installed")
    kv = [(torch.randn(4, 16, 2, 128), torch.randn(4, 16, 2, 64)) for _ in range(2)]
    for spec, roles in (("attention", ("K", "V")), ("mla", ("KV", "KPE"))):
        fmt, nkv = L.normalize_kv_and_discover_format(kv, "vllm", {"kv_cache_spec": spec})
        assert kvcore.parse_format(str(fmt)).roles == roles
        s = L.get_spec(nkv, fmt)
        for accessor in (s.num_layers, s.hidden_dim, s.num_blocks, s.concrete_shape_str, s.data_ptrs):
            with pytest.raises(GeometryError, match=rf"multi-plane layout \(planes {roles[0]}, {roles[1]}.*kvcore.build_layout"):
                accessor()
        lay = kvcore.build_layout(str(fmt), nkv)
        assert lay.num_layers == 2 and lay.staging_shapes(3) == {roles[0]: (2, 3, 256), roles[1]: (2, 3, 128)}
        staged = kvcore.gather(lay, torch.tensor([5]))
        assert torch.equal(staged[roles[1]][1, 0], kv[1][1][0, 5].reshape(-1))


# -- LMCache 0.5.6's contract: the platform its adapters state, kv_layout as memory order (issue 24) ---------


def test_singleton_head_pages_are_read_as_lmcache_reads_them_one_row_per_token():
    pytest.importorskip("kvcore_vllm")
    nb, bs = 9, 16
    for w, dt, fmt in ((576, torch.bfloat16, "NL_X_NB_BS_HS"), (656, torch.uint8, "NL_X_NB_BS_HS"), (132, torch.uint8, "NL_X_NB_BSV_BSS")):
        kv = [torch.zeros(nb, 1, bs, w, dtype=dt) for _ in range(3)]  # vLLM 0.33 MLA / record pages, LMCache's vLLM adapter
        for hints in ({"kv_layout": "HND"}, {"kv_layout": "HND", "torch_device_type": "cuda"}):
            f, norm = L.normalize_kv_and_discover_format(kv, L.EngineType.VLLM, hints)
            assert f == fmt and [t.data_ptr() for t in norm] == [t.data_ptr() for t in kv]
            assert (L.get_kv_size(norm, f), L.get_num_blocks(norm, f), L.get_block_size(norm, f)) == (1, nb, bs)
    kv = [torch.arange(nb * bs * 576, dtype=torch.float32).view(nb, 1, bs, 576).bfloat16() for _ in range(2)]
    f, norm = L.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "HND"})
    assert (L.get_head_size(norm, f), L.get_num_heads(norm, f)) == (576, 1)  # LMCache's geometry: one head, the packed row
    assert torch.equal(norm[1][3, 7], kv[1][3, 0, 7])
    # V4's 584 B blocked page reads differently as a packed row: kvcore's ambiguity stays (LMCache reads rows: wrong there)
    with pytest.raises(AmbiguousLayoutError) as e:
        L.normalize_kv_and_discover_format([torch.zeros(nb, 1, bs, 584, dtype=torch.uint8)], "vllm", {"kv_layout": "HND"})
    assert "cache_dtype" in e.value.hints


def test_the_platform_lmcache_states_decides_cpu_tensors(monkeypatch):
    pytest.importorskip("kvcore_vllm")
    # vLLM 0.26 HND packed K|V [NB, NH, BS, 2*HS] (float16: no tiled CPU path, AMX or NEON BFMMLA, can have packed it)
    kv = [torch.zeros(6, 4, 16, 128, dtype=torch.float16) for _ in range(3)]
    f, _ = L.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "HND"})  # unstated: LMCache's GPU layouts
    assert f == L.EngineKVFormat.NL_X_NB_NH_BS_CS and L.get_num_heads(kv, f) == 4
    f, norm = L.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "HND", "torch_device_type": "cpu"})
    # vLLM CPU_ATTN: per block and head K column-major, then V (the kernel's packing; LMCache: CS, wrong); block 16: no AMX
    assert f == "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
    monkeypatch.setattr(L, "torch_device_type", "cpu")  # the module global LMCache's detector reads
    assert L.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "HND"})[0] == "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
    monkeypatch.setattr(L, "torch_device_type", "cuda")
    assert L.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "HND"})[0] == "NL_X_NB_NH_BS_CS"


def test_kv_layout_names_the_memory_order_as_lmcache_reads_it():
    pytest.importorskip("kvcore_vllm")
    nb, bs, nh, hs = 5, 16, 2, 64
    contiguous = [torch.zeros(2, nb, bs, nh, hs, dtype=torch.bfloat16) for _ in range(2)]
    f, norm = L.normalize_kv_and_discover_format(contiguous, "vllm", {"kv_layout": "HND"})
    # LMCache: the shape is the memory order, HND: [2, NB, NH=16, BS=2, HS]
    assert f == "NL_X_TWO_NB_NH_BS_HS" and (L.get_num_heads(norm, f), L.get_block_size(norm, f)) == (bs, nh)
    permuted = [torch.zeros(2, nb, nh, bs, hs, dtype=torch.bfloat16).transpose(2, 3) for _ in range(2)]  # vLLM <= 0.23 HND
    f, norm = L.normalize_kv_and_discover_format(permuted, "vllm", {"kv_layout": "HND"})
    assert f == "NL_X_TWO_NB_NH_BS_HS" and norm[0].shape == (2, nb, nh, bs, hs) and norm[0].is_contiguous()
    assert (L.get_num_heads(norm, f), L.get_block_size(norm, f)) == (nh, bs) and norm[1].data_ptr() == permuted[1].data_ptr()


def test_vllm_ascend_plane_tuples_get_lmcaches_name_and_rbln_and_unified_views_are_detected():
    pytest.importorskip("kvcore_vllm")
    pytest.importorskip("kvcore_sglang")
    nope, rope, dsa = (torch.zeros(7, 3, 1, w) for w in (32, 4, 8))
    for entry in ((nope, rope), (nope, rope, dsa), (nope,)):
        f, norm = L.normalize_kv_and_discover_format([entry] * 2, "vllm", {"kv_layout": "NHD"})
        assert f == L.EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS and [p.data_ptr() for p in norm[0]] == [p.data_ptr() for p in entry]
    k, v = torch.zeros(7, 3, 2, 4), torch.zeros(7, 3, 2, 4)
    assert L.normalize_kv_and_discover_format([(k, v)], "vllm")[0] == L.EngineKVFormat.NL_X_TWO_X_NB_BS_NH_HS
    rbln = [torch.zeros(2, 7, 2, 1, 3, 4) for _ in range(3)]
    f, norm = L.normalize_kv_and_discover_format(rbln, "vllm", {"kv_layout": "NHD"})
    assert f == L.EngineKVFormat.NL_X_TWO_NB_NH_ONE_BS_HS and norm[0].data_ptr() == rbln[0].data_ptr()
    unified = [torch.zeros(7, 3, 2, 4) for _ in range(6)]
    f, norm = L.normalize_kv_and_discover_format(unified, "sglang", {"kv_list_layout": "unified"})
    assert f == L.EngineKVFormat.NL_X_NB_BS_NH_HS and L.get_num_layers(norm, f) == 6 and L.get_kv_size(norm, f) == 1
