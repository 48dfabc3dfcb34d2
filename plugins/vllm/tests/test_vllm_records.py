"""vLLM's uint8 byte records, each width read exactly as vLLM's writer kernels address it.

The oracle is :func:`kvcore_vllm.fixtures.record_view`, which restates the writers' pointer
arithmetic (vLLM 0.33 ``deepseek_v41/common/ops/fused_compress_quant_cache.py``,
``indexer_k_store.py``, ``rocm_aiter_mla_sparse.py``, ``deepseek_v32/common/kernels.py``);
``kvcore_vllm.specs`` has the table with sources. The class fixed here: LMCache's
blocked-scale table read 528 (DeepSeek-V4.1) and 352 (``nvfp4_ds_mla``) as blocked pages,
which vLLM writes per token, and nothing read ROCm's tiled indexer page.
"""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.fixtures import RECORD_CASES, allocate_records, record_hints, record_view

import kvcore
from kvcore.testing import TokenGroups

TILED = "K=NL_X_NB_BSC_HSC_BSE_HSE+KS=NL_X_NB_BS_HS"


def _fill(kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for t in kv.values():
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def _row(view, slot: int, bs: int) -> torch.Tensor:
    """One token's bytes in an oracle plane (a view, a tuple of segments, or token groups)."""
    b, n = divmod(slot, bs)
    if isinstance(view, TokenGroups):
        v = view.view
        return v[b, n // v.shape[2], n % v.shape[2]].reshape(-1)
    if isinstance(view, tuple):
        return torch.cat([p[b, n].reshape(-1) for p in view])
    return view[b, n].reshape(-1)


def _planes(lay, staged):
    """{plane index: [NL, T, W_p] staged rows} for classic and per-plane staging."""
    out = {}
    for i, p in enumerate(lay.planes) if lay.format.container == "planes" else [(0, None)]:
        if p is None:
            out[0] = staged[0]
        elif p.staging_index is not None:
            out[i] = staged[p.staging_index]
        else:
            out[i] = staged[p.role]
    return out


def _check(lay, kv, bs: int, seed: int = 0):
    """gather == the writers' bytes, slot by slot; scatter writes exactly those bytes."""
    _fill(kv, seed)
    nslots = lay.num_blocks * bs
    slots = [0, bs - 1, bs, nslots - 1, 5, -1]
    staged = _planes(lay, kvcore.gather(lay, torch.tensor(slots)))
    nplanes = len(staged)
    for li in range(lay.num_layers):
        for p in range(nplanes):
            view = record_view(kv, li, p)
            for i, s in enumerate(slots):
                got = staged[p][li, i]
                if s < 0:
                    assert not got.any()
                else:
                    assert torch.equal(got, _row(view, s, bs)), (li, p, s)
    # scatter fresh bytes to other slots: exactly the oracle's bytes change
    before = {k: t.clone() for k, t in kv.items()}
    dst = [1, bs + 2, nslots - 2]
    src = lay.allocate_staging(len(dst)) if lay.format.container == "planes" else None
    if src is None:
        src = torch.randint(0, 256, (1, lay.num_layers, len(dst), lay.head_size), dtype=torch.uint8)
        parts = {0: src[0]}
    else:
        if isinstance(src, dict):
            for t in src.values():
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        else:
            src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
        parts = _planes(lay, src)
    kvcore.scatter(lay, torch.tensor(dst), src)
    for li in range(lay.num_layers):
        for p in range(nplanes):
            view = record_view(kv, li, p)
            for i, s in enumerate(dst):
                assert torch.equal(_row(view, s, bs), parts[p][li, i]), (li, p, s)
    changed = sum(int((kv[k] != before[k]).sum()) for k in kv)
    assert changed <= lay.num_layers * len(dst) * sum(int(parts[p].shape[-1]) for p in parts)


@pytest.mark.parametrize(("record", "version", "layout", "platform", "fmt"), RECORD_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize(("bs", "nb"), [(32, 3), (64, 2)], ids=str)
def test_every_record_width_as_vllm_writes_it(record, version, layout, platform, fmt, bs, nb):
    kv = allocate_records(record, layout, version=version, num_layers=2, num_blocks=nb, block_size=bs, platform=platform)
    lay = kvcore.detect(kv, "vllm", record_hints(record, version, layout, platform))
    assert lay.format.name == fmt
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_heads) == (2, nb, bs, 1)
    _check(lay, kv, bs)


def test_528_is_per_token_not_blocked():
    """DeepSeek-V4.1's MXFP8 record: each token's 512 value bytes, then its own 16 scale bytes
    (``_rope_quant_insert_mxfp8_kernel``: ``values = page + t*528``, ``scales = values + 512``).
    LMCache's table read it as a blocked page (scale 16): a token's scales at ``page + BS*512 + t*16``."""
    kv = allocate_records(528, "LBNHC", num_layers=1, num_blocks=2, block_size=64)
    t = next(iter(kv.values())).squeeze(1)
    page = t[1].reshape(-1)
    n = 5
    page[n * 528 : n * 528 + 512] = 7  # token 5's values, written as the kernel writes them
    page[n * 528 + 512 : n * 528 + 528] = 9  # and its scales, right after
    lay = kvcore.detect(kv, "vllm", {"cache_dtype": "fp8_ds_mla", "attention_backend": "FLASHMLA_SPARSE"})
    assert (lay.format.name, lay.head_size) == ("NL_X_NB_BS_HS", 528)
    row = kvcore.gather(lay, torch.tensor([64 + n]))[0, 0, 0]
    assert torch.equal(row, torch.cat([torch.full((512,), 7, dtype=torch.uint8), torch.full((16,), 9, dtype=torch.uint8)]))
    blocked_scales = page[64 * 512 + n * 16 : 64 * 512 + n * 16 + 16]
    assert not torch.equal(blocked_scales, row[512:])  # the old reading's bytes were another token's values


@pytest.mark.parametrize("record", [656, 528, 352, 288])
def test_per_token_records_need_no_cache_dtype(record):
    """The width identifies the record (vLLM's own writers dispatch on ``k_cache.shape[-1]``)."""
    kv = allocate_records(record, "NHD" if record == 656 else "LBNHC", version="0.11.0" if record == 656 else "0.33.0",
                          num_layers=2, num_blocks=3, block_size=16)  # fmt: skip
    h = {} if record == 656 else {"attention_backend": "FLASHMLA_SPARSE"}
    assert kvcore.detect(kv, "vllm", h).format.name == "NL_X_NB_BS_HS"


@pytest.mark.parametrize(
    ("record", "hints", "ok"),
    [
        (656, {"cache_dtype": "fp8_ds_mla", "head_size": 576}, True),  # V3.2: model_config.get_head_size() is 576
        (584, {"cache_dtype": "fp8_ds_mla", "head_size": 512}, True),  # V4: head_size stays semantic (512)
        (528, {"cache_dtype": "fp8_ds_mla", "head_size": 512}, True),
        (528, {"cache_dtype": "nvfp4_ds_mla"}, True),  # V4.1 nvfp4_ds_mla keeps the MXFP8 sliding-window record
        (288, {"cache_dtype": "nvfp4_ds_mla", "head_size": 512}, True),
        (352, {"cache_dtype": "fp8_ds_mla"}, False),  # fp8_ds_mla never writes 352 B
        (584, {"cache_dtype": "nvfp4_ds_mla"}, False),
        (288, {"cache_dtype": "fp8_ds_mla"}, False),
        (584, {"cache_dtype": "fp8_ds_mla", "head_size": 576}, False),
        (656, {"cache_dtype": "auto", "head_size": 576}, False),  # 576 with a plain cache dtype is not a 656 B record
    ],
)
def test_record_hints_must_agree_with_the_width(record, hints, ok):
    kv = allocate_records(record, "LBNHC", num_layers=2, num_blocks=3, block_size=16)
    h = {"attention_backend": "FLASHMLA_SPARSE", **hints}
    if ok:
        assert kvcore.detect(kv, "vllm", h).format.name.startswith("NL_X_NB_")
    else:
        with pytest.raises(kvcore.DetectionError):
            kvcore.detect(kv, "vllm", h)


# -- the platform decides ROCm's tiled indexer page ---------------------------------------------


def test_rocm_indexer_page_is_never_guessed():
    """132 B indexer pages of more than one token: blocked on CUDA / CPU / XPU, 16x16-byte key
    tiles on ROCm (vLLM 0.24+). Tensors that do not say their platform (a description, meta
    tensors) raise AmbiguousLayoutError naming device_type."""
    kv = allocate_records(132, "LBNHC", num_layers=2, num_blocks=3, block_size=32, device="meta")
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(kv, "vllm", {"vllm_version": "0.33", "attention_backend": "TRITON_MLA"})
    assert set(ei.value.candidates) == {"NL_X_NB_BSV_BSS", TILED}
    assert ei.value.hints == ["device_type"]  # the record's width is its bytes: head_size decides nothing here
    for hints, fmt in (
        ({"device_type": "cuda"}, "NL_X_NB_BSV_BSS"),
        ({"device_type": "cpu"}, "NL_X_NB_BSV_BSS"),
        ({"device_type": "rocm"}, TILED),
        ({"attention_backend": "ROCM_AITER_MLA_SPARSE"}, TILED),  # a ROCm-only backend says the platform
        ({"attention_backend": "FLASHMLA_SPARSE"}, "NL_X_NB_BSV_BSS"),
    ):
        h = {"vllm_version": "0.33", "attention_backend": "TRITON_MLA", **hints}
        assert kvcore.detect(kv, "vllm", h).format.name == fmt, hints


def test_rocm_indexer_edges():
    one = allocate_records(132, "NHD", version="0.26.0", num_layers=2, num_blocks=3, block_size=1, platform="rocm")
    # one token per block: vLLM's ROCm writer uses the NORMAL layout (block_size == 1), i.e. the blocked page
    assert kvcore.detect(one, "vllm", {"device_type": "rocm"}).format.name == "NL_X_NB_BSV_BSS"
    kv = allocate_records(132, "NHD", version="0.26.0", num_layers=2, num_blocks=3, block_size=32, platform="rocm")
    # 0.13's ROCm indexer blocks hold one token and 0.11 has no ROCm sparse MLA: the C++ op's blocked page
    assert kvcore.detect(kv, "vllm", {"device_type": "rocm", "vllm_version": "0.13"}).format.name == "NL_X_NB_BSV_BSS"
    with pytest.raises(kvcore.GeometryError, match="block_size % 16"):
        allocate_records(132, "NHD", version="0.26.0", num_layers=2, num_blocks=3, block_size=24, platform="rocm")
    odd = allocate_records(132, "NHD", version="0.26.0", num_layers=2, num_blocks=3, block_size=24)
    with pytest.raises(kvcore.DetectionError):  # ROCm would have refused 24-token blocks; no reading is left
        kvcore.detect(odd, "vllm", {"device_type": "rocm", "vllm_version": "0.26"})


def test_rocm_build_of_torch_says_the_platform(monkeypatch):
    kv = allocate_records(132, "NHD", version="0.26.0", num_layers=2, num_blocks=3, block_size=32, platform="rocm")
    assert kvcore.detect(kv, "vllm", {"vllm_version": "0.26"}).format.name == "NL_X_NB_BSV_BSS"  # this CPU build: not ROCm
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    lay = kvcore.detect(kv, "vllm", {"vllm_version": "0.26"})
    assert lay.format.name == TILED
    _check(lay, kv, 32)


def test_rocm_mxfp4_indexer_pages_are_not_claimed():
    """68 B MXFP4 indexer pages: blocked on CUDA; on ROCm gfx950 (vLLM 0.33) aiter writes its own
    order, whose tile sizes only aiter's cache_format() knows at run time: refused, never guessed."""
    kv = allocate_records(68, "LBNHC", num_layers=2, num_blocks=3, block_size=32, platform="rocm")
    for h in ({"device_type": "rocm"}, {"attention_backend": "ROCM_AITER_MLA_SPARSE"}):
        with pytest.raises(kvcore.DetectionError, match="aiter") as ei:
            kvcore.detect(kv, "vllm", {"vllm_version": "0.33", "attention_backend": "TRITON_MLA", **h})
        assert not isinstance(ei.value, kvcore.AmbiguousLayoutError)
    with pytest.raises(kvcore.GeometryError, match="aiter"):
        record_view(kv, 0, 0)
    meta = allocate_records(68, "LBNHC", num_layers=2, num_blocks=3, block_size=32, device="meta")
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(meta, "vllm", {"vllm_version": "0.33", "attention_backend": "TRITON_MLA"})
    assert ei.value.hints == ["device_type"] and ei.value.candidates[0] == "NL_X_NB_BSV_BSS" and "aiter" in ei.value.candidates[1]
    assert kvcore.detect(meta, "vllm", {"vllm_version": "0.33", "attention_backend": "TRITON_MLA", "device_type": "cuda"}).format.name == (
        "NL_X_NB_BSV_BSS"
    )


@pytest.mark.parametrize(("record", "fmt"), [(584, "NL_X_NB_BSV_BSS"), (528, "NL_X_NB_BS_HS"), (132, "NL_X_NB_BSV_BSS")])
def test_compressed_caches_hold_block_size_over_ratio_states(record, fmt):
    """DeepSeek-V4's compressed caches: ``tokens_per_state = compress_ratio``, so a manager block of
    64 tokens holds 16 stored states at ratio 4 (0.33 ``AttentionSpec.num_states``); kvcore reads the
    states (the block size of the tensors), padded pages included (584: 16*584 rounded up to 576 B)."""
    kv = allocate_records(record, "LBNHC", num_layers=2, num_blocks=3, block_size=64, tokens_per_state=4)
    t = next(iter(kv.values()))
    assert t.shape == (3, 1, 16, record)
    if record == 584:
        assert t.stride(0) == 17 * 576  # 9344 B rounded up to the 576 B TMA stride
    lay = kvcore.detect(kv, "vllm", {"vllm_version": "0.33", "attention_backend": "FLASHMLA_SPARSE", "device_type": "cuda"})
    assert (lay.format.name, lay.block_size, lay.num_blocks) == (fmt, 16, 3)
    _check(lay, kv, 16, seed=4)
