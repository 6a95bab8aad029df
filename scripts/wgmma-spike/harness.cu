// Runs spike.cu's kernels (a CUBIN built by NVRTC for sm_90a) with every
// plausible pairing of shared-memory placement and descriptor offsets and
// prints the relative error of each against the product computed here: the
// pairings at ~1e-7 are how wgmma reads that operand.
//
//   nvcc -O2 -std=c++17 harness.cu -lcuda -o harness && ./harness spike.cubin [KERNEL CONFIG]
// With KERNEL (smem_k, smem_mn, regs_a) and CONFIG (0-15) it runs that one
// pairing only: a pairing that faults ends the process's context, so
// run.sh runs each in a process of its own.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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

struct Layout {
    int a_sr, a_sk, a_lbo, a_sbo;
    int b_sr, b_sk, b_lbo, b_sbo;
};

int main(int argc, char** argv) {
    if (argc != 2 && argc != 4) return fprintf(stderr, "usage: harness spike.cubin [KERNEL CONFIG]\n"), 2;
    const std::string only_kernel = argc == 4 ? argv[2] : "";
    const int only_config = argc == 4 ? atoi(argv[3]) : -1;
    cudaFree(0);
    CUmodule mod;
    CU(cuModuleLoad(&mod, argv[1]));
    std::vector<unsigned short> a(4096), b(4096), bt(4096);
    std::vector<float> af(4096), bf(4096);
    unsigned s = 12345;
    for (int i = 0; i < 4096; ++i) {
        for (auto* v : {&af, &bf}) {
            s = s * 1664525u + 1013904223u;
            const float x = __bfloat162float(__float2bfloat16(((s >> 8) & 0xffff) / 32768.f - 1.f));
            (*v)[i] = x;
        }
        const __nv_bfloat16 ha = __float2bfloat16(af[i]), hb = __float2bfloat16(bf[i]);
        a[i] = *reinterpret_cast<const unsigned short*>(&ha);
        b[i] = *reinterpret_cast<const unsigned short*>(&hb);
    }
    for (int k = 0; k < 64; ++k)
        for (int n = 0; n < 64; ++n) bt[n * 64 + k] = b[k * 64 + n];
    std::vector<double> ref(4096, 0.0);
    for (int m = 0; m < 64; ++m)
        for (int n = 0; n < 64; ++n)
            for (int k = 0; k < 64; ++k) ref[m * 64 + n] += (double)af[m * 64 + k] * bf[k * 64 + n];
    void *da, *db, *dbt, *dc;
    cudaMalloc(&da, 8192);
    cudaMalloc(&db, 8192);
    cudaMalloc(&dbt, 8192);
    cudaMalloc(&dc, 16384);
    cudaMemcpy(da, a.data(), 8192, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b.data(), 8192, cudaMemcpyHostToDevice);
    cudaMemcpy(dbt, bt.data(), 8192, cudaMemcpyHostToDevice);
    // Placements: 8-row (or 8-n) groups 1024 bytes apart and k groups 128
    // apart ("k-fast"), or the other way round ("rows-fast"); descriptors:
    // LBO the k-direction stride and SBO the row one ("lbo=k"), or swapped.
    struct P {
        const char* name;
        int sr, sk;
    } places[] = {{"k-fast", 1024, 128}, {"rows-fast", 128, 1024}};
    const char* kernels[] = {"smem_k", "smem_mn", "regs_a"};
    for (const char* kn : kernels) {
        if (!only_kernel.empty() && only_kernel != kn) continue;
        int config = -1;
        CUfunction f;
        CU(cuModuleGetFunction(&f, mod, kn));
        for (auto pa : places)
            for (int swap_a = 0; swap_a < 2; ++swap_a)
                for (auto pb : places)
                    for (int swap_b = 0; swap_b < 2; ++swap_b) {
                        ++config;
                        if (only_config >= 0 && config != only_config) continue;
                        Layout l{pa.sr, pa.sk, swap_a ? pa.sr : pa.sk, swap_a ? pa.sk : pa.sr,
                                 pb.sr, pb.sk, swap_b ? pb.sr : pb.sk, swap_b ? pb.sk : pb.sr};
                        const bool a_unused = std::string(kn) == "regs_a";
                        if (a_unused && (pa.sr != 1024 || swap_a)) continue;
                        void* bptr = std::string(kn) == "smem_mn" ? db : dbt;
                        void* args[] = {&da, &bptr, &dc, &l};
                        cudaMemset(dc, 0xff, 16384);
                        CU(cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, 0, args, nullptr));
                        const CUresult r = cuCtxSynchronize();
                        if (r != CUDA_SUCCESS) {
                            const char* m = "";
                            cuGetErrorString(r, &m);
                            printf("%-8s A %-9s %s  B %-9s %s: launch failed: %s\n", kn, pa.name,
                                   swap_a ? "lbo=rows" : "lbo=k   ", pb.name, swap_b ? "lbo=rows" : "lbo=k   ", m);
                            return 1;  // the context is gone after a fault
                        }
                        std::vector<float> c(4096);
                        cudaMemcpy(c.data(), dc, 16384, cudaMemcpyDeviceToHost);
                        double num = 0, den = 0;
                        for (int i = 0; i < 4096; ++i) {
                            num += (c[i] - ref[i]) * (c[i] - ref[i]);
                            den += ref[i] * ref[i];
                        }
                        printf("%-8s A %-9s %s  B %-9s %s: rel %.2e%s\n", kn, a_unused ? "(regs)" : pa.name,
                               a_unused ? "        " : swap_a ? "lbo=rows" : "lbo=k   ", pb.name,
                               swap_b ? "lbo=rows" : "lbo=k   ", std::sqrt(num / den),
                               std::sqrt(num / den) < 1e-5 ? "   <== matches" : "");
                    }
    }
    return 0;
}
