"""The core's own plugin: the torch reference kernel and the native kernels that the
core ships (see ``csrc/``). It registers no format: the core knows no engine."""

from __future__ import annotations

from kvcore.hookspecs import hookimpl
from kvcore.kernels.reference import REFERENCE


@hookimpl
def kvcore_register_kernels(register):
    register(REFERENCE)
    try:
        from kvcore.kernels import native
    except ImportError:  # pragma: no cover - native module absent in a partial install
        return
    for k in native.kernels():
        register(k)
