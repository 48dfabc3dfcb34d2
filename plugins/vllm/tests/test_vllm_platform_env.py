"""The platform, the engine's environment and per-layer containers, as vLLM itself reads them.

Each test checks a class of input against vLLM's own reading (``kvcore_vllm.fixtures``:
allocation and ``kv_view`` restate vLLM's code per release) with real values: the CPU
backend's readings wherever the platform may be CPU (``platform_cpu``),
``VLLM_KV_CACHE_LAYOUT`` / ``VLLM_V1_USE_PREFILL_DECODE_ATTENTION`` parsed as ``vllm/envs.py``
does and applied only to the backends that read them, per-backend layouts (0.26 FlexAttention
is NHD only), 0.33 DeepSeek-V3.2 indexer caches as ``bind_kv_cache`` leaves them, 0.11 / 0.13
``[kv_cache]`` lists, (K, V) pairs and their hints, bounded cross-layer readings of one tensor,
and the messages that say why nothing fits.
"""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import CPU_VEC, SPLIT_K, allocate, allocate_dsv32, blocked_views, kv_view
from kvcore_vllm.hints import env_flag, parse_hints
from kvcore_vllm.pairs import PAIRS_KV_PLANES, PAIRS_MLA_PLANES, allocate_pairs
from kvcore_vllm.rules import MAX_BARE_LAYERS, bare_candidates

import kvcore

CPU_ROWS = CPU_VEC  # CPU_ATTN 0.24-0.33: per (block, head) K column-major, then V (cpu_attn_vec.hpp)
PACKED_HND = "NL_X_NB_NH_BS_CS"  # 0.26 GPU packed K|V, HND


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.delenv("VLLM_V1_USE_PREFILL_DECODE_ATTENTION", raising=False)


def _gather_equal(a: kvcore.KVLayout, b: kvcore.KVLayout, slots: list[int]) -> bool:
    s = torch.tensor(slots)
    return torch.equal(kvcore.gather(a, s).view(torch.uint8), kvcore.gather(b, s).view(torch.uint8))


# -- 1. the CPU backend is a reading wherever the platform may be CPU ------------------------------


def test_cpu_rows_are_a_reading_of_cpu_tensors_without_a_platform(semantic):
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    cpu26 = allocate("0.26.0", "CPU_ATTN", "HND", **g)  # [3, 2, 16, 128]: GPU packed HND has the same shape
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(cpu26, "vllm", {"vllm_version": "0.26.0", "num_kv_heads": 2})
    assert {CPU_ROWS, PACKED_HND} <= set(ei.value.candidates)
    assert {"attention_backend", "device_type"} <= set(ei.value.hints)
    for deciding in ({"attention_backend": "CPU_ATTN"}, {"device_type": "cpu"}):
        lay = kvcore.detect(cpu26, "vllm", {"vllm_version": "0.26.0", "num_kv_heads": 2, **deciding})
        assert (lay.format.name, lay.block_size, lay.num_heads, lay.head_size) == (CPU_ROWS, 16, 2, 64)
        semantic(lay, cpu26, kv_view)  # kv_view: view(NB, NH, 2*BS, HS).chunk(2, dim=2), as cpu_attn.py reads it
    gpu = kvcore.detect(cpu26, "vllm", {"vllm_version": "0.26.0", "num_kv_heads": 2, "device_type": "cuda"})
    assert gpu.format.name == PACKED_HND
    # 0.24 has no rank-4 GPU cache: the CPU rows are the one reading, HND hint or not
    cpu24 = allocate("0.24.0", "CPU_ATTN", "HND", **g)
    for hints in ({"vllm_version": "0.24.0", "kv_cache_layout": "HND"}, {"vllm_version": "0.24.0"}):
        lay = kvcore.detect(cpu24, "vllm", hints)
        assert (lay.format.name, lay.block_size, lay.num_heads) == (CPU_ROWS, 16, 2)
        semantic(lay, cpu24, kv_view, seed=1)
    # tensors that say nothing about the platform (meta: a description) keep the CPU reading too
    meta = [torch.empty(3, 2, 16, 128, dtype=torch.bfloat16, device="meta") for _ in range(2)]
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(meta, "vllm", {"vllm_version": "0.26.0", "num_kv_heads": 2})
    assert {CPU_ROWS, PACKED_HND} <= set(ei.value.candidates)


def test_use_ipex_selects_torch_sdpa(semantic):
    flat = [torch.zeros(2, 3, 2048, dtype=torch.bfloat16)]  # (2, NB, BS*NH*HS), or an MLA latent of 2 blocks
    with pytest.raises(kvcore.DetectionError, match="block_size.*head_size") as ei:
        kvcore.detect(flat, "vllm", {"vllm_version": "0.11.0", "use_ipex": True})
    assert "MLA" not in str(ei.value)  # use_ipex exists for TORCH_SDPA only: the latent is no reading
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    kv = allocate("0.11.0", "TORCH_SDPA", "NHD", use_ipex=True, **g)
    lay = kvcore.detect(kv, "vllm", {"vllm_version": "0.11.0", "use_ipex": True, "block_size": 16, "num_kv_heads": 2})
    assert (lay.format.name, lay.block_size, lay.num_heads, lay.head_size) == ("NL_X_TWO_NB_NH_BS_HS", 16, 2, 64)
    semantic(lay, kv, kv_view)
    noipex = allocate("0.11.0", "TORCH_SDPA", "NHD", use_ipex=False, **g)
    lay = kvcore.detect(noipex, "vllm", {"use_ipex": False, "block_size": 16, "num_kv_heads": 2})
    assert lay.format.name == SPLIT_K
    semantic(lay, noipex, kv_view)
    with pytest.raises(kvcore.DetectionError):  # a GPU backend has no such setting
        kvcore.detect(kv, "vllm", {"use_ipex": True, "attention_backend": "FLASH_ATTN", "block_size": 16, "num_kv_heads": 2})


# -- 2. environment variables parsed as vllm/envs.py parses them ---------------------------------


@pytest.mark.parametrize(
    ("value", "split"),
    [("1", True), ("true", True), ("TRUE", True), ("True", True), (True, True), (1, True)]
    + [("yes", False), ("on", False), ("2", False), (" 1", False), ("0", False), ("false", False), ("", False), (False, False)],
)
def test_prefill_decode_flag_parsed_as_vllm_does(value, split, monkeypatch, semantic):
    # vLLM 0.11 envs.py: os.getenv("VLLM_V1_USE_PREFILL_DECODE_ATTENTION", "False").lower() in ("true", "1")
    assert env_flag(value) is split
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    kv = allocate("0.11.0", "ROCM_ATTN", "NHD", prefill_decode_attention=split, **g)
    fmt = SPLIT_K if split else "NL_X_TWO_NB_BS_NH_HS"
    hints = {"vllm_version": "0.11.0", "attention_backend": "ROCM_ATTN"}
    lay = kvcore.detect(kv, "vllm", {**hints, "VLLM_V1_USE_PREFILL_DECODE_ATTENTION": value})
    assert lay.format.name == fmt
    semantic(lay, kv, kv_view)
    if isinstance(value, str):  # the engine's environment, read the same way
        monkeypatch.setenv("VLLM_V1_USE_PREFILL_DECODE_ATTENTION", value)
        assert kvcore.detect(kv, "vllm", hints).format.name == fmt


def test_prefill_decode_flag_on_puts_rocms_reading_beside_the_others(semantic):
    """The variable is read by ROCm's backend only (0.11 rocm_attn.py): stated on, with the
    device and backend unstated, ROCm's split reading stands beside FlashAttention's NHD
    reading of the same CPU-held tensor -- an ambiguity naming the hints that decide, never
    FlashAttention's reading by default; each deciding hint gives the engine's bytes."""
    g = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64)
    kv = allocate("0.11.0", "ROCM_ATTN", "NHD", prefill_decode_attention=True, **g)
    base = {"vllm_version": "0.11.0", "VLLM_V1_USE_PREFILL_DECODE_ATTENTION": True, "kv_cache_layout": "NHD"}
    with pytest.raises(kvcore.AmbiguousLayoutError) as e:
        kvcore.detect(kv, "vllm", base)
    assert ["attention_backend"] in e.value.decide
    lay = kvcore.detect(kv, "vllm", {**base, "attention_backend": "ROCM_ATTN"})
    assert lay.format.name == SPLIT_K
    semantic(lay, kv, kv_view)
    # on ROCm the AITER backends read the same tensor by unbind(0): the device alone does not decide
    with pytest.raises(kvcore.AmbiguousLayoutError) as e:
        kvcore.detect(kv, "vllm", {**base, "device_type": "rocm"})
    assert e.value.decide == [["attention_backend"]]
    # off (vLLM's default): ROCm reads unbind(0), the same bytes as FlashAttention's NHD
    kv_off = allocate("0.11.0", "ROCM_ATTN", "NHD", prefill_decode_attention=False, **g)
    lay = kvcore.detect(kv_off, "vllm", {**base, "VLLM_V1_USE_PREFILL_DECODE_ATTENTION": False})
    assert lay.format.name == "NL_X_TWO_NB_BS_NH_HS"
    semantic(lay, kv_off, kv_view)


@pytest.mark.parametrize(
    ("value", "version", "ok"),
    [("HND", "0.26.0", True), ("NHD", "0.11.0", True), ("BLHNC", "0.33.0", True), ("HND", "0.33.0", True)]
    + [("hnd", None, False), ("Nhd", "0.11.0", False), ("", None, False), ("BLHNC", "0.26.0", False), ("LBNHC", "0.24", False)],
)
def test_kv_cache_layout_variable_takes_vllms_values_only(value, version, ok, monkeypatch):
    # vllm/envs.py: env_with_choices("VLLM_KV_CACHE_LAYOUT", None, ["NHD", "HND"]) up to 0.26, the eight 0.33 names
    # in 0.33; case-sensitive; anything else raises ValueError in vLLM (the engine does not start)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", value)
    hints = {"vllm_version": version} if version else {}
    if ok:
        assert parse_hints(hints).env_kv_cache_layout == value
        assert parse_hints({**hints, "kv_cache_layout": "NHD"}).env_kv_cache_layout is None  # an explicit layout wins
    else:
        with pytest.raises(kvcore.DetectionError, match="VLLM_KV_CACHE_LAYOUT"):
            parse_hints(hints)
        parse_hints({**hints, "kv_cache_layout": "NHD"})  # not read at all when a layout is given


# -- 4. VLLM_KV_CACHE_LAYOUT steers only the backends that read get_kv_cache_layout() --------------

G4 = dict(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)


@pytest.mark.parametrize(
    ("version", "backend", "layout", "env", "fmt"),
    [
        ("0.24.0", "FLEX_ATTENTION", "NHD", "HND", "NL_X_NB_BS_TWO_NH_HS"),  # stride order (0, 2, 1, 3, 4) always
        ("0.26.0", "FLEX_ATTENTION", "NHD", "HND", "NL_X_NB_BS_NH_CS"),  # stride order (0, 2, 1, 3) always
        ("0.11.0", "TRITON_ATTN", "NHD", "HND", "NL_X_NB_TWO_BS_NH_HS"),  # no stride order in 0.11
        ("0.11.0", "FLEX_ATTENTION", "NHD", "HND", "NL_X_TWO_NB_BS_NH_HS"),
        ("0.24.0", "ROCM_AITER_FA", "NHD", "HND", "NL_X_NB_TWO_BS_NH_HS"),
        ("0.26.0", "CPU_ATTN", "HND", "NHD", CPU_ROWS),  # get_required_kv_cache_layout() "HND" wins (selector.py)
        ("0.24.0", "CPU_ATTN", "HND", "NHD", CPU_ROWS),
        ("0.11.0", "FLASHINFER", "HND", "NHD", "NL_X_NB_TWO_NH_BS_HS"),  # SM 10.x: set_kv_cache_layout("HND")
        ("0.26.0", "FLASHINFER", "HND", "NHD", PACKED_HND),
    ],
)
def test_layout_variable_ignored_by_backends_that_do_not_read_it(version, backend, layout, env, fmt, monkeypatch, semantic):
    kv = allocate(version, backend, layout, **G4)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", env)
    hints = {"vllm_version": version, "attention_backend": backend, "tensor_order": "allocated"}
    if backend == "ROCM_AITER_FA":
        hints["dtype"] = "bfloat16"
    lay = kvcore.detect(kv, "vllm", hints)
    assert (lay.format.name, lay.block_size, lay.num_heads) == (fmt, 16, 2)
    semantic(lay, kv, kv_view)


@pytest.mark.parametrize(
    ("version", "backend"),
    [("0.11.0", "FLASH_ATTN"), ("0.24.0", "TRITON_ATTN"), ("0.26.0", "FLASH_ATTN"), ("0.26.0", "TRITON_ATTN"), ("0.24.0", "FLASHINFER")],
)
def test_layout_variable_binds_backends_that_read_it(version, backend, monkeypatch):
    kv = allocate(version, backend, "NHD", **G4)  # NHD strides, the variable says HND: vLLM would have allocated HND
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    with pytest.raises(kvcore.DetectionError, match="VLLM_KV_CACHE_LAYOUT='HND'") as ei:
        kvcore.detect(kv, "vllm", {"vllm_version": version, "attention_backend": backend})
    assert not isinstance(ei.value, kvcore.AmbiguousLayoutError)


def test_layout_variable_without_a_backend_keeps_every_backends_reading(monkeypatch):
    # 0.11 (2, NB, BS, NH, HS) contiguous under VLLM_KV_CACHE_LAYOUT=HND: FlexAttention / AITER ignore the variable
    # (NHD as allocated), FlashAttention obeys it (HND, handed over in memory order): the backend decides
    kv = allocate("0.11.0", "FLEX_ATTENTION", "NHD", **G4)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", {"vllm_version": "0.11.0", "device_type": "cuda"})
    assert {"NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"} <= set(ei.value.candidates)
    assert "attention_backend" in ei.value.hints


# -- 11. XPU forces NHD in 0.11-0.24 only ---------------------------------------------------------


def test_xpu_forces_nhd_only_up_to_024(semantic):
    hnd24 = allocate("0.24.0", "FLASH_ATTN", "HND", **G4)
    with pytest.raises(kvcore.DetectionError, match="xpu"):
        kvcore.detect(hnd24, "vllm", {"vllm_version": "0.24.0", "device_type": "xpu"})
    # platforms/xpu.py 0.26 / 0.33 no longer calls set_kv_cache_layout("NHD"): HND caches are XPU's too
    hnd26 = allocate("0.26.0", "FLASH_ATTN", "HND", **G4)
    lay = kvcore.detect(hnd26, "vllm", {"vllm_version": "0.26.0", "device_type": "xpu", "tensor_order": "allocated"})
    assert (lay.format.name, lay.block_size, lay.num_heads) == (PACKED_HND, 16, 2)
    semantic(lay, hnd26, kv_view)
    v33 = allocate("0.33.0", "FLASH_ATTN", "LBHNC", **G4)
    lay = kvcore.detect(v33, "vllm", {"vllm_version": "0.33.0", "device_type": "xpu", "kv_cache_layout": "LBHNC"})
    assert lay.format.name == PACKED_HND
    semantic(lay, v33, kv_view)


def test_xpu_plugin_names_the_split_layout_by_its_registered_name():
    import kvcore_xpu.layouts

    assert SPLIT_K in kvcore_xpu.layouts.__doc__
    assert SPLIT_K in {f.name for f in kvcore.formats()}
    assert "NL_X_TWO_NB_NH_HS_BS" not in kvcore_xpu.layouts.__doc__


# -- 3. 0.33 DeepSeek-V3.2 indexer caches as bind_kv_cache leaves them ([B, N, C]) -----------------


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC"])
def test_dsv32_indexer_bound_3d_views_under_block_outermost_layouts(layout):
    _mla, idx = allocate_dsv32(layout, num_layers=3, num_blocks=2, block_size=64)
    bound = {k: v.squeeze(1) for k, v in idx.items()}  # DeepseekV32IndexerCache.bind_kv_cache: kv_cache.squeeze(1)
    g = torch.Generator().manual_seed(3)
    for t in bound.values():
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    slots = torch.tensor([0, 3, 64, 127])
    for hints in ({"vllm_version": "0.33.0", "kv_cache_layout": layout}, {"vllm_version": "0.33.0"}, {"kv_cache_layout": layout}):
        lay = kvcore.detect(bound, "vllm", hints)
        assert (lay.format.name, lay.num_layers, lay.num_blocks, lay.block_size) == ("NB_NL_BSV_BSS", 3, 2, 64)
        out = kvcore.gather(lay, slots)
        for li in range(3):
            vals, scales = blocked_views(idx, li)
            for i, s in enumerate(slots.tolist()):
                assert torch.equal(out[0, li, i], torch.cat([vals[s // 64, s % 64], scales[s // 64, s % 64]]))
    with pytest.raises(kvcore.DetectionError, match="LBNHC"):  # the strides show interleaved layers
        kvcore.detect(bound, "vllm", {"vllm_version": "0.33.0", "kv_cache_layout": "LBNHC"})
    # on ROCm the same bytes are the tiled indexer page: the 3-D and 4-D forms read alike
    rocm = {"vllm_version": "0.33.0", "kv_cache_layout": layout, "attention_backend": "ROCM_AITER_MLA_SPARSE"}
    four, three = kvcore.detect(idx, "vllm", rocm), kvcore.detect(bound, "vllm", rocm)
    assert three.format.name == four.format.name == "K=NB_NL_BSC_HSC_BSE_HSE+KS=NB_NL_BS_HS"
    a, b = kvcore.gather(three, slots), kvcore.gather(four, slots)
    assert set(a) == set(b) == {"K", "KS"} and all(torch.equal(a[r], b[r]) for r in a)


# -- 5. a backend that allocates one layout decides between twins ---------------------------------


@pytest.mark.parametrize("order", [None, "physical"])
def test_flex_026_cross_layer_tensor_is_nhd(order, semantic):
    kv = allocate("0.26.0", "FLEX_ATTENTION", "NHD", cross_layer=True, **G4)
    v0, v1 = list(kv.values())[:2]
    nb, nh, bs, cs = v0.shape  # per-layer view (NB, NH, BS, 2*HS) of the (NB, NL, BS, NH, CS) buffer
    step = v1.storage_offset() - v0.storage_offset()
    bare = torch.as_strided(v0, (nb, 2, bs, nh, cs), (v0.stride(0), step, v0.stride(2), v0.stride(1), 1), v0.storage_offset())
    assert bare.is_contiguous()
    hints = {"vllm_version": "0.26.0", "attention_backend": "FLEX_ATTENTION"}
    if order:
        hints["tensor_order"] = order
    lay = kvcore.detect(bare, "vllm", hints)
    assert (lay.format.name, lay.num_layers, lay.block_size, lay.num_heads, lay.head_size) == ("NB_NL_BS_NH_CS", 2, 16, 2, 8)
    semantic(lay, kv, kv_view)
    # FlashAttention 0.26 has both: the same tensor is an NHD or an HND cross-layer buffer
    with pytest.raises(kvcore.AmbiguousLayoutError):
        kvcore.detect(bare, "vllm", {"vllm_version": "0.26.0", "attention_backend": "FLASH_ATTN"})


# -- 6. vLLM 0.11 / 0.13 bind [kv_cache] per layer --------------------------------------------------


def test_bound_one_element_lists_are_the_layers_kv(semantic):
    kv = allocate("0.11.0", "FLASH_ATTN", "NHD", num_layers=3, num_blocks=5, block_size=16, num_kv_heads=4, head_size=64)
    bound = {name: [t] for name, t in kv.items()}  # v1/worker/utils.py::bind_kv_cache: forward_context[name].kv_cache = [kv_cache]
    hints = {"vllm_version": "0.11.0", "kv_cache_layout": "NHD"}
    lay = kvcore.detect(bound, "vllm", hints)
    assert (lay.format.name, lay.num_layers, lay.block_size, lay.num_heads) == ("NL_X_TWO_NB_BS_NH_HS", 3, 16, 4)
    assert lay.layer_names == tuple(kv)
    semantic(lay, kv, kv_view)
    per = kvcore.detect_per_layer(bound, "vllm", hints=hints)
    assert list(per) == list(kv) and all(x is not None and x.format.name == "NL_X_TWO_NB_BS_NH_HS" for x in per.values())
    # rank 3: a bound MLA latent or a one-state Mamba-style layer (short conv): kv_cache_spec decides
    mla = allocate("0.11.0", "FLASHMLA", "NHD", num_layers=2, num_blocks=5, block_size=16, num_kv_heads=1, head_size=576)
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect({k: [t] for k, t in mla.items()}, "vllm", {"vllm_version": "0.11.0"})
    assert ei.value.hints == ["kv_cache_spec"]
    lay = kvcore.detect({k: [t] for k, t in mla.items()}, "vllm", {"vllm_version": "0.11.0", "kv_cache_spec": "mla"})
    assert (lay.format.name, lay.head_size) == ("NL_X_NB_BS_HS", 576)
    semantic(lay, mla, kv_view)
    # a bound Mamba layer [[conv, ssm]] is state, and 0.24+ binds tensors themselves: a list there is state
    conv, ssm = torch.zeros(5, 8, 3), torch.zeros(5, 4, 16, 8)
    with pytest.raises(kvcore.DetectionError, match="Mamba"):
        kvcore.detect([[[conv, ssm]]], "vllm")
    with pytest.raises(kvcore.DetectionError, match="Mamba"):
        kvcore.detect(bound, "vllm", {"vllm_version": "0.24.0"})
    mixed = {"model.layers.0.mixer": [[conv, ssm]], **{f"model.layers.{i + 1}.self_attn.attn": [t] for i, t in enumerate(kv.values())}}
    per = kvcore.detect_per_layer(mixed, "vllm", hints=hints)
    assert per["model.layers.0.mixer"] is None and all(per[k] is not None for k in list(mixed)[1:])


# -- 7 / 9. (K, V) pairs: layout hints and unequal widths -------------------------------------------


def test_kv_pairs_are_nhd_only(monkeypatch, semantic):
    kv = allocate_pairs(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=16, head_size=64)
    for bad in ("HND", "LBHNC", "BLNHC"):
        with pytest.raises(kvcore.DetectionError, match=f"kv_cache_layout='{bad}'.*NHD"):
            kvcore.detect(kv, "vllm", {"kv_cache_layout": bad})
    for good in ("NHD", "LBNHC"):
        lay = kvcore.detect(kv, "vllm", {"kv_cache_layout": good})
        assert (lay.format.name, lay.block_size, lay.num_heads) == ("NL_X_TWO_X_NB_BS_NH_HS", 4, 16)
        semantic(lay, kv, lambda k, layer, p: list(k.values())[layer][p])
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")  # vllm-ascend never reads it
    assert kvcore.detect(kv, "vllm").format.name == "NL_X_TWO_X_NB_BS_NH_HS"


@pytest.mark.parametrize(
    ("hints", "fmt", "roles"),
    [
        ({"kv_cache_spec": "attention"}, PAIRS_KV_PLANES, ("K", "V")),
        ({"head_size": 32}, PAIRS_KV_PLANES, ("K", "V")),
        ({"attention_backend": "FLASH_ATTN"}, PAIRS_KV_PLANES, ("K", "V")),
        ({"kv_cache_spec": "mla"}, PAIRS_MLA_PLANES, ("KV", "KPE")),
        ({"head_size": 48}, PAIRS_MLA_PLANES, ("KV", "KPE")),
    ],
)
def test_pairs_of_unequal_widths_are_planes(hints, fmt, roles):
    kv = allocate_pairs(num_layers=2, num_blocks=4, block_size=8, num_kv_heads=1, head_size=32, head_size_v=16)
    g = torch.Generator().manual_seed(7)
    for pair in kv.values():
        for t in pair:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm")
    assert {"kv_cache_spec", "head_size"} <= set(ei.value.hints)
    lay = kvcore.detect(kv, "vllm", hints)
    assert lay.format.name == fmt
    slots = torch.tensor([0, 9, 31])
    out = kvcore.gather(lay, slots)  # per-plane staging: each plane at its own width
    assert set(out) == set(roles)
    for p, role in enumerate(roles):
        assert out[role].shape == (2, 3, (32, 16)[p])
        for li, pair in enumerate(kv.values()):
            want = pair[p].reshape(-1, (32, 16)[p])[slots]
            assert torch.equal(out[role][li], want)
    with pytest.raises(kvcore.DetectionError, match="head_size=40"):
        kvcore.detect(kv, "vllm", {"head_size": 40})


# -- 8. one bare tensor: cross-layer readings are bounded, never proportional to an axis ------------


def test_bare_tensor_cross_layer_readings_are_bounded():
    from kvcore_vllm.hints import VllmHints

    huge = torch.empty(2, 10**6, 16, 2, 16, device="meta")  # 0.26 cross NHD would have NL = 10**6
    h = VllmHints(vllm_version="0.26.0", kv_cache_layout="NHD")
    why: list[str] = []
    assert bare_candidates(huge, h, rejected=why) == []
    assert why and str(MAX_BARE_LAYERS) in why[0]
    at_bound = torch.empty(2, MAX_BARE_LAYERS, 16, 2, 16, device="meta")
    assert [r.candidate.format for r in bare_candidates(at_bound, h)] == ["NB_NL_BS_NH_CS"]
    with pytest.raises(kvcore.DetectionError, match=f"more than the {MAX_BARE_LAYERS}"):  # FlexAttention: NHD only
        kvcore.detect(huge, "vllm", {"vllm_version": "0.26.0", "attention_backend": "FLEX_ATTENTION"})
    # without hints: the per-layer readings only (none of them builds anything per block)
    big = torch.empty(2, 5_000_000_000, 16, 4, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(big, "vllm")
    assert not {"NB_NL_BS_NH_CS", "NB_NL_NH_BS_CS"} & set(ei.value.candidates)  # NL would be 5e9: not offered


# -- 9. messages that name what is missing or wrong -------------------------------------------------


def test_fp8_cache_dtype_with_float_tensors_is_an_error():
    kv = allocate("0.11.0", "FLASH_ATTN", "NHD", **G4)  # bfloat16: not an fp8 cache
    with pytest.raises(kvcore.DetectionError, match="cache_dtype='fp8_e4m3'.*uint8.*bfloat16"):
        kvcore.detect(kv, "vllm", {"vllm_version": "0.11.0", "cache_dtype": "fp8_e4m3"})
    fp8 = allocate("0.11.0", "FLASH_ATTN", "NHD", cache_dtype="fp8_e4m3", **G4)  # uint8, as vLLM stores it
    lay = kvcore.detect(fp8, "vllm", {"vllm_version": "0.11.0", "cache_dtype": "fp8_e4m3", "kv_cache_layout": "NHD"})
    assert (lay.dtype, lay.storage_dtype) == (torch.float8_e4m3fn, torch.uint8)


# -- 10. overlapping per-layer views: the reason reaches the caller ---------------------------------


def test_overlapping_layer_views_say_why():
    n = 2 * 4 * 16 * 2 * 64
    buf = torch.zeros(4 * n, dtype=torch.bfloat16)
    views = [buf[:n].view(2, 4, 16, 2, 64), buf[128 : 128 + n].view(2, 4, 16, 2, 64)]
    with pytest.raises(kvcore.DetectionError, match="overlap") as ei:
        kvcore.detect(views, "vllm", {"vllm_version": "0.11.0", "kv_cache_layout": "NHD"})
    assert "FlashAttention" in str(ei.value) and "no kvcore plugin recognises" not in str(ei.value)
