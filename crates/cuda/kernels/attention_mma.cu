// Tensor-core flash attention for bf16 and f16 storage, head sizes 17..128.
//
// Same op, layouts and results as attention.cu (q: [B, T, Hq, D]; k, v:
// [B, T, Hkv, D]; lse: [B, Hq, T] in f32, natural log), computed with
// `mma.sync.m16n8k16` (16-bit inputs, f32 accumulation) on fragments read
// from shared memory with `ldmatrix`; global tiles arrive by `cp.async`,
// double-buffered. The design, the launch geometry and the determinism
// argument are in crates/cuda/src/attention.rs (`mma` section); the host
// mirrors the tile sizes and shared-memory sizes below and a launch that
// disagrees traps.
//
// Kernels (DP = head size rounded up to a multiple of 16, 32..128):
//   attention_mma_fwd_dDP_<dt>     grid (ceil(T/64), Hq, B)        o, lse
//   attention_mma_bwd_q_dDP_<dt>   grid (ceil(T/64), Hq, B)        gq
//   attention_mma_bwd_kv_dDP_<dt>  grid (ceil(T/64), Hkv, B)       gk, gv
//
// Fragment layouts (PTX ISA, mma.m16n8k16, lane = 4·g + c): the A tile
// (16×16, row-major) gives a lane rows g and g+8 at columns 2c, 2c+1 and
// 2c+8, 2c+9; the B tile (16×8) columns g at rows 2c.. and 2c+8..; the f32
// C tile (16×8) rows g and g+8 at columns 2c, 2c+1. So a C tile pair is an A
// tile as it stands: scores become the A operand of the next product without
// leaving registers. Softmax runs in base 2 on f32 scores; probabilities are
// rounded to the storage type only as the A operand of `p·v` (and the score
// gradients as that of `ds·k`, `dsᵀ·q`), as in FlashAttention-2.

#define SGM_LOG2E 1.4426950408889634074f
#define SGM_LN2 0.69314718055994530942f

namespace sgm {

typedef unsigned int u32;
typedef unsigned short u16;

constexpr int NT = 128;  // four warps
constexpr int BR = 64;   // rows a block owns: query rows (fwd, bwd_q) or key rows (bwd_kv)

// Columns per step: keys (fwd, bwd_q) or query rows (bwd_kv). Narrower for
// large heads so that the score and gradient tiles stay in registers.
template <int DP> struct Geo {
    static constexpr int SD = DP + 8;  // shared row stride: 16-byte rows, conflict-free ldmatrix
    static constexpr int FWD_BC = 64;
    static constexpr int BWD_BC = DP <= 64 ? 64 : 32;
    // Shared memory bytes, mirrored by src/attention.rs.
    static constexpr int FWD_SMEM = (BR + 4 * FWD_BC) * SD * 2;
    static constexpr int BQ_SMEM = (2 * BR + 4 * BWD_BC) * SD * 2 + 2 * BR * 4;
    static constexpr int BKV_SMEM = (2 * BR + 4 * BWD_BC) * SD * 2 + 4 * BWD_BC * 4;
};

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm4(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4t(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

template <typename T> struct Ty;
template <> struct Ty<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats rounded to nearest even, the first in the low half.
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    }
};
template <> struct Ty<__half> {
    static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    }
};

// The A fragment of rows m0..m0+15, columns k0..k0+15 of a [*, SD] tile.
template <int SD> __device__ __forceinline__ void frag_a(u32* r, const u16* s, int m0, int k0, int lane) {
    ldsm4(r, s + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + k0 + (lane >> 4) * 8);
}
// B fragments of two n-tiles from a tile stored [n][k] (rows are the
// product's columns): n0..n0+15, k0..k0+15; r[0..1] for n0.., r[2..3] for n0+8..
template <int SD> __device__ __forceinline__ void frag_b_nk(u32* r, const u16* s, int n0, int k0, int lane) {
    ldsm4(r, s + (n0 + (lane & 7) + (lane >> 4) * 8) * SD + k0 + ((lane >> 3) & 1) * 8);
}
// The same from a tile stored [k][n] (transposed by ldmatrix).
template <int SD> __device__ __forceinline__ void frag_b_kn(u32* r, const u16* s, int k0, int n0, int lane) {
    ldsm4t(r, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + n0 + (lane >> 4) * 8);
}

// The widest copy (elements) both the rows (D elements apart) and the base allow.
__device__ __forceinline__ int vec_of(const void* p, int D) {
    const unsigned long long a = (unsigned long long)p;
    if (D % 8 == 0 && a % 16 == 0) return 8;
    if (D % 4 == 0 && a % 8 == 0) return 4;
    if (D % 2 == 0 && a % 4 == 0) return 2;
    return 1;
}

template <int BYTES> __device__ __forceinline__ void cp_async(u16* dst, const u16* src, bool ok) {
    const int n = ok ? BYTES : 0;  // 0 source bytes: the destination is zero-filled
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES),
                     "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Rows t0..t0+ROWS of one head (row t at g + t·stride, D elements) into s
// [ROWS][SD], zero past T and past D up to DP. Asynchronous for V ≥ 2.
template <int V, int ROWS, int DP>
__device__ __forceinline__ void tile_v(u16* s, const u16* g, int t0, int Tn, long long stride, int D) {
    constexpr int CH = DP / V, SD = Geo<DP>::SD;
    for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
        const int r = i / CH, c = (i - r * CH) * V;
        const bool ok = t0 + r < Tn && c < D;
        const u16* src = ok ? g + (long long)(t0 + r) * stride + c : g;
        u16* dst = s + r * SD + c;
        if constexpr (V == 1)
            *dst = ok ? *src : (u16)0;
        else
            cp_async<2 * V>(dst, src, ok);
    }
}
template <int ROWS, int DP>
__device__ __forceinline__ void tile(u16* s, const void* g, int vec, int t0, int Tn, long long stride, int D) {
    const u16* p = (const u16*)g;
    switch (vec) {
        case 8: tile_v<8, ROWS, DP>(s, p, t0, Tn, stride, D); break;
        case 4: tile_v<4, ROWS, DP>(s, p, t0, Tn, stride, D); break;
        case 2: tile_v<2, ROWS, DP>(s, p, t0, Tn, stride, D); break;
        default: tile_v<1, ROWS, DP>(s, p, t0, Tn, stride, D); break;
    }
}

__device__ __forceinline__ unsigned dynamic_smem() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
// The host computes the geometry from the same constants; a launch that
// disagrees would skip rows or overrun shared memory, so it traps.
__device__ __forceinline__ void check_launch(int rows, int Tn, int smem) {
    if ((int)gridDim.x != (Tn + rows - 1) / rows || (int)blockDim.x != NT || (int)dynamic_smem() < smem) __trap();
}

// Ls[i] = lse·log2(e) and Ds[i] = go·o − glse for the n rows t0.. (zero past
// T); n·(NT/n) threads, NT/n per row over dims, summed in a fixed order.
template <typename T, int N>
__device__ __forceinline__ void row_stats(float* Ls, float* Ds, int t0, const T* o, const T* go, const float* lse,
                                          const float* glse, long long stride, long long stat, int Tn, int D) {
    constexpr int PER = NT / N;  // threads per row: 2 or 4, neighbours in a warp
    const int i = threadIdx.x / PER, part = threadIdx.x % PER, t = t0 + i;
    float sum = 0.f;
    if (t < Tn)
        for (int d = part; d < D; d += PER) sum += load(go, (long long)t * stride + d) * load(o, (long long)t * stride + d);
#pragma unroll
    for (int off = PER / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (part == 0) {
        Ls[i] = t < Tn ? lse[stat + t] * SGM_LOG2E : 0.f;
        Ds[i] = t < Tn ? sum - (glse ? glse[stat + t] : 0.f) : 0.f;
    }
}

// ---------------------------------------------------------------------------
// Forward: the block owns 64 query rows (16 per warp) and walks the key tiles
// up to the diagonal with an online softmax.
// ---------------------------------------------------------------------------
template <typename T, int DP>
__device__ void fwd(const T* q, const T* k, const T* v, T* o, float* lse, int Tn, int Hq, int Hkv, int D,
                    double scale) {
    typedef Geo<DP> G;
    constexpr int SD = G::SD, BC = G::FWD_BC, KT = DP / 16, NO = DP / 8, NS = BC / 8;
    extern __shared__ __align__(16) u16 smem[];
    u16* const Qs = smem;
    u16* const Ks = Qs + BR * SD;      // two buffers of BC rows
    u16* const Vs = Ks + 2 * BC * SD;  // two buffers of BC rows
    check_launch(BR, Tn, G::FWD_SMEM);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;  // longest rows first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
    const int q0 = qt * BR;
    const long long qs = (long long)Hq * D, ks = (long long)Hkv * D;
    const T* const qb = q + (long long)b * Tn * qs + (long long)h * D;
    const T* const kb = k + (long long)b * Tn * ks + (long long)hk * D;
    const T* const vb = v + (long long)b * Tn * ks + (long long)hk * D;
    const int vq = vec_of(q, D), vk = vec_of(k, D), vv = vec_of(v, D);
    const int last = min(q0 + BR, Tn) - 1, ntiles = last / BC + 1;
    const float c2 = (float)(scale * 1.4426950408889634074);

    tile<BR, DP>(Qs, qb, vq, q0, Tn, qs, D);
    tile<BC, DP>(Ks, kb, vk, 0, Tn, ks, D);
    tile<BC, DP>(Vs, vb, vv, 0, Tn, ks, D);
    cp_commit();

    u32 qf[KT][4];
    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int row0 = q0 + warp * 16 + g;  // this lane's rows: row0, row0 + 8

    for (int j = 0; j < ntiles; ++j) {
        if (j + 1 < ntiles) {
            const int nb = (j + 1) & 1;
            tile<BC, DP>(Ks + nb * BC * SD, kb, vk, (j + 1) * BC, Tn, ks, D);
            tile<BC, DP>(Vs + nb * BC * SD, vb, vv, (j + 1) * BC, Tn, ks, D);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) frag_a<SD>(qf[kk], Qs, warp * 16, kk * 16, lane);
        }
        const u16* const Kt = Ks + (j & 1) * BC * SD;
        const u16* const Vt = Vs + (j & 1) * BC * SD;
        const int k0 = j * BC;

        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int np = 0; np < NS / 2; ++np) {
                u32 bf[4];
                frag_b_nk<SD>(bf, Kt, np * 16, kk * 16, lane);
                Ty<T>::mma(s[2 * np], qf[kk], bf[0], bf[1]);
                Ty<T>::mma(s[2 * np + 1], qf[kk], bf[2], bf[3]);
            }

        // Scale, mask (future keys, keys past T), running max.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + n * 8 + 2 * c + (e & 1), row = row0 + (e >> 1) * 8;
                const float x = (key > row || key >= Tn) ? -INFINITY : s[n][e] * c2;
                s[n][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float mn = fmaxf(m[r], mx[r]);  // finite: key k0 <= every row of this tile range
            alpha[r] = exp2f(m[r] - mn);
            m[r] = mn;
        }
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[n][e] - m[e >> 1]);
                s[n][e] = p;
                sum[e >> 1] += p;
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }

        // acc += p · v.
#pragma unroll
        for (int kc = 0; kc < BC / 16; ++kc) {
            u32 pa[4] = {Ty<T>::pack(s[2 * kc][0], s[2 * kc][1]), Ty<T>::pack(s[2 * kc][2], s[2 * kc][3]),
                         Ty<T>::pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                         Ty<T>::pack(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
            for (int np = 0; np < DP / 16; ++np) {
                u32 bf[4];
                frag_b_kn<SD>(bf, Vt, kc * 16, np * 16, lane);
                Ty<T>::mma(acc[2 * np], pa, bf[0], bf[1]);
                Ty<T>::mma(acc[2 * np + 1], pa, bf[2], bf[3]);
            }
        }
        __syncthreads();  // the buffer of tile j is refilled at j + 1
    }

    // The row sums were kept per lane; add the four lanes of a row (fixed order).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    T* const ob = o + (long long)b * Tn * qs + (long long)h * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= Tn) continue;
        const float inv = 1.f / l[r];
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            const int d = n * 8 + 2 * c;
            if (d < D) store(ob, (long long)row * qs + d, acc[n][2 * r] * inv);
            if (d + 1 < D) store(ob, (long long)row * qs + d + 1, acc[n][2 * r + 1] * inv);
        }
        if (c == 0) lse[((long long)b * Hq + h) * Tn + row] = (m[r] + log2f(l[r])) * SGM_LN2;
    }
}

// ---------------------------------------------------------------------------
// Backward, query side: the block owns 64 query rows and walks the key tiles
// up to the diagonal: gq = scale · Σ_j p_ij (go_i·v_j − D_i) k_j.
// ---------------------------------------------------------------------------
template <typename T, int DP>
__device__ void bwd_q(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* go,
                      const float* glse, T* gq, int Tn, int Hq, int Hkv, int D, double scale) {
    typedef Geo<DP> G;
    constexpr int SD = G::SD, BC = G::BWD_BC, KT = DP / 16, NO = DP / 8, NS = BC / 8;
    extern __shared__ __align__(16) u16 smem[];
    u16* const Qs = smem;
    u16* const Gs = Qs + BR * SD;
    u16* const Ks = Gs + BR * SD;      // two buffers
    u16* const Vs = Ks + 2 * BC * SD;  // two buffers
    float* const Ls = reinterpret_cast<float*>(Vs + 2 * BC * SD);
    float* const Ds = Ls + BR;
    check_launch(BR, Tn, G::BQ_SMEM);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
    const int q0 = qt * BR;
    const long long qs = (long long)Hq * D, ks = (long long)Hkv * D;
    const long long qoff = (long long)b * Tn * qs + (long long)h * D;
    const T* const kb = k + (long long)b * Tn * ks + (long long)hk * D;
    const T* const vb = v + (long long)b * Tn * ks + (long long)hk * D;
    const int vk = vec_of(k, D), vv = vec_of(v, D);
    const int last = min(q0 + BR, Tn) - 1, ntiles = last / BC + 1;
    const float c2 = (float)(scale * 1.4426950408889634074);

    tile<BR, DP>(Qs, q + qoff, vec_of(q, D), q0, Tn, qs, D);
    tile<BR, DP>(Gs, go + qoff, vec_of(go, D), q0, Tn, qs, D);
    tile<BC, DP>(Ks, kb, vk, 0, Tn, ks, D);
    tile<BC, DP>(Vs, vb, vv, 0, Tn, ks, D);
    cp_commit();
    row_stats<T, BR>(Ls, Ds, q0, o + qoff, go + qoff, lse, glse, qs, ((long long)b * Hq + h) * Tn, Tn, D);

    u32 qf[KT][4], gf[KT][4];
    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const int row0 = q0 + warp * 16 + g;
    float Lr[2], Dr[2];

    for (int j = 0; j < ntiles; ++j) {
        if (j + 1 < ntiles) {
            const int nb = (j + 1) & 1;
            tile<BC, DP>(Ks + nb * BC * SD, kb, vk, (j + 1) * BC, Tn, ks, D);
            tile<BC, DP>(Vs + nb * BC * SD, vb, vv, (j + 1) * BC, Tn, ks, D);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) {
                frag_a<SD>(qf[kk], Qs, warp * 16, kk * 16, lane);
                frag_a<SD>(gf[kk], Gs, warp * 16, kk * 16, lane);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                Lr[r] = Ls[warp * 16 + g + r * 8];
                Dr[r] = Ds[warp * 16 + g + r * 8];
            }
        }
        const u16* const Kt = Ks + (j & 1) * BC * SD;
        const u16* const Vt = Vs + (j & 1) * BC * SD;
        const int k0 = j * BC;

        float s[NS][4], dp[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int np = 0; np < NS / 2; ++np) {
                u32 bf[4];
                frag_b_nk<SD>(bf, Kt, np * 16, kk * 16, lane);
                Ty<T>::mma(s[2 * np], qf[kk], bf[0], bf[1]);
                Ty<T>::mma(s[2 * np + 1], qf[kk], bf[2], bf[3]);
                frag_b_nk<SD>(bf, Vt, np * 16, kk * 16, lane);
                Ty<T>::mma(dp[2 * np], gf[kk], bf[0], bf[1]);
                Ty<T>::mma(dp[2 * np + 1], gf[kk], bf[2], bf[3]);
            }
        // ds = p · (dp − D_i), p = exp2(s·scale·log2 e − L_i), zero where masked.
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + n * 8 + 2 * c + (e & 1), row = row0 + (e >> 1) * 8;
                const float p = (key > row || key >= Tn) ? 0.f : exp2f(s[n][e] * c2 - Lr[e >> 1]);
                s[n][e] = p * (dp[n][e] - Dr[e >> 1]);
            }
        // acc += ds · k.
#pragma unroll
        for (int kc = 0; kc < BC / 16; ++kc) {
            u32 pa[4] = {Ty<T>::pack(s[2 * kc][0], s[2 * kc][1]), Ty<T>::pack(s[2 * kc][2], s[2 * kc][3]),
                         Ty<T>::pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                         Ty<T>::pack(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
            for (int np = 0; np < DP / 16; ++np) {
                u32 bf[4];
                frag_b_kn<SD>(bf, Kt, kc * 16, np * 16, lane);
                Ty<T>::mma(acc[2 * np], pa, bf[0], bf[1]);
                Ty<T>::mma(acc[2 * np + 1], pa, bf[2], bf[3]);
            }
        }
        __syncthreads();
    }

    T* const gb = gq + qoff;
    const float sc = (float)scale;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= Tn) continue;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            const int d = n * 8 + 2 * c;
            if (d < D) store(gb, (long long)row * qs + d, acc[n][2 * r] * sc);
            if (d + 1 < D) store(gb, (long long)row * qs + d + 1, acc[n][2 * r + 1] * sc);
        }
    }
}

// ---------------------------------------------------------------------------
// Backward, key side: the block owns 64 key rows of one kv head and walks the
// query heads of its group, then their query tiles from the diagonal on:
// gv_j = Σ_i p_ij go_i, gk_j = scale · Σ_i p_ij (go_i·v_j − D_i) q_i. Scores
// are computed transposed (keys × queries) so that they are A operands.
// ---------------------------------------------------------------------------
template <typename T, int DP>
__device__ void bwd_kv(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* go,
                       const float* glse, T* gk, T* gv, int Tn, int Hq, int Hkv, int D, double scale) {
    typedef Geo<DP> G;
    constexpr int SD = G::SD, BQ = G::BWD_BC, KT = DP / 16, NO = DP / 8, NS = BQ / 8;
    extern __shared__ __align__(16) u16 smem[];
    u16* const Ks = smem;
    u16* const Vs = Ks + BR * SD;
    u16* const Qs = Vs + BR * SD;      // two buffers of BQ rows
    u16* const Gs = Qs + 2 * BQ * SD;  // two buffers
    float* const Ls = reinterpret_cast<float*>(Gs + 2 * BQ * SD);  // two buffers
    float* const Ds = Ls + 2 * BQ;                                 // two buffers
    check_launch(BR, Tn, G::BKV_SMEM);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int hk = blockIdx.y, b = blockIdx.z, grp = Hq / Hkv;
    const int k0 = blockIdx.x * BR;  // the first blocks have the most query tiles: launched first
    const long long qs = (long long)Hq * D, ks = (long long)Hkv * D;
    const long long koff = (long long)b * Tn * ks + (long long)hk * D;
    const int vq = vec_of(q, D), vg = vec_of(go, D);
    const int first = k0 / BQ, nq = (Tn + BQ - 1) / BQ, per_head = nq - first, steps = grp * per_head;
    const float c2 = (float)(scale * 1.4426950408889634074);

    tile<BR, DP>(Ks, k + koff, vec_of(k, D), k0, Tn, ks, D);
    tile<BR, DP>(Vs, v + koff, vec_of(v, D), k0, Tn, ks, D);
    auto issue = [&](int step, int buf) {
        const int h = hk * grp + step / per_head, t0 = (first + step % per_head) * BQ;
        const long long qoff = (long long)b * Tn * qs + (long long)h * D;
        tile<BQ, DP>(Qs + buf * BQ * SD, q + qoff, vq, t0, Tn, qs, D);
        tile<BQ, DP>(Gs + buf * BQ * SD, go + qoff, vg, t0, Tn, qs, D);
    };
    issue(0, 0);
    cp_commit();

    float dk[NO][4], dv[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
    const int key0 = k0 + warp * 16 + g;  // this lane's keys: key0, key0 + 8

    for (int st = 0; st < steps; ++st) {
        const int buf = st & 1;
        const int h = hk * grp + st / per_head, t0 = (first + st % per_head) * BQ;
        const long long qoff = (long long)b * Tn * qs + (long long)h * D;
        row_stats<T, BQ>(Ls + buf * BQ, Ds + buf * BQ, t0, o + qoff, go + qoff, lse, glse, qs,
                         ((long long)b * Hq + h) * Tn, Tn, D);
        if (st + 1 < steps) {
            issue(st + 1, buf ^ 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const u16* const Qt = Qs + buf * BQ * SD;
        const u16* const Gt = Gs + buf * BQ * SD;
        const float* const Lt = Ls + buf * BQ;
        const float* const Dt = Ds + buf * BQ;

        // sᵀ = k·qᵀ and dpᵀ = v·goᵀ, [16 keys × BQ queries] per warp.
        float s[NS][4], dp[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            u32 ka[4], va[4];
            frag_a<SD>(ka, Ks, warp * 16, kk * 16, lane);
            frag_a<SD>(va, Vs, warp * 16, kk * 16, lane);
#pragma unroll
            for (int np = 0; np < NS / 2; ++np) {
                u32 bf[4];
                frag_b_nk<SD>(bf, Qt, np * 16, kk * 16, lane);
                Ty<T>::mma(s[2 * np], ka, bf[0], bf[1]);
                Ty<T>::mma(s[2 * np + 1], ka, bf[2], bf[3]);
                frag_b_nk<SD>(bf, Gt, np * 16, kk * 16, lane);
                Ty<T>::mma(dp[2 * np], va, bf[0], bf[1]);
                Ty<T>::mma(dp[2 * np + 1], va, bf[2], bf[3]);
            }
        }
        // pᵀ into s, dsᵀ into dp; zero where the query precedes the key or is past T.
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = n * 8 + 2 * c + (e & 1), query = t0 + qi, key = key0 + (e >> 1) * 8;
                const float p = (query < key || query >= Tn) ? 0.f : exp2f(s[n][e] * c2 - Lt[qi]);
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - Dt[qi]);
            }
        // gv += pᵀ·go, gk += dsᵀ·q.
#pragma unroll
        for (int kc = 0; kc < BQ / 16; ++kc) {
            u32 pa[4] = {Ty<T>::pack(s[2 * kc][0], s[2 * kc][1]), Ty<T>::pack(s[2 * kc][2], s[2 * kc][3]),
                         Ty<T>::pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                         Ty<T>::pack(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            u32 da[4] = {Ty<T>::pack(dp[2 * kc][0], dp[2 * kc][1]), Ty<T>::pack(dp[2 * kc][2], dp[2 * kc][3]),
                         Ty<T>::pack(dp[2 * kc + 1][0], dp[2 * kc + 1][1]),
                         Ty<T>::pack(dp[2 * kc + 1][2], dp[2 * kc + 1][3])};
#pragma unroll
            for (int np = 0; np < DP / 16; ++np) {
                u32 bf[4];
                frag_b_kn<SD>(bf, Gt, kc * 16, np * 16, lane);
                Ty<T>::mma(dv[2 * np], pa, bf[0], bf[1]);
                Ty<T>::mma(dv[2 * np + 1], pa, bf[2], bf[3]);
                frag_b_kn<SD>(bf, Qt, kc * 16, np * 16, lane);
                Ty<T>::mma(dk[2 * np], da, bf[0], bf[1]);
                Ty<T>::mma(dk[2 * np + 1], da, bf[2], bf[3]);
            }
        }
        __syncthreads();  // buffers of this step are refilled at the next
    }

    const float sc = (float)scale;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + r * 8;
        if (key >= Tn) continue;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            const int d = n * 8 + 2 * c;
            if (d < D) {
                store(gk + koff, (long long)key * ks + d, dk[n][2 * r] * sc);
                store(gv + koff, (long long)key * ks + d, dv[n][2 * r]);
            }
            if (d + 1 < D) {
                store(gk + koff, (long long)key * ks + d + 1, dk[n][2 * r + 1] * sc);
                store(gv + koff, (long long)key * ks + d + 1, dv[n][2 * r + 1]);
            }
        }
    }
}

}  // namespace sgm

// ---------------------------------------------------------------------------
// Entry points. Each module is one variant: src/kernels.rs defines SGM_SFX,
// SGM_TYPE and SGM_DP (a multiple of 16 in 32..128). Without them (an editor,
// a syntax check) every variant is instantiated.
// ---------------------------------------------------------------------------

#define SGM_ENTRY(sfx, T, DP)                                                                                     \
    extern "C" __global__ void __launch_bounds__(sgm::NT) attention_mma_fwd_d##DP##_##sfx(                        \
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,              \
        float* __restrict__ lse, int Tn, int Hq, int Hkv, int D, double scale) {                                  \
        sgm::fwd<T, DP>(q, k, v, o, lse, Tn, Hq, Hkv, D, scale);                                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(sgm::NT) attention_mma_bwd_q_d##DP##_##sfx(                      \
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ o,        \
        const float* __restrict__ lse, const T* __restrict__ go, const float* __restrict__ glse,                  \
        T* __restrict__ gq, int Tn, int Hq, int Hkv, int D, double scale) {                                       \
        sgm::bwd_q<T, DP>(q, k, v, o, lse, go, glse, gq, Tn, Hq, Hkv, D, scale);                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(sgm::NT) attention_mma_bwd_kv_d##DP##_##sfx(                     \
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ o,        \
        const float* __restrict__ lse, const T* __restrict__ go, const float* __restrict__ glse,                  \
        T* __restrict__ gk, T* __restrict__ gv, int Tn, int Hq, int Hkv, int D, double scale) {                   \
        sgm::bwd_kv<T, DP>(q, k, v, o, lse, go, glse, gk, gv, Tn, Hq, Hkv, D, scale);                             \
    }
// Expands the variant macros before they are pasted into names.
#define SGM_ENTRY_OF(sfx, T, DP) SGM_ENTRY(sfx, T, DP)

#ifdef SGM_DP
SGM_ENTRY_OF(SGM_SFX, SGM_TYPE, SGM_DP)
#else
#define SGM_ALL(sfx, T)                                                                                   \
    SGM_ENTRY(sfx, T, 32) SGM_ENTRY(sfx, T, 48) SGM_ENTRY(sfx, T, 64) SGM_ENTRY(sfx, T, 80) SGM_ENTRY(sfx, T, 96) \
    SGM_ENTRY(sfx, T, 112) SGM_ENTRY(sfx, T, 128)
SGM_ALL(bf16, __nv_bfloat16)
SGM_ALL(f16, __half)
#endif
