"""The remote tier (3): a prefix computed on one node served on another, and write-behind throughput.

    python3 benchmarks/bench_remote.py [--prompts 8] [--blocks 32] [--writes 2000]

Needs ``redis-server`` (started here on a Unix socket, no persistence).

1. **Cross-node prefix hit.**  Node A (a kvpoold) creates, writes and frees
   ``--prompts`` prompts of ``--blocks`` blocks (512 KiB each: a small
   Llama-like layout); its writer sends them to Redis.  Node B (another
   kvpoold on the same Redis) then creates the same prompts: each ``Create``
   finds the chain past its (empty) local tiers in Redis and returns with the
   bytes in its pool.  Yardsticks measured in the same run: a ``Create`` on B
   that misses everywhere (the remote tier asked, nothing there: the cost a
   miss adds before the model recomputes), and the same ``Create`` on a
   daemon without a remote tier.
2. **Write-behind throughput.**  ``RemoteStore`` alone: the time from queueing
   ``--writes`` blocks until Redis has them all, pipelined in batches of 256
   versus one round trip per block.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "remote"))  # redislib
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # conftest.Daemon

from _common import machine, print_table, write_json  # noqa: E402

BLOCK_SIZE = 16


def layout():
    import kvpool

    return kvpool.Layout("remote-bench", num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                         block_size=BLOCK_SIZE)


def prompt(i: int, blocks: int) -> list[int]:
    return [900_000 + i] + [(i * 7919 + k) % 32_000 for k in range(1, blocks * BLOCK_SIZE)]


def wait(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the remote tier did not catch up")
        time.sleep(0.05)


def cross_node(redis, args) -> dict:
    import torch

    import kvpool
    from conftest import Daemon

    common = ["--backend", "cpu", "--pool-bytes", "512MiB", "--chunk-bytes", "2MiB", "--log-level", "warning"]
    remote = ["--remote-url", redis.url, "--remote-timeout", "2"]
    a = Daemon(*common, *remote).start()
    b = Daemon(*common, *remote).start()
    plain = Daemon(*common).start()
    lay = layout()
    try:
        with kvpool.connect(a.socket, name="node-a", layout=lay) as ca:
            rows = ca.kv_cache().view(-1).view(torch.uint8).view(ca.num_blocks, -1)
            block_bytes = rows.shape[1]
            for i in range(args.prompts):
                s = ca.create_sequence(prompt(i, args.blocks))
                for j, blk in enumerate(s.block_table.tolist()):
                    rows[blk].fill_((i * 31 + j) % 251)
                ca.mark_written(s)
                ca.free(s)
            total = args.prompts * args.blocks
            wait(lambda: ca.stats().remote[0].blocks_written >= total)
        hit, miss, local_miss = [], [], []
        with kvpool.connect(b.socket, name="node-b", layout=lay) as cb, \
                kvpool.connect(plain.socket, name="no-remote", layout=lay) as cp:
            rows_b = cb.kv_cache().view(-1).view(torch.uint8).view(cb.num_blocks, -1)
            for i in range(args.prompts):  # the hits first: the misses' blocks are written out afterwards
                t0 = time.perf_counter()
                s = cb.create_sequence(prompt(i, args.blocks))
                hit.append(time.perf_counter() - t0)
                assert s.num_cached_tokens == args.blocks * BLOCK_SIZE, s.num_cached_tokens
                assert int(rows_b[int(s.block_table[-1])][0]) == (i * 31 + args.blocks - 1) % 251
                cb.free(s)
            for i in range(args.prompts):
                t0 = time.perf_counter()
                s = cb.create_sequence(prompt(10_000 + i, args.blocks))
                miss.append(time.perf_counter() - t0)
                cb.free(s)
                t0 = time.perf_counter()
                s = cp.create_sequence(prompt(20_000 + i, args.blocks))
                local_miss.append(time.perf_counter() - t0)
                cp.free(s)
            rs = cb.stats().remote[0]
        nbytes = args.blocks * block_bytes
        return {
            "blocks_per_prompt": args.blocks, "block_bytes": block_bytes, "prompts": args.prompts,
            "hit_ms": 1e3 * statistics.median(hit), "remote_miss_ms": 1e3 * statistics.median(miss),
            "no_remote_miss_ms": 1e3 * statistics.median(local_miss),
            "hit_gbps": nbytes / statistics.median(hit) / 1e9, "remote_hit_blocks": rs.hit_blocks,
        }
    finally:
        for d in (a, b, plain):
            d.stop()


def write_behind(redis, n: int, block_bytes: int, batch: int) -> dict:
    from kvpoold.transfer.remote import Namespace, RemoteSettings, RemoteStore

    store = RemoteStore(RemoteSettings(redis.url, batch_blocks=batch, queue_bytes=1 << 40))
    try:
        ns = Namespace(f"bench{batch}", f"bench {block_bytes}", block_bytes)
        rows = np.random.default_rng(0).integers(0, 256, (n, block_bytes), np.uint8)
        digests = [i.to_bytes(16, "little") for i in range(n)]
        t0 = time.perf_counter()
        store.put_many(ns, digests, list(rows))
        assert store.flush(600)
        dt = time.perf_counter() - t0
        assert store.blocks_written == n and store.failures == 0
        return {"blocks": n, "block_bytes": block_bytes, "batch": batch, "seconds": dt,
                "blocks_per_s": n / dt, "mb_per_s": n * block_bytes / dt / 1e6}
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per prompt (512 KiB each)")
    ap.add_argument("--writes", type=int, default=2000, help="blocks of the write-behind test")
    args = ap.parse_args()
    from redislib import RedisServer

    redis = RedisServer().start()
    try:
        x = cross_node(redis, args)
        writes = [write_behind(redis, args.writes, bb, batch) for bb in (4096, 64 << 10) for batch in (256, 1)]
    finally:
        redis.stop()
    print_table(f"cross-node prefix hit: {x['prompts']} prompts of {x['blocks_per_prompt']} blocks "
                f"of {x['block_bytes'] >> 10} KiB (median Create)",
                ["Create on node B", "ms", "GB/s"],
                [["remote hit (bytes in B's pool)", f"{x['hit_ms']:.2f}", f"{x['hit_gbps']:.2f}"],
                 ["miss, remote tier asked", f"{x['remote_miss_ms']:.2f}", ""],
                 ["miss, no remote tier (yardstick)", f"{x['no_remote_miss_ms']:.2f}", ""]])
    print_table("write-behind to Redis (queue to stored)", ["block", "batch", "blocks/s", "MB/s", "seconds"],
                [[f"{w['block_bytes'] >> 10} KiB", str(w["batch"]), f"{w['blocks_per_s']:.0f}",
                  f"{w['mb_per_s']:.0f}", f"{w['seconds']:.2f}"] for w in writes])
    write_json("remote", {"machine": machine(), "cross_node": x, "write_behind": writes})


if __name__ == "__main__":
    main()
