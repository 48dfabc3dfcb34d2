"""Detection of LMDeploy's PyTorch-engine KV caches (``engine="lmdeploy"``).

Accepted inputs (``lmdeploy/pytorch/engine/cache_engine.py::CacheEngine``):

* ``gpu_cache`` / ``cpu_cache`` -- a list over layers of tuples ``(k, v)`` (unquantised,
  fp8, MLA) or ``(k, v, k_scales_zeros, v_scales_zeros)`` (int4 / int8 / TurboQuant), each
  tensor ``[NB, *block_shape]``. Every generation hands these out; 0.6.0-0.6.3 as separate
  tensors, 0.6.4-0.10 as views of cross-layer tensors, 0.11+ as views of one uint8 pool.
* ``full_gpu_cache`` of 0.6.4-0.10 -- the tuple of cross-layer tensors ``[NL, NB, *block_shape]``.
* ``full_gpu_cache`` of 0.11+ -- the uint8 pool ``[NL, NB, bytes]`` with the hints
  ``num_kv_heads``, ``head_dim`` (or ``k_head_dim`` + ``v_head_dim``), ``block_size`` (or
  ``kernel_block_size``) and ``dtype``; cut as ``CacheEngine.allocate_caches`` cuts it.
* a ``CacheEngine`` itself: its ``gpu_cache``, with its ``cache_config`` / ``model_config``
  as hints (hints given too must agree).

Normalised to (``kvcore_lmdeploy.formats``): per-layer ``(K, V)`` pairs of one head size
-> ``NL_X_TWO_X_NB_BS_NH_HS`` / ``NL_X_TWO_X_NB_NH_BS_HS``; MLA (V of head size 0) -> the K
tensors, ``NL_X_NB_BS_ONE_HS``; quantised -> ``{role: per-layer list}`` under
``K=NL_X_NB_BS_NH_HS+V=...+KSZ=...+VSZ=...`` (TurboQuant: ``KN``, ``VN``); cross-layer
tensors and the pool -> ``{role: tensor}`` under the ``NL_NB_...`` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore import Candidate, DetectionError, GeometryError, memory_ordered, resolve
from kvcore_lmdeploy import formats as F
from kvcore_lmdeploy.hints import DEVICE_OF_TORCH, LMDeployHints, parse_hints

__all__ = ["detect_lmdeploy", "GEOMETRY_HINTS", "carve_pool"]

#: LMDeploy's names for the geometry kvcore compares between readings
GEOMETRY_HINTS = {"block_size": "block_size", "num_heads": "num_kv_heads", "head_size": "head_dim"}
_INT_DTYPES = (torch.uint8, torch.int8)  # cuda stores int4/int8 codes as uint8, ascend as int8 (CacheEngine.__init__)
_FP8 = {16: torch.float8_e4m3fn, 17: torch.float8_e5m2}
_ORDER_OF_DEVICE = {"cuda": "NHD", "ascend": "NHD", "maca": "NHD", "camb": "HND"}


def detect_lmdeploy(kv_caches: Any, hints: Any) -> Any:
    """Recognise an LMDeploy KV cache (see the module docstring for the inputs).

    Returns:
        a :class:`kvcore.Detection` (through :func:`kvcore.resolve`).
    Raises:
        DetectionError: not an LMDeploy cache, a plane missing, planes disagreeing on
            blocks / tokens / heads, a hint the tensors contradict, or a layout this plugin
            does not claim (custom per-model caches, MLA fp8, K/V of different head sizes).
        AmbiguousLayoutError: NHD and HND both fit and nothing decides (``device_type``).
    """
    raw = dict(hints or {})
    if _is_cache_engine(kv_caches):
        kv_caches, raw = _unwrap_engine(kv_caches, raw)
    h = parse_hints(raw)
    if isinstance(kv_caches, torch.Tensor):
        return _pool(kv_caches, h)
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise DetectionError(
            f"lmdeploy: expected CacheEngine.gpu_cache (a list of per-layer tuples), the tuple of cross-layer tensors "
            f"(0.6.4-0.10 full_gpu_cache), the uint8 pool (0.11+), or a CacheEngine; got {type(kv_caches).__name__}"
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


# -- the CacheEngine object -------------------------------------------------------------------


def _is_cache_engine(x: Any) -> bool:
    return not isinstance(x, (list, tuple, dict, torch.Tensor)) and hasattr(x, "gpu_cache") and hasattr(x, "cache_config")


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
    if kbs is not None:
        facts["kernel_block_size"] = int(kbs)
    if getattr(cc, "block_size", None) is not None:
        facts["block_size"] = int(cc.block_size)
    if mc is not None:
        for name in ("head_dim", "k_head_dim", "v_head_dim"):
            if getattr(mc, name, None) is not None:
                facts[name] = int(getattr(mc, name))
        if getattr(mc, "num_key_value_heads", None) is not None:
            facts["num_kv_heads"] = int(mc.num_key_value_heads) // int(getattr(engine, "world_size", 1) or 1)
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


def _orders(ref: torch.Tensor, h: LMDeployHints) -> list[str]:
    """The block orders the backend can have allocated: ``device_type``, else the tensor's
    torch device; a CPU tensor (host cache, copy) keeps both."""
    dev = DEVICE_OF_TORCH.get(ref.device.type)
    if h.device_type is not None:
        if dev is not None and _ORDER_OF_DEVICE[dev] != _ORDER_OF_DEVICE[h.device_type]:
            raise DetectionError(
                f"lmdeploy: hint device_type={h.device_type!r} but the tensors are on a {ref.device.type} device, which LMDeploy's "
                f"{dev} backend fills ({_ORDER_OF_DEVICE[dev]} blocks)"
            )
        return [_ORDER_OF_DEVICE[h.device_type]]
    if dev is not None:
        return [_ORDER_OF_DEVICE[dev]]
    return ["NHD", "HND"]


def _bs_nh(shape: Sequence[int], order: str) -> tuple[int, int]:
    """(block_size, num_heads) of a block shape ``(BS, NH, HS)`` / ``(NH, BS, HS)``."""
    a, b = int(shape[0]), int(shape[1])
    return (a, b) if order == "NHD" else (b, a)


def _fits(h: LMDeployHints, order: str, bs: int, nh: int, reasons: list[str], what: str) -> bool:
    if not h.block_fits(bs):
        said = f"kernel_block_size={h.kernel_block_size}" if h.kernel_block_size is not None else f"block_size={h.block_size}"
        reasons.append(f"{what} read {order}: {bs} tokens per block, but {said}")
        return False
    if h.num_kv_heads is not None and h.num_kv_heads != nh:
        reasons.append(f"{what} read {order}: {nh} heads, but num_kv_heads={h.num_kv_heads}")
        return False
    return True


def _check_memory_order(ts: Sequence[torch.Tensor], what: str) -> None:
    for t in ts:
        if not memory_ordered(t):
            raise DetectionError(
                f"lmdeploy: {what} {tuple(t.shape)} has strides {tuple(t.stride())}, whose memory order is not its axis order; "
                "LMDeploy's CacheEngine allocates block tensors in memory order (torch.empty, or slices of its pool): pass them "
                "as the engine holds them"
            )


def _value_dtype_check(k: torch.Tensor, h: LMDeployHints, what: str) -> None:
    qp = h.quant_policy
    if qp in _FP8 and k.dtype != _FP8[qp]:
        raise DetectionError(f"lmdeploy: quant_policy={qp} stores K/V as {_FP8[qp]}, but {what} is {k.dtype}")
    if qp == 0 and k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise DetectionError(f"lmdeploy: quant_policy=0 stores K/V in the model dtype, but {what} is {k.dtype} (fp8 is 16 / 17)")
    if qp in (0, 16, 17, None) and k.dtype in _INT_DTYPES:
        raise DetectionError(
            f"lmdeploy: {what} is {k.dtype}: an int4/int8/TurboQuant cache, but its scale/zero tensors are missing "
            "(CacheEngine gives each layer (k, v, k_scales_zeros, v_scales_zeros)); pass the whole per-layer tuples"
        )
    if qp in (0, None) and h.dtype is not None and k.dtype not in (h.dtype, *_FP8.values()):
        raise DetectionError(f"lmdeploy: hint dtype={h.dtype} but {what} is {k.dtype} (an unquantised cache holds the model dtype)")


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


# -- per-layer tuples (CacheEngine.gpu_cache) -----------------------------------------------


def _per_layer(entries: list[tuple], h: LMDeployHints) -> Any:
    n = {len(e) for e in entries}
    if len(n) != 1:
        raise DetectionError(f"lmdeploy: the per-layer tuples have different lengths {sorted(n)}; CacheEngine gives every layer alike")
    n = n.pop()
    cols = [[e[i] for e in entries] for i in range(n)]
    refs = [_same(c, f"tensor {i} of the per-layer tuple") for i, c in enumerate(cols)]
    if any(r.dim() != 4 for r in refs):
        raise DetectionError(
            f"lmdeploy: per-layer cache tensors are [num_blocks, *block_shape] (4-D); got {[tuple(r.shape) for r in refs]} "
            "(0.6.x MACA's split-K blocks are not described by this plugin)"
        )
    _check_memory_order(refs, "a per-layer cache tensor")
    k, v = refs[0], refs[1] if n > 1 else None
    if n == 1:
        raise DetectionError("lmdeploy: each layer holds one tensor; CacheEngine gives (k, v[, k_scales_zeros, v_scales_zeros])")
    if n == 2:
        return _plain(cols[0], cols[1], k, v, h, cross=False)
    if n == 3:
        raise DetectionError(
            "lmdeploy: each layer holds 3 tensors: a quantised cache's plane is missing (CacheEngine gives (k, v, "
            "k_scales_zeros, v_scales_zeros) per layer for quant_policy 4 / 8 / 42)"
        )
    if n == 4 and refs[2].dim() == 4 and refs[0].dtype in _INT_DTYPES:
        return _quant(dict(zip(("K", "V", "S1", "S2"), cols)), refs, h, cross=False)
    raise DetectionError(
        f"lmdeploy: each layer holds {n} tensors {[(tuple(r.shape), str(r.dtype)) for r in refs]}; beyond (k, v) and the "
        "scale/zero tensors these are ModelConfig.cache_shapes (custom per-model caches, e.g. DeepSeek-V3.2's indexer), "
        "which kvcore-lmdeploy does not describe"
    )


def _plain(ks: list, vs: list, k: torch.Tensor, v: torch.Tensor, h: LMDeployHints, *, cross: bool) -> Any:
    """Unquantised / fp8 K and V (and MLA: V of head size 0)."""
    lead = 1 if cross else 0  # the NL axis of a cross-layer tensor
    what = "K (cross-layer)" if cross else "K"
    if h.quant_policy in (4, 8, 42):
        raise DetectionError(
            f"lmdeploy: quant_policy={h.quant_policy} keeps per-token-head scale/zero tensors beside K and V, but only "
            f"{'K, V' if cross else '(k, v) per layer'} were passed: a plane is missing (pass all four)"
        )
    _value_dtype_check(k, h, what)
    if int(v.shape[-1]) == 0:  # MLA: ModelConfig.v_head_dim == 0 (deepseek_v2.py)
        if cross:
            raise DetectionError("lmdeploy: an MLA cache (V of head size 0) is described per layer: pass CacheEngine.gpu_cache")
        if k.dtype in _FP8.values():
            raise DetectionError(
                "lmdeploy: an fp8 MLA cache (0.11+ use_mla_fp8_cache: 656-byte records of fp8 values, fp32 scales and bf16 rope) "
                "is not described by kvcore-lmdeploy"
            )
        if int(k.shape[2]) != 1 or h.device_type == "camb":
            raise DetectionError(f"lmdeploy: a V of head size 0 is MLA, whose K is [NB, BS, 1, D]; got K {tuple(k.shape)}")
        if h.v_dim() not in (None, 0):
            raise DetectionError(f"lmdeploy: V has head size 0 (MLA) but the hints say v_head_dim={h.v_dim()}")
        _head_check(h.model_copy(update={"v_head_dim": None, "head_dim": h.k_dim()}), int(k.shape[-1]), 0, 0)
        reasons: list[str] = []
        if not _fits(h, "NHD", int(k.shape[1]), 1, reasons, "MLA K"):
            raise DetectionError("lmdeploy: " + "; ".join(reasons))
        c = Candidate(F.MLA, list(ks), note="LMDeploy MLA: K latents (V is not stored)", label="MLA")
        return resolve([c], engine="lmdeploy", geometry_hints=GEOMETRY_HINTS, required=True)
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
    _head_check(h, int(k.shape[-1]), int(v.shape[-1]), h.quant_policy)
    cands: list[Candidate] = []
    reasons = []
    for order in _orders(k, h):
        bs, nh = _bs_nh(k.shape[lead + 1 : lead + 3], order)
        if not _fits(h, order, bs, nh, reasons, "K, V"):
            continue
        dev = "camb" if order == "HND" else "cuda"
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
                note=f"LMDeploy {'cross-layer K, V' if cross else 'gpu_cache (k, v) per layer'}, {order} blocks ({dev} backend)",
                decided_by={"device_type": dev},
                label=f"{order} ({dev})",
            )
        )
    if not cands:
        raise DetectionError("lmdeploy: no block order fits the hints: " + "; ".join(reasons))
    return resolve(cands, engine="lmdeploy", hints=_given(h), geometry_hints=GEOMETRY_HINTS, required=True)


def _given(h: LMDeployHints) -> dict:
    return {k: v for k, v in h.model_dump().items() if v is not None}


def _quant(planes: dict[str, list], refs: list[torch.Tensor], h: LMDeployHints, *, cross: bool) -> Any:
    """int4 / int8 ((scale, zero) pairs) or TurboQuant (norms) values and side planes."""
    k, v, s1, s2 = refs
    lead = 1 if cross else 0
    if v.dtype != k.dtype:
        raise DetectionError(f"lmdeploy: quantised K is {k.dtype} but V is {v.dtype}; CacheEngine stores both as uint8 (ascend: int8)")
    w1, w2 = int(s1.shape[-1]), int(s2.shape[-1])
    turbo = (w1, w2) == (2, 1)
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
    if h.quant_policy is not None:
        if h.quant_policy in (0, 16, 17):
            raise DetectionError(
                f"lmdeploy: quant_policy={h.quant_policy} keeps no scale/zero tensors, but each layer holds four tensors with "
                f"uint8 K/V; with quant_policy {h.quant_policy} the extra tensors would be ModelConfig.cache_shapes (custom "
                "caches), which kvcore-lmdeploy does not describe"
            )
        if (h.quant_policy == 42) != turbo:
            raise DetectionError(
                f"lmdeploy: quant_policy={h.quant_policy} but the side tensors end in ({w1}, {w2}) elements "
                f"({'TurboQuant' if turbo else 'int4/int8'} keeps that)"
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
    if h.device_type == "camb":
        raise DetectionError("lmdeploy: device_type='camb' does not quantise the KV cache (PytorchEngineConfig: cuda and ascend only)")
    dev = DEVICE_OF_TORCH.get(k.device.type)
    if dev == "camb":
        raise DetectionError("lmdeploy: a quantised cache on an mlu (camb) device: LMDeploy quantises on cuda and ascend only")
    bs, nh = _bs_nh(k.shape[lead + 1 : lead + 3], "NHD")
    reasons: list[str] = []
    if not _fits(h, "NHD", bs, nh, reasons, "the quantised planes"):
        raise DetectionError("lmdeploy: " + "; ".join(reasons))
    name = (F.X_TURBO if turbo else F.X_QUANT) if cross else (F.TURBO if turbo else F.QUANT)
    kv = {named[r]: (cols[0] if cross else list(cols)) for r, cols in planes.items()}
    what = "TurboQuant" if turbo else {4: "int4", 8: "int8"}.get(policy or 0, "int4/int8")
    c = Candidate(name, kv, note=f"LMDeploy {what} KV with per-token-head side planes ({'cross-layer' if cross else 'per layer'})")
    return resolve([c], engine="lmdeploy", hints=_given(h), geometry_hints=GEOMETRY_HINTS, required=True)


# -- cross-layer tensors (0.6.4-0.10 full_gpu_cache) ----------------------------------------------


def _cross_layer(ts: list[torch.Tensor], h: LMDeployHints) -> Any:
    if any(t.dim() != 5 for t in ts):
        raise DetectionError(
            f"lmdeploy: a tuple of tensors is read as CacheEngine.full_gpu_cache (0.6.4-0.10): cross-layer tensors "
            f"[num_layers, num_blocks, *block_shape] (5-D); got {[tuple(t.shape) for t in ts]}. For per-layer tensors pass "
            "CacheEngine.gpu_cache (a list of per-layer tuples)"
        )
    _check_memory_order(ts, "a cross-layer cache tensor")
    if len({int(t.shape[0]) for t in ts}) != 1:
        raise DetectionError(f"lmdeploy: the cross-layer tensors disagree on num_layers: {[int(t.shape[0]) for t in ts]}")
    if len(ts) == 2:
        return _plain([ts[0]], [ts[1]], ts[0], ts[1], h, cross=True)
    if len(ts) == 4 and ts[0].dtype in _INT_DTYPES:
        return _quant({"K": [ts[0]], "V": [ts[1]], "S1": [ts[2]], "S2": [ts[3]]}, ts, h, cross=True)
    raise DetectionError(
        f"lmdeploy: {len(ts)} cross-layer tensors; CacheEngine.full_gpu_cache holds (K, V) or, quantised, (K, V, "
        "k_scales_zeros, v_scales_zeros)" + (": a plane is missing" if len(ts) == 3 else "")
    )


# -- the 0.11+ memory pool --------------------------------------------------------------------------


def _esize(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


def _plan(h: LMDeployHints, policy: int, order: str, block: int | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype, int, int]]:
    """``(role, block shape, dtype, byte offset, bytes)`` of each slice of one (layer, block)
    of the pool, for ``policy``, ``order`` and ``block`` tokens per allocated (kernel) block
    (default: ``kernel_block_size``, else ``block_size``): K, V, then the side planes, each
    starting at the previous one's size rounded up to 256 bytes (``CacheDesc.aligned_size``)."""
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
    are not that plan's."""
    plan = _plan(h, policy, order, block)
    if int(pool.shape[2]) != _plan_bytes(plan):
        return None
    out = {}
    for role, shape, dt, off, size in plan:
        out[role] = pool[:, :, off : off + size].view(dt).unflatten(2, shape)
    return out


def _version(h: LMDeployHints) -> tuple[int, ...] | None:
    """``lmdeploy_version`` as a tuple (None when not given); an unreadable one is a DetectionError."""
    if h.lmdeploy_version is None:
        return None
    from kvcore_lmdeploy.allocation import version_tuple

    try:
        return version_tuple(h.lmdeploy_version)
    except GeometryError as e:
        raise DetectionError(f"lmdeploy: hint lmdeploy_version: {e}") from None


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
    """0.11+ ``CacheEngine.full_gpu_cache``: ``torch.zeros((NL, NB, mem_pool_size), uint8)``."""
    if pool.dim() != 3 or pool.dtype != torch.uint8:
        raise DetectionError(
            f"lmdeploy: one tensor is read as the 0.11+ memory pool (NL, NB, bytes) of uint8; got {tuple(pool.shape)} {pool.dtype}"
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
    if h.v_dim() == 0:
        raise DetectionError("lmdeploy: an MLA pool (v_head_dim 0) is described per layer: pass CacheEngine.gpu_cache")
    if h.k_dim() != h.v_dim():
        raise DetectionError(f"lmdeploy: k_head_dim {h.k_dim()} != v_head_dim {h.v_dim()}: not described by kvcore-lmdeploy")
    v = _version(h)
    if v is not None and v < (0, 11, 0):
        raise DetectionError(
            f"lmdeploy: hint lmdeploy_version={h.lmdeploy_version!r}, but one uint8 tensor [NL, NB, bytes] is the memory pool "
            "of 0.11+; before 0.11 CacheEngine.full_gpu_cache is the tuple of cross-layer tensors"
        )
    # QuantPolicy (lmdeploy/messages.py): 4 / 8 from 0.6.2, fp8 (16, 17) and TurboQuant (42) from 0.14.0
    known = [0, 4, 8, 16, 17, 42] if v is None or v >= (0, 14, 0) else [0, 4, 8]
    if h.quant_policy is not None and h.quant_policy not in known:
        raise DetectionError(f"lmdeploy: quant_policy={h.quant_policy} is 0.14+, but the hint lmdeploy_version={h.lmdeploy_version!r}")
    policies = [h.quant_policy] if h.quant_policy is not None else known
    orders = _orders(pool, h)
    several = h.kernel_block_size is None and any(len(_kernel_blocks(h, o)) > 1 for o in orders)
    cands, tried = [], []
    for policy in policies:
        for order in orders:
            if policy in (4, 8, 42) and order == "HND":
                continue  # LMDeploy quantises on cuda / ascend only
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
                if policy == 42:
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
                        planes,
                        note=f"LMDeploy 0.11+ memory pool, {what}, cut at 256-byte-aligned slices",
                        decided_by=decided,
                        label=what,
                    )
                )
    if not cands:
        raise DetectionError(
            "lmdeploy: the memory pool's bytes per block fit no reading of the hints (extra ModelConfig.cache_shapes slices "
            "are not described):\n" + "\n".join(f"  - {t}" for t in tried)
        )
    return resolve(cands, engine="lmdeploy", hints=_given(h), geometry_hints=GEOMETRY_HINTS, required=True)
