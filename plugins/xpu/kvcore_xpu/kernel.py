"""``triton-xpu``: one generic gather/scatter kernel in Triton, driven by the stride table.

The kernel reads nothing but the :class:`~kvcore.spec.StrideTable` it is handed (planes
with their bases per layer, byte strides, heads, widths and staging targets), so it moves
every layout any plugin declares, single- or multi-plane, without a switch on format
names. Per transfer it launches **one Triton program per staging buffer** (a classic
``[kv_size, NL, T, NH*HS]`` buffer: one launch for all layers and both K and V; a
multi-plane record staged into one buffer per plane: one launch per buffer; planes of
one buffer whose rows split into differently shaped runs, e.g. a chunked K beside a
transposed V: one launch per run shape), each over every (layer, plane) pair of its
planes and every token.

A token row is moved as its *segments*: the longest runs contiguous on both the cache
and the staging side (a whole row of all heads for NHD-like planes and MLA, one head for
HND-like planes, one chunk for chunked heads). A program moves a tile of tokens x
segments x units, the run being the contiguous inner dimension, so per-head runs (HND)
and rows that are no power of two (MLA's 1152 bytes: 1024 + 128) are read and written
with coalesced vector accesses; no address needs a division (see
:mod:`kvcore_xpu._triton_copy`).

Bytes move unchanged, as integers of the widest width (8, 4, 2 or 1 bytes) that every
address, stride, offset and run length of the launch allows; when they are all multiples
of 16 the compiler is told so and uses 16-byte vector accesses.

Devices:

- ``xpu`` (Intel GPUs; Triton's Intel backend ships with PyTorch's XPU builds): the
  kernel serves XPU caches (priority 5; the torch reference kernel is 0).
- ``cuda``: the same program compiles for NVIDIA GPUs. It serves a CUDA cache only when
  forced (``KVCORE_KERNEL=triton-xpu``): :meth:`TritonKernel.accepts` declines any staging
  device but ``xpu``, so the core's selection never picks it there on its own. This is how
  it is proven on a GPU (``scripts/gpu_triton_check.py``). Staging may be device memory
  or pinned host memory (read and written in place: zero-copy); pageable host memory
  goes through a device buffer sized by the tokens moved.
- ``cpu`` only under Triton's interpreter (``TRITON_INTERPRET=1``): then ``cpu`` joins
  :attr:`TritonKernel.device_types` and the kernel moves CPU tensors when forced; it is
  how the kernel is proven on machines without a GPU (``kvcore check xpu``).

Launch cost: per stride table the descriptors (plane strides, base addresses, segment
offsets) are computed once and uploaded to the device; per (table, staging buffers,
token count, direction) the launch arguments are computed once, and a repeated transfer
costs a dictionary lookup and the launch itself: with Triton >= 3.3 the compiled
kernel's launcher is called directly (``CompiledKernel[grid]``), skipping the JIT's
per-call argument binding and cache-key hashing (``KVCORE_TRITON_FAST_LAUNCH=0``
turns that off). Nothing synchronises with the host and nothing is allocated per call
(device staging).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvcore.errors import TransferError
from kvcore.kernels import TransferPlan, check_storages
from kvcore.spec import Plane, StrideTable

__all__ = ["TritonKernel", "KERNEL", "NAME", "interpreting", "triton_version", "LaunchParams", "launch_params"]

NAME = "triton-xpu"
_MAX_CACHED = 64
_MAX_TILES = 2**31 - 1  # token tiles: the grid's first axis
_MAX_PAIRS = 65535  # (layer, plane) pairs per launch: the grid's second axis
# tile sizes (tunable for a benchmark; the defaults were chosen on the GPU script's sweep)
_TILE_BYTES = int(os.environ.get("KVCORE_TRITON_TILE_BYTES", "16384"))
_NUM_WARPS = int(os.environ.get("KVCORE_TRITON_WARPS", "4"))
_MIN_PROGRAMS = int(os.environ.get("KVCORE_TRITON_MIN_PROGRAMS", "1024"))
_MAX_PIECE = 512  # units per piece of a segment (longer segments take several pieces)
_MAX_BLOCK_T = 1024  # tokens per program
_INTERP_TILE_UNITS = 1 << 16  # the interpreter: few programs, each as large as this
_INTERP_FEW = True  # the interpreter cuts launches in few programs (tests set False: device cuts)
_NF = 8  # int64 fields per plane descriptor (``_triton_copy.FIELDS``, padded)


def interpreting() -> bool:
    """True under Triton's interpreter (``TRITON_INTERPRET=1``): programs run on the host."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_TRITON: dict[str, object] = {}


def triton_version() -> str | None:
    """The installed triton's version (``pytorch-triton-xpu`` installs as ``triton`` too), or None."""
    if "version" not in _TRITON:
        v = None
        if importlib.util.find_spec("triton") is not None:
            try:
                from importlib.metadata import PackageNotFoundError, version

                for dist in ("triton", "pytorch-triton-xpu", "pytorch-triton"):
                    try:
                        v = version(dist)
                        break
                    except PackageNotFoundError:
                        continue
                if v is None:
                    import triton

                    v = getattr(triton, "__version__", "unknown")
            except Exception as e:  # noqa: BLE001 - a broken triton is reported, not raised
                _TRITON["error"] = f"{type(e).__name__}: {e}"
        _TRITON["version"] = v
    return _TRITON["version"]  # type: ignore[return-value]


def _program():
    """``(jitted program, module)``, imported on first use.

    Raises:
        TransferError: triton is not installed or fails to import.
    """
    interp = interpreting()
    try:
        from kvcore_xpu import _triton_copy as mod
    except Exception as e:  # noqa: BLE001 - ImportError, or a triton broken against this torch
        raise TransferError(f"{NAME}: triton cannot be imported ({type(e).__name__}: {e}); install triton or use another kernel") from None
    return mod.jitted(interp), mod


def _xpu_available() -> bool:
    xpu = getattr(torch, "xpu", None)
    try:
        return bool(xpu is not None and xpu.is_available())
    except Exception:  # noqa: BLE001
        return False


def _gcd_all(values, start: int = 16) -> int:
    g = start
    for v in values:
        v = int(v)
        if v:
            g = math.gcd(g, abs(v))
    return g


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _segments(p: Plane) -> tuple[list[int], list[int], int]:
    """A plane's token row as segments, the longest runs contiguous on both sides:
    ``(cache offsets, staging offsets, bytes per segment)``, offsets from the token's
    row on each side. One segment when all heads are one run on both sides (NHD, MLA);
    else one per head, or one per (head, chunk) when heads are chunked."""
    s, st = p.strides, p.staging
    if s.n_chunks == 1 and s.n_sub == 1:
        if p.num_heads == 1 or (s.head == p.head_bytes and st.head_stride == p.head_bytes):
            return [0], [0], p.num_heads * p.head_bytes
        return [h * s.head for h in range(p.num_heads)], [h * st.head_stride for h in range(p.num_heads)], p.head_bytes
    cache, stage = [], []
    for h in range(p.num_heads):
        for c in range(s.n_chunks):
            for j in range(s.n_sub):
                cache.append(h * s.head + c * s.chunk + j * s.sub)
                stage.append(h * st.head_stride + (c * s.n_sub + j) * s.chunk_bytes)
    return cache, stage, s.chunk_bytes


class _Launch:
    """The planes of one staging buffer whose rows have one segment shape: one launch.

    Attributes:
        key: the staging buffer's key; classic: whether it is the ``[kv_size, NL, T, row]``
            buffer (else ``[NL, T, row]``).
        num_planes: the planes of the launch; block_size: the table's.
        n_segs, seg_bytes: segments per token row and bytes per segment (every plane).
        grouped: some plane's block tokens are split in groups.
        align: the largest power of two up to 16 dividing every cache-side address,
            stride and offset, and the segment length.
        desc, bases, segs: the device tables the program reads (see ``_triton_copy``).
    """

    __slots__ = ("key", "classic", "num_planes", "block_size", "n_segs", "seg_bytes", "grouped", "align", "desc", "bases", "segs")

    def __init__(self, key: str, classic: bool, planes: list[Plane], table: StrideTable, device: torch.device):
        self.key = key
        self.classic = classic
        self.num_planes = len(planes)
        self.block_size = table.block_size
        rows, segs, align_vals = [], [], []
        self.grouped = False
        self.n_segs = self.seg_bytes = 0
        for p in planes:
            s, st = p.strides, p.staging
            coff, soff, seg_bytes = _segments(p)
            self.n_segs, self.seg_bytes = len(coff), seg_bytes
            grouped = bool(s.token_group) and s.token_group < table.block_size
            tg, tgs = (s.token_group, s.token_group_stride) if grouped else (table.block_size, 0)
            row = [s.block, s.token, tg, tgs, st.index if st.index is not None else 0, st.offset]
            rows.append(row + [0] * (_NF - len(row)))
            segs.append([coff, soff])
            align_vals += [s.block, s.token, tgs, seg_bytes, st.offset, *coff, *soff]
            self.grouped = self.grouped or grouped
        addrs = [[t.untyped_storage().data_ptr() + off for (t, off) in (p.bases[li] for p in planes)] for li in range(table.num_layers)]
        align_vals += [a for layer in addrs for a in layer]
        self.align = _gcd_all(align_vals)
        self.desc = torch.tensor(rows, dtype=torch.int64).reshape(len(planes), _NF).to(device)
        self.bases = torch.tensor(addrs, dtype=torch.int64).reshape(table.num_layers, len(planes)).to(device)
        self.segs = torch.tensor(segs, dtype=torch.int64).reshape(len(planes), 2, self.n_segs).to(device)


class _Prepared:
    """Per-table launch arguments, computed once per stride table.

    Attributes:
        device: the device the cache's tensors are on (with its index).
        launches: the :class:`_Launch` es of a transfer, in order.
        probe: ``(tensor, storage address, storage bytes)`` of the first plane's first
            layer: the cache is still the one the tables were computed against.
        calls: per transfer signature (:func:`_signature`), the launches ready to run.
    """

    __slots__ = ("device", "launches", "probe", "calls", "__weakref__")

    def __init__(self, table: StrideTable):
        self.calls: dict[tuple, tuple] = {}
        t0 = table.planes[0].bases[0][0]
        st = t0.untyped_storage()
        self.probe = (t0, st.data_ptr(), st.nbytes())
        self.device = t0.device
        launches = []
        for b in table.buffers:
            shapes: dict[tuple, list[Plane]] = {}
            for p in table.planes:
                if p.staging.buffer == b.key:
                    coff, _, seg_bytes = _segments(p)
                    shapes.setdefault((len(coff), seg_bytes), []).append(p)
            for planes in shapes.values():
                launches.append(_Launch(b.key, b.kv_size is not None, planes, table, self.device))
        self.launches = launches


_CACHE: OrderedDict[int, tuple[weakref.ref, _Prepared]] = OrderedDict()


def _fresh(prep: _Prepared) -> bool:
    t, ptr, nbytes = prep.probe
    st = t.untyped_storage()
    return st.data_ptr() == ptr and st.nbytes() == nbytes


def _prepared(table: StrideTable) -> _Prepared:
    """The launch arguments of ``table``, cached while the table lives and its first
    plane's storage is the one they were computed against.

    Raises:
        TransferError: a storage of the table was freed, reallocated or replaced since
            detection (:func:`kvcore.kernels.check_storages`).
    """
    check_storages(table)
    hit = _CACHE.get(id(table))
    if hit is not None and hit[0]() is table and _fresh(hit[1]):
        return hit[1]
    prep = _Prepared(table)
    _CACHE[id(table)] = (weakref.ref(table), prep)
    while len(_CACHE) > _MAX_CACHED:
        _CACHE.popitem(last=False)
    return prep


def _index(dev: torch.device) -> int | None:
    """``dev``'s index; for ``cuda``/``xpu`` without one, the current device's (what
    ``torch.device("cuda")`` means)."""
    if dev.index is not None or dev.type not in ("cuda", "xpu"):
        return dev.index
    return torch.cuda.current_device() if dev.type == "cuda" else torch.xpu.current_device()


def _same(a: torch.device, b: torch.device) -> bool:
    """One device: the same type and index (``cuda`` is the current CUDA device)."""
    return a.type == b.type and (a.index == b.index or _index(a) == _index(b))


def _on_current(dev: torch.device) -> bool:
    """Work for ``dev`` goes there without switching the current device."""
    if dev.index is None or dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return dev.index == torch.cuda.current_device()
    return dev.type == "xpu" and dev.index == torch.xpu.current_device()


def _device_ctx(dev: torch.device):
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        return torch.cuda.device(dev)
    if dev.type == "xpu" and dev.index is not None and dev.index != torch.xpu.current_device():
        return torch.xpu.device(dev)
    return contextlib.nullcontext()


_FAST_OFF: list[str] = []  # why direct launches were turned off in this process


def _fast_launch_failed(e: Exception) -> None:
    """A direct launch raised: launch through the JIT from now on (warned once). The
    launches of a transfer move the same bytes to the same places when repeated."""
    import warnings

    if not _FAST_OFF:
        _FAST_OFF.append(f"{type(e).__name__}: {e}")
        warnings.warn(
            f"{NAME}: Triton {triton_version()}'s compiled-kernel launcher refused a direct launch ({_FAST_OFF[0]}); "
            "launching through the JIT from now on",
            RuntimeWarning,
            stacklevel=3,
        )
    for _, prep in _CACHE.values():
        prep.calls.clear()


def _fast_launch() -> bool:
    """Whether a compiled kernel's launcher may be called directly: Triton >= 3.3 (its
    JIT passes every argument, constexprs included, to the launcher, as the compiled
    kernel's ``[grid]`` runner does), unless ``KVCORE_TRITON_FAST_LAUNCH=0`` or a direct
    launch raised in this process."""
    if _FAST_OFF or os.environ.get("KVCORE_TRITON_FAST_LAUNCH", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        import triton

        major, minor = (int("".join(ch for ch in x if ch.isdigit()) or 0) for x in triton.__version__.split(".")[:2])
    except Exception:  # noqa: BLE001 - an unreadable version: the JIT path
        return False
    return (major, minor) >= (3, 3)


def _runner(compiled, grid: tuple[int, int]):
    """``compiled[grid]``: the compiled kernel's launcher alone, taking ``(*every
    argument)`` (Triton's ``CompiledKernel[grid]`` reads three grid dimensions; the
    JIT pads them, this does too); None when this Triton's compiled kernel offers none
    (then the JIT launches)."""
    if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "__getitem__")):
        return None
    try:
        return compiled[(*grid, *(1,) * (3 - len(grid)))]
    except Exception:  # noqa: BLE001 - the JIT path still works
        return None


class TritonKernel:
    """The Triton stride-table kernel (see the module docstring).

    Attributes:
        name: ``"triton-xpu"`` (``KVCORE_KERNEL=triton-xpu`` forces it).
        device_types: ``("xpu", "cuda")``, plus ``"cpu"`` under ``TRITON_INTERPRET=1``.
        formats: None (every format: it reads only the stride table).
        priority: 5 (above the reference kernel's 0, below the native kernels' 10).
    """

    name = NAME
    formats = None
    priority = 5

    @property
    def device_types(self) -> tuple[str, ...]:
        return ("xpu", "cuda", "cpu") if interpreting() else ("xpu", "cuda")

    # -- selection ------------------------------------------------------------------
    def available(self) -> bool:
        if triton_version() is None:
            return False
        if interpreting():
            return True
        if _xpu_available():
            return True
        try:
            return torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            return False

    def why(self) -> str:
        v = triton_version()
        if v is None:
            err = _TRITON.get("error")
            return (
                "unavailable: triton is not installed"
                + (f" ({err})" if err else "")
                + ("; PyTorch's XPU builds ship it as pytorch-triton-xpu, elsewhere `pip install kvcore-xpu[triton]`")
            )
        what = (
            f"Triton {v} program over the stride table: one launch per staging buffer (all layers and planes), "
            "(token, run) tiles of integer units of up to 8 bytes, 16-byte vectors where every address allows"
        )
        if interpreting():
            return f"{what}; TRITON_INTERPRET=1: runs in Triton's interpreter on CPU tensors, when forced (KVCORE_KERNEL={NAME})"
        have = []
        if _xpu_available():
            have.append(f"xpu x{torch.xpu.device_count()}")
        try:
            if torch.cuda.is_available():
                have.append(f"cuda x{torch.cuda.device_count()} (only when forced: KVCORE_KERNEL={NAME})")
        except Exception:  # noqa: BLE001
            pass
        if not have:
            xpu = "torch.xpu.is_available() is False" if getattr(torch, "xpu", None) is not None else "this torch has no torch.xpu"
            return (
                f"unavailable: no XPU device ({xpu}; torch {torch.__version__}) and no CUDA device; {what}. "
                "Set TRITON_INTERPRET=1 to run it on CPU tensors in Triton's interpreter"
            )
        return f"{what}; serves {', '.join(have)}"

    def supports(self, table: StrideTable) -> bool:
        """Every stride table (it reads nothing else)."""
        return True

    def accepts(self, staging_device_type: str | None) -> bool:
        """Chosen on its own only for XPU caches (whose staging is on the XPU), and not under
        the interpreter; on CUDA and on the interpreter's CPU it serves only when forced."""
        return staging_device_type in (None, "xpu") and not interpreting()

    # -- transfers ------------------------------------------------------------------
    def gather(self, plan: TransferPlan) -> None:
        self._run(plan, True)

    def scatter(self, plan: TransferPlan) -> None:
        self._run(plan, False)

    def _check(self, plan: TransferPlan, dev: torch.device) -> dict[str, torch.Tensor]:
        """Everything this kernel needs, checked before the first byte moves (``dev``: the
        device the cache's tensors are on).

        Raises:
            TransferError: a device this kernel cannot run on (CPU tensors outside the
                interpreter, device tensors inside it), a staging buffer missing, of the
                wrong rank or on another device, or slots not int64 [T] on the cache's
                device.
        """
        table = plan.table
        if interpreting():
            if dev.type != "cpu":
                raise TransferError(
                    f"{NAME}: TRITON_INTERPRET=1 runs Triton programs on the host, so it moves CPU caches only; this cache "
                    f"is on {dev}: unset TRITON_INTERPRET to run the compiled kernel"
                )
        elif dev.type not in ("xpu", "cuda"):
            raise TransferError(
                f"{NAME} moves xpu and cuda caches (cpu ones only under TRITON_INTERPRET=1); this cache is on {dev}: use another kernel"
            )
        slots = plan.slots
        if not _same(slots.device, dev) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise TransferError(f"{NAME}: slots must be int64 [T] on {dev}, got {slots.dtype} {tuple(slots.shape)} on {slots.device}")
        bufs = plan.buffers
        t = slots.numel()
        for b in table.buffers:
            buf = bufs.get(b.key)
            if buf is None:
                raise TransferError(f"{NAME}: the plan has no staging buffer {b.key!r} (buffers: {', '.join(bufs) or 'none'})")
            want = 4 if b.kv_size is not None else 3
            if buf.dim() != want or buf.shape[-2] != t or buf.element_size() * buf.shape[-1] != b.row_bytes:
                raise TransferError(
                    f"{NAME}: staging buffer {b.key!r} has shape {tuple(buf.shape)} of {buf.dtype}; expected {want} dims, "
                    f"{t} tokens and rows of {b.row_bytes} bytes"
                )
            if buf.numel() and buf.stride(-1) != 1:
                raise TransferError(
                    f"{NAME}: staging buffer {b.key!r}'s last dimension must be contiguous, got strides {tuple(buf.stride())}"
                )
            if not _same(buf.device, dev):
                ok = dev.type == "cuda" and buf.device.type == "cpu" and not interpreting()
                if not ok:
                    raise TransferError(f"{NAME}: staging buffer {b.key!r} is on {buf.device} but the cache is on {dev}")
        return bufs

    def _run(self, plan: TransferPlan, gather: bool) -> None:
        if plan.num_valid == 0 or plan.slots.numel() == 0:
            return
        table = plan.table
        # the fast path: this table, staged the same way as before (same buffers, strides,
        # token count, devices, direction): launch what was prepared then
        hit = _CACHE.get(id(table))
        if hit is not None and hit[0]() is table:
            prep = hit[1]
            dev = prep.device
            if _fresh(prep):
                slots = plan.slots
                sig = _signature(plan.staging, slots, gather, interpreting() if dev.type == "cpu" else False)
                calls = prep.calls.get(sig)
                if calls is not None:
                    try:
                        if _on_current(dev):
                            for run, args in calls:
                                run(slots, *args)
                        else:
                            with _device_ctx(dev):
                                for run, args in calls:
                                    run(slots, *args)
                        return
                    except Exception as e:  # noqa: BLE001 - only a refused direct launch is retried
                        if all(isinstance(run, _Bound) for run, _ in calls):
                            raise
                        _fast_launch_failed(e)  # then the JIT launches (again): same bytes, same places
        self._run_checked(plan, gather)

    def _run_checked(self, plan: TransferPlan, gather: bool) -> None:
        table = plan.table
        interp = interpreting()
        prep = _prepared(table)
        dev = prep.device
        bufs = self._check(plan, dev)
        fn, mod = _program()
        # pageable host staging of a CUDA cache: through a device buffer (pinned: zero-copy)
        bounce: list[tuple[torch.Tensor, torch.Tensor]] = []
        work: dict[str, torch.Tensor] = {}
        for key, buf in bufs.items():
            if not _same(buf.device, dev) and not buf.is_pinned():
                tmp = torch.empty(buf.shape, dtype=buf.dtype, device=dev)
                bounce.append((buf, tmp))
                buf = tmp
            work[key] = buf
        slots = plan.slots if plan.slots.is_contiguous() else plan.slots.contiguous()
        T = slots.numel()
        # every launch is cut before the first one runs: a refusal writes nothing
        calls = []
        for ln in prep.launches:
            lp = launch_params(ln, work[ln.key], T, table.num_layers, few=interp and _INTERP_FEW)
            for pair0, n in lp.chunks:
                args, kw = launch_args(ln, lp, T, pair0, gather, mod.UNIT_TYPES)
                calls.append(((lp.n_tiles, n), args, kw))
        for host, tmp in bounce:
            tmp.copy_(host)  # scatter reads it; a gather leaves its skipped rows as they were
        ready = []
        fast = not interp and _fast_launch()
        with _device_ctx(dev):
            for grid, args, kw in calls:
                launch = fn[grid]
                compiled = launch(slots, *args, **kw)
                run = _runner(compiled, grid) if fast else None
                if run is not None:
                    # the launcher takes every argument in the program's order, constexprs too
                    ready.append((run, (*args, *(kw[k] for k in fn.arg_names[1 + len(args) :]))))
                else:
                    ready.append((_Bound(launch, kw), args))
        for host, tmp in bounce:
            if gather:
                host.copy_(tmp)
        # cached only for device staging: host memory is checked (pinned or not) every call
        if slots is plan.slots and all(_same(b.device, dev) for b in bufs.values()):
            if len(prep.calls) >= _MAX_CACHED:
                prep.calls.clear()
            prep.calls[_signature(plan.staging, slots, gather, interp if dev.type == "cpu" else False)] = tuple(ready)


def launch_args(ln: _Launch, lp: LaunchParams, T: int, pair0: int, gather: bool, unit_types: dict) -> tuple[tuple, dict]:
    """The program's arguments after ``slots`` for the launch of ``ln`` cut as ``lp``
    from pair ``pair0``: ``(runtime arguments in order, compile-time ones and num_warps)``."""
    bs = ln.block_size
    args = (
        T,
        ln.bases,
        ln.desc,
        ln.segs,
        ln.num_planes,
        pair0,
        lp.addr,
        lp.s_index,
        lp.s_layer,
        lp.s_token,
        bs,
        bs.bit_length() - 1,
        ln.n_segs,
        lp.seg_vecs,
        lp.n_full,
    )
    kw = dict(
        GATHER=gather,
        UT=unit_types[lp.unit],
        W=lp.unit,
        ALIGN=lp.align,
        BLOCK_T=lp.block_t,
        NSEG=lp.nseg,
        EA=lp.piece,
        EB=lp.tail,
        NFC=_NF,
        SEGS=ln.n_segs > 1,
        BS_POW2=lp.bs_pow2,
        GROUPED=ln.grouped,
        num_warps=lp.warps,
    )
    return args, kw


class _Bound:
    """A JIT launch with its compile-time arguments bound: ``(slots, *args)``."""

    __slots__ = ("launch", "kw")

    def __init__(self, launch, kw: dict):
        self.launch, self.kw = launch, kw

    def __call__(self, slots, *args):
        return self.launch(slots, *args, **self.kw)


def _signature(staging, slots: torch.Tensor, gather: bool, interp: bool) -> tuple:
    """What fixes a transfer's launches besides the table: the staging buffers' addresses,
    shapes, strides, dtypes and devices, the slots' count, stride, dtype and device, the
    direction, the interpreter, and the tuning knobs."""
    if isinstance(staging, torch.Tensor):
        st = (staging.data_ptr(), staging.shape, staging.stride(), staging.dtype, staging.device)
    else:
        st = tuple((k, v.data_ptr(), v.shape, v.stride(), v.dtype, v.device) for k, v in staging.items())
    return (
        st,
        slots.shape,
        slots.stride(),
        slots.dtype,
        slots.device,
        gather,
        interp,
        _TILE_BYTES,
        _NUM_WARPS,
        _MIN_PROGRAMS,
        _MAX_PIECE,
        _INTERP_FEW,
    )


@dataclass(frozen=True)
class LaunchParams:
    """How one launch is cut.

    Attributes:
        addr: the staging buffer's address; ``s_index``, ``s_layer``, ``s_token``: its byte
            strides over the K/V index, the layer and the token (0 where it has no such axis).
        unit: bytes moved per integer (8, 4, 2 or 1): the widest that divides every address,
            stride, offset and run of the launch.
        align: the largest power of two up to 16 dividing every address the launch forms
            (the vector width in bytes).
        seg_vecs: ``align``-byte vectors per segment.
        piece, n_full, tail: a segment is ``n_full`` pieces of ``piece`` units, then a
            masked piece of ``tail`` units (0: none); powers of two.
        nseg: segments per program step (a power of two, at least the row's segments
            unless they exceed a tile).
        block_t: tokens per program: about ``KVCORE_TRITON_TILE_BYTES`` per piece step,
            fewer when the launch would otherwise have under ``KVCORE_TRITON_MIN_PROGRAMS``
            programs.
        n_tiles: programs per (layer, plane) pair; chunks: ``(first pair, pairs)`` per launch.
        bs_pow2: the block size is a power of two (slot -> block, offset: shift and mask).
        warps: warps per program: ``KVCORE_TRITON_WARPS``, fewer when a program's piece
            step has under one vector per thread.
    """

    addr: int
    s_index: int
    s_layer: int
    s_token: int
    unit: int
    align: int
    seg_vecs: int
    piece: int
    n_full: int
    tail: int
    nseg: int
    block_t: int
    n_tiles: int
    chunks: tuple[tuple[int, int], ...]
    bs_pow2: bool
    warps: int


def launch_params(ln: _Launch, buf: torch.Tensor, T: int, num_layers: int, few: bool = False) -> LaunchParams:
    """Cut ``ln``'s launch for staging buffer ``buf`` and ``T`` tokens (``few``: as few
    programs as possible, for Triton's interpreter).

    Raises:
        TransferError: ``T`` needs more programs than one launch's grid holds.
    """
    esz = buf.element_size()
    if ln.classic:
        s_index, s_layer, s_token = buf.stride(0) * esz, buf.stride(1) * esz, buf.stride(2) * esz
    else:
        s_index, s_layer, s_token = 0, buf.stride(0) * esz, buf.stride(1) * esz
    addr = buf.data_ptr()
    align = _gcd_all((addr, s_index, s_layer, s_token), ln.align)
    unit = 8 if align % 8 == 0 else 4 if align % 4 == 0 else 2 if align % 2 == 0 else 1
    seg_units = ln.seg_bytes // unit
    vec = align // unit
    if seg_units <= _MAX_PIECE:
        piece, n_full = _pow2_floor(seg_units), 1
    else:
        piece, n_full = _MAX_PIECE, seg_units // _MAX_PIECE
    rest = seg_units - n_full * piece
    tail = _pow2_ceil(rest) if rest else 0
    pairs = num_layers * ln.num_planes
    if few:  # the interpreter runs programs one by one: one per pair where it can
        nseg = _pow2_ceil(ln.n_segs)
        block_t = max(1, min(_pow2_ceil(T), _pow2_floor(max(1, _INTERP_TILE_UNITS // (nseg * piece)))))
    else:
        tile_units = max(1, _TILE_BYTES // unit)
        nseg = min(_pow2_ceil(ln.n_segs), _pow2_floor(max(1, tile_units // piece)))
        block_t = max(1, min(_MAX_BLOCK_T, _pow2_ceil(T), _pow2_floor(max(1, tile_units // (nseg * piece)))))
        # ... but enough programs to keep every multiprocessor busy on small transfers
        while block_t > 1 and pairs * -(-T // block_t) < _MIN_PROGRAMS:
            block_t //= 2
    n_tiles = -(-T // block_t)
    if n_tiles > _MAX_TILES:
        raise TransferError(
            f"{NAME}: {T} tokens need {n_tiles} programs per (layer, plane), more than one launch holds; move fewer tokens per call"
        )
    chunks = tuple((p0, min(_MAX_PAIRS, pairs - p0)) for p0 in range(0, pairs, _MAX_PAIRS))
    bs = ln.block_size
    # a small tile's piece step still gives every thread a whole vector
    warps = 1 if few else max(1, min(_NUM_WARPS, _pow2_floor(block_t * nseg * piece // (32 * vec))))
    return LaunchParams(
        addr,
        s_index,
        s_layer,
        s_token,
        unit,
        align,
        seg_units // vec,
        piece,
        n_full,
        tail,
        nseg,
        block_t,
        n_tiles,
        chunks,
        bs > 0 and bs & (bs - 1) == 0,
        warps,
    )


KERNEL = TritonKernel()
