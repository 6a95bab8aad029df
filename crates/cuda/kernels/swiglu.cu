// The fused SwiGLU activation of LLaMA-family MLPs, h = silu(gate) * up,
// and its backward, computing exactly the CPU reference's formulas in this
// order (crates/core/src/ops/swiglu.rs) in acc_t, rounding each output once.
//
// Launch convention (crates/cuda/src/ops/swiglu.rs builds it): 1-D
// grid-stride loops over the n elements, any grid, blockDim.x at most
// SG_SWIGLU_THREADS (the kernels' __launch_bounds__);
// - `swiglu_<dt>(const T* gate, const T* up, T* h, i64 n)`;
// - `swiglu_backward_<dt>(const T* gate, const T* up, const T* gh,
//    T* dgate, T* dup, i64 n)`.
// In place: h may be gate or up; dgate may be gate and dup may be up. Each
// thread reads element i of every input before it writes element i of an
// output, and no pointer is __restrict__, so that is safe.

#define SG_SWIGLU_THREADS 256

namespace sg_swiglu {

__device__ __forceinline__ float exp_(float a) { return expf(a); }
__device__ __forceinline__ double exp_(double a) { return exp(a); }

template <typename T> __device__ __forceinline__ void forward(const T* gate, const T* up, T* h, i64 n) {
    typedef acc_t<T> A;
    const A one = A(1);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        A g = load(gate, i), u = load(up, i);
        A s = div_rn(g, add_rn(one, exp_(-g)));
        store(h, i, mul_rn(s, u));
    }
}

template <typename T>
__device__ __forceinline__ void backward(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) {
    typedef acc_t<T> A;
    const A one = A(1);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        A g = load(gate, i), u = load(up, i), d = load(gh, i);
        A e = exp_(-g);
        A sig = div_rn(one, add_rn(one, e));
        A s = div_rn(g, add_rn(one, e));
        A ds = mul_rn(sig, add_rn(one, mul_rn(g, sub_rn(one, sig))));
        store(dup, i, mul_rn(d, s));
        store(dgate, i, mul_rn(mul_rn(d, u), ds));
    }
}

}  // namespace sg_swiglu

#define SG_SWIGLU_KERNELS(sfx, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_SWIGLU_THREADS)                                      \
        swiglu_##sfx(const T* gate, const T* up, T* h, i64 n) {                                           \
        sg_swiglu::forward<T>(gate, up, h, n);                                                            \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SG_SWIGLU_THREADS)                                      \
        swiglu_backward_##sfx(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) {         \
        sg_swiglu::backward<T>(gate, up, gh, dgate, dup, n);                                              \
    }
SG_FOR_EACH_FLOAT(SG_SWIGLU_KERNELS)
