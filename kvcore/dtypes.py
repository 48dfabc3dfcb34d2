"""Element dtype names: one table for the core, the command line and every plugin.

A KV cache's element dtype is named in many places (hints, ``kvcore detect`` JSON,
``kvcore describe --dtype``, plugin fixtures). They all read names through
:func:`parse_dtype`, so a name accepted in one place is accepted everywhere, including
the fp8 *FNUZ* types AMD's MI300 family (gfx942) computes in: ``float8_e4m3fnuz`` and
``float8_e5m2fnuz`` (no negative zero, NaN is 0x80, exponent bias one higher than OCP
fp8: byte 0x40 is 2.0 as ``float8_e4m3fn`` and 1.0 as ``float8_e4m3fnuz``). A byte
buffer never says which fp8 it holds; which one an engine writes is an engine fact
(each plugin documents its own, e.g. SGLang on ROCm writes FNUZ).

Engine vocabularies (vLLM's ``--kv-cache-dtype fp8``, SGLang's ``fp8_e4m3``) stay in
their plugins: they map onto the dtypes here, often depending on the platform.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from kvcore.containers import tensors_in
from kvcore.errors import DetectionError, KVCoreError

__all__ = [
    "DTYPES",
    "DTYPE_ALIASES",
    "FP8_DTYPES",
    "FNUZ_DTYPES",
    "dtype_name",
    "is_fp8",
    "parse_dtype",
    "fp8_dtype",
    "rocm_build",
    "described_tensors",
]

#: canonical name -> dtype: every element dtype kvcore moves (a KV cache's values, or the
#: bytes of fp8 / record caches stored as int8 / uint8).
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    # MXFP8 block scales (OCP MX: 8 exponent bits, no sign, no mantissa): a scale plane's dtype
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}

#: other spellings of the same dtypes (short forms engines and users write).
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3fnuz": "float8_e4m3fnuz",
    "fp8_e5m2fnuz": "float8_e5m2fnuz",
    "fp8_e8m0fnu": "float8_e8m0fnu",
    "e8m0": "float8_e8m0fnu",
}

#: the fp8 element dtypes (OCP and FNUZ).
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: the FNUZ fp8 dtypes (AMD MI300 / gfx942).
FNUZ_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def is_fp8(dtype: Any) -> bool:
    """True for the four fp8 dtypes (OCP e4m3fn / e5m2, FNUZ e4m3fnuz / e5m2fnuz)."""
    return dtype in FP8_DTYPES


def parse_dtype(
    value: Any,
    *,
    what: str = "dtype",
    error: type[KVCoreError] = DetectionError,
    extra: dict[str, torch.dtype | None] | None = None,
) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or a name (``"bfloat16"``, ``"torch.float16"``,
    ``"bf16"``, ``"float8_e4m3fnuz"``; case-insensitive).

    Args:
        value: a ``torch.dtype`` (returned as it is) or a name.
        what: how the caller names the value, for the message (``"hint dtype"``).
        error: the exception class to raise (a :class:`~kvcore.KVCoreError` subclass).
        extra: engine vocabulary accepted besides the table (``{"auto": None, ...}``),
            looked up first.
    Returns:
        the dtype (or ``extra``'s value, which may be None).
    Raises:
        ``error``: an unknown name, listing the accepted ones.
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("torch.", "")
        if extra and key in extra:
            return extra[key]
        key = DTYPE_ALIASES.get(key, key)
        if key in DTYPES:
            return DTYPES[key]
    accepted = list(extra or {}) + list(DTYPES) + list(DTYPE_ALIASES)
    raise error(f"unknown {what} {value!r}: pass a torch.dtype or one of {', '.join(dict.fromkeys(accepted))}")


def fp8_dtype(kind: str, *, fnuz: bool) -> torch.dtype:
    """``("e4m3", fnuz=False)`` -> ``float8_e4m3fn``; ``("e5m2", fnuz=True)`` -> ``float8_e5m2fnuz``.

    Raises:
        ValueError: ``kind`` is not ``"e4m3"`` or ``"e5m2"`` (a programming error).
    """
    table = {
        ("e4m3", False): torch.float8_e4m3fn,
        ("e4m3", True): torch.float8_e4m3fnuz,
        ("e5m2", False): torch.float8_e5m2,
        ("e5m2", True): torch.float8_e5m2fnuz,
    }
    try:
        return table[(kind, bool(fnuz))]
    except KeyError:
        raise ValueError(f"fp8 kind must be 'e4m3' or 'e5m2', got {kind!r}") from None


_DESCRIBED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvcore_described_tensors", default=False)


@contextlib.contextmanager
def described_tensors() -> Iterator[None]:
    """Within this block the tensors being detected are a description (``kvcore detect``
    builds them from JSON), not memory an engine of this process allocated: the torch build
    of this process is no evidence of the engine's platform (:func:`rocm_build` says None)."""
    token = _DESCRIBED.set(True)
    try:
        yield
    finally:
        _DESCRIBED.reset(token)


def rocm_build(tensors: Any) -> bool | None:
    """Whether the process that holds ``tensors`` runs a ROCm (HIP) build of torch:
    ``torch.version.hip`` is set. That is the test engines themselves make (SGLang's
    ``is_hip()``), so it is evidence about the engine's platform when the tensors are
    real memory of this process.

    Returns:
        True / False for real tensors (any device), None when every tensor is on the
        ``meta`` device or inside :func:`described_tensors` (a description from a log:
        this process says nothing about the engine's platform), or there are no tensors.
    """

    ts = tensors_in(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]
    if not ts or _DESCRIBED.get() or all(t.device.type == "meta" for t in ts):
        return None
    return getattr(torch.version, "hip", None) is not None
