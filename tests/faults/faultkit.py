"""Helpers of the fault tests (a uniquely named module: test folders have no __init__.py)."""

from __future__ import annotations

import time

import kvpool

LAYOUT = kvpool.Layout("fault-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def admin_of(sock: str) -> str:
    return sock[:-5] + "-admin.sock"


def wait_all_free(sock: str, timeout: float = 30.0):
    """Wait until no session holds a block (the grace period has passed); return the last stats."""
    deadline = time.monotonic() + timeout
    with kvpool.Connection(sock) as conn:
        while True:
            st = conn.stats()
            used = sum(c.used_blocks + c.reserved_blocks for c in st.classes)
            if (used == 0 and st.sequences == 0) or time.monotonic() > deadline:
                return st
            time.sleep(0.2)
