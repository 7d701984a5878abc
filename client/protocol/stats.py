"""The operator figures, defined once: the daemon's core builds them, the wire carries them, clients read them.

Each dataclass here has a protobuf message with exactly the same field
names (``protos/kvpool.proto``; ``tests/server/test_stats_schema.py`` checks
it): ``ClassStats``, ``TierStats``, ``DeviceStats``, ``ClientInfo``, and
``PoolStats`` as ``StatsReply``.  ``to_message`` and ``from_message`` convert
by field name, so a figure added to both appears everywhere without code.

Only the standard library is imported here: the daemon's core uses these
classes and must not pull in gRPC, numpy or torch.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, fields, is_dataclass


@dataclass(frozen=True, kw_only=True)
class ClassStats:
    """One layout class of one device pool, in blocks."""

    class_id: int
    geometry: str
    models: tuple[str, ...] = ()  # the models attached to the class (the service fills it in)
    block_bytes: int
    capacity_blocks: int  # the id space: what the class could own
    total_blocks: int  # owned now
    used_blocks: int  # held by sequences or reserves
    reserved_blocks: int  # of used: in session reserves
    cached_blocks: int
    free_blocks: int
    cow_copies: int
    evictions: int
    prefix_queries: int
    prefix_hits: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    # tiers, in blocks
    promoted_blocks: int = 0  # prefix hits brought back from a lower tier
    demoted_blocks: int = 0  # cached blocks the device evicted into a lower tier
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swapped_sequences: int = 0  # now
    lost_blocks: int = 0  # promoted or swapped-in blocks whose bytes did not arrive (bad checksum, I/O error)
    # memory, in bytes
    mapped_bytes: int = 0  # the class's slabs now: what the memory backend must back
    released_bytes: int = 0  # slabs given back so far (to other classes, unassigned memory, a shrink)
    reserved_bytes: int = 0  # the class's virtual range (its whole id space); no memory behind it by itself
    remote_hit_blocks: int = 0  # of promoted: prefix hits the remote tier answered
    tenant: str = ""  # who may use the class ("uid 1000", "gid 100"; "" when tenants are not told apart)
    taken_bytes: int = 0  # slabs taken so far (from unassigned memory or from other classes)
    commit_seconds: float = 0.0  # the daemon's time backing the slabs taken (vmm: creating and mapping chunks)
    release_seconds: float = 0.0  # the daemon's time letting go of the slabs released (vmm: unmapping chunks)

    @property
    def hit_rate(self) -> float:
        """Share of queried prompt tokens found in the prefix cache."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True)
class TierStats:
    """One lower tier (host, disk) of one device pool."""

    tier: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    pinned_bytes: int = 0  # held for swapped-out sequences (never evicted)
    blocks_in: int = 0  # placed here: demoted, pushed down from the tier above, swapped out
    blocks_out: int = 0  # taken back to the device: promoted or swapped in
    dropped_blocks: int = 0  # evicted with nowhere lower to go
    corrupt_blocks: int = 0  # failed their checksum on read (disk); dropped, never served
    bytes_written: int = 0  # by the transfer engine, with the seconds its copies took
    write_seconds: float = 0.0
    bytes_read: int = 0
    read_seconds: float = 0.0
    failed_writes: int = 0  # blocks whose write failed (EIO, ENOSPC, ...): the copy was dropped
    failed_reads: int = 0  # blocks whose read failed: not served, the owner recomputes

    @property
    def write_gbps(self) -> float:
        """GB/s of the copies into this tier while they ran."""
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


@dataclass(frozen=True)
class DeviceStats:
    """One device pool: one per GPU of ``--devices``; one on the CPU backend."""

    index: int  # position in --devices
    device: int  # the daemon's CUDA ordinal; -1 on the CPU backend
    bus_id: str  # PCI bus id of the GPU; "" on the CPU backend
    pool_bytes: int
    free_bytes: int  # not owned by any class
    sequences: int
    clients: int  # sessions bound to this pool
    classes: tuple[ClassStats, ...]
    tiers: tuple[TierStats, ...]
    max_pool_bytes: int = 0  # the most the pool may grow to (0: not reported)
    memory: str = ""  # how the memory is made: "shm" (cpu), "vmm" (elastic CUDA), "ipc" (legacy CUDA)
    physical_bytes: int = 0  # memory held now (vmm: chunks created and not yet given back to the GPU)
    draining_bytes: int = 0  # vmm: chunks that left their class, held until every client let go of them
    freed_bytes: int = 0  # vmm: given back to the GPU so far
    free_seconds: float = 0.0  # vmm: the daemon's time giving those chunks back

    @property
    def name(self) -> str:
        return f"cuda:{self.device}" if self.device >= 0 else "cpu"


@dataclass(frozen=True)
class RemoteStats:
    """The remote tier (tier 3: Redis or Valkey shared by several daemons), as this daemon sees it."""

    url: str  # the password redacted
    state: str  # connecting | connected | backoff (not asked until the retry time) | retrying
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    skipped_lookups: int = 0  # not asked: in backoff
    timeouts: int = 0  # lookups past --remote-timeout
    failures: int = 0  # failed round trips
    corrupt_blocks: int = 0  # failed their checksum or layout check: dropped, never served
    blocks_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_dropped: int = 0  # dropped from a full write queue
    write_queue_blocks: int = 0
    fetch_seconds: float = 0.0
    write_seconds: float = 0.0
    last_error: str = ""
    forged_blocks: int = 0  # with --remote-key-file: values whose tag did not verify; dropped, never served

    @property
    def fetch_ms(self) -> float:
        """Mean latency of a lookup that got an answer, in milliseconds."""
        answered = self.lookups - self.timeouts - self.skipped_lookups
        return 1000 * self.fetch_seconds / answered if answered > 0 else 0.0


@dataclass(frozen=True)
class PoolStats:
    """The daemon's figures (``kvpoolctl stats``): totals over its device pools, and each pool."""

    backend: str
    version: str
    pool_bytes: int
    chunk_bytes: int
    free_bytes: int
    sequences: int
    clients: int
    uptime_seconds: float
    rpcs: int
    classes: tuple[ClassStats, ...]  # every pool's, in ``devices`` order
    tiers: tuple[TierStats, ...]
    draining: bool = False  # no new attaches or sequences (kvpoolctl drain)
    devices: tuple[DeviceStats, ...] = ()
    remote: tuple[RemoteStats, ...] = ()  # one entry with a remote tier

    def to_dict(self) -> dict:
        """``asdict`` plus the derived rates (``kvpoolctl stats --json``)."""
        d = asdict(self)
        for out, st in [(d, self)] + list(zip(d["devices"], self.devices)):
            for c, cs in zip(out["classes"], st.classes):
                c["hit_rate"] = cs.hit_rate
            for t, ts in zip(out["tiers"], st.tiers):
                t["write_gbps"], t["read_gbps"] = ts.write_gbps, ts.read_gbps
        return d


@dataclass(frozen=True)
class ClientInfo:
    """One attached session (``kvpoolctl clients``)."""

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


#: the wire message of each schema class (its name in ``protos/kvpool.proto``)
MESSAGE_NAMES = {ClassStats: "ClassStats", TierStats: "TierStats", DeviceStats: "DeviceStats",
                 PoolStats: "StatsReply", ClientInfo: "ClientInfo", RemoteStats: "RemoteStats"}

_item_types: dict[type, dict[str, type | None]] = {}


def _items(cls) -> dict[str, type | None]:
    """Field name -> the schema class of its items (a tuple of nested figures), or None."""
    got = _item_types.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = {}
        for f in fields(cls):
            args = typing.get_args(hints[f.name])
            got[f.name] = args[0] if args and is_dataclass(args[0]) else None
        _item_types[cls] = got
    return got


def to_message(obj, msg):
    """Fill the protobuf message ``msg`` from the schema object ``obj`` field by field; returns ``msg``."""
    for name, item in _items(type(obj)).items():
        value = getattr(obj, name)
        if item is not None:
            repeated = getattr(msg, name)
            for v in value:
                to_message(v, repeated.add())
        elif isinstance(value, tuple):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def from_message(cls, msg):
    """The schema object ``cls`` read from the protobuf message ``msg`` field by field."""
    kw = {}
    for name, item in _items(cls).items():
        value = getattr(msg, name)
        if item is not None:
            value = tuple(from_message(item, v) for v in value)
        elif not isinstance(value, (int, float, str, bool, bytes)):
            value = tuple(value)  # a repeated scalar
        kw[name] = value
    return cls(**kw)


__all__ = ["ClassStats", "TierStats", "DeviceStats", "PoolStats", "RemoteStats", "ClientInfo", "MESSAGE_NAMES",
           "to_message", "from_message"]
