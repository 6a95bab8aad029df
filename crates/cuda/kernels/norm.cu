// RMSNorm and LayerNorm over the last axis, forward and backward; the same
// formulas, in the same operation order, as crates/core/src/ops/norm.rs.
//
// Row kernels (`rms_norm_*`, `rms_norm_backward_*`, `layer_norm_*`,
// `layer_norm_backward_*`): one block per row of `cols` elements, threads
// striding over the row, grid-striding over rows so any grid is correct.
// blockDim.x is a multiple of 32, at most 1024 (block_sum's contract).
//
// Parameter-gradient kernels (`rms_norm_backward_gw_*`,
// `layer_norm_backward_gwb_*`): a sum over all rows per column, computed
// without float atomics and without scratch memory: block (32, 32) owns 32
// columns; lane y of column x adds rows y, y+32, ... in row order, then the
// 32 lane sums of a column are added by a fixed tree in shared memory. The
// order depends only on the shape, so every run gives the same bits.
//
// `rms_norm_vec_*` and `rms_norm_backward_vec_*` take the row kernels'
// arguments for rows of whole 16-byte packs, every address 16-byte aligned
// (the lowering checks, and that blockDim.x · NORM_VEC_PACKS covers a row):
// each thread keeps its packs of the row in registers between the two
// passes, so the row is read from memory once, 16 bytes per load. Each
// element's formula is the row kernel's; the sum's grouping differs.
//
// Statistics (mean, rstd and their cotangents) are stored in acc_t<T>,
// which is the op's stat dtype (f32, or f64 for f64 data).
//
// The backward row kernels take an `addend` (null when absent): a tensor of
// x's shape added to gx before its rounding, as the CPU does (the op's
// `addend` form). It may be gx itself, so gx is not __restrict__: each
// thread reads an element of the addend before it writes that element.

#define NORM_COL_TILE 32   // columns per parameter-gradient block (blockDim.x)
#define NORM_ROW_LANES 32  // row lanes per parameter-gradient block (blockDim.y)

// The CPU converts the length to the accumulator through f64 (`c(cdim as f64)`).
template <typename A> __device__ __forceinline__ A row_count(i64 cols) { return (A)(double)cols; }

// ---------------------------------------------------------------- rms_norm

// y = x·rstd·w, rstd = 1/sqrt(mean(x²) + eps).
template <typename T>
__device__ void rms_norm_rows(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                              acc_t<T>* __restrict__ rstd, i64 rows, i64 cols, double eps) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    const A n = row_count<A>(cols), e = (A)eps;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        A ss = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) {
            A v = load(xr, k);
            ss += v * v;
        }
        ss = block_sum(ss, scratch);
        const A inv = A(1) / sqrt(ss / n + e);
        if (threadIdx.x == 0) rstd[r] = inv;
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) store(yr, k, load(xr, k) * inv * load(w, k));
    }
}

// gx = rstd·w·gy − x·rstd³·(Σ x·w·gy + grstd)/C per row (+ addend).
template <typename T>
__device__ void rms_norm_backward_rows(const T* __restrict__ x, const T* __restrict__ w,
                                       const acc_t<T>* __restrict__ rstd, const T* __restrict__ gy,
                                       const acc_t<T>* __restrict__ grstd, int has_grstd, const T* addend, T* gx,
                                       i64 rows, i64 cols) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    const A n = row_count<A>(cols);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        const T* gr = gy + r * cols;
        T* or_ = gx + r * cols;
        A dot = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) dot += load(xr, k) * load(w, k) * load(gr, k);
        dot = block_sum(dot, scratch);
        const A rs = rstd[r];
        const A gs = has_grstd ? grstd[r] : A(0);
        const A coef = rs * rs * rs * (dot + gs) / n;
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) {
            const A xv = load(xr, k), g = load(gr, k);
            const A v = rs * load(w, k) * g - xv * coef;
            store(or_, k, addend ? v + load(addend, r * cols + k) : v);
        }
    }
}

#define NORM_VEC_PACKS 4  // 16-byte packs of a row a vec-kernel thread holds

template <typename T>
__device__ void rms_norm_rows_vec(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                  acc_t<T>* __restrict__ rstd, i64 rows, i64 cols, double eps) {
    typedef acc_t<T> A;
    typedef Pack<T> P;
    __shared__ A scratch[32];
    const A n = row_count<A>(cols), e = (A)eps;
    const int packs = (int)(cols / P::N);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        P px[NORM_VEC_PACKS];
        A ss = A(0);
#pragma unroll
        for (int u = 0; u < NORM_VEC_PACKS; ++u) {
            const int j = threadIdx.x + u * blockDim.x;
            if (j < packs) px[u].read(x + r * cols, j);
        }
#pragma unroll
        for (int u = 0; u < NORM_VEC_PACKS; ++u) {
            const int j = threadIdx.x + u * blockDim.x;
            if (j < packs)
#pragma unroll
                for (int k = 0; k < P::N; ++k) {
                    const A v = load(px[u].elems(), k);
                    ss += v * v;
                }
        }
        ss = block_sum(ss, scratch);
        const A inv = A(1) / sqrt(ss / n + e);
        if (threadIdx.x == 0) rstd[r] = inv;
#pragma unroll
        for (int u = 0; u < NORM_VEC_PACKS; ++u) {
            const int j = threadIdx.x + u * blockDim.x;
            if (j >= packs) continue;
            P pw, py;
            pw.read(w, j);
#pragma unroll
            for (int k = 0; k < P::N; ++k)
                store(py.elems(), k, load(px[u].elems(), k) * inv * load(pw.elems(), k));
            py.write(y + r * cols, j);
        }
    }
}

template <typename T>
__device__ void rms_norm_backward_rows_vec(const T* __restrict__ x, const T* __restrict__ w,
                                           const acc_t<T>* __restrict__ rstd, const T* __restrict__ gy,
                                           const acc_t<T>* __restrict__ grstd, int has_grstd, const T* addend,
                                           T* gx, i64 rows, i64 cols) {
    typedef acc_t<T> A;
    typedef Pack<T> P;
    __shared__ A scratch[32];
    const A n = row_count<A>(cols);
    const int packs = (int)(cols / P::N);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        P px[NORM_VEC_PACKS], pg[NORM_VEC_PACKS];
#pragma unroll
        for (int u = 0; u < NORM_VEC_PACKS; ++u) {
            const int j = threadIdx.x + u * blockDim.x;
            if (j < packs) {
                px[u].read(x + r * cols, j);
                pg[u].read(gy + r * cols, j);
            }
        }
        A dot = A(0);
#pragma unroll
        for (int u = 0; u < NORM_VEC_PACKS; ++u) {
            const int j = threadIdx.x + u * blockDim.x;
            if (j >= packs) continue;
            P pw;
            pw.read(w, j);
#pragma unroll
            for (int k = 0; k < P::N; ++k)
                dot += load(px[u].elems(), k) * load(pw.elems(), k) * load(pg[u].elems(), k);
        }
        dot = block_sum(dot, scratch);
        const A rs = rstd[r];
        const A gs = has_grstd ? grstd[r] : A(0);
        const A coef = rs * rs * rs * (dot + gs) / n;
#pragma unroll
        for (int u = 0; u < NORM_VEC_PACKS; ++u) {
            const int j = threadIdx.x + u * blockDim.x;
            if (j >= packs) continue;
            P pw, po, pa;
            pw.read(w, j);
            if (addend) pa.read(addend + r * cols, j);
#pragma unroll
            for (int k = 0; k < P::N; ++k) {
                const A xv = load(px[u].elems(), k), g = load(pg[u].elems(), k);
                const A v = rs * load(pw.elems(), k) * g - xv * coef;
                store(po.elems(), k, addend ? v + load(pa.elems(), k) : v);
            }
            po.write(gx + r * cols, j);
        }
    }
}

// Adds the NORM_ROW_LANES partial sums of each column (lanes along y) by a
// fixed tree; the total ends in part[0][threadIdx.x]. Every thread of the
// block must call it.
template <typename A> __device__ void column_tree(A (*part)[NORM_COL_TILE + 1]) {
    __syncthreads();
    for (int h = NORM_ROW_LANES / 2; h > 0; h >>= 1) {
        if ((int)threadIdx.y < h) part[threadIdx.y][threadIdx.x] += part[threadIdx.y + h][threadIdx.x];
        __syncthreads();
    }
}

// gw[c] = Σ_rows gy·x·rstd.
template <typename T>
__device__ void rms_norm_backward_gw_cols(const T* __restrict__ x, const acc_t<T>* __restrict__ rstd,
                                          const T* __restrict__ gy, T* __restrict__ gw, i64 rows, i64 cols) {
    typedef acc_t<T> A;
    // +1 column of padding: the tree reads down columns, without bank conflicts.
    __shared__ A part[NORM_ROW_LANES][NORM_COL_TILE + 1];
    const i64 c = (i64)blockIdx.x * NORM_COL_TILE + threadIdx.x;
    A s = A(0);
    if (c < cols)
        for (i64 r = threadIdx.y; r < rows; r += NORM_ROW_LANES)
            s += load(gy, r * cols + c) * load(x, r * cols + c) * rstd[r];
    part[threadIdx.y][threadIdx.x] = s;
    column_tree(part);
    if (threadIdx.y == 0 && c < cols) store(gw, c, part[0][threadIdx.x]);
}

// ---------------------------------------------------------------- layer_norm

// y = (x − mean)·rstd·w + b, rstd = 1/sqrt(var + eps), biased variance of the
// centred values (two passes, as the CPU: no cancellation).
template <typename T>
__device__ void layer_norm_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                T* __restrict__ y, acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                                i64 rows, i64 cols, double eps) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    const A n = row_count<A>(cols), e = (A)eps;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        T* yr = y + r * cols;
        A s = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) s += load(xr, k);
        const A m = block_sum(s, scratch) / n;
        A v = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) {
            const A d = load(xr, k) - m;
            v += d * d;
        }
        const A var = block_sum(v, scratch) / n;
        const A inv = A(1) / sqrt(var + e);
        if (threadIdx.x == 0) {
            mean[r] = m;
            rstd[r] = inv;
        }
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x)
            store(yr, k, (load(xr, k) - m) * inv * load(w, k) + load(b, k));
    }
}

// With x̂ = (x − mean)·rstd and g = gy·w:
// gx = rstd·(g − mean(g) − x̂·mean(g·x̂)) + gmean/C − grstd·rstd²·x̂/C.
template <typename T>
__device__ void layer_norm_backward_rows(const T* __restrict__ x, const T* __restrict__ w,
                                         const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                                         const T* __restrict__ gy, const acc_t<T>* __restrict__ gmean,
                                         const acc_t<T>* __restrict__ grstd, int has_gstats, const T* addend,
                                         T* gx, i64 rows, i64 cols) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    const A n = row_count<A>(cols);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        const T* gr = gy + r * cols;
        T* or_ = gx + r * cols;
        const A m = mean[r], rs = rstd[r];
        A sg = A(0), sgx = A(0);
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) {
            const A g = load(gr, k) * load(w, k);
            sg += g;
            sgx += g * (load(xr, k) - m) * rs;
        }
        const A mg = block_sum(sg, scratch) / n;
        const A mgx = block_sum(sgx, scratch) / n;
        const A gm = has_gstats ? gmean[r] : A(0);
        const A grs = has_gstats ? grstd[r] : A(0);
        const A shift = gm / n, stat_coef = grs * rs * rs / n;
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) {
            const A xh = (load(xr, k) - m) * rs;
            const A v = rs * (load(gr, k) * load(w, k) - mg - xh * mgx) + shift - stat_coef * xh;
            store(or_, k, addend ? v + load(addend, r * cols + k) : v);
        }
    }
}

// gw[c] = Σ_rows gy·x̂, gb[c] = Σ_rows gy.
template <typename T>
__device__ void layer_norm_backward_gwb_cols(const T* __restrict__ x, const acc_t<T>* __restrict__ mean,
                                             const acc_t<T>* __restrict__ rstd, const T* __restrict__ gy,
                                             T* __restrict__ gw, T* __restrict__ gb, i64 rows, i64 cols) {
    typedef acc_t<T> A;
    __shared__ A pw[NORM_ROW_LANES][NORM_COL_TILE + 1];
    __shared__ A pb[NORM_ROW_LANES][NORM_COL_TILE + 1];
    const i64 c = (i64)blockIdx.x * NORM_COL_TILE + threadIdx.x;
    A sw = A(0), sb = A(0);
    if (c < cols)
        for (i64 r = threadIdx.y; r < rows; r += NORM_ROW_LANES) {
            const A g = load(gy, r * cols + c);
            sw += g * ((load(x, r * cols + c) - mean[r]) * rstd[r]);
            sb += g;
        }
    pw[threadIdx.y][threadIdx.x] = sw;
    pb[threadIdx.y][threadIdx.x] = sb;
    column_tree(pw);
    column_tree(pb);
    if (threadIdx.y == 0 && c < cols) {
        store(gw, c, pw[0][threadIdx.x]);
        store(gb, c, pb[0][threadIdx.x]);
    }
}

// ---------------------------------------------------------------- entry points

#define SG_NORM_KERNELS(sfx, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        rms_norm_##sfx(const T* x, const T* w, T* y, acc_t<T>* rstd, i64 rows, i64 cols, double eps) { sg_pdl_entry();            \
        rms_norm_rows<T>(x, w, y, rstd, rows, cols, eps);                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        rms_norm_backward_##sfx(const T* x, const T* w, const acc_t<T>* rstd, const T* gy,                       \
                                const acc_t<T>* grstd, int has_grstd, const T* addend, T* gx, i64 rows,          \
                                i64 cols) { sg_pdl_entry();                                                                       \
        rms_norm_backward_rows<T>(x, w, rstd, gy, grstd, has_grstd, addend, gx, rows, cols);                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        rms_norm_vec_##sfx(const T* x, const T* w, T* y, acc_t<T>* rstd, i64 rows, i64 cols, double eps) { sg_pdl_entry();        \
        rms_norm_rows_vec<T>(x, w, y, rstd, rows, cols, eps);                                                     \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        rms_norm_backward_vec_##sfx(const T* x, const T* w, const acc_t<T>* rstd, const T* gy,                   \
                                    const acc_t<T>* grstd, int has_grstd, const T* addend, T* gx, i64 rows,      \
                                    i64 cols) { sg_pdl_entry();                                                                   \
        rms_norm_backward_rows_vec<T>(x, w, rstd, gy, grstd, has_grstd, addend, gx, rows, cols);                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NORM_COL_TILE * NORM_ROW_LANES)                                  \
        rms_norm_backward_gw_##sfx(const T* x, const acc_t<T>* rstd, const T* gy, T* gw, i64 rows, i64 cols) { sg_pdl_entry();   \
        rms_norm_backward_gw_cols<T>(x, rstd, gy, gw, rows, cols);                                                \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        layer_norm_##sfx(const T* x, const T* w, const T* b, T* y, acc_t<T>* mean, acc_t<T>* rstd, i64 rows,     \
                         i64 cols, double eps) { sg_pdl_entry();                                                                  \
        layer_norm_rows<T>(x, w, b, y, mean, rstd, rows, cols, eps);                                              \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024)                                                            \
        layer_norm_backward_##sfx(const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,            \
                                  const T* gy, const acc_t<T>* gmean, const acc_t<T>* grstd, int has_gstats,      \
                                  const T* addend, T* gx, i64 rows, i64 cols) { sg_pdl_entry();                                   \
        layer_norm_backward_rows<T>(x, w, mean, rstd, gy, gmean, grstd, has_gstats, addend, gx, rows, cols);      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NORM_COL_TILE * NORM_ROW_LANES)                                  \
        layer_norm_backward_gwb_##sfx(const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, const T* gy,       \
                                      T* gw, T* gb, i64 rows, i64 cols) { sg_pdl_entry();                                         \
        layer_norm_backward_gwb_cols<T>(x, mean, rstd, gy, gw, gb, rows, cols);                                   \
    }

SG_FOR_EACH_FLOAT(SG_NORM_KERNELS)
