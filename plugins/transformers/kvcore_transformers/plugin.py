"""Entry point of the kvcore-transformers plugin (group ``kvcore``).

Nothing here imports transformers: the plugin loads with every ``import kvcore``.
"""

from __future__ import annotations

from kvcore import KVFormat, Source, hookimpl

from .caches import LAYER_PAIRS_FORMAT

ENGINE = "transformers"


def formats() -> list[KVFormat]:
    """The layouts this plugin registers.

    ``NB_NL_TWO_BS_NH_HS`` (the continuous-batching paged cache, one group) is *detected*
    but not registered here: the same physical layout is vLLM's cross-layer cache and
    kvcore-vllm registers that name (a name is a layout, and one plugin owns it).
    """
    return [
        KVFormat(
            name=LAYER_PAIRS_FORMAT,
            engines=[ENGINE],
            attention_backends=["DynamicCache", "StaticCache", "DynamicSlidingWindowLayer", "StaticSlidingWindowLayer"],
            description=(
                "transformers DynamicCache/StaticCache: per-layer (K, V) of [batch, NH, seq, HS]; "
                "block = batch row, block_size = seq (slot = b * seq + position)"
            ),
            sources=[
                Source(engine=ENGINE, version="5.24.0", file="src/transformers/cache_utils.py::DynamicLayer.update"),
                Source(engine=ENGINE, version="5.24.0", file="src/transformers/cache_utils.py::StaticLayer.lazy_initialization"),
                Source(engine=ENGINE, version="4.53.3", file="src/transformers/cache_utils.py::DynamicCache.update"),
            ],
        )
    ]


@hookimpl
def kvcore_register_formats(register):
    for fmt in formats():
        register(fmt)


@hookimpl
def kvcore_detect(kv_caches, engine, hints):
    if engine != ENGINE:
        return None
    from .detect import detect

    return detect(kv_caches, hints)


@hookimpl
def kvcore_register_fixtures(register):
    from .fixtures import fixture_cases

    for case in fixture_cases():
        register(case)


def _run_demo(argv):
    from .demo import run

    return run(argv)


@hookimpl
def kvcore_register_demos(register):
    register(
        ENGINE,
        _run_demo,
        "tiny random Llama on transformers' continuous batching: detect the live paged cache, offload/restore a request, "
        "check against a DynamicCache; then offload/rebuild a DynamicCache mid-generation",
    )
