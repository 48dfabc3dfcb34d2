"""Index inputs that must be refused rather than coerced, and borrowed storage that changes
under a layout (failures seen in offloading systems: truncated float slots, wrapped
unsigned ids, meta tensors from a log, a cache reallocated after detection)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

import kvcore

NB, BS, NH, HS = 4, 4, 2, 8


@pytest.fixture()
def layout():
    caches = [torch.arange(2 * NB * BS * NH * HS, dtype=torch.float32).reshape(2, NB, BS, NH, HS) + 1000 * i for i in range(2)]
    return kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", caches)


@pytest.mark.parametrize(
    "slots",
    [[1.7, 2.2], np.array([np.inf]), np.array([2**64 - 1], dtype=np.uint64), [True, False], np.array([-0.5]), torch.tensor([1.0])],
    ids=["float-list", "inf", "uint64-wrap", "bools", "negative-float", "float-tensor"],
)
def test_non_integer_slot_mappings_are_refused_not_truncated(layout, slots):
    before = [t.clone() for t in layout.kv_caches]
    with pytest.raises(kvcore.TransferError, match="integer tensor"):
        kvcore.gather(layout, slots)
    with pytest.raises(kvcore.TransferError, match="integer tensor"):
        kvcore.scatter(layout, slots, torch.zeros(2, 2, len(slots), NH * HS))
    assert all(torch.equal(a, b) for a, b in zip(before, layout.kv_caches))


def test_integer_lists_and_arrays_are_slots(layout):
    want = kvcore.gather(layout, torch.tensor([1, 6]))
    assert torch.equal(kvcore.gather(layout, [1, 6]), want)
    assert torch.equal(kvcore.gather(layout, np.array([1, 6], dtype=np.int32)), want)
    assert kvcore.gather(layout, []).shape == (2, 2, 0, NH * HS)
    assert torch.equal(want[1, 0, 1].view(NH, HS), layout.kv_caches[0][1, 1, 2])  # slot 6 = block 1, offset 2


def test_block_ids_must_be_integers(layout):
    with pytest.raises(kvcore.TransferError, match="block_ids must be a 1-D integer"):
        kvcore.gather_blocks(layout, [1.9])


def test_a_one_element_array_of_layers_is_a_list_not_a_scalar(layout):
    assert kvcore.gather(layout, [1], layers=torch.tensor([1])).shape == (2, 1, 1, NH * HS)
    assert kvcore.gather(layout, [1], layers=np.array([1])).shape == (2, 1, 1, NH * HS)
    assert kvcore.gather(layout, [1], layers=torch.tensor(1)).shape == (2, 1, NH * HS)
    with pytest.raises(kvcore.TransferError, match="1-D"):
        kvcore.gather(layout, [1], layers=torch.tensor([[1]]))


def test_an_expanded_out_buffer_is_refused(layout):
    out = torch.zeros(1, 1, 1, NH * HS).expand(2, 2, 3, NH * HS)
    with pytest.raises(kvcore.TransferError, match="stride 0"):
        kvcore.gather(layout, [1, 2, 3], out)


def test_meta_layouts_describe_but_do_not_move():
    lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.empty(2, NB, BS, NH, HS, device="meta") for _ in range(2)])
    assert lay.describe() == f"2 x [2, {NB}, {BS}, {NH}, {HS}]"
    with pytest.raises(kvcore.TransferError, match="meta"):
        kvcore.gather(lay, [1])


def test_meta_slot_mapping_is_refused(layout):
    with pytest.raises(kvcore.TransferError, match="meta"):
        kvcore.gather(layout, torch.tensor([1], device="meta"))


def test_layer_groups_that_are_not_lists_are_a_detection_error():
    with pytest.raises(kvcore.DetectionError, match="layer_groups"):
        kvcore.detect_per_layer([torch.zeros(2, NB, BS, NH, HS)], "vllm", layer_groups=[0, 1])


def _changes(t: torch.Tensor, how: str):
    """Change ``t``'s storage as an engine might; returns what must stay alive meanwhile."""
    st = t.untyped_storage()
    n = st.nbytes()
    if how == "freed":
        st.resize_(0)
    elif how == "reallocated":  # same size, new memory (blockers keep the old block from coming back)
        old, blockers = st.data_ptr(), []
        for _ in range(16):
            st.resize_(0)
            blockers += [torch.empty(n, dtype=torch.uint8) for _ in range(4)]
            st.resize_(n)
            if st.data_ptr() != old:
                return blockers
        pytest.skip("the allocator kept handing back the same block")
    elif how == "grown":
        st.resize_(n + 4096)
    else:  # replaced: the tensor now views other memory
        t.set_(torch.zeros(t.shape, dtype=t.dtype).untyped_storage(), 0, t.shape, t.stride())
    return None


@pytest.mark.parametrize("kernel", ["native-cpu", "reference"])
@pytest.mark.parametrize("how", ["freed", "reallocated", "grown", "replaced"])
@pytest.mark.parametrize("layer", [0, 1])
def test_a_cache_storage_changed_after_detection_is_refused_before_any_write(layout, kernel, how, layer, monkeypatch):
    """An engine that frees or re-creates its KV cache after detection (sleep mode): every
    (layer, plane) storage is checked, on every kernel, before any byte moves; the caller
    detects again (issue 17.1: a freed layer 1 crashed the native kernel, a reallocated one
    was written at its old address)."""
    from kvcore.kernels import _build

    if kernel == "native-cpu" and (_build.disabled() or not _build.load().loaded):
        pytest.skip("no native op")
    monkeypatch.setenv("KVCORE_KERNEL", kernel)
    staged = kvcore.gather(layout, [5, 9])  # prepares any per-table kernel state
    t = layout.kv_caches[layer]
    alive = _changes(t, how)  # noqa: F841

    # (torch itself must not read a freed tensor: compare whole storages as bytes)
    def storages():
        return [torch.empty(0, dtype=torch.uint8).set_(c.untyped_storage()).clone() for c in layout.kv_caches]

    keep = storages()
    out = torch.full_like(staged, 7.0)
    with pytest.raises(kvcore.TransferError, match=rf"layer {layer} plane K.*{'freed' if how == 'freed' else ''}.*detect"):
        kvcore.gather(layout, [5, 9], out)
    assert torch.all(out == 7.0)
    with pytest.raises(kvcore.TransferError, match="Detect the cache again"):
        kvcore.scatter(layout, [5, 9], staged + 1)
    assert all(torch.equal(a, b) for a, b in zip(storages(), keep))
    with pytest.raises(kvcore.TransferError, match="Detect the cache again"):
        kvcore.plan(layout).gather([1])
    # a new detection of the same tensors moves them again
    if how != "freed":
        fresh = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", layout.kv_caches)
        kvcore.scatter(fresh, [5, 9], staged + 1)
        assert torch.equal(kvcore.gather(fresh, [5, 9]), staged + 1)


_PLANES = "K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH"


def _plane_layout():
    k = [torch.randint(-100, 100, (NB, BS, NH, HS), dtype=torch.int8) for _ in range(2)]
    ks = [torch.randn(NB, BS, NH).to(torch.bfloat16) for _ in range(2)]
    return kvcore.build_layout(_PLANES, {"K": k, "KS": ks})


@pytest.mark.parametrize("kernel", ["native-cpu", "reference"])
@pytest.mark.parametrize("how", ["freed", "reallocated", "grown", "replaced"])
@pytest.mark.parametrize("plane, layer", [("K", 0), ("K", 1), ("KS", 0), ("KS", 1)])
@pytest.mark.parametrize("api", ["module", "plan-made-before", "blocks"])
def test_every_plane_of_a_multi_plane_cache_is_checked_before_any_write(kernel, how, plane, layer, api, monkeypatch):
    """Issue 17 / review: with the reference kernel a reallocated storage of a multi-plane
    layout's second plane or second layer was not refused. Every (layer, plane) storage is
    checked before any byte moves, on every kernel and every entry point (kvcore.gather /
    scatter, a plan made before the change, the block calls); the cache and the staging
    stay byte-identical."""
    from kvcore.kernels import _build

    if kernel == "native-cpu" and (_build.disabled() or not _build.load().loaded):
        pytest.skip("no native op")
    monkeypatch.setenv("KVCORE_KERNEL", kernel)
    lay = _plane_layout()
    plan = kvcore.plan(lay)
    staged = kvcore.gather(lay, [5, 9, 13])
    blocks = kvcore.gather_blocks(lay, [1, 3])
    victim = lay.kv_caches[plane][layer]
    alive = _changes(victim, how)  # noqa: F841

    def storages():
        return [torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone() for r in ("K", "KS") for t in lay.kv_caches[r]]

    keep = storages()
    if api == "module":
        gather, scatter = (lambda out: kvcore.gather(lay, [5, 9, 13], out)), (lambda: kvcore.scatter(lay, [5, 9, 13], staged))
        out = {k: torch.full_like(v, 7) for k, v in staged.items()}
    elif api == "plan-made-before":
        gather, scatter = (lambda out: plan.gather([5, 9, 13], out)), (lambda: plan.scatter([5, 9, 13], staged))
        out = {k: torch.full_like(v, 7) for k, v in staged.items()}
    else:
        gather, scatter = (lambda out: kvcore.gather_blocks(lay, [1, 3], out)), (lambda: kvcore.scatter_blocks(lay, [1, 3], blocks))
        out = {k: torch.full_like(v, 7) for k, v in blocks.items()}
    was = {"freed": "freed", "replaced": "replaced"}.get(how, "reallocated or resized")
    want = rf"layer {layer} plane {plane} was {was}.*Detect the cache again"
    with pytest.raises(kvcore.TransferError, match=want):
        gather(out)
    assert all(torch.all(v == 7) for v in out.values())
    with pytest.raises(kvcore.TransferError, match=want):
        scatter()
    assert all(torch.equal(a, b) for a, b in zip(storages(), keep))


# -- review items 6, 7, 8: lazy views, validate=, the caller's index in errors ----------------

KERNELS = ["native-cpu", "reference"]


def _kernel(kernel, monkeypatch):
    from kvcore.kernels import _build

    if kernel == "native-cpu" and (_build.disabled() or not _build.load().loaded):
        pytest.skip("no native op")
    monkeypatch.setenv("KVCORE_KERNEL", kernel)


def _entry_points(lay, plan):
    """(name, gather(slots, out), scatter(slots, src)) for every way a transfer is asked."""
    return [
        ("module", lambda s, o: kvcore.gather(lay, s, o), lambda s, src: kvcore.scatter(lay, s, src)),
        ("plan", lambda s, o: plan.gather(s, o), lambda s, src: plan.scatter(s, src)),
    ]


@pytest.mark.parametrize("kernel", KERNELS)
def test_index_tensors_with_a_negation_bit_move_by_their_values(layout, kernel, monkeypatch):
    """Review item 6, index side: ``torch.tensor([5, 9])._neg_view()`` shows -5, -9 (padding)
    but stores 5, 9: a kernel reading its bytes moved slots 5 and 9. Slots and block ids move
    as the values they show, on every entry point."""
    _kernel(kernel, monkeypatch)
    plan = kvcore.plan(layout)
    for name, gather, scatter in _entry_points(layout, plan):
        pad = torch.tensor([5, 9])._neg_view()  # reads [-5, -9]: padding, nothing moves
        out = torch.full((2, 2, 2, NH * HS), 7.0)
        gather(pad, out)
        assert torch.all(out == 7.0), name
        before = [t.clone() for t in layout.kv_caches]
        scatter(pad, torch.zeros(2, 2, 2, NH * HS))
        assert all(torch.equal(a, b) for a, b in zip(before, layout.kv_caches)), name
        shown = (-torch.tensor([3, 6]))._neg_view()  # reads [3, 6]
        assert torch.equal(gather(shown, None), kvcore.gather(layout, torch.tensor([3, 6]))), name
    blocks = torch.tensor([1])._neg_view()  # block -1: padding
    out = torch.full((2, 2, BS, NH * HS), 7.0)
    kvcore.gather_blocks(layout, blocks, out)
    assert torch.all(out == 7.0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sparse_or_nested_index_tensors_are_transfer_errors(layout, kernel, monkeypatch):
    _kernel(kernel, monkeypatch)
    plan = kvcore.plan(layout)
    bad = {"sparse_coo": torch.tensor([1, 2]).to_sparse(), "nested": torch.nested.nested_tensor([torch.tensor([1, 2])])}
    for kind, s in bad.items():
        for _, gather, scatter in _entry_points(layout, plan):
            with pytest.raises(kvcore.TransferError, match=f"slot_mapping is a {kind} tensor"):
                gather(s, None)
            with pytest.raises(kvcore.TransferError, match=f"slot_mapping is a {kind} tensor"):
                scatter(s, torch.zeros(2, 2, 2, NH * HS))
        with pytest.raises(kvcore.TransferError, match=f"block_ids is a {kind} tensor"):
            kvcore.scatter_blocks(layout, s, torch.zeros(2, 2, 2 * BS, NH * HS))


def _plane_cache():
    k = [torch.randn(NB, BS, NH, HS) for _ in range(2)]
    ks = [torch.randn(NB, BS, NH).to(torch.bfloat16) for _ in range(2)]
    return kvcore.build_layout("K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH", {"K": k, "KS": ks})


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["neg", "conj", "neg-plane"])
def test_staging_with_a_negation_or_conjugation_bit_moves_as_its_values(kernel, kind, monkeypatch):
    """Review item 6, staging side: an ``out``/``src`` view carrying torch's lazy negation
    (real) or conjugation (complex) bit, classic or one plane of per-plane staging, gathers
    the cache's values into what the view shows and scatters what it shows, on every
    entry point."""
    _kernel(kernel, monkeypatch)
    if kind == "neg-plane":
        lay = _plane_cache()
    elif kind == "conj":
        lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.complex(torch.randn(2, NB, BS, NH, HS), torch.randn(2, NB, BS, NH, HS))])
    else:
        lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.randn(2, NB, BS, NH, HS) for _ in range(2)])
    lazy = (lambda t: t.conj()) if kind == "conj" else (lambda t: t._neg_view())
    unlazy = (lambda t: t.conj().clone().conj()) if kind == "conj" else (lambda t: (-t).clone()._neg_view())
    slots = torch.tensor([1, 6, 13])
    want = kvcore.gather(lay, slots)
    plan = kvcore.plan(lay)
    for name, gather, scatter in _entry_points(lay, plan):
        if isinstance(want, dict):  # one plane's buffer is lazy
            out = {r: torch.zeros_like(v) for r, v in want.items()}
            out["K"] = lazy(torch.zeros_like(want["K"]))
            gather(slots, out)
            assert all(torch.equal(out[r], want[r]) for r in want), name
            src = dict(want)
            src["K"] = unlazy(want["K"] + 1)
            scatter(torch.tensor([2, 3, 4]), src)
            back = kvcore.gather(lay, torch.tensor([2, 3, 4]))
            assert torch.equal(back["K"], want["K"] + 1) and torch.equal(back["KS"], want["KS"]), name
        else:
            out = lazy(torch.zeros_like(want))
            gather(slots, out)
            assert torch.equal(out, want), name
            scatter(torch.tensor([2, 3, 4]), unlazy(want + 1))
            assert torch.equal(kvcore.gather(lay, torch.tensor([2, 3, 4])), want + 1), name


@pytest.mark.parametrize("kernel", KERNELS + ["nosuch"])
@pytest.mark.parametrize("value", ["bogus", "SYNC", "", True, 1, b"sync"])
def test_validate_is_checked_first_on_every_entry_point(layout, kernel, value, monkeypatch):
    """Review item 7: an unknown ``validate`` is a TransferError naming the choices, raised
    before any kernel is chosen (even a forced kernel that does not exist) or launched, by
    every entry point; nothing is written."""
    if kernel == "nosuch":
        monkeypatch.setenv("KVCORE_KERNEL", "nosuch")
    else:
        _kernel(kernel, monkeypatch)
    staged = torch.ones(2, 2, 2, NH * HS)
    blocks = torch.ones(2, 2, BS, NH * HS)
    calls = {
        "gather": lambda: kvcore.gather(layout, [1, 2], validate=value),
        "scatter": lambda: kvcore.scatter(layout, [3, 4], staged, validate=value),
        "gather_blocks": lambda: kvcore.gather_blocks(layout, [1], validate=value),
        "scatter_blocks": lambda: kvcore.scatter_blocks(layout, [1], blocks, validate=value),
        "plan.gather": lambda: kvcore.plan(layout).gather([1, 2], validate=value),
        "plan.scatter": lambda: kvcore.plan(layout).scatter([3, 4], staged, validate=value),
        "plan.scatter_blocks": lambda: kvcore.plan(layout).scatter_blocks([2], blocks, validate=value),
        "empty scatter": lambda: kvcore.scatter(layout, [], staged[:, :, :0], validate=value),
    }
    before = [t.clone() for t in layout.kv_caches]
    for call in calls.values():
        with pytest.raises(kvcore.TransferError, match=rf"validate must be one of 'device', 'sync', 'none' .*got {re.escape(repr(value))}"):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, layout.kv_caches))
    assert torch.all(staged == 1) and torch.all(blocks == 1)


@pytest.mark.parametrize("kernel", KERNELS)
def test_refusals_name_the_callers_own_index(layout, kernel, monkeypatch):
    """Review item 8: a repeated slot names the slot_mapping index that repeats and the one
    it repeats; a repeated block the block_ids indices (not derived slots); out of range
    names the first bad index; padding and skipped rows are never blamed; every entry point,
    nothing written."""
    _kernel(kernel, monkeypatch)
    plan = kvcore.plan(layout)
    n = NB * BS
    before = [t.clone() for t in layout.kv_caches]
    cases = [
        ([-1, 7, 3, 9, 3, 7], 0, r"slot_mapping\[4\] = 3 repeats slot_mapping\[2\]: a scatter would write slot 3 twice"),
        ([3, 7, 3, 9, 7], 1, r"slot_mapping\[4\] = 7 repeats slot_mapping\[1\]"),  # [0] is skipped
        ([5, n, 5], 0, rf"slot_mapping\[1\] = {n} is out of range \(valid 0..{n - 1}"),  # the first problem wins
        ([5, 6, 5, n], 0, r"slot_mapping\[2\] = 5 repeats slot_mapping\[0\]"),
    ]
    for slots, skip, want in cases:
        src = torch.zeros(2, 2, len(slots), NH * HS)
        for call, extra in (
            (functools.partial(kvcore.scatter, layout), {}),
            (plan.scatter, {}),
            (functools.partial(kvcore.scatter, layout), {"validate": "sync"}),
        ):
            with pytest.raises(kvcore.TransferError, match=want):
                call(torch.tensor(slots), src, skip_prefix=skip, **extra)
    blocks = [
        ([0, 2, -1, 2], 0, r"block_ids\[3\] = 2 repeats block_ids\[1\]: a scatter would write block 2 twice"),
        ([3, 1, 0, 1], 0, r"block_ids\[3\] = 1 repeats block_ids\[1\]"),
        ([1, NB], 0, rf"block_ids\[1\] = {NB} is out of range \(valid 0..{NB - 1}"),
        ([1, 2, 1], BS // 2, r"block_ids\[2\] = 1 repeats block_ids\[0\]"),  # block 0 half written: a real repeat
    ]
    for ids, skip, want in blocks:
        src = torch.zeros(2, 2, len(ids) * BS, NH * HS)
        for call in (functools.partial(kvcore.scatter_blocks, layout), plan.scatter_blocks):
            with pytest.raises(kvcore.TransferError, match=want):
                call(ids, src, skip_prefix=skip)
    assert all(torch.equal(a, b) for a, b in zip(before, layout.kv_caches))
    # a block wholly inside skip_prefix moves nothing: its id is not a repeat, nor out of range
    src = torch.arange(2 * 2 * 3 * BS * NH * HS, dtype=torch.float32).reshape(2, 2, 3 * BS, NH * HS)
    kvcore.scatter_blocks(layout, [1, 2, 1], src, skip_prefix=BS)
    assert torch.equal(kvcore.gather_blocks(layout, [2, 1]), src[:, :, BS:])
    kvcore.gather_blocks(layout, [NB + 5, 0], skip_prefix=BS)
    # gathers may repeat
    assert torch.equal(kvcore.gather(layout, [4, 4])[:, :, 0], kvcore.gather(layout, [4, 4])[:, :, 1])
