"""The checks LMCache's GPU connectors make on their configuration, connector class and
format (``utils.need_gpu_interm_buffer``, ``assert_*``)."""

from __future__ import annotations

from typing import Any

from kvcore import registry
from kvcore.compat.lmcache.formats import EngineKVFormat, _fmt
from kvcore.errors import FormatError, KVCoreError, TransferError


def need_gpu_interm_buffer(lmcache_config: Any) -> bool:
    """Whether a GPU connector needs an intermediate device buffer: yes unless the config
    enables prefill/decode disaggregation (LMCache ``utils.need_gpu_interm_buffer``).

    Args:
        lmcache_config: LMCache's ``LMCacheEngineConfig`` (anything with ``enable_pd``).
    Raises:
        KVCoreError: the config has no ``enable_pd``.
    """
    if not hasattr(lmcache_config, "enable_pd"):
        raise KVCoreError(
            f"need_gpu_interm_buffer expects LMCache's LMCacheEngineConfig (an object with enable_pd), got {type(lmcache_config).__name__}"
        )
    return not bool(lmcache_config.enable_pd)


#: LMCache's layerwise GPU connector classes (``utils.assert_layerwise_gpu_connector``:
#: ``gpu_connectors``, ``xpu_connectors``, ``musa_connectors``).
LAYERWISE_CONNECTORS = (
    "VLLMPagedMemLayerwiseGPUConnector",
    "VLLMBufferLayerwiseGPUConnector",
    "SGLangLayerwiseGPUConnector",
    "VLLMPagedMemLayerwiseXPUConnector",
    "VLLMBufferLayerwiseXPUConnector",
    "SGLangLayerwiseXPUConnector",
    "SGLangLayerwiseMUSAConnector",
)


def assert_layerwise_gpu_connector(gpu_connector: Any) -> None:
    """Refuse a GPU connector that is not one of LMCache's layerwise connectors (its class
    or a base class is named in :data:`LAYERWISE_CONNECTORS`; LMCache checks ``isinstance``
    against those classes).

    Raises:
        TransferError: not a layerwise connector (LMCache: ``AssertionError``).
    """
    names = {c.__name__ for c in type(gpu_connector).__mro__}
    if not names & set(LAYERWISE_CONNECTORS):
        raise TransferError(
            f"{type(gpu_connector).__name__} is not a layerwise GPU connector; layerwise transfer needs one of "
            f"{', '.join(LAYERWISE_CONNECTORS)}"
        )


#: Per-layer non-MLA vLLM members LMCache's vLLM connectors accept
#: (``utils.assert_is_vllm_flash_attn_or_flash_infer``).
_VLLM_NON_MLA = (
    "NL_X_TWO_NB_BS_NH_HS",
    "NL_X_NB_TWO_BS_NH_HS",
    "NL_X_TWO_NB_NH_BS_HS",
    "NL_X_NB_TWO_NH_BS_HS",
    "NL_X_NB_NH_BS_TWO_HS",
    "NL_X_NB_BS_NH_TWO_HS",
    "NL_X_NB_NH_BS_CS",
    "NL_X_NB_BS_NH_CS",
)
#: ... and the MLA members added by ``assert_is_vllm_mla_or_flash_attn_or_flash_infer``.
_VLLM_MLA = ("NL_X_NB_BS_HS", "NL_X_NB_BSV_BSS")


def _vllm_per_layer(f: EngineKVFormat, mla: bool) -> bool:
    """A per-layer format kvcore's vLLM plugin registers (detection can return it)."""

    try:
        engines = registry.get_format(str(f)).engines
    except FormatError:
        return False
    # vLLM-RBLN's 6-D pages are the RBLN device ops' alone (LMCache's GPU connectors never take member 15)
    return "vllm" in engines and f.syntax.container == "layer_list" and (mla or not f.is_mla) and str(f) != "NL_X_TWO_NB_NH_ONE_BS_HS"


def assert_is_vllm_flash_attn_or_flash_infer(engine_kv_format: Any) -> None:
    """Refuse a format that is not a per-layer non-MLA vLLM layout: LMCache's list (the
    FlashAttention / FlashInfer members, NHD and HND, and the packed K|V members) or a
    per-layer non-MLA format kvcore's vLLM plugin registers.

    Raises:
        FormatError: any other format (LMCache: ``AssertionError``).
    """
    f = _fmt(engine_kv_format)
    if str(f) not in _VLLM_NON_MLA and not _vllm_per_layer(f, mla=False):
        raise FormatError(
            f"{f} is not a per-layer non-MLA vLLM format; expected one of {', '.join(_VLLM_NON_MLA)} (or another vLLM per-layer layout)"
        )


def assert_is_vllm_mla_or_flash_attn_or_flash_infer(engine_kv_format: Any) -> None:
    """Refuse a format that is not a per-layer vLLM layout: LMCache's list (FlashAttention /
    FlashInfer NHD and HND, MLA latents, blocked-scale pages) or a per-layer format kvcore's
    vLLM plugin registers.

    Raises:
        FormatError: any other format (LMCache: ``AssertionError``).
    """
    f = _fmt(engine_kv_format)
    allowed = _VLLM_NON_MLA[:4] + _VLLM_MLA
    if str(f) not in allowed and not _vllm_per_layer(f, mla=True):
        raise FormatError(f"{f} is not a per-layer vLLM format; expected one of {', '.join(allowed)} (or another vLLM per-layer layout)")
