"""Hints for ``kvcore.detect(..., engine="sglang", hints=...)``.

SGLang's tensors do not say everything: a per-layer ``(rows, 1, D)`` tensor is an MLA
latent or a one-KV-head MHA slice (tensor parallelism leaves one head per rank), a 4-D
``(P, A, B, D)`` buffer is the HND page-row layout or a page-split NHD view when
``A == B``, and a host pool's axis order depends on ``--hicache-mem-layout``. Hints are
the facts the caller has from SGLang's own configuration.

Fields (all optional; aliases in brackets):

* ``page_size`` [``tokens_per_block``, ``block_size``]: SGLang's ``--page-size``
  (``server_args.page_size``; default 1). Splits the fused token axis of the device
  pools into ``[NB, BS]`` views, checks the page axis of HND / page-first-direct pools.
* ``kv_list_layout``: how a list of per-layer tensors is arranged. ``"k_v"``: a flat
  list of ``2*NL`` tensors, all K layers then all V layers (SGLang's
  ``data_ptrs = cat(k_data_ptrs, v_data_ptrs)`` order, LMCache's MP path);
  ``"nested"``: ``[k_buffer, v_buffer]``; ``"pairs"``: one ``(k, v)`` per layer (what
  :func:`kvcore.detect_per_layer` hands a group). ``"k_v"`` also says "this is MHA".
* ``layout`` [``kv_cache_layout``]: ``"NHD"`` (SGLang's default token rows),
  ``"HND"`` (``SGLANG_USE_HND_KVCACHE``: page rows ``(num_pages, NH, page_size, HS)``)
  or ``"ascend"`` (``AscendTokenToKVPool``: one cross-layer tensor
  ``(2, NL, pages, page_size, NH, HS)``).
* ``mem_layout`` [``hicache_mem_layout``]: a HiCache host pool's layout:
  ``layer_first``, ``page_first`` (SGLang's default), ``page_first_direct``,
  ``page_head``.
* ``num_kv_heads``, ``head_size`` [``head_dim``], ``v_head_size`` [``v_head_dim``],
  ``num_layers`` [``layer_num``]: the pool's ``head_num``, ``head_dim``,
  ``v_head_dim``, ``layer_num``. Each must agree with the tensors (a contradiction is a
  :class:`kvcore.DetectionError`); they also decide between candidate readings.
* ``dtype`` [``kv_cache_dtype``]: ``--kv-cache-dtype`` (``auto``, ``fp8_e4m3``,
  ``fp8_e5m2``), any dtype name of :mod:`kvcore.dtypes` (``bfloat16``, ``float8_e4m3fnuz``,
  ...) or a ``torch.dtype``. SGLang stores fp8 as ``torch.uint8`` (``store_dtype``, 0.5.3
  ``memory_pool.py::KVCache.__init__``) because ``index_put`` lacks fp8; with an fp8
  hint the layout's element dtype is the fp8 type over the same bytes. ``fp8_e4m3`` /
  ``fp8_e5m2`` are FNUZ on ROCm (``ModelRunner.init_memory_pool``: ``is_hip()`` picks
  ``float8_e4m3fnuz`` / ``float8_e5m2fnuz``): the platform is ``device_type``, else the
  torch build of the process that holds the tensors (SGLang's own ``is_hip()`` test);
  for tensors on the meta device (a description) the two readings are an ambiguity.
* ``device_type`` [``device``]: ``cuda``, ``rocm`` (``hip``), ``cpu``, ``npu``, ``xpu``,
  ``musa``, ``hpu``: where SGLang runs (decides ``fp8_e4m3`` / ``fp8_e5m2``).
* ``tensor_order``: kvcore's generic hint (``allocated`` / ``physical``, see
  :mod:`kvcore.detection`). SGLang allocates its pools contiguous; a 4-D page view whose
  strides are permuted is read through them, named by its memory order.
* ``is_mla``: the model uses MLA (``MLATokenToKVPool``).
* ``sglang_version``: informational (``"0.5.3"``, ``"0.5.23"``); layouts are read
  from the tensors' own shapes and strides, so no version switch is needed.

Precedence: a structural hint (``is_mla``, ``kv_list_layout``, ``layout``,
``mem_layout``) selects the reading outright; size hints (``page_size``,
``num_kv_heads``, ``head_size``, ``num_layers``) drop readings whose axes disagree;
then the tensors' shapes and strides; SGLang's defaults last (a 3-D token-row pool is
NHD; no ``page_size`` keeps the fused token axis ``NBBS``). Readings still left that
address memory differently raise :class:`kvcore.AmbiguousLayoutError` naming the hint
that decides — the plugin never guesses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcore import DetectionError
from kvcore.detection import tensor_order
from kvcore.dtypes import parse_dtype

__all__ = ["SGLangHints", "parse_hints", "element_dtype"]

#: SGLang's ``--kv-cache-dtype`` strings whose dtype depends on the platform: the OCP fp8
#: types on CUDA, FNUZ on ROCm (0.5.3 ``model_executor/model_runner.py::ModelRunner.init_memory_pool``:
#: ``torch.float8_e4m3fnuz`` / ``torch.float8_e5m2fnuz`` when ``is_hip()``). Kept as the string until
#: detection knows the platform (:func:`kvcore_sglang.detect.detect_sglang`).
PLATFORM_FP8 = ("fp8_e4m3", "fp8_e5m2")
DEVICE_TYPES = ("cuda", "rocm", "cpu", "npu", "xpu", "musa", "hpu")


class SGLangHints(BaseModel):
    """Validated SGLang hints (see the module docstring for meaning and precedence)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, populate_by_name=True)

    page_size: int | None = Field(None, ge=1, validation_alias=AliasChoices("page_size", "tokens_per_block", "block_size"))
    kv_list_layout: Literal["k_v", "nested", "pairs"] | None = None
    layout: Literal["NHD", "HND", "ASCEND"] | None = Field(None, validation_alias=AliasChoices("layout", "kv_cache_layout"))
    mem_layout: Literal["layer_first", "page_first", "page_first_direct", "page_head"] | None = Field(
        None, validation_alias=AliasChoices("mem_layout", "hicache_mem_layout")
    )
    num_kv_heads: int | None = Field(None, ge=1)
    head_size: int | None = Field(None, ge=1, validation_alias=AliasChoices("head_size", "head_dim"))
    v_head_size: int | None = Field(None, ge=1, validation_alias=AliasChoices("v_head_size", "v_head_dim"))
    num_layers: int | None = Field(None, ge=1, validation_alias=AliasChoices("num_layers", "layer_num"))
    dtype: Any = Field(None, validation_alias=AliasChoices("dtype", "kv_cache_dtype"))
    is_mla: bool | None = None
    sglang_version: str | None = None
    device_type: Literal["cuda", "rocm", "cpu", "npu", "xpu", "musa", "hpu"] | None = Field(
        None, validation_alias=AliasChoices("device_type", "device")
    )
    tensor_order: str | None = None

    @field_validator("device_type", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Any:
        if v is None:
            return None
        s = str(getattr(v, "type", v)).strip().lower().split(":")[0]
        return {"hip": "rocm", "ascend": "npu"}.get(s, s)

    @field_validator("tensor_order", mode="before")
    @classmethod
    def _order(cls, v: Any) -> Any:
        try:
            return tensor_order({"tensor_order": v}) if v is not None else None
        except DetectionError as e:
            raise ValueError(str(e)) from None

    @field_validator("layout", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        if v is None or isinstance(v, torch.dtype):
            return v
        if isinstance(v, str) and v.strip().lower() in PLATFORM_FP8:
            return v.strip().lower()
        try:
            return parse_dtype(v, what="dtype/kv_cache_dtype", extra={"auto": None})
        except DetectionError as e:
            raise ValueError(f"{e} (or SGLang's {', '.join(PLATFORM_FP8)})") from None


def parse_hints(hints: Mapping[str, Any] | None) -> SGLangHints:
    """Validate a hints dict.

    Raises:
        kvcore.DetectionError: an unknown key (listing the accepted ones) or a bad value.
    """
    raw = dict(hints or {})
    for name, f in SGLangHints.model_fields.items():
        alias = f.validation_alias
        names = [n for n in (alias.choices if isinstance(alias, AliasChoices) else [name]) if n in raw and raw[n] is not None]
        if len(names) > 1:
            values = {n: raw[n] for n in names}
            if len({repr(v) for v in values.values()}) > 1:
                raise DetectionError(f"sglang hints {values} name one fact ({name}) with different values; pass one of them")
            for n in names[1:]:
                del raw[n]
    try:
        return SGLangHints.model_validate(raw)
    except ValidationError as e:
        accepted = []
        for name, f in SGLangHints.model_fields.items():
            alias = f.validation_alias
            names = list(alias.choices) if isinstance(alias, AliasChoices) else [name]
            accepted.append("/".join(str(n) for n in names))
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'hints'}: {err['msg']}" for err in e.errors())
        raise DetectionError(f"sglang hints rejected ({problems}). Accepted hints: {', '.join(accepted)}") from None


def element_dtype(storage: torch.dtype, hints: SGLangHints) -> torch.dtype | None:
    """The element dtype to hand the spec (None = the tensors' own dtype).

    SGLang keeps fp8 KV as ``torch.uint8`` (``store_dtype``); an fp8 ``dtype`` hint over
    uint8 tensors makes the layout's element dtype that fp8 type (same bytes).

    Raises:
        kvcore.DetectionError: the hint names a dtype the tensors cannot be holding.
    """
    want = hints.dtype
    if want is None or want == storage:
        return None
    if storage == torch.uint8 and torch.empty(0, dtype=want).element_size() == 1:
        return want
    raise DetectionError(
        f"sglang: the dtype hint says {want} but the KV tensors hold {storage}; SGLang stores a KV pool in its dtype, "
        "or as torch.uint8 for fp8 (fp8_e4m3 / fp8_e5m2). Fix the hint or pass the pool's own tensors"
    )


def declared_hints() -> list[Any]:
    """The hints :class:`SGLangHints` reads, declared for ``kvcore hints sglang``
    (``kvcore_register_hints``); meanings as in this module's docstring."""
    from kvcore import Hint
    from kvcore.dtypes import DTYPE_ALIASES, DTYPES
    from kvcore.hints import tensor_order_hint

    pool = "python/sglang/srt/mem_cache/memory_pool.py"
    return [
        Hint(
            engine="sglang",
            name="page_size",
            aliases=["tokens_per_block", "block_size"],
            meaning="SGLang's --page-size: splits a device pool's fused token axis into [NB, BS] views; checks the page axis of "
            "HND and page-first-direct pools",
            type="int > 0",
            default="1: the fused token axis stays NBBS",
            source="python/sglang/srt/server_args.py::ServerArgs.page_size",
        ),
        Hint(
            engine="sglang",
            name="kv_list_layout",
            meaning="how a list of per-layer tensors is arranged: k_v = all K layers then all V layers (2*NL tensors, MHA), "
            "nested = [k_buffer, v_buffer], pairs = one (k, v) per layer",
            values=["k_v", "nested", "pairs"],
            default="read from the nesting",
        ),
        Hint(
            engine="sglang",
            name="layout",
            aliases=["kv_cache_layout"],
            meaning="token rows (NHD, SGLang's default), page rows (num_pages, NH, page_size, HS) with SGLANG_USE_HND_KVCACHE "
            "(HND), or AscendTokenToKVPool's cross-layer tensor (ascend)",
            values=["NHD", "HND", "ascend"],
            default="NHD for a 3-D token-row pool; ambiguous 4-D buffers name this hint",
            source=pool,
        ),
        Hint(
            engine="sglang",
            name="mem_layout",
            aliases=["hicache_mem_layout"],
            meaning="a HiCache host pool's --hicache-mem-layout",
            values=["layer_first", "page_first", "page_first_direct", "page_head"],
            default="read from the shape where it can; else this hint is named",
            source="python/sglang/srt/mem_cache/pool_host/mha.py::MHATokenToKVPoolHost.init_kv_buffer",
        ),
        Hint(
            engine="sglang",
            name="num_kv_heads",
            meaning="the pool's head_num (KV heads per rank)",
            type="int > 0",
            default="from the shapes",
        ),
        Hint(
            engine="sglang",
            name="head_size",
            aliases=["head_dim"],
            meaning="the pool's head_dim (K; MLA: kv_lora_rank + qk_rope_head_dim)",
            type="int > 0",
            default="from the shapes",
        ),
        Hint(
            engine="sglang",
            name="v_head_size",
            aliases=["v_head_dim"],
            meaning="the pool's v_head_dim when V's head size differs from K's",
            type="int > 0",
            default="head_size",
        ),
        Hint(
            engine="sglang",
            name="num_layers",
            aliases=["layer_num"],
            meaning="the pool's layer_num",
            type="int > 0",
            default="from the shapes",
        ),
        Hint(
            engine="sglang",
            name="dtype",
            aliases=["kv_cache_dtype"],
            meaning="--kv-cache-dtype: fp8 pools are stored as uint8 (store_dtype) and carry fp8 elements",
            values=["auto", *PLATFORM_FP8, *DTYPES, *DTYPE_ALIASES],
            type="torch.dtype or name",
            default="the tensors' own dtype",
            source=f"{pool}::KVCache.__init__",
        ),
        Hint(
            engine="sglang",
            name="is_mla",
            meaning="the model uses MLA (MLATokenToKVPool): one latent head",
            type="bool",
            default="from the shapes",
        ),
        Hint(
            engine="sglang",
            name="device_type",
            aliases=["device"],
            meaning="where SGLang runs: rocm (hip) makes fp8_e4m3 / fp8_e5m2 FNUZ (ModelRunner.init_memory_pool picks by is_hip())",
            values=list(DEVICE_TYPES),
            default="the torch build of the process holding the tensors; for meta tensors an fp8 name is ambiguous",
            source="python/sglang/srt/model_executor/model_runner.py::ModelRunner.init_memory_pool",
        ),
        tensor_order_hint("sglang"),
        Hint(
            engine="sglang",
            name="sglang_version",
            meaning="informational: layouts are read from the tensors' shapes and strides",
            type="version string",
        ),
    ]
