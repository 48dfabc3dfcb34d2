"""Hybrid pools through kvcore.detect_per_layer: SWAKVPool, HybridLinearKVPool (Mamba), DSA."""

from __future__ import annotations

import logging

import kvcore_sglang
import pytest
import torch
from kvcore_sglang import MambaState, NoCache, hybrid_linear_layer_entries, kv_caches_of, swa_layer_entries
from kvcore_sglang import fixtures as fx
from kvcore_sglang.fixtures import as_bytes, fill_random

import kvcore


def _swa(full_size: int, swa_size: int):
    fk, fv = fx.alloc_mha_053(2, full_size, 1, 2, 8)
    sk, sv = fx.alloc_mha_053(4, swa_size, 1, 2, 8)
    for i, t in enumerate(fk + fv + sk + sv):
        fill_random(t, 300 + i)
    return fk, fv, sk, sv


def test_swa_pool_full_and_sliding_window_subpools_get_their_own_layouts():
    fk, fv, sk, sv = _swa(full_size=32, swa_size=16)
    entries, groups = swa_layer_entries([fk, fv], [sk, sv], full_layer_ids=[2, 5], swa_layer_ids=[0, 1, 3, 4])
    assert groups == [[2, 5], [0, 1, 3, 4]]
    lays = kvcore.detect_per_layer(entries, "sglang", layer_groups=groups)
    full, swa = lays[2], lays[0]
    assert lays[5] is full and all(lays[i] is swa for i in (0, 1, 3, 4))
    assert (full.format.name, full.page_buffer_size, full.layer_ids) == ("TWO_X_NL_X_NBBS_NH_HS", 33, (2, 5))
    assert (swa.page_buffer_size, swa.layer_ids) == (17, (0, 1, 3, 4))
    # each sub-pool is addressed with its own allocator's slots; staging follows layer_ids
    out = kvcore.gather(swa, torch.tensor([16, 1]))
    assert torch.equal(as_bytes(out[1, 2, 0]), as_bytes(sv[2][16]))  # model layer 3 = swa sub-pool layer 2
    out = kvcore.gather(full, torch.tensor([32]))
    assert torch.equal(as_bytes(out[0, 1, 0]), as_bytes(fk[1][32]))  # model layer 5 = full sub-pool layer 1
    with pytest.raises(kvcore.TransferError, match="17 slots"):
        kvcore.gather(swa, torch.tensor([20]))


def test_swa_subpools_of_equal_size_stay_apart_by_layer_groups():
    fk, fv, sk, sv = _swa(full_size=16, swa_size=16)
    entries, groups = swa_layer_entries([fk, fv], [sk, sv], [2, 5], [0, 1, 3, 4])
    lays = kvcore.detect_per_layer(entries, "sglang", layer_groups=groups)
    assert lays[2] is not lays[0] and lays[2].layer_ids == (2, 5) and lays[0].layer_ids == (0, 1, 3, 4)
    with pytest.raises(kvcore.DetectionError, match="given twice"):
        swa_layer_entries([fk, fv], [sk, sv], [2, 5], [0, 1, 2, 4])


def test_hybrid_linear_pool_excludes_mamba_state(caplog):
    size, nl = 16, 6
    attn_ids = [2, 5]
    fk, fv = fx.alloc_mha_053(len(attn_ids), size, 1, 2, 8)
    # 0.5.3 MambaPool: one tensor per state kind, (num_mamba_layers, size + 1, *shape)
    conv = torch.zeros(4, size + 1, 24, 3)
    temporal = torch.zeros(4, size + 1, 2, 8, 16)
    mamba_ids = [i for i in range(nl) if i not in attn_ids]
    entries, groups = hybrid_linear_layer_entries([fk, fv], attn_ids, {lid: (conv[j], temporal[j]) for j, lid in enumerate(mamba_ids)})
    assert all(isinstance(entries[i], MambaState) for i in mamba_ids)
    with caplog.at_level(logging.INFO, logger="kvcore.detection"):
        lays = kvcore.detect_per_layer(entries, "sglang", layer_groups=groups)
    assert [lays[i] is None for i in range(nl)] == [i in mamba_ids for i in range(nl)]
    assert lays[2].layer_ids == (2, 5) and lays[2].num_layers == 2
    assert "not KV" in caplog.text
    # the same state as plain tuples (conv and temporal differ in rank) is excluded too
    raw = [(conv[j], temporal[j]) for j in range(4)]
    assert kvcore.detect_per_layer(raw, "sglang") == [None] * 4
    with pytest.raises(kvcore.DetectionError, match="not a KV cache"):
        kvcore.detect(entries[:1], "sglang")


def test_dsa_model_mla_and_indexer_lists_detect_per_group():
    kv = fx.alloc_mla(2, size=128, page_size=64, kv_cache_dim=64)
    idx = fx.alloc_indexer(2, size=128, page_size=64)
    lays = kvcore.detect_per_layer(kv + idx, "sglang", hints={"page_size": 64, "is_mla": True, "index_page_size": 64})
    assert [lay.format.name for lay in lays] == ["NL_X_NB_BS_ONE_HS"] * 2 + ["NL_X_NB_BSV_BSS"] * 2
    assert lays[0].layer_ids == (0, 1) and lays[2].layer_ids == (2, 3)
    assert (lays[0].num_blocks, lays[2].num_blocks) == (3, 3)


def test_kv_caches_of_sglang_pool_objects():
    class MHAPool:
        def __init__(self):
            self.k_buffer, self.v_buffer = fx.alloc_mha_0523(3, 8, 1, 2, 4)

    class HostPool:
        def __init__(self):
            self.kv_buffer = fx.alloc_host_mha("page_first", 3, 8, 1, 2, 4)

        @property
        def k_buffer(self):
            return self.kv_buffer[0]

    class MLAPool:
        kv_buffer = fx.alloc_mla(3, 8, 1, 16)

    p, hp = MHAPool(), HostPool()
    assert kvcore.detect(kv_caches_of(p), "sglang").data_ptrs() == [t.data_ptr() for t in p.k_buffer + p.v_buffer]
    assert kvcore.detect(kv_caches_of(hp), "sglang", {"mem_layout": "page_first"}).format.name == "TWO_NBBS_NL_NH_HS"
    assert kvcore.detect(kv_caches_of(MLAPool()), "sglang").format.name == "NL_X_NBBS_ONE_HS"
    with pytest.raises(kvcore.DetectionError, match="not an SGLang KV pool"):
        kv_caches_of(object())


def test_swa_pool_object_and_full_to_swa_slot_translation():
    from types import SimpleNamespace

    fk, fv, sk, sv = _swa(full_size=32, swa_size=16)
    full_ids, swa_ids = [2, 5], [0, 1, 3, 4]
    pool = SimpleNamespace(
        full_kv_pool=SimpleNamespace(k_buffer=fk, v_buffer=fv),
        swa_kv_pool=SimpleNamespace(k_buffer=sk, v_buffer=sv),
        layers_mapping={**{g: (i, False) for i, g in enumerate(full_ids)}, **{g: (i, True) for i, g in enumerate(swa_ids)}},
        full_to_swa_index_mapping=torch.arange(33) % 17,
    )
    entries, groups = kvcore_sglang.swa_pool_layer_entries(pool)
    assert groups == [full_ids, swa_ids]
    lays = kvcore.detect_per_layer(entries, "sglang", layer_groups=groups)
    loc = torch.tensor([20, 30])
    out = kvcore.gather(lays[0], kvcore_sglang.slot_mapping(pool.full_to_swa_index_mapping[loc]))
    assert torch.equal(as_bytes(out[0, 3, 1]), as_bytes(sk[3][30 % 17]))  # model layer 4 = swa sub-pool layer 3
    with pytest.raises(kvcore.DetectionError, match="not an SGLang SWAKVPool"):
        kvcore_sglang.swa_pool_layer_entries(object())


def test_hybrid_linear_pool_takes_global_layer_ids():
    # NemotronH: attention at global ids 3, 8, 14; Mamba layers beside them; MoE-only layers (7, 11, 13) hold no cache.
    # HybridLinearKVPool maps the attention layers' global ids to its sub-pool (full_attention_layer_id_mapping)
    size = 16
    fk, fv = fx.alloc_mha_053(3, size, 1, 2, 8)
    for i, t in enumerate(fk):
        t.copy_(torch.full_like(t, float(i + 1)))
    mamba_ids = [0, 1, 2, 4, 5, 6, 9, 10, 12]
    conv = torch.zeros(len(mamba_ids), size + 1, 24, 3)
    temporal = torch.zeros(len(mamba_ids), size + 1, 2, 8, 16)
    entries, groups = hybrid_linear_layer_entries([fk, fv], [3, 8, 14], {lid: (conv[j], temporal[j]) for j, lid in enumerate(mamba_ids)})
    assert len(entries) == 15 and groups == [[3, 8, 14], mamba_ids]
    assert [i for i, e in enumerate(entries) if isinstance(e, NoCache)] == [7, 11, 13]
    lays = kvcore.detect_per_layer(entries, "sglang", layer_groups=groups)
    assert [i for i, lay in enumerate(lays) if lay is not None] == [3, 8, 14]
    lay = lays[14]
    assert lay.layer_ids == (3, 8, 14) and lay.num_layers == 3
    out = kvcore.gather(lay, torch.tensor([5]))
    assert out[0, :, 0, 0].tolist() == [1.0, 2.0, 3.0]  # sub-pool layers 0, 1, 2 = global 3, 8, 14
    with pytest.raises(kvcore.DetectionError, match="layer id 8 is given twice"):
        hybrid_linear_layer_entries([fk, fv], [3, 8, 14], {8: (conv[0], temporal[0])})
    with pytest.raises(kvcore.DetectionError, match="holds 3 layers but 2 layer ids"):
        hybrid_linear_layer_entries([fk, fv], [3, 8], {})
