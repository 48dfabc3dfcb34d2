"""The native kernels on stride tables v2 of any shape: multi-plane records (planes of
different widths, dtypes, head counts, strides, token groups and chunks, staged into their
own buffers, into a shared K/V buffer, or side by side / interleaved in one staged row),
blocked-scale records; bit-exact against the torch reference kernel in both directions
(scatters compared over every byte of every cache storage).

Tables are built by hand from real tensors: each plane of each layer is a torch tensor whose
axes (blocks, tokens or token groups, heads, elements or element chunks) are in a random
physical order, so the strides are whatever torch gives that order. The CPU cases run
everywhere; the ``cuda`` cases run on a GPU machine (``scripts/gpu_check.py``).
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

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.int8, torch.float64, torch.float8_e4m3fn]


def _native(device: str):
    k = CPU_KERNEL if device == "cpu" else CUDA_KERNEL
    if _build.disabled():
        pytest.skip("KVCORE_NATIVE=0")
    assert k.available(), k.why()
    return k


def _esz(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


def _plane_tensor(rng: random.Random, nl: int, nb: int, bs: int, nh: int, e: int, dt, device, one_tensor: bool, group: int, chunk: int):
    """Random-byte tensors of one plane and its PlaneStrides: axes NB, BS (or BSC, BSE), NH,
    E (or HSC, HSE with HSE innermost) in a random order; one tensor [NL, ...] or one per layer."""
    axes = [("NB", nb), ("NH", nh)]
    axes += [("BSC", bs // group), ("BSE", group)] if group else [("BS", bs)]
    split = bool(chunk)
    if split:
        axes.append(("HSC", e // chunk))
    else:
        axes.append(("E", e))
    rng.shuffle(axes)
    if split:
        axes.append(("HSE", chunk))
    shape = [n for _, n in axes]
    pad = rng.choice([0, 1])
    esz = _esz(dt)
    nbytes_layer = esz
    for n in shape:
        nbytes_layer *= n
    if one_tensor:
        raw = torch.randint(0, 256, ((nl + pad) * nbytes_layer,), dtype=torch.uint8)
        full = raw.view(dt).view(nl + pad, *shape)[pad:].to(device)
        layers = [full[i] for i in range(nl)]
    else:
        layers = []
        for _ in range(nl):
            raw = torch.randint(0, 256, ((1 + pad) * nbytes_layer,), dtype=torch.uint8)
            layers.append(raw.view(dt)[pad * (nbytes_layer // esz) :].view(*shape).to(device))
    ref = layers[0]
    st = {name: int(ref.stride(i)) * esz for i, (name, _) in enumerate(axes)}
    if group:
        token, tg, tgs = st["BSE"], group, st["BSC"]
    else:
        token, tg, tgs = st["BS"], 0, 0
    if split:
        chunk_stride, chunk_bytes, n_chunks = st["HSC"], chunk * esz, e // chunk
    elif st["E"] == esz:
        chunk_stride, chunk_bytes, n_chunks = 0, e * esz, 1
    else:
        chunk_stride, chunk_bytes, n_chunks = st["E"], esz, e
    ps = PlaneStrides(
        block=st["NB"],
        token=token,
        head=st["NH"],
        chunk=chunk_stride,
        chunk_bytes=chunk_bytes,
        n_chunks=n_chunks,
        token_group=tg,
        token_group_stride=tgs,
    )
    return layers, ps


def random_table(seed: int, device: str):
    """A hand-built multi-plane table over fresh random tensors; the same seed builds the
    same bytes (two calls give two independent caches with identical contents)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    nl, nb, bs = rng.randint(1, 3), rng.randint(2, 6), rng.choice([1, 2, 3, 4, 6, 8])
    nplanes = rng.randint(1, 5)
    staging_mode = rng.choice(["own", "own", "row", "interleave", "kv"])
    planes_spec = []
    for i in range(nplanes):
        dt = rng.choice(DTYPES)
        nh = rng.randint(1, 4)
        e = rng.choice([1, 2, 3, 4, 8, 16])
        group = rng.choice([0, 0] + [g for g in (1, 2, 4) if bs % g == 0 and g < bs])
        chunk = rng.choice([0, 0] + [c for c in (1, 2, 4) if e % c == 0 and c < e])
        planes_spec.append((f"P{i}", dt, nh, e, group, chunk, rng.random() < 0.5))
    if staging_mode == "interleave":  # planes interleaved per head need one head count
        nh0 = planes_spec[0][2]
        planes_spec = [(r, dt, nh0, e, g, c, o) for (r, dt, _, e, g, c, o) in planes_spec]
    if staging_mode == "kv":  # a classic-like K/V buffer: two planes of one shape and dtype, then own buffers
        r, dt, nh, e, g, c, o = planes_spec[0]
        if len(planes_spec) == 1:
            planes_spec.append(("P1", dt, nh, e, 0, 0, o))
        else:
            planes_spec[1] = ("P1", dt, nh, e, planes_spec[1][4] if bs % max(1, planes_spec[1][4]) == 0 else 0, 0, planes_spec[1][6])
    planes = []
    buffers = []
    tensors = []
    row_off = 0
    inter_stride = sum(_esz(dt) * e for (_, dt, _, e, _, _, _) in planes_spec)
    for i, (role, dt, nh, e, group, chunk, one) in enumerate(planes_spec):
        layers, ps = _plane_tensor(rng, nl, nb, bs, nh, e, dt, device, one, group, chunk)
        tensors += layers
        hb = e * _esz(dt)
        bases = tuple((t, t.storage_offset() * t.element_size()) for t in layers)
        if staging_mode == "own" or (staging_mode == "kv" and i >= 2):
            target = StagingTarget(buffer=role, index=None, offset=0, head_stride=hb)
            buffers.append(StagingBuffer(key=role, kv_size=None, row_bytes=nh * hb, dtype=dt))
        elif staging_mode == "kv":
            target = StagingTarget(buffer="kv", index=i, offset=0, head_stride=hb)
            if i == 0:
                buffers.append(StagingBuffer(key="kv", kv_size=2, row_bytes=nh * hb, dtype=dt))
        elif staging_mode == "row":
            target = StagingTarget(buffer="kv", index=0, offset=row_off, head_stride=hb)
            row_off += nh * hb
        else:  # interleave: head h of every plane, one after another
            target = StagingTarget(buffer="kv", index=0, offset=row_off, head_stride=inter_stride)
            row_off += hb
        planes.append(Plane(role=role, strides=ps, num_heads=nh, head_bytes=hb, dtype=dt, bases=bases, staging=target))
    if staging_mode == "row":
        buffers.append(StagingBuffer(key="kv", kv_size=1, row_bytes=row_off, dtype=torch.uint8))
    elif staging_mode == "interleave":
        buffers.append(StagingBuffer(key="kv", kv_size=1, row_bytes=inter_stride * planes_spec[0][2], dtype=torch.uint8))
    table = StrideTable(
        num_layers=nl,
        block_size=bs,
        num_slots=nb * bs,
        device=torch.device(device),
        planes=tuple(planes),
        buffers=tuple(buffers),
    )
    return table, tensors, rng


def _staging(table: StrideTable, t: int, device, fill: int | None = 0xA5, seed: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    g = torch.Generator().manual_seed(seed)
    for b in table.buffers:
        x = torch.empty(b.shape(table.num_layers, t), dtype=b.dtype)
        u = x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.uint8)
        if fill is None:
            u.copy_(torch.randint(0, 256, u.shape, dtype=torch.uint8, generator=g))
        else:
            u.fill_(fill)
        out[b.key] = x.to(device)
    return out


def _stage_arg(table, bufs):
    return bufs["kv"] if len(bufs) == 1 and "kv" in bufs else bufs


def _bytes(bufs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: v.view(torch.uint8).cpu().clone() if v.element_size() == 1 else v.contiguous().view(torch.uint8).cpu().clone()
        for k, v in bufs.items()
    }


def _storages(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            out.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(s).cpu().clone())
    return out


def _slots(rng: random.Random, num_slots: int, device) -> torch.Tensor:
    t = rng.randint(0, num_slots)
    s = rng.sample(range(num_slots), t)
    for i in range(len(s)):
        if rng.random() < 0.15:
            s[i] = -1
    return torch.tensor(s, dtype=torch.int64, device=device)


def check_table_against_reference(seed: int, device: str) -> None:
    k = _native(device)
    table, tensors, rng = random_table(seed, device)
    slots = _slots(rng, table.num_slots, device)
    t = slots.numel()
    nv = int((slots >= 0).sum())
    a, b = _staging(table, t, device), _staging(table, t, device)
    k.gather(TransferPlan(table, slots, _stage_arg(table, a), nv))
    REFERENCE.gather(TransferPlan(table, slots, _stage_arg(table, b), nv))
    ba, bb = _bytes(a), _bytes(b)
    for key in ba:
        assert torch.equal(ba[key], bb[key]), (seed, key, table)
    # scatter into two identical caches: native and reference, every byte of every storage
    t2, tensors2, _ = random_table(seed, device)
    src = _staging(table, t, device, fill=None, seed=seed)
    k.scatter(TransferPlan(table, slots, _stage_arg(table, src), nv))
    REFERENCE.scatter(TransferPlan(t2, slots, _stage_arg(t2, src), nv))
    for x, y in zip(_storages(tensors), _storages(tensors2)):
        assert torch.equal(x, y), (seed, table)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(40))
def test_hand_built_multi_plane_tables_match_the_reference(device, seed):
    check_table_against_reference(seed, device)


@pytest.fixture
def every_thread():
    """The native CPU kernel's grain forced to one byte: every transfer is split over all
    threads (by bytes: planes of different row widths), as large transfers are."""
    from kvcore.kernels.native import _ops

    if _build.disabled() or _ops() is None:
        pytest.skip("no native op")
    mod = _ops()
    old = mod.cpu_grain()
    mod.set_cpu_grain(1)
    yield
    mod.set_cpu_grain(old)


@pytest.mark.parametrize("seed", range(100, 130))
def test_multi_plane_tables_split_over_threads_match_the_reference(seed, every_thread):
    if torch.get_num_threads() < 2:
        pytest.skip("one thread")
    check_table_against_reference(seed, "cpu")


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "25")), deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**31 - 1), device=st.sampled_from(DEVICES))
    def test_random_multi_plane_tables_match_the_reference(seed, device):
        check_table_against_reference(seed, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w,scale", [(20, 4), (656, 16), (7, 3)])
def test_blocked_scale_records_match_the_reference(device, w, scale, force):
    k = _native(device)
    g = torch.Generator().manual_seed(w)
    kv = [torch.randint(0, 256, (5, 4, w), dtype=torch.uint8, generator=g).to(device) for _ in range(3)]
    kv2 = [x.clone() for x in kv]
    la = kvcore.build_layout("NL_X_NB_BSV_BSS", kv, params={"scale_bytes": scale})
    lb = kvcore.build_layout("NL_X_NB_BSV_BSS", kv2, params={"scale_bytes": scale})
    slots = torch.tensor([7, -1, 0, 19, 3, 12], device=device)
    force(k.name)
    a = kvcore.gather(la, slots)
    force("reference")
    b = kvcore.gather(la, slots)
    assert torch.equal(a.cpu(), b.cpu())
    # the staged row is the record: its values, then its scales
    blk, off = 19 // 4, 19 % 4
    vals = kv[1][blk].reshape(-1)[off * (w - scale) : (off + 1) * (w - scale)]
    scales = kv[1][blk].reshape(-1)[4 * (w - scale) + off * scale : 4 * (w - scale) + (off + 1) * scale]
    assert torch.equal(a[0, 1, 3].cpu(), torch.cat([vals, scales]).cpu())
    src = torch.randint(0, 256, a.shape, dtype=torch.uint8, generator=g).to(device)
    force(k.name)
    kvcore.scatter(la, slots, src)
    force("reference")
    kvcore.scatter(lb, slots, src)
    for x, y in zip(kv, kv2):
        assert torch.equal(x.cpu(), y.cpu())


@pytest.fixture
def force(monkeypatch):
    def f(name: str):
        monkeypatch.setenv("KVCORE_KERNEL", name)

    return f


def test_a_quantised_record_moves_in_one_call_with_the_scales_beside_the_values():
    """int8 K/V values with bf16 per-(token, head) scales in sibling tensors (4 planes):
    the staged rows hold exactly the engine's values and scales."""
    from kvcore.bench import quantised_table

    table, tensors = quantised_table(num_layers=2, num_blocks=6, block_size=4, num_heads=2, head_size=8, device="cpu")
    k = _native("cpu")
    slots = torch.tensor([5, -1, 0, 23, 9])
    bufs = _staging(table, 5, "cpu")
    k.gather(TransferPlan(table, slots, bufs, 4))
    kv_vals, k_scales = tensors["K"], tensors["KS"]
    for li in range(2):
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            row = bufs["K"][li, i].view(torch.int8).reshape(2, 8)
            assert torch.equal(row, kv_vals[li][s // 4, s % 4])
            assert torch.equal(bufs["KS"][li, i].view(torch.int16), k_scales[li][s // 4, s % 4].view(torch.int16))  # bits: NaNs too
    assert torch.equal(bufs["K"][:, 1].view(torch.uint8), torch.full_like(bufs["K"][:, 1].view(torch.uint8), 0xA5))
