"""The side socket's ``chunks`` dialog (CUDA VMM) refuses what it must, and the daemon stays whole.

The dialog itself runs on a GPU (tests/server/test_gpu_vmm.py); these refusals need none.
"""

from __future__ import annotations

import os

import kvpool
from kvpool.handoff import _ask

LAYOUT = kvpool.Layout("chunks", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def test_chunks_are_refused_without_a_vmm_pool_or_a_valid_session(daemon):
    with kvpool.connect(daemon.socket, name="c", layout=LAYOUT) as c:
        seq = c.create_sequence(range(9))
        for token in (c._token.hex(), "00" * 32, "not-hex"):  # a CPU pool, an unknown session, garbage
            reply, fds = _ask(daemon.socket, b"chunks " + token.encode(), 5.0)
            for fd in fds:
                os.close(fd)
            assert reply == b"err refused\n" and not fds
        c.extend({seq: [9, 10]})  # the session and the pool go on as before
        assert seq.num_tokens == 11
        with kvpool.Connection(daemon.socket) as conn:
            ok, detail = conn.check()
        assert ok, detail
