"""``kvcore_detect`` for engine ``"vllm"``.

Input: the runner's per-layer container with dicts already turned into lists in layer
order by the core (``runner.kv_caches`` or the ``{layer_name: tensor}`` dict handed to KV
connectors). Each entry is one layer's tensor: a per-layer allocation (<= 0.26), a
permuted view of a cross-layer buffer (0.13-0.2x with a cross-layer connector), or a
0.33 view into the one int8 buffer.

Decision (see :mod:`kvcore_vllm.hints` for the hint precedence):

1. entries that are lists of tensors (vLLM's Mamba state), or 4-D ``[NB, 1, 1, C]``
   pages no rule reads (0.33 ``MambaSpec``: one state per block), are not KV: returned as
   ``Detection(format=None, excluded=...)``;
2. every rule of :mod:`kvcore_vllm.rules` consistent with the hints and the tensors'
   shapes and strides gives a candidate; :func:`kvcore.resolve` merges candidates that
   place bytes identically and raises :class:`kvcore.AmbiguousLayoutError` (naming the
   deciding hints) for the rest -- shape alone never decides between layouts that share a
   shape (``NB == 2``, ``NH == 1`` MLA vs one KV head, ``BS == NH`` without stride
   evidence, packed ``NH == 2`` across versions);
3. when the hints rule out every reading the tensors allow, :class:`kvcore.DetectionError`
   says what the hints said and what the strides show.

vLLM 0.33 int8 byte views with neither ``dtype`` nor an fp8 ``cache_dtype`` hint are
described in bytes (dtype int8, head_size in bytes): transfers still move exactly the
right bytes, K before V; pass ``dtype`` for element geometry.

A contiguous per-layer 5-D tensor with distinct BS and NH and no hints is vLLM's default
NHD (``get_kv_cache_layout`` falls back to NHD; 0.11 ``vllm/v1/attention/backends/utils.py``
l.345).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import AmbiguousLayoutError, Detection, DetectionError, GeometryError, build_layout, resolve
from kvcore.detection import describe_input
from kvcore_vllm.hints import LAYOUT_FAMILY, VllmHints, parse_hints
from kvcore_vllm.rules import Reading, candidates

__all__ = ["detect_vllm"]


def _layout_class(r: Reading) -> tuple[str, bool] | None:
    base, _, cross = r.layout.partition("/")
    if base == "*":
        return None
    fam = LAYOUT_FAMILY.get(base, base)
    return fam, cross == "cross" or base[0] == "B"


def _deciding(readings: list[Reading]) -> list[str]:
    """The hints whose values differ between readings that place bytes differently."""
    groups: dict[tuple, list[Reading]] = {}
    geo: dict[int, tuple] = {}
    for r in readings:
        c = r.candidate
        try:
            lay = build_layout(c.format, c.kv_caches, dtype=c.dtype, params=c.params)
        except GeometryError:
            continue
        groups.setdefault((lay.kv_size, lay.stride_table().signature()), []).append(r)
        geo[id(r)] = (lay.block_size, lay.num_heads, lay.head_size)
    gs = list(groups.values())
    keys: list[str] = []

    def differs(f) -> bool:
        # a hint decides when the groups of byte-identical readings answer it differently
        return len({frozenset(f(r) for r in g) for g in gs}) > 1

    if differs(lambda r: r.rule.mla):
        keys += ["attention_backend", "head_size", "cache_dtype"]
    if differs(lambda r: r.rule.blocked):
        keys += ["cache_dtype", "head_size"]
    if differs(lambda r: r.rule.eras):
        keys.append("vllm_version")
    if differs(lambda r: r.rule.families):
        keys.append("attention_backend")
    if differs(_layout_class) and all(_layout_class(r) is not None for g in gs for r in g):
        keys.append("kv_cache_layout")
    if differs(lambda r: r.candidate.note.endswith("physical order)")):
        keys.append("kv_cache_layout")
    if differs(lambda r: geo[id(r)][0]):
        keys.append("block_size")
    if differs(lambda r: geo[id(r)][1]):
        keys.append("num_kv_heads")
    if differs(lambda r: geo[id(r)][2]):
        keys.append("head_size")
    if differs(lambda r: r.rule.gate in ("cpu", "tpu", "rocm")):
        keys.append("device_type")
    # settings vLLM reads at run time that no tensor shows (IPEX importable, an env var)
    for field, name in (("use_ipex", "use_ipex"), ("prefill_decode_attention", "VLLM_V1_USE_PREFILL_DECODE_ATTENTION")):
        if differs(lambda r, f=field: dict(r.rule.requires).get(f)):
            keys.append(name)
    return list(dict.fromkeys(keys))


def _fitting(readings: list[Reading]) -> list[Reading]:
    out = []
    for r in readings:
        c = r.candidate
        try:
            build_layout(c.format, c.kv_caches, dtype=c.dtype, params=c.params)
        except GeometryError:
            continue
        out.append(r)
    return out


def _explain_misfit(tensors: list[torch.Tensor], h: VllmHints, raw_hints: dict) -> None:
    """Raise DetectionError when the hints exclude every reading the tensors allow."""
    loose = _fitting(candidates(tensors, h, check_layout=False))
    if loose and (h.kv_cache_layout is not None or h.device_type == "xpu"):
        said = h.kv_cache_layout or "NHD (forced on XPU)"
        shows = sorted({f"{r.layout} ({r.candidate.format})" for r in loose})
        raise DetectionError(
            f"vLLM: the kv_cache_layout hint says {said}, but the tensors' strides show {', '.join(shows)}.\n"
            f"tensors:\n{describe_input(tensors)}\nFix the hint (or VLLM_KV_CACHE_LAYOUT), or pass the tensors vLLM allocated."
        )
    free = _fitting(candidates(tensors, VllmHints(device_type=h.device_type)))
    if raw_hints and free:
        shows = sorted({f"{r.candidate.label} -> {r.candidate.format}" for r in free})
        raise DetectionError(
            f"vLLM: no layout fits these tensors with hints {raw_hints}; without them they read as: {'; '.join(shows)}.\n"
            f"tensors:\n{describe_input(tensors)}\nCheck block_size, num_kv_heads, head_size, attention_backend and vllm_version."
        )


def _distinct(items: list[torch.Tensor]) -> tuple[list[torch.Tensor], str, tuple[int, ...] | None]:
    """Drop entries that are the very same view as an earlier one: vLLM registers one tensor
    under several layer names for KV groups that alias one buffer (0.11
    ``kv_cache_utils.py::get_kv_cache_config_from_groups``: ``shared_by=[full.i, sw.i]``) and
    for cross-layer KV sharing (``shared_kv_cache_layers``: the entry *is* the target
    layer's tensor). One memory is one layer of the layout (kvcore refuses two planes at
    one address: a scatter would write it twice)."""
    seen: dict[tuple, int] = {}
    keep: list[torch.Tensor] = []
    kept: list[int] = []
    aliases: list[str] = []
    for i, t in enumerate(items):
        if t.is_meta:  # meta tensors have no addresses: only the same object is the same memory
            key: tuple = ("object", id(t))
        else:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            aliases.append(f"{i}->{seen[key]}")
            continue
        seen[key] = i
        keep.append(t)
        kept.append(i)
    if not aliases:
        return items, "", None
    return (
        keep,
        (
            f"; entries {', '.join(aliases)} alias an earlier entry (shared KV / aliased KV cache groups): "
            f"the layout holds the {len(keep)} distinct layers"
        ),
        tuple(kept),
    )


def detect_vllm(kv_caches: Any, hints: Any) -> Detection | None:
    """Detect one vLLM KV cache group (see the module docstring).

    Returns:
        a :class:`kvcore.Detection`, a not-KV Detection (``format=None``), or None when
        no vLLM layout has this shape at all.
    Raises:
        AmbiguousLayoutError: two layouts fit and place bytes differently.
        DetectionError: the hints contradict the tensors, or a hint value is unknown.
    """
    h = parse_hints(hints)
    raw = {k: v for k, v in (hints or {}).items() if v is not None} if isinstance(hints, dict) else {}
    items = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
    if any(isinstance(x, (list, tuple)) for x in items):
        shapes = [[tuple(t.shape) for t in x] if isinstance(x, (list, tuple)) else tuple(x.shape) for x in items]
        return Detection(
            format=None,
            excluded=f"Mamba state (a list of state tensors per layer, shapes {shapes[:3]}): not KV "
            "(vLLM 0.11 gpu_model_runner.py::_reshape_kv_cache_tensors builds Mamba layers a list of as_strided state tensors)",
        )
    if not all(isinstance(x, torch.Tensor) for x in items):
        return None
    t0 = items[0]
    if any(t.dim() != t0.dim() or t.dtype != t0.dtype for t in items):
        return None  # the core groups by signature; a mixed list is not one layout
    items, alias_note, kept = _distinct(items)
    readings = candidates(items, h)
    if alias_note:
        for r in readings:
            r.candidate.note += alias_note
    if readings:
        try:
            deciding = _deciding(readings)
            if deciding:
                for r in readings:
                    r.candidate.decided_by = {k: v for k, v in r.candidate.decided_by.items() if k in deciding}
            det = resolve([r.candidate for r in readings], engine="vllm", deciding_hints=deciding)
        except AmbiguousLayoutError:
            raise
        if det is not None:
            det.layer_ids = kept  # the entries the layout's layers are (aliases dropped), or None: all
            return det
    if t0.dim() == 4 and t0.shape[1] == 1 and t0.shape[2] == 1:
        return Detection(
            format=None,
            excluded=f"Mamba state pages {tuple(t0.shape)} ([NB, 1, 1, C]: one state per block, vLLM 0.33 MambaSpec "
            "tokens_per_state=-1, engine_layouts.md §1.14): not KV",
        )
    if t0.dim() < 3:
        return Detection(format=None, excluded=f"tensor of shape {tuple(t0.shape)}: rank < 3 is not a paged vLLM KV cache")
    _explain_misfit(items, h, raw)
    return None
