"""Which layout a backend family allocates under the layout hints: ``kv_cache_layout``,
``VLLM_KV_CACHE_LAYOUT`` (per era, only the families that read it), XPU's forced NHD and
FlashInfer's HND override."""

from __future__ import annotations

from kvcore_vllm.hints import KV_CACHE_LAYOUTS, LAYOUT_ALIASES, LAYOUT_FAMILY, VllmHints
from kvcore_vllm.releases import LAYOUT_ERA
from kvcore_vllm.rules.rule import Rule

#: per era, the backend families whose allocation reads ``get_kv_cache_layout()`` (their
#: ``get_kv_cache_stride_order``): the ones ``VLLM_KV_CACHE_LAYOUT`` steers. 0.11 / 0.13
#: ``flash_attn.py`` and ``flashinfer.py``; 0.24 - 0.28 also ``triton_attn.py``. FlexAttention
#: (fixed order from 0.24, none before), ROCm AITER / ROCM_ATTN, TORCH_SDPA, Pallas and the MLA
#: backends (one latent order) ignore it; 0.24 - 0.28 CPU_ATTN's ``get_required_kv_cache_layout()``
#: is ``"HND"``, which the selector sets over the variable (``v1/attention/selector.py``). From
#: 0.29 every backend is steered: ``resolve_kv_cache_layout`` (``v1/attention/backends/utils.py``)
#: uses the variable or refuses to start when a backend does not support it.
LAYOUT_READERS: dict[str, tuple[str, ...]] = {
    "0.11": ("FLASH_ATTN", "FLASHINFER"),
    "0.13": ("FLASH_ATTN", "FLASHINFER"),
    "0.24": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"),
    "0.26": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"),
}
#: families whose layout vLLM overrides on some GPUs whatever the variable says: FlashInfer on
#: SM 10.x is HND (0.11 ``platforms/cuda.py`` ``set_kv_cache_layout("HND")``; 0.13-0.28
#: ``FlashInferBackend.get_required_kv_cache_layout``): ``VLLM_KV_CACHE_LAYOUT=NHD`` does not rule
#: its HND cache out.
LAYOUT_OVERRIDES: dict[str, str] = {"FLASHINFER": "HND"}
#: eras whose XPU platform forces NHD (``platforms/xpu.py`` ``set_kv_cache_layout("NHD")`` in
#: 0.11, 0.13 and 0.24 - 0.25; 0.26 and later no longer call it).
XPU_FORCES_NHD = ("0.11", "0.13", "0.24")


def _key_fits(key: str, value: str) -> bool:
    """A rule's layout key (``NHD``, ``HND/cross``, ``*``, a 0.29+ member...) is what the layout
    value ``value`` (``NHD``/``HND`` or a 0.29+ ``KVCacheLayout`` member) names."""
    fam = value if value in LAYOUT_ALIASES else LAYOUT_FAMILY[value]
    specific = value in KV_CACHE_LAYOUTS
    base, _, cross = key.partition("/")
    cross_key = cross == "cross"
    if base == "*":
        return not specific or (value[0] == "B") == cross_key
    if base in KV_CACHE_LAYOUTS:
        if specific:
            return base == value
        return LAYOUT_FAMILY[base] == fam
    if base != fam:
        return False
    return not specific or (value[0] == "B") == cross_key


def _rule_families(rule: Rule, key: str, h: VllmHints) -> tuple[str, ...]:
    """The rule's backend families that allocate layout ``key`` (``Rule.only``), narrowed to
    the ``attention_backend`` hint's family."""
    return tuple(f for f in rule.families if (h.family is None or f == h.family) and key in rule.only.get(f, (key,)))


def layout_families(rule: Rule, key: str, h: VllmHints, layout_source: str = "kv_cache_layout") -> tuple[tuple[str, ...], dict[str, str]]:
    """Which of the rule's families may have allocated layout ``key`` given the layout hints,
    and, when none may, the hint that rules it out (``{hint: value}``, for the contradiction
    message).

    Precedence: an explicit layout (``kv_cache_layout``, ``cache_config``) states the cache's
    layout and binds every family; XPU in 0.11-0.24 forces NHD (:data:`XPU_FORCES_NHD`); the
    environment's ``VLLM_KV_CACHE_LAYOUT`` binds only the families that read
    ``get_kv_cache_layout()`` in that era (:data:`LAYOUT_READERS`), and not FlashInfer's HND
    override (:data:`LAYOUT_OVERRIDES`).
    """
    fams = _rule_families(rule, key, h)
    if not fams:
        return (), {}
    if h.kv_cache_layout is not None:
        return (fams, {}) if _key_fits(key, h.kv_cache_layout) else ((), {layout_source: h.kv_cache_layout})
    eras = (h.era,) if h.era is not None else rule.eras
    if h.device_type == "xpu" and all(e in XPU_FORCES_NHD for e in eras):
        return (fams, {}) if _key_fits(key, "NHD") else ((), {"device_type": "xpu (forces NHD in vLLM 0.11-0.24)"})
    env = h.env_kv_cache_layout
    if env is None:
        return fams, {}
    out = []
    for f in fams:
        steered = any(e == LAYOUT_ERA or f in LAYOUT_READERS.get(e, ()) for e in eras)
        if not steered or _key_fits(key, env) or (f in LAYOUT_OVERRIDES and _key_fits(key, LAYOUT_OVERRIDES[f])):
            out.append(f)
    return tuple(out), ({} if out else {"VLLM_KV_CACHE_LAYOUT": env})
