// FP8 operands (crates/core/src/ops/fp8.rs defines the formats, the scale
// and the packing): the amax and scale of a tensor, and its codes, plain or
// transposed. The CPU reference computes the same bits: |x| and the max are
// exact, the scale is one correctly rounded f32 division, each code one
// correctly rounded multiply (`__fmul_rn`, never contracted) and the
// saturating round-to-nearest-even conversion of PTX's
// `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (CUDA's `__nv_cvt_float_to_fp8`).
//
// Launch convention (crates/cuda/src/ops/fp8.rs builds it):
// - `fp8_scale_<fmt>_<dt>(const T* x, i64 n, float* out)`: any grid of
//   SG_FP8_THREADS-thread blocks, grid-stride, `out[0..2]` zeroed before (a
//   memset node). Each block takes max |x| of its share into out[0], as
//   bits (an integer max of non-negative floats' bits orders them as
//   floats, and a NaN's bits exceed infinity's, so a NaN wins as it does on
//   the CPU), and counts itself done in out[1]; the last block done turns
//   the amax into [1 / scale, scale];
// - `fp8_quantize_<fmt>_<dt>(const T* x, const float* scale, unsigned* out,
//   i64 words)`: 1-D grid-stride, 16 bytes of x (8 or 4 elements) per
//   thread and iteration where x is 16-byte aligned, one word (4 elements)
//   otherwise;
// - `fp8_quantize_t_<fmt>_<dt>(const T* x, const float* scale, unsigned*
//   out, unsigned* plain, i64 rows, i64 cols)`: x `[rows, cols]`, out
//   `[cols, rows / 4]` words, and unless `plain` is null the plain codes
//   `[rows, cols / 4]` too; a (32, 8) block per 64 × 64 tile, grid
//   (⌈cols/64⌉, ⌈rows/64⌉). Rows of x are read 16 bytes at a time and the
//   transposed codes stored 16 at a time where the shapes and addresses
//   allow, a word at a time otherwise.
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

// max |x| of this thread's share, as bits.
template <typename T> __device__ __forceinline__ unsigned amax_bits(const T* x, i64 n) {
    unsigned m = 0;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    constexpr int per = 16 / sizeof(T);
    i64 body = 0;
    if ((reinterpret_cast<unsigned long long>(x) & 15) == 0) {
        body = n / per * per;
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        const i64 n4 = n / per;
        i64 i = tid;
        // Four independent loads in flight per thread before their maxima.
        for (; i + 3 * stride < n4; i += 4 * stride) {
            const uint4 a = x4[i], b = x4[i + stride], c = x4[i + 2 * stride], d = x4[i + 3 * stride];
            m = max(m, max(max(max_bits16<T>(a), max_bits16<T>(b)), max(max_bits16<T>(c), max_bits16<T>(d))));
        }
        for (; i < n4; i += stride) m = max(m, max_bits16<T>(x4[i]));
    }
    for (i64 i = body + tid; i < n; i += stride) m = max(m, abs_bits(load(x, i)));
    return m;
}

template <__nv_fp8_interpretation_t F, typename T> __device__ __forceinline__ void scale(const T* x, i64 n, float* out) {
    __shared__ unsigned warp_max_bits[SG_FP8_THREADS / 32];
    unsigned* bits = reinterpret_cast<unsigned*>(out);
    unsigned m = amax_bits(x, n);
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max_bits[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = max(m, warp_max_bits[w]);
    if (m != 0) atomicMax(&bits[0], m);
    // The block's max is visible before it counts itself done, so the last
    // block to count reads every block's.
    __threadfence();
    if (atomicAdd(&bits[1], 1u) != gridDim.x - 1) return;
    const float a = __uint_as_float(atomicOr(&bits[0], 0u));
    float s;
    if (!isfinite(a)) s = __int_as_float(0x7fc00000);
    else if (a == 0.0f) s = 1.0f;
    else s = fminf(__fdiv_rn(max_finite<F>(), a), SG_FP8_MAX_SCALE);
    out[0] = __fdiv_rn(1.0f, s);
    out[1] = s;
}

// The codes of the 16 / sizeof(T) consecutive elements of one 16-byte load
// (8 of 16-bit floats, 4 of f32), packed in element order: PER / 4 words.
template <__nv_fp8_interpretation_t F, typename T> struct Codes16 {
    static constexpr int PER = 16 / sizeof(T);
    unsigned w[PER / 4];
    __device__ __forceinline__ Codes16(const uint4& u, float s) {
        const T* v = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int k = 0; k < PER / 4; ++k)
            w[k] = code<F>(load(v, 4 * k), s) | code<F>(load(v, 4 * k + 1), s) << 8 |
                   code<F>(load(v, 4 * k + 2), s) << 16 | code<F>(load(v, 4 * k + 3), s) << 24;
    }
    __device__ __forceinline__ unsigned char byte(int j) const { return (unsigned char)(w[j / 4] >> (8 * (j % 4))); }
    // Stores the words at word `at` of `out` (aligned to their size).
    __device__ __forceinline__ void store(unsigned* out, i64 at) const {
        if constexpr (PER == 8) *reinterpret_cast<uint2*>(out + at) = make_uint2(w[0], w[1]);
        else out[at] = w[0];
    }
};

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 15) == 0; }

template <__nv_fp8_interpretation_t F, typename T>
__device__ __forceinline__ unsigned word_of(const T* x, i64 e, float s) {
    return code<F>(load(x, e), s) | code<F>(load(x, e + 1), s) << 8 | code<F>(load(x, e + 2), s) << 16 |
           code<F>(load(x, e + 3), s) << 24;
}

template <__nv_fp8_interpretation_t F, typename T>
__device__ __forceinline__ void quantize(const T* x, const float* scale, unsigned* out, i64 words) {
    using C = Codes16<F, T>;
    const float s = scale[1];
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 body = 0;  // words written by 16-byte loads
    if (aligned16(x) && (reinterpret_cast<unsigned long long>(out) & (4 * (C::PER / 4) - 1)) == 0) {
        const i64 groups = words * 4 / C::PER;
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        for (i64 g = tid; g < groups; g += stride) C(x4[g], s).store(out, g * (C::PER / 4));
        body = groups * (C::PER / 4);
    }
    for (i64 w = body + tid; w < words; w += stride) out[w] = word_of<F>(x, w * 4, s);
}

template <__nv_fp8_interpretation_t F, typename T>
__device__ __forceinline__ void quantize_t(const T* x, const float* scale, unsigned* out, unsigned* plain, i64 rows,
                                           i64 cols) {
    using C = Codes16<F, T>;
    constexpr int CHUNKS = SG_FP8_TILE / C::PER;  // 16-byte loads per tile row
    // The codes of the tile transposed: byte r of row c is x[r0 + r][c0 + c].
    // A row is 68 bytes (17 words) so that the byte stores of a warp, which
    // walk the columns, spread over the banks; the words are read whole.
    __shared__ unsigned tile_words[SG_FP8_TILE][SG_FP8_TILE / 4 + 1];
    const auto tile = [&](int c, int r) -> unsigned char& {
        return reinterpret_cast<unsigned char*>(tile_words[c])[r];
    };
    const float s = scale[1];
    const i64 c0 = (i64)blockIdx.x * SG_FP8_TILE, r0 = (i64)blockIdx.y * SG_FP8_TILE;
    const int t = threadIdx.y * 32 + threadIdx.x;
    if (aligned16(x) && cols % C::PER == 0) {
        // A 16-byte chunk of a row is wholly inside the matrix or wholly out.
        for (int i = t; i < SG_FP8_TILE * CHUNKS; i += SG_FP8_THREADS) {
            const int r = i / CHUNKS, ch = i % CHUNKS;
            const i64 gr = r0 + r, gc = c0 + ch * C::PER;
            if (gr < rows && gc < cols) {
                const C codes(*reinterpret_cast<const uint4*>(x + gr * cols + gc), s);
#pragma unroll
                for (int j = 0; j < C::PER; ++j) tile(ch * C::PER + j, r) = codes.byte(j);
            } else {
#pragma unroll
                for (int j = 0; j < C::PER; ++j) tile(ch * C::PER + j, r) = 0;
            }
        }
    } else {
        for (int r = threadIdx.y; r < SG_FP8_TILE; r += 8) {
            for (int c = threadIdx.x; c < SG_FP8_TILE; c += 32) {
                const i64 gr = r0 + r, gc = c0 + c;
                tile(c, r) = gr < rows && gc < cols ? (unsigned char)code<F>(load(x, gr * cols + gc), s) : 0;
            }
        }
    }
    __syncthreads();
    const i64 row_words = rows / 4;
    if (rows % 16 == 0 && aligned16(out)) {
        // 16 codes (four words) per thread: a tile's 64 columns × 4 quads.
        // rows % 16 == 0: a quad is wholly inside the matrix or wholly out.
        const int c = t / 4, q = t % 4;
        const i64 gc = c0 + c, gw = r0 / 4 + 4 * q;
        if (gc < cols && gw < row_words) {
            const unsigned* w = &tile_words[c][4 * q];
            *reinterpret_cast<uint4*>(out + gc * row_words + gw) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    } else {
        for (int i = t; i < SG_FP8_TILE * SG_FP8_TILE / 4; i += SG_FP8_THREADS) {
            const int c = i / (SG_FP8_TILE / 4), w = i % (SG_FP8_TILE / 4);
            const i64 gc = c0 + c, gw = r0 / 4 + w;
            if (gc < cols && gw < row_words) out[gc * row_words + gw] = tile_words[c][w];
        }
    }
    if (plain != nullptr) {
        // Word w of row r holds the codes of columns 4w .. 4w + 3.
        const i64 col_words = cols / 4;
        for (int i = t; i < SG_FP8_TILE * SG_FP8_TILE / 4; i += SG_FP8_THREADS) {
            const int r = i / (SG_FP8_TILE / 4), w = i % (SG_FP8_TILE / 4);
            const i64 gr = r0 + r, gw = c0 / 4 + w;
            if (gr < rows && gw < col_words)
                plain[gr * col_words + gw] = (unsigned)tile(4 * w, r) | (unsigned)tile(4 * w + 1, r) << 8 |
                                             (unsigned)tile(4 * w + 2, r) << 16 | (unsigned)tile(4 * w + 3, r) << 24;
        }
    }
}

}  // namespace sg_fp8

#define SG_FP8_FORMAT(fmt, F)                                                                                 \
    SG_FP8_QUANTIZE(fmt, F, f32, float)                                                                       \
    SG_FP8_QUANTIZE(fmt, F, bf16, __nv_bfloat16)                                                              \
    SG_FP8_QUANTIZE(fmt, F, f16, __half)

#define SG_FP8_QUANTIZE(fmt, F, sfx, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(SG_FP8_THREADS)                                             \
        fp8_scale_##fmt##_##sfx(const T* x, i64 n, float* out) { sg_pdl_entry();                               \
        sg_fp8::scale<F, T>(x, n, out);                                                                       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_FP8_THREADS)                                             \
        fp8_quantize_##fmt##_##sfx(const T* x, const float* scale, unsigned* out, i64 words) { sg_pdl_entry(); \
        sg_fp8::quantize<F, T>(x, scale, out, words);                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_FP8_THREADS) fp8_quantize_t_##fmt##_##sfx(               \
        const T* x, const float* scale, unsigned* out, unsigned* plain, i64 rows, i64 cols) { sg_pdl_entry(); \
        sg_fp8::quantize_t<F, T>(x, scale, out, plain, rows, cols);                                           \
    }

SG_FP8_FORMAT(e4m3, __NV_E4M3)
SG_FP8_FORMAT(e5m2, __NV_E5M2)
