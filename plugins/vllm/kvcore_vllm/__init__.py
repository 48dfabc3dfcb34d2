"""kvcore-vllm: vLLM's KV cache layouts for kvcore (engine name ``"vllm"``).

Modules: :mod:`~kvcore_vllm.rules` (the layouts as data, per era and backend),
:mod:`~kvcore_vllm.hints` (vLLM's vocabulary and the hint precedence),
:mod:`~kvcore_vllm.detect` (the ``kvcore_detect`` hook), :mod:`~kvcore_vllm.specs` (the two
exotic layouts), :mod:`~kvcore_vllm.fixtures` (allocation as vLLM does it, per version),
:mod:`~kvcore_vllm.formats` (registration), :mod:`~kvcore_vllm.plugin` (hooks).

What vLLM allocates, and the kvcore format it is (the name is the physical order; facts
from ``../shared/reference/engine_layouts.md`` §1, sources on every registered format):

=======  ============================  =============  =========================
version  backend                       layout         kvcore format
=======  ============================  =============  =========================
0.11     FLASH_ATTN, FLEX, XPU          NHD            NL_X_TWO_NB_BS_NH_HS
0.11     FLASH_ATTN                     HND            NL_X_TWO_NB_NH_BS_HS
0.11     FLASHINFER, TRITON_ATTN        NHD            NL_X_NB_TWO_BS_NH_HS
0.11     FLASHINFER                     HND            NL_X_NB_TWO_NH_BS_HS
0.11     FLASH_ATTN beside Mamba        NHD / HND      NL_X_NB_TWO_BS_NH_HS / NL_X_NB_TWO_NH_BS_HS
0.11     ROCM_ATTN (split_kv_cache)     -              NL_X_TWO_NB_NH_HS_BS (K in 16-byte chunks)
0.11+    MLA backends (576; fp8_ds_mla  -              NL_X_NB_BS_HS
         656 and nvfp4_ds_mla 352
         uint8 per-token records)
0.11+    DSv3.2 indexer 132 uint8,      -              NL_X_NB_BSV_BSS
         DSv4 fp8_ds_mla 584/528 pages
0.11     TORCH_SDPA (CPU)               -              NL_X_TWO_NB_NH_HS_BS (K in 16-byte chunks)
0.11     PALLAS (TPU)                   -              NL_X_NB_BS_NH_TWO_HS
0.13     FLASH_ATTN / FLASHINFER        NHD cross      NB_NL_TWO_BS_NH_HS
0.13     FLASH_ATTN                     HND cross      NB_NH_NL_TWO_BS_HS
0.13     FLASHINFER                     HND cross      NB_TWO_NH_NL_BS_HS
0.13     CPU_ATTN                       -              NL_X_TWO_NB_NH_BS_HS
0.24     FLASH_ATTN, FLASHINFER, TRITON NHD / HND      NL_X_NB_TWO_BS_NH_HS / NL_X_NB_TWO_NH_BS_HS
0.24     FLASH_ATTN                     NHD/HND cross  NB_NL_TWO_BS_NH_HS / NB_NH_NL_TWO_BS_HS
0.24     FLEX_ATTENTION                 -              NL_X_NB_BS_TWO_NH_HS
0.24-26  CPU_ATTN                       HND            NL_X_NB_NH_BS_CS
0.26     GPU backends                   NHD / HND      NL_X_NB_BS_NH_CS / NL_X_NB_NH_BS_CS
0.26     FLASH_ATTN                     NHD cross      NB_NL_BS_NH_CS
0.33     GPU backends                   LBNHC (NHD)    NL_X_NB_BS_NH_CS
0.33     GPU backends                   LBHNC (HND)    NL_X_NB_NH_BS_CS
0.33     GPU backends                   LHBNC          NL_X_NH_NB_BS_CS
0.33     GPU backends                   BLHNC          NB_NL_NH_BS_CS
0.33     GPU backends                   BLNHC          NB_NL_BS_NH_CS
0.33     GPU backends                   BHLNC          NB_NH_NL_BS_CS
0.33     MLA backends                   LB* / B*       NL_X_NB_BS_HS / NB_NL_BS_HS
0.33     CPU_ATTN                       LBHNC          NL_X_NB_NH_TWO_BS_HS
0.33     ROCM_ATTN (K/V head slots)     LBHNC / LHBNC  NL_X_NB_TWO_BS_NH_HS / NL_X_TWO_NB_BS_NH_HS
=======  ============================  =============  =========================
"""

__all__ = ["VllmHints", "allocate", "kv_view", "blocked_views", "RULES"]

_LAZY = {
    "VllmHints": "kvcore_vllm.hints",
    "allocate": "kvcore_vllm.fixtures",
    "kv_view": "kvcore_vllm.fixtures",
    "blocked_views": "kvcore_vllm.fixtures",
    "RULES": "kvcore_vllm.rules",
}


def __getattr__(name: str):
    # lazy: loading the plugin (kvcore_vllm.plugin) must stay cheap and import nothing it does not need
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcore_vllm' has no attribute {name!r}")
