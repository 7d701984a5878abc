"""Fixed-size slots in one byte range (the host buffer, a disk data file).

Blocks of one layout class all have the same size, so a slot allocator needs
no splitting: each slot size keeps a min-heap of free offsets (the lowest
first, so that a batch allocated together tends to be one contiguous run, and
one large copy or one ``pwritev`` moves it), and untouched space is handed out
by a bump pointer.  When neither has a slot of the size asked for, a free
slot of another, larger size is taken whole (its remainder is wasted until it
is freed): that only happens with several layout classes of different block
sizes, and keeps the allocator O(log n) per slot with no fragmentation
bookkeeping.  All offsets and sizes are multiples of ``align``.
"""

from __future__ import annotations

import heapq


class SlotAllocator:
    def __init__(self, capacity: int | None, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.capacity = capacity  # None: unbounded (a file that grows)
        self.align = align
        self.top = 0  # the bump pointer: [top, capacity) was never handed out
        self._free: dict[int, list[int]] = {}  # slot size -> heap of free offsets
        self._sorted: set[int] = set()  # slot sizes whose heap is in ascending order (a sorted list is a heap)
        self._size: dict[int, int] = {}  # offset -> slot size, for slots in use
        self.used = 0

    def round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least ``nbytes``, or None when there is none."""
        size = self.round(max(1, nbytes))
        heap = self._free.get(size)
        if heap:
            off = heapq.heappop(heap)
            self._sorted.discard(size)
            self._size[off] = size
        elif self.capacity is None or self.top + size <= self.capacity:
            off = self.top
            self.top += size
            self._size[off] = size
        else:
            bigger = sorted(s for s, h in self._free.items() if s > size and h)
            if not bigger:
                return None
            off = heapq.heappop(self._free[bigger[0]])
            self._sorted.discard(bigger[0])
            self._size[off] = bigger[0]
        self.used += self._size[off]
        return off

    def free(self, offset: int) -> None:
        size = self._size.pop(offset)
        self.used -= size
        heapq.heappush(self._free.setdefault(size, []), offset)
        self._sorted.discard(size)

    def alloc_many(self, nbytes: int, n: int, more: int = 0) -> list[int]:
        """Up to ``n`` slots of ``nbytes`` at once (fewer when full), in ascending order.

        A batch's slots are then mostly consecutive, so a copy or a write
        moves them in few large runs; the cost is per batch (a sort, a
        range) rather than a heap operation per slot.  ``more``: how many
        slots the caller will ask for next (a batch taken in pieces); the
        free list is then sorted once, and each piece is a slice of it.
        """
        size = self.round(max(1, nbytes))
        heap = self._free.get(size)
        out: list[int] = []
        if heap and n > 0:
            if n >= len(heap):
                out = sorted(heap)
                heap.clear()
            elif size in self._sorted or (n + more) * 8 >= len(heap):
                if size not in self._sorted:
                    heap.sort()  # a sorted list is a heap: what stays behind is one still
                    self._sorted.add(size)
                out = heap[:n]
                del heap[:n]
            else:
                out = [heapq.heappop(heap) for _ in range(n)]
        k = n - len(out)
        if k > 0:
            room = k if self.capacity is None else min(k, max(0, (self.capacity - self.top) // size))
            if room > 0:
                out.extend(range(self.top, self.top + room * size, size))
                self.top += room * size
        self._size.update(dict.fromkeys(out, size))
        self.used += size * len(out)
        while len(out) < n:  # free slots of other sizes, taken whole (several layout classes)
            off = self.alloc(nbytes)
            if off is None:
                break
            out.append(off)
        return out

    def free_many(self, offsets) -> None:
        """``free`` for many slots (an unknown or twice-freed offset raises KeyError)."""
        offsets = list(offsets)
        sizes = list(map(self._size.pop, offsets))
        if not sizes:
            return
        size = sizes[0]
        if sizes.count(size) != len(sizes):
            for off, sz in zip(offsets, sizes):
                self.used -= sz
                heapq.heappush(self._free.setdefault(sz, []), off)
                self._sorted.discard(sz)
            return
        self.used -= size * len(offsets)
        heap = self._free.setdefault(size, [])
        self._sorted.discard(size)
        if len(offsets) * 4 >= len(heap):
            heap.extend(offsets)
            heapq.heapify(heap)
        else:
            for off in offsets:
                heapq.heappush(heap, off)

    def size_of(self, offset: int) -> int:
        return self._size[offset]

    def reserve(self, offset: int, size: int) -> None:
        """Mark ``[offset, offset+size)`` used (rebuilding the state of a file at start).

        Call for every used slot first, in any order, then ``seal``.
        """
        size = self.round(size)
        if offset % self.align or offset in self._size:
            raise ValueError(f"bad or duplicate slot offset {offset}")
        self._size[offset] = size
        self.used += size
        self.top = max(self.top, offset + size)

    def seal(self, stride: int) -> None:
        """After ``reserve``: every ``stride``-sized gap below the bump pointer becomes free."""
        stride = self.round(stride)
        taken = sorted(self._size.items())
        pos = 0
        heap = self._free.setdefault(stride, [])
        for off, size in taken + [(self.top, 0)]:
            while pos + stride <= off:
                heap.append(pos)
                pos += stride
            pos = max(pos, off + size)
        heapq.heapify(heap)
        self._sorted.discard(stride)

    @property
    def free_bytes(self) -> int | None:
        if self.capacity is None:
            return None
        return self.capacity - self.used
