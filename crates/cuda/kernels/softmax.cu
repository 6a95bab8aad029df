// Softmax over the last axis and its backward, as crates/core/src/ops/softmax.rs.
//
// `softmax_<dtype>(x, y, rows, cols)` and
// `softmax_backward_<dtype>(y, gy, gx, rows, cols)`: one block per row
// (grid-striding over rows), blockDim.x a multiple of 32, at most 1024.
//
// Both run in place (softmax: y == x; backward: gx == gy), so no pointer is
// `__restrict__` and every row is read completely (its statistics reduced
// over the block, which synchronises it) before any element of it is
// written; an element is then read and written by the same thread.

// y = exp(x − max) / Σ exp(x − max). The max ignores NaN as Rust's
// `f32::max` does (fmax), so an all −inf row gives NaN as on the CPU.
template <typename T> __device__ void softmax_rows(const T* x, T* y, i64 rows, i64 cols) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        A m = A(-INFINITY);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) m = fmax(m, load(xr, k));
        m = block_max(m, scratch);  // fmax ignores NaN, as Rust's `max`
        A s = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) s += exp(load(xr, k) - m);
        s = block_sum(s, scratch);
        // exp is evaluated again rather than kept, as on the CPU: one rounding to T.
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) store(yr, k, exp(load(xr, k) - m) / s);
    }
}

// gx = y·(gy − Σ gy·y).
template <typename T> __device__ void softmax_backward_rows(const T* y, const T* gy, T* gx, i64 rows, i64 cols) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* yr = y + r * cols;
        const T* gr = gy + r * cols;
        T* or_ = gx + r * cols;
        A dot = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) dot += load(gr, k) * load(yr, k);
        dot = block_sum(dot, scratch);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) store(or_, k, load(yr, k) * (load(gr, k) - dot));
    }
}

#define SG_SOFTMAX_KERNELS(sfx, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) softmax_##sfx(const T* x, T* y, i64 rows, i64 cols) { sg_pdl_entry();  \
        softmax_rows<T>(x, y, rows, cols);                                                                    \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(1024)                                                        \
        softmax_backward_##sfx(const T* y, const T* gy, T* gx, i64 rows, i64 cols) { sg_pdl_entry();                          \
        softmax_backward_rows<T>(y, gy, gx, rows, cols);                                                      \
    }

SG_FOR_EACH_FLOAT(SG_SOFTMAX_KERNELS)
