"""The Prometheus endpoint, scraped over HTTP and parsed with prometheus-client's parser; health; reflection."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import kvpool
from kvpool import Connection
from opskit import LAYOUT, free_port


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families, name, **labels) -> float:
    """The value of one sample, found by its own name (``_total``, ``_count``, ``_bucket``...)."""
    for samples in families.values():
        for s in samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name}{labels} not in the scrape")


def test_metrics_endpoint(daemon_factory):
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    assert f"metrics=http://127.0.0.1:{port}/metrics" in d.output()
    with kvpool.connect(d.socket, name="m", layout=LAYOUT) as c:
        a = c.create_sequence(range(10))  # 3 blocks
        c.create_sequence(range(9))  # prefix hit on the first 8 tokens
        child = c.fork(a)
        c.extend({child: [1]})  # copy-on-write of the shared partial block
        c.flush()
        c.lookup(range(10))
        c.free(c.sequences())
        with Connection(d.socket[:-5] + "-admin.sock") as admin:
            evicted = admin.evict(max_blocks=2)
        f = scrape(port)
        assert value(f, "kvpool_info", backend="cpu") == 1
        assert value(f, "kvpool_pool_bytes") == 64 << 20
        assert value(f, "kvpool_prefix_queries_total", class_id="0") == 3  # two creates and a lookup
        assert value(f, "kvpool_prefix_hits_total", class_id="0") == 2
        assert value(f, "kvpool_prefix_query_tokens_total", class_id="0") == 29
        assert value(f, "kvpool_cow_copies_total", class_id="0") == 1
        assert value(f, "kvpool_evictions_total", class_id="0") == evicted == 2
        st = c.stats().classes[0]
        for state, n in (("used", st.used_blocks - st.reserved_blocks), ("reserved", st.reserved_blocks),
                         ("cached", st.cached_blocks), ("free", st.free_blocks)):
            assert value(f, "kvpool_class_blocks", class_id="0", state=state) == n
        assert value(f, "kvpool_class_block_bytes", class_id="0") == st.block_bytes
        assert value(f, "kvpool_class_taken_bytes_total", class_id="0") == st.taken_bytes > 0
        assert value(f, "kvpool_class_commit_seconds_total", class_id="0") == st.commit_seconds > 0
        assert value(f, "kvpool_tier_capacity_bytes", tier="device") == 64 << 20
        assert value(f, "kvpool_tier_blocks", tier="device") == st.used_blocks + st.cached_blocks
        assert value(f, "kvpool_sessions", state="connected") == 1
        assert value(f, "kvpool_sequences") == 0 and value(f, "kvpool_draining") == 0
        assert value(f, "kvpool_rpcs_total", method="Create", code="OK") == 2
        assert value(f, "kvpool_rpc_duration_seconds_count", method="Create") == 2
        assert value(f, "kvpool_rpc_duration_seconds_bucket", method="Create", le="+Inf") == 2
        assert value(f, "kvpool_rpc_duration_seconds_count", method="Step") >= 1
        assert value(f, "kvpool_rpcs_total", method="Evict", code="OK") == 1
        assert "process_resident_memory_bytes" in f
        with Connection(d.socket) as conn, pytest.raises(kvpool.PermissionDenied):
            conn.evict()  # the interceptor of one server never hands a call to the other's servicer
        f = scrape(port)
        assert value(f, "kvpool_rpcs_total", method="Evict", code="PERMISSION_DENIED") == 1


def test_no_metrics_endpoint_by_default(daemon):
    assert "metrics=" not in daemon.output()


def test_health_and_reflection(daemon):
    for path in (daemon.socket, daemon.socket[:-5] + "-admin.sock"):
        with grpc.insecure_channel("unix://" + path) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "kvpool.v1.KVPool"):
                r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10)
            names = {s.name for s in reply.list_services_response.service}
            assert {"kvpool.v1.KVPool", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
            (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="kvpool.v1.KVPool")]), timeout=10)
            assert reply.file_descriptor_response.file_descriptor_proto  # grpcurl can describe the API
