// Counter-based dropout, y = x * keep / (1 - p), computing exactly the CPU
// reference of crates/core/src/ops/dropout.rs, whose module doc defines
// the mask: the same SplitMix64 hash of (stream, micro-batch, step,
// element index) in wrapping 64-bit integer arithmetic, so both keep the
// same elements; a kept element is mul_rn(x, scale) in acc_t rounded once
// to T, a dropped one +0.
//
// Launch convention (crates/cuda/src/ops/dropout.rs builds it): 1-D
// grid-stride loops over the n elements, any grid, blockDim.x at most
// SG_DROPOUT_THREADS (the kernels' __launch_bounds__);
// - `dropout_<dt>(const T* x, const float* step, T* y, i64 n, i64 stream,
//    i64 micro_batch, i64 threshold, acc_t<T> scale)`: `step` the
//    one-element f32 step count in device memory (a captured graph replays
//    with each step's value), `stream` the u64 stream's bits, `threshold`
//    round(p * 2^32) in [0, 2^32], `scale` 1 / (1 - p) rounded to acc_t.
// In place: y may be x. Each thread reads element i of x before it writes
// element i of y, and no pointer is __restrict__, so that is safe.

#define SG_DROPOUT_THREADS 256

namespace sg_dropout {

typedef unsigned long long u64;

constexpr u64 GAMMA = 0x9e3779b97f4a7c15ull;

// SplitMix64's output function.
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// The f32 step count as Rust's `as u64`: toward zero, saturating, NaN to 0.
__device__ __forceinline__ u64 step_count(float s) {
    if (!(s > 0.0f)) return 0ull;
    if (s >= 18446744073709551616.0f) return ~0ull;
    return (u64)s;
}

template <typename T>
__device__ __forceinline__ void dropout(const T* x, const float* step, T* y, i64 n, u64 stream, u64 micro_batch,
                                        u64 threshold, acc_t<T> scale) {
    const u64 key = mix64(mix64(mix64(GAMMA ^ stream) ^ step_count(*step)) ^ micro_batch);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const u64 r = mix64(key + ((u64)i + 1ull) * GAMMA) >> 32;
        const acc_t<T> v = load(x, i);
        store(y, i, r >= threshold ? mul_rn(v, scale) : acc_t<T>(0));
    }
}

}  // namespace sg_dropout

#define SG_DROPOUT_KERNELS(sfx, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(SG_DROPOUT_THREADS)                                             \
        dropout_##sfx(const T* x, const float* step, T* y, i64 n, i64 stream, i64 micro_batch, i64 threshold,    \
                      acc_t<T> scale) { sg_pdl_entry(); \
        sg_dropout::dropout<T>(x, step, y, n, (unsigned long long)stream, (unsigned long long)micro_batch,       \
                               (unsigned long long)threshold, scale);                                             \
    }
SG_FOR_EACH_FLOAT(SG_DROPOUT_KERNELS)
