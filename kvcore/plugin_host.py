"""The plugin host: the pluggy manager, entry-point loading, and the registries the
``register`` callbacks fill (formats, kernels, demos, hints), with the precedence rule
for a format name several plugins declare. See :mod:`kvcore.registry` for the rules;
the process-wide host and the public functions live there."""

from __future__ import annotations

import difflib
import importlib.metadata as md
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.errors import FormatError, PluginError
from kvcore.format_decl import KVFormat
from kvcore.grammar import parse
from kvcore.hint_decl import Hint
from kvcore.plugin_isolation import contained, exc_text
from kvcore.plugin_kernels import _GuardedKernel

ENTRY_POINT_GROUP = "kvcore"


BUILTIN = "kvcore"
#: the module of the core's built-in plugin (loaded as an entry point: :meth:`PluginHost._load_all`)
BUILTIN_MODULE = "kvcore.builtin"


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
        # the core's own plugin (the reference and native kernels) is reached like every other
        # plugin, by its entry point: it sits above the host (it imports the kernels)
        builtin = md.EntryPoint(name=BUILTIN, value=BUILTIN_MODULE, group=ENTRY_POINT_GROUP).load()
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


def generic_builds(name: str) -> bool:
    """The core's grammar builds format ``name`` by itself (its generic spec reads every
    axis): every name except the ``NP`` plane tuples, which need a plugin's ``kvcore_spec``."""
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


def _dist_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _warn_unknown_disabled(names: set[str], installed: set[str], where: str, registered: set[str] = frozenset()) -> None:
    """Warn (:class:`KVCorePluginWarning`) about names to disable that no installed plugin
    has: a misspelt name (``vlm``) would otherwise leave loaded the plugin the user meant
    to disable, without a word. The warning names each unknown name, the closest installed
    names, and every installed plugin."""
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
