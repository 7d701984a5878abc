"""The chunk-sync dialog between ``kvpool.handoff.sync_chunks`` and the daemon's ``chunk_sync.serve``, over a
real Unix socket with real file descriptors; the daemon's ledger is the real one (no GPU: the arena records)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kvpool.handoff import sync_chunks
from kvpoold.memory.chunk_ledger import ChunkLedger
from kvpoold.server import chunk_sync

pytestmark = pytest.mark.timeout(60)


class RecordingArena:
    """What the client's VMM arena does with its places, as a record (``VmmMappedArena`` on a GPU)."""

    def __init__(self, chunks: int) -> None:
        self.chunk_of = np.zeros(chunks, np.int64)
        self.mapped: list[tuple[int, int]] = []

    def unmap(self, index: int) -> None:
        self.chunk_of[index] = 0

    def map_fd(self, index: int, chunk: int, fd: int) -> None:
        os.close(fd)
        self.chunk_of[index] = chunk
        self.mapped.append((index, chunk))


class Daemon:
    """The side socket's chunk dialog on a thread of its own; ``before_dialog`` runs after each answer is taken."""

    def __init__(self, path: str, ledger: ChunkLedger, class_id: int) -> None:
        self.path, self.ledger, self.class_id = path, ledger, class_id
        self.backend = SimpleNamespace(ledger=ledger, export=lambda chunk: os.memfd_create(f"chunk{chunk}"),
                                       settle=lambda: None)
        self.before_dialog = lambda: None
        self.dialogs = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_unix_server(self._dialog, self.path))
        ready.set()
        self.loop.run_forever()

    async def _dialog(self, reader, writer) -> None:
        await reader.readline()  # "chunks <token>"
        sync = chunk_sync.ChunkSync(self.backend, 7, self.class_id)
        self.dialogs += 1
        self.before_dialog()
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(writer.get_extra_info("socket").fileno()))
        try:
            raw.setblocking(False)
            await chunk_sync.serve(reader, raw, sync)
        finally:
            raw.close()
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def daemon(tmp_path):
    ledger = ChunkLedger()
    ledger.add_class(0, "a")
    ledger.add_class(1, "a")
    d = Daemon(str(tmp_path / "kvpoold.sock.handoff"), ledger, 0)
    yield d
    d.close()


def test_a_sync_maps_the_class_places_and_acks_them(daemon):
    placed = {i: daemon.ledger.place(0, i).chunk for i in (0, 3)}
    arena = RecordingArena(8)
    generation = sync_chunks(grpc_path(daemon), b"\x01", arena)
    assert generation == daemon.ledger.generation[0]
    assert sorted(arena.mapped) == sorted(placed.items())
    assert daemon.ledger.maybe[7] == set(placed.values())


def test_a_chunk_that_moved_during_the_dialog_is_not_mapped_and_the_client_starts_again(daemon):
    """The answer lists a chunk that then leaves its place unmapped by anyone and backs another class's place:
    the daemon says ``moved`` instead of sending it, and the client's second dialog finds the place empty."""
    chunk = daemon.ledger.place(0, 2).chunk

    def move_it_once():
        if daemon.dialogs == 1:
            daemon.ledger.unplace(0, 2)
            assert daemon.ledger.place(1, 5).chunk == chunk

    daemon.before_dialog = move_it_once
    arena = RecordingArena(8)
    sync_chunks(grpc_path(daemon), b"\x01", arena)
    assert daemon.dialogs == 2
    assert arena.mapped == [] and not arena.chunk_of.any()
    assert chunk not in daemon.ledger.maybe[7]


def grpc_path(daemon) -> str:
    """The gRPC socket path whose side socket the daemon listens on."""
    return daemon.path[: -len(".handoff")]
