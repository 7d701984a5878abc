"""The remote tier (3): a prefix computed on one node served on another, and write-behind throughput.

    python3 benchmarks/bench_remote.py [--prompts 8] [--blocks 32] [--writes 2000] [--repeats 7]
                                       [--ttft-prompts 3] [--ttft-tokens 4096] [--only all|raw|ttft]
    python3 benchmarks/bench_remote.py --only raw --tls   # part 3 over rediss://
    python3 benchmarks/bench_remote.py --only raw --keyed  # part 3 with a secret: HMAC-SHA256 names and tags
    python3 benchmarks/bench_remote.py --only ttft --device cuda --redis-server .redis-bundle/bin/redis-server

Needs ``redis-server`` (started here on a Unix socket, no persistence; ``--redis-server`` names another,
e.g. the bundle that scripts/redis-bundle.sh makes for a machine without one).

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
3. **The tier against the raw client.**  ``RemoteStore.write_batch`` (the
   writer thread's pipelined ``SET``: header, checksum, ``EX``) and
   ``RemoteStore.fetch`` (the daemon's read: one ``EXISTS`` of the chain's
   keys, one ``MGET``, header and checksum checks) against redis-py's own
   pipelined ``SET``/``GET`` of values of the same sizes, 32 KiB and 2 MiB
   blocks, interleaved, median of ``--repeats``; the ratio (tier / raw) is the
   share of the client's bandwidth the tier keeps.  With ``--keyed`` the tier
   has a secret (``--remote-key-file``): HMAC-SHA256 block names and value
   tags instead of the xxh3 checksum.
4. **Time to first token, prompt found in Redis vs computed.**  A Llama-shaped
   random model through ``kvpool.hf.PagedModel``: on the CPU backend
   (``--device cpu``) a small one (4 layers, hidden 512, 8 heads over 2 KV
   heads, head_dim 64, float32); on the GPU (``--device cuda``: CUDA daemons,
   the model on the GPU) Llama-3.2-1B's shape in bfloat16 (16 layers, 32 heads
   over 8 KV heads, head_dim 64: 512 KiB per block of 16 tokens, 128 MiB of KV
   per 4096-token prompt); ``--ttft-model`` picks either anywhere.  Node A
   (remote tier) prefills ``--ttft-prompts`` prompts of ``--ttft-tokens``
   tokens, one at a time until Redis holds each; node B (same Redis, empty
   local tiers) times ``generate([prompt], max_new_tokens=1)`` (the prefix
   comes from Redis, only the last query is computed) against the same on a
   node C without a remote tier (the whole prefill), interleaved, after one
   warm-up of each.  Also reported: B's mean remote fetch time, and whether B
   and C choose the same first token (and their largest logit difference).
"""

from __future__ import annotations

import argparse
import os
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


def tier_vs_raw(redis, block_bytes: int, blocks: int, repeats: int, tls_ca: str = "",
                secret: bytes | None = None) -> dict:
    """GB/s of payload bytes: the tier's batched write and read paths vs the raw client's pipelined SET/GET
    (``tls_ca``: both over the server's ``rediss://`` URL, verified against this CA; ``secret``: the tier's
    names and checks keyed with it)."""
    from kvpoold.transfer.remote import Namespace, RemoteSettings, RemoteStore

    store = RemoteStore(RemoteSettings(redis.url, batch_blocks=blocks, timeout=60, socket_timeout=60, tls_ca=tls_ca,
                                       secret=secret))
    if tls_ca:
        import redis as redis_py

        raw = redis_py.Redis.from_url(redis.url, ssl_ca_certs=tls_ca, socket_timeout=60)
    else:
        raw = redis.client()
        raw.connection_pool.connection_kwargs["socket_timeout"] = 60
    try:
        ns = Namespace("tvr", f"tier-vs-raw {block_bytes}", block_bytes, secret)
        rows = list(np.random.default_rng(block_bytes).integers(0, 256, (blocks, block_bytes), np.uint8))
        digests = [i.to_bytes(16, "little") for i in range(blocks)]
        batch = [(ns.key(d), ns, row) for d, row in zip(digests, rows)]
        raw_keys = [b"raw:%d:%d" % (block_bytes, i) for i in range(blocks)]
        raw_values = [row.tobytes() for row in rows]  # the client's input as bytes: no copy counted for it

        def tier_write():
            store.write_batch(batch)

        def tier_read():
            got = store.fetch(ns, [digests])
            assert len(got.payloads) == blocks and got.refused == 0

        def raw_write():
            pipe = raw.pipeline(transaction=False)
            for k, v in zip(raw_keys, raw_values):
                pipe.set(k, v)
            pipe.execute()

        def raw_read():
            pipe = raw.pipeline(transaction=False)
            for k in raw_keys:
                pipe.get(k)
            got = pipe.execute()
            assert len(got) == blocks and all(v is not None for v in got)

        fns = {"tier_write": tier_write, "raw_write": raw_write, "tier_read": tier_read, "raw_read": raw_read}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():  # warm-up: connections, first allocation of the keys
            f()
        for _ in range(repeats):  # interleaved: noise falls on both
            for name, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        nbytes = blocks * block_bytes
        out = {"block_bytes": block_bytes, "blocks": blocks, "repeats": repeats}
        for name, t in times.items():
            out[f"{name}_gbps"] = nbytes / statistics.median(t) / 1e9
        out["write_ratio"] = out["tier_write_gbps"] / out["raw_write_gbps"]
        out["read_ratio"] = out["tier_read_gbps"] / out["raw_read_gbps"]
        return out
    finally:
        store.close()
        raw.flushall()
        raw.close()


SMALL_LLAMA = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, vocab_size=256)


def ttft_model(args):
    """The TTFT part's model (random weights, on ``args.device``) and a description of it for the JSON."""
    import torch

    if args.ttft_model == "small":
        from hf_models import make_model

        geometry = {**SMALL_LLAMA, "max_position_embeddings": max(8192, 2 * args.ttft_tokens)}
        model = make_model("llama", seed=0, device=args.device, **geometry)
        return model, {**SMALL_LLAMA, "dtype": "float32"}
    import transformers

    from bench_serve import llama_1b_config

    config = llama_1b_config()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size")
    return model, {"name": "Llama-3.2-1B shape, random weights", **{k: getattr(config, k) for k in keys},
                   "dtype": "bfloat16"}


def ttft(redis, args) -> dict:
    """TTFT of a 4k-token prompt whose KV is in Redis (node B) vs computed (node C)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hf"))
    from conftest import Daemon

    from kvpool.hf import PagedModel

    model, described = ttft_model(args)
    vocab = model.config.vocab_size
    if args.device == "cuda":
        common = ["--backend", "cuda", "--pool-bytes", "4GiB", "--chunk-bytes", "2MiB", "--log-level", "warning"]
    else:
        common = ["--backend", "cpu", "--pool-bytes", "512MiB", "--chunk-bytes", "2MiB", "--log-level", "warning"]
    # a hit's blocks must all arrive (up to 128 MiB for the 1B shape) for the time to mean anything
    remote = ["--remote-url", redis.url, "--remote-timeout", "30"]
    up = 120 if args.device == "cuda" else 30  # seconds to start: a CUDA daemon's first start loads CUDA and CuPy
    a, b, c = (Daemon(*common, *remote).start(up), Daemon(*common, *remote).start(up), Daemon(*common).start(up))
    rng = np.random.default_rng(4096)
    prompts = [rng.integers(0, vocab, args.ttft_tokens).tolist() for _ in range(args.ttft_prompts)]
    # the warm-up prompt: as long as the timed ones on the GPU, whose kernels are compiled on first use of a
    # shape; short on the CPU, where a prefill of the full length would cost seconds for nothing
    warm_tokens = args.ttft_tokens if args.device == "cuda" else 3 * BLOCK_SIZE + 5
    warm = rng.integers(0, vocab, warm_tokens).tolist()
    model_id = "bench-remote-ttft"

    def paged(d):
        return PagedModel.connect(model, d.socket, name=model_id, model_id=model_id, block_size=BLOCK_SIZE)

    def remote_stats(pm):
        return pm.client.stats().remote[0]

    try:
        with torch.no_grad():
            pa = paged(a)
            a_prefill = []
            written = 0
            for p in [warm, *prompts]:
                t0 = time.perf_counter()
                seqs, _ = pa.prefill([p])  # marks the prompt written: write-behind to Redis
                a_prefill.append(time.perf_counter() - t0)
                pa.free(seqs)
                # one prompt at a time reaches Redis: all of them at once could pass the write queue's bound
                written += len(p) // BLOCK_SIZE
                wait(lambda: (lambda r: r.blocks_written >= written and r.write_queue_blocks == 0)(remote_stats(pa)))
            ra = remote_stats(pa)
            assert ra.write_dropped == 0 and ra.failures == 0, ra
            block_bytes = ra.bytes_written // ra.blocks_written
            pa.close()
            pb_, pc = paged(b), paged(c)
            for pm in (pb_, pc):  # warm-up, off the clock: B's from Redis, C's computed
                pm.generate([warm], max_new_tokens=1)
            before = remote_stats(pb_)
            hit, full, cached, answers, diffs = [], [], [], [], []
            for p in prompts:  # interleaved: noise falls on both
                t0 = time.perf_counter()
                g = pb_.generate([p], max_new_tokens=1, output_logits=True)
                hit.append(time.perf_counter() - t0)
                cached.append(g.num_cached_tokens[0])
                t0 = time.perf_counter()
                h = pc.generate([p], max_new_tokens=1, output_logits=True)
                full.append(time.perf_counter() - t0)
                answers.append(g.tokens[0] == h.tokens[0])
                diffs.append((g.logits[0] - h.logits[0]).abs().max().item())
            rs = remote_stats(pb_)
            pb_.close()
            pc.close()
        lookups = rs.lookups - before.lookups
        return {
            "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "model": described, "prompt_tokens": args.ttft_tokens, "prompts": args.ttft_prompts,
            "torch_threads": torch.get_num_threads(), "block_bytes_stored": block_bytes,
            "prompt_bytes_stored": block_bytes * (args.ttft_tokens // BLOCK_SIZE),
            "node_a_prefill_s": statistics.median(a_prefill[1:]),
            "remote_hit_ttft_s": statistics.median(hit), "full_prefill_ttft_s": statistics.median(full),
            "speedup": statistics.median(full) / statistics.median(hit),
            "remote_hit_ttft_all_s": hit, "full_prefill_ttft_all_s": full,
            "node_b_fetch_s_mean": (rs.fetch_seconds - before.fetch_seconds) / max(1, lookups),
            "cached_tokens": cached, "same_first_token": all(answers), "max_abs_logit_diff": max(diffs),
            "node_b_remote_hit_blocks": rs.hit_blocks - before.hit_blocks,
            "node_b_bytes_read": rs.bytes_read - before.bytes_read,
        }
    finally:
        for d in (a, b, c):
            d.stop()


def raw_key(args) -> str:
    """The JSON key of the tier-vs-raw part: how it ran (TLS, keyed) is in its name."""
    return "tier_vs_raw" + ("_tls" if args.tls else "") + ("_keyed" if args.keyed else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per prompt (512 KiB each)")
    ap.add_argument("--writes", type=int, default=2000, help="blocks of the write-behind test")
    ap.add_argument("--repeats", type=int, default=7, help="repeats of the tier-vs-raw test (median)")
    ap.add_argument("--ttft-prompts", type=int, default=3)
    ap.add_argument("--ttft-tokens", type=int, default=4096)
    ap.add_argument("--only", choices=["all", "raw", "ttft"], default="all",
                    help="run only the tier-vs-raw or the TTFT part (the JSON then holds only that part)")
    ap.add_argument("--tls", action="store_true",
                    help="with --only raw: the tier and the raw client over TLS (rediss://, a throwaway CA made "
                         "with the openssl command; JSON: tier_vs_raw_tls)")
    ap.add_argument("--keyed", action="store_true",
                    help="with --only raw: the tier with a secret (HMAC-SHA256 names and tags, as with "
                         "--remote-key-file; JSON: tier_vs_raw_keyed)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="the TTFT part's daemons (--backend) and model; cuda goes with --only ttft "
                         "(JSON: results/remote_cuda.json)")
    ap.add_argument("--ttft-model", choices=["small", "llama-3.2-1b"], default=None,
                    help="the TTFT part's model: a 4-layer float32 Llama (the CPU's default) or Llama-3.2-1B's "
                         "shape in bfloat16 (the GPU's default); random weights either way")
    ap.add_argument("--redis-server", default="redis-server",
                    help="the redis-server to start, e.g. .redis-bundle/bin/redis-server (scripts/redis-bundle.sh)")
    args = ap.parse_args()
    if (args.tls or args.keyed) and args.only != "raw":
        ap.error("--tls and --keyed go with --only raw")
    if args.device == "cuda" and args.only != "ttft":
        ap.error("--device cuda goes with --only ttft")
    args.ttft_model = args.ttft_model or ("llama-3.2-1b" if args.device == "cuda" else "small")
    import tempfile

    from redislib import Certs, RedisServer

    certs = Certs(tempfile.mkdtemp(prefix="kvpool-bench-certs-")) if args.tls else None
    redis = RedisServer(tls=certs, binary=args.redis_server).start()
    results: dict = {}
    try:
        if args.only == "all":
            results["cross_node"] = cross_node(redis, args)
            results["write_behind"] = [write_behind(redis, args.writes, bb, batch)
                                       for bb in (4096, 64 << 10) for batch in (256, 1)]
        if args.only in ("all", "raw"):  # 64 MiB of values per pass for either size
            secret = os.urandom(32) if args.keyed else None
            results[raw_key(args)] = [
                tier_vs_raw(redis, bb, (64 << 20) // bb, args.repeats, certs.ca if certs else "", secret)
                for bb in (32 << 10, 2 << 20)]
        if args.only in ("all", "ttft"):
            results["ttft"] = ttft(redis, args)
    finally:
        redis.stop()
    if "cross_node" in results:
        x = results["cross_node"]
        print_table(f"cross-node prefix hit: {x['prompts']} prompts of {x['blocks_per_prompt']} blocks "
                    f"of {x['block_bytes'] >> 10} KiB (median Create)",
                    ["Create on node B", "ms", "GB/s"],
                    [["remote hit (bytes in B's pool)", f"{x['hit_ms']:.2f}", f"{x['hit_gbps']:.2f}"],
                     ["miss, remote tier asked", f"{x['remote_miss_ms']:.2f}", ""],
                     ["miss, no remote tier (yardstick)", f"{x['no_remote_miss_ms']:.2f}", ""]])
        print_table("write-behind to Redis (queue to stored)", ["block", "batch", "blocks/s", "MB/s", "seconds"],
                    [[f"{w['block_bytes'] >> 10} KiB", str(w["batch"]), f"{w['blocks_per_s']:.0f}",
                      f"{w['mb_per_s']:.0f}", f"{w['seconds']:.2f}"] for w in results["write_behind"]])
    for key in ("tier_vs_raw", "tier_vs_raw_tls", "tier_vs_raw_keyed", "tier_vs_raw_tls_keyed"):
        if key not in results:
            continue
        rows = []
        for r in results[key]:
            size = f"{r['block_bytes'] >> 10} KiB" if r["block_bytes"] < 1 << 20 else f"{r['block_bytes'] >> 20} MiB"
            for way in ("write", "read"):
                rows.append([size, str(r["blocks"]), way, f"{r[f'tier_{way}_gbps']:.2f}",
                             f"{r[f'raw_{way}_gbps']:.2f}", f"{r[f'{way}_ratio']:.2f}"])
        over = ("TLS on localhost" if "tls" in key else "a Unix socket") + (", keyed" if "keyed" in key else "")
        print_table(f"the tier vs redis-py's pipelined SET/GET over {over} (payload GB/s, median of "
                    f"{args.repeats}, interleaved)", ["block", "blocks", "way", "tier GB/s", "raw GB/s", "tier/raw"],
                    rows)
    if "ttft" in results:
        t = results["ttft"]
        where = t["gpu"] or "CPU"
        print_table(f"time to first token, {t['prompt_tokens']}-token prompt, {t['model'].get('name', 'small Llama')} "
                    f"{t['model']['dtype']} on {where} (median of {t['prompts']}; "
                    f"{t['prompt_bytes_stored'] / 2**20:.0f} MiB of KV per prompt in Redis)",
                    ["node", "TTFT s", "cached tokens"],
                    [["B: prefix from Redis", f"{t['remote_hit_ttft_s']:.3f}", str(min(t["cached_tokens"]))],
                     ["  of which the remote fetch (mean)", f"{t['node_b_fetch_s_mean']:.3f}", ""],
                     ["C: no remote tier (full prefill)", f"{t['full_prefill_ttft_s']:.3f}", "0"],
                     ["speedup (C / B)", f"{t['speedup']:.2f}x", ""]])
        print(f"same first token: {t['same_first_token']}; "
              f"max |logit difference| B vs C: {t['max_abs_logit_diff']:.3g}")
    if args.device == "cuda":  # a file of its own: the CPU figures stay as they are
        write_json("remote_cuda", results)
        return
    if args.only != "all":  # keep the other parts of the last full run
        import json

        from _common import RESULTS

        path = RESULTS / "remote.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        old.pop("machine", None)
        results = {**old, **results}
    write_json("remote", results)

if __name__ == "__main__":
    main()
