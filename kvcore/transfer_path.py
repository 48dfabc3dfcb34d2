"""The generic transfer path under :mod:`kvcore.transfer` and :class:`kvcore.LayoutPlan`:
the checks every gather/scatter runs before the first byte moves (layer selection, slot
and block indices, staging shape, dtype, device and overlap), :func:`slots_for_blocks`,
and :func:`_run`, which hands validated :class:`~kvcore.kernels.TransferPlan` s to the
selected kernel. Every refusal is a :class:`~kvcore.TransferError` raised before a write.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch

from kvcore.errors import GeometryError, TransferError
from kvcore.inputs import plain_integers
from kvcore.kernels import TransferPlan, check_storages, select_kernel, staging_conflict
from kvcore.layout import KVLayout

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def _index_tensor(x, what: str) -> torch.Tensor:
    """An integer index tensor from a tensor, list or numpy array, without casting: float,
    bool or unsigned-64 input is refused rather than truncated or wrapped.

    A view carrying torch's lazy negation bit (``t._neg_view()``) is resolved to the values
    it shows (a kernel reads the bytes, which hold the unnegated values).

    Raises:
        TransferError: not integers, not a dense strided tensor (sparse, nested), or on the
            meta device.
    """
    if isinstance(x, torch.Tensor) and (x.layout != torch.strided or x.is_nested):
        kind = "nested" if x.is_nested else str(x.layout).replace("torch.", "")
        raise TransferError(f"{what} is a {kind} tensor; pass a dense 1-D integer tensor (int64), e.g. t.to_dense()")
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TransferError(f"{what} must be a 1-D integer tensor (int64), got {type(x).__name__}: {e}") from None
        if x.numel() == 0 and x.dtype == torch.float32:  # an empty list
            x = x.to(torch.int64)
    if x.dtype not in _INT_DTYPES:
        raise TransferError(
            f"{what} must be a 1-D integer tensor (it must hold integers, int64), got {x.dtype}; convert deliberately instead of letting values be truncated"
        )
    if x.device.type == "meta":
        raise TransferError(f"{what} is on the meta device (no values); pass it on the CPU or the cache's device")
    if x.is_neg():
        x = x.resolve_neg()
    return x


def _layers(layout: KVLayout, layers: Sequence[int] | int | None) -> list[int]:
    n = layout.num_layers
    if layers is None:
        return list(range(n))
    layers = plain_integers(layers, "layers", TransferError)  # a torch or numpy array of layer indices
    try:
        seq = [layers] if isinstance(layers, int) else list(layers)
    except TypeError:
        raise TransferError(f"layers must be None, a layer index or a list of layer indices, got {layers!r}") from None
    if not seq:
        raise TransferError("layers is empty; pass None for all layers or a non-empty list of layer indices")
    for k, i in enumerate(seq):
        if not isinstance(i, int):
            i = plain_integers(i, f"layers[{k}]", TransferError)
        if not isinstance(i, int) and hasattr(i, "__index__"):
            try:
                i = operator.index(i)  # numpy / torch integer scalars
            except TypeError:
                pass
        seq[k] = i
        if not isinstance(i, int) or isinstance(i, bool) or not (0 <= i < n):
            raise TransferError(f"layer index {i!r} is out of range: this layout has {n} layers (0..{n - 1})")
    if len(set(seq)) != len(seq):
        raise TransferError(f"layers {seq} repeats a layer")
    return seq


def _slots(layout: KVLayout, slot_mapping, skip_prefix: int, check_duplicates: bool) -> tuple[torch.Tensor, int]:
    slot_mapping = _index_tensor(slot_mapping, "slot_mapping")
    if layout.device.type == "meta":
        raise TransferError(
            "this layout describes tensors on the meta device (shapes without memory, e.g. from `kvcore detect`): "
            "it can be described but not moved; detect the real cache to transfer"
        )
    if slot_mapping.dim() != 1:
        raise TransferError(f"slot_mapping must be 1-D [T], got shape {tuple(slot_mapping.shape)}")
    t = slot_mapping.numel()
    skip_prefix = plain_integers(skip_prefix, "skip_prefix", TransferError)
    if not isinstance(skip_prefix, (int, bool)) and hasattr(skip_prefix, "__index__"):
        try:
            skip_prefix = operator.index(skip_prefix)  # numpy / torch integer scalars
        except TypeError:
            pass
    if isinstance(skip_prefix, bool) or not isinstance(skip_prefix, int) or not (0 <= skip_prefix <= t):
        raise TransferError(f"skip_prefix must be between 0 and the number of tokens ({t}), got {skip_prefix!r}")
    slots = slot_mapping.to(device=layout.device, dtype=torch.int64)
    if skip_prefix:
        slots = slots.clone()
        slots[:skip_prefix] = -1
    n_slots = layout.page_buffer_size
    valid_range = f"valid 0..{n_slots - 1}: this cache has {n_slots} slots per layer; negative slots are padding and are skipped"
    bad = False
    if t:
        bad = int(slots.max()) >= n_slots
    valid = slots[slots >= 0]
    nv = int(valid.numel())
    if not bad and check_duplicates and nv > 1:
        bad = int(torch.unique(valid).numel()) != nv
    if bad:
        raise TransferError(_first_bad_index(slots, n_slots, check_duplicates, "slot_mapping", "slot", valid_range))
    slots = torch.where(slots < 0, torch.full_like(slots, -1), slots)
    return slots, nv


def _first_bad_index(values: torch.Tensor, n: int, check_duplicates: bool, arg: str, unit: str, valid_range: str) -> str:
    """The message for the first index of ``values`` (what the caller passed, as ``arg``)
    that is out of range (``>= n``) or, with ``check_duplicates``, repeats an earlier
    in-range value; negative values are padding. Called only when one exists."""
    v = values.detach().to("cpu", torch.int64)
    oor = torch.nonzero(v >= n).flatten()
    first_oor = int(oor[0]) if oor.numel() else None
    first_dup = None
    if check_duplicates:
        ok = torch.nonzero((v >= 0) & (v < n)).flatten()
        vals = v[ok]
        if vals.numel() > 1:
            srt, perm = torch.sort(vals, stable=True)
            later = perm[1:][srt[1:] == srt[:-1]]  # positions (among ok) that repeat an earlier equal value
            if later.numel():
                first_dup = int(ok[int(later.min())])
    if first_dup is not None and (first_oor is None or first_dup < first_oor):
        val = int(v[first_dup])
        earlier = int(torch.nonzero(v == val)[0])
        return (
            f"{arg}[{first_dup}] = {val} repeats {arg}[{earlier}]: a scatter would write {unit} {val} twice; each {unit} may "
            f"appear once ({valid_range})"
        )
    i = first_oor if first_oor is not None else 0
    return f"{arg}[{i}] = {int(v[i])} is out of range ({valid_range})"


def _check_dense(x: torch.Tensor, what: str, want: tuple[int, ...]) -> None:
    """Refuse a staging tensor the kernels cannot address as dense strided memory, before
    anything reads its shape or strides (a nested tensor has neither): a nested tensor
    (``torch.nested``), a sparse or other non-strided one (``x.layout`` not ``torch.strided``).

    Raises:
        TransferError: naming ``what``, its kind and the dense shape ``want`` expected.
    """
    if getattr(x, "is_nested", False):
        raise TransferError(
            f"{what} is a nested tensor (torch.nested, ragged rows): staging buffers are dense strided tensors; pass a dense "
            f"tensor of shape {list(want)} (layout.allocate_staging makes one)"
        )
    if x.layout != torch.strided:
        raise TransferError(
            f"{what} is a {str(x.layout).replace('torch.', '')} tensor: staging buffers are dense (torch.strided); pass a dense "
            f"tensor of shape {list(want)} (t.to_dense() makes one)"
        )


def _check_staging(layout: KVLayout, staging: torch.Tensor, layers: list[int], single: bool, t: int, what: str) -> torch.Tensor:
    if not isinstance(staging, torch.Tensor):
        if isinstance(staging, Mapping):
            raise TransferError(
                f"{what} is a dict, but format {layout.format.name} stages one tensor [kv_size, NL, T, NH*HS] "
                f"(here {layout.staging_shape(t, layers[0] if single else layers)}); pass that tensor"
            )
        raise TransferError(f"{what} must be a torch.Tensor, got {type(staging).__name__}")
    want = layout.staging_shape(t, layers[0] if single else layers)
    _check_dense(staging, what, want)
    if tuple(staging.shape) != want:
        lay = "[kv_size, T, NH*HS]" if single else "[kv_size, NL, T, NH*HS]"
        raise TransferError(f"{what} has shape {tuple(staging.shape)}, expected {want} ({lay} for this layout and {t} tokens)")
    if staging.dtype != layout.dtype:
        raise TransferError(
            f"{what} is {staging.dtype} but the cache holds {layout.dtype}; pass a {layout.dtype} buffer "
            "(the bytes move unchanged, so the dtypes must match)"
        )
    dev = layout.device
    if staging.device != dev and not (dev.type == "cuda" and staging.device.type == "cpu"):
        raise TransferError(
            f"{what} is on {staging.device} but the cache is on {dev}; use a buffer on {dev}"
            + (" or in pinned host memory" if dev.type == "cuda" else "")
        )
    if staging.numel() and staging.stride(-1) != 1:
        raise TransferError(f"{what}'s last dimension must be contiguous (stride 1), got strides {tuple(staging.stride())}")
    if what == "out":
        overlap = [i for i, (n, st) in enumerate(zip(staging.shape, staging.stride())) if n > 1 and st == 0]
        if overlap:
            raise TransferError(
                f"out has stride 0 on axis {overlap[0]} (an expanded view): its rows overlap, so gathered rows would "
                "overwrite each other; pass a buffer whose rows are distinct memory"
            )
    return staging.unsqueeze(1) if single else staging


def _resolve_neg_conj(staging, gather: bool):
    """Staging carrying torch's negative/conjugate bit (``_neg_view()``): the kernels move raw
    bytes, so a scatter reads a resolved copy and a gather writes into one that is then
    copied back through the view. Returns ``(staging for the kernel, copy-back pairs)``."""
    if isinstance(staging, torch.Tensor):
        if staging.is_neg() or staging.is_conj():
            fixed = staging.resolve_neg().resolve_conj()
            return fixed, ([(staging, fixed)] if gather else [])
        return staging, []
    out, back = {}, []
    for k, b in staging.items():
        if isinstance(b, torch.Tensor) and (b.is_neg() or b.is_conj()):
            out[k] = b.resolve_neg().resolve_conj()
            if gather:
                back.append((b, out[k]))
        else:
            out[k] = b
    return out, back


def _byte_range(x: torch.Tensor) -> tuple[int, int]:
    if x.numel() == 0:
        return (x.data_ptr(), x.data_ptr())
    last = sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    return (x.data_ptr(), x.data_ptr() + (last + 1) * x.element_size())


def _check_plane_staging(layout: KVLayout, staging, layers: list[int], single: bool, t: int, what: str) -> dict[str, torch.Tensor]:
    """Validate a per-plane staging dict; returns ``{key: [NL, T, row]}`` views (one layer:
    a leading axis of 1 added). Raises TransferError naming the entry, before any write."""
    bufs = layout.staging_buffers
    shapes = layout.staging_shapes(t, layers[0] if single else layers)
    keys = [b.key for b in bufs]
    listed = ", ".join(f"{k!r}: {list(v)}" for k, v in shapes.items())
    if not isinstance(staging, Mapping):
        raise TransferError(
            f"{what} must be a dict {{role: tensor}}: format {layout.format.name} stages one buffer per plane ({listed}); "
            f"got {type(staging).__name__} (layout.allocate_staging(T) makes one)"
        )
    missing = [k for k in keys if k not in staging]
    extra = [k for k in staging if k not in keys]
    if missing or extra:
        bits = ([f"plane(s) {', '.join(map(repr, missing))} missing"] if missing else []) + (
            [f"key(s) {', '.join(map(repr, extra))} are no staging buffer of this layout"] if extra else []
        )
        raise TransferError(f"{what}: {' and '.join(bits)}; format {layout.format.name} stages exactly {listed}")
    dev = layout.device
    out: dict[str, torch.Tensor] = {}
    for b in bufs:
        x, label = staging[b.key], f"{what}[{b.key!r}]"
        if not isinstance(x, torch.Tensor):
            raise TransferError(f"{label} must be a torch.Tensor, got {type(x).__name__}")
        want = shapes[b.key]
        _check_dense(x, label, want)
        if tuple(x.shape) != want:
            lay = "[T, NH_p*HS_p]" if single else "[NL, T, NH_p*HS_p]"
            raise TransferError(f"{label} has shape {tuple(x.shape)}, expected {want} ({lay} for plane {b.key} and {t} tokens)")
        if x.dtype != b.dtype:
            raise TransferError(
                f"{label} is {x.dtype} but plane {b.key} holds {b.dtype}; pass a {b.dtype} buffer (the bytes move unchanged, so the dtypes must match)"
            )
        if x.device != dev and not (dev.type == "cuda" and x.device.type == "cpu"):
            raise TransferError(
                f"{label} is on {x.device} but the cache is on {dev}; use a buffer on {dev}"
                + (" or in pinned host memory" if dev.type == "cuda" else "")
            )
        if x.numel() and x.stride(-1) != 1:
            raise TransferError(f"{label}'s last dimension must be contiguous (stride 1), got strides {tuple(x.stride())}")
        if what == "out":
            overlap = [i for i, (n, st) in enumerate(zip(x.shape, x.stride())) if n > 1 and st == 0]
            if overlap:
                raise TransferError(
                    f"{label} has stride 0 on axis {overlap[0]} (an expanded view): its rows overlap, so gathered rows would "
                    "overwrite each other; pass a buffer whose rows are distinct memory"
                )
        out[b.key] = x.unsqueeze(0) if single else x
    if what == "out" and len(keys) > 1:
        spans = sorted((staging[k].device.type, staging[k].device.index, *_byte_range(staging[k]), k) for k in keys if staging[k].numel())
        prev = None  # (device, hi, key) of the span reaching furthest so far
        for dt, di, lo, hi, k in spans:
            if prev is not None and prev[0] == (dt, di) and lo < prev[1]:
                raise TransferError(f"{what}[{prev[2]!r}] and {what}[{k!r}] share memory; each plane needs a buffer of its own")
            if prev is None or prev[0] != (dt, di) or hi > prev[1]:
                prev = ((dt, di), hi, k)
    return out


def _run_planes(layout: KVLayout, slots: torch.Tensor, nv: int, staging, layers, sel: list[int], single: bool, gather: bool):
    t = slots.numel()
    if staging is None:
        staging = layout.allocate_staging(t, layers if single else sel)
    bufs = _check_plane_staging(layout, staging, sel, single, t, "out" if gather else "src")
    table = layout.stride_table(None if sel == list(range(layout.num_layers)) else sel)
    why = staging_conflict(table, bufs, "out" if gather else "src")
    if why:
        check_storages(table)  # a cache re-pointed since detection is the cause to name, not the overlap it fakes
        raise TransferError(why)
    bufs, back = _resolve_neg_conj(bufs, gather)
    plan = TransferPlan(table=table, slots=slots, staging=bufs, num_valid=nv)
    if nv:
        dev_t = next(iter(bufs.values())).device.type
        kernel = select_kernel(layout.device.type, layout.format.name, dev_t, table=table)
        (kernel.gather if gather else kernel.scatter)(plan)
        for view, fixed in back:
            view.copy_(fixed)
    return staging


def _scalar_layer(layers):
    """A numpy / 0-d torch integer scalar means one layer, like an int."""
    if layers is None or isinstance(layers, (int, list, tuple, range)) or not hasattr(layers, "__index__"):
        return layers
    if getattr(layers, "ndim", 0) != 0:  # a 1-element array is a list of one layer, not a scalar
        return layers
    v = plain_integers(layers, "layers", TransferError)  # a meta tensor holds no index: refused here
    if isinstance(v, int):
        return v
    try:
        return operator.index(layers)
    except (TypeError, RuntimeError):
        return layers


def _run(layout: KVLayout, slot_mapping, staging, layers, skip_prefix: int, gather: bool) -> torch.Tensor:
    layers = _scalar_layer(layers)
    sel = _layers(layout, layers)
    single = isinstance(layers, int)
    slots, nv = _slots(layout, slot_mapping, skip_prefix, check_duplicates=not gather)
    if not layout.classic_staging:
        return _run_planes(layout, slots, nv, staging, layers, sel, single, gather)
    t = slots.numel()
    if staging is None:
        staging = torch.zeros(layout.staging_shape(t, layers if single else sel), dtype=layout.dtype, device=layout.device)
    st4 = _check_staging(layout, staging, sel, single, t, "out" if gather else "src")
    table_all = layout.stride_table(None if sel == list(range(layout.num_layers)) else sel)
    why = staging_conflict(table_all, {"kv": st4}, "out" if gather else "src")
    if why:
        check_storages(table_all)  # a cache re-pointed since detection is the cause to name, not the overlap it fakes
        raise TransferError(why)
    st4, back = _resolve_neg_conj(st4, gather)
    runs = [(0, len(sel))] if gather else _write_once(layout, sel)
    for a, b in runs:
        part = sel[a:b]
        whole = (a, b) == (0, len(sel))
        table = table_all if whole else layout.stride_table(None if part == list(range(layout.num_layers)) else part)
        st = st4 if whole else st4[:, a:b]
        plan = TransferPlan(table=table, slots=slots, staging=st, num_valid=nv)
        if nv:
            kernel = select_kernel(layout.device.type, layout.format.name, st.device.type, table=table)
            (kernel.gather if gather else kernel.scatter)(plan)
    if nv:
        for view, fixed in back:
            view.copy_(fixed)
    return staging


def _write_once(layout: KVLayout, sel: list[int]) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` of positions in ``sel`` to scatter: a layer whose memory an earlier
    layer of the selection already writes (``layout.aliases``) is left out, so shared
    memory is written once, from the first of its layers."""
    if not layout.aliases:
        return [(0, len(sel))]
    seen: set[int] = set()
    keep = []
    for i in sel:
        p = layout.layer_map[i]
        keep.append(p not in seen)
        seen.add(p)
    runs, start = [], None
    for k, ok in enumerate(keep + [False]):
        if ok and start is None:
            start = k
        elif not ok and start is not None:
            runs.append((start, k))
            start = None
    return runs


def _block_ids(layout, block_ids) -> tuple[int, torch.Tensor]:
    """``(block_size, block_ids as int64 [N] on the layout's device)``; raises TransferError when
    the layout has no blocks (fused NBBS) or ``block_ids`` is not a 1-D integer index."""
    try:
        bs, _ = layout.block_size, layout.num_blocks
    except GeometryError as e:
        raise TransferError(f"block transfers need blocks: {e}") from None
    b = _index_tensor(block_ids, "block_ids")
    if b.dim() != 1:
        raise TransferError(f"block_ids must be a 1-D integer tensor, got {b.dtype} of shape {tuple(b.shape)}")
    return bs, b.to(device=layout.device, dtype=torch.int64)


def slots_for_blocks(
    layout: KVLayout, block_ids, *, num_tokens: int | None = None, check_duplicates: bool = False, skip_prefix: int = 0
) -> torch.Tensor:
    """The slot mapping that covers whole blocks: ``block_id * block_size + [0, BS)``.

    Args:
        check_duplicates: refuse a block id given twice (what a scatter needs).
        skip_prefix: the transfer leaves the first ``skip_prefix`` rows alone: the ids of
            blocks wholly inside them are not checked (nothing of them moves), as a
            transfer's skipped slots are not.
    Raises:
        TransferError: a block id outside ``0..num_blocks-1`` (negative ids are padding and
            map to -1 slots), a repeated block id (``check_duplicates``), or a layout
            without blocks (fused NBBS). The message names the first offending index of
            ``block_ids`` (``block_ids[1] = 1 repeats block_ids[0]``) and the valid range.
    """
    bs, b = _block_ids(layout, block_ids)
    nb = layout.num_blocks
    chk = b
    skip_prefix = plain_integers(skip_prefix, "skip_prefix", TransferError)
    whole = skip_prefix // bs if isinstance(skip_prefix, int) and not isinstance(skip_prefix, bool) and skip_prefix > 0 else 0
    if whole:
        chk = b.clone()
        chk[:whole] = -1  # wholly skipped blocks move nothing
    bad = bool(chk.numel()) and int(chk.max()) >= nb
    if not bad and check_duplicates:
        live = chk[chk >= 0]
        bad = live.numel() > 1 and int(torch.unique(live).numel()) != int(live.numel())
    if bad:
        valid_range = f"valid 0..{nb - 1}: this cache has {nb} blocks; negative block ids are padding and are skipped"
        raise TransferError(_first_bad_index(chk, nb, check_duplicates, "block_ids", "block", valid_range))
    slots = (b[:, None] * bs + torch.arange(bs, device=b.device)[None, :]).flatten()
    slots = torch.where(b.repeat_interleave(bs) < 0, torch.full_like(slots, -1), slots)
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not (0 <= num_tokens <= slots.numel()):
            raise TransferError(f"num_tokens must be between 0 and {slots.numel()} (the blocks' slots), got {num_tokens!r}")
        slots = slots[:num_tokens]
    return slots
