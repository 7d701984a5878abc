"""Typed views of the daemon's operator answers (``kvpoolctl`` prints these).

The figures (``PoolStats`` and what it holds, ``ClientInfo``) are the one
schema both sides share, ``kvpool.protocol.stats``; ``SequenceInfo`` is the
client's view of one sequence's page table.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol.stats import ClassStats, ClientInfo, DeviceStats, PoolStats, TierStats


@dataclass(frozen=True)
class SequenceInfo:
    seq_id: int
    num_tokens: int
    num_cached_tokens: int
    block_table: tuple[int, ...]


__all__ = ["ClassStats", "ClientInfo", "DeviceStats", "PoolStats", "SequenceInfo", "TierStats"]
