// CUDA C++ source of the batched block copies (kvpool/kernels/block_copy.py): copy-on-write,
// gather and scatter of whole pool blocks, compiled at first use by CuPy/NVRTC.
// copy_blocks runs kvpool_copy_v16_u4_cg / _u8_cg (16-byte aligned blocks) or kvpool_copy_v1
// (any alignment); the other entry points are there for its kernel= knob
// (benchmarks/bench_block_copy.py --sweep).

// Cache policy of the copy's loads/stores: 0 plain, 1 .cg (L2 only, skip
// L1: copies never reuse data), 2 .cs (streaming, evict first).
template <int MODE, typename V>
__device__ __forceinline__ V ld(const V* p) {
    if constexpr (MODE == 1) return __ldcg(p);
    else if constexpr (MODE == 2) return __ldcs(p);
    else return *p;
}
template <int MODE, typename V>
__device__ __forceinline__ void st(V* p, V v) {
    if constexpr (MODE == 1) __stcg(p, v);
    else if constexpr (MODE == 2) __stcs(p, v);
    else *p = v;
}

// One thread block copies n elements of V; UNROLL loads are in flight per
// thread before the first store, which is what keeps HBM busy.
template <typename V, int UNROLL, int MODE>
__device__ __forceinline__ void copy_chunk(const V* __restrict__ s, V* __restrict__ d, long long n) {
    const long long T = blockDim.x;
    long long i = threadIdx.x;
    for (; i + (UNROLL - 1) * T < n; i += UNROLL * T) {
        V r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) r[u] = ld<MODE>(s + i + u * T);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) st<MODE>(d + i + u * T, r[u]);
    }
    for (; i < n; i += T) st<MODE>(d + i, ld<MODE>(s + i));
}

// Work item w = (pair p, chunk c).  A null id array means "the identity"
// (gather writes out[p], scatter reads src[p]).
template <typename V, int UNROLL, int MODE>
__device__ __forceinline__ void copy_blocks_impl(
    unsigned long long src_base, unsigned long long dst_base,
    unsigned long long src_ids_p, long long src_ids_stride,
    unsigned long long dst_ids_p, long long dst_ids_stride,
    long long num_pairs, long long src_row, long long dst_row,
    long long block_bytes, long long chunk_bytes, long long chunks) {
    const long long* src_ids = reinterpret_cast<const long long*>(src_ids_p);
    const long long* dst_ids = reinterpret_cast<const long long*>(dst_ids_p);
    const long long items = num_pairs * chunks;
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        const long long p = w / chunks;
        const long long c = w - p * chunks;
        const long long s = src_ids ? src_ids[p * src_ids_stride] : p;
        const long long d = dst_ids ? dst_ids[p * dst_ids_stride] : p;
        const long long off = c * chunk_bytes;
        const long long len = min(chunk_bytes, block_bytes - off);
        copy_chunk<V, UNROLL, MODE>(
            reinterpret_cast<const V*>(src_base + s * src_row + off),
            reinterpret_cast<V*>(dst_base + d * dst_row + off),
            len / (long long)sizeof(V));
    }
}

#define KVPOOL_COPY_ENTRY(NAME, V, UNROLL, MODE)                                   \
extern "C" __global__ void NAME(                                                        \
    unsigned long long a, unsigned long long b, unsigned long long c, long long d,      \
    unsigned long long e, long long f, long long g, long long h, long long i,           \
    long long j, long long k, long long l) {                                            \
    copy_blocks_impl<V, UNROLL, MODE>(a, b, c, d, e, f, g, h, i, j, k, l);         \
}

KVPOOL_COPY_ENTRY(kvpool_copy_v16_u4, uint4, 4, 0)
KVPOOL_COPY_ENTRY(kvpool_copy_v16_u4_cg, uint4, 4, 1)
KVPOOL_COPY_ENTRY(kvpool_copy_v16_u8_cg, uint4, 8, 1)
KVPOOL_COPY_ENTRY(kvpool_copy_v16_u4_cs, uint4, 4, 2)
KVPOOL_COPY_ENTRY(kvpool_copy_v16_u8_cs, uint4, 8, 2)
KVPOOL_COPY_ENTRY(kvpool_copy_v1, unsigned char, 4, 0)
