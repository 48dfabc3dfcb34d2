"""A vLLM KV connector on kvcore: CPU KV offloading that restores every request exactly.

``kv_transfer_config={"kv_connector": "KvcoreConnector", "kv_connector_module_path":
"kvcore_vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}``
(``plugins/vllm/README.md`` has the ``vllm serve`` line and every key).

Modules, one job each: :mod:`.config` (keys, the store's size), :mod:`.keys` (chunk keys as
vLLM's prefix cache keys blocks), :mod:`.index` (what the store holds: slots, LRU),
:mod:`.plan` (what a step does: plain data in vLLM's connector metadata),
:mod:`.scheduler` (the scheduler side), :mod:`.arena` (the store's memory),
:mod:`.worker` (loads and saves with :func:`kvcore.scatter` / :func:`kvcore.gather`),
:mod:`.connector` (vLLM's ``KVConnectorBase_V1``). Only :mod:`.connector` imports vLLM; it
is loaded when vLLM asks for ``KvcoreConnector``.
"""

__all__ = [
    "KvcoreConnector",
    "KvcoreConnectorMetadata",
    "KvcoreWorkerMetadata",
    "KvcoreConnectorStats",
    "ConnectorConfig",
    "ConnectorConfigError",
]

_LAZY = {
    "KvcoreConnector": "kvcore_vllm.connector.connector",
    "KvcoreConnectorMetadata": "kvcore_vllm.connector.connector",
    "KvcoreWorkerMetadata": "kvcore_vllm.connector.connector",
    "KvcoreConnectorStats": "kvcore_vllm.connector.connector",
    "ConnectorConfig": "kvcore_vllm.connector.config",
    "ConnectorConfigError": "kvcore_vllm.connector.config",
}


def __getattr__(name: str):
    # vLLM is imported only when vLLM itself asks for the connector class
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcore_vllm.connector' has no attribute {name!r}")
