"""Layouts from a running vLLM's own objects: no hand-written hints.

A vLLM integration (a KV connector, an offloader living in the worker) already holds every
fact kvcore needs: the model runner, or the ``VllmConfig`` with its KV-cache config and the
attention layers. :func:`detect_engine` reads them and returns one kvcore layout per
KV-cache group::

    from kvcore_vllm import detect_engine

    engine = detect_engine(runner)                 # vLLM's GPU/CPU model runner
    for g in engine.groups:                        # one per KV-cache group
        print(g.index, g.kind, g.backend, g.layout and g.layout.describe())
    layout = engine.layout_of("model.layers.0.self_attn.attn")

    # inside a KV connector (KVConnectorBase_V1.register_kv_caches):
    engine = detect_engine(vllm_config=self._vllm_config, kv_caches=kv_caches,
                           kv_cache_config=self._kv_cache_config)

What is read, and where vLLM keeps it (0.24-0.32; older runners have the same names):

==========================  =================================================================
fact (hint)                 vLLM object
==========================  =================================================================
``vllm_version``            ``vllm.__version__``
``device_type``             ``vllm.platforms.current_platform`` (``device_type``, ``is_rocm()``)
groups, their layers        ``kv_cache_config.kv_cache_groups[i].layer_names``
``kv_cache_spec``           the group's ``kv_cache_spec`` class (full / sliding-window
                            attention, MLA, Mamba)
``block_size``              ``kv_cache_spec.block_size`` (the manager's; the tensors show the
                            kernel block, :mod:`kvcore_vllm.rules` splits)
``num_kv_heads``            ``kv_cache_spec.num_kv_heads`` (per rank)
``head_size``               ``kv_cache_spec.head_size``
``cache_dtype``             ``vllm_config.cache_config.cache_dtype``
``dtype``                   ``vllm_config.model_config.dtype`` (the model's)
``attention_backend``       each layer's ``get_attn_backend().get_name()``
``cpu_attn_isa``            each CPU_ATTN layer's ``isa`` (0.29+: ``CPUAttentionMetadataBuilder.
                            _set_isa_to_layers``; 0.24-0.28: its impl's ``isa``)
``kv_cache_layout``         ``kv_cache_config.kv_cache_layout`` (0.29+), else
                            ``vllm.v1.attention.backends.utils.get_kv_cache_layout()``
the tensors                 ``static_forward_context[name].kv_cache`` (what each layer reads;
                            0.11 / 0.13 bind ``[kv_cache]``), or the connector's
                            ``kv_caches``
==========================  =================================================================

Mamba and other state groups hold no KV: their :class:`EngineGroup` has ``layout=None`` and
says so. Errors: :class:`kvcore.DetectionError` when an object lacks a fact this module reads
(naming the attribute), or when detection itself refuses (ambiguity cannot arise: every
deciding hint is given).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import kvcore
from kvcore import DetectionError

__all__ = ["EngineGroup", "EngineLayouts", "engine_hints", "detect_engine"]

#: ``KVCacheSpec`` class names -> the plugin's ``kv_cache_spec`` vocabulary; anything else
#: with ``mamba`` / ``state`` in its name is state, not KV.
_SPEC_KINDS = {
    "FullAttentionSpec": "attention",
    "SlidingWindowSpec": "attention",
    "ChunkedLocalAttentionSpec": "attention",
    "CrossAttentionSpec": "attention",
    "EncoderOnlyAttentionSpec": "attention",
    "SinkFullAttentionSpec": "attention",
    "MLAAttentionSpec": "mla",
}


@dataclass(frozen=True)
class EngineGroup:
    """One vLLM KV-cache group, as kvcore reads it.

    Attributes:
        index: the group's index in ``kv_cache_config.kv_cache_groups`` (the block table
            index vLLM's scheduler uses for it).
        layer_names: the group's layers, in vLLM's order (the layout's layer order).
        kind: ``attention``, ``mla``, or the spec's class name for state groups (``MambaSpec``).
        spec: the group's ``KVCacheSpec`` (vLLM's object).
        backend: the attention backend's name (``CPU_ATTN``, ``FLASH_ATTN``, ...), or None.
        hints: the hints handed to :func:`kvcore.detect` (the engine's facts).
        layout: the group's :class:`kvcore.Layout`; None for a group that holds no KV
            (Mamba state).
        note: why ``layout`` is None, or "".
    """

    index: int
    layer_names: tuple[str, ...]
    kind: str
    spec: Any
    backend: str | None
    hints: dict[str, Any]
    layout: Any
    note: str = ""


@dataclass(frozen=True)
class EngineLayouts:
    """Every KV-cache group of one vLLM worker (see :func:`detect_engine`)."""

    groups: tuple[EngineGroup, ...]
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_groups(self) -> tuple[EngineGroup, ...]:
        """The groups that hold KV (a layout each), in group order."""
        return tuple(g for g in self.groups if g.layout is not None)

    def group_of(self, layer_name: str) -> EngineGroup:
        """The group holding ``layer_name``; :class:`kvcore.DetectionError` if none does."""
        for g in self.groups:
            if layer_name in g.layer_names:
                return g
        raise DetectionError(f"vLLM layer {layer_name!r} is in no KV-cache group; groups hold {[g.layer_names for g in self.groups]}")

    def layout_of(self, layer_name: str):
        """The layout of the group holding ``layer_name`` (None for state groups)."""
        return self.group_of(layer_name).layout


def _need(obj: Any, path: str, what: str) -> Any:
    cur = obj
    for part in path.split("."):
        if cur is None or not hasattr(cur, part):
            raise DetectionError(f"vLLM object {type(obj).__name__} has no {path} ({what}); pass the model runner or vllm_config")
        cur = getattr(cur, part)
    return cur


def _version() -> str:
    try:
        import vllm  # the engine is running in this process: its objects were handed in
    except ImportError as e:  # pragma: no cover - objects of a vLLM that cannot be imported
        raise DetectionError(f"kvcore_vllm.detect_engine needs vLLM importable in this process: {e}") from None
    return str(vllm.__version__)


def _device_type(runner: Any) -> str | None:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover
        current_platform = None
    if current_platform is not None:
        if getattr(current_platform, "is_rocm", lambda: False)():
            return "rocm"
        dev = getattr(current_platform, "device_type", None)
        if dev:
            return str(dev)
    dev = getattr(runner, "device", None)
    return torch.device(dev).type if dev is not None else None


def _layout_name(kv_cache_config: Any) -> str | None:
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is not None:
        return str(getattr(name, "name", name))
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
    except ImportError:
        return None
    try:
        return str(get_kv_cache_layout())
    except Exception:  # noqa: BLE001 - an engine without a configured layout: the strides decide
        return None


def _layer_tensor(layer: Any, name: str) -> torch.Tensor:
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):
        # 0.11 / 0.13 bind one tensor per virtual engine: forward_context[name].kv_cache = [kv_cache]
        kv = kv[0] if len(kv) == 1 else kv
    if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
        raise DetectionError(f"vLLM layer {name!r} holds no KV cache yet ({type(kv).__name__}); call after the engine allocated it")
    return kv


def _backend_name(layer: Any) -> str | None:
    get = getattr(layer, "get_attn_backend", None)
    backend = get() if callable(get) else getattr(layer, "attn_backend", None)
    name = getattr(backend, "get_name", None)
    return str(name()) if callable(name) else None


def _isa(layer: Any) -> str | None:
    """CPU_ATTN's kernel path: the layer's ``isa`` (0.29+: ``CPUAttentionMetadataBuilder.
    _set_isa_to_layers``), else its impl's (0.24-0.28: ``CPUAttentionBackendImpl.__init__``
    sets ``self.isa = _get_attn_isa(...)``)."""
    isa = getattr(layer, "isa", None)
    if isa is None:
        isa = getattr(getattr(layer, "impl", None), "isa", None)
    return None if isa is None else str(isa)


def _one(values: Sequence[Any], what: str, group: int) -> Any:
    vals = list(dict.fromkeys(v for v in values if v is not None))
    if len(vals) > 1:
        raise DetectionError(f"vLLM KV-cache group {group}: its layers disagree on {what} ({vals}); kvcore reads one layout per group")
    return vals[0] if vals else None


def _kind(spec: Any) -> str:
    name = type(spec).__name__
    return _SPEC_KINDS.get(name, name)


def engine_hints(
    runner: Any = None,
    *,
    vllm_config: Any = None,
    kv_cache_config: Any = None,
    kv_caches: Mapping[str, torch.Tensor] | None = None,
) -> list[tuple[int, tuple[str, ...], Any, dict[str, Any], list[torch.Tensor]]]:
    """The facts of each KV-cache group as kvcore hints, with the group's tensors.

    Args:
        runner: vLLM's model runner (``GPUModelRunner``, ``CPUModelRunner``, ...): its
            ``vllm_config``, ``kv_cache_config`` and layers are read.
        vllm_config: the engine's ``VllmConfig`` (when no runner is at hand: a KV
            connector's constructor receives it); its ``compilation_config.
            static_forward_context`` holds the layers.
        kv_cache_config: the engine's ``KVCacheConfig`` (groups and layout); without it,
            every layer of ``kv_caches`` (or of the forward context) is one group.
        kv_caches: ``{layer name: tensor}`` as a connector's ``register_kv_caches``
            receives it; default: each layer's own ``kv_cache``.

    Returns:
        ``[(group index, layer names, spec, hints, tensors)]``; state groups (Mamba) carry
        no hints and no tensors.

    Raises:
        kvcore.DetectionError: neither a runner nor a ``vllm_config``; an object without a
            fact this function reads (the message names it); layers of one group that
            disagree on their backend or kernel path.
    """
    if runner is None and vllm_config is None:
        raise DetectionError("kvcore_vllm.engine_hints needs vLLM's model runner or its vllm_config")
    if vllm_config is None:
        vllm_config = _need(runner, "vllm_config", "the engine's VllmConfig")
    if kv_cache_config is None and runner is not None:
        kv_cache_config = getattr(runner, "kv_cache_config", None)
    context = _need(vllm_config, "compilation_config.static_forward_context", "the model's layers by name")
    version = _version()
    facts: dict[str, Any] = {"vllm_version": version}
    dev = _device_type(runner)
    if dev is not None:
        facts["device_type"] = dev
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if cache_dtype is not None:
        facts["cache_dtype"] = str(cache_dtype)
    model_dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    if isinstance(model_dtype, torch.dtype):
        facts["dtype"] = model_dtype
    layout = _layout_name(kv_cache_config) if kv_cache_config is not None else None
    if layout is not None:
        facts["kv_cache_layout"] = layout

    if kv_cache_config is not None:
        groups = [(i, tuple(g.layer_names), g.kv_cache_spec) for i, g in enumerate(kv_cache_config.kv_cache_groups)]
    else:
        names = tuple(kv_caches) if kv_caches is not None else tuple(n for n, m in context.items() if hasattr(m, "kv_cache"))
        groups = [(0, names, None)]

    out = []
    for index, names, spec in groups:
        kind = _kind(spec) if spec is not None else None
        if kind not in (None, "attention", "mla"):
            out.append((index, names, spec, {}, []))
            continue
        layers = []
        for n in names:
            if n not in context:
                raise DetectionError(f"vLLM KV-cache group {index}: layer {n!r} is not in the forward context")
            layers.append(context[n])
        tensors = [kv_caches[n] if kv_caches is not None and n in kv_caches else _layer_tensor(m, n) for n, m in zip(names, layers)]
        hints = dict(facts)
        backend = _one([_backend_name(m) for m in layers], "the attention backend", index)
        if backend is not None:
            hints["attention_backend"] = backend
        isa = _one([_isa(m) for m in layers], "the CPU attention kernel path (isa)", index)
        if isa is not None:
            hints["cpu_attn_isa"] = str(isa)
        if spec is not None:
            hints["kv_cache_spec"] = kind
            for key, attr in (("block_size", "block_size"), ("num_kv_heads", "num_kv_heads"), ("head_size", "head_size")):
                v = getattr(spec, attr, None)
                if isinstance(v, int) and v > 0:
                    hints[key] = v
            if kind == "mla":
                hints.pop("num_kv_heads", None)
        out.append((index, names, spec, hints, tensors))
    return out


def detect_engine(
    runner: Any = None,
    *,
    vllm_config: Any = None,
    kv_cache_config: Any = None,
    kv_caches: Mapping[str, torch.Tensor] | None = None,
) -> EngineLayouts:
    """Detect every KV-cache group of a running vLLM from its own objects.

    Takes what an integration holds -- the model runner, or the ``VllmConfig`` (with the
    ``KVCacheConfig`` and the connector's ``kv_caches``) -- and returns one
    :class:`kvcore.Layout` per KV-cache group, built by :func:`kvcore.detect` with the
    engine's facts as hints (:func:`engine_hints`; the module docstring lists where each
    fact comes from). Groups over one buffer (vLLM's hybrid allocator: sliding-window
    beside full attention) each get their own layout over the shared memory, as each has
    its own block table.

    Returns:
        :class:`EngineLayouts`; ``groups[i]`` is vLLM's KV-cache group ``i``.

    Raises:
        kvcore.DetectionError: a missing fact (named), or the tensors contradict the
            engine's own facts (a kvcore or engine bug worth reporting: the message shows both).
    """
    groups = []
    facts: dict[str, Any] = {}
    for index, names, spec, hints, tensors in engine_hints(
        runner, vllm_config=vllm_config, kv_cache_config=kv_cache_config, kv_caches=kv_caches
    ):
        kind = _kind(spec) if spec is not None else "attention"
        if not tensors:
            groups.append(
                EngineGroup(index, names, kind, spec, None, {}, None, note=f"{kind}: state, not KV (kvcore moves no bytes of it)")
            )
            continue
        facts = {k: v for k, v in hints.items() if k in ("vllm_version", "device_type", "cache_dtype", "dtype", "kv_cache_layout")}
        layout = kvcore.detect(tensors, engine="vllm", hints=hints)
        groups.append(EngineGroup(index, names, kind, spec, hints.get("attention_backend"), hints, layout))
    return EngineLayouts(tuple(groups), facts)
