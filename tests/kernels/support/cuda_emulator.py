"""Run the CUDA kernels' own source on the CPU, one emulated lane per CUDA thread.

The GPU kernels depend on index arithmetic that is easy to get subtly wrong
(MMA fragment layouts, the dim permutation of the V operand, split-KV
bookkeeping) and GPU time is scarce; CI has no GPU at all. This module
compiles ``kvpool/kernels/cuda/paged_attention.cu`` with the host C++ compiler, replacing only
the region between ``BEGIN PRIMITIVES`` and ``END PRIMITIVES`` (inline PTX:
16-byte loads, float→16-bit conversions, ``mma.sync``) with host code that
implements the PTX ISA's definitions, and runs each CTA's threads (128, or 256 for
the 8-warp prefill kernel) as
cooperative fibers (``ucontext``) in one OS thread. Warp shuffles, warp
reductions, MMAs and ``__syncthreads`` are barriers between fibers, so the
kernel code runs unchanged, lane by lane, deterministically.

It checks logic, not speed or memory-model subtleties. ``EmulatorLauncher``
plugs into the same host launch code as the real CuPy launcher, so the
planning (grid, splits, work mapping) is exercised as well. Needs ``g++``
with C++17; tests skip when it is missing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import torch

from kvpool.kernels import cuda_source
from kvpool.kernels.cuda_runtime import block_threads, cluster_z, module_kernels

# The kernels' source as shipped, behind its ``#line 1 "paged_attention.cu"`` directive.
SOURCE = cuda_source.read_attention()

_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <ucontext.h>
#include <vector>
#include <utility>
using std::min;
using std::max;

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __shared__
#define KVPOOL_CLUSTERS 1

struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
struct uint2 { unsigned x, y; };
struct int2 { int x, y; };
static inline int2 make_int2(int a, int b) { return int2{a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct dim3 { unsigned x, y, z; };
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

// ---- fibers: one per CUDA thread of the CTA being run ----------------------
enum { RUNNABLE, WAITING, DONE };
struct Barrier { int size, count; };
struct Fiber { ucontext_t ctx; int state; Barrier* wait; unsigned tid; };
static const int MAXT = 256;  // most threads per CTA (the 8-warp prefill kernel)
static int nthr = 128;        // threads of the grid being run (set per launch)
static Fiber fib[MAXT];
static ucontext_t sched_ctx;
static int cur;
static dim3 blockIdx, gridDim;
static unsigned cluster_size = 1;             // CTAs per cluster along z
static int cluster_arrivals, cluster_fault;   // cluster barrier arrivals; a wait that found some missing
#define blockDim (dim3{(unsigned)nthr, 1, 1})
static Barrier warp_bar[MAXT / 32], cta_bar, named_bar[16];
uint4 smem4[(232 * 1024) / 16];  // `extern __shared__ uint4 smem4[]` in the kernel binds here
struct Copy { void* dst; const void* src; bool ok; };
static std::vector<Copy> pending[MAXT];
static std::vector<size_t> groups[MAXT];   // end index in pending[] of each committed group
static int cp_mode_late = 0;
extern "C" void emu_set_cp_async_late(int late) { cp_mode_late = late; }

// Places no kernel may read (a pool's chunks given back: on the GPU, unmapped). A global
// read by a primitive that touches one is recorded (the first address) and reads zeros.
static std::vector<std::pair<uintptr_t, uintptr_t>> forbidden;
static uintptr_t forbidden_hit;
extern "C" void emu_forbid(uint64_t lo, uint64_t hi) { forbidden.push_back({(uintptr_t)lo, (uintptr_t)hi}); }
extern "C" void emu_allow_all() { forbidden.clear(); forbidden_hit = 0; }
extern "C" uint64_t emu_forbidden_hit() { return forbidden_hit; }
static inline bool readable(const void* p, size_t n) {
    const uintptr_t a = (uintptr_t)p;
    for (const auto& r : forbidden)
        if (a < r.second && a + n > r.first) {
            if (!forbidden_hit) forbidden_hit = a;
            return false;
        }
    return true;
}

static inline dim3 cur_tid() { return dim3{fib[cur].tid, 0, 0}; }
#define threadIdx (cur_tid())

static void bar_wait(Barrier* b) {
    if (++b->count == b->size) {
        b->count = 0;
        for (int i = 0; i < nthr; ++i)
            if (fib[i].state == WAITING && fib[i].wait == b) fib[i].state = RUNNABLE;
        return;
    }
    fib[cur].state = WAITING;
    fib[cur].wait = b;
    swapcontext(&fib[cur].ctx, &sched_ctx);
}

// Per-warp exchange slots for collectives.
static unsigned xu[MAXT][8];
static float xf[MAXT][4];
static inline int lane_id() { return cur & 31; }
static inline Barrier* my_warp() { return &warp_bar[cur >> 5]; }

static inline void __syncthreads() { bar_wait(&cta_bar); }
static inline float __shfl_xor_sync(unsigned, float v, int m) {
    xf[cur][0] = v; bar_wait(my_warp());
    const float r = xf[(cur & ~31) | (lane_id() ^ m)][0]; bar_wait(my_warp());
    return r;
}
static inline int __shfl_xor_sync(unsigned, int v, int m) {
    xu[cur][2] = (unsigned)v; bar_wait(my_warp());
    const int r = (int)xu[(cur & ~31) | (lane_id() ^ m)][2]; bar_wait(my_warp());
    return r;
}
static inline float __shfl_sync(unsigned, float v, int src) {
    xf[cur][0] = v; bar_wait(my_warp());
    const float r = xf[(cur & ~31) | (src & 31)][0]; bar_wait(my_warp());
    return r;
}
static inline int __shfl_sync(unsigned, int v, int src) {
    xu[cur][2] = (unsigned)v; bar_wait(my_warp());
    const int r = (int)xu[(cur & ~31) | (src & 31)][2]; bar_wait(my_warp());
    return r;
}
static inline int __shfl_up_sync(unsigned, int v, unsigned d) {
    xu[cur][2] = (unsigned)v; bar_wait(my_warp());
    const int l = lane_id();
    const int r = l >= (int)d ? (int)xu[cur - d][2] : v; bar_wait(my_warp());
    return r;
}
static inline unsigned __ballot_sync(unsigned, int pred) {
    xu[cur][3] = pred != 0; bar_wait(my_warp());
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) r |= xu[(cur & ~31) | l][3] << l;
    bar_wait(my_warp());
    return r;
}
static inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __any_sync(unsigned, int pred) {
    xu[cur][1] = pred != 0; bar_wait(my_warp());
    int r = 0;
    for (int l = 0; l < 32; ++l) r |= (int)xu[(cur & ~31) | l][1];
    bar_wait(my_warp());
    return r;
}
static inline int __reduce_max_sync(unsigned, int v) {
    xu[cur][0] = (unsigned)v; bar_wait(my_warp());
    int r = (int)xu[cur & ~31][0];
    for (int l = 1; l < 32; ++l) r = max(r, (int)xu[(cur & ~31) | l][0]);
    bar_wait(my_warp());
    return r;
}
static inline unsigned __reduce_add_sync(unsigned, unsigned v) {
    xu[cur][0] = v; bar_wait(my_warp());
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) r += xu[(cur & ~31) | l][0];
    bar_wait(my_warp());
    return r;
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}

// ---- 16-bit formats ----------------------------------------------------------
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline uint16_t f32_to_f16(float f) { _Float16 h = (_Float16)f; uint16_t r; std::memcpy(&r, &h, 2); return r; }
static inline float f16_to_f32(uint16_t h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
static inline float bf16_to_f32(uint16_t h) { return __uint_as_float((unsigned)h << 16); }
"""

_PRIMITIVES = r"""
__device__ __forceinline__ uint4 ld16(const void* p) {
    uint4 r{0, 0, 0, 0};
    if (readable(p, 16)) std::memcpy(&r, p, 16);
    return r;
}
__device__ __forceinline__ float2 ldcg2(const float* p) { return readable(p, 8) ? float2{p[0], p[1]} : float2{0, 0}; }
__device__ __forceinline__ float ldcg1(const float* p) { return readable(p, 4) ? *p : 0.f; }
// CTAs run one after another here, so an arrival is a plain increment.
__device__ __forceinline__ int arrive(int* c) { return (*c)++; }

// Clusters: run_grid runs a cluster's CTAs one after another, highest rank first, on one
// shared-memory array, so a pointer into rank 0's shared memory is the pointer itself (the
// kernel keeps what other ranks write there clear of what rank 0 uses before its wait). A
// wait checks that every thread of the cluster has arrived: in this order, a kernel whose
// rank 0 waits on a rank that never arrives (or arrives later) fails instead of reading stale data.
__device__ __forceinline__ u32 cluster_rank() { return blockIdx.z % cluster_size; }
__device__ __forceinline__ float* cluster_map(float* p, u32) { return p; }
__device__ __forceinline__ void cluster_arrive() { ++cluster_arrivals; }
__device__ __forceinline__ void cluster_wait() {
    bar_wait(&cta_bar);
    if (cluster_arrivals != cluster_size * nthr) cluster_fault = 1;
}

// cp.async: in "early" mode a copy lands when issued, in "late" mode only when
// cp.async.wait_group retires its group. A kernel correct under both has its
// waits and barriers in the right places (late catches reading too soon,
// early catches overwriting a stage another warp may still read). A masked
// lane (ok false) stores its zeros at once, as the kernel's primitive does.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    if (!ok || !readable(src, 16)) { std::memset(dst, 0, 16); return; }
    if (cp_mode_late) { pending[cur].push_back(Copy{dst, src, ok}); return; }
    std::memcpy(dst, src, 16);
}
__device__ __forceinline__ void cp_async_commit() {
    groups[cur].push_back(pending[cur].size());
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    auto& gs = groups[cur];
    if ((int)gs.size() <= N) return;
    const size_t upto = gs[gs.size() - 1 - N];   // copies of all but the newest N groups
    for (size_t i = 0; i < upto; ++i) {
        const Copy& c = pending[cur][i];
        if (c.ok) std::memcpy(c.dst, c.src, 16); else std::memset(c.dst, 0, 16);
    }
    pending[cur].erase(pending[cur].begin(), pending[cur].begin() + upto);
    gs.erase(gs.begin(), gs.end() - N);
    for (auto& x : gs) x -= upto;
}
__device__ __forceinline__ void group_sync(int id, int nthreads) {
    if (nthreads == 32) { bar_wait(my_warp()); return; }
    Barrier* b = &named_bar[id];
    b->size = nthreads;
    bar_wait(b);
}

// ldmatrix .x4 .trans: lane 8 i + r gives the address of row r of matrix i; register i of
// lane 4 g + t receives (row 2 t, column g) low and (row 2 t + 1, column g) high.
__device__ __forceinline__ void ldsm_x4_trans(const void* row, u32 (&r)[4]) {
    const uint64_t a = (uint64_t)(uintptr_t)row;
    xu[cur][6] = (unsigned)a; xu[cur][7] = (unsigned)(a >> 32);
    bar_wait(my_warp());
    const int base = cur & ~31, g = lane_id() >> 2, t = lane_id() & 3;
    u32 v[4];
    for (int i = 0; i < 4; ++i) {
        v[i] = 0;
        for (int h = 0; h < 2; ++h) {
            const int src = base + 8 * i + 2 * t + h;
            const uint64_t p = (uint64_t)xu[src][6] | ((uint64_t)xu[src][7] << 32);
            uint16_t e;
            std::memcpy(&e, (const char*)(uintptr_t)p + 2 * g, 2);
            v[i] |= (u32)e << (16 * h);
        }
    }
    bar_wait(my_warp());
    for (int i = 0; i < 4; ++i) r[i] = v[i];
}

template <int DT> __device__ __forceinline__ u32 pack2(float lo, float hi) {
    if constexpr (DT == 1) return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
    else return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}
__device__ __forceinline__ float bf16_low(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_high(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// cvt.rn.f16x2.e4m3x2 by the OCP float8 e4m3 definition: bias 7, exponent 0 subnormal,
// S.1111.111 NaN (no infinities).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 x) {
    u32 r = 0;
    for (int i = 0; i < 2; ++i) {
        const unsigned b = (x >> (8 * i)) & 0xffu, e = (b >> 3) & 15u, m = b & 7u;
        float mag = e ? std::ldexp(1.0f + m / 8.0f, (int)e - 7) : std::ldexp((float)m, -9);
        if ((b & 0x7fu) == 0x7fu) mag = NAN;
        r |= (u32)f32_to_f16(b & 0x80u ? -mag : mag) << (16 * i);
    }
    return r;
}
__device__ __forceinline__ float half_to_float(u32 h) { return f16_to_f32((uint16_t)h); }

template <int DT> __device__ __forceinline__ typename Store<DT>::T from_f32(float x) {
    if constexpr (DT == 0) return x;
    else if constexpr (DT == 1) return f32_to_f16(x);
    else return f32_to_bf16(x);
}

// PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type":
// group = lane >> 2, t = lane % 4.  A (16x16): reg j holds (row g + 8*(j&1),
// cols 2t + 8*(j>>1) + {0,1}).  B (16x8): reg j holds (rows 2t + 8j + {0,1}, col g).
// C (16x8): c[i] = (row g + 8*(i>>1), col 2t + (i&1)).
template <int DT> static inline float half_val(u32 reg, int hi) {
    const uint16_t h = (uint16_t)(hi ? reg >> 16 : reg & 0xffff);
    return DT == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}
template <int DT>
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const u32 mine[6] = {a0, a1, a2, a3, b0, b1};
    for (int j = 0; j < 6; ++j) xu[cur][j] = mine[j];
    bar_wait(my_warp());
    const int base = cur & ~31, g = lane_id() >> 2, t = lane_id() & 3;
    float d[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double acc = 0.0;
        for (int k = 0; k < 16; ++k) {
            const int la = base + (row & 7) * 4 + ((k & 7) >> 1);
            const u32 ra = xu[la][(row >> 3) + 2 * (k >> 3)];
            const int lb = base + col * 4 + ((k & 7) >> 1);
            const u32 rb = xu[lb][4 + (k >> 3)];
            acc += (double)half_val<DT>(ra, k & 1) * (double)half_val<DT>(rb, k & 1);
        }
        d[i] = c[i] + (float)acc;
    }
    bar_wait(my_warp());
    for (int i = 0; i < 4; ++i) c[i] = d[i];
}
"""

_LAUNCH = r"""
// ---- running one grid -------------------------------------------------------
typedef void (*Body)(void*);
static Body body_fn;
static void* body_arg;
static void fiber_main(int i) {
    body_fn(body_arg);
    fib[i].state = DONE;
    swapcontext(&fib[i].ctx, &sched_ctx);
}
static char* stacks;
static const size_t STACK = 256 * 1024;

static int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned threads, unsigned cz, Body fn, void* arg) {
    if (threads % 32 || threads > (unsigned)MAXT) return 2;
    if (gz % cz) return 4;
    gridDim = dim3{gx, gy, gz};
    nthr = (int)threads;
    cluster_size = cz;
    cluster_fault = 0;
    if (!stacks) stacks = (char*)std::malloc(STACK * MAXT);
    body_fn = fn; body_arg = arg;
    for (unsigned z0 = 0; z0 < gz; z0 += cz)
    for (unsigned y = 0; y < gy; ++y)
    for (unsigned x = 0; x < gx; ++x)
    for (unsigned rank = cz; rank-- > 0;) {
        const unsigned z = z0 + rank;
        if (cz > 1 && rank == cz - 1) {             // a new cluster: nothing carried over
            cluster_arrivals = 0;
            std::memset(smem4, 0xff, sizeof smem4);  // NaN floats
        }
        blockIdx = dim3{x, y, z};
        for (int w = 0; w < nthr / 32; ++w) warp_bar[w] = Barrier{32, 0};
        cta_bar = Barrier{nthr, 0};
        for (int i = 0; i < 16; ++i) named_bar[i] = Barrier{0, 0};
        for (int i = 0; i < nthr; ++i) { pending[i].clear(); groups[i].clear(); }
        for (int i = 0; i < nthr; ++i) {
            fib[i].state = RUNNABLE; fib[i].wait = nullptr; fib[i].tid = i;
            getcontext(&fib[i].ctx);
            fib[i].ctx.uc_stack.ss_sp = stacks + STACK * i;
            fib[i].ctx.uc_stack.ss_size = STACK;
            fib[i].ctx.uc_link = nullptr;
            makecontext(&fib[i].ctx, (void (*)())fiber_main, 1, i);
        }
        for (;;) {
            bool progress = false, all_done = true;
            for (int i = 0; i < nthr; ++i) {
                if (fib[i].state == DONE) continue;
                all_done = false;
                if (fib[i].state != RUNNABLE) continue;
                cur = i; progress = true;
                swapcontext(&sched_ctx, &fib[i].ctx);
            }
            if (all_done) break;
            if (!progress) return 1;  // deadlock: divergent collective or early exit
        }
    }
    return cluster_fault ? 3 : 0;
}
"""


def _params(kind: str, dt: int, kf: int = 0) -> list[tuple[str, str]]:
    t = "float" if dt == 0 else "u16"
    kv = "unsigned char" if kf else t
    if kind == "attention":
        return [
            (f"const {t}*", "q"), ("i64", "q_stride_t"), ("i64", "q_stride_h"),
            (f"const {kv}*", "k_cache"), (f"const {kv}*", "v_cache"), ("i64", "k_stride"), ("i64", "v_stride"),
            ("int", "num_blocks"), ("int", "num_kv_heads"), ("int", "bs_log2"),
            ("const int*", "block_tables"), ("i64", "bt_stride"), ("int", "max_blocks"),
            ("const int*", "seq_lens"), ("const int*", "cu_seqlens"), ("const int*", "tile_cum"),
            ("int", "num_seqs"), ("int", "group"), ("float", "scale_log2"),
            ("int", "chunk"), ("int", "num_splits"),
            (f"{t}*", "out"), ("float*", "part_o"), ("float*", "part_lse"), ("int*", "counters"),
            ("int", "window"), ("float", "softcap_log2"), ("float", "v_scale"),
            ("int", "work_target"), ("int", "min_chunk"), ("int", "item_overhead"), ("int", "item_classes"),
        ]  # fmt: skip
    if kind == "merge":
        return [
            ("const float*", "part_o"), ("const float*", "part_lse"), (f"{t}*", "out"),
            ("const int*", "seq_lens"), ("const int*", "cu_seqlens"), ("int", "num_seqs"), ("int", "num_tokens"),
            ("int", "max_blocks"),
            ("int", "bs_log2"), ("int", "hq"), ("int", "num_splits"), ("int", "chunk"),
        ]  # fmt: skip
    return [
        ("const char*", "key"), ("i64", "key_st"), ("i64", "key_sh"),
        ("const char*", "value"), ("i64", "val_st"), ("i64", "val_sh"),
        ("char*", "k_cache"), ("char*", "v_cache"), ("i64", "k_stride"), ("i64", "v_stride"),
        ("const i64*", "slots"), ("int", "num_heads"), ("int", "block_size"), ("int", "row_bytes"),
        ("i64", "num_slots"),
    ]  # fmt: skip


def _emulated_source(module_key: tuple) -> tuple[str, dict[str, str]]:
    begin, end = SOURCE.index("// BEGIN PRIMITIVES"), SOURCE.index("// END PRIMITIVES")
    # g++ reports the kernel source's own file and line numbers: the host primitives under
    # a name of their own, the rest of the file from the line of its END PRIMITIVES.
    end_line = SOURCE.count("\n", 0, end)  # the directive in front is line 0
    kernel_src = (
        SOURCE[:begin]
        + f'#line 1 "cuda_emulator.py:_PRIMITIVES"\n{_PRIMITIVES}'
        + f'#line {end_line} "{cuda_source.PAGED_ATTENTION}"\n{SOURCE[end:]}'
    )
    parts = [_PRELUDE, kernel_src, '#line 1 "cuda_emulator.py:_LAUNCH"\n' + _LAUNCH]
    symbols = {}
    dt = module_key[1] if module_key[0] in ("attention", "prefill") else 0
    kf = module_key[3] if module_key[0] == "attention" else 0
    for short, expr in module_kernels(module_key).items():
        plist = _params(short, dt, kf if short == "attention" else 0)
        params = ", ".join(f"{ty} {nm}" for ty, nm in plist)
        call = ", ".join(nm for _, nm in plist)
        body_call = ", ".join(f"a->{nm}" for _, nm in plist)
        sym = "".join(ch if ch.isalnum() else "_" for ch in expr)
        parts.append(
            f"""
struct Args_{sym} {{ {"; ".join(f"{ty} {nm}" for ty, nm in plist)}; }};
static void body_{sym}(void* p) {{ Args_{sym}* a = (Args_{sym}*)p; {expr}({body_call}); }}
extern "C" int emu_{sym}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, {params}) {{
    Args_{sym} a = {{ {call} }};
    return run_grid(gx, gy, gz, threads, {cluster_z(module_key, short)}, body_{sym}, &a);
}}
"""
        )
        symbols[short] = f"emu_{sym}"
    return "\n".join(parts), symbols


_CTYPE = {
    np.uint64: ctypes.c_void_p,
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
    np.float32: ctypes.c_float,
}
_LOCK = threading.Lock()


def available() -> bool:
    return shutil.which("g++") is not None


class ForbiddenRead(RuntimeError):
    """A kernel read memory in one of ``EmulatorLauncher.forbidden``'s ranges (on a GPU: a place not mapped)."""


class EmulatorLauncher:
    """Drop-in for ``CupyLauncher`` that runs kernels on CPU tensors (slowly)."""

    def __init__(self, num_sms: int = 4, cp_async: str = "late") -> None:
        if cp_async not in ("early", "late"):
            raise ValueError("cp_async must be 'early' or 'late'")
        self.cp_async = cp_async
        self._late = int(cp_async == "late")
        self._sms = num_sms
        self._libs: dict = {}
        self.forbidden: list[tuple[int, int]] = []  # [lo, hi) byte ranges no kernel may read (``ForbiddenRead``)
        self._cache = os.path.join(tempfile.gettempdir(), f"kvpool-cuda-emulator-{os.getuid()}")

    def num_sms(self, device: torch.device) -> int:
        return self._sms

    def clusters(self, device: torch.device) -> bool:
        return True  # cluster kernels run here (a cluster's CTAs one after another)

    def _lib(self, module_key: tuple):
        if module_key not in self._libs:
            src, symbols = _emulated_source(module_key)
            digest = hashlib.sha256(src.encode()).hexdigest()[:16]
            os.makedirs(self._cache, exist_ok=True)
            so = os.path.join(self._cache, f"{digest}.so")
            if not os.path.exists(so):
                cpp = os.path.join(self._cache, f"{digest}.cpp")
                with open(cpp, "w") as f:
                    f.write(src)
                tmp = f"{so}.{os.getpid()}.tmp"
                cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas", cpp, "-o", tmp]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode:
                    raise RuntimeError(f"emulator build failed:\n{res.stderr[-4000:]}")
                os.replace(tmp, so)
            lib = ctypes.CDLL(so)
            lib.emu_forbid.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
            lib.emu_forbidden_hit.restype = ctypes.c_uint64
            self._libs[module_key] = (lib, symbols)
        return self._libs[module_key]

    def launch(self, module_key: tuple, name: str, device: torch.device, grid, args, smem: int = 0) -> None:
        if device.type != "cpu":
            raise ValueError("the emulator runs kernels on CPU tensors")
        if smem > 232 * 1024:
            raise ValueError(f"emulated shared memory is 232 KiB; kernel asked for {smem} bytes")
        lib, symbols = self._lib(module_key)
        fn = getattr(lib, symbols[name])
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_uint] * 4 + [_CTYPE[type(a)] for a in args]
        values = [int(a) if isinstance(a, np.uint64) else a.item() for a in args]
        with _LOCK:  # the fiber scheduler is global state
            lib.emu_set_cp_async_late(self._late)
            lib.emu_allow_all()
            for lo, hi in self.forbidden:
                lib.emu_forbid(ctypes.c_uint64(lo), ctypes.c_uint64(hi))
            rc = fn(*[int(g) for g in grid], block_threads(module_key), *values)
            hit = ctypes.c_uint64(lib.emu_forbidden_hit()).value
        if hit:
            raise ForbiddenRead(f"emulated {name} read {hit:#x}, in a forbidden range")
        if rc == 3:
            raise RuntimeError(f"emulated {name}: a cluster barrier wait found a CTA of its cluster not yet arrived")
        if rc == 4:
            raise ValueError(f"grid z = {grid[2]} is not a whole number of {cluster_z(module_key, name)}-CTA clusters")
        if rc == 2:
            raise ValueError(f"the emulator runs 32 to 256 threads per CTA in whole warps; got {block_threads(module_key)}")
        if rc:
            raise RuntimeError(f"emulated {name} deadlocked: a collective was reached by only part of a warp/CTA")
