// The unary maps' math, shared by the elementwise kernels (elementwise.cu)
// and the gated MLP activations (glu.cu), both of which get this header
// prepended (src/ops/elementwise.rs and src/ops/glu.rs declare the modules):
// f(x) and f'(x) for every UnaryFn, written as the CPU reference computes
// them (crates/core/src/ops/elementwise.rs, UnaryFn::eval and ::derivative)
// with `_rn` intrinsics, so every basic operation rounds as on the CPU and
// only the library functions (exp, tanh, ...) may differ in the last bits.

namespace sg_act {

__device__ __forceinline__ float exp_(float a) { return expf(a); }
__device__ __forceinline__ double exp_(double a) { return exp(a); }
__device__ __forceinline__ float log_(float a) { return logf(a); }
__device__ __forceinline__ double log_(double a) { return log(a); }
__device__ __forceinline__ float tanh_(float a) { return tanhf(a); }
__device__ __forceinline__ double tanh_(double a) { return tanh(a); }
__device__ __forceinline__ float pow_(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_(double a, double b) { return pow(a, b); }
// The CPU computes erf in f64 for every accumulator type and rounds once.
__device__ __forceinline__ float erf_(float a) { return (float)erf((double)a); }
__device__ __forceinline__ double erf_(double a) { return erf(a); }

// The CPU's f64 constants (ops/elementwise.rs), rounded to A where used.
constexpr double kSqrt2OverPi = 0.7978845608028654;         // (2/π).sqrt()
constexpr double kGeluC = 0.044715;
constexpr double kGeluC3 = 3.0 * 0.044715;
constexpr double kFrac1Sqrt2 = 0.70710678118654752440;       // FRAC_1_SQRT_2
constexpr double kInvSqrt2Pi = 0.3989422804014327;          // 1 / (2π).sqrt()

enum Fn { NEG, EXP, LOG, SQRT, RSQRT, TANH, SIGMOID, SILU, GELU_TANH, GELU_ERF, POW };

template <typename A> __device__ __forceinline__ A gelu_tanh_inner(A x) {
    // k * (x + c * x * x * x), left to right as on the CPU.
    return mul_rn((A)kSqrt2OverPi, add_rn(x, mul_rn(mul_rn(mul_rn((A)kGeluC, x), x), x)));
}

template <typename A> __device__ __forceinline__ A sigmoid(A x) {
    return div_rn(A(1), add_rn(A(1), exp_(-x)));
}

// f(x), as UnaryFn::eval.
template <int F, typename A> __device__ __forceinline__ A eval(A x, double p) {
    const A one = A(1), half = A(0.5);
    switch (F) {
        case NEG: return -x;
        case EXP: return exp_(x);
        case LOG: return log_(x);
        case SQRT: return sqrt_rn(x);
        case RSQRT: return div_rn(one, sqrt_rn(x));
        case TANH: return tanh_(x);
        case SIGMOID: return sigmoid(x);
        case SILU: return div_rn(x, add_rn(one, exp_(-x)));
        case GELU_TANH: return mul_rn(mul_rn(half, x), add_rn(one, tanh_(gelu_tanh_inner(x))));
        case GELU_ERF: return mul_rn(mul_rn(half, x), add_rn(one, erf_(mul_rn(x, (A)kFrac1Sqrt2))));
        default: return pow_(x, (A)p);
    }
}

// f'(x), as UnaryFn::derivative.
template <int F, typename A> __device__ __forceinline__ A derivative(A x, double p) {
    const A one = A(1), half = A(0.5);
    switch (F) {
        case NEG: return -one;
        case EXP: return exp_(x);
        case LOG: return div_rn(one, x);
        case SQRT: return div_rn(half, sqrt_rn(x));
        case RSQRT: return div_rn(-half, mul_rn(x, sqrt_rn(x)));
        case TANH: {
            A t = tanh_(x);
            return sub_rn(one, mul_rn(t, t));
        }
        case SIGMOID: {
            A s = sigmoid(x);
            return mul_rn(s, sub_rn(one, s));
        }
        case SILU: {
            A s = sigmoid(x);
            return mul_rn(s, add_rn(one, mul_rn(x, sub_rn(one, s))));
        }
        case GELU_TANH: {
            A t = tanh_(gelu_tanh_inner(x));
            A dinner = mul_rn((A)kSqrt2OverPi, add_rn(one, mul_rn(mul_rn((A)kGeluC3, x), x)));
            A a = mul_rn(half, add_rn(one, t));
            A b = mul_rn(mul_rn(mul_rn(half, x), sub_rn(one, mul_rn(t, t))), dinner);
            return add_rn(a, b);
        }
        case GELU_ERF: {
            A cdf = mul_rn(half, add_rn(one, erf_(mul_rn(x, (A)kFrac1Sqrt2))));
            A pdf = mul_rn(exp_(mul_rn(mul_rn(-half, x), x)), (A)kInvSqrt2Pi);
            return add_rn(cdf, mul_rn(x, pdf));
        }
        default: return mul_rn((A)p, pow_(x, (A)(p - 1.0)));
    }
}

}  // namespace sg_act
