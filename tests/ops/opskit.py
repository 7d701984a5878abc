"""Helpers for the operations tests: kvpoolctl as a real command, a notify socket, a free port.

(A uniquely named module: test folders have no __init__.py, so "conftest" or "helpers" would clash.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import kvpool

LAYOUT = kvpool.Layout("ops-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def run_ctl(sock: str, *args: str, admin: str | None = None, timeout: float = 60):
    cmd = [sys.executable, "-m", "kvpoold.ctl", "--socket", sock]
    if admin is not None:
        cmd += ["--admin-socket", admin]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env["COLUMNS"] = "200"  # rich wraps tables at the terminal's width
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotifySocket:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvpool-notify-")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[str] = []

    def wait_for(self, line: str, timeout: float = 20.0, count: int = 1) -> list[str]:
        """Collect datagrams until ``count`` of them contain ``line``; returns all seen so far."""
        deadline = time.monotonic() + timeout
        while sum(line in m.split("\n") for m in self.messages) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {line!r} (x{count}) on the notify socket; got {self.messages}")
            self.sock.settimeout(left)
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
        return self.messages

    def close(self) -> None:
        self.sock.close()


def wait_until(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
