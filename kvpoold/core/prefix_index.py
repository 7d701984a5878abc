"""The device tier's prefix index of one layout class: block hash <-> block.

A block gets a hash once it is full; the index maps each hash to one block
and back.  A block registered on behalf of a *writer* (the owner that still
has to write its KV) is *unwritten* until that owner confirms it: only the
writer's own prefix hits may use it meanwhile, since its bytes may still be
garbage for everyone else.

Invariants (``check``): the two maps are inverse bijections, and every
unwritten block is hashed.
"""

from __future__ import annotations

from collections import deque
from itertools import filterfalse, repeat
from typing import Iterable

import numpy as np


class PrefixIndex:
    __slots__ = ("_by_hash", "_hash_of", "_unwritten", "on_confirm")

    def __init__(self) -> None:
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._unwritten: dict[int, int] = {}  # block -> the owner that has to write it
        #: called with (blocks, their hashes) whose writer confirmed their KV (the remote tier copies them)
        self.on_confirm = None

    def __len__(self) -> int:
        return len(self._by_hash)

    # -- queries ------------------------------------------------------------------
    def lookup(self, digest: bytes) -> int | None:
        return self._by_hash.get(digest)

    def lookup_many(self, digests: Iterable[bytes], default=None) -> list:
        """The block of each hash, ``default`` where none has it."""
        return list(map(self._by_hash.get, digests, repeat(default)))

    def hit_mask(self, digests: list[bytes]) -> np.ndarray:
        """Whether each hash is on the device (one C-level pass)."""
        return np.fromiter(map(self._by_hash.__contains__, digests), np.bool_, len(digests))

    def digest_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def digests_of(self, blocks: Iterable[int]) -> list[bytes | None]:
        return list(map(self._hash_of.get, blocks))

    def is_hashed(self, block: int) -> bool:
        return block in self._hash_of

    def none_hashed(self, blocks) -> bool:
        return self._hash_of.keys().isdisjoint(blocks)

    def hashed(self, blocks) -> list[int]:
        """The blocks that carry a hash, in order."""
        return list(filter(self._hash_of.__contains__, blocks))

    def unhashed(self, blocks) -> list[int]:
        return list(filterfalse(self._hash_of.__contains__, blocks))

    def visible(self, block: int, owner: int | None) -> bool:
        """Whether ``owner``'s prefix hit may use ``block`` (its KV is written, or it is the writer)."""
        writer = self._unwritten.get(block)
        return writer is None or writer == owner

    def visible_prefix(self, blocks: list, owner: int | None) -> list:
        """The longest prefix of ``blocks`` (None: a lower-tier hit) that ``owner``'s prefix hit may use."""
        unwritten = self._unwritten
        if not unwritten or unwritten.keys().isdisjoint(blocks):
            return blocks
        for i, b in enumerate(blocks):  # another session may still be writing some of them
            if b is not None and not self.visible(b, owner):
                return blocks[:i]
        return blocks

    def unwritten_items(self):
        """(block, writer) of every unwritten block."""
        return self._unwritten.items()

    def blocks(self):
        """Every hashed block."""
        return self._hash_of.keys()

    def digest_items(self):
        """(hash, block) of every entry."""
        return self._by_hash.items()

    # -- changes ------------------------------------------------------------------
    def register(self, block: int, digest: bytes, writer: int | None = None) -> bool:
        """Give ``block`` its hash unless another block has it already.

        ``writer``: the owner who still has to write the block's KV; until it
        confirms (``confirm``), only that owner's prefix hits see the block.
        """
        if digest in self._by_hash:
            return False
        self._by_hash[digest] = block
        self._hash_of[block] = digest
        if writer is not None:
            self._unwritten[block] = writer
        return True

    def register_many(self, blocks: list[int], digests: list[bytes], writer: int | None = None) -> list[int]:
        """``register`` of each (block, hash) pair, in order; returns the blocks that got their hash."""
        by_hash = self._by_hash
        if not by_hash.keys().isdisjoint(digests):
            return [b for b, h in zip(blocks, digests) if self.register(b, h, writer)]
        before = len(by_hash)
        by_hash.update(zip(digests, blocks))
        if len(by_hash) != before + len(digests):  # a hash twice in the batch (no set built to find out)
            deque(map(by_hash.pop, digests, repeat(None)), 0)  # every one was new: undo, then key by key
            return [b for b, h in zip(blocks, digests) if self.register(b, h, writer)]
        self._hash_of.update(zip(blocks, digests))
        if writer is not None:
            self._unwritten.update(dict.fromkeys(blocks, writer))
        return blocks

    def confirm(self, blocks: Iterable[int], writer: int) -> None:
        """``writer`` says the KV of these blocks is written: every prefix hit may use them."""
        unwritten = self._unwritten
        if not unwritten:
            return
        if not isinstance(blocks, list):
            blocks = list(blocks)
        if list(map(unwritten.get, blocks)).count(writer) == len(blocks):
            deque(map(unwritten.pop, blocks, repeat(None)), 0)  # the common case (all the writer's), in C
            done = blocks
        else:
            done = list(dict.fromkeys(b for b in blocks if unwritten.get(b) == writer))
            deque(map(unwritten.__delitem__, done), 0)
        if self.on_confirm is not None and done:
            self.on_confirm(done, list(map(self._hash_of.__getitem__, done)))

    def forget_unwritten(self, blocks: Iterable[int], writer: int) -> None:
        """``writer`` is gone without confirming: its blocks' KV may be garbage, so drop their hashes."""
        unwritten = self._unwritten
        for b in blocks:
            if unwritten.get(b) == writer:
                del unwritten[b]
                del self._by_hash[self._hash_of.pop(b)]

    def forget(self, block: int) -> bytes | None:
        """Drop ``block``'s hash (its bytes are lost); returns it."""
        digest = self._hash_of.pop(block, None)
        if digest is not None:
            del self._by_hash[digest]
            self._unwritten.pop(block, None)
        return digest

    def forget_many(self, blocks: list[int]) -> list[bytes]:
        """Drop the hashes of hashed blocks (evicted ones); returns them in order."""
        digests = list(map(self._hash_of.pop, blocks))
        deque(map(self._by_hash.__delitem__, digests), 0)
        if self._unwritten:
            for b in blocks:
                self._unwritten.pop(b, None)
        return digests

    # -- invariants -----------------------------------------------------------------
    def check(self) -> None:
        assert len(self._by_hash) == len(self._hash_of), "hash -> block and block -> hash differ in size"
        assert all(self._hash_of.get(b) == h for h, b in self._by_hash.items()), "the two maps disagree"
        assert self._unwritten.keys() <= self._hash_of.keys(), "an unwritten block without a hash"
