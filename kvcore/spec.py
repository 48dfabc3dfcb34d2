"""The spec: a format's geometry read from the tensors, and the stride table it builds.

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

The parts live apart, one job each: the stride table in :mod:`kvcore.strides`, the
aliasing proofs in :mod:`kvcore.aliasing`, the reading of one plane template in
:mod:`kvcore.plane_reader`; their names stay importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

# the stride table and the aliasing proofs live in their own modules; their names stay importable from here
from kvcore.aliasing import _MEET_BUDGET, _check_disjoint, _check_no_alias, _describe_tensor, _meet, _Region, _regions, _Undecided  # noqa: F401
from kvcore.errors import GeometryError
from kvcore.format_decl import KVFormat
from kvcore.grammar import VALUE_ROLES
from kvcore.plane_reader import _QUANTIZED, _head_runs, _node_at, _Read, _read_template, _refuse_quantized, walk_leaves  # noqa: F401
from kvcore.strides import (  # noqa: F401
    Plane,
    PlaneStrides,
    StagingBuffer,
    StagingTarget,
    StrideTable,
    TensorState,
    _extent,
    _geo_text,
    _geometry,
    caller_problem,
    classic_table,
    plane_address,
    record_callers,
)

__all__ = [
    "PlaneStrides",
    "Plane",
    "PlaneInfo",
    "StagingTarget",
    "StagingBuffer",
    "StrideTable",
    "TensorState",
    "caller_problem",
    "record_callers",
    "Spec",
    "walk_leaves",
    "classic_table",
]


@dataclass(frozen=True)
class PlaneInfo:
    """One plane of a layout as a user sees it (``KVLayout.planes``).

    Attributes:
        role: ``"K"``, ``"V"``, ``"KV"`` (an MLA latent), a side plane's role of a
            multi-plane name (``"KS"``, ``"VZ"``, ...), or ``"VALS"``/``"SCALES"`` (the two
            parts of a blocked-scale record).
        template: the plane's template (multi-plane names), else the format's name.
        dtype: the plane's element dtype.
        storage_dtype: the dtype of the tensors holding it (differs for byte views).
        num_heads: heads per token (1 for a plane without a head axis).
        head_size: elements of ``dtype`` per head (1 for a plane without an element axis).
        head_bytes: bytes per head (``head_size * element size``).
        staging: key of the staging buffer the plane goes to (``"kv"`` or the role).
        staging_index: the plane's index on the classic buffer's K/V axis; None for a
            per-plane buffer.
    """

    role: str
    template: str
    dtype: torch.dtype
    storage_dtype: torch.dtype
    num_heads: int
    head_size: int
    head_bytes: int
    staging: str
    staging_index: int | None

    @property
    def row_bytes(self) -> int:
        """Bytes of one token on this plane: ``num_heads * head_bytes``."""
        return self.num_heads * self.head_bytes

    @property
    def hidden_dim(self) -> int:
        """Elements of one token on this plane: ``num_heads * head_size``."""
        return self.num_heads * self.head_size


class Spec:
    """The generic spec: geometry and stride table from a format's grammar.

    Args:
        format: the :class:`KVFormat`.
        kv_caches: a container nested exactly as the format's list levels
            (``NL_X_...``: a list of NL tensors; ``TWO_X_NL_X_...``: [K list, V list];
            ``NL_X_TWO_X_...``: NL (K, V) pairs; no list level: one tensor). For a
            multi-plane name ``ROLE=TEMPLATE+...``: a dict ``{role: container}``, each
            container nested as that plane's template (one entry per plane, no other).
        dtype: the element dtype when the tensors are a byte view of it (vLLM 0.33's
            int8 buffers carrying bf16, fp8 stored as uint8 viewed as float8). The
            element axis (HS/CS, or HSE) must then be contiguous and its byte size
            divisible by the element size. Default: the tensors' dtype. Multi-plane
            names: one dtype for every plane, or a dict ``{role: dtype}`` (roles left out
            keep their tensors' dtype).
        params: extra facts the name cannot carry: ``head_size`` (K head size of a
            packed CS axis; default CS/2).

    Multi-plane layouts stage as the classic buffer ``[kv_size, NL, T, NH*HS]`` when their
    planes are exactly ``K`` (and ``V``), or one ``KV`` latent, of one dtype, one head count
    and one head width; any other multi-plane layout stages one buffer per plane,
    ``{role: [NL, T, NH_p * HS_p]}`` in the plane's dtype (:class:`StagingBuffer`).

    Raises:
        GeometryError: the container does not nest as the format says, tensors of one
            layout (of one plane) disagree in shape/dtype/device/strides, an axis literal
            is wrong (TWO must be 2, ONE 1), K and V head sizes differ in a CS axis, a
            dtype is a torch quantized dtype, planes disagree on layers, blocks, block
            size or heads, a plane is missing from (or extra in) the dict, or the strides
            would make two addresses alias (inside a tensor, or between two (layer,
            plane) regions) or reach past the tensor's storage.
    """

    def __init__(self, format: KVFormat, kv_caches: Any, *, dtype: Any = None, params: dict | None = None):
        self.format = format
        self.syntax = format.syntax
        self.kv_caches = kv_caches
        multi = self.syntax.multi_plane
        if dtype is not None and not isinstance(dtype, torch.dtype) and not (multi and isinstance(dtype, Mapping)):
            more = " or a dict {role: dtype}" if multi else ""
            raise GeometryError(f"dtype must be a torch.dtype (e.g. torch.bfloat16){more} or None, got {dtype!r}")
        if params is not None and not isinstance(params, dict):
            raise GeometryError(f"params must be a dict (e.g. {{'head_size': 128}}) or None, got {type(params).__name__}")
        self.params = dict(params or {})
        self._dtype_arg = dtype
        self.axis_sizes: dict[str, int] = {}
        self.plane_leaves: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self.plane_info: tuple[PlaneInfo, ...] = ()
        self.head_size_: int | None = None
        if multi:
            self._init_planes()
        else:
            self.leaves = walk_leaves(kv_caches, len(self.syntax.list_levels))
            first = self.leaves[0][1]
            for path, t in self.leaves:
                if t.dtype != first.dtype or t.device != first.device:
                    raise GeometryError(
                        f"format {format.name}: kv_caches{list(path)} is {t.dtype} on {t.device} but the first tensor is "
                        f"{first.dtype} on {first.device}; one layout holds one dtype on one device (use detect_per_layer for mixed caches)"
                    )
            _refuse_quantized(first.dtype, f"format {format.name}: kv_caches")
            _refuse_quantized(dtype, f"format {format.name}: dtype")
            self.storage_dtype = first.dtype
            self.dtype = dtype or first.dtype
            self.device = first.device
        self._build()
        if not self.plane_info:
            self.plane_info = self._table_plane_info()
        self._check_bounds()
        self._check_disjoint_planes()

    def _table_plane_info(self) -> tuple[PlaneInfo, ...]:
        out = []
        for p in self.table.planes:
            esz = torch.empty(0, dtype=p.dtype).element_size()
            out.append(
                PlaneInfo(
                    role=p.role,
                    template=self.format.name,
                    dtype=p.dtype,
                    storage_dtype=self.storage_dtype,
                    num_heads=p.num_heads,
                    head_size=p.head_bytes // esz,
                    head_bytes=p.head_bytes,
                    staging=p.staging.buffer,
                    staging_index=p.staging.index,
                )
            )
        return tuple(out)

    # -- multi-plane names -------------------------------------------------------------
    def _init_planes(self) -> None:
        fmt, syn, kv = self.format, self.syntax, self.kv_caches
        roles = syn.roles
        if not isinstance(kv, Mapping):
            raise GeometryError(
                f"format {fmt.name} has planes {', '.join(roles)}: kv_caches must be a dict {{role: container}} "
                f"(each container nested as its plane's template), got {type(kv).__name__}"
            )
        missing = [r for r in roles if r not in kv]
        extra = [k for k in kv if k not in roles]
        if missing or extra:
            bits = []
            if missing:
                bits.append(f"plane(s) {', '.join(map(repr, missing))} missing")
            if extra:
                bits.append(f"key(s) {', '.join(map(repr, extra))} are no plane of it")
            raise GeometryError(f"format {fmt.name}: kv_caches {' and '.join(bits)}; it needs exactly the planes {', '.join(roles)}")
        darg = self._dtype_arg
        if isinstance(darg, Mapping):
            bad = [k for k in darg if k not in roles]
            if bad:
                raise GeometryError(
                    f"format {fmt.name}: dtype names {', '.join(map(repr, bad))}, which are no planes of it ({', '.join(roles)})"
                )
            for r, d in darg.items():
                if d is not None and not isinstance(d, torch.dtype):
                    raise GeometryError(f"format {fmt.name}: dtype[{r!r}] must be a torch.dtype, got {d!r}")
        self.leaves = []
        self.plane_dtypes: dict[str, torch.dtype] = {}
        self.plane_storage_dtypes: dict[str, torch.dtype] = {}
        device = None
        for pi, p in enumerate(syn.planes):
            where = f"kv_caches[{p.role!r}]"
            leaves = walk_leaves(kv[p.role], len(p.syntax.list_levels), where)
            first = leaves[0][1]
            for path, t in leaves:
                if t.dtype != first.dtype or t.device != first.device:
                    raise GeometryError(
                        f"format {fmt.name}: {where}{list(path)} is {t.dtype} on {t.device} but {where}'s first tensor is "
                        f"{first.dtype} on {first.device}; one plane holds one dtype on one device"
                    )
            if device is None:
                device = first.device
            elif first.device != device:
                raise GeometryError(
                    f"format {fmt.name}: plane {p.role!r} is on {first.device} but plane {syn.roles[0]!r} is on {device}; "
                    "all planes of a layout live on one device"
                )
            d = darg.get(p.role) if isinstance(darg, Mapping) else darg
            _refuse_quantized(first.dtype, f"format {fmt.name}: {where}")
            _refuse_quantized(d, f"format {fmt.name}: the dtype of plane {p.role!r}")
            self.plane_dtypes[p.role] = d or first.dtype
            self.plane_storage_dtypes[p.role] = first.dtype
            self.plane_leaves[p.role] = leaves
            self.leaves += [((pi,) + path, t) for path, t in leaves]
        self.device = device
        values = [r for r in roles if r in VALUE_ROLES] or list(roles)
        vd = {self.plane_dtypes[r] for r in values}
        sd = {self.plane_storage_dtypes[r] for r in values}
        # the layout's dtype is its values' (None when K and V differ: ask layout.planes)
        self.dtype = vd.pop() if len(vd) == 1 else None
        self.storage_dtype = sd.pop() if len(sd) == 1 else None

    def _build_planes(self) -> None:
        fmt, syn = self.format, self.syntax
        reads: dict[str, _Read] = {}
        for p in syn.planes:
            reads[p.role] = _read_template(
                f"format {fmt.name} plane {p.role!r}",
                p.syntax,
                self.plane_leaves[p.role],
                self.kv_caches[p.role],
                self.plane_dtypes[p.role],
                {},
                f"kv_caches[{p.role!r}]",
            )

        def disagree(what: str, vals: dict[str, Any]) -> None:
            if len(set(vals.values())) > 1:
                listed = ", ".join(f"{r} {v}" for r, v in vals.items())
                raise GeometryError(
                    f"format {fmt.name}: the planes disagree on {what} ({listed}); every plane of a record addresses the same "
                    f"layers, blocks and tokens{' and heads' if what == 'num_heads (NH)' else ''}"
                )

        disagree("num_layers (NL)", {r: g.num_layers for r, g in reads.items()})
        paged = {r: g for r, g in reads.items() if g.block_size is not None}
        disagree("num_blocks (NB)", {r: g.num_blocks for r, g in paged.items()})
        disagree("block_size (BS)", {r: g.block_size for r, g in paged.items()})
        disagree("token slots (NB*BS or NBBS)", {r: g.num_slots for r, g in reads.items()})
        disagree("num_heads (NH)", {r: g.num_heads for r, g in reads.items() if "NH" in g.sizes})
        any_g = next(iter(reads.values()))
        nl, num_slots = any_g.num_layers, any_g.num_slots
        if paged:
            g0 = next(iter(paged.values()))
            num_blocks, block_size = g0.num_blocks, g0.block_size
        else:
            num_blocks, block_size = None, None
        bs_int = block_size or 1
        heads = {g.num_heads for g in reads.values() if "NH" in g.sizes}
        self.num_layers_, self.num_blocks_, self.block_size_, self.num_slots_ = nl, num_blocks, block_size, num_slots
        self.num_heads_ = heads.pop() if heads else 1
        self.kv_size_ = syn.kv_size
        roles = syn.roles
        values = [r for r in roles if r in VALUE_ROLES] or list(roles)
        hs = {reads[r].head_size for r in values}
        self.head_size_ = hs.pop() if len(hs) == 1 else None
        # staging: exactly K (and V), or one KV latent, of one dtype, head count and width: the classic buffer
        order = [r for r in ("K", "V") if r in roles] if set(roles) in ({"K"}, {"K", "V"}) else list(roles)
        same = (
            len({self.plane_dtypes[r] for r in roles}) == 1
            and len({reads[r].num_heads for r in roles}) == 1
            and len({reads[r].head_size * reads[r].esz for r in roles}) == 1
        )
        classic = same and set(roles) in ({"K"}, {"K", "V"}, {"KV"})
        planes, infos = [], {}
        for idx, r in enumerate(order):
            g = reads[r]
            s = g.strides
            if block_size is not None and g.block_size is None:  # an NBBS plane beside paged planes: slot = block*BS + t
                s = replace(s, block=s.block * block_size, token=s.block)
            head_bytes = g.head_size * g.esz
            leaves = self.plane_leaves[r]
            psyn = syn.plane(r).syntax
            bases = []
            for layer in range(nl):
                t = leaves[layer][1] if psyn.list_levels == ("NL",) else leaves[0][1]
                bases.append((t, t.storage_offset() * g.isz + (layer * g.layer_delta if psyn.axis("NL") is not None else 0)))
            target = (
                StagingTarget(buffer="kv", index=idx, offset=0, head_stride=head_bytes)
                if classic
                else StagingTarget(buffer=r, index=None, offset=0, head_stride=head_bytes)
            )
            planes.append(
                Plane(
                    role=r,
                    strides=s,
                    num_heads=g.num_heads,
                    head_bytes=head_bytes,
                    dtype=self.plane_dtypes[r],
                    bases=tuple(bases),
                    staging=target,
                )
            )
            infos[r] = PlaneInfo(
                role=r,
                template=psyn.name,
                dtype=self.plane_dtypes[r],
                storage_dtype=self.plane_storage_dtypes[r],
                num_heads=g.num_heads,
                head_size=g.head_size,
                head_bytes=head_bytes,
                staging=target.buffer,
                staging_index=target.index,
            )
        if classic:
            p0 = planes[0]
            buffers: tuple[StagingBuffer, ...] = (StagingBuffer(key="kv", kv_size=len(planes), row_bytes=p0.row_bytes, dtype=p0.dtype),)
        else:
            buffers = tuple(StagingBuffer(key=p.role, kv_size=None, row_bytes=p.row_bytes, dtype=p.dtype) for p in planes)
        self.table = StrideTable(
            num_layers=nl, block_size=bs_int, num_slots=num_slots, device=self.device, planes=tuple(planes), buffers=buffers
        )
        # each plane's layers along its tensor's NL axis were proven disjoint; two planes over one tensor were not
        nl_axis = {p.role: p.syntax.axis("NL") is not None for p in syn.planes}
        self._in_tensor_checked = (
            self.table,
            lambda a, b: a.tensor == b.tensor and a.role == b.role and (a.layer == b.layer or nl_axis[a.role]),
            False,
        )
        self.plane_info = tuple(infos[r] for r in roles)
        sizes: dict[str, int] = {"NL": nl}
        if block_size is not None:
            sizes.update(NB=num_blocks, BS=block_size)
        sizes["PBS"] = num_slots
        if heads or self.num_heads_ > 1:
            sizes["NH"] = self.num_heads_
        for r, g in reads.items():
            sizes.update({f"{r}.{k}": v for k, v in g.sizes.items()})
        self.axis_sizes = sizes

    # -- the generic construction ----------------------------------------------------
    def _build(self) -> None:
        syn, fmt = self.syntax, self.format
        if syn.multi_plane:
            self._build_planes()
            return
        if syn.blocked_scale:
            self._build_blocked_scale()
            return
        if syn.has("NP"):
            raise GeometryError(
                f"format {fmt.name} has plane tuples of different widths; it needs a spec of its own "
                "from the plugin that registers it (kvcore_spec hook), and none answered; a multi-plane name "
                "(ROLE=TEMPLATE+ROLE=TEMPLATE) describes such planes without one"
            )
        g = _read_template(f"format {fmt.name}", syn, self.leaves, self.kv_caches, self.dtype, self.params, "kv_caches")
        self.head_size_ = g.head_size
        self.num_layers_ = g.num_layers
        self.kv_size_ = syn.kv_size
        self.num_heads_ = g.num_heads
        self.block_size_, self.num_blocks_, self.num_slots_ = g.block_size, g.num_blocks, g.num_slots
        # bases per (layer, kv)
        has_nl = syn.axis("NL") is not None
        kv_in_tensor = syn.axis("TWO") is not None or syn.has("CS")
        bases = []
        for layer in range(self.num_layers_):
            row = []
            for kv in range(self.kv_size_):
                t = self._leaf_for(layer, kv)
                off = t.storage_offset() * g.isz + (g.layer_delta * layer if has_nl else 0)
                if kv_in_tensor:
                    off += kv * g.kv_delta
                row.append((t, off))
            bases.append(tuple(row))
        self.axis_sizes = g.sizes
        self.table = classic_table(
            num_layers=self.num_layers_,
            kv_size=self.kv_size_,
            block_size=g.block_size or 1,
            num_slots=self.num_slots_,
            num_heads=self.num_heads_,
            head_bytes=g.head_size * g.esz,
            dtype=self.dtype,
            device=self.device,
            strides=(g.strides,) * self.kv_size_,
            bases=bases,
            roles=("KV",) if syn.is_mla else None,
        )
        # _read_template proved regions disjoint that differ only along the tensor's own axes (NL, TWO/CS)
        nl_axis, kv_axis = has_nl, kv_in_tensor or self.kv_size_ == 1
        self._in_tensor_checked = (
            self.table,
            lambda a, b: a.tensor == b.tensor and (a.layer == b.layer or nl_axis) and (a.role == b.role or kv_axis),
            nl_axis and kv_axis,
        )

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
            span = (nblocks - 1) * s.block + s.max_token_offset(last_tok) + (p.num_heads - 1) * s.head + s.head_span
            for t, off in p.bases:
                last = off + span
                nbytes = t.untyped_storage().nbytes()
                if off < 0 or last > nbytes:
                    raise GeometryError(
                        f"format {self.format.name}: the geometry reaches byte {last} but the tensor's storage holds {nbytes} "
                        f"({_describe_tensor(t)}); the sizes or strides do not describe this tensor"
                    )

    def _check_disjoint_planes(self) -> None:
        """Every (layer, plane) region must own its bytes: two regions whose address sets
        intersect alias (one tensor registered for two layers; per-layer views of one buffer
        where layer 1 starts one token row after layer 0), so a scatter to one would
        overwrite the other. Decided on the exact address sets, not on byte ranges, so
        interleavings that share a range without sharing a byte stay accepted: K and V
        interleaved per block, layers interleaved in a cross-layer tensor, K|V packed in one
        row, a blocked record's values and scales."""
        checked = getattr(self, "_in_tensor_checked", None)
        if checked is None or checked[0] is not self.table:  # a subclass replaced the generic table: check every pair
            _check_disjoint(self.format.name, self.table)
        else:
            _check_disjoint(self.format.name, self.table, checked[1], checked[2])

    # -- accessors (KVLayout forwards to these) --------------------------------------
    @property
    def num_layers(self) -> int:
        return self.num_layers_

    @property
    def num_blocks(self) -> int:
        if self.num_blocks_ is None:
            raise GeometryError(
                f"format {self.format.name} fuses blocks and tokens in one axis (NBBS): it has no num_blocks; "
                "use page_buffer_size, or detect with a block_size (or page_size) hint: kvcore then splits the axis into blocks of that many tokens (NBBS -> NB_BS)"
            )
        return self.num_blocks_

    @property
    def block_size(self) -> int:
        if self.block_size_ is None:
            raise GeometryError(
                f"format {self.format.name} fuses blocks and tokens in one axis (NBBS): it has no block_size; "
                "use page_buffer_size, or detect with a block_size (or page_size) hint: kvcore then splits the axis into blocks of that many tokens (NBBS -> NB_BS)"
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
        all V; per-layer tuples: K0, V0, K1, V1, ...; one tensor: itself; multi-plane
        names: each plane's tensors in the name's plane order)."""
        return [t for _, t in self.leaves]

    def leaf_layer(self, path: tuple[int, ...]) -> int:
        """The layer a leaf (by its path in :attr:`leaves`) holds, or -1 for a tensor
        holding every layer. Multi-plane paths start with the plane's index."""
        if self.syntax.multi_plane:
            lv = self.syntax.planes[path[0]].syntax.list_levels
            path = path[1:]
        else:
            lv = self.syntax.list_levels
        if "NL" not in lv:
            return -1
        return path[lv.index("NL")]
