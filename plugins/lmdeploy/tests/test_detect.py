"""Detection of LMDeploy's caches, every generation: real geometries, hand-computed
addresses written through LMDeploy's own tensors, hints, ambiguities and bad inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy import plugin
from kvcore_lmdeploy.allocation import CacheConfig, allocate, pool_bytes

import kvcore
from kvcore import AmbiguousLayoutError, DetectionError, GeometryError

CUDA = {"device_type": "cuda"}
# Llama-3-8B on one rank: 8 KV heads of 128; a few layers and blocks keep it small
LLAMA = dict(num_layers=3, num_blocks=6, block_size=64, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("version", ["0.6.0", "0.6.3", "0.6.4", "0.9.2", "0.10.2", "0.11.1", "0.12.3", "0.14.0"])
def test_gpu_cache_of_every_generation_nhd(version):
    alloc = allocate(version, CacheConfig(**LLAMA))
    for entry in alloc.gpu_cache:  # CacheEngine uses torch.empty before 0.11
        for t in entry:
            t.zero_()
    k, v = alloc.gpu_cache[1]
    assert tuple(k.shape) == (6, 64, 8, 128) and k.dtype == torch.bfloat16
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints=CUDA)
    assert layout.format.name == F.NHD
    assert layout.describe() == "3 x 2 x [6, 64, 8, 128]"
    assert (layout.num_layers, layout.num_blocks, layout.block_size, layout.num_heads, layout.head_size) == (3, 6, 64, 8, 128)
    # block 4, token 17, head 5, element 99 of layer 1's V, written as LMDeploy's kernels address it
    v[4, 17, 5, 99] = 7.0
    k[4, 17, 5, 99] = -2.0
    staged = kvcore.gather(layout, torch.tensor([4 * 64 + 17, 3]))  # [2, NL, T, NH*HS]
    assert staged[1, 1, 0, 5 * 128 + 99].item() == 7.0 and staged[0, 1, 0, 5 * 128 + 99].item() == -2.0
    assert int(staged.count_nonzero()) == 2


def test_generations_differ_in_memory_not_in_name():
    """0.6.0 separate tensors, 0.9.2 views of one cross-layer tensor per kind, 0.11+ views
    of one uint8 pool with K, V at 256-byte-aligned offsets inside each (layer, block)."""
    cfg = CacheConfig(2, 3, 4, 2, 16)
    per_layer = allocate("0.6.0", cfg).gpu_cache
    assert per_layer[0][0].untyped_storage().data_ptr() != per_layer[1][0].untyped_storage().data_ptr()
    cross = allocate("0.9.2", cfg)
    assert cross.gpu_cache[1][0].storage_offset() == 3 * 4 * 2 * 16 and cross.gpu_cache[1][0].is_contiguous()
    pool = allocate("0.14.0", cfg)
    assert pool.full.dtype == torch.uint8 and tuple(pool.full.shape) == (2, 3, 512)  # K 256 B + V 256 B per block
    k, v = pool.gpu_cache[1]
    assert k.stride() == (256, 2 * 16, 16, 1) and v.storage_offset() * 2 == 1 * 3 * 512 + 256
    for cache in (per_layer, cross.gpu_cache, pool.gpu_cache):
        assert kvcore.detect(cache, engine="lmdeploy", hints=CUDA).format.name == F.NHD


def test_camb_blocks_are_hnd():
    alloc = allocate("0.12.3", CacheConfig(**LLAMA, device_type="camb"))
    k, v = alloc.gpu_cache[2]
    assert tuple(k.shape) == (6, 8, 64, 128)  # (NH, BS, HS) blocks
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"device_type": "camb"})
    assert layout.format.name == F.HND and layout.format.is_hnd
    k[5, 3, 40, 7] = 1.5  # head 3, token 40
    staged = kvcore.gather(layout, torch.tensor([5 * 64 + 40]), layers=2)
    assert staged[0, 0, 3 * 128 + 7].item() == 1.5


def test_cpu_copies_need_the_device_type_or_a_size_hint():
    """A host (swap) cache or a copy on the CPU: (BS, NH, HS) and (NH, BS, HS) both fit."""
    alloc = allocate("0.9.2", CacheConfig(2, 3, 16, 4, 32))
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy")
    assert "device_type" in e.value.hints and "block_size" in e.value.hints and "num_kv_heads" in e.value.hints
    assert set(e.value.candidates) == {F.NHD, F.HND}
    assert kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"block_size": 16}).format.name == F.NHD
    assert kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"num_kv_heads": 16}).format.name == F.HND
    square = allocate("0.9.2", CacheConfig(2, 3, 4, 4, 32))  # BS == NH: only the backend decides
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(square.gpu_cache, engine="lmdeploy", hints={"block_size": 4})
    assert e.value.hints == ["device_type"]
    one_head = allocate("0.9.2", CacheConfig(2, 3, 4, 1, 32))  # [3, 4, 1, 32]: NHD with 1 head, or HND with 4 heads of 1 token
    with pytest.raises(AmbiguousLayoutError):
        kvcore.detect(one_head.gpu_cache, engine="lmdeploy")
    assert kvcore.detect(one_head.gpu_cache, engine="lmdeploy", hints={"block_size": 4}).num_heads == 1


def test_tensor_device_is_the_backend():
    """A meta tensor says nothing; a cuda tensor was filled by the CUDA backend (NHD), an npu
    tensor by Ascend's, and a device_type hint naming another backend contradicts it."""
    from kvcore_lmdeploy.detect import _readings, _window
    from kvcore_lmdeploy.hints import parse_hints

    alloc = allocate("0.9.2", CacheConfig(1, 2, 4, 4, 8), device="meta")
    with pytest.raises(AmbiguousLayoutError):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy")
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    h = parse_hints({})
    every = _window(h, "gpu_cache")
    assert _readings(on_gpu, h, every) == [("NHD", {"device_type": "cuda"})]
    on_npu = (
        SimpleNamespace(device=torch.device("npu", 0)) if hasattr(torch, "npu") else SimpleNamespace(device=SimpleNamespace(type="npu"))
    )
    assert _readings(on_npu, h, every) == [
        ("NHD", {"device_type": "ascend", "soc_version": "Ascend910", "lmdeploy_version": "0.7.0-0.7.x, 0.8.0+"}),
        ("NZ", {"device_type": "ascend", "soc_version": "Ascend310P", "lmdeploy_version": "0.8.0-0.11.0"}),
    ]
    assert _readings(
        on_npu, parse_hints({"lmdeploy_version": "0.12.3"}), _window(parse_hints({"lmdeploy_version": "0.12.3"}), "gpu_cache")
    ) == [("NHD", {"device_type": "ascend"})]
    assert _readings(on_npu, parse_hints({"soc_version": "Ascend910B3"}), every) == [("NHD", {"device_type": "ascend"})]
    with pytest.raises(DetectionError, match="device_type='camb' but the tensors are on a cuda device"):
        _readings(on_gpu, parse_hints({"device_type": "camb"}), every)
    # MetaX MACA tensors are cuda tensors: the hint is taken, and MACA's blocks depend on the release
    assert _readings(on_gpu, parse_hints({"device_type": "maca"}), every) == [
        ("HND", {"device_type": "maca", "lmdeploy_version": "0.6.2-0.6.3"}),
        ("NHD", {"device_type": "maca", "lmdeploy_version": "0.10.0+"}),
    ]


@pytest.mark.parametrize(("policy", "dtype"), [(16, torch.float8_e4m3fn), (17, torch.float8_e5m2)])
def test_fp8_caches_0_14(policy, dtype):
    alloc = allocate("0.14.0", CacheConfig(**LLAMA, quant_policy=policy))
    assert alloc.gpu_cache[0][0].dtype == dtype and len(alloc.gpu_cache[0]) == 2  # per-tensor scales live in the module
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**CUDA, "quant_policy": policy})
    assert layout.format.name == F.NHD and layout.dtype == dtype
    other = 17 if policy == 16 else 16
    with pytest.raises(DetectionError, match=f"quant_policy={other} stores K/V as"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**CUDA, "quant_policy": other})
    with pytest.raises(GeometryError, match="fp8 / TurboQuant are 0.14"):
        allocate("0.12.3", CacheConfig(**LLAMA, quant_policy=policy))


def test_mla_keeps_k_only():
    cfg = CacheConfig(num_layers=4, num_blocks=3, block_size=64, num_kv_heads=1, head_dim=576, k_head_dim=576, v_head_dim=0)
    alloc = allocate("0.9.2", cfg)
    assert tuple(alloc.gpu_cache[0][1].shape) == (3, 64, 1, 0)
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints=CUDA)
    assert layout.format.name == F.MLA and layout.is_mla and layout.kv_size == 1 and layout.head_size == 576
    alloc.gpu_cache[3][0][2, 5, 0, 575] = 3.0
    assert kvcore.gather(layout, torch.tensor([2 * 64 + 5]), layers=3)[0, 0, 575].item() == 3.0
    with pytest.raises(DetectionError, match="v_head_dim=128"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"v_head_dim": 128})


def test_quantised_caches_are_multi_plane():
    for version in ("0.6.2", "0.9.2", "0.11.1", "0.14.0"):
        alloc = allocate(version, CacheConfig(**LLAMA, quant_policy=8))
        k, v, ksz, vsz = alloc.gpu_cache[0]
        assert k.dtype == torch.uint8 and tuple(ksz.shape) == (6, 64, 8, 2) and ksz.dtype == torch.bfloat16
        layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"quant_policy": 8})
        assert layout.format.name == F.QUANT and not layout.classic_staging
        assert layout.staging_shapes(5) == {"K": (3, 5, 1024), "V": (3, 5, 1024), "KSZ": (3, 5, 16), "VSZ": (3, 5, 16)}
        assert [(p.role, p.dtype, p.head_size) for p in layout.planes] == [
            ("K", torch.uint8, 128),
            ("V", torch.uint8, 128),
            ("KSZ", torch.bfloat16, 2),
            ("VSZ", torch.bfloat16, 2),
        ]
    int4 = allocate("0.14.0", CacheConfig(**LLAMA, quant_policy=4))
    layout = kvcore.detect(int4.gpu_cache, engine="lmdeploy", hints={"quant_policy": 4, "head_dim": 128})
    assert layout.head_size == 64  # two 4-bit codes per byte
    with pytest.raises(DetectionError, match="quant_policy 8 stores|holds 64 elements per head, but the head_dim hints say 128"):
        kvcore.detect(int4.gpu_cache, engine="lmdeploy", hints={"quant_policy": 8, "head_dim": 128})
    with pytest.raises(DetectionError, match="quant_policy=42 but the side tensors"):
        kvcore.detect(int4.gpu_cache, engine="lmdeploy", hints={"quant_policy": 42})


def test_turboquant_planes_have_their_own_widths():
    alloc = allocate("0.14.0", CacheConfig(**LLAMA, quant_policy=42))
    k, v, kn, vn = alloc.gpu_cache[0]
    assert (k.shape[-1], v.shape[-1], kn.shape[-1], vn.shape[-1]) == (64, 32, 2, 1)
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy")
    assert layout.format.name == F.TURBO
    assert layout.staging_shapes(2) == {"K": (3, 2, 512), "V": (3, 2, 256), "KN": (3, 2, 16), "VN": (3, 2, 8)}
    v[1, 2, 7, 31] = 0xAB
    vn[1, 2, 7, 0] = 0.25
    st = kvcore.gather(layout, torch.tensor([66]), layers=0)
    assert st["V"][0, 7 * 32 + 31].item() == 0xAB and st["VN"][0, 7].item() == 0.25
    with pytest.raises(GeometryError, match="multiple of 4"):
        allocate("0.14.0", CacheConfig(1, 1, 1, 1, 6, quant_policy=42))


def test_cross_layer_tuple_of_0_9():
    alloc = allocate("0.9.2", CacheConfig(**LLAMA, quant_policy=8))
    layout = kvcore.detect(alloc.full, engine="lmdeploy", hints=CUDA)
    assert layout.format.name == F.X_QUANT and layout.describe().startswith("K: [3, 6, 64, 8, 128]")
    plain = allocate("0.9.2", CacheConfig(**LLAMA))
    layout = kvcore.detect(plain.full, engine="lmdeploy", hints=CUDA)
    assert layout.format.name == F.X_NHD and layout.classic_staging
    plain.full[1][2, 5, 63, 7, 127] = 9.0  # V, layer 2, block 5, token 63, head 7
    assert kvcore.gather(layout, torch.tensor([5 * 64 + 63]))[1, 2, 0, 7 * 128 + 127].item() == 9.0


def test_the_0_11_pool_is_cut_from_the_hints():
    alloc = allocate("0.14.0", CacheConfig(**LLAMA, quant_policy=8, dtype=torch.float16))
    hints = {"num_kv_heads": 8, "head_dim": 128, "block_size": 64, "dtype": "float16", "device_type": "cuda"}
    layout = kvcore.detect(alloc.full, engine="lmdeploy", hints=hints)  # quant_policy read from the pool's size
    assert layout.format.name == F.X_QUANT
    for role, mine in zip(("K", "V", "KSZ", "VSZ"), alloc.caches):
        theirs = layout.kv_caches[role]
        assert theirs.data_ptr() == mine.data_ptr() and theirs.stride() == mine.stride() and theirs.shape == mine.shape
    with pytest.raises(DetectionError, match="pass the hints num_kv_heads, dtype"):
        kvcore.detect(alloc.full, engine="lmdeploy", hints={"head_dim": 128, "block_size": 64})
    with pytest.raises(DetectionError, match="fit no reading"):
        kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "head_dim": 64})


def test_a_pool_whose_size_fits_two_policies_names_quant_policy():
    """bf16 K, V of 16 bytes per block and fp8 K, V of 8 both round up to 256 bytes."""
    cfg = CacheConfig(2, 3, 1, 1, 8)
    assert pool_bytes(cfg) == pool_bytes(CacheConfig(2, 3, 1, 1, 8, quant_policy=16)) == 512
    hints = {"num_kv_heads": 1, "head_dim": 8, "block_size": 1, "dtype": "bfloat16", "device_type": "cuda"}
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(allocate("0.14.0", cfg).full, engine="lmdeploy", hints=hints)
    assert e.value.hints == ["quant_policy"]
    layout = kvcore.detect(allocate("0.14.0", cfg).full, engine="lmdeploy", hints={**hints, "quant_policy": 16})
    assert layout.dtype == torch.float8_e4m3fn


def test_kernel_blocks_of_0_14():
    alloc = allocate("0.14.0", CacheConfig(**LLAMA, kernel_block_size=16))
    assert tuple(alloc.gpu_cache[0][0].shape) == (24, 16, 8, 128)  # 6 manager blocks of 64 = 24 kernel blocks of 16
    layout = kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**CUDA, "block_size": 64})
    assert layout.block_size == 16 and layout.num_blocks == 24
    assert kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**CUDA, "kernel_block_size": 16}).block_size == 16
    with pytest.raises(DetectionError, match="kernel_block_size=32"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={**CUDA, "kernel_block_size": 32})
    with pytest.raises(GeometryError, match="no kernel_block_size"):
        allocate("0.12.3", CacheConfig(**LLAMA, kernel_block_size=16))


def test_a_cache_engine_object_supplies_its_own_hints():
    alloc = allocate("0.9.2", CacheConfig(2, 3, 16, 4, 32, quant_policy=4))
    engine = SimpleNamespace(
        gpu_cache=alloc.gpu_cache,
        cache_config=SimpleNamespace(quant_policy=4, device_type="cuda", block_size=16),
        model_config=SimpleNamespace(dtype=torch.bfloat16, head_dim=32, k_head_dim=None, v_head_dim=None, num_key_value_heads=8),
        world_size=2,
    )
    layout = kvcore.detect(engine, engine="lmdeploy")
    assert layout.format.name == F.QUANT and layout.num_heads == 4 and layout.head_size == 16
    with pytest.raises(DetectionError, match="contradicts the CacheEngine's own quant_policy=4"):
        kvcore.detect(engine, engine="lmdeploy", hints={"quant_policy": 8})


# -- bad inputs: each a clear error, before anything is built or moved ---------------------------------


def _quant_cache():
    return allocate("0.14.0", CacheConfig(2, 3, 4, 2, 16, quant_policy=8))


def test_a_plane_missing():
    alloc = _quant_cache()
    with pytest.raises(DetectionError, match="plane is missing"):
        kvcore.detect([e[:3] for e in alloc.gpu_cache], engine="lmdeploy")
    with pytest.raises(DetectionError, match="scale/zero tensors are missing"):
        kvcore.detect([e[:2] for e in alloc.gpu_cache], engine="lmdeploy", hints=CUDA)
    with pytest.raises(DetectionError, match="a plane is missing"):
        kvcore.detect(
            [e[:2] for e in allocate("0.14.0", CacheConfig(2, 3, 4, 2, 16)).gpu_cache], engine="lmdeploy", hints={"quant_policy": 8}
        )
    with pytest.raises(DetectionError, match="a plane is missing"):
        kvcore.detect(tuple(allocate("0.9.2", CacheConfig(2, 3, 4, 2, 16, quant_policy=8)).full[:3]), engine="lmdeploy")


@pytest.mark.parametrize(("axis", "what"), [(0, "blocks"), (1, "block size"), (2, "heads")])
def test_planes_disagreeing_on_nb_bs_nh(axis, what):
    alloc = _quant_cache()
    entries = []
    for k, v, ksz, vsz in alloc.gpu_cache:
        shape = list(ksz.shape)
        shape[axis] += 1
        entries.append((k, v, torch.zeros(shape, dtype=ksz.dtype), vsz))
    with pytest.raises(DetectionError, match=r"the planes disagree on blocks, block size or heads \(K \(3, 4, 2\), V \(3, 4, 2\), KSZ"):
        kvcore.detect(entries, engine="lmdeploy")
    # given straight to the core, the same planes are a GeometryError naming the axis
    kv = {"K": [e[0] for e in entries], "V": [e[1] for e in entries], "KSZ": [e[2] for e in entries], "VSZ": [e[3] for e in entries]}
    with pytest.raises(GeometryError, match="planes disagree"):
        kvcore.build_layout(F.QUANT, kv)


def test_layers_that_differ_and_hints_that_contradict():
    alloc = _quant_cache()
    bad = list(alloc.gpu_cache)
    bad[1] = (bad[1][0], bad[1][1], bad[1][2].float(), bad[1][3])
    with pytest.raises(DetectionError, match="tensor 2 of the per-layer tuple of layer 1"):
        kvcore.detect(bad, engine="lmdeploy")
    with pytest.raises(DetectionError, match="hint dtype=torch.float16 but the scale/zero tensors are torch.bfloat16"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"dtype": "float16"})
    with pytest.raises(DetectionError, match="does not quantise"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"device_type": "camb"})
    with pytest.raises(DetectionError, match="quant_policy 7 is not one of"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"quant_policy": 7})
    with pytest.raises(DetectionError, match="Accepted hints"):
        kvcore.detect(alloc.gpu_cache, engine="lmdeploy", hints={"kv_cache_layout": "NHD"})
    with pytest.raises(DetectionError, match="custom per-model caches"):
        kvcore.detect([(*e, e[2]) for e in alloc.gpu_cache], engine="lmdeploy")
    permuted = [tuple(t.transpose(1, 2) for t in e) for e in allocate("0.9.2", CacheConfig(2, 3, 4, 2, 16)).gpu_cache]
    with pytest.raises(DetectionError, match="memory order is not its axis order"):
        kvcore.detect(permuted, engine="lmdeploy", hints=CUDA)


def test_other_engines_are_not_answered():
    alloc = allocate("0.9.2", CacheConfig(2, 3, 4, 2, 16))
    for engine in ("vllm", "sglang", "turbomind", "LMDeploy"):
        assert plugin.kvcore_detect(kv_caches=alloc.gpu_cache, engine=engine, hints={}) is None


def test_hints_are_declared():
    names = {h.name for _, h in kvcore.hints("lmdeploy")}
    assert {"quant_policy", "device_type", "block_size", "kernel_block_size", "num_kv_heads", "head_dim", "dtype", "tensor_order"} <= names
