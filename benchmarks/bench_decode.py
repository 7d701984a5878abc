"""Paged decode and prefill on the GPU: ours vs FlashInfer vs SDPA on contiguous K/V.

    python3 benchmarks/bench_decode.py [--grid none|quick|full | --shapes 16x4096,...] [--variants v7]
        [--prefill 1024,4096] [--prefill-variants v8] [--no-gather] [--json PATH] [--division PER_SM:OVERHEAD:CLASSES]

Decode shape (the kernel notes' grid): bfloat16, head_dim 128, 32 query / 8 KV heads,
block size 16, block tables = random permutations of the pool. Timing: a
CUDA graph holds R consecutive calls whose inputs rotate over R copies
(R chosen so the copies exceed the 60 MB L2 several times), so neither Python
launch overhead nor L2 hits flatter small shapes; each graph replay is timed
with CUDA events after warm-up and we report the median per call. Bandwidth
is K+V bytes read per call over time, also as a fraction of the 4.18 TB/s
device-to-device copy (read + write) measured on the H200.

Rows: ``ours VARIANT`` (each kernel variant asked for: the shipped ``cuda_attention.VARIANTS``
and the benchmark-only ones of ``kernel_variants.py``, with the planner's split-KV and, for v7, stage choice),
``ours VARIANT bounded`` (called with ``min_seq_len`` = ``max_seq_len`` = the batch's length, where
that changes the plan: page-aware decode then runs the fixed grid), ``ours sN`` (the variant, forced N
splits, to tune the planner; ``VARIANT sN`` when several variants are timed), ``fi-tc`` / ``fi-cc`` (FlashInfer's
``BatchDecodeWithPagedKVCacheWrapper`` with / without ``use_tensor_cores``),
``sdpa`` (torch SDPA, contiguous K/V, no paging: the ceiling), ``gather+sdpa``
(index the blocks, then SDPA). FlashInfer reads the very same pool and block
tables: our pool stores per block [K|V][kv head][slot][dim], which is
FlashInfer's HND layout of a [pages, 2, heads, page_size, dim] cache, so it
gets a view, no copy. FlashInfer rows appear only where it imports (on the GPU
machine: ``source .fi-bundle/activate.sh``); a failure there is printed and
recorded, and the other rows still run.

Prefill (one sequence of ``ctx`` new tokens, causal): SDPA on contiguous K/V,
ours per variant (the kernel the planner runs for it is printed: ``wgmma gG kK sS`` =
the warpgroup-MMA kernel with G warpgroups, K-key tiles and S stages; ``dedicated
wW mN`` = the mma.sync prefill kernel with W warps of 16 N rows per CTA, ``generic`` = the
split-KV kernel), and FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` on the same
paged pool, last: its first use builds a JIT module (over a minute on a fresh
GPU machine). Rows print and the JSON is rewritten as soon as each is timed, so
a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from kvpool.kernels.cuda_attention import (
    DEFAULT_DECODE_VARIANT,
    DEFAULT_PREFILL_VARIANT,
    DEFAULT_TUNING,
)


HQ, HKV, D, BS = 32, 8, 128, 16
COPY_TBPS = 4.18
L2_BYTES = 60e6
FI_WORKSPACE = 256 * 1024 * 1024


def flashinfer_or_none():
    """FlashInfer if importable here, else None (it is optional: GPU machine only)."""
    try:
        import flashinfer

        return flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means: skip its rows
        print(f"# flashinfer unavailable: {type(e).__name__}: {e}")
        return None


_FI_WS: dict = {}


def fi_workspace() -> torch.Tensor:
    """One float workspace shared by every FlashInfer wrapper: wrappers planned for the
    same shapes hold identical plans, and their calls run one after another on one stream."""
    if "ws" not in _FI_WS:
        _FI_WS["ws"] = torch.zeros(FI_WORKSPACE, dtype=torch.uint8, device="cuda")
    return _FI_WS["ws"]


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
    # at idle clocks (a config measured first came out 10% slower).
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


def time_in_turn(timers, passes: int, case: str) -> tuple[dict[str, float], dict[str, str]]:
    """Run every ``(impl, () -> us)`` of ``timers`` ``passes`` times in turn (a, b, c, a, b, c,
    ...) and keep each one's lowest median, so that a drift of the clocks during a case spares
    no side; returns (us by impl, error by impl). A timer that raises is recorded and not run
    again."""
    best: dict[str, float] = {}
    errors: dict[str, str] = {}
    for _ in range(max(1, passes)):
        for impl, time_it in timers:
            if impl in errors:
                continue
            try:
                best[impl] = min(best.get(impl, math.inf), time_it())
            except Exception as e:  # noqa: BLE001 - record and go on
                print(f"# {impl} {case} failed: {type(e).__name__}: {str(e)[:300]}")
                errors[impl] = f"{type(e).__name__}: {e}"[:500]
    return best, errors


def eager_time_us(make_call, copies: int, replays: int = 20) -> float:
    """Median per-call µs of ``copies`` calls launched from Python (includes launch overhead)."""
    calls = [make_call(i) for i in range(copies)]
    for c in calls:
        c()
    times = []
    for _ in range(replays + 5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for c in calls:
            c()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / copies)
    return statistics.median(times[5:])


def decode_kv_bytes(batch: int, ctx: int) -> int:
    """K and V bytes (bfloat16) that one decode call reads."""
    return batch * ctx * HKV * D * 2 * 2


def decode_copies(batch: int, ctx: int) -> int:
    """Input copies to rotate over so that together they exceed L2 four times."""
    return max(1, math.ceil(4 * L2_BYTES / decode_kv_bytes(batch, ctx)))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"16x4096,1x1024"`` -> [(16, 4096), (1, 1024)]."""
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def decode_case(batch: int, ctx: int, copies: int, gen: torch.Generator, sequential: bool = False):
    """One pool holding ``copies`` disjoint sets of sequences; tables are random permutations
    (``sequential``: the pool's own order, a diagnostic of what paging costs in DRAM locality)."""
    blocks_per_seq = ctx // BS
    num_blocks = batch * blocks_per_seq * copies
    pool = torch.randn((num_blocks, 1, 2, HKV, BS, D), dtype=torch.bfloat16, device="cuda")
    order = torch.arange(num_blocks) if sequential else torch.randperm(num_blocks, generator=gen)
    perm = order.to(torch.int32).cuda()
    tables = perm.view(copies, batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qs = torch.randn((copies, batch, HQ, D), dtype=torch.bfloat16, device="cuda")
    return pool, tables, lens, qs


def _pipelines(variant: str | None):
    """What ``variant=`` takes for a variant name (None: what the defaults run)."""
    import kernel_variants

    return None if variant is None else kernel_variants.get(variant)


def bench_decode(batch: int, ctx: int, variants, split_options, fi, gen, with_gather=True, sequential=False,
                 tuning=DEFAULT_TUNING) -> list[dict]:  # fmt: skip
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import check_attention

    kv_bytes = decode_kv_bytes(batch, ctx)
    copies = decode_copies(batch, ctx)
    pool, tables, lens, qs = decode_case(batch, ctx, copies, gen, sequential)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    outs = torch.empty_like(qs)
    rows = []

    def ours(splits, variant=None, min_seq_len=None):
        def make(i):
            a = check_attention(qs[i], k, v, tables[i], lens, None, None, outs[i])
            return lambda: cuda_attention.paged_attention(
                a, qs[i], k, v, tables[i], lens, None, max_seq_len=ctx, min_seq_len=min_seq_len, num_splits=splits,
                variant=_pipelines(variant), tuning=tuning,
            )

        return make

    for variant in variants:
        us = graph_time_us(ours(None, variant), copies)
        plan = _decode_plan(batch, ctx, variant, tuning=tuning)
        rows.append(dict(impl=f"ours {variant}", batch=batch, ctx=ctx, us=us, splits=plan.num_splits, stages=plan.pipe.stages))
        bounded = _decode_plan(batch, ctx, variant, min_seq_len=ctx, tuning=tuning)
        if bounded != plan:  # what a caller that passes the even bounds gets (kvpool.hf's eager decode)
            us = graph_time_us(ours(None, variant, ctx), copies)
            rows.append(dict(impl=f"ours {variant} bounded", batch=batch, ctx=ctx, us=us, splits=bounded.num_splits,
                             stages=bounded.pipe.stages))  # fmt: skip
    for variant in variants:
        for splits in split_options:
            name = f"ours s{splits}" if len(variants) == 1 else f"{variant} s{splits}"
            us = graph_time_us(ours(splits, variant), copies)
            stages = _decode_plan(batch, ctx, variant, splits, tuning=tuning).pipe.stages
            rows.append(dict(impl=name, batch=batch, ctx=ctx, us=us, splits=splits, stages=stages))
    if fi is not None:
        for tc in (True, False):
            name = "fi-tc" if tc else "fi-cc"
            try:
                us, backend = _flashinfer_decode(fi, tc, pool, tables, qs, outs, batch, ctx, copies)
                rows.append(dict(impl=name, batch=batch, ctx=ctx, us=us, backend=backend))
            except Exception as e:  # noqa: BLE001 - record and go on with the other rows
                print(f"# {name} B{batch} L{ctx} failed: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)
                rows.append(dict(impl=name, batch=batch, ctx=ctx, us=float("nan"), error=f"{type(e).__name__}: {e}"[:500]))

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

    if with_gather and kv_bytes <= 4e9:
        rows.append(dict(impl="gather+sdpa", batch=batch, ctx=ctx, us=graph_time_us(gather_sdpa, copies)))
    for r in rows:
        if not math.isfinite(r["us"]):
            r["us"] = r["tb_per_s"] = r["frac_copy"] = float("nan")
            continue
        r["tb_per_s"] = kv_bytes / (r["us"] * 1e-6) / 1e12
        r["frac_copy"] = r["tb_per_s"] / COPY_TBPS
    return rows


def _flashinfer_decode(fi, tensor_cores: bool, pool, tables, qs, outs, batch, ctx, copies):
    """FlashInfer paged decode on our pool: one wrapper per input copy (each holds its
    own page indices), all planned alike and sharing one workspace."""
    paged = pool[:, 0]  # [blocks, 2, Hkv, BS, D] = FlashInfer's HND cache, a view
    per_seq = ctx // BS
    indptr = torch.arange(0, (batch + 1) * per_seq, per_seq, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), BS, dtype=torch.int32, device="cuda")
    wrappers = []
    for i in range(copies):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(fi_workspace(), "HND", use_tensor_cores=tensor_cores)
        w.plan(indptr, tables[i].reshape(-1).contiguous(), last, HQ, HKV, D, BS,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
        wrappers.append(w)
    make = lambda i: lambda: wrappers[i].run(qs[i], paged, out=outs[i])  # noqa: E731
    try:
        us = graph_time_us(make, copies)
    except Exception as e:  # noqa: BLE001 - not capturable here: time it eagerly, and say so
        print(f"# FlashInfer decode not capturable ({type(e).__name__}: {str(e)[:200]}); eager timing")
        torch.cuda.synchronize()
        us = eager_time_us(make, copies)
    return us, str(getattr(wrappers[0], "resolved_backend", "?"))


def _decode_plan(batch: int, ctx: int, variant: str | None = None, splits: int | None = None,
                 min_seq_len: int | None = None, tuning=DEFAULT_TUNING):
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import AttentionArgs, CacheGeometry

    geo = CacheGeometry(1, HKV, BS, D, 0, 0, torch.bfloat16, torch.device("cuda"))
    a = AttentionArgs(geo, batch, batch, HQ, HQ // HKV, 1.0, None)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return cuda_attention.plan_attention(
        a, prefill=False, max_blocks=ctx // BS, max_seq_len=ctx, num_sms=sms, variant=_pipelines(variant),
        num_splits=splits, min_seq_len=min_seq_len, tuning=tuning,
    )


def bench_prefill(ctx: int, variants, fi, gen, emit, tuning=DEFAULT_TUNING) -> list[dict]:
    """One sequence, ``ctx`` new tokens, causal: SDPA (contiguous), then ours (paged), then
    FlashInfer (paged; its first use builds a JIT module, a minute or more). ``emit(row)``
    gets each row as soon as it is timed, so a run cut short still shows what it measured.
    ``tuning``: the planner's knobs (``cuda_attention.Tuning``)."""
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import check_attention
    from kvpool.kernels.cuda_runtime import has_wgmma

    nblk = ctx // BS
    pool = torch.randn((nblk, 1, 2, HKV, BS, D), dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(nblk, generator=gen).to(torch.int32).cuda().view(1, nblk)
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
    q = torch.randn((ctx, HQ, D), dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    a = check_attention(q, k, v, table, lens, cu, None, out)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flops = 4 * ctx * ctx / 2 * HQ * D
    rows = []

    def add(name, us, **extra):
        sdpa_us = rows[0]["us"] if rows else us
        row = dict(impl=name, ctx=ctx, us=us, tflops=flops / (us * 1e-6) / 1e12, frac_sdpa=sdpa_us / us, **extra)
        rows.append(row)
        emit(row)

    kc = pool[table[0].long(), 0, 0].permute(1, 0, 2, 3).reshape(1, HKV, ctx, D).contiguous()
    vc = pool[table[0].long(), 0, 1].permute(1, 0, 2, 3).reshape(1, HKV, ctx, D).contiguous()
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    add("sdpa", graph_time_us(lambda i: lambda: F.scaled_dot_product_attention(q4, kc, vc, is_causal=True, enable_gqa=True), 1))
    for variant in variants:
        pipelines = _pipelines(variant)
        run = lambda pipelines=pipelines: cuda_attention.paged_attention(  # noqa: E731
            a, q, k, v, table, lens, cu, max_seq_len=ctx, variant=pipelines, tuning=tuning
        )
        plan = cuda_attention.plan_attention(
            a, prefill=True, max_blocks=nblk, max_seq_len=ctx, num_sms=sms, variant=pipelines, wgmma=has_wgmma(0),
            tuning=tuning,
        )
        p = plan.pipe
        if p.wgmma:
            kernel = f"wgmma g{p.warps // 4} k{p.keys} s{p.stages}"
        else:
            kernel = f"dedicated w{p.warps} m{p.mtiles}" if p.dedicated else f"generic s{plan.num_splits}"
        add(f"ours {variant}", graph_time_us(lambda i, run=run: run, 1), kernel=kernel)
    if fi is not None:
        try:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(fi_workspace(), "HND")
            w.plan(cu, torch.tensor([0, nblk], dtype=torch.int32, device="cuda"), table.reshape(-1).contiguous(),
                   torch.tensor([BS], dtype=torch.int32, device="cuda"), HQ, HKV, D, BS, causal=True,
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
            paged = pool[:, 0]
            us = graph_time_us(lambda i: lambda: w.run(q, paged, out=out), 1)
            add("fi-prefill", us, backend=str(getattr(w, "_backend", "?")))
        except Exception as e:  # noqa: BLE001
            print(f"# fi-prefill {ctx} failed: {type(e).__name__}: {str(e)[:300]}")
            add("fi-prefill", float("nan"), error=f"{type(e).__name__}: {e}"[:500])
    return rows


def _finite(x):
    """NaN (a failed row) as JSON null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


GRIDS = {
    "none": [],
    "quick": [(1, 1024), (1, 16384), (16, 4096), (64, 4096)],
    "full": [(b, c) for b in (1, 16, 64, 256) for c in (1024, 4096, 16384)],
}


def parse_sweep(text: str) -> list[tuple[int | None, int | None, int | None]]:
    """``"a:256,1:0,::8"`` -> [(None, 256, None), (1, 0, None), (None, None, 8)]: CTAs per SM
    planned (a: the planner's rule), an item's overhead in keys and the size classes of the item
    order, per page-aware configuration to time; an empty field keeps the planner's."""
    out = []
    for part in filter(None, text.split(",")):
        per_sm, overhead, classes = (part.split(":") + ["", ""])[:3]
        out.append((None if per_sm in ("a", "") else int(per_sm), int(overhead) if overhead else None,
                    int(classes) if classes else None))  # fmt: skip
    return out


def main() -> None:
    import kernel_variants

    names = ",".join(kernel_variants.names())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    p.add_argument("--shapes", default="", help="decode shapes BxCTX to time instead of --grid, e.g. 16x4096,16x16384")
    p.add_argument("--splits", default="", help="comma-separated forced split counts to compare, e.g. 1,2,4")
    p.add_argument("--splits-batches", default="", help="time the forced splits only at these batch sizes (default: all)")
    p.add_argument("--variants", type=kernel_variants.name_list, default=DEFAULT_DECODE_VARIANT,
                   help=f"our decode kernel variants to time ({names}; default: what decode runs)")
    p.add_argument("--prefill-variants", type=kernel_variants.name_list, default=DEFAULT_PREFILL_VARIANT,
                   help=f"our prefill kernel variants to time ({names}; default: what prefill runs)")
    p.add_argument("--no-gather", action="store_true", help="skip the gather-then-SDPA decode rows")
    p.add_argument("--sequential-tables", action="store_true",
                   help="block tables in pool order instead of random permutations (a diagnostic, not the notes' grid)")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer even if it imports")
    p.add_argument("--prefill", default="1024,4096", help="prefill lengths ('' to skip)")
    p.add_argument("--json", default=None, help="write all rows here")
    p.add_argument("--division", default="", help="page-aware knobs for every call, PER_SM:OVERHEAD:CLASSES "
                   "(bench_mixed_decode.py --sweep's fields; default: the planner's)")
    args = p.parse_args()

    bench(args, kernel_variants.tuning(*(parse_sweep(args.division) or [()])[0]))


def bench(args, tuning) -> None:
    """The tables and JSON of ``main``'s arguments, every call of ours planned with ``tuning``."""
    gen = torch.Generator().manual_seed(0)
    split_options = [int(x) for x in args.splits.split(",") if x]
    split_batches = {int(x) for x in args.splits_batches.split(",") if x}
    variants, prefill_variants = args.variants, args.prefill_variants
    fi = None if args.no_flashinfer else flashinfer_or_none()
    dev = torch.cuda.get_device_name(0)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fi_ver = getattr(fi, "__version__", None)
    print(f"# decode bf16 D={D} Hq={HQ} Hkv={HKV} bs={BS} on {dev}, {stamp}, flashinfer {fi_ver}")
    print("# us per call (median of CUDA-graph replays, inputs rotated past L2); copy% = K+V bytes / us vs 4.18 TB/s")
    print(f"{'B':>4} {'ctx':>6} {'impl':>12} {'us':>9} {'TB/s':>6} {'copy%':>6}")
    out = args.json or str(Path(__file__).parent / "results" / f"kernels-decode-{time.strftime('%Y%m%dT%H%M%S')}.json")
    rows, prefill = [], []

    def save():
        doc = dict(device=dev, date=stamp, flashinfer=fi_ver, copy_tb_per_s=COPY_TBPS,
                   tables="sequential" if args.sequential_tables else "random", decode=rows, prefill=prefill)
        Path(out).write_text(json.dumps(_finite(doc), indent=1))

    shapes = parse_shapes(args.shapes) or GRIDS[args.grid]
    for batch, ctx in shapes:
        splits_here = split_options if not split_batches or batch in split_batches else []
        for r in bench_decode(batch, ctx, variants, splits_here, fi, gen, not args.no_gather, args.sequential_tables,
                              tuning):  # fmt: skip
            rows.append(r)
            extra = f"  (splits={r['splits']}, stages={r['stages']})" if "splits" in r else ""
            extra += f"  [{r['backend']}]" if "backend" in r else ""
            print(f"{batch:>4} {ctx:>6} {r['impl']:>12} {r['us']:>9.1f} {r['tb_per_s']:>6.2f} {100 * r['frac_copy']:>5.0f}%{extra}", flush=True)
        torch.cuda.empty_cache()
        save()
    def emit_prefill(r):
        prefill.append(r)
        kernel = f"  [{r['kernel']}]" if "kernel" in r else ""
        print(f"prefill ctx={r['ctx']:>6} {r['impl']:>11} {r['us']:>9.1f} us {r['tflops']:>6.1f} TFLOP/s {100 * r['frac_sdpa']:>4.0f}% of sdpa{kernel}", flush=True)
        save()

    for ctx in [int(c) for c in args.prefill.split(",") if c]:
        bench_prefill(ctx, prefill_variants, fi, gen, emit_prefill, tuning)
    save()
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
