"""Real continuous batching on a hybrid model (sliding-window and full-attention layers).

transformers allocates one uint8 tensor carved by two allocators; a request's blocks are
held at finish (as the demo does), and kvcore's gather of each group's slots — the
sliding group a ring of the last ``sliding_window`` positions — must equal the same
model's DynamicCache (which keeps ``sliding_window - 1`` positions of sliding layers).
"""

from __future__ import annotations

import logging

import torch
from kvcore_transformers import demo, detect_paged, kv_caches, paged_groups, request_slots

import kvcore


def test_hybrid_model_paged_groups_match_the_dynamic_cache():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    model = Qwen2ForCausalLM(cfg).eval()
    prompts = demo._prompts(0, [30, 9, 17], cfg.vocab_size)
    cache, held, results = demo._run_continuous_batching(model, prompts, "keep", 5, 4, 48)
    assert len(results) == 3 and all(r.error is None for r in results.values())
    layouts = detect_paged(cache)
    assert layouts["sliding_attention"].layer_ids == (0, 2) and layouts["full_attention"].layer_ids == (1, 3)
    res = results["keep"]
    tokens = list(res.prompt_ids) + list(res.generated_tokens)[:-1]
    n = len(tokens)
    with torch.no_grad():
        ref = kv_caches(demo._cache_of(model(input_ids=torch.tensor([tokens]), use_cache=True)))
    for name, group in paged_groups(cache).items():
        slots = request_slots(group, held[name], n)
        stored = (slots >= 0).nonzero().flatten()
        assert len(stored) == (8 if name == "sliding_attention" else n)
        staged = kvcore.gather(layouts[name], slots)
        for i, layer in enumerate(group.layer_ids):
            k, v = ref[layer]
            s = k.shape[2]  # the DynamicCache keeps the last s positions
            pos = stored[stored >= n - s]
            assert len(pos) == min(s, len(stored))
            for kv, t in ((0, k), (1, v)):
                want = t[0].transpose(0, 1)[pos - (n - s)].reshape(len(pos), -1)
                err = float((staged[kv, i][pos] - want).abs().max())
                assert err <= 1e-5 * float(want.abs().max()), f"{name} layer {layer} {'KV'[kv]}: max err {err}"
