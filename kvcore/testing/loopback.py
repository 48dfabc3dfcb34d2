"""One GPU standing in for two: ``kvcore.send`` and ``kvcore.recv`` in one process over a
device-to-device wire (the GPU engine's tests and single-GPU measurements; issue 26).

NCCL cannot run two ranks on one GPU. :class:`LoopbackWire` stands in for a NCCL process
group of two ranks whose two ends live in this process: each rank's groups of point-to-point
operations become device-to-device copies, on the posting stream, into and out of mailboxes
(one per message of a call, per direction). Everything else is kvcore's GPU engine as it
runs on two GPUs: the slot checks, the packing, the gate and the unpacking kernels, the
side streams and events, one group per chunk, and (``KVCORE_P2P_GRAPH=1``) the groups
replayed from CUDA graphs — the copies are what gets captured.

The wire is one-sided: a send lands in its mailbox when posted, a receive reads its mailbox
when posted. Which mailbox a message uses (its place in a call) is counted on the device, in
stream order, not on the host: a group replayed from a CUDA graph never calls the wire, so a
host count would drift when one group of a call is replayed and the next one captured (a
middle chunk's group is the same for every control slot, the first and last are not). So the ranks' calls must alternate sender first (``send`` then ``recv``, per
transfer), and the receiver's answers (R0, V) that the sender reads are the previous call's
(prefilled for the first one): every fast call of one agreement sends the same answers
when nothing is refused. A handshake cannot run over it: :meth:`LoopbackWire.agree_tokens`
installs on both ends the agreement their handshake would leave. Refusals are not modelled (the two
ranks share the process's device error record); the CPU suite and two GPUs test those.
"""

from __future__ import annotations

import weakref

import torch

from kvcore import distributed as d
from kvcore.p2p_graph import EventWork

__all__ = ["LoopbackWire", "LoopbackGroup"]


class LoopbackGroup:
    """One rank's view of the two-rank group (``rank`` 0 or 1); the process group kvcore is
    given (``group=``). Implements what kvcore's GPU engine calls: ``_start_coalescing``,
    ``send``, ``recv`` and ``_end_coalescing``."""

    def __init__(self, wire: LoopbackWire, rank: int):
        self.wire, self.rank = wire, rank
        self._ops: list | None = None

    def _start_coalescing(self, device) -> None:
        self._ops = []

    def send(self, tensors, dst: int, tag: int):
        self._ops.append((True, tensors[0], dst, tag))

    def recv(self, tensors, src: int, tag: int):
        self._ops.append((False, tensors[0], src, tag))

    def _end_coalescing(self, device) -> EventWork:
        ops, self._ops = self._ops, None
        stream = torch.cuda.current_stream(device)
        for send, t, peer, tag in ops:
            key = (self.rank, peer, tag) if send else (peer, self.rank, tag)
            self.wire._mailboxes(key, t.nbytes).move(send, t.view(-1).view(torch.uint8))
        self.wire.groups += 1
        ev = torch.cuda.Event()
        ev.record(stream)
        return EventWork(ev)


class _Mailboxes:
    """The mailboxes of one direction (one message of a call each, rows of ``buf``), and the
    device counters of the next message each end posts (sender, receiver): a message lands in
    row ``pos[True]`` and is read from row ``pos[False]``, each counter then advances modulo
    the number of messages, all on the posting stream (so a CUDA graph replays it too)."""

    def __init__(self, sizes: list[int], device: torch.device):
        self.sizes = sizes
        self.buf = torch.zeros(len(sizes), max(sizes), dtype=torch.uint8, device=device)
        self.pos = {True: torch.zeros(1, dtype=torch.int64, device=device), False: torch.zeros(1, dtype=torch.int64, device=device)}

    def move(self, send: bool, flat: torch.Tensor) -> None:
        n = flat.numel()
        if n > self.buf.shape[1]:
            raise RuntimeError(f"loopback: a message of {n} bytes, the largest mailbox {self.buf.shape[1]}: {self.sizes}")
        rows, pos = self.buf[:, :n], self.pos[send]
        if send:
            rows.index_copy_(0, pos, flat.view(1, n))
        else:
            torch.index_select(rows, 0, pos, out=flat.view(1, n))
        pos.add_(1).remainder_(len(self.sizes))


class LoopbackWire:
    """Two :class:`LoopbackGroup` ends on one device (``groups()``), registered with kvcore."""

    def __init__(self, device: torch.device | str = "cuda"):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("LoopbackWire needs torch.distributed initialised (a world of one process will do)")
        self.device = torch.device(device)
        self.ends = (LoopbackGroup(self, 0), LoopbackGroup(self, 1))
        self.boxes: dict = {}  # (src, dst, tag) -> _Mailboxes
        self.groups = 0
        for rank, pg in enumerate(self.ends):
            g = d._Group.__new__(d._Group)
            g.ref, g.me, g.ranks, g.index, g.backend, g.coalesce = weakref.ref(pg), rank, [0, 1], {0: 0, 1: 1}, "nccl", True
            try:
                g.graphs = {}
            except AttributeError:  # a kvcore before CUDA-graph replay (a before/after comparison)
                pass
            d._GROUPS[id(pg)] = g

    def _mailboxes(self, key, nbytes: int) -> _Mailboxes:
        boxes = self.boxes.get(key)
        if boxes is None:
            raise RuntimeError(f"loopback: no agreement installed for messages {key} (LoopbackWire.agree_tokens)")
        return boxes

    def agree_tokens(
        self, send_layout, recv_layout, num_tokens: int, *, heads=None, recv_heads=None, tag: int = 0, chunk_bytes: int | None = None
    ) -> int:
        """Install on both ends the agreement a handshake between ``kvcore.send(send_layout,
        slots, 1, heads=heads, chunk_bytes=chunk_bytes, tag=tag, group=ends[0])`` and
        ``kvcore.recv(recv_layout, slots, 0, heads=recv_heads, tag=tag, group=ends[1])`` of
        ``num_tokens`` slots would leave, size the mailboxes of one such call and prefill the
        receiver's answers. Returns the number of chunks per call."""

        s_side = d._side(send_layout, None, heads, "heads")
        r_side = d._side(recv_layout, None, recv_heads, "heads", tuple(p[0] for p in s_side.sig))
        if r_side.sig != s_side.sig or r_side.wire.token_bytes != s_side.wire.token_bytes:
            raise RuntimeError(f"loopback: the two sides do not match: {s_side.sig} / {r_side.sig}")
        dev = self.device
        t = int(num_tokens)
        tb = s_side.wire.token_bytes
        ct = d._chunk_tokens(tb, t, chunk_bytes, dev.type)
        sch = d._channel(d._GROUPS[id(self.ends[0])], 1, tag, True)
        rch = d._channel(d._GROUPS[id(self.ends[1])], 0, tag, False)
        epoch = max((sch.agreement.epoch if sch.agreement else 0), (rch.agreement.epoch if rch.agreement else 0)) + 1
        sag = d._Agreement(s_side.sig, s_side.table.num_layers, t, ct, tb, epoch, peer_desc="rank 1's loopback cache")
        sag.dfast = d._message(d._ctl_record(d.MAGIC, d.FAST, epoch, t, 0), None, d.HEADER_BYTES).to(dev)
        rag = d._Agreement(s_side.sig, s_side.table.num_layers, t, ct, tb, epoch, peer_desc="rank 0's loopback cache")
        rag.r0fast = d._ctl_record(d.MAGIC, d.FAST, epoch, t).to(dev)
        bounds = sag.bounds()
        fwd = [d.HEADER_BYTES] + [(sag.prefix_bytes if i == 0 else 0) + (b - a) * tb for i, (a, b) in enumerate(bounds)]
        self.boxes[(0, 1, tag)] = _Mailboxes(fwd, dev)
        back = self.boxes[(1, 0, tag)] = _Mailboxes([d.CTL_BYTES, d.CTL_BYTES], dev)
        back.buf[0].copy_(rag.r0fast.view(-1).view(torch.uint8))  # R0 and a clean V
        back.buf[1].copy_(d._ctl_record(d.MAGIC, d.FAST, epoch, t, 0).to(dev).view(-1).view(torch.uint8))
        torch.cuda.synchronize(dev)
        sch.agreement, rch.agreement = sag, rag
        return len(bounds)
