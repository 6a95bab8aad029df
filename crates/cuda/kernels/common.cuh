// Shared by every stepgraph kernel source (prepended by the loader).
//
// Conventions:
// - every kernel is `extern "C" __global__`, named `<op>_<dtype>` with dtype
//   one of f32, bf16, f16, f64 (the storage type of its float tensors);
// - arithmetic happens in `acc_t<T>`: float for f32/bf16/f16, double for f64;
//   storage is rounded once, to nearest even;
// - indices are 64-bit (`i64`): W2's logits alone hold 6.2e8 elements;
// - no float atomics: every result is computed by one thread in a fixed
//   order, so every run, eager or graph, gives the same bits;
// - outputs are never read before they are written (arena memory is reused);
// - a kernel's body starts with `sg_pdl_entry()` (below).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;

// Programmatic dependent launch (sm_90): every kernel begins with this.
// `griddepcontrol.wait` returns once the grids this one depends on have
// completed and their writes are visible, so nothing before it touches
// global memory; `launch_dependents` then lets the next kernel in the
// stream, if it was launched with programmatic serialization, have its
// blocks scheduled while this grid's last blocks run, so that its launch
// latency hides behind them. Launched without that attribute (the
// default), the wait returns at once and the trigger does nothing.
__device__ __forceinline__ void sg_pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// NVRTC compiles without the C library's <math.h>, which is where INFINITY lives.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Which keys an attention query sees and how its scores are capped (the
// `Scores` and `positions` of crates/core/src/ops/attention.rs): query row
// i of batch row b sees the keys first(i)..=i, with first(i) the largest of
// 0, i + 1 − window (window > 0) and i − pos[b, i] (pos not null: packed
// documents restarting their positions at 0), at most i. first(i) never
// decreases along a row, so a tile of rows i0..i1 sees no key before
// first(i0), and the queries that see key j are j..=last_query(j).
struct SgKeys {
    const int* pos;  // [B, T] positions within documents, or null
    int window;      // sliding window, 0 for none
    double softcap;  // logit soft-cap (natural units), 0 for none

    __device__ __forceinline__ bool masked() const { return pos != nullptr || window > 0; }

    __device__ __forceinline__ int first(int b, int Tn, int i) const {
        int lo = window > 0 ? max(i + 1 - window, 0) : 0;
        if (pos) lo = max(lo, i - pos[(i64)b * Tn + i]);
        return max(min(lo, i), 0);
    }

    // The last query row (< Tn) whose keys include j: j + window − 1 at
    // most, and within j's document (a binary search over first()).
    __device__ __forceinline__ int last_query(int b, int Tn, int j) const {
        int hi = Tn - 1;
        if (window > 0) hi = (int)min((i64)hi, (i64)j + window - 1);  // 64-bit: window may be near INT_MAX
        if (!pos || hi <= j) return hi;
        int lo = j;  // first(j) <= j always
        while (lo < hi) {
            const int mid = lo + (hi - lo + 1) / 2;
            if (first(b, Tn, mid) <= j) lo = mid;
            else hi = mid - 1;
        }
        return lo;
    }
};

// The soft-capped score of a scaled product s (natural units), and the
// slope of the cap at a capped score c: softcap·tanh(s/softcap), 1 − (c/softcap)².
__device__ __forceinline__ float sg_cap(float s, double softcap) {
    const float cap = (float)softcap;
    return cap * tanhf(s / cap);
}
__device__ __forceinline__ double sg_cap(double s, double softcap) { return softcap * tanh(s / softcap); }
__device__ __forceinline__ float sg_cap_slope(float c, double softcap) {
    const float r = c / (float)softcap;
    return 1.f - r * r;
}
__device__ __forceinline__ double sg_cap_slope(double c, double softcap) {
    const double r = c / softcap;
    return 1.0 - r * r;
}

template <typename T> struct AccOf { typedef float type; };
template <> struct AccOf<double> { typedef double type; };
template <typename T> using acc_t = typename AccOf<T>::type;

__device__ __forceinline__ float load(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ double load(const double* p, i64 i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, i64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load(const __half* p, i64 i) { return __half2float(p[i]); }

__device__ __forceinline__ void store(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(double* p, i64 i, double v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, i64 i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, i64 i, float v) { p[i] = __float2half_rn(v); }

// Correctly rounded arithmetic in the accumulator type. The `_rn`
// intrinsics are never contracted into an FMA, so a kernel that uses them
// rounds after every operation exactly as the CPU reference does.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }

// N consecutive elements of T moved as 16-byte words (N · sizeof(T) a
// multiple of 16), for the kernels' contiguous fast paths; the caller
// guarantees 16-byte alignment. Pack<T> is one word: 8 bf16/f16, 4 f32, 2 f64.
template <typename T, int N_ = 16 / (int)sizeof(T)> struct Pack {
    static constexpr int N = N_;
    static constexpr int W = (int)sizeof(T) * N / 16;
    uint4 w[W];
    __device__ __forceinline__ const T* elems() const { return reinterpret_cast<const T*>(w); }
    __device__ __forceinline__ T* elems() { return reinterpret_cast<T*>(w); }
    // Pack j of `base` (elements j·N .. j·N + N).
    __device__ __forceinline__ void read(const T* base, i64 j) {
#pragma unroll
        for (int k = 0; k < W; ++k) w[k] = reinterpret_cast<const uint4*>(base)[j * W + k];
    }
    __device__ __forceinline__ void write(T* base, i64 j) const {
#pragma unroll
        for (int k = 0; k < W; ++k) reinterpret_cast<uint4*>(base)[j * W + k] = w[k];
    }
};

// The shared-window address of a generic pointer to shared memory.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Four 8×8 tiles of 16-bit elements from shared memory into mma.sync
// fragments: lanes 8q..8q+7 give the row addresses of tile q, which lands
// in r[q]; `t` transposes each tile as it loads (a tile stored with its
// columns as rows).
__device__ __forceinline__ void sg_ldsm4(unsigned* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void sg_ldsm4t(unsigned* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Asynchronous copies of BYTES (4, 8 or 16) from global to shared memory,
// grouped by cp_commit and awaited by cp_wait<N> (at most N of the issuing
// thread's latest groups still in flight; other threads' copies need a
// barrier after it). With `ok` false nothing is read and the destination is
// zero-filled.
template <int BYTES> __device__ __forceinline__ void cp_async(void* dst, const void* src, bool ok) {
    const int n = ok ? BYTES : 0;
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES),
                     "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Instantiates macro M(suffix, storage type) for every float dtype.
#define SG_FOR_EACH_FLOAT(M) M(f32, float) M(bf16, __nv_bfloat16) M(f16, __half) M(f64, double)

// Sum of `v` over the warp, the same value in every lane (fixed butterfly order).
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to
// every thread. `scratch` holds 32 values. Deterministic: fixed tree.
template <typename A> __device__ A block_sum(A v, A* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A r = (lane < nwarps) ? scratch[lane] : A(0);
    r = warp_sum(r);
    return r;
}
template <typename A> __device__ A block_max(A v, A* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A r = (lane < nwarps) ? scratch[lane] : A(-INFINITY);
    r = warp_max(r);
    return r;
}

// One m16n8k16 tensor-core product on 16-bit operands with f32
// accumulation, c += a·b, in mma.sync's fragment layouts (PTX ISA: a lane
// 4·g + t holds A's rows g, g+8 at columns 2t, 2t+1, 2t+8, 2t+9 in a[0..4],
// B's column g at rows 2t, 2t+1 and 2t+8, 2t+9 in b0, b1, C's rows g, g+8
// at columns 2t, 2t+1 in c[0..4]); `pack` rounds two floats into one
// register of the type (the first in the low half). Used by the attention
// and few-row product kernels.
template <typename T> struct Mma16;
template <> struct Mma16<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats rounded to nearest even, the first in the low half.
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&v);
    }
};
template <> struct Mma16<__half> {
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&v);
    }
};
