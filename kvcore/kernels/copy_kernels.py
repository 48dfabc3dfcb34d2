"""Copy kernels: token rows from one paged cache straight into another, two stride tables.

A copy kernel never sees a format name. It receives a :class:`CopyPlan` — the source and
destination :class:`~kvcore.spec.StrideTable` (layers selected, head ranges applied,
planes paired by position: ``src.planes[i]`` moves into ``dst.planes[i]``, equal head
counts, head widths and dtypes), and two validated slot mappings — and moves bytes, one
pass, no staging buffer. Row ``i`` moves source slot ``src_slots[i]`` to destination slot
``dst_slots[i]``; a ``-1`` on either side skips the row (the destination row is left as
it was).

Three kernels of the stride-driven family:

- ``reference``: torch indexing, one copy per (layer, plane), any device and any pair of
  devices (a pageable host side goes through ``Tensor.to``).
- ``native-cpu``: ``torch.ops.kvcore.copy_rows`` (``csrc/kvcore_copy.cpp``), rows in
  parallel, one vector copy per run that is contiguous on both sides.
- ``native-cuda``: the same op on a GPU (``csrc/kvcore_copy.cu``): every layer and plane
  in one launch, 16-byte coalesced units; a side in pinned host memory is read or written
  in place (device <-> pinned host with the layout conversion fused).

A kernel registered by a plugin (``kvcore_register_kernels``) takes part when it defines
``copy(plan)``; ``supports_copy(plan) -> bool`` lets it decline a plan. The highest
``priority`` that accepts the plan serves it; ``KVCORE_COPY_KERNEL=name`` (or
``KVCORE_KERNEL=name`` naming a copy kernel) forces one.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvcore import registry
from kvcore.errors import TransferError
from kvcore.kernels import _build, check_storages, guard_rows
from kvcore.kernels.views import UNIT as _UNIT
from kvcore.kernels.views import cache_rows_view
from kvcore.spec import Plane, StrideTable

__all__ = ["CopyPlan", "ReferenceCopyKernel", "NativeCopyKernel", "copy_kernels", "select_copy_kernel", "check_tables"]


@dataclass(frozen=True)
class CopyPlan:
    """One copy, fully validated.

    Attributes:
        src, dst: the two stride tables, restricted to the layers moved (in pairing order)
            and to the head ranges, planes paired by position.
        src_slots, dst_slots: int64 ``[T]``; ``-1`` on both sides where either side was
            padding. On the device that runs the copy (a CUDA device when either cache is
            on one), or each on its cache's device for the reference kernel's own use.
        num_valid: rows that move.
    """

    src: StrideTable
    dst: StrideTable
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    num_valid: int

    @property
    def exec_device(self) -> torch.device:
        """The device that runs the copy: the GPU when either side is on one, else the source's."""
        for d in (self.src.device, self.dst.device):
            if d.type != "cpu":
                return d
        return self.src.device


def check_tables(src: StrideTable, dst: StrideTable) -> None:
    """Both caches of a copy are still what their layouts describe
    (:func:`kvcore.kernels.check_storages`: storages not freed, resized or replaced,
    tensors not reshaped in place, the caller's tensors not re-pointed under kvcore's views).

    Raises:
        TransferError: naming the side, the (layer, plane) and what changed.
    """

    for table, what in ((src, "source"), (dst, "destination")):
        try:
            check_storages(table)
        except TransferError as e:
            raise TransferError(f"kvcore.copy: the {what} cache: {e}") from None


# -- reference -------------------------------------------------------------------------


def _rows_view(p: Plane, t: torch.Tensor, off: int, nblocks: int, block_size: int, w: int, cache: dict) -> torch.Tensor:
    """``[blocks, (groups,) tokens, heads, chunks, sub-runs, units]`` of one (layer, plane), as ``w``-byte integers."""
    return cache_rows_view(p, t, off, nblocks, block_size, w, cache)


def _index(table: StrideTable, p: Plane, slots: torch.Tensor) -> tuple:
    blk = torch.div(slots, table.block_size, rounding_mode="floor")
    off = slots - blk * table.block_size
    s = p.strides
    if s.token_group and s.token_group < table.block_size:
        return (blk, torch.div(off, s.token_group, rounding_mode="floor"), off % s.token_group)
    return (blk, off)


def _unit_width(plan: CopyPlan) -> int:
    g = 8
    for table in (plan.src, plan.dst):
        for p in table.planes:
            s = p.strides
            for v in (
                s.block,
                s.token,
                s.head,
                s.chunk,
                s.chunk_bytes,
                s.token_group_stride,
                s.sub,
                p.head_bytes,
                *(o for _, o in p.bases),
            ):
                if v:
                    g = math.gcd(g, int(v))
    return g if g in _UNIT else 1


class ReferenceCopyKernel:
    """Torch reference copy: every device and pair of devices, every plan, priority 0."""

    name = "reference"
    priority = 0

    def available(self) -> bool:
        return True

    def why(self) -> str:
        return "torch indexing, one copy per (layer, plane); always available"

    def supports_copy(self, plan: CopyPlan) -> bool:
        return True

    def copy(self, plan: CopyPlan) -> None:
        if plan.num_valid == 0:
            return
        src, dst = plan.src, plan.dst
        check_tables(src, dst)  # a freed, resized or re-pointed cache is a TransferError, never a raw error or a lost write
        sdev, ddev = src.device, dst.device
        ss = plan.src_slots.to(sdev)
        ds = plan.dst_slots.to(ddev)
        keep_s = ss >= 0
        ss = ss[keep_s]
        ds = ds[keep_s.to(ddev)]
        nv = int(ss.numel())
        w = _unit_width(plan)
        views: dict = {}
        nb_s = -(-src.num_slots // src.block_size)
        nb_d = -(-dst.num_slots // dst.block_size)
        for ps, pd in zip(src.planes, dst.planes):
            si = _index(src, ps, ss)
            di = _index(dst, pd, ds)
            for li in range(src.num_layers):
                (ts, os_), (td, od) = ps.bases[li], pd.bases[li]
                sv = _rows_view(ps, ts, os_, nb_s, src.block_size, w, views)
                dv = _rows_view(pd, td, od, nb_d, dst.block_size, w, views)
                rows = sv[si].reshape(nv, -1)
                if sdev != ddev:
                    rows = rows.to(ddev)
                dv[di] = rows.reshape(dv[di].shape)


REFERENCE_COPY = ReferenceCopyKernel()


# -- native ----------------------------------------------------------------------------

_MAX_CACHED = 64


class _Prepared:
    """The op's per-plan-pair arguments, computed once per pair of tables."""

    __slots__ = ("src_ptrs", "dst_ptrs", "src_geom", "dst_geom", "rows", "args", "probes", "__weakref__")

    def __init__(self, plan: CopyPlan, device: torch.device):
        def geom(table: StrideTable) -> torch.Tensor:
            return torch.tensor(
                [
                    [p.block, p.token, p.head, p.chunk, p.chunk_bytes, p.n_chunks, p.strides.token_group, p.strides.token_group_stride]
                    for p in table.planes
                ],
                dtype=torch.int64,
            ).reshape(len(table.planes), 8)

        sp, dp = plan.src.ptrs(), plan.dst.ptrs()
        self.src_ptrs = sp.to(device) if device.type != "cpu" else sp
        self.dst_ptrs = dp.to(device) if device.type != "cpu" else dp
        self.src_geom, self.dst_geom = geom(plan.src), geom(plan.dst)
        self.rows = torch.tensor([[p.num_heads, p.head_bytes] for p in plan.src.planes], dtype=torch.int64).reshape(-1, 2)
        g = 16
        for a in sp.flatten().tolist() + dp.flatten().tolist():
            g = math.gcd(g, int(a))
        align = g if g in (1, 2, 4, 8, 16) else 1

        def probe(table: StrideTable, ptrs: torch.Tensor) -> int:
            return int(ptrs.flatten()[0]) if (device.type == "cuda" and table.device.type == "cpu") else 0

        self.args = (plan.src.block_size, plan.src.num_slots, plan.dst.block_size, plan.dst.num_slots, align)
        self.probes = (probe(plan.src, sp), probe(plan.dst, dp))


_CACHE: OrderedDict[tuple[int, int], tuple[weakref.ref, weakref.ref, _Prepared]] = OrderedDict()


_CACHE_LOCK = threading.Lock()


def _prepare(plan: CopyPlan, device: torch.device) -> _Prepared:
    key = (id(plan.src), id(plan.dst))
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None and hit[0]() is plan.src and hit[1]() is plan.dst:
        return hit[2]
    prep = _Prepared(plan, device)
    with _CACHE_LOCK:
        _CACHE[key] = (weakref.ref(plan.src), weakref.ref(plan.dst), prep)
        while len(_CACHE) > _MAX_CACHED:
            _CACHE.popitem(last=False)
    return prep


def prepare_native(src: StrideTable, dst: StrideTable, shared: bool):
    """The native op library's prepared copy plan (``CopyPlan`` in ``csrc/kvcore_copy.cpp``)
    for two paired tables, or None when the library (or its copy plan) is not available.

    Raises:
        TransferError: a cache storage changed since the tables were built, or the op refuses
            the tables.
    """

    if _op() is None or not hasattr(_build.MODULE, "CopyPlan"):
        return None
    check_tables(src, dst)
    dev = src.device if src.device.type != "cpu" else dst.device

    def geom(table: StrideTable) -> torch.Tensor:
        return torch.tensor(
            [
                [p.block, p.token, p.head, p.chunk, p.chunk_bytes, p.n_chunks, p.strides.token_group, p.strides.token_group_stride]
                for p in table.planes
            ],
            dtype=torch.int64,
        ).reshape(len(table.planes), 8)

    sp, dp = src.ptrs(), dst.ptrs()
    g = 16
    for a in sp.flatten().tolist() + dp.flatten().tolist():
        g = math.gcd(g, int(a))
    align = g if g in (1, 2, 4, 8, 16) else 1

    def probe(table: StrideTable, ptrs: torch.Tensor) -> int:
        return int(ptrs.flatten()[0]) if (dev.type == "cuda" and table.device.type == "cpu") else 0

    rows = torch.tensor([[p.num_heads, p.head_bytes] for p in src.planes], dtype=torch.int64).reshape(-1, 2)
    storages, labels, snap = guard_rows([("source ", src), ("destination ", dst)])
    plan = _build.MODULE.CopyPlan(
        sp,
        geom(src),
        dp,
        geom(dst),
        rows,
        int(src.block_size),
        int(src.num_slots),
        int(dst.block_size),
        int(dst.num_slots),
        align,
        probe(src, sp),
        probe(dst, dp),
        bool(shared),
        storages,
        labels,
        snap,
        torch.empty(0, device=dev),
    )
    if not plan.ok():
        raise TransferError(plan.error())
    return plan


def _op():
    """``torch.ops.kvcore.copy_rows`` once the op library is built and loaded, else None."""

    if not _build.load().loaded:
        return None
    try:
        return torch.ops.kvcore.copy_rows.default
    except (AttributeError, RuntimeError):
        return None


def _all_pinned(table: StrideTable) -> bool:
    return all(t.is_pinned() for p in table.planes for t, _ in p.bases)


class NativeCopyKernel:
    """``torch.ops.kvcore.copy_rows`` on the CPU (``native-cpu``) or a GPU (``native-cuda``)."""

    priority = 10

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.name = f"native-{device_type}"

    def available(self) -> bool:
        if self.device_type == "cuda":
            if not torch.cuda.is_available():
                return False

            return _op() is not None and _build.status().cuda
        return _op() is not None

    def why(self) -> str:
        if self.device_type == "cuda" and not torch.cuda.is_available():
            return "unavailable: no CUDA device visible to torch"
        st = _build.status() if _build.status().attempted else _build.load()
        if not st.loaded:
            return f"unavailable: {st.reason}; the torch reference copy serves"
        if _op() is None:
            return "unavailable: the op library has no kvcore.copy_rows (built from older sources)"
        if self.device_type == "cuda" and not st.cuda:
            return "unavailable: the op library was built without CUDA"
        if self.device_type == "cuda":
            return "CUDA op kvcore.copy_rows (csrc/kvcore_copy.cu): all layers and planes in one launch, 16-byte units, pinned host sides in place"
        return "C++ op kvcore.copy_rows (csrc/kvcore_copy.cpp): rows in parallel, one vector copy per run contiguous on both sides"

    def supports_copy(self, plan: CopyPlan) -> bool:
        n = len(plan.src.planes)
        if not 1 <= n <= 8 or any(p.strides.sub_runs for t in (plan.src, plan.dst) for p in t.planes):
            return False
        if self.device_type == "cpu":
            return plan.src.device.type == "cpu" and plan.dst.device.type == "cpu"
        dev = plan.exec_device
        if dev.type != "cuda" or plan.src.num_layers * n > 65535:
            return False
        for t in (plan.src, plan.dst):
            if t.device.type == "cuda" and t.device != dev:
                return False
            if t.device.type == "cpu" and not _all_pinned(t):
                return False  # pageable host memory cannot be reached by the GPU
            if t.device.type not in ("cpu", "cuda"):
                return False
        return True

    def copy(self, plan: CopyPlan) -> None:
        if plan.num_valid == 0:
            return
        op = _op()
        dev = plan.exec_device if self.device_type == "cuda" else torch.device("cpu")
        if op is None:
            REFERENCE_COPY.copy(plan)
            return
        check_tables(plan.src, plan.dst)  # the raw op re-checks nothing: check here, before the pointers are used
        prep = _prepare(plan, dev)
        ss = plan.src_slots.to(dev).contiguous()
        ds = plan.dst_slots.to(dev).contiguous()
        rc = op(prep.src_ptrs, prep.src_geom, ss, prep.dst_ptrs, prep.dst_geom, ds, prep.rows, *prep.args, *prep.probes)
        if rc:
            raise TransferError(f"{self.name} refused the copy: {torch.ops.kvcore.copy_last_error()}")


NATIVE_CPU_COPY = NativeCopyKernel("cpu")
NATIVE_CUDA_COPY = NativeCopyKernel("cuda")


def copy_kernels() -> list:
    """The copy kernels: the built-in ones and every registered kernel that defines ``copy``."""

    out = [NATIVE_CUDA_COPY, NATIVE_CPU_COPY, REFERENCE_COPY]
    for k in registry.kernels():
        if callable(getattr(k, "copy", None)) and k not in out:
            out.append(k)
    return sorted(out, key=lambda k: -int(getattr(k, "priority", 0)))


def select_copy_kernel(plan: CopyPlan):
    """The kernel that serves ``plan``.

    Raises:
        TransferError: ``KVCORE_COPY_KERNEL`` (or ``KVCORE_KERNEL``) names a copy kernel that
            cannot serve the plan.
    """
    kernels = copy_kernels()
    forced = os.environ.get("KVCORE_COPY_KERNEL", "").strip()
    if not forced:
        k_env = os.environ.get("KVCORE_KERNEL", "").strip()
        if k_env and any(k.name == k_env for k in kernels):
            forced = k_env
    if forced:
        for k in kernels:
            if k.name == forced:
                sup = getattr(k, "supports_copy", None)
                if not k.available() or (sup is not None and not sup(plan)):
                    raise TransferError(
                        f"copy kernel {forced} (forced by KVCORE_COPY_KERNEL/KVCORE_KERNEL) cannot serve a copy from "
                        f"{plan.src.device} to {plan.dst.device}: {k.why()}"
                    )
                return k
        raise TransferError(f"KVCORE_COPY_KERNEL={forced} names no copy kernel; copy kernels: {', '.join(k.name for k in kernels)}")
    for k in kernels:
        sup = getattr(k, "supports_copy", None)
        if (sup is None or sup(plan)) and k.available():
            return k
    return REFERENCE_COPY
