"""vLLM on Rebellions NPUs (vllm-rbln): ``NL_X_TWO_NB_NH_ONE_BS_HS``.

vllm-rbln's attention backend (``vllm_rbln/v1/attention/backends/flash_attention.py::
RBLNFlashAttentionBackend.get_kv_cache_shape``, registered as ``FLASH_ATTN``) returns
``(2, num_blocks, num_kv_heads, 1, block_size, head_size)`` -- "kv_cache_shape = [B, H, 1,
S, D]" per K and V, the singleton the RBLN attention kernel's query ``[1, H, G, L, D]``
needs -- and defines no ``get_kv_cache_stride_order``, so ``RBLNModelRunner.
_reshape_kv_cache_tensors`` (``vllm_rbln/v1/worker/rbln_model_runner.py``) views each
layer's raw int8 buffer as the dtype and as that shape, in memory order (identity stride
order). The backend never reads ``get_kv_cache_layout()``: a ``kv_cache_layout`` of NHD /
HND (what a connector reads from vLLM's global setting) does not change it. Read from
RBLN-SW/vllm-rbln (main, 2026-06; tags v0.9.x carry the same shape).

The engine's attention reads ``kv_cache[kv]`` as ``[NB, NH, 1, BS, HS]``: token ``t`` of
block ``b``, head ``h`` is ``kv_cache[kv, b, h, 0, t]`` (:func:`rbln_view`).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import Detection, DetectionError, GeometryError, KVFormat, Source
from kvcore.detection import describe_input
from kvcore.testing import FixtureCase

__all__ = ["RBLN_FORMAT", "RBLN_SOURCE", "rbln_format", "allocate_rbln", "rbln_view", "rbln_fixture", "detect_rbln"]

RBLN_FORMAT = "NL_X_TWO_NB_NH_ONE_BS_HS"
RBLN_SOURCE = (
    "vllm-rbln vllm_rbln/v1/attention/backends/flash_attention.py::RBLNFlashAttentionBackend.get_kv_cache_shape "
    "(2, num_blocks, num_kv_heads, 1, block_size, head_size); vllm_rbln/v1/worker/rbln_model_runner.py::"
    "RBLNModelRunner._reshape_kv_cache_tensors (raw int8 .view(dtype).view(shape), identity stride order)"
)


def rbln_format() -> KVFormat:
    return KVFormat(
        name=RBLN_FORMAT,
        engines=["vllm"],
        attention_backends=["RBLN FLASH_ATTN (vllm-rbln)"],
        description="vllm-rbln: per layer (2, NB, NH, 1, BS, HS), HND with the singleton the RBLN kernel needs",
        sources=[Source(engine="vllm", version="vllm-rbln main", file=RBLN_SOURCE)],
    )


def allocate_rbln(
    *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype=torch.bfloat16, device: Any = "cpu"
) -> dict[str, torch.Tensor]:
    """``{layer_name: kv_cache}`` as vllm-rbln builds it: one raw int8 buffer per layer,
    ``.view(dtype).view((2, NB, NH, 1, BS, HS))``.

    Raises:
        GeometryError: a size below 1.
    """
    if min(num_layers, num_blocks, block_size, num_kv_heads, head_size) < 1:
        raise GeometryError("every size of a vllm-rbln cache is at least 1")
    shape = (2, num_blocks, num_kv_heads, 1, block_size, head_size)
    nbytes = 2 * num_blocks * num_kv_heads * block_size * head_size * torch.empty(0, dtype=dtype).element_size()
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(nbytes, dtype=torch.int8, device=device).view(dtype).view(shape)
        for i in range(num_layers)
    }


def rbln_view(kv_caches: Any, layer: int, kv: int) -> torch.Tensor:
    """The engine's K (kv=0) or V (kv=1) of one layer as ``[NB, BS, NH, HS]``: RBLN's
    attention takes ``kv_cache[kv]`` ``[B, H, 1, S, D]``; drop the singleton, tokens before heads."""
    t = list(kv_caches.values())[layer] if isinstance(kv_caches, dict) else kv_caches[layer]
    return t[kv].squeeze(2).transpose(1, 2)


def rbln_fixture() -> FixtureCase:
    def make(sizes: dict, dtype: torch.dtype, device: Any):
        kv = allocate_rbln(
            num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"],
            num_kv_heads=sizes["num_heads"], head_size=sizes["head_size"], dtype=dtype, device=device,
        )  # fmt: skip
        return kv, {}

    return FixtureCase(
        name="vllm-rbln",
        engine="vllm",
        format=RBLN_FORMAT,
        make=make,
        kv_view=rbln_view,
        sizes={"num_layers": 2, "num_blocks": 4, "block_size": 8, "num_heads": 2, "head_size": 16},
        dtypes=(torch.bfloat16, torch.float16, torch.float32),
        source=f"vllm {RBLN_SOURCE}",
    )


def detect_rbln(items: list[torch.Tensor], h: Any) -> Detection | None:
    """vllm-rbln's 6-D per-layer caches ``(2, NB, NH, 1, BS, HS)`` in memory order, or None
    for tensors of another shape.

    Raises:
        DetectionError: a 0.33 block-outermost or heads-outermost ``kv_cache_layout`` (no
            vllm-rbln cache has it), permuted strides, or geometry hints the tensors contradict.
    """
    t0 = items[0]
    if t0.dim() != 6 or t0.shape[0] != 2 or t0.shape[3] != 1 or any(t.shape != t0.shape for t in items):
        return None
    _, nb, nh, _, bs, hs = (int(x) for x in t0.shape)
    lay = h.kv_cache_layout
    if lay is not None and lay not in ("NHD", "HND", "LBNHC", "LBHNC"):
        raise DetectionError(
            f"vLLM: kv_cache_layout={lay!r}, but these are vllm-rbln's per-layer (2, NB, NH, 1, BS, HS) caches ({RBLN_SOURCE}); "
            "that backend allocates one order whatever the layout setting, and no block- or heads-outermost one"
        )
    for t in items:
        if not t.is_contiguous():
            raise DetectionError(
                f"vLLM: 6-D (2, NB, NH, 1, BS, HS) caches are vllm-rbln's, allocated in memory order ({RBLN_SOURCE}); these "
                f"strides are permuted:\n{describe_input(items)}"
            )
    bad = [
        (k, v, w)
        for k, v, w in (("block_size", h.block_size, bs), ("num_kv_heads", h.num_kv_heads, nh), ("head_size", h.head_size, hs))
        if v not in (None, w)
    ]
    if bad:
        raise DetectionError(
            "vLLM: vllm-rbln caches (2, NB, NH, 1, BS, HS) = "
            f"{tuple(t0.shape)}, but " + ", ".join(f"{k}={v} (the tensors hold {w})" for k, v, w in bad)
        )
    return Detection(format=RBLN_FORMAT, kv_caches=list(items), note=f"vllm-rbln (2, NB, NH, 1, BS, HS) per layer ({RBLN_SOURCE})")
