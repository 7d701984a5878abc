"""One decode step of a batch: kvpool.engine (CUDA graphs, and eager) against transformers' generate.

    python3 benchmarks/bench_step.py                        # GPU: Llama-3.2-1B's shape, bf16, 32 x 512-token prompts
    python3 benchmarks/bench_step.py --tiny --device cpu    # the tiny test Llama on the CPU backend (a check)

The same random weights and prompts run three ways:

* **transformers generate**: ``model.generate`` (SDPA, DynamicCache) on the
  batch, greedy, every sequence to ``--new-tokens``; a logits processor stamps
  each step, so a step's time is the gap between two stamps.  Its steps are
  bound by the host launching kernels, so it runs before and after the
  engines and the faster run is the yardstick.
* **kvpool engine, eager** and **kvpool engine, CUDA graphs**: the requests go
  into a ``kvpool.engine.Engine`` on a kvpoold started here; the engine is
  stepped by hand and a step's time is its ``StepTimings.total`` (schedule,
  daemon calls, buffer upload, forward, sampling: everything the serving
  thread does for it).

Steps are compared where every sequence holds ``--at`` tokens or so (the
median of the decode steps from ``at - 64`` to ``at + 64``).  For the graph
runner it also times the captured forward alone (graph replays between CUDA
events), which splits a step into GPU work and host work.

Prints a table and writes JSON to benchmarks/results/step_<model>_<device>_<time>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from bench_serve import llama_1b_config, wait  # noqa: E402


def build_model(tiny: bool, device: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if tiny:
        from hf_models import make_model

        return make_model("llama", max_position_embeddings=2048).to(device)
    with torch.device(device):
        return transformers.LlamaForCausalLM(llama_1b_config()).to(torch.bfloat16).eval()


def window(values: list[tuple[int, float]], at: int) -> float:
    """Median of the step times whose sequences were ``at`` +- 64 tokens long."""
    near = [t for length, t in values if abs(length - at) <= 64]
    return statistics.median(near)


def run_transformers(model, prompts: np.ndarray, new_tokens: int, device: str) -> list[tuple[int, float]]:
    import torch
    import transformers

    class Stamps(transformers.LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append((input_ids.shape[1], time.perf_counter()))
            return scores

    model.set_attn_implementation("sdpa")
    ids = torch.from_numpy(prompts).to(device)
    for n in (8, new_tokens):  # the first is a warm-up
        stamps = Stamps()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, logits_processor=[stamps])
    return [(length, t1 - t0) for (_, t0), (length, t1) in zip(stamps.times, stamps.times[1:])]


def run_engine(model, socket: str, prompts: np.ndarray, new_tokens: int, graphs: bool, tag: str) -> dict:
    import torch

    import kvpool.engine as ke

    batch, plen = prompts.shape
    config = ke.EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch), cuda_graphs=graphs,
                             max_model_len=plen + new_tokens + 16)
    with ke.Engine.connect(model, socket, name=f"bench-step-{tag}", model_id=f"bench-step-{tag}",
                           config=config) as eng:
        t0 = time.perf_counter()
        eng.warm_up()
        capture = time.perf_counter() - t0
        params = ke.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        streams = [eng.add_request(p.tolist(), params) for p in prompts]
        steps = []
        while not all(s.last and s.last.finished for s in streams):
            t = eng.step()
            if t.num_seqs == batch and t.num_tokens == batch:
                steps.append((plen + len(streams[0].last.token_ids), t))
        outputs = [list(s.result().token_ids) for s in streams]
        gpu_ms = None
        runner = eng.runner
        if graphs and getattr(runner, "capture", False):
            graph, _ = runner._graphs[runner.size_for(batch)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            gpu_ms = start.elapsed_time(end) / 20
    at = [(length, t.total) for length, t in steps]
    phases = {k: statistics.median(getattr(t, k) for _, t in steps) * 1e3
              for k in ("schedule", "daemon", "prepare", "forward", "sample")}
    return {"steps": at, "phases_ms": phases, "outputs": outputs, "graph_forward_ms": gpu_ms,
            "capture_s": capture}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny random Llama of the tests")
    p.add_argument("--device", default=None, help="cuda (default) | cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--at", type=int, default=640, help="sequence length at which steps are compared")
    p.add_argument("--pool-bytes", default="8GiB")
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.batch, args.prompt_len, args.new_tokens, args.at = min(args.batch, 8), 64, 48, 96
        args.pool_bytes = "256MiB"
    import torch

    model = build_model(args.tiny, args.device)
    vocab = model.config.vocab_size
    prompts = np.random.default_rng(0).integers(10, vocab, (args.batch, args.prompt_len))
    rows, out = [], {"args": vars(args)}
    # transformers' step is bound by the host launching its kernels: timed before and after
    # the engines, the faster of the two is the yardstick
    hf_runs = [window(run_transformers(model, prompts, args.new_tokens, args.device), args.at) * 1e3]
    tmp = tempfile.mkdtemp(prefix="bench-step-")
    sock = os.path.join(tmp, "kvpoold.sock")
    daemon = subprocess.Popen([sys.executable, "-m", "kvpoold", "--socket", sock, "--pool-bytes", args.pool_bytes,
                               "--log-level", "warning", *(["--backend", "cuda"] if args.device == "cuda" else [])])
    try:
        wait(lambda: os.path.exists(sock), 60, "kvpoold")
        runs, engine_rows = {}, []
        for graphs in (False, True) if args.device == "cuda" else (False,):
            tag = "graphs" if graphs else "eager"
            r = runs[tag] = run_engine(model, sock, prompts, args.new_tokens, graphs, tag)
            ms = window(r["steps"], args.at) * 1e3
            ph = r["phases_ms"]
            gpu = f"{r['graph_forward_ms']:.2f}" if r["graph_forward_ms"] else "-"
            engine_rows.append((tag, ms, gpu, " / ".join(f"{k} {v:.2f}" for k, v in ph.items())))
            out[tag] = {"step_ms": ms, **{k: v for k, v in r.items() if k != "outputs"}}
        if len(runs) == 2:
            same = sum(a == b for a, b in zip(runs["eager"]["outputs"], runs["graphs"]["outputs"]))
            out["graphs_equal_eager_sequences"] = same
            print(f"greedy outputs equal with and without graphs: {same} of {args.batch} sequences")
    finally:
        daemon.terminate()
        daemon.wait(30)
    hf_runs.append(window(run_transformers(model, prompts, args.new_tokens, args.device), args.at) * 1e3)
    hf_ms = min(hf_runs)
    out["transformers_ms"], out["transformers_runs_ms"] = hf_ms, hf_runs
    rows.append(["transformers generate (sdpa)", f"{hf_ms:.2f}", "1.00", "-",
                 "runs " + " / ".join(f"{v:.2f}" for v in hf_runs)])
    for tag, ms, gpu, phases in engine_rows:
        out[tag]["ratio"] = ms / hf_ms
        rows.append([f"kvpool engine, {'CUDA graphs' if tag == 'graphs' else 'eager'}", f"{ms:.2f}",
                     f"{ms / hf_ms:.2f}", gpu, phases])
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print_table(f"decode step at B{args.batch} x ~{args.at} tokens, {'tiny' if args.tiny else 'Llama-3.2-1B shape'} "
                f"on {dev}", ["system", "step ms (median)", "vs transformers", "graph forward ms (GPU)",
                              "phases ms (median)"], rows)
    write_json(f"step_{'tiny' if args.tiny else 'llama1b'}_{args.device}_{time.strftime('%Y%m%dT%H%M%S')}", out)


if __name__ == "__main__":
    main()
