"""A model process the elastic-pool tests drive line by line: ``python vmm_proc.py SOCKET JSON``.

JSON: ``layout`` (kvpool.Layout keywords), ``seed`` and optionally ``device``
(the CUDA ordinal of the pool to attach to, default 0).  Then each line on
stdin is a JSON command; each answer is one JSON line on stdout:

  {"op": "fill", "n": N, "tokens": T}  create N sequences of T tokens, write a
                                        pattern (seed, block, position) into each block
  {"op": "free", "count": K}           free the K oldest sequences held
  {"op": "verify"}                     every held block still has its pattern?
  {"op": "quit"}

Errors come back as {"error": "..."}; the process keeps going.
"""

from __future__ import annotations

import json
import sys

import torch

import kvpool


def pattern(seed: int, block: int, block_elems: int, dtype) -> torch.Tensor:
    base = (seed * 1000003 + block * 7919) % 997
    return ((torch.arange(block_elems, dtype=torch.float64) + base) % 251).to(dtype)


def main() -> None:
    socket, args = sys.argv[1], json.loads(sys.argv[2])
    layout = kvpool.Layout(**args["layout"])
    seed = int(args["seed"])
    device = int(args.get("device", 0))
    with kvpool.connect(socket, name=f"vmm-{seed}", layout=layout, device=device) as client:
        kv = client.kv_cache()
        flat = kv.view(kv.shape[0], -1)
        held: list = []
        written: dict[int, torch.Tensor] = {}
        print(json.dumps({"ready": True, "num_blocks": client.num_blocks}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["op"] == "fill":
                    start = len(held)
                    prompts = [[seed * 100000 + (start + i) * 1000 + t for t in range(cmd["tokens"])]
                               for i in range(cmd["n"])]
                    seqs = client.create_sequences(prompts)
                    kv = client.kv_cache()
                    flat = kv.view(kv.shape[0], -1)
                    for s in seqs:
                        for b in s.block_table.tolist():
                            written[b] = pattern(seed, b, flat.shape[1], flat.dtype).to(flat.device)
                            flat[b] = written[b]
                    torch.cuda.synchronize()
                    client.mark_written(seqs)
                    held += seqs
                    out = {"held": len(held), "blocks": len(written)}
                elif cmd["op"] == "free":
                    gone, held = held[:cmd["count"]], held[cmd["count"]:]
                    keep = {b for s in held for b in s.block_table.tolist()}
                    client.free(gone)
                    written = {b: v for b, v in written.items() if b in keep}
                    out = {"held": len(held)}
                elif cmd["op"] == "verify":
                    torch.cuda.synchronize()
                    bad = [b for b, v in written.items() if not torch.equal(flat[b], v)]
                    out = {"checked": len(written), "bad": bad[:10]}
                elif cmd["op"] == "quit":
                    break
                else:
                    out = {"error": f"unknown op {cmd['op']}"}
            except kvpool.KvpoolError as exc:
                out = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
