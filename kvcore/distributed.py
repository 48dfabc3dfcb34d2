"""KV transfer between processes: ``kvcore.send`` / ``kvcore.recv`` on ``torch.distributed``.

A prefill process sends a request's tokens, a decode process receives them into its own
layout — NHD into HND, block size 16 into 32, TP 1 into TP 2 (``heads=``) — with the
conversion fused into packing and unpacking. The distributed engine is torch's (NCCL
between GPUs, Gloo between CPU processes), not kvcore's.

**Channels and the agreement.** A channel is (process group, peer, tag, direction). Its
two ends keep the *agreement* of their last successful transfer: the wire geometry (the
planes in the sender's order: role, heads, head bytes, dtype; the layer count), the token
count, the chunking and an epoch. A call whose own geometry and token count equal the
agreement runs **fast**: no host ever waits for the peer, every message size is known to
both sides in advance, and on a GPU the call only enqueues work (slot checks, packing,
the NCCL operations, unpacking) and returns. A call that differs (the first on a channel,
a new geometry, another token count, or an argument this side refuses) runs **slow**: the
two hosts exchange their headers first (a handshake), then, when the receiver accepts,
both run the fast transfer under the new agreement. Both ends update the agreement in the
same handshake, so they always decide alike; when only one side changed, the two calls do
not match and both raise (below). ``chunk_bytes`` is agreed in a handshake: on a channel
whose geometry and token count do not change, the agreed chunking is kept (use another
``tag`` for another chunking).

**Messages** (all point-to-point; on NCCL each group of them is one coalesced operation,
the chunks overlapping packing and unpacking):

1. sender -> receiver ``D`` (4 KiB): a control record (mode fast/slow, epoch, tokens) and
   the sender's format, geometry and chunking as JSON (read by a slow receiver only);
   receiver -> sender ``R0`` (64 B): the receiver's mode. Exchanged together.
2. slow only: sender -> receiver nothing more; receiver -> sender the status (1 KiB JSON):
   ok, or why the receiver refuses (its own arguments, or a header it cannot convert).
   After an ok both run the fast transfer.
3. chunks: the tokens in the receiver's row order (row ``i`` of the sender's slots lands
   in row ``i`` of the receiver's), ``chunk_tokens`` rows per chunk, each chunk the planes
   one after another, each ``[NL, n, NH*HS]`` bytes (for a K/V layout exactly the staging
   layout ``[2, NL, n, NH*HS]``). The first chunk starts with the sender's slot verdict
   and its padding mask (one byte per token). Staging: two chunks per device and
   direction, reused across calls (``release_staging()`` frees them), never proportional
   to the cache or the request.
4. receiver -> sender ``V`` (64 B) with the last chunk: the receiver's slot verdict.

**Validation and errors.** The sender checks its slots (range), the receiver its own
(range, a slot twice) — on a GPU on the device, in one-block kernels on the current
stream. The receiver lands a chunk only when the sender's ``D`` says fast under the same
agreement, the sender's verdict is clean and its own is: a refused transfer writes
nothing. On a GPU a refusal found on the device surfaces as a
:class:`~kvcore.TransferError` at the next kvcore CUDA call or :func:`kvcore.synchronize`
(as device validation does for :func:`kvcore.gather`), on both sides (the sender reads the
receiver's ``R0``/``V``, the receiver the sender's ``D`` and verdict). On the CPU, and
for anything the host sees (a bad argument, a handshake the receiver refuses: other
planes, head counts, widths, dtypes, layer or token counts), the call itself raises, on
both sides. When only one side changed (a mismatch), the other side's fast transfer is
completed with a refused one of the agreed size, so the channel stays usable.

**Timeouts.** Every message has a deadline (``timeout`` seconds, default
``KVCORE_P2P_TIMEOUT`` or 300). A peer that disappears raises a ``TransferError`` naming
the destination slots of the unfinished chunk (the receiver) or the token rows not
delivered (the sender): in the call (CPU, and the handshake), or on a GPU at the next
call on that device or :func:`kvcore.synchronize` once the deadline has passed (wait with
``kvcore.synchronize``, not ``torch.cuda.synchronize``, to have the deadline enforced).
Chunks before it were landed, nothing after it was written. The process group must then
be destroyed and created again (a NCCL communicator with a pending operation cannot be
reused).

**Streams (GPU).** Slot checks, packing and unpacking run on the current stream; the NCCL
operations are posted from a kvcore side stream that waits only for what they read, so
the wire overlaps packing and unpacking within a call and across calls. When a call
returns, the current stream is ordered after the packing (sender) or the unpacking
(receiver), so later work on it sees the landed rows. NCCL point-to-point groups use the
process group's collective communicator: the first NCCL operation of a group must involve
all its ranks (as for ``torch.distributed.batch_isend_irecv``; a barrier does).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvcore import p2p_graph
from kvcore.errors import TransferError
from kvcore.kernels import TransferPlan, _build, select_kernel
from kvcore.layout import KVLayout
from kvcore.layout_copy import _check_slots, _select, head_range
from kvcore.layout_plan import _dense
from kvcore.p2p_graph import WireGraphs
from kvcore.spec import StagingBuffer, StagingTarget, StrideTable
from kvcore.transfer import _index_tensor, _layers

__all__ = ["send", "recv", "release_staging", "HEADER_BYTES", "STATUS_BYTES", "DEFAULT_CHUNK_BYTES"]

HEADER_BYTES = 4096
STATUS_BYTES = 1024
CTL_BYTES = 64
PROTOCOL = 2
MAGIC = 0x6B76636F72650002
FAST, SLOW = 1, 2
DEFAULT_CHUNK_BYTES = 256 << 20
"""The largest staging chunk (bytes) kvcore.send picks by itself on a GPU (8 MiB on the CPU).
On two H200s (docs/benchmarks.md) every chunk cost tens of µs of NCCL and host time: 8192
tokens of a TP half (537 MB) moved fastest in two chunks of 256 MiB (88 % of the ceiling for
both halves, against 82 % in four of 128 MiB and 72 % in eight of 64 MiB)."""
DEFAULT_CHUNK_BYTES_CPU = 8 << 20
_MIN_CHUNK_BYTES = {"cuda": 16 << 20, "cpu": 2 << 20}
"""The smallest chunk kvcore.send picks by itself: below it a NCCL operation's fixed cost
(tens of µs) outweighs what overlapping its packing would save."""
_MIN_CHUNKS = {"cuda": 2, "cpu": 4}
_CTL_RING = 8
_STATS = {"handshakes": 0, "fast": 0}  # per process: handshakes run, fast transfers started (tests, diagnostics)
_NO_GATE = torch.empty(0, dtype=torch.int32)
_CPU = torch.device("cpu")
# control record fields (csrc/kvcore_copy.h, CtlField)
_F_MAGIC, _F_MODE, _F_EPOCH, _F_TOKENS, _F_VERDICT, _F_INDEX, _F_VALUE, _F_NUM = range(8)
_OP_SEND, _OP_RECV = 3, 4


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _timeout(timeout) -> float:
    if timeout is None:
        if _ENV_DATA is not None and b"KVCORE_P2P_TIMEOUT" not in _ENV_DATA:
            return 300.0
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


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


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
        pause = min(0.001, pause * 2 if pause else 1e-5)


def _poll(work, timeout: float) -> None:
    """Wait on the host for a GPU work (polled: a NCCL work's ``wait`` only orders streams)."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        try:
            if work.is_completed():
                return
        except RuntimeError as e:
            raise _PeerLost(_reason(e, timeout)) from None
        if time.monotonic() > deadline:
            raise _PeerLost(f"nothing arrived within {timeout:g} s")
        if pause:
            time.sleep(pause)
        pause = min(0.001, pause * 2 if pause else 1e-5)


def _reason(e: BaseException, timeout: float) -> str:
    text = " ".join(str(e).split())
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"nothing arrived within {timeout:g} s ({text[:200]})"
    return f"the connection failed ({text[:300]})"


# -- process groups and channels ---------------------------------------------------------


class _Group:
    """What kvcore needs of a process group, looked up once."""

    __slots__ = ("ref", "pg", "me", "ranks", "index", "backend", "coalesce", "graphs", "__weakref__")

    def __init__(self, pg):
        import torch.distributed as dist

        # per device index: this group's point-to-point groups captured in CUDA graphs, dropped
        # with the process group object
        graphs = self.graphs = {}
        self.ref = weakref.ref(pg, lambda _r: graphs.clear())
        self.me = dist.get_rank()
        self.ranks = list(dist.get_process_group_ranks(pg))
        self.index = {r: i for i, r in enumerate(self.ranks)}
        self.backend = str(dist.get_backend(pg)).lower()
        self.coalesce = hasattr(pg, "_start_coalescing") and hasattr(pg, "_end_coalescing")


_GROUPS: dict[int, _Group] = {}


def _group(group, peer, what: str) -> tuple[_Group, object]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise TransferError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    g = _GROUPS.get(id(pg))
    if g is None or g.ref() is not pg:
        g = _Group(pg)
        _GROUPS[id(pg)] = g
    if isinstance(peer, bool) or not isinstance(peer, int) or peer not in g.index:
        raise TransferError(f"{what}={peer!r} is not a rank of the process group (ranks {g.ranks[:8]}{'...' if len(g.ranks) > 8 else ''})")
    if peer == g.me:
        raise TransferError(f"{what}={peer} is this process's own rank; to move tokens within one process use kvcore.copy")
    return g, pg


@dataclass
class _Agreement:
    """What both ends of a channel agreed on in their last handshake."""

    sig: tuple  # ((role, num_heads, head_bytes, dtype), ...) in the sender's plane order
    layers: int
    tokens: int
    chunk_tokens: int
    token_bytes: int
    epoch: int
    peer_desc: str = ""  # the peer's format and geometry, for messages
    dfast: torch.Tensor | None = None  # sender: the fast D message on the wire device
    r0fast: torch.Tensor | None = None  # receiver: the fast R0 message
    programs: dict = field(default_factory=dict)  # the fast path precomputed per side (_Program)

    @property
    def prefix_bytes(self) -> int:
        return CTL_BYTES + _pad16(self.tokens)

    def bounds(self) -> list[tuple[int, int]]:
        t, ct = self.tokens, self.chunk_tokens
        return [(a, min(t, a + ct)) for a in range(0, t, ct)]


class _Channel:
    __slots__ = ("agreement", "calls", "ctl", "ctl_next", "broken", "side_memo", "eng")

    def __init__(self):
        self.agreement: _Agreement | None = None
        self.calls = 0
        self.ctl: list = []
        self.ctl_next = 0
        self.broken: str | None = None  # why a transfer stopped between its messages: the channel is out of step
        self.side_memo: tuple | None = None  # receiver: the last call's side (_recv_side)
        self.eng = None  # the GPU engine of the last fast call (_dev_engine)

    def check(self, what: str) -> None:
        if self.broken:
            raise TransferError(
                f"{what}: an earlier transfer on this channel stopped between its messages ({self.broken}); the two sides are out "
                "of step: destroy and re-create the process group"
            )


def _channel(g: _Group, peer: int, tag: int, sending: bool) -> _Channel:
    chans = _CHANNELS.setdefault(id(g), (weakref.ref(g), {}))
    if chans[0]() is not g:
        chans = _CHANNELS[id(g)] = (weakref.ref(g), {})
    key = (peer, tag, sending)
    ch = chans[1].get(key)
    if ch is None:
        ch = chans[1][key] = _Channel()
    return ch


_CHANNELS: dict[int, tuple] = {}


# -- what travels ------------------------------------------------------------------------


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
    """Tokens per chunk: ``chunk_bytes`` exactly when given; else half of the transfer on a
    GPU (a quarter on the CPU), between the device's smallest chunk and
    :data:`DEFAULT_CHUNK_BYTES`."""
    if token_bytes <= 0 or num_tokens <= 0:
        return 1
    if chunk_bytes is None:
        gpu = device_type == "cuda"
        cap = DEFAULT_CHUNK_BYTES if gpu else DEFAULT_CHUNK_BYTES_CPU
        lo = _MIN_CHUNK_BYTES.get(device_type, _MIN_CHUNK_BYTES["cpu"])
        chunk_bytes = min(cap, max(lo, -(-num_tokens * token_bytes // _MIN_CHUNKS["cuda" if gpu else "cpu"])))
    return max(1, min(num_tokens, chunk_bytes // token_bytes))


def _slot_list(slots, limit: int = 12) -> str:
    v = [int(x) for x in (slots.tolist() if isinstance(slots, torch.Tensor) else slots) if int(x) >= 0]
    if not v:
        return "none (all padding)"
    if len(v) <= limit:
        return str(v)
    return f"{v[: limit // 2]} ... {v[-limit // 2 :]} ({len(v)} slots)"


def _sig(table: StrideTable) -> tuple:
    return tuple((p.role, p.num_heads, p.head_bytes, _dt(p.dtype)) for p in table.planes)


def _ctl_record(*fields: int) -> torch.Tensor:
    out = torch.zeros(8, dtype=torch.int64)
    out[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return out.view(torch.uint8)


def _message(record: torch.Tensor, obj: dict | None, size: int) -> torch.Tensor:
    """A control message: the record, then ``obj`` as JSON (zero padded to ``size`` bytes)."""
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[:CTL_BYTES] = record
    if obj is not None:
        raw = json.dumps(obj, separators=(",", ":")).encode()
        room = size - CTL_BYTES
        if len(raw) > room and "error" in obj:
            obj = dict(obj, error=obj["error"][: max(0, len(obj["error"]) - (len(raw) - room) - 16)] + " ...")
            raw = json.dumps(obj, separators=(",", ":")).encode()
        if len(raw) > room and "describe" in obj:
            obj = dict(obj, describe="")
            raw = json.dumps(obj, separators=(",", ":")).encode()
        if len(raw) > room:
            raise TransferError(f"a kvcore message of {len(raw)} bytes does not fit {room} bytes (too many planes?)")
        buf[CTL_BYTES : CTL_BYTES + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _read(t: torch.Tensor, what: str, json_too: bool) -> tuple[list[int], dict | None]:
    """A control message's record and (``json_too``) its JSON, read on the host."""
    host = t.cpu()
    rec = host[:CTL_BYTES].view(torch.int64).tolist()
    if rec[_F_MAGIC] != MAGIC:
        raise TransferError(
            f"the peer's {what} is not a kvcore protocol {PROTOCOL} message: both sides must call kvcore.send / kvcore.recv, in "
            "the same order, with the same kvcore version; destroy and re-create the process group"
        )
    if not json_too:
        return rec, None
    raw = bytes(host[CTL_BYTES:].numpy().tobytes()).rstrip(b"\0")
    try:
        obj = json.loads(raw.decode()) if raw else {}
    except (UnicodeDecodeError, ValueError):
        raise TransferError(f"the peer's {what} carries no readable kvcore header ({raw[:40]!r}...)") from None
    return rec, obj


def _mismatch(
    head: dict, planes_here: tuple, layers_here: int, tokens_here: int, src: str, mine: str, here: str = "this side"
) -> tuple[str | None, list]:
    """Why the sender's header ``head`` cannot land in a side with ``planes_here``
    (``(role, heads, head_bytes, dtype)`` each), or None and the order in which this side's
    planes pair with the sender's (indices into ``planes_here``)."""
    planes = head.get("planes") or []
    sroles = [p[0] for p in planes]
    droles = [p[0] for p in planes_here]
    if sorted(sroles) != sorted(droles):
        return (
            f"the sender ({src}) sends planes {'+'.join(sroles)} per token but {mine} records {'+'.join(droles)}; planes are paired by role",
            [],
        )
    by_role = {p[0]: i for i, p in enumerate(planes_here)}
    order = []
    for role, nh, hb, dt in planes:
        i = by_role[role]
        _, mnh, mhb, mdt = planes_here[i]
        if nh != mnh:
            return (
                f"plane {role}: the sender ({src}) sends {nh} KV head(s) (its heads {head.get('heads')}) but {mine} takes {mnh}; "
                "the sender passes heads=(start, stop) for a tensor-parallel split, the receiver heads= for a merge",
                [],
            )
        if hb != mhb:
            return (
                f"plane {role}: a head is {hb} bytes on the sender ({src}, {dt}) but {mhb} bytes here ({mine}, {mdt}); head sizes must match",
                [],
            )
        if dt != mdt:
            return (
                f"plane {role}: the sender ({src}) sends {dt} but {mine} holds {mdt}; bytes move unchanged, so the dtypes must match",
                [],
            )
        order.append(i)
    if head.get("layers") != layers_here:
        return (
            f"the sender ({src}) sends {head.get('layers')} layer(s) but {here} receives into {layers_here}; select equal numbers with layers=",
            [],
        )
    if head.get("tokens") != tokens_here:
        return (f"the sender ({src}) sends {head.get('tokens')} token rows but {here} has {tokens_here} slots; row i lands in slot i", [])
    return None, order


def _src_desc(head: dict) -> str:
    return f"rank {head.get('rank')}'s {head.get('format')} ({head.get('describe')})"


# -- one side's tables, cached per layout --------------------------------------------------


class _Side:
    """One cache's table, wire form and kernels for sending or receiving."""

    def __init__(self, layout: KVLayout, table: StrideTable):
        self.layout = layout
        self.table = table
        self.wire = _wire(table)
        self.sig = _sig(table)
        self.num_slots = layout.page_buffer_size
        self.prep = None
        self.bitmap = None
        self._views: dict = {}
        self._kernels: dict = {}

    def kernel(self, wire_device_type: str):
        k = self._kernels.get(wire_device_type)
        if k is None:
            k = self._kernels[wire_device_type] = select_kernel(
                self.layout.device.type, self.layout.format.name, wire_device_type, table=self.wire.table
            )
        return k

    def native(self, emulate: bool = False):
        """The prepared native plan of the wire table (the GPU engine; ``emulate``: its CPU
        emulation), or None when the native op library does not serve this table."""
        if self.prep is None:
            from kvcore.kernels.native import CPU_KERNEL, CUDA_KERNEL, prepare

            want = CPU_KERNEL if emulate else CUDA_KERNEL
            dev_type = "cpu" if emulate else "cuda"
            if self.kernel(dev_type) is want and _build.MODULE is not None and hasattr(_build.MODULE, "p2p_gate"):
                self.prep = prepare(self.wire.table)
            else:
                self.prep = False
        return self.prep or None

    def views(self, buf: torch.Tensor, offset: int, n: int):
        key = (buf.data_ptr(), offset, n)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 8:
                self._views.clear()
            v = self._views[key] = self.wire.views(buf[offset:], n)
        return v


def _side(layout: KVLayout, layers, heads, what: str, roles: tuple | None = None) -> _Side:
    """The side of ``layout`` for these layers and heads (receiver: planes in ``roles`` order),
    cached on the layout.

    Raises:
        TransferError: a bad layer selection or head range.
    """
    lk = layers if (layers is None or layers.__class__ is int) else (("L", *layers) if isinstance(layers, (list, tuple, range)) else None)
    try:
        key = (lk, heads, roles) if lk is not None or layers is None else None
        hash(key)
    except TypeError:
        key = None
    cache = getattr(layout, "_kvcore_p2p_sides", None)
    if cache is None:
        cache = layout._kvcore_p2p_sides = {}
    if key is not None:
        s = cache.get(key)
        if s is not None:
            return s
    sel = _layers(layout, layers)
    table = layout.stride_table(None if sel == list(range(layout.num_layers)) else sel)
    table = _select(table, head_range(heads, what, layout), what)
    if roles is not None:
        by_role = {p.role: p for p in table.planes}
        ordered = tuple(by_role[r] for r in roles)
        if ordered != table.planes:
            table = replace(table, planes=ordered)
    s = _Side(layout, table)
    if key is not None:
        if len(cache) > 32:
            cache.clear()
        cache[key] = s
    return s


# -- the GPU engine ----------------------------------------------------------------------


class _Ring:
    """Two staging chunks of one device and direction, reused across calls. Per chunk:
    the NCCL work that last read or wrote it and the event after the kernel that last
    unpacked it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cap = 0
        self.bufs: list[torch.Tensor] = []
        self.work: list = [None, None]
        self.free: list = [None, None]
        self.k = 0
        self.retired: list = []
        self.gen = 0  # bumped whenever the buffers change: precomputed slices of them are stale

    def ensure(self, nbytes: int) -> None:
        if self.retired:
            self.retired = [r for r in self.retired if not _done_all(r)]
        if nbytes <= self.cap:
            return
        if self.bufs:
            self.retired.append((self.bufs, self.work, self.free))
        self.cap = nbytes
        self.gen += 1
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.work = [None, None]
        self.free = [None, None]
        if self.device.type == "cuda":
            # the NCCL stream does not wait for the current stream: the memory's earlier users
            # there (the caching allocator's stream) must be done
            torch.cuda.current_stream(self.device).synchronize()

    def next(self) -> int:
        k = self.k
        self.k ^= 1
        return k


def _done_all(r) -> bool:
    _, works, events = r
    return all(w is None or _done(w) for w in works) and all(e is None or e.query() for e in events)


def _done(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:
        return True


@dataclass
class _InFlight:
    """A GPU transfer whose NCCL operations may still be running."""

    what: str  # "kvcore.send to rank 1" / "kvcore.recv from rank 0"
    sending: bool
    works: list  # (work, chunk index or -1, first row, end row)
    chunks: int
    tokens: int
    deadline: float
    timeout: float
    slots: torch.Tensor | None
    keep: tuple


class _Cuda:
    """Per-device state of the GPU engine."""

    def __init__(self, device: torch.device):
        self.device = device
        self.xs = torch.cuda.Stream(device)  # NCCL operations are posted from here
        self.ks = torch.cuda.Stream(device)  # the sender reads the receiver's answers here
        self.rings = {True: _Ring(device), False: _Ring(device)}
        self.inflight: deque[_InFlight] = deque()
        self.ev_main = torch.cuda.Event()  # reused: the posting stream waits for the current stream


_CUDA: dict[int, _Cuda] = {}


def _cuda(device: torch.device) -> _Cuda:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    st = _CUDA.get(idx)
    if st is None:
        st = _CUDA[idx] = _Cuda(torch.device("cuda", idx))
    return st


class _Ctl:
    """Per-call control buffers of a channel (a ring per channel): D, R0, V, flags; on a GPU
    the events that guard their reuse (the emulation waits on the host: no events)."""

    __slots__ = ("buf", "d", "r0", "v", "flag", "gate", "ev", "ev_check", "work", "device")

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.device = device
        self.buf = torch.zeros(HEADER_BYTES + 3 * CTL_BYTES, dtype=torch.uint8, device=device)
        if cuda:
            torch.cuda.current_stream(device).synchronize()  # as _Ring.ensure: the NCCL stream writes it unordered
        self.d = self.buf[:HEADER_BYTES]
        self.r0 = self.buf[HEADER_BYTES : HEADER_BYTES + CTL_BYTES]
        self.v = self.buf[HEADER_BYTES + CTL_BYTES : HEADER_BYTES + 2 * CTL_BYTES]
        flags = self.buf[HEADER_BYTES + 2 * CTL_BYTES :].view(torch.int32)
        self.flag, self.gate = flags[0:1], flags[1:2]
        self.ev = torch.cuda.Event() if cuda else _NoEvent()  # the last reader of R0 / V (sender) or D (receiver)
        self.ev_check = torch.cuda.Event() if cuda else _NoEvent()  # receiver: after the check that wrote V
        self.work = None


def _ctl(ch: _Channel, device: torch.device) -> _Ctl:
    if ch.ctl and ch.ctl[0].device != device:  # the channel moved to another device: new control buffers
        ch.ctl, ch.ctl_next = [], 0
    if len(ch.ctl) < _CTL_RING:
        ch.ctl.append(_Ctl(device))
        return ch.ctl[-1]
    c = ch.ctl[ch.ctl_next]
    ch.ctl_next = (ch.ctl_next + 1) % _CTL_RING
    return c


def _coalesced(g: _Group, pg, device, gpeer: int, ops, tag: int):
    """Post ``ops`` ((send?, tensor), ...) to the peer as one NCCL group; one work."""
    if g.coalesce:
        pg._start_coalescing(device)
        try:
            for send, t in ops:
                (pg.send if send else pg.recv)([t], gpeer, tag)
        finally:
            work = pg._end_coalescing(device)
        return work
    import torch.distributed as dist

    peer = g.ranks[gpeer]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if s else dist.irecv, t, peer, group=pg, tag=tag) for s, t in ops])
    return _Works(works)


class _Works:
    """Several works as one (a batch posted op by op). With ``timeout`` (host waits,
    emulation) ``wait`` blocks with that deadline and raises :class:`_PeerLost`."""

    def __init__(self, works, timeout: float | None = None):
        self.works = [w for w in works if w is not None]
        self.timeout = timeout
        self.done = False

    def wait(self, *a):
        if self.timeout is None:
            for w in self.works:
                w.wait()
            return
        if not self.done:
            for w in self.works:
                _wait(w, self.timeout)
            self.done = True

    def is_completed(self) -> bool:
        if self.timeout is not None:
            return self.done
        return all(w.is_completed() for w in self.works)


def _surface(device: torch.device, block: bool = False) -> None:
    """Raise what earlier GPU transfers on ``device`` left: a refusal found on the device,
    or a transfer past its deadline. ``block``: wait for every transfer in flight (with its
    deadline)."""
    st = _CUDA.get(device.index if device.index is not None else torch.cuda.current_device())
    if st is not None:
        q = st.inflight
        while q:
            f = q[0]
            pending = [(w, i, a, b) for (w, i, a, b) in f.works if not _done(w)]
            if not pending:
                q.popleft()
                continue
            if not block and time.monotonic() <= f.deadline:
                break
            w, i, a, b = pending[0]
            try:
                _poll(w, max(0.0, f.deadline - time.monotonic()) + 1e-3)
                f.works = [x for x in f.works if x[0] is not w]
                continue
            except _PeerLost as e:
                q.clear()
                raise _lost_error(f, i, a, b, e.reason) from None
    msg = _take_device_error()
    if msg:
        raise TransferError(msg)


def _take_device_error() -> str:
    global _take_device_error
    from kvcore.kernels.native import take_device_error

    _take_device_error = take_device_error
    return take_device_error()


def _lost_error(f: _InFlight, i: int, a: int, b: int, reason: str) -> TransferError:
    if f.sending:
        part = f"chunk {i} of {f.chunks} (token rows {a}..{b - 1}) was not delivered" if i >= 0 else "the answer did not arrive"
        return TransferError(
            f"{f.what}: {part}: {reason}. The receiver's slots for token rows {max(a, 0)}..{f.tokens - 1} were not written by this "
            "transfer; destroy and re-create the process group before the next transfer"
        )
    if i < 0:
        return TransferError(f"{f.what}: the last message was not delivered: {reason}; every chunk was landed")
    slots = "unknown"
    if f.slots is not None and not f.slots.is_cuda:
        slots = _slot_list(f.slots[a:b])
    elif f.slots is not None:
        # a side stream: the current stream may wait behind the lost chunk
        with torch.cuda.stream(torch.cuda.Stream(f.slots.device)):
            slots = _slot_list(f.slots[a:b].cpu())
    landed = f"chunks 0..{i - 1} (rows 0..{a - 1}) were landed; " if i else "no chunk was landed; "
    return TransferError(
        f"{f.what}: chunk {i} of {f.chunks} (rows {a}..{b - 1}) did not arrive: {reason}. Destination slots {slots} (that chunk) "
        f"were not written, nor the slots of rows {b}..{f.tokens - 1}; {landed}nothing else was touched. Destroy and re-create the "
        "process group before the next transfer"
    )


def _drain(device=None) -> None:
    """:func:`kvcore.synchronize`'s part: wait for the GPU transfers in flight (deadlines
    enforced) and raise what they left."""
    if not _CUDA:
        return
    devs = list(_CUDA.values()) if device is None else [_cuda(torch.device(device))]
    for st in devs:
        _surface(st.device, block=True)


def release_staging() -> None:
    """Free the staging chunks kvcore.send / kvcore.recv keep between calls (they are
    allocated again by the next transfer). Waits for the transfers in flight."""
    for st in list(_CUDA.values()):
        _surface(st.device, block=True)
        torch.cuda.synchronize(st.device)
        for r in st.rings.values():
            r.bufs, r.cap, r.retired = [], 0, []
            r.work, r.free = [None, None], [None, None]
            r.gen += 1
    for g in _GROUPS.values():
        for wg in g.graphs.values():
            wg.clear()
    _HOST_RINGS.clear()


# -- send --------------------------------------------------------------------------------


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
    own layout. See the module docstring for the protocol. On a GPU with NCCL a call that
    repeats its channel's agreed geometry and token count only enqueues work and returns;
    the current stream is ordered after the packing (the cache may be changed afterwards).

    Args:
        layout: the sender's cache (from :func:`kvcore.detect`); on a GPU with NCCL, on the
            CPU with Gloo (a GPU cache with Gloo is packed into pinned host chunks).
        slots: int64 ``[T]``; a negative slot is padding: the receiver leaves that row alone.
        dst: the receiver's global rank.
        heads: ``(start, stop)``: send only KV heads ``start..stop-1`` (a TP split: each
            decode rank receives its share of the heads).
        layers: the sender's layers to send (default all), in the order they land.
        group: the process group (default: the world).
        chunk_bytes: bytes per staging chunk (two are kept; a chunk holds at least one
            token), agreed in the handshake that opens the channel or changes its geometry
            or token count. Default: half of the transfer (CPU: a quarter), at least 16 MiB
            (CPU: 2 MiB) and at most 256 MiB (CPU: 8 MiB).
        timeout: seconds (or a timedelta) each message may take (default
            ``KVCORE_P2P_TIMEOUT`` or 300).
        tag: the point-to-point tag: one channel per tag (Gloo also tells concurrent
            transfers apart by it).

    Raises:
        TransferError: the sender's own arguments are bad (a slot out of range, a head
            range past its heads, a bad rank; the receiver is told and raises too), the
            receiver refused (its message is included: other planes, head counts, widths,
            dtypes, layer or token counts, its own bad slots), the two calls do not match,
            or the receiver disappeared (the token rows not delivered are named). On a GPU
            a refusal found on a device is raised by the next kvcore CUDA call or
            :func:`kvcore.synchronize` (module docstring).
    """
    with _device_of(layout):
        _send(layout, slots, dst, heads, layers, group, chunk_bytes, timeout, tag)


def _device_of(layout):
    if isinstance(layout, KVLayout) and layout.device.type == "cuda":
        return torch.cuda.device(layout.device)
    return contextlib.nullcontext()


def _check_layout(layout, what: str) -> None:
    if not isinstance(layout, KVLayout):
        raise TransferError(f"the {what} cache must be a KVLayout (from kvcore.detect), got {type(layout).__name__}")
    if layout.device.type == "meta":
        raise TransferError(f"the {what} layout describes tensors on the meta device (shapes without memory): it cannot be moved")


def _wire_device(layout, g: _Group) -> torch.device:
    backend = g.backend
    if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in backend:
        return layout.device
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        if not isinstance(layout, KVLayout) or layout.device.type != "cuda":
            raise TransferError(f"the process group's backend is {backend}, which moves CUDA tensors only, but this cache is on the CPU")
    return torch.device("cpu")


def _slots_arg(slots, layout: KVLayout, what: str) -> torch.Tensor:
    """The slots as a 1-D int64 tensor on the cache's device (no value checks)."""
    s = slots
    if s.__class__ is torch.Tensor and s.dtype is torch.int64 and s.device == layout.device and _dense(s) and s.dim() == 1:
        return s
    s = _index_tensor(slots, what)
    if s.dim() != 1:
        raise TransferError(f"{what} must be 1-D [T], got shape {tuple(s.shape)}")
    return s.to(device=layout.device, dtype=torch.int64).contiguous()


def _send(layout, slots, dst, heads, layers, group, chunk_bytes, timeout, tag) -> None:
    tmo = _timeout(timeout)
    g, pg = _group(group, dst, "dst")
    err: TransferError | None = None
    wdev = torch.device("cpu")
    side = s = None
    t = 0
    try:
        _check_layout(layout, "sending")
        wdev = _wire_device(layout, g)
        side = _side(layout, layers, heads, "heads")
        s = _slots_arg(slots, layout, "slots")
        t = int(s.shape[0])
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
            raise TransferError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    except TransferError as e:
        err = e
        if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in g.backend:
            wdev = layout.device
    if wdev.type == "cuda":
        _surface(wdev)
    ch = _channel(g, dst, tag, True)
    ch.check(f"kvcore.send to rank {dst}")
    ag = ch.agreement
    if err is None and ag is not None and ag.sig == side.sig and ag.layers == side.table.num_layers and ag.tokens == t:
        _send_fast(ch, ag, g, pg, dst, wdev, side, s, tmo, tag)
        return
    ag = _send_slow(ch, g, pg, dst, wdev, layout, side, s, t, heads, chunk_bytes, err, tmo, tag)
    _send_fast(ch, ag, g, pg, dst, wdev, side, s, tmo, tag)


def _header(layout: KVLayout, side: _Side, heads, t: int, ct: int, me: int) -> dict:
    return {
        "kvcore": PROTOCOL,
        "ok": True,
        "format": layout.format.name,
        "describe": layout.describe(),
        "rank": me,
        "tokens": t,
        "layers": side.table.num_layers,
        "heads": list(head_range(heads, "heads") or (0, layout.num_heads)),
        "planes": [list(p) for p in side.sig],
        "chunk_tokens": ct,
        "token_bytes": side.wire.token_bytes,
    }


def _send_slow(ch, g, pg, dst, wdev, layout, side, s, t, heads, chunk_bytes, err, tmo, tag) -> _Agreement:
    """The handshake: D and R0 read on both hosts, then the receiver's status. Returns the
    new agreement, or raises (after completing the receiver's transfer when it is fast)."""
    _STATS["handshakes"] += 1
    ag = ch.agreement
    epoch = (ag.epoch + 1) if ag is not None else 1
    head: dict
    if err is None:
        try:
            _check_slots(layout, s, "slots", False)
        except TransferError as e:
            err = e
    if err is None:
        ct = _chunk_tokens(side.wire.token_bytes, t, chunk_bytes, layout.device.type)
        head = _header(layout, side, heads, t, ct, g.me)
    else:
        ct = 1
        head = {"kvcore": PROTOCOL, "ok": False, "rank": g.me, "error": str(err)}
    d = _message(_ctl_record(MAGIC, SLOW, epoch, t, 0 if err is None else 1), head, HEADER_BYTES).to(wdev)
    r0 = torch.zeros(CTL_BYTES, dtype=torch.uint8, device=wdev)
    what = f"kvcore.send to rank {dst}"
    try:
        _exchange(g, pg, dst, wdev, [(True, d), (False, r0)], tag, tmo)
    except _PeerLost as e:
        if err is not None:
            raise err from None
        raise TransferError(f"{what}: the receiver did not answer the header: {e.reason}; nothing was sent") from None
    rec, _ = _read(r0, "answer", False)
    if rec[_F_MODE] == FAST:
        # the receiver repeats the agreed transfer: this call does not match it
        if ag is None or rec[_F_EPOCH] != ag.epoch:
            raise TransferError(
                f"{what}: the receiver's channel state is out of step with this side's; destroy and re-create the process group"
            )
        _complete_refused_send(g, pg, dst, wdev, ag, tag, tmo)
        if err is not None:
            raise err  # the receiver's gate refused the transfer: it raises too
        why, _ = _mismatch(head, ag.sig, ag.layers, ag.tokens, _src_desc(head), f"rank {dst}'s {ag.peer_desc}", "the receiver")
        why = why or "this call differs from the transfer this channel agreed on"
        raise TransferError(
            f"{what}: the receiver refused and wrote nothing: {why} (the receiver repeats the transfer this channel agreed on, "
            f"{ag.tokens} token rows; the two calls do not match, both sides raise)"
        )
    if err is not None:
        raise err
    status = torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=wdev)
    try:
        _exchange(g, pg, dst, wdev, [(False, status)], tag, tmo)
    except _PeerLost as e:
        raise TransferError(f"{what}: the receiver did not answer: {e.reason}; nothing was sent") from None
    _, st = _read(status, "status", True)
    if not st.get("ok"):
        raise TransferError(f"{what}: the receiver refused and wrote nothing: {st.get('error')}")
    new = _Agreement(side.sig, side.table.num_layers, t, ct, side.wire.token_bytes, epoch, peer_desc=st.get("describe", ""))
    new.dfast = _message(_ctl_record(MAGIC, FAST, epoch, t, 0), None, HEADER_BYTES).to(wdev)
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).synchronize()  # sent from the side stream, which does not wait for this one
    ch.agreement = new
    return new


def _exchange(g, pg, peer, wdev, ops, tag, tmo) -> None:
    """Post ``ops`` and wait for them on the host (the slow path)."""
    if wdev.type == "cuda":
        work = _coalesced(g, pg, wdev, g.index[peer], ops, tag)
        try:
            work._kvcore_poll = True
        except AttributeError:
            work = _Polled(work)
        _wait(work, tmo)
        return
    works = [_post(snd, t, peer, pg, tag) for snd, t in ops]
    for w in works:
        _wait(w, tmo)


def _wire_groups(ag: _Agreement, bounds, buf: torch.Tensor, sending: bool, v: torch.Tensor) -> list[list[tuple[bool, torch.Tensor]]]:
    """The point-to-point groups of one agreed transfer, as ``(send?, tensor)`` ops: chunk
    ``i`` from ``buf`` (the header prefix only with the first), and the receiver's verdict
    ``v`` travelling the other way with the last chunk (alone when there are no chunks).
    ``sending``: this side sends the chunks (and receives ``v``)."""
    groups = []
    for i, (a, b) in enumerate(bounds):
        lo = 0 if i == 0 else ag.prefix_bytes
        groups.append([(sending, buf[lo : ag.prefix_bytes + (b - a) * ag.token_bytes])])
    if groups:
        groups[-1].append((not sending, v))
    else:
        groups.append([(not sending, v)])
    return groups


def _complete_refused_send(g, pg, dst, wdev, ag: _Agreement, tag, tmo) -> None:
    """Feed a fast receiver the agreed transfer's messages (refused: the D it read says slow)."""
    ring = _host_ring(True, wdev) if wdev.type == "cpu" else _cuda(wdev).rings[True]
    need = ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes
    ring.ensure(need)
    v = torch.zeros(CTL_BYTES, dtype=torch.uint8, device=wdev)
    bounds = ag.bounds()
    buf = ring.bufs[0]
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).wait_stream(_cuda(wdev).xs)
        for w in ring.work:
            if w is not None:
                w.wait()
    buf[:CTL_BYTES].copy_(_ctl_record(MAGIC, 0, ag.epoch, ag.tokens, 8).to(wdev))
    for ops in _wire_groups(ag, bounds, buf, True, v):
        try:
            _exchange(g, pg, dst, wdev, ops, tag, tmo)
        except _PeerLost:
            return


def _send_fast(ch: _Channel, ag: _Agreement, g, pg, dst, wdev, side: _Side, s: torch.Tensor, tmo: float, tag: int) -> None:
    ch.calls += 1
    _STATS["fast"] += 1
    with _step(ch):
        _send_fast_any(ch, ag, g, pg, dst, wdev, side, s, tmo, tag)


class _Done(Exception):
    """Raised inside a fast transfer once all its messages were posted: a refusal to report."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self.msg = msg


class _step:
    """A fast transfer: an exception before all its messages were posted leaves the two
    sides out of step (the channel is marked broken); a refusal after it (:class:`_Done`)
    is raised as a TransferError."""

    __slots__ = ("ch",)

    def __init__(self, ch: _Channel):
        self.ch = ch

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if e is None:
            return False
        if isinstance(e, _Done):
            raise TransferError(e.msg) from None
        if isinstance(e, TransferError) and "destroy and re-create the process group" in str(e).lower():
            self.ch.broken = str(e)[:300]
        else:
            self.ch.broken = f"{type(e).__name__}: {str(e)[:300]}"
        return False


def _dev_engine(ch: _Channel, wdev, g, pg, peer, tag, tmo) -> _DevEngine:
    """The channel's GPU engine, made current (the current stream and the timeout of this call)."""
    e = ch.eng
    if e is None or e.pg is not pg or e.g is not g or e.dev != wdev:
        e = ch.eng = _DevEngine(wdev, g, pg, peer, tag, tmo)
        return e
    e.main = torch.cuda.current_stream(wdev)
    e.tmo = tmo
    return e


def _send_fast_any(ch, ag, g, pg, dst, wdev, side, s, tmo, tag) -> None:
    if wdev.type == "cuda" and side.native() is not None:
        _send_fast_dev(_dev_engine(ch, wdev, g, pg, dst, tag, tmo), ch, ag, dst, side, s)
    elif wdev.type == "cpu" and _emulate() and side.layout.device.type == "cpu" and side.native(emulate=True) is not None:
        _send_fast_dev(_EmuEngine(g, pg, dst, tag, tmo, True), ch, ag, dst, side, s)
    else:
        _send_fast_host(ch, ag, g, pg, dst, wdev, side, s, tmo, tag)


def _emulate() -> bool:
    """``KVCORE_P2P_EMULATE=1``: run the GPU engine's fast path on the CPU over Gloo (the same
    messages, the native CPU control functions and gated kernels, host waits): for tests."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(b"KVCORE_P2P_EMULATE") == b"1"
    return os.environ.get("KVCORE_P2P_EMULATE", "") == "1"


class _DevEngine:
    """The GPU engine: NCCL groups posted from a side stream, kernels on the current stream,
    the sender's reading of the answers on a second side stream; nothing waits on the host."""

    emulated = False

    def __init__(self, dev, g, pg, peer, tag, tmo):
        st = _cuda(dev)
        self.st, self.dev, self.g, self.pg, self.gpeer, self.tag, self.tmo = st, dev, g, pg, g.index[peer], tag, tmo
        self.main = torch.cuda.current_stream(dev)
        self.xs, self.ks = st.xs, st.ks

    def ring(self, sending: bool) -> _Ring:
        return self.st.rings[sending]

    def ctl(self, ch: _Channel) -> _Ctl:
        return _ctl(ch, self.dev)

    def on(self, stream):
        return _On(stream, self.main)

    def xs_after_main(self) -> None:
        """The posting stream waits for everything on the current stream so far."""
        ev = self.st.ev_main
        ev.record(self.main)
        self.xs.wait_event(ev)

    def post(self, ops, key=None):
        """Post one group from the current stream (the posting stream); with graphs on
        (``KVCORE_P2P_GRAPH=1``) and a ``key`` (the group's operations, see :class:`_Program`),
        replay its captured graph instead."""
        if key is not None and p2p_graph.enabled():
            wg = self.g.graphs.get(self.dev.index)
            if wg is None:
                wg = self.g.graphs[self.dev.index] = WireGraphs()
            w = wg.post((self.gpeer, self.tag, key), lambda: self._post(ops))
            if w is not None:
                return w
        return self._post(ops)

    def _post(self, ops):
        return _coalesced(self.g, self.pg, self.dev, self.gpeer, ops, self.tag)

    def after(self, work) -> None:
        work.wait()  # the current stream waits for the NCCL group (the host does not)

    def wait_event(self, stream, ev) -> None:
        if ev is not None:
            stream.wait_event(ev)

    def record(self, ev, stream) -> None:
        ev.record(stream)

    def event(self):
        return torch.cuda.Event()

    def keep(self, f: _InFlight) -> None:
        self.st.inflight.append(f)


class _On:
    """Make ``stream`` current, then ``main`` again."""

    __slots__ = ("stream", "main")

    def __init__(self, stream, main):
        self.stream, self.main = stream, main

    def __enter__(self):
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *a):
        torch.cuda.set_stream(self.main)
        return False


class _NoEvent:
    def query(self) -> bool:
        return True

    def record(self, *a) -> None:
        pass


class _EmuEngine:
    """The GPU engine's fast path on the CPU (tests): the same messages and kernels, posted
    one by one to Gloo, every wait on the host."""

    emulated = True
    _rings: dict = {}

    def __init__(self, g, pg, peer, tag, tmo, sending):
        self.pg, self.peer, self.tag, self.tmo = pg, peer, tag, tmo
        self.main = self.xs = self.ks = None

    def ring(self, sending: bool) -> _Ring:
        r = _EmuEngine._rings.get(sending)
        if r is None:
            r = _EmuEngine._rings[sending] = _Ring(torch.device("cpu"))
        return r

    def ctl(self, ch: _Channel) -> _Ctl:
        return _ctl(ch, _CPU)  # every message of a call is waited for in the call: reuse is safe

    def on(self, stream):
        return contextlib.nullcontext()

    def xs_after_main(self) -> None:
        pass

    def post(self, ops, key=None):
        return _Works([_post(snd, t, self.peer, self.pg, self.tag) for snd, t in ops], self.tmo)

    def after(self, work) -> None:
        work.wait()

    def wait_event(self, stream, ev) -> None:
        pass

    def record(self, ev, stream) -> None:
        pass

    def event(self):
        return _NoEvent()

    def keep(self, f: _InFlight) -> None:
        pass


# -- the fast path's programs (issue 26) -----------------------------------------------------
#
# Everything a fast transfer posts is fixed by the agreement: the chunk bounds, the staging
# slices, the kernels' staging arguments and the point-to-point groups (one group per chunk;
# the control messages travel with the first and the last chunk: one group per call when the
# transfer is one chunk). A :class:`_Program` computes them once per agreement, side and
# staging buffers, so that a fast call only walks it; with ``KVCORE_P2P_GRAPH=1`` the GPU
# engine replays each group from a CUDA graph keyed by :meth:`_Program.group`'s key
# (kvcore/p2p_graph.py).


class _Program:
    """One side's fast transfer under one agreement, precomputed.

    ``chunk(k, i)``: chunk ``i``'s wire bytes in staging buffer ``k`` (with the prefix for
    chunk 0) and its kernels' staging list; ``head(k)``: the sender's verdict record and
    padding mask, or the receiver's prefix, in buffer ``k``; ``group(k, i, ctl)``: the
    operations of chunk ``i``'s group (``i = -1``: the control messages alone, no tokens)
    and their key (direction, address, bytes of each operation). Built lazily, kept while the
    agreement and the staging buffers last.
    """

    __slots__ = (
        "ag",
        "side",
        "prep",
        "plan",
        "ring",
        "gen",
        "sending",
        "P",
        "tb",
        "T",
        "K",
        "bounds",
        "what",
        "_chunks",
        "_heads",
        "_groups",
    )

    def __init__(self, ag: _Agreement, side: _Side, prep, ring: _Ring, sending: bool, what: str):
        self.ag, self.side, self.prep, self.plan, self.ring, self.gen = ag, side, prep, prep.plan, ring, ring.gen
        self.sending = sending
        self.P, self.tb, self.T = ag.prefix_bytes, ag.token_bytes, ag.tokens
        self.bounds = ag.bounds()
        self.K = len(self.bounds)
        self.what = what
        self._chunks: dict = {}
        self._heads: dict = {}
        self._groups: dict = {}

    def chunk(self, k: int, i: int):
        c = self._chunks.get((k, i))
        if c is None:
            a, b = self.bounds[i]
            buf, P, n = self.ring.bufs[k], self.P, b - a
            wire = buf[: P + n * self.tb] if i == 0 else buf[P : P + n * self.tb]
            c = self._chunks[(k, i)] = (wire, self.prep.staging_list(self.side.wire.views(buf[P:], n)))
        return c

    def head(self, k: int):
        h = self._heads.get(k)
        if h is None:
            buf = self.ring.bufs[k]
            h = self._heads[k] = (buf[:CTL_BYTES], buf[CTL_BYTES : self.P]) if self.sending else buf[: self.P]
        return h

    def group(self, k: int, i: int, ctl: _Ctl):
        key = (k, i, id(ctl))
        g = self._groups.get(key)
        if g is None or g[2] is not ctl:
            snd, ag = self.sending, self.ag
            first = [(True, ag.dfast), (False, ctl.r0)] if snd else [(False, ctl.d), (True, ag.r0fast)]
            if i < 0:
                ops = [*first, (not snd, ctl.v)]
            else:
                ops = [*first, (snd, self.chunk(k, 0)[0])] if i == 0 else [(snd, self.chunk(k, i)[0])]
                if i == self.K - 1:
                    ops.append((not snd, ctl.v))  # the receiver's verdict V travels with the last chunk
            g = self._groups[key] = (ops, tuple((o, t.data_ptr(), t.nbytes) for o, t in ops), ctl)
        return g[0], g[1]


def _program(ag: _Agreement, side: _Side, ring: _Ring, prep, emulated: bool, sending: bool, peer: int) -> _Program:
    progs = ag.programs
    key = (id(side), emulated)
    prog = progs.get(key)
    if prog is None or prog.side is not side or prog.gen != ring.gen:
        if len(progs) > 8:
            progs.clear()
        what = f"kvcore.send to rank {peer}" if sending else f"kvcore.recv from rank {peer}"
        prog = progs[key] = _Program(ag, side, prep, ring, sending, what)
    return prog


def _native_module():
    """The native op library (loaded: a fast path runs only when :meth:`_Side.native` found it)."""
    return _build.MODULE


def _send_fast_dev(eng, ch, ag, dst, side, s) -> None:
    """The sender's fast transfer on the GPU engine (or its CPU emulation): per chunk the
    slot check (first chunk), the packing and one group; the receiver's answers read on a
    side stream."""
    mod = _native_module()
    ring = eng.ring(True)
    ring.ensure(ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes)
    prog = _program(ag, side, ring, side.native(emulate=eng.emulated), eng.emulated, True, dst)
    xs, plan, K, calls = eng.xs, prog.plan, prog.K, ch.calls
    ctl = eng.ctl(ch)
    works = []
    errors = []
    try:
        if K == 0:  # no tokens: the D / R0 / V exchange alone
            with eng.on(xs):
                eng.xs_after_main()
                if ctl.work is not None:
                    eng.wait_event(xs, ctl.ev)
                works.append((eng.post(*prog.group(0, -1, ctl)), -1, 0, 0))
        for i in range(K):
            a, b = prog.bounds[i]
            k = ring.next()
            if ring.work[k] is not None:
                eng.after(ring.work[k])  # the current stream waits until the chunk buffer's last send read it
            if i == 0:
                rep, mask = prog.head(k)
                rc = mod.p2p_check(s, side.num_slots, None, 0, None, ctl.flag, rep, MAGIC, FAST, ag.epoch, mask, _OP_SEND, calls, dst)
                if rc < 0:
                    raise TransferError(mod.copy_last_error())
                if rc > 0:  # the CPU answers at once (a GPU records a refusal on the device)
                    errors.append(mod.copy_last_error())
            rc = plan.run_gated(True, s if K == 1 else s[a:b], prog.chunk(k, i)[1], _NO_GATE)
            if rc:
                raise TransferError(f"{prog.what}: packing chunk {i} was refused: {mod.last_error()}")
            with eng.on(xs):
                eng.xs_after_main()
                if i == 0 and ctl.work is not None:
                    eng.wait_event(xs, ctl.ev)  # the last reader of this control slot's R0 / V
                w = eng.post(*prog.group(k, i, ctl))
            ring.work[k] = w
            works.append((w, i, a, b))
        # the receiver's answers, read on a side stream: the current stream does not wait for the wire
        w_last = works[-1][0]
        with eng.on(eng.ks):
            for w, *_ in works if eng.emulated else works[-1:]:
                eng.after(w)  # GPU: the last group (the NCCL stream runs them in order)
            rc = mod.p2p_verdict(ctl.r0, ctl.v, MAGIC, ag.epoch, ag.tokens, None, calls, dst)
            eng.record(ctl.ev, eng.ks)
        if rc < 0:
            raise TransferError(mod.copy_last_error())
        if rc > 0:
            errors.append(mod.copy_last_error())
    except _PeerLost as e:  # emulation: a host wait ran out
        i, a, b = next(((i, a, b) for w, i, a, b in works if not _done(w)), (-1, 0, 0))
        f = _InFlight(prog.what, True, works, K, ag.tokens, 0.0, eng.tmo, None, ())
        raise _lost_error(f, i, a, b, e.reason) from None
    ctl.work = w_last
    eng.keep(_InFlight(prog.what, True, works, K, ag.tokens, time.monotonic() + eng.tmo, eng.tmo, None, (ag.dfast, s)))
    if errors:
        raise _Done(errors[0])


# -- host engine (Gloo) --------------------------------------------------------------------

_HOST_RINGS: dict = {}


class _HostRing:
    def __init__(self, pin: bool):
        self.pin = pin
        self.cap = 0
        self.bufs: list[torch.Tensor] = []

    def ensure(self, nbytes: int) -> None:
        if nbytes > self.cap:
            self.cap = nbytes
            self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin) for _ in range(2)]
        self.work = [None, None]


def _host_ring(sending: bool, wdev, pin: bool = False) -> _HostRing:
    key = (sending, pin)
    r = _HOST_RINGS.get(key)
    if r is None:
        r = _HOST_RINGS[key] = _HostRing(pin)
    return r


def _check_values(src, src_n, dst, dst_n) -> tuple[int, int, int, int]:
    """The host twin of the device slot check: (kind, index, value, num_slots), kind 0 = ok."""
    if src is not None:
        bad = torch.nonzero(src >= src_n)
        if bad.numel():
            i = int(bad[0])
            return 1, i, int(src[i]), src_n
    if dst is not None:
        bad = torch.nonzero(dst >= dst_n)
        if bad.numel():
            i = int(bad[0])
            return 3, i, int(dst[i]), dst_n
        valid = dst[dst >= 0]
        if valid.numel() > 1:
            srt, _ = torch.sort(valid)
            same = srt[1:] == srt[:-1]
            if bool(same.any()):
                return 2, -1, int(srt[1:][same][0]), dst_n
    return 0, -1, 0, 0


def _send_fast_host(ch, ag, g, pg, dst, wdev, side, s, tmo, tag) -> None:
    """The fast transfer with every message waited for on the host (Gloo; a GPU cache packs
    into pinned host chunks)."""
    layout = side.layout
    cuda_cache = layout.device.type == "cuda"
    host_s = s.cpu() if s.is_cuda else s
    P, tb = ag.prefix_bytes, ag.token_bytes
    ring = _host_ring(True, wdev, pin=cuda_cache and wdev.type == "cpu")
    ring.ensure(P + ag.chunk_tokens * tb)
    kind, index, value, num = _check_values(host_s, side.num_slots, None, 0)
    what = f"kvcore.send to rank {dst}"
    kernel = side.kernel(wdev.type)
    r0 = torch.zeros(CTL_BYTES, dtype=torch.uint8)
    v = torch.zeros(CTL_BYTES, dtype=torch.uint8)
    bounds = ag.bounds()
    pending: list = [None, None]
    first_err = None

    def lost(i, a, b, e):
        return TransferError(
            f"{what}: chunk {i} of {len(bounds)} (token rows {a}..{b - 1}) was not delivered: {e.reason}. The receiver's slots for "
            f"token rows {a}..{ag.tokens - 1} were not written by this call; destroy and re-create the process group before the next "
            "transfer"
        )

    for i, (a, b) in enumerate(bounds):
        k = i % 2
        if pending[k] is not None:
            for w, (pi, pa, pb) in pending[k]:
                try:
                    _wait(w, tmo)
                except _PeerLost as e:
                    raise lost(pi, pa, pb, e) from None
            pending[k] = None
        buf = ring.bufs[k]
        if i == 0:
            buf[:CTL_BYTES] = _ctl_record(MAGIC, 0, ag.epoch, ag.tokens, kind, index, value, num)
            buf[CTL_BYTES : CTL_BYTES + ag.tokens] = (host_s >= 0).to(torch.uint8)
        valid = s[a:b] >= 0 if kind == 0 else None
        n_valid = int(valid.sum()) if valid is not None else 0
        if n_valid:
            kernel.gather(TransferPlan(table=side.wire.table, slots=s[a:b], staging=side.wire.views(buf[P:], b - a), num_valid=n_valid))
            if cuda_cache:
                torch.cuda.current_stream(layout.device).synchronize()  # Gloo reads the pinned chunk from the host
        if i == 0:
            ops = [(True, ag.dfast), (False, r0), (True, buf[: P + (b - a) * tb])]
        else:
            ops = [(True, buf[P : P + (b - a) * tb])]
        if i == len(bounds) - 1:
            ops.append((False, v))  # the receiver posts it with the last chunk (one chunk: alone); Gloo matches in order
        pending[k] = [(_post(snd, t, dst, pg, tag), (i, a, b)) for snd, t in ops]
    if not bounds:
        pending[0] = [(_post(snd, t, dst, pg, tag), (-1, 0, 0)) for snd, t in [(True, ag.dfast), (False, r0), (False, v)]]
    for part in pending:
        for w, (pi, pa, pb) in part or ():
            try:
                _wait(w, tmo)
            except _PeerLost as e:
                if pi < 0:
                    raise TransferError(f"{what}: the receiver did not answer: {e.reason}") from None
                raise lost(pi, pa, pb, e) from None
    if kind:
        raise _Done(
            f"{what} was refused and wrote nothing: slots[{index}] = {value} is out of range: this cache has {num} slots per layer "
            f"(valid 0..{num - 1}; negative slots are padding and are skipped); the receiver wrote nothing and raises too"
        )
    rr = r0.view(torch.int64).tolist()
    vv = v.view(torch.int64).tolist()
    if rr[_F_MAGIC] != MAGIC or vv[_F_MAGIC] != MAGIC:
        first_err = f"{what}: the receiver's answer is not kvcore's: both sides must call kvcore.send / kvcore.recv in the same order"
    elif rr[_F_MODE] != FAST or rr[_F_EPOCH] != ag.epoch or rr[_F_TOKENS] != ag.tokens:
        first_err = (
            f"{what}: the receiver (rank {dst}) was called with {rr[_F_TOKENS]} token rows or another geometry than this channel agreed "
            f"on ({ag.tokens} rows), so it did not take this transfer; both sides raise, nothing was written"
        )
    elif vv[_F_VERDICT]:
        vk, vi, vval, vn = vv[_F_VERDICT], vv[_F_INDEX], vv[_F_VALUE], vv[_F_NUM]
        why = (
            f"destination slot {vval} appears more than once in its slots"
            if vk == 2
            else f"its slots[{vi}] = {vval} is out of range: it has {vn} slots per layer"
        )
        first_err = f"{what}: the receiver (rank {dst}) refused and wrote nothing: {why}"
    if first_err:
        raise _Done(first_err)


# -- recv --------------------------------------------------------------------------------


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

    On a GPU with NCCL a call that repeats its channel's agreed geometry and token count
    only enqueues work and returns; the current stream is ordered after the unpacking.

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
            counts: both sides raise, nothing is written), the sender refused, the two
            calls do not match, or the sender disappeared (the destination slots of the
            unfinished chunk are named: they and all later rows were not written; earlier
            chunks were landed). On a GPU a refusal found on a device is raised by the
            next kvcore CUDA call or :func:`kvcore.synchronize` (module docstring).
    """
    with _device_of(layout):
        _recv(layout, slots, src, heads, layers, group, timeout, tag)


def _recv(layout, slots, src, heads, layers, group, timeout, tag) -> None:
    tmo = _timeout(timeout)
    g, pg = _group(group, src, "src")
    err: TransferError | None = None
    wdev = torch.device("cpu")
    s = None
    t = 0
    ch = _channel(g, src, tag, False)
    ch.check(f"kvcore.recv from rank {src}")
    ag = ch.agreement
    side = None
    try:
        _check_layout(layout, "receiving")
        wdev = _wire_device(layout, g)
        s = _slots_arg(slots, layout, "slots")
        t = int(s.shape[0])
        side = _recv_side(ch, layout, layers, heads, ag)
    except TransferError as e:
        err = e
        if isinstance(layout, KVLayout) and layout.device.type == "cuda" and "nccl" in g.backend:
            wdev = layout.device
    if wdev.type == "cuda":
        _surface(wdev)
    if err is None and ag is not None and side.sig == ag.sig and side.table.num_layers == ag.layers and ag.tokens == t:
        _recv_fast(ch, ag, g, pg, src, wdev, side, s, tmo, tag)
        return
    ag, side = _recv_slow(ch, g, pg, src, wdev, layout, side, s, t, layers, heads, err, tmo, tag)
    _recv_fast(ch, ag, g, pg, src, wdev, side, s, tmo, tag)


def _recv_side(ch: _Channel, layout, layers, heads, ag: _Agreement | None) -> _Side:
    """The receiving side of ``layout``, its planes in the sender's order when the agreement
    has the same roles (remembered per channel for the same arguments and agreement)."""
    m = ch.side_memo
    if m is not None and m[0] is layout and m[1] is ag and m[2] is layers and m[3] == heads:
        return m[4]
    roles = tuple(p[0] for p in ag.sig) if ag is not None else None
    base = _side(layout, layers, heads, "heads")
    side = base
    if roles is not None and sorted(roles) == sorted(p.role for p in base.table.planes):
        side = _side(layout, layers, heads, "heads", roles)
    ch.side_memo = (layout, ag, layers, heads, side)
    return side


def _recv_slow(ch, g, pg, src, wdev, layout, side, s, t, layers, heads, err, tmo, tag):
    _STATS["handshakes"] += 1
    ag = ch.agreement
    what = f"kvcore.recv from rank {src}"
    if err is None:
        try:
            _check_slots(layout, s, "slots", True)
        except TransferError as e:
            err = e
    d = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=wdev)
    r0 = _ctl_record(MAGIC, SLOW, ag.epoch if ag is not None else 0, t, 0 if err is None else 1).to(wdev)
    try:
        _exchange(g, pg, src, wdev, [(False, d), (True, r0)], tag, tmo)
    except _PeerLost as e:
        where = f"; destination slots {_slot_list(s.cpu())} were not written" if s is not None else ""
        raise TransferError(f"{what}: no header arrived: {e.reason}{where}") from None
    rec, head = _read(d, "header", True)
    if rec[_F_MODE] == FAST:
        # the sender repeats the agreed transfer: this call does not match it
        if ag is None or rec[_F_EPOCH] != ag.epoch:
            raise TransferError(
                f"{what}: the sender's channel state is out of step with this side's; destroy and re-create the process group"
            )
        if err is None:
            mine = f"this {layout.format.name} ({layout.describe()})"
            why, _ = _mismatch(
                {"planes": [list(p) for p in ag.sig], "layers": ag.layers, "tokens": ag.tokens, "heads": None},
                side.sig,
                side.table.num_layers,
                t,
                ag.peer_desc,
                mine,
            )
            err = TransferError(
                f"{what}: {why or 'this call differs from the transfer this channel agreed on'} (the sender repeats the transfer this "
                f"channel agreed on, {ag.tokens} token rows; the two calls do not match, both sides raise, nothing was written)"
            )
        _complete_refused_recv(g, pg, src, wdev, ag, tag, tmo)
        raise err
    if not head.get("ok") or rec[_F_VERDICT]:
        raise TransferError(f"{what}: the sender refused and sent nothing: {head.get('error')}")
    planes = tuple(tuple(p) for p in head.get("planes") or ())
    if err is None:
        why, order = _mismatch(
            head, side.sig, side.table.num_layers, t, _src_desc(head), f"this {layout.format.name} ({layout.describe()})"
        )
        if why is not None:
            err = TransferError(why)
        else:
            side = _side(layout, layers, heads, "heads", tuple(p[0] for p in planes))
            if side.wire.token_bytes != head.get("token_bytes"):
                err = TransferError(f"the sender's rows are {head.get('token_bytes')} bytes per token, this side's {side.wire.token_bytes}")
    status = {"kvcore": PROTOCOL, "ok": err is None, "rank": g.me}
    if err is not None:
        status["error"] = f"rank {g.me}: {err}"
    else:
        status["describe"] = f"{layout.format.name} ({layout.describe()})"
    try:
        _exchange(g, pg, src, wdev, [(True, _message(_ctl_record(MAGIC), status, STATUS_BYTES).to(wdev))], tag, tmo)
    except _PeerLost as e:
        if err is None:
            raise TransferError(f"{what}: the status could not be returned: {e.reason}; nothing was written") from None
    if err is not None:
        raise err
    new = _Agreement(
        planes, int(head["layers"]), t, int(head["chunk_tokens"]), int(head["token_bytes"]), rec[_F_EPOCH], peer_desc=_src_desc(head)
    )
    new.r0fast = _ctl_record(MAGIC, FAST, new.epoch, t).to(wdev)
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).synchronize()  # sent from the side stream, which does not wait for this one
    ch.agreement = new
    return new, side


def _complete_refused_recv(g, pg, src, wdev, ag: _Agreement, tag, tmo) -> None:
    """Take a fast sender's agreed transfer without landing it, and answer it refused."""
    ring = _host_ring(False, wdev) if wdev.type == "cpu" else _cuda(wdev).rings[False]
    ring.ensure(ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes)
    if wdev.type == "cuda":
        torch.cuda.current_stream(wdev).wait_stream(_cuda(wdev).xs)
        for e in ring.free:
            if e is not None:
                e.synchronize()
    buf = ring.bufs[0]
    v = _ctl_record(MAGIC, 0, ag.epoch, ag.tokens, 8).to(wdev)
    bounds = ag.bounds()
    for ops in _wire_groups(ag, bounds, buf, False, v):
        try:
            _exchange(g, pg, src, wdev, ops, tag, tmo)
        except _PeerLost:
            return


def _recv_fast(ch: _Channel, ag: _Agreement, g, pg, src, wdev, side: _Side, s: torch.Tensor, tmo: float, tag: int) -> None:
    ch.calls += 1
    _STATS["fast"] += 1
    with _step(ch):
        _recv_fast_any(ch, ag, g, pg, src, wdev, side, s, tmo, tag)


def _recv_fast_any(ch, ag, g, pg, src, wdev, side, s, tmo, tag) -> None:
    if wdev.type == "cuda" and side.native() is not None:
        _recv_fast_dev(_dev_engine(ch, wdev, g, pg, src, tag, tmo), ch, ag, src, side, s)
    elif wdev.type == "cpu" and _emulate() and side.layout.device.type == "cpu" and side.native(emulate=True) is not None:
        _recv_fast_dev(_EmuEngine(g, pg, src, tag, tmo, False), ch, ag, src, side, s)
    else:
        _recv_fast_host(ch, ag, g, pg, src, wdev, side, s, tmo, tag)


def _recv_fast_dev(eng, ch, ag, src, side, s) -> None:
    """The receiver's fast transfer on the GPU engine (or its CPU emulation): its slot check,
    then per chunk one group (two in flight) and the gated unpacking; the first chunk's gate
    decides whether anything lands."""
    mod = _native_module()
    ring = eng.ring(False)
    ring.ensure(ag.prefix_bytes + ag.chunk_tokens * ag.token_bytes)
    prog = _program(ag, side, ring, side.native(emulate=eng.emulated), eng.emulated, False, src)
    main, xs, plan, K, T, calls = eng.main, eng.xs, prog.plan, prog.K, prog.T, ch.calls
    ctl = eng.ctl(ch)
    dev = s.device
    if side.bitmap is None:
        side.bitmap = torch.zeros(max(1, (side.num_slots + 31) // 32), dtype=torch.int32, device=dev)
    if ctl.work is not None:
        eng.after(ctl.work)  # the current stream waits until this control slot's V was sent
    errors = []
    rc = mod.p2p_check(None, 0, s, side.num_slots, side.bitmap, ctl.flag, ctl.v, MAGIC, FAST, ag.epoch, None, _OP_RECV, calls, src)
    if rc < 0:
        raise TransferError(mod.copy_last_error())
    own = mod.copy_last_error() if rc > 0 else None
    ev_check = ctl.ev_check
    eng.record(ev_check, main)
    eff = torch.empty(T, dtype=torch.int64, device=dev)
    works: list = []
    slot_of: list[int] = []
    bounds = prog.bounds

    def post(i: int):
        k = ring.next()
        slot_of.append(k)
        with eng.on(xs):
            eng.wait_event(xs, ring.free[k])  # the last unpacking of this chunk buffer
            if i == 0 and ctl.work is not None:
                eng.wait_event(xs, ctl.ev)  # the last gate that read this control slot's D
            if i == K - 1:
                eng.wait_event(xs, ev_check)  # V (with the last chunk) is written by the check
            w = eng.post(*prog.group(k, i, ctl))
        ring.work[k] = w
        works.append((w, i, *bounds[i]))

    def land(i: int):
        a, b = bounds[i]
        k = slot_of[i]
        eng.after(works[i][0])  # the current stream waits for the chunk
        if i == 0:
            rc = mod.p2p_gate(ctl.d, prog.head(k), ctl.flag, MAGIC, ag.epoch, T, s, eff, ctl.gate, calls, src)
            if rc < 0:
                raise TransferError(mod.copy_last_error())
            if 0 < rc < 100:
                errors.append(mod.copy_last_error())
            eng.record(ctl.ev, main)
        rc = plan.run_gated(False, eff if K == 1 else eff[a:b], prog.chunk(k, i)[1], ctl.gate)
        if rc:
            raise TransferError(f"{prog.what}: unpacking chunk {i} was refused: {mod.last_error()}")
        if ring.free[k] is None:
            ring.free[k] = eng.event()
        eng.record(ring.free[k], main)

    try:
        if K == 0:
            with eng.on(xs):
                if ctl.work is not None:
                    eng.wait_event(xs, ctl.ev)
                eng.wait_event(xs, ev_check)
                w = eng.post(*prog.group(0, -1, ctl))
            works.append((w, -1, 0, 0))
            eng.after(w)
            eng.record(ctl.ev, main)
        else:
            post(0)
            if K > 1:
                post(1)
            for i in range(K):
                land(i)
                if i + 2 < K:
                    post(i + 2)
    except _PeerLost as e:  # emulation: a host wait ran out
        i, a, b = next(((i, a, b) for w, i, a, b in works if not _done(w)), (-1, 0, 0))
        f = _InFlight(prog.what, False, works, K, T, 0.0, eng.tmo, s, ())
        raise _lost_error(f, i, a, b, e.reason) from None
    ctl.work = works[-1][0]
    eng.keep(_InFlight(prog.what, False, works, K, T, time.monotonic() + eng.tmo, eng.tmo, s, (ag.r0fast, eff)))
    if errors:
        raise _Done(errors[0])
    if own:
        raise _Done(own)


def _recv_fast_host(ch, ag, g, pg, src, wdev, side, s, tmo, tag) -> None:
    layout = side.layout
    cuda_cache = layout.device.type == "cuda"
    host_s = s.cpu() if s.is_cuda else s
    P, tb, T = ag.prefix_bytes, ag.token_bytes, ag.tokens
    ring = _host_ring(False, wdev, pin=cuda_cache and wdev.type == "cpu")
    ring.ensure(P + ag.chunk_tokens * tb)
    what = f"kvcore.recv from rank {src}"
    own = _check_values(None, 0, host_s, side.num_slots)
    v = _ctl_record(MAGIC, FAST, ag.epoch, T, *own)
    d = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    kernel = side.kernel(wdev.type)
    bounds = ag.bounds()
    K = len(bounds)
    works: list = [None] * K
    verdict = None
    eff = None

    def post(i):
        a, b = bounds[i]
        buf = ring.bufs[i % 2]
        ops = [(False, d), (True, ag.r0fast), (False, buf[: P + (b - a) * tb])] if i == 0 else [(False, buf[P : P + (b - a) * tb])]
        if i == K - 1:
            ops.append((True, v))
        works[i] = [_post(snd, t, src, pg, tag) for snd, t in ops]

    if K == 0:
        for w in [_post(snd, t, src, pg, tag) for snd, t in [(False, d), (True, ag.r0fast), (True, v)]]:
            try:
                _wait(w, tmo)
            except _PeerLost as e:
                raise TransferError(f"{what}: the sender was lost: {e.reason}; nothing was written") from None
        return
    post(0)
    if K > 1:
        post(1)
    for i, (a, b) in enumerate(bounds):
        for w in works[i]:
            try:
                _wait(w, tmo)
            except _PeerLost as e:
                landed = f"chunks 0..{i - 1} (rows 0..{a - 1}) were landed; " if (i and verdict == 0) else "no chunk was landed; "
                raise TransferError(
                    f"{what}: chunk {i} of {K} (rows {a}..{b - 1}) did not arrive: {e.reason}. Destination slots "
                    f"{_slot_list(host_s[a:b])} (that chunk) were not written, nor the slots of rows "
                    f"{b}..{T - 1}; {landed}nothing else was touched. Destroy and re-create the process group before the next transfer"
                ) from None
        buf = ring.bufs[i % 2]
        if i == 0:
            verdict, eff = _gate_host(d, buf, own[0], ag, host_s, what, layout, side, src)
        if verdict == 0:
            es = eff[a:b]
            n_valid = int((es >= 0).sum())
            if n_valid:
                plan = TransferPlan(
                    table=side.wire.table, slots=es.to(layout.device), staging=side.wire.views(buf[P:], b - a), num_valid=n_valid
                )
                kernel.scatter(plan)
                if cuda_cache:
                    torch.cuda.current_stream(layout.device).synchronize()  # the pinned chunk is reused by Gloo next
        if i + 2 < K:
            post(i + 2)
    if own[0]:
        kind, index, value, num = own
        if kind == 2:
            raise _Done(
                f"{what} was refused and wrote nothing: destination slot {value} appears more than once in slots; it would be written "
                "twice (the sender is told and raises too)"
            )
        raise _Done(
            f"{what} was refused and wrote nothing: slots[{index}] = {value} is out of range: this cache has {num} slots per layer "
            f"(valid 0..{num - 1}; negative slots are padding and are skipped); the sender is told and raises too"
        )
    if verdict:
        raise _Done(str(verdict))


def _gate_host(d: torch.Tensor, buf: torch.Tensor, own: int, ag: _Agreement, host_s, what, layout, side, src):
    """The host twin of the gate kernel: (0 or the TransferError to raise, effective slots)."""
    dr = d[:CTL_BYTES].view(torch.int64).tolist()
    pr = buf[:CTL_BYTES].view(torch.int64).tolist()
    none = torch.full_like(host_s, -1)
    if dr[_F_MAGIC] != MAGIC or pr[_F_MAGIC] != MAGIC:
        return TransferError(f"{what}: a chunk is not kvcore's: both sides must call kvcore.send / kvcore.recv in the same order"), none
    if dr[_F_MODE] != FAST or dr[_F_EPOCH] != ag.epoch or dr[_F_TOKENS] != ag.tokens:
        try:
            _, head = _read(d, "header", True)
        except TransferError:
            head = {}
        if dr[_F_VERDICT] or not head.get("ok", True):
            return TransferError(f"{what}: the sender refused and sent nothing: {head.get('error')}"), none
        mine = f"this {layout.format.name} ({layout.describe()})"
        why, _ = _mismatch(head, side.sig, side.table.num_layers, ag.tokens, _src_desc(head), mine) if head else (None, [])
        return TransferError(
            f"{what}: {why or 'the sender changed the transfer'} (this side repeats the transfer this channel agreed on, {ag.tokens} "
            "token rows; the two calls do not match, both sides raise, nothing was written)"
        ), none
    if pr[_F_VERDICT]:
        return TransferError(
            f"{what}: the sender refused and sent nothing: its slots[{pr[_F_INDEX]}] = {pr[_F_VALUE]} is out of range: it has "
            f"{pr[_F_NUM]} slots per layer"
        ), none
    if own:
        return -1, none
    mask = buf[CTL_BYTES : CTL_BYTES + ag.tokens].bool()
    return 0, torch.where(mask, host_s, none)
