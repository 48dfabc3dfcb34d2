"""The :class:`Rule` record (one vLLM allocation: era, backend family, shape) and its
naming helpers; every rule family module declares its rules with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore import Source
from kvcore.errors import FormatError
from kvcore_vllm.releases import ERAS, layout_physical_order

GPU_FAMILIES = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")


#: vLLM 0.29+ ``create_kv_cache_views``' logical ``[L, B, H, N, C]`` as kvcore tokens: a backend's
#: view ``[NB, NH, BS, C]``, and a head-slot view's (``customize_spec`` with ``num_head_slots=2``: H
#: is the K/V slot, C a slot's ``NH*HS`` row read token-major as ``NH HS``).
VIEW_AXES = ("NL", "NB", "NH", "BS", "CS")
SLOT_AXES = ("NL", "NB", "TWO", "BS", "NH HS")


def member_layouts(members: Sequence[str], axes: Sequence[str] = VIEW_AXES) -> dict[str, tuple[str, ...]]:
    """``KVCacheLayout`` members (a backend's ``supported_kv_cache_layouts()``) -> each one's
    physical order over ``axes`` (:func:`kvcore_vllm.releases.layout_physical_order`; an axis of
    several tokens, ``"NH HS"``, expands in place, ``""`` drops a squeezed axis).
    ``member_layouts(("LHBNC",))`` -> ``{"LHBNC": ("NL", "NH", "NB", "BS", "CS")}``."""
    return {m: tuple(tok for axis in layout_physical_order(m, tuple(axes)) for tok in axis.split()) for m in members}


def stride_layouts(logical: str, orders: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, ...]]:
    """vLLM's ``get_kv_cache_stride_order`` per layout key -> each key's physical order: the
    per-layer shape ``logical`` (``get_kv_cache_shape``'s axes) permuted by the order, after a
    layer list's ``NL``; an order one longer (``include_num_layers_dimension=True``, a
    ``/cross`` key) permutes ``(NL, *logical)``, one cross-layer buffer.
    ``stride_layouts("NB TWO BS NH HS", {"HND": (0, 1, 3, 2, 4)})`` -> ``{"HND": ("NL", "NB", "TWO", "NH", "BS", "HS")}``."""
    axes = tuple(logical.split())
    out = {}
    for key, order in orders.items():
        if len(order) == len(axes) + 1:
            out[key] = tuple((("NL",) + axes)[i] for i in order)
        else:
            out[key] = ("NL",) + tuple(axes[i] for i in order)
    return out


def _o(s: str) -> tuple[str, ...]:
    return tuple(s.split())


@dataclass(frozen=True)
class Rule:
    """One vLLM allocation: see the module docstring.

    Attributes:
        label: a short human name (shown in notes and ambiguity messages).
        eras: layout eras (:data:`kvcore_vllm.hints.ERAS`) the rule holds for.
        families: backend families (:data:`kvcore_vllm.hints.BACKEND_FAMILY` values).
        rank: rank of the tensor vLLM hands out.
        logical: axis tokens of the per-layer view after ``transform``.
        layouts: layout key -> physical axis order (with ``NL``).
        sources: where the facts come from.
        transform: name of a zero-copy view transform (:data:`TRANSFORMS`), or "".
        gate: "gpu" (excluded when device_type is cpu/tpu), "cpu" (needs device_type cpu
            or a CPU backend), "tpu" (needs device_type tpu or PALLAS), "rocm" (needs
            device_type rocm, ROCM_ATTN, or tensors of a ROCm process: :func:`platform_rocm`),
            "rocm?" (excluded only where the platform is known not to be ROCm), "cuda" (an
            NVIDIA-only backend: excluded for device_type other than cuda and where the platform
            is known to be ROCm), "" (any).
        physical_ok: a tensor already permuted to a layout's physical order (the
            caller's ``tensor_order="physical"``) is a reading of this rule: offered for
            every memory-ordered tensor, marked ``order="physical"`` (the core decides,
            :mod:`kvcore.detection`).
        mla: MLA latent (no K/V axis); blocked: blocked-scale records.
        planes: the name of a plane builder (:data:`PLANE_BUILDERS`) for layouts whose
            parts live apart (K and V of different orders, a tiled value region beside its
            scales): each per-layer view (in ``logical`` order) becomes one view per plane,
            and ``layouts`` maps each key to a multi-plane name (``K=...+V=...``).
        requires: ``(hint field, value)`` pairs: a setting vLLM reads at run time that the
            tensors cannot show (``use_ipex``, ``prefill_decode_attention``); the rule is
            out when the hint says otherwise, and two rules that differ only here make
            detection raise AmbiguousLayoutError naming that hint.
        only: family -> the layout keys that family allocates, where it allocates fewer
            than the rule lists (a backend without ``get_kv_cache_stride_order`` has one
            physical order whatever ``get_kv_cache_layout()`` says: 0.26 FlexAttention is
            NHD only, 0.26 ROCm AITER HND only).
        block_sizes: the tensor block sizes (kernel blocks) the backend runs with, where it
            restricts them (0.33 B12X ``get_supported_kernel_block_sizes() == (64, 128)``);
            empty: any.
        head_sizes: the head sizes the backend accepts (``get_supported_head_sizes()``), checked
            where the head size is known (a ``head_size`` hint, or one derived from
            ``num_kv_heads``); empty: any.
    """

    label: str
    eras: tuple[str, ...]
    families: tuple[str, ...]
    rank: int
    logical: tuple[str, ...]
    layouts: dict[str, tuple[str, ...] | str]
    sources: tuple[Source, ...]
    transform: str = ""
    gate: str = "gpu"
    physical_ok: bool = False
    mla: bool = False
    blocked: bool = False
    backends_label: tuple[str, ...] = field(default=())
    requires: tuple[tuple[str, bool], ...] = ()
    planes: str = ""
    only: dict[str, tuple[str, ...]] = field(default_factory=dict)
    block_sizes: tuple[int, ...] = ()
    head_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # an era label that is not an era would silently match nothing
        unknown = [e for e in self.eras if e not in ERAS]
        if unknown:
            raise FormatError(f"vLLM rule {self.label!r}: eras {unknown} are not layout eras {ERAS} (kvcore_vllm.releases)")


def _src(version: str, file: str) -> Source:
    return Source(engine="vllm", version=version, file=file)


def physical_name(order: Sequence[str] | str) -> str:
    """``("NL","TWO","NB",...)`` -> ``NL_X_TWO_NB_...``; ``NL`` inside -> one tensor name; a
    multi-plane name (a plane rule's layout) is itself."""
    if isinstance(order, str):
        return order
    toks = list(order)
    if toks[0] == "NL":
        return "NL_X_" + "_".join(toks[1:])
    return "_".join(toks)
