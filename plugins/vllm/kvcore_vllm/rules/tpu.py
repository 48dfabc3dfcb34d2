"""vLLM's TPU Pallas backend (0.11 - 0.13): ``(NB, BS, 2*NH, ceil128(HS))``, K and V interleaved per head."""

from __future__ import annotations

import torch

from kvcore_vllm.hints import VllmHints
from kvcore_vllm.rules.rule import Rule, _o, _src
from kvcore_vllm.rules.sources import _PALLAS

TPU_RULES: tuple[Rule, ...] = (
    Rule(
        label="TPU Pallas (NB, BS, 2*NH, ceil128(HS)), K/V interleaved per head",
        eras=("0.11", "0.13"),
        families=("PALLAS",),
        rank=4,
        logical=_o("NB BS NH TWO HS"),
        layouts={"NHD": _o("NL NB BS NH TWO HS")},
        sources=(_src("0.11.0", _PALLAS + " (l.100); write_to_kv_cache cat([k, v], -1).reshape(-1, 2H, D)"),),
        transform="pallas",
        gate="tpu",
        backends_label=("PALLAS",),
    ),
)


def _t_pallas(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # (B, N, 2H, P) -> (B, N, H, 2, D): K and V alternate on the head axis; D = head_size (<= P)
    b, n, h2, p = t.shape
    if h2 % 2 or t.stride(3) != 1:
        return None
    d = h.head_size or p
    if d > p:
        return None
    return torch.as_strided(t, (b, n, h2 // 2, 2, d), (t.stride(0), t.stride(1), 2 * t.stride(2), t.stride(2), 1), t.storage_offset())
