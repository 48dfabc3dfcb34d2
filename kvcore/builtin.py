"""The core's own plugin: the torch reference kernel and the native kernels that the
core ships (see ``csrc/``). It registers no format: the core knows no engine."""

from __future__ import annotations

from kvcore.hookspecs import hookimpl
from kvcore.kernels import native
from kvcore.kernels.reference import REFERENCE


@hookimpl
def kvcore_register_kernels(register):
    register(REFERENCE)
    for k in native.kernels():
        register(k)
