"""Two transformers model processes share one system prompt through kvpoold.

    python3 -m kvpoold --socket "$XDG_RUNTIME_DIR/kvpool.sock" &   # CPU backend by default
    python3 examples/hf_shared_prefix.py --socket "$XDG_RUNTIME_DIR/kvpool.sock"

Both processes load the same model (by default a small Llama with random
weights made from a fixed seed, so nothing is downloaded; ``--arch qwen2`` for
a Qwen2, ``--model PATH_OR_NAME`` for real weights via ``from_pretrained``),
attach to the daemon with the same model id, and generate greedily for
"system prompt + own question" through ``kvpool.hf.PagedModel``: the KV cache
lives in the daemon's pool and attention runs on it with ``kvpool.kernels``.
Process A computes the whole prompt; process B, started once A's prefill is
in the pool, finds the system prompt's full blocks there and its prefill
computes only the rest (its RoPE positions start where the cached prefix
ends).  Each prints its tokens; ``--check`` also runs transformers' own eager
attention on the same weights and says whether the tokens agree.  At the end
the daemon's stats are printed (``kvpoolctl stats``): B's prefix hit is there.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time

SEED = 0
SYSTEM_PROMPT = (
    "You are a careful assistant for a team that runs LLM inference servers. Answer briefly, "
    "name the trade-offs, and say when you are unsure. The servers share one KV-cache pool."
)
QUESTIONS = {
    "worker-a": "Why does paging the KV cache waste less memory?",
    "worker-b": "What does a prefix cache save?",
}


def build_model(args):
    """(model, tokenizer or None, model id): the same weights in every process."""
    import torch
    import transformers

    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError):
            tok = None
        if tok is not None and len(tok) < 2:  # no tokenizer files: transformers made an empty one
            tok = None
        return model.eval(), tok, args.model
    # head_dim 64: the smallest the GPU kernels take, so the same example runs on a CUDA daemon
    common = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, initializer_range=0.2)
    if args.arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    torch.manual_seed(SEED)
    # the model id names the weights: blocks are only shared under equal ids
    return cls(config).eval(), None, f"random-{args.arch}-seed{SEED}"


def encode(text: str, tok, vocab: int) -> list[int]:
    if tok is not None:
        return tok(text, add_special_tokens=False)["input_ids"]
    return [(ord(c) * 7 + i) % (vocab - 1) + 1 for i, c in enumerate(text)]  # a stand-in tokenizer


def worker(args, name: str, start_after, prefilled, finish, results) -> None:
    import torch

    import kvpool
    import kvpool.hf

    model, tok, model_id = build_model(args)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = encode(SYSTEM_PROMPT + "\n", tok, vocab) + encode(QUESTIONS[name], tok, vocab)
    layout = kvpool.hf.layout_for(model, model_id, block_size=args.block_size)
    with kvpool.connect(args.socket, name=name, layout=layout) as client:
        model.to(client.kv_cache().device)  # the pool's device: CPU shared memory or the CUDA device
        reference = None
        if args.check:  # transformers' own path on the same weights, before kvpool takes the model
            model.set_attn_implementation("eager")
            ids = torch.tensor([prompt], device=model.device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                     do_sample=False)
            reference = out[0, len(prompt):].tolist()
        pm = kvpool.hf.PagedModel(model, client)
        if start_after is not None:  # B: loaded and attached; its prefill waits for A's to be in the pool
            start_after.wait()
        t0 = time.perf_counter()
        (seq,), logits = pm.prefill([prompt])
        prefill_ms = (time.perf_counter() - t0) * 1e3
        prefilled.set()  # its blocks are in the pool now: the other process may start
        gen = pm.continue_greedy([seq], [int(logits[0].argmax())], args.max_new_tokens)
        client.flush()
        generated = gen.tokens[0]
        results.put({
            "name": name, "model_id": model_id, "prompt_tokens": len(prompt),
            "cached_tokens": seq.num_cached_tokens, "computed_tokens": len(prompt) - seq.num_cached_tokens,
            "prefill_ms": round(prefill_ms, 2), "tokens": generated, "blocks": seq.block_table.tolist(),
            "text": tok.decode(generated) if tok is not None else None,
            "matches_eager": None if reference is None else generated == reference,
        })
        finish.wait()  # hold the sequence until both are done: its blocks are shared meanwhile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=os.environ.get("KVPOOL_SOCKET"),
                    help="kvpoold's socket (default $KVPOOL_SOCKET)")
    ap.add_argument("--arch", choices=("llama", "qwen2"), default="llama", help="random-weight model kind")
    ap.add_argument("--model", default=None, help="a transformers model name or folder (from_pretrained)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--check", action="store_true", help="compare with transformers' eager attention")
    ap.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    a_prefilled, b_prefilled, finish = ctx.Event(), ctx.Event(), ctx.Event()
    results = ctx.Queue()
    a = ctx.Process(target=worker, args=(args, "worker-a", None, a_prefilled, finish, results))
    b = ctx.Process(target=worker, args=(args, "worker-b", a_prefilled, b_prefilled, finish, results))
    a.start()
    b.start()
    got = []
    try:
        while len(got) < 2 and (a.is_alive() or b.is_alive() or not results.empty()):
            try:
                got.append(results.get(timeout=1.0))
            except queue.Empty:
                continue
        if len(got) == 2:
            report(args, sorted(got, key=lambda r: r["name"]))
    finally:
        finish.set()
        a.join()
        b.join()
    if a.exitcode or b.exitcode or len(got) < 2:
        raise SystemExit(f"a worker failed (exit codes {a.exitcode}, {b.exitcode})")


def report(args, got: list[dict]) -> None:
    """Tokens out, then the pool while both processes still hold their sequences."""
    import kvpool

    for r in got:
        line = (f"{r['name']}: prompt {r['prompt_tokens']} tokens, {r['cached_tokens']} found in the pool "
                f"(prefill computed {r['computed_tokens']}); generated {r['tokens']}")
        if r["text"] is not None:
            line += f" = {r['text']!r}"
        if r["matches_eager"] is not None:
            line += f"; matches transformers eager: {r['matches_eager']}"
        print(line, flush=True)
    shared = set(got[0]["blocks"]) & set(got[1]["blocks"])
    print(f"{len(shared)} blocks are in both processes' block tables (the system prompt's full blocks)")
    sock = ["--socket", args.socket] if args.socket else []
    print("$ kvpoolctl " + " ".join(sock + ["stats"]), flush=True)
    subprocess.run([sys.executable, "-m", "kvpoold.ctl", *sock, "stats"], check=False)
    if args.json:
        with kvpool.Connection(args.socket) as conn:
            stats = conn.stats().to_dict()
        print(json.dumps({"workers": got, "shared_blocks": len(shared), "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
