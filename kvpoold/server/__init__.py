"""The gRPC service: a thin adapter from the wire to the core, sessions, admin.

Modules, top to bottom; each imports only modules below it
(``tests/server/test_layering.py`` fails on any import cycle):

* ``app``: start-up and shutdown: sockets, one pool per device, gRPC servers, signals, systemd.
* ``servicer``: the gRPC methods, each three lines: convert, call, convert back.
* ``convert``: protobuf messages <-> the call and result types of ``calls``.
* ``service``: ``Service``: the sessions, the pools, drain, the operator calls over every pool.
* ``devices``: ``DevicePools``: the pools, which pool a session is bound to (by its GPU's bus id).
* ``session_pool``: ``PoolSession``: one session's sequence calls on its pool; of the service it
  knows only ``SessionKeeper`` (drain state, session lookup, drop).
* ``pools``: ``DevicePool``: one device's core, arenas and the parts below, composed.
* ``classes``, ``quotas``, ``limits``: parts of a pool that know only the core (and the live
  configuration, through a callable): classes in use and their caps; memory quotas and shares;
  per-call bounds.
* ``tiers``, ``tier_inflight``, ``tier_pending``, ``tier_remote``: the pool's tiers, one job each:
  the transfer engine; blocks whose bytes are arriving; sequences waiting for them; the remote tier.
* ``calls``: call and result types (``StepCall``, ``AttachResult``, ...).
* ``sessions``, ``handoff``, ``access``, ``events``, ``chunk_sync``, ``errors``, ``metrics``,
  ``sockpath``, ``logsafe``, ``sd``: sessions and leases; the side socket (credentials, tickets,
  fds); admin, drain and per-user caps; KV events; CUDA chunk hand-off; the one error -> status
  mapping; Prometheus; socket paths; log-safe strings; systemd notify.
"""
