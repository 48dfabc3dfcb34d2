"""The four hooks a kvcore plugin may implement.

Project name and entry-point group: ``kvcore``. A plugin is any module or object with
functions decorated by :data:`kvcore.hookimpl`; it is found through its distribution's
``[project.entry-points.kvcore]`` table, or registered with
:func:`kvcore.register_plugin`. Hooks take keyword arguments and an implementation may
accept a subset of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("kvcore")
hookimpl = pluggy.HookimplMarker("kvcore")


@hookspec
def kvcore_register_formats(register: Callable[..., Any]) -> None:
    """Declare layouts. Called once, when the plugin is loaded.

    Call ``register(KVFormat(...))`` once per layout. Two plugins registering the
    same format name raise :class:`kvcore.PluginError` naming both.
    """


@hookspec(firstresult=True)
def kvcore_detect(kv_caches: Any, engine: str, hints: dict[str, Any]) -> Any:
    """Recognise an engine's KV cache.

    Args:
        kv_caches: the cache container with dicts already turned into lists (layer
            order kept): nested lists/tuples of ``torch.Tensor``.
        engine: the engine name the caller gave (``"vllm"``, ``"sglang"``, ...).
        hints: a plain dict of the caller's hints.

    Returns:
        A :class:`kvcore.Detection` for an engine this plugin knows, else None.
        Raise :class:`kvcore.AmbiguousLayoutError` when two formats fit and no hint
        decides; never guess.
    """


@hookspec(firstresult=True)
def kvcore_spec(format: Any) -> Any:
    """Offer a spec class for an exotic format (blocked-scale records, planes of
    different widths, layouts whose element runs are not one axis).

    Args:
        format: the :class:`kvcore.KVFormat`.

    Returns:
        A subclass of :class:`kvcore.spec.Spec` (called as ``cls(format, kv_caches,
        dtype=..., params=...)``), or None to let the core's generic spec answer.
    """


@hookspec
def kvcore_register_kernels(register: Callable[..., Any]) -> None:
    """Offer transfer kernels. Called once, when the plugin is loaded.

    Call ``register(kernel)`` with an object satisfying
    :class:`kvcore.kernels.TransferKernel`: ``name``, ``device_types``, ``formats``
    (None for all), ``priority`` (higher wins), ``available()`` and
    ``gather(plan)`` / ``scatter(plan)``.
    """


@hookspec
def kvcore_register_fixtures(register: Callable[..., Any]) -> None:
    """Offer allocation fixtures for the conformance suite. Called once, at load.

    Call ``register(kvcore.testing.FixtureCase(...))`` for each format the plugin
    registers (at least one case per format): a function that allocates a cache
    exactly as the engine's own code does (shapes *and* strides), the hints to detect
    it with, the declared geometry, and an engine-side view used as the semantic
    oracle. See :class:`kvcore.testing.FixtureCase`.
    """


@hookspec
def kvcore_register_demos(register: Callable[..., Any]) -> None:
    """Offer an end-to-end demo for ``kvcore demo --engine NAME``. Called once, at load.

    Call ``register(name, run, help)`` where ``run(argv: list[str]) -> int`` parses its
    own options, prints what it did, and returns the process exit code (1 on any
    mismatch).
    """
