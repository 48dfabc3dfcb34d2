"""vLLM CPU_ATTN's own cache writer is the oracle: kvcore gathers what it wrote, and scatters
the bytes it would have written.

``vllm._custom_ops.cpu_attn_reshape_and_cache`` (``csrc/cpu/cpu_attn.cpp``, per kernel path
``cpu_attn_vec.hpp`` / ``cpu_attn_amx.hpp``) writes given K/V rows into given slots of a cache
allocated as vLLM allocates it; kvcore detects that cache from the facts vLLM holds (version,
backend, kernel path, dtypes) and must

* gather, at those slots, exactly the rows the writer received (fp8: the bytes of values fp8
  represents exactly, so vLLM's truncating conversion and torch's rounding agree), and
* scatter the same rows into a zeroed cache that is then byte-identical to the writer's.

Runs inside an engine virtualenv (``scripts/engine_envs.py``); the kernel paths are those this
CPU can run (``amx`` needs AMX tiles).
"""

from __future__ import annotations

import pytest
import torch

import kvcore

from .harness import VERSION, vllm

ops = pytest.importorskip("vllm._custom_ops")

AMX = torch.cpu._is_amx_tile_supported()
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: 0.24-0.28 allow blocks of 16 (``get_supported_kernel_block_sizes() == [MultipleOf(16)]``), 0.29+ of 32
MIN_BLOCK = 32 if VERSION >= (0, 29) else 16


def _isas() -> list[str]:
    return (["amx"] if AMX else []) + ["vec", "vec16"]


def _cases():
    for isa in _isas():
        dtypes = [torch.bfloat16] if isa == "amx" else [torch.bfloat16, torch.float16, torch.float32]
        for dtype in dtypes:
            for cache_dtype in ["auto", "fp8_e4m3", "fp8_e5m2"]:
                if cache_dtype != "auto" and (isa == "vec16" or dtype == torch.float16):
                    continue  # vLLM: FP8 KV cache only on the x86 AMX / VEC paths
                for bs, nh, hs in [(32, 2, 64), (64, 1, 128), (128, 8, 32), (32, 4, 256)]:
                    yield pytest.param(isa, dtype, cache_dtype, bs, nh, hs, id=f"{isa}-{str(dtype)[6:]}-{cache_dtype}-bs{bs}-nh{nh}-hs{hs}")
    for hs in (80, 96, 112, 160):  # head sizes vLLM sends to vec16 (0.26+: head_size % 32 != 0) or that AMX would not take
        yield pytest.param("vec16", torch.bfloat16, "auto", 32, 2, hs, id=f"vec16-bfloat16-auto-bs32-nh2-hs{hs}")
    if MIN_BLOCK == 16:
        yield pytest.param("vec16", torch.bfloat16, "auto", 16, 2, 64, id="vec16-bfloat16-auto-bs16-nh2-hs64")


def _allocate(num_layers: int, nb: int, nh: int, bs: int, hs: int, dtype: torch.dtype, cache_dtype: str) -> list[torch.Tensor]:
    """One tensor per layer, as vLLM's CPU runner hands them out: ``CPUAttentionBackend``'s
    ``[NB, NH, BS, 2*HS]`` (0.24+), fp8 caches in uint8 (``STR_DTYPE_TO_TORCH_DTYPE``)."""
    store = torch.uint8 if cache_dtype != "auto" else dtype
    flat = torch.zeros(num_layers * nb * nh * bs * 2 * hs, dtype=store)
    return list(flat.view(num_layers, nb, nh, bs, 2 * hs).unbind(0))


def _write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, isa: str, cache_dtype: str) -> None:
    nb, nh, bs, _ = cache.shape
    key_cache, value_cache = cache.view(nb, nh, 2 * bs, -1).chunk(2, dim=2)  # cpu_attn.py's container
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, kv_cache_dtype=cache_dtype)


def _rows(t: int, nh: int, hs: int, dtype: torch.dtype, cache_dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if cache_dtype == "auto":
        return torch.randn((t, nh, hs), generator=g).to(dtype)
    # values fp8 represents exactly (every fp8 byte but NaN/inf), so any rounding agrees; vLLM's
    # conversion writes -0.0 as +0.0 (cpu_attn_vec.hpp's fp8 store), so no negative zero either
    fdt = FP8[cache_dtype]
    codes = torch.randint(0, 256, (t, nh, hs), generator=g, dtype=torch.uint8)
    vals = codes.view(fdt).float()
    vals = torch.where(torch.isfinite(vals), vals, torch.zeros_like(vals)) + 0.0
    return vals.to(dtype)


def _slots(nb: int, bs: int, t: int, seed: int) -> torch.Tensor:
    """``t`` distinct slots over the cache, a request's run of consecutive slots (a partial
    last block) first, then scattered ones; two engine padding slots (-1)."""
    g = torch.Generator().manual_seed(seed)
    run = torch.arange(bs + 3, bs + 3 + min(t // 2, (nb - 2) * bs))
    rest = torch.randperm(nb * bs, generator=g)
    rest = rest[~torch.isin(rest, run)][: t - len(run)]
    s = torch.cat([run, rest])
    s[[1, -2]] = -1
    return s


def _hints(isa: str, dtype: torch.dtype, cache_dtype: str) -> dict:
    return {
        "vllm_version": vllm.__version__,
        "device_type": "cpu",
        "attention_backend": "CPU_ATTN",
        "cpu_attn_isa": isa,
        "dtype": dtype,
        "cache_dtype": cache_dtype,
    }


@pytest.mark.parametrize("isa, dtype, cache_dtype, bs, nh, hs", list(_cases()))
def test_gather_returns_what_vllm_wrote_and_scatter_writes_what_vllm_would(isa, dtype, cache_dtype, bs, nh, hs):
    nl, nb, t = 2, 6, 70
    caches = _allocate(nl, nb, nh, bs, hs, dtype, cache_dtype)
    slots = _slots(nb, bs, t, seed=bs + hs)
    ks = [_rows(t, nh, hs, dtype, cache_dtype, seed=10 * i + 1) for i in range(nl)]
    vs = [_rows(t, nh, hs, dtype, cache_dtype, seed=10 * i + 2) for i in range(nl)]
    for c, k, v in zip(caches, ks, vs):
        _write(c, k, v, slots, isa, cache_dtype)

    layout = kvcore.detect(caches, engine="vllm", hints=_hints(isa, dtype, cache_dtype))
    got = kvcore.gather(layout, slots)
    valid = slots >= 0
    elem = FP8[cache_dtype] if cache_dtype != "auto" else dtype
    for i in range(nl):
        for kv, rows in ((0, ks[i]), (1, vs[i])):
            want = rows[valid].to(elem).reshape(int(valid.sum()), nh * hs)
            have = got[kv, i][valid].view(elem) if got.dtype != elem else got[kv, i][valid]
            wrong = (have.view(torch.uint8) != want.view(torch.uint8)).reshape(len(want), -1).any(-1)
            assert not wrong.any(), f"{'KV'[kv]} of layer {i}: {int(wrong.sum())} of {len(want)} rows differ from what vLLM wrote"

    fresh = _allocate(nl, nb, nh, bs, hs, dtype, cache_dtype)
    target = kvcore.detect(fresh, engine="vllm", hints=_hints(isa, dtype, cache_dtype))
    kvcore.scatter(target, slots, got)
    for i in range(nl):
        assert torch.equal(fresh[i].view(torch.uint8), caches[i].view(torch.uint8)), f"layer {i}: scatter's bytes differ from vLLM's writer"


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles: vLLM would never choose the amx path here")
def test_bfloat16_cache_without_the_kernel_path_is_ambiguous_naming_it():
    caches = _allocate(2, 4, 2, 32, 64, torch.bfloat16, "auto")
    hints = _hints("amx", torch.bfloat16, "auto")
    del hints["cpu_attn_isa"]
    with pytest.raises(kvcore.AmbiguousLayoutError) as e:
        kvcore.detect(caches, engine="vllm", hints=hints)
    assert "cpu_attn_isa" in str(e.value)


@pytest.mark.parametrize("dtype, hs", [(torch.float32, 64), (torch.float16, 64), (torch.float16, 80)])
def test_caches_no_tiled_path_can_have_written_need_no_kernel_path(dtype, hs):
    # vLLM chooses AMX (x86) or NEON BFMMLA tiles (Arm) only for a bfloat16 model: any other dtype is column-major K
    caches = _allocate(2, 4, 2, 32, hs, dtype, "auto")
    hints = _hints("vec", dtype, "auto")
    del hints["cpu_attn_isa"]
    layout = kvcore.detect(caches, engine="vllm", hints=hints)
    assert layout.format.name == "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"


def test_bfloat16_cache_amx_cannot_have_written_still_names_the_kernel_path():
    # head size 80: not AMX, but on an Arm host vLLM 0.31+ packs bfloat16 in NEON BFMMLA tiles kvcore does not read
    caches = _allocate(2, 4, 2, 32, 80, torch.bfloat16, "auto")
    hints = _hints("vec16", torch.bfloat16, "auto")
    del hints["cpu_attn_isa"]
    with pytest.raises(kvcore.AmbiguousLayoutError, match="cpu_attn_isa") as e:
        kvcore.detect(caches, engine="vllm", hints=hints)
    assert "BFMMLA" in str(e.value)
    layout = kvcore.detect(caches, engine="vllm", hints={**hints, "cpu_attn_isa": "vec16"})
    assert layout.format.name == "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
