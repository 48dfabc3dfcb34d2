"""Geometry of the generic spec, for each structural family, against hand-computed
numbers (LMCache's per-format accessor table, ``lmcache_kv_format.md`` §2.3)."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import GeometryError, PageBufferShapeDesc, build_layout
from kvcore.grammar import parse

pytestmark = pytest.mark.usefixtures("core_only")

NL, NB, BS, NH, HS = 3, 5, 4, 2, 8


def _geom(lay):
    return (
        lay.num_layers,
        lay.num_blocks,
        lay.block_size,
        lay.num_heads,
        lay.head_size,
        lay.hidden_dim,
        lay.kv_size,
        lay.page_buffer_size,
        lay.tokens_per_layer,
        lay.elements_per_layer,
    )


def test_layer_list_two_major_nhd():
    kv = [torch.zeros(2, NB, BS, NH, HS, dtype=torch.bfloat16) for _ in range(NL)]
    lay = build_layout("NL_X_TWO_NB_BS_NH_HS", kv)
    # elements per layer = K.numel() * 2 = 5*4*2*8 * 2
    assert _geom(lay) == (3, 5, 4, 2, 8, 16, 2, 20, 20, 640)
    assert lay.dtype == torch.bfloat16 and lay.storage_dtype == torch.bfloat16 and lay.element_size == 2
    assert lay.device == torch.device("cpu")
    assert lay.describe() == "3 x [2, 5, 4, 2, 8]"
    assert lay.sizes() == {"NL": 3, "NB": 5, "BS": 4, "NH": 2, "HS": 8}
    assert lay.shape_desc() == PageBufferShapeDesc(kv_size=2, nl=3, nb=5, bs=4, nh=2, hs=8, element_size=2, block_stride_elems=0)
    assert lay.shape_desc([1]).nl == 1
    assert lay.data_ptrs() == [t.data_ptr() for t in kv]
    assert lay.data_ptrs([2, 0]) == [kv[2].data_ptr(), kv[0].data_ptr()]
    assert lay.layer_ids == (0, 1, 2) and lay.layer_names is None
    assert not lay.is_mla
    tb = lay.stride_table()
    p = tb.planes[0]
    # bytes: token row NH*HS*2 = 32, block BS*32 = 128, head HS*2 = 16; V plane after NB*BS*NH*HS*2 = 640
    assert (p.block, p.token, p.head, p.chunk_bytes, p.n_chunks) == (128, 32, 16, 16, 1)
    assert p.row_contiguous
    assert tb.planes[1].strides == p.strides and (tb.planes[0].role, tb.planes[1].role) == ("K", "V")
    assert [[off for _, off in layer] for layer in tb.bases] == [[0, 640]] * 3
    assert all(t is kv[i] for i, layer in enumerate(tb.bases) for t, _ in layer)
    assert (tb.num_layers, tb.kv_size, tb.block_size, tb.num_slots, tb.num_heads, tb.head_bytes, tb.row_bytes) == (3, 2, 4, 20, 2, 16, 32)
    assert tb.ptrs().tolist() == [[t.data_ptr(), t.data_ptr() + 640] for t in kv]
    sub = lay.stride_table([2, 1])
    assert sub.num_layers == 2 and sub.bases[0][0][0] is kv[2]
    s = lay.summary()
    assert (s["format"], s["concrete"], s["num_blocks"], s["block_size"], s["dtype"], s["is_hnd"]) == (
        "NL_X_TWO_NB_BS_NH_HS",
        "3 x [2, 5, 4, 2, 8]",
        5,
        4,
        "bfloat16",
        False,
    )


def test_layer_list_two_major_hnd():
    kv = [torch.zeros(2, NB, NH, BS, HS) for _ in range(NL)]
    lay = build_layout("NL_X_TWO_NB_NH_BS_HS", kv)
    assert _geom(lay) == (3, 5, 4, 2, 8, 16, 2, 20, 20, 640)
    p = lay.stride_table().planes[0]
    # fp32: token HS*4 = 32, head BS*HS*4 = 128, block NH*BS*HS*4 = 256
    assert (p.block, p.token, p.head) == (256, 32, 128)
    assert not p.row_contiguous
    assert lay.summary()["is_hnd"] is True
    assert lay.shape_desc().block_stride_elems == 0


def test_nb_two_flashinfer():
    kv = [torch.zeros(NB, 2, BS, NH, HS, dtype=torch.float16) for _ in range(NL)]
    lay = build_layout("NL_X_NB_TWO_BS_NH_HS", kv)
    assert _geom(lay) == (3, 5, 4, 2, 8, 16, 2, 20, 20, 640)
    tb = lay.stride_table()
    # block = 2*BS*NH*HS*2 bytes = 256; V starts one K block-half later: BS*NH*HS*2 = 128
    assert tb.planes[0].block == 256 and tb.planes[0].token == 32
    assert [off for _, off in tb.bases[1]] == [0, 128]
    # tight: no padding reported
    assert lay.shape_desc().block_stride_elems == 0


def test_mla_layer_list():
    kv = [torch.zeros(NB, BS, 576, dtype=torch.bfloat16) for _ in range(NL)]
    lay = build_layout("NL_X_NB_BS_HS", kv)
    assert _geom(lay) == (3, 5, 4, 1, 576, 576, 1, 20, 20, 11520)
    assert lay.is_mla
    assert lay.shape_desc() == PageBufferShapeDesc(kv_size=1, nl=3, nb=5, bs=4, nh=1, hs=576, element_size=2, block_stride_elems=0)
    tb = lay.stride_table()
    assert tb.kv_size == 1 and len(tb.planes) == 1 and tb.planes[0].block == 4 * 576 * 2
    assert lay.staging_shape(7) == (1, 3, 7, 576)
    assert lay.staging_shape(7, 1) == (1, 7, 576)


def test_nbbs_with_singleton_head():
    kv = [torch.zeros(NB * BS, 1, HS) for _ in range(NL)]
    lay = build_layout("NL_X_NBBS_ONE_HS", kv)
    assert (lay.num_layers, lay.num_heads, lay.head_size, lay.hidden_dim, lay.kv_size) == (3, 1, 8, 8, 1)
    assert (lay.page_buffer_size, lay.tokens_per_layer, lay.elements_per_layer) == (20, 20, 160)
    for acc in ("num_blocks", "block_size"):
        with pytest.raises(GeometryError, match="NBBS"):
            getattr(lay, acc)
    assert lay.describe() == "3 x [20, 1, 8]"
    assert lay.shape_desc() == PageBufferShapeDesc(kv_size=1, nl=3, nb=20, bs=1, nh=1, hs=8, element_size=4, block_stride_elems=0)
    s = lay.summary()
    assert s["num_blocks"] is None and s["block_size"] is None and s["page_buffer_size"] == 20
    tb = lay.stride_table()
    assert tb.block_size == 1 and tb.num_slots == 20 and tb.planes[0].block == 32
    with pytest.raises(GeometryError, match="size 1"):
        build_layout("NL_X_NBBS_ONE_HS", [torch.zeros(20, 2, HS)])


def test_kv_list_nbbs():
    k = [torch.zeros(NB * BS, NH, HS) for _ in range(NL)]
    v = [torch.zeros(NB * BS, NH, HS) for _ in range(NL)]
    lay = build_layout("TWO_X_NL_X_NBBS_NH_HS", [k, v])
    assert (lay.num_layers, lay.num_heads, lay.head_size, lay.hidden_dim, lay.kv_size, lay.page_buffer_size) == (3, 2, 8, 16, 2, 20)
    # PBS; kv[0][0].numel() * 2
    assert lay.elements_per_layer == 20 * 2 * 8 * 2
    with pytest.raises(GeometryError):
        _ = lay.num_blocks
    assert lay.describe() == "2 x 3 x [20, 2, 8]"
    assert lay.data_ptrs() == [t.data_ptr() for t in k] + [t.data_ptr() for t in v]
    tb = lay.stride_table()
    assert tb.bases[1][0][0] is k[1] and tb.bases[1][1][0] is v[1]


def test_kv_list_paged():
    k = [torch.zeros(NB, BS, NH, HS) for _ in range(NL)]
    v = [torch.zeros(NB, BS, NH, HS) for _ in range(NL)]
    lay = build_layout("TWO_X_NL_X_NB_BS_NH_HS", [k, v])
    assert _geom(lay) == (3, 5, 4, 2, 8, 16, 2, 20, 20, 640)
    assert lay.data_ptrs() == [t.data_ptr() for t in k + v]
    assert lay.data_ptrs([2, 0]) == [k[2].data_ptr(), k[0].data_ptr(), v[2].data_ptr(), v[0].data_ptr()]
    assert lay.describe() == "2 x 3 x [5, 4, 2, 8]"
    with pytest.raises(GeometryError, match="2 entries"):
        build_layout("TWO_X_NL_X_NB_BS_NH_HS", [k, v, k])


def test_per_layer_tuples():
    kv = [(torch.zeros(NB, BS, NH, HS), torch.zeros(NB, BS, NH, HS)) for _ in range(NL)]
    lay = build_layout("NL_X_TWO_X_NB_BS_NH_HS", kv)
    assert _geom(lay) == (3, 5, 4, 2, 8, 16, 2, 20, 20, 640)
    # interleaved: K0, V0, K1, V1, K2, V2
    assert lay.data_ptrs() == [t.data_ptr() for pair in kv for t in pair]
    assert lay.data_ptrs([1]) == [kv[1][0].data_ptr(), kv[1][1].data_ptr()]
    assert lay.describe() == "3 x 2 x [5, 4, 2, 8]"
    tb = lay.stride_table()
    assert tb.bases[2][1][0] is kv[2][1] and tb.bases[2][1][1] == 0


def test_cross_layer_one_tensor():
    t = torch.zeros(NB, NL, 2, BS, NH, HS, dtype=torch.bfloat16)
    lay = build_layout("NB_NL_TWO_BS_NH_HS", t)
    assert _geom(lay) == (3, 5, 4, 2, 8, 16, 2, 20, 20, 640)
    assert lay.data_ptrs() == [t.data_ptr()]
    assert lay.data_ptrs([1]) == [t.data_ptr()]
    assert lay.describe() == "[5, 3, 2, 4, 2, 8]"
    assert lay.shape_desc().block_stride_elems == 0
    tb = lay.stride_table()
    # block = NL*2*BS*NH*HS*2 bytes = 768; layer l at l*2*BS*NH*HS*2 = l*256; V +128
    assert tb.planes[0].block == 768 and tb.planes[0].token == 32
    assert [[off for _, off in layer] for layer in tb.bases] == [[0, 128], [256, 384], [512, 640]]
    hnd = build_layout("NB_NL_TWO_NH_BS_HS", torch.zeros(NB, NL, 2, NH, BS, HS))
    assert (hnd.num_heads, hnd.block_size) == (2, 4)
    assert (hnd.stride_table().planes[0].head, hnd.stride_table().planes[0].token) == (4 * 8 * 4, 8 * 4)


def test_cs_packed_int8_view_carrying_bf16():
    # vLLM 0.33 unified cache: an int8 buffer viewed [NB, BS, NH, CS bytes] carrying bf16 K|V
    kv = [torch.zeros(NB, BS, NH, 2 * HS * 2, dtype=torch.int8) for _ in range(NL)]
    lay = build_layout("NL_X_NB_BS_NH_CS", kv, dtype=torch.bfloat16)
    assert _geom(lay) == (3, 5, 4, 2, 8, 16, 2, 20, 20, 640)
    assert lay.dtype == torch.bfloat16 and lay.storage_dtype == torch.int8 and lay.element_size == 2
    assert lay.describe() == "3 x [5, 4, 2, 32]"  # the tensors' own sizes (CS in int8 units)
    assert lay.shape_desc() == PageBufferShapeDesc(kv_size=2, nl=3, nb=5, bs=4, nh=2, hs=8, element_size=2, block_stride_elems=0)
    tb = lay.stride_table()
    # head row = HS*2 bytes = 16; one token's heads: NH * 32 bytes = 64; V after K's 16 bytes
    assert (tb.head_bytes, tb.planes[0].head, tb.planes[0].token, tb.planes[0].block) == (16, 32, 64, 256)
    assert [off for _, off in tb.bases[0]] == [0, 16]
    # the same bytes as plain bf16
    same = build_layout("NL_X_NB_BS_NH_CS", [t.view(torch.bfloat16) for t in kv])
    assert same.stride_table().signature() == tb.signature()
    # HND twin
    hnd = build_layout("NL_X_NB_NH_BS_CS", [torch.zeros(NB, NH, BS, 2 * HS) for _ in range(NL)])
    assert (hnd.num_heads, hnd.block_size, hnd.head_size) == (2, 4, 8)


def test_cs_head_size_param_and_its_errors():
    kv = [torch.zeros(NB, BS, NH, 16) for _ in range(2)]
    assert build_layout("NL_X_NB_BS_NH_CS", kv, params={"head_size": 8}).head_size == 8
    with pytest.raises(GeometryError, match="K 6, V 10"):
        build_layout("NL_X_NB_BS_NH_CS", kv, params={"head_size": 6})
    with pytest.raises(GeometryError, match="odd"):
        build_layout("NL_X_NB_BS_NH_CS", [torch.zeros(NB, BS, NH, 15)])
    with pytest.raises(GeometryError, match="whole number"):
        build_layout("NL_X_NB_BS_NH_CS", [torch.zeros(NB, BS, NH, 31, dtype=torch.int8)], dtype=torch.bfloat16)
    # a byte view needs a contiguous element axis
    t = torch.zeros(NB, BS, 32, NH, dtype=torch.int8).transpose(2, 3)
    with pytest.raises(GeometryError, match="contiguous element axis"):
        build_layout("NL_X_NB_BS_NH_CS", [t], dtype=torch.bfloat16)


def test_deprecated_two_hs_and_rbln():
    lay = build_layout("NL_X_NB_NH_BS_TWO_HS", [torch.zeros(NB, NH, BS, 2, HS) for _ in range(2)])
    assert (lay.num_heads, lay.block_size, lay.head_size, lay.kv_size, lay.hidden_dim) == (2, 4, 8, 2, 16)
    tb = lay.stride_table()
    assert [off for _, off in tb.bases[0]] == [0, 32] and tb.planes[0].token == 64
    rbln = build_layout("NL_X_TWO_NB_NH_ONE_BS_HS", [torch.zeros(2, NB, NH, 1, BS, HS) for _ in range(2)])
    six = build_layout("NL_X_TWO_NB_NH_BS_HS", [t.squeeze(3) for t in rbln.kv_caches])
    # §1.2 #15: byte/stride-identical to #6
    assert rbln.stride_table().signature() == six.stride_table().signature()
    with pytest.raises(GeometryError, match=r"axis 3 \(ONE\) must have size 1"):
        build_layout("NL_X_TWO_NB_NH_ONE_BS_HS", [torch.zeros(2, NB, NH, 2, BS, HS)])


def test_independent_components_kv1_with_heads():
    lay = build_layout("NL_X_NB_BS_NH_HS", [torch.zeros(NB, BS, NH, HS) for _ in range(4)])
    assert _geom(lay) == (4, 5, 4, 2, 8, 16, 1, 20, 20, 320)
    assert not lay.is_mla and lay.shape_desc().nh == NH


@pytest.mark.parametrize(
    "name, kv, match",
    [
        ("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(3, NB, BS, NH, HS)], r"axis 0 \(TWO\) must have size 2"),
        ("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(NB, BS, NH, HS)], "expects 5-D"),
        ("NL_X_TWO_NB_BS_NH_HS", torch.zeros(2, NB, BS, NH, HS), "non-empty list"),
        ("NL_X_TWO_NB_BS_NH_HS", [], "non-empty list"),
        ("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(2, NB, BS, NH, HS), "x"], "torch.Tensor"),
        ("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(2, NB, BS, NH, HS), torch.zeros(2, NB + 1, BS, NH, HS)], "uniform"),
        ("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(2, NB, BS, NH, HS), torch.zeros(2, NB, BS, NH, HS, dtype=torch.float16)], "dtype"),
        ("NL_X_NB_BSV_BSS", [torch.zeros(NB, BS, 132, dtype=torch.uint8)], "scale_bytes"),  # the engine must say the scale width
        ("NL_X_NP_X_NB_BS_ONE_HS", [(torch.zeros(NB, BS, 1, HS),)], "spec of its own"),
        ("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(2, NB, BS, NH, HS * 2)[..., ::2]], None),  # strided HS: allowed
    ],
)
def test_tensors_that_do_not_fit_raise_geometry_error(name, kv, match):
    if match is None:
        lay = build_layout(name, kv)
        assert lay.stride_table().planes[0].n_chunks == HS  # one element per chunk, stride 8 bytes
        return
    with pytest.raises(GeometryError, match=match):
        build_layout(name, kv)


def test_malformed_name_in_build_layout():
    with pytest.raises(kvcore.FormatError, match="'FOO'"):
        build_layout("NL_X_FOO_HS", [torch.zeros(2, 2)])


def test_layer_index_errors():
    lay = build_layout("NL_X_NB_BS_HS", [torch.zeros(NB, BS, HS) for _ in range(NL)])
    for bad in ([3], [-1], [0, 0], ["a"], [True]):
        for call in (lay.data_ptrs, lay.shape_desc, lay.stride_table):
            with pytest.raises(GeometryError):
                call(bad)


def test_dtype_and_params_arguments_are_checked():
    kv = [torch.zeros(NB, BS, HS)]
    with pytest.raises(GeometryError, match="torch.dtype"):
        build_layout("NL_X_NB_BS_HS", kv, dtype="bfloat16")
    with pytest.raises(GeometryError, match="params must be a dict"):
        build_layout("NL_X_NB_BS_HS", kv, params=[("head_size", 4)])


# -- dim-0 padding: every format whose dim 0 is the block axis, found from the grammar ----

_ALL_NAMES = [
    "NB_NL_TWO_BS_NH_HS",
    "NL_X_TWO_NB_BS_NH_HS",
    "NL_X_NB_TWO_BS_NH_HS",
    "NL_X_NB_BS_HS",
    "TWO_X_NL_X_NBBS_NH_HS",
    "NL_X_NBBS_ONE_HS",
    "NL_X_TWO_NB_NH_BS_HS",
    "NL_X_NB_TWO_NH_BS_HS",
    "NB_NL_TWO_NH_BS_HS",
    "TWO_X_NL_X_NB_BS_NH_HS",
    "NL_X_NB_NH_BS_TWO_HS",
    "NL_X_NB_BS_NH_TWO_HS",
    "NL_X_NB_NH_BS_CS",
    "NL_X_NB_BS_NH_CS",
    "NL_X_TWO_NB_NH_ONE_BS_HS",
    "NL_X_TWO_X_NB_BS_NH_HS",
    "NB_NL_NH_BS_CS",
    "NB_NL_BS_NH_CS",
    "NL_X_NB_BS_NH_HS",
]
_DIM0_BLOCK = [n for n in _ALL_NAMES if parse(n).axes[0] in ("NB", "NBBS")]
_DIM0_OTHER = [n for n in _ALL_NAMES if parse(n).axes[0] not in ("NB", "NBBS")]


def test_dim0_block_formats_are_found_by_the_grammar():
    assert len(_DIM0_BLOCK) == 16 and "NL_X_NB_TWO_BS_NH_HS" in _DIM0_BLOCK and "NB_NL_TWO_BS_NH_HS" in _DIM0_BLOCK
    assert _DIM0_OTHER == ["NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS", "NL_X_TWO_NB_NH_ONE_BS_HS"]


@pytest.mark.parametrize("name", _DIM0_BLOCK)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dim0_padding_is_honoured(name, dtype, alloc, oracle):
    pad = 5  # elements of padding after each block row
    iv = torch.int16 if dtype == torch.bfloat16 else torch.int32
    tight = alloc(name, dtype=dtype)
    padded = alloc(name, dtype=dtype, pad_elems=pad)
    lt, lp = build_layout(name, tight), build_layout(name, padded)
    row = lp.spec.leaves[0][1].stride(0)
    assert row == lt.spec.leaves[0][1].stride(0) + pad
    assert lt.shape_desc().block_stride_elems == 0
    assert lp.shape_desc().block_stride_elems == row
    assert lp.stride_table().planes[0].block == row * torch.empty(0, dtype=dtype).element_size()
    assert lp.shape_desc().model_dump(exclude={"block_stride_elems"}) == lt.shape_desc().model_dump(exclude={"block_stride_elems"})
    # transfers read the padded rows right: fill with random bits, gather, compare
    gen = torch.Generator().manual_seed(0)
    for _, t in lp.spec.leaves:
        t.view(iv).copy_(torch.randint(-(2**15), 2**15, t.shape, generator=gen).to(iv))
    slots = torch.tensor([0, 11, 5, -1, 7])
    got = kvcore.gather(lp, slots)
    for k in range(lp.kv_size):
        for layer in range(lp.num_layers):
            for i, s in enumerate(slots.tolist()):
                if s < 0:
                    assert not got[k, layer, i].view(iv).any()
                    continue
                want = oracle(name, padded, layer, k, s).reshape(-1)
                assert torch.equal(got[k, layer, i].view(iv), want.view(iv))


@pytest.mark.parametrize("name", _DIM0_OTHER)
def test_padding_of_a_non_block_dim0_is_described_by_strides_but_not_by_shape_desc(name, alloc):
    lay = build_layout(name, alloc(name, pad_elems=3))  # the K/V axis is padded: V starts later
    tb = lay.stride_table()
    assert tb.bases[0][1][1] == (lay.spec.leaves[0][1].stride(0)) * 4
    with pytest.raises(GeometryError, match="dim-0 block axis"):
        lay.shape_desc()


def test_aliasing_strides_are_refused():
    base = torch.zeros(NB * BS * NH * HS)
    # block stride half a block: blocks overlap
    t = base.as_strided((NB, BS, NH, HS), (BS * NH * HS // 2, NH * HS, HS, 1))
    with pytest.raises(GeometryError, match="alias"):
        build_layout("NL_X_NB_BS_NH_HS", [t])
    # a head stride smaller than a head row
    t = base.as_strided((NB, BS, NH, HS), (BS * NH * HS // 2, NH * HS // 2, HS // 2, 1))
    with pytest.raises(GeometryError, match="alias"):
        build_layout("NL_X_NB_BS_NH_HS", [t])
    # a padded TWO axis is fine, an overlapping one is not
    buf = torch.zeros(2 * NB * BS * NH * HS)
    t = buf.as_strided((2, NB, BS, NH, HS), (NB * BS * NH * HS - 1, BS * NH * HS, NH * HS, HS, 1))
    with pytest.raises(GeometryError, match="K/V"):
        build_layout("NL_X_TWO_NB_BS_NH_HS", [t])
    # one tensor registered for two layers
    one = torch.zeros(NB, BS, HS)
    with pytest.raises(GeometryError, match="alias"):
        build_layout("NL_X_NB_BS_HS", [one, torch.zeros(NB, BS, HS), one])


def test_byte_view_geometry_stays_inside_storage():
    # 20 int8 = 10 bf16 elements: K 5, V 5; the last V byte is the tensor's last byte
    t = torch.zeros(NB, BS, NH, 20, dtype=torch.int8)
    lay = build_layout("NL_X_NB_BS_NH_CS", [t], dtype=torch.bfloat16)
    assert lay.head_size == 5
    tb = lay.stride_table()
    p = tb.planes[1]
    last = tb.bases[0][1][1] + (NB - 1) * p.block + (BS - 1) * p.token + (NH - 1) * p.head + p.chunk_bytes
    assert last == t.untyped_storage().nbytes()


# torch keeps every tensor's storage large enough for its own view, so geometry past the
# storage comes from a spec that computes it wrong: the core checks every spec's table.
def test_a_plugin_spec_reaching_past_storage_is_refused():
    class ShortSpec(kvcore.Spec):
        def _build(self):
            super()._build()
            from dataclasses import replace

            self.table = replace(self.table, num_slots=self.table.num_slots + self.table.block_size)

    class P:  # a spec answers for a name its plugin declares (never overriding a name it does not)
        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_NB_BS_HS"))

        @kvcore.hookimpl
        def kvcore_spec(self, format):
            return ShortSpec if format.name == "NL_X_NB_BS_HS" else None

    kvcore.register_plugin(P(), name="shortspec")
    with pytest.raises(GeometryError, match="reaches byte"):
        build_layout("NL_X_NB_BS_HS", [torch.zeros(NB, BS, HS)])
    kvcore.unregister_plugin("shortspec")
    assert build_layout("NL_X_NB_BS_HS", [torch.zeros(NB, BS, HS)]).num_blocks == NB


@pytest.mark.parametrize("axis", range(5))
def test_zero_size_axes_are_refused(axis):
    shape = [2, NB, BS, NH, HS]
    tok = ["TWO", "NB", "BS", "NH", "HS"][axis]
    shape[axis] = 0
    with pytest.raises(GeometryError, match=rf"axis {axis} \({tok}\) (has size 0|must have size 2)"):
        build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(shape)])


def test_a_spec_hook_must_return_a_spec_class_and_its_crashes_are_geometry_errors():
    class Returns42:
        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_NB_BS_HS"))

        @kvcore.hookimpl
        def kvcore_spec(self, format):
            return 42

    kvcore.register_plugin(Returns42(), name="r42")
    with pytest.raises(kvcore.PluginError, match="returned 42 for format NL_X_NB_BS_HS"):
        build_layout("NL_X_NB_BS_HS", [torch.zeros(NB, BS, HS)])
    kvcore.unregister_plugin("r42")

    class Crashing(kvcore.Spec):
        def _build(self):
            raise IndexError("tuple index out of range")

    class P:
        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_NB_BS_HS"))

        @kvcore.hookimpl
        def kvcore_spec(self, format):
            return Crashing

    kvcore.register_plugin(P(), name="crashing")
    with pytest.raises(GeometryError, match="Crashing could not read these tensors: IndexError") as ei:
        build_layout("NL_X_NB_BS_HS", [torch.zeros(NB, BS, HS)])
    assert isinstance(ei.value.__cause__, IndexError)


def test_meta_device_caches_build_and_aliasing_is_still_refused():
    # `kvcore detect` describes caches from a log on the meta device: no memory, all storage
    # addresses 0; distinct meta tensors are distinct planes, one tensor twice is not
    kv = [torch.empty(2, NB, BS, NH, HS, device="meta") for _ in range(NL)]
    lay = build_layout("NL_X_TWO_NB_BS_NH_HS", kv)
    assert (lay.num_layers, lay.num_blocks, lay.device.type) == (NL, NB, "meta")
    assert lay.shape_desc().block_stride_elems == 0
    with pytest.raises(GeometryError, match="alias"):
        build_layout("NL_X_TWO_NB_BS_NH_HS", [kv[0], kv[0]])


def test_blocked_scale_records_are_read_from_the_grammar_given_the_scale_width():
    # [NB, BS, W] bytes; per block: BS records' value bytes, then their scale bytes
    nb, bs, w, s = 3, 4, 12, 4
    pool = torch.arange(nb * bs * w, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(nb, bs, w)
    lay = kvcore.build_layout("NL_X_NB_BSV_BSS", [pool], params={"scale_bytes": s})
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size, lay.kv_size) == (nb, bs, 1, w, 1)
    assert lay.describe() == f"1 x [{nb}, {bs}x{w - s}, {bs}x{s}]"
    slots = torch.tensor([5, 0, 11])
    out = kvcore.gather(lay, slots)
    flat = pool.reshape(nb, bs * w)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, bs)
        want = torch.cat([flat[b, t * (w - s) : (t + 1) * (w - s)], flat[b, bs * (w - s) + t * s : bs * (w - s) + (t + 1) * s]])
        assert torch.equal(out[0, 0, i], want)
