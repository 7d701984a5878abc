"""The client side of the side socket against a real Unix socket whose server refuses at accept."""

from __future__ import annotations

import socket
import threading

import pytest

from kvpool.errors import Unavailable
from kvpool.handoff import _ask


def refusing_server(path: str, answer: bytes) -> threading.Thread:
    """Accept one connection, answer ``answer`` without reading a byte, close: as a daemon over its caps does."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                if answer:
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_refusal_sent_before_the_request_is_read_reaches_the_caller(tmp_path):
    # a request far larger than the socket's buffers: the send is still going when the server closes
    address = str(tmp_path / "d.sock")
    server = refusing_server(address + ".handoff", b"err too many connections\n")
    reply, fds = _ask(address, b"x" * (8 << 20), timeout=30)
    server.join(30)
    assert reply == b"err too many connections\n" and fds == []


def test_a_server_that_closes_without_an_answer_is_unavailable(tmp_path):
    address = str(tmp_path / "d.sock")
    server = refusing_server(address + ".handoff", b"")
    with pytest.raises(Unavailable, match="side socket"):
        _ask(address, b"x" * (8 << 20), timeout=30)
    server.join(30)
