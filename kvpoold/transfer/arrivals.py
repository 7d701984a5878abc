"""``Arrivals``: the state of a batch of device blocks whose bytes are on their way in."""

from __future__ import annotations

import numpy as np


class Arrivals:
    """Bytes on their way into a batch of device blocks of one layout class.

    ``state[i]`` says how block ``blocks[i]`` stands: ``ARRIVING``, ``OK``,
    ``LOST`` (its copy was missing or its read failed) or ``CORRUPT`` (a bad
    checksum on disk).  The waiters run once, when the last block is settled.
    """

    ARRIVING, OK, LOST, CORRUPT = 0, 1, 2, 3

    __slots__ = ("class_id", "blocks", "state", "left", "waiters", "digests")

    def __init__(self, class_id: int, blocks: np.ndarray) -> None:
        self.class_id = class_id
        self.blocks = np.asarray(blocks, np.int64)
        self.state = np.zeros(len(self.blocks), np.int8)
        self.left = len(self.blocks)
        self.waiters: list = []
        self.digests: dict[int, bytes | None] = {}  # index -> the hash a failed block lost (the daemon's)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def done(self) -> bool:
        return self.left == 0

    @property
    def ok(self) -> bool:
        """Done, and every block arrived."""
        return self.left == 0 and not (self.state != self.OK).any()

    def failed(self) -> np.ndarray:
        """Indices of the blocks whose bytes did not arrive."""
        return np.flatnonzero(self.state >= self.LOST)

    def arriving(self) -> np.ndarray:
        """Indices of the blocks still arriving."""
        return np.flatnonzero(self.state == self.ARRIVING)

    def settle(self, index, state: int) -> None:
        """Blocks ``index`` (indices, a slice or a mask) are settled as ``state``."""
        st = self.state
        n = int(np.count_nonzero(st[index] == self.ARRIVING))
        assert n == len(st[index]), "a block of this batch was settled twice"
        st[index] = state
        self.left -= n
        if n and self.left == 0:
            waiters, self.waiters = self.waiters, []
            for w in waiters:
                w(self)

    def __repr__(self) -> str:
        return (f"Arrivals(class {self.class_id}, {len(self)} blocks, {self.left} arriving, "
                f"{len(self.failed())} failed)")
