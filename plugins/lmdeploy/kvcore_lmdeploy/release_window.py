"""Which LMDeploy releases may have written a cache: the version window per cache holder, and
the platform facts a release implies (:func:`_context`)."""

from __future__ import annotations

from kvcore import DetectionError, GeometryError
from kvcore_lmdeploy.checks import _FP8
from kvcore_lmdeploy.hints import LMDeployHints

_INF = (1 << 30, 0, 0)
#: which releases hand out each holder (CacheEngine.gpu_cache: all; the cross-layer tensors:
#: 0.6.4-0.11.0 full_gpu_cache, 0.11.1+ allocate_caches' slices; the uint8 pool: 0.11.1+)
_HOLDERS = {
    "gpu_cache": ((0, 6, 0), _INF),
    "cross-layer tensors": ((0, 6, 4), _INF),
    "memory pool": ((0, 11, 1), _INF),
}


def _vstr(v: tuple[int, ...]) -> str:
    return "any later release" if v >= _INF else ".".join(str(x) for x in v)


def _span(lo: tuple[int, ...], hi: tuple[int, ...]) -> str:
    if hi == (lo[0], lo[1], lo[2] + 1):
        return _vstr(lo)
    if hi >= _INF:
        return f"{_vstr(lo)}+"
    last = (hi[0], hi[1], hi[2] - 1) if hi[2] else (hi[0], hi[1] - 1, "x")
    return f"{_vstr(lo)}-{'.'.join(str(x) for x in last)}"


def _version(h: LMDeployHints) -> tuple[int, ...] | None:
    """``lmdeploy_version`` as a tuple (None when not given); an unreadable one is a DetectionError."""
    if h.lmdeploy_version is None:
        return None
    from kvcore_lmdeploy.allocation import version_tuple

    try:
        return version_tuple(h.lmdeploy_version)
    except GeometryError as e:
        raise DetectionError(f"lmdeploy: hint lmdeploy_version: {e}") from None


def _window(h: LMDeployHints, holder: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The releases ``[lo, hi)`` that may have allocated ``holder``: the holder's own span,
    or the one ``lmdeploy_version`` names (a version outside the span is a DetectionError)."""
    lo, hi = _HOLDERS[holder]
    v = _version(h)
    if v is None:
        return lo, hi
    if not lo <= v < hi:
        held = {
            "memory pool": "one uint8 tensor [NL, NB, bytes] is the memory pool of 0.11.1+ (CacheEngine.allocate_caches); "
            "before 0.11.1 CacheEngine.full_gpu_cache is the tuple of cross-layer tensors",
            "cross-layer tensors": "cross-layer tensors [NL, NB, *block_shape] are 0.6.4+'s (CacheEngine._allocate_cache; "
            "0.6.0-0.6.3 allocate separate per-layer tensors)",
            "gpu_cache": "kvcore-lmdeploy describes LMDeploy 0.6.0+",
        }[holder]
        raise DetectionError(f"lmdeploy: hint lmdeploy_version={h.lmdeploy_version!r}, but {held}")
    return v, (v[0], v[1], v[2] + 1)


def _kernel_blocks_possible(window: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """0.14.0 ``CacheEngine.allocate_caches`` splits manager blocks into kernel blocks."""
    return window[1] > (0, 14, 0)


def _context(h: LMDeployHints) -> None:
    """Hints that contradict each other, whatever the tensors.

    Raises:
        DetectionError: naming both hints (a release before 0.6.0; quant_policy 4/8 before
            0.6.2, 16/17/42 or a kernel_block_size other than block_size before 0.14.0; camb before 0.7; fp8 off
            CUDA; int quantisation on camb / maca; soc_version off Ascend).
    """
    v = _version(h)
    said = f"the hint lmdeploy_version={h.lmdeploy_version!r}"
    if v is not None:
        if v < (0, 6, 0):
            raise DetectionError(f"lmdeploy: {said}: releases before 0.6.0 are not described by kvcore-lmdeploy")
        if h.quant_policy in (4, 8) and v < (0, 6, 2):
            raise DetectionError(
                f"lmdeploy: quant_policy={h.quant_policy}, but {said}: the PyTorch engine quantises the KV cache from 0.6.2 "
                "(CacheEngine.allocate_gpu_cache)"
            )
        if h.quant_policy in (16, 17, 42) and v < (0, 14, 0):
            raise DetectionError(
                f"lmdeploy: quant_policy={h.quant_policy} is 0.14+, but {said} (messages.py::QuantPolicy: up to 0.12.3 "
                "quant_policy is 0, 4 or 8)"
            )
        if h.kernel_block_size is not None and v < (0, 14, 0) and h.kernel_block_size != h.block_size:
            # (kernel_block_size == block_size is 0.14's "no split" and says nothing else)
            raise DetectionError(
                f"lmdeploy: kernel_block_size={h.kernel_block_size}, but {said}: CacheConfig.kernel_block_size is 0.14.0's "
                "(before it the tensors hold block_size tokens per block; pass block_size)"
            )
        if h.device_type == "camb" and v < (0, 7, 0):
            raise DetectionError(f"lmdeploy: device_type='camb', but {said}: the Cambricon backend (dlinfer/camb) is 0.7+")
    if h.soc_version is not None and h.device_type not in (None, "ascend"):
        raise DetectionError(
            f"lmdeploy: soc_version={h.soc_version!r} names an Ascend chip, but device_type={h.device_type!r}: soc_version "
            "is for device_type='ascend'"
        )
    if h.quant_policy in _FP8 and h.device_type not in (None, "cuda"):
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} (fp8) with device_type={h.device_type!r}: LMDeploy 0.14.0 "
            "CacheEngine.__init__ asserts 'FP8 quantization is only supported on CUDA device'"
        )
    if h.quant_policy in (4, 8, 42) and h.device_type in ("camb", "maca"):
        raise DetectionError(
            f"lmdeploy: device_type={h.device_type!r} does not quantise the KV cache (quant_policy={h.quant_policy}): "
            "PytorchEngineConfig.__post_init__ allows KV quantisation on cuda and ascend only"
        )
