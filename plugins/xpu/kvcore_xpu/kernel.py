"""``triton-xpu``: one generic gather/scatter kernel in Triton, driven by the stride table.

The kernel reads nothing but the :class:`~kvcore.spec.StrideTable` it is handed (planes
with their bases per layer, byte strides, heads, widths and staging targets), so it moves
every layout any plugin declares, single- or multi-plane, without a switch on format
names. Per transfer it launches **one Triton program per staging buffer** (a classic
``[kv_size, NL, T, NH*HS]`` buffer: one launch for all layers and both K and V; a
multi-plane record staged into one buffer per plane: one launch per buffer), each over
every (layer, plane) pair of its buffer and every token.

Bytes move unchanged, as integers of the widest width (8, 4, 2 or 1 bytes) that every
address, stride, offset and run length of the launch allows; when they are all multiples
of 16 the compiler is told so and may use 16-byte vector accesses.

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

Per stride table the descriptors (plane strides and base addresses) are computed once
and uploaded to the device; per call only the staging buffer's address and strides are
read. Nothing synchronises with the host.
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
from kvcore.kernels import TransferPlan
from kvcore.spec import Plane, StrideTable

__all__ = ["TritonKernel", "KERNEL", "NAME", "interpreting", "triton_version"]

NAME = "triton-xpu"
_MAX_CACHED = 64
_MAX_PROGRAMS = 2**31 - 1  # one launch's 1-D grid
# tile sizes (tunable for a benchmark; the defaults were chosen on the GPU script's sweep)
_TILE_BYTES = int(os.environ.get("KVCORE_TRITON_TILE_BYTES", "16384"))
_NUM_WARPS = int(os.environ.get("KVCORE_TRITON_WARPS", "4"))
_MAX_BLOCK_E = 512  # units per segment step
_MIN_PROGRAMS = int(os.environ.get("KVCORE_TRITON_MIN_PROGRAMS", "2048"))


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


@dataclass
class _Segments:
    n_segs: int
    seg_bytes: int
    n_chunks: int


def _segments(p: Plane) -> _Segments:
    """The longest runs contiguous on both the cache and the staging side."""
    s = p.strides
    st = p.staging
    if s.n_chunks == 1:
        if p.num_heads == 1 or (s.head == p.head_bytes and st.head_stride == p.head_bytes):
            return _Segments(1, p.num_heads * p.head_bytes, 1)
        return _Segments(p.num_heads, p.head_bytes, 1)
    return _Segments(p.num_heads * s.n_chunks, s.chunk_bytes, s.n_chunks)


class _Group:
    """The planes staged into one buffer: one launch."""

    __slots__ = ("key", "classic", "desc", "bases", "align", "num_planes", "max_segs", "max_seg_bytes", "grouped", "chunked")

    def __init__(self, key: str, classic: bool, planes: list[Plane], table: StrideTable, device: torch.device):
        self.key = key
        self.classic = classic
        self.num_planes = len(planes)
        rows, align_vals = [], []
        self.max_segs, self.max_seg_bytes = 1, 1
        self.grouped = self.chunked = False
        for p in planes:
            s, st = p.strides, p.staging
            seg = _segments(p)
            grouped = bool(s.token_group) and s.token_group < table.block_size
            tg, tgs = (s.token_group, s.token_group_stride) if grouped else (table.block_size, 0)
            row = [
                s.block,
                s.token,
                tg,
                tgs,
                s.head,
                s.chunk,
                seg.n_chunks,
                s.chunk_bytes,
                seg.n_segs,
                seg.seg_bytes,
                st.index if st.index is not None else 0,
                st.offset,
                st.head_stride,
            ]
            rows.append(row + [0] * (16 - len(row)))
            align_vals += [s.block, s.token, tgs, s.chunk_bytes, seg.seg_bytes, st.offset, st.head_stride]
            if p.num_heads > 1:
                align_vals.append(s.head)
            if seg.n_chunks > 1:
                align_vals.append(s.chunk)
            self.grouped = self.grouped or grouped
            self.chunked = self.chunked or seg.n_chunks > 1
            self.max_segs = max(self.max_segs, seg.n_segs)
            self.max_seg_bytes = max(self.max_seg_bytes, seg.seg_bytes)
        addrs = [[t.untyped_storage().data_ptr() + off for (t, off) in (p.bases[li] for p in planes)] for li in range(table.num_layers)]
        align_vals += [a for layer in addrs for a in layer]
        self.align = _gcd_all(align_vals)
        self.desc = torch.tensor(rows, dtype=torch.int64).to(device)
        self.bases = torch.tensor(addrs, dtype=torch.int64).reshape(table.num_layers, len(planes)).to(device)


class _Prepared:
    """Per-table launch arguments, computed once per stride table."""

    __slots__ = ("groups", "probe", "calls", "__weakref__")

    def __init__(self, table: StrideTable):
        self.calls: dict[tuple, tuple] = {}
        t0 = table.planes[0].bases[0][0]
        self.probe = (t0, t0.untyped_storage().data_ptr(), t0.untyped_storage().nbytes())
        groups = []
        for b in table.buffers:
            planes = [p for p in table.planes if p.staging.buffer == b.key]
            if planes:
                groups.append(_Group(b.key, b.kv_size is not None, planes, table, table.device))
        self.groups = groups


_CACHE: OrderedDict[int, tuple[weakref.ref, _Prepared]] = OrderedDict()


def _fresh(prep: _Prepared) -> bool:
    t, ptr, nbytes = prep.probe
    st = t.untyped_storage()
    return st.data_ptr() == ptr and st.nbytes() == nbytes


def _prepared(table: StrideTable) -> _Prepared:
    """The launch arguments of ``table``, cached while the table lives and its first
    plane's storage is the one they were computed against.

    Raises:
        TransferError: a plane's storage was freed since detection.
    """
    hit = _CACHE.get(id(table))
    if hit is not None and hit[0]() is table and _fresh(hit[1]):
        return hit[1]
    for p in table.planes:
        for t, _ in p.bases:
            if t.untyped_storage().nbytes() == 0:
                raise TransferError(f"{NAME}: the cache's storage was freed or resized since detection; detect the cache again")
    prep = _Prepared(table)
    _CACHE[id(table)] = (weakref.ref(table), prep)
    while len(_CACHE) > _MAX_CACHED:
        _CACHE.popitem(last=False)
    return prep


def _same_device(dev: torch.device) -> bool:
    """The launch goes to ``dev`` without switching the current device."""
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
            "integer units of up to 8 bytes, 16-byte vectors where every address allows"
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

    def _check(self, plan: TransferPlan) -> dict[str, torch.Tensor]:
        """Everything this kernel needs, checked before the first byte moves.

        Raises:
            TransferError: a device this kernel cannot run on (CPU tensors outside the
                interpreter, device tensors inside it), a staging buffer missing or of the
                wrong rank, or slots not on the cache's device.
        """
        table = plan.table
        dev = table.device
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
        if plan.slots.device != dev or plan.slots.dtype != torch.int64 or plan.slots.dim() != 1:
            raise TransferError(
                f"{NAME}: slots must be int64 [T] on {dev}, got {plan.slots.dtype} {tuple(plan.slots.shape)} on {plan.slots.device}"
            )
        bufs = plan.buffers
        t = plan.slots.numel()
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
            if buf.device != dev:
                ok = dev.type == "cuda" and buf.device.type == "cpu" and not interpreting()
                if not ok:
                    raise TransferError(f"{NAME}: staging buffer {b.key!r} is on {buf.device} but the cache is on {dev}")
        return bufs

    def _run(self, plan: TransferPlan, gather: bool) -> None:
        if plan.num_valid == 0 or plan.slots.numel() == 0:
            return
        table = plan.table
        dev = table.device
        # CPU tensors run only in the interpreter (the checked path refuses them otherwise)
        interp = interpreting() if dev.type == "cpu" else False
        slots = plan.slots
        # the fast path: this table, staged the same way as before (same buffers, strides,
        # token count, devices): launch the arguments computed then
        hit = _CACHE.get(id(table))
        if hit is not None and hit[0]() is table and _fresh(hit[1]):
            sig = _signature(plan.staging, slots, interp)
            calls = hit[1].calls.get(sig)
            if calls is not None:
                fn = _FN[interp]
                if _same_device(dev):
                    for grid, args, kw in calls:
                        fn[grid](slots, *args, GATHER=gather, **kw)
                else:
                    with _device_ctx(dev):
                        for grid, args, kw in calls:
                            fn[grid](slots, *args, GATHER=gather, **kw)
                return
        self._run_checked(plan, gather)

    def _run_checked(self, plan: TransferPlan, gather: bool) -> None:
        table = plan.table
        interp = interpreting()
        bufs = self._check(plan)
        fn, mod = _program()
        _FN[interp] = fn
        prep = _prepared(table)
        dev = table.device
        # pageable host staging of a CUDA cache: through a device buffer (pinned: zero-copy)
        bounce: list[tuple[torch.Tensor, torch.Tensor]] = []
        work: dict[str, torch.Tensor] = {}
        for g in prep.groups:
            buf = bufs[g.key]
            if buf.device != dev and not buf.is_pinned():
                tmp = torch.empty(buf.shape, dtype=buf.dtype, device=dev)
                bounce.append((buf, tmp))
                buf = tmp
            work[g.key] = buf
        slots = plan.slots if plan.slots.is_contiguous() else plan.slots.contiguous()
        T = slots.numel()
        # every launch is cut before the first one runs: a refusal writes nothing
        calls = []
        for g in prep.groups:
            # the interpreter runs programs one by one: as few as possible there
            lp = launch_params(g, work[g.key], T, table.num_layers, 1 if interp else None)
            kw = dict(
                UT=mod.UNIT_TYPES[lp.unit],
                W=lp.unit,
                ALIGN=lp.align,
                BLOCK_R=lp.block_r,
                BLOCK_E=lp.block_e,
                NFC=mod.NF,
                ONE_SEG=g.max_segs == 1,
                GROUPED=g.grouped,
                CHUNKED=g.chunked,
                num_warps=_NUM_WARPS,
            )
            for pair0, n in lp.chunks:
                args = (T, g.bases, g.desc, g.num_planes, lp.n_tiles, pair0, lp.addr, lp.s_index, lp.s_layer, lp.s_token, table.block_size)
                calls.append(((n * lp.n_tiles,), args, kw))
        for host, tmp in bounce:
            tmp.copy_(host)  # scatter reads it; a gather leaves its skipped rows as they were
        with _device_ctx(dev):
            for grid, args, kw in calls:
                fn[grid](slots, *args, GATHER=gather, **kw)
        for host, tmp in bounce:
            if gather:
                host.copy_(tmp)
        # cached only for device staging: host memory is checked (pinned or not) every call
        if slots is plan.slots and all(b.device == dev for b in bufs.values()):
            if len(prep.calls) >= _MAX_CACHED:
                prep.calls.clear()
            prep.calls[_signature(plan.staging, slots, interp)] = tuple(calls)


_FN: dict[bool, object] = {}


def _signature(staging, slots: torch.Tensor, interp: bool) -> tuple:
    """What fixes a transfer's launch arguments besides the table: the staging buffers'
    addresses, shapes, strides, dtypes and devices, the slots' count, device and dtype."""
    if isinstance(staging, torch.Tensor):
        st = (staging.data_ptr(), staging.shape, staging.stride(), staging.dtype, staging.device)
    else:
        st = tuple((k, v.data_ptr(), v.shape, v.stride(), v.dtype, v.device) for k, v in staging.items())
    return (st, slots.shape, slots.dtype, slots.device, interp, _TILE_BYTES, _NUM_WARPS, _MIN_PROGRAMS)


@dataclass(frozen=True)
class LaunchParams:
    """How one staging buffer's launch is cut.

    Attributes:
        addr: the staging buffer's address; ``s_index``, ``s_layer``, ``s_token``: its byte
            strides over the K/V index, the layer and the token (0 where it has no such axis).
        unit: bytes moved per integer (8, 4, 2 or 1): the widest that divides every address,
            stride, offset and run of the launch.
        align: the largest power of two up to 16 dividing every address the launch forms.
        block_e: units per step along a segment; block_r: (token, segment) items per program
            (about ``KVCORE_TRITON_TILE_BYTES`` per program, fewer when the launch would
            otherwise have under ``KVCORE_TRITON_MIN_PROGRAMS`` programs).
        n_tiles: programs per (layer, plane) pair; chunks: ``(first pair, pairs)`` per launch.
    """

    addr: int
    s_index: int
    s_layer: int
    s_token: int
    unit: int
    align: int
    block_e: int
    block_r: int
    n_tiles: int
    chunks: tuple[tuple[int, int], ...]


def launch_params(g: _Group, buf: torch.Tensor, T: int, num_layers: int, min_programs: int | None = None) -> LaunchParams:
    esz = buf.element_size()
    if g.classic:
        s_index, s_layer, s_token = buf.stride(0) * esz, buf.stride(1) * esz, buf.stride(2) * esz
    else:
        s_index, s_layer, s_token = 0, buf.stride(0) * esz, buf.stride(1) * esz
    addr = buf.data_ptr()
    align = _gcd_all((addr, s_index, s_layer, s_token), g.align)
    unit = 8 if align % 8 == 0 else 4 if align % 4 == 0 else 2 if align % 2 == 0 else 1
    block_e = _block_e(g.max_seg_bytes // unit)
    # about _TILE_BYTES per program (a segment longer than block_e takes several steps) ...
    block_r = max(1, min(1024, _pow2_floor(max(1, _TILE_BYTES // max(g.max_seg_bytes, block_e * unit)))))
    pairs = num_layers * g.num_planes
    # ... but enough programs to keep every multiprocessor busy on small transfers
    min_programs = _MIN_PROGRAMS if min_programs is None else min_programs
    while block_r > 1 and pairs * -(-(T * g.max_segs) // block_r) < min_programs:
        block_r //= 2
    n_tiles = max(1, -(-(T * g.max_segs) // block_r))
    if n_tiles > _MAX_PROGRAMS:
        raise TransferError(
            f"{NAME}: {T} tokens need {n_tiles} programs per (layer, plane), more than one launch holds; move fewer tokens per call"
        )
    per_launch = max(1, _MAX_PROGRAMS // n_tiles)
    chunks = tuple((p0, min(per_launch, pairs - p0)) for p0 in range(0, pairs, per_launch))
    return LaunchParams(addr, s_index, s_layer, s_token, unit, align, block_e, block_r, n_tiles, chunks)


def _block_e(seg_units: int) -> int:
    """Units per step along a segment: the largest power of two (at most
    :data:`_MAX_BLOCK_E`) whose rounding of the segment wastes at most an eighth of it."""
    seg_units = max(1, seg_units)
    e = min(_MAX_BLOCK_E, 1 << (seg_units - 1).bit_length())
    while e > 1 and (-(-seg_units // e) * e - seg_units) * 8 > seg_units:
        e //= 2
    return e


KERNEL = TritonKernel()
