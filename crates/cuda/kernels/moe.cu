// Mixture-of-experts routing and grouped products (crates/core/src/ops/moe.rs
// defines them; crates/cuda/src/ops/moe.rs builds the launches). Every
// result is computed by one thread in the CPU reference's order, rounding as
// it rounds (products and sums one `_rn` operation at a time), so every
// output equals the CPU's bit for bit.
//
// - `top_k_<dt>(const T* x, T* vals, int* idx, i64 rows, i64 width, i64 k)`:
//   a thread per row takes the best remaining entry k times (larger first,
//   NaN above every number, the lower index among equals). 1-D grid-stride.
// - `top_k_backward_<dt>(const int* idx, const T* g, T* gx, i64 rows,
//   i64 width, i64 k)`: a thread per element of gx, the cotangent of the
//   slot that picked it or zero. 1-D grid-stride.
// - `expert_sort_<id>(const Id* ids, int* tokens, int* position,
//   int* offsets, float* counts, i64 pairs, i64 k, i64 experts)`: ONE
//   block. Each thread counts its experts' pairs (also written to counts as
//   floats), thread 0 sums the counts into offsets, then
//   each thread walks all pairs in order placing its experts' pairs (a
//   stable counting sort). Ids outside [0, experts) are clamped into it
//   (the CPU refuses them), so the kernel never writes out of bounds.
// - `grouped_matmul_<dt>(const T* x, const T* w, const int* offsets,
//   T* y, i64 m, i64 k, i64 n, i64 experts, i64 trans_w)`: a thread per
//   output element; its row's expert by binary search in the offsets
//   (clamped into [0, experts)), then the dot product in depth order.
// - `grouped_matmul_weight_grad_<dt>(const T* a, const T* b,
//   const int* offsets, T* out, i64 m, i64 na, i64 nb, i64 experts)`: a
//   thread per output element (e, i, j) sums its expert's rows in order
//   (the rows clamped into [0, m]).
//
// These are the plain forms: correct on every shape, not yet fast (no
// tensor cores, no tiling).

#define SG_MOE_THREADS 256

namespace sg_moe {

// Is score a (index i) ranked before score b (index j)? `ranks_before` of the CPU.
template <typename A> __device__ __forceinline__ bool before(A a, i64 i, A b, i64 j) {
    const bool an = isnan(a), bn = isnan(b);
    if (an || bn) return an && (!bn || i < j);
    return a > b || (a == b && i < j);
}

template <typename T>
__device__ __forceinline__ void top_k(const T* x, T* vals, int* idx, i64 rows, i64 width, i64 k) {
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (i64)gridDim.x * blockDim.x) {
        const T* row = x + r * width;
        // The slots already filled hold the taken indices: an entry is free
        // when no earlier slot of this row took it.
        for (i64 s = 0; s < k; ++s) {
            i64 best = -1;
            acc_t<T> best_v = 0;
            for (i64 i = 0; i < width; ++i) {
                bool taken = false;
                for (i64 t = 0; t < s; ++t) taken |= idx[r * k + t] == (int)i;
                if (taken) continue;
                const acc_t<T> v = load(row, i);
                if (best < 0 || before(v, i, best_v, best)) best = i, best_v = v;
            }
            idx[r * k + s] = (int)best;
            vals[r * k + s] = row[best];
        }
    }
}

template <typename T>
__device__ __forceinline__ void top_k_backward(const int* idx, const T* g, T* gx, i64 rows, i64 width, i64 k) {
    const i64 n = rows * width;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const i64 r = e / width, c = e % width;
        acc_t<T> v = 0;
        for (i64 s = 0; s < k; ++s)
            if (idx[r * k + s] == (int)c) v = load(g, r * k + s);
        store(gx, e, v);
    }
}

template <typename Id>
__device__ __forceinline__ void expert_sort(const Id* ids, int* tokens, int* position, int* offsets, float* counts,
                                            i64 pairs, i64 k, i64 experts) {
    auto expert = [&](i64 i) -> i64 {
        const i64 e = (i64)ids[i];
        return e < 0 ? 0 : (e >= experts ? experts - 1 : e);
    };
    for (i64 e = threadIdx.x; e < experts; e += blockDim.x) {
        int count = 0;
        for (i64 i = 0; i < pairs; ++i) count += expert(i) == e;
        offsets[e + 1] = count;
        counts[e] = (float)count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (i64 e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
    }
    __syncthreads();
    for (i64 e = threadIdx.x; e < experts; e += blockDim.x) {
        int p = offsets[e];
        for (i64 i = 0; i < pairs; ++i) {
            if (expert(i) != e) continue;
            tokens[p] = (int)(i / k);
            position[i] = p;
            ++p;
        }
    }
}

// The expert whose rows hold row p: the last e with offsets[e] <= p, within [0, experts).
__device__ __forceinline__ i64 expert_of(const int* offsets, i64 experts, i64 p) {
    i64 lo = 0, hi = experts - 1;
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) / 2;
        if ((i64)offsets[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__device__ __forceinline__ void grouped_matmul(const T* x, const T* w, const int* offsets, T* y, i64 m, i64 k, i64 n,
                                               i64 experts, i64 trans_w) {
    const i64 total = m * n;
    for (i64 o = (i64)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
        const i64 p = o / n, j = o % n;
        const T* we = w + expert_of(offsets, experts, p) * k * n;
        acc_t<T> acc = 0;
        for (i64 i = 0; i < k; ++i) {
            const acc_t<T> wv = trans_w ? load(we, i * n + j) : load(we, j * k + i);
            acc = add_rn(acc, mul_rn(load(x, p * k + i), wv));
        }
        store(y, o, acc);
    }
}

template <typename T>
__device__ __forceinline__ void grouped_matmul_weight_grad(const T* a, const T* b, const int* offsets, T* out, i64 m,
                                                           i64 na, i64 nb, i64 experts) {
    const i64 total = experts * na * nb;
    for (i64 o = (i64)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (i64)gridDim.x * blockDim.x) {
        const i64 e = o / (na * nb), i = (o / nb) % na, j = o % nb;
        i64 lo = offsets[e], hi = offsets[e + 1];
        lo = lo < 0 ? 0 : (lo > m ? m : lo);
        hi = hi < lo ? lo : (hi > m ? m : hi);
        acc_t<T> acc = 0;
        for (i64 p = lo; p < hi; ++p) acc = add_rn(acc, mul_rn(load(a, p * na + i), load(b, p * nb + j)));
        store(out, o, acc);
    }
}

}  // namespace sg_moe

#define SG_MOE_FLOAT_KERNELS(sfx, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(SG_MOE_THREADS)                                              \
        top_k_##sfx(const T* x, T* vals, int* idx, i64 rows, i64 width, i64 k) { sg_pdl_entry(); \
        sg_moe::top_k<T>(x, vals, idx, rows, width, k);                                                       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_MOE_THREADS)                                              \
        top_k_backward_##sfx(const int* idx, const T* g, T* gx, i64 rows, i64 width, i64 k) { sg_pdl_entry(); \
        sg_moe::top_k_backward<T>(idx, g, gx, rows, width, k);                                                \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_MOE_THREADS)                                              \
        grouped_matmul_##sfx(const T* x, const T* w, const int* offsets, T* y, i64 m, i64 k, i64 n,           \
                             i64 experts, i64 trans_w) { sg_pdl_entry(); \
        sg_moe::grouped_matmul<T>(x, w, offsets, y, m, k, n, experts, trans_w);                               \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_MOE_THREADS)                                              \
        grouped_matmul_weight_grad_##sfx(const T* a, const T* b, const int* offsets, T* out, i64 m, i64 na,   \
                                         i64 nb, i64 experts) { sg_pdl_entry(); \
        sg_moe::grouped_matmul_weight_grad<T>(a, b, offsets, out, m, na, nb, experts);                        \
    }
SG_FOR_EACH_FLOAT(SG_MOE_FLOAT_KERNELS)

#define SG_MOE_SORT_KERNEL(sfx, Id)                                                                           \
    extern "C" __global__ void __launch_bounds__(SG_MOE_THREADS)                                              \
        expert_sort_##sfx(const Id* ids, int* tokens, int* position, int* offsets, float* counts, i64 pairs,  \
                          i64 k, i64 experts) { sg_pdl_entry(); \
        sg_moe::expert_sort<Id>(ids, tokens, position, offsets, counts, pairs, k, experts);                   \
    }
SG_MOE_SORT_KERNEL(i32, int)
SG_MOE_SORT_KERNEL(i64, long long)
