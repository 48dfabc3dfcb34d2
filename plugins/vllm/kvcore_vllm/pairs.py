"""Per-layer ``(K, V)`` pairs: vLLM on Ascend NPUs (vllm-ascend) and connectors that keep
the pre-V1 convention of one K tensor and one V tensor per layer.

vllm-ascend's ``NPUModelRunner._reshape_kv_cache_tensors``
(``vllm_ascend/worker/model_runner_v1.py``) takes its attention backend's shape
``(2, num_blocks, block_size, num_kv_heads, head_size)``
(``vllm_ascend/attention/attention_v1.py::AscendAttentionBackend.get_kv_cache_shape``),
drops the leading 2, and views one raw int8 buffer per K and one per V as
``[NB, BS, NH, HS]`` of the cache dtype: ``kv_caches[layer_name] = (k_cache, v_cache)``.
No permute: the tensors are in memory order. kvcore names that ``NL_X_TWO_X_NB_BS_NH_HS``.

K and V may differ in width: an attention spec with ``head_size_v`` gets V
``(..., head_size_v)`` (``v_shape = (*kv_cache_shape[1:-1], head_size_v)``), and the MLA branch
(``AscendMLAAttentionSpec``) keeps an MLA layer's ``(nope, rope)`` caches of ``kv_lora_rank``
and ``qk_rope_head_dim`` elements in the same two slots (one latent split in two: not K and V).
Both are multi-plane names whose planes stage at their own widths: ``K=...+V=...``
(:data:`PAIRS_KV_PLANES`) and ``KV=...+KPE=...`` (:data:`PAIRS_MLA_PLANES`: vLLM's MLA names, the
latent ``kv_c`` and the RoPE key ``k_pe``); the bytes are
the same, so ``kv_cache_spec`` (``attention`` / ``mla``) or ``head_size`` says which.

Read from vllm-ascend 0.23.0.post1 (sdist): ``vllm_ascend/worker/model_runner_v1.py``
(``k_shape`` / ``v_shape``), ``vllm_ascend/attention/attention_v1.py``, ``fa3_v1.py`` (no
``get_kv_cache_stride_order`` anywhere: one order, NHD; ``get_kv_cache_layout()`` is not read).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import GeometryError, KVFormat, Source
from kvcore.testing import FixtureCase

__all__ = [
    "DSA_PLANES",
    "DSA_C8_PLANES",
    "ONE_PLANE",
    "INDEXER_PLANES",
    "INDEXER_KEYS",
    "allocate_ascend_tuples",
    "PAIRS_FORMAT",
    "PAIRS_KV_PLANES",
    "PAIRS_MLA_PLANES",
    "ASCEND_SOURCE",
    "pairs_format",
    "pairs_formats",
    "allocate_pairs",
    "pairs_fixture",
    "pairs_fixtures",
]

PAIRS_FORMAT = "NL_X_TWO_X_NB_BS_NH_HS"
#: K and V of different head sizes (``head_size_v``): one plane each, staged at its own width.
PAIRS_KV_PLANES = "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS"
#: an MLA layer's (nope, rope) caches: the compressed latent ``kv_c`` (``KV``, the value role of an
#: MLA cache) and the decoupled RoPE key ``k_pe`` (``KPE``), one plane each.
PAIRS_MLA_PLANES = "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS"
#: vllm-ascend 0.18 DeepSeek-V3.2 (sparse attention) layer: ``(k_cache, v_cache, dsa_k_cache)`` -- the
#: MLA latent's nope and rope caches and the lightning indexer's keys ``(NB, BS, NH, index_head_dim)``
#: in the spec's dtype; ``IK`` is the indexer-key plane.
DSA_PLANES = "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS+IK=NL_X_NB_BS_NH_HS"
#: with the sparse C8 indexer: ``(k_cache, v_cache, dsa_k_cache, dsa_k_scale_cache)``, the keys int8 and
#: one float16 scale per token ``(NB, BS, NH, 1)`` (``IKS``).
DSA_C8_PLANES = "KV=NL_X_NB_BS_NH_HS+KPE=NL_X_NB_BS_NH_HS+IK=NL_X_NB_BS_NH_HS+IKS=NL_X_NB_BS_NH_HS"
#: vllm-ascend 0.23+ one-plane tuples ``(k_cache,)``: a sparse-C8 MLA layer's int8 cache, or an SFA
#: indexer layer's keys without scales (``AscendSFAIndexerCacheSpec``): one record per token.
ONE_PLANE = "KV=NL_X_NB_BS_NH_HS"
#: the same one-plane tuple of an SFA indexer layer, named so by ``kv_cache_spec="indexer"``.
INDEXER_KEYS = "K=NL_X_NB_BS_NH_HS"
#: vllm-ascend 0.23+ SFA indexer layer with scales: ``(indexer_k_cache, indexer_scale_cache)``.
INDEXER_PLANES = "K=NL_X_NB_BS_NH_HS+KS=NL_X_NB_BS_NH_HS"
ASCEND_SOURCE = "vllm-ascend vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._reshape_kv_cache_tensors"
#: the releases each tuple convention is read from (git tags of vllm-project/vllm-ascend).
ASCEND_DSA_SOURCE = (
    "vllm-ascend v0.18.0 vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._allocate_kv_cache_tensors "
    "(use_sparse: raw (k, v, dsa_k[, dsa_k_scale]) int8 buffers) / ::_reshape_kv_cache_tensors (dsa_k_cache_shape "
    "(num_blocks, block_size, num_kv_heads, index_head_dim); C8: int8 keys, float16 scales (..., 1))"
)
ASCEND_SFA_SOURCE = (
    "vllm-ascend v0.23.0 vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._reshape_kv_cache_tensors "
    "(AscendSFAIndexerCacheSpec: (indexer_k_cache,) or (indexer_k_cache, indexer_scale_cache); sparse SFA C8 MLA: (k_cache,))"
)
_SOURCES = (
    Source(
        engine="vllm", version="vllm-ascend main", file="vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._reshape_kv_cache_tensors"
    ),
    Source(
        engine="vllm", version="vllm-ascend main", file="vllm_ascend/attention/attention_v1.py::AscendAttentionBackend.get_kv_cache_shape"
    ),
)


def pairs_format() -> KVFormat:
    """The :class:`kvcore.KVFormat` of per-layer (K, V) pairs."""
    return KVFormat(
        name=PAIRS_FORMAT,
        engines=["vllm"],
        attention_backends=["ASCEND"],
        description="vllm-ascend: per layer a (K, V) tuple of [NB, BS, NH, HS] tensors (one raw buffer each, no permute)",
        sources=list(_SOURCES),
    )


def pairs_formats() -> list[KVFormat]:
    """The formats of per-layer pairs: equal widths, K/V with ``head_size_v``, MLA (nope, rope)."""
    return [
        pairs_format(),
        KVFormat(
            name=PAIRS_KV_PLANES,
            engines=["vllm"],
            attention_backends=["ASCEND"],
            description="vllm-ascend: per layer a (K, V) tuple of [NB, BS, NH, HS] and [NB, BS, NH, head_size_v] tensors",
            sources=list(_SOURCES),
        ),
        KVFormat(
            name=PAIRS_MLA_PLANES,
            engines=["vllm"],
            attention_backends=["ASCEND"],
            description="vllm-ascend MLA: per layer a (nope, rope) tuple of [NB, BS, 1, kv_lora_rank] and "
            "[NB, BS, 1, qk_rope_head_dim] tensors",
            sources=list(_SOURCES),
        ),
        KVFormat(
            name=DSA_PLANES,
            engines=["vllm"],
            attention_backends=["ASCEND (sparse attention)"],
            description="vllm-ascend DeepSeek-V3.2: per layer a (k, v, dsa_k) tuple: the MLA latent's nope and rope caches "
            "and the indexer keys, each [NB, BS, 1, width]",
            sources=[Source(engine="vllm", version="vllm-ascend 0.18.0", file=ASCEND_DSA_SOURCE)],
        ),
        KVFormat(
            name=DSA_C8_PLANES,
            engines=["vllm"],
            attention_backends=["ASCEND (sparse attention, C8 indexer)"],
            description="vllm-ascend DeepSeek-V3.2 sparse C8: per layer a (k, v, dsa_k, dsa_k_scale) tuple: nope, rope, "
            "int8 indexer keys, float16 key scales [NB, BS, 1, 1]",
            sources=[Source(engine="vllm", version="vllm-ascend 0.18.0", file=ASCEND_DSA_SOURCE)],
        ),
        KVFormat(
            name=ONE_PLANE,
            engines=["vllm"],
            attention_backends=["ASCEND (sparse C8 MLA, SFA indexer)"],
            description="vllm-ascend: per layer a one-tensor tuple (k_cache,) [NB, BS, 1, width]: one record per token",
            sources=[Source(engine="vllm", version="vllm-ascend 0.23.0", file=ASCEND_SFA_SOURCE)],
        ),
        KVFormat(
            name=INDEXER_KEYS,
            engines=["vllm"],
            attention_backends=["ASCEND (SFA indexer)"],
            description="vllm-ascend SFA indexer layer without scales: per layer a one-tensor tuple (indexer_k,) [NB, BS, 1, width]",
            sources=[Source(engine="vllm", version="vllm-ascend 0.23.0", file=ASCEND_SFA_SOURCE)],
        ),
        KVFormat(
            name=INDEXER_PLANES,
            engines=["vllm"],
            attention_backends=["ASCEND (SFA indexer)"],
            description="vllm-ascend SFA indexer layer: per layer an (indexer_k, indexer_scale) tuple [NB, BS, 1, width] of two dtypes",
            sources=[Source(engine="vllm", version="vllm-ascend 0.23.0", file=ASCEND_SFA_SOURCE)],
        ),
    ]


def allocate_ascend_tuples(
    kind: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    widths: tuple[int, ...] = (512, 64, 128),
    dtype: torch.dtype = torch.bfloat16,
    key_dtype: torch.dtype = torch.int8,
    scale_dtype: torch.dtype = torch.float16,
    device: Any = "cpu",
) -> dict[str, tuple[torch.Tensor, ...]]:
    """vllm-ascend's tuple entries, allocated as its runner does: one raw int8 buffer per
    slot (``torch.zeros(size, dtype=torch.int8)``), viewed as its dtype and as
    ``(num_blocks, block_size, num_kv_heads=1, width)``; ``{layer_name: tuple}``.

    ``kind``: ``"dsa"`` ``(k, v, dsa_k)`` (``widths`` = kv_lora_rank, qk_rope_head_dim,
    index_head_dim; all ``dtype``), ``"dsa_c8"`` ``(k, v, dsa_k, dsa_k_scale)`` (keys
    ``key_dtype``, scales ``scale_dtype`` of width 1), ``"one"`` ``(k_cache,)`` (``widths[0]``,
    ``key_dtype``: the sparse-C8 MLA cache), ``"indexer"`` ``(indexer_k, indexer_scale)``
    (``widths[-1]`` keys of ``key_dtype``, width-1 ``scale_dtype`` scales). Sources:
    :data:`ASCEND_DSA_SOURCE`, :data:`ASCEND_SFA_SOURCE`.

    Raises:
        GeometryError: an unknown ``kind`` or a size below 1.
    """
    kinds = ("dsa", "dsa_c8", "one", "indexer")
    if kind not in kinds:
        raise GeometryError(f"allocate_ascend_tuples: kind must be one of {kinds}, got {kind!r}")
    if len(widths) < (3 if kind.startswith("dsa") else 1) or min(num_layers, num_blocks, block_size, *widths) < 1:
        raise GeometryError("every size of a vllm-ascend cache is at least 1 (dsa kinds take three widths)")
    plans = {
        "dsa": lambda: [(widths[0], dtype), (widths[1], dtype), (widths[2], dtype)],
        "dsa_c8": lambda: [(widths[0], dtype), (widths[1], dtype), (widths[2], key_dtype), (1, scale_dtype)],
        "one": lambda: [(widths[0], key_dtype)],
        "indexer": lambda: [(widths[-1], key_dtype), (1, scale_dtype)],
    }
    out = {}
    for i in range(num_layers):
        slots = []
        for width, dt in plans[kind]():
            shape = (num_blocks, block_size, 1, width)
            nbytes = num_blocks * block_size * width * torch.empty(0, dtype=dt).element_size()
            slots.append(torch.zeros(nbytes, dtype=torch.int8, device=device).view(dt).view(shape))
        out[f"model.layers.{i}.self_attn.attn"] = tuple(slots)
    return out


def allocate_pairs(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: Any = "cpu",
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What vllm-ascend hands a connector: ``{layer_name: (k_cache, v_cache)}``, each a view
    of its own int8 buffer as ``[NB, BS, NH, HS]`` of ``dtype`` (V ``[NB, BS, NH,
    head_size_v]`` when given: an attention spec's ``head_size_v``, or an MLA layer's
    ``qk_rope_head_dim`` beside ``kv_lora_rank`` = ``head_size``).

    Raises:
        GeometryError: a size below 1.
    """
    hv = head_size if head_size_v is None else head_size_v
    if min(num_layers, num_blocks, block_size, num_kv_heads, head_size, hv) < 1:
        raise GeometryError("every size of a vllm-ascend cache is at least 1")
    esz = torch.empty(0, dtype=dtype).element_size()
    out = {}
    for i in range(num_layers):
        pair = []
        for width in (head_size, hv):
            shape = (num_blocks, block_size, num_kv_heads, width)
            nbytes = num_blocks * block_size * num_kv_heads * width * esz
            pair.append(torch.zeros(nbytes, dtype=torch.int8, device=device).view(dtype).view(shape))
        out[f"model.layers.{i}.self_attn.attn"] = tuple(pair)
    return out


def pairs_fixture() -> FixtureCase:
    """The conformance fixture: the allocation above, read as the NPU attention reads it
    (``k_cache``, ``v_cache`` are ``[NB, BS, NH, HS]`` as they are)."""

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        kv = allocate_pairs(
            num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"],
            num_kv_heads=sizes["num_heads"], head_size=sizes["head_size"], dtype=dtype, device=device,
        )  # fmt: skip
        return kv, {"block_size": sizes["block_size"], "num_kv_heads": sizes["num_heads"], "head_size": sizes["head_size"]}

    def view(kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
        return list(kv_caches.values())[layer][kv]

    return FixtureCase(
        name="vllm-ascend-pairs",
        engine="vllm",
        format=PAIRS_FORMAT,
        make=make,
        kv_view=view,
        sizes={"num_layers": 2, "num_blocks": 4, "block_size": 8, "num_heads": 2, "head_size": 16},
        dtypes=(torch.bfloat16, torch.float16, torch.float32),
        source=f"vllm {ASCEND_SOURCE}",
    )


def _planes_fixture(name: str, fmt: str, spec: str, hv: int, nh: int) -> FixtureCase:
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        kv = allocate_pairs(
            num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"],
            num_kv_heads=sizes["num_heads"], head_size=sizes["head_size"], head_size_v=hv, dtype=dtype, device=device,
        )  # fmt: skip
        return kv, {"block_size": sizes["block_size"], "num_kv_heads": sizes["num_heads"], "kv_cache_spec": spec}

    def view(kv_caches: Any, layer: int, plane: int) -> torch.Tensor:
        return list(kv_caches.values())[layer][plane]  # the tuple's slots as vllm-ascend's attention reads them

    return FixtureCase(
        name=name,
        engine="vllm",
        format=fmt,
        make=make,
        kv_view=view,
        sizes={"num_layers": 2, "num_blocks": 4, "block_size": 8, "num_heads": nh, "head_size": 32},
        dtypes=(torch.bfloat16, torch.float16, torch.float32),
        source=f"vllm {ASCEND_SOURCE} (k_shape / v_shape)",
    )


def _tuples_fixture(kind: str, fmt: str, dtypes: tuple[torch.dtype, ...], spec: str | None = None) -> FixtureCase:
    """A vllm-ascend tuple convention (:func:`allocate_ascend_tuples`), read as vllm-ascend's
    attention reads it: slot ``p`` of layer ``layer``'s tuple, ``(NB, BS, 1, width)`` as it is."""

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        hs = sizes["head_size"]
        widths = (hs, max(1, hs // 4), max(1, hs // 2)) if kind.startswith("dsa") else (hs,)
        kv = allocate_ascend_tuples(
            kind, num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"],
            widths=widths, dtype=dtype, key_dtype=dtype if kind in ("one", "indexer") else torch.int8,
            scale_dtype=torch.float32 if dtype == torch.float16 else torch.float16, device=device,
        )  # fmt: skip
        spec_hint = spec or ("indexer" if kind == "indexer" else None)
        return kv, {"block_size": sizes["block_size"], **({"kv_cache_spec": spec_hint} if spec_hint else {})}

    def view(kv_caches: Any, layer: int, plane: int) -> torch.Tensor:
        return list(kv_caches.values())[layer][plane]

    return FixtureCase(
        name=f"vllm-ascend-tuples-{kind}" + (f"-{spec}" if spec else ""),
        engine="vllm",
        format=fmt,
        make=make,
        kv_view=view,
        sizes={"num_layers": 2, "num_blocks": 4, "block_size": 8, "num_heads": 1, "head_size": 32},
        dtypes=dtypes,
        source=f"vllm {ASCEND_DSA_SOURCE if kind.startswith('dsa') else ASCEND_SFA_SOURCE}",
    )


def pairs_fixtures() -> list[FixtureCase]:
    """The conformance fixtures of every pairs format (K/V of 32 and 16 elements; MLA
    (nope, rope) of 32 and 8 with one head)."""
    return [
        pairs_fixture(),
        _planes_fixture("vllm-ascend-pairs-head_size_v", PAIRS_KV_PLANES, "attention", 16, 2),
        _planes_fixture("vllm-ascend-pairs-mla", PAIRS_MLA_PLANES, "mla", 8, 1),
        _tuples_fixture("dsa", DSA_PLANES, (torch.bfloat16, torch.float16)),
        _tuples_fixture("dsa_c8", DSA_C8_PLANES, (torch.bfloat16, torch.float16)),
        _tuples_fixture("one", ONE_PLANE, (torch.bfloat16,)),
        _tuples_fixture("one", INDEXER_KEYS, (torch.bfloat16,), spec="indexer"),
        _tuples_fixture("indexer", INDEXER_PLANES, (torch.bfloat16,)),
    ]
