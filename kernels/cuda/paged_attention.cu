// CUDA C++ source of kvpool's GPU kernels, compiled at first use by CuPy/NVRTC
// (kvpool/kernels/cuda_runtime.py); the CPU emulator of the tests compiles it as C++.
// Five kernels here, a sixth in paged_attention_sm90.cu:
//
// paged_attention_kernel<DT, DA, KF, WKV, NS, KT>
//     Decode and prefill in one kernel, on tensor cores (mma.sync.m16n8k16, fp32
//     accumulation). A CTA of 4 warps owns one (sequence, query tile, KV head, KV split)
//     work item. The query tile's rows are (token, query head) pairs of one GQA group, so
//     every KV block is read once per KV head for all query heads that share it. WKV says
//     how the 4 warps divide the item: 4 (decode) = all warps share the same 16 rows and
//     split the KV range between them; 1 (prefill) = each warp owns 16 rows and walks the
//     whole (causal) KV range; 2 = in between (decode when shared memory is short: float32,
//     head_dim 256). Warps meet once, at the end, in shared memory.
//
//     Memory pipeline: K and V stages (KT keys each, a multiple of 16) stream into shared
//     memory with cp.async through a ring of NS stages per group of warps that share a key
//     range (one ring per warp in decode, one ring for the CTA in prefill), so NS - 1
//     stages are always in flight and loads cost no registers. Consecutive threads copy
//     consecutive 16-byte chunks, so a warp instruction reads 512 contiguous bytes (faster
//     than fixed rows and chunk columns per thread). Each chunk is stored at a swizzled
//     position so that the fragment reads below are free of shared-memory bank conflicts
//     (checked by arithmetic for head_dim 64/128/256; see benchmarks/NOTES-kernels.md for
//     what was measured). The host picks (NS, KT) per kernel variant
//     (cuda_attention.VARIANTS) and shape.
//
//     MMA mapping (lane = 4 * g + t; S = scores, P = probabilities):
//       S[16 rows x 8 tokens] += Q[16 rows x 16 dims] * K^T[16 dims x 8 tokens]
//       O[16 rows x 8 dims]   += P[16 rows x 16 tokens] * V[16 tokens x 8 dims]
//     A dot product does not care about the order of its terms, so a lane reads 8
//     *consecutive* dims (one 16-byte chunk) of Q and of K and uses them as its fragment
//     elements for two k-steps. For V the token axis is the reduction axis, so a lane reads
//     8 consecutive dims of two token rows and interleaves them with prmt into (token,
//     token+1) pairs; the output dims then come out permuted, which the epilogue undoes.
//     The S accumulator fragment is exactly P's A-operand layout, so P never leaves
//     registers.
//
//     float32 caches run the same path with each operand split into two bfloat16 terms
//     (hi + lo, three MMAs per product): about 16 mantissa bits.
//
//     With split-KV and an arrival-counter buffer (counters), the last split CTA of a
//     (tile, KV head) merges the tile's rows itself (merge_row) and resets its counter.
//
//     Page-aware (work_target > 0, decode and prefill): the grid is a bound on (work item,
//     KV head) pairs and each CTA finds its item from the lengths (locate_item for decode,
//     locate_prefill_item over query tiles), so the split of a sequence or tile follows its
//     own key count; counters and partials are per item.
//
//     DA is the model's head_dim (64, 80, 96, 112, 128, 192, 256), computed on Pad<DA, KF>::D
//     dims with zero pads; KF = 1 reads a float8 e4m3 cache and computes in float16, with the
//     K scale in scale_log2 and the V scale applied to the output. A sliding window (window)
//     starts each tile's keys at its first query's window; softcap_log2 caps the scores.
//
// paged_attention_pair_kernel<DT, DA, KF, WKV, NS, KT> (sm_90+: thread block clusters)
//     The same CTA body for decode with exactly two splits, launched as clusters of the
//     two split CTAs of each (tile, KV head): split 1 writes its normalized rows and
//     log-sum-exps into split 0's shared memory (distributed shared memory, past split 0's
//     rings) and arrives at the cluster barrier; split 0 waits there and writes the merged
//     rows. No partials in global memory and no arrival counter: one barrier in place of an
//     L2 atomic and the partials' round trip through global memory, which is the faster merge
//     (benchmarks/NOTES-kernels.md).
//
// prefill_kernel<DT, D, MT, NW, NS>
//     Prefill for 16-bit types and head_dim 64/128 when the query tiles fill the GPU
//     without split-KV: NW warps x 16 MT rows per CTA (4 x 1, 4 x 2, or 8 x 1 with Q
//     fragments kept in registers), Q staged once in shared memory, K/V in 64-key tiles
//     through an NS-stage cp.async ring (one barrier per tile), V operands by
//     ldmatrix.trans, causal masking only on tiles that cross a row's limit, rows written
//     straight from registers. The grid is 1-D with the KV head fastest and the longest
//     query tiles first.
//
// prefill_wg_kernel<DT, D> (paged_attention_sm90.cu, appended to this source and compiled
//     for sm_90a only)
//     The same prefill on Hopper's warpgroup MMA with K/V loaded by TMA; what the planner
//     runs there in place of prefill_kernel.
//
// merge_splits_kernel<DT, DA, KF>
//     Split-KV without the fused merge: one warp per (token, head) combines the per-split
//     (normalized output, log2-sum-exp) partials. Only launched when num_splits > 1 and no
//     counters were given.
//
// write_kv_kernel
//     Reshape-and-cache by slot mapping; dtype-blind 16-byte copies.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

// Thread block clusters exist from sm_90 on (the emulator defines this itself).
#ifndef KVPOOL_CLUSTERS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVPOOL_CLUSTERS 1
#else
#define KVPOOL_CLUSTERS 0
#endif
#endif

#define NEG_INF (__int_as_float(0xff800000))
#define FULL_MASK 0xffffffffu

// DT: 0 = float32, 1 = float16, 2 = bfloat16 (16-bit types travel as raw bits).
template <int DT> struct Store { typedef u16 T; };
template <> struct Store<0> { typedef float T; };
// KF: how the K/V cache stores elements. 0: as DT; 1: float8 e4m3 bytes (a per-tensor
// scale, applied by the host to the softmax scale for K and here to the output for V),
// computed in DT (16-bit) after an exact conversion.
template <int DT, int KF> struct Kv { typedef typename Store<DT>::T T; };
template <int DT> struct Kv<DT, 1> { typedef unsigned char T; };

// The head_dim the generic kernel computes with: the model's DA rounded up to 64, 128 or 256,
// whose rows of 16-byte chunks the ring's fill passes tile (192 would not: 24 chunks per
// bfloat16 row against 32 threads), and at least 128 for a float8 cache (a 64-byte row
// leaves a prefill ring's 128 threads more than a stage's chunks). Pad dims are zero in Q
// and K, so they add nothing to a score; their output columns are never written.
template <int DA, int KF = 0> struct Pad { static constexpr int D = DA <= 64 && !KF ? 64 : DA <= 128 ? 128 : 256; };

// BEGIN PRIMITIVES (inline PTX; cuda_emulator.py swaps this region for host code)
__device__ __forceinline__ uint4 ld16(const void* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Loads through L2 only: partials written by other CTAs of the same launch.
__device__ __forceinline__ float2 ldcg2(const float* p) {
    float2 r;
    asm volatile("ld.global.cg.v2.f32 {%0,%1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ float ldcg1(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}
// One arrival at a split counter; returns the count before it. Release: this CTA's partials
// (written before a CTA barrier) are visible to whoever sees the arrival. Acquire: for the
// last arrival, the other splits' partials are visible to this CTA once it passes a CTA
// barrier (one atomic instead of a fence, the atomic and a second fence per thread: less
// latency between the last split and its merge). The last arrival resets the counter for
// the next call.
__device__ __forceinline__ int arrive(int* c) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
    return old;
}

// Thread block clusters (sm_90+): this CTA's rank in its cluster, a pointer into another
// CTA's shared memory (distributed shared memory), and the cluster barrier's two halves:
// arrive (release: this thread's earlier writes, to any CTA's shared memory, are visible to
// the cluster's threads once they pass the wait) and wait (acquire). The planner launches the
// cluster kernel only where the device has clusters; elsewhere these are never reached.
__device__ __forceinline__ u32 cluster_rank() {
    u32 r = 0;
#if KVPOOL_CLUSTERS
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ float* cluster_map(float* p, u32 rank) {
#if KVPOOL_CLUSTERS
    float* r;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank));
    return r;
#else
    return p;
#endif
}
__device__ __forceinline__ void cluster_arrive() {
#if KVPOOL_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if KVPOOL_CLUSTERS
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// 16 bytes global -> shared without registers; ok == false writes zeros with a plain store and issues no copy:
// a zero-size cp.async would still name a global address, and a masked lane's address (a position past the
// sequence, a block id outside the pool) may lie where this process maps nothing.  The zeros land at once, as an
// early copy may (the rings' waits and barriers allow both).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    if (ok) {
        const u32 d = (u32)__cvta_generic_to_shared(dst);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
    } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
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

// Four 8x8 matrices of 16-bit elements from shared memory, transposed: lanes 8 i .. 8 i + 7
// give the addresses of matrix i's 8 rows (16 bytes each); register i of lane 4 g + t gets
// matrix i's elements (row 2 t, column g) and (row 2 t + 1, column g).
__device__ __forceinline__ void ldsm_x4_trans(const void* row, u32 (&r)[4]) {
    const u32 a = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// Two float8 e4m3 values (low byte first) -> two float16 (low half first). Exact: every
// e4m3 value is a normal float16. sm_89+ convert in one instruction; older GPUs decode the
// bits (sign, 4-bit exponent of bias 7, 3-bit mantissa; exponent 0 is subnormal).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 x) {
    u32 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((u16)x));
#else
    r = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 b = (x >> (8 * i)) & 0xffu, e = (b >> 3) & 15u, m = b & 7u;
        const float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(b & 0x80u ? -mag : mag));
        r |= (u32)h << (16 * i);
    }
#endif
    return r;
}
__device__ __forceinline__ float half_to_float(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
    return f;
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

// Chunk j of row r of a tile sits at chunk swz_chunk(j, r) (rows of 8 or more chunks).
template <int CPR> __device__ __forceinline__ int swz_chunk(int j, int r) {
    static_assert(CPR % 8 == 0, "rows of 8k chunks");
    return j ^ swz(r);
}

// Eight consecutive elements e .. e + 7 of tile row r (a ring stage holds D-dim rows of
// KF's element type) as four registers of 16-bit pairs: DT's (hi; float32 also lo, see
// split8), float16 from a float8 cache.
template <int DT, int KF, int D>
__device__ __forceinline__ void read8(const unsigned char* tile, int r, int e, u32 (&hi)[4], u32 (&lo)[4]) {
    constexpr int ES = KF ? 1 : DT == 0 ? 4 : 2;
    constexpr int CPR = D * ES / 16;
    const unsigned char* row = tile + r * (D * ES);
    if constexpr (KF) {
        // Eight bytes, half a chunk: e is a multiple of 8.
        const uint2 a = *reinterpret_cast<const uint2*>(row + (swz_chunk<CPR>(e >> 4, r) << 4) + (e & 8));
        hi[0] = e4m3x2_to_f16x2(a.x & 0xffffu); hi[1] = e4m3x2_to_f16x2(a.x >> 16);
        hi[2] = e4m3x2_to_f16x2(a.y & 0xffffu); hi[3] = e4m3x2_to_f16x2(a.y >> 16);
        return;
    }
    const int j = (e * ES) >> 4;
    const uint4 a = *reinterpret_cast<const uint4*>(row + (swz_chunk<CPR>(j, r) << 4));
    if constexpr (DT == 0) {
        const uint4 b = *reinterpret_cast<const uint4*>(row + (swz_chunk<CPR>(j + 1, r) << 4));
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

// The sum of v over this lane and the lanes below it (a warp's inclusive prefix sum).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// Which unit x of a list of sequences' units (sequence j has count(j) >= 0 of them) falls
// in: sequence b and its unit idx (of n). One warp scans 32 sequences at a time with
// shuffles; no buffer, no launch before this one.
template <typename Count>
__device__ __forceinline__ bool locate_scan(int num_seqs, int x, Count count, int& b, int& idx, int& n) {
    const int lane = threadIdx.x & 31;
    int before = 0;                                          // units of the sequences passed
    for (int s0 = 0; s0 < num_seqs; s0 += 32) {
        const int j = s0 + lane;
        const int c = j < num_seqs ? count(j) : 0;
        const int inc = warp_inclusive_sum(c);
        const unsigned hit = __ballot_sync(FULL_MASK, j < num_seqs && before + inc > x);
        if (hit) {
            const int l = __ffs(hit) - 1;
            b = s0 + l;
            n = __shfl_sync(FULL_MASK, c, l);
            idx = x - before - __shfl_sync(FULL_MASK, inc - c, l);
            return true;
        }
        before += __shfl_sync(FULL_MASK, inc, 31);
    }
    return false;
}

// The prefill tile mapping without a tile_cum buffer: ceil(q_len / tq) tiles per sequence.
__device__ __forceinline__ bool locate_tile_scan(const int* cu_seqlens, int num_seqs, int tq, int x, int& b, int& tile) {
    int n;
    return locate_scan(num_seqs, x, [&](int j) { return (cu_seqlens[j + 1] - cu_seqlens[j] + tq - 1) / tq; }, b, tile, n);
}

// First key a query at `pos` sees with a sliding window (0: none), rounded down to 8 so
// that K/V stages stay in whole 8-key groups (the few keys below the window are masked).
__device__ __forceinline__ int window_start(int pos, int window) {
    return window > 0 ? max(0, pos - window + 1) & ~7 : 0;
}

// Page-aware attention: the work item that CTA x (of one KV head) runs, from the lengths
// themselves (read on the device, so a CUDA graph replays with new lengths). The rule,
// mirrored on the host by cuda_attention.work_items, in units of 64 keys. The units of work
// are query tiles: decode has one per sequence; prefill has ceil(q_len / tq) per sequence,
// tile t holding tokens t tq .. t tq + tq - 1 of the sequence's queries. Tile i sees w_i
// units of keys (from its first token's window start to its last token's position); with u
// units per item it gets n_i = max(1, ceil(w_i / u)) items (an empty decode sequence's one
// item writes zeros), its keys shared evenly between them (a multiple of 64 each, the last
// takes the rest), so no item is empty or a sliver. A tile is long when 2 w_i > u (its
// items take more than half an item's time), short otherwise (one item).
//   * Fewer tiles than S = target (the CTAs per KV head that run at once): with a = overhead
//     (a CTA's fixed cost, in units), u is the smallest (at least min_chunk) for which the
//     long tiles' items fit one wave (sum over long i of n_i <= S) and all the work fits S
//     slots of one item's time (sum_i (w_i + a n_i) <= S (u + a)). The long tiles' items run
//     first, then one item per short tile: short items fill the slots that long ones leave,
//     instead of holding a slot that a long item then waits for.
//   * S or more tiles (several waves whatever the split): decode takes u = ceil(sum w_i / S),
//     lowered to max_chunk where the grid (target + num_seqs items) still holds the items;
//     prefill splits no tile. Prefill items run in tile order (a sequence's last tile, which
//     sees the most keys, first), decode items by size class (locate_item; one class: in
//     batch order).
// A tile's items are consecutive: the first, x - split, numbers its partials and counter.
// Returns false past the last item. Every warp computes the same answer.

// One wave's u (the rule above) for tiles of `units` units in all, the widest `widest`, over
// `ntiles` tiles; long_and_work(u) returns (long tiles' items, all items) at u, summed over
// the warp. Starts at a lower bound (the work alone, one item per tile) and a u that surely
// fits (every tile short and alone in its item, the work within S slots), probes near the
// answer (all units over S, a uniform batch's answer; else three times that), then bisects.
template <typename Counts>
__device__ __forceinline__ int one_wave_units(int units, int widest, int ntiles, int s, int a, int min_u,
                                              Counts long_and_work) {
    auto fits = [&](int u) {
        const int2 n = long_and_work(u);
        return n.x <= s && (i64)units + (i64)a * n.y <= (i64)s * (u + a);
    };
    int lo = max(min_u, (units + a * ntiles) / s - a);
    if (fits(lo)) return lo;
    int hi = max(2 * widest, (units + a * ntiles + s - 1) / s) + 1;
    const int near = max(lo + 1, (units + s - 1) / s);
    const int probe = max(lo + 1, (3 * units + s - 1) / s);
    if (near < hi && fits(near)) hi = near;
    else if (probe < hi && fits(probe)) lo = max(lo, near), hi = probe;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (fits(mid)) hi = mid; else lo = mid;
    }
    return hi;
}

// Most size classes of the decode item order (locate_item): halvings of the item size u
// (cuda_source.ORDER_CLASSES, checked against this line when the source is read).
constexpr int ORDER_CLASSES = 8;

// Decode (one tile per sequence; inlined: a few passes over the lengths).
__device__ __forceinline__ bool locate_item(const int* seq_lens, int num_seqs, int cap, int window, int target,
                                            int min_chunk, int max_chunk, int overhead, int classes, int x, int& b,
                                            int& split, int& nsplit, int& chunk) {
    const int lane = threadIdx.x & 31;
    auto visible = [&](int j) {
        const int len = max(0, seq_lens[j]);
        return max(0, min(len, cap) - window_start(len - 1, window));
    };
    auto warp_sum = [](int v) { return (int)__reduce_add_sync(FULL_MASK, (unsigned)v); };
    auto units_of = [&](int j) { return (visible(j) + 63) >> 6; };
    auto items_of = [](int w, int u) { return max(1, (w + u - 1) / u); };
    int units = 0, widest = 0;                               // visible keys in 64-key units
    for (int j = lane; j < num_seqs; j += 32) {
        const int w = units_of(j);
        units += w;
        widest = max(widest, w);
    }
    units = warp_sum(units);
    widest = __reduce_max_sync(FULL_MASK, widest);
    const int s = max(1, target), a = overhead >> 6;
    const int min_u = max(1, min_chunk >> 6), max_u = max(min_u, max_chunk >> 6);
    const bool one_wave = num_seqs < target;
    int u;
    if (one_wave) {
        u = one_wave_units(units, widest, num_seqs, s, a, min_u, [&](int u) {
            int nl = 0, nall = 0;
            for (int j = lane; j < num_seqs; j += 32) {
                const int w = units_of(j), n = items_of(w, u);
                nall += n;
                if (2 * w > u) nl += n;
            }
            return make_int2(warp_sum(nl), warp_sum(nall));
        });
    } else {
        u = max(min_u, (units + s - 1) / s);
        if (u > max_u) {
            int nall = 0;
            for (int j = lane; j < num_seqs; j += 32) nall += items_of(units_of(j), max_u);
            if (warp_sum(nall) <= target + num_seqs) u = max_u;
        }
    }
    // Largest items first: each sequence's items go to the class of their size, (u/2, u] first
    // (the long sequences'), then (u/4, u/2], ... down to the last of `classes` classes (at
    // least two in one wave), each class in batch order; one class is the batch order. A long
    // item that started in a late wave behind smaller ones would run on while the rest of the
    // GPU idles; a full sort per CTA would cost more than it gains. One or two classes take no
    // division per sequence (an item is over u/2 exactly when its sequence is).
    const int last = min(ORDER_CLASSES, max(one_wave ? 2 : 1, classes)) - 1;
    auto size_class = [&](int w) {
        if (last < 2) return last == 0 || 2 * w > u ? 0 : 1;
        const int n = items_of(w, u), p = (w + n - 1) / n;
        return 2 * p > u ? 0 : min(last, max(1, 31 - __clz(u / max(p, 1))));
    };
    int cls = 0, before = 0;                                 // x's class and the items ahead of it
    if (last > 0) {
        int in_class[ORDER_CLASSES];
#pragma unroll
        for (int k = 0; k < ORDER_CLASSES; ++k) in_class[k] = 0;
        for (int j = lane; j < num_seqs; j += 32) {
            const int w = units_of(j), k = size_class(w), n = items_of(w, u);
#pragma unroll
            for (int c = 0; c < ORDER_CLASSES; ++c) in_class[c] += c == k ? n : 0;
        }
#pragma unroll
        for (int k = 0; k < ORDER_CLASSES; ++k) {
            if (k > last) break;
            const int n = warp_sum(in_class[k]);
            if (before + n <= x && k == cls) cls = k + 1, before += n;
        }
        if (cls > last) return false;
    }
    const bool found = locate_scan(num_seqs, x - before, [&](int j) {
        const int w = units_of(j);
        return size_class(w) == cls ? items_of(w, u) : 0;
    }, b, split, nsplit);
    if (!found) return false;
    chunk = ((visible(b) + nsplit - 1) / nsplit + 63) & ~63;  // this sequence's keys per item
    return true;
}

// Prefill (ceil(q_len / tq) tiles per sequence). Not inlined: inlined, its loops raised the
// kernel's registers from 168 to 224 (two CTAs per SM where three fit), although none of
// them is live in the key loop. Lane l holds sequences l k .. l k + k - 1 (k =
// ceil(num_seqs / 32)), so that a tile's place is one warp scan.
__device__ __noinline__ bool locate_prefill_item(const int* seq_lens, const int* cu_seqlens, int num_seqs, int tq,
                                                 int cap, int window, int target, int min_chunk, int overhead, int x,
                                                 int& b, int& tile, int& split, int& nsplit, int& chunk) {
    const int lane = threadIdx.x & 31;
    const int per = (num_seqs + 31) >> 5;
    const int j0 = min(num_seqs, lane * per), j1 = min(num_seqs, j0 + per);
    auto tile_keys = [&](int j, int t) {                     // keys that tile t of sequence j sees
        const int len = max(0, seq_lens[j]);
        const int ql = cu_seqlens[j + 1] - cu_seqlens[j];
        const int first_pos = len - ql, tok0 = t * tq;
        const int hi = min(min(len, cap), first_pos + tok0 + min(tq, ql - tok0));
        return max(0, hi - window_start(first_pos + tok0, window));
    };
    auto tiles_of = [&](int j) { return (cu_seqlens[j + 1] - cu_seqlens[j] + tq - 1) / tq; };
    auto each = [&](auto f) {                                // f(sequence, tile, units) over this lane's tiles
        for (int j = j0; j < j1; ++j)
            for (int t = tiles_of(j) - 1; t >= 0; --t) f(j, t, (tile_keys(j, t) + 63) >> 6);
    };
    auto warp_sum = [](int v) { return (int)__reduce_add_sync(FULL_MASK, (unsigned)v); };
    auto items_of = [](int w, int u) { return max(1, (w + u - 1) / u); };
    // The lane whose share c holds item y (l = -1: none), and y's offset into that share.
    auto find_lane = [&](int c, int y, int& l) {
        const int inc = warp_inclusive_sum(c);
        const unsigned hit = __ballot_sync(FULL_MASK, inc > y);
        l = hit ? __ffs(hit) - 1 : -1;
        return y - (inc - c);
    };
    int mine = 0, l;
    for (int j = j0; j < j1; ++j) mine += tiles_of(j);
    const int ntiles = warp_sum(mine);
    if (ntiles >= target) {                                  // S or more tiles: one item each, in tile order
        int rest = find_lane(mine, x, l), fb = -1, ft = 0;
        if (l < 0) return false;
        if (lane == l) {
            for (int j = j0; j < j1 && fb < 0; ++j) {
                const int n = tiles_of(j);
                if (rest < n) fb = j, ft = n - 1 - rest;     // a sequence's last tile first
                else rest -= n;
            }
        }
        b = __shfl_sync(FULL_MASK, fb, l);
        tile = __shfl_sync(FULL_MASK, ft, l);
        split = 0, nsplit = 1;
        chunk = (tile_keys(b, tile) + 63) & ~63;
        return true;
    }
    int held = 0, widest = 0;
    each([&](int, int, int w) { held += w; widest = max(widest, w); });
    const int units = warp_sum(held);
    widest = __reduce_max_sync(FULL_MASK, widest);
    const int s = max(1, target), a = overhead >> 6, min_u = max(1, min_chunk >> 6);
    const int u = one_wave_units(units, widest, ntiles, s, a, min_u, [&](int u) {
        int nl = 0, nall = 0;
        each([&](int, int, int w) {
            const int n = items_of(w, u);
            nall += n;
            if (2 * w > u) nl += n;
        });
        return make_int2(warp_sum(nl), warp_sum(nall));
    });
    // cls 0 counts the long tiles' items, 1 the short tiles' (one each).
    int n_long = 0;
    each([&](int, int, int w) { if (2 * w > u) n_long += items_of(w, u); });
    n_long = warp_sum(n_long);
    const int cls = x < n_long ? 0 : 1;
    const int y = cls ? x - n_long : x;
    auto count = [&](int w) { return (2 * w > u) == (cls == 0) ? (cls ? 1 : items_of(w, u)) : 0; };
    int c = 0;
    each([&](int, int, int w) { c += count(w); });
    int rest = find_lane(c, y, l), fb = -1, ft = 0, fs = 0, fn = 1;  // lane l walks its own tiles
    if (l < 0) return false;
    if (lane == l) {
        each([&](int j, int t, int w) {
            const int k = count(w);
            if (fb < 0 && rest < k) { fb = j; ft = t; fs = rest; fn = cls ? 1 : items_of(w, u); }
            rest -= k;
        });
    }
    b = __shfl_sync(FULL_MASK, fb, l);
    tile = __shfl_sync(FULL_MASK, ft, l);
    split = __shfl_sync(FULL_MASK, fs, l);
    nsplit = __shfl_sync(FULL_MASK, fn, l);
    chunk = ((tile_keys(b, tile) + nsplit - 1) / nsplit + 63) & ~63;  // this tile's keys per item
    return true;
}

// One online-softmax step for a lane's two rows (log2 domain): mx holds the rows' score
// maxima over this lane's keys of the new tile. Reduces them over the lane's quad, updates
// the running max m_run and sum l_run, and gives the max to subtract in msafe (0 for a row
// with no key yet, so that exp2 stays finite) and the factor for the old accumulators in
// corr. Returns whether any factor differs from 1.
__device__ __forceinline__ bool softmax_step(float (&mx)[2], float (&m_run)[2], float (&l_run)[2], float (&msafe)[2],
                                             float (&corr)[2]) {
    bool moved = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
        const float m_new = fmaxf(m_run[i], mx[i]);
        msafe[i] = m_new == NEG_INF ? 0.f : m_new;
        corr[i] = m_new == m_run[i] ? 1.f : exp2f(m_run[i] - msafe[i]);
        moved = moved || corr[i] != 1.f;
        m_run[i] = m_new;
        l_run[i] *= corr[i];
    }
    return moved;
}

// One warp merges one (query token, head) row: out = sum over the row's ns splits of
// 2^(lse_s - max) o_s / sum 2^(lse_s - max), where split s's log-sum-exp is lse[s * stride]
// and its D-float output row po[s * stride * D] (only the first DA dims are written out).
// Lanes own D/32 consecutive dims. A merge is latency-bound, not bandwidth: the first PF
// splits' partial rows are loaded together with their log-sum-exps, before the max that
// weights them is known (one L2 round trip on the path of a fused merge, not two);
// further splits follow in unrolled batches, many rows in flight at once.
template <int DT, int D, int DA>
__device__ __forceinline__ void merge_row(const float* lse, const float* po_row, i64 stride,
                                          typename Store<DT>::T* out_row, int ns, int lane)
{
    constexpr int DPL = D / 32;
    constexpr int PF = D >= 256 ? 8 : 16;
    const float* po = po_row + lane * DPL;
    const i64 ost = stride * D;
    const float lse_lane = lane < ns ? ldcg1(lse + lane * stride) : NEG_INF;
    float2 pre[PF][DPL / 2];
#pragma unroll
    for (int j = 0; j < PF; ++j)
#pragma unroll
        for (int i = 0; i < DPL / 2; ++i) {
            pre[j][i].x = pre[j][i].y = 0.f;
            if (j < ns) pre[j][i] = ldcg2(po + j * ost + 2 * i);
        }
    float M = lse_lane;
    for (int s = lane + 32; s < ns; s += 32) M = fmaxf(M, ldcg1(lse + s * stride));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, o));
    float acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
    float L = 0.f;
    if (M != NEG_INF) {
        const float w_first = exp2f(lse_lane - M);          // 0 for a lane past ns
#pragma unroll
        for (int j = 0; j < PF; ++j) {
            const float w = __shfl_sync(FULL_MASK, w_first, j);
            L += w;
#pragma unroll
            for (int i = 0; i < DPL / 2; ++i) {
                acc[2 * i] += w * pre[j][i].x;
                acc[2 * i + 1] += w * pre[j][i].y;
            }
        }
        for (int s0 = PF; s0 < ns; s0 += 32) {
            const float w_lane = s0 + lane < ns ? exp2f(ldcg1(lse + (s0 + lane) * stride) - M) : 0.f;
            const int n = min(32, ns - s0);
#pragma unroll 8
            for (int j = 0; j < n; ++j) {
                const float w = __shfl_sync(FULL_MASK, w_lane, j);
                const float* p = po + (s0 + j) * ost;
                L += w;
#pragma unroll
                for (int i = 0; i < DPL / 2; ++i) {
                    const float2 v = ldcg2(p + 2 * i);
                    acc[2 * i] += w * v.x;
                    acc[2 * i + 1] += w * v.y;
                }
            }
        }
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i)
        if (DA == D || lane * DPL + i < DA) out_row[lane * DPL + i] = from_f32<DT>(acc[i] * inv);
}

// Splits of a row that the attention kernel runs: those that start before the
// row's last visible key (at least split 0, which also covers an empty row).
__device__ __forceinline__ int splits_run(int lim, int chunk, int num_splits) {
    return lim <= 0 ? 1 : min(num_splits, (lim + chunk - 1) / chunk);
}

// The argument list every attention kernel takes (cuda_attention.paged_attention passes one
// tuple to whichever it launches; the Hopper prefill kernel appends its two TMA maps), with
// the macro's argument the cache's element type. window (0: none), softcap_log2 (0: none; the
// soft cap times log2 e), v_scale (the V cache's dequantization scale) and work_target /
// min_chunk / item_overhead / item_classes (work_target > 0: page-aware, see locate_item, which
// then takes `chunk` as its max_chunk) only reach the generic kernel; the host never gives the
// dedicated prefill kernels other values than 0, 0, 1, 0, 0, 0, 0.
#define ATTENTION_PARAMS_KV(...)                                                                           \
    const typename Store<DT>::T* __restrict__ q, i64 q_stride_t, i64 q_stride_h,                          \
    const __VA_ARGS__* __restrict__ k_cache, const __VA_ARGS__* __restrict__ v_cache,                     \
    i64 k_stride, i64 v_stride, int num_blocks, int num_kv_heads, int bs_log2,                            \
    const int* __restrict__ block_tables, i64 bt_stride, int max_blocks,                                  \
    const int* __restrict__ seq_lens, const int* __restrict__ cu_seqlens, const int* __restrict__ tile_cum, \
    int num_seqs, int group, float scale_log2, int chunk, int num_splits,                                 \
    typename Store<DT>::T* __restrict__ out, float* part_o, float* part_lse, int* __restrict__ counters,  \
    int window, float softcap_log2, float v_scale, int work_target, int min_chunk, int item_overhead,     \
    int item_classes
#define ATTENTION_PARAMS ATTENTION_PARAMS_KV(typename Store<DT>::T)

// The names of ATTENTION_PARAMS, to pass them on.
#define ATTENTION_ARGS                                                                        \
    q, q_stride_t, q_stride_h, k_cache, v_cache, k_stride, v_stride, num_blocks, num_kv_heads, \
    bs_log2, block_tables, bt_stride, max_blocks, seq_lens, cu_seqlens, tile_cum, num_seqs,   \
    group, scale_log2, chunk, num_splits, out, part_o, part_lse, counters,                    \
    window, softcap_log2, v_scale, work_target, min_chunk, item_overhead, item_classes

// Shared memory of a pair CTA (PAIR below) past its rings and epilogue: where split 1's
// normalized rows ([16 * 4 / WKV][D] floats) and their log-sum-exps land. KES: bytes per
// cached element.
template <int KES, int D, int WKV, int NS, int KT> __device__ __forceinline__ constexpr int pair_recv_offset() {
    constexpr int rings = WKV * NS * 2 * KT * D * KES;
    constexpr int epilogue = (4 * 16 * (D + 1) + 8 * 16) * 4 + 16;
    return ((rings > epilogue ? rings : epilogue) + 15) / 16 * 16;
}

// One CTA of paged_attention_kernel (PAIR = false) or of paged_attention_pair_kernel (PAIR:
// two splits in a cluster of two CTAs that merge through shared memory).
template <int DT, int DA, int KF, int WKV, int NS, int KT, bool PAIR>
__device__ __forceinline__ void attention_cta(ATTENTION_PARAMS_KV(typename Kv<DT, KF>::T))
{
    using T = typename Store<DT>::T;
    constexpr int D = Pad<DA, KF>::D;          // head dims computed (DA of them are real)
    constexpr int warps_kv = WKV;              // warps splitting one row tile's keys (4 decode, 1 prefill)
    constexpr int warps_row = 4 / WKV;         // warps sharing one cp.async ring
    constexpr int GT = 32 * warps_row;         // threads that fill a ring
    constexpr int ES = KF ? 1 : DT == 0 ? 4 : 2;  // bytes per cached element
    constexpr int RB = D * ES;                 // bytes per K/V row in a stage
    constexpr int RBG = DA * ES;               // bytes per K/V row in the cache
    constexpr int CPR = RB / 16;               // 16-byte chunks per stage row
    constexpr int CPRG = RBG / 16;             // of them, read from the cache (the rest are zero)
    constexpr int SB = 2 * KT * RB;            // one stage: KT K rows then KT V rows
    constexpr int NT = KT / 8;                 // 8-key n-tiles of S per stage
    static_assert(KT % 16 == 0 && NS >= 2, "stages hold whole 16-key MMA steps");
    static_assert(RBG % 16 == 0, "cache rows of whole 16-byte chunks");
    static_assert(!KF || DT != 0, "float8 caches compute in a 16-bit type");
    constexpr int NQ = D / 32;                 // Q/K 8-element chunks per lane (two k-steps each)
    constexpr int NV = D / 64;                 // 64-dim V chunks (eight n-tiles each)
    constexpr int SROW = D + 1;                // padded epilogue row
    constexpr int RW = 16;                     // rows per warp (one m-tile)
    // The MMAs' type: DT, but float16 for a float8 cache whatever DT (e4m3 -> float16 is one
    // instruction per pair, -> bfloat16 four; Q and P in float16 keep more mantissa than
    // bfloat16, and |q| stays far below float16's 65504 in attention).
    constexpr int CT = KF ? 1 : DT;
    extern __shared__ uint4 smem4[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(smem4);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    // What this CTA works on: (sequence b, query tile, KV head, split of nsplit of chunk keys).
    int b, tile, kvh, split, nsplit, chunk_c;
    const int tq = (RW * warps_row) / group;                 // query tokens per CTA tile
    const bool paged = work_target > 0;        // page-aware: grid (items x KV heads)
    if (paged) {
        kvh = blockIdx.x % num_kv_heads;
        const int x = blockIdx.x / num_kv_heads;
        tile = 0;
        const bool found = cu_seqlens
            ? locate_prefill_item(seq_lens, cu_seqlens, num_seqs, tq, max_blocks << bs_log2, window, work_target,
                                  min_chunk, item_overhead, x, b, tile, split, nsplit, chunk_c)
            : locate_item(seq_lens, num_seqs, max_blocks << bs_log2, window, work_target, min_chunk, chunk,
                          item_overhead, item_classes, x, b, split, nsplit, chunk_c);
        if (!found) return;
    } else {
        // The grid is (tiles, KV heads, splits) and launches x fastest; CTAs take their (tile,
        // KV head) in KV-head-fastest order instead, so that the KV heads of a sequence run
        // together: its table row and Q rows are read while in L2, and a block's per-head
        // chunks at about the same time. That matters on grids of several waves; grids of one
        // wave run all CTAs at once either way.
        const int xy = blockIdx.x + gridDim.x * blockIdx.y;
        kvh = xy % gridDim.y;
        split = blockIdx.z, nsplit = num_splits, chunk_c = chunk;
        if (!locate_tile(tile_cum, num_seqs, xy / gridDim.y, b, tile)) return;
    }
    const int* bt = block_tables + (i64)b * bt_stride;
    const int q_begin = cu_seqlens ? cu_seqlens[b] : b;
    const int q_len = cu_seqlens ? cu_seqlens[b + 1] - q_begin : 1;
    const int tok0 = tile * tq;
    const int ntok = min(tq, q_len - tok0);
    if (ntok <= 0) return;
    // Block ids of this warp's first NS - 1 tiles. Without a window they do not depend on the
    // sequence's length, and are read before it: a table row holds max_blocks entries whatever
    // the length, so this read overlaps the length's instead of waiting for it (one dependent
    // global load less before the first cp.async, in the chain of latencies that a batch-1
    // call is). Used only below kv_len.
    const int wr = warp / warps_kv, wk = warp - wr * warps_kv;
    const int step = KT * warps_kv;
    int first_ids[NS - 1][KT / 8];
    auto read_first_ids = [&](int first) {
#pragma unroll
        for (int k = 0; k < NS - 1; ++k)
#pragma unroll
            for (int q = 0; q < KT / 8; ++q) {
                const int blk = (first + step * k + 8 * q) >> bs_log2;
                first_ids[k][q] = blk < max_blocks ? bt[blk] : -1;
            }
    };
    if (window == 0) read_first_ids(split * chunk_c + KT * wk);
    const int seq_len = seq_lens[b];
    const int kv_len = min(seq_len, max_blocks << bs_log2);  // never read past the table
    const int first_pos = seq_len - q_len;                   // position of query 0
    const int cta_hi = min(kv_len, first_pos + tok0 + ntok); // keys the tile's last token sees
    // Splits count from the first key the tile's first token sees (0 without a window).
    // The warps with the same wk share one ring and walk keys kv_begin + 16 (wk + warps_kv k).
    const int kv_lo = window_start(first_pos + tok0, window);
    const int kv_begin = kv_lo + split * chunk_c;
    const int first = kv_begin + KT * wk;
    if (window > 0) read_first_ids(first);
    if (kv_begin >= cta_hi && split > 0 && !PAIR) return;    // merge skips this split (a pair's
                                                             // split 1 delivers an empty row)

    const int bs_mask = (1 << bs_log2) - 1;
    const int head_row = kvh << bs_log2;                     // first row of this KV head in a block
    unsigned char* ring = smem + wk * (NS * SB);

    // Ring filling: a stage holds KT K rows, then KT V rows, of CPR 16-byte chunks.
    // Consecutive threads take consecutive 16-byte chunks of a key row and then of the
    // next rows, so one warp instruction moves 512 contiguous bytes (whole 128-byte
    // lines; a block's rows of one head are contiguous). Keys come in
    // groups of 8 that never straddle a block (block_size >= 8, stages start at
    // multiples of 8): one table read and one 64-bit offset per group and stage.
    constexpr int LR = GT / CPR > 0 ? GT / CPR : 1;       // rows per pass (1 if a row needs several)
    constexpr int LC = GT / CPR > 0 ? CPR : GT;           // threads per row in a pass
    constexpr int LP = (KT * CPR) / GT;                   // passes per tensor and stage
    constexpr int LRG = LR > 8 ? LR / 8 : 1;              // 8-key groups one pass touches
    const int gtid = 32 * wr + lane;
    const int lrow = gtid / LC, lcol = gtid % LC;
    static_assert(LP >= 1 && (KT * CPR) % GT == 0, "the ring's threads must tile a stage");

    // Stream tile k (K and V, KT keys each) into its stage; zeros past the sequence
    // or for a block id outside the pool. table_id(q, pos0): the block id of 8-key group q.
    auto issue = [&](int k, auto table_id) {
        const int base = first + step * k;
        unsigned char* st = ring + (k % NS) * SB;
        const unsigned char* kb = reinterpret_cast<const unsigned char*>(k_cache);
        const unsigned char* vb = reinterpret_cast<const unsigned char*>(v_cache);
        // Byte offsets of each 8-key group's first row (before the loads: the
        // cp.async "memory" clobbers would stop the compiler from sharing table reads).
        i64 gk[NT], gv[NT];
        bool gok[NT];
#pragma unroll
        for (int q = 0; q < NT; ++q) {
            const int pos0 = base + 8 * q;
            const int id = pos0 < kv_len ? table_id(q, pos0) : -1;
            gok[q] = (unsigned)id < (unsigned)num_blocks;
            const i64 row_el = (i64)(head_row + (pos0 & bs_mask)) * DA;
            gk[q] = gok[q] ? ((i64)id * k_stride + row_el) * ES : 0;
            gv[q] = gok[q] ? ((i64)id * v_stride + row_el) * ES : 0;
        }
#pragma unroll
        for (int p = 0; p < LP; ++p) {
            // pass p covers rows p * LR .. + LR - 1, or (LR == 1 and CPR > GT) a part of one row
            const int r0 = GT >= CPR ? p * LR : (p * GT) / CPR;  // compile-time
            const int r = r0 + (GT >= CPR ? lrow : 0);
            const int j = GT >= CPR ? lcol : (p * GT) % CPR + lcol;
            const int q = r0 >> 3;
            i64 ko = gk[q], vo = gv[q];
            bool ok = gok[q];
            if constexpr (LRG > 1) {
#pragma unroll
                for (int e = 1; e < LRG; ++e)
                    if ((r >> 3) == q + e) { ko = gk[q + e]; vo = gv[q + e]; ok = gok[q + e]; }
            }
            ok = ok && base + r < kv_len && (CPRG == CPR || j < CPRG);
            const int in_grp = (r & 7) * RBG + 16 * j;
            const int xo = swz_chunk<CPR>(j, r) << 4;
            cp_async16(st + r * RB + xo, kb + (ok ? ko + in_grp : 0), ok);
            cp_async16(st + (KT + r) * RB + xo, vb + (ok ? vo + in_grp : 0), ok);
        }
    };

    const int kv_end = split == nsplit - 1 ? cta_hi : min(cta_hi, kv_begin + chunk_c);
    const int ntiles = kv_end > first ? (kv_end - first + step - 1) / step : 0;

    // This lane's rows: r0 = RW * wr + g and r0 + 8; row r = (token r / group, head r % group).
    int lim[2], lo[2];                                       // row attends to positions lo .. lim - 1
    u32 qh[2][NQ][4], ql[2][NQ][4];
    int lim_hi = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = RW * wr + g + 8 * i;
        const int tok = r / group, head = r - tok * group;
        const bool valid = r < ntok * group;
        const int pos = first_pos + tok0 + tok;
        lim[i] = valid ? min(pos + 1, kv_end) : 0;
        lo[i] = window > 0 ? pos - window + 1 : 0;
        lim_hi = max(lim_hi, lim[i]);
        const T* qp = q + (i64)(q_begin + tok0 + tok) * q_stride_t + (i64)(kvh * group + head) * q_stride_h + 8 * t4;
#pragma unroll
        for (int c = 0; c < NQ; ++c) {
            load8<DT>(qp + 32 * c, valid && 32 * c + 8 * t4 < DA, qh[i][c], ql[i][c]);
            if constexpr (CT != DT) {                        // bfloat16 q on a float8 cache
#pragma unroll
                for (int k = 0; k < 4; ++k) qh[i][c][k] = pack2<1>(bf16_low(qh[i][c][k]), bf16_high(qh[i][c][k]));
            }
        }
    }
    const int w_hi = __reduce_max_sync(FULL_MASK, lim_hi);

    float acc[8 * NV][4];
#pragma unroll
    for (int n = 0; n < 8 * NV; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m_run[2], l_run[2];
    m_run[0] = m_run[1] = NEG_INF, l_run[0] = l_run[1] = 0.f;

#pragma unroll
    for (int k = 0; k < NS - 1; ++k) {
        if (k < ntiles) issue(k, [&](int q, int) { return first_ids[k][q]; });
        cp_async_commit();
    }
    // Block ids of tile k + NS - 1, read in the iteration before the one that issues it: no
    // table read stands between tile k's arrival and the cp.async of tile k + NS - 1, so the
    // table's latency is hidden behind a tile's compute.
    int ahead_ids[KT / 8];
    auto read_ids = [&](int k) {
#pragma unroll
        for (int q = 0; q < KT / 8; ++q) {
            const int pos0 = first + step * k + 8 * q;
            ahead_ids[q] = k < ntiles && pos0 < kv_len ? bt[pos0 >> bs_log2] : -1;
        }
    };
    read_ids(NS - 1);
    for (int k = 0; k < ntiles; ++k) {
        cp_async_wait<NS - 2>();                             // this thread's chunks of tile k landed
        group_sync(1 + wk, GT);                              // everyone's did; stage k-1 is free
        if (k + NS - 1 < ntiles) issue(k + NS - 1, [&](int q, int) { return ahead_ids[q]; });
        cp_async_commit();
        read_ids(k + NS);                                    // for the next iteration's issue
        const int base = first + step * k;
        if (base >= w_hi) continue;                          // no row of this warp needs these keys
        const unsigned char* kt = ring + (k % NS) * SB;
        const unsigned char* vt = kt + KT * RB;

        // S = Q K^T: n-tile nt covers tokens 8 nt .. 8 nt + 7; this lane reads token 8 nt + g,
        // dims 32 c + 8 t4 .. + 7 (fragment elements of k-steps 2c and 2c + 1).
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            if (KT > 16 && base + 8 * nt >= w_hi) continue;  // past every row's causal limit (masked below)
#pragma unroll
            for (int c = 0; c < NQ; ++c) {
                u32 kh[4], kl[4];
                read8<DT, KF, D>(kt, 8 * nt + g, 32 * c + 8 * t4, kh, kl);
                mma<CT>(s[nt], qh[0][c][0], qh[1][c][0], qh[0][c][1], qh[1][c][1], kh[0], kh[1]);
                mma<CT>(s[nt], qh[0][c][2], qh[1][c][2], qh[0][c][3], qh[1][c][3], kh[2], kh[3]);
                if constexpr (DT == 0) {
                    mma<CT>(s[nt], qh[0][c][0], qh[1][c][0], qh[0][c][1], qh[1][c][1], kl[0], kl[1]);
                    mma<CT>(s[nt], qh[0][c][2], qh[1][c][2], qh[0][c][3], qh[1][c][3], kl[2], kl[3]);
                    mma<CT>(s[nt], ql[0][c][0], ql[1][c][0], ql[0][c][1], ql[1][c][1], kh[0], kh[1]);
                    mma<CT>(s[nt], ql[0][c][2], ql[1][c][2], ql[0][c][3], ql[1][c][3], kh[2], kh[3]);
                }
            }
        }

        // Online softmax in the log2 domain. s[nt][e] is (row r0, token 8 nt + 2 t4 + e),
        // s[nt][2 + e] is (row r0 + 8, same token); a row's KT scores live on its 4 lanes.
        float corr[2];
        bool moved = false;
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const int pos = base + 8 * nt + 2 * t4 + (e & 1);
                float x = s[nt][e] * scale_log2;
                if (softcap_log2 > 0.f) x = softcap_log2 * tanhf(x / softcap_log2);
                x = pos < lim[i] && pos >= lo[i] ? x : NEG_INF;
                s[nt][e] = x;
                mx[i] = fmaxf(mx[i], x);
            }
        float msafe[2];
        moved = softmax_step(mx, m_run, l_run, msafe, corr);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - msafe[e >> 1]);
                l_run[e >> 1] += s[nt][e];
            }
        if (__any_sync(FULL_MASK, moved)) {                  // rare once the max settles
#pragma unroll
            for (int n = 0; n < 8 * NV; ++n) {
                acc[n][0] *= corr[0]; acc[n][1] *= corr[0];
                acc[n][2] *= corr[1]; acc[n][3] *= corr[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            if (KT > 16 && base + 16 * kk >= w_hi) break;     // all-zero P from here on
            // P as the A operand: (row r0, tokens 2t4, 2t4+1), (r0+8, same), then tokens + 8.
            u32 ph[4], pl[4];
            const float (&s0)[4] = s[2 * kk];
            const float (&s1)[4] = s[2 * kk + 1];
            ph[0] = pack2<CT>(s0[0], s0[1]); ph[1] = pack2<CT>(s0[2], s0[3]);
            ph[2] = pack2<CT>(s1[0], s1[1]); ph[3] = pack2<CT>(s1[2], s1[3]);
            if constexpr (DT == 0) {
                pl[0] = pack2<2>(s0[0] - bf16_low(ph[0]), s0[1] - bf16_high(ph[0]));
                pl[1] = pack2<2>(s0[2] - bf16_low(ph[1]), s0[3] - bf16_high(ph[1]));
                pl[2] = pack2<2>(s1[0] - bf16_low(ph[2]), s1[1] - bf16_high(ph[2]));
                pl[3] = pack2<2>(s1[2] - bf16_low(ph[3]), s1[3] - bf16_high(ph[3]));
            }
            // O += P V. This lane reads V tokens 2t4, 2t4+1, 8+2t4, 9+2t4 (of this 16-key step)
            // at dims 64c + 8g .. + 7; pairing two token rows gives the B operand of n-tile
            // (c, j), output dim 64c + 8g + j.
#pragma unroll
            for (int c = 0; c < NV; ++c) {
                u32 vh[4][4], vl[4][4];
#pragma unroll
                for (int rr = 0; rr < 4; ++rr)
                    read8<DT, KF, D>(vt, 16 * kk + 8 * (rr >> 1) + 2 * t4 + (rr & 1), 64 * c + 8 * g, vh[rr], vl[rr]);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 sel = (j & 1) ? 0x7632u : 0x5410u;
                    const int k2 = j >> 1;
                    const u32 b0 = __byte_perm(vh[0][k2], vh[1][k2], sel);
                    const u32 b1 = __byte_perm(vh[2][k2], vh[3][k2], sel);
                    mma<CT>(acc[8 * c + j], ph[0], ph[1], ph[2], ph[3], b0, b1);
                    if constexpr (DT == 0) {
                        mma<CT>(acc[8 * c + j], ph[0], ph[1], ph[2], ph[3],
                                __byte_perm(vl[0][k2], vl[1][k2], sel), __byte_perm(vl[2][k2], vl[3][k2], sel));
                        mma<CT>(acc[8 * c + j], pl[0], pl[1], pl[2], pl[3], b0, b1);
                    }
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
    float* so = smf + warp * RW * SROW;
    float* sm_m = smf + 4 * RW * SROW;
    float* sm_l = sm_m + 4 * RW;
#pragma unroll
    for (int c = 0; c < NV; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int d0 = 64 * c + 16 * t4 + j;                 // output cols 2t4, 2t4+1 of n-tile (c, j)
            float* o0 = so + g * SROW + d0;
            o0[0] = acc[8 * c + j][0];
            o0[8] = acc[8 * c + j][1];
            o0[8 * SROW] = acc[8 * c + j][2];
            o0[8 * SROW + 8] = acc[8 * c + j][3];
        }
    if (t4 == 0) {
        sm_m[warp * RW + g] = m_run[0]; sm_m[warp * RW + g + 8] = m_run[1];
        sm_l[warp * RW + g] = l_run[0]; sm_l[warp * RW + g + 8] = l_run[1];
    }
    __syncthreads();

    // One thread per row turns the warps' (m, l) into their weights 2^(m_w - M) / L, in
    // place of m_w, and the row's log-sum-exp, in place of l_w0; then each output element
    // is a weighted sum of smem reads (no exp or division per element).
    const int hq = num_kv_heads * group;
    const int rows = ntok * group;
    if (threadIdx.x < rows) {
        const int r = threadIdx.x, w0 = (r / RW) * warps_kv, lr = r % RW;
        float M = NEG_INF, L = 0.f;
#pragma unroll
        for (int w = w0; w < w0 + warps_kv; ++w) M = fmaxf(M, sm_m[w * RW + lr]);
        float f[warps_kv];
#pragma unroll
        for (int i = 0; i < warps_kv; ++i) {
            f[i] = M == NEG_INF ? 0.f : exp2f(sm_m[(w0 + i) * RW + lr] - M);
            L += f[i] * sm_l[(w0 + i) * RW + lr];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
        for (int i = 0; i < warps_kv; ++i) sm_m[(w0 + i) * RW + lr] = f[i] * inv;
        sm_l[w0 * RW + lr] = L > 0.f ? M + log2f(L) : NEG_INF;
    }
    __syncthreads();
    // Row r's output element d (normalized over this CTA's keys) and its log-sum-exp.
    auto row_out = [&](int r, int d) {
        const int w0 = (r / RW) * warps_kv, lr = r % RW;
        float o = 0.f;
#pragma unroll
        for (int w = w0; w < w0 + warps_kv; ++w) o += sm_m[w * RW + lr] * smf[(w * RW + lr) * SROW + d];
        return o * v_scale;
    };
    auto row_lse = [&](int r) { return sm_l[(r / RW) * warps_kv * RW + r % RW]; };
    auto out_row = [&](int r) {
        const int tok = r / group;
        return (i64)(q_begin + tok0 + tok) * hq + kvh * group + (r - tok * group);
    };
    if constexpr (PAIR) {
        // Split-KV in a cluster of two CTAs (Hopper): split 1 writes its rows and their
        // log-sum-exps into split 0's shared memory, past split 0's rings (split 0 may still be
        // streaming keys), and arrives at the cluster barrier; split 0 waits there and combines
        // them with its own rows. No partials in global memory, no arrival counter, one barrier
        // in place of an L2 atomic and the partials' reads.
        constexpr int PR = RW * warps_row;                   // most rows of a CTA tile
        float* recv = reinterpret_cast<float*>(smem + pair_recv_offset<ES, D, WKV, NS, KT>());
        if (cluster_rank() == 1) {
            float* dst = cluster_map(recv, 0);
            for (int idx = threadIdx.x; idx < rows * DA; idx += blockDim.x) {
                const int r = idx / DA, d = idx - r * DA;
                dst[r * D + d] = row_out(r, d);
                if (d == 0) dst[PR * D + r] = row_lse(r);
            }
            cluster_arrive();                                // release: the rows above are visible
            return;                                          // no one reads this CTA's memory
        }
        cluster_arrive();
        cluster_wait();                                      // acquire: split 1's rows are here
        for (int idx = threadIdx.x; idx < rows * DA; idx += blockDim.x) {
            const int r = idx / DA, d = idx - r * DA;
            const float l0 = row_lse(r), l1 = recv[PR * D + r];
            const float M = fmaxf(l0, l1);
            float o = 0.f;
            if (M != NEG_INF) {
                const float a0 = exp2f(l0 - M), a1 = exp2f(l1 - M);
                o = (a0 * row_out(r, d) + a1 * recv[r * D + d]) / (a0 + a1);
            }
            out[out_row(r) * DA + d] = from_f32<DT>(o);
        }
    } else {
        // Partials: row r of split s at part_row(r, s); the splits of one row lie split_stride
        // rows apart. Page-aware attention numbers them by work item (item0 + s; an item's rows
        // are its tile's tq tokens, one in decode, x all query heads), the fixed grid by (token,
        // head, split).
        const int item0 = (int)blockIdx.x / num_kv_heads - split;  // the tile's first item
        const int tqp = cu_seqlens ? tq : 1;
        const i64 split_stride = paged ? (i64)tqp * hq : 1;
        auto part_row = [&](int r, int s) {
            const int tok = r / group;
            return paged ? ((i64)(item0 + s) * tqp + tok) * hq + kvh * group + (r - tok * group)
                         : out_row(r) * num_splits + s;
        };
        for (int idx = threadIdx.x; idx < rows * DA; idx += blockDim.x) {
            const int r = idx / DA, d = idx - r * DA;
            const float o = row_out(r, d);
            if (nsplit == 1) {
                out[out_row(r) * DA + d] = from_f32<DT>(o);
            } else {
                const i64 pi = part_row(r, split);
                part_o[pi * D + d] = o;
                if (d == 0) part_lse[pi] = row_lse(r);
            }
        }
        if (nsplit == 1 || counters == nullptr) return;      // merge_splits_kernel follows

        // Fused merge: the last split CTA of this (tile, KV head) to finish merges its rows,
        // saving a launch and its latency (what dominates small batches).
        int* flag = reinterpret_cast<int*>(sm_l + 4 * RW);
        __syncthreads();                                     // every partial of this CTA is written
        if (threadIdx.x == 0) {
            const int expected = paged ? nsplit : splits_run(cta_hi - kv_lo, chunk_c, nsplit);
            int* c = counters + (paged ? (i64)item0 * num_kv_heads + kvh : (i64)blockIdx.x * gridDim.y + blockIdx.y);
            const int last = arrive(c) == expected - 1;
            if (last) *c = 0;                                // ready for the next call on this stream
            *flag = last;
        }
        __syncthreads();                                     // after thread 0's acquire: partials visible
        if (!*flag) return;
        for (int r = warp; r < rows; r += 4) {
            const int lim = min(first_pos + tok0 + r / group + 1, kv_len);
            const int ns = lim <= 0 ? 0 : paged ? nsplit : splits_run(lim - kv_lo, chunk_c, nsplit);
            const i64 p0 = part_row(r, 0);
            merge_row<DT, D, DA>(part_lse + p0, part_o + p0 * D, split_stride, out + out_row(r) * DA, ns, lane);
        }
    }
}

template <int DT, int DA, int KF, int WKV, int NS, int KT>
__global__ void __launch_bounds__(128) paged_attention_kernel(ATTENTION_PARAMS_KV(typename Kv<DT, KF>::T)) {
    attention_cta<DT, DA, KF, WKV, NS, KT, false>(ATTENTION_ARGS);
}

#if KVPOOL_CLUSTERS
// Decode with exactly two splits: each cluster of two CTAs is one (tile, KV head).
template <int DT, int DA, int KF, int WKV, int NS, int KT>
__global__ void __cluster_dims__(1, 1, 2) __launch_bounds__(128) paged_attention_pair_kernel(ATTENTION_PARAMS_KV(typename Kv<DT, KF>::T)) {
    attention_cta<DT, DA, KF, WKV, NS, KT, true>(ATTENTION_ARGS);
}
#endif

// What a prefill work item (a CTA of the prefill kernels, or one item of a persistent CTA's
// queue) works on: its (sequence, query tile, KV head) and key bounds. Items are numbered
// with the KV head fastest and run in that order (CTAs start in order of blockIdx; a
// persistent CTA takes the next number from a counter), so every KV head's longest tiles
// (the last of each sequence) start first. n_items is an upper bound on the tiles times the
// KV heads: an item past the real tiles is empty (false).
struct PrefillTile { int b, kvh, q_begin, tok0, ntok, kv_len, first_pos, cta_hi, nrows; };
__device__ __forceinline__ bool prefill_tile(const int* cu_seqlens, const int* seq_lens, int num_seqs, int num_kv_heads,
                                             int max_blocks, int bs_log2, int group, int tq, int item, int n_items,
                                             PrefillTile& t) {
    t.kvh = item % num_kv_heads;
    const int x = n_items / num_kv_heads - 1 - item / num_kv_heads;
    int tile;
    if (!locate_tile_scan(cu_seqlens, num_seqs, tq, x, t.b, tile)) return false;
    t.q_begin = cu_seqlens[t.b];
    const int q_len = cu_seqlens[t.b + 1] - t.q_begin;
    t.tok0 = tile * tq;
    t.ntok = min(tq, q_len - t.tok0);
    if (t.ntok <= 0) return false;
    const int seq_len = seq_lens[t.b];
    t.kv_len = min(seq_len, max_blocks << bs_log2);
    t.first_pos = seq_len - q_len;
    t.cta_hi = max(0, min(t.kv_len, t.first_pos + t.tok0 + t.ntok));
    t.nrows = t.ntok * group;
    return true;
}

// A prefill tile's BM query rows from row0 on into shared memory by cp.async, zeros past the
// last row: row r is (token r / group, head r % group of KV head t.kvh); 16-byte chunk c of
// row r goes to byte offset(r, c). Threads take consecutive chunks (CPR per row, LR rows per pass).
template <int BM, int LR, int CPR, typename T, typename Offset>
__device__ __forceinline__ void load_q_tile(unsigned char* qs, const T* q, i64 q_stride_t, i64 q_stride_h,
                                            const PrefillTile& t, int group, int tid, Offset offset, int row0 = 0) {
    const int lc = tid % CPR;
#pragma unroll
    for (int p = 0; p < BM / LR; ++p) {
        const int r = row0 + p * LR + tid / CPR;
        const int tok = r / group, head = r - tok * group;
        const bool ok = r < t.nrows;
        const T* src = q + (ok ? (i64)(t.q_begin + t.tok0 + tok) * q_stride_t + (i64)(t.kvh * group + head) * q_stride_h : 0);
        cp_async16(qs + offset(r, lc), reinterpret_cast<const unsigned char*>(src) + 16 * lc, ok);
    }
}

// Writes a lane's share of prefill row r (if the tile has it) from MMA accumulators: the
// lane holds head dims 8 n + 2 t4 and + 1 (acc(n, 0), acc(n, 1), unnormalized; l is the
// lane's part of the row sum). One 4-byte store per n-tile: a quad covers 16 bytes.
template <int DT, int D, typename Acc>
__device__ __forceinline__ void store_prefill_row(typename Store<DT>::T* out, const PrefillTile& t, int group, int hq,
                                                  int r, float l, int t4, Acc acc) {
    l += __shfl_xor_sync(FULL_MASK, l, 1);
    l += __shfl_xor_sync(FULL_MASK, l, 2);
    if (r >= t.nrows) return;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int tok = r / group;
    const i64 row = (i64)(t.q_begin + t.tok0 + tok) * hq + t.kvh * group + (r - tok * group);
    u32* o = reinterpret_cast<u32*>(out + row * D) + t4;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[4 * n] = pack2<DT>(acc(n, 0) * inv, acc(n, 1) * inv);
}

// Swizzle of the prefill kernel's tiles: chunk j of row r sits at chunk j ^ swz_p(r).
// swz_p is a bijection on r % 8 (ldmatrix's 8 rows of one chunk hit 8 bank groups) whose
// values for rows 2q and 2q + 1 differ in bit 2 (a quarter-warp reading rows 2q, 2q + 1 x
// chunks 4c .. 4c + 3, the Q and K fragment reads, hits 8 bank groups too).
__device__ __forceinline__ int swz_p(int r) { return ((r & 1) << 2) | ((r >> 1) & 3); }

// Dedicated prefill (16-bit types, head_dim 64/128): a CTA of NW warps owns RW = 16 MT
// query rows per warp (16 MT NW per CTA) of one KV head and walks the keys in 64-key tiles.
// Per tile: one cp.async group (K and V, NS-stage ring), one __syncthreads, then per warp
// S = Q K^T over 64 keys (with 4 warps, Q fragments re-read from shared memory, so
// registers hold the 64-key S and the output accumulators only), one online-softmax
// step (masking only on tiles that cross a row's causal limit) and O += P V. Rows are written straight from
// registers: no split-KV, no cross-warp merge. V fragments come from ldmatrix.trans.
// The grid runs the longest query tiles (the last ones of each sequence) first.
// NW = 8 (with MT = 1, NS = 3): 8 warps x 16 rows = 128 rows per CTA, so each K/V byte
// brought from L2 serves as many rows as MT = 2 while each warp keeps MT = 1's registers
// (no spill at one CTA per SM, 255 registers allowed); with that room the warp keeps its
// Q fragments in registers (read from shared memory once, not once per tile), and a
// 3-stage ring keeps two tiles in flight while the single CTA on the SM computes.
template <int DT, int D, int MT, int NW = 4, int NS = 2>
__global__ void __launch_bounds__(32 * NW, 8 / NW) prefill_kernel(
    ATTENTION_PARAMS)
{
    static_assert(DT != 0 && (D == 64 || D == 128), "16-bit types, head_dim 64 or 128");
    using T = typename Store<DT>::T;
    constexpr int KT = 64;                     // keys per tile
    constexpr int RB = D * 2;                  // bytes per K/V/Q row
    constexpr int CPR = RB / 16;               // 16-byte chunks per row
    static_assert((NW == 4 || NW == 8) && NS >= 2, "4 or 8 warps, 2+ stages");
    constexpr int NTH = 32 * NW;               // threads per CTA
    constexpr bool QREG = NW == 8;             // Q fragments live in registers
    constexpr int RW = 16 * MT;                // rows per warp
    constexpr int BM = NW * RW;                // rows per CTA
    constexpr int NT = KT / 8;                 // 8-key n-tiles of S
    constexpr int NQ = D / 32;                 // 8-element Q/K chunks per lane (two k-steps each)
    constexpr int NV = D / 64;                 // 64-dim V chunks (eight n-tiles each)
    constexpr int SB = 2 * KT * RB;            // one stage: KT K rows then KT V rows
    constexpr int LR = NTH / CPR;              // rows per fill pass
    constexpr int LP = KT / LR;                // fill passes per tensor and tile
    extern __shared__ uint4 smem4[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(smem4);
    unsigned char* qs = smem;                  // BM rows of Q, swizzled like K
    unsigned char* ring = smem + BM * RB;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
    const int g = lane >> 2, t4 = lane & 3;
    PrefillTile pt;                            // BM / group query tokens per CTA
    if (!prefill_tile(cu_seqlens, seq_lens, num_seqs, num_kv_heads, max_blocks, bs_log2, group, BM / group,
                      blockIdx.x, gridDim.x, pt))
        return;
    const int nrows = pt.nrows, kv_len = pt.kv_len;
    const int q0 = pt.first_pos + pt.tok0;     // position of the tile's first token
    const int ntiles = (pt.cta_hi + KT - 1) / KT;

    // Q tile -> shared memory, in the first cp.async group.
    load_q_tile<BM, LR, CPR>(qs, q, q_stride_t, q_stride_h, pt, group, tid,
                             [](int r, int c) { return r * RB + ((c ^ swz_p(r)) << 4); });
    // Tile k's K and V rows: pass p covers rows p LR .. + LR - 1 (whole 8-key groups,
    // never straddling a block); consecutive threads copy consecutive 16-byte chunks.
    const int* bt = block_tables + (i64)pt.b * bt_stride;
    const int bs_mask = (1 << bs_log2) - 1;
    const int head_row = pt.kvh << bs_log2;
    const unsigned char* kb = reinterpret_cast<const unsigned char*>(k_cache);
    const unsigned char* vb = reinterpret_cast<const unsigned char*>(v_cache);
    const int lrow = tid / CPR, lcol = tid % CPR;
    auto issue = [&](int k) {
        unsigned char* st = ring + (k % NS) * SB;
        int ids[LP];
#pragma unroll
        for (int p = 0; p < LP; ++p) {                  // table reads first (all in flight), then the copies
            const int pos = KT * k + p * LR + lrow;
            ids[p] = pos < kv_len ? bt[pos >> bs_log2] : -1;
        }
#pragma unroll
        for (int p = 0; p < LP; ++p) {
            const int r = p * LR + lrow;
            const bool ok = (unsigned)ids[p] < (unsigned)num_blocks;
            const i64 row_el = (i64)(head_row + ((KT * k + r) & bs_mask)) * D;
            const i64 ko = ok ? ((i64)ids[p] * k_stride + row_el) * 2 + 16 * lcol : 0;
            const i64 vo = ok ? ((i64)ids[p] * v_stride + row_el) * 2 + 16 * lcol : 0;
            const int xo = r * RB + ((lcol ^ swz_p(r)) << 4);
            cp_async16(st + xo, kb + ko, ok);
            cp_async16(st + KT * RB + xo, vb + vo, ok);
        }
    };
#pragma unroll
    for (int k = 0; k < NS - 1; ++k) {                  // tiles 0 .. NS - 2 in flight (Q with tile 0)
        if (k < ntiles) issue(k);
        cp_async_commit();
    }

    // This lane's rows: m-tile m, half i -> row RW warp + 16 m + g + 8 i = (token, head).
    int lim[MT][2];
    int lo = 0x7fffffff, hi = 0;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = RW * warp + 16 * m + g + 8 * i;
            const bool valid = r < nrows;
            lim[m][i] = valid ? max(0, min(q0 + r / group + 1, kv_len)) : 0;
            if (valid) { lo = min(lo, lim[m][i]); hi = max(hi, lim[m][i]); }
        }
    // 16-byte chunk j of row r of a tile, as four registers (elements 2k, 2k + 1 in reg k).
    auto chunk_at = [](const unsigned char* tile, int r, int j) {
        return *reinterpret_cast<const uint4*>(tile + r * RB + ((j ^ swz_p(r)) << 4));
    };
    const int w_hi = __reduce_max_sync(FULL_MASK, hi);     // keys past this: no row of the warp
    const int w_lo = -__reduce_max_sync(FULL_MASK, -lo);   // keys below this: every row, unmasked

    float acc[MT][8 * NV][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < 8 * NV; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) m_run[m][0] = m_run[m][1] = NEG_INF, l_run[m][0] = l_run[m][1] = 0.f;

    uint4 qreg[QREG ? NQ : 1][MT][2];                       // QREG: this lane's Q fragments, all tiles
    for (int k = 0; k < ntiles; ++k) {
        cp_async_wait<NS - 2>();                           // tile k (and Q) landed for this thread
        __syncthreads();                                   // for all threads; tile k - 1 is consumed
        if (k + NS - 1 < ntiles) issue(k + NS - 1);        // into tile k - 1's stage
        cp_async_commit();
        if constexpr (QREG) {
            if (k == 0) {
#pragma unroll
                for (int c = 0; c < NQ; ++c)
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int i = 0; i < 2; ++i) qreg[c][m][i] = chunk_at(qs, RW * warp + 16 * m + g + 8 * i, 4 * c + t4);
            }
        }
        const int base = KT * k;
        if (base >= w_hi) continue;
        const unsigned char* kt = ring + (k % NS) * SB;
        const unsigned char* vt = kt + KT * RB;

        // S = Q K^T (lane: token 8 nt + g of K, dims 32 c + 8 t4 .. + 7 of Q and K).
        float s[MT][NT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[m][nt][0] = s[m][nt][1] = s[m][nt][2] = s[m][nt][3] = 0.f;
#pragma unroll
        for (int c = 0; c < NQ; ++c) {
            uint4 qa[MT][2];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if constexpr (QREG) qa[m][i] = qreg[c][m][i];
                    else qa[m][i] = chunk_at(qs, RW * warp + 16 * m + g + 8 * i, 4 * c + t4);
                }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if (base + 8 * nt >= w_hi) break;            // masked below, never read by P V
                const uint4 kh = chunk_at(kt, 8 * nt + g, 4 * c + t4);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma<DT>(s[m][nt], qa[m][0].x, qa[m][1].x, qa[m][0].y, qa[m][1].y, kh.x, kh.y);
                    mma<DT>(s[m][nt], qa[m][0].z, qa[m][1].z, qa[m][0].w, qa[m][1].w, kh.z, kh.w);
                }
            }
        }

        // Online softmax in the log2 domain; s[m][nt][e]: row half e >> 1, key 8 nt + 2 t4 + (e & 1).
        const bool masked = base + KT > w_lo;              // a diagonal (or last) tile for this warp
        float corr[MT][2];
        bool moved = false;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[m][nt][e] * scale_log2;
                    if (masked && base + 8 * nt + 2 * t4 + (e & 1) >= lim[m][e >> 1]) x = NEG_INF;
                    s[m][nt][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
            float msafe[2];
            moved = softmax_step(mx, m_run[m], l_run[m], msafe, corr[m]) || moved;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[m][nt][e] = exp2f(s[m][nt][e] - msafe[e >> 1]);
                    l_run[m][e >> 1] += s[m][nt][e];
                }
        }
        if (__any_sync(FULL_MASK, moved)) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < 8 * NV; ++n) {
                    acc[m][n][0] *= corr[m][0]; acc[m][n][1] *= corr[m][0];
                    acc[m][n][2] *= corr[m][1]; acc[m][n][3] *= corr[m][1];
                }
        }

        // O += P V, 16 keys per step. One ldmatrix.x4.trans gives the B operands of two
        // 8-dim n-tiles (matrices: keys 0-7 / 8-15 x dims 16 n2 .. + 7, then + 8 .. + 15);
        // lane l addresses key 16 kk + 8 ((l >> 3) & 1) + (l & 7), chunk 2 n2 + (l >> 4).
        // P comes straight from the S accumulators.
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            if (base + 16 * kk >= w_hi) break;
            u32 ph[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const float (&s0)[4] = s[m][2 * kk];
                const float (&s1)[4] = s[m][2 * kk + 1];
                ph[m][0] = pack2<DT>(s0[0], s0[1]); ph[m][1] = pack2<DT>(s0[2], s0[3]);
                ph[m][2] = pack2<DT>(s1[0], s1[1]); ph[m][3] = pack2<DT>(s1[2], s1[3]);
            }
            const int vr = 16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7);
            const unsigned char* vrow = vt + vr * RB;
            const int vx = swz_p(vr);
#pragma unroll
            for (int n2 = 0; n2 < D / 16; ++n2) {
                u32 vb4[4];
                ldsm_x4_trans(vrow + (((2 * n2 + (lane >> 4)) ^ vx) << 4), vb4);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma<DT>(acc[m][2 * n2], ph[m][0], ph[m][1], ph[m][2], ph[m][3], vb4[0], vb4[1]);
                    mma<DT>(acc[m][2 * n2 + 1], ph[m][0], ph[m][1], ph[m][2], ph[m][3], vb4[2], vb4[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: rows written straight from the accumulators (C columns of n-tile n).
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 2; ++i)
            store_prefill_row<DT, D>(out, pt, group, num_kv_heads * group, RW * warp + 16 * m + g + 8 * i, l_run[m][i], t4,
                                     [&](int n, int j) { return acc[m][n][2 * i + j]; });
}

// One warp per (query token, head), when the attention kernel did not merge (never with a
// sliding window: the host merges those in the attention kernel).
template <int DT, int DA, int KF>
__global__ void __launch_bounds__(128) merge_splits_kernel(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, typename Store<DT>::T* __restrict__ out,
    const int* __restrict__ seq_lens, const int* __restrict__ cu_seqlens, int num_seqs, int num_tokens, int max_blocks,
    int bs_log2, int hq, int num_splits, int chunk)
{
    constexpr int D = Pad<DA, KF>::D;          // the attention kernel's partial rows
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
    const int ns = lim <= 0 ? 0 : splits_run(lim, chunk, num_splits);
    merge_row<DT, D, DA>(part_lse + row * num_splits, part_o + row * num_splits * D, 1, out + row * DA, ns, lane);
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
