"""The kvpool engine against vLLM's CPU build: output tokens/s of one batch of requests, same ids, same weights.

    python3 benchmarks/bench_vs_vllm_cpu.py              # 64 requests, 2 workloads, median of 3: ~15 min on 2 idle cores
    python3 benchmarks/bench_vs_vllm_cpu.py --quick      # a smoke run of the whole path (~3 min)
    KVPOOL_VLLM_VENV=/path/to/venv-vllm python3 benchmarks/bench_vs_vllm_cpu.py --num-requests 32

One random-weight Llama is built here (``--layers`` 8, hidden 512, 8 heads of
64, 2 KV heads, vocab 32000: 63M parameters; ``save_pretrained``, nothing
downloaded; no tokenizer: both systems take token ids).  Both systems get the
same requests, all at once, greedy, ``ignore_eos``, every request to
``--output-tokens``; both run the same step limits (``--num-requests``
sequences, ``--max-batched-tokens`` tokens a step):

* **independent**: ``--num-requests`` prompts of ``--prompt-tokens`` random ids;
* **shared prefix**: the same, each behind one common ``--prefix-tokens``-token
  prefix, so a prefix cache has something to find.

Each repetition draws fresh prompts (neither system's prefix cache sees an
earlier repetition's), the same for both systems, and the two systems run in
turn, alternating which goes first.  Figures, medians over the repetitions:

* output tokens per wall second, from handing the batch over to its last token
  (prefill included);
* output tokens per CPU-second: the user + system time the system's processes
  spent meanwhile (kvpool: this process and kvpoold; vLLM: its front end,
  engine core and worker).  Other work on the machine moves this far less
  than the wall-time figure; threads that spin while they wait count too.

* **kvpool**: a kvpoold on the CPU backend, started here, and
  ``kvpool.engine.Engine.generate`` in this process (stepping in this thread).
* **vLLM**: ``vllm.LLM.generate`` of vLLM's CPU build (``vllm-cpu``) in a
  subprocess (``vllm_cpu_batch.py``) under the interpreter of its own venv
  (``$KVPOOL_VLLM_VENV``, default ``~/.cache/kvpool/venv-vllm``, as
  scripts/vllm_venv.sh builds it for the connector tests): vLLM pins a transformers that cannot be imported beside ours.  Eager
  (no graphs on a CPU anyway), prefix caching on, its default block size (128
  tokens on the CPU; kvpool: 16).

Every output is compared token for token; mismatches are reported, not hidden.

**float32 on both** (``--dtype``): both sides then do the same arithmetic up
to the order of sums, so greedy outputs can be compared token for token (in
bfloat16 two correct engines round differently and a random model's
near-ties flip), and on a CPU without AVX-512 BF16 or AMX bfloat16 matrix
products are emulated, slower than float32.  The JSON records which of these
the CPU has (``cpu_flags``, from ``/proc/cpuinfo``); ``--dtype bfloat16`` runs
both in bfloat16 instead.

The machine should be idle: before each measurement the script samples the
CPU use of the whole machine for a second while both systems sit idle and the
load average; above 25% busy (or a 1-minute load above half the cores) the
table and the JSON say the figures ran on a busy machine.

Prints a table and writes JSON to benchmarks/results/vs_vllm_cpu_<time>.json.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "vllm_connector"))

from _common import print_table, write_json  # noqa: E402
from bench_serve import wait  # noqa: E402
from vllm_engines import Engine as VllmProcess  # noqa: E402

# where scripts/vllm_venv.sh builds it (the connector tests' venv: tests/vllm_connector/conftest.py)
VLLM_VENV = Path(os.environ.get("KVPOOL_VLLM_VENV")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpool" / "venv-vllm")
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
BUSY_CPU_PERCENT = 25.0
WORKLOADS = ("independent", "shared prefix")


# -- the machine -----------------------------------------------------------------------------------
def cpu_flags() -> dict[str, bool]:
    """Whether the CPU has the instructions that make bfloat16 matrix products fast."""
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {name: name in flags for name in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants so far."""
    total = 0.0
    for pid in pids:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def machine_load(settle: float = 2.0) -> dict:
    """The machine's CPU use over a second while both systems idle, and its load averages.

    ``settle`` seconds first: vLLM's worker spins on its queue for a moment after a batch.
    """
    time.sleep(settle)
    busy = psutil.cpu_percent(interval=1.0)
    load = os.getloadavg()
    cores = os.cpu_count() or 1
    return {"cpu_percent": busy, "loadavg": [round(x, 2) for x in load],
            "busy": busy > BUSY_CPU_PERCENT or load[0] > cores / 2}


# -- the model and the requests --------------------------------------------------------------------
def build_llama(path: str, layers: int, dtype: str, seed: int = 0) -> dict:
    """A random-weight Llama saved in ``path`` (63M parameters at 8 layers); its shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(getattr(torch, dtype))
    model.save_pretrained(path)
    return {**shape, "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype}


def make_requests(args, vocab: int, repetition: int) -> dict[str, list[list[int]]]:
    """Each workload's prompts for one repetition (fresh ids each repetition, the same for both systems)."""
    rng = random.Random(1000 + repetition)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prefix = ids(args.prefix_tokens)
    return {"independent": [ids(args.prompt_tokens) for _ in range(args.num_requests)],
            "shared prefix": [prefix + ids(args.prompt_tokens) for _ in range(args.num_requests)]}


def kv_bytes(shape: dict, tokens: int) -> int:
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]
    return per_token * tokens * (4 if shape["dtype"] == "float32" else 2)


# -- the two systems -------------------------------------------------------------------------------
class Kvpool:
    """A kvpoold (CPU backend) and an ``Engine`` on it in this process."""

    def __init__(self, args, model_dir: str, tmp: Path, pool_bytes: int, max_model_len: int):
        import numba
        import torch
        import transformers

        import kvpool.engine as ke

        self.ke = ke
        sock = str(tmp / "kvpoold.sock")
        self.daemon = subprocess.Popen([sys.executable, "-m", "kvpoold", "--socket", sock, "--pool-bytes",
                                        str(pool_bytes), "--log-level", "warning"], cwd=ROOT)
        wait(lambda: os.path.exists(sock), 60, "kvpoold", self.daemon)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
        config = ke.EngineConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_batched_tokens,
                                 max_model_len=max_model_len, fused_layers=args.fused_layers)
        self.engine = ke.Engine.connect(model, sock, name="bench-vs-vllm", model_id="bench-vs-vllm", config=config)
        self.torch_threads = torch.get_num_threads()
        self.numba_threading_layer = numba.threading_layer()  # chosen at connect's warm-up launch
        self.pids = [os.getpid(), self.daemon.pid]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        eng = self.engine
        params = self.ke.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        eng.timings.reset()
        before, cpu0 = eng.stats(), cpu_seconds(self.pids)
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        seconds = time.perf_counter() - t0
        cpu = cpu_seconds(self.pids) - cpu0
        delta = eng.stats() - before
        summary = eng.timings.summary()
        return {"seconds": seconds, "cpu_seconds": cpu, "outputs": [list(o.token_ids) for o in outs],
                "num_cached_tokens": [o.num_cached_tokens for o in outs], "steps": delta.steps,
                "prefix_hit_tokens": delta.prefix_hit_tokens,
                "step_shares": {k[:-6]: round(v, 4) for k, v in summary.items() if k.endswith("_share")}}

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.daemon.terminate()
            self.daemon.wait(30)


class Vllm:
    """vLLM's CPU engine in a subprocess under its venv's interpreter (``vllm_cpu_batch.py``)."""

    def __init__(self, args, model_dir: str, tmp: Path, kv_space_gib: int, max_model_len: int):
        kwargs = {"dtype": args.dtype, "max_num_seqs": args.num_requests,
                  "max_num_batched_tokens": args.max_batched_tokens, "max_model_len": max_model_len}
        self.proc = VllmProcess("vllm", model_dir, None, tmp, python=str(VLLM_PYTHON),
                                llm_args=kwargs, script=HERE / "vllm_cpu_batch.py",
                                env={"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)})
        self.startup_seconds = self.proc.ready(timeout=900)
        self.torch_threads = self.proc.ready_info["torch_threads"]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        cpu0 = cpu_seconds([self.proc.proc.pid])
        r = self.proc.call({"prompts": prompts, "max_tokens": max_tokens}, timeout=3600)
        return {**r, "cpu_seconds": cpu_seconds([self.proc.proc.pid]) - cpu0}

    def close(self) -> None:
        self.proc.close()


# -- measuring -------------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(kv: list[list[int]], vl: list[list[int]]) -> dict:
    """How many requests got the same tokens from both; where the others first differ."""
    diff = [{"request": i, "first_difference_at": first_difference(a, b)}
            for i, (a, b) in enumerate(zip(kv, vl)) if a != b]
    return {"identical": len(kv) - len(diff), "of": len(kv), "mismatches": diff}


def measure(systems: dict, args, vocab: int) -> dict:
    """Every repetition of every workload on every system, in turn; raw figures per workload."""
    raw = {w: {"kvpool": [], "vllm": [], "load": [], "compare": []} for w in WORKLOADS}
    for rep in range(args.repeat):
        requests = make_requests(args, vocab, rep)
        order = list(systems) if rep % 2 == 0 else list(reversed(systems))
        for w in WORKLOADS:
            got = {}
            for name in order:
                load = machine_load()
                raw[w]["load"].append({"system": name, "repetition": rep, **load})
                r = systems[name].generate(requests[w], args.output_tokens)
                tokens = sum(len(o) for o in r["outputs"])
                r["tok_per_s"], r["tok_per_cpu_s"] = tokens / r["seconds"], tokens / r["cpu_seconds"]
                got[name] = r["outputs"]
                raw[w][name].append({k: v for k, v in r.items() if k != "outputs"})
                print(f"  rep {rep} {w:13s} {name:6s} {r['tok_per_s']:7.1f} output tok/s "
                      f"({r['seconds']:.1f} s, {r['tok_per_cpu_s']:.1f} per CPU-second; machine {load['cpu_percent']:.0f}% busy before, "
                      f"load {load['loadavg'][0]})", flush=True)
            if len(got) == 2:
                raw[w]["compare"].append(compare(got["kvpool"], got["vllm"]))
    return raw


def warm_up(systems: dict, vocab: int) -> None:
    """First-call costs (Numba's compile, thread pools, allocations) out of the figures."""
    rng = random.Random(7)
    prompts = [[rng.randrange(10, vocab) for _ in range(40 + 8 * i)] for i in range(4)]
    for s in systems.values():
        s.generate(prompts, 4)


def median_and_span(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(raw: dict) -> tuple[list[list], dict]:
    """Per workload: medians (and spans) of both figures on both systems, their ratios, the output check."""
    rows, out = [], {}
    for w, r in raw.items():
        systems = [s for s in ("kvpool", "vllm") if r[s]]
        fig = {(s, key): median_and_span(r[s], key) for s in systems for key in ("tok_per_s", "tok_per_cpu_s")}
        ratio = {key: fig["kvpool", key]["median"] / fig["vllm", key]["median"] if "vllm" in systems else None
                 for key in ("tok_per_s", "tok_per_cpu_s")}
        same, total = sum(c["identical"] for c in r["compare"]), sum(c["of"] for c in r["compare"])
        busy = any(x["busy"] for x in r["load"])
        shares = r["kvpool"][-1]["step_shares"]
        out[w] = {**{f"{s}_{key}": fig[s, key] for s, key in fig}, **{f"ratio_{k}": v for k, v in ratio.items()},
                  "identical_outputs": same, "outputs_compared": total, "busy": busy, "kvpool_step_shares": shares}

        def cell(s: str, key: str) -> str:
            f = fig.get((s, key))
            return f"{f['median']:.1f} ({f['min']:.0f}-{f['max']:.0f})" if f else "-"

        rows.append([w, cell("kvpool", "tok_per_s"), cell("vllm", "tok_per_s"),
                     f"{ratio['tok_per_s']:.2f}x" if ratio["tok_per_s"] else "-",
                     cell("kvpool", "tok_per_cpu_s"), cell("vllm", "tok_per_cpu_s"),
                     f"{ratio['tok_per_cpu_s']:.2f}x" if ratio["tok_per_cpu_s"] else "-",
                     f"{same}/{total}" if total else "-",
                     "/".join(f"{x['loadavg'][0]:.0f}" for x in r["load"]) + (" BUSY" if busy else ""),
                     f"forward {shares['forward'] * 100:.0f}%"])
    return rows, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64, help="requests of one batch, all at once")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="each prompt's own tokens")
    ap.add_argument("--prefix-tokens", type=int, default=512, help="the shared prefix of the second workload")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--max-batched-tokens", type=int, default=1024, help="tokens one step computes (both)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions (the median is shown)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--omp-wait-policy", choices=("active", "passive"), default=None,
                    help="OMP_WAIT_POLICY for both systems (default: the environment's, else OpenMP's own)")
    ap.add_argument("--fused-layers", action="store_true",
                    help="kvpool runs the model through kvpool.fused (merged matmuls, fused norm/RoPE/SiLU ops)")
    ap.add_argument("--skip-vllm", action="store_true", help="kvpool alone (profiling our side)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 short requests, 2 layers, once")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.prompt_tokens, args.prefix_tokens, args.output_tokens = 8, 32, 64, 8
        args.layers, args.repeat = 2, 1
    if args.omp_wait_policy:  # read as an OpenMP runtime loads: here before torch is imported; vLLM's inherit it
        assert "torch" not in sys.modules
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    if not args.skip_vllm and not VLLM_PYTHON.exists():
        sys.exit(f"no vLLM venv at {VLLM_VENV} (scripts/vllm_venv.sh builds it; KVPOOL_VLLM_VENV "
                 "names another); --skip-vllm runs kvpool alone")
    before = machine_load(settle=0)
    print(f"machine before the run: {before['cpu_percent']:.0f}% CPU busy, load {before['loadavg']}"
          + ("  ** BUSY: figures will be noisy **" if before["busy"] else ""), flush=True)
    max_model_len = args.prefix_tokens + args.prompt_tokens + args.output_tokens + 16
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        tmp_path = Path(tmp)
        model_dir = str(tmp_path / "model")
        shape = build_llama(model_dir, args.layers, args.dtype)
        need = kv_bytes(shape, args.num_requests * max_model_len)
        systems, startup = {}, {}
        try:
            t0 = time.perf_counter()
            systems["kvpool"] = Kvpool(args, model_dir, tmp_path, pool_bytes=2 * need + (64 << 20),
                                       max_model_len=max_model_len)
            startup["kvpool"] = time.perf_counter() - t0
            if not args.skip_vllm:
                systems["vllm"] = Vllm(args, model_dir, tmp_path, kv_space_gib=max(1, math.ceil(2 * need / 2**30)),
                                       max_model_len=max_model_len)
                startup["vllm"] = systems["vllm"].startup_seconds
            warm_up(systems, shape["vocab_size"])
            raw = measure(systems, args, shape["vocab_size"])
            threads = {name: s.torch_threads for name, s in systems.items()}
            numba_layer = systems["kvpool"].numba_threading_layer
        finally:
            for s in systems.values():
                s.close()
    rows, summary = summarize(raw)
    busy = before["busy"] or any(s["busy"] for s in summary.values())
    title = (f"{args.num_requests} requests at once, {args.prompt_tokens}-token prompts (+{args.prefix_tokens} shared "
             f"in the second), {args.output_tokens} output tokens, greedy; Llama {shape['parameters'] / 1e6:.0f}M "
             f"({args.layers} layers, {args.dtype}), {os.cpu_count()} cores; output tokens per wall second and per "
             f"CPU-second of each system's processes, median (min-max) of {args.repeat}")
    print_table(title, ["workload", "kvpool tok/s", "vLLM tok/s", "kvpool / vLLM", "kvpool tok/CPU-s",
                        "vLLM tok/CPU-s", "kvpool / vLLM", "identical outputs", "1-min load before each",
                        "kvpool step"], rows)
    if busy:
        print(f"\nWARNING: the machine was busy (others above {BUSY_CPU_PERCENT:.0f}% of its CPU, or load above "
              "half the cores): the figures are noisy")
    mismatched = {w: [c["mismatches"] for c in raw[w]["compare"] if c["mismatches"]] for w in WORKLOADS}
    for w, m in mismatched.items():
        if m:
            print(f"\noutputs differ ({w}): {m}")
    write_json(f"vs_vllm_cpu_{time.strftime('%Y%m%dT%H%M%S')}", {
        "bench": "vs_vllm_cpu", "args": vars(args), "model": shape, "cpu_flags": cpu_flags(),
        "torch_threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "kvpool_numba_threading_layer": numba_layer, "startup_seconds": startup,
        "load_before": before, "busy": busy,
        "summary": summary, "raw": raw,
    })


if __name__ == "__main__":
    main()
