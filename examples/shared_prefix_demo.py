"""Two model processes share one system prompt through kvpoold.

    python3 examples/shared_prefix_demo.py --socket "$XDG_RUNTIME_DIR/kvpool.sock"

Each process attaches with the same model layout, creates a sequence made of
a shared system prompt and its own question, computes K/V only for the tokens
the pool does not already hold, writes them into the shared pool with
``kvpool.kernels.write_kv`` and decodes a few tokens with
``kvpool.kernels.paged_decode_attention``, reading the other process's blocks
in place.  The "model" is a toy (K/V and queries are a fixed function of the
token ids) so the demo needs no weights; the memory path is the real one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

LAYOUT = dict(model_id="demo-llama", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", block_size=16)
Q_HEADS = 8
SYSTEM_PROMPT = list(range(1000, 1000 + 24 * 16))  # 384 tokens, 24 full blocks
QUESTIONS = {"worker-a": [11, 12, 13, 14, 15], "worker-b": [21, 22, 23]}


def toy_kv(tokens: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic stand-in for a model's K/V projection of ``tokens``."""
    d, h = LAYOUT["head_dim"], LAYOUT["num_kv_heads"]
    phase = tokens[:, None, None] * 0.01 + np.arange(h)[None, :, None] + np.arange(d)[None, None, :] * 0.1
    return np.sin(phase + layer).astype(np.float32), np.cos(phase - layer).astype(np.float32)


def worker(socket: str, name: str, start_after: mp.Event | None, done: mp.Event) -> None:
    import torch

    import kvpool
    from kvpool.kernels import paged_decode_attention, write_kv

    if start_after is not None:
        start_after.wait()
    layout = kvpool.Layout(**LAYOUT)
    with kvpool.connect(socket, name=name, layout=layout) as client:
        kv = client.kv_cache()
        prompt = SYSTEM_PROMPT + QUESTIONS[name]
        t0 = time.perf_counter()
        seq = client.create_sequence(prompt)
        new = np.asarray(prompt[seq.num_cached_tokens:], np.int64)
        slots = torch.from_numpy(client.slot_mapping(seq, seq.num_cached_tokens, len(new)))
        for layer in range(layout.num_layers):
            k, v = toy_kv(new, layer)
            write_kv(torch.from_numpy(k), torch.from_numpy(v), kv[:, layer, 0], kv[:, layer, 1], slots)
        client.mark_written(seq)  # the prompt's KV is in the pool: other processes may reuse it now
        prefill_ms = (time.perf_counter() - t0) * 1e3
        generated = []
        for _ in range(8):
            tables = torch.from_numpy(client.block_tables([seq]))
            lens = torch.from_numpy(client.seq_lens([seq]))
            q = torch.ones(1, Q_HEADS, layout.head_dim) * 0.05
            out = paged_decode_attention(q, kv[:, 0, 0], kv[:, 0, 1], tables, lens)
            token = int(abs(float(out.sum())) * 1000) % 32000  # the toy model's "argmax"
            generated.append(token)
            client.extend({seq: [token]})
            pos = seq.num_tokens - 1
            slot = torch.from_numpy(client.slot_mapping(seq, pos, 1))
            for layer in range(layout.num_layers):
                k, v = toy_kv(np.asarray([token]), layer)
                write_kv(torch.from_numpy(k), torch.from_numpy(v), kv[:, layer, 0], kv[:, layer, 1], slot)
        print(f"{name}: prompt {len(prompt)} tokens, {seq.num_cached_tokens} found in the pool "
              f"(prefill computed {len(new)}), {prefill_ms:.1f} ms; generated {generated}", flush=True)
        client.flush()
        done.set()
        done.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=None, help="kvpoold's socket (default $KVPOOL_SOCKET)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    a_done, b_done = ctx.Event(), ctx.Event()
    a = ctx.Process(target=worker, args=(args.socket, "worker-a", None, a_done))
    b = ctx.Process(target=worker, args=(args.socket, "worker-b", a_done, b_done))
    a.start()
    b.start()
    b.join()
    a.join()
    if a.exitcode or b.exitcode:
        raise SystemExit(f"a worker failed (exit codes {a.exitcode}, {b.exitcode})")


if __name__ == "__main__":
    main()
