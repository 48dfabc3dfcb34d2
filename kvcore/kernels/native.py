"""Native transfer kernels: the C++ CPU and CUDA ops of ``csrc/`` (``torch.ops.kvcore``).

Both take the layout's stride table as data and never see a format name: plane base
addresses ``[NL, P]`` and one 18-field record per plane (:func:`plane_records`; the
fields are documented in ``csrc/kvcore_ops.h``: cache strides incl. chunks and token
groups, a chunk's strided sub-runs, heads, width, the staging buffer / K/V index / byte
offset / head stride the plane is staged into, and the alignment of its bases), plus the slot mapping and the staging
buffers. Any table of the stride table v2 moves: classic K/V, MLA, blocked-scale records
(two planes sharing a staged row), multi-plane records with planes of different widths,
dtypes and staging buffers.

- ``native-cpu``: walks (plane, layer, token) rows, one 16-byte vector copy loop per
  contiguous run (a block's adjacent rows as one run); a plane whose head elements are not
  one run (chunks: a column-major ``[HS, BS]`` head, VNNI tiles ``[BS/16, HS/2, 16, 2]``)
  moves a block's consecutive tokens per head as one register-tiled transpose of
  chunk-sized items (``csrc/kvcore_tile.h``: SSE2, AVX2 where the CPU has it); a transfer
  below two grains
  (default 8 MiB per thread, ``KVCORE_CPU_GRAIN_BYTES``) stays on the calling thread,
  larger ones use ``at::parallel_for`` with one thread per grain, the rows split by bytes.
- ``native-cuda``: every layer and every plane in one launch (up to 8 planes per launch),
  each plane with its own vector width (16-byte coalesced loads and stores where its
  addresses allow, else 8/4/2/1), 64-bit offsets; staging on the device or in pinned
  host memory (zero-copy).

Both are reached through a prepared plan (``NativePlan`` in ``csrc/kvcore_cpu.cpp``),
built once per stride table: it holds the plane records, the bases (on the cache's
device), every cache storage with its address and size at detection (re-checked before
every call: a freed, reallocated or replaced storage is a :class:`~kvcore.TransferError`,
nothing moves) and the byte ranges the cache addresses (staging that shares memory with
the cache, or rows of a staging buffer that share memory, are refused). A call runs
without the dispatcher and with the GIL released. ``torch.ops.kvcore.gather`` /
``scatter`` are the registered ops (the same kernels, the raw ABI, no storage check) for
other callers. Neither throws: a refused call returns non-zero with the reason in
``last_error()``.

The library is built on first use (see :mod:`kvcore.kernels._build`); ``KVCORE_NATIVE=0``
disables both kernels.
"""

from __future__ import annotations

import math
import os
import weakref
from collections import OrderedDict

import torch

from kvcore.errors import TransferError
from kvcore.kernels import TransferPlan, _build, check_storages, guard_rows, plane_span
from kvcore.kernels.reference import REFERENCE
from kvcore.spec import StrideTable

__all__ = [
    "NativeCPUKernel",
    "NativeCUDAKernel",
    "kernels",
    "prepare",
    "plane_records",
    "PLANE_FIELDS",
    "RC_OK",
    "RC_REFUSED",
    "RC_NEG_CONJ",
    "RC_STALE",
    "RC_PENDING",
    "RC_PAGEABLE",
]

#: fields of one plane record (``csrc/kvcore_ops.h``, ``enum PlaneField``)
PLANE_FIELDS = (
    "block",
    "token",
    "head",
    "chunk",
    "chunk_bytes",
    "n_chunks",
    "token_group",
    "token_group_stride",
    "num_heads",
    "head_bytes",
    "buffer",
    "kv_index",
    "st_offset",
    "st_head",
    "base_align",
    "sub",
    "n_sub",
    "reserved",
)
MAX_PLANES = 64
RC_OK, RC_REFUSED, RC_NEG_CONJ, RC_STALE, RC_PENDING, RC_PAGEABLE = 0, 1, 2, 3, 4, 5

_MAX_CACHED = 64


def plane_records(table: StrideTable) -> torch.Tensor:
    """int64 ``[P, 18]``: the table's planes as the native ops read them (field order:
    :data:`PLANE_FIELDS`; ``buffer`` indexes ``table.buffers``; ``kv_index`` is -1 for a
    plane's own buffer; ``base_align`` is the largest power of two up to 16 dividing the
    plane's base address in every layer)."""
    keys = [b.key for b in table.buffers]
    host = table.ptrs()
    rows = []
    for k, p in enumerate(table.planes):
        g = 16
        for a in host[:, k].tolist():
            g = math.gcd(g, int(a))
        s = p.strides
        rows.append(
            [
                s.block,
                s.token,
                s.head,
                s.chunk,
                s.chunk_bytes,
                s.n_chunks,
                s.token_group,
                s.token_group_stride,
                p.num_heads,
                p.head_bytes,
                keys.index(p.staging.buffer),
                -1 if p.staging.index is None else p.staging.index,
                p.staging.offset,
                p.staging.head_stride,
                g,
                s.sub if s.n_sub > 1 else 0,
                s.n_sub,
                0,
            ]
        )
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(PLANE_FIELDS))


class _Prepared:
    """A table's native plan (``plan``: the C++ ``NativePlan``), with what the Python side
    needs per call: the staging buffer keys in order."""

    __slots__ = ("plan", "keys", "classic", "single", "table", "__weakref__")

    def __init__(self, table: StrideTable, single: bool):
        mod = _build.MODULE
        check_storages(table)  # a table whose storage already changed is refused, not prepared
        self.table = table
        self.single = single
        self.keys = tuple(b.key for b in table.buffers)
        b0 = table.buffers[0]
        self.classic = len(table.buffers) == 1 and b0.key == "kv" and b0.kv_size is not None
        host = table.ptrs()
        buffers = torch.tensor([[-1 if b.kv_size is None else b.kv_size, b.row_bytes] for b in table.buffers], dtype=torch.int64).reshape(
            len(table.buffers), 2
        )
        dtypes = [torch.empty(0, dtype=b.dtype) for b in table.buffers]
        extents = []
        for p in table.planes:
            span = plane_span(table, p)
            for t, off in p.bases:
                st = t.untyped_storage()
                if span:
                    extents.append((st.data_ptr() + off, st.data_ptr() + off + span))
        storages, labels, snap = guard_rows([("", table)])
        self.plan = mod.NativePlan(
            host,
            plane_records(table),
            buffers,
            dtypes,
            int(table.block_size),
            int(table.num_slots),
            storages,
            labels,
            snap,
            torch.tensor(extents, dtype=torch.int64).reshape(len(extents), 2),
            torch.empty(0, device=table.device),
            single,
        )
        if not self.plan.ok():
            raise TransferError(self.plan.error())

    def staging_list(self, staging, public: bool = False) -> list[torch.Tensor]:
        """The staging buffers in the table's buffer order: a tensor is the classic ``"kv"``
        buffer; otherwise a mapping holding exactly the table's buffer keys (the public API
        takes classic staging only as a tensor, ``public``).

        Raises:
            TransferError: a mapping where one tensor is staged (public), a tensor where a
                mapping is needed, or a mapping whose keys are not exactly the buffers.
        """
        classic = self.classic
        if isinstance(staging, torch.Tensor):
            if classic:
                return [staging]
            raise TransferError(f"staging must be a dict with the buffers {list(self.keys)}, got one tensor")
        if classic and public:
            raise TransferError(f"staging must be one tensor (the classic [kv_size, NL, T, row] buffer), got {type(staging).__name__}")
        try:
            if len(staging) != len(self.keys):
                raise KeyError(sorted(set(staging) ^ set(self.keys)))
            out = [staging[k] for k in self.keys]
        except (KeyError, TypeError) as e:
            raise TransferError(
                f"staging must be a dict with exactly the buffers {list(self.keys)}, got {type(staging).__name__}: {e}"
            ) from None
        for k, t in zip(self.keys, out):
            if not isinstance(t, torch.Tensor):
                raise TransferError(f"staging[{k!r}] must be a torch.Tensor, got {type(t).__name__}")
        return out


_CACHE: OrderedDict[tuple[int, bool], tuple[weakref.ref, _Prepared]] = OrderedDict()


def prepare(table: StrideTable, single: bool = False) -> _Prepared:
    """The native plan for ``table`` (cached while the table lives).

    Raises:
        TransferError: the op library is not loaded, a cache storage changed since the table
            was built (the engine freed or re-created its cache: detect again), or the table
            is not one the op can move.
    """
    key = (id(table), single)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is table:
        return hit[1]
    if _ops() is None:
        raise TransferError(f"the native op library is not available: {_build.status().reason}")
    prep = _Prepared(table, single)
    _CACHE[key] = (weakref.ref(table), prep)
    while len(_CACHE) > _MAX_CACHED:
        _CACHE.popitem(last=False)
    return prep


_OPS: list = []


def _ops():
    """The loaded op module (``NativePlan``, ``take_device_error``...), or None."""
    if _OPS:
        return _OPS[0]
    if not _build.load().loaded or _build.MODULE is None or not hasattr(_build.MODULE, "NativePlan"):
        return None
    mod = _build.MODULE
    tune = os.environ.get("KVCORE_CUDA_UNROLL", "").strip()
    if tune:  # "DEVICE,HOST": loads in flight per thread (4 or 8) for device / pinned-host staging
        try:
            dev, host = (int(x) for x in tune.split(","))
        except ValueError:
            raise TransferError(f"KVCORE_CUDA_UNROLL must be 'DEVICE,HOST' with values 4 or 8, got {tune!r}") from None
        torch.ops.kvcore.set_cuda_unroll(dev, host)
    grain = os.environ.get("KVCORE_CPU_GRAIN_BYTES", "").strip()
    if grain:
        try:
            mod.set_cpu_grain(int(grain))
        except ValueError:
            raise TransferError(f"KVCORE_CPU_GRAIN_BYTES must be a number of bytes, got {grain!r}") from None
    pdl = os.environ.get("KVCORE_CUDA_PDL", "").strip()
    if pdl:
        mod.set_cuda_pdl(pdl not in ("0", "false", "no", "off"))
    _OPS.append(mod)
    return mod


def take_device_error() -> str:
    """The pending device-side refusal of an earlier CUDA call, once ('' when none)."""
    mod = _OPS[0] if _OPS else (_build.MODULE if _build.status().loaded else None)
    if mod is None or not hasattr(mod, "take_device_error"):
        return ""
    return mod.take_device_error()


def resolve_neg_conj(t: torch.Tensor) -> torch.Tensor:
    """``t`` with torch's negative / conjugate bits applied (a new tensor when set)."""
    return t.resolve_neg().resolve_conj()


def run_prepared(prep: _Prepared, gather: bool, slots: torch.Tensor, staging, skip: int, validate: int, who: str) -> None:
    """One call of a prepared plan, with the return codes turned into kvcore's behaviour:
    refusals raise :class:`TransferError`; staging with torch's negative/conjugate bit is
    resolved (gather: into a resolved copy, then copied back through the view; scatter: from
    a resolved copy); pageable host staging for a CUDA cache goes to the reference kernel."""
    lst = prep.staging_list(staging)
    rc = prep.plan.run1(gather, slots, lst[0], skip, validate) if len(lst) == 1 else prep.plan.run(gather, slots, lst, skip, validate)
    if rc == RC_OK:
        return
    if rc == RC_NEG_CONJ:
        fixed = [resolve_neg_conj(b) if (b.is_neg() or b.is_conj()) else b for b in lst]
        rc = prep.plan.run(gather, slots, fixed, skip, validate)
        if rc == RC_OK:
            if gather:
                for b, f in zip(lst, fixed):
                    if f is not b:
                        b.copy_(f)
            return
    if rc == RC_PAGEABLE:
        raise _Pageable()
    msg = _build.MODULE.last_error()
    raise NativeRefusal(f"{who}: {msg}" if rc == RC_REFUSED and who else msg, rc)


class NativeRefusal(TransferError):
    """A call the native op refused before moving a byte; ``code`` is the op's return code
    (:data:`RC_REFUSED`, :data:`RC_STALE`, :data:`RC_PENDING`)."""

    def __init__(self, msg: str, code: int):
        super().__init__(msg)
        self.code = code


class _Pageable(Exception):
    """Internal: pageable host staging for a CUDA cache (the reference kernel moves it)."""


class _NativeKernel:
    formats = None
    priority = 10
    device_type = "cpu"

    @property
    def device_types(self) -> tuple[str, ...]:
        return (self.device_type,)

    def supports(self, table: StrideTable) -> bool:
        """Every table of the stride table v2 with at most 64 planes (chunks of strided
        sub-runs included: ``PlaneStrides.sub_runs``)."""
        return 1 <= len(table.planes) <= MAX_PLANES

    def _call(self, plan: TransferPlan, gather: bool) -> None:
        if _ops() is None or not self.supports(plan.table):
            # select_kernel skips this kernel when it is given the table (or when the op
            # library is not built); a caller that calls it anyway still gets a correct transfer
            (REFERENCE.gather if gather else REFERENCE.scatter)(plan)
            return
        prep = prepare(plan.table)
        slots = plan.slots if plan.slots.is_contiguous() else plan.slots.contiguous()
        try:
            # a TransferPlan is validated by its maker; the op still skips slots out of range
            run_prepared(prep, gather, slots, plan.staging, 0, 0, f"{self.name} refused the transfer")
        except _Pageable:
            (REFERENCE.gather if gather else REFERENCE.scatter)(plan)

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
        grain = _ops().cpu_grain() if _ops() is not None else 0
        return (
            f"C++ op torch.ops.kvcore (csrc/kvcore_cpu.cpp): every plane of the record, (plane, layer, token) rows, one 16-byte "
            f"vector copy per contiguous run, heads in chunks as tiled transposes of a block's consecutive tokens; one thread "
            f"below {grain >> 10} KiB per thread, else at::parallel_for on up to "
            f"{torch.get_num_threads()} threads; {st.reason}"
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
        return super().supports(table) and table.num_layers <= 65535

    def why(self) -> str:
        if not torch.cuda.is_available():
            return f"unavailable: no CUDA device visible to torch {torch.__version__}"
        st = _build.status() if _build.status().attempted else _build.load()
        if not st.loaded:
            return f"unavailable: {st.reason}; the torch reference kernel serves CUDA caches"
        if not st.cuda:
            return f"unavailable: the op library was built without CUDA ({'; '.join(st.log) or st.reason})"
        return (
            "CUDA op torch.ops.kvcore (csrc/kvcore_cuda.cu): all layers and planes in one launch, each plane in its own vector "
            f"width (16-byte coalesced where aligned), slots validated on the device, staging on the GPU or in pinned host memory "
            f"(zero-copy); {st.reason}"
        )


CPU_KERNEL = NativeCPUKernel()
CUDA_KERNEL = NativeCUDAKernel()


def kernels() -> list:
    """The native kernels to register (always both: ``available()`` says whether each
    one can serve here, and ``why()`` says why not)."""
    return [CPU_KERNEL, CUDA_KERNEL]
