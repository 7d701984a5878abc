"""Typed views of the daemon's operator answers (``kvpoolctl`` prints these)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ClassStats:
    class_id: int
    geometry: str
    models: tuple[str, ...]
    block_bytes: int
    capacity_blocks: int
    total_blocks: int
    used_blocks: int
    reserved_blocks: int
    cached_blocks: int
    free_blocks: int
    cow_copies: int
    evictions: int
    prefix_queries: int
    prefix_hits: int
    prefix_query_tokens: int
    prefix_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        """Share of queried prompt tokens found in the prefix cache."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True)
class TierStats:
    tier: str
    capacity_bytes: int
    used_bytes: int
    blocks: int


@dataclass(frozen=True)
class PoolStats:
    backend: str
    version: str
    pool_bytes: int
    chunk_bytes: int
    free_bytes: int
    sequences: int
    clients: int
    uptime_seconds: float
    rpcs: int
    classes: tuple[ClassStats, ...]
    tiers: tuple[TierStats, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        for c, cs in zip(d["classes"], self.classes):
            c["hit_rate"] = cs.hit_rate
        return d


@dataclass(frozen=True)
class ClientInfo:
    session_id: int
    name: str
    pid: int
    model_id: str
    class_id: int
    sequences: int
    reserved_blocks: int
    connected: bool
    attached_seconds: float


@dataclass(frozen=True)
class SequenceInfo:
    seq_id: int
    num_tokens: int
    num_cached_tokens: int
    block_table: tuple[int, ...]
