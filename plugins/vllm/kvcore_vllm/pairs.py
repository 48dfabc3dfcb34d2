"""Per-layer ``(K, V)`` pairs: vLLM on Ascend NPUs (vllm-ascend) and connectors that keep
the pre-V1 convention of one K tensor and one V tensor per layer.

vllm-ascend's ``NPUModelRunner._reshape_kv_cache_tensors``
(``vllm_ascend/worker/model_runner_v1.py``) takes its attention backend's shape
``(2, num_blocks, block_size, num_kv_heads, head_size)``
(``vllm_ascend/attention/attention_v1.py::AscendAttentionBackend.get_kv_cache_shape``),
drops the leading 2, and views one raw int8 buffer per K and one per V as
``[NB, BS, NH, HS]`` of the cache dtype: ``kv_caches[layer_name] = (k_cache, v_cache)``.
No permute: the tensors are in memory order. kvcore names that ``NL_X_TWO_X_NB_BS_NH_HS``.

Its MLA branch keeps ``(nope, rope)`` caches of different widths (``kv_lora_rank``,
``qk_rope_head_dim``) in the same tuple slot; they are not K and V, and detection says so.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import GeometryError, KVFormat, Source
from kvcore.testing import FixtureCase

__all__ = ["PAIRS_FORMAT", "ASCEND_SOURCE", "pairs_format", "allocate_pairs", "pairs_fixture"]

PAIRS_FORMAT = "NL_X_TWO_X_NB_BS_NH_HS"
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


def allocate_pairs(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: Any = "cpu",
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What vllm-ascend hands a connector: ``{layer_name: (k_cache, v_cache)}``, each a view
    of its own int8 buffer as ``[NB, BS, NH, HS]`` of ``dtype``.

    Raises:
        GeometryError: a size below 1.
    """
    if min(num_layers, num_blocks, block_size, num_kv_heads, head_size) < 1:
        raise GeometryError("every size of a vllm-ascend cache is at least 1")
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    nbytes = num_blocks * block_size * num_kv_heads * head_size * torch.empty(0, dtype=dtype).element_size()
    out = {}
    for i in range(num_layers):
        k = torch.zeros(nbytes, dtype=torch.int8, device=device).view(dtype).view(shape)
        v = torch.zeros(nbytes, dtype=torch.int8, device=device).view(dtype).view(shape)
        out[f"model.layers.{i}.self_attn.attn"] = (k, v)
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
