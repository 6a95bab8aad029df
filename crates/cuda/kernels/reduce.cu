// Reductions (sum, mean, max over any sorted set of axes) and the max
// reduction's backward, matching crates/core/src/ops/reduce.rs.
//
// The host (lower_basic.rs) drops size-1 axes and merges adjacent axes of the
// same kind, so an input is a row-major walk of kept groups and reduced
// groups: output element o starts at `kept_offset(o)` and its reduced
// elements sit at `kept_offset(o) + red_offset(r)` for r in [0, count).
// Three layouts, each deterministic (a fixed partition of r over threads,
// then a fixed combining tree; no atomics), chosen from the shape only:
//
// - `<k>_rows_<dt>`: the innermost axis is reduced and rows are long; one
//   block per output (grid-stride), blockDim.x a multiple of 32;
// - `<k>_warps_<dt>`: the innermost axis is reduced and rows are short; one
//   warp per output, blockDim (32, W);
// - `<k>_cols_<dt>`: the innermost axis is kept; blockDim (32, BY) with BY a
//   power of two <= 32: threadIdx.x walks 32 adjacent outputs (coalesced
//   reads), threadIdx.y splits the reduced range, then a tree over y.
//
// k is sum, mean or max. Signatures:
//   <k>_<layout>_<dt>(const T* x, T* y, i64 nout, i64 count, ReduceShape s)
//   max_backward_<layout>_<dt>(const T* x, const T* y, const T* g, T* gx,
//                              i64 nout, i64 count, ReduceShape s)
// where y and g of max_backward hold nout elements (the keepdim shape).
//
// Sums accumulate in acc_t in a different order from the CPU's sequential
// loop, so they agree to rounding, not bit for bit; max and max_backward
// are exact. The CPU's max ignores NaN like fmax; an empty group gives
// -inf (max), 0 (sum) and NaN (mean) on both.

namespace sg_red {

constexpr int kMaxRank = 8;
enum Kind { SUM, MEAN, MAX };

struct ReduceShape {
    i64 nk;  // kept groups, outer to inner (0 for a full reduction)
    i64 ksize[kMaxRank];
    i64 kstride[kMaxRank];
    i64 nr;  // reduced groups, outer to inner (>= 1)
    i64 rsize[kMaxRank];
    i64 rstride[kMaxRank];
};

// I is the type of the index divisions: 32-bit when the whole input fits,
// which is several times cheaper than 64-bit division.
template <typename I> __device__ __forceinline__ i64 kept_offset(const ReduceShape& s, i64 o) {
    if (s.nk == 0) return 0;
    if (s.nk == 1) return o * s.kstride[0];
    I rem = (I)o;
    i64 off = 0;
#pragma unroll
    for (int d = kMaxRank - 1; d >= 0; --d) {
        if (d < s.nk) {
            I sz = (I)s.ksize[d];
            off += (i64)(rem % sz) * s.kstride[d];
            rem /= sz;
        }
    }
    return off;
}

template <typename I> __device__ __forceinline__ i64 red_offset(const ReduceShape& s, i64 r) {
    if (s.nr == 1) return r * s.rstride[0];
    I rem = (I)r;
    i64 off = 0;
#pragma unroll
    for (int d = kMaxRank - 1; d >= 0; --d) {
        if (d < s.nr) {
            I sz = (I)s.rsize[d];
            off += (i64)(rem % sz) * s.rstride[d];
            rem /= sz;
        }
    }
    return off;
}

__device__ __forceinline__ float max_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// -inf without math.h's INFINITY, which NVRTC does not define.
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ULL); }

template <int K, typename A> __device__ __forceinline__ A init() {
    if constexpr (K == MAX) return neg_inf<A>();
    else return A(0);
}
template <int K, typename A> __device__ __forceinline__ A combine(A a, A b) {
    if constexpr (K == MAX) return max_(a, b);
    else return a + b;
}
// As the CPU: the mean divides the sum by the count converted to A.
template <int K, typename A> __device__ __forceinline__ A finish(A a, i64 count) {
    if constexpr (K == MEAN) return div_rn(a, (A)(double)count);
    else return a;
}

// Combines `v` over the warp, the same value in every lane (fixed butterfly).
template <int K, typename A> __device__ __forceinline__ A warp_combine(A v) {
    for (int o = 16; o > 0; o >>= 1) v = combine<K>(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Combines `v` over the block (blockDim.x a multiple of 32, at most 1024; y
// and z 1), returned to every thread: a fixed tree as common.cuh's
// block_sum, written here because common.cuh's block_max needs INFINITY.
template <int K, typename A> __device__ __forceinline__ A block_combine(A v, A* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_combine<K>(v);
    __syncthreads();  // the previous call's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A r = lane < nwarps ? scratch[lane] : init<K, A>();
    return warp_combine<K>(r);
}

template <int K, typename T, typename I>
__device__ __forceinline__ void rows(const T* x, T* y, i64 nout, i64 count, const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    for (i64 o = blockIdx.x; o < nout; o += gridDim.x) {
        i64 base = kept_offset<I>(s, o);
        A acc = init<K, A>();
        for (i64 r = threadIdx.x; r < count; r += blockDim.x) acc = combine<K>(acc, load(x, base + red_offset<I>(s, r)));
        acc = block_combine<K>(acc, scratch);
        if (threadIdx.x == 0) store(y, o, finish<K>(acc, count));
    }
}

template <int K, typename T, typename I>
__device__ __forceinline__ void warps(const T* x, T* y, i64 nout, i64 count, const ReduceShape& s) {
    typedef acc_t<T> A;
    for (i64 o = blockIdx.x * (i64)blockDim.y + threadIdx.y; o < nout; o += (i64)gridDim.x * blockDim.y) {
        i64 base = kept_offset<I>(s, o);
        A acc = init<K, A>();
        for (i64 r = threadIdx.x; r < count; r += 32) acc = combine<K>(acc, load(x, base + red_offset<I>(s, r)));
        acc = warp_combine<K>(acc);
        if (threadIdx.x == 0) store(y, o, finish<K>(acc, count));
    }
}

// Tree over threadIdx.y of `part[ty][tx]` (blockDim.y a power of two); the
// result lands in part[0][tx]. Ends with a barrier.
template <typename A, typename F> __device__ __forceinline__ void tree_y(A (*part)[33], F f) {
    __syncthreads();
    for (int h = blockDim.y >> 1; h > 0; h >>= 1) {
        if (threadIdx.y < h) part[threadIdx.y][threadIdx.x] = f(part[threadIdx.y][threadIdx.x], part[threadIdx.y + h][threadIdx.x]);
        __syncthreads();
    }
}

template <int K, typename T, typename I>
__device__ __forceinline__ void cols(const T* x, T* y, i64 nout, i64 count, const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ A part[32][33];
    i64 tiles = (nout + 31) / 32;
    // The tile loop is uniform over the block: every thread reaches every barrier.
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        i64 o = t * 32 + threadIdx.x;
        A acc = init<K, A>();
        if (o < nout) {
            i64 base = kept_offset<I>(s, o);
            for (i64 r = threadIdx.y; r < count; r += blockDim.y) acc = combine<K>(acc, load(x, base + red_offset<I>(s, r)));
        }
        part[threadIdx.y][threadIdx.x] = acc;
        tree_y(part, [](A a, A b) { return combine<K>(a, b); });
        if (threadIdx.y == 0 && o < nout) store(y, o, finish<K>(part[0][threadIdx.x], count));
        __syncthreads();
    }
}

// max_backward: g[o] / ties at every element equal to y[o], 0 elsewhere.
template <typename T>
__device__ __forceinline__ acc_t<T> share_of(const T* g, i64 o, long long ties) {
    typedef acc_t<T> A;
    return div_rn(load(g, o), (A)(double)(ties > 1 ? ties : 1));
}

template <typename T, typename I>
__device__ __forceinline__ void mb_rows(const T* x, const T* y, const T* g, T* gx, i64 nout, i64 count, const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ long long scratch[32];
    for (i64 o = blockIdx.x; o < nout; o += gridDim.x) {
        i64 base = kept_offset<I>(s, o);
        A m = load(y, o);
        long long ties = 0;
        for (i64 r = threadIdx.x; r < count; r += blockDim.x) ties += load(x, base + red_offset<I>(s, r)) == m;
        ties = block_combine<SUM>(ties, scratch);
        A share = share_of(g, o, ties);
        for (i64 r = threadIdx.x; r < count; r += blockDim.x) {
            i64 i = base + red_offset<I>(s, r);
            store(gx, i, load(x, i) == m ? share : A(0));
        }
    }
}

template <typename T, typename I>
__device__ __forceinline__ void mb_warps(const T* x, const T* y, const T* g, T* gx, i64 nout, i64 count, const ReduceShape& s) {
    typedef acc_t<T> A;
    for (i64 o = blockIdx.x * (i64)blockDim.y + threadIdx.y; o < nout; o += (i64)gridDim.x * blockDim.y) {
        i64 base = kept_offset<I>(s, o);
        A m = load(y, o);
        long long ties = 0;
        for (i64 r = threadIdx.x; r < count; r += 32) ties += load(x, base + red_offset<I>(s, r)) == m;
        ties = warp_combine<SUM>(ties);
        A share = share_of(g, o, ties);
        for (i64 r = threadIdx.x; r < count; r += 32) {
            i64 i = base + red_offset<I>(s, r);
            store(gx, i, load(x, i) == m ? share : A(0));
        }
    }
}

template <typename T, typename I>
__device__ __forceinline__ void mb_cols(const T* x, const T* y, const T* g, T* gx, i64 nout, i64 count, const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ long long part[32][33];
    i64 tiles = (nout + 31) / 32;
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        i64 o = t * 32 + threadIdx.x;
        long long ties = 0;
        i64 base = 0;
        A m = A(0);
        if (o < nout) {
            base = kept_offset<I>(s, o);
            m = load(y, o);
            for (i64 r = threadIdx.y; r < count; r += blockDim.y) ties += load(x, base + red_offset<I>(s, r)) == m;
        }
        part[threadIdx.y][threadIdx.x] = ties;
        tree_y(part, [](long long a, long long b) { return a + b; });
        if (o < nout) {
            A share = share_of(g, o, part[0][threadIdx.x]);
            for (i64 r = threadIdx.y; r < count; r += blockDim.y) {
                i64 i = base + red_offset<I>(s, r);
                store(gx, i, load(x, i) == m ? share : A(0));
            }
        }
        // part[0] is read above: the next tile must not overwrite it early.
        __syncthreads();
    }
}

}  // namespace sg_red

// The most threads per block lower_basic.rs launches for each layout.
#define SG_RED_BOUND_rows 1024
#define SG_RED_BOUND_warps 256
#define SG_RED_BOUND_cols 1024

// 32-bit index math when every input index fits in 32 bits.
#define SG_RED_DISPATCH(call, total) \
    if ((total) <= 0xffffffffLL) {   \
        typedef unsigned int I;      \
        call;                        \
    } else {                         \
        typedef unsigned long long I; \
        call;                        \
    }

#define SG_REDUCE_LAYOUT(kname, K, layout, dt, T)                                                            \
    extern "C" __global__ void __launch_bounds__(SG_RED_BOUND_##layout) kname##_##layout##_##dt(const T* x, T* y, i64 nout, i64 count, sg_red::ReduceShape s) { \
        SG_RED_DISPATCH((sg_red::layout<sg_red::K, T, I>(x, y, nout, count, s)), nout * count)             \
    }

#define SG_REDUCE_KIND(kname, K, dt, T)          \
    SG_REDUCE_LAYOUT(kname, K, rows, dt, T)      \
    SG_REDUCE_LAYOUT(kname, K, warps, dt, T)     \
    SG_REDUCE_LAYOUT(kname, K, cols, dt, T)

#define SG_MAX_BACKWARD(layout, dt, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(SG_RED_BOUND_##layout) max_backward_##layout##_##dt(const T* x, const T* y, const T* g, T* gx, i64 nout, \
                                                          i64 count, sg_red::ReduceShape s) {               \
        SG_RED_DISPATCH((sg_red::mb_##layout<T, I>(x, y, g, gx, nout, count, s)), nout * count)             \
    }

#define SG_REDUCE_ALL(dt, T)            \
    SG_REDUCE_KIND(sum, SUM, dt, T)     \
    SG_REDUCE_KIND(mean, MEAN, dt, T)   \
    SG_REDUCE_KIND(max, MAX, dt, T)     \
    SG_MAX_BACKWARD(rows, dt, T)        \
    SG_MAX_BACKWARD(warps, dt, T)       \
    SG_MAX_BACKWARD(cols, dt, T)
SG_FOR_EACH_FLOAT(SG_REDUCE_ALL)
