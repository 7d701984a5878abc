"""Helpers of the tier tests: a small layout, deterministic block contents, daemons with tiers.

Every block a test writes holds bytes derived from the tokens of its prefix
(what a model would compute), so a block read back anywhere can be checked
byte for byte against what must be there.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvpool

# 2 layers x K/V x 2 heads x 16 tokens x 16 dims x fp16 = 4096 bytes: a page, so O_DIRECT applies
LAYOUT = kvpool.Layout("tiers-model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=16)
BLOCK = 4096
BS = LAYOUT.block_size


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


BACKENDS = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")]),
]


def prompt(i: int, blocks: int = 4, extra: int = 0) -> list[int]:
    """A prompt of ``blocks`` full blocks (+ ``extra`` tokens) that shares no block with prompt j != i."""
    return [100_000 + i] + [(i * 31 + k) % 50_000 for k in range(1, blocks * BS + extra)]


def block_bytes(tokens) -> np.ndarray:
    """The bytes of the block whose prefix is ``tokens`` (a function of the tokens)."""
    seed = int.from_bytes(np.asarray(tokens, np.uint32).tobytes()[-64:], "little") % (1 << 63)
    seed ^= len(tokens)
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def rows(client):
    """The pool as a [blocks, 4096] uint8 torch tensor (shared memory or GPU memory, no copy)."""
    import torch

    return client.kv_cache().view(-1).view(torch.uint8).view(client.num_blocks, BLOCK)


def write_sequence(client, seq, tokens, start_block: int = 0) -> None:
    """Write the KV of every block (a partial last block too) of ``seq`` from ``start_block`` on."""
    import torch

    r = rows(client)
    table = seq.block_table
    for i in range(start_block, len(table)):
        r[int(table[i])] = torch.from_numpy(block_bytes(tokens[:(i + 1) * BS])).to(r.device)
    if r.is_cuda:
        torch.cuda.synchronize()  # written before the daemon may copy the blocks


def check_sequence(client, seq, tokens, blocks: int | None = None) -> None:
    r = rows(client)
    table = seq.block_table
    n = len(table) if blocks is None else blocks
    for i in range(n):
        got = r[int(table[i])].cpu().numpy()
        assert np.array_equal(got, block_bytes(tokens[:(i + 1) * BS])), (
            f"block {i} (pool block {table[i]}) holds other bytes")
