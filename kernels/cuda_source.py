"""CUDA C++ source of the GPU kernels (compiled at first use by CuPy/NVRTC).

Kept as a Python string so that it ships inside the package with no
package-data configuration. Three kernels:

``paged_attention_kernel<DT, D, WKV>``
    Decode and prefill in one kernel, on tensor cores (``mma.sync.m16n8k16``,
    fp32 accumulation). A CTA of 4 warps owns one (sequence, query tile, KV
    head, KV split) work item. The query tile's rows are (token, query head)
    pairs of one GQA group, so every KV block is read once per KV head for
    all query heads that share it. ``WKV`` says how the 4 warps divide the
    item: 4 (decode) = all warps share the same 16 rows and split the KV
    range between them; 1 (prefill) = each warp owns 16 rows and walks the
    whole (causal) KV range; 2 = in between (decode when shared memory is
    short: float32, head_dim 256). Warps meet once, at the end, in shared
    memory.

    Memory pipeline: K and V tiles (16 keys) stream into shared memory with
    ``cp.async`` through a ring of ``NS`` stages per group of warps that
    share a key range (one ring per warp in decode, one ring for the CTA in
    prefill), so ``NS - 1`` tiles are always in flight and loads cost no
    registers. Each 16-byte chunk is stored at a swizzled position so that
    the fragment reads below are free of shared-memory bank conflicts
    (checked by arithmetic for head_dim 64/128/256; see NOTES-kernels.md
    for what was measured).

    MMA mapping (lane = 4 * g + t; S = scores, P = probabilities):
      S[16 rows x 8 tokens] += Q[16 rows x 16 dims] * K^T[16 dims x 8 tokens]
      O[16 rows x 8 dims]   += P[16 rows x 16 tokens] * V[16 tokens x 8 dims]
    A dot product does not care about the order of its terms, so a lane
    reads 8 *consecutive* dims (one 16-byte chunk) of Q and of K and uses them
    as its fragment elements for two k-steps. For V the token axis is the
    reduction axis, so a lane reads 8 consecutive dims of two token rows and
    interleaves them with ``prmt`` into (token, token+1) pairs; the output
    dims then come out permuted, which the epilogue undoes. The S
    accumulator fragment is exactly P's A-operand layout, so P never leaves
    registers.

    float32 caches run the same path with each operand split into two
    bfloat16 terms (hi + lo, three MMAs per product): about 16 mantissa bits.

``merge_splits_kernel<DT, D>``
    Split-KV: one warp per (token, head) combines the per-split (normalized
    output, log2-sum-exp) partials. Only launched when ``num_splits > 1``.

``write_kv_kernel``
    Reshape-and-cache by slot mapping; dtype-blind 16-byte copies.
"""

NUM_STAGES = 3  # cp.async ring depth; the host sizes shared memory with it

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define NEG_INF (__int_as_float(0xff800000))
#define FULL_MASK 0xffffffffu
#define NS @NUM_STAGES@

// DT: 0 = float32, 1 = float16, 2 = bfloat16 (16-bit types travel as raw bits).
template <int DT> struct Store { typedef u16 T; };
template <> struct Store<0> { typedef float T; };

// BEGIN PRIMITIVES (inline PTX; cuda_emulator.py swaps this region for host code)
__device__ __forceinline__ uint4 ld16(const void* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// 16 bytes global -> shared without registers; ok == false writes zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
// Barrier among the `nthreads` threads (whole warps) that share one cp.async ring.
__device__ __forceinline__ void group_sync(int id, int nthreads) {
    if (nthreads == 32) __syncwarp();
    else asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(nthreads) : "memory");
}

// Two floats -> one register of two 16-bit values, `lo` in the low half.
// DT 0 (the float32 split) uses bfloat16, which keeps float32's range.
template <int DT> __device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (DT == 1) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float bf16_low(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_high(u32 x) { return __uint_as_float(x & 0xffff0000u); }

template <int DT> __device__ __forceinline__ typename Store<DT>::T from_f32(float x) {
    if constexpr (DT == 0) {
        return x;
    } else {
        u16 h;
        if constexpr (DT == 1) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        else asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    }
}

// c += A * B for one m16n8k16 tile; float32 accumulators.
template <int DT>
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (DT == 1)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// END PRIMITIVES

// Eight floats -> bfloat16 hi/lo pairs: hi + lo carries ~16 mantissa bits.
__device__ __forceinline__ void split8(const float (&f)[8], u32 (&hi)[4], u32 (&lo)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        hi[k] = pack2<2>(f[2 * k], f[2 * k + 1]);
        lo[k] = pack2<2>(f[2 * k] - bf16_low(hi[k]), f[2 * k + 1] - bf16_high(hi[k]));
    }
}

// Eight consecutive elements at p (global) as four registers of 16-bit pairs
// (element 2k in the low half of reg k); ok == false gives zeros, no access.
template <int DT>
__device__ __forceinline__ void load8(const typename Store<DT>::T* p, bool ok, u32 (&hi)[4], u32 (&lo)[4]) {
    if constexpr (DT == 0) {
        uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
        if (ok) { a = ld16(p); b = ld16(p + 4); }
        const float f[8] = {__uint_as_float(a.x), __uint_as_float(a.y), __uint_as_float(a.z), __uint_as_float(a.w),
                            __uint_as_float(b.x), __uint_as_float(b.y), __uint_as_float(b.z), __uint_as_float(b.w)};
        split8(f, hi, lo);
    } else {
        uint4 a = make_uint4(0, 0, 0, 0);
        if (ok) a = ld16(p);
        hi[0] = a.x; hi[1] = a.y; hi[2] = a.z; hi[3] = a.w;
    }
}

// Shared-memory tile of 16 rows x D elements; 16-byte chunk j of row r sits at
// chunk j ^ swz(r). Reads of K (rows 2q, 2q+1 x 4 chunks per 8 lanes) and of V
// (rows 2t + {0,2,4,6} x 2 chunks per 8 lanes) then hit 8 distinct bank groups.
__device__ __forceinline__ int swz(int r) { return (r & 6) ^ ((r & 1) << 2); }

template <int DT, int D>
__device__ __forceinline__ void read8(const unsigned char* tile, int r, int e, u32 (&hi)[4], u32 (&lo)[4]) {
    constexpr int ES = DT == 0 ? 4 : 2;
    const int j = (e * ES) >> 4;
    const unsigned char* row = tile + r * (D * ES);
    const uint4 a = *reinterpret_cast<const uint4*>(row + ((j ^ swz(r)) << 4));
    if constexpr (DT == 0) {
        const uint4 b = *reinterpret_cast<const uint4*>(row + (((j + 1) ^ swz(r)) << 4));
        const float f[8] = {__uint_as_float(a.x), __uint_as_float(a.y), __uint_as_float(a.z), __uint_as_float(a.w),
                            __uint_as_float(b.x), __uint_as_float(b.y), __uint_as_float(b.z), __uint_as_float(b.w)};
        split8(f, hi, lo);
    } else {
        hi[0] = a.x; hi[1] = a.y; hi[2] = a.z; hi[3] = a.w;
    }
}

// Which sequence and query tile CTA x works on. Decode (tile_cum == nullptr):
// CTA x is sequence x. Prefill: tile_cum[b] = query tiles of sequences 0..b.
__device__ __forceinline__ bool locate_tile(const int* tile_cum, int num_seqs, int x, int& b, int& tile) {
    if (tile_cum == nullptr) { b = x; tile = 0; return true; }
    int lo = 0, hi = num_seqs;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (tile_cum[mid] > x) hi = mid; else lo = mid + 1;
    }
    if (lo >= num_seqs) return false;
    b = lo;
    tile = x - (b > 0 ? tile_cum[b - 1] : 0);
    return true;
}

template <int DT, int D, int WKV>
__global__ void __launch_bounds__(128) paged_attention_kernel(
    const typename Store<DT>::T* __restrict__ q, i64 q_stride_t, i64 q_stride_h,
    const typename Store<DT>::T* __restrict__ k_cache, const typename Store<DT>::T* __restrict__ v_cache,
    i64 k_stride, i64 v_stride, int num_blocks, int num_kv_heads, int bs_log2,
    const int* __restrict__ block_tables, i64 bt_stride, int max_blocks,
    const int* __restrict__ seq_lens, const int* __restrict__ cu_seqlens, const int* __restrict__ tile_cum,
    int num_seqs, int group, float scale_log2, int chunk, int num_splits,
    typename Store<DT>::T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse)
{
    using T = typename Store<DT>::T;
    constexpr int warps_kv = WKV;              // warps splitting one row tile's keys (4 decode, 1 prefill)
    constexpr int warps_row = 4 / WKV;         // warps sharing one cp.async ring
    constexpr int GT = 32 * warps_row;         // threads that fill a ring
    constexpr int ES = DT == 0 ? 4 : 2;
    constexpr int RB = D * ES;                 // bytes per K/V row
    constexpr int CPR = RB / 16;               // 16-byte chunks per row
    constexpr int SB = 32 * RB;                // one stage: 16 K rows then 16 V rows
    constexpr int NQ = D / 32;                 // Q/K 8-element chunks per lane (two k-steps each)
    constexpr int NV = D / 64;                 // 64-dim V chunks (eight n-tiles each)
    constexpr int SROW = D + 1;                // padded epilogue row
    extern __shared__ uint4 smem4[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(smem4);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int kvh = blockIdx.y, split = blockIdx.z;

    int b, tile;
    if (!locate_tile(tile_cum, num_seqs, blockIdx.x, b, tile)) return;
    const int tq = (16 * warps_row) / group;                 // query tokens per CTA tile
    const int q_begin = cu_seqlens ? cu_seqlens[b] : b;
    const int q_len = cu_seqlens ? cu_seqlens[b + 1] - q_begin : 1;
    const int tok0 = tile * tq;
    const int ntok = min(tq, q_len - tok0);
    if (ntok <= 0) return;
    const int seq_len = seq_lens[b];
    const int kv_len = min(seq_len, max_blocks << bs_log2);  // never read past the table
    const int first_pos = seq_len - q_len;                   // position of query 0
    const int cta_hi = min(kv_len, first_pos + tok0 + ntok); // keys the tile's last token sees
    const int kv_begin = split * chunk;
    if (kv_begin >= cta_hi && num_splits > 1) return;        // merge skips this split
    const int kv_end = split == num_splits - 1 ? cta_hi : min(cta_hi, kv_begin + chunk);

    // This lane's two rows: r0 = 16 * wr + g and r0 + 8; row r = (token r / group, head r % group).
    const int wr = warp / warps_kv, wk = warp - wr * warps_kv;
    int lim[2];                                              // row attends to positions < lim
    u32 qh[2][NQ][4], ql[2][NQ][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 16 * wr + g + 8 * i;
        const int tok = r / group, head = r - tok * group;
        const bool valid = r < ntok * group;
        lim[i] = valid ? min(first_pos + tok0 + tok + 1, kv_end) : 0;
        const T* qp = q + (i64)(q_begin + tok0 + tok) * q_stride_t + (i64)(kvh * group + head) * q_stride_h + 8 * t4;
#pragma unroll
        for (int c = 0; c < NQ; ++c) load8<DT>(qp + 32 * c, valid, qh[i][c], ql[i][c]);
    }
    const int w_hi = __reduce_max_sync(FULL_MASK, max(lim[0], lim[1]));

    float acc[8 * NV][4];
#pragma unroll
    for (int n = 0; n < 8 * NV; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};

    // The warps with the same wk share one ring and walk keys kv_begin + 16 (wk + warps_kv k).
    const int* bt = block_tables + (i64)b * bt_stride;
    const int bs_mask = (1 << bs_log2) - 1;
    const int head_row = kvh << bs_log2;                     // first row of this KV head in a block
    const int step = 16 * warps_kv;
    const int first = kv_begin + 16 * wk;
    const int ntiles = kv_end > first ? (kv_end - first + step - 1) / step : 0;
    unsigned char* ring = smem + wk * (NS * SB);

    // Ring filling. A stage holds 32 rows (K tokens 0-15, then V tokens 0-15) of CPR
    // 16-byte chunks. TPR threads share a row per pass (at least 2, so a warp reads
    // whole 32-byte sectors), a pass covers RPP rows, and each thread keeps the same
    // rows and chunk column for every tile: its chunk addresses are constant offsets
    // from one row pointer per row group, its swizzle one XOR.
    constexpr int TPR = GT >= 64 ? GT / 32 : 2;
    constexpr int RPP = GT / TPR;              // rows per pass: 16 or 32
    constexpr int RG = 32 / RPP;               // passes over rows
    constexpr int CG = CPR / TPR;              // chunks per row and thread
    static_assert(CPR % TPR == 0 && RPP % 16 == 0, "the ring's threads must tile a stage");
    const int gtid = 32 * wr + lane;
    const int trow = gtid / TPR, tcol = gtid % TPR;
    int rr_of[RG], xr_of[RG];
#pragma unroll
    for (int a = 0; a < RG; ++a) {
        rr_of[a] = a * RPP + trow;                           // stage row: < 16 K, else V
        xr_of[a] = tcol ^ swz(rr_of[a] & 15);
    }

    // Stream tile k (K and V, 16 keys each) into its stage; zeros past the sequence
    // or for a block id outside the pool.
    auto issue = [&](int k) {
        const int base = first + step * k;
        unsigned char* st = ring + (k % NS) * SB;
#pragma unroll
        for (int a = 0; a < RG; ++a) {
            const int rr = rr_of[a], r = rr & 15;
            const int pos = base + r;
            int id = -1;
            if (pos < kv_len) id = bt[pos >> bs_log2];
            const bool ok = pos < kv_len && (unsigned)id < (unsigned)num_blocks;
            const T* cache = rr < 16 ? k_cache : v_cache;
            const i64 stride = rr < 16 ? k_stride : v_stride;
            const unsigned char* src = reinterpret_cast<const unsigned char*>(
                cache + (ok ? (i64)id * stride + (i64)(head_row + (pos & bs_mask)) * D : 0)) + 16 * tcol;
            unsigned char* dst = st + rr * RB;
#pragma unroll
            for (int c = 0; c < CG; ++c)
                cp_async16(dst + (((c * TPR) ^ xr_of[a]) << 4), src + 16 * TPR * c, ok);
        }
    };

#pragma unroll
    for (int k = 0; k < NS - 1; ++k) {
        if (k < ntiles) issue(k);
        cp_async_commit();
    }
    for (int k = 0; k < ntiles; ++k) {
        cp_async_wait<NS - 2>();                             // this thread's chunks of tile k landed
        group_sync(1 + wk, GT);                              // everyone's did; stage k-1 is free
        if (k + NS - 1 < ntiles) issue(k + NS - 1);
        cp_async_commit();
        const int base = first + step * k;
        if (base >= w_hi) continue;                          // no row of this warp needs these keys
        const unsigned char* kt = ring + (k % NS) * SB;
        const unsigned char* vt = kt + 16 * RB;

        // S = Q K^T: n-tile nt covers tokens 8 nt .. 8 nt + 7; this lane reads token 8 nt + g,
        // dims 32 c + 8 t4 .. + 7 (fragment elements of k-steps 2c and 2c + 1).
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int c = 0; c < NQ; ++c) {
                u32 kh[4], kl[4];
                read8<DT, D>(kt, 8 * nt + g, 32 * c + 8 * t4, kh, kl);
                mma<DT>(s[nt], qh[0][c][0], qh[1][c][0], qh[0][c][1], qh[1][c][1], kh[0], kh[1]);
                mma<DT>(s[nt], qh[0][c][2], qh[1][c][2], qh[0][c][3], qh[1][c][3], kh[2], kh[3]);
                if constexpr (DT == 0) {
                    mma<DT>(s[nt], qh[0][c][0], qh[1][c][0], qh[0][c][1], qh[1][c][1], kl[0], kl[1]);
                    mma<DT>(s[nt], qh[0][c][2], qh[1][c][2], qh[0][c][3], qh[1][c][3], kl[2], kl[3]);
                    mma<DT>(s[nt], ql[0][c][0], ql[1][c][0], ql[0][c][1], ql[1][c][1], kh[0], kh[1]);
                    mma<DT>(s[nt], ql[0][c][2], ql[1][c][2], ql[0][c][3], ql[1][c][3], kh[2], kh[3]);
                }
            }
        }

        // Online softmax in the log2 domain. s[nt][e] is (row r0, token 8 nt + 2 t4 + e),
        // s[nt][2 + e] is (row r0 + 8, same token); a row's 16 scores live on its 4 lanes.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const int pos = base + 8 * nt + 2 * t4 + (e & 1);
                const float x = pos < lim[i] ? s[nt][e] * scale_log2 : NEG_INF;
                s[nt][e] = x;
                mx[i] = fmaxf(mx[i], x);
            }
        float corr[2], msafe[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
            const float m_new = fmaxf(m_run[i], mx[i]);
            msafe[i] = m_new == NEG_INF ? 0.f : m_new;       // no key yet: keep exp2 finite
            corr[i] = m_new == m_run[i] ? 1.f : exp2f(m_run[i] - msafe[i]);
            m_run[i] = m_new;
            l_run[i] *= corr[i];
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - msafe[e >> 1]);
                l_run[e >> 1] += s[nt][e];
            }
        if (__any_sync(FULL_MASK, corr[0] != 1.f || corr[1] != 1.f)) {   // rare once the max settles
#pragma unroll
            for (int n = 0; n < 8 * NV; ++n) {
                acc[n][0] *= corr[0]; acc[n][1] *= corr[0];
                acc[n][2] *= corr[1]; acc[n][3] *= corr[1];
            }
        }
        // P as the A operand: (row r0, tokens 2t4, 2t4+1), (r0+8, same), then tokens + 8.
        u32 ph[4], pl[4];
        ph[0] = pack2<DT>(s[0][0], s[0][1]); ph[1] = pack2<DT>(s[0][2], s[0][3]);
        ph[2] = pack2<DT>(s[1][0], s[1][1]); ph[3] = pack2<DT>(s[1][2], s[1][3]);
        if constexpr (DT == 0) {
            pl[0] = pack2<2>(s[0][0] - bf16_low(ph[0]), s[0][1] - bf16_high(ph[0]));
            pl[1] = pack2<2>(s[0][2] - bf16_low(ph[1]), s[0][3] - bf16_high(ph[1]));
            pl[2] = pack2<2>(s[1][0] - bf16_low(ph[2]), s[1][1] - bf16_high(ph[2]));
            pl[3] = pack2<2>(s[1][2] - bf16_low(ph[3]), s[1][3] - bf16_high(ph[3]));
        }
        // O += P V. This lane reads V tokens 2t4, 2t4+1, 8+2t4, 9+2t4 at dims 64c + 8g .. + 7;
        // pairing two token rows gives the B operand of n-tile (c, j), output dim 64c + 8g + j.
#pragma unroll
        for (int c = 0; c < NV; ++c) {
            u32 vh[4][4], vl[4][4];
#pragma unroll
            for (int rr = 0; rr < 4; ++rr)
                read8<DT, D>(vt, 8 * (rr >> 1) + 2 * t4 + (rr & 1), 64 * c + 8 * g, vh[rr], vl[rr]);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 sel = (j & 1) ? 0x7632u : 0x5410u;
                const int k2 = j >> 1;
                const u32 b0 = __byte_perm(vh[0][k2], vh[1][k2], sel);
                const u32 b1 = __byte_perm(vh[2][k2], vh[3][k2], sel);
                mma<DT>(acc[8 * c + j], ph[0], ph[1], ph[2], ph[3], b0, b1);
                if constexpr (DT == 0) {
                    mma<DT>(acc[8 * c + j], ph[0], ph[1], ph[2], ph[3],
                            __byte_perm(vl[0][k2], vl[1][k2], sel), __byte_perm(vl[2][k2], vl[3][k2], sel));
                    mma<DT>(acc[8 * c + j], pl[0], pl[1], pl[2], pl[3], b0, b1);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: each warp parks its unnormalized rows in smem (dims un-permuted),
    // then the CTA merges the warps that share rows and writes out.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(FULL_MASK, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(FULL_MASK, l_run[i], 2);
    }
    __syncthreads();                                         // the rings are free: reuse them
    float* smf = reinterpret_cast<float*>(smem);
    float* so = smf + warp * 16 * SROW;
    float* sm_m = smf + 4 * 16 * SROW;
    float* sm_l = sm_m + 64;
#pragma unroll
    for (int c = 0; c < NV; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int d0 = 64 * c + 16 * t4 + j;                 // output cols 2t4, 2t4+1 of n-tile (c, j)
            so[g * SROW + d0] = acc[8 * c + j][0];
            so[g * SROW + d0 + 8] = acc[8 * c + j][1];
            so[(g + 8) * SROW + d0] = acc[8 * c + j][2];
            so[(g + 8) * SROW + d0 + 8] = acc[8 * c + j][3];
        }
    if (t4 == 0) {
        sm_m[warp * 16 + g] = m_run[0]; sm_m[warp * 16 + g + 8] = m_run[1];
        sm_l[warp * 16 + g] = l_run[0]; sm_l[warp * 16 + g + 8] = l_run[1];
    }
    __syncthreads();

    const int hq = num_kv_heads * group;
    const int rows = ntok * group;
    for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
        const int r = idx / D, d = idx - r * D;
        const int w0 = (r >> 4) * warps_kv, lr = r & 15;
        float M = NEG_INF;
        for (int w = w0; w < w0 + warps_kv; ++w) M = fmaxf(M, sm_m[w * 16 + lr]);
        float L = 0.f, O = 0.f;
        if (M != NEG_INF) {
            for (int w = w0; w < w0 + warps_kv; ++w) {
                const float f = exp2f(sm_m[w * 16 + lr] - M);
                L += f * sm_l[w * 16 + lr];
                O += f * smf[(w * 16 + lr) * SROW + d];
            }
        }
        const float o = L > 0.f ? O / L : 0.f;
        const int tok = r / group;
        const i64 row = (i64)(q_begin + tok0 + tok) * hq + kvh * group + (r - tok * group);
        if (num_splits == 1) {
            out[row * D + d] = from_f32<DT>(o);
        } else {
            const i64 pi = row * num_splits + split;
            part_o[pi * D + d] = o;
            if (d == 0) part_lse[pi] = L > 0.f ? M + log2f(L) : NEG_INF;
        }
    }
}

// One warp per (query token, head): out = sum over the row's splits of
// 2^(lse_s - max) o_s / sum 2^(lse_s - max). A split counts only if the
// attention kernel ran it for this row (it covers some of the row's keys).
// Lanes own D/32 consecutive dims; the split loop is unrolled so that many
// partial rows are in flight at once (the merge is latency-bound, not bandwidth).
template <int DT, int D>
__global__ void __launch_bounds__(128) merge_splits_kernel(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, typename Store<DT>::T* __restrict__ out,
    const int* __restrict__ seq_lens, const int* __restrict__ cu_seqlens, int num_seqs, int num_tokens, int max_blocks,
    int bs_log2, int hq, int num_splits, int chunk)
{
    constexpr int DPL = D / 32;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);  // = token * hq + head
    if (row >= (i64)num_tokens * hq) return;
    const int qi = (int)(row / hq);
    int b = qi;
    if (cu_seqlens != nullptr) {
        int lo = 0, hi = num_seqs;                   // first b with cu[b + 1] > qi
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (cu_seqlens[mid + 1] > qi) hi = mid; else lo = mid + 1;
        }
        b = lo;
    }
    if (b >= num_seqs) return;
    const int q_begin = cu_seqlens ? cu_seqlens[b] : b;
    const int q_len = cu_seqlens ? cu_seqlens[b + 1] - q_begin : 1;
    const int seq_len = seq_lens[b];
    const int kv_len = min(seq_len, max_blocks << bs_log2);
    const int lim = min(seq_len - q_len + (qi - q_begin) + 1, kv_len);
    const int ns = lim <= 0 ? 0 : min(num_splits, (lim + chunk - 1) / chunk);
    const float* lse = part_lse + row * num_splits;
    const float* po = part_o + row * num_splits * D + lane * DPL;

    float M = NEG_INF;
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, lse[s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, o));
    float acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
    float L = 0.f;
    if (M != NEG_INF) {
        for (int s0 = 0; s0 < ns; s0 += 32) {
            const float w_lane = s0 + lane < ns ? exp2f(lse[s0 + lane] - M) : 0.f;
            const int n = min(32, ns - s0);
#pragma unroll 8
            for (int j = 0; j < n; ++j) {
                const float w = __shfl_sync(FULL_MASK, w_lane, j);
                const float2* p = reinterpret_cast<const float2*>(po + (i64)(s0 + j) * D);
                L += w;
#pragma unroll
                for (int i = 0; i < DPL / 2; ++i) {
                    const float2 v = p[i];
                    acc[2 * i] += w * v.x;
                    acc[2 * i + 1] += w * v.y;
                }
            }
        }
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    typename Store<DT>::T* o = out + row * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; ++i) o[i] = from_f32<DT>(acc[i] * inv);
}

// Reshape-and-cache: one CTA per token copies its K and V rows (all heads) into
// slot = block * block_size + offset with 16-byte moves. Strides are in bytes.
// Negative (padding) and out-of-range slots are skipped.
__global__ void __launch_bounds__(128) write_kv_kernel(
    const char* __restrict__ key, i64 key_st, i64 key_sh, const char* __restrict__ value, i64 val_st, i64 val_sh,
    char* __restrict__ k_cache, char* __restrict__ v_cache, i64 k_stride, i64 v_stride,
    const i64* __restrict__ slots, int num_heads, int block_size, int row_bytes, i64 num_slots)
{
    const int tok = blockIdx.x;
    const i64 slot = slots[tok];
    if (slot < 0 || slot >= num_slots) return;
    const i64 blk = slot / block_size;
    const int off = (int)(slot - blk * block_size);
    const int vecs = row_bytes >> 4;
    const int per_tensor = num_heads * vecs;
    for (int i = threadIdx.x; i < 2 * per_tensor; i += blockDim.x) {
        const bool is_v = i >= per_tensor;
        const int j = is_v ? i - per_tensor : i;
        const int h = j / vecs, v = j - h * vecs;
        const char* src = is_v ? value + tok * val_st + h * val_sh : key + tok * key_st + h * key_sh;
        char* dst = (is_v ? v_cache + blk * v_stride : k_cache + blk * k_stride) + (i64)(h * block_size + off) * row_bytes;
        reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
    }
}
""".replace("@NUM_STAGES@", str(NUM_STAGES))
