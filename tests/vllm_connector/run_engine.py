"""One vLLM CPU engine in its own process: greedy outputs of some prompts, as JSON on the line starting "RESULT ".

    python tests/vllm_connector/run_engine.py MODEL_DIR PROMPTS_JSON [SOCKET]

With SOCKET the engine runs with kvpool.vllm.KvpoolConnector on that kvpoold.
With KILL_AFTER_FIRST=PID in the environment, PID (the daemon) is killed with
SIGKILL once the first prompt is done: the engine must go on serving.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    model, prompts_json = sys.argv[1], sys.argv[2]
    socket = sys.argv[3] if len(sys.argv) > 3 else None
    prompts = json.loads(prompts_json)
    from vllm import LLM, SamplingParams

    kw = {}
    if socket:
        kw["kv_transfer_config"] = {
            "kv_connector": "KvpoolConnector",
            "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": socket},
        }
    t0 = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              block_size=32, enable_prefix_caching=True, **kw)
    started = time.perf_counter() - t0
    results = []
    kill = int(os.environ.get("KILL_AFTER_FIRST", "0"))
    for i, p in enumerate(prompts):  # one at a time: each request's cache hit is its own
        if i == 1 and kill:
            os.kill(kill, signal.SIGKILL)
            time.sleep(0.5)
        t1 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0),
                           use_tqdm=False)[0]
        gen = out.outputs[0]
        logprobs = [step[tok].logprob for step, tok in zip(gen.logprobs or [], gen.token_ids)]
        results.append({"tokens": list(gen.token_ids), "logprobs": logprobs,
                        "num_cached_tokens": out.num_cached_tokens, "seconds": time.perf_counter() - t1})
    print("RESULT " + json.dumps({"startup_seconds": started, "results": results}), flush=True)


if __name__ == "__main__":
    main()
