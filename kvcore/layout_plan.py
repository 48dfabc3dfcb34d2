"""Reusable transfer plans: the per-call work of :func:`kvcore.gather` / :func:`kvcore.scatter`
done once per (layout, layers).

``kvcore.plan(layout, layers)`` resolves the layer selection, the stride table, the kernel
and (native kernels) the prepared native plan once; its :meth:`LayoutPlan.gather` and
:meth:`LayoutPlan.scatter` then only check their arguments and launch. ``kvcore.gather``
and ``kvcore.scatter`` keep one plan per (layout, layers) and use it, so the module
functions run at the same speed.

Validation (``validate=``):

- ``"device"`` (the default): on a CUDA cache, slot range and (scatter) repeated slots are
  checked **on the GPU**, in a one-block check kernel launched before the transfer on the
  same stream; the host never waits. A refused call writes nothing (the transfer kernel
  reads the check's verdict before its first store) and its :class:`~kvcore.TransferError`
  surfaces at the next kvcore CUDA transfer that starts after the GPU ran the refused call
  (that call raises instead of running, and moves nothing), or at
  :func:`kvcore.synchronize`, whichever comes first. A call whose arguments are wrong in a
  way the host can see (shape, dtype, device, layers, a stale cache) raises at once, as
  always. On a CPU cache ``"device"`` is ``"sync"``.
- ``"sync"``: as ``"device"``, then the call waits for the GPU and raises before returning
  (not allowed while capturing a CUDA graph).
- ``"none"``: no value check (for callers that validated their slot mappings); slots
  outside the cache are still never moved (skipped, as padding), but a repeated scatter
  slot is written twice in an unspecified order.

CUDA graphs: with ``"device"`` or ``"none"`` a call makes no host synchronisation and no
host-side decision that depends on slot values, so it can be captured in a
``torch.cuda.CUDAGraph`` and replayed with new values written into the same slot tensor
(warm the plan up before capturing: the first call of a plan prepares it, which uploads
its pointer table). A refusal during a replay surfaces as above.

The reference kernel and plugin kernels validate synchronously whatever ``validate`` says;
the value of ``validate`` itself is checked on every call, before a kernel is chosen (a
:class:`~kvcore.TransferError` naming the choices).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence

import torch

from kvcore import transfer_path
from kvcore.errors import TransferError
from kvcore.inputs import plain_integers
from kvcore.kernels import _build, select_kernel, single_threaded
from kvcore.kernels.native import CPU_KERNEL, CUDA_KERNEL, RC_NEG_CONJ, RC_PAGEABLE, RC_REFUSED, prepare, run_prepared, take_device_error
from kvcore.transfer_path import _block_ids, _index_tensor, _layers, _run, _scalar_layer, _write_once, slots_for_blocks

__all__ = ["LayoutPlan", "plan", "synchronize"]

_VALIDATE = {"device": 1, "sync": 2, "none": 0}
_Tensor = torch.Tensor
_INT64 = torch.int64
_STRIDED = torch.strided


def _dense(s: torch.Tensor) -> bool:
    """The fast path's test: a contiguous strided tensor whose bytes are its values (no
    lazy negation bit); anything else goes through :func:`kvcore.transfer._index_tensor`."""
    return s.layout is _STRIDED and not s.is_nested and s.is_contiguous() and not s.is_neg()


# os.environ.get costs ~1-2 us per call; the POSIX bytes mapping behind it ~0.1 us
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _forced_kernel():
    if _ENV_DATA is not None:
        return _ENV_DATA.get(b"KVCORE_KERNEL")
    return os.environ.get("KVCORE_KERNEL")


_MAX_PLANS_PER_LAYOUT = 256


class LayoutPlan:
    """Transfers of one layout's layer selection, prepared once.

    Attributes:
        layout: the :class:`~kvcore.KVLayout`.
        layers: ``None`` (all layers), a layer index (one layer: staging without the NL
            axis) or the list of layer indices (staging order follows it).
        table: the :class:`~kvcore.StrideTable` of those layers.
        kernel: the transfer kernel serving them (chosen when the plan is made).
    """

    def __init__(self, layout, layers: Sequence[int] | int | None = None):

        layers = _scalar_layer(layers)
        sel = _layers(layout, layers)
        self.layout = layout
        self.single = isinstance(layers, int)
        self.layers = layers if self.single or layers is None else list(sel)
        self._sel = sel
        self.device = layout.device
        self._cuda = self.device.type == "cuda"
        self.table = layout.stride_table(None if sel == list(range(layout.num_layers)) else sel)
        self._keys = tuple(b.key for b in self.table.buffers)
        b0 = self.table.buffers[0]
        self.classic_staging = len(self.table.buffers) == 1 and b0.key == "kv" and b0.kv_size is not None
        self.kernel = None
        self._prep = None
        # layers that share memory (layout.aliases) are scattered once, from the first of
        # them: such a selection scatters through the generic path
        self._scatter_native = _write_once(layout, sel) == [(0, len(sel))]
        if self.device.type == "meta":
            return
        try:
            self.kernel = select_kernel(self.device.type, layout.format.name, self.device.type, table=self.table)
        except TransferError:
            return  # the generic path raises it, at the call
        if self.kernel is CPU_KERNEL or self.kernel is CUDA_KERNEL:
            self._prep = prepare(self.table, self.single)

    # -- staging ----------------------------------------------------------------------------
    def staging_shapes(self, num_tokens: int) -> dict[str, tuple[int, ...]]:
        """``{buffer key: shape}`` for ``num_tokens`` tokens (one layer: no NL axis)."""
        out = {}
        for b in self.table.buffers:
            shp = b.shape(self.table.num_layers, num_tokens)
            if self.single:
                shp = shp[:-3] + shp[-2:]
            out[b.key] = tuple(shp)
        return out

    def allocate(self, num_tokens: int, *, device=None, pin_memory: bool = False):
        """Zeroed staging for ``num_tokens`` tokens: a tensor (classic staging) or a dict
        ``{role: tensor}``, on ``device`` (default: the cache's), pinned when asked."""
        dev = torch.device(device) if device is not None else self.device
        shapes = self.staging_shapes(num_tokens)
        nbytes = num_tokens * self.table.num_layers * sum(b.row_bytes * (b.kv_size or 1) for b in self.table.buffers)
        with single_threaded(dev, nbytes):  # a small zero fill on the calling thread
            out = {b.key: torch.zeros(shapes[b.key], dtype=b.dtype, device=dev, pin_memory=pin_memory) for b in self.table.buffers}
        return out["kv"] if self.classic_staging else out

    # -- transfers --------------------------------------------------------------------------
    def gather(self, slot_mapping, out=None, *, skip_prefix: int = 0, validate: str | None = None):
        """Copy the tokens at ``slot_mapping`` into staging (see :func:`kvcore.gather`).

        Returns:
            the staging buffer(s): ``out``, or a new zeroed one.
        Raises:
            TransferError: as :func:`kvcore.gather`; with ``validate="device"`` on CUDA a
                slot value error surfaces later (module docstring).
        """
        v = 1 if validate is None else self._validate(validate)  # checked whichever kernel serves
        prep = self._prep
        if prep is None:
            return self._generic(True, slot_mapping, out, skip_prefix)
        s = slot_mapping
        if s.__class__ is not _Tensor or s.dtype is not _INT64 or s.is_cuda is not self._cuda or not _dense(s):
            s = self._slots_in(s)
        if skip_prefix.__class__ is not int:
            skip_prefix = self._skip_in(skip_prefix, s)
        if out is None:
            if s.dim() != 1:
                self._slots_in(s)
            out = self.allocate(s.shape[0])
        if out.__class__ is _Tensor:
            rc = prep.plan.run1(True, s, out, skip_prefix, v)
        else:
            rc = prep.plan.run(True, s, self._staging_list(prep, True, out, skip_prefix, slot_mapping), skip_prefix, v)
        if rc:
            self._failed(prep, rc, True, s, out, skip_prefix, v, slot_mapping)
        return out

    def scatter(self, slot_mapping, src, *, skip_prefix: int = 0, validate: str | None = None) -> None:
        """Copy staged tokens into the cache at ``slot_mapping`` (see :func:`kvcore.scatter`).

        Raises:
            TransferError: as :func:`kvcore.scatter`; with ``validate="device"`` on CUDA a
                slot value error (out of range, a slot twice) surfaces later (module docstring).
        """
        if src is None:
            raise TransferError(
                "scatter needs src, a staging buffer [kv_size, NL, T, NH*HS] (per-plane staging: a dict {role: [NL, T, NH_p*HS_p]})"
            )
        v = 1 if validate is None else self._validate(validate)  # checked whichever kernel serves
        prep = self._prep
        if prep is None or not self._scatter_native:
            self._generic(False, slot_mapping, src, skip_prefix)
            return
        s = slot_mapping
        if s.__class__ is not _Tensor or s.dtype is not _INT64 or s.is_cuda is not self._cuda or not _dense(s):
            s = self._slots_in(s)
        if skip_prefix.__class__ is not int:
            skip_prefix = self._skip_in(skip_prefix, s)
        if src.__class__ is _Tensor:
            rc = prep.plan.run1(False, s, src, skip_prefix, v)
        else:
            rc = prep.plan.run(False, s, self._staging_list(prep, False, src, skip_prefix, slot_mapping), skip_prefix, v)
        if rc:
            self._failed(prep, rc, False, s, src, skip_prefix, v, slot_mapping)

    def gather_blocks(self, block_ids, out=None, *, skip_prefix: int = 0, validate: str | None = None):
        """Gather whole blocks (see :func:`kvcore.gather_blocks`). On CUDA with
        ``validate`` other than ``"sync"`` the block ids are not checked on the host: an id past
        the cache makes slots past it, refused on the device like any slot out of range."""
        if validate is not None:
            self._validate(validate)
        return self.gather(self._block_slots(block_ids, validate, skip_prefix=skip_prefix), out, skip_prefix=skip_prefix, validate=validate)

    def scatter_blocks(self, block_ids, src, *, skip_prefix: int = 0, validate: str | None = None) -> None:
        """Scatter whole blocks (the inverse of :meth:`gather_blocks`)."""
        if validate is not None:
            self._validate(validate)
        slots = self._block_slots(block_ids, validate, check_duplicates=True, skip_prefix=skip_prefix)
        self.scatter(slots, src, skip_prefix=skip_prefix, validate=validate)

    def synchronize(self) -> None:
        """:func:`kvcore.synchronize` on this plan's device."""
        synchronize(self.device)

    # -- internals --------------------------------------------------------------------------
    def _staging_list(self, prep, gather: bool, staging, skip: int, original) -> list[torch.Tensor]:
        try:
            return prep.staging_list(staging, public=True)
        except TransferError:
            self._explain(gather, original, staging, skip)
            raise

    def _failed(self, prep, rc: int, gather: bool, s: torch.Tensor, staging, skip: int, v: int, original) -> None:
        """The op declined a call before moving a byte (return code ``rc``): call it again
        the way the code says (staging with torch's negative/conjugate bit resolved;
        pageable host staging through the generic path), or raise the refusal (a stale
        storage, an earlier call's device refusal, anything else the op checks)."""
        msg = _build.MODULE.last_error()
        if rc == RC_NEG_CONJ:
            run_prepared(prep, gather, s, staging, skip, v, "")
            return
        if rc == RC_PAGEABLE:
            self._generic(gather, original, staging, skip)
            return
        if rc == RC_REFUSED:
            self._explain(gather, original, staging, skip)
        raise TransferError(msg)

    def _explain(self, gather: bool, slot_mapping, staging, skip: int) -> None:
        """Raise the Python layer's message for a call the op refused (the same checks,
        worded as every other kvcore error); returns when it finds nothing to say."""
        if isinstance(staging, Mapping) and not isinstance(staging, torch.Tensor) and self.classic_staging:
            transfer_path._check_staging(self.layout, staging, self._sel, self.single, 0, "out" if gather else "src")
        slots, _ = transfer_path._slots(self.layout, slot_mapping, skip, check_duplicates=not gather)
        t = slots.numel()
        what = "out" if gather else "src"
        if self.classic_staging:
            transfer_path._check_staging(self.layout, staging, self._sel, self.single, t, what)
        elif hasattr(transfer_path, "_check_plane_staging"):
            transfer_path._check_plane_staging(self.layout, staging, self._sel, self.single, t, what)

    def _generic(self, gather: bool, slot_mapping, staging, skip_prefix):
        return _run(self.layout, slot_mapping, staging, self.layers, skip_prefix, gather)

    def _slots_in(self, slot_mapping) -> torch.Tensor:
        s = _index_tensor(slot_mapping, "slot_mapping")
        if s.dim() != 1:
            raise TransferError(f"slot_mapping must be 1-D [T], got shape {tuple(s.shape)}")
        return s.to(device=self.device, dtype=torch.int64).contiguous()

    def _skip_in(self, skip_prefix, s: torch.Tensor) -> int:
        skip_prefix = plain_integers(skip_prefix, "skip_prefix", TransferError)
        if not isinstance(skip_prefix, bool) and hasattr(skip_prefix, "__index__"):
            try:
                skip_prefix = operator.index(skip_prefix)
            except TypeError:
                pass
        if isinstance(skip_prefix, bool) or not isinstance(skip_prefix, int) or not (0 <= skip_prefix <= s.shape[0]):
            raise TransferError(f"skip_prefix must be between 0 and the number of tokens ({s.shape[0]}), got {skip_prefix!r}")
        return skip_prefix

    def _validate(self, validate) -> int:
        v = _VALIDATE.get(validate) if isinstance(validate, str) else None
        if v is None:
            raise TransferError(
                f"validate must be one of 'device', 'sync', 'none' (or None for the default), got {validate!r}; it is checked "
                "before a kernel is chosen, whichever kernel serves the call"
            )
        return v

    def _block_slots(self, block_ids, validate, check_duplicates: bool = False, skip_prefix=0) -> torch.Tensor:
        if not (self._cuda and validate != "sync"):
            # host-validated: errors name the caller's block_ids (the first bad index), not derived slots
            dup = check_duplicates and validate != "none"
            return slots_for_blocks(self.layout, block_ids, check_duplicates=dup, skip_prefix=skip_prefix)
        bs, b = _block_ids(self.layout, block_ids)
        slots = (b[:, None] * bs + torch.arange(bs, device=b.device)[None, :]).flatten()
        return torch.where(b.repeat_interleave(bs) < 0, torch.full_like(slots, -1), slots)

    def __repr__(self) -> str:
        k = self.kernel.name if self.kernel is not None else None
        return f"LayoutPlan({self.layout.format.name}, layers={self.layers}, kernel={k}, staging={self.staging_shapes(0)})"


def plan(layout, layers: Sequence[int] | int | None = None) -> LayoutPlan:
    """A reusable plan for transfers of ``layout``'s ``layers`` (see :class:`LayoutPlan`).

    Raises:
        TransferError: a bad layer selection, or a cache storage that changed since
            detection.
    """
    return LayoutPlan(layout, layers)


def _plan_for(layout, layers) -> LayoutPlan:
    """The plan ``kvcore.gather`` / ``scatter`` use: one per (layout, layers, forced kernel)."""
    try:
        cache = layout._kvcore_plans
    except AttributeError:
        cache = layout._kvcore_plans = {}
    if layers is None or layers.__class__ is int:
        key = (layers, _forced_kernel())
    elif isinstance(layers, (list, tuple, range)):
        key = (("L", *layers), _forced_kernel())
    else:
        return LayoutPlan(layout, layers)
    p = cache.get(key)
    if p is None:
        p = LayoutPlan(layout, layers)
        if len(cache) >= _MAX_PLANS_PER_LAYOUT:
            cache.clear()
        cache[key] = p
    return p


def synchronize(device=None) -> None:
    """Wait for ``device`` (default: the current CUDA device; nothing to wait for on a CPU)
    and raise the :class:`~kvcore.TransferError` of any kvcore CUDA call refused on the
    device since the last report.

    Raises:
        TransferError: naming the refused call (gather, scatter, copy, send or recv, its
            number), the first bad slot index and value or the repeated slot, or the peer's
            refusal; that call wrote nothing. A :func:`kvcore.send` / :func:`kvcore.recv`
            still in flight past its deadline (its peer is gone): naming the unfinished
            chunk's destination slots or the token rows not delivered.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type == "cuda":
            import sys

            p2p = sys.modules.get("kvcore.distributed")
            if p2p is not None:  # transfers in flight: wait with their deadlines, raise what they left
                p2p._drain(dev)
            torch.cuda.synchronize(dev)
    msg = take_device_error()
    if msg:
        raise TransferError(msg)
