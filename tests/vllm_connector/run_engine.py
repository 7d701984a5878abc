"""One vLLM CPU engine in its own process, serving commands from stdin (one JSON object a line).

    python tests/vllm_connector/run_engine.py MODEL_DIR [SOCKET] [--llm JSON]

With SOCKET the engine runs with kvpool.vllm.KvpoolConnector on that kvpoold
(``retry_seconds`` 1: a restarted daemon is found again within a second).
``--llm`` overrides ``LLM(...)`` arguments, e.g. ``{"num_gpu_blocks_override": 48,
"max_num_batched_tokens": 64}``: a KV cache of 48 blocks (vLLM preempts when the
running requests need more) and prompts prefilled 64 tokens a step.
It prints ``READY {"startup_seconds": ...}`` once the engine is up, then
answers each command with one line ``RESULT {...}`` (vLLM's own logs go to
stderr and other stdout lines, which callers skip):

* ``{"prompts": [[token ids], ...], "max_tokens": 8}``: greedy outputs, one
  request after the other (each request's cache hit is its own; with
  ``"together": true`` all in one ``generate`` call, scheduled side by side), with
  ``num_cached_tokens`` (vLLM's local plus connector hit), the generated tokens,
  their logprobs and the seconds to the first token (``max_tokens`` 1) or the whole
  request (for ``together``: the whole call).
* ``{"metrics": true}``: vLLM's counters (``LLM.get_metrics()``) by name.
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


def _kv_transfer_config(socket: str) -> dict:
    return {
        "kv_connector": "KvpoolConnector",
        "kv_connector_module_path": "kvpool.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": socket, "retry_seconds": 1},
    }


def _result(out, seconds: float) -> dict:
    gen = out.outputs[0]
    logprobs = [step[tok].logprob for step, tok in zip(gen.logprobs or [], gen.token_ids)]
    return {"tokens": list(gen.token_ids), "logprobs": logprobs, "num_cached_tokens": out.num_cached_tokens,
            "seconds": seconds}


def _generate(llm, cmd: dict) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in cmd["prompts"]]
    batches = [requests] if cmd.get("together") else [[r] for r in requests]
    results = []
    for batch in batches:
        t1 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        results += [_result(out, time.perf_counter() - t1) for out in outs]
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("socket", nargs="?")
    ap.add_argument("--llm", type=json.loads, default={}, help="LLM(...) arguments over the defaults, as JSON")
    args = ap.parse_args()
    from vllm import LLM

    kw = {"kv_transfer_config": _kv_transfer_config(args.socket)} if args.socket else {}
    kw = {"dtype": "bfloat16", "max_model_len": 4096, "block_size": 32, **kw, **args.llm}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
              disable_log_stats=False, **kw)
    print("READY " + json.dumps({"startup_seconds": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        if cmd.get("metrics"):
            counters: dict[str, float] = {}
            for m in llm.get_metrics():
                if hasattr(m, "value"):  # counters and gauges (histograms have no single value)
                    counters[m.name] = counters.get(m.name, 0) + m.value
            print("RESULT " + json.dumps(counters), flush=True)
            continue
        print("RESULT " + json.dumps(_generate(llm, cmd)), flush=True)


if __name__ == "__main__":
    main()
