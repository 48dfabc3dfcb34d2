"""Checks on the tensors a plugin's detection returns: no quantized tensors
(:func:`refuse_quantized`), and views of the caller's memory, never copies
(:class:`_MemoryRanges`); and the private copy of the hints each plugin gets
(:func:`_own_copy`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvcore.containers import tensors_in
from kvcore.errors import DetectionError, KVCoreError


def _own_copy(x: Any, depth: int = 0) -> Any:
    """A copy of a hints value that shares no dict, list or set with ``x`` (tuples and
    frozensets rebuilt when they hold one); other objects (tensors, configs) are shared."""
    if depth > 32:
        return x
    if isinstance(x, Mapping):
        return {k: _own_copy(v, depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [_own_copy(v, depth + 1) for v in x]
    if isinstance(x, set):
        return {_own_copy(v, depth + 1) for v in x}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_own_copy(v, depth + 1) for v in x)
    return x


def _tensors(container: Any) -> list[Any]:
    return tensors_in(container)


def refuse_quantized(container: Any, what: str, error: type[KVCoreError] = DetectionError) -> None:
    """Raise ``error`` when ``container`` holds a quantized tensor (``torch.quint8`` ...):
    kvcore moves plain element types, and torch's quantized tensors have no byte view."""
    _refuse_quantized(_tensors(container), what, error)


def _refuse_quantized(tensors: list[Any], what: str, error: type[KVCoreError] = DetectionError) -> None:
    for t in tensors:
        if getattr(t, "is_quantized", False):
            raise error(
                f"{what} holds a quantized tensor ({str(t.dtype).replace('torch.', '')}, shape {list(t.shape)}); kvcore moves "
                "plain element types: pass the tensor's integer storage (t.int_repr(), or the engine's own uint8/int8 buffer) "
                "and its scales as a plane of their own"
            )


class _MemoryRanges:
    """The byte ranges of every storage the caller's container reaches, per device: a
    detection's tensors must lie inside them (views, not copies). An engine's cache object
    is searched through its attributes (a few levels deep)."""

    def __init__(self, container: Any):
        self.ranges: dict[Any, list[tuple[int, int]]] = {}
        tensors, self.exhaustive = _reachable_tensors(container)
        for t in tensors:
            try:
                st = t.untyped_storage()
                lo = st.data_ptr()
                self.ranges.setdefault(t.device, []).append((lo, lo + st.nbytes()))
            except (RuntimeError, NotImplementedError):  # a tensor without storage: nothing to compare
                continue
        self.known = bool(self.ranges)

    def outside(self, kv_caches: Any) -> str:
        """'' when every tensor of ``kv_caches`` lies in the caller's memory, else which one does not."""
        if not self.known:
            return ""  # an opaque engine object: nothing to compare with
        for i, t in enumerate(_tensors(kv_caches)):
            if t.device.type == "meta" or t.numel() == 0:
                continue
            esz = t.element_size()
            lo = t.data_ptr() + esz * sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
            hi = t.data_ptr() + esz * (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0) + 1)
            if not any(a <= lo and hi <= b for a, b in self.ranges.get(t.device, [])):
                if not self.exhaustive:
                    return ""  # an engine object not searched to its end: its memory may be where we did not look
                return f"tensor {i}, shape {list(t.shape)} on {t.device}, is not a view of the cache"
        return ""


def _reachable_tensors(obj: Any, limit: int = 10_000, max_depth: int = 8) -> tuple[list[Any], bool]:
    """The tensors reachable from ``obj`` through containers and object attributes, and
    whether the search reached every object (False when cut by depth or ``limit``)."""

    out: list[Any] = []
    seen: set[int] = set()
    stack = [(obj, 0)]
    exhaustive = True
    while stack:
        if len(seen) >= limit:
            return out, False
        x, depth = stack.pop()
        if id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), type)):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, Mapping):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, depth + 1) for v in x)
        elif depth >= max_depth:
            exhaustive = False
        else:
            attrs = getattr(x, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend((v, depth + 1) for v in attrs.values())
            for s in getattr(type(x), "__slots__", ()) or ():
                if isinstance(s, str) and hasattr(x, s):
                    stack.append((getattr(x, s), depth + 1))
    return out, exhaustive
