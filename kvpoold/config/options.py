"""Every setting of the daemon: its default, how its value is parsed, whether SIGHUP changes it."""

from __future__ import annotations

import grp
from dataclasses import dataclass, fields

from .values import parse_bool, parse_bytes, parse_devices, parse_float, parse_int, parse_mode

DEFAULT_SOCKET = "/run/kvpoold/kvpoold.sock"
DEFAULT_CONFIG = "/etc/kvpoold/kvpoold.toml"
ENV_PREFIX = "KVPOOL_"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names key, value and source."""


@dataclass(frozen=True)
class Config:
    """Every setting of the daemon, with its default."""

    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660  # who may attach: the socket's owner and group
    backend: str = "cpu"  # cpu | cuda
    pool_bytes: int = 0  # 0: cpu -> 1 GiB, cuda -> gpu_memory_fraction of free memory
    gpu_memory_fraction: float = 0.9
    devices: tuple[int, ...] = (0,)  # cuda: one pool per GPU (sizes per GPU); cpu: ignored, one pool
    chunk_bytes: int = 2 << 20  # the unit memory moves between layout classes in
    grace_seconds: float = 5.0  # a vanished client's sequences are freed after this
    max_reserve_blocks: int = 1024  # per session: blocks a client may assign locally
    max_sessions: int = 1024
    eviction_policy: str = "lru"
    shm_dir: str = "/dev/shm"
    log_level: str = "info"
    host_bytes: int = 0
    disk_dir: str = ""
    disk_bytes: int = 0
    metrics_port: int = 0  # 0: no Prometheus endpoint
    # -- operations --
    metrics_address: str = "127.0.0.1"  # where the Prometheus endpoint listens
    socket_group: str = ""  # chgrp the socket (and CPU shared memory) to this group: its members may attach
    admin_socket: str = "auto"  # admin calls (evict, drain, other sessions' sequences); auto: beside the socket
    admin_socket_mode: int = 0o600
    max_blocks_per_session: int = 0  # device blocks one session's sequences may hold; 0: no quota
    shutdown_timeout: float = 30.0  # SIGTERM: how long to wait for clients to detach
    # -- limits --
    # live sequences one session may hold; 0: no limit.  Far above any batch, low enough that one client
    # cannot fill the daemon's memory with sequence records.
    max_sequences_per_session: int = 65536
    # tokens one call may carry (create prompts, step tokens, lookup); 0: no limit.  Larger than any model's
    # context with a margin; bounds how long one call holds the event loop (benchmarks/bench_stall.py).
    max_tokens_per_call: int = 1 << 20
    lease_seconds: float = 10.0  # a session that made no call (the client heartbeats) for this long is dropped; 0: off
    # bytes of a client string (name, model id, revision, dtype); extra keys may have 4x this; 0: no limit
    max_string_bytes: int = 1024
    tenant_by: str = "uid"  # clients of different tenants (uid, gid; none: one tenant) share no memory or cache
    # -- elastic GPU memory --
    cuda_memory: str = "auto"  # vmm: chunks move between classes; ipc: one legacy allocation; auto: vmm if it works
    release_after_seconds: float = 30.0  # a slab empty this long goes back to the GPU (vmm) / the OS (cpu)
    # -- remote tier (3): Redis or Valkey shared by the daemons of several machines --
    remote_url: str = ""  # redis://host:6379/0, rediss://..., unix:///path; "": no remote tier
    remote_password_file: str = ""  # the password, read from this file (instead of the URL)
    remote_key_file: str = ""  # the secret that keys block names and value tags; "": none (the server is trusted)
    remote_tls_ca: str = ""  # rediss://: the CA certificates (PEM) the server's must chain to; "": the system's
    remote_tls_cert: str = ""  # rediss://: this daemon's client certificate (PEM), for servers that require one
    remote_tls_key: str = ""  # rediss://: the client certificate's private key (PEM); "": in remote_tls_cert's file
    remote_cluster: bool = False  # remote_url names one node of a Redis Cluster
    remote_prefix: str = "kvpool"  # every key starts with this (several deployments on one server)
    remote_ttl: float = 86400.0  # seconds a stored block lives; 0: no expiry (the server's maxmemory policy)
    remote_timeout: float = 0.05  # a remote lookup past this counts as a miss, seconds
    remote_write: str = "through"  # through: every written block; evict: blocks leaving the last local tier
    events_stream: str = ""  # also publish KV events to this Redis stream (XADD, capped); "": not
    # layout classes (distinct tenant + geometry) one device pool keeps at once, in all and per tenant; 0: no cap.
    # Idle ones (no session, only cached blocks) are reclaimed, least recently used first, to make room.
    max_classes: int = 64
    max_classes_per_tenant: int = 16
    # -- per-user caps (the uid the kernel reports; 0: no cap): one user cannot lock the others out --
    max_tickets_per_user: int = 64  # attach tickets one user holds unredeemed (each attach takes one for ms)
    max_sessions_per_user: int = 256  # sessions of one user at once (of max_sessions)
    max_handoff_connections_per_user: int = 32  # open connections of one user to a side socket
    handoff_timeout: float = 2.0  # a side-socket connection must send its request (and take the reply) within this
    fair_share: bool = True  # with several users on a pool, each may hold at most pool / users of its memory
    max_pool_share_per_user: float = 1.0  # the most of a pool one user may hold, however many users there are
    # -- the gRPC sockets (per socket; gRPC tells a servicer nothing of its peer, so no cap can be per user) --
    grpc_idle_seconds: float = 60.0  # a connection with no call in progress this long is closed; 0: never
    max_grpc_connections: int = 2048  # connections at once; more are closed at accept; 0: no cap
    # calls in progress on one connection (a client queues more); a process's sessions share one connection,
    # each with its Watch call open: keep it above max_sessions_per_user; 0: no cap
    max_grpc_streams: int = 1024
    max_message_bytes: int = 0  # largest request read; larger ones are refused unread; 0: what the limits need

    def effective_pool_bytes(self) -> int:
        return self.pool_bytes or (1 << 30)

    def admin_socket_path(self) -> str:
        """The admin socket's path; '' when there is none."""
        return admin_socket_for(self.socket, self.admin_socket)

    def socket_gid(self) -> int | None:
        """The gid ``socket_group`` names, None when unset."""
        return group_id(self.socket_group) if self.socket_group else None


def admin_socket_for(socket: str, admin_socket: str = "auto") -> str:
    """``auto``: ``kvpoold.sock`` -> ``kvpoold-admin.sock`` beside it; ``""``/``none``: no admin socket."""
    if admin_socket.lower() in ("", "none", "off"):
        return ""
    if admin_socket.lower() != "auto":
        return admin_socket
    base = socket[:-5] if socket.endswith(".sock") else socket
    return base + "-admin.sock"


def group_id(group: str) -> int:
    if group.isdigit():
        return int(group)
    return grp.getgrnam(group).gr_gid


# Settings SIGHUP changes in a running daemon; every other one needs a restart.
# (socket_mode and socket_group also apply to the shared memory made at start, so they need a restart.)
LIVE_KEYS = frozenset({
    "log_level", "grace_seconds", "max_reserve_blocks", "max_sessions", "max_blocks_per_session",
    "shutdown_timeout", "admin_socket_mode", "max_sequences_per_session", "max_tokens_per_call",
    "lease_seconds", "max_string_bytes", "release_after_seconds", "max_classes", "max_classes_per_tenant",
    "max_tickets_per_user", "max_sessions_per_user", "max_handoff_connections_per_user", "handoff_timeout",
    "fair_share", "max_pool_share_per_user",
})


PARSERS = {
    "socket": str,
    "socket_mode": parse_mode,
    "backend": str,
    "pool_bytes": parse_bytes,
    "gpu_memory_fraction": parse_float,
    "devices": parse_devices,
    "chunk_bytes": parse_bytes,
    "grace_seconds": parse_float,
    "max_reserve_blocks": parse_int,
    "max_sessions": parse_int,
    "eviction_policy": str,
    "shm_dir": str,
    "log_level": str,
    "host_bytes": parse_bytes,
    "disk_dir": str,
    "disk_bytes": parse_bytes,
    "metrics_port": parse_int,
    "metrics_address": str,
    "socket_group": str,
    "admin_socket": str,
    "admin_socket_mode": parse_mode,
    "max_blocks_per_session": parse_int,
    "shutdown_timeout": parse_float,
    "max_sequences_per_session": parse_int,
    "max_tokens_per_call": parse_int,
    "lease_seconds": parse_float,
    "max_string_bytes": parse_int,
    "tenant_by": str,
    "cuda_memory": str,
    "release_after_seconds": parse_float,
    "remote_url": str,
    "remote_password_file": str,
    "remote_key_file": str,
    "remote_tls_ca": str,
    "remote_tls_cert": str,
    "remote_tls_key": str,
    "remote_cluster": parse_bool,
    "remote_prefix": str,
    "remote_ttl": parse_float,
    "remote_timeout": parse_float,
    "remote_write": str,
    "events_stream": str,
    "max_classes": parse_int,
    "max_classes_per_tenant": parse_int,
    "max_tickets_per_user": parse_int,
    "max_sessions_per_user": parse_int,
    "max_handoff_connections_per_user": parse_int,
    "handoff_timeout": parse_float,
    "fair_share": parse_bool,
    "max_pool_share_per_user": parse_float,
    "grpc_idle_seconds": parse_float,
    "max_grpc_connections": parse_int,
    "max_grpc_streams": parse_int,
    "max_message_bytes": parse_bytes,
}
KEYS = tuple(f.name for f in fields(Config))
assert set(KEYS) == set(PARSERS)
