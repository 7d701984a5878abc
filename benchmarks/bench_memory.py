"""KV-memory efficiency: kvpool's blocks vs contiguous max-length reservation.

    python3 benchmarks/bench_memory.py            # ~1 min on 2 CPU cores
    python3 benchmarks/bench_memory.py --quick    # fewer requests (CI-sized)

Workload.  Request lengths follow the ShareGPT statistics that the vLLM paper
reports (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023, section 6.1 / figure 11): mean input
161.31 tokens, mean output 337.99 tokens.  The paper gives the means and
histograms, not a formula, so lengths are drawn from log-normal
distributions with exactly those means (``mu = ln(mean) - sigma**2 / 2``) and
``sigma = 1.0`` (long right tails like the paper's histograms; the
sensitivity table below re-runs with sigma 0.5 and 1.5), fixed seed 0, then
clipped to a 2048-token context (input <= 2047, input + output <= 2048, as
the paper's OPT models).  The means after clipping are printed.

Serving.  All requests are queued at t=0 (a saturated server, where memory
decides the batch size).  Each step admits queued requests in FIFO order
while memory allows, then every running request generates one token; a request
holds its input plus the tokens generated so far, and frees its memory when it
has generated its output.  Memory is a 16 GiB KV budget of a Llama-3-8B-like
layout (32 layers, 8 KV heads, head_dim 128, bfloat16: 128 KiB per token, so
131072 token slots).

* kvpool: the real core, ``kvpoold.core.KVCacheManager`` (no daemon, no
  bytes: the same bookkeeping the daemon runs).  A request is ``create``d
  with its prompt, ``extend``ed by one token per step, ``free``d at the end.
  Admission keeps 1% of the blocks free (vLLM's default watermark); when a
  step cannot get a block, the most recently admitted request is preempted
  (freed, re-queued at the front, and recomputed later: its generated tokens
  become part of its prompt, and the prefix cache may still hold them).
* max-2048: each request reserves one contiguous 2048-token slab at admission
  (the maximum context), as systems before PagedAttention did (the paper's
  "Orca (Max)"; FasterTransformer).  Also "pow2" (reserve input+output
  rounded up to a power of two: Orca (Pow2)) and "oracle" (reserve exactly
  input+output: Orca (Oracle)); both need the output length in advance, which
  no real server has.  Contiguous reservations are counted as slots only: no
  external fragmentation is charged to them (in their favour).

Measured over the saturated steps (from the first admission refused for lack
of memory to the last step with a queue): the share of *allocated* KV memory
that holds real tokens (1 - waste), the share of the whole budget that holds
real tokens, and the mean number of concurrent requests (batch size).  The
static count is how many of the sampled requests, at their final length,
fit in the budget at once.

Prefix sharing: N requests share a 1024-token system prompt followed by their
own ShareGPT-like input and output; the core holds them with its prefix cache
(one copy of the system prompt's 64 blocks) vs the same requests made unique
(``extra_key`` per request: no sharing).

Targets: waste < 4% with kvpool; >= 2.5x the max-2048 baseline's
concurrent requests.  Writes ``benchmarks/results/memory.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import print_table, write_json  # noqa: E402

from kvpoold.core import Geometry, KVCacheManager, OutOfBlocks  # noqa: E402

MEAN_INPUT, MEAN_OUTPUT = 161.31, 337.99  # ShareGPT, vLLM paper section 6.1
MAX_LEN = 2048
LAYOUT = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # Llama-3-8B-like
TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # K and V, every layer: 128 KiB
BUDGET_BYTES = 16 << 30
CHUNK = 2 << 20
WATERMARK = 0.01
SYSTEM_PROMPT_TOKENS = 1024


def sample_requests(n: int, sigma: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input lengths, output lengths): log-normal with the ShareGPT means, clipped to the context."""
    rng = np.random.default_rng(seed)
    inp = rng.lognormal(math.log(MEAN_INPUT) - sigma**2 / 2, sigma, n)
    out = rng.lognormal(math.log(MEAN_OUTPUT) - sigma**2 / 2, sigma, n)
    inp = np.clip(np.rint(inp), 1, MAX_LEN - 1).astype(np.int64)
    out = np.clip(np.rint(out), 1, None).astype(np.int64)
    out = np.minimum(out, MAX_LEN - inp)
    return inp, out


def tokens_of(req: int, start: int, count: int) -> np.ndarray:
    """Token ids of request ``req`` at positions start..: unique per request (no accidental sharing)."""
    return ((req << 11) + np.arange(start, start + count)).astype(np.uint32)


class PagedMemory:
    """kvpool's core: blocks on demand, preemption by recompute when a step runs out."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.m = KVCacheManager(BUDGET_BYTES, chunk_bytes=CHUNK, max_reserve_blocks=0)
        self.cid = self.m.register_class(Geometry(**LAYOUT, block_size=block_size))
        self.pool = self.m.class_pool(self.cid)
        self.capacity = self.pool.obtainable()
        self.seq: dict[int, int] = {}  # request -> sequence id
        self.preemptions = 0

    def used_blocks(self) -> int:
        return self.m.stats().classes[self.cid].used_blocks

    def admit(self, req: int, held: int) -> bool:
        need = -(-held // self.bs)
        if self.pool.obtainable() - need < WATERMARK * self.capacity:
            return False
        try:
            info = self.m.create(0, self.cid, "bench", tokens_of(req, 0, held))
        except OutOfBlocks:
            return False
        self.seq[req] = info.seq_id
        return True

    def step(self, running: list[int], held: dict[int, int]) -> list[int]:
        """One token for every running request; returns the preempted ones (latest admitted first)."""
        preempted = []
        while running:
            ids = np.fromiter((self.seq[r] for r in running), np.int64, len(running))
            toks = np.fromiter(((r << 11) + held[r] for r in running), np.uint32, len(running))
            try:
                self.m.extend_columns(0, ids, None, toks)
                return preempted
            except OutOfBlocks:
                victim = running.pop()
                self.release(victim)
                preempted.append(victim)
                self.preemptions += 1
        return preempted

    def release(self, req: int) -> None:
        self.m.free(0, [self.seq.pop(req)])

    def allocated_tokens(self) -> int:
        return self.used_blocks() * self.bs

    @property
    def budget_tokens(self) -> int:
        return self.capacity * self.bs


class ContiguousMemory:
    """Pre-PagedAttention: one contiguous reservation per request, sized at admission."""

    def __init__(self, policy: str, inp: np.ndarray, out: np.ndarray) -> None:
        self.policy, self.inp, self.out = policy, inp, out
        self.budget_tokens = BUDGET_BYTES // TOKEN_BYTES
        self.reserved: dict[int, int] = {}
        self.preemptions = 0

    def size(self, req: int) -> int:
        total = int(self.inp[req] + self.out[req])
        if self.policy == "max-2048":
            return MAX_LEN
        if self.policy == "pow2":
            return min(MAX_LEN, 1 << (total - 1).bit_length())
        return total  # oracle

    def admit(self, req: int, held: int) -> bool:
        s = self.size(req)
        if sum(self.reserved.values()) + s > self.budget_tokens:
            return False
        self.reserved[req] = s
        return True

    def step(self, running, held) -> list[int]:
        return []  # the reservation already covers the whole output

    def release(self, req: int) -> None:
        del self.reserved[req]

    def allocated_tokens(self) -> int:
        return sum(self.reserved.values())


def serve(mem, inp: np.ndarray, out: np.ndarray) -> dict:
    """Run every request to completion; averages over the saturated steps."""
    n = len(inp)
    queue = list(range(n))  # FIFO; preempted requests go back to the front
    generated = np.zeros(n, np.int64)
    held: dict[int, int] = {}
    running: list[int] = []
    saturated = False
    samples = []  # (tokens held, allocated tokens, running)
    steps = 0
    while queue or running:
        while queue:
            r = queue[0]
            if not mem.admit(r, int(inp[r] + generated[r])):
                saturated = True
                break
            queue.pop(0)
            running.append(r)
            held[r] = int(inp[r] + generated[r])
        if not running:
            raise RuntimeError("a single request does not fit in the budget")
        for r in reversed(mem.step(running, held)):  # running shrank in place
            del held[r]
            queue.insert(0, r)
        for r in running:
            held[r] += 1
            generated[r] += 1
        steps += 1
        if saturated and queue:
            samples.append((sum(held.values()), mem.allocated_tokens(), len(running)))
        done = [r for r in running if generated[r] >= out[r]]
        for r in done:
            mem.release(r)
            del held[r]
        if done:
            finished = set(done)
            running = [r for r in running if r not in finished]
    if not samples:
        raise RuntimeError("memory never limited the batch: use more requests (--requests)")
    s = np.asarray(samples, np.float64)
    return {
        "steps": steps,
        "saturated_steps": len(samples),
        "real_share_of_allocated": float(np.mean(s[:, 0] / s[:, 1])),
        "waste_of_allocated": float(1 - np.mean(s[:, 0] / s[:, 1])),
        "real_share_of_budget": float(np.mean(s[:, 0]) / mem.budget_tokens),
        "mean_concurrent": float(np.mean(s[:, 2])),
        "preemptions": mem.preemptions,
        "budget_tokens": int(mem.budget_tokens),
    }


def static_fit(inp: np.ndarray, out: np.ndarray, block_size: int | None, budget_tokens: int) -> int:
    """How many requests (in sample order, at their final length) fit at once."""
    total = inp + out
    cost = -(-total // block_size) * block_size if block_size else np.full_like(total, MAX_LEN)
    return int(np.searchsorted(np.cumsum(cost), budget_tokens, side="right"))


def prefix_sharing(ns: list[int], sigma: float, block_size: int = 16) -> list[dict]:
    rows = []
    for n in ns:
        inp, out = sample_requests(n, sigma, seed=1)
        system = np.arange(10**6, 10**6 + SYSTEM_PROMPT_TOKENS, dtype=np.uint32)
        held = {}
        for shared in (True, False):
            m = KVCacheManager(1 << 40, chunk_bytes=CHUNK, max_reserve_blocks=0)
            cid = m.register_class(Geometry(**LAYOUT, block_size=block_size))
            for r in range(n):
                own = np.concatenate([system, tokens_of(r, 0, int(inp[r] + out[r]))])
                m.create(0, cid, "bench", own, extra_key="" if shared else f"req{r}")
            st = m.stats().classes[cid]
            held[shared] = st.used_blocks
            if shared:
                hit_tokens = st.prefix_hit_tokens
        blk_bytes = block_size * TOKEN_BYTES
        rows.append({
            "requests": n,
            "blocks_shared": held[True], "blocks_unshared": held[False],
            "gib_shared": held[True] * blk_bytes / 2**30, "gib_unshared": held[False] * blk_bytes / 2**30,
            "saved_share": 1 - held[True] / held[False],
            "prefix_hit_tokens": hit_tokens,
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="1500 requests, no sensitivity runs")
    args = ap.parse_args()
    n = 1500 if args.quick else args.requests
    t0 = time.perf_counter()
    inp, out = sample_requests(n, 1.0)
    print(f"{n} requests, log-normal sigma 1.0, seed 0: mean input {inp.mean():.1f} (target {MEAN_INPUT}), "
          f"mean output {out.mean():.1f} (target {MEAN_OUTPUT}); p50/p99 input {np.percentile(inp, 50):.0f}/"
          f"{np.percentile(inp, 99):.0f}, output {np.percentile(out, 50):.0f}/{np.percentile(out, 99):.0f}")
    print(f"budget {BUDGET_BYTES >> 30} GiB of KV at {TOKEN_BYTES >> 10} KiB/token "
          f"= {BUDGET_BYTES // TOKEN_BYTES} tokens")

    systems = {f"kvpool bs{bs}": PagedMemory(bs) for bs in (16, 8, 32)}
    systems.update({p: ContiguousMemory(p, inp, out) for p in ("max-2048", "pow2", "oracle")})
    results = {}
    for name, mem in systems.items():
        results[name] = serve(mem, inp, out)
        bs = mem.bs if isinstance(mem, PagedMemory) else None
        if name in ("pow2", "oracle"):
            results[name]["static_fit"] = None
        else:
            results[name]["static_fit"] = static_fit(inp, out, bs, mem.budget_tokens)
    base = results["max-2048"]["mean_concurrent"]
    rows = []
    for name, r in results.items():
        r["concurrency_vs_max2048"] = r["mean_concurrent"] / base
        rows.append([
            name, f"{100 * r['waste_of_allocated']:.2f}%", f"{100 * r['real_share_of_allocated']:.1f}%",
            f"{100 * r['real_share_of_budget']:.1f}%", f"{r['mean_concurrent']:.1f}",
            f"{r['concurrency_vs_max2048']:.2f}x", r["static_fit"] if r["static_fit"] is not None else "-",
            r["preemptions"],
        ])
    print_table(
        "Serving ShareGPT-like requests in 16 GiB of KV (saturated steps)",
        ["memory", "waste", "real/allocated", "real/budget", "concurrent", "vs max-2048", "static fit", "preempt"],
        rows,
    )

    sensitivity = []
    if not args.quick:
        for sigma in (0.5, 1.5):
            i2, o2 = sample_requests(n, sigma)
            k = serve(PagedMemory(16), i2, o2)
            b = serve(ContiguousMemory("max-2048", i2, o2), i2, o2)
            sensitivity.append({
                "sigma": sigma, "mean_input": float(i2.mean()), "mean_output": float(o2.mean()),
                "kvpool_waste": k["waste_of_allocated"], "kvpool_concurrent": k["mean_concurrent"],
                "max2048_concurrent": b["mean_concurrent"], "ratio": k["mean_concurrent"] / b["mean_concurrent"],
            })
        print_table(
            "Sensitivity to the length spread (kvpool bs16 vs max-2048)",
            ["sigma", "mean in/out", "kvpool waste", "kvpool concurrent", "max-2048 concurrent", "ratio"],
            [[s["sigma"], f"{s['mean_input']:.0f}/{s['mean_output']:.0f}", f"{100 * s['kvpool_waste']:.2f}%",
              f"{s['kvpool_concurrent']:.1f}", f"{s['max2048_concurrent']:.1f}", f"{s['ratio']:.2f}x"]
             for s in sensitivity],
        )

    sharing = prefix_sharing([1, 8, 32, 128] if args.quick else [1, 8, 32, 128, 512], 1.0)
    print_table(
        f"Prefix sharing: N requests with one {SYSTEM_PROMPT_TOKENS}-token system prompt (bs16, final lengths)",
        ["N", "blocks shared", "blocks unshared", "GiB shared", "GiB unshared", "saved"],
        [[r["requests"], r["blocks_shared"], r["blocks_unshared"], f"{r['gib_shared']:.2f}",
          f"{r['gib_unshared']:.2f}", f"{100 * r['saved_share']:.1f}%"] for r in sharing],
    )
    k = results["kvpool bs16"]
    targets = {
        "waste_below_4pct": k["waste_of_allocated"] < 0.04,
        "concurrency_at_least_2.5x": k["concurrency_vs_max2048"] >= 2.5,
    }
    print(f"\ntargets: waste {100 * k['waste_of_allocated']:.2f}% < 4%: {targets['waste_below_4pct']}; "
          f"{k['concurrency_vs_max2048']:.2f}x >= 2.5x the max-2048 concurrency: "
          f"{targets['concurrency_at_least_2.5x']}  ({time.perf_counter() - t0:.0f} s)")
    write_json("memory", {
        "workload": {
            "source": "ShareGPT means from Kwon et al., SOSP 2023 (vLLM), section 6.1 / figure 11",
            "distribution": "log-normal with the paper's means, sigma 1.0, seed 0, clipped to a 2048 context",
            "requests": n, "mean_input": float(inp.mean()), "mean_output": float(out.mean()),
            "budget_bytes": BUDGET_BYTES, "token_bytes": TOKEN_BYTES, "layout": LAYOUT,
            "watermark": WATERMARK,
        },
        "serving": results,
        "sensitivity": sensitivity,
        "prefix_sharing": {"system_prompt_tokens": SYSTEM_PROMPT_TOKENS, "block_size": 16, "rows": sharing},
        "targets": targets,
    })


if __name__ == "__main__":
    main()
