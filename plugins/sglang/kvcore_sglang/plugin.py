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


@hookimpl
def kvcore_register_fixtures(register):
    from kvcore_sglang.fixtures import CASES

    for case in CASES:
        register(case)


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
