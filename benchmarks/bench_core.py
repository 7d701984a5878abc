"""Speed of the pure core, each figure beside a yardstick measured in the same run.

    python3 benchmarks/bench_core.py

Targets:
* allocate+free of a batch of 64 costs no more per block than a dict insert+delete;
* ``extend`` of 256 sequences by one token costs at most 1/10 of an empty gRPC
  round trip over a Unix socket;
* block hashing costs at most 1/3 of hashlib.sha256 over the same bytes;
* freeing a batch of 2048 sequences costs no more per block than the
  ``extend`` that allocated them (measured in the same rounds); its ratio to
  a dict insert+delete is printed beside it.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import EmptyRpcYardstick, median_ns, percentiles, print_table, write_json  # noqa: E402

from kvpoold.core import Geometry, KVCacheManager  # noqa: E402
from kvpoold.core.hashing import chain_hashes, pack_tokens, root_hash  # noqa: E402

GEOMETRY = Geometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)


def bench_alloc_free() -> list[dict]:
    m = KVCacheManager(64 << 30, chunk_bytes=2 << 20)
    pool = m.classes[m.register_class(GEOMETRY)]
    pool.release(pool.allocate(4096))  # warm: slabs taken once
    yard = _dict_insert_delete_ns()
    rows = []
    for batch in (1, 64):
        def op():
            pool.release(pool.allocate(batch))

        ns = median_ns(op, number=max(200, 20000 // batch)) / batch
        rows.append({"batch": batch, "ns_per_block": ns, "dict_insert_delete_ns": yard, "ratio": ns / yard})
    return rows


def _dict_insert_delete_ns() -> float:
    d: dict = {}

    def dict_op():
        d[1] = None
        del d[1]

    return median_ns(dict_op, number=20000)


def bench_free_batch(n_seqs: int = 2048, blocks_each: int = 4, rounds: int = 7) -> dict:
    """``free`` of a batch of ``n_seqs`` sequences, per block (the ``extend`` that allocated them for scale)."""
    m = KVCacheManager(64 << 30, chunk_bytes=2 << 20)
    cid = m.register_class(GEOMETRY)
    bs = GEOMETRY.block_size
    alloc, free = [], []
    for r in range(rounds):  # a new extra key each round: no prefix hits on the last round's blocks
        ids = np.array([m.create(1, cid, "llama", [i % 32000], extra_key=str(r)).seq_id for i in range(n_seqs)])
        counts = np.full(n_seqs, blocks_each * bs, np.int64)
        tokens = (np.arange(n_seqs * blocks_each * bs) % 32000).astype(np.uint32)
        t0 = time.perf_counter_ns()
        m.extend_columns(1, ids, counts, tokens)
        t1 = time.perf_counter_ns()
        m.free(1, ids.tolist())
        t2 = time.perf_counter_ns()
        alloc.append((t1 - t0) / (n_seqs * blocks_each))
        free.append((t2 - t1) / (n_seqs * (blocks_each + 1)))
    a, f = statistics.median(alloc), statistics.median(free)
    yard = _dict_insert_delete_ns()
    return {"sequences": n_seqs, "blocks_per_sequence": blocks_each + 1, "free_ns_per_block": f,
            "extend_alloc_ns_per_block": a, "dict_insert_delete_ns": yard, "ratio_to_dict": f / yard,
            "ratio": f / a}


def bench_extend(yard_rpc_p50_ns: float, steps: int = 400) -> dict:
    m = KVCacheManager(256 << 30, chunk_bytes=2 << 20)
    cid = m.register_class(GEOMETRY)
    seqs = [m.create(1, cid, "llama", [(i * 7 + j) % 32000 for j in range(100 + i)]).seq_id for i in range(256)]
    ids = np.array(seqs, np.int64)
    samples = []
    for step in range(steps):
        tokens = ((ids + step) % 32000).astype(np.uint32)  # the wire carries packed arrays
        t0 = time.perf_counter_ns()
        m.extend_columns(1, ids, None, tokens)  # None: one token each (the wire's decode form)
        samples.append(time.perf_counter_ns() - t0)
    p = percentiles(samples)
    return {**p, "empty_rpc_p50_us": yard_rpc_p50_ns / 1e3, "ratio_p50": p["p50_us"] * 1e3 / yard_rpc_p50_ns}


def bench_hash(block_size: int = 16, n_tokens: int = 16384) -> dict:
    tokens = [(i * 2654435761) % 128000 for i in range(n_tokens)]
    root = root_hash("llama")
    packed = pack_tokens(tokens)

    raw = memoryview(packed).cast("B")
    step = block_size * 4

    def sha_chain():
        parent = hashlib.sha256(b"llama").digest()
        for start in range(0, len(raw), step):
            parent = hashlib.sha256(parent + raw[start : start + step]).digest()

    # interleaved rounds, so that a noisy neighbour hits both sides alike
    ours, ours_prepacked, sha, ratios = [], [], [], []
    for _ in range(15):
        a = median_ns(lambda: chain_hashes(root, pack_tokens(tokens), block_size), repeat=1, number=10)
        b = median_ns(lambda: chain_hashes(root, packed, block_size), repeat=1, number=10)
        y = median_ns(sha_chain, repeat=1, number=10)
        ours.append(a), ours_prepacked.append(b), sha.append(y), ratios.append(b / y)
    ours, ours_prepacked, sha = (statistics.median(v) for v in (ours, ours_prepacked, sha))
    return {
        "ns_per_token": ours / n_tokens,
        "ns_per_token_prepacked": ours_prepacked / n_tokens,
        "sha256_ns_per_token": sha / n_tokens,
        # the target compares like with like: both hash the same token bytes
        "ratio": statistics.median(ratios),
        "ratio_including_packing": ours / sha,
    }


def main() -> None:
    with EmptyRpcYardstick() as rpc:
        rpc_samples = rpc.samples_ns(3000)
    rpc_p = percentiles(rpc_samples)
    alloc = bench_alloc_free()
    extend = bench_extend(rpc_p["p50_us"] * 1e3)
    hashing = bench_hash()
    free = bench_free_batch()

    print_table(
        "allocate + free (LayoutClass), per block",
        ["batch", "ns/block", "dict ins+del ns", "ratio", "target"],
        [[r["batch"], f"{r['ns_per_block']:.1f}", f"{r['dict_insert_delete_ns']:.1f}", f"{r['ratio']:.2f}",
          "<= 1.0" if r["batch"] == 64 else "-"] for r in alloc],
    )
    print_table(
        "extend of 256 sequences by one token (KVCacheManager.extend)",
        ["p50 us", "p99 us", "empty RPC p50 us", "ratio p50", "target"],
        [[f"{extend['p50_us']:.1f}", f"{extend['p99_us']:.1f}", f"{extend['empty_rpc_p50_us']:.1f}",
          f"{extend['ratio_p50']:.3f}", "<= 0.10"]],
    )
    print_table(
        "prefix hashing (xxh3-128 chain, 16-token blocks)",
        ["ns/token (from bytes)", "sha256 ns/token (same bytes)", "ratio", "target",
         "ns/token (from a list of ints)"],
        [[f"{hashing['ns_per_token_prepacked']:.2f}", f"{hashing['sha256_ns_per_token']:.2f}",
          f"{hashing['ratio']:.2f}", "<= 0.33", f"{hashing['ns_per_token']:.2f}"]],
    )
    print_table(
        "free of a batch of sequences (KVCacheManager.free), per block",
        ["sequences", "blocks each", "free ns/block", "extend (allocating) ns/block", "ratio", "target",
         "dict ins+del ns", "ratio to dict"],
        [[free["sequences"], free["blocks_per_sequence"], f"{free['free_ns_per_block']:.1f}",
          f"{free['extend_alloc_ns_per_block']:.1f}", f"{free['ratio']:.2f}", "<= 1.0",
          f"{free['dict_insert_delete_ns']:.1f}", f"{free['ratio_to_dict']:.2f}"]],
    )
    write_json("core", {"empty_rpc": rpc_p, "alloc_free": alloc, "extend_256": extend, "hashing": hashing,
                        "free_batch": free})


if __name__ == "__main__":
    main()
