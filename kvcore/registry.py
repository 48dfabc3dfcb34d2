"""The plugin host: pluggy manager, entry-point discovery, and the registries the
``register`` callbacks fill.

Loading is lazy and happens once, on the first question that needs plugins
(``kvcore.formats()``, ``kvcore.detect(...)``, ...). Each entry point of group
``kvcore`` is loaded on its own: one that fails to import is skipped with a
:class:`KVCorePluginWarning` naming it and the error, and the rest still load.

Environment:
    ``KVCORE_STRICT_PLUGINS=1``  a plugin that fails to load raises :class:`PluginError`.
    ``KVCORE_DISABLE_PLUGINS=a,b`` entry points (plugin names) not to load.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.errors import FormatError, PluginError
from kvcore.formats import KVFormat

__all__ = [
    "KVCorePluginWarning",
    "PluginInfo",
    "register_plugin",
    "unregister_plugin",
    "disable_plugins",
    "plugins",
    "formats",
    "get_format",
    "kernels",
    "reset",
    "host",
]

ENTRY_POINT_GROUP = "kvcore"


class KVCorePluginWarning(UserWarning):
    """A plugin was skipped (failed to import or to register)."""


@dataclass
class PluginInfo:
    """What ``kvcore plugins`` shows for one plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    formats: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _env_list(name: str) -> set[str]:
    return {x.strip() for x in os.environ.get(name, "").split(",") if x.strip()}


class PluginHost:
    """Owns the pluggy manager and the format and kernel registries."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.pm = pluggy.PluginManager("kvcore")
        self.pm.add_hookspecs(hookspecs)
        self.formats: dict[str, KVFormat] = {}
        self.format_owner: dict[str, str] = {}
        self.kernels: list[Any] = []
        self.kernel_owner: dict[int, str] = {}
        self.demos: dict[str, tuple[Any, str, str]] = {}
        self.info: dict[str, PluginInfo] = {}
        self.disabled: set[str] = set()
        self._loaded = False

    # -- loading ---------------------------------------------------------------------
    def ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            try:
                self._load_all()
            except BaseException:
                # a strict-mode failure or a duplicate format: leave no half-loaded host
                # behind, so the next question raises again instead of answering partially
                disabled = set(self.disabled)
                self.__init__()
                self.disabled = disabled
                raise

    def _load_all(self) -> None:
        from kvcore import builtin

        self._add(builtin, "kvcore", dist=("kvcore", _dist_version("kvcore")))
        strict = os.environ.get("KVCORE_STRICT_PLUGINS", "") not in ("", "0", "false", "False")
        disabled = _env_list("KVCORE_DISABLE_PLUGINS") | self.disabled
        eps = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        seen: set[str] = set()
        for ep in eps:
            if ep.name in seen or ep.name in disabled or self.pm.has_plugin(ep.name):
                continue
            seen.add(ep.name)
            dist = (ep.dist.name, ep.dist.version) if ep.dist is not None else (None, None)
            try:
                obj = ep.load()
            except Exception as e:  # noqa: BLE001 - a broken plugin must not break kvcore
                self._fail(ep.name, dist, f"import failed: {type(e).__name__}: {e}", strict, e)
                continue
            try:
                self._add(obj, ep.name, dist=dist)
            except PluginError:
                raise
            except Exception as e:  # noqa: BLE001
                self._remove(ep.name)
                self._fail(ep.name, dist, f"registration failed: {type(e).__name__}: {e}", strict, e)

    def _fail(self, name: str, dist: tuple, why: str, strict: bool, exc: Exception) -> None:
        d = f" (distribution {dist[0]} {dist[1]})" if dist[0] else ""
        msg = (
            f"kvcore plugin {name!r}{d} was skipped: {why}. "
            f"Fix or uninstall it, or set KVCORE_DISABLE_PLUGINS={name} to silence this; "
            "KVCORE_STRICT_PLUGINS=1 makes this an error."
        )
        if strict:
            raise PluginError(msg) from exc
        self.info[name] = PluginInfo(name=name, distribution=dist[0], version=dist[1], error=why)
        warnings.warn(msg, KVCorePluginWarning, stacklevel=3)

    def _add(self, obj: Any, name: str, dist: tuple = (None, None)) -> None:
        with self._lock:
            if self.pm.has_plugin(name):
                raise PluginError(f"a kvcore plugin named {name!r} is already registered; unregister it first")
            try:
                self.pm.register(obj, name=name)
            except (ValueError, pluggy.PluginValidationError) as e:
                raise PluginError(f"kvcore plugin {name!r} cannot be registered: {e}") from e
            info = PluginInfo(name=name, distribution=dist[0], version=dist[1])
            callers = self.pm.get_hookcallers(obj) or []
            info.hooks = sorted(h.name for h in callers)
            unknown = sorted(h.name for h in callers if not h.has_spec())
            if unknown:
                known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("kvcore_")))
                warnings.warn(
                    f"kvcore plugin {name!r} implements {', '.join(unknown)}, which kvcore never calls (a typo?); the hooks are {known}",
                    KVCorePluginWarning,
                    stacklevel=3,
                )
            self.info[name] = info
            caller = self.pm.subset_hook_caller  # call only this plugin's implementations
            others = [p for p in self.pm.get_plugins() if p is not obj]

            def register_format(fmt: KVFormat, /) -> KVFormat:
                if not isinstance(fmt, KVFormat):
                    raise PluginError(f"plugin {name!r} registered {fmt!r}; register() takes a kvcore.KVFormat")
                if fmt.name in self.formats:
                    owner = self.format_owner[fmt.name]
                    raise PluginError(
                        f"format {fmt.name!r} is registered by two plugins: {owner!r} and {name!r}; "
                        f"disable one (KVCORE_DISABLE_PLUGINS={name}) or rename the format"
                    )
                self.formats[fmt.name] = fmt
                self.format_owner[fmt.name] = name
                info.formats.append(fmt.name)
                return fmt

            def register_kernel(kernel: Any, /) -> Any:
                for attr in ("name", "device_types", "gather", "scatter"):
                    if not hasattr(kernel, attr):
                        raise PluginError(f"plugin {name!r} registered a kernel without {attr!r}: {kernel!r}")
                self.kernels.append(kernel)
                self.kernel_owner[id(kernel)] = name
                info.kernels.append(str(kernel.name))
                return kernel

            def register_demo(demo_name: str, run: Any, help: str = "", /) -> None:
                if demo_name in self.demos:
                    raise PluginError(f"demo {demo_name!r} is registered by two plugins: {self.demos[demo_name][2]!r} and {name!r}")
                self.demos[demo_name] = (run, help, name)

            try:
                caller("kvcore_register_formats", others)(register=register_format)
                caller("kvcore_register_kernels", others)(register=register_kernel)
                caller("kvcore_register_demos", others)(register=register_demo)
            except Exception:
                self._remove(name)
                raise

    def _remove(self, name: str) -> None:
        with self._lock:
            for fname in [f for f, o in self.format_owner.items() if o == name]:
                del self.formats[fname]
                del self.format_owner[fname]
            self.kernels = [k for k in self.kernels if self.kernel_owner.get(id(k)) != name]
            self.demos = {d: v for d, v in self.demos.items() if v[2] != name}
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            self.info.pop(name, None)


def _dist_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


_HOST: PluginHost | None = None


def host() -> PluginHost:
    """The process-wide plugin host, loaded on first use."""
    global _HOST
    if _HOST is None:
        _HOST = PluginHost()
    _HOST.ensure_loaded()
    return _HOST


def reset() -> None:
    """Forget every plugin; the next question reloads entry points (for tests)."""
    global _HOST
    _HOST = None


def register_plugin(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object or module from code (tests, notebooks).

    Its ``kvcore_register_formats`` / ``kvcore_register_kernels`` run at once.

    Returns:
        the name it was registered under.
    Raises:
        PluginError: the name is taken, or one of its formats is already registered
            (the message names both plugins). On error nothing of it stays registered.
    """
    h = host()
    name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    try:
        h._add(plugin, name)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - a hook of the plugin failed while registering
        raise PluginError(f"kvcore plugin {name!r} failed while registering: {type(e).__name__}: {e}") from e
    return name


def unregister_plugin(name: str) -> None:
    """Remove a plugin and everything it registered."""
    host()._remove(name)


def disable_plugins(*names: str) -> None:
    """Disable plugins by name: those loaded are removed, and they are not loaded again
    (the API twin of ``KVCORE_DISABLE_PLUGINS``)."""
    h = host()
    for n in names:
        if n == "kvcore":
            raise PluginError("the core's built-in plugin 'kvcore' cannot be disabled")
        h.disabled.add(n)
        h._remove(n)


def plugins() -> list[PluginInfo]:
    """What loaded (and what was skipped, with ``error`` set), in name order."""
    return sorted(host().info.values(), key=lambda i: (i.name != "kvcore", i.name))


def formats() -> list[KVFormat]:
    """Every registered format, by name."""
    h = host()
    return [h.formats[n] for n in sorted(h.formats)]


def get_format(name: str | KVFormat) -> KVFormat:
    """The registered format named ``name``.

    Raises:
        FormatError: for a malformed name (naming the bad token) or a name no plugin
            registers (listing the close ones).
    """
    if isinstance(name, KVFormat):
        return name
    from kvcore.grammar import parse

    parse(name)
    h = host()
    if name not in h.formats:
        import difflib

        close = difflib.get_close_matches(name, list(h.formats), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `kvcore formats` lists them"
        raise FormatError(f"no plugin registers format {name!r}{hint}")
    return h.formats[name]


def format_owner(name: str) -> str:
    return host().format_owner[name]


def kernels() -> list[Any]:
    return list(host().kernels)


def demos() -> dict[str, tuple[Any, str, str]]:
    """Registered demos: name -> (run, help, plugin)."""
    return dict(host().demos)
