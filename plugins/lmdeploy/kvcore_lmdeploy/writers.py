"""LMDeploy's own fill op as the conformance suite's writer oracle (:class:`kvcore.testing.Writer`).

``lmdeploy/pytorch/kernels/cuda/fill_kv_cache.py::fill_kv_cache`` (LMDeploy 0.18.0) is the
Triton kernel LMDeploy's CUDA attention writes the paged ``bshd`` cache with. Triton's
interpreter runs it on CPU tensors (``TRITON_INTERPRET=1``), so the suite runs LMDeploy's own
kernel in the engine environment ``.venvs/lmdeploy`` (``scripts/engine_envs.py``: LMDeploy
pins torch <= 2.12.1 and triton <= 3.7.1, so it is installed there without its pins, beside
the CPU torch; its kernels import with the few packages that env lists).

Slots: one sequence per slot, decoding one token (``q_seq_length`` 1, ``kv_seq_length`` =
the slot's offset + 1, a block table holding the slot's block), which is how the kernel
addresses ``block_offsets[b][kv_pos // BS] * BS + kv_pos % BS``. An MLA latent is written
K-only (``v_states`` None), as LMDeploy's MLA attention calls it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvcore.testing import Writer

__all__ = ["fill_writer", "no_writer_reason", "NOT_THIS_VERSION"]

SOURCE = "lmdeploy 0.18.0 lmdeploy/pytorch/kernels/cuda/fill_kv_cache.py::fill_kv_cache (_fill_kv_cache_kernel)"

#: why older cuda fixtures of the same format carry no writer
NOT_THIS_VERSION = (
    "the writer runs LMDeploy 0.18.0's fill_kv_cache, whose cache is the 0.14.0 fixture's: that fixture of the same format is proved by it"
)


def no_writer_reason(name: str) -> str:
    """Why fixture ``name`` carries no writer."""
    if any(q in name for q in ("-int4", "-int8", "-turbo")):
        return (
            "LMDeploy's quantising fill computes the int4/int8/TurboQuant values and their scales from float states, so "
            "it cannot write given rows; the writer checks move raw K/V rows"
        )
    if "-cuda-" not in name:
        return "LMDeploy writes this device's cache with dlinfer's fill op (Ascend, Cambricon, MACA), which does not run here"
    return (
        "the 0.11.1+ cross-layer pool: fill_kv_cache writes its per-layer slices, the layout of the per-layer fixture "
        "proved by it; the writer checks do not cover multi-plane names yet"
    )


def _fill(kv_caches: Any, slots: torch.Tensor, rows: dict, *, hints: dict) -> None:
    from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache

    t = len(slots)
    for layer, entry in enumerate(kv_caches):
        k_cache, v_cache = (entry[0], entry[1]) if isinstance(entry, (list, tuple)) else (entry, None)
        bs = k_cache.shape[1]
        dev = k_cache.device
        v = rows.get("V")
        if v_cache is not None and v_cache.shape[-1] == 0:
            v_cache = None  # the MLA latent: V is K's first v_head_dim elements
        fill_kv_cache(
            rows["K"][layer],
            None if v is None or v_cache is None else v[layer],
            k_cache,
            v_cache,
            q_start_loc=torch.arange(t, device=dev),
            q_seq_length=torch.ones(t, dtype=torch.long, device=dev),
            kv_seq_length=(slots % bs + 1).to(dev),
            max_q_seq_length=1,
            block_offsets=(slots // bs).view(t, 1).to(dev),
        )


def _interpreter() -> str | None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        return "LMDeploy's fill op is a Triton kernel: on a machine without a GPU it runs only under TRITON_INTERPRET=1"
    return None


def fill_writer() -> Writer:
    return Writer(
        name="lmdeploy.pytorch.kernels.cuda.fill_kv_cache",
        write=_fill,
        source=SOURCE,
        requires=("lmdeploy.pytorch.kernels.cuda.fill_kv_cache",),
        ready=_interpreter,
    )
