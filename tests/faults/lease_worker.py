"""A client of the lease tests: ``python lease_worker.py SOCKET MODE``.

Attaches, creates 3 sequences of 10 tokens, prints ``ready <session id>``,
then obeys one command per stdin line and answers with one line:

* ``busy S``: hold the client's lock and spin in pure Python for S seconds
  (no call to the daemon meanwhile), then ``busy done``;
* ``call``: one call that needs the session (``extend`` through the daemon);
  prints ``ok`` or ``<error type>: <message>``, and whether the heartbeat
  thread saw the session end (``expired=True``).
"""

from __future__ import annotations

import sys
import time

import kvpool
from faultkit import LAYOUT


def main() -> int:
    sock = sys.argv[1]
    c = kvpool.connect(sock, name="lease-worker", layout=LAYOUT)
    seqs = c.create_sequences([list(range(i * 100, i * 100 + 10)) for i in range(3)])
    print(f"ready {c.session_id}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "busy":
            end = time.monotonic() + float(args[0])
            with c._lock:  # the heartbeat must not need it
                n = 0
                while time.monotonic() < end:
                    n = (n * 31 + 7) % 1000003  # GIL-heavy Python, no I/O
            print("busy done", flush=True)
        elif cmd == "call":
            try:
                c.extend({seqs[0]: [1]})
                c.flush()  # reaches the daemon
                print(f"ok expired={c.session_expired.is_set()}", flush=True)
            except kvpool.KvpoolError as exc:
                print(f"{type(exc).__name__}: {exc} expired={c.session_expired.is_set()}", flush=True)
        elif cmd == "quit":
            break
    try:
        c.close()
    except kvpool.KvpoolError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
