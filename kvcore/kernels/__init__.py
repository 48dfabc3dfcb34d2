"""Transfer kernels: the contract, the plan they receive, and how one is chosen.

A kernel never sees a format name. It receives a :class:`TransferPlan` — the layout's
:class:`~kvcore.spec.StrideTable` for the selected layers, the slot mapping (already
validated, negative = skip) and the staging tensor — and moves bytes.

Kernels are offered by plugins through ``kvcore_register_kernels``. For a transfer the
core picks, among the kernels whose ``device_types`` include the cache's device type,
whose ``formats`` is None or names the layout's format, and whose ``available()`` is
true, the one with the highest ``priority``; the torch reference kernel (priority 0)
answers what no other claims. ``KVCORE_KERNEL=name`` forces one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvcore.errors import TransferError
from kvcore.spec import StrideTable

__all__ = ["TransferKernel", "TransferPlan", "select_kernel", "kernel_report"]


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
    from kvcore import registry

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
        names = ", ".join(k.name for k in cands) or "none"
        raise TransferError(f"KVCORE_KERNEL={forced} does not serve {format_name} on {device_type}; kernels that do: {names}")
    for k in cands:
        ok = getattr(k, "accepts", None)
        sup = getattr(k, "supports", None)
        if table is not None and sup is not None and not sup(table):
            continue
        if k.available() and (ok is None or ok(staging_device_type)):
            return k
    raise TransferError(f"no transfer kernel serves device type {device_type!r}")


def kernel_report() -> list[dict]:
    """For ``kvcore doctor``: every registered kernel, whether it is available and why."""
    from kvcore import registry

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
