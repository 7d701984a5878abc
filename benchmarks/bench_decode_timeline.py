"""Where a paged decode call's time goes, CTA by CTA, on the GPU (a diagnostic).

    python3 benchmarks/bench_decode_timeline.py [--shapes 16x4096,16x16384,1x1024] [--calls 15] [--json PATH]

For each shape (the notes' decode grid: bfloat16, head_dim 128, 32 query / 8 KV heads, block
size 16, random block tables; ``bench_decode.decode_case``) this compiles the decode
kernel with timestamps added to its source (``%globaltimer`` and ``%smid``, written by
thread 0 of each CTA to a buffer) and runs ``--calls`` single calls, each after a
200 MB write that evicts L2. Per call, in µs from the first CTA's start:

- ``first tile``: median time from a CTA's start until its first K/V tile has landed
  (the table read and the first load, queued behind every other CTA's);
- ``loop end p10/p50/max``: when CTAs finish their key loops;
- ``epilogue``: median time for a CTA to merge its warps and write its rows or partials
  (with two splits as a cluster pair: until split 1 has written its rows into split 0's
  shared memory, or split 0 is ready to wait for them);
- ``merge``: median time of the fused split merge, in the CTAs that run it (a pair's split
  0: its wait for split 1 and the merge);
- ``span``: first CTA start to last CTA end.

The table shows the call with the median span. Then per SM: each SM's mean loop end over
the even calls against the odd ones (a correlation near 1 means the spread between SMs
is a property of the SMs, not chance), and the SMs split at the median into a fast and a
slow half, with each half's mean loop end. ``NOTES-kernels.md`` has what this found on
the H200.

The instrumented kernel is what ``paged_decode_attention`` runs, plus the stores of the
stamps; the script fails with the missing line's text if the kernel source no longer
has one of the lines it instruments. Needs a CUDA GPU and CuPy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import bench_decode as bd

SLOTS = 16  # stamps per CTA: 0 start, 1 first tile, 2 loop end, 3 epilogue end, 4 merge end, 5 smid + 1
MAX_CTAS = 16384

_STAMP_NOW = (
    "__device__ __forceinline__ unsigned long long stamp_now() {\n"
    "    unsigned long long t;\n    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t));\n    return t;\n}\n"
)
_KERNEL = "template <int DT, int DA, int KF, int WKV, int NS, int KT, bool PAIR>\n__device__ __forceinline__ void attention_cta("
_CTA_START = "    const bool paged = work_target > 0;        // page-aware: grid (items x KV heads)\n"
_FIRST_TILE = "        const int base = first + step * k;\n        if (base >= w_hi) continue;"
_LOOP_END = "    __syncthreads();                                         // the rings are free: reuse them\n"
_EPILOGUE_END = "        if (nsplit == 1 || counters == nullptr) return;      // merge_splits_kernel follows\n"
_MERGE_END = "ns, lane);\n        }\n    }\n}\n"
# the pair kernel (two splits as a cluster): split 1 has pushed its rows; split 0 is about to
# wait for them; split 0 has written the merged rows
_PAIR_SENT = "            cluster_arrive();                                // release: the rows above are visible\n"
_PAIR_WAIT = "        cluster_arrive();\n        cluster_wait();"
_PAIR_END = "            out[out_row(r) * DA + d] = from_f32<DT>(o);\n        }\n    } else {\n"
# (a piece of the kernel source, what replaces it)
_EDITS = [
    (_KERNEL, _STAMP_NOW + _KERNEL),
    (_CTA_START, _CTA_START
     + "    unsigned long long* STAMP = (unsigned long long*)STAMP_ADDR + "
     "(((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * STAMP_SLOTS;\n"
     "    if (threadIdx.x == 0) { STAMP[0] = stamp_now(); u32 sm; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm)); "
     "STAMP[5] = sm + 1; }\n"),
    (_FIRST_TILE, _FIRST_TILE.replace("\n", "\n        if (k == 0 && threadIdx.x == 0) STAMP[1] = stamp_now();\n", 1)),
    (_LOOP_END, _LOOP_END + "    if (threadIdx.x == 0) STAMP[2] = stamp_now();\n"),
    (_EPILOGUE_END, "        __syncthreads();\n        if (threadIdx.x == 0) STAMP[3] = stamp_now();\n" + _EPILOGUE_END),
    (_MERGE_END, "ns, lane);\n        }\n        __syncthreads();\n        if (threadIdx.x == 0) STAMP[4] = stamp_now();\n    }\n}\n"),
    (_PAIR_SENT, "            __syncthreads();\n            if (threadIdx.x == 0) STAMP[3] = stamp_now();\n" + _PAIR_SENT),
    (_PAIR_WAIT, "        __syncthreads();\n        if (threadIdx.x == 0) STAMP[3] = stamp_now();\n" + _PAIR_WAIT),
    (_PAIR_END, _PAIR_END.replace("    } else {\n",
                                  "        __syncthreads();\n        if (threadIdx.x == 0) STAMP[4] = stamp_now();\n    } else {\n")),
]


def instrumented(source: str, addr: int) -> str:
    """The kernel source with the stamps added (``addr``: the device buffer they go to)."""
    s = source
    for old, new in _EDITS:
        if s.count(old) != 1:
            raise SystemExit(f"the kernel source has {s.count(old)} copies of a piece this script instruments "
                             f"(it needs exactly one): {old.strip()!r}")
        s = s.replace(old, new)
    return f"#define STAMP_ADDR {addr}ULL\n#define STAMP_SLOTS {SLOTS}\n" + s


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def call_summary(stamps: list[list[int]]) -> dict:
    """One call's per-CTA stamps (ns) -> the table's figures (µs) and each CTA's SM and loop end."""
    ctas = [s for s in stamps if s[0]]
    t0 = min(s[0] for s in ctas)
    us = lambda t: (t - t0) / 1e3  # noqa: E731
    ends = [us(max(s[3], s[4])) for s in ctas if s[3]]
    merges = [(s[4] - s[3]) / 1e3 for s in ctas if s[4]]
    loop_end = [us(s[2]) for s in ctas if s[2]]
    return dict(
        ctas=len(ctas),
        first_tile=statistics.median((s[1] - s[0]) / 1e3 for s in ctas if s[1]),
        loop_end_p10=_pct(loop_end, 10), loop_end_p50=_pct(loop_end, 50), loop_end_max=max(loop_end),
        epilogue=statistics.median((s[3] - s[2]) / 1e3 for s in ctas if s[3] and s[2]),
        merge=statistics.median(merges) if merges else 0.0,
        span=max(ends),
        per_cta=[(s[5] - 1, us(s[2])) for s in ctas if s[2]],
    )


def sm_classes(calls: list[dict]) -> dict:
    """Per-SM mean loop end: even calls against odd ones, and a fast / slow half."""

    def means(subset):
        by_sm: dict[int, list[float]] = {}
        for c in subset:
            for sm, end in c["per_cta"]:
                by_sm.setdefault(sm, []).append(end)
        return {sm: statistics.fmean(v) for sm, v in by_sm.items()}

    even, odd, every = means(calls[0::2]), means(calls[1::2]), means(calls)
    sms = sorted(set(even) & set(odd))
    corr = statistics.correlation([even[s] for s in sms], [odd[s] for s in sms]) if len(sms) > 2 else float("nan")
    order = sorted(every, key=every.get)
    half = len(order) // 2
    fast, slow = order[:half], order[half:]
    return dict(
        sms=len(every),
        even_odd_correlation=corr,
        fast_half_loop_end=statistics.fmean(every[s] for s in fast),
        slow_half_loop_end=statistics.fmean(every[s] for s in slow),
        slow_sms=sorted(slow),
    )


def timeline(batch: int, ctx: int, calls: int, stamps: torch.Tensor) -> dict:
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import check_attention

    gen = torch.Generator().manual_seed(0)
    copies = bd.decode_copies(batch, ctx)
    pool, tables, lens, qs = bd.decode_case(batch, ctx, copies, gen)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    outs = torch.empty_like(qs)
    plan = bd._decode_plan(batch, ctx)
    n = plan.grid[0] * plan.grid[1] * plan.grid[2]
    if n > MAX_CTAS:
        raise SystemExit(f"B{batch} x {ctx} has {n} CTAs; this script stamps at most {MAX_CTAS}")
    runs = []
    for i in range(copies):
        a = check_attention(qs[i], k, v, tables[i], lens, None, None, outs[i])
        runs.append(lambda i=i, a=a: cuda_attention.paged_attention(a, qs[i], k, v, tables[i], lens, None, max_seq_len=ctx))
    for _ in range(200):  # compile, then clocks up
        runs[0]()
    evict = torch.empty(int(200e6), dtype=torch.uint8, device="cuda")
    results = []
    for c in range(calls):
        evict.fill_(c & 255)
        stamps.zero_()
        torch.cuda.synchronize()
        runs[c % copies]()
        torch.cuda.synchronize()
        results.append(call_summary(stamps[: n * SLOTS].view(n, SLOTS).cpu().tolist()))
    median = sorted(results, key=lambda r: r["span"])[len(results) // 2]
    row = {key: val for key, val in median.items() if key != "per_cta"}
    return dict(batch=batch, ctx=ctx, splits=plan.num_splits, stages=plan.pipe.stages, median_call=row,
                spans=[r["span"] for r in results], sm=sm_classes(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16x4096,16x16384,1x1024", help="decode shapes BxCTX")
    p.add_argument("--calls", type=int, default=15, help="calls per shape (at least 4)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.calls < 4:
        p.error("--calls must be at least 4 (the SM analysis compares even and odd calls)")
    from kvpool.kernels import cuda_runtime

    stamps = torch.zeros(MAX_CTAS * SLOTS, dtype=torch.int64, device="cuda")
    cuda_runtime.SOURCE = instrumented(cuda_runtime.SOURCE, stamps.data_ptr())
    cuda_runtime._functions.cache_clear()
    dev = torch.cuda.get_device_name(0)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"# decode timeline, bf16 D={bd.D} Hq={bd.HQ} Hkv={bd.HKV} bs={bd.BS} on {dev}, {stamp}; µs, the median call of {args.calls}")
    print(f"{'B':>4} {'ctx':>6} {'CTAs':>5} {'first tile':>10} {'loop end p10/p50/max':>22} {'epilogue':>8} {'merge':>6} {'span':>7}"
          f" | {'SMs':>3} {'even/odd r':>10} {'fast/slow half loop end':>24}")
    rows = []
    for batch, ctx in bd.parse_shapes(args.shapes):
        r = timeline(batch, ctx, args.calls, stamps)
        rows.append(r)
        m, sm = r["median_call"], r["sm"]
        ends = f"{m['loop_end_p10']:.1f} / {m['loop_end_p50']:.1f} / {m['loop_end_max']:.1f}"
        halves = f"{sm['fast_half_loop_end']:.1f} / {sm['slow_half_loop_end']:.1f}"
        print(f"{batch:>4} {ctx:>6} {m['ctas']:>5} {m['first_tile']:>10.1f} {ends:>22} {m['epilogue']:>8.2f} {m['merge']:>6.2f} "
              f"{m['span']:>7.1f} | {sm['sms']:>3} {sm['even_odd_correlation']:>10.2f} {halves:>24}", flush=True)
        torch.cuda.empty_cache()
    out = args.json or str(Path(__file__).parent / "results" / f"kernels-timeline-{time.strftime('%Y%m%dT%H%M%S')}.json")
    Path(out).write_text(json.dumps(dict(device=dev, date=stamp, calls=args.calls, shapes=rows), indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
