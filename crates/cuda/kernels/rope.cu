// Rotary position embedding on x: [B, T, H, D], the GPT-NeoX / Hugging Face
// `rotate_half` convention of crates/core/src/ops/rope.rs: with h = n_rot/2,
// dimension i < h of every head pairs with i + h and rotates by
// θ = t·f_i with f_i = base^(−2i/n_rot) (−θ when `inverse`); dimensions
// ≥ n_rot pass through; n_rot == 1 scales dimension 0 by cos θ − sin θ with
// f_0 = 1 (ignoring `inverse`); n_rot == 0 is a copy.
//
// Frequency scaling travels in one `RopeScale` argument (by value, the last
// of every kernel): kind 1, Llama-3.x, replaces f_i by `llama3_inv_freq`, the
// CPU's `Llama3Scaling::adjust` (transformers' `_compute_llama3_parameters`)
// operation for operation; kind 2, LongRoPE, makes f_i
// 1 / (factor_i · base^(2i/n_rot)) with the long factors when the launch's
// largest position reaches the original context and the short ones
// otherwise, and multiplies cos θ and sin θ by the attention factor.
//
// θ, cos θ and sin θ are computed in double and converted to acc_t once,
// exactly as the CPU does, so every dtype sees the CPU's angles.
//
// `rope_<dtype>(x, y, bt_rows, seq, heads, dim, n_rot, base, inverse, scale)`: one
// block per position t (grid-striding over the seq positions), which
// rotates the rows (b, t) of heads·dim elements of every b; a 2-D block,
// blockDim.x (a multiple of 32) over the pairs of a head, blockDim.y over
// batch rows and heads, at most 1024 threads in all. The block computes the angles of its
// position into shared memory, ROPE_CHUNK pairs at a time, and every head
// of every batch row reads them, so the double-precision trigonometry runs
// once per (position, pair) rather than once per head and batch row.
//
// `rope_at_<dtype>(x, y, start, bt_rows, seq, heads, ...)` (the same
// arguments after `start`): row b's token t sits at position start[b] + t
// (generation, where rows sit at different positions, so no two rows share
// angles): one block per row (b, t), grid-striding over the bt_rows rows,
// the same block shape, angles computed the same way; under LongRoPE each
// block first finds the largest position of the launch.
//
// `rope2_<dtype>(x1, y1, x2, y2, bt_rows, seq, heads1, heads2, dim, ...)`:
// two rotations of the same rows and angles (a layer's q and k) in one
// launch, block row blockIdx.y = 0 rotating x1 (heads1 heads) into y1 and
// row 1 x2 (heads2) into y2, each as `rope_<dtype>` would; and
// `rope2_at_<dtype>(x1, y1, x2, y2, start, ...)`, the same for `rope_at`.
// With per-token positions (packed documents) the lowering passes seq = 1,
// so row (b, t) sits at start[b·T + t].
//
// In place (y == x) is correct: one thread reads both elements of a pair
// before it writes either, and no other thread touches that pair.

#define ROPE_CHUNK 256  // pairs whose angles the block holds at once
#define ROPE_UNROLL 4   // pairs a thread loads before it stores any
#define ROPE_LONG_PAIRS 128  // the most rotated pairs LongRoPE factors travel for

// How the inverse frequencies are scaled (`RopeScaleArg` of the lowering
// writes these bytes): kind 0 plain, 1 Llama-3.x (its four numbers), 2
// LongRoPE (per-pair factors, the original context, the attention factor).
struct RopeScale {
    long long kind;
    double factor, low_freq_factor, high_freq_factor, old_context;
    double attention;
    long long original;
    double short_factor[ROPE_LONG_PAIRS];
    double long_factor[ROPE_LONG_PAIRS];
};

// Llama-3.x frequency scaling of the inverse frequency `f`.
__device__ double llama3_inv_freq(double f, double factor, double low_freq_factor, double high_freq_factor,
                                  double old_context) {
    const double low_freq_wavelen = old_context / low_freq_factor;
    const double high_freq_wavelen = old_context / high_freq_factor;
    const double wavelen = 2.0 * 3.14159265358979323846 / f;
    const double f_llama = wavelen > low_freq_wavelen ? f / factor : f;
    if (wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen) {
        const double smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        return (1.0 - smooth) * f_llama / factor + smooth * f_llama;
    }
    return f_llama;
}

// Rotates `count` rows of heads·dim elements, the rows r0 + i·step, all at
// position `pos`, with the block's angle table. Callers run it with the
// whole block, which it synchronises.
template <typename T>
__device__ void rope_rows_at(const T* x, T* y, i64 r0, i64 step, i64 count, i64 pos, int heads, int dim, int n_rot,
                             double base, int inverse, const RopeScale& scale, bool long_factors) {
    typedef acc_t<T> A;
    __shared__ A cs_tab[ROPE_CHUNK];
    __shared__ A sn_tab[ROPE_CHUNK];
    const int row = heads * dim;
    const int half = n_rot / 2;  // 0 for n_rot in {0, 1}
    const double sign = inverse ? -1.0 : 1.0;
    // The block is 2-D for the rotation (x: pairs of a head, y: heads and
    // rows); the other loops see it flat.
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
    if (n_rot == 1) {
        // The head-size-1 quirk: a diagonal scaling by cos t − sin t.
        const double freq = scale.kind == 1 ? llama3_inv_freq(1.0, scale.factor, scale.low_freq_factor,
                                                              scale.high_freq_factor, scale.old_context)
                                            : 1.0;
        const double theta = (double)pos * freq;
        const A f = (A)(cos(theta) - sin(theta));
        for (i64 i = 0; i < count; ++i) {
            const T* xr = x + (r0 + i * step) * (i64)row;
            T* yr = y + (r0 + i * step) * (i64)row;
            for (int k = tid; k < row; k += nthreads) {
                if (k % dim == 0)
                    store(yr, k, load(xr, k) * f);
                else if (x != y)
                    yr[k] = xr[k];
            }
        }
        return;
    }
    for (int c0 = 0; c0 < half; c0 += ROPE_CHUNK) {
        const int cn = min(half - c0, ROPE_CHUNK);
        // The previous chunk (or position) is done with the table before it is refilled.
        __syncthreads();
        const double amplitude = scale.kind == 2 ? scale.attention : 1.0;
        const double* factors = long_factors ? scale.long_factor : scale.short_factor;
        for (int i = tid; i < cn; i += nthreads) {
            const double exponent = 2.0 * (double)(c0 + i) / (double)n_rot;
            double freq;
            if (scale.kind == 2) {
                freq = 1.0 / (factors[c0 + i] * pow(base, exponent));
            } else {
                freq = pow(base, -exponent);
                if (scale.kind == 1)
                    freq = llama3_inv_freq(freq, scale.factor, scale.low_freq_factor, scale.high_freq_factor,
                                           scale.old_context);
            }
            const double theta = (double)pos * freq;
            cs_tab[i] = (A)(amplitude * cos(theta));
            sn_tab[i] = (A)(sign * amplitude * sin(theta));
        }
        __syncthreads();
        // Every pair of every head of every row: lane x takes pair j of the
        // chunk, lanes y the heads of each row, ROPE_UNROLL heads at a time
        // with all their loads issued before any store. A pair is read and
        // written by one thread only, so in place stays correct; no division
        // per pair.
        for (int j = threadIdx.x; j < cn; j += blockDim.x) {
            const A cs = cs_tab[j], sn = sn_tab[j];
            for (i64 i = 0; i < count; ++i) {
                const i64 base_at = (r0 + i * step) * (i64)row + c0 + j;
                for (int h0 = threadIdx.y; h0 < heads; h0 += ROPE_UNROLL * blockDim.y) {
                    A a[ROPE_UNROLL], b2[ROPE_UNROLL];
#pragma unroll
                    for (int u = 0; u < ROPE_UNROLL; ++u) {
                        const int h = h0 + u * blockDim.y;
                        if (h < heads) {
                            a[u] = load(x, base_at + h * dim);
                            b2[u] = load(x, base_at + h * dim + half);
                        }
                    }
#pragma unroll
                    for (int u = 0; u < ROPE_UNROLL; ++u) {
                        const int h = h0 + u * blockDim.y;
                        if (h >= heads) continue;
                        store(y, base_at + h * dim, a[u] * cs - b2[u] * sn);
                        store(y, base_at + h * dim + half, b2[u] * cs + a[u] * sn);
                    }
                }
            }
        }
    }
    // Dimensions [n_rot, dim) pass through bit for bit; in place they already hold x.
    const int pass = dim - n_rot;
    if (x != y && pass > 0)
        for (i64 i = 0; i < count; ++i) {
            const T* xr = x + (r0 + i * step) * (i64)row;
            T* yr = y + (r0 + i * step) * (i64)row;
            for (int k = tid; k < heads * pass; k += nthreads) {
                const int h = k / pass, d = n_rot + (k - h * pass);
                yr[h * dim + d] = xr[h * dim + d];
            }
        }
}

// Does a LongRoPE launch take the long factors? Its largest position is
// start[e] + last over the `entries` starts; the whole block computes it.
__device__ bool long_positions(const int* start, i64 entries, i64 last, const RopeScale& scale) {
    __shared__ long long top;
    if (scale.kind != 2) return false;  // uniform over the block
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
    if (tid == 0) top = -9223372036854775807LL - 1;
    __syncthreads();
    long long mine = -9223372036854775807LL - 1;
    for (i64 e = tid; e < entries; e += nthreads) mine = max(mine, (long long)start[e] + last);
    atomicMax(&top, mine);
    __syncthreads();
    return top + 1 > scale.original;
}

// Positions 0..seq on axis 1: one block per position t, rotating row (b, t)
// of every batch row b with the angles of t.
template <typename T>
__device__ void rope_rows(const T* x, T* y, i64 bt_rows, i64 seq, int heads, int dim, int n_rot, double base,
                          int inverse, const RopeScale& scale) {
    const i64 batch = seq > 0 ? bt_rows / seq : 0;
    const bool long_factors = scale.kind == 2 && seq > scale.original;
    for (i64 t = blockIdx.x; t < seq; t += gridDim.x)
        rope_rows_at<T>(x, y, t, seq, batch, t, heads, dim, n_rot, base, inverse, scale, long_factors);
}

// Per-row positions start[b] + t (generation): one block per row (b, t),
// each with its own angles, as the CPU's `rope_kernel` with `Some(start)`.
// (Per-token positions come with seq = 1: one start per row.)
template <typename T>
__device__ void rope_rows_positioned(const T* x, T* y, const int* start, i64 bt_rows, i64 seq, int heads, int dim,
                                     int n_rot, double base, int inverse, const RopeScale& scale) {
    const bool long_factors = long_positions(start, bt_rows / seq, seq - 1, scale);
    for (i64 bt = blockIdx.x; bt < bt_rows; bt += gridDim.x) {
        const i64 b = bt / seq, t = bt - b * seq;
        rope_rows_at<T>(x, y, bt, 1, 1, (i64)start[b] + t, heads, dim, n_rot, base, inverse, scale, long_factors);
    }
}

#define SG_ROPE_KERNEL(sfx, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024)                                                         \
        rope_##sfx(const T* x, T* y, i64 bt_rows, i64 seq, int heads, int dim, int n_rot, double base,         \
                   int inverse, const __grid_constant__ RopeScale scale) { sg_pdl_entry(); \
        rope_rows<T>(x, y, bt_rows, seq, heads, dim, n_rot, base, inverse, scale);                             \
    }

SG_FOR_EACH_FLOAT(SG_ROPE_KERNEL)

#define SG_ROPE2_KERNEL(sfx, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        rope2_##sfx(const T* x1, T* y1, const T* x2, T* y2, i64 bt_rows, i64 seq, int heads1, int heads2,       \
                    int dim, int n_rot, double base, int inverse, const __grid_constant__ RopeScale scale) { sg_pdl_entry(); \
        const bool second = blockIdx.y == 1;                                                                    \
        rope_rows<T>(second ? x2 : x1, second ? y2 : y1, bt_rows, seq, second ? heads2 : heads1, dim, n_rot,    \
                     base, inverse, scale);                                                                     \
    }

SG_FOR_EACH_FLOAT(SG_ROPE2_KERNEL)

#define SG_ROPE_AT_KERNEL(sfx, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(1024)                                                         \
        rope_at_##sfx(const T* x, T* y, const int* start, i64 bt_rows, i64 seq, int heads, int dim, int n_rot, \
                      double base, int inverse, const __grid_constant__ RopeScale scale) { sg_pdl_entry(); \
        rope_rows_positioned<T>(x, y, start, bt_rows, seq, heads, dim, n_rot, base, inverse, scale);           \
    }

SG_FOR_EACH_FLOAT(SG_ROPE_AT_KERNEL)

#define SG_ROPE2_AT_KERNEL(sfx, T)                                                                               \
    extern "C" __global__ void __launch_bounds__(1024)                                                           \
        rope2_at_##sfx(const T* x1, T* y1, const T* x2, T* y2, const int* start, i64 bt_rows, i64 seq, int heads1, \
                       int heads2, int dim, int n_rot, double base, int inverse,                                 \
                       const __grid_constant__ RopeScale scale) { sg_pdl_entry(); \
        const bool second = blockIdx.y == 1;                                                                     \
        rope_rows_positioned<T>(second ? x2 : x1, second ? y2 : y1, start, bt_rows, seq, second ? heads2 : heads1, \
                                dim, n_rot, base, inverse, scale);                                               \
    }

SG_FOR_EACH_FLOAT(SG_ROPE2_AT_KERNEL)
