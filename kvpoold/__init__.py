"""kvpoold: the KV-cache memory daemon (core bookkeeping, memory backends, transfers, gRPC service)."""

__version__ = "0.1.0"
