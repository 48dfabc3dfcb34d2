"""Tensors described in JSON (shapes, strides, dtypes), for ``kvcore detect``: a user can
ask about a cache they saw in a log without the cache.

A description is ``{"engine": ..., "hints": {...}, "dtype": ..., "kv_caches": NODE}`` or a
bare NODE. A NODE is a leaf ``{"shape": [...], "stride": [...], "dtype": "bfloat16",
"storage": "name", "storage_offset": n}``, a list of NODEs, a dict of layer name → NODE,
or ``{"repeat": N, "of": NODE}`` for N identical layers (under a plane role, ``{"K": {"repeat": N, "of": ...}}``, the
plane's list of layers). Leaves naming one ``storage``
become views of one buffer (vLLM 0.33's per-layer views into one allocation).
Tensors are built on ``meta`` (no memory) or as CPU storage that is reserved but never
written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from kvcore.dtypes import parse_dtype as _parse
from kvcore.errors import KVCoreError

__all__ = ["UsageError", "load_tensor_description", "parse_dtype"]


class UsageError(KVCoreError, ValueError):
    """Bad command-line input (an unreadable description, an unknown dtype): the CLI
    reports it on stderr with exit code 2."""


def parse_dtype(name: str) -> Any:
    """A dtype name from a description or the command line, read through the shared
    table :mod:`kvcore.dtypes` (fp8 FNUZ included).

    Raises:
        UsageError: an unknown name (listing the accepted ones).
    """

    return _parse(name, what="dtype", error=UsageError)


#: the most tensors a description may expand to: a model has a few hundred layers; a repeat
#: far beyond that is a typo (checked before anything is built, so it answers at once)
MAX_TENSORS = 16384
_I64 = 2**63 - 1


class _LeafSpec:
    __slots__ = ("shape", "stride", "dtype", "storage", "storage_offset", "step", "where", "esize")

    def __init__(self, shape, stride, dtype, storage, storage_offset, step, where, esize):
        self.shape, self.stride, self.dtype = shape, stride, dtype
        self.storage, self.storage_offset, self.step, self.where, self.esize = storage, storage_offset, step, where, esize

    def offset(self, index: int | None) -> int:
        return self.storage_offset + (index or 0) * self.step

    def extent(self, index: int | None) -> int:
        """Elements from the storage's start to one past the last element addressed."""
        if any(n == 0 for n in self.shape):
            return self.offset(index)
        return self.offset(index) + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1


class _Repeated:
    """``count`` copies of one node, described once (nothing per copy until built)."""

    __slots__ = ("count", "node", "where")

    def __init__(self, count: int, node: Any, where: str):
        self.count, self.node, self.where = count, node, where


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _int_list(v: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise UsageError(f"{where}: {what} must be a list of integers, got {_short(v)}")
    if any(abs(x) > _I64 for x in v):
        raise UsageError(f"{where}: {what} {_short(v)} has an entry beyond 64 bits (a tensor's sizes and strides are int64)")
    return tuple(v)


def _short(v: Any, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _positive_int(v: Any, what: str, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UsageError(f"{where}: {what} must be a positive integer, got {_short(v)}")
    return v


_LEAF_KEYS = {"shape", "stride", "dtype", "storage", "storage_offset", "repeat", "storage_offset_step"}


def _parse_leaf(d: dict, where: str, default_dtype: str | None) -> _LeafSpec:

    unknown = set(d) - _LEAF_KEYS
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {sorted(unknown)}; a tensor takes {sorted(_LEAF_KEYS)}")
    shape = _int_list(d["shape"], "shape", where)
    if any(n < 0 for n in shape):
        raise UsageError(f"{where}: shape {list(shape)} has a negative size")
    stride = _int_list(d["stride"], "stride", where) if "stride" in d else _contiguous_stride(shape)
    if len(stride) != len(shape):
        raise UsageError(f"{where}: stride {list(stride)} has {len(stride)} entries but shape {list(shape)} has {len(shape)}")
    if any(s < 0 for s in stride):
        raise UsageError(f"{where}: negative strides {list(stride)} are not supported")
    dt = d.get("dtype", default_dtype)
    if dt is None:
        raise UsageError(f'{where}: no dtype (give "dtype": "bfloat16" on the tensor or at the top level)')
    off = d.get("storage_offset", 0)
    step = d.get("storage_offset_step", 0)
    for name, v in (("storage_offset", off), ("storage_offset_step", step)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UsageError(f"{where}: {name} must be a non-negative integer, got {_short(v)}")
    storage = d.get("storage")
    if storage is not None and not isinstance(storage, str):
        raise UsageError(f"{where}: storage must be a name (string) shared by the tensors that view one buffer")
    dtype = parse_dtype(dt)
    leaf = _LeafSpec(shape, stride, dtype, storage, off, step, where, dtype.itemsize)
    if math.prod(shape) > _I64 or leaf.extent(None) * leaf.esize > _I64:
        raise UsageError(
            f"{where}: shape {list(shape)} with stride {list(stride)} addresses {leaf.extent(None) * leaf.esize:,} bytes "
            f"({math.prod(shape):,} elements); a tensor must fit in 64-bit byte offsets (under 8 EiB)"
        )
    return leaf


def _is_leaf(d: dict) -> bool:
    return "shape" in d


def _expand(node: Any, where: str, default_dtype: str | None, depth: int = 0, repeated: bool = False) -> Any:
    """JSON node → the same nesting with :class:`_LeafSpec` leaves and :class:`_Repeated`
    repeats (described once, not expanded)."""
    if depth > 64:
        raise UsageError(f"{where}: nested more than 64 levels deep; a KV cache is a few levels of lists at most")
    if isinstance(node, dict):
        if _is_leaf(node):
            leaf = _parse_leaf(node, where, default_dtype)
            if "repeat" not in node:
                if leaf.step and not repeated:
                    raise UsageError(
                        f'{where}: "storage_offset_step" advances the offset per repeat, but this tensor is not repeated '
                        '(give it "repeat": N, or put it inside {"repeat": N, "of": ...})'
                    )
                return leaf
            return _Repeated(_positive_int(node["repeat"], "repeat", where), leaf, where)
        if "repeat" in node and "of" in node:
            extra = set(node) - {"repeat", "of"}
            if extra:
                raise UsageError(f'{where}: a repeat takes "repeat" and "of" only, not {sorted(extra)}')
            n = _positive_int(node["repeat"], "repeat", where)
            return _Repeated(n, _expand(node["of"], f"{where}[i]", default_dtype, depth + 1, True), where)
        out: dict[str, Any] = {}
        for k, v in node.items():
            sub = _expand(v, f"{where}[{k!r}]", default_dtype, depth + 1, repeated)
            if isinstance(sub, _Repeated) and "{i}" not in k and not _is_role(k):
                raise UsageError(
                    f"{where}: key {k!r} repeats its tensor; put '{{i}}' in the name (e.g. model.layers.{{i}}.self_attn.attn), "
                    "or name a plane role (K, V, KS, ...), whose repeat is the plane's list of layers"
                )
            out[k] = sub
        if not out:
            raise UsageError(f"{where}: an empty mapping describes no tensors")
        return out
    if isinstance(node, list):
        items = [_expand(v, f"{where}[{i}]", default_dtype, depth + 1, repeated) for i, v in enumerate(node)]
        if not items:
            raise UsageError(f"{where}: an empty list describes no tensors")
        return items
    raise UsageError(f'{where}: expected a tensor ({{"shape": [...], "dtype": ...}}), a list or a mapping, got {_short(node)}')


def _is_role(key: str) -> bool:
    """A multi-plane role key (``K``, ``V``, ``KS``, ``KV``: upper case, as :class:`kvcore.Planes`)."""
    return re.fullmatch(r"[A-Z][A-Z0-9]*", key) is not None


def _count(node: Any) -> int:
    """How many tensors ``node`` expands to, without expanding it."""
    if isinstance(node, _LeafSpec):
        return 1
    if isinstance(node, _Repeated):
        return node.count * _count(node.node)
    vals = node.values() if isinstance(node, dict) else node
    return sum(_count(v) for v in vals)


def _instances(node: Any, index: int | None = None):
    """Every (leaf, repeat index) ``node`` expands to: the index counts the copies of the
    enclosing repeats, outer repeats major (it advances ``storage_offset_step``)."""
    if isinstance(node, _LeafSpec):
        yield node, index
    elif isinstance(node, _Repeated):
        for i in range(node.count):
            yield from _instances(node.node, i if index is None else index * node.count + i)
    else:
        for v in node.values() if isinstance(node, dict) else node:
            yield from _instances(v, index)


def _materialize(node: Any, device: str) -> Any:
    """Build the tensors: each leaf its own storage of the minimal size, or views of one
    shared storage per ``storage`` name. On ``meta`` nothing is allocated."""
    import torch

    shared: dict[str, int] = {}
    for lf, idx in _instances(node):
        nbytes = lf.extent(idx) * lf.esize
        if nbytes > _I64:
            raise UsageError(f"{lf.where}: copy {idx} starts at element {lf.offset(idx):,} and ends past 64-bit byte offsets")
        if lf.storage:
            shared[lf.storage] = max(shared.get(lf.storage, 0), nbytes)
    bases: dict[str, Any] = {}
    for name, nbytes in shared.items():
        bases[name] = torch.empty(max(nbytes, 1) + 8, dtype=torch.uint8, device=device)

    def build(lf: _LeafSpec, idx: int | None):
        off = lf.offset(idx)
        if lf.storage:
            base = bases[lf.storage]
            usable = (base.numel() // lf.esize) * lf.esize
            typed = base[:usable].view(lf.dtype)
            return torch.as_strided(typed, lf.shape, lf.stride, off)
        if off:
            flat = torch.empty(max(lf.extent(idx), 1), dtype=lf.dtype, device=device)
            return torch.as_strided(flat, lf.shape, lf.stride, off)
        return torch.empty_strided(lf.shape, lf.stride, dtype=lf.dtype, device=device)

    def copies(x: _Repeated, idx: int | None) -> list[Any]:
        return [walk(x.node, i if idx is None else idx * x.count + i) for i in range(x.count)]

    def walk(x: Any, idx: int | None) -> Any:
        if isinstance(x, _LeafSpec):
            return build(x, idx)
        if isinstance(x, _Repeated):
            return copies(x, idx)
        if isinstance(x, dict):
            out: dict[str, Any] = {}
            for k, v in x.items():
                if isinstance(v, _Repeated) and "{i}" not in k:  # a plane role: its list of layers
                    out[k] = copies(v, idx)
                elif isinstance(v, _Repeated):
                    for i, item in enumerate(copies(v, idx)):
                        out[k.replace("{i}", str(i))] = item
                else:
                    out[k] = walk(v, idx)
            return out
        out_list: list[Any] = []
        for v in x:
            if isinstance(v, _Repeated):
                out_list.extend(copies(v, idx))
            else:
                out_list.append(walk(v, idx))
        return out_list

    return walk(node, None)


def load_tensor_description(doc: Any, device: str = "meta") -> tuple[Any, str | None, dict]:
    """Turn a JSON tensor description into tensors: ``(kv_caches, engine, hints)``.

    The document is ``{"engine": ..., "hints": {...}, "dtype": ..., "kv_caches": NODE}`` or a
    bare NODE, where NODE is a tensor ``{"shape": [...], "stride": [...], "dtype": "bfloat16",
    "storage_offset": 0, "storage": "name", "repeat": N, "storage_offset_step": S}``, a list
    of NODEs, or a mapping of layer name → NODE (a name with ``{i}`` expands a repeated
    tensor). ``stride`` defaults to contiguous; tensors naming one ``storage`` are views of
    one buffer (vLLM 0.33 views into one allocation); ``{"repeat": N, "of": NODE}``
    repeats any node. Strides and offsets are in elements of the tensor's dtype.
    ``storage_offset_step`` advances a tensor's offset by S for each copy of the repeat
    around it (its own ``"repeat"``, or ``{"repeat", "of"}`` nodes: copies are counted
    across nested repeats, outer major). Repeats are described once and counted before
    anything is built: a description of more than :data:`MAX_TENSORS` tensors is refused
    at once.

    Raises:
        UsageError: malformed descriptions (the message says where), sizes beyond 64 bits,
            too many tensors, or tensors torch cannot build. On a CPU ``device``, a
            RuntimeError/MemoryError when the address space is not there (the CLI then
            builds on ``meta``).
    """
    if isinstance(doc, dict) and "kv_caches" in doc:
        extra = set(doc) - {"engine", "hints", "dtype", "kv_caches", "comment"}
        if extra:
            raise UsageError(f"unknown top-level key(s) {sorted(extra)}; use engine, hints, dtype, kv_caches")
        node, engine, hints, dtype = doc["kv_caches"], doc.get("engine"), doc.get("hints") or {}, doc.get("dtype")
    else:
        node, engine, hints, dtype = doc, None, {}, None
    if not isinstance(hints, dict):
        raise UsageError(f"hints must be a JSON object, got {_short(hints)}")
    if engine is not None and not isinstance(engine, str):
        raise UsageError(f"engine must be a string, got {_short(engine)}")
    tree = _expand(node, "kv_caches", dtype)
    n = _count(tree)
    if n > MAX_TENSORS:
        raise UsageError(
            f"the description expands to {n:,} tensors; kvcore detect builds at most {MAX_TENSORS:,} (a model has a few hundred "
            'layers): check the "repeat" counts'
        )
    try:
        return _materialize(tree, device), engine, hints
    except UsageError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError) as e:
        if device != "meta" and isinstance(e, (RuntimeError, MemoryError)):
            raise  # no address space for CPU storage: the caller may fall back to meta
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"these tensors cannot be built: {type(e).__name__}: {first}") from None
