"""DeepSeek MLA caches, every holder and generation: the latents with DeepSeek's real head
hints (``head_dim = k_head_dim = kv_lora_rank + rope``, ``v_head_dim = 0``) and as a
``CacheEngine``; int8 / int4 latents with their k/v scale-zero tensors (multi-plane, with the
dequantising oracle); the 0.6.4-0.11.0 cross-layer ``full_gpu_cache`` and the 0.11.1+ pool;
fp8 (quant_policy 16 / 17); and what LMDeploy never allocates.

Expected bytes come from the fixtures' engine-side views (LMDeploy's kernel addressing), never
from kvcore's stride table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.allocation import CacheConfig, allocate, generation
from kvcore_lmdeploy.fixtures import view_cross_layer, view_per_layer, view_pool
from kvcore_lmdeploy.quant import dequantize, dequantize_staged, quantize, tolerance

import kvcore
from kvcore import DetectionError

# DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64
LATENT, RANK = 576, 512
DEEPSEEK = {"head_dim": LATENT, "k_head_dim": LATENT, "v_head_dim": 0}
VERSIONS = ["0.6.0", "0.6.2", "0.6.4", "0.9.2", "0.10.2", "0.11.0", "0.11.1", "0.12.3", "0.14.0"]


def _mla(version, policy=0, nl=2, nb=3, bs=16, dtype=torch.bfloat16, width=LATENT):
    cfg = CacheConfig(nl, nb, bs, 1, width, k_head_dim=width, v_head_dim=0, dtype=dtype, quant_policy=policy)
    return allocate(version, cfg), cfg


def _memory(alloc, version):
    """The allocation's distinct tensors: per-layer tensors, the cross-layer tuple, or the pool."""
    gen = generation(version)
    return [t for e in alloc.gpu_cache for t in e] if gen == "per_layer" else [alloc.full] if gen == "pool" else list(alloc.full)


HINT_SETS = [
    {},
    {"device_type": "cuda"},
    DEEPSEEK,
    {"k_head_dim": LATENT, "v_head_dim": 0},
    {"head_dim": LATENT, "v_head_dim": 0},
    {"head_dim": LATENT},
    {**DEEPSEEK, "num_kv_heads": 1, "block_size": 16, "dtype": "bfloat16", "device_type": "cuda"},
]


@pytest.mark.parametrize("version", VERSIONS)
def test_mla_latents_detect_with_deepseeks_own_hints(version, engine_side):
    """D1: the model's real head hints (and every subset) detect the latents, every release."""
    alloc, _ = _mla(version)
    engine_side.fill_random([t for e in alloc.gpu_cache for t in e], seed=1)
    for hints in HINT_SETS:
        layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**hints, "lmdeploy_version": version})
        assert layout.format.name == F.MLA and layout.head_size == LATENT and layout.num_heads == 1, hints
    view = view_per_layer()
    slots = [0, 17, 47, 5]
    staged = kvcore.gather(layout, torch.tensor(slots))  # [1, NL, T, 576]
    for layer in range(2):
        want = engine_side.rows(lambda lay, p: view(alloc.gpu_cache, lay, p), layer, 0, slots, 16)
        assert torch.equal(engine_side.as_bytes(staged[0, layer]), want)


@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("version", ["0.6.2", "0.9.2", "0.14.0"])
def test_a_deepseek_cache_engine_detects(version, world_size):
    """D1: a CacheEngine of a DeepSeek model states head_dim 576, k_head_dim 576, v_head_dim 0;
    per rank one latent head (0.6.x: multi_query_attention, not divided; 0.7+: the config
    builder replicates the KV head to the TP size, num_key_value_heads = tp)."""
    alloc, _ = _mla(version)
    mc = SimpleNamespace(dtype=torch.bfloat16, **DEEPSEEK)
    if version == "0.6.2":
        mc.num_key_value_heads, mc.multi_query_attention = 1, True
    else:
        mc.num_key_value_heads = max(1, world_size)  # update_num_kv_heads
    engine = SimpleNamespace(
        gpu_cache=alloc.gpu_cache,
        cache_config=SimpleNamespace(block_size=16, quant_policy=0, device_type="cuda"),
        model_config=mc,
        world_size=world_size,
    )
    layout = kvcore.detect(engine, engine="lmdeploy", hints={"lmdeploy_version": version})
    assert layout.format.name == F.MLA and layout.head_size == LATENT


def test_mla_hints_that_contradict_the_latents():
    alloc, _ = _mla("0.9.2")
    for hints, match in (
        ({"v_head_dim": 128}, "v_head_dim=128"),
        ({"head_dim": 128, "v_head_dim": 0}, "holds 576 elements per head, but the head_dim hints say 128"),
        ({**DEEPSEEK, "num_kv_heads": 2}, "1 heads, but num_kv_heads=2"),
        ({**DEEPSEEK, "block_size": 24}, "16 tokens per block, but block_size=24"),
        ({**DEEPSEEK, "block_size": 64, "lmdeploy_version": "0.9.2"}, "has no kernel blocks"),
        ({**DEEPSEEK, "quant_policy": 8}, "a plane is missing"),
        ({**DEEPSEEK, "device_type": "camb"}, "MLA, whose K is"),
        ({**DEEPSEEK, "dtype": "float16"}, "hint dtype=torch.float16"),
    ):
        with pytest.raises(DetectionError, match=match):
            kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints=hints)


@pytest.mark.parametrize(("policy", "dtype"), [(16, torch.float8_e4m3fn), (17, torch.float8_e5m2)])
def test_fp8_mla_latents_0_14(policy, dtype, engine_side):
    """quant_policy 16 / 17 with an MLA model: fp8 latents of the model's width (per-tensor
    scales live in the attention module); CUDA only, 0.14 only."""
    alloc, _ = _mla("0.14.0", policy)
    assert alloc.gpu_cache[0][0].dtype == dtype and tuple(alloc.gpu_cache[0][1].shape) == (3, 16, 1, 0)
    engine_side.fill_random([t for e in alloc.gpu_cache for t in e], seed=policy)
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**DEEPSEEK, "quant_policy": policy})
    assert layout.format.name == F.MLA and layout.dtype == dtype
    staged = kvcore.gather(layout, torch.tensor([3, 40]), layers=1)
    view = view_per_layer()
    want = engine_side.rows(lambda lay, p: view(alloc.gpu_cache, lay, p), 1, 0, [3, 40], 16)
    assert torch.equal(engine_side.as_bytes(staged[0]), want)
    with pytest.raises(DetectionError, match="FP8 quantization is only supported on CUDA"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"quant_policy": policy, "device_type": "ascend"})
    with pytest.raises(DetectionError, match="0.14"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"lmdeploy_version": "0.12.3"})


def test_the_656_byte_mla_fp8_record_is_not_claimed():
    """0.11.1+ use_mla_fp8_cache: K float8_e4m3fn [.., 1, 656] (512 fp8 + 4 fp32 scales + 64
    bf16 rope per token, cache_engine.py::MLA_FP8_HEAD_DIM): bytes of three dtypes."""
    k = torch.zeros(3, 64, 1, 656, dtype=torch.float8_e4m3fn)
    v = k[..., :0]
    with pytest.raises(DetectionError, match="656-byte records"):
        kvcore.detect([(k, v)], engine="lmdeploy", hints=DEEPSEEK)


# -- D4: MLA int8 / int4 -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.6.2", "0.6.4", "0.9.2", "0.11.1", "0.14.0"])
@pytest.mark.parametrize("policy", [8, 4])
def test_mla_int_latents_are_a_three_plane_record(version, policy, engine_side):
    """CacheEngine allocates (k uint8 [NB, BS, 1, 576 | 288], v [NB, BS, 1, 0], k_sz, v_sz
    [NB, BS, 1, 2]); the record is KV + KSZ + VSZ, every byte the attention reads."""
    alloc, _ = _mla(version, policy)
    k, v, ksz, vsz = alloc.gpu_cache[0]
    assert k.dtype == torch.uint8 and k.shape[-1] == (LATENT if policy == 8 else LATENT // 2) and v.shape[-1] == 0
    engine_side.fill_random([t for e in alloc.gpu_cache for t in e], seed=policy)
    for hints in ({}, {"quant_policy": policy}, {**DEEPSEEK, "device_type": "cuda"}, {**DEEPSEEK, "quant_policy": policy}):
        layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints=hints)
        assert layout.format.name == F.MLA_QUANT, hints
    assert layout.is_mla and layout.kv_size == 1 and not layout.classic_staging
    assert layout.staging_shapes(5) == {"KV": (2, 5, k.shape[-1]), "KSZ": (2, 5, 2), "VSZ": (2, 5, 2)}
    dst, _ = _mla(version, policy, nb=4)
    for e in dst.gpu_cache:
        for t in e:
            t.zero_()
    dst_layout = kvcore.detect(dst.gpu_cache, engine="lmdeploy", hints={"quant_policy": policy})
    view = view_per_layer(kind=f"mla-int{policy}")
    engine_side.check_gather_scatter(
        layout,
        dst_layout,
        lambda lay, p: view(alloc.gpu_cache, lay, p),
        lambda lay, p: view(dst.gpu_cache, lay, p),
        F.MLA_ROLES,
        16,
        src_slots=[0, 1, 31, 47, 20],
        dst_slots=[63, 2, 16, 17, 40],
        dst_tensors=_memory(dst, version),
    )


@pytest.mark.parametrize(
    ("version", "policy", "scale_dtype"), [("0.6.2", 8, torch.bfloat16), ("0.9.2", 4, torch.float16), ("0.14.0", 8, torch.float32)]
)
def test_mla_int_latents_dequantise_as_lmdeploy_reads_them(version, policy, scale_dtype):
    """The latents quantised as fill_kv_cache's K path does (per token, over all 576), written
    through LMDeploy's tensors; kvcore gathers; dequantize_staged gives the latents back within
    the quantisation step and exactly what the engine's K read gives; V (the first
    kv_lora_rank codes with v_scales_zeros) equals the engine's V read."""
    nl, nb, bs = 2, 3, 16
    alloc, _ = _mla(version, policy, nl=nl, nb=nb, bs=bs, dtype=scale_dtype)
    g = torch.Generator().manual_seed(7)
    ref = torch.randn(nl, nb * bs, 1, LATENT, generator=g) * torch.rand(nl, nb * bs, 1, 1, generator=g).add(0.5)
    vsz_ref = torch.rand(nl, nb * bs, 1, 2, generator=g).to(scale_dtype)  # whatever that memory holds: fill never writes it
    view = view_per_layer(kind=f"mla-int{policy}")
    for layer in range(nl):
        codes, sz = quantize(ref[layer], policy, scale_dtype)
        kv, ksz, vsz = (view(alloc.gpu_cache, layer, p) for p in range(3))
        kv.copy_(codes.view(kv.shape))
        ksz.copy_(sz.view(ksz.shape))
        vsz.copy_(vsz_ref[layer].view(vsz.shape))
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**DEEPSEEK, "quant_policy": policy})
    slots = torch.tensor([0, 9, 33, -1, 47])
    staged = kvcore.gather(layout, slots)
    got = dequantize_staged(layout, staged, policy, kv_lora_rank=RANK)
    keep = slots >= 0
    want = ref[:, slots[keep]]
    _, sz = quantize(want, policy, scale_dtype)
    err = (got["KV"][:, keep] - want).abs()
    assert bool((err <= tolerance(want, sz)).all()) and float(err.max()) > 0
    for layer in range(nl):
        kv, ksz, vsz = (view(alloc.gpu_cache, layer, p).flatten(0, 1) for p in range(3))
        engine_k = dequantize(kv, ksz, policy)  # _flatten_kv_cache_quant: K with k_scales_zeros
        engine_v = dequantize(kv, vsz, policy)[..., :RANK]  # V = k_cache[..., :kv_lora_rank] with v_scales_zeros
        assert torch.equal(got["KV"][layer, keep], engine_k[slots[keep]])
        assert torch.equal(got["V"][layer, keep], engine_v[slots[keep]])
    # the oracle can fail: V read with K's scales is not the engine's V
    wrong = dequantize_staged(layout, {**staged, "VSZ": staged["KSZ"]}, policy, kv_lora_rank=RANK)
    assert not torch.equal(wrong["V"][:, keep], got["V"][:, keep])


def test_mla_quant_refusals():
    alloc, _ = _mla("0.9.2", 8)
    gc = alloc.gpu_cache
    with pytest.raises(DetectionError, match="v_head_dim=512"):
        kvcore.detect(gc, engine="lmdeploy", hints={"v_head_dim": 512})
    with pytest.raises(DetectionError, match="quant_policy 4 stores head_dim/2"):
        kvcore.detect(gc, engine="lmdeploy", hints={**DEEPSEEK, "quant_policy": 4})
    with pytest.raises(DetectionError, match="does not quantise"):
        kvcore.detect(gc, engine="lmdeploy", hints={"device_type": "camb"})
    with pytest.raises(DetectionError, match="quantises the KV cache from 0.6.2"):
        kvcore.detect(gc, engine="lmdeploy", hints={"lmdeploy_version": "0.6.0"})
    with pytest.raises(DetectionError, match="MLA planes disagree"):
        kvcore.detect([(k, v, ksz[:, :8], vsz) for k, v, ksz, vsz in gc], engine="lmdeploy")
    turbo = [(k, v, ksz, vsz[..., :1]) for k, v, ksz, vsz in gc]
    with pytest.raises(DetectionError, match="does not support shared_kv"):
        kvcore.detect(turbo, engine="lmdeploy")


# -- D7: MLA full_gpu_cache and the pool ---------------------------------------------------------------------


@pytest.mark.parametrize(("version", "policy"), [("0.6.4", 0), ("0.9.2", 0), ("0.11.0", 8), ("0.10.2", 4)])
def test_mla_cross_layer_full_gpu_cache(version, policy, engine_side):
    alloc, _ = _mla(version, policy)
    engine_side.fill_random(list(alloc.full), seed=3)
    hints = {**DEEPSEEK, "device_type": "cuda", "lmdeploy_version": version}
    layout = kvcore.detect(alloc.full, engine="lmdeploy", hints=hints)
    assert layout.format.name == (F.X_MLA if policy == 0 else F.X_MLA_QUANT)
    dst, _ = _mla(version, policy)
    for t in dst.full:
        t.zero_()
    dst_layout = kvcore.detect(dst.full, engine="lmdeploy", hints=hints)
    kind = "mla" if policy == 0 else f"mla-int{policy}"
    view = view_cross_layer(kind=kind, version=version)
    roles = ("KV",) if policy == 0 else F.MLA_ROLES
    engine_side.check_gather_scatter(
        layout,
        dst_layout,
        lambda lay, p: view(alloc.full, lay, p),
        lambda lay, p: view(dst.full, lay, p),
        roles,
        16,
        src_slots=[1, 2, 30, 47],
        dst_slots=[47, 0, 15, 16],
        dst_tensors=list(dst.full),
    )


@pytest.mark.parametrize(
    ("policy", "dtype"), [(0, torch.bfloat16), (0, torch.float32), (8, torch.bfloat16), (4, torch.float16), (16, torch.bfloat16)]
)
def test_mla_pool_0_14(policy, dtype, engine_side):
    """The 0.11.1+ pool of an MLA model: K's slice, V's desc of size 0 (no bytes), the
    quant descs; cut from DeepSeek's hints."""
    alloc, cfg = _mla("0.14.0", policy, dtype=dtype)
    engine_side.fill_random([alloc.full], seed=5)
    hints = {**DEEPSEEK, "num_kv_heads": 1, "block_size": 16, "dtype": str(dtype).removeprefix("torch."), "quant_policy": policy}
    layout = kvcore.detect(alloc.full, engine="lmdeploy", hints=hints)
    assert layout.format.name == (F.X_MLA_QUANT if policy in (4, 8) else F.X_MLA)
    k = alloc.caches[0]
    got = layout.kv_caches["KV"] if policy in (4, 8) else layout.kv_caches
    assert got.data_ptr() == k.data_ptr() and got.stride() == k.stride() and got.shape == k.shape
    dst, _ = _mla("0.14.0", policy, dtype=dtype)
    dst_layout = kvcore.detect(dst.full, engine="lmdeploy", hints=hints)
    kind = "mla" if policy in (0, 16) else f"mla-int{policy}"
    roles = ("KV",) if policy in (0, 16) else F.MLA_ROLES
    view = view_pool(kind)
    engine_side.check_gather_scatter(
        layout,
        dst_layout,
        lambda lay, p: view(alloc.full, lay, p, hints=hints),
        lambda lay, p: view(dst.full, lay, p, hints=hints),
        roles,
        16,
        src_slots=[0, 5, 46],
        dst_slots=[47, 12, 13],
        dst_tensors=[dst.full],
    )
    # without quant_policy a pool row that fits one policy only is read from its size
    without = {k: v for k, v in hints.items() if k != "quant_policy"}
    if policy in (8, 4):
        assert kvcore.detect(alloc.full, engine="lmdeploy", hints=without).format.name == F.X_MLA_QUANT
    with pytest.raises(DetectionError, match="one KV head per rank"):
        kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "num_kv_heads": 2})
    with pytest.raises(DetectionError, match="TurboQuant"):
        kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "quant_policy": 42})
