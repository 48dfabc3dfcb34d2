"""SGLang's fp8 cache names on ROCm: which float8 dtype a name stores per release and GPU, and
the hint variants detection tries where the tensors cannot tell."""

from __future__ import annotations

from typing import Any

import torch

from kvcore import DetectionError
from kvcore.dtypes import fp8_dtype, rocm_build
from kvcore_sglang.hints import SGLangHints

#: the first SGLang release whose ROCm fp8 KV dtype is ``fp8_kernel.fp8_dtype`` for both
#: ``fp8_e4m3`` and ``fp8_e5m2`` (0.5.6.post1 ``model_runner.py::ModelRunner.init_memory_pool``
#: still picks ``float8_e4m3fnuz`` / ``float8_e5m2fnuz``; 0.5.6.post2 and 0.5.7 use ``fp8_dtype``;
#: 0.5.23 moved the choice to ``mem_cache/kv_cache_dtype.py::configure_kv_cache_dtype``)
FP8_DTYPE_SINCE = (0, 5, 6, 2)


def _rocm_fp8(kind: str, unified: bool, gfx94: bool) -> torch.dtype:
    """SGLang's KV dtype for ``--kv-cache-dtype fp8_<kind>`` on ROCm.

    ``unified`` (0.5.6.post2+): ``fp8_dtype`` of ``layers/quantization/fp8_kernel.py``
    (0.5.23: ``kernels/ops/quantization/fp8_kernel.py``): ``float8_e4m3fnuz`` when
    ``is_fp8_fnuz()`` (``"gfx94" in gcnArchName`` of device 0), else ``float8_e4m3fn`` --
    for e5m2 too. Before: ``float8_e4m3fnuz`` / ``float8_e5m2fnuz`` on every ROCm GPU."""
    if unified:
        return torch.float8_e4m3fnuz if gfx94 else torch.float8_e4m3fn
    return fp8_dtype(kind, fnuz=True)


def _gfx94_of_tensors(kv_caches: Any) -> bool | None:
    """``"gfx94" in gcnArchName`` of the ROCm GPU holding the tensors (SGLang's
    ``is_fp8_fnuz``); None when they are not on a ROCm GPU of this process."""
    if not rocm_build(kv_caches):
        return None
    from kvcore.detection import tensors_in

    for t in tensors_in(kv_caches) if not isinstance(kv_caches, torch.Tensor) else [kv_caches]:
        if t.device.type == "cuda":
            try:
                return "gfx94" in torch.cuda.get_device_properties(t.device).gcnArchName
            except Exception:  # noqa: BLE001 - no arch name: unknown, not an error
                return None
    return None


def _on_gpu(kv_caches: Any) -> bool:
    from kvcore.detection import tensors_in

    ts = tensors_in(kv_caches) if not isinstance(kv_caches, torch.Tensor) else [kv_caches]
    return any(t.device.type == "cuda" for t in ts)


def _dtype_variants(h: SGLangHints, kv_caches: Any) -> tuple[list[tuple[SGLangHints, str]], list[str]]:
    """The hints to read the tensors with, one per dtype SGLang's ``fp8_e4m3`` /
    ``fp8_e5m2`` can name here, with a label, and the hints that would decide.

    Off ROCm the OCP type. On ROCm (``device_type='rocm'``, else the torch build of the
    process holding the tensors: SGLang's own ``is_hip()``) it follows ``sglang_version``
    (:data:`FP8_DTYPE_SINCE`) and the GPU (``gcn_arch``, else the ``gcnArchName`` of the
    ROCm GPU holding the tensors); for meta tensors (a description) the platform is open.
    Readings that differ in dtype are returned for the caller to report as an ambiguity.

    Raises:
        DetectionError: a ``gcn_arch`` hint that the GPU holding the tensors contradicts.
    """
    if not isinstance(h.dtype, str):
        return [(h, "")], []
    kind = h.dtype[len("fp8_") :]
    if h.device_type is not None:
        platform: bool | None = h.device_type == "rocm"
        if h.gcn_arch is not None and not platform:
            raise DetectionError(f"sglang: hint gcn_arch={h.gcn_arch!r} names a ROCm GPU, but device_type={h.device_type!r}")
    elif h.gcn_arch is not None:  # the caller says ROCm; a CUDA GPU of this (non-ROCm) process says otherwise
        if rocm_build(kv_caches) is False and _on_gpu(kv_caches):
            raise DetectionError(
                f"sglang: hint gcn_arch={h.gcn_arch!r} names a ROCm GPU, but the tensors are on a GPU of a CUDA (not ROCm) torch build"
            )
        platform = True
    else:
        platform = rocm_build(kv_caches)
    ocp = fp8_dtype(kind, fnuz=False)
    if platform is False:
        return [(h.model_copy(update={"dtype": ocp}), "")], []
    v = h.version()
    versions = [v >= FP8_DTYPE_SINCE] if v is not None else [False, True]
    seen = _gfx94_of_tensors(kv_caches)
    if h.gcn_arch is not None and seen is not None and seen != h.gcn_arch.startswith("gfx94"):
        raise DetectionError(
            f"sglang: hint gcn_arch={h.gcn_arch!r} but the tensors are on a ROCm GPU that is{'' if seen else ' not'} gfx94x"
        )
    gfx94 = h.gcn_arch.startswith("gfx94") if h.gcn_arch is not None else seen
    archs = [gfx94] if gfx94 is not None else [True, False]
    readings: dict[torch.dtype, list[str]] = {}
    if platform is None:
        readings.setdefault(ocp, []).append("CUDA and other non-ROCm platforms")
    for unified in versions:
        for g in archs:
            when = "SGLang >= 0.5.6.post2" if unified else "SGLang <= 0.5.6.post1"
            gpu = ("gfx94x" if g else "not gfx94x") if unified and gfx94 is None else None
            readings.setdefault(_rocm_fp8(kind, unified, g), []).append(f"ROCm, {when}" + (f", {gpu}" if gpu else ""))
    variants = [(h.model_copy(update={"dtype": d}), "; ".join(dict.fromkeys(labels))) for d, labels in readings.items()]
    if len(variants) == 1:
        return variants, []
    deciding = []
    if platform is None:
        deciding.append("device_type")
    if v is None and any(_rocm_fp8(kind, False, g) != _rocm_fp8(kind, True, g) for g in archs):
        deciding.append("sglang_version")
    if gfx94 is None and any(_rocm_fp8(kind, u, True) != _rocm_fp8(kind, u, False) for u in versions):
        deciding.append("gcn_arch")
    return variants, deciding
