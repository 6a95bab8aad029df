// Products of a few rows by a weight matrix, y = x · wᵀ (+ addend), for
// decode steps: x [m, k] with m ≤ 16, w [n, k] row-major (`trans_b`), y
// [m, n]; bf16/f16 on tensor cores with f32 accumulation. The blas module
// (`crates/cuda/src/blas/skinny.rs`) offers these kernels to tuning as
// candidates next to cuBLASLt's algorithms, for the shapes they can run.
//
// Why: a decode step's products read every weight once and do 2·m flops
// per weight, so they are bound by how many weight bytes are in flight.
// cuBLASLt's products at m = 1 streamed W6's weights at ~2.3 TB/s, against
// 4.18 TB/s for a copy; an earlier matrix-vector kernel (4 columns per
// warp, one warp for a column's whole depth) ran only ~6 warps per SM at
// W6's widths and was slower still. Here a block's WARPS warps split one
// 8-column tile's depth, so a 3200-wide product runs 400 × WARPS warps,
// and each lane keeps weight packs in flight: in the register pipeline
// the next U chunks' loads are issued before this U's products; the
// asynchronous variants copy several groups of U chunks ahead into
// per-warp shared-memory rings with cp.async, where ptxas cannot trade
// the bytes in flight for registers.
//
// Layout: block (blockIdx.x, blockIdx.y) owns columns 8·blockIdx.x … +8
// of batch entry blockIdx.y. The depth is cut into 32-element chunks;
// warp i of the block takes chunks [i·per, (i+1)·per). In a chunk at kb,
// lane (g = lane / 4, t = lane % 4) loads w[col g][kb + 8t … +8] and
// x[row g][same], x[row g + 8][same] as 16-byte packs: words 0–1 feed one
// m16n8k16 product and words 2–3 a second. Each product's logical depth
// index L maps to the physical kb + 8t + (L % 2) + 2·(L ≥ 8) (+4 for the
// second) for A and B alike, so together the two cover the chunk exactly
// once (the host model `blas::skinny::tests` replays this mapping against
// a plain product). Rows ≥ m and columns ≥ n load zeros and store nothing.
//
// Warps sum their accumulators through shared memory in warp order, so
// every run gives the same bits; the addend (the output's layout, or a
// bias row) joins in f32 before the one rounding, as cuBLASLt's epilogues.
//
// Needs: k a multiple of 8, x and w (every batch entry) 16-byte aligned;
// the host checks (`skinny::eligible`).

typedef unsigned int u32;

// A weight pack: read once, so it bypasses L1 (the activations, read by
// every block, stay cached).
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
// An activation pack, cached: volatile like the weight loads, so the
// compiler keeps it ahead of the products instead of sinking it next to
// its use, where its latency would stall every product.
__device__ __forceinline__ uint4 load_cached(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Addend kinds (the host's `GemmAddend`).
#define SK_ADD_NONE 0
#define SK_ADD_FULL 1
#define SK_ADD_BIAS 2

// Rows of x a lane loads per chunk: 1, or 2 when x may have more than 8 rows.
template <int ROWS> __host__ __device__ constexpr int x_packs() { return ROWS > 8 ? 2 : 1; }
// Slots of an asynchronous block's rings: as many as 46 KiB hold (static
// shared memory stops at 48 KiB; the warps' partial sums take the rest),
// at most 8. One slot is WARPS · U chunks of every lane's 16-byte packs.
template <int WARPS, int U, int ROWS> __host__ __device__ constexpr int ring_slots() {
    const int slot = WARPS * U * (1 + x_packs<ROWS>()) * 32 * 16;
    return 46 * 1024 / slot < 8 ? 46 * 1024 / slot : 8;
}

template <typename T, int WARPS, int U, int ROWS, bool ASYNC>
__device__ __forceinline__ void skinny(const T* __restrict__ x, const T* __restrict__ w, T* y, const T* addend,
                                       int add_kind, int m, int n, int k, i64 sx, i64 sw, i64 sy) {
    __shared__ float red[WARPS > 1 ? WARPS : 1][32][4];
    // ASYNC: each warp's ring of S slots, a slot holding U chunks of every
    // lane's packs (weights, then x rows), lane-contiguous.
    constexpr int PACKS = 1 + x_packs<ROWS>(), S = ASYNC ? ring_slots<WARPS, U, ROWS>() : 0;
    static_assert(!ASYNC || S >= 2, "a ring needs two slots");
    __shared__ __align__(16) uint4 ring[S > 0 ? WARPS * S * U * PACKS * 32 : 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const i64 b = blockIdx.y;
    x += b * sx;
    w += b * sw;
    y += b * sy;
    if (add_kind == SK_ADD_FULL) addend += b * sy;
    const int n0 = (int)blockIdx.x * 8;
    const bool w_ok = n0 + g < n, x0_ok = g < m, x1_ok = ROWS > 8 && g + 8 < m;
    const T* w_row = w + (i64)(w_ok ? n0 + g : 0) * k;
    const T* x_row0 = x + (i64)(x0_ok ? g : 0) * k;
    const T* x_row1 = x + (i64)(x1_ok ? g + 8 : 0) * k;
    const int chunks = (k + 31) / 32, per = (chunks + WARPS - 1) / WARPS;
    const int c_begin = warp * per, c_end = min(chunks, c_begin + per);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (!ASYNC) {
        // Software-pipelined by one group of U chunks: the next group's loads
        // are issued before this group's products, so a lane keeps U packs
        // of weights in flight while its tensor cores work. Loads are
        // unconditional (a pack out of range reads the row's first pack, in
        // bounds, and is zeroed at use): ptxas does not hoist a load that
        // sits behind a branch.
        uint4 wv[U], xv0[U], xv1[ROWS > 8 ? U : 1];
        auto issue = [&](int c0) {
    #pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64 kk = (i64)(c0 + u) * 32 + 8 * t;
                const i64 at = c0 + u < c_end && kk < k ? kk : 0;
                wv[u] = load_stream(w_row + at);
                xv0[u] = load_cached(x_row0 + at);
                if (ROWS > 8) xv1[ROWS > 8 ? u : 0] = load_cached(x_row1 + at);
            }
        };
        if (c_begin < c_end) issue(c_begin);
        for (int c0 = c_begin; c0 < c_end; c0 += U) {
            uint4 cw[U], cx0[U], cx1[ROWS > 8 ? U : 1];
    #pragma unroll
            for (int u = 0; u < U; ++u) {
                const bool in = c0 + u < c_end && (i64)(c0 + u) * 32 + 8 * t < k;
                cw[u] = in && w_ok ? wv[u] : zero;
                cx0[u] = in && x0_ok ? xv0[u] : zero;
                if (ROWS > 8) cx1[ROWS > 8 ? u : 0] = in && x1_ok ? xv1[ROWS > 8 ? u : 0] : zero;
            }
            if (c0 + U < c_end) issue(c0 + U);
    #pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint4 x1 = ROWS > 8 ? cx1[ROWS > 8 ? u : 0] : zero;
                const u32 a_lo[4] = {cx0[u].x, x1.x, cx0[u].y, x1.y}, a_hi[4] = {cx0[u].z, x1.z, cx0[u].w, x1.w};
                Mma16<T>::mma(acc, a_lo, cw[u].x, cw[u].y);
                Mma16<T>::mma(acc, a_hi, cw[u].z, cw[u].w);
            }
        }
    } else {
        // Asynchronous copies into this warp's ring, S − 1 groups of U
        // chunks ahead of the products: the bytes in flight live in shared
        // memory, not registers, so ptxas cannot trade them away. A lane
        // reads back only the packs it copied itself, so its own
        // cp.async.wait_group is all the synchronisation needed; a slot is
        // refilled one iteration after its packs were read (their products
        // consumed them), so no copy overtakes a read.
        uint4* const slots = ring + (i64)warp * S * U * PACKS * 32;
        auto issue = [&](int c0, int slot) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64 kk = (i64)(c0 + u) * 32 + 8 * t;
                const bool in = c0 + u < c_end && kk < k;
                uint4* const at = slots + ((slot * U + u) * PACKS) * 32 + lane;
                cp_async<16>(at, w_row + (in ? kk : 0), in && w_ok);
                cp_async<16>(at + 32, x_row0 + (in ? kk : 0), in && x0_ok);
                if (ROWS > 8) cp_async<16>(at + 64, x_row1 + (in ? kk : 0), in && x1_ok);
            }
        };
        const int groups = c_begin < c_end ? (c_end - c_begin + U - 1) / U : 0;
#pragma unroll
        for (int s = 0; s < S - 1; ++s) {
            if (s < groups) issue(c_begin + s * U, s);
            cp_commit();
        }
        for (int i = 0; i < groups; ++i) {
            if (i + S - 1 < groups) issue(c_begin + (i + S - 1) * U, (i + S - 1) % S);
            cp_commit();
            cp_wait<S - 1>();
            const uint4* const slot = slots + (i % S) * U * PACKS * 32 + lane;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint4 wp = slot[u * PACKS * 32], x0 = slot[u * PACKS * 32 + 32];
                const uint4 x1 = ROWS > 8 ? slot[u * PACKS * 32 + 64] : zero;
                const u32 a_lo[4] = {x0.x, x1.x, x0.y, x1.y}, a_hi[4] = {x0.z, x1.z, x0.w, x1.w};
                Mma16<T>::mma(acc, a_lo, wp.x, wp.y);
                Mma16<T>::mma(acc, a_hi, wp.z, wp.w);
            }
        }
        cp_wait<0>();
    }
    if (WARPS > 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][lane][i] = acc[i];
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float s = red[0][lane][i];
#pragma unroll
            for (int v = 1; v < WARPS; ++v) s += red[v][lane][i];
            acc[i] = s;
        }
    }
    // Accumulator i of lane (g, t): row g (i < 2) or g + 8, column 2t + i % 2.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = i < 2 ? g : g + 8, col = n0 + 2 * t + (i & 1);
        if (r < m && col < n) {
            const i64 at = (i64)r * n + col;
            float v = acc[i];
            if (add_kind == SK_ADD_FULL) v += load(addend, at);
            if (add_kind == SK_ADD_BIAS) v += load(addend, col);
            store(y, at, v);
        }
    }
}

// skinny_w{WARPS}_u{U}_r{ROWS}_{dtype} (register pipeline) and
// skinny_w{WARPS}_u{U}_a_r{ROWS}_{dtype} (cp.async rings of ring_slots
// slots), (x, w, y, addend, add_kind, m, n, k, sx, sw, sy): grid
// (ceil(n / 8), batch), block 32·WARPS, m ≤ ROWS (8: rows g + 8 are never
// loaded, which frees registers or ring space for more weight packs).
#define SG_SKINNY_KERNEL(NAME, WARPS, U, ROWS, ASYNC, T)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                                   \
        NAME(const T* __restrict__ x, const T* __restrict__ w, T* y, const T* addend, int add_kind, int m,     \
             int n, int k, i64 sx, i64 sw, i64 sy) { sg_pdl_entry();                                                           \
        skinny<T, WARPS, U, ROWS, ASYNC>(x, w, y, addend, add_kind, m, n, k, sx, sw, sy);                      \
    }
#define SG_SKINNY(WARPS, U, ROWS, sfx, T) \
    SG_SKINNY_KERNEL(skinny_w##WARPS##_u##U##_r##ROWS##_##sfx, WARPS, U, ROWS, false, T)
#define SG_SKINNY_ASYNC(WARPS, U, ROWS, sfx, T) \
    SG_SKINNY_KERNEL(skinny_w##WARPS##_u##U##_a_r##ROWS##_##sfx, WARPS, U, ROWS, true, T)
#define SG_SKINNY_ROWS(sfx, T, ROWS)                                                       \
    SG_SKINNY(8, 4, ROWS, sfx, T) SG_SKINNY(16, 4, ROWS, sfx, T) SG_SKINNY(4, 4, ROWS, sfx, T) \
        SG_SKINNY(16, 2, ROWS, sfx, T) SG_SKINNY_ASYNC(4, 2, ROWS, sfx, T) SG_SKINNY_ASYNC(2, 4, ROWS, sfx, T)
#define SG_SKINNY_ALL(sfx, T) SG_SKINNY_ROWS(sfx, T, 8) SG_SKINNY_ROWS(sfx, T, 16)

SG_SKINNY_ALL(bf16, __nv_bfloat16)
SG_SKINNY_ALL(f16, __half)
