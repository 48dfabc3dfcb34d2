"""Detection never guesses, and takes every real input (issue 16), class by class:

* a layout hint that contradicts the strides is an error naming both;
* a contiguous tensor that reads two ways (as allocated, or an NHD/HND cache already
  permuted into memory order) is ambiguous until a hint decides, and each deciding hint
  gives the engine's values back;
* fp8 FNUZ is honoured wherever a dtype is named, and ROCm's fp8 is never assumed;
* rank-3 caches of any width, bare cross-layer tensors, per-layer (K, V) pairs;
* an ambiguity never names a hint the caller gave (issue 17 item 7).
"""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import MATRIX, SPLIT_K, allocate, kv_view
from kvcore_vllm.pairs import allocate_pairs

import kvcore
from kvcore.detection import physical_permutation

# per-layer GPU layouts with an NHD/HND choice (<= 0.26) or NHD only (Triton, Flex 0.24)
PER_LAYER = [
    (v, b, lay, fmt)
    for v, b, lay, cross, fmt, extra in MATRIX
    if not cross and not extra and v < "0.33" and b in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
]
OTHER = {"NHD": "HND", "HND": "NHD"}
G = dict(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)  # BS != NH


def _ids(rows):
    return [f"{v}-{b}-{lay}" for v, b, lay, *_ in rows]


def _facts(version: str, backend: str) -> dict:
    return {"vllm_version": version, "attention_backend": backend}


# -- 1. a hint that contradicts the strides -----------------------------------------------------


def _env_steers(version: str, backend: str, env: str) -> bool:
    """Whether VLLM_KV_CACHE_LAYOUT=env fixes this backend's allocation: only backends whose
    get_kv_cache_stride_order reads get_kv_cache_layout() (0.11/0.13 flash_attn.py, flashinfer.py;
    0.24/0.26 also triton_attn.py), and FlashInfer's NHD not (SM 10.x overrides it to HND:
    0.11 platforms/cuda.py, 0.13-0.26 FlashInferBackend.get_required_kv_cache_layout)."""
    readers = {"FLASH_ATTN", "FLASHINFER"} | ({"TRITON_ATTN"} if version >= "0.24" else set())
    return backend in readers and not (backend == "FLASHINFER" and env == "NHD")


@pytest.mark.parametrize(("version", "backend", "layout", "fmt"), PER_LAYER, ids=_ids(PER_LAYER))
def test_a_layout_hint_contradicting_the_strides_is_an_error_naming_both(version, backend, layout, fmt, monkeypatch):
    kv = allocate(version, backend, layout, **G)
    wrong = OTHER[layout]
    for hints in ({**_facts(version, backend), "kv_cache_layout": wrong}, _facts(version, backend)):
        if "kv_cache_layout" not in hints:
            monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", wrong)  # the environment alone, as vLLM reads it
            if not _env_steers(version, backend, wrong):
                # the backend ignores the variable (or vLLM overrides it): the strides answer
                assert kvcore.detect(kv, "vllm", hints).format.name == fmt
                monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
                continue
        with pytest.raises(kvcore.DetectionError) as ei:
            kvcore.detect(kv, "vllm", hints)
        e = ei.value
        assert not isinstance(e, kvcore.AmbiguousLayoutError), str(e)
        msg = str(e)
        source = "kv_cache_layout" if "kv_cache_layout" in hints else "VLLM_KV_CACHE_LAYOUT"
        assert f"{source}='{wrong}'" in msg and fmt in msg, msg  # the hint, and what the strides show
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def test_issue_examples_of_contradicting_hints():
    nhd = torch.zeros(2, 5, 16, 4, 64, dtype=torch.bfloat16)  # vLLM 0.11 FlashAttention NHD, BS 16, 4 heads
    # on a GPU (on CPU, vLLM 0.13 CPU_ATTN allocates this very shape HND: (2, NB, NH, BS, HS))
    with pytest.raises(kvcore.DetectionError, match="kv_cache_layout='HND'.*NL_X_TWO_NB_BS_NH_HS.*BS=16, NH=4"):
        kvcore.detect([nhd, nhd.clone()], "vllm", {"kv_cache_layout": "HND", "device_type": "cuda"})
    hnd = torch.zeros(5, 4, 16, 128, dtype=torch.bfloat16)  # vLLM 0.26 packed HND, 4 heads, BS 16
    with pytest.raises(kvcore.DetectionError, match="kv_cache_layout='NHD'.*NL_X_NB_NH_BS_CS.*BS=16, NH=4"):
        kvcore.detect([hnd], "vllm", {"kv_cache_layout": "NHD", "vllm_version": "0.26"})
    # the caller says the tensor was permuted into memory order: then the hint is the truth
    # (on a GPU: a CPU tensor of this shape may also be vLLM 0.13 CPU_ATTN's, whose kernel packs K column-major)
    lay = kvcore.detect([nhd, nhd.clone()], "vllm", {"kv_cache_layout": "HND", "tensor_order": "physical", "device_type": "cuda"})
    assert (lay.format.name, lay.block_size, lay.num_heads) == ("NL_X_TWO_NB_NH_BS_HS", 4, 16)


# -- 2. physical-order twins ---------------------------------------------------------------------


@pytest.mark.parametrize(("version", "backend", "layout", "fmt"), PER_LAYER, ids=_ids(PER_LAYER))
def test_a_cache_handed_over_in_memory_order(version, backend, layout, fmt, semantic):
    """Any allocation permuted into memory order (as some connectors hand it over) reads
    right once the caller says so, and without that is either its only reading or an
    ambiguity that names the deciding hints -- never a guess with the geometry swapped."""
    kv = allocate(version, backend, layout, **G)
    phys = [t.permute(physical_permutation(t)) for t in kv.values()]
    facts = _facts(version, backend)
    lay = kvcore.detect(phys, "vllm", {**facts, "kv_cache_layout": layout, "tensor_order": "physical"})
    assert lay.format.name == fmt
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (5, 16, 2, 8)
    semantic(lay, kv, kv_view)
    try:
        bare = kvcore.detect(phys, "vllm", facts)
    except kvcore.AmbiguousLayoutError as e:
        assert fmt in e.candidates and len(e.candidates) >= 2
        assert {"tensor_order", "num_kv_heads", "block_size"} <= set(e.hints) and not set(e.hints) & set(facts)
    else:  # only one reading exists (an NHD-only backend): it must be the right one
        assert (bare.format.name, bare.block_size, bare.num_heads) == (fmt, 16, 2)


def test_issue_examples_of_twins(semantic):
    packed = torch.zeros(3, 16, 2, 256, dtype=torch.bfloat16)  # 0.26 packed, 2 heads, BS 16, in memory order
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect([packed], "vllm", {"vllm_version": "0.26", "device_type": "cuda"})
    assert {"NL_X_NB_BS_NH_CS", "NL_X_NB_NH_BS_CS"} <= set(ei.value.candidates)
    assert {"num_kv_heads", "block_size", "kv_cache_layout", "tensor_order"} <= set(ei.value.hints)
    for hints in ({"num_kv_heads": 2}, {"block_size": 16}, {"kv_cache_layout": "NHD", "tensor_order": "physical"}):
        lay = kvcore.detect([packed], "vllm", {"vllm_version": "0.26", "device_type": "cuda", **hints})
        assert (lay.format.name, lay.block_size, lay.num_heads, lay.head_size) == ("NL_X_NB_BS_NH_CS", 16, 2, 128)
    fi = allocate("0.11.0", "FLASHINFER", "HND", num_layers=1, num_blocks=5, block_size=16, num_kv_heads=8, head_size=64)
    (t,) = fi.values()
    phys = t.permute(physical_permutation(t))
    assert tuple(phys.shape) == (5, 2, 8, 16, 64)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect([phys], "vllm", {"attention_backend": "FLASHINFER", "vllm_version": "0.11"})
    assert {"NL_X_NB_TWO_BS_NH_HS", "NL_X_NB_TWO_NH_BS_HS"} <= set(ei.value.candidates)
    lay = kvcore.detect([phys], "vllm", {"attention_backend": "FLASHINFER", "vllm_version": "0.11", "num_kv_heads": 8})
    assert (lay.format.name, lay.block_size, lay.num_heads) == ("NL_X_NB_TWO_NH_BS_HS", 16, 8)
    semantic(lay, fi, kv_view)


# -- 3. fp8 FNUZ -------------------------------------------------------------------------------


def _fp8_cache(**kw):
    return allocate("0.24.0", "FLASHINFER", "NHD", cache_dtype="fp8_e4m3", **{**G, "num_layers": 1, "block_size": 16, **kw})


def test_rocm_fp8_is_never_assumed_and_fnuz_is_honoured():
    kv = _fp8_cache()
    t = next(iter(kv.values()))
    assert t.dtype == torch.uint8
    base = {"vllm_version": "0.24", "attention_backend": "FLASHINFER", "kv_cache_layout": "NHD", "cache_dtype": "fp8"}
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:  # MI300 (gfx942) writes FNUZ, MI350 (gfx950) OCP
        kvcore.detect(kv, "vllm", {**base, "device_type": "rocm"})
    assert ei.value.hints == ["dtype"] and "float8_e4m3fnuz" in str(ei.value) and "gfx94" in str(ei.value)
    t.fill_(0x40)  # 2.0 as OCP e4m3, 1.0 as FNUZ e4m3
    for dt in (torch.float8_e4m3fnuz, "float8_e4m3fnuz", "fp8_e4m3fnuz"):
        lay = kvcore.detect(kv, "vllm", {**base, "device_type": "rocm", "dtype": dt})
        assert lay.dtype == torch.float8_e4m3fnuz and lay.storage_dtype == torch.uint8
        g = kvcore.gather(lay, torch.tensor([0, 3]))
        assert g.dtype == torch.float8_e4m3fnuz and g.float().unique().tolist() == [1.0]
    lay = kvcore.detect(kv, "vllm", {**base, "device_type": "cuda"})
    assert lay.dtype == torch.float8_e4m3fn and kvcore.gather(lay, torch.tensor([0])).float().unique().tolist() == [2.0]
    lay = kvcore.detect(kv, "vllm", base)  # CPU tensors of a CUDA/CPU torch build: not ROCm
    assert lay.dtype == torch.float8_e4m3fn
    with pytest.raises(kvcore.DetectionError, match="fp8 e5m2 but the dtype hint says float8_e4m3fnuz"):
        kvcore.detect(kv, "vllm", {**base, "cache_dtype": "fp8_e5m2", "dtype": "float8_e4m3fnuz"})
    e5 = {**base, "cache_dtype": "fp8_e5m2", "dtype": "float8_e5m2fnuz"}
    assert kvcore.detect(kv, "vllm", e5).dtype == torch.float8_e5m2fnuz


def test_fp8_of_a_described_cache_needs_the_platform():
    meta = [torch.empty(5, 2, 16, 2, 8, dtype=torch.uint8, device="meta")]
    hints = {"vllm_version": "0.24", "attention_backend": "FLASHINFER", "kv_cache_layout": "NHD", "cache_dtype": "fp8"}
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:  # a description from a log says nothing of the platform
        kvcore.detect(meta, "vllm", hints)
    assert set(ei.value.hints) == {"dtype", "device_type"}
    assert kvcore.detect(meta, "vllm", {**hints, "device_type": "cuda"}).dtype == torch.float8_e4m3fn


# -- 4. rank-3 caches of any width ------------------------------------------------------------------


@pytest.mark.parametrize("width", [4, 100, 128, 576, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rank3_caches_of_any_width_are_latents(width, dtype, semantic):
    kv = [torch.zeros(7, 3, width, dtype=dtype) for _ in range(2)]
    lay = kvcore.detect(kv, "vllm")
    assert (lay.format.name, lay.kv_size, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (
        "NL_X_NB_BS_HS",
        1,
        7,
        3,
        1,
        width,
    )
    semantic(lay, kv, lambda k, layer, p: k[layer].unsqueeze(2))


def test_minimax_m3_indexer_keys_beside_packed_gqa():
    """vLLM 0.26, MiniMax-M3: rank-3 indexer key caches (NB, 128, 128) bf16 beside packed GQA
    caches (NB, NH, BS, 2*HS) -- here 3 and 4 layers of each, interleaved."""
    gqa = allocate("0.26.0", "FLASH_ATTN", "HND", num_layers=4, num_blocks=6, block_size=16, num_kv_heads=2, head_size=64)
    idx = [torch.zeros(6, 128, 128, dtype=torch.bfloat16) for _ in range(3)]
    g = list(gqa.values())
    kv = {f"model.layers.{i}.attn": t for i, t in enumerate([g[0], idx[0], g[1], idx[1], g[2], idx[2], g[3]])}
    res = kvcore.detect_per_layer(kv, "vllm", hints={"vllm_version": "0.26", "kv_cache_layout": "HND", "device_type": "cuda"})
    fmts = [x.format.name for x in res.values()]
    assert fmts == ["NL_X_NB_NH_BS_CS", "NL_X_NB_BS_HS"] * 3 + ["NL_X_NB_NH_BS_CS"]
    idx_lay = res["model.layers.1.attn"]
    assert (idx_lay.num_layers, idx_lay.block_size, idx_lay.head_size, idx_lay.layer_ids) == (3, 128, 128, (1, 3, 5))


def test_record_widths_follow_the_dtype():
    ds = [torch.zeros(4, 64, 656, dtype=torch.uint8)]  # fp8_ds_mla per-token record
    assert kvcore.detect(ds, "vllm").format.name == "NL_X_NB_BS_HS"
    idx = [torch.zeros(4, 64, 132, dtype=torch.uint8)]  # DeepSeek-V3.2 indexer: blocked-scale pages
    assert kvcore.detect(idx, "vllm").format.name == "NL_X_NB_BSV_BSS"
    assert kvcore.detect([torch.zeros(4, 64, 132, dtype=torch.bfloat16)], "vllm").format.name == "NL_X_NB_BS_HS"


def test_a_rank3_cache_that_needs_hints_names_them():
    flat = [torch.zeros(2, 8, 1024)]  # vLLM 0.11 CPU (2, NB, BS*NH*HS), or an MLA latent of 2 blocks
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(flat, "vllm", {"device_type": "cpu"})
    assert {"block_size", "head_size"} <= set(ei.value.hints) and "NL_X_NB_BS_HS" in ei.value.candidates
    with pytest.raises(kvcore.DetectionError, match="needs block_size or num_kv_heads or head_size") as ei:
        kvcore.detect(flat, "vllm", {"device_type": "cpu", "attention_backend": "TORCH_SDPA"})
    assert "two of block_size, num_kv_heads, head_size" in str(ei.value)
    full = {"device_type": "cpu", "attention_backend": "TORCH_SDPA", "block_size": 16, "head_size": 64, "use_ipex": False}
    lay = kvcore.detect(flat, "vllm", full)
    assert (lay.format.name, lay.block_size, lay.num_heads, lay.head_size) == (SPLIT_K, 16, 1, 64)


# -- 5. bare cross-layer tensors ------------------------------------------------------------------


def test_the_bare_cross_layer_tensor_of_a_connector():
    t = torch.zeros(8, 4, 2, 16, 8, 16, dtype=torch.bfloat16)  # [NB, NL, 2, BS, NH, HS]
    for hints in (None, {"kv_cache_layout": "NHD"}):
        lay = kvcore.detect(t, "vllm", hints)
        assert lay.format.name == "NB_NL_TWO_BS_NH_HS"
        assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (4, 8, 16, 8, 16)
    assert kvcore.detect([t], "vllm").format.name == "NB_NL_TWO_BS_NH_HS"  # one 6-D entry can only be that


CROSS = [
    (v, b, lay, fmt)
    for v, b, lay, cross, fmt, extra in MATRIX
    if kvcore.parse_format(fmt).container == "cross_layer" and b != "FLASHMLA" and not extra
]


@pytest.mark.parametrize(("version", "backend", "layout", "fmt"), CROSS, ids=_ids(CROSS))
def test_detection_is_idempotent_on_its_cross_layer_normal_form(version, backend, layout, fmt):
    g = {**G, "num_kv_heads": 3}
    if backend == "B12X":
        g.update(block_size=64, head_size=64)  # the kernel blocks and head sizes B12X runs with
    kv = allocate(version, backend, layout, cross_layer=version < "0.33", **g)
    hints = {**_facts(version, backend), "kv_cache_layout": layout}
    lay = kvcore.detect(kv, "vllm", hints)
    assert lay.format.name == fmt and isinstance(lay.kv_caches, torch.Tensor)
    again = kvcore.detect(lay.kv_caches, "vllm", hints)  # the one tensor a cross-layer connector is handed
    assert again.format.name == fmt
    assert again.stride_table().signature() == lay.stride_table().signature()


# -- 6. per-layer (K, V) pairs ---------------------------------------------------------------------


def test_per_layer_kv_pairs_are_kv_not_mamba(semantic):
    kv = allocate_pairs(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_size=8)
    lay = kvcore.detect(kv, "vllm")
    assert lay.format.name == "NL_X_TWO_X_NB_BS_NH_HS"
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (3, 4, 16, 2, 8)
    assert lay.layer_names == tuple(kv)
    semantic(lay, kv, lambda k, layer, p: list(k.values())[layer][p])
    as_lists = [list(p) for p in kv.values()]
    assert kvcore.detect(as_lists, "vllm").format.name == "NL_X_TWO_X_NB_BS_NH_HS"
    shared = [as_lists[0], as_lists[1], as_lists[0]]  # KV sharing through the same pair
    lay = kvcore.detect(shared, "vllm")
    assert lay.num_layers == 3 and lay.aliases == {2: 0}
    nope, rope = torch.zeros(4, 16, 1, 512), torch.zeros(4, 16, 1, 64)  # vllm-ascend MLA (or K/V with head_size_v)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect([(nope, rope)], "vllm")
    assert "Mamba" not in str(ei.value) and {"kv_cache_spec", "head_size"} <= set(ei.value.hints)
    assert kvcore.detect([(nope, rope)], "vllm", {"kv_cache_spec": "mla"}).format.name == "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS"


# -- issue 17 item 7: never name a hint the caller gave ----------------------------------------------


@pytest.mark.parametrize(
    "given",
    [
        {"vllm_version": "0.11"},
        {"vllm_version": "0.11", "attention_backend": "FLASH_ATTN"},
        {"kv_cache_layout": "NHD"},
        {"block_size": 2},
        {"num_kv_heads": 2},
        {"tensor_order": "allocated"},
    ],
)
def test_an_ambiguity_names_only_hints_not_given(given):
    kv = [torch.zeros(2, 2, 2, 2, 8)]  # NB == 2, BS == NH == 2: as ambiguous as a cache gets
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", given)
    assert ei.value.hints and not set(ei.value.hints) & set(given), (ei.value.hints, given)
    assert "hints given: " in str(ei.value) and all(f"{k}={v!r}" in str(ei.value) for k, v in given.items())


# -- messages that teach ----------------------------------------------------------------------------


def test_messages_that_teach():
    a = torch.zeros(2, 5, 16, 4, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, 5, 16, 4, 32, dtype=torch.bfloat16)  # another head size: a hybrid model
    with pytest.raises(kvcore.DetectionError, match="kvcore.detect_per_layer"):
        kvcore.detect([a, b], "vllm", {"kv_cache_layout": "NHD"})
    with pytest.raises(kvcore.DetectionError, match="the pool has 0 blocks") as ei:
        kvcore.detect([torch.zeros(2, 0, 16, 4, 64)], "vllm", {"kv_cache_layout": "NHD"})
    assert "readings tried, and why they do not fit" in str(ei.value)  # the reasons are kept (issue 13)
