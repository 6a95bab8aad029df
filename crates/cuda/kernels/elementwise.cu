// Pointwise kernels: constant fill, unary maps and their backward, binary
// maps with numpy broadcasting, and dtype casts. They compute exactly the CPU
// reference's formulas (crates/core/src/ops/elementwise.rs) in acc_t.
//
// Launch conventions (src/ops/elementwise.rs builds them):
// - 1-D grid-stride loops over the n output elements: any grid, blockDim.x
//   at most SG_EW_THREADS (256, the kernels' __launch_bounds__);
// - `full_<dt>(T* y, i64 n, double value)`;
// - `<f>_<dt>(const T* x, T* y, i64 n, double p)` for every UnaryFn name f
//   (p is pow's exponent, ignored by the others);
// - `<f>_backward_<dt>(const T* x, const T* g, T* y, i64 n, double p)`;
// - `<add|sub|mul|div>_<dt>(const T* a, const T* b, T* y, i64 n, BinaryShape s)`;
// - `<add|sub|mul|div>_vec_<dt>(const T* a, const T* b, T* y, i64 n)`: the
//   same map for operands of the output's shape, contiguous, every address
//   16-byte aligned (the lowering checks): each thread moves 16 bytes per
//   operand per iteration (8 bf16/f16, 4 f32, 2 f64), the last n mod that
//   element by element. The same formula per element, so the same bits;
//   launch over n / (16 / sizeof(T)) threads;
// - `cast_<src>_<dst>(const S* x, D* y, i64 n)`.
// In-place: y may equal x (unary), g (unary backward) or an input of the
// output's shape (binary). Every thread reads element i of its inputs before
// writing element i of y, and no pointer is __restrict__, so that is safe.
//
// The CPU reference never fuses a multiply and an add; formulas below use the
// `_rn` intrinsics, which the compiler never contracts into an FMA, so every
// basic operation rounds as on the CPU and only the library functions (exp,
// tanh, ...) may differ in the last bits.

// Threads per block of every kernel here (src/ops/util.rs THREADS: every launch uses exactly this many).
#define SG_EW_THREADS 256

namespace sg_ew {

constexpr int kMaxRank = 8;

// exp_, tanh_, eval<F>, derivative<F> and the rest of the unary maps'
// math are in activation.cuh (prepended to this module), shared with the
// gated activations of glu.cu.
using namespace sg_act;

// Output shape and per-input element strides (0 on broadcast axes), after the
// host merged contiguous axes. Axes [0, rank) are used; rank >= 1.
struct BinaryShape {
    i64 rank;
    i64 size[kMaxRank];
    i64 sa[kMaxRank];
    i64 sb[kMaxRank];
};

// Input offsets of output element i. I is the index type of the divisions:
// 32-bit when every index fits (much cheaper than 64-bit division).
template <typename I>
__device__ __forceinline__ void binary_offsets(const BinaryShape& s, i64 i, i64& ia, i64& ib) {
    if (s.rank == 1) {
        ia = i * s.sa[0];
        ib = i * s.sb[0];
        return;
    }
    I rem = (I)i;
    ia = 0;
    ib = 0;
#pragma unroll
    for (int d = kMaxRank - 1; d >= 0; --d) {
        if (d < s.rank) {
            I sz = (I)s.size[d];
            I c = rem % sz;
            rem /= sz;
            ia += (i64)c * s.sa[d];
            ib += (i64)c * s.sb[d];
        }
    }
}

enum BinFn { ADD, SUB, MUL, DIV };

template <int F, typename A> __device__ __forceinline__ A binary_eval(A a, A b) {
    switch (F) {
        case ADD: return add_rn(a, b);
        case SUB: return sub_rn(a, b);
        case MUL: return mul_rn(a, b);
        default: return div_rn(a, b);
    }
}

template <int F, typename I, typename T>
__device__ __forceinline__ void binary_loop(const T* a, const T* b, T* y, i64 n, const BinaryShape& s) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 ia, ib;
        binary_offsets<I>(s, i, ia, ib);
        store(y, i, binary_eval<F>(load(a, ia), load(b, ib)));
    }
}

template <int F, typename T> __device__ __forceinline__ void binary_vec(const T* a, const T* b, T* y, i64 n) {
    typedef Pack<T> P;
    const i64 packs = n / P::N;
    const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = first; j < packs; j += stride) {
        P pa, pb, py;
        pa.read(a, j);
        pb.read(b, j);
#pragma unroll
        for (int k = 0; k < P::N; ++k) store(py.elems(), k, binary_eval<F>(load(pa.elems(), k), load(pb.elems(), k)));
        py.write(y, j);
    }
    for (i64 i = packs * P::N + first; i < n; i += stride) store(y, i, binary_eval<F>(load(a, i), load(b, i)));
}

}  // namespace sg_ew

// A grid-stride loop over [0, n).
#define SG_EW_LOOP(i, n) \
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// ---------------------------------------------------------------- full

#define SG_FULL(dt, T)                                                        \
    extern "C" __global__ void __launch_bounds__(SG_EW_THREADS)               \
        full_##dt(T* y, i64 n, double value) { sg_pdl_entry();                                \
        /* As T::from_f64: to the accumulator type first, then to storage. */ \
        acc_t<T> v = (acc_t<T>)value;                                         \
        SG_EW_LOOP(i, n) store(y, i, v);                                      \
    }
SG_FOR_EACH_FLOAT(SG_FULL)

// ---------------------------------------------------------------- unary

#define SG_UNARY(name, F, dt, T)                                                \
    extern "C" __global__ void __launch_bounds__(SG_EW_THREADS)                 \
        name##_##dt(const T* x, T* y, i64 n, double p) { sg_pdl_entry();                        \
        SG_EW_LOOP(i, n) store(y, i, sg_ew::eval<sg_ew::F>(load(x, i), p));     \
    }                                                                           \
    extern "C" __global__ void __launch_bounds__(SG_EW_THREADS)                 \
        name##_backward_##dt(const T* x, const T* g, T* y, i64 n, double p) { sg_pdl_entry();   \
        SG_EW_LOOP(i, n) {                                                      \
            acc_t<T> xi = load(x, i), gi = load(g, i);                          \
            store(y, i, ::mul_rn(gi, sg_ew::derivative<sg_ew::F>(xi, p))); \
        }                                                                       \
    }

#define SG_UNARY_ALL(dt, T)               \
    SG_UNARY(neg, NEG, dt, T)             \
    SG_UNARY(exp, EXP, dt, T)             \
    SG_UNARY(log, LOG, dt, T)             \
    SG_UNARY(sqrt, SQRT, dt, T)           \
    SG_UNARY(rsqrt, RSQRT, dt, T)         \
    SG_UNARY(tanh, TANH, dt, T)           \
    SG_UNARY(sigmoid, SIGMOID, dt, T)     \
    SG_UNARY(silu, SILU, dt, T)           \
    SG_UNARY(gelu_tanh, GELU_TANH, dt, T) \
    SG_UNARY(gelu_erf, GELU_ERF, dt, T)   \
    SG_UNARY(pow, POW, dt, T)
SG_FOR_EACH_FLOAT(SG_UNARY_ALL)

// ---------------------------------------------------------------- binary

#define SG_BINARY(name, F, dt, T)                                                \
    extern "C" __global__ void __launch_bounds__(SG_EW_THREADS)                  \
        name##_##dt(const T* a, const T* b, T* y, i64 n, sg_ew::BinaryShape s) { sg_pdl_entry(); \
        if (n <= 0xffffffffLL)                                                   \
            sg_ew::binary_loop<sg_ew::F, unsigned int>(a, b, y, n, s);           \
        else                                                                     \
            sg_ew::binary_loop<sg_ew::F, unsigned long long>(a, b, y, n, s);     \
    }                                                                            \
    extern "C" __global__ void __launch_bounds__(SG_EW_THREADS)                  \
        name##_vec_##dt(const T* a, const T* b, T* y, i64 n) { sg_pdl_entry();                   \
        sg_ew::binary_vec<sg_ew::F, T>(a, b, y, n);                              \
    }

#define SG_BINARY_ALL(dt, T)   \
    SG_BINARY(add, ADD, dt, T) \
    SG_BINARY(sub, SUB, dt, T) \
    SG_BINARY(mul, MUL, dt, T) \
    SG_BINARY(div, DIV, dt, T)
SG_FOR_EACH_FLOAT(SG_BINARY_ALL)

// ---------------------------------------------------------------- cast

// As the CPU: through f64 (exact for every source), then to the target's
// accumulator type and storage. For bf16/f16 targets that is f64 -> f32 ->
// narrow, two roundings, exactly what the reference does.
#define SG_CAST(sdt, S, ddt, D)                                     \
    extern "C" __global__ void __launch_bounds__(SG_EW_THREADS)     \
        cast_##sdt##_##ddt(const S* x, D* y, i64 n) { sg_pdl_entry();               \
        SG_EW_LOOP(i, n) store(y, i, (acc_t<D>)(double)load(x, i)); \
    }
#define SG_CAST_FROM(sdt, S)             \
    SG_CAST(sdt, S, f32, float)          \
    SG_CAST(sdt, S, bf16, __nv_bfloat16) \
    SG_CAST(sdt, S, f16, __half)         \
    SG_CAST(sdt, S, f64, double)
SG_FOR_EACH_FLOAT(SG_CAST_FROM)

// ---------------------------------------------------------------- split_tf32

// x as hi + lo for 3xTF32 products, both TF32 values: hi the nearest TF32
// value, ties away from zero (`cvt.rna.tf32.f32`, as the CPU's
// `tf32_round`), lo the same rounding of x - hi (exact in f32). A tensor
// core drops the low 13 bits of the f32 data it reads; x - hi can have
// them, TF32 values cannot, so the products see exactly what the CPU's do.
// split_tf32_f32(const float* x, float* hi, float* lo, i64 n).
extern "C" __global__ void __launch_bounds__(SG_EW_THREADS)
    split_tf32_f32(const float* x, float* hi, float* lo, i64 n) { sg_pdl_entry();
    SG_EW_LOOP(i, n) {
        const float v = x[i];
        unsigned h, l;
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(v));
        const float hv = __uint_as_float(h);
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(__fsub_rn(v, hv)));
        hi[i] = hv;
        lo[i] = __uint_as_float(l);
    }
}
