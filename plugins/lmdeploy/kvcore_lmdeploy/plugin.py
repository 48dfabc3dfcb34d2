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
    import dataclasses

    from kvcore_lmdeploy.fixtures import CASES
    from kvcore_lmdeploy.writers import NOT_THIS_VERSION, fill_writer, no_writer_reason

    for case in CASES:
        if case.writer is None:
            cuda_bshd = case.format in ("NL_X_TWO_X_NB_BS_NH_HS", "NL_X_NB_BS_ONE_HS") and "-cuda-" in case.name
            if cuda_bshd and case.name.startswith("lmdeploy-0.14.0-"):
                case = dataclasses.replace(case, writer=fill_writer())
            else:
                case = dataclasses.replace(case, writer=NOT_THIS_VERSION if cuda_bshd else no_writer_reason(case.name))
        register(case)
