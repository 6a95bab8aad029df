// Initial weights drawn in place on the device, bit for bit what the host
// draws (crates/core/src/models/init.rs, whose module doc gives the
// distribution): element i of a random weight is the splitmix64 output
// number i + 1 of the parameter's stream, its four 16-bit quarters summed
// (an integer), centred, converted exactly to float and multiplied once by
// `scale` with round-to-nearest-even; then stored in the parameter's dtype,
// rounded to nearest even. Integer operations and one `__fmul_rn` only, so
// nothing depends on the device's math library or on FMA contraction.
//
// Launch convention (crates/cuda/src/init.rs builds it): a 1-D grid-stride
// loop over the n elements, any grid, blockDim.x at most SG_INIT_THREADS;
// `init_param_<dt>(T* out, i64 n, u64 stream, int kind, float scale)` with
// kind 0 zeros, 1 ones, 2 random, 3 uniform (the stream and the scale are
// computed on the host: `param_stream`, `ParamInit::scale`). Writes every element of
// out and reads nothing.

#define SG_INIT_THREADS 256

namespace sg_init {

typedef unsigned long long u64;

// splitmix64's increment and output function (Stafford's mix 13), as `mix64`
// and `SPLITMIX_GAMMA` in init.rs.
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float value(u64 stream, i64 i, int kind, float scale) {
    if (kind == 0) return 0.0f;
    if (kind == 1) return 1.0f;
    u64 z = mix64(stream + ((u64)i + 1ull) * 0x9E3779B97F4A7C15ull);
    if (kind == 3) {
        // Uniform (a LoRA A matrix): the top 24 bits, centred; |centred| <= 2^23, exact.
        int centred = (int)(z >> 40) - 8388608;
        return __fmul_rn(__int2float_rn(centred), scale);
    }
    // |centred| <= 131070 < 2^24: the conversion is exact.
    int centred = (int)(z & 0xFFFFull) + (int)((z >> 16) & 0xFFFFull) + (int)((z >> 32) & 0xFFFFull) +
                  (int)(z >> 48) - 131070;
    return __fmul_rn(__int2float_rn(centred), scale);
}

template <typename T> __device__ __forceinline__ void fill(T* out, i64 n, u64 stream, int kind, float scale) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        // `store` rounds to nearest even (f32 → bf16/f16) or widens exactly (f64).
        store(out, i, value(stream, i, kind, scale));
    }
}

}  // namespace sg_init

#define SG_INIT_KERNEL(dt, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(SG_INIT_THREADS)                                           \
        init_param_##dt(T* out, i64 n, unsigned long long stream, int kind, float scale) { sg_pdl_entry();                  \
        sg_init::fill(out, n, stream, kind, scale);                                                         \
    }
SG_FOR_EACH_FLOAT(SG_INIT_KERNEL)
