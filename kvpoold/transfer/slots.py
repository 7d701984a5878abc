"""Fixed-size slots in one byte range (the host buffer, a disk data file).

Blocks of one layout class all have the same size, so a slot allocator needs
no splitting: each slot size keeps its free offsets in ascending order (the
lowest first, so that a batch allocated together tends to be one contiguous
run, and one large copy or one ``pwritev`` moves it), and untouched space is
handed out by a bump pointer.  When neither has a slot of the size asked for,
a free slot of another, larger size is taken whole (its remainder is wasted
until it is freed): that only happens with several layout classes of
different block sizes, and needs no fragmentation bookkeeping.  All offsets
and sizes are multiples of ``align``.

The daemon takes and gives back slots tens of thousands at a time (a
demotion, a promotion), so the state is kept in numpy arrays and every batch
operation is a few vectorized steps, with no Python work per slot:

* the size of each slot in use sits in one array indexed by ``offset //
  align`` (0: not the start of a slot in use).  It costs 4 bytes per
  ``align`` bytes of the range (0.1%), and catches a slot freed twice;
* a size's free list is a sorted numpy array, taken from the front by
  slicing; batches freed since are kept aside and merged in with one sort
  when a batch is next taken (one merge per batch, not per slot), and slots
  freed one at a time go on a small heap, so that single frees and
  allocations (the disk store's) stay O(log n).
"""

from __future__ import annotations

import heapq

import numpy as np

from kvpool.protocol.sizes import cdiv

_EMPTY = np.zeros(0, np.int64)


class _FreeList:
    """Free offsets of one slot size.

    ``sorted[head:]`` is ascending; ``pending`` holds batches freed since
    (merged in with one sort when a batch is next taken), ``heap`` the
    offsets freed one at a time (a disk write done, a disk entry dropped):
    a single slot is then taken in O(log n) with no merge, even while frees
    and allocations alternate.
    """

    __slots__ = ("sorted", "head", "pending", "heap", "count")

    def __init__(self) -> None:
        self.sorted = _EMPTY
        self.head = 0
        self.pending: list[np.ndarray] = []
        self.heap: list[int] = []
        self.count = 0

    def _merge(self, with_heap: bool) -> None:
        parts = [self.sorted[self.head:], *self.pending]
        if with_heap and self.heap:
            parts.append(np.asarray(self.heap, np.int64))
            self.heap = []
        # timsort: the parts are mostly ascending runs, so the merge costs little more than a copy
        self.sorted = np.sort(np.concatenate(parts), kind="stable")
        self.head = 0
        self.pending = []

    def take(self, n: int) -> np.ndarray:
        """The ``n`` lowest free offsets (fewer if there are fewer), removed from the list."""
        if self.pending or self.heap:
            self._merge(with_heap=True)
        h = self.head
        out = self.sorted[h:h + n]
        self.head = h + len(out)
        self.count -= len(out)
        return out

    def take_one(self) -> int:
        """The lowest free offset, removed (the list is not empty)."""
        if self.pending:
            self._merge(with_heap=False)
        h, heap = self.head, self.heap
        if h < len(self.sorted) and (not heap or int(self.sorted[h]) < heap[0]):
            self.head = h + 1
            off = int(self.sorted[h])
        else:
            off = heapq.heappop(heap)
        self.count -= 1
        return off


class SlotAllocator:
    def __init__(self, capacity: int | None, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.capacity = capacity  # None: unbounded (a file that grows)
        self.align = align
        self._shift = align.bit_length() - 1
        self.top = 0  # the bump pointer: [top, capacity) was never handed out
        self._free: dict[int, _FreeList] = {}  # slot size -> its free offsets
        #: slot size in units of ``align``, per ``offset // align``, for slots in use (0 elsewhere)
        self._units = np.zeros((capacity // align + 1) if capacity is not None else 1024, np.int32)
        self.used = 0

    def round(self, nbytes: int) -> int:
        return cdiv(nbytes, self.align) * self.align

    def _grow(self, end: int) -> None:
        """Room in the size array for slots up to byte ``end`` (a file that grows)."""
        need = (end >> self._shift) + 1
        if need > len(self._units):
            units = np.zeros(max(need, 2 * len(self._units)), np.int32)
            units[:len(self._units)] = self._units
            self._units = units

    def _list(self, size: int) -> _FreeList:
        fl = self._free.get(size)
        if fl is None:
            fl = self._free[size] = _FreeList()
        return fl

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least ``nbytes``, or None when there is none."""
        size = self.round(max(1, nbytes))
        fl = self._free.get(size)
        if fl is not None and fl.count:
            off = fl.take_one()
        elif self.capacity is None or self.top + size <= self.capacity:
            off = self.top
            self.top += size
            if self.capacity is None:
                self._grow(self.top)
        else:
            return self._bigger(size)
        self._units[off >> self._shift] = size >> self._shift
        self.used += size
        return off

    def _bigger(self, size: int) -> int | None:
        """A free slot of the smallest larger size, taken whole (several layout classes)."""
        bigger = sorted(s for s, fl in self._free.items() if s > size and fl.count)
        if not bigger:
            return None
        off = self._free[bigger[0]].take_one()
        self._units[off >> self._shift] = bigger[0] >> self._shift
        self.used += bigger[0]
        return off

    def alloc_many(self, nbytes: int, n: int) -> list[int]:
        """Up to ``n`` slots of ``nbytes`` at once (fewer when full), in ascending order.

        A batch's slots are then mostly consecutive, so a copy or a write
        moves them in few large runs; the cost is a slice and a few array
        operations per call, not per slot (a batch taken in pieces: each
        piece is a slice of the sorted free list).
        """
        return self.alloc_array(nbytes, n).tolist()

    def alloc_array(self, nbytes: int, n: int) -> np.ndarray:
        """``alloc_many`` as an int64 array (what a copier takes)."""
        size = self.round(max(1, nbytes))
        if n <= 0:
            return _EMPTY
        fl = self._free.get(size)
        taken = fl.take(n) if fl is not None and fl.count else _EMPTY
        k = n - len(taken)
        fresh = _EMPTY
        if k > 0:
            room = k if self.capacity is None else min(k, max(0, (self.capacity - self.top) // size))
            if room > 0:
                fresh = np.arange(self.top, self.top + room * size, size, dtype=np.int64)
                self.top += room * size
                if self.capacity is None:
                    self._grow(self.top)
        offs = np.concatenate((taken, fresh)) if len(fresh) and len(taken) else (fresh if len(fresh) else taken)
        self._units[offs >> self._shift] = size >> self._shift
        self.used += size * len(offs)
        if len(offs) == n:
            return offs
        out = offs.tolist()
        while len(out) < n:  # free slots of other sizes, taken whole (several layout classes)
            off = self._bigger(size)
            if off is None:
                break
            out.append(off)
        return np.asarray(out, np.int64)

    def free(self, offset: int) -> None:
        """Give one slot back (KeyError if it is not in use)."""
        offset = int(offset)
        i = offset >> self._shift
        if offset % self.align or not 0 <= i < len(self._units) or self._units[i] <= 0:
            raise KeyError(offset)
        size = int(self._units[i]) << self._shift
        self._units[i] = 0
        self.used -= size
        fl = self._list(size)
        heapq.heappush(fl.heap, offset)
        fl.count += 1

    def free_many(self, offsets) -> None:
        """``free`` for many slots; an unknown or twice-freed offset raises KeyError and frees none."""
        offs = np.array(offsets, np.int64).reshape(-1)  # a copy: the free list keeps it
        n = len(offs)
        if not n:
            return
        idx = offs >> self._shift
        if (offs & (self.align - 1)).any() or idx.min() < 0 or idx.max() >= len(self._units):
            raise KeyError(f"offsets that are no slots: {offsets!r}")
        units = self._units[idx]
        if not (units > 0).all():
            raise KeyError(f"offsets not in use: {offs[units <= 0].tolist()}")
        mark = np.arange(-1, -n - 1, -1, dtype=np.int32)  # each position writes its own mark:
        self._units[idx] = mark
        if not (self._units[idx] == mark).all():  # a duplicate's first position was overwritten
            self._units[idx] = units
            raise KeyError(f"an offset freed twice in one call: {offsets!r}")
        self._units[idx] = 0
        u0 = units[0]
        if (units == u0).all():
            size = int(u0) << self._shift
            self.used -= size * n
            fl = self._list(size)
            fl.pending.append(offs)
            fl.count += n
            return
        for u in np.unique(units).tolist():  # several sizes (several layout classes)
            sel = offs[units == u]
            size = u << self._shift
            self.used -= size * len(sel)
            fl = self._list(size)
            fl.pending.append(sel)
            fl.count += len(sel)

    def size_of(self, offset: int) -> int:
        i = offset >> self._shift
        if offset % self.align or not 0 <= i < len(self._units) or self._units[i] <= 0:
            raise KeyError(offset)
        return int(self._units[i]) << self._shift

    def reserve(self, offset: int, size: int) -> None:
        """Mark ``[offset, offset+size)`` used (rebuilding the state of a file at start).

        Call for every used slot first, in any order, then ``seal``.
        """
        size = self.round(size)
        if offset % self.align or offset < 0:
            raise ValueError(f"bad or duplicate slot offset {offset}")
        self._grow(offset + size)
        i = offset >> self._shift
        if self._units[i]:
            raise ValueError(f"bad or duplicate slot offset {offset}")
        self._units[i] = size >> self._shift
        self.used += size
        self.top = max(self.top, offset + size)

    def seal(self, stride: int) -> None:
        """After ``reserve``: every ``stride``-sized gap below the bump pointer becomes free."""
        stride = self.round(stride)
        starts = np.flatnonzero(self._units[:self.top >> self._shift]).tolist()
        pos = 0
        gaps: list[int] = []
        for i in starts + [self.top >> self._shift]:
            off = i << self._shift
            while pos + stride <= off:
                gaps.append(pos)
                pos += stride
            if off < self.top:
                pos = max(pos, off + (int(self._units[i]) << self._shift))
        fl = self._list(stride)
        fl.pending.append(np.asarray(gaps, np.int64))
        fl.count += len(gaps)

    @property
    def free_bytes(self) -> int | None:
        if self.capacity is None:
            return None
        return self.capacity - self.used
