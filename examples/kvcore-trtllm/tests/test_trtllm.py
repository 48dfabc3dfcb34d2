"""Tests of the TensorRT-LLM example plugin (real geometries, hand-computed addresses)."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import DetectionError

plugin = pytest.importorskip("kvcore_trtllm.plugin")

LLAMA3_8B = {"num_kv_heads": 8, "tokens_per_block": 32, "head_dim": 128}


def _pool(nb, nl, kvf, hints, dtype=torch.bfloat16):
    return torch.zeros(nb, nl, kvf, hints["tokens_per_block"] * hints["num_kv_heads"] * hints["head_dim"], dtype=dtype)


def test_llama3_8b_pool_geometry_and_one_hand_computed_address():
    pool = _pool(4, 32, 2, LLAMA3_8B)
    layout = kvcore.detect(pool, engine="trtllm", hints=LLAMA3_8B)
    assert layout.format.name == "NB_NL_TWO_NH_BS_HS"
    assert layout.describe() == "[4, 32, 2, 8, 32, 128]"
    assert (layout.num_layers, layout.num_blocks, layout.block_size, layout.num_heads, layout.head_size) == (32, 4, 32, 8, 128)
    assert layout.page_buffer_size == 128 and layout.kv_size == 2 and layout.format.is_hnd
    # getKVLocalIdx: block 2, layer 5, V, head 3, token 7, channel 9 -> head*BS*HD + token*HD + channel
    pool[2, 5, 1, 3 * 32 * 128 + 7 * 128 + 9] = 42.0
    staged = kvcore.gather(layout, torch.tensor([2 * 32 + 7]), layers=5)  # [2, 1, NH*HS]
    assert staged[1, 0, 3 * 128 + 9].item() == 42.0
    assert int(torch.count_nonzero(staged)) == 1


def test_deepseek_v3_mla_pool():
    hints = {"num_kv_heads": 1, "tokens_per_block": 32, "head_dim": 576}
    pool = _pool(2, 61, 1, hints)
    layout = kvcore.detect([pool], engine="tensorrt_llm", hints=hints)
    assert layout.format.name == "NB_NL_ONE_BS_HS" and layout.is_mla
    assert layout.describe() == "[2, 61, 1, 32, 576]"
    assert (layout.num_layers, layout.kv_size, layout.num_heads, layout.head_size, layout.hidden_dim) == (61, 1, 1, 576, 576)
    pool[1, 60, 0, 31 * 576 + 575] = -3.0
    assert kvcore.gather(layout, torch.tensor([63]), layers=60)[0, 0, 575].item() == -3.0


@pytest.mark.parametrize(
    ("shape", "hints", "match"),
    [
        ((4, 2, 2, 256), {"num_kv_heads": 2, "tokens_per_block": 8}, "pass hints head_dim"),
        ((4, 2, 2, 256), {"num_kv_heads": 2, "tokens_per_block": 8, "head_dim": 32}, "holds 256 elements but"),
        ((4, 2, 3, 256), {"num_kv_heads": 2, "tokens_per_block": 8, "head_dim": 16}, "kv_factor .axis 2. is 3"),
        ((4, 2, 1, 256), {"num_kv_heads": 2, "tokens_per_block": 8, "head_dim": 16}, "one latent head, but num_kv_heads=2"),
        ((4, 2, 2, 256), {"num_kv_heads": 2, "tokens_per_block": 8, "head_dim": 16, "kv_layout": "NHD"}, "kv_layout='NHD'"),
        ((4, 2, 2, 256), {"num_kv_heads": 0, "tokens_per_block": 8, "head_dim": 16}, "num_kv_heads=0 must be a positive int"),
        ((4, 2, 512), {"num_kv_heads": 2, "tokens_per_block": 8, "head_dim": 16}, "expected the 4-D block pool"),
    ],
)
def test_detection_errors_say_what_is_wrong(shape, hints, match):
    with pytest.raises(DetectionError, match=match):
        kvcore.detect(torch.zeros(shape), engine="trtllm", hints=hints)


def test_several_pools_in_one_list_are_refused_and_other_engines_ignored():
    hints = {"num_kv_heads": 1, "tokens_per_block": 2, "head_dim": 4}
    pools = [_pool(2, 1, 2, hints), _pool(2, 1, 2, hints)]
    with pytest.raises(DetectionError, match="got a list of 2"):
        kvcore.detect(pools, engine="trtllm", hints=hints)
    assert plugin.kvcore_detect(kv_caches=pools[0], engine="vllm", hints=hints) is None


def test_nhd_hint_with_one_head_is_the_same_bytes():
    hints = {"num_kv_heads": 1, "tokens_per_block": 4, "head_dim": 8, "kv_layout": "NHD"}
    layout = kvcore.detect(_pool(3, 2, 2, hints), engine="trtllm", hints=hints)
    assert layout.format.name == "NB_NL_TWO_NH_BS_HS" and layout.num_heads == 1


def test_detection_is_idempotent_on_its_canonical_view():
    """The canonical 6-D [NB, NL, 2, NH, BS, HS] (what a layout holds) is accepted as well as
    the 4-D pool, without hints: its shape carries the geometry."""
    hints = {"num_kv_heads": 2, "tokens_per_block": 8, "head_dim": 16}
    pool = _pool(4, 3, 2, hints)
    layout = kvcore.detect(pool, engine="trtllm", hints=hints)
    view = layout.kv_caches
    assert tuple(view.shape) == (4, 3, 2, 2, 8, 16)
    for given in (None, hints):
        again = kvcore.detect(view, engine="trtllm", hints=given)
        assert again.format.name == layout.format.name
        assert again.stride_table().signature() == layout.stride_table().signature()
    mla_hints = {"num_kv_heads": 1, "tokens_per_block": 4, "head_dim": 576}
    mla = kvcore.detect(_pool(2, 2, 1, mla_hints), engine="trtllm", hints=mla_hints)
    assert kvcore.detect(mla.kv_caches, engine="trtllm").stride_table().signature() == mla.stride_table().signature()


def test_a_canonical_view_must_agree_with_hints_and_strides():
    view = torch.zeros(4, 3, 2, 2, 8, 16)
    with pytest.raises(DetectionError, match=r"num_kv_heads=4 \(the view has 2\)"):
        kvcore.detect(view, engine="trtllm", hints={"num_kv_heads": 4})
    nhd_memory = torch.zeros(4, 3, 2, 8, 2, 16).transpose(3, 4)  # HND-shaped, but tokens outside heads in memory
    with pytest.raises(DetectionError, match="memory order is not its axis order"):
        kvcore.detect(nhd_memory, engine="trtllm")
