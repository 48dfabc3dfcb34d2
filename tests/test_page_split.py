"""The core splits a fused NBBS axis into blocks by the caller's block_size / page_size hint,
so every NBBS layout gets num_blocks, block_size and block transfers without each plugin
reimplementing the split."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import Detection, DetectionError, KVFormat, Source, hookimpl

FUSED = "NL_X_ONE_NBBS_NH_HS"
SPLIT = "NL_X_ONE_NB_BS_NH_HS"


class _Pool:
    """A token pool: per layer [1, rows, NH, HS]; the detector returns the fused name only."""

    @hookimpl
    def kvcore_register_formats(self, register):
        register(KVFormat(name=FUSED, engines=["pool"], description="token pool", sources=[Source(engine="pool", file="pool.py::alloc")]))

    @hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != "pool":
            return None
        return Detection(format=FUSED, kv_caches=list(kv_caches), note="pool")


@pytest.fixture
def pool(core_only):
    kvcore.register_plugin(_Pool(), name="pool")
    return [torch.arange(2 * 24 * 2 * 4, dtype=torch.float32).view(2, 24, 2, 4)[:1].clone() + 1000 * i for i in range(3)]


def test_without_a_hint_the_fused_axis_has_no_blocks_and_the_message_says_how_to_split(pool):
    lay = kvcore.detect(pool, "pool")
    assert lay.format.name == FUSED and lay.page_buffer_size == 24
    with pytest.raises(kvcore.GeometryError, match=r"detect with a block_size \(or page_size\) hint: kvcore then splits the axis"):
        _ = lay.num_blocks
    with pytest.raises(kvcore.TransferError, match="block transfers need blocks"):
        kvcore.gather_blocks(lay, torch.tensor([0]))


@pytest.mark.parametrize("key", ["block_size", "page_size"])
def test_a_block_size_hint_splits_the_axis_and_gather_blocks_works(pool, key):
    fused = kvcore.detect(pool, "pool")
    lay = kvcore.detect(pool, "pool", hints={key: 8})
    assert lay.format.name == SPLIT and (lay.num_blocks, lay.block_size, lay.page_buffer_size) == (3, 8, 24)
    # derived from the fused declaration: its engines and sources, the hint named
    assert lay.format.engines == ["pool"] and lay.format.sources[0].file == "pool.py::alloc"
    assert f"page-split by the {key} hint" in lay.format.description
    # the same bytes, the same slots: block b's rows are slots b*8 .. b*8+7
    slots = torch.arange(8, 16)
    assert torch.equal(kvcore.gather_blocks(lay, torch.tensor([1])), kvcore.gather(fused, slots))
    assert torch.equal(kvcore.gather(lay, slots), kvcore.gather(fused, slots))
    assert kvcore.gather(lay, torch.tensor([9]))[0, 2, 0, 0].item() == pool[2][0, 9, 0, 0].item()
    # detect_per_layer splits the same way
    assert {x.format.name for x in kvcore.detect_per_layer(pool, "pool", hints={key: 8})} == {SPLIT}


def test_a_hint_that_does_not_divide_the_axis_or_disagrees_is_refused(pool):
    with pytest.raises(DetectionError, match="does not divide the fused NBBS axis of 24 rows"):
        kvcore.detect(pool, "pool", hints={"block_size": 5})
    with pytest.raises(DetectionError, match="disagree on the tokens per block"):
        kvcore.detect(pool, "pool", hints={"block_size": 8, "page_size": 4})
    for bad in (True, 0, -8, "8"):
        with pytest.raises(DetectionError, match="must be a positive int"):
            kvcore.detect(pool, "pool", hints={"page_size": bad})


def test_a_registered_split_name_is_used_as_declared(pool):
    class _Both(_Pool):
        @hookimpl
        def kvcore_register_formats(self, register):
            super().kvcore_register_formats(register)
            register(
                KVFormat(name=SPLIT, engines=["pool"], description="paged pool", sources=[Source(engine="pool", file="pool.py::paged")])
            )

    kvcore.unregister_plugin("pool")
    kvcore.register_plugin(_Both(), name="pool")
    lay = kvcore.detect(pool, "pool", hints={"page_size": 4})
    assert lay.format.name == SPLIT and lay.format.description == "paged pool" and lay.num_blocks == 6
