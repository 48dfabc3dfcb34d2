"""The layout grammar: a format's name *is* its shape template.

``NL_X_TWO_NB_BS_NH_HS`` means "a list of NL tensors, each ``[2, NB, BS, NH, HS]``".
``_`` separates the axes of one tensor, ``_X_`` opens a list level. The tokens:

========  =================================================================
token     meaning
========  =================================================================
NL        layers
NB        blocks (pages)
BS        block size: tokens per block
BSC, BSE  a block's tokens split in groups: BSC groups of BSE tokens (token =
          group * BSE + index), BSC outer; together they replace BS
NBBS      blocks and tokens fused in one axis (page buffer size, rendered PBS)
NH        KV heads (per tensor-parallel rank)
HS        head size (elements)
HSC, HSE  a head's elements split in chunks: HSC chunks of HSE elements (element =
          chunk * HSE + index), HSC outer; together they replace HS
CS        K and V packed in one axis, K first (CS = HS_k + HS_v)
TWO       a literal axis of size 2: K then V
ONE       a literal axis of size 1
NP        planes of a per-layer tuple (superseded by multi-plane names, below)
BSV, BSS  blocked-scale records: a block's values, then its scales
========  =================================================================

A **multi-plane** name ``ROLE=TEMPLATE(+ROLE=TEMPLATE)*`` describes a record whose parts
live in tensors of their own, each with its own strides, width and dtype, e.g. ROCm paged
attention's split K beside a token-innermost V: ``K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS``.
ROLE is ``K`` / ``V`` (key / value values; ``KV`` an MLA latent) or any other
``[A-Z][A-Z0-9]*`` name (conventions: ``KS``/``VS`` scales, ``KZ``/``VZ`` zeros,
``KSZ``/``VSZ`` (scale, zero) pairs). A TEMPLATE is a single-plane name without ``TWO``,
``CS``, ``NP`` and ``BSV``/``BSS`` (a plane is one of K or V, or a side plane); its element
axis may be omitted (one element per head). Multi-plane names replace ``NP``.

The token vocabulary is LMCache's ``EngineKVFormat`` naming
(``csrc/engine_kv_format.h``), so every name in that enum parses here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from kvcore.errors import FormatError

__all__ = ["Role", "TOKENS", "Syntax", "PlaneSyntax", "VALUE_ROLES", "parse", "render_symbolic", "render_concrete"]


class Role(str, Enum):
    """What an axis addresses."""

    LAYER = "layer"
    BLOCK = "block"
    TOKEN = "token"
    TOKEN_GROUP = "token_group"  # BSC: groups of a block's tokens
    TOKEN_IN_GROUP = "token_in_group"  # BSE: a token inside its group
    SLOT = "slot"  # fused NB*BS
    HEAD = "head"
    ELEMENT = "element"
    ELEMENT_CHUNK = "element_chunk"  # HSC: chunks of a head's elements
    ELEMENT_IN_CHUNK = "element_in_chunk"  # HSE: an element inside its chunk
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
    "BSC": _Token(Role.TOKEN_GROUP, "BSC"),
    "BSE": _Token(Role.TOKEN_IN_GROUP, "BSE"),
    "NBBS": _Token(Role.SLOT, "PBS"),
    "NH": _Token(Role.HEAD, "NH"),
    "HS": _Token(Role.ELEMENT, "HS"),
    "HSC": _Token(Role.ELEMENT_CHUNK, "HSC"),
    "HSE": _Token(Role.ELEMENT_IN_CHUNK, "HSE"),
    "CS": _Token(Role.PACKED_KV, "CS"),
    "TWO": _Token(Role.KV, "2", 2),
    "ONE": _Token(Role.SINGLETON, "1", 1),
    "NP": _Token(Role.PLANE, "NP"),
    "BSV": _Token(Role.SCALE_VALUES, "BSxVALS"),
    "BSS": _Token(Role.SCALE_SCALES, "BSxSCALES"),
}

#: plane roles that hold a record's values (K, V, or an MLA latent ``KV``); every other
#: role is a side plane (scales, zeros, ...).
VALUE_ROLES = ("K", "V", "KV")

_CONTAINERS = {
    (): "cross_layer",
    ("NL",): "layer_list",
    ("TWO", "NL"): "kv_list",
    ("NL", "TWO"): "per_layer_tuple",
    ("NL", "NP"): "per_layer_tuple",
}

_ROLE_RE = re.compile(r"[A-Z][A-Z0-9]*\Z")

# the element axis is one of these families (at most one per tensor)
_ELEMENT_FAMILIES = (("HS",), ("CS",), ("HSC", "HSE"), ("BSV", "BSS"))
# tokens a plane template may not hold, and why
_NOT_IN_PLANES = {
    "TWO": "a plane is one of K or V: name K and V as planes of their own (K=...+V=...)",
    "CS": "a plane is one of K or V: K|V packed in CS is a single-plane name",
    "NP": "multi-plane names replace NP: name each plane ROLE=TEMPLATE",
    "BSV": "blocked-scale records (BSV_BSS) are a single-plane name",
    "BSS": "blocked-scale records (BSV_BSS) are a single-plane name",
}


@dataclass(frozen=True)
class PlaneSyntax:
    """One plane of a multi-plane name: its role and its template (a :class:`Syntax`)."""

    role: str
    syntax: Syntax

    @property
    def template(self) -> str:
        return self.syntax.name


@dataclass(frozen=True)
class Syntax:
    """A parsed format name.

    Attributes:
        name: the format name, e.g. ``"NL_X_TWO_NB_BS_NH_HS"``.
        list_levels: tokens of the list levels, outermost first (``("NL",)``); empty for a
            multi-plane name (each plane has its own, see :attr:`planes`).
        axes: tokens of the tensor axes, outermost first; empty for a multi-plane name.
        planes: for a multi-plane name ``ROLE=TEMPLATE+...``, one :class:`PlaneSyntax` per
            plane in the name's order; empty for a single-plane name.
    """

    name: str
    list_levels: tuple[str, ...]
    axes: tuple[str, ...]
    planes: tuple[PlaneSyntax, ...] = ()

    # -- derived facts -------------------------------------------------------------
    @property
    def multi_plane(self) -> bool:
        """True for a ``ROLE=TEMPLATE(+ROLE=TEMPLATE)*`` name."""
        return bool(self.planes)

    @property
    def roles(self) -> tuple[str, ...]:
        """The plane roles in the name's order (multi-plane names), else ``()``."""
        return tuple(p.role for p in self.planes)

    def plane(self, role: str) -> PlaneSyntax:
        """The plane of ``role``. Raises FormatError naming the roles there are."""
        for p in self.planes:
            if p.role == role:
                return p
        raise FormatError(f"format {self.name!r} has no plane {role!r}; its planes are {', '.join(self.roles) or '(none: single-plane)'}")

    @property
    def tokens(self) -> tuple[str, ...]:
        """Every token of the name (for a multi-plane name: of every plane, once each)."""
        if self.planes:
            return tuple(dict.fromkeys(t for p in self.planes for t in p.syntax.tokens))
        return self.list_levels + self.axes

    def has(self, token: str) -> bool:
        return token in self.tokens

    def axis(self, token: str) -> int | None:
        """Position of ``token`` among the tensor axes, or None (always None for a
        multi-plane name: ask ``plane(role).syntax``)."""
        return self.axes.index(token) if token in self.axes else None

    @property
    def container(self) -> str:
        """``cross_layer`` (one bare tensor), ``layer_list``, ``kv_list`` or
        ``per_layer_tuple``; ``planes`` for a multi-plane name, whose containers are a
        dict ``{role: container}`` each nested as the plane's own (:attr:`containers`)."""
        if self.planes:
            return "planes"
        return _CONTAINERS[self.list_levels]

    @property
    def containers(self) -> dict[str, str]:
        """Multi-plane names: ``{role: that plane's container}``; single-plane: ``{}``."""
        return {p.role: p.syntax.container for p in self.planes}

    @property
    def kv_size(self) -> int:
        """2 when K and V are both stored (a TWO axis or packed CS; multi-plane: a ``K``
        and a ``V`` plane), 1 for MLA / key-only."""
        if self.planes:
            return 2 if ("K" in self.roles and "V" in self.roles) else 1
        return 2 if (self.has("TWO") or self.has("CS")) else 1

    @property
    def is_mla(self) -> bool:
        """One latent row per token: no K/V split and no head axis (a ``ONE`` axis at most):
        DeepSeek MLA latents, indexer caches, blocked-scale records, MLA plane tuples
        (LMCache ``FormatFacts::is_mla`` for #3, #5, #14, #17, ``lmcache_kv_format.md`` §1.3).
        A kv_size-1 format with heads (SGLang's independent components
        ``NL_X_NB_BS_NH_HS``, §1.2) is not MLA: its NH heads are real (§7.2: ``nh = 1 if
        is_mla`` is the bug this avoids). A multi-plane name is MLA when it has no K/V pair
        and no plane has a head axis."""
        return self.kv_size == 1 and not self.has("NH")

    @property
    def fused_kv(self) -> bool:
        """K and V of one (token, head) packed in one contiguous row, K first: a ``CS``
        axis, or a ``TWO`` axis directly outside ``HS`` (``..._TWO_HS``). Never for a
        multi-plane name (its K and V are planes of their own).

        Source: LMCache ``csrc/engine_kv_format.h`` ``FormatFacts::is_fused_packed``, true
        for ``NL_X_NB_NH_BS_TWO_HS`` / ``NL_X_NB_BS_NH_TWO_HS`` (#10/#11) and the CS
        members #12/#13 (LMCache 0.5.6).
        """
        if self.has("CS"):
            return True
        k, e = self.axis("TWO"), self.axis("HS")
        return k is not None and e is not None and e == k + 1 and e == len(self.axes) - 1

    @property
    def fused_nbbs(self) -> bool:
        """Blocks and tokens fused (NBBS); for a multi-plane name, in every plane (a plane
        with NB and BS gives the layout its blocks)."""
        if self.planes:
            return all(p.syntax.has("NBBS") for p in self.planes)
        return self.has("NBBS")

    @property
    def is_hnd(self) -> bool:
        """Heads outside tokens inside a block (``... NH ... BS ...``; with token groups,
        NH outside the outer of BSC/BSE). A multi-plane name is HND when every plane that
        has both a head and a token axis is."""
        if self.planes:
            both = [p.syntax for p in self.planes if p.syntax.has("NH") and p.syntax._token_axis() is not None]
            return bool(both) and all(s.is_hnd for s in both)
        h, t = self.axis("NH"), self._token_axis()
        return h is not None and t is not None and h < t

    def _token_axis(self) -> int | None:
        pos = [self.axis(t) for t in ("BS", "BSC", "BSE")]
        pos = [p for p in pos if p is not None]
        return min(pos) if pos else None

    @property
    def two_major(self) -> bool:
        """The K/V axis sits outside the block axis (``TWO_NB``, or ``TWO_NBBS``)."""
        k, b = self.axis("TWO"), self.axis("NB") if self.has("NB") else self.axis("NBBS")
        return k is not None and b is not None and k < b

    @property
    def blocked_scale(self) -> bool:
        return self.has("BSV")

    @property
    def chunked_heads(self) -> bool:
        """A head's elements are split in chunks (HSC/HSE) in some plane."""
        return self.has("HSC")

    @property
    def token_groups(self) -> bool:
        """A block's tokens are split in groups (BSC/BSE) in some plane."""
        return self.has("BSC")

    @property
    def element_token(self) -> str | None:
        """The element axis family of a single-plane name or template: ``"HS"``, ``"CS"``,
        ``"HSC"`` (chunked, with HSE), ``"BSV"`` (blocked-scale), or None (a plane template
        without an element axis: one element per head)."""
        for fam in _ELEMENT_FAMILIES:
            if fam[0] in self.tokens:
                return fam[0]
        return None

    def symbolic(self) -> str:
        return render_symbolic(self)

    def concrete(self, sizes: Mapping[str, int]) -> str:
        return render_concrete(self, sizes)


def parse(name: str) -> Syntax:
    """Parse a format name: a single-plane name (``NL_X_TWO_NB_BS_NH_HS``) or a
    multi-plane name ``ROLE=TEMPLATE(+ROLE=TEMPLATE)*``.

    Raises:
        FormatError: naming the offending token or plane, for an unknown token, a list
            level that is not a single token, a repeated axis, a format with no element
            axis (HS, CS, HSC_HSE or BSV_BSS; optional in a plane template) or two of them
            (HS and CS, HS and HSC, ...), HSC without HSE (or BSC without BSE), two K/V axes
            (TWO and CS, or TWO twice), NBBS together with NB, BS or BSC/BSE, BS together
            with BSC/BSE, BSV without BSS, or an unsupported list nesting; in a multi-plane
            name also a part without ``ROLE=``, a malformed or repeated role, an empty
            template, or a template holding TWO, CS, NP or BSV/BSS.
    """
    if not isinstance(name, str) or not name:
        raise FormatError(f"a format name is a non-empty string like 'NL_X_TWO_NB_BS_NH_HS', got {name!r}")
    return _parse(name)


@lru_cache(maxsize=512)
def _parse(name: str) -> Syntax:
    if "=" in name or "+" in name:
        return _parse_planes(name)
    return _parse_template(name, name, plane=False)


def _parse_planes(name: str) -> Syntax:
    parts = name.split("+")
    planes: list[PlaneSyntax] = []
    seen: dict[str, int] = {}
    for i, part in enumerate(parts, 1):
        if not part:
            raise FormatError(
                f"format {name!r}: plane {i} is empty (a doubled, leading or trailing '+'); planes are ROLE=TEMPLATE joined by one '+'"
            )
        if "=" not in part:
            raise FormatError(
                f"format {name!r}: plane {i} {part!r} has no 'ROLE='; a multi-plane name is ROLE=TEMPLATE(+ROLE=TEMPLATE)*, "
                "e.g. 'K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS'"
            )
        role, template = part.split("=", 1)
        if not _ROLE_RE.match(role):
            raise FormatError(
                f"format {name!r}: plane {i} role {role!r} is not a role; a role is K, V, or an upper-case name "
                "[A-Z][A-Z0-9]* (KS/VS scales, KZ/VZ zeros, KSZ/VSZ scale-zero pairs)"
            )
        if role in seen:
            raise FormatError(f"format {name!r}: role {role!r} names planes {seen[role]} and {i}; each plane has its own role")
        seen[role] = i
        if not template:
            raise FormatError(
                f"format {name!r}: plane {i} {role!r} has an empty template; write {role}=TEMPLATE, e.g. {role}=NL_X_NB_BS_NH_HS"
            )
        if "=" in template:
            raise FormatError(f"format {name!r}: plane {i} {part!r} has two '='; planes are joined by '+'")
        planes.append(PlaneSyntax(role=role, syntax=_parse_template(template, name, plane=True, where=f"plane {role!r}")))
    return Syntax(name=name, list_levels=(), axes=(), planes=tuple(planes))


def _parse_template(text: str, name: str, *, plane: bool, where: str = "") -> Syntax:
    """Parse one tensor template. ``name`` is the whole format name (for messages),
    ``plane`` relaxes the rules for a plane template (element axis optional; no TWO, CS,
    NP, BSV/BSS)."""
    at = f"format {name!r}" + (f", {where} {text!r}" if where else "")
    parts = text.split("_")
    groups: list[list[str]] = [[]]
    for i, tok in enumerate(parts):
        if tok == "" and i == len(parts) - 1 and i > 0 and parts[i - 1] == "X":
            raise FormatError(f"{at}: ends with a dangling '_X_'; the last group must name the tensor's axes")
        if tok == "":
            raise FormatError(f"{at}: empty token {i} (a doubled, leading or trailing '_'); axes are separated by one '_'")
        if tok == "X":
            if not groups[-1]:
                raise FormatError(f"{at}: '_X_' at token {i} has no axis before it")
            groups.append([])
            continue
        if tok not in TOKENS:
            known = ", ".join(TOKENS)
            raise FormatError(f"{at}: unknown token {tok!r} (token {i}); known tokens are {known}, and X for a list level")
        if plane and tok in _NOT_IN_PLANES:
            raise FormatError(f"{at}: {tok!r} cannot appear in a plane template; {_NOT_IN_PLANES[tok]}")
        groups[-1].append(tok)
    if not groups[-1]:
        raise FormatError(f"{at}: ends with '_X_'; the last group must name the tensor's axes")
    *levels, axes = groups
    for g in levels:
        if len(g) != 1:
            raise FormatError(f"{at}: list level {'_'.join(g)!r} must be a single token (NL, TWO or NP), as in 'NL_X_...'")
    list_levels = tuple(g[0] for g in levels)
    seen: dict[str, int] = {}
    for tok in list_levels + tuple(axes):
        if tok != "ONE" and tok in seen:
            raise FormatError(f"{at}: axis {tok!r} is repeated; each axis may appear once")
        seen[tok] = 1
    if "TWO" in seen and "CS" in seen:
        raise FormatError(f"{at}: two K/V axes (TWO and CS); K/V is either a TWO axis or packed in CS, not both")
    if "NBBS" in seen:
        for tok in ("NB", "BS", "BSC", "BSE"):
            if tok in seen:
                raise FormatError(f"{at}: NBBS already fuses NB and BS, so {tok!r} cannot appear too")
    for a, b, what in (
        ("HSC", "HSE", "a head's element chunks: HSC chunks of HSE elements"),
        ("BSC", "BSE", "a block's token groups: BSC groups of BSE tokens"),
    ):
        if (a in seen) != (b in seen):
            tok, other = (a, b) if a in seen else (b, a)
            raise FormatError(f"{at}: {tok!r} needs its partner {other!r} ({what})")
    if "BS" in seen and "BSC" in seen:
        raise FormatError(f"{at}: BS and BSC_BSE both name the block's tokens; use BS, or BSC and BSE (BS = BSC * BSE)")
    if ("BSV" in seen) != ("BSS" in seen):
        tok = "BSV" if "BSV" in seen else "BSS"
        raise FormatError(f"{at}: {tok!r} needs its partner (BSV values then BSS scales)")
    fams = [fam for fam in _ELEMENT_FAMILIES if any(t in seen for t in fam)]
    if len(fams) > 1:
        named = " and ".join("_".join(f) for f in fams)
        raise FormatError(
            f"{at}: two element axes ({named}); a tensor has one: HS (a head's elements), HSC_..._HSE (the same, in chunks), "
            "CS (K|V packed) or BSV_BSS (blocked-scale records)"
        )
    if not fams and not plane:
        raise FormatError(f"{at}: no element axis; the innermost content must be HS, HSC_HSE, CS or BSV_BSS")
    for lvl in list_levels:
        if lvl not in ("NL", "TWO", "NP"):
            raise FormatError(f"{at}: {lvl!r} cannot be a list level; list levels are NL, TWO and NP")
    if list_levels not in _CONTAINERS:
        raise FormatError(
            f"{at}: list nesting {'_X_'.join(list_levels)!r} is not supported; "
            "use NL_X_ (layer list), TWO_X_NL_X_ (K list, V list), NL_X_TWO_X_ / NL_X_NP_X_ (per-layer tuples), or none (one tensor)"
        )
    if "NB" in seen and "BS" not in seen and "BSC" not in seen and "BSV" not in seen:
        raise FormatError(f"{at}: NB without BS; a paged format needs both (or NBBS, or NB with BSC_BSE token groups)")
    if not any(t in seen for t in ("NB", "NBBS")):
        raise FormatError(f"{at}: no block axis; a format addresses tokens through NB_BS or NBBS")
    return Syntax(name=text, list_levels=list_levels, axes=tuple(axes))


def render_symbolic(syntax: Syntax | str) -> str:
    """``NL_X_TWO_NB_BS_NH_HS`` → ``NL x [2, NB, BS, NH, HS]``; a multi-plane name renders
    each plane as ``ROLE: ...`` joined by `` + ``
    (``K: NL x [NB, NH, HSC, BS, HSE] + V: NL x [NB, NH, HS, BS]``)."""
    s = parse(syntax) if isinstance(syntax, str) else syntax
    if s.planes:
        return " + ".join(f"{p.role}: {render_symbolic(p.syntax)}" for p in s.planes)
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


def plane_sizes(sizes: Mapping[str, object], role: str) -> dict[str, int]:
    """The sizes one plane renders with: the shared keys (``NL``, ``NB``...), overridden by
    ``"ROLE.TOKEN"`` keys (``"K.HS": 192``) and by a nested ``sizes[ROLE]`` dict."""
    out: dict[str, int] = {k: v for k, v in sizes.items() if "." not in k and isinstance(v, int)}
    nested = sizes.get(role)
    if isinstance(nested, Mapping):
        out.update(nested)
    pre = role + "."
    out.update({k[len(pre) :]: v for k, v in sizes.items() if k.startswith(pre) and isinstance(v, int)})
    return out


def render_concrete(syntax: Syntax | str, sizes: Mapping[str, int]) -> str:
    """Substitute sizes: ``NL_X_TWO_NB_BS_NH_HS`` with NL=32, NB=2048, BS=16, NH=8, HS=128
    → ``32 x [2, 2048, 16, 8, 128]``. ``NBBS`` reads ``sizes["PBS"]``; a missing size keeps
    its label. A multi-plane name renders each plane with :func:`plane_sizes` (shared keys,
    overridden per plane by ``"K.HS"``-style keys): ``K: 2 x [...] + V: 2 x [...]``."""
    s = parse(syntax) if isinstance(syntax, str) else syntax
    if s.planes:
        return " + ".join(f"{p.role}: {render_concrete(p.syntax, plane_sizes(sizes, p.role))}" for p in s.planes)
    inner = "[" + ", ".join(_concrete_token(t, sizes) for t in s.axes) + "]"
    return " x ".join([_concrete_token(t, sizes) for t in s.list_levels] + [inner])
