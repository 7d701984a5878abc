"""kvpoold's configuration: defaults < TOML file < KVPOOL_* environment < flags.

One precedence rule, applied key by key.  Every value is validated at start;
a bad one raises ``ConfigError`` naming the key, the value and where it came
from, so the daemon can print one clear line and exit.
"""

from __future__ import annotations

import grp
import importlib.util
import math
import os
import re
import stat
import tomllib
import urllib.parse
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

DEFAULT_SOCKET = "/run/kvpoold/kvpoold.sock"
DEFAULT_CONFIG = "/etc/kvpoold/kvpoold.toml"
ENV_PREFIX = "KVPOOL_"

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}


# Upper bounds a value must respect to be usable end to end.  Counts of blocks,
# sequences and tokens travel as int32 (block ids, token counts) or uint32
# (reserve target) on the wire; sizes as uint64 and through off_t/mmap.
MAX_COUNT = 2**31 - 1
MAX_BYTES = 2**63 - 1
MAX_SECONDS = 365 * 86400.0  # asyncio timers overflow far above; a year is "never" for an operator
# The largest gRPC message either way (the daemon's replies; max_message_bytes at most).
# A call carries 4 bytes per token plus per-sequence arrays; at 8 bytes per token the
# most tokens one call may carry still fits, so max_tokens_per_call answers first.
MAX_MESSAGE_BYTES = 256 << 20
MAX_TOKENS_PER_CALL = MAX_MESSAGE_BYTES // 8
# What the largest legitimate request needs on the wire (``receive_limit``): per token its
# id and a claimed block (4 + 4 bytes); per sequence its id, count, claim count, a freed id
# and a prompt's framing (64 bytes); per reserve block a return (8); strings (name, model
# id, extra keys) room for 16 of the longest; and the message's own framing.
EXTRA_KEY_FACTOR = 4  # an extra key (a LoRA id, an adapter list) may have this many times max_string_bytes
TOKEN_WIRE_BYTES = 8
SEQUENCE_WIRE_BYTES = 64
RESERVE_WIRE_BYTES = 8
STRINGS_PER_CALL = 16
MESSAGE_SLACK_BYTES = 64 << 10
REMOTE_SCHEMES = ("redis", "rediss", "unix")
# The remote tier's secret: 128 bits at least; far more is no key file (a path given by mistake).
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096
# caps on what one user may hold at once (0: none); each is counted per uid
PER_USER_CAPS = ("max_tickets_per_user", "max_sessions_per_user", "max_handoff_connections_per_user")
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
SUN_PATH_MAX = 107


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names key, value and source."""


def parse_bytes(value: Any) -> int:
    """``2GiB``, ``512MiB``, ``1.5G``, ``4096`` -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 2GiB")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("sizes cannot be negative")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError("expected a size like 2GiB, 512MiB, 1.5G or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _float(value: Any) -> float:
    """A finite number: NaN compares false with every bound and infinity overflows timers."""
    if isinstance(value, bool):
        raise ValueError("expected a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError("must be a finite number (not nan or inf)")
    return out


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("expected an integer")
        return int(value)
    return int(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _devices(value: Any) -> tuple[int, ...]:
    """``0``, ``0,1``, ``[0, 1]`` -> (0, 1): the GPUs one daemon serves, one pool each (cuda backend)."""
    if isinstance(value, bool):
        raise ValueError("expected GPU ordinals like 0 or 0,1")
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = str(value).split(",")
    texts = [str(v).strip() for v in items]
    if not texts or any(not t.isdigit() for t in texts) or any(isinstance(v, bool) for v in items):
        raise ValueError("expected GPU ordinals like 0 or 0,1 (comma-separated, no gaps, no ranges)")
    out = tuple(int(t) for t in texts)
    dup = sorted({d for d in out if out.count(d) > 1})
    if dup:
        raise ValueError(f"GPU {dup[0]} is listed twice: each GPU gets one pool")
    return out


def _mode(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(str(value), 8)


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
        return _gid(self.socket_group) if self.socket_group else None


def admin_socket_for(socket: str, admin_socket: str = "auto") -> str:
    """``auto``: ``kvpoold.sock`` -> ``kvpoold-admin.sock`` beside it; ``""``/``none``: no admin socket."""
    if admin_socket.lower() in ("", "none", "off"):
        return ""
    if admin_socket.lower() != "auto":
        return admin_socket
    base = socket[:-5] if socket.endswith(".sock") else socket
    return base + "-admin.sock"


def _memory_total() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the allocation reports ENOMEM itself
        return 0


def _gid(group: str) -> int:
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


_PARSERS = {
    "socket": str,
    "socket_mode": _mode,
    "backend": str,
    "pool_bytes": parse_bytes,
    "gpu_memory_fraction": _float,
    "devices": _devices,
    "chunk_bytes": parse_bytes,
    "grace_seconds": _float,
    "max_reserve_blocks": _int,
    "max_sessions": _int,
    "eviction_policy": str,
    "shm_dir": str,
    "log_level": str,
    "host_bytes": parse_bytes,
    "disk_dir": str,
    "disk_bytes": parse_bytes,
    "metrics_port": _int,
    "metrics_address": str,
    "socket_group": str,
    "admin_socket": str,
    "admin_socket_mode": _mode,
    "max_blocks_per_session": _int,
    "shutdown_timeout": _float,
    "max_sequences_per_session": _int,
    "max_tokens_per_call": _int,
    "lease_seconds": _float,
    "max_string_bytes": _int,
    "tenant_by": str,
    "cuda_memory": str,
    "release_after_seconds": _float,
    "remote_url": str,
    "remote_password_file": str,
    "remote_key_file": str,
    "remote_tls_ca": str,
    "remote_tls_cert": str,
    "remote_tls_key": str,
    "remote_cluster": _bool,
    "remote_prefix": str,
    "remote_ttl": _float,
    "remote_timeout": _float,
    "remote_write": str,
    "events_stream": str,
    "max_classes": _int,
    "max_classes_per_tenant": _int,
    "max_tickets_per_user": _int,
    "max_sessions_per_user": _int,
    "max_handoff_connections_per_user": _int,
    "handoff_timeout": _float,
    "fair_share": _bool,
    "max_pool_share_per_user": _float,
    "grpc_idle_seconds": _float,
    "max_grpc_connections": _int,
    "max_grpc_streams": _int,
    "max_message_bytes": parse_bytes,
}
KEYS = tuple(f.name for f in fields(Config))
assert set(KEYS) == set(_PARSERS)


def _validate(cfg: Config, sources: Mapping[str, str]) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{key} = {getattr(cfg, key)!r} ({sources.get(key, 'default')}): {why}")

    for key in ("max_reserve_blocks", "max_sessions", "max_blocks_per_session", "max_sequences_per_session",
                "max_tokens_per_call", "max_string_bytes", "max_classes", "max_classes_per_tenant", *PER_USER_CAPS,
                "max_grpc_connections", "max_grpc_streams"):
        if getattr(cfg, key) > MAX_COUNT:
            raise bad(key, f"must be at most {MAX_COUNT} (the wire and block ids are 32-bit)")
    if cfg.max_tokens_per_call > MAX_TOKENS_PER_CALL:
        raise bad("max_tokens_per_call", f"must be at most {MAX_TOKENS_PER_CALL} (larger calls exceed the "
                                         f"{MAX_MESSAGE_BYTES >> 20} MiB gRPC message limit)")
    for key in ("pool_bytes", "chunk_bytes", "host_bytes", "disk_bytes"):
        if getattr(cfg, key) > MAX_BYTES:
            raise bad(key, f"must be at most {MAX_BYTES} bytes")
    for key in ("grace_seconds", "shutdown_timeout", "release_after_seconds"):
        if getattr(cfg, key) > MAX_SECONDS:
            raise bad(key, f"must be at most {MAX_SECONDS:.0f} seconds (a year)")
    for key, path in (("socket", cfg.socket), ("admin_socket", cfg.admin_socket_path())):
        if path and len(os.fsencode(path)) > SUN_PATH_MAX:
            raise bad(key, f"a Unix socket path is at most {SUN_PATH_MAX} bytes ({len(os.fsencode(path))} given)")
    if cfg.host_bytes:
        total = _memory_total()
        if total and cfg.host_bytes > total:
            raise bad("host_bytes", f"larger than this machine's memory ({total} bytes)")
    if cfg.backend not in ("cpu", "cuda"):
        raise bad("backend", "must be cpu or cuda")
    if not cfg.socket:
        raise bad("socket", "must be a path")
    if not 0 < cfg.gpu_memory_fraction <= 1:
        raise bad("gpu_memory_fraction", "must be in (0, 1]")
    if cfg.chunk_bytes < 4096 or cfg.chunk_bytes & (cfg.chunk_bytes - 1):
        raise bad("chunk_bytes", "must be a power of two of at least 4096")
    if cfg.pool_bytes and cfg.pool_bytes < cfg.chunk_bytes:
        raise bad("pool_bytes", f"must hold at least one chunk ({cfg.chunk_bytes} bytes)")
    if cfg.tenant_by not in ("uid", "gid", "none"):
        raise bad("tenant_by", "must be uid, gid or none")
    if cfg.cuda_memory not in ("auto", "vmm", "ipc"):
        raise bad("cuda_memory", "must be auto, vmm or ipc")
    if cfg.grace_seconds < 0:
        raise bad("grace_seconds", "must be >= 0")
    if not (cfg.lease_seconds == 0 or 0.3 <= cfg.lease_seconds <= 86400):
        raise bad("lease_seconds", "must be 0 (no lease) or between 0.3 and 86400 seconds")
    if cfg.max_reserve_blocks < 0:
        raise bad("max_reserve_blocks", "must be >= 0")
    if cfg.max_sessions < 1:
        raise bad("max_sessions", "must be >= 1")
    if cfg.eviction_policy != "lru":
        raise bad("eviction_policy", "must be lru")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise bad("log_level", "must be debug, info, warning or error")
    if not 0 <= cfg.metrics_port <= 65535:
        raise bad("metrics_port", "must be a TCP port (0 disables)")
    if not 0 <= cfg.socket_mode <= 0o777:
        raise bad("socket_mode", "must be a file mode like 660")
    if not 0 <= cfg.admin_socket_mode <= 0o777:
        raise bad("admin_socket_mode", "must be a file mode like 600")
    if cfg.max_blocks_per_session < 0:
        raise bad("max_blocks_per_session", "must be >= 0 (0: no quota)")
    if cfg.max_sequences_per_session < 0:
        raise bad("max_sequences_per_session", "must be >= 0 (0: no limit)")
    if cfg.max_tokens_per_call < 0:
        raise bad("max_tokens_per_call", "must be >= 0 (0: no limit)")
    if cfg.max_string_bytes < 0:
        raise bad("max_string_bytes", "must be >= 0 (0: no limit)")
    for key in ("max_classes", "max_classes_per_tenant", *PER_USER_CAPS, "max_grpc_connections",
                "max_grpc_streams"):
        if getattr(cfg, key) < 0:
            raise bad(key, "must be >= 0 (0: no cap)")
    _validate_connections(cfg, bad)
    if cfg.shutdown_timeout < 0:
        raise bad("shutdown_timeout", "must be >= 0 seconds")
    if cfg.release_after_seconds < 0:
        raise bad("release_after_seconds", "must be >= 0 seconds (0: release an empty slab at once)")
    if not cfg.metrics_address:
        raise bad("metrics_address", "must be an address to listen on, like 127.0.0.1 or 0.0.0.0")
    if cfg.socket_group:
        try:
            _gid(cfg.socket_group)
        except KeyError:
            raise bad("socket_group", "no such group") from None
    admin = cfg.admin_socket_path()
    if admin and os.path.abspath(admin) == os.path.abspath(cfg.socket):
        raise bad("admin_socket", "must differ from socket")
    _validate_remote(cfg, bad)


def _validate_connections(cfg: Config, bad) -> None:
    """The side sockets' deadline, the gRPC servers' options and the pool share."""
    if not 0 < cfg.handoff_timeout <= 3600:
        raise bad("handoff_timeout", "must be in (0, 3600] seconds")
    if not (cfg.grpc_idle_seconds == 0 or 0.1 <= cfg.grpc_idle_seconds <= MAX_SECONDS):
        raise bad("grpc_idle_seconds", "must be 0 (never) or between 0.1 seconds and a year")
    if cfg.max_grpc_streams and cfg.max_sessions_per_user and cfg.max_grpc_streams <= cfg.max_sessions_per_user:
        raise bad("max_grpc_streams", f"must be above max_sessions_per_user ({cfg.max_sessions_per_user}): the "
                                      "sessions of one process share its connection, each with a call always open")
    if not 0 < cfg.max_pool_share_per_user <= 1:
        raise bad("max_pool_share_per_user", "must be in (0, 1] (a fraction of each pool)")
    if cfg.max_message_bytes:
        if not 1 << 16 <= cfg.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise bad("max_message_bytes", f"must be 0 (what the limits need) or between 64KiB and "
                                           f"{MAX_MESSAGE_BYTES >> 20}MiB")
        need = needed_message_bytes(cfg)
        if cfg.max_message_bytes < need:
            raise bad("max_message_bytes", f"is below the {need} bytes the largest call allowed by "
                                           "max_tokens_per_call, max_sequences_per_session and max_string_bytes "
                                           "needs; lower those or leave max_message_bytes at 0")


def needed_message_bytes(cfg: Config) -> int:
    """The largest request a client may send within the per-call and per-session limits (``MAX_MESSAGE_BYTES``
    when one of them is off)."""
    if not (cfg.max_tokens_per_call and cfg.max_sequences_per_session and cfg.max_string_bytes):
        return MAX_MESSAGE_BYTES
    need = (TOKEN_WIRE_BYTES * cfg.max_tokens_per_call + SEQUENCE_WIRE_BYTES * cfg.max_sequences_per_session
            + RESERVE_WIRE_BYTES * cfg.max_reserve_blocks
            + STRINGS_PER_CALL * EXTRA_KEY_FACTOR * cfg.max_string_bytes + MESSAGE_SLACK_BYTES)
    return min(need, MAX_MESSAGE_BYTES)


def receive_limit(cfg: Config) -> int:
    """The gRPC servers' receive limit: ``max_message_bytes``, or what the limits need (0)."""
    return cfg.max_message_bytes or needed_message_bytes(cfg)


def _validate_remote(cfg: Config, bad) -> None:
    if cfg.remote_url:
        why = check_url(cfg.remote_url)
        if why:
            raise ConfigError(f"remote_url = {_redacted(cfg.remote_url)!r}: {why}")
        if importlib.util.find_spec("redis") is None:
            raise ConfigError("remote_url needs the redis package: pip install 'kvpool[remote]'")
    elif cfg.events_stream:
        raise bad("events_stream", "needs remote_url (the stream lives on the remote tier's server)")
    elif cfg.remote_key_file:
        raise bad("remote_key_file", "needs remote_url (it keys the remote tier)")
    if cfg.remote_password_file and not os.access(cfg.remote_password_file, os.R_OK):
        raise bad("remote_password_file", "cannot be read")
    if cfg.remote_key_file:
        try:
            read_key_file(cfg.remote_key_file)
        except ValueError as exc:
            raise bad("remote_key_file", str(exc)) from None
    _validate_tls(cfg, bad)
    if not cfg.remote_prefix or any(c.isspace() for c in cfg.remote_prefix):
        raise bad("remote_prefix", "must be a non-empty string without spaces")
    if not 0 <= cfg.remote_ttl <= MAX_SECONDS:
        raise bad("remote_ttl", "must be between 0 (no expiry) and a year, in seconds")
    if not 0 < cfg.remote_timeout <= 60:
        raise bad("remote_timeout", "must be in (0, 60] seconds")
    if cfg.remote_write not in ("through", "evict"):
        raise bad("remote_write", "must be through or evict")


def read_key_file(path: str) -> bytes:
    """The remote tier's secret in ``path``, without surrounding whitespace (a trailing newline).

    The file must be a regular file of this process's user that no group or other user may read or
    write (the secret lets whoever holds it write blocks every daemon serves to its models), holding at
    least ``MIN_KEY_BYTES`` bytes; else ValueError saying why (never what it holds).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)  # of the file opened: nothing can swap it between the check and the read
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"is owned by uid {st.st_uid}, not by the daemon's user (uid {os.geteuid()}): chown it")
        if st.st_mode & 0o077:
            raise ValueError(f"has mode {stat.S_IMODE(st.st_mode):o}: group and others must have no access "
                             f"(chmod 600)")
        secret = os.read(fd, MAX_KEY_BYTES + 1).strip()
    finally:
        os.close(fd)
    if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
        raise ValueError(f"holds {len(secret)} bytes of key; {MIN_KEY_BYTES} to {MAX_KEY_BYTES} are needed "
                         f"(e.g. head -c 32 /dev/urandom > FILE)")
    return secret


def _validate_tls(cfg: Config, bad) -> None:
    """The TLS files: only with a rediss:// URL, readable, and certificates and keys that load."""
    import ssl

    keys = [k for k in ("remote_tls_ca", "remote_tls_cert", "remote_tls_key") if getattr(cfg, k)]
    if not keys:
        return
    if urllib.parse.urlsplit(cfg.remote_url).scheme != "rediss":
        raise bad(keys[0], "needs a rediss:// remote_url (TLS)")
    for key in keys:
        if not os.access(getattr(cfg, key), os.R_OK):
            raise bad(key, "cannot be read")
    if cfg.remote_tls_key and not cfg.remote_tls_cert:
        raise bad("remote_tls_key", "needs remote_tls_cert (the client certificate it belongs to)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cfg.remote_tls_ca:
        try:
            context.load_verify_locations(cafile=cfg.remote_tls_ca)
        except (ssl.SSLError, ValueError) as exc:
            raise bad("remote_tls_ca", f"holds no PEM certificate ({exc})") from None
    if cfg.remote_tls_cert:
        try:
            context.load_cert_chain(cfg.remote_tls_cert, cfg.remote_tls_key or None)
        except (ssl.SSLError, ValueError) as exc:
            raise bad("remote_tls_cert", f"no PEM certificate with its private key (remote_tls_key) ({exc})") from None


def _redacted(url: str) -> str:
    try:
        return redact(url)
    except ValueError:
        return "<unparsable URL>"


def redact(url: str) -> str:
    """``url`` without its password (for logs and stats)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.username:
        netloc = f"{parts.username}:***@{netloc}"
    else:
        netloc = f":***@{netloc}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_url(url: str) -> str:
    """Why ``url`` is no Redis URL ("" if it is one): ``redis://``, ``rediss://`` or ``unix://``."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in REMOTE_SCHEMES:
        return f"the scheme must be one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}"
    if parts.scheme == "unix":
        if not parts.path:
            return "unix:// needs a socket path (unix:///run/redis.sock)"
        return ""
    if not parts.hostname:
        return "needs a host (redis://host:6379/0)"
    if port is not None and not 0 < port < 65536:
        return "the port must be in 1..65535"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"the database must be a number, got {db!r}"
    return ""



def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults < file < environment < flags.

    ``path`` None means the default file if it exists; a path that was asked
    for explicitly must exist.  ``flags`` holds only the flags actually given.
    """
    env = os.environ if env is None else env
    flags = flags or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    explicit = path is not None or "config" in flags or f"{ENV_PREFIX}CONFIG" in env
    path = flags.get("config") or path or env.get(f"{ENV_PREFIX}CONFIG") or DEFAULT_CONFIG
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        table = doc.get("kvpoold", doc)
        for key, value in table.items():
            if key not in _PARSERS:
                raise ConfigError(f"config file {path}: unknown key {key!r} (known: {', '.join(KEYS)})")
            values[key], sources[key] = value, f"from {path}"
    elif explicit:
        raise ConfigError(f"config file {path} does not exist")

    for key in KEYS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            values[key], sources[key] = env[name], f"from ${name}"
    for key, value in flags.items():
        if key == "config" or value is None:
            continue
        if key not in _PARSERS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key], sources[key] = value, f"from --{key.replace('_', '-')}"

    parsed = {}
    for key, value in values.items():
        try:
            parsed[key] = _PARSERS[key](value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key} = {value!r} ({sources[key]}): {exc}") from None
    cfg = replace(Config(), **parsed)
    _validate(cfg, sources)
    return cfg


def config_as_dict(cfg: Config) -> dict[str, Any]:
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else (oct(v)[2:] if f.name.endswith("socket_mode") else v)
    out["remote_url"] = _redacted(cfg.remote_url)  # the config is shown to every client (GetConfig)
    return out


def changed_keys(old: Config, new: Config) -> list[str]:
    """The settings whose value differs between two configurations."""
    return [f.name for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)]
