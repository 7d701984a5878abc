"""KV write (reshape-and-cache) on the CPU with Numba.

Copies each token's ``[num_kv_heads, head_dim]`` key and value rows into the
pool at ``slot = block_id * block_size + offset``. The copy is dtype-blind:
everything travels as bytes (a uint8 view), so float16, bfloat16 and float32
share one Numba specialization and bfloat16 needs no conversion at all.

A decode step writes one token per sequence: 64 sequences of a small model are
some 64 KiB of copies per layer, microseconds of work, less than opening a
parallel region costs, and on a loaded machine far less (the region ends only
once every thread of the team has run). Below ``PARALLEL_MIN_BYTES`` the same
copy runs serially in the calling thread.
"""

from __future__ import annotations

from ._numba_compat import PARALLEL_LAUNCH, numba

PARALLEL_MIN_BYTES = 1 << 20  # key + value bytes of one call from which the copy runs on all threads


def _copy_rows(key, value, k_bytes, v_bytes, slots, block_size, k_stride, v_stride, num_kv_heads, row_bytes):
    """``key``/``value``: uint8 ``[T, num_kv_heads * row_bytes]``; ``k_bytes``/``v_bytes``:
    flat uint8 views of one layer's cache from block 0 (strides in bytes).
    Negative slots are skipped. Tokens are copied in parallel (``write_kv_cpu``);
    duplicate slots are a caller error (last writer unspecified), as on the GPU.
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


# other threads (the heartbeat) run meanwhile: nogil
write_kv_cpu = numba.njit(parallel=True, cache=True, nogil=True)(_copy_rows)
write_kv_cpu_serial = numba.njit(cache=True, nogil=True)(_copy_rows)  # prange is range here


def copy_rows(key, value, k_bytes, v_bytes, slots, block_size, k_stride, v_stride, num_kv_heads, row_bytes) -> None:
    """``write_kv_cpu``'s copy: serial below ``PARALLEL_MIN_BYTES`` of keys and values, else on all threads."""
    args = (key, value, k_bytes, v_bytes, slots, block_size, k_stride, v_stride, num_kv_heads, row_bytes)
    if key.nbytes + value.nbytes < PARALLEL_MIN_BYTES:
        write_kv_cpu_serial(*args)
        return
    with PARALLEL_LAUNCH:
        write_kv_cpu(*args)
