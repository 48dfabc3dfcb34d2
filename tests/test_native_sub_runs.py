"""The native CPU kernel on planes whose head has a second strided element level
(``PlaneStrides.n_sub > 1``: chunks of strided sub-runs), byte for byte against the torch
reference kernel, and on vLLM CPU's AMX cache against the engine's own addressing.

Engine fact (vLLM 0.24-0.32, ``csrc/cpu/cpu_attn_amx.hpp``, ``reshape_and_cache`` of the AMX
path; ``/work/shared/reference``): per (block, kv head) K is packed in VNNI tiles
``[BS/16, HS/2, 16, 2]`` (token ``o``, element ``e`` at ``((o // 16) * HS/2 + e // 2) * 32 +
(o % 16) * 2 + e % 2``) and V in tiles ``[HS/16, BS/2, 16, 2]`` (element ``e`` of token ``o``
at ``((e // 16) * BS/2 + o // 2) * 32 + (e % 16) * 2 + o % 2``): a token's 16 elements of
one V chunk lie two elements apart, the second strided level.

The hand-built tables put a plane's axes (blocks, tokens or token groups, heads, chunks,
sub-runs, and a contiguous innermost run) in a random physical order, so the strides are
whatever torch gives that order; slot mappings run across blocks, start and stop mid-block,
and carry padding (-1) slots.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import kvcore
from kvcore.kernels import TransferPlan, _build
from kvcore.kernels.native import CPU_KERNEL, CUDA_KERNEL
from kvcore.kernels.reference import REFERENCE
from kvcore.spec import Plane, PlaneStrides, StagingBuffer, StagingTarget, StrideTable

DTYPES = [torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.fixture
def native():
    if _build.disabled():
        pytest.skip("KVCORE_NATIVE=0")
    assert CPU_KERNEL.available(), CPU_KERNEL.why()
    return CPU_KERNEL


def _esz(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


def sub_run_table(seed: int, device: str = "cpu") -> tuple[StrideTable, list[torch.Tensor], random.Random]:
    """One or two planes over fresh random bytes, each head ``n_chunks x n_sub x run``
    elements with the chunk and sub-run axes strided (n_sub >= 2); the same seed builds the
    same bytes."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    nl, nb = rng.randint(1, 3), rng.randint(2, 5)
    bs = rng.choice([1, 2, 3, 4, 6, 8, 16, 32])
    planes, buffers, tensors = [], [], []
    for i in range(rng.randint(1, 2)):
        dt = rng.choice(DTYPES)
        esz = _esz(dt)
        nh = rng.randint(1, 3)
        nc, ns, run = rng.choice([1, 2, 3, 4]), rng.choice([2, 3, 4, 16]), rng.choice([1, 1, 2, 3])
        group = rng.choice([0, 0] + [x for x in (1, 2, 4, 16) if bs % x == 0 and x < bs])
        axes = [("NB", nb), ("NH", nh), ("HSC", nc), ("HSS", ns)]
        axes += [("BSC", bs // group), ("BSE", group)] if group else [("BS", bs)]
        rng.shuffle(axes)
        axes.append(("RUN", run))  # the contiguous innermost run of elements (or one element)
        shape = [n for _, n in axes]
        numel = 1
        for n in shape:
            numel *= n
        layers = [torch.randint(0, 256, (numel * esz,), dtype=torch.uint8, generator=g).to(device).view(dt).view(*shape) for _ in range(nl)]
        st = {name: int(layers[0].stride(k)) * esz for k, (name, _) in enumerate(axes)}
        token, tg, tgs = (st["BSE"], group, st["BSC"]) if group else (st["BS"], 0, 0)
        ps = PlaneStrides(
            block=st["NB"],
            token=token,
            head=st["NH"],
            chunk=st["HSC"],
            chunk_bytes=run * esz,
            n_chunks=nc,
            token_group=tg,
            token_group_stride=tgs,
            sub=st["HSS"],
            n_sub=ns,
        )
        hb = nc * ns * run * esz
        role = f"P{i}"
        planes.append(
            Plane(
                role=role,
                strides=ps,
                num_heads=nh,
                head_bytes=hb,
                dtype=dt,
                bases=tuple((t, t.storage_offset() * esz) for t in layers),
                staging=StagingTarget(buffer=role, index=None, offset=0, head_stride=hb),
            )
        )
        buffers.append(StagingBuffer(key=role, kv_size=None, row_bytes=nh * hb, dtype=dt))
        tensors += layers
    table = StrideTable(
        num_layers=nl,
        block_size=bs,
        num_slots=nb * bs,
        device=torch.device(device),
        planes=tuple(planes),
        buffers=tuple(buffers),
    )
    return table, tensors, rng


def _slots(rng: random.Random, table: StrideTable, *, scatter: bool) -> torch.Tensor:
    """Runs of consecutive slots (starting and stopping mid-block, across blocks), single
    slots and -1 padding; no slot twice for a scatter."""
    n, bs = table.num_slots, table.block_size
    out: list[int] = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.random()
        if kind < 0.6:
            a = rng.randrange(n)
            out += range(a, min(n, a + rng.randint(1, 3 * bs)))
        elif kind < 0.8:
            out.append(rng.randrange(n))
        else:
            out += [-1] * rng.randint(1, 2)
    if scatter:
        seen: set[int] = set()
        out = [s if s < 0 or s not in seen and not seen.add(s) else -1 for s in out]
    return torch.tensor(out, dtype=torch.int64)


def _buffers(table: StrideTable, t: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for b in table.buffers:
        x = torch.empty(b.shape(table.num_layers, t), dtype=b.dtype)
        x.view(torch.uint8).copy_(torch.randint(0, 256, x.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
        out[b.key] = x.to(table.device)
    return out


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check_against_reference(seed: int, device: str = "cpu") -> None:
    kernel = CPU_KERNEL if device == "cpu" else CUDA_KERNEL
    table, tensors, rng = sub_run_table(seed, device)
    assert any(p.strides.n_sub > 1 for p in table.planes) and kernel.supports(table)
    g = torch.Generator().manual_seed(seed)
    slots = _slots(rng, table, scatter=False).to(device)
    nv = int((slots >= 0).sum())
    a = _buffers(table, len(slots), g)
    b = {k: v.clone() for k, v in a.items()}
    kernel.gather(TransferPlan(table, slots, a, nv))
    REFERENCE.gather(TransferPlan(table, slots, b, nv))
    for key in a:
        assert torch.equal(_u8(a[key]), _u8(b[key])), (seed, key, table)
    # scatter: two identical caches, every byte of every layer tensor
    slots = _slots(rng, table, scatter=True).to(device)
    nv = int((slots >= 0).sum())
    t2, tensors2, _ = sub_run_table(seed, device)
    src = _buffers(table, len(slots), g)
    kernel.scatter(TransferPlan(table, slots, src, nv))
    REFERENCE.scatter(TransferPlan(t2, slots, src, nv))
    for x, y in zip(tensors, tensors2):
        assert torch.equal(_u8(x), _u8(y)), (seed, table)


@pytest.mark.parametrize("seed", range(60))
def test_sub_run_planes_match_the_reference(seed, native):
    check_against_reference(seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.py runs it)")
@pytest.mark.parametrize("seed", range(60))
def test_sub_run_planes_match_the_reference_on_cuda(seed):
    """The CUDA kernel's (chunk, sub-run) addressing, byte for byte against the reference."""
    if not CUDA_KERNEL.available():
        pytest.fail(f"native CUDA kernel unavailable: {CUDA_KERNEL.why()}")
    check_against_reference(seed, "cuda")
    torch.cuda.synchronize()


@pytest.fixture
def every_thread():
    """The native CPU kernel's grain forced to one byte: every transfer split over all threads
    (runs of tokens cut where a thread's rows end)."""
    from kvcore.kernels.native import _ops

    mod = _ops()
    if mod is None or torch.get_num_threads() < 2:
        pytest.skip("no native op, or one thread")
    old = mod.cpu_grain()
    mod.set_cpu_grain(1)
    yield
    mod.set_cpu_grain(old)


@pytest.mark.parametrize("seed", range(200, 215))
def test_sub_run_planes_split_over_threads_match_the_reference(seed, native, every_thread):
    check_against_reference(seed)


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "25")), deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**31 - 1))
    def test_random_sub_run_planes_match_the_reference(seed):
        if _build.disabled():
            pytest.skip("KVCORE_NATIVE=0")
        check_against_reference(seed)


# -- vLLM CPU_AMX: the engine's addressing, the native kernel chosen ---------------------------

AMX = "K=NL_X_NB_NH_BSC_HSC_BSE_HSE+V=NL_X_NB_NH_HSC_BSC_HSE_BSE"
NL, NB = 2, 5


def _amx_offsets(bs: int, hs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[BS, HS]`` element offsets of K's and V's (token o, element e) inside their half of
    one (block, head) (vLLM ``cpu_attn_amx.hpp``)."""
    o = torch.arange(bs)[:, None]
    e = torch.arange(hs)[None, :]
    k = ((o // 16) * (hs // 2) + e // 2) * 32 + (o % 16) * 2 + e % 2
    v = ((e // 16) * (bs // 2) + o // 2) * 32 + (e % 16) * 2 + o % 2
    return k, v


def _amx_cache(dt: torch.dtype, bs: int, nh: int, hs: int, seed: int) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Per layer one container ``[NB, NH, 2 * BS * HS]`` (K half, then V half per block and
    head, as vLLM's CPU backend allocates it), and the two planes as views of it."""
    g = torch.Generator().manual_seed(seed)
    raw = [torch.randint(0, 256, (NB, nh, 2 * bs * hs * _esz(dt)), dtype=torch.uint8, generator=g).view(dt) for _ in range(NL)]
    half = bs * hs
    views = {
        "K": [t[:, :, :half].unflatten(2, (bs // 16, hs // 2, 16, 2)) for t in raw],
        "V": [t[:, :, half:].unflatten(2, (hs // 16, bs // 2, 16, 2)) for t in raw],
    }
    return raw, views


@pytest.mark.parametrize("hs", [64, 128, 96])
@pytest.mark.parametrize("bs", [32, 64])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_vllm_cpu_amx_moves_natively_as_the_engine_addresses_it(dt, bs, hs, native, monkeypatch):
    nh = 3
    raw, views = _amx_cache(dt, bs, nh, hs, seed=bs + hs)
    lay = kvcore.build_layout(AMX, views)
    # chosen on its own (nothing forced), and a sub-run plane among its planes
    monkeypatch.delenv("KVCORE_KERNEL", raising=False)
    plan = kvcore.plan(lay)
    assert plan.kernel is native
    assert [p.strides.n_sub for p in plan.table.planes] == [1, 16]
    koff, voff = _amx_offsets(bs, hs)
    half = bs * hs
    slots = list(range(3 * bs + 5, 4 * bs)) + [-1] + list(range(bs, bs + 19)) + [2 * bs + 7] + list(range(4 * bs, 4 * bs + bs // 2 + 1))
    st = torch.tensor(slots)
    out = kvcore.gather(lay, st)
    for li in range(NL):
        for i, s in enumerate(slots):
            if s < 0:
                continue
            b, o = divmod(s, bs)
            k = raw[li][b][:, koff[o]].reshape(-1)
            v = raw[li][b][:, half + voff[o]].reshape(-1)
            assert torch.equal(_u8(out[0, li, i]), _u8(k)), (li, s)
            assert torch.equal(_u8(out[1, li, i]), _u8(v)), (li, s)
    # scatter: exactly the slots' bytes change, where the engine's addressing puts them
    src = torch.randint(0, 256, _u8(out).shape, dtype=torch.uint8).view(dt).view(out.shape)
    want = [t.clone() for t in raw]
    for li in range(NL):
        for i, s in enumerate(slots):
            if s >= 0:
                b, o = divmod(s, bs)
                want[li][b][:, koff[o]] = src[0, li, i].view(nh, hs)
                want[li][b][:, half + voff[o]] = src[1, li, i].view(nh, hs)
    kvcore.scatter(lay, st, src)
    for li in range(NL):
        assert torch.equal(_u8(raw[li]), _u8(want[li])), li
