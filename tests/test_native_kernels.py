"""The native kernels (csrc/: C++ CPU op, CUDA op) against a semantic oracle and the
torch reference kernel.

Caches are laid out from a *logical* cache ``[NL, kv, NB, BS, NH, HS]`` of random bits
through torch views only (:func:`kvcore.bench.make_cache`), never through kvcore's stride
table, so a gather must return exactly ``logical[l, k, slot // BS, slot % BS]``: swapped
K/V, transposed heads or a wrong layer show up as wrong bits. Scatters are compared with
the reference kernel over every byte of the cache's storage (so nothing outside the
slots moved). All comparisons are on integer views: fp8, NaN payloads and -0 compare
exactly.

The CPU cases run in CI (the first one builds the C++ op, cached afterwards). The same
file runs on a GPU machine (``scripts/gpu_check.py``) where the ``cuda`` cases and the
pinned-host cases run too.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvcore
from kvcore.bench import make_cache
from kvcore.errors import TransferError
from kvcore.format_decl import KVFormat
from kvcore.kernels import TransferPlan, _build, select_kernel
from kvcore.kernels.native import CPU_KERNEL, CUDA_KERNEL
from kvcore.kernels.reference import REFERENCE
from kvcore.layout import KVLayout
from kvcore.spec import Spec

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (grammar name, kv_size) — every layout family the generic spec describes
FAMILIES = [
    "NL_X_TWO_NB_BS_NH_HS",  # NHD (flash-attn)
    "NL_X_TWO_NB_NH_BS_HS",  # HND
    "NL_X_NB_TWO_BS_NH_HS",  # FlashInfer NHD
    "NL_X_NB_TWO_NH_BS_HS",  # FlashInfer HND
    "NL_X_NB_BS_HS",  # MLA
    "NL_X_NBBS_ONE_HS",  # MLA, fused blocks
    "TWO_X_NL_X_NBBS_NH_HS",  # K list, V list, fused blocks
    "TWO_X_NL_X_NB_BS_NH_HS",
    "NB_NL_TWO_BS_NH_HS",  # cross-layer, one tensor
    "NB_NL_TWO_NH_BS_HS",
    "NL_X_NB_BS_NH_CS",  # packed K|V on the last axis
    "NL_X_NB_NH_BS_CS",
    "NL_X_TWO_X_NB_BS_NH_HS",  # per-layer (K, V) tuples
    "NL_X_TWO_NB_NH_HS_BS",  # element axis not innermost: one chunk per element
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.float64]


def _native(device: str):
    k = CPU_KERNEL if device == "cpu" else CUDA_KERNEL
    if _build.disabled():
        pytest.skip("KVCORE_NATIVE=0")
    assert k.available(), k.why()
    return k


def _kv_size(name: str) -> int:
    return 2 if ("TWO" in name or "CS" in name) else 1


def _logical(name: str, nl, nb, bs, nh, hs, dtype, device, seed=0) -> torch.Tensor:
    kv = _kv_size(name)
    if "NH" not in name.split("_"):
        nh = 1
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.empty(0, dtype=dtype).element_size()
    shape = (nl, kv, nb, bs, nh, hs)
    bits = torch.randint(0, 256, (*shape[:-1], hs * w), dtype=torch.uint8, generator=g)
    t = bits.view(dtype) if w > 1 else bits.view(dtype)
    # special bit patterns (NaN payloads, -0, +-inf, fp8 NaN) at fixed places
    iv = t.view(INT[w]).reshape(-1)
    specials = {1: [0x7F, 0xFF, 0x80], 2: [0x7FC1, -0x8000, 0x7F80, -1], 4: [0x7FC00001, -(2**31), 0x7F800000], 8: [-(2**63), -1]}[w]
    for i, v in enumerate(specials):
        iv[(i * 7919) % iv.numel()] = v if w > 1 else v & 0xFF
    return t.to(device)


def _build_layout(name, logical, *, pad=False, storage_dtype=None):
    """The core's generic spec for ``name`` (not a plugin's: a plugin may register the same
    name with an exotic spec, e.g. vLLM's chunked-K ``NL_X_TWO_NB_NH_HS_BS``)."""
    caches = make_cache(name, logical, pad=pad, storage_dtype=storage_dtype)
    fmt = KVFormat(name=name, description="test layout")
    spec = Spec(fmt, caches, dtype=logical.dtype if storage_dtype else None)
    return KVLayout(fmt, spec), caches


def _slots(num_slots: int, t: int, seed: int, negatives: int = 2, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(num_slots, generator=g)[:t].clone()
    if negatives:
        s[torch.randperm(s.numel(), generator=g)[:negatives]] = -1
    return s.to(device)


def _expected(logical: torch.Tensor, slots: torch.Tensor, poison: torch.Tensor, layers=None) -> torch.Tensor:
    nl, kv, nb, bs, nh, hs = logical.shape
    flat = logical.reshape(nl, kv, nb * bs, nh * hs)
    if layers is not None:
        flat = flat[list(layers)]
    out = poison.clone()
    ok = slots >= 0
    idx = torch.nonzero(ok).flatten()
    out[:, :, idx] = flat[:, :, slots[ok]].permute(1, 0, 2, 3)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()]).cpu()


def _poison(layout, t: int, device, layers=None) -> torch.Tensor:
    st = torch.empty(layout.staging_shape(t, layers), dtype=layout.dtype, device=device)
    st.view(torch.uint8).fill_(0xA5)
    return st


def _storage_bytes(caches) -> list[torch.Tensor]:
    seen, out = set(), []

    def walk(n):
        if isinstance(n, torch.Tensor):
            s = n.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                out.append(torch.empty(0, dtype=torch.uint8, device=n.device).set_(s).clone().cpu())
        else:
            for c in n:
                walk(c)

    walk(caches)
    return out


def _same_storage(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def force(monkeypatch):
    def f(name: str):
        monkeypatch.setenv("KVCORE_KERNEL", name)

    return f


# -- semantic gather, every family and dtype ---------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gather_semantic_every_family(device, name, dtype, force):
    k = _native(device)
    logical = _logical(name, 3, 7, 5, 2, 8, dtype, device, seed=hash(name) % 1000)
    layout, _ = _build_layout(name, logical)
    slots = _slots(layout.page_buffer_size, 20, seed=1, device=device)
    force(k.name)
    out = kvcore.gather(layout, slots, _poison(layout, 20, device))
    assert torch.equal(_bits(out), _bits(_expected(logical, slots, _poison(layout, 20, device))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS", "NL_X_NB_BS_HS", "NL_X_NB_NH_BS_CS"])
def test_gather_semantic_every_dtype(device, dtype, name, force):
    k = _native(device)
    logical = _logical(name, 2, 5, 4, 3, 16, dtype, device, seed=7)
    layout, _ = _build_layout(name, logical)
    slots = _slots(layout.page_buffer_size, 11, seed=2, device=device)
    force(k.name)
    out = kvcore.gather(layout, slots, _poison(layout, 11, device))
    assert torch.equal(_bits(out), _bits(_expected(logical, slots, _poison(layout, 11, device))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name,pad,storage",
    [
        ("NL_X_TWO_NB_BS_NH_HS", True, None),  # padded dim 0 (storage offset) and padded rows
        ("NL_X_TWO_NB_NH_BS_HS", True, None),
        ("NL_X_NB_BS_HS", True, None),
        ("NB_NL_TWO_BS_NH_HS", True, None),
        ("NL_X_TWO_NB_BS_NH_HS", False, torch.int8),  # int8 buffer carrying bf16
        ("NL_X_NB_BS_NH_CS", False, torch.int8),
        ("NL_X_TWO_NB_BS_NH_HS", True, torch.uint8),
    ],
)
def test_padded_and_byte_views(device, name, pad, storage, force):
    k = _native(device)
    logical = _logical(name, 2, 6, 4, 2, 8, torch.bfloat16, device, seed=3)
    layout, _ = _build_layout(name, logical, pad=pad, storage_dtype=storage)
    slots = _slots(layout.page_buffer_size, 13, seed=4, device=device)
    force(k.name)
    out = kvcore.gather(layout, slots, _poison(layout, 13, device))
    assert torch.equal(_bits(out), _bits(_expected(logical, slots, _poison(layout, 13, device))))


# -- scatter: bit-exact against the reference over the whole storage ---------------------


def _scatter_both(device, name, logical, slots, force, *, pad=False, storage=None, layers=None, skip_prefix=0):
    k = _native(device)
    la, ca = _build_layout(name, logical, pad=pad, storage_dtype=storage)
    lb, cb = _build_layout(name, logical, pad=pad, storage_dtype=storage)
    t = slots.numel()
    src = torch.empty(la.staging_shape(t, layers), dtype=la.dtype, device=device)
    src.view(torch.uint8).copy_(torch.randint(0, 256, src.view(torch.uint8).shape, dtype=torch.uint8))
    force(k.name)
    kvcore.scatter(la, slots, src, layers=layers, skip_prefix=skip_prefix)
    force("reference")
    kvcore.scatter(lb, slots, src, layers=layers, skip_prefix=skip_prefix)
    assert _same_storage(_storage_bytes(ca), _storage_bytes(cb))
    return la, src


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
def test_scatter_matches_reference_every_family(device, name, force):
    logical = _logical(name, 3, 7, 5, 2, 8, torch.bfloat16, device, seed=11)
    slots = _slots(7 * 5, 17, seed=5, device=device)
    la, src = _scatter_both(device, name, logical, slots, force)
    # and the scattered rows read back (semantic round trip through the native gather)
    force(_native(device).name)
    back = kvcore.gather(la, slots, _poison(la, 17, device))
    ok = (slots >= 0).cpu()
    assert torch.equal(_bits(back)[:, :, ok], _bits(src)[:, :, ok])
    assert torch.equal(_bits(back)[:, :, ~ok], _bits(_poison(la, 17, device))[:, :, ~ok])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_every_dtype(device, dtype, force):
    name = "NL_X_TWO_NB_NH_BS_HS"
    logical = _logical(name, 2, 5, 4, 3, 6, dtype, device, seed=12)
    _scatter_both(device, name, logical, _slots(20, 9, seed=6, device=device), force)


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_padded_int8_view(device, force):
    name = "NL_X_TWO_NB_BS_NH_HS"
    logical = _logical(name, 2, 6, 4, 2, 8, torch.bfloat16, device, seed=13)
    _scatter_both(device, name, logical, _slots(24, 10, seed=7, device=device), force, pad=True, storage=torch.int8)


# -- slots, layers, skip_prefix, empty --------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_layer_subsets_and_skip_prefix(device, force):
    k = _native(device)
    name = "NL_X_TWO_NB_NH_BS_HS"
    logical = _logical(name, 5, 6, 4, 2, 8, torch.float16, device, seed=21)
    layout, _ = _build_layout(name, logical)
    slots = _slots(24, 12, seed=8, device=device)
    force(k.name)
    layers = [4, 1, 2]
    out = kvcore.gather(layout, slots, _poison(layout, 12, device, layers), layers=layers, skip_prefix=3)
    s2 = slots.clone()
    s2[:3] = -1
    assert torch.equal(_bits(out), _bits(_expected(logical, s2, _poison(layout, 12, device, layers), layers)))
    one = kvcore.gather(layout, slots, _poison(layout, 12, device, 3), layers=3)
    exp = _expected(logical, slots, _poison(layout, 12, device, [3]), [3])[:, 0]
    assert torch.equal(_bits(one), _bits(exp))
    _scatter_both(device, name, logical, slots, force, layers=[3, 0], skip_prefix=5)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_all_negative(device, force):
    k = _native(device)
    name = "NL_X_TWO_NB_BS_NH_HS"
    logical = _logical(name, 2, 4, 4, 2, 8, torch.bfloat16, device, seed=22)
    layout, caches = _build_layout(name, logical)
    force(k.name)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    assert kvcore.gather(layout, empty).shape == (2, 2, 0, 16)
    before = _storage_bytes(caches)
    neg = torch.full((6,), -1, dtype=torch.int64, device=device)
    out = kvcore.gather(layout, neg, _poison(layout, 6, device))
    assert torch.equal(_bits(out), _bits(_poison(layout, 6, device)))
    kvcore.scatter(layout, neg, out)
    assert _same_storage(before, _storage_bytes(caches))
    # the op itself, with no valid slot, writes nothing either
    plan = TransferPlan(layout.stride_table(), neg, out, 0)
    k.scatter(plan)
    assert _same_storage(before, _storage_bytes(caches))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("geom", [(1, 2, 4, 4, 4), (2, 2, 1, 1, 1), (3, 9, 16, 8, 128), (2, 3, 3, 5, 3)])
def test_edge_geometries(device, geom, force):
    """NB == 2, BS == NH, a single head, block size 1, odd head sizes (narrow units)."""
    nl, nb, bs, nh, hs = geom
    for name in ("NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"):
        k = _native(device)
        logical = _logical(name, nl, nb, bs, nh, hs, torch.bfloat16, device, seed=sum(geom))
        layout, _ = _build_layout(name, logical)
        t = min(nb * bs, 9)
        slots = _slots(nb * bs, t, seed=9, negatives=1, device=device)
        force(k.name)
        out = kvcore.gather(layout, slots, _poison(layout, t, device))
        assert torch.equal(_bits(out), _bits(_expected(logical, slots, _poison(layout, t, device))))
        _scatter_both(device, name, logical, slots, force)


# -- validation before any write ---------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_write_nothing(device, force):
    """Refused before anything moves (``validate="sync"``: on CUDA the slot values are
    checked on the device and the call raises before returning; the deferred default is
    tested in test_public_path.py)."""
    k = _native(device)
    name = "NL_X_TWO_NB_BS_NH_HS"
    logical = _logical(name, 2, 4, 4, 2, 8, torch.bfloat16, device, seed=23)
    layout, caches = _build_layout(name, logical)
    force(k.name)
    before = _storage_bytes(caches)
    out = _poison(layout, 4, device)
    with pytest.raises(TransferError, match="out of range"):
        kvcore.gather(layout, torch.tensor([0, 1, 16, 2], device=device), out, validate="sync")
    assert torch.equal(_bits(out), _bits(_poison(layout, 4, device)))
    # host-validated: names the first repeating index; a CUDA device check names the slot
    dup = (
        r"slot_mapping\[2\] = 3 repeats slot_mapping\[0\]"
        if device == "cpu"
        else r"slot 3 appears more than once|slot_mapping\[2\] = 3 repeats"
    )
    with pytest.raises(TransferError, match=dup):
        kvcore.scatter(layout, torch.tensor([3, 5, 3, 1], device=device), out, validate="sync")
    with pytest.raises(TransferError, match="out of range"):
        kvcore.scatter(layout, torch.tensor([3, 5, 99, 1], device=device), out, validate="sync")
    with pytest.raises(TransferError):
        kvcore.scatter(layout, torch.tensor([3, 5, 6, 1], device=device), out.float())
    with pytest.raises(TransferError):
        kvcore.scatter(layout, torch.tensor([3, 5, 6], device=device), out)
    assert _same_storage(before, _storage_bytes(caches))


@pytest.mark.parametrize("device", DEVICES)
def test_op_refuses_bad_arguments_before_writing(device):
    """The op checks what it can itself (a direct torch.ops call bypasses kvcore.gather)."""
    k = _native(device)
    name = "NL_X_TWO_NB_BS_NH_HS"
    logical = _logical(name, 2, 4, 4, 2, 8, torch.bfloat16, device, seed=24)
    layout, caches = _build_layout(name, logical)
    table = layout.stride_table()
    before = _storage_bytes(caches)
    slots = torch.tensor([1, 2, 3], device=device)
    bad_shape = torch.zeros((2, 2, 3, 15), dtype=torch.bfloat16, device=device)
    with pytest.raises(TransferError, match="staging"):
        k.scatter(TransferPlan(table, slots, bad_shape, 3))
    bad_slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    good = torch.zeros((2, 2, 3, 16), dtype=torch.bfloat16, device=device)
    with pytest.raises(TransferError, match="int64"):
        k.scatter(TransferPlan(table, bad_slots, good, 3))
    assert _same_storage(before, _storage_bytes(caches))
    # slots outside [0, num_slots) are skipped by the op itself, never written
    far = torch.tensor([1, 10_000, -5], device=device)
    k.scatter(TransferPlan(table, far, good, 1))
    la, _ = _build_layout(name, logical)
    force_ref = TransferPlan(la.stride_table(), torch.tensor([1, -1, -1], device=device), good, 1)
    REFERENCE.scatter(force_ref)
    assert _same_storage(_storage_bytes(caches), _storage_bytes(la.kv_caches))


# -- random geometries (hypothesis) --------------------------------------------------------

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "25")), deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        name=st.sampled_from(FAMILIES),
        nl=st.integers(1, 4),
        nb=st.integers(2, 9),
        bs=st.integers(1, 17),
        nh=st.integers(1, 5),
        hs=st.integers(1, 40),
        dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8, torch.float8_e5m2, torch.float64]),
        pad=st.booleans(),
        frac=st.floats(0.0, 1.0),
        seed=st.integers(0, 2**16),
        device=st.sampled_from(DEVICES),
    )
    def test_random_geometries_agree_with_reference(name, nl, nb, bs, nh, hs, dtype, pad, frac, seed, device):
        k = _native(device)
        logical = _logical(name, nl, nb, bs, nh, hs, dtype, device, seed=seed)
        layout, caches = _build_layout(name, logical, pad=pad)
        t = max(0, int(frac * layout.page_buffer_size))
        slots = _slots(layout.page_buffer_size, t, seed=seed, negatives=min(2, t), device=device)
        table = layout.stride_table()
        nv = int((slots >= 0).sum())
        a, b = _poison(layout, t, device), _poison(layout, t, device)
        k.gather(TransferPlan(table, slots, a, nv))
        REFERENCE.gather(TransferPlan(table, slots, b, nv))
        assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(_bits(a), _bits(_expected(logical, slots, _poison(layout, t, device))))
        lb, cb = _build_layout(name, logical, pad=pad)
        src = torch.empty_like(a)
        src.view(torch.uint8).copy_(torch.randint(0, 256, src.view(torch.uint8).shape, dtype=torch.uint8))
        k.scatter(TransferPlan(table, slots, src, nv))
        REFERENCE.scatter(TransferPlan(lb.stride_table(), slots, src, nv))
        assert _same_storage(_storage_bytes(caches), _storage_bytes(cb))


# -- selection, reporting --------------------------------------------------------------------


def test_native_cpu_serves_cpu_caches_and_reports_why():
    k = _native("cpu")
    assert k.priority > REFERENCE.priority
    logical = _logical("NL_X_TWO_NB_BS_NH_HS", 1, 2, 2, 1, 4, torch.float32, "cpu")
    layout, _ = _build_layout("NL_X_TWO_NB_BS_NH_HS", logical)
    assert select_kernel("cpu", layout.format.name, "cpu", layout.stride_table()) is k
    assert "parallel_for" in k.why() and "csrc" in k.why()
    if not torch.cuda.is_available():
        assert not CUDA_KERNEL.available()
        assert CUDA_KERNEL.why().startswith("unavailable: ")
    from kvcore.kernels import kernel_report

    rows = {r["name"]: r for r in kernel_report()}
    assert rows["native-cpu"]["available"] and rows["native-cpu"]["why"] == k.why()


def test_native_kernels_serve_every_v2_table():
    # a blocked-scale record is two planes staged into one row: the native ops move it too
    kv = [torch.zeros(3, 4, 20, dtype=torch.uint8)]
    blocked = kvcore.build_layout("NL_X_NB_BSV_BSS", kv, params={"scale_bytes": 4}).stride_table()
    logical = _logical("NL_X_NB_BS_HS", 1, 2, 2, 1, 4, torch.uint8, "cpu")
    layout, _ = _build_layout("NL_X_NB_BS_HS", logical)
    t = layout.stride_table()
    assert t.classic and not blocked.classic
    assert CPU_KERNEL.supports(t) and CPU_KERNEL.supports(blocked)
    assert select_kernel("cpu", "NL_X_NB_BSV_BSS", "cpu", blocked) is CPU_KERNEL


# -- CUDA: staging in pinned host memory, read and written in place -------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS", "NL_X_NB_BS_HS", "NL_X_NB_TWO_BS_NH_HS"])
@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_host_staging_both_directions(name, pinned, force):
    k = _native("cuda")
    logical = _logical(name, 3, 8, 16, 4, 64, torch.bfloat16, "cuda", seed=31)
    layout, caches = _build_layout(name, logical)
    slots = _slots(layout.page_buffer_size, 40, seed=10, device="cuda")
    host = _poison(layout, 40, "cpu")
    if pinned:
        host = host.pin_memory()
    force(k.name)
    kvcore.gather(layout, slots, host)
    torch.cuda.synchronize()
    assert torch.equal(_bits(host), _bits(_expected(logical, slots, _poison(layout, 40, "cuda")).cpu()))
    src = torch.randint(0, 256, host.view(torch.uint8).shape, dtype=torch.uint8).view(layout.dtype)
    if pinned:
        src = src.pin_memory()
    lb, cb = _build_layout(name, logical)
    kvcore.scatter(layout, slots, src)
    force("reference")
    kvcore.scatter(lb, slots, src.cuda())
    torch.cuda.synchronize()
    assert _same_storage(_storage_bytes(caches), _storage_bytes(cb))


@pytest.mark.parametrize("device", DEVICES)
def test_registered_ops_match_the_direct_entry(device):
    """torch.ops.kvcore.gather/scatter (the dispatcher path, ABI 4: ptrs [NL, P], plane
    records [P, 18], slots, a list of staging buffers) move the same bytes as the direct entry."""
    k = _native(device)
    from kvcore.kernels.native import plane_records

    name = "NL_X_TWO_NB_NH_BS_HS"
    logical = _logical(name, 2, 5, 4, 2, 8, torch.float16, device, seed=41)
    layout, caches = _build_layout(name, logical)
    table = layout.stride_table()
    slots = _slots(20, 9, seed=11, device=device)
    a, b = _poison(layout, 9, device), _poison(layout, 9, device)
    k.gather(TransferPlan(table, slots, a, 7))
    ptrs, recs = table.ptrs().to(device), plane_records(table)
    assert torch.ops.kvcore.abi_version() == 5
    assert torch.ops.kvcore.gather(ptrs, recs, slots, [b], table.block_size, table.num_slots) == 0
    assert torch.equal(_bits(a), _bits(b))
    before = _storage_bytes(caches)
    bad = torch.zeros((2, 2, 9, 15), dtype=torch.float16, device=device)
    assert torch.ops.kvcore.scatter(ptrs, recs, slots, [bad], table.block_size, table.num_slots) != 0
    assert "staging row" in torch.ops.kvcore.last_error()
    bad_rec = recs.clone()
    bad_rec[0, 4] = 3  # chunk_bytes x n_chunks no longer a head
    assert torch.ops.kvcore.scatter(ptrs, bad_rec, slots, [a], table.block_size, table.num_slots) != 0
    assert "head_bytes" in torch.ops.kvcore.last_error()
    assert _same_storage(before, _storage_bytes(caches))


def test_no_compiler_means_reference_with_one_warning(monkeypatch, caplog):
    """Without a compiler the build is not attempted: one warning, the reference serves."""
    monkeypatch.setenv("CXX", "no-such-compiler-kvcore")
    assert "no C++ compiler" in _build._missing_tools()
    fresh = _build.BuildStatus()
    monkeypatch.setattr(_build, "_STATUS", fresh)
    monkeypatch.setattr(_build, "_WARNED", False)
    monkeypatch.setattr(_build, "_has_ops", lambda: False)
    with caplog.at_level("WARNING", logger="kvcore.native"):
        st = _build.load()
        _build.load()
    assert not st.loaded and "no C++ compiler" in st.reason
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "reference kernel serves" in warnings[0].getMessage()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("KVCORE_NATIVE", "0")
    monkeypatch.setattr(_build, "_STATUS", _build.BuildStatus())
    st = _build.load()
    assert not st.loaded and "KVCORE_NATIVE=0" in st.reason
