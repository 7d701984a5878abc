"""The daemon connection shared by model clients and operator tools."""

from __future__ import annotations

import os

import grpc

from .errors import from_rpc_error
from .protocol import kvpool_pb2 as pb
from .protocol import kvpool_pb2_grpc as pb_grpc
from .stats import ClassStats, ClientInfo, DeviceStats, PoolStats, SequenceInfo, TierStats

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
        r = self.call("Stats", pb.StatsRequest())
        return PoolStats(
            backend=r.backend, version=r.version, pool_bytes=r.pool_bytes, chunk_bytes=r.chunk_bytes,
            free_bytes=r.free_bytes, sequences=r.sequences, clients=r.clients,
            uptime_seconds=r.uptime_seconds, rpcs=r.rpcs,
            classes=_classes(r.classes),
            tiers=_tiers(r.tiers),
            draining=r.draining,
            devices=tuple(
                DeviceStats(index=d.index, device=d.device, bus_id=d.bus_id, pool_bytes=d.pool_bytes,
                            free_bytes=d.free_bytes, sequences=d.sequences, clients=d.clients,
                            classes=_classes(d.classes), tiers=_tiers(d.tiers))
                for d in r.devices
            ),
        )

    def clients(self) -> list[ClientInfo]:
        r = self.call("Clients", pb.ClientsRequest())
        return [
            ClientInfo(c.session_id, c.name, c.pid, c.model_id, c.class_id, c.sequences, c.reserved_blocks,
                       c.connected, c.attached_seconds, device=c.device)
            for c in r.clients
        ]

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

    # -- operations (issue 8) ----------------------------------------------------------
    def drain(self, resume: bool = False) -> dict:
        """Admin socket only: stop (``resume``: restart) taking new attaches and sequences."""
        r = self.call("Drain", pb.DrainRequest(resume=resume))
        return {"draining": r.draining, "sessions": r.sessions, "sequences": r.sequences}

    def reset(self) -> dict:
        """Admin socket only: drop every session and every cached block (an empty pool)."""
        r = self.call("Reset", pb.ResetRequest())
        return {"sessions_dropped": r.sessions_dropped, "blocks_released": r.blocks_released,
                "cached_evicted": r.cached_evicted}

    def config(self) -> dict:
        """The daemon's running configuration; ``live_keys`` are those SIGHUP can change."""
        import json

        r = self.call("GetConfig", pb.GetConfigRequest())
        return {"config": json.loads(r.config_json), "live_keys": list(r.live_keys), "admin_socket": r.admin_socket}


def _seq_info(t) -> SequenceInfo:
    import numpy as np

    return SequenceInfo(t.seq_id, t.num_tokens, t.num_cached_tokens,
                        tuple(np.frombuffer(t.block_table, "<i4").tolist()))


def _classes(msgs) -> tuple[ClassStats, ...]:
    return tuple(
        ClassStats(
            class_id=c.class_id, geometry=c.geometry, models=tuple(c.models), block_bytes=c.block_bytes,
            capacity_blocks=c.capacity_blocks, total_blocks=c.total_blocks, used_blocks=c.used_blocks,
            reserved_blocks=c.reserved_blocks, cached_blocks=c.cached_blocks, free_blocks=c.free_blocks,
            cow_copies=c.cow_copies, evictions=c.evictions, prefix_queries=c.prefix_queries,
            prefix_hits=c.prefix_hits, prefix_query_tokens=c.prefix_query_tokens,
            prefix_hit_tokens=c.prefix_hit_tokens,
            promoted_blocks=c.promoted_blocks, demoted_blocks=c.demoted_blocks,  # tiers (issue 6)
            swapped_out_blocks=c.swapped_out_blocks, swapped_in_blocks=c.swapped_in_blocks,
            swapped_sequences=c.swapped_sequences, lost_blocks=c.lost_blocks,
        )
        for c in msgs
    )


def _tiers(msgs) -> tuple[TierStats, ...]:
    return tuple(
        TierStats(t.tier, t.capacity_bytes, t.used_bytes, t.blocks, pinned_bytes=t.pinned_bytes,
                  blocks_in=t.blocks_in, blocks_out=t.blocks_out, dropped_blocks=t.dropped_blocks,
                  corrupt_blocks=t.corrupt_blocks, bytes_written=t.bytes_written,
                  write_seconds=t.write_seconds, bytes_read=t.bytes_read, read_seconds=t.read_seconds,
                  failed_writes=t.failed_writes, failed_reads=t.failed_reads)
        for t in msgs
    )
