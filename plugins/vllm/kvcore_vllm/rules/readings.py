"""Rules -> readings: every :class:`kvcore.Candidate` a rule allows for per-layer tensors
(:func:`candidates`) or one whole cross-layer tensor (:func:`bare_candidates`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore import Candidate, GeometryError, build_layout
from kvcore.grammar import parse
from kvcore_vllm.hints import BACKEND_FAMILY, KV_CACHE_LAYOUTS, LAYOUT_ALIASES, VllmHints
from kvcore_vllm.rules.cpu import _neon_bf16
from kvcore_vllm.rules.head_slots import _slot_heads
from kvcore_vllm.rules.match import _rule_ok, _sizes, _sizes_ok
from kvcore_vllm.rules.mla import _aiter_pages
from kvcore_vllm.rules.paged import _missing_hints, flat_misfit
from kvcore_vllm.rules.platform import platform_cpu, platform_rocm
from kvcore_vllm.rules.rule import Rule, physical_name
from kvcore_vllm.rules.steering import _rule_families, layout_families
from kvcore_vllm.rules.table import PLANE_BUILDERS, RULES, TRANSFORMS
from kvcore_vllm.rules.views import _element_dtype, _element_view, _layers_separate, _ordered, stack_layers
from kvcore_vllm.specs import BLOCKED_SCALE_RECORDS


@dataclass
class Reading:
    """A candidate with what detection needs to explain it."""

    candidate: Candidate
    rule: Rule
    layout: str
    as_given: bool = False  # the view keeps the tensor's own axis order (tie-break between identical readings)
    families: tuple[str, ...] = ()  # the rule's families that allocate this layout under the hints (default: all)

    def __post_init__(self) -> None:
        if not self.families:
            self.families = self.rule.families


def backends_label(rule: Rule, families: Sequence[str]) -> str:
    """The backend names of ``rule`` that belong to ``families`` (for ``decided_by``)."""
    if tuple(families) == rule.families or not families:
        return "/".join(rule.backends_label or rule.families)
    names = [b for b in rule.backends_label if BACKEND_FAMILY.get(b) in families]
    return "/".join(names or families)


def _reading(
    rule: Rule,
    key: str,
    views: list[torch.Tensor],
    tokens: tuple[str, ...],
    h: VllmHints,
    note: str,
    kernel_split: bool = False,
    rocm: bool | None = None,
    families: tuple[str, ...] = (),
    rejected: list[str] | None = None,
) -> Reading | None:
    """Views in ``rule.logical`` (or a physical) token order -> a candidate for layout ``key``.

    The candidate's ``order`` (see :mod:`kvcore.detection`): ``"physical"`` for a tensor read
    as already in memory order (``tokens`` is the layout's physical order, not the rule's
    logical one), ``"allocated"`` when the views permute the tensor's axes (its strides
    show the engine's permuted allocation), else None (the tensor's own axes, in memory
    order: it reads so whichever way it was handed over).
    """
    order = rule.layouts[key]
    t0 = views[0]
    sz = _sizes(tokens, t0)
    if sz is None:
        return None
    dtype, esz = _element_dtype(t0, h, rule)
    if not _sizes_ok(rule, sz, t0, esz, h, kernel_split, rocm):
        return None
    if kernel_split and "BS" in sz and sz["BS"] != h.block_size:
        note += f" (block_size {h.block_size} is the manager's: the kernel reads blocks of {sz['BS']} tokens)"
    decided = {"vllm_version": "/".join(rule.eras), "attention_backend": backends_label(rule, families)}
    if key not in ("*", "*/mamba"):
        decided["kv_cache_layout"] = key.replace("/cross", " (cross-layer)").replace("/mamba", " (beside Mamba layers)")
    if rule.planes:
        kv = _planes(rule, order, views, tokens, h)
        if kv is None:
            return None
        return Reading(_candidate(rule, key, order, kv, dtype, decided, note), rule, key, True, families)
    as_given = False
    if order[0] == "NL":
        perm = [tokens.index(tok) for tok in _fmt_tokens(order[1:])]
        as_given = perm == sorted(perm) and not rule.transform
        pv = [v.permute(perm) for v in views]
        if not all(_ordered(v) for v in pv):
            return None
        if not _layers_separate(pv):
            # interleaved layers are a cross-layer buffer (its own reading); layers whose bytes overlap are no
            # vLLM cache at all: keep build_layout's explanation for the error detection raises
            if rejected is not None:
                try:
                    build_layout(
                        physical_name(order),
                        pv,
                        dtype=dtype,
                        params={"scale_bytes": BLOCKED_SCALE_RECORDS[sz["HS"]]} if rule.blocked else {},
                    )
                except GeometryError as e:
                    why = f"{rule.label}, layout {key}{note}: {e}"
                    if why not in rejected:
                        rejected.append(why)
            return None
        kv = pv
        identity = perm == sorted(perm)
    else:
        stacked = stack_layers(views)
        if stacked is None:
            return None
        full = ("NL",) + tokens
        perm = [full.index(tok) for tok in _fmt_tokens(order)]
        kv = stacked.permute(perm)
        if not _ordered(kv):
            return None
        # per-layer views of one cross-layer buffer: each layer read in its own axis order holds either way
        inner = [i for i in perm if i != 0]
        identity = inner == sorted(inner)
    physical = tokens != rule.logical
    fmt = physical_name(order)
    params = {"scale_bytes": BLOCKED_SCALE_RECORDS[sz["HS"]]} if rule.blocked else {}
    order_of = "physical" if physical else (None if identity else "allocated")
    cand = _candidate(rule, key, fmt, kv, dtype, decided, note, params=params, order=order_of)
    return Reading(cand, rule, key, as_given, families)


def _candidate(
    rule: Rule, key: str, fmt: str, kv: Any, dtype: torch.dtype | None, decided: dict[str, str], note: str, **extra: Any
) -> Candidate:
    """The candidate of one reading of ``rule`` under layout ``key`` (ROCm-only rules also say
    ``device_type`` decided it)."""
    if rule.gate in ("rocm", "rocm?"):
        decided["device_type"] = "rocm"
    return Candidate(
        format=fmt,
        kv_caches=kv,
        dtype=dtype,
        note=f"vLLM {rule.label}, layout {key}{note}",
        decided_by=decided,
        label=f"{rule.label}, {key}{note}",
        **extra,
    )


def _planes(rule: Rule, name: str, views: list[torch.Tensor], tokens: tuple[str, ...], h: VllmHints) -> dict[str, Any] | None:
    """One layer view per entry (in ``tokens`` order) -> ``{role: container}`` for the
    multi-plane ``name``: a list of per-layer plane views, or, where the name's template
    has ``NL`` inside (0.29+ block-outermost layouts), one view of all layers per plane."""
    per = [PLANE_BUILDERS[rule.planes](v, tokens, h) for v in views]
    if any(p is None for p in per):
        return None
    syntax = parse(name)
    out: dict[str, Any] = {}
    for role in syntax.roles:
        ps = [p[role] for p in per]
        axes = syntax.plane(role).syntax.axes
        if "NL" in axes:
            stacked = stack_layers(ps)
            if stacked is None:
                return None
            at = axes.index("NL")
            perm = list(range(1, at + 1)) + [0] + list(range(at + 1, stacked.dim()))
            x = stacked.permute(perm)
            if not _ordered(x):
                return None
            out[role] = x
        else:
            if not all(_ordered(x) for x in ps) or not _layers_separate(ps):
                return None
            out[role] = ps
    return out


def _fmt_tokens(order: Sequence[str]) -> tuple[str, ...]:
    # BSV_BSS is the element axis of a blocked-scale record; the view's token is HS
    out: list[str] = []
    for tok in order:
        if tok == "BSV":
            out.append("BS")
        elif tok == "BSS":
            out.append("HS")
        else:
            out.append(tok)
    return tuple(out)


def _key_families(
    rule: Rule, key: str, h: VllmHints, check_layout: bool, evidence: bool, layout_source: str
) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """The families of ``rule`` that may allocate layout ``key`` and the hint against it
    (:func:`layout_families`; the hints ignored without ``check_layout``), or None when the
    layout is out: ruled out by a hint, unless ``evidence`` keeps it marked ``against``."""
    fams, against = layout_families(rule, key, h, layout_source) if check_layout else (_rule_families(rule, key, h), {})
    if fams:
        return fams, against
    if not against or not evidence:
        return None
    return _rule_families(rule, key, h), against


def candidates(
    tensors: list[torch.Tensor],
    h: VllmHints,
    *,
    check_layout: bool = True,
    evidence: bool = False,
    layout_source: str = "kv_cache_layout",
    needs: list[str] | None = None,
    unclaimed: list[str] | None = None,
    rejected: list[str] | None = None,
) -> list[Reading]:
    """Every reading of ``tensors`` (one per layer, in layer order) that a rule allows.

    Each rule gives its as-allocated reading (the rule's logical axes, permuted into the
    layout's physical order by the tensors' strides) and, for rules whose layouts can be
    handed over already permuted into memory order (``physical_ok``), the reading of the
    tensors as that physical order (``order="physical"``): the core decides between them
    (:func:`kvcore.resolve`).

    Args:
        check_layout: drop the readings the ``kv_cache_layout`` hint (or XPU's forced NHD)
            rules out. With ``False`` the hint is ignored.
        evidence: keep those readings instead, marked ``against={hint: value}``: they are
            what the strides show when the hint contradicts them.
        layout_source: how the caller gave the layout (``kv_cache_layout``, or
            ``VLLM_KV_CACHE_LAYOUT`` when it came from the environment), for messages.
        needs: when given, rules whose transform cannot apply for want of a hint append
            ``"<rule label>: <hints>"`` here (vLLM 0.11 CPU's flat ``(2, NB, BS*NH*HS)``
            needs ``block_size`` and ``head_size`` or ``num_kv_heads``; the split reading of
            int8 byte views needs ``dtype``).
        unclaimed: when given, layouts these tensors may be that kvcore does not read
            (vLLM 0.33 ROCm's aiter MXFP4 indexer pages) are appended here.
        rejected: when given, readings whose shapes fit but whose memory cannot be a
            vLLM cache are appended here with the reason (per-layer views that overlap:
            :func:`kvcore.build_layout`'s own explanation), for the error detection raises
            when nothing fits.

    The platform comes from :func:`platform_rocm` and :func:`platform_cpu`.

    A ``block_size`` hint is first matched exactly; only when no reading has that block
    size is it read as the manager's block size split into kernel blocks (vLLM 0.13+:
    ``block_size // kernel_block_size`` kernel blocks per block).
    """
    opts = dict(
        check_layout=check_layout,
        evidence=evidence,
        layout_source=layout_source,
        needs=needs,
        unclaimed=unclaimed,
        rejected=rejected,
        rocm=platform_rocm(h, tensors),
        cpu=platform_cpu(h, tensors),
    )
    out = _candidates(tensors, h, False, **opts)
    if not [r for r in out if not r.candidate.against] and h.block_size is not None and h.era != "0.11":
        out = _candidates(tensors, h, True, **opts)
    return out


def _candidates(
    tensors: list[torch.Tensor],
    h: VllmHints,
    kernel_split: bool,
    *,
    check_layout: bool,
    evidence: bool,
    layout_source: str,
    needs: list[str] | None,
    unclaimed: list[str] | None = None,
    rejected: list[str] | None = None,
    rocm: bool | None = None,
    cpu: bool | None = None,
) -> list[Reading]:
    out: list[Reading] = []
    t0 = tensors[0]
    for rule in RULES:
        if t0.dim() != rule.rank or not _rule_ok(rule, h, rocm, cpu):
            continue
        keys = {}
        for key in rule.layouts:
            allowed = _key_families(rule, key, h, check_layout, evidence, layout_source)
            if allowed is not None:
                keys[key] = allowed
        if not keys:
            continue  # no layout of this rule is allowed: it needs no hint either
        # only readings the layout hints rule out: what they would need is beside the point
        rule_needs = None if all(a for _, a in keys.values()) else needs
        src = list(tensors)
        if rule.planes == "split_kv":
            src = [_element_view(t, h) for t in tensors]
            if any(t is None for t in src):
                if rule_needs is not None:
                    rule_needs.append(f"{rule.label}: needs dtype (an int8 byte view: V's tokens are one element apart)")
                continue
        if rule.transform:
            fn = TRANSFORMS[rule.transform]
            views = [fn(t, h) for t in src]
            if any(v is None for v in views):
                missing = _missing_hints(rule, t0, h)
                if rule_needs is not None and missing:
                    rule_needs.append(f"{rule.label}: needs {' and '.join(missing)}")
                misfit = flat_misfit(t0.shape[2], h) if rule.transform in ("paged", "paged_ipex") and t0.shape[0] == 2 else None
                if misfit and rejected is not None and not all(a for _, a in keys.values()):
                    why = f"{rule.label}: {misfit}"
                    if why not in rejected:
                        rejected.append(why)
                continue
        else:
            views = src
        other = _aiter_pages(rule, views[0], h, rocm) or _neon_bf16(rule, views[0], h)
        if other is not None and unclaimed is not None and other not in unclaimed:
            unclaimed.append(other)
        for key, (fams, against) in keys.items():
            found = []
            why = rejected if not against else None  # a reading a hint rules out explains nothing
            r = _reading(rule, key, views, rule.logical, h, "", kernel_split, rocm, fams, why)
            if r is not None:
                found.append(r)
            # the tensor already permuted to this layout's physical order
            order = rule.layouts[key]
            phys = () if rule.planes else tuple(tok for tok in _fmt_tokens(order) if tok != "NL")
            # vLLM 0.29+ reads the compat names NHD / HND as LBNHC / LBHNC exactly (config/cache.py::
            # _LAYOUT_COMPAT_ALIASES): a twin of another member is not what such a hint names
            named = h.kv_cache_layout or h.env_kv_cache_layout
            alias_only = check_layout and named in LAYOUT_ALIASES and key in KV_CACHE_LAYOUTS and key != LAYOUT_ALIASES[named]
            if rule.physical_ok and not rule.planes and "/" not in key and order[0] == "NL" and phys != rule.logical and not alias_only:
                r = _reading(rule, key, views, phys, h, " (tensor already in memory order)", kernel_split, rocm, fams, why)
                if r is not None:
                    found.append(r)
            for r in found:
                r.candidate.against = dict(against)
            out.extend(found)
    # among readings that turn out byte-identical, the first wins: prefer the tensor's own axis order
    out.sort(key=lambda r: not r.as_given)
    return out


def _bare_view(rule: Rule, order: Sequence[str], t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    """One whole cross-layer tensor ``t`` as the axes of ``order`` (a view, never a copy), or
    None. A rule without a transform takes the tensor as it is; a head-slot rule (0.30+ B12X
    BLHNC) also takes vLLM's ``[NB, NL, 2, BS, NH*HS]`` (the slot's row split into heads as
    :func:`_t_head_slots_nhd` does) beside the split form ``[NB, NL, 2, BS, NH, HS]``."""
    if not rule.transform:
        return t if len(order) == t.dim() else None
    if rule.transform != "head_slots_nhd" or tuple(order[-2:]) != ("NH", "HS"):
        return None
    if t.dim() == len(order):
        return t
    if t.dim() != len(order) - 1 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    c = t.shape[-1]
    nh = _slot_heads(t, c, h)
    return None if nh is None else t.unflatten(-1, (nh, c // nh))


#: The most layers a single tensor is read as (a whole cross-layer buffer, its layer axis one
#: of the tensor's axes). No model vLLM serves has near this many attention layers per
#: pipeline stage (DeepSeek-V3 61, Llama-3.1-405B 126); kvcore's layout holds a row per
#: layer, so a reading whose layer count is an axis of millions of blocks would cost time
#: and memory in proportion to that axis. Such readings are not offered: detection says why
#: when nothing else fits (pass the per-layer tensors as a list instead).
MAX_BARE_LAYERS = 1024


def bare_candidates(
    t: torch.Tensor,
    h: VllmHints,
    *,
    check_layout: bool = True,
    evidence: bool = False,
    layout_source: str = "kv_cache_layout",
    rejected: list[str] | None = None,
) -> list[Reading]:
    """Readings of one tensor that is a whole cross-layer cache, as a cross-layer connector
    is handed it: the buffer vLLM allocates in the layout's physical order before it takes
    per-layer views (0.13-0.2x ``allocate_uniform_kv_caches``: e.g. ``[NB, NL, 2, BS, NH, HS]``
    for FlashAttention NHD; 0.26 - 0.28 ``[NB, NL, BS, NH, 2*HS]``; 0.29+ ``BLHNC`` / ``BLNHC`` /
    ``BHLNC``). The tensor must be in memory order; its axes are then the format's.

    A reading with more than :data:`MAX_BARE_LAYERS` layers is not offered; with
    ``rejected`` given, it is listed there with the reason. Nothing here is proportional
    to a tensor axis: every candidate is the tensor itself."""
    out: list[Reading] = []
    if not _ordered(t):
        return out
    rocm, cpu = platform_rocm(h, [t]), platform_cpu(h, [t])
    for rule in RULES:
        if rule.planes or not _rule_ok(rule, h, rocm, cpu):
            continue
        for key, order in rule.layouts.items():
            if order[0] == "NL":
                continue
            x = _bare_view(rule, order, t, h)
            if x is None:
                continue
            allowed = _key_families(rule, key, h, check_layout, evidence, layout_source)
            if allowed is None:
                continue
            fams, against = allowed
            tokens = _fmt_tokens(order)
            sz = _sizes(tokens, x)
            if sz is None:
                continue
            dtype, esz = _element_dtype(x, h, rule)
            if not _sizes_ok(rule, sz, x, esz, h, rocm=rocm):
                continue
            if sz["NL"] > MAX_BARE_LAYERS:
                if rejected is not None and not against:
                    why = (
                        f"{rule.label}, {key}, one cross-layer tensor: its layer axis would hold {sz['NL']} layers, more than "
                        f"the {MAX_BARE_LAYERS} kvcore-vllm reads in one tensor (no vLLM model has that many; pass the "
                        "per-layer tensors as a list)"
                    )
                    if why not in rejected:
                        rejected.append(why)
                continue
            decided = {"vllm_version": "/".join(rule.eras), "attention_backend": backends_label(rule, fams)}
            decided["kv_cache_layout"] = key.replace("/cross", " (cross-layer)")
            params = {"scale_bytes": BLOCKED_SCALE_RECORDS[sz["HS"]]} if rule.blocked else {}
            cand = Candidate(
                format=physical_name(order),
                kv_caches=x,
                dtype=dtype,
                params=params,
                note=f"vLLM {rule.label}, layout {key}: the whole cross-layer buffer",
                decided_by=decided,
                label=f"{rule.label}, {key}, one cross-layer tensor",
                against=against,
            )
            out.append(Reading(cand, rule, key, True, fams))
    return out
