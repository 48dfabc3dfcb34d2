"""Entry point of the kvcore-lmdeploy plugin (group ``kvcore``, name ``lmdeploy``)."""

from __future__ import annotations

from kvcore import hookimpl
from kvcore_lmdeploy.formats import FORMATS


@hookimpl
def kvcore_register_formats(register):
    for fmt in FORMATS:
        register(fmt)


@hookimpl
def kvcore_detect(kv_caches, engine, hints):
    if engine != "lmdeploy":  # other engines are not ours
        return None
    from kvcore_lmdeploy.detect import detect_lmdeploy

    return detect_lmdeploy(kv_caches, hints)


@hookimpl
def kvcore_register_hints(register):
    from kvcore_lmdeploy.hints import declared_hints

    for h in declared_hints():
        register(h)


@hookimpl
def kvcore_register_fixtures(register):
    from kvcore_lmdeploy.fixtures import CASES

    for case in CASES:
        register(case)
