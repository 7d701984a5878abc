"""The daemon connection shared by model clients and operator tools."""

from __future__ import annotations

import os

import grpc

from .errors import from_rpc_error
from .protocol import kvpool_pb2 as pb
from .protocol import kvpool_pb2_grpc as pb_grpc
from .protocol.stats import from_message
from .stats import ClientInfo, PoolStats, SequenceInfo

DEFAULT_SOCKET = "/run/kvpoold/kvpoold.sock"
DEFAULT_TIMEOUT_S = 30.0


def resolve_address(address: str | None) -> str:
    """``None`` -> $KVPOOL_SOCKET or the default socket; a path -> ``unix://path``."""
    address = address or os.environ.get("KVPOOL_SOCKET") or DEFAULT_SOCKET
    if "://" in address or address.startswith("unix:"):
        return address
    return "unix://" + os.path.abspath(address)


class Connection:
    """A gRPC channel to kvpoold whose calls raise kvpool's typed errors."""

    def __init__(self, address: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = resolve_address(address)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
        ])
        self._stub = pb_grpc.KVPoolStub(self._channel)

    def call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- operator calls (no session needed) -------------------------------------------
    def ping(self, timeout: float | None = None) -> None:
        self.call("Ping", pb.PingRequest(), timeout)

    def stats(self) -> PoolStats:
        return from_message(PoolStats, self.call("Stats", pb.StatsRequest()))

    def clients(self) -> list[ClientInfo]:
        return [from_message(ClientInfo, c) for c in self.call("Clients", pb.ClientsRequest()).clients]

    def sequences_of(self, session_id: int, session: bytes = b"") -> list[SequenceInfo]:
        """Another session's sequences (admin socket), or one's own when ``session`` is its token."""
        r = self.call("Sequences", pb.SequencesRequest(session_id=session_id, session=session))
        return [_seq_info(t) for t in r.sequences]

    def evict(self, class_id: int | None = None, max_blocks: int | None = None) -> int:
        r = self.call("Evict", pb.EvictRequest(class_id=-1 if class_id is None else class_id,
                                               max_blocks=max_blocks or 0))
        return r.evicted

    def check(self) -> tuple[bool, str]:
        r = self.call("Check", pb.CheckRequest())
        return r.ok, r.detail

    # -- operations ----------------------------------------------------------
    def drain(self, resume: bool = False) -> dict:
        """Admin socket only: stop (``resume``: restart) taking new attaches and sequences."""
        r = self.call("Drain", pb.DrainRequest(resume=resume))
        return {"draining": r.draining, "sessions": r.sessions, "sequences": r.sequences}

    def reset(self) -> dict:
        """Admin socket only: drop every session and every cached block (an empty pool)."""
        r = self.call("Reset", pb.ResetRequest())
        return {"sessions_dropped": r.sessions_dropped, "blocks_released": r.blocks_released,
                "cached_evicted": r.cached_evicted}

    def resize(self, pool_bytes: int, device: int | None = None) -> list[dict]:
        """Admin socket only: move the ceiling of the pool on ``device`` (None: every pool); per pool, how far it got."""
        r = self.call("Resize", pb.ResizeRequest(pool_bytes=pool_bytes, device=-1 if device is None else device))
        return [{"device": p.device, "target_bytes": p.target_bytes, "pool_bytes": p.pool_bytes, "met": p.met,
                 "freed_bytes": p.freed_bytes, "evicted_blocks": p.evicted_blocks,
                 "max_pool_bytes": p.max_pool_bytes} for p in r.pools]
    def events(self, follow: bool = False, recent: int = 1024, timeout: float | None = None):
        """Admin socket only: KV events as dicts (kind, tier, from_tier, model_ids, layout, block_hashes as
        hex, dropped, time, device): the recent ones, then (``follow``) new ones as they happen.

        Args:
            follow: keep the stream open (iterate until the caller stops; ``timeout`` ends it).
            recent: how many recent events come first.
            timeout: seconds the whole stream may stay open (None: no limit with ``follow``).
        Returns:
            An iterator of dicts.
        """
        stream = self._stub.Events(pb.EventsRequest(follow=follow, recent=recent),
                                   timeout=timeout if timeout is not None or follow else self.timeout)
        try:
            for ev in stream:
                yield {"seq": ev.seq, "kind": ev.kind, "tier": ev.tier, "from_tier": ev.from_tier,
                       "model_ids": list(ev.model_ids), "layout": ev.layout,
                       "block_hashes": [h.hex() for h in ev.block_hashes], "dropped": ev.dropped,
                       "time": ev.time, "device": ev.device}
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and follow:
                return
            raise from_rpc_error(exc, self.address) from None
        finally:
            stream.cancel()

    def config(self) -> dict:
        """The daemon's running configuration; ``live_keys`` are those SIGHUP can change."""
        import json

        r = self.call("GetConfig", pb.GetConfigRequest())
        return {"config": json.loads(r.config_json), "live_keys": list(r.live_keys), "admin_socket": r.admin_socket}


def _seq_info(t) -> SequenceInfo:
    import numpy as np

    return SequenceInfo(t.seq_id, t.num_tokens, t.num_cached_tokens,
                        tuple(np.frombuffer(t.block_table, "<i4").tolist()))
