"""A model process for the warm-restart tests: ``python restart_proc.py SOCKET JSON``.

JSON: ``arch`` (``llama`` or a model of tests/hf/test_sliding_softcap.py: ``gemma2``...), ``device``
(``cpu``, ``cuda``), ``model_id``, ``prompt`` (token ids), ``new_tokens``, ``role`` and ``dump`` (an .npy
path).  The model is the tests' small random one with head_dim 64 (a head_dim the GPU kernels take), float32.

* ``first``: prefill the prompt through ``kvpool.hf`` (which says its K/V is written), save the bytes of its
  full blocks to ``dump``, print one JSON line (its block table and first greedy token), then hold the
  sequence until killed.
* ``successor``: create the prompt's sequence, save the bytes of the blocks the pool already held to
  ``dump``, then generate greedily; print one JSON line with how many prompt tokens the pool held, the table,
  the tokens, and transformers' own greedy tokens for the same prompt (eager attention, DynamicCache).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hf_models import eager_copy, make_model, reference_generate  # noqa: E402
from test_sliding_softcap import make  # noqa: E402

import kvpool.hf as kvpool_hf  # noqa: E402

BLOCK_SIZE = 16
GPU_SHAPE = dict(hidden_size=256, head_dim=64)  # 4 query heads, 2 KV heads of 64


def build(arch: str, device: str):
    model = make_model("llama", **GPU_SHAPE) if arch == "llama" else make(arch, **GPU_SHAPE)
    return model.to(device)


def dump_blocks(pm, blocks: list[int], path: str) -> None:
    """The raw bytes of ``blocks`` (every layer's K and V) as the process sees them through its pool view."""
    kv = pm.client.kv_cache()
    if kv.is_cuda:
        torch.cuda.synchronize(kv.device)
    raw = kv[torch.tensor(blocks, dtype=torch.long, device=kv.device)].contiguous().cpu()
    np.save(path, raw.view(torch.uint8).numpy())


def main() -> None:
    socket, args = sys.argv[1], json.loads(sys.argv[2])
    model = build(args["arch"], args["device"])
    prompt = args["prompt"]
    full = len(prompt) // BLOCK_SIZE
    with kvpool_hf.PagedModel.connect(model, socket, name=f"restart-{args['role']}", model_id=args["model_id"],
                                      block_size=BLOCK_SIZE) as pm:
        if args["role"] == "first":
            (seq,), logits = pm.prefill([prompt])
            table = seq.block_table.tolist()
            dump_blocks(pm, table[:full], args["dump"])
            print(json.dumps({"table": table, "first_token": int(logits[0].argmax()),
                              "cached": seq.num_cached_tokens}), flush=True)
            while True:  # hold the sequence: the test kills this process
                time.sleep(60)
        seq = pm.client.create_sequence(prompt)
        cached, table = seq.num_cached_tokens, seq.block_table.tolist()
        dump_blocks(pm, table[:cached // BLOCK_SIZE], args["dump"])
        pm.client.free(seq, written=False)  # its tail was never computed
        gen = pm.generate([prompt], max_new_tokens=args["new_tokens"])
        want, _ = reference_generate(eager_copy(model), prompt, args["new_tokens"])
        print(json.dumps({"cached": cached, "table": table, "tokens": gen.tokens[0],
                          "generate_cached": gen.num_cached_tokens[0], "reference_tokens": want}), flush=True)


if __name__ == "__main__":
    main()
