"""The plugin registry: the process-wide plugin host and the questions kvcore asks plugins
(formats, kernels, hints, fixtures, ``kvcore_spec``, ``kvcore_detect``).

The host's parts live apart, one job each, and their names stay importable from here:
the pluggy manager, entry-point loading and the registries the ``register`` callbacks fill
(:mod:`kvcore.plugin_host`); the containment of a plugin's exceptions
(:mod:`kvcore.plugin_isolation`); a plugin kernel guarded and bound to its selection
(:mod:`kvcore.plugin_kernels`); the checks on a detection's tensors
(:mod:`kvcore.plugin_answers`). The core's own plugin (:mod:`kvcore.builtin`) is loaded
like the others, through its entry point, so the host imports no kernel.

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
import threading
from collections.abc import Callable
from typing import Any

import pluggy  # noqa: F401 - kept importable from here

from kvcore import hookspecs  # noqa: F401 - kept importable from here
from kvcore.containers import describe_input
from kvcore.detection_decl import Detection
from kvcore.errors import DetectionError, FormatError, KVCoreError, PluginError
from kvcore.format_decl import KVFormat
from kvcore.grammar import parse
from kvcore.hint_decl import Hint, tensor_order_hint
from kvcore.spec import Spec

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
    "registered_fixtures",
    "fixtures_by_plugin",
]

# The host's parts live in their own modules (kvcore.plugin_host, plugin_isolation, plugin_kernels,
# plugin_answers); their names stay importable from here.
from kvcore.plugin_answers import _MemoryRanges, _own_copy, _reachable_tensors, _refuse_quantized, _tensors, refuse_quantized  # noqa: E402, F401
from kvcore.plugin_host import (  # noqa: E402, F401
    BUILTIN,
    ENTRY_POINT_GROUP,
    LABELS,
    KVCorePluginWarning,
    PluginHost,
    PluginInfo,
    _call_impl,
    _Conflict,
    _dist_version,
    _env_list,
    _impls,
    _is_engines_own,
    _merged,
    _structure,
    _warn_unknown_disabled,
    generic_builds,
    strict,
)
from kvcore.plugin_isolation import PASS_THROUGH, PluginAbort, attributed, contained, exc_text  # noqa: E402, F401
from kvcore.plugin_kernels import BoundKernel, _GuardedKernel  # noqa: E402, F401

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
    names |= {c.format for c in registered_fixtures(skip_broken=True) if str(getattr(c, "engine", "")).lower() == want}
    return [h.formats[n] for n in sorted(names) if n in h.formats]


def get_format(name: str | KVFormat) -> KVFormat:
    """The registered format named ``name``.

    Raises:
        FormatError: for a malformed name (naming the bad token) or a name no plugin
            registers (listing the close ones).
    """
    if isinstance(name, KVFormat):
        return name
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
        raise DetectionError(
            f"no kvcore plugin gave a usable answer for engine {engine!r}:\n  "
            + "\n  ".join(refused)
            + f"\ntensors:\n{describe_input(container)}"
        ) from first_cause
    return None


def registered_fixtures(plugin: str | None = None, *, skip_broken: bool = False) -> list[Any]:
    """Every fixture the loaded plugins register through ``kvcore_register_fixtures`` (or
    ``plugin``'s only), in plugin-name order. The hook is called through pluggy: every
    implementation a plugin has (one named with ``specname=`` too) contributes.

    Raises:
        Exception: whatever a plugin's hook raised (``skip_broken``: that plugin's cases
            are left out instead; :func:`fixtures_by_plugin` reports it).
    """
    by_plugin, errors = fixtures_by_plugin(None if plugin is None else [plugin])
    if errors and not skip_broken:
        raise next(iter(errors.values()))
    return [c for name in sorted(by_plugin) for c in by_plugin[name]]


def fixtures_by_plugin(plugins: list[str] | None = None) -> tuple[dict[str, list[Any]], dict[str, BaseException]]:
    """``({plugin: [cases]}, {plugin: the exception its hook raised})`` for every loaded
    plugin (or those named). A plugin whose hook raised keeps the cases registered before."""
    h = host()
    out: dict[str, list[Any]] = {}
    errors: dict[str, BaseException] = {}
    for p in h.pm.get_plugins():
        name = h.pm.get_name(p)
        if plugins is not None and name not in plugins:
            continue
        out[name] = []
        impls = [i for i in h.pm.hook.kvcore_register_fixtures.get_hookimpls() if i.plugin_name == name]
        for impl in reversed(impls):  # pluggy's call order
            try:
                contained(impl.function, *[{"register": out[name].append}[a] for a in impl.argnames])
            except Exception as e:  # noqa: BLE001 - reported per plugin by the caller
                errors[name] = e
                break
    return out, errors
