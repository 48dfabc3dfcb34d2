"""LMCache's format vocabulary: the ``EngineKVFormat`` member table and value, the engine
type, the hint and cache types, and the format predicates of ``lmcache_native``."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal, TypedDict, Union

import torch

from kvcore.errors import FormatError
from kvcore.format_decl import KVFormat
from kvcore.grammar import parse

#: LMCache 0.5.6's ``EngineKVFormat`` members and their enum values
#: (``csrc/engine_kv_format.h``, ``enum class EngineKVFormat``).
LMCACHE_FORMATS: Mapping[str, int] = MappingProxyType(
    {
        "NB_NL_TWO_BS_NH_HS": 0,
        "NL_X_TWO_NB_BS_NH_HS": 1,
        "NL_X_NB_TWO_BS_NH_HS": 2,
        "NL_X_NB_BS_HS": 3,
        "TWO_X_NL_X_NBBS_NH_HS": 4,
        "NL_X_NBBS_ONE_HS": 5,
        "NL_X_TWO_NB_NH_BS_HS": 6,
        "NL_X_NB_TWO_NH_BS_HS": 7,
        "NB_NL_TWO_NH_BS_HS": 8,
        "TWO_X_NL_X_NB_BS_NH_HS": 9,
        "NL_X_NB_NH_BS_TWO_HS": 10,
        "NL_X_NB_BS_NH_TWO_HS": 11,
        "NL_X_NB_NH_BS_CS": 12,
        "NL_X_NB_BS_NH_CS": 13,
        "NL_X_NB_BSV_BSS": 14,
        "NL_X_TWO_NB_NH_ONE_BS_HS": 15,
        "NL_X_TWO_X_NB_BS_NH_HS": 16,
        "NL_X_NP_X_NB_BS_ONE_HS": 17,
        "NL_X_NB_BS_NH_HS": 18,
    }
)

#: Who allocates each LMCache member, per LMCache's spec files (``specs/<member>.py``,
#: ``attention_backends``) and ``lmcache_kv_format.md`` §1.2: the backend labels for
#: members no installed kvcore plugin registers (a plugin's own list comes first).
_LMCACHE_ALLOCATORS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "NB_NL_TWO_BS_NH_HS": ("vLLM cross-layer KV buffer",),
        "NL_X_TWO_NB_BS_NH_HS": ("vLLM FlashAttention, NHD",),
        "NL_X_NB_TWO_BS_NH_HS": ("vLLM FlashInfer, NHD",),
        "NL_X_NB_BS_HS": ("vLLM MLA latent cache", "SGLang MLA paged by LMCache's MP path"),
        "TWO_X_NL_X_NBBS_NH_HS": ("SGLang MHA token pool",),
        "NL_X_NBBS_ONE_HS": ("SGLang MLA token pool",),
        "NL_X_TWO_NB_NH_BS_HS": ("vLLM FlashAttention, HND",),
        "NL_X_NB_TWO_NH_BS_HS": ("vLLM FlashInfer, HND",),
        "NB_NL_TWO_NH_BS_HS": ("TensorRT-LLM block pool (HND blocks)",),
        "TWO_X_NL_X_NB_BS_NH_HS": ("SGLang MHA pool paged by LMCache's MP path",),
        "NL_X_NB_NH_BS_TWO_HS": ("vLLM blocks-first packed K|V, HND (superseded by NL_X_NB_NH_BS_CS)",),
        "NL_X_NB_BS_NH_TWO_HS": ("vLLM blocks-first packed K|V, NHD (superseded by NL_X_NB_BS_NH_CS)",),
        "NL_X_NB_NH_BS_CS": ("vLLM per-layer packed K|V view, HND",),
        "NL_X_NB_BS_NH_CS": ("vLLM per-layer packed K|V view, NHD",),
        "NL_X_NB_BSV_BSS": ("vLLM DeepSeek blocked-scale pages (indexer, quantised MLA)",),
        "NL_X_TWO_NB_NH_ONE_BS_HS": ("vLLM-RBLN (Rebellions NPU) attention",),
        "NL_X_TWO_X_NB_BS_NH_HS": ("vLLM-Ascend per-layer (K, V) tuples",),
        "NL_X_NP_X_NB_BS_ONE_HS": ("vLLM-Ascend MLA / DSA plane tuples",),
        "NL_X_NB_BS_NH_HS": ("SGLang per-component K or V views (kv_list_layout='unified')",),
    }
)

#: The engine LMCache's spec file of each member is about (its ``attention_backends``), as
#: the kvcore engine name: that engine's plugin gives the member's first backend label.
_LMCACHE_ENGINE: Mapping[str, str] = MappingProxyType(
    {
        name: ("sglang" if labels[0].startswith("SGLang") else "trtllm" if labels[0].startswith("TensorRT-LLM") else "vllm")
        for name, labels in _LMCACHE_ALLOCATORS.items()
    }
)

#: LMCache's blocked-scale record widths -> scale bytes per record
#: (``specs/nl_x_nb_bsv_bss.py::BLOCKED_SCALE_RECORDS``, lmcache_kv_format.md §6.4).
#: Used when an ``NL_X_NB_BSV_BSS`` value carries no ``scale_bytes`` of its own.
_BLOCKED_SCALE_RECORDS: Mapping[int, int] = MappingProxyType({584: 8, 528: 16, 352: 32, 132: 4, 68: 4})


# -- the format value ------------------------------------------------------------------------


class EngineKVFormat(str):
    """A format name that behaves like LMCache's ``EngineKVFormat`` member.

    It *is* the name (``fmt == "NL_X_TWO_NB_BS_NH_HS"``, hashable, JSON-able). LMCache's
    members are class attributes (``EngineKVFormat.NL_X_NB_BS_HS``, ``__members__``) with
    their enum ``value`` (``int(fmt)``); any name the grammar parses is a value too, which is
    how detection returns kvcore formats LMCache has no member for. ``dtype`` / ``params``
    carry what detection decided beyond the name (the element dtype of a byte view, the
    scale width of blocked-scale records); the accessors rebuild the layout with them.

    Raises:
        FormatError: the name does not parse.
    """

    dtype: torch.dtype | None
    params: dict[str, Any]
    __members__: ClassVar[Mapping[str, EngineKVFormat]]

    def __new__(cls, name: str, dtype: torch.dtype | None = None, params: dict[str, Any] | None = None):
        parse(str(name))
        obj = super().__new__(cls, str(name))
        obj.dtype = dtype
        obj.params = dict(params or {})
        return obj

    def __repr__(self) -> str:
        return f"EngineKVFormat.{str(self)}"

    def __reduce__(self):
        return (EngineKVFormat, (str(self), self.dtype, self.params))

    def __int__(self) -> int:
        v = self.value
        if v is None:
            raise FormatError(
                f"{str(self)} is a kvcore format with no LMCache EngineKVFormat value (LMCache's members: {', '.join(LMCACHE_FORMATS)})"
            )
        return v

    @property
    def name(self) -> str:
        return str(self)

    @property
    def value(self) -> int | None:
        """LMCache's enum value of this member, or None for a name LMCache has no member for."""
        return LMCACHE_FORMATS.get(str(self))

    @property
    def syntax(self):
        return parse(str(self))

    @property
    def kv_size(self) -> int:
        return self.syntax.kv_size

    @property
    def is_mla(self) -> bool:
        return self.syntax.is_mla

    @property
    def is_cross_layer(self) -> bool:
        return self.syntax.container == "cross_layer"

    @property
    def is_kv_list(self) -> bool:
        return self.syntax.container == "kv_list"

    @property
    def is_layer_list(self) -> bool:
        """True for per-layer lists, including per-layer tuples (as LMCache's facts)."""
        return self.syntax.container in ("layer_list", "per_layer_tuple")

    @property
    def is_kv_second_tuple(self) -> bool:
        return self.syntax.container == "per_layer_tuple"

    @property
    def is_hnd(self) -> bool:
        return self.syntax.is_hnd

    @property
    def is_fused_packed(self) -> bool:
        return self.syntax.fused_kv

    @property
    def is_two_major(self) -> bool:
        return self.syntax.two_major

    @property
    def is_pbs_fused(self) -> bool:
        return self.syntax.fused_nbbs

    @property
    def is_single_kv(self) -> bool:
        """Each list entry is one K or V tensor with real heads (``NL_X_NB_BS_NH_HS``):
        kv_size 1 with a head axis."""
        syn = self.syntax
        return syn.container == "layer_list" and syn.kv_size == 1 and syn.has("NH")


for _name in LMCACHE_FORMATS:
    setattr(EngineKVFormat, _name, EngineKVFormat(_name))
EngineKVFormat.__members__ = MappingProxyType({n: getattr(EngineKVFormat, n) for n in LMCACHE_FORMATS})
del _name


class EngineType(enum.Enum):
    """LMCache's ``lmcache.utils.EngineType``: the serving engine a cache comes from. Its
    value is the kvcore engine name its plugin answers to."""

    VLLM = "vllm"
    ATOM = "atom"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    MOCK = "mock"


#: LMCache ``kv_format/types.py::DiscoverableKVCache``: a tensor or nested lists/tuples of them.
DiscoverableKVCache = Union[torch.Tensor, list["DiscoverableKVCache"], tuple["DiscoverableKVCache", ...]]


class LayoutHints(TypedDict, total=False):
    """LMCache's ``kv_format/types.py::LayoutHints`` (a plain dict works too).

    Keys: ``kv_layout`` (``"NHD"``, ``"HND"``, ``"BLHNC"``, ``"BLNHC"``: vLLM's physical order),
    ``num_kv_heads``, ``tokens_per_block`` and ``head_dim`` (TensorRT-LLM's pool geometry;
    ``tokens_per_block`` also SGLang's page size), ``kv_list_layout`` (SGLang: ``"k_v"`` for a
    flat list of K layers then V layers). See the module docstring for how each reaches the
    engine's plugin; kvcore plugin hint keys may be given alongside.
    """

    kv_layout: Literal["NHD", "HND", "BLHNC", "BLNHC"]
    num_kv_heads: int
    tokens_per_block: int
    kv_list_layout: Literal["k_v", "unified"]
    head_dim: int


def _fmt(fmt: Any) -> EngineKVFormat:
    if isinstance(fmt, EngineKVFormat):
        return fmt
    if isinstance(fmt, KVFormat):
        return EngineKVFormat(fmt.name)
    name = getattr(fmt, "name", fmt)  # an enum member of LMCache's own EngineKVFormat
    if not isinstance(name, str):
        raise FormatError(f"expected a format name (str), a kvcore.KVFormat or an EngineKVFormat, got {fmt!r}")
    return EngineKVFormat(name)


# -- format facts (LMCache's C++ predicates) -------------------------------------------------

#: The facts of a format, each an :class:`EngineKVFormat` property and a spec class attribute
#: (:func:`~kvcore.compat.lmcache.get_spec_class`); those but ``is_single_kv`` are also
#: LMCache's module-level predicates below.
FACTS: dict[str, str] = {
    "is_mla": "No K/V split and no heads (kv_size 1).",
    "is_cross_layer": "One tensor holds every layer.",
    "is_kv_list": "``[K layers, V layers]``.",
    "is_layer_list": "One entry per layer (including per-layer tuples).",
    "is_kv_second_tuple": "Each layer entry is a tuple (``NL_X_TWO_X_...``, ``NL_X_NP_X_...``).",
    "is_hnd": "Heads outside tokens within a block.",
    "is_fused_packed": "K and V packed in the element axis (CS, or TWO directly outside HS).",
    "is_two_major": "The K/V axis is outside the block axis.",
    "is_pbs_fused": "Blocks and tokens fused in one axis (NBBS).",
    "is_single_kv": "Each list entry is one K or V tensor with real heads (``NL_X_NB_BS_NH_HS``).",
}


def _predicate(fact: str) -> Callable[[Any], bool]:
    def predicate(engine_kv_format: Any) -> bool:
        return getattr(_fmt(engine_kv_format), fact)

    predicate.__name__ = predicate.__qualname__ = fact
    predicate.__doc__ = FACTS[fact] + "\n\nRaises:\n    FormatError: not a format name."
    return predicate


is_mla = _predicate("is_mla")
is_cross_layer = _predicate("is_cross_layer")
is_kv_list = _predicate("is_kv_list")
is_layer_list = _predicate("is_layer_list")
is_kv_second_tuple = _predicate("is_kv_second_tuple")
is_hnd = _predicate("is_hnd")
is_fused_packed = _predicate("is_fused_packed")
is_two_major = _predicate("is_two_major")
is_pbs_fused = _predicate("is_pbs_fused")
