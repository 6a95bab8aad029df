// Token embedding: the row gather `table[ids]` and its deterministic
// backward, matching crates/core/src/ops/embedding.rs.
//
// Launch conventions:
//   embedding_<u>_<id>(const Id* ids, const U* table, U* y, i64 n_ids, i64 rows, i64 wu)
//       blockDim (tx, ty): threadIdx.y picks a position (grid-stride over
//       positions by blockIdx.x), threadIdx.x walks its row's wu units.
//       The gather copies bits, so it is keyed by copy unit u (u16, u32,
//       u64, u128: the host picks the widest dividing the row bytes and the
//       addresses) and id type (i32, i64).
//   embedding_backward_<dt>_<id>(const Id* ids, const T* gy, T* gt, i64 n_ids, i64 rows, i64 width)
//       one block per table row (grid-stride over rows), blockDim.x a
//       multiple of 32 (at most 1024), y and z 1.
//
// Ids out of [0, rows) cannot be reported from a kernel; the session checks
// step inputs on the host before the step, as the CPU does. Should one reach
// a kernel anyway, it is never used as an address: the forward writes a zero
// row for it and the backward never matches it to a table row.
//
// The backward is deterministic without atomics: each block owns one table
// row r and scans all ids in ascending position order, a tile at a time;
// matching positions are compacted in order (warp ballots and a prefix over
// warps) and summed in that order, as the CPU's stable counting sort does.
// A row selected once is a bit copy of gy's row and a row never selected is
// zero, as on the CPU. Cost: every block reads all ids (rows x n_ids id
// reads, mostly from L2), which is small next to the step for LLaMA-sized
// vocabularies and token counts.

namespace sg_emb {

template <typename Id, typename U>
__device__ __forceinline__ void gather_rows(const Id* ids, const U* table, U* y, i64 n_ids, i64 rows, i64 wu) {
    for (i64 p = blockIdx.x * (i64)blockDim.y + threadIdx.y; p < n_ids; p += (i64)gridDim.x * blockDim.y) {
        i64 id = (i64)ids[p];
        bool ok = id >= 0 && id < rows;
        const U* src = table + (ok ? id : 0) * wu;
        U* dst = y + p * wu;
        for (i64 c = threadIdx.x; c < wu; c += blockDim.x) dst[c] = ok ? src[c] : U{};
    }
}

// Columns each thread accumulates per pass over the ids, in registers.
constexpr int kCols = 8;
// Ids each thread examines per tile before the block checks for a match.
constexpr int kIds = 4;

template <typename T, typename Id>
__device__ __forceinline__ void scatter_rows(const Id* ids, const T* gy, T* gt, i64 n_ids, i64 rows, i64 width) {
    typedef acc_t<T> A;
    __shared__ i64 list[1024];  // matching positions of one slab, ascending
    __shared__ int warp_count[32];
    const int nt = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 tile = (i64)nt * kIds;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        // Columns [c0, c0 + nt * kCols) per pass; the ids are rescanned per pass.
        for (i64 c0 = 0; c0 < width; c0 += (i64)nt * kCols) {
            A acc[kCols];
#pragma unroll
            for (int j = 0; j < kCols; ++j) acc[j] = A(0);
            long long count = 0;
            i64 single = 0;  // the position when exactly one matches
            for (i64 t0 = 0; t0 < n_ids; t0 += tile) {
                bool m[kIds];
                bool any = false;
#pragma unroll
                for (int k = 0; k < kIds; ++k) {
                    i64 pos = t0 + (i64)k * nt + threadIdx.x;
                    m[k] = pos < n_ids && (i64)ids[pos] == row;
                    any |= m[k];
                }
                // Most tiles hold no occurrence of this row: one barrier and on.
                if (!__syncthreads_or(any)) continue;
#pragma unroll
                for (int k = 0; k < kIds; ++k) {
                    // Slab k holds positions t0 + k*nt + [0, nt): compact its
                    // matches in position order (warp by warp, lane by lane).
                    unsigned ballot = __ballot_sync(0xffffffffu, m[k]);
                    if (lane == 0) warp_count[warp] = __popc(ballot);
                    int total = __syncthreads_count(m[k]);
                    if (total == 0) continue;  // uniform over the block
                    if (m[k]) {
                        int before = __popc(ballot & ((1u << lane) - 1u));
                        for (int w = 0; w < warp; ++w) before += warp_count[w];
                        list[before] = t0 + (i64)k * nt + threadIdx.x;
                    }
                    __syncthreads();
                    for (int q = 0; q < total; ++q) {
                        i64 p = list[q];
#pragma unroll
                        for (int j = 0; j < kCols; ++j) {
                            i64 c = c0 + threadIdx.x + (i64)j * nt;
                            if (c < width) acc[j] += load(gy, p * width + c);
                        }
                    }
                    count += total;
                    single = list[0];
                    // list and warp_count are rewritten by the next slab.
                    __syncthreads();
                }
            }
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                i64 c = c0 + threadIdx.x + (i64)j * nt;
                if (c >= width) continue;
                i64 o = row * width + c;
                if (count == 0) store(gt, o, A(0));
                else if (count == 1) gt[o] = gy[single * width + c];
                else store(gt, o, acc[j]);
            }
        }
    }
}

}  // namespace sg_emb

#define SG_EMB_GATHER(u, U, id, Id)                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                  \
        embedding_##u##_##id(const Id* ids, const U* table, U* y, i64 n_ids, i64 rows, \
                                                   i64 wu) { sg_pdl_entry();                           \
        sg_emb::gather_rows<Id, U>(ids, table, y, n_ids, rows, wu);                    \
    }
#define SG_EMB_GATHER_IDS(u, U)   \
    SG_EMB_GATHER(u, U, i32, int) \
    SG_EMB_GATHER(u, U, i64, long long)
SG_EMB_GATHER_IDS(u16, unsigned short)
SG_EMB_GATHER_IDS(u32, unsigned int)
SG_EMB_GATHER_IDS(u64, unsigned long long)
SG_EMB_GATHER_IDS(u128, uint4)

#define SG_EMB_BACKWARD(dt, T, id, Id)                                               \
    extern "C" __global__ void __launch_bounds__(512)                                \
        embedding_backward_##dt##_##id(const Id* ids, const T* gy, T* gt, i64 n_ids, \
                                                             i64 rows, i64 width) { sg_pdl_entry();  \
        sg_emb::scatter_rows<T, Id>(ids, gy, gt, n_ids, rows, width);                \
    }
#define SG_EMB_BACKWARD_IDS(dt, T)   \
    SG_EMB_BACKWARD(dt, T, i32, int) \
    SG_EMB_BACKWARD(dt, T, i64, long long)
SG_FOR_EACH_FLOAT(SG_EMB_BACKWARD_IDS)
