"""kvpool: the client library of kvpoold.

    import kvpool
    layout = kvpool.Layout("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    with kvpool.connect(name="worker-0", layout=layout) as client:
        seq = client.create_sequence(prompt_ids)
        kv = client.kv_cache()          # [num_blocks, layers, 2, kv heads, block_size, head_dim]
        client.extend({seq: [next_id]})  # one call per scheduler step, for the whole batch

The names below are imported on first use (PEP 562): ``kvpool.protocol``,
which the daemon's core imports for the shared figures, must not pull in
gRPC or numpy through this package.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "Client": "client", "ExtendResult": "client", "Sequence": "client", "connect": "client",
    "Connection": "connection", "Layout": "layout",
    "KvpoolError": "errors", "InvalidArgument": "errors", "NotFound": "errors", "OutOfBlocks": "errors",
    "PermissionDenied": "errors", "FailedPrecondition": "errors", "SessionExpired": "errors",
    "Unavailable": "errors", "DaemonError": "errors", "TooManySessions": "errors",
    "TooManyClasses": "errors",
    "ClassStats": "stats", "ClientInfo": "stats", "PoolStats": "stats", "SequenceInfo": "stats",
    "TierStats": "stats",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
