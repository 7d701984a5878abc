"""One client of the stress test: ``python stress_worker.py SOCKET SEED NOPS SWAP``.

Random create/extend/fork/free/swap for NOPS operations; errors the daemon may
legitimately answer under load (out of blocks) are counted, anything else
fails the process. Prints one JSON line of counts at the end.
"""

from __future__ import annotations

import json
import random
import sys

import kvpool
from faultkit import LAYOUT


def main() -> int:
    sock, seed, nops, swap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    live: list = []
    swapped: list = []
    shared = list(range(1000, 1016))  # a shared prefix: prefix-cache hits between processes
    with kvpool.connect(sock, name=f"stress-{seed}", layout=LAYOUT) as c:
        print("ready", flush=True)
        for _ in range(nops):
            ops = ["create"] * 3 + ["extend"] * 4 + (["fork", "free"] * 2 if live else [])
            if swap and live:
                ops.append("swap_out")
            if swapped:
                ops.append("swap_in")
            op = rng.choice(ops)
            try:
                if op == "create":
                    n = rng.randint(1, 3)
                    prompts = [(shared[: rng.randint(0, 16)] + [rng.randrange(50000) for _ in range(rng.randint(1, 24))])
                               for _ in range(n)]
                    live += c.create_sequences(prompts)
                    if rng.random() < 0.3:
                        c.mark_written(live[-n:])
                elif op == "extend":
                    if live:
                        batch = {s: [rng.randrange(50000) for _ in range(rng.randint(1, 6))]
                                 for s in rng.sample(live, min(len(live), rng.randint(1, 4)))}
                        c.extend(batch)
                elif op == "fork":
                    live.append(c.fork(rng.choice(live)))
                elif op == "free":
                    s = live.pop(rng.randrange(len(live)))
                    c.free(s)
                elif op == "swap_out":
                    s = live.pop(rng.randrange(len(live)))
                    c.swap_out(s)
                    swapped.append(s)
                elif op == "swap_in":
                    s = swapped.pop(rng.randrange(len(swapped)))
                    c.swap_in(s)
                    live.append(s)
                counts[op] = counts.get(op, 0) + 1
            except kvpool.OutOfBlocks:
                counts["out_of_blocks"] = counts.get("out_of_blocks", 0) + 1
                if live and rng.random() < 0.5:
                    c.free(live.pop(rng.randrange(len(live))))
            if len(live) > 24:
                c.free(live.pop(0))
        if rng.random() < 0.5:  # half leave their sequences to the daemon's detach
            c.free(live + swapped)
        c.flush()
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
