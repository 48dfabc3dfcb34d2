"""The detection driver, and the helpers plugins use to decide between candidates.

``detect`` turns the caller's container into nested lists (a dict keyed by layer name
becomes a list in layer order), asks the engine's plugin (``kvcore_detect``), and builds
the :class:`~kvcore.layout.KVLayout`. Nothing is copied: detection and normalisation are
views.

Plugins decide with :func:`resolve`: each candidate (format + normalised views) is
built into a layout; candidates whose stride tables are identical move the same bytes
and are one answer; candidates that address memory differently are a real ambiguity,
and :class:`~kvcore.AmbiguousLayoutError` names them and the hint that decides.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcore import registry
from kvcore.errors import AmbiguousLayoutError, DetectionError, GeometryError
from kvcore.layout import Detection, KVLayout, build_layout

__all__ = [
    "detect",
    "detect_per_layer",
    "normalize_container",
    "Candidate",
    "resolve",
    "physical_permutation",
    "describe_input",
]

log = logging.getLogger("kvcore.detection")

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def _layer_key(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    if m:
        return int(m.group(1))
    nums = re.findall(r"\d+", name)
    return int(nums[0]) if nums else None


def normalize_container(kv_caches: Any) -> tuple[Any, list[str] | None]:
    """Dicts become lists in layer order (the layer index parsed from names such as
    ``model.layers.7.self_attn.attn``; insertion order where names carry none); tuples
    and lists are kept. Returns ``(container, layer_names or None)``.

    An object that is not a container (an engine's cache object) is returned as it is,
    for the engine's plugin to unwrap.

    Raises:
        DetectionError: an empty container, or a list/dict that holds no tensors.
    """
    names = None
    if isinstance(kv_caches, Mapping):
        if not kv_caches:
            raise DetectionError("kv_caches is an empty dict; pass the engine's per-layer KV cache tensors")
        items = list(kv_caches.items())
        keys = [_layer_key(str(k)) for k, _ in items]
        if all(k is not None for k in keys):
            order = sorted(range(len(items)), key=lambda i: (keys[i], i))
            items = [items[i] for i in order]
        names = [str(k) for k, _ in items]
        kv_caches = [v for _, v in items]
    if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == 0:
        raise DetectionError("kv_caches is empty; pass the engine's KV cache tensors (a list, tuple or dict of layers)")
    if not tensors_in(kv_caches):
        if names is None and not isinstance(kv_caches, (list, tuple, str, bytes, int, float, bool, type(None))):
            # an engine's own cache object (a transformers DynamicCache, ...): passed untouched to the plugins,
            # whose kvcore_detect unwraps the objects of its engine; if none does, detect() says so
            return kv_caches, None
        raise DetectionError(f"kv_caches holds no torch.Tensor (got {type(kv_caches).__name__})")
    return kv_caches, names


def tensors_in(container: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple container, in container order."""
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(container)
    return out


def describe_input(kv_caches: Any, limit: int = 6) -> str:
    """One line per distinct leaf: shape, stride, dtype, device, and where it is."""
    rows: OrderedDict[tuple, list[str]] = OrderedDict()

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            key = (tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device))
            rows.setdefault(key, []).append(path)
        elif isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                walk(y, f"{path}[{i}]")
        else:
            rows.setdefault(("not a tensor", type(x).__name__), []).append(path)

    walk(kv_caches, "kv_caches")
    out = []
    for key, paths in list(rows.items())[:limit]:
        where = paths[0] if len(paths) == 1 else f"{paths[0]} .. ({len(paths)} entries)"
        if key[0] == "not a tensor":
            out.append(f"  {where}: {key[1]} (not a tensor)")
        else:
            out.append(f"  {where}: shape={list(key[0])} stride={list(key[1])} dtype={key[2].replace('torch.', '')} device={key[3]}")
    if len(rows) > limit:
        out.append(f"  ... and {len(rows) - limit} more distinct tensor kinds")
    return "\n".join(out)


def _hints_dict(hints: Any) -> dict[str, Any]:
    if hints is None:
        return {}
    if hasattr(hints, "model_dump"):
        return {k: v for k, v in hints.model_dump().items() if v is not None}
    if isinstance(hints, Mapping):
        return {k: v for k, v in hints.items() if v is not None}
    raise DetectionError(f"hints must be a dict or a pydantic model, got {type(hints).__name__}")


def _detectors() -> list[str]:
    h = registry.host()
    return sorted(getattr(i, "plugin_name", None) or h.pm.get_name(i.plugin) for i in h.pm.hook.kvcore_detect.get_hookimpls())


def _ask(host: Any, container: Any, engine: str, hints: dict[str, Any]) -> Detection | None:
    """Ask the plugins' ``kvcore_detect`` hooks, one plugin at a time: one that crashes,
    returns garbage or returns copies is named and skipped (:func:`kvcore.registry.ask_detect`)."""
    return registry.ask_detect(container, engine, hints)


def detect(kv_caches: Any, engine: str, hints: Any = None) -> KVLayout:
    """Recognise an engine's KV cache and describe it.

    Args:
        kv_caches: the engine's cache: a list or tuple (nested as the engine keeps it),
            or a dict keyed by layer name (vLLM), of ``torch.Tensor``.
        engine: ``"vllm"``, ``"sglang"``, ``"transformers"``, ... — the plugin that answers.
        hints: a dict or pydantic model of facts the tensors cannot show (the engine's
            documented precedence applies; see each plugin's docs).
    Returns:
        a :class:`KVLayout` over views of the caller's tensors (no copies).
    Raises:
        DetectionError: no plugin recognises it (the message lists the tensors' shapes,
            strides and dtypes, the engine and the plugins asked), or a plugin's
            ``kvcore_detect`` crashed or returned something that is not a Detection.
        AmbiguousLayoutError: two formats fit and no hint decides (names both and the hint).
    """
    container, names = normalize_container(kv_caches)
    h = _hints_dict(hints)
    host = registry.host()
    det = _ask(host, container, engine, h)
    if det is None:
        asked = ", ".join(_detectors()) or "none (no engine plugin is installed)"
        raise DetectionError(
            f"{_unknown_engine(engine)}no kvcore plugin recognises this KV cache for engine {engine!r} (hints {h or 'none'}).\n"
            f"tensors:\n{describe_input(container)}\n"
            f"plugins asked: {asked}. Check the engine name, add hints (kv_cache_layout, attention_backend, "
            "block_size, num_kv_heads...), or install the engine's plugin."
        )
    if det.format is None:
        raise DetectionError(f"these tensors are not a KV cache: {det.excluded or det.note}\ntensors:\n{describe_input(container)}")
    n_layer_names = names if names is not None else None
    try:
        layout = build_layout(
            det.format, det.kv_caches, dtype=det.dtype, params=det.params, note=det.note, engine=engine, layer_ids=det.layer_ids
        )
    except GeometryError as e:
        raise DetectionError(
            f"engine {engine!r}: detected {det.format} but the tensors do not fit it: {e}\ntensors:\n{describe_input(container)}"
        ) from e
    if n_layer_names is not None and len(n_layer_names) == layout.num_layers:
        layout.layer_names = tuple(n_layer_names)
    log.debug("detected %s %s for engine %s (%s)", layout.format.name, layout.describe(), engine, det.note)
    return layout


def _unknown_engine(engine: str) -> str:
    """A first line for the error when no installed plugin declares ``engine`` at all."""
    known = sorted({e for f in registry.formats() for e in f.engines} | set(registry.demos()))
    if engine in known:
        return ""
    return f"no installed plugin declares engine {engine!r} (engines they declare: {', '.join(known) or 'none'}); "


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return ("L", tuple(_signature(y) for y in x))
    return ("?", type(x).__name__)


def detect_per_layer(
    kv_caches: Any,
    engine: str,
    layer_groups: Sequence[Sequence[int]] | None = None,
    hints: Any = None,
) -> list[KVLayout | None]:
    """Detect a hybrid model's cache: one :class:`KVLayout` per layer, in layer order.

    Layers are grouped by the engine's groups when given (``layer_groups``: lists of
    layer indices sharing a block table), then by tensor shape, stride and dtype; each
    group is detected on its own, so mixed head sizes, rank-3 indexer caches beside
    rank-5 attention caches, and per-group block sizes each get their own format.
    Layers of one group share one layout (``layout.layer_ids`` lists them). Entries a
    plugin recognises as not KV (Mamba state) are ``None``, with the reason logged.

    Raises:
        DetectionError / AmbiguousLayoutError: for a group nothing recognises (or
            recognises twice), a plugin that crashed, or ``layer_groups`` naming a layer
            out of range or in two groups.
    """
    container, names = normalize_container(kv_caches)
    if not isinstance(container, (list, tuple)):
        return [detect(container, engine, hints)]
    n = len(container)
    groups: list[list[int]]
    if layer_groups is None:
        groups = [list(range(n))]
    else:
        try:
            groups = [list(g) for g in layer_groups]
        except TypeError:
            raise DetectionError(
                f"layer_groups must be a list of lists of layer indices (the engine's KV cache groups), got {layer_groups!r}"
            ) from None
        seen = [i for g in groups for i in g]
        bad = [i for i in seen if isinstance(i, bool) or not isinstance(i, int) or not (0 <= i < n)]
        if bad:
            raise DetectionError(f"layer_groups names layers {bad} but kv_caches has {n} layers (0..{n - 1})")
        twice = sorted({i for i in seen if seen.count(i) > 1})
        if twice:
            raise DetectionError(f"layer_groups puts layers {twice} in more than one group; each layer belongs to one group")
        rest = [i for i in range(n) if i not in set(seen)]
        if rest:
            groups.append(rest)
    out: list[KVLayout | None] = [None] * n
    h = _hints_dict(hints)
    host = registry.host()
    for g in groups:
        by_sig: OrderedDict[Any, list[int]] = OrderedDict()
        for i in g:
            by_sig.setdefault(_signature(container[i]), []).append(i)
        for idxs in by_sig.values():
            sub = [container[i] for i in idxs]
            det = _ask(host, sub, engine, h)
            if det is None:
                asked = ", ".join(_detectors()) or "none"
                raise DetectionError(
                    f"{_unknown_engine(engine)}no kvcore plugin recognises layers {idxs} for engine {engine!r}.\n"
                    f"tensors:\n{describe_input(sub)}\nplugins asked: {asked}"
                )
            if det.format is None:
                log.info("layers %s excluded: %s", idxs, det.excluded or det.note)
                continue
            try:
                layout = build_layout(det.format, det.kv_caches, dtype=det.dtype, params=det.params, note=det.note, engine=engine)
            except GeometryError as e:
                raise DetectionError(
                    f"engine {engine!r}: layers {idxs} detected as {det.format} but the tensors do not fit it: {e}\n"
                    f"tensors:\n{describe_input(sub)}"
                ) from e
            if layout.num_layers == len(idxs):
                layout.layer_ids = tuple(idxs)
                if names is not None:
                    layout.layer_names = tuple(names[i] for i in idxs)
            for i in idxs:
                out[i] = layout
    return out


# -- helpers for plugins -------------------------------------------------------------


@dataclass
class Candidate:
    """One way to read the tensors: a format, the views that match it, and which hint
    value selects it (for the ambiguity message)."""

    format: str
    kv_caches: Any
    dtype: torch.dtype | None = None
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    decided_by: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def detection(self) -> Detection:
        return Detection(format=self.format, kv_caches=self.kv_caches, dtype=self.dtype, params=self.params, note=self.note)


def resolve(candidates: Sequence[Candidate], *, engine: str, deciding_hints: Sequence[str] = ()) -> Detection | None:
    """Pick the one meaning of the tensors among ``candidates``.

    Candidates that do not build (their geometry does not fit the tensors) drop out.
    Those left are grouped by their stride table's signature: one group means one
    answer (the first candidate of it). Several groups mean the same tensors can be read
    two ways that move different bytes: :class:`AmbiguousLayoutError`.

    Returns:
        a Detection, or None when no candidate fits.
    """
    built: list[tuple[Candidate, Any]] = []
    for c in candidates:
        try:
            lay = build_layout(c.format, c.kv_caches, dtype=c.dtype, params=c.params)
        except GeometryError as e:
            log.debug("candidate %s rejected: %s", c.format, e)
            continue
        built.append((c, lay))
    if not built:
        return None
    groups: OrderedDict[tuple, list[tuple[Candidate, Any]]] = OrderedDict()
    for c, lay in built:
        sig = (lay.kv_size, lay.stride_table().signature())
        groups.setdefault(sig, []).append((c, lay))
    if len(groups) == 1:
        return built[0][0].detection()
    firsts = [v[0] for v in groups.values()]
    lines = []
    for c, lay in firsts:
        dec = ", ".join(f"{k}={v!r}" for k, v in c.decided_by.items())
        lab = f" [{c.label}]" if c.label else ""
        lines.append(f"  {c.format}{lab}: {lay.describe()}" + (f" (selected by {dec})" if dec else ""))
    keys = list(dict.fromkeys(list(deciding_hints) + [k for c, _ in firsts for k in c.decided_by]))
    raise AmbiguousLayoutError(
        f"{engine}: these tensors fit {len(firsts)} layouts that place bytes differently, and no hint decides:\n"
        + "\n".join(lines)
        + f"\nPass one of these hints to decide: {', '.join(keys) or '(see the plugin docs)'}",
        candidates=[c.format for c, _ in firsts],
        hints=keys,
    )


def physical_permutation(t: torch.Tensor) -> list[int]:
    """The axis order that makes ``t``'s memory order outermost-first: axes sorted by
    decreasing stride; ties (size-1 axes) keep their given order."""
    return sorted(range(t.dim()), key=lambda i: (-t.stride(i) if t.shape[i] > 1 else _size1_rank(t, i), i))


def _size1_rank(t: torch.Tensor, i: int) -> int:
    # a size-1 axis sits where its neighbour to the right is: it changes no address
    for j in range(i + 1, t.dim()):
        if t.shape[j] > 1:
            return -t.stride(j)
    return 0
