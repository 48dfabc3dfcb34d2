"""KV transfer between processes: ``kvcore.send`` / ``kvcore.recv`` on ``torch.distributed``.

A prefill process sends a request's tokens, a decode process receives them into its own
layout — NHD into HND, block size 16 into 32, TP 1 into TP 2 (``heads=``) — with the
conversion fused into packing and unpacking. The distributed engine is torch's (NCCL
between GPUs, Gloo between CPU processes), not kvcore's.

Protocol (one call on each side, messages in this order, all point-to-point):

1. **header** (sender -> receiver, 4 KiB): the sender's format name and geometry — the
   planes it sends (role, heads, head bytes, dtype), layers, tokens, chunk size — or,
   when the sender's own arguments were refused, its error (both sides then raise).
2. **padding mask** (only when the sender's slot mapping has padding slots): one byte per
   token; the receiver leaves those rows untouched.
3. **chunks**: the tokens in the receiver's row order (row ``i`` of the sender's slots
   lands in row ``i`` of the receiver's), ``chunk_tokens`` rows per chunk, each chunk the
   planes one after another, each ``[NL, n, NH*HS]`` bytes (for a K/V layout exactly the
   staging layout ``[2, NL, n, NH*HS]``). Packing (a gather into the sender's staging
   chunk), the wire and unpacking (a scatter from the receiver's chunk) overlap: two
   staging chunks per side, so the memory a call allocates is bounded by
   ``2 * chunk_bytes`` per side, never proportional to the cache or the request.
4. **status** (receiver -> sender, 1 KiB): ``ok``, or why the receiver refused (its own
   arguments, or a header it cannot convert: other planes, head counts, widths, dtypes,
   layer or token counts). A refusing receiver reads the chunks but writes nothing, and
   both sides raise :class:`~kvcore.TransferError`.

Timeouts: every message wait has a deadline (``timeout`` seconds, default
``KVCORE_P2P_TIMEOUT`` or 300). A peer that disappears mid-transfer raises a
``TransferError`` naming the destination slots of the unfinished chunk (the receiver) or
the unfinished token rows (the sender); chunks before it were landed, nothing after it
was written. The process group must then be destroyed and created again (a NCCL
communicator with a pending operation cannot be reused).

On CUDA the calls return with the unpacking kernels enqueued on the current stream; the
header and the status are read by the host (two small synchronisations per call).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvcore.errors import KVCoreError, TransferError
from kvcore.kernels import TransferPlan, select_kernel
from kvcore.layout import KVLayout
from kvcore.layout_copy import _check_slots, _select, head_range
from kvcore.spec import StagingBuffer, StagingTarget, StrideTable
from kvcore.transfer import _layers

__all__ = ["send", "recv", "HEADER_BYTES", "STATUS_BYTES", "DEFAULT_CHUNK_BYTES"]

HEADER_BYTES = 4096
STATUS_BYTES = 1024
PROTOCOL = 1
DEFAULT_CHUNK_BYTES = 64 << 20
"""The largest staging chunk (bytes) kvcore.send picks by itself on a GPU (8 MiB on the CPU)."""
DEFAULT_CHUNK_BYTES_CPU = 8 << 20
_MIN_CHUNK_BYTES = {"cuda": 8 << 20, "cpu": 2 << 20}
"""The smallest chunk kvcore.send picks by itself: a chunk must keep the wire busy longer than
the host needs to queue the next one (a NCCL message of 8 MiB takes about 25 µs on NVLink)."""
_MIN_CHUNKS = 4


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _timeout(timeout) -> float:
    if timeout is None:
        env = os.environ.get("KVCORE_P2P_TIMEOUT", "").strip()
        try:
            return float(env) if env else 300.0
        except ValueError:
            raise TransferError(f"KVCORE_P2P_TIMEOUT must be a number of seconds, got {env!r}") from None
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise TransferError(f"timeout must be a positive number of seconds (or a timedelta), got {timeout!r}")
    return float(timeout)


# -- point-to-point primitives (module-level so tests can interpose) ---------------------


def _isend(tensor: torch.Tensor, peer: int, group, tag: int):
    import torch.distributed as dist

    return dist.isend(tensor, peer, group=group, tag=tag)


def _irecv(tensor: torch.Tensor, peer: int, group, tag: int):
    import torch.distributed as dist

    return dist.irecv(tensor, peer, group=group, tag=tag)


class _FailedWork:
    """An operation the backend refused to post (the peer's connection is already gone)."""

    _kvcore_poll = True

    def __init__(self, msg: str):
        self.msg = msg

    def is_completed(self) -> bool:
        return True

    def wait(self, *a) -> None:
        raise RuntimeError(self.msg)


def _post(send: bool, tensor: torch.Tensor, peer: int, group, tag: int):
    try:
        work = (_isend if send else _irecv)(tensor, peer, group, tag)
    except RuntimeError as e:
        return _FailedWork(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    if work is not None and tensor.is_cuda:
        try:
            work._kvcore_poll = True  # NCCL: completion is a CUDA event, polled without blocking
        except AttributeError:
            return _Polled(work)
    return work


class _Polled:
    """A work whose completion is polled (when the backend's Work takes no attributes)."""

    _kvcore_poll = True

    def __init__(self, work):
        self.work = work

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, *a) -> None:
        self.work.wait(*a)


class _PeerLost(Exception):
    """A message did not complete: ``reason`` says how (timeout or the backend's error)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _wait(work, timeout: float) -> None:
    """Wait for ``work`` with a deadline; the backend's own error, if any, is raised as
    :class:`_PeerLost`. NCCL works answer ``is_completed`` (a CUDA event query): they are
    polled, so that a lost peer cannot hang the host. Other backends' point-to-point works
    (Gloo) complete only inside ``wait``, which takes the deadline itself."""
    if work is None:
        return
    if not getattr(work, "_kvcore_poll", False):
        import datetime

        try:
            work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise _PeerLost(_reason(e, timeout)) from None
        return
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        try:
            done = work.is_completed()
        except RuntimeError as e:  # the backend reports a failed operation
            raise _PeerLost(_reason(e, timeout)) from None
        if done:
            try:
                work.wait()
            except RuntimeError as e:
                raise _PeerLost(_reason(e, timeout)) from None
            return
        if time.monotonic() > deadline:
            raise _PeerLost(f"nothing arrived within {timeout:g} s")
        if pause:
            time.sleep(pause)
        pause = min(0.002, pause * 2 if pause else 2e-5)


def _reason(e: BaseException, timeout: float) -> str:
    text = " ".join(str(e).split())
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"nothing arrived within {timeout:g} s ({text[:200]})"
    return f"the connection failed ({text[:300]})"


# -- what travels ------------------------------------------------------------------------


def _encode(obj: dict, size: int, device: torch.device) -> torch.Tensor:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    if len(raw) > size:
        if "error" in obj:
            obj = dict(obj, error=obj["error"][: max(0, len(obj["error"]) - (len(raw) - size) - 16)] + " ...")
            raw = json.dumps(obj, separators=(",", ":")).encode()
        if len(raw) > size:
            raise TransferError(f"a kvcore message of {len(raw)} bytes does not fit {size} bytes (too many planes?)")
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device) if device.type != "cpu" else buf


def _decode(t: torch.Tensor, what: str) -> dict:
    raw = bytes(t.cpu().numpy().tobytes()).rstrip(b"\0")
    try:
        obj = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise TransferError(
            f"the peer's {what} is not a kvcore message ({raw[:40]!r}...): both sides must call kvcore.send / kvcore.recv, "
            "in the same order"
        ) from None
    if not isinstance(obj, dict) or obj.get("kvcore") != PROTOCOL:
        raise TransferError(f"the peer's {what} is kvcore protocol {obj.get('kvcore') if isinstance(obj, dict) else '?'}, not {PROTOCOL}")
    return obj


@dataclass(frozen=True)
class _Wire:
    """One side's view of the wire: the table whose staging buffers are the wire chunk."""

    table: StrideTable
    roles: tuple[str, ...]
    row_bytes: tuple[int, ...]  # per plane: NH * head_bytes
    dtypes: tuple[torch.dtype, ...]
    classic: bool

    @property
    def token_bytes(self) -> int:
        """Wire bytes of one token (all layers, all planes)."""
        return self.table.num_layers * sum(self.row_bytes)

    def views(self, buf: torch.Tensor, n: int):
        """The staging argument of a :class:`TransferPlan` over the first ``n`` tokens' bytes of ``buf``."""
        nl = self.table.num_layers
        if self.classic:
            b = self.table.buffers[0]
            esz = torch.empty(0, dtype=b.dtype).element_size()
            return buf[: b.kv_size * nl * n * b.row_bytes].view(b.dtype).view(b.kv_size, nl, n, b.row_bytes // esz)
        out, off = {}, 0
        for role, rb, dt in zip(self.roles, self.row_bytes, self.dtypes):
            esz = torch.empty(0, dtype=dt).element_size()
            out[role] = buf[off : off + nl * n * rb].view(dt).view(nl, n, rb // esz)
            off += nl * n * rb
        return out


def _wire(table: StrideTable, per_plane: bool = False) -> _Wire:
    """The wire form of ``table``: the planes one after another, each ``[NL, n, NH*W]``. A
    classic K/V table already stages exactly so (``[kv, NL, n, row]``); any other table
    (or ``per_plane=True``) gets one staging buffer per plane."""
    roles = tuple(p.role for p in table.planes)
    rows = tuple(p.num_heads * p.head_bytes for p in table.planes)
    dts = tuple(p.dtype for p in table.planes)
    if table.classic and not per_plane:
        return _Wire(table, roles, rows, dts, True)
    planes = tuple(replace(p, staging=StagingTarget(buffer=p.role, index=None, offset=0, head_stride=p.head_bytes)) for p in table.planes)
    buffers = tuple(StagingBuffer(key=p.role, kv_size=None, row_bytes=r, dtype=p.dtype) for p, r in zip(table.planes, rows))
    return _Wire(replace(table, planes=planes, buffers=buffers), roles, rows, dts, False)


def _chunk_tokens(token_bytes: int, num_tokens: int, chunk_bytes: int | None, device_type: str) -> int:
    """Tokens per chunk: ``chunk_bytes`` exactly when given; else a quarter of the transfer,
    between the device's smallest chunk and :data:`DEFAULT_CHUNK_BYTES`."""
    if token_bytes <= 0 or num_tokens <= 0:
        return 1
    if chunk_bytes is None:
        cap = DEFAULT_CHUNK_BYTES if device_type == "cuda" else DEFAULT_CHUNK_BYTES_CPU
        lo = _MIN_CHUNK_BYTES.get(device_type, _MIN_CHUNK_BYTES["cpu"])
        chunk_bytes = min(cap, max(lo, -(-num_tokens * token_bytes // _MIN_CHUNKS)))
    return max(1, min(num_tokens, chunk_bytes // token_bytes))


def _slot_list(slots: torch.Tensor, limit: int = 12) -> str:
    v = [int(x) for x in slots.tolist() if int(x) >= 0]
    if not v:
        return "none (all padding)"
    if len(v) <= limit:
        return str(v)
    return f"{v[: limit // 2]} ... {v[-limit // 2 :]} ({len(v)} slots)"


# -- the two sides ---------------------------------------------------------------------


def _group_info(group, peer, what: str):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise TransferError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    me = dist.get_rank()
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    if isinstance(peer, bool) or not isinstance(peer, int) or peer not in ranks:
        raise TransferError(f"{what}={peer!r} is not a rank of the process group (ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''})")
    if peer == me:
        raise TransferError(f"{what}={peer} is this process's own rank; to move tokens within one process use kvcore.copy")
    backend = str(dist.get_backend(group)).lower()
    return me, backend


def _wire_device(layout: KVLayout | None, backend: str) -> torch.device:
    if layout is not None and layout.device.type == "cuda" and "nccl" in backend:
        return layout.device
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        if layout is None or layout.device.type != "cuda":
            raise TransferError(f"the process group's backend is {backend}, which moves CUDA tensors only, but this cache is on the CPU")
    return torch.device("cpu")


def _check_layout(layout, what: str) -> None:
    if not isinstance(layout, KVLayout):
        raise TransferError(f"the {what} cache must be a KVLayout (from kvcore.detect), got {type(layout).__name__}")
    if layout.device.type == "meta":
        raise TransferError(f"the {what} layout describes tensors on the meta device (shapes without memory): it cannot be moved")


def _side_table(layout: KVLayout, layers, heads, what: str) -> StrideTable:
    sel = _layers(layout, layers)
    table = layout.stride_table(None if sel == list(range(layout.num_layers)) else sel)
    return _select(table, head_range(heads, what, layout), what)


def _staging(wire: _Wire, n: int, dev: torch.device, host_for_cuda: bool) -> torch.Tensor:
    return torch.empty(max(1, n * wire.token_bytes), dtype=torch.uint8, device=dev, pin_memory=host_for_cuda)


def _record(dev: torch.device):
    if dev.type == "cuda":
        ev = torch.cuda.Event()
        ev.record()
        return ev
    return None


def send(
    layout: KVLayout,
    slots,
    dst: int,
    *,
    heads=None,
    layers: Sequence[int] | int | None = None,
    group=None,
    chunk_bytes: int | None = None,
    timeout=None,
    tag: int = 0,
) -> None:
    """Send the tokens at ``slots`` to rank ``dst``, which calls :func:`recv`.

    Row ``i`` of ``slots`` lands in row ``i`` of the receiver's slots, in the receiver's
    own layout. See the module docstring for the protocol.

    Args:
        layout: the sender's cache (from :func:`kvcore.detect`); on a GPU with NCCL, on the
            CPU with Gloo (a GPU cache with Gloo is packed into pinned host chunks).
        slots: int64 ``[T]``; a negative slot is padding: the receiver leaves that row alone.
        dst: the receiver's global rank.
        heads: ``(start, stop)``: send only KV heads ``start..stop-1`` (a TP split: each
            decode rank receives its share of the heads).
        layers: the sender's layers to send (default all), in the order they land.
        group: the process group (default: the world).
        chunk_bytes: bytes per staging chunk (two are allocated; a chunk holds at least one
            token). Default: a quarter of the transfer, at least 8 MiB (CPU: 2 MiB) and at most
            64 MiB (CPU: 8 MiB), so that packing, the wire and unpacking overlap while each
            chunk keeps the wire busy longer than the host needs to queue the next.
        timeout: seconds (or a timedelta) each message may take (default
            ``KVCORE_P2P_TIMEOUT`` or 300).
        tag: the point-to-point tag (Gloo), to tell concurrent transfers apart.

    Raises:
        TransferError: the sender's own arguments are bad (a slot out of range, a head
            range past its heads, a bad rank; the receiver is told and raises too), the
            receiver refused (its message is included: other planes, head counts, widths,
            dtypes, layer or token counts, or its own bad arguments), or the receiver
            disappeared (the token rows not delivered are named).
    """
    with _device_of(layout):
        _send(layout, slots, dst, heads, layers, group, chunk_bytes, timeout, tag)


def _device_of(layout):
    if isinstance(layout, KVLayout) and layout.device.type == "cuda":
        return torch.cuda.device(layout.device)
    return contextlib.nullcontext()


def _send(layout, slots, dst, heads, layers, group, chunk_bytes, timeout, tag) -> None:
    tmo = _timeout(timeout)
    me, backend = _group_info(group, dst, "dst")
    err: TransferError | None = None
    try:
        _check_layout(layout, "sending")
        wdev = _wire_device(layout, backend)
        table = _side_table(layout, layers, heads, "heads")
        wire = _wire(table)
        s = _check_slots(layout, slots, "slots", False)
        s_dev = s.to(layout.device)
        t = int(s.numel())
        valid_host = s >= 0
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
            raise TransferError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
        ct = _chunk_tokens(wire.token_bytes, t, chunk_bytes, layout.device.type)
        padding = bool((~valid_host).any()) if t else False
    except TransferError as e:
        err = e
        wdev = layout.device if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in backend else torch.device("cpu")
    if err is not None:
        msg = {"kvcore": PROTOCOL, "ok": False, "error": str(err)}
        try:
            _wait(_post(True, _encode(msg, HEADER_BYTES, wdev), dst, group, tag), tmo)
        except _PeerLost:
            pass
        raise err
    head = {
        "kvcore": PROTOCOL,
        "ok": True,
        "format": layout.format.name,
        "describe": layout.describe(),
        "rank": me,
        "tokens": t,
        "layers": table.num_layers,
        "heads": list(head_range(heads, "heads") or (0, layout.num_heads)),
        "planes": [[r, p.num_heads, p.head_bytes, _dt(p.dtype)] for r, p in zip(wire.roles, table.planes)],
        "chunk_tokens": ct,
        "token_bytes": wire.token_bytes,
        "padding": padding,
    }

    def lost(what: str, e: _PeerLost, first_row: int = 0) -> TransferError:
        return TransferError(
            f"kvcore.send to rank {dst}: {what}: {e.reason}. The receiver's slots for token rows {first_row}..{t - 1} were "
            "not written by this call; destroy and re-create the process group before the next transfer"
        )

    # the header (and the mask) are not waited for here: packing the first chunks overlaps
    # with the receiver reading the header
    early = [(_post(True, _encode(head, HEADER_BYTES, wdev), dst, group, tag), "the header")]
    if padding:
        mask = valid_host.to(torch.uint8)
        early.append((_post(True, mask.to(wdev) if wdev.type != "cpu" else mask, dst, group, tag), "the padding mask"))

    def settle_early() -> None:
        while early:
            work, what = early.pop(0)
            try:
                _wait(work, tmo)
            except _PeerLost as e:
                raise lost(f"{what} was not delivered", e) from None

    bounds = [(a, min(t, a + ct)) for a in range(0, t, ct)]
    if bounds:
        host_for_cuda = layout.device.type == "cuda" and wdev.type == "cpu"
        kernel = select_kernel(layout.device.type, layout.format.name, wdev.type, table=wire.table)
        counts = [int(valid_host[a:b].sum()) for a, b in bounds]
        bufs = [_staging(wire, bounds[0][1] - bounds[0][0], wdev, host_for_cuda) for _ in range(min(2, len(bounds)))]
        pending: list = [None] * len(bufs)
        for i, (a, b) in enumerate(bounds):
            k = i % len(bufs)
            if pending[k] is not None:
                settle_early()
                pa, pb = bounds[i - len(bufs)]
                try:
                    _wait(pending[k], tmo)
                except _PeerLost as e:
                    raise lost(f"chunk {i - len(bufs)} of {len(bounds)} (token rows {pa}..{pb - 1}) was not delivered", e, pa) from None
            buf = bufs[k]
            if counts[i]:
                kernel.gather(TransferPlan(table=wire.table, slots=s_dev[a:b], staging=wire.views(buf, b - a), num_valid=counts[i]))
            if host_for_cuda:  # Gloo reads the pinned chunk from the host: the packing must be done
                ev = _record(layout.device)
                ev.synchronize()
            pending[k] = _post(True, buf[: (b - a) * wire.token_bytes], dst, group, tag)
        settle_early()
        for j in range(len(bounds) - len(bufs), len(bounds)):
            if j < 0:
                continue
            try:
                _wait(pending[j % len(bufs)], tmo)
            except _PeerLost as e:
                pa, pb = bounds[j]
                raise lost(f"chunk {j} of {len(bounds)} (token rows {pa}..{pb - 1}) was not delivered", e, pa) from None
    settle_early()
    status = torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=wdev)
    try:
        _wait(_post(False, status, dst, group, tag), tmo)
    except _PeerLost as e:
        raise TransferError(
            f"kvcore.send to rank {dst}: every chunk was sent but the receiver did not confirm: {e.reason}; whether it landed "
            "them is unknown to this side"
        ) from None
    st = _decode(status, "status")
    if not st.get("ok"):
        raise TransferError(f"kvcore.send to rank {dst}: the receiver refused and wrote nothing: {st.get('error')}")


def _compare(head: dict, table: StrideTable, layout: KVLayout, t: int) -> tuple[TransferError | None, StrideTable | None]:
    """The receiver's table with its planes in the sender's order, or why the header cannot
    land in it."""
    src = f"rank {head.get('rank')}'s {head.get('format')} ({head.get('describe')})"
    mine = f"this {layout.format.name} ({layout.describe()})"
    planes = head.get("planes") or []
    sroles = [p[0] for p in planes]
    droles = [p.role for p in table.planes]
    if sorted(sroles) != sorted(droles):
        return TransferError(
            f"the sender ({src}) sends planes {'+'.join(sroles)} per token but {mine} records {'+'.join(droles)}; planes are paired by role"
        ), None
    by_role = {p.role: p for p in table.planes}
    ordered = []
    for role, nh, hb, dt in planes:
        p = by_role[role]
        if nh != p.num_heads:
            return TransferError(
                f"plane {role}: the sender ({src}) sends {nh} KV head(s) (its heads {head.get('heads')}) but {mine} takes "
                f"{p.num_heads}; the sender passes heads=(start, stop) for a tensor-parallel split, the receiver heads= for "
                "a merge"
            ), None
        if hb != p.head_bytes:
            return TransferError(
                f"plane {role}: a head is {hb} bytes on the sender ({src}, {dt}) but {p.head_bytes} bytes here ({mine}, "
                f"{_dt(p.dtype)}); head sizes must match"
            ), None
        if dt != _dt(p.dtype):
            return TransferError(
                f"plane {role}: the sender ({src}) sends {dt} but {mine} holds {_dt(p.dtype)}; bytes move unchanged, so the "
                "dtypes must match"
            ), None
        ordered.append(p)
    if head.get("layers") != table.num_layers:
        return TransferError(
            f"the sender ({src}) sends {head.get('layers')} layer(s) but this side receives into {table.num_layers}; "
            "select equal numbers with layers="
        ), None
    if head.get("tokens") != t:
        return TransferError(
            f"the sender ({src}) sends {head.get('tokens')} token rows but this side has {t} slots; row i lands in slot i"
        ), None
    if [p.role for p in ordered] != droles:
        table = replace(table, planes=tuple(ordered))
    return None, table


def recv(
    layout: KVLayout,
    slots,
    src: int,
    *,
    heads=None,
    layers: Sequence[int] | int | None = None,
    group=None,
    timeout=None,
    tag: int = 0,
) -> None:
    """Receive tokens from rank ``src`` (which calls :func:`send`) into ``slots`` of this cache.

    Args:
        layout: the receiver's cache (from :func:`kvcore.detect`), in its own layout.
        slots: int64 ``[T]``: row ``i`` of the sender lands in ``slots[i]``; a negative slot
            (here or on the sender) leaves the row untouched.
        src: the sender's global rank.
        heads: ``(start, stop)``: land the incoming heads in this cache's KV heads
            ``start..stop-1`` (a TP merge: a cache with more heads than the sender sends).
        layers: this cache's layers to fill (default all), in the sender's order.
        group, timeout, tag: as :func:`send`.

    Raises:
        TransferError: this side's arguments are bad (a slot out of range or repeated; the
            sender is told and raises too), the sender's header cannot land here (other
            planes, head counts without ``heads=``, widths, dtypes, layer or token
            counts: both sides raise, nothing is written), the sender refused, or the
            sender disappeared (the destination slots of the unfinished chunk are named:
            they and all later rows were not written; earlier chunks were landed).
    """
    with _device_of(layout):
        _recv(layout, slots, src, heads, layers, group, timeout, tag)


def _recv(layout, slots, src, heads, layers, group, timeout, tag) -> None:
    tmo = _timeout(timeout)
    me, backend = _group_info(group, src, "src")
    err: TransferError | None = None
    table = wire = None
    s = None
    try:
        _check_layout(layout, "receiving")
        wdev = _wire_device(layout, backend)
        table = _side_table(layout, layers, heads, "heads")
        s = _check_slots(layout, slots, "slots", True)
    except TransferError as e:
        err = e
        wdev = layout.device if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in backend else torch.device("cpu")
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=wdev)
    try:
        _wait(_post(False, header, src, group, tag), tmo)
    except _PeerLost as e:
        where = f"; destination slots {_slot_list(s)} were not written" if s is not None else ""
        raise TransferError(f"kvcore.recv from rank {src}: no header arrived: {e.reason}{where}") from None
    head = _decode(header, "header")
    if not head.get("ok"):
        raise TransferError(f"kvcore.recv from rank {src}: the sender refused and sent nothing: {head.get('error')}")
    t = int(head.get("tokens", 0))
    if err is None:
        err, table = _compare(head, table, layout, int(s.numel()))
    if err is None:
        wire = _wire(table)
        if wire.token_bytes != head.get("token_bytes"):
            err = TransferError(f"the sender's rows are {head.get('token_bytes')} bytes per token, this side's {wire.token_bytes}")
    eff = s
    if head.get("padding"):
        mask = torch.zeros(t, dtype=torch.uint8, device=wdev)
        try:
            _wait(_post(False, mask, src, group, tag), tmo)
        except _PeerLost as e:
            where = f"; destination slots {_slot_list(s)} were not written" if s is not None else ""
            raise TransferError(f"kvcore.recv from rank {src}: the padding mask did not arrive: {e.reason}{where}") from None
        if err is None:
            eff = torch.where(mask.cpu().bool(), s, torch.full_like(s, -1))
    ct = max(1, int(head.get("chunk_tokens", 1)))
    tb = int(head.get("token_bytes", 0))
    bounds = [(a, min(t, a + ct)) for a in range(0, t, ct)]
    if bounds:
        host_for_cuda = err is None and layout.device.type == "cuda" and wdev.type == "cpu"
        if err is None:
            eff_dev = eff.to(layout.device)
            valid_host = eff >= 0
            counts = [int(valid_host[a:b].sum()) for a, b in bounds]
            kernel = select_kernel(layout.device.type, layout.format.name, wdev.type, table=wire.table)
        n_buf = min(2, len(bounds))
        bufs = [torch.empty(max(1, ct * tb), dtype=torch.uint8, device=wdev, pin_memory=host_for_cuda) for _ in range(n_buf)]
        works: list = [None] * n_buf
        events: list = [None] * n_buf
        for j in range(n_buf):
            a, b = bounds[j]
            works[j] = _post(False, bufs[j][: (b - a) * tb], src, group, tag)
        for i, (a, b) in enumerate(bounds):
            k = i % n_buf
            try:
                _wait(works[k], tmo)
            except _PeerLost as e:
                if err is not None:
                    raise TransferError(f"kvcore.recv from rank {src}: {err} (and then the sender was lost: {e.reason})") from None
                landed = f"chunks 0..{i - 1} (rows 0..{a - 1}) were landed; " if i else "no chunk was landed; "
                raise TransferError(
                    f"kvcore.recv from rank {src}: chunk {i} of {len(bounds)} (rows {a}..{b - 1}) did not arrive: {e.reason}. "
                    f"Destination slots {_slot_list(eff[a:b])} (that chunk) were not written, nor the slots of rows {b}..{t - 1}; "
                    f"{landed}nothing else was touched. Destroy and re-create the process group before the next transfer"
                ) from None
            if err is None and counts[i]:
                kernel.scatter(TransferPlan(table=wire.table, slots=eff_dev[a:b], staging=wire.views(bufs[k], b - a), num_valid=counts[i]))
                events[k] = _record(layout.device) if host_for_cuda else None
            nxt = i + n_buf
            if nxt < len(bounds):
                if events[k] is not None:  # Gloo writes the pinned chunk from the host: the unpacking must be done
                    events[k].synchronize()
                    events[k] = None
                na, nb = bounds[nxt]
                works[k] = _post(False, bufs[k][: (nb - na) * tb], src, group, tag)
    status = {"kvcore": PROTOCOL, "ok": err is None, "rank": me}
    if err is not None:
        status["error"] = f"rank {me}: {err}"
    try:
        st_t = _encode(status, STATUS_BYTES, wdev)
        work = _post(True, st_t, src, group, tag)
        if err is None and getattr(work, "_kvcore_poll", False):
            _keep(work, st_t)  # NCCL: the confirmation completes in the background, this side is done
        else:
            _wait(work, tmo)
    except _PeerLost:
        if err is None:
            raise TransferError(f"kvcore.recv from rank {src}: every chunk was landed but the status could not be returned") from None
    except KVCoreError:
        pass
    if err is not None:
        raise err


_INFLIGHT: list = []


def _keep(work, tensor: torch.Tensor) -> None:
    """Hold ``tensor`` until ``work`` (a NCCL send nobody waits for) has completed."""
    _INFLIGHT[:] = [(w, t) for w, t in _INFLIGHT if not _done(w)]
    _INFLIGHT.append((work, tensor))


def _done(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:
        return True
