"""The stride table: every byte address a transfer kernel needs, and nothing about format names.

The one idea: in almost every layout the ``HS`` elements of one (layer, K/V, token,
head) are one contiguous run, so a token row is addressed by a base per (layer, K/V)
and the byte strides of block, token-in-block and head. Layouts that split a head into
chunks add one level, ``chunk``. Everything is in **bytes**, so the element dtype is
metadata. :class:`kvcore.spec.Spec` builds a :class:`StrideTable` from a format and the
tensors; kernels (:mod:`kvcore.kernels`) read it. This module also keeps the record of
the caller's own tensors (:func:`record_callers`) that every transfer re-checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from kvcore.errors import GeometryError

__all__ = [
    "PlaneStrides",
    "Plane",
    "StagingTarget",
    "StagingBuffer",
    "StrideTable",
    "TensorState",
    "caller_problem",
    "record_callers",
    "classic_table",
    "plane_address",
    "plane_span",
]


@dataclass(frozen=True)
class PlaneStrides:
    """The cache-side address pattern of one plane, in bytes.

    The bytes of (slot, head, chunk, sub) start at
    ``base + (slot // block_size) * block + token_offset(slot % block_size) + head * head
    + chunk * chunk + sub * sub`` and run ``chunk_bytes``; a head's ``n_chunks * n_sub`` runs,
    in (chunk, sub) order, are its staged bytes. ``token_offset(t) = t * token`` unless the
    block's tokens are split in groups (``BSC``/``BSE``: ``token_group`` tokens per group),
    then ``(t // token_group) * token_group_stride + (t % token_group) * token``.

    ``n_sub > 1`` is a second strided level of a head's elements: the elements inside a chunk
    are not contiguous (vLLM CPU's AMX V tile: a token's 16 elements of a chunk two elements
    apart, the chunks ``16 * block_size`` elements apart). Kernels that address a chunk as
    one run refuse such planes (:attr:`sub_runs`).
    """

    block: int
    token: int
    head: int
    chunk: int
    chunk_bytes: int
    n_chunks: int
    token_group: int = 0
    token_group_stride: int = 0
    sub: int = 0
    n_sub: int = 1

    @property
    def run_bytes(self) -> int:
        """Bytes of one head (``chunk_bytes * n_sub * n_chunks``)."""
        return self.chunk_bytes * self.n_sub * self.n_chunks

    @property
    def sub_runs(self) -> bool:
        """True when a chunk is several strided runs (``n_sub > 1``)."""
        return self.n_sub > 1

    @property
    def head_span(self) -> int:
        """Bytes from a head's first byte to one past its last."""
        return (self.n_chunks - 1) * self.chunk + (self.n_sub - 1) * self.sub + self.chunk_bytes

    @property
    def row_contiguous(self) -> bool:
        """True when a whole token row (all heads) is one contiguous run (given
        ``head == run_bytes``; a single head is contiguous whenever it is one chunk)."""
        return self.n_chunks == 1 and self.n_sub == 1 and self.head == self.run_bytes

    def max_token_offset(self, last: int) -> int:
        """The largest :meth:`token_offset` over tokens ``0..last`` (strides are >= 0)."""
        cands = {0, last}
        if self.token_group and last >= self.token_group:
            cands.add((last // self.token_group) * self.token_group - 1)
        return max(self.token_offset(t) for t in cands)

    def token_offset(self, t: int) -> int:
        """Byte offset of token ``t`` (0 <= t < block_size) inside its block."""
        if self.token_group:
            return (t // self.token_group) * self.token_group_stride + (t % self.token_group) * self.token
        return t * self.token


@dataclass(frozen=True)
class StagingTarget:
    """Where one plane's bytes go in the staging buffers.

    Attributes:
        buffer: key of the staging buffer (:attr:`StagingBuffer.key`): ``"kv"`` for the
            classic ``[kv_size, NL, T, row]`` buffer, else the plane's role.
        index: the plane's position on the classic buffer's leading K/V axis; None for a
            per-plane buffer ``[NL, T, row]``.
        offset: byte offset of the plane's first head inside a staged row.
        head_stride: bytes between consecutive heads inside a staged row (equal to the
            plane's ``head_bytes`` unless several planes interleave per head in one row).
    """

    buffer: str
    index: int | None
    offset: int
    head_stride: int


@dataclass(frozen=True)
class StagingBuffer:
    """One staging buffer of a transfer.

    Attributes:
        key: ``"kv"`` (the classic buffer) or a plane role.
        kv_size: the leading K/V axis of the classic buffer; None for per-plane buffers.
        row_bytes: bytes of one token's staged row.
        dtype: the buffer's element dtype (``row_bytes`` is a whole number of them).
    """

    key: str
    kv_size: int | None
    row_bytes: int
    dtype: torch.dtype

    @property
    def row_elems(self) -> int:
        return self.row_bytes // torch.empty(0, dtype=self.dtype).element_size()

    def shape(self, num_layers: int, num_tokens: int) -> tuple[int, ...]:
        """``[kv_size, NL, T, row]`` for the classic buffer, ``[NL, T, row]`` for a plane's."""
        if self.kv_size is None:
            return (num_layers, num_tokens, self.row_elems)
        return (self.kv_size, num_layers, num_tokens, self.row_elems)


@dataclass(frozen=True)
class Plane:
    """One plane of a record: its cache-side address pattern, its size per token, its
    bases per layer and where it is staged.

    Attributes:
        role: ``"K"``, ``"V"``, ``"KV"`` (an MLA latent), or a multi-plane role
            (``"KS"``, ``"VZ"``, ...; blocked-scale records: ``"VALS"``, ``"SCALES"``).
        strides: the :class:`PlaneStrides` (bytes).
        num_heads: heads per token on this plane (1 where the plane has no head axis).
        head_bytes: bytes of one head's run (``strides.run_bytes``).
        dtype: the plane's element dtype.
        bases: per layer ``(tensor, byte_offset)``: the plane starts ``byte_offset`` bytes
            into that tensor's storage.
        staging: the plane's :class:`StagingTarget`.
    """

    role: str
    strides: PlaneStrides
    num_heads: int
    head_bytes: int
    dtype: torch.dtype
    bases: tuple[tuple[torch.Tensor, int], ...]
    staging: StagingTarget

    # the address pattern, read through (tests and kernels read ``plane.block`` etc.)
    @property
    def block(self) -> int:
        return self.strides.block

    @property
    def token(self) -> int:
        return self.strides.token

    @property
    def head(self) -> int:
        return self.strides.head

    @property
    def chunk(self) -> int:
        return self.strides.chunk

    @property
    def chunk_bytes(self) -> int:
        return self.strides.chunk_bytes

    @property
    def n_chunks(self) -> int:
        return self.strides.n_chunks

    @property
    def row_bytes(self) -> int:
        """Cache bytes of one token on this plane (all heads)."""
        return self.num_heads * self.head_bytes

    @property
    def row_contiguous(self) -> bool:
        """True when a whole token row of this plane (all heads) is one contiguous run."""
        s = self.strides
        return s.n_chunks == 1 and s.n_sub == 1 and (self.num_heads == 1 or s.head == self.head_bytes)


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset())


@dataclass(frozen=True)
class TensorState:
    """One tensor a stride table addresses, as it was when the table was built.

    Attributes:
        tensor: the tensor (the table holds it anyway).
        geometry: ``(shape, strides, storage_offset)`` (elements).
        storage: ``(storage id, data_ptr, nbytes)`` of its storage.
        base: for a view (``tensor._base``: the tensor it was made from, normally the
            caller's own), that tensor, else None. A view keeps its memory alive even when
            the caller re-points the tensor it views to other memory (``set_``, ``.data =``),
            so a transfer compares this tensor's storage with the view's.
        base_geometry: ``base``'s ``(shape, strides, storage_offset)``.
    """

    tensor: torch.Tensor
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    storage: tuple[int, int, int]
    base: torch.Tensor | None = None
    base_geometry: tuple[tuple[int, ...], tuple[int, ...], int] | None = None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorState:
        st = t.untyped_storage()
        b = t._base
        if b is not None and b.untyped_storage()._cdata != st._cdata:
            b = None  # not a plain view of one storage: nothing to compare
        return cls(t, _geometry(t), (st._cdata, st.data_ptr(), st.nbytes()), b, None if b is None else _geometry(b))

    def problem(self) -> str | None:
        """What changed since the table was built, or None: the tensor's shape, strides or
        offset, or the storage of the tensor it views (its own storage is
        :func:`kvcore.kernels.check_storages`'s first check)."""
        now = _geometry(self.tensor)
        if now != self.geometry:
            return (
                f"changed shape, strides or offset in place since the layout was detected (was {_geo_text(self.geometry)}, "
                f"now {_geo_text(now)})"
            )
        b = self.base
        if b is not None:
            bst = b.untyped_storage()
            if bst._cdata != self.storage[0]:
                return (
                    "is a view of a tensor (normally the caller's) that was re-pointed to other memory since the layout was "
                    f"detected (set_, .data =; now {bst.nbytes()} bytes at {bst.data_ptr():#x}): kvcore's view still holds the "
                    f"old memory ({self.storage[2]} bytes at {self.storage[1]:#x}), which that tensor no longer shows"
                )
            bnow = _geometry(b)
            if bnow != self.base_geometry:
                return (
                    "is a view of a tensor (normally the caller's) that changed shape, strides or offset in place since the "
                    f"layout was detected (was {_geo_text(self.base_geometry)}, now {_geo_text(bnow)})"
                )
        return None


def _geo_text(g) -> str:
    return f"shape {list(g[0])} stride {list(g[1])} offset {g[2]}"


def caller_problem(state: TensorState) -> str | None:
    """What changed in a caller's tensor (:attr:`StrideTable.callers`) since the layout was
    built, or None: its storage (another ``StorageImpl``, address or size: ``set_``,
    ``.data =``, a ``resize_`` that grew it, ``untyped_storage().resize_(0)``), then its
    shape, strides or storage offset (``resize_``, ``as_strided_``, ``transpose_``,
    ``set_`` onto the same storage at another offset)."""
    t = state.tensor
    st = t.untyped_storage()
    cdata, ptr, nbytes = state.storage
    if st._cdata != cdata or st.data_ptr() != ptr or st.nbytes() != nbytes:
        how = (
            "re-pointed to other memory (set_, .data =)"
            if st._cdata != cdata
            else ("freed" if st.nbytes() == 0 else "reallocated or resized")
        )
        return (
            f"was {how} since the layout was detected (was {nbytes} bytes at {ptr:#x}, now {st.nbytes()} bytes at "
            f"{st.data_ptr():#x}): kvcore's views still address the old memory, which that tensor no longer shows"
        )
    now = _geometry(t)
    if now != state.geometry:
        return (
            "changed shape, strides or offset in place since the layout was detected (resize_, as_strided_, transpose_, "
            f"set_; was {_geo_text(state.geometry)}, now {_geo_text(now)}): the layout no longer describes it"
        )
    return None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of the elements ``t`` shows ((0, 0) when it shows none)."""
    if t.numel() == 0:
        return (0, 0)
    esz = t.element_size()
    lo = t.data_ptr()
    return lo, lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * esz + esz


def record_callers(table: StrideTable, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Record the caller's own tensors ``(path, tensor)`` in ``table.callers`` (in place;
    tables derived later keep them), so every transfer compares their storage and geometry
    with what they were (:func:`kvcore.kernels.check_storages`, the C++ guard's rows from
    :func:`kvcore.kernels.guard_rows`) and refuses once the caller re-pointed or reshaped one.

    A plane tensor's base (:attr:`TensorState.base`) that a recorded caller's tensor is
    itself a view of is no longer compared: the caller's tensor is.

    Kept: tensors on a storage the planes address whose bytes overlap a (layer, plane)'s
    addressed bytes (the label names the first such (layer, plane)); not kept: a plane's own
    tensor (already guarded), tensors holding none of the table's bytes (another group's
    layers, a Mamba state), meta or non-strided tensors, repeats of one object.
    """
    ranges: dict[int, list[tuple[int, int, int, str]]] = {}
    own: set[int] = set()
    for p in table.planes:
        span = max(plane_span(table, p), 1)
        for li, (t, off) in enumerate(p.bases):
            own.add(id(t))
            if t.device.type == "meta":
                continue
            st = t.untyped_storage()
            lo = st.data_ptr() + off
            ranges.setdefault(st._cdata, []).append((lo, lo + span, li, p.role))
    callers = list(table.callers)
    seen = own | {id(s.tensor) for _, s in callers}
    for where, t in tensors:
        if id(t) in seen or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        if getattr(t, "is_nested", False) or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        rs = ranges.get(st._cdata)
        if not rs:
            continue
        lo, hi = _extent(t)
        hit = next(((li, role) for a, b, li, role in rs if a < hi and lo < b), None)
        if hit is None:
            continue
        seen.add(id(t))
        state = TensorState(t, _geometry(t), (st._cdata, st.data_ptr(), st.nbytes()))
        callers.append((f"{where} (layer {hit[0]} plane {hit[1]})", state))
    object.__setattr__(table, "callers", tuple(callers))
    # A plane tensor's base that a caller's tensor is itself a view of (vLLM: the flat buffer
    # the caller's per-layer views are cut from) is no longer compared: the caller's own
    # tensor is, and re-pointing that buffer changes neither it nor kvcore's views. This
    # keeps the per-call guard at one row per plane tensor and per caller's tensor.
    under = {id(s.tensor._base) for _, s in callers if s.tensor._base is not None}
    under -= {id(t) for _, t in tensors}  # a tensor the caller passed itself stays compared
    states = table.tensor_states
    for k, st in list(states.items()):
        if st.base is not None and id(st.base) in under:
            states[k] = replace(st, base=None, base_geometry=None)


@dataclass(frozen=True)
class StrideTable:
    """Everything a transfer kernel needs, and nothing about format names.

    A token's record is one or more :class:`Plane` s (K and V; an MLA latent; a blocked
    record's values and scales; quantised values with their scales and zeros...), each
    with its own bases, strides, heads, width and dtype, all addressed by one slot
    mapping. Each plane is staged into one of :attr:`buffers`.

    Attributes:
        num_layers: layers in this table (a layer subset keeps its order).
        block_size: tokens per block; a slot ``s`` is block ``s // block_size``, offset
            ``s % block_size`` (1 for fused NBBS axes).
        num_slots: valid slots are ``0 <= s < num_slots``.
        device: the cache's device.
        planes: the record's planes, in staging order.
        buffers: the staging buffers the planes fill (classic layouts: one, ``"kv"``).
        snapshot: every distinct storage the table addresses, as it was when the table was
            built (at detection): ``(storage id, data_ptr, nbytes)``. A layer subset keeps
            its parent's snapshot. Transfers refuse to run once a storage was freed,
            reallocated, resized or replaced since (:func:`kvcore.kernels.check_storages`).
        tensor_states: ``{id(tensor): TensorState}`` for every tensor the planes address,
            as it was when the table was built: its shape, strides and storage offset (the
            geometry was read from them) and, for a view, the tensor it views (normally
            the caller's own tensor) with that tensor's shape, strides and offset. A
            transfer refuses to run once a tensor changed in place (``resize_``,
            ``as_strided_``, ``set_``) or the tensor it views was re-pointed to other
            memory (:func:`kvcore.kernels.check_storages`). Derived tables keep their
            parent's.
        callers: ``(label, TensorState)`` for each of the caller's own tensors (what was
            passed to :func:`kvcore.detect`, :func:`kvcore.detect_per_layer` or
            :func:`kvcore.build_layout`) that holds bytes the planes address and is not
            itself a plane's tensor, recorded by :func:`record_callers`: its storage
            (``StorageImpl``, address, size) and geometry as they were. A caller's tensor
            is often a view itself (vLLM's per-layer caches are views of one buffer), so
            re-pointing it (``set_``, ``.data =``, ``resize_``) changes neither kvcore's
            views nor the buffer they view; only this record sees it. The label names the
            tensor's path and the (layer, plane) it holds. Derived tables keep their
            parent's.
    """

    num_layers: int
    block_size: int
    num_slots: int
    device: torch.device
    planes: tuple[Plane, ...]
    buffers: tuple[StagingBuffer, ...]
    snapshot: tuple[tuple[int, int, int], ...] = field(default=(), compare=False, repr=False)
    tensor_states: Mapping[int, TensorState] = field(default_factory=dict, compare=False, repr=False)
    callers: tuple[tuple[str, TensorState], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.snapshot:
            snap = []
            seen = set()
            for p in self.planes:
                for t, _ in p.bases:
                    if t.device.type == "meta":
                        continue
                    st = t.untyped_storage()
                    if st._cdata not in seen:
                        seen.add(st._cdata)
                        snap.append((st._cdata, st.data_ptr(), st.nbytes()))
            object.__setattr__(self, "snapshot", tuple(snap))
        if not self.tensor_states:
            states = {}
            for p in self.planes:
                for t, _ in p.bases:
                    if t.device.type != "meta" and id(t) not in states:
                        states[id(t)] = TensorState.of(t)
            object.__setattr__(self, "tensor_states", states)

    # -- the classic view (one "kv" buffer) ---------------------------------------------
    @property
    def classic(self) -> bool:
        """One ``"kv"`` buffer whose every K/V slot is exactly one plane's whole row, all
        planes with one head count, head width and dtype, no token groups: the layout
        the first-generation kernels move (``[kv_size, NL, T, NH*HS]``)."""
        if len(self.buffers) != 1 or self.buffers[0].key != "kv" or self.buffers[0].kv_size != len(self.planes):
            return False
        p0 = self.planes[0]
        return all(
            p.staging.index == i
            and p.staging.offset == 0
            and p.staging.head_stride == p.head_bytes
            and p.num_heads == p0.num_heads
            and p.head_bytes == p0.head_bytes
            and p.dtype == p0.dtype
            and not p.strides.token_group
            for i, p in enumerate(self.planes)
        )

    @property
    def kv_size(self) -> int:
        """The classic buffer's K/V count (2 or 1), else the number of planes."""
        b = self.buffers[0]
        return b.kv_size if (len(self.buffers) == 1 and b.kv_size is not None) else len(self.planes)

    @property
    def num_heads(self) -> int:
        return self.planes[0].num_heads

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's staged row in the first buffer (``row_bytes / num_heads``)."""
        return self.buffers[0].row_bytes // self.planes[0].num_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers[0].dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row in the first staging buffer."""
        return self.buffers[0].row_bytes

    @property
    def bases(self) -> tuple[tuple[tuple[torch.Tensor, int], ...], ...]:
        """``bases[layer][plane] = (tensor, byte_offset)``."""
        return tuple(tuple(p.bases[li] for p in self.planes) for li in range(self.num_layers))

    def buffer(self, key: str) -> StagingBuffer:
        for b in self.buffers:
            if b.key == key:
                return b
        raise KeyError(key)

    def ptrs(self) -> torch.Tensor:
        """int64 ``[num_layers, num_planes]`` plane base addresses (bytes), on the CPU."""
        return torch.tensor(
            [[t.untyped_storage().data_ptr() + off for (t, off) in layer] for layer in self.bases],
            dtype=torch.int64,
        ).reshape(self.num_layers, len(self.planes))

    def storages(self) -> list[tuple[torch.Tensor, int, int]]:
        """Every distinct storage the table addresses: ``(a tensor on it, data_ptr, nbytes)``
        as they are now (a transfer compares them again before writing)."""
        seen: dict[int | tuple, tuple[torch.Tensor, int, int]] = {}
        for p in self.planes:
            for t, _ in p.bases:
                st = t.untyped_storage()
                key = st._cdata if t.device.type == "meta" else st.data_ptr()
                if key not in seen:
                    seen[key] = (t, st.data_ptr(), st.nbytes())
        return list(seen.values())

    def subset(self, layers: Sequence[int]) -> StrideTable:
        return replace(
            self,
            num_layers=len(layers),
            planes=tuple(replace(p, bases=tuple(p.bases[i] for i in layers)) for p in self.planes),
        )

    def select_heads(self, start: int, stop: int) -> StrideTable:
        """The table of heads ``start .. stop-1`` only (a tensor-parallel slice of the KV heads).

        A derived table, no copy: every plane's bases move ``start * head`` bytes and its
        ``num_heads`` becomes ``stop - start``; strides are unchanged. Staged rows shrink to
        the selected heads (a plane's heads keep their ``offset`` and ``head_stride`` inside
        the row, so interleaved planes stay interleaved). ``(0, num_heads)`` returns ``self``.

        Raises:
            GeometryError: ``start``/``stop`` are not integers with ``0 <= start < stop``, a
                plane has fewer than ``stop`` heads (an MLA latent has one head: it is moved
                whole), or a staging buffer holds planes of different head counts or head
                strides (their rows cannot shrink by whole heads).
        """
        for v in (start, stop):
            if isinstance(v, bool) or not isinstance(v, int):
                raise GeometryError(f"a head range is two integers (start, stop), got ({start!r}, {stop!r})")
        if not 0 <= start < stop:
            raise GeometryError(f"head range ({start}, {stop}) is empty or negative; it needs 0 <= start < stop")
        if start == 0 and all(p.num_heads == stop for p in self.planes):
            return self
        for p in self.planes:
            if p.num_heads < stop:
                raise GeometryError(
                    f"head range ({start}, {stop}) reaches past plane {p.role}, which has {p.num_heads} head(s) "
                    f"(valid ranges lie in 0..{p.num_heads})"
                )
        n = stop - start
        buffers = []
        for b in self.buffers:
            staged = [p for p in self.planes if p.staging.buffer == b.key]
            kinds = {(p.num_heads, p.staging.head_stride) for p in staged}
            if len(kinds) != 1:
                raise GeometryError(
                    f"staging buffer {b.key!r} holds planes of different head counts or head strides "
                    f"({', '.join(f'{p.role}: {p.num_heads} x {p.staging.head_stride} B' for p in staged)}); "
                    "its rows cannot shrink to a head range"
                )
            nh, hstride = kinds.pop()
            buffers.append(replace(b, row_bytes=b.row_bytes - (nh - n) * hstride))
        planes = tuple(replace(p, num_heads=n, bases=tuple((t, off + start * p.strides.head) for t, off in p.bases)) for p in self.planes)
        return replace(self, planes=planes, buffers=tuple(buffers))

    def signature(self) -> tuple:
        """What fixes the mapping (layer, plane, slot, head, byte) → memory address: two
        tables with one signature move the same bytes. The stride of an axis of extent 1
        (one head, one token per block, one block, one chunk) addresses nothing, so it is
        left out: ``[NB, BS, 1, HS]`` read as NHD or as HND is one answer."""
        one_token = self.block_size == 1
        one_block = self.num_slots <= self.block_size

        def norm(p: Plane) -> tuple:
            s = p.strides
            grouped = bool(s.token_group) and s.token_group < self.block_size
            return (
                p.num_heads,
                p.head_bytes,
                p.dtype,
                p.staging,
                replace(
                    s,
                    block=0 if one_block else s.block,
                    token=0 if one_token or (grouped and s.token_group == 1) else s.token,
                    head=0 if p.num_heads == 1 else s.head,
                    chunk=0 if s.n_chunks == 1 else s.chunk,
                    sub=0 if s.n_sub == 1 else s.sub,
                    token_group=s.token_group if grouped else 0,
                    token_group_stride=s.token_group_stride if grouped else 0,
                ),
            )

        return (
            self.num_layers,
            self.block_size,
            self.num_slots,
            tuple(self.buffers),
            tuple(norm(p) for p in self.planes),
            tuple(tuple(plane_address(t, off) for (t, off) in p.bases) for p in self.planes),
        )


def classic_table(
    *,
    num_layers: int,
    kv_size: int,
    block_size: int,
    num_slots: int,
    num_heads: int,
    head_bytes: int,
    dtype: torch.dtype,
    device: torch.device,
    strides: Sequence[PlaneStrides],
    bases: Sequence[Sequence[tuple[torch.Tensor, int]]],
    roles: Sequence[str] | None = None,
) -> StrideTable:
    """A table of the classic shape: ``kv_size`` planes (K, V; or one latent / key plane)
    of one head count, width and dtype, staged ``[kv_size, NL, T, NH*HS]``.

    Args:
        strides: one :class:`PlaneStrides` per K/V plane (K and V may differ: a chunked K
            beside a transposed V).
        bases: ``bases[layer][kv] = (tensor, byte_offset)``.
        roles: plane roles (default ``("K", "V")``, or ``("K",)`` for kv_size 1).
    """
    roles = tuple(roles) if roles is not None else (("K", "V") if kv_size == 2 else ("K",))
    planes = tuple(
        Plane(
            role=roles[kv],
            strides=strides[kv],
            num_heads=num_heads,
            head_bytes=head_bytes,
            dtype=dtype,
            bases=tuple(tuple(layer)[kv] for layer in bases),
            staging=StagingTarget(buffer="kv", index=kv, offset=0, head_stride=head_bytes),
        )
        for kv in range(kv_size)
    )
    return StrideTable(
        num_layers=num_layers,
        block_size=block_size,
        num_slots=num_slots,
        device=device,
        planes=planes,
        buffers=(StagingBuffer(key="kv", kv_size=kv_size, row_bytes=num_heads * head_bytes, dtype=dtype),),
    )


def plane_address(t: torch.Tensor, byte_offset: int) -> int | tuple:
    """Where a plane starts, for comparing planes: the address ``storage.data_ptr() + offset``;
    for ``meta`` tensors, whose storages all have address 0, ``("meta", storage id, offset)``
    so that distinct meta storages (``kvcore detect`` builds tensors from a description on
    ``meta``) are not mistaken for one memory."""
    st = t.untyped_storage()
    if t.device.type == "meta":
        return ("meta", st._cdata, byte_offset)
    return st.data_ptr() + byte_offset


def plane_span(table: StrideTable, p) -> int:
    """Bytes from a plane's base (per layer) to the end of the last byte it addresses."""
    s = p.strides
    nblocks = -(-table.num_slots // table.block_size)
    last_tok = min(table.block_size, table.num_slots) - 1
    if nblocks <= 0 or last_tok < 0:
        return 0
    return (nblocks - 1) * s.block + s.max_token_offset(last_tok) + (p.num_heads - 1) * s.head + s.head_span
