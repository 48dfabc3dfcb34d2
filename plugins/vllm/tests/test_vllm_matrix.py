"""Every (version, backend, layout) vLLM allocates: detection, geometry, semantic gather and
scatter, and bit-exact round trips for each dtype, on caches allocated as vLLM does."""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import MATRIX, MLA_BACKENDS, MULTI_PLANE, RECORD_CASES, case_name, fixture_cases, record_case_name

import kvcore
from kvcore.testing import registered_fixtures

CASES = {c.name: c for c in fixture_cases()}
ROWS = {case_name(v, b, lay, x, extra): (v, b, lay, x, fmt, extra) for v, b, lay, x, fmt, extra in MATRIX}
IDS = list(ROWS)
FP_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)


def _kernel_split(name: str) -> int:
    return 4 if "-kernel" in name else 1  # the manager block holds 4 kernel blocks


def test_matrix_has_one_case_per_row():
    # one case per matrix row, plus the blocked-scale indexer (its oracle is a pair of segment views)
    # and one per byte record (RECORD_CASES: their oracle is the writers' pointer arithmetic)
    assert len(ROWS) == len(MATRIX)
    records = {record_case_name(*r[:4]) for r in RECORD_CASES}
    assert len(records) == len(RECORD_CASES)
    assert set(IDS) | {"vllm-0.11-INDEXER", "vllm-0.29-INDEXER-BLHNC"} | records == set(CASES)
    assert {CASES[record_case_name(*r[:4])].format for r in RECORD_CASES} == {r[4] for r in RECORD_CASES}
    assert CASES["vllm-0.11-INDEXER"].format == "NL_X_NB_BSV_BSS"
    pairs = {"vllm-ascend-pairs", "vllm-ascend-pairs-head_size_v", "vllm-ascend-pairs-mla"}  # + kvcore_vllm.pairs
    pairs |= {f"vllm-ascend-tuples-{k}" for k in ("dsa", "dsa_c8", "one", "indexer", "one-indexer")} | {"vllm-rbln"}
    assert {c.name for c in registered_fixtures("vllm")} == set(CASES) | pairs


@pytest.mark.parametrize("name", IDS)
def test_detect_geometry_and_semantics(name, semantic):
    case = CASES[name]
    sizes = dict(case.sizes)
    kv, hints = case.make(sizes, torch.bfloat16, "cpu")
    layout = kvcore.detect(kv, "vllm", hints)
    assert layout.format.name == case.format
    assert layout.num_layers == sizes["num_layers"]
    assert layout.num_blocks == sizes["num_blocks"] * _kernel_split(name)
    assert layout.block_size == sizes["block_size"]
    mla = ROWS[name][1] in MLA_BACKENDS
    if mla or case.format not in MULTI_PLANE or "num_kv_heads" in hints:
        assert layout.num_heads == sizes["num_heads"]
        assert layout.head_size == sizes["head_size"]
    assert layout.kv_size == (1 if mla else 2)
    assert layout.dtype == torch.bfloat16
    assert layout.hidden_dim == sizes["num_heads"] * sizes["head_size"]
    inputs = {t.untyped_storage().data_ptr() for t in kv.values()}
    assert all(t.untyped_storage().data_ptr() in inputs for t in layout.spec.kernel_leaves())  # views, never copies
    if layout.format.container == "layer_list":
        assert layout.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(sizes["num_layers"]))
    semantic(layout, kv, lambda k, layer, p: case.view(k, layer, p, hints))


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("dtype", FP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_dtypes_round_trip(name, dtype, semantic):
    case = CASES[name]
    if dtype not in case.dtypes:
        pytest.skip(f"{name} does not allocate {dtype}")
    sizes = dict(case.sizes, num_layers=2, num_blocks=3)
    kv, hints = case.make(sizes, dtype, "cpu")
    layout = kvcore.detect(kv, "vllm", hints)
    assert layout.format.name == case.format
    assert layout.dtype == dtype
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and "PALLAS" not in name:
        assert layout.storage_dtype == torch.uint8  # vLLM stores fp8 caches as uint8
    semantic(layout, kv, lambda k, layer, p: case.view(k, layer, p, hints), seed=3)


def _few_hints(name: str, full: dict, sizes: dict) -> dict:
    """Only what the tensors cannot show: that they are as vLLM allocated them (a contiguous
    tensor is also an HND/NHD cache already permuted into memory order), the device family,
    the backend where two backends of one device read one shape differently, run-time
    settings (IPEX, the 0.11 ROCm variable), a padded head, 0.33's one-head MLA view, the heads of a
    0.33 head slot."""
    hints = {k: full[k] for k in ("device_type", "use_ipex", "VLLM_V1_USE_PREFILL_DECODE_ATTENTION") if k in full}
    hints.setdefault("device_type", "cuda")  # the platform: CPU tensors may also be vLLM CPU's (platform_cpu)
    hints["tensor_order"] = "allocated"
    if "CPU_ATTN" in name:
        hints["cpu_attn_isa"] = full["cpu_attn_isa"]  # the kernel path packs the block; no tensor shows it
    if "TORCH_SDPA" in name:
        hints.update(block_size=full["block_size"], num_kv_heads=sizes["num_heads"])
    if "PALLAS" in name:
        hints["head_size"] = full["head_size"]
    if any(f"0.29-{b}-" in name for b in ("FLASHMLA", "CPU_MLA", "AMX_MLA")):
        hints["head_size"] = 576  # [NB, 1, BS, 576]: one MHA head of 288 or an MLA latent of 576
    if "ROCM" in name or "B12X" in name:
        # 0.33 head slots [NB, 2, BS, NH*HS]: two packed K|V heads too (the backend decides), and the slot's
        # row does not show how many heads it holds
        hints.update(attention_backend=full["attention_backend"], vllm_version=full["vllm_version"])
        if "ROCM_ATTN" in name or "ROCM_SEGMENTED_ATTN" in name or "B12X" in name:
            hints["num_kv_heads"] = sizes["num_heads"]
    return hints


@pytest.mark.parametrize("name", IDS)
def test_detect_from_strides_with_few_hints(name):
    """Strides decide NHD/HND and layer/block-outermost; only facts the tensors cannot show are given."""
    case = CASES[name]
    kv, full = case.make(dict(case.sizes), torch.bfloat16, "cpu")
    layout = kvcore.detect(kv, "vllm", _few_hints(name, full, case.sizes))
    assert layout.format.name == case.format
    assert (layout.num_blocks, layout.block_size, layout.num_heads) == (
        case.sizes["num_blocks"] * _kernel_split(name),
        case.sizes["block_size"],
        case.sizes["num_heads"],
    )


def test_cross_layer_reports_one_tensor_pointer_and_layer_stride():
    case = CASES["vllm-0.13-FLASH_ATTN-NHD-cross"]
    kv, hints = case.make(dict(case.sizes), torch.bfloat16, "cpu")
    layout = kvcore.detect(kv, "vllm", hints)
    views = list(kv.values())
    assert layout.format.container == "cross_layer"
    assert layout.data_ptrs() == [views[0].data_ptr()]
    tb = layout.stride_table()
    nh = case.sizes["num_heads"]
    page = 2 * 16 * nh * 16 * 2  # K+V page of one layer and block, bytes
    assert tb.planes[0].block == page * case.sizes["num_layers"]
    ptrs = tb.ptrs()
    assert int(ptrs[1, 0] - ptrs[0, 0]) == page  # layer stride inside a block
    assert int(ptrs[0, 1] - ptrs[0, 0]) == page // 2  # V after K


def test_v033_block_outermost_pointers_and_strides():
    case = CASES["vllm-0.29-FLASH_ATTN-BLHNC"]
    kv, hints = case.make(dict(case.sizes), torch.bfloat16, "cpu")
    layout = kvcore.detect(kv, "vllm", hints)
    views = list(kv.values())
    tb = layout.stride_table()
    nh, bs, hs = case.sizes["num_heads"], 16, 16
    page = nh * bs * 2 * hs * 2
    assert tb.planes[0].block == page * 2  # two layers' pages per block
    assert tb.planes[0].head == bs * 2 * hs * 2
    assert tb.planes[0].token == 2 * hs * 2
    ptrs = tb.ptrs()
    for layer, v in enumerate(views):
        assert int(ptrs[layer, 0]) == v.data_ptr()
        assert int(ptrs[layer, 1]) == v.data_ptr() + hs * 2  # V is the second half of C


def test_v033_byte_views_with_and_without_dtype(semantic):
    from kvcore_vllm.fixtures import allocate, kv_view

    kv = allocate("0.33.0", "FLASH_ATTN", "LBNHC", num_layers=2, num_blocks=5, block_size=8, num_kv_heads=2, head_size=8, byte_views=True)
    assert next(iter(kv.values())).dtype == torch.int8
    lay = kvcore.detect(kv, "vllm", {"dtype": "bfloat16"})
    assert (lay.format.name, lay.dtype, lay.head_size, lay.storage_dtype) == ("NL_X_NB_BS_NH_CS", torch.bfloat16, 8, torch.int8)
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))
    raw = kvcore.detect(kv, "vllm")  # no element dtype: the bytes, K first
    assert (raw.dtype, raw.head_size) == (torch.int8, 16)
    semantic(raw, kv, lambda k, layer, p: kv_view(k, layer, p), seed=5)


def test_v033_fp8_views():
    from kvcore_vllm.fixtures import allocate

    kv = allocate(
        "0.33.0", "FLASHINFER", "LBHNC", num_layers=2, num_blocks=4, block_size=8, num_kv_heads=2, head_size=16, cache_dtype="fp8_e5m2"
    )
    lay = kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_e5m2", "tensor_order": "allocated", "device_type": "cuda"})
    assert (lay.format.name, lay.dtype, lay.head_size) == ("NL_X_NB_NH_BS_CS", torch.float8_e5m2, 16)


def test_padded_v033_pool(semantic):
    from kvcore_vllm.fixtures import allocate, kv_view

    kv = allocate("0.33.0", "FLASH_ATTN", "LBNHC", num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8, block_padding=64)
    lay = kvcore.detect(kv, "vllm", {"vllm_version": "0.33"})
    page = 4 * 2 * 16 * 2
    assert lay.stride_table().planes[0].block == page + 64
    assert lay.shape_desc().block_stride_elems == (page + 64) // 2
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))


def test_dict_input_keeps_layer_order():
    from kvcore_vllm.fixtures import allocate, kv_view

    kv = allocate("0.11.0", "FLASH_ATTN", "NHD", num_layers=12, num_blocks=3, block_size=16, num_kv_heads=2, head_size=8)
    shuffled = {k: kv[k] for k in sorted(kv)}  # "layers.10" sorts before "layers.2"
    assert list(shuffled)[2] == "model.layers.10.self_attn.attn"
    for i in range(12):
        kv_view(kv, i, 0).fill_(i)
    lay = kvcore.detect(shuffled, "vllm", {"kv_cache_layout": "NHD"})
    assert lay.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(12))
    out = kvcore.gather(lay, torch.tensor([0, 17]))
    assert out[0, :, 0, 0].tolist() == [float(i) for i in range(12)]


def test_formats_listed_with_sources():
    # this plugin's own declarations (another plugin may declare the same name with its sources)
    names = {
        f.name: kvcore.registry.declarations(f.name)["vllm"] for f in kvcore.formats() if "vllm" in kvcore.registry.declarations(f.name)
    }
    for *_, fmt, _extra in MATRIX:
        f = names[fmt]
        assert "vllm" in f.engines and f.sources and all(s.engine == "vllm" and s.version and s.file for s in f.sources)
    assert {"FLASHINFER", "FLASH_ATTN"} <= set(names["NL_X_NB_TWO_BS_NH_HS"].attention_backends)
    assert {s.version for s in names["NL_X_NB_TWO_BS_NH_HS"].sources} >= {"0.11.0", "0.24.0"}


def test_other_engines_are_not_answered():
    from kvcore_vllm.plugin import kvcore_detect

    assert kvcore_detect(kv_caches=[torch.zeros(2, 4, 16, 2, 8)], engine="sglang", hints={}) is None


@pytest.mark.parametrize(
    ("version", "backend", "layout"), [("0.11.0", "FLASHINFER", "HND"), ("0.26.0", "FLASH_ATTN", "NHD"), ("0.33.0", "FLASH_ATTN", "BLNHC")]
)
def test_kv_view_on_a_plain_list_with_explicit_facts(version, backend, layout, semantic):
    from kvcore_vllm.fixtures import allocate, kv_view

    kv = list(allocate(version, backend, layout, num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=8).values())
    lay = kvcore.detect(kv, "vllm", {"vllm_version": version, "kv_cache_layout": layout})
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p, version=version, backend=backend, head_size=8, num_kv_heads=2))


def test_v033_mla_byte_views():
    from kvcore_vllm.fixtures import allocate

    kv = allocate("0.33.0", "FLASHMLA", "LBNHC", num_layers=2, num_blocks=3, block_size=4, num_kv_heads=1, head_size=576, byte_views=True)
    assert next(iter(kv.values())).shape == (3, 1, 4, 1152)
    with pytest.raises(kvcore.AmbiguousLayoutError):  # 1152 bytes: a bf16 latent of 576, or one K|V head
        kvcore.detect(kv, "vllm")
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "FLASHMLA"})
    assert (lay.format.name, lay.dtype, lay.head_size, lay.kv_size) == ("NL_X_NB_BS_HS", torch.int8, 1152, 1)
    lay = kvcore.detect(kv, "vllm", {"attention_backend": "FLASHMLA", "dtype": "bfloat16"})
    assert (lay.dtype, lay.head_size) == (torch.bfloat16, 576)
