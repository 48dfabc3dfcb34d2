"""Tensors described in JSON (shapes, strides, dtypes), for ``kvcore detect``: a user can
ask about a cache they saw in a log without the cache.

A description is ``{"engine": ..., "hints": {...}, "dtype": ..., "kv_caches": NODE}`` or a
bare NODE. A NODE is a leaf ``{"shape": [...], "stride": [...], "dtype": "bfloat16",
"storage": "name", "storage_offset": n}``, a list of NODEs, a dict of layer name → NODE,
or ``{"repeat": N, "of": NODE}`` for N identical layers. Leaves naming one ``storage``
become views of one buffer (vLLM 0.33's per-layer views into one allocation).
Tensors are built on ``meta`` (no memory) or as CPU storage that is reserved but never
written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
    from kvcore.dtypes import parse_dtype as _parse

    return _parse(name, what="dtype", error=UsageError)


class _LeafSpec:
    __slots__ = ("shape", "stride", "dtype", "storage", "storage_offset", "where")

    def __init__(self, shape, stride, dtype, storage, storage_offset, where):
        self.shape, self.stride, self.dtype = shape, stride, dtype
        self.storage, self.storage_offset, self.where = storage, storage_offset, where


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _int_list(v: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise UsageError(f"{where}: {what} must be a list of integers, got {v!r}")
    return tuple(v)


_LEAF_KEYS = {"shape", "stride", "dtype", "storage", "storage_offset", "repeat", "storage_offset_step"}


def _parse_leaf(d: dict, where: str, default_dtype: str | None, index: int | None = None) -> _LeafSpec:
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
            raise UsageError(f"{where}: {name} must be a non-negative integer, got {v!r}")
    if index is not None:
        off += index * step
    storage = d.get("storage")
    if storage is not None and not isinstance(storage, str):
        raise UsageError(f"{where}: storage must be a name (string) shared by the tensors that view one buffer")
    return _LeafSpec(shape, stride, parse_dtype(dt), storage, off, where)


def _is_leaf(d: dict) -> bool:
    return "shape" in d


def _expand(node: Any, where: str, default_dtype: str | None) -> Any:
    """JSON node → the same nesting with :class:`_LeafSpec` leaves (``repeat`` expanded)."""
    if isinstance(node, dict):
        if _is_leaf(node):
            n = node.get("repeat")
            if n is None:
                return _parse_leaf(node, where, default_dtype)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise UsageError(f"{where}: repeat must be a positive integer, got {n!r}")
            return _Repeated([_parse_leaf(node, f"{where}[{i}]", default_dtype, i) for i in range(n)])
        if "repeat" in node and "of" in node:
            n = node["repeat"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise UsageError(f"{where}: repeat must be a positive integer, got {n!r}")
            return _Repeated([_expand(node["of"], f"{where}[{i}]", default_dtype) for i in range(n)])
        out: dict[str, Any] = {}
        for k, v in node.items():
            sub = _expand(v, f"{where}[{k!r}]", default_dtype)
            if isinstance(sub, _Repeated):
                if "{i}" not in k:
                    raise UsageError(
                        f"{where}: key {k!r} repeats its tensor; put '{{i}}' in the name (e.g. model.layers.{{i}}.self_attn.attn)"
                    )
                for i, item in enumerate(sub.items):
                    out[k.replace("{i}", str(i))] = item
            else:
                out[k] = sub
        if not out:
            raise UsageError(f"{where}: an empty mapping describes no tensors")
        return out
    if isinstance(node, list):
        items: list[Any] = []
        for i, v in enumerate(node):
            sub = _expand(v, f"{where}[{i}]", default_dtype)
            items.extend(sub.items if isinstance(sub, _Repeated) else [sub])
        if not items:
            raise UsageError(f"{where}: an empty list describes no tensors")
        return items
    raise UsageError(f'{where}: expected a tensor ({{"shape": [...], "dtype": ...}}), a list or a mapping, got {node!r}')


class _Repeated:
    def __init__(self, items: list[Any]):
        self.items = items


def _leaves(node: Any) -> list[_LeafSpec]:
    if isinstance(node, _LeafSpec):
        return [node]
    if isinstance(node, _Repeated):
        node = node.items
    vals = node.values() if isinstance(node, dict) else node
    return [x for v in vals for x in _leaves(v)]


def _extent_elems(leaf: _LeafSpec) -> int:
    if any(n == 0 for n in leaf.shape):
        return leaf.storage_offset
    return leaf.storage_offset + sum((n - 1) * s for n, s in zip(leaf.shape, leaf.stride)) + 1


def _materialize(node: Any, device: str) -> Any:
    """Build the tensors: each leaf its own storage of the minimal size, or views of one
    shared storage per ``storage`` name. On ``meta`` nothing is allocated."""
    import torch

    leaves = _leaves(node)
    shared: dict[str, int] = {}
    for lf in leaves:
        if lf.storage:
            esz = torch.empty(0, dtype=lf.dtype).element_size()
            shared[lf.storage] = max(shared.get(lf.storage, 0), _extent_elems(lf) * esz)
    bases: dict[str, Any] = {}
    for name, nbytes in shared.items():
        bases[name] = torch.empty(max(nbytes, 1) + 8, dtype=torch.uint8, device=device)

    def build(lf: _LeafSpec):
        if lf.storage:
            base = bases[lf.storage]
            esz = torch.empty(0, dtype=lf.dtype).element_size()
            usable = (base.numel() // esz) * esz
            typed = base[:usable].view(lf.dtype)
            return torch.as_strided(typed, lf.shape, lf.stride, lf.storage_offset)
        n = _extent_elems(lf)
        if lf.storage_offset:
            flat = torch.empty(max(n, 1), dtype=lf.dtype, device=device)
            return torch.as_strided(flat, lf.shape, lf.stride, lf.storage_offset)
        return torch.empty_strided(lf.shape, lf.stride, dtype=lf.dtype, device=device)

    def walk(x: Any) -> Any:
        if isinstance(x, _LeafSpec):
            return build(x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return [walk(v) for v in x]

    return walk(node)


def load_tensor_description(doc: Any, device: str = "meta") -> tuple[Any, str | None, dict]:
    """Turn a JSON tensor description into tensors: ``(kv_caches, engine, hints)``.

    The document is ``{"engine": ..., "hints": {...}, "dtype": ..., "kv_caches": NODE}`` or a
    bare NODE, where NODE is a tensor ``{"shape": [...], "stride": [...], "dtype": "bfloat16",
    "storage_offset": 0, "storage": "name", "repeat": N, "storage_offset_step": S}``, a list
    of NODEs, or a mapping of layer name → NODE (a name with ``{i}`` expands a repeated
    tensor). ``stride`` defaults to contiguous; tensors naming one ``storage`` are views of
    one buffer (vLLM 0.33 views into one allocation); ``{"repeat": N, "of": NODE}``
    repeats any node. Strides and offsets are in elements of the tensor's dtype.

    Raises:
        UsageError: malformed descriptions (the message says where).
    """
    if isinstance(doc, dict) and "kv_caches" in doc:
        extra = set(doc) - {"engine", "hints", "dtype", "kv_caches", "comment"}
        if extra:
            raise UsageError(f"unknown top-level key(s) {sorted(extra)}; use engine, hints, dtype, kv_caches")
        node, engine, hints, dtype = doc["kv_caches"], doc.get("engine"), doc.get("hints") or {}, doc.get("dtype")
    else:
        node, engine, hints, dtype = doc, None, {}, None
    if not isinstance(hints, dict):
        raise UsageError(f"hints must be a JSON object, got {hints!r}")
    tree = _expand(node, "kv_caches", dtype)
    if isinstance(tree, _Repeated):
        tree = tree.items
    return _materialize(tree, device), engine, hints
