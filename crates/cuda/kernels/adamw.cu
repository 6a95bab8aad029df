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
//                     double beta1, double beta2, double eps, double wd,
//                     const P* gscale)
// 1-D grid-stride loop, blockDim.x = 256. m and v are each P or f32.
// gscale (null when absent) is one element of P: the gradient is read as
// g·gscale rounded to P, what a `mul` node before the update would store
// (gradient clipping's factor, folded in).
// `adamw_multi_<p>_<m>_<v>(MultiTable t, lr, step, lr_f64, step_f64, beta1,
// beta2, eps, wd, gscale)` updates up to 48 such tensors at once (see
// MultiTable), all scaled by the same gscale.
// `adamw_vec_<p>_<m>_<v>` takes the same arguments for tensors whose every
// address is 16-byte aligned (the lowering checks) and updates 8 consecutive
// elements per thread and iteration with 16-byte loads and stores: launch
// it over n / 8 threads.
// `adamw[_vec|_multi]_<p>_<m>_<v>_master` and `..._kahan` also carry the
// master state of AdamW::master in core:
// the plain and 16-byte kernels take two more arguments after gscale,
// `const W* w, W* w_out` (W = float for _master, P for _kahan), and the
// multi-tensor kernel takes MultiTableT<9, 40>, whose address arrays 7 and 8
// are w and w_out. The update then starts from the f32 master (the
// parameter itself at step 1) or from p + compensation, and leaves the
// master, or what rounding the parameter lost, behind.
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
    A gscale;  // the gradient's factor, when scaled
    int valid, scaled;
    int first;  // step == 1: an f32 master starts from the parameter
};

// The master state an update carries (MasterWeights in core).
enum Mode { kNone = 0, kMaster = 1, kKahan = 2 };

// Its storage type: f32 for a master copy, the parameter's own for a
// compensation (and, unused, without state).
template <typename P, int Mode> struct MasterOf { typedef P type; };
template <typename P> struct MasterOf<P, kMaster> { typedef float type; };
template <typename P, int Mode> using master_t = typename MasterOf<P, Mode>::type;

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
    c.first = step == 1.0;
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

// One element's update: the parameter, first and second moment as stored,
// and the master state (a value of acc_t<P>: what the caller stores in W).
template <typename P, typename M, typename V, int Mode>
__device__ __forceinline__ void element(const Coefs<acc_t<P>>& c, acc_t<P> gi, acc_t<P> pi0, acc_t<M> mi0,
                                        acc_t<V> vi0, acc_t<P> wi0, acc_t<P>& p_new, acc_t<M>& m_new,
                                        acc_t<V>& v_new, acc_t<P>& w_new) {
    typedef acc_t<P> A;
    typedef acc_t<M> AM;
    typedef acc_t<V> AV;
    if (!c.valid) {
        p_new = pi0;
        m_new = mi0;
        v_new = vi0;
        w_new = wi0;
        return;
    }
    // g·scale as the `mul` it replaces stores it: rounded to P.
    if (c.scaled) gi = stored((const P*)nullptr, mul_rn(gi, c.gscale));
    // The weight the update starts from: the parameter, the f32 master
    // (the parameter at the first step), or the parameter plus what
    // rounding it lost.
    A w0 = pi0;
    if constexpr (Mode == kMaster) {
        if (!c.first) w0 = wi0;
    }
    if constexpr (Mode == kKahan) w0 = add_rn(pi0, wi0);
    A pi = mul_rn(w0, c.decay);
    A mi = lerp((A)mi0, gi, c.w1);
    A vi = add_rn(mul_rn((A)vi0, c.beta2), mul_rn(mul_rn(c.w2, gi), gi));
    // The moments as stored: the parameter update reads the state it
    // leaves behind, as PyTorch's in-place ops do.
    m_new = stored((const M*)nullptr, (AM)mi);
    v_new = stored((const V*)nullptr, (AV)vi);
    A denom = add_rn(div_rn(sqrt_rn((A)v_new), c.bc2_sqrt), c.eps);
    p_new = add_rn(pi, div_rn(mul_rn(c.neg_step_size, (A)m_new), denom));
    // The master as computed, or what rounding the parameter to P lost
    // (exact in A), itself rounded to P when stored.
    if constexpr (Mode == kMaster) w_new = p_new;
    if constexpr (Mode == kKahan) w_new = sub_rn(p_new, stored((const P*)nullptr, p_new));
}

// The block's coefficients, computed by one thread (two f64 pows), with
// the gradient's factor when there is one; the grid is capped, so this is a
// handful per step.
template <typename P, typename A>
__device__ __forceinline__ Coefs<A> block_coefs(const void* lr, i64 lr_f64, const void* step, i64 step_f64,
                                                double beta1, double beta2, double eps, double wd, const P* gscale) {
    __shared__ Coefs<A> shared_c;
    if (threadIdx.x == 0) {
        Coefs<A> c = coefs<A>(lr, lr_f64, step, step_f64, beta1, beta2, eps, wd);
        c.scaled = gscale != nullptr;
        c.gscale = gscale ? (A)load(gscale, 0) : A(1);
        shared_c = c;
    }
    __syncthreads();
    return shared_c;
}

// Element i: reads it from p, g, m, v (and w) and writes it to p_out,
// m_out, v_out (and w_out), which may be the inputs: every read comes
// before any write. Without master state w and w_out are never touched.
template <typename P, typename M, typename V, int Mode>
__device__ __forceinline__ void update_at(const Coefs<acc_t<P>>& c, const P* p, const P* g, const M* m, const V* v,
                                          const master_t<P, Mode>* w, P* p_out, M* m_out, V* v_out,
                                          master_t<P, Mode>* w_out, i64 i) {
    acc_t<P> pn, wn = acc_t<P>(0), w0 = acc_t<P>(0);
    acc_t<M> mn;
    acc_t<V> vn;
    if constexpr (Mode != kNone) w0 = load(w, i);
    element<P, M, V, Mode>(c, load(g, i), load(p, i), load(m, i), load(v, i), w0, pn, mn, vn, wn);
    store(m_out, i, mn);
    store(v_out, i, vn);
    if constexpr (Mode != kNone) store(w_out, i, wn);
    store(p_out, i, pn);
}

template <typename P, typename M, typename V, int Mode>
__device__ __forceinline__ void update(const P* p, const P* g, const M* m, const V* v, const void* lr, const void* step,
                                       P* p_out, M* m_out, V* v_out, i64 n, i64 lr_f64, i64 step_f64, double beta1,
                                       double beta2, double eps, double wd, const P* gscale,
                                       const master_t<P, Mode>* w, master_t<P, Mode>* w_out) {
    const Coefs<acc_t<P>> c = block_coefs<P, acc_t<P>>(lr, lr_f64, step, step_f64, beta1, beta2, eps, wd, gscale);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        update_at<P, M, V, Mode>(c, p, g, m, v, w, p_out, m_out, v_out, w_out, i);
}

// Elements per thread and iteration of `update_vec`.
constexpr int kVec = 8;

// Pack j (elements kVec·j ..): read with 16-byte loads, updated in place in
// the registers (each element read before it is written), written back.
template <typename P, typename M, typename V, int Mode>
__device__ __forceinline__ void update_pack(const Coefs<acc_t<P>>& c, const P* p, const P* g, const M* m, const V* v,
                                            const master_t<P, Mode>* w, P* p_out, M* m_out, V* v_out,
                                            master_t<P, Mode>* w_out, i64 j) {
    Pack<P, kVec> rp, rg;
    Pack<M, kVec> rm;
    Pack<V, kVec> rv;
    Pack<master_t<P, Mode>, kVec> rw;
    rp.read(p, j);
    rg.read(g, j);
    rm.read(m, j);
    rv.read(v, j);
    if constexpr (Mode != kNone) rw.read(w, j);
#pragma unroll
    for (int k = 0; k < kVec; ++k)
        update_at<P, M, V, Mode>(c, rp.elems(), rg.elems(), rm.elems(), rv.elems(), rw.elems(), rp.elems(),
                                 rm.elems(), rv.elems(), rw.elems(), k);
    rm.write(m_out, j);
    rv.write(v_out, j);
    if constexpr (Mode != kNone) rw.write(w_out, j);
    rp.write(p_out, j);
}

// `update` for 16-byte-aligned tensors: each thread updates kVec
// consecutive elements per iteration with 16-byte loads and stores (the
// same arithmetic per element, so the same bits), the last n mod kVec
// element by element.
template <typename P, typename M, typename V, int Mode>
__device__ __forceinline__ void update_vec(const P* p, const P* g, const M* m, const V* v, const void* lr,
                                           const void* step, P* p_out, M* m_out, V* v_out, i64 n, i64 lr_f64,
                                           i64 step_f64, double beta1, double beta2, double eps, double wd,
                                           const P* gscale, const master_t<P, Mode>* w, master_t<P, Mode>* w_out) {
    const Coefs<acc_t<P>> c = block_coefs<P, acc_t<P>>(lr, lr_f64, step, step_f64, beta1, beta2, eps, wd, gscale);
    const i64 runs = n / kVec;
    const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = first; j < runs; j += stride)
        update_pack<P, M, V, Mode>(c, p, g, m, v, w, p_out, m_out, v_out, w_out, j);
    for (i64 i = runs * kVec + first; i < n; i += stride)
        update_at<P, M, V, Mode>(c, p, g, m, v, w, p_out, m_out, v_out, w_out, i);
}

// Multi-tensor AdamW: up to kMax parameters of one kernel's dtypes,
// sharing the learning rate, step and hyperparameters, in one launch. The
// table of addresses travels as the kernel's argument (__grid_constant__:
// read in place, within the 4 KB of arguments every GPU takes): 48 tensors
// and 7 address arrays without master state, 40 and 9 with it. Each
// tensor is cut into chunks of kChunk elements, numbered across the table
// (chunk_end: the running count); a block takes chunks blockIdx.x,
// + gridDim.x, ... and updates a chunk as update_vec does (8-element packs,
// the same arithmetic per element, so the same bits), the chunk holding a
// tensor's last n mod 8 elements also those, element by element. Every
// tensor is 16-byte aligned (the host merges only `adamw_vec` launches).
constexpr int kChunk = 256 * kVec * 2;

template <int kArrays, int kMax> struct MultiTableT {
    i64 n[kMax];
    unsigned long long ptr[kArrays][kMax];  // p, g, m, v, p_out, m_out, v_out[, w, w_out]
    int chunk_end[kMax];
    int count;
};
typedef MultiTableT<7, 48> MultiTable;
typedef MultiTableT<9, 40> MultiTableMaster;

template <typename P, typename M, typename V, int Mode, typename Table>
__device__ __forceinline__ void update_multi(const Table& t, const void* lr, const void* step, i64 lr_f64,
                                             i64 step_f64, double beta1, double beta2, double eps, double wd,
                                             const P* gscale) {
    typedef master_t<P, Mode> W;
    const Coefs<acc_t<P>> c = block_coefs<P, acc_t<P>>(lr, lr_f64, step, step_f64, beta1, beta2, eps, wd, gscale);
    const int total = t.chunk_end[t.count - 1];
    int k = 0;  // chunks ascend, so the tensor only moves forward
    for (int ch = blockIdx.x; ch < total; ch += gridDim.x) {
        while (t.chunk_end[k] <= ch) ++k;
        const P* p = (const P*)t.ptr[0][k];
        const P* g = (const P*)t.ptr[1][k];
        const M* m = (const M*)t.ptr[2][k];
        const V* v = (const V*)t.ptr[3][k];
        P* p_out = (P*)t.ptr[4][k];
        M* m_out = (M*)t.ptr[5][k];
        V* v_out = (V*)t.ptr[6][k];
        const W* w = nullptr;
        W* w_out = nullptr;
        if constexpr (Mode != kNone) {
            w = (const W*)t.ptr[7][k];
            w_out = (W*)t.ptr[8][k];
        }
        const i64 n = t.n[k], runs = n / kVec, base = (i64)(ch - (k ? t.chunk_end[k - 1] : 0)) * kChunk;
#pragma unroll
        for (int r = 0; r < kChunk / (kVec * 256); ++r) {
            const i64 j = base / kVec + r * 256 + threadIdx.x;
            if (j >= runs) break;
            update_pack<P, M, V, Mode>(c, p, g, m, v, w, p_out, m_out, v_out, w_out, j);
        }
        const i64 tail = runs * kVec;
        if (tail >= base && tail < base + kChunk && tail + threadIdx.x < n)
            update_at<P, M, V, Mode>(c, p, g, m, v, w, p_out, m_out, v_out, w_out, tail + threadIdx.x);
    }
}

}  // namespace sg_adamw

#define SG_ADAMW(pdt, P, mdt, M, vdt, V)                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        adamw_##pdt##_##mdt##_##vdt(const P* p, const P* g, const M* m, const V* v, const void* lr, const void* step, \
                                   P* p_out, M* m_out, V* v_out, i64 n, i64 lr_f64, i64 step_f64, double beta1,       \
                                   double beta2, double eps, double wd, const P* gscale) { sg_pdl_entry();                    \
        sg_adamw::update<P, M, V, sg_adamw::kNone>(p, g, m, v, lr, step, p_out, m_out, v_out, n, lr_f64, step_f64,    \
                                                   beta1, beta2, eps, wd, gscale, nullptr, nullptr);                  \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        adamw_vec_##pdt##_##mdt##_##vdt(const P* p, const P* g, const M* m, const V* v, const void* lr,               \
                                       const void* step, P* p_out, M* m_out, V* v_out, i64 n, i64 lr_f64,            \
                                       i64 step_f64, double beta1, double beta2, double eps, double wd,              \
                                       const P* gscale) { sg_pdl_entry();                    \
        sg_adamw::update_vec<P, M, V, sg_adamw::kNone>(p, g, m, v, lr, step, p_out, m_out, v_out, n, lr_f64,          \
                                                       step_f64, beta1, beta2, eps, wd, gscale, nullptr, nullptr);    \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        adamw_multi_##pdt##_##mdt##_##vdt(const __grid_constant__ sg_adamw::MultiTable t, const void* lr,              \
                                         const void* step, i64 lr_f64, i64 step_f64, double beta1, double beta2,      \
                                         double eps, double wd, const P* gscale) { sg_pdl_entry();                    \
        sg_adamw::update_multi<P, M, V, sg_adamw::kNone>(t, lr, step, lr_f64, step_f64, beta1, beta2, eps, wd,        \
                                                         gscale);                                                     \
    }

// The kernels of one master mode (suffix _master or _kahan, Mode, state type W).
#define SG_ADAMW_MASTER(pdt, P, mdt, M, vdt, V, suffix, Mode, W)                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        adamw_##pdt##_##mdt##_##vdt##_##suffix(const P* p, const P* g, const M* m, const V* v, const void* lr,         \
                                               const void* step, P* p_out, M* m_out, V* v_out, i64 n, i64 lr_f64,    \
                                               i64 step_f64, double beta1, double beta2, double eps, double wd,      \
                                               const P* gscale, const W* w, W* w_out) { sg_pdl_entry();                    \
        sg_adamw::update<P, M, V, Mode>(p, g, m, v, lr, step, p_out, m_out, v_out, n, lr_f64, step_f64, beta1, beta2, \
                                        eps, wd, gscale, w, w_out);                                                   \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        adamw_vec_##pdt##_##mdt##_##vdt##_##suffix(const P* p, const P* g, const M* m, const V* v, const void* lr,    \
                                                   const void* step, P* p_out, M* m_out, V* v_out, i64 n,            \
                                                   i64 lr_f64, i64 step_f64, double beta1, double beta2, double eps, \
                                                   double wd, const P* gscale, const W* w, W* w_out) { sg_pdl_entry();                    \
        sg_adamw::update_vec<P, M, V, Mode>(p, g, m, v, lr, step, p_out, m_out, v_out, n, lr_f64, step_f64, beta1,    \
                                            beta2, eps, wd, gscale, w, w_out);                                        \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) adamw_multi_##pdt##_##mdt##_##vdt##_##suffix(                   \
        const __grid_constant__ sg_adamw::MultiTableMaster t, const void* lr, const void* step, i64 lr_f64,          \
        i64 step_f64, double beta1, double beta2, double eps, double wd, const P* gscale) { sg_pdl_entry();                    \
        sg_adamw::update_multi<P, M, V, Mode>(t, lr, step, lr_f64, step_f64, beta1, beta2, eps, wd, gscale);          \
    }

// Without master state, and with either kind.
#define SG_ADAMW_ALL(pdt, P, mdt, M, vdt, V)                                        \
    SG_ADAMW(pdt, P, mdt, M, vdt, V)                                                \
    SG_ADAMW_MASTER(pdt, P, mdt, M, vdt, V, master, sg_adamw::kMaster, float)       \
    SG_ADAMW_MASTER(pdt, P, mdt, M, vdt, V, kahan, sg_adamw::kKahan, P)

// Moments in the parameter's dtype or in f32, each independently.
#define SG_ADAMW_P(pdt, P, KERNELS)               \
    KERNELS(pdt, P, pdt, P, pdt, P)               \
    KERNELS(pdt, P, f32, float, pdt, P)           \
    KERNELS(pdt, P, pdt, P, f32, float)           \
    KERNELS(pdt, P, f32, float, f32, float)
SG_ADAMW_P(bf16, __nv_bfloat16, SG_ADAMW_ALL)
SG_ADAMW_P(f16, __half, SG_ADAMW_ALL)
SG_ADAMW_P(f64, double, SG_ADAMW_ALL)
SG_ADAMW_ALL(f32, float, f32, float, f32, float)

// ------------------------------------------------------------ 8-bit moments
//
// `adamw_8bit_<p>[_master|_kahan](const P* p, const P* g, const u8* m_codes,
// const float* m_absmax, const u8* v_codes, const float* v_absmax,
// const void* lr, const void* step, P* p_out, u8* m_codes_out,
// float* m_absmax_out, u8* v_codes_out, float* v_absmax_out, i64 n,
// i64 lr_f64, i64 step_f64, double beta1, double beta2, double eps,
// double wd, const P* gscale[, const W* w, W* w_out])`: AdamW8bit of
// crates/core/src/ops/adamw8.rs, its bytes. One block of 256 threads per
// quantization block of 2048 elements (grid-striding over the blocks), 8
// consecutive elements per thread: each element's update as `element`
// computes it but with the moments read dequantized and the parameter
// updated from the unquantized new moments; the block's new absmax of each
// moment (a maximum: the same in any order), then each element's code: the
// first map entry at least its quotient (guessed from the map's formula,
// then corrected by steps) and the nearer of it and the one below, the
// lower code on a tie (and a positive second moment never zero's code).
// The maps are built by every block from the same f64 constants as
// `dynamic_map`. Codes past n in the last word are written as zero. With
// invalid scalars every output receives its input.

namespace sg_adamw {

typedef unsigned char u8;

#define ADAMW8_BLOCK 2048
#define ADAMW8_THREADS 256
#define ADAMW8_PER_THREAD 8

// Entry t of the signed (first moment) or unsigned map, ascending: see
// `dynamic_map` (decade d holds 2^d values a sign, or 2^(d+1) unsigned).
__device__ __forceinline__ float map_value(int t, bool signed_map) {
    const double decades[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
    int k;  // index among the positive values, ascending; -1: zero
    float sign = 1.0f;
    if (t == 255) return 1.0f;
    if (signed_map) {
        if (t == 127) return 0.0f;
        if (t < 127) {
            k = 126 - t;
            sign = -1.0f;
        } else {
            k = t - 128;
        }
    } else {
        if (t == 0) return 0.0f;
        k = t - 1;
    }
    int d = 0, first = 0;
    for (;; ++d) {
        const int count = signed_map ? (1 << d) : (1 << (d + 1));
        if (k < first + count) break;
        first += count;
    }
    const int n = signed_map ? (1 << d) : (1 << (d + 1)), j = k - first;
    const double frac = __ddiv_rn((double)(2 * j + 1), (double)(2 * n));
    const double v = __dmul_rn(__dadd_rn(0.1, __dmul_rn(0.9, frac)), decades[d]);
    return sign * __double2float_rn(v);
}

// An index near the first map entry at least x, from the map's formula:
// x's decade, then its cell within the decade (`quantize8` corrects it).
__device__ __forceinline__ int code_guess(float x, bool signed_map) {
    const float a = fabsf(x);
    // The decade, and the reciprocal of its top (products, not divisions:
    // a guess needs no exact rounding).
    int d;
    float per_decade;
    if (a >= 0.1f) d = 6, per_decade = 1.0f;
    else if (a >= 0.01f) d = 5, per_decade = 10.0f;
    else if (a >= 1e-3f) d = 4, per_decade = 100.0f;
    else if (a >= 1e-4f) d = 3, per_decade = 1e3f;
    else if (a >= 1e-5f) d = 2, per_decade = 1e4f;
    else if (a >= 1e-6f) d = 1, per_decade = 1e5f;
    else d = 0, per_decade = 1e6f;
    const int n = signed_map ? (1 << d) : (2 << d);
    // Values of decade d are (0.1 + 0.9 (2j + 1) / 2n) · 10^(d-6), j < n.
    int j = (int)((a * per_decade - 0.1f) * (1.0f / 0.9f) * (float)n);
    j = j < 0 ? 0 : (j >= n ? n - 1 : j);
    if (signed_map) {
        const int k = (n - 1) + j;  // among the 127 positive values, ascending
        return x >= 0.0f ? 128 + k : 126 - k;
    }
    return x < 0.0f ? 0 : 1 + (n - 2) + j;
}

// The code of x: the nearest map value, the lower one on a tie, the end
// codes beyond the map (as the CPU's binary search: the first entry at
// least x found from a guess moved down and up, a few steps at most).
__device__ __forceinline__ u8 quantize8(float x, const float* map, bool signed_map) {
    if (x != x) return 0;  // NaN: no entry is below it
    int lo = code_guess(x, signed_map);
    while (lo > 0 && !(map[lo - 1] < x)) --lo;
    while (lo < 256 && map[lo] < x) ++lo;
    if (lo == 0) return 0;
    if (lo == 256) return 255;
    const float below = __fsub_rn(x, map[lo - 1]), above = __fsub_rn(map[lo], x);
    return (u8)(above < below ? lo : lo - 1);
}

// A thread's 8 codes, as bytes or as one 8-byte word.
union Codes {
    uint2 word;
    u8 code[ADAMW8_PER_THREAD];
};

// The block's maxima of a and b (non-negative), in every thread, in one
// pass through shared memory.
__device__ __forceinline__ void block_max2(float& a, float& b, float2* scratch) {
    a = warp_max(a);
    b = warp_max(b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = make_float2(a, b);
    __syncthreads();
    float2 r = scratch[0];
    for (int i = 1; i < ADAMW8_THREADS / 32; ++i) r.x = fmaxf(r.x, scratch[i].x), r.y = fmaxf(r.y, scratch[i].y);
    __syncthreads();
    a = r.x;
    b = r.y;
}

template <typename P, int Mode>
__device__ __forceinline__ void update_8bit(const P* p, const P* g, const u8* mq, const float* ms, const u8* vq,
                                            const float* vs, const void* lr, const void* step, P* p_out, u8* mq_out,
                                            float* ms_out, u8* vq_out, float* vs_out, i64 n, i64 lr_f64, i64 step_f64,
                                            double beta1, double beta2, double eps, double wd, const P* gscale,
                                            const master_t<P, Mode>* w, master_t<P, Mode>* w_out) {
    __shared__ float smap[256], umap[256];
    __shared__ float2 scratch[ADAMW8_THREADS / 32];
    const Coefs<float> c = block_coefs<P, float>(lr, lr_f64, step, step_f64, beta1, beta2, eps, wd, gscale);
    for (int t = threadIdx.x; t < 256; t += blockDim.x) {
        smap[t] = map_value(t, true);
        umap[t] = map_value(t, false);
    }
    __syncthreads();
    const i64 blocks = (n + ADAMW8_BLOCK - 1) / ADAMW8_BLOCK, padded = (n + 3) / 4 * 4;
    const bool aligned8 =
        (((unsigned long long)mq | (unsigned long long)vq | (unsigned long long)mq_out | (unsigned long long)vq_out) &
         7ull) == 0;
    for (i64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        const i64 base = b * ADAMW8_BLOCK + (i64)threadIdx.x * ADAMW8_PER_THREAD;
        const float am = ms[b], av = vs[b];
        float mi[ADAMW8_PER_THREAD], vi[ADAMW8_PER_THREAD];
        float m_max = 0.0f, v_max = 0.0f;
        // The thread's 8 codes of each moment: one 8-byte access where all
        // are in the tensor and the code arrays start 8-byte aligned (base
        // is a multiple of 8; a small tensor's codes may be packed at 4),
        // byte by byte otherwise.
        Codes mc, vc;
        const bool whole = aligned8 && base + ADAMW8_PER_THREAD <= n;
        if (whole) {
            mc.word = *reinterpret_cast<const uint2*>(mq + base);
            vc.word = *reinterpret_cast<const uint2*>(vq + base);
        } else {
#pragma unroll
            for (int k = 0; k < ADAMW8_PER_THREAD; ++k) {
                mc.code[k] = base + k < n ? mq[base + k] : (u8)0;
                vc.code[k] = base + k < n ? vq[base + k] : (u8)0;
            }
        }
#pragma unroll
        for (int k = 0; k < ADAMW8_PER_THREAD; ++k) {
            const i64 i = base + k;
            mi[k] = 0.0f;
            vi[k] = 0.0f;
            if (i >= n) continue;
            float pi = load(p, i), wi0 = 0.0f;
            if constexpr (Mode != kNone) wi0 = load(w, i);
            const float m0 = __fmul_rn(smap[mc.code[k]], am), v0 = __fmul_rn(umap[vc.code[k]], av);
            if (!c.valid) {
                if constexpr (Mode != kNone) store(w_out, i, wi0);
                store(p_out, i, pi);
                mq_out[i] = mc.code[k];
                vq_out[i] = vc.code[k];
                continue;
            }
            float gi = load(g, i);
            if (c.scaled) gi = stored((const P*)nullptr, __fmul_rn(gi, c.gscale));
            float w0 = pi;
            if constexpr (Mode == kMaster) {
                if (!c.first) w0 = wi0;
            }
            if constexpr (Mode == kKahan) w0 = __fadd_rn(pi, wi0);
            const float wd_applied = __fmul_rn(w0, c.decay);
            const float mn = lerp(m0, gi, c.w1);
            const float vn = __fadd_rn(__fmul_rn(v0, c.beta2), __fmul_rn(__fmul_rn(c.w2, gi), gi));
            const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vn), c.bc2_sqrt), c.eps);
            const float pn = __fadd_rn(wd_applied, __fdiv_rn(__fmul_rn(c.neg_step_size, mn), denom));
            if constexpr (Mode == kMaster) store(w_out, i, pn);
            if constexpr (Mode == kKahan) store(w_out, i, __fsub_rn(pn, stored((const P*)nullptr, pn)));
            store(p_out, i, pn);
            mi[k] = mn;
            vi[k] = vn;
            m_max = fmaxf(m_max, fabsf(mn));
            v_max = fmaxf(v_max, fabsf(vn));
        }
        // Every thread has read its block's scales: the new ones may be written.
        block_max2(m_max, v_max, scratch);
        if (!c.valid) {
            if (threadIdx.x == 0) ms_out[b] = am, vs_out[b] = av;
            continue;
        }
#pragma unroll
        for (int k = 0; k < ADAMW8_PER_THREAD; ++k) {
            if (base + k < n) {
                mc.code[k] = m_max > 0.0f ? quantize8(__fdiv_rn(mi[k], m_max), smap, true) : (u8)127;
                // A positive second moment never takes zero's code (second_moment_code).
                u8 v = v_max > 0.0f ? quantize8(__fdiv_rn(vi[k], v_max), umap, false) : (u8)0;
                if (v == 0 && vi[k] > 0.0f && v_max > 0.0f) v = 1;
                vc.code[k] = v;
            } else {
                mc.code[k] = 0;
                vc.code[k] = 0;
            }
        }
        if (whole) {
            *reinterpret_cast<uint2*>(mq_out + base) = mc.word;
            *reinterpret_cast<uint2*>(vq_out + base) = vc.word;
        } else {
            for (int k = 0; k < ADAMW8_PER_THREAD && base + k < padded; ++k) {
                mq_out[base + k] = mc.code[k];
                vq_out[base + k] = vc.code[k];
            }
        }
        if (threadIdx.x == 0) ms_out[b] = m_max, vs_out[b] = v_max;
    }
}

}  // namespace sg_adamw

#define SG_ADAMW8(pdt, P, suffix, Mode, W)                                                                            \
    extern "C" __global__ void __launch_bounds__(ADAMW8_THREADS) adamw_8bit_##pdt##suffix(                           \
        const P* p, const P* g, const unsigned char* mq, const float* ms, const unsigned char* vq, const float* vs,  \
        const void* lr, const void* step, P* p_out, unsigned char* mq_out, float* ms_out, unsigned char* vq_out,     \
        float* vs_out, i64 n, i64 lr_f64, i64 step_f64, double beta1, double beta2, double eps, double wd,           \
        const P* gscale, const W* w, W* w_out) { sg_pdl_entry(); \
        sg_adamw::update_8bit<P, Mode>(p, g, mq, ms, vq, vs, lr, step, p_out, mq_out, ms_out, vq_out, vs_out, n,      \
                                       lr_f64, step_f64, beta1, beta2, eps, wd, gscale, w, w_out);                   \
    }
#define SG_ADAMW8_ALL(pdt, P)                                \
    SG_ADAMW8(pdt, P, , sg_adamw::kNone, P)                  \
    SG_ADAMW8(pdt, P, _master, sg_adamw::kMaster, float)     \
    SG_ADAMW8(pdt, P, _kahan, sg_adamw::kKahan, P)
SG_ADAMW8_ALL(f32, float)
SG_ADAMW8_ALL(bf16, __nv_bfloat16)
SG_ADAMW8_ALL(f16, __half)
