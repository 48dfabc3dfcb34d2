"""``kvcore_detect`` for engine ``"vllm"``.

Input: the runner's per-layer container with dicts already turned into lists in layer
order by the core (``runner.kv_caches`` or the ``{layer_name: tensor}`` dict handed to KV
connectors). Each entry is one layer's tensor: a per-layer allocation (<= 0.26), a
permuted view of a cross-layer buffer (0.13-0.2x with a cross-layer connector), a 0.33
view into the one int8 buffer, or a ``(K, V)`` pair (vllm-ascend). One tensor on its own
may also be a whole cross-layer buffer (what a cross-layer connector is handed).

Decision (see :mod:`kvcore_vllm.hints` for the hint precedence):

1. entries that are lists of tensors are per-layer ``(K, V)`` pairs when they can be
   (two tensors ``[NB, BS, NH, *]`` of one leading shape: vllm-ascend
   ``NPUModelRunner._reshape_kv_cache_tensors``; NHD only, so an HND or block-outermost
   ``kv_cache_layout`` contradicts them; of unequal widths they are K/V with ``head_size_v``
   or an MLA layer's (nope, rope) caches, multi-plane names that ``kv_cache_spec`` or
   ``head_size`` pick), one-element lists ``[kv_cache]`` as vLLM 0.11 / 0.13
   ``bind_kv_cache`` keeps them (read as the tensor; at ranks a one-state Mamba layer shares
   ``kv_cache_spec`` decides), else vLLM's Mamba state (a list of state tensors of different
   shapes, 0.11 ``gpu_model_runner.py::_reshape_kv_cache_tensors``); the ``kv_cache_spec``
   hint (``attention`` / ``mla`` / ``mamba``) says which outright. 4-D
   ``[NB, 1, 1, C]`` pages no rule reads (0.33 ``MambaSpec``: one state per block) are not
   KV either. Not-KV entries come back as ``Detection(format=None, excluded=...)``;
2. entries that are the same memory (KV sharing: one cache under several layer names)
   stay one layer each, reported as ``layout.aliases``;
3. every rule of :mod:`kvcore_vllm.rules` consistent with the hints and the tensors'
   shapes and strides gives a candidate -- the tensors as vLLM allocated them and, for a
   contiguous tensor, as an HND/NHD cache already permuted into memory order;
   :func:`kvcore.resolve` merges candidates that place bytes identically and raises
   :class:`kvcore.AmbiguousLayoutError` for the rest, naming only hints that decide and
   that the caller did not give -- shape alone never decides between layouts that share a
   shape (``NB == 2``, ``NH == 1`` MLA vs one KV head, an NHD/HND twin, packed ``NH == 2``
   across versions, OCP vs FNUZ fp8 on ROCm);
4. a layout hint the strides contradict raises :class:`kvcore.DetectionError` naming both
   (``tensor_order="physical"`` says the tensor was permuted into memory order);
   hints that rule out every reading the tensors allow, likewise; readings whose shapes fit
   but whose memory cannot be a vLLM cache (per-layer views that overlap; a single tensor
   whose layer axis would exceed :data:`kvcore_vllm.rules.MAX_BARE_LAYERS`) are named with
   the reason when nothing else fits.

Layouts whose parts live apart come back as multi-plane names with ``kv_caches={role:
container}``: vLLM's paged-attention reading (``split_kv_cache``: K ``(NB, NH, HS/x, BS, x)``,
V ``(NB, NH, HS, BS)``) is ``K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS``, ROCm's tiled
indexer page ``K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS``. uint8 byte records are read by
their width (:mod:`kvcore_vllm.specs`); where the platform changes a record's order and the
tensors cannot tell it (:func:`kvcore_vllm.rules.platform_rocm` is None), detection raises
:class:`kvcore.AmbiguousLayoutError` naming ``device_type``; a record only ROCm's aiter can read
(0.33's MXFP4 indexer pages on gfx950) is a :class:`kvcore.DetectionError`.

vLLM 0.33 int8 byte views with neither ``dtype`` nor an fp8 ``cache_dtype`` hint are
described in bytes (dtype int8, head_size in bytes): transfers still move exactly the
right bytes, K before V; pass ``dtype`` for element geometry.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import AmbiguousLayoutError, Candidate, Detection, DetectionError, GeometryError, build_layout, resolve, split_aliases
from kvcore.detection import describe_input, memory_ordered
from kvcore.dtypes import dtype_name, fp8_dtype, is_fp8, rocm_build
from kvcore_vllm.hints import LAYOUT_FAMILY, VllmHints, parse_hints
from kvcore_vllm.pairs import ASCEND_SOURCE as _ASCEND
from kvcore_vllm.pairs import PAIRS_FORMAT, PAIRS_KV_PLANES, PAIRS_MLA_PLANES
from kvcore_vllm.rules import CPU_VEC, NEON_BF16, ROCM_ONLY_BACKENDS, Reading, bare_candidates, candidates

__all__ = ["detect_vllm"]

_GEOMETRY = {"block_size": "block_size", "num_heads": "num_kv_heads", "head_size": "head_size"}


def _layout_class(r: Reading) -> tuple[str, bool] | None:
    base, _, cross = r.layout.partition("/")
    if base == "*":
        return None
    fam = LAYOUT_FAMILY.get(base, base)
    return fam, cross == "cross" or base[0] == "B"


def _deciding(readings: list[Reading]) -> list[str]:
    """The vLLM hints that select between readings that place bytes differently (the
    geometry hints and ``tensor_order`` the core adds itself)."""
    groups: dict[tuple, list[Reading]] = {}
    for r in readings:
        c = r.candidate
        if c.against:
            continue
        try:
            lay = build_layout(c.format, c.kv_caches, dtype=c.dtype, params=c.params)
        except GeometryError:
            continue
        groups.setdefault((lay.kv_size, lay.dtype, lay.stride_table().signature()), []).append(r)
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
    if differs(lambda r: r.families):
        keys.append("attention_backend")
    if differs(_layout_class) and all(_layout_class(r) is not None for g in gs for r in g):
        keys.append("kv_cache_layout")
    if differs(lambda r: r.candidate.order == "physical"):
        keys.append("kv_cache_layout")
    if differs(lambda r: r.rule.gate in ("cpu", "tpu", "rocm", "rocm?")):
        keys.append("device_type")
    if differs(lambda r: r.rule.gate == "cpu"):
        keys.append("attention_backend")  # CPU_ATTN / TORCH_SDPA against a GPU backend
    # settings vLLM reads at run time that no tensor shows (IPEX importable, an env var)
    for field, name in (
        ("use_ipex", "use_ipex"),
        ("prefill_decode_attention", "VLLM_V1_USE_PREFILL_DECODE_ATTENTION"),
        ("cpu_amx", "cpu_attn_isa"),
    ):
        if differs(lambda r, f=field: dict(r.rule.requires).get(f)):
            keys.append(name)
    if differs(lambda r: r.candidate.dtype):
        keys.append("dtype")
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


def _explain_misfit(tensors: list[torch.Tensor], h: VllmHints, raw_hints: dict, needs: list[str]) -> None:
    """Raise DetectionError when the hints exclude every reading the tensors allow, or a
    reading needs hints it did not get."""
    if needs:
        raise DetectionError(
            f"vLLM: these tensors can be read only with more hints: {'; '.join(dict.fromkeys(needs))}.\ntensors:\n{describe_input(tensors)}"
        )
    free = _fitting(candidates(tensors, VllmHints(device_type=h.device_type)))
    if raw_hints and free and h.block_size is not None:
        for r in free:
            c = r.candidate
            try:
                lay = build_layout(c.format, c.kv_caches, dtype=c.dtype, params=c.params)
                nb, bs = lay.num_blocks, lay.block_size
            except GeometryError:
                continue
            if bs < h.block_size and h.block_size % bs == 0 and nb % (h.block_size // bs):
                ratio = h.block_size // bs
                raise DetectionError(
                    f"vLLM: block_size={h.block_size}, but these tensors hold {nb} blocks of {bs} tokens: vLLM splits each "
                    f"manager block into {ratio} kernel blocks and makes num_blocks x {ratio} of them (0.13+ "
                    "gpu_model_runner._reshape_kv_cache_tensors, 0.33 create_kv_cache_views), so a count of kernel blocks "
                    f"is a multiple of {ratio}; {nb} is not. Check block_size (the manager's), or pass the cache's own "
                    f"tensors.\ntensors:\n{describe_input(tensors)}"
                )
    if raw_hints and free:
        shows = sorted({f"{r.candidate.label} -> {r.candidate.format}" for r in free})
        raise DetectionError(
            f"vLLM: no layout fits these tensors with hints {raw_hints}; without them they read as: {'; '.join(shows)}.\n"
            f"tensors:\n{describe_input(tensors)}\nCheck block_size, num_kv_heads, head_size, attention_backend and vllm_version."
        )


def _layout_source(h: VllmHints, hints: Any) -> str:
    """Where the explicit layout hint came from, for messages (the environment's
    ``VLLM_KV_CACHE_LAYOUT`` is a field of its own, :attr:`VllmHints.env_kv_cache_layout`)."""
    raw = hints if isinstance(hints, dict) else {}
    if raw.get("kv_cache_layout") is not None or h.kv_cache_layout is None:
        return "kv_cache_layout"
    return "cache_config.kv_cache_layout"


# -- fp8: OCP or FNUZ -------------------------------------------------------------------


def _gfx94(tensors: list[torch.Tensor]) -> bool | None:
    """vLLM's ``RocmPlatform.is_fp8_fnuz``: ``"gfx94" in gcnArchName``, read from the GPU
    that holds the tensors; None when they are not on a ROCm GPU of this process."""
    for t in tensors:
        if t.device.type == "cuda" and getattr(torch.version, "hip", None):
            try:
                return "gfx94" in torch.cuda.get_device_properties(t.device).gcnArchName
            except Exception:  # noqa: BLE001 - no arch name: unknown, not an error
                return None
    return None


#: backends whose fp8 cache is OCP on every platform they run on: B12X is CUDA (SM 12.x, vLLM 0.33
#: ``b12x.py::B12xPagedAttentionBackend.supports_compute_capability``; ``current_platform.fp8_dtype()``
#: float8_e4m3fn); ROCM_SEGMENTED_ATTN runs on RDNA only and takes fp8 on gfx12 only
#: (``rocm_segmented_attn.py::RocmSegmentedAttentionBackend.supports_combination``), where
#: ``platforms/rocm.py::RocmPlatform.fp8_dtype`` is float8_e4m3fn (FNUZ is gfx94x's).
OCP_FP8_BACKENDS = ("B12X", "ROCM_SEGMENTED_ATTN")


def _fp8_variants(h: VllmHints, tensors: list[torch.Tensor]) -> tuple[list[tuple[VllmHints, str]], list[str]]:
    """The hints to read the tensors with, one per fp8 element dtype the platform allows.

    Returns:
        ([(hints, label suffix)], extra deciding hints).
    Raises:
        DetectionError: a ``dtype`` hint that is fp8 of the other kind than ``cache_dtype``.
    """
    kind = h.fp8_kind
    if kind is None:
        return [(h, "")], []
    if is_fp8(h.dtype):
        if ("e4m3" in dtype_name(h.dtype)) != (kind == "e4m3"):
            raise DetectionError(
                f"vLLM: cache_dtype={h.cache_dtype!r} stores fp8 {kind} but the dtype hint says {dtype_name(h.dtype)}; fix one of them"
            )
        return [(h, "")], []
    if h.attention_backend in OCP_FP8_BACKENDS:
        return [(h.model_copy(update={"dtype": fp8_dtype(kind, fnuz=False)}), "")], []
    if h.device_type == "rocm" or (h.device_type is None and h.attention_backend in ROCM_ONLY_BACKENDS):
        # a ROCm-only backend ran on ROCm whatever process now holds the tensors (a copy, a description)
        platform: str | None = "rocm"
    elif h.device_type is not None:
        platform = "other"
    else:
        built = rocm_build(tensors)
        platform = None if built is None else ("rocm" if built else "other")
    if platform == "other":
        return [(h.model_copy(update={"dtype": fp8_dtype(kind, fnuz=False)}), "")], []
    if platform == "rocm":
        fnuz = _gfx94(tensors)
        if fnuz is not None:
            return [(h.model_copy(update={"dtype": fp8_dtype(kind, fnuz=fnuz)}), "")], []
    ocp, nuz = fp8_dtype(kind, fnuz=False), fp8_dtype(kind, fnuz=True)
    return [
        (h.model_copy(update={"dtype": ocp}), f" as {dtype_name(ocp)} (CUDA; ROCm gfx950)"),
        (h.model_copy(update={"dtype": nuz}), f" as {dtype_name(nuz)} (ROCm gfx94x: MI300X, MI325X)"),
    ], (["device_type"] if platform is None else [])


# -- per-layer lists: (K, V) pairs or Mamba state -----------------------------------------


def _pair_shape(x: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(K shape, V shape) when ``x`` can be one layer's (K, V): two rank-4 tensors
    ``[NB, BS, NH, *]`` of one dtype, device and leading shape."""
    if not isinstance(x, (list, tuple)) or len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x):
        return None
    k, v = x
    if k.dim() != 4 or v.dim() != 4 or k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype or k.device != v.device:
        return None
    return tuple(k.shape), tuple(v.shape)


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, (list, tuple)):
        return [_shapes(y) for y in x]
    return type(x).__name__


def _mamba(items: list[Any]) -> Detection:
    shapes = [_shapes(x) for x in items]
    return Detection(
        format=None,
        excluded=f"Mamba state (a list of state tensors per layer, shapes {shapes[:3]}): not KV "
        "(vLLM 0.11 gpu_model_runner.py::_reshape_kv_cache_tensors builds Mamba layers a list of as_strided state tensors)",
    )


#: ranks of the one state tensor of vLLM 0.11 / 0.13's single-state Mamba-style layers
#: (``mamba_utils.py::MambaStateShapeCalculator``: ``linear_attention_state_shape`` (H, D, D) and
#: ``short_conv_state_shape`` (one conv state), each behind the block axis): ``[t]`` of such a rank
#: is a bound KV cache or such a state, and only ``kv_cache_spec`` tells.
_ONE_STATE_RANKS = (3, 4)


def _bound(items: list[Any]) -> bool:
    """Every entry a one-element list or tuple: vLLM 0.11 / 0.13 ``bind_kv_cache``
    (``v1/worker/utils.py``) sets ``forward_context[name].kv_cache = [kv_cache]`` ("use list
    because of v0 PP virtual engine")."""
    return all(isinstance(x, (list, tuple)) and len(x) == 1 for x in items)


def _one_element_lists(items: list[Any], h: VllmHints, hints: Any) -> Detection | None:
    """Entries ``[x]``: a layer's cache as ``Attention.kv_cache`` holds it in vLLM 0.11 / 0.13
    (``x`` the KV tensor, or a Mamba layer's list of state tensors), or, in any version, a
    Mamba-style layer whose state list has one tensor (linear attention, short conv). A KV
    tensor is read as itself; where its rank is also a one-state layer's, ``kv_cache_spec``
    decides."""
    inner = [x[0] for x in items]
    if h.kv_cache_spec == "mamba" or all(isinstance(x, (list, tuple)) for x in inner):
        return _mamba(items)
    if not all(isinstance(x, torch.Tensor) for x in inner):
        return None
    if h.kv_cache_spec is None:
        if h.era not in (None, "0.11", "0.13"):
            # 0.24+ binds the tensor itself (v1/worker/utils.py::bind_kv_cache): a list is a Mamba state list
            return _mamba(items)
        ranks = sorted({t.dim() for t in inner})
        if any(r in _ONE_STATE_RANKS for r in ranks):
            raise AmbiguousLayoutError(
                f"vLLM: every entry is a one-element list of a rank-{'/'.join(map(str, ranks))} tensor: either the layer's KV cache "
                "as vLLM 0.11 / 0.13 binds it (v1/worker/utils.py::bind_kv_cache: forward_context[name].kv_cache = [kv_cache]) "
                "or a Mamba-style layer with one state tensor (linear attention, short conv: "
                f"mamba_utils.py::MambaStateShapeCalculator).\ntensors:\n{describe_input(items)}\n"
                "Pass kv_cache_spec='attention' (or 'mla') for the KV cache, kv_cache_spec='mamba' for state",
                candidates=["KV cache (bound list)", "Mamba state"],
                hints=["kv_cache_spec"],
            )
    det = detect_vllm(inner, hints)
    if det is not None and det.format is None and h.kv_cache_spec is not None:
        raise DetectionError(f"vLLM: kv_cache_spec={h.kv_cache_spec!r} but the listed tensors are {det.excluded}")
    return det


def _ascend_tuples(items: list[Any], h: VllmHints) -> Detection | None:
    """vllm-ascend's tuple entries other than equal-dtype (K, V) pairs: the container is
    the engine's statement that they are attention caches (vllm-ascend builds every
    attention-family entry a tuple and a Mamba layer's state a list:
    ``kv_caches[layer_name] = state_tensors``), so they are never read as Mamba state.

    * ``(k, v, dsa_k)`` / ``(k, v, dsa_k, dsa_k_scale)``: a DeepSeek-V3.2 sparse-attention
      layer (vllm-ascend 0.18, :data:`~kvcore_vllm.pairs.ASCEND_DSA_SOURCE`) -> ``KV``, ``KPE``,
      ``IK`` (, ``IKS``) planes;
    * ``(k_cache,)``: a sparse-C8 MLA layer or an SFA indexer layer without scales (0.23+,
      :data:`~kvcore_vllm.pairs.ASCEND_SFA_SOURCE`) -> one ``KV`` plane;
    * ``(indexer_k, indexer_scale)`` of two dtypes and widths: an SFA indexer layer with
      scales (0.23+) -> ``IK``, ``IKS`` planes.

    Every slot is ``(NB, BS, NH, width)`` in memory order with one ``(NB, BS, NH)`` per
    layer and, for these latent-style caches, ``NH == 1``. Returns None for tuples of
    another kind (the pair reading, or layers of different shapes: ``detect_per_layer``).

    Raises:
        DetectionError: a tuple of such arity whose slots are not ``[NB, BS, 1, *]`` tensors
            of one leading shape, permuted strides, a layout or ``kv_cache_spec`` hint the
            tuples contradict, or geometry hints that disagree.
    """
    from kvcore_vllm.pairs import ASCEND_DSA_SOURCE, ASCEND_SFA_SOURCE, DSA_C8_PLANES, DSA_PLANES, INDEXER_KEYS, INDEXER_PLANES, ONE_PLANE

    n = len(items[0])
    if any(len(x) != n for x in items) or not all(isinstance(t, torch.Tensor) for x in items for t in x):
        return None
    first = items[0]
    two_dtypes = n == 2 and first[0].dtype != first[1].dtype
    if n not in (1, 3, 4) and not two_dtypes:
        return None
    fmt, roles, src, what = {
        1: (ONE_PLANE, ("KV",), ASCEND_SFA_SOURCE, "one-plane tuples (k_cache,)"),
        2: (INDEXER_PLANES, ("K", "KS"), ASCEND_SFA_SOURCE, "SFA indexer tuples (indexer_k, indexer_scale)"),
        3: (DSA_PLANES, ("KV", "KPE", "IK"), ASCEND_DSA_SOURCE, "DeepSeek-V3.2 sparse-attention tuples (k, v, dsa_k)"),
        4: (DSA_C8_PLANES, ("KV", "KPE", "IK", "IKS"), ASCEND_DSA_SOURCE, "sparse C8 tuples (k, v, dsa_k, dsa_k_scale)"),
    }[n]
    if n == 1 and h.kv_cache_spec == "indexer":
        fmt, roles, what = INDEXER_KEYS, ("K",), "SFA indexer key tuples (indexer_k,)"
    if two_dtypes and h.kv_cache_spec != "indexer":
        # a 2-tuple of two dtypes is an SFA indexer layer (keys, scales) or an fa-quant layer whose K cache alone is
        # quantised (vllm-ascend quantization/modelslim_config.py::get_kv_quant_dtype: MLA models quantise only the nope
        # cache): the bytes do not say which
        if h.kv_cache_spec in ("mla", "attention"):
            fmt, roles = (PAIRS_MLA_PLANES, ("KV", "KPE")) if h.kv_cache_spec == "mla" else (PAIRS_KV_PLANES, ("K", "V"))
            what, src = f"fa-quant {'(nope, rope)' if roles[0] == 'KV' else '(K, V)'} tuples of two dtypes", _ASCEND
        else:
            raise AmbiguousLayoutError(
                f"vLLM: per-layer tuples of two dtypes ({dtype_name(first[0].dtype)} {first[0].shape[-1]} wide, "
                f"{dtype_name(first[1].dtype)} {first[1].shape[-1]} wide): vllm-ascend builds an SFA indexer layer's "
                f"(indexer_k, indexer_scale) this way ({ASCEND_SFA_SOURCE}) and an fa-quant layer whose K (MLA: nope) cache "
                "alone is quantised (quantization/modelslim_config.py::get_kv_quant_dtype).\n"
                f"tensors:\n{describe_input(items)}\nPass kv_cache_spec ('indexer' for keys and scales, 'mla' for nope and "
                "rope, 'attention' for K and V)",
                candidates=[INDEXER_PLANES, PAIRS_MLA_PLANES, PAIRS_KV_PLANES],
                hints=["kv_cache_spec"],
            )
    lead = tuple(first[0].shape[:3]) if first[0].dim() == 4 else None
    shapes = {tuple(tuple(t.shape) for t in x) for x in items}
    bad = lead is None or any(t.dim() != 4 or tuple(t.shape[:3]) != lead for x in items for t in x)
    if bad or (lead[2] != 1 and roles[0] != "K"):
        raise DetectionError(
            f"vLLM: per-layer {what}: vllm-ascend builds every slot (num_blocks, block_size, 1, width) with one (num_blocks, "
            f"block_size) per layer ({src}); these are not:\n{describe_input(items)}"
        )
    if len(shapes) != 1 or len({tuple(t.dtype for t in x) for x in items}) != 1:
        return None  # layers that differ: detect_per_layer groups them
    if h.kv_cache_spec == "mamba" or (n in (3, 4) and h.kv_cache_spec in ("attention", "indexer")):
        raise DetectionError(
            f"vLLM: kv_cache_spec={h.kv_cache_spec!r}, but the entries are {what}: vllm-ascend builds a Mamba layer's state a "
            f"list and these tuples only for {'attention' if n in (1, 2) else 'sparse MLA'} layers ({src})"
        )
    _pairs_layout_hint(h)
    if not all(memory_ordered(t) for x in items for t in x):
        raise DetectionError(
            f"vLLM: per-layer {what} are views in memory order ({src}); these strides are permuted:\n{describe_input(items)}"
        )
    nb, bs, nh = lead
    if h.block_size not in (None, bs) or h.num_kv_heads not in (None, nh):
        raise DetectionError(
            f"vLLM: per-layer {what} [NB={nb}, BS={bs}, NH={nh}] but the hints say block_size={h.block_size}, num_kv_heads="
            f"{h.num_kv_heads}; fix the hints"
        )
    distinct, aliases = split_aliases(items)
    kv = {role: [x[i] for x in distinct] for i, role in enumerate(roles)}
    widths = ", ".join(f"{r} {t.shape[-1]} x {dtype_name(t.dtype)}" for r, t in zip(roles, distinct[0]))
    det = Detection(format=fmt, kv_caches=kv, note=f"vllm-ascend per-layer {what} ({widths}; {src})")
    det.aliases = aliases or None
    return det


def _lists(items: list[Any], h: VllmHints, hints: Any = None) -> Detection | None:
    if all(isinstance(x, tuple) for x in items):
        det = _ascend_tuples(items, h)
        if det is not None:
            return det
    if h.kv_cache_spec == "mamba":
        return _mamba(items)
    if _bound(items):
        return _one_element_lists(items, h, hints)
    shapes = [_pair_shape(x) for x in items]
    if any(s is None for s in shapes):
        if h.kv_cache_spec in ("attention", "mla"):
            raise DetectionError(
                f"vLLM: kv_cache_spec={h.kv_cache_spec!r} but these per-layer lists are neither (K, V) pairs of two "
                f"[NB, BS, NH, HS] tensors nor one-element lists of a KV tensor:\n{describe_input(items)}"
            )
        if all(isinstance(x, (list, tuple)) for x in items):
            return _mamba(items)
        return None  # tensors and lists mixed: the core groups entries by kind (detect_per_layer)
    if len(set(shapes)) != 1:
        return None  # layers of different shapes: detect_per_layer
    _pairs_layout_hint(h)
    k_shape, v_shape = shapes[0]
    distinct, aliases = split_aliases(items)
    pairs = [tuple(p) for p in distinct]
    k0 = pairs[0][0]
    if not all(memory_ordered(t) for p in pairs for t in p):
        raise DetectionError(
            "vLLM: per-layer (K, V) pairs are [NB, BS, NH, HS] tensors in memory order as vllm-ascend allocates them "
            f"({_ASCEND}); these strides are permuted:\n{describe_input(items)}"
        )
    nb, bs, nh, hs = k0.shape
    hv = v_shape[-1]
    fmt, roles, what = _pairs_format(h, hs, hv, items)
    if h.block_size not in (None, bs) or h.num_kv_heads not in (None, nh) or (h.head_size is not None and hs == hv and h.head_size != hs):
        raise DetectionError(
            f"vLLM: per-layer (K, V) pairs [NB={nb}, BS={bs}, NH={nh}, HS={hs}] but the hints say block_size="
            f"{h.block_size}, num_kv_heads={h.num_kv_heads}, head_size={h.head_size}; fix the hints"
        )
    variants, extra = _fp8_variants(h, [t for p in pairs for t in p])
    cands: list[Candidate] = []
    for hv_hints, suffix in variants:
        dtype = _pair_dtype(k0, hv_hints)
        kv: Any = pairs if roles is None else {roles[0]: [p[0] for p in pairs], roles[1]: [p[1] for p in pairs]}
        cands.append(
            Candidate(
                fmt,
                kv,
                dtype,
                note=f"vLLM per-layer {what} ({_ASCEND}){suffix}",
                decided_by={"dtype": dtype_name(dtype)} if suffix and dtype is not None else {},
                label=f"{what}{suffix}",
            )
        )
    det = resolve(cands, engine="vllm", deciding_hints=extra, hints=_given(h), geometry_hints=_GEOMETRY, required=True)
    det.aliases = aliases or None
    return det


def _pairs_layout_hint(h: VllmHints) -> None:
    """vllm-ascend allocates (K, V) pairs in one order only: ``AscendAttentionBackend.
    get_kv_cache_shape`` is ``(2, NB, BS, NH, HS)`` and no ``get_kv_cache_stride_order`` exists
    (``vllm_ascend/attention/attention_v1.py``, vllm-ascend 0.23), the runner drops the 2 and
    views each raw buffer ``[NB, BS, NH, HS]``: an explicit layout hint other than NHD /
    LBNHC contradicts the pairs (``VLLM_KV_CACHE_LAYOUT`` from the environment is not read
    by vllm-ascend and is ignored)."""
    lay = h.kv_cache_layout
    if lay is not None and lay not in ("NHD", "LBNHC"):
        raise DetectionError(
            f"vLLM: kv_cache_layout={lay!r}, but per-layer (K, V) pairs are vllm-ascend's [NB, BS, NH, HS] tensors (tokens "
            f"outside heads, NHD; {_ASCEND} views get_kv_cache_shape (2, NB, BS, NH, HS) without a stride order): no "
            "HND or block-outermost pairs exist. Drop or fix the hint"
        )


def _pairs_format(h: VllmHints, hk: int, hv: int, items: list[Any]) -> tuple[str, tuple[str, str] | None, str]:
    """(format, plane roles or None, description) of pairs whose K width is ``hk`` and V
    width ``hv``. Equal widths: the classic ``NL_X_TWO_X_NB_BS_NH_HS``. Different widths
    (vllm-ascend ``_reshape_kv_cache_tensors``): K and V of an attention spec with
    ``head_size_v`` -> ``K=...+V=...``; an ``AscendMLAAttentionSpec`` layer's (nope, rope)
    caches (``kv_lora_rank``, ``qk_rope_head_dim`` wide: one latent split in two, not K and
    V) -> ``KV=...+KPE=...``, vLLM's MLA names: ``KV`` the compressed latent ``kv_c`` (K's and
    V's source), ``KPE`` the decoupled RoPE key ``k_pe``. Each plane stages at its own width
    (per-plane staging)."""
    if hk == hv:
        return PAIRS_FORMAT, None, "(K, V) pairs"
    mla = h.is_mla is True or (h.head_size is not None and h.head_size == hk + hv != hk)
    gqa = h.is_mla is False or h.kv_cache_spec == "attention" or (h.head_size is not None and h.head_size == hk)
    if h.head_size is not None and h.head_size not in (hk, hk + hv):
        raise DetectionError(
            f"vLLM: per-layer pairs of widths {hk} and {hv} but head_size={h.head_size}: K/V pairs with head_size_v have "
            f"head_size {hk}, MLA (nope, rope) pairs {hk + hv} (kv_lora_rank + qk_rope_head_dim); fix the hint"
        )
    if mla == gqa:
        raise AmbiguousLayoutError(
            f"vLLM: per-layer pairs whose first tensor is {hk} and second {hv} wide: vllm-ascend keeps both K and V of an "
            f"attention spec with head_size_v ({_ASCEND}: v_shape (..., head_size_v)) and an MLA layer's (nope, rope) "
            "caches (kv_lora_rank, qk_rope_head_dim) this way; the bytes are the same, what they hold is not.\n"
            f"tensors:\n{describe_input(items)}\nPass kv_cache_spec ('attention' for K/V, 'mla' for nope/rope) or "
            f"head_size ({hk} for K/V, {hk + hv} for MLA)",
            candidates=[PAIRS_KV_PLANES, PAIRS_MLA_PLANES],
            hints=["kv_cache_spec", "head_size"],
        )
    if mla:
        return PAIRS_MLA_PLANES, ("KV", "KPE"), f"MLA (nope, rope) pairs of widths {hk} and {hv}"
    return PAIRS_KV_PLANES, ("K", "V"), f"(K, V) pairs of head sizes {hk} and {hv} (head_size_v)"


def _pair_dtype(k: torch.Tensor, h: VllmHints) -> torch.dtype | None:
    want = h.element_dtype()
    if k.dtype in (torch.uint8, torch.int8) and want is not None and want != k.dtype and torch.empty(0, dtype=want).element_size() == 1:
        return want
    if want is not None and want != k.dtype and h.cache_dtype not in (None, "auto"):
        raise DetectionError(f"vLLM: the (K, V) tensors are {k.dtype} but cache_dtype={h.cache_dtype!r} says {dtype_name(want)}")
    return None


def _given(h: VllmHints) -> dict[str, Any]:
    """The hints the caller gave, by field name (the environment's layout included) and by
    the names messages use for them."""
    d = h.model_dump(exclude_none=True)
    if "prefill_decode_attention" in d:
        d["VLLM_V1_USE_PREFILL_DECODE_ATTENTION"] = d["prefill_decode_attention"]
    return d


def _half_of_storage(items: list[torch.Tensor]) -> bool:
    """Every tensor views a storage of its own, over exactly half of its bytes (the other
    half addressed by no tensor given)."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in items:
        if t.device.type == "meta":
            return False
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    for ts in by_storage.values():
        nbytes = ts[0].untyped_storage().nbytes()
        if len(ts) != 1 or nbytes == 0 or 2 * ts[0].numel() * ts[0].element_size() != nbytes:
            return False  # several given views share it (a group of a shared buffer's layers), or it is not half used
    return True


def _check_half_of_storage(items: list[torch.Tensor], det: Detection) -> None:
    """A user's mistake that reads like a layout: the K half of each layer (``kv[0]`` of
    FlashAttention's ``(2, NB, BS, NH, HS)``, ``kv[:, 0]`` of FlashInfer's ``(NB, 2, ...)``)
    is a 4-D tensor whose strides fit a 0.26 packed K|V cache with other heads and block
    size. vLLM allocates each layer's memory whole (one raw buffer per KV cache tensor,
    ``gpu_model_runner._allocate_kv_cache_tensors``; 0.33 one buffer every layer's view
    covers), so tensors that address exactly half of every storage they view, the other
    half by no tensor given, are no vLLM allocation on their own: K halves (or V halves),
    or one layer of two of a shared buffer. Without ``vllm_version`` / ``attention_backend``
    this is not answered.

    Raises:
        AmbiguousLayoutError: naming the reading, the halves, and the hints that state it.
    """
    if not _half_of_storage(items):
        return
    t0 = items[0]
    raise AmbiguousLayoutError(
        f"vllm: these tensors read as {det.format} ({det.note}), but each addresses exactly half of its storage "
        f"({t0.numel() * t0.element_size()} of {t0.untyped_storage().nbytes()} bytes) and no tensor given addresses the other "
        "half: vLLM allocates a layer's memory whole, so these look like the K (or V) half of each layer's (2, NB, ...) / "
        "(NB, 2, ...) cache, or one layer of two of a shared buffer. Pass each layer's whole tensor (vLLM's kv_caches "
        "entries); if these are the cache as vLLM allocated it, pass vllm_version or attention_backend.\n"
        f"tensors:\n{describe_input(items)}",
        candidates=[det.format, "the K or V half of a vLLM layer"],
        hints=["vllm_version", "attention_backend"],
    )


def _check_record_width(items: list[torch.Tensor], h: VllmHints) -> None:
    """An MLA-only cache dtype (``fp8_ds_mla``, ``nvfp4_ds_mla``) names records vLLM writes
    at a few widths only (:data:`kvcore_vllm.specs.RECORDS`: ``fp8_ds_mla`` 656 B DeepSeek-V3.2,
    584 B V4, 528 B V4.1; the DSA indexer's 132 / 68 B keys beside them under any MLA cache
    dtype): byte tensors of another width contradict the hint.

    Raises:
        DetectionError: naming the width, the widths the cache dtype's writers produce and
            those writers.
    """
    from kvcore_vllm.hints import MLA_CACHE_DTYPES
    from kvcore_vllm.specs import RECORDS

    t0 = items[0]
    if h.cache_dtype not in MLA_CACHE_DTYPES or t0.dtype not in (torch.uint8, torch.int8) or t0.dim() < 3:
        return
    # the DSA indexer's records (cache_dtypes empty) sit beside the MLA cache under any MLA cache dtype
    allowed = {w: r for w, r in RECORDS.items() if h.cache_dtype in r.cache_dtypes or not r.cache_dtypes}
    w = int(t0.shape[-1])
    if w not in allowed:
        listed = "; ".join(f"{x} B: {r.writer}" for x, r in sorted(allowed.items(), reverse=True))
        raise DetectionError(
            f"vLLM: cache_dtype={h.cache_dtype!r}, but these byte tensors hold {w}-byte rows: no vLLM {h.cache_dtype} writer "
            f"produces {w} bytes per token. Its records are {listed} (kvcore_vllm.specs). Fix cache_dtype, or pass the "
            f"cache's own tensors.\ntensors:\n{describe_input(items)}"
        )


# -- the decision -------------------------------------------------------------------------


def detect_vllm(kv_caches: Any, hints: Any) -> Detection | None:
    """Detect one vLLM KV cache group (see the module docstring).

    Returns:
        a :class:`kvcore.Detection` (``aliases`` set when entries share memory), a not-KV
        Detection (``format=None``), or None when no vLLM layout has this shape at all.
    Raises:
        AmbiguousLayoutError: two layouts fit and place bytes differently.
        DetectionError: the hints contradict the tensors, or a hint value is unknown.
    """
    h = parse_hints(hints)
    raw = {k: v for k, v in (hints or {}).items() if v is not None} if isinstance(hints, dict) else {}
    bare = isinstance(kv_caches, torch.Tensor)
    items = [kv_caches] if bare else list(kv_caches)
    if any(isinstance(x, (list, tuple)) for x in items):
        return _lists(items, h, hints)
    if not all(isinstance(x, torch.Tensor) for x in items):
        return None
    if h.kv_cache_spec == "mamba":
        return _mamba(items)
    t0 = items[0]
    if any(t.dim() != t0.dim() or t.dtype != t0.dtype for t in items):
        return None  # the core groups by signature; a mixed list is not one layout
    _check_record_width(items, h)
    items, aliases = split_aliases(items)
    if t0.dim() == 6 and not bare:
        from kvcore_vllm.rbln import detect_rbln

        det = detect_rbln(items, h)
        if det is not None:
            det.aliases = aliases or None
            return det
    source = _layout_source(h, hints)
    layout_given = h.kv_cache_layout is not None or h.env_kv_cache_layout is not None or h.device_type == "xpu"
    variants, extra = _fp8_variants(h, items)
    readings: list[Reading] = []
    needs: list[str] = []
    unclaimed: list[str] = []
    rejected: list[str] = []
    for hv, suffix in variants:
        rs = candidates(items, hv, evidence=layout_given, layout_source=source, needs=needs, unclaimed=unclaimed, rejected=rejected)
        # one tensor given on its own may be a whole cross-layer buffer (as a cross-layer connector is handed it);
        # in a list it is one layer, unless its rank is no per-layer tensor's
        if bare or (len(items) == 1 and not any(r.rule.rank == t0.dim() for r in rs) and t0.dim() >= 5):
            rs += bare_candidates(items[0], hv, evidence=layout_given, layout_source=source, rejected=rejected)
        for r in rs:
            if suffix:
                r.candidate.label += suffix
                r.candidate.note += suffix
                r.candidate.decided_by["dtype"] = dtype_name(r.candidate.dtype) if r.candidate.dtype else None
        readings += rs
    if readings:
        deciding = _deciding(readings) + extra
        for r in readings:
            r.candidate.decided_by = {k: v for k, v in r.candidate.decided_by.items() if k in deciding}
        geometry = dict(_GEOMETRY)
        if all(r.rule.blocked for r in readings):
            del geometry["head_size"]  # a record's width is its bytes whatever the hint: head_size decides nothing there
        det = resolve([r.candidate for r in readings], engine="vllm", deciding_hints=deciding, hints=_given(h), geometry_hints=geometry)
        # the NEON BFMMLA possibility stands beside the CPU column-major reading only (the answer's own kernel path)
        unclaimed = [u for u in unclaimed if u != NEON_BF16 or (det is not None and det.format == CPU_VEC)]
        if det is not None and unclaimed:
            # the tensors may also be a layout kvcore does not read, and only the platform (or the backend) tells: not a decision
            platform = ("cpu_attn_isa",) if all(u.startswith("vLLM CPU_ATTN") for u in unclaimed) else ("device_type", "attention_backend")
            deciding_unclaimed = [k for k in platform if k not in _given(h)]
            raise AmbiguousLayoutError(
                f"vllm: these tensors read as {det.format} ({det.note}), and may also be {'; '.join(unclaimed)}.\n"
                f"tensors:\n{describe_input(items)}\nPass {' or '.join(deciding_unclaimed)} (the engine's platform) to decide",
                candidates=[det.format, *unclaimed],
                hints=deciding_unclaimed,
            )
        if det is not None and needs:
            # another reading exists that only more hints could build (vLLM 0.11 CPU's flat pages): not a decision
            missing = [m for n in needs for m in ("block_size", "head_size", "num_kv_heads", "dtype") if m in n and m not in _given(h)]
            raise AmbiguousLayoutError(
                f"vllm: these tensors read as {det.format} ({det.note}), and may also be a layout that needs more hints: "
                f"{'; '.join(dict.fromkeys(needs))}.\ntensors:\n{describe_input(items)}\n"
                f"Pass attention_backend, or {', '.join(dict.fromkeys(missing))} to build the other reading",
                candidates=[det.format] + [n.split(":")[0] for n in dict.fromkeys(needs)],
                hints=["attention_backend", *dict.fromkeys(missing)],
            )
        if det is not None and not bare and h.vllm_version is None and h.attention_backend is None:
            _check_half_of_storage(items, det)
        if det is not None:
            if aliases:
                det.aliases = aliases
                det.note += f"; entries {', '.join(f'{i}->{j}' for i, j in aliases.items())} are the memory of an earlier entry (shared KV)"
            return det
    if t0.dim() == 4 and t0.shape[1] == 1 and t0.shape[2] == 1:
        return Detection(
            format=None,
            excluded=f"Mamba state pages {tuple(t0.shape)} ([NB, 1, 1, C]: one state per block, vLLM 0.33 MambaSpec "
            "tokens_per_state=-1, engine_layouts.md §1.14): not KV",
        )
    if t0.dim() < 3:
        return Detection(format=None, excluded=f"tensor of shape {tuple(t0.shape)}: rank < 3 is not a paged vLLM KV cache")
    unclaimed = [u for u in unclaimed if u != NEON_BF16]  # a possibility beside the CPU reading only, never an answer
    if unclaimed:
        raise DetectionError(
            f"vLLM: these tensors are {'; '.join(unclaimed)}.\ntensors:\n{describe_input(items)}\n"
            "Only the platform's own kernels know that order; kvcore reads the CUDA layout of this record (device_type cuda)"
        )
    if rejected:
        raise DetectionError(
            "vLLM: these tensors have the shape of vLLM layouts that cannot hold them:\n"
            + "\n".join(f"  - {r}" for r in rejected)
            + f"\ntensors:\n{describe_input(items)}"
        )
    _explain_misfit(items, h, raw, needs)
    return None
