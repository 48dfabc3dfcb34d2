"""The fast path's programs: what a fast transfer posts, fixed by the agreement and computed
once per side and staging buffers."""

from __future__ import annotations

from kvcore.distributed.channels import _Agreement
from kvcore.distributed.engine import _Ctl
from kvcore.distributed.rings import _Ring
from kvcore.distributed.sides import _Side
from kvcore.distributed.wire import CTL_BYTES
from kvcore.kernels import _build


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
