"""Declared hints: what a plugin's detector reads from ``kvcore.detect(..., hints=...)``.

A plugin declares each hint it reads through the ``kvcore_register_hints`` hook, so a
user can ask ``kvcore hints ENGINE`` (or :func:`kvcore.hints`) what to pass, what each
hint means and which values it accepts, instead of reading the plugin's source::

    @kvcore.hookimpl
    def kvcore_register_hints(register):
        register(kvcore.Hint(
            engine="tinyllm",
            name="kv_layout",
            meaning="the cache's head order, as tinyllm's --kv-layout flag sets it",
            values=["NHD", "HND"],
            default="read from the strides; NHD when they cannot tell",
            source="tinyllm/config.py::CacheConfig.kv_layout",
        ))

The declaration is documentation the CLI and the conformance suite read; each plugin still
validates its hints itself (and raises :class:`kvcore.DetectionError` for a bad value).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcore.errors import PluginError

__all__ = ["Hint", "tensor_order_hint"]


class Hint(BaseModel):
    """One hint an engine's detector reads.

    Attributes:
        engine: the engine name the hint applies to (as passed to :func:`kvcore.detect`).
        name: the key in the ``hints`` dict.
        meaning: what it tells the detector, in the engine's terms (one or two sentences).
        values: the accepted values when they are a closed set (e.g. ``["NHD", "HND"]``).
        type: what an open value is: ``"int > 0"``, ``"bool"``, ``"version string"``,
            ``"torch.dtype or name"``, ... (default ``"str"``).
        aliases: other keys accepted for the same hint (e.g. ``tokens_per_block``).
        default: what the detector assumes when the hint is absent ("" = nothing: the
            tensors decide, or detection says the hint is needed).
        source: where the engine defines the fact (``file::symbol``), if anywhere.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str = Field(min_length=1)
    name: str = Field(min_length=1)
    meaning: str = Field(min_length=1)
    values: list[str] = Field(default_factory=list)
    type: str = "str"
    aliases: list[str] = Field(default_factory=list)
    default: str = ""
    source: str = ""

    def __init__(self, **data) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise PluginError(f"invalid kvcore.Hint {data.get('name', '(no name)')!r}: {e}") from None

    @field_validator("values", "aliases", mode="before")
    @classmethod
    def _strings(cls, v):
        if v is None:
            return []
        return [str(x) for x in v]

    def accepted(self) -> str:
        """The accepted values as one line: the closed set, else the type."""
        return ", ".join(self.values) if self.values else self.type


def tensor_order_hint(engine: str) -> Hint:
    """The declaration of kvcore's generic ``tensor_order`` hint (:data:`kvcore.TENSOR_ORDER`),
    which every engine accepts, for a plugin's ``kvcore_register_hints``."""
    return Hint(
        engine=engine,
        name="tensor_order",
        meaning="how the tensors' axes relate to memory: 'allocated' (as the engine allocated them; permuted strides show "
        "the memory order) or 'physical' (the caller permuted them into memory order). A contiguous tensor can be either, "
        "and when the two readings differ (NHD/HND twins) this hint decides",
        values=["allocated", "physical"],
        default="either: where the readings differ, detection raises AmbiguousLayoutError naming this hint",
        source="kvcore.detection (docs/plugins.md, 'Tensor order')",
    )
