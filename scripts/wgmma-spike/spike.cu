// A spike, not product code: checks on the GPU how wgmma (sm_90a) reads its
// operands, before the Hopper attention kernels rely on it. One warpgroup
// computes C[64×64] = A[64×64] · B[64×64] (bf16 in, f32 out) in four k16
// steps, with
//   kernel `smem_k`:  A and B both from shared memory, K-major (Bᵀ given as
//                     [n][k], the q·kᵀ case);
//   kernel `smem_mn`: B from shared memory MN-major ([k][n], the p·v case)
//                     with the transpose bit;
//   kernel `regs_a`:  A from registers in mma.sync's m16n8k16 A-fragment
//                     layout (what the softmax's f32 results turn into),
//                     B K-major from shared memory.
// Shared memory holds the canonical no-swizzle layout: 8×16-byte core
// matrices; element (row r, k) of a K-major operand at
// (r/8)·SR + (k/8)·SK + (r%8)·16 + (k%8)·2, and of the MN-major B element
// (k, n) at (n/8)·SN + (k/8)·SK + (k%8)·16 + (n%8)·2. The placement strides
// and the descriptor's leading/stride byte offsets come from the host, which
// tries the plausible pairings and reports which reproduce the product.
// Compiled with NVRTC for sm_90a (scripts/nvrtc_cubin.py … --gpu-architecture=sm_90a).

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Matrix descriptor: start address, leading and stride byte offsets (all
// >> 4), no swizzle (bits 62-63 = 0), base offset 0.
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr >> 4) & 0x3fff) | ((u64)((lbo >> 4) & 0x3fff) << 16) | ((u64)((sbo >> 4) & 0x3fff) << 32);
}

#define D32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define DOUT(d)                                                                                                        \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),        \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),         \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),        \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

template <int TB> __device__ __forceinline__ void wgmma_ss(float* d, u64 da, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32 ", %32, %33, p, 1, 1, 0, %34;\n}\n"
                 : DOUT(d)
                 : "l"(da), "l"(db), "n"(TB));
}
__device__ __forceinline__ void wgmma_rs(float* d, const u32* a, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " D32
                 ", {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : DOUT(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// Geometry and descriptor offsets, from the host.
struct Layout {
    int a_sr, a_sk, a_lbo, a_sbo;  // A: placement strides (rows, k) and descriptor offsets
    int b_sr, b_sk, b_lbo, b_sbo;  // B: rows = n (K-major) or the n-groups (MN-major), k
};

// C in the accumulator layout: warp w, lane 4g + c holds rows 16w + g and
// 16w + g + 8, columns 8j + 2c and + 1 in d[4j..4j+4].
__device__ void store_c(float* c, const float* d) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cc = lane & 3;
    for (int j = 0; j < 8; ++j) {
        const int r0 = 16 * w + g, col = 8 * j + 2 * cc;
        c[r0 * 64 + col] = d[4 * j];
        c[r0 * 64 + col + 1] = d[4 * j + 1];
        c[(r0 + 8) * 64 + col] = d[4 * j + 2];
        c[(r0 + 8) * 64 + col + 1] = d[4 * j + 3];
    }
}

// Row-major global [64][64] (element (r, k) at r·64 + k) into the K-major placement.
__device__ void place_k(unsigned char* s, const unsigned short* g, int sr, int sk) {
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        const int r = i / 64, k = i % 64;
        *reinterpret_cast<unsigned short*>(s + (r / 8) * sr + (k / 8) * sk + (r % 8) * 16 + (k % 8) * 2) = g[i];
    }
}
// Row-major global B [k][n] into the MN-major placement.
__device__ void place_mn(unsigned char* s, const unsigned short* g, int sn, int sk) {
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
        const int k = i / 64, n = i % 64;
        *reinterpret_cast<unsigned short*>(s + (n / 8) * sn + (k / 8) * sk + (k % 8) * 16 + (n % 8) * 2) = g[i];
    }
}

__shared__ __align__(128) unsigned char sa[8192], sb[8192];

// A [64][64] row-major, Bt [64 n][64 k] row-major.
extern "C" __global__ void __launch_bounds__(128) smem_k(const unsigned short* a, const unsigned short* bt, float* c,
                                                          Layout l) {
    place_k(sa, a, l.a_sr, l.a_sk);
    place_k(sb, bt, l.b_sr, l.b_sk);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    fence();
    for (int ks = 0; ks < 4; ++ks)
        wgmma_ss<0>(d, desc(smem_u32(sa) + ks * 2 * l.a_sk, l.a_lbo, l.a_sbo),
                    desc(smem_u32(sb) + ks * 2 * l.b_sk, l.b_lbo, l.b_sbo));
    commit_wait();
    store_c(c, d);
}

// A [64][64] row-major, B [64 k][64 n] row-major (MN-major), transposed read.
extern "C" __global__ void __launch_bounds__(128) smem_mn(const unsigned short* a, const unsigned short* b, float* c,
                                                           Layout l) {
    place_k(sa, a, l.a_sr, l.a_sk);
    place_mn(sb, b, l.b_sr, l.b_sk);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    fence();
    for (int ks = 0; ks < 4; ++ks)
        wgmma_ss<1>(d, desc(smem_u32(sa) + ks * 2 * l.a_sk, l.a_lbo, l.a_sbo),
                    desc(smem_u32(sb) + ks * 2 * l.b_sk, l.b_lbo, l.b_sbo));
    commit_wait();
    store_c(c, d);
}

// A from registers: warp w's rows 16w..16w+15; lane 4g + c holds (row g, k
// 2c..2c+1), (row g + 8, same k), (row g, k 2c+8..+9), (row g + 8, same),
// as mma.sync's m16n8k16 A fragment.
extern "C" __global__ void __launch_bounds__(128) regs_a(const unsigned short* a, const unsigned short* bt, float* c,
                                                          Layout l) {
    place_k(sb, bt, l.b_sr, l.b_sk);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cc = lane & 3;
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    fence();
    for (int ks = 0; ks < 4; ++ks) {
        const int r = 16 * w + g, k = 16 * ks + 2 * cc;
        const u32* row0 = reinterpret_cast<const u32*>(a + r * 64);
        const u32* row8 = reinterpret_cast<const u32*>(a + (r + 8) * 64);
        u32 fr[4] = {row0[k / 2], row8[k / 2], row0[k / 2 + 4], row8[k / 2 + 4]};
        wgmma_rs(d, fr, desc(smem_u32(sb) + ks * 2 * l.b_sk, l.b_lbo, l.b_sbo));
    }
    commit_wait();
    store_c(c, d);
}
