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
//   block of SG_SORT_THREADS, a stable counting sort. Each warp owns a
//   contiguous segment of the pairs and walks it 32 at a time; lanes of
//   one expert find each other with `__match_any_sync`, and a pair's place
//   is its expert's offset, plus that expert's pairs in earlier segments,
//   earlier rounds and lower lanes. Per-segment counts live in shared
//   memory (segments × experts ≤ SG_SORT_SHARED ints; the lowering refuses
//   more experts); counts are also written as floats. Ids outside
//   [0, experts) are clamped into it (the CPU refuses them), so the kernel
//   never writes out of bounds.
// - `grouped_matmul_<dt>(const T* x, const T* w, const int* offsets,
//   T* y, i64 m, i64 k, i64 n, i64 experts, i64 trans_w)`: a thread per
//   output element; its row's expert by binary search in the offsets
//   (clamped into [0, experts)), then the dot product in depth order.
// - `grouped_matmul_weight_grad_<dt>(const T* a, const T* b,
//   const int* offsets, T* out, i64 m, i64 na, i64 nb, i64 experts)`: a
//   thread per output element (e, i, j) sums its expert's rows in order
//   (the rows clamped into [0, m]).
//
// These plain forms are correct on every shape and dtype; bf16 and f16
// products whose widths are multiples of 8 run on tensor cores instead:
//
// - `grouped_mma_nt_<dt>` (w[e] stored [n][k]) and `grouped_mma_nn_<dt>`
//   (w[e] stored [k][n], `trans_w`), with the arguments of
//   `grouped_matmul` (trans_w unread): blocks of GMM_BM × GMM_BN outputs, 8
//   warps of 64 × 32, m16n8k16 `mma.sync` with f32 accumulation on tiles
//   staged by `cp.async` in two buffers of GMM_BK depth. A block's rows
//   belong to one expert: block x is the x-th row tile in expert order
//   (each expert's rows cut into tiles of GMM_BM, the last one partial),
//   found by walking the offsets; the grid holds ceil(m / GMM_BM) + experts
//   tiles, the most there can be, and blocks past the last tile return.
//   Rows outside the tile's expert and columns past n are zero-filled on
//   load and not stored.
// - `grouped_mma_weight_grad_<dt>(a, b, offsets, out, m, na, nb, experts)`:
//   block (x, y, e) computes out[e] rows GMM_BM·x.., columns GMM_BN·y.. as
//   the sum over expert e's rows of a[p]ᵀ b[p], in GMM_BK-row steps (the
//   A operand read transposed); an expert without rows gets zeros.
//
// Both need k, n (na, nb) multiples of 8 and 16-byte aligned operands (the
// lowering checks); each output is its f32 sum rounded once, the sum's
// order that of the tensor cores rather than the CPU's.

#define SG_MOE_THREADS 256
// The routing sort's block: per-segment counts of at most SORT_SHARED ints
// (segments × experts; the lowering refuses more experts than that).
#define SG_SORT_THREADS 1024
#define SG_SORT_SHARED 8192
#define GMM_BM 128
#define GMM_BN 128
#define GMM_BK 32
#define GMM_THREADS 256
#define GMM_PAD 8  // shared row padding (elements): conflict-free ldmatrix rows

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
    // seg[s * experts + e]: first the pairs of expert e in segment s, then
    // the place of segment s's next pair of expert e.
    __shared__ int seg[SG_SORT_SHARED];
    __shared__ int warp_sums[SG_SORT_THREADS / 32];
    __shared__ int carry;
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const i64 segments = min((i64)warps, (i64)SG_SORT_SHARED / experts);
    const i64 rounds = (pairs + 32 * segments - 1) / (32 * segments);
    // Warp s owns the pairs [32·rounds·s, 32·rounds·(s+1)), walked 32 at a
    // time; lanes holding the same expert find each other with one match.
    auto expert_at = [&](i64 i) -> int {
        if (i >= pairs) return -1;
        const i64 e = (i64)ids[i];
        return (int)(e < 0 ? 0 : (e >= experts ? experts - 1 : e));
    };
    for (i64 i = threadIdx.x; i < segments * experts; i += blockDim.x) seg[i] = 0;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    if (warp < segments) {
        int* mine = seg + warp * experts;
        for (i64 r = 0; r < rounds; ++r) {
            const int e = expert_at((warp * rounds + r) * 32 + lane);
            const unsigned peers = __match_any_sync(all, e);
            if (e >= 0 && lane == __ffs(peers) - 1) mine[e] += __popc(peers);
            __syncwarp();
        }
    }
    __syncthreads();
    // Offsets: an exclusive scan of the experts' totals, blockDim experts at
    // a time; each segment's count becomes its first place.
    for (i64 first = 0; first < experts; first += blockDim.x) {
        const i64 e = first + threadIdx.x;
        int total = 0;
        if (e < experts)
            for (i64 s = 0; s < segments; ++s) {
                const int c = seg[s * experts + e];
                seg[s * experts + e] = total;
                total += c;
            }
        int upto = total;  // inclusive scan within the warp
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(all, upto, d);
            if (lane >= d) upto += y;
        }
        if (lane == 31) warp_sums[warp] = upto;
        __syncthreads();
        if (warp == 0) {
            int w = lane < warps ? warp_sums[lane] : 0;
            for (int d = 1; d < 32; d <<= 1) {
                const int y = __shfl_up_sync(all, w, d);
                if (lane >= d) w += y;
            }
            if (lane < warps) warp_sums[lane] = w;
        }
        __syncthreads();
        const int before = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + upto - total;
        if (e < experts) {
            offsets[e] = before;
            counts[e] = (float)total;
            for (i64 s = 0; s < segments; ++s) seg[s * experts + e] += before;
        }
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) carry = before + total;
        __syncthreads();
    }
    if (threadIdx.x == 0) offsets[experts] = carry;
    // Placement: the same walk; a pair goes after its expert's earlier
    // pairs of this segment, of this round's lower lanes first.
    if (warp < segments) {
        int* mine = seg + warp * experts;
        unsigned below;
        asm("mov.u32 %0, %%lanemask_lt;" : "=r"(below));
        for (i64 r = 0; r < rounds; ++r) {
            const i64 i = (warp * rounds + r) * 32 + lane;
            const int e = expert_at(i);
            const unsigned peers = __match_any_sync(all, e);
            if (e >= 0) {
                const int p = mine[e] + __popc(peers & below);
                tokens[p] = (int)(i / k);
                position[i] = p;
            }
            __syncwarp();
            if (e >= 0 && lane == __ffs(peers) - 1) mine[e] += __popc(peers);
            __syncwarp();
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

// ------------------------------------------------------------- tensor cores

typedef unsigned short u16;
typedef unsigned int u32;

// One thread's 8-element (16-byte) chunks of a [rows][cols] shared tile from
// a row-major global matrix: chunk c of the tile is row c / (cols / 8),
// columns 8·(c % (cols / 8)) ..; `row_ok` and `col_ok` say which exist.
template <int ROWS, int COLS, int SD, typename RowOk, typename Src>
__device__ __forceinline__ void stage(u16* dst, RowOk row_ok, Src src, int col0, int cols_total) {
    constexpr int PER_ROW = COLS / 8, CHUNKS = ROWS * PER_ROW;
    for (int c = threadIdx.x; c < CHUNKS; c += GMM_THREADS) {
        const int r = c / PER_ROW, col = (c % PER_ROW) * 8;
        const bool ok = row_ok(r) && col0 + col < cols_total;
        // Nothing is read when !ok (the chunk is zero-filled).
        cp_async<16>(dst + r * SD + col, src(ok ? r : 0) + (ok ? col0 + col : 0), ok);
    }
}

// The A fragment (16 rows × 16 depth) at rows m0.., depth k0.. of a tile
// stored [m][k] (`load_a_mk`) or [k][m] (`load_a_km`, loaded transposed).
template <int SD> __device__ __forceinline__ void load_a_mk(u32* a, const u16* s, int m0, int k0, int lane) {
    sg_ldsm4(a, s + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + k0 + (lane >> 4) * 8);
}
template <int SD> __device__ __forceinline__ void load_a_km(u32* a, const u16* s, int m0, int k0, int lane) {
    sg_ldsm4t(a, s + (k0 + (lane & 7) + ((lane >> 4) & 1) * 8) * SD + m0 + ((lane >> 3) & 1) * 8);
}
// The B fragments of two n-tiles (16 depth × 16 columns) at depth k0..,
// columns n0.. of a tile stored [n][k] (`load_b_nk`) or [k][n] (`load_b_kn`).
template <int SD> __device__ __forceinline__ void load_b_nk(u32* b, const u16* s, int n0, int k0, int lane) {
    sg_ldsm4(b, s + (n0 + (lane & 7) + (lane >> 4) * 8) * SD + k0 + ((lane >> 3) & 1) * 8);
}
template <int SD> __device__ __forceinline__ void load_b_kn(u32* b, const u16* s, int k0, int n0, int lane) {
    sg_ldsm4t(b, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * SD + n0 + (lane >> 4) * 8);
}

// The accumulators of one warp's 64 × 32 outputs: [m-tile][n-tile][4].
struct GmmAcc {
    float c[4][4][4];
};

// One GMM_BK step of a warp's outputs from the staged tiles: A stored
// [m][k] (A_KM false) or [k][m]; B stored [n][k] (B_NK) or [k][n].
template <typename T, bool A_KM, bool B_NK, int SA, int SB>
__device__ __forceinline__ void gmm_step(GmmAcc& acc, const u16* as, const u16* bs, int wm, int wn, int lane) {
#pragma unroll
    for (int kk = 0; kk < GMM_BK; kk += 16) {
        u32 a[4][4], b[2][4];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            if (A_KM)
                load_a_km<SA>(a[mi], as, wm * 64 + mi * 16, kk, lane);
            else
                load_a_mk<SA>(a[mi], as, wm * 64 + mi * 16, kk, lane);
        }
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
            if (B_NK)
                load_b_nk<SB>(b[nj], bs, wn * 32 + nj * 16, kk, lane);
            else
                load_b_kn<SB>(b[nj], bs, kk, wn * 32 + nj * 16, lane);
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) Mma16<T>::mma(acc.c[mi][ni], a[mi], b[ni / 2][2 * (ni % 2)], b[ni / 2][2 * (ni % 2) + 1]);
    }
}

// Stores a warp's outputs at out[row·ld + col] for rows below `rows_end`
// and columns below `cols_end` (both relative to the block's origin),
// each f32 sum rounded once; ld and the columns are even.
template <typename T>
__device__ __forceinline__ void gmm_store(const GmmAcc& acc, T* out, i64 ld, int rows_end, int cols_end, int wm,
                                          int wn, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int col = wn * 32 + ni * 8 + 2 * t;
            if (col >= cols_end) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = wm * 64 + mi * 16 + g + 8 * h;
                if (row >= rows_end) continue;
                *reinterpret_cast<u32*>(out + (i64)row * ld + col) =
                    Mma16<T>::pack(acc.c[mi][ni][2 * h], acc.c[mi][ni][2 * h + 1]);
            }
        }
}

template <typename T, bool TRANS_W>
__device__ __forceinline__ void grouped_mma(const T* x, const T* w, const int* offsets, T* y, i64 m, i64 k, i64 n,
                                            i64 experts) {
    constexpr int SA = GMM_BK + GMM_PAD;
    constexpr int SB = TRANS_W ? GMM_BN + GMM_PAD : GMM_BK + GMM_PAD;
    constexpr int B_ELEMS = TRANS_W ? GMM_BK * SB : GMM_BN * SB;
    __shared__ __align__(16) u16 as[2][GMM_BM * SA];
    __shared__ __align__(16) u16 bs[2][B_ELEMS];
    // This block's row tile: the blockIdx.x-th in expert order.
    i64 tile = blockIdx.x, expert = -1, row0 = 0, row_end = 0;
    for (i64 e = 0; e < experts; ++e) {
        i64 lo = offsets[e], hi = offsets[e + 1];
        lo = lo < 0 ? 0 : (lo > m ? m : lo);
        hi = hi < lo ? lo : (hi > m ? m : hi);
        const i64 tiles = (hi - lo + GMM_BM - 1) / GMM_BM;
        if (tile < tiles) {
            expert = e, row0 = lo + tile * GMM_BM, row_end = hi;
            break;
        }
        tile -= tiles;
    }
    if (expert < 0) return;
    const int n0 = blockIdx.y * GMM_BN;
    const u16* xs = reinterpret_cast<const u16*>(x);
    const u16* we = reinterpret_cast<const u16*>(w) + expert * k * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
    const int rows = (int)(row_end - row0 < GMM_BM ? row_end - row0 : GMM_BM);
    auto load = [&](int buf, i64 k0) {
        stage<GMM_BM, GMM_BK, SA>(
            as[buf], [&](int r) { return r < rows; }, [&](int r) { return xs + (row0 + r) * k; }, (int)k0, (int)k);
        if (TRANS_W)  // w[e] is [k][n]: depth rows k0.., columns n0..
            stage<GMM_BK, GMM_BN, SB>(
                bs[buf], [&](int r) { return k0 + r < k; }, [&](int r) { return we + (k0 + r) * n; }, n0, (int)n);
        else  // w[e] is [n][k]: rows n0.., depth k0..
            stage<GMM_BN, GMM_BK, SB>(
                bs[buf], [&](int r) { return n0 + r < n; }, [&](int r) { return we + (i64)(n0 + r) * k; }, (int)k0,
                (int)k);
        cp_commit();
    };
    GmmAcc acc = {};
    const i64 steps = (k + GMM_BK - 1) / GMM_BK;
    load(0, 0);
    for (i64 s = 0; s < steps; ++s) {
        if (s + 1 < steps) load((int)((s + 1) & 1), (s + 1) * GMM_BK);
        else cp_commit();
        cp_wait<1>();
        __syncthreads();
        gmm_step<T, false, !TRANS_W, SA, SB>(acc, as[s & 1], bs[s & 1], wm, wn, lane);
        __syncthreads();
    }
    gmm_store<T>(acc, y + row0 * n + n0, n, rows, (int)(n - n0 < GMM_BN ? n - n0 : GMM_BN), wm, wn, lane);
}

template <typename T>
__device__ __forceinline__ void grouped_mma_weight_grad(const T* a, const T* b, const int* offsets, T* out, i64 m,
                                                        i64 na, i64 nb, i64 experts) {
    constexpr int S = GMM_BM + GMM_PAD;  // GMM_BM == GMM_BN: both tiles [GMM_BK][S]
    __shared__ __align__(16) u16 as[2][GMM_BK * S];
    __shared__ __align__(16) u16 bs[2][GMM_BK * S];
    const i64 e = blockIdx.z;
    i64 lo = offsets[e], hi = offsets[e + 1];
    lo = lo < 0 ? 0 : (lo > m ? m : lo);
    hi = hi < lo ? lo : (hi > m ? m : hi);
    const int i0 = blockIdx.x * GMM_BM, j0 = blockIdx.y * GMM_BN;
    const u16* au = reinterpret_cast<const u16*>(a);
    const u16* bu = reinterpret_cast<const u16*>(b);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
    auto load = [&](int buf, i64 p0) {
        stage<GMM_BK, GMM_BM, S>(
            as[buf], [&](int r) { return p0 + r < hi; }, [&](int r) { return au + (p0 + r) * na; }, i0, (int)na);
        stage<GMM_BK, GMM_BN, S>(
            bs[buf], [&](int r) { return p0 + r < hi; }, [&](int r) { return bu + (p0 + r) * nb; }, j0, (int)nb);
        cp_commit();
    };
    GmmAcc acc = {};
    const i64 steps = (hi - lo + GMM_BK - 1) / GMM_BK;
    if (steps > 0) load(0, lo);
    for (i64 s = 0; s < steps; ++s) {
        if (s + 1 < steps) load((int)((s + 1) & 1), lo + (s + 1) * GMM_BK);
        else cp_commit();
        cp_wait<1>();
        __syncthreads();
        gmm_step<T, true, false, S, S>(acc, as[s & 1], bs[s & 1], wm, wn, lane);
        __syncthreads();
    }
    const int rows_end = (int)(na - i0 < GMM_BM ? na - i0 : GMM_BM);
    const int cols_end = (int)(nb - j0 < GMM_BN ? nb - j0 : GMM_BN);
    gmm_store<T>(acc, out + e * na * nb + (i64)i0 * nb + j0, nb, rows_end, cols_end, wm, wn, lane);
}

}  // namespace sg_moe

#define SG_MOE_MMA_KERNELS(sfx, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(GMM_THREADS)                                                 \
        grouped_mma_nt_##sfx(const T* x, const T* w, const int* offsets, T* y, i64 m, i64 k, i64 n,           \
                             i64 experts, i64 trans_w) { sg_pdl_entry(); \
        sg_moe::grouped_mma<T, false>(x, w, offsets, y, m, k, n, experts);                                    \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GMM_THREADS)                                                 \
        grouped_mma_nn_##sfx(const T* x, const T* w, const int* offsets, T* y, i64 m, i64 k, i64 n,           \
                             i64 experts, i64 trans_w) { sg_pdl_entry(); \
        sg_moe::grouped_mma<T, true>(x, w, offsets, y, m, k, n, experts);                                     \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GMM_THREADS)                                                 \
        grouped_mma_weight_grad_##sfx(const T* a, const T* b, const int* offsets, T* out, i64 m, i64 na,      \
                                      i64 nb, i64 experts) { sg_pdl_entry(); \
        sg_moe::grouped_mma_weight_grad<T>(a, b, offsets, out, m, na, nb, experts);                           \
    }
SG_MOE_MMA_KERNELS(bf16, __nv_bfloat16)
SG_MOE_MMA_KERNELS(f16, __half)

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
    extern "C" __global__ void __launch_bounds__(SG_SORT_THREADS)                                             \
        expert_sort_##sfx(const Id* ids, int* tokens, int* position, int* offsets, float* counts, i64 pairs,  \
                          i64 k, i64 experts) { sg_pdl_entry(); \
        sg_moe::expert_sort<Id>(ids, tokens, position, offsets, counts, pairs, k, experts);                   \
    }
SG_MOE_SORT_KERNEL(i32, int)
SG_MOE_SORT_KERNEL(i64, long long)
