"""Prometheus metrics: pool usage, prefix cache, sessions, RPC latency.

Served by prometheus-client's HTTP server on ``metrics_address:metrics_port``
(a thread).  The pool figures are read when Prometheus scrapes: the scrape
thread asks the event loop for them (``run_coroutine_threadsafe``), so the
daemon's one concurrency rule — state is touched only on the loop — holds.
RPC latency is measured by a gRPC server interceptor, one histogram series
per method; it is installed only when metrics are enabled.

Series (``device`` is a pool: the daemon's CUDA ordinal of one of ``--devices``,
or ``cpu``; ``class_id`` a layout class of that pool; ``tier`` device/host/disk):

=================================================  ========  ==============================
kvpool_info{version,backend}                       gauge     1
kvpool_device_info{device,bus_id}                  gauge     1 per pool (PCI bus id of its GPU)
kvpool_pool_bytes{device}                          gauge     device pool size
kvpool_pool_unassigned_bytes{device}               gauge     not yet given to a class
kvpool_class_blocks{device,class_id,state}         gauge     used / reserved / cached / free
kvpool_class_block_bytes{device,class_id}          gauge
kvpool_tier_capacity_bytes{device,tier}            gauge
kvpool_tier_used_bytes{device,tier}                gauge
kvpool_tier_blocks{device,tier}                    gauge
kvpool_tier_<figure>_total{device,tier}            counter   transfers from the tiers' stats: blocks_in,
                                                             blocks_out, bytes_written, bytes_read, ...
kvpool_class_<figure>_total{device,class_id}       counter   promoted/demoted/swapped blocks, memory
                                                             taken and released, commit/release seconds, ...
kvpool_tier_pinned_bytes{device,tier},
kvpool_class_swapped_sequences{device,class_id}    gauge
kvpool_prefix_queries_total{device,class_id}       counter   lookups and creates
kvpool_prefix_hits_total{device,class_id}          counter   of those, with a cached prefix
kvpool_prefix_query_tokens_total{device,class_id}  counter
kvpool_prefix_hit_tokens_total{device,class_id}    counter
kvpool_cow_copies_total{device,class_id}           counter   copy-on-write copies
kvpool_evictions_total{device,class_id}            counter   cached blocks dropped
kvpool_sessions{state}                             gauge     connected / disconnected
kvpool_pool_sessions{device}                       gauge     sessions bound to the pool
kvpool_sequences{device}                           gauge
kvpool_draining                                    gauge     1 while drained
kvpool_remote_up{url,state}                        gauge     1 when the remote tier answers (state: connected,
                                                             connecting, backoff, retrying)
kvpool_remote_<figure>_total                       counter   the remote tier's stats: hit_blocks, miss_blocks,
                                                             bytes_read, bytes_written, timeouts, failures, ...
kvpool_remote_write_queue_blocks                   gauge     blocks waiting to be written to it
kvpool_events_published_total                      counter   KV events
kvpool_events_dropped_total                        counter   KV events a slow reader missed
kvpool_rpc_duration_seconds{method}                histogram unary calls
kvpool_rpcs_total{method,code}                     counter   by status code
=================================================  ========  ==============================

plus prometheus-client's ``process_*`` series.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import fields, is_dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

log = logging.getLogger("kvpoold")

LATENCY_BUCKETS = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 5.0,
)
SCRAPE_TIMEOUT_S = 5.0


def _device_label(d) -> str:
    """The ``device`` label of a pool's series: the daemon's CUDA ordinal, or ``cpu``."""
    return str(d.device) if d.device >= 0 else "cpu"


def pool_families(service) -> list:
    """Every pool, prefix-cache and session series, read from the service (call on the event loop).

    Pool series carry a ``device`` label: one pool per GPU of ``--devices``
    (``cpu`` on the CPU backend); ``class_id`` is a class of that pool.
    The figures are the service's ``PoolStats`` (``kvpool.protocol.stats``).
    """
    st = service.stats()
    devices = [(_device_label(d), d) for d in st.devices]
    out = []

    def gauge(name, doc, labels=(), rows=()):
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        for values, v in rows:
            g.add_metric(list(values), float(v))
        out.append(g)

    def counter(name, doc, labels=(), rows=()):
        c = CounterMetricFamily(name, doc, labels=list(labels))
        for values, v in rows:
            c.add_metric(list(values), float(v))
        out.append(c)

    gauge("kvpool_info", "kvpoold version and backend", ("version", "backend"), [((st.version, st.backend), 1)])
    gauge("kvpool_device_info", "one pool per device: its PCI bus id", ("device", "bus_id"),
          [((label, d.bus_id), 1) for label, d in devices])
    gauge("kvpool_pool_bytes", "device pool size in bytes", ("device",),
          [((label,), d.pool_bytes) for label, d in devices])
    gauge("kvpool_pool_unassigned_bytes", "pool bytes not owned by any layout class", ("device",),
          [((label,), d.free_bytes) for label, d in devices])
    gauge("kvpool_pool_max_bytes", "the most the pool may grow to (kvpoolctl resize)", ("device",),
          [((label,), d.max_pool_bytes) for label, d in devices])
    gauge("kvpool_pool_physical_bytes", "memory the pool holds now (vmm: chunks created, not given back)",
          ("device",), [((label,), d.physical_bytes) for label, d in devices])
    gauge("kvpool_pool_draining_bytes", "vmm: chunks that left their class, held until every client let go",
          ("device",), [((label,), d.draining_bytes) for label, d in devices])
    counter("kvpool_pool_freed_bytes", "vmm: memory given back to the GPU", ("device",),
            [((label,), d.freed_bytes) for label, d in devices])
    counter("kvpool_pool_free_seconds", "vmm: the daemon's time giving memory back to the GPU", ("device",),
            [((label,), d.free_seconds) for label, d in devices])
    # (device label, class id label, ClassStats) and (device label, TierStats) over every pool
    classes = [(label, str(c.class_id), c) for label, d in devices for c in d.classes]
    gauge("kvpool_class_blocks", "device blocks of a layout class by state", ("device", "class_id", "state"), [
        row for d, k, c in classes for row in (
            ((d, k, "used"), c.used_blocks - c.reserved_blocks),
            ((d, k, "reserved"), c.reserved_blocks),
            ((d, k, "cached"), c.cached_blocks),
            ((d, k, "free"), c.free_blocks),
        )
    ])
    gauge("kvpool_class_block_bytes", "bytes per block of a layout class", ("device", "class_id"),
          [((d, k), c.block_bytes) for d, k, c in classes])

    tiers = []
    for label, d in devices:
        blocks = sum(c.used_blocks + c.cached_blocks for c in d.classes)
        used = sum((c.used_blocks + c.cached_blocks) * c.block_bytes for c in d.classes)
        tiers.append((label, "device", d.pool_bytes, used, blocks))
        tiers += [(label, t.tier, t.capacity_bytes, t.used_bytes, t.blocks) for t in d.tiers]
    labels = ("device", "tier")
    gauge("kvpool_tier_capacity_bytes", "capacity of a tier in bytes", labels, [(t[:2], t[2]) for t in tiers])
    gauge("kvpool_tier_used_bytes", "bytes of a tier holding blocks", labels, [(t[:2], t[3]) for t in tiers])
    gauge("kvpool_tier_blocks", "blocks held in a tier", labels, [(t[:2], t[4]) for t in tiers])
    lower = [(label, t) for label, d in devices for t in d.tiers]
    _extra_series("tier", "tier", [t for _, t in lower], [(d, t.tier) for d, t in lower], gauge, counter)
    _extra_series("class", "class_id", [c for _, _, c in classes], [(d, k) for d, k, _ in classes], gauge, counter)

    for name, attr, doc in (
        ("kvpool_prefix_queries", "prefix_queries", "prefix-cache queries (lookups and creates)"),
        ("kvpool_prefix_hits", "prefix_hits", "prefix-cache queries that found a cached prefix"),
        ("kvpool_prefix_query_tokens", "prefix_query_tokens", "prompt tokens queried in the prefix cache"),
        ("kvpool_prefix_hit_tokens", "prefix_hit_tokens", "prompt tokens found in the prefix cache"),
        ("kvpool_cow_copies", "cow_copies", "copy-on-write block copies"),
        ("kvpool_evictions", "evictions", "cached blocks evicted"),
    ):
        counter(name, doc, ("device", "class_id"), [((d, k), getattr(c, attr)) for d, k, c in classes])

    sessions = list(service.sessions)
    connected = sum(1 for s in sessions if s.connected)
    gauge("kvpool_sessions", "attached client sessions", ("state",),
          [(("connected",), connected), (("disconnected",), len(sessions) - connected)])
    gauge("kvpool_pool_sessions", "sessions bound to a device's pool", ("device",),
          [((label,), d.clients) for label, d in devices])
    gauge("kvpool_sequences", "live sequences", ("device",), [((label,), d.sequences) for label, d in devices])
    gauge("kvpool_draining", "1 while the daemon is drained (no new attaches or sequences)",
          rows=[((), int(st.draining))])
    for r in st.remote:
        gauge("kvpool_remote_up", "1 when the remote tier answers", ("url", "state"),
              [((r.url, r.state), int(r.state == "connected"))])
        for f in fields(r):
            value = getattr(r, f.name)
            if isinstance(value, str):
                continue
            if f.name == "write_queue_blocks":
                gauge("kvpool_remote_write_queue_blocks", "blocks waiting to be written to the remote tier",
                      rows=[((), value)])
            else:
                counter(f"kvpool_remote_{f.name}", f"remote tier figure {f.name}", rows=[((), value)])
    events = service.events.stats()
    counter("kvpool_events_published", "KV events published", rows=[((), events["published"])])
    counter("kvpool_events_dropped", "KV events a slow reader missed", rows=[((), events["dropped"])])
    return out


_KNOWN = {
    "tier": {"tier", "capacity_bytes", "used_bytes", "blocks"},
    "class": {"class_id", "geometry", "models", "block_bytes", "capacity_blocks", "total_blocks", "used_blocks",
              "reserved_blocks", "cached_blocks", "free_blocks", "cow_copies", "evictions", "prefix_queries",
              "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens"},
}
_LEVELS = {"pinned_bytes", "swapped_sequences", "mapped_bytes", "reserved_bytes"}  # gauges; every other extra figure is a running total


def _extra_series(kind: str, label: str, rows, keys, gauge, counter) -> None:
    """Numeric figures of the tier and class stats beyond the known ones.

    ``keys``: (device label, tier or class id label) of each row.

    The tier work keeps transfer and swap figures there (``blocks_in``,
    ``bytes_written``, ``promoted_blocks``, ``swapped_out_blocks``...): running
    totals, exported as counters ``kvpool_<kind>_<figure>_total``; the few
    levels in ``_LEVELS`` (``pinned_bytes``, ``swapped_sequences``) as gauges.
    """
    if not rows or not is_dataclass(rows[0]):
        return
    for f in fields(rows[0]):
        if f.name in _KNOWN[kind]:
            continue
        values = [getattr(r, f.name) for r in rows]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        emit = gauge if f.name in _LEVELS else counter
        emit(f"kvpool_{kind}_{f.name}", f"{kind} figure {f.name}", ("device", label),
             [(k, v) for k, v in zip(keys, values)])


class PoolCollector:
    """A prometheus-client collector that reads the service on its event loop."""

    def __init__(self, service, loop: asyncio.AbstractEventLoop) -> None:
        self.service = service
        self.loop = loop

    def collect(self):
        async def read():
            return pool_families(self.service)

        try:
            families = asyncio.run_coroutine_threadsafe(read(), self.loop).result(SCRAPE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a scrape must not kill the HTTP thread
            log.exception("metrics: could not read the pool")
            return
        yield from families

    def describe(self):
        return []  # collected at scrape time only: no registration-time call into the loop


class RpcMetrics:
    """The RPC series: a latency histogram per method, calls counted by status code."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram(
            "kvpool_rpc_duration_seconds", "time to serve a unary call", ["method"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.calls = Counter("kvpool_rpcs", "calls served, by status code", ["method", "code"], registry=registry)

    def interceptor(self) -> "RpcInterceptor":
        """A new interceptor for one server (each server has its own handlers: never share one)."""
        return RpcInterceptor(self)


class RpcInterceptor(grpc.aio.ServerInterceptor):
    """Times every unary call of one server and counts it by status code."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics
        # wrapped handlers of *this* server by method: a handler from another server's
        # servicer (the admin socket's) must never answer here
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, details):
        cached = self._handlers.get(details.method)
        if cached is not None:
            return cached
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler  # streams (Watch, health Watch, reflection) are not timed
        method = details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary
        hist = self.metrics.latency.labels(method)
        calls = self.metrics.calls
        ok = calls.labels(method, "OK")

        async def timed(request, context):
            t0 = time.perf_counter()
            try:
                reply = await inner(request, context)
            except BaseException:
                code = context.code() if hasattr(context, "code") else None
                calls.labels(method, getattr(code, "name", None) or "UNKNOWN").inc()
                raise
            finally:
                hist.observe(time.perf_counter() - t0)
            ok.inc()
            return reply

        wrapped = grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        self._handlers[details.method] = wrapped
        return wrapped


class Metrics:
    """The registry, the RPC interceptor and the HTTP endpoint of one daemon."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.rpc = RpcMetrics(self.registry)
        self._httpd = None
        self.port = 0

    def serve(self, service, loop, address: str, port: int) -> None:
        self.registry.register(PoolCollector(service, loop))
        self._httpd, _thread = start_http_server(port, addr=address, registry=self.registry)
        self.port = self._httpd.server_address[1]

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
