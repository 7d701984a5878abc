"""Prefill on real batches: several prompts, prompts behind a prefix hit, and a chunk of a long
prompt beside many one-token decodes, ours vs FlashInfer's paged prefill.

    python3 benchmarks/bench_mixed_prefill.py [--variants v8] [--fi-backends fa2,fa3] [--passes 2]
        [--cases fresh,prefix,chunk] [--json PATH]

Shape as bench_decode.py: bfloat16, head_dim 128, 32 query / 8 KV heads, block size 16,
random-permutation block tables; causal, each sequence's queries its last ``q_len`` positions
(``paged_prefill_attention``'s contract, and FlashInfer's causal mask with fewer queries than
keys). CUDA graphs, median per call; every row timed ``--passes`` times in turn (ours,
FlashInfer, ours, ...), the lowest median kept.

Batches (``name: (q_len, cached tokens before the queries) per sequence``):
* ``fresh``: several new prompts, nothing cached (equal or mixed lengths);
* ``prefix``: new prompt tokens behind a prefix already in the pool (a prefix-cache hit);
* ``chunk``: one chunk of a long prompt (chunked prefill) beside many decodes (q_len 1).

Rows: ``ours VARIANT`` (what ``paged_prefill_attention`` runs; ``--variants`` names others),
``fi-fa2`` / ``fi-fa3`` (FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, causal, planned
with the true lengths on the host), ``best-fi`` (the faster). ``TFLOP/s`` counts the causal
products the batch needs (4 x visible keys x head_dim per query head and query);
``vs fi``: our time over FlashInfer's best (<= 1 is the target).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from bench_decode import (
    BS, D, HKV, HQ, L2_BYTES, _finite, fi_workspace, flashinfer_or_none, graph_time_us, time_in_turn,
)
from bench_mixed_decode import fi_page_layout, make_pool


def cases() -> list[tuple[str, list[tuple[int, int]]]]:
    rng = random.Random(0)
    mixed = [2048, 1024, 768, 512, 384, 256, 128, 64]
    return [
        ("fresh 4x1k", [(1024, 0)] * 4),
        ("fresh 8x1k", [(1024, 0)] * 8),
        ("fresh 16x512", [(512, 0)] * 16),
        ("fresh 4x4k", [(4096, 0)] * 4),
        ("fresh mixed 8", [(n, 0) for n in mixed]),
        ("prefix 4x512+4k", [(512, 4096)] * 4),
        ("prefix 8x256+2k", [(256, 2048)] * 8),
        ("prefix 16x128+8k", [(128, 8192)] * 16),
        ("prefix mixed 8", [(rng.choice([64, 256, 1024]), rng.choice([512, 4096, 16384])) for _ in range(8)]),
        ("chunk 2k@16k+64dec", [(2048, 14336)] + [(1, rng.randint(256, 4096)) for _ in range(64)]),
        ("chunk 512@32k+128dec", [(512, 32256)] + [(1, rng.randint(256, 8192)) for _ in range(128)]),
        ("chunk 4k@0+32dec", [(4096, 0)] + [(1, rng.randint(1024, 16384)) for _ in range(32)]),
    ]


def causal_flops(batch: list[tuple[int, int]]) -> float:
    """Multiply-adds x 2 of Q K^T and P V over the keys each query sees."""
    keys = sum(q * c + q * (q + 1) / 2 for q, c in batch)
    return 4 * keys * HQ * D


def bench_case(name, batch, variants, fi, backends, gen, passes) -> list[dict]:
    import kernel_variants
    from kvpool.kernels import cuda_attention
    from kvpool.kernels._validate import check_attention

    q_lens = [q for q, _ in batch]
    seq_lens_l = [q + c for q, c in batch]
    kv_bytes = sum(seq_lens_l) * HKV * D * 2 * 2
    copies = max(1, math.ceil(2 * L2_BYTES / kv_bytes))
    pool, tables, flat = make_pool(seq_lens_l, copies, torch.bfloat16, gen)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tokens = int(cu[-1])
    qs = torch.randn((copies, tokens, HQ, D), dtype=torch.bfloat16, device="cuda")
    outs = torch.empty_like(qs)
    timers = []
    for variant in variants:
        pipelines = None if variant is None else kernel_variants.get(variant)

        def make(i, pipelines=pipelines):
            a = check_attention(qs[i], k, v, tables[i], seq_lens, cu, None, outs[i])
            return lambda: cuda_attention.paged_attention(
                a, qs[i], k, v, tables[i], seq_lens, cu, max_seq_len=max(seq_lens_l), variant=pipelines
            )

        timers.append((f"ours {variant or 'default'}", lambda make=make: graph_time_us(make, copies)))
    fi_impls = []
    if fi is not None:
        kv_indptr, last = fi_page_layout(seq_lens_l)
        paged = pool[:, 0]
        for backend in backends:
            def fi_time(backend=backend):
                wrappers = []
                for i in range(copies):
                    w = fi.BatchPrefillWithPagedKVCacheWrapper(fi_workspace(), "HND", backend=backend)
                    w.plan(cu, kv_indptr, flat[i], last, HQ, HKV, D, BS, causal=True,
                           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
                    wrappers.append(w)
                return graph_time_us(lambda i: lambda: wrappers[i].run(qs[i], paged, out=outs[i]), copies)

            fi_impls.append(f"fi-{backend}")
            timers.append((f"fi-{backend}", fi_time))
    best, errors = time_in_turn(timers, passes, name)
    flops = causal_flops(batch)
    rows = []
    for impl, _ in timers:
        us = best.get(impl, float("nan"))
        rows.append(dict(case=name, impl=impl, seqs=len(batch), tokens=tokens, us=us, error=errors.get(impl),
                         tflops=flops / (us * 1e-6) / 1e12 if math.isfinite(us) else float("nan")))  # fmt: skip
    fi_best = min((best[i] for i in fi_impls if i in best), default=math.inf)
    if math.isfinite(fi_best):
        rows.append(dict(case=name, impl="best-fi", seqs=len(batch), tokens=tokens, us=fi_best,
                         tflops=flops / (fi_best * 1e-6) / 1e12))  # fmt: skip
    for r in rows:
        r["vs_fi"] = r["us"] / fi_best if math.isfinite(fi_best) else float("nan")
    del pool
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    import kernel_variants

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", type=kernel_variants.name_list, default="",
                   help="our prefill variants besides the default, comma-separated")
    p.add_argument("--fi-backends", default="fa2,fa3", help="FlashInfer prefill backends to time")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--cases", default="", help="only the cases whose names contain one of these, comma-separated")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "mixed-prefill.json"))
    args = p.parse_args()
    variants = [None, *args.variants]
    fi = None if args.no_flashinfer else flashinfer_or_none()
    backends = [x for x in args.fi_backends.split(",") if x]
    gen = torch.Generator().manual_seed(0)
    dev, stamp = torch.cuda.get_device_name(0), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"# mixed prefill bf16 D={D} Hq={HQ} Hkv={HKV} bs={BS} causal on {dev}, {stamp}, "
          f"flashinfer {getattr(fi, '__version__', None)}")  # fmt: skip
    print(f"{'case':>22} {'impl':>12} {'us':>9} {'TFLOP/s':>8} {'vs fi':>6}")
    rows = []
    wanted = [c for c in args.cases.split(",") if c]
    for name, batch in cases():
        if wanted and not any(w in name for w in wanted):
            continue
        got = bench_case(name, batch, variants, fi, backends, gen, args.passes)
        for r in got:
            print(f"{name:>22} {r['impl']:>12} {r['us']:>9.1f} {r['tflops']:>8.1f} {r['vs_fi']:>6.2f}", flush=True)
        rows.extend(got)
        doc = dict(device=dev, date=stamp, flashinfer=getattr(fi, "__version__", None), rows=rows)
        Path(args.json).write_text(json.dumps(_finite(doc), indent=1))
    print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
