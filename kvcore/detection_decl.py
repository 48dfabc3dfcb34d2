"""``Detection``: what a plugin's ``kvcore_detect`` hook returns (a declaration, like
:class:`~kvcore.KVFormat` and :class:`~kvcore.Hint`): a format name and the caller's
tensors normalised to it. The core builds the :class:`~kvcore.KVLayout` from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Detection"]


@dataclass
class Detection:
    """What a ``kvcore_detect`` hook returns.

    Attributes:
        format: the format name.
        kv_caches: the container normalised to the format's nesting (views of the
            caller's tensors, never copies); for a multi-plane format a dict
            ``{role: container}``, each nested as that plane's template.
        dtype: the element dtype when the tensors are a byte view of it, else None; for
            a multi-plane format one dtype for every plane or a dict ``{role: dtype}``
            (roles left out keep their tensors' dtype).
        params: facts the name cannot carry (``head_size`` of a packed CS axis, ...).
        note: one line on how it was decided (shown by ``kvcore detect``).
        excluded: set (with the reason) for tensors that are not KV (Mamba state);
            then ``format`` is None.
        layer_ids: the model's layer indices of the layout's layers, when the plugin
            knows them and they are not 0..NL-1 (one attention-type group of a hybrid
            model's cache); None: 0..NL-1.
        aliases: ``{layer: earlier layer}`` for layers that are the very same memory as an
            earlier layer (KV-sharing layers registered under several names; see
            :func:`kvcore.detection.split_aliases`). ``kv_caches`` then holds only the
            distinct layers, in order, and the layout still has one layer per entry.
    """

    format: str | None
    kv_caches: Any = None
    dtype: torch.dtype | dict[str, torch.dtype] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    excluded: str | None = None
    layer_ids: tuple[int, ...] | None = None
    aliases: dict[int, int] | None = None
