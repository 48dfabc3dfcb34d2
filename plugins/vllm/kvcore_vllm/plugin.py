"""Entry point of the kvcore-vllm plugin (group ``kvcore``)."""

from __future__ import annotations

from kvcore import hookimpl


@hookimpl
def kvcore_register_formats(register):
    return None
