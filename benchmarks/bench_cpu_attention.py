"""Paged attention on the CPU (the Numba kernels of the CPU backend) against torch's SDPA.

    python3 benchmarks/bench_cpu_attention.py [--threads N] [--quick]

Same model shape as the GPU benchmark (32 query / 8 KV heads, head_dim 128,
block size 16, bfloat16 pool, block tables that are random permutations of the
pool), smaller sizes. Per case, in one process and one run:

* ``ours``: ``paged_decode_attention`` / ``paged_prefill_attention`` on CPU tensors;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V
  (no paging, the yardstick; float32 and bfloat16, whichever is faster here);
* ``gather+sdpa``: index the pool's blocks into contiguous K/V, then SDPA (what a
  paged cache costs without a paged kernel).

Times are medians in ms; the ratio column is ours / the best SDPA. The first call of
the Numba kernel compiles it (cached on disk), so every case is warmed up first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import print_table, write_json  # noqa: E402

from kvpool.kernels import paged_decode_attention, paged_prefill_attention  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def median_ms(fn, repeat: int) -> float:
    fn()  # warm-up (compiles on the first case)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def make_pool(batch: int, ctx: int, gen: torch.Generator):
    nblk = batch * ctx // BS
    pool = torch.randn((nblk, 1, 2, HKV, BS, D), generator=gen).to(torch.bfloat16)
    table = torch.randperm(nblk, generator=gen).to(torch.int32).view(batch, ctx // BS)
    return pool, table


def contiguous_kv(pool, table, dtype):
    """[B, Hkv, ctx, D] K and V gathered from the pool (the yardstick's input)."""
    b, nb = table.shape
    idx = table.long().reshape(-1)
    k = pool[idx, 0, 0].reshape(b, nb, HKV, BS, D).permute(0, 2, 1, 3, 4).reshape(b, HKV, nb * BS, D)
    v = pool[idx, 0, 1].reshape(b, nb, HKV, BS, D).permute(0, 2, 1, 3, 4).reshape(b, HKV, nb * BS, D)
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


def sdpa_best(q4, k, v, causal: bool, repeat: int) -> tuple[float, str]:
    """The faster of SDPA in float32 and in bfloat16 on these inputs, and which it was."""
    best = None
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd, vd = q4.to(dtype), k.to(dtype), v.to(dtype)
        ms = median_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=True), repeat)
        if best is None or ms < best[0]:
            best = (ms, str(dtype).removeprefix("torch."))
    return best


def bench_decode(batch: int, ctx: int, repeat: int, gen) -> dict:
    pool, table = make_pool(batch, ctx, gen)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn((batch, HQ, D), generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    ours = median_ms(lambda: paged_decode_attention(q, k_cache, v_cache, table, lens, out=out), repeat)
    k, v = contiguous_kv(pool, table, torch.float32)
    q4 = q.float().unsqueeze(2)  # [B, Hq, 1, D]
    sdpa, sdpa_dtype = sdpa_best(q4, k, v, False, repeat)
    gather = median_ms(
        lambda: F.scaled_dot_product_attention(
            q4.to(torch.bfloat16), *contiguous_kv(pool, table, torch.bfloat16), enable_gqa=True
        ),
        repeat,
    )
    return dict(mode="decode", batch=batch, ctx=ctx, ours_ms=ours, sdpa_ms=sdpa, sdpa_dtype=sdpa_dtype, gather_sdpa_ms=gather)


def bench_prefill(ctx: int, repeat: int, gen) -> dict:
    pool, table = make_pool(1, ctx, gen)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    lens = torch.tensor([ctx], dtype=torch.int32)
    cu = torch.tensor([0, ctx], dtype=torch.int32)
    q = torch.randn((ctx, HQ, D), generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    ours = median_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, table, lens, cu, out=out), repeat)
    k, v = contiguous_kv(pool, table, torch.float32)
    q4 = q.float().transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, ctx, D]
    sdpa, sdpa_dtype = sdpa_best(q4, k, v, True, repeat)
    gather = median_ms(
        lambda: F.scaled_dot_product_attention(
            q4.to(torch.bfloat16), *contiguous_kv(pool, table, torch.bfloat16), is_causal=True, enable_gqa=True
        ),
        repeat,
    )
    return dict(mode="prefill", batch=1, ctx=ctx, ours_ms=ours, sdpa_ms=sdpa, sdpa_dtype=sdpa_dtype, gather_sdpa_ms=gather)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="torch and Numba threads (0: leave the defaults)")
    p.add_argument("--quick", action="store_true", help="fewer cases and repeats (a smoke run)")
    args = p.parse_args()
    if args.threads:
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    repeat = 3 if args.quick else 9
    decode_cases = [(1, 1024), (8, 1024)] if args.quick else [(1, 1024), (1, 4096), (8, 1024), (8, 4096), (32, 1024)]
    prefill_cases = [256] if args.quick else [256, 1024]
    rows = [bench_decode(b, c, repeat, gen) for b, c in decode_cases] + [bench_prefill(c, repeat, gen) for c in prefill_cases]
    table = [
        [r["mode"], r["batch"], r["ctx"], f"{r['ours_ms']:.2f}", f"{r['sdpa_ms']:.2f} ({r['sdpa_dtype']})",
         f"{r['gather_sdpa_ms']:.2f}", f"{r['ours_ms'] / r['sdpa_ms']:.2f}"]
        for r in rows
    ]  # fmt: skip
    threads = torch.get_num_threads()
    print_table(
        f"paged attention on the CPU, bf16 pool, Hq={HQ} Hkv={HKV} D={D} bs={BS}, {threads} threads (ms, median)",
        ["mode", "B", "ctx", "ours", "sdpa contiguous (best dtype)", "gather+sdpa", "ours/sdpa"],
        table,
    )
    write_json("cpu_attention", {"threads": threads, "cases": rows})


if __name__ == "__main__":
    main()
