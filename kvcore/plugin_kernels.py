"""A plugin's transfer kernel as the core calls it: guarded (:class:`_GuardedKernel`: a
kernel that raises is marked broken and skipped) and bound to the selection that chose it
(:class:`BoundKernel`: a failed transfer is redone by the next kernel)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.errors import KVCoreError, PluginError
from kvcore.plugin_isolation import contained, exc_text


class _GuardedKernel:
    """A plugin's kernel, as the core calls it. ``available``/``supports``/``accepts``
    that raise count as False (with one warning), ``why`` that raises says so. A
    ``gather``/``scatter`` that raises something other than a :class:`KVCoreError` (a
    refusal, which propagates unchanged) marks the kernel broken for the rest of the
    process (:attr:`broken`; ``available()`` is then False, ``why()`` says why) with a
    warning naming it, and -- when the kernel was chosen by :func:`kvcore.kernels.select_kernel`,
    not forced by ``KVCORE_KERNEL`` -- the same transfer is redone by the next kernel that
    serves the plan (docs/plugins.md §8, "When a plugin kernel fails"). Under
    ``KVCORE_STRICT_PLUGINS=1``, or when forced, it raises :class:`PluginError` instead.
    Every other attribute is the kernel's own."""

    _GUARDED = ("supports", "accepts")

    def __init__(self, kernel: Any, plugin: str, host: Any):
        self.kernel, self.plugin, self._host = kernel, plugin, host
        self.broken: str | None = None

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.kernel, attr)
        if attr in self._GUARDED and callable(value):
            return lambda *a, **kw: self._ask(attr, value, *a, **kw)
        return value

    def __repr__(self) -> str:
        return f"<kernel {self.kernel.name!r} of plugin {self.plugin!r}>"

    def _ask(self, what: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> bool:
        try:
            return bool(contained(fn, *a, **kw))
        except KVCoreError:
            raise
        except Exception as e:  # noqa: BLE001 - a plugin's kernel must not break the transfer path
            self._host.misbehaved(self.plugin, f"kernel {self.kernel.name!r}.{what}() raised {exc_text(e)}", e)
            return False

    def available(self) -> bool:
        return self.broken is None and self._ask("available", self.kernel.available)

    def why(self) -> str:
        if self.broken is not None:
            return f"marked broken in this process: {self.broken}"
        try:
            return str(contained(self.kernel.why))
        except Exception as e:  # noqa: BLE001
            return f"why() raised {exc_text(e)}"

    def move(self, what: str, plan: Any, fallback: Callable[[], Any] | None = None) -> None:
        """Run the kernel's ``gather``/``scatter`` on ``plan``; ``fallback()`` selects the
        kernel that redoes the transfer if this one fails (None: raise PluginError)."""
        if self.broken is not None and fallback is not None:
            getattr(fallback(), what)(plan)
            return
        try:
            contained(getattr(self.kernel, what), plan)
        except KVCoreError:
            raise  # the kernel refused the plan (before writing, by the contract)
        except Exception as e:  # noqa: BLE001
            self.broken = f"{what}() raised {exc_text(e)}"
            failed = (
                f"kernel {self.kernel.name!r} of plugin {self.plugin!r} failed in {what}: {exc_text(e)}; the cache or the staging "
                "buffer may be partly written"
            )
            if fallback is None:
                raise PluginError(
                    f"{failed}. It was forced by KVCORE_KERNEL, so no other kernel was tried: unset KVCORE_KERNEL, force "
                    f"another kernel (KVCORE_KERNEL=reference) or disable the plugin (KVCORE_DISABLE_PLUGINS={self.plugin})"
                ) from e
            self._host.misbehaved(  # raises PluginError under KVCORE_STRICT_PLUGINS=1
                self.plugin,
                f"{failed}; it is not used again in this process, and the transfer was redone from the start by the next kernel "
                "that serves it (which rewrites every byte the request addresses)",
                e,
            )
            getattr(fallback(), what)(plan)

    def gather(self, plan: Any) -> None:
        self.move("gather", plan)

    def scatter(self, plan: Any) -> None:
        self.move("scatter", plan)


class BoundKernel:
    """A plugin kernel as :func:`kvcore.kernels.select_kernel` returns it: the kernel with
    the selection that chose it, so a failing transfer is redone by the next kernel that
    selection picks (:class:`_GuardedKernel`). Every attribute is the kernel's."""

    def __init__(self, guarded: _GuardedKernel, reselect: Callable[[], Any]):
        self.guarded, self._reselect = guarded, reselect

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.guarded, attr)

    def __repr__(self) -> str:
        return repr(self.guarded)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.guarded or (isinstance(other, BoundKernel) and other.guarded is self.guarded)

    def __hash__(self) -> int:
        return hash(self.guarded)

    def gather(self, plan: Any) -> None:
        self.guarded.move("gather", plan, self._reselect)

    def scatter(self, plan: Any) -> None:
        self.guarded.move("scatter", plan, self._reselect)
