"""kvcore-xpu: the Intel XPU device backend for kvcore.

One generic gather/scatter kernel written in Triton, ``triton-xpu``, driven by the
layout's stride table like every kvcore kernel (no switch on format names). It serves
XPU caches, CUDA caches when forced (``KVCORE_KERNEL=triton-xpu``), and CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, forced), which is how it is proven
on machines without an Intel GPU. See :mod:`kvcore_xpu.kernel`.
"""

from __future__ import annotations

from .kernel import KERNEL, NAME, TritonKernel, interpreting, triton_version

__all__ = ["KERNEL", "NAME", "TritonKernel", "interpreting", "triton_version"]
