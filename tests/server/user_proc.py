"""A process of another user, driven line by line, for the per-user cap tests: ``python user_proc.py USER SOCKET``.

It starts as root, imports what it needs, drops to ``USER`` (``tenant_proc.drop_to``) and then reads one
JSON command per line on stdin and answers one JSON line on stdout, until stdin closes (then it lets go of
everything it holds).  Errors are answered, never raised: ``{"error": class name, "message": ...}``; every
answer also says how many sessions (``attached``) and blocks in its sequences' tables (``blocks``) the user
holds.

Commands (``op``):
  attach  n, layout     -- attach up to ``n`` more sessions (``kvpool.connect``), stopping at the first refusal
  fill    tokens        -- create sequences of ``tokens`` tokens on every session in turn until one is refused
  create  tokens        -- one sequence on the first session
  tickets n             -- ask the side socket for ``n`` attach tickets; counts the answers
  open    kind, n       -- open up to ``n`` connections to the side socket (``handoff``) or the gRPC socket
                           (``grpc``), as many as the backlog takes, and send nothing on them
  watch   timeout, want -- wait until ``want`` of the open connections were closed by the daemon (or ``timeout``)
  close                 -- close the open connections
  big     bytes         -- a Create carrying a prompt of that many bytes, on the first session
"""

from __future__ import annotations

import json
import socket
import sys
import time

import numpy as np

import kvpool
from kvpool.handoff import attach_ticket, socket_path
from kvpool.protocol import kvpool_pb2 as pb
from tenant_proc import LAYOUT, drop_to


class User:
    def __init__(self, address: str) -> None:
        self.address = address
        self.clients: list = []
        self.sequences: list = []
        self.raw: list[socket.socket] = []

    def attach(self, n: int, layout: dict | None = None) -> dict:
        lay = kvpool.Layout("user-model", **{**LAYOUT, **(layout or {})})
        for _ in range(n):
            self.clients.append(kvpool.connect(self.address, name="capped", layout=lay))
        return {}

    def fill(self, tokens: int) -> dict:
        while True:  # until a create is refused: the error is the answer
            for c in self.clients:
                self.sequences.append(c.create_sequence(self.prompt(tokens)))

    def create(self, tokens: int) -> dict:
        self.sequences.append(self.clients[0].create_sequence(self.prompt(tokens)))
        return {}

    def prompt(self, tokens: int) -> np.ndarray:
        """Tokens no other sequence of this process starts with: no prefix hit shares a block."""
        return np.arange(tokens, dtype=np.uint32) + np.uint32(len(self.sequences) << 16)

    def blocks(self) -> int:
        return sum(len(s.block_table) for s in self.sequences)

    def tickets(self, n: int) -> dict:
        ok, refused = 0, {}
        for _ in range(n):
            try:
                attach_ticket(self.address)
                ok += 1
            except kvpool.KvpoolError as exc:
                refused[str(exc)] = refused.get(str(exc), 0) + 1
        return {"ok": ok, "refused": refused}

    def open(self, kind: str, n: int) -> dict:
        path = socket_path(self.address) if kind == "handoff" else self.address
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:  # the listening socket's backlog is full
                s.close()
                break
            self.raw.append(s)
        return {"opened": len(self.raw)}

    def watch(self, timeout: float, want: int) -> dict:
        """Poll the open connections until ``want`` of them were closed by the daemon; what each said."""
        said = {}
        deadline = time.monotonic() + timeout
        while True:
            for i, s in enumerate(self.raw):
                if i in said:
                    continue
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    data = f"error {exc.errno}".encode()
                if not data:
                    said[i] = ""
                elif data.startswith(b"err"):  # the refusal; the close follows it
                    said[i] = data.decode("ascii", "replace").strip()
            if len(said) >= want or time.monotonic() > deadline:
                return {"closed": len(said), "open": len(self.raw) - len(said),
                        "said": sorted(set(said.values()))}
            time.sleep(0.05)

    def close(self) -> dict:
        for s in self.raw:
            s.close()
        self.raw = []
        return {}

    def big(self, nbytes: int) -> dict:
        c = self.clients[0]
        c._conn.call("Create", pb.CreateRequest(session=c._token, prompts=[pb.Prompt(tokens=b"\0" * nbytes)]),
                     timeout=120)
        return {}

    def release(self) -> None:
        self.close()
        for c in self.clients:
            try:
                c.close()
            except kvpool.KvpoolError:
                pass


def main() -> None:
    user, address = sys.argv[1], sys.argv[2]
    drop_to(user)
    me = User(address)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            out = getattr(me, op)(**cmd) or {}
        except kvpool.KvpoolError as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        out.update(attached=len(me.clients), blocks=me.blocks())  # what this user holds now
        print(json.dumps(out), flush=True)
    me.release()


if __name__ == "__main__":
    main()
