"""Semantic gather (oracle: SGLang-side indexing), bit-exact round trips, the padded page,
the indexer pool, and device -> HiCache host offload in SGLang's own layout."""

from __future__ import annotations

import pytest
import torch
from kvcore_sglang import fixtures as fx
from kvcore_sglang import slot_mapping
from kvcore_sglang.fixtures import CASES, as_bytes, fill_random

import kvcore

# classic staging only: the multi-plane cases (K/V of two head sizes) are the conformance suite's (kvcore check sglang)
WRITABLE = [c for c in CASES if c.format != "NL_X_NB_BSV_BSS" and "=" not in c.format]


def _fill_all(case, caches, layout):
    for layer in range(layout.num_layers):
        for kv in range(layout.kv_size):
            fill_random(case.kv_view(caches, layer, kv), seed=1000 * layer + 10 * kv + 7)


def _expected_row(case, caches, layer, kv, slot):
    view = case.kv_view(caches, layer, kv)
    bs = view.shape[1]
    return as_bytes(view[slot // bs, slot % bs])


@pytest.mark.parametrize("case", WRITABLE, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_semantic_gather_matches_sglang_indexing(case, dtype):
    caches, hints = case.make(dict(case.sizes), dtype, "cpu")
    lay = kvcore.detect(caches, "sglang", hints)
    _fill_all(case, caches, lay)
    n = lay.page_buffer_size
    slots = torch.tensor([n - 1, 0, 3, -1, 1, n // 2], dtype=torch.int64)
    out = kvcore.gather(lay, slots)
    assert tuple(out.shape) == (lay.kv_size, lay.num_layers, 6, lay.hidden_dim) and out.dtype == dtype
    for layer in range(lay.num_layers):
        for kv in range(lay.kv_size):
            for i, s in enumerate(slots.tolist()):
                if s < 0:
                    assert torch.equal(as_bytes(out[kv, layer, i]), torch.zeros(lay.hidden_dim * out.element_size(), dtype=torch.uint8))
                else:
                    assert torch.equal(as_bytes(out[kv, layer, i]), _expected_row(case, caches, layer, kv, s)), (layer, kv, s)


@pytest.mark.parametrize("case", WRITABLE, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float8_e5m2], ids=str)
def test_scatter_then_gather_is_bit_exact_and_touches_only_its_slots(case, dtype):
    caches, hints = case.make(dict(case.sizes), dtype, "cpu")
    lay = kvcore.detect(caches, "sglang", hints)
    n = lay.page_buffer_size
    g = torch.Generator().manual_seed(5)
    src = torch.empty(lay.staging_shape(4), dtype=dtype)
    src.view(torch.uint8).copy_(torch.randint(0, 256, src.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    before = [as_bytes(case.kv_view(caches, layer, kv)) for layer in range(lay.num_layers) for kv in range(lay.kv_size)]
    slots = torch.tensor([n - 1, 2, -1, 0])
    kvcore.scatter(lay, slots, src)
    back = kvcore.gather(lay, slots)
    keep = slots >= 0
    assert torch.equal(as_bytes(back[:, :, keep]), as_bytes(src[:, :, keep]))
    # every other row is unchanged, the skipped row was not written
    i = 0
    for layer in range(lay.num_layers):
        for kv in range(lay.kv_size):
            view = case.kv_view(caches, layer, kv)
            bs = view.shape[1]
            rows = view.reshape(view.shape[0] * bs, -1)
            old = before[i].reshape(view.shape[0] * bs, -1)
            i += 1
            changed = {s for s in slots.tolist() if s >= 0}
            for r in range(rows.shape[0]):
                if r not in changed:
                    assert torch.equal(as_bytes(rows[r]), old[r]), (layer, kv, r)
            for j, s in enumerate(slots.tolist()):
                if s >= 0:
                    assert torch.equal(as_bytes(rows[s]), as_bytes(src[kv, layer, j]))


def test_dummy_page_is_a_real_slot_and_minus_one_is_skip():
    k, v = fx.alloc_mha_053(num_layers=2, size=12, page_size=4, head_num=2, head_dim=4)
    lay = kvcore.detect([k, v], "sglang", {"page_size": 4, "kv_list_layout": "nested"})
    src = torch.arange(2 * 2 * 3 * 8, dtype=torch.bfloat16).reshape(2, 2, 3, 8) + 1
    loc = torch.tensor([0, 3, 9])  # slots 0 and 3 are the padded page (page 0)
    kvcore.scatter(lay, slot_mapping(loc), src)
    assert torch.equal(k[1][0].reshape(-1), src[0, 1, 0]) and torch.equal(v[0][3].reshape(-1), src[1, 0, 1])
    assert torch.equal(k[0][9].reshape(-1), src[0, 0, 2])
    # skipping the dummy page: -1 leaves it untouched
    k[0].zero_()
    sm = slot_mapping(loc, page_size=4, skip_dummy_page=True)
    assert sm.tolist() == [-1, -1, 9]
    kvcore.scatter(lay, sm, src + 100)
    assert torch.count_nonzero(k[0][:4]) == 0 and torch.equal(k[0][9].reshape(-1), src[0, 0, 2] + 100)
    out = kvcore.gather(lay, torch.tensor([0, -1]))
    assert torch.equal(out[1, 1, 0], v[1][0].reshape(-1)) and torch.count_nonzero(out[:, :, 1]) == 0


def test_out_of_range_slot_is_refused_before_writing():
    k, v = fx.alloc_mha_053(num_layers=1, size=7, page_size=1, head_num=2, head_dim=4)
    lay = kvcore.detect([k, v], "sglang")
    src = torch.ones(2, 1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(kvcore.TransferError, match="out of range"):
        kvcore.scatter(lay, torch.tensor([1, 8]), src)  # rows are size + page_size = 8: slot 8 does not exist
    assert torch.count_nonzero(k[0]) == 0 and torch.count_nonzero(v[0]) == 0
    with pytest.raises(kvcore.TransferError):
        slot_mapping(torch.tensor([[1, 2]]))


def test_indexer_pool_gathers_keys_then_scales_by_page_and_by_slot():
    ps = 64
    bufs = fx.alloc_indexer(num_layers=2, size=3 * ps - 1, page_size=ps)  # 3 pages
    for i, b in enumerate(bufs):
        fill_random(b, seed=40 + i)
    lay = kvcore.detect(bufs, "sglang", {"sglang_version": "0.5.3"})
    out = kvcore.gather_blocks(lay, torch.tensor([2, 0]))
    assert tuple(out.shape) == (1, 2, 2 * ps, 132) and out.dtype == torch.uint8
    for layer, b in enumerate(bufs):
        for j, page in enumerate([2, 0]):
            for t in (0, 1, ps - 1):
                row = out[0, layer, j * ps + t]
                # SGLang: buf[page, :ps*128] are fp8 keys (token t at t*128), buf[page, ps*128:] fp32 scales (t at t*4)
                assert torch.equal(row[:128], b[page, t * 128 : (t + 1) * 128])
                assert torch.equal(row[128:], b[page, ps * 128 + 4 * t : ps * 128 + 4 * t + 4])
        scales = b[2, ps * 128 :].view(torch.float32)
        assert torch.equal(out[0, layer, 5, 128:].view(torch.float32), scales[5:6])
    # token slots: loc -> page loc // 64, offset loc % 64
    loc = torch.tensor([2 * ps + 5, 70])
    by_slot = kvcore.gather(lay, loc)
    assert torch.equal(by_slot[0, :, 0], out[0, :, 5]) and torch.equal(by_slot[0, 1, 1, :128], bufs[1][1, 6 * 128 : 7 * 128])
    vals, scl = fx.indexer_segment_views(bufs[1], ps)
    assert vals.untyped_storage().data_ptr() == bufs[1].untyped_storage().data_ptr()
    assert torch.equal(out[0, 1, ps + 3], torch.cat([vals[0, 3, 0], scl[0, 3, 0]]))  # page 0, token 3
    # round trip into other pages: keys and scales land in their own regions
    kvcore.scatter_blocks(lay, torch.tensor([1, 0]), out)
    assert torch.equal(bufs[0][1], bufs[0][2]) and torch.equal(bufs[1][1], bufs[1][2])


def _sglang_host_k(buf, mem, layer, host_idx, page_size):
    """A host pool's K rows for ``host_idx`` as SGLang's host-pool code indexes them."""
    if mem == "layer_first":
        return buf[0, layer, host_idx]
    if mem == "page_first":
        return buf[0, host_idx, layer]
    p, o = host_idx // page_size, host_idx % page_size
    if mem == "page_first_direct":
        return buf[0, p, layer, o]
    return buf[0, p, :, o, layer]  # page_head: (2, pages, NH, page_size, NL, HS)


@pytest.mark.parametrize("mem", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_device_pool_offloads_into_host_pool_in_sglangs_layout(mem, dtype):
    nl, ps, nh, hs = 3, 4, 2, 8
    k, v = fx.alloc_mha_0523(nl, size=24, page_size=ps, head_num=nh, head_dim=hs, dtype=dtype)
    hints = {"kv_cache_dtype": dtype} if dtype != torch.bfloat16 else {}
    dev = kvcore.detect([k, v], "sglang", {**hints, "page_size": ps})
    for layer in range(nl):
        fill_random(k[layer], 10 + layer)
        fill_random(v[layer], 20 + layer)
    host = fx.alloc_host_mha(mem, nl, size=32, page_size=ps, head_num=nh, head_dim=hs, dtype=dtype)
    hl = kvcore.detect(host, "sglang", {**hints, "mem_layout": mem})
    loc = torch.tensor([8, 9, 10, 11, 20, 21])  # device pages 2 and 5
    host_idx = torch.tensor([12, 13, 14, 15, 28, 29])  # host pages 3 and 7
    kvcore.scatter(hl, host_idx, kvcore.gather(dev, loc))
    for layer in range(nl):
        got = _sglang_host_k(host, mem, layer, host_idx, ps)
        assert torch.equal(as_bytes(got), as_bytes(k[layer][loc])), (mem, layer)
    # V too, through SGLang's v_buffer = kv_buffer[1]
    vb = host[1:2]
    assert torch.equal(as_bytes(_sglang_host_k(vb, mem, 1, host_idx, ps)), as_bytes(v[1][loc]))
    # and back into other device slots
    back = torch.tensor([4, 5, 6, 7, 12, 13])
    kvcore.scatter(dev, back, kvcore.gather(hl, host_idx))
    for layer in range(nl):
        assert torch.equal(as_bytes(k[layer][back]), as_bytes(k[layer][loc]))
        assert torch.equal(as_bytes(v[layer][back]), as_bytes(v[layer][loc]))


@pytest.mark.parametrize("mem", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pool_offloads_into_mla_host_pool(mem):
    nl, ps, d = 3, 4, 40
    kv = fx.alloc_mla(nl, size=12, page_size=ps, kv_cache_dim=d, dtype=torch.float8_e4m3fn)
    assert kv[0].dtype == torch.uint8  # SGLang's store_dtype for fp8
    for layer in range(nl):
        fill_random(kv[layer], 50 + layer)
    dev = kvcore.detect(kv, "sglang", {"is_mla": True, "kv_cache_dtype": "fp8_e4m3"})
    host = fx.alloc_host_mla(mem, nl, size=16, page_size=ps, kv_cache_dim=d, dtype=torch.float8_e4m3fn)
    hl = kvcore.detect(host, "sglang", {"mem_layout": mem, "kv_cache_dtype": "fp8_e4m3"})
    loc, hidx = torch.tensor([5, 6, 15]), torch.tensor([0, 9, 3])
    staged = kvcore.gather(dev, loc)
    assert staged.dtype == torch.float8_e4m3fn and tuple(staged.shape) == (1, nl, 3, d)
    kvcore.scatter(hl, hidx, staged)
    for layer in range(nl):
        view = fx.host_kv_view(host, mem, layer, 0, mla=True)
        bs = view.shape[1]
        for h, lc in zip(hidx.tolist(), loc.tolist()):
            assert torch.equal(view[h // bs, h % bs].reshape(-1), kv[layer][lc].reshape(-1))


def test_indexer_pages_are_described_by_the_scale_width_detection_passes():
    # the core reads NL_X_NB_BSV_BSS from the grammar; the plugin supplies the engine fact,
    # 4 scale bytes per 132-byte record: keys at token stride 128, scales after the page's keys
    bufs = fx.alloc_indexer(num_layers=2, size=8 * 3, page_size=8)
    lay = kvcore.detect(bufs, "sglang", {"sglang_version": "0.5.3"})
    assert (lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size, lay.kv_size) == (bufs[0].shape[0], 8, 1, 132, 1)
    vals, scales = lay.stride_table().planes
    assert (vals.role, vals.block, vals.token, vals.chunk_bytes, vals.staging.offset) == ("VALS", 8 * 132, 128, 128, 0)
    # the scales start after the page's 8 key records, 4 bytes a token, staged after the keys
    assert (scales.role, scales.block, scales.token, scales.chunk_bytes, scales.staging.offset) == ("SCALES", 8 * 132, 4, 4, 128)
    assert [off for _, off in scales.bases] == [off + 8 * 128 for _, off in vals.bases]
    assert lay.describe() == f"2 x [{bufs[0].shape[0]}, 8x128, 8x4]"
    with pytest.raises(kvcore.GeometryError, match="scale_bytes"):
        kvcore.build_layout("NL_X_NB_BSV_BSS", lay.kv_caches)
    with pytest.raises(kvcore.GeometryError, match="bytes"):
        kvcore.build_layout("NL_X_NB_BSV_BSS", [b.view(torch.float16) for b in lay.kv_caches], params={"scale_bytes": 4})


def _sgl_index_read(buf, loc, ips, r):
    """SGLang 0.5.23 IndexKeyCache.move's addressing: kernel view rows of ips tokens,
    keys [:ips*128] (token t at t*128), scales [ips*128:] (t at t*4); loc -> (loc // ips, loc % ips)."""
    kv = buf.view(-1, buf.shape[1] // r)
    keys = kv[:, : ips * 128].view(kv.shape[0], ips, 128)
    scales = kv[:, ips * 128 :].view(kv.shape[0], ips, 4)
    return keys[loc // ips, loc % ips], scales[loc // ips, loc % ips]


@pytest.mark.parametrize(
    "hints", [{"page_size": 128, "attn_dcp_size": 2, "dcp_replicated": True}, {"index_page_size": 64}, {"index_page_size": 32}]
)
def test_dcp_indexer_pool_gathers_and_scatters_by_sglangs_kernel_pages(hints):
    # 0.5.23 DSATokenToKVPool(dcp_replicated) with page_size 128, attn_dcp_size 2: index_page_size 64, rows of 128 records
    ips = hints.get("index_page_size", 64)
    r = 128 // ips
    bufs = [torch.zeros(3, 128 * 132, dtype=torch.uint8) for _ in range(2)]
    for i, b in enumerate(bufs):
        fill_random(b, seed=70 + i)
    lay = kvcore.detect(bufs, "sglang", hints)
    assert (lay.num_blocks, lay.block_size, lay.head_size) == (3 * r, ips, 132)
    assert lay.data_ptrs() == [b.data_ptr() for b in bufs]
    loc = torch.tensor([ips, ips + 1, 130, 200, 3 * 128 - 1, 5])
    out = kvcore.gather(lay, loc)
    for layer, b in enumerate(bufs):
        keys, scales = _sgl_index_read(b, loc, ips, r)
        assert torch.equal(out[0, layer], torch.cat([keys, scales], 1))
    # scatter: the buffers equal SGLang's own write of the records (IndexKeyCache.move's addressing), nothing else changes
    expected = [b.clone() for b in bufs]
    dst = torch.tensor([7, ips + 3, 2 * 128 + 9])
    new = torch.randint(0, 256, (1, 2, 3, 132), dtype=torch.uint8)
    kvcore.scatter(lay, dst, new)
    for layer, b in enumerate(bufs):
        kv = expected[layer].view(-1, b.shape[1] // r)
        keys = kv[:, : ips * 128].view(kv.shape[0], ips, 128)
        scales = kv[:, ips * 128 :].view(kv.shape[0], ips, 4)
        keys[dst // ips, dst % ips] = new[0, layer, :, :128]
        scales[dst // ips, dst % ips] = new[0, layer, :, 128:]
        assert torch.equal(b, expected[layer])


def test_skip_topk_placeholder_layers_are_left_out_of_the_indexer_layout():
    # 0.5.23 IndexKeyCache._layer_num_pages: layers that reuse the previous top-k get (0, W) placeholders
    bufs = [torch.zeros(5, 64 * 132, dtype=torch.uint8), torch.zeros(0, 64 * 132, dtype=torch.uint8)]
    bufs += [torch.zeros(5, 64 * 132, dtype=torch.uint8), torch.zeros(0, 64 * 132, dtype=torch.uint8)]
    for i in (0, 2):
        fill_random(bufs[i], seed=90 + i)
    lay = kvcore.detect(bufs, "sglang", {"index_page_size": 64})
    assert (lay.num_layers, lay.layer_ids, lay.num_blocks) == (2, (0, 2), 5)
    assert lay.data_ptrs() == [bufs[0].data_ptr(), bufs[2].data_ptr()]
    out = kvcore.gather(lay, torch.tensor([70]))
    for j, i in enumerate((0, 2)):
        keys, scales = _sgl_index_read(bufs[i], torch.tensor([70]), 64, 1)
        assert torch.equal(out[0, j], torch.cat([keys, scales], 1))
    named = kvcore.detect({f"layers.{i}.index_k": b for i, b in enumerate(bufs)}, "sglang", {"index_page_size": 64})
    assert named.layer_names == ("layers.0.index_k", "layers.2.index_k")
    with pytest.raises(kvcore.DetectionError, match="skip_topk_layers"):
        kvcore.detect(bufs[1:2], "sglang")  # only placeholders: nothing to move
    per = kvcore.detect_per_layer(bufs, "sglang", hints={"index_page_size": 64})
    assert per[1] is None and per[3] is None and per[0] is per[2]  # placeholders are not KV, like Mamba state
    assert per[0].layer_ids == (0, 2)
