// A spike, not product code: checks on a Hopper GPU what the attention
// kernels would rely on to load their tiles with the tensor copy engine
// (TMA) into 128-byte-swizzled shared memory and multiply them with wgmma:
//
//   copy   one 64 × 64 bf16 box of a [100][200] tensor by
//          cp.async.bulk.tensor.2d with SWIZZLE_128B, at column 100 (a box
//          starting 200 bytes into a row, as a head of 100 elements does)
//          and at column 164 and row 50 (boxes reaching past the tensor's
//          columns and rows): the shared bytes against element (r, c) at
//          r·128 + ((2c / 16) xor (r mod 8))·16 + 2c mod 16, zero outside;
//   k_k    C[64×64] = A·Bᵀ with A [64 m][64 k] and Bᵀ [64 n][64 k] each one
//          swizzled box (K-major, q·kᵀ), descriptors in 128B-swizzle mode,
//          the start address advanced 32 bytes per k16 step, for several
//          leading / stride byte offsets;
//   k_mn   C[64×128] = A·B with B [64 k][128 n] (MN-major, p·v) as two
//          swizzled boxes of 64 n × 64 k, 8 KB apart, read with the
//          transpose bit; the start address advanced 2048 bytes (16 k rows)
//          per k16 step, for several leading / stride byte offsets.
//
// Prints one line per case with the relative error against the product
// computed here; the offsets at ~1e-7 are how wgmma reads that layout.
//
// Seen on an H100 (driver 580.159.04): k_k reads the swizzled boxes right
// with a stride byte offset of 1024 and any leading one (0, 16, 1024,
// 8192); every k_mn case stops with an illegal memory access. `copy` lands
// the box at (0, 0) exactly as the 128-byte swizzle says, and the box at
// column 164 (328 bytes into a row, not a multiple of 16) stops with an
// illegal instruction. So did a build of the attention forward whose boxes
// started at heads of 100 columns (200 bytes apart), while its boxes at
// multiples of 16 bytes ran: a box must start on a 16-byte boundary of its
// row, so such a head is read from the boundary before it.
//
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tma_spike.cu -lcuda -o tma_spike && ./tma_spike
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

typedef unsigned int u32;
typedef unsigned long long u64;

#define CU(x)                                                              \
    do {                                                                   \
        CUresult r_ = (x);                                                 \
        if (r_ != CUDA_SUCCESS) {                                          \
            const char* m_ = "";                                           \
            cuGetErrorString(r_, &m_);                                     \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, m_); \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}
// Box at (column c0, row r0) of `map` into dst, completing on bar.
__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, u64* bar, int c0, int r0) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
            smem_u32(dst)),
        "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(r0)
        : "memory");
}

// 128B-swizzle descriptor: start, leading and stride byte offsets (>> 4),
// layout type 1 (128-byte swizzle) in bits 62-63.
__device__ __forceinline__ u64 desc_sw128(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr >> 4) & 0x3fff) | ((u64)((lbo >> 4) & 0x3fff) << 16) | ((u64)((sbo >> 4) & 0x3fff) << 32) |
           (1ull << 62);
}

__shared__ __align__(1024) unsigned char s_a[8192], s_b[16384];
__shared__ u64 s_bar;

// One 64 × 64 bf16 box (8 KB) of `map` at (column c0, row r0) into dst.
struct Box {
    void* dst;
    const CUtensorMap* map;
    int c0, r0;
};
// The boxes, issued by thread 0 onto s_bar and waited for by every thread.
template <int N> __device__ void load_boxes(const Box (&boxes)[N]) {
    if (threadIdx.x == 0) {
        mbar_init(&s_bar);
        mbar_expect(&s_bar, N * 8192);
        for (const Box& b : boxes) tma_2d(b.dst, b.map, &s_bar, b.c0, b.r0);
    }
    __syncthreads();
    mbar_wait(&s_bar, 0);
}

extern "C" __global__ void copy(const __grid_constant__ CUtensorMap map, int c0, int r0, unsigned char* out) {
    const Box boxes[] = {{s_a, &map, c0, r0}};
    load_boxes(boxes);
    for (int i = threadIdx.x; i < 8192; i += blockDim.x) out[i] = s_a[i];
}

#define R32 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define R64                                                                                                            \
    R32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%" \
        "58,%59,%60,%61,%62,%63"
#define O8(d, i)                                                                                                       \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define O32(d) O8(d, 0), O8(d, 8), O8(d, 16), O8(d, 24)
#define O64(d) O32(d), O8(d, 32), O8(d, 40), O8(d, 48), O8(d, 56)

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// C in the accumulator layout: warp w, lane 4g + c holds rows 16w + g and
// 16w + g + 8, columns 8j + 2c and + 1 in d[4j..4j+4].
__device__ void store_c(float* c, const float* d, int n) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, cc = lane & 3;
    for (int j = 0; j < n / 8; ++j) {
        const int r0 = 16 * w + g, col = 8 * j + 2 * cc;
        c[r0 * n + col] = d[4 * j];
        c[r0 * n + col + 1] = d[4 * j + 1];
        c[(r0 + 8) * n + col] = d[4 * j + 2];
        c[(r0 + 8) * n + col + 1] = d[4 * j + 3];
    }
}

// A [64 m][64 k] and Bᵀ [64 n][64 k], both row-major boxes of their maps.
extern "C" __global__ void __launch_bounds__(128) k_k(const __grid_constant__ CUtensorMap ma,
                                                       const __grid_constant__ CUtensorMap mb, float* c, u32 a_lbo,
                                                       u32 a_sbo, u32 lbo, u32 sbo) {
    const Box boxes[] = {{s_a, &ma, 0, 0}, {s_b, &mb, 0, 0}};
    load_boxes(boxes);
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    fence();
    for (int ks = 0; ks < 4; ++ks) {
        const u64 da = desc_sw128(smem_u32(s_a) + ks * 32, a_lbo, a_sbo);
        const u64 db = desc_sw128(smem_u32(s_b) + ks * 32, lbo, sbo);
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" R32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : O32(d)
                     : "l"(da), "l"(db));
    }
    commit_wait();
    store_c(c, d, 64);
}

// A [64 m][64 k] as in k_k; B [64 k][128 n] as two boxes of 64 n (columns
// 0..63 at s_b, 64..127 at s_b + 8192), read MN-major (transpose bit).
extern "C" __global__ void __launch_bounds__(128) k_mn(const __grid_constant__ CUtensorMap ma,
                                                        const __grid_constant__ CUtensorMap mb, float* c, u32 a_lbo,
                                                        u32 a_sbo, u32 lbo, u32 sbo) {
    const Box boxes[] = {{s_a, &ma, 0, 0}, {s_b, &mb, 0, 0}, {s_b + 8192, &mb, 64, 0}};
    load_boxes(boxes);
    float d[64];
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    fence();
    for (int ks = 0; ks < 4; ++ks) {
        const u64 da = desc_sw128(smem_u32(s_a) + ks * 32, a_lbo, a_sbo);
        const u64 db = desc_sw128(smem_u32(s_b) + ks * 2048, lbo, sbo);
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" R64 "}, %64, %65, p, 1, 1, 0, 1;\n}\n"
                     : O64(d)
                     : "l"(da), "l"(db));
    }
    commit_wait();
    store_c(c, d, 128);
}

// A 2D bf16 tensor map over `rows` rows of `cols` elements (row stride
// cols · 2 bytes), 64 × 64 boxes, 128-byte swizzle, zeros outside.
static CUtensorMap map_2d(void* base, u64 cols, u64 rows) {
    CUtensorMap m;
    const cuuint64_t dims[2] = {cols, rows}, strides[1] = {cols * 2};
    const cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
    CU(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, elem,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return m;
}

static unsigned short bf16_bits(float x) {
    const __nv_bfloat16 h = __float2bfloat16(x);
    return *reinterpret_cast<const unsigned short*>(&h);
}

// Random bf16 values in [-1, 1): their bits and their values.
static void fill(std::vector<unsigned short>& bits, std::vector<float>& vals, unsigned seed) {
    for (size_t i = 0; i < bits.size(); ++i) {
        seed = seed * 1664525u + 1013904223u;
        const float x = __bfloat162float(__float2bfloat16(((seed >> 8) & 0xffff) / 32768.f - 1.f));
        vals[i] = x;
        bits[i] = bf16_bits(x);
    }
}

static void* upload(const void* p, size_t bytes) {
    void* d;
    cudaMalloc(&d, bytes);
    cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice);
    return d;
}

static double rel(const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return std::sqrt(num / den);
}

// With no argument, every case in this process; with `copy`, `k_k` or
// `k_mn N`, that case alone (a case that faults ends the process's
// context, so run.sh runs each in a process of its own).
int main(int argc, char** argv) {
    const std::string only = argc > 1 ? argv[1] : "";
    const int only_config = argc > 2 ? atoi(argv[2]) : -1;
    cudaFree(0);
    // Launches the kernel `f` of this file on one block of 128 threads.
    auto launch = [](const void* f, void** args) {
        if (cudaLaunchKernel(f, dim3(1), dim3(128), args, 0, 0) != cudaSuccess ||
            cudaDeviceSynchronize() != cudaSuccess) {
            printf("launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
            exit(1);
        }
    };

    // k_k and k_mn.
    std::vector<unsigned short> a(64 * 64), bt(64 * 64), b(64 * 128);
    std::vector<float> av(64 * 64), btv(64 * 64), bv(64 * 128);
    fill(a, av, 1);
    fill(bt, btv, 2);
    fill(b, bv, 3);
    void *da = upload(a.data(), a.size() * 2), *dbt = upload(bt.data(), bt.size() * 2),
         *db = upload(b.data(), b.size() * 2);
    CUtensorMap ma = map_2d(da, 64, 64), mbt = map_2d(dbt, 64, 64), mb = map_2d(db, 128, 64);
    float* dc;
    cudaMalloc(&dc, 64 * 128 * 4);
    std::vector<double> want_k(64 * 64, 0.0), want_mn(64 * 128, 0.0);
    for (int m = 0; m < 64; ++m)
        for (int k = 0; k < 64; ++k) {
            for (int n = 0; n < 64; ++n) want_k[m * 64 + n] += (double)av[m * 64 + k] * btv[n * 64 + k];
            for (int n = 0; n < 128; ++n) want_mn[m * 128 + n] += (double)av[m * 64 + k] * bv[k * 128 + n];
        }
    const u32 offsets[][2] = {{16, 1024}, {0, 1024}, {1024, 1024}, {8192, 1024}, {1024, 8192}, {16, 128}};
    // A's offsets in k_mn: the first pair k_k reads correctly.
    u32 a_lbo = 16, a_sbo = 1024;
    bool a_found = false;
    for (auto& o : offsets) {
        if (only != "" && only != "k_k" && only != "k_mn") break;
        u32 lbo = o[0], sbo = o[1];
        void* args[] = {&ma, &mbt, &dc, &lbo, &sbo, &lbo, &sbo};
        cudaMemset(dc, 0xff, 64 * 64 * 4);
        launch(reinterpret_cast<const void*>(k_k), args);
        std::vector<float> c(64 * 64);
        cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost);
        const double e = rel(c, want_k);
        if (only != "k_mn") printf("k_k  lbo %5u sbo %5u: rel %.2e%s\n", lbo, sbo, e, e < 1e-5 ? "   <== matches" : "");
        if (e < 1e-5 && !a_found) a_lbo = lbo, a_sbo = sbo, a_found = true;
    }
    for (size_t k = 0; k < sizeof(offsets) / sizeof(offsets[0]); ++k) {
        if ((only != "" && only != "k_mn") || (only_config >= 0 && (int)k != only_config)) continue;
        u32 lbo = offsets[k][0], sbo = offsets[k][1];
        void* args[] = {&ma, &mb, &dc, &a_lbo, &a_sbo, &lbo, &sbo};
        cudaMemset(dc, 0xff, 64 * 128 * 4);
        launch(reinterpret_cast<const void*>(k_mn), args);
        std::vector<float> c(64 * 128);
        cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost);
        const double e = rel(c, want_mn);
        printf("k_mn A (%u, %u) B lbo %5u sbo %5u: rel %.2e%s\n", a_lbo, a_sbo, lbo, sbo, e,
               e < 1e-5 ? "   <== matches" : "");
    }

    // copy: a [100][200] tensor, boxes at (0, 0), (164, 50) and (100, 0).
    if (only == "" || only == "copy") {
        const int R = 100, C = 200;
        std::vector<unsigned short> g(R * C);
        std::vector<float> gv(R * C);
        fill(g, gv, 7);
        void* dg = upload(g.data(), g.size() * 2);
        CUtensorMap m = map_2d(dg, C, R);
        unsigned char* dout;
        cudaMalloc(&dout, 8192);
        const int at[3][2] = {{0, 0}, {164, 50}, {100, 0}};
        for (auto& a : at) {
            int c0 = a[0], r0 = a[1];
            void* args[] = {&m, &c0, &r0, &dout};
            cudaMemset(dout, 0xee, 8192);
            launch(reinterpret_cast<const void*>(copy), args);
            std::vector<unsigned char> out(8192);
            cudaMemcpy(out.data(), dout, 8192, cudaMemcpyDeviceToHost);
            int bad = 0, bad_plain = 0;
            for (int r = 0; r < 64; ++r)
                for (int c = 0; c < 64; ++c) {
                    const int gr = r0 + r, gc = c0 + c;
                    const unsigned short want = gr < R && gc < C ? g[gr * C + gc] : 0;
                    const int sw = r * 128 + (((2 * c) / 16) ^ (r % 8)) * 16 + (2 * c) % 16;
                    const int plain = r * 128 + 2 * c;
                    bad += *reinterpret_cast<unsigned short*>(&out[sw]) != want;
                    bad_plain += *reinterpret_cast<unsigned short*>(&out[plain]) != want;
                }
            printf("copy box at column %d row %d: %d of 4096 differ from the 128B swizzle (%d from no swizzle)%s\n", c0,
                   r0, bad, bad_plain, bad == 0 ? "   <== matches" : "");
        }
    }

    return 0;
}
