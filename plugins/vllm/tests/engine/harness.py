"""Run the real vLLM in-process with tiny models written here, and record what it wrote.

Used by the tests in this folder, which run inside an engine virtualenv
(``scripts/engine_envs.py``: ``.venvs/vllm-0.32``, ``.venvs/vllm-0.28``). Nothing is downloaded:
each model is a ``config.json`` written in a temporary folder, loaded with
``load_format="dummy"``; prompts are token ids.

* :func:`tiny_model` writes a model family's config (Llama GQA, Qwen3, Qwen2, Gemma-2 with
  sliding-window and full layers, GraniteMoeHybrid with Mamba2 + attention, DeepSeek-V2 MLA).
* :func:`make_llm` builds ``vllm.LLM`` with weights drawn so that the output depends on the KV
  cache (vLLM's dummy loader draws weights in +-1e-3: nearly uniform logits, so a corrupted
  cache would change nothing).
* :class:`WriterLog` wraps vLLM's cache writers (``cpu_attn_reshape_and_cache`` and the MLA
  writers): every row a writer received, with its slot, is the truth a gather must return.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])

_BASE = dict(
    vocab_size=512,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
_GQA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

#: tiny configs of the model families the tests run (vLLM's own model classes load them)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=64, **_GQA),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=64, **_GQA),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **_GQA),
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
        query_pre_attn_scalar=64,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=True,  # vLLM's Gemma2ForCausalLM asserts it (0.28)
    ),
    "granitehybrid": dict(
        architectures=["GraniteMoeHybridForCausalLM"],
        model_type="granitemoehybrid",
        layer_types=["mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        num_local_experts=0,
        num_experts_per_tok=0,
        shared_intermediate_size=512,
        position_embedding_type="rope",
        embedding_multiplier=1.0,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        attention_multiplier=0.125,
        **_GQA,
    ),
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        moe_intermediate_size=128,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=2,
        moe_layer_freq=1,
        topk_method="greedy",
        scoring_func="softmax",
    ),
}

#: families with state layers: vLLM CPU cannot checkpoint Mamba states for prefix caching
#: (``mamba_mixer2.py`` indexes intermediate states its CPU scan does not return)
NO_PREFIX_CACHING = ("granitehybrid",)


def tiny_model(root: Path, family: str, dtype: str = "bfloat16") -> str:
    """Write ``family``'s config into ``root/family-dtype`` and return the folder."""
    d = Path(root) / f"{family}-{dtype}"
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(_BASE)
    cfg.update(FAMILIES[family])
    cfg["torch_dtype"] = dtype
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


# -- weights that make the output depend on the cache ---------------------------------------

_GEN = torch.Generator().manual_seed(0)


def _dummy_weight(tensor: torch.Tensor, *args, **kwargs) -> None:
    """Uniform weights of variance 1/fan_in (1-D tensors around 1): activations of order
    one through the layers, so attention, and so the KV cache, decides the next token."""
    if not torch.is_floating_point(tensor) or tensor.numel() == 0:
        return
    with torch.no_grad():
        if tensor.dim() >= 2:
            a = math.sqrt(3.0 / tensor.shape[-1])
            tensor.copy_((torch.rand(tensor.shape, generator=_GEN) * 2 - 1).mul_(a).to(tensor.dtype))
        else:
            tensor.copy_((torch.rand(tensor.shape, generator=_GEN) * 0.5 + 0.75).to(tensor.dtype))


@contextlib.contextmanager
def _informative_weights() -> Iterator[None]:
    from vllm.model_executor.model_loader import dummy_loader

    def whole_module(module, *args, **kwargs) -> None:  # 0.28's DummyModelLoader: initialize_dummy_weights(layer, config)
        for t in list(module.parameters()) + list(module.buffers()):
            _dummy_weight(t)

    names = {"initialize_single_dummy_weight": _dummy_weight, "initialize_dummy_weights": whole_module}
    orig = {n: getattr(dummy_loader, n) for n in names if hasattr(dummy_loader, n)}
    _GEN.manual_seed(1234)  # the same weights for every LLM of one config
    for n in orig:
        setattr(dummy_loader, n, names[n])
    try:
        yield
    finally:
        for n, f in orig.items():
            setattr(dummy_loader, n, f)


def make_llm(
    model_dir: str,
    *,
    dtype: str = "bfloat16",
    block_size: int = 32,
    kv_cache_dtype: str = "auto",
    prefix_caching: bool = False,
    max_model_len: int = 1024,
    cache_mb: int = 32,
    **kw: Any,
) -> LLM:
    """``vllm.LLM`` on the CPU, in this process, with informative dummy weights."""
    with _informative_weights():
        llm = LLM(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=dtype,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=max_model_len,
            max_num_seqs=4,
            kv_cache_memory_bytes=cache_mb << 20,
            enable_prefix_caching=prefix_caching,
            seed=0,
            **kw,
        )
    _post_load(llm)
    return llm


def _post_load(llm: LLM) -> None:
    """What the dummy draw cannot know from a tensor alone, fixed by name: Mamba's ``A`` is stored
    as ``-exp(A_log)`` by the weight loader (positive, the state grows without bound: NaN
    logits), so it becomes a decay; biases around 1 (Qwen2's q/k/v) drown the attention scores
    in a constant, so they become small."""
    with torch.no_grad():
        for name, p in runner_of(llm).model.named_parameters():
            if name.endswith(".A") and p.dim() == 1:
                p.copy_(-(torch.rand(p.shape, generator=_GEN) * 0.5 + 0.5).to(p.dtype))
            elif name.endswith(".bias") and p.numel():
                p.copy_(((torch.rand(p.shape, generator=_GEN) * 2 - 1) * 0.1).to(p.dtype))


def close(llm: LLM | None) -> None:
    """Free an LLM's engine (vLLM keeps one per process alive until collected)."""
    if llm is None:
        return
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def runner_of(llm: LLM) -> Any:
    """The model runner of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def scheduler_of(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, _BASE["vocab_size"], (n,), generator=g).tolist()


# -- what vLLM's writers received -------------------------------------------------------------


@dataclass
class WriterLog:
    """Every call of vLLM's KV-cache writers while active: per layer (by its cache's first byte),
    the slots and the K / V rows (MLA: the latent row ``[kv_c | k_pe]``) the writer got.

    ``rows(layer_ptr)`` -> ``(slots [T], K [T, NH, HS], V [T, NH, HS] or None)``, the last
    write of each slot winning, padding slots (< 0) dropped.
    """

    calls: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = field(default_factory=dict)

    def add(self, ptr: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.calls.setdefault(ptr, []).append(
            (slots.detach().flatten().to(torch.int64).clone(), k.detach().clone(), None if v is None else v.detach().clone())
        )

    def rows(self, ptr: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        last: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for slots, k, v in self.calls.get(ptr, []):
            for i, s in enumerate(slots.tolist()):
                if s >= 0:
                    last[s] = (k[i], None if v is None else v[i])
        order = sorted(last)
        ks = torch.stack([last[s][0] for s in order])
        vs = None if last[order[0]][1] is None else torch.stack([last[s][1] for s in order])
        return torch.tensor(order, dtype=torch.int64), ks, vs


def _ptr(t: torch.Tensor) -> int:
    """The first byte of a layer's cache view (layers of one vLLM buffer share a storage)."""
    return t.data_ptr()


@contextlib.contextmanager
def record_writes() -> Iterator[WriterLog]:
    """Wrap vLLM's KV-cache writer ops for the duration: ``cpu_attn_reshape_and_cache``
    (CPU_ATTN) and the MLA writers (``amx_mla_concat_and_cache``, CPU_MLA's
    ``do_kv_cache_update``). Keys of the log are the layer caches' ``data_ptr()`` (the K half starts the layer's view)."""
    from vllm import _custom_ops as ops

    log = WriterLog()
    patched: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, wrapper: Any) -> None:
        if hasattr(obj, name):
            patched.append((obj, name, getattr(obj, name)))
            setattr(obj, name, wrapper(getattr(obj, name)))

    def attn(orig):
        def w(key, value, key_cache, value_cache, slot_mapping, *a, **k):
            log.add(
                _ptr(key_cache),
                slot_mapping,
                key.view(key.shape[0], -1, key_cache.shape[-1]),
                value.view(value.shape[0], -1, key_cache.shape[-1]),
            )
            return orig(key, value, key_cache, value_cache, slot_mapping, *a, **k)

        return w

    def amx_mla(orig):
        def w(kv_c, k_pe, kv_cache, slot_mapping, *a, **k):
            log.add(_ptr(kv_cache), slot_mapping, torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], -1).unsqueeze(1), None)
            return orig(kv_c, k_pe, kv_cache, slot_mapping, *a, **k)

        return w

    patch(ops, "cpu_attn_reshape_and_cache", attn)
    patch(ops, "amx_mla_concat_and_cache", amx_mla)
    with contextlib.suppress(ImportError):
        from vllm.v1.attention.backends.mla import cpu_mla

        impl = getattr(cpu_mla, "CPUMLAImpl", None)
        if impl is not None and hasattr(impl, "do_kv_cache_update"):

            def mla_update(orig):
                def w(self, kv_c_normed, k_pe, kv_cache, slot_mapping, *a, **k):
                    row = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], -1).unsqueeze(1)
                    log.add(_ptr(kv_cache), slot_mapping, row, None)
                    return orig(self, kv_c_normed, k_pe, kv_cache, slot_mapping, *a, **k)

                return w

            patch(impl, "do_kv_cache_update", mla_update)
    try:
        yield log
    finally:
        for obj, name, orig in reversed(patched):
            setattr(obj, name, orig)
