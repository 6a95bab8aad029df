// Mean token cross-entropy over [N, V] logits and its backward, as
// crates/core/src/ops/loss.rs. Targets are i32 or i64 (`tgt_i64` says
// which); statistics (lse, the loss, their cotangents) are acc_t<T>, the
// op's stat dtype.
//
// Forward, two launches:
// - `cross_entropy_lse_<dtype>(x, lse, rows, cols)`: one block per row
//   (grid-striding), blockDim.x a multiple of 32 ≤ 1024; writes every row's
//   max-shifted log-sum-exp.
// - `cross_entropy_loss_<dtype>(x, tgt, tgt_i64, lse, loss, rows, cols,
//   ignore_index)`: one block of 1024 threads; thread i adds rows i, i+1024,
//   ... in order and a fixed block tree adds the threads, so the mean is
//   deterministic without a scratch buffer of per-row losses (each one is
//   recomputed as lse − logit[target]). No row kept: 0/0 = NaN, as the CPU.
//
// Backward, one launch: `cross_entropy_backward_<dtype>(x, tgt, tgt_i64,
// lse, gloss, glse, has_glse, dx, rows, cols, ignore_index)`, grid-striding
// over rows with a grid of at most CE_BWD_MAX_BLOCKS (set by the lowering):
// every block first counts the kept rows itself (the mean's divisor; there
// is nowhere to keep it between launches), so fewer blocks than rows keep
// that count cheap. dx may be x (in place): each element is read and then
// overwritten by the same thread, and rows are independent.
//
// The CPU rejects a target outside [0, V) that is not the ignore index; a
// kernel cannot, so such a row never reads out of bounds and turns the loss
// (forward) or its row of dx (backward, when a gradient flows to the row)
// into NaN, where it is noticed.

__device__ __forceinline__ i64 load_target(const void* tgt, int tgt_i64, i64 n) {
    return tgt_i64 ? ((const i64*)tgt)[n] : (i64)((const int*)tgt)[n];
}

template <typename A> __device__ __forceinline__ A quiet_nan() {
    return (A)__longlong_as_double(0x7ff8000000000000LL);
}

// log Σ exp(x − shift) + shift with shift the row max, or 0 when the max is
// infinite (PyTorch's rule, as the CPU): an all −inf row gives −inf, not NaN.
template <typename T>
__device__ void cross_entropy_lse_rows(const T* __restrict__ x, acc_t<T>* __restrict__ lse, i64 rows, i64 cols) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        A m = A(-INFINITY);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) m = fmax(m, load(xr, k));
        m = block_max(m, scratch);  // fmax ignores NaN, as Rust's `max`
        const A shift = isfinite(m) ? m : A(0);
        A s = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) s += exp(load(xr, k) - shift);
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) lse[r] = log(s) + shift;
    }
}

template <typename T>
__device__ void cross_entropy_loss_block(const T* __restrict__ x, const void* __restrict__ tgt, int tgt_i64,
                                         const acc_t<T>* __restrict__ lse, acc_t<T>* __restrict__ loss, i64 rows,
                                         i64 cols, i64 ignore_index) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    __shared__ i64 count_scratch[32];
    A sum = A(0);
    i64 kept = 0;
    for (i64 n = threadIdx.x; n < rows; n += blockDim.x) {
        const i64 t = load_target(tgt, tgt_i64, n);
        if (t == ignore_index) continue;
        sum += (t >= 0 && t < cols) ? lse[n] - load(x, n * cols + t) : quiet_nan<A>();
        kept += 1;
    }
    sum = block_sum(sum, scratch);
    kept = block_sum(kept, count_scratch);
    if (threadIdx.x == 0) loss[0] = sum / (A)(double)kept;
}

// dx[n, j] = a_n·(p_nj − [j = t_n]) + glse_n·p_nj, p_nj = exp(x[n, j] − lse_n),
// a_n = gloss / max(#kept, 1) for kept rows and 0 for ignored ones; a row
// with a_n = glse_n = 0 is zero (no 0·exp(..) NaN from infinite logits).
template <typename T>
__device__ void cross_entropy_backward_rows(const T* x, const void* __restrict__ tgt, int tgt_i64,
                                            const acc_t<T>* __restrict__ lse, const acc_t<T>* __restrict__ gloss,
                                            const acc_t<T>* __restrict__ glse, int has_glse, T* dx, i64 rows,
                                            i64 cols, i64 ignore_index) {
    typedef acc_t<T> A;
    __shared__ i64 count_scratch[32];
    i64 kept = 0;
    for (i64 n = threadIdx.x; n < rows; n += blockDim.x) kept += load_target(tgt, tgt_i64, n) != ignore_index;
    kept = block_sum(kept, count_scratch);
    // One rounded scale for every row, as the CPU.
    const A scale = gloss[0] / (A)(double)(kept > 1 ? kept : 1);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        T* dr = dx + r * cols;
        const i64 t = load_target(tgt, tgt_i64, r);
        const A a = t == ignore_index ? A(0) : scale;
        const A b = has_glse ? glse[r] : A(0);
        if (a == A(0) && b == A(0)) {
            for (i64 k = threadIdx.x; k < cols; k += blockDim.x) store(dr, k, A(0));
            continue;
        }
        const bool bad = t != ignore_index && (t < 0 || t >= cols);
        const A l = lse[r], coef = a + b;
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) {
            const A p = exp(load(xr, k) - l);
            const A v = coef * p - (k == t ? a : A(0));
            store(dr, k, bad ? quiet_nan<A>() : v);
        }
    }
}

#define SG_LOSS_KERNELS(sfx, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        cross_entropy_lse_##sfx(const T* x, acc_t<T>* lse, i64 rows, i64 cols) { sg_pdl_entry();                                \
        cross_entropy_lse_rows<T>(x, lse, rows, cols);                                                          \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        cross_entropy_loss_##sfx(const T* x, const void* tgt, int tgt_i64, const acc_t<T>* lse, acc_t<T>* loss, \
                                 i64 rows, i64 cols, i64 ignore_index) { sg_pdl_entry();                                        \
        cross_entropy_loss_block<T>(x, tgt, tgt_i64, lse, loss, rows, cols, ignore_index);                      \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        cross_entropy_backward_##sfx(const T* x, const void* tgt, int tgt_i64, const acc_t<T>* lse,             \
                                     const acc_t<T>* gloss, const acc_t<T>* glse, int has_glse, T* dx,          \
                                     i64 rows, i64 cols, i64 ignore_index) { sg_pdl_entry();                                    \
        cross_entropy_backward_rows<T>(x, tgt, tgt_i64, lse, gloss, glse, has_glse, dx, rows, cols,             \
                                       ignore_index);                                                           \
    }

SG_FOR_EACH_FLOAT(SG_LOSS_KERNELS)
