// Fused causal grouped-query attention, forward and backward, flash style.
//
// q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; o: [B, T, Hq, D]; lse: [B, Hq, T]
// in the accumulator type. Query head h reads kv head h / (Hq / Hkv).
// Nothing T×T is stored: the forward keeps a running max and sum per query
// row and saves lse; the backward recomputes the probabilities from lse.
// The design and the determinism argument are in crates/cuda/src/ops/attention.rs;
// the launch geometry there must match the tile constants below.
//
// Which keys a query row sees (`SgKeys` of common.cuh, the three arguments
// after the scale: positions, window, soft-cap): row i of batch row b sees
// keys first(i)..=i, first(i) = max(0, i + 1 − window, i − pos[b, i]) (the
// window when > 0, the document start when positions are given), the rule
// of crates/core/src/ops/attention.rs. first() never decreases along a row,
// so a block of consecutive query rows needs no key tile before the one
// holding first() of its first row, and a block of key rows no query tile
// after the one holding last_query() of its last key: those tiles are
// skipped, the others masked entry by entry. With softcap > 0 a score is
// capped, softcap·tanh(scale·q·k / softcap), before the softmax, and the
// backward multiplies ds by the cap's slope. Plain causal attention
// (no positions, window or soft-cap) runs the arithmetic it always ran.
//
// Kernels (dtype suffix f32, bf16, f16, f64; V is the head-size bucket):
//   attention_fwd_dV_<dt>     grid (ceil(T/rows), Hq, B)   o, lse
//   attention_bwd_q_dV_<dt>   grid (ceil(T/rows), Hq, B)   gq
//   attention_bwd_kv_dV_<dt>  grid (ceil(T/keys), Hkv, B)  gk, gv
// V in {1, 4, 16}: one thread per query row (per key and query slice for
// bwd_kv), D <= V. V in {32, 64, 128, 256}: register-tiled, D <= V.

#define SGA_LOG2E 1.4426950408889634074
#define SGA_LN2 0.69314718055994530942

namespace sga {

__device__ __forceinline__ float inf_of(float) { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double inf_of(double) { return __longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ float ex2(float x) { return exp2f(x); }
__device__ __forceinline__ double ex2(double x) { return exp2(x); }
__device__ __forceinline__ float lg2(float x) { return log2f(x); }
__device__ __forceinline__ double lg2(double x) { return log2(x); }
__device__ __forceinline__ float amax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double amax(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// The launch geometry is computed on the host (src/ops/attention.rs) from the
// same tile sizes; a launch that disagrees would skip rows, so it traps.
__device__ __forceinline__ void check_launch(int rows_per_block, int threads, int Tn) {
    if ((int)gridDim.x != (Tn + rows_per_block - 1) / rows_per_block || (int)blockDim.x != threads) __trap();
}

// N consecutive values from shared memory at p into r[0..N). p is aligned to
// min(16, N * sizeof) bytes, so whole 16-byte (or 8-byte) vectors are used.
template <int N> __device__ __forceinline__ void lds(float* r, const float* p) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const float4 x = reinterpret_cast<const float4*>(p)[i];
            r[4 * i] = x.x;
            r[4 * i + 1] = x.y;
            r[4 * i + 2] = x.z;
            r[4 * i + 3] = x.w;
        }
    } else if constexpr (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const float2 x = reinterpret_cast<const float2*>(p)[i];
            r[2 * i] = x.x;
            r[2 * i + 1] = x.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = p[i];
    }
}
template <int N> __device__ __forceinline__ void lds(double* r, const double* p) {
    if constexpr (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const double2 x = reinterpret_cast<const double2*>(p)[i];
            r[2 * i] = x.x;
            r[2 * i + 1] = x.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = p[i];
    }
}
// Four values to shared memory at p (16-byte aligned).
__device__ __forceinline__ void sts4(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ void sts4(double* p, double a, double b, double c, double d) {
    reinterpret_cast<double2*>(p)[0] = make_double2(a, b);
    reinterpret_cast<double2*>(p)[1] = make_double2(c, d);
}

// Same value in all NX lanes of a group of NX consecutive lanes (NX <= 32,
// a power of two); butterfly order, so every lane gets identical bits.
template <int NX, typename A> __device__ __forceinline__ A group_max(A v) {
#pragma unroll
    for (int o = NX / 2; o > 0; o >>= 1) v = amax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <int NX, typename A> __device__ __forceinline__ A group_sum(A v) {
#pragma unroll
    for (int o = NX / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------
// Register-tiled kernels.
//
// A block of NT = 256 threads owns R "rows" (query rows in fwd/bwd_q, key rows
// in bwd_kv) and steps over tiles of C "columns" (keys, resp. query rows).
// Thread t = ry * NX + cx owns rows 4ry..4ry+3; in a score tile it owns
// columns CPT*cx..CPT*cx+CPT-1, and of a [R, DMAX] accumulator the dims
// VW*cx + VW*NX*m + e (m < DPT/VW, e < VW).
//
// Phase 1 (scores): S[R, C] = X[R, D] · Y[C, D]^T, the reduction over D in
// slices of DC dims staged transposed in shared memory (XT[d][row]).
// Phase 2 (products): Acc[R, DMAX] += W[C, R]^T · Z[C, DMAX], where W is the
// score tile turned into probabilities (or their gradients) and written to
// shared memory column-major, and Z is staged KC full rows at a time.
// Global loads for the next slice are issued into registers before the
// current one is used (single-buffered prefetch).
// ---------------------------------------------------------------------------

// Tile<A, R, C, NX, DC, KC, DMAX>: R rows per block, C columns per step, NX
// threads per row group, DC dims per staged slice, KC rows per staged chunk,
// DMAX the head-size bucket. Static shared memory stays under 48 KB.
template <typename A, int R_, int C_, int NX_, int DC_, int KC_, int DMAX_> struct Tile {
    static constexpr int NT = 256, R = R_, C = C_, NX = NX_, DC = DC_, KC = KC_, DMAX = DMAX_;
    static constexpr int RY = NT / NX, CPT = C / NX, DPT = DMAX / NX;
    static constexpr int VEC = 16 / (int)sizeof(A);
    static constexpr int VW = DPT < VEC ? DPT : VEC;
    // Padded strides (multiples of 16 bytes): XT/W rows, YT rows, Z rows.
    static constexpr int RS = R + VEC, CS = C + VEC, XS = DMAX + VEC;
    static_assert(RY * NX == NT && RY * 4 == R, "four rows per thread");
    static_assert(CPT * NX == C && DPT * NX == DMAX && DPT % VW == 0, "columns and dims split evenly");
    static_assert(R * DC % NT == 0 && C * DC % NT == 0 && KC * DMAX % NT == 0 && C % KC == 0, "staging splits evenly");
};

// Tile shapes per accumulator type and head-size bucket. The row counts R
// (and NT) are mirrored by the launch geometry in src/ops/attention.rs.
template <typename A, int DMAX> struct Cfg;
// minb: blocks per SM asked of ptxas (__launch_bounds__), which caps registers at 128 for 2.
template <int DMAX> struct Cfg<float, DMAX> {
    static constexpr int minb = DMAX <= 128 ? 2 : 1;
    typedef Tile<float, 64, 64, 16, 32, 16, DMAX> fwd;
    typedef Tile<float, 64, 64, 16, 16, 16, DMAX> bq;
    typedef Tile<float, (DMAX <= 64 ? 64 : 32), 64, (DMAX <= 64 ? 16 : 32), 16, 16, DMAX> bkv;
};
template <int DMAX> struct Cfg<double, DMAX> {
    static constexpr int minb = 1;
    typedef Tile<double, 32, 32, 32, 16, 8, DMAX> fwd;
    typedef Tile<double, 32, 32, 32, 16, 8, DMAX> bq;
    typedef Tile<double, (DMAX <= 128 ? 32 : 16), 64, (DMAX <= 128 ? 32 : 64), 16, 8, DMAX> bkv;
};

// A DC-dim slice (dims d0..d0+DC) of N rows (t0..t0+N) of one head, zero
// outside T × D, held in registers and stored transposed: dst[dd * ld + row].
// Thread t holds dim t % DC of rows t / DC + STEP * u.
template <typename T, typename A, int N, int DC, int NT> struct Slice {
    static_assert(NT % DC == 0 && N % (NT / DC) == 0, "slice splits evenly");
    static constexpr int STEP = NT / DC, PER = N / STEP;
    A r[PER];
    __device__ __forceinline__ void fetch(const T* src, i64 stride, int t0, int Tn, int d0, int D) {
        const int d = d0 + (int)threadIdx.x % DC, t = t0 + (int)threadIdx.x / DC;
        const T* p = src + (i64)t * stride + d;
        const i64 step = (i64)STEP * stride;
#pragma unroll
        for (int u = 0; u < PER; ++u) r[u] = (t + STEP * u < Tn && d < D) ? (A)load(p, u * step) : A(0);
    }
    __device__ __forceinline__ void put(A* dst, int ld) const {
        A* p = dst + ((int)threadIdx.x % DC) * ld + (int)threadIdx.x / DC;
#pragma unroll
        for (int u = 0; u < PER; ++u) p[STEP * u] = r[u];
    }
};

// N full rows (t0..t0+N, dims 0..DMAX) of one head, zero outside T × D,
// stored row-major: dst[row * ld + d]. Thread t holds dim t % DMAX of rows
// t / DMAX + STEP * u.
template <typename T, typename A, int N, int DMAX, int NT> struct Rows {
    static_assert(NT % DMAX == 0 && N % (NT / DMAX) == 0, "rows split evenly");
    static constexpr int STEP = NT / DMAX, PER = N / STEP;
    A r[PER];
    __device__ __forceinline__ void fetch(const T* src, i64 stride, int t0, int Tn, int D) {
        const int d = (int)threadIdx.x % DMAX, t = t0 + (int)threadIdx.x / DMAX;
        const T* p = src + (i64)t * stride + d;
        const i64 step = (i64)STEP * stride;
#pragma unroll
        for (int u = 0; u < PER; ++u) r[u] = (t + STEP * u < Tn && d < D) ? (A)load(p, u * step) : A(0);
    }
    __device__ __forceinline__ void put(A* dst, int ld) const {
        A* p = dst + ((int)threadIdx.x / DMAX) * ld + (int)threadIdx.x % DMAX;
#pragma unroll
        for (int u = 0; u < PER; ++u) p[STEP * u * ld] = r[u];
    }
};

// acc[r][c] += sum_dd XT[dd][4ry + r] * YT[dd][CPT*cx + c] over one staged slice.
template <class Cf, typename A>
__device__ __forceinline__ void dot_slice(A (&acc)[4][Cf::CPT], const A* XT, const A* YT, int ry, int cx) {
#pragma unroll
    for (int dd = 0; dd < Cf::DC; ++dd) {
        A x[4], y[Cf::CPT];
        lds<4>(x, XT + dd * Cf::RS + 4 * ry);
        lds<Cf::CPT>(y, YT + dd * Cf::CS + Cf::CPT * cx);
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < Cf::CPT; ++c) acc[r][c] += x[r] * y[c];
    }
}

// acc[r][j] += sum_kk W[kk][4ry + r] * Z[kk][dim j] over KC staged rows.
template <class Cf, typename A>
__device__ __forceinline__ void mul_rows(A (&acc)[4][Cf::DPT], const A* W, const A* Z, int ry, int cx) {
    constexpr int VW = Cf::VW;
#pragma unroll
    for (int kk = 0; kk < Cf::KC; ++kk) {
        A w[4];
        lds<4>(w, W + kk * Cf::RS + 4 * ry);
#pragma unroll
        for (int m = 0; m < Cf::DPT / VW; ++m) {
            A z[VW];
            lds<VW>(z, Z + kk * Cf::XS + VW * cx + VW * Cf::NX * m);
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int e = 0; e < VW; ++e) acc[r][m * VW + e] += w[r] * z[e];
        }
    }
}

// Writes the thread's [4][CPT] tile to W[column][row] (stride RS).
template <class Cf, typename A>
__device__ __forceinline__ void put_tile(A* W, const A (&s)[4][Cf::CPT], int ry, int cx) {
#pragma unroll
    for (int c = 0; c < Cf::CPT; ++c)
        sts4(W + (Cf::CPT * cx + c) * Cf::RS + 4 * ry, s[0][c], s[1][c], s[2][c], s[3][c]);
}

// Stores the thread's [4][DPT] accumulator rows (times f) for rows < T, dims < D.
template <class Cf, typename T, typename A>
__device__ __forceinline__ void store_acc(T* base, i64 stride, int row0, int Tn, int D, const A (&acc)[4][Cf::DPT],
                                          const A (&f)[4], int ry, int cx) {
    constexpr int VW = Cf::VW;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int t = row0 + 4 * ry + r;
        if (t >= Tn) continue;
#pragma unroll
        for (int m = 0; m < Cf::DPT / VW; ++m)
#pragma unroll
            for (int e = 0; e < VW; ++e) {
                const int d = VW * cx + VW * Cf::NX * m + e;
                if (d < D) store(base, (i64)t * stride + d, acc[r][m * VW + e] * f[r]);
            }
    }
}

// acc += W·rows over the n·KC rows t0.. of src (one head, zero past T or
// D): KC rows at a time are staged in Z ([KC][XS]) while the next KC are
// fetched, and multiplied by the matching KC columns of W ([C][RS]). The
// shared memory is reused on return (every thread has passed the last barrier).
template <class Cf, typename T, typename A>
__device__ __forceinline__ void mul_staged_rows(A (&acc)[4][Cf::DPT], const A* W, A* Z, const T* src, i64 stride,
                                                int t0, int n, int Tn, int D, int ry, int cx) {
    Rows<T, A, Cf::KC, Cf::DMAX, Cf::NT> z;
    z.fetch(src, stride, t0, Tn, D);
    for (int kc = 0; kc < n; ++kc) {
        z.put(Z, Cf::XS);
        __syncthreads();
        if (kc + 1 < n) z.fetch(src, stride, t0 + (kc + 1) * Cf::KC, Tn, D);
        mul_rows<Cf>(acc, W + kc * Cf::KC * Cf::RS, Z, ry, cx);
        __syncthreads();
    }
}

// The two score tiles of a backward pass, from zero: s = X1·Y1ᵀ and
// dp = X2·Y2ᵀ for the R rows x0.. of x1, x2 (row stride xs) against the C
// rows y0.. of y1, y2 (row stride ys), over D in DC-dim slices. Each slice
// is staged transposed in sm as [X1 | X2 | Y1 | Y2] ([DC][RS] twice, then
// [DC][CS] twice) while the next one is fetched.
template <class Cf, typename T, typename A>
__device__ __forceinline__ void pair_scores(A (&s)[4][Cf::CPT], A (&dp)[4][Cf::CPT], A* sm, const T* x1, const T* x2,
                                            i64 xs, int x0, const T* y1, const T* y2, i64 ys, int y0, int Tn, int D,
                                            int ry, int cx) {
    constexpr int NT = Cf::NT, R = Cf::R, C = Cf::C, DC = Cf::DC, RS = Cf::RS, CS = Cf::CS;
    A* const X1 = sm;
    A* const X2 = sm + DC * RS;
    A* const Y1 = sm + 2 * DC * RS;
    A* const Y2 = Y1 + DC * CS;
    const int nch = (D + DC - 1) / DC;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < Cf::CPT; ++c) s[r][c] = dp[r][c] = A(0);
    Slice<T, A, R, DC, NT> a1, a2;
    Slice<T, A, C, DC, NT> b1, b2;
    a1.fetch(x1, xs, x0, Tn, 0, D);
    a2.fetch(x2, xs, x0, Tn, 0, D);
    b1.fetch(y1, ys, y0, Tn, 0, D);
    b2.fetch(y2, ys, y0, Tn, 0, D);
    for (int ch = 0; ch < nch; ++ch) {
        a1.put(X1, RS);
        a2.put(X2, RS);
        b1.put(Y1, CS);
        b2.put(Y2, CS);
        __syncthreads();
        if (ch + 1 < nch) {
            const int d0 = (ch + 1) * DC;
            a1.fetch(x1, xs, x0, Tn, d0, D);
            a2.fetch(x2, xs, x0, Tn, d0, D);
            b1.fetch(y1, ys, y0, Tn, d0, D);
            b2.fetch(y2, ys, y0, Tn, d0, D);
        }
        dot_slice<Cf>(s, X1, Y1, ry, cx);
        dot_slice<Cf>(dp, X2, Y2, ry, cx);
        __syncthreads();
    }
}

// Ls[i] = lse·log2(e) and Ds[i] = go·o − glse for the n rows t0.. of one
// query head (zero past T; Ds also into delta unless it is null); one warp
// per row, lanes over dims, fixed order.
template <typename T, typename A>
__device__ void row_stats(A* Ls, A* Ds, int n, int t0, const T* o, const T* go, const A* lse, const A* glse, A* delta,
                          i64 stride, i64 stat, int Tn, int D) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int i = warp; i < n; i += nw) {
        const int t = t0 + i;
        A sum = A(0);
        if (t < Tn)
            for (int d = lane; d < D; d += 32)
                sum += (A)load(go, (i64)t * stride + d) * (A)load(o, (i64)t * stride + d);
        sum = warp_sum(sum);
        if (lane == 0) {
            Ls[i] = t < Tn ? lse[stat + t] * A(SGA_LOG2E) : A(0);
            Ds[i] = t < Tn ? sum - (glse ? glse[stat + t] : A(0)) : A(0);
            if (delta && t < Tn) delta[stat + t] = Ds[i];
        }
    }
}

// The elementwise steps that turn score tiles into probabilities or their
// gradients, one copy per CAP (softcap > 0), chosen by a uniform branch in
// each kernel. The plain copy is the expressions as they were before
// soft-caps existed, so plain attention keeps its bits: its products
// contract into the same FMAs, where one shared copy would put a select
// between a product and its sum. Only the capped copy pays for tanh.
// Masked entries are those outside first(row)..=row.

// Forward: s <- the score in base 2 (scale·q·k·log2 e, or the capped score
// times log2 e), −inf where key k0 + CPT·cx + c is masked for row r0 + 4ry + r.
template <bool CAP, class Cf, typename A>
__device__ __forceinline__ void fwd_scores(A (&s)[4][Cf::CPT], int k0, int r0, const int (&lo)[4], int ry, int cx,
                                           A c2, A sc, double softcap) {
    const A ninf = -inf_of(A(0));
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < Cf::CPT; ++c) {
            const int key = k0 + Cf::CPT * cx + c;
            const bool on = key <= r0 + 4 * ry + r && key >= lo[r];
            if constexpr (CAP)
                s[r][c] = on ? A(sg_cap(s[r][c] * sc, softcap)) * A(SGA_LOG2E) : ninf;
            else
                s[r][c] = on ? s[r][c] * c2 : ninf;
        }
}

// Query side: s <- ds = p·(dp − D) (times the cap's slope), zero where
// masked (Lo: the first key of each of the block's rows).
template <bool CAP, class Cf, typename A>
__device__ __forceinline__ void bq_ds(A (&s)[4][Cf::CPT], const A (&dp)[4][Cf::CPT], int k0, int r0,
                                      const int* Lo, const A (&L2)[4], const A (&Di)[4], int ry, int cx, A c2,
                                      A sc, double softcap) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < Cf::CPT; ++c) {
            const int key = k0 + Cf::CPT * cx + c;
            const bool on = key <= r0 + 4 * ry + r && key >= Lo[4 * ry + r];
            if constexpr (CAP) {
                const A cs = A(sg_cap(s[r][c] * sc, softcap));
                const A p = on ? ex2(cs * A(SGA_LOG2E) - L2[r]) : A(0);
                s[r][c] = p * (dp[r][c] - Di[r]) * A(sg_cap_slope(cs, softcap));
            } else {
                const A p = on ? ex2(s[r][c] * c2 - L2[r]) : A(0);
                s[r][c] = p * (dp[r][c] - Di[r]);
            }
        }
}

// Key side (rows are keys j0 + 4ry + r, columns queries q0 + CPT·cx + c):
// s <- p, dp <- ds (times the cap's slope), zero where the query precedes
// the key, is past T or past the key's last query (Lq, one per block row).
template <bool CAP, class Cf, typename A>
__device__ __forceinline__ void bkv_p_ds(A (&s)[4][Cf::CPT], A (&dp)[4][Cf::CPT], int q0, int j0, int Tn,
                                         const int* Lq, const A* Ls, const A* Ds, int ry, int cx, A c2, A sc,
                                         double softcap) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < Cf::CPT; ++c) {
            const int i = Cf::CPT * cx + c, t = q0 + i;
            const bool on = t >= j0 + 4 * ry + r && t < Tn && t <= Lq[4 * ry + r];
            if constexpr (CAP) {
                const A cs = A(sg_cap(s[r][c] * sc, softcap));
                const A p = on ? ex2(cs * A(SGA_LOG2E) - Ls[i]) : A(0);
                s[r][c] = p;
                dp[r][c] = p * (dp[r][c] - Ds[i]) * A(sg_cap_slope(cs, softcap));
            } else {
                const A p = on ? ex2(s[r][c] * c2 - Ls[i]) : A(0);
                s[r][c] = p;
                dp[r][c] = p * (dp[r][c] - Ds[i]);
            }
        }
}

// Forward: the block owns R query rows; online softmax over key tiles of C,
// from the tile holding the first key its first row sees.
template <typename T, class Cf>
__device__ void fwd_tiled(const T* q, const T* k, const T* v, T* o, acc_t<T>* lse, int Tn, int Hq, int Hkv, int D,
                          double scale, SgKeys keys) {
    typedef acc_t<T> A;
    constexpr int NT = Cf::NT, R = Cf::R, C = Cf::C, NX = Cf::NX, DC = Cf::DC, KC = Cf::KC;
    constexpr int CPT = Cf::CPT, DPT = Cf::DPT;
    constexpr int RS = Cf::RS, CS = Cf::CS, XS = Cf::XS;
    constexpr int P1 = DC * (RS + CS), P2 = KC * XS, U = P1 > P2 ? P1 : P2;
    static_assert(NX <= 32 && 32 % NX == 0, "a row group's lanes share a warp (row max and sum by shuffles)");
    __shared__ __align__(16) A sm[U + C * RS];
    A* const XT = sm;            // q slice, [DC][RS]
    A* const YT = sm + DC * RS;  // k slice, [DC][CS]
    A* const Z = sm;             // v rows, [KC][XS]
    A* const W = sm + U;         // probabilities, [C][RS]

    check_launch(R, NT, Tn);
    const int tid = threadIdx.x, ry = tid / NX, cx = tid % NX;
    const int nqt = (Tn + R - 1) / R, qt = nqt - 1 - (int)blockIdx.x;  // longest rows first
    const int h = blockIdx.y, b = blockIdx.z, g = h / (Hq / Hkv);
    const int r0 = qt * R, last = imin(Tn - 1, r0 + R - 1);
    const i64 qs = (i64)Hq * D, ks = (i64)Hkv * D;
    const T* const qb = q + ((i64)b * Tn * Hq + h) * D;
    const T* const kb = k + ((i64)b * Tn * Hkv + g) * D;
    const T* const vb = v + ((i64)b * Tn * Hkv + g) * D;
    const A c2 = A(scale * SGA_LOG2E), sc = A(scale), ninf = -inf_of(A(0));
    const int nch = (D + DC - 1) / DC;

    A acc[4][DPT], m[4], l[4];
    int lo[4];  // the first key each of the thread's rows sees (0 past T: never stored)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        m[r] = ninf;
        l[r] = A(0);
        const int row = r0 + 4 * ry + r;
        lo[r] = row < Tn ? keys.first(b, Tn, row) : 0;
#pragma unroll
        for (int j = 0; j < DPT; ++j) acc[r][j] = A(0);
    }

    // first() never decreases along a row: no row of the block sees a key
    // before its first row's first key, so earlier tiles are skipped.
    for (int k0 = keys.first(b, Tn, r0) / C * C; k0 <= last; k0 += C) {
        A s[4][CPT];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < CPT; ++c) s[r][c] = A(0);
        Slice<T, A, R, DC, NT> sq;
        Slice<T, A, C, DC, NT> sk;
        sq.fetch(qb, qs, r0, Tn, 0, D);
        sk.fetch(kb, ks, k0, Tn, 0, D);
        for (int ch = 0; ch < nch; ++ch) {
            sq.put(XT, RS);
            sk.put(YT, CS);
            __syncthreads();
            if (ch + 1 < nch) {
                sq.fetch(qb, qs, r0, Tn, (ch + 1) * DC, D);
                sk.fetch(kb, ks, k0, Tn, (ch + 1) * DC, D);
            }
            dot_slice<Cf>(s, XT, YT, ry, cx);
            __syncthreads();
        }
        // Scores in base 2, −inf outside first(row)..=row. A row may see no
        // key of a tile (its first key lies beyond): its max stays −inf
        // and the tile adds exp2(−inf) = 0 below.
        if (keys.softcap > 0)
            fwd_scores<true, Cf>(s, k0, r0, lo, ry, cx, c2, sc, keys.softcap);
        else
            fwd_scores<false, Cf>(s, k0, r0, lo, ry, cx, c2, sc, keys.softcap);
        // Online softmax in base 2; every lane of a row group holds the same m, l.
        A alpha[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            A mt = ninf;
#pragma unroll
            for (int c = 0; c < CPT; ++c) mt = amax(mt, s[r][c]);
            mt = group_max<NX>(mt);
            const A mn = amax(m[r], mt), mref = (mn == ninf) ? A(0) : mn;
            alpha[r] = ex2(m[r] - mref);
            m[r] = mn;
            A rs = A(0);
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                s[r][c] = ex2(s[r][c] - mref);
                rs += s[r][c];
            }
            l[r] = l[r] * alpha[r] + group_sum<NX>(rs);
#pragma unroll
            for (int j = 0; j < DPT; ++j) acc[r][j] *= alpha[r];
        }
        put_tile<Cf>(W, s, ry, cx);
        const int nkc = (imin(C, last + 1 - k0) + KC - 1) / KC;  // key chunks that can be unmasked
        mul_staged_rows<Cf>(acc, W, Z, vb, ks, k0, nkc, Tn, D, ry, cx);
    }

    A inv[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) inv[r] = A(1) / l[r];
    store_acc<Cf>(o + ((i64)b * Tn * Hq + h) * D, qs, r0, Tn, D, acc, inv, ry, cx);
    if (cx == 0) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int t = r0 + 4 * ry + r;
            if (t < Tn) lse[((i64)b * Hq + h) * Tn + t] = (m[r] + lg2(l[r])) * A(SGA_LN2);
        }
    }
}

// Backward, query side: the block owns R query rows of one head and steps
// over key tiles in order, from the one holding its first row's first key:
// gq_i = scale · sum_j p_ij (go_i·v_j − D_i) k_j (times the cap's slope).
template <typename T, class Cf>
__device__ void bq_tiled(const T* q, const T* k, const T* v, const T* o, const acc_t<T>* lse, const T* go,
                         const acc_t<T>* glse, T* gq, acc_t<T>* delta, int Tn, int Hq, int Hkv, int D, double scale,
                         SgKeys keys) {
    typedef acc_t<T> A;
    constexpr int NT = Cf::NT, R = Cf::R, C = Cf::C, NX = Cf::NX, DC = Cf::DC, KC = Cf::KC;
    constexpr int CPT = Cf::CPT, DPT = Cf::DPT;
    constexpr int RS = Cf::RS, CS = Cf::CS, XS = Cf::XS;
    constexpr int P1 = DC * 2 * (RS + CS), P2 = KC * XS, U = P1 > P2 ? P1 : P2;
    __shared__ __align__(16) A sm[U + C * RS + 2 * R];
    // sm: q, go, k, v slices while scoring (pair_scores), then k rows [KC][XS].
    A* const Z = sm;                    // k rows [KC][XS]
    A* const W = sm + U;                // ds tile [C][RS]
    A* const Ls = W + C * RS;           // [R]
    A* const Ds = Ls + R;               // [R]
    __shared__ int Lo[R];               // first key of each row (0 past T), as Lq in bkv_tiled

    check_launch(R, NT, Tn);
    const int tid = threadIdx.x, ry = tid / NX, cx = tid % NX;
    const int nqt = (Tn + R - 1) / R, qt = nqt - 1 - (int)blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (Hq / Hkv);
    const int r0 = qt * R, last = imin(Tn - 1, r0 + R - 1);
    const i64 qs = (i64)Hq * D, ks = (i64)Hkv * D;
    const i64 qoff = ((i64)b * Tn * Hq + h) * D, koff = ((i64)b * Tn * Hkv + g) * D;
    const T *const qb = q + qoff, *const gob = go + qoff, *const kb = k + koff, *const vb = v + koff;
    const A c2 = A(scale * SGA_LOG2E), sc = A(scale);

    row_stats(Ls, Ds, R, r0, o + qoff, gob, lse, glse, delta, qs, ((i64)b * Hq + h) * Tn, Tn, D);
    for (int r = tid; r < R; r += NT) Lo[r] = r0 + r < Tn ? keys.first(b, Tn, r0 + r) : 0;
    __syncthreads();
    A L2[4], Di[4], acc[4][DPT];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        L2[r] = Ls[4 * ry + r];
        Di[r] = Ds[4 * ry + r];
#pragma unroll
        for (int j = 0; j < DPT; ++j) acc[r][j] = A(0);
    }

    // As in the forward, tiles before the first row's first key are skipped.
    for (int k0 = keys.first(b, Tn, r0) / C * C; k0 <= last; k0 += C) {
        A s[4][CPT], dp[4][CPT];
        pair_scores<Cf>(s, dp, sm, qb, gob, qs, r0, kb, vb, ks, k0, Tn, D, ry, cx);
        if (keys.softcap > 0)
            bq_ds<true, Cf>(s, dp, k0, r0, Lo, L2, Di, ry, cx, c2, sc, keys.softcap);
        else
            bq_ds<false, Cf>(s, dp, k0, r0, Lo, L2, Di, ry, cx, c2, sc, keys.softcap);
        put_tile<Cf>(W, s, ry, cx);
        const int nkc = (imin(C, last + 1 - k0) + KC - 1) / KC;
        mul_staged_rows<Cf>(acc, W, Z, kb, ks, k0, nkc, Tn, D, ry, cx);
    }
    const A f[4] = {A(scale), A(scale), A(scale), A(scale)};
    store_acc<Cf>(gq + qoff, qs, r0, Tn, D, acc, f, ry, cx);
}

// Backward, key side: the block owns R key rows of one kv head and steps,
// in order, over the query heads of its group and their query tiles, from
// the diagonal to the tile holding the last query that sees its last key:
// gv_j = sum_i p_ij go_i, gk_j = scale · sum_i p_ij (go_i·v_j − D_i) q_i
// (times the cap's slope).
template <typename T, class Cf>
__device__ void bkv_tiled(const T* q, const T* k, const T* v, const T* o, const acc_t<T>* lse, const T* go,
                          const acc_t<T>* glse, T* gk, T* gv, int Tn, int Hq, int Hkv, int D, double scale,
                          SgKeys keys) {
    typedef acc_t<T> A;
    constexpr int NT = Cf::NT, R = Cf::R, C = Cf::C, NX = Cf::NX, DC = Cf::DC, KC = Cf::KC;
    constexpr int CPT = Cf::CPT, DPT = Cf::DPT;
    constexpr int RS = Cf::RS, CS = Cf::CS, XS = Cf::XS;
    constexpr int P1 = DC * 2 * (RS + CS), P2 = KC * XS, U = P1 > P2 ? P1 : P2;
    __shared__ __align__(16) A sm[U + C * RS + 2 * C];
    // sm: k, v, q, go slices while scoring (pair_scores), then go rows, then q rows [KC][XS].
    A* const Z = sm;                    // go rows, then q rows [KC][XS]
    A* const W = sm + U;                // p, then ds [C][RS]
    A* const Ls = W + C * RS;           // [C]
    A* const Ds = Ls + C;               // [C]
    __shared__ int Lq[R];               // last query of each key row

    check_launch(R, NT, Tn);
    const int tid = threadIdx.x, ry = tid / NX, cx = tid % NX;
    const int j0 = blockIdx.x * R, g = blockIdx.y, b = blockIdx.z, G = Hq / Hkv;
    const i64 qs = (i64)Hq * D, ks = (i64)Hkv * D, koff = ((i64)b * Tn * Hkv + g) * D;
    const T *const kb = k + koff, *const vb = v + koff;
    const A c2 = A(scale * SGA_LOG2E), sc = A(scale);

    // The queries that see key j are j..=last_query(j) (first() never
    // decreases), so query t >= j sees key j exactly when t <= Lq[j − j0]:
    // one search per key row here instead of a first() per query and tile.
    // Past T, last_query is T − 1 without reading positions. Kept in shared
    // memory: four more registers per thread spill in the 128-register buckets.
    for (int r = tid; r < R; r += NT) Lq[r] = keys.last_query(b, Tn, j0 + r);
    __syncthreads();
    A ak[4][DPT], av[4][DPT];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int j = 0; j < DPT; ++j) ak[r][j] = av[r][j] = A(0);
    // last_query never decreases either: no query after the last key's
    // last one sees a key of the block (T without positions or a window).
    const int qend = keys.last_query(b, Tn, imin(Tn - 1, j0 + R - 1)) + 1;

    for (int h = g * G; h < (g + 1) * G; ++h) {
        const i64 qoff = ((i64)b * Tn * Hq + h) * D, stat = ((i64)b * Hq + h) * Tn;
        const T *const qb = q + qoff, *const gob = go + qoff;
        for (int q0 = j0 / C * C; q0 < qend; q0 += C) {
            row_stats(Ls, Ds, C, q0, o + qoff, gob, lse, glse, (A*)nullptr, qs, stat, Tn, D);
            A s[4][CPT], dp[4][CPT];
            pair_scores<Cf>(s, dp, sm, kb, vb, ks, j0, qb, gob, qs, q0, Tn, D, ry, cx);
            if (keys.softcap > 0)
                bkv_p_ds<true, Cf>(s, dp, q0, j0, Tn, Lq, Ls, Ds, ry, cx, c2, sc, keys.softcap);
            else
                bkv_p_ds<false, Cf>(s, dp, q0, j0, Tn, Lq, Ls, Ds, ry, cx, c2, sc, keys.softcap);
            const int nqc = (imin(C, Tn - q0) + KC - 1) / KC;
            put_tile<Cf>(W, s, ry, cx);
            mul_staged_rows<Cf>(av, W, Z, gob, qs, q0, nqc, Tn, D, ry, cx);
            put_tile<Cf>(W, dp, ry, cx);
            mul_staged_rows<Cf>(ak, W, Z, qb, qs, q0, nqc, Tn, D, ry, cx);
        }
    }
    const A one[4] = {A(1), A(1), A(1), A(1)}, f[4] = {A(scale), A(scale), A(scale), A(scale)};
    store_acc<Cf>(gv + koff, ks, j0, Tn, D, av, one, ry, cx);
    store_acc<Cf>(gk + koff, ks, j0, Tn, D, ak, f, ry, cx);
}

// ---------------------------------------------------------------------------
// Small head sizes (D <= DS, DS in {1, 4, 16}): one thread per query row
// (fwd, bwd_q) with key tiles staged in shared memory; bwd_kv uses one thread
// per (key, query slice) and sums the slices in a fixed order at the end.
//
// A staged tile is as many rows as a shared-memory budget holds
// (`small_tile_rows`: 2048 keys of head size 1 in f32, down to 64): every
// tile costs a block a round trip to memory and two barriers, and rows of
// one or a few elements leave little work between them (W2's head size 1
// at T = 4096 took 448 of them per bwd_kv block at 64 rows). The tile size
// only sets how often a block stages and waits: each row's arithmetic runs
// in the same order at any size, so results are the same bits.
// ---------------------------------------------------------------------------

constexpr int SMALL_NT = 128;   // fwd and bwd_q: threads = query rows per block
constexpr int SKV_KB = 32;      // bwd_kv: keys per block (one per lane)
constexpr int SKV_NS = 8;       // bwd_kv: query slices (one per warp)

// Rows of a staged tile holding `per_row` accumulator values per row in at
// most `bytes`: a power of two from 64 to 2048.
template <typename A> __host__ __device__ constexpr int small_tile_rows(int per_row, int bytes) {
    int rows = 2048;
    while (rows > 64 && rows * per_row * (int)sizeof(A) > bytes) rows >>= 1;
    return rows;
}
// fwd and bwd_q: keys per staged tile (k and v rows).
template <int DS, typename A> __host__ __device__ constexpr int small_kt() { return small_tile_rows<A>(2 * DS, 16384); }
// bwd_kv: query rows per staged tile (q and go rows, lse and delta).
template <int DS, typename A> __host__ __device__ constexpr int skv_qt() { return small_tile_rows<A>(2 * DS + 2, 32768); }

// Row t of one head into registers (zero past T or D).
template <int DS, typename T, typename A>
__device__ __forceinline__ void load_row(A (&r)[DS], const T* base, i64 stride, int t, int Tn, int D) {
#pragma unroll
    for (int d = 0; d < DS; ++d) r[d] = (t < Tn && d < D) ? (A)load(base, (i64)t * stride + d) : A(0);
}

// Keys k0..k0+KT of k and v (zero past `end` or D) into Ks, Vs [KT][DS].
template <int DS, int NT, int KT, typename T, typename A>
__device__ __forceinline__ void stage_kv(A* Ks, A* Vs, const T* kb, const T* vb, i64 ks, int k0, int end, int D) {
    for (int e = threadIdx.x; e < KT * DS; e += NT) {
        const int t = k0 + e / DS, d = e % DS;
        const bool ok = t < end && d < D;
        Ks[e] = ok ? (A)load(kb, (i64)t * ks + d) : A(0);
        Vs[e] = ok ? (A)load(vb, (i64)t * ks + d) : A(0);
    }
}

// The per-key steps of the small kernels, one copy per CAP as for the
// tiled ones (see fwd_scores).

// fwd: keys jbeg..jend of the staged tile into the row's online softmax.
template <bool CAP, int DS, typename A>
__device__ __forceinline__ void fwd_small_keys(A (&acc)[DS], A& m, A& l, const A (&qr)[DS], const A* Ks, const A* Vs,
                                               int jbeg, int jend, A c2, A sc, double softcap) {
    for (int j = jbeg; j < jend; ++j) {
        A kr[DS], vr[DS];
        lds<DS>(kr, Ks + j * DS);
        A s = A(0);
#pragma unroll
        for (int d = 0; d < DS; ++d) s += qr[d] * kr[d];
        if constexpr (CAP)
            s = A(sg_cap(s * sc, softcap)) * A(SGA_LOG2E);
        else
            s *= c2;
        if (s > m) {  // new running max: rescale what was accumulated
            const A alpha = ex2(m - s);
            l *= alpha;
#pragma unroll
            for (int d = 0; d < DS; ++d) acc[d] *= alpha;
            m = s;
        }
        const A p = ex2(s - m);
        l += p;
        lds<DS>(vr, Vs + j * DS);
#pragma unroll
        for (int d = 0; d < DS; ++d) acc[d] += p * vr[d];
    }
}

// bwd_q: acc += ds·k over keys jbeg..jend of the staged tile.
template <bool CAP, int DS, typename A>
__device__ __forceinline__ void bq_small_keys(A (&acc)[DS], const A (&qr)[DS], const A (&gr)[DS], const A* Ks,
                                              const A* Vs, int jbeg, int jend, A L2, A Di, A c2, A sc,
                                              double softcap) {
    for (int j = jbeg; j < jend; ++j) {
        A kr[DS], vr[DS];
        lds<DS>(kr, Ks + j * DS);
        lds<DS>(vr, Vs + j * DS);
        A s = A(0), dp = A(0);
#pragma unroll
        for (int d = 0; d < DS; ++d) {
            s += qr[d] * kr[d];
            dp += gr[d] * vr[d];
        }
        A ds;
        if constexpr (CAP) {
            const A cs = A(sg_cap(s * sc, softcap));
            ds = ex2(cs * A(SGA_LOG2E) - L2) * (dp - Di) * A(sg_cap_slope(cs, softcap));
        } else {
            ds = ex2(s * c2 - L2) * (dp - Di);
        }
#pragma unroll
        for (int d = 0; d < DS; ++d) acc[d] += ds * kr[d];
    }
}

// bwd_kv: the lane's key j against its slice sl of the staged query tile
// q0.. (rows sl, sl + NS, ...): the queries j..=lq (and < T) see it.
template <bool CAP, int DS, int QT, int NS, typename A>
__device__ __forceinline__ void bkv_small_queries(A (&ak)[DS], A (&av)[DS], const A (&kr)[DS], const A (&vr)[DS],
                                                  const A* Qs, const A* Gs, const A* Ls, const A* Ds, int sl, int q0,
                                                  int j, int lq, int Tn, A c2, A sc, double softcap) {
#pragma unroll 2
    for (int u = 0; u < QT / NS; ++u) {
        const int i = sl + NS * u, t = q0 + i;
        if (t >= j && t < Tn && t <= lq) {
            A qv[DS], gvv[DS];
            lds<DS>(qv, Qs + i * DS);
            lds<DS>(gvv, Gs + i * DS);
            A s = A(0), dp = A(0);
#pragma unroll
            for (int d = 0; d < DS; ++d) {
                s += qv[d] * kr[d];
                dp += gvv[d] * vr[d];
            }
            A p, ds;
            if constexpr (CAP) {
                const A cs = A(sg_cap(s * sc, softcap));
                p = ex2(cs * A(SGA_LOG2E) - Ls[i]);
                ds = p * (dp - Ds[i]) * A(sg_cap_slope(cs, softcap));
            } else {
                p = ex2(s * c2 - Ls[i]);
                ds = p * (dp - Ds[i]);
            }
#pragma unroll
            for (int d = 0; d < DS; ++d) {
                av[d] += p * gvv[d];
                ak[d] += ds * qv[d];
            }
        }
    }
}

// fwd and bwd_q: the block's rows r0.. see no key before first(r0) (first()
// never decreases), so key tiles start at the one holding it; in a tile, a
// row walks its keys from first(row) (or the tile's start) to itself.
template <typename T, int DS>
__device__ void fwd_small(const T* q, const T* k, const T* v, T* o, acc_t<T>* lse, int Tn, int Hq, int Hkv, int D,
                          double scale, SgKeys keys) {
    typedef acc_t<T> A;
    constexpr int NT = SMALL_NT, KT = small_kt<DS, A>();
    __shared__ __align__(16) A Ks[KT * DS];
    __shared__ __align__(16) A Vs[KT * DS];
    check_launch(NT, NT, Tn);
    const int nqt = (Tn + NT - 1) / NT, qt = nqt - 1 - (int)blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (Hq / Hkv);
    const int r0 = qt * NT, row = r0 + (int)threadIdx.x, last = imin(Tn - 1, r0 + NT - 1);
    const i64 qs = (i64)Hq * D, ks = (i64)Hkv * D;
    const i64 qoff = ((i64)b * Tn * Hq + h) * D, koff = ((i64)b * Tn * Hkv + g) * D;
    const A c2 = A(scale * SGA_LOG2E), sc = A(scale);
    const int lo = row < Tn ? keys.first(b, Tn, row) : 0;
    A qr[DS], acc[DS];
    load_row<DS>(qr, q + qoff, qs, row, Tn, D);
#pragma unroll
    for (int d = 0; d < DS; ++d) acc[d] = A(0);
    A m = -inf_of(A(0)), l = A(0);
    for (int k0 = keys.first(b, Tn, r0) / KT * KT; k0 <= last; k0 += KT) {
        stage_kv<DS, NT, KT>(Ks, Vs, k + koff, v + koff, ks, k0, last + 1, D);
        __syncthreads();
        const int jbeg = imax(lo - k0, 0), jend = row < Tn ? imin(KT, row - k0 + 1) : 0;
        if (keys.softcap > 0)
            fwd_small_keys<true, DS>(acc, m, l, qr, Ks, Vs, jbeg, jend, c2, sc, keys.softcap);
        else
            fwd_small_keys<false, DS>(acc, m, l, qr, Ks, Vs, jbeg, jend, c2, sc, keys.softcap);
        __syncthreads();
    }
    if (row < Tn) {
        const A inv = A(1) / l;
#pragma unroll
        for (int d = 0; d < DS; ++d)
            if (d < D) store(o + qoff, (i64)row * qs + d, acc[d] * inv);
        lse[((i64)b * Hq + h) * Tn + row] = (m + lg2(l)) * A(SGA_LN2);
    }
}

template <typename T, int DS>
__device__ void bq_small(const T* q, const T* k, const T* v, const T* o, const acc_t<T>* lse, const T* go,
                         const acc_t<T>* glse, T* gq, acc_t<T>* delta, int Tn, int Hq, int Hkv, int D, double scale,
                         SgKeys keys) {
    typedef acc_t<T> A;
    constexpr int NT = SMALL_NT, KT = small_kt<DS, A>();
    __shared__ __align__(16) A Ks[KT * DS];
    __shared__ __align__(16) A Vs[KT * DS];
    check_launch(NT, NT, Tn);
    const int nqt = (Tn + NT - 1) / NT, qt = nqt - 1 - (int)blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (Hq / Hkv);
    const int r0 = qt * NT, row = r0 + (int)threadIdx.x, last = imin(Tn - 1, r0 + NT - 1);
    const i64 qs = (i64)Hq * D, ks = (i64)Hkv * D;
    const i64 qoff = ((i64)b * Tn * Hq + h) * D, koff = ((i64)b * Tn * Hkv + g) * D;
    const i64 st = ((i64)b * Hq + h) * Tn + row;
    const A c2 = A(scale * SGA_LOG2E), sc = A(scale);
    const int lo = row < Tn ? keys.first(b, Tn, row) : 0;
    A qr[DS], gr[DS], orow[DS], acc[DS];
    load_row<DS>(qr, q + qoff, qs, row, Tn, D);
    load_row<DS>(gr, go + qoff, qs, row, Tn, D);
    load_row<DS>(orow, o + qoff, qs, row, Tn, D);
    A Di = A(0);
#pragma unroll
    for (int d = 0; d < DS; ++d) {
        Di += gr[d] * orow[d];
        acc[d] = A(0);
    }
    A L2 = A(0);
    if (row < Tn) {
        if (glse) Di -= glse[st];
        L2 = lse[st] * A(SGA_LOG2E);
        delta[st] = Di;
    }
    for (int k0 = keys.first(b, Tn, r0) / KT * KT; k0 <= last; k0 += KT) {
        stage_kv<DS, NT, KT>(Ks, Vs, k + koff, v + koff, ks, k0, last + 1, D);
        __syncthreads();
        const int jbeg = imax(lo - k0, 0), jend = row < Tn ? imin(KT, row - k0 + 1) : 0;
        if (keys.softcap > 0)
            bq_small_keys<true, DS>(acc, qr, gr, Ks, Vs, jbeg, jend, L2, Di, c2, sc, keys.softcap);
        else
            bq_small_keys<false, DS>(acc, qr, gr, Ks, Vs, jbeg, jend, L2, Di, c2, sc, keys.softcap);
        __syncthreads();
    }
    if (row < Tn) {
#pragma unroll
        for (int d = 0; d < DS; ++d)
            if (d < D) store(gq + qoff, (i64)row * qs + d, acc[d] * A(scale));
    }
}

// bwd_kv: query t sees the lane's key j, j <= t, exactly when t <= last_query(j)
// (first() never decreases); query tiles stop after the block's last key's
// last query.
template <typename T, int DS>
__device__ void bkv_small(const T* q, const T* k, const T* v, const T* o, const acc_t<T>* lse, const T* go,
                          const acc_t<T>* glse, T* gk, T* gv, int Tn, int Hq, int Hkv, int D, double scale,
                          SgKeys keys) {
    typedef acc_t<T> A;
    constexpr int NT = SKV_KB * SKV_NS, KB = SKV_KB, NS = SKV_NS, QT = skv_qt<DS, A>();
    static_assert(QT % NS == 0, "a query row's slice is its row mod NS in every tile");
    constexpr int STG = 2 * QT * DS + 2 * QT, RED = NS * KB * DS;
    __shared__ __align__(16) A sm[STG > RED ? STG : RED];
    A* const Qs = sm;             // [QT][DS]
    A* const Gs = sm + QT * DS;   // [QT][DS]
    A* const Ls = Gs + QT * DS;   // [QT]
    A* const Ds = Ls + QT;        // [QT]
    check_launch(KB, NT, Tn);
    const int lane = threadIdx.x & 31, sl = threadIdx.x >> 5;
    const int j0 = blockIdx.x * KB, g = blockIdx.y, b = blockIdx.z, G = Hq / Hkv;
    const int j = j0 + lane;
    const i64 qs = (i64)Hq * D, ks = (i64)Hkv * D, koff = ((i64)b * Tn * Hkv + g) * D;
    const A c2 = A(scale * SGA_LOG2E), sc = A(scale);
    // T − 1 for keys past T (nothing is read there) or without positions and window.
    const int lq = keys.last_query(b, Tn, j), qend = keys.last_query(b, Tn, imin(Tn - 1, j0 + KB - 1)) + 1;
    A kr[DS], vr[DS], ak[DS], av[DS];
    load_row<DS>(kr, k + koff, ks, j, Tn, D);
    load_row<DS>(vr, v + koff, ks, j, Tn, D);
#pragma unroll
    for (int d = 0; d < DS; ++d) ak[d] = av[d] = A(0);

    for (int h = g * G; h < (g + 1) * G; ++h) {
        const i64 qoff = ((i64)b * Tn * Hq + h) * D, stat = ((i64)b * Hq + h) * Tn;
        for (int q0 = j0 / QT * QT; q0 < qend; q0 += QT) {
            for (int e = threadIdx.x; e < QT * DS; e += NT) {
                const int t = q0 + e / DS, d = e % DS;
                const bool ok = t < Tn && d < D;
                Qs[e] = ok ? (A)load(q + qoff, (i64)t * qs + d) : A(0);
                Gs[e] = ok ? (A)load(go + qoff, (i64)t * qs + d) : A(0);
            }
            for (int i = threadIdx.x; i < QT; i += NT) {
                const int t = q0 + i;
                A di = A(0), l2 = A(0);
                if (t < Tn) {
                    for (int d = 0; d < D; ++d)
                        di += (A)load(go + qoff, (i64)t * qs + d) * (A)load(o + qoff, (i64)t * qs + d);
                    if (glse) di -= glse[stat + t];
                    l2 = lse[stat + t] * A(SGA_LOG2E);
                }
                Ls[i] = l2;
                Ds[i] = di;
            }
            __syncthreads();
            if (keys.softcap > 0)
                bkv_small_queries<true, DS, QT, NS>(ak, av, kr, vr, Qs, Gs, Ls, Ds, sl, q0, j, lq, Tn, c2, sc,
                                                    keys.softcap);
            else
                bkv_small_queries<false, DS, QT, NS>(ak, av, kr, vr, Qs, Gs, Ls, Ds, sl, q0, j, lq, Tn, c2, sc,
                                                     keys.softcap);
            __syncthreads();
        }
    }
    // Sum the NS slices in order: gv first, then gk (times scale).
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
        for (int d = 0; d < DS; ++d) sm[(sl * KB + lane) * DS + d] = pass == 0 ? av[d] : ak[d];
        __syncthreads();
        for (int e = threadIdx.x; e < KB * DS; e += NT) {
            const int jj = e / DS, d = e % DS, t = j0 + jj;
            A sum = A(0);
#pragma unroll
            for (int s = 0; s < NS; ++s) sum += sm[(s * KB + jj) * DS + d];
            if (t < Tn && d < D)
                store(pass == 0 ? gv + koff : gk + koff, (i64)t * ks + d, pass == 0 ? sum : sum * A(scale));
        }
        __syncthreads();
    }
}

}  // namespace sga

// ---------------------------------------------------------------------------
// Entry points.
// ---------------------------------------------------------------------------

// Every pass ends with the key rule and soft-cap (`SgKeys`): positions
// (i32[B, T], or null), window (0: none), softcap (0: none).
#define SGA_KEYS const int *__restrict__ pos, int window, double softcap
#define SGA_KEYS_OF (SgKeys{pos, window, softcap})
#define SGA_FWD_PARAMS(T)                                                                       \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ o, \
        acc_t<T> *__restrict__ lse, int Tn, int Hq, int Hkv, int D, double scale, SGA_KEYS
#define SGA_BWD_INPUTS(T)                                                                             \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const T *__restrict__ o, \
        const acc_t<T> *__restrict__ lse, const T *__restrict__ go, const acc_t<T> *__restrict__ glse
#define SGA_BQ_PARAMS(T)                                                                                \
    SGA_BWD_INPUTS(T), T *__restrict__ gq, acc_t<T> *__restrict__ delta, int Tn, int Hq, int Hkv, int D, \
        double scale, SGA_KEYS
#define SGA_BKV_PARAMS(T) \
    SGA_BWD_INPUTS(T), T *__restrict__ gk, T *__restrict__ gv, int Tn, int Hq, int Hkv, int D, double scale, SGA_KEYS

#define SGA_SMALL(sfx, T, DS)                                                                                  \
    extern "C" __global__ void __launch_bounds__(sga::SMALL_NT)                                                \
        attention_fwd_d##DS##_##sfx(SGA_FWD_PARAMS(T)) { sg_pdl_entry();                                       \
        sga::fwd_small<T, DS>(q, k, v, o, lse, Tn, Hq, Hkv, D, scale, SGA_KEYS_OF);                            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(sga::SMALL_NT)                                                \
        attention_bwd_q_d##DS##_##sfx(SGA_BQ_PARAMS(T)) { sg_pdl_entry();                                      \
        sga::bq_small<T, DS>(q, k, v, o, lse, go, glse, gq, delta, Tn, Hq, Hkv, D, scale, SGA_KEYS_OF);        \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(sga::SKV_KB * sga::SKV_NS)                                    \
        attention_bwd_kv_d##DS##_##sfx(SGA_BKV_PARAMS(T)) { sg_pdl_entry();                                    \
        sga::bkv_small<T, DS>(q, k, v, o, lse, go, glse, gk, gv, Tn, Hq, Hkv, D, scale, SGA_KEYS_OF);         \
    }

#define SGA_TILED_BOUNDS(T, DM) __launch_bounds__(256, sga::Cfg<acc_t<T>, DM>::minb)
#define SGA_TILED(sfx, T, DM)                                                                                  \
    extern "C" __global__ void SGA_TILED_BOUNDS(T, DM) attention_fwd_d##DM##_##sfx(SGA_FWD_PARAMS(T)) { sg_pdl_entry();        \
        typedef typename sga::Cfg<acc_t<T>, DM>::fwd Cf;                                                       \
        sga::fwd_tiled<T, Cf>(q, k, v, o, lse, Tn, Hq, Hkv, D, scale, SGA_KEYS_OF);                            \
    }                                                                                                          \
    extern "C" __global__ void SGA_TILED_BOUNDS(T, DM) attention_bwd_q_d##DM##_##sfx(SGA_BQ_PARAMS(T)) { sg_pdl_entry();       \
        typedef typename sga::Cfg<acc_t<T>, DM>::bq Cf;                                                        \
        sga::bq_tiled<T, Cf>(q, k, v, o, lse, go, glse, gq, delta, Tn, Hq, Hkv, D, scale, SGA_KEYS_OF);        \
    }                                                                                                          \
    extern "C" __global__ void SGA_TILED_BOUNDS(T, DM) attention_bwd_kv_d##DM##_##sfx(SGA_BKV_PARAMS(T)) { sg_pdl_entry();     \
        typedef typename sga::Cfg<acc_t<T>, DM>::bkv Cf;                                                       \
        sga::bkv_tiled<T, Cf>(q, k, v, o, lse, go, glse, gk, gv, Tn, Hq, Hkv, D, scale, SGA_KEYS_OF);         \
    }

#define SGA_ALL(sfx, T)                                                                            \
    SGA_SMALL(sfx, T, 1) SGA_SMALL(sfx, T, 4) SGA_SMALL(sfx, T, 16)                                \
    SGA_TILED(sfx, T, 32) SGA_TILED(sfx, T, 64) SGA_TILED(sfx, T, 128) SGA_TILED(sfx, T, 256)

SG_FOR_EACH_FLOAT(SGA_ALL)
