"""Detection of DynamicCache / StaticCache: hybrids, refusals, versions, hints."""

from __future__ import annotations

import pytest
import torch
from kvcore_transformers import LAYER_PAIRS_FORMAT, kv_caches
from kvcore_transformers.fixtures import Legacy453DynamicCache
from kvcore_transformers.versions import PAGED_RANGE, SUPPORTED_RANGE, check_version

import kvcore


def _states(b, nh, s, hs, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, nh, hs, generator=g).to(dtype).transpose(1, 2)


def _hybrid_dynamic(window=4, seq=9):
    """A DynamicCache built from a config with sliding and full layers (5.24 ``DynamicCache(config=...)``)."""
    from transformers import DynamicCache, MistralConfig

    cfg = MistralConfig(
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=8, hidden_size=16, sliding_window=window
    )
    cfg.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cache = DynamicCache(config=cfg)
    written = []
    for i in range(4):
        k, v = _states(1, 2, seq, 8, 2 * i), _states(1, 2, seq, 8, 2 * i + 1)
        cache.update(k, v, i)
        written.append((k, v))
    return cache, written


def test_hybrid_dynamic_cache_needs_per_layer_detection():
    cache, written = _hybrid_dynamic()
    with pytest.raises(kvcore.DetectionError, match="detect_per_layer"):
        kvcore.detect(cache, engine="transformers")
    layouts = kvcore.detect_per_layer(kv_caches(cache), engine="transformers")
    sliding, full = layouts[0], layouts[1]
    assert layouts[2] is sliding and layouts[3] is full
    assert sliding.layer_ids == (0, 2) and full.layer_ids == (1, 3)
    assert (sliding.block_size, full.block_size) == (3, 9)  # the sliding layer keeps window - 1 tokens
    # the sliding layers hold the last window-1 positions: slot s is position seq - 3 + s
    staged = kvcore.gather(sliding, torch.arange(3))
    k2 = written[2][0][0].transpose(0, 1)[-3:].reshape(3, 16)
    assert torch.equal(staged[0, 1], k2)
    staged = kvcore.gather(full, torch.arange(9))
    assert torch.equal(staged[1, 1], written[3][1][0].transpose(0, 1).reshape(9, 16))


def test_batch_rows_are_blocks():
    """slot = b * seq + position addresses batch row b (num_blocks = batch)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    k, v = _states(3, 2, 5, 4, 0), _states(3, 2, 5, 4, 1)
    cache.update(k, v, 0)
    lay = kvcore.detect(cache, engine="transformers")
    assert (lay.num_blocks, lay.block_size, lay.format.name) == (3, 5, LAYER_PAIRS_FORMAT)
    staged = kvcore.gather(lay, torch.tensor([2 * 5 + 4, 0 * 5 + 1]))
    assert torch.equal(staged[0, 0, 0], k[2, :, 4].reshape(-1))
    assert torch.equal(staged[1, 0, 1], v[0, :, 1].reshape(-1))
    assert torch.equal(kvcore.gather_blocks(lay, [1])[0, 0], k[1].transpose(0, 1).reshape(5, 8))


def test_k_and_v_head_sizes_that_differ_are_refused_with_the_way_out():
    cache = Legacy453DynamicCache()
    k, v = _states(1, 2, 5, 12, 0), _states(1, 2, 5, 8, 1)
    cache.update(k, v, 0)
    with pytest.raises(kvcore.DetectionError, match="K head size 12 differs from V head size 8") as e:
        kvcore.detect(cache, engine="transformers")
    assert "NL_X_NB_NH_BS_HS" in str(e.value)
    # the way out the message names works: K and V as two key-only layouts
    kl = kvcore.build_layout("NL_X_NB_NH_BS_HS", [k for k, _ in kv_caches(cache)])
    assert (kl.kv_size, kl.head_size) == (1, 12)
    assert torch.equal(kvcore.gather(kl, torch.arange(5))[0, 0], k[0].transpose(0, 1).reshape(5, 24))


def test_refusals():
    from transformers import DynamicCache, EncoderDecoderCache

    with pytest.raises(kvcore.DetectionError, match="no layers yet|hold no KV yet"):
        kvcore.detect(DynamicCache(), engine="transformers")
    enc = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with pytest.raises(kvcore.DetectionError, match="self_attention_cache"):
        kvcore.detect(enc, engine="transformers")
    cache = DynamicCache()
    cache.update(_states(1, 2, 3, 4, 0), _states(1, 2, 3, 4, 1), 0)
    with pytest.raises(kvcore.DetectionError, match="does not know the hints"):
        kvcore.detect(cache, engine="transformers", hints={"kv_cache_layout": "HND"})
    with pytest.raises(kvcore.DetectionError, match="container"):
        kvcore.detect(kv_caches(cache), engine="transformers", hints={"container": "dict"})
    # not a cache at all: the plugin does not claim it, and detect says nothing recognises it
    with pytest.raises(kvcore.DetectionError, match="no kvcore plugin recognises"):
        kvcore.detect(object(), engine="transformers")
    # another engine's name: this plugin stays out of it
    assert kvcore.registry.host().pm.hook.kvcore_detect.get_hookimpls()  # plugins are loaded
    from kvcore_transformers.plugin import kvcore_detect

    assert kvcore_detect(kv_caches=cache, engine="vllm", hints={}) is None


def test_two_lists_of_two_tensors_need_the_container_hint():
    """[K list, V list] of 2 layers and 2 [K, V] lists have the same shapes: never guess."""
    ks = [_states(1, 2, 3, 4, 0), _states(1, 2, 3, 4, 1)]
    vs = [_states(1, 2, 3, 4, 2), _states(1, 2, 3, 4, 3)]
    with pytest.raises(kvcore.AmbiguousLayoutError) as e:
        kvcore.detect([ks, vs], engine="transformers")
    assert e.value.hints == ["container"]
    lay = kvcore.detect([ks, vs], engine="transformers", hints={"container": "kv_lists"})
    assert torch.equal(kvcore.gather(lay, torch.arange(3))[1, 0], vs[0][0].transpose(0, 1).reshape(3, 8))
    # three layers as [K list, V list] cannot be pairs; tuples are pairs
    ks.append(_states(1, 2, 3, 4, 4))
    vs.append(_states(1, 2, 3, 4, 5))
    lay3 = kvcore.detect([ks, vs], engine="transformers")
    assert lay3.num_layers == 3
    assert torch.equal(kvcore.gather(lay3, torch.arange(3))[1, 2], vs[2][0].transpose(0, 1).reshape(3, 8))
    pairs = kvcore.detect([(ks[0], vs[0]), (ks[1], vs[1])], engine="transformers")
    assert torch.equal(kvcore.gather(pairs, torch.arange(3))[1, 1], vs[1][0].transpose(0, 1).reshape(3, 8))


def test_kv_lists_container_hint():
    cache = Legacy453DynamicCache()
    for i in range(2):
        cache.update(_states(1, 2, 3, 4, 2 * i), _states(1, 2, 3, 4, 2 * i + 1), i)
    a = kvcore.detect([cache.key_cache, cache.value_cache], engine="transformers", hints={"container": "kv_lists"})
    b = kvcore.detect(cache, engine="transformers")
    assert a.stride_table().signature() == b.stride_table().signature()


@pytest.mark.parametrize(
    "version,ok", [("4.52.4", False), ("4.53.0", True), ("4.57.6", True), ("5.24.0", True), ("5.25.0", False), ("6.0.0", False)]
)
def test_supported_range(version, ok):
    if ok:
        assert check_version(version=version) == version
    else:
        with pytest.raises(kvcore.DetectionError) as e:
            check_version(version=version)
        assert f"transformers{SUPPORTED_RANGE[0]},{SUPPORTED_RANGE[1]}" in str(e.value) and version in str(e.value)


def test_paged_range_and_version_hint():
    with pytest.raises(kvcore.DetectionError, match=f"transformers{PAGED_RANGE[0]},{PAGED_RANGE[1]}"):
        check_version("paged cache", paged=True, version="5.17.0")
    assert check_version(paged=True, version="5.18.0") == "5.18.0"
    cache = Legacy453DynamicCache()
    cache.update(_states(1, 2, 3, 4, 0), _states(1, 2, 3, 4, 1), 0)
    with pytest.raises(kvcore.DetectionError, match="4.40.0"):
        kvcore.detect(kv_caches(cache), engine="transformers", hints={"transformers_version": "4.40.0"})


def test_installed_version_outside_the_range_is_refused(monkeypatch):
    import kvcore_transformers.versions as versions
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(_states(1, 2, 3, 4, 0), _states(1, 2, 3, 4, 1), 0)
    monkeypatch.setattr(versions, "installed_version", lambda: "5.30.0")
    with pytest.raises(kvcore.DetectionError, match="transformers 5.30.0 is installed"):
        kvcore.detect(cache, engine="transformers")


def test_layers_without_per_token_kv_are_left_out_with_their_model_ids():
    """5.24 DummyLayer (KV-shared / attention-free layers) and LinearAttentionLayer (recurrent
    state) hold no per-token KV: the layout covers the other layers, with their model ids."""
    from transformers import DynamicCache

    cu = pytest.importorskip("transformers.cache_utils")
    if not (hasattr(cu, "DummyLayer") and hasattr(cu, "LinearAttentionLayer")):
        pytest.skip("this transformers has no DummyLayer / LinearAttentionLayer (5.24 has both)")
    DummyLayer, LinearAttentionLayer = cu.DummyLayer, cu.LinearAttentionLayer
    cache = DynamicCache()
    written = []
    for i in range(4):
        k, v = _states(1, 2, 5, 4, 2 * i), _states(1, 2, 5, 4, 2 * i + 1)
        cache.update(k, v, i)
        written.append((k, v))
    cache.layers[1] = DummyLayer()
    cache.layers[3] = LinearAttentionLayer()
    lay = kvcore.detect(cache, engine="transformers")
    assert lay.num_layers == 2 and lay.layer_ids == (0, 2)
    assert "[1, 3]" in lay.note
    staged = kvcore.gather(lay, torch.arange(5))
    assert torch.equal(staged[0, 1], written[2][0][0].transpose(0, 1).reshape(5, 8))
    per = kvcore.detect_per_layer(kv_caches(cache), engine="transformers")
    assert per[1] is None and per[3] is None and per[0] is per[2] and per[0].layer_ids == (0, 2)
    cache.layers[0] = DummyLayer()
    cache.layers[2] = DummyLayer()
    with pytest.raises(kvcore.DetectionError, match="no layer of this DynamicCache holds per-token KV"):
        kvcore.detect(cache, engine="transformers")


def test_dtype_names_and_the_generic_tensor_order_hint():
    from kvcore_transformers.caches import CachePair, as_dtype

    assert as_dtype("float8_e4m3fnuz") is torch.float8_e4m3fnuz and as_dtype("bf16") is torch.bfloat16  # kvcore's one table
    pairs = [(torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 5, 8)) for _ in range(2)]
    # plain contiguous tensors: as allocated [batch, NH=3, seq=5, HS], or a transposed allocation
    # [batch, seq=3, NH=5, HS] someone permuted into memory order -- never guessed
    with pytest.raises(kvcore.AmbiguousLayoutError) as ei:
        kvcore.detect(pairs, engine="transformers")
    assert set(ei.value.hints) == {"num_kv_heads", "tensor_order"}
    lay = kvcore.detect(pairs, engine="transformers", hints={"tensor_order": "allocated"})
    assert (lay.format.name, lay.num_heads, lay.block_size) == (LAYER_PAIRS_FORMAT, 3, 5)
    assert kvcore.detect(pairs, engine="transformers", hints={"num_kv_heads": 3}).num_heads == 3
    lay = kvcore.detect(pairs, engine="transformers", hints={"tensor_order": "physical", "num_kv_heads": 5})
    assert (lay.format.name, lay.num_heads, lay.block_size) == ("NL_X_TWO_X_NB_BS_NH_HS", 5, 3)
    # pairs read out of the cache object are as transformers allocated them
    own = [CachePair(p) for p in pairs]
    assert kvcore.detect(own, engine="transformers").num_heads == 3
    with pytest.raises(kvcore.DetectionError, match="tensor_order='sideways' is not known"):
        kvcore.detect(pairs, engine="transformers", hints={"tensor_order": "sideways"})
