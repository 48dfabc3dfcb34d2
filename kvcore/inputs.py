"""The door every cache container passes before a plugin or a spec sees it.

:func:`kvcore.detect`, :func:`kvcore.detect_per_layer` and :func:`kvcore.build_layout`
refuse, before asking any plugin, input that no layout can describe, with a
:class:`~kvcore.KVCoreError` that says what is wrong with it:

* a container nested deeper than :data:`MAX_DEPTH` list/tuple/dict levels above a tensor,
  or one that contains itself. The deepest container a format name spells is two list
  levels (``TWO_X_NL_X_...``, ``NL_X_TWO_X_...``, ``NL_X_NP_X_...``); an engine's own
  container adds at most one: vLLM's layers bound as ``{layer name: [per-virtual-engine
  entry]}``, each entry a tensor, a ``(K, V)`` pair (vllm-ascend) or a Mamba state tuple
  ``[conv, ssm]`` (vllm/model_executor/models/utils.py::bind_kv_cache), i.e. three levels.
  One more is allowed for a :class:`~kvcore.Planes` mapping around such containers;
* a tensor kvcore cannot address as dense strided memory: a nested tensor
  (``torch.nested``), a sparse or other non-strided tensor (``t.layout`` is not
  ``torch.strided``);
* a tensor carrying torch's lazy negation or conjugation bit (``x._neg_view()``,
  ``x.conj()`` of a complex tensor): its bytes are not the values it shows, and a transfer
  moves bytes in place, so a gather would return the unnegated bytes and a scatter would
  store values the view negates again. Such a view is refused rather than resolved: a
  resolved copy (``x.resolve_neg()``) is not the cache, and kvcore describes the cache's
  own memory.

Other objects (an engine's cache object) pass untouched: the engine's plugin unwraps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvcore.errors import DetectionError, GeometryError, KVCoreError

__all__ = ["MAX_DEPTH", "check_container", "check_tensor", "tensor_paths", "plain_integers"]

#: Container levels (list, tuple, dict) allowed above a tensor: the deepest container a
#: format name spells is two (``TWO_X_NL_X_...``), an engine's bound layers three
#: (``{name: [(K, V)]}``), one more for a ``{role: ...}`` mapping of planes around them.
MAX_DEPTH = 4


def check_tensor(t: torch.Tensor, where: str, error: type[KVCoreError] = GeometryError) -> None:
    """Raise ``error`` when ``t`` is not dense strided memory kvcore can address in place
    (nested, sparse or another non-strided layout, or a lazily negated/conjugated view)."""
    if getattr(t, "is_nested", False):
        raise error(
            f"{where} is a nested tensor (torch.nested, ragged rows): a KV cache is dense strided memory; pass the engine's "
            "dense per-layer tensors (a list of tensors), not a nested tensor built from them"
        )
    if t.layout != torch.strided:
        raise error(
            f"{where} is a {str(t.layout).replace('torch.', '')} tensor (shape {list(t.shape)}): kvcore addresses dense "
            "strided memory (torch.strided); pass the engine's dense cache tensor (t.to_dense() would be a copy, not the cache)"
        )
    if t.is_neg() or t.is_conj():
        bit = "negation" if t.is_neg() else "conjugation"
        raise error(
            f"{where} carries torch's lazy {bit} bit (a {'_neg_view()' if t.is_neg() else 'conj()'} view, shape {list(t.shape)}): "
            f"its bytes are not the values it shows, and a transfer moves the cache's bytes in place, so it would read and "
            "write the unnegated values. Pass the cache tensor itself; a resolved copy (t.resolve_neg() / t.resolve_conj()) "
            "is not the cache"
        )


def check_container(
    container: Any,
    what: str = "kv_caches",
    *,
    error: type[KVCoreError] = DetectionError,
    tensor_error: type[KVCoreError] = GeometryError,
    max_depth: int = MAX_DEPTH,
) -> None:
    """Refuse a container no layout can describe (see the module docstring).

    Raises:
        ``error`` (DetectionError by default): nested deeper than ``max_depth`` levels, or
            containing itself; names the path.
        ``tensor_error`` (GeometryError by default): a nested, non-strided, or lazily
            negated/conjugated tensor; names its path.
    """
    stack: list[tuple[Any, int, str, tuple[int, ...]]] = [(container, 0, what, ())]
    while stack:
        x, depth, path, above = stack.pop()
        if isinstance(x, torch.Tensor):
            check_tensor(x, path, tensor_error)
            continue
        if isinstance(x, (str, bytes)):
            continue
        if isinstance(x, Mapping):
            items = [(f"{path}[{k!r}]", v) for k, v in x.items()]
        elif isinstance(x, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(x)]
        else:
            continue  # an engine's own object: its plugin unwraps it
        if id(x) in above:
            raise error(f"{path} contains itself (a container that holds itself is no KV cache)")
        if depth >= max_depth:
            raise error(
                f"{path} is nested more than {max_depth} levels deep ({type(x).__name__} inside {depth} containers): a KV cache "
                f"container has at most {max_depth} levels above its tensors (a format spells at most two: a list of (K, V) "
                "pairs, a K list and a V list of layers; an engine's bound layers add one: {layer name: [(K, V)]}; a "
                "{role: ...} dict of planes one more); pass the engine's container as it keeps it, not wrapped in further lists"
            )
        inner = (*above, id(x))
        stack.extend((v, depth + 1, p, inner) for p, v in reversed(items))


def tensor_paths(container: Any, what: str = "kv_caches") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested dict/list/tuple container with its path (``kv_caches['layer.0'][1]``),
    in container order; an object that is no container (an engine's cache object) yields
    nothing. Guards against a container holding itself."""
    out: list[tuple[str, torch.Tensor]] = []
    stack: list[tuple[Any, str, tuple[int, ...]]] = [(container, what, ())]
    while stack:
        x, path, above = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append((path, x))
            continue
        if isinstance(x, (str, bytes)) or id(x) in above:
            continue
        if isinstance(x, Mapping):
            items = [(f"{path}[{k!r}]", v) for k, v in x.items()]
        elif isinstance(x, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(x)]
        else:
            continue
        inner = (*above, id(x))
        stack.extend((v, p, inner) for p, v in reversed(items))
    return out


def plain_integers(x: Any, what: str, error: type[KVCoreError]) -> Any:
    """An integer argument given as a tensor or array (a layer index, ``layers=``,
    ``skip_prefix=``, a head range bound) as plain Python: a 0-d integer tensor or array
    becomes an ``int``, a 1-D one a ``list`` of ints; anything else is returned as it is,
    for the caller's own checks.

    Raises:
        ``error``: a tensor on the meta device (shapes without values: there is no index to
            read), or a tensor or array of another rank than 0 or 1.
    """
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            raise error(
                f"{what} is a tensor on the meta device (a shape without values, {x.dtype}, shape {list(x.shape)}): there "
                "is no index to read; pass an int, a list of ints, or a CPU tensor"
            )
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            return x  # the caller refuses it in its own words (not an integer)
    elif not (hasattr(x, "ndim") and hasattr(x, "tolist")):
        return x
    if x.ndim > 1:
        raise error(f"{what} must be an integer or a 1-D list of integers, got an array of shape {tuple(x.shape)}")
    return x.tolist()
