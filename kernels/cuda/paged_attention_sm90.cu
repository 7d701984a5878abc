// CUDA C++ source of the Hopper prefill kernel (sm_90a: warpgroup MMA), compiled appended
// to paged_attention.cu (cuda_runtime.compile_sm90a).
//
// prefill_wg_kernel<DT, D> computes what prefill_kernel in paged_attention.cu computes
// (same arguments, same rows, same causal rule), but on Hopper's asynchronous warpgroup
// MMA (wgmma.mma_async) instead of mma.sync: a warpgroup (4 warps, 128 threads) multiplies
// a 64-row tile in one instruction per 16-wide k-step, reading its operands straight from
// shared memory through matrix descriptors, so no lane spends instructions or registers
// loading fragments. This is how SDPA's Hopper kernels (FlashAttention-3, cuDNN) reach a far
// larger share of the tensor cores' peak than the mma.sync prefill can
// (benchmarks/NOTES-kernels.md).
//
// Layout: every tile (Q, K, V) is stored as 128-byte panels of 64 head dims, rows 128
// bytes apart, with the hardware's 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r % 8)), so that one descriptor per k-step describes it. S = Q K^T reads Q and K
// "K-major" (head dims contiguous); O += P V takes P from registers (the S accumulators
// re-packed to 16 bits, the layout that mma.sync uses too) and V "MN-major" (transposed by
// the MMA unit itself). K and V arrive by TMA (the copy engine), one box per pool block,
// through a 3-stage ring that a producer warpgroup of its own keeps full
// (FlashAttention-3's warp specialization, registers moved to the MMA warpgroups by
// setmaxnreg); cuda_tma.py makes the tensor maps of the pool that the kernel reads. Q
// arrives once, by cp.async.
//
// Compiled only for sm_90a: wgmma exists on no other architecture, so the planner uses
// this kernel only on a device of compute capability 9.0.

typedef unsigned long long u64;

// ---- Warpgroup MMA primitives (sm_90a) ----
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets (all in 16-byte units). K-major operands: rows 128 bytes apart,
// 8-row groups SBO = 1024 bytes apart, LBO unused (1). MN-major: LBO = the distance
// between 64-element panels, SBO = 1024 bytes between 8-row groups of the k axis.
__device__ __forceinline__ u64 gmma_desc(u32 addr, u32 lbo16, u32 sbo16) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo16 & 0x3FFF) << 16) | ((u64)(sbo16 & 0x3FFF) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// cp.async writes shared memory through the generic proxy, wgmma reads it through the
// async proxy: each thread orders its own completed copies before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Keeps the compiler from moving accumulator registers across an MMA in flight.
template <int R> __device__ __forceinline__ void reg_fence(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// mbarriers and TMA (bulk tensor copies global -> shared, completion counted in bytes).
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
    asm volatile("{\n.reg .pred P1;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@!P1 bra WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
// One box of a 3-D tensor map (coordinates innermost first) into shared memory at dst.
__device__ __forceinline__ void tma_load_3d(u32 dst, const void* map, u32 bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// Named barriers (id 0 is __syncthreads): sync waits for `count` threads, arrive only counts.
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}
// Register reallocation between warpgroups (every warp of a warpgroup executes the same one).
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N)); }
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N)); }

template <int N, int DT> struct Wg;
// One Wg<N, DT> per (N, type): ss (A and B from shared memory, S = Q K^T; ss0 its first
// k-step, D = A B, with D only written so that S is not live between one tile's softmax
// and the next tile's S) and rs (A from registers, B transposed: O += P V). Written out
// per N because inline PTX names every accumulator register (AB: the PTX type of A and B);
// tests/kernels/test_cuda_source.py generates this text again and checks it.
#define KVPOOL_WG_64(DT, AB) \
template <> struct Wg<64, DT> { \
    static __device__ __forceinline__ void ss(float (&d)[32], u64 a, u64 b, int accumulate) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
            : "l"(a), "l"(b), "r"(accumulate)); \
    } \
    static __device__ __forceinline__ void ss0(float (&d)[32], u64 a, u64 b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]) \
            : "l"(a), "l"(b), "r"(0)); \
    } \
    static __device__ __forceinline__ void rs(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1)); \
    } \
};
#define KVPOOL_WG_128(DT, AB) \
template <> struct Wg<128, DT> { \
    static __device__ __forceinline__ void ss(float (&d)[64], u64 a, u64 b, int accumulate) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "l"(a), "l"(b), "r"(accumulate)); \
    } \
    static __device__ __forceinline__ void ss0(float (&d)[64], u64 a, u64 b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]) \
            : "l"(a), "l"(b), "r"(0)); \
    } \
    static __device__ __forceinline__ void rs(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1)); \
    } \
};
KVPOOL_WG_64(1, "f16")
KVPOOL_WG_64(2, "bf16")
KVPOOL_WG_128(1, "f16")
KVPOOL_WG_128(2, "bf16")

// Byte offset of 16-byte chunk c of row r in a tile of 128-byte panels (panel_bytes each).
__device__ __forceinline__ int sw128(int r, int c, int panel_bytes) {
    return (c >> 3) * panel_bytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Prefill on warpgroup MMA: a CTA of NWG warpgroups owns 64 NWG query rows ((token, head)
// pairs of one GQA group, as in prefill_kernel) of one KV head and walks the keys in tiles
// of KN through an NS-stage ring that TMA fills.
//
// Synchronization, FlashAttention-3 style, no CTA-wide barrier in the loop:
// * full[s]: the tile in stage s landed (TMA's byte count); every thread waits on it.
// * empty[s]: every consumer warp has finished the tile in stage s (one arrival per warp,
//   after its warpgroup's MMAs on it completed); the producer waits on it before refilling s.
// * The producer is a warpgroup of its own, after the NWG consumer (MMA) warpgroups: its
//   first warp's lane j loads pool block j of a tile, one box of 64 head dims x block_size
//   rows per panel and tensor, which the copy engine writes in the same 128-byte swizzle the
//   MMA descriptors read. A block id past the sequence or out of range becomes num_blocks,
//   a coordinate outside the map: zeros. Its other warps only hand their registers over
//   (setmaxnreg: 40 per producer thread, 232 per consumer thread, FlashAttention-3's split of
//   the register file). A warpgroup of its own, not the first warp of a consumer warpgroup,
//   whose MMAs would then wait for it every tile (benchmarks/NOTES-kernels.md).
// * Ping-pong (two warpgroups): named barriers make the warpgroups take turns issuing their
//   MMAs, so one warpgroup's softmax runs while the other's MMAs keep the tensor cores busy.
// * A warpgroup issues tile k - 1's O += P V and then tile k's S = Q K^T as one group and
//   waits once. Issuing S first and running the softmax beside P V (FlashAttention-3's
//   intra-warpgroup overlap) keeps the two accumulators and P live at once, which spills in
//   the registers left after the producer warpgroup's share, and was the slower
//   (benchmarks/NOTES-kernels.md). One wait also frees tile k - 1 before the softmax.
// A warpgroup whose rows end before a tile skips its MMAs (uniform over the warpgroup, as
// wgmma requires) but keeps taking part in the barriers.
//
// PERSIST: one CTA per SM runs work items (query tiles, prefill_tile) one after another,
// the next number taken from a counter (counters[0]; the CTA that finishes last zeroes it
// and counters[1], so the next launch and a graph's next replay find zeros), so that what a
// CTA pays once (its start, the first K/V tiles' and Q's latency, the epilogue) no longer
// leaves the tensor cores idle: with short query tiles (small prompts, a few tiles each)
// that was most of a CTA's time. The producer looks the items up and hands them over in a
// queue of two in shared memory (item_full / item_empty, as full / empty), then streams
// the item's K/V tiles on through the same ring, so the next item's first tiles load while
// the consumers finish this one. A consumer warpgroup loads the next item's Q rows (its own
// 64, which only its own S MMAs read) as soon as its last S MMA of this item completed,
// behind that tile's softmax, the last P V and the epilogue.
//
// Shape, the fastest of the shapes timed (benchmarks/NOTES-kernels.md): 2 consumer warpgroups
// (128 rows), 128-key tiles, 3 stages (225 KiB of shared memory, one CTA per SM). One
// warpgroup per CTA, 64- or 96-key tiles, 4-5 stages and no ping-pong were all slower.
constexpr int WG_GROUPS = 2, WG_KEYS = 128, WG_STAGES = 3;

template <int DT, int D, bool PERSIST = false>
__global__ void __launch_bounds__(128 * (WG_GROUPS + 1), 1) prefill_wg_kernel(
    ATTENTION_PARAMS, const void* __restrict__ k_map, const void* __restrict__ v_map)
{
    static_assert(DT != 0 && (D == 64 || D == 128), "16-bit types, head_dim 64 or 128");
    using T = typename Store<DT>::T;
    constexpr int NWG = WG_GROUPS, KN = WG_KEYS, NS = WG_STAGES;
    static_assert(NWG == 2 && NS >= 3 && KN % 64 == 0, "two warpgroups take turns; 3+ stages");
    constexpr int NTH = 128 * NWG;             // consumer threads (the MMA warpgroups)
    constexpr int BM = 64 * NWG;               // rows per CTA
    constexpr int CPR = D / 8;                 // 16-byte chunks per row
    constexpr int QP = BM * 128;               // bytes per Q panel (64 head dims)
    constexpr int KP = KN * 128;               // bytes per K or V panel
    constexpr int TB = (D / 64) * KP;          // one K (or V) tile
    constexpr int SB = 2 * TB;                 // one stage: K tile, then V tile
    constexpr int LR = NTH / CPR;              // Q rows per fill pass
    static_assert(BM % LR == 0, "whole fill passes");
    extern __shared__ uint4 smem4[];
    // Swizzled tiles must start on 1024 bytes (the swizzle pattern's period); the host
    // asks for 1 KiB more than the tiles and barriers need.
    const u32 raw = smem_addr(smem4);
    unsigned char* smem = reinterpret_cast<unsigned char*>(smem4) + ((1024 - (raw & 1023)) & 1023);
    unsigned char* qs = smem;
    unsigned char* ring = smem + (D / 64) * QP;
    u64* full = reinterpret_cast<u64*>(ring + NS * SB);
    u64* empty = full + NS;
    u64* item_full = empty + NS;               // PERSIST: the queue of work items
    u64* item_empty = item_full + 2;
    PrefillTile* queue = reinterpret_cast<PrefillTile*>(item_empty + 2);

    // Warp and warpgroup indices through a shuffle: the compiler then knows them (and all
    // that derives from them, such as which tiles a warpgroup skips) to be warp-uniform, and
    // does not serialize the wgmma instructions behind branches it would think divergent.
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = __shfl_sync(FULL_MASK, tid >> 5, 0), wg = warp >> 2, wl = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const bool producer = warp == 4 * NWG;
    const int n_items = PERSIST ? num_splits * num_kv_heads : gridDim.x;
    auto locate = [&](int item, PrefillTile& t) {              // BM / group query tokens per item
        return prefill_tile(cu_seqlens, seq_lens, num_seqs, num_kv_heads, max_blocks, bs_log2, group, BM / group,
                            item, n_items, t);
    };
    PrefillTile pt;                                            // this CTA's item (PERSIST: the producer's)
    if (!PERSIST && !locate(blockIdx.x, pt)) return;

    const int tile_blocks = KN >> bs_log2;
    auto tma_block = [&](const PrefillTile& t, int k) {        // this lane's block id in tile k of item t
        const int pos = KN * k + (lane << bs_log2);
        const int id = lane < tile_blocks && pos < t.kv_len ? block_tables[(i64)t.b * bt_stride + (pos >> bs_log2)] : -1;
        return (unsigned)id < (unsigned)num_blocks ? id : num_blocks;
    };
    auto tma_issue = [&](int slot, int kvh, int blk) {
        const u32 bar = smem_addr(full + slot);
        if (lane == 0) mbar_expect_tx(bar, 2 * KN * D * 2);
        __syncwarp();
        if (lane < tile_blocks) {
            const u32 st = smem_addr(ring + slot * SB) + (lane << bs_log2) * 128;
#pragma unroll
            for (int p = 0; p < D / 64; ++p) {
                tma_load_3d(st + p * KP, k_map, bar, 64 * p, kvh << bs_log2, blk);
                tma_load_3d(st + TB + p * KP, v_map, bar, 64 * p, kvh << bs_log2, blk);
            }
        }
    };
    // Start-up, with its global reads overlapped: barriers, the Q tile by cp.async (consumer
    // threads), the producer's block ids of the first NS tiles, which go out by TMA as soon as
    // the barriers are initialized, while Q is still on its way.
    if (tid == 0) {
#pragma unroll
        for (int st = 0; st < NS; ++st) {
            mbar_init(smem_addr(full + st), 1);
            mbar_init(smem_addr(empty + st), 4 * NWG);
        }
        if (PERSIST) {
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                mbar_init(smem_addr(item_full + st), 1);
                mbar_init(smem_addr(item_empty + st), 4 * NWG);
            }
        }
        mbar_init_fence();
    }
    if constexpr (!PERSIST) {
        const int ntiles = (pt.cta_hi + KN - 1) / KN;
        if (tid < NTH)
            load_q_tile<BM, LR, CPR>(qs, q, q_stride_t, q_stride_h, pt, group, tid, [](int r, int c) { return sw128(r, c, QP); });
        cp_async_commit();
        int blk[NS];                                           // the producer's block ids of tiles 0 .. NS - 1
#pragma unroll
        for (int k = 0; k < NS; ++k) blk[k] = producer && k < ntiles ? tma_block(pt, k) : 0;
        __syncthreads();                                       // barriers initialized
        if (producer) {
#pragma unroll
            for (int k = 0; k < NS; ++k)
                if (k < ntiles) tma_issue(k, pt.kvh, blk[k]);
        }
        cp_async_wait<0>();                                    // Q landed for this thread
        fence_async_smem();
    }
    __syncthreads();                                           // and for all (PERSIST: barriers initialized)
    if (wg == NWG) {
        // The producer warpgroup: its first warp refills each stage as soon as every consumer
        // warp released it (the next tile's block id is read before the wait, so that its
        // latency hides behind it). 40 + 2 x 232 registers per thread fit the register file.
        setmaxnreg_dec<40>();
        if (!producer) return;
        if constexpr (!PERSIST) {
            const int ntiles = (pt.cta_hi + KN - 1) / KN;
            int next_blk = NS < ntiles ? tma_block(pt, NS) : 0;
            for (int t = NS; t < ntiles; ++t) {
                const int b = next_blk;
                if (t + 1 < ntiles) next_blk = tma_block(pt, t + 1);
                mbar_wait(smem_addr(empty + t % NS), (t / NS - 1) & 1);
                tma_issue(t % NS, pt.kvh, b);
            }
        } else {
            // Items: this CTA's number first, then one from the counter each time the producer
            // has issued an item's last tile (NS tiles before the consumers need the next). Not
            // sooner: a CTA that took its next number while starting a long item would hold that
            // item back for all of the long one (a tail of two long items on one SM).
            auto take = [&]() { return __shfl_sync(FULL_MASK, lane == 0 ? atomicAdd(counters, 1) : 0, 0) + (int)gridDim.x; };
            int item = blockIdx.x, tile = 0;                   // tile: K/V tiles issued so far
            for (int j = 0;; ++j) {
                bool ok = false;
                while (item < n_items && !(ok = locate(item, pt))) item = take();
                if (j >= 2) mbar_wait(smem_addr(item_empty + (j & 1)), ((j >> 1) - 1) & 1);
                if (lane == 0) {
                    if (!ok) pt.nrows = -1;                    // the end of the queue
                    queue[j & 1] = pt;
                    mbar_arrive(smem_addr(item_full + (j & 1)));
                }
                if (!ok) break;
                const int ntiles = (pt.cta_hi + KN - 1) / KN;
                int next_blk = ntiles > 0 ? tma_block(pt, 0) : 0;
                for (int k = 0; k < ntiles; ++k, ++tile) {
                    const int b = next_blk;
                    if (k + 1 < ntiles) next_blk = tma_block(pt, k + 1);
                    if (tile >= NS) mbar_wait(smem_addr(empty + tile % NS), (tile / NS - 1) & 1);
                    tma_issue(tile % NS, pt.kvh, b);
                }
                item = take();
            }
            if (lane == 0) {                                   // the last CTA out zeroes the counters
                __threadfence();
                if (atomicAdd(counters + 1, 1) == (int)gridDim.x - 1) {
                    counters[0] = 0;
                    counters[1] = 0;
                }
            }
        }
        return;
    }
    setmaxnreg_inc<232>();
    if (wg == 1) named_arrive(1, 256);                         // warpgroup 0 issues first

    const u32 q_base = smem_addr(qs) + 64 * 128 * wg;
    // PERSIST: item j of the queue; this warpgroup's 64 Q rows of it by cp.async.
    auto queued = [&](int j) -> const PrefillTile& {
        mbar_wait(smem_addr(item_full + (j & 1)), (j >> 1) & 1);
        return queue[j & 1];
    };
    auto load_q = [&](const PrefillTile& t) {
        if (t.nrows > 0)
            load_q_tile<64, 128 / CPR, CPR>(qs, q, q_stride_t, q_stride_h, t, group, tid & 127,
                                            [](int r, int c) { return sw128(r, c, QP); }, 64 * wg);
        cp_async_commit();
    };
    if (PERSIST) load_q(queued(0));
    int tile = 0;                                              // K/V tiles consumed so far
    for (int j = 0;; ++j) {
        const PrefillTile& it = PERSIST ? queued(j) : pt;
        if (it.nrows < 0) break;
        if (PERSIST) {
            cp_async_wait<0>();                                // this warpgroup's Q rows landed
            fence_async_smem();
            named_sync(5 + wg, 128);
        }
        const int nrows = it.nrows, kv_len = it.kv_len;
        const int q0 = it.first_pos + it.tok0;                 // position of the item's first token
        const int ntiles = (it.cta_hi + KN - 1) / KN;

        // This thread's rows: 64 wg + 16 wl + g (+ 8). The warpgroup's key bounds come from its
        // first and last valid rows, so they are uniform over its 128 threads.
        int lim[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = 64 * wg + 16 * wl + g + 8 * i;
            lim[i] = r < nrows ? max(0, min(q0 + r / group + 1, kv_len)) : 0;
        }
        const int r_first = 64 * wg, r_last = min(64 * wg + 63, nrows - 1);
        const int wg_hi = r_first < nrows ? max(0, min(q0 + r_last / group + 1, kv_len)) : 0;
        const int wg_lo = r_first < nrows ? max(0, min(q0 + r_first / group + 1, kv_len)) : 0;

        float o[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
        float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
        u32 p[KN / 16][4];                             // P of the previous tile, 16-bit A fragments
        bool have_p = false;                           // p holds a tile whose P V is still to issue
        u32 pv_base = 0;                               // that tile's V
        bool pv_half = false;                          // that tile's upper KN / 2 keys are all masked

        // O += P V for the tile in p: k-step kk covers keys 16 kk .. + 15 (2048 bytes of V rows);
        // P's A fragment is S's accumulators of n-tiles 2 kk and 2 kk + 1, packed to 16 bits.
        // A half tile's upper k-steps would add P = 0 times V: skipped.
        auto issue_pv = [&]() {
            const u64 vd = gmma_desc(pv_base, KP >> 4, 64);
#pragma unroll
            for (int kk = 0; kk < KN / 16; ++kk)
                if (kk < KN / 32 || !pv_half) Wg<D, DT>::rs(o, p[kk][0], p[kk][1], p[kk][2], p[kk][3], vd + kk * 128);
        };
        // P's registers are read by the MMA unit until the wait: pretend to use them after it,
        // so that the compiler does not reuse them in between.
        auto hold_p = [&]() {
#pragma unroll
            for (int kk = 0; kk < KN / 16; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(p[kk][e]) :: "memory");
        };

        for (int k = 0; k < ntiles; ++k, ++tile) {
            const int base = KN * k;
            const bool run = base < wg_hi;
            const int slot = tile % NS;
            mbar_wait(smem_addr(full + slot), (tile / NS) & 1);
            if (base + KN > kv_len) {
                // Rows past the sequence inside its last block hold whatever the pool had there:
                // zero them in V (their P is 0, but 0 x NaN is not). Each warpgroup writes the
                // same zeros and hands them to the async proxy for its own MMAs.
                const int z0 = max(0, kv_len - base);
                constexpr int CH = (D / 64) * 8;
                for (int i = tid & 127; i < (KN - z0) * CH; i += 128) {
                    const int r = z0 + i / CH, c = i % CH;
                    *reinterpret_cast<uint4*>(ring + slot * SB + TB + (c >> 3) * KP + r * 128 + (c & 7) * 16) = make_uint4(0, 0, 0, 0);
                }
                fence_async_smem();
                named_sync(3 + wg, 128);
            }
            const u32 k_base = smem_addr(ring + slot * SB);

            // O += P_{k-1} V_{k-1}, then S = Q K^T: k-step kk covers head dims 16 kk .. + 15 (32 bytes
            // into a 128-byte panel row). Descriptors are bases plus constant offsets. Where this
            // warpgroup's rows see none of the tile's upper half (the causal diagonal of short
            // query tiles: half of all last tiles), S is m64n(KN / 2): the upper accumulators
            // are left unwritten and the mask below sets them to -inf. Not at head_dim 64: there
            // ptxas serializes the wgmma instructions of the whole kernel when S has both widths
            // (its C7511 "insufficient register resources" note).
            float s[KN / 2];
            const bool half = D == 128 && base + KN / 2 >= wg_hi;
            auto issue_s = [&]() {
                const u64 qd = gmma_desc(q_base, 1, 64), kd = gmma_desc(k_base, 1, 64);
                float (&s_lo)[KN / 4] = *reinterpret_cast<float (*)[KN / 4]>(s);
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    const u32 off = ((kk >> 2) * QP + (kk & 3) * 32) >> 4, koff = ((kk >> 2) * KP + (kk & 3) * 32) >> 4;
                    if (half) {
                        if (kk == 0) Wg<KN / 2, DT>::ss0(s_lo, qd + off, kd + koff);
                        else Wg<KN / 2, DT>::ss(s_lo, qd + off, kd + koff, 1);
                    } else {
                        if (kk == 0) Wg<KN, DT>::ss0(s, qd + off, kd + koff);
                        else Wg<KN, DT>::ss(s, qd + off, kd + koff, 1);
                    }
                }
            };
            named_sync(1 + wg, 256);                   // this warpgroup's turn at the tensor cores
            wg_fence();
            if (have_p) issue_pv();
            if (run) issue_s();
            wg_commit();
            // The other's turn (PERSIST: always; warpgroup 0 takes warpgroup 1's last one at the end).
            if (PERSIST || !(wg == 1 && k == ntiles - 1)) named_arrive(2 - wg, 256);
            wg_wait<0>();                              // S_k and P_{k-1} V_{k-1} done
            reg_fence(s);
            reg_fence(o);
            hold_p();
            if (k >= 1 && lane == 0) mbar_arrive(smem_addr(empty + (tile - 1) % NS));  // tile k - 1 consumed
            if (PERSIST && k == ntiles - 1) load_q(queued(j + 1));  // this warpgroup's Q rows are read: the next item's

            // Online softmax (log2 domain; scale_log2 > 0, so the max of raw scores is the max of
            // scaled ones). s[4 n + e]: row g + 8 (e >> 1), key 8 n + 2 t4 + (e & 1).
            float corr[2] = {1.f, 1.f};
            bool moved = false;
            if (run) {
                const bool masked = base + KN > wg_lo;
                float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
                for (int n = 0; n < KN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (masked && base + 8 * n + 2 * t4 + (e & 1) >= lim[e >> 1]) s[4 * n + e] = NEG_INF;
                        mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * n + e]);
                    }
                float msafe[2];
                mx[0] *= scale_log2;
                mx[1] *= scale_log2;
                moved = softmax_step(mx, m_run, l_run, msafe, corr);
#pragma unroll
                for (int n = 0; n < KN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[4 * n + e] = exp2f(fmaf(s[4 * n + e], scale_log2, -msafe[e >> 1]));
                        l_run[e >> 1] += s[4 * n + e];
                    }
            }
            if (run) {
                if (__any_sync(FULL_MASK, moved)) {
#pragma unroll
                    for (int n = 0; n < D / 8; ++n) {
                        o[4 * n] *= corr[0]; o[4 * n + 1] *= corr[0];
                        o[4 * n + 2] *= corr[1]; o[4 * n + 3] *= corr[1];
                    }
                }
#pragma unroll
                for (int kk = 0; kk < KN / 16; ++kk) {
                    p[kk][0] = pack2<DT>(s[8 * kk], s[8 * kk + 1]);
                    p[kk][1] = pack2<DT>(s[8 * kk + 2], s[8 * kk + 3]);
                    p[kk][2] = pack2<DT>(s[8 * kk + 4], s[8 * kk + 5]);
                    p[kk][3] = pack2<DT>(s[8 * kk + 6], s[8 * kk + 7]);
                }
                pv_base = k_base + TB;
                pv_half = half;
            }
            have_p = run;
        }
        if (PERSIST && ntiles == 0) load_q(queued(j + 1));  // an item with no keys read no Q
        if (have_p) {                                  // the last tile's P V
            wg_fence();
            issue_pv();
            wg_commit();
            wg_wait<0>();
            reg_fence(o);
            hold_p();
        }
        if (PERSIST && ntiles > 0 && lane == 0) mbar_arrive(smem_addr(empty + (tile - 1) % NS));

        // Epilogue: o[4 n + 2 i + j] is row g + 8 i, head dim 8 n + 2 t4 + j.
#pragma unroll
        for (int i = 0; i < 2; ++i)
            store_prefill_row<DT, D>(out, it, group, num_kv_heads * group, 64 * wg + 16 * wl + g + 8 * i, l_run[i], t4,
                                     [&](int n, int jj) { return o[4 * n + 2 * i + jj]; });
        if (!PERSIST) break;
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(item_empty + (j & 1)));  // its queue entry read
    }
    if (PERSIST && wg == 0) named_sync(1, 256);        // warpgroup 1's turn after its last tile
}
