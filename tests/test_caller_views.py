"""A caller's cache tensor re-pointed or reshaped after detection is refused, whether or not
it is itself a view (every vLLM-allocated cache is: per-layer views of one buffer).

kvcore's layouts hold views of the caller's tensors. When the caller's tensor is a view
itself, re-pointing it (``set_``, ``.data =``, ``resize_``) changes neither kvcore's views
nor the buffer they view, so a guard that looks only at those would let a scatter
"succeed" into memory the caller's tensor no longer shows. Every guard (the Python checks
of the reference kernel and of ``kvcore.copy``, the C++ guard of the native plans)
compares the caller's own tensors too (``StrideTable.callers``).

For every plugin's fixture family (vLLM, SGLang, LMDeploy, transformers), each as the
engine allocates it and (where it still reads the same) as plain non-view clones, every
in-place mutation of one of the caller's tensors is refused by every entry point (gather,
gather out=, scatter, gather_blocks, scatter_blocks, plan(...).gather / .scatter, a
one-layer plan, kvcore.copy from and into it), on both kernels, with the plan built before
the mutation (the C++ guard's cached rows) and after it, and nothing moves: the caches'
storages, the memory the tensor was re-pointed to and the staging buffer stay
byte-identical. And no false refusal: the engine writing into its cache in place, building
new view objects over the same memory (vLLM's forward ``kv_cache.unbind(0)``), dropping the
container it passed, or writing through those new views, all keep working, with the
values the engine wrote.

Also staging that is not dense strided memory (nested, sparse) is a TransferError naming
it, before any byte moves, on every entry point and both kernels.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kvcore
from kvcore.errors import TransferError
from kvcore.inputs import tensor_paths
from kvcore.kernels import _build
from kvcore.kernels.copy_kernels import NATIVE_CPU_COPY
from kvcore.testing import registered_fixtures

FIXTURES = [
    "vllm-0.26-FLASH_ATTN-HND",
    "vllm-0.24-FLASHINFER-HND",
    "vllm-0.24-FLASHMLA-NHD-cross",
    "vllm-0.29-FLASH_ATTN-LBNHC",
    "sglang-0.5.23-mha-hnd",
    "sglang-0.5.23-mha-nhd-fused-paged",
    "sglang-mla-paged",
    "lmdeploy-0.14.0-cuda-mla",
    "lmdeploy-0.9.2-ascend310P-plain",
    "lmdeploy-0.14.0-cuda-plain-full",
    "lmdeploy-0.14.0-cuda-int4",
    "transformers-4.53-DynamicCache-prefill",
    "transformers-5.24-PagedAttentionCache-full_attention",
    "transformers-5.24-DynamicCache",
]


def _fixture(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_name = {f.name: f for f in registered_fixtures(skip_broken=True)}
    if name not in by_name:
        pytest.skip(f"fixture {name} is not registered (its plugin is not installed)")
    return by_name[name]


@pytest.fixture(params=["reference", "native-cpu"])
def kernel(request, monkeypatch):
    if request.param == "native-cpu":
        if _build.disabled() or not _build.load().loaded:
            pytest.skip("native op unavailable")
        if not NATIVE_CPU_COPY.available():
            pytest.skip(f"native copy kernel unavailable: {NATIVE_CPU_COPY.why()}")
    monkeypatch.setenv("KVCORE_KERNEL", request.param)
    monkeypatch.setenv("KVCORE_COPY_KERNEL", request.param)
    return request.param


def _fill(ts, seed):
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        if t.numel():
            b = t.view(torch.uint8) if t.dim() and t.stride(-1) == 1 else None
            if b is not None:
                b.copy_(torch.randint(0, 60, b.shape, dtype=torch.uint8, generator=g))


def _clone_container(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone_container(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_container(v) for v in x)
    return x


def _make(f, variant, seed=0):
    """(caches, layout) of fixture ``f``: as the engine allocates it, or cloned into plain
    (non-view) tensors; None when the clones no longer read as the same format."""
    try:
        caches, hints = f.make(dict(f.sizes), f.dtypes[0], "cpu")
    except ImportError as e:  # the fixture restates an engine release newer than the one installed here
        pytest.skip(f"fixture {f.name} needs {e.name or e}: not installed in this environment")
    fmt = None
    if variant == "cloned":
        fmt = kvcore.detect(caches, engine=f.engine, hints=hints).format.name
        caches = _clone_container(caches)
        if not isinstance(caches, (list, tuple, dict)):
            return None
    _fill([t for _, t in tensor_paths(caches)], seed)
    try:
        lay = kvcore.detect(caches, engine=f.engine, hints=hints)
    except kvcore.KVCoreError:
        if variant == "cloned":
            return None
        raise
    if fmt is not None and lay.format.name != fmt:
        return None
    return caches, lay


def _bytes(st):
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).clone()


def _storages(tensors):
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault(st._cdata, st)
    return list(seen.values())


def _snap(storages, staging):
    out = [_bytes(s) if s.nbytes() else None for s in storages]
    for t in _leaves(staging):
        out.append(t.view(torch.uint8).clone() if t.numel() else None)
    return out


def _leaves(x):
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x.values() for t in _leaves(v)]


def _same(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
    )


def _victim(caches, lay):
    """The biggest of the caller's tensors (one whose bytes the layout addresses)."""
    leaves = [t for _, t in tensor_paths(caches) if t.numel()]
    return max(leaves, key=lambda t: t.numel() * t.element_size())


def _other_geometry(t):
    """An in-bounds (size, stride, offset) on t's storage different from t's own."""
    off = t.storage_offset()
    shape = list(t.shape)
    if off > 0:
        return shape, list(t.stride()), off - 1
    if shape and shape[0] > 1:
        shape[0] -= 1
        return shape, list(t.stride()), off + t.stride(0)
    return [max(t.numel() - 1, 0)], [1], off + 1


def _transposable(t):
    for a in range(t.dim()):
        for b in range(a + 1, t.dim()):
            if (t.shape[a], t.stride(a)) != (t.shape[b], t.stride(b)):
                return a, b
    return None


MUTATIONS = {
    "set_ other storage": lambda t, keep: t.set_(keep(torch.full_like(t, 3))),
    "set_ same storage other offset": lambda t, keep: t.set_(
        t.untyped_storage(), _other_geometry(t)[2], _other_geometry(t)[0], _other_geometry(t)[1]
    ),
    ".data =": lambda t, keep: setattr(t, "data", keep(torch.full_like(t, 3))),
    "resize_(n)": lambda t, keep: t.resize_(t.numel() if t.dim() != 1 else t.numel() // 2),
    "resize_(0)": lambda t, keep: t.resize_(0),
    "as_strided_": lambda t, keep: t.as_strided_((1,), (1,), t.storage_offset()),
    "transpose_": lambda t, keep: t.transpose_(*_transposable(t)),
    "storage freed": lambda t, keep: t.untyped_storage().resize_(0),
}


def _entry_points(lay, other, T, slots, src, blocks, src_blocks, out):
    """name -> a call (given the mutated layout ``lay``, a twin ``other``)."""
    dst_slots = torch.arange(T)
    return {
        "gather": lambda: kvcore.gather(lay, slots),
        "gather out=": lambda: kvcore.gather(lay, slots, out=out),
        "scatter": lambda: kvcore.scatter(lay, slots, src),
        "gather_blocks": lambda: kvcore.gather_blocks(lay, blocks),
        "scatter_blocks": lambda: kvcore.scatter_blocks(lay, blocks, src_blocks),
        "plan.gather": lambda: kvcore.plan(lay).gather(slots, out),
        "plan.scatter": lambda: kvcore.plan(lay).scatter(slots, src),
        "plan(layer 0).scatter": lambda: kvcore.plan(lay, 0).scatter(slots, _layer0(src)),
        "copy from it": lambda: kvcore.copy(lay, slots, other, dst_slots),
        "copy into it": lambda: kvcore.copy(other, dst_slots, lay, slots),
    }


def _layer0(src):
    return src[:, 0] if isinstance(src, torch.Tensor) else {k: v[0] for k, v in src.items()}


def _staging(lay, T, seed):
    buf = lay.allocate_staging(T)
    _fill(_leaves(buf), seed)
    return buf


@pytest.mark.parametrize("variant", ["allocated", "cloned"])
@pytest.mark.parametrize("name", FIXTURES)
def test_every_mutation_of_a_callers_tensor_is_refused_everywhere(name, variant, kernel):
    f = _fixture(name)
    probe = _make(f, variant)
    if probe is None:
        pytest.skip(f"{name}: its clones do not read as the same format (views of one buffer decide it)")
    lay0 = probe[1]
    T = 3
    n = lay0.page_buffer_size
    slots = torch.tensor([0, n // 2, n - 1])
    bs = lay0.block_size
    blocks = torch.tensor([0])
    failures = []
    for mname, mutate in MUTATIONS.items():
        for warm in (True, False):
            caches, lay = _make(f, variant, seed=1)
            _, other = _make(f, variant, seed=2)
            victim = _victim(caches, lay)
            if mname == "transpose_" and _transposable(victim) is None:
                continue
            src = _staging(lay, T, 3)
            out = _staging(lay, T, 4)
            src_blocks = _staging(lay, bs, 5)
            calls = _entry_points(lay, other, T, slots, src, blocks, src_blocks, out)
            if warm:  # plans (and the C++ guard's rows) built while the cache was intact
                kvcore.gather(lay, slots)
                kvcore.plan(lay).gather(slots)
                kvcore.plan(lay, 0).gather(slots)
                kvcore.copy(lay, slots, other, torch.arange(T))
                kvcore.copy(other, torch.arange(T), lay, slots)
            watched = _storages([t for _, t in tensor_paths(caches)] + [t for _, t in tensor_paths(other.kv_caches)])
            watched = [s for s in watched if s.nbytes()]
            kept = []

            def keep(x, kept=kept):
                kept.append(x)
                return x

            mutate(victim, keep)
            watched += [x.untyped_storage() for x in kept]
            staging = {"src": src, "out": out, "src_blocks": src_blocks}
            for ename, call in calls.items():
                live = [s for s in watched if s.nbytes()]
                before = _snap(live, staging)
                try:
                    call()
                    failures.append(f"{mname} warm={warm} {ename}: accepted")
                    continue
                except TransferError as e:
                    msg = str(e)
                    if "Detect the cache again" not in msg or "layer" not in msg or "plane" not in msg:
                        failures.append(f"{mname} warm={warm} {ename}: message does not name the layer/plane or say detect again: {msg}")
                except Exception as e:  # noqa: BLE001 - any other exception is the defect under test
                    failures.append(f"{mname} warm={warm} {ename}: raw {type(e).__name__}: {e}")
                    continue
                if not _same(before, _snap(live, staging)):
                    failures.append(f"{mname} warm={warm} {ename}: refused but bytes moved")
    assert not failures, f"{name} ({variant}, {kernel}):\n" + "\n".join(failures)


# -- no false refusal ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["vllm-0.26-FLASH_ATTN-HND", "vllm-0.24-FLASHMLA-NHD-cross", "sglang-0.5.23-mha-hnd", "transformers-4.53-DynamicCache-prefill"]
)
def test_normal_engine_use_is_never_refused(name, kernel):
    """The engine writes into its cache in place, between steps builds new view objects over
    the same memory and writes through them, and drops the container it passed to detect:
    every entry point keeps working and sees exactly what the engine wrote."""
    f = _fixture(name)
    caches, lay = _make(f, "allocated", seed=7)
    T = 4
    n = lay.page_buffer_size
    slots = torch.tensor([1, n // 3, n // 2, n - 1])
    before = kvcore.gather(lay, slots)
    kvcore.plan(lay).gather(slots)  # a cached plan (the C++ guard's rows) from before the writes
    leaves = [t for _, t in tensor_paths(caches) if t.numel()]
    # the engine writes in place: through its own tensors, and through new views of them
    # (vLLM's attention does kv_cache.unbind(0) every forward: new Python objects, same memory)
    for t in leaves:
        fresh = t.view(t.shape)  # a new object over the same memory
        fresh.view(torch.uint8).add_(1) if fresh.stride(-1) == 1 else fresh.add_(1)
        assert fresh.data_ptr() == t.data_ptr()
    del caches, leaves  # the engine's container is gone; the layout keeps its tensors alive
    after = kvcore.gather(lay, slots)
    for b, a in zip(_leaves(before), _leaves(after)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8) + 1)
    # and writes land where the engine's memory is: scatter then read back through a new plan
    src = _staging(lay, T, 11)
    kvcore.scatter(lay, slots, src)
    got = kvcore.plan(lay).gather(slots)
    for s, g in zip(_leaves(src), _leaves(got)):
        assert torch.equal(s.view(torch.uint8), g.view(torch.uint8))
    _, other = _make(f, "allocated", seed=8)
    kvcore.copy(lay, slots, other, torch.arange(T))
    for s, g in zip(_leaves(src), _leaves(kvcore.gather(other, torch.arange(T)))):
        assert torch.equal(s.view(torch.uint8), g.view(torch.uint8))


def test_scatter_lands_in_the_callers_view_tensors(kernel):
    """vLLM allocates each layer as a view of one int8 buffer: a scatter lands in exactly the
    rows the caller's tensors show (torch indexing of the caller's tensor is the oracle)."""
    fixtures = pytest.importorskip("kvcore_vllm.fixtures")
    nl, nb, bs, nh, hs = 3, 4, 16, 2, 8
    caches = fixtures.allocate(
        "0.11.0", "FLASH_ATTN", "HND", num_layers=nl, num_blocks=nb, block_size=bs, num_kv_heads=nh, head_size=hs, dtype=torch.float16
    )
    leaves = list(caches.values())
    assert all(t._base is not None and tuple(t.shape) == (2, nb, bs, nh, hs) and t.stride(3) == bs * hs for t in leaves)  # HND memory
    _fill(leaves, 0)
    lay = kvcore.detect(caches, engine="vllm", hints={"kv_cache_layout": "HND", "num_kv_heads": nh})
    slots = torch.tensor([2, 37])
    src = _staging(lay, 2, 9)
    kvcore.scatter(lay, slots, src)
    for li, t in enumerate(leaves):
        for k in range(2):
            for j, s in enumerate(slots.tolist()):
                assert torch.equal(t[k, s // bs, s % bs].reshape(-1), src[k, li, j])
    leaves[2].data = torch.zeros_like(leaves[2])  # re-pointed: refused, and layer 2's old memory keeps its rows
    with pytest.raises(TransferError, match=r"layer 2 plane K.*(re-pointed|replaced).*Detect the cache again"):
        kvcore.scatter(lay, slots, torch.zeros_like(src))
    assert torch.equal(leaves[0][0, 0, 2].reshape(-1), src[0, 0, 0])
    assert not leaves[2].any()


def test_a_callers_tensor_holding_none_of_the_layouts_bytes_is_not_guarded(kernel):
    """vLLM's hybrid models put Mamba state beside attention layers; detect_per_layer gives
    the attention group its own layout. Re-pointing a tensor outside that layout (here: a
    tensor of another group) leaves the layout working."""
    nb, bs, nh, hs = 4, 4, 2, 8
    buf = torch.zeros(3 * 2 * nb * bs * nh * hs, dtype=torch.float16)
    layers = [buf[i * 2 * nb * bs * nh * hs : (i + 1) * 2 * nb * bs * nh * hs].view(2, nb, bs, nh, hs) for i in range(2)]
    state = buf[2 * 2 * nb * bs * nh * hs :].view(-1, hs)  # another group's memory in the same buffer
    lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", layers)
    lay2 = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", [layers[0]])
    state.set_(torch.zeros(4, hs, dtype=torch.float16))
    src = torch.randn(lay.staging_shape(2)).to(torch.float16)
    kvcore.scatter(lay, torch.tensor([0, 7]), src)
    assert torch.equal(layers[1][0, 1, 3].reshape(-1), src[0, 1, 1])
    layers[1].set_(torch.zeros_like(layers[1]))
    with pytest.raises(TransferError, match=r"layer 1 plane K.*Detect the cache again"):
        kvcore.scatter(lay, torch.tensor([0, 7]), src)
    kvcore.scatter(lay2, torch.tensor([0]), src[:, :1, :1])  # the one-layer layout never held layer 1
    assert torch.equal(layers[0][0, 0, 0].reshape(-1), src[0, 0, 0])


def test_the_refusal_names_the_callers_tensor_and_layer():
    f = _fixture("vllm-0.26-FLASH_ATTN-HND")
    caches, lay = _make(f, "allocated")
    names = list(caches.keys()) if isinstance(caches, dict) else None
    leaves = [t for _, t in tensor_paths(caches)]
    leaves[1].set_(torch.zeros_like(leaves[1]))
    with pytest.raises(TransferError) as e:
        kvcore.scatter(lay, torch.tensor([0]), _staging(lay, 1, 0))
    msg = str(e.value)
    assert "layer 1 plane" in msg and "re-pointed" in msg and "Detect the cache again" in msg
    if names:
        assert repr(names[1]) in msg


# -- staging that is no dense strided memory ----------------------------------------------------


def _bad_staging(kind, like):
    if kind == "nested":
        return torch.nested.nested_tensor([torch.zeros(like.shape[1:], dtype=like.dtype)] * like.shape[0])
    return like.to_sparse()


@pytest.mark.parametrize("kind", ["nested", "sparse"])
@pytest.mark.parametrize("name", ["vllm-0.26-FLASH_ATTN-HND", "lmdeploy-0.14.0-cuda-int4", "transformers-5.24-DynamicCache"])
def test_nested_or_sparse_staging_is_a_transfer_error(name, kind, kernel):
    f = _fixture(name)
    caches, lay = _make(f, "allocated", seed=1)
    T = 2
    slots = torch.tensor([0, 1])
    storages = _storages([t for _, t in tensor_paths(caches)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        def bad(like):
            if isinstance(like, torch.Tensor):
                return _bad_staging(kind, like)
            return {k: (_bad_staging(kind, v) if i == len(like) - 1 else v) for i, (k, v) in enumerate(like.items())}

        full, one, blk = lay.allocate_staging(T), lay.allocate_staging(T, 0), lay.allocate_staging(lay.block_size)
        calls = {
            "gather out=": lambda: kvcore.gather(lay, slots, out=bad(full)),
            "scatter": lambda: kvcore.scatter(lay, slots, bad(full)),
            "gather(layers=0) out=": lambda: kvcore.gather(lay, slots, out=bad(one), layers=0),
            "scatter_blocks": lambda: kvcore.scatter_blocks(lay, torch.tensor([0]), bad(blk)),
            "gather_blocks out=": lambda: kvcore.gather_blocks(lay, torch.tensor([0]), out=bad(blk)),
            "plan.gather": lambda: kvcore.plan(lay).gather(slots, bad(full)),
            "plan.scatter": lambda: kvcore.plan(lay).scatter(slots, bad(full)),
            "plan(layer 0).gather": lambda: kvcore.plan(lay, 0).gather(slots, bad(one)),
        }
        kvcore.gather(lay, slots)  # plans cached
        for ename, call in calls.items():
            before = [_bytes(s) for s in storages]
            with pytest.raises(TransferError, match=rf"{kind}\w* tensor.*dense") as e:
                call()
            assert "out" in str(e.value) or "src" in str(e.value), ename
            assert all(torch.equal(a, _bytes(s)) for a, s in zip(before, storages)), f"{ename} moved bytes"
