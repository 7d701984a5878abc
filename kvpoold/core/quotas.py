"""What owners hold, in blocks and bytes: the queries the daemon's quotas ask before a call (read only)."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kvpool.protocol.sizes import cdiv

from .seq_table import SeqTable
from .state import Owners


class Quotas:
    """Device blocks and bytes that owners' page tables and reserves take, and what a call would add."""

    def __init__(self, registry, seqs: SeqTable, owners: Owners) -> None:
        self._registry = registry  # ``classes.ClassRegistry``
        self._seqs = seqs
        self._owners = owners

    def block_size(self, class_id: int) -> int:
        """Tokens per block of a layout class."""
        return self._registry.pool(class_id).block_size

    def held_device_blocks(self, owner: int) -> int:
        """Device blocks in ``owner``'s page tables (ceil(tokens / block size) per sequence).

        A block two of its sequences share counts twice; swapped-out sequences hold none.
        """
        t = self._seqs
        mine = t.owner == owner
        if t.nswapped:
            mine &= ~t.swapped
        if not mine.any():
            return 0
        return int(cdiv(t.ntok[mine], self._registry.block_size[t.cls[mine]]).sum())

    def held_bytes(self, owners: Iterable[int]) -> int:
        """Device bytes ``owners`` hold: their page tables' blocks (as ``held_device_blocks``) and reserves."""
        owners = list(owners)
        if not owners:
            return 0
        t = self._seqs
        mine = t.owner == owners[0]  # a few compares beat np.isin's sort for the few sessions of a user
        for owner in owners[1:]:
            mine |= t.owner == owner
        if t.nswapped:
            mine &= ~t.swapped
        slots = np.flatnonzero(mine)
        held = 0
        if len(slots):
            cls = t.cls[slots]
            block_bytes = np.fromiter((getattr(c, "block_bytes", 0) for c in self._registry.classes), np.int64,
                                      len(self._registry.classes))  # a vacant class has none (and no sequence)
            held = int((cdiv(t.ntok[slots], self._registry.block_size[cls]) * block_bytes[cls]).sum())
        for owner in owners:
            state = self._owners.get(owner)
            if state is not None:
                held += sum(len(r) * self._registry.classes[c].block_bytes for c, r in state.reserves.items())
        return held

    def device_blocks_of(self, owner: int, seq_ids: Iterable[int]) -> int:
        """Device blocks the sequences' tokens fill (what a swap-in brings back, what a free gives back)."""
        slots = [self._seqs.slot_of(owner, i) for i in seq_ids]
        if not slots:
            return 0
        t = self._seqs
        return int(cdiv(t.ntok[slots], self._registry.block_size[t.cls[slots]]).sum())
