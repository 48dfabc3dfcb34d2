"""Containment of plugin code: what a plugin's hook may raise and how kvcore carries it.

A hook that raises a ``BaseException`` that is not an ``Exception`` (``SystemExit``...)
is turned into :class:`PluginAbort` (:func:`contained`), so one plugin cannot end the
caller's process; ``KeyboardInterrupt`` and ``GeneratorExit`` pass through
(:data:`PASS_THROUGH`). A :class:`~kvcore.KVCoreError` a plugin raised is re-worded to
name it (:func:`attributed`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.errors import KVCoreError

#: what a plugin may raise that kvcore lets through: the user's Ctrl-C and generator close.
PASS_THROUGH = (KeyboardInterrupt, GeneratorExit)


class PluginAbort(Exception):
    """A plugin raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
    a custom ``BaseException`` subclass): kvcore contains it like any other exception
    from a plugin (the original is ``__cause__`` and :attr:`original`), so one plugin
    cannot end the process or break every other plugin. ``KeyboardInterrupt`` and
    ``GeneratorExit`` pass through (:data:`PASS_THROUGH`)."""

    def __init__(self, original: BaseException):
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


def contained(fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
    """``fn(*a, **kw)`` (a plugin's code) with a ``BaseException`` that is not an
    ``Exception`` -- other than :data:`PASS_THROUGH` -- turned into :class:`PluginAbort`."""
    try:
        return fn(*a, **kw)
    except PASS_THROUGH:
        raise
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit and kin from a plugin must not end kvcore's caller
        raise PluginAbort(e) from e


def exc_text(e: BaseException) -> str:
    """``"Type: message"`` for an exception a plugin raised (the original type for a
    contained :class:`PluginAbort`)."""
    if isinstance(e, PluginAbort):
        return str(e)
    return f"{type(e).__name__}: {e}"


def attributed(e: KVCoreError, plugin: str) -> KVCoreError:
    """``e`` (raised by ``plugin``'s hook) with its message prefixed by ``kvcore plugin
    'name': `` -- the same exception object, type and attributes, so callers catching
    :class:`DetectionError` / :class:`AmbiguousLayoutError` see what they did before."""
    prefix = f"kvcore plugin {plugin!r}: "
    if e.args and isinstance(e.args[0], str):
        if not e.args[0].startswith(prefix):
            e.args = (prefix + e.args[0], *e.args[1:])
    else:
        e.args = (prefix + str(e), *e.args[1:])
    return e
