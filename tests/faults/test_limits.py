"""Limits: sequences per session and tokens per call; refused before the core, nothing changed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvpool
from faultkit import LAYOUT
from kvpool.protocol import kvpool_pb2 as pb


@pytest.mark.parametrize("flag,key", [("--max-sequences-per-session", "max_sequences_per_session"),
                                      ("--max-tokens-per-call", "max_tokens_per_call")])
def test_limit_flags_are_validated(flag, key):
    out = subprocess.run([sys.executable, "-m", "kvpoold", flag, "-1", "--check-config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"{key} = -1 (from {flag}): must be >= 0" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvpoold", flag, "7", "--check-config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f'"{key}": 7' in out.stdout


def test_max_sequences_per_session(daemon_factory):
    d = daemon_factory("--max-sequences-per-session", "3")
    with kvpool.connect(d.socket, name="s", layout=LAYOUT) as c, \
            kvpool.connect(d.socket, name="other", layout=LAYOUT) as other:
        a, b = c.create_sequences([range(5), range(9)])
        before = c.stats()
        with pytest.raises(kvpool.OutOfBlocks, match=r"limit max_sequences_per_session=3 exceeded: the session "
                                                      r"holds 2 sequences and this call adds 2"):
            c.create_sequences([range(3), range(4)])
        after = c.stats()
        assert after.sequences == before.sequences == 2
        assert [x.used_blocks for x in after.classes] == [x.used_blocks for x in before.classes]
        c.fork(a)  # the third one fits
        with pytest.raises(kvpool.OutOfBlocks, match="max_sequences_per_session=3"):
            c.fork(b)
        with pytest.raises(kvpool.OutOfBlocks, match="max_sequences_per_session"):
            c.create_sequence(range(2))
        c.free(b)
        c.create_sequence(range(2))  # freeing makes room again
        other.create_sequences([range(3)] * 3)  # the limit is per session
        ok, detail = kvpool.Connection(d.socket).check()
        assert ok, detail


def test_max_tokens_per_call(daemon_factory):
    d = daemon_factory("--max-tokens-per-call", "10")
    with kvpool.connect(d.socket, name="t", layout=LAYOUT) as c:
        with pytest.raises(kvpool.InvalidArgument, match=r"limit max_tokens_per_call=10 exceeded: "
                                                         r"this call carries 11 tokens"):
            c.create_sequence(range(11))
        with pytest.raises(kvpool.InvalidArgument, match="max_tokens_per_call=10"):
            c.create_sequences([range(6), range(5)])  # counted over the whole call
        assert c.stats().sequences == 0
        seq = c.create_sequence(range(10))
        before = c.sequences()[0]
        with pytest.raises(kvpool.InvalidArgument, match="max_tokens_per_call=10"):
            c._conn.call("Step", pb.StepRequest(
                session=c._token, seq_ids=np.array([seq.id], "<i8").tobytes(),
                token_counts=np.array([11], "<i4").tobytes(), tokens=np.arange(11, dtype="<u4").tobytes()))
        assert c.sequences()[0].num_tokens == before.num_tokens == 10  # nothing was applied
        with pytest.raises(kvpool.InvalidArgument, match="max_tokens_per_call"):
            c.lookup(range(50))
        ok, detail = kvpool.Connection(d.socket).check()
        assert ok, detail
