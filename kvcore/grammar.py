"""The layout grammar: a format's name *is* its shape template.

``NL_X_TWO_NB_BS_NH_HS`` means "a list of NL tensors, each ``[2, NB, BS, NH, HS]``".
``_`` separates the axes of one tensor, ``_X_`` opens a list level. The tokens:

========  =================================================================
token     meaning
========  =================================================================
NL        layers
NB        blocks (pages)
BS        block size: tokens per block
NBBS      blocks and tokens fused in one axis (page buffer size, rendered PBS)
NH        KV heads (per tensor-parallel rank)
HS        head size (elements)
CS        K and V packed in one axis, K first (CS = HS_k + HS_v)
TWO       a literal axis of size 2: K then V
ONE       a literal axis of size 1
NP        planes of a per-layer tuple (MLA latent / rope / indexer planes)
BSV, BSS  blocked-scale records: a block's values, then its scales
========  =================================================================

The token vocabulary is LMCache's ``EngineKVFormat`` naming
(``csrc/engine_kv_format.h``), so every name in that enum parses here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from kvcore.errors import FormatError

__all__ = ["Role", "TOKENS", "Syntax", "parse", "render_symbolic", "render_concrete"]


class Role(str, Enum):
    """What an axis addresses."""

    LAYER = "layer"
    BLOCK = "block"
    TOKEN = "token"
    SLOT = "slot"  # fused NB*BS
    HEAD = "head"
    ELEMENT = "element"
    PACKED_KV = "packed_kv"  # CS: K|V in the element axis
    KV = "kv"
    SINGLETON = "singleton"
    PLANE = "plane"
    SCALE_VALUES = "scale_values"
    SCALE_SCALES = "scale_scales"


@dataclass(frozen=True)
class _Token:
    role: Role
    label: str  # symbolic rendering
    literal: int | None = None


TOKENS: dict[str, _Token] = {
    "NL": _Token(Role.LAYER, "NL"),
    "NB": _Token(Role.BLOCK, "NB"),
    "BS": _Token(Role.TOKEN, "BS"),
    "NBBS": _Token(Role.SLOT, "PBS"),
    "NH": _Token(Role.HEAD, "NH"),
    "HS": _Token(Role.ELEMENT, "HS"),
    "CS": _Token(Role.PACKED_KV, "CS"),
    "TWO": _Token(Role.KV, "2", 2),
    "ONE": _Token(Role.SINGLETON, "1", 1),
    "NP": _Token(Role.PLANE, "NP"),
    "BSV": _Token(Role.SCALE_VALUES, "BSxVALS"),
    "BSS": _Token(Role.SCALE_SCALES, "BSxSCALES"),
}

_CONTAINERS = {
    (): "cross_layer",
    ("NL",): "layer_list",
    ("TWO", "NL"): "kv_list",
    ("NL", "TWO"): "per_layer_tuple",
    ("NL", "NP"): "per_layer_tuple",
}


@dataclass(frozen=True)
class Syntax:
    """A parsed format name.

    Attributes:
        name: the format name, e.g. ``"NL_X_TWO_NB_BS_NH_HS"``.
        list_levels: tokens of the list levels, outermost first (``("NL",)``).
        axes: tokens of the tensor axes, outermost first.
    """

    name: str
    list_levels: tuple[str, ...]
    axes: tuple[str, ...]

    # -- derived facts -------------------------------------------------------------
    @property
    def tokens(self) -> tuple[str, ...]:
        return self.list_levels + self.axes

    def has(self, token: str) -> bool:
        return token in self.tokens

    def axis(self, token: str) -> int | None:
        """Position of ``token`` among the tensor axes, or None."""
        return self.axes.index(token) if token in self.axes else None

    @property
    def container(self) -> str:
        """``cross_layer`` (one bare tensor), ``layer_list``, ``kv_list`` or ``per_layer_tuple``."""
        return _CONTAINERS[self.list_levels]

    @property
    def kv_size(self) -> int:
        """2 when K and V are both stored (a TWO axis or packed CS), 1 for MLA / key-only."""
        return 2 if (self.has("TWO") or self.has("CS")) else 1

    @property
    def is_mla(self) -> bool:
        """One latent row per token: no K/V split and no head axis (a ``ONE`` axis at most):
        DeepSeek MLA latents, indexer caches, blocked-scale records, MLA plane tuples
        (LMCache ``FormatFacts::is_mla`` for #3, #5, #14, #17, ``lmcache_kv_format.md`` §1.3).
        A kv_size-1 format with heads (SGLang's independent components
        ``NL_X_NB_BS_NH_HS``, §1.2) is not MLA: its NH heads are real (§7.2: ``nh = 1 if
        is_mla`` is the bug this avoids)."""
        return self.kv_size == 1 and not self.has("NH")

    @property
    def fused_kv(self) -> bool:
        """K and V of one (token, head) packed in one contiguous row, K first: a ``CS``
        axis, or a ``TWO`` axis directly outside ``HS`` (``..._TWO_HS``).

        Source: LMCache ``csrc/engine_kv_format.h`` ``FormatFacts::is_fused_packed``, true
        for ``NL_X_NB_NH_BS_TWO_HS`` / ``NL_X_NB_BS_NH_TWO_HS`` (#10/#11) and the CS
        members #12/#13 (``../shared/reference/lmcache_kv_format.md`` §1.3).
        """
        if self.has("CS"):
            return True
        k, e = self.axis("TWO"), self.axis("HS")
        return k is not None and e is not None and e == k + 1 and e == len(self.axes) - 1

    @property
    def fused_nbbs(self) -> bool:
        return self.has("NBBS")

    @property
    def is_hnd(self) -> bool:
        """Heads outside tokens inside a block (``... NH ... BS ...``)."""
        h, t = self.axis("NH"), self.axis("BS")
        return h is not None and t is not None and h < t

    @property
    def two_major(self) -> bool:
        """The K/V axis sits outside the block axis (``TWO_NB``, or ``TWO_NBBS``)."""
        k, b = self.axis("TWO"), self.axis("NB") if self.has("NB") else self.axis("NBBS")
        return k is not None and b is not None and k < b

    @property
    def blocked_scale(self) -> bool:
        return self.has("BSV")

    def symbolic(self) -> str:
        return render_symbolic(self)

    def concrete(self, sizes: Mapping[str, int]) -> str:
        return render_concrete(self, sizes)


_ELEMENT_TOKENS = ("HS", "CS", "BSV")


def parse(name: str) -> Syntax:
    """Parse a format name.

    Raises:
        FormatError: naming the offending token, for an unknown token, a list level that
            is not a single token, a repeated axis, a format with no element axis
            (HS, CS or BSV), two K/V axes (TWO and CS, or TWO twice), NBBS together with
            NB or BS, BSV without BSS, or an unsupported list nesting.
    """
    if not isinstance(name, str) or not name:
        raise FormatError(f"a format name is a non-empty string like 'NL_X_TWO_NB_BS_NH_HS', got {name!r}")
    return _parse(name)


@lru_cache(maxsize=512)
def _parse(name: str) -> Syntax:
    parts = name.split("_")
    groups: list[list[str]] = [[]]
    for i, tok in enumerate(parts):
        if tok == "" and i == len(parts) - 1 and i > 0 and parts[i - 1] == "X":
            raise FormatError(f"format {name!r}: ends with a dangling '_X_'; the last group must name the tensor's axes")
        if tok == "":
            raise FormatError(f"format {name!r}: empty token {i} (a doubled, leading or trailing '_'); axes are separated by one '_'")
        if tok == "X":
            if not groups[-1]:
                raise FormatError(f"format {name!r}: '_X_' at token {i} has no axis before it")
            groups.append([])
            continue
        if tok not in TOKENS:
            known = ", ".join(TOKENS)
            raise FormatError(f"format {name!r}: unknown token {tok!r} (token {i}); known tokens are {known}, and X for a list level")
        groups[-1].append(tok)
    if not groups[-1]:
        raise FormatError(f"format {name!r}: ends with '_X_'; the last group must name the tensor's axes")
    *levels, axes = groups
    for g in levels:
        if len(g) != 1:
            raise FormatError(f"format {name!r}: list level {'_'.join(g)!r} must be a single token (NL, TWO or NP), as in 'NL_X_...'")
    list_levels = tuple(g[0] for g in levels)
    seen: dict[str, int] = {}
    for tok in list_levels + tuple(axes):
        if tok != "ONE" and tok in seen:
            raise FormatError(f"format {name!r}: axis {tok!r} is repeated; each axis may appear once")
        seen[tok] = 1
    if "TWO" in seen and "CS" in seen:
        raise FormatError(f"format {name!r}: two K/V axes (TWO and CS); K/V is either a TWO axis or packed in CS, not both")
    if "NBBS" in seen and ("NB" in seen or "BS" in seen):
        tok = "NB" if "NB" in seen else "BS"
        raise FormatError(f"format {name!r}: NBBS already fuses NB and BS, so {tok!r} cannot appear too")
    if ("BSV" in seen) != ("BSS" in seen):
        tok = "BSV" if "BSV" in seen else "BSS"
        raise FormatError(f"format {name!r}: {tok!r} needs its partner (BSV values then BSS scales)")
    if not any(t in seen for t in _ELEMENT_TOKENS):
        raise FormatError(f"format {name!r}: no element axis; the innermost content must be HS, CS or BSV_BSS")
    for lvl in list_levels:
        if lvl not in ("NL", "TWO", "NP"):
            raise FormatError(f"format {name!r}: {lvl!r} cannot be a list level; list levels are NL, TWO and NP")
    if list_levels not in _CONTAINERS:
        raise FormatError(
            f"format {name!r}: list nesting {'_X_'.join(list_levels)!r} is not supported; "
            "use NL_X_ (layer list), TWO_X_NL_X_ (K list, V list), NL_X_TWO_X_ / NL_X_NP_X_ (per-layer tuples), or none (one tensor)"
        )
    if "NB" in seen and "BS" not in seen and "BSV" not in seen:
        raise FormatError(f"format {name!r}: NB without BS; a paged format needs both (or NBBS)")
    if not any(t in seen for t in ("NB", "NBBS")):
        raise FormatError(f"format {name!r}: no block axis; a format addresses tokens through NB_BS or NBBS")
    return Syntax(name=name, list_levels=list_levels, axes=tuple(axes))


def render_symbolic(syntax: Syntax | str) -> str:
    """``NL_X_TWO_NB_BS_NH_HS`` → ``NL x [2, NB, BS, NH, HS]``."""
    s = parse(syntax) if isinstance(syntax, str) else syntax
    inner = "[" + ", ".join(TOKENS[t].label for t in s.axes) + "]"
    return " x ".join([TOKENS[t].label for t in s.list_levels] + [inner])


def _concrete_token(tok: str, sizes: Mapping[str, int]) -> str:
    t = TOKENS[tok]
    if t.literal is not None:
        return str(t.literal)
    key = {"NBBS": "PBS"}.get(tok, tok)
    if tok == "BSV":
        return f"{sizes['BS']}x{sizes['VALS']}" if "BS" in sizes and "VALS" in sizes else "BSxVALS"
    if tok == "BSS":
        return f"{sizes['BS']}x{sizes['SCALES']}" if "BS" in sizes and "SCALES" in sizes else "BSxSCALES"
    if key in sizes:
        return str(sizes[key])
    if tok in sizes:
        return str(sizes[tok])
    return t.label


def render_concrete(syntax: Syntax | str, sizes: Mapping[str, int]) -> str:
    """Substitute sizes: ``NL_X_TWO_NB_BS_NH_HS`` with NL=32, NB=2048, BS=16, NH=8, HS=128
    → ``32 x [2, 2048, 16, 8, 128]``. ``NBBS`` reads ``sizes["PBS"]``; a missing size keeps its label."""
    s = parse(syntax) if isinstance(syntax, str) else syntax
    inner = "[" + ", ".join(_concrete_token(t, sizes) for t in s.axes) + "]"
    return " x ".join([_concrete_token(t, sizes) for t in s.list_levels] + [inner])
