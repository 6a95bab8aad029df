// Reductions (sum, mean, max over any sorted set of axes), the max
// reduction's backward and the squared norms of many tensors, matching crates/core/src/ops/reduce.rs.
//
// The host (src/ops/reduce.rs) drops size-1 axes and merges adjacent axes of the
// same kind, so an input is a row-major walk of kept groups and reduced
// groups: output element o starts at `kept_offset(o)` and its reduced
// elements sit at `kept_offset(o) + red_offset(r)` for r in [0, count).
// Three layouts, each deterministic (a fixed partition of r over threads,
// then a fixed combining tree; no atomics), chosen from the shape only:
//
// - `<k>_rows_<dt>`: the innermost axis is reduced and rows are long; one
//   block per output (grid-stride), blockDim.x a multiple of 32 (<= 1024);
// - `<k>_warps_<dt>`: the innermost axis is reduced and rows are short; one
//   warp per output, blockDim (32, W) (<= 256 threads);
// - `<k>_cols_<dt>`: the innermost axis is kept, or reduced in rows of at
//   most 16; blockDim (32, BY) with BY a power of two <= 32: threadIdx.x
//   walks 32 adjacent outputs (coalesced reads), threadIdx.y splits the
//   reduced range, then a tree over y.
//
// k is sum or max; a mean is the sum kernel with `mean` = 1, which divides
// by the count at the end as the CPU does. Signatures:
//   <k>_<layout>_<dt>(const T* x, T* y, i64 nout, i64 count, i64 mean, ReduceShape s)
//   max_backward_<layout>_<dt>(const T* x, const T* y, const T* g, T* gx,
//                              i64 nout, i64 count, ReduceShape s)
// where y and g of max_backward hold nout elements (the keepdim shape).
// Grids are any size (grid-stride over outputs).
//
// Sums accumulate in acc_t in a different order from the CPU's sequential
// loop, so they agree to rounding, not bit for bit; max and max_backward
// are exact (ties counted exactly, g / ties computed as on the CPU). The
// CPU's max ignores NaN like fmax; an empty group gives -inf (max), 0 (sum)
// and NaN (mean) on both.

namespace sg_red {

// Kept and reduced groups alternate after merging, so a rank-8 input has at
// most 4 of each.
constexpr int kMaxGroups = 4;
enum Kind { SUM, MAX };

struct ReduceShape {
    i64 nk;  // kept groups, outer to inner (0 for a full reduction)
    i64 ksize[kMaxGroups];
    i64 kstride[kMaxGroups];
    i64 nr;  // reduced groups, outer to inner (>= 1)
    i64 rsize[kMaxGroups];
    i64 rstride[kMaxGroups];
};

// Offset of index `idx` of a row-major walk over n groups (n <= 4). 32-bit
// division when every index fits (`wide` false), inlined; 64-bit division,
// far larger and slower code, only for inputs of more than 2^32 elements,
// out of line so the common path stays small. (Sizes and strides go by
// value: taking the address of the kernel's struct would copy it to local
// memory in every thread.)
__device__ __noinline__ i64 walk_offset64(i64 idx, i64 n, i64 s0, i64 s1, i64 s2, i64 s3, i64 t0, i64 t1, i64 t2,
                                          i64 t3) {
    const i64 size[kMaxGroups] = {s0, s1, s2, s3}, stride[kMaxGroups] = {t0, t1, t2, t3};
    unsigned long long rem = (unsigned long long)idx;
    i64 off = 0;
#pragma unroll
    for (int d = kMaxGroups - 1; d >= 0; --d) {
        if (d < n) {
            unsigned long long sz = (unsigned long long)size[d];
            off += (i64)(rem % sz) * stride[d];
            rem /= sz;
        }
    }
    return off;
}

__device__ __forceinline__ i64 walk_offset(i64 idx, i64 n, const i64 (&size)[kMaxGroups],
                                          const i64 (&stride)[kMaxGroups], bool wide) {
    if (n == 0) return 0;
    if (n == 1) return idx * stride[0];
    if (wide) {
        return walk_offset64(idx, n, size[0], size[1], size[2], size[3], stride[0], stride[1], stride[2], stride[3]);
    }
    unsigned int rem = (unsigned int)idx;
    i64 off = 0;
#pragma unroll
    for (int d = kMaxGroups - 1; d >= 0; --d) {
        if (d < n) {
            unsigned int sz = (unsigned int)size[d];
            off += (i64)(rem % sz) * stride[d];
            rem /= sz;
        }
    }
    return off;
}

__device__ __forceinline__ i64 kept_offset(const ReduceShape& s, i64 o, bool wide) {
    return walk_offset(o, s.nk, s.ksize, s.kstride, wide);
}
__device__ __forceinline__ i64 red_offset(const ReduceShape& s, i64 r, bool wide) {
    return walk_offset(r, s.nr, s.rsize, s.rstride, wide);
}

__device__ __forceinline__ float max_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_(double a, double b) { return fmax(a, b); }

// -inf of A, exactly (NVRTC has no <math.h>).
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
// As the CPU: a mean divides the sum by the count converted to A.
template <typename A> __device__ __forceinline__ A finish(A a, i64 count, i64 mean) {
    return mean ? div_rn(a, (A)(double)count) : a;
}

// Combines `v` over the warp, the same value in every lane (fixed butterfly).
template <int K, typename A> __device__ __forceinline__ A warp_combine(A v) {
    for (int o = 16; o > 0; o >>= 1) v = combine<K>(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Combines `v` over the block (blockDim.x a multiple of 32, at most 1024; y
// and z 1), returned to every thread: the fixed tree of common.cuh's
// block_sum/block_max as one template over the kind, which also serves the
// integer tie counts of max_backward.
template <int K, typename A> __device__ __forceinline__ A block_combine(A v, A* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_combine<K>(v);
    __syncthreads();  // the previous call's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A r = lane < nwarps ? scratch[lane] : init<K, A>();
    return warp_combine<K>(r);
}

// Tree over threadIdx.y of `part[ty][tx]` (blockDim.y a power of two); the
// result lands in part[0][tx]. Starts and ends with a barrier.
template <typename A, typename F> __device__ __forceinline__ void tree_y(A (*part)[33], F f) {
    __syncthreads();
    for (int h = blockDim.y >> 1; h > 0; h >>= 1) {
        if (threadIdx.y < h) {
            part[threadIdx.y][threadIdx.x] = f(part[threadIdx.y][threadIdx.x], part[threadIdx.y + h][threadIdx.x]);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------- reductions

template <int K, typename T>
__device__ __forceinline__ void rows(const T* x, T* y, i64 nout, i64 count, i64 mean, const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    const bool wide = nout * count > 0xffffffffLL;
    for (i64 o = blockIdx.x; o < nout; o += gridDim.x) {
        i64 base = kept_offset(s, o, wide);
        A acc = init<K, A>();
        for (i64 r = threadIdx.x; r < count; r += blockDim.x) {
            acc = combine<K>(acc, load(x, base + red_offset(s, r, wide)));
        }
        acc = block_combine<K>(acc, scratch);
        if (threadIdx.x == 0) store(y, o, finish(acc, count, mean));
    }
}

template <int K, typename T>
__device__ __forceinline__ void warps(const T* x, T* y, i64 nout, i64 count, i64 mean, const ReduceShape& s) {
    typedef acc_t<T> A;
    const bool wide = nout * count > 0xffffffffLL;
    // The loop bound depends on threadIdx.y only: whole warps stay together.
    for (i64 o = blockIdx.x * (i64)blockDim.y + threadIdx.y; o < nout; o += (i64)gridDim.x * blockDim.y) {
        i64 base = kept_offset(s, o, wide);
        A acc = init<K, A>();
        for (i64 r = threadIdx.x; r < count; r += 32) acc = combine<K>(acc, load(x, base + red_offset(s, r, wide)));
        acc = warp_combine<K>(acc);
        if (threadIdx.x == 0) store(y, o, finish(acc, count, mean));
    }
}

template <int K, typename T>
__device__ __forceinline__ void cols(const T* x, T* y, i64 nout, i64 count, i64 mean, const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ A part[32][33];
    const bool wide = nout * count > 0xffffffffLL;
    i64 tiles = (nout + 31) / 32;
    // The tile loop is uniform over the block: every thread reaches every barrier.
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        i64 o = t * 32 + threadIdx.x;
        A acc = init<K, A>();
        if (o < nout) {
            i64 base = kept_offset(s, o, wide);
            for (i64 r = threadIdx.y; r < count; r += blockDim.y) {
                acc = combine<K>(acc, load(x, base + red_offset(s, r, wide)));
            }
        }
        part[threadIdx.y][threadIdx.x] = acc;
        tree_y(part, [](A a, A b) { return combine<K>(a, b); });
        if (threadIdx.y == 0 && o < nout) store(y, o, finish(part[0][threadIdx.x], count, mean));
        // part[0] is read above: the next tile must not overwrite it early.
        __syncthreads();
    }
}

// ---------------------------------------------------------------- max_backward

// g[o] / ties at every element of group o equal to y[o], 0 elsewhere.
template <typename T> __device__ __forceinline__ acc_t<T> share_of(const T* g, i64 o, long long ties) {
    typedef acc_t<T> A;
    return div_rn(load(g, o), (A)(double)(ties > 1 ? ties : 1));
}

template <typename T>
__device__ __forceinline__ void mb_rows(const T* x, const T* y, const T* g, T* gx, i64 nout, i64 count,
                                        const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ long long scratch[32];
    const bool wide = nout * count > 0xffffffffLL;
    for (i64 o = blockIdx.x; o < nout; o += gridDim.x) {
        i64 base = kept_offset(s, o, wide);
        A m = load(y, o);
        long long ties = 0;
        for (i64 r = threadIdx.x; r < count; r += blockDim.x) ties += load(x, base + red_offset(s, r, wide)) == m;
        ties = block_combine<SUM>(ties, scratch);
        A share = share_of(g, o, ties);
        for (i64 r = threadIdx.x; r < count; r += blockDim.x) {
            i64 i = base + red_offset(s, r, wide);
            store(gx, i, load(x, i) == m ? share : A(0));
        }
    }
}

template <typename T>
__device__ __forceinline__ void mb_warps(const T* x, const T* y, const T* g, T* gx, i64 nout, i64 count,
                                         const ReduceShape& s) {
    typedef acc_t<T> A;
    const bool wide = nout * count > 0xffffffffLL;
    for (i64 o = blockIdx.x * (i64)blockDim.y + threadIdx.y; o < nout; o += (i64)gridDim.x * blockDim.y) {
        i64 base = kept_offset(s, o, wide);
        A m = load(y, o);
        long long ties = 0;
        for (i64 r = threadIdx.x; r < count; r += 32) ties += load(x, base + red_offset(s, r, wide)) == m;
        ties = warp_combine<SUM>(ties);
        A share = share_of(g, o, ties);
        for (i64 r = threadIdx.x; r < count; r += 32) {
            i64 i = base + red_offset(s, r, wide);
            store(gx, i, load(x, i) == m ? share : A(0));
        }
    }
}

template <typename T>
__device__ __forceinline__ void mb_cols(const T* x, const T* y, const T* g, T* gx, i64 nout, i64 count,
                                        const ReduceShape& s) {
    typedef acc_t<T> A;
    __shared__ long long part[32][33];
    const bool wide = nout * count > 0xffffffffLL;
    i64 tiles = (nout + 31) / 32;
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        i64 o = t * 32 + threadIdx.x;
        long long ties = 0;
        i64 base = 0;
        A m = A(0);
        if (o < nout) {
            base = kept_offset(s, o, wide);
            m = load(y, o);
            for (i64 r = threadIdx.y; r < count; r += blockDim.y) ties += load(x, base + red_offset(s, r, wide)) == m;
        }
        part[threadIdx.y][threadIdx.x] = ties;
        tree_y(part, [](long long a, long long b) { return a + b; });
        if (o < nout) {
            A share = share_of(g, o, part[0][threadIdx.x]);
            for (i64 r = threadIdx.y; r < count; r += blockDim.y) {
                i64 i = base + red_offset(s, r, wide);
                store(gx, i, load(x, i) == m ? share : A(0));
            }
        }
        // part[0] is read above: the next tile must not overwrite it early.
        __syncthreads();
    }
}

// Squared norms of many tensors (SquaredNorms in crates/core/src/ops/reduce.rs),
// up to kNormTensors per pair of launches, described by a NormTable:
//   squared_norms_partial_<dt>(NormTable t, acc_t<T>* partials)
//     one 256-thread block per run of kNormChunk elements of a tensor
//     (grid-stride over the table's runs): the run's sum of squares, each
//     thread's share in a fixed order then a fixed tree, into
//     partials[t.partial_base + run];
//   squared_norms_finish_<dt>(NormTable t, acc_t<T>* partials, acc_t<T>* norms)
//     one block per tensor: its runs' partial sums in a fixed order, into
//     norms[t.norm_base + k], and those partial slots zeroed again (the
//     workspace is all zero between launches, as the CPU leaves it).
// Runs of a 16-byte-aligned tensor that are whole are read in 16-byte packs.
constexpr int kNormTensors = 96;
constexpr int kNormChunk = 16384;
constexpr int kNormThreads = 256;

struct NormTable {
    i64 n[kNormTensors];          // elements of each tensor
    i64 ptr[kNormTensors];        // its address
    i64 chunk_end[kNormTensors];  // running count of runs through tensor k
    i64 partial_base;             // the workspace slot of the table's first run
    i64 norm_base;                // the norms slot of the table's first tensor
    i64 count;                    // tensors in the table (>= 1)
};

template <typename T> __device__ void norm_partial(const NormTable& t, acc_t<T>* partials) {
    typedef acc_t<T> A;
    typedef Pack<T> P;
    __shared__ A scratch[32];
    const i64 total = t.chunk_end[t.count - 1];
    for (i64 run = blockIdx.x; run < total; run += gridDim.x) {
        // The first tensor whose runs end past `run` (empty tensors own none).
        int lo = 0, hi = (int)t.count - 1;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (t.chunk_end[mid] > run) hi = mid;
            else lo = mid + 1;
        }
        const T* x = reinterpret_cast<const T*>(t.ptr[lo]);
        const i64 start = (run - (lo ? t.chunk_end[lo - 1] : 0)) * kNormChunk;
        const i64 end = min(t.n[lo], start + (i64)kNormChunk);
        A s = A(0);
        if ((t.ptr[lo] & 15) == 0 && end - start == kNormChunk) {
            const T* base = x + start;  // start is a multiple of kNormChunk: still 16-byte aligned
#pragma unroll
            for (int r = 0; r < kNormChunk / (P::N * kNormThreads); ++r) {
                P p;
                p.read(base, r * kNormThreads + threadIdx.x);
#pragma unroll
                for (int e = 0; e < P::N; ++e) {
                    const A v = load(p.elems(), e);
                    s = add_rn(s, mul_rn(v, v));
                }
            }
        } else {
            for (i64 j = start + threadIdx.x; j < end; j += kNormThreads) {
                const A v = load(x, j);
                s = add_rn(s, mul_rn(v, v));
            }
        }
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) partials[t.partial_base + run] = s;
    }
}

template <typename T> __device__ void norm_finish(const NormTable& t, acc_t<T>* partials, acc_t<T>* norms) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    for (i64 k = blockIdx.x; k < t.count; k += gridDim.x) {
        const i64 first = t.partial_base + (k ? t.chunk_end[k - 1] : 0), last = t.partial_base + t.chunk_end[k];
        A s = A(0);
        for (i64 j = first + threadIdx.x; j < last; j += kNormThreads) {
            s = add_rn(s, partials[j]);
            partials[j] = A(0);  // read by this thread only
        }
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) norms[t.norm_base + k] = s;
    }
}

}  // namespace sg_red

// The most threads per block src/ops/reduce.rs launches for each layout.
#define SG_RED_BOUND_rows 1024
#define SG_RED_BOUND_warps 256
#define SG_RED_BOUND_cols 1024

#define SG_REDUCE_LAYOUT(kname, K, layout, dt, T)                                                         \
    extern "C" __global__ void __launch_bounds__(SG_RED_BOUND_##layout)                                   \
        kname##_##layout##_##dt(const T* x, T* y, i64 nout, i64 count, i64 mean, sg_red::ReduceShape s) { sg_pdl_entry(); \
        sg_red::layout<sg_red::K, T>(x, y, nout, count, mean, s);                                         \
    }

#define SG_MAX_BACKWARD(layout, dt, T)                                                                \
    extern "C" __global__ void __launch_bounds__(SG_RED_BOUND_##layout) max_backward_##layout##_##dt( \
        const T* x, const T* y, const T* g, T* gx, i64 nout, i64 count, sg_red::ReduceShape s) { sg_pdl_entry();      \
        sg_red::mb_##layout<T>(x, y, g, gx, nout, count, s);                                          \
    }

#define SG_REDUCE_ALL(dt, T)                 \
    SG_REDUCE_LAYOUT(sum, SUM, rows, dt, T)  \
    SG_REDUCE_LAYOUT(sum, SUM, warps, dt, T) \
    SG_REDUCE_LAYOUT(sum, SUM, cols, dt, T)  \
    SG_REDUCE_LAYOUT(max, MAX, rows, dt, T)  \
    SG_REDUCE_LAYOUT(max, MAX, warps, dt, T) \
    SG_REDUCE_LAYOUT(max, MAX, cols, dt, T)  \
    SG_MAX_BACKWARD(rows, dt, T)             \
    SG_MAX_BACKWARD(warps, dt, T)            \
    SG_MAX_BACKWARD(cols, dt, T)             \
    SG_SQUARED_NORMS(dt, T)
#define SG_SQUARED_NORMS(dt, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(sg_red::kNormThreads)                                     \
        squared_norms_partial_##dt(const __grid_constant__ sg_red::NormTable t, acc_t<T>* partials) { sg_pdl_entry();      \
        sg_red::norm_partial<T>(t, partials);                                                              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(sg_red::kNormThreads) squared_norms_finish_##dt(          \
        const __grid_constant__ sg_red::NormTable t, acc_t<T>* partials, acc_t<T>* norms) { sg_pdl_entry();                \
        sg_red::norm_finish<T>(t, partials, norms);                                                        \
    }
SG_FOR_EACH_FLOAT(SG_REDUCE_ALL)
