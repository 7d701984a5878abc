"""Immutable results of core calls.

The core owns the page tables; callers get frozen snapshots or deltas, never
a reference to internal state.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SequenceInfo:
    """A sequence's whole page table."""

    seq_id: int
    class_id: int
    block_table: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class SeqDelta:
    """What one extend changed: ``block_table[first:first+len(blocks)] = blocks``.

    ``first`` is before the old end when copy-on-write replaced the shared
    last block by a private copy.
    """

    seq_id: int
    first: int
    blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``src`` to ``dst`` in class ``class_id`` before writing into ``dst``."""

    class_id: int
    src: int
    dst: int


@dataclass(frozen=True)
class ExtendResult:
    deltas: tuple[SeqDelta, ...]
    copies: tuple[BlockCopy, ...] = ()


@dataclass(frozen=True)
class ExtendItem:
    """Tokens appended to one sequence.

    ``claimed``: blocks the session took from its reserve for these tokens,
    in order (the client's local fast path).  They fill the first new block
    positions; the daemon allocates any further ones.
    """

    seq_id: int
    tokens: object
    claimed: tuple[int, ...] = ()


@dataclass(frozen=True)
class LookupResult:
    """Longest cached prefix of a token list, in tokens, and where it lives."""

    num_cached_tokens: int
    device_tokens: int
    host_tokens: int = 0
    disk_tokens: int = 0


@dataclass(frozen=True)
class ClassStats:
    class_id: int
    geometry: str
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


@dataclass(frozen=True)
class TierStats:
    tier: str
    capacity_bytes: int
    used_bytes: int
    blocks: int


@dataclass(frozen=True)
class PoolStats:
    pool_bytes: int
    chunk_bytes: int
    free_chunks: int
    sequences: int
    owners: int
    classes: tuple[ClassStats, ...]
    tiers: tuple[TierStats, ...] = field(default=())
