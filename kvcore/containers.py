"""The caller's container, read without copying: :class:`Planes` (a dict of plane roles),
:class:`Layers` (one layer per item), :func:`normalize_container` (dicts of layer names
put in layer order), :func:`tensors_in` and :func:`describe_input` (what error messages
show of the caller's tensors)."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from kvcore.errors import DetectionError
from kvcore.inputs import check_container

__all__ = ["Planes", "Layers", "normalize_container", "tensors_in", "describe_input"]


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def _layer_key(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    if m:
        return int(m.group(1))
    nums = re.findall(r"\d+", name)
    return int(nums[0]) if nums else None


_ROLE_RE = re.compile(r"[A-Z][A-Z0-9]*")


class Planes(dict):
    """A multi-plane cache handed to :func:`detect`: ``{role: container}``, each container
    the tensors of one plane (``{"K": k_layers, "V": v_layers, "KS": k_scales}``).

    Its keys are plane roles (``[A-Z][A-Z0-9]*``: ``K``, ``V``, ``KV``, ``KS``, ``KZ``...),
    never layer names: the engine's plugin receives the mapping as it is, roles intact
    (``kv_caches["K"]``), and returns ``Detection(format="K=...+V=...", kv_caches={role:
    ...})``. A plain dict whose keys are all roles without digits (``{"K": ..., "V": ...}``)
    is read the same way; wrap the dict in ``Planes`` when a role has digits (``"K2"``),
    which would otherwise read as a layer name.

    Raises:
        DetectionError: (at :func:`detect`) a key that is not a role, or an empty mapping.
    """

    def __repr__(self) -> str:
        return f"Planes({dict.__repr__(self)})"


class Layers(list):
    """A list whose items are **one layer each**, in layer order: what kvcore hands a detector
    whenever it knows the outer level is layers -- the entries of a dict of layer names
    (``{"model.layers.0.attn": ..., ...}``, put in layer order) and every group
    :func:`detect_per_layer` detects. Item ``i`` is layer ``i``'s entry exactly as the caller
    gave it: a tensor, a per-layer ``(K, V)`` pair, a tuple of planes.

    A plain list or tuple from the caller arrives as it is: its outer level may be layers or
    K/V (``[k_layers, v_layers]``), and for two layers of two same-shaped tensors each the two
    readings look alike. A detector that reads ``[[K, V], [K, V]]`` as ``[K list, V list]`` takes
    layer 0's V for layer 1's K; given a ``Layers`` it must read each item as one layer. A
    caller may pass ``kvcore.Layers([...])`` to say the same.
    """

    def __repr__(self) -> str:
        return f"Layers({list.__repr__(self)})"


def _is_planes(x: Any) -> bool:
    """``x`` is a dict of plane roles: :class:`Planes`, or a plain dict whose keys are all
    role names without a digit (a layer name carries a layer number: ``layers.0``)."""
    if isinstance(x, Planes):
        return True
    return (
        isinstance(x, Mapping)
        and bool(x)
        and all(isinstance(k, str) and _ROLE_RE.fullmatch(k) and not any(c.isdigit() for c in k) for k in x)
    )


def normalize_container(kv_caches: Any, *, sort_dicts: bool = True) -> tuple[Any, list[str] | None]:
    """Dicts of layers become lists, tuples and lists are kept. Returns ``(container,
    layer_names or None)``.

    With ``sort_dicts`` (what :func:`detect` does) a dict's entries are put in layer order,
    the layer index parsed from names such as ``model.layers.7.self_attn.attn`` (insertion
    order where names carry none); without it (:func:`detect_per_layer`) they keep the
    dict's own order.

    A dict of plane roles (:class:`Planes`, or a plain dict whose keys are all roles without
    digits: ``{"K": ..., "V": ..., "KS": ...}``) is a multi-plane cache: it is returned as a
    :class:`Planes` mapping, keys intact and never used as layer names (``layer_names`` None).
    A dict of two or more containers whose keys carry no layer number (``{"k": [...], "v":
    [...]}``) reads either way and is refused.

    An object that is not a container (an engine's cache object) is returned as it is,
    for the engine's plugin to unwrap. The container is first checked at the door
    (:func:`kvcore.inputs.check_container`: nesting depth, nested/sparse/non-strided
    tensors, negated or conjugated views).

    Raises:
        DetectionError: an empty container, a list/dict that holds no tensors, a container
            nested too deep or holding itself, a :class:`Planes` key that is not a role, or
            a dict of containers whose keys are neither roles nor numbered layer names.
        GeometryError: a tensor kvcore cannot address in place (nested, sparse or another
            non-strided layout, a lazily negated/conjugated view).
    """
    check_container(kv_caches)
    names = None
    if _is_planes(kv_caches):
        bad = [k for k in kv_caches if not (isinstance(k, str) and _ROLE_RE.fullmatch(k))]
        if bad:
            raise DetectionError(f"kvcore.Planes keys are plane roles ([A-Z][A-Z0-9]*: K, V, KS, ...); {bad[0]!r} is not one")
        if not tensors_in(kv_caches):
            raise DetectionError(f"kv_caches (planes {', '.join(kv_caches)}) holds no torch.Tensor")
        return (kv_caches if isinstance(kv_caches, Planes) else Planes(kv_caches)), None
    if isinstance(kv_caches, Mapping):
        if not kv_caches:
            raise DetectionError("kv_caches is an empty dict; pass the engine's per-layer KV cache tensors")
        items = list(kv_caches.items())
        keys = [_layer_key(str(k)) for k, _ in items]
        if len(items) > 1 and all(k is None for k in keys) and all(isinstance(v, (list, tuple, Mapping)) for _, v in items):
            shown = ", ".join(repr(k) for k, _ in items[:6]) + (", ..." if len(items) > 6 else "")
            raise DetectionError(
                f"kv_caches is a dict of containers whose keys ({shown}) carry no layer number: each key reads either as a "
                "plane role or as a layer name, and nothing decides. For a multi-plane cache name the roles upper-case "
                "({'K': [...], 'V': [...]}, or kvcore.Planes(...) for roles with digits); for layers pass a list in layer "
                "order, or a dict whose names carry the layer index (model.layers.0...)"
            )
        if sort_dicts and all(k is not None for k in keys):
            order = sorted(range(len(items)), key=lambda i: (keys[i], i))
            items = [items[i] for i in order]
        names = [str(k) for k, _ in items]
        kv_caches = Layers(v for _, v in items)
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

    def walk(x: Any, path: str, depth: int = 0) -> None:
        if isinstance(x, torch.Tensor):
            try:
                stride = tuple(x.stride())
            except RuntimeError:  # nested or sparse tensors have no strides
                stride = (str(x.layout).replace("torch.", "") + (" nested" if getattr(x, "is_nested", False) else ""),)
            shape = tuple(x.shape) if not getattr(x, "is_nested", False) else ("ragged",)
            key = (shape, stride, str(x.dtype), str(x.device))
            rows.setdefault(key, []).append(path)
        elif isinstance(x, (list, tuple, Mapping)) and depth < 16:
            pairs = x.items() if isinstance(x, Mapping) else enumerate(x)
            for i, y in pairs:
                walk(y, f"{path}[{i!r}]" if isinstance(x, Mapping) else f"{path}[{i}]", depth + 1)
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
