// The fused LM head and cross-entropy, as crates/core/src/ops/linear_ce.rs:
// the logits are computed one chunk of vocabulary columns at a time by
// cuBLASLt (launched by the lowering between these kernels) into a
// [rows, cw] workspace, and these kernels do the rest. Statistics are
// acc_t<T> (the op's stat dtype); targets are i32 or i64 (`tgt_i64`).
// Nothing here is in place across operands; each kernel's outputs are
// disjoint from its inputs except where noted.
//
// Soft-capping (`softcap` > 0, Gemma 2's final logit cap): the chunk
// kernels read each logit x as softcap·tanh(x/softcap) (`sg_cap`, in acc_t)
// for the max, the sum, the target logit and the backward's softmax, and
// the backward multiplies the capped logit's cotangent by the cap's slope
// 1 − (capped/softcap)² before it is stored. Each chunk kernel has one copy
// per CAP, chosen by a uniform branch on `softcap`; the plain copy is the
// expressions as they were before caps, so uncapped heads keep their bits.
//
// Forward (lse holds each row's running max until `finish`):
// - `linear_ce_init_<dtype>(lse, run_sum, tlogit, rows)`, 1-D grid-stride:
//   max −inf, sum 0, target logit 0.
// - per chunk, after the product: `linear_ce_chunk_stats_<dtype>(logits,
//   tgt, tgt_i64, lse, run_sum, tlogit, rows, cw, v0, ignore_index,
//   softcap)`: one
//   block per row (grid-striding), blockDim.x a multiple of 32 ≤ 1024; folds
//   the chunk into the row's running max and sum (online log-sum-exp, the
//   old sum rescaled unless it is 0) and picks the target logit when the
//   target is in [v0, v0 + cw).
// - `linear_ce_finish_<dtype>(tgt, tgt_i64, lse, run_sum, tlogit, loss, rows,
//   classes, ignore_index, mean)`: one block of 1024 threads; thread i turns
//   rows i, i+1024, ... into log-sum-exps and adds their losses in order, a
//   fixed block tree adds the threads (deterministic). Mean over no kept row
//   is 0/0 = NaN; a target outside [0, classes) that is not the ignore index
//   makes the loss NaN (the CPU rejects it; a kernel cannot).
//
// Backward, per chunk after the product of the chunk's logits:
// - `linear_ce_backward_chunk_<dtype>(g, tgt, tgt_i64, lse, gloss, glse,
//   has_glse, rows, cw, v0, classes, ignore_index, mean, softcap)`: one block per row
//   (grid-striding, at most LCE_BWD_MAX_BLOCKS blocks, each recounting the
//   kept rows for the mean's divisor), overwriting the chunk's logits g in
//   place with their cotangent a·(p − onehot) + glse·p, p = exp(g − lse)
//   (with a cap: g capped, and the cotangent times the cap's slope),
//   a = gloss / #kept (mean) or gloss (sum) for kept rows, 0 for ignored
//   ones; each element is read and then written by one thread.
// - `linear_ce_accumulate_<dtype>(partial, acc, n, first)`, 1-D grid-stride:
//   acc = (first ? 0 : acc) + partial, in the chunk order the lowering
//   launches (no atomics); the lowering puts each chunk's partial product
//   in dhidden's buffer, which `linear_ce_round` overwrites at the end.
// - after the last chunk, `linear_ce_round_<dtype>(acc, dhidden, n)`:
//   dhidden = acc rounded once.

__device__ __forceinline__ i64 lce_target(const void* tgt, int tgt_i64, i64 n) {
    return tgt_i64 ? ((const i64*)tgt)[n] : (i64)((const int*)tgt)[n];
}

template <typename A> __device__ __forceinline__ A lce_nan() {
    return (A)__longlong_as_double(0x7ff8000000000000LL);
}

// Whether every row of a [rows, cw] chunk at `base` can be read in 16-byte
// packs: rows a whole number of packs long, the chunk 16-byte aligned (a
// grid-uniform choice). Packs change which thread reads which element, not
// the elementwise results; the row sums then add in another order.
template <typename T> __device__ __forceinline__ bool lce_packed(const T* base, i64 cw) {
    return cw % Pack<T>::N == 0 && ((unsigned long long)base & 15) == 0;
}

// f(x) for this thread's elements of a chunk row of cw (in 16-byte packs
// when `packed`), each as the accumulator type.
template <typename T, typename F> __device__ __forceinline__ void lce_row_each(const T* row, i64 cw, bool packed, F f) {
    typedef Pack<T> P;
    if (packed) {
        for (i64 j = threadIdx.x; j < cw / P::N; j += blockDim.x) {
            P p;
            p.read(row, j);
#pragma unroll
            for (int e = 0; e < P::N; ++e) f(load(p.elems(), e));
        }
    } else {
        for (i64 k = threadIdx.x; k < cw; k += blockDim.x) f(load(row, k));
    }
}

// The log-sum-exp shift: the running max, or 0 when it is infinite (an all
// −inf row gives −inf, not NaN, as the CPU).
template <typename A> __device__ __forceinline__ A lce_shift(A m) {
    return isfinite(m) ? m : A(0);
}

template <typename T>
__device__ void lce_init(acc_t<T>* lse, acc_t<T>* run_sum, acc_t<T>* tlogit, i64 rows) {
    typedef acc_t<T> A;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < rows; i += (i64)gridDim.x * blockDim.x) {
        lse[i] = A(-INFINITY);
        run_sum[i] = A(0);
        tlogit[i] = A(0);
    }
}

// The logit of the product x: softcap·tanh(x/softcap) in the CAP copy, x
// itself in the plain one.
template <bool CAP, typename A> __device__ __forceinline__ A lce_logit(A x, double softcap) {
    if constexpr (CAP)
        return A(sg_cap(x, softcap));
    else
        return x;
}

template <bool CAP, typename T>
__device__ void lce_chunk_stats(const T* __restrict__ logits, const void* __restrict__ tgt, int tgt_i64,
                                acc_t<T>* __restrict__ lse, acc_t<T>* __restrict__ run_sum,
                                acc_t<T>* __restrict__ tlogit, i64 rows, i64 cw, i64 v0, i64 ignore_index,
                                double softcap) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    const bool packed = lce_packed(logits, cw);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = logits + r * cw;
        const A old_max = lse[r];
        A m = old_max;
        lce_row_each(row, cw, packed, [&](A x) { m = fmax(m, lce_logit<CAP>(x, softcap)); });
        m = block_max(m, scratch);  // fmax ignores NaN, as Rust's `max`
        const A sh = lce_shift(m);
        A s = A(0);
        lce_row_each(row, cw, packed, [&](A x) { s += exp(lce_logit<CAP>(x, softcap) - sh); });
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) {
            const A old = run_sum[r];
            // Rescaling an empty sum is skipped: 0 · exp(+huge) would be NaN.
            const A kept = old == A(0) ? old : old * exp(lce_shift(old_max) - sh);
            run_sum[r] = kept + s;
            lse[r] = m;
            const i64 t = lce_target(tgt, tgt_i64, r);
            if (t != ignore_index && t >= v0 && t < v0 + cw) tlogit[r] = lce_logit<CAP>(load(row, t - v0), softcap);
        }
    }
}

template <typename T>
__device__ void lce_finish(const void* __restrict__ tgt, int tgt_i64, acc_t<T>* __restrict__ lse,
                           const acc_t<T>* __restrict__ run_sum, const acc_t<T>* __restrict__ tlogit,
                           acc_t<T>* __restrict__ loss, i64 rows, i64 classes, i64 ignore_index, int mean) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    __shared__ i64 count_scratch[32];
    A sum = A(0);
    i64 kept = 0;
    for (i64 n = threadIdx.x; n < rows; n += blockDim.x) {
        const A l = log(run_sum[n]) + lce_shift(lse[n]);
        lse[n] = l;
        const i64 t = lce_target(tgt, tgt_i64, n);
        if (t == ignore_index) continue;
        sum += (t >= 0 && t < classes) ? l - tlogit[n] : lce_nan<A>();
        kept += 1;
    }
    sum = block_sum(sum, scratch);
    kept = block_sum(kept, count_scratch);
    if (threadIdx.x == 0) loss[0] = mean ? sum / (A)(double)kept : sum;
}

// The cotangent of the product x (read from the chunk) of column v0 + k:
// a·(p − onehot) + coef_glse·p with p = exp(logit − l), times the cap's
// slope in the CAP copy; the plain copy is the expression as it was before
// caps.
template <bool CAP, typename A>
__device__ __forceinline__ A lce_dlogit(A x, A l, A coef, A a, bool onehot, double softcap) {
    if constexpr (CAP) {
        const A z = A(sg_cap(x, softcap));
        const A p = exp(z - l);
        return (coef * p - (onehot ? a : A(0))) * A(sg_cap_slope(z, softcap));
    } else {
        const A p = exp(x - l);
        return coef * p - (onehot ? a : A(0));
    }
}

template <bool CAP, typename T>
__device__ void lce_backward_chunk(T* g, const void* __restrict__ tgt, int tgt_i64, const acc_t<T>* __restrict__ lse,
                                   const acc_t<T>* __restrict__ gloss, const acc_t<T>* __restrict__ glse,
                                   int has_glse, i64 rows, i64 cw, i64 v0, i64 classes, i64 ignore_index,
                                   int mean, double softcap) {
    typedef acc_t<T> A;
    typedef Pack<T> P;
    __shared__ i64 count_scratch[32];
    const bool packed = lce_packed(g, cw);
    i64 kept = 0;
    for (i64 n = threadIdx.x; n < rows; n += blockDim.x) kept += lce_target(tgt, tgt_i64, n) != ignore_index;
    kept = block_sum(kept, count_scratch);
    // One rounded scale for every row, as the CPU.
    const A scale = mean ? gloss[0] / (A)(double)(kept > 1 ? kept : 1) : gloss[0];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        T* gr = g + r * cw;
        const i64 t = lce_target(tgt, tgt_i64, r);
        const A a = t == ignore_index ? A(0) : scale;
        const A b = has_glse ? glse[r] : A(0);
        if (a == A(0) && b == A(0)) {
            // Also avoids 0 · exp(..) turning into NaN for infinite logits.
            for (i64 k = threadIdx.x; k < cw; k += blockDim.x) store(gr, k, A(0));
            continue;
        }
        const bool bad = t != ignore_index && (t < 0 || t >= classes);
        const A l = lse[r], coef = a + b;
        if (packed) {
            for (i64 j = threadIdx.x; j < cw / P::N; j += blockDim.x) {
                P x;
                x.read(gr, j);
#pragma unroll
                for (int e = 0; e < P::N; ++e) {
                    const i64 k = j * P::N + e;
                    const A v = lce_dlogit<CAP>(load(x.elems(), e), l, coef, a, v0 + k == t, softcap);
                    store(x.elems(), e, bad ? lce_nan<A>() : v);
                }
                x.write(gr, j);
            }
            continue;
        }
        for (i64 k = threadIdx.x; k < cw; k += blockDim.x) {
            const A v = lce_dlogit<CAP>(load(gr, k), l, coef, a, v0 + k == t, softcap);
            store(gr, k, bad ? lce_nan<A>() : v);
        }
    }
}

template <typename T>
__device__ void lce_accumulate(const T* __restrict__ partial, acc_t<T>* __restrict__ acc, i64 n, int first) {
    typedef acc_t<T> A;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const A base = first ? A(0) : acc[i];
        acc[i] = base + load(partial, i);
    }
}

template <typename T> __device__ void lce_round(const acc_t<T>* __restrict__ acc, T* __restrict__ out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        store(out, i, acc[i]);
}

#define SG_LINEAR_CE_KERNELS(sfx, T)                                                                            \
    extern "C" __global__ void linear_ce_init_##sfx(acc_t<T>* lse, acc_t<T>* run_sum, acc_t<T>* tlogit,          \
                                                    i64 rows) { sg_pdl_entry();                                                 \
        lce_init<T>(lse, run_sum, tlogit, rows);                                                                \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        linear_ce_chunk_stats_##sfx(const T* logits, const void* tgt, int tgt_i64, acc_t<T>* lse,               \
                                    acc_t<T>* run_sum, acc_t<T>* tlogit, i64 rows, i64 cw, i64 v0,              \
                                    i64 ignore_index, double softcap) { sg_pdl_entry();                                         \
        if (softcap > 0)                                                                                        \
            lce_chunk_stats<true, T>(logits, tgt, tgt_i64, lse, run_sum, tlogit, rows, cw, v0, ignore_index,    \
                                     softcap);                                                                  \
        else                                                                                                    \
            lce_chunk_stats<false, T>(logits, tgt, tgt_i64, lse, run_sum, tlogit, rows, cw, v0, ignore_index,   \
                                      softcap);                                                                 \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        linear_ce_finish_##sfx(const void* tgt, int tgt_i64, acc_t<T>* lse, const acc_t<T>* run_sum,            \
                               const acc_t<T>* tlogit, acc_t<T>* loss, i64 rows, i64 classes, i64 ignore_index, \
                               int mean) { sg_pdl_entry();                                                                      \
        lce_finish<T>(tgt, tgt_i64, lse, run_sum, tlogit, loss, rows, classes, ignore_index, mean);             \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        linear_ce_backward_chunk_##sfx(T* g, const void* tgt, int tgt_i64, const acc_t<T>* lse,                 \
                                       const acc_t<T>* gloss, const acc_t<T>* glse, int has_glse, i64 rows,     \
                                       i64 cw, i64 v0, i64 classes, i64 ignore_index, int mean,                 \
                                       double softcap) { sg_pdl_entry();                                                        \
        if (softcap > 0)                                                                                        \
            lce_backward_chunk<true, T>(g, tgt, tgt_i64, lse, gloss, glse, has_glse, rows, cw, v0, classes,     \
                                        ignore_index, mean, softcap);                                           \
        else                                                                                                    \
            lce_backward_chunk<false, T>(g, tgt, tgt_i64, lse, gloss, glse, has_glse, rows, cw, v0, classes,    \
                                         ignore_index, mean, softcap);                                          \
    }                                                                                                           \
    extern "C" __global__ void linear_ce_accumulate_##sfx(const T* partial, acc_t<T>* acc, i64 n, int first) { sg_pdl_entry();   \
        lce_accumulate<T>(partial, acc, n, first);                                                              \
    }                                                                                                           \
    extern "C" __global__ void linear_ce_round_##sfx(const acc_t<T>* acc, T* out, i64 n) { sg_pdl_entry();                      \
        lce_round<T>(acc, out, n);                                                                              \
    }

SG_FOR_EACH_FLOAT(SG_LINEAR_CE_KERNELS)
