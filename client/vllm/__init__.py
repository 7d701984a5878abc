"""kvpool under vLLM: a KV connector (``KVConnectorBase_V1``) backed by kvpoold.

Selected in vLLM with::

    kv_transfer_config = {
        "kv_connector": "KvpoolConnector",
        "kv_connector_module_path": "kvpool.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvpoold/kvpoold.sock"},
    }

``kvpool.vllm`` itself imports without vLLM: the connector class (which
subclasses vLLM's base) is imported on first use (PEP 562), and the block
layout conversion (``kvpool.vllm.blocks``) needs torch only.
"""

from __future__ import annotations

__all__ = ["KvpoolConnector", "KvpoolConnectorMetadata"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import connector  # imports vLLM

    return getattr(connector, name)
