"""vLLM 0.29+ K/V head slots ``[NB, 2, BS, NH*HS]`` (``customize_spec`` with ``num_head_slots=2``):
ROCM_ATTN read by ``split_kv_cache``, ROCM_SEGMENTED_ATTN and B12X read token-major."""

from __future__ import annotations

import torch

from kvcore_vllm.hints import VllmHints
from kvcore_vllm.releases import LAYOUT_ERA
from kvcore_vllm.rules.paged import SPLIT_KV
from kvcore_vllm.rules.rule import SLOT_AXES, Rule, _o, _src, member_layouts
from kvcore_vllm.rules.sources import _B12X, _ROCM, _RSEG

SLOT_RULES: tuple[Rule, ...] = (
    Rule(
        label="ROCm 0.29+ K/V head slots [NB, 2, BS, NH*HS] read by split_kv_cache",
        eras=(LAYOUT_ERA,),
        families=("ROCM_ATTN",),
        rank=4,
        logical=_o("NB TWO NH HS BS"),
        # each plane's own order is (NB, NH, ...) under both layouts: LBHNC puts a block's K and V
        # slots side by side, LHBNC every block's K slot before every V slot (the planes' strides)
        layouts=dict.fromkeys(("LBHNC", "LHBNC"), SPLIT_KV),
        sources=(
            _src(
                "0.33.0",
                _ROCM + "::RocmAttentionBackend.customize_spec (num_head_slots=2, C = NH*HS*dtype); forward "
                "split_kv_cache(kv_cache.transpose(0, 1), ...)",
            ),
        ),
        transform="head_slots",
        gate="rocm",
        backends_label=("ROCM_ATTN",),
        planes="split_kv",
    ),
    Rule(
        label="ROCm 0.32+ ROCM_SEGMENTED_ATTN K/V head slots [NB, 2, BS, NH*HS] read token-major",
        eras=(LAYOUT_ERA,),
        families=("ROCM_SEGMENTED",),
        rank=4,
        # RocmSegmentedAttentionImpl._split_kv_cache: kv_cache[:, 0] / kv_cache[:, 1], each .unflatten(-1, (NH, HS)):
        # slot 0 holds the block's K as [BS, NH, HS] rows, slot 1 its V
        logical=_o("NB TWO BS NH HS"),
        # LBHNC: a block's K slot beside its V slot; LHBNC: every block's K slot, then every block's V slot
        layouts=member_layouts(("LBHNC", "LHBNC"), SLOT_AXES),
        sources=(
            _src(
                "0.33.0",
                _RSEG + "::RocmSegmentedAttentionBackend(RocmAttentionBackend): inherits rocm_attn.py::customize_spec "
                "(num_head_slots=2, state_content_bytes = NH*HS*dtype size) and supported_kv_cache_layouts (LHBNC, LBHNC); "
                "RocmSegmentedAttentionImpl._split_kv_cache: kv_cache[:, 0].unflatten(-1, (NH, HS)), kv_cache[:, 1] likewise "
                "(do_kv_cache_update: triton_reshape_and_cache_flash)",
            ),
        ),
        transform="head_slots_nhd",
        gate="rocm",
        backends_label=("ROCM_SEGMENTED_ATTN",),
        head_sizes=(64, 128, 256),  # RocmSegmentedAttentionBackend.get_supported_head_sizes
    ),
    Rule(
        label="0.30+ B12X K/V head slots [NB, 2, BS, NH*HS] read token-major",
        eras=(LAYOUT_ERA,),
        families=("B12X",),
        rank=4,
        # B12xPagedAttentionImpl._kv_cache_views: kv_cache.unbind(1), each .unflatten(-1, (NH, HS))
        logical=_o("NB TWO BS NH HS"),
        layouts=member_layouts(("LBHNC", "BLHNC"), SLOT_AXES),
        sources=(
            _src(
                "0.33.0",
                _B12X + "::B12xPagedAttentionBackend.customize_spec (num_head_slots=2, state_content_bytes = NH*HS*dtype "
                "size), supported_kv_cache_layouts (LBHNC, BLHNC); B12xPagedAttentionImpl._kv_cache_views: "
                "kv_cache.unbind(1), unflatten(-1, (NH, HS)) (do_kv_cache_update: reshape_and_cache_flash)",
            ),
        ),
        transform="head_slots_nhd",
        gate="cuda",  # supports_compute_capability: SM 12.0 / 12.1 only
        backends_label=("B12X",),
        block_sizes=(64, 128),  # get_supported_kernel_block_sizes() == _B12X_SUPPORTED_PAGE_SIZES
        head_sizes=(64, 128, 192, 256),  # get_supported_head_sizes
    ),
)


def _t_head_slots(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # ROCm 0.29+: [NB, 2, BS, C], C = NH*HS; each head slot's BS*C run is read by split_kv_cache as
    # V (NH, HS, BS) (K in 16-byte chunks, the spec's concern) -> V's view [NB, 2, NH, HS, BS].
    # NH by the hints, else one head of C: the bytes of a slot's run do not depend on NH.
    b, two, n, c = t.shape
    if two != 2 or (c > 1 and t.stride(3) != 1) or (n > 1 and t.stride(2) != c):
        return None
    if h.num_kv_heads:
        nh = h.num_kv_heads
    elif h.head_size and c % h.head_size == 0:
        nh = c // h.head_size
    else:
        nh = 1
    if c % nh:
        return None
    d = c // nh
    return torch.as_strided(t, (b, two, nh, d, n), (t.stride(0), t.stride(1), d * n, n, 1), t.storage_offset())


def _slot_heads(t: torch.Tensor, c: int, h: VllmHints) -> int | None:
    """The KV heads of a 0.29+ head slot of ``c`` elements (``C = NH*HS``): ``num_kv_heads``,
    else ``C // head_size``, else one head of ``C`` (the slot's bytes do not depend on how
    its row splits into heads; pass ``num_kv_heads`` for the head geometry). ``head_size``
    is in elements: an int8 byte view divides by the element size of ``dtype``."""
    if h.num_kv_heads:
        return h.num_kv_heads if c % h.num_kv_heads == 0 else None
    if h.head_size:
        el = h.element_dtype() if t.dtype == torch.int8 else None
        width = h.head_size * (torch.empty(0, dtype=el).element_size() if el is not None else 1)
        return c // width if c % width == 0 else None
    return 1


def _t_head_slots_nhd(t: torch.Tensor, h: VllmHints) -> torch.Tensor | None:
    # 0.30+ B12X / 0.32+ ROCM_SEGMENTED_ATTN: [NB, 2, BS, C], C = NH*HS, each slot read token-major:
    # kv_cache.unbind(1) (kv_cache[:, i]) then .unflatten(-1, (NH, HS)) -> [NB, 2, BS, NH, HS]
    b, two, n, c = t.shape
    if two != 2 or (c > 1 and t.stride(3) != 1):
        return None
    nh = _slot_heads(t, c, h)
    if nh is None:
        return None
    d = c // nh
    return torch.as_strided(t, (b, two, n, nh, d), (t.stride(0), t.stride(1), t.stride(2), d, 1), t.storage_offset())
