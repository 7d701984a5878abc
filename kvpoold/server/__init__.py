"""The gRPC service: a thin adapter from the wire to the core, sessions, admin."""
