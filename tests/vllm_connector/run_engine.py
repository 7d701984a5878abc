"""One vLLM CPU engine in its own process, serving commands from stdin (one JSON object a line).

    python tests/vllm_connector/run_engine.py MODEL_DIR [SOCKET]

With SOCKET the engine runs with kvpool.vllm.KvpoolConnector on that kvpoold
(``retry_seconds`` 1: a restarted daemon is found again within a second).
It prints ``READY {"startup_seconds": ...}`` once the engine is up, then
answers each command with one line ``RESULT {...}`` (vLLM's own logs go to
stderr and other stdout lines, which callers skip):

* ``{"prompts": [[token ids], ...], "max_tokens": 8}``: greedy outputs, one
  request after the other (each request's cache hit is its own), with
  ``num_cached_tokens`` (vLLM's local plus connector hit), the generated tokens,
  their logprobs and the seconds to the first token (``max_tokens`` 1) or the whole
  request.
* ``{"metrics": true}``: vLLM's counters (``LLM.get_metrics()``) by name.
* ``{"exit": true}``: stops.
"""

from __future__ import annotations

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


def main() -> None:
    model = sys.argv[1]
    socket = sys.argv[2] if len(sys.argv) > 2 else None
    from vllm import LLM, SamplingParams

    kw = {"kv_transfer_config": _kv_transfer_config(socket)} if socket else {}
    t0 = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096, enforce_eager=True,
              block_size=32, enable_prefix_caching=True, disable_log_stats=False, **kw)
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
        results = []
        params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0, ignore_eos=True, logprobs=0)
        for p in cmd["prompts"]:
            t1 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            gen = out.outputs[0]
            logprobs = [step[tok].logprob for step, tok in zip(gen.logprobs or [], gen.token_ids)]
            results.append({"tokens": list(gen.token_ids), "logprobs": logprobs,
                            "num_cached_tokens": out.num_cached_tokens, "seconds": time.perf_counter() - t1})
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
