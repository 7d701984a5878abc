"""Device blocks whose bytes are still arriving from a lower tier, batch by batch.

The transfer engine returns one ``Arrivals`` batch per layout class for the
promotions and swap-ins a call started (``Tiers.sync``).  Each batch's blocks
still arriving get a transfer hold in the core (nothing reuses them meanwhile)
and are marked in a per-class array (block -> batch serial) until the batch
is done: one completion per batch, and the batch's per-block state answers
"which blocks are still arriving".  A block whose bytes failed to arrive (a
bad checksum on disk, an I/O error) loses its hash in the core, so no prefix
hit finds it again.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np

from kvpoold.core import KVCacheManager
from kvpoold.transfer import Arrivals

log = logging.getLogger("kvpoold")


class InFlight:
    """One pool's batches in flight: the blocks they hold, and which batch each block waits on."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        #: per class: block -> the serial of the batch its bytes are arriving in (-1: none)
        self.batch_of: dict[int, np.ndarray] = {}
        self.batches: dict[int, tuple[Arrivals, np.ndarray, np.ndarray]] = {}  # serial -> (batch, held, sorter)
        self._serial = 0

    def add_class(self, class_id: int, num_blocks: int) -> None:
        self.batch_of[class_id] = np.full(num_blocks, -1, np.int64)

    def remove_class(self, class_id: int) -> None:
        self.batch_of.pop(class_id, None)

    def start(self, a: Arrivals) -> None:
        """A batch started: hold its blocks still arriving until it is done."""
        self.fail_new(a)  # blocks whose copy was missing fail at once
        if a.done:
            return
        held = a.blocks[a.arriving()]
        serial = self._serial
        self._serial += 1
        self.batches[serial] = (a, held, np.argsort(a.blocks, kind="stable"))
        self.batch_of[a.class_id][held] = serial
        self.manager.hold_blocks(a.class_id, held.tolist())
        a.waiters.append(partial(self._arrived, serial))

    def _arrived(self, serial: int, a: Arrivals) -> None:
        _, held, _ = self.batches.pop(serial)
        self.batch_of[a.class_id][held] = -1
        self.fail_new(a)
        self.manager.release_holds(a.class_id, held.tolist())

    def fail_new(self, a: Arrivals) -> None:
        """Forget the hashes of the batch's failed blocks not handled yet (their owners recompute them)."""
        for i in a.failed().tolist():
            if i not in a.digests:
                self.fail_block(a, i)

    def fail_block(self, a: Arrivals, i: int) -> None:
        """Block ``i`` of the batch did not arrive: the core forgets its hash, kept in ``a.digests``."""
        block = int(a.blocks[i])
        log.warning("tiers: the bytes of block %d (class %d) did not arrive (%s): its owners recompute it",
                    block, a.class_id, "bad checksum" if a.state[i] == Arrivals.CORRUPT else "lost")
        a.digests[i] = self.manager.invalidate_block(a.class_id, block)

    # -- lookups -------------------------------------------------------------------------------------
    def parts(self, class_id: int, table: np.ndarray, positions: np.ndarray) -> list:
        """(positions, batch, indices in it) of the batches in flight that ``table[positions]`` wait on."""
        batch_of = self.batch_of.get(class_id)
        if batch_of is None:
            return []
        parts = []
        serials = batch_of[table[positions]]
        inflight = serials >= 0
        positions, serials = positions[inflight], serials[inflight]
        for s in np.unique(serials).tolist():
            a, _, order = self.batches[s]
            p = positions[serials == s]
            index = order[np.searchsorted(a.blocks[order], table[p])]
            parts.append((p, a, index))
        return parts

    def batches_of(self, class_id: int, block_table) -> list[Arrivals]:
        """The batches in flight that any block of ``block_table`` waits on."""
        batch_of = self.batch_of.get(class_id)
        if batch_of is None or not block_table:
            return []
        serials = np.unique(batch_of[np.asarray(block_table, np.int64)])
        return [self.batches[s][0] for s in serials.tolist() if s >= 0]


__all__ = ["InFlight"]
