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
  ``"unified"``: each list entry is one cache *component* already paged, as LMCache's
  SGLang unified-radix-cache connector registers SGLang's buffers (``k_buffer`` then
  ``v_buffer`` entries ``[NB, page_size, NH, HS]``, MLA ``kv_buffer`` entries
  ``[NB, page_size, D]``): ``NL_X_NB_BS_NH_HS`` / ``NL_X_NB_BS_HS``, one "layer" per
  component (kvcore does not pair K with V there: the connector concatenates groups).
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
  ``fp8_e5m2`` name the OCP types off ROCm. On ROCm (``is_hip()``) SGLang up to
  0.5.6.post1 picks ``float8_e4m3fnuz`` / ``float8_e5m2fnuz`` (0.5.3
  ``model_executor/model_runner.py::ModelRunner.init_memory_pool``); from 0.5.6.post2 both
  names are ``fp8_kernel.fp8_dtype`` -- ``float8_e4m3fnuz`` on gfx94x (``is_fp8_fnuz``:
  ``"gfx94" in gcnArchName``), ``float8_e4m3fn`` otherwise (gfx950), e5m2 included (0.5.23
  ``mem_cache/kv_cache_dtype.py::configure_kv_cache_dtype``). The platform is
  ``device_type``, else the torch build of the process that holds the tensors (SGLang's own
  ``is_hip()`` test); the release is ``sglang_version``; the GPU is ``gcn_arch``, else the
  ``gcnArchName`` of the ROCm GPU holding the tensors. Where these leave two dtypes (tensors
  on the meta device, or no version / GPU to go by) detection raises
  :class:`kvcore.AmbiguousLayoutError` naming the missing ones and ``dtype``.
* ``device_type`` [``device``]: ``cuda``, ``rocm`` (``hip``), ``cpu``, ``npu``, ``xpu``,
  ``musa``, ``hpu``: where SGLang runs (with ``sglang_version`` and ``gcn_arch``, decides
  ``fp8_e4m3`` / ``fp8_e5m2``).
* ``gcn_arch`` [``gfx``]: the ROCm GPU's ``gcnArchName`` (``gfx942``, ``gfx950``;
  ``gfx942:sramecc+:xnack-`` is read as ``gfx942``): decides the fp8 names from 0.5.6.post2.
* ``tensor_order``: kvcore's generic hint (``allocated`` / ``physical``, see
  :mod:`kvcore.detection`). SGLang allocates its pools contiguous; a 4-D page view whose
  strides are permuted is read through them, named by its memory order.
* ``is_mla``: the model uses MLA (``MLATokenToKVPool``).
* ``sglang_version``: ``"0.5.3"``, ``"0.5.23"``, ``"0.5.6.post2"``...; layouts are read
  from the tensors' own shapes and strides; the version decides what ``fp8_e4m3`` /
  ``fp8_e5m2`` mean on ROCm (above), and ``0.5.3`` (whose ``NSATokenToKVPool`` has no
  kernel-page split) decides the DSA indexer's page (below).
* ``index_page_size``, ``attn_dcp_size``, ``dcp_replicated``, ``index_kpool``: the DSA
  indexer pool's kernel page (0.5.23 ``memory_pool.py::DSATokenToKVPool.__init__``:
  ``index_page_size = page_size // index_kpool``, divided by ``attn_dcp_size`` when
  ``dcp_replicated`` -- a draft worker under decode-context parallelism,
  ``kv_cache_configurator.py`` ``loc_space_scale > 1``). A buffer row of
  ``page_size // index_kpool`` records is re-viewed as several kernel pages of
  ``index_page_size`` tokens (``index_key_cache.py::IndexKeyCache._kernel_view``), which
  a 2-D uint8 tensor cannot show: see :mod:`kvcore_sglang.indexer`.

Precedence: a structural hint (``is_mla``, ``kv_list_layout``, ``layout``,
``mem_layout``) selects the reading outright; size hints (``page_size``,
``num_kv_heads``, ``head_size``, ``num_layers``) drop readings whose axes disagree;
then the tensors' shapes and strides; SGLang's defaults last (a 3-D token-row pool is
NHD; no ``page_size`` keeps the fused token axis ``NBBS``). Readings still left that
address memory differently raise :class:`kvcore.AmbiguousLayoutError` naming the hint
that decides — the plugin never guesses.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
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
#: an SGLang release string: major.minor[.patch][.postN] (a pre-release suffix is read as its release)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?post(\d+))?(?:[.-]?(?:rc|a|b|dev)\d*)?$")
DEVICE_TYPES = ("cuda", "rocm", "cpu", "npu", "xpu", "musa", "hpu")


class SGLangHints(BaseModel):
    """Validated SGLang hints (see the module docstring for meaning and precedence)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, populate_by_name=True)

    page_size: int | None = Field(None, ge=1, validation_alias=AliasChoices("page_size", "tokens_per_block", "block_size"))
    kv_list_layout: Literal["k_v", "nested", "pairs", "unified"] | None = None
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
    gcn_arch: str | None = Field(None, validation_alias=AliasChoices("gcn_arch", "gfx"))
    tensor_order: str | None = None
    index_page_size: int | None = Field(None, ge=1)
    attn_dcp_size: int | None = Field(None, ge=1)
    dcp_replicated: bool | None = None
    index_kpool: int | None = Field(None, ge=1)

    @field_validator("gcn_arch", mode="before")
    @classmethod
    def _arch(cls, v: Any) -> Any:
        if v is None:
            return None
        s = str(v).strip().lower().split(":")[0]
        if not re.fullmatch(r"gfx[0-9a-f]+", s):
            raise ValueError(f"gcn_arch {v!r} is not a ROCm gcnArchName (e.g. 'gfx942', 'gfx950', 'gfx942:sramecc+:xnack-')")
        return s

    @field_validator("sglang_version", mode="before")
    @classmethod
    def _sglang_version(cls, v: Any) -> Any:
        return None if v is None else str(v).strip()

    def version(self) -> tuple[int, int, int, int] | None:
        """``sglang_version`` as ``(major, minor, patch, post)`` (``0.5.6.post2`` -> ``(0, 5, 6, 2)``;
        a pre-release counts as its release), None when not given.

        Raises:
            kvcore.DetectionError: a version string that is not an SGLang release (asked only
                where the version decides something: an fp8 name on ROCm).
        """
        if self.sglang_version is None:
            return None
        m = _VERSION.match(self.sglang_version)
        if m is None:
            raise DetectionError(
                f"sglang: hint sglang_version={self.sglang_version!r} is not an SGLang release (e.g. '0.5.3', '0.5.6.post2', "
                "'0.5.23'); on ROCm it decides what an fp8 kv_cache_dtype name means"
            )
        return (int(m[1]), int(m[2]), int(m[3] or 0), int(m[4] or 0))

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


#: the pool geometry hints, each a positive int: (name, aliases, meaning, default)
_POOL_GEOMETRY: tuple[tuple[str, list[str], str, str], ...] = (
    ("num_kv_heads", [], "the pool's head_num (KV heads per rank)", "from the shapes"),
    ("head_size", ["head_dim"], "the pool's head_dim (K; MLA: kv_lora_rank + qk_rope_head_dim)", "from the shapes"),
    ("v_head_size", ["v_head_dim"], "the pool's v_head_dim when V's head size differs from K's", "head_size"),
    ("num_layers", ["layer_num"], "the pool's layer_num", "from the shapes"),
)


def declared_hints() -> list[Any]:
    """The hints :class:`SGLangHints` reads, declared for ``kvcore hints sglang``
    (``kvcore_register_hints``); meanings as in this module's docstring."""
    from kvcore import Hint, tensor_order_hint
    from kvcore.dtypes import DTYPE_ALIASES, DTYPES

    hint = partial(Hint, engine="sglang")
    pool = "python/sglang/srt/mem_cache/memory_pool.py"
    return [
        hint(
            name="page_size",
            aliases=["tokens_per_block", "block_size"],
            meaning="SGLang's --page-size: splits a device pool's fused token axis into [NB, BS] views; checks the page axis of "
            "HND and page-first-direct pools",
            type="int > 0",
            default="1: the fused token axis stays NBBS",
            source="python/sglang/srt/server_args.py::ServerArgs.page_size",
        ),
        hint(
            name="kv_list_layout",
            meaning="how a list of per-layer tensors is arranged: k_v = all K layers then all V layers (2*NL tensors, MHA), "
            "nested = [k_buffer, v_buffer], pairs = one (k, v) per layer, unified = one paged component per entry (LMCache's "
            "SGLang unified connector: K and V buffers [NB, page_size, NH, HS] or MLA [NB, page_size, D])",
            values=["k_v", "nested", "pairs", "unified"],
            default="read from the nesting",
        ),
        hint(
            name="layout",
            aliases=["kv_cache_layout"],
            meaning="token rows (NHD, SGLang's default), page rows (num_pages, NH, page_size, HS) with SGLANG_USE_HND_KVCACHE "
            "(HND), or AscendTokenToKVPool's cross-layer tensor (ascend)",
            values=["NHD", "HND", "ascend"],
            default="NHD for a 3-D token-row pool; ambiguous 4-D buffers name this hint",
            source=pool,
        ),
        hint(
            name="mem_layout",
            aliases=["hicache_mem_layout"],
            meaning="a HiCache host pool's --hicache-mem-layout",
            values=["layer_first", "page_first", "page_first_direct", "page_head"],
            default="read from the shape where it can; else this hint is named",
            source="python/sglang/srt/mem_cache/pool_host/mha.py::MHATokenToKVPoolHost.init_kv_buffer",
        ),
        *(
            hint(name=name, aliases=aliases, meaning=meaning, type="int > 0", default=default)
            for name, aliases, meaning, default in _POOL_GEOMETRY
        ),
        hint(
            name="dtype",
            aliases=["kv_cache_dtype"],
            meaning="--kv-cache-dtype: fp8 pools are stored as uint8 (store_dtype) and carry fp8 elements",
            values=["auto", *PLATFORM_FP8, *DTYPES, *DTYPE_ALIASES],
            type="torch.dtype or name",
            default="the tensors' own dtype",
            source=f"{pool}::KVCache.__init__",
        ),
        hint(
            name="is_mla",
            meaning="the model uses MLA (MLATokenToKVPool): one latent head",
            type="bool",
            default="from the shapes",
        ),
        hint(
            name="device_type",
            aliases=["device"],
            meaning="where SGLang runs: off rocm (hip) fp8_e4m3 / fp8_e5m2 are the OCP types; on rocm they follow "
            "sglang_version and gcn_arch",
            values=list(DEVICE_TYPES),
            default="the torch build of the process holding the tensors; for meta tensors an fp8 name is ambiguous",
            source="python/sglang/srt/model_executor/model_runner.py::ModelRunner.init_memory_pool (0.5.3); "
            "python/sglang/srt/mem_cache/kv_cache_dtype.py::configure_kv_cache_dtype (0.5.23)",
        ),
        hint(
            name="gcn_arch",
            aliases=["gfx"],
            meaning="the ROCm GPU's gcnArchName: from SGLang 0.5.6.post2 fp8_e4m3 and fp8_e5m2 are float8_e4m3fnuz on gfx94x "
            "(is_fp8_fnuz) and float8_e4m3fn otherwise",
            type="gfx name (gfx942, gfx950)",
            default="the gcnArchName of the ROCm GPU holding the tensors; else an fp8 name that depends on it is ambiguous",
            source="python/sglang/kernels/ops/quantization/fp8_kernel.py::is_fp8_fnuz (0.5.23)",
        ),
        tensor_order_hint("sglang"),
        hint(
            name="index_page_size",
            meaning="the DSA indexer's kernel page in tokens (DSATokenToKVPool.index_page_size): each buffer row of "
            "page_size // index_kpool records is that many kernel pages, token loc -> page loc // index_page_size",
            type="int > 0, dividing the row's records",
            default="from attn_dcp_size/dcp_replicated/index_kpool or sglang_version 0.5.3; else ambiguous",
            source="python/sglang/srt/mem_cache/index_key_cache.py::IndexKeyCache._kernel_view (0.5.23)",
        ),
        hint(
            name="attn_dcp_size",
            meaning="decode-context-parallel size: divides the DSA indexer's kernel page when dcp_replicated",
            type="int > 0",
            default="with dcp_replicated unknown and attn_dcp_size > 1 the indexer page is ambiguous",
            source=f"{pool}::DSATokenToKVPool.__init__ (0.5.23)",
        ),
        hint(
            name="dcp_replicated",
            meaning="the DSA pool was built with dcp_replicated=True (a draft worker with attn_dcp_size > 1): the indexer's "
            "kernel page is page_size // index_kpool // attn_dcp_size",
            type="bool",
            default="unknown",
            source="python/sglang/srt/mem_cache/kv_cache_configurator.py (loc_space_scale > 1) (0.5.23)",
        ),
        hint(
            name="index_kpool",
            meaning="DSA index-key pooling (one record per index_kpool tokens); only 1 is token-addressed, larger values are "
            "refused (SGLang's own IndexKeyCache.move asserts index_kpool == 1)",
            type="int > 0",
            default="1 when any other indexer hint decides",
            source=f"{pool}::DSATokenToKVPool.__init__ (0.5.23)",
        ),
        hint(
            name="sglang_version",
            meaning="layouts are read from the tensors' shapes and strides; on ROCm the version decides fp8_e4m3 / fp8_e5m2 "
            "(up to 0.5.6.post1 FNUZ of the named kind, from 0.5.6.post2 fp8_kernel.fp8_dtype)",
            type="version string",
            default="for an fp8 name on ROCm: ambiguous where the releases differ",
        ),
    ]
