"""Detection of LMDeploy's PyTorch-engine KV caches (``engine="lmdeploy"``).

Accepted inputs (``lmdeploy/pytorch/engine/cache_engine.py::CacheEngine``):

* ``gpu_cache`` / ``cpu_cache`` -- a list over layers of tuples ``(k, v)`` (unquantised,
  fp8, MLA) or ``(k, v, k_scales_zeros, v_scales_zeros)`` (int4 / int8 / TurboQuant, MLA
  int4 / int8), each tensor ``[NB, *block_shape]``. Every generation hands these out;
  0.6.0-0.6.3 as separate tensors, 0.6.4-0.11.0 as views of cross-layer tensors, 0.11.1+
  as views of one uint8 pool.
* ``full_gpu_cache`` of 0.6.4-0.11.0 -- the tuple of cross-layer tensors ``[NL, NB, *block_shape]``.
* ``full_gpu_cache`` of 0.11.1+ -- the uint8 pool ``[NL, NB, bytes]`` with the hints
  ``num_kv_heads``, ``head_dim`` (or ``k_head_dim`` + ``v_head_dim``; MLA: ``v_head_dim=0``),
  ``block_size`` (or ``kernel_block_size``) and ``dtype``; cut as
  ``CacheEngine.allocate_caches`` cuts it.
* a ``CacheEngine`` itself: its ``gpu_cache``, with its ``cache_config`` / ``model_config``
  as hints (hints given too must agree; heads per rank follow the release's
  ``_get_key_block_shape_impl``).

Block orders (the backend's ``get_k_block_shape``, per release -- ``SOURCES.md``): CUDA
``(BS, NH, HS)``; Cambricon ``(NH, BS, HS)`` (0.7+); Ascend ``(BS, NH, HS)``, but on Ascend
310P in 0.8.0-0.11.0 ``((NH*HS+15)//16, BS, 16)`` "NZ" blocks; MACA ``(NH, BS, HS)`` in
0.6.2-0.6.3, split-K (not described) in 0.6.4-0.9.x, ``(BS, NH, HS)`` from 0.10. Every
reading the tensors, the hints and the release allow is a candidate; two that move
different bytes raise :class:`kvcore.AmbiguousLayoutError` naming the hint that decides
(``device_type``, ``soc_version``, ``lmdeploy_version``, a size).

Normalised to (``kvcore_lmdeploy.formats``): per-layer ``(K, V)`` pairs of one head size
-> ``NL_X_TWO_X_NB_BS_NH_HS`` / ``NL_X_TWO_X_NB_NH_BS_HS``; Ascend 310P NZ -> ``K=NL_X_NB_NH_HSC_BS_HSE+V=...``;
MLA (V of head size 0) -> the K tensors, ``NL_X_NB_BS_ONE_HS`` (cross-layer ``NL_NB_BS_ONE_HS``);
quantised -> ``{role: per-layer list}`` under ``K=NL_X_NB_BS_NH_HS+V=...+KSZ=...+VSZ=...``
(TurboQuant: ``KN``, ``VN``; MLA: ``KV=...+KSZ=...+VSZ=...``); cross-layer tensors and the
pool -> ``{role: tensor}`` under the ``NL_NB_...`` names.

Blocks are the tensors' blocks: with LMDeploy 0.14's ``kernel_block_size`` below
``block_size`` those are kernel blocks (the detection note says so);
:mod:`kvcore_lmdeploy.blocks` maps the block manager's ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore import AmbiguousLayoutError, Candidate, DetectionError, GeometryError, memory_ordered, resolve
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.hints import LMDeployHints, parse_hints

__all__ = ["detect_lmdeploy", "GEOMETRY_HINTS", "carve_pool", "RULES", "MLA_FP8_HEAD_DIM"]

#: LMDeploy's names for the geometry kvcore compares between readings
GEOMETRY_HINTS = {"block_size": "block_size", "num_heads": "num_kv_heads", "head_size": "head_dim"}
_INT_DTYPES = (torch.uint8, torch.int8)  # cuda stores int4/int8 codes as uint8, ascend (<= 0.11.0) as int8 (CacheEngine.__init__)
_FP8 = {16: torch.float8_e4m3fn, 17: torch.float8_e5m2}
_FP8_DTYPES = tuple(_FP8.values())
#: 0.11.1+ ``cache_engine.py::MLA_FP8_HEAD_DIM`` (``use_mla_fp8_cache``: 512 fp8 + 4 fp32 scales + 64 bf16 rope)
MLA_FP8_HEAD_DIM = 656

# -- releases ------------------------------------------------------------------------------------

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


def detect_lmdeploy(kv_caches: Any, hints: Any) -> Any:
    """Recognise an LMDeploy KV cache (see the module docstring for the inputs).

    Returns:
        a :class:`kvcore.Detection` (through :func:`kvcore.resolve`).
    Raises:
        DetectionError: not an LMDeploy cache, a plane missing, planes disagreeing on
            blocks / tokens / heads, a hint the tensors or another hint contradict (the
            release named by ``lmdeploy_version`` included), or a layout this plugin does
            not claim (custom per-model caches, the 656-byte MLA fp8 records, MACA's split K,
            Ascend's flattened blocks, K/V of different head sizes).
        AmbiguousLayoutError: two readings move different bytes and nothing decides
            (``device_type``, ``soc_version``, ``lmdeploy_version``, a size hint).
    """
    raw = dict(hints or {})
    if _is_cache_engine(kv_caches):
        kv_caches, raw = _unwrap_engine(kv_caches, raw)
    h = parse_hints(raw)
    _context(h)
    if isinstance(kv_caches, torch.Tensor):
        return _pool(kv_caches, h)
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise DetectionError(
            f"lmdeploy: expected CacheEngine.gpu_cache (a list of per-layer tuples), the tuple of cross-layer tensors "
            f"(0.6.4-0.11.0 full_gpu_cache), the uint8 pool (0.11.1+), or a CacheEngine; got {type(kv_caches).__name__}"
        )
    if all(isinstance(e, torch.Tensor) for e in kv_caches):
        if len(kv_caches) == 1 and kv_caches[0].dim() == 3:
            return _pool(kv_caches[0], h)
        return _cross_layer(list(kv_caches), h)
    if all(isinstance(e, (list, tuple)) and e and all(isinstance(t, torch.Tensor) for t in e) for e in kv_caches):
        return _per_layer([tuple(e) for e in kv_caches], h)
    raise DetectionError(
        "lmdeploy: expected a list of per-layer tuples of tensors (CacheEngine.gpu_cache: (k, v) or (k, v, k_scales_zeros, "
        "v_scales_zeros) per layer) or a tuple of cross-layer tensors; got a mix of tensors and containers"
    )


# -- block orders per backend and release --------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One backend's block shape over a span of releases.

    Attributes:
        backend: ``PytorchEngineConfig.device_type``.
        order: ``NHD``, ``HND``, ``NZ``, or None for a shape this plugin does not describe.
        lo, hi: the releases ``[lo, hi)``.
        socs: the Ascend chips it holds for (``soc_family``), None for every chip.
        shape: the block shape, as LMDeploy writes it.
        source: file and function.
    """

    backend: str
    order: str | None
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    socs: frozenset[str] | None
    shape: str
    source: str


_OB = "lmdeploy/pytorch/backends/{}/op_backend.py::{}.get_k_block_shape"
#: every backend's block shape per release, read in the released wheels (SOURCES.md)
RULES: tuple[Rule, ...] = (
    Rule("cuda", "NHD", (0, 6, 0), _INF, None, "(block_size, num_heads, head_size)", _OB.format("cuda", "CudaOpsBackend")),
    Rule("camb", "HND", (0, 7, 0), _INF, None, "(num_heads, block_size, head_size)", _OB.format("dlinfer/camb", "CambOpsBackend")),
    Rule(
        "maca",
        "HND",
        (0, 6, 2),
        (0, 6, 4),
        None,
        "(num_heads, block_size, head_size) (0.6.2)",
        _OB.format("dlinfer/maca", "MacaOpsBackend"),
    ),
    Rule(
        "maca",
        None,
        (0, 6, 4),
        (0, 10, 0),
        None,
        "split K (num_heads, head_size // 16, block_size, 16), V (num_heads, block_size, head_size) (0.6.4-0.9.2)",
        _OB.format("dlinfer/maca", "MacaOpsBackend"),
    ),
    Rule(
        "maca", "NHD", (0, 10, 0), _INF, None, "(block_size, num_heads, head_size) (0.10.2+)", _OB.format("dlinfer/maca", "MacaOpsBackend")
    ),
    Rule(
        "ascend",
        None,
        (0, 6, 0),
        (0, 7, 0),
        None,
        "(block_size, num_heads * head_size) (0.6.0-0.6.5)",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
    Rule(
        "ascend",
        "NHD",
        (0, 7, 0),
        (0, 8, 0),
        None,
        "(block_size, num_heads, head_size) (0.7.3)",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
    Rule(
        "ascend",
        "NHD",
        (0, 8, 0),
        _INF,
        frozenset({"910"}),
        "(block_size, num_heads, head_size) on Ascend910*",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
    Rule(
        "ascend",
        "NZ",
        (0, 8, 0),
        (0, 11, 1),
        frozenset({"310P"}),
        "((num_heads * head_size + 15) // 16, block_size, 16) on Ascend310P* (0.8.0-0.11.0)",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
)


def _backends(ref: torch.Tensor, h: LMDeployHints, allowed: Sequence[str] | None, what: str, why: str) -> list[str]:
    """The backends (``device_type``) that may have allocated ``ref``: the hint, else the
    tensor's torch device (a ``cuda`` tensor is the CUDA backend's -- MACA's are ``cuda``
    tensors too, so MACA needs the hint --, ``npu`` Ascend's, ``mlu`` Cambricon's), else
    (a CPU copy, the host swap cache) every backend whose blocks a 4-D tensor can be.
    ``allowed`` narrows them (fp8: cuda; int quantisation: cuda, ascend); a hint or a
    device outside it is a DetectionError (``what`` / ``why`` word it)."""
    dev = ref.device.type
    implied = {"cuda": ("cuda", "maca"), "npu": ("ascend",), "mlu": ("camb",)}.get(dev)
    if h.device_type is not None:
        if implied is not None and h.device_type not in implied:
            raise DetectionError(
                f"lmdeploy: hint device_type={h.device_type!r} but the tensors are on a {dev} device, which LMDeploy's "
                f"{' / '.join(implied)} backend fills"
            )
        found = [h.device_type]
    elif h.soc_version is not None:
        if implied is not None and "ascend" not in implied:
            raise DetectionError(
                f"lmdeploy: hint soc_version={h.soc_version!r} names an Ascend chip, but the tensors are on a {dev} device"
            )
        found = ["ascend"]
    elif implied is not None:
        found = [implied[0]]
    else:
        found = ["cuda", "camb", "ascend"]
    if allowed is not None:
        bad = [b for b in found if b not in allowed]
        if bad and (h.device_type is not None or implied is not None or h.soc_version is not None):
            raise DetectionError(f"lmdeploy: {what}: device_type={bad[0]!r} does not {why}")
        found = [b for b in found if b in allowed]
    return found


def _readings(
    ref: torch.Tensor,
    h: LMDeployHints,
    window: tuple[tuple[int, ...], tuple[int, ...]],
    *,
    allowed: Sequence[str] | None = None,
    what: str = "this cache",
    why: str = "",
) -> list[tuple[str, dict[str, Any]]]:
    """``(order, decided_by)`` of every block order the possible backends allocate in the
    releases of ``window`` (and on the ``soc_version`` chip): :data:`RULES`. Orders of one
    backend that depend on the chip or the release carry ``soc_version`` /
    ``lmdeploy_version`` in ``decided_by``.

    Raises:
        DetectionError: a backend the hints name allocates nothing described in those
            releases (MACA's split K, Ascend's flattened blocks, a 310P after 0.11.0, ...).
    """
    soc = h.soc()
    out: list[tuple[str, dict[str, Any]]] = []
    missing: list[str] = []
    for b in _backends(ref, h, allowed, what, why):
        rules = [r for r in RULES if r.backend == b and r.lo < window[1] and window[0] < r.hi]
        on_chip = [r for r in rules if soc is None or r.socs is None or soc in r.socs]
        if not on_chip:
            if rules:
                missing.append(f"device_type={b!r}: LMDeploy {_span(*window)}'s {b} backend does not run soc_version={h.soc_version!r}")
            else:
                missing.append(f"device_type={b!r}: LMDeploy {_span(*window)} has no {b} backend")
            continue
        described = [r for r in on_chip if r.order is not None]
        if not described:
            r = on_chip[0]
            missing.append(
                f"device_type={b!r}: LMDeploy {_span(*window)} allocates {r.shape} blocks ({r.source}), not described by kvcore-lmdeploy"
            )
            continue
        orders = list(dict.fromkeys(r.order for r in described))
        for order in orders:
            dec: dict[str, Any] = {"device_type": b}
            if len(orders) > 1:
                mine = [r for r in described if r.order == order]
                if soc is None and any(r.socs is not None for r in described):
                    dec["soc_version"] = "Ascend310P" if order == "NZ" else "Ascend910"
                dec["lmdeploy_version"] = ", ".join(_span(max(r.lo, window[0]), min(r.hi, window[1])) for r in mine)
            if (order, dec) not in out:
                out.append((order, dec))
    if not out:
        raise DetectionError("lmdeploy: " + "; ".join(missing))
    return out


# -- the CacheEngine object -------------------------------------------------------------------


def _is_cache_engine(x: Any) -> bool:
    return not isinstance(x, (list, tuple, dict, torch.Tensor)) and hasattr(x, "gpu_cache") and hasattr(x, "cache_config")


def _heads_per_rank(mc: Any, world_size: int, version: tuple[int, ...] | None) -> int:
    """KV heads per rank as the release's ``CacheEngine._get_key_block_shape_impl`` computes
    them: 0.6.0-0.6.4 ``if local and not model_config.multi_query_attention: num_heads //=
    world_size`` (an MQA model -- Falcon-7B, DeepSeek-V2 in 0.6.x, ``multi_query_attention=True``
    -- keeps its one head on every rank); 0.6.5+ always divide (the model config builders
    replicate KV heads up to the TP size, ``update_num_kv_heads``). Without a version, a
    ``model_config`` that has the ``multi_query_attention`` field (0.6.0-0.6.4's
    ``ModelConfig``; later ones lack it) follows the 0.6.x rule.

    Raises:
        DetectionError: heads not divisible by the world size (LMDeploy asserts it).
    """
    heads = int(mc.num_key_value_heads)
    mqa = bool(getattr(mc, "multi_query_attention", False))
    if mqa and (version is None or version < (0, 6, 5)):
        return heads
    if heads % world_size:
        raise DetectionError(
            f"lmdeploy: the CacheEngine's model has {heads} KV heads and world_size {world_size}: "
            "CacheEngine._get_key_block_shape_impl asserts num_heads % world_size == 0"
        )
    return heads // world_size


def _unwrap_engine(engine: Any, given: dict) -> tuple[Any, dict]:
    """``CacheEngine.gpu_cache`` and the hints its configs state; a given hint that differs
    is a DetectionError (a hint never overrides the engine's own facts)."""
    cc, mc = engine.cache_config, getattr(engine, "model_config", None)
    facts: dict[str, Any] = {}
    qp = getattr(cc, "quant_policy", None)
    if qp is not None:
        facts["quant_policy"] = int(qp)
    if getattr(cc, "device_type", None) is not None:
        facts["device_type"] = cc.device_type
    kbs = getattr(cc, "kernel_block_size", None)
    if kbs is not None and int(kbs) > 0:  # 0.14 CacheConfig: -1 until __post_init__ sets block_size
        facts["kernel_block_size"] = int(kbs)
    if getattr(cc, "block_size", None) is not None:
        facts["block_size"] = int(cc.block_size)
    if mc is not None:
        for name in ("head_dim", "k_head_dim", "v_head_dim"):
            if getattr(mc, name, None) is not None:
                facts[name] = int(getattr(mc, name))
        if getattr(mc, "num_key_value_heads", None) is not None:
            version = _version(parse_hints({"lmdeploy_version": given.get("lmdeploy_version")}))
            facts["num_kv_heads"] = _heads_per_rank(mc, int(getattr(engine, "world_size", 1) or 1), version)
        if isinstance(getattr(mc, "dtype", None), torch.dtype):
            facts["dtype"] = mc.dtype
    for k, v in facts.items():
        g = given.get(k)
        if g is not None and repr(parse_hints({k: g}).model_dump()[k]) != repr(parse_hints({k: v}).model_dump()[k]):
            raise DetectionError(f"lmdeploy: hint {k}={g!r} contradicts the CacheEngine's own {k}={v!r}")
    return engine.gpu_cache, {**facts, **{k: v for k, v in given.items() if v is not None}}


# -- shared checks ------------------------------------------------------------------------------


def _same(ts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """The first tensor, after checking every layer's has its shape, strides, dtype and device."""
    ref = ts[0]
    for i, t in enumerate(ts):
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype or t.device != ref.device or t.stride() != ref.stride():
            raise DetectionError(
                f"lmdeploy: {what} of layer {i} is {tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}, layer 0's "
                f"{tuple(ref.shape)} {ref.dtype} strides {ref.stride()} on {ref.device}: CacheEngine allocates every layer alike"
            )
    return ref


def _bs_nh(shape: Sequence[int], order: str) -> tuple[int, int]:
    """(block_size, num_heads) of a block shape ``(BS, NH, HS)`` / ``(NH, BS, HS)``."""
    a, b = int(shape[0]), int(shape[1])
    return (a, b) if order == "NHD" else (b, a)


def _fits(h: LMDeployHints, order: str, bs: int, nh: int | None, reasons: list[str], what: str, kernel_blocks: bool = True) -> bool:
    if not h.block_fits(bs, kernel_blocks):
        said = f"kernel_block_size={h.kernel_block_size}" if h.kernel_block_size is not None else f"block_size={h.block_size}"
        why = "" if kernel_blocks else f" (lmdeploy_version={h.lmdeploy_version!r} has no kernel blocks: those are 0.14.0's)"
        reasons.append(f"{what} read {order}: {bs} tokens per block, but {said}{why}")
        return False
    if nh is not None and h.num_kv_heads is not None and h.num_kv_heads != nh:
        reasons.append(f"{what} read {order}: {nh} heads, but num_kv_heads={h.num_kv_heads}")
        return False
    return True


def _block_note(h: LMDeployHints, bs: int) -> str:
    """What a block id means when the tensors hold 0.14 kernel blocks."""
    if h.block_size is not None and h.block_size != bs:
        r = h.block_size // bs
        return (
            f"; blocks are {bs}-token KERNEL blocks of LMDeploy's {h.block_size}-token blocks: block ids (gather_blocks, "
            f"num_blocks) count kernel blocks, the block manager's block m is kernel blocks m*{r}..m*{r}+{r - 1} "
            "(0.14.0 inputs_maker.py::_map_to_kernel_block_offsets; kvcore_lmdeploy.blocks takes the manager's ids)"
        )
    if h.kernel_block_size is not None:
        return f"; blocks are {bs}-token kernel blocks (kernel_block_size): block ids count kernel blocks"
    return ""


def _check_memory_order(ts: Sequence[torch.Tensor], what: str) -> None:
    for t in ts:
        if not memory_ordered(t):
            raise DetectionError(
                f"lmdeploy: {what} {tuple(t.shape)} has strides {tuple(t.stride())}, whose memory order is not its axis order; "
                "LMDeploy's CacheEngine allocates block tensors in memory order (torch.empty, or slices of its pool): pass them "
                "as the engine holds them"
            )


def _value_dtype_check(k: torch.Tensor, h: LMDeployHints, what: str, window: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    qp = h.quant_policy
    if qp in _FP8 and k.dtype != _FP8[qp]:
        raise DetectionError(f"lmdeploy: quant_policy={qp} stores K/V as {_FP8[qp]}, but {what} is {k.dtype}")
    if qp == 0 and k.dtype in _FP8_DTYPES:
        raise DetectionError(f"lmdeploy: quant_policy=0 stores K/V in the model dtype, but {what} is {k.dtype} (fp8 is 16 / 17)")
    if qp in (0, 16, 17, None) and k.dtype in _INT_DTYPES:
        raise DetectionError(
            f"lmdeploy: {what} is {k.dtype}: an int4/int8/TurboQuant cache, but its scale/zero tensors are missing "
            "(CacheEngine gives each layer (k, v, k_scales_zeros, v_scales_zeros)); pass the whole per-layer tuples"
        )
    if qp in (0, None) and h.dtype is not None and k.dtype not in (h.dtype, *_FP8_DTYPES):
        raise DetectionError(f"lmdeploy: hint dtype={h.dtype} but {what} is {k.dtype} (an unquantised cache holds the model dtype)")
    if k.dtype in _FP8_DTYPES and window[1] <= (0, 14, 0):
        raise DetectionError(
            f"lmdeploy: {what} is {k.dtype}, an fp8 KV cache (quant_policy 16 / 17), which is 0.14.0's, but the hint "
            f"lmdeploy_version={h.lmdeploy_version!r}"
        )


def _head_check(h: LMDeployHints, kw: int, vw: int, policy: int | None) -> None:
    """The stored widths against ``head_dim`` / ``k_head_dim`` / ``v_head_dim``."""
    kd, vd = h.k_dim(), h.v_dim()
    div_k = {4: 2, 42: 2}.get(policy or 0, 1)
    div_v = {4: 2, 42: 4}.get(policy or 0, 1)
    for name, want, got, div in (("K", kd, kw, div_k), ("V", vd, vw, div_v)):
        if want is None:
            continue
        if want % div or want // div != got:
            pack = f" (quant_policy {policy} stores head_dim/{div} bytes)" if div > 1 else ""
            raise DetectionError(f"lmdeploy: {name} holds {got} elements per head, but the head_dim hints say {want}{pack}")


def _mla_head_check(h: LMDeployHints, width: int, policy: int | None) -> None:
    """An MLA latent's stored width against ``k_head_dim`` / ``head_dim`` (int4 stores half),
    and ``v_head_dim``: DeepSeek's ``ModelConfig`` has ``v_head_dim = 0`` (V is not stored),
    so a ``v_head_dim`` given must be 0; ``head_dim`` / ``k_head_dim`` are the latent's
    ``kv_lora_rank + qk_rope_head_dim`` (``configurations/deepseek_v2.py``)."""
    if h.v_head_dim not in (None, 0):
        raise DetectionError(f"lmdeploy: V has head size 0 (MLA) but the hints say v_head_dim={h.v_head_dim}")
    kd = h.k_dim()
    if kd is None:
        return
    div = 2 if policy == 4 else 1
    if kd % div or kd // div != width:
        pack = f" (quant_policy {policy} stores head_dim/{div} bytes)" if div > 1 else ""
        raise DetectionError(f"lmdeploy: the MLA latent (K) holds {width} elements per head, but the head_dim hints say {kd}{pack}")


def _given(h: LMDeployHints) -> dict:
    return {k: v for k, v in h.model_dump().items() if v is not None}


def _resolve(cands: list[Candidate], h: LMDeployHints) -> Any:
    return resolve(cands, engine="lmdeploy", hints=_given(h), geometry_hints=GEOMETRY_HINTS, required=True)


# -- per-layer tuples (CacheEngine.gpu_cache) -----------------------------------------------


def _per_layer(entries: list[tuple], h: LMDeployHints) -> Any:
    window = _window(h, "gpu_cache")
    n = {len(e) for e in entries}
    if len(n) != 1:
        raise DetectionError(f"lmdeploy: the per-layer tuples have different lengths {sorted(n)}; CacheEngine gives every layer alike")
    n = n.pop()
    cols = [[e[i] for e in entries] for i in range(n)]
    refs = [_same(c, f"tensor {i} of the per-layer tuple") for i, c in enumerate(cols)]
    if any(r.dim() != 4 for r in refs):
        raise DetectionError(
            f"lmdeploy: per-layer cache tensors are [num_blocks, *block_shape] (4-D); got {[tuple(r.shape) for r in refs]} "
            "(MACA's split-K blocks of 0.6.4-0.9.x and Ascend's (block_size, num_heads * head_size) blocks of 0.6.x are not "
            "described by this plugin)"
        )
    _check_memory_order(refs, "a per-layer cache tensor")
    k, v = refs[0], refs[1] if n > 1 else None
    if n == 1:
        raise DetectionError("lmdeploy: each layer holds one tensor; CacheEngine gives (k, v[, k_scales_zeros, v_scales_zeros])")
    if n == 2:
        return _plain(cols[0], cols[1], k, v, h, cross=False, window=window)
    if n == 3:
        raise DetectionError(
            "lmdeploy: each layer holds 3 tensors: a quantised cache's plane is missing (CacheEngine gives (k, v, "
            "k_scales_zeros, v_scales_zeros) per layer for quant_policy 4 / 8 / 42)"
        )
    if n == 4 and refs[2].dim() == 4 and refs[0].dtype in _INT_DTYPES:
        return _quant(dict(zip(("K", "V", "S1", "S2"), cols)), refs, h, cross=False, window=window)
    raise DetectionError(
        f"lmdeploy: each layer holds {n} tensors {[(tuple(r.shape), str(r.dtype)) for r in refs]}; beyond (k, v) and the "
        "scale/zero tensors these are ModelConfig.cache_shapes (custom per-model caches, e.g. DeepSeek-V3.2's indexer), "
        "which kvcore-lmdeploy does not describe"
    )


_FP8_WHY = "run an fp8 KV cache: LMDeploy 0.14.0 CacheEngine.__init__ asserts 'FP8 quantization is only supported on CUDA device'"
_INT_WHY = "quantise the KV cache (PytorchEngineConfig.__post_init__: cuda and ascend only)"


def _plain(ks: list, vs: list, k: torch.Tensor, v: torch.Tensor, h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """Unquantised / fp8 K and V (and MLA: V of head size 0)."""
    lead = 1 if cross else 0  # the NL axis of a cross-layer tensor
    what = "K (cross-layer)" if cross else "K"
    if h.quant_policy in (4, 8, 42):
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} keeps per-token-head scale/zero tensors beside K and V, but only "
            f"{'K, V' if cross else '(k, v) per layer'} were passed: a plane is missing (pass all four)"
        )
    if int(v.shape[-1]) == 0:  # MLA: ModelConfig.v_head_dim == 0 (deepseek_v2.py)
        return _mla(ks, k, v, h, cross=cross, window=window)
    _value_dtype_check(k, h, what, window)
    if v.dtype != k.dtype or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise DetectionError(
            f"lmdeploy: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} disagree beyond the head size; "
            "CacheEngine allocates them with one dtype, block count, block size and head count"
        )
    if int(v.shape[-1]) != int(k.shape[-1]):
        raise DetectionError(
            f"lmdeploy: K head size {k.shape[-1]} and V head size {v.shape[-1]} differ (k_head_dim != v_head_dim): not "
            "described by kvcore-lmdeploy (no released model allocates it outside MLA)"
        )
    fp8 = k.dtype in _FP8_DTYPES or h.quant_policy in _FP8
    readings = _readings(k, h, window, allowed=("cuda",) if fp8 else None, what=f"{what} is {k.dtype}", why=_FP8_WHY)
    kernel = _kernel_blocks_possible(window)
    cands: list[Candidate] = []
    pseudo: list[Candidate] = []
    reasons: list[str] = []
    seen: set[str] = set()
    for order, dec in readings:
        if order == "NZ" or order in seen:
            continue  # one backend's NHD (or HND) moves the same bytes as another's: the first one stands for both
        seen.add(order)
        bs, nh = _bs_nh(k.shape[lead + 1 : lead + 3], order)
        if not _fits(h, order, bs, nh, reasons, "K, V", kernel):
            continue
        try:
            _head_check(h, int(k.shape[-1]), int(v.shape[-1]), h.quant_policy)
        except DetectionError as e:
            reasons.append(f"K, V read {order}: {str(e).removeprefix('lmdeploy: ')}")
            continue
        dev = dec["device_type"]
        if cross:
            name = F.X_NHD if order == "NHD" else F.X_HND
            kv: Any = {"K": ks[0], "V": vs[0]}
        else:
            name = F.NHD if order == "NHD" else F.HND
            kv = [(a, b) for a, b in zip(ks, vs)]
        cands.append(
            Candidate(
                name,
                kv,
                note=f"LMDeploy {'cross-layer K, V' if cross else 'gpu_cache (k, v) per layer'}, {order} blocks ({dev} backend)"
                + _block_note(h, bs),
                decided_by=dec,
                label=f"{order} ({dev})",
            )
        )
    for order, dec in readings:
        if order == "NZ":
            got = _nz_candidate(ks, vs, k, h, cross=cross, dec=dec, kernel=kernel, reasons=reasons)
            if got is not None:
                cands.append(got[0])
                if got[1]:
                    pseudo.append(got[0])
    if not cands:
        raise DetectionError("lmdeploy: no block order fits the hints: " + "; ".join(reasons))
    if all(any(c is p for p in pseudo) for c in cands):
        raise DetectionError(f"lmdeploy: {cands[0].note}" + ("; other readings: " + "; ".join(reasons) if reasons else ""))
    return _resolve(cands, h)


# -- Ascend 310P NZ blocks (0.8.0-0.11.0) ----------------------------------------------------------


def _nz_heads(h: LMDeployHints, chunks: int, reasons: list[str]) -> tuple[int, int] | str | None:
    """``(num_heads, head_size)`` of NZ blocks of ``chunks`` 16-element chunks per token
    (``(num_heads * head_size + 15) // 16``), from ``num_kv_heads`` / ``head_dim``;
    ``"unknown"`` without them, ``"undescribed"`` for a head size that is not a multiple of
    16 (its chunks straddle heads: no per-head address pattern), None when the hints do not
    fit (the reason appended)."""
    nh, hd = h.num_kv_heads, h.k_dim()
    what = "K, V read as Ascend 310P NZ blocks"
    if h.v_dim() is not None and hd is not None and h.v_dim() != hd:
        reasons.append(f"{what}: k_head_dim {hd} != v_head_dim {h.v_dim()}, but K and V blocks have one shape")
        return None
    if nh is None and hd is None:
        return "unknown"
    if hd is not None and hd % 16:
        if nh is not None and (nh * hd + 15) // 16 != chunks:
            reasons.append(f"{what}: {nh} heads of {hd} make {(nh * hd + 15) // 16} chunks of 16, the tensors hold {chunks}")
            return None
        return "undescribed"
    if hd is None:
        if chunks % nh:
            reasons.append(f"{what}: {chunks} chunks of 16 elements are not num_kv_heads={nh} heads of a multiple of 16")
            return None
        hd = 16 * chunks // nh
    elif nh is None:
        if chunks % (hd // 16):
            reasons.append(f"{what}: {chunks} chunks of 16 elements are not heads of head_dim={hd}")
            return None
        nh = chunks // (hd // 16)
    if (nh * hd + 15) // 16 != chunks:
        reasons.append(f"{what}: {nh} heads of {hd} make {(nh * hd + 15) // 16} chunks of 16, the tensors hold {chunks}")
        return None
    return nh, hd


def _nz_candidate(
    ks: list, vs: list, k: torch.Tensor, h: LMDeployHints, *, cross: bool, dec: dict, kernel: bool, reasons: list[str]
) -> tuple[Candidate, bool] | None:
    """The Ascend 310P reading of 4-D blocks ``[NB, C, BS, 16]``: 0.8.0-0.11.0
    ``AscendOpsBackend.get_k_block_shape`` returns ``((num_heads * head_size + 15) // 16,
    block_size, 16)`` on ``SocVersion.is_Ascend310P()``; the element order is FRACTAL_NZ
    (``ascend/utils.py::nd_to_nz_spec``: a block's ``[BS, NH*HS]`` rows reshaped to
    ``(BS, NH*HS/16, 16)`` and permuted to ``(NH*HS/16, BS, 16)``), so element ``d`` of head
    ``h`` of token ``t`` is ``[(h*HS + d) // 16, t, (h*HS + d) % 16]``. With ``HS`` a multiple
    of 16 that is ``[NB, NH, HS/16, BS, 16]``: the chunk axis unflattened into (head,
    chunk). Returns ``(candidate, placeholder)``: a placeholder (one pseudo-head of all the
    chunks) stands for a reading whose heads the hints do not give, or that is not
    described; it is never an answer (see :func:`_plain`)."""
    lead = 1 if cross else 0
    what = "K, V read as Ascend 310P NZ blocks"
    if int(k.shape[-1]) != 16:
        reasons.append(f"{what}: NZ blocks end in 16 elements, these in {int(k.shape[-1])}")
        return None
    chunks, bs = int(k.shape[lead + 1]), int(k.shape[lead + 2])
    if not _fits(h, "NZ", bs, None, reasons, "K, V", kernel):
        return None
    heads = _nz_heads(h, chunks, reasons)
    if heads is None:
        return None
    fmt = F.X_NZ if cross else F.NZ
    if isinstance(heads, str):
        nh, per_head = 1, chunks
        if heads == "unknown":
            label = "Ascend 310P NZ, heads unknown"
            note = (
                f"these tensors read as Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0, [NB, {chunks}, {bs}, 16]: "
                f"{chunks} chunks of 16 elements per token), whose heads the tensors do not show: pass num_kv_heads or head_dim"
            )
        else:
            label = "Ascend 310P NZ, not described"
            note = (
                f"these tensors read as Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0) of head_dim={h.k_dim()}, not a multiple "
                "of 16: the 16-element chunks straddle heads, which kvcore-lmdeploy does not describe"
            )
        placeholder = True
    else:
        nh, hd = heads
        per_head = hd // 16
        label = "Ascend 310P NZ"
        note = (
            f"LMDeploy Ascend 310P NZ blocks ({'cross-layer K, V' if cross else 'gpu_cache (k, v) per layer'}): "
            f"[NB, {chunks}, {bs}, 16] read as {nh} heads of {hd}" + _block_note(h, bs)
        )
        placeholder = False
    if cross:
        kv: Any = {"K": ks[0].unflatten(2, (nh, per_head)), "V": vs[0].unflatten(2, (nh, per_head))}
    else:
        kv = {"K": [t.unflatten(1, (nh, per_head)) for t in ks], "V": [t.unflatten(1, (nh, per_head)) for t in vs]}
    return Candidate(fmt, kv, note=note, decided_by=dec, label=label), placeholder


# -- MLA (V of head size 0) --------------------------------------------------------------------------


def _mla_block(k: torch.Tensor, h: LMDeployHints, window: tuple, lead: int, *, allowed: Sequence[str] | None, what: str, why: str) -> None:
    """An MLA latent is ``[.., BS, 1, D]``: NHD blocks of one head (CUDA; DeepSeek's
    ``num_key_value_heads = 1``, per rank after ``update_num_kv_heads``)."""
    orders = [o for o, _ in _readings(k, h, window, allowed=allowed, what=what, why=why)]
    if int(k.shape[lead + 2]) != 1 or h.device_type == "camb" or "NHD" not in orders:
        raise DetectionError(
            f"lmdeploy: a V of head size 0 is MLA, whose K is [NB, BS, 1, D] (an NHD block of one head); got K {tuple(k.shape)}"
            + ("" if "NHD" in orders else f" from a backend that allocates {orders} blocks")
        )


def _mla(ks: list, k: torch.Tensor, v: torch.Tensor, h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """DeepSeek MLA: ``ModelConfig`` ``k_head_dim = kv_lora_rank + qk_rope_head_dim``,
    ``v_head_dim = 0``, one KV head (``configurations/deepseek_v2.py::DeepseekV2ModelConfigBuilder.build``):
    K ``[NB, BS, 1, D]`` holds the latents, V ``[NB, BS, 1, 0]`` nothing (the model reads V
    as ``k_cache[..., :kv_lora_rank]``, ``models/deepseek_v2.py``). fp8 (quant_policy 16 /
    17, 0.14) stores the latents as fp8 of the same width; 0.11.1+ ``use_mla_fp8_cache``
    records (``MLA_FP8_HEAD_DIM`` = 656 bytes of fp8 values, fp32 scales and bf16 rope) are
    not described."""
    lead = 1 if cross else 0
    if v.dtype != k.dtype or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise DetectionError(
            f"lmdeploy: MLA K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} disagree beyond the head size; "
            "CacheEngine allocates them alike (V of head size 0)"
        )
    width = int(k.shape[-1])
    if k.dtype == torch.float8_e4m3fn and width == MLA_FP8_HEAD_DIM and h.k_dim() != MLA_FP8_HEAD_DIM:
        raise DetectionError(
            "lmdeploy: an fp8 MLA cache of 656-byte records (0.11+ use_mla_fp8_cache: 512 fp8 values, 4 fp32 scales, 64 bf16 "
            "rope -- cache_engine.py::MLA_FP8_HEAD_DIM) is not described by kvcore-lmdeploy"
        )
    _value_dtype_check(k, h, "the MLA latent (K)", window)
    fp8 = k.dtype in _FP8_DTYPES
    _mla_block(k, h, window, lead, allowed=("cuda",) if fp8 else None, what=f"an MLA latent of {k.dtype}", why=_FP8_WHY)
    _mla_head_check(h, width, h.quant_policy)
    reasons: list[str] = []
    bs = int(k.shape[lead + 1])
    if not _fits(h, "NHD", bs, 1, reasons, "MLA K", _kernel_blocks_possible(window)):
        raise DetectionError("lmdeploy: " + "; ".join(reasons))
    fmt, kv = (F.X_MLA, ks[0]) if cross else (F.MLA, list(ks))
    where = "cross-layer K" if cross else "gpu_cache K per layer"
    c = Candidate(fmt, kv, note=f"LMDeploy MLA: K latents ({where}; V is not stored)" + _block_note(h, bs), label="MLA")
    return _resolve([c], h)


def _side_checks(s1: torch.Tensor, s2: torch.Tensor, h: LMDeployHints) -> tuple[int, int]:
    w1, w2 = int(s1.shape[-1]), int(s2.shape[-1])
    if (w1, w2) not in ((2, 2), (2, 1)):
        raise DetectionError(
            f"lmdeploy: the side tensors end in {w1} and {w2} elements; int4/int8 keep (scale, zero) pairs (2, 2), TurboQuant "
            "(mse_norm, qjl_norm) for K and one norm for V (2, 1) -- CacheEngine.get_quant_cache_descs"
        )
    if s1.dtype != s2.dtype or not s1.dtype.is_floating_point or s1.element_size() < 2:
        raise DetectionError(
            f"lmdeploy: the scale/zero tensors are {s1.dtype} and {s2.dtype}; CacheEngine keeps both in the model dtype "
            "(bfloat16, float16 or float32)"
        )
    if h.dtype is not None and s1.dtype != h.dtype:
        raise DetectionError(f"lmdeploy: hint dtype={h.dtype} but the scale/zero tensors are {s1.dtype} (they hold the model dtype)")
    if h.quant_policy in (0, 16, 17):
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} keeps no scale/zero tensors, but each layer holds four tensors with "
            f"uint8 K/V; with quant_policy {h.quant_policy} the extra tensors would be ModelConfig.cache_shapes (custom "
            "caches), which kvcore-lmdeploy does not describe"
        )
    return w1, w2


def _int_backends_check(k: torch.Tensor, h: LMDeployHints) -> None:
    """CUDA stores int4 / int8 / TurboQuant codes as uint8 (``CacheEngine.__init__``; 0.11.1+
    ``get_k_cache_desc``): int8 codes are Ascend's (<= 0.11.0)."""
    if k.dtype == torch.int8 and (h.device_type == "cuda" or (h.device_type is None and k.device.type == "cuda")):
        raise DetectionError(
            "lmdeploy: the codes are int8, but LMDeploy's CUDA backend stores them as uint8 (CacheEngine.__init__: int8 is "
            "Ascend's, up to 0.11.0)"
        )


def _quant_readings(k: torch.Tensor, h: LMDeployHints, window: tuple) -> list[tuple[str, dict]]:
    """Block orders of a quantised cache: CUDA (uint8) or Ascend (int8 up to 0.11.0, uint8
    in the 0.11.1+ pool descs); a CPU copy's dtype names which. Ascend 310P NZ blocks are
    possible for int8 codes only (0.8.0-0.11.0, where Ascend stores int8)."""
    _int_backends_check(k, h)
    found = _readings(k, h, window, allowed=("cuda", "ascend"), what="a quantised cache", why=_INT_WHY)
    if k.dtype == torch.int8:
        found = [(o, d) for o, d in found if d["device_type"] != "cuda"] or found
    else:
        found = [(o, d) for o, d in found if o != "NZ"]
    return found


def _quant(planes: dict[str, list], refs: list[torch.Tensor], h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """int4 / int8 ((scale, zero) pairs) or TurboQuant (norms) values and side planes."""
    k, v, s1, s2 = refs
    lead = 1 if cross else 0
    if v.dtype != k.dtype:
        raise DetectionError(f"lmdeploy: quantised K is {k.dtype} but V is {v.dtype}; CacheEngine stores both as uint8 (ascend: int8)")
    w1, w2 = _side_checks(s1, s2, h)
    if window[1] <= (0, 6, 2):
        raise DetectionError(
            f"lmdeploy: a quantised cache (codes with scale/zero tensors), but the hint lmdeploy_version={h.lmdeploy_version!r}: "
            "the PyTorch engine quantises the KV cache from 0.6.2"
        )
    if int(v.shape[-1]) == 0:
        return _mla_quant(planes, refs, h, cross=cross, window=window)
    turbo = (w1, w2) == (2, 1)
    if h.quant_policy is not None and (h.quant_policy == 42) != turbo:
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} but the side tensors end in ({w1}, {w2}) elements "
            f"({'TurboQuant' if turbo else 'int4/int8'} keeps that)"
        )
    if turbo and window[1] <= (0, 14, 0):
        raise DetectionError(
            f"lmdeploy: TurboQuant side tensors (norms ending in 2 and 1 elements), but the hint lmdeploy_version="
            f"{h.lmdeploy_version!r}: TurboQuant (quant_policy 42) is 0.14.0's"
        )
    # every plane addresses the same blocks, tokens and heads (the block shape's first two axes)
    shapes = {r: tuple(int(x) for x in t.shape[: lead + 3]) for r, t in zip(("K", "V", "S1", "S2"), refs)}
    roles = F.TURBO_ROLES if turbo else F.INT_ROLES
    named = dict(zip(("K", "V", "S1", "S2"), roles))
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{named[r]} {s}" for r, s in shapes.items())
        raise DetectionError(
            f"lmdeploy: the planes disagree on {'layers, ' if cross else ''}blocks, block size or heads ({listed}); "
            "CacheEngine allocates the scale/zero tensors as block_shape[:-1] + [2] beside K and V"
        )
    readings = _quant_readings(k, h, window)
    if any(o == "NZ" for o, _ in readings) and int(k.shape[-1]) == 16:
        others = [F.X_TURBO if turbo else F.X_QUANT] if cross else [F.TURBO if turbo else F.QUANT]
        if all(o == "NZ" for o, _ in readings):
            raise DetectionError(
                "lmdeploy: a quantised cache in Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0: codes ((NH*HS+15)//16, BS, 16) "
                "with scale/zero tensors ((NH*HS+15)//16, BS, 2)) is not described by kvcore-lmdeploy"
            )
        raise AmbiguousLayoutError(
            f"lmdeploy: these int8 codes [.., {k.shape[lead + 1]}, {k.shape[lead + 2]}, 16] fit Ascend 910 blocks (block_size "
            f"{k.shape[lead + 1]}, {k.shape[lead + 2]} heads of 16) and Ascend 310P NZ blocks (LMDeploy 0.8.0-0.11.0: "
            "((NH*HS+15)//16, BS, 16), not described by kvcore-lmdeploy; 0.7.x allocates (BS, NH, HS) on every chip); pass "
            + " or ".join(k for k in ("soc_version (e.g. 'Ascend910B3')", "lmdeploy_version") if getattr(h, k.split()[0]) is None)
            + " to decide",
            candidates=others + ["Ascend 310P NZ quantised blocks (not described)"],
            hints=[k for k in ("soc_version", "lmdeploy_version") if getattr(h, k) is None],
        )
    policy = h.quant_policy
    if policy is None and turbo:
        policy = 42
    if policy is not None:
        _head_check(h, int(k.shape[-1]), int(v.shape[-1]), policy)
    elif h.k_dim() is not None:
        # int4 or int8: the tensors move the same bytes either way; head_dim (HS vs 2 * stored bytes) names which
        try:
            _head_check(h, int(k.shape[-1]), int(v.shape[-1]), 8)
            policy = 8
        except DetectionError:
            _head_check(h, int(k.shape[-1]), int(v.shape[-1]), 4)
            policy = 4
    if not turbo and int(k.shape[-1]) != int(v.shape[-1]):
        raise DetectionError(f"lmdeploy: int4/int8 K holds {k.shape[-1]} bytes per head but V {v.shape[-1]}; they pack alike")
    if turbo and int(k.shape[-1]) != 2 * int(v.shape[-1]):
        raise DetectionError(
            f"lmdeploy: TurboQuant packs K in head_dim/2 bytes and V in head_dim/4, but K holds {k.shape[-1]} and V {v.shape[-1]}"
        )
    bs, nh = _bs_nh(k.shape[lead + 1 : lead + 3], "NHD")
    reasons: list[str] = []
    if not _fits(h, "NHD", bs, nh, reasons, "the quantised planes", _kernel_blocks_possible(window)):
        raise DetectionError("lmdeploy: " + "; ".join(reasons))
    name = (F.X_TURBO if turbo else F.X_QUANT) if cross else (F.TURBO if turbo else F.QUANT)
    kv = {named[r]: (cols[0] if cross else list(cols)) for r, cols in planes.items()}
    what = "TurboQuant" if turbo else {4: "int4", 8: "int8"}.get(policy or 0, "int4/int8")
    c = Candidate(
        name,
        kv,
        note=f"LMDeploy {what} KV with per-token-head side planes ({'cross-layer' if cross else 'per layer'})" + _block_note(h, bs),
    )
    return _resolve([c], h)


def _mla_quant(planes: dict[str, list], refs: list[torch.Tensor], h: LMDeployHints, *, cross: bool, window: tuple) -> Any:
    """DeepSeek MLA with int8 / int4 (quant_policy 8 / 4, 0.6.2+): CacheEngine allocates the
    latent codes K ``[.., BS, 1, D]`` (int4: ``D/2`` bytes), an empty V ``[.., BS, 1, 0]`` and
    both ``(*block_shape[:-1], 2)`` scale/zero tensors. ``models/deepseek_v2.py::
    DeepseekV2Attention.forward`` passes ``k_cache = past_key_value[0]``, ``v_cache =
    past_key_value[0][..., :kv_lora_rank]`` and ``k_scales_zeros`` / ``v_scales_zeros`` =
    ``past_key_value[2]`` / ``[3]``; ``fill_kv_cache`` writes K codes and ``k_scales_zeros``
    (``BLOCK_DV = 0``: V shares K's memory), the attention kernels read V as the latent
    codes with ``v_scales_zeros``. So the record is three planes: ``KV`` (the latent codes),
    ``KSZ``, ``VSZ`` -- all cache memory the engine reads, moved byte for byte."""
    k, v, s1, s2 = refs
    lead = 1 if cross else 0
    if (int(s1.shape[-1]), int(s2.shape[-1])) == (2, 1) or h.quant_policy == 42:
        raise DetectionError(
            "lmdeploy: TurboQuant (quant_policy 42) with MLA (V of head size 0): LMDeploy 0.14.0's paged attention asserts "
            "'quant_policy==42 does not support shared_kv' (pagedattention.py::paged_attention_fwd); not an LMDeploy cache"
        )
    shapes = {r: tuple(int(x) for x in t.shape[: lead + 3]) for r, t in (("KV", k), ("V", v), ("KSZ", s1), ("VSZ", s2))}
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{r} {s}" for r, s in shapes.items())
        raise DetectionError(
            f"lmdeploy: the MLA planes disagree on {'layers, ' if cross else ''}blocks, block size or heads ({listed}); "
            "CacheEngine allocates V and the scale/zero tensors with K's block shape"
        )
    _mla_block(k, h, window, lead, allowed=("cuda", "ascend"), what="a quantised cache", why=_INT_WHY)
    _int_backends_check(k, h)
    width = int(k.shape[-1])
    policy = h.quant_policy
    if policy is not None:
        _mla_head_check(h, width, policy)
    elif h.k_dim() is not None:
        try:
            _mla_head_check(h, width, 8)
            policy = 8
        except DetectionError:
            _mla_head_check(h, width, 4)
            policy = 4
    else:
        _mla_head_check(h, width, None)
    reasons: list[str] = []
    bs = int(k.shape[lead + 1])
    if not _fits(h, "NHD", bs, 1, reasons, "the MLA planes", _kernel_blocks_possible(window)):
        raise DetectionError("lmdeploy: " + "; ".join(reasons))
    name = F.X_MLA_QUANT if cross else F.MLA_QUANT
    cols = {"KV": planes["K"], "KSZ": planes["S1"], "VSZ": planes["S2"]}
    kv = {r: (c[0] if cross else list(c)) for r, c in cols.items()}
    what = {4: "int4", 8: "int8"}.get(policy or 0, "int4/int8")
    c = Candidate(
        name,
        kv,
        note=f"LMDeploy MLA {what}: latent codes KV with k/v (scale, zero) planes KSZ, VSZ ({'cross-layer' if cross else 'per layer'}; "
        "V is read as the latent's first kv_lora_rank codes with VSZ)" + _block_note(h, bs),
        label="MLA " + what,
    )
    return _resolve([c], h)


# -- cross-layer tensors (0.6.4-0.11.0 full_gpu_cache) ----------------------------------------------


def _cross_layer(ts: list[torch.Tensor], h: LMDeployHints) -> Any:
    if any(t.dim() != 5 for t in ts):
        raise DetectionError(
            f"lmdeploy: a tuple of tensors is read as CacheEngine.full_gpu_cache (0.6.4-0.11.0): cross-layer tensors "
            f"[num_layers, num_blocks, *block_shape] (5-D); got {[tuple(t.shape) for t in ts]}. For per-layer tensors pass "
            "CacheEngine.gpu_cache (a list of per-layer tuples)"
        )
    window = _window(h, "cross-layer tensors")
    _check_memory_order(ts, "a cross-layer cache tensor")
    if len({int(t.shape[0]) for t in ts}) != 1:
        raise DetectionError(f"lmdeploy: the cross-layer tensors disagree on num_layers: {[int(t.shape[0]) for t in ts]}")
    if len(ts) == 2:
        return _plain([ts[0]], [ts[1]], ts[0], ts[1], h, cross=True, window=window)
    if len(ts) == 4 and ts[0].dtype in _INT_DTYPES:
        return _quant({"K": [ts[0]], "V": [ts[1]], "S1": [ts[2]], "S2": [ts[3]]}, ts, h, cross=True, window=window)
    raise DetectionError(
        f"lmdeploy: {len(ts)} cross-layer tensors; CacheEngine.full_gpu_cache holds (K, V) or, quantised, (K, V, "
        "k_scales_zeros, v_scales_zeros)" + (": a plane is missing" if len(ts) == 3 else "")
    )


# -- the 0.11.1+ memory pool ------------------------------------------------------------------------


def _esize(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


def _plan(h: LMDeployHints, policy: int, order: str, block: int | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype, int, int]]:
    """``(role, block shape, dtype, byte offset, bytes)`` of each slice of one (layer, block)
    of the pool, for ``policy``, ``order`` and ``block`` tokens per allocated (kernel) block
    (default: ``kernel_block_size``, else ``block_size``): K, V, then the side planes, each
    starting at the previous one's size rounded up to 256 bytes (``CacheDesc.aligned_size``;
    MLA's V desc has size 0 and takes no bytes)."""
    kd, vd, nh = h.k_dim(), h.v_dim(), h.num_kv_heads
    bs = block if block is not None else h.kernel_block_size if h.kernel_block_size is not None else h.block_size
    if policy in (4, 42):
        kd //= 2
    vd = vd // 2 if policy == 4 else vd // 4 if policy == 42 else vd
    vdt = _FP8.get(policy) or (torch.uint8 if policy in (4, 8, 42) else h.dtype)

    def blk(d: int) -> tuple[int, ...]:
        return (bs, nh, d) if order == "NHD" else (nh, bs, d)

    parts = [("K", blk(kd), vdt), ("V", blk(vd), vdt)]
    if policy in (4, 8, 42):
        roles = F.TURBO_ROLES if policy == 42 else F.INT_ROLES
        parts += [(roles[2], blk(2), h.dtype), (roles[3], blk(1 if policy == 42 else 2), h.dtype)]
    out, off = [], 0
    for role, shape, dt in parts:
        size = shape[0] * shape[1] * shape[2] * _esize(dt)
        out.append((role, shape, dt, off, size))
        off += -(-size // 256) * 256
    return out


def _plan_bytes(plan: list[tuple[str, tuple[int, ...], torch.dtype, int, int]]) -> int:
    return sum(-(-p[4] // 256) * 256 for p in plan)


def carve_pool(pool: torch.Tensor, h: LMDeployHints, policy: int, order: str, block: int | None = None) -> dict[str, torch.Tensor] | None:
    """The pool's planes as cross-layer views ``{role: [NL, NB, *block_shape]}`` for
    ``policy``, ``order`` and ``block`` tokens per allocated block (default: the hints'
    ``kernel_block_size``, else ``block_size``), or None when the pool's bytes per block
    are not that plan's. An MLA pool (``v_head_dim`` 0) has no ``V`` entry."""
    plan = _plan(h, policy, order, block)
    if int(pool.shape[2]) != _plan_bytes(plan):
        return None
    out = {}
    for role, shape, dt, off, size in plan:
        if size == 0:
            continue  # MLA's V: CacheDesc of size 0, an empty view
        out[role] = pool[:, :, off : off + size].view(dt).unflatten(2, shape)
    return out


def _kernel_blocks(h: LMDeployHints, order: str) -> list[int]:
    """Tokens per allocated block the pool may hold under the hints, for ``order``.

    0.14.0 ``CacheEngine.allocate_caches`` allocates ``kernel_block_size`` blocks;
    ``PytorchEngineConfig.__post_init__`` defaults it to ``block_size`` and requires a power
    of 2, at least 16, dividing ``block_size``; camb (HND) forces both to 16. Before 0.14
    the allocated block is ``block_size``. With ``kernel_block_size`` given that is the
    one reading; with only ``block_size`` (the manager's block) every kernel block it
    allows is a reading (the pool's bytes per block may fit several: the caller's
    ``kernel_block_size`` decides)."""
    if h.kernel_block_size is not None:
        kb = h.kernel_block_size
        if h.block_size is not None and h.block_size != kb and (h.block_size % kb or kb < 16 or kb & (kb - 1)):
            raise DetectionError(
                f"lmdeploy: hints block_size={h.block_size} and kernel_block_size={kb} disagree: LMDeploy 0.14's kernel block "
                "is a power of 2, at least 16, dividing block_size (PytorchEngineConfig.__post_init__)"
            )
        return [kb]
    bs = int(h.block_size)
    v = _version(h)
    if order == "HND" or (v is not None and v < (0, 14, 0)):
        return [bs]
    return [bs] + [p for p in (1 << k for k in range(4, bs.bit_length())) if p < bs and bs % p == 0][::-1]


def _pool(pool: torch.Tensor, h: LMDeployHints) -> Any:
    """0.11.1+ ``CacheEngine.full_gpu_cache``: ``torch.zeros((NL, NB, mem_pool_size), uint8)``."""
    if pool.dim() != 3 or pool.dtype != torch.uint8:
        raise DetectionError(
            f"lmdeploy: one tensor is read as the 0.11.1+ memory pool (NL, NB, bytes) of uint8; got {tuple(pool.shape)} {pool.dtype}"
        )
    if pool.stride(-1) != 1 or not memory_ordered(pool):
        raise DetectionError(f"lmdeploy: the memory pool must be as CacheEngine allocates it (contiguous bytes); strides {pool.stride()}")
    missing = [
        name
        for name, val in (
            ("num_kv_heads", h.num_kv_heads),
            ("head_dim (or k_head_dim and v_head_dim)", h.k_dim() if h.v_dim() is not None else None),
            ("block_size (or kernel_block_size)", h.kernel_block_size or h.block_size),
            ("dtype", h.dtype),
        )
        if val is None
    ]
    if missing:
        raise DetectionError(
            f"lmdeploy: the memory pool {tuple(pool.shape)} is bytes: its slices follow from the model, pass the hints "
            f"{', '.join(missing)} (CacheEngine.allocate_caches cuts it from ModelConfig and CacheConfig)"
        )
    window = _window(h, "memory pool")
    mla = h.v_dim() == 0
    if mla and h.num_kv_heads != 1:
        raise DetectionError(
            f"lmdeploy: v_head_dim=0 is MLA, whose latent is one KV head per rank (configurations/deepseek_v2.py), but "
            f"num_kv_heads={h.num_kv_heads}"
        )
    if not mla and h.k_dim() != h.v_dim():
        raise DetectionError(f"lmdeploy: k_head_dim {h.k_dim()} != v_head_dim {h.v_dim()}: not described by kvcore-lmdeploy")
    v = _version(h)
    # QuantPolicy (lmdeploy/messages.py): 4 / 8 from 0.6.2, fp8 (16, 17) and TurboQuant (42) from 0.14.0
    known = [0, 4, 8, 16, 17, 42] if v is None or v >= (0, 14, 0) else [0, 4, 8]
    if mla:
        known = [p for p in known if p != 42]  # 0.14.0 paged_attention_fwd: quant_policy 42 does not support shared_kv
        if h.quant_policy == 42:
            raise DetectionError("lmdeploy: TurboQuant (quant_policy 42) with MLA (v_head_dim 0): LMDeploy's paged attention refuses it")
    policies = [h.quant_policy] if h.quant_policy is not None else known
    orders = list(dict.fromkeys(o for o, _ in _readings(pool, h, window)))
    several = h.kernel_block_size is None and any(len(_kernel_blocks(h, o)) > 1 for o in orders)
    cands, tried = [], []
    for policy in policies:
        for order in orders:
            if policy in (4, 8, 42) and order == "HND":
                continue  # LMDeploy quantises on cuda / ascend only
            if policy in _FP8 and order == "HND":
                continue  # fp8 KV is CUDA only (0.14.0 CacheEngine.__init__)
            if mla and order != "NHD":
                continue  # an MLA latent is one head: (block_size, 1, D)
            if policy == 4 and h.k_dim() % 2 or policy == 42 and h.k_dim() % 4:
                tried.append(f"quant_policy {policy}: head_dim {h.k_dim()} cannot be packed")
                continue
            for block in _kernel_blocks(h, order):
                planes = carve_pool(pool, h, policy, order, block)
                need = _plan_bytes(_plan(h, policy, order, block))
                what = f"quant_policy {policy} {order}, {block}-token blocks"
                if planes is None:
                    tried.append(f"{what}: {need} bytes per block, the pool has {pool.shape[2]}")
                    continue
                kv: Any = planes
                if mla and policy in (4, 8):
                    name, kv = F.X_MLA_QUANT, {"KV": planes["K"], "KSZ": planes["KSZ"], "VSZ": planes["VSZ"]}
                elif mla:
                    name, kv = F.X_MLA, planes["K"]
                elif policy == 42:
                    name = F.X_TURBO
                elif policy in (4, 8):
                    name = F.X_QUANT
                else:
                    name = F.X_NHD if order == "NHD" else F.X_HND
                dev = "camb" if order == "HND" else "cuda"
                decided: dict[str, Any] = {"quant_policy": policy, "device_type": dev}
                if several:
                    decided["kernel_block_size"] = block
                cands.append(
                    Candidate(
                        name,
                        kv,
                        note=f"LMDeploy 0.11.1+ memory pool{' (MLA)' if mla else ''}, {what}, cut at 256-byte-aligned slices"
                        + _block_note(h, block),
                        decided_by=decided,
                        label=what,
                    )
                )
    if not cands:
        raise DetectionError(
            "lmdeploy: the memory pool's bytes per block fit no reading of the hints (extra ModelConfig.cache_shapes slices "
            "are not described):\n" + "\n".join(f"  - {t}" for t in tried)
        )
    return _resolve(cands, h)
