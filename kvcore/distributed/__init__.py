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

**The package**, one job a module (imports flow down this list)::

    wire         the control messages, the chunking, the planes' bytes on the wire, mismatches
    rings        staging chunks reused across calls
    channels     process groups, channels and their agreements; a fast transfer's steps
    transport    posting point-to-point messages, NCCL groups, waiting with a deadline
    sides        one side's table, wire form and kernels; the arguments' checks
    engine       the GPU engine, its CPU emulation, transfers in flight and their errors
    programs     what a fast transfer posts, precomputed per agreement
    gates        the host twins of the device slot checks and gate
    handshake    the slow path: the handshake, and completing a refused fast transfer
    fast_device  the fast transfer on the GPU engine
    fast_host    the fast transfer waited for on the host (Gloo)
    api          send, recv, release_staging

Every name the single module had is importable from this package, and setting one here
(a test interposing ``_isend``) sets it where it is used.
"""

from __future__ import annotations

import sys
import types

from kvcore.distributed import api, channels, engine, fast_device, fast_host, gates, handshake, programs, rings, sides, transport, wire
from kvcore.distributed.api import (  # noqa: F401
    _fast,
    _fast_any,
    _recv,
    _recv_fast,
    _recv_fast_any,
    _send,
    _send_fast,
    _send_fast_any,
    recv,
    release_staging,
    send,
)
from kvcore.distributed.channels import (  # noqa: F401
    _CHANNELS,
    _GROUPS,
    _STATS,
    _Agreement,
    _Channel,
    _channel,
    _Done,
    _Group,
    _group,
    _step,
)
from kvcore.distributed.engine import (  # noqa: F401
    _CPU,
    _CTL_RING,
    _CUDA,
    _NO_GATE,
    _Ctl,
    _ctl,
    _Cuda,
    _cuda,
    _dev_engine,
    _DevEngine,
    _drain,
    _EmuEngine,
    _emulate,
    _InFlight,
    _lost_error,
    _NoEvent,
    _On,
    _surface,
    _take_device_error,
)
from kvcore.distributed.fast_device import (  # noqa: F401
    _recv_fast_dev,
    _send_fast_dev,
)
from kvcore.distributed.fast_host import (  # noqa: F401
    _recv_fast_host,
    _send_fast_host,
)
from kvcore.distributed.gates import (  # noqa: F401
    _check_values,
    _gate_host,
)
from kvcore.distributed.handshake import (  # noqa: F401
    _complete_refused_recv,
    _complete_refused_send,
    _header,
    _recv_slow,
    _send_slow,
    _wire_groups,
)
from kvcore.distributed.programs import (  # noqa: F401
    _native_module,
    _Program,
    _program,
)
from kvcore.distributed.rings import (  # noqa: F401
    _HOST_RINGS,
    _done,
    _done_all,
    _host_ring,
    _HostRing,
    _Ring,
)
from kvcore.distributed.sides import (  # noqa: F401
    _check_layout,
    _device_of,
    _recv_side,
    _Side,
    _side,
    _slots_arg,
    _wire_device,
)
from kvcore.distributed.transport import (  # noqa: F401
    _ENV_DATA,
    _coalesced,
    _exchange,
    _FailedWork,
    _irecv,
    _isend,
    _PeerLost,
    _poll,
    _Polled,
    _post,
    _reason,
    _timeout,
    _wait,
    _Works,
)

# every name the single module defined stays importable here
from kvcore.distributed.wire import (  # noqa: F401
    _F_EPOCH,
    _F_INDEX,
    _F_MAGIC,
    _F_MODE,
    _F_NUM,
    _F_TOKENS,
    _F_VALUE,
    _F_VERDICT,
    _MIN_CHUNK_BYTES,
    _MIN_CHUNKS,
    _OP_RECV,
    _OP_SEND,
    CTL_BYTES,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CHUNK_BYTES_CPU,
    FAST,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL,
    SLOW,
    STATUS_BYTES,
    _chunk_tokens,
    _ctl_record,
    _dt,
    _message,
    _mismatch,
    _pad16,
    _read,
    _sig,
    _slot_list,
    _src_desc,
    _Wire,
    _wire,
)

__all__ = ["send", "recv", "release_staging", "HEADER_BYTES", "STATUS_BYTES", "DEFAULT_CHUNK_BYTES"]

_MODULES = (wire, transport, channels, sides, rings, engine, programs, gates, handshake, fast_device, fast_host, api)
_UNSET = object()


class _OneModule(types.ModuleType):
    """This package behaves, for code that sets its names, as the one module it was: setting
    ``kvcore.distributed.NAME`` (a test interposing ``_isend``, a script replacing ``_group``)
    sets it in every submodule that holds the same object under that name."""

    def __setattr__(self, name: str, value) -> None:
        old = self.__dict__.get(name, _UNSET)
        super().__setattr__(name, value)
        if old is not _UNSET:
            for mod in _MODULES:
                if mod.__dict__.get(name, _UNSET) is old:
                    setattr(mod, name, value)


sys.modules[__name__].__class__ = _OneModule
