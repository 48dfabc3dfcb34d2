"""The wire format: the control messages (a 64-byte record, JSON headers), the chunking,
the planes' byte layout on the wire, and why a sender's header cannot land on a receiver."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from kvcore.errors import TransferError
from kvcore.spec import StagingBuffer, StagingTarget, StrideTable

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


# control record fields (csrc/kvcore_copy.h, CtlField)
_F_MAGIC, _F_MODE, _F_EPOCH, _F_TOKENS, _F_VERDICT, _F_INDEX, _F_VALUE, _F_NUM = range(8)


_OP_SEND, _OP_RECV = 3, 4


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


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
