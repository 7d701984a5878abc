"""Paged attention on the CPU with Numba: decode and prefill are one kernel.

Decode is prefill with one query per sequence, so a single kernel serves
both: a work item is (sequence, KV head, tile of query tokens: 1 in decode,
``q_tile(group)`` in prefill), and it handles the tile's tokens times the
group's query heads (its *rows*) together. It walks the sequence's keys in
chunks of ``CHUNK``, each gathered from the item's blocks and converted to
float32 once, then used by every row of the item (GQA reads each block once
per KV head). Per chunk it does two small matrix products and one online-
softmax step per row (running max and sum, fp32), so no score matrix beyond
one chunk exists. Items run in parallel (``prange``), ordered so that every
thread's contiguous share carries about the same work (``work_items``).

Numba has no explicit SIMD, so the loops are shaped for LLVM's vectorizer:
the innermost loop runs over contiguous float32 with the other operand's
values hoisted out of it, and each pass handles 4 x 4 of them (4 keys x 4
dims, or 4 rows x 4 keys), so one vector load feeds 4 FMAs and the
accumulators are loaded and stored once per 4 FMAs instead of once per FMA.
Indices that LLVM cannot prove non-negative go in as ``np.uint64``: Numba
adds negative-index wraparound to signed ones, which blocks vectorization of
the loop they index in (and around the products' inner loops cost a third of
their speed, in per-pass overhead).

* Tiles of ``LANES`` rows or more (prefill): queries are transposed once per
  item (``[D, rows]``), scores come out as ``S^T [keys, rows]`` with the rows
  in the vector lanes, and the softmax (max, exp, sum) runs lane-wise over
  rows; rows whose tokens precede a whole chunk (the causal triangle) skip it.
* Fewer rows (decode: one token, rows = GQA group): lanes over rows would be
  mostly empty, so scores are dot products over head_dim, 4 rows x 2 keys per
  pass sharing their loads, and the softmax runs over the keys of a row.
* Both then accumulate ``acc[rows, D] += P @ V`` with head_dim innermost.
* Shared prefixes (decode without a window): sequences whose block tables begin
  with the same blocks see the same keys there (one prompt behind many
  requests). ``cpu_work.shared_prefixes`` finds them on the host; a first
  ``prange`` walks each group's common keys once per tile of about
  ``TILE_ROWS`` rows, every member's rows in the lanes (``_prefix_item``), and
  leaves each row's online-softmax state (max, denominator, accumulator) for
  the sequence's own item, which goes on from it at its first own key. The
  arithmetic per row is the same; what it saves is each sequence loading and
  converting the shared K/V, and the dot products' poorer use of the lanes.
* ``exp`` is a polynomial (Cephes ``expf``, within 3e-7 relative) in plain
  arithmetic so that it vectorizes: Numba's ``np.exp`` is a scalar libm call
  here (no SVML).

Sliding window, soft cap and scales: a row's keys are ``lo[r] <= j < lim[r]``;
with a window the item's key loop starts at its first token's first visible
key (invisible keys are never loaded), and in a chunk only the rows and keys
that some row sees are scored; keys before a row's window are masked to
``_BEFORE_WINDOW`` (rows in lanes) or skipped by the loop bounds (keys in
lanes), so the no-window path does no extra work per score. ``k_scale`` is
folded into the query scale and ``v_scale`` into the final ``1 / den``; the
soft cap is applied to a chunk's scores before its softmax step, with a
polynomial ``tanh`` (Cephes ``tanhf``) that vectorizes.

Storage types: NumPy has no bfloat16 or float8 and Numba no float16, so q
arrives as float32 or raw uint16 bits, and the caches as raw bytes that the
kernel reinterprets by ``kv_mode``: float32; uint16 bits converted when loaded
(bfloat16 by a 16-bit shift, float16 by moving its exponent and mantissa bits,
both exact, subnormals and infinities included); or float8_e4m3fn codes,
looked up in a 256-entry float32 table (exact). q's type is the cache's, or any
of float16 / bfloat16 / float32 with an fp8 cache (``q_mode``). Passing the
cache as bytes and q in both a uint16 and a float32 array (the unused one
empty) keeps the kernel to ONE Numba specialization for every dtype, which keeps
the first-call compile (and the test suite) short; so does keeping the item's
work in functions of their own rather than in the ``prange`` body (see
``_item``).

``fastmath`` leaves out ``nnan``/``ninf``: masked and empty rows rely on exact
-inf/zero handling being kept, everything else (reassociation for SIMD dot
products, contraction into FMA, approximate exp) is fair game.

Parts: ``cpu_numerics`` (float16 bits, ``exp``, ``tanh`` that vectorize), ``cpu_work``
(the work items and their order); the kernel is here.
"""

from __future__ import annotations

import numpy as np

from ._numba_compat import numba
from .cpu_numerics import FASTMATH, ONE, ZERO, bits_to_f32, f16_to_f32, fast_exp, fast_tanh

MODE_F32, MODE_F16, MODE_BF16, MODE_FP8 = 0, 1, 2, 3
CHUNK = 64  # keys per online-softmax step (a multiple of 4)
LANES = 16  # float32 lanes of one AVX-512 register: the row padding when rows are in lanes
_NEG = np.float32(-1e30)  # "no score yet"; finite so exp(_NEG - m) is a clean 0
_BEFORE_WINDOW = np.float32(-3e38)  # a masked score: below _NEG, so exp(it - m) is 0 even while m = _NEG


@numba.njit(inline="always", fastmath=FASTMATH)
def _load(src8, src16, src32, fp8_values, mode, base, n, dst, dst_bits, at):
    """Convert ``n`` cache elements starting at ``base`` into ``dst[at:at+n]`` (float32).

    (Slices first: indices that LLVM knows are >= 0 keep Numba's negative-index
    wraparound out of the loop, which would otherwise block vectorization.)
    """
    if mode == MODE_F32:
        s32, d32 = src32[base : base + n], dst[at : at + n]
        for i in range(n):
            d32[i] = s32[i]
    elif mode == MODE_F16:
        s16, d32 = src16[base : base + n], dst[at : at + n]
        for i in range(n):
            d32[i] = f16_to_f32(s16[i])
    elif mode == MODE_BF16:
        s16, dbits = src16[base : base + n], dst_bits[at : at + n]
        for i in range(n):
            dbits[i] = np.uint32(s16[i]) << np.uint32(16)
    else:
        s8, d32 = src8[base : base + n], dst[at : at + n]
        for i in range(n):
            d32[i] = fp8_values[np.uint64(s8[i])]


@numba.njit(inline="always", fastmath=FASTMATH)
def _load_chunk(src, mode, table, b, stride, h, bs, d, key0, n, n4, dst, dst_bits):
    """Keys ``key0 .. key0+n`` of (sequence b, head h) into flat ``dst [n4 * d]``, keys past n zeroed.

    ``src`` is ``(uint8, uint16, float32, fp8 values)``: the cache in the array of its
    storage type (the others empty) and the 256 float32 values of the fp8 codes.
    """
    src8, src16, src32, fp8_values = src
    key, row = key0, 0
    while row < n:
        j = key // bs
        off = key - j * bs
        cnt = min(bs - off, n - row)
        base = table[b, j] * stride + (h * bs + off) * d
        _load(src8, src16, src32, fp8_values, mode, base, cnt * d, dst, dst_bits, row * d)
        key += cnt
        row += cnt
    for i in range(n * d, n4 * d):
        dst[i] = ZERO


@numba.njit(inline="always", fastmath=FASTMATH)
def _add_4x4(out, w, a, k, x, lo, hi):
    """``out[a + j, u] += sum_m w[a + j, k + m] * x[k + m, u]`` for j, m < 4, lo <= u < hi.

    The register-blocked pass of both products: 16 values of ``w`` hoisted, ``u``
    innermost over contiguous float32, so one vector load of ``x`` feeds 4 FMAs and
    each row of ``out`` is loaded and stored once per 4.
    """
    a0, a1, a2, a3 = np.uint64(a), np.uint64(a + 1), np.uint64(a + 2), np.uint64(a + 3)
    k0, k1, k2, k3 = np.uint64(k), np.uint64(k + 1), np.uint64(k + 2), np.uint64(k + 3)
    w00, w01, w02, w03 = w[a0, k0], w[a0, k1], w[a0, k2], w[a0, k3]
    w10, w11, w12, w13 = w[a1, k0], w[a1, k1], w[a1, k2], w[a1, k3]
    w20, w21, w22, w23 = w[a2, k0], w[a2, k1], w[a2, k2], w[a2, k3]
    w30, w31, w32, w33 = w[a3, k0], w[a3, k1], w[a3, k2], w[a3, k3]
    for u in range(lo, hi):
        uu = np.uint64(u)
        x0, x1, x2, x3 = x[k0, uu], x[k1, uu], x[k2, uu], x[k3, uu]
        out[a0, uu] += w00 * x0 + w01 * x1 + w02 * x2 + w03 * x3
        out[a1, uu] += w10 * x0 + w11 * x1 + w12 * x2 + w13 * x3
        out[a2, uu] += w20 * x0 + w21 * x1 + w22 * x2 + w23 * x3
        out[a3, uu] += w30 * x0 + w31 * x1 + w32 * x2 + w33 * x3


@numba.njit(fastmath=FASTMATH, cache=True)
def _scores_rows_in_lanes(kb, qt, st, c0, nk, d, r0, r1):
    """``st[c, r] = sum_i kb[c, i] * qt[i, r]`` for keys c0 <= c < nk (multiples of 4), rows r0 <= r < r1.

    4 keys x 4 dims per pass (``_add_4x4``): 16 values of K hoisted, the row loop innermost.
    """
    d4 = d - d % 4
    for c in range(c0, nk, 4):
        c_0, c_1, c_2, c_3 = np.uint64(c), np.uint64(c + 1), np.uint64(c + 2), np.uint64(c + 3)
        for r in range(r0, r1):
            u = np.uint64(r)
            st[c_0, u] = ZERO
            st[c_1, u] = ZERO
            st[c_2, u] = ZERO
            st[c_3, u] = ZERO
        for i in range(0, d4, 4):
            _add_4x4(st, kb, c, i, qt, r0, r1)
        for i in range(d4, d):
            a0, a1, a2, a3 = kb[c_0, i], kb[c_1, i], kb[c_2, i], kb[c_3, i]
            for r in range(r0, r1):
                u = np.uint64(r)
                x0 = qt[i, u]
                st[c_0, u] += a0 * x0
                st[c_1, u] += a1 * x0
                st[c_2, u] += a2 * x0
                st[c_3, u] += a3 * x0


@numba.njit(fastmath=FASTMATH, cache=True)
def _soft_cap(s, i0, i1, j0, j1, cap):
    """``s[i, j] = cap * tanh(s[i, j] / cap)`` for i0 <= i < i1, j0 <= j < j1."""
    inv = ONE / cap
    for i in range(i0, i1):
        iu = np.uint64(i)
        for j in range(j0, j1):
            ju = np.uint64(j)
            s[iu, ju] = cap * fast_tanh(s[iu, ju] * inv)


@numba.njit(fastmath=FASTMATH, cache=True)
def _mask_before_window(st, nk, r0, rp, lo_row):
    """``st[c, r] = _BEFORE_WINDOW`` for keys c < lo_row[r] (rows in lanes, rows r0 <= r < rp).

    The softmax then needs no lower bound of its own: such a score neither raises the
    running max nor survives ``fast_exp`` (so the no-window path pays nothing for windows).
    """
    for c in range(nk):
        for r in range(r0, rp):
            u = np.uint64(r)
            st[c, u] = _BEFORE_WINDOW if c < lo_row[u] else st[c, u]


@numba.njit(fastmath=FASTMATH, cache=True)
def _softmax_rows_in_lanes(st, nk, rp, lim_row, m, den, corr):
    """One online-softmax step on ``st [nk, rp]`` (rows in lanes): scores → probabilities.

    Row r sees the chunk's keys before ``lim_row[r]`` (and none before its window, see
    ``_mask_before_window``); the others get probability 0.
    Sets ``corr[r]`` (the factor for the row's accumulator) and updates m, den.
    """
    for r in range(rp):
        corr[r] = m[r]  # the new max, for now
    for c in range(nk):
        for r in range(rp):
            x = st[c, r] if c < lim_row[r] else _NEG
            corr[r] = max(corr[r], x)
    for r in range(rp):
        mx = corr[r]
        corr[r] = fast_exp(m[r] - mx)
        m[r] = mx
        den[r] *= corr[r]
    for c in range(nk):
        for r in range(rp):
            p = fast_exp(st[c, r] - m[r])
            p = p if c < lim_row[r] else ZERO
            st[c, r] = p
            den[r] += p


@numba.njit(fastmath=FASTMATH, cache=True)
def _scores_keys_in_lanes(kb, qs, s, rows, d, lo_row, lim_row):
    """``s[r, c] = sum_i qs[r, i] * kb[c, i]`` for lo_row[r] <= c < lim_row[r] (or a few more).

    4 rows x 2 keys per pass (8 dot products sharing their loads), then 1 row x 4 keys.
    """
    rows4 = rows - rows % 4
    for r in range(0, rows4, 4):
        lo = min(lo_row[r], lo_row[r + 1], lo_row[r + 2], lo_row[r + 3]) // 2 * 2
        n = max(lim_row[r], lim_row[r + 1], lim_row[r + 2], lim_row[r + 3])
        r0, r1, r2, r3 = np.uint64(r), np.uint64(r + 1), np.uint64(r + 2), np.uint64(r + 3)
        for c in range(lo, n, 2):
            ca, cb = np.uint64(c), np.uint64(c + 1)
            t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = ZERO
            for i in range(d):
                ka, kb_ = kb[ca, i], kb[cb, i]
                q0, q1, q2, q3 = qs[r0, i], qs[r1, i], qs[r2, i], qs[r3, i]
                t0 += q0 * ka
                t1 += q1 * ka
                t2 += q2 * ka
                t3 += q3 * ka
                u0 += q0 * kb_
                u1 += q1 * kb_
                u2 += q2 * kb_
                u3 += q3 * kb_
            s[r0, ca], s[r1, ca], s[r2, ca], s[r3, ca] = t0, t1, t2, t3
            s[r0, cb], s[r1, cb], s[r2, cb], s[r3, cb] = u0, u1, u2, u3
    for r in range(rows4, rows):
        ru = np.uint64(r)
        for c in range(lo_row[r] // 4 * 4, lim_row[r], 4):
            ca, cb, cc, cd = np.uint64(c), np.uint64(c + 1), np.uint64(c + 2), np.uint64(c + 3)
            t0 = t1 = t2 = t3 = ZERO
            for i in range(d):
                q0 = qs[ru, i]
                t0 += q0 * kb[ca, i]
                t1 += q0 * kb[cb, i]
                t2 += q0 * kb[cc, i]
                t3 += q0 * kb[cd, i]
            s[ru, ca], s[ru, cb], s[ru, cc], s[ru, cd] = t0, t1, t2, t3


@numba.njit(fastmath=FASTMATH, cache=True)
def _softmax_keys_in_lanes(s, rows, nk, lo_row, lim_row, m, den, corr):
    """One online-softmax step on ``s [rows, nk]`` (keys in lanes); row r sees keys lo_row[r] <= c < lim_row[r]."""
    for r in range(rows):
        lo, n = lo_row[r], lim_row[r]
        row = s[r]
        seen = row[lo:n]  # (a slice: its indices start at 0, which LLVM sees are >= 0)
        mx = m[r]
        for c in range(n - lo):
            mx = max(mx, seen[c])
        corr[r] = fast_exp(m[r] - mx)
        m[r] = mx
        tot = ZERO
        for c in range(n - lo):
            p = fast_exp(seen[c] - mx)
            seen[c] = p
            tot += p
        for c in range(lo):
            row[c] = ZERO
        for c in range(n, nk):
            row[np.uint64(c)] = ZERO
        den[r] = den[r] * corr[r] + tot


@numba.njit(fastmath=FASTMATH, cache=True)
def _accumulate(p, vb, acc, rows, lo_row, nk_row, d):
    """``acc[r, :] += sum_c p[r, c] * vb[c, :]``, row r over keys lo_row[r] <= c < nk_row[r], widened to 4.

    (The probabilities outside a row's keys are 0 from lo_row rounded down to a
    multiple of 4 up to the chunk's multiple of 4.)
    4 rows x 4 keys per pass (``_add_4x4``): 16 probabilities hoisted, head_dim innermost.
    """
    rows4 = rows - rows % 4
    for r in range(0, rows4, 4):
        lo = min(lo_row[r], lo_row[r + 1], lo_row[r + 2], lo_row[r + 3]) // 4 * 4
        n = max(nk_row[r], nk_row[r + 1], nk_row[r + 2], nk_row[r + 3])
        for c in range(lo, n, 4):
            _add_4x4(acc, p, r, c, vb, 0, d)
    for r in range(rows4, rows):
        ru = np.uint64(r)
        for c in range(lo_row[r] // 4 * 4, nk_row[r], 4):
            c_0, c_1, c_2, c_3 = np.uint64(c), np.uint64(c + 1), np.uint64(c + 2), np.uint64(c + 3)
            p00, p01, p02, p03 = p[ru, c_0], p[ru, c_1], p[ru, c_2], p[ru, c_3]
            for i in range(d):
                acc[ru, i] += p00 * vb[c_0, i] + p01 * vb[c_1, i] + p02 * vb[c_2, i] + p03 * vb[c_3, i]


@numba.njit(inline="always", fastmath=FASTMATH)
def _query(q16, q32, q_mode, t, hq, i):
    """``q[t, hq, i]`` as float32, from q's storage type (``q_mode``)."""
    if q_mode == MODE_F32:
        return q32[t, hq, i]
    if q_mode == MODE_F16:
        return f16_to_f32(q16[t, hq, i])
    return bits_to_f32(np.uint32(q16[t, hq, i]) << np.uint32(16))


@numba.njit(inline="always")
def _chunk_buffers(d):
    """A chunk of K and of V in float32 (flat, their uint32 bits, ``[CHUNK, D]``)."""
    kflat = np.empty(CHUNK * d, dtype=np.float32)
    vflat = np.empty(CHUNK * d, dtype=np.float32)
    kbits, vbits = kflat.view(np.uint32), vflat.view(np.uint32)
    return kflat, vflat, kbits, vbits, kflat.reshape((CHUNK, d)), vflat.reshape((CHUNK, d))


@numba.njit(fastmath=FASTMATH, cache=True)
def _rescale(acc, corr, rows, d):
    """``acc[r, :] *= corr[r]``: the accumulator follows its row's new running max."""
    for r in range(rows):
        c = corr[r]
        if c != ONE:
            for i in range(d):
                acc[r, i] *= c


@numba.njit(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)  # other threads (the heartbeat) run meanwhile
def paged_attention_cpu(
    q16, q32, q_mode, k_bytes, v_bytes, kv_mode, fp8_values, k_stride, v_stride, num_kv_heads, block_size,
    block_tables, seq_lens, cu_seqlens, items, qk_scale, soft_cap, window, v_scale, out,
    prefix_items, members, prefix_keys, state_m, state_den, state_acc,
):  # fmt: skip
    """``out[T, Hq, D]`` (float32) for every work item ``(seq, kv_head, tok0, ntok)``.

    ``q16/q32`` is ``q [T, Hq, D]`` in its storage type (``q_mode``; the other one empty).
    ``k_bytes`` (and v) is a flat byte view of one layer's cache from block 0, block ``i``
    at ``i * k_stride`` elements of its storage type (``kv_mode``; fp8 codes are looked up
    in ``fp8_values``, their 256 float32 values). ``qk_scale`` is the softmax scale times
    ``k_scale``; ``soft_cap`` 0 and ``window`` 0 mean none; ``v_scale`` multiplies the output.
    (Bytes, reinterpreted here: every argument costs the dispatcher a type lookup per call.)

    Shared prefixes (decode without a window; all empty otherwise): each row
    ``(first, count, kv_head, keys)`` of ``prefix_items`` is the decode sequences
    ``members[first:first+count]``, whose block tables begin with the same blocks, over
    their common keys ``0 .. keys``: their rows together, rows in lanes
    (``_prefix_item``), into ``state_*`` ``[T, Hq(, D)]``; then sequence b's own work
    items start from that state at key ``prefix_keys[b]``.
    """
    k_src = _typed_views(k_bytes, kv_mode, fp8_values)
    v_src = _typed_views(v_bytes, kv_mode, fp8_values)
    for w in numba.prange(prefix_items.shape[0]):
        first, count = prefix_items[w, 0], prefix_items[w, 1]
        _prefix_item(
            q16, q32, q_mode, k_src, v_src, kv_mode, k_stride, v_stride, num_kv_heads, block_size, block_tables,
            cu_seqlens, members[first : first + count], prefix_items[w, 2], prefix_items[w, 3], qk_scale, soft_cap,
            state_m, state_den, state_acc,
        )  # fmt: skip
    for w in numba.prange(items.shape[0]):
        _item(
            q16, q32, q_mode, k_src, v_src, kv_mode, k_stride, v_stride, num_kv_heads, block_size,
            block_tables, seq_lens, cu_seqlens, items[w, 0], items[w, 1], items[w, 2], items[w, 3],
            qk_scale, soft_cap, window, v_scale, out, prefix_keys, state_m, state_den, state_acc,
        )  # fmt: skip


@numba.njit(fastmath=FASTMATH, cache=True)
def _prefix_item(
    q16, q32, q_mode, k_src, v_src, kv_mode, k_stride, v_stride, num_kv_heads, block_size, block_tables,
    cu_seqlens, members, h, n_keys, qk_scale, soft_cap, state_m, state_den, state_acc,
):  # fmt: skip
    """Keys ``0 .. n_keys`` of KV head h for the decode sequences ``members`` (their tables share
    those keys' blocks, read through the first member's): one online softmax over every member's
    rows at once, rows in lanes, each chunk loaded once for all of them. Leaves each row's state
    (running max, denominator, unnormalized accumulator) in ``state_*`` for ``_item`` to go on from.
    """
    d = state_acc.shape[2]
    group = state_acc.shape[1] // num_kv_heads
    rows = members.shape[0] * group
    rp = (rows + LANES - 1) // LANES * LANES
    m = np.full(rp, _NEG, dtype=np.float32)
    den = np.zeros(rp, dtype=np.float32)
    corr = np.empty(rp, dtype=np.float32)
    lo_row = np.zeros(rp, dtype=np.int64)  # every row sees every key of a chunk, padding rows none
    lim_row = np.zeros(rp, dtype=np.int64)
    acc = np.zeros((rows, d), dtype=np.float32)
    qs = np.zeros((d, rp), dtype=np.float32)
    for j in range(members.shape[0]):
        t = cu_seqlens[members[j]]
        for g in range(group):
            for i in range(d):
                qs[i, j * group + g] = _query(q16, q32, q_mode, t, h * group + g, i) * qk_scale
    kflat, vflat, kbits, vbits, kbuf, vbuf = _chunk_buffers(d)
    s = np.zeros((CHUNK, rp), dtype=np.float32)
    b = members[0]
    for key0 in range(0, n_keys, CHUNK):
        n = min(CHUNK, n_keys - key0)
        n4 = (n + 3) // 4 * 4
        _load_chunk(k_src, kv_mode, block_tables, b, k_stride, h, block_size, d, key0, n, n4, kflat, kbits)
        _load_chunk(v_src, kv_mode, block_tables, b, v_stride, h, block_size, d, key0, n, n4, vflat, vbits)
        for r in range(rows):
            lim_row[r] = n
        _scores_rows_in_lanes(kbuf, qs, s, 0, n4, d, 0, rp)
        if soft_cap > 0:
            _soft_cap(s, 0, n4, 0, rp, soft_cap)
        _softmax_rows_in_lanes(s, n4, rp, lim_row, m, den, corr)
        _rescale(acc, corr, rows, d)
        _accumulate(s.T, vbuf, acc, rows, lo_row, lim_row, d)
    for j in range(members.shape[0]):
        t = cu_seqlens[members[j]]
        for g in range(group):
            r, hq = j * group + g, h * group + g
            state_m[t, hq] = m[r]
            state_den[t, hq] = den[r]
            for i in range(d):
                state_acc[t, hq, i] = acc[r, i]


@numba.njit(cache=True)
def _typed_views(raw, mode, fp8_values):
    """``(uint8, uint16, float32, fp8_values)`` views of cache bytes, the ones not of ``mode`` empty."""
    none = np.empty(0, np.uint8)
    wide = mode == MODE_F16 or mode == MODE_BF16
    return (
        raw if mode == MODE_FP8 else none,
        (raw if wide else none).view(np.uint16),
        (raw if mode == MODE_F32 else none).view(np.float32),
        fp8_values,
    )


@numba.njit(fastmath=FASTMATH, cache=True)
def _item(
    q16, q32, q_mode, k_src, v_src, kv_mode, k_stride, v_stride, num_kv_heads, block_size,
    block_tables, seq_lens, cu_seqlens, b, h, tok0, ntok, qk_scale, soft_cap, window, v_scale, out,
    prefix_keys, state_m, state_den, state_acc,
):  # fmt: skip
    """One work item: sequence b, KV head h, query tokens tok0 .. tok0+ntok of the sequence.

    A decode sequence with ``prefix_keys[b] > 0`` starts at that key from the state
    that ``_prefix_item`` left for its rows.

    (A function of its own, not the body of the ``prange``: Numba's parallel passes
    analyse the loop body, and a large one multiplies the first-call compile time.)
    """
    d = out.shape[2]
    group = out.shape[1] // num_kv_heads
    bs = block_size
    q0 = cu_seqlens[b]
    q_len = cu_seqlens[b + 1] - q0
    kv_len = seq_lens[b]
    first_pos = kv_len - q_len  # position of this sequence's query 0
    tile_pos = first_pos + tok0  # position of the item's first query
    rows = ntok * group
    lanes = rows >= LANES  # rows in vector lanes (prefill tiles) or keys (decode)
    rp = (rows + LANES - 1) // LANES * LANES if lanes else rows
    m = np.full(rp, _NEG, dtype=np.float32)
    den = np.zeros(rp, dtype=np.float32)
    corr = np.empty(rp, dtype=np.float32)
    lo = np.zeros(rp, dtype=np.int64)  # row r sees keys lo[r] <= j < lim[r]; padding rows none
    lim = np.zeros(rp, dtype=np.int64)
    lo_row = np.zeros(rp, dtype=np.int64)  # the same, within the current chunk
    lim_row = np.zeros(rp, dtype=np.int64)
    acc = np.zeros((rows, d), dtype=np.float32)
    # scaled queries: [D, rp] with rows in lanes, else [rows, D]
    qs = np.zeros((d, rp), dtype=np.float32) if lanes else np.empty((rows, d), dtype=np.float32)
    for tt in range(ntok):
        for g in range(group):
            r = tt * group + g
            lim[r] = tile_pos + tt + 1
            lo[r] = max(lim[r] - window, 0) if window > 0 else 0
            t, hq = q0 + tok0 + tt, h * group + g
            for i in range(d):
                x = _query(q16, q32, q_mode, t, hq, i) * qk_scale
                if lanes:
                    qs[i, r] = x
                else:
                    qs[r, i] = x
    kflat, vflat, kbits, vbits, kbuf, vbuf = _chunk_buffers(d)
    s = np.zeros((CHUNK, rp) if lanes else (rp, CHUNK), dtype=np.float32)
    hi = min(kv_len, tile_pos + ntok)  # keys the last token of the tile sees
    first_key = max(tile_pos + 1 - window, 0) if window > 0 else 0  # the first token's first key
    if prefix_keys.shape[0] > 0 and prefix_keys[b] > 0:  # decode: one token, rows = group
        first_key = prefix_keys[b]
        for g in range(group):
            m[g], den[g] = state_m[q0, h * group + g], state_den[q0, h * group + g]
            for i in range(d):
                acc[g, i] = state_acc[q0, h * group + g, i]
    for key0 in range(first_key, max(hi, 0), CHUNK):
        n = min(CHUNK, hi - key0)
        n4 = (n + 3) // 4 * 4
        _load_chunk(k_src, kv_mode, block_tables, b, k_stride, h, bs, d, key0, n, n4, kflat, kbits)
        _load_chunk(v_src, kv_mode, block_tables, b, v_stride, h, bs, d, key0, n, n4, vflat, vbits)
        for r in range(rp):
            lo_row[r] = min(max(lo[r] - key0, 0), n)
            lim_row[r] = min(max(lim[r] - key0, 0), n)
        if lanes:
            # rows (token-major) whose token comes before every key of the chunk see none of
            # it, nor do those whose window starts after it: skip their scores (whole
            # vectors; their stale scores are masked below), and the keys before the
            # window of the first row scored
            r0 = min(max(key0 - tile_pos, 0) * group // LANES * LANES, rp)
            r1 = rp
            if window > 0:
                r1 = min(max(key0 + n - 1 - tile_pos + window, 0) * group, rp)
                r1 = (r1 + LANES - 1) // LANES * LANES
            c0 = lo_row[r0] // 4 * 4 if r0 < r1 else 0
            _scores_rows_in_lanes(kbuf, qs, s, c0, n4, d, r0, r1)
            if soft_cap > 0:
                _soft_cap(s, c0, n4, r0, r1, soft_cap)
            if window > 0:
                _mask_before_window(s, n4, r0, rp, lo_row)
            _softmax_rows_in_lanes(s, n4, rp, lim_row, m, den, corr)
        else:
            _scores_keys_in_lanes(kbuf, qs, s, rows, d, lo_row, lim_row)
            if soft_cap > 0:
                _soft_cap(s, 0, rows, 0, n4, soft_cap)
            _softmax_keys_in_lanes(s, rows, n4, lo_row, lim_row, m, den, corr)
        _rescale(acc, corr, rows, d)
        if lanes:
            _accumulate(s.T, vbuf, acc, rows, lo_row, lim_row, d)
        else:
            _accumulate(s, vbuf, acc, rows, lo_row, lim_row, d)
    for tt in range(ntok):
        for g in range(group):
            r = tt * group + g
            inv = v_scale / den[r] if den[r] > 0 else ZERO
            for i in range(d):
                out[q0 + tok0 + tt, h * group + g, i] = acc[r, i] * inv
