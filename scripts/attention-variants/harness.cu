// Times and checks builds of the tensor-core attention kernels
// (kernels/attention_mma.cu) outside stepgraph, so that one run on a GPU can
// compare several of them: each build is a CUBIN (made by regs.py with
// NVRTC, exactly as stepgraph compiles it, or by nvcc in run.sh), loaded and
// launched through the driver API. Inputs are drawn from a fixed seed, so
// every build sees the same ones; outputs go to files that compare.py checks
// against PyTorch (f32 math on the same inputs) and against the first build.
//
//   harness CUBIN ABI OUTDIR B T Hq Hkv D REPS
//
// ABI: `base` (the kernels before the commit that added this harness: 64
// rows per block everywhere, o tiles streamed by bwd_kv, no delta) or `new`
// (this checkout's geometry, mirrored from src/ops/attention.rs) or `wg`
// (the warpgroup-MMA backward, built with -DSGM_WGMMA for sm_90a) or `wg2`
// (that and the two-warpgroup forward) or `wg3` (two warpgroups everywhere).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define CU(x)                                                                 \
    do {                                                                      \
        CUresult r_ = (x);                                                    \
        if (r_ != CUDA_SUCCESS) {                                             \
            const char* m_ = "";                                              \
            cuGetErrorString(r_, &m_);                                        \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, m_);    \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float uniform() {  // splitmix64 -> [-1, 1)
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((z >> 11) * (1.0 / 9007199254740992.0)) * 2.f - 1.f;
}

static void save(const std::string& path, const void* dev, size_t bytes) {
    std::vector<char> h(bytes);
    CK(cudaMemcpy(h.data(), dev, bytes, cudaMemcpyDeviceToHost));
    FILE* f = fopen(path.c_str(), "wb");
    fwrite(h.data(), 1, bytes, f);
    fclose(f);
}

static void* upload(size_t n, const std::string& path) {
    std::vector<__nv_bfloat16> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = __float2bfloat16_rn(uniform());
    void* d;
    CK(cudaMalloc(&d, n * 2));
    CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    if (!path.empty()) {
        FILE* f = fopen(path.c_str(), "wb");
        fwrite(h.data(), 2, n, f);
        fclose(f);
    }
    return d;
}

int main(int argc, char** argv) {
    if (argc < 10) return fprintf(stderr, "usage: harness CUBIN ABI OUTDIR B T Hq Hkv D REPS\n"), 2;
    const std::string cubin = argv[1], abi = argv[2], out = argv[3];
    const int B = atoi(argv[4]), T = atoi(argv[5]), Hq = atoi(argv[6]), Hkv = atoi(argv[7]), D = atoi(argv[8]),
              reps = atoi(argv[9]);
    const bool base = abi == "base";
    const int DP = (D + 15) / 16 * 16, SD = DP + 8, row = SD * 2;
    // Geometry of the 16-bit kernels (Geo in attention_mma.cu).
    const int bwd_cols = DP <= 64 ? 64 : 32;
    // ABI `wg`: the warpgroup-MMA backward (WgGeo: one warpgroup per 64
    // rows, six core-matrix tiles of DP columns); the forward as `new`.
    // ABI `wg2`: as `wg`, and the forward of two warpgroups (WgFwd: 256
    // threads, 128 rows, a 128-row q tile, two stages of 128-row k and v
    // tiles, eight mbarriers).
    // ABI `wg3`: as `wg2`, and the backward of two warpgroups (WgBwd: 256
    // threads, 128 rows, three stages of 64-row streamed tiles, mbarriers).
    const bool wg3 = abi == "wg3", wg2 = abi == "wg2" || wg3, wg = abi == "wg" || wg2;
    const int tile = 64 * DP * 2;
    const int fwd_rows = !base && DP > 64 ? 128 : 64, fwd_cols = fwd_rows == 64 ? 64 : 32;
    const int fwd_smem = wg2 ? 5 * 128 * DP * 2 + 64 : (fwd_rows + 4 * fwd_cols) * row;
    const unsigned fwd_threads = wg2 ? 256 : 128;
    const int bq_rows = !wg && !base && DP > 64 && DP < 128 ? 128 : 64;
    const int bq_smem = wg3  ? 4 * tile + 6 * tile + 128 * 8 + 48
                        : wg ? 6 * tile + 2 * 64 * 4
                             : (2 * bq_rows + 4 * bwd_cols) * row + 2 * bq_rows * 4;
    const int bkv_smem = wg3  ? 4 * tile + 3 * (2 * tile + 512) + 48
                         : wg ? 6 * tile + 2 * 64 * 4
                              : (128 + (base ? 6 : 4) * bwd_cols) * row + 2 * bwd_cols * 4;
    const int bwd_rows = wg3 ? 128 : 64;
    const unsigned bwd_threads = wg3 ? 256 : 128;

    CK(cudaFree(0));  // the runtime's primary context, which the driver calls below use
    CUmodule mod;
    CU(cuModuleLoad(&mod, cubin.c_str()));
    CUfunction ffwd, fq, fkv;
    const std::string sfx = "_d" + std::to_string(DP) + "_bf16";
    CU(cuModuleGetFunction(&ffwd, mod, ("attention_mma_fwd" + sfx).c_str()));
    CU(cuModuleGetFunction(&fq, mod, ("attention_mma_bwd_q" + sfx).c_str()));
    CU(cuModuleGetFunction(&fkv, mod, ("attention_mma_bwd_kv" + sfx).c_str()));
    CU(cuFuncSetAttribute(ffwd, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, fwd_smem));
    CU(cuFuncSetAttribute(fq, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bq_smem));
    CU(cuFuncSetAttribute(fkv, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bkv_smem));

    const bool write_inputs = getenv("WRITE_INPUTS") != nullptr;
    const size_t nq = (size_t)B * T * Hq * D, nk = (size_t)B * T * Hkv * D, ns = (size_t)B * Hq * T;
    void* q = upload(nq, write_inputs ? out + "/q.bin" : "");
    void* k = upload(nk, write_inputs ? out + "/k.bin" : "");
    void* v = upload(nk, write_inputs ? out + "/v.bin" : "");
    void* go = upload(nq, write_inputs ? out + "/go.bin" : "");
    void *o, *gq, *gk, *gv, *lse, *delta, *glse = nullptr;
    CK(cudaMalloc(&o, nq * 2));
    CK(cudaMalloc(&gq, nq * 2));
    CK(cudaMalloc(&gk, nk * 2));
    CK(cudaMalloc(&gv, nk * 2));
    CK(cudaMalloc(&lse, ns * 4));
    CK(cudaMalloc(&delta, ns * 4));
    // Poison: every output element must be written.
    for (auto [p, n] : {std::pair{o, nq * 2}, {gq, nq * 2}, {gk, nk * 2}, {gv, nk * 2}, {lse, ns * 4}})
        CK(cudaMemset(p, 0xff, n));

    double scale = 1.0 / sqrt((double)D);
    int Tn = T, hq = Hq, hkv = Hkv, d = D;
    auto launch = [&](CUfunction f, int rows, int heads, int smem, std::vector<void*> args, unsigned threads = 128) {
        CU(cuLaunchKernel(f, (T + rows - 1) / rows, heads, B, threads, 1, 1, smem, 0, args.data(), nullptr));
    };
    auto fwd = [&] {
        launch(ffwd, fwd_rows, Hq, fwd_smem, {&q, &k, &v, &o, &lse, &Tn, &hq, &hkv, &d, &scale}, fwd_threads);
    };
    auto bq = [&] {
        if (base)
            launch(fq, 64, Hq, bq_smem, {&q, &k, &v, &o, &lse, &go, &glse, &gq, &Tn, &hq, &hkv, &d, &scale});
        else
            launch(fq, wg3 ? bwd_rows : bq_rows, Hq, bq_smem,
                   {&q, &k, &v, &o, &lse, &go, &glse, &gq, &delta, &Tn, &hq, &hkv, &d, &scale}, bwd_threads);
    };
    auto bkv = [&] {
        if (base)
            launch(fkv, 64, Hkv, bkv_smem, {&q, &k, &v, &o, &lse, &go, &glse, &gk, &gv, &Tn, &hq, &hkv, &d, &scale});
        else
            launch(fkv, bwd_rows, Hkv, bkv_smem,
                   {&q, &k, &v, &o, &lse, &go, &glse, &delta, &gk, &gv, &Tn, &hq, &hkv, &d, &scale}, bwd_threads);
    };
    fwd();
    bq();  // first: the new key side reads its D_i
    bkv();
    CK(cudaDeviceSynchronize());
    save(out + "/o.bin", o, nq * 2);
    save(out + "/lse.bin", lse, ns * 4);
    save(out + "/gq.bin", gq, nq * 2);
    save(out + "/gk.bin", gk, nk * 2);
    save(out + "/gv.bin", gv, nk * 2);

    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto median_ms = [&](auto&& f) {
        std::vector<float> t;
        for (int i = 0; i < reps; ++i) {
            CK(cudaEventRecord(e0));
            f();
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    const float tf = median_ms(fwd), tq = median_ms(bq), tkv = median_ms(bkv);
    CK(cudaGetLastError());
    // Causal FLOPs: products over the lower triangle (T·(T+1)/2 pairs).
    const double pairs = (double)B * Hq * T * (T + 1) / 2.0, unit = 2.0 * pairs * D;
    printf("fwd %.3f ms (%.0f TFLOP/s)  bwd_q %.3f ms  bwd_kv %.3f ms  bwd %.3f ms (%.0f TFLOP/s at 2.5x fwd)\n", tf,
           2 * unit / tf / 1e9, tq, tkv, tq + tkv, 5 * unit / (tq + tkv) / 1e9);
    return 0;
}
