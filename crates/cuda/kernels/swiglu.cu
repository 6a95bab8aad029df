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
// - `swiglu_vec_<dt>` and `swiglu_backward_vec_<dt>`, the same arguments,
//   for 16-byte-aligned tensors (the lowering checks): each thread handles
//   16 bytes of every operand per iteration (the same formula per element,
//   so the same bits), the last n mod 16/sizeof(T) element by element;
//   launch over n / (16 / sizeof(T)) threads.
// In place: h may be gate or up; dgate may be gate and dup may be up. Each
// thread reads element i of every input before it writes element i of an
// output, and no pointer is __restrict__, so that is safe.

#define SG_SWIGLU_THREADS 256

namespace sg_swiglu {

__device__ __forceinline__ float exp_(float a) { return expf(a); }
__device__ __forceinline__ double exp_(double a) { return exp(a); }

template <typename A> __device__ __forceinline__ A h_of(A g, A u) {
    const A one = A(1);
    return mul_rn(div_rn(g, add_rn(one, exp_(-g))), u);
}

// (dgate, dup) of one element.
template <typename A> __device__ __forceinline__ void grads_of(A g, A u, A d, A& dg, A& du) {
    const A one = A(1);
    A e = exp_(-g);
    A sig = div_rn(one, add_rn(one, e));
    A s = div_rn(g, add_rn(one, e));
    A ds = mul_rn(sig, add_rn(one, mul_rn(g, sub_rn(one, sig))));
    du = mul_rn(d, s);
    dg = mul_rn(mul_rn(d, u), ds);
}

// Element i of h, and of (dgate, dup): reads every input before writing.
template <typename T> __device__ __forceinline__ void forward_at(const T* gate, const T* up, T* h, i64 i) {
    store(h, i, h_of(load(gate, i), load(up, i)));
}
template <typename T>
__device__ __forceinline__ void backward_at(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 i) {
    acc_t<T> dg, du;
    grads_of(load(gate, i), load(up, i), load(gh, i), dg, du);
    store(dup, i, du);
    store(dgate, i, dg);
}

template <typename T> __device__ __forceinline__ void forward(const T* gate, const T* up, T* h, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        forward_at(gate, up, h, i);
}

template <typename T>
__device__ __forceinline__ void backward(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        backward_at(gate, up, gh, dgate, dup, i);
}

template <typename T> __device__ __forceinline__ void forward_vec(const T* gate, const T* up, T* h, i64 n) {
    typedef Pack<T> P;
    const i64 packs = n / P::N;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = first; j < packs; j += stride) {
        P pg, pu, ph;
        pg.read(gate, j);
        pu.read(up, j);
#pragma unroll
        for (int k = 0; k < P::N; ++k) forward_at(pg.elems(), pu.elems(), ph.elems(), k);
        ph.write(h, j);
    }
    for (i64 i = packs * P::N + first; i < n; i += stride) forward_at(gate, up, h, i);
}

template <typename T>
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
            backward_at(pg.elems(), pu.elems(), pd.elems(), pdg.elems(), pdu.elems(), k);
        pdu.write(dup, j);
        pdg.write(dgate, j);
    }
    for (i64 i = packs * P::N + first; i < n; i += stride) backward_at(gate, up, gh, dgate, dup, i);
}

}  // namespace sg_swiglu

#define SG_SWIGLU_KERNELS(sfx, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_SWIGLU_THREADS)                                      \
        swiglu_##sfx(const T* gate, const T* up, T* h, i64 n) { sg_pdl_entry();                                           \
        sg_swiglu::forward<T>(gate, up, h, n);                                                            \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SG_SWIGLU_THREADS)                                      \
        swiglu_backward_##sfx(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) { sg_pdl_entry();         \
        sg_swiglu::backward<T>(gate, up, gh, dgate, dup, n);                                              \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SG_SWIGLU_THREADS)                                      \
        swiglu_vec_##sfx(const T* gate, const T* up, T* h, i64 n) { sg_pdl_entry();                                       \
        sg_swiglu::forward_vec<T>(gate, up, h, n);                                                        \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SG_SWIGLU_THREADS)                                      \
        swiglu_backward_vec_##sfx(const T* gate, const T* up, const T* gh, T* dgate, T* dup, i64 n) { sg_pdl_entry();     \
        sg_swiglu::backward_vec<T>(gate, up, gh, dgate, dup, n);                                          \
    }
SG_FOR_EACH_FLOAT(SG_SWIGLU_KERNELS)
