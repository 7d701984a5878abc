"""KV write (reshape-and-cache) on the CPU with Numba.

Copies each token's ``[num_kv_heads, head_dim]`` key and value rows into the
pool at ``slot = block_id * block_size + offset``. The copy is dtype-blind:
everything travels as bytes (a uint8 view), so float16, bfloat16 and float32
share one Numba specialization and bfloat16 needs no conversion at all.
"""

from __future__ import annotations

from ._numba_compat import numba


@numba.njit(parallel=True, cache=True, nogil=True)  # other threads (the heartbeat) run meanwhile
def write_kv_cpu(key, value, k_bytes, v_bytes, slots, block_size, k_stride, v_stride, num_kv_heads, row_bytes):
    """``key``/``value``: uint8 ``[T, num_kv_heads * row_bytes]``; ``k_bytes``/``v_bytes``:
    flat uint8 views of one layer's cache from block 0 (strides in bytes).
    Negative slots are skipped. Tokens are copied in parallel; duplicate slots
    are a caller error (last writer unspecified), as on the GPU.
    """
    for t in numba.prange(slots.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot % block_size
        for h in range(num_kv_heads):
            src = h * row_bytes
            dk = blk * k_stride + (h * block_size + off) * row_bytes
            dv = blk * v_stride + (h * block_size + off) * row_bytes
            k_bytes[dk : dk + row_bytes] = key[t, src : src + row_bytes]
            v_bytes[dv : dv + row_bytes] = value[t, src : src + row_bytes]
