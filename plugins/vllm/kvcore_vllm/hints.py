"""Hints for vLLM detection: what the tensors cannot show, in vLLM's own vocabulary.

:class:`VllmHints` accepts a dict, itself, or vLLM objects, and normalises every value to
one spelling. Unknown values raise :class:`kvcore.DetectionError` listing the accepted
ones.

Precedence (highest first)
--------------------------
1. **explicit hints** (``hints={"kv_cache_layout": "HND", ...}``);
2. **vLLM objects** fill the fields the explicit hints left empty: ``cache_config``
   (anything with ``.cache_dtype``, ``.block_size``, ``.kv_cache_layout`` -- vLLM's
   ``CacheConfig``) and ``vllm_config`` (its ``.cache_config``, ``.model_config.dtype`` and
   ``.model_config.get_head_size()``); duck-typed, vLLM is not imported;
3. **the environment**: ``VLLM_KV_CACHE_LAYOUT`` (from the hints under that name, the
   engine's own value, else this process's) is read only when neither of the above gave a
   layout, parsed as vLLM's ``envs.py`` does (``env_with_choices``: case-sensitive ``NHD`` /
   ``HND``, from 0.29 also the ``KVCacheLayout`` names; anything else is a
   :class:`kvcore.DetectionError`: vLLM refuses to start with it). It is kept apart from an
   explicit layout (:attr:`VllmHints.env_kv_cache_layout`) because up to 0.28 it steers
   only the backends whose allocation reads ``get_kv_cache_layout()``
   (:data:`kvcore_vllm.rules.LAYOUT_READERS`: FlashAttention, FlashInfer, Triton from 0.24),
   and not where vLLM overrides it (``set_kv_cache_layout``: FlashInfer on SM 10.x is HND,
   CPU_ATTN 0.24 - 0.28 is HND, XPU 0.11-0.25 is NHD); from 0.29 ``resolve_kv_cache_layout``
   applies it to every backend. ``VLLM_V1_USE_PREFILL_DECODE_ATTENTION`` likewise, parsed as
   0.11 / 0.13 ``envs.py`` does: ``value.lower() in ("true", "1")``, everything else False;
4. **strides**: where the tensors' strides show the physical order (a permuted
   allocation, e.g. FlashAttention HND in <= 0.23) they decide NHD vs HND and layer- vs
   block-outermost by themselves; a hint that contradicts them raises
   :class:`kvcore.DetectionError` naming both;
5. **tensor order**: a contiguous tensor is either as vLLM allocated it or an HND / NHD
   cache the caller already permuted into memory order (some connectors do). When the two
   readings give different geometry (``[2, NB, 16, 4, 64]``: NHD with block size 16 and 4
   heads, or HND in memory order with 16 heads and block size 4) nothing in the bytes
   decides: :class:`kvcore.AmbiguousLayoutError` names ``kv_cache_layout``,
   ``num_kv_heads``, ``block_size`` and ``tensor_order`` (``"allocated"``: as vLLM
   allocated it; ``"physical"``: already in memory order). vLLM's default layout is not
   assumed: detection never guesses;
6. **version defaults**: device ``xpu`` forces NHD in vLLM 0.11-0.25 (``vllm/platforms/xpu.py``
   ``set_kv_cache_layout("NHD")``; 0.26 and later no longer call it) and defaults block_size
   to 64.

Platform: ``device_type``, else a backend of one platform, else ``use_ipex`` (a TORCH_SDPA
setting: CPU), else the tensors. Tensors on an accelerator are no CPU engine's; CPU (or
meta) tensors of a non-ROCm torch build may be vLLM CPU's as well as a GPU cache copied or
described, so the CPU backend's readings stand beside the GPU ones and, where they place
bytes differently, detection names ``attention_backend`` / ``device_type``
(:func:`kvcore_vllm.rules.platform_cpu`).

fp8: an fp8 ``cache_dtype`` is stored as uint8; its element dtype is ``float8_e4m3fn`` /
``float8_e5m2`` on CUDA and on ROCm ``current_platform.fp8_dtype()``: FNUZ
(``float8_e4m3fnuz``) on gfx94x (MI300X, MI325X), OCP on gfx950. Detection reads the
platform from ``device_type`` or, for tensors in this process, from the torch build
(``torch.version.hip``) and the GPU's ``gcnArchName``; where that cannot tell, the two
readings are an ambiguity that ``dtype`` (e.g. ``"float8_e4m3fnuz"``) decides. A
``dtype`` hint that is an fp8 of the cache dtype's kind is always the element dtype.

Sources: ``SOURCES.md`` (vLLM's ``envs.py``, ``config/cache.py``, ``attention/selector.py`` and the
backends, per release).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from kvcore import DetectionError
from kvcore.detection import tensor_order
from kvcore.dtypes import fp8_dtype, is_fp8, parse_dtype
from kvcore_vllm.releases import (
    BACKEND_FAMILY,
    BACKEND_RELEASES,
    ENV_LAYOUTS,
    ERAS,
    KV_CACHE_LAYOUTS,
    LAYOUT_ALIASES,
    LAYOUT_ERA,
    LAYOUT_FAMILY,
    UNCLAIMED_BACKENDS,
    backend_in_release,
    era_of,
)

__all__ = [
    "VllmHints",
    "KV_CACHE_LAYOUTS",
    "LAYOUT_ALIASES",
    "LAYOUT_FAMILY",
    "BACKENDS",
    "BACKEND_FAMILY",
    "BACKEND_RELEASES",
    "UNCLAIMED_BACKENDS",
    "KNOWN_BACKENDS",
    "LAYOUT_ERA",
    "CACHE_DTYPES",
    "ERAS",
    "era_of",
    "env_flag",
    "ENV_LAYOUTS",
    "parse_hints",
    "CPU_ATTN_ISAS",
]

#: every name vLLM can report or be configured with: the families kvcore reads, then those it
#: names as unclaimed (:data:`kvcore_vllm.releases.UNCLAIMED_BACKENDS`).
BACKENDS = tuple(BACKEND_FAMILY)
KNOWN_BACKENDS = BACKENDS + tuple(UNCLAIMED_BACKENDS)

#: vLLM ``CacheConfig.cache_dtype`` strings -> storage kind. fp8 variants are stored as
#: uint8 (``STR_DTYPE_TO_TORCH_DTYPE``, engine_layouts.md §1.2) and viewed as float8 by
#: the kernels. Which fp8 is platform-dependent (:data:`FP8_KINDS`): OCP ``float8_e4m3fn``
#: on CUDA; on ROCm ``current_platform.fp8_dtype()``, FNUZ ``float8_e4m3fnuz`` on gfx94x
#: (MI300X/MI325X) and OCP on gfx950 (MI350X/MI355X) -- vLLM ``vllm/platforms/rocm.py::
#: RocmPlatform.is_fp8_fnuz`` (``"gfx94" in gcnArchName``) and ``fp8_dtype``; ROCm's cache
#: kernels accept ``fp8``/``fp8_e4m3`` only (``csrc/quantization/fp8/amd/quant_utils.cuh``
#: ``DISPATCH_BY_KV_CACHE_DTYPE``). The values below are the CUDA ones.
CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_inc": torch.float8_e4m3fn,
    "fp8_ds_mla": torch.uint8,
    "nvfp4_ds_mla": torch.uint8,
    "int8_per_token_head": torch.int8,
    "fp8_per_token_head": torch.uint8,
}
#: cache dtypes that only MLA backends use.
MLA_CACHE_DTYPES = ("fp8_ds_mla", "nvfp4_ds_mla")
#: fp8 cache dtypes -> their fp8 kind; the exact dtype (OCP or FNUZ) depends on the platform.
FP8_KINDS = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_inc": "e4m3", "fp8_e5m2": "e5m2"}
#: ``kv_cache_spec`` hint values: what vLLM's ``KVCacheSpec`` says a layer is (``attention``:
#: ``FullAttentionSpec`` / ``SlidingWindowSpec``...; ``mla``: ``MLAAttentionSpec``; ``mamba``:
#: ``MambaSpec``).
KV_CACHE_SPECS = ("attention", "mla", "mamba", "indexer")

DEVICE_TYPES = ("cuda", "rocm", "cpu", "xpu", "tpu", "hpu", "npu")
#: vLLM CPU_ATTN's kernel paths (``cpu_attn.py::_get_attn_isa``, the layers' ``isa``; 0.24-0.32
#: ``csrc/cpu/cpu_attn_*.hpp``): ``amx`` (x86 AMX, bfloat16, block_size % 32 == 0), ``vec`` /
#: ``vec16`` (x86 AVX-512 / AVX2), ``neon`` (Arm), ``vsx`` (POWER), ``vxe`` (s390x), ``rvv`` (RISC-V).
CPU_ATTN_ISAS = ("amx", "vec", "vec16", "neon", "vsx", "vxe", "rvv", "amx_fp8")
#: kernel paths whose packing kvcore does not read (``csrc/cpu/cpu_attn_amx_fp8.hpp``: K tile packings
#: that differ between stored versions; ``cpu_attn_neon_bfmmla.hpp``: NEON bfloat16 BFMMLA tiles whose
#: constants were not checked against a running engine), and why
CPU_ISAS_NOT_CLAIMED = {
    "amx_fp8": "the native AMX-FP8 kernel (csrc/cpu/cpu_attn_amx_fp8.hpp) packs K per 64-byte slice in an order that "
    "differs between vLLM's stored versions of the file; kvcore does not read it",
}


def env_flag(value: Any) -> bool:
    """A boolean environment variable as vLLM 0.11 / 0.13 ``vllm/envs.py`` reads
    ``VLLM_V1_USE_PREFILL_DECODE_ATTENTION``: ``value.lower() in ("true", "1")``; every
    other string (``"yes"``, ``"on"``, ``"2"``, ``" 1"``) is False. A bool is itself, an int
    its decimal string (``1`` -> True, ``2`` -> False)."""
    if isinstance(value, bool):
        return value
    return str(value).lower() in ("true", "1")


def _bad(field: str, value: Any, accepted) -> DetectionError:
    return DetectionError(f"vLLM hint {field}={value!r} is not known; accepted values: {', '.join(map(str, accepted))}")


class VllmHints(BaseModel):
    """Facts about a vLLM KV cache, in vLLM's vocabulary (all optional).

    Attributes:
        kv_cache_layout: ``NHD``/``HND`` (<= 0.28) or a 0.29+ ``KVCacheLayout`` member;
            normalised to upper case. ``layout33`` gives the ``KVCacheLayout`` name (aliases
            applied).
        attention_backend: a vLLM backend name (``FLASH_ATTN``, ``FLASHINFER``,
            ``TRITON_ATTN``, ``FLEX_ATTENTION``, ``FLASHMLA``, ``CPU_ATTN``, ``PALLAS``...).
        num_kv_heads, block_size, head_size: per-rank geometry (head_size in elements;
            MLA: kv_lora_rank + qk_rope_head_dim, 576 for DeepSeek-V3).
        cache_dtype: vLLM's ``--kv-cache-dtype`` string (``auto``, ``fp8_e4m3``, ...).
        dtype: the model dtype (torch dtype or its name); the element dtype of byte views.
        vllm_version: ``"0.11.0"``, ``"0.24"``...; selects that era's rules only.
        device_type: ``cuda``/``rocm``/``cpu``/``xpu``/``tpu``/``hpu``/``npu``; ``cpu``
            selects vLLM's CPU backend rules (any other value rules them out; without it
            they are considered for CPU tensors), ``tpu`` the Pallas rules, ``xpu`` forces
            NHD in 0.11-0.25, ``rocm`` makes an fp8 ``cache_dtype`` platform-dependent (FNUZ on gfx94x),
            allows ``ROCM_ATTN``'s and ``ROCM_SEGMENTED_ATTN``'s readings and ROCm's tiled DSA indexer
            pages, any value but ``cuda`` rules out ``B12X`` (:func:`kvcore_vllm.rules.platform_rocm`).
        kv_cache_spec: ``attention``, ``mla`` or ``mamba``: what vLLM's ``KVCacheSpec`` says
            the layers are, for per-layer lists (K/V pairs, MLA (nope, rope) pairs, a
            one-element list ``[kv_cache]`` as 0.11 / 0.13 bind it, or Mamba state);
            ``mla`` also selects the MLA rules.
        tensor_order: the core's generic hint (:data:`kvcore.TENSOR_ORDER`): ``allocated``
            (the tensors as vLLM allocated them) or ``physical`` (already permuted into
            memory order).
        use_ipex: vLLM 0.11 ``TORCH_SDPA``: whether ``intel_extension_for_pytorch`` was
            importable in the engine (``cpu_attn.py::_use_ipex``): with it K and V are
            ``(NB, NH, BS, HS)``, without it K is stored in 16-byte chunks. An fp8 cache
            implies it (vLLM refuses fp8 without IPEX). Given, it selects TORCH_SDPA (no
            other backend has the setting).
        prefill_decode_attention: vLLM 0.11 ``ROCM_ATTN``: the engine's
            ``VLLM_V1_USE_PREFILL_DECODE_ATTENTION`` (pass it under that name, or set the
            variable): on, K/V are read by ``split_kv_cache``; off, by ``unbind(0)``.
            Strings are read as vLLM reads the variable (:func:`env_flag`).
        env_kv_cache_layout: the ``VLLM_KV_CACHE_LAYOUT`` the engine ran with (hint
            ``VLLM_KV_CACHE_LAYOUT``, else this process's variable), when no explicit
            layout was given; exactly one of vLLM's accepted values.
        cpu_attn_isa: vLLM CPU_ATTN's kernel path (the attention layers' ``isa``, chosen by
            ``cpu_attn.py::_get_attn_isa`` from the CPU, the model dtype, block size and head
            size): ``amx`` packs K and V in AMX tiles, the other paths store K column-major
            (:data:`CPU_ATTN_ISAS`). The tensors cannot show it.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as e:
            msgs = []
            for err in e.errors():
                orig = (err.get("ctx") or {}).get("error")
                msgs.append(str(orig) if orig is not None else f"vLLM hint {'.'.join(map(str, err['loc']))}: {err['msg']}")
            raise DetectionError("; ".join(msgs)) from None

    kv_cache_layout: str | None = None
    attention_backend: str | None = None
    num_kv_heads: int | None = None
    block_size: int | None = None
    head_size: int | None = None
    cache_dtype: str | None = None
    dtype: Any = None
    vllm_version: str | None = None
    device_type: str | None = None
    kv_cache_spec: str | None = None
    tensor_order: str | None = None
    use_ipex: bool | None = None
    prefill_decode_attention: bool | None = None
    env_kv_cache_layout: str | None = None
    cpu_attn_isa: str | None = None

    @field_validator("cpu_attn_isa", mode="before")
    @classmethod
    def _isa(cls, v):
        if v is None:
            return None
        s = str(v).strip().lower()
        if s not in CPU_ATTN_ISAS:
            raise _bad("cpu_attn_isa", v, CPU_ATTN_ISAS)
        if s in CPU_ISAS_NOT_CLAIMED:
            raise DetectionError(f"vLLM CPU_ATTN kernel path {s!r} is not claimed by kvcore-vllm: {CPU_ISAS_NOT_CLAIMED[s]}")
        return s

    @field_validator("use_ipex", mode="before")
    @classmethod
    def _flag(cls, v, info):
        if v is None or isinstance(v, bool):
            return v
        s = str(v).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off", ""):
            return False
        raise DetectionError(f"vLLM hint {info.field_name}={v!r} must be a bool (True/False, 1/0)")

    @field_validator("prefill_decode_attention", mode="before")
    @classmethod
    def _env_flag(cls, v):
        # exactly as vLLM reads the variable (0.11 / 0.13 vllm/envs.py, environment_variables
        # ["VLLM_V1_USE_PREFILL_DECODE_ATTENTION"]): os.getenv(..., "False").lower() in ("true", "1"),
        # every other value is False ("yes", "on", "2", " 1" included); a bool is itself
        if v is None or isinstance(v, bool):
            return v
        return env_flag(v)

    @field_validator("env_kv_cache_layout", mode="before")
    @classmethod
    def _env_layout(cls, v):
        # vLLM's envs.py env_with_choices("VLLM_KV_CACHE_LAYOUT", None, choices): case-sensitive, anything
        # else makes vLLM raise ValueError when it reads the variable (the engine never starts)
        if v is None:
            return None
        s = str(v)
        if s not in ENV_LAYOUTS[LAYOUT_ERA]:
            raise DetectionError(
                f"VLLM_KV_CACHE_LAYOUT={s!r} is not a value vLLM accepts (vllm/envs.py env_with_choices, case-sensitive): "
                f"{', '.join(ENV_LAYOUTS[ERAS[0]])} up to 0.28, {', '.join(ENV_LAYOUTS[LAYOUT_ERA])} from {LAYOUT_ERA}; vLLM refuses to "
                "start with it, so it describes no cache. Fix or unset the variable"
            )
        return s

    @model_validator(mode="after")
    def _release_facts(self):
        # a backend or a KVCacheLayout member the stated release does not have describes no cache it wrote
        if self.vllm_version is None:
            return self
        b = self.attention_backend
        if b is not None and backend_in_release(b, self.vllm_version) is False:
            first, last = BACKEND_RELEASES[b]
            raise DetectionError(
                f"vLLM hint attention_backend={b!r} is not a backend of vLLM {self.vllm_version}: the read releases have it "
                f"from {first} to {last} (kvcore_vllm.releases.BACKEND_RELEASES, SOURCES.md). Fix vllm_version or the backend"
            )
        lay = self.kv_cache_layout
        if lay in KV_CACHE_LAYOUTS and ERAS.index(self.era) < ERAS.index(LAYOUT_ERA):
            raise DetectionError(
                f"vLLM hint kv_cache_layout={lay!r} is a KVCacheLayout member (vllm/v1/kv_cache_layout.py, vLLM {LAYOUT_ERA} "
                f"and later); vLLM {self.vllm_version} knows only NHD and HND. Pass NHD or HND, or fix vllm_version"
            )
        return self

    @model_validator(mode="after")
    def _env_layout_era(self):
        era = self.era
        if self.env_kv_cache_layout is not None and era is not None:
            ok = ENV_LAYOUTS[era]
            if self.env_kv_cache_layout not in ok:
                raise DetectionError(
                    f"VLLM_KV_CACHE_LAYOUT={self.env_kv_cache_layout!r} is not a value vLLM {self.vllm_version} accepts "
                    f"(vllm/envs.py env_with_choices: {', '.join(ok)}); vLLM refuses to start with it. Fix or unset the variable"
                )
        return self

    @field_validator("kv_cache_layout", mode="before")
    @classmethod
    def _layout(cls, v):
        if v is None:
            return None
        v = getattr(v, "name", v)  # a KVCacheLayout enum member
        s = str(v).strip().upper()
        if s not in LAYOUT_ALIASES and s not in KV_CACHE_LAYOUTS:
            raise _bad("kv_cache_layout", v, list(LAYOUT_ALIASES) + list(KV_CACHE_LAYOUTS))
        return s

    @field_validator("attention_backend", mode="before")
    @classmethod
    def _backend(cls, v):
        if v is None:
            return None
        v = getattr(v, "name", v)
        s = str(v).strip().upper()
        if s in UNCLAIMED_BACKENDS:
            raise DetectionError(
                f"vLLM hint attention_backend={v!r}: kvcore-vllm does not read this backend's cache ({UNCLAIMED_BACKENDS[s]}); "
                f"the backends it reads: {', '.join(BACKENDS)}"
            )
        if s not in BACKEND_FAMILY:
            raise _bad("attention_backend", v, BACKENDS)
        return s

    @field_validator("cache_dtype", mode="before")
    @classmethod
    def _cache_dtype(cls, v):
        if v is None:
            return None
        s = str(v).strip().lower()
        if s not in CACHE_DTYPES:
            raise _bad("cache_dtype", v, CACHE_DTYPES)
        return s

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v):
        if v is None:
            return None
        return parse_dtype(v, what="vLLM hint dtype")

    @field_validator("kv_cache_spec", mode="before")
    @classmethod
    def _spec(cls, v):
        if v is None:
            return None
        s = str(v).strip().lower().removesuffix("spec").removesuffix("_")
        s = {
            "fullattention": "attention",
            "full_attention": "attention",
            "slidingwindow": "attention",
            "sliding_window": "attention",
            "mlaattention": "mla",
            "mla_attention": "mla",
            # a DSA lightning indexer's key cache: vLLM's DeepseekV32IndexerCache (allocated through the MLA
            # rules), vllm-ascend's AscendSFAIndexerCacheSpec
            "indexer_cache": "indexer",
            "indexercache": "indexer",
            "ascendsfaindexercache": "indexer",
            "sfa_indexer_cache": "indexer",
        }.get(s, s)
        if s not in KV_CACHE_SPECS:
            raise _bad("kv_cache_spec", v, KV_CACHE_SPECS)
        return s

    @field_validator("tensor_order", mode="before")
    @classmethod
    def _order(cls, v):
        return tensor_order({"tensor_order": v}) if v is not None else None

    @field_validator("vllm_version", mode="before")
    @classmethod
    def _version(cls, v):
        if v is None:
            return None
        era_of(str(v))
        return str(v).strip()

    @field_validator("device_type", mode="before")
    @classmethod
    def _device(cls, v):
        if v is None:
            return None
        s = str(getattr(v, "type", v)).strip().lower().split(":")[0]
        if s not in DEVICE_TYPES:
            raise _bad("device_type", v, DEVICE_TYPES)
        return s

    @field_validator("num_kv_heads", "block_size", "head_size", mode="before")
    @classmethod
    def _positive(cls, v, info):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise DetectionError(f"vLLM hint {info.field_name}={v!r} must be a positive int")
        return v

    # -- derived ---------------------------------------------------------------------
    @property
    def era(self) -> str | None:
        return era_of(self.vllm_version) if self.vllm_version else None

    @property
    def family(self) -> str | None:
        return BACKEND_FAMILY.get(self.attention_backend) if self.attention_backend else None

    @property
    def layout33(self) -> str | None:
        """The ``KVCacheLayout`` name (vLLM 0.29+; NHD -> LBNHC, HND -> LBHNC), or None."""
        if self.kv_cache_layout is None:
            return None
        return LAYOUT_ALIASES.get(self.kv_cache_layout, self.kv_cache_layout)

    @property
    def layout_family(self) -> str | None:
        """``NHD`` or ``HND`` (None without a layout hint)."""
        if self.kv_cache_layout is None:
            return None
        if self.kv_cache_layout in LAYOUT_ALIASES:
            return self.kv_cache_layout
        return LAYOUT_FAMILY[self.kv_cache_layout]

    @property
    def is_mla(self) -> bool | None:
        """True for MLA backends or MLA-only cache dtypes, False for other backends, else None."""
        if self.cache_dtype in MLA_CACHE_DTYPES or self.kv_cache_spec in ("mla", "indexer"):
            return True
        if self.family is None:
            return None
        return self.family == "MLA"

    @property
    def cpu_amx(self) -> bool | None:
        """Whether vLLM's CPU attention ran its AMX kernel path (``cpu_attn_isa``): True for
        ``amx``, False for any other path, None when not stated."""
        if self.cpu_attn_isa is None:
            return None
        return self.cpu_attn_isa == "amx"

    @property
    def fp8_kind(self) -> str | None:
        """``"e4m3"`` / ``"e5m2"`` for the fp8 cache dtypes, else None."""
        return FP8_KINDS.get(self.cache_dtype or "")

    def element_dtype(self) -> torch.dtype | None:
        """The element dtype a byte (int8/uint8) view carries: for an fp8 cache dtype the
        ``dtype`` hint when it is that kind of fp8 (``float8_e4m3fnuz`` on ROCm MI300),
        else the CUDA fp8 type (detection settles the platform first:
        :func:`kvcore_vllm.detect.detect_vllm`); the model dtype for ``auto``; None when
        unknown."""
        kind = self.fp8_kind
        if kind is not None:
            if is_fp8(self.dtype):
                return self.dtype
            return fp8_dtype(kind, fnuz=False)
        cd = CACHE_DTYPES.get(self.cache_dtype or "auto")
        if cd is not None:
            return cd
        return self.dtype

    @property
    def default_block_size(self) -> int:
        """vLLM's platform default block size: 64 on XPU, else 16 (engine_layouts.md §1.2)."""
        return 64 if self.device_type == "xpu" else 16


def parse_hints(hints: Any) -> VllmHints:
    """Normalise hints given as a dict, a :class:`VllmHints`, or None.

    A ``cache_config`` entry (vLLM's ``CacheConfig`` or anything with ``.cache_dtype``,
    ``.block_size``, ``.kv_cache_layout``) fills missing fields; ``VLLM_KV_CACHE_LAYOUT``
    is read only when no layout came from either. Unknown keys raise
    :class:`kvcore.DetectionError` naming the accepted ones.
    """
    if isinstance(hints, VllmHints):
        return hints
    if hints is None:
        d: dict[str, Any] = {}
    elif isinstance(hints, Mapping):
        d = {k: v for k, v in hints.items() if v is not None}
    elif hasattr(hints, "model_dump"):
        d = {k: v for k, v in hints.model_dump().items() if v is not None}
    else:
        raise DetectionError(f"vLLM hints must be a dict or VllmHints, got {type(hints).__name__}")
    vcfg = d.pop("vllm_config", None)
    if vcfg is not None:
        # vLLM's VllmConfig: its cache_config, and the model's dtype and (MLA-aware) head size
        if getattr(vcfg, "cache_config", None) is not None and "cache_config" not in d:
            d["cache_config"] = vcfg.cache_config
        mc = getattr(vcfg, "model_config", None)
        if mc is not None:
            if "dtype" not in d and getattr(mc, "dtype", None) is not None:
                d["dtype"] = mc.dtype
            get_hs = getattr(mc, "get_head_size", None)
            if "head_size" not in d and callable(get_hs):
                d["head_size"] = int(get_hs())
    obj = d.pop("cache_config", None)
    if obj is not None:
        for field, attr in (("cache_dtype", "cache_dtype"), ("block_size", "block_size"), ("kv_cache_layout", "kv_cache_layout")):
            val = getattr(obj, attr, None)
            if field not in d and val is not None:
                d[field] = val
    # the engine's environment variables: given as hints (the engine's values), else this process's,
    # parsed exactly as vLLM's envs.py parses them (VllmHints validators)
    if "VLLM_V1_USE_PREFILL_DECODE_ATTENTION" in d:
        d["prefill_decode_attention"] = d.pop("VLLM_V1_USE_PREFILL_DECODE_ATTENTION")
    elif "prefill_decode_attention" not in d and os.environ.get("VLLM_V1_USE_PREFILL_DECODE_ATTENTION") is not None:
        d["prefill_decode_attention"] = os.environ["VLLM_V1_USE_PREFILL_DECODE_ATTENTION"]
    if "VLLM_KV_CACHE_LAYOUT" in d:
        d["env_kv_cache_layout"] = d.pop("VLLM_KV_CACHE_LAYOUT")
    if "kv_cache_layout" in d:
        d.pop("env_kv_cache_layout", None)  # a layout from the hints or vLLM's config wins over the variable
    elif "env_kv_cache_layout" not in d and os.environ.get("VLLM_KV_CACHE_LAYOUT") is not None:
        d["env_kv_cache_layout"] = os.environ["VLLM_KV_CACHE_LAYOUT"]
    # the core passes hints meant for every plugin; keep ours, refuse misspellings of ours
    known = set(VllmHints.model_fields)
    generic = {"engine", "page_size", "tokens_per_block", "layer_groups"}  # tensor_order is a field
    unknown = set(d) - known - generic
    if unknown:
        accepted = (known - {"prefill_decode_attention", "env_kv_cache_layout"}) | {
            "cache_config",
            "vllm_config",
            "VLLM_V1_USE_PREFILL_DECODE_ATTENTION",
            "VLLM_KV_CACHE_LAYOUT",
        }
        raise DetectionError(f"unknown vLLM hint(s) {sorted(unknown)}; accepted: {sorted(accepted)}")
    if "page_size" in d and "block_size" not in d:
        d["block_size"] = d["page_size"]
    return VllmHints(**{k: v for k, v in d.items() if k in known})


def declared_hints() -> list[Any]:
    """The hints :func:`parse_hints` reads, declared for ``kvcore hints vllm``
    (``kvcore_register_hints``). Accepted values are this module's tables."""
    from kvcore import Hint, tensor_order_hint
    from kvcore.dtypes import DTYPE_ALIASES, DTYPES

    src = "engine_layouts.md §1.2"
    return [
        Hint(
            engine="vllm",
            name="kv_cache_layout",
            meaning="vLLM's KV cache layout: NHD (tokens outside heads) or HND (heads outside tokens) up to 0.28; a "
            "KVCacheLayout member (L=layer, B=block, N=token, H=head, C=channel, outermost first) from 0.29. A layout the "
            "strides contradict is an error",
            values=[*LAYOUT_ALIASES, *KV_CACHE_LAYOUTS],
            default="read from the strides; ambiguous shapes name this hint (VLLM_KV_CACHE_LAYOUT steers the backends that read it)",
            source="vllm/v1/attention/backends/utils.py::get_kv_cache_layout; 0.29+ vllm/v1/kv_cache_layout.py::KVCacheLayout",
        ),
        Hint(
            engine="vllm",
            name="VLLM_KV_CACHE_LAYOUT",
            meaning="the engine's environment variable, used when no kv_cache_layout is given: up to 0.28 it fixes the "
            "layout of the backends whose allocation reads get_kv_cache_layout() (FLASH_ATTN, FLASHINFER; TRITON_ATTN from "
            "0.24) except where vLLM overrides it (FlashInfer on SM 10.x: HND; CPU_ATTN 0.24-0.28: HND; XPU 0.11-0.25: NHD); "
            "from 0.29 every backend's. Case-sensitive, as vLLM's envs.py reads it; other values are refused",
            values=list(ENV_LAYOUTS[LAYOUT_ERA]),
            default="the variable in this process's environment",
            source="vllm/envs.py (env_with_choices); vllm/v1/attention/backends/utils.py::get_kv_cache_layout / "
            "0.29+ ::resolve_kv_cache_layout",
        ),
        Hint(
            engine="vllm",
            name="attention_backend",
            meaning="the attention backend that allocated the cache; selects its get_kv_cache_shape rule (MLA backends: one latent head)",
            values=list(BACKENDS),
            default="read from the shapes; ambiguous shapes name this hint",
            source="vllm/attention/backends/registry.py",
        ),
        Hint(
            engine="vllm",
            name="vllm_version",
            meaning="the vLLM version that allocated the cache; selects that era's layout rules only",
            type=f"version string ({', '.join(ERAS)} or later; 0.11 and later)",
            default="every era whose rules fit the tensors",
        ),
        Hint(
            engine="vllm",
            name="cache_dtype",
            meaning="vLLM's --kv-cache-dtype: fp8 variants are stored as uint8 and carry fp8 elements",
            values=list(CACHE_DTYPES),
            default="auto: the tensors' own dtype",
            source="vllm/utils/torch_utils.py::STR_DTYPE_TO_TORCH_DTYPE",
        ),
        Hint(
            engine="vllm",
            name="dtype",
            meaning="the model dtype: the element dtype of byte (int8/uint8) views of the cache",
            type="torch.dtype or name",
            values=[*DTYPES, *DTYPE_ALIASES],
        ),
        Hint(
            engine="vllm",
            name="num_kv_heads",
            meaning="KV heads per tensor-parallel rank",
            type="int > 0",
            default="from the shapes; a 0.29+ head slot [NB, 2, BS, NH*HS] (ROCM_ATTN, ROCM_SEGMENTED_ATTN, B12X) does not show it: "
            "without it (or head_size) the slot's row is one head of NH*HS; 0.11 TORCH_SDPA's flat (2, NB, BS*NH*HS) row: any "
            "two of block_size, num_kv_heads, head_size",
        ),
        Hint(
            engine="vllm",
            name="block_size",
            meaning="tokens per block (CacheConfig.block_size)",
            type="int > 0",
            aliases=["page_size"],
            default=f"from the shapes; 16 (64 on XPU) where they cannot tell ({src})",
        ),
        Hint(
            engine="vllm",
            name="head_size",
            meaning="elements per head (MLA: kv_lora_rank + qk_rope_head_dim, 576 for DeepSeek-V3)",
            type="int > 0",
            default="from the shapes",
        ),
        Hint(
            engine="vllm",
            name="device_type",
            meaning="the platform: cpu selects the CPU backend's rules (another value rules them out), tpu the Pallas rules, "
            "xpu forces NHD in 0.11-0.25 (platforms/xpu.py set_kv_cache_layout; not from 0.26), rocm makes an fp8 "
            "cache_dtype FNUZ on gfx94x (RocmPlatform.fp8_dtype), allows ROCM_ATTN's split_kv_cache and ROCM_SEGMENTED_ATTN's "
            "token-major readings (any value but cuda rules out B12X) and reads a DSA "
            "indexer page (132 B records, block_size > 1, 0.24+) as ROCm's 16x16-byte key tiles (0.33 MXFP4 indexer pages "
            "on ROCm are aiter's and refused)",
            values=list(DEVICE_TYPES),
            default="a backend of one platform only (ROCM_*, FLASHMLA*, CUTLASS_MLA, FLASHINFER*, B12X, CPU, PALLAS), use_ipex (CPU), "
            "else the tensors' device and the torch build of the process holding them: accelerator tensors are not the CPU "
            "backend's, CPU tensors may be (its readings are then considered beside the GPU ones); tensors that say nothing "
            "(meta, a description) name this hint where it decides",
        ),
        Hint(
            engine="vllm",
            name="cpu_attn_isa",
            meaning="vLLM CPU_ATTN's kernel path (the attention layers' isa): amx stores K and V in AMX tiles, the others "
            "K column-major then V row-major per block and head; the tensors cannot show it",
            type="str",
            values=list(CPU_ATTN_ISAS),
            default="from the engine's objects (kvcore_vllm.engine); else from the dtype, block size and head size where "
            "they rule AMX out (AMX needs bfloat16, block_size % 32 == 0, head_size % 32 == 0); else the shapes name this hint",
            source="vllm/v1/attention/backends/cpu_attn.py::_get_attn_isa; csrc/cpu/cpu_attn_vec.hpp, cpu_attn_amx.hpp",
        ),
        Hint(
            engine="vllm",
            name="use_ipex",
            meaning="vLLM 0.11 TORCH_SDPA: whether intel_extension_for_pytorch was importable in the engine; with it K and V "
            "are (NB, NH, BS, HS), without it K is stored in 16-byte chunks (an fp8 cache implies it). Given, it selects "
            "TORCH_SDPA",
            type="bool",
            default="from the cache dtype where it decides; else the shapes name this hint",
            source="vllm/v1/attention/backends/cpu_attn.py::_use_ipex",
        ),
        Hint(
            engine="vllm",
            name="VLLM_V1_USE_PREFILL_DECODE_ATTENTION",
            aliases=["prefill_decode_attention"],
            meaning="vLLM 0.11 ROCM_ATTN: the engine's environment variable; on, K/V are read by split_kv_cache, off, by "
            "unbind(0). Read as vLLM's envs.py reads it: value.lower() in ('true', '1'), anything else is off",
            type="bool or the variable's string",
            default="the variable in this process's environment",
            source="vllm/v1/attention/backends/rocm_attn.py",
        ),
        Hint(
            engine="vllm",
            name="kv_cache_spec",
            meaning="what vLLM's KVCacheSpec says the layers are: attention ((K, V) pairs, vllm-ascend; [kv_cache] as 0.11/0.13 "
            "bind_kv_cache keeps it), mla (MLA rules only; vllm-ascend (nope, rope) pairs), indexer (a DSA indexer's key "
            "cache: MLA-style rules; vllm-ascend (indexer_k, indexer_scale) tuples) or mamba (state tensors, not KV)",
            values=list(KV_CACHE_SPECS),
            default="(K, V) pairs when two [NB, BS, NH, *] tensors of one shape; [t] of a rank no one-state Mamba layer has is "
            "the KV tensor t, of rank 3 or 4 an ambiguity naming this hint; any other list is Mamba state",
            source="vllm/v1/kv_cache_interface.py::KVCacheSpec",
        ),
        tensor_order_hint("vllm"),
        Hint(
            engine="vllm",
            name="cache_config",
            meaning="vLLM's CacheConfig (or any object with .cache_dtype, .block_size, .kv_cache_layout): fills those hints",
            type="object",
        ),
        Hint(
            engine="vllm",
            name="vllm_config",
            meaning="vLLM's VllmConfig: its cache_config, the model dtype and the model's head size",
            type="object",
        ),
        Hint(
            engine="vllm",
            name="layer_groups",
            meaning="the KV cache groups (lists of layer indices sharing a block table), for kvcore.detect_per_layer",
            type="list of lists of int",
        ),
    ]
