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
ASCEND_SOURCE = "vllm-ascend vllm_ascend/worker/model_runner_v1.py::NPUModelRunner._reshape_kv_cache_tensors"
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
    ]


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


def pairs_fixtures() -> list[FixtureCase]:
    """The conformance fixtures of every pairs format (K/V of 32 and 16 elements; MLA
    (nope, rope) of 32 and 8 with one head)."""
    return [
        pairs_fixture(),
        _planes_fixture("vllm-ascend-pairs-head_size_v", PAIRS_KV_PLANES, "attention", 16, 2),
        _planes_fixture("vllm-ascend-pairs-mla", PAIRS_MLA_PLANES, "mla", 8, 1),
    ]
