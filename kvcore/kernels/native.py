"""Native kernels (C++ CPU, CUDA) registered as ``torch.ops.kvcore.*``. Filled in by the
native-kernels work; until then it offers none."""

from __future__ import annotations


def kernels() -> list:
    return []
