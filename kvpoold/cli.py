"""``kvpoold``: the daemon's command line.

Flags override ``KVPOOL_*`` environment variables, which override the TOML
file (``--config``, default /etc/kvpoold/kvpoold.toml when it exists), which
overrides the defaults.  ``--check-config`` prints the resolved configuration
and exits.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvpoold import __version__
from kvpoold.config import DEFAULT_CONFIG, DEFAULT_SOCKET, ConfigError, config_as_dict, load_config

EPILOG = """examples:
  kvpoold --socket /tmp/kvpool.sock --pool-bytes 2GiB        # CPU pool in shared memory
  kvpoold --backend cuda --gpu-memory-fraction 0.8           # GPU pool, shared over CUDA IPC
  kvpoold --backend cuda --devices 0,1 --pool-bytes 40GiB    # one 40 GiB pool on each of two GPUs
  KVPOOL_POOL_BYTES=4GiB kvpoold --config ./kvpoold.toml
  kvpoold --check-config                                    # print the resolved settings
  kvpoold --metrics-port 9464 --max-blocks-per-session 4096  # Prometheus endpoint, a quota per client

precedence: defaults < TOML file < KVPOOL_<KEY> environment variables < flags.
signals: SIGHUP reloads the settings that can change live (log_level, grace_seconds, lease_seconds,
  max_reserve_blocks, max_sessions, max_blocks_per_session, shutdown_timeout,
  admin_socket_mode, max_sequences_per_session, max_tokens_per_call, max_string_bytes, max_classes,
  max_classes_per_tenant, the per-user caps, handoff_timeout, fair_share, max_pool_share_per_user)
  and logs the others as needing a restart; SIGTERM/SIGINT stop
  gracefully (clients are told and get shutdown_timeout seconds to detach).

exit codes: 0 stopped cleanly, 2 bad configuration or cannot start"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpoold", description="KV-cache memory daemon for LLM inference.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help=f"TOML config file (default {DEFAULT_CONFIG} if it exists; env KVPOOL_CONFIG)")
    p.add_argument("--socket", help=f"Unix socket to listen on (default {DEFAULT_SOCKET}; env KVPOOL_SOCKET)")
    p.add_argument("--socket-mode", help="file mode of the socket, octal (default 660): who may attach")
    p.add_argument("--backend", choices=["cpu", "cuda"], help="where blocks live (default cpu)")
    p.add_argument("--pool-bytes", help="pool size, e.g. 2GiB (default: 1GiB on cpu, a fraction of free GPU memory on cuda)")
    p.add_argument("--gpu-memory-fraction", help="cuda: share of free GPU memory for the pool (default 0.9)")
    p.add_argument("--devices", help="cuda: GPU ordinals, e.g. 0 or 0,1 (default 0): one pool per GPU, each of "
                                     "--pool-bytes/--gpu-memory-fraction, --host-bytes and --disk-bytes (in "
                                     "<disk-dir>/gpuN with several); a client gets the pool of its GPU. "
                                     "Ignored by the cpu backend (one pool)")
    p.add_argument("--chunk-bytes", help="unit memory moves between layouts in (default 2MiB)")
    p.add_argument("--grace-seconds", help="a vanished client's sequences are freed after this (default 5)")
    p.add_argument("--lease-seconds",
                   help="a session whose client made no call for this long is dropped: a frozen (SIGSTOPped, "
                        "hung) client; the client library heartbeats every lease/3 (default 10; 0: off)")
    p.add_argument("--tenant-by", choices=("uid", "gid", "none"),
                   help="clients of different users (uid) or groups (gid) share no memory or prefix cache; "
                        "none: all share (default uid; needs a restart)")
    p.add_argument("--max-reserve-blocks", help="blocks a session may hold to assign locally (default 1024)")
    p.add_argument("--max-sessions", help="most sessions at once (default 1024)")
    p.add_argument("--shm-dir", help="cpu: shared-memory directory (default /dev/shm)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    p.add_argument("--socket-group", help="group given the socket (and CPU shared memory): its members may attach")
    p.add_argument("--admin-socket",
                   help="socket for admin calls (evict, drain, other sessions' sequences); default 'auto': "
                        "<socket>-admin.sock beside the socket; 'none': no admin socket")
    p.add_argument("--admin-socket-mode", help="file mode of the admin socket, octal (default 600)")
    p.add_argument("--max-blocks-per-session", help="quota: device blocks one session's sequences may hold (0: none)")
    p.add_argument("--max-sequences-per-session",
                   help="limit: live sequences one session may hold (default 65536; 0: none)")
    p.add_argument("--max-tokens-per-call", help="limit: tokens one call may carry (default 1048576; 0: none)")
    p.add_argument("--max-string-bytes",
                   help="limit: bytes of a client's name, model id, revision, dtype; extra keys 4x (default 1024; "
                        "0: none)")
    p.add_argument("--max-classes",
                   help="cap: layout classes (distinct geometries) a device pool keeps at once; idle ones are "
                        "reclaimed, least recently used first, to make room (default 64; 0: none)")
    p.add_argument("--max-classes-per-tenant",
                   help="cap: layout classes one tenant keeps at once on a device pool (default 16; 0: none)")
    # per-user caps: one user cannot lock the others out
    p.add_argument("--max-tickets-per-user",
                   help="cap: attach tickets one user (uid) holds unredeemed at once (default 64; 0: none)")
    p.add_argument("--max-sessions-per-user", help="cap: sessions of one user at once (default 256; 0: none)")
    p.add_argument("--max-handoff-connections-per-user",
                   help="cap: open connections of one user to a side socket (<socket>.handoff); more are refused "
                        "at accept (default 32; 0: none)")
    p.add_argument("--handoff-timeout",
                   help="seconds a side-socket connection may take to send its request; a silent one is closed "
                        "(default 2)")
    p.add_argument("--fair-share", metavar="on|off",
                   help="with several users on a device pool, each may hold at most the pool divided by the "
                        "users with a session there (default on)")
    p.add_argument("--max-pool-share-per-user",
                   help="the most of a device pool one user may hold whatever the number of users, e.g. 0.5 "
                        "(default 1)")
    # the gRPC sockets
    p.add_argument("--grpc-idle-seconds",
                   help="a gRPC connection with no call in progress this long is closed; the client reconnects "
                        "at its next call (default 60; 0: never)")
    p.add_argument("--max-grpc-connections",
                   help="connections to each gRPC socket at once; more are closed at accept (default 2048; 0: none)")
    p.add_argument("--max-grpc-streams", help="calls in progress on one gRPC connection (default 1024; 0: none)")
    p.add_argument("--max-message-bytes",
                   help="largest request read, e.g. 16MiB; larger ones are refused unread (default 0: what "
                        "max_tokens_per_call, max_sequences_per_session and max_string_bytes need)")
    p.add_argument("--shutdown-timeout", help="on SIGTERM, seconds to wait for clients to detach (default 30)")
    p.add_argument("--metrics-port", help="serve Prometheus metrics on this TCP port (default 0: off)")
    p.add_argument("--metrics-address", help="address of the metrics endpoint (default 127.0.0.1)")
    # tiers
    p.add_argument("--host-bytes", help="tier 1: host memory (pinned on a GPU) for blocks evicted from the pool, "
                                        "e.g. 64GiB (default 0: none)")
    p.add_argument("--disk-dir", help="tier 2: directory of the disk tier, kvpoold's user's own and not writable "
                                      "by group or others (made 0700 when missing; default: the systemd state "
                                      "directory /var/lib/kvpoold when it exists)")
    p.add_argument("--disk-bytes", help="tier 2: disk space for blocks, e.g. 500GiB (default 0: no disk tier)")
    # elastic GPU memory
    p.add_argument("--cuda-memory", choices=["auto", "vmm", "ipc"],
                   help="cuda: vmm (CUDA virtual memory: chunks move between layout classes and go back to the "
                        "GPU when unused), ipc (legacy: one allocation per GPU, one layout class), auto (vmm "
                        "where the GPU supports it; the default)")
    p.add_argument("--release-after-seconds",
                   help="a slab that stays empty this long is given back (to the GPU with vmm, to the OS on the "
                        "cpu backend); default 30; live on SIGHUP")
    # remote tier and KV events
    p.add_argument("--remote-url", help="tier 3: a Redis or Valkey server shared by several daemons, "
                                        "redis://[user:password@]host:6379/0, rediss://..., unix:///path "
                                        "(default: none)")
    p.add_argument("--remote-password-file", help="tier 3: read the server's password from this file")
    p.add_argument("--remote-key-file", metavar="FILE",
                   help="tier 3: a secret (at least 16 bytes; mode 600, the daemon's user's) that keys block "
                        "names and authenticates values, the same on every daemon meant to share blocks; without "
                        "it anyone who can reach the server can read and forge cached KV (default: none)")
    p.add_argument("--remote-tls-ca", metavar="FILE",
                   help="tier 3, rediss://: the CA certificates (PEM) the server's certificate must chain to "
                        "(default: the system's trusted CAs)")
    p.add_argument("--remote-tls-cert", metavar="FILE",
                   help="tier 3, rediss://: a client certificate (PEM) for servers that require one "
                        "(tls-auth-clients yes: mutual TLS)")
    p.add_argument("--remote-tls-key", metavar="FILE",
                   help="tier 3, rediss://: the client certificate's private key (PEM; default: in the "
                        "--remote-tls-cert file)")
    p.add_argument("--remote-cluster", action="store_const", const=True,
                   help="tier 3: --remote-url names one node of a Redis Cluster")
    p.add_argument("--remote-prefix", help="tier 3: prefix of every key (default kvpool)")
    p.add_argument("--remote-ttl", help="tier 3: seconds a stored block lives (default 86400; 0: no expiry)")
    p.add_argument("--remote-timeout", help="tier 3: a lookup with no answer within this many seconds is a "
                                            "miss (default 0.05)")
    p.add_argument("--remote-write", choices=("through", "evict"),
                   help="tier 3: write every block its writer confirmed (through, the default), or only "
                        "blocks leaving the last local tier (evict)")
    p.add_argument("--events-stream", help="also publish KV events to this Redis stream on --remote-url")
    p.add_argument("--check-config", action="store_true", help="print the resolved configuration as JSON and exit")
    p.add_argument("--version", action="version", version=f"kvpoold {__version__}")
    return p


FLAG_KEYS = (
    "socket", "socket_mode", "backend", "pool_bytes", "gpu_memory_fraction", "devices", "chunk_bytes",
    "grace_seconds", "max_reserve_blocks", "max_sessions", "shm_dir", "log_level",
    "socket_group", "admin_socket", "admin_socket_mode", "max_blocks_per_session", "shutdown_timeout",
    "metrics_port", "metrics_address",
    "max_sequences_per_session", "max_tokens_per_call", "lease_seconds", "max_string_bytes",  # limits, lease
    "max_classes", "max_classes_per_tenant",  # caps on layout classes
    "max_tickets_per_user", "max_sessions_per_user", "max_handoff_connections_per_user", "handoff_timeout",
    "fair_share", "max_pool_share_per_user",  # per-user caps
    "grpc_idle_seconds", "max_grpc_connections", "max_grpc_streams", "max_message_bytes",  # the gRPC sockets
    "host_bytes", "disk_dir", "disk_bytes",  # tiers
    "tenant_by",
    "cuda_memory", "release_after_seconds",  # elastic GPU memory
    "remote_url", "remote_password_file", "remote_key_file", "remote_cluster", "remote_prefix", "remote_ttl",
    "remote_timeout", "remote_write", "events_stream",  # remote tier, KV events
    "remote_tls_ca", "remote_tls_cert", "remote_tls_key",  # the remote tier's TLS
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags = {k: getattr(args, k) for k in FLAG_KEYS if getattr(args, k) is not None}
    try:
        config = load_config(path=args.config, flags=flags)
        from kvpoold.faults import check_environment

        check_environment()  # a bad KVPOOLD_FAILPOINTS is a configuration error: one line, exit 2
    except ConfigError as exc:
        print(f"kvpoold: bad configuration: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(json.dumps(config_as_dict(config), indent=2, allow_nan=False))
        return 0
    from kvpool.crash_stacks import show_stacks_on_native_crash
    from kvpoold.server.app import run

    show_stacks_on_native_crash()
    return run(config, reload=lambda: load_config(path=args.config, flags=flags))


if __name__ == "__main__":
    sys.exit(main())
