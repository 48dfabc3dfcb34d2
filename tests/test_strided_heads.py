"""Planes whose head elements are not one contiguous run, through the native CPU kernel,
checked byte for byte against plain torch indexing of the engine's addressing.

The engine fact (``/work/shared/reference/engine_layouts.md`` §1.9): vLLM's CPU attention
(0.13, 0.24-0.32; ``csrc/cpu/cpu_attn_vec.hpp``, ``AttentionImpl<ISA::VEC>::reshape_and_cache``,
"reshape K as column-major and V as row-major"; vec16 and fp8 inherit it) stores, inside
each layer tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (only a
container), per (block, head): K as ``[head_size, block_size]`` — element ``e`` of token
``o`` at ``e * BS + o`` — then V as ``[block_size, head_size]``. Its AMX path (bf16,
``block_size % 32 == 0``) packs K in VNNI tiles ``[BS/16, HS/2, 16, 2]`` (token ``o``,
element ``e`` at ``((o // 16) * HS/2 + e // 2) * 32 + (o % 16) * 2 + e % 2``); its V is not
modelled here (V row-major stands beside it).

The oracle never goes through kvcore's stride table: the expected staged row of slot
``b * BS + o`` is read from the layer tensor with torch indexing at exactly those element
offsets, and a scatter's expected cache is written the same way into a copy. Head sizes are
the ones vLLM's CPU backend accepts (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512: the
vec16 ISA serves ``head_size % 32 != 0``); block sizes are multiples of 32 (vLLM's CPU
kernel block). Slot mappings run across blocks, start and stop mid-block (runs of every
length, full 16-byte tiles and their tails), skip padding slots, and permute slots at random.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.kernels import _build

pytestmark = pytest.mark.usefixtures("core_only")

KT = "K=NL_X_NB_NH_HS_BS+V=NL_X_NB_NH_BS_HS"
KTILE = "K=NL_X_NB_NH_BSC_HSC_BSE_HSE+V=NL_X_NB_NH_BS_HS"
NL, NB, NH = 2, 6, 2


@pytest.fixture
def native_cpu(monkeypatch):
    """The native CPU kernel, forced (a transfer it cannot serve would raise, not fall back)."""
    from kvcore.kernels.native import CPU_KERNEL

    if _build.disabled():
        pytest.skip("KVCORE_NATIVE=0")
    assert CPU_KERNEL.available(), CPU_KERNEL.why()
    monkeypatch.setenv("KVCORE_KERNEL", CPU_KERNEL.name)
    return CPU_KERNEL


def _esz(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


def _raw(dt: torch.dtype, bs: int, hs: int, seed: int) -> list[torch.Tensor]:
    """Per layer the engine's container ``[NB, NH, BS, 2 * HS]`` of ``dt``, random bytes."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NB, NH, bs, 2 * hs * _esz(dt)), dtype=torch.uint8, generator=g).view(dt).view(NB, NH, bs, 2 * hs)
        for _ in range(NL)
    ]


def _k_offsets(fmt: str, bs: int, hs: int) -> torch.Tensor:
    """``[BS, HS]``: element offset of K's (token o, element e) inside its (block, head)."""
    o = torch.arange(bs)[:, None]
    e = torch.arange(hs)[None, :]
    if fmt == KT:
        return e * bs + o
    return ((o // 16) * (hs // 2) + e // 2) * 32 + (o % 16) * 2 + e % 2


def _v_offsets(bs: int, hs: int) -> torch.Tensor:
    o = torch.arange(bs)[:, None]
    e = torch.arange(hs)[None, :]
    return bs * hs + o * hs + e


def _views(fmt: str, raw: list[torch.Tensor], bs: int, hs: int) -> dict[str, list[torch.Tensor]]:
    """The two planes as views of each layer's container (what an integration hands kvcore)."""
    k_axes = (hs, bs) if fmt == KT else (bs // 16, hs // 2, 16, 2)
    out: dict[str, list[torch.Tensor]] = {"K": [], "V": []}
    for t in raw:
        flat = t.view(NB, NH, 2 * bs * hs)
        out["K"].append(flat[:, :, : bs * hs].unflatten(2, k_axes))
        out["V"].append(flat[:, :, bs * hs :].unflatten(2, (bs, hs)))
    return out


def _engine_rows(fmt: str, raw: torch.Tensor, slot: int, bs: int, hs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one slot of one layer, ``[NH * HS]`` each, by the engine's addressing."""
    b, o = divmod(slot, bs)
    flat = raw.view(NB, NH, 2 * bs * hs)[b]  # [NH, 2*BS*HS]
    return flat[:, _k_offsets(fmt, bs, hs)[o]].reshape(-1), flat[:, _v_offsets(bs, hs)[o]].reshape(-1)


def _write_engine_rows(fmt: str, raw: torch.Tensor, slot: int, bs: int, hs: int, k: torch.Tensor, v: torch.Tensor) -> None:
    b, o = divmod(slot, bs)
    flat = raw.view(NB, NH, 2 * bs * hs)[b]
    flat[:, _k_offsets(fmt, bs, hs)[o]] = k.view(NH, hs)
    flat[:, _v_offsets(bs, hs)[o]] = v.view(NH, hs)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _slot_patterns(bs: int, seed: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    n = NB * bs
    # a request's consecutive slots over blocks 4, 1, 3 starting mid-block, a padding slot, a
    # lone slot, the rest of block 0 from offset 9, and a run that stops mid-block
    runs = list(range(4 * bs + 5, 5 * bs)) + list(range(1 * bs, 2 * bs)) + list(range(3 * bs, 3 * bs + 19))
    runs += [-1, 2 * bs + 7, -3] + list(range(9, bs)) + list(range(5 * bs, 5 * bs + bs // 2 + 3))
    return {
        "runs": runs,
        "permuted": torch.randperm(n, generator=g)[: n // 2].tolist() + [-1],
        "one": [2 * bs + bs - 1],
    }


HEAD_SIZES = [32, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def _dtypes():
    return [torch.bfloat16, torch.uint8, torch.float8_e4m3fn, torch.float32]


@pytest.mark.parametrize("fmt", [KT, KTILE], ids=["colmajor", "tiles"])
@pytest.mark.parametrize("dt", _dtypes(), ids=str)
@pytest.mark.parametrize("hs", HEAD_SIZES)
def test_gather_and_scatter_match_the_engines_addressing(fmt, dt, hs, native_cpu):
    bs = 32 if hs >= 256 else 64
    if fmt == KTILE and dt != torch.bfloat16:
        pytest.skip("the VNNI tile layout is vLLM's bf16 AMX path")
    raw = _raw(dt, bs, hs, seed=hs)
    lay = kvcore.build_layout(fmt, _views(fmt, raw, bs, hs))
    assert kvcore.plan(lay).kernel is native_cpu
    assert lay.classic_staging and lay.head_size == hs and lay.block_size == bs
    for name, slots in _slot_patterns(bs, seed=hs).items():
        st = torch.tensor(slots, dtype=torch.int64)
        # gather: padding rows keep what the buffer held
        out = torch.randint(0, 256, (2, NL, len(slots), NH * hs * _esz(dt)), dtype=torch.uint8).view(dt)
        before = out.clone()
        kvcore.gather(lay, st, out)
        for li in range(NL):
            for i, s in enumerate(slots):
                if s < 0:
                    assert torch.equal(_bytes(out[:, li, i]), _bytes(before[:, li, i])), f"{name}: padding row {i} written"
                    continue
                k, v = _engine_rows(fmt, raw[li], s, bs, hs)
                assert torch.equal(_bytes(out[0, li, i]), _bytes(k)), f"{name}: K of slot {s} layer {li}"
                assert torch.equal(_bytes(out[1, li, i]), _bytes(v)), f"{name}: V of slot {s} layer {li}"
        # scatter: exactly the slots' bytes change, as the engine's addressing places them
        src = torch.randint(0, 256, (*out.shape[:-1], out.shape[-1] * _esz(dt)), dtype=torch.uint8).view(dt)
        want = [t.clone() for t in raw]
        for li in range(NL):
            for i, s in enumerate(slots):
                if s >= 0:
                    _write_engine_rows(fmt, want[li], s, bs, hs, src[0, li, i], src[1, li, i])
        kvcore.scatter(lay, st, src)
        for li in range(NL):
            assert torch.equal(_bytes(raw[li]), _bytes(want[li])), f"{name}: scatter into layer {li}"


@pytest.mark.parametrize("fmt", [KT, KTILE], ids=["colmajor", "tiles"])
def test_layer_subsets_blocks_and_skip_prefix(fmt, native_cpu):
    bs, hs, dt = 32, 64, torch.bfloat16
    raw = _raw(dt, bs, hs, seed=7)
    lay = kvcore.build_layout(fmt, _views(fmt, raw, bs, hs))
    # whole blocks, one layer (staging without the NL axis)
    got = kvcore.gather_blocks(lay, torch.tensor([3, 0]), layers=1)
    for i, s in enumerate(list(range(3 * bs, 4 * bs)) + list(range(bs))):
        k, v = _engine_rows(fmt, raw[1], s, bs, hs)
        assert torch.equal(_bytes(got[0, i]), _bytes(k)) and torch.equal(_bytes(got[1, i]), _bytes(v))
    # skip_prefix leaves the first rows alone in both directions
    slots = torch.arange(2 * bs + 3, 3 * bs + 10)
    out = torch.zeros(2, NL, len(slots), NH * hs, dtype=dt)
    kvcore.gather(lay, slots, out, skip_prefix=5)
    assert not _bytes(out[:, :, :5]).any()
    k, v = _engine_rows(fmt, raw[0], int(slots[5]), bs, hs)
    assert torch.equal(_bytes(out[0, 0, 5]), _bytes(k)) and torch.equal(_bytes(out[1, 0, 5]), _bytes(v))
    want = [t.clone() for t in raw]
    src = torch.randint(0, 256, out.shape, dtype=torch.int16).view(dt)
    for li in range(NL):
        for i in range(5, len(slots)):
            _write_engine_rows(fmt, want[li], int(slots[i]), bs, hs, src[0, li, i], src[1, li, i])
    kvcore.scatter(lay, slots, src, skip_prefix=5)
    for li in range(NL):
        assert torch.equal(_bytes(raw[li]), _bytes(want[li]))


def test_a_refused_scatter_writes_nothing(native_cpu):
    bs, hs, dt = 32, 128, torch.bfloat16
    raw = _raw(dt, bs, hs, seed=3)
    lay = kvcore.build_layout(KT, _views(KT, raw, bs, hs))
    snap = [t.clone() for t in raw]
    src = torch.ones(2, NL, 40, NH * hs, dtype=dt)
    for bad in (list(range(40, 79)) + [NB * bs], list(range(40, 79)) + [41]):  # out of range; a slot twice
        with pytest.raises(kvcore.TransferError):
            kvcore.scatter(lay, torch.tensor(bad), src)
        assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(raw, snap))


@pytest.fixture
def every_thread():
    """The native CPU kernel's grain forced to one byte: every transfer split over all threads
    (runs of tokens cut where a thread's rows end)."""
    from kvcore.kernels.native import _ops

    mod = _ops()
    if mod is None:
        pytest.skip("no native op")
    if torch.get_num_threads() < 2:
        pytest.skip("one thread")
    old = mod.cpu_grain()
    mod.set_cpu_grain(1)
    yield
    mod.set_cpu_grain(old)


@pytest.mark.parametrize("fmt", [KT, KTILE], ids=["colmajor", "tiles"])
def test_runs_cut_between_threads_move_like_one_thread(fmt, native_cpu, every_thread):
    bs, hs, dt = 32, 96, torch.bfloat16
    raw = _raw(dt, bs, hs, seed=11)
    lay = kvcore.build_layout(fmt, _views(fmt, raw, bs, hs))
    slots = _slot_patterns(bs, seed=11)["runs"]
    out = kvcore.gather(lay, torch.tensor(slots))
    for li in range(NL):
        for i, s in enumerate(slots):
            if s >= 0:
                k, v = _engine_rows(fmt, raw[li], s, bs, hs)
                assert torch.equal(_bytes(out[0, li, i]), _bytes(k)) and torch.equal(_bytes(out[1, li, i]), _bytes(v))
    want = [t.clone() for t in raw]
    src = torch.randint(0, 256, out.shape, dtype=torch.int16).view(dt)
    for li in range(NL):
        for i, s in enumerate(slots):
            if s >= 0:
                _write_engine_rows(fmt, want[li], s, bs, hs, src[0, li, i], src[1, li, i])
    kvcore.scatter(lay, torch.tensor(slots), src)
    for li in range(NL):
        assert torch.equal(_bytes(raw[li]), _bytes(want[li]))


@pytest.mark.parametrize("fmt", [KT, KTILE], ids=["colmajor", "tiles"])
def test_the_benchmark_lays_the_planes_out_as_the_engine_does(fmt):
    """``kvcore bench``'s KT / Ktile cases measure this layout: one container per layer, K
    then V per (block, head), in the engine's addressing (not a layout of our own)."""
    from kvcore import bench

    bs, hs = 32, 64
    planes = bench.shared_planes(
        fmt, num_layers=NL, num_blocks=NB, block_size=bs, num_heads=NH, head_size=hs, dtype=torch.bfloat16, device="cpu"
    )
    raw = [k._base for k in planes["K"]]
    assert all(r is v._base for r, v in zip(raw, planes["V"])) and raw[0].shape == (NB, NH, 2 * bs * hs)
    lay = kvcore.build_layout(fmt, planes)
    slots = _slot_patterns(bs, seed=5)["runs"]
    out = kvcore.gather(lay, torch.tensor(slots))
    for li in range(NL):
        for i, s in enumerate(slots):
            if s >= 0:
                k, v = _engine_rows(fmt, raw[li].view(NB, NH, bs, 2 * hs), s, bs, hs)
                assert torch.equal(_bytes(out[0, li, i]), _bytes(k)) and torch.equal(_bytes(out[1, li, i]), _bytes(v))


@pytest.mark.parametrize("slots", ["blocks", "random"])
def test_bench_rows_of_the_strided_cases_carry_slots_and_spreads(slots):
    from kvcore import bench

    case = bench.Case(
        "KT", KT, num_layers=2, num_heads=2, head_size=64, storage_dtype=torch.uint8, dtype=torch.float8_e4m3fn, kind="shared"
    )
    rows = bench.bench_case(case, 32, 100, torch.device("cpu"), repeats=3, with_reference=False, host=False, sample_bytes=1e5, slots=slots)
    assert [r.direction for r in rows] == ["gather", "scatter"]
    for r in rows:
        assert r.slots == slots and r.mbytes == pytest.approx(2 * 2 * 2 * 64 * 100 / 1e6)
        lo, hi = r.gbps_range
        assert lo <= r.gbps <= hi and r.vs_copy_range[0] <= r.vs_copy_range[1] and r.public_vs_copy > 0
    table = bench.format_table(rows)
    assert f"| {slots} |" in table and "–" in table
