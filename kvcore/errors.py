"""kvcore's exception hierarchy.

Every validation failure in kvcore raises one of these (never ``assert``), and every
message names what was wrong and what would be right::

    KVCoreError
    ├── FormatError            bad format template, unknown format name
    ├── DetectionError         nothing recognises this input
    │   └── AmbiguousLayoutError   two formats fit; names both and the deciding hint
    ├── GeometryError          an accessor the format cannot answer, inconsistent sizes
    ├── TransferError          bad slot/block ids, dtype/device/shape mismatch (raised
    │                          before any byte is written)
    └── PluginError            duplicate format names, a broken plugin in strict mode
"""

from __future__ import annotations

__all__ = [
    "KVCoreError",
    "FormatError",
    "DetectionError",
    "AmbiguousLayoutError",
    "GeometryError",
    "TransferError",
    "PluginError",
]


class KVCoreError(Exception):
    """Base class of every error kvcore raises on purpose."""


class FormatError(KVCoreError, ValueError):
    """A format name does not parse, or names no registered format."""


class DetectionError(KVCoreError, ValueError):
    """No plugin recognises the KV cache handed to :func:`kvcore.detect`."""


class AmbiguousLayoutError(DetectionError):
    """Two or more formats fit the same tensors and no hint decides between them.

    Attributes:
        candidates: the format names (with sizes) that fit.
        hints: every hint key that bears on the choice (none the caller gave).
        decide: the sets of hints that decide: ``[[k], ...]`` when each ``k`` decides
            alone, ``[[a, b]]`` when ``a`` and ``b`` decide only together, ``[]`` when the
            hints cannot tell every candidate apart (or the raiser did not work it out).
    """

    def __init__(
        self,
        message: str,
        candidates: list[str] | None = None,
        hints: list[str] | None = None,
        decide: list[list[str]] | None = None,
    ):
        super().__init__(message)
        self.candidates = list(candidates or [])
        self.hints = list(hints or [])
        self.decide = [list(d) for d in decide] if decide is not None else [[h] for h in self.hints]


class GeometryError(KVCoreError, ValueError):
    """A geometry question the format cannot answer, or tensors whose sizes disagree."""


class TransferError(KVCoreError, ValueError):
    """A gather/scatter call was refused. Raised before any byte of the cache is written."""


class PluginError(KVCoreError, RuntimeError):
    """A plugin misbehaved: a duplicate format name, a failed import in strict mode."""
