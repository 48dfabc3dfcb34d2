"""SGLang's one-tensor pools: HiCache host pools per ``--hicache-mem-layout`` and the Ascend
cross-layer device pool."""

from __future__ import annotations

import torch

from kvcore import Candidate, DetectionError
from kvcore_sglang.deciding import _one_storage
from kvcore_sglang.formats import HOST_FORMATS
from kvcore_sglang.hints import SGLangHints, element_dtype


def _host_candidates(t: torch.Tensor, h: SGLangHints) -> list[Candidate]:
    dtype = element_dtype(t.dtype, h)
    s = tuple(int(x) for x in t.shape)
    cands: list[Candidate] = []

    def want(mem: str, mla: bool, nl: int, nh: int | None, ps_axis: int | None, rows: int | None) -> bool:
        return (
            h.layout != "ASCEND"
            and h.mem_layout in (None, mem)
            and h.is_mla in (None, mla)
            and h.num_layers in (None, nl)
            and (nh is None or h.num_kv_heads in (None, nh))
            and (ps_axis is None or h.page_size in (None, ps_axis))
            and (rows is None or h.page_size is None or rows % h.page_size == 0)
        )

    def add(mem: str, mla: bool) -> None:
        name = HOST_FORMATS[mem][1 if mla else 0]
        cands.append(
            Candidate(
                name,
                t,
                dtype,
                note=f"SGLang HiCache {'MLA' if mla else 'MHA'} host pool, {mem}",
                decided_by={"mem_layout": mem, "is_mla": mla},
                label=f"{'MLA' if mla else 'MHA'} {mem}",
            )
        )

    if t.dim() == 5 and s[0] == 2:
        if want("layer_first", False, s[1], s[3], None, s[2]):
            add("layer_first", False)
        if want("page_first", False, s[2], s[3], None, s[1]):
            add("page_first", False)
    if t.dim() == 6 and s[0] == 2:
        if want("page_first_direct", False, s[2], s[4], s[3], None):
            add("page_first_direct", False)
        if want("page_head", False, s[4], s[2], s[3], None):
            add("page_head", False)
    if t.dim() == 6 and s[0] == 2:
        cands += _ascend_candidates(t, h)
    if t.dim() == 4 and s[2] == 1:
        if want("layer_first", True, s[0], None, None, s[1]):
            add("layer_first", True)
        if want("page_first", True, s[1], None, None, s[0]):
            add("page_first", True)
    if t.dim() == 5 and s[3] == 1 and want("page_first_direct", True, s[1], None, s[2], None):
        add("page_first_direct", True)
    if not cands:
        raise DetectionError(
            f"sglang: one tensor {list(s)} {t.dtype} is not a HiCache host pool consistent with the hints "
            f"({h.model_dump(exclude_none=True) or 'none'}): MHA layer_first (2, NL, size, NH, HS), page_first (2, size, NL, NH, HS), "
            "page_first_direct (2, pages, NL, page_size, NH, HS), page_head (2, pages, NH, page_size, NL, HS); MLA layer_first "
            "(NL, size, 1, D), page_first (size, NL, 1, D), page_first_direct (pages, NL, page_size, 1, D)"
        )
    return cands


# -- Ascend cross-layer device pool -------------------------------------------------------


def _ascend_candidates(t: torch.Tensor, h: SGLangHints) -> list[Candidate]:
    """SGLang 0.5.3 ``memory_pool.py::AscendTokenToKVPool``: one tensor
    ``(2, layer_num, size // page_size + 1, page_size, head_num, head_dim)``."""
    s = tuple(int(x) for x in t.shape)
    if not (
        h.mem_layout is None
        and h.layout in (None, "ASCEND")
        and h.is_mla is not True
        and h.num_layers in (None, s[1])
        and h.page_size in (None, s[3])
        and h.num_kv_heads in (None, s[4])
    ):
        return []
    return [
        Candidate(
            "TWO_NL_NB_BS_NH_HS",
            t,
            element_dtype(t.dtype, h),
            note="SGLang AscendTokenToKVPool kv_buffer (cross-layer)",
            decided_by={"layout": "ascend"},
            label="Ascend device pool",
        )
    ]


def _ascend_from_halves(ts: list[torch.Tensor], h: SGLangHints) -> list[Candidate]:
    """``[k_buffer, v_buffer]`` of an Ascend pool: ``kv_buffer[0]`` and ``kv_buffer[1]``,
    5-D views of one storage; re-viewed (``as_strided``, no copy) as the 6-D pool."""
    if len(ts) != 2:
        raise DetectionError(f"sglang: {len(ts)} 5-D tensors; an Ascend pool's k_buffer, v_buffer are kv_buffer[0], kv_buffer[1]")
    k, v = ts
    delta = v.storage_offset() - k.storage_offset()
    if (
        not _one_storage(k, v)
        or tuple(k.shape) != tuple(v.shape)
        or tuple(k.stride()) != tuple(v.stride())
        or k.dtype != v.dtype
        or delta <= 0
    ):
        raise DetectionError(
            "sglang: two 5-D tensors are an Ascend pool only as kv_buffer[0], kv_buffer[1] of one "
            "(2, NL, pages, page_size, NH, HS) tensor (one storage, V after K); pass kv_buffer itself"
        )
    base = torch.as_strided(k, (2, *k.shape), (delta, *k.stride()), k.storage_offset())
    return _ascend_candidates(base, h)
