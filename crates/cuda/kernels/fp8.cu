// FP8 operands (crates/core/src/ops/fp8.rs defines the formats, the scale
// and the packing): the amax and scale of a tensor, and its codes, plain or
// transposed. The CPU reference computes the same bits: |x| and the max are
// exact, the scale is one correctly rounded f32 division, each code one
// correctly rounded multiply (`__fmul_rn`, never contracted) and the
// saturating round-to-nearest-even conversion of PTX's
// `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (CUDA's `__nv_cvt_float_to_fp8`).
//
// Launch convention (crates/cuda/src/ops/fp8.rs builds it):
// - `fp8_amax_<dt>(const T* x, i64 n, unsigned* amax)`: any grid of
//   SG_FP8_THREADS-thread blocks, grid-stride; `*amax` zeroed before (a
//   memset node), then holding the bits of max |x| (an integer max of
//   non-negative floats' bits orders them as floats, and a NaN's bits
//   exceed infinity's, so a NaN wins as it does on the CPU);
// - `fp8_scale_<fmt>(float* out)`: one thread; reads the amax bits from
//   out[0], writes [1 / scale, scale];
// - `fp8_quantize_<fmt>_<dt>(const T* x, const float* scale, unsigned* out,
//   i64 words)`: 1-D grid-stride, one word (4 consecutive elements) per
//   thread and iteration;
// - `fp8_quantize_t_<fmt>_<dt>(const T* x, const float* scale, unsigned*
//   out, i64 rows, i64 cols)`: x `[rows, cols]`, out `[cols, rows / 4]`
//   words; a (32, 8) block per 64 × 64 tile, grid (⌈cols/64⌉, ⌈rows/64⌉).
// In place: never (codes and scales are other tensors).

#include <cuda_fp8.h>

#define SG_FP8_THREADS 256
#define SG_FP8_TILE 64

namespace sg_fp8 {

// The largest scale (2^100) and the formats' largest finite values, as
// FP8_MAX_SCALE and Fp8Format::max_finite of the CPU reference.
#define SG_FP8_MAX_SCALE 1.2676506002282294e30f

template <__nv_fp8_interpretation_t F> __device__ __forceinline__ float max_finite() {
    return F == __NV_E4M3 ? 448.0f : 57344.0f;
}

template <__nv_fp8_interpretation_t F> __device__ __forceinline__ unsigned code(float x, float scale) {
    return (unsigned)__nv_cvt_float_to_fp8(__fmul_rn(x, scale), __NV_SATFINITE, F);
}

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The 16-byte loads of the amax: a uint4 of T holds 16 / sizeof(T) elements.
template <typename T> __device__ __forceinline__ unsigned max_bits16(const uint4& u) {
    const T* v = reinterpret_cast<const T*>(&u);
    unsigned m = 0;
#pragma unroll
    for (int j = 0; j < (int)(16 / sizeof(T)); ++j) m = max(m, abs_bits(load(v, j)));
    return m;
}

template <typename T> __device__ __forceinline__ void amax(const T* x, i64 n, unsigned* out) {
    __shared__ unsigned warp_max_bits[SG_FP8_THREADS / 32];
    unsigned m = 0;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    constexpr int per = 16 / sizeof(T);
    i64 body = 0;
    if ((reinterpret_cast<unsigned long long>(x) & 15) == 0) {
        body = n / per * per;
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        for (i64 i = tid; i < n / per; i += stride) m = max(m, max_bits16<T>(x4[i]));
    }
    for (i64 i = body + tid; i < n; i += stride) m = max(m, abs_bits(load(x, i)));
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max_bits[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = max(m, warp_max_bits[w]);
        if (m != 0) atomicMax(out, m);
    }
}

template <__nv_fp8_interpretation_t F> __device__ __forceinline__ void scale(float* out) {
    const float a = out[0];  // the amax kernel's bits: max |x|
    float s;
    if (!isfinite(a)) s = __int_as_float(0x7fc00000);
    else if (a == 0.0f) s = 1.0f;
    else s = fminf(__fdiv_rn(max_finite<F>(), a), SG_FP8_MAX_SCALE);
    out[0] = __fdiv_rn(1.0f, s);
    out[1] = s;
}

template <__nv_fp8_interpretation_t F, typename T>
__device__ __forceinline__ void quantize(const T* x, const float* scale, unsigned* out, i64 words) {
    const float s = scale[1];
    for (i64 w = (i64)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += (i64)gridDim.x * blockDim.x) {
        const i64 e = w * 4;
        out[w] = code<F>(load(x, e), s) | code<F>(load(x, e + 1), s) << 8 | code<F>(load(x, e + 2), s) << 16 |
                 code<F>(load(x, e + 3), s) << 24;
    }
}

template <__nv_fp8_interpretation_t F, typename T>
__device__ __forceinline__ void quantize_t(const T* x, const float* scale, unsigned* out, i64 rows, i64 cols) {
    // tile[c][r]: the codes of column c0 + c, rows r0 .. r0 + 63; rows
    // padded by a word so the column reads of the store spread over banks.
    __shared__ unsigned char tile[SG_FP8_TILE][SG_FP8_TILE + 4];
    const float s = scale[1];
    const i64 c0 = (i64)blockIdx.x * SG_FP8_TILE, r0 = (i64)blockIdx.y * SG_FP8_TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    for (int r = ty; r < SG_FP8_TILE; r += 8) {
        for (int c = tx; c < SG_FP8_TILE; c += 32) {
            const i64 gr = r0 + r, gc = c0 + c;
            tile[c][r] = gr < rows && gc < cols ? (unsigned char)code<F>(load(x, gr * cols + gc), s) : 0;
        }
    }
    __syncthreads();
    const i64 row_words = rows / 4;
    for (int i = ty * 32 + tx; i < SG_FP8_TILE * SG_FP8_TILE / 4; i += 256) {
        const int c = i / (SG_FP8_TILE / 4), w = i % (SG_FP8_TILE / 4);
        const i64 gc = c0 + c, gw = r0 / 4 + w;
        if (gc < cols && gw < row_words) {
            const unsigned char* t = &tile[c][4 * w];
            out[gc * row_words + gw] = (unsigned)t[0] | (unsigned)t[1] << 8 | (unsigned)t[2] << 16 | (unsigned)t[3] << 24;
        }
    }
}

}  // namespace sg_fp8

#define SG_FP8_FLOATS(M) M(f32, float) M(bf16, __nv_bfloat16) M(f16, __half)

#define SG_FP8_AMAX(sfx, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(SG_FP8_THREADS)                                            \
        fp8_amax_##sfx(const T* x, i64 n, unsigned* amax) { sg_pdl_entry(); sg_fp8::amax<T>(x, n, amax); }
SG_FP8_FLOATS(SG_FP8_AMAX)

#define SG_FP8_FORMAT(fmt, F)                                                                                 \
    extern "C" __global__ void fp8_scale_##fmt(float* out) { sg_pdl_entry(); sg_fp8::scale<F>(out); }        \
    SG_FP8_QUANTIZE(fmt, F, f32, float)                                                                       \
    SG_FP8_QUANTIZE(fmt, F, bf16, __nv_bfloat16)                                                              \
    SG_FP8_QUANTIZE(fmt, F, f16, __half)

#define SG_FP8_QUANTIZE(fmt, F, sfx, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(SG_FP8_THREADS)                                             \
        fp8_quantize_##fmt##_##sfx(const T* x, const float* scale, unsigned* out, i64 words) { sg_pdl_entry(); \
        sg_fp8::quantize<F, T>(x, scale, out, words);                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_FP8_THREADS)                                             \
        fp8_quantize_t_##fmt##_##sfx(const T* x, const float* scale, unsigned* out, i64 rows, i64 cols) { sg_pdl_entry(); \
        sg_fp8::quantize_t<F, T>(x, scale, out, rows, cols);                                                  \
    }

SG_FP8_FORMAT(e4m3, __NV_E4M3)
SG_FP8_FORMAT(e5m2, __NV_E5M2)
