"""Distinct tensors over one memory: vLLM 0.33's hybrid KV-cache groups (full attention and
sliding window aliasing one buffer from byte 0, each group read through its own block table:
``v1/core/kv_cache_planning.py::get_kv_cache_config_from_groups``) versus KV sharing (one
tensor object under several layer names: ``gpu_model_runner.py``, ``kv_caches[layer_name] =
kv_caches[target_layer_name]``). The tensors cannot tell the two apart; they place a slot's
bytes differently, so kvcore never picks one: ``layer_groups`` decides."""

from __future__ import annotations

import pytest
import torch

import kvcore

HINTS = {"vllm_version": "0.11.0", "attention_backend": "FLASH_ATTN", "kv_cache_layout": "NHD"}


def _buf():
    g = torch.Generator().manual_seed(3)
    return torch.randint(-1000, 1000, (2, 4, 16, 2, 64), generator=g, dtype=torch.int16).view(torch.bfloat16)


def test_distinct_views_of_one_memory_need_layer_groups():
    a, b = _buf(), _buf()
    # f0 and s1 alias one buffer (two groups), f2 and s3 another: distinct view objects
    caches = {"f0": a.view(a.shape), "s1": a.view(a.shape), "f2": b.view(b.shape), "s3": b.view(b.shape)}
    for call in (lambda: kvcore.detect(caches, "vllm", HINTS), lambda: kvcore.detect_per_layer(caches, "vllm", hints=HINTS)):
        with pytest.raises(kvcore.AmbiguousLayoutError) as e:
            call()
        assert e.value.hints == ["layer_groups"] and "distinct tensors over the same memory" in str(e.value)
    # the engine's groups decide: each group one layout over its own views, no aliases
    out = kvcore.detect_per_layer(caches, "vllm", hints=HINTS, layer_groups=[["f0", "f2"], ["s1", "s3"]])
    assert out["f0"] is out["f2"] and out["s1"] is out["s3"] and out["f0"] is not out["s1"]
    assert not out["f0"].aliases and out["f0"].layer_names == ("f0", "f2")
    slots = torch.tensor([0, 17, 63])
    g = kvcore.gather(out["s1"], slots)
    flat = a.view(2, 64, 2 * 64)
    assert torch.equal(g[:, 0].view(torch.int16), flat[:, slots].view(torch.int16))


def test_one_tensor_under_two_names_is_kv_sharing():
    a, b = _buf(), _buf()
    caches = {"model.layers.0.attn": a, "model.layers.1.attn": b, "model.layers.2.attn": a}
    lay = kvcore.detect(caches, "vllm", HINTS)
    assert lay.num_layers == 3 and lay.aliases == {2: 0}
    out = kvcore.detect_per_layer(caches, "vllm", hints=HINTS)
    assert out["model.layers.2.attn"].aliases == {2: 0}
