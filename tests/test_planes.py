"""Multi-plane records: a token's record is several planes, each its own tensors, strides,
width and dtype (``ROLE=TEMPLATE(+ROLE=TEMPLATE)*``), and the HSC/HSE (chunked heads) and
BSC/BSE (token groups) tokens in any template.

Every transfer is checked semantically against views of the engine-shaped tensors built
here by plain indexing (never through kvcore's stride table): gather returns, for each
(plane, layer, token, head, element), the value the engine's tensor holds there; scatter
changes exactly the bytes those views address, nothing else.

Engine facts the cases model (sources):
* ROCm paged attention's split K ``(NB, NH, HS/x, BS, x)`` beside V ``(NB, NH, HS, BS)``:
  vLLM 0.11.0 ``vllm/attention/ops/paged_attn.py::PagedAttention.get_kv_cache_shape`` /
  ``split_kv_cache`` (``x = 16 // element_size``), ``engine_layouts.md`` §1.9.
* int8 / int4 K/V with per-token-head scales and zeros in sibling tensors: LMDeploy
  0.6-0.11 ``lmdeploy/pytorch/engine/cache_engine.py::CacheEngine`` (quant_policy 4/8).
* SGLang ROCm ``vectorized_5d`` V ``(NB, NH, BS/X, HS, X)``: token groups of X tokens.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import FormatError, GeometryError, TransferError, build_layout
from kvcore.grammar import parse

pytestmark = pytest.mark.usefixtures("core_only")

NL, NB, BS, NH, HS = 2, 3, 4, 2, 16


# -- grammar ---------------------------------------------------------------------------

ROCM = "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS"
QUANT = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH+KZ=NL_X_NB_BS_NH+VS=NL_X_NB_BS_NH+VZ=NL_X_NB_BS_NH"


def test_multi_plane_names_parse_and_render_per_plane():
    s = parse(ROCM)
    assert s.multi_plane and s.roles == ("K", "V")
    assert s.plane("K").template == "NL_X_NB_NH_HSC_BS_HSE"
    assert s.plane("K").syntax.axes == ("NB", "NH", "HSC", "BS", "HSE")
    assert s.plane("V").syntax.list_levels == ("NL",)
    assert (s.kv_size, s.is_mla, s.container, s.containers, s.is_hnd) == (2, False, "planes", {"K": "layer_list", "V": "layer_list"}, True)
    assert not s.fused_kv and not s.two_major and not s.fused_nbbs and s.chunked_heads and not s.token_groups
    assert s.symbolic() == "K: NL x [NB, NH, HSC, BS, HSE] + V: NL x [NB, NH, HS, BS]"
    sizes = {"NL": 32, "NB": 100, "BS": 16, "NH": 8, "K.HSC": 16, "K.HSE": 8, "HS": 128}
    assert s.concrete(sizes) == "K: 32 x [100, 8, 16, 16, 8] + V: 32 x [100, 8, 128, 16]"
    # a nested per-plane dict overrides the shared keys too
    assert parse("K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS").concrete({"NL": 2, "NB": 3, "BS": 4, "NH": 1, "HS": 8, "V": {"HS": 4}}) == (
        "K: 2 x [3, 4, 1, 8] + V: 2 x [3, 4, 1, 4]"
    )
    assert kvcore.KVFormat(name=ROCM).container == "planes"


def test_multi_plane_facts():
    q = parse(QUANT)
    assert q.kv_size == 2 and not q.is_mla and not q.is_hnd and q.roles[2:] == ("KS", "KZ", "VS", "VZ")
    assert q.plane("KS").syntax.element_token is None  # one element per head
    # key only, with a scale plane: kv_size 1, heads are real, not MLA
    k = parse("K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH")
    assert (k.kv_size, k.is_mla) == (1, False)
    # an MLA latent beside its scale: no heads anywhere
    m = parse("KV=NL_X_NB_BS_HS+KVS=NL_X_NB_BS_ONE")
    assert (m.kv_size, m.is_mla, m.is_hnd) == (1, True, False)
    # planes of different containers; a fused-slot plane
    c = parse("K=NB_NL_BS_NH_HS+V=NL_X_NBBS_NH_HS")
    assert c.containers == {"K": "cross_layer", "V": "layer_list"} and not c.fused_nbbs
    assert parse("K=NL_X_NBBS_NH_HS+V=NL_X_NBBS_NH_HS").fused_nbbs


def test_chunk_and_group_tokens_in_single_plane_names():
    s = parse("NL_X_TWO_NB_NH_BSC_HS_BSE")
    assert s.is_hnd and s.token_groups and s.kv_size == 2 and s.two_major
    assert s.symbolic() == "NL x [2, NB, NH, BSC, HS, BSE]"
    assert parse("NL_X_TWO_NB_NH_HSC_BS_HSE").chunked_heads
    assert parse("NL_X_NB_BSC_NH_BSE_HS").is_hnd is False  # NH inside the token groups: NHD inside a group
    # NP stays parseable (superseded by multi-plane names)
    assert parse("NL_X_NP_X_NB_BS_ONE_HS").container == "per_layer_tuple"


@pytest.mark.parametrize(
    "name, part",
    [
        # two element axes (issue 17 item 6), in every combination
        ("NL_X_NB_BS_NH_HS_CS", "two element axes (HS and CS)"),
        ("NL_X_NB_BS_NH_CS_HS", "two element axes (HS and CS)"),
        ("NL_X_NB_BS_NH_HS_HSC_HSE", "two element axes (HS and HSC_HSE)"),
        ("NL_X_NB_BS_NH_HSC_CS_HSE", "two element axes (CS and HSC_HSE)"),
        ("NL_X_NB_BSV_BSS_HS", "two element axes (HS and BSV_BSS)"),
        ("K=NL_X_NB_BS_NH_HSC_HS_HSE", "two element axes"),
        ("NL_X_NB_BS_NH_HSC", "'HSC' needs its partner 'HSE'"),
        ("NL_X_NB_BS_NH_HSE", "'HSE' needs its partner 'HSC'"),
        ("NL_X_NB_BSC_NH_HS", "'BSC' needs its partner 'BSE'"),
        ("NL_X_NB_BS_BSC_BSE_NH_HS", "BS and BSC_BSE"),
        ("NL_X_NBBS_BSC_BSE_HS", "'BSC' cannot appear too"),
        ("NL_X_NB_BSE_NH_HS", "'BSE' needs its partner 'BSC'"),
        # multi-plane syntax
        ("K=NL_X_TWO_NB_BS_NH_HS", "plane 'K' 'NL_X_TWO_NB_BS_NH_HS': 'TWO' cannot appear in a plane template"),
        ("K=NL_X_NB_BS_NH_CS", "'CS' cannot appear in a plane template"),
        ("K=NL_X_NP_X_NB_BS_HS", "'NP' cannot appear in a plane template"),
        ("K=NL_X_NB_BSV_BSS", "'BSV' cannot appear in a plane template"),
        ("K=NL_X_NB_BS_NH_HS+NL_X_NB_BS_NH_HS", "plane 2 'NL_X_NB_BS_NH_HS' has no 'ROLE='"),
        ("k=NL_X_NB_BS_NH_HS", "plane 1 role 'k' is not a role"),
        ("1K=NL_X_NB_BS_NH_HS", "role '1K' is not a role"),
        ("K=NL_X_NB_BS_NH_HS+K=NL_X_NB_BS_NH_HS", "role 'K' names planes 1 and 2"),
        ("K=NL_X_NB_BS_NH_HS+", "plane 2 is empty"),
        ("+K=NL_X_NB_BS_NH_HS", "plane 1 is empty"),
        ("K=NL_X_NB_BS_NH_HS++V=NL_X_NB_BS_NH_HS", "plane 2 is empty"),
        ("K=", "plane 1 'K' has an empty template"),
        ("K=NL_X_NB_BS_NH_HS=V", "has two '='"),
        ("K=NL_X_NB_BS_NH_FOO+V=NL_X_NB_BS_NH_HS", "plane 'K' 'NL_X_NB_BS_NH_FOO': unknown token 'FOO'"),
        ("K=NL_X_NB_NH_HS+V=NL_X_NB_BS_NH_HS", "plane 'K' 'NL_X_NB_NH_HS': NB without BS"),
        ("K=NL_X_BS_NH_HS", "no block axis"),
        ("K=NL_X_NB_BS_NH_HS_HS", "axis 'HS' is repeated"),
    ],
)
def test_malformed_names_raise_format_error_naming_the_part(name, part):
    with pytest.raises(FormatError) as ei:
        parse(name)
    assert part in str(ei.value)
    assert repr(name) in str(ei.value)
    with pytest.raises(FormatError):
        kvcore.KVFormat(name=name)


# -- engine-shaped caches and independent views ---------------------------------------


def _fill(tensors, seed):
    """Distinct, position-dependent bits in every tensor (through an integer view)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        hi = 255 if it == torch.uint8 else 2**15 - 1
        t.view(it).copy_(torch.randint(0, hi, t.shape, generator=g).to(it))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _staged_row(staged, info, layer_pos, token):
    if info.staging_index is not None:
        return staged[info.staging_index, layer_pos, token]
    return staged[info.role][layer_pos, token]


class Case:
    """An engine-shaped cache: ``kv`` ({role: per-layer list}), the format name, and
    ``row(kv, role, layer, slot)`` -> the engine's ``[NH_p, *elem]`` view of one token."""

    def __init__(self, name, kv, row, dtype=None):
        self.name, self.kv, self.row, self.dtype = name, kv, row, dtype

    def tensors(self, kv=None):
        kv = self.kv if kv is None else kv
        return [t for v in kv.values() for t in (v if isinstance(v, list) else [v])]

    def clone(self):
        return {r: [t.clone() for t in v] for r, v in self.kv.items()}


def rocm_case(dtype=torch.bfloat16):
    x = 16 // torch.empty(0, dtype=dtype).element_size()
    k = [torch.zeros(NB, NH, HS // x, BS, x, dtype=dtype) for _ in range(NL)]
    v = [torch.zeros(NB, NH, HS, BS, dtype=dtype) for _ in range(NL)]

    def row(kv, role, layer, slot):
        b, t = divmod(slot, BS)
        return kv["K"][layer][b, :, :, t, :] if role == "K" else kv["V"][layer][b, :, :, t]

    return Case(ROCM, {"K": k, "V": v}, row)


def quant_case(pairs=False):
    """int8 K/V [NB, BS, NH, HS] with bf16 scales and zeros per (token, head) in sibling
    tensors: separate KS/KZ/VS/VZ planes, or (pairs) KSZ/VSZ planes of (scale, zero)."""
    kv = {r: [torch.zeros(NB, BS, NH, HS, dtype=torch.int8) for _ in range(NL)] for r in ("K", "V")}
    if pairs:
        name = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KSZ=NL_X_NB_BS_NH_HS+VSZ=NL_X_NB_BS_NH_HS"
        for r in ("KSZ", "VSZ"):
            kv[r] = [torch.zeros(NB, BS, NH, 2, dtype=torch.bfloat16) for _ in range(NL)]
    else:
        name = QUANT
        for r in ("KS", "KZ", "VS", "VZ"):
            kv[r] = [torch.zeros(NB, BS, NH, dtype=torch.bfloat16) for _ in range(NL)]

    def row(kv, role, layer, slot):
        b, t = divmod(slot, BS)
        return kv[role][layer][b, t]

    return Case(name, kv, row)


def int4_case():
    """int4 values packed two per byte: uint8 [NB, BS, NH, HS/2], bf16 (scale, zero) pairs."""
    name = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KSZ=NL_X_NB_BS_NH_HS+VSZ=NL_X_NB_BS_NH_HS"
    kv = {r: [torch.zeros(NB, BS, NH, HS // 2, dtype=torch.uint8) for _ in range(NL)] for r in ("K", "V")}
    for r in ("KSZ", "VSZ"):
        kv[r] = [torch.zeros(NB, BS, NH, 2, dtype=torch.bfloat16) for _ in range(NL)]
    return Case(name, kv, lambda kv, role, layer, slot: kv[role][layer][slot // BS, slot % BS])


def widths_case():
    """K head size 24, V head size 16 (MiMo-style), HND K and NHD V."""
    k = [torch.zeros(NB, NH, BS, 24, dtype=torch.float16) for _ in range(NL)]
    v = [torch.zeros(NB, BS, NH, 16, dtype=torch.float16) for _ in range(NL)]

    def row(kv, role, layer, slot):
        b, t = divmod(slot, BS)
        return kv["K"][layer][b, :, t] if role == "K" else kv["V"][layer][b, t]

    return Case("K=NL_X_NB_NH_BS_HS+V=NL_X_NB_BS_NH_HS", {"K": k, "V": v}, row)


def groups_case(dtype=torch.bfloat16):
    """SGLang ROCm vectorized_5d: K (NB, NH, HS/X, BS, X), V (NB, NH, BS/X, HS, X) with
    X = 16 bytes of elements (token groups of X tokens in V)."""
    x = 2  # tokens per group / elements per chunk (small, so BS = 4 holds two groups)
    k = [torch.zeros(NB, NH, HS // x, BS, x, dtype=dtype) for _ in range(NL)]
    v = [torch.zeros(NB, NH, BS // x, HS, x, dtype=dtype) for _ in range(NL)]

    def row(kv, role, layer, slot):
        b, t = divmod(slot, BS)
        if role == "K":
            return kv["K"][layer][b, :, :, t, :]
        return kv["V"][layer][b, :, t // x, :, t % x]

    return Case("K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_BSC_HS_BSE", {"K": k, "V": v}, row)


CASES = {
    "rocm_split_k": rocm_case,
    "int8_scales_zeros": quant_case,
    "int8_scale_zero_pairs": lambda: quant_case(pairs=True),
    "int4_packed": int4_case,
    "different_widths": widths_case,
    "token_groups": groups_case,
}

SLOTS = [5, 0, -1, 11, 6, 9]


def _check_gather(case, lay, got, slots, layers):
    infos = {p.role: p for p in lay.planes}
    for role, info in infos.items():
        for li, layer in enumerate(layers):
            for i, s in enumerate(slots):
                staged = _staged_row(got, info, li, i)
                if s < 0:
                    assert not _bytes(staged).any(), f"{role} layer {layer} padding row {i} was written"
                    continue
                want = case.row(case.kv, role, layer, s)
                assert torch.equal(_bytes(staged), _bytes(want)), f"{case.name}: {role} layer {layer} slot {s}"


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("which", list(CASES))
def test_semantic_gather_and_scatter(which, kernel, monkeypatch):
    if kernel == "reference":
        monkeypatch.setenv("KVCORE_KERNEL", "reference")
    case = CASES[which]()
    _fill(case.tensors(), seed=1)
    lay = build_layout(case.name, case.kv)
    slots = torch.tensor(SLOTS)
    # gather: all layers, a reversed subset, one layer
    _check_gather(case, lay, kvcore.gather(lay, slots), SLOTS, [0, 1])
    _check_gather(case, lay, kvcore.gather(lay, slots, layers=[1, 0]), SLOTS, [1, 0])
    one = kvcore.gather(lay, slots, layers=1)
    one4 = one.unsqueeze(1) if isinstance(one, torch.Tensor) else {k: v.unsqueeze(0) for k, v in one.items()}
    _check_gather(case, lay, one4, SLOTS, [1])
    # scatter changes exactly the bytes the engine's views address
    src = lay.allocate_staging(len(SLOTS))
    _fill([src] if isinstance(src, torch.Tensor) else list(src.values()), seed=2)
    want = case.clone()
    for info in lay.planes:
        for layer in range(NL):
            for i, s in enumerate(SLOTS):
                if s >= 0:
                    view = case.row(want, info.role, layer, s)
                    row = _staged_row(src, info, layer, i)
                    view.copy_(row.view(view.dtype).reshape(view.shape))
    kvcore.scatter(lay, slots, src)
    for role in case.kv:
        for layer in range(NL):
            assert torch.equal(_bytes(case.kv[role][layer]), _bytes(want[role][layer])), f"{case.name}: scatter {role} layer {layer}"
    # and gathers back bit-exact
    back = kvcore.gather(lay, slots)
    for info in lay.planes:
        for layer in range(NL):
            for i, s in enumerate(SLOTS):
                if s >= 0:
                    assert torch.equal(_bytes(_staged_row(back, info, layer, i)), _bytes(_staged_row(src, info, layer, i)))


def test_rocm_split_k_geometry_and_classic_staging():
    case = rocm_case()
    lay = build_layout(case.name, case.kv)
    assert lay.classic_staging and lay.stride_table().classic
    assert lay.staging_shape(7) == (2, NL, 7, NH * HS) and lay.staging_shapes(7) == {"kv": (2, NL, 7, NH * HS)}
    assert lay.staging_shape(7, 1) == (2, 7, NH * HS)
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size, lay.kv_size) == (NL, NB, BS, NH, HS, 2)
    assert lay.dtype == torch.bfloat16 and lay.hidden_dim == NH * HS
    assert lay.elements_per_layer == 2 * NB * BS * NH * HS
    k, v = lay.stride_table().planes
    # K (NB, NH, HS/8, BS, 8) bf16: 16-byte chunks BS*16 bytes apart; V (NB, NH, HS, BS): one element per chunk
    assert (k.role, k.token, k.head, k.chunk, k.chunk_bytes, k.n_chunks) == ("K", 16, HS * BS * 2, BS * 16, 16, HS // 8)
    assert (v.role, v.token, v.head, v.chunk, v.chunk_bytes, v.n_chunks) == ("V", 2, HS * BS * 2, BS * 2, 2, HS)
    assert lay.describe() == f"K: {NL} x [{NB}, {NH}, {HS // 8}, {BS}, 8] + V: {NL} x [{NB}, {NH}, {HS}, {BS}]"
    assert [p.role for p in lay.planes] == ["K", "V"] and [p.staging_index for p in lay.planes] == [0, 1]
    assert lay.data_ptrs() == [t.data_ptr() for t in case.kv["K"]] + [t.data_ptr() for t in case.kv["V"]]
    assert lay.data_ptrs([1]) == [case.kv["K"][1].data_ptr(), case.kv["V"][1].data_ptr()]
    with pytest.raises(GeometryError, match="multi-plane record"):
        lay.shape_desc()
    s = lay.summary()
    assert s["staging"] == {"kv": [2, NL, "T", NH * HS]}
    assert [(p["role"], p["template"], p["head_size"]) for p in s["planes"]] == [
        ("K", "NL_X_NB_NH_HSC_BS_HSE", HS),
        ("V", "NL_X_NB_NH_HS_BS", HS),
    ]
    # the plane order of the name does not change the staging: K first
    lay2 = build_layout("V=NL_X_NB_NH_HS_BS+K=NL_X_NB_NH_HSC_BS_HSE", case.kv)
    assert [p.role for p in lay2.stride_table().planes] == ["K", "V"] and [p.role for p in lay2.planes] == ["V", "K"]
    _fill(case.tensors(), seed=3)
    assert torch.equal(kvcore.gather(lay2, [3, 7]).view(torch.int16), kvcore.gather(lay, [3, 7]).view(torch.int16))


def test_per_plane_staging_shapes_and_dtypes():
    case = quant_case()
    lay = build_layout(case.name, case.kv)
    assert not lay.classic_staging
    assert lay.staging_shapes(5) == {"K": (NL, 5, NH * HS), "V": (NL, 5, NH * HS), **{r: (NL, 5, NH) for r in ("KS", "KZ", "VS", "VZ")}}
    assert lay.staging_shapes(5, 0)["KS"] == (5, NH) and lay.staging_shapes(5, [1])["K"] == (1, 5, NH * HS)
    assert {b.key: b.dtype for b in lay.staging_buffers} == {
        "K": torch.int8,
        "V": torch.int8,
        **{r: torch.bfloat16 for r in ("KS", "KZ", "VS", "VZ")},
    }
    st = lay.allocate_staging(5)
    assert {k: (tuple(v.shape), v.dtype) for k, v in st.items()} == {
        b.key: (lay.staging_shapes(5)[b.key], b.dtype) for b in lay.staging_buffers
    }
    with pytest.raises(GeometryError, match="stages one buffer per plane"):
        lay.staging_shape(5)
    with pytest.raises(GeometryError, match="multi-plane record"):
        lay.shape_desc()
    assert (lay.dtype, lay.head_size, lay.kv_size, lay.num_heads) == (torch.int8, HS, 2, NH)
    info = {p.role: p for p in lay.planes}
    assert (info["KS"].dtype, info["KS"].num_heads, info["KS"].head_size, info["KS"].head_bytes, info["KS"].staging) == (
        torch.bfloat16,
        NH,
        1,
        2,
        "KS",
    )
    assert lay.elements_per_layer == NB * BS * (2 * NH * HS + 4 * NH)
    s = lay.summary()
    assert s["staging"]["KS"] == [NL, "T", NH] and s["staging"]["K"] == [NL, "T", NH * HS]
    assert "KS: 2 x [3, 4, 2]" in lay.describe()


def test_different_widths_and_mixed_dtypes_have_no_single_head_size():
    case = widths_case()
    lay = build_layout(case.name, case.kv)
    assert lay.staging_shapes(3) == {"K": (NL, 3, NH * 24), "V": (NL, 3, NH * 16)}
    with pytest.raises(GeometryError, match="different head sizes .*K 24, V 16"):
        _ = lay.head_size
    assert lay.summary()["head_size"] is None and lay.dtype == torch.float16
    # per-plane dtypes: K as fp8 bytes, V as int8
    kv = {
        "K": [torch.zeros(NB, BS, NH, HS, dtype=torch.uint8) for _ in range(NL)],
        "V": [torch.zeros(NB, BS, NH, HS, dtype=torch.int8) for _ in range(NL)],
    }
    lay = build_layout("K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS", kv, dtype={"K": torch.float8_e4m3fn})
    assert [p.dtype for p in lay.planes] == [torch.float8_e4m3fn, torch.int8] and not lay.classic_staging
    with pytest.raises(GeometryError, match="different dtypes"):
        _ = lay.dtype
    assert "dtype={'K': torch.float8_e4m3fn, 'V': torch.int8}" in repr(lay)
    # a byte view carrying bf16 in one plane only
    kv = {
        "K": [torch.zeros(NB, BS, NH, 2 * HS, dtype=torch.int8) for _ in range(NL)],
        "KS": [torch.zeros(NB, BS, NH, dtype=torch.float32) for _ in range(NL)],
    }
    lay = build_layout("K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH", kv, dtype={"K": torch.bfloat16})
    assert lay.head_size == HS and lay.staging_shapes(1) == {"K": (NL, 1, NH * HS), "KS": (NL, 1, NH)}


def test_single_plane_names_with_chunks_and_token_groups():
    # V vectorized: [2, NB, NH, BS/X, HS, X] per layer, K and V alike
    x = 2
    kv = [torch.zeros(2, NB, NH, BS // x, HS, x, dtype=torch.float32) for _ in range(NL)]
    _fill(kv, seed=4)
    lay = build_layout("NL_X_TWO_NB_NH_BSC_HS_BSE", kv)
    p = lay.stride_table().planes[0].strides
    assert (p.token_group, p.token_group_stride, p.token) == (x, HS * x * 4, 4)
    assert lay.staging_shape(3) == (2, NL, 3, NH * HS) and lay.describe() == f"{NL} x [2, {NB}, {NH}, {BS // x}, {HS}, {x}]"
    got = kvcore.gather(lay, [5, 2])
    for li in range(NL):
        for kvi in range(2):
            for i, s in enumerate([5, 2]):
                b, t = divmod(s, BS)
                assert torch.equal(got[kvi, li, i], kv[li][kvi, b, :, t // x, :, t % x].reshape(-1))
    with pytest.raises(GeometryError, match="token groups"):
        lay.shape_desc()
    # groups that continue each other are one plain token axis
    kv = [torch.zeros(2, NB, NH, HS, BS // x, x).permute(0, 1, 2, 4, 5, 3) for _ in range(NL)]  # [2, NB, NH, BSC, BSE, HS]
    lay = build_layout("NL_X_TWO_NB_NH_BSC_BSE_HS", kv)
    assert lay.stride_table().planes[0].strides.token_group == 0
    # strided elements whose chunks continue each other are one element-strided head
    kv = [torch.zeros(2, NB, BS, NH, HS // 4, 4, 2)[..., 0] for _ in range(NL)]
    p = build_layout("NL_X_TWO_NB_BS_NH_HSC_HSE", kv).stride_table().planes[0]
    assert (p.n_chunks, p.chunk_bytes, p.chunk) == (HS, 4, 8)
    # chunked heads whose chunks continue each other are one contiguous run
    kv = [torch.zeros(2, NB, BS, NH, HS // 4, 4) for _ in range(NL)]
    p = build_layout("NL_X_TWO_NB_BS_NH_HSC_HSE", kv).stride_table().planes[0]
    assert (p.n_chunks, p.chunk_bytes) == (1, HS * 4)
    # HSE not contiguous and not continuing: a second strided level (chunks of strided runs: vLLM CPU's AMX V tile)
    tr = [torch.zeros(2, NB, BS, NH, 4, HS // 4).transpose(-1, -2) for _ in range(NL)]
    p = build_layout("NL_X_TWO_NB_BS_NH_HSC_HSE", tr).stride_table().planes[0]
    assert (p.n_chunks, p.strides.n_sub, p.chunk_bytes, p.chunk, p.strides.sub) == (HS // 4, 4, 4, 4, HS)


# -- planes that do not fit -----------------------------------------------------------


def _quant_kv():
    return quant_case().kv


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda kv: kv.pop("KZ"), "plane\\(s\\) 'KZ' missing"),
        (lambda kv: kv.update(XS=kv["KS"]), "key\\(s\\) 'XS' are no plane"),
        (
            lambda kv: kv.update(K=[torch.zeros(NB + 1, BS, NH, HS, dtype=torch.int8) for _ in range(NL)]),
            "disagree on num_blocks \\(NB\\) \\(K 4, V 3",
        ),
        (
            lambda kv: kv.update(VS=[torch.zeros(NB, 2 * BS, NH, dtype=torch.bfloat16) for _ in range(NL)]),
            "disagree on block_size \\(BS\\).*VS 8",
        ),
        (
            lambda kv: kv.update(VZ=[torch.zeros(NB, BS, NH + 1, dtype=torch.bfloat16) for _ in range(NL)]),
            "disagree on num_heads \\(NH\\).*VZ 3",
        ),
        (lambda kv: kv.update(KS=kv["KS"][:1]), "disagree on num_layers \\(NL\\).*KS 1"),
        (lambda kv: kv.update(K=kv["K"][0]), "kv_caches\\['K'\\] should be a non-empty list"),
        (
            lambda kv: kv.update(V=[t.to(torch.int16) for t in kv["V"]][:1] + kv["V"][1:]),
            "kv_caches\\['V'\\]\\[1\\] is torch.int8 .* first tensor is torch.int16",
        ),
    ],
)
def test_planes_that_do_not_fit_are_geometry_errors_naming_the_planes(mutate, match):
    kv = _quant_kv()
    mutate(kv)
    with pytest.raises(GeometryError, match=match):
        build_layout(QUANT, kv)


def test_container_and_dtype_arguments_of_multi_plane_formats():
    kv = _quant_kv()
    with pytest.raises(GeometryError, match="must be a dict \\{role: container\\}"):
        build_layout(QUANT, list(kv.values()))
    with pytest.raises(GeometryError, match="dtype names 'XS'"):
        build_layout(QUANT, kv, dtype={"XS": torch.bfloat16})
    with pytest.raises(GeometryError, match="dtype\\['KS'\\] must be a torch.dtype"):
        build_layout(QUANT, kv, dtype={"KS": "bf16"})
    with pytest.raises(GeometryError, match="or a dict \\{role: dtype\\}"):
        build_layout(QUANT, kv, dtype="bf16")
    with pytest.raises(GeometryError, match="must be a torch.dtype"):  # a dict is for multi-plane formats only
        build_layout("NL_X_NB_BS_NH_HS", kv["K"], dtype={"K": torch.int8})
    with pytest.raises(GeometryError, match="one element per head"):  # a byte view needs an element axis
        build_layout("K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH", {"K": kv["K"], "KS": kv["KS"]}, dtype={"KS": torch.float32})
    meta = {r: [t.to("meta") for t in v] for r, v in kv.items()}
    meta["K"] = kv["K"]
    with pytest.raises(GeometryError, match="plane 'V' is on meta but plane 'K' is on cpu"):
        build_layout(QUANT, meta)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("qdtype", ["quint8", "qint8", "qint32"])
def test_quantized_torch_dtypes_are_refused_at_the_door(qdtype):
    dt = getattr(torch, qdtype)
    q = torch.quantize_per_tensor(torch.zeros(NB, BS, NH, HS), 0.1, 0, dt)
    # build_layout refuses quantized tensors at the door; the spec refuses them (and dtypes) too
    with pytest.raises(GeometryError, match=f"quantized tensor \\({qdtype}|{qdtype}, a torch quantized dtype"):
        build_layout("NL_X_NB_BS_NH_HS", [q, q.clone()])
    with pytest.raises(GeometryError, match="quantized dtype"):
        build_layout("NL_X_NB_BS_NH_HS", [torch.zeros(NB, BS, NH, HS, dtype=torch.uint8)], dtype=dt)
    kv = _quant_kv()
    kv["K"] = [q, q.clone()]
    with pytest.raises(GeometryError, match="quantized"):
        build_layout(QUANT, kv)
    with pytest.raises(GeometryError, match=f"kv_caches\\['K'\\] is torch.{qdtype}, a torch quantized dtype"):
        kvcore.Spec(kvcore.KVFormat(name=QUANT), kv)


# -- bad staging: refused before any write --------------------------------------------


def _snapshot(case):
    return [t.clone() for t in case.tensors()]


def _unchanged(case, snap):
    return all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(case.tensors(), snap))


def _bad_stagings(lay, t):
    good = lay.allocate_staging(t)
    yield "a tensor for a dict", torch.zeros(2, NL, t, NH * HS, dtype=torch.int8), "must be a dict \\{role: tensor\\}"
    yield "a plane missing", {k: v for k, v in good.items() if k != "VS"}, "plane\\(s\\) 'VS' missing"
    yield "an extra key", {**good, "XS": good["KS"].clone()}, "key\\(s\\) 'XS' are no staging buffer"
    yield "a plane of the wrong dtype", {**good, "KS": good["KS"].float()}, "out\\['KS'\\]|src\\['KS'\\]"
    yield "a plane of the wrong shape", {**good, "K": torch.zeros(NL, t, NH * HS + 1, dtype=torch.int8)}, "expected \\(2, 6, 32\\)"
    yield "a plane on another device", {**good, "V": good["V"].to("meta")}, "is on meta but the cache is on cpu"
    yield "a plane that is not a tensor", {**good, "KZ": [0] * 4}, "must be a torch.Tensor"
    yield "a plane with a strided last axis", {**good, "K": torch.zeros(NL, t, NH * HS * 2, dtype=torch.int8)[..., ::2]}, "last dimension"


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_bad_per_plane_staging_is_a_transfer_error_before_any_write(direction):
    case = quant_case()
    _fill(case.tensors(), seed=5)
    lay = build_layout(case.name, case.kv)
    t = len(SLOTS)
    for what, staging, match in _bad_stagings(lay, t):
        snap = _snapshot(case)
        bufs = [staging] if isinstance(staging, torch.Tensor) else [v for v in staging.values() if isinstance(v, torch.Tensor)]
        bsnap = [b.clone() for b in bufs if b.device.type != "meta"]
        with pytest.raises(TransferError, match=match):
            if direction == "gather":
                kvcore.gather(lay, SLOTS, staging)
            else:
                kvcore.scatter(lay, SLOTS, staging)
        assert _unchanged(case, snap), what
        assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip([b for b in bufs if b.device.type != "meta"], bsnap)), what
    # gather into two planes sharing memory
    good = lay.allocate_staging(t)
    good["VS"] = good["KS"]
    with pytest.raises(TransferError, match="share memory"):
        kvcore.gather(lay, SLOTS, good)


def test_classic_layouts_refuse_a_dict_and_plane_layouts_check_one_layer_shapes():
    case = rocm_case()
    lay = build_layout(case.name, case.kv)
    with pytest.raises(TransferError, match="is a dict, but format .* stages one tensor"):
        kvcore.gather(lay, [0], {"kv": torch.zeros(2, NL, 1, NH * HS, dtype=torch.bfloat16)})
    q = quant_case()
    lay = build_layout(q.name, q.kv)
    st = lay.allocate_staging(2, 1)
    assert st["K"].shape == (2, NH * HS)
    kvcore.scatter(lay, [1, 2], st, layers=1)
    with pytest.raises(TransferError, match="\\[T, NH_p\\*HS_p\\]"):
        kvcore.gather(lay, [1, 2], lay.allocate_staging(2), layers=1)
    # an empty mapping is a no-op returning the planes' empty buffers
    out = kvcore.gather(lay, [])
    assert {k: tuple(v.shape) for k, v in out.items()} == lay.staging_shapes(0)


# -- (layer, plane) regions must not share a byte (issue 17 item 3) ---------------------


def test_per_layer_views_that_overlap_are_refused():
    row = NH * HS
    buf = torch.zeros(NB * BS * row + row)
    l0 = buf[: NB * BS * row].view(NB, BS, NH, HS)
    l1 = buf[row : row + NB * BS * row].view(NB, BS, NH, HS)  # layer 1 starts one token row after layer 0
    with pytest.raises(GeometryError, match="layer 0 K and layer 1 K overlap .*alias"):
        build_layout("NL_X_NB_BS_NH_HS", [l0, l1])
    # by a single element, too
    l1 = buf[1 : 1 + NB * BS * row].view(NB, BS, NH, HS)
    with pytest.raises(GeometryError, match="overlap"):
        build_layout("NL_X_NB_BS_NH_HS", [l0, l1])
    # one tensor registered twice still says where
    with pytest.raises(GeometryError, match="start at the same address"):
        build_layout("NL_X_NB_BS_NH_HS", [l0, l0])
    # K and V of a per-layer tuple that are one tensor; one tensor as two planes of a cross-layer record
    t = torch.zeros(NB, BS, NH, HS)
    with pytest.raises(GeometryError, match="layer 0 K and layer 0 V start at the same address"):
        build_layout("NL_X_TWO_X_NB_BS_NH_HS", [(t, t)])
    x = torch.zeros(NB, NL, BS, NH, HS)
    with pytest.raises(GeometryError, match="start at the same address"):
        build_layout("K=NB_NL_BS_NH_HS+V=NB_NL_BS_NH_HS", {"K": x, "V": x})
    build_layout("K=NB_NL_BS_NH_HS+V=NB_NL_BS_NH_HS", {"K": x, "V": torch.zeros_like(x)})
    # two planes of a multi-plane record over the same bytes
    k = [torch.zeros(NB, BS, NH, HS) for _ in range(NL)]
    with pytest.raises(GeometryError, match=r"layer (\d) K and layer \1 V start at the same address"):
        build_layout("K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS", {"K": k, "V": k})
    # a scale plane viewed into the value plane's bytes
    vals = [torch.zeros(NB, BS, NH, HS) for _ in range(NL)]
    scales = [t[:, :, :, 3] for t in vals]
    with pytest.raises(GeometryError, match="KS .*alias|K .*KS.*alias"):
        build_layout("K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH", {"K": vals, "KS": scales})


def test_interleavings_that_share_a_range_but_no_byte_are_accepted():
    # K and V interleaved per block (one tensor per layer)
    build_layout("NL_X_NB_TWO_BS_NH_HS", [torch.zeros(NB, 2, BS, NH, HS) for _ in range(NL)])
    # layers interleaved in one cross-layer tensor
    build_layout("NB_NL_TWO_BS_NH_HS", torch.zeros(NB, NL, 2, BS, NH, HS))
    # K|V packed in one row
    build_layout("NL_X_NB_BS_NH_CS", [torch.zeros(NB, BS, NH, 2 * HS) for _ in range(NL)])
    # K and V halves of one buffer (SGLang host pool)
    buf = torch.zeros(2, NL, NB * BS, NH, HS)
    build_layout("TWO_X_NL_X_NBBS_NH_HS", [[buf[0, i] for i in range(NL)], [buf[1, i] for i in range(NL)]])
    # per-layer views of one buffer, blocks outermost (vLLM 0.33 cross-layer pages)
    pages = torch.zeros(NB, NL, 2, BS, NH, HS)
    build_layout("NL_X_NB_TWO_BS_NH_HS", [pages[:, i] for i in range(NL)])
    # per-layer views of one buffer whose layers interleave per head (distinct bytes, shared range)
    inter = torch.zeros(NB, BS, NH, NL, HS)
    build_layout("NL_X_NB_BS_NH_HS", [inter[:, :, :, i] for i in range(NL)])
    # blocked-scale: values then scales of a block's records, two planes in one row
    build_layout("NL_X_NB_BSV_BSS", [torch.zeros(NB, BS, 12, dtype=torch.uint8) for _ in range(NL)], params={"scale_bytes": 4})
    # a multi-plane record whose values and scales interleave per block in one uint8 pool
    pool = torch.zeros(NB, BS * NH * HS + BS * NH * 2, dtype=torch.uint8)
    vals = pool[:, : BS * NH * HS].view(NB, BS, NH, HS)
    scales = pool[:, BS * NH * HS :].view(torch.bfloat16).view(NB, BS, NH)
    lay = build_layout("K=NB_BS_NH_HS+KS=NB_BS_NH", {"K": vals, "KS": scales})
    assert lay.num_layers == 1 and lay.staging_shapes(1) == {"K": (1, 1, NH * HS), "KS": (1, 1, NH)}


def test_overlap_is_decided_by_addresses_not_byte_ranges():
    # two layers whose byte ranges overlap while their bytes do not: layer 1 sits in layer 0's head padding
    buf = torch.zeros(NB, BS, NH, 2 * HS)
    l0, l1 = buf[..., :HS], buf[..., HS:]
    lay = build_layout("NL_X_NB_BS_NH_HS", [l0, l1])
    assert lay.num_layers == 2
    # ... but one element more and they share a byte
    l1 = buf[..., HS - 1 : 2 * HS - 1]
    with pytest.raises(GeometryError, match="overlap"):
        build_layout("NL_X_NB_BS_NH_HS", [l0, l1])
    # meta tensors (kvcore detect from a log): distinct storages never overlap
    metas = [torch.empty(NB, BS, NH, HS, device="meta") for _ in range(NL)]
    build_layout("NL_X_NB_BS_NH_HS", metas)


def test_cli_describes_multi_plane_names_per_plane(capsys):
    import json

    from kvcore import cli

    rc = cli.main(["describe", ROCM, "--sizes", "NL=2,NB=10,BS=16,NH=2,HS=64,K.HSE=8", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["concrete"] == "K: 2 x [10, 2, 8, 16, 8] + V: 2 x [10, 2, 64, 16]"
    assert [p["role"] for p in d["planes"]] == ["K", "V"] and d["facts"]["container"] == "planes"
    assert d["elements"] == 2 * (2 * 10 * 2 * 64 * 16)  # both planes, every layer
    rc = cli.main(["describe", QUANT, "--sizes", "NL=2,NB=10,BS=16,NH=2,HS=64", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["elements"] == 2 * 10 * 16 * 2 * (2 * 64 + 4)
    rc = cli.main(["describe", "NL_X_NB_BS_NH_HS_CS"])
    assert rc == 2 and "two element axes (HS and CS)" in capsys.readouterr().err
