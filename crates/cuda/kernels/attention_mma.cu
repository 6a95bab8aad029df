// Tensor-core flash attention for bf16, f16 and f32 storage, head sizes 17..128.
//
// Same op, layouts and results as attention.cu (q: [B, T, Hq, D]; k, v:
// [B, T, Hkv, D]; lse: [B, Hq, T] in f32, natural log), computed with
// `mma.sync` on fragments read from shared memory; global tiles arrive by
// `cp.async`. bf16/f16 use m16n8k16 (f32 accumulation, `ldmatrix`, tiles
// double-buffered); f32 uses m16n8k8 on TF32 in three products (3xTF32),
// which keeps f32 accuracy. The fragment traits `Tc16` and `Tc32` are all
// that differs; the three kernels are written once over them. The design,
// the launch geometry and the determinism argument are in
// crates/cuda/src/ops/attention.rs; the host mirrors the tile sizes and shared
// memory sizes of `Geo` below, and a launch that disagrees traps.
//
// With SGM_WGMMA (a module built for sm_90a) the three passes use Hopper's
// warpgroup MMA instead (fwd_wg, bwd_q_wg, bwd_kv_wg at the end of this
// file: two warpgroups of 64 rows per block sharing streamed tiles handed
// over by mbarriers, operands in shared memory as wgmma's core matrices;
// every pass's streamed tiles come by TMA);
// 128 rows per block, same arguments, results up to summation order.
//
// Kernels (DP = head size rounded up to a multiple of 16, 32..128), in launch order:
//   attention_mma_fwd_dDP_<dt>     grid (ceil(T/FWD_ROWS), Hq, B)  o, lse
//   attention_mma_bwd_q_dDP_<dt>   grid (ceil(T/BQ_ROWS), Hq, B)   gq, delta (D_i per row)
//   attention_mma_bwd_kv_dDP_<dt>  grid (ceil(T/64), Hkv, B)       gk, gv (reads delta)
//
// Fragment layouts (PTX ISA, lane = 4·g + c): for m16n8k16 the A tile
// (16×16, row-major) gives a lane rows g and g+8 at columns 2c, 2c+1 and
// 2c+8, 2c+9; the B tile (16×8) column g at rows 2c.. and 2c+8..; the f32
// C tile (16×8) rows g and g+8 at columns 2c, 2c+1. So a C tile pair is an A
// tile as it stands: scores become the A operand of the next product without
// leaving registers (for m16n8k8 the same holds after renaming the depth
// slots, see Tc32). Softmax runs in base 2 on f32 scores; in 16-bit storage
// probabilities are rounded only as the A operand of `p·v` (and the score
// gradients as that of `ds·k`, `dsᵀ·q`), as in FlashAttention-2.
//
// Which keys a query sees (`SgKeys`, common.cuh): row i sees the keys
// first(i)..=i, which covers causal, sliding-window and packed-document
// masks at once. Every pass masks each score entry outside that range (and
// past T), with first() (or, on the key side, last_query()) computed once
// per row a thread owns. first() never decreases along a row, so whole
// tiles are skipped without looking at each row: the query-side passes
// start at the key tile holding first() of their block's first row, and
// bwd_kv stops at the query tile holding last_query() of its block's last
// key row. With a soft-cap a score is capped in natural units,
// softcap·tanh(scale·q·k / softcap), before it goes to base 2, and the
// score gradients take the cap's slope. The cap sits behind a branch that
// is uniform over the launch, and without a window or positions the tile
// ranges are the full ones and the added compares never fire, so plain
// causal attention computes exactly what it did before.

#define SGM_LOG2E 1.4426950408889634074f
#define SGM_LN2 0.69314718055994530942f

namespace sgm {

typedef unsigned int u32;
typedef unsigned short u16;

constexpr int NT = 128;  // four warps
constexpr int BR = 64;   // rows a block owns: query rows (fwd, bwd_q) or key rows (bwd_kv)


// ---------------------------------------------------------------------------
// Fragment traits: what the kernels below need of a tensor-core product.
//   E          shared-memory element (the storage type's bits)
//   KS         reduction depth of one mma; PAD: shared row padding (elements)
//   NBUF       shared buffers per streamed tile (2: the next tile loads
//              while this one is used); HOLD: keep a block's own A operands
//              (q, go) in registers rather than re-reading shared memory
//   A, B       an A fragment (16 rows × KS) and the B fragments of two n-tiles
//              (KS × 16 columns)
//   load_a<SD>(a, s, m0, k0)     rows m0.., depth k0.. of a tile stored [m][k]
//   load_b_nk<SD>(b, s, n0, k0)  from a tile stored [n][k] (k·qᵀ-like)
//   load_b_kn<SD>(b, s, k0, n0)  from a tile stored [k][n] (p·v-like); its
//                                depth order matches a_from_c's
//   a_from_c(a, c)               the A fragment made of KS/8 f32 result tiles
//   mma(c, a, b, t)              c += a·b for n-tile t of the pair
// ---------------------------------------------------------------------------

// bf16/f16: m16n8k16 with f32 accumulation, fragments by ldmatrix.
template <typename T> struct Tc16 {
    typedef u16 E;
    static constexpr int KS = 16, PAD = 8, NBUF = 2;
    static constexpr bool HOLD = true;
    struct A {
        u32 r[4];
    };
    struct B {
        u32 r[4];
    };
    template <int SD> static __device__ __forceinline__ void load_a(A& a, const E* s, int m0, int k0, int lane) {
        sg_ldsm4(a.r, s + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + k0 + (lane >> 4) * 8);
    }
    template <int SD> static __device__ __forceinline__ void load_b_nk(B& b, const E* s, int n0, int k0, int lane) {
        sg_ldsm4(b.r, s + (n0 + (lane & 7) + (lane >> 4) * 8) * SD + k0 + ((lane >> 3) & 1) * 8);
    }
    template <int SD> static __device__ __forceinline__ void load_b_kn(B& b, const E* s, int k0, int n0, int lane) {
        sg_ldsm4t(b.r, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + n0 + (lane >> 4) * 8);
    }
    // A C tile pair is an A tile as it stands (rows g, g+8; columns 2c.. and 2c+8..).
    static __device__ __forceinline__ void a_from_c(A& a, const float (*c)[4]) {
        a.r[0] = Mma16<T>::pack(c[0][0], c[0][1]);
        a.r[1] = Mma16<T>::pack(c[0][2], c[0][3]);
        a.r[2] = Mma16<T>::pack(c[1][0], c[1][1]);
        a.r[3] = Mma16<T>::pack(c[1][2], c[1][3]);
    }
    static __device__ __forceinline__ void mma(float* c, const A& a, const B& b, int t) {
        Mma16<T>::mma(c, a.r, b.r[2 * t], b.r[2 * t + 1]);
    }
};

// f32: m16n8k8 on TF32 in three products (3xTF32): x = hi + lo with hi
// TF32 and lo the remainder, and a·b ≈ lo_a·hi_b + hi_a·lo_b + hi_a·hi_b,
// which keeps about f32's precision (the dropped lo·lo term and lo's
// truncation to TF32 are ~2⁻²¹ relative) at tensor-core speed.
// Fragments are read with 32-bit shared loads; shared rows of DP + 4 words
// keep them conflict-free (DP/4 even, so the stride/4 is odd).
struct Tc32 {
    typedef float E;
    static constexpr int KS = 8, PAD = 4, NBUF = 1;
    static constexpr bool HOLD = false;
    struct A {
        u32 hi[4], lo[4];
    };
    struct B {
        u32 hi[4], lo[4];
    };
    // hi: x rounded to TF32 (half an ulp added, low 13 bits cleared); lo =
    // x − hi exactly, handed over as f32 bits: the tensor core reads TF32
    // operands by truncating the low 13 bits. Integer and f32 adds run at
    // full rate where `cvt.rna.tf32` runs at a quarter, and the splits are a
    // large share of this kernel's instructions.
    static __device__ __forceinline__ void split(float x, u32& hi, u32& lo) {
        hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
        lo = __float_as_uint(x - __uint_as_float(hi));
    }
    static __device__ __forceinline__ void set_a(A& a, float x0, float x1, float x2, float x3) {
        split(x0, a.hi[0], a.lo[0]);
        split(x1, a.hi[1], a.lo[1]);
        split(x2, a.hi[2], a.lo[2]);
        split(x3, a.hi[3], a.lo[3]);
    }
    // A (16×8): rows g, g+8 at depth c and c+4.
    template <int SD> static __device__ __forceinline__ void load_a(A& a, const E* s, int m0, int k0, int lane) {
        const E* p = s + (m0 + (lane >> 2)) * SD + k0 + (lane & 3);
        set_a(a, p[0], p[8 * SD], p[4], p[8 * SD + 4]);
    }
    // B (8×8) per n-tile: column g at depth c and c+4.
    template <int SD> static __device__ __forceinline__ void load_b_nk(B& b, const E* s, int n0, int k0, int lane) {
        const E* p = s + (n0 + (lane >> 2)) * SD + k0 + (lane & 3);
        split(p[0], b.hi[0], b.lo[0]);
        split(p[4], b.hi[1], b.lo[1]);
        split(p[8 * SD], b.hi[2], b.lo[2]);
        split(p[8 * SD + 4], b.hi[3], b.lo[3]);
    }
    // Depth slots c and c+4 hold rows 2c and 2c+1 (the order a_from_c uses).
    template <int SD> static __device__ __forceinline__ void load_b_kn(B& b, const E* s, int k0, int n0, int lane) {
        const E* p = s + (k0 + 2 * (lane & 3)) * SD + n0 + (lane >> 2);
        split(p[0], b.hi[0], b.lo[0]);
        split(p[SD], b.hi[1], b.lo[1]);
        split(p[8], b.hi[2], b.lo[2]);
        split(p[SD + 8], b.hi[3], b.lo[3]);
    }
    // One C tile (rows g, g+8; columns 2c, 2c+1): depth slot c takes column
    // 2c and slot c+4 column 2c+1, so no value leaves its lane.
    static __device__ __forceinline__ void a_from_c(A& a, const float (*c)[4]) {
        set_a(a, c[0][0], c[0][2], c[0][1], c[0][3]);
    }
    static __device__ __forceinline__ void mma1(float* c, const u32* a, u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ void mma(float* c, const A& a, const B& b, int t) {
        mma1(c, a.lo, b.hi[2 * t], b.hi[2 * t + 1]);
        mma1(c, a.hi, b.lo[2 * t], b.lo[2 * t + 1]);
        mma1(c, a.hi, b.hi[2 * t], b.hi[2 * t + 1]);
    }
};

template <typename T> struct TcOf {
    typedef Tc16<T> type;
};
template <> struct TcOf<float> {
    typedef Tc32 type;
};

// Tile sizes and shared memory per storage type and padded head size DP;
// mirrored by src/ops/attention.rs (scripts/attention-variants times
// alternatives). Columns per step are keys (fwd, bwd_q) or query rows
// (bwd_kv), narrower where the score tiles would crowd registers.
// In the forward a warp owns FWD_MT tiles of 16 query rows: for 16-bit
// storage and heads over 64 two, so that every B fragment read from shared
// memory feeds two products (ldmatrix traffic, not the tensor cores, bounds
// one tile per warp), with 32 keys per step to stay within registers; at 64
// and below one tile and 64 keys measured faster; f32's split fragments
// leave no registers for a second tile.
//
// Heads over 128 (WIDE, 16-bit storage, padded to 256): a warp's
// accumulator row tile alone is 128 registers, so every pass keeps one row
// tile per warp, 32 columns per step and no operand held in registers, and
// the key side splits its outputs: KV_SPLIT blocks share each 64 key rows,
// each recomputing the scores over the whole head and accumulating its own
// DP / KV_SPLIT columns of gk and gv (both halves at once would need 256).
template <typename T, int DP> struct Geo {
    typedef typename TcOf<T>::type Tc;
    typedef typename Tc::E E;
    static constexpr int ES = (int)sizeof(E), SD = DP + Tc::PAD, NBUF = Tc::NBUF;
    static constexpr bool WIDE = DP > 128;
    static constexpr bool HOLD = Tc::HOLD && !WIDE;
    static constexpr int KV_SPLIT = WIDE ? 2 : 1;
    static constexpr int FWD_MT = ES == 2 && DP > 64 && !WIDE ? 2 : 1;
    static constexpr int FWD_ROWS = NT / 32 * 16 * FWD_MT;
    static constexpr int FWD_BC = ES == 2 && FWD_MT == 1 && !WIDE ? 64 : 32;
    static constexpr int BWD_BC = ES == 2 && DP <= 64 ? 64 : 32;
    static constexpr int FWD_SMEM = (FWD_ROWS + 2 * NBUF * FWD_BC) * SD * ES;
    // bwd_q: two row tiles per warp measured 7% faster at DP 112, 3% slower at 128.
    static constexpr int BQ_MT = ES == 2 && DP > 64 && DP < 128 ? 2 : 1;
    static constexpr int BQ_ROWS = NT / 32 * 16 * BQ_MT;
    static constexpr int BQ_SMEM = (2 * BQ_ROWS + 2 * NBUF * BWD_BC) * SD * ES + 2 * BQ_ROWS * 4;
    // bwd_kv streams q and go tiles; D_i comes from bwd_q (the op's delta output).
    static constexpr int BKV_SMEM = (2 * BR + 2 * NBUF * BWD_BC) * SD * ES + 2 * BWD_BC * 4;
    static_assert(DP % 16 == 0 && FWD_BC % 16 == 0 && BWD_BC % 16 == 0, "whole fragments");
    static_assert(!WIDE || (DP == 256 && ES == 2), "wide heads: 16-bit storage padded to 256");
};

// The widest copy (elements of ES bytes, at most 16 bytes) that both the rows
// (D elements apart) and the base allow.
template <int ES> __device__ __forceinline__ int vec_of(const void* p, int D) {
    const unsigned long long a = (unsigned long long)p;
    for (int v = 16 / ES; v > 1; v >>= 1)
        if (D % v == 0 && a % (unsigned long long)(v * ES) == 0) return v;
    return 1;
}

// Rows t0..t0+ROWS of one head (row t at g + t·stride, D elements) into s
// [ROWS][SD], zero past T and past D up to DP; by cp.async of V elements.
template <int V, int ROWS, int DP, int SD, typename E>
__device__ __forceinline__ void tile_v(E* s, const E* g, int t0, int Tn, long long stride, int D) {
    constexpr int CH = DP / V;
    for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
        const int r = i / CH, c = (i - r * CH) * V;
        const bool ok = t0 + r < Tn && c < D;
        const E* src = ok ? g + (long long)(t0 + r) * stride + c : g;
        E* dst = s + r * SD + c;
        if constexpr (V * sizeof(E) < 4)
            *dst = ok ? *src : (E)0;  // 2-byte rows: cp.async copies 4, 8 or 16 bytes
        else
            cp_async<V * sizeof(E)>(dst, src, ok);
    }
}
template <int ROWS, int DP, int SD, typename E>
__device__ __forceinline__ void tile(E* s, const void* g, int vec, int t0, int Tn, long long stride, int D) {
    const E* p = (const E*)g;
    if constexpr (sizeof(E) == 2) {
        if (vec == 8) return tile_v<8, ROWS, DP, SD>(s, p, t0, Tn, stride, D);
    }
    if (vec == 4) return tile_v<4, ROWS, DP, SD>(s, p, t0, Tn, stride, D);
    if (vec == 2) return tile_v<2, ROWS, DP, SD>(s, p, t0, Tn, stride, D);
    tile_v<1, ROWS, DP, SD>(s, p, t0, Tn, stride, D);
}

__device__ __forceinline__ unsigned dynamic_smem() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
// The host computes the geometry from the same constants; a launch that
// disagrees would skip rows or overrun shared memory, so it traps.
__device__ __forceinline__ void check_launch(int rows, int Tn, int smem, int threads = NT) {
    if ((int)gridDim.x != (Tn + rows - 1) / rows || (int)blockDim.x != threads || (int)dynamic_smem() < smem) __trap();
}

// Ls[i] = lse·log2(e) and Ds[i] = go·o − glse for the n rows t0.. (zero past
// T; Ds also into delta when it is not null); NT/N neighbouring threads per row over dims, summed in a fixed order.
template <typename T, int N, int NTH = NT>
__device__ __forceinline__ void row_stats(float* Ls, float* Ds, int t0, const T* o, const T* go, const float* lse,
                                          const float* glse, float* delta, long long stride, long long stat, int Tn,
                                          int D) {
    constexpr int PER = NTH / N;
    const int i = threadIdx.x / PER, part = threadIdx.x % PER, t = t0 + i;
    float sum = 0.f;
    if (t < Tn)
        for (int d = part; d < D; d += PER) sum += load(go, (long long)t * stride + d) * load(o, (long long)t * stride + d);
#pragma unroll
    for (int off = PER / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (part == 0) {
        Ls[i] = t < Tn ? lse[stat + t] * SGM_LOG2E : 0.f;
        Ds[i] = t < Tn ? sum - (glse ? glse[stat + t] : 0.f) : 0.f;
        if (delta && t < Tn) delta[stat + t] = Ds[i];
    }
}

// Rows row0 and row0 + 8 of a warp's accumulator tiles (the lane's columns
// 8n + 2c and + 1 of each of NO tiles; acc laid out as [NO][4] floats),
// times sc, into rows of base (stride elements apart); rows past T and
// columns past D are skipped. With base2, acc2 and sc2 (gk and gv) a second
// set of tiles goes to the same places of base2, element by element with the
// first (as separate passes the key side's d128 pass spilled more).
template <int NO, typename T>
__device__ __forceinline__ void store_rows(T* base, long long stride, int row0, int Tn, int D, int c, const float* acc,
                                           float sc, T* base2 = nullptr, const float* acc2 = nullptr,
                                           float sc2 = 1.f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= Tn) continue;
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = n * 8 + 2 * c + e;
                if (d >= D) continue;
                store(base, (long long)row * stride + d, acc[4 * n + 2 * r + e] * sc);
                if (base2) store(base2, (long long)row * stride + d, acc2[4 * n + 2 * r + e] * sc2);
            }
    }
}

// The two product shapes of every pass, over MT tiles of 16 rows of one
// warp (each B fragment read once, used by every row tile).
// c[m][NC][4] += a[m] · tileᵀ for columns 0..8·NC of a tile stored
// [column][depth] (scores: q·kᵀ, go·vᵀ, k·qᵀ, v·goᵀ), at depth slice k0.
template <class Tc, int SD, int NC, int MT>
__device__ __forceinline__ void mma_nk(float (*c)[NC][4], const typename Tc::A* a, const typename Tc::E* tile, int k0,
                                       int lane) {
#pragma unroll
    for (int np = 0; np < NC / 2; ++np) {
        typename Tc::B bf;
        Tc::template load_b_nk<SD>(bf, tile, np * 16, k0, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            Tc::mma(c[mt][2 * np], a[mt], bf, 0);
            Tc::mma(c[mt][2 * np + 1], a[mt], bf, 1);
        }
    }
}
// acc[m][DP/8][4] += a[m] · tile[k0..k0+KS, 0..DP] for a tile stored
// [depth][dim] (p·v, ds·k, pᵀ·go, dsᵀ·q).
template <class Tc, int SD, int DP, int MT>
__device__ __forceinline__ void mma_kn(float (*acc)[DP / 8][4], const typename Tc::A* a, const typename Tc::E* tile,
                                       int k0, int lane) {
#pragma unroll
    for (int np = 0; np < DP / 16; ++np) {
        typename Tc::B bf;
        Tc::template load_b_kn<SD>(bf, tile, k0, np * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            Tc::mma(acc[mt][2 * np], a[mt], bf, 0);
            Tc::mma(acc[mt][2 * np + 1], a[mt], bf, 1);
        }
    }
}
// One row tile (the backward passes).
template <class Tc, int SD, int NC>
__device__ __forceinline__ void mma_nk1(float (*c)[4], const typename Tc::A& a, const typename Tc::E* tile, int k0,
                                        int lane) {
    mma_nk<Tc, SD, NC, 1>(reinterpret_cast<float(*)[NC][4]>(c), &a, tile, k0, lane);
}
template <class Tc, int SD, int DP>
__device__ __forceinline__ void mma_kn1(float (*acc)[4], const typename Tc::A& a, const typename Tc::E* tile, int k0,
                                        int lane) {
    mma_kn<Tc, SD, DP, 1>(reinterpret_cast<float(*)[DP / 8][4]>(acc), &a, tile, k0, lane);
}

// ---------------------------------------------------------------------------
// Forward: the block owns FWD_ROWS query rows (16·FWD_MT per warp) and walks
// the key tiles from the one holding its first row's first key up to the
// diagonal with an online softmax. (Skipping the tiles wholly after a warp's
// rows and masking only diagonal tiles was tried: exact, but slower as
// measured: the branches cost more than the work. So every tile is masked.)
// ---------------------------------------------------------------------------
template <typename T, int DP>
__device__ void fwd(const T* q, const T* k, const T* v, T* o, float* lse, int Tn, int Hq, int Hkv, int D,
                    double scale, const SgKeys keys) {
    typedef Geo<T, DP> G;
    typedef typename G::Tc Tc;
    typedef typename G::E E;
    typedef typename Tc::A FA;
    constexpr int SD = G::SD, BC = G::FWD_BC, KS = Tc::KS, KT = DP / KS, NO = DP / 8, NS = BC / 8, NB = G::NBUF;
    constexpr int MT = G::FWD_MT, ROWS = G::FWD_ROWS;
    // Hold the warp's q fragments in registers when they fit (one row tile).
    constexpr bool HOLD = G::HOLD && MT == 1;
    // With two row tiles (or wide heads) the depth loop of q·kᵀ stays
    // rolled: unrolled, the compiler hoists every depth slice's fragments
    // and spills.
    constexpr int KK_UNROLL = MT == 1 && !G::WIDE ? KT : 1;
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    E* const Qs = reinterpret_cast<E*>(smem_bytes);
    E* const Ks = Qs + ROWS * SD;     // NB buffers of BC rows
    E* const Vs = Ks + NB * BC * SD;  // NB buffers of BC rows
    check_launch(ROWS, Tn, G::FWD_SMEM);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;  // longest rows first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
    const int q0 = qt * ROWS;
    const long long qs = (long long)Hq * D, ks = (long long)Hkv * D;
    const T* const qb = q + (long long)b * Tn * qs + (long long)h * D;
    const T* const kb = k + (long long)b * Tn * ks + (long long)hk * D;
    const T* const vb = v + (long long)b * Tn * ks + (long long)hk * D;
    const int vk = vec_of<G::ES>(k, D), vv = vec_of<G::ES>(v, D);
    // Key tiles j0..ntiles − 1: no row of the block sees a key before its
    // first row's first key.
    const int last = min(q0 + ROWS, Tn) - 1, j0 = keys.first(b, Tn, q0) / BC, ntiles = last / BC + 1;
    const float c2 = (float)(scale * 1.4426950408889634074);
    // Soft-capped scores are already in base 2 when they are masked (f2 = 1).
    const bool cap = keys.softcap > 0;
    const float sc = (float)scale, f2 = cap ? 1.f : c2;
    auto issue = [&](int j, int buf) {
        tile<BC, DP, SD>(Ks + buf * BC * SD, kb, vk, j * BC, Tn, ks, D);
        tile<BC, DP, SD>(Vs + buf * BC * SD, vb, vv, j * BC, Tn, ks, D);
    };

    tile<ROWS, DP, SD>(Qs, qb, vec_of<G::ES>(q, D), q0, Tn, qs, D);
    issue(j0, j0 % NB);  // tile j lives in buffer j % NB
    cp_commit();

    // This warp's rows: w0.. (a lane's rows: w0 + 16·mt + g and + 8).
    const int w0 = q0 + warp * 16 * MT;
    FA qf[HOLD ? KT : 1];
    float acc[MT][NO][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NO; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
    // m stays −∞ while every key a row has met was masked (its first key
    // lies in a later tile); it is finite once the row meets itself.
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
    // The keys a lane's rows see: lo..hi, hi the row itself or T − 1 past
    // T (so `key > hi` is the causal mask and the mask past T in one).
    int lo[MT][2], hi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + mt * 16 + g + r * 8;
            hi[mt][r] = min(row, Tn - 1);
            lo[mt][r] = row < Tn ? keys.first(b, Tn, row) : 0;
        }

    for (int j = j0; j < ntiles; ++j) {
        if (NB == 2 && j + 1 < ntiles) {
            issue(j + 1, (j + 1) & 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        if constexpr (HOLD) {
            if (j == j0) {
#pragma unroll
                for (int kk = 0; kk < KT; ++kk) Tc::template load_a<SD>(qf[kk], Qs, warp * 16, kk * KS, lane);
            }
        }
        const E* const Kt = Ks + (j % NB) * BC * SD;
        const E* const Vt = Vs + (j % NB) * BC * SD;
        const int k0 = j * BC;
        float s[MT][NS][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll KK_UNROLL
        for (int kk = 0; kk < KT; ++kk) {
            FA qa[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (HOLD)
                    qa[mt] = qf[kk];
                else
                    Tc::template load_a<SD>(qa[mt], Qs, warp * 16 * MT + mt * 16, kk * KS, lane);
            }
            mma_nk<Tc, SD, NS, MT>(s, qa, Kt, kk * KS, lane);
        }

        // Soft-cap (natural units) and go to base 2; then scale by f2 and
        // mask the keys outside lo..hi.
        if (cap) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NS; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][n][e] = sg_cap(s[mt][n][e] * sc, keys.softcap) * SGM_LOG2E;
        }
        float mx[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mx[mt][0] = mx[mt][1] = -INFINITY;
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + n * 8 + 2 * c + (e & 1);
                    const bool out = key > hi[mt][e >> 1] || key < lo[mt][e >> 1];
                    const float x = out ? -INFINITY : s[mt][n][e] * f2;
                    s[mt][n][e] = x;
                    mx[mt][e >> 1] = fmaxf(mx[mt][e >> 1], x);
                }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // mr: the new maximum, or 0 for a row with no key yet (so that
            // exp2 gets −∞ rather than −∞ − (−∞)).
            float alpha[2], sum[2] = {0.f, 0.f}, mr[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float x = mx[mt][r];
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
                const float mn = fmaxf(m[mt][r], x);
                mr[r] = mn == -INFINITY ? 0.f : mn;
                alpha[r] = exp2f(m[mt][r] - mr[r]);
                m[mt][r] = mn;
            }
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = exp2f(s[mt][n][e] - mr[e >> 1]);
                    s[mt][n][e] = p;
                    sum[e >> 1] += p;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) l[mt][r] = l[mt][r] * alpha[r] + sum[r];
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                acc[mt][n][0] *= alpha[0];
                acc[mt][n][1] *= alpha[0];
                acc[mt][n][2] *= alpha[1];
                acc[mt][n][3] *= alpha[1];
            }
        }

        // acc += p · v.
#pragma unroll
        for (int kc = 0; kc < BC / KS; ++kc) {
            FA pa[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Tc::a_from_c(pa[mt], &s[mt][kc * (KS / 8)]);
            mma_kn<Tc, SD, DP, MT>(acc, pa, Vt, kc * KS, lane);
        }
        __syncthreads();  // this tile's buffer is refilled next
        if (NB == 1 && j + 1 < ntiles) {
            issue(j + 1, 0);
            cp_commit();
        }
    }

    T* const ob = o + (long long)b * Tn * qs + (long long)h * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        // The row sums were kept per lane; add the four lanes of a row (fixed order).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
            l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 2);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + mt * 16 + g + r * 8;
            if (row >= Tn) continue;
            const float inv = 1.f / l[mt][r];
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                const int d = n * 8 + 2 * c;
                if (d < D) store(ob, (long long)row * qs + d, acc[mt][n][2 * r] * inv);
                if (d + 1 < D) store(ob, (long long)row * qs + d + 1, acc[mt][n][2 * r + 1] * inv);
            }
            if (c == 0) lse[((long long)b * Hq + h) * Tn + row] = (m[mt][r] + log2f(l[mt][r])) * SGM_LN2;
        }
    }
}

// ---------------------------------------------------------------------------
// Backward, query side: the block owns BQ_ROWS query rows and walks the key tiles
// from the one holding its first row's first key up to the diagonal:
// gq = scale · Σ_j p_ij (go_i·v_j − D_i) k_j (ds times the cap's slope
// with a soft-cap). It runs
// first and stores its rows' D_i = go_i·o_i − glse_i in delta for bwd_kv
// (which otherwise streamed o tiles to recompute them for every key block:
// a third more tile traffic and a dot product per step; 24% of its time).
// ---------------------------------------------------------------------------
template <typename T, int DP>
__device__ void bwd_q(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* go,
                      const float* glse, T* gq, float* delta, int Tn, int Hq, int Hkv, int D, double scale,
                      const SgKeys keys) {
    typedef Geo<T, DP> G;
    typedef typename G::Tc Tc;
    typedef typename G::E E;
    typedef typename Tc::A FA;
    constexpr int SD = G::SD, BC = G::BWD_BC, KS = Tc::KS, KT = DP / KS, NO = DP / 8, NS = BC / 8, NB = G::NBUF;
    constexpr int MT = G::BQ_MT, ROWS = G::BQ_ROWS;
    // One row tile: q and go fragments held in registers; two (or wide
    // heads): re-read per depth slice, the depth loop rolled (as in the forward).
    constexpr bool HOLD = G::HOLD && MT == 1;
    constexpr int KK_UNROLL = MT == 1 && !G::WIDE ? KT : 1;
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    E* const Qs = reinterpret_cast<E*>(smem_bytes);
    E* const Gs = Qs + ROWS * SD;
    E* const Ks = Gs + ROWS * SD;     // NB buffers
    E* const Vs = Ks + NB * BC * SD;  // NB buffers
    float* const Ls = reinterpret_cast<float*>(Vs + NB * BC * SD);
    float* const Ds = Ls + ROWS;
    check_launch(ROWS, Tn, G::BQ_SMEM);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
    const int q0 = qt * ROWS;
    const long long qs = (long long)Hq * D, ks = (long long)Hkv * D;
    const long long qoff = (long long)b * Tn * qs + (long long)h * D;
    const T* const kb = k + (long long)b * Tn * ks + (long long)hk * D;
    const T* const vb = v + (long long)b * Tn * ks + (long long)hk * D;
    const int vk = vec_of<G::ES>(k, D), vv = vec_of<G::ES>(v, D);
    // Key tiles j0..ntiles − 1, as in the forward.
    const int last = min(q0 + ROWS, Tn) - 1, j0 = keys.first(b, Tn, q0) / BC, ntiles = last / BC + 1;
    const float c2 = (float)(scale * 1.4426950408889634074);
    // With a soft-cap the scores are in base 2 and dp holds the cap's
    // slope times dp − D_i before the shared pointwise step (f2 = 1, dm = 0).
    const bool cap = keys.softcap > 0;
    const float sc = (float)scale, f2 = cap ? 1.f : c2, dm = cap ? 0.f : 1.f;
    auto issue = [&](int j, int buf) {
        tile<BC, DP, SD>(Ks + buf * BC * SD, kb, vk, j * BC, Tn, ks, D);
        tile<BC, DP, SD>(Vs + buf * BC * SD, vb, vv, j * BC, Tn, ks, D);
    };

    tile<ROWS, DP, SD>(Qs, q + qoff, vec_of<G::ES>(q, D), q0, Tn, qs, D);
    tile<ROWS, DP, SD>(Gs, go + qoff, vec_of<G::ES>(go, D), q0, Tn, qs, D);
    issue(j0, j0 % NB);  // tile j lives in buffer j % NB
    cp_commit();
    row_stats<T, ROWS>(Ls, Ds, q0, o + qoff, go + qoff, lse, glse, delta, qs, ((long long)b * Hq + h) * Tn, Tn, D);

    FA qf[HOLD ? KT : 1], gf[HOLD ? KT : 1];
    float acc[MT][NO][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NO; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
    const int w0 = q0 + warp * 16 * MT;  // this warp's rows (a lane's: w0 + 16·mt + g and + 8)
    float Lr[MT][2], Dr[MT][2];
    // The keys a lane's rows see: lo..hi (as in the forward).
    int lo[MT][2], hi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = w0 + mt * 16 + g + r * 8;
            hi[mt][r] = min(row, Tn - 1);
            lo[mt][r] = row < Tn ? keys.first(b, Tn, row) : 0;
        }

    for (int j = j0; j < ntiles; ++j) {
        if (NB == 2 && j + 1 < ntiles) {
            issue(j + 1, (j + 1) & 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        if (j == j0) {
            if constexpr (HOLD) {
#pragma unroll
                for (int kk = 0; kk < KT; ++kk) {
                    Tc::template load_a<SD>(qf[kk], Qs, warp * 16, kk * KS, lane);
                    Tc::template load_a<SD>(gf[kk], Gs, warp * 16, kk * KS, lane);
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    Lr[mt][r] = Ls[warp * 16 * MT + mt * 16 + g + r * 8];
                    Dr[mt][r] = Ds[warp * 16 * MT + mt * 16 + g + r * 8];
                }
        }
        const E* const Kt = Ks + (j % NB) * BC * SD;
        const E* const Vt = Vs + (j % NB) * BC * SD;
        const int k0 = j * BC;

        float s[MT][NS][4], dp[MT][NS][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = dp[mt][n][e] = 0.f;
#pragma unroll KK_UNROLL
        for (int kk = 0; kk < KT; ++kk) {
            FA qa[MT], ga[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (HOLD) {
                    qa[mt] = qf[kk];
                    ga[mt] = gf[kk];
                } else {
                    Tc::template load_a<SD>(qa[mt], Qs, warp * 16 * MT + mt * 16, kk * KS, lane);
                    Tc::template load_a<SD>(ga[mt], Gs, warp * 16 * MT + mt * 16, kk * KS, lane);
                }
            }
            mma_nk<Tc, SD, NS, MT>(s, qa, Kt, kk * KS, lane);
            mma_nk<Tc, SD, NS, MT>(dp, ga, Vt, kk * KS, lane);
        }
        // With a soft-cap: the capped score x (natural units) in base 2 into
        // s, and (dp − D_i)·slope(x) into dp. (As one pass with the one below
        // the cap's temporaries crowded registers: d48's rose from 143 to 226.)
        if (cap) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NS; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float x = sg_cap(s[mt][n][e] * sc, keys.softcap);
                        const float di = Dr[mt][e >> 1];
                        s[mt][n][e] = x * SGM_LOG2E;
                        dp[mt][n][e] = (dp[mt][n][e] - di) * sg_cap_slope(x, keys.softcap);
                    }
        }
        // ds = p · (dp − D_i), p = exp2(s·scale·log2 e − L_i), zero outside lo..hi.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + n * 8 + 2 * c + (e & 1);
                    const bool out = key > hi[mt][e >> 1] || key < lo[mt][e >> 1];
                    const float p = out ? 0.f : exp2f(s[mt][n][e] * f2 - Lr[mt][e >> 1]);
                    s[mt][n][e] = p * (dp[mt][n][e] - Dr[mt][e >> 1] * dm);
                }
        // acc += ds · k.
#pragma unroll
        for (int kc = 0; kc < BC / KS; ++kc) {
            FA da[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Tc::a_from_c(da[mt], &s[mt][kc * (KS / 8)]);
            mma_kn<Tc, SD, DP, MT>(acc, da, Kt, kc * KS, lane);
        }
        __syncthreads();
        if (NB == 1 && j + 1 < ntiles) {
            issue(j + 1, 0);
            cp_commit();
        }
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) store_rows<NO>(gq + qoff, qs, w0 + mt * 16 + g, Tn, D, c, acc[mt][0], (float)scale);
}

// ---------------------------------------------------------------------------
// Backward, key side: the block owns 64 key rows of one kv head and walks the
// query heads of its group, then their query tiles from the diagonal to the
// one holding the last query that sees its last key (last_query()):
// gv_j = Σ_i p_ij go_i, gk_j = scale · Σ_i p_ij (go_i·v_j − D_i) q_i, with
// D_i from bwd_q (delta; o and glse are not read). Scores are computed
// transposed (keys × queries) so that they are A operands. For wide heads
// grid y is kv heads × KV_SPLIT: the block's part of it says which
// DP / KV_SPLIT columns of gk and gv it owns.
// ---------------------------------------------------------------------------
template <typename T, int DP>
__device__ void bwd_kv(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* go,
                       const float* glse, const float* delta, T* gk, T* gv, int Tn, int Hq, int Hkv, int D,
                       double scale, const SgKeys keys) {
    typedef Geo<T, DP> G;
    typedef typename G::Tc Tc;
    typedef typename G::E E;
    typedef typename Tc::A FA;
    constexpr int SD = G::SD, BQ = G::BWD_BC, KS = Tc::KS, KT = DP / KS, NB = G::NBUF;
    constexpr int DO = DP / G::KV_SPLIT, NO = DO / 8, NS = BQ / 8;  // DO: output columns of this block
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    E* const Ks = reinterpret_cast<E*>(smem_bytes);
    E* const Vs = Ks + BR * SD;
    E* const Qs = Vs + BR * SD;       // NB buffers of BQ rows
    E* const Gs = Qs + NB * BQ * SD;  // NB buffers
    float* const Ls = reinterpret_cast<float*>(Gs + NB * BQ * SD);
    float* const Ds = Ls + BQ;
    check_launch(BR, Tn, G::BKV_SMEM);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int hk = blockIdx.y / G::KV_SPLIT, b = blockIdx.z, grp = Hq / Hkv;
    const int d0 = blockIdx.y % G::KV_SPLIT * DO;  // this block's first output column
    const int k0 = blockIdx.x * BR;  // the first blocks have the most query tiles: launched first
    const long long qs = (long long)Hq * D, ks = (long long)Hkv * D;
    const long long koff = (long long)b * Tn * ks + (long long)hk * D;
    const int vq = vec_of<G::ES>(q, D), vg = vec_of<G::ES>(go, D);
    // Query tiles first..nq − 1 of each head: the diagonal's, up to the one
    // holding the last query that sees the block's last key (last_query()
    // never decreases along the keys).
    const int kl = min(k0 + BR, Tn) - 1, nq = keys.last_query(b, Tn, kl) / BQ + 1;
    const int first = k0 / BQ, per_head = nq - first, steps = grp * per_head;
    const float c2 = (float)(scale * 1.4426950408889634074);
    // With a soft-cap the scores are in base 2 and dp holds the cap's
    // slope times dp − D_i before the shared pointwise step (f2 = 1, dm = 0).
    const bool cap = keys.softcap > 0;
    const float sc = (float)scale, f2 = cap ? 1.f : c2, dm = cap ? 0.f : 1.f;

    tile<BR, DP, SD>(Ks, k + koff, vec_of<G::ES>(k, D), k0, Tn, ks, D);
    tile<BR, DP, SD>(Vs, v + koff, vec_of<G::ES>(v, D), k0, Tn, ks, D);
    auto issue = [&](int step, int buf) {
        const int h = hk * grp + step / per_head, t0 = (first + step % per_head) * BQ;
        const long long qoff = (long long)b * Tn * qs + (long long)h * D;
        tile<BQ, DP, SD>(Qs + buf * BQ * SD, q + qoff, vq, t0, Tn, qs, D);
        tile<BQ, DP, SD>(Gs + buf * BQ * SD, go + qoff, vg, t0, Tn, qs, D);
    };
    issue(0, 0);
    cp_commit();

    float dk[NO][4], dv[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
    const int key0 = k0 + warp * 16 + g;  // this lane's keys: key0, key0 + 8
    // The queries that see this lane's keys: key..lq (lq < T, so `query >
    // lq` is also the mask past T).
    const int lq[2] = {keys.last_query(b, Tn, key0), keys.last_query(b, Tn, key0 + 8)};

    for (int st = 0; st < steps; ++st) {
        const int buf = st % NB;
        const int h = hk * grp + st / per_head, t0 = (first + st % per_head) * BQ;
        // This step's row terms, loaded while the tiles arrive.
        constexpr int PER = NT / BQ;  // neighbouring threads per row of the row terms
        const int ri = threadIdx.x / PER, part = threadIdx.x % PER, rt = t0 + ri;
        float lse_r = 0.f, delta_r = 0.f;
        if (part == 0 && rt < Tn) {
            const long long stat = ((long long)b * Hq + h) * Tn;
            lse_r = lse[stat + rt];
            delta_r = delta[stat + rt];
        }
        if (NB == 2 && st + 1 < steps) {
            issue(st + 1, buf ^ 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const E* const Qt = Qs + buf * BQ * SD;
        const E* const Gt = Gs + buf * BQ * SD;
        // L_i, and D_i = go_i·o_i − glse_i of this step's rows (bwd_q's).
        if (part == 0) {
            Ls[ri] = rt < Tn ? lse_r * SGM_LOG2E : 0.f;
            Ds[ri] = rt < Tn ? delta_r : 0.f;
        }
        __syncthreads();
        const float* const Lt = Ls;
        const float* const Dt = Ds;

        // sᵀ = k·qᵀ and dpᵀ = v·goᵀ, [16 keys × BQ queries] per warp.
        float s[NS][4], dp[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
        auto scores = [&](int kk) {
            FA ka, va;
            Tc::template load_a<SD>(ka, Ks, warp * 16, kk * KS, lane);
            Tc::template load_a<SD>(va, Vs, warp * 16, kk * KS, lane);
            mma_nk1<Tc, SD, NS>(s, ka, Qt, kk * KS, lane);
            mma_nk1<Tc, SD, NS>(dp, va, Gt, kk * KS, lane);
        };
        if constexpr (G::WIDE) {
#pragma unroll 4
            for (int kk = 0; kk < KT; ++kk) scores(kk);  // fully unrolled, the wide depth loop spills
        } else {
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) scores(kk);
        }
        // With a soft-cap: the capped score x (natural units) in base 2 into
        // s, and (dp − D_i)·slope(x) into dp (as in bwd_q).
        if (cap) {
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qi = n * 8 + 2 * c + (e & 1);
                    const float x = sg_cap(s[n][e] * sc, keys.softcap);
                    s[n][e] = x * SGM_LOG2E;
                    dp[n][e] = (dp[n][e] - Dt[qi]) * sg_cap_slope(x, keys.softcap);
                }
        }
        // pᵀ into s, dsᵀ into dp; zero where the query precedes the key or
        // is past lq. (dp − D_i·dm is dp − D_i exactly where dm = 1.)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = n * 8 + 2 * c + (e & 1), query = t0 + qi, key = key0 + (e >> 1) * 8;
                const float p = query < key || query > lq[e >> 1] ? 0.f : exp2f(s[n][e] * f2 - Lt[qi]);
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - Dt[qi] * dm);
            }
        // gv += pᵀ·go, gk += dsᵀ·q.
#pragma unroll
        for (int kc = 0; kc < BQ / KS; ++kc) {
            FA pa, da;
            Tc::a_from_c(pa, &s[kc * (KS / 8)]);
            Tc::a_from_c(da, &dp[kc * (KS / 8)]);
            mma_kn1<Tc, SD, DO>(dv, pa, Gt + d0, kc * KS, lane);
            mma_kn1<Tc, SD, DO>(dk, da, Qt + d0, kc * KS, lane);
        }
        __syncthreads();  // buffers of this step are refilled next
        if (NB == 1 && st + 1 < steps) {
            issue(st + 1, 0);
            cp_commit();
        }
    }

    store_rows<NO>(gk + koff + d0, ks, key0, Tn, D - d0, c, dk[0], (float)scale, gv + koff + d0, dv[0]);
}

#ifdef SGM_WGMMA
// ---------------------------------------------------------------------------
// Hopper (sm_90a) key-side backward: the same pass as bwd_kv (same grid,
// same results up to summation order), with warpgroup MMA. The block is one
// warpgroup owning 64 key rows; per step it takes 64 query rows:
//   sᵀ = k·qᵀ and dpᵀ = v·goᵀ       wgmma m64n64k16, both operands in shared memory
//   gv += pᵀ·go, gk += dsᵀ·q        wgmma m64nDPk16, pᵀ and dsᵀ from registers
// Every tile is stored in the canonical no-swizzle layout of 8 × 16-byte
// core matrices: element (r, k) of a [rows][DP] tile at byte
//   (r/8)·16·DP + (k/8)·128 + (r%8)·16 + (k%8)·2,
// so one tile serves as a K-major operand (q and go as the B of the scores,
// k and v as their A) and, read with the transpose bit, as an MN-major one
// (q and go as the B of the gradient products). Descriptor offsets as
// scripts/wgmma-spike measured on the H200: the leading byte offset is the
// stride between core matrices along K, the stride byte offset along M/N.
// A warp's rows of a wgmma accumulator are laid out as mma.sync's C tiles,
// so pᵀ and dsᵀ become A operands without leaving registers (a_from_c).
// ---------------------------------------------------------------------------
typedef unsigned long long u64;

template <typename T> struct WgTy;
template <> struct WgTy<__nv_bfloat16> {
    static constexpr bool BF16 = true;
};
template <> struct WgTy<__half> {
    static constexpr bool BF16 = false;
};
// The two shapes the passes use: the 64 × 64 scores from shared memory
// (Wg<64>::ss) and the DP-wide gradient products with A from registers
// (Wg<DP>::rs_t). Operand lists written out (inline asm cannot loop over
// registers).
template <int N> struct Wg;
template <> struct Wg<64> {
    // d[32] = A·B (ACC = 0) or d[32] += A·B, A and B from shared memory, both K-major.
    template <typename T, int ACC = 1> static __device__ __forceinline__ void ss(float* d, u64 a, u64 b) {
        // ACC = 0 writes d without reading it ("=f"): its old values are dead,
        // so the compiler need not keep or move them while wgmma runs.
        if constexpr (ACC == 0 && WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]) : "l"(a), "l"(b));
        else if constexpr (ACC == 0)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]) : "l"(a), "l"(b));
        else if constexpr (WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "l"(a), "l"(b));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "l"(a), "l"(b));
    }
};
template <> struct Wg<80> {
    // d[40] (+)= A·B (ACC as Wg<64>::ss), A from registers (mma.sync's A-fragment layout per warp), B
    // MN-major in shared memory.
    template <typename T, int ACC = 1> static __device__ __forceinline__ void rs_t(float* d, const u32* a, u64 b) {
        if constexpr (ACC == 0 && WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, {%40,%41,%42,%43}, %44, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (ACC == 0)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, {%40,%41,%42,%43}, %44, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, {%40,%41,%42,%43}, %44, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, {%40,%41,%42,%43}, %44, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
};
template <> struct Wg<96> {
    // d[48] (+)= A·B (ACC as Wg<64>::ss), A from registers (mma.sync's A-fragment layout per warp), B
    // MN-major in shared memory.
    template <typename T, int ACC = 1> static __device__ __forceinline__ void rs_t(float* d, const u32* a, u64 b) {
        if constexpr (ACC == 0 && WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, {%48,%49,%50,%51}, %52, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (ACC == 0)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, {%48,%49,%50,%51}, %52, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, {%48,%49,%50,%51}, %52, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, {%48,%49,%50,%51}, %52, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
};
template <> struct Wg<112> {
    // d[56] (+)= A·B (ACC as Wg<64>::ss), A from registers (mma.sync's A-fragment layout per warp), B
    // MN-major in shared memory.
    template <typename T, int ACC = 1> static __device__ __forceinline__ void rs_t(float* d, const u32* a, u64 b) {
        if constexpr (ACC == 0 && WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}, {%56,%57,%58,%59}, %60, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (ACC == 0)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n112k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}, {%56,%57,%58,%59}, %60, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}, {%56,%57,%58,%59}, %60, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n112k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}, {%56,%57,%58,%59}, %60, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
};
template <> struct Wg<128> {
    // d[64] (+)= A·B as Wg<64>::ss (the forward's scores over 128 keys).
    template <typename T, int ACC = 1> static __device__ __forceinline__ void ss(float* d, u64 a, u64 b) {
        // ACC = 0 writes d without reading it ("=f"): its old values are dead,
        // so the compiler need not keep or move them while wgmma runs.
        if constexpr (ACC == 0 && WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]) : "l"(a), "l"(b));
        else if constexpr (ACC == 0)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]) : "l"(a), "l"(b));
        else if constexpr (WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "l"(a), "l"(b));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "l"(a), "l"(b));
    }
    // d[64] (+)= A·B (ACC as Wg<64>::ss), A from registers (mma.sync's A-fragment layout per warp), B
    // MN-major in shared memory.
    template <typename T, int ACC = 1> static __device__ __forceinline__ void rs_t(float* d, const u32* a, u64 b) {
        if constexpr (ACC == 0 && WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (ACC == 0)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                         : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else if constexpr (WgTy<T>::BF16)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
};

// A no-swizzle matrix descriptor (addresses and offsets in 16-byte units).
__device__ __forceinline__ u64 wg_desc(const void* p, u32 lbo, u32 sbo) {
    return (u64)((smem_addr(p) >> 4) & 0x3fff) | ((u64)((lbo >> 4) & 0x3fff) << 16) |
           ((u64)((sbo >> 4) & 0x3fff) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Generic-proxy writes (cp.async, stores) made visible to wgmma's reads.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Rows t0..t0+ROWS of one head into a core-matrix tile, zero past T and past
// D up to DP, by NTH threads (this one is `tid`). Lanes 8i..8i+7 take rows
// 0..7 of one core matrix column, so a warp's shared writes are 512
// contiguous bytes. Used for copies of 2 and 4 bytes (heads whose rows
// allow no wider); wider copies take tile_cm_slabs.
template <int V, int ROWS, int DP, int NTH, typename E>
__device__ __forceinline__ void tile_cm_v(unsigned char* s, const E* g, int t0, int Tn, long long stride, int D,
                                          int tid, int lo) {
    constexpr int CH = DP / V;
    for (int i = tid; i < ROWS * CH; i += NTH) {
        const int j = i >> 3, r = (j / CH) * 8 + (i & 7), c = (j % CH) * V;
        const bool ok = t0 + r < Tn && c >= lo && c < D + lo;
        const E* src = ok ? g + (long long)(t0 + r) * stride + c - lo : g;
        E* dst = reinterpret_cast<E*>(s + (r >> 3) * (16 * DP) + (c >> 3) * 128 + (r & 7) * 16 + (c & 7) * 2);
        if constexpr (V * sizeof(E) < 4)
            *dst = ok ? *src : (E)0;
        else
            cp_async<V * sizeof(E)>(dst, src, ok);
    }
}
// tile_cm_v for copies of 8 or 16 bytes with a fixed share of the tile per
// thread, so that its addresses are a base and compile-time offsets:
// tile_cm_v's index arithmetic (a division by the chunks per row for every
// copy, in 64 bits) was about half of the warpgroup forward's instructions
// on W5's shape, which issue-bound it. Warp w copies the 8-row groups w,
// w + NTH/32, ... of every column slab of 4 copies; lane 8q + i takes row i
// of the group and copy q of the slab, so a warp's shared writes are 256 or
// 512 contiguous bytes, as tile_cm_v's. The same bytes land in the same
// places as with tile_cm_v.
template <int V, int ROWS, int DP, int NTH, typename E>
__device__ __forceinline__ void tile_cm_slabs(unsigned char* s, const E* g, int t0, int Tn, long long stride, int D,
                                              int tid, int lo) {
    static_assert(V * sizeof(E) == 8 || V * sizeof(E) == 16, "8- or 16-byte copies");
    constexpr int NW = NTH / 32, SLAB = 4 * V, NSLAB = (DP + SLAB - 1) / SLAB;
    static_assert((ROWS / 8) % NW == 0, "whole 8-row groups per warp");
    const int lane = tid & 31, warp = tid >> 5, i = lane & 7, q = lane >> 3;
    const int c = q * V;  // this lane's first column in every slab
    // Byte offset of (row i of group 0, column c) in the core-matrix layout.
    const u32 at = smem_addr(s) + i * 16 + (c >> 3) * 128 + (c & 7) * (int)sizeof(E);
#pragma unroll
    for (int k = 0; k < ROWS / 8 / NW; ++k) {
        const int rg = warp + k * NW, r = rg * 8 + i;
        // Columns this row still has from c on: none past T. A copy of
        // columns outside lo..lo + D reads nothing (source size 0, zeros
        // written), so its address, at most DP − D elements outside the
        // row, is never read either.
        const int left = t0 + r < Tn ? D + lo - c : 0;
        const E* const src = t0 + r < Tn ? g + (long long)(t0 + r) * stride + c - lo : g;
        const u32 dst = at + rg * (16 * DP);
#pragma unroll
        for (int sl = 0; sl < NSLAB; ++sl) {
            if (sl * SLAB + c >= DP) continue;  // past the padded width (the last slab's tail)
            const int n = sl * SLAB < left && sl * SLAB + c >= lo ? V * (int)sizeof(E) : 0;
            const E* const from = src + sl * SLAB;
            const u32 to = dst + sl * (SLAB / 8) * 128;
            if constexpr (V * sizeof(E) == 16)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(n));
            else
                asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(to), "l"(from), "r"(n));
        }
    }
}

// With `lo`, the row's D columns go to tile columns lo..lo + D and the
// tile's first lo columns are zeros too (lo a multiple of vec).
template <int ROWS, int DP, typename E, int NTH = NT>
__device__ __forceinline__ void tile_cm(unsigned char* s, const void* g, int vec, int t0, int Tn, long long stride,
                                        int D, int tid = -1, int lo = 0) {
    const E* p = (const E*)g;
    if (tid < 0) tid = threadIdx.x;
    // Every warpgroup tile (16-bit, 64 or 128 rows by 256 threads) takes
    // the slabs for copies of 8 and 16 bytes.
    if (vec == 8) return tile_cm_slabs<8, ROWS, DP, NTH>(s, p, t0, Tn, stride, D, tid, lo);
    if (vec == 4) return tile_cm_slabs<4, ROWS, DP, NTH>(s, p, t0, Tn, stride, D, tid, lo);
    if (vec == 2) return tile_cm_v<2, ROWS, DP, NTH>(s, p, t0, Tn, stride, D, tid, lo);
    tile_cm_v<1, ROWS, DP, NTH>(s, p, t0, Tn, stride, D, tid, lo);
}

// Descriptor offsets of a core-matrix tile read K-major: 128 bytes along K
// and 16·DP along the rows (wg_scores_issue).
constexpr u32 KM_LBO = 128;

// Issues (without waiting) the two 64 × 64 score products s = a·bᵀ and
// dp = c·dᵀ over DP: a and c core-matrix tiles, b and d streamed 64-row
// tiles as the copy engine lays them out (columns in slabs of 8, each slab
// 64 rows of 16 bytes: core matrices 1024 bytes apart along K and 128
// along the rows). The first depth slice overwrites the accumulators
// (scale-d off) instead of zeroing them: a register written by another
// instruction while an earlier wgmma is still in flight makes ptxas
// serialize the warpgroup's products.
template <typename T, int DP>
__device__ __forceinline__ void wg_scores_issue(float* s, float* dp, const unsigned char* a, const unsigned char* b,
                                                const unsigned char* c, const unsigned char* d) {
    constexpr u32 KM_SBO = 16 * DP, SL_LBO = 64 * 16, SL_SBO = 128;
    wg_fence();
    Wg<64>::template ss<T, 0>(s, wg_desc(a, KM_LBO, KM_SBO), wg_desc(b, SL_LBO, SL_SBO));
    Wg<64>::template ss<T, 0>(dp, wg_desc(c, KM_LBO, KM_SBO), wg_desc(d, SL_LBO, SL_SBO));
#pragma unroll
    for (int kk = 1; kk < DP / 16; ++kk) {
        Wg<64>::template ss<T>(s, wg_desc(a + kk * 256, KM_LBO, KM_SBO), wg_desc(b + kk * 2 * SL_LBO, SL_LBO, SL_SBO));
        Wg<64>::template ss<T>(dp, wg_desc(c + kk * 256, KM_LBO, KM_SBO), wg_desc(d + kk * 2 * SL_LBO, SL_LBO, SL_SBO));
    }
    wg_commit();
}

// A wgmma A fragment (16 rows × 16 of a warp) from two accumulator C tiles,
// as mma.sync's a_from_c.
template <typename T> __device__ __forceinline__ void wg_a_from_c(u32* a, const float* c) {
    a[0] = Mma16<T>::pack(c[0], c[1]);
    a[1] = Mma16<T>::pack(c[2], c[3]);
    a[2] = Mma16<T>::pack(c[4], c[5]);
    a[3] = Mma16<T>::pack(c[6], c[7]);
}

// 2^x for the warpgroup passes: the bare ex2.approx.ftz (2 ulp; results
// below 2^-126, probabilities that add nothing beside the row's largest,
// flush to zero). exp2f's care for those results cost the backward passes
// 7% (W5's shape: 2.17 against 2.01 ms).
__device__ __forceinline__ float wg_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------
// Forward on warpgroup MMA. A block is two consumer warpgroups owning 64
// query rows each (128 in all) and one producer warp. The consumers share
// every 128-key tile of k and v; the producer's first lane brings the tiles
// with the tensor copy engine (TMA, `cp.async.bulk.tensor`) into a ring of
// NST stages handed over by mbarriers (full: the stage's bytes have landed,
// as the copy engine counts them; free: both warpgroups are done reading
// it). So the consumers issue no copies beyond their q tile's, and the
// warpgroups drift apart by up to a tile instead of meeting at a block
// barrier every step. The consumers' 8-byte copies of W5's 200-byte rows
// had kept L1 75% busy and a third of their stalls on it.
//
// Tile layouts, from 3D tensor maps over [B][T][Hkv·D] (the host's
// `fwd_tensor_maps`; rows past T arrive as zeros):
//   k: 128-byte-swizzled boxes of 64 columns × BN rows, one per 64 columns
//      of the head: read K-major as the B of q·kᵀ, 8-row atoms 1024 bytes
//      apart, each 16-deep slice 32 bytes further within its box (the
//      offsets scripts/tma-spike measured);
//   v: unswizzled boxes of 8 columns × BN rows (16 bytes of each row),
//      BN·16 bytes apart: every 8 rows of a box are one core matrix, so the
//      tile is read MN-major as the B of p·v with core matrices 128 bytes
//      apart along the keys and BN·16 along the columns.
// A box's columns past D hold the next head's values (zeros past the row):
// in q·kᵀ they meet q's zero padding, and in p·v they make only accumulator
// columns past D, which are never stored. (A non-finite value there would
// reach this head's scores; it makes its own head's output non-finite
// anyway, since every key is seen by its own row.)
//
// Within a warpgroup the products of neighbouring tiles overlap the softmax:
// step j issues s_j = q·k_jᵀ, then acc += p_{j-1}·v_{j-1}, waits only for
// s_j, runs the online softmax on it while the tensor cores do p·v, then
// waits for p·v before rescaling acc and packing p_j (the registers an
// in-flight wgmma reads or writes are left alone until it completes).
// Results as `fwd` up to summation order. The block walks the key tiles
// from the one holding its first row's first key to the diagonal; steps,
// stages and phase parities count from that tile (step j is tile j0 + j).
// Masks go only where a key can be outside a row's first()..=row: on the
// last tile (the diagonal, and keys past T) and, with a window or
// documents, on the first tiles, those before the first key of the warp's
// last row; the tiles between run unmasked.
// ---------------------------------------------------------------------------
template <int DP> struct WgFwd {
    static constexpr int ROWS = 128, BN = 128, CONSUMERS = 256, THREADS = CONSUMERS + 128, NST = 3;
    static constexpr int KBOX = (DP + 63) / 64;  // 64-column boxes per k tile
    static constexpr int QT = ROWS * DP * 2, KT = KBOX * BN * 128, VT = BN * DP * 2;
    // The swizzled k boxes need 1024-byte alignment: up to 1024 bytes go to
    // aligning the k stages, then the v stages, q and 4·NST + 1 mbarriers.
    static constexpr int SMEM = 1024 + NST * (KT + VT) + QT + (4 * NST + 1) * 8;
};

// A CUtensorMap as the driver encodes it (the host's `TensorMap` argument).
struct __align__(64) TmaMap {
    unsigned long long w[16];
};

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}
// Barriers bars[0..n) of `count` arrivals each, set up by thread 0 before
// any thread of the block uses them.
// The fence makes the barriers' initialization visible to the copy
// engine, which completes its transfers on them.
__device__ __forceinline__ void mbar_init_all(u64* bars, int n, u32 count) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < n; ++i) mbar_init(bars + i, count);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}
// One arrival on bar once every cp.async this thread has issued so far has landed.
__device__ __forceinline__ void mbar_arrive_copies(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Accumulator columns of a shifted tile (see fwd_wg) back in place: out's
// column d is acc's d + shift (shift = 2u, even, below 8). Lane c's
// columns 8n + 2c (and + 1) come from lane (c + u) mod 4, in tile n, or
// n + 1 where c + u passes 4; so a lane c < u hands over its tile n + 1.
// Without a shift every lane takes its own. The whole warp takes part.
template <int NO>
__device__ __forceinline__ void unshift_cols(float* out, const float* acc, int shift) {
    const int lane = threadIdx.x & 31, c = lane & 3, u = shift >> 1, from = (lane & ~3) | ((c + u) & 3);
    const bool next = c < u;
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            out[4 * n + e] =
                __shfl_sync(0xffffffffu, next ? (n + 1 < NO ? acc[4 * n + 4 + e] : 0.f) : acc[4 * n + e], from);
}
// Expects `bytes` more on bar without arriving (the arrivals are the
// threads' own).
__device__ __forceinline__ void mbar_expect_tx_only(u64* bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Expects `bytes` more on bar (the copy engine's completions count them
// down) and arrives once.
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// The box of `map` at coordinates (c0, c1, c2) into dst, completing on bar.
__device__ __forceinline__ void tma_3d(void* dst, const TmaMap* map, u64* bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::
            "r"(smem_addr(dst)),
        "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
// A K-major descriptor into 128-byte-swizzled rows (layout type 1), 8-row
// atoms `sbo` bytes apart; the leading offset is unused in this mode.
__device__ __forceinline__ u64 wg_desc_sw128(const void* p, u32 sbo) {
    return (u64)((smem_addr(p) >> 4) & 0x3fff) | (1ull << 16) | ((u64)((sbo >> 4) & 0x3fff) << 32) | (1ull << 62);
}

template <typename T, int DP>
__device__ void fwd_wg(const T* q, T* o, float* lse, int Tn, int Hq, int Hkv, int D, double scale, const SgKeys keys,
                       const TmaMap* kmap, const TmaMap* vmap) {
    typedef WgFwd<DP> G;
    typedef u16 E;
    constexpr int ROWS = G::ROWS, BN = G::BN, NST = G::NST, KT = G::KT, VT = G::VT, NO = DP / 8, NS = BN / 8;
    constexpr u32 KM_SBO = 16 * DP;
    static_assert(DP % 16 == 0 && DP >= 64 && DP <= 128, "wgmma widths");
    extern __shared__ __align__(128) unsigned char smem_bytes[];
    unsigned char* const Ks = smem_bytes + ((1024 - (smem_addr(smem_bytes) & 1023)) & 1023);  // NST stages
    unsigned char* const Vs = Ks + NST * KT;                                                    // NST stages
    unsigned char* const Qs = Vs + NST * VT;
    u64* const full_k = reinterpret_cast<u64*>(Qs + G::QT);
    u64* const full_v = full_k + NST;
    u64* const free_k = full_k + 2 * NST;
    u64* const free_v = full_k + 3 * NST;
    u64* const q_full = full_k + 4 * NST;
    check_launch(ROWS, Tn, G::SMEM, G::THREADS);

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;  // longest rows first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
    const int q0 = qt * ROWS;
    const long long qs = (long long)Hq * D;
    // ntiles steps over the key tiles j0..=diagonal (step j: tile j0 + j).
    const int last = min(q0 + ROWS, Tn) - 1, j0 = keys.first(b, Tn, q0) / BN, ntiles = last / BN + 1 - j0;
    // The copy engine reads boxes from 16-byte boundaries only, so the
    // boxes start `shift` columns before the head, at the boundary at or
    // before it (the host checks D + shift ≤ DP for every kv head): tile
    // column j holds the head's column j − shift. q's tile is shifted alike
    // (its first shift columns zeros), which leaves q·kᵀ as it was; the
    // output's column d is the accumulator's d + shift.
    const int shift = (hk * D) & 7;

    if (tid == 0) {
        for (int i = 0; i < 2 * NST; ++i) mbar_init(full_k + i, 1);
        for (int i = 2 * NST; i < 4 * NST + 1; ++i) mbar_init(full_k + i, G::CONSUMERS);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid >= G::CONSUMERS) {
        // The producer warpgroup gives its registers to the consumers
        // (24 + 2 · 240 per thread of a warpgroup fill the SM's 64 Ki).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        // The producer: tile j into stage j % NST once both warpgroups have
        // freed that stage's tile j − NST (the phase of parity (j/NST − 1) & 1).
        if (tid == G::CONSUMERS) {
            for (int j = 0; j < ntiles; ++j) {
                const int st = j % NST, t0 = (j0 + j) * BN;
                const u32 freed = (j / NST - 1) & 1;
                if (j >= NST) mbar_wait(free_k + st, freed);
                mbar_expect_tx(full_k + st, KT);
#pragma unroll
                for (int x = 0; x < G::KBOX; ++x)
                    tma_3d(Ks + st * KT + x * BN * 128, kmap, full_k + st, hk * D - shift + 64 * x, t0, b);
                if (j >= NST) mbar_wait(free_v + st, freed);
                mbar_expect_tx(full_v + st, VT);
#pragma unroll
                for (int x = 0; x < DP / 8; ++x)
                    tma_3d(Vs + st * VT + x * BN * 16, vmap, full_v + st, hk * D - shift + 8 * x, t0, b);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

    const T* const qb = q + (long long)b * Tn * qs + (long long)h * D;
    // Copies of two bytes would be plain stores, which the mbarriers do not
    // track; the host launches this kernel only where D and the bases allow 4.
    int vq = vec_of<2>(q, D);
    while (shift % vq) vq >>= 1;  // copies that start on the shifted columns
    if (vq < 2) __trap();
    tile_cm<ROWS, DP, E, G::CONSUMERS>(Qs, qb, vq, q0, Tn, qs, D, tid, shift);
    mbar_arrive_copies(q_full);
    const float c2 = (float)(scale * 1.4426950408889634074);
    // Soft-capped scores are in base 2 before their maximum is taken (f2 = 1).
    const bool cap = keys.softcap > 0;
    const float sc = (float)scale, f2 = cap ? 1.f : c2;

    const unsigned char* const Qw = Qs + wg * 64 * DP * 2;  // this warpgroup's 64 rows
    const int w0 = q0 + wg * 64 + warp * 16;                // a lane's rows: w0 + g and + 8
    float acc[DP / 2], s[NS * 4];
    u32 pa[BN / 16][4];
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) acc[i] = 0.f;
    // m in base 2 (scores · c2, or capped scores · log2 e); l per lane over
    // its own columns. m stays −∞ while every key a row has met was masked.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    // The keys a lane's rows see, lo..hi (hi: the row, or T − 1 past T), and
    // the first key of the warp's last row: tiles from there on need no
    // mask but the diagonal's.
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = w0 + g + r * 8;
        hi[r] = min(row, Tn - 1);
        lo[r] = row < Tn ? keys.first(b, Tn, row) : 0;
    }
    const int wlo = keys.first(b, Tn, min(w0 + 15, Tn - 1));
    mbar_wait(q_full, 0);
    fence_async_smem();

    auto issue_scores = [&](int j) {
        const int st = j % NST;
        mbar_wait(full_k + st, (j / NST) & 1);
        const unsigned char* const Kt = Ks + st * KT;
        wg_fence();
        Wg<BN>::template ss<T, 0>(s, wg_desc(Qw, KM_LBO, KM_SBO), wg_desc_sw128(Kt, 1024));
#pragma unroll
        for (int kk = 1; kk < DP / 16; ++kk)
            Wg<BN>::template ss<T>(s, wg_desc(Qw + kk * 256, KM_LBO, KM_SBO),
                                   wg_desc_sw128(Kt + (kk >> 2) * BN * 128 + (kk & 3) * 32, 1024));
        wg_commit();
    };
    auto issue_pv = [&](int j) {
        const int st = j % NST;
        mbar_wait(full_v + st, (j / NST) & 1);
        const unsigned char* const Vt = Vs + st * VT;
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) Wg<DP>::template rs_t<T>(acc, pa[kc], wg_desc(Vt + kc * 256, 128, BN * 16));
        wg_commit();
    };
    // The online softmax of step j's scores, in place (s becomes p in f32);
    // returns the factors acc must be rescaled by. With a soft-cap the
    // scores are first capped (natural units) and put in base 2, so that
    // the maximum below is taken over the capped scores themselves.
    auto softmax = [&](int j, float* alpha) {
        if (cap) {
#pragma unroll
            for (int i = 0; i < NS * 4; ++i) s[i] = sg_cap(s[i] * sc, keys.softcap) * SGM_LOG2E;
        }
        const int k0 = (j0 + j) * BN;
        if (j == ntiles - 1 || k0 < wlo) {  // mask keys outside lo..hi
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + n * 8 + 2 * c + (e & 1);
                    if (key > hi[e >> 1] || key < lo[e >> 1]) s[4 * n + e] = -INFINITY;
                }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * n + e]);
        // mr: the new maximum, or 0 for a row with no key yet (so that
        // wg_exp2 gets −∞ rather than −∞ − (−∞)).
        float sum[2] = {0.f, 0.f}, mr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float x = mx[r];
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
            const float mn = fmaxf(m[r], x * f2);  // f2 > 0: the scaled maximum
            mr[r] = mn == -INFINITY ? 0.f : mn;
            alpha[r] = wg_exp2(m[r] - mr[r]);
            m[r] = mn;
        }
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = wg_exp2(fmaf(s[4 * n + e], f2, -mr[e >> 1]));
                s[4 * n + e] = p;
                sum[e >> 1] += p;
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
    };
    auto pack_p = [&] {
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) wg_a_from_c<T>(pa[kc], s + 8 * kc);
    };

    float alpha[2];
    issue_scores(0);
    wg_wait<0>();
    mbar_arrive(free_k);
    softmax(0, alpha);
    pack_p();
    for (int j = 1; j < ntiles; ++j) {
        issue_scores(j);
        issue_pv(j - 1);
        wg_wait<1>();  // s_j has landed; p_{j-1}·v_{j-1} may still run
        mbar_arrive(free_k + j % NST);
        softmax(j, alpha);
        wg_wait<0>();
        mbar_arrive(free_v + (j - 1) % NST);
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            acc[4 * n] *= alpha[0];
            acc[4 * n + 1] *= alpha[0];
            acc[4 * n + 2] *= alpha[1];
            acc[4 * n + 3] *= alpha[1];
        }
        pack_p();
    }
    issue_pv(ntiles - 1);
    wg_wait<0>();
    float out[DP / 2];
    unshift_cols<NO>(out, acc, shift);

    T* const ob = o + (long long)b * Tn * qs + (long long)h * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    // Pairs of columns as one 4-byte store where D is even (every pair then
    // starts on an even element of an aligned base).
    const bool pairs = vec_of<2>(o, D) >= 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = w0 + g + r * 8;
        if (row >= Tn) continue;
        const float inv = 1.f / l[r];
        const long long at = (long long)row * qs;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            const int d = n * 8 + 2 * c;
            const float x0 = out[4 * n + 2 * r] * inv, x1 = out[4 * n + 2 * r + 1] * inv;
            if (pairs && d + 1 < D) {
                *reinterpret_cast<u32*>(ob + at + d) = Mma16<T>::pack(x0, x1);
            } else {
                if (d < D) store(ob, at + d, x0);
                if (d + 1 < D) store(ob, at + d + 1, x1);
            }
        }
        if (c == 0) lse[((long long)b * Hq + h) * Tn + row] = (m[r] + log2f(l[r])) * SGM_LN2;
    }
}
// ---------------------------------------------------------------------------
// Backward on warpgroup MMA, two warpgroups per block. As in fwd_wg, a block
// is two warpgroups owning 64 rows each (128 in all: query rows for bwd_q,
// key rows for bwd_kv) that share every streamed 64-row tile; the tiles run
// in three stages handed over by mbarriers (full / free per stage). The
// block's first thread has the copy engine bring each streamed tile (k and
// v for bwd_q, q and go for bwd_kv) in 8-column slabs, shifted as fwd_wg's
// (its own tiles shifted alike by cp.async, the gradients unshifted at the
// end); bwd_kv's row terms come by cp.async from the first 128 threads.
// Every thread still waits for a stage to be free before its refill (one
// arrival each on full), where a producer warpgroup would take registers
// the key side needs (it holds 240). Each step issues its two score
// products as soon as its tiles have landed (in bwd_q while the tensor
// cores may still run the previous step's ds·k), waits for them, frees the
// previous step's stage, refills it with the tile two steps ahead, and runs
// the pointwise part and the gradient products of this step.
// Same grid order, arguments, outputs, tile ranges and determinism as the
// one-warpgroup passes (every output element accumulated by one thread in
// a fixed order). Steps, stages and phase parities count from the first
// tile of the range (0 for each head's diagonal tile in bwd_kv, as before).
// ---------------------------------------------------------------------------
// Once step j (of `total`) holds what it needs of its stage ring's tiles:
// this thread's part in freeing the previous step's stage, then, once
// every thread has freed it, the refill of that stage with step
// j + NST - 1 by `load`.
template <int NST, typename Load>
__device__ __forceinline__ void recycle_stage(u64* free_, int j, int total, Load& load) {
    if (j < 1) return;
    mbar_arrive(free_ + (j - 1) % NST);
    const int t = j + NST - 1;
    if (t < total) {
        mbar_wait(free_ + t % NST, ((t - NST) / NST) & 1);
        load(t);
    }
}

template <int DP> struct WgBwd {
    static constexpr int ROWS = 128, BS = 64, THREADS = 256, NST = 3;
    static constexpr int OWN = ROWS * DP * 2, TILE = BS * DP * 2;
    // Up to 128 bytes to align the copy engine's tiles, then for bwd_q: q
    // and go (128 rows), NST stages of a k and a v tile, row terms of the
    // 128 rows, 2·NST mbarriers.
    static constexpr int BQ_SMEM = 128 + 2 * OWN + 2 * NST * TILE + 2 * ROWS * 4 + 2 * NST * 8;
    // bwd_kv: k and v (128 rows), NST stages of a q and a go tile with their
    // 64 rows' lse and delta, 2·NST mbarriers.
    static constexpr int BKV_SMEM = 128 + 2 * OWN + NST * (2 * TILE + 2 * BS * 4) + 2 * NST * 8 + ROWS * 4;
};
// The dynamic shared memory from its first 128-byte boundary.
__device__ __forceinline__ unsigned char* smem_aligned_128(unsigned char* p) {
    return p + ((128 - (smem_addr(p) & 127)) & 127);
}

template <typename T, int DP>
__device__ void bwd_q_wg(const T* q, const T* o, const float* lse, const T* go, const float* glse, T* gq, float* delta,
                         int Tn, int Hq, int Hkv, int D, double scale, const SgKeys keys, const TmaMap* kmap,
                         const TmaMap* vmap) {
    typedef WgBwd<DP> G;
    typedef u16 E;
    constexpr int ROWS = G::ROWS, BC = G::BS, NTH = G::THREADS, NST = G::NST, TILE = G::TILE, NO = DP / 8,
                  NS = BC / 8;
    extern __shared__ __align__(128) unsigned char smem_bytes[];
    unsigned char* const Qs = smem_aligned_128(smem_bytes);
    unsigned char* const Gs = Qs + G::OWN;
    unsigned char* const Ks = Gs + G::OWN;       // NST stages
    unsigned char* const Vs = Ks + NST * TILE;  // NST stages
    float* const Ls = reinterpret_cast<float*>(Vs + NST * TILE);
    float* const Ds = Ls + ROWS;
    u64* const full = reinterpret_cast<u64*>(Ds + ROWS);
    u64* const free_ = full + NST;
    check_launch(ROWS, Tn, G::BQ_SMEM, NTH);

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;  // longest rows first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (Hq / Hkv);
    const int q0 = qt * ROWS;
    const long long qs = (long long)Hq * D;
    const long long qoff = (long long)b * Tn * qs + (long long)h * D;
    // k and v tiles come by the copy engine in 8-column slabs from the
    // 16-byte boundary at or before the kv head, `shift` columns before it;
    // q and go are shifted alike, and gq's columns are unshifted at the end
    // (as in fwd_wg).
    const int shift = (hk * D) & 7;
    int vq = vec_of<2>(q, D), vg = vec_of<2>(go, D);
    while (shift % vq) vq >>= 1;
    while (shift % vg) vg >>= 1;
    if (min(vq, vg) < 2) __trap();  // the host checks D and the bases (mbarriers track cp.async only)
    // ntiles steps over the key tiles j0..=diagonal (step j: tile j0 + j).
    const int last = min(q0 + ROWS, Tn) - 1, j0 = keys.first(b, Tn, q0) / BC, ntiles = last / BC + 1 - j0;
    const float c2 = (float)(scale * 1.4426950408889634074);
    // A soft-cap is folded in before the shared pointwise step (f2 = 1, dm = 0), as in bwd_q.
    const bool cap = keys.softcap > 0;
    const float sc = (float)scale, f2 = cap ? 1.f : c2, dm = cap ? 0.f : 1.f;

    mbar_init_all(full, 2 * NST, NTH);
    // A stage is full once every thread's copies have landed (the first
    // stages' include q and go) and the copy engine's bytes with them.
    auto load = [&](int j) {
        const int st = j % NST, t0 = (j0 + j) * BC;
        if (tid == 0) {
            mbar_expect_tx_only(full + st, 2 * TILE);
#pragma unroll
            for (int x = 0; x < DP / 8; ++x) {
                tma_3d(Ks + st * TILE + x * BC * 16, kmap, full + st, hk * D - shift + 8 * x, t0, b);
                tma_3d(Vs + st * TILE + x * BC * 16, vmap, full + st, hk * D - shift + 8 * x, t0, b);
            }
        }
        mbar_arrive_copies(full + st);
    };
    tile_cm<ROWS, DP, E, NTH>(Qs, q + qoff, vq, q0, Tn, qs, D, tid, shift);
    tile_cm<ROWS, DP, E, NTH>(Gs, go + qoff, vg, q0, Tn, qs, D, tid, shift);
    for (int j = 0; j < NST && j < ntiles; ++j) load(j);  // q and go land with the first stage
    row_stats<T, ROWS, NTH>(Ls, Ds, q0, o + qoff, go + qoff, lse, glse, delta, qs, ((long long)b * Hq + h) * Tn, Tn,
                            D);
    __syncthreads();

    const int r0 = wg * 64 + warp * 16, w0 = q0 + r0;  // a lane's rows: w0 + g and + 8
    const unsigned char* const Qw = Qs + wg * 64 * DP * 2;
    const unsigned char* const Gw = Gs + wg * 64 * DP * 2;
    const float Lr[2] = {Ls[r0 + g], Ls[r0 + g + 8]}, Dr[2] = {Ds[r0 + g], Ds[r0 + g + 8]};
    // The keys a lane's rows see: lo..hi (hi: the row, or T − 1 past T).
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = w0 + g + r * 8;
        hi[r] = min(row, Tn - 1);
        lo[r] = row < Tn ? keys.first(b, Tn, row) : 0;
    }
    float acc[DP / 2], s[NS * 4], dp[NS * 4];
    u32 da[BC / 16][4];
    // A step up to its score gradients, packed as the A operand of ds·k in
    // da; returns the step's k tile. The caller issues acc += ds·k: the
    // first step overwrites acc in its first product rather than starting
    // from zeros (zeros written before the loop, meeting the products in
    // flight across its back edge, make ptxas serialize every product).
    auto front = [&](int j) {
        const int st = j % NST;
        mbar_wait(full + st, (j / NST) & 1);
        fence_async_smem();
        const unsigned char* const Kt = Ks + st * TILE;
        const unsigned char* const Vt = Vs + st * TILE;
        wg_scores_issue<T, DP>(s, dp, Qw, Kt, Gw, Vt);
        wg_wait<0>();  // these scores, and the previous step's ds·k
        recycle_stage<NST>(free_, j, ntiles, load);
        const int k0 = (j0 + j) * BC;
        // With a soft-cap: the capped score x in base 2 into s, (dp − D_i)·slope(x) into dp.
        if (cap) {
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = sg_cap(s[4 * n + e] * sc, keys.softcap);
                    s[4 * n + e] = x * SGM_LOG2E;
                    dp[4 * n + e] = (dp[4 * n + e] - Dr[e >> 1]) * sg_cap_slope(x, keys.softcap);
                }
        }
        // ds = p·(dp − D_i), zero outside lo..hi.
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + n * 8 + 2 * c + (e & 1);
                const float p = key > hi[e >> 1] || key < lo[e >> 1] ? 0.f : wg_exp2(s[4 * n + e] * f2 - Lr[e >> 1]);
                s[4 * n + e] = p * (dp[4 * n + e] - Dr[e >> 1] * dm);
            }
#pragma unroll
        for (int kc = 0; kc < BC / 16; ++kc) wg_a_from_c<T>(da[kc], s + 8 * kc);
        wg_fence();
        return Kt;
    };
    // ds·k reads the k tile MN-major: core matrices 128 bytes apart along
    // the keys, BC·16 along the columns.
    const unsigned char* Kt = front(0);
    Wg<DP>::template rs_t<T, 0>(acc, da[0], wg_desc(Kt, 128, BC * 16));
#pragma unroll
    for (int kc = 1; kc < BC / 16; ++kc) Wg<DP>::template rs_t<T>(acc, da[kc], wg_desc(Kt + kc * 256, 128, BC * 16));
    wg_commit();
    for (int j = 1; j < ntiles; ++j) {
        Kt = front(j);
#pragma unroll
        for (int kc = 0; kc < BC / 16; ++kc) Wg<DP>::template rs_t<T>(acc, da[kc], wg_desc(Kt + kc * 256, 128, BC * 16));
        wg_commit();
    }
    wg_wait<0>();

    float out[DP / 2];
    unshift_cols<NO>(out, acc, shift);
    store_rows<NO>(gq + qoff, qs, w0 + g, Tn, D, c, out, (float)scale);
}

// The last query row that sees each key of a key-side block (keys k0..kl,
// ROWS of them at most), found by the whole block at once instead of a
// binary search over the positions per key: at T = 2048 that search is 11
// dependent global reads, and two of them (the block's last key for its
// query range, then each thread's own keys) stood between a block's start
// and its first tile.
//   lq(j) = min(j + window − 1, lqd(j)),  lqd(j) = max{i : dfirst(i) ≤ j}
// where dfirst(i) is the first key of row i's document, which never
// decreases along a row. For kl, an NTH-ary search over the rows after it
// (every thread tests one row, `__syncthreads_count` counts the rows still
// seeing kl; T = 65536 takes two rounds). A key j whose document is kl's
// has lqd(j) = lqd(kl): every row after kl that sees kl starts its
// document at kl's document start, ≤ j. Any other key's document ends
// inside the block, at the row before the first block row whose document
// starts after j, found by halving over the block's document starts,
// which the block keeps in shared memory (`starts`, ROWS ints).
template <int NTH, int ROWS> struct KeySide {
    const SgKeys& keys;
    const int* starts;
    int k0, kl, Tn;
    int last;  // lq(kl)

    // Every thread of the block, together (block barriers inside).
    __device__ __forceinline__ KeySide(const SgKeys& keys_, int b, int Tn_, int k0_, int* starts_)
        : keys(keys_), starts(starts_), k0(k0_), kl(min(k0_ + ROWS, Tn_) - 1), Tn(Tn_) {
        int lo = kl, hi = Tn - 1;  // lq(kl) lies in lo..hi
        if (keys.window > 0) hi = (int)min((i64)hi, (i64)kl + keys.window - 1);
        if (keys.pos) {
            const int* const pos = keys.pos + (i64)b * Tn;
            auto dfirst = [&](int i) { return max(min(i - pos[i], i), 0); };
            const int tid = threadIdx.x;
            if (tid < ROWS) starts_[tid] = k0 + tid <= kl ? dfirst(k0 + tid) : 0x7fffffff;
            while (lo < hi) {
                // Candidates lo + ⌊(t + 1)·n / m⌋, t < m: increasing, the last one hi.
                const int n = hi - lo, m = min(n, NTH);
                const bool sees = tid < m && dfirst(lo + (int)((i64)(tid + 1) * n / m)) <= kl;
                const int cnt = __syncthreads_count(sees);
                const int nlo = cnt == 0 ? lo : lo + (int)((i64)cnt * n / m);
                hi = cnt == m ? hi : lo + (int)((i64)(cnt + 1) * n / m) - 1;
                lo = nlo;
            }
            __syncthreads();  // the document starts
        } else {
            lo = hi;  // without documents every row from kl to hi sees kl
        }
        last = lo;
    }

    // lq(j) for this block's key j, or T − 1 past T (where every query
    // precedes j: masked all the same).
    __device__ __forceinline__ int of(int j) const {
        if (j > kl) return Tn - 1;
        int l = last;
        if (keys.pos && starts[kl - k0] > j) {
            int a = j - k0 + 1, z = kl - k0;  // the first r in a..z with starts[r] > j (starts[z] is)
            while (a < z) {
                const int mid = (a + z) >> 1;
                if (starts[mid] > j) z = mid;
                else a = mid + 1;
            }
            l = k0 + a - 1;
        }
        return keys.window > 0 ? (int)min((i64)l, (i64)j + keys.window - 1) : l;
    }
};

template <typename T, int DP>
__device__ void bwd_kv_wg(const T* k, const T* v, const float* lse, const float* delta, T* gk, T* gv, int Tn, int Hq,
                          int Hkv, int D, double scale, const SgKeys keys, const TmaMap* qmap, const TmaMap* gomap) {
    typedef WgBwd<DP> G;
    typedef u16 E;
    constexpr int ROWS = G::ROWS, BQ = G::BS, NTH = G::THREADS, NST = G::NST, TILE = G::TILE, NO = DP / 8,
                  NS = BQ / 8;
    constexpr int STAGE = 2 * TILE + 2 * BQ * 4;  // q, go, then lse and delta of the 64 rows
    extern __shared__ __align__(128) unsigned char smem_bytes[];
    unsigned char* const Ks = smem_aligned_128(smem_bytes);
    unsigned char* const Vs = Ks + G::OWN;
    unsigned char* const Ss = Vs + G::OWN;  // NST stages
    u64* const full = reinterpret_cast<u64*>(Ss + NST * STAGE);
    u64* const free_ = full + NST;
    int* const starts = reinterpret_cast<int*>(full + 2 * NST);
    check_launch(ROWS, Tn, G::BKV_SMEM, NTH);

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int hk = blockIdx.y, b = blockIdx.z, grp = Hq / Hkv;
    const int k0 = blockIdx.x * ROWS;  // the first blocks have the most query tiles: launched first
    const long long ks = (long long)Hkv * D;
    const long long koff = (long long)b * Tn * ks + (long long)hk * D;
    // q and go tiles come by the copy engine in 8-column slabs from the
    // 16-byte boundary at or before each query head, `shift` columns before
    // it (the host checks that every head of the group has the same); k and
    // v are shifted alike, and gk's and gv's columns are unshifted at the
    // end (as in fwd_wg).
    const int shift = (hk * grp * D) & 7;
    int vk = vec_of<2>(k, D), vv = vec_of<2>(v, D);
    while (shift % vk) vk >>= 1;
    while (shift % vv) vv >>= 1;
    if (min(vk, vv) < 2) __trap();
    // k and v first: they load while the block finds its query range.
    tile_cm<ROWS, DP, E, NTH>(Ks, k + koff, vk, k0, Tn, ks, D, tid, shift);
    tile_cm<ROWS, DP, E, NTH>(Vs, v + koff, vv, k0, Tn, ks, D, tid, shift);
    // Query tiles first..nq − 1 of each head (as in bwd_kv), and the
    // queries that see this lane's keys: key..lq (lq < T, so `query > lq`
    // is also the mask past T).
    const int key0 = k0 + wg * 64 + warp * 16 + g;  // this lane's keys: key0, key0 + 8
    int nq, lq[2];
    {
        const KeySide<NTH, ROWS> side(keys, b, Tn, k0, starts);
        // (Through a shuffle: as a per-thread value rather than the
        // block-uniform one ptxas keeps in a uniform register, the key side
        // at width 128 fits its registers without spilling.)
        nq = __shfl_sync(0xffffffffu, side.last, 0) / BQ + 1;
        lq[0] = side.of(key0);
        lq[1] = side.of(key0 + 8);
    }
    const int first = k0 / BQ, per_head = nq - first, steps = grp * per_head;
    const float c2 = (float)(scale * 1.4426950408889634074);
    // A soft-cap is folded in before the shared pointwise step (f2 = 1, dm = 0), as in bwd_kv.
    const bool cap = keys.softcap > 0;
    const float sc = (float)scale, f2 = cap ? 1.f : c2, dm = cap ? 0.f : 1.f;

    mbar_init_all(full, 2 * NST, NTH);
    // A stage is full once every thread's copies have landed (the first
    // stages' include k and v) and the copy engine's bytes with them.
    auto load = [&](int step) {
        unsigned char* const S = Ss + (step % NST) * STAGE;
        const int h = hk * grp + step / per_head, t0 = (first + step % per_head) * BQ;
        const long long stat = ((long long)b * Hq + h) * Tn;
        if (tid == 0) {
            mbar_expect_tx_only(full + step % NST, 2 * TILE);
#pragma unroll
            for (int x = 0; x < DP / 8; ++x) {
                tma_3d(S + x * BQ * 16, qmap, full + step % NST, h * D - shift + 8 * x, t0, b);
                tma_3d(S + TILE + x * BQ * 16, gomap, full + step % NST, h * D - shift + 8 * x, t0, b);
            }
        }
        if (tid < 2 * BQ) {  // lse, then delta, of rows t0..; zero past T
            const int r = tid % BQ, t = t0 + r;
            const float* src = tid < BQ ? lse : delta;
            cp_async<4>(S + 2 * TILE + tid * 4, t < Tn ? src + stat + t : src, t < Tn);
        }
        mbar_arrive_copies(full + step % NST);
    };
    for (int st = 0; st < NST && st < steps; ++st) load(st);  // k and v land with the first stage

    const int kr = wg * 64;
    const unsigned char* const Kw = Ks + kr * DP * 2;
    const unsigned char* const Vw = Vs + kr * DP * 2;
    float dk[DP / 2], dv[DP / 2], s[NS * 4], dp[NS * 4];
    u32 pa[BQ / 16][4], da[BQ / 16][4];
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) dk[i] = dv[i] = 0.f;

    for (int st = 0; st < steps; ++st) {
        const int sg = st % NST;
        const int t0 = (first + st % per_head) * BQ;
        mbar_wait(full + sg, (st / NST) & 1);
        fence_async_smem();
        const unsigned char* const S = Ss + sg * STAGE;
        const unsigned char* const Qt = S;
        const unsigned char* const Gt = S + TILE;
        const float* const Lt = reinterpret_cast<const float*>(S + 2 * TILE);
        const float* const Dt = Lt + BQ;
        // (The upper warpgroup's first query tile of each head lies wholly
        // before its keys, and with a window or documents the lower one's
        // last tiles may lie wholly after its keys' last queries; they are
        // computed and masked all the same: a wgmma on a branch makes ptxas
        // serialize every one of them.)
        wg_scores_issue<T, DP>(s, dp, Kw, Qt, Vw, Gt);
        wg_wait<0>();
        recycle_stage<NST>(free_, st, steps, load);
        // With a soft-cap: the capped score x in base 2 into s, (dp − D_i)·slope(x) into dp.
        if (cap) {
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qi = n * 8 + 2 * c + (e & 1);
                    const float x = sg_cap(s[4 * n + e] * sc, keys.softcap);
                    s[4 * n + e] = x * SGM_LOG2E;
                    dp[4 * n + e] = (dp[4 * n + e] - Dt[qi]) * sg_cap_slope(x, keys.softcap);
                }
        }
        // pᵀ into s, dsᵀ into dp; zero where the query precedes the key or
        // is past lq. (dp − D_i·dm is dp − D_i exactly where dm = 1.)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = n * 8 + 2 * c + (e & 1), query = t0 + qi, key = key0 + (e >> 1) * 8;
                const float p =
                    query < key || query > lq[e >> 1] ? 0.f : wg_exp2(s[4 * n + e] * f2 - Lt[qi] * SGM_LOG2E);
                s[4 * n + e] = p;
                dp[4 * n + e] = p * (dp[4 * n + e] - Dt[qi] * dm);
            }
        // gv += pᵀ·go, gk += dsᵀ·q over the 64 queries, 16 at a time.
#pragma unroll
        for (int kc = 0; kc < BQ / 16; ++kc) {
            wg_a_from_c<T>(pa[kc], s + 8 * kc);
            wg_a_from_c<T>(da[kc], dp + 8 * kc);
        }
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < BQ / 16; ++kc) {  // go and q MN-major, as ds·k in bwd_q_wg
            Wg<DP>::template rs_t<T>(dv, pa[kc], wg_desc(Gt + kc * 256, 128, BQ * 16));
            Wg<DP>::template rs_t<T>(dk, da[kc], wg_desc(Qt + kc * 256, 128, BQ * 16));
        }
        wg_commit();
        // Waited for here, not across the next step's scores as in bwd_q:
        // holding pᵀ and dsᵀ over that step made the key side spill (255
        // registers) and measured slower (W5's shape 1.25 against 1.17 ms).
        wg_wait<0>();
    }

    float gk_out[DP / 2], gv_out[DP / 2];
    unshift_cols<NO>(gk_out, dk, shift);
    unshift_cols<NO>(gv_out, dv, shift);
    store_rows<NO>(gk + koff, ks, key0, Tn, D, c, gk_out, (float)scale, gv + koff, gv_out);
}
#endif  // SGM_WGMMA

}  // namespace sgm

// ---------------------------------------------------------------------------
// Entry points. Each module is one variant: src/ops/attention.rs (KERNELS) defines SGM_SFX,
// SGM_TYPE and SGM_DP (a multiple of 16 in 32..128, or 256 for 16-bit storage). Without them (an editor,
// a syntax check) every variant is instantiated.
// ---------------------------------------------------------------------------

#define SGM_ENTRY(sfx, T, DP)                                                                                     \
    extern "C" __global__ void __launch_bounds__(SGM_FWD_THREADS) attention_mma_fwd_d##DP##_##sfx(                \
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,              \
        float* __restrict__ lse, int Tn, int Hq, int Hkv, int D, double scale, const int* __restrict__ pos,       \
        int window, double softcap SGM_FWD_MAPS) { sg_pdl_entry();                                                                \
        const SgKeys keys{pos, window, softcap};                                                                  \
        SGM_FWD(T, DP);                                                                                           \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(SGM_BWD_THREADS) attention_mma_bwd_q_d##DP##_##sfx(                      \
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ o,        \
        const float* __restrict__ lse, const T* __restrict__ go, const float* __restrict__ glse,                  \
        T* __restrict__ gq, float* __restrict__ delta, int Tn, int Hq, int Hkv, int D, double scale,               \
        const int* __restrict__ pos, int window, double softcap SGM_BWD_Q_MAPS) { sg_pdl_entry();                                \
        const SgKeys keys{pos, window, softcap};                                                                  \
        SGM_BWD_Q(T, DP);                                                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(SGM_BWD_THREADS) attention_mma_bwd_kv_d##DP##_##sfx(                     \
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ o,        \
        const float* __restrict__ lse, const T* __restrict__ go, const float* __restrict__ glse,                  \
        const float* __restrict__ delta, T* __restrict__ gk, T* __restrict__ gv, int Tn, int Hq, int Hkv, int D,   \
        double scale, const int* __restrict__ pos, int window, double softcap SGM_BWD_KV_MAPS) { sg_pdl_entry();                  \
        const SgKeys keys{pos, window, softcap};                                                                  \
        SGM_BWD_KV(T, DP);                                                                                        \
    }
// The passes: on warpgroup MMA in a module built for sm_90a with SGM_WGMMA
// defined (16-bit storage, padded widths 80..128: the host's
// wgmma_attention), mma.sync otherwise. The warpgroup forward is two
// consumer warpgroups and a producer per block (fwd_wg); an earlier one of
// one warpgroup with synchronous products (commit 5a55a4e) measured slower
// than mma.sync.
#ifdef SGM_WGMMA
// The warpgroup forward also takes the tensor maps of k and v.
#define SGM_FWD_THREADS 384
#define SGM_FWD_MAPS , const __grid_constant__ sgm::TmaMap kmap, const __grid_constant__ sgm::TmaMap vmap
#define SGM_FWD(T, DP) sgm::fwd_wg<T, DP>(q, o, lse, Tn, Hq, Hkv, D, scale, keys, &kmap, &vmap)
#define SGM_BWD_THREADS 256
// The backward passes take the tensor maps of the tiles they stream: k and
// v on the query side, q and go on the key side.
#define SGM_BWD_Q_MAPS , const __grid_constant__ sgm::TmaMap kmap, const __grid_constant__ sgm::TmaMap vmap
#define SGM_BWD_KV_MAPS , const __grid_constant__ sgm::TmaMap qmap, const __grid_constant__ sgm::TmaMap gomap
#define SGM_BWD_Q(T, DP) \
    sgm::bwd_q_wg<T, DP>(q, o, lse, go, glse, gq, delta, Tn, Hq, Hkv, D, scale, keys, &kmap, &vmap)
#define SGM_BWD_KV(T, DP) sgm::bwd_kv_wg<T, DP>(k, v, lse, delta, gk, gv, Tn, Hq, Hkv, D, scale, keys, &qmap, &gomap)
#else
#define SGM_BWD_THREADS sgm::NT
#define SGM_FWD_THREADS sgm::NT
#define SGM_FWD_MAPS
#define SGM_BWD_Q_MAPS
#define SGM_BWD_KV_MAPS
#define SGM_FWD(T, DP) sgm::fwd<T, DP>(q, k, v, o, lse, Tn, Hq, Hkv, D, scale, keys)
#define SGM_BWD_Q(T, DP) sgm::bwd_q<T, DP>(q, k, v, o, lse, go, glse, gq, delta, Tn, Hq, Hkv, D, scale, keys)
#define SGM_BWD_KV(T, DP) sgm::bwd_kv<T, DP>(q, k, v, o, lse, go, glse, delta, gk, gv, Tn, Hq, Hkv, D, scale, keys)
#endif
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
SGM_ALL(f32, float)
SGM_ENTRY(bf16, __nv_bfloat16, 256)
SGM_ENTRY(f16, __half, 256)
#endif
