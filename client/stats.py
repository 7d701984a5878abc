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
    # tiers (issue 6), in blocks
    promoted_blocks: int = 0
    demoted_blocks: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swapped_sequences: int = 0
    lost_blocks: int = 0

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
    # tiers (issue 6)
    pinned_bytes: int = 0  # held for swapped-out sequences
    blocks_in: int = 0  # demoted, pushed down or swapped out into this tier
    blocks_out: int = 0  # promoted or swapped in from this tier
    dropped_blocks: int = 0
    corrupt_blocks: int = 0  # failed their checksum: dropped, never served
    bytes_written: int = 0
    write_seconds: float = 0.0
    bytes_read: int = 0
    read_seconds: float = 0.0
    failed_writes: int = 0  # faults (issue 9): writes that failed (EIO, ENOSPC, ...): those copies were dropped
    failed_reads: int = 0  # reads that failed: not served, the owner recomputes

    @property
    def write_gbps(self) -> float:
        """GB/s of the copies into this tier while they ran."""
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


@dataclass(frozen=True)
class DeviceStats:
    """One pool of a daemon serving several GPUs (``--devices 0,1``): one per GPU; one on the CPU backend."""

    index: int  # position in --devices
    device: int  # the daemon's CUDA ordinal; -1 on the CPU backend
    bus_id: str  # PCI bus id of the GPU; "" on the CPU backend
    pool_bytes: int
    free_bytes: int
    sequences: int
    clients: int
    classes: tuple[ClassStats, ...]
    tiers: tuple[TierStats, ...]

    @property
    def name(self) -> str:
        return f"cuda:{self.device}" if self.device >= 0 else "cpu"


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
    draining: bool = False  # no new attaches or sequences (kvpoolctl drain)
    # one per pool (issue 4); ``classes``/``tiers`` above list every pool's, in this order
    devices: tuple[DeviceStats, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        for out, st in [(d, self)] + list(zip(d["devices"], self.devices)):
            for c, cs in zip(out["classes"], st.classes):
                c["hit_rate"] = cs.hit_rate
            for t, ts in zip(out["tiers"], st.tiers):
                t["write_gbps"], t["read_gbps"] = ts.write_gbps, ts.read_gbps
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
    device: str = ""  # the session's pool: "cuda:1 (0000:3B:00.0)" or "cpu"


@dataclass(frozen=True)
class SequenceInfo:
    seq_id: int
    num_tokens: int
    num_cached_tokens: int
    block_table: tuple[int, ...]
