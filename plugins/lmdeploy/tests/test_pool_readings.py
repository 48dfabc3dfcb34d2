"""The 0.11+ memory pool carries no geometry: every (quant_policy, kernel block) the hints
allow is a reading, and detection must return the one reading that fills the pool's bytes
per block or name the hints that decide -- never pick one by size arithmetic.

The oracle is :func:`kvcore_lmdeploy.allocation.pool_bytes` (LMDeploy's own slicing,
repeated from ``CacheEngine.allocate_caches``), not the detector's plan."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.allocation import CacheConfig, allocate, pool_bytes

import kvcore
from kvcore import AmbiguousLayoutError, DetectionError, GeometryError

_DNAME = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _kernel_choices(version: str, block_size: int) -> list[int]:
    """Tokens per allocated block LMDeploy ``version`` may use with ``block_size``
    (0.14.0 PytorchEngineConfig.__post_init__: a power of 2 >= 16 dividing block_size)."""
    if version != "0.14.0":
        return [block_size]
    return [k for k in (16, 32, 64, 128) if k <= block_size and block_size % k == 0]


def _readings(cfg: CacheConfig, policies: list[int], kernels: list[int]) -> set[tuple[int, int]]:
    """Every (policy, kernel block) whose pool rows are as many bytes as ``cfg``'s."""
    want = pool_bytes(cfg)
    out = set()
    for p, kb in itertools.product(policies, kernels):
        try:
            c = CacheConfig(**{**cfg.__dict__, "quant_policy": p, "kernel_block_size": kb})
            if pool_bytes(c) == want:
                out.add((p, kb))
        except GeometryError:  # int4 of an odd head size, ...
            continue
    return out


def _cases():
    for version, bs, hd, nh, dt, policy in itertools.product(
        ("0.12.3", "0.14.0"), (16, 32, 64), (8, 16, 64), (1, 2), (torch.float16, torch.float32), (0, 4, 8, 16, 42)
    ):
        for kb in _kernel_choices(version, bs):
            if policy in (16, 42) and version != "0.14.0":
                continue
            yield (
                version,
                CacheConfig(
                    num_layers=2,
                    num_blocks=3,
                    block_size=bs,
                    num_kv_heads=nh,
                    head_dim=hd,
                    dtype=dt,
                    quant_policy=policy,
                    kernel_block_size=kb if version == "0.14.0" else None,
                ),
            )


def _same_planes(layout: kvcore.KVLayout, caches: list[torch.Tensor]) -> bool:
    got = list(layout.kv_caches.values())
    return len(got) == len(caches) and all(
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype for a, b in zip(got, caches)
    )


def test_every_pool_reading_is_the_allocation_or_an_ambiguity_naming_the_deciding_hints():
    """Over versions, block sizes, head sizes, head counts, model dtypes, policies and kernel
    blocks: with the manager's block_size only, the answer is LMDeploy's own slicing when
    one (policy, kernel block) fills the row, else AmbiguousLayoutError naming exactly the
    hints whose values differ between the fitting readings."""
    seen_ambiguous = {"quant_policy": 0, "kernel_block_size": 0}
    n = 0
    for version, cfg in _cases():
        alloc = allocate(version, cfg)
        base = {"device_type": "cuda", "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "dtype": _DNAME[cfg.dtype]}
        every_kernel = _kernel_choices("0.14.0", cfg.block_size)  # without the version: any 0.14 kernel block
        every_policy = [0, 4, 8, 16, 17, 42]
        versioned = every_policy if version == "0.14.0" else [0, 4, 8]
        for given, policies, kernels in (
            ({"quant_policy": cfg.quant_policy}, [cfg.quant_policy], every_kernel),
            ({}, every_policy, every_kernel),
            ({"lmdeploy_version": version}, versioned, _kernel_choices(version, cfg.block_size)),
        ):
            hints = {**base, "block_size": cfg.block_size, **given}
            fits = _readings(cfg, policies, kernels)
            assert (cfg.quant_policy, cfg.kernel_block) in fits
            n += 1
            if len(fits) == 1:
                layout = kvcore.detect(alloc.full, engine="lmdeploy", hints=hints)
                assert _same_planes(layout, alloc.caches), (version, cfg, hints)
                assert layout.block_size == cfg.kernel_block
                assert layout.num_blocks == cfg.num_blocks * cfg.block_size // cfg.kernel_block
                continue
            with pytest.raises(AmbiguousLayoutError) as e:
                kvcore.detect(alloc.full, engine="lmdeploy", hints=hints)
            want = [h for h, i in (("quant_policy", 0), ("kernel_block_size", 1)) if len({f[i] for f in fits}) > 1]
            assert sorted(e.value.hints) == sorted(want), (version, cfg, hints, fits, e.value.hints)
            for h in want:
                seen_ambiguous[h] += 1
            # the deciding hints given: the allocation, exactly
            full = {**hints, "quant_policy": cfg.quant_policy, "kernel_block_size": cfg.kernel_block}
            layout = kvcore.detect(alloc.full, engine="lmdeploy", hints=full)
            assert _same_planes(layout, alloc.caches), (version, cfg, full)
    assert n > 1000 and seen_ambiguous["quant_policy"] > 20 and seen_ambiguous["kernel_block_size"] > 20


def test_int8_in_16_token_kernel_blocks_is_not_read_as_int4_in_32():
    """The reviewers' case: int8 with 16-token kernel blocks and int4 with 32-token blocks
    fill 1536 bytes per row alike (K 512 + V 512 + two 256-byte-aligned scale/zero slices)."""
    cfg = CacheConfig(
        num_layers=1,
        num_blocks=5,
        block_size=32,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float16,
        quant_policy=8,
        kernel_block_size=16,
    )
    alloc = allocate("0.14.0", cfg)
    assert tuple(alloc.full.shape) == (1, 10, 1536)
    hints = {"device_type": "cuda", "num_kv_heads": 2, "head_dim": 16, "block_size": 32, "dtype": "float16"}
    with pytest.raises(AmbiguousLayoutError) as e:
        kvcore.detect(alloc.full, engine="lmdeploy", hints=hints)
    assert sorted(e.value.hints) == ["kernel_block_size", "quant_policy"]
    assert "quant_policy=4, kernel_block_size=32" in str(e.value) and "quant_policy=8, kernel_block_size=16" in str(e.value)
    # either hint decides; block_size=32 is the manager's block, a multiple of the kernel block
    for extra in ({"quant_policy": 8}, {"kernel_block_size": 16}):
        layout = kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, **extra})
        assert layout.format.name == F.X_QUANT and _same_planes(layout, alloc.caches)
        assert (layout.block_size, layout.num_blocks, layout.head_size) == (16, 10, 16)
    # a byte written where LMDeploy's kernel puts manager block 1, token 21, head 1, element 7:
    # kernel block 1 * 2 + 21 // 16 = 3, token 21 % 16 = 5 -- slot 53 either way
    k = alloc.caches[0]
    k.zero_()
    k[0, 3, 5, 1, 7] = 201
    staged = kvcore.gather(layout, torch.tensor([53, 52]))
    assert staged["K"][0, 0, 1 * 16 + 7].item() == 201 and int(staged["K"].count_nonzero()) == 1
    # the wrong reading (int4, 32-token blocks) would have found it at slot 3 * 32 + 5 * ...: not here
    assert int(kvcore.gather(layout, torch.tensor([3 * 32 + 5]))["K"].count_nonzero()) == 0


def test_the_version_and_kernel_hints_narrow_the_pool_readings():
    cfg = CacheConfig(num_layers=1, num_blocks=5, block_size=32, num_kv_heads=2, head_dim=16, dtype=torch.float16, quant_policy=4)
    hints = {"device_type": "cuda", "num_kv_heads": 2, "head_dim": 16, "block_size": 32, "dtype": "float16"}
    alloc = allocate("0.12.3", cfg)  # before 0.14 the allocated block is block_size: int4 is the one reading
    with pytest.raises(AmbiguousLayoutError):
        kvcore.detect(alloc.full, engine="lmdeploy", hints=hints)
    layout = kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "lmdeploy_version": "0.12.3"})
    assert _same_planes(layout, alloc.caches) and layout.block_size == 32 and layout.head_size == 8
    with pytest.raises(DetectionError, match="memory pool of 0.11"):
        kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "lmdeploy_version": "0.9.2"})
    with pytest.raises(DetectionError, match="quant_policy=16 is 0.14"):
        kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "lmdeploy_version": "0.12.3", "quant_policy": 16})
    for kb in (24, 8, 64):  # not a power of 2 >= 16 dividing 32
        with pytest.raises(DetectionError, match=f"block_size=32 and kernel_block_size={kb} disagree"):
            kvcore.detect(alloc.full, engine="lmdeploy", hints={**hints, "kernel_block_size": kb})
    with pytest.raises(GeometryError, match="sets both to 16 on camb"):
        allocate("0.14.0", CacheConfig(1, 5, 32, 2, 16, device_type="camb", kernel_block_size=16))
