"""Every value checked at start: a bad one raises ``ConfigError`` naming the key, the value and its source."""

from __future__ import annotations

import os
from typing import Mapping

from .limits import (
    MAX_BYTES, MAX_COUNT, MAX_MESSAGE_BYTES, MAX_SECONDS, MAX_TOKENS_PER_CALL, PER_USER_CAPS, SUN_PATH_MAX,
    needed_message_bytes,
)
from .options import Config, ConfigError, group_id
from .remote_tier import validate_remote

def memory_total() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the allocation reports ENOMEM itself
        return 0



def validate(cfg: Config, sources: Mapping[str, str]) -> None:
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
        total = memory_total()
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
    validate_connections(cfg, bad)
    if cfg.shutdown_timeout < 0:
        raise bad("shutdown_timeout", "must be >= 0 seconds")
    if cfg.release_after_seconds < 0:
        raise bad("release_after_seconds", "must be >= 0 seconds (0: release an empty slab at once)")
    if not cfg.metrics_address:
        raise bad("metrics_address", "must be an address to listen on, like 127.0.0.1 or 0.0.0.0")
    if cfg.socket_group:
        try:
            group_id(cfg.socket_group)
        except KeyError:
            raise bad("socket_group", "no such group") from None
    admin = cfg.admin_socket_path()
    if admin and os.path.abspath(admin) == os.path.abspath(cfg.socket):
        raise bad("admin_socket", "must differ from socket")
    validate_remote(cfg, bad)


def validate_connections(cfg: Config, bad) -> None:
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
