"""Entry point of the kvcore-xpu plugin (group ``kvcore``).

It registers one kernel, ``triton-xpu`` (:mod:`kvcore_xpu.kernel`), and no format: the
KV caches vLLM and SGLang allocate on Intel GPUs are layouts the vLLM and SGLang plugins
already register. Its fixtures are those engines' allocations at the XPU paths' block
sizes, page sizes and dtypes (:mod:`kvcore_xpu.layouts`, with the sources). Nothing here
imports triton: the plugin loads with every ``import kvcore``.
"""

from __future__ import annotations

from kvcore import hookimpl

from .kernel import KERNEL


@hookimpl
def kvcore_register_kernels(register):
    register(KERNEL)


@hookimpl
def kvcore_register_fixtures(register):
    from .layouts import xpu_fixture_cases

    for case in xpu_fixture_cases():
        register(case)
