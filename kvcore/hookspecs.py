"""The hooks a kvcore plugin may implement.

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

    Call ``register(KVFormat(...))`` once per layout. Several plugins may declare one
    name when their declarations agree (one name, one grammar, one layout; the labels
    are merged). A plugin declaring a name differently from another (its ``kvcore_spec``
    gives another spec for it) is skipped with a warning naming both; the engine's own
    plugin (named after an engine its declaration lists) keeps the name, else the plugin
    loaded first.
    """


@hookspec(firstresult=True)
def kvcore_detect(kv_caches: Any, engine: str, hints: dict[str, Any]) -> Any:
    """Recognise an engine's KV cache. Return None at once for an engine that is not yours.

    kvcore asks the plugins that declare ``engine`` first. A hook that raises anything but
    a :class:`kvcore.KVCoreError`, returns something that is not a Detection, or returns
    tensors that are not views of the caller's memory, is skipped with a warning naming
    the plugin (an error under ``KVCORE_STRICT_PLUGINS=1``), and the others answer.

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

    Asked only of the plugins that declare the format (of every plugin for a name no
    plugin declares). A hook that raises, or returns something that is not a Spec
    subclass, is a :class:`kvcore.PluginError` naming the plugin.

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
    """Offer allocation fixtures for the conformance suite. Called by the suite (and by
    ``kvcore formats --engine``), through pluggy: every implementation a plugin has
    (``specname=`` included) is called.

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


@hookspec
def kvcore_register_hints(register: Callable[..., Any]) -> None:
    """Declare the hints a plugin's detector reads. Called once, at load.

    Call ``register(kvcore.Hint(engine=..., name=..., meaning=..., values=[...],
    type=..., aliases=[...], default=..., source=...))`` for each hint: ``kvcore hints
    ENGINE`` prints them, with their meaning and accepted values, and the conformance suite
    checks that every hint a fixture passes is declared.
    """
