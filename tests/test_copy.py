"""kvcore.copy: layout-to-layout copy, checked semantically.

Every cache is written through an engine-style view ``[NB, BS, NH, HS]`` per (layer, K/V)
built with plain torch indexing (not kvcore's stride table) with a code unique to
(layer, K/V, slot, head, element); after a copy, every destination element must equal the
code of its source row (moved rows) or its own old value (everything else). Each case runs
on the torch reference kernel and on the native C++ kernel (when it builds here)."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import TransferError, build_layout
from kvcore.kernels.copy_kernels import NATIVE_CPU_COPY, NATIVE_CUDA_COPY, select_copy_kernel
from kvcore.layout_copy import plan_copy

pytestmark = pytest.mark.usefixtures("core_only")

HS = 8


@pytest.fixture(params=["reference", "native-cpu"])
def kernel(request, monkeypatch):
    if request.param == "native-cpu" and not NATIVE_CPU_COPY.available():
        pytest.skip(f"native copy kernel unavailable: {NATIVE_CPU_COPY.why()}")
    monkeypatch.setenv("KVCORE_COPY_KERNEL", request.param)
    return request.param


# -- layouts: name -> (allocate(nl, nb, bs, nh, dtype) -> kv_caches, view(kv_caches, layer, kv) -> [NB, BS, NH, HS]) -------


def _ll(nl, shape, dtype):
    return [torch.zeros(*shape, dtype=dtype) for _ in range(nl)]


FAMILIES = {
    "NL_X_TWO_NB_BS_NH_HS": (lambda nl, nb, bs, nh, dt: _ll(nl, (2, nb, bs, nh, HS), dt), lambda c, ly, k: c[ly][k]),
    "NL_X_TWO_NB_NH_BS_HS": (lambda nl, nb, bs, nh, dt: _ll(nl, (2, nb, nh, bs, HS), dt), lambda c, ly, k: c[ly][k].transpose(1, 2)),
    "NL_X_NB_TWO_BS_NH_HS": (lambda nl, nb, bs, nh, dt: _ll(nl, (nb, 2, bs, nh, HS), dt), lambda c, ly, k: c[ly][:, k]),
    "NL_X_NB_TWO_NH_BS_HS": (
        lambda nl, nb, bs, nh, dt: _ll(nl, (nb, 2, nh, bs, HS), dt),
        lambda c, ly, k: c[ly][:, k].transpose(1, 2),
    ),
    "TWO_X_NL_X_NB_BS_NH_HS": (
        lambda nl, nb, bs, nh, dt: [_ll(nl, (nb, bs, nh, HS), dt), _ll(nl, (nb, bs, nh, HS), dt)],
        lambda c, ly, k: c[k][ly],
    ),
    "NL_X_TWO_X_NB_BS_NH_HS": (
        lambda nl, nb, bs, nh, dt: [(torch.zeros(nb, bs, nh, HS, dtype=dt), torch.zeros(nb, bs, nh, HS, dtype=dt)) for _ in range(nl)],
        lambda c, ly, k: c[ly][k],
    ),
    "NB_NL_TWO_BS_NH_HS": (lambda nl, nb, bs, nh, dt: torch.zeros(nb, nl, 2, bs, nh, HS, dtype=dt), lambda c, ly, k: c[:, ly, k]),
    "NL_X_NB_BS_NH_CS": (
        lambda nl, nb, bs, nh, dt: _ll(nl, (nb, bs, nh, 2 * HS), dt),
        lambda c, ly, k: c[ly][..., k * HS : (k + 1) * HS],
    ),
    "NL_X_NB_NH_BS_CS": (
        lambda nl, nb, bs, nh, dt: _ll(nl, (nb, nh, bs, 2 * HS), dt),
        lambda c, ly, k: c[ly][..., k * HS : (k + 1) * HS].transpose(1, 2),
    ),
    "NL_X_TWO_NB_NH_HS_BS": (  # element axis outside the token axis: one chunk per element
        lambda nl, nb, bs, nh, dt: _ll(nl, (2, nb, nh, HS, bs), dt),
        lambda c, ly, k: c[ly][k].permute(0, 3, 1, 2),
    ),
}
MLA = {
    "NL_X_NB_BS_HS": (lambda nl, nb, bs, nh, dt: _ll(nl, (nb, bs, HS), dt), lambda c, ly, k: c[ly].unsqueeze(2)),
    "NL_X_NBBS_ONE_HS": (lambda nl, nb, bs, nh, dt: _ll(nl, (nb * bs, 1, HS), dt), lambda c, ly, k: c[ly].unsqueeze(1)),
}


def _code(layer, kv, slot, head, elem):
    """A unique positive int32 per (layer, K/V, slot, head, element) (slot < 4096, head < 64)."""
    return (((layer * 2 + kv) * 4096 + slot) * 64 + head) * HS + elem + 1


class Cache:
    """A cache of one family, every element holding its code (as int32 bits of the dtype)."""

    def __init__(self, name, nl, nb, bs, nh, dtype=torch.int32, fill=True, seed_offset=0):
        fams = {**FAMILIES, **MLA}
        alloc, self._view = fams[name]
        self.name, self.nl, self.nb, self.bs, self.nh, self.dtype = name, nl, nb, bs, nh, dtype
        self.kv_size = 1 if name in MLA else 2
        self.caches = alloc(nl, nb, bs, nh, dtype)
        if fill and dtype == torch.int32:
            for ly in range(nl):
                for k in range(self.kv_size):
                    v = self.view(ly, k)
                    slot = torch.arange(nb * bs).view(nb, bs, 1, 1)
                    h = torch.arange(nh).view(1, 1, nh, 1)
                    e = torch.arange(HS).view(1, 1, 1, HS)
                    v.copy_(_code(ly + seed_offset, k, slot, h, e).to(torch.int32).view(v.shape))
        self.layout = build_layout(name, self.caches)

    def view(self, layer, kv) -> torch.Tensor:
        """``[NB, BS, NH, HS]`` (int32 bits) of one (layer, K/V)."""
        v = self._view(self.caches, layer, kv)
        return v if v.dtype == torch.int32 else v.view(torch.int32)

    def snapshot(self) -> list[torch.Tensor]:
        return [self.view(ly, k).clone() for ly in range(self.nl) for k in range(self.kv_size)]

    def tensors(self) -> list[torch.Tensor]:
        out, stack = [], [self.caches]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                out.append(x)
            else:
                stack.extend(x)
        return out


def _expected(src: Cache, dst: Cache, ss, ds, *, heads=None, dst_heads=None, layers=None, dst_layers=None):
    """The destination's views after the copy, computed with torch indexing alone."""
    want = {}
    layers = list(range(src.nl)) if layers is None else layers
    dst_layers = list(range(dst.nl)) if dst_layers is None else dst_layers
    h0, h1 = heads or (0, src.nh)
    d0, d1 = dst_heads or (0, dst.nh)
    for sl, dl in zip(layers, dst_layers):
        for k in range(src.kv_size):
            sv = src.view(sl, k).reshape(src.nb * src.bs, src.nh, HS)
            dv = dst.view(dl, k).reshape(dst.nb * dst.bs, dst.nh, HS).clone()
            for a, b in zip(ss.tolist(), ds.tolist()):
                if a >= 0 and b >= 0:
                    dv[b, d0:d1] = sv[a, h0:h1]
            want[(dl, k)] = dv
    return want


def _check(dst: Cache, want: dict, before: list[torch.Tensor]):
    i = 0
    for ly in range(dst.nl):
        for k in range(dst.kv_size):
            got = dst.view(ly, k).reshape(dst.nb * dst.bs, dst.nh, HS)
            exp = want.get((ly, k), before[i].reshape(dst.nb * dst.bs, dst.nh, HS))
            if not torch.equal(got, exp):
                bad = torch.nonzero(got != exp)[0].tolist()
                raise AssertionError(
                    f"{dst.name} layer {ly} kv {k}: first mismatch at (slot, head, elem) {bad}: got {int(got[tuple(bad)])}, want {int(exp[tuple(bad)])}"
                )
            i += 1


def _slots(n_src, n_dst, t, seed, pad=True):
    g = torch.Generator().manual_seed(seed)
    ss = torch.randperm(n_src, generator=g)[:t]
    ds = torch.randperm(n_dst, generator=g)[:t]
    if pad and t > 3:
        ss[1] = -1  # source padding: the destination row stays as it was
        ds[3] = -1  # destination padding
    return ss, ds


# -- every conversion class ------------------------------------------------------------

PAIRS = [(a, b) for a in FAMILIES for b in FAMILIES if a == "NL_X_TWO_NB_BS_NH_HS" or b == "NL_X_TWO_NB_BS_NH_HS"] + [
    ("NL_X_NB_TWO_NH_BS_HS", "NL_X_NB_NH_BS_CS"),
    ("NB_NL_TWO_BS_NH_HS", "TWO_X_NL_X_NB_BS_NH_HS"),
    ("NL_X_TWO_NB_NH_HS_BS", "NL_X_NB_TWO_NH_BS_HS"),
]


@pytest.mark.parametrize("src_name,dst_name", PAIRS)
def test_copy_semantic(kernel, src_name, dst_name):
    # block size 4 -> 8 and a destination pool of a different size: slots are remapped row by row
    src = Cache(src_name, 3, 6, 4, 2)
    dst = Cache(dst_name, 3, 5, 8, 2, seed_offset=7)
    ss, ds = _slots(24, 40, 13, seed=hash((src_name, dst_name)) % 1000)
    want = _expected(src, dst, ss, ds)
    before = dst.snapshot()
    src_before = src.snapshot()
    kvcore.copy(src.layout, ss, dst.layout, ds)
    _check(dst, want, before)
    assert all(torch.equal(a, b) for a, b in zip(src.snapshot(), src_before)), "the source changed"


@pytest.mark.parametrize("src_name,dst_name", [("NL_X_NB_BS_HS", "NL_X_NBBS_ONE_HS"), ("NL_X_NBBS_ONE_HS", "NL_X_NB_BS_HS")])
def test_copy_mla_whole(kernel, src_name, dst_name):
    src = Cache(src_name, 4, 4, 16, 1)
    dst = Cache(dst_name, 4, 3, 8, 1, seed_offset=3)
    ss, ds = _slots(64, 24, 20, seed=5)
    want = _expected(src, dst, ss, ds)
    before = dst.snapshot()
    kvcore.copy(src.layout, ss, dst.layout, ds)
    _check(dst, want, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float64, torch.uint8])
def test_copy_bit_exact_dtypes(kernel, dtype):
    """Bytes move unchanged: random bit patterns (NaN payloads and -0 included) survive NHD -> HND."""
    src = build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.empty(2, 4, 16, 2, 64, dtype=dtype) for _ in range(2)])
    for t in src.kv_caches:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    dst = build_layout("NL_X_TWO_NB_NH_BS_HS", [torch.zeros(2, 3, 2, 32, 64, dtype=dtype) for _ in range(2)])
    ss = torch.arange(40, 64)
    ds = torch.arange(24) + 60
    kvcore.copy(src, ss, dst, ds)
    back = kvcore.gather(dst, ds)
    assert torch.equal(back.view(torch.uint8), kvcore.gather(src, ss).view(torch.uint8))


def test_copy_tp_split_and_merge(kernel):
    # prefill TP 1 (4 heads, NHD, BS 4) -> two decode ranks of TP 2 (2 heads each, HND, BS 8)
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 2, 6, 4, 4)
    ranks = [Cache("NL_X_TWO_NB_NH_BS_HS", 2, 4, 8, 2, seed_offset=9 + r) for r in range(2)]
    ss, ds = _slots(24, 32, 11, seed=1)
    for r, dst in enumerate(ranks):
        want = _expected(src, dst, ss, ds, heads=(2 * r, 2 * r + 2))
        before = dst.snapshot()
        kvcore.copy(src.layout, ss, dst.layout, ds, heads=(2 * r, 2 * r + 2))
        _check(dst, want, before)
    # and back: two TP ranks merged into one cache of 4 heads
    merged = Cache("NL_X_NB_TWO_BS_NH_HS", 2, 3, 16, 4, seed_offset=20)
    ms = torch.arange(11) + 5
    before = merged.snapshot()
    wants = {}
    for r, part in enumerate(ranks):
        w = _expected(part, merged, ds, ms, dst_heads=(2 * r, 2 * r + 2))
        for key, v in w.items():
            base = wants.get(key)
            if base is not None:
                v[:, : 2 * r] = base[:, : 2 * r]
            wants[key] = v
        kvcore.copy(part.layout, ds, merged.layout, ms, dst_heads=(2 * r, 2 * r + 2))
    _check(merged, wants, before)


def test_copy_heads_on_both_sides(kernel):
    src = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 4, 4, 4)
    dst = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 4, 4, 4, seed_offset=2)
    ss, ds = torch.tensor([3, 7, 12]), torch.tensor([0, 15, 9])
    want = _expected(src, dst, ss, ds, heads=(1, 3), dst_heads=(0, 2))
    before = dst.snapshot()
    kvcore.copy(src.layout, ss, dst.layout, ds, heads=(1, 3), dst_heads=(0, 2))
    _check(dst, want, before)


def test_copy_layer_subsets(kernel):
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 4, 4, 4, 2)
    dst = Cache("TWO_X_NL_X_NB_BS_NH_HS", 2, 4, 4, 2, seed_offset=11)
    ss, ds = torch.tensor([1, 2, 3, 9]), torch.tensor([4, 5, 6, 0])
    want = _expected(src, dst, ss, ds, layers=[3, 1], dst_layers=[0, 1])
    before = dst.snapshot()
    kvcore.copy(src.layout, ss, dst.layout, ds, layers=[3, 1], dst_layers=[0, 1])
    _check(dst, want, before)
    # same layer indices on both sides by default
    dst4 = Cache("NL_X_TWO_NB_NH_BS_HS", 4, 4, 4, 2, seed_offset=13)
    want = _expected(src, dst4, ss, ds, layers=[2], dst_layers=[2])
    before = dst4.snapshot()
    kvcore.copy(src.layout, ss, dst4.layout, ds, layers=2)
    _check(dst4, want, before)


def test_copy_within_one_cache_disjoint_slots(kernel):
    c = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 4, 4, 2)
    ss, ds = torch.tensor([0, 1, 2]), torch.tensor([8, 9, 14])
    want = _expected(c, c, ss, ds)
    before = c.snapshot()
    kvcore.copy(c.layout, ss, c.layout, ds)
    _check(c, want, before)


def test_copy_empty_and_all_padding(kernel):
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 2, 4, 2)
    dst = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 2, 4, 2, seed_offset=1)
    before = dst.snapshot()
    kvcore.copy(src.layout, torch.empty(0, dtype=torch.int64), dst.layout, [])
    kvcore.copy(src.layout, torch.tensor([-1, 3]), dst.layout, torch.tensor([2, -1]))
    _check(dst, {}, before)


# -- bad input: a TransferError before any byte moves ----------------------------------


def _refused(src: Cache, dst: Cache, ss, ds, match: str, **kw):
    before = [t.clone() for t in dst.tensors()]
    with pytest.raises(TransferError, match=match):
        kvcore.copy(src.layout, ss, dst.layout, ds, **kw)
    assert all(torch.equal(a, b) for a, b in zip(dst.tensors(), before)), "a refused copy wrote the destination"


def test_refuses_head_mismatch_without_heads():
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 4, 4, 4)
    dst = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 4, 4, 2)
    _refused(src, dst, [0, 1], [2, 3], r"moves 4 KV head\(s\) but the destination .* takes 2; pass heads=\(start, stop\)")


def test_refuses_bad_head_ranges():
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 4, 4, 4)
    dst = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 4, 4, 2)
    _refused(src, dst, [0], [1], r"heads=\(3, 5\) reaches past the 4 KV head", heads=(3, 5))
    _refused(src, dst, [0], [1], r"not a head range", heads=(2, 2))
    _refused(src, dst, [0], [1], r"must be None or \(start, stop\)", heads=3)
    _refused(src, dst, [0], [1], r"moves 3 KV head\(s\) but the destination .* takes 2$", heads=(0, 3))
    mla = Cache("NL_X_NB_BS_HS", 1, 4, 4, 1)
    mla2 = Cache("NL_X_NBBS_ONE_HS", 1, 4, 4, 1)
    _refused(mla, mla2, [0], [1], r"MLA latent has no head axis: it is copied whole", heads=(0, 2))


def test_refuses_dtype_and_width_mismatch():
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 4, 4, 2)
    dst = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 4, 4, 2, dtype=torch.float32, fill=False)
    _refused(src, dst, [0], [1], r"source \(NL_X_TWO_NB_BS_NH_HS\) holds int32 but the destination \(NL_X_TWO_NB_NH_BS_HS\) holds float32")
    wide = build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(2, 4, 4, 2, 2 * HS, dtype=torch.int32)])
    before = [t.clone() for t in wide.kv_caches]
    with pytest.raises(TransferError, match=r"a source head is 32 bytes .* a destination head is 64 bytes"):
        kvcore.copy(src.layout, [0], wide, [1])
    assert all(torch.equal(a, b) for a, b in zip(wide.kv_caches, before))


def test_refuses_bad_slots():
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 4, 4, 2)
    dst = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 2, 4, 2)
    _refused(src, dst, [0, 1, 2], [3, 5, 3], r"destination slot 3 appears more than once in dst_slots \(rows \[0, 2\]\)")
    _refused(src, dst, [0, 16], [1, 2], r"src_slots\[1\] = 16 is out of range: .* 16 slots")
    _refused(src, dst, [0, 1], [1, 8], r"dst_slots\[1\] = 8 is out of range: .* 8 slots")
    _refused(src, dst, [0, 1], [1], r"src_slots has 2 rows but dst_slots has 1")
    _refused(src, dst, torch.tensor([0.0]), [1], r"src_slots must be a 1-D integer tensor")
    _refused(src, dst, [[0]], [[1]], r"src_slots must be 1-D")


def test_refuses_overlap_within_one_cache():
    c = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 4, 4, 2)
    _refused(c, c, [0, 5], [5, 6], r"share memory and slot 5 is both read and written")


def test_refuses_layer_and_plane_mismatch():
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 3, 4, 4, 1)
    dst = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 4, 4, 1)
    _refused(src, dst, [0], [1], r"moves 3 source layer\(s\) into 2 destination layer\(s\)")
    _refused(src, dst, [0], [1], r"layers=\[2\] names layer 2, but the destination has 2 layers; pass dst_layers=", layers=[2])
    _refused(src, dst, [0], [1], r"dst_layers: layer index 5 is out of range", layers=[0], dst_layers=[5])
    mla = Cache("NL_X_NB_BS_HS", 2, 4, 4, 1)
    _refused(src, mla, [0], [1], r"records planes K\+V per token but the destination \(NL_X_NB_BS_HS\) records KV", layers=[0, 1])


def test_refuses_meta_and_non_layouts():
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 4, 4, 2)
    meta = build_layout("NL_X_TWO_NB_NH_BS_HS", [torch.empty(2, 4, 2, 4, HS, dtype=torch.int32, device="meta")])
    with pytest.raises(TransferError, match="meta device"):
        kvcore.copy(src.layout, [0], meta, [0])
    with pytest.raises(TransferError, match="must be a KVLayout"):
        kvcore.copy(src.caches, [0], src.layout, [1])


def test_kernel_selection_on_cpu(monkeypatch):
    src = Cache("NL_X_TWO_NB_BS_NH_HS", 1, 4, 4, 2)
    dst = Cache("NL_X_TWO_NB_NH_BS_HS", 1, 4, 4, 2)
    plan = plan_copy(src.layout, [0], dst.layout, [1])
    assert not NATIVE_CUDA_COPY.supports_copy(plan)  # both sides on the CPU
    monkeypatch.setenv("KVCORE_COPY_KERNEL", "reference")
    assert select_copy_kernel(plan).name == "reference"
    monkeypatch.setenv("KVCORE_COPY_KERNEL", "native-cuda")
    with pytest.raises(TransferError, match="copy kernel native-cuda .* cannot serve"):
        kvcore.copy(src.layout, [0], dst.layout, [1])
    monkeypatch.setenv("KVCORE_COPY_KERNEL", "nope")
    with pytest.raises(TransferError, match="names no copy kernel"):
        kvcore.copy(src.layout, [0], dst.layout, [1])


def test_select_heads_is_a_derived_table():
    c = Cache("NL_X_TWO_NB_NH_BS_HS", 2, 4, 4, 4)
    t = c.layout.stride_table()
    s = t.select_heads(1, 3)
    assert s.num_heads == 2 and s.row_bytes == 2 * HS * 4 and s.classic
    for p, q in zip(t.planes, s.planes):
        assert q.strides == p.strides
        assert [off for _, off in q.bases] == [off + p.strides.head for _, off in p.bases]
    assert t.select_heads(0, 4) is t
    staged = kvcore.gather(c.layout, torch.tensor([5, 6]))
    from kvcore.kernels import TransferPlan
    from kvcore.kernels.reference import REFERENCE

    out = torch.zeros(2, 2, 2, 2 * HS, dtype=torch.int32)
    REFERENCE.gather(TransferPlan(table=s, slots=torch.tensor([5, 6]), staging=out, num_valid=2))
    assert torch.equal(out, staged.view(2, 2, 2, 4, HS)[:, :, :, 1:3].reshape(2, 2, 2, 2 * HS))


# -- CUDA (run on a GPU machine: scripts/gpu_pd_bench.py runs these first) -----------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _to(c: Cache, device, pin=False) -> Cache:
    """The same cache (same values, same layout) on another device or in pinned host memory."""
    out = Cache(c.name, c.nl, c.nb, c.bs, c.nh, fill=False)

    def move(x):
        if isinstance(x, torch.Tensor):
            y = x.to(device)
            return y.pin_memory() if pin else y
        t = [move(v) for v in x]
        return tuple(t) if isinstance(x, tuple) else t

    out.caches = move(c.caches)
    out.layout = build_layout(c.name, out.caches)
    return out


@cuda
@pytest.mark.parametrize("src_name,dst_name", PAIRS + [("NL_X_NB_BS_HS", "NL_X_NBBS_ONE_HS")])
@pytest.mark.parametrize("where", ["device", "to_pinned", "from_pinned", "to_pageable"])
def test_copy_cuda_semantic(src_name, dst_name, where, monkeypatch):
    nh = 1 if src_name in MLA else 2
    src = Cache(src_name, 3, 6, 4, nh)
    dst = Cache(dst_name, 3, 5, 8, nh, seed_offset=7)
    ss, ds = _slots(24, 40, 13, seed=3)
    want = _expected(src, dst, ss, ds)
    before = dst.snapshot()
    dev = torch.device("cuda")
    gs = _to(src, "cpu", pin=True) if where == "from_pinned" else _to(src, dev)
    if where == "to_pinned":
        gd = _to(dst, "cpu", pin=True)
    elif where == "to_pageable":
        gd = _to(dst, "cpu")
    else:
        gd = _to(dst, dev)
    plan = plan_copy(gs.layout, ss, gd.layout, ds)
    expect_native = where != "to_pageable" and NATIVE_CUDA_COPY.available()
    assert (select_copy_kernel(plan).name == "native-cuda") == expect_native
    kvcore.copy(gs.layout, ss.to(dev), gd.layout, ds.to(dev))
    torch.cuda.synchronize()
    got = _to(gd, "cpu")
    _check(got, want, before)


@cuda
def test_copy_cuda_tp_split_bit_exact():
    dev = torch.device("cuda")
    src = build_layout(
        "NL_X_TWO_NB_BS_NH_HS",
        [torch.randint(-(2**15), 2**15, (2, 64, 16, 8, 128), dtype=torch.int16, device=dev).view(torch.bfloat16) for _ in range(4)],
    )
    ranks = [
        build_layout("NL_X_TWO_NB_NH_BS_HS", [torch.zeros(2, 40, 4, 32, 128, dtype=torch.bfloat16, device=dev) for _ in range(4)])
        for _ in range(2)
    ]
    ss = torch.randperm(1024, device=dev)[:777]
    ds = torch.randperm(1280, device=dev)[:777]
    for r, d in enumerate(ranks):
        kvcore.copy(src, ss, d, ds, heads=(4 * r, 4 * r + 4))
    full = kvcore.gather(src, ss).view(2, 4, 777, 8, 128)
    for r, d in enumerate(ranks):
        got = kvcore.gather(d, ds).view(2, 4, 777, 4, 128)
        assert torch.equal(got.view(torch.int16), full[:, :, :, 4 * r : 4 * r + 4].view(torch.int16))


@cuda
def test_copy_cuda_validates_on_the_device():
    """validate='device' (default): a refused copy writes nothing and raises at kvcore.synchronize
    (or the next kvcore CUDA call); 'sync' raises in the call; every refusal of the host checks
    has its device twin (source and destination range, a destination slot twice, a slot read
    and written within one cache)."""
    dev = torch.device("cuda")
    src = _to(Cache("NL_X_TWO_NB_BS_NH_HS", 2, 4, 4, 2), dev)
    dst = _to(Cache("NL_X_TWO_NB_NH_BS_HS", 2, 2, 8, 2, seed_offset=5), dev)
    before = [t.clone() for t in dst.tensors()]
    cases = [
        ([0, 1, 2], [3, 5, 3], r"destination slot 3 appears more than once in dst_slots"),
        ([0, 16], [1, 2], r"src_slots\[1\] = 16 is out of range: the source has 16 slots"),
        ([0, 1], [1, 16], r"dst_slots\[1\] = 16 is out of range: the destination has 16 slots"),
    ]
    for ss, ds, match in cases:
        s, d = torch.tensor(ss, device=dev), torch.tensor(ds, device=dev)
        kvcore.copy(src.layout, s, dst.layout, d)  # enqueued; refused on the device
        with pytest.raises(
            TransferError, match=r"an earlier kvcore.copy \(call #\d+\) was refused on the device and wrote nothing: " + match
        ):
            kvcore.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(dst.tensors(), before))
        with pytest.raises(TransferError, match=match.split(":")[0]):
            kvcore.copy(src.layout, s, dst.layout, d, validate="sync")
        assert all(torch.equal(a, b) for a, b in zip(dst.tensors(), before))
    kvcore.synchronize()  # nothing pending
    one = _to(Cache("NL_X_TWO_NB_NH_BS_HS", 1, 4, 4, 2), dev)
    keep = [t.clone() for t in one.tensors()]
    kvcore.copy(one.layout, torch.tensor([0, 5], device=dev), one.layout, torch.tensor([5, 6], device=dev))
    with pytest.raises(TransferError, match=r"share memory and slot 5 is both read and written"):
        kvcore.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(one.tensors(), keep))
    # a good copy after the refusals lands
    ss, ds = torch.tensor([0, 5, 9], device=dev), torch.tensor([2, 7, 11], device=dev)
    kvcore.copy(src.layout, ss, dst.layout, ds)
    kvcore.synchronize()
    got = kvcore.gather(dst.layout, ds).cpu()
    want = kvcore.gather(src.layout, ss).cpu()
    assert torch.equal(got, want)


@cuda
def test_copy_cuda_public_call_matches_the_kernel_entry():
    dev = torch.device("cuda")
    src = _to(Cache("NL_X_TWO_NB_BS_NH_HS", 3, 6, 4, 2), dev)
    dst = _to(Cache("NL_X_TWO_NB_NH_BS_HS", 3, 5, 8, 2, seed_offset=7), dev)
    ss, ds = _slots(24, 40, 13, seed=3)
    for validate in (None, "none", "sync"):
        d2 = _to(Cache("NL_X_TWO_NB_NH_BS_HS", 3, 5, 8, 2, seed_offset=7), dev)
        kvcore.copy(src.layout, ss.to(dev), d2.layout, ds.to(dev), validate=validate)
        plan = plan_copy(src.layout, ss, dst.layout, ds)
        select_copy_kernel(plan).copy(plan)
        kvcore.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(d2.tensors(), dst.tensors()))
