"""kvcore: know how every LLM serving engine lays out its KV cache, and move it fast.

Quick start::

    import kvcore
    layout = kvcore.detect(kv_caches, engine="vllm", hints={"kv_cache_layout": "HND"})
    layout.format.name        # "NL_X_TWO_NB_NH_BS_HS"
    layout.describe()         # "32 x [2, 2048, 8, 16, 128]"
    staged = kvcore.gather(layout, slot_mapping)          # [2, NL, T, NH*HS]
    kvcore.scatter(layout, other_slot_mapping, staged)

A record may have several planes, each its own tensors, strides, width and dtype: a
multi-plane name ``ROLE=TEMPLATE(+ROLE=TEMPLATE)*`` (``K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH``:
int8 K values beside bf16 per-token-head scales). ``layout.planes`` lists them; when they
are not exactly K (and V) of one dtype and width, transfers stage a dict
``{role: [NL, T, NH_p*HS_p]}`` (``layout.staging_shapes``, ``layout.allocate_staging``).

Layouts are declared by plugins (entry-point group ``kvcore``); the core knows no engine.
"""

from __future__ import annotations

from kvcore.detection import TENSOR_ORDER, Candidate, Layers, Planes, detect, detect_per_layer, memory_ordered, resolve, split_aliases
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
from kvcore.format_decl import KVFormat, Source
from kvcore.grammar import parse as parse_format
from kvcore.hint_decl import Hint, tensor_order_hint
from kvcore.hookspecs import hookimpl
from kvcore.layout import Detection, KVLayout, PageBufferShapeDesc, build_layout
from kvcore.layout_copy import copy
from kvcore.layout_plan import LayoutPlan, plan, synchronize
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
from kvcore.spec import Plane, PlaneInfo, PlaneStrides, Spec, StagingBuffer, StagingTarget, StrideTable, classic_table
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
    "Layers",
    "LayoutPlan",
    "PageBufferShapeDesc",
    "Plane",
    "PlaneInfo",
    "PlaneStrides",
    "Planes",
    "PluginError",
    "Source",
    "Spec",
    "StagingBuffer",
    "StagingTarget",
    "StrideTable",
    "TENSOR_ORDER",
    "TransferError",
    "build_layout",
    "classic_table",
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
    "memory_ordered",
    "parse_format",
    "plan",
    "plugins",
    "recv",
    "register_plugin",
    "resolve",
    "scatter",
    "scatter_blocks",
    "send",
    "slots_for_blocks",
    "split_aliases",
    "synchronize",
    "tensor_order_hint",
    "unregister_plugin",
]
