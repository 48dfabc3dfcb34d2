"""MLA latents, blocked-scale records, padded pools, and hybrid models through detect_per_layer."""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import allocate, allocate_records, blocked_views, kv_view

import kvcore


@pytest.mark.parametrize(
    ("version", "backend", "layout", "width", "scale"),
    [
        ("0.11.0", "INDEXER", "NHD", 132, 4),
        ("0.33.0", "INDEXER", "LBNHC", 132, 4),
        ("0.26.0", "V4", "NHD", 584, 8),
        ("0.33.0", "V4", "LBNHC", 584, 8),
        ("0.33.0", "MXFP4", "LBNHC", 68, 4),
    ],
)
@pytest.mark.parametrize("padding", [0, 40])
def test_blocked_scale_records(version, backend, layout, width, scale, padding):
    """The widths vLLM writes blocked: per block all tokens' values, then all tokens' scales
    (DSA indexer keys 132 / 68, DeepSeek-V4 fp8_ds_mla 584; kvcore_vllm.specs), padded pages too."""
    if backend == "INDEXER":
        kv = allocate(version, backend, layout, num_layers=2, num_blocks=5, block_size=4, num_kv_heads=1, head_size=576,
                      dtype=torch.uint8, block_padding=padding)  # fmt: skip
    else:  # DeepSeek-V4's pages are rounded up to 576 B (alignment); add the test's padding on top
        kv = allocate_records(width, layout, version=version, num_layers=2, num_blocks=5, block_size=4,
                              alignment=(4 * width + padding) if padding else None)  # fmt: skip
    hints = {"vllm_version": version, "cache_dtype": "fp8_ds_mla" if backend == "V4" else None}
    if version.startswith("0.33"):
        # [NB, 1, BS, W] uint8 is also one fp8 MHA head of W/2: the backend decides
        with pytest.raises(kvcore.AmbiguousLayoutError):
            kvcore.detect(kv, "vllm", {"vllm_version": version})
        hints["attention_backend"] = "FLASHMLA_SPARSE"
    lay = kvcore.detect(kv, "vllm", hints)
    assert lay.format.name == "NL_X_NB_BSV_BSS"
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size, lay.kv_size) == (2, 5, 4, 1, width, 1)
    assert lay.describe() == f"2 x [5, 4x{width - scale}, 4x{scale}]"
    assert lay.stride_table().planes[0].block == 4 * width + padding
    layers = [t.squeeze(1) if t.dim() == 4 else t for t in kv.values()]
    if backend == "INDEXER":
        with pytest.raises(kvcore.GeometryError, match="blocked_views"):
            kv_view(kv, 0, 0, head_size=576)
    g = torch.Generator().manual_seed(1)
    for t in layers:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    slots = torch.tensor([7, -1, 0, 19, 12])
    out = kvcore.gather(lay, slots)
    for li in range(len(layers)):
        vals, scales = blocked_views(kv, li)
        assert vals.shape[-1] == width - scale and scales.shape[-1] == scale
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                assert not out[0, li, i].any()
                continue
            b, n = divmod(s, 4)
            assert torch.equal(out[0, li, i], torch.cat([vals[b, n], scales[b, n]]))
    before = [t.clone() for t in layers]
    src = torch.randint(0, 256, (1, 2, 3, width), generator=g, dtype=torch.uint8)
    kvcore.scatter(lay, torch.tensor([1, 8, 14]), src)
    for li, t in enumerate(layers):
        vals, scales = blocked_views(kv, li)
        for i, s in enumerate([1, 8, 14]):
            b, n = divmod(s, 4)
            assert torch.equal(vals[b, n], src[0, li, i, : width - scale]) and torch.equal(scales[b, n], src[0, li, i, width - scale :])
        changed = (t != before[li]).nonzero()
        assert {int(x) for x in changed[:, 0]} <= {0, 2, 3}  # only the blocks of slots 1, 8, 14


def test_nvfp4_ds_mla_records(semantic):
    # vLLM 0.33 flashmla_sparse.py / deepseek_v32 kernels.py: nvfp4_ds_mla is a 352 B record per token
    # (NoPE, RoPE, then its own scales); vLLM writes no 352-byte blocked page
    kv = allocate("0.33.0", "FLASHMLA_SPARSE", "LBNHC", num_layers=2, num_blocks=3, block_size=4, num_kv_heads=1, head_size=576,
                  cache_dtype="nvfp4_ds_mla")  # fmt: skip
    assert next(iter(kv.values())).shape == (3, 1, 4, 352)
    for hints in ({"attention_backend": "FLASHMLA_SPARSE"}, {"cache_dtype": "nvfp4_ds_mla"}, {"head_size": 352}):
        lay = kvcore.detect(kv, "vllm", hints)
        assert (lay.format.name, lay.head_size, lay.dtype) == ("NL_X_NB_BS_HS", 352, torch.uint8)
    semantic(lay, kv, lambda k, layer, p: kv_view(k, layer, p))
    # model_config.get_head_size() is 576 for it: the engine's own truth, with its cache dtype
    assert kvcore.detect(kv, "vllm", {"cache_dtype": "nvfp4_ds_mla", "head_size": 576}).head_size == 352
    with pytest.raises(kvcore.DetectionError):  # fp8_ds_mla writes 656 / 584 / 528 B records, never 352
        kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_ds_mla"})


def test_fp8_ds_mla_is_a_per_token_record(semantic):
    kv = allocate("0.11.0", "FLASHMLA_SPARSE", "NHD", num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1, head_size=576,
                  cache_dtype="fp8_ds_mla")  # fmt: skip
    assert next(iter(kv.values())).shape == (4, 4, 656)
    lay = kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_ds_mla"})
    assert (lay.format.name, lay.head_size, lay.dtype, lay.kv_size) == ("NL_X_NB_BS_HS", 656, torch.uint8, 1)
    semantic(lay, kv, kv_view)
    assert kvcore.detect(kv, "vllm").format.name == "NL_X_NB_BS_HS"  # 656 uint8 is no other vLLM layout


def test_mla_fp8_and_padded_pool(semantic):
    kv = allocate("0.11.0", "FLASHMLA", "NHD", num_layers=3, num_blocks=4, block_size=4, num_kv_heads=1, head_size=576,
                  cache_dtype="fp8_e4m3", block_padding=64)  # fmt: skip
    lay = kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_e4m3"})
    assert (lay.format.name, lay.dtype, lay.head_size) == ("NL_X_NB_BS_HS", torch.float8_e4m3fn, 576)
    assert lay.shape_desc().block_stride_elems == 4 * 576 + 64
    semantic(lay, kv, kv_view)


def test_gemma_mixed_head_sizes_and_indexer_beside_attention():
    a = allocate("0.11.0", "FLASH_ATTN", "NHD", num_layers=4, num_blocks=5, block_size=16, num_kv_heads=2, head_size=16)
    b = allocate("0.11.0", "FLASH_ATTN", "NHD", num_layers=4, num_blocks=5, block_size=16, num_kv_heads=1, head_size=32)
    kv = {f"model.layers.{i}.self_attn.attn": (a if i % 2 == 0 else b)[f"model.layers.{i}.self_attn.attn"] for i in range(4)}
    res = kvcore.detect_per_layer(kv, "vllm", hints={"kv_cache_layout": "NHD"})
    assert list(res) == list(kv)  # a dict in: the same keys out
    lays = list(res.values())
    assert [x.head_size for x in lays] == [16, 32, 16, 32]
    assert lays[0] is lays[2] and lays[0].layer_ids == (0, 2) and lays[1].layer_ids == (1, 3)
    assert lays[1].layer_names == ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
    att = allocate("0.33.0", "FLASH_ATTN", "LBNHC", num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8)
    idx = allocate("0.11.0", "INDEXER", "NHD", num_layers=2, num_blocks=5, block_size=4, num_kv_heads=1, head_size=576, dtype=torch.uint8)
    mixed = [
        att["model.layers.0.self_attn.attn"],
        idx["model.layers.0.self_attn.attn"],
        att["model.layers.1.self_attn.attn"],
        idx["model.layers.1.self_attn.attn"],
    ]
    lays = kvcore.detect_per_layer(mixed, "vllm", hints={"dtype": "bfloat16"})
    assert [x.format.name for x in lays] == ["NL_X_NB_BS_NH_CS", "NL_X_NB_BSV_BSS"] * 2


def test_mamba_state_is_excluded():
    att = allocate("0.11.0", "FLASH_ATTN", "NHD", num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)
    conv, ssm = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8, 8)
    kv = {
        "model.layers.0.mixer": [conv, ssm],
        "model.layers.1.self_attn.attn": att["model.layers.1.self_attn.attn"],
        "model.layers.2.mixer": [conv, ssm],
    }
    lays = list(kvcore.detect_per_layer(kv, "vllm", hints={"kv_cache_layout": "NHD"}).values())
    assert lays[0] is None and lays[2] is None
    assert lays[1].format.name == "NL_X_TWO_NB_BS_NH_HS" and lays[1].layer_ids == (1,)
    with pytest.raises(kvcore.DetectionError, match="Mamba"):
        kvcore.detect({"model.layers.0.mixer": [conv, ssm]}, "vllm")
    # two states of one shape could be a (K, V) pair: only if they are [NB, BS, NH, HS]; the hint says so outright
    same = [torch.zeros(5, 4, 8), torch.zeros(5, 4, 8)]
    with pytest.raises(kvcore.DetectionError, match="Mamba"):
        kvcore.detect([same], "vllm")
    pair = [torch.zeros(5, 16, 2, 8), torch.zeros(5, 16, 2, 8)]
    assert kvcore.detect([pair], "vllm").format.name == "NL_X_TWO_X_NB_BS_NH_HS"
    with pytest.raises(kvcore.DetectionError, match="Mamba"):
        kvcore.detect([pair], "vllm", {"kv_cache_spec": "mamba"})
    pages = [torch.zeros(5, 1, 1, 96, dtype=torch.int8) for _ in range(2)]  # 0.33 MambaSpec: one state per block
    lays = kvcore.detect_per_layer(pages + [att["model.layers.0.self_attn.attn"]], "vllm", hints={"block_size": 16})
    assert lays[:2] == [None, None] and lays[2].format.name == "NL_X_TWO_NB_BS_NH_HS"


def test_aliased_groups_and_shared_kv_layers(semantic):
    base = allocate("0.11.0", "FLASH_ATTN", "NHD", num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8)
    t0, t1 = base.values()
    # 0.11 get_kv_cache_config_from_groups: tensor i is shared_by one full and one sliding-window layer
    kv = {"model.layers.0.attn": t0, "model.layers.1.attn": t0, "model.layers.2.attn": t1, "model.layers.3.attn": t1}
    nhd = {"kv_cache_layout": "NHD"}
    lay = kvcore.detect(kv, "vllm", nhd)
    assert (lay.format.name, lay.num_layers) == ("NL_X_TWO_NB_BS_NH_HS", 4)  # one layer per entry, never fewer
    assert lay.aliases == {1: 0, 3: 2} and "earlier entry" in lay.note  # which layers share memory
    assert lay.data_ptrs() == [t0.data_ptr(), t0.data_ptr(), t1.data_ptr(), t1.data_ptr()]
    assert lay.layer_names == tuple(kv)
    slots = torch.tensor([3, 17, -1, 40])
    g = kvcore.gather(lay, slots)
    assert torch.equal(g[:, 0], g[:, 1]) and torch.equal(g[:, 2], g[:, 3])
    distinct = kvcore.detect(base, "vllm", nhd)
    assert torch.equal(g[:, [0, 2]], kvcore.gather(distinct, slots))  # the shared memory's own values
    semantic(distinct, base, kv_view)
    lays = list(kvcore.detect_per_layer(kv, "vllm", hints=nhd).values())
    assert all(x is lays[0] for x in lays) and lays[0].num_layers == 4 and lays[0].layer_ids == (0, 1, 2, 3)
    lays = list(kvcore.detect_per_layer(kv, "vllm", layer_groups=[[0, 2], [1, 3]], hints=nhd).values())  # the engine's groups
    assert lays[0].layer_ids == (0, 2) and lays[1].layer_ids == (1, 3) and not lays[0].aliases
    assert lays[0].data_ptrs() == lays[1].data_ptrs()
    # cross-layer KV sharing: layer 2 reuses layer 0's tensor object
    shared = {"model.layers.0.attn": t0, "model.layers.1.attn": t1, "model.layers.2.attn": t0}
    lay = kvcore.detect(shared, "vllm", nhd)
    assert lay.num_layers == 3 and lay.aliases == {2: 0} and lay.data_ptrs() == [t0.data_ptr(), t1.data_ptr(), t0.data_ptr()]
    assert [x.format.name for x in kvcore.detect_per_layer(shared, "vllm", hints=nhd).values()] == ["NL_X_TWO_NB_BS_NH_HS"] * 3


def test_partially_overlapping_layers_are_not_a_layer_list():
    buf = torch.zeros(4096, dtype=torch.bfloat16)
    a = torch.as_strided(buf, (2, 4, 16, 2, 8), (1024, 256, 16, 8, 1), 0)
    b = torch.as_strided(buf, (2, 4, 16, 2, 8), (1024, 256, 16, 8, 1), 8)  # interleaves with a, no uniform cross-layer form
    with pytest.raises(kvcore.DetectionError):
        kvcore.detect([a, b], "vllm", {"vllm_version": "0.11"})


def test_meta_tensors_keep_every_layer():
    layers = [torch.empty(2, 64, 16, 2, 8, dtype=torch.bfloat16, device="meta") for _ in range(3)]
    nhd = {"kv_cache_layout": "NHD"}
    lay = kvcore.detect(layers, "vllm", nhd)
    assert (lay.format.name, lay.num_layers, lay.aliases) == ("NL_X_TWO_NB_BS_NH_HS", 3, {})
    twice = kvcore.detect([layers[0], layers[0]], "vllm", nhd)  # one object twice: shared KV
    assert (twice.num_layers, twice.aliases) == (2, {1: 0})


@pytest.mark.parametrize(("layout", "fmt"), [("NHD", "NL_X_NB_TWO_BS_NH_HS"), ("HND", "NL_X_NB_TWO_NH_BS_HS")])
def test_attention_restrided_beside_mamba(layout, fmt, semantic):
    kv = allocate("0.11.0", "FLASH_ATTN", layout, num_layers=2, num_blocks=5, block_size=16, num_kv_heads=2, head_size=8, mamba_hybrid=True)
    t = next(iter(kv.values()))
    assert t.shape == (2, 5, 16, 2, 8) and t.stride()[:2] == (256, 512)
    if layout == "NHD":
        # a CPU tensor: vLLM 0.13 CPU_ATTN's (2, NB, NH, BS, HS) restrided beside Mamba layers is these very
        # strides with heads and tokens swapped (tests/test_vllm_hybrid_restride.py); the platform decides
        with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
            kvcore.detect(kv, "vllm")
        assert {"attention_backend", "device_type"} <= set(ei.value.hints)
    lay = kvcore.detect(kv, "vllm", {"device_type": "cuda"})
    assert lay.format.name == fmt  # K and V of a block are adjacent: blocks-first physically
    semantic(lay, kv, kv_view)


def test_v033_mixed_page_sizes_share_one_block_outermost_buffer():
    """Gemma-4-style groups with different head sizes in one 0.33 buffer, BLHNC: a block holds
    every layer's page of both groups (vllm/v1/kv_cache_interface.py::create_kv_cache_views with
    each KVCacheTensor's offset, layer_stride and the shared block_stride)."""
    nb, bs = 4, 4
    groups = [dict(nh=2, hs=8, layers=2), dict(nh=1, hs=16, layers=2)]
    pages = [g["nh"] * bs * 2 * g["hs"] * 2 for g in groups]  # bf16 K|V bytes per (layer, block)
    block_stride = sum(p * g["layers"] for p, g in zip(pages, groups))
    buf = torch.zeros(block_stride * nb, dtype=torch.int8)
    views, offset = [], 0
    for g, page in zip(groups, pages):
        c = 2 * g["hs"] * 2
        for layer in range(g["layers"]):
            v = torch.as_strided(buf, (nb, g["nh"], bs, c), (block_stride, bs * c, c, 1), offset + layer * page)
            views.append(v.view(torch.bfloat16))
        offset += page * g["layers"]
    kv = {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate([views[0], views[2], views[1], views[3]])}
    # [NB, 1, BS, C] alone is also an MLA view of width C: the backend decides
    with pytest.raises(kvcore.AmbiguousLayoutError, match="attention_backend"):
        kvcore.detect_per_layer(kv, "vllm", hints={"vllm_version": "0.33.0"})
    lays = list(kvcore.detect_per_layer(kv, "vllm", hints={"vllm_version": "0.33.0", "attention_backend": "FLASH_ATTN"}).values())
    assert [x.format.name for x in lays] == ["NB_NL_NH_BS_CS"] * 4
    assert lays[0] is lays[2] and lays[1] is lays[3] and lays[0] is not lays[1]
    assert (lays[0].head_size, lays[0].num_heads, lays[1].head_size, lays[1].num_heads) == (8, 2, 16, 1)
    assert lays[0].stride_table().planes[0].block == block_stride == lays[1].stride_table().planes[0].block
    # semantic: write each layer's K of slot 5 through vLLM's own split and gather it back per group
    for i, v in enumerate(kv.values()):
        k = v.transpose(1, 2).split(v.shape[-1] // 2, dim=-1)[0]  # [NB, BS, NH, HS]
        k[1, 1].fill_(float(i + 1))
    for lay, ids in ((lays[0], (0, 2)), (lays[1], (1, 3))):
        out = kvcore.gather(lay, torch.tensor([5]))
        assert out[0, :, 0].float().mean(dim=-1).tolist() == [float(i + 1) for i in ids]
        assert not out[1].any()
