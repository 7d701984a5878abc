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
    swapped: bool = False  # swapped out: the table is empty until swap-in


@dataclass(frozen=True)
class SeqDelta:
    """What one extend changed: ``block_table[first:] = blocks``.

    ``first`` is before the old end when copy-on-write replaced the shared
    last block by a private copy.
    """

    seq_id: int
    first: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``src`` to ``dst`` in class ``class_id`` before writing into ``dst``."""

    class_id: int
    src: int
    dst: int


class ExtendResult:
    """What an extend changed, as columns (the wire's form) with a per-sequence view.

    Sequence ``delta_seq_ids[i]`` has ``block_table[delta_first[i]:]`` replaced
    by its ``delta_counts[i]`` ids in ``delta_blocks``; only sequences whose
    table changed appear.  ``copies`` must run before the new tokens' KV is
    written.  Immutable: the arrays are read-only.
    """

    __slots__ = ("delta_seq_ids", "delta_first", "delta_counts", "delta_blocks", "copies")

    def __init__(self, seq_ids=(), first=(), counts=(), blocks=(), copies: tuple[BlockCopy, ...] = ()) -> None:
        import numpy as np

        for name, values, dtype in (("delta_seq_ids", seq_ids, np.int64), ("delta_first", first, np.int32),
                                    ("delta_counts", counts, np.int32), ("delta_blocks", blocks, np.int32)):
            arr = np.array(values, dtype)  # a private copy
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "copies", tuple(copies))

    def __setattr__(self, name, value):
        raise AttributeError("ExtendResult is immutable")

    @classmethod
    def _adopt(cls, seq_ids, first, counts, blocks) -> "ExtendResult":
        """Wrap arrays the caller made for this result alone (no copies: the hot path)."""
        self = object.__new__(cls)
        for name, arr in (("delta_seq_ids", seq_ids), ("delta_first", first),
                          ("delta_counts", counts), ("delta_blocks", blocks)):
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "copies", ())
        return self

    @classmethod
    def from_deltas(cls, deltas, copies=()) -> "ExtendResult":
        return cls([d.seq_id for d in deltas], [d.first for d in deltas], [len(d.blocks) for d in deltas],
                   [b for d in deltas for b in d.blocks], copies)

    @property
    def deltas(self) -> tuple[SeqDelta, ...]:
        """Per-sequence view (builds objects: for tests and tools, not the hot path)."""
        out, pos = [], 0
        blocks = self.delta_blocks.tolist()
        for sid, first, n in zip(self.delta_seq_ids.tolist(), self.delta_first.tolist(), self.delta_counts.tolist()):
            out.append(SeqDelta(sid, first, tuple(blocks[pos:pos + n])))
            pos += n
        return tuple(out)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExtendResult) and self.deltas == other.deltas and self.copies == other.copies

    def __repr__(self) -> str:
        return f"ExtendResult(deltas={self.deltas!r}, copies={self.copies!r})"


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
    # tiers (issue 6), in blocks
    promoted_blocks: int = 0  # prefix hits brought back from a lower tier
    demoted_blocks: int = 0  # cached blocks the device evicted into a lower tier
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swapped_sequences: int = 0  # now
    lost_blocks: int = 0  # promoted or swapped-in blocks whose bytes did not arrive (bad checksum, I/O error)


@dataclass(frozen=True)
class TierStats:
    tier: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    # tiers (issue 6)
    pinned_bytes: int = 0  # held for swapped-out sequences (never evicted)
    blocks_in: int = 0  # placed here: demoted, pushed down from the tier above, swapped out
    blocks_out: int = 0  # taken back to the device: promoted or swapped in
    dropped_blocks: int = 0  # evicted with nowhere lower to go
    corrupt_blocks: int = 0  # failed their checksum on read (disk); dropped, never served
    bytes_written: int = 0  # by the transfer engine, with the seconds its copies took
    write_seconds: float = 0.0
    bytes_read: int = 0
    read_seconds: float = 0.0
    failed_writes: int = 0  # faults (issue 9): blocks whose write failed (the copy was dropped)
    failed_reads: int = 0  # blocks whose read failed (not served; the owner recomputes)


@dataclass(frozen=True)
class PoolStats:
    pool_bytes: int
    chunk_bytes: int
    free_chunks: int
    sequences: int
    owners: int
    classes: tuple[ClassStats, ...]
    tiers: tuple[TierStats, ...] = field(default=())
