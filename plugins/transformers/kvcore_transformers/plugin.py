"""Entry point of the kvcore-transformers plugin (group ``kvcore``).

Nothing here imports transformers: the plugin loads with every ``import kvcore``.
"""

from __future__ import annotations

from kvcore import KVFormat, Source, hookimpl

from .caches import LAYER_PAIRS_FORMAT, LAYER_PAIRS_NHD_FORMAT, PAGED_FORMAT

ENGINE = "transformers"


def formats() -> list[KVFormat]:
    """The layouts this plugin registers.

    ``NB_NL_TWO_BS_NH_HS`` (the continuous-batching paged cache, one group) is also vLLM's
    cross-layer cache, which kvcore-vllm declares: a name is one layout, so both plugins
    declare it (identically) and each works without the other.
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
        ),
        KVFormat(
            name=PAGED_FORMAT,
            engines=[ENGINE],
            attention_backends=["PagedAttentionCache"],
            description=(
                "transformers continuous batching: one attention-type group of PagedAttentionCache's uint8 tensor viewed as "
                "[NB, NL_group, 2, page_size, NH, HS] (a block holds each layer's K page then V page)"
            ),
            sources=[
                Source(
                    engine=ENGINE,
                    version="5.24.0",
                    file="src/transformers/generation/continuous_batching/cache.py::PagedAttentionCache.__init__",
                ),
                Source(
                    engine=ENGINE,
                    version="5.24.0",
                    file="src/transformers/generation/continuous_batching/cache_allocators/full_attention.py::FullAttentionCacheAllocator",
                ),
            ],
        ),
        KVFormat(
            name=LAYER_PAIRS_NHD_FORMAT,
            engines=[ENGINE],
            attention_backends=["DynamicCache"],
            description=(
                "transformers 4.53 DynamicCache after a prefill: per-layer (K, V) are attention's key_states.transpose(1, 2) "
                "views, [batch, NH, seq, HS] over NHD memory [batch, seq, NH, HS]; block = batch row, block_size = seq"
            ),
            sources=[
                Source(engine=ENGINE, version="4.53.3", file="src/transformers/cache_utils.py::DynamicCache.update"),
                Source(engine=ENGINE, version="4.53.3", file="src/transformers/models/llama/modeling_llama.py::LlamaAttention.forward"),
            ],
        ),
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


def hints() -> list:
    """The hints :func:`kvcore_transformers.detect.detect` reads (its ``HINTS``), declared
    for ``kvcore hints transformers``."""
    from kvcore import Hint, tensor_order_hint
    from kvcore.dtypes import DTYPE_ALIASES, DTYPES

    from .versions import PAGED_RANGE, SUPPORTED_RANGE

    paged = "a raw 1-D uint8 continuous-batching cache: "
    src = "src/transformers/generation/continuous_batching/cache.py::PagedAttentionCache"
    return [
        Hint(
            engine=ENGINE,
            name="attention_type",
            meaning="which attention-type group of a continuous-batching PagedAttentionCache to describe",
            values=["full_attention", "sliding_attention"],
            default="the only group; several groups without this hint are ambiguous",
            source=src,
        ),
        Hint(
            engine=ENGINE,
            name="container",
            meaning="how a list of per-layer tensors is nested: layer_pairs = [(K, V), ...], kv_lists = [K list, V list] "
            "(4.53's key_cache / value_cache); two lists of two tensors read both ways",
            values=["layer_pairs", "kv_lists"],
            default="read from the nesting (tuples are pairs)",
        ),
        Hint(
            engine=ENGINE,
            name="transformers_version",
            meaning=f"refuse tensors from a transformers version outside the supported range {' '.join(SUPPORTED_RANGE)} "
            f"(paged cache: {' '.join(PAGED_RANGE)})",
            type="version string",
        ),
        Hint(engine=ENGINE, name="num_layers", meaning=paged + "layers of the attention-type group", type="int > 0"),
        Hint(engine=ENGINE, name="num_kv_heads", meaning=paged + "KV heads", type="int > 0"),
        Hint(engine=ENGINE, name="head_size", meaning=paged + "elements per head", type="int > 0"),
        Hint(engine=ENGINE, name="page_size", aliases=["block_size"], meaning=paged + "tokens per page", type="int > 0"),
        Hint(
            engine=ENGINE,
            name="dtype",
            meaning=paged + "the element dtype the bytes carry",
            values=[*DTYPES, *DTYPE_ALIASES],
            type="torch.dtype or name",
        ),
        tensor_order_hint(ENGINE),
    ]


@hookimpl
def kvcore_register_hints(register):
    for h in hints():
        register(h)


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
