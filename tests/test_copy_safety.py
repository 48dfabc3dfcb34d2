"""kvcore.copy never crashes and never writes outside the request.

Three classes of input, each on the torch reference kernel and the native C++ kernel:

* caches changed since their layouts were built: a storage freed, resized or replaced, a
  tensor reshaped in place, or the caller's tensor re-pointed (``set_``) under the views a
  layout holds -- on either side, before the first copy (plan built then) or after it
  (plan cached). Every one is a ``TransferError`` and no byte moves anywhere: not in the
  old memory, not in the new one, not in the source.
* source and destination over one memory (one cache; two layouts of one buffer read
  differently; a cache and a view of part of it; multi-plane layouts with planes swapped):
  a copy never reads a byte it writes. The ground truth is computed independently: the
  element indices every row touches, read through plain torch views of an ``arange`` of
  the buffer; a copy must be refused exactly when the bytes read and the bytes written
  meet, and otherwise land what torch indexing says.
* threads: concurrent copies into disjoint slots of one destination all land.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import kvcore
from kvcore import TransferError, build_layout
from kvcore.kernels.copy_kernels import NATIVE_CPU_COPY

pytestmark = pytest.mark.usefixtures("core_only")

NL, NB, BS, NH, HS = 2, 8, 4, 4, 8


@pytest.fixture(params=["reference", "native-cpu"])
def kernel(request, monkeypatch):
    if request.param == "native-cpu" and not NATIVE_CPU_COPY.available():
        pytest.skip(f"native copy kernel unavailable: {NATIVE_CPU_COPY.why()}")
    monkeypatch.setenv("KVCORE_COPY_KERNEL", request.param)
    return request.param


# -- readings of one flat int32 buffer ---------------------------------------------------------
# name -> (format, kv_caches(flat), view(flat, layer, kv) -> [blocks, BS', NH, HS] with its block size)
# `flat` is either the memory itself or an arange of its element indices: the same torch views
# give the values a row holds and the elements it touches.


def _nhd(m):
    return m.view(NL, 2, NB, BS, NH, HS)


READINGS = {
    "NHD": ("NL_X_TWO_NB_BS_NH_HS", lambda m: [_nhd(m)[ly] for ly in range(NL)], lambda m, ly, k: _nhd(m)[ly, k], BS),
    "HND": (
        "NL_X_TWO_NB_NH_BS_HS",
        lambda m: [m.view(NL, 2, NB, NH, BS, HS)[ly] for ly in range(NL)],
        lambda m, ly, k: m.view(NL, 2, NB, NH, BS, HS)[ly, k].transpose(1, 2),
        BS,
    ),
    # NHD with half the block size: slot s is the same bytes as in NHD, numbered through other blocks
    "NHD_bs2": (
        "NL_X_TWO_NB_BS_NH_HS",
        lambda m: [m.view(NL, 2, 2 * NB, BS // 2, NH, HS)[ly] for ly in range(NL)],
        lambda m, ly, k: m.view(NL, 2, 2 * NB, BS // 2, NH, HS)[ly, k],
        BS // 2,
    ),
    "FI": (
        "NL_X_NB_TWO_BS_NH_HS",
        lambda m: [m.view(NL, NB, 2, BS, NH, HS)[ly] for ly in range(NL)],
        lambda m, ly, k: m.view(NL, NB, 2, BS, NH, HS)[ly, :, k],
        BS,
    ),
    "XL": ("NB_NL_TWO_BS_NH_HS", lambda m: m.view(NB, NL, 2, BS, NH, HS), lambda m, ly, k: m.view(NB, NL, 2, BS, NH, HS)[:, ly, k], BS),
    # a cache over blocks 1.. of NHD's: slot s here is NHD's slot s + BS
    "SHIFT": (
        "NL_X_TWO_NB_BS_NH_HS",
        lambda m: [_nhd(m)[ly, :, 1:] for ly in range(NL)],
        lambda m, ly, k: _nhd(m)[ly, k, 1:],
        BS,
    ),
    # multi-plane: NHD's K and V as separate planes, and with the roles swapped
    "MP": (
        "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS",
        lambda m: {"K": [_nhd(m)[ly, 0] for ly in range(NL)], "V": [_nhd(m)[ly, 1] for ly in range(NL)]},
        lambda m, ly, k: _nhd(m)[ly, k],
        BS,
    ),
    "MPswap": (
        "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS",
        lambda m: {"K": [_nhd(m)[ly, 1] for ly in range(NL)], "V": [_nhd(m)[ly, 0] for ly in range(NL)]},
        lambda m, ly, k: _nhd(m)[ly, 1 - k],
        BS,
    ),
    # K over NHD's V region, V an HND reading of NHD's K region
    "MPhnd": (
        "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_NH_BS_HS",
        lambda m: {
            "K": [_nhd(m)[ly, 1] for ly in range(NL)],
            "V": [_nhd(m)[ly, 0].reshape(NB, NH, BS, HS) for ly in range(NL)],
        },
        lambda m, ly, k: _nhd(m)[ly, 1] if k == 0 else _nhd(m)[ly, 0].reshape(NB, NH, BS, HS).transpose(1, 2),
        BS,
    ),
}
N = NL * 2 * NB * BS * NH * HS


def _layout(name, mem):
    fmt, caches, _, _ = READINGS[name]
    return build_layout(fmt, caches(mem))


def _rows(name, flat, ly, k):
    """``[slots, NH, HS]`` of one (layer, K/V) of a reading, through torch views only."""
    v = READINGS[name][2](flat, ly, k)
    return v.reshape(-1, NH, HS)


def _touched(name, layers, slots, heads):
    """Element indices of ``flat`` the rows of ``slots`` touch in ``layers``, K and V, ``heads``."""
    idx = torch.arange(N)
    out = [
        _rows(name, idx, ly, k)[torch.tensor(slots, dtype=torch.int64)][:, heads[0] : heads[1]].reshape(-1) for ly in layers for k in (0, 1)
    ]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def _expected(mem_before, sname, dname, ss, ds, layers, dst_layers, heads, dst_heads):
    want = mem_before.clone()
    bs = READINGS[dname][3]
    for sl, dl in zip(layers, dst_layers):
        for k in (0, 1):
            sv = _rows(sname, mem_before, sl, k)
            dv = READINGS[dname][2](want, dl, k)  # a view of `want`: assignments land in it
            for a, b in zip(ss, ds):
                if a >= 0 and b >= 0:
                    dv[b // bs, b % bs, dst_heads[0] : dst_heads[1]] = sv[a, heads[0] : heads[1]]
    return want


def _run_case(sname, dname, ss, ds, layers=None, dst_layers=None, heads=None, dst_heads=None):
    """Copy between two readings of one memory; returns 'refused' or 'copied' after checking
    it against the independent ground truth (refused exactly when read and written bytes meet)."""
    g = torch.Generator().manual_seed(len(ss) * 7 + sum(ss) + 3 * sum(ds))
    mem = torch.randint(-(2**31), 2**31 - 1, (N,), dtype=torch.int32, generator=g)
    src, dst = _layout(sname, mem), _layout(dname, mem)
    ly = list(range(NL)) if layers is None else layers
    dly = ly if dst_layers is None else dst_layers
    h, dh = heads or (0, NH), dst_heads or (0, NH)
    valid = [(a, b) for a, b in zip(ss, ds) if a >= 0 and b >= 0]
    reads = _touched(sname, ly, [a for a, _ in valid], h)
    writes = _touched(dname, dly, [b for _, b in valid], dh)
    meet = bool(torch.isin(reads, writes).any())
    before = mem.clone()
    try:
        kvcore.copy(src, torch.tensor(ss), dst, torch.tensor(ds), layers=layers, dst_layers=dst_layers, heads=heads, dst_heads=dst_heads)
    except TransferError as e:
        assert meet, f"refused a copy whose read and written bytes do not meet: {e}"
        assert "share memory" in str(e)
        assert torch.equal(mem, before), "a refused copy wrote"
        return "refused"
    assert not meet, "a copy that reads bytes it writes was not refused"
    want = _expected(before, sname, dname, ss, ds, ly, dly, h, dh)
    assert torch.equal(mem, want), f"first wrong element {int(torch.nonzero(mem != want)[0])}"
    return "copied"


# -- one memory, two layouts --------------------------------------------------------------------


def test_same_cache_slots(kernel):
    # one layout: refused exactly when a slot is read and written
    assert _run_case("NHD", "NHD", [0, 5, 9], [16, 17, 18]) == "copied"
    assert _run_case("NHD", "NHD", [0, 5, 9], [16, 9, 18]) == "refused"
    # the same memory read through another layout object of the same reading: the same rule
    assert _run_case("HND", "HND", [3, 30], [30, 4]) == "refused"
    assert _run_case("HND", "HND", [3, 30], [31, 4]) == "copied"


def test_same_cache_disjoint_heads_share_a_slot(kernel):
    # heads 0..1 of slot 5 into heads 2..3 of slot 5: the same rows, no byte in common
    assert _run_case("NHD", "NHD", [5, 6], [5, 6], heads=(0, 2), dst_heads=(2, 4)) == "copied"
    assert _run_case("HND", "HND", [5], [5], heads=(0, 2), dst_heads=(1, 3)) == "refused"  # head 1 is read and written


def test_same_cache_other_layer(kernel):
    # cross-layer pool: layer 0's slot 3 into layer 1's slot 3 (interleaved regions, disjoint bytes)
    assert _run_case("XL", "XL", [3, 7], [3, 7], layers=[0], dst_layers=[1]) == "copied"
    assert _run_case("XL", "XL", [3], [3], layers=[1], dst_layers=[1]) == "refused"
    assert _run_case("NHD", "NHD", [3, 7], [3, 7], layers=[0], dst_layers=[1]) == "copied"


def test_two_readings_of_one_memory(kernel):
    # NHD and HND over one buffer: slots 0..3 (block 0) into HND slots 4..7 (block 1) share no byte
    assert _run_case("NHD", "HND", [0, 1, 2, 3], [4, 5, 6, 7]) == "copied"
    # HND slot 1 is block 0 again: NHD's row 0 is read and HND's rows of block 0 interleave with it
    assert _run_case("NHD", "HND", [0], [1]) == "refused"
    # another block size: NHD slot s is NHD_bs2 slot s (same bytes)
    assert _run_case("NHD", "NHD_bs2", [2, 3], [9, 10]) == "copied"
    assert _run_case("NHD", "NHD_bs2", [2, 3], [9, 2]) == "refused"
    # FlashInfer's blocks-first reading and NHD's K/V-first reading of one buffer
    assert _run_case("FI", "NHD", [0], [31]) in ("copied", "refused")  # whatever the bytes say (checked inside)


def test_cache_and_a_view_of_part_of_it(kernel):
    # SHIFT's slot s is NHD's slot s + BS: only that pairing meets
    assert _run_case("NHD", "SHIFT", [0, 1, 2], [0, 1, 2]) == "copied"
    assert _run_case("NHD", "SHIFT", [0, BS + 1], [7, 1]) == "refused"
    assert _run_case("SHIFT", "NHD", [0, 1], [0, 1]) == "copied"
    assert _run_case("SHIFT", "NHD", [0, 1], [BS + 1, 2]) == "refused"


def test_multi_plane_over_one_memory(kernel):
    # NHD and its K/V as separate planes: the same regions read the same way
    assert _run_case("NHD", "MP", [0, 1], [2, 3]) == "copied"
    assert _run_case("MP", "NHD", [0, 1], [1, 3]) == "refused"
    # K and V swapped between the sides: the source's V region is the destination's K region, read the same way
    assert _run_case("MP", "MPswap", [0, 1], [2, 3]) == "copied"
    assert _run_case("MP", "MPswap", [0, 1], [2, 0]) == "refused"
    # ... and read another way (HND): the destination's V rows of block 0 interleave with the source's rows 0, 1
    assert _run_case("MP", "MPhnd", [0, 1], [12, 13]) == "copied"
    assert _run_case("MP", "MPhnd", [0, 1], [2, 13]) == "refused"
    assert _run_case("MPhnd", "HND", [0, 1], [12, 13]) in ("copied", "refused")  # whatever the bytes say (checked inside)


def test_how_shared_memory_is_checked():
    """One memory read the same way on both sides is checked by slot values (on a GPU in the
    device check, no host read-back); read differently, by byte runs on the host."""
    from kvcore.layout_copy import CopyLayoutPlan

    mem, other = torch.zeros(N, dtype=torch.int32), torch.zeros(N, dtype=torch.int32)

    def mode(a, b, mem_b=mem, **kw):
        return CopyLayoutPlan(_layout(a, mem), _layout(b, mem_b), **kw).overlap.mode

    assert mode("NHD", "NHD", other) == "none"
    assert mode("NHD", "NHD") == "slots"
    assert mode("NHD", "MP") == "slots" and mode("MP", "MPswap") == "slots"
    assert mode("NHD", "NHD", heads=(0, 2), dst_heads=(2, 4)) == "none"
    assert mode("NHD", "NHD", heads=(0, 2), dst_heads=(1, 3)) == "slots"
    assert mode("NHD", "NHD", layers=[0], dst_layers=[1]) == "none"  # per-layer regions apart
    assert mode("XL", "XL", layers=[0], dst_layers=[1]) == "bytes"  # interleaved in one pool
    for b in ("HND", "NHD_bs2", "SHIFT", "FI", "MPhnd"):
        assert mode("NHD", b) == "bytes", b


def test_interleaved_rows_disjoint_byte_by_byte(kernel, monkeypatch):
    """NHD's slot 1, heads 0..1, is one run in block 0; the HND reading's slot 2, heads 0..1,
    two runs on either side of it: the hulls meet, the bytes do not. Exact: copied. Past the
    run budget the rows are taken to overlap: refused (never a wrong copy), saying so."""
    kw = {"heads": (0, 2), "dst_heads": (0, 2)}
    assert _run_case("NHD", "MPhnd", [1], [2], **kw) == "copied"
    assert _run_case("NHD", "MPhnd", [1], [1], **kw) == "refused"
    import kvcore.layout_copy as lc

    monkeypatch.setattr(lc, "_MAX_RUNS", 1)
    mem = torch.arange(N, dtype=torch.int32)
    before = mem.clone()
    with pytest.raises(TransferError, match=r"interleave .* too many to prove them disjoint run by run, so they are taken to overlap"):
        kvcore.copy(_layout("NHD", mem), torch.tensor([1]), _layout("MPhnd", mem), torch.tensor([2]), **kw)
    assert torch.equal(mem, before)


def test_overlap_message_names_the_rows_and_slots(kernel):
    mem = torch.zeros(N, dtype=torch.int32)
    a, b = _layout("NHD", mem), _layout("SHIFT", mem)
    with pytest.raises(TransferError, match=r"row 1 reads source slot 5 \(layer 0, plane K\) and row 0 writes destination slot 1"):
        kvcore.copy(a, torch.tensor([9, 5]), b, torch.tensor([1, 12]))
    c = _layout("NHD", mem)
    with pytest.raises(TransferError, match=r"slot 9 is both read and written \(read by row 1, written by row 0\)"):
        kvcore.copy(a, torch.tensor([2, 9]), c, torch.tensor([9, 12]))


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a dev requirement
    given = None

if given is not None:

    @given(data=st.data())
    @settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "25")), deadline=None, suppress_health_check=list(HealthCheck))
    @pytest.mark.parametrize("kern", ["reference", "native-cpu"])
    def test_random_copies_over_one_memory(kern, data, monkeypatch):
        if kern == "native-cpu" and not NATIVE_CPU_COPY.available():
            pytest.skip("native copy kernel unavailable")
        monkeypatch.setenv("KVCORE_COPY_KERNEL", kern)
        names = sorted(READINGS)
        sname = data.draw(st.sampled_from(names))
        dname = data.draw(st.sampled_from(names))
        nsrc = (NB - 1) * BS if sname == "SHIFT" else NB * BS
        ndst = (NB - 1) * BS if dname == "SHIFT" else NB * BS
        t = data.draw(st.integers(1, 6))
        ss = data.draw(st.lists(st.integers(-1, nsrc - 1), min_size=t, max_size=t))
        ds = data.draw(st.lists(st.integers(0, ndst - 1), min_size=t, max_size=t, unique=True))
        kw = {}
        if data.draw(st.booleans()):
            h0 = data.draw(st.integers(0, NH - 2))
            d0 = data.draw(st.integers(0, NH - 2))
            kw = {"heads": (h0, h0 + 2), "dst_heads": (d0, d0 + 2)}
        if data.draw(st.booleans()):
            kw["layers"] = [data.draw(st.integers(0, NL - 1))]
            kw["dst_layers"] = [data.draw(st.integers(0, NL - 1))]
        _run_case(sname, dname, ss, ds, **kw)


def test_aliased_destination_layers_are_written_once_from_the_first(kernel):
    """KV-sharing layers: destination layers 1 and 3 are layer 0's and layer 2's memory. Each
    memory is written once, from the source layer paired with the first of its layers (as
    kvcore.scatter), never twice from different source layers in a racing order."""
    src_t = [torch.full((2, NB, BS, NH, HS), 10 * (ly + 1), dtype=torch.int32) for ly in range(4)]
    src = build_layout("NL_X_TWO_NB_BS_NH_HS", src_t)
    mem = [torch.zeros(2, NB, NH, BS, HS, dtype=torch.int32) for _ in range(2)]
    dst = build_layout("NL_X_TWO_NB_NH_BS_HS", mem, aliases={1: 0, 3: 2})
    assert dst.num_layers == 4 and dst.aliases == {1: 0, 3: 2}
    kvcore.copy(src, [5, 6], dst, [1, 9])
    for m, want in zip(mem, (10, 30)):  # source layers 0 and 2 (the first of each memory)
        v = m.transpose(2, 3)  # [2, NB, BS, NH, HS], a view
        for slot in (1, 9):
            assert bool((v[:, slot // BS, slot % BS] == want).all())
            v[:, slot // BS, slot % BS] = 0
        assert int(m.abs().sum()) == 0  # nothing else written
    kvcore.copy(src, [5], dst, [2], layers=[3, 1], dst_layers=[1, 0])  # both land in memory 0: the first pair wins
    assert bool((mem[0].transpose(2, 3).reshape(2, -1, NH, HS)[:, 2] == 40).all())


# -- caches changed since detection ----------------------------------------------------------------


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).clone()


MUTATIONS = {
    "set_ to new memory": lambda t: t.set_(torch.full(t.shape, 7, dtype=t.dtype, device=t.device).untyped_storage(), 0, t.shape),
    "set_ to nothing": lambda t: t.set_(),
    "resize_(0)": lambda t: t.resize_(0),
    "storage freed": lambda t: t.untyped_storage().resize_(0),
    "storage shrunk": lambda t: t.untyped_storage().resize_(64),
    "storage grown": lambda t: t.untyped_storage().resize_(t.untyped_storage().nbytes() * 4),
    "as_strided_": lambda t: t.as_strided_(t.shape, [1] * t.dim()),
    "set_ onto itself, offset": lambda t: t.set_(t.untyped_storage(), 16, (2, 3, BS, NH, HS)),
    "transpose_": lambda t: t.transpose_(1, 2),
}


def _caches(views: bool, fill: int):
    """The caller's tensors and what the layout is built over: the tensors themselves, or
    views of them (what a detector hands over: ``x.view(...)``, ``_base`` is the caller's)."""
    mine = [torch.full((2, NB, BS, NH, HS), fill + ly, dtype=torch.int32) for ly in range(NL)]
    given = [t.view(t.shape) for t in mine] if views else mine
    return mine, given


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("views", [False, True], ids=["tensors", "views"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_changed_cache_is_refused_and_nothing_moves(kernel, mutation, side, views, warm):
    smine, sgiven = _caches(views, 100)
    dmine, dgiven = _caches(views, 200)
    src = build_layout("NL_X_TWO_NB_BS_NH_HS", sgiven)
    dst = build_layout("NL_X_TWO_NB_NH_BS_HS", [t.transpose(2, 3) for t in dgiven])  # HND reading of [2, NB, BS, NH, HS]... as views
    if warm:  # the plan is built and cached by a good copy first
        kvcore.copy(src, torch.tensor([1]), dst, torch.tensor([2]))
    victim = (smine if side == "source" else dmine)[1]
    old = [_flat_bytes(t) for t in smine + dmine] + [_flat_bytes(t) for t in sgiven + dgiven]
    held = [t.untyped_storage() for t in smine + dmine + sgiven + dgiven]  # the memory as it was (kept alive)
    MUTATIONS[mutation](victim)
    new = [_flat_bytes(t) for t in smine + dmine]
    with pytest.raises(TransferError, match=rf"{side}\b.*layer 1 plane K.*Detect the cache again"):
        kvcore.copy(src, torch.tensor([3, 9]), dst, torch.tensor([5, 6]))
    # nothing moved: not in the memory the layouts were built over, not in the caller's new memory
    for a, st_ in zip(old, held):
        now = torch.empty(0, dtype=torch.uint8).set_(st_, 0, (st_.nbytes(),), (1,))
        assert now.numel() < a.numel() or torch.equal(now[: a.numel()], a)
    assert all(torch.equal(_flat_bytes(t), b) for t, b in zip(smine + dmine, new))


def test_changed_cache_message_names_side_layer_and_change(kernel):
    smine, sgiven = _caches(True, 1)
    dmine, dgiven = _caches(True, 2)
    src, dst = build_layout("NL_X_TWO_NB_BS_NH_HS", sgiven), build_layout("NL_X_TWO_NB_BS_NH_HS", dgiven)
    kvcore.copy(src, [0], dst, [0])
    dmine[1].set_(torch.zeros(dmine[1].shape, dtype=torch.int32).untyped_storage(), 0, dmine[1].shape)
    with pytest.raises(TransferError, match=r"destination.*layer 1 plane K.*(re-pointed|replaced).*Detect the cache again"):
        kvcore.copy(src, [0], dst, [1])
    smine2, _ = _caches(False, 3)
    src2 = build_layout("NL_X_TWO_NB_BS_NH_HS", smine2)
    smine2[0].resize_(0)
    with pytest.raises(TransferError, match=r"source.*layer 0 plane K.*(changed shape, strides or offset).*Detect the cache again"):
        kvcore.copy(src2, [0], build_layout("NL_X_TWO_NB_BS_NH_HS", _caches(False, 4)[0]), [1])


def test_a_changed_cache_detected_again_copies_right(kernel):
    smine, sgiven = _caches(True, 10)
    dmine, dgiven = _caches(True, 20)
    src, dst = build_layout("NL_X_TWO_NB_BS_NH_HS", sgiven), build_layout("NL_X_TWO_NB_BS_NH_HS", dgiven)
    kvcore.copy(src, [0], dst, [0])
    fresh = torch.arange(2 * NB * BS * NH * HS, dtype=torch.int32).view(2, NB, BS, NH, HS)
    dmine[0].set_(fresh.untyped_storage(), 0, fresh.shape)
    with pytest.raises(TransferError):
        kvcore.copy(src, [3], dst, [5])
    dst = build_layout("NL_X_TWO_NB_BS_NH_HS", [t.view(t.shape) for t in dmine])
    kvcore.copy(src, [3], dst, [5])
    for ly in range(NL):
        for k in (0, 1):
            want = smine[ly][k].reshape(-1, NH, HS)[3]
            assert torch.equal(dmine[ly][k].reshape(-1, NH, HS)[5], want)
    assert int(fresh[0, 0, 0, 0, 0]) == 0 and torch.equal(fresh.view(-1)[:10], torch.arange(10, dtype=torch.int32))


def test_changed_multi_plane_cache_is_refused(kernel):
    def planes(fill):
        k = [torch.full((NB, BS, NH, HS), fill, dtype=torch.int32) for _ in range(NL)]
        v = [torch.full((NB, BS, NH, HS), fill + 1, dtype=torch.int32) for _ in range(NL)]
        ks = [torch.full((NB, BS, NH), fill + 2, dtype=torch.int32) for _ in range(NL)]
        return {"K": k, "V": v, "KS": ks}

    name = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH"
    s, d = planes(1), planes(50)
    src = build_layout(name, {r: [t.view(t.shape) for t in ts] for r, ts in s.items()})
    dst = build_layout(name, {r: [t.view(t.shape) for t in ts] for r, ts in d.items()})
    kvcore.copy(src, [1, 2], dst, [3, 4])
    assert int(d["KS"][1][0, 3, 0]) == 3 and int(d["V"][0][1, 0, 0, 0]) == 2  # slot 4 = block 1, token 0
    snap = {r: [t.clone() for t in ts] for r, ts in d.items()}
    d["KS"][1].set_(torch.zeros(NB, BS, NH, dtype=torch.int32).untyped_storage(), 0, (NB, BS, NH))
    with pytest.raises(TransferError, match=r"destination.*layer 1 plane KS"):
        kvcore.copy(src, [5], dst, [6])
    for r in ("K", "V"):
        assert all(torch.equal(a, b) for a, b in zip(d[r], snap[r]))
    s["V"][0].untyped_storage().resize_(0)
    with pytest.raises(TransferError, match=r"source.*layer 0 plane V"):
        kvcore.copy(src, [5], build_layout(name, planes(9)), [6])


# -- slots are validated before any byte moves ------------------------------------------------------


@pytest.mark.parametrize("validate", [None, "none", "sync"])
def test_cpu_validates_slots_whatever_validate_says(kernel, validate):
    """On the CPU the slot values are checked before the copy whatever ``validate`` says (the
    docstring's promise; ``validate`` chooses how a GPU checks): a bad row at the end of the
    request leaves every plane of every layer untouched."""
    name = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_NH_BS_HS+KS=NL_X_NB_BS_NH"
    src = build_layout(
        name,
        {
            "K": [torch.ones(NB, BS, NH, HS, dtype=torch.int32)] * 1,
            "V": [torch.ones(NB, NH, BS, HS, dtype=torch.int32)],
            "KS": [torch.ones(NB, BS, NH, dtype=torch.int32)],
        },
    )
    d = {
        "K": [torch.zeros(NB, BS, NH, HS, dtype=torch.int32)],
        "V": [torch.zeros(NB, NH, BS, HS, dtype=torch.int32)],
        "KS": [torch.zeros(NB, BS, NH, dtype=torch.int32)],
    }
    dst = build_layout(name, d)
    n = NB * BS
    for ss, ds, match in (
        ([0, 1, 2], [3, 4, 3], "appears more than once"),
        ([0, 1, n], [3, 4, 5], "out of range"),
        ([0, 1, 2], [3, 4, n], "out of range"),
    ):
        with pytest.raises(TransferError, match=match):
            kvcore.copy(src, torch.tensor(ss), dst, torch.tensor(ds), validate=validate)
        assert all(int(t.abs().sum()) == 0 for ts in d.values() for t in ts), "a refused copy wrote"


# -- threads ---------------------------------------------------------------------------------------


def test_concurrent_copies_into_disjoint_slots(kernel):
    src_t = [torch.arange(2 * NB * 8 * NH * HS, dtype=torch.int32).view(2, NB * 8, 1, NH, HS) + 10**6 * ly for ly in range(NL)]
    src = build_layout("NL_X_TWO_NB_BS_NH_HS", src_t)
    dst_t = [torch.zeros(2, NB * 8, NH, 1, HS, dtype=torch.int32) for _ in range(NL)]
    dst = build_layout("NL_X_TWO_NB_NH_BS_HS", dst_t)
    n = NB * 8
    errors, barrier = [], threading.Barrier(4)

    def work(w):
        try:
            barrier.wait()
            for it in range(40):
                mine = torch.arange(w, n, 4)  # thread w owns slots w, w+4, ...
                kvcore.copy(src, (mine + it) % n, dst, mine)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for ly in range(NL):
        for k in (0, 1):
            for b in range(n):
                a = (b + 39) % n  # each slot's last write: iteration 39
                assert torch.equal(dst_t[ly][k, b, :, 0], src_t[ly][k, a, 0]), (ly, k, b)


def test_concurrent_first_use_and_cache_eviction(kernel):
    """Many (source, destination) pairs planned from several threads at once: more pairs than
    the caches keep, so entries are evicted while others are looked up."""
    src = [build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.full((2, NB, BS, NH, HS), i, dtype=torch.int32)]) for i in range(12)]
    dst_t = [torch.zeros(2, NB, NH, BS, HS, dtype=torch.int32) for _ in range(12)]
    dst = [build_layout("NL_X_TWO_NB_NH_BS_HS", [t]) for t in dst_t]
    errors = []

    def work(w):
        try:
            for i in range(12):
                for j in range(12):
                    if (i + j) % 3 == w:
                        kvcore.copy(src[i], [i], dst[j], [i + 1])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for j, t in enumerate(dst_t):
        for i in range(12):
            assert bool((t.transpose(2, 3).reshape(2, -1, NH, HS)[:, i + 1] == i).all()), (i, j)


# -- CUDA (scripts/gpu_check.py runs these on a GPU machine) ----------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("mutation", ["set_ to new memory", "resize_(0)", "storage freed", "transpose_"])
@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("where", ["device", "pinned_dst", "pageable_dst"])
def test_cuda_changed_cache_is_refused(mutation, side, where):
    dev = torch.device("cuda")
    smine = [torch.full((2, NB, BS, NH, HS), 5 + ly, dtype=torch.int32, device=dev) for ly in range(NL)]
    if where == "device":
        dmine = [torch.zeros(2, NB, BS, NH, HS, dtype=torch.int32, device=dev) for _ in range(NL)]
    else:
        dmine = [torch.zeros(2, NB, BS, NH, HS, dtype=torch.int32, pin_memory=where == "pinned_dst") for _ in range(NL)]
    src = build_layout("NL_X_TWO_NB_BS_NH_HS", [t.view(t.shape) for t in smine])
    dst = build_layout("NL_X_TWO_NB_BS_NH_HS", [t.view(t.shape) for t in dmine])
    kvcore.copy(src, torch.tensor([1], device=dev), dst, torch.tensor([2], device=dev))
    kvcore.synchronize()
    victim = (smine if side == "source" else dmine)[1]
    held = [t.untyped_storage() for t in dst.kv_caches]

    def raw(st_):
        return torch.empty(0, dtype=torch.uint8, device=st_.device).set_(st_, 0, (st_.nbytes(),), (1,))

    keep = [raw(st_).clone() for st_ in held]
    try:
        MUTATIONS[mutation](victim)
    except RuntimeError as e:  # e.g. a pinned storage that torch does not resize
        pytest.skip(f"torch refuses the change itself: {e}")
    with pytest.raises(TransferError, match=side):
        kvcore.copy(src, torch.tensor([3], device=dev), dst, torch.tensor([5], device=dev))
    kvcore.synchronize()
    for st_, a in zip(held, keep):  # nothing written into the memory the layout was built over
        if st_.nbytes() >= a.numel():
            assert torch.equal(raw(st_)[: a.numel()], a)


@cuda
def test_cuda_two_readings_of_one_memory():
    dev = torch.device("cuda")
    mem = torch.arange(N, dtype=torch.int32, device=dev)
    a = build_layout("NL_X_TWO_NB_BS_NH_HS", [_nhd(mem)[ly] for ly in range(NL)])
    b = build_layout("NL_X_TWO_NB_NH_BS_HS", [mem.view(NL, 2, NB, NH, BS, HS)[ly] for ly in range(NL)])
    before = mem.clone()
    # refused in the call, whatever validate says but "none" (host check, one read-back)
    for validate in (None, "sync"):
        with pytest.raises(TransferError, match="read bytes it writes"):
            kvcore.copy(a, torch.tensor([0], device=dev), b, torch.tensor([1], device=dev), validate=validate)
    kvcore.synchronize()
    assert torch.equal(mem, before)
    # disjoint rows land
    kvcore.copy(a, torch.tensor([0, 1, 2, 3], device=dev), b, torch.tensor([4, 5, 6, 7], device=dev))
    kvcore.synchronize()
    want = _expected(before.cpu(), "NHD", "HND", [0, 1, 2, 3], [4, 5, 6, 7], list(range(NL)), list(range(NL)), (0, NH), (0, NH))
    assert torch.equal(mem.cpu(), want)
    # the same reading on both sides: checked on the device (slot values)
    c = build_layout("NL_X_TWO_NB_BS_NH_HS", [_nhd(mem)[ly] for ly in range(NL)])
    keep = mem.clone()
    kvcore.copy(a, torch.tensor([0, 9], device=dev), c, torch.tensor([9, 10], device=dev))
    with pytest.raises(TransferError, match=r"slot 9 is both read and written"):
        kvcore.synchronize()
    assert torch.equal(mem, keep)
    # a graph cannot capture the host check of two readings
    g = torch.cuda.CUDAGraph()
    s, d = torch.tensor([8], device=dev), torch.tensor([12], device=dev)
    kvcore.copy(a, s, b, d)  # warm: plans built outside the capture
    kvcore.synchronize()
    with pytest.raises(TransferError, match="CUDA graph"):
        with torch.cuda.graph(g):
            kvcore.copy(a, s, b, d)


# -- the same guard serves kvcore.gather / kvcore.scatter (kvcore.kernels.check_storages, TensorGuard) --


@pytest.mark.parametrize("kern", ["reference", "native-cpu"])
@pytest.mark.parametrize("mutation", ["set_ to new memory", "resize_(0)", "as_strided_"])
def test_scatter_refuses_a_caller_tensor_changed_under_its_views(kern, mutation, monkeypatch):
    """A detector hands kvcore views of the caller's tensors; the caller re-points or reshapes
    its tensor afterwards: a scatter would land in memory only kvcore's view still holds."""
    if kern == "native-cpu" and not NATIVE_CPU_COPY.available():
        pytest.skip("native op unavailable")
    monkeypatch.setenv("KVCORE_KERNEL", kern)
    mine, given = _caches(True, 0)
    lay = build_layout("NL_X_TWO_NB_BS_NH_HS", given)
    staged = kvcore.gather(lay, [1, 2])  # plans prepared
    held = [t.untyped_storage() for t in given]
    keep = [_flat_bytes(t) for t in given]
    MUTATIONS[mutation](mine[1])
    new = _flat_bytes(mine[1])
    with pytest.raises(TransferError, match=r"layer 1 plane K.*Detect the cache again"):
        kvcore.scatter(lay, [1, 2], staged + 1)
    for st_, a in zip(held, keep):
        assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(st_, 0, (st_.nbytes(),), (1,)), a)
    assert torch.equal(_flat_bytes(mine[1]), new)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_slot_tensors_with_the_negation_bit_move_by_their_values(kernel, side):
    """A slot tensor carrying torch's lazy negation bit shows negative (padding) values while
    its bytes hold positive ones; the copy follows the values: padding rows do not move, and
    the rows it does move are the ones the values name."""
    src = [torch.randn(2, 4, 16, 2, 8) for _ in range(2)]
    dst = [torch.zeros(2, 4, 16, 2, 8) for _ in range(2)]
    a = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", src)
    b = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", dst)
    neg = torch.tensor([1, 2])._neg_view()  # shows [-1, -2]: both padding
    ss, ds = (neg, torch.tensor([3, 4])) if side == "src" else (torch.tensor([3, 4]), neg)
    for _ in range(2):  # cold and cached plan
        kvcore.copy(a, ss, b, ds)
    assert not any(x.any() for x in dst)
    # a negated view of negative values shows positive slots: those rows move
    shown = torch.tensor([-5, -6])._neg_view()  # shows [5, 6]
    kvcore.copy(a, shown, b, torch.tensor([7, 8]))
    for layer in range(2):
        flat_s = src[layer].reshape(2, 64, 2, 8)
        flat_d = dst[layer].reshape(2, 64, 2, 8)
        assert torch.equal(flat_d[:, 7], flat_s[:, 5]) and torch.equal(flat_d[:, 8], flat_s[:, 6])
        assert int((flat_d != 0).any(dim=(0, 2, 3)).sum()) == 2
