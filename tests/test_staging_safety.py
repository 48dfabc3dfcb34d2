"""Staging buffers that alias the cache or themselves, and views carrying torch's
negative/conjugate bits (issue 17.2), on every CPU kernel: refused before any byte moves
(byte ranges, not only stride 0), or resolved so the values moved are the view's values."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.errors import TransferError
from kvcore.kernels import TransferPlan, _build

NL, NB, BS, NH, HS = 2, 4, 4, 2, 8
KERNELS = ["reference"] + ([] if _build.disabled() else ["native-cpu"])


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    if request.param == "native-cpu" and not _build.load().loaded:
        pytest.skip("no native op")
    monkeypatch.setenv("KVCORE_KERNEL", request.param)
    return request.param


def _layout(big: bool = False):
    # one storage holding both layers (and, when big, room for a staging buffer after them)
    n = 2 * NB * BS * NH * HS
    pool = torch.randn(NL * n + (2 * NL * 5 * NH * HS if big else 0))
    caches = [pool[i * n : (i + 1) * n].view(2, NB, BS, NH, HS) for i in range(NL)]
    return kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches), pool


def _bytes(t):
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def test_out_inside_the_cache_is_refused(kernel):
    lay, pool = _layout()
    shape = lay.staging_shape(5)
    out = pool[: 2 * NL * 5 * NH * HS].view(shape)  # a view into layer 0's K and V
    before = _bytes(pool)
    with pytest.raises(TransferError, match="shares memory with the KV cache"):
        kvcore.gather(lay, [1, 2, 3, 4, 5], out)
    assert torch.equal(_bytes(pool), before)


def test_out_in_the_same_pool_but_outside_the_cache_is_fine(kernel):
    lay, pool = _layout(big=True)
    n = NL * 2 * NB * BS * NH * HS
    out = pool[n:].view(lay.staging_shape(5))
    got = kvcore.gather(lay, [1, 2, 3, 4, 5], out)
    assert got is out
    assert torch.equal(out, kvcore.gather(lay, [1, 2, 3, 4, 5]))


def test_scatter_from_the_rows_it_overwrites_is_refused(kernel):
    lay, pool = _layout()
    # src rows are cache rows: token t of K layer 0 is slot t's row
    src = pool[: 2 * NL * 3 * NH * HS].view(lay.staging_shape(3))
    before = _bytes(pool)
    with pytest.raises(TransferError, match="shares memory with the KV cache"):
        kvcore.scatter(lay, [3, 1, 0], src)
    assert torch.equal(_bytes(pool), before)


@pytest.mark.parametrize(
    "strides",
    [
        (5 * NH * HS, 5 * NH * HS, NH * HS, 1),  # layer 1's K is layer 0's V
        (2 * 5 * NH * HS, 5 * NH * HS, NH * HS // 2, 1),  # token rows half a row apart
        (0, 5 * NH * HS, NH * HS, 1),  # K and V one memory (stride 0)
    ],
    ids=["layer1-K-is-layer0-V", "half-row-token-stride", "kv-stride-0"],
)
def test_out_whose_rows_share_memory_is_refused(kernel, strides):
    lay, pool = _layout()
    shape = lay.staging_shape(5)
    base = torch.full((4 * 5 * NL * NH * HS,), 7.0)
    out = torch.as_strided(base, shape, strides)
    before = _bytes(pool)
    with pytest.raises(TransferError, match="share memory|stride 0"):
        kvcore.gather(lay, [1, 2, 3, 4, 5], out)
    assert torch.all(base == 7.0)
    with pytest.raises(TransferError, match="share memory|stride 0"):
        kvcore.scatter(lay, [1, 2, 3, 4, 5], out)
    assert torch.equal(_bytes(pool), before)


def test_a_negative_view_is_moved_as_its_values(kernel):
    lay, pool = _layout()
    slots = [6, -1, 2]
    plain = torch.randn(lay.staging_shape(3))
    neg_src = (-plain)._neg_view()  # reads as `plain`, stored as -plain
    assert neg_src.is_neg() and torch.equal(neg_src, plain)
    kvcore.scatter(lay, slots, neg_src)
    back = kvcore.gather(lay, slots)
    assert torch.equal(back[:, :, [0, 2]], plain[:, :, [0, 2]])
    # gather into a negative view: the view reads the cache's values; padding rows keep theirs
    store = torch.full(lay.staging_shape(3), -5.0)
    out = store._neg_view()  # reads as +5
    kvcore.gather(lay, slots, out)
    assert torch.equal(out[:, :, [0, 2]], plain[:, :, [0, 2]])
    assert torch.all(out[:, :, 1] == 5.0)


def test_native_op_refuses_overlapping_and_aliasing_plane_buffers():
    """Per-plane staging dicts at the kernel level: two buffers sharing memory, a buffer
    inside the cache, rows sharing memory: refused, nothing written."""
    if _build.disabled() or not _build.load().loaded:
        pytest.skip("no native op")
    from kvcore.bench import quantised_table
    from kvcore.kernels.native import CPU_KERNEL

    table, tensors = quantised_table(num_layers=2, num_blocks=4, block_size=4, num_heads=2, head_size=8, device="cpu")
    shapes = {b.key: b.shape(2, 3) for b in table.buffers}
    good = {b.key: torch.zeros(shapes[b.key], dtype=b.dtype) for b in table.buffers}
    slots = torch.tensor([1, 5, 9])

    def raw():  # bytes (random bf16 scales hold NaNs)
        return [t.view(torch.uint8).clone() for ts in tensors.values() for t in ts]

    before = raw()

    def unchanged():
        return all(torch.equal(a, b) for a, b in zip(raw(), before))

    shared = dict(good)
    shared["V"] = good["K"]  # two planes, one memory
    with pytest.raises(TransferError, match="share memory"):
        CPU_KERNEL.scatter(TransferPlan(table, slots, shared, 3))
    inside = dict(good)
    inside["K"] = tensors["K"][0].view(-1)[: good["K"].numel()].view(shapes["K"])
    with pytest.raises(TransferError, match="shares memory with the KV cache"):
        CPU_KERNEL.gather(TransferPlan(table, slots, inside, 3))
    rows = dict(good)
    rows["KS"] = torch.as_strided(torch.zeros(64, dtype=torch.bfloat16), shapes["KS"], (3, 1, 1))
    with pytest.raises(TransferError, match="share memory"):
        CPU_KERNEL.gather(TransferPlan(table, slots, rows, 3))
    assert unchanged()
    CPU_KERNEL.gather(TransferPlan(table, slots, good, 3))


def _overlaps(t: torch.Tensor) -> bool:
    """Brute force: do two elements of ``t`` share a byte?"""
    esz = t.element_size()
    seen: set[int] = set()
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in t.shape]).reshape(-1, t.dim()).tolist():
        off = sum(i * s for i, s in zip(idx, t.stride())) * esz
        b = set(range(off, off + esz))
        if seen & b:
            return True
        seen |= b
    return False


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        s0=st.integers(0, 40),
        s1=st.integers(0, 40),
        s2=st.integers(0, 20),
        kern=st.sampled_from(KERNELS),
    )
    def test_random_staging_strides_are_refused_exactly_when_rows_could_collide(s0, s1, s2, kern):
        """Any strided ``out`` either is refused, or gathers exactly what a fresh buffer gets;
        one whose elements truly share memory is always refused."""
        import os

        caches = [torch.randn(2, 3, 2, 1, 4) for _ in range(2)]
        lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)
        shape = lay.staging_shape(3)  # [2, 2, 3, 4]
        strides = (s0, s1, s2, 1)
        need = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
        out = torch.as_strided(torch.full((need,), 9.0), shape, strides)
        old = os.environ.get("KVCORE_KERNEL")
        os.environ["KVCORE_KERNEL"] = kern
        try:
            try:
                kvcore.gather(lay, [0, 4, 3], out)
            except TransferError:
                return
            assert not _overlaps(out)
            assert torch.equal(out, kvcore.gather(lay, [0, 4, 3]))
        finally:
            if old is None:
                os.environ.pop("KVCORE_KERNEL", None)
            else:
                os.environ["KVCORE_KERNEL"] = old
