// The fused AdamW update, matching crates/core/src/ops/optim.rs operation by
// operation (PyTorch's `_single_tensor_adamw`):
//
//   p  <- p * (1 - lr*wd)
//   m  <- lerp(m, g, 1 - beta1)
//   v  <- v*beta2 + (1 - beta2)*g*g
//   p  <- p + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// with the scalar coefficients computed in f64 and rounded once to the
// compute type acc_t<P>, each element in acc_t<P>, the moments rounded to
// their storage type and read back as stored before the parameter update,
// and the parameter rounded once. Every basic operation uses an `_rn`
// intrinsic, which the compiler never contracts into an FMA, so the result
// is the CPU's bit for bit up to the f64 pow of the bias corrections
// (CUDA's pow and the host libm's may differ in the last f64 bit).
//
// Launch convention (src/ops/optim.rs):
//   adamw_<p>_<m>_<v>(const P* p, const P* g, const M* m, const V* v,
//                     const void* lr, const void* step, P* p_out, M* m_out,
//                     V* v_out, i64 n, i64 lr_f64, i64 step_f64,
//                     double beta1, double beta2, double eps, double wd)
// 1-D grid-stride loop, blockDim.x = 256. m and v are each P or f32.
// lr and step are one-element device tensors (f32, or f64 where the flag
// is 1) read inside the kernel, so a captured graph replays with the values
// written before each step. Outputs may alias their inputs (p_out = p,
// m_out = m, v_out = v): each thread reads element i of every input before
// it writes element i of any output, and no pointer is __restrict__.
//
// The host validates lr (finite, >= 0) and step (finite, >= 1) before the
// step, as the CPU kernel does. A kernel cannot report an error, so with
// invalid values it skips the update: the outputs receive the inputs
// unchanged rather than NaNs.

namespace sg_adamw {

__device__ __forceinline__ float abs_(float a) { return fabsf(a); }
__device__ __forceinline__ double abs_(double a) { return fabs(a); }

// A value of S's accumulator type as stored in S and read back (what the CPU
// gets reading a moment after writing it).
__device__ __forceinline__ float stored(const float*, float x) { return x; }
__device__ __forceinline__ double stored(const double*, double x) { return x; }
__device__ __forceinline__ float stored(const __nv_bfloat16*, float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float stored(const __half*, float x) { return __half2float(__float2half_rn(x)); }

// PyTorch's lerp: a + w*(b - a) for |w| < 0.5, else b - (b - a)*(1 - w).
template <typename A> __device__ __forceinline__ A lerp(A a, A b, A w) {
    const A one = A(1);
    if (abs_(w) < A(0.5)) return add_rn(a, mul_rn(w, sub_rn(b, a)));
    return sub_rn(b, mul_rn(sub_rn(b, a), sub_rn(one, w)));
}

template <typename A> struct Coefs {
    A decay, w1, beta2, w2, neg_step_size, bc2_sqrt, eps;
    int valid;
};

__device__ __forceinline__ double read_scalar(const void* p, i64 is_f64) {
    return is_f64 ? *(const double*)p : (double)*(const float*)p;
}

// AdamW::coefs: f64 arithmetic (no contraction), each coefficient rounded once to A.
template <typename A>
__device__ __forceinline__ Coefs<A> coefs(const void* lr_p, i64 lr_f64, const void* step_p, i64 step_f64, double beta1,
                                          double beta2, double eps, double wd) {
    Coefs<A> c;
    double lr = read_scalar(lr_p, lr_f64), step = read_scalar(step_p, step_f64);
    c.valid = isfinite(lr) && lr >= 0.0 && isfinite(step) && step >= 1.0;
    double bc1 = __dsub_rn(1.0, pow(beta1, step));
    double bc2 = __dsub_rn(1.0, pow(beta2, step));
    double step_size = __ddiv_rn(lr, bc1);
    c.decay = (A)__dsub_rn(1.0, __dmul_rn(lr, wd));
    c.w1 = (A)__dsub_rn(1.0, beta1);
    c.beta2 = (A)beta2;
    c.w2 = (A)__dsub_rn(1.0, beta2);
    c.neg_step_size = (A)(-step_size);
    c.bc2_sqrt = (A)__dsqrt_rn(bc2);
    c.eps = (A)eps;
    return c;
}

template <typename P, typename M, typename V>
__device__ __forceinline__ void update(const P* p, const P* g, const M* m, const V* v, const void* lr, const void* step,
                                       P* p_out, M* m_out, V* v_out, i64 n, i64 lr_f64, i64 step_f64, double beta1,
                                       double beta2, double eps, double wd) {
    typedef acc_t<P> A;
    typedef acc_t<M> AM;
    typedef acc_t<V> AV;
    // One thread per block computes the coefficients (two f64 pows) for the
    // whole block; the grid is capped, so this is a handful per step.
    __shared__ Coefs<A> shared_c;
    if (threadIdx.x == 0) shared_c = coefs<A>(lr, lr_f64, step, step_f64, beta1, beta2, eps, wd);
    __syncthreads();
    const Coefs<A> c = shared_c;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        A gi = load(g, i), pi0 = load(p, i);
        AM mi0 = load(m, i);
        AV vi0 = load(v, i);
        if (!c.valid) {
            store(p_out, i, pi0);
            store(m_out, i, mi0);
            store(v_out, i, vi0);
            continue;
        }
        A pi = mul_rn(pi0, c.decay);
        A mi = lerp((A)mi0, gi, c.w1);
        A vi = add_rn(mul_rn((A)vi0, c.beta2), mul_rn(mul_rn(c.w2, gi), gi));
        // The moments as stored: the parameter update reads the state it
        // leaves behind, as PyTorch's in-place ops do.
        AM ms = stored(m, (AM)mi);
        AV vs = stored(v, (AV)vi);
        A denom = add_rn(div_rn(sqrt_rn((A)vs), c.bc2_sqrt), c.eps);
        store(m_out, i, ms);
        store(v_out, i, vs);
        store(p_out, i, add_rn(pi, div_rn(mul_rn(c.neg_step_size, (A)ms), denom)));
    }
}

}  // namespace sg_adamw

#define SG_ADAMW(pdt, P, mdt, M, vdt, V)                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        adamw_##pdt##_##mdt##_##vdt(const P* p, const P* g, const M* m, const V* v, const void* lr, const void* step, \
                                   P* p_out, M* m_out, V* v_out, i64 n, i64 lr_f64, i64 step_f64, double beta1,       \
                                   double beta2, double eps, double wd) {                                             \
        sg_adamw::update<P, M, V>(p, g, m, v, lr, step, p_out, m_out, v_out, n, lr_f64, step_f64, beta1, beta2,       \
                                  eps, wd);                                                                           \
    }

// Moments in the parameter's dtype or in f32, each independently.
#define SG_ADAMW_P(pdt, P)               \
    SG_ADAMW(pdt, P, pdt, P, pdt, P)     \
    SG_ADAMW(pdt, P, f32, float, pdt, P) \
    SG_ADAMW(pdt, P, pdt, P, f32, float) \
    SG_ADAMW(pdt, P, f32, float, f32, float)
SG_ADAMW_P(bf16, __nv_bfloat16)
SG_ADAMW_P(f16, __half)
SG_ADAMW_P(f64, double)
SG_ADAMW(f32, float, f32, float, f32, float)
