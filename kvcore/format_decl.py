"""``KVFormat``: a layout declaration, validated by pydantic.

A plugin declares a layout with its name (the shape template, see
:mod:`kvcore.grammar`) and a few labels; every structural fact is derived from the
name, so it is stated once.

Example::

    KVFormat(
        name="NL_X_TWO_NB_BS_NH_HS",
        engines=["vllm"],
        attention_backends=["FLASH_ATTN"],
        description="vLLM <= 0.23 FlashAttention, NHD",
        sources=[Source(engine="vllm", version="0.11.0",
                        file="vllm/v1/attention/backends/flash_attn.py::FlashAttentionBackend.get_kv_cache_shape")],
    )
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, field_validator

from kvcore.errors import FormatError
from kvcore.grammar import Syntax, parse, render_concrete, render_symbolic

__all__ = ["Source", "KVFormat"]


class Source(BaseModel):
    """Where an engine fact comes from: engine, version and file (``file::function``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str
    version: str = ""
    file: str = ""

    def __str__(self) -> str:
        v = f" {self.version}" if self.version else ""
        f = f" {self.file}" if self.file else ""
        return f"{self.engine}{v}{f}"


class KVFormat(BaseModel):
    """A KV cache layout: its name is its shape template.

    Attributes:
        name: the shape template, e.g. ``NL_X_TWO_NB_BS_NH_HS``.
        engines: engines that allocate this layout (labels, for listings).
        attention_backends: the engines' backend names that use it (labels).
        description: one line for ``kvcore formats``.
        sources: where the layout fact comes from (engine, version, file).
    Derived (read-only): kv_size, is_mla, container, is_hnd, fused_kv, fused_nbbs,
    two_major, symbolic.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    engines: list[str] = Field(default_factory=list)
    attention_backends: list[str] = Field(default_factory=list)
    description: str = ""
    sources: list[Source] = Field(default_factory=list)

    def __init__(self, **data) -> None:
        # a malformed name raises kvcore's FormatError (naming the bad token), not
        # pydantic's ValidationError; model_validate() still reports it as a ValidationError
        if "name" in data:
            parse(data["name"])
        try:
            super().__init__(**data)
        except ValidationError as e:  # a missing name, a misspelt field, a wrong type
            raise FormatError(f"invalid KVFormat {data.get('name', '(no name)')!r}: {e}") from e

    @field_validator("name")
    @classmethod
    def _parse_name(cls, v: str) -> str:
        try:
            parse(v)
        except FormatError as e:
            # pydantic wraps ValueErrors; re-raise ours unwrapped by the caller
            raise ValueError(str(e)) from None
        return v

    @property
    def syntax(self) -> Syntax:
        return parse(self.name)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kv_size(self) -> int:
        return self.syntax.kv_size

    @computed_field  # type: ignore[prop-decorator]
    @property
    def is_mla(self) -> bool:
        return self.syntax.is_mla

    @computed_field  # type: ignore[prop-decorator]
    @property
    def container(self) -> str:
        return self.syntax.container

    @computed_field  # type: ignore[prop-decorator]
    @property
    def is_hnd(self) -> bool:
        return self.syntax.is_hnd

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fused_kv(self) -> bool:
        return self.syntax.fused_kv

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fused_nbbs(self) -> bool:
        return self.syntax.fused_nbbs

    @computed_field  # type: ignore[prop-decorator]
    @property
    def two_major(self) -> bool:
        return self.syntax.two_major

    @computed_field  # type: ignore[prop-decorator]
    @property
    def symbolic(self) -> str:
        return render_symbolic(self.syntax)

    def concrete(self, sizes: dict[str, int]) -> str:
        return render_concrete(self.syntax, sizes)

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        # frozen, but its label lists are not hashable: a format is identified by its name
        return hash(self.name)


def make_format(**kwargs) -> KVFormat:
    """Build a KVFormat, raising :class:`FormatError` (not pydantic's ValidationError) for a bad name."""
    name = kwargs.get("name")
    parse(name)  # raises FormatError with the precise message
    return KVFormat(**kwargs)
