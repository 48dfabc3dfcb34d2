"""kvcore: know how every LLM serving engine lays out its KV cache, and move it fast.

Quick start::

    import kvcore
    layout = kvcore.detect(kv_caches, engine="vllm", hints={"kv_cache_layout": "HND"})
    layout.format.name        # "NL_X_TWO_NB_NH_BS_HS"
    layout.describe()         # "32 x [2, 2048, 8, 16, 128]"
    staged = kvcore.gather(layout, slot_mapping)          # [2, NL, T, NH*HS]
    kvcore.scatter(layout, other_slot_mapping, staged)

Layouts are declared by plugins (entry-point group ``kvcore``); the core knows no engine.
"""

from __future__ import annotations

from kvcore.detection import Candidate, detect, detect_per_layer, resolve
from kvcore.distributed import recv, send
from kvcore.errors import (
    AmbiguousLayoutError,
    DetectionError,
    FormatError,
    GeometryError,
    KVCoreError,
    PluginError,
    TransferError,
)
from kvcore.formats import KVFormat, Source
from kvcore.grammar import parse as parse_format
from kvcore.hints import Hint
from kvcore.hookspecs import hookimpl
from kvcore.layout import Detection, KVLayout, PageBufferShapeDesc, build_layout
from kvcore.layout_copy import copy
from kvcore.registry import (
    KVCorePluginWarning,
    disable_plugins,
    formats,
    get_format,
    hints,
    plugins,
    register_plugin,
    unregister_plugin,
)
from kvcore.spec import PlaneStrides, Spec, StrideTable
from kvcore.transfer import gather, gather_blocks, scatter, scatter_blocks, slots_for_blocks

__version__ = "0.1.0"

__all__ = [
    "AmbiguousLayoutError",
    "Candidate",
    "Detection",
    "DetectionError",
    "FormatError",
    "GeometryError",
    "Hint",
    "KVCoreError",
    "KVCorePluginWarning",
    "KVFormat",
    "KVLayout",
    "PageBufferShapeDesc",
    "PlaneStrides",
    "PluginError",
    "Source",
    "Spec",
    "StrideTable",
    "TransferError",
    "build_layout",
    "copy",
    "detect",
    "detect_per_layer",
    "disable_plugins",
    "formats",
    "gather",
    "gather_blocks",
    "get_format",
    "hints",
    "hookimpl",
    "parse_format",
    "plugins",
    "recv",
    "register_plugin",
    "resolve",
    "scatter",
    "scatter_blocks",
    "send",
    "slots_for_blocks",
    "unregister_plugin",
]
