"""kvcore-vllm: vLLM's KV cache layouts for kvcore (engine name ``"vllm"``).

Modules: :mod:`~kvcore_vllm.rules` (the layouts as data, per era and backend),
:mod:`~kvcore_vllm.hints` (vLLM's vocabulary and the hint precedence),
:mod:`~kvcore_vllm.detect` (the ``kvcore_detect`` hook), :mod:`~kvcore_vllm.specs` (the byte
records vLLM writes, per width), :mod:`~kvcore_vllm.fixtures` (allocation as vLLM does it, per version),
:mod:`~kvcore_vllm.formats` (registration), :mod:`~kvcore_vllm.plugin` (hooks),
:mod:`~kvcore_vllm.engine` (layouts from a running vLLM's own objects: :func:`detect_engine`).

What vLLM allocates, per version and backend, and the kvcore format it is: the table in
``plugins/vllm/README.md``; the facts with vLLM file and function per release:
``plugins/vllm/SOURCES.md``. :mod:`~kvcore_vllm.fixtures` restates vLLM's allocation and
reading code and is the oracle the rules are tested against.
"""

__all__ = ["VllmHints", "allocate", "allocate_dsv32", "kv_view", "blocked_views", "RULES", "detect_engine", "engine_hints", "EngineLayouts"]

_LAZY = {
    "VllmHints": "kvcore_vllm.hints",
    "allocate": "kvcore_vllm.fixtures",
    "allocate_dsv32": "kvcore_vllm.fixtures",
    "kv_view": "kvcore_vllm.fixtures",
    "blocked_views": "kvcore_vllm.fixtures",
    "RULES": "kvcore_vllm.rules",
    "detect_engine": "kvcore_vllm.engine",
    "engine_hints": "kvcore_vllm.engine",
    "EngineLayouts": "kvcore_vllm.engine",
}


def __getattr__(name: str):
    # lazy: loading the plugin (kvcore_vllm.plugin) must stay cheap and import nothing it does not need
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcore_vllm' has no attribute {name!r}")
