"""LMCache's ``utils.get_*`` geometry accessors and shape strings, over :func:`get_spec`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore.compat.lmcache.formats import _fmt
from kvcore.compat.lmcache.specs import get_spec, get_spec_class
from kvcore.detection import normalize_container
from kvcore.errors import FormatError, GeometryError
from kvcore.grammar import TOKENS, render_concrete, render_symbolic

# one logger for the whole facade (its name is the one LMCache users filter on)
logger = logging.getLogger("kvcore.compat.lmcache")


# -- geometry accessors (LMCache utils.get_*) ------------------------------------------------


def get_num_layers(kv_caches: Any, engine_kv_format: Any) -> int:
    """Layers in ``kv_caches``."""
    return get_spec(kv_caches, engine_kv_format).num_layers()


def get_num_blocks(kv_caches: Any, engine_kv_format: Any) -> int:
    """Blocks per layer (layer 0). Raises GeometryError (a ValueError) for a fused NBBS axis."""
    return get_spec(kv_caches, engine_kv_format).num_blocks()


def get_block_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """Tokens per block of layer ``layer_idx`` (cross-layer formats ignore it).
    Raises GeometryError for a fused NBBS axis or a bad ``layer_idx``."""
    return get_spec(kv_caches, engine_kv_format).block_size(layer_idx)


def get_page_buffer_size(kv_caches: Any, engine_kv_format: Any) -> int:
    """Token slots per layer: ``num_blocks * block_size``, or the fused NBBS axis."""
    return get_spec(kv_caches, engine_kv_format).page_buffer_size()


def get_kv_size(kv_caches: Any, engine_kv_format: Any) -> int:
    """2 when K and V are both stored (a TWO axis, or packed in CS), 1 for MLA."""
    return get_spec(kv_caches, engine_kv_format).kv_size()


def get_num_heads(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """KV heads of layer ``layer_idx`` (1 for MLA)."""
    return get_spec(kv_caches, engine_kv_format).num_heads(layer_idx)


def get_hidden_dim_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """``num_heads * head_size`` of layer ``layer_idx``: one token's K (or V) row, in elements."""
    return get_spec(kv_caches, engine_kv_format).hidden_dim(layer_idx)


get_hidden_dim = get_hidden_dim_size


def get_head_size(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> int:
    """Head size of layer ``layer_idx`` in elements (576 for DeepSeek MLA latents; the K head
    size of a packed CS axis)."""
    return get_spec(kv_caches, engine_kv_format).head_size(layer_idx)


def get_tokens_per_layer(kv_caches: Any, engine_kv_format: Any) -> int:
    """Token slots per layer (``num_blocks * block_size``)."""
    return get_spec(kv_caches, engine_kv_format).tokens_per_layer()


def get_elements_per_layer(kv_caches: Any, engine_kv_format: Any) -> int:
    """Elements one layer holds, K and V together (``kv_size * slots * NH * HS``)."""
    return get_spec(kv_caches, engine_kv_format).elements_per_layer()


def get_dtype(kv_caches: Any, engine_kv_format: Any, layer_idx: int = 0) -> torch.dtype:
    """Element dtype of layer ``layer_idx`` (the carried dtype of byte views, e.g. bf16 in int8 buffers)."""
    return get_spec(kv_caches, engine_kv_format).dtype(layer_idx)


def get_device(kv_caches: Any) -> torch.device:
    """The device of the first tensor in ``kv_caches`` (LMCache ``utils.get_device``).

    Raises:
        DetectionError: ``kv_caches`` holds no tensor.
    """
    container, _ = normalize_container(kv_caches)
    probe = container
    while isinstance(probe, (list, tuple)):
        probe = probe[0]
    return probe.device


def get_group_data_ptrs(kv_caches: Any, engine_kv_format: Any, layer_indices: Sequence[int]) -> list[int]:
    """Device pointers of ``layer_indices`` in kernel order (one per layer; all K then all V
    for K/V lists; K0, V0, K1, V1 for per-layer tuples; one base for a cross-layer tensor).
    Layers outside ``layer_indices`` are not read, so a group of a hybrid model's cache answers.

    Raises:
        GeometryError: a layer index out of range or repeated.
    """
    return get_spec(kv_caches, engine_kv_format).data_ptrs(list(layer_indices))


def get_data_ptrs(kv_caches: Any, engine_kv_format: Any, layer_indices: Sequence[int] | None = None) -> list[int]:
    """Like :func:`get_group_data_ptrs`; ``layer_indices`` defaults to every layer (the
    spec method ``KVFormatSpec.data_ptrs``)."""
    return get_spec(kv_caches, engine_kv_format).data_ptrs(None if layer_indices is None else list(layer_indices))


# -- shape strings ---------------------------------------------------------------------------


def describe_shape(engine_kv_format: Any) -> str:
    """Symbolic shape: ``NL_X_TWO_NB_BS_NH_HS`` → ``NL x [2, NB, BS, NH, HS]``.

    Raises:
        FormatError: not a format name.
    """
    return render_symbolic(str(_fmt(engine_kv_format)))


def concrete_shape(engine_kv_format: Any, size_fn: Callable[[str], int]) -> str:
    """The shape with ``size_fn(label)`` substituted for each label (NL, NB, BS, NH, HS, PBS,
    CS, NP; literal 2 and 1 stay). ``size_fn`` raising ``KeyError`` propagates (LMCache's
    ``concrete_shape`` contract)."""
    syn = _fmt(engine_kv_format).syntax
    sizes: dict[str, int] = {}
    for tok in syn.tokens:
        t = TOKENS[tok]
        if t.literal is not None or tok in ("BSV", "BSS"):
            continue
        sizes[t.label] = int(size_fn(t.label))
    return render_concrete(syn, sizes)


def get_engine_kv_shape_description(engine_kv_format: Any) -> str:
    """Symbolic shape, or ``"Unknown (<format>)"`` for a name that does not parse."""
    try:
        return describe_shape(engine_kv_format)
    except FormatError:
        return f"Unknown ({engine_kv_format})"


def get_concrete_engine_kv_shape(kv_caches: Any, engine_kv_format: Any) -> str:
    """Concrete shape (``80 x [2, 2048, 128, 8, 128]``; layer 0's sizes for a per-layer list),
    or ``"Unknown (<format>)"`` when the tensors do not fit the format (a logging helper:
    it never raises for that)."""
    try:
        return get_spec(kv_caches, engine_kv_format).concrete_shape_str()
    except (FormatError, GeometryError):
        return f"Unknown ({engine_kv_format})"


def get_concrete_engine_kv_shape_from_shape_desc(shape_desc: Any, engine_kv_format: Any) -> str:
    """Concrete shape of one kernel group from its :class:`PageBufferShapeDesc` (``nl`` is the
    group's layer count). Fused NBBS formats use ``nb * bs``; CS is ``hs`` for a ``kv_size``
    1 descriptor (LMCache's convention), else ``2 * hs``. Returns ``"Unknown (<format>)"``
    for a name that does not parse."""
    sizes = {
        "NB": shape_desc.nb,
        "NL": shape_desc.nl,
        "BS": shape_desc.bs,
        "NH": shape_desc.nh,
        "HS": shape_desc.hs,
        "CS": shape_desc.hs if shape_desc.kv_size == 1 else 2 * shape_desc.hs,
        "PBS": shape_desc.nb * shape_desc.bs,
    }
    try:
        return render_concrete(_fmt(engine_kv_format).syntax, sizes)
    except FormatError:
        return f"Unknown ({engine_kv_format})"


def get_attention_backend(engine_kv_format: Any) -> str:
    """The format's representative attention backend: the first of its spec class's
    ``attention_backends``, or ``"Unknown (<format>)"`` (diagnostic only, as in LMCache)."""
    try:
        backends = get_spec_class(engine_kv_format).attention_backends
    except FormatError:
        return f"Unknown ({engine_kv_format})"
    return backends[0] if backends else f"Unknown ({engine_kv_format})"


def legible_print_engine_kv_format(engine_kv_format: Any) -> None:
    """Log the format's symbolic shape and a backend that uses it."""
    shape = get_engine_kv_shape_description(engine_kv_format)
    if shape.startswith("Unknown"):
        logger.warning("Unknown Engine KV Format: %s", engine_kv_format)
        return
    logger.info("Engine KV Format: %s", shape)
    logger.info("Currently used by:\n  - %s", get_attention_backend(engine_kv_format))
