"""Entry point of the kvcore-sglang plugin (group ``kvcore``, name ``sglang``)."""

from __future__ import annotations

from kvcore import hookimpl
from kvcore_sglang.formats import FORMATS


@hookimpl
def kvcore_register_formats(register):
    for fmt in FORMATS:
        register(fmt)


@hookimpl
def kvcore_detect(kv_caches, engine, hints):
    if engine != "sglang":
        return None
    from kvcore_sglang.detect import detect_sglang

    return detect_sglang(kv_caches, hints)


@hookimpl
def kvcore_register_hints(register):
    from kvcore_sglang.hints import declared_hints

    for h in declared_hints():
        register(h)


#: why SGLang's own set_kv_buffer is no writer oracle here (scripts/engine_envs.py says more)
NO_WRITER = (
    "SGLang 0.5.23 pins torch==2.14.1 (a CUDA build) and its mem_cache/memory_pool.py imports the whole server "
    "(configs -> multimodal processors -> torchvision, whose PyPI wheel needs libtorch_cuda): MHATokenToKVPool.set_kv_buffer "
    "cannot be imported on a CPU-only machine without stubbing modules the pool does not use"
)


@hookimpl
def kvcore_register_fixtures(register):
    import dataclasses

    from kvcore_sglang.fixtures import CASES

    for case in CASES:
        register(case if case.writer is not None else dataclasses.replace(case, writer=NO_WRITER))


def _run_demo(argv):
    from kvcore_sglang.demo import run

    return run(argv)


@hookimpl
def kvcore_register_demos(register):
    register(
        "sglang",
        _run_demo,
        "SGLang: Llama-3-8B MHA pools (page size 1 and 64) and a DeepSeek-V3 MLA pool offloaded into a page_first HiCache host pool and back",
    )
