"""Transfer kernels: the contract, the plan they receive, and how one is chosen.

A kernel never sees a format name. It receives a :class:`TransferPlan` — the layout's
:class:`~kvcore.spec.StrideTable` for the selected layers, the slot mapping (already
validated, negative = skip) and the staging tensor — and moves bytes.

Kernels are offered by plugins through ``kvcore_register_kernels``. For a transfer the
core picks, among the kernels whose ``device_types`` include the cache's device type,
whose ``formats`` is None or names the layout's format, and whose ``available()`` is
true, the one with the highest ``priority``; the torch reference kernel (priority 0)
answers what no other claims. ``KVCORE_KERNEL=name`` forces one. Kernel names are
unique (a plugin registering a taken name is skipped); a plugin kernel that fails a
transfer is marked broken and the transfer is redone by the next kernel
(:class:`kvcore.registry.BoundKernel`, docs/plugins.md §8).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvcore import registry
from kvcore.errors import TransferError
from kvcore.kernels import _build
from kvcore.registry import BoundKernel, _GuardedKernel
from kvcore.spec import StrideTable, caller_problem
from kvcore.strides import _extent, plane_span

__all__ = [
    "TransferKernel",
    "TransferPlan",
    "select_kernel",
    "kernel_report",
    "check_storages",
    "check_tensor_states",
    "guard_rows",
    "plane_span",
    "staging_conflict",
    "single_threaded",
    "cpu_grain",
]


@dataclass(frozen=True)
class TransferPlan:
    """One gather or scatter, fully validated.

    Attributes:
        table: stride table restricted to the layers being moved, in staging order.
        slots: int64 ``[T]`` on the cache's device; ``-1`` rows are not moved (engine
            padding, and the ``skip_prefix`` rows).
        staging: the classic buffer ``[kv_size, NL, T, NH*HS]`` (a 4-D view even for one
            layer), or a dict ``{buffer key: tensor}`` holding one tensor per
            :class:`~kvcore.spec.StagingBuffer` of the table (``"kv"``: 4-D as above; a
            plane's own buffer: ``[NL, T, row]``). Last dims contiguous, on the cache's
            device or (CUDA caches) in host memory.
        num_valid: number of slots >= 0.
    """

    table: StrideTable
    slots: torch.Tensor
    staging: torch.Tensor | Mapping[str, torch.Tensor]
    num_valid: int

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The staging buffers by key (``{"kv": staging}`` for a classic tensor)."""
        if isinstance(self.staging, torch.Tensor):
            return {"kv": self.staging}
        return dict(self.staging)


@runtime_checkable
class TransferKernel(Protocol):
    name: str
    device_types: tuple[str, ...]
    formats: tuple[str, ...] | None
    priority: int

    def available(self) -> bool: ...

    def why(self) -> str: ...

    def gather(self, plan: TransferPlan) -> None: ...

    def scatter(self, plan: TransferPlan) -> None: ...


def _candidates(device_type: str, format_name: str):
    out = []
    for k in registry.kernels():
        if device_type not in tuple(k.device_types):
            continue
        fm = getattr(k, "formats", None)
        if fm is not None and format_name not in fm:
            continue
        out.append(k)
    return sorted(out, key=lambda k: -int(getattr(k, "priority", 0)))


def select_kernel(device_type: str, format_name: str, staging_device_type: str | None = None, table: StrideTable | None = None):
    """The kernel that serves ``format_name`` on ``device_type``.

    A kernel may define ``supports(table) -> bool`` (e.g. a kernel that moves only classic
    K/V tables); when ``table`` is given, kernels that decline it are skipped.

    Raises:
        TransferError: ``KVCORE_KERNEL`` names a kernel that cannot serve it, or no
            kernel (not even the reference) claims the device.
    """
    forced = os.environ.get("KVCORE_KERNEL", "").strip()
    cands = _candidates(device_type, format_name)
    if forced:
        for k in cands:
            if k.name == forced:
                if not k.available():
                    raise TransferError(f"KVCORE_KERNEL={forced} is not available here: {k.why()}")
                return k
        raise TransferError(forced_kernel_problem(forced, device_type, format_name, cands))
    for k in cands:
        ok = getattr(k, "accepts", None)
        sup = getattr(k, "supports", None)
        if table is not None and sup is not None and not sup(table):
            continue
        if k.available() and (ok is None or ok(staging_device_type)):
            return _bound(k, lambda: select_kernel(device_type, format_name, staging_device_type, table))
    raise TransferError(f"no transfer kernel serves device type {device_type!r}")


def _bound(k, reselect):
    """A plugin's kernel with the selection that chose it, so a transfer it fails is redone
    by the next kernel (:class:`kvcore.registry.BoundKernel`); the core's kernels as they are."""

    return BoundKernel(k, reselect) if isinstance(k, _GuardedKernel) else k


def forced_kernel_problem(forced: str, device_type: str, format_name: str, cands=None) -> str:
    """Why ``KVCORE_KERNEL=forced`` cannot serve ``format_name`` on ``device_type``: no
    kernel of that name is registered (listing those that are, and the plugins disabled or
    failed to load, one of which may provide it), or the kernel does not claim the device
    type or the format."""

    every = registry.kernels()
    named = [k for k in every if k.name == forced]
    if not named:
        registered = ", ".join(sorted({k.name for k in every})) or "none"
        msg = f"KVCORE_KERNEL={forced}: no kernel of that name is registered (registered kernels: {registered})"
        off = registry.disabled_plugins()
        failed = sorted(i.name for i in registry.plugins() if i.error)
        if off:
            msg += f"; disabled plugins (KVCORE_DISABLE_PLUGINS / kvcore.disable_plugins): {', '.join(off)}"
        if failed:
            msg += f"; plugins that failed to load: {', '.join(failed)}"
        if off or failed:
            msg += " -- the kernel's plugin may be one of them"
        return msg + ". Unset KVCORE_KERNEL to let kvcore choose, or name a registered kernel"
    k = named[0]
    if device_type not in tuple(k.device_types):
        return (
            f"KVCORE_KERNEL={forced} does not serve device type {device_type!r} (it claims {', '.join(k.device_types)}); kernels "
            f"that serve {format_name or 'this format'} on {device_type}: {', '.join(c.name for c in (cands or [])) or 'none'}"
        )
    return (
        f"KVCORE_KERNEL={forced} does not serve format {format_name} (it moves {', '.join(k.formats or [])} only); kernels "
        f"that serve it on {device_type}: {', '.join(c.name for c in (cands or [])) or 'none'}"
    )


def kernel_report() -> list[dict]:
    """For ``kvcore doctor``: every registered kernel, whether it is available and why."""

    rows = []
    for k in sorted(registry.kernels(), key=lambda k: (tuple(k.device_types), -int(k.priority))):
        rows.append(
            {
                "name": k.name,
                "device_types": list(k.device_types),
                "formats": "all" if k.formats is None else list(k.formats),
                "priority": int(k.priority),
                "available": bool(k.available()),
                "why": k.why(),
            }
        )
    return rows


# -- safety checks every kernel runs before it writes --------------------------------------


def check_storages(table: StrideTable) -> None:
    """Refuse a transfer whose cache storage changed since the table was built (detection):
    every (layer, plane)'s storage must be the same storage, at the same address, of the
    same size. An engine that frees or re-creates its KV cache (sleep mode) needs a new
    :func:`kvcore.detect`. Every kernel (the reference kernel, the native ones, a plugin's
    through this function) runs it over every plane and layer before any write.

    A storage freed and re-created **at the very same address with the same size** (the
    allocator handing the freed block back) cannot be told from the original: torch exposes
    no allocation generation. The transfer then moves the tensor's current bytes -- its own
    memory, so nothing outside the cache is touched -- and the values are whatever the
    engine wrote since; detect again after re-creating a cache.

    Raises:
        TransferError: naming the (layer, plane), the size and address then and now.
    """
    snap = {c: (ptr, n) for c, ptr, n in table.snapshot}
    for p in table.planes:
        for li, (t, _) in enumerate(p.bases):
            if t.device.type == "meta":
                continue
            st = t.untyped_storage()
            want = snap.get(st._cdata)
            ptr, n = st.data_ptr(), st.nbytes()
            if want is None or want != (ptr, n):
                how = "replaced" if want is None else ("freed" if n == 0 else "reallocated or resized")
                then = "" if want is None else f"{want[1]} bytes at {want[0]:#x}, "
                raise TransferError(
                    f"the storage of layer {li} plane {p.role} was {how} after the layout was detected ({then}now {n} bytes at "
                    f"{ptr:#x}); nothing was moved. Detect the cache again"
                )
    check_tensor_states(table)


def check_tensor_states(table: StrideTable) -> None:
    """Refuse a transfer once a tensor the table addresses changed in place since the table
    was built (its shape, strides or storage offset: ``resize_``, ``as_strided_``, ``set_``
    onto the same storage), or the tensor it is a view of (normally the caller's own, e.g.
    a detector's ``view(dtype)`` of it) was re-pointed to other memory (``set_``,
    ``.data =``) or reshaped in place: the layout no longer describes the caller's tensors,
    and a write would land in memory the caller's tensor no longer shows (see
    :class:`~kvcore.spec.TensorState`). :func:`check_storages` runs it.

    Then every caller's tensor the table records (:attr:`~kvcore.spec.StrideTable.callers`:
    what was passed to :func:`kvcore.detect` and friends, often a view itself, e.g. vLLM's
    per-layer views of one buffer): its storage (``StorageImpl``, address, size) and its
    shape, strides and offset must be as recorded; re-pointing it (``set_``, ``.data =``,
    ``resize_``) leaves kvcore's own views and their base untouched, so only this sees it.

    Not seen: a tensor neither passed by the caller nor held or viewed by the table, and
    memory freed under an unchanged storage (an engine unmapping it).

    Raises:
        TransferError: naming the (layer, plane), what changed, then and now.
    """
    states = table.tensor_states
    seen = set()
    for p in table.planes:
        for li, (t, _) in enumerate(p.bases):
            k = id(t)
            if k in seen:
                continue
            seen.add(k)
            st = states.get(k)
            if st is None or st.tensor is not t:
                continue
            why = st.problem()
            if why is not None:
                raise TransferError(f"the tensor of layer {li} plane {p.role} {why}; nothing was moved. Detect the cache again")
    for label, st in table.callers:
        why = caller_problem(st)
        if why is not None:
            raise TransferError(f"the caller's tensor {label} {why}; nothing was moved. Detect the cache again")


def guard_rows(tables: Sequence[tuple[str, StrideTable]]) -> tuple[list[torch.Tensor], list[str], torch.Tensor]:
    """The C++ plans' guard (``TensorGuard``, ``csrc/kvcore_ops.h``) for ``(label prefix,
    table)`` pairs: every distinct tensor the tables address with its storage and geometry
    as the table recorded them, every tensor such a tensor is a view of with the view's
    storage and its own geometry, and every caller's tensor the tables record
    (:attr:`~kvcore.spec.StrideTable.callers`) with its storage and geometry. One row per
    tensor object (deduplicated across tables). Returns ``(tensors, labels, snapshot)``, the snapshot
    int64 ``[N, 4 + 2 * D]``: ptr, nbytes, storage_offset, ndim, sizes, strides (padded).

    Call after :func:`check_storages` (the recorded state is then the current one)."""
    rows: list[tuple[torch.Tensor, str, int, int, tuple]] = []
    seen: set[int] = set()
    for prefix, table in tables:
        states = table.tensor_states
        snap = {c: (ptr, n) for c, ptr, n in table.snapshot}
        for p in table.planes:
            for li, (t, _) in enumerate(p.bases):
                if t.device.type == "meta" or id(t) in seen:
                    continue
                seen.add(id(t))
                label = f"{prefix}layer {li} plane {p.role}"
                st = states.get(id(t))
                if st is None or st.tensor is not t:  # a table built without states: the storage only
                    ptr, n = snap.get(t.untyped_storage()._cdata, (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
                    rows.append((t, label, ptr, n, None))
                    continue
                _, ptr, n = st.storage
                rows.append((t, label, ptr, n, st.geometry))
                b = st.base
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    rows.append((b, f"the tensor that {label} views (the caller's tensor)", ptr, n, st.base_geometry))
        for label, st in table.callers:  # the caller's own tensors (often views themselves): after the planes'
            t = st.tensor
            if id(t) in seen:
                continue
            seen.add(id(t))
            _, ptr, n = st.storage
            rows.append((t, f"{prefix}the caller's tensor {label}", ptr, n, st.geometry))
    dmax = max((len(g[0]) for *_, g in rows if g is not None), default=0)
    snap_rows = []
    for _, _, ptr, n, g in rows:
        if g is None:
            snap_rows.append([ptr, n, -1, -1] + [0] * (2 * dmax))
        else:
            shape, stride, off = g
            pad = [0] * (dmax - len(shape))
            snap_rows.append([ptr, n, off, len(shape), *shape, *pad, *stride, *pad])
    snapshot = torch.tensor(snap_rows, dtype=torch.int64).reshape(len(rows), 4 + 2 * dmax)
    return [r[0] for r in rows], [r[1] for r in rows], snapshot


def _self_overlapping(t: torch.Tensor) -> bool:
    axes = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    extent = 1
    for st, n in axes:
        if st < extent:
            return True
        extent = st * (n - 1) + extent
    return False


def staging_conflict(table: StrideTable, buffers: Mapping[str, torch.Tensor], what: str) -> str | None:
    """Why these staging buffers cannot be used with this table, or None: rows that share
    memory (a stride smaller than what it steps over, e.g. ``as_strided`` views), buffers
    that share memory with each other, or a buffer that shares memory with the bytes the
    cache's planes address (a view into the cache). Byte ranges, not only stride 0."""
    spans = []
    for p in table.planes:
        span = plane_span(table, p)
        for t, off in p.bases:
            if t.device.type != "meta" and span:
                base = t.untyped_storage().data_ptr() + off
                spans.append((base, base + span))
    ext = {}
    for key, b in buffers.items():
        if any(st < 0 for st in b.stride()):
            return f"{what} has a negative stride {tuple(b.stride())}"
        if _self_overlapping(b):
            return (
                f"{what} (shape {tuple(b.shape)}, strides {tuple(b.stride())}) has rows that share memory (a stride smaller than what "
                "it steps over); rows would overwrite each other: pass a buffer whose rows are distinct memory"
            )
        lo, hi = ext[key] = _extent(b)
        if lo != hi:
            for a, z in spans:
                if lo < z and a < hi:
                    return f"{what} (bytes {lo:#x}..{hi:#x}) shares memory with the KV cache; stage into a buffer of its own"
    keys = list(ext)
    for i, a in enumerate(keys):
        for b in keys[:i]:
            (l1, h1), (l2, h2) = ext[a], ext[b]
            if l1 != h1 and l2 != h2 and l1 < h2 and l2 < h1:
                return f"staging buffers {b!r} and {a!r} share memory; each plane's buffer needs its own memory"
    return None


def cpu_grain() -> int:
    """Bytes per CPU thread of a transfer: below twice this, CPU work stays on the calling
    thread (the native op library's setting, ``KVCORE_CPU_GRAIN_BYTES``; 8 MiB without it)."""

    mod = _build.MODULE
    if mod is not None and hasattr(mod, "cpu_grain"):
        return int(mod.cpu_grain())
    env = os.environ.get("KVCORE_CPU_GRAIN_BYTES", "").strip()
    return int(env) if env.isdigit() else 8 << 20


@contextlib.contextmanager
def single_threaded(device: torch.device, nbytes: int):
    """Run the block's torch CPU ops on the calling thread when ``nbytes`` is below two
    grains (:func:`cpu_grain`): on a busy host, waking the intra-op pool costs milliseconds
    per op, far more than moving a few MB. No effect for other devices or large sizes."""
    if device.type != "cpu" or nbytes >= 2 * cpu_grain() or torch.get_num_threads() <= 1:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
