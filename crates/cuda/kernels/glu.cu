// The fused gated MLP activations h = act(gate) * up (SwiGLU: act = silu;
// GeGLU: act = gelu, tanh or erf form) and their backward, computing
// exactly the CPU reference's formulas in this order (crates/core/src/ops/
// glu.rs) in acc_t, rounding each output once. act and act' are the unary
// maps' eval<F> and derivative<F> of activation.cuh, prepended to this
// module.
//
// Launch convention (crates/cuda/src/ops/glu.rs builds it): 1-D
// grid-stride loops over the n elements, any grid, blockDim.x at most
// SG_GLU_THREADS (the kernels' __launch_bounds__); <act> is swiglu,
// geglu_tanh or geglu:
// - `<act>_<dt>(const T* gate, const T* up, T* h, i64 n)`;
// - `<act>_backward_<dt>(const T* gate, const T* up, const T* gh,
//    T* dgate, T* dup, i64 n)`.
// - `<act>_vec_<dt>` and `<act>_backward_vec_<dt>`, the same arguments,
//   for 16-byte-aligned tensors (the lowering checks): each thread handles
//   16 bytes of every operand per iteration (the same formula per element,
//   so the same bits), the last n mod 16/sizeof(T) element by element;
//   launch over n / (16 / sizeof(T)) threads.
// In place: h may be gate or up; dgate may be gate and dup may be up. Each
// thread reads element i of every input before it writes element i of an
// output, and no pointer is __restrict__, so that is safe.

#define SG_GLU_THREADS 256

namespace sg_glu {

// h = act(g) · u.
template <int F, typename A> __device__ __forceinline__ A h_of(A g, A u) {
    return mul_rn(sg_act::eval<F>(g, 0.0), u);
}

// (dgate, dup) of one element: dup = d · act(g), dgate = (d · u) · act'(g).
template <int F, typename A> __device__ __forceinline__ void grads_of(A g, A u, A d, A& dg, A& du) {
    du = mul_rn(d, sg_act::eval<F>(g, 0.0));
    dg = mul_rn(mul_rn(d, u), sg_act::derivative<F>(g, 0.0));
}

// Element i of h, and of (dgate, dup): reads every input before writing.
template <int F, typename T> __device__ __forceinline__ void forward_at(const T* gate, const T* up, T* h, i64 i) {
    store(h, i, h_of<F>(load(gate, i), load(up, i)));
}
template <int F, typename T>
__device__ __forceinline__ void backward_at(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 i) {
    acc_t<T> dg, du;
    grads_of<F>(load(gate, i), load(up, i), load(gh, i), dg, du);
    store(dup, i, du);
    store(dgate, i, dg);
}

template <int F, typename T> __device__ __forceinline__ void forward(const T* gate, const T* up, T* h, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        forward_at<F>(gate, up, h, i);
}

template <int F, typename T>
__device__ __forceinline__ void backward(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        backward_at<F>(gate, up, gh, dgate, dup, i);
}

template <int F, typename T> __device__ __forceinline__ void forward_vec(const T* gate, const T* up, T* h, i64 n) {
    typedef Pack<T> P;
    const i64 packs = n / P::N;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = first; j < packs; j += stride) {
        P pg, pu, ph;
        pg.read(gate, j);
        pu.read(up, j);
#pragma unroll
        for (int k = 0; k < P::N; ++k) forward_at<F>(pg.elems(), pu.elems(), ph.elems(), k);
        ph.write(h, j);
    }
    for (i64 i = packs * P::N + first; i < n; i += stride) forward_at<F>(gate, up, h, i);
}

template <int F, typename T>
__device__ __forceinline__ void backward_vec(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) {
    typedef Pack<T> P;
    const i64 packs = n / P::N;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = first; j < packs; j += stride) {
        P pg, pu, pd, pdg, pdu;
        pg.read(gate, j);
        pu.read(up, j);
        pd.read(gh, j);
#pragma unroll
        for (int k = 0; k < P::N; ++k)
            backward_at<F>(pg.elems(), pu.elems(), pd.elems(), pdg.elems(), pdu.elems(), k);
        pdu.write(dup, j);
        pdg.write(dgate, j);
    }
    for (i64 i = packs * P::N + first; i < n; i += stride) backward_at<F>(gate, up, gh, dgate, dup, i);
}

}  // namespace sg_glu

#define SG_GLU_KERNELS(act, F, sfx, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(SG_GLU_THREADS)                                         \
        act##_##sfx(const T* gate, const T* up, T* h, i64 n) { sg_pdl_entry(); \
        sg_glu::forward<sg_act::F, T>(gate, up, h, n);                                                    \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SG_GLU_THREADS)                                         \
        act##_backward_##sfx(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) { sg_pdl_entry(); \
        sg_glu::backward<sg_act::F, T>(gate, up, gh, dgate, dup, n);                                      \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SG_GLU_THREADS)                                         \
        act##_vec_##sfx(const T* gate, const T* up, T* h, i64 n) { sg_pdl_entry(); \
        sg_glu::forward_vec<sg_act::F, T>(gate, up, h, n);                                                \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SG_GLU_THREADS)                                         \
        act##_backward_vec_##sfx(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) { sg_pdl_entry(); \
        sg_glu::backward_vec<sg_act::F, T>(gate, up, gh, dgate, dup, n);                                  \
    }
#define SG_GLU_ALL(sfx, T)                      \
    SG_GLU_KERNELS(swiglu, SILU, sfx, T)        \
    SG_GLU_KERNELS(geglu_tanh, GELU_TANH, sfx, T) \
    SG_GLU_KERNELS(geglu, GELU_ERF, sfx, T)
SG_FOR_EACH_FLOAT(SG_GLU_ALL)
