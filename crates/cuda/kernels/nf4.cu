// Dequantization of 4-bit NormalFloat weights (QLoRA's NF4), computing
// exactly the CPU reference of crates/core/src/ops/nf4.rs, whose module doc
// defines the format: value = level[code] * absmax of the element's
// 64-element block, one f32 multiply rounded once to the output type; with
// double quantization the block's absmax is (q / 127) * scale + mean, each
// operation a correctly rounded `_rn` intrinsic (never contracted into an
// FMA), so every output element is the CPU's bits.
//
// Launch convention (crates/cuda/src/ops/nf4.rs builds it): 1-D
// grid-stride loops over the `words` packed code words (8 elements each),
// any grid, blockDim.x at most SG_NF4_THREADS (the kernels'
// __launch_bounds__);
// - `nf4_dequantize_<dt>(const int* codes, const float* absmax, T* out,
//    i64 words)`;
// - `nf4_dequantize_dq_<dt>(const int* codes, const int* absmax_codes,
//    const float* scales, i64 groups, T* out, i64 words)`: the i8 absmax
//    codes packed 4 per word, `scales[g]` the scale of group g of 256
//    blocks and `scales[groups]` the mean.
// In place: never (the output is a float tensor, the inputs integer codes
// and scales of another size).

#define SG_NF4_THREADS 256

namespace sg_nf4 {

// The bits of the 16 NF4 levels, ascending (NF4_LEVELS of the CPU
// reference; a unit test of the lowering compares the two lists).
__constant__ unsigned LEVEL_BITS[16] = {
    0xBF800000u, 0xBF3239B1u, 0xBF066B30u, 0xBECA32A0u, 0xBE91A24Du, 0xBE3D353Fu, 0xBDBA7871u, 0x00000000u,
    0x3DA2FAFFu, 0x3E24CAE3u, 0x3E7C04DDu, 0x3EAD033Au, 0x3EE1A4B8u, 0x3F1007ABu, 0x3F3913B3u, 0x3F800000u,
};

// The levels in shared memory: threads of a warp index them with different
// codes, which constant memory would serialize.
__device__ __forceinline__ void load_levels(float* levels) {
    for (int k = threadIdx.x; k < 16; k += blockDim.x) levels[k] = __uint_as_float(LEVEL_BITS[k]);
    __syncthreads();
}

// The absmax of block b under double quantization.
__device__ __forceinline__ float double_absmax(const int* absmax_codes, const float* scales, i64 groups, i64 b) {
    const unsigned word = (unsigned)absmax_codes[b >> 2];
    const int q = (int)(signed char)((word >> (8 * (int)(b & 3))) & 0xFFu);
    return __fadd_rn(__fmul_rn(__fdiv_rn((float)q, 127.0f), scales[b >> 8]), scales[groups]);
}

// The 8 elements of word k, whose block has absmax `a`.
template <typename T> __device__ __forceinline__ void word_out(const float* levels, unsigned word, float a, T* out, i64 k) {
#pragma unroll
    for (int j = 0; j < 8; ++j) store(out, k * 8 + j, (acc_t<T>)__fmul_rn(levels[(word >> (4 * j)) & 0xFu], a));
}

template <typename T> __device__ __forceinline__ void plain(const int* codes, const float* absmax, T* out, i64 words) {
    __shared__ float levels[16];
    load_levels(levels);
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < words; k += (i64)gridDim.x * blockDim.x)
        word_out(levels, (unsigned)codes[k], absmax[k >> 3], out, k);
}

template <typename T>
__device__ __forceinline__ void dq(const int* codes, const int* absmax_codes, const float* scales, i64 groups, T* out,
                                   i64 words) {
    __shared__ float levels[16];
    load_levels(levels);
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < words; k += (i64)gridDim.x * blockDim.x)
        word_out(levels, (unsigned)codes[k], double_absmax(absmax_codes, scales, groups, k >> 3), out, k);
}

}  // namespace sg_nf4

#define SG_NF4_KERNELS(sfx, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(SG_NF4_THREADS)                                               \
        nf4_dequantize_##sfx(const int* codes, const float* absmax, T* out, i64 words) { sg_pdl_entry(); \
        sg_nf4::plain<T>(codes, absmax, out, words);                                                            \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(SG_NF4_THREADS) nf4_dequantize_dq_##sfx(                      \
        const int* codes, const int* absmax_codes, const float* scales, i64 groups, T* out, i64 words) { sg_pdl_entry(); \
        sg_nf4::dq<T>(codes, absmax_codes, scales, groups, out, words);                                         \
    }
SG_FOR_EACH_FLOAT(SG_NF4_KERNELS)
