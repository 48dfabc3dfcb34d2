"""Hints for ``kvcore.detect(..., engine="lmdeploy", hints=...)``, in LMDeploy's own words.

LMDeploy's PyTorch engine allocates every block tensor contiguous, so its tensors do not
say everything: a per-layer ``[NB, A, B, HS]`` block tensor is ``(block_size, num_heads,
head_size)`` on the CUDA / Ascend / MACA backends and ``(num_heads, block_size,
head_size)`` on Cambricon (``camb``); the 0.11+ memory pool ``[NL, NB, bytes]`` carries no
geometry at all. Hints are the facts the caller has from LMDeploy's configuration
(``PytorchEngineConfig`` / ``CacheConfig`` / ``ModelConfig``).

Fields (all optional; aliases in brackets):

* ``quant_policy``: ``PytorchEngineConfig.quant_policy`` -- ``0`` (none), ``4`` (int4),
  ``8`` (int8), ``16`` (fp8 e4m3), ``17`` (fp8 e5m2), ``42`` (TurboQuant); an
  ``lmdeploy.messages.QuantPolicy`` member works (it is an ``int``). Checks the sibling
  scale/zero tensors, the element dtype and (int4 / TurboQuant) the packed widths; picks
  the pool's slices.
* ``device_type`` [``device``]: ``PytorchEngineConfig.device_type`` -- ``cuda``,
  ``ascend``, ``maca``, ``camb``. Decides the block order (``backends/*/op_backend.py::
  get_k_block_shape``): ``cuda`` ``(BS, NH, HS)`` (NHD); ``camb`` ``(NH, BS, HS)`` (HND);
  ``ascend`` NHD on Ascend 910, but 0.8.0-0.11.0 on Ascend 310P the "NZ" blocks
  ``((NH*HS+15)//16, BS, 16)`` (``soc_version`` decides); ``maca`` HND in 0.6.2-0.6.3, split-K
  (not described) in 0.6.4-0.9.x, NHD from 0.10 (``lmdeploy_version`` decides). Without it a
  tensor on a ``cuda`` device is read as the CUDA backend's (MetaX MACA tensors are ``cuda``
  tensors too: pass ``device_type='maca'``), one on ``npu`` as Ascend's and one on ``mlu`` as
  Cambricon's; a CPU tensor (LMDeploy's host swap cache, a copy) needs this hint,
  ``block_size`` or ``num_kv_heads`` where the readings differ. fp8 KV (``quant_policy``
  16 / 17) is CUDA only (0.14.0 ``CacheEngine.__init__`` asserts it), int4 / int8 /
  TurboQuant CUDA and Ascend only (``PytorchEngineConfig.__post_init__``).
* ``soc_version``: the Ascend chip, as LMDeploy's ``SocVersion.device_name()`` reads it
  (``torch_npu.npu.get_device_name()``, e.g. ``Ascend910B3``, ``Ascend310P3``; ``910B`` and
  ``310P`` are accepted). Only for ``device_type='ascend'``: 0.8.0-0.11.0 allocate NZ blocks on
  ``Ascend310P*`` and NHD blocks on ``Ascend910*``.
* ``block_size`` [``cache_block_seq_len``]: ``CacheConfig.block_size`` (tokens per block;
  TurboMind calls it ``cache_block_seq_len``). From 0.14 the manager's block may be split
  into kernel blocks: the tensors hold ``kernel_block_size`` tokens per block (a power of
  2, at least 16, dividing ``block_size``; camb: both 16), so a ``block_size`` that is such
  a multiple of theirs is read as the manager's. The layout's blocks are then the
  **kernel** blocks (``layout.block_size`` is the kernel block, ``gather_blocks`` takes
  kernel block ids); :mod:`kvcore_lmdeploy.blocks` takes the manager's block ids. The 0.11+ pool's bytes do not show its
  block: with ``block_size`` alone every kernel block it allows is a reading, and when two
  of them (with the policies) fill the pool's bytes per block alike -- int8 in 16-token
  blocks and int4 in 32-token blocks, say -- detection raises ``AmbiguousLayoutError``
  naming ``quant_policy`` / ``kernel_block_size``.
* ``kernel_block_size``: ``CacheConfig.kernel_block_size`` (0.14+): tokens per allocated block.
* ``num_kv_heads``: KV heads per rank (``ModelConfig.num_key_value_heads // world_size``,
  what ``CacheEngine._get_key_block_shape_impl`` allocates).
* ``head_dim``, ``k_head_dim``, ``v_head_dim``: ``ModelConfig.head_dim`` /
  ``k_head_dim`` / ``v_head_dim`` -- the model's (unpacked) head sizes; int4 stores
  ``head_dim // 2`` bytes, TurboQuant's V ``head_dim // 4``.
* ``dtype``: ``ModelConfig.dtype`` (``bfloat16``, ``float16``, ``float32`` or a
  ``torch.dtype``): the K/V dtype of an unquantised cache and the dtype of the int8/int4
  scales and zeros.
* ``tensor_order``: kvcore's generic hint (``allocated`` / ``physical``). LMDeploy
  allocates every tensor contiguous, so both readings are the same here.
* ``lmdeploy_version``: the release that allocated the cache. Every other hint and the
  tensors are checked against it (a contradiction is a :class:`kvcore.DetectionError`):
  int4 / int8 from 0.6.2; fp8 and TurboQuant, and kernel blocks, from 0.14.0; Cambricon from
  0.7; the cross-layer ``full_gpu_cache`` tuple 0.6.4-0.11.0 and the uint8 pool from 0.11.1;
  Ascend 310P's NZ blocks 0.8.0-0.11.0; MACA's block order per release (above). For
  a ``CacheEngine`` of 0.6.0-0.6.4 it also decides how an MQA model's heads are split.

Precedence: ``quant_policy`` and ``device_type`` select readings outright; size hints drop
readings whose axes disagree; then the tensors' shapes, dtypes and devices. Readings still
left that address memory differently raise :class:`kvcore.AmbiguousLayoutError` naming the
hints that decide -- the plugin never guesses. A hint the tensors contradict is a
:class:`kvcore.DetectionError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcore import DetectionError
from kvcore.detection import tensor_order
from kvcore.dtypes import parse_dtype

__all__ = ["LMDeployHints", "parse_hints", "declared_hints", "soc_family", "QUANT_POLICIES", "DEVICE_TYPES", "MODEL_DTYPES"]

#: ``lmdeploy.messages.QuantPolicy`` (0.14.0): NONE, INT4, INT8, FP8, FP8_E5M2, TURBO_QUANT.
#: Up to 0.12.3 ``quant_policy`` is a plain ``Literal[0, 4, 8]``.
QUANT_POLICIES = {0: "none", 4: "int4", 8: "int8", 16: "fp8 e4m3", 17: "fp8 e5m2", 42: "TurboQuant"}
#: ``PytorchEngineConfig.device_type``
DEVICE_TYPES = ("cuda", "ascend", "maca", "camb")
#: the model dtypes LMDeploy's PyTorch engine runs (``ModelConfig.dtype``)
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: what a torch device type says about the backend that allocated the tensor
DEVICE_OF_TORCH = {"cuda": "cuda", "npu": "ascend", "mlu": "camb"}


class LMDeployHints(BaseModel):
    """Validated LMDeploy hints (see the module docstring for meaning and precedence)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, populate_by_name=True)

    quant_policy: int | None = None
    device_type: Literal["cuda", "ascend", "maca", "camb"] | None = Field(None, validation_alias=AliasChoices("device_type", "device"))
    block_size: int | None = Field(None, ge=1, validation_alias=AliasChoices("block_size", "cache_block_seq_len"))
    kernel_block_size: int | None = Field(None, ge=1)
    num_kv_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)
    k_head_dim: int | None = Field(None, ge=1)
    v_head_dim: int | None = Field(None, ge=0)
    dtype: Any = None
    tensor_order: str | None = None
    lmdeploy_version: str | None = None
    soc_version: str | None = None

    @field_validator("quant_policy", mode="before")
    @classmethod
    def _policy(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or int(v) not in QUANT_POLICIES:
            accepted = ", ".join(f"{k} ({n})" for k, n in QUANT_POLICIES.items())
            raise ValueError(f"quant_policy {v!r} is not one of LMDeploy's QuantPolicy values: {accepted}")
        return int(v)

    @field_validator("device_type", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Any:
        if v is None:
            return None
        s = str(getattr(v, "type", v)).strip().lower().split(":")[0]
        return {"npu": "ascend", "mlu": "camb"}.get(s, s)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        if v is None:
            return None
        try:
            d = parse_dtype(v, what="hint dtype (ModelConfig.dtype)")
        except DetectionError as e:
            raise ValueError(str(e)) from None
        if d not in MODEL_DTYPES:
            raise ValueError(f"dtype {d} is not a model dtype LMDeploy runs (bfloat16, float16, float32)")
        return d

    @field_validator("tensor_order", mode="before")
    @classmethod
    def _order(cls, v: Any) -> Any:
        try:
            return tensor_order({"tensor_order": v}) if v is not None else None
        except DetectionError as e:
            raise ValueError(str(e)) from None

    @field_validator("lmdeploy_version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        return None if v is None else str(v)

    @field_validator("soc_version", mode="before")
    @classmethod
    def _soc(cls, v: Any) -> Any:
        if v is None:
            return None
        s = str(v).strip()
        if s.lower().startswith("ascend"):
            s = s[len("ascend") :]
        s = "Ascend" + s.upper()
        if soc_family(s) is None:
            raise ValueError(
                f"soc_version {v!r}: LMDeploy's ascend backend names Ascend910* and Ascend310P* chips "
                "(backends/dlinfer/ascend/op_backend.py::SocVersion), e.g. 'Ascend910B3' or 'Ascend310P3'"
            )
        return s

    # -- derived -----------------------------------------------------------------------
    def k_dim(self) -> int | None:
        """The model's K head size (``k_head_dim``, else ``head_dim``)."""
        return self.k_head_dim if self.k_head_dim is not None else self.head_dim

    def v_dim(self) -> int | None:
        """The model's V head size (``v_head_dim``, else ``head_dim``)."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    def soc(self) -> str | None:
        """``"310P"``, ``"910"`` or None (no ``soc_version``)."""
        return None if self.soc_version is None else soc_family(self.soc_version)

    def block_fits(self, bs: int, kernel_blocks: bool = True) -> bool:
        """Whether a tensor with ``bs`` tokens per block fits ``kernel_block_size`` /
        ``block_size`` (0.14 ``CacheEngine.allocate_caches``: the manager's block_size is a
        multiple of the kernel block the tensors hold). ``kernel_blocks=False`` (a release
        before 0.14): the tensors hold ``block_size`` tokens per block."""
        if self.kernel_block_size is not None:
            return bs == self.kernel_block_size
        if self.block_size is not None:
            if not kernel_blocks:
                return bs == self.block_size
            # 0.14 PytorchEngineConfig.__post_init__: kernel_block_size is >= 16, a power of 2 dividing block_size
            return bs == self.block_size or (bs >= 16 and bs & (bs - 1) == 0 and self.block_size % bs == 0)
        return True


def soc_family(name: str) -> str | None:
    """``"310P"`` for ``Ascend310P*``, ``"910"`` for ``Ascend910*``, else None: the prefixes
    ``SocVersion.is_Ascend310P`` / ``is_Ascend910`` (0.10.2+; 0.8.0 / 0.9.2 ``is_Ascend910B``)
    test."""
    if name.startswith("Ascend310P"):
        return "310P"
    if name.startswith("Ascend910"):
        return "910"
    return None


def parse_hints(hints: Mapping[str, Any] | None) -> LMDeployHints:
    """Validate a hints dict.

    Raises:
        kvcore.DetectionError: an unknown key (listing the accepted ones), two aliases of
            one hint with different values, or a bad value.
    """
    raw = dict(hints or {})
    for name, f in LMDeployHints.model_fields.items():
        alias = f.validation_alias
        names = [n for n in (alias.choices if isinstance(alias, AliasChoices) else [name]) if n in raw and raw[n] is not None]
        if len(names) > 1:
            values = {n: raw[n] for n in names}
            if len({repr(v) for v in values.values()}) > 1:
                raise DetectionError(f"lmdeploy hints {values} name one fact ({name}) with different values; pass one of them")
            for n in names[1:]:
                del raw[n]
    try:
        return LMDeployHints.model_validate(raw)
    except ValidationError as e:
        accepted = []
        for name, f in LMDeployHints.model_fields.items():
            alias = f.validation_alias
            names = list(alias.choices) if isinstance(alias, AliasChoices) else [name]
            accepted.append("/".join(str(n) for n in names))
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'hints'}: {err['msg']}" for err in e.errors())
        raise DetectionError(f"lmdeploy hints rejected ({problems}). Accepted hints: {', '.join(accepted)}") from None


def declared_hints() -> list[Any]:
    """The hints :class:`LMDeployHints` reads, for ``kvcore hints lmdeploy``."""
    from kvcore import Hint, tensor_order_hint

    hint = partial(Hint, engine="lmdeploy")
    ce = "lmdeploy/pytorch/engine/cache_engine.py::CacheEngine"
    return [
        hint(
            name="quant_policy",
            meaning="PytorchEngineConfig.quant_policy: 0 none, 4 int4 (K/V uint8 of head_dim/2 bytes), 8 int8, 16 fp8 e4m3, "
            "17 fp8 e5m2, 42 TurboQuant; int4/int8/TurboQuant add per-token-head scale/zero (norm) tensors",
            values=[str(k) for k in QUANT_POLICIES],
            default="read from the tensors (sibling scale/zero tensors, dtypes); the 0.11+ pool: the one policy whose bytes per "
            "block fit, several fitting raise AmbiguousLayoutError naming this hint",
            source="lmdeploy/messages.py::QuantPolicy (0.14.0); PytorchEngineConfig.quant_policy",
        ),
        hint(
            name="device_type",
            aliases=["device"],
            meaning="PytorchEngineConfig.device_type: the backend whose get_k_block_shape allocated the blocks: cuda (BS, NH, HS) "
            "(NHD); camb (NH, BS, HS) (HND); ascend NHD, or 0.8.0-0.11.0 on Ascend 310P NZ ((NH*HS+15)//16, BS, 16) "
            "(soc_version decides); maca HND in 0.6.2-0.6.3, NHD from 0.10 (lmdeploy_version decides). fp8 KV is cuda only",
            values=list(DEVICE_TYPES),
            default="the tensors' torch device (cuda: the CUDA backend, npu: Ascend, mlu: Cambricon); CPU tensors need it "
            "where the readings differ",
            source="lmdeploy/pytorch/backends/*/op_backend.py::get_k_block_shape",
        ),
        hint(
            name="block_size",
            aliases=["cache_block_seq_len"],
            meaning="CacheConfig.block_size, tokens per block (TurboMind: cache_block_seq_len); 0.14+: a multiple of the "
            "kernel block the tensors hold",
            type="int > 0",
            default="from the shapes",
            source="lmdeploy/pytorch/config.py::CacheConfig.block_size",
        ),
        hint(
            name="kernel_block_size",
            meaning="CacheConfig.kernel_block_size (0.14+): tokens per allocated block (a power of 2 >= 16 dividing block_size; camb: 16)",
            type="int > 0",
            default="the tensors' block; the 0.11+ pool: every kernel block block_size allows, several fitting the pool's "
            "bytes raise AmbiguousLayoutError naming this hint",
            source=f"{ce}.allocate_caches (0.14.0)",
        ),
        hint(
            name="num_kv_heads",
            meaning="KV heads per rank: ModelConfig.num_key_value_heads // world_size",
            type="int > 0",
            default="from the shapes (required for the 0.11+ memory pool)",
            source=f"{ce}._get_key_block_shape_impl",
        ),
        hint(
            name="head_dim",
            meaning="ModelConfig.head_dim: the model's head size (int4 stores head_dim/2 bytes per head)",
            type="int > 0",
            default="from the shapes (required for the 0.11+ memory pool unless k_head_dim and v_head_dim are given)",
            source="lmdeploy/pytorch/config.py::ModelConfig.head_dim",
        ),
        hint(
            name="k_head_dim",
            meaning="ModelConfig.k_head_dim when K's head size differs from head_dim",
            type="int > 0",
            default="head_dim",
            source="lmdeploy/pytorch/config.py::ModelConfig.k_head_dim",
        ),
        hint(
            name="v_head_dim",
            meaning="ModelConfig.v_head_dim when V's head size differs from head_dim (0 for MLA: V is not stored)",
            type="int >= 0",
            default="head_dim",
            source="lmdeploy/pytorch/config.py::ModelConfig.v_head_dim",
        ),
        hint(
            name="dtype",
            meaning="ModelConfig.dtype: K/V dtype of an unquantised cache, dtype of the int4/int8 scales and zeros",
            values=["bfloat16", "float16", "float32"],
            type="torch.dtype or name",
            default="the tensors' dtypes (required for the 0.11+ memory pool)",
            source="lmdeploy/pytorch/config.py::ModelConfig.dtype",
        ),
        tensor_order_hint("lmdeploy"),
        hint(
            name="lmdeploy_version",
            meaning="the release that allocated the cache; every hint and the tensors are checked against it: int4/int8 "
            "from 0.6.2, fp8 / TurboQuant / kernel blocks from 0.14.0, camb from 0.7, the cross-layer full_gpu_cache "
            "tuple 0.6.4-0.11.0, the uint8 pool from 0.11.1, Ascend 310P NZ blocks 0.8.0-0.11.0, MACA's block order "
            "(0.6.2-0.6.3 HND, 0.10+ NHD), and a 0.6.0-0.6.4 CacheEngine's MQA head split",
            type="version string",
            default="read from the tensors; where two releases allocate the same tensors differently (MACA), "
            "AmbiguousLayoutError names this hint",
            source="SOURCES.md (per release)",
        ),
        hint(
            name="soc_version",
            meaning="the Ascend chip (SocVersion.device_name(): torch_npu.npu.get_device_name(), e.g. Ascend910B3, "
            "Ascend310P3); LMDeploy 0.8.0-0.11.0 allocate NZ blocks ((NH*HS+15)//16, BS, 16) on Ascend310P*, "
            "(BS, NH, HS) on Ascend910*",
            type="Ascend device name",
            default="both readings where the tensors fit both (AmbiguousLayoutError names this hint)",
            source="lmdeploy/pytorch/backends/dlinfer/ascend/op_backend.py::AscendOpsBackend.get_k_block_shape (0.8.0-0.11.0)",
        ),
    ]
