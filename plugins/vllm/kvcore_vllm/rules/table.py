"""The rule table in detection order (the first of byte-identical readings names the group in
messages), and the named view transforms and plane builders the rules refer to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvcore_vllm.hints import VllmHints
from kvcore_vllm.rules.classic import CLASSIC_RULES
from kvcore_vllm.rules.cpu import CPU_RULES, _p_cpu_amx, _p_cpu_vec, _t_kv_rows
from kvcore_vllm.rules.head_slots import SLOT_RULES, _t_head_slots, _t_head_slots_nhd
from kvcore_vllm.rules.kv_cache_layout import LAYOUT_RULES
from kvcore_vllm.rules.mla import MLA_RULES, _p_rocm_tiles, _t_squeeze_head
from kvcore_vllm.rules.packed import PACKED_RULES
from kvcore_vllm.rules.paged import PAGED_RULES, _p_split_kv, _t_paged, _t_paged5, _t_paged_ipex
from kvcore_vllm.rules.rule import Rule
from kvcore_vllm.rules.tpu import TPU_RULES, _t_pallas

RULES: tuple[Rule, ...] = CLASSIC_RULES + PACKED_RULES + LAYOUT_RULES + PAGED_RULES + SLOT_RULES + CPU_RULES + TPU_RULES + MLA_RULES

PLANE_BUILDERS: dict[str, Callable[[torch.Tensor, Sequence[str], VllmHints], dict[str, torch.Tensor] | None]] = {
    "split_kv": lambda v, tokens, h: _p_split_kv(v, tokens),
    "rocm_tiles": lambda v, tokens, h: _p_rocm_tiles(v, tokens),
    "cpu_vec": _p_cpu_vec,
    "cpu_amx": _p_cpu_amx,
}


TRANSFORMS: dict[str, Callable[[torch.Tensor, VllmHints], torch.Tensor | None]] = {
    "squeeze_head": _t_squeeze_head,
    "kv_rows": _t_kv_rows,
    "paged": _t_paged,
    "pallas": _t_pallas,
    "paged5": _t_paged5,
    "head_slots": _t_head_slots,
    "head_slots_nhd": _t_head_slots_nhd,
    "paged_ipex": _t_paged_ipex,
}
