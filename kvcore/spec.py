"""Geometry and the stride table, computed from a format's grammar for any layout.

The one idea: in almost every layout the ``HS`` elements of one (layer, K/V, token,
head) are one contiguous run, so a token row is addressed by a base per (layer, K/V)
and the byte strides of block, token-in-block and head. Layouts that split a head into
chunks (vLLM's old CPU/ROCm K cache: 16-byte chunks interleaved across tokens; a
transposed V) add one level, ``chunk``. Everything is in **bytes**, so the element dtype
is metadata: fp8 stored as uint8, int8 buffer views carrying bf16 and packed K|V rows
need no special case. Padding and permuted views are only other strides.

:class:`Spec` is the generic spec: it reads axis roles from the format name and strides
from the tensors themselves. A plugin overrides it (``kvcore_spec`` hook) only for
layouts whose tokens have no single address pattern.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvcore.errors import GeometryError
from kvcore.formats import KVFormat

__all__ = ["PlaneStrides", "Plane", "StagingTarget", "StagingBuffer", "StrideTable", "Spec", "walk_leaves", "classic_table"]


@dataclass(frozen=True)
class PlaneStrides:
    """The cache-side address pattern of one plane, in bytes.

    The bytes of (slot, head, chunk) start at
    ``base + (slot // block_size) * block + token_offset(slot % block_size) + head * head
    + chunk * chunk`` and run ``chunk_bytes``; ``n_chunks * chunk_bytes`` is one head's run.
    ``token_offset(t) = t * token`` unless the block's tokens are split in groups
    (``BSC``/``BSE``: ``token_group`` tokens per group), then
    ``(t // token_group) * token_group_stride + (t % token_group) * token``.
    """

    block: int
    token: int
    head: int
    chunk: int
    chunk_bytes: int
    n_chunks: int
    token_group: int = 0
    token_group_stride: int = 0

    @property
    def run_bytes(self) -> int:
        """Bytes of one head's run (``chunk_bytes * n_chunks``)."""
        return self.chunk_bytes * self.n_chunks

    @property
    def row_contiguous(self) -> bool:
        """True when a whole token row (all heads) is one contiguous run (given
        ``head == run_bytes``; a single head is contiguous whenever it is one chunk)."""
        return self.n_chunks == 1 and self.head == self.run_bytes

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
        return s.n_chunks == 1 and (self.num_heads == 1 or s.head == self.head_bytes)


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
    """

    num_layers: int
    block_size: int
    num_slots: int
    device: torch.device
    planes: tuple[Plane, ...]
    buffers: tuple[StagingBuffer, ...]

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


def walk_leaves(node: Any, depth: int, where: str = "kv_caches") -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Flatten ``depth`` list levels into ``[(index_path, tensor), ...]`` in container order.

    Raises:
        GeometryError: a level is not a list/tuple, is empty, or a leaf is not a tensor.
    """
    if depth == 0:
        if not isinstance(node, torch.Tensor):
            raise GeometryError(f"{where} should be a torch.Tensor here, got {type(node).__name__}")
        return [((), node)]
    if not isinstance(node, (list, tuple)) or len(node) == 0:
        kind = type(node).__name__ if not isinstance(node, (list, tuple)) else "an empty list"
        raise GeometryError(f"{where} should be a non-empty list here ({depth} list level(s) left), got {kind}")
    out = []
    for i, child in enumerate(node):
        for path, t in walk_leaves(child, depth - 1, f"{where}[{i}]"):
            out.append(((i,) + path, t))
    return out


def _describe_tensor(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)} stride={tuple(t.stride())} dtype={t.dtype}"


class Spec:
    """The generic spec: geometry and stride table from a format's grammar.

    Args:
        format: the :class:`KVFormat`.
        kv_caches: a container nested exactly as the format's list levels
            (``NL_X_...``: a list of NL tensors; ``TWO_X_NL_X_...``: [K list, V list];
            ``NL_X_TWO_X_...``: NL (K, V) pairs; no list level: one tensor).
        dtype: the element dtype when the tensors are a byte view of it (vLLM 0.33's
            int8 buffers carrying bf16, fp8 stored as uint8 viewed as float8). The
            element axis (HS/CS) must then be contiguous and its byte size divisible by
            the element size. Default: the tensors' dtype.
        params: extra facts the name cannot carry: ``head_size`` (K head size of a
            packed CS axis; default CS/2).

    Raises:
        GeometryError: the container does not nest as the format says, tensors of one
            layout disagree in shape/dtype/device/strides, an axis literal is wrong
            (TWO must be 2, ONE 1), K and V head sizes differ, or the strides would make
            two addresses alias or reach past the tensor's storage.
    """

    def __init__(self, format: KVFormat, kv_caches: Any, *, dtype: torch.dtype | None = None, params: dict | None = None):
        self.format = format
        self.syntax = format.syntax
        self.kv_caches = kv_caches
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise GeometryError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
        if params is not None and not isinstance(params, dict):
            raise GeometryError(f"params must be a dict (e.g. {{'head_size': 128}}) or None, got {type(params).__name__}")
        self.params = dict(params or {})
        self._dtype_arg = dtype
        self.leaves = walk_leaves(kv_caches, len(self.syntax.list_levels))
        first = self.leaves[0][1]
        for path, t in self.leaves:
            if t.dtype != first.dtype or t.device != first.device:
                raise GeometryError(
                    f"format {format.name}: kv_caches{list(path)} is {t.dtype} on {t.device} but the first tensor is "
                    f"{first.dtype} on {first.device}; one layout holds one dtype on one device (use detect_per_layer for mixed caches)"
                )
        self.storage_dtype = first.dtype
        self.dtype: torch.dtype = dtype or first.dtype
        self.device: torch.device = first.device
        self.axis_sizes: dict[str, int] = {}
        self._build()
        self._check_bounds()
        self._check_distinct_planes()

    # -- the generic construction ----------------------------------------------------
    def _build(self) -> None:
        syn, fmt = self.syntax, self.format
        if syn.blocked_scale:
            self._build_blocked_scale()
            return
        if syn.has("NP"):
            raise GeometryError(
                f"format {fmt.name} has plane tuples of different widths; it needs a spec of its own "
                "from the plugin that registers it (kvcore_spec hook), and none answered"
            )
        sizes: dict[str, int] = {}
        # list levels
        for depth, tok in enumerate(syn.list_levels):
            lens = {len(_node_at(self.kv_caches, p[:depth])) for p, _ in self.leaves}
            if len(lens) != 1:
                raise GeometryError(f"format {fmt.name}: list level {tok} has different lengths {sorted(lens)}")
            sizes[tok] = lens.pop()
        if sizes.get("TWO", 2) != 2:
            raise GeometryError(f"format {fmt.name}: the TWO list level must hold 2 entries (K, V), got {sizes['TWO']}")
        # tensor axes
        nd = len(syn.axes)
        ref_path, ref = self.leaves[0]
        for path, t in self.leaves:
            if t.dim() != nd:
                raise GeometryError(
                    f"format {fmt.name} expects {nd}-D tensors {fmt.symbolic}, but kv_caches{list(path)} is "
                    f"{t.dim()}-D ({_describe_tensor(t)})"
                )
            if tuple(t.shape) != tuple(ref.shape) or tuple(t.stride()) != tuple(ref.stride()):
                raise GeometryError(
                    f"format {fmt.name}: kv_caches{list(path)} ({_describe_tensor(t)}) differs from kv_caches{list(ref_path)} "
                    f"({_describe_tensor(ref)}); a layout is uniform across its layers (use detect_per_layer for hybrid models)"
                )
        for i, tok in enumerate(syn.axes):
            n = int(ref.shape[i])
            lit = {"TWO": 2, "ONE": 1}.get(tok)
            if lit is not None and n != lit:
                raise GeometryError(f"format {fmt.name}: axis {i} ({tok}) must have size {lit}, got {n} ({_describe_tensor(ref)})")
            if n == 0:
                raise GeometryError(
                    f"format {fmt.name}: axis {i} ({tok}) has size 0 ({_describe_tensor(ref)}); a KV cache needs at least "
                    "one block, one token per block, one head and one element"
                )
            if tok not in ("TWO", "ONE"):
                sizes[tok] = n
        isz = ref.element_size()
        esz = torch.empty(0, dtype=self.dtype).element_size()
        st = {tok: int(ref.stride(i)) * isz for i, tok in enumerate(syn.axes) if tok != "ONE"}
        for tok, s in st.items():
            if s < 0:
                raise GeometryError(f"format {fmt.name}: negative stride on axis {tok} ({_describe_tensor(ref)}); flip the view first")
        etok = "CS" if syn.has("CS") else "HS"
        e_axis = syn.axis(etok)
        if e_axis is None:
            raise GeometryError(f"format {fmt.name}: the element axis {etok} must be a tensor axis")
        e_units = sizes[etok]
        e_stride = st[etok]
        if esz != isz:
            if e_stride != isz:
                raise GeometryError(
                    f"format {fmt.name}: the tensors are {self.storage_dtype} but carry {self.dtype}; that needs a contiguous "
                    f"element axis, and {etok} has stride {ref.stride(e_axis)}"
                )
            if (e_units * isz) % esz:
                raise GeometryError(
                    f"format {fmt.name}: the {etok} axis holds {e_units * isz} bytes, not a whole number of {self.dtype} elements ({esz} B)"
                )
            e_count = e_units * isz // esz
            e_stride = esz
        else:
            e_count = e_units
        if etok == "CS":
            hs = int(self.params.get("head_size") or 0) or (e_count // 2)
            if e_count % 2 and not self.params.get("head_size"):
                raise GeometryError(f"format {fmt.name}: packed K|V axis CS={e_count} is odd; K and V head sizes must be given (head_size)")
            if 2 * hs != e_count:
                raise GeometryError(
                    f"format {fmt.name}: CS={e_count} elements but head_size={hs}: K and V head sizes differ "
                    f"(K {hs}, V {e_count - hs}); the staging layout [2, NL, T, NH*HS] needs equal K and V head sizes"
                )
        else:
            hs = e_count
        self.head_size_ = hs
        # geometry
        self.num_layers_ = sizes.get("NL", 1)
        self.kv_size_ = syn.kv_size
        self.num_heads_ = sizes.get("NH", 1)
        if syn.has("NBBS"):
            self.block_size_, self.num_blocks_ = None, None
            self.num_slots_ = sizes["NBBS"]
            blk, tokst, bs_int = st["NBBS"], 0, 1
            sizes["PBS"] = sizes["NBBS"]
        else:
            self.block_size_, self.num_blocks_ = sizes["BS"], sizes["NB"]
            self.num_slots_ = sizes["NB"] * sizes["BS"]
            blk, tokst, bs_int = st["NB"], st["BS"], sizes["BS"]
        head = st.get("NH", 0)
        if e_stride == esz:
            chunk, chunk_bytes, n_chunks = 0, hs * esz, 1
        else:
            chunk, chunk_bytes, n_chunks = e_stride, esz, hs
        plane = PlaneStrides(block=blk, token=tokst, head=head, chunk=chunk, chunk_bytes=chunk_bytes, n_chunks=n_chunks)
        # bases per (layer, kv)
        kv_delta = st["TWO"] if syn.axis("TWO") is not None else (hs * e_stride if etok == "CS" else 0)
        layer_delta = st.get("NL", 0) if syn.axis("NL") is not None else 0
        bases = []
        for layer in range(self.num_layers_):
            row = []
            for kv in range(self.kv_size_):
                t = self._leaf_for(layer, kv)
                off = t.storage_offset() * isz + layer_delta * (layer if syn.axis("NL") is not None else 0)
                if syn.axis("TWO") is not None or etok == "CS":
                    off += kv * kv_delta
                row.append((t, off))
            bases.append(tuple(row))
        self.axis_sizes = sizes
        self.table = classic_table(
            num_layers=self.num_layers_,
            kv_size=self.kv_size_,
            block_size=bs_int,
            num_slots=self.num_slots_,
            num_heads=self.num_heads_,
            head_bytes=hs * esz,
            dtype=self.dtype,
            device=self.device,
            strides=(plane,) * self.kv_size_,
            bases=bases,
            roles=("KV",) if syn.is_mla else None,
        )
        # axes living inside one tensor must not alias each other
        extents = [
            ("block", self.num_blocks_ or self.num_slots_, blk),
            ("token", bs_int, tokst),
            ("head", self.num_heads_, head),
            ("chunk", n_chunks, chunk),
        ]
        if syn.axis("TWO") is not None or etok == "CS":
            extents.append(("K/V", 2, kv_delta))
        if syn.axis("NL") is not None:
            extents.append(("layer", self.num_layers_, layer_delta))
        _check_no_alias(fmt.name, extents, chunk_bytes, ref)

    def _build_blocked_scale(self) -> None:
        """``..._NB_BSV_BSS``: per-layer byte tensors ``[NB, BS, W]`` whose block holds the
        ``BS`` records' value bytes first (``BS * (W - S)``), then their scale bytes
        (``BS * S``) -- the DeepSeek-V3.2 indexer K cache and the quantised DeepSeek MLA pages.

        A token's staged row is its value bytes followed by its scale bytes (``W`` bytes,
        uint8, one head, kv_size 1). The record is two planes staged into one row: ``VALS``
        (token stride ``W - S``, staged at byte 0) and ``SCALES`` (starting ``BS * (W - S)``
        bytes into the block, token stride ``S``, staged at byte ``W - S``). The scale width ``S``
        is an engine fact, so detection passes it: ``params={"scale_bytes": S}``. The block
        stride is the tensor's own (a dim-0 padded pool keeps its padding).

        Raises:
            GeometryError: a nesting other than a layer list, tensors that are not 3-D byte
                tensors of one shape and stride, no (or an impossible) ``scale_bytes``, or a
                block whose bytes are not contiguous.
        """
        fmt = self.format
        leaves = self.leaves
        if self.syntax.list_levels == () and self.syntax.axes == ("NB", "NL", "BSV", "BSS"):
            # block-outermost (cross-layer) pages: one [NB, NL, BS, W] tensor, layer l is its [:, l] view
            t4 = leaves[0][1]
            if t4.dim() != 4:
                raise GeometryError(f"format {fmt.name}: kv_caches should be [NB, NL, BS, W] bytes, got {_describe_tensor(t4)}")
            leaves = [((layer,), t4[:, layer]) for layer in range(int(t4.shape[1]))]
        elif self.syntax.list_levels != ("NL",) or self.syntax.axes != ("NB", "BSV", "BSS"):
            raise GeometryError(
                f"format {fmt.name}: blocked-scale records are a layer list of [NB, BS, W] byte tensors (NL_X_NB_BSV_BSS) "
                "or one block-outermost [NB, NL, BS, W] tensor (NB_NL_BSV_BSS)"
            )
        ref_path, ref = leaves[0]
        for path, t in leaves:
            if t.dim() != 3:
                raise GeometryError(f"format {fmt.name}: kv_caches{list(path)} should be [NB, BS, W] bytes, got {_describe_tensor(t)}")
            if tuple(t.shape) != tuple(ref.shape) or tuple(t.stride()) != tuple(ref.stride()):
                raise GeometryError(
                    f"format {fmt.name}: kv_caches{list(path)} ({_describe_tensor(t)}) differs from kv_caches{list(ref_path)} "
                    f"({_describe_tensor(ref)}); a layout is uniform across its layers (use detect_per_layer for hybrid models)"
                )
        if ref.element_size() != 1 or torch.empty(0, dtype=self.dtype).element_size() != 1:
            raise GeometryError(
                f"format {fmt.name}: blocked-scale records are opaque bytes (uint8/int8), got tensors of {ref.dtype} read as {self.dtype}"
            )
        nb, bs, w = (int(x) for x in ref.shape)
        if min(nb, bs, w) <= 0:
            raise GeometryError(f"format {fmt.name}: zero-size axis in {_describe_tensor(ref)}")
        scale = self.params.get("scale_bytes")
        if not isinstance(scale, int) or isinstance(scale, bool) or not (0 < scale < w):
            raise GeometryError(
                f"format {fmt.name}: records of {w} bytes need params={{'scale_bytes': S}} with 0 < S < {w} "
                f"(the engine's record table says how many of a record's bytes are scales), got {scale!r}"
            )
        if ref.stride(2) != 1 or (bs > 1 and ref.stride(1) != w):
            raise GeometryError(
                f"format {fmt.name}: a block's {bs}x{w} bytes must be contiguous (strides (*, {w}, 1)), got {_describe_tensor(ref)}: "
                "values and scales are laid out block-wise, not per token"
            )
        vals, block = w - scale, int(ref.stride(0))
        nl = len(leaves)
        self.num_layers_, self.kv_size_, self.num_heads_, self.head_size_ = nl, 1, 1, w
        self.num_blocks_, self.block_size_, self.num_slots_ = nb, bs, nb * bs
        self.axis_sizes = {"NL": nl, "NB": nb, "BS": bs, "VALS": vals, "SCALES": scale}
        bases = tuple((t, t.storage_offset() * t.element_size()) for _, t in leaves)
        self.table = StrideTable(
            num_layers=nl,
            block_size=bs,
            num_slots=nb * bs,
            device=self.device,
            planes=(
                Plane(
                    role="VALS",
                    strides=PlaneStrides(block=block, token=vals, head=0, chunk=0, chunk_bytes=vals, n_chunks=1),
                    num_heads=1,
                    head_bytes=vals,
                    dtype=self.dtype,
                    bases=bases,
                    staging=StagingTarget(buffer="kv", index=0, offset=0, head_stride=w),
                ),
                Plane(
                    role="SCALES",
                    strides=PlaneStrides(block=block, token=scale, head=0, chunk=0, chunk_bytes=scale, n_chunks=1),
                    num_heads=1,
                    head_bytes=scale,
                    dtype=self.dtype,
                    bases=tuple((t, off + bs * vals) for t, off in bases),
                    staging=StagingTarget(buffer="kv", index=0, offset=vals, head_stride=w),
                ),
            ),
            buffers=(StagingBuffer(key="kv", kv_size=1, row_bytes=w, dtype=self.dtype),),
        )
        _check_no_alias(fmt.name, [("block", nb, block)], bs * w, ref)

    def _leaf_for(self, layer: int, kv: int) -> torch.Tensor:
        lv = self.syntax.list_levels
        node = self.kv_caches
        if lv == ():
            return node
        if lv == ("NL",):
            return node[layer]
        if lv == ("TWO", "NL"):
            return node[kv][layer]
        if lv == ("NL", "TWO"):
            return node[layer][kv]
        raise GeometryError(f"format {self.format.name}: no generic addressing for list levels {lv}")

    def _check_bounds(self) -> None:
        tb = self.table
        nblocks = -(-tb.num_slots // tb.block_size)
        last_tok = min(tb.block_size, tb.num_slots) - 1
        for p in tb.planes:
            s = p.strides
            span = (
                (nblocks - 1) * s.block
                + s.max_token_offset(last_tok)
                + (p.num_heads - 1) * s.head
                + (s.n_chunks - 1) * s.chunk
                + s.chunk_bytes
            )
            for t, off in p.bases:
                last = off + span
                nbytes = t.untyped_storage().nbytes()
                if off < 0 or last > nbytes:
                    raise GeometryError(
                        f"format {self.format.name}: the geometry reaches byte {last} but the tensor's storage holds {nbytes} "
                        f"({_describe_tensor(t)}); the sizes or strides do not describe this tensor"
                    )

    def _check_distinct_planes(self) -> None:
        """Two (layer, plane) planes starting at one address alias at slot 0 (e.g. one
        tensor registered for two layers): a scatter to one would overwrite the other."""
        seen: dict[int | tuple, tuple[int, str]] = {}
        for p in self.table.planes:
            for li, (t, off) in enumerate(p.bases):
                addr = plane_address(t, off)
                if addr in seen and t.untyped_storage().nbytes() > 0:
                    pl, pr = seen[addr]
                    raise GeometryError(
                        f"format {self.format.name}: layer {li} {p.role} and layer {pl} {pr} start at the same address, so they "
                        "alias (is one tensor registered twice?); every (layer, plane) needs its own memory"
                    )
                seen[addr] = (li, p.role)

    # -- accessors (KVLayout forwards to these) --------------------------------------
    @property
    def num_layers(self) -> int:
        return self.num_layers_

    @property
    def num_blocks(self) -> int:
        if self.num_blocks_ is None:
            raise GeometryError(
                f"format {self.format.name} fuses blocks and tokens in one axis (NBBS): it has no num_blocks; "
                "use page_buffer_size, or detect with a block_size/page_size hint that splits it"
            )
        return self.num_blocks_

    @property
    def block_size(self) -> int:
        if self.block_size_ is None:
            raise GeometryError(
                f"format {self.format.name} fuses blocks and tokens in one axis (NBBS): it has no block_size; "
                "use page_buffer_size, or detect with a block_size/page_size hint that splits it"
            )
        return self.block_size_

    @property
    def num_heads(self) -> int:
        return self.num_heads_

    @property
    def head_size(self) -> int:
        return self.head_size_

    @property
    def kv_size(self) -> int:
        return self.kv_size_

    @property
    def page_buffer_size(self) -> int:
        return self.num_slots_

    def stride_table(self) -> StrideTable:
        return self.table

    def kernel_leaves(self) -> list[torch.Tensor]:
        """The tensors in kernel order (layer lists: one per layer; K/V lists: all K then
        all V; per-layer tuples: K0, V0, K1, V1, ...; one tensor: itself)."""
        return [t for _, t in self.leaves]

    def leaf_layer(self, path: tuple[int, ...]) -> int:
        lv = self.syntax.list_levels
        if "NL" not in lv:
            return -1
        return path[lv.index("NL")]


def _node_at(node: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        node = node[i]
    return node


def _check_no_alias(name: str, extents: list[tuple[str, int, int]], inner_bytes: int, ref: torch.Tensor) -> None:
    """Axes (size, byte stride) of one tensor must nest without overlap: sorted by stride,
    each stride must step over everything inside it."""
    axes = sorted([(s, n, a) for (a, n, s) in extents if n > 1], key=lambda x: x[0])
    extent = inner_bytes
    inner_name = "one element run"
    for stride, n, axis in axes:
        if stride < extent:
            raise GeometryError(
                f"format {name}: axis {axis} steps {stride} bytes but {inner_name} inside it spans {extent} bytes, so two "
                f"addresses alias ({_describe_tensor(ref)}); these strides are not this format's layout"
            )
        extent = stride * (n - 1) + extent
        inner_name = f"the {axis} axis"
