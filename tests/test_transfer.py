"""Transfers with the torch reference kernel: semantic gather per structural family,
bit-exact scatter∘gather per dtype, padding slots, skip_prefix, layer subsets, blocks,
validation before any write, and a property test against an independent torch oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcore
from kvcore import TransferError, build_layout

pytestmark = pytest.mark.usefixtures("core_only")

NL, NB, BS, NH, HS = 3, 5, 4, 2, 8
SLOTS = NB * BS


@pytest.fixture(autouse=True)
def _reference_kernel(monkeypatch):
    monkeypatch.setenv("KVCORE_KERNEL", "reference")


# -- families: (format, allocate(dtype) -> kv_caches (+dtype kwarg), engine view) -------
# The view is what the engine's attention code indexes: [NB, BS, NH, HS] for one
# (layer, K/V) (fused NBBS: [PBS, 1, NH, HS]), written with plain torch indexing.


def _ll(shape, dtype):
    return [torch.zeros(*shape, dtype=dtype) for _ in range(NL)]


FAMILIES = {
    "NL_X_TWO_NB_BS_NH_HS": (lambda dt: _ll((2, NB, BS, NH, HS), dt), lambda kv, ly, k: kv[ly][k]),
    "NL_X_TWO_NB_NH_BS_HS": (lambda dt: _ll((2, NB, NH, BS, HS), dt), lambda kv, ly, k: kv[ly][k].transpose(1, 2)),
    "NL_X_NB_TWO_BS_NH_HS": (lambda dt: _ll((NB, 2, BS, NH, HS), dt), lambda kv, ly, k: kv[ly][:, k]),
    "NL_X_NB_TWO_NH_BS_HS": (lambda dt: _ll((NB, 2, NH, BS, HS), dt), lambda kv, ly, k: kv[ly][:, k].transpose(1, 2)),
    "NL_X_NB_BS_HS": (lambda dt: _ll((NB, BS, HS), dt), lambda kv, ly, k: kv[ly].unsqueeze(2)),
    "NL_X_NBBS_ONE_HS": (lambda dt: _ll((SLOTS, 1, HS), dt), lambda kv, ly, k: kv[ly].unsqueeze(1)),
    "TWO_X_NL_X_NBBS_NH_HS": (
        lambda dt: [_ll((SLOTS, NH, HS), dt), _ll((SLOTS, NH, HS), dt)],
        lambda kv, ly, k: kv[k][ly].unsqueeze(1),
    ),
    "TWO_X_NL_X_NB_BS_NH_HS": (lambda dt: [_ll((NB, BS, NH, HS), dt), _ll((NB, BS, NH, HS), dt)], lambda kv, ly, k: kv[k][ly]),
    "NL_X_TWO_X_NB_BS_NH_HS": (
        lambda dt: [(torch.zeros(NB, BS, NH, HS, dtype=dt), torch.zeros(NB, BS, NH, HS, dtype=dt)) for _ in range(NL)],
        lambda kv, ly, k: kv[ly][k],
    ),
    "NB_NL_TWO_BS_NH_HS": (lambda dt: torch.zeros(NB, NL, 2, BS, NH, HS, dtype=dt), lambda kv, ly, k: kv[:, ly, k]),
    "NB_NL_TWO_NH_BS_HS": (lambda dt: torch.zeros(NB, NL, 2, NH, BS, HS, dtype=dt), lambda kv, ly, k: kv[:, ly, k].transpose(1, 2)),
    "NL_X_NB_BS_NH_CS": (lambda dt: _ll((NB, BS, NH, 2 * HS), dt), lambda kv, ly, k: kv[ly][..., k * HS : (k + 1) * HS]),
    "NL_X_NB_NH_BS_CS": (lambda dt: _ll((NB, NH, BS, 2 * HS), dt), lambda kv, ly, k: kv[ly][..., k * HS : (k + 1) * HS].transpose(1, 2)),
    "NL_X_NB_NH_BS_TWO_HS": (lambda dt: _ll((NB, NH, BS, 2, HS), dt), lambda kv, ly, k: kv[ly][:, :, :, k].transpose(1, 2)),
    "NL_X_TWO_NB_NH_ONE_BS_HS": (lambda dt: _ll((2, NB, NH, 1, BS, HS), dt), lambda kv, ly, k: kv[ly][k][:, :, 0].transpose(1, 2)),
    "NL_X_NB_BS_NH_HS": (lambda dt: _ll((NB, BS, NH, HS), dt), lambda kv, ly, k: kv[ly]),
}


def _int(dtype):
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]


def _code(layer, kv, slot, head, elem, nh=NH, hs=HS):
    """A unique non-zero int32 per (layer, K/V, slot, head, element)."""
    return ((((layer * 2 + kv) * SLOTS + slot) * nh + head) * hs + elem) + 1


def _grid(layer, kv, nb, bs, nh, hs):
    b = torch.arange(nb).view(nb, 1, 1, 1)
    t = torch.arange(bs).view(1, bs, 1, 1)
    h = torch.arange(nh).view(1, 1, nh, 1)
    e = torch.arange(hs).view(1, 1, 1, hs)
    return _code(layer, kv, b * bs + t, h, e, nh, hs).to(torch.int32)


def _fill_codes(name, kv_caches, kv_size, view_dtype=None):
    _, view = FAMILIES[name]
    for layer in range(NL):
        for k in range(kv_size):
            v = view(kv_caches, layer, k)
            if view_dtype is not None:
                v = v.view(view_dtype)
            nb, bs = v.shape[0], v.shape[1]
            v.view(torch.int32).copy_(_grid(layer, k, nb, bs, NH if v.shape[2] > 1 else 1, v.shape[3]))


def _expected_rows(slots, layers, kv_size, nh, hs):
    out = torch.zeros(kv_size, len(layers), len(slots), nh * hs, dtype=torch.int32)
    h = torch.arange(nh).view(nh, 1)
    e = torch.arange(hs).view(1, hs)
    for k in range(kv_size):
        for j, layer in enumerate(layers):
            for i, s in enumerate(slots):
                if s >= 0:
                    out[k, j, i] = _code(layer, k, s, h, e, nh, hs).reshape(-1)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_semantic_gather_and_scatter(name):
    alloc, view = FAMILIES[name]
    kv = alloc(torch.float32)
    lay = build_layout(name, kv)
    nh = lay.num_heads
    _fill_codes(name, kv, lay.kv_size)
    before = [t.clone() for _, t in lay.spec.leaves]
    slots = [17, 0, -1, 5, 19, 4, -3, 10]
    sentinel = -7
    out = torch.full(lay.staging_shape(len(slots)), float("nan"))
    out.view(torch.int32).fill_(sentinel)
    got = kvcore.gather(lay, torch.tensor(slots), out)
    assert got is out
    want = _expected_rows(slots, range(NL), lay.kv_size, nh, HS)
    neg = torch.tensor([s < 0 for s in slots])
    want[:, :, neg] = sentinel  # padding rows untouched
    assert torch.equal(got.view(torch.int32), want)
    # gather never writes the cache
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, (_, b) in zip(before, lay.spec.leaves))

    # scatter into a fresh cache at other slots; read back through the engine's view
    kv2 = alloc(torch.float32)
    lay2 = build_layout(name, kv2)
    dst = [3, 12, -1, 18, 1, 7, -1, 9]
    kvcore.scatter(lay2, torch.tensor(dst), got)
    for layer in range(NL):
        for k in range(lay.kv_size):
            v = view(kv2, layer, k).view(torch.int32)
            bs = v.shape[1]
            for i, (s_src, s_dst) in enumerate(zip(slots, dst)):
                if s_dst >= 0:
                    exp = torch.tensor([[_code(layer, k, s_src, h, e, nh) for e in range(HS)] for h in range(nh)], dtype=torch.int32)
                    assert torch.equal(v[s_dst // bs, s_dst % bs], exp), (layer, k, i)
            written = {d for d in dst if d >= 0}
            for s in range(SLOTS):
                if s not in written:
                    assert not v[s // bs, s % bs].any(), (layer, k, s)


def test_semantic_gather_int8_buffer_carrying_bf16():
    # vLLM 0.33: int8 pages [NB, BS, NH, CS bytes]; K|V bf16 packed in the last axis
    kv = [torch.zeros(NB, BS, NH, 2 * HS * 2, dtype=torch.int8) for _ in range(NL)]
    lay = build_layout("NL_X_NB_BS_NH_CS", kv, dtype=torch.bfloat16)
    for layer in range(NL):
        for k in range(2):
            v = kv[layer].view(torch.bfloat16)[..., k * HS : (k + 1) * HS].view(torch.int16)
            v.copy_((_grid(layer, k, NB, BS, NH, HS) % 32749).to(torch.int16))
    slots = [19, 0, 7, -1, 8]
    got = kvcore.gather(lay, slots)
    assert got.dtype == torch.bfloat16 and got.shape == (2, NL, 5, NH * HS)
    want = (_expected_rows(slots, range(NL), 2, NH, HS) % 32749).to(torch.int16)
    want[:, :, 3] = 0
    assert torch.equal(got.view(torch.int16), want)


def test_semantic_gather_with_a_strided_element_axis():
    # HS is not innermost in memory: physical [2, NB, BS, HS, NH], seen as [2, NB, BS, NH, HS]
    kv = [torch.zeros(2, NB, BS, HS, NH).transpose(3, 4) for _ in range(NL)]
    lay = build_layout("NL_X_TWO_NB_BS_NH_HS", kv)
    assert lay.stride_table().planes[0].n_chunks == HS
    for layer in range(NL):
        for k in range(2):
            kv[layer][k].view(torch.int32).copy_(_grid(layer, k, NB, BS, NH, HS))
    slots = [3, 19, -1, 0]
    got = kvcore.gather(lay, slots)
    want = _expected_rows(slots, range(NL), 2, NH, HS)
    assert torch.equal(got.view(torch.int32), want)
    dst = build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(2, NB, BS, HS, NH).transpose(3, 4) for _ in range(NL)])
    kvcore.scatter(dst, slots, got)
    assert torch.equal(kvcore.gather(dst, slots).view(torch.int32), want)


# -- bit-exact scatter∘gather per dtype, NaN and -0 included ----------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]
SPECIAL = {
    torch.bfloat16: [0x7FC0, 0xFFC1, 0x8000, 0x7F80, 0xFF80, 0x0001],  # NaNs, -0, +-inf, denormal
    torch.float16: [0x7E00, 0xFE01, 0x8000, 0x7C00, 0xFC00, 0x0001],
    torch.float32: [0x7FC00001, -0x003FFFFF, -(2**31), 0x7F800000, 0x00000001],
    torch.float8_e4m3fn: [0x7F, 0xFF, 0x80, 0x01],
    torch.float8_e5m2: [0x7F, 0xFE, 0x80, 0x7C, 0x01],
    torch.uint8: [0xFF, 0x80, 0x00, 0x01],
}


def _random_bits(shape, dtype, seed):
    it = _int(dtype)
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2 ** (8 * torch.empty(0, dtype=it).element_size()), shape, generator=g, dtype=torch.int64)
    flat = bits.view(-1)
    sp = SPECIAL[dtype]
    flat[: len(sp) * 3] = torch.tensor(sp * 3)
    if it != torch.uint8:
        bits = torch.where(
            bits >= 2 ** (8 * torch.empty(0, dtype=it).element_size() - 1), bits - 2 ** (8 * torch.empty(0, dtype=it).element_size()), bits
        )
    return bits.to(it).view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize(
    "name", ["NL_X_TWO_NB_NH_BS_HS", "NL_X_NB_TWO_BS_NH_HS", "TWO_X_NL_X_NBBS_NH_HS", "NB_NL_TWO_BS_NH_HS", "NL_X_NB_BS_HS"]
)
def test_scatter_then_gather_is_bit_exact(name, dtype):
    alloc, view = FAMILIES[name]
    lay = build_layout(name, alloc(dtype))
    slots = torch.tensor([6, 0, 19, -1, 13, 2])
    src = _random_bits(lay.staging_shape(len(slots)), dtype, seed=1)
    kvcore.scatter(lay, slots, src)
    back = kvcore.gather(lay, slots)
    it = _int(dtype)
    valid = slots >= 0
    assert torch.equal(back[:, :, valid].view(it), src[:, :, valid].view(it))
    assert not back[:, :, ~valid].view(it).any()
    # the bytes landed where the engine reads them
    v = view(lay.kv_caches, 1, lay.kv_size - 1).view(it)
    bs = v.shape[1]
    assert torch.equal(v[13 // bs, 13 % bs].reshape(-1), src[lay.kv_size - 1, 1, 4].view(it))


def test_bit_exact_through_an_int8_byte_view():
    kv = [torch.zeros(NB, BS, NH, 2 * HS * 2, dtype=torch.int8) for _ in range(2)]
    lay = build_layout("NL_X_NB_BS_NH_CS", kv, dtype=torch.bfloat16)
    slots = torch.tensor([1, 18, 7])
    src = _random_bits(lay.staging_shape(3), torch.bfloat16, seed=2)
    kvcore.scatter(lay, slots, src)
    assert torch.equal(kvcore.gather(lay, slots).view(torch.int16), src.view(torch.int16))
    # V of slot 18 sits right after K in the packed row
    row = kv[1].view(torch.bfloat16)[18 // BS, 18 % BS, 1]
    assert torch.equal(row[HS:].view(torch.int16), src[1, 1, 1, HS:].view(torch.int16))


# -- padding slots, skip_prefix, layers, blocks, empty ----------------------------------


def _coded_layout(name="NL_X_TWO_NB_BS_NH_HS"):
    alloc, _ = FAMILIES[name]
    kv = alloc(torch.float32)
    lay = build_layout(name, kv)
    _fill_codes(name, kv, lay.kv_size)
    return lay


def _snapshot(lay):
    return [t.view(torch.uint8).clone() if t.is_contiguous() else t.clone().view(torch.uint8) for _, t in lay.spec.leaves]


def _same(lay, snap):
    return all(torch.equal(t.contiguous().view(torch.uint8), s) for (_, t), s in zip(lay.spec.leaves, snap))


def test_negative_slots_skip_both_directions():
    lay = _coded_layout()
    snap = _snapshot(lay)
    slots = torch.tensor([-1, 4, -1, -100])
    src = torch.full(lay.staging_shape(4), 1.5)
    kvcore.scatter(lay, slots, src)
    # only slot 4 changed
    for layer in range(NL):
        for k in range(2):
            plane = lay.kv_caches[layer][k]
            assert torch.all(plane[1, 0] == 1.5)
            plane[1, 0].view(torch.int32).copy_(_grid(layer, k, NB, BS, NH, HS)[1, 0])
    assert _same(lay, snap)
    out = torch.full(lay.staging_shape(4), 9.0)
    kvcore.gather(lay, slots, out)
    assert torch.all(out[:, :, [0, 2, 3]] == 9.0)
    assert torch.equal(out[:, :, 1].view(torch.int32), _expected_rows([4], range(NL), 2, NH, HS)[:, :, 0])
    # all padding: nothing moves, nothing is allocated beyond the staging buffer
    kvcore.scatter(lay, torch.tensor([-1, -1]), torch.zeros(lay.staging_shape(2)))
    assert _same(lay, snap)


def test_skip_prefix():
    lay = _coded_layout()
    slots = torch.tensor([3, 7, 11, 15])
    out = torch.full(lay.staging_shape(4), 2.0)
    kvcore.gather(lay, slots, out, skip_prefix=2)
    assert torch.all(out[:, :, :2] == 2.0)
    assert torch.equal(out[:, :, 2:].view(torch.int32), _expected_rows([11, 15], range(NL), 2, NH, HS))
    snap = _snapshot(lay)
    src = torch.full(lay.staging_shape(4), 3.0)
    kvcore.scatter(lay, slots, src, skip_prefix=3)
    for layer in range(NL):
        for k in range(2):
            plane = lay.kv_caches[layer][k]
            assert torch.all(plane[15 // BS, 15 % BS] == 3.0)
            plane[15 // BS, 15 % BS].view(torch.int32).copy_(_grid(layer, k, NB, BS, NH, HS)[3, 3])
    assert _same(lay, snap)
    # skip_prefix == T is a no-op; past T is refused
    kvcore.scatter(lay, slots, src, skip_prefix=4)
    assert _same(lay, snap)
    with pytest.raises(TransferError, match="skip_prefix"):
        kvcore.gather(lay, slots, skip_prefix=5)
    with pytest.raises(TransferError, match="skip_prefix"):
        kvcore.gather(lay, slots, skip_prefix=-1)


@pytest.mark.parametrize("name", ["NL_X_TWO_NB_BS_NH_HS", "TWO_X_NL_X_NB_BS_NH_HS", "NB_NL_TWO_BS_NH_HS", "NL_X_NB_BS_HS"])
def test_layer_subsets_and_one_layer(name):
    lay = _coded_layout(name)
    slots = torch.tensor([2, 9, -1, 16])
    full = kvcore.gather(lay, slots)
    sub = kvcore.gather(lay, slots, layers=[2, 0])
    assert sub.shape == (lay.kv_size, 2, 4, lay.hidden_dim)
    assert torch.equal(sub.view(torch.int32), full[:, [2, 0]].view(torch.int32))
    one = kvcore.gather(lay, slots, layers=1)
    assert one.shape == (lay.kv_size, 4, lay.hidden_dim)
    assert torch.equal(one.view(torch.int32), full[:, 1].view(torch.int32))
    import numpy as np

    assert torch.equal(kvcore.gather(lay, slots, layers=np.int64(1)).view(torch.int32), one.view(torch.int32))
    # scatter one layer: only that layer changes
    kvcore.scatter(lay, torch.tensor([0]), torch.full((lay.kv_size, 1, lay.hidden_dim), 4.0), layers=2)
    after = kvcore.gather(lay, torch.arange(SLOTS))
    assert torch.all(after[:, 2, 0] == 4.0)
    want = _expected_rows(list(range(SLOTS)), range(NL), lay.kv_size, lay.num_heads, HS)
    want[:, 2, 0] = torch.tensor(4.0).view(torch.int32)
    assert torch.equal(after.view(torch.int32), want)
    # scatter a layer subset, in the order given
    kvcore.scatter(lay, torch.tensor([1, 2]), sub[:, :, [0, 3]].clone(), layers=[1, 2])
    want[:, 1, [1, 2]] = sub[:, 0, [0, 3]].view(torch.int32)
    want[:, 2, [1, 2]] = sub[:, 1, [0, 3]].view(torch.int32)
    assert torch.equal(kvcore.gather(lay, torch.arange(SLOTS)).view(torch.int32), want)


def test_gather_blocks_and_scatter_blocks():
    lay = _coded_layout()
    got = kvcore.gather_blocks(lay, [3, -1, 0])
    assert got.shape == (2, NL, 3 * BS, NH * HS)
    want = _expected_rows(list(range(12, 16)) + [-1] * BS + list(range(0, 4)), range(NL), 2, NH, HS)
    assert torch.equal(got.view(torch.int32), want)
    assert kvcore.slots_for_blocks(lay, [3, -1]).tolist() == [12, 13, 14, 15, -1, -1, -1, -1]
    assert kvcore.slots_for_blocks(lay, [1], num_tokens=3).tolist() == [4, 5, 6]
    for bad in (-1, BS + 1, 1.5):
        with pytest.raises(TransferError, match="num_tokens"):
            kvcore.slots_for_blocks(lay, [1], num_tokens=bad)
    # move blocks 3 and 0 into blocks 1 and 4
    kvcore.scatter_blocks(lay, [1, -1, 4], got)
    moved = kvcore.gather_blocks(lay, [1, 4])
    assert torch.equal(moved.view(torch.int32), torch.cat([want[:, :, :BS], want[:, :, 2 * BS :]], dim=2))
    with pytest.raises(TransferError, match=r"block_ids\[1\] = 5 is out of range"):
        kvcore.gather_blocks(lay, [0, 5])
    with pytest.raises(TransferError, match="1-D integer"):
        kvcore.gather_blocks(lay, torch.tensor([0.0]))
    nbbs = build_layout("NL_X_NBBS_ONE_HS", [torch.zeros(SLOTS, 1, HS)])
    with pytest.raises(TransferError, match="need blocks"):
        kvcore.gather_blocks(nbbs, [0])


def test_empty_slot_mapping():
    lay = _coded_layout()
    snap = _snapshot(lay)
    out = kvcore.gather(lay, torch.tensor([], dtype=torch.int64))
    assert out.shape == (2, NL, 0, NH * HS)
    kvcore.scatter(lay, torch.tensor([], dtype=torch.int64), torch.zeros(2, NL, 0, NH * HS))
    kvcore.scatter(lay, [], torch.zeros(2, NL, 0, NH * HS))
    assert _same(lay, snap)
    assert kvcore.gather_blocks(lay, []).shape == (2, NL, 0, NH * HS)


def test_int32_and_list_slot_mappings():
    lay = _coded_layout()
    a = kvcore.gather(lay, torch.tensor([5, -1, 2], dtype=torch.int32))
    b = kvcore.gather(lay, [5, -1, 2])
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(a.view(torch.int32), _expected_rows([5, -1, 2], range(NL), 2, NH, HS))


# -- validation happens before any byte moves --------------------------------------------


def _bad_calls(lay):
    T = 3
    good = torch.zeros(lay.staging_shape(T) if lay is not None else (2, NL, T, NH * HS))
    slots = torch.tensor([1, 2, 3])
    wide = torch.zeros(2, NL, T, 2 * NH * HS)
    return [
        (
            "slot out of range",
            lambda: kvcore.scatter(lay, torch.tensor([1, SLOTS, 3]), good),
            rf"slot_mapping\[1\] = {SLOTS} is out of range",
        ),
        (
            "duplicate scatter slot",
            lambda: kvcore.scatter(lay, torch.tensor([4, 9, 4]), good),
            r"slot_mapping\[2\] = 4 repeats slot_mapping\[0\]",
        ),
        ("wrong dtype", lambda: kvcore.scatter(lay, slots, good.to(torch.float16)), "float16"),
        ("wrong shape", lambda: kvcore.scatter(lay, slots, torch.zeros(2, NL, T + 1, NH * HS)), "expected"),
        ("wrong row width", lambda: kvcore.scatter(lay, slots, torch.zeros(2, NL, T, NH * HS + 1)), "expected"),
        ("non-contiguous last dim", lambda: kvcore.scatter(lay, slots, wide[..., ::2]), "contiguous"),
        ("bad layer", lambda: kvcore.scatter(lay, slots, good[:, :1].clone(), layers=[NL]), "out of range"),
        ("bad layer (neg)", lambda: kvcore.scatter(lay, slots, good[:, :1].clone(), layers=[-1]), "out of range"),
        ("repeated layer", lambda: kvcore.scatter(lay, slots, good[:, :2].clone(), layers=[0, 0]), "repeats"),
        ("no layers", lambda: kvcore.scatter(lay, slots, good, layers=[]), "empty"),
        ("float slots", lambda: kvcore.scatter(lay, torch.tensor([1.0, 2.0, 3.0]), good), "integers"),
        ("2-D slots", lambda: kvcore.scatter(lay, slots.view(1, 3), good), "1-D"),
        ("slots not numbers", lambda: kvcore.scatter(lay, ["a", "b", "c"], good), "integer tensor"),
        ("wrong device", lambda: kvcore.scatter(lay, slots, good.to("meta")), "meta"),
        ("no src", lambda: kvcore.scatter(lay, slots, None), "needs src"),
        ("src not a tensor", lambda: kvcore.scatter(lay, slots, good.tolist()), "torch.Tensor"),
        ("sparse src", lambda: kvcore.scatter(lay, slots, good.to_sparse()), "dense"),
    ]


_BAD = [c[0] for c in _bad_calls(None)]


@pytest.mark.parametrize("what", _BAD)
def test_a_refused_scatter_leaves_the_cache_byte_identical(what):
    lay = _coded_layout()
    _, call, match = next(c for c in _bad_calls(lay) if c[0] == what)
    snap = _snapshot(lay)
    with pytest.raises(TransferError, match=match):
        call()
    assert _same(lay, snap), what


def test_a_refused_gather_leaves_out_and_cache_unchanged():
    lay = _coded_layout()
    snap = _snapshot(lay)
    out = torch.full(lay.staging_shape(3), 5.0)
    for slots, kw, match in [
        (torch.tensor([0, 1, SLOTS + 7]), {}, "out of range"),
        (torch.tensor([0, 1, 2]), {"layers": [0, 9]}, "out of range"),
    ]:
        with pytest.raises(TransferError, match=match):
            kvcore.gather(lay, slots, out, **kw)
        assert torch.all(out == 5.0)
    with pytest.raises(TransferError, match="float16"):
        kvcore.gather(lay, [0, 1, 2], torch.zeros(lay.staging_shape(3), dtype=torch.float16))
    assert _same(lay, snap)
    # gather tolerates duplicate slots (reading twice is fine)
    dup = kvcore.gather(lay, [4, 4])
    assert torch.equal(dup[:, :, 0], dup[:, :, 1])


def test_transfer_error_is_a_kvcore_error():
    assert issubclass(TransferError, kvcore.KVCoreError)


# -- property test: random geometry, random memory order, random slots --------------------

_AXES = ["TWO", "NB", "BS", "NH", "HS"]


@st.composite
def _cases(draw):
    cross = draw(st.booleans())
    axes = list(_AXES) + (["NL"] if cross else [])
    logical = draw(st.permutations(axes))
    physical = draw(st.permutations(axes))
    sizes = {
        "NL": draw(st.integers(1, 3)),
        "TWO": 2,
        "NB": draw(st.integers(1, 4)),
        "BS": draw(st.integers(1, 5)),
        "NH": draw(st.integers(1, 3)),
        "HS": draw(st.integers(1, 6)),
    }
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
    n_slots = sizes["NB"] * sizes["BS"]
    t = draw(st.integers(0, 8))
    slots = draw(st.lists(st.integers(-2, n_slots - 1), min_size=t, max_size=t))
    pad = (draw(st.sampled_from(axes)), draw(st.integers(0, 2)))  # padding on one physical axis
    return cross, logical, physical, sizes, dtype, slots, pad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_property_gather_matches_an_independent_oracle(case):
    cross, logical, physical, sizes, dtype, slots, (pad_axis, pad) = case
    it = _int(dtype)
    gen = torch.Generator().manual_seed(len(slots) * 31 + sizes["NB"])

    bases = []

    def one():
        shape = [sizes[a] + (pad if a == pad_axis else 0) for a in physical]
        phys = torch.randint(0, 2**8 if it == torch.uint8 else 2**15, shape, generator=gen).to(it).view(dtype)
        bases.append(phys)
        phys = phys.narrow(physical.index(pad_axis), 0, sizes[pad_axis])  # padded rows: only strides differ
        return phys.permute([physical.index(a) for a in logical])  # a permuted view, no copy

    name = "_".join(logical) if cross else "NL_X_" + "_".join(logical)
    kv = one() if cross else [one() for _ in range(sizes["NL"])]
    lay = build_layout(name, kv)
    got = kvcore.gather(lay, torch.tensor(slots, dtype=torch.int64))
    nl, nh, hs = sizes["NL"], sizes["NH"], sizes["HS"]
    assert got.shape == (2, nl, len(slots), nh * hs)
    # oracle: index the logical view by named axes, independently of kvcore
    for layer in range(nl):
        t = kv if cross else kv[layer]
        canon = ["NL", "TWO", "NB", "BS", "NH", "HS"] if cross else ["TWO", "NB", "BS", "NH", "HS"]
        v = t.permute([logical.index(a) for a in canon])
        if cross:
            v = v[layer]
        for i, s in enumerate(slots):
            for k in range(2):
                row = got[k, layer, i].view(it)
                if s < 0:
                    assert not row.any()
                else:
                    assert torch.equal(row, v[k, s // sizes["BS"], s % sizes["BS"]].reshape(-1).view(it))
    # scatter into a zeroed twin of the same memory order, then gather back
    valid = sorted({s for s in slots if s >= 0})
    if valid:
        n_before = len(bases)
        kv2 = one() if cross else [one() for _ in range(nl)]
        for b in bases[n_before:]:
            b.view(it).zero_()  # the whole allocation, padding included
        lay2 = build_layout(name, kv2)
        src = kvcore.gather(lay, torch.tensor(valid))
        kvcore.scatter(lay2, torch.tensor(valid), src)
        assert torch.equal(kvcore.gather(lay2, torch.tensor(valid)).view(it), src.view(it))
        # nothing but the valid slots' rows changed: padding stays zero, and no other slot
        written = sum(int((b.view(it) != 0).sum()) for b in bases[n_before:])
        assert written == int((src.view(it) != 0).sum())


def test_per_layer_views_into_a_blocks_first_pool():
    # kvcached / vLLM blocks-first: one pool [NB, NL, 2, BS, NH, HS], each layer registers
    # pool[:, layer] -> [NB, 2, BS, NH, HS] whose block stride spans every layer (dim-0 padding)
    pool = torch.zeros(NB, NL, 2, BS, NH, HS)
    views = [pool[:, layer] for layer in range(NL)]
    per_layer = build_layout("NL_X_NB_TWO_BS_NH_HS", views)
    whole = build_layout("NB_NL_TWO_BS_NH_HS", pool)
    assert per_layer.shape_desc().block_stride_elems == NL * 2 * BS * NH * HS
    assert per_layer.data_ptrs() == [pool[0, layer].data_ptr() for layer in range(NL)]
    # both readings address the same bytes for every (layer, K/V, slot, head)
    assert per_layer.stride_table().signature() == whole.stride_table().signature()
    for layer in range(NL):
        for k in range(2):
            pool[:, layer, k].view(torch.int32).copy_(_grid(layer, k, NB, BS, NH, HS))
    slots = [19, 3, -1, 8]
    want = _expected_rows(slots, range(NL), 2, NH, HS)
    assert torch.equal(kvcore.gather(per_layer, slots).view(torch.int32), want)
    # a scatter through one layer's view lands only in that layer's part of the pool
    kvcore.scatter(per_layer, [0], torch.full((2, 1, NH * HS), 6.0), layers=1)
    assert torch.all(pool[0, 1, :, 0] == 6.0)
    assert torch.equal(pool[0, 0, 0, 0].view(torch.int32), _grid(0, 0, NB, BS, NH, HS)[0, 0])
    assert torch.equal(pool[0, 2, 1, 0].view(torch.int32), _grid(2, 1, NB, BS, NH, HS)[0, 0])


def test_numpy_scalars_for_skip_prefix():
    import numpy as np

    lay = _coded_layout()
    out = torch.full(lay.staging_shape(2), 1.0)
    kvcore.gather(lay, [3, 4], out, skip_prefix=np.int64(1))
    assert torch.all(out[:, :, 0] == 1.0) and not torch.all(out[:, :, 1] == 1.0)
    with pytest.raises(TransferError, match="skip_prefix"):
        kvcore.gather(lay, [3, 4], skip_prefix=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cache_with_pinned_host_staging():
    name = "NL_X_TWO_NB_NH_BS_HS"
    kv = [torch.zeros(2, NB, NH, BS, HS, device="cuda") for _ in range(NL)]
    lay = build_layout(name, kv)
    _fill_codes(name, kv, 2)
    slots = [17, -1, 0, 9]
    want = _expected_rows(slots, range(NL), 2, NH, HS)
    host = torch.empty(lay.staging_shape(4), pin_memory=True)
    host.view(torch.int32).fill_(-5)
    kvcore.gather(lay, slots, host)
    want_host = want.clone()
    want_host[:, :, 1] = -5
    assert torch.equal(host.view(torch.int32), want_host)
    assert torch.equal(kvcore.gather(lay, slots).cpu().view(torch.int32), want)
    dst = build_layout(name, [torch.zeros(2, NB, NH, BS, HS, device="cuda") for _ in range(NL)])
    kvcore.scatter(dst, [3, -1, 4, 5], host)
    back = kvcore.gather(dst, [3, 4, 5]).cpu().view(torch.int32)
    assert torch.equal(back, want[:, :, [0, 2, 3]])


def test_interior_padding_between_heads_and_tokens():
    # head rows padded to HS+3 elements, token rows padded by 5 more: only strides differ
    buf = torch.zeros(NB, BS, NH * (HS + 3) + 5)
    t = buf[:, :, : NH * (HS + 3)].view(NB, BS, NH, HS + 3)[..., :HS]
    kv = [t]
    lay = build_layout("NL_X_NB_BS_NH_HS", kv)
    p = lay.stride_table().planes[0]
    assert (p.head, p.token, p.block) == ((HS + 3) * 4, (NH * (HS + 3) + 5) * 4, BS * (NH * (HS + 3) + 5) * 4)
    buf.view(torch.int32).copy_(torch.arange(buf.numel(), dtype=torch.int32).view(buf.shape))
    slots = [0, 13, -1, 19]
    got = kvcore.gather(lay, slots)
    for i, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(got[0, 0, i].view(torch.int32), t[s // BS, s % BS].reshape(-1).view(torch.int32))
    with pytest.raises(kvcore.GeometryError, match="dim-0 block axis"):
        lay.shape_desc()
    # padding bytes are never written by a scatter
    before = buf.clone()
    kvcore.scatter(lay, [5], torch.full((1, 1, 1, NH * HS), -1.0))
    changed = (buf.view(torch.int32) != before.view(torch.int32)).nonzero().tolist()
    assert len(changed) == NH * HS
    assert all(b == 1 and tok == 1 and e % (HS + 3) < HS and e < NH * (HS + 3) for b, tok, e in changed)


# -- a plugin spec with an extra row segment: blocked-scale records --------------------


class BlockedScaleSpec(kvcore.Spec):
    """``[NB, BS*V + BS*S]`` uint8 pages: a block's BS value records (V bytes each), then
    its BS scale records (S bytes each); the staged row is values then scales."""

    def _build(self):
        kv = self.kv_caches
        t = kv[0]
        bs, s = self.params["block_size"], self.params["scale_bytes"]
        v = t.shape[1] // bs - s
        self.num_layers_, self.num_blocks_, self.block_size_ = len(kv), t.shape[0], bs
        self.num_slots_, self.num_heads_, self.head_size_, self.kv_size_ = t.shape[0] * bs, 1, v + s, 1
        self.axis_sizes = {"NL": len(kv), "NB": t.shape[0], "BS": bs, "VALS": v, "SCALES": s}
        skew = self.params.get("skew", 0)
        bases = tuple((x, x.storage_offset()) for x in kv)
        vals = kvcore.spec.Plane(
            role="VALS",
            strides=kvcore.PlaneStrides(block=t.stride(0), token=v, head=0, chunk=0, chunk_bytes=v, n_chunks=1),
            num_heads=1,
            head_bytes=v,
            dtype=torch.uint8,
            bases=bases,
            staging=kvcore.spec.StagingTarget(buffer="kv", index=0, offset=0, head_stride=v + s),
        )
        scales = kvcore.spec.Plane(
            role="SCALES",
            strides=kvcore.PlaneStrides(block=t.stride(0), token=s, head=0, chunk=0, chunk_bytes=s, n_chunks=1),
            num_heads=1,
            head_bytes=s,
            dtype=torch.uint8,
            bases=tuple((x, off + bs * v + skew) for x, off in bases),
            staging=kvcore.spec.StagingTarget(buffer="kv", index=0, offset=v, head_stride=v + s),
        )
        self.table = kvcore.StrideTable(
            num_layers=len(kv),
            block_size=bs,
            num_slots=self.num_slots_,
            device=t.device,
            planes=(vals, scales),
            buffers=(kvcore.spec.StagingBuffer(key="kv", kv_size=1, row_bytes=v + s, dtype=torch.uint8),),
        )


def test_planes_sharing_a_staged_row_move_with_the_reference_kernel():
    class P:  # a spec answers for a name its plugin declares
        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_NB_BSV_BSS"))

        @kvcore.hookimpl
        def kvcore_spec(self, format):
            return BlockedScaleSpec if format.name == "NL_X_NB_BSV_BSS" else None

    kvcore.register_plugin(P(), name="blocked")
    bs, v, s = 4, 12, 4
    kv = [torch.randint(0, 256, (NB, bs * (v + s)), dtype=torch.uint8) for _ in range(2)]
    lay = build_layout("NL_X_NB_BSV_BSS", kv, params={"block_size": bs, "scale_bytes": s})
    assert lay.describe() == "2 x [5, 4x12, 4x4]"
    slots = [7, -1, 0, 18]
    got = kvcore.gather(lay, slots)
    assert got.shape == (1, 2, 4, v + s)
    for layer in range(2):
        for i, slot in enumerate(slots):
            if slot < 0:
                assert not got[0, layer, i].any()
                continue
            b, tok = divmod(slot, bs)
            want = torch.cat([kv[layer][b, tok * v : (tok + 1) * v], kv[layer][b, bs * v + tok * s : bs * v + (tok + 1) * s]])
            assert torch.equal(got[0, layer, i], want)
    dst = build_layout("NL_X_NB_BSV_BSS", [torch.zeros_like(x) for x in kv], params={"block_size": bs, "scale_bytes": s})
    kvcore.scatter(dst, [1, -1, 2, 3], got)
    assert torch.equal(kvcore.gather(dst, [1, 2, 3]), got[:, :, [0, 2, 3]])
    # a plane reaching past the page is refused when the layout is built
    with pytest.raises(kvcore.GeometryError, match="reaches byte"):
        build_layout("NL_X_NB_BSV_BSS", kv, params={"block_size": bs, "scale_bytes": s, "skew": 1})


def test_kernel_selection_skips_kernels_that_decline_the_stride_table(monkeypatch):
    """A kernel with ``supports(table) -> False`` (e.g. only classic tables) must not be
    chosen for that table, whatever its priority."""
    monkeypatch.delenv("KVCORE_KERNEL")
    seen = []

    class Picky:
        name = "picky"
        device_types = ("cpu",)
        formats = None
        priority = 10_000

        def available(self):
            return True

        def why(self):
            return "declines tables that are not classic K/V tables"

        def supports(self, table):
            seen.append(table)
            return table.classic

        def gather(self, plan):
            raise AssertionError("picky kernel must not be used for this table")

        scatter = gather

    class P:
        @kvcore.hookimpl
        def kvcore_register_kernels(self, register):
            register(Picky())

        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_NB_BSV_BSS"))

        @kvcore.hookimpl
        def kvcore_spec(self, format):
            return BlockedScaleSpec if format.name == "NL_X_NB_BSV_BSS" else None

    kvcore.register_plugin(P(), name="picky-plugin")
    kv = [torch.randint(0, 256, (NB, 4 * 16), dtype=torch.uint8)]
    lay = build_layout("NL_X_NB_BSV_BSS", kv, params={"block_size": 4, "scale_bytes": 4})
    got = kvcore.gather(lay, [5])
    assert torch.equal(got[0, 0, 0], torch.cat([kv[0][1, 12:24], kv[0][1, 52:56]]))
    kvcore.scatter(lay, [6], got)
    assert seen and all(len(t.planes) == 2 and not t.classic for t in seen)
