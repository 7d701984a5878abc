"""kvpool: the client library of kvpoold.

    import kvpool
    layout = kvpool.Layout("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    with kvpool.connect(name="worker-0", layout=layout) as client:
        seq = client.create_sequence(prompt_ids)
        kv = client.kv_cache()          # [num_blocks, layers, 2, kv heads, block_size, head_dim]
        client.extend({seq: [next_id]})  # one call per scheduler step, for the whole batch
"""

from .client import Client, ExtendResult, Sequence, connect
from .connection import Connection
from .errors import (
    DaemonError,
    FailedPrecondition,
    InvalidArgument,
    KvpoolError,
    NotFound,
    OutOfBlocks,
    PermissionDenied,
    SessionExpired,
    Unavailable,
)
from .layout import Layout
from .stats import ClassStats, ClientInfo, PoolStats, SequenceInfo, TierStats

__all__ = [
    "Client", "ExtendResult", "Sequence", "connect", "Connection", "Layout",
    "KvpoolError", "InvalidArgument", "NotFound", "OutOfBlocks", "PermissionDenied", "FailedPrecondition",
    "SessionExpired", "Unavailable", "DaemonError",
    "ClassStats", "ClientInfo", "PoolStats", "SequenceInfo", "TierStats",
]
