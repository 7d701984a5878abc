"""Immutable results of core calls.

The core owns the page tables; callers get frozen snapshots or deltas, never
a reference to internal state.  The class and tier figures are the shared
operator schema (``kvpool.protocol.stats``, standard library only): the
core fills them in, the service and the clients carry them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.protocol.stats import ClassStats, TierStats


@dataclass(frozen=True)
class PageTable:
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


class ExtendDeltas:
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
        raise AttributeError("ExtendDeltas is immutable")

    @classmethod
    def _adopt(cls, seq_ids, first, counts, blocks) -> "ExtendDeltas":
        """Wrap arrays the caller made for this result alone (no copies: the hot path)."""
        self = object.__new__(cls)
        for name, arr in (("delta_seq_ids", seq_ids), ("delta_first", first),
                          ("delta_counts", counts), ("delta_blocks", blocks)):
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "copies", ())
        return self

    @classmethod
    def from_deltas(cls, deltas, copies=()) -> "ExtendDeltas":
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
        return isinstance(other, ExtendDeltas) and self.deltas == other.deltas and self.copies == other.copies

    def __repr__(self) -> str:
        return f"ExtendDeltas(deltas={self.deltas!r}, copies={self.copies!r})"


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
    remote_tokens: int = 0


@dataclass(frozen=True)
class ManagerStats:
    """One ``KVCacheManager``'s figures; the service turns them into a ``DeviceStats``."""

    pool_bytes: int
    chunk_bytes: int
    free_chunks: int
    sequences: int
    owners: int
    classes: tuple[ClassStats, ...]
    tiers: tuple[TierStats, ...] = field(default=())
    max_pool_bytes: int = 0  # the most ``resize`` may grow the pool to


@dataclass(frozen=True)
class ResizeResult:
    """What ``resize`` did: a shrink that would take held blocks stops short and says so."""

    target_bytes: int  # asked for
    pool_bytes: int  # the pool's size now
    freed_chunks: int  # given back by classes: their memory is released (``drain_slab_changes``)
    evicted_blocks: int  # cached blocks of the slabs given back (demoted to the lower tiers)
    met: bool  # the pool is now ``target_bytes`` (rounded down to whole chunks)
