"""Helpers of the tier fault tests."""

from __future__ import annotations

import time


def settle(conn, timeout: float):
    """Stats once no session is left and nothing is in flight (used == reserved == 0), or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        st = conn.stats()
        c = st.classes[0]
        idle = st.clients == 0 and c.used_blocks == 0 and c.reserved_blocks == 0
        if idle and all(t.pinned_bytes == 0 for t in st.tiers) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)
