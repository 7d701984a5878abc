"""A model process for the integration tests, run as ``python client_proc.py SOCKET ACTION JSON``.

``device`` in JSON: passed to ``kvpool.connect``; ``init_cuda``: start CUDA in torch first (the
client then names torch's current GPU).  Actions (each prints one JSON line on stdout):
  write  -- create a sequence from ``prompt``, write each token's id as its K/V values
            into the shared pool, optionally free it; prints the block table
  read   -- create a sequence from ``prompt``; prints what it found cached and the
            values it reads back from the pool at the cached positions
  peek   -- print the values stored in ``blocks`` (first element of each token slot)
  fork   -- create from ``prompt``, write it, fork, extend the child by one token;
            prints both tables and the copy that ran
  hold   -- create ``n`` sequences, print "holding", then sleep until killed
"""

from __future__ import annotations

import json
import sys
import time

import kvpool

LAYOUT = kvpool.Layout("test-model", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def write_tokens(client, seq, start, tokens):
    """Write each token's id as its K and V values, through the zero-copy pool tensor."""
    import torch

    kv = client.kv_cache()  # CPU: shared memory; CUDA: the daemon's device memory over IPC
    slots = client.slot_mapping(seq, start, len(tokens))
    bs = LAYOUT.block_size
    for slot, tok in zip(slots.tolist(), tokens):
        kv[slot // bs, :, :, :, slot % bs, :] = float(tok)
    if kv.is_cuda:
        torch.cuda.synchronize(kv.device)  # the writes are done before anyone is told about them


def read_tokens(client, seq, count):
    kv = client.kv_cache()
    bs = LAYOUT.block_size
    return [float(kv[s // bs, 0, 0, 0, s % bs, 0]) for s in client.slot_mapping(seq, 0, count).tolist()]


def main() -> None:
    socket, action, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if args.get("init_cuda"):  # a model process that already uses its GPU: the pool of that GPU
        import torch

        torch.cuda.init()
    with kvpool.connect(socket, name=f"test-{action}", layout=LAYOUT, device=args.get("device")) as client:
        if action == "write":
            seq = client.create_sequence(args["prompt"])
            write_tokens(client, seq, seq.num_cached_tokens, args["prompt"][seq.num_cached_tokens:])
            client.mark_written(seq)
            out = {"table": seq.block_table.tolist()}
            if args.get("free"):
                client.free(seq)
            print(json.dumps(out), flush=True)
        elif action == "read":
            seq = client.create_sequence(args["prompt"])
            print(json.dumps({
                "table": seq.block_table.tolist(),
                "cached": seq.num_cached_tokens,
                "values": read_tokens(client, seq, seq.num_cached_tokens),
            }), flush=True)
        elif action == "peek":
            kv = client.kv_cache()
            bus = ""
            if kv.is_cuda:
                from kvpool.ipc.cuda import bus_id

                bus = bus_id(kv.device.index)
            print(json.dumps({"values": [kv[b, 0, 0, 0, :, 0].tolist() for b in args["blocks"]],
                              "device": str(kv.device), "bus_id": bus}), flush=True)
        elif action == "fork":
            seq = client.create_sequence(args["prompt"])
            write_tokens(client, seq, 0, args["prompt"])
            # its full block stays cached after this process ends: that keeps the class, and so the
            # bytes a later process peeks at (a class with nothing left is reclaimed, arena and all)
            client.mark_written(seq)
            child = client.fork(seq)
            r = client.extend({child: [args["next"]]})
            write_tokens(client, child, len(args["prompt"]), [args["next"]])
            print(json.dumps({
                "parent": seq.block_table.tolist(), "child": child.block_table.tolist(),
                "copies": [list(c) for c in r.copies],
            }), flush=True)
            time.sleep(args.get("linger", 0))
        elif action == "hold":
            seqs = [client.create_sequence(list(range(i, i + 10))) for i in range(args["n"])]
            client.mark_written(seqs)  # as if their KV had been computed
            print(json.dumps({"holding": len(seqs), "session": client.session_id}), flush=True)
            while True:
                time.sleep(1)
        else:
            raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main()
