"""Tier 3 keyed with the operator's secret (``--remote-key-file``), against real daemons and a real redis-server:
someone who reaches the server without the secret can neither tell which prompts are cached nor get a forged
value served; daemons with the same secret still share blocks."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import kvpool
from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash
from kvpoold.transfer.remote import Namespace, decode, encode, layout_string
from procs import wait_for
from redislib import free_port
from test_remote import remote_stats, write_prompt
from tierlib import BLOCK, BS, LAYOUT, check_sequence, prompt, rows

NO_KEY_WARNING = "remote tier without --remote-key-file: anyone who can reach"
TIMEOUT = 10.0  # the remote lookups' deadline: generous, the tests assert no timing


def key_file(path, secret: bytes, mode: int = 0o600) -> str:
    """``secret`` in a new file ``path`` of mode ``mode`` (the test's user owns it: the daemon's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with open(fd, "wb") as f:
        f.write(secret)
    os.chmod(path, mode)  # past the umask
    return str(path)


@pytest.fixture
def secret_file(tmp_path):
    """``secret_file(name)`` -> a fresh key file holding 32 random bytes (as ``head -c 32 /dev/urandom``)."""

    def make(name: str = "key") -> str:
        return key_file(tmp_path / name, os.urandom(32))

    return make


def public_keys(toks) -> list[bytes]:
    """The keys of ``toks``' blocks as anyone can compute them from public inputs: the model id, the tokens,
    the layout and the tenant (this test's uid), by the unkeyed scheme."""
    geometry = {"num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads, "head_dim": LAYOUT.head_dim,
                "dtype": LAYOUT.dtype, "block_size": BS, "block_bytes": BLOCK, "tenant": f"uid {os.getuid()}"}
    ns = Namespace("kvpool", layout_string(geometry), BLOCK)
    return [ns.key(h) for h in chain_hashes(root_hash(LAYOUT.model_id), pack_tokens(toks), BS)]


def found(rc, keys) -> int:
    return sum(rc.exists(k) for k in keys)


def layout_in(value: bytes) -> str:
    """The layout text a stored value carries in the clear after its header (the keyed format's)."""
    nlayout = struct.unpack_from("<H", value, 48)[0]
    return value[50:50 + nlayout].decode()


def test_a_prober_without_the_secret_cannot_tell_which_prompts_are_cached(redis_server, node, secret_file):
    r = redis_server()
    rc = r.client()
    keyed, plain = node(r, "--remote-key-file", secret_file(), timeout=TIMEOUT), node(r, timeout=TIMEOUT)
    secret_toks, public_toks = prompt(1, blocks=4), prompt(2, blocks=4)
    with kvpool.connect(plain.socket, name="plain", layout=LAYOUT) as c:
        write_prompt(c, public_toks)
        assert wait_for(lambda: remote_stats(c).blocks_written >= 4)
    assert found(rc, public_keys(public_toks)) == 4  # the probe works where no secret keys the store
    before = set(rc.keys("kvpool:*"))
    with kvpool.connect(keyed.socket, name="keyed", layout=LAYOUT) as c:
        write_prompt(c, secret_toks)
        assert wait_for(lambda: remote_stats(c).blocks_written >= 4)
    written = set(rc.keys("kvpool:*")) - before
    assert len(written) == 4  # the keyed daemon stored the prompt ...
    assert found(rc, public_keys(secret_toks)) == 0  # ... under keys nobody can compute from it
    hashes = chain_hashes(root_hash(LAYOUT.model_id), pack_tokens(secret_toks), BS)
    assert not any(h.hex().encode() in k for k in written for h in hashes)
    assert {k.split(b":")[1] for k in written}.isdisjoint(k.split(b":")[1] for k in before)  # nor the layout tag


def test_values_forged_without_the_secret_are_refused_counted_and_never_reach_a_pool(redis_server, node,
                                                                                     secret_file):
    r = redis_server()
    rc = r.client()
    secret = secret_file()
    a = node(r, "--remote-key-file", secret, timeout=TIMEOUT)
    toks, other = prompt(3, blocks=4), prompt(4, blocks=2)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        write_prompt(ca, other)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 6)
    keys = sorted(rc.keys("kvpool:*"))
    assert len(keys) == 6
    authentic = {k: rc.get(k) for k in keys}
    # the attacker reads the layout every value carries, and writes a value of the old format over each key:
    # a whole block of that layout with a valid xxh3 checksum
    forged_bytes = np.full(BLOCK, 0xA5, np.uint8)
    for k, value in authentic.items():
        forged = encode(Namespace("kvpool", layout_in(value), BLOCK), k, forged_bytes)
        assert decode(Namespace("kvpool", layout_in(value), BLOCK), k, forged) is not None  # valid unkeyed
        rc.set(k, forged)
    port = free_port()
    b = node(r, "--remote-key-file", secret, "--metrics-port", str(port), timeout=TIMEOUT)
    with kvpool.connect(b.socket, name="b", layout=LAYOUT) as cb:
        s = cb.create_sequence(toks)
        assert s.num_cached_tokens == 0  # nothing served: the client computes the prompt itself
        pool = rows(cb).cpu().numpy()
        assert not (pool == forged_bytes).all(axis=1).any()  # no forged byte reached the pool
        rs = remote_stats(cb)
        assert rs.forged_blocks == 1 and rs.corrupt_blocks == 0 and rs.hit_blocks == 0  # the chain's first
        assert len(rc.keys("kvpool:*")) == 5  # the refused value is gone from the store (until a writer's free)
        cb.free(s)
    assert "values without a valid tag" in b.output()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    assert "kvpool_remote_forged_blocks_total 1.0" in metrics


def test_an_authentic_value_moved_to_another_key_is_refused(redis_server, node, secret_file):
    r = redis_server()
    rc = r.client()
    secret = secret_file()
    a = node(r, "--remote-key-file", secret, timeout=TIMEOUT)
    toks = prompt(5, blocks=3)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 3)
    keys = rc.keys("kvpool:*")
    values = [rc.get(k) for k in keys]
    assert len(values) == 3
    for k, donor in zip(keys, values[1:] + values[:1]):  # each key gets a value the secret sealed for another
        rc.set(k, donor)
    b = node(r, "--remote-key-file", secret, timeout=TIMEOUT)
    with kvpool.connect(b.socket, name="b", layout=LAYOUT) as cb:
        s = cb.create_sequence(toks)
        assert s.num_cached_tokens == 0
        assert remote_stats(cb).forged_blocks == 1 and remote_stats(cb).hit_blocks == 0
        cb.free(s)


def test_daemons_with_the_same_secret_share_blocks_and_another_secret_sees_none(redis_server, node, secret_file,
                                                                                  tmp_path):
    r = redis_server()
    secret = os.urandom(32)
    # two machines: each its own copy of the same secret (with a trailing newline on one: ignored)
    a = node(r, "--remote-key-file", key_file(tmp_path / "a.key", secret), timeout=TIMEOUT)
    b = node(r, "--remote-key-file", key_file(tmp_path / "b.key", secret + b"\n"), timeout=TIMEOUT)
    toks = prompt(6, blocks=5, extra=3)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 5 and remote_stats(ca).write_queue_blocks == 0)
    with kvpool.connect(b.socket, name="b", layout=LAYOUT) as cb:
        s = cb.create_sequence(toks)
        assert s.num_cached_tokens == 5 * BS
        cb.wait(s)
        check_sequence(cb, s, toks, blocks=5)  # node A's bytes, byte for byte
        rs = remote_stats(cb)
        assert rs.hit_blocks >= 5 and rs.forged_blocks == 0 and rs.corrupt_blocks == 0
        cb.free(s)
    other = node(r, "--remote-key-file", secret_file("other.key"), timeout=TIMEOUT)  # another secret
    nobody = node(r, "--remote-key-file", key_file(tmp_path / "c.key", secret), "--tenant-by", "none",
                  timeout=TIMEOUT)  # the same secret, another tenant
    for d in (other, nobody):
        with kvpool.connect(d.socket, name="c", layout=LAYOUT) as cc:
            s = cc.create_sequence(toks)
            assert s.num_cached_tokens == 0
            rs = remote_stats(cc)
            assert rs.state == "connected" and rs.lookups >= 1 and rs.hit_blocks == 0
            assert rs.forged_blocks == 0 and rs.corrupt_blocks == 0 and rs.failures == 0 and not rs.last_error


def test_events_keep_the_block_hashes_routers_compute_with_a_secret(redis_server, node, secret_file):
    r = redis_server()
    a = node(r, "--remote-key-file", secret_file(), "--events-stream", "kvpool-events", timeout=TIMEOUT)
    toks = prompt(7, blocks=3)
    with kvpool.connect(a.socket, name="a", layout=LAYOUT) as ca:
        write_prompt(ca, toks)
        assert wait_for(lambda: remote_stats(ca).blocks_written >= 3)
    with kvpool.Connection(a.socket[:-5] + "-admin.sock") as conn:
        events = list(conn.events(recent=1000))
    stored = {h for e in events if e["kind"] == "stored" and e["tier"] == "remote" for h in e["block_hashes"]}
    assert stored == {h.hex() for h in chain_hashes(root_hash(LAYOUT.model_id), pack_tokens(toks), BS)}
    assert wait_for(lambda: r.client().xlen("kvpool-events") >= len(events))
    assert "the stream carries every tenant's block hashes in the clear" in a.output()


def test_without_a_secret_the_daemon_warns_and_with_one_never_shows_it(redis_server, node, secret_file, tmp_path):
    r = redis_server()
    plain = node(r, "--log-level", "debug", timeout=TIMEOUT)
    lines = [line for line in plain.output().splitlines() if NO_KEY_WARNING in line]
    assert len(lines) == 1 and r.url in lines[0] and "forge" in lines[0]
    secret = b"s3cret-0123456789-never-shown"
    keyed = node(r, "--log-level", "debug", "--remote-key-file", key_file(tmp_path / "shown.key", secret),
                 timeout=TIMEOUT)
    with kvpool.connect(keyed.socket, name="a", layout=LAYOUT) as c:
        write_prompt(c, prompt(8, blocks=2))
        assert wait_for(lambda: remote_stats(c).blocks_written >= 2)
    out = subprocess.run([sys.executable, "-m", "kvpoold.ctl", "--socket", keyed.socket, "config", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "shown.key" in out.stdout  # the path is shown, never what it holds
    assert NO_KEY_WARNING not in keyed.output()
    assert "s3cret" not in keyed.output() and "s3cret" not in out.stdout + out.stderr


def check_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpoold", "--remote-url", "redis://h:6379/0", *args,
                           "--check-config"], capture_output=True, text=True)


def test_a_bad_key_file_is_one_line_and_exit_2(tmp_path):
    good = key_file(tmp_path / "good.key", b"k" * 16)
    out = check_config("--remote-key-file", good)
    assert out.returncode == 0, out.stderr
    cases = {
        "world-readable": (key_file(tmp_path / "open.key", b"secret-material-0123456789", 0o644), "chmod 600"),
        "group-readable": (key_file(tmp_path / "group.key", b"secret-material-0123456789", 0o640), "chmod 600"),
        "too short": (key_file(tmp_path / "short.key", b"secret-material\n"), "16"),
        "missing": (str(tmp_path / "nothing.key"), "cannot be read"),
        "a directory": (str(tmp_path), "not a regular file"),
    }
    other = key_file(tmp_path / "theirs.key", b"secret-material-0123456789")
    os.chown(other, 65534, 65534)  # another user's file (the tests run as root)
    cases["another user's"] = (other, "owned by uid 65534")
    for what, (path, why) in cases.items():
        out = check_config("--remote-key-file", path)
        assert out.returncode == 2, (what, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and "remote_key_file" in out.stderr and why in out.stderr, (what, out.stderr)
        assert "secret-material" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--remote-key-file", good, "--check-config"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "needs remote_url" in out.stderr
