"""Process groups and channels: a channel (group, peer, tag, direction) keeps the agreement
of its last handshake; a fast transfer that stops between its messages breaks it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from kvcore.distributed.wire import CTL_BYTES, _pad16
from kvcore.errors import TransferError

_STATS = {"handshakes": 0, "fast": 0}  # per process: handshakes run, fast transfers started (tests, diagnostics)


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
