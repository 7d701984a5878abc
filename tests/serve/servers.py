"""``kvpool serve`` in real subprocesses, on a tiny model directory built here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def send_raw(url: str, path: str, body: bytes = b"", **headers: str) -> socket.socket:
    """POSTs ``body`` to ``url + path`` on a connection of its own and returns the socket, the response unread
    (``read_raw``; or close the socket to hang up). ``headers`` (``content_length="..."`` for
    ``Content-Length``) replace the defaults."""
    host, port = url.removeprefix("http://").split(":")
    fields = {"host": host, "connection": "close", "content_type": "application/json",
              "content_length": str(len(body)), **headers}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in fields.items())
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def read_raw(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case names) and body of the response on ``sock``, read to the end."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status.split()[1]), headers, body


class Server:
    """A ``python -m kvpool.serve`` process; ``url`` once ``wait_ready`` returns."""

    def __init__(self, model_dir: str, daemon_socket: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvpool-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.serve", "--model", model_dir, "--socket", daemon_socket,
             "--port", str(self.port), "--served-model-name", "tiny", "--block-size", "8",
             "--max-num-batched-tokens", "64", "--log-level", "warning", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = 60.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpool serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"kvpool serve did not become ready:\n{self.output()}")

    def metric(self, name: str, default: float | None = None) -> float:
        """The value of the metric ``name`` (with its labels: ``name{label="value"}``); ``default`` when the
        server has none yet (a labelled counter appears at its first count)."""
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        if default is None:
            raise KeyError(name)
        return default

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
