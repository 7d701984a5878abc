"""Offline throughput of kvpool.engine: 1,000 ShareGPT-like requests submitted at once, output tokens/s.

    python3 benchmarks/bench_offline.py                          # GPU: Llama-3.1-8B and Llama-3.2-1B shapes, bf16
    python3 benchmarks/bench_offline.py --models 8b --fused both # 8B only, unfused and fused layers
    python3 benchmarks/bench_offline.py --models 1b --fused on --overlap both   # overlapped steps against serial
    python3 benchmarks/bench_offline.py --backend cpu --quick    # the tiny test Llama on the CPU backend (a check)

Workload (fixed seed): prompt and output lengths log-normal (sigma 1.0) with the
ShareGPT means of the vLLM paper (161.31 / 337.99 tokens), cut like vLLM's
ShareGPT sampler (prompt <= 1024, prompt + output <= 2048), prompts of random
token ids, every request runs to its ``max_tokens`` (``ignore_eos``), greedy.
All requests are added before the first step; the engine is stepped by hand
until every one has finished.  Models: random bf16 weights of the published
configs of Llama-3.1-8B and Llama-3.2-1B.

Yardsticks: vLLM's published 12,553 output tok/s and SGLang's 16,215 for the 8B
model on one H100 (ShareGPT, offline), and the limit this run computes for its
own trace: ``max(FLOPs / matmul rate, bytes / copy bandwidth)`` with the rate
and bandwidth measured on this GPU (a bf16 8192^3 matmul; a 2 GiB device copy,
read + write), FLOPs = 2 x parameters x (prompt + output tokens) plus the
attention's QK and PV, bytes = the weights read once per step for the fewest
decode steps ``max_num_seqs`` and the longest output allow plus every output
token's K/V context.

Decode steps: for each batch size of ``--step-batches`` with sequences of
``--step-len`` tokens, the step's wall time (``StepTimings.total``, median)
against its GPU time (the captured graph's replay between CUDA events) and
against ``(weights + K/V bytes) / copy bandwidth``.

Prints a table and writes JSON to benchmarks/results/offline_<device>_<time>.json.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "hf"))

from _common import die_with_parent, print_table, write_json  # noqa: E402
from bench_serve import llama_1b_config, wait  # noqa: E402

MEAN_INPUT, MEAN_OUTPUT, SIGMA = 161.31, 337.99, 1.0  # ShareGPT, vLLM paper section 6.1
PUBLISHED_8B_H100 = {"vLLM": 12553, "SGLang": 16215}  # output tok/s, ShareGPT offline, Llama-3.1-8B, 1x H100


def llama_8b_config():
    """The published config of Llama-3.1-8B (random weights wherever it is used)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )


def build_model(name: str, device: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "tiny":
        from hf_models import make_model

        return make_model("llama", max_position_embeddings=2048, device=device)
    config = {"8b": llama_8b_config, "1b": llama_1b_config}[name]()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no float32 copy of 8B weights
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(old)


def sample_lengths(n: int, max_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths): log-normal with ShareGPT's means, cut as vLLM's ShareGPT sampler cuts
    the real set (prompts <= ``max_len / 2``, prompt + output <= ``max_len``, 2048 there)."""
    rng = np.random.default_rng(seed)
    inp = rng.lognormal(math.log(MEAN_INPUT) - SIGMA**2 / 2, SIGMA, n)
    out = rng.lognormal(math.log(MEAN_OUTPUT) - SIGMA**2 / 2, SIGMA, n)
    inp = np.clip(np.rint(inp), 4, max_len // 2).astype(np.int64)
    out = np.clip(np.rint(out), 1, max_len - inp).astype(np.int64)
    return inp, out


def model_figures(model) -> dict:
    """Parameter bytes and the per-token FLOPs and K/V bytes of a Llama-shaped model."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    dense = sum(p.numel() for p in model.parameters()) - (0 if c.tie_word_embeddings else embed.numel())
    return {
        "weight_bytes": weight_bytes,
        "matmul_params": dense,  # every weight but the embedding lookup (the lm_head is a matmul)
        "kv_bytes_per_token": 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * embed.element_size(),
        "attn_flops_per_context_token": 4 * c.num_hidden_layers * c.num_attention_heads * head_dim,
    }


def device_ceilings(device: str) -> dict:
    """Measured copy bandwidth (read + write, TB/s) and bf16 matmul rate (TFLOP/s) of this GPU."""
    import torch

    if device != "cuda":
        return {"copy_tbps": None, "matmul_tflops": None}
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def timed(fn, n):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 1e3 / n

    copy_s = timed(lambda: dst.copy_(src), 20)
    mm_s = timed(lambda: a @ b, 20)
    out = {"copy_tbps": 2 * src.numel() * 2 / copy_s / 1e12, "matmul_tflops": 2 * 8192**3 / mm_s / 1e12}
    return out


def throughput_limit(figs: dict, ceil: dict, inp: np.ndarray, out: np.ndarray, max_seqs: int) -> dict:
    """The trace's floor: max(FLOPs / rate, bytes / bandwidth), in seconds, and the output tok/s it allows."""
    if ceil["copy_tbps"] is None:
        return {}
    tokens = int(inp.sum() + out.sum())
    # a token at position p attends to p + 1 keys (causal): prompts' and outputs' sums in closed form
    ctx = float((inp * (inp + 1) / 2).sum() + (out * inp + out * (out + 1) / 2).sum())
    flops = 2 * figs["matmul_params"] * tokens + figs["attn_flops_per_context_token"] * ctx
    # every decode step reads all the weights; there are at least as many as the longest output's tokens
    decode_steps = max(int(out.max()) - 1, math.ceil(out.sum() / max_seqs))
    kv_read = float((out * inp + out * (out + 1) / 2).sum()) * figs["kv_bytes_per_token"]
    moved = decode_steps * figs["weight_bytes"] + kv_read
    compute_s, memory_s = flops / (ceil["matmul_tflops"] * 1e12), moved / (ceil["copy_tbps"] * 1e12)
    floor = max(compute_s, memory_s)
    return {"compute_s": compute_s, "memory_s": memory_s, "floor_s": floor, "limit_tok_s": float(out.sum()) / floor,
            "bound": "compute" if compute_s >= memory_s else "memory"}


def make_engine(model, sock: str, tag: str, args, *, variant: tuple, max_seqs: int, max_len: int):
    import kvpool.engine as ke

    fused, overlap = variant
    config = ke.EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max(args.max_batched_tokens, max_seqs),
                             max_model_len=max_len, fused_layers=fused, cuda_graphs=args.backend == "cuda",
                             **({} if overlap is None else {"overlap_steps": overlap}))
    return ke.Engine.connect(model, sock, name=f"bench-offline-{tag}", model_id=f"bench-offline-{tag}",
                             config=config)


def run_offline(model, sock: str, tag: str, args, variant, inp: np.ndarray, out: np.ndarray) -> dict:
    import kvpool.engine as ke

    vocab = model.config.vocab_size
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(10, vocab, n).tolist() for n in inp]
    with make_engine(model, sock, tag, args, variant=variant, max_seqs=args.max_num_seqs, max_len=args.max_model_len) \
            as eng:
        t0 = time.perf_counter()
        eng.warm_up()
        capture_s = time.perf_counter() - t0
        before = eng.stats()
        t0 = time.perf_counter()
        streams = [eng.add_request(p, ke.SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True))
                   for p, n in zip(prompts, out)]
        phases = dict.fromkeys(("schedule", "daemon", "gpu_wait", "chunk_sync", "prepare", "forward", "sample",
                                "total", "daemon_calls"), 0.0)
        while not all(s.last is not None and s.last.finished for s in streams):
            t = eng.step()
            for k in phases:
                phases[k] += getattr(t, k)
        elapsed = time.perf_counter() - t0
        results = [s.result() for s in streams]
        after = eng.stats()
    made = sum(len(r.token_ids) for r in results)
    if made != int(out.sum()):
        raise SystemExit(f"{tag}: {made} output tokens, expected {int(out.sum())}: a request stopped early")
    firsts = [list(r.token_ids[:8]) for r in results]
    return {"seconds": elapsed, "output_tokens": made, "first_tokens": firsts, "output_tok_s": made / elapsed,
            "total_tok_s": (made + int(inp.sum())) / elapsed, "capture_s": capture_s,
            "steps": after.steps - before.steps, "steps_ahead": after.steps_ahead - before.steps_ahead,
            "preemptions": after.preemptions - before.preemptions,
            "phases_s": phases}


def graph_gpu_ms(runner, batch: int) -> float | None:
    """The median GPU time of the engine's own replays of its decode graph at ``batch`` sequences (CUDA events
    around each replay; the first two left out, as for the wall time), or None without graphs."""
    if not getattr(runner, "capture", False):
        return None
    times = [ms for n, _, ms in runner.replay_ms() if n == batch][2:]
    return statistics.median(times) if times else None


def run_decode_steps(model, sock: str, tag: str, args, variant, batch: int, figs: dict, ceil: dict) -> dict:
    """Decode steps of ``batch`` sequences at about ``--step-len`` tokens: wall vs GPU vs the bandwidth floor."""
    import kvpool.engine as ke

    vocab, new = model.config.vocab_size, args.step_new_tokens
    plen = args.step_len - new // 2
    prompts = np.random.default_rng(args.seed + batch).integers(10, vocab, (batch, plen))
    with make_engine(model, sock, f"{tag}-b{batch}", args, variant=variant, max_seqs=batch,
                     max_len=plen + new + 16) as eng:
        eng.warm_up()
        if getattr(eng.runner, "capture", False):
            eng.runner.time_replays()
        params = ke.SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        streams = [eng.add_request(p.tolist(), params) for p in prompts]
        steps = []
        while not all(s.last is not None and s.last.finished for s in streams):
            t = eng.step()
            if t.num_seqs == batch and t.num_tokens == batch:
                steps.append(t)
        failed = [r.error for r in (s.result() for s in streams) if r.error]
        if failed:
            raise RuntimeError(f"{tag} B{batch}: {len(failed)} requests failed: {failed[0]}")
        gpu = graph_gpu_ms(eng.runner, batch)
        ahead = eng.stats().steps_ahead
    steps = steps[2:]  # the first decode steps may still capture or compile
    wall = statistics.median(t.total for t in steps) * 1e3
    phases = {k: statistics.median(getattr(t, k) for t in steps) * 1e3
              for k in ("schedule", "daemon", "gpu_wait", "chunk_sync", "prepare", "forward", "sample")}
    row = {"batch": batch, "seq_len": args.step_len, "wall_ms": wall, "gpu_ms": gpu, "phases_ms": phases,
           "decode_steps": len(steps), "steps_ahead": ahead,
           "daemon_calls_per_step": statistics.mean(t.daemon_calls for t in steps)}
    if ceil["copy_tbps"]:
        moved = figs["weight_bytes"] + batch * args.step_len * figs["kv_bytes_per_token"]
        row["floor_ms"] = moved / (ceil["copy_tbps"] * 1e12) * 1e3
        row["gpu_over_floor"] = gpu / row["floor_ms"] if gpu else None
        row["wall_over_gpu"] = wall / gpu if gpu else None
    return row


def guarded(fn, *args):
    """``fn(*args)``, or ``None`` after printing its traceback: one failed run leaves the others' figures."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported, and the benchmark goes on with the next run
        traceback.print_exc()
        return None


def run_tag(model: str, variant: tuple) -> str:
    fused, overlap = variant
    tag = f"{model}-{'fused' if fused else 'unfused' if fused is False else 'default'}"
    return tag + ("-serial" if overlap is False else "-overlap" if overlap else "")


def choices(arg: str) -> list:
    """``EngineConfig`` values for a ``--fused`` / ``--overlap`` argument."""
    return {"off": [False], "on": [True], "both": [False, True], "default": [None]}[arg]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="few short requests (a smoke run)")
    p.add_argument("--models", default=None, help="comma list of 8b, 1b, tiny (default: 8b,1b; tiny on the CPU)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=2048, help="also the trace's longest prompt + output")
    p.add_argument("--fused", default="default", choices=("default", "off", "on", "both"),
                   help="EngineConfig.fused_layers: the engine's default, off, on, or both in turn")
    p.add_argument("--overlap", default="default", choices=("default", "off", "on", "both"),
                   help="EngineConfig.overlap_steps: the engine's default, off, on, or both in turn")
    p.add_argument("--step-batches", default=None,
                   help="decode-step breakdown batch sizes (default 32,64,128; 4,8 with --quick on the CPU; '' skips it)")
    p.add_argument("--step-len", type=int, default=1024)
    p.add_argument("--step-new-tokens", type=int, default=24)
    p.add_argument("--skip-offline", action="store_true", help="only the decode-step breakdown")
    p.add_argument("--pool-bytes", default=None, help="kvpoold's pool (default: 40GiB on the GPU, 512MiB on CPU)")
    args = p.parse_args()
    cpu = args.backend == "cpu"
    models = (args.models or ("tiny" if cpu else "8b,1b")).split(",")
    if args.quick:
        args.num_requests, args.max_num_seqs, args.max_model_len = min(args.num_requests, 16), 8, 256
        args.step_len, args.step_new_tokens, args.max_batched_tokens = 128, 8, 512
    if args.step_batches is None:
        args.step_batches = "4,8" if cpu and args.quick else "32,64,128"
    pool = args.pool_bytes or ("512MiB" if cpu else "40GiB")
    device = "cpu" if cpu else "cuda"

    import torch

    ceil = device_ceilings(device)
    if not cpu:
        torch.cuda.empty_cache()  # the ceilings' buffers
    dev_name = torch.cuda.get_device_name() if not cpu else "cpu"
    print(f"# {dev_name}: copy {ceil['copy_tbps']} TB/s, bf16 matmul {ceil['matmul_tflops']} TFLOP/s", flush=True)
    inp, out = sample_lengths(args.num_requests, args.max_model_len, args.seed)
    report = {"args": vars(args), "device": dev_name, "ceilings": ceil, "models": {},
              "trace": {"requests": len(inp), "prompt_tokens": int(inp.sum()), "output_tokens": int(out.sum()),
                        "mean_prompt": float(inp.mean()), "mean_output": float(out.mean())}}
    stamp = time.strftime("%Y%m%dT%H%M%S")
    tmp = tempfile.mkdtemp(prefix="bench-offline-")
    sock = os.path.join(tmp, "kvpoold.sock")
    daemon = subprocess.Popen([sys.executable, "-m", "kvpoold", "--socket", sock, "--pool-bytes", pool,
                               "--log-level", "warning", *([] if cpu else ["--backend", "cuda"])],
                              preexec_fn=die_with_parent)
    offline_rows, step_rows = [], []
    try:
        wait(lambda: os.path.exists(sock), 120, "kvpoold", daemon)
        for name in models:
            model = build_model(name, device)
            figs = model_figures(model)
            limit = throughput_limit(figs, ceil, inp, out, args.max_num_seqs)
            entry = report["models"][name] = {"figures": figs, "limit": limit, "offline": {}, "steps": {}}
            # every offline run first (the headline figure), then the decode-step breakdowns
            variants = [(f, o) for f in choices(args.fused) for o in choices(args.overlap)]
            for variant in variants if not args.skip_offline else []:
                tag = run_tag(name, variant)
                r = entry["offline"][tag] = guarded(run_offline, model, sock, tag, args, variant, inp, out)
                if r is None:
                    continue
                of_limit = f"{r['output_tok_s'] / limit['limit_tok_s']:.2f}" if limit else "-"
                yard = f"{r['output_tok_s'] / PUBLISHED_8B_H100['vLLM']:.2f}" if name == "8b" else "-"
                offline_rows.append([tag, f"{r['output_tok_s']:.0f}", f"{r['seconds']:.1f}", f"{r['steps']} / {r['steps_ahead']}",
                                     r["preemptions"], f"{limit.get('limit_tok_s', 0):.0f}", of_limit, yard])
                print(f"{tag}: {r['output_tok_s']:.0f} output tok/s in {r['seconds']:.1f} s; "
                      + ", ".join(f"{k} {max(v, 0.0):.1f}" for k, v in r["phases_s"].items() if k != "daemon_calls")
                      + f" s; {r['phases_s']['daemon_calls']:.0f} daemon calls", flush=True)
                write_json(f"offline_{device}_{stamp}", report)
            runs = [r for r in entry["offline"].values() if r]
            if len(runs) == 2:  # bf16 near-ties may part some greedy continuations; most should agree
                same = sum(a == b for a, b in zip(runs[0].pop("first_tokens"), runs[1].pop("first_tokens")))
                entry["same_first_8_tokens"] = same
                print(f"{name}: the first 8 greedy tokens agree for {same} of {len(inp)} requests", flush=True)
            for batch in [int(b) for b in args.step_batches.split(",") if b]:
                for variant in variants:
                    tag = run_tag(name, variant)
                    s = entry["steps"][f"{tag}-b{batch}"] = guarded(run_decode_steps, model, sock, tag, args, variant,
                                                                   batch, figs, ceil)
                    if s is None:
                        continue
                    fmt = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
                    step_rows.append([tag, batch, f"{s['wall_ms']:.2f}", fmt(s["gpu_ms"]), fmt(s.get("floor_ms")),
                                      fmt(s.get("gpu_over_floor")), fmt(s.get("wall_over_gpu")),
                                      f"{s['daemon_calls_per_step']:.2f}",
                                      " / ".join(f"{k} {v:.2f}" for k, v in s["phases_ms"].items())])
                    print(f"{tag} B{batch}: wall {s['wall_ms']:.2f} ms, GPU {fmt(s['gpu_ms'])} ms", flush=True)
                    write_json(f"offline_{device}_{stamp}", report)
            del model
            gc.collect()  # the engines' references to the weights go with their cycles
            if not cpu:
                torch.cuda.empty_cache()
    finally:
        daemon.terminate()
        daemon.wait(30)
    if offline_rows:
        print_table(f"offline: {len(inp)} requests ({int(inp.sum())} prompt / {int(out.sum())} output tokens) "
                    f"on {dev_name}", ["run", "output tok/s", "s", "steps / ahead", "preempt", "limit tok/s",
                                       "of limit", "vs vLLM 12553"], offline_rows)
    if step_rows:
        print_table(f"decode steps at ~{args.step_len} tokens", ["run", "batch", "wall ms", "GPU ms", "floor ms",
                                                                 "GPU/floor", "wall/GPU", "calls/step", "phases ms"], step_rows)
    write_json(f"offline_{device}_{stamp}", report)


if __name__ == "__main__":
    main()
