// Exact f32 products of small matrices on CUDA cores, C = op(A) · op(B)
// (+ addend), for shapes that leave cuBLASLt's f32 kernels few tiles. The
// blas module (`crates/cuda/src/blas/tiled.rs`) offers these kernels to
// tuning as candidates next to cuBLASLt's algorithms.
//
// Why: W3's 256 × 256 × 256 f32 products took 15 µs each under cuBLASLt
// (a `bench --profile` of W3): 4 output tiles, so 4 SMs of 132 did the work,
// each at its own CUDA cores' rate. Tiles of BM × BN = 32 × 32 give such a
// product 64 blocks; 64 × 64 tiles suit larger ones.
//
// Layout: block (x, y, z) owns rows BM·y …, columns BN·x … of batch entry
// z; 256 threads, thread (tx = tid % 16, ty = tid / 16) computes the
// (BM/16) × (BN/16) outputs at rows ty + 16·i, columns tx + 16·j (strided,
// so the 16 threads of a row read consecutive shared words). The depth is
// walked in BK-element slices staged in shared memory; each output's sum
// runs over k in increasing order with one fused multiply-add per term, so
// every run gives the same bits. A is [m, k] ([k, m] when trans_a), B
// [k, n] ([n, k] when trans_b), C [m, n], each contiguous per batch entry.
// The addend (the output's layout, or a bias row) joins in f32 at the end,
// as cuBLASLt's epilogues; there is no other rounding (f32 throughout).

#define TL_THREADS 256
#define TL_BK 16

// Addend kinds (the host's `GemmAddend`).
#define TL_ADD_NONE 0
#define TL_ADD_FULL 1
#define TL_ADD_BIAS 2

// One depth slice of an operand into shared memory: dst[kk][i] = the
// element at outer index o0 + i (a row of op(A), a column of op(B)) and
// depth k0 + kk, zero past `outer` or `k`. The operand is stored [outer, k]
// (`depth_inner`) or [k, outer]; consecutive threads take consecutive
// elements of the stored rows either way.
template <int W>
__device__ __forceinline__ void stage_slice(float (*dst)[W + 1], const float* __restrict__ src, bool depth_inner,
                                            int outer, int k, int o0, int k0) {
    for (int e = threadIdx.x; e < W * TL_BK; e += TL_THREADS) {
        const int i = depth_inner ? e / TL_BK : e % W, kk = depth_inner ? e % TL_BK : e / W;
        const int go = o0 + i, gk = k0 + kk;
        float v = 0.f;
        if (go < outer && gk < k) v = depth_inner ? src[(i64)go * k + gk] : src[(i64)gk * outer + go];
        dst[kk][i] = v;
    }
}

template <int BM, int BN>
__device__ __forceinline__ void tiled(const float* __restrict__ a, const float* __restrict__ b, float* c,
                                      const float* addend, int add_kind, int m, int n, int k, int trans_a,
                                      int trans_b, i64 sa, i64 sb, i64 sc) {
    constexpr int RM = BM / 16, RN = BN / 16;
    // +1 column: a slice row written along the stored matrix's rows hits
    // distinct banks whichever layout it came from.
    __shared__ float As[TL_BK][BM + 1];
    __shared__ float Bs[TL_BK][BN + 1];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const i64 z = blockIdx.z;
    a += z * sa;
    b += z * sb;
    c += z * sc;
    if (add_kind == TL_ADD_FULL) addend += z * sc;
    const int row0 = (int)blockIdx.y * BM, col0 = (int)blockIdx.x * BN;
    float acc[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < k; k0 += TL_BK) {
        stage_slice<BM>(As, a, !trans_a, m, k, row0, k0);
        stage_slice<BN>(Bs, b, trans_b, n, k, col0, k0);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TL_BK; ++kk) {
            float av[RM], bv[RN];
#pragma unroll
            for (int i = 0; i < RM; ++i) av[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < RN; ++j) bv[j] = Bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < RM; ++i)
#pragma unroll
                for (int j = 0; j < RN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) {
            const int r = row0 + ty + 16 * i, col = col0 + tx + 16 * j;
            if (r < m && col < n) {
                const i64 at = (i64)r * n + col;
                float v = acc[i][j];
                if (add_kind == TL_ADD_FULL) v += addend[at];
                if (add_kind == TL_ADD_BIAS) v += addend[col];
                c[at] = v;
            }
        }
}

// tiled_{BM}x{BN}_f32(a, b, c, addend, add_kind, m, n, k, trans_a, trans_b, sa, sb, sc):
// grid (ceil(n / BN), ceil(m / BM), batch), block 256.
#define SG_TILED(BM, BN)                                                                                     \
    extern "C" __global__ void __launch_bounds__(TL_THREADS) tiled_##BM##x##BN##_f32(                        \
        const float* __restrict__ a, const float* __restrict__ b, float* c, const float* addend, int add_kind, \
        int m, int n, int k, int trans_a, int trans_b, i64 sa, i64 sb, i64 sc) { sg_pdl_entry();                             \
        tiled<BM, BN>(a, b, c, addend, add_kind, m, n, k, trans_a, trans_b, sa, sb, sc);                     \
    }
SG_TILED(32, 32)
SG_TILED(64, 64)
SG_TILED(32, 64)
