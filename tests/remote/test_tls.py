"""The remote tier over TLS (rediss://) against a real redis-server with throwaway certificates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvpool
from kvpoold.cli import build_parser
from kvpoold.config import ConfigError, load_config
from kvpoold.transfer.remote import Namespace, RemoteSettings, RemoteStore
from procs import wait_for
from redislib import free_port
from test_remote import remote_stats, write_prompt
from tierlib import BS, LAYOUT, check_sequence, prompt


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_a_prompt_written_over_mutual_tls_through_node_a_is_a_hit_on_node_b(where, redis_server, redis_cluster, node,
                                                                            certs, tmp_path):
    tls = ["--remote-tls-ca", certs.ca, "--remote-tls-cert", certs.client_cert, "--remote-tls-key", certs.client_key]
    if where == "server":
        r = redis_server("--requirepass", "s3cret", tls=certs, clients="yes")  # a client certificate is required
        secret = tmp_path / "redis.password"
        secret.write_text("s3cret\n")
        tls += ["--remote-password-file", str(secret)]
        blocks = 4
    else:
        r = redis_cluster(tls=certs, clients="yes")  # three TLS-only nodes that require client certificates
        tls.append("--remote-cluster")
        blocks = 12  # keys in the three nodes' slots
    a, b = node(r, *tls), node(r, *tls)
    toks = prompt(11, blocks=blocks, extra=3)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= blocks)
        rs = remote_stats(ca)
        assert rs.state == "connected" and rs.url.startswith("rediss://") and rs.failures == 0
    assert len(r.keys("kvpool:*")) == blocks  # on the server (seen through its plain Unix socket, or redis-cli)
    with kvpool.connect(b.socket, name="b", layout=LAYOUT) as cb:
        s = cb.create_sequence(toks)
        assert s.num_cached_tokens == blocks * BS
        cb.wait(s)
        check_sequence(cb, s, toks, blocks=blocks)  # node A's bytes, byte for byte
        rs = remote_stats(cb)
        assert rs.hit_blocks == blocks and rs.bytes_read > blocks * 4096 and rs.failures == 0
        cb.free(s)
        ok, detail = cb._conn.check()
        assert ok, detail
    if where == "cluster":
        assert r.nodes_with_keys("kvpool:*") >= 2  # the keys really live on several nodes
    assert "s3cret" not in a.output() + b.output()


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_a_wrong_ca_fails_the_remote_tier_and_local_serving_goes_on(where, redis_server, redis_cluster, node, certs):
    r, extra = (redis_server(tls=certs), ()) if where == "server" else (redis_cluster(tls=certs), ("--remote-cluster",))
    a = node(r, *extra, "--remote-tls-ca", certs.other_ca)  # a CA that did not sign the server's certificate
    toks = prompt(12, blocks=3)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        assert wait_for(lambda: remote_stats(ca).state in ("backoff", "retrying"))
        rs = remote_stats(ca)
        assert rs.failures >= 1 and "not signed by a trusted CA" in rs.last_error and certs.other_ca in rs.last_error
        write_prompt(ca, toks)  # creates, writes and local hits go on
        s = ca.create_sequence(toks)
        assert s.num_cached_tokens == 3 * BS
        check_sequence(ca, s, toks, blocks=3)
        ca.free(s)
        assert ca.create_sequence(prompt(13, blocks=2)).num_cached_tokens == 0  # a miss: answered all the same
        rs = remote_stats(ca)
        assert rs.blocks_written == 0 and rs.state in ("backoff", "retrying") and rs.failures >= 1
    assert "not signed by a trusted CA" in a.output()  # the operator is told why in the log too
    assert r.keys("kvpool:*") == []


def test_a_plain_server_or_a_missing_client_certificate_behind_rediss_is_a_clear_failure(redis_server, certs):
    plain = free_port()
    redis_server("--port", str(plain))
    strict = redis_server(tls=certs, clients="yes")
    ns = Namespace("kvpool", "a layout", 4096)
    for settings, why in ((RemoteSettings(f"rediss://localhost:{plain}/0", tls_ca=certs.ca, socket_timeout=0.3),
                           "no TLS handshake"),
                          (RemoteSettings(strict.url, tls_ca=certs.ca), "client certificate")):
        store = RemoteStore(settings)
        try:
            assert wait_for(lambda: store.state == "backoff", timeout=10)
            assert why in store.last_error and store.failures >= 1
            assert store.fetch(ns, [[b"h" * 16]]).payloads == {}  # a miss, not an error
        finally:
            store.close()


def test_tls_options_are_documented_and_checked_at_start(certs, tmp_path):
    text = build_parser().format_help()
    assert "--remote-tls-ca" in text and "--remote-tls-cert" in text and "--remote-tls-key" in text
    url = "rediss://localhost:6380/0"
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--remote-url", url, "--remote-tls-ca", certs.ca,
                          "--remote-tls-cert", certs.client_cert, "--remote-tls-key", certs.client_key,
                          "--check-config"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["remote_tls_cert"] == certs.client_cert
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for flags, why in ((dict(remote_url="redis://localhost:6379/0", remote_tls_ca=certs.ca), "needs a rediss://"),
                       (dict(remote_url=url, remote_tls_ca=str(tmp_path / "none.pem")), "cannot be read"),
                       (dict(remote_url=url, remote_tls_ca=str(garbage)), "no PEM certificate"),
                       (dict(remote_url=url, remote_tls_key=certs.client_key), "needs remote_tls_cert"),
                       (dict(remote_url=url, remote_tls_cert=certs.client_cert, remote_tls_key=certs.server_key),
                        "private key")):  # not the certificate's key
        with pytest.raises(ConfigError, match=why):
            load_config(env={}, flags=flags)
