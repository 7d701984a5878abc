"""Serving under load: kvpool serve (continuous batching on the pool) against transformers' static batches.

    python3 benchmarks/bench_serve.py --tiny                    # CPU, a tiny random Llama, seconds
    python3 benchmarks/bench_serve.py --llama-1b-shape          # GPU, Llama-3.2-1B-shaped random weights, bf16
    python3 benchmarks/bench_serve.py --llama-1b-shape --servers 2   # also two serve processes on one daemon
    python3 benchmarks/bench_serve.py --tiny --url http://127.0.0.1:8000 --served-model-name tiny  # a running server

Requests arrive as a Poisson process (``--rate`` per second).  Prompt and
output lengths are drawn from log-normal distributions shaped like ShareGPT
conversations (generated here, nothing downloaded), and a share of the prompts
(``--shared-prefix``) start with one common system prompt, so the pool's prefix
cache has something to find.  Prompts are random token ids (the server takes
ids; no tokenizer is needed) and every request runs to its ``max_tokens``
(``ignore_eos``).

* **kvpool serve**: a daemon and a ``kvpool serve`` process are started here
  (or ``--url`` names a running one); with ``--servers N`` the trace runs
  again through N serve processes of the model on one daemon, requests sent
  to them in turn, so the shared system prompt computed by one is a prefix
  hit in the others; each request is a streaming
  ``/v1/completions`` call; TTFT is the arrival of the first token's event,
  TPOT the mean gap between the later ones.
* **yardstick, transformers static batches**: the same requests, the same
  weights, in this process: whenever the previous batch is done, every request
  that has arrived (up to ``--static-batch``) is left-padded into one
  ``model.generate`` that runs until the batch's longest output.

Prints a table and writes JSON to benchmarks/results/serve_<model>_<device>_<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "hf"))

from _common import print_table, write_json  # noqa: E402


# -- the model -------------------------------------------------------------------------------------
def llama_1b_config():
    """The published config of Llama-3.2-1B (the weights are random wherever it is used)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )


def build_model_dir(kind: str, out: str, device: str) -> str:
    """Save a random-weight model with ``save_pretrained``: the tiny test Llama, or Llama-3.2-1B's shape."""
    import torch
    import transformers

    if kind == "tiny":
        from hf_models import make_model

        model = make_model("llama", max_position_embeddings=2048)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(llama_1b_config()).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


# -- the workload ----------------------------------------------------------------------------------
def workload(n: int, rate: float, kind: str, vocab: int, shared_prefix: float, seed: int) -> list[dict]:
    """Arrival time, prompt ids and output length of each request (ShareGPT-like log-normal lengths)."""
    rng = np.random.default_rng(seed)
    if kind == "tiny":  # small enough for two CPU cores
        p_med, p_max, o_med, o_max, system_len = 40, 400, 24, 96, 64
    else:  # ShareGPT's conversations: prompts ~ 200 tokens median, answers ~ 150, long tails
        p_med, p_max, o_med, o_max, system_len = 200, 2048, 150, 1024, 256
    system = rng.integers(10, vocab, system_len).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    out = []
    for i in range(n):
        plen = int(np.clip(rng.lognormal(np.log(p_med), 0.9), 4, p_max))
        olen = int(np.clip(rng.lognormal(np.log(o_med), 0.8), 2, o_max))
        prompt = rng.integers(10, vocab, plen).tolist()
        if rng.random() < shared_prefix:
            prompt = system + prompt
        out.append({"arrival": float(arrivals[i]), "prompt": prompt, "max_tokens": olen})
    return out


def summarize(name: str, results: list[dict], duration: float, extra: dict) -> dict:
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    tpot = np.array([r["tpot"] for r in results if r["tpot"] is not None]) * 1e3
    out_tokens = sum(r["tokens"] for r in results)
    in_tokens = sum(r["prompt_tokens"] for r in results)
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")  # noqa: E731
    return {"system": name, "requests": len(results), "duration_s": duration,
            "output_tok_per_s": out_tokens / duration, "total_tok_per_s": (out_tokens + in_tokens) / duration,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99), **extra}


# -- kvpool serve ----------------------------------------------------------------------------------
class StreamError(RuntimeError):
    """The server ended a stream with an error event (the request failed after its response began)."""


async def read_token_events(response, stamps: list[float]) -> dict | None:
    """Read a streaming completion's server-sent events: the time of each token's event is appended to
    ``stamps`` as it comes (the server sends one event per token); returns the usage event's figures.
    ``StreamError`` with the server's message if it sends an error event."""
    usage = None
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            error = event["error"]
            raise StreamError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        if event.get("usage"):
            usage = event["usage"]
        elif event["choices"]:
            stamps.append(time.perf_counter())
    return usage


async def one_request(client, url: str, model: str, req: dict, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + req["arrival"] - time.perf_counter()))
    start = time.perf_counter()
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stamps = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        usage = await read_token_events(r, stamps)
    n = usage["completion_tokens"]
    return {"ttft": stamps[0] - start, "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
            "tokens": n, "prompt_tokens": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def drive(urls: list[str], model: str, reqs: list[dict]) -> tuple[list[dict], float]:
    """Send each request at its arrival time, to the servers in turn."""
    import httpx

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, urls[i % len(urls)], model, r, t0)
                                         for i, r in enumerate(reqs)))
        return results, time.perf_counter() - t0


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run_server(args, model_dir: str, reqs: list[dict], warmup: list[dict], servers: int = 1) -> dict:
    """The trace through ``servers`` kvpool serve processes on one kvpoold (started here unless ``--url``)."""
    import httpx

    procs, urls = [], [args.url] if args.url else []
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    try:
        if not urls:
            sock = os.path.join(tmp, "kvpoold.sock")
            daemon = [sys.executable, "-m", "kvpoold", "--socket", sock, "--pool-bytes", args.pool_bytes,
                      "--log-level", "warning", *(["--backend", "cuda"] if args.device == "cuda" else []),
                      *(["--host-bytes", args.host_bytes] if args.host_bytes else [])]
            procs.append(subprocess.Popen(daemon))
            wait(lambda: os.path.exists(sock), 60, "kvpoold", procs[0])
            for i in range(servers):
                port = 18000 + (os.getpid() * 4 + i) % 1000
                urls.append(f"http://127.0.0.1:{port}")
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvpool.serve", "--model", model_dir, "--socket", sock, "--port", str(port),
                     "--served-model-name", args.served_model_name, "--device", args.device, "--log-level", "warning",
                     "--max-num-seqs", str(args.max_num_seqs),
                     "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                     "--max-model-len", str(args.max_model_len), *(["--enforce-eager"] if args.enforce_eager else [])]))
            for url, proc in zip(urls, procs[1:]):
                wait(lambda: _healthy(url), 600, "kvpool serve", proc)
        for url in urls:  # warm-up (kernels compile, first calls), prompts that are not in the trace
            asyncio.run(drive([url], args.served_model_name, warmup))
        names = ("preemptions", "prefix_hit_tokens")
        before = {k: sum(metric(u, f"kvpool_serve_{k}_total") for u in urls) for k in names}
        results, duration = asyncio.run(drive(urls, args.served_model_name, reqs))
        extra = {k: sum(metric(u, f"kvpool_serve_{k}_total") for u in urls) - v for k, v in before.items()}
        extra["step_timings"] = httpx.get(urls[0] + "/engine/stats").json()["step_timings"]
        name = "kvpool serve" if servers == 1 else f"kvpool serve x{servers}, one daemon"
        return summarize(name, results, duration, extra)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start in {timeout} s")
        time.sleep(0.2)


# -- the yardstick: transformers' generate in static batches ----------------------------------------
def run_static(args, model_dir: str, reqs: list[dict]) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(args.device).eval()
    pad = 0

    class Stamps(transformers.LogitsProcessor):  # called once per generated token: its times are the tokens'
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[dict]) -> list[float]:
        width = max(len(r["prompt"]) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r["prompt"])) + r["prompt"] for r in batch], device=args.device)
        mask = (torch.arange(width, device=args.device)[None] >= torch.tensor(
            [width - len(r["prompt"]) for r in batch], device=args.device)[:, None]).long()
        longest = max(r["max_tokens"] for r in batch)
        stamps = Stamps()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=pad, logits_processor=[stamps])
        if args.device == "cuda":
            torch.cuda.synchronize()
        return stamps.times

    generate(reqs[: min(4, len(reqs))])  # warm-up
    results, queue, t0 = [], list(reqs), time.perf_counter()
    while queue:
        now = time.perf_counter() - t0
        if queue[0]["arrival"] > now:
            time.sleep(queue[0]["arrival"] - now)
            continue
        batch = [r for r in queue if r["arrival"] <= now][: args.static_batch]
        queue = [r for r in queue if r not in batch]
        times = generate(batch)
        for r in batch:
            mine = times[: r["max_tokens"]]
            results.append({"ttft": mine[0] - t0 - r["arrival"], "tokens": r["max_tokens"],
                            "tpot": (mine[-1] - mine[0]) / (len(mine) - 1) if len(mine) > 1 else None,
                            "prompt_tokens": len(r["prompt"])})
    return summarize("transformers static batches", results, time.perf_counter() - t0,
                     {"preemptions": 0, "prefix_hit_tokens": 0})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--tiny", action="store_true", help="the tiny random Llama of the tests (CPU)")
    kind.add_argument("--llama-1b-shape", action="store_true", help="Llama-3.2-1B-shaped random weights, bf16 (GPU)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="requests per second (Poisson)")
    p.add_argument("--shared-prefix", type=float, default=0.3, help="share of prompts that start with one system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda for --llama-1b-shape)")
    p.add_argument("--url", default=None, help="a running kvpool serve (its daemon and model are yours)")
    p.add_argument("--model-dir", default=None, help="the model directory (default: built here in a temp dir)")
    p.add_argument("--served-model-name", default="bench")
    p.add_argument("--pool-bytes", default=None)
    p.add_argument("--host-bytes", default=None, help="a host tier for the daemon (swap on preemption)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--static-batch", type=int, default=None, help="the yardstick's batch size (default: max-num-seqs)")
    p.add_argument("--skip-yardstick", action="store_true")
    p.add_argument("--servers", type=int, default=1,
                   help="also run the trace through this many kvpool serve processes on one daemon (round-robin)")
    p.add_argument("--enforce-eager", action="store_true", help="kvpool serve without CUDA graphs")
    args = p.parse_args()
    name = "tiny" if args.tiny else "llama1b"
    tiny = args.tiny
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.num_requests = args.num_requests or (24 if tiny else 500)
    args.rate = args.rate or (4.0 if tiny else 20.0)
    args.pool_bytes = args.pool_bytes or ("256MiB" if tiny else "16GiB")
    args.max_num_seqs = args.max_num_seqs or (16 if tiny else 128)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (256 if tiny else 2048)
    args.max_model_len = args.max_model_len or (1024 if tiny else 4096)
    args.static_batch = args.static_batch or args.max_num_seqs

    model_dir = args.model_dir or build_model_dir(name, tempfile.mkdtemp(prefix=f"bench-{name}-"), args.device)
    reqs = workload(args.num_requests, args.rate, name, 256 if tiny else 128256, args.shared_prefix, args.seed)
    vocab = 256 if tiny else 128256
    warmup = workload(4, args.rate, name, vocab, 0.0, args.seed + 1000)
    rows = [run_server(args, model_dir, reqs, warmup, n) for n in sorted({1, args.servers})]
    if not args.skip_yardstick:
        rows.append(run_static(args, model_dir, reqs))
    header = ["system", "requests", "duration_s", "output_tok_per_s", "total_tok_per_s", "ttft_p50_ms",
              "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "preemptions", "prefix_hit_tokens"]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else v  # noqa: E731
    print_table(f"serving {args.num_requests} requests at {args.rate}/s, {name} on {args.device}", header,
                [[fmt(r[h]) for h in header] for r in rows])
    timings = rows[0]["step_timings"]
    print("\nkvpool serve, share of step time: " + ", ".join(
        f"{k} {timings[k + '_share']:.0%}" for k in ("schedule", "daemon", "prepare", "forward", "sample")))
    write_json(f"serve_{name}_{args.device}_{time.strftime('%Y%m%dT%H%M%S')}",
               {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
