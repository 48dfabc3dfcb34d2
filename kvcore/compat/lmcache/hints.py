"""LMCache's ``layout_hints`` and platform statement, handed to an engine's kvcore plugin
as the plugin reads them (the package docstring's "Layout hints")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvcore.compat.lmcache.contiguity import _memory_ordered_views
from kvcore.detection import tensors_in
from kvcore.errors import DetectionError

#: LMCache's ``torch_device_type`` (``lmcache/v1/platform``; LMCache 0.5.6's vLLM detector reads
#: it as a module global and its tests monkeypatch it): the platform the caller states. None
#: (the default): not stated -- the facade then reads vLLM caches as LMCache does, as the GPU
#: backends' layouts (LMCache has no other; its platform only picks a default ``kv_layout``),
#: unless the tensors sit on another accelerator. ``"cpu"`` (here, or ``torch_device_type`` in
#: ``layout_hints``) selects vLLM CPU's own layouts (kvcore-vllm's CPU rules).
torch_device_type: str | None = None


def _vllm_device(kv_caches: Any) -> str:
    """The platform LMCache's contract gives a vLLM cache nobody stated one for: the
    tensors' accelerator (ROCm builds: ``rocm``), else a GPU backend's (``cuda``)."""
    if torch_device_type is not None:
        return str(torch_device_type)
    leaves = tensors_in(kv_caches) if not isinstance(kv_caches, torch.Tensor) else [kv_caches]
    dev = leaves[0].device.type if leaves else "cpu"
    if dev == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return dev if dev in ("xpu", "hpu") else "cuda"


# -- hints -----------------------------------------------------------------------------------


def _engine(serving_engine: Any) -> str:
    """``"vllm"``, LMCache's ``EngineType.VLLM`` (by value or name) → ``"vllm"``."""
    if isinstance(serving_engine, str):
        return serving_engine.lower()
    for attr in ("value", "name"):
        v = getattr(serving_engine, attr, None)
        if isinstance(v, str):
            return v.lower()
    raise DetectionError(f"serving_engine must be an engine name such as 'vllm' or 'sglang', got {serving_engine!r}")


#: LMCache hint key -> the engine plugin's key (None: dropped); keys not listed pass unchanged.
_GENERIC_HINTS: dict[str, str | None] = {
    "kv_layout": "kv_cache_layout",
    "tokens_per_block": "block_size",
    "head_dim": "head_size",
    "torch_device_type": "device_type",
    "inference_engine_logical_block_size": None,
}
_ENGINE_HINTS: dict[str, dict[str, str | None]] = {
    "vllm": {**_GENERIC_HINTS, "kv_list_layout": None},
    "sglang": {
        "kv_layout": "layout",
        "tokens_per_block": "page_size",
        "head_dim": "head_size",
        "torch_device_type": None,
        "inference_engine_logical_block_size": None,
    },
    # kvcore-trtllm reads LMCache's names (KVCacheManager's vocabulary)
    **{e: {"inference_engine_logical_block_size": None} for e in ("trtllm", "tensorrt_llm", "tensorrt-llm")},
}


def _hints(layout_hints: Any, engine: str = "") -> dict[str, Any]:
    """LMCache ``LayoutHints`` (or kvcore keys) -> the hints of ``engine``'s plugin.

    Raises:
        DetectionError: not a dict; two spellings of one hint with different values.
    """
    if layout_hints is None:
        return {}
    if hasattr(layout_hints, "model_dump"):
        layout_hints = layout_hints.model_dump(exclude_none=True)
    if not isinstance(layout_hints, Mapping):
        raise DetectionError(f"layout_hints must be a dict (LMCache LayoutHints), got {type(layout_hints).__name__}")
    table = _ENGINE_HINTS.get(engine, _GENERIC_HINTS)
    out: dict[str, Any] = {}
    for k, v in layout_hints.items():
        if v is None:
            continue
        key = table.get(k, k)
        if key is None:
            continue
        if key != k and layout_hints.get(key) is not None:
            if layout_hints[key] != v:
                raise DetectionError(f"layout_hints gives {k}={v!r} and {key}={layout_hints[key]!r}; they name one fact, give one")
            continue
        out[key] = v
    return out


def _prepare(kv_caches: Any, engine: str, layout_hints: Any) -> tuple[Any, dict[str, Any]]:
    """Hand LMCache's inputs to the engine's plugin as the plugin reads them (see the
    module docstring's "Layout hints")."""
    hints = _hints(layout_hints, engine)
    raw = dict(layout_hints) if isinstance(layout_hints, Mapping) else {}
    if engine == "vllm" and hints.get("device_type") is None:
        # LMCache's adapters always state the platform (torch_device_type); LMCache reads the GPU backends' layouts
        hints["device_type"] = _vllm_device(kv_caches)
    if engine == "vllm" and hints.get("kv_cache_layout") is not None and hints.get("tensor_order") is None:
        # LMCache reads kv_layout as the memory order of the tensors after its contiguity recovery
        # (detection.py::detect_format: attempt_permute_to_contiguous_view, then the detector): the same here
        kv_caches = _memory_ordered_views(kv_caches)
        hints["tensor_order"] = "physical"
    if engine == "sglang" and raw.get("kv_list_layout") not in ("k_v", "unified") and "is_mla" not in hints:
        entries = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else kv_caches
        if (
            isinstance(entries, (list, tuple))
            and entries
            and all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == 1 for t in entries)
        ):
            # LMCache 0.5.6 (detectors/sglang.py) reads a flat list of (rows, 1, D) tensors as the MLA pool, and
            # tokens_per_block splits its rows into pages (NL_X_NB_BS_HS; without it the fused NL_X_NBBS_ONE_HS)
            hints["is_mla"] = True
    if engine in ("trtllm", "tensorrt_llm", "tensorrt-llm"):
        pool = kv_caches[0] if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == 1 else kv_caches
        if isinstance(pool, torch.Tensor) and pool.dim() == 6:
            kv_caches, hints = _trtllm_pool(pool, hints)
    return kv_caches, hints


def _trtllm_pool(pool: torch.Tensor, hints: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """LMCache's TensorRT-LLM form ``[NB, NL, 2, NH, BS, HS]`` -> the ``[NB, NL, 2, NH*BS*HS]``
    pool TensorRT-LLM allocates, and the hints that factor its last axis (LMCache
    ``detectors/trtllm.py`` takes either)."""
    nb, nl, kvf, nh, bs, hd = (int(x) for x in pool.shape)
    s = pool.stride()
    if s[5] != 1 or s[4] != hd or s[3] != bs * hd:
        raise DetectionError(
            f"trtllm: a 6-D pool view {tuple(pool.shape)} must be the pool [NB, NL, kv_factor, NH*BS*HS] viewed, with its last "
            f"three axes contiguous; got strides {tuple(s)}"
        )
    out = dict(hints)
    for key, v in (("num_kv_heads", nh), ("tokens_per_block", bs), ("head_dim", hd)):
        if out.get(key) is not None and out[key] != v:
            raise DetectionError(f"trtllm: hint {key}={out[key]!r} but the 6-D pool view {tuple(pool.shape)} has {v}")
        out[key] = v
    return pool.flatten(3), out
