"""Which physical chunk backs which place of which class, and who may still map it.

Pure bookkeeping for the CUDA VMM backend (``cuda_vmm.py`` makes the driver
calls): chunk ids are integers, places are (class id, chunk index), viewers
are the daemon's session ids of clients that map chunks of their class.

The rule that keeps processes safe, enforced here:

1. **Mapped before handed out.**  The daemon maps a chunk into a class's
   range (``place``) before the core hands out any block in it.  A client
   maps the chunks of a block before it uses the block: it checks every
   reply's blocks against its mapping and syncs over the side socket when one
   is missing (``kvpool.mapping.PoolMapping.ensure_mapped``).  A client only ever maps a
   chunk at the one index the daemon had it at.
2. **Unmapped only when empty.**  The core gives a slab back only when no
   block of it is held, cached or reserved; then the daemon unmaps its chunks
   from its own range (``unplace``).
3. **Reused or freed only when nobody maps it.**  Every chunk the daemon ever
   sent a viewer counts as mapped by that viewer until the viewer confirms a
   sync that no longer includes it (``acked``) or its session ends
   (``forget``).  An unplaced chunk some viewer may still map is *draining*:
   it is never given to another place (except back to the very place it left,
   where the viewer's stale mapping is the right one again) and never freed.
   Viewers of the class are told to sync (``remap`` on their Watch stream).
4. **Never across tenants.**  A free chunk is reused only by classes of the
   tenant it came from, within the same round of slab changes; whatever is
   left is released to the GPU (``take_idle``).  A client that kept a handle
   to a chunk (it can: the driver cannot revoke an imported handle) can thus
   only ever see its own tenant's bytes; another tenant gets fresh memory.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


GONE = (-1, -1)  # the place a draining chunk left belonged to a class that is gone


@dataclass(frozen=True)
class Placed:
    """The chunk that now backs a place, and where it came from."""

    chunk: int
    source: str  # "new" (create it), "idle" (reuse: same tenant), "draining" (back to its own place)


class ChunkLedger:
    """Chunks, their places, their viewers; see the module's rule."""

    def __init__(self) -> None:
        self._next = 1
        self.places: dict[int, dict[int, int]] = {}  # class -> {index: chunk}
        self.tenant_of_class: dict[int, str] = {}
        self.generation: dict[int, int] = {}  # class -> bumps at every change of its places
        self.where: dict[int, tuple[int, int]] = {}  # placed chunk -> (class, index)
        self.tenant_of: dict[int, str] = {}  # every live chunk -> its tenant
        self.draining: dict[int, tuple[int, int]] = {}  # chunk -> the place it left
        self._left: dict[tuple[int, int], int] = {}  # the place -> the chunk draining from it
        self.idle: dict[str, list[int]] = defaultdict(list)  # tenant -> chunks nobody maps
        self.maybe: dict[int, set[int]] = {}  # viewer -> chunks it may map
        self.class_of_viewer: dict[int, int] = {}
        self.viewers: dict[int, int] = defaultdict(int)  # chunk -> viewers that may map it

    # -- classes --------------------------------------------------------------------
    def add_class(self, cid: int, tenant: str) -> None:
        if cid in self.places:
            raise ValueError(f"class {cid} already has a range")
        self.places[cid] = {}
        self.tenant_of_class[cid] = tenant
        self.generation[cid] = 0

    def drop_class(self, cid: int) -> list[int]:
        """Forget a class whose places are all empty; returns viewers still attached to it (none expected)."""
        if self.places.get(cid):
            raise ValueError(f"class {cid} still has {len(self.places[cid])} chunks placed")
        self.places.pop(cid, None)
        self.tenant_of_class.pop(cid, None)
        self.generation.pop(cid, None)
        for chunk, (c, index) in self.draining.items():
            if c == cid:  # the id may be given to a new class: its places are not these
                self.draining[chunk] = GONE
                self._left.pop((c, index), None)
        return [v for v, c in self.class_of_viewer.items() if c == cid]

    # -- the daemon's own mapping -------------------------------------------------------
    def place(self, cid: int, index: int) -> Placed:
        """The chunk to map at (``cid``, ``index``): the one draining from there, a same-tenant idle one, or new."""
        places = self.places[cid]
        if index in places:
            raise ValueError(f"class {cid} index {index} is already placed")
        tenant = self.tenant_of_class[cid]
        chunk = self._left.pop((cid, index), None)
        if chunk is not None:
            del self.draining[chunk]
            source = "draining"
        elif self.idle[tenant]:
            chunk, source = self.idle[tenant].pop(), "idle"
        else:
            chunk, source = self._next, "new"
            self._next += 1
            self.tenant_of[chunk] = tenant
        places[index] = chunk
        self.where[chunk] = (cid, index)
        self.generation[cid] += 1
        return Placed(chunk, source)

    def unplace(self, cid: int, index: int) -> tuple[int, list[int]]:
        """Take the chunk out of (``cid``, ``index``); returns it and the viewers to tell (it drains)."""
        chunk = self.places[cid].pop(index)
        del self.where[chunk]
        self.generation[cid] += 1
        if self.viewers[chunk]:
            self.draining[chunk] = (cid, index)
            self._left[(cid, index)] = chunk
            return chunk, [v for v, m in self.maybe.items() if chunk in m]
        self.idle[self.tenant_of[chunk]].append(chunk)
        return chunk, []

    def take_idle(self, keep_tenant: str | None = None) -> list[int]:
        """Idle chunks to release to the GPU (those of ``keep_tenant`` stay for reuse); they leave the ledger."""
        out = []
        for tenant in list(self.idle):
            if tenant != keep_tenant:
                out.extend(self.idle.pop(tenant))
        for chunk in out:
            del self.tenant_of[chunk]
            self.viewers.pop(chunk, None)
        return out

    def discard(self, chunk: int) -> None:
        """Drop an idle chunk that was never created (its creation failed)."""
        self.idle[self.tenant_of.pop(chunk)].remove(chunk)

    # -- viewers (clients that map chunks) ----------------------------------------------
    def snapshot(self, cid: int) -> tuple[int, dict[int, int]]:
        """(generation, {index: chunk}) of a class now."""
        return self.generation[cid], dict(self.places[cid])

    def open_view(self, viewer: int, cid: int) -> None:
        if self.class_of_viewer.setdefault(viewer, cid) != cid:
            raise ValueError(f"viewer {viewer} views class {self.class_of_viewer[viewer]}, not {cid}")
        self.maybe.setdefault(viewer, set())

    def sent(self, viewer: int, chunks) -> None:
        """``chunks`` are about to go to ``viewer``: from now on it may map them."""
        mine = self.maybe[viewer]
        for c in chunks:
            if c not in mine:
                if c not in self.tenant_of:
                    raise ValueError(f"chunk {c} does not exist")
                mine.add(c)
                self.viewers[c] += 1

    def acked(self, viewer: int, chunks) -> None:
        """``viewer`` confirmed that it maps exactly ``chunks`` now (a finished sync)."""
        if viewer not in self.maybe:
            return  # its session ended meanwhile
        keep = set(chunks)
        self._let_go(viewer, self.maybe[viewer] - keep)
        self.maybe[viewer] &= keep

    def forget(self, viewer: int) -> None:
        """``viewer``'s process maps nothing any more (its session ended, or it unmapped everything)."""
        chunks = self.maybe.pop(viewer, set())
        self.class_of_viewer.pop(viewer, None)
        self._let_go(viewer, chunks)

    def _let_go(self, viewer: int, chunks) -> None:
        for c in chunks:
            self.viewers[c] -= 1
            if self.viewers[c] == 0:
                del self.viewers[c]
                if c in self.draining:  # nobody maps it any more: free to reuse or release
                    self._left.pop(self.draining.pop(c), None)
                    self.idle[self.tenant_of[c]].append(c)

    # -- figures and checks -------------------------------------------------------------
    def placed_chunks(self, cid: int | None = None) -> int:
        if cid is None:
            return len(self.where)
        return len(self.places.get(cid, ()))

    def live_chunks(self) -> int:
        """Chunks that exist (placed, draining or idle): the physical memory held."""
        return len(self.tenant_of)

    def check(self) -> None:
        placed = {c: (cid, i) for cid, places in self.places.items() for i, c in places.items()}
        assert placed == self.where, "places and where disagree"
        idle = [c for cs in self.idle.values() for c in cs]
        assert len(set(idle)) == len(idle), "a chunk twice idle"
        assert not (set(idle) & set(placed)) and not (set(idle) & set(self.draining)), "an idle chunk in use"
        assert not (set(self.draining) & set(placed)), "a draining chunk placed"
        assert self._left == {p: c for c, p in self.draining.items() if p != GONE}, "draining places wrong"
        assert set(placed) | set(self.draining) | set(idle) == set(self.tenant_of), "a chunk lost or unknown"
        counts: dict[int, int] = defaultdict(int)
        for chunks in self.maybe.values():
            for c in chunks:
                counts[c] += 1
        assert counts == {c: n for c, n in self.viewers.items() if n}, "viewer counts wrong"
        assert all(self.viewers.get(c, 0) > 0 for c in self.draining), "a draining chunk nobody maps"
        assert not any(self.viewers.get(c, 0) for c in idle), "an idle chunk somebody maps"
        for cid, places in self.places.items():
            tenant = self.tenant_of_class[cid]
            assert all(self.tenant_of[c] == tenant for c in places.values()), "a chunk crossed tenants"
