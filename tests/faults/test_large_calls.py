"""Large calls: bounded by default, and a refused one leaves no memory behind."""

from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest

import kvpool

LAYOUT = kvpool.Layout("big", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=16)


def test_default_token_limit_refuses_a_huge_lookup(daemon):
    c = kvpool.connect(daemon.socket, layout=LAYOUT, name="big")
    try:
        with pytest.raises(kvpool.InvalidArgument, match="max_tokens_per_call=1048576"):
            c.lookup(np.zeros(2_000_000, dtype=np.uint32))
        assert c.lookup(np.zeros(1 << 20, dtype=np.uint32)) == 0  # the largest allowed call still works
    finally:
        c.close()


def test_failed_huge_creates_do_not_keep_memory(daemon):
    proc = psutil.Process(daemon.proc.pid)
    c = kvpool.connect(daemon.socket, layout=LAYOUT, name="big")
    try:
        prompt = np.zeros(10_000_000, dtype=np.uint32)  # 40 MB on the wire
        with pytest.raises(kvpool.InvalidArgument):
            c.create_sequences([prompt])
        before = proc.memory_info().rss
        for _ in range(5):
            with pytest.raises(kvpool.InvalidArgument):
                c.create_sequences([prompt])
        grown = proc.memory_info().rss - before
        assert grown < 80 << 20, f"daemon RSS grew {grown >> 20} MiB over 5 refused 40 MB calls"
    finally:
        c.close()
    gc.collect()


def test_default_sequence_limit(daemon):
    with kvpool.Connection(daemon.socket) as conn:
        assert conn.config()["config"]["max_sequences_per_session"] == 65536
