"""What one :func:`kvcore.detect` call knows besides the tensors: the caller's hints
(:func:`_hints_dict`), the generic ``tensor_order`` hint (:data:`TENSOR_ORDER`,
:func:`tensor_order`), the hints that fix a geometry (:data:`GEOMETRY_HINTS`), and the
call's context (:data:`_CALL`: its hints and the readings plugins rejected), which
:func:`kvcore.detection.resolve` reads."""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import DetectionError

#: The hint every engine accepts that states how the tensors' axes relate to memory.
TENSOR_ORDER = "tensor_order"


#: Its values: ``"allocated"`` (as the engine allocated them: its logical shape, strides
#: show any permutation) and ``"physical"`` (already permuted into memory order).
TENSOR_ORDERS = ("allocated", "physical")


_ORDER_ALIASES = {
    "allocated": "allocated",
    "as_allocated": "allocated",
    "logical": "allocated",
    "physical": "physical",
    "memory": "physical",
    "memory_order": "physical",
}


#: Default names of the hints that fix a layout's geometry (layout attribute -> hint).
GEOMETRY_HINTS: dict[str, str] = {"block_size": "block_size", "num_heads": "num_kv_heads", "head_size": "head_size"}


def _hints_dict(hints: Any) -> dict[str, Any]:
    if hints is None:
        return {}
    if hasattr(hints, "model_dump"):
        return {k: v for k, v in hints.model_dump().items() if v is not None}
    if isinstance(hints, Mapping):
        return {k: v for k, v in hints.items() if v is not None}
    raise DetectionError(f"hints must be a dict or a pydantic model, got {type(hints).__name__}")


def tensor_order(hints: Mapping[str, Any] | None) -> str | None:
    """The value of the generic :data:`TENSOR_ORDER` hint: ``"allocated"``, ``"physical"``
    or None (not given). Also accepts ``"logical"`` / ``"as_allocated"`` and ``"memory"``
    / ``"memory_order"``.

    Raises:
        DetectionError: any other value.
    """
    if not hints or hints.get(TENSOR_ORDER) is None:
        return None
    v = hints[TENSOR_ORDER]
    key = str(v).strip().lower() if isinstance(v, str) else None
    if key not in _ORDER_ALIASES:
        raise DetectionError(
            f"hint {TENSOR_ORDER}={v!r} is not known: use 'allocated' (the tensors as the engine allocated them; their strides "
            "show the memory order) or 'physical' (the tensors were already permuted so that their axes are in memory order)"
        )
    return _ORDER_ALIASES[key]


# -- one detect() call's context: the caller's hints and the readings plugins rejected ------


@dataclass
class _Call:
    hints: dict[str, Any]
    rejected: list[str] = field(default_factory=list)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("kvcore_detect_call", default=None)
