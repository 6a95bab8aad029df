// Shape movement: broadcast, permute, slice, slice_backward and concat,
// matching crates/core/src/ops/movement.rs. Movement copies bits, so the
// kernels are keyed by the width of the unit they copy, not by dtype:
// u8, u16, u32, u64 and u128 (uint4). The host (src/ops/movement.rs) picks the
// widest unit that divides every run of contiguous bytes, every offset and
// both addresses, so a bf16 slice of 64-element rows moves 16-byte units.
//
// Launch conventions: 1-D grid-stride loops over the n units of the output
// (concat: of the input), any grid, blockDim.x at most SG_MV_THREADS (256).
//   broadcast_<u>(const U* x, U* y, i64 n, GatherShape s)
//   permute_<u>(const U* x, U* y, i64 n, GatherShape s)
//       y[i] = x[offset(i)], offset from the output coordinates of i and the
//       input strides (0 on broadcast axes), after the host merged axes;
//   slice_<u>(const U* x, U* y, i64 n, i64 cy, i64 cx, i64 off)
//       y[i] = x[(i / cy) * cx + off + i % cy];
//   slice_backward_<u>(const U* x, U* y, i64 n, i64 cy, i64 cx, i64 lo)
//       with j = i % cy: y[i] = x[(i / cy) * cx + j - lo] if lo <= j < lo + cx, else 0;
//   concat_<u>(const U* x, U* y, i64 n, i64 cx, i64 cy, i64 off)
//       y[(i / cx) * cy + off + i % cx] = x[i] (one launch per input).
// None of these ops declares an in-place pair: inputs and outputs never alias.

// Threads per block of every kernel here (src/ops/util.rs THREADS: every launch uses exactly this many).
#define SG_MV_THREADS 256

namespace sg_mv {

constexpr int kMaxRank = 8;

struct GatherShape {
    i64 rank;  // >= 1
    i64 size[kMaxRank];
    i64 stride[kMaxRank];
};

template <typename I> __device__ __forceinline__ i64 gather_offset(const GatherShape& s, i64 i) {
    if (s.rank == 1) return i * s.stride[0];
    I rem = (I)i;
    i64 off = 0;
#pragma unroll
    for (int d = kMaxRank - 1; d >= 0; --d) {
        if (d < s.rank) {
            I sz = (I)s.size[d];
            off += (i64)(rem % sz) * s.stride[d];
            rem /= sz;
        }
    }
    return off;
}

template <typename I, typename U>
__device__ __forceinline__ void gather(const U* x, U* y, i64 n, const GatherShape& s) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = x[gather_offset<I>(s, i)];
}

template <typename I, typename U>
__device__ __forceinline__ void slice(const U* x, U* y, i64 n, i64 cy, i64 cx, i64 off) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        I q = (I)i / (I)cy, r = (I)i % (I)cy;
        y[i] = x[(i64)q * cx + off + (i64)r];
    }
}

template <typename I, typename U>
__device__ __forceinline__ void slice_backward(const U* x, U* y, i64 n, i64 cy, i64 cx, i64 lo) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        I q = (I)i / (I)cy, j = (I)i % (I)cy;
        i64 jj = (i64)j;
        y[i] = (jj >= lo && jj < lo + cx) ? x[(i64)q * cx + jj - lo] : U{};
    }
}

template <typename I, typename U>
__device__ __forceinline__ void concat(const U* x, U* y, i64 n, i64 cx, i64 cy, i64 off) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        I q = (I)i / (I)cx, r = (I)i % (I)cx;
        y[(i64)q * cy + off + (i64)r] = x[i];
    }
}

}  // namespace sg_mv

// 32-bit division when every index of the loop fits (the output, or for
// concat the input, has at most n units and the chunk sizes are <= n).
#define SG_MV_DISPATCH(call, n)       \
    if ((n) <= 0xffffffffLL) {        \
        typedef unsigned int I;       \
        call;                         \
    } else {                          \
        typedef unsigned long long I; \
        call;                         \
    }

#define SG_MOVEMENT(u, U)                                                     \
    extern "C" __global__ void __launch_bounds__(SG_MV_THREADS)               \
        broadcast_##u(const U* x, U* y, i64 n, sg_mv::GatherShape s) { sg_pdl_entry();        \
        SG_MV_DISPATCH((sg_mv::gather<I, U>(x, y, n, s)), n)                  \
    }                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_MV_THREADS)               \
        permute_##u(const U* x, U* y, i64 n, sg_mv::GatherShape s) { sg_pdl_entry();          \
        SG_MV_DISPATCH((sg_mv::gather<I, U>(x, y, n, s)), n)                  \
    }                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_MV_THREADS)               \
        slice_##u(const U* x, U* y, i64 n, i64 cy, i64 cx, i64 off) { sg_pdl_entry();         \
        SG_MV_DISPATCH((sg_mv::slice<I, U>(x, y, n, cy, cx, off)), n)         \
    }                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_MV_THREADS)               \
        slice_backward_##u(const U* x, U* y, i64 n, i64 cy, i64 cx, i64 lo) { sg_pdl_entry(); \
        SG_MV_DISPATCH((sg_mv::slice_backward<I, U>(x, y, n, cy, cx, lo)), n) \
    }                                                                         \
    extern "C" __global__ void __launch_bounds__(SG_MV_THREADS)               \
        concat_##u(const U* x, U* y, i64 n, i64 cx, i64 cy, i64 off) { sg_pdl_entry();        \
        SG_MV_DISPATCH((sg_mv::concat<I, U>(x, y, n, cx, cy, off)), n)        \
    }

SG_MOVEMENT(u8, unsigned char)
SG_MOVEMENT(u16, unsigned short)
SG_MOVEMENT(u32, unsigned int)
SG_MOVEMENT(u64, unsigned long long)
SG_MOVEMENT(u128, uint4)
