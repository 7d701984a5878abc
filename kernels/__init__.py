"""kvpool.kernels: paged attention and KV writes over kvpool's block pool.

Pool layout (one layout class): ``kv_cache [num_blocks, num_layers, 2,
num_kv_heads, block_size, head_dim]``, C-contiguous, float16 / bfloat16 /
float32 / float8_e4m3fn; a physical block id indexes axis 0. Kernels work on one layer's
views ``k_cache = kv_cache[:, layer, 0]`` and ``v_cache = kv_cache[:, layer,
1]`` (axis-0 stride = one whole multi-layer block) or on any tensors with
the same inner layout.

CPU tensors run Numba kernels; CUDA tensors run CUDA kernels compiled by CuPy
on first use (CuPy is imported only then). On Hopper (compute capability 9.0),
prefill runs a warpgroup-MMA kernel compiled for sm_90a that loads K/V by TMA;
its tensor maps of the pool are made at a view's first prefill call and cached,
so a prefill captured in a CUDA graph should follow one warm-up call on the same
pool view (otherwise that capture uses the ``mma.sync`` kernel). The CUDA C++
sources ship as package data (``cuda/*.cu``); the float64 definitions the kernels
are tested against live with the tests (``tests/kernels/support/reference.py``).

* ``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale, out, max_seq_len,
  min_seq_len, sliding_window, logits_soft_cap, k_scale, v_scale)``
* ``paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale, out,
  max_seq_len, sliding_window, logits_soft_cap, k_scale, v_scale)``
* ``write_kv(key, value, k_cache, v_cache, slot_mapping, *, k_scale, v_scale)``

``sliding_window`` W: the query at position p sees keys ``p - W < j <= p`` (its own
included; None: all up to p). ``logits_soft_cap`` c: scores become ``c * tanh(s / c)``.
An fp8 cache holds ``clamp(x / scale, -448, 448)`` (``write_kv`` quantizes) and
attention reads ``stored * k_scale`` / ``stored * v_scale``, with q and out in
float16, bfloat16 or float32; other caches take q in their dtype and scales of 1.0.

GPU calls never synchronize the host and can be captured in a CUDA graph
(after one warm-up call outside capture, which compiles the kernel).
``max_seq_len`` is an optional upper bound on ``seq_lens`` that the GPU path
uses to size split-KV; the CPU path ignores it. Decode's ``min_seq_len``, a lower bound,
lets the GPU planner run an even batch (within 1/8 of ``max_seq_len``) on a fixed grid of
splits instead of dividing the work by the lengths on the device.
"""

if __name__ == "kernels":  # this folder found as a top-level package: see _top_level
    from ._top_level import give_way

    give_way()
    __all__: list[str] = []
else:
    from .attention import paged_decode_attention, paged_prefill_attention
    from .kv_write import write_kv

    __all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]
