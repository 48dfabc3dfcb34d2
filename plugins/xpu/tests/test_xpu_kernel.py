"""The Triton kernel (``triton-xpu``) under Triton's interpreter, on CPU tensors.

No Intel GPU exists on the development machines, so the program runs in Triton's
interpreter (``TRITON_INTERPRET=1``), which executes it on the host against CPU tensors.
Every test compares with the torch reference kernel byte for byte, or with views of the
cache built independently of kvcore's stride table.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvcore_xpu import KERNEL, NAME  # noqa: E402
from kvcore_xpu.kernel import _Prepared, launch_params  # noqa: E402

import kvcore  # noqa: E402
from kvcore.errors import TransferError  # noqa: E402
from kvcore.kernels import TransferPlan, select_kernel  # noqa: E402
from kvcore.kernels.reference import REFERENCE  # noqa: E402
from kvcore.spec import Plane, PlaneStrides, StagingBuffer, StagingTarget, StrideTable  # noqa: E402


@pytest.fixture
def interp(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("KVCORE_KERNEL", raising=False)


def _rand_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    st = t.untyped_storage()
    n = st.nbytes()
    torch.empty(0, dtype=torch.uint8).set_(st, 0, (n,), (1,)).copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
    return t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).clone()


def _esz(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# -- hand-made stride tables, each with an engine-side view per plane ----------------------
#
# A case is (planes, buffers, views, tensors): ``views()[plane][layer]`` is ``[NB, BS, NH, E]``,
# built with torch views of the plane's tensors (the oracle), ``buffers`` the staging buffers.

NL, NB, BS, NH = 2, 5, 8, 3


def _plane(role, strides, nh, head_bytes, dtype, tensors, staging):
    return Plane(
        role=role,
        strides=strides,
        num_heads=nh,
        head_bytes=head_bytes,
        dtype=dtype,
        bases=tuple((t, t.storage_offset() * t.element_size()) for t in tensors),
        staging=staging,
    )


def case_multi_plane():
    """Four planes of four widths and dtypes, each staged into its own buffer: K values
    uint8 NHD, K scales fp16 (one per head), V values bf16 HND, V zeros fp32 HND."""
    hk, hv = 16, 8
    k = [torch.empty(NB, BS, NH, hk, dtype=torch.uint8) for _ in range(NL)]
    ks = [torch.empty(NB, BS, NH, dtype=torch.float16) for _ in range(NL)]
    v = [torch.empty(NB, NH, BS, hv, dtype=torch.bfloat16) for _ in range(NL)]
    vz = [torch.empty(NB, NH, BS, dtype=torch.float32) for _ in range(NL)]
    planes = (
        _plane("K", PlaneStrides(NH * hk * BS, NH * hk, hk, 0, hk, 1), NH, hk, torch.uint8, k, StagingTarget("K", None, 0, hk)),
        _plane("KS", PlaneStrides(NH * 2 * BS, NH * 2, 2, 0, 2, 1), NH, 2, torch.float16, ks, StagingTarget("KS", None, 0, 2)),
        _plane(
            "V",
            PlaneStrides(NH * BS * hv * 2, hv * 2, BS * hv * 2, 0, hv * 2, 1),
            NH,
            hv * 2,
            torch.bfloat16,
            v,
            StagingTarget("V", None, 0, hv * 2),
        ),
        _plane("VZ", PlaneStrides(NH * BS * 4, 4, BS * 4, 0, 4, 1), NH, 4, torch.float32, vz, StagingTarget("VZ", None, 0, 4)),
    )
    buffers = (
        StagingBuffer("K", None, NH * hk, torch.uint8),
        StagingBuffer("KS", None, NH * 2, torch.float16),
        StagingBuffer("V", None, NH * hv * 2, torch.bfloat16),
        StagingBuffer("VZ", None, NH * 4, torch.float32),
    )

    def views():  # built when asked: a reshape of a permuted view is a copy
        return [
            [t for t in k],
            [t.unsqueeze(-1) for t in ks],
            [t.transpose(1, 2) for t in v],
            [t.transpose(1, 2).unsqueeze(-1) for t in vz],
        ]

    return planes, buffers, views, k + ks + v + vz


def case_token_groups():
    """K with the block's tokens split in groups of 4 (``NB_BSC_NH_BSE_HS``) beside a
    classic NHD V, both in the one ``kv`` buffer."""
    hs, g = 8, 4
    esz = 2
    k = [torch.empty(NB, BS // g, NH, g, hs, dtype=torch.float16) for _ in range(NL)]
    v = [torch.empty(NB, BS, NH, hs, dtype=torch.float16) for _ in range(NL)]
    ks = PlaneStrides(
        block=BS * NH * hs * esz,
        token=hs * esz,
        head=g * hs * esz,
        chunk=0,
        chunk_bytes=hs * esz,
        n_chunks=1,
        token_group=g,
        token_group_stride=NH * g * hs * esz,
    )
    vs = PlaneStrides(BS * NH * hs * esz, NH * hs * esz, hs * esz, 0, hs * esz, 1)
    planes = (
        _plane("K", ks, NH, hs * esz, torch.float16, k, StagingTarget("kv", 0, 0, hs * esz)),
        _plane("V", vs, NH, hs * esz, torch.float16, v, StagingTarget("kv", 1, 0, hs * esz)),
    )
    buffers = (StagingBuffer("kv", 2, NH * hs * esz, torch.float16),)

    def views():
        return [[t.permute(0, 1, 3, 2, 4).reshape(NB, BS, NH, hs) for t in k], [t for t in v]]

    return planes, buffers, views, k + v


def case_chunked_heads():
    """ROCm-style split K ``[NB, NH, HS/x, BS, x]`` (16-byte chunks interleaved across
    tokens) and a transposed V ``[NB, NH, HS, BS]`` (one element per chunk), bf16."""
    hs, x, esz = 16, 8, 2
    k = [torch.empty(NB, NH, hs // x, BS, x, dtype=torch.bfloat16) for _ in range(NL)]
    v = [torch.empty(NB, NH, hs, BS, dtype=torch.bfloat16) for _ in range(NL)]
    kst = PlaneStrides(
        block=NH * hs * BS * esz, token=x * esz, head=hs * BS * esz, chunk=BS * x * esz, chunk_bytes=x * esz, n_chunks=hs // x
    )
    vst = PlaneStrides(block=NH * hs * BS * esz, token=esz, head=hs * BS * esz, chunk=BS * esz, chunk_bytes=esz, n_chunks=hs)
    planes = (
        _plane("K", kst, NH, hs * esz, torch.bfloat16, k, StagingTarget("kv", 0, 0, hs * esz)),
        _plane("V", vst, NH, hs * esz, torch.bfloat16, v, StagingTarget("kv", 1, 0, hs * esz)),
    )
    buffers = (StagingBuffer("kv", 2, NH * hs * esz, torch.bfloat16),)

    def views():
        return [[t.permute(0, 3, 1, 2, 4).reshape(NB, BS, NH, hs) for t in k], [t.permute(0, 3, 1, 2) for t in v]]

    return planes, buffers, views, k + v


def case_interleaved_row():
    """Two planes sharing one staged row, interleaved per head: head h's 12 value bytes,
    then its 4 scale bytes (values HND, scales NHD, at a 24-byte dim-0 offset)."""
    hv, hsc = 12, 4
    vals = [torch.empty(NB, NH, BS, hv, dtype=torch.uint8) for _ in range(NL)]
    big = [torch.empty(NB * BS * NH * hsc + 24, dtype=torch.uint8) for _ in range(NL)]
    sc = [b[24:].view(NB, BS, NH, hsc) for b in big]
    w = hv + hsc
    planes = (
        _plane("VALS", PlaneStrides(NH * BS * hv, hv, BS * hv, 0, hv, 1), NH, hv, torch.uint8, vals, StagingTarget("kv", 0, 0, w)),
        _plane("SCALES", PlaneStrides(BS * NH * hsc, NH * hsc, hsc, 0, hsc, 1), NH, hsc, torch.uint8, sc, StagingTarget("kv", 0, hv, w)),
    )
    buffers = (StagingBuffer("kv", 1, NH * w, torch.uint8),)

    def views():
        return [[t.transpose(1, 2) for t in vals], [t for t in sc]]

    return planes, buffers, views, vals + sc


CASES = {
    "multi_plane": case_multi_plane,
    "token_groups": case_token_groups,
    "chunked_heads": case_chunked_heads,
    "interleaved_row": case_interleaved_row,
}


def _table(planes, buffers) -> StrideTable:
    return StrideTable(num_layers=NL, block_size=BS, num_slots=NB * BS, device=torch.device("cpu"), planes=planes, buffers=buffers)


def _staging(buffers, t: int, fill: int, *, strided: bool = False) -> dict[str, torch.Tensor]:
    """One buffer per key, filled with ``fill`` bytes; ``strided``: each a view into a
    larger buffer (rows padded, the token axis cut short: a non-contiguous view)."""
    out = {}
    for b in buffers:
        shape = b.shape(NL, t)
        if strided:
            big = torch.empty(*shape[:-2], t + 3, shape[-1] + 5, dtype=b.dtype)
            big.view(torch.uint8).fill_(fill)
            out[b.key] = big[..., 1 : t + 1, 2 : 2 + shape[-1]]
        else:
            out[b.key] = torch.full(shape, 0, dtype=b.dtype)
            out[b.key].view(torch.uint8).fill_(fill)
    return out


def _plan(table, slots, staging) -> TransferPlan:
    s = torch.tensor(slots, dtype=torch.int64)
    return TransferPlan(
        table=table, slots=s, staging=staging if len(staging) > 1 or "kv" not in staging else staging["kv"], num_valid=int((s >= 0).sum())
    )


SLOTS = [17, 3, -1, 39, 0, 8, 22, -1, 31, 9, 10, 11]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided_staging"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gather_and_scatter_match_the_engine_views_and_the_reference(interp, name, strided):
    planes, buffers, views, tensors = CASES[name]()
    gen = torch.Generator().manual_seed(7)
    for t in tensors:
        _rand_(t, gen)
    table = _table(planes, buffers)
    got = _staging(buffers, len(SLOTS), 0xA5, strided=strided)
    want = _staging(buffers, len(SLOTS), 0xA5, strided=strided)
    KERNEL.gather(_plan(table, SLOTS, got))
    REFERENCE.gather(_plan(table, SLOTS, want))
    for key in got:
        assert torch.equal(_bytes(got[key]), _bytes(want[key])), key
    # the oracle: each staged row holds the engine's view of that (layer, slot, head)
    engine = views()
    for pi, p in enumerate(planes):
        buf = got[p.staging.buffer]
        for layer in range(NL):
            rows = buf[layer] if p.staging.index is None else buf[p.staging.index, layer]
            rows_u8 = rows.contiguous().view(torch.uint8)
            for i, slot in enumerate(SLOTS):
                if slot < 0:
                    assert (rows_u8[i] == 0xA5).all()
                    continue
                eng = engine[pi][layer][slot // BS, slot % BS].contiguous().view(torch.uint8).reshape(p.num_heads, -1)
                for h in range(p.num_heads):
                    at = p.staging.offset + h * p.staging.head_stride
                    assert torch.equal(rows_u8[i, at : at + p.head_bytes], eng[h]), (p.role, layer, slot, h)
    # scatter random staging rows into the cache: byte-identical to the reference
    src = _staging(buffers, len(SLOTS), 0, strided=strided)
    for b in src.values():
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    scatter_slots = [s if s < 0 else (s * 7 + 3) % (NB * BS) for s in SLOTS]
    assert len(set(s for s in scatter_slots if s >= 0)) == sum(s >= 0 for s in scatter_slots)
    before = [_bytes(t) for t in tensors]
    KERNEL.scatter(_plan(table, scatter_slots, src))
    after_kernel = [_bytes(t) for t in tensors]
    for t, b in zip(tensors, before):
        _bytes_set(t, b)
    REFERENCE.scatter(_plan(table, scatter_slots, src))
    for t, a in zip(tensors, after_kernel):
        assert torch.equal(_bytes(t), a)
    assert any(not torch.equal(a, b) for a, b in zip(after_kernel, before))


def _bytes_set(t: torch.Tensor, b: torch.Tensor) -> None:
    st = t.untyped_storage()
    torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).copy_(b)


# -- the partial last chunk ----------------------------------------------------------------
#
# An offloading connector moves a request in chunks of C tokens through one preallocated
# chunk buffer [kv, NL, C, row]; the last chunk has fewer tokens than C (and than a block),
# and its staging buffer is the view buf[:, :, :n] -- not contiguous. A kernel that assumes
# a contiguous staging buffer writes the wrong rows, or past the view (one offloading
# project's XPU path loses the device here). The kernel reads the view's strides.

FORMATS = {
    "NHD": ("NL_X_TWO_NB_BS_NH_HS", lambda nb, bs: (2, nb, bs, 4, 16), torch.bfloat16),
    "HND": ("NL_X_TWO_NB_NH_BS_HS", lambda nb, bs: (2, nb, 4, bs, 16), torch.float16),
    "MLA": ("NL_X_NB_BS_HS", lambda nb, bs: (nb, bs, 40), torch.bfloat16),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_partial_last_chunk_through_non_contiguous_staging_views(interp, monkeypatch, fmt):
    name, shape, dtype = FORMATS[fmt]
    nl, nb, bs, chunk = 3, 6, 16, 16
    gen = torch.Generator().manual_seed(3)
    caches = [_rand_(torch.empty(shape(nb, bs), dtype=dtype), gen) for _ in range(nl)]
    lay = kvcore.build_layout(name, caches)
    T = 37  # 2 full chunks of 16, then 5 tokens: not a multiple of the block size either
    assert T % bs and T % chunk
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[[4, 33]] = -1
    monkeypatch.setenv("KVCORE_KERNEL", "reference")
    whole = kvcore.gather(lay, slots)
    monkeypatch.setenv("KVCORE_KERNEL", NAME)
    buf = torch.empty(lay.staging_shape(chunk), dtype=dtype)
    for start in range(0, T, chunk):
        n = min(chunk, T - start)
        buf.view(torch.uint8).fill_(0x5A)
        view = buf[:, :, :n]
        assert n == chunk or not view.is_contiguous()
        kvcore.gather(lay, slots[start : start + n], view)
        got = view.clone()
        want = whole[:, :, start : start + n]
        pad = slots[start : start + n] < 0
        assert torch.equal(got[:, :, ~pad].view(torch.uint8), want[:, :, ~pad].view(torch.uint8))
        assert (got[:, :, pad].view(torch.uint8) == 0x5A).all()  # padding rows untouched
        assert (buf[:, :, n:].view(torch.uint8) == 0x5A).all()  # nothing written past the view
        # one layer of the partial chunk: a 3-D view [kv, n, row] with the layer's stride
        one = torch.empty(lay.staging_shape(chunk, 1), dtype=dtype)
        one.view(torch.uint8).fill_(0x5A)
        kvcore.gather(lay, slots[start : start + n], one[:, :n], layers=1)
        assert torch.equal(one[:, :n][:, ~pad].view(torch.uint8), want[:, 1][:, ~pad].view(torch.uint8))
        assert (one[:, n:].view(torch.uint8) == 0x5A).all()
    # scatter the chunks back through the same kind of views into a fresh cache
    dst = [torch.zeros_like(c) for c in caches]
    ref = [torch.zeros_like(c) for c in caches]
    dl, rl = kvcore.build_layout(name, dst), kvcore.build_layout(name, ref)
    for start in range(0, T, chunk):
        n = min(chunk, T - start)
        buf.copy_(torch.zeros_like(buf))
        buf[:, :, :n] = whole[:, :, start : start + n]
        monkeypatch.setenv("KVCORE_KERNEL", NAME)
        kvcore.scatter(dl, slots[start : start + n], buf[:, :, :n])
        monkeypatch.setenv("KVCORE_KERNEL", "reference")
        kvcore.scatter(rl, slots[start : start + n], buf[:, :, :n])
    for a, b in zip(dst, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert a.view(torch.uint8).any()


# -- the device's launch cuts, run in the interpreter -------------------------------------------
#
# On a GPU a launch is cut in many small programs: several pieces per segment and a masked
# tail, several segment steps per row, many token tiles. The interpreter normally runs few
# large programs; with tiny tiles it runs every one of those paths on CPU tensors.


@pytest.fixture
def device_cuts(interp, monkeypatch):
    from kvcore_xpu import kernel as km

    monkeypatch.setattr(km, "_INTERP_FEW", False)
    monkeypatch.setattr(km, "_TILE_BYTES", 64)  # 8 units of 8 bytes per step
    monkeypatch.setattr(km, "_MAX_PIECE", 4)
    monkeypatch.setattr(km, "_MIN_PROGRAMS", 1)
    return km


@pytest.mark.parametrize("name", sorted(CASES))
def test_device_cuts_match_the_reference(device_cuts, name):
    planes, buffers, _, tensors = CASES[name]()
    gen = torch.Generator().manual_seed(11)
    for t in tensors:
        _rand_(t, gen)
    table = _table(planes, buffers)
    got, want = _staging(buffers, len(SLOTS), 0xA5, strided=True), _staging(buffers, len(SLOTS), 0xA5, strided=True)
    KERNEL.gather(_plan(table, SLOTS, got))
    REFERENCE.gather(_plan(table, SLOTS, want))
    for key in got:
        assert torch.equal(_bytes(got[key]), _bytes(want[key])), key
    src = _staging(buffers, len(SLOTS), 0)
    for b in src.values():
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    before = [_bytes(t) for t in tensors]
    KERNEL.scatter(_plan(table, SLOTS, src))
    after = [_bytes(t) for t in tensors]
    for t, b in zip(tensors, before):
        _bytes_set(t, b)
    REFERENCE.scatter(_plan(table, SLOTS, src))
    assert all(torch.equal(_bytes(t), a) for t, a in zip(tensors, after))


@pytest.mark.parametrize(
    "name,shape,dtype,bs",
    [
        ("NL_X_TWO_NB_NH_BS_HS", (2, 5, 3, 6, 40), torch.bfloat16, 6),  # 3 heads of 80 B, BS not a power of two
        ("NL_X_NB_BS_HS", (5, 8, 72), torch.bfloat16, 8),  # a 144-byte row: 2 pieces of 64, a tail of 16
        ("NL_X_TWO_NB_BS_NH_HS", (2, 5, 4, 3, 12), torch.float16, 4),  # 72-byte rows: 8-byte units
    ],
)
def test_device_cuts_of_pieces_tails_and_segment_steps(device_cuts, name, shape, dtype, bs):
    km = device_cuts
    gen = torch.Generator().manual_seed(5)
    caches = [_rand_(torch.empty(shape, dtype=dtype), gen) for _ in range(3)]
    lay = kvcore.build_layout(name, caches)
    tb = lay.stride_table()
    assert tb.block_size == bs
    slots = torch.tensor([7, -1, 3, 0, 19, 12, 5, 13, 1, -1, 2])
    (ln,) = km._Prepared(tb).launches
    lp = km.launch_params(ln, torch.empty(lay.staging_shape(len(slots)), dtype=dtype), len(slots), 3)
    assert lp.n_tiles > 1 and (lp.n_full > 1 or lp.tail or ln.n_segs > lp.nseg)
    got = torch.full(lay.staging_shape(len(slots)), 3.0, dtype=dtype)
    want = got.clone()
    KERNEL.gather(TransferPlan(tb, slots, got, 9))
    REFERENCE.gather(TransferPlan(tb, slots, want, 9))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    dst = [torch.zeros_like(c) for c in caches]
    ref = [torch.zeros_like(c) for c in caches]
    KERNEL.scatter(TransferPlan(kvcore.build_layout(name, dst).stride_table(), slots, got, 9))
    REFERENCE.scatter(TransferPlan(kvcore.build_layout(name, ref).stride_table(), slots, got, 9))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dst, ref))
    assert any(a.view(torch.uint8).any() for a in dst)


def test_a_repeated_transfer_with_strided_slots_is_not_served_from_the_cache(interp):
    """The launch cache is keyed by the slots' stride too: the same call with a strided
    slot view (same count) reads the right slots."""
    gen = torch.Generator().manual_seed(2)
    caches = [_rand_(torch.empty(2, 6, 8, 2, 16, dtype=torch.float16), gen) for _ in range(2)]
    tb = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches).stride_table()
    out = torch.zeros(2, 2, 4, 32, dtype=torch.float16)
    KERNEL.gather(TransferPlan(tb, torch.tensor([1, 2, 3, 4]), out, 4))
    strided = torch.tensor([40, 0, 9, 0, 17, 0, 30, 0])[::2]
    assert not strided.is_contiguous()
    KERNEL.gather(TransferPlan(tb, strided, out, 4))
    want = torch.zeros_like(out)
    REFERENCE.gather(TransferPlan(tb, strided.contiguous(), want, 4))
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_devices_compare_by_type_and_index(monkeypatch):
    """``cuda`` means the current CUDA device: the same device as ``cuda:<current>``,
    another than ``cuda:<other>``; types never match across."""
    from kvcore_xpu.kernel import _same

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 0)
    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:1")
    assert _same(cuda, cuda1) and _same(cuda1, cuda) and _same(cuda0, cuda0) and _same(cuda, cuda)
    assert not _same(cuda, cuda0) and not _same(cuda0, cuda1)
    assert _same(torch.device("xpu"), torch.device("xpu:0")) and not _same(torch.device("xpu"), torch.device("xpu:1"))
    assert not _same(torch.device("xpu:0"), cuda0) and not _same(torch.device("cpu"), cuda0)
    assert _same(torch.device("cpu"), torch.device("cpu"))


# -- units, alignment and launch shape -------------------------------------------------------


def _launches(tb):
    return _Prepared(tb).launches


def test_unit_width_is_the_widest_every_address_allows(interp):
    caches = [torch.empty(2, 4, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)
    tb = lay.stride_table()
    (ln,) = _launches(tb)
    assert (ln.n_segs, ln.seg_bytes) == (1, 256)  # both heads are one run on both sides
    aligned = torch.empty(2, 2, 10, 128, dtype=torch.bfloat16)
    lp = launch_params(ln, aligned, 10, 2)
    assert (lp.unit, lp.align, lp.seg_vecs) == (8, 16, 16)
    assert (lp.piece, lp.n_full, lp.tail) == (32, 1, 0) and lp.bs_pow2
    # a small transfer is spread over one program per token; the interpreter asks for few
    assert (lp.block_t, lp.n_tiles) == (1, 10)
    assert launch_params(ln, aligned, 10, 2, few=True).n_tiles == 1
    # a view one element in: every address is only 2-byte aligned, so units are int16
    big = torch.empty(2 * 2 * 10 * 128 + 1, dtype=torch.bfloat16)
    big.zero_()
    odd = big[1:].view(2, 2, 10, 128)
    lp = launch_params(ln, odd, 10, 2)
    assert (lp.unit, lp.align, lp.seg_vecs, lp.piece, lp.tail) == (2, 2, 128, 128, 0)
    # and the bytes still move unchanged
    gen = torch.Generator().manual_seed(1)
    for c in caches:
        _rand_(c, gen)
    slots = torch.tensor([5, -1, 60, 0, 33, 2, 7, 9, 63, 1])
    ref = torch.zeros(2, 2, 10, 128, dtype=torch.bfloat16)
    REFERENCE.gather(TransferPlan(tb, slots, ref, 9))
    KERNEL.gather(TransferPlan(tb, slots, odd, 9))
    assert torch.equal(odd.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize(
    "name,shape,nl,tokens,want",
    [
        # Llama-3-8B per rank (32 layers, 8 heads of 128, bf16) and a DeepSeek MLA latent
        # (61 layers, 576): (segments per row, units per piece, pieces, tail units,
        # segments per step, tokens per program, programs per pair); 8-byte units
        ("NL_X_TWO_NB_BS_NH_HS", (2, 2, 16, 8, 128), 32, 8192, (1, 256, 1, 0, 1, 8, 1024)),
        ("NL_X_TWO_NB_BS_NH_HS", (2, 2, 64, 8, 128), 32, 256, (1, 256, 1, 0, 1, 8, 32)),
        ("NL_X_TWO_NB_NH_BS_HS", (2, 2, 8, 16, 128), 32, 8192, (8, 32, 1, 0, 8, 8, 1024)),
        ("NL_X_TWO_NB_NH_BS_HS", (2, 2, 8, 64, 128), 32, 256, (8, 32, 1, 0, 8, 8, 32)),
        ("NL_X_NB_BS_HS", (2, 64, 576), 61, 8192, (1, 128, 1, 16, 1, 16, 512)),
        ("NL_X_NB_BS_HS", (2, 16, 576), 61, 256, (1, 128, 1, 16, 1, 8, 32)),
        # a long row (32 heads of 128, 8 KB): two steps of 4 KB pieces, four tokens per program
        ("NL_X_TWO_NB_BS_NH_HS", (2, 2, 16, 32, 128), 4, 8192, (1, 512, 2, 0, 1, 4, 2048)),
    ],
)
def test_launch_shape_of_the_benchmark_geometries(name, shape, nl, tokens, want):
    """About 16 KB per program step at 8192 tokens, as a (token, run) tile: whole rows for
    NHD and MLA (a 1152-byte MLA row: 1024 + 128 bytes), (token, head) runs for HND; at
    least 1024 programs at 256 tokens."""
    caches = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(nl)]
    lay = kvcore.build_layout(name, caches)
    tb = lay.stride_table()
    (ln,) = _launches(tb)
    staging = torch.empty(lay.staging_shape(tokens), dtype=torch.bfloat16, device="meta")
    lp = launch_params(ln, staging, tokens, nl)
    assert (ln.n_segs, lp.piece, lp.n_full, lp.tail, lp.nseg, lp.block_t, lp.n_tiles) == want
    assert lp.unit == 8 and lp.align == 16 and lp.chunks == ((0, nl * len(tb.planes)),)
    assert lp.seg_vecs * 16 == ln.seg_bytes == lp.unit * (lp.piece * lp.n_full + (lp.tail and ln.seg_bytes // 8 - lp.piece * lp.n_full))


def test_planes_of_one_buffer_with_different_runs_are_separate_launches():
    """A chunked K (16-byte chunks) beside a transposed V (2-byte chunks) in one ``kv``
    buffer: two launches, each with its segment offsets (head, chunk) on both sides."""
    planes, buffers, _, _ = case_chunked_heads()
    k, v = _launches(_table(planes, buffers))
    assert (k.n_segs, k.seg_bytes, v.n_segs, v.seg_bytes) == (NH * 2, 16, NH * 16, 2)
    kst = planes[0].strides
    want_cache = [h * kst.head + c * kst.chunk for h in range(NH) for c in range(2)]
    want_stage = [h * 32 + c * 16 for h in range(NH) for c in range(2)]
    assert k.segs[0, 0].tolist() == want_cache and k.segs[0, 1].tolist() == want_stage
    assert k.desc[0, :6].tolist() == [kst.block, kst.token, BS, 0, 0, 0]
    assert v.desc[0, 4] == 1  # V is index 1 of the kv buffer


def test_one_launch_moves_all_layers_and_planes(interp, monkeypatch):
    """A classic table is one launch over every (layer, K/V) pair; a table staged into
    four buffers is four launches."""
    from kvcore_xpu import _triton_copy

    calls = []
    real = _triton_copy.jitted

    class Spy:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            calls.append(grid)
            return self.fn[grid]

    monkeypatch.setattr(_triton_copy, "jitted", lambda interp: Spy(real(interp)))
    caches = [torch.randn(2, 4, 16, 2, 8) for _ in range(5)]
    lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)
    monkeypatch.setenv("KVCORE_KERNEL", NAME)
    out = kvcore.gather(lay, torch.arange(20))
    assert len(calls) == 1
    monkeypatch.setenv("KVCORE_KERNEL", "reference")
    assert torch.equal(out, kvcore.gather(lay, torch.arange(20)))
    calls.clear()
    planes, buffers, _, tensors = case_multi_plane()
    KERNEL.gather(_plan(_table(planes, buffers), [1, 2, 3], _staging(buffers, 3, 0)))
    assert len(calls) == 4


# -- what the device compiles, and how a repeated transfer launches ---------------------------
#
# No GPU here, but Triton compiles for one without it: the program is compiled for sm_90
# (an H200) from the launches the kernel cuts, the PTX read for 16-byte vector accesses and
# 64-bit divisions, and tiles of one element compiled at all (Triton folds them into
# scalars; an alignment hint of the wrong rank then aborts the compiler).


def _ptx(args, kw) -> str:
    """The PTX of the program for the launch ``(args, kw)`` (``launch_args``), for sm_90."""
    import triton
    from kvcore_xpu import _triton_copy as tc
    from triton.backends.compiler import GPUTarget

    fn = tc.jitted(False)
    kw = dict(kw)
    warps = kw.pop("num_warps")
    sig = {"slots_ptr": "*i64"}
    for name, a in zip(fn.arg_names[1:], args):
        sig[name] = "*i64" if isinstance(a, torch.Tensor) else "i32" if -(2**31) <= a < 2**31 else "i64"
    sig.update({k: "constexpr" for k in kw})
    names = fn.arg_names
    src = triton.compiler.ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in kw.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n] == "*i64"},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]


@pytest.fixture
def compiled(monkeypatch):
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # no floating point here; silences 3.9's notice
    from kvcore_xpu import _triton_copy as tc

    return tc


@pytest.mark.parametrize(
    "name,shape,nl,tokens",
    [
        ("NL_X_TWO_NB_BS_NH_HS", (2, 2, 16, 8, 128), 32, 256),
        ("NL_X_TWO_NB_NH_BS_HS", (2, 2, 8, 16, 128), 32, 8192),
        ("NL_X_NB_BS_HS", (2, 64, 576), 61, 8192),
    ],
    ids=["NHD", "HND", "MLA"],
)
def test_benchmark_geometries_compile_to_16_byte_vectors_without_divisions(compiled, name, shape, nl, tokens):
    from kvcore_xpu.kernel import launch_args

    caches = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(nl)]
    lay = kvcore.build_layout(name, caches)
    (ln,) = _launches(lay.stride_table())
    lp = launch_params(ln, torch.empty(lay.staging_shape(tokens), dtype=torch.bfloat16, device="meta"), tokens, nl)
    for gather in (True, False):
        ptx = _ptx(*launch_args(ln, lp, tokens, 0, gather, compiled.UNIT_TYPES))
        loads = [line for line in ptx.splitlines() if "ld.global" in line and "b64" in line]
        stores = [line for line in ptx.splitlines() if "st.global" in line]
        # every store, and every load but the descriptor and slot reads, is a 16-byte vector
        assert stores and all(".v2.b64" in line for line in stores), stores[:3]
        assert sum(".v2.b64" in line for line in loads) == len(stores)
        assert "div.s64" not in ptx and "rem.s64" not in ptx and "div.u64" not in ptx


def test_tiles_of_one_element_and_every_unit_width_compile(compiled):
    """Small transfers cut into programs of one token, one segment, one unit (every
    hand-made table above, an NHD cache staged at an odd address: 2-byte units, 5- and
    1-byte rows: 1-byte units)."""
    from kvcore_xpu.kernel import launch_args

    launches = []
    for make in CASES.values():
        planes, buffers, _, _ = make()
        table = _table(planes, buffers)
        staging = _staging(buffers, 1, 0)
        for ln in _launches(table):
            launches.append((ln, launch_params(ln, staging[ln.key], 1, NL)))
    caches = [torch.empty(2, 4, 16, 1, 4, dtype=torch.bfloat16) for _ in range(2)]
    (ln,) = _launches(kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches).stride_table())
    odd = torch.empty(2 * 2 * 1 * 4 + 1, dtype=torch.bfloat16)[1:].view(2, 2, 1, 4)
    launches.append((ln, launch_params(ln, odd, 1, 2)))
    for width in (5, 1):  # 5-byte rows (1-byte units, a tail piece), 1-byte rows: a [1, 1, 1] tile
        caches = [torch.empty(4, 16, width, dtype=torch.uint8) for _ in range(2)]
        (ln,) = _launches(kvcore.build_layout("NL_X_NB_BS_HS", caches).stride_table())
        launches.append((ln, launch_params(ln, torch.empty(2, 1, width, dtype=torch.uint8), 1, 2)))
    assert {lp.block_t for _, lp in launches} == {1} and {lp.unit for _, lp in launches} >= {1, 2, 4, 8}
    assert any(lp.piece == 1 and lp.nseg == 1 for _, lp in launches)
    for ln, lp in launches:
        assert "st.global" in _ptx(*launch_args(ln, lp, 1, 0, False, compiled.UNIT_TYPES))


@pytest.fixture
def direct_launch(interp, monkeypatch):
    """The compiled path on CPU tensors: the JIT returns Triton's own ``CompiledKernel``
    whose launcher (``state["launcher"]``, by default: run the program in the interpreter
    with the arguments it receives, by name) is what a repeated transfer calls."""
    from types import SimpleNamespace

    from kvcore_xpu import _triton_copy as tc
    from kvcore_xpu import kernel as km
    from triton.compiler import compiler as tcomp

    program = tc.jitted(True)
    names = program.arg_names
    state = {"jit": 0, "runner": 0}

    def run_by_name(g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
        assert (g2, stream, function) == (1, "stream", "function") and len(args) == len(names)
        state["runner"] += 1
        program[(g0, g1, g2)](**dict(zip(names, args)))

    state["launcher"] = run_by_name
    ck = object.__new__(tcomp.CompiledKernel)
    ck.module, ck._module_pid, ck.function, ck.packed_metadata = object(), None, "function", None
    ck.name, ck.src, ck.metadata = "_copy_rows", None, None  # read when a launch hook is set
    ck._run = lambda *a: state["launcher"](*a)
    monkeypatch.setattr(
        tcomp, "driver", SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: "stream"))
    )

    class Jit:
        arg_names = names

        def __getitem__(self, grid):
            def launch(*args, **kw):
                state["jit"] += 1
                kw.pop("num_warps")
                program[grid](*args, **kw)
                return ck

            return launch

    monkeypatch.setattr(km, "_program", lambda: (Jit(), tc))
    monkeypatch.setattr(km, "interpreting", lambda: False)  # the compiled path ...
    monkeypatch.setattr(km.TritonKernel, "_check", lambda self, plan, dev: plan.buffers)  # ... on CPU tensors
    monkeypatch.setattr(km, "_MIN_PROGRAMS", 1)
    monkeypatch.setattr(km, "_FAST_OFF", [])
    return state


def test_a_repeated_transfer_calls_the_compiled_kernels_runner_with_every_argument(direct_launch):
    """A repeated transfer skips the JIT: it calls Triton's own ``CompiledKernel[grid]``
    runner (grid padded to three dimensions) with every argument in the program's order.
    Here that runner's launcher runs the program in the interpreter with the arguments it
    receives, by name: the bytes it moves prove the order."""
    seen = direct_launch
    planes, buffers, _, tensors = case_chunked_heads()  # two launches: two run shapes
    gen = torch.Generator().manual_seed(4)
    for t in tensors:
        _rand_(t, gen)
    table = _table(planes, buffers)
    want = _staging(buffers, len(SLOTS), 0)
    REFERENCE.gather(_plan(table, SLOTS, want))
    got = _staging(buffers, len(SLOTS), 0)
    plan = _plan(table, SLOTS, got)
    KERNEL.gather(plan)
    assert (seen["jit"], seen["runner"]) == (2, 0) and torch.equal(_bytes(got["kv"]), _bytes(want["kv"]))
    got["kv"].zero_()
    KERNEL.gather(plan)
    assert (seen["jit"], seen["runner"]) == (2, 2) and torch.equal(_bytes(got["kv"]), _bytes(want["kv"]))
    # scatter: first call through the JIT, the repeat through the runner
    src = _staging(buffers, len(SLOTS), 0)
    src["kv"].view(torch.uint8).copy_(torch.randint(0, 256, src["kv"].view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    before = [_bytes(t) for t in tensors]
    REFERENCE.scatter(_plan(table, SLOTS, src))
    ref = [_bytes(t) for t in tensors]
    splan = _plan(table, SLOTS, src)
    for _ in range(2):
        for t, b in zip(tensors, before):
            _bytes_set(t, b)
        KERNEL.scatter(splan)
        assert all(torch.equal(_bytes(t), r) for t, r in zip(tensors, ref))
    assert (seen["jit"], seen["runner"]) == (4, 4)


def test_a_refused_direct_launch_falls_back_to_the_jit_for_good(direct_launch):
    """A Triton whose compiled-kernel runner refuses the call (as one reading a grid
    dimension that is not there): the transfer still moves its bytes, through the JIT,
    with one warning; later transfers go straight to the JIT."""
    seen = direct_launch

    def refuses(*args):
        raise IndexError("tuple index out of range")

    seen["launcher"] = refuses
    caches = [_rand_(torch.empty(2, 6, 8, 2, 16, dtype=torch.float16), torch.Generator().manual_seed(9)) for _ in range(2)]
    tb = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches).stride_table()
    slots = torch.tensor([40, 3, -1, 17])
    want = torch.zeros(2, 2, 4, 32, dtype=torch.float16)
    REFERENCE.gather(TransferPlan(tb, slots, want, 3))
    out = torch.zeros_like(want)
    plan = TransferPlan(tb, slots, out, 3)
    KERNEL.gather(plan)
    out.zero_()
    with pytest.warns(RuntimeWarning, match="launching through the JIT from now on"):
        KERNEL.gather(plan)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)) and seen["jit"] == 2
    out.zero_()
    KERNEL.gather(plan)
    KERNEL.gather(plan)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)) and seen["jit"] == 4 and seen["runner"] == 0


# -- selection and refusals -------------------------------------------------------------------


def test_selection_serves_xpu_and_only_when_forced_elsewhere(monkeypatch):
    monkeypatch.delenv("KVCORE_KERNEL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "cpu" not in KERNEL.device_types and {"xpu", "cuda"} <= set(KERNEL.device_types)
    assert KERNEL.supports is not None and KERNEL.accepts("xpu") and not KERNEL.accepts("cuda") and not KERNEL.accepts("cpu")
    assert select_kernel("cpu", "NL_X_TWO_NB_BS_NH_HS", "cpu").name != NAME
    monkeypatch.setenv("KVCORE_KERNEL", NAME)
    with pytest.raises(TransferError, match=f"KVCORE_KERNEL={NAME} does not serve .* on cpu"):
        select_kernel("cpu", "NL_X_TWO_NB_BS_NH_HS", "cpu")
    # under the interpreter it serves CPU tensors, but only when forced
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "cpu" in KERNEL.device_types and KERNEL.available()
    assert select_kernel("cpu", "NL_X_TWO_NB_BS_NH_HS", "cpu").name == NAME
    monkeypatch.delenv("KVCORE_KERNEL")
    assert select_kernel("cpu", "NL_X_TWO_NB_BS_NH_HS", "cpu").name != NAME
    assert not KERNEL.accepts("xpu")  # an XPU cache is never handed to the interpreter


def test_refuses_before_writing(monkeypatch):
    """Outside the interpreter a CPU cache is refused; a staging buffer of the wrong shape
    is refused; neither the cache nor the staging buffer changes."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    caches = [torch.randn(2, 4, 16, 2, 8) for _ in range(2)]
    lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)
    tb = lay.stride_table()
    before = [c.clone() for c in caches]
    out = torch.full((2, 2, 3, 16), 7.0)
    with pytest.raises(TransferError, match="cpu ones only under TRITON_INTERPRET=1"):
        KERNEL.gather(TransferPlan(tb, torch.tensor([1, 2, 3]), out, 3))
    with pytest.raises(TransferError, match="cpu ones only under TRITON_INTERPRET=1"):
        KERNEL.scatter(TransferPlan(tb, torch.tensor([1, 2, 3]), out, 3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(TransferError, match="rows of 64 bytes"):
        KERNEL.scatter(TransferPlan(tb, torch.tensor([1, 2, 3]), torch.zeros(2, 2, 3, 8), 3))
    with pytest.raises(TransferError, match="no staging buffer 'kv'"):
        KERNEL.scatter(TransferPlan(tb, torch.tensor([1, 2, 3]), {"K": out}, 3))
    assert all(torch.equal(a, b) for a, b in zip(caches, before)) and (out == 7.0).all()
