"""The public transfer path at kernel speed (issue 12): reusable plans, ``validate=``,
device-side validation on CUDA (a refused call writes nothing; its error surfaces at the
next kvcore CUDA transfer or at ``kvcore.synchronize()``), CUDA-graph capture and replay
with new slot values, stale storage on CUDA. The CPU cases run everywhere; the CUDA cases
on a GPU machine (``scripts/gpu_check.py``)."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.errors import TransferError
from kvcore.kernels import _build

NL, NB, BS, NH, HS = 3, 8, 4, 2, 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _native_or_skip(device: str):
    if _build.disabled() or not _build.load().loaded or (device == "cuda" and not _build.status().cuda):
        pytest.skip("no native op")


def _layout(device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randint(0, 256, (2, NB, BS, NH, HS * 2), dtype=torch.uint8, generator=g).view(dtype).to(device) for _ in range(NL)]
    return kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)


def _raw(lay):
    return [c.view(torch.uint8).cpu().clone() for c in lay.kv_caches]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- CPU: plans and the validate argument -------------------------------------------------


def test_a_plan_moves_what_the_module_functions_move():
    lay = _layout("cpu")
    p = kvcore.plan(lay, layers=[2, 0])
    assert p.staging_shapes(5) == {"kv": (2, 2, 5, NH * HS)}
    out = p.gather([3, -1, 17, 4, 30])
    assert torch.equal(out.view(torch.int16), kvcore.gather(lay, [3, -1, 17, 4, 30], layers=[2, 0]).view(torch.int16))
    one = kvcore.plan(lay, layers=1)
    assert one.gather([5]).shape == (2, 1, NH * HS)
    src = torch.randn(2, 2, 2, NH * HS).to(torch.bfloat16)
    p.scatter([9, 10], src)
    assert torch.equal(p.gather([9, 10]), src)
    # kvcore.gather keeps one plan per (layout, layers)
    kvcore.gather(lay, [1], layers=[2, 0])
    assert len([k for k in lay.__dict__["_kvcore_plans"] if k[0] == ("L", 2, 0)]) == 1


def test_validate_argument():
    lay = _layout("cpu")
    with pytest.raises(TransferError, match="validate must be one of"):
        kvcore.gather(lay, [1], validate="later")
    # CPU: "device" and "sync" are synchronous; "none" skips the value checks, never memory safety
    for v in ("device", "sync"):
        with pytest.raises(TransferError, match="out of range"):
            kvcore.gather(lay, [1, NB * BS], validate=v)
    snap = _raw(lay)
    out = kvcore.gather(lay, [1, NB * BS + 5, -1], validate="none")  # the bad row is skipped, not read
    assert torch.all(out[:, :, 1:].view(torch.int16) == 0)
    assert torch.equal(out[:, :, 0], kvcore.gather(lay, [1])[:, :, 0])
    kvcore.scatter(lay, [NB * BS + 1], torch.ones(2, NL, 1, NH * HS, dtype=torch.bfloat16), validate="none")
    assert _same(_raw(lay), snap)


def test_int32_and_list_slot_mappings_and_numpy_skip_prefix():
    import numpy as np

    lay = _layout("cpu")
    a = kvcore.gather(lay, torch.tensor([4, 9, 2], dtype=torch.int32), skip_prefix=np.int64(1))
    b = kvcore.gather(lay, [4, 9, 2], skip_prefix=1)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.all(a[:, :, 0].view(torch.int16) == 0)


# -- CUDA ---------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("bad", ["range", "duplicate"])
def test_device_validation_writes_nothing_and_reports_later(direction, bad):
    _native_or_skip("cuda")
    if direction == "gather" and bad == "duplicate":
        pytest.skip("a gather may read a slot twice")
    kvcore.synchronize()  # nothing pending from earlier tests
    lay = _layout("cuda")
    slots = torch.tensor([3, 9, NB * BS + 2, 1] if bad == "range" else [3, 9, 3, 1], device="cuda")
    snap = _raw(lay)
    buf = torch.full((2, NL, 4, NH * HS), 2.0, dtype=torch.bfloat16, device="cuda")
    keep = buf.clone()
    if direction == "gather":
        kvcore.gather(lay, slots, buf)  # returns at once: no host synchronisation
    else:
        kvcore.scatter(lay, slots, buf)
    torch.cuda.synchronize()
    assert torch.equal(buf, keep) and _same(_raw(lay), snap)
    msg = r"slot_mapping\[2\] = 34 is out of range" if bad == "range" else "slot 3 appears more than once"
    with pytest.raises(TransferError, match=msg):
        kvcore.synchronize()
    kvcore.synchronize()  # reported once
    # later valid calls work
    good = torch.tensor([3, 9, 5, 1], device="cuda")
    kvcore.scatter(lay, good, buf)
    assert torch.equal(kvcore.gather(lay, good), buf)


@cuda
def test_a_device_refusal_surfaces_at_the_next_cuda_transfer_which_then_does_nothing():
    _native_or_skip("cuda")
    kvcore.synchronize()
    lay = _layout("cuda")
    src = torch.ones(2, NL, 2, NH * HS, dtype=torch.bfloat16, device="cuda")
    kvcore.scatter(lay, torch.tensor([1, 1], device="cuda"), src)
    torch.cuda.synchronize()
    snap = _raw(lay)
    with pytest.raises(TransferError, match="an earlier kvcore.scatter .* was refused on the device and wrote nothing"):
        kvcore.scatter(lay, torch.tensor([4, 5], device="cuda"), src)
    torch.cuda.synchronize()
    assert _same(_raw(lay), snap)  # the call that raised did nothing
    kvcore.scatter(lay, torch.tensor([4, 5], device="cuda"), src)
    assert torch.equal(kvcore.gather(lay, torch.tensor([4, 5], device="cuda")), src)


@cuda
def test_validate_sync_raises_before_returning():
    _native_or_skip("cuda")
    kvcore.synchronize()
    lay = _layout("cuda")
    snap = _raw(lay)
    src = torch.ones(2, NL, 3, NH * HS, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TransferError, match=r"slot_mapping\[1\] = 99 is out of range"):
        kvcore.scatter(lay, torch.tensor([2, 99, 4], device="cuda"), src, validate="sync")
    assert _same(_raw(lay), snap)
    kvcore.synchronize()  # nothing left pending
    kvcore.scatter(lay, torch.tensor([2, 3, 4], device="cuda"), src, validate="sync")


@cuda
@pytest.mark.parametrize("validate", ["device", "none"])
def test_cuda_graph_capture_and_replay_with_new_slot_values(validate):
    _native_or_skip("cuda")
    kvcore.synchronize()
    lay = _layout("cuda", seed=4)
    ref = _layout("cuda", seed=4)  # the same bytes, moved eagerly
    slots = torch.tensor([0, 5, 9, 30], device="cuda")
    out = torch.zeros(2, NL, 4, NH * HS, dtype=torch.bfloat16, device="cuda")
    src = torch.randn(2, NL, 4, NH * HS, device="cuda").to(torch.bfloat16)
    p = kvcore.plan(lay)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: prepares the plan outside the capture
        p.gather(slots, out, validate=validate)
        p.scatter(slots, src, validate=validate)
    torch.cuda.current_stream().wait_stream(side)
    kvcore.scatter(ref, slots, src)  # the reference cache gets the warm-up's write too
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p.scatter(slots, src, validate=validate)
        p.gather(slots, out, validate=validate)
    for new in ([7, 1, 22, 12], [2, -1, 31, 8], [16, 17, 18, 19]):
        slots.copy_(torch.tensor(new, device="cuda"))
        src.copy_(torch.randn(src.shape, device="cuda").to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        kvcore.scatter(ref, slots, src)
        want = kvcore.gather(ref, slots)
        ok = slots >= 0
        assert torch.equal(out[:, :, ok], want[:, :, ok])
        assert _same(_raw(lay), _raw(ref))
    if validate == "device":
        snap = _raw(lay)
        slots.copy_(torch.tensor([3, 3, 4, 5], device="cuda"))  # a repeated scatter slot (the gather may read it twice)
        g.replay()
        torch.cuda.synchronize()
        assert _same(_raw(lay), snap)
        with pytest.raises(TransferError, match="slot 3 appears more than once"):
            kvcore.synchronize()


@cuda
def test_cuda_stale_storage_is_a_transfer_error_not_an_illegal_access():
    _native_or_skip("cuda")
    kvcore.synchronize()
    lay = _layout("cuda")
    kvcore.gather(lay, torch.tensor([1, 2], device="cuda"))
    lay.kv_caches[1].untyped_storage().resize_(0)
    out = torch.full((2, NL, 2, NH * HS), 3.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TransferError, match="layer 1 plane K was freed"):
        kvcore.gather(lay, torch.tensor([1, 2], device="cuda"), out)
    with pytest.raises(TransferError, match="Detect the cache again"):
        kvcore.scatter(lay, torch.tensor([1, 2], device="cuda"), out)
    torch.cuda.synchronize()  # the context is healthy
    assert torch.all(out == 3.0)


@cuda
def test_cuda_staging_inside_the_cache_is_refused():
    _native_or_skip("cuda")
    lay = _layout("cuda")
    view = lay.kv_caches[0].view(-1)[: 2 * NL * 2 * NH * HS].view(2, NL, 2, NH * HS)
    snap = _raw(lay)
    with pytest.raises(TransferError, match="shares memory with the KV cache"):
        kvcore.gather(lay, torch.tensor([5, 6], device="cuda"), view)
    assert _same(_raw(lay), snap)


@cuda
def test_cuda_concurrent_streams_on_disjoint_slots():
    _native_or_skip("cuda")
    kvcore.synchronize()
    lay = _layout("cuda")
    ref = _layout("cuda")
    srcs = [torch.randn(2, NL, 4, NH * HS, device="cuda").to(torch.bfloat16) for _ in range(4)]
    slot_sets = [torch.arange(4 * i, 4 * i + 4, device="cuda") for i in range(4)]
    streams = [torch.cuda.Stream() for _ in range(4)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(5):
        for st, sl, src in zip(streams, slot_sets, srcs):
            with torch.cuda.stream(st):
                kvcore.scatter(lay, sl, src)
    torch.cuda.synchronize()
    kvcore.synchronize()  # no false duplicate across streams
    for sl, src in zip(slot_sets, srcs):
        kvcore.scatter(ref, sl, src)
    assert _same(_raw(lay), _raw(ref))


@cuda
def test_cuda_quantised_planes_with_pinned_staging():
    _native_or_skip("cuda")
    from kvcore.bench import quantised_table
    from kvcore.kernels import TransferPlan
    from kvcore.kernels.native import CUDA_KERNEL
    from kvcore.kernels.reference import REFERENCE

    table, _ = quantised_table(num_layers=3, num_blocks=8, block_size=16, num_heads=8, head_size=128, device="cuda")
    slots = torch.randperm(128, device="cuda")[:40]
    slots[::7] = -1
    nv = int((slots >= 0).sum())
    pinned = {b.key: torch.full(b.shape(3, 40), 0, dtype=b.dtype).pin_memory() for b in table.buffers}
    dev = {b.key: torch.zeros(b.shape(3, 40), dtype=b.dtype, device="cuda") for b in table.buffers}
    CUDA_KERNEL.gather(TransferPlan(table, slots, pinned, nv))
    REFERENCE.gather(TransferPlan(table, slots, dev, nv))
    torch.cuda.synchronize()
    for k in pinned:
        assert torch.equal(pinned[k].view(torch.uint8), dev[k].cpu().view(torch.uint8)), k
