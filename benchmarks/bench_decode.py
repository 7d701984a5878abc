"""Paged decode (and a little prefill) on the GPU: ours vs SDPA on contiguous K/V.

    python3 benchmarks/bench_decode.py [--grid quick|full] [--json PATH]

Decode shape of issue 5: bfloat16, head_dim 128, 32 query / 8 KV heads,
block size 16, block tables = random permutations of the pool. Timing: a
CUDA graph holds R consecutive calls whose inputs rotate over R copies
(R chosen so the copies exceed the 60 MB L2 several times), so neither Python
launch overhead nor L2 hits flatter small shapes; each graph replay is timed
with CUDA events after warm-up and we report the median per call. Bandwidth
is K+V bytes read per call over time, also as a fraction of the 4.18 TB/s
device-to-device copy (read + write) measured on the H200 (issue 5).

Rows: ``ours`` (planner's split-KV choice), ``ours sN`` (forced N splits, to
tune the planner), ``sdpa`` (torch SDPA, contiguous K/V, no paging: the
ceiling), ``gather+sdpa`` (index_select the blocks, then SDPA).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F


HQ, HKV, D, BS = 32, 8, 128, 16
COPY_TBPS = 4.18
L2_BYTES = 60e6


def graph_time_us(make_call, copies: int, replays: int = 20) -> float:
    """Median per-call µs of ``copies`` calls captured in one CUDA graph."""
    calls = [make_call(i) for i in range(copies)]
    for c in calls:  # warm-up: compile, load, allocate
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    # Warm up for >= 50 ms of GPU time: short shapes otherwise run their first replays
    # at idle clocks (run 3 saw the same config 10% slower when it was measured first).
    warm = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spent_ms = 0.0
    while spent_ms < 50.0:
        warm[0].record()
        for _ in range(5):
            g.replay()
        warm[1].record()
        warm[1].synchronize()
        spent_ms += warm[0].elapsed_time(warm[1])
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / copies)
    return statistics.median(times)


def decode_case(batch: int, ctx: int, copies: int, gen: torch.Generator):
    """One pool holding ``copies`` disjoint sets of sequences; tables are random permutations."""
    blocks_per_seq = ctx // BS
    num_blocks = batch * blocks_per_seq * copies
    pool = torch.randn((num_blocks, 1, 2, HKV, BS, D), dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32).cuda()
    tables = perm.view(copies, batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qs = torch.randn((copies, batch, HQ, D), dtype=torch.bfloat16, device="cuda")
    return pool, tables, lens, qs


def bench_decode(batch: int, ctx: int, split_options, gen) -> list[dict]:
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import check_attention

    kv_bytes = batch * ctx * HKV * D * 2 * 2
    copies = max(1, math.ceil(4 * L2_BYTES / kv_bytes))
    pool, tables, lens, qs = decode_case(batch, ctx, copies, gen)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    outs = torch.empty_like(qs)
    rows = []

    def ours(splits):
        def make(i):
            a = check_attention(qs[i], k, v, tables[i], lens, None, None, outs[i])
            return lambda: cuda_attention.paged_attention(
                a, qs[i], k, v, tables[i], lens, None, max_seq_len=ctx, num_splits=splits
            )

        return make

    for splits in [None, *split_options]:
        us = graph_time_us(ours(splits), copies)
        name = "ours" if splits is None else f"ours s{splits}"
        rows.append(dict(impl=name, batch=batch, ctx=ctx, us=us))
    plan_splits = _planned_splits(batch, ctx)
    rows[0]["splits"] = plan_splits

    # contiguous K/V for SDPA: [copies, B, Hkv, L, D] gathered once, outside timing
    def contiguous(i, which):
        blocks = pool[tables[i].long(), 0, which]  # [B, nblk, Hkv, BS, D]
        return blocks.permute(0, 2, 1, 3, 4).reshape(batch, HKV, ctx, D).contiguous()

    ks = [contiguous(i, 0) for i in range(copies)]
    vs = [contiguous(i, 1) for i in range(copies)]

    def sdpa(i):
        q4 = qs[i].unsqueeze(2)
        return lambda: F.scaled_dot_product_attention(q4, ks[i], vs[i], enable_gqa=True)

    rows.append(dict(impl="sdpa", batch=batch, ctx=ctx, us=graph_time_us(sdpa, copies)))

    def gather_sdpa(i):
        q4 = qs[i].unsqueeze(2)
        idx = tables[i].long()

        def run():
            kk = pool[idx, 0, 0].permute(0, 2, 1, 3, 4).reshape(batch, HKV, ctx, D)
            vv = pool[idx, 0, 1].permute(0, 2, 1, 3, 4).reshape(batch, HKV, ctx, D)
            return F.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)

        return run

    if kv_bytes <= 4e9:
        rows.append(dict(impl="gather+sdpa", batch=batch, ctx=ctx, us=graph_time_us(gather_sdpa, copies)))
    for r in rows:
        r["tb_per_s"] = kv_bytes / (r["us"] * 1e-6) / 1e12
        r["frac_copy"] = r["tb_per_s"] / COPY_TBPS
    return rows


def _planned_splits(batch: int, ctx: int) -> int:
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import AttentionArgs, CacheGeometry

    geo = CacheGeometry(1, HKV, BS, D, 0, 0, torch.bfloat16, torch.device("cuda"))
    a = AttentionArgs(geo, batch, batch, HQ, HQ // HKV, 1.0, None)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = cuda_attention.plan_attention(a, prefill=False, max_blocks=ctx // BS, max_seq_len=ctx, num_sms=sms)
    return plan.num_splits


def bench_prefill(ctx: int, gen) -> list[dict]:
    """One sequence, ``ctx`` new tokens, causal: ours (paged) vs SDPA (contiguous)."""
    from kvpool.kernels import paged_prefill_attention

    nblk = ctx // BS
    pool = torch.randn((nblk, 1, 2, HKV, BS, D), dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(nblk, generator=gen).to(torch.int32).cuda().view(1, nblk)
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
    q = torch.randn((ctx, HQ, D), dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    ours = graph_time_us(lambda i: lambda: paged_prefill_attention(q, k, v, table, lens, cu, out=out, max_seq_len=ctx), 1)
    kc = pool[table[0].long(), 0, 0].permute(1, 0, 2, 3).reshape(1, HKV, ctx, D).contiguous()
    vc = pool[table[0].long(), 0, 1].permute(1, 0, 2, 3).reshape(1, HKV, ctx, D).contiguous()
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    sdpa = graph_time_us(lambda i: lambda: F.scaled_dot_product_attention(q4, kc, vc, is_causal=True, enable_gqa=True), 1)
    flops = 4 * ctx * ctx / 2 * HQ * D
    return [
        dict(impl=name, ctx=ctx, us=us, tflops=flops / (us * 1e-6) / 1e12)
        for name, us in (("ours", ours), ("sdpa", sdpa))
    ]


GRIDS = {
    "quick": [(1, 1024), (1, 16384), (16, 4096), (64, 4096)],
    "full": [(b, c) for b in (1, 16, 64, 256) for c in (1024, 4096, 16384)],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    p.add_argument("--splits", default="", help="comma-separated forced split counts to compare, e.g. 1,2,4")
    p.add_argument("--prefill", default="1024,4096", help="prefill lengths ('' to skip)")
    p.add_argument("--json", default=None, help="write all rows here")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    split_options = [int(s) for s in args.splits.split(",") if s]
    dev = torch.cuda.get_device_name(0)
    print(f"# decode bf16 D={D} Hq={HQ} Hkv={HKV} bs={BS} on {dev}; us per call (median of graph replays)")
    print(f"{'B':>4} {'ctx':>6} {'impl':>12} {'us':>9} {'TB/s':>6} {'copy%':>6}")
    rows = []
    for batch, ctx in GRIDS[args.grid]:
        for r in bench_decode(batch, ctx, split_options, gen):
            rows.append(r)
            extra = f"  (splits={r['splits']})" if "splits" in r else ""
            print(f"{batch:>4} {ctx:>6} {r['impl']:>12} {r['us']:>9.1f} {r['tb_per_s']:>6.2f} {100 * r['frac_copy']:>5.0f}%{extra}")
        torch.cuda.empty_cache()
    prefill = []
    for ctx in [int(c) for c in args.prefill.split(",") if c]:
        for r in bench_prefill(ctx, gen):
            prefill.append(r)
            print(f"prefill ctx={ctx:>6} {r['impl']:>6} {r['us']:>9.1f} us {r['tflops']:>6.1f} TFLOP/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "decode": rows, "prefill": prefill}, indent=1))


if __name__ == "__main__":
    main()
