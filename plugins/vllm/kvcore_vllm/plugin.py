"""Entry point of the kvcore-vllm plugin (group ``kvcore``, name ``vllm``).

Hooks: formats (:mod:`kvcore_vllm.formats`), detection for engine ``"vllm"``
(:mod:`kvcore_vllm.detect`), hints, allocation fixtures (:mod:`kvcore_vllm.fixtures`) and
the ``vllm`` demo. No ``kvcore_spec``: every vLLM layout is a name kvcore's generic spec
reads (K and V of different orders are multi-plane names; the blocked-scale records take
their scale width from :data:`kvcore_vllm.specs.BLOCKED_SCALE_RECORDS`).
"""

from __future__ import annotations

from kvcore import hookimpl

ENGINE = "vllm"


@hookimpl
def kvcore_register_formats(register):
    from kvcore_vllm.formats import vllm_formats

    for f in vllm_formats():
        register(f)


@hookimpl
def kvcore_detect(kv_caches, engine, hints):
    if engine != ENGINE:
        return None
    from kvcore_vllm.detect import detect_vllm

    return detect_vllm(kv_caches, hints)


@hookimpl
def kvcore_register_hints(register):
    from kvcore_vllm.hints import declared_hints

    for h in declared_hints():
        register(h)


@hookimpl
def kvcore_register_fixtures(register):
    from kvcore_vllm.fixtures import fixture_cases
    from kvcore_vllm.pairs import pairs_fixtures

    for case in fixture_cases():
        register(case)
    for case in pairs_fixtures():
        register(case)
    from kvcore_vllm.rbln import rbln_fixture

    register(rbln_fixture())


@hookimpl
def kvcore_register_demos(register):
    register(
        "vllm",
        lambda argv: __import__("kvcore_vllm.demo", fromlist=["run"]).run(argv),
        "allocate vLLM-shaped caches (Llama-3-8B FlashAttention NHD/HND, DeepSeek-V3 MLA), detect, offload and reload",
    )
