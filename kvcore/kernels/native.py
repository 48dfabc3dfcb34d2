"""Native transfer kernels: the C++ CPU and CUDA ops of ``csrc/`` (``torch.ops.kvcore``).

Both ops take the layout's stride table as data — plane base addresses ``[NL, kv_size]``,
per-plane byte strides ``[kv_size, 6]`` (block, token, head, chunk, chunk_bytes,
n_chunks) — plus the slot mapping and the staging buffer, and never see a format name:

- ``native-cpu``: parallel over (layer, K/V, token) rows with ``at::parallel_for``, one
  16-byte vector copy loop per contiguous run (a whole ``NH*HS`` row where the layout
  keeps it contiguous, e.g. NHD; one head's row for HND; one chunk for chunked heads).
- ``native-cuda``: every layer and both K/V planes in one launch, 16-byte vectorised
  coalesced loads and stores where every address allows (else 8/4/2/1), 64-bit
  offsets; the staging buffer may be device memory or pinned host memory, read or
  written in place (zero-copy).

Both are reached through the op library's direct entry (``transfer``: the same C++
functions without the dispatcher's boxing, GIL released); ``torch.ops.kvcore.gather`` /
``scatter`` are the registered ops for other callers. Neither throws: a refused call
returns non-zero and ``torch.ops.kvcore.last_error()`` says why (raised here as
:class:`~kvcore.TransferError`). Negative slots are skipped (the row stays untouched). Tables other than classic
K/V tables (blocked-scale records, multi-plane records) are left to the reference kernel
(``supports``).
The library is built on first use (see :mod:`kvcore.kernels._build`); ``KVCORE_NATIVE=0``
disables both kernels.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections import OrderedDict

import torch

from kvcore.errors import TransferError
from kvcore.kernels import TransferPlan, _build
from kvcore.spec import StrideTable

__all__ = ["NativeCPUKernel", "NativeCUDAKernel", "kernels", "prepare"]

_MAX_CACHED = 64


class _Prepared:
    """Per-table arguments of the native ops, computed once per stride table."""

    __slots__ = ("ptrs", "strides", "base_align", "supported", "args", "probe", "__weakref__")

    def __init__(self, table: StrideTable, device: torch.device):
        # the first plane's storage: if the engine reallocated its cache since, re-prepare
        t0 = table.bases[0][0][0]
        self.probe = (t0, t0.untyped_storage().data_ptr(), t0.untyped_storage().nbytes())
        self.supported = _classic(table)
        host = table.ptrs()
        self.ptrs = host.to(device) if device.type != "cpu" else host
        self.strides = torch.tensor(
            [[p.block, p.token, p.head, p.chunk, p.chunk_bytes, p.n_chunks] for p in table.planes], dtype=torch.int64
        ).reshape(len(table.planes), 6)
        g = 16
        for a in host.flatten().tolist():
            g = math.gcd(g, int(a))
        self.base_align = g if g in (1, 2, 4, 8, 16) else 1
        # block_size, num_heads, head_bytes, num_slots, base_align
        self.args = (int(table.block_size), int(table.num_heads), int(table.head_bytes), int(table.num_slots), self.base_align)


def _classic(table: StrideTable) -> bool:
    """The op moves one or two planes of one width into the classic buffer."""
    return len(table.planes) in (1, 2) and table.classic


_CACHE: OrderedDict[int, tuple[weakref.ref, _Prepared]] = OrderedDict()


def _fresh(prep: _Prepared) -> bool:
    t, ptr, nbytes = prep.probe
    st = t.untyped_storage()
    return st.data_ptr() == ptr and st.nbytes() == nbytes


def prepare(table: StrideTable) -> _Prepared:
    """The op arguments for ``table`` (cached while the table lives, and while its first
    plane's storage is the one it was prepared against).

    Raises:
        TransferError: the cache's storage shrank below what the layout addresses (the
            engine reallocated it: detect again).
    """
    key = id(table)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is table and _fresh(hit[1]):
        return hit[1]
    for layer in table.bases:
        for t, _ in layer:
            if t.untyped_storage().nbytes() == 0:
                raise TransferError("the cache's storage was freed or resized since detection; detect the cache again")
    prep = _Prepared(table, table.device)
    _CACHE[key] = (weakref.ref(table), prep)
    while len(_CACHE) > _MAX_CACHED:
        _CACHE.popitem(last=False)
    return prep


_OPS: list = []


def _ops():
    """``(gather, scatter)`` op overloads once the library is loaded, else None."""
    if _OPS:
        return _OPS[0]
    if not _build.load().loaded:
        return None
    mod = _build.MODULE
    if mod is not None and hasattr(mod, "transfer"):
        # the same implementations without the dispatcher's boxing, GIL released
        _OPS.append((functools.partial(mod.transfer, True), functools.partial(mod.transfer, False)))
    else:
        _OPS.append((torch.ops.kvcore.gather.default, torch.ops.kvcore.scatter.default))
    tune = os.environ.get("KVCORE_CUDA_UNROLL", "").strip()
    if tune:  # "DEVICE,HOST": loads in flight per thread (4 or 8) for device / pinned-host staging
        try:
            dev, host = (int(x) for x in tune.split(","))
        except ValueError:
            raise TransferError(f"KVCORE_CUDA_UNROLL must be 'DEVICE,HOST' with values 4 or 8, got {tune!r}") from None
        torch.ops.kvcore.set_cuda_unroll(dev, host)
    return _OPS[0]


class _NativeKernel:
    formats = None
    priority = 10
    device_type = "cpu"

    @property
    def device_types(self) -> tuple[str, ...]:
        return (self.device_type,)

    def supports(self, table: StrideTable) -> bool:
        """False for what the op does not move: anything but a classic K/V table."""
        return _classic(table)

    def _call(self, plan: TransferPlan, gather: bool) -> None:
        table = plan.table
        hit = _CACHE.get(id(table))
        prep = hit[1] if hit is not None and hit[0]() is table and _fresh(hit[1]) else prepare(table)
        ops = _OPS[0] if _OPS else _ops()
        if ops is None or not prep.supported:
            # select_kernel skips this kernel when it is given the table (or when the op
            # library is not built); a caller that calls it anyway still gets a correct transfer
            from kvcore.kernels.reference import REFERENCE

            (REFERENCE.gather if gather else REFERENCE.scatter)(plan)
            return
        slots = plan.slots if plan.slots.is_contiguous() else plan.slots.contiguous()
        if ops[0 if gather else 1](prep.ptrs, prep.strides, slots, plan.staging, *prep.args):
            # the op validates before moving a byte, and reports instead of throwing
            raise TransferError(f"{self.name} refused the transfer: {torch.ops.kvcore.last_error()}")

    def gather(self, plan: TransferPlan) -> None:
        self._call(plan, True)

    def scatter(self, plan: TransferPlan) -> None:
        self._call(plan, False)


class NativeCPUKernel(_NativeKernel):
    """The C++ CPU op (``csrc/kvcore_cpu.cpp``)."""

    name = "native-cpu"
    device_type = "cpu"

    def available(self) -> bool:
        return _build.load().loaded

    def accepts(self, staging_device_type: str | None) -> bool:
        return staging_device_type in (None, "cpu")

    def why(self) -> str:
        st = _build.status() if _build.status().attempted else _build.load()
        if not st.loaded:
            return f"unavailable: {st.reason}; the torch reference kernel serves CPU caches"
        return (
            f"C++ op torch.ops.kvcore (csrc/kvcore_cpu.cpp): at::parallel_for over (layer, K/V, token) rows on "
            f"{torch.get_num_threads()} threads, one 16-byte vector copy per contiguous run; {st.reason}"
        )


class NativeCUDAKernel(_NativeKernel):
    """The CUDA op (``csrc/kvcore_cuda.cu``)."""

    name = "native-cuda"
    device_type = "cuda"

    def available(self) -> bool:
        if not torch.cuda.is_available():
            return False
        st = _build.load()
        return st.loaded and st.cuda

    def accepts(self, staging_device_type: str | None) -> bool:
        return staging_device_type in (None, "cuda", "cpu")

    def supports(self, table: StrideTable) -> bool:
        return super().supports(table) and table.num_layers * table.kv_size <= 65535

    def _call(self, plan: TransferPlan, gather: bool) -> None:
        st = plan.staging
        if not st.is_cuda and not st.is_pinned():
            # pageable host memory cannot be reached by the GPU: the reference kernel
            # moves it through a device buffer proportional to the tokens
            from kvcore.kernels.reference import REFERENCE

            (REFERENCE.gather if gather else REFERENCE.scatter)(plan)
            return
        super()._call(plan, gather)

    def why(self) -> str:
        if not torch.cuda.is_available():
            return f"unavailable: no CUDA device visible to torch {torch.__version__}"
        st = _build.status() if _build.status().attempted else _build.load()
        if not st.loaded:
            return f"unavailable: {st.reason}; the torch reference kernel serves CUDA caches"
        if not st.cuda:
            return f"unavailable: the op library was built without CUDA ({'; '.join(st.log) or st.reason})"
        return (
            "CUDA op torch.ops.kvcore (csrc/kvcore_cuda.cu): all layers and K/V in one launch, 16-byte coalesced "
            f"vectors where aligned, staging on the GPU or in pinned host memory (zero-copy); {st.reason}"
        )


CPU_KERNEL = NativeCPUKernel()
CUDA_KERNEL = NativeCUDAKernel()


def kernels() -> list:
    """The native kernels to register (always both: ``available()`` says whether each
    one can serve here, and ``why()`` says why not)."""
    return [CPU_KERNEL, CUDA_KERNEL]
