"""Check kvcore-transformers against another transformers release without replacing the venv's.

Used to verify the supported range (README "Supported transformers versions")::

    pip install --target /tmp/tf/4.53.3 --no-deps transformers==4.53.3 "huggingface_hub<1.0" "tokenizers<0.22" requests
    PYTHONPATH=/tmp/tf/4.53.3 .venv/bin/python plugins/transformers/scripts/check_version.py

It runs a tiny random Llama (batch 2) through a DynamicCache and a StaticCache forward pass,
checks that kvcore's gather equals the caches' own tensors (slot = b * seq + position), then
runs the demo's DynamicCache path (offload after prefill, rebuild by scatter, identical greedy
continuation). Exit code 0 when every check passes. For 5.18+ run the whole demo too:
``PYTHONPATH=... python -m kvcore_transformers.demo`` (5.18 - 5.20 need psutil on CPU).
"""

import inspect
import json
import sys

import torch
import transformers
from kvcore_transformers import demo
from transformers import StaticCache

import kvcore

print("transformers", transformers.__version__)
model = demo.build_model(0)
g = torch.Generator().manual_seed(5)
prompt = torch.randint(3, 256, (2, 13), generator=g)  # batch 2: slot = b * seq + pos
with torch.no_grad():
    out = model(input_ids=prompt, use_cache=True)
dyn = demo._cache_of(out)
lay = kvcore.detect(dyn, engine="transformers")
print(type(dyn).__name__, lay.format.name, lay.describe())
staged = kvcore.gather(lay, torch.arange(2 * 13))
own_k = dyn.key_cache if isinstance(getattr(dyn, "key_cache", None), list) else [layer.keys for layer in dyn.layers]
own_v = dyn.value_cache if isinstance(getattr(dyn, "value_cache", None), list) else [layer.values for layer in dyn.layers]
ok = all(
    torch.equal(staged[0, i], own_k[i].transpose(1, 2).reshape(26, -1))
    and torch.equal(staged[1, i], own_v[i].transpose(1, 2).reshape(26, -1))
    for i in range(4)
)
print("dynamic gather == cache tensors:", ok, "contiguous:", own_k[0].is_contiguous())
params = inspect.signature(StaticCache.__init__).parameters
kw = dict(config=model.config, max_cache_len=40)
if "max_batch_size" in params:
    kw["max_batch_size"] = 2
if "dtype" in params:
    kw["dtype"] = torch.float32
st = StaticCache(**kw)
with torch.no_grad():
    model(input_ids=prompt, past_key_values=st, use_cache=True, cache_position=torch.arange(13))
slay = kvcore.detect(st, engine="transformers")
print("StaticCache", slay.format.name, slay.describe())
slots = torch.cat([torch.arange(13), 40 + torch.arange(13)])
s2 = kvcore.gather(slay, slots)
err = (s2 - staged).abs().max().item()
print("static gather vs dynamic max err", err)
res = {}
okd = demo.part_dynamic(model, type("A", (), {"seed": 0, "dynamic_prompt_len": 29, "max_new_tokens": 8})(), res)
print(
    "dynamic offload/rebuild/continue:",
    okd,
    json.dumps({k: res["dynamic"][k] for k in ("format", "concrete", "rebuilt_bit_exact", "identical", "uninterrupted")}),
)
sys.exit(0 if (ok and err <= 1e-5 * float(staged.abs().max()) and okd) else 1)
