"""What happens to device blocks that others follow: evictions demote, confirmations are journaled.

A class's pool reports a batch of evicted blocks, and its prefix index a batch
of confirmed ones (their writer's KV is written); this part turns them into
tier moves (demotions, write-through copies to the remote tier) and into the
journal the daemon drains for KV events.
"""

from __future__ import annotations

from itertools import repeat

from .block_pool import LayoutClass
from .state import Counters
from .tiers import MovePlan, Tier, TierPlacement


class PoolEvents:
    """The journal of device blocks stored and removed, and the moves evictions and confirmations plan."""

    def __init__(self, placement: TierPlacement, moves: MovePlan, *, remote_write: str, journal: bool,
                 track_moves: bool) -> None:
        self._placement = placement
        self._moves = moves
        #: "" (no remote tier), "through" (every confirmed block is copied there) or "evict" (blocks
        #: leaving the last local tier go there)
        self.remote_write = remote_write
        #: (kind, tier, class id, hashes) of what the plan does not say: device blocks stored (confirmed)
        #: and removed (evicted); drained with ``drain_journal`` (KV events).  None: not kept.
        self._journal: list | None = [] if journal else None
        #: whether blocks leaving the device go anywhere (a lower tier, or the remote one on eviction)
        self.track_moves = track_moves

    @property
    def follows_confirmations(self) -> bool:
        """Whether a confirmation does anything here (else a class's index need not report them)."""
        return self.remote_write == "through" or self._journal is not None

    def confirmed(self, pool: LayoutClass, blocks: list[int], digests: list[bytes]) -> None:
        """Blocks whose writer confirmed their KV: journaled, and copied to the remote tier (``through``)."""
        if self._journal is not None:
            self._journal.append(("stored", Tier.DEVICE, pool.class_id, digests))
        if self.remote_write == "through":
            keys = list(zip(repeat(pool.class_id), digests))
            self._moves.add_many(keys, Tier.DEVICE, Tier.REMOTE, blocks, pool.block_bytes)

    def evicted(self, pool: LayoutClass, counters: Counters, blocks: list[int], digests: list[bytes]) -> None:
        """A batch of cached blocks was evicted, oldest first: demote them (one plan for the batch)."""
        if self._journal is not None:
            self._journal.append(("removed", Tier.DEVICE, pool.class_id, digests))
        if self.track_moves:
            keys = list(zip(repeat(pool.class_id), digests))
            counters.demoted_blocks += self._placement.demote_many(self._moves, keys, pool.block_bytes, blocks)

    def drain_journal(self) -> list:
        """(kind, tier, class id, hashes) since the last call: device blocks "stored" and "removed"."""
        if not self._journal:
            return []
        out, self._journal = self._journal, []
        return out
