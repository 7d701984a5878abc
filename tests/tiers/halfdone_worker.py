"""A client whose tier operation is interrupted: ``python halfdone_worker.py SOCKET MODE``.

Prints ``calling`` just before the call the test interrupts (SIGKILL or
SIGSTOP), and ``done <n>`` if the call returns (n: the tokens whose KV is
there, or the blocks given back).  Modes:

* ``create``: create a sequence over prompt 0 (16 blocks), which the test put
  on the disk tier: the call waits for its promotion;
* ``swap_in``: create and write 4 sequences, swap them out, then swap them in
  (the call waits for the reads);
* ``swap_out``: create and write 4 sequences, swap them out (the reply comes
  after the device reads; the writes to disk may still run), then idle.
"""

from __future__ import annotations

import sys
import time

import kvpool
from tierlib import LAYOUT, prompt, write_sequence


def main() -> int:
    sock, mode = sys.argv[1], sys.argv[2]
    c = kvpool.connect(sock, name=f"halfdone-{mode}", layout=LAYOUT)
    if mode == "create":
        print("calling", flush=True)
        s = c.create_sequence(prompt(0, 16))
        print(f"done {s.num_cached_tokens}", flush=True)
    else:
        seqs = []
        for i in range(4):
            toks = prompt(200 + i, 3, extra=5)
            seqs.append(c.create_sequence(toks))
            write_sequence(c, seqs[-1], toks)
        if mode == "swap_out":
            print("calling", flush=True)
        n = c.swap_out(seqs)
        if mode == "swap_out":
            print(f"done {n}", flush=True)
        else:
            print("calling", flush=True)
            c.swap_in(seqs)
            print(f"done {sum(s.num_cached_tokens for s in seqs)}", flush=True)
    time.sleep(3600)  # until the test kills it
    return 0


if __name__ == "__main__":
    sys.exit(main())
