"""The plugin host: pluggy manager, entry-point discovery, the registries the ``register``
callbacks fill, and the isolation that keeps one bad plugin from breaking the others.

Loading is lazy and happens once, on the first question that needs plugins
(``kvcore.formats()``, ``kvcore.detect(...)``, ...), under a lock: threads that ask at the
same time wait for the one load and all see the loaded host. Each entry point of group
``kvcore`` is loaded on its own: one that fails to import or to register is skipped with a
:class:`KVCorePluginWarning` naming it and the error, and the rest still load.

One name, one layout. Several plugins may declare the same format name when their
declarations agree (the same name is the same grammar, so the same layout; an LMDeploy
plugin may declare a layout vLLM's plugin also declares, and each works without the
other); their labels (engines, attention backends, sources) are merged. A declaration is
the :class:`~kvcore.KVFormat` less those labels plus the spec the declaring plugin's
``kvcore_spec`` gives for it; two plugins whose declarations of one name differ cannot
both be loaded. Which one keeps the name (:meth:`PluginHost._keeper`, docs/plugins.md §3):
first, the declaration that keeps the name's generic meaning (a plugin giving its own spec
for a name the core's grammar builds by itself overrides it and yields); then the engine's
own plugin (named after an engine its declaration lists); then the plugin that declared
it first -- so a newcomer never knocks out a plugin already serving the name, whatever
their names sort as. The other is named and skipped with a warning that advises
disabling only it (a :class:`PluginError` under ``KVCORE_STRICT_PLUGINS=1``, and from
:func:`register_plugin`).

The declarations of a name are kept in precedence order (the engine's own plugins, then
load order): :func:`format_owner` is the first, and the merged labels list its engines
and backends first, whatever else is installed.

At run time the host calls each plugin's hooks on its own (:func:`ask_detect`,
:func:`spec_for`, the kernels' methods): a hook that raises something other than a
:class:`~kvcore.KVCoreError` (any ``Exception``, or a ``BaseException`` such as
``SystemExit``: only ``KeyboardInterrupt`` and ``GeneratorExit`` pass through,
:func:`contained`), or returns something that is not what the hook promises, is named and
skipped with a warning, and the other plugins answer; an error that leaves kvcore is a
``KVCoreError``, and one a plugin raised names it (:func:`attributed`). Kernel names are
unique (a plugin registering a taken one is skipped); a plugin kernel that fails a
transfer is marked broken and the transfer redone by the next kernel (:class:`BoundKernel`).

Environment:
    ``KVCORE_STRICT_PLUGINS=1``  a plugin that fails to load, or misbehaves, raises :class:`PluginError`.
    ``KVCORE_DISABLE_PLUGINS=a,b`` entry points (plugin names) not to load.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.errors import DetectionError, FormatError, KVCoreError, PluginError
from kvcore.format_decl import KVFormat
from kvcore.hint_decl import Hint

__all__ = [
    "KVCorePluginWarning",
    "PluginInfo",
    "register_plugin",
    "unregister_plugin",
    "disable_plugins",
    "disabled_plugins",
    "plugins",
    "formats",
    "get_format",
    "declarations",
    "formats_for_engine",
    "kernels",
    "hints",
    "reset",
    "host",
    "ask_detect",
    "spec_for",
]

ENTRY_POINT_GROUP = "kvcore"
BUILTIN = "kvcore"

#: KVFormat fields that label a declaration (merged across plugins) rather than define the layout.
LABELS = frozenset({"engines", "attention_backends", "description", "sources"})


class KVCorePluginWarning(UserWarning):
    """A plugin was skipped (failed to import or to register, or misbehaved in a hook)."""


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


def strict() -> bool:
    """``KVCORE_STRICT_PLUGINS`` is set: misbehaving plugins raise instead of warning."""
    return os.environ.get("KVCORE_STRICT_PLUGINS", "") not in ("", "0", "false", "False")


class _Conflict(PluginError):
    """Two plugins declare one format name differently."""

    def __init__(self, message: str, culprit: str, keeper: str):
        super().__init__(message)
        self.culprit, self.keeper = culprit, keeper


class PluginHost:
    """Owns the pluggy manager and the format, kernel, demo and hint registries."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.disabled: set[str] = set()
        self._clear()

    def _clear(self) -> None:
        self.pm = pluggy.PluginManager("kvcore")
        self.pm.add_hookspecs(hookspecs)
        self.formats: dict[str, KVFormat] = {}  # name -> the declarations' merged labels
        self.format_owner: dict[str, str] = {}  # name -> its owner (the first in precedence order)
        self.declarations: dict[str, dict[str, KVFormat]] = {}  # name -> {plugin: its declaration}
        self.kernels: list[Any] = []
        self.kernel_owner: dict[int, str] = {}
        self.demos: dict[str, tuple[Any, str, str]] = {}
        self.hints: list[tuple[str, Hint]] = []
        self.info: dict[str, PluginInfo] = {}
        self._loaded = False
        self._loading: int | None = None  # the thread loading, while it loads
        self._warned: set[str] = set()
        self._seq: dict[str, int] = {}  # plugin -> when it was added (load order), for precedence ties
        self._next_seq = 0

    # -- loading ---------------------------------------------------------------------
    def ensure_loaded(self) -> None:
        """Load the entry points once. Threads asking during the load wait for it; a hook
        of a plugin being loaded that asks again (same thread) sees what loaded so far."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading == threading.get_ident():
                return
            self._loading = threading.get_ident()
            try:
                self._load_all()
            except BaseException:
                # a strict-mode failure: leave no half-loaded host behind, so the next
                # question raises again instead of answering partially
                disabled = set(self.disabled)
                self._clear()
                self.disabled = disabled
                raise
            finally:
                self._loading = None
            self._loaded = True

    def _load_all(self) -> None:
        from kvcore import builtin

        self._add(builtin, BUILTIN, dist=("kvcore", _dist_version("kvcore")))
        is_strict = strict()
        disabled = _env_list("KVCORE_DISABLE_PLUGINS") | self.disabled
        eps = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        _warn_unknown_disabled(
            _env_list("KVCORE_DISABLE_PLUGINS"), {e.name for e in eps}, "KVCORE_DISABLE_PLUGINS", {n for n, _ in self.pm.list_name_plugin()}
        )
        seen: set[str] = set()
        for ep in eps:
            if ep.name in seen or ep.name in disabled or self.pm.has_plugin(ep.name):
                continue
            seen.add(ep.name)
            dist = (ep.dist.name, ep.dist.version) if ep.dist is not None else (None, None)
            try:
                obj = contained(ep.load)
            except Exception as e:  # noqa: BLE001 - a broken plugin must not break kvcore
                self._fail(ep.name, dist, f"import failed: {exc_text(e)}", is_strict, e)
                continue
            try:
                self._add(obj, ep.name, dist=dist, loading=True)
            except _Conflict as e:
                self._remove(ep.name)
                # the advice names the plugin the conflict skips, never the one that keeps the name
                culprit_dist = dist if e.culprit == ep.name else self._dist_of(e.culprit)
                self._fail(e.culprit, culprit_dist, str(e), is_strict, e, advice=False)
            except Exception as e:  # noqa: BLE001
                self._remove(ep.name)
                self._fail(ep.name, dist, f"registration failed: {exc_text(e)}", is_strict, e)

    def _dist_of(self, name: str) -> tuple:
        info = self.info.get(name)
        return (info.distribution, info.version) if info is not None else (None, None)

    def _fail(self, name: str, dist: tuple, why: str, is_strict: bool, exc: BaseException | None, *, advice: bool = True) -> None:
        d = f" (distribution {dist[0]} {dist[1]})" if dist[0] else ""
        msg = f"kvcore plugin {name!r}{d} was skipped: {why}" if advice else why
        msg = msg.rstrip(".") + (
            f". Fix or uninstall it, or set KVCORE_DISABLE_PLUGINS={name} to silence this; KVCORE_STRICT_PLUGINS=1 makes this an error."
        )
        if is_strict:
            raise PluginError(msg) from exc
        self.info[name] = PluginInfo(name=name, distribution=dist[0], version=dist[1], error=why)
        warnings.warn(msg, KVCorePluginWarning, stacklevel=4)

    def _add(self, obj: Any, name: str, dist: tuple = (None, None), *, loading: bool = False) -> None:
        with self._lock:
            if self.pm.has_plugin(name):
                raise PluginError(f"a kvcore plugin named {name!r} is already registered; unregister it first")
            try:
                hash(obj)
            except TypeError:
                raise PluginError(
                    f"kvcore plugin {name!r} is a {type(obj).__name__}, which is not hashable; register a module or an instance of a class"
                ) from None
            try:
                self.pm.register(obj, name=name)
            except (ValueError, pluggy.PluginValidationError) as e:
                raise PluginError(f"kvcore plugin {name!r} cannot be registered: {e}") from e
            info = PluginInfo(name=name, distribution=dist[0], version=dist[1])
            self._seq[name], self._next_seq = self._next_seq, self._next_seq + 1
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

            def register_format(fmt: KVFormat, /) -> KVFormat:
                if not isinstance(fmt, KVFormat):
                    raise PluginError(f"plugin {name!r} registered {fmt!r}; register() takes a kvcore.KVFormat")
                self._declare(name, fmt, loading=loading)
                info.formats.append(fmt.name)
                return fmt

            def register_kernel(kernel: Any, /) -> Any:
                for attr in ("name", "device_types", "gather", "scatter"):
                    if not hasattr(kernel, attr):
                        raise PluginError(f"plugin {name!r} registered a kernel without {attr!r}: {kernel!r}")
                kname = str(kernel.name)
                for other in self.kernels:
                    if str(other.name) == kname:
                        owner = self.kernel_owner.get(id(other), "?")
                        same = "registers it twice" if owner == name else f"plugin {owner!r} registered it first"
                        raise PluginError(
                            f"plugin {name!r} registers a kernel named {kname!r}, and {same}: a kernel name is one kernel "
                            f"(KVCORE_KERNEL={kname} must mean one thing), so {name!r} was skipped. Give the kernel a name of its own"
                        )
                k = kernel if name == BUILTIN else _GuardedKernel(kernel, name, self)
                self.kernels.append(k)
                self.kernel_owner[id(k)] = name
                info.kernels.append(str(kernel.name))
                return kernel

            def register_demo(demo_name: str, run: Any, help: str = "", /) -> None:
                if demo_name in self.demos:
                    raise PluginError(f"demo {demo_name!r} is registered by two plugins: {self.demos[demo_name][2]!r} and {name!r}")
                self.demos[demo_name] = (run, help, name)

            def register_hint(hint: Hint, /) -> Hint:
                if not isinstance(hint, Hint):
                    raise PluginError(f"plugin {name!r} registered {hint!r:.80}; register() takes a kvcore.Hint")
                if any(p == name and (h.engine, h.name) == (hint.engine, hint.name) for p, h in self.hints):
                    raise PluginError(f"plugin {name!r} declares hint {hint.name!r} of engine {hint.engine!r} twice")
                self.hints.append((name, hint))
                return hint

            try:
                self._call_own(name, "kvcore_register_formats", register=register_format)
                self._call_own(name, "kvcore_register_kernels", register=register_kernel)
                self._call_own(name, "kvcore_register_demos", register=register_demo)
                self._call_own(name, "kvcore_register_hints", register=register_hint)
            except BaseException:
                self._remove(name)
                raise

    def _call_own(self, plugin: str, hook: str, **kwargs: Any) -> list[Any]:
        """Call ``plugin``'s implementations of ``hook`` (and only its own), in pluggy's order."""
        return [_call_impl(impl, kwargs) for impl in reversed(_impls(self.pm, hook)) if impl.plugin_name == plugin]

    # -- format declarations ------------------------------------------------------------
    def _declare(self, plugin: str, fmt: KVFormat, *, loading: bool) -> None:
        while True:
            decls = self.declarations.get(fmt.name)
            if not decls:
                self.declarations[fmt.name] = {plugin: fmt}
                self.format_owner[fmt.name] = plugin
                self.formats[fmt.name] = fmt
                return
            if plugin in decls:
                if decls[plugin] != fmt:
                    raise PluginError(f"plugin {plugin!r} registers format {fmt.name!r} twice, with different labels")
                return
            owner = self.format_owner[fmt.name]
            diff = self._difference(owner, decls[owner], plugin, fmt)
            if diff is None:
                decls[plugin] = fmt
                self._order_declarations(fmt.name)
                return
            keeper, culprit, why = self._keeper(owner, decls[owner], plugin, fmt)
            if culprit == plugin:
                msg = (
                    f"kvcore plugin {culprit!r} declares format {fmt.name!r} differently from plugin {keeper!r} ({diff}); "
                    f"a format name is one layout, and {why}, so {culprit!r} was skipped. Rename the format in {culprit!r}, "
                    f"or declare it as {keeper!r} does"
                )
                raise _Conflict(msg, culprit, keeper)
            msg = (
                f"kvcore plugin {culprit!r} declares format {fmt.name!r} differently from plugin {keeper!r} ({diff}); "
                f"a format name is one layout, and {why}, so {culprit!r} was skipped. Rename the format in {culprit!r}, or "
                f"declare it as {keeper!r} does"
            )
            if not loading:
                # register_plugin(): code asked for this plugin explicitly; refuse it, naming the one in the way
                raise _Conflict(
                    f"kvcore plugin {plugin!r} cannot be registered: it declares format {fmt.name!r} differently from plugin "
                    f"{culprit!r} ({diff}), and {why}; unregister {culprit!r} first (kvcore.unregister_plugin({culprit!r}))",
                    plugin,
                    culprit,
                )
            if strict():
                raise _Conflict(msg, culprit, keeper)
            # the plugin that held the name yields it: it is skipped, the newcomer loads
            info = self.info.get(culprit) or PluginInfo(culprit)
            self._remove(culprit)
            self._fail(culprit, (info.distribution, info.version), msg, False, None, advice=False)

    def _keeper(self, p1: str, f1: KVFormat, p2: str, f2: KVFormat) -> tuple[str, str, str]:
        """Which of two plugins whose declarations of one name differ keeps it:
        ``(keeper, culprit, why)``. The rule (docs/plugins.md §3), in order:

        1. a declaration that keeps the name's generic meaning beats one that overrides it
           (a ``kvcore_spec`` of its own for a name the core's grammar builds by itself; for
           a name the grammar cannot build alone, one without a spec is the incomplete one);
        2. the engine's own plugin (named after an engine its declaration lists) beats one
           that is not;
        3. the plugin that declared the name first (entry points load in name order, after
           the core; :func:`register_plugin` after them) keeps it: a newcomer never knocks
           out a plugin already serving the name.
        """
        o1, o2 = self._overrides(p1, f1), self._overrides(p2, f2)
        if o1 != o2:
            keeper, culprit = (p2, p1) if o1 else (p1, p2)
            cf = f1 if culprit == p1 else f2
            if generic_builds(cf.name):
                why = f"{culprit!r} overrides the name's generic meaning (its own kvcore_spec for a name the core's grammar builds)"
            else:
                why = f"{culprit!r} gives no spec for a name the core's grammar cannot build alone"
            return keeper, culprit, why
        own1, own2 = _is_engines_own(p1, f1), _is_engines_own(p2, f2)
        if own1 != own2:
            keeper, culprit = (p1, p2) if own1 else (p2, p1)
            return keeper, culprit, f"{keeper!r} is the engine's own plugin (named after an engine it declares the name for)"
        return p1, p2, f"{p1!r} declared it first"

    def _overrides(self, plugin: str, fmt: KVFormat) -> bool:
        has_spec = self._own_spec(plugin, fmt) is not None
        return has_spec if generic_builds(fmt.name) else not has_spec

    def _order_declarations(self, name: str) -> None:
        """Put a name's declarations in precedence order (the engine's own plugins first,
        then load order) and derive its owner and merged labels from that order, so the
        answer does not depend on which other plugins are installed or load first."""
        decls = self.declarations[name]
        order = sorted(decls, key=lambda p: (not _is_engines_own(p, decls[p]), self._seq.get(p, 1 << 30)))
        self.declarations[name] = {p: decls[p] for p in order}
        self.format_owner[name] = order[0]
        self.formats[name] = _merged([decls[p] for p in order])

    def _difference(self, p1: str, f1: KVFormat, p2: str, f2: KVFormat) -> str | None:
        """How ``p2``'s declaration of a name differs from ``p1``'s, or None when they agree.

        A declaration is the :class:`KVFormat` less its labels (:data:`LABELS`), plus the
        spec class the declaring plugin's ``kvcore_spec`` gives for the name (None: the
        core's generic spec). Which one keeps the name when they differ: :meth:`_keeper`."""
        s1, s2 = _structure(f1), _structure(f2)
        if s1 != s2:
            keys = sorted(k for k in set(s1) | set(s2) if s1.get(k) != s2.get(k))
            return "; ".join(f"{k}: {s1.get(k)!r} vs {s2.get(k)!r}" for k in keys)
        c1, c2 = self._own_spec(p1, f1), self._own_spec(p2, f2)
        if c1 is not c2:

            def what(p: str, c: Any) -> str:
                return f"{p!r} gives {c.__module__}.{c.__qualname__} (its kvcore_spec)" if c is not None else f"{p!r} uses the core's spec"

            return f"{what(p1, c1)}, {what(p2, c2)}"
        return None

    def _own_spec(self, plugin: str, fmt: KVFormat) -> Any:
        for impl in reversed(_impls(self.pm, "kvcore_spec")):
            if impl.plugin_name != plugin:
                continue
            try:
                cls = _call_impl(impl, {"format": fmt})
            except Exception as e:  # noqa: BLE001
                raise PluginError(f"kvcore plugin {plugin!r}: kvcore_spec(format={fmt.name}) raised {exc_text(e)}") from e
            if cls is not None:
                return cls
        return None

    def _remove(self, name: str) -> None:
        with self._lock:
            for fname in [f for f, d in self.declarations.items() if name in d]:
                decls = self.declarations[fname]
                del decls[name]
                if not decls:
                    del self.declarations[fname]
                    del self.formats[fname]
                    del self.format_owner[fname]
                else:
                    self._order_declarations(fname)
            self.kernels = [k for k in self.kernels if self.kernel_owner.get(id(k)) != name]
            self.kernel_owner = {i: o for i, o in self.kernel_owner.items() if o != name}
            self.demos = {d: v for d, v in self.demos.items() if v[2] != name}
            self.hints = [(p, h) for p, h in self.hints if p != name]
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            self.info.pop(name, None)
            self._seq.pop(name, None)

    # -- misbehaviour at run time -------------------------------------------------------
    def misbehaved(self, plugin: str, what: str, exc: BaseException | None = None) -> None:
        """A plugin's hook misbehaved and was skipped: warn once per (plugin, what)
        (raise :class:`PluginError` under ``KVCORE_STRICT_PLUGINS=1``)."""
        msg = (
            f"kvcore plugin {plugin!r} misbehaved and was skipped: {what}. The other plugins answered; fix or uninstall it, "
            f"or set KVCORE_DISABLE_PLUGINS={plugin}; KVCORE_STRICT_PLUGINS=1 makes this an error."
        )
        if strict():
            raise PluginError(
                f"kvcore plugin {plugin!r} misbehaved: {what}. KVCORE_STRICT_PLUGINS=1 makes this an error (without it the "
                f"plugin is skipped and the others answer); fix or uninstall it, or set KVCORE_DISABLE_PLUGINS={plugin}"
            ) from exc
        key = f"{plugin}\0{what}"
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, KVCorePluginWarning, stacklevel=4)

    def detect_order(self, engine: str) -> list[Any]:
        """The ``kvcore_detect`` implementations in the order :func:`ask_detect` asks them
        for ``engine`` (docs/plugins.md, ``kvcore_detect``): the plugins that serve the
        engine first -- the engine's own plugin (named after it) before the others, then
        load order (entry points by name after the core, :func:`register_plugin` after
        them), so a newcomer never pre-empts a plugin already serving the engine -- then
        the plugins that do not serve it, in pluggy's order. Among the serving plugins that
        are not the engine's own, ``@hookimpl(tryfirst=True)`` / ``(trylast=True)`` move a
        plugin to the front / back as pluggy documents."""
        impls = list(reversed(_impls(self.pm, "kvcore_detect")))

        def rank(i: Any) -> tuple:
            p = i.plugin_name
            if not self.serves(p, engine):
                return (2, 0, 0)
            if p.lower() == engine.lower():
                return (0, 0, self._seq.get(p, 1 << 30))
            return (1, 0 if i.tryfirst else 2 if i.trylast else 1, self._seq.get(p, 1 << 30))

        return sorted(impls, key=rank)  # stable: pluggy's order among the non-serving plugins

    def serves(self, plugin: str, engine: str) -> bool:
        """``plugin`` declares something for ``engine``: a format listing it, a hint of it, a demo of its name."""
        if any(plugin in d and engine in d[plugin].engines for d in self.declarations.values()):
            return True
        return any(p == plugin and h.engine == engine for p, h in self.hints) or self.demos.get(engine, (0, 0, None))[2] == plugin


def _impls(pm: pluggy.PluginManager, hook: str) -> list[Any]:
    """A hook's plain implementations (wrappers are not answers), in registration order."""
    caller = getattr(pm.hook, hook, None)
    if caller is None:
        return []
    return [i for i in caller.get_hookimpls() if not (i.hookwrapper or i.wrapper)]


def _call_impl(impl: Any, kwargs: Mapping[str, Any]) -> Any:
    return contained(impl.function, *[kwargs[a] for a in impl.argnames])


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


def generic_builds(name: str) -> bool:
    """The core's grammar builds format ``name`` by itself (its generic spec reads every
    axis): every name except the ``NP`` plane tuples, which need a plugin's ``kvcore_spec``."""
    from kvcore.grammar import parse

    try:
        return not parse(name).has("NP")
    except FormatError:
        return False


def _is_engines_own(plugin: str, fmt: KVFormat) -> bool:
    """``plugin`` is named after an engine its declaration of ``fmt`` lists (case-insensitive)."""
    return plugin.lower() in {e.lower() for e in fmt.engines}


def _structure(fmt: KVFormat) -> dict[str, Any]:
    return fmt.model_dump(exclude=set(LABELS))


def _merged(decls: list[KVFormat]) -> KVFormat:
    """One KVFormat for the declarations of a name: the first's fields, the labels of all."""
    if len(decls) == 1:
        return decls[0]

    def union(xs):
        out = []
        for x in xs:
            if x not in out:
                out.append(x)
        return out

    first = decls[0]
    return first.model_copy(
        update={
            "engines": union(e for d in decls for e in d.engines),
            "attention_backends": union(b for d in decls for b in d.attention_backends),
            "sources": union(s for d in decls for s in d.sources),
        }
    )


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

    def __init__(self, kernel: Any, plugin: str, host: PluginHost):
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


def _dist_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


_HOST: PluginHost | None = None
_HOST_LOCK = threading.Lock()


def host() -> PluginHost:
    """The process-wide plugin host, loaded on first use (once, whichever thread asks first)."""
    global _HOST
    h = _HOST
    if h is None:
        with _HOST_LOCK:
            if _HOST is None:
                _HOST = PluginHost()
            h = _HOST
    h.ensure_loaded()
    return h


def reset() -> None:
    """Forget every plugin; the next question reloads entry points (for tests)."""
    global _HOST
    with _HOST_LOCK:
        _HOST = None


def register_plugin(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object or module from code (tests, notebooks).

    Its ``kvcore_register_*`` hooks run at once. A format name another plugin declares
    is accepted when the declarations agree (see the module docstring).

    Returns:
        the name it was registered under.
    Raises:
        PluginError: the name is taken, one of its formats is declared differently by
            another plugin (the message names both and what differs), or a hook raised.
            On error nothing of it stays registered.
    """
    h = host()
    name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    try:
        h._add(plugin, name)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - a hook of the plugin failed while registering
        raise PluginError(f"kvcore plugin {name!r} failed while registering: {exc_text(e)}") from e
    return name


def unregister_plugin(name: str) -> None:
    """Remove a plugin and everything it registered."""
    host()._remove(name)


def _warn_unknown_disabled(names: set[str], installed: set[str], where: str, registered: set[str] = frozenset()) -> None:
    """Warn (:class:`KVCorePluginWarning`) about names to disable that no installed plugin
    has: a misspelt name (``vlm``) would otherwise leave loaded the plugin the user meant
    to disable, without a word. The warning names each unknown name, the closest installed
    names, and every installed plugin."""
    import difflib

    known = set(installed) | set(registered)
    unknown = sorted(n for n in names if n not in known and n != BUILTIN)
    if BUILTIN in names:
        warnings.warn(
            f"{where}: the core's built-in plugin {BUILTIN!r} cannot be disabled; it stays loaded", KVCorePluginWarning, stacklevel=3
        )
    for n in unknown:
        close = difflib.get_close_matches(n, sorted(known - {BUILTIN}), n=3, cutoff=0.5)
        did = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        warnings.warn(
            f"{where} names {n!r}, which is no installed kvcore plugin{did}: nothing is disabled by it. Installed plugins "
            f"(entry point names): {', '.join(sorted(known - {BUILTIN})) or 'none'}",
            KVCorePluginWarning,
            stacklevel=3,
        )


def disable_plugins(*names: str) -> None:
    """Disable plugins by name: those loaded are removed, and they are not loaded again
    (the API twin of ``KVCORE_DISABLE_PLUGINS``). A name no installed plugin has is
    kept (a plugin registered later under it stays disabled) with a
    :class:`KVCorePluginWarning` naming it and the installed plugins."""
    h = host()
    _warn_unknown_disabled(
        {n for n in names if n != BUILTIN},
        {e.name for e in md.entry_points(group=ENTRY_POINT_GROUP)},
        "disable_plugins",
        {n for n, _ in h.pm.list_name_plugin()},
    )
    for n in names:
        if n == BUILTIN:
            raise PluginError("the core's built-in plugin 'kvcore' cannot be disabled")
        h.disabled.add(n)
        h._remove(n)


def disabled_plugins() -> list[str]:
    """The plugin names disabled by ``KVCORE_DISABLE_PLUGINS`` or :func:`disable_plugins`."""
    return sorted(_env_list("KVCORE_DISABLE_PLUGINS") | host().disabled)


def plugins() -> list[PluginInfo]:
    """What loaded (and what was skipped, with ``error`` set), in name order."""
    return sorted(host().info.values(), key=lambda i: (i.name != BUILTIN, i.name))


def formats() -> list[KVFormat]:
    """Every registered format, by name (labels merged across the plugins declaring it)."""
    h = host()
    return [h.formats[n] for n in sorted(h.formats)]


def declarations(name: str) -> dict[str, KVFormat]:
    """``{plugin: its declaration}`` for a format name, in precedence order: the engines' own
    plugins first, then load order ({} if none); the first is :func:`format_owner`."""
    return dict(host().declarations.get(name, {}))


def formats_for_engine(engine: str) -> list[KVFormat]:
    """Every layout ``engine``'s detector can return (case-insensitive): the formats a
    declaration lists the engine for, and the formats of the fixtures registered for it (a fixture says
    the engine's detector returns its format, and the conformance suite checks it)."""
    h = host()
    want = engine.lower()
    names = {n for n, f in h.formats.items() if want in (e.lower() for e in f.engines)}
    try:
        from kvcore.testing.fixtures import registered_fixtures

        names |= {c.format for c in registered_fixtures(skip_broken=True) if str(getattr(c, "engine", "")).lower() == want}
    except ImportError:  # pragma: no cover - kvcore.testing is part of kvcore
        pass
    return [h.formats[n] for n in sorted(names) if n in h.formats]


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
    """The plugin that owns format ``name``: of the plugins declaring it (identically), an
    engine's own plugin (named after an engine its declaration lists) before the others,
    then the first loaded. Stable whatever other plugins are installed."""
    return host().format_owner[name]


def kernels() -> list[Any]:
    return list(host().kernels)


def demos() -> dict[str, tuple[Any, str, str]]:
    """Registered demos: name -> (run, help, plugin)."""
    return dict(host().demos)


def hints(engine: str | None = None) -> list[tuple[str, Hint]]:
    """Declared hints as ``(plugin, Hint)``, for ``engine`` or all, in declaration order.

    kvcore's generic ``tensor_order`` hint (:func:`kvcore.tensor_order_hint`), which
    detection accepts for every engine, is listed after an engine's own hints (plugin
    ``kvcore``) where the engine's plugins do not declare it themselves."""
    from kvcore.hint_decl import tensor_order_hint

    rows = [(p, h) for p, h in host().hints if engine is None or h.engine == engine]
    engines = dict.fromkeys(h.engine for _, h in rows)
    for e in engines:
        if not any(h.engine == e and h.name == "tensor_order" for _, h in rows):
            last = max(i for i, (_, h) in enumerate(rows) if h.engine == e)
            rows.insert(last + 1, ("kvcore", tensor_order_hint(e)))
    return rows


# -- hooks called one plugin at a time -------------------------------------------------------


def spec_for(fmt: KVFormat) -> Any:
    """The spec class for ``fmt``: the first answer of a ``kvcore_spec`` of a plugin that
    declares the name (all declarers agree, see the module docstring). For a name no plugin
    declares, a plugin's spec answers only when the core's grammar cannot build the name
    alone (``NP`` plane tuples): a spec never overrides what a name the grammar builds
    means. None: the core's generic spec.

    Raises:
        PluginError: a ``kvcore_spec`` raised or returned something that is not a
            subclass of :class:`kvcore.Spec` (the message names the plugin).
    """
    from kvcore.spec import Spec

    h = host()
    impls = list(reversed(_impls(h.pm, "kvcore_spec")))
    decls = h.declarations.get(fmt.name)
    if decls:
        rank = {p: i for i, p in enumerate(decls)}
        impls = sorted((i for i in impls if i.plugin_name in rank), key=lambda i: rank[i.plugin_name])
    elif generic_builds(fmt.name):
        return None
    for impl in impls:
        try:
            cls = _call_impl(impl, {"format": fmt})
        except KVCoreError as e:
            attributed(e, impl.plugin_name)
            raise
        except Exception as e:  # noqa: BLE001
            raise PluginError(f"kvcore plugin {impl.plugin_name!r}: kvcore_spec(format={fmt.name}) raised {exc_text(e)}") from e
        if cls is None:
            continue
        if not (isinstance(cls, type) and issubclass(cls, Spec)):
            raise PluginError(
                f"kvcore plugin {impl.plugin_name!r}: a kvcore_spec hook returned {cls!r:.80} for format {fmt.name}; it must return "
                "a subclass of kvcore.Spec or None"
            )
        return cls
    return None


def ask_detect(container: Any, engine: str, hints: dict[str, Any], build: Callable[[Any, str], Any] | None = None) -> Any:
    """Ask each plugin's ``kvcore_detect`` for ``engine`` until one answers.

    The plugins that declare ``engine`` (a format listing it, a hint of it) are asked first
    -- the engine's own plugin, then load order (:meth:`PluginHost.detect_order`) -- then
    the others, in pluggy's order. Each plugin gets its own copy of ``hints``
    (dicts, lists and sets copied all the way down): a plugin that edits them changes
    nothing the next plugin, or the caller, sees. A plugin is skipped, with a warning
    naming it, when its hook raises an exception that is not a :class:`~kvcore.KVCoreError`,
    returns something that is not a :class:`~kvcore.Detection`, returns a Detection over
    tensors that are not views of the caller's memory, or (with ``build``) returns a
    Detection that does not build: a format name that does not parse or that no loaded
    plugin registers, or tensors that do not fit the format. A ``KVCoreError`` (DetectionError,
    AmbiguousLayoutError) is an answer from a plugin that declares the engine (later
    plugins are not asked); from one that does not, it is kept and raised only when no
    other plugin answers. Either way its message starts ``kvcore plugin 'name': ``
    (:func:`attributed`). A ``SystemExit`` or other ``BaseException`` from a hook counts
    as an exception (:func:`contained`).

    Args:
        build: ``build(detection, plugin) -> layout``; an exception it raises means the
            plugin's answer is unusable (the plugin is skipped as above).
    Returns:
        the Detection, or None when no plugin recognises the cache.
    Raises:
        DetectionError: quantized tensors (kvcore moves plain element types), a plugin's
            error when it is the only answer, or the refusals when every answer was refused
            (naming each plugin and why; chained to the first refusal's error).
        PluginError: under ``KVCORE_STRICT_PLUGINS=1``, the first misbehaving plugin.
    """
    from kvcore.layout import Detection

    _refuse_quantized(_tensors(container), "kv_caches")
    h = host()
    impls = h.detect_order(engine)
    held: list[tuple[str, KVCoreError]] = []
    refused: list[str] = []
    first_cause: BaseException | None = None
    memory = None
    for impl in impls:
        p = impl.plugin_name
        kwargs = {"kv_caches": container, "engine": engine, "hints": _own_copy(hints)}
        try:
            det = _call_impl(impl, kwargs)
        except KVCoreError as e:
            if h.serves(p, engine):
                attributed(e, p)
                raise  # the plugin's answer for tensors it recognises
            held.append((p, attributed(e, p)))
            continue
        except Exception as e:  # noqa: BLE001 - a crashing plugin must not pre-empt the right one
            why = f"kvcore_detect(engine={engine!r}) raised {exc_text(e)}"
            h.misbehaved(p, why, e)
            refused.append(f"{p}: {why}")
            first_cause = first_cause or e
            continue
        if det is None:
            continue
        if not isinstance(det, Detection):
            why = f"kvcore_detect(engine={engine!r}) returned {det!r:.120}; it must return a kvcore.Detection or None"
            h.misbehaved(p, why)
            refused.append(f"{p}: {why}")
            continue
        _refuse_quantized(_tensors(det.kv_caches), f"the {p} plugin's detection")
        if det.format is not None:
            if memory is None:
                memory = _MemoryRanges(container)
            bad = memory.outside(det.kv_caches)
            if bad:
                why = (
                    f"kvcore_detect(engine={engine!r}) returned a {det.format} detection whose tensors are not a view of "
                    f"the cache ({bad}): detection must return views of the caller's tensors, never copies"
                )
                h.misbehaved(p, why)
                refused.append(f"{p}: {why}")
                continue
            if build is not None:
                try:
                    build(det, p)
                except Exception as e:  # noqa: BLE001 - a KVCoreError, or garbage fields the core could not read
                    what = str(e) if isinstance(e, KVCoreError) else exc_text(e)
                    why = f"kvcore_detect(engine={engine!r}) returned a detection kvcore cannot use: {what}"
                    h.misbehaved(p, why, e)
                    refused.append(f"{p}: {why}")
                    first_cause = first_cause or e
                    continue
        if held:
            for q, e in held:
                h.misbehaved(q, f"kvcore_detect raised {type(e).__name__} for engine {engine!r}, which it declares nothing for: {e}", e)
        return det
    if held:
        raise held[0][1]
    if refused:
        from kvcore.detection import describe_input

        raise DetectionError(
            f"no kvcore plugin gave a usable answer for engine {engine!r}:\n  "
            + "\n  ".join(refused)
            + f"\ntensors:\n{describe_input(container)}"
        ) from first_cause
    return None


def _own_copy(x: Any, depth: int = 0) -> Any:
    """A copy of a hints value that shares no dict, list or set with ``x`` (tuples and
    frozensets rebuilt when they hold one); other objects (tensors, configs) are shared."""
    if depth > 32:
        return x
    if isinstance(x, Mapping):
        return {k: _own_copy(v, depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [_own_copy(v, depth + 1) for v in x]
    if isinstance(x, set):
        return {_own_copy(v, depth + 1) for v in x}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_own_copy(v, depth + 1) for v in x)
    return x


def _tensors(container: Any) -> list[Any]:
    from kvcore.detection import tensors_in

    return tensors_in(container)


def refuse_quantized(container: Any, what: str, error: type[KVCoreError] = DetectionError) -> None:
    """Raise ``error`` when ``container`` holds a quantized tensor (``torch.quint8`` ...):
    kvcore moves plain element types, and torch's quantized tensors have no byte view."""
    _refuse_quantized(_tensors(container), what, error)


def _refuse_quantized(tensors: list[Any], what: str, error: type[KVCoreError] = DetectionError) -> None:
    for t in tensors:
        if getattr(t, "is_quantized", False):
            raise error(
                f"{what} holds a quantized tensor ({str(t.dtype).replace('torch.', '')}, shape {list(t.shape)}); kvcore moves "
                "plain element types: pass the tensor's integer storage (t.int_repr(), or the engine's own uint8/int8 buffer) "
                "and its scales as a plane of their own"
            )


class _MemoryRanges:
    """The byte ranges of every storage the caller's container reaches, per device: a
    detection's tensors must lie inside them (views, not copies). An engine's cache object
    is searched through its attributes (a few levels deep)."""

    def __init__(self, container: Any):
        self.ranges: dict[Any, list[tuple[int, int]]] = {}
        tensors, self.exhaustive = _reachable_tensors(container)
        for t in tensors:
            try:
                st = t.untyped_storage()
                lo = st.data_ptr()
                self.ranges.setdefault(t.device, []).append((lo, lo + st.nbytes()))
            except (RuntimeError, NotImplementedError):  # a tensor without storage: nothing to compare
                continue
        self.known = bool(self.ranges)

    def outside(self, kv_caches: Any) -> str:
        """'' when every tensor of ``kv_caches`` lies in the caller's memory, else which one does not."""
        if not self.known:
            return ""  # an opaque engine object: nothing to compare with
        for i, t in enumerate(_tensors(kv_caches)):
            if t.device.type == "meta" or t.numel() == 0:
                continue
            esz = t.element_size()
            lo = t.data_ptr() + esz * sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
            hi = t.data_ptr() + esz * (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0) + 1)
            if not any(a <= lo and hi <= b for a, b in self.ranges.get(t.device, [])):
                if not self.exhaustive:
                    return ""  # an engine object not searched to its end: its memory may be where we did not look
                return f"tensor {i}, shape {list(t.shape)} on {t.device}, is not a view of the cache"
        return ""


def _reachable_tensors(obj: Any, limit: int = 10_000, max_depth: int = 8) -> tuple[list[Any], bool]:
    """The tensors reachable from ``obj`` through containers and object attributes, and
    whether the search reached every object (False when cut by depth or ``limit``)."""
    import torch

    out: list[Any] = []
    seen: set[int] = set()
    stack = [(obj, 0)]
    exhaustive = True
    while stack:
        if len(seen) >= limit:
            return out, False
        x, depth = stack.pop()
        if id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), type)):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, Mapping):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, depth + 1) for v in x)
        elif depth >= max_depth:
            exhaustive = False
        else:
            attrs = getattr(x, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend((v, depth + 1) for v in attrs.values())
            for s in getattr(type(x), "__slots__", ()) or ():
                if isinstance(s, str) and hasattr(x, s):
                    stack.append((getattr(x, s), depth + 1))
    return out, exhaustive
