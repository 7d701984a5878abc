"""Decode on real batches: mixed lengths, ours vs FlashInfer, and float8 vs bfloat16 KV.

    python3 benchmarks/bench_mixed_decode.py [--grid quick|full] [--variants v9,v7] [--no-fp8] [--json PATH]
        [--sweep a:256,1:0,2:,::8] [--passes 2] [--cases skewed,spread] [--fp8-variants v9,v9s2]
        [--fp8-shapes 64x4096,256x4096]

Shape as bench_decode.py: bfloat16, head_dim 128, 32 query / 8 KV heads, block size 16,
random-permutation block tables, CUDA graphs with inputs rotated past L2, median per call.

Batches (lengths fixed per case, seeded):
* ``skewed BxL/n``: n sequences of L tokens among B - n short ones (64 to 1024 tokens);
* ``spread BxL``: B lengths drawn log-uniformly from L/100 to L (two orders of magnitude).

Rows: ``ours VARIANT`` (v9: page-aware decode, the default; v7: the fixed (sequence x
split) grid it replaces), ``fi-tc`` / ``fi-cc`` (FlashInfer's paged decode wrapper with /
without tensor cores, planned with the batch's true lengths on the host), ``best-fi`` (the
faster of the two), and ``sdpa-pad`` (torch SDPA on contiguous K/V padded to the longest
sequence with a key mask; only where the padded K/V fit in 8 GB: it reads B x L keys).
``copy%``: K/V bytes the batch really holds over the time, against the 4.18 TB/s
device-to-device copy. ``vs fi``: our time over FlashInfer's best (<= 1 is the target).

``--sweep PER_SM:OVERHEAD:CLASSES,...`` adds rows ``v9 sPER_SM oOVERHEAD cCLASSES``: page-aware
decode planned with other knobs (``kernel_variants.tuning``: CTAs per SM of the wave, an item's
fixed cost, the size classes of the item order; an empty field keeps the planner's).
``--passes N`` times every row N times in turn and keeps the lowest median.

float8: ``ours`` (and ``--fp8-variants``, with ``kernel_variants.PROBES``) on a float8 e4m3
pool against the same shape in bfloat16, uniform batches (the target: at most 0.55x the
bfloat16 time from B64 x 4k up), with FlashInfer's float8 decode on the same pool, and each
variant also ``bounded`` (called with the batch's true ``min_seq_len`` and ``max_seq_len``:
these even batches then run the fixed grid), against bfloat16 called alike; before
them, the bandwidth of random gathers of 1-8 KiB rows (a float8 block's rows of one KV head
are 2 KiB, bfloat16's 4 KiB).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_decode import (
    BS, COPY_TBPS, D, HKV, HQ, L2_BYTES, _finite, fi_workspace, flashinfer_or_none, graph_time_us, parse_sweep,
    time_in_turn,
)


def skewed(batch: int, longest: int, n_long: int, rng: random.Random) -> list[int]:
    lens = [longest] * n_long + [rng.randint(64, 1024) for _ in range(batch - n_long)]
    rng.shuffle(lens)
    return lens


def spread(batch: int, longest: int, rng: random.Random) -> list[int]:
    lo = math.log(max(1, longest // 100))
    return [int(math.exp(rng.uniform(lo, math.log(longest)))) for _ in range(batch)]


def cases(grid: str) -> list[tuple[str, list[int]]]:
    rng = random.Random(0)
    out = []
    skews = [(2, 131072, 1), (8, 32768, 1), (32, 131072, 1), (64, 8192, 1), (128, 32768, 2), (256, 131072, 1),
             (256, 8192, 4)]  # fmt: skip
    spreads = [(16, 32768), (64, 8192), (256, 32768)]
    if grid == "full":
        skews += [(2, 8192, 1), (8, 131072, 1), (32, 8192, 1), (64, 32768, 4), (128, 131072, 1), (256, 32768, 1)]
        spreads += [(2, 131072), (16, 8192), (64, 32768), (128, 131072), (256, 8192)]
    for b, longest, n in skews:
        out.append((f"skewed {b}x{longest // 1024}k/{n}", skewed(b, longest, n, rng)))
    for b, longest in spreads:
        out.append((f"spread {b}x{longest // 1024}k", spread(b, longest, rng)))
    return out


def make_pool(lens: list[int], copies: int, dtype: torch.dtype, gen: torch.Generator):
    """One pool of ``copies`` disjoint sets of the batch's blocks; random tables."""
    need = [-(-n // BS) for n in lens]
    per_copy, width = sum(need), max(need)
    pool = torch.randn((per_copy * copies, 1, 2, HKV, BS, D), dtype=torch.bfloat16, device="cuda").to(dtype)
    perm = torch.randperm(per_copy * copies, generator=gen).to(torch.int32).cuda()
    tables = torch.zeros((copies, len(lens), width), dtype=torch.int32, device="cuda")
    flat = []
    for c in range(copies):
        start = c * per_copy
        ids = []
        for b, n in enumerate(need):
            tables[c, b, :n] = perm[start : start + n]
            ids.append(perm[start : start + n])
            start += n
        flat.append(torch.cat(ids))
    return pool, tables, flat


def fi_page_layout(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's page indptr and last-page lengths for sequences of ``lens`` tokens (their
    pages listed one sequence after another, as ``make_pool``'s flat lists are)."""
    need = [-(-n // BS) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(need).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    last = torch.tensor([n - (m - 1) * BS for n, m in zip(lens, need)], dtype=torch.int32, device="cuda")
    return indptr, last


def bench_case(name, lens, variants, fi, gen, dtype=torch.bfloat16, with_sdpa=True, sweep=(), passes=1,
               bounded=False) -> list[dict]:
    """Rows for one batch: each timed ``passes`` times in turn (ours, FlashInfer, ours, ...),
    the lowest median kept, so that a drift of the clocks during the case spares no side.
    ``bounded``: each variant also as ``ours VARIANT bounded``, called with the batch's true
    ``max_seq_len`` and ``min_seq_len`` (an even batch then runs the fixed grid)."""
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import check_attention

    import kernel_variants

    batch, longest = len(lens), max(lens)
    es = torch.empty(0, dtype=dtype).element_size()
    kv_bytes = sum(lens) * HKV * D * 2 * es
    copies = max(1, math.ceil(4 * L2_BYTES / kv_bytes))
    pool, tables, flat = make_pool(lens, copies, dtype, gen)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qs = torch.randn((copies, batch, HQ, D), dtype=torch.bfloat16, device="cuda")
    outs = torch.empty_like(qs)
    timers = []  # (impl, () -> us)

    def ours(variant, knobs=(), bounds=(None, None)):
        pipelines, tuning = kernel_variants.get(variant), kernel_variants.tuning(*knobs)

        def make(i):
            a = check_attention(qs[i], k, v, tables[i], seq_lens, None, None, outs[i])
            return lambda: cuda_attention.paged_attention(a, qs[i], k, v, tables[i], seq_lens, None, variant=pipelines,
                                                          tuning=tuning, max_seq_len=bounds[0],
                                                          min_seq_len=bounds[1])  # fmt: skip

        return lambda: graph_time_us(make, copies)

    for variant in variants:
        timers.append((f"ours {variant}", ours(variant)))
        if bounded:
            timers.append((f"ours {variant} bounded", ours(variant, bounds=(longest, min(lens)))))
    for knobs in sweep:
        per_sm, overhead, classes = knobs
        timers.append((f"v9 s{per_sm or 'a'} o{overhead} c{classes}", ours("v9", knobs)))
    fi_impls = []
    if fi is not None:
        indptr, last = fi_page_layout(lens)
        paged = pool[:, 0]
        for tc in (True, False):
            def fi_time(tc=tc):
                wrappers = []
                for i in range(copies):
                    w = fi.BatchDecodeWithPagedKVCacheWrapper(fi_workspace(), "HND", use_tensor_cores=tc)
                    w.plan(indptr, flat[i], last, HQ, HKV, D, BS, q_data_type=torch.bfloat16, kv_data_type=dtype)
                    wrappers.append(w)
                return graph_time_us(lambda i: lambda: wrappers[i].run(qs[i], paged, out=outs[i]), copies)

            impl = "fi-tc" if tc else "fi-cc"
            fi_impls.append(impl)
            timers.append((impl, fi_time))
    best, errors = time_in_turn(timers, passes, name)
    rows = []

    def add(impl, us, **extra):
        rows.append(dict(case=name, impl=impl, batch=batch, longest=longest, kv_bytes=kv_bytes, us=us,
                         frac_copy=kv_bytes / (us * 1e-6) / 1e12 / COPY_TBPS if math.isfinite(us) else float("nan"),
                         **extra))  # fmt: skip

    for impl, _ in timers:
        if impl in errors:
            add(impl, float("nan"), error=errors[impl])
        else:
            add(impl, best[impl])
    fi_best = min((best[i] for i in fi_impls if i in best), default=math.inf)
    if math.isfinite(fi_best):
        add("best-fi", fi_best)
    padded = batch * longest * HKV * D * 2 * 2
    if with_sdpa and padded <= 8e9:
        kpad = torch.zeros((batch, HKV, longest, D), dtype=torch.bfloat16, device="cuda")
        vpad = torch.zeros_like(kpad)
        for b, n in enumerate(lens):
            blocks = pool[tables[0, b, : -(-n // BS)].long(), 0].float().to(torch.bfloat16)  # [nb, 2, Hkv, BS, D]
            kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, HKV, -1, D)[:, :, :n]
            kpad[b, :, :n], vpad[b, :, :n] = kv[0], kv[1]
        mask = (torch.arange(longest, device="cuda")[None, :] < seq_lens[:, None]).view(batch, 1, 1, longest)
        q4 = qs[0].unsqueeze(2)
        add("sdpa-pad", graph_time_us(lambda i: lambda: F.scaled_dot_product_attention(q4, kpad, vpad, attn_mask=mask, enable_gqa=True), 1))
        del kpad, vpad
    del pool
    torch.cuda.empty_cache()
    return rows


def gather_tb_per_s(row_bytes: int, total: int = 1 << 31) -> float:
    """Bytes read plus written per second by a gather of every ``row_bytes`` row of a
    ``total``-byte buffer in random order: what the memory system gives reads of that size at
    random places (a float8 block's rows of one KV head are 2 KiB, bfloat16's 4 KiB)."""
    rows = total // row_bytes
    src = torch.randint(0, 255, (rows, row_bytes // 16, 16), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    idx = torch.randperm(rows, device="cuda")
    us = graph_time_us(lambda i: lambda: torch.index_select(src, 0, idx, out=dst), 1)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * rows * row_bytes / (us * 1e-6) / 1e12


FP8_SHAPES = [(64, 4096), (128, 4096), (64, 16384), (256, 4096), (16, 4096), (1, 16384)]


def main() -> None:
    import kernel_variants

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=["quick", "full"], default="quick")
    p.add_argument("--variants", type=kernel_variants.name_list, default="v9,v7", help="our decode variants to time")
    p.add_argument("--no-fp8", action="store_true", help="skip the float8 rows")
    p.add_argument("--sweep", default="", help="page-aware knobs to time besides the variants, PER_SM:OVERHEAD:CLASSES,... "
                   "(PER_SM a: the planner's rule; an empty field: the planner's), e.g. a:0,1:256,2:")
    p.add_argument("--passes", type=int, default=1, help="time every row this many times in turn, keep the lowest")
    p.add_argument("--fp8-variants", type=kernel_variants.name_list, default="",
                   help="decode variants to time on the float8 shapes, kernel_variants.PROBES included (default: the first)")
    p.add_argument("--fp8-shapes", default=",".join(f"{b}x{c}" for b, c in FP8_SHAPES), help="BxCTX,... of the float8 rows")
    p.add_argument("--cases", default="", help="only the cases whose names contain one of these, comma-separated")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "mixed-decode.json"))
    args = p.parse_args()
    variants = args.variants
    fi = None if args.no_flashinfer else flashinfer_or_none()
    gen = torch.Generator().manual_seed(0)
    dev, stamp = torch.cuda.get_device_name(0), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"# mixed-length decode bf16 D={D} Hq={HQ} Hkv={HKV} bs={BS} on {dev}, {stamp}, flashinfer {getattr(fi, '__version__', None)}")
    print(f"{'case':>22} {'impl':>9} {'us':>9} {'copy%':>6} {'vs fi':>6}")
    rows, fp8 = [], []

    def save():
        doc = dict(device=dev, date=stamp, flashinfer=getattr(fi, "__version__", None), copy_tb_per_s=COPY_TBPS,
                   mixed=rows, fp8=fp8)  # fmt: skip
        Path(args.json).write_text(json.dumps(_finite(doc), indent=1))

    sweep = parse_sweep(args.sweep)
    wanted = [c for c in args.cases.split(",") if c]
    for name, lens in cases(args.grid):
        if wanted and not any(w in name for w in wanted):
            continue
        got = bench_case(name, lens, variants, fi, gen, sweep=sweep, passes=args.passes)
        best = next((r["us"] for r in got if r["impl"] == "best-fi"), float("nan"))
        for r in got:
            r["vs_fi"] = r["us"] / best if math.isfinite(best) else float("nan")
            print(f"{name:>22} {r['impl']:>9} {r['us']:>9.1f} {100 * r['frac_copy']:>5.0f}% {r['vs_fi']:>6.2f}", flush=True)
        rows.extend(got)
        save()
    if not args.no_fp8:
        print(f"{'fp8 shape':>22} {'bf16 us':>9} {'fp8 us':>9} {'ratio':>6}")
        for row in (1024, 2048, 4096, 8192):
            tb = gather_tb_per_s(row)
            fp8.append(dict(gather_row_bytes=row, tb_per_s=tb))
            print(f"# random gather of {row}-byte rows: {tb:.2f} TB/s ({100 * tb / COPY_TBPS:.0f}% of copy)", flush=True)
        fp8_variants = args.fp8_variants or variants[:1]
        for batch, ctx in [tuple(map(int, x.split("x"))) for x in args.fp8_shapes.split(",") if x]:
            lens = [ctx] * batch
            ref16 = bench_case(f"{batch}x{ctx}", lens, variants[:1], None, gen, torch.bfloat16, False, bounded=True)
            t16s = {r["impl"]: r["us"] for r in ref16}
            got = bench_case(f"{batch}x{ctx}", lens, fp8_variants, fi, gen, torch.float8_e4m3fn, False, sweep=sweep,
                             bounded=True)  # fmt: skip
            for r in got:  # each row against the bfloat16 time of the same call (bounded or not)
                impl, t8 = r["impl"], r["us"]
                t16 = t16s[f"ours {variants[0]} bounded" if impl.endswith("bounded") else f"ours {variants[0]}"]
                fp8.append(dict(batch=batch, ctx=ctx, variant=impl, bf16_us=t16, fp8_us=t8, ratio=t8 / t16))
                print(f"{f'{batch}x{ctx} {impl}':>22} {t16:>9.1f} {t8:>9.1f} {t8 / t16:>6.2f}", flush=True)
            save()
    save()
    print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
