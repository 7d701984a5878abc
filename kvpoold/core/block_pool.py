"""Block ids of one layout class, and the chunk budget the classes share.

Memory is counted in *chunks* (2 MiB by default, the CUDA VMM granularity).
A class owns *slabs* of ``slab_chunks`` chunks; slab slot ``s`` of a class
holds block ids ``[s*bps, (s+1)*bps)``, so a class's ids form one uniform
array (one base, one stride for kernels) and memory flows between classes a
slab at a time, without a static split.

Inside a class every block id of an owned slab is in exactly one state:

* **free**: on the free stack (no hash, nobody holds it);
* **cached**: nobody holds it but it carries a hash; kept in eviction order
  and reused on a prefix hit until its memory is needed;
* **held**: by ``1 + extra[b]`` holders (page-table entries and reserves).

Allocation pops the free stack (C-level slice), release pushes it back; both
are O(1) per block with no scan.  Only giving slabs back to another class
looks at the class's free list, and that happens rarely and in bulk.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import filterfalse
from typing import Callable, Iterable

import numpy as np

from kvpool.protocol.sizes import cdiv

from .errors import LayoutDoesNotFit, OutOfBlocks
from .layout import Geometry
from .policy import make_policy
from .prefix_index import PrefixIndex

DEFAULT_CHUNK_BYTES = 2 << 20


def choose_slab_chunks(
    block_bytes: int, chunk_bytes: int, total_chunks: int, limit_chunks: int | None = None, exact: bool = False
) -> int:
    """Chunks per slab: the fewest that hold a block with at most 1/32 waste.

    Args:
        block_bytes: size of one block.
        chunk_bytes: the pool's allocation granularity.
        total_chunks: the pool's size now; the search for little waste stays within it.
        limit_chunks: the most the pool may grow to (default ``total_chunks``); a slab must fit it.
        exact: a whole number of blocks per slab, no waste at all (the smallest such slab), so that
            every slab starts on a chunk boundary (CUDA VMM maps slabs chunk by chunk).

    Returns:
        The slab size in chunks.
    """
    limit = total_chunks if limit_chunks is None else limit_chunks
    if exact:
        k = block_bytes // math.gcd(block_bytes, chunk_bytes)
        if k > limit:
            raise LayoutDoesNotFit(
                f"a block of {block_bytes} bytes needs slabs of {k} chunks ({k * chunk_bytes} bytes) to fill "
                f"them exactly, but the pool may hold only {limit * chunk_bytes} bytes"
            )
        return k
    k_min = cdiv(block_bytes, chunk_bytes)
    if k_min > limit:
        raise LayoutDoesNotFit(
            f"one block needs {block_bytes} bytes but the pool has only {limit * chunk_bytes}"
        )
    best, best_waste = k_min, 1.0
    for k in range(k_min, max(k_min, min(total_chunks, 16 * k_min)) + 1):
        waste = (k * chunk_bytes % block_bytes) / (k * chunk_bytes)
        if waste <= 1 / 32:
            return k
        if waste < best_waste:
            best, best_waste = k, waste
    return best


class ChunkBudget:
    """The pool's memory, in chunks, shared by every class.

    ``total`` can move (``KVCacheManager.resize``) up to ``limit``, for which
    every class's id space is sized, so block ids never change.  With
    ``exact_slabs`` every slab holds a whole number of blocks.
    """

    def __init__(
        self, total_chunks: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *, limit: int | None = None,
        exact_slabs: bool = False,
    ) -> None:
        if total_chunks <= 0 or chunk_bytes <= 0:
            raise ValueError("the pool needs at least one chunk of positive size")
        if limit is not None and limit < total_chunks:
            raise ValueError(f"the limit ({limit} chunks) is below the pool's size ({total_chunks} chunks)")
        self.total = total_chunks
        self.free = total_chunks
        self.chunk_bytes = chunk_bytes
        self.limit = total_chunks if limit is None else limit
        self.exact_slabs = exact_slabs
        self.classes: list[LayoutClass] = []
        self.clock = 0  # stamps the blocks that become cached, so that classes can compare their ages

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def reclaimable(self, requester: "LayoutClass", evict: bool) -> int:
        """Chunks the other classes could give back (empty slabs, or unheld ones if ``evict``)."""
        return sum(c.slabs_to_give(evict=evict) * c.slab_chunks for c in self.classes if c is not requester)

    def reclaim(self, requester: "LayoutClass | None", chunks: int, evict: bool) -> None:
        """Make at least ``chunks`` chunks free by taking slabs back from other classes (None: from any).

        Empty slabs first; with ``evict``, then slabs holding only cached blocks, those whose newest block
        was cached longest ago first, whichever class they belong to: a model that stopped for a while
        (a crash, a redeploy) keeps the prefixes it computed last while others' older ones go.
        """
        others = [c for c in self.classes if c is not requester]
        for other in others:
            if self.free >= chunks:
                return
            other.give_back_empty_slabs(chunks - self.free)
        if not evict or self.free >= chunks or not others:
            return
        found = [(i, *c.cached_only_slots()) for i, c in enumerate(others)]
        owner = np.concatenate([np.full(len(slots), i) for i, slots, _ in found])
        slots = np.concatenate([slots for _, slots, _ in found])
        ages = np.concatenate([age for _, _, age in found])
        chosen: dict[int, set[int]] = {}
        need = chunks - self.free
        for j in np.argsort(ages, kind="stable").tolist():
            if need <= 0:
                break
            i = int(owner[j])
            chosen.setdefault(i, set()).add(int(slots[j]))
            need -= others[i].slab_chunks
        for i, taken in chosen.items():
            others[i].give_back(taken)


class LayoutClass:
    """Block ids, ref counts and the device-tier prefix index of one layout class."""

    SLABS_AHEAD = 8  # slabs taken at once from unassigned memory when the class grows

    def __init__(
        self,
        class_id: int,
        geometry: Geometry,
        budget: ChunkBudget,
        policy: str = "lru",
        on_evict: Callable[[int, list[int], list[bytes]], None] | None = None,
    ) -> None:
        self.class_id = class_id
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self.block_size = geometry.block_size
        self.budget = budget
        self.slab_chunks = choose_slab_chunks(
            self.block_bytes, budget.chunk_bytes, budget.total, budget.limit, budget.exact_slabs
        )
        self.slab_bytes = self.slab_chunks * budget.chunk_bytes
        self.blocks_per_slab = self.slab_bytes // self.block_bytes
        #: bytes of one slab's blocks (``slab_bytes`` less the tail no block fills): slab s is at s * span
        self.span = self.blocks_per_slab * self.block_bytes
        self.max_slabs = budget.limit // self.slab_chunks
        #: size of the id space: the class could own the whole pool, grown to its limit
        self.num_block_ids = self.max_slabs * self.blocks_per_slab
        self.free: list[int] = []
        self.cached = make_policy(policy)
        self.extra: dict[int, int] = {}
        self.prefix = PrefixIndex()
        self.slots: set[int] = set()
        # slots not owned: the given-back ones (a heap, lowest first), then [fresh, max_slabs)
        self._returned: list[int] = []
        self._fresh = 0
        self.released: list[int] = []  # slots given back since the daemon last drained them
        self.taken: list[int] = []  # slots taken since the daemon last drained them
        #: told (class id, blocks, hashes) of every batch of hashed blocks evicted, oldest first
        self.on_evict = on_evict
        self.evictions = 0
        self.released_slabs = 0  # ever given back
        self.taken_slabs = 0  # ever taken
        budget.classes.append(self)

    # -- sizes --------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        return len(self.slots) * self.blocks_per_slab

    @property
    def held_blocks(self) -> int:
        return self.total_blocks - len(self.free) - len(self.cached)

    def obtainable(self, need: int | None = None) -> int:
        """How many blocks ``allocate`` could produce right now (evicting if needed).

        With ``need``, stops as soon as the cheap sources cover it: looking at
        what other classes could give back is only done when it matters.
        """
        cheap = len(self.free) + len(self.cached)
        chunks = self.budget.free
        cheap_total = cheap + (chunks // self.slab_chunks) * self.blocks_per_slab
        if need is not None and cheap_total >= need:
            return cheap_total
        chunks += self.budget.reclaimable(self, evict=True)
        return cheap + (chunks // self.slab_chunks) * self.blocks_per_slab

    # -- allocation -----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh block ids, each held once.  Callers check ``obtainable`` first."""
        if n <= 0:
            return []
        free = self.free
        if len(free) < n:
            self._grow(n - len(free))
        ids = free[:-n - 1:-1]  # the top n of the stack, top first
        del free[-n:]
        return ids

    def _grow(self, short: int) -> None:
        """Add at least ``short`` blocks under the free stack, cheapest source first."""
        bps, k, budget = self.blocks_per_slab, self.slab_chunks, self.budget
        gained: list[int] = []
        # from unassigned memory, take a few slabs ahead: big blocks (one per slab) would
        # otherwise cost a slab operation per block; other classes can take them back
        ahead = max(short, self.SLABS_AHEAD * bps)
        short -= ahead - self._take_slabs(ahead, gained)
        if short > 0:  # other classes' empty slabs cost nothing to take
            budget.reclaim(self, cdiv(short, bps) * k, evict=False)
            short = self._take_slabs(short, gained)
        if short > 0 and len(self.cached):  # then our own least useful cached blocks
            evicted = self._evict_many(short)
            gained.extend(evicted)
            short -= len(evicted)
        if short > 0:  # last, other classes' cached-only slabs
            budget.reclaim(self, cdiv(short, bps) * k, evict=True)
            short = self._take_slabs(short, gained)
        # below what is already free, in the order gained: low ids of a new slab first
        self.free[:0] = gained[::-1]
        if short > 0:
            raise OutOfBlocks(short, 0)

    def unowned_spans(self) -> list[tuple[int, int]]:
        """(byte offset, bytes) of the runs of slab slots the class does not own, over its whole id space."""
        spans, start = [], None
        for slot in range(self.max_slabs + 1):
            owned = slot in self.slots or slot == self.max_slabs
            if not owned and start is None:
                start = slot
            elif owned and start is not None:
                spans.append((start * self.span, (slot - start) * self.span))
                start = None
        return spans

    def _take_slabs(self, short: int, gained: list[int]) -> int:
        """Take slabs (given-back ones first, then never-used ones in bulk) until ``short`` is covered."""
        bps, k, budget = self.blocks_per_slab, self.slab_chunks, self.budget
        while short > 0 and budget.free >= k and self._returned:
            slot = heapq.heappop(self._returned)
            self.slots.add(slot)
            self.taken.append(slot)
            self.taken_slabs += 1
            budget.free -= k
            gained.extend(range(slot * bps, (slot + 1) * bps))
            short -= bps
        if short > 0:
            m = min(cdiv(short, bps), budget.free // k, self.max_slabs - self._fresh)
            if m > 0:
                new = range(self._fresh, self._fresh + m)
                self._fresh += m
                self.slots.update(new)
                self.taken.extend(new)
                self.taken_slabs += m
                budget.free -= m * k
                gained.extend(range(new.start * bps, new.stop * bps))
                short -= m * bps
        return short

    def _evict_many(self, n: int) -> list[int]:
        """Evict up to ``n`` cached blocks, oldest first (one batch: the tiers plan their demotion at once)."""
        blocks = self.cached.victims(n)
        self._forget_hashes(blocks)
        return blocks

    def _forget_hashes(self, blocks: list[int]) -> None:
        if not blocks:
            return
        digests = self.prefix.forget_many(blocks)
        self.evictions += len(blocks)
        if self.on_evict is not None:
            self.on_evict(self.class_id, blocks, digests)

    # -- holders --------------------------------------------------------------
    def share(self, ids: Iterable[int]) -> None:
        """One more holder for each held block (fork, prefix hit on a held block)."""
        extra = self.extra
        if not isinstance(ids, list):
            ids = list(ids)
        if extra.keys().isdisjoint(ids) and len(set(ids)) == len(ids):
            extra.update(dict.fromkeys(ids, 1))  # the common case (a batch's holds), in C
            return
        for b in ids:
            extra[b] = extra.get(b, 0) + 1

    def release(self, ids: list[int]) -> None:
        """One holder fewer for each block, in the given order.

        Callers pass a sequence's blocks tail first: cached blocks enter the
        eviction order in that order, so a sequence's tail is evicted first.
        """
        extra, prefix = self.extra, self.prefix
        if extra.keys().isdisjoint(ids):  # nobody else holds them: each becomes free or cached, in C
            if prefix.none_hashed(ids):
                self.free.extend(ids)  # the common case
                return
            hashed = prefix.hashed(ids)
            self.cached.insert_many(hashed, self.budget.tick())
            if len(hashed) < len(ids):
                self.free.extend(prefix.unhashed(ids))
            return
        if len(set(ids)) == len(ids) and list(map(extra.get, ids)).count(1) == len(ids):
            deque(map(extra.__delitem__, ids), 0)  # one holder fewer of blocks held twice (a batch's holds)
            return
        cached, free, stamp = self.cached, self.free, self.budget.tick()
        for b in ids:
            c = extra.get(b)
            if c:
                if c == 1:
                    del extra[b]
                else:
                    extra[b] = c - 1
            elif prefix.is_hashed(b):
                cached.insert(b, stamp)
            else:
                free.append(b)

    def owns(self, block: int) -> bool:
        """Whether ``block`` lies in a slab this class owns now."""
        return type(block) is int and block >= 0 and block // self.blocks_per_slab in self.slots

    def is_shared(self, block: int) -> bool:
        return block in self.extra

    # -- prefix hits -----------------------------------------------------------
    def acquire_many(self, blocks: list[int]) -> None:
        """``acquire_cached`` of each block (distinct blocks)."""
        revived = self.cached.present(blocks)
        self.cached.remove_many(revived)
        if len(revived) < len(blocks):
            self.share(list(filterfalse(set(revived).__contains__, blocks)))

    def acquire_cached(self, block: int) -> None:
        """A prefix hit on ``block``: cached becomes held, held gains a holder."""
        if block in self.cached:
            self.cached.remove(block)
        else:
            self.extra[block] = self.extra.get(block, 0) + 1

    def invalidate(self, block: int) -> bytes | None:
        """Forget ``block``'s hash (its bytes never arrived); an unheld block becomes free.  Returns the hash."""
        digest = self.prefix.forget(block)
        if digest is not None and block in self.cached:
            self.cached.remove(block)
            self.free.append(block)
        return digest

    def drop_cached(self, max_blocks: int | None = None) -> int:
        """Evict cached blocks (oldest first) to the free list; returns how many."""
        n = len(self.cached) if max_blocks is None else min(max_blocks, len(self.cached))
        if n <= 0:
            return 0
        self.free.extend(self._evict_many(n))
        return n

    # -- giving memory back ----------------------------------------------------
    def _slot_usage(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(owned slots, free blocks in each, cached blocks in each), highest slot first.

        Vectorised: a class may hold hundreds of thousands of free or cached
        blocks, and a class that needs memory asks every other class this.
        """
        bps, top = self.blocks_per_slab, self.max_slabs
        slots = np.fromiter(self.slots, np.int64, len(self.slots))
        slots[::-1].sort()
        free = np.bincount(np.asarray(self.free, np.int64) // bps, minlength=top)
        cached = np.bincount(np.fromiter(self.cached, np.int64, len(self.cached)) // bps, minlength=top)
        return slots, free[slots], cached[slots]

    def _unheld_slots(self, evict: bool) -> np.ndarray:
        """Owned slots with no held block: empty ones first, then (``evict``) those holding only cached blocks."""
        if not self.slots:
            return np.empty(0, np.int64)
        slots, free, cached = self._slot_usage()
        bps = self.blocks_per_slab
        empty = slots[free == bps]
        if not evict:
            return empty
        return np.concatenate([empty, slots[(cached > 0) & (free + cached == bps)]])

    def slabs_to_give(self, evict: bool) -> int:
        """Slabs with no held block (empty ones only unless ``evict``)."""
        return len(self._unheld_slots(evict=evict))

    def give_back_empty_slabs(self, chunks: int) -> None:
        """Return empty slabs to the budget until ``chunks`` chunks were freed (high slots first)."""
        if chunks <= 0:
            return
        want = cdiv(chunks, self.slab_chunks)
        chosen = set(self._unheld_slots(evict=False)[:want].tolist())
        if chosen:
            self.give_back(chosen)

    def cached_only_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(owned slots holding cached blocks and no held one, the stamp of each one's newest cached block)."""
        if not self.slots:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        slots, free, cached = self._slot_usage()
        slots = slots[(cached > 0) & (free + cached == self.blocks_per_slab)]
        keys = np.fromiter(self.cached, np.int64, len(self.cached))
        newest = np.zeros(self.max_slabs, np.int64)
        np.maximum.at(newest, keys // self.blocks_per_slab, np.fromiter(self.cached.stamps(), np.int64, len(keys)))
        return slots, newest[slots]

    def give_back(self, slots: set[int]) -> None:
        """Return these owned slabs, which hold no held block, to the budget (their cached blocks are evicted)."""
        bps = self.blocks_per_slab
        leaving = np.zeros(self.max_slabs, bool)
        leaving[np.fromiter(slots, np.int64, len(slots))] = True
        cached = np.fromiter(self.cached, np.int64, len(self.cached))
        doomed = cached[leaving[cached // bps]].tolist()
        self.cached.remove_many(doomed)
        self._forget_hashes(doomed)
        free = np.asarray(self.free, np.int64)
        kept = free[~leaving[free // bps]]
        kept[::-1].sort()  # compact: later allocations take low slots first
        self.free = kept.tolist()
        for slot in slots:
            self.slots.remove(slot)
            heapq.heappush(self._returned, slot)
            self.released.append(slot)
        self.released_slabs += len(slots)
        self.budget.free += len(slots) * self.slab_chunks

    def drain_slab_changes(self) -> tuple[list[int], list[int]]:
        """(slots taken, slots given back) since the last call, for the memory backend."""
        out = self.taken, self.released
        self.taken, self.released = [], []
        return out

    # -- invariants -----------------------------------------------------------
    def check(self) -> dict[int, int]:
        """Assert the pool's invariants; returns block -> holder count for held blocks."""
        bps = self.blocks_per_slab
        owned = {b for s in self.slots for b in range(s * bps, (s + 1) * bps)}
        free = set(self.free)
        cached = set(self.cached)
        assert len(free) == len(self.free), "a block is twice on the free list"
        assert not (free & cached), "a block is both free and cached"
        assert free <= owned and cached <= owned, "a free/cached block outside the owned slabs"
        held = owned - free - cached
        assert set(self.extra) <= held, "a shared count on a block that is not held"
        assert all(c >= 1 for c in self.extra.values())
        self.prefix.check()
        hashed = set(self.prefix.blocks())
        assert cached <= hashed, "a cached block without a hash"
        assert {b for b, _ in self.prefix.unwritten_items()} <= held, "an unwritten block that is not held"
        assert not (free & hashed), "a free block with a hash"
        assert hashed <= owned, "a hashed block outside the owned slabs"
        unowned = set(self._returned) | set(range(self._fresh, self.max_slabs))
        assert all(s < self._fresh for s in self._returned), "a returned slot beyond the fresh range"
        assert not (self.slots & unowned), "a slot both owned and unowned"
        assert len(self.slots) + len(unowned) == self.max_slabs, "slots lost"
        assert len(set(self._returned)) == len(self._returned)
        assert self.taken_slabs - self.released_slabs == len(self.slots), "slabs taken and given back are miscounted"
        stamps = list(self.cached.stamps())
        assert stamps == sorted(stamps) and all(0 < t <= self.budget.clock for t in stamps), (
            "the eviction order and the cached blocks' stamps disagree")
        return {b: 1 + self.extra.get(b, 0) for b in held}
