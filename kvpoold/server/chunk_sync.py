"""Handing a client the chunks of its class (CUDA VMM), over the side socket.

The dialog, after the request line ``chunks <session token in hex>`` (the
connection's kernel credentials must be the session's):

1. daemon: ``ok <generation> <n>`` and ``n`` (index, chunk id) pairs, int64
   little-endian: every place of the class now;
2. client: ``want <k>`` and ``k`` chunk ids (int64), the ones it lacks;
3. daemon, per batch of at most ``CHUNK_BATCH``: ``fds <m>`` with ``m`` file
   descriptors attached; client: ``next`` once it imported and mapped them
   (one batch in flight: descriptors never pile up in the socket).  Or
   ``moved``, and the dialog ends: a chunk of the batch left its place since
   step 1 and nobody mapped it, so it may back another place now (a viewer that
   mapped it at the old place would write into memory the daemon gave away);
   the client starts again from step 1;
4. client: ``ack`` when it maps exactly the pairs of step 1; daemon: ``done``.

From step 3 on, every chunk sent counts as mapped by that session
(``ChunkLedger.sent``); only the ``ack`` lets the daemon forget the chunks the
client dropped.  A dialog that breaks off changes nothing else.  Chunks are
exported when sent and the descriptors closed at once: the daemon keeps no
descriptor per chunk.  See ``kvpool.handoff.sync_chunks`` for the client.
"""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np

from kvpool.handoff import CHUNK_BATCH

STEP_SECONDS = 60.0  # a client may take this long to map one batch (or to answer at all)


class ChunkSync:
    """One session's view of its class at the start of a dialog (made by ``DevicePool.chunk_sync``)."""

    def __init__(self, backend, viewer: int, class_id: int) -> None:
        self.backend, self.viewer, self.class_id = backend, viewer, class_id
        backend.ledger.open_view(viewer, class_id)
        self.generation, self.places = backend.ledger.snapshot(class_id)
        self.index_of = {chunk: index for index, chunk in self.places.items()}

    def pairs(self) -> bytes:
        arr = np.array(sorted(self.places.items()), "<i8").reshape(-1, 2)
        return arr.tobytes()

    def check_wanted(self, chunks: np.ndarray) -> None:
        if not set(chunks.tolist()) <= set(self.places.values()):
            raise PermissionError("a chunk outside the session's class was asked for")

    def still_placed(self, chunks: list[int]) -> bool:
        """Whether each of ``chunks`` backs its place of step 1 now, or drains back to it."""
        ledger, cid = self.backend.ledger, self.class_id
        return all(ledger.where.get(c) == (cid, self.index_of[c]) or ledger.draining.get(c) == (cid, self.index_of[c])
                   for c in chunks)

    def export(self, chunks: list[int]) -> list[int]:
        """File descriptors of ``chunks``; from now on the session may map them."""
        self.backend.ledger.sent(self.viewer, chunks)
        fds: list[int] = []
        try:
            for c in chunks:
                fds.append(self.backend.export(c))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def ack(self) -> None:
        self.backend.ledger.acked(self.viewer, self.places.values())
        self.backend.settle()


async def serve(reader: asyncio.StreamReader, raw: socket.socket, sync: ChunkSync) -> None:
    """Run the dialog on one connection (``raw``: a non-blocking duplicate of its socket, for writing)."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(raw, b"ok %d %d\n" % (sync.generation, len(sync.places)) + sync.pairs())
    words = (await asyncio.wait_for(reader.readline(), STEP_SECONDS)).split()
    if len(words) != 2 or words[0] != b"want" or not words[1].isdigit() or int(words[1]) > len(sync.places):
        return
    wanted = np.frombuffer(await asyncio.wait_for(reader.readexactly(8 * int(words[1])), STEP_SECONDS), "<i8")
    sync.check_wanted(wanted)
    for start in range(0, len(wanted), CHUNK_BATCH):
        batch = wanted[start:start + CHUNK_BATCH].tolist()
        if not sync.still_placed(batch):
            await loop.sock_sendall(raw, b"moved\n")
            return
        fds = sync.export(batch)
        try:
            # the client read everything before: the buffer is empty and this short message never blocks
            socket.send_fds(raw, [b"fds %d\n" % len(batch)], fds)
        finally:
            for fd in fds:
                os.close(fd)
        if (await asyncio.wait_for(reader.readline(), STEP_SECONDS)).strip() != b"next":
            return
    if (await asyncio.wait_for(reader.readline(), STEP_SECONDS)).strip() != b"ack":
        return
    sync.ack()
    await loop.sock_sendall(raw, b"done\n")
