"""Attaching to kvpoold (with retry while it is away) and the calls of the session that made."""

from __future__ import annotations

import os
import time

from .connection import Connection
from .errors import FailedPrecondition, InvalidArgument, Unavailable
from .handoff import attach_ticket
from .ipc import DeviceMismatch, client_bus_id
from .layout import Layout
from .protocol import kvpool_pb2 as pb


def device_bus_id(device) -> str:
    """PCI bus id of this client's GPU: ``device``, else torch's current device once CUDA is in use; "" if none.

    The daemon binds the session to that GPU's pool (``kvpoold/server/pools.py``).
    """
    try:
        return client_bus_id(device)
    except DeviceMismatch as exc:
        raise FailedPrecondition(str(exc)) from None
    except ValueError as exc:  # not a device
        raise InvalidArgument(str(exc)) from None


def attach_request(name: str, layout: Layout, device) -> pb.AttachRequest:
    return pb.AttachRequest(
        name=name, pid=os.getpid(),
        layout=pb.Layout(
            model_id=layout.model_id, revision=layout.revision, num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
            block_size=layout.block_size,
        ),
        device_bus_id=device_bus_id(device),  # a daemon serving several GPUs: this GPU's pool
    )


def attach(conn: Connection, req: pb.AttachRequest, *, retry_for: float):
    """Attach; with ``retry_for`` > 0, retry UNAVAILABLE with backoff for that many seconds."""
    deadline = time.monotonic() + retry_for
    delay = 0.05
    while True:
        try:
            req.attach_ticket = attach_ticket(conn.address)  # one-time: a retry needs a new one
            return conn.call("Attach", req)
        except Unavailable:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(delay, left))
            delay = min(delay * 2, 2.0)


class Session:
    """One attached session: its connection, its token, and when it last called the daemon.

    ``call`` counts the calls (``rpcs``) and renews the lease's clock
    (``last_call``, which the heartbeat reads).

    Args:
        address: the daemon's socket (``Connection``).
        name, layout, device: what the attach says (see ``kvpool.connect``).
        timeout: per call; with ``reconnect``, also how long the attach is retried.
    """

    def __init__(self, address: str | None, *, name: str, layout: Layout, timeout: float, device,
                 reconnect: bool) -> None:
        self.conn = Connection(address, timeout=timeout)
        try:
            request = attach_request(name, layout, device)
            self.attach_reply = attach(self.conn, request, retry_for=timeout if reconnect else 0.0)
        except BaseException:
            self.conn.close()
            raise
        self.token = self.attach_reply.session
        self.rpcs = 0
        self.last_call = time.monotonic()

    def call(self, method: str, request):
        self.rpcs += 1
        self.touch()
        return self.conn.call(method, request)

    def touch(self) -> None:
        """The daemon heard from this session just now (the lease runs from here)."""
        self.last_call = time.monotonic()
