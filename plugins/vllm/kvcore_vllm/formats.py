"""Every format the vLLM plugin registers, derived from the rule table.

One physical layout is one name across versions and backends: the name is the layout's
physical axis order (:func:`kvcore_vllm.rules.physical_name`), so FlashInfer <= 0.23 and
FlashAttention 0.24 both register ``NL_X_NB_TWO_BS_NH_HS``, with both backends and both
sources listed. Sources are vLLM files and functions per release (``SOURCES.md``).
"""

from __future__ import annotations

from functools import lru_cache

from kvcore import KVFormat, Source
from kvcore_vllm.rules import RULES, physical_name

__all__ = ["vllm_formats"]


@lru_cache(maxsize=1)
def vllm_formats() -> tuple[KVFormat, ...]:
    """The :class:`kvcore.KVFormat` of every layout a rule in :data:`kvcore_vllm.rules.RULES` produces."""
    acc: dict[str, dict] = {}
    for rule in RULES:
        eras = f"{rule.eras[0]}" if len(rule.eras) == 1 else f"{rule.eras[0]}-{rule.eras[-1]}"
        for key, order in rule.layouts.items():
            name = physical_name(order)
            d = acc.setdefault(name, {"backends": [], "desc": [], "sources": []})
            for b in rule.backends_label or rule.families:
                if b not in d["backends"]:
                    d["backends"].append(b)
            line = f"{rule.label} [{key}] (vLLM {eras})"
            if line not in d["desc"]:
                d["desc"].append(line)
            for s in rule.sources:
                if s not in d["sources"]:
                    d["sources"].append(s)
    from kvcore_vllm.pairs import pairs_formats  # per-layer (K, V) pairs: no per-layer-tensor rule describes them
    from kvcore_vllm.rbln import rbln_format  # vllm-rbln's 6-D caches: no vLLM backend rule has that rank

    out = list(pairs_formats()) + [rbln_format()]
    for name, d in acc.items():
        out.append(
            KVFormat(
                name=name,
                engines=["vllm"],
                attention_backends=d["backends"],
                description="; ".join(d["desc"]),
                sources=[Source(engine=s.engine, version=s.version, file=s.file) for s in d["sources"]],
            )
        )
    return tuple(out)
