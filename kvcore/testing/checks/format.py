"""Format-level checks, one per format a plugin registers.

* ``grammar``: the name parses and renders, its derived facts agree with its declared labels,
  it cites a source file and names an engine.
* ``fixtures_exist``: the registering plugin supplies at least one fixture for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.grammar import parse, render_symbolic
from kvcore.testing.results import CheckFailure


def check_grammar(fmt) -> str:
    syn = parse(fmt.name)
    if syn.name != fmt.name:
        raise CheckFailure(f"parse({fmt.name!r}).name is {syn.name!r}")
    sym = render_symbolic(syn)
    for role, ps in [(p.role, p.syntax) for p in syn.planes] or [(None, syn)]:
        psym = render_symbolic(ps)
        n_axes = psym.split("[", 1)[1].rstrip("]").count(",") + 1
        if n_axes != len(ps.axes) or psym.count(" x ") != len(ps.list_levels):
            raise CheckFailure(
                f"{fmt.name} renders as {sym!r}, which does not show its {len(ps.axes)} axes and {len(ps.list_levels)} list levels"
                + (f" (plane {role})" if role else "")
            )
        if role is not None and f"{role}: {psym}" not in sym:
            raise CheckFailure(f"{fmt.name} renders as {sym!r}, which does not show plane {role} as {role}: {psym}")
    facts = {
        "kv_size": (fmt.kv_size, syn.kv_size),
        "is_mla": (fmt.is_mla, syn.is_mla),
        "container": (fmt.container, syn.container),
        "is_hnd": (fmt.is_hnd, syn.is_hnd),
        "fused_kv": (fmt.fused_kv, syn.fused_kv),
        "fused_nbbs": (fmt.fused_nbbs, syn.fused_nbbs),
    }
    bad = {k: v for k, v in facts.items() if v[0] != v[1]}
    if bad:
        raise CheckFailure(f"{fmt.name}: declared facts disagree with the name: {bad}")
    text = " ".join([fmt.description, *fmt.attention_backends]).upper()
    if syn.has("NH") and syn.has("BS") and not syn.fused_kv:
        other = "NHD" if syn.is_hnd else "HND"
        if f" {other}" in f" {text}" and ("HND" if syn.is_hnd else "NHD") not in text:
            raise CheckFailure(
                f"{fmt.name} is {'HND' if syn.is_hnd else 'NHD'} by its name but its description says {other}: {fmt.description!r}"
            )
    if not fmt.sources or not any(s.file for s in fmt.sources):
        raise CheckFailure(f"{fmt.name} cites no source file: register it with sources=[Source(engine, version, file)]")
    if not fmt.engines:
        raise CheckFailure(f"{fmt.name} names no engine (KVFormat.engines)")
    return sym


def check_fixtures_exist(plugin: str, fmt_name: str, fixture_names: Sequence[str]) -> str:
    if not fixture_names:
        raise CheckFailure(
            f"{fmt_name} is registered but {plugin} supplies no FixtureCase for it (kvcore_register_fixtures); "
            "an untested format is not supported"
        )
    return f"{len(fixture_names)} fixture(s)"
