// Generation: the kernels of kv_write, cached_attention and sample_next,
// matching crates/core/src/ops/decode.rs (lowered by src/ops/decode.rs).
//
// Every index a kernel derives from device values (a cache row, a start
// position) is checked before it is used as an address: rows outside
// [0, N) and positions outside [0, S) are skipped, as on the CPU, so a bad
// value never reads or writes outside an operand.
//
// Launch conventions:
//   kv_write_<u>(U* cache, const U* src, const int* rows, const int* start,
//                const int* last, i64 bt_rows, i64 seq, i64 n, i64 s, i64 row_units)
//       one block per new row (b, t) (grid-striding), threads over its
//       row_units copy units; keyed by copy unit like movement.cu. With
//       `last` (not null) the cache is a ring (KvWrite's `ring`).
//   kv_write2_<u>(cache0, src0, cache1, src1, rows, start, last, ...the same)
//       two such writes (grid y = 2), merged by src/ops/decode.rs's
//       `merge_kv_writes` from consecutive launches.
//   cached_attention_split_h<H>_v<VW>_e<E>_s<ST>_<dtype>(q, k_cache, v_cache, rows, start,
//                part, o, i64 seq, i64 n, i64 s, int hq, int hkv, int d,
//                i64 splits, i64 chunk, double scale, int pitch, int window,
//                double softcap)
//       grid (B·T, splits, Hkv · head tiles), CA_THREADS threads; with
//       ST > 0, CA_WARPS · ST · 2 · 32 · pitch elements of dynamic shared
//       memory (each warp's ring of ST key and value tiles).
//   cached_attention_combine_<dtype>(part, o, i64 rows, int d, i64 splits)
//       one warp per query row (B·T·Hq rows, grid-striding), CA_THREADS threads.
//   sample_next_<dtype>(logits, sampling, seeds, start_in, next, start_out,
//                i64 batch, i64 vocab, i64 advance)
//       one block of SN_THREADS per batch row (grid-striding).

// `EMPTY_MAX` of decode.rs: the m of a split with nothing to attend to.
#define SG_EMPTY_MAX (-3.0e38)

// ------------------------------------------------------------------ kv_write

// The slot position p of batch row b goes to (KvWrite::slot): p itself
// inside the cache, or with a ring (last not null) p mod s for the s
// positions up to last[b]; -1 for none.
__device__ __forceinline__ i64 kv_slot(i64 p, const int* last, i64 b, i64 s) {
    if (p < 0 || s <= 0) return -1;
    if (!last) return p < s ? p : -1;
    const i64 l = last[b];
    return p <= l && p > l - s ? p % s : -1;
}

// Whether batch row b2 (positions start[b2]..+seq) writes `slot`: the one
// position that could (p itself, or in a ring the one of its s positions
// up to last[b2] that falls in the slot) is among its rows and written.
__device__ __forceinline__ bool kv_writes_slot(i64 slot, const int* start, const int* last, i64 b2, i64 seq, i64 s) {
    i64 p2 = slot;
    if (last) {
        const i64 l = last[b2];
        p2 = l - (((l - slot) % s) + s) % s;
    }
    const i64 t2 = p2 - (i64)start[b2];
    return t2 >= 0 && t2 < seq && kv_slot(p2, last, b2, s) == slot;
}

// A later batch row that writes the same cache slot wins, as in the CPU's
// loop order: each slot is written by exactly one block, so duplicated
// (row, slot) pairs give the same bits on every run instead of racing.
template <typename U>
__device__ void kv_write_rows(U* cache, const U* src, const int* rows, const int* start, const int* last,
                              i64 bt_rows, i64 seq, i64 n, i64 s, i64 row_units) {
    for (i64 bt = blockIdx.x; bt < bt_rows; bt += gridDim.x) {
        const i64 b = bt / seq, t = bt - b * seq;
        const i64 r = rows[b], slot = kv_slot((i64)start[b] + t, last, b, s);
        if (r < 0 || r >= n || slot < 0) continue;
        const i64 batch = bt_rows / seq;
        bool overwritten = false;
        for (i64 b2 = b + 1; b2 < batch && !overwritten; ++b2)
            overwritten = rows[b2] == r && kv_writes_slot(slot, start, last, b2, seq, s);
        if (overwritten) continue;
        U* dst = cache + (r * s + slot) * row_units;
        const U* from = src + bt * row_units;
        for (i64 u = threadIdx.x; u < row_units; u += blockDim.x) dst[u] = from[u];
    }
}

#define SG_KV_WRITE(name, U)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        kv_write_##name(U* cache, const U* src, const int* rows, const int* start, const int* last, i64 bt_rows, \
                        i64 seq, i64 n, i64 s, i64 row_units) { sg_pdl_entry();                                 \
        kv_write_rows<U>(cache, src, rows, start, last, bt_rows, seq, n, s, row_units);                         \
    }

// Two kv_writes of one step (a layer's keys and values: the same rows and
// positions into caches of one shape) in one launch; blockIdx.y picks the pair.
#define SG_KV_WRITE2(name, U)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                          \
        kv_write2_##name(U* cache0, const U* src0, U* cache1, const U* src1, const int* rows, const int* start, \
                         const int* last, i64 bt_rows, i64 seq, i64 n, i64 s, i64 row_units) { sg_pdl_entry(); \
        const bool second = blockIdx.y == 1;                                                                   \
        kv_write_rows<U>(second ? cache1 : cache0, second ? src1 : src0, rows, start, last, bt_rows, seq, n, s, \
                         row_units);                                                                           \
    }

SG_KV_WRITE(u8, unsigned char)
SG_KV_WRITE(u16, unsigned short)
SG_KV_WRITE(u32, unsigned int)
SG_KV_WRITE(u64, unsigned long long)
SG_KV_WRITE(u128, uint4)
SG_KV_WRITE2(u8, unsigned char)
SG_KV_WRITE2(u16, unsigned short)
SG_KV_WRITE2(u32, unsigned int)
SG_KV_WRITE2(u64, unsigned long long)
SG_KV_WRITE2(u128, uint4)

// ------------------------------------------------------------ cached_attention
//
// Split pass: a block owns one query row (b, t), one split of the cache
// positions and up to H query heads of one kv head's group, so each
// key and value row it reads serves all those heads. Its four warps take
// 32-key tiles of the split in turn. In a tile, lane j owns key j: it reads
// that key row whole (VW elements per load) and dots it with every head's
// query (in shared memory), then the warp updates each head's online
// softmax (m, l) and, lane by lane over the tile's keys, its accumulator,
// whose D elements are spread over the lanes in packs of VW (at most E per
// lane). The warps' states are then combined in warp order and written as
// the split's partial (m, l, acc[D]).
//
// Staging (ST > 0): reading its key row in place, a lane waits on memory
// once per load batch and the warp once per value batch, ~8 dependent
// round trips per tile with little in flight between them. With ST stages
// each warp instead copies its tiles (32 key rows, then 32 value rows) into
// a ring in shared memory by cp.async, coalesced (consecutive lanes take
// consecutive packs of a row), ST − 1 tiles ahead of the one it computes,
// and reads them from there with the same arithmetic in the same order, so
// the results are the same bits. Rows are `pitch` elements apart in the
// ring, a pitch whose 4-byte words per load are odd, so the 32 lanes
// reading their key rows a load at a time hit distinct banks.
//
// Window and soft-cap (`Scores` of crates/core/src/ops/attention.rs, as
// `cached_attention_cpu` applies them): a query at cache position p sees
// positions max(0, p + 1 − window)..=p when window > 0, so a split starts
// at the later of its own start and the window's, and one wholly before the
// window writes the empty partial; with softcap > 0 a score is
// softcap·tanh(scale·q·k / softcap). Without either, the arithmetic is
// what it was before they existed.
//
// Combine pass: one warp per query row walks its splits in order, as the
// CPU does: o = Σ acc·e^{m − M} / Σ l·e^{m − M}, zeros where nothing was
// attended to. With one split the split pass writes o = acc / l itself.

#define CA_THREADS 128
// Key packs a lane loads before it uses them; value rows per batch shrink
// as a lane's accumulators (H heads × NS packs) grow, to stay in registers.
#define CA_BATCH 8
#define CA_WARPS (CA_THREADS / 32)
#define CA_MAX_D 256

// VW consecutive elements read as one load of VW·sizeof(T) bytes; the host
// only picks VW when every row start is aligned to it.
template <typename T, int VW> struct alignas(sizeof(T) * VW) Chunk {
    T e[VW];
};

// Element i of a chunk as the accumulator type; bf16 widens by a shift
// (its bits are f32's upper half), which keeps chunks packed in registers.
template <typename T, int VW> __device__ __forceinline__ acc_t<T> chunk_elem(const Chunk<T, VW>& c, int i) {
    return load(c.e, i);
}
template <int VW> __device__ __forceinline__ float chunk_elem(const Chunk<__nv_bfloat16, VW>& c, int i) {
    return __uint_as_float((unsigned)reinterpret_cast<const unsigned short*>(c.e)[i] << 16);
}

// Copies keys [j0, j0 + n_keys) of one head (row j at `at + j·stride`) into
// the ring slot `dst` (rows `pitch` apart), VW elements per cp.async; then
// commits them as one group. Lane u takes packs u, u + 32, ...: consecutive
// lanes, consecutive packs of a row, then the next row.
template <typename T, int VW>
__device__ __forceinline__ void stage_rows(T* dst, const T* src, i64 at, i64 stride, int n_keys, int packs,
                                           int pitch, int lane) {
    int r = lane / packs, pk = lane - r * packs;
    const int step_rows = 32 / packs, step_packs = 32 - step_rows * packs;
    static_assert(VW * sizeof(T) >= 4, "cp.async copies 4, 8 or 16 bytes: 2-byte packs are read in place");
    for (; r < n_keys;) {
        cp_async<VW * sizeof(T)>(dst + r * pitch + pk * VW, src + at + r * stride + pk * VW, true);
        r += step_rows;
        pk += step_packs;
        if (pk >= packs) {
            pk -= packs;
            ++r;
        }
    }
    cp_commit();
}

template <typename T, int H, int VW, int E, int ST>
__device__ void cached_attention_split(const T* q, const T* kc, const T* vc, const int* rows, const int* start,
                                       acc_t<T>* part, T* o, i64 seq, i64 n_rows, i64 cache_len, int hq, int hkv,
                                       int d, i64 splits, i64 chunk, double scale_d, int pitch, int window,
                                       double softcap, T* ring) {
    typedef acc_t<T> A;
    constexpr int NS = E / VW;  // packs of the accumulator per lane
    constexpr int VB = H * NS <= 2 ? CA_BATCH : H * NS <= 4 ? CA_BATCH / 2 : CA_BATCH / 4;
    __shared__ A q_s[H][CA_MAX_D];
    __shared__ A w_acc[CA_WARPS][H][CA_MAX_D];
    __shared__ A w_m[CA_WARPS][H], w_l[CA_WARPS][H], w_f[CA_WARPS][H], m_s[H], l_s[H];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 bt = blockIdx.x, sp = blockIdx.y;
    const int group = hq / hkv, tiles = (group + H - 1) / H;
    const int g = blockIdx.z / tiles, tile = blockIdx.z - g * tiles;
    const int h0 = g * group + tile * H, nh = min(H, group - tile * H);
    const i64 b = bt / seq, t = bt - b * seq;
    const i64 row = rows[b], pos = (i64)start[b] + t;
    // Keys 0..=pos of a valid row (the window's of them), within the cache;
    // none for an invalid row. A split before the window has lo >= hi.
    const i64 last = (row >= 0 && row < n_rows && pos >= 0) ? min(pos, cache_len - 1) + 1 : 0;
    const i64 lo = window > 0 ? max(sp * chunk, pos + 1 - window) : sp * chunk;
    const i64 hi = min((sp + 1) * chunk, last);
    const A scale = (A)scale_d, empty = (A)SG_EMPTY_MAX;
    const int packs = d / VW;
    const i64 stride = (i64)hkv * d;  // elements from one position to the next

    for (int i = threadIdx.x; i < nh * d; i += blockDim.x) {
        const int hh = i / d, dd = i - hh * d;
        q_s[hh][dd] = load(q, (bt * hq + h0 + hh) * (i64)d + dd);
    }
    __syncthreads();

    A m[H], l[H], acc[H][E];
#pragma unroll
    for (int h = 0; h < H; ++h) {
        m[h] = empty;
        l[h] = A(0);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] = A(0);
    }
    // Only dereferenced for keys in [lo, hi), which exist only for a valid row.
    const i64 head_at = (lo < hi ? row * cache_len * stride : 0) + (i64)g * d;
    // This warp's ring: ST slots of 32 key rows then 32 value rows.
    T* const slots = ring + (i64)warp * ST * 64 * pitch;
    const i64 first = lo + warp * 32;
    // Stages tile i (keys from first + i·CA_WARPS·32) into its slot; past
    // the split the groups are empty, so every tile commits two groups.
    auto stage = [&](int i) {
        if constexpr (ST > 0) {
            const i64 j0 = first + (i64)i * CA_WARPS * 32;
            const int n_keys = j0 < hi ? (int)min((i64)32, hi - j0) : 0;
            T* slot = slots + (i64)(i % ST) * 64 * pitch;
            stage_rows<T, VW>(slot, kc, head_at + j0 * stride, stride, n_keys, packs, pitch, lane);
            stage_rows<T, VW>(slot + 32 * pitch, vc, head_at + j0 * stride, stride, n_keys, packs, pitch, lane);
        }
    };
    if constexpr (ST > 0)
        for (int i = 0; i < ST - 1; ++i) stage(i);
    int tile_i = 0;
    for (i64 j0 = first; j0 < hi; j0 += CA_WARPS * 32, ++tile_i) {
        const i64 j = j0 + lane;
        const bool valid = j < hi;
        // Where this tile's key and value rows are read: the ring slot once
        // its groups arrive, or the cache itself.
        const T *k_rows, *v_rows;
        i64 row_stride;
        if constexpr (ST > 0) {
            __syncwarp();  // every lane is done with the slot refilled next (tile_i − 1's)
            stage(tile_i + ST - 1);
            cp_wait<2 * ST - 1>();  // this tile's keys (its values and later tiles may be in flight)
            __syncwarp();
            k_rows = slots + (i64)(tile_i % ST) * 64 * pitch;
            v_rows = k_rows + 32 * pitch;
            row_stride = pitch;
        } else {
            k_rows = kc + head_at + j0 * stride;
            v_rows = vc + head_at + j0 * stride;
            row_stride = stride;
        }
        A dot[H];
#pragma unroll
        for (int h = 0; h < H; ++h) dot[h] = A(0);
        if (valid) {
            const T* kr = k_rows + lane * row_stride;
            // CA_BATCH loads issued before their products, so a tile waits
            // for memory packs / CA_BATCH times, not once per pack.
            for (int pk0 = 0; pk0 < packs; pk0 += CA_BATCH) {
                Chunk<T, VW> kb[CA_BATCH];
#pragma unroll
                for (int u = 0; u < CA_BATCH; ++u)
                    if (pk0 + u < packs) kb[u] = *reinterpret_cast<const Chunk<T, VW>*>(kr + (pk0 + u) * VW);
#pragma unroll
                for (int u = 0; u < CA_BATCH; ++u) {
                    if (pk0 + u >= packs) break;
#pragma unroll
                    for (int e = 0; e < VW; ++e)
#pragma unroll
                        for (int h = 0; h < H; ++h)
                            if (h < nh) dot[h] += q_s[h][(pk0 + u) * VW + e] * chunk_elem(kb[u], e);
                }
            }
        }
        A p[H];
#pragma unroll
        for (int h = 0; h < H; ++h) {
            if (h >= nh) continue;
            // A uniform branch: the plain score stays the product it was.
            const A s = !valid ? A(-INFINITY) : softcap > 0 ? A(sg_cap(scale * dot[h], softcap)) : scale * dot[h];
            const A m_new = fmax(m[h], warp_max(s));
            const A rescale = exp(m[h] - m_new);  // 0 while m is still EMPTY_MAX
            p[h] = exp(s - m_new);                // 0 for lanes past the split
            l[h] = l[h] * rescale + warp_sum(p[h]);
#pragma unroll
            for (int e = 0; e < E; ++e) acc[h][e] *= rescale;
            m[h] = m_new;
        }
        // acc += Σ_j p_j·v_j, key by key (p_j from lane j), each lane its packs of v_j.
        // The value rows of VB keys are loaded before they are added.
        const int n_keys = (int)min((i64)32, hi - j0);
        if constexpr (ST > 0) {
            cp_wait<2 * ST - 2>();  // this tile's values
            __syncwarp();
        }
        const T* vr = v_rows;
        for (int jj0 = 0; jj0 < n_keys; jj0 += VB) {
            Chunk<T, VW> vb[VB][NS];
#pragma unroll
            for (int u = 0; u < VB; ++u)
#pragma unroll
                for (int ns = 0; ns < NS; ++ns) {
                    const int pk = lane + 32 * ns;
                    if (jj0 + u < n_keys && pk < packs)
                        vb[u][ns] = *reinterpret_cast<const Chunk<T, VW>*>(vr + (jj0 + u) * row_stride + pk * VW);
                }
#pragma unroll
            for (int u = 0; u < VB; ++u) {
                const int jj = jj0 + u;
                if (jj >= n_keys) break;
                A pj[H];
#pragma unroll
                for (int h = 0; h < H; ++h) pj[h] = __shfl_sync(0xffffffffu, h < nh ? p[h] : A(0), jj);
#pragma unroll
                for (int ns = 0; ns < NS; ++ns) {
                    const int pk = lane + 32 * ns;
                    if (pk >= packs) continue;
#pragma unroll
                    for (int h = 0; h < H; ++h)
                        if (h < nh)
#pragma unroll
                            for (int e = 0; e < VW; ++e) acc[h][ns * VW + e] += pj[h] * chunk_elem(vb[u][ns], e);
                }
            }
        }
    }

    if constexpr (ST > 0) cp_wait<0>();  // the empty groups past the split

    // The warps' states, combined in warp order (a warp without keys has
    // m = EMPTY_MAX, l = 0, acc = 0 and weighs nothing, unless no warp had any).
#pragma unroll
    for (int h = 0; h < H; ++h) {
        if (h >= nh) continue;
        if (lane == 0) {
            w_m[warp][h] = m[h];
            w_l[warp][h] = l[h];
        }
#pragma unroll
        for (int ns = 0; ns < NS; ++ns) {
            const int pk = lane + 32 * ns;
            if (pk >= packs) continue;
#pragma unroll
            for (int e = 0; e < VW; ++e) w_acc[warp][h][pk * VW + e] = acc[h][ns * VW + e];
        }
    }
    __syncthreads();
    if (threadIdx.x < nh) {
        const int h = threadIdx.x;
        A big_m = empty;
        for (int w = 0; w < CA_WARPS; ++w) big_m = fmax(big_m, w_m[w][h]);
        for (int w = 0; w < CA_WARPS; ++w) w_f[w][h] = exp(w_m[w][h] - big_m);
        m_s[h] = big_m;
        A l_total = A(0);
        for (int w = 0; w < CA_WARPS; ++w) l_total += w_l[w][h] * w_f[w][h];
        l_s[h] = l_total;
    }
    __syncthreads();
    const int width = d + 2;
    for (int i = threadIdx.x; i < nh * width; i += blockDim.x) {
        const int hh = i / width, c = i - hh * width;
        A v = A(0);
        if (c == 0) {
            v = m_s[hh];
        } else {
            for (int w = 0; w < CA_WARPS; ++w) v += (c == 1 ? w_l[w][hh] : w_acc[w][hh][c - 2]) * w_f[w][hh];
        }
        part[((bt * hq + h0 + hh) * splits + sp) * width + c] = v;
        // With one split the combine pass would only divide by l (its
        // weight e^{m − M} is 1): the split writes o itself and the host
        // launches no combine.
        if (splits == 1 && c >= 2)
            store(o, (bt * hq + h0 + hh) * (i64)d + (c - 2), l_s[hh] > A(0) ? v / l_s[hh] : A(0));
    }
}

// o of one query row per warp, its splits in order as on the CPU; the
// weights e^{m − M} of 32 splits at a time are computed by the lanes and
// broadcast.
template <typename T> __device__ void cached_attention_combine(const acc_t<T>* part, T* o, i64 rows, int d, i64 splits) {
    typedef acc_t<T> A;
    constexpr int E = CA_MAX_D / 32;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const i64 width = d + 2;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        const A* pr = part + r * splits * width;
        A big_m = (A)SG_EMPTY_MAX;
        for (i64 sp = lane; sp < splits; sp += 32) big_m = fmax(big_m, pr[sp * width]);
        big_m = warp_max(big_m);
        A total = A(0), acc[E];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = A(0);
        for (i64 sp0 = 0; sp0 < splits; sp0 += 32) {
            A w = A(0), l = A(0);
            if (sp0 + lane < splits) {
                w = exp(pr[(sp0 + lane) * width] - big_m);
                l = pr[(sp0 + lane) * width + 1];
            }
            const int n = (int)min((i64)32, splits - sp0);
            for (int jj = 0; jj < n; ++jj) {
                const A wj = __shfl_sync(0xffffffffu, w, jj), lj = __shfl_sync(0xffffffffu, l, jj);
                total += lj * wj;
                const A* ps = pr + (sp0 + jj) * width + 2;
#pragma unroll
                for (int e = 0; e < E; ++e)
                    if (lane + 32 * e < d) acc[e] += wj * ps[lane + 32 * e];
            }
        }
#pragma unroll
        for (int e = 0; e < E; ++e)
            if (lane + 32 * e < d) store(o, r * d + lane + 32 * e, total > A(0) ? acc[e] / total : A(0));
    }
}

#define SG_CA_SPLIT_ST(sfx, T, H, VW, E, ST)                                                                    \
    extern "C" __global__ void __launch_bounds__(CA_THREADS)                                                     \
        cached_attention_split_h##H##_v##VW##_e##E##_s##ST##_##sfx(                                              \
            const T* q, const T* kc, const T* vc, const int* rows, const int* start, acc_t<T>* part, T* o,        \
            i64 seq, i64 n, i64 s, int hq, int hkv, int d, i64 splits, i64 chunk, double scale, int pitch,        \
            int window, double softcap) { sg_pdl_entry();                                                         \
        extern __shared__ __align__(16) unsigned char ca_ring[];                                                 \
        cached_attention_split<T, H, VW, E, ST>(q, kc, vc, rows, start, part, o, seq, n, s, hq, hkv, d, splits, \
                                                chunk, scale, pitch, window, softcap,                            \
                                                reinterpret_cast<T*>(ca_ring));                                  \
    }
// Every width reads the cache in place (ST = 0); those whose loads are at
// least 4 bytes (cp.async's smallest copy) can also stage it (ST = 2).
#define SG_CA_SPLIT(sfx, T, H, VW, E) SG_CA_SPLIT_ST(sfx, T, H, VW, E, 0)
#define SG_CA_SPLIT2(sfx, T, H, VW, E) SG_CA_SPLIT_ST(sfx, T, H, VW, E, 0) SG_CA_SPLIT_ST(sfx, T, H, VW, E, 2)

#define SG_CA_COMBINE(sfx, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(CA_THREADS)                                                     \
        cached_attention_combine_##sfx(const acc_t<T>* part, T* o, i64 rows, int d, i64 splits) { sg_pdl_entry();                \
        cached_attention_combine<T>(part, o, rows, d, splits);                                                   \
    }

// Heads per block H: 1 (one query head per kv head: its registers and
// shared memory are a fraction of the grouped kernel's, so more blocks fit
// an SM) or the most a block holds (8; 4 for f64, whose accumulators take
// twice the registers). Load widths VW (elements) of 2 to 16 bytes and lane
// widths E ≥ VW: E = 4 serves D ≤ 128, E = 8 D ≤ 256. src/ops/decode.rs
// picks them.
#define SG_CA_WIDTHS_16(sfx, T, H)                                                                                \
    SG_CA_SPLIT(sfx, T, H, 1, 4) SG_CA_SPLIT2(sfx, T, H, 2, 4) SG_CA_SPLIT2(sfx, T, H, 4, 4)                      \
        SG_CA_SPLIT(sfx, T, H, 1, 8) SG_CA_SPLIT2(sfx, T, H, 2, 8) SG_CA_SPLIT2(sfx, T, H, 4, 8)                  \
            SG_CA_SPLIT2(sfx, T, H, 8, 8)
#define SG_CA_WIDTHS_32(sfx, T, H)                                                                                \
    SG_CA_SPLIT2(sfx, T, H, 1, 4) SG_CA_SPLIT2(sfx, T, H, 2, 4) SG_CA_SPLIT2(sfx, T, H, 4, 4)                     \
        SG_CA_SPLIT2(sfx, T, H, 1, 8) SG_CA_SPLIT2(sfx, T, H, 2, 8) SG_CA_SPLIT2(sfx, T, H, 4, 8)
#define SG_CA_WIDTHS_64(sfx, T, H)                                                                                \
    SG_CA_SPLIT2(sfx, T, H, 1, 4) SG_CA_SPLIT2(sfx, T, H, 2, 4) SG_CA_SPLIT2(sfx, T, H, 1, 8)                     \
        SG_CA_SPLIT2(sfx, T, H, 2, 8)

SG_CA_WIDTHS_16(bf16, __nv_bfloat16, 1)
SG_CA_WIDTHS_16(bf16, __nv_bfloat16, 8)
SG_CA_COMBINE(bf16, __nv_bfloat16)
SG_CA_WIDTHS_16(f16, __half, 1)
SG_CA_WIDTHS_16(f16, __half, 8)
SG_CA_COMBINE(f16, __half)
SG_CA_WIDTHS_32(f32, float, 1)
SG_CA_WIDTHS_32(f32, float, 8)
SG_CA_COMBINE(f32, float)
SG_CA_WIDTHS_64(f64, double, 1)
SG_CA_WIDTHS_64(f64, double, 4)
SG_CA_COMBINE(f64, double)

// ----------------------------------------------------------------- sample_next
//
// One block per batch row, in double like the CPU's `sample_row`, so the
// tokens match it. Greedy rows take the first largest logit. Otherwise the
// top-k threshold (the k-th largest value: exact whatever the algorithm) and
// the top-p threshold τ are each found by searching the order-preserving
// integer keys of the logits: the largest key K whose predicate holds
// (count of keys ≥ K at least k; mass of kept tokens with keys ≥ K at least
// top_p of their total). The search narrows [lo, hi) by SN_PIVOTS pivots per
// pass over the row, each pass one block reduction in a fixed order (the
// masses are sums in another order than the CPU's, so τ can differ only
// where a cumulative mass ties top_p·total to rounding). Then the
// Gumbel-max draw: the first kept token with the largest z − ln(−ln u).
//
// Keys are of the storage value (16, 32 or 64 bits), NaN mapped to −inf and
// −0 to +0 (which the CPU's comparisons treat as equal), so the search takes
// at most 16, 32 or 64 / log2(SN_PIVOTS + 1) passes. z = x / temperature is
// monotone in x, so a threshold on keys is one on z; the kept tests compare
// z itself, as the CPU does.
//
// When top-k keeps at most SN_CANDIDATES tokens, they are compacted once (in
// index order, so every sum has a fixed order) into shared memory and top-p
// and the draw read only them.

#define SN_THREADS 1024
#define SN_PIVOTS 3
#define SN_CANDIDATES 1536
#define SN_NONE 0x7fffffff

// Order-preserving keys of a storage type's bits: NaN becomes −inf and −0
// becomes +0, then negative values are complemented and positive ones get
// the sign bit, so unsigned order is numeric order.
template <typename K, int BITS> struct KeyBits {
    static constexpr K sign = K(1) << (BITS - 1);
    static constexpr K mask = ~K(0) >> (8 * sizeof(K) - BITS);
    __device__ static K of(K u, K inf_bits) {
        if ((u & ~sign) > inf_bits) u = sign | inf_bits;
        if (u == sign) u = 0;
        return (u & sign) ? (~u & mask) : (u | sign);
    }
    __device__ static K bits(K k) { return (k & sign) ? (k & ~sign) : (~k & mask); }
};

template <typename T> struct SnKey;
template <> struct SnKey<float> {
    typedef unsigned int K;
    typedef KeyBits<K, 32> B;
    __device__ static K of(float x) { return B::of(__float_as_uint(x), 0x7f800000u); }
    __device__ static double value(K k) { return (double)__uint_as_float(B::bits(k)); }
};
template <> struct SnKey<__nv_bfloat16> {
    typedef unsigned int K;
    typedef KeyBits<K, 16> B;
    __device__ static K of(__nv_bfloat16 x) { return B::of(__bfloat16_as_ushort(x), 0x7f80u); }
    __device__ static double value(K k) {
        return (double)__bfloat162float(__ushort_as_bfloat16((unsigned short)B::bits(k)));
    }
};
template <> struct SnKey<__half> {
    typedef unsigned int K;
    typedef KeyBits<K, 16> B;
    __device__ static K of(__half x) { return B::of(__half_as_ushort(x), 0x7c00u); }
    __device__ static double value(K k) { return (double)__half2float(__ushort_as_half((unsigned short)B::bits(k))); }
};
template <> struct SnKey<double> {
    typedef unsigned long long K;
    typedef KeyBits<K, 64> B;
    __device__ static K of(double x) { return B::of((K)__double_as_longlong(x), 0x7ff0000000000000ull); }
    __device__ static double value(K k) { return __longlong_as_double((long long)B::bits(k)); }
};

// splitmix64 and gumbel_uniform of decode.rs, bit for bit.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ double gumbel_uniform(unsigned long long seed, unsigned int position, unsigned int token) {
    const unsigned long long h = splitmix64(seed ^ splitmix64(((unsigned long long)position << 32) | token));
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Shared scratch of the block reductions.
template <typename K> struct SnScratch {
    K k[3][32];
    int i[2][32];
    double s[32][SN_PIVOTS + 1];
    long long c[32][SN_PIVOTS + 1];
};

// Element-wise sums of v over the block; every thread sums the warps' sums
// in warp order, so all get the same bits.
template <typename W, int N> __device__ void block_sum_n(W (&v)[N], W (*scratch)[N]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = warp_sum(v[j]);
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < N; ++j) scratch[warp][j] = v[j];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < N; ++j) {
        W s = W(0);
        for (int w = 0; w < nwarps; ++w) s += scratch[w][j];
        v[j] = s;
    }
}

// The block's smallest `lo`, largest `hi`, and the best (key, index):
// larger key first, then smaller index.
template <typename K> __device__ void block_min_max_arg(K& lo, K& hi, K& bk, int& bi, SnScratch<K>& sc) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const K lo2 = __shfl_xor_sync(0xffffffffu, lo, o), hi2 = __shfl_xor_sync(0xffffffffu, hi, o);
        const K bk2 = __shfl_xor_sync(0xffffffffu, bk, o);
        const int bi2 = __shfl_xor_sync(0xffffffffu, bi, o);
        lo = min(lo, lo2);
        hi = max(hi, hi2);
        if (bk2 > bk || (bk2 == bk && bi2 < bi)) bk = bk2, bi = bi2;
    }
    __syncthreads();
    if (lane == 0) sc.k[0][warp] = lo, sc.k[1][warp] = hi, sc.k[2][warp] = bk, sc.i[0][warp] = bi;
    __syncthreads();
    lo = sc.k[0][0], hi = sc.k[1][0], bk = sc.k[2][0], bi = sc.i[0][0];
    for (int w = 1; w < nwarps; ++w) {
        lo = min(lo, sc.k[0][w]);
        hi = max(hi, sc.k[1][w]);
        if (sc.k[2][w] > bk || (sc.k[2][w] == bk && sc.i[0][w] < bi)) bk = sc.k[2][w], bi = sc.i[0][w];
    }
}

// The tokens a search or draw walks: the whole row, or the candidates
// compacted into shared memory. j-th element: its key, z and token index.
template <typename T> struct RowSource {
    typedef typename SnKey<T>::K K;
    const T* x;
    i64 n;
    double temperature;
    __device__ K key(i64 j) const { return SnKey<T>::of(x[j]); }
    __device__ double z(i64 j, K k) const { return SnKey<T>::value(k) / temperature; }
    __device__ int index(i64 j) const { return (int)j; }
};
template <typename T> struct CandSource {
    typedef typename SnKey<T>::K K;
    const K* keys;
    const double* zs;
    const int* idx;
    i64 n;
    __device__ K key(i64 j) const { return keys[j]; }
    __device__ double z(i64 j, K) const { return zs[j]; }
    __device__ int index(i64 j) const { return idx[j]; }
};

// The largest key K in [lo, hi) with `above + Σ_{K ≤ key_i < hi} w_i ≥ need`,
// given that it holds at lo and `above` is the sum over keys ≥ hi (it fails
// at hi). `weight(j, key)` is evaluated only for elements strictly inside
// the current window. W is long long (counts) or double (masses).
template <typename W, typename Src, typename Weight>
__device__ typename Src::K sn_search(const Src& src, typename Src::K lo, typename Src::K hi, W above, W need,
                                     Weight weight, W (*scratch)[SN_PIVOTS + 1]) {
    typedef typename Src::K K;
    while (hi - lo > 1) {
        // Pivots split (lo, hi) into n + 1 parts of nearly equal key range.
        const K span = hi - lo;
        const int n = span - 1 < (K)SN_PIVOTS ? (int)(span - 1) : SN_PIVOTS;
        const K part = span / (K)(n + 1), rem = span % (K)(n + 1);
        K piv[SN_PIVOTS];
#pragma unroll
        for (int j = 0; j < SN_PIVOTS; ++j) {
            const K jj = (K)(j + 1);
            piv[j] = j < n ? lo + jj * part + (jj < rem ? jj : rem) : hi;
        }
        // sums[j]: over window keys ≥ piv[j]; sums[SN_PIVOTS]: the window's count.
        W sums[SN_PIVOTS + 1];
#pragma unroll
        for (int j = 0; j <= SN_PIVOTS; ++j) sums[j] = W(0);
        for (i64 e = threadIdx.x; e < src.n; e += blockDim.x) {
            const K k = src.key(e);
            if (k <= lo || k >= hi) continue;
            sums[SN_PIVOTS] += W(1);
            if (k < piv[0]) continue;
            const W w = weight(e, k);
#pragma unroll
            for (int j = 0; j < SN_PIVOTS; ++j)
                if (k >= piv[j]) sums[j] += w;
        }
        block_sum_n(sums, scratch);
        // No key strictly inside: every K in (lo, hi) fails as hi does.
        if (sums[SN_PIVOTS] == W(0)) break;
        int a = 0;  // pivots that pass, from the left (the predicate falls with K)
        while (a < n && above + sums[a] >= need) ++a;
        const K new_lo = a > 0 ? piv[a - 1] : lo;
        if (a < n) {
            hi = piv[a];
            above = above + sums[a];
        }
        lo = new_lo;
    }
    return lo;
}

// Σ exp(z − zmax) over the tokens with z ≥ thr (the CPU's top-k-kept set)
// and the smallest key among them.
template <typename Src>
__device__ double sn_total(const Src& src, double thr, double zmax, typename Src::K& kept_lo,
                           SnScratch<typename Src::K>& sc) {
    typedef typename Src::K K;
    double v[SN_PIVOTS + 1] = {0.0};
    K lo = ~K(0), hi = 0, bk = 0;
    int bi = SN_NONE;
    for (i64 e = threadIdx.x; e < src.n; e += blockDim.x) {
        const K k = src.key(e);
        const double z = src.z(e, k);
        if (z >= thr) {
            v[0] += exp(z - zmax);
            lo = min(lo, k);
        }
    }
    block_sum_n(v, sc.s);
    block_min_max_arg(lo, hi, bk, bi, sc);
    kept_lo = lo;
    return v[0];
}

// The Gumbel-max draw over the tokens with z ≥ thr and z ≠ −inf: as the
// CPU's sequential loop, the first kept token wins if its score is NaN
// (z NaN, which nothing then beats), else the first largest score.
template <typename Src>
__device__ int sn_draw(const Src& src, double thr, unsigned long long seed, unsigned int position,
                       SnScratch<typename Src::K>& sc) {
    typedef typename Src::K K;
    int first = SN_NONE, bi = SN_NONE;
    bool first_nan = false;
    double best = -INFINITY;
    for (i64 e = threadIdx.x; e < src.n; e += blockDim.x) {
        const K k = src.key(e);
        const double z = src.z(e, k);
        if (z < thr || z == -INFINITY) continue;
        const int i = src.index(e);
        const double score = z - log(-log(gumbel_uniform(seed, position, (unsigned int)i)));
        if (i < first) first = i, first_nan = isnan(score);
        if (!isnan(score) && (bi == SN_NONE || score > best || (score == best && i < bi))) best = score, bi = i;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const int f2 = __shfl_xor_sync(0xffffffffu, first, o);
        const bool n2 = __shfl_xor_sync(0xffffffffu, (int)first_nan, o);
        const int b2 = __shfl_xor_sync(0xffffffffu, bi, o);
        const double s2 = __shfl_xor_sync(0xffffffffu, best, o);
        if (f2 < first) first = f2, first_nan = n2;
        if (b2 != SN_NONE && (bi == SN_NONE || s2 > best || (s2 == best && b2 < bi))) best = s2, bi = b2;
    }
    __syncthreads();
    if (lane == 0) sc.i[0][warp] = first, sc.i[1][warp] = bi, sc.s[warp][0] = best, sc.s[warp][1] = first_nan;
    __syncthreads();
    first = SN_NONE, bi = SN_NONE;
    for (int w = 0; w < nwarps; ++w) {
        if (sc.i[0][w] < first) first = sc.i[0][w], first_nan = sc.s[w][1] != 0.0;
        const int b2 = sc.i[1][w];
        const double s2 = sc.s[w][0];
        if (b2 != SN_NONE && (bi == SN_NONE || s2 > best || (s2 == best && b2 < bi))) best = s2, bi = b2;
    }
    if (first == SN_NONE) return 0;
    return first_nan ? first : bi;
}

template <typename T>
__device__ void sample_rows(const T* logits, const float* sampling, const i64* seeds, const int* start_in, int* next,
                            int* start_out, i64 batch, i64 vocab, i64 advance) {
    typedef typename SnKey<T>::K K;
    __shared__ SnScratch<K> sc;
    __shared__ K cand_key[SN_CANDIDATES];
    __shared__ double cand_z[SN_CANDIDATES];
    __shared__ int cand_idx[SN_CANDIDATES];
    __shared__ int warp_count[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    for (i64 r = blockIdx.x; r < batch; r += gridDim.x) {
        const RowSource<T> row{logits + r * vocab, vocab, (double)sampling[r * 3]};
        const double temperature = sampling[r * 3], top_k = sampling[r * 3 + 1], top_p = sampling[r * 3 + 2];
        // Read before any thread writes start_out (which may be start_in).
        const i64 st = start_in[r];
        const unsigned long long seed = (unsigned long long)seeds[r];
        const i64 position = min(max(st + advance, (i64)0), (i64)0xffffffffll);

        // Smallest and largest key; the greedy token (first largest logit).
        K kmin = ~K(0), kmax = 0, bk = 0;
        int bi = SN_NONE;
        for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const K k = row.key(i);
            kmin = min(kmin, k);
            kmax = max(kmax, k);
            if (k > bk) bk = k, bi = (int)i;  // ascending i per thread: first wins ties
        }
        block_min_max_arg(kmin, kmax, bk, bi, sc);

        int chosen = bi;
        if (temperature > 0.0) {
            double thr = -INFINITY;
            const bool top_k_on = top_k >= 1.0 && top_k < (double)vocab;
            if (top_k_on) {
                // count(K) = #{key ≥ K}: the largest K with count ≥ k is the k-th largest key.
                const auto one = [](i64, K) { return 1ll; };
                const K kk = sn_search<long long>(row, kmin, kmax + 1, 0ll, (long long)top_k, one, sc.c);
                thr = SnKey<T>::value(kk) / temperature;
            }
            // Compact the top-k tokens when few, in index order.
            int n_cand = -1;
            if (top_k_on) {
                int total = 0;
                for (i64 base = 0; base < vocab && total <= SN_CANDIDATES; base += blockDim.x) {
                    const i64 i = base + threadIdx.x;
                    K k = 0;
                    double z = 0.0;
                    bool keep = false;
                    if (i < vocab) {
                        k = row.key(i);
                        z = row.z(i, k);
                        keep = z >= thr;
                    }
                    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
                    if (lane == 0) warp_count[warp] = __popc(ballot);
                    __syncthreads();
                    int at = total + __popc(ballot & ((1u << lane) - 1u));
                    for (int w = 0; w < warp; ++w) at += warp_count[w];
                    for (int w = 0; w < nwarps; ++w) total += warp_count[w];
                    if (keep && at < SN_CANDIDATES) cand_key[at] = k, cand_z[at] = z, cand_idx[at] = (int)i;
                    __syncthreads();
                }
                if (total <= SN_CANDIDATES) n_cand = total;
            }
            const CandSource<T> cand{cand_key, cand_z, cand_idx, n_cand};
            if (top_p > 0.0 && top_p < 1.0) {
                const double zmax = SnKey<T>::value(kmax) / temperature;
                K kept_lo;  // the smallest kept key: the search starts there
                double mass;
                if (n_cand >= 0)
                    mass = sn_total(cand, thr, zmax, kept_lo, sc);
                else
                    mass = sn_total(row, thr, zmax, kept_lo, sc);
                const double need = top_p * mass;
                // NaN (an infinite logit) keeps every token, as on the CPU.
                if (mass >= need) {
                    const auto w_row = [&](i64 j, K k) { return exp(row.z(j, k) - zmax); };
                    const auto w_cand = [&](i64 j, K k) { return exp(cand.z(j, k) - zmax); };
                    const K kp = n_cand >= 0 ? sn_search<double>(cand, kept_lo, kmax + 1, 0.0, need, w_cand, sc.s)
                                             : sn_search<double>(row, kept_lo, kmax + 1, 0.0, need, w_row, sc.s);
                    thr = fmax(thr, SnKey<T>::value(kp) / temperature);
                }
            }
            chosen = n_cand >= 0 ? sn_draw(cand, thr, seed, (unsigned int)position, sc)
                                 : sn_draw(row, thr, seed, (unsigned int)position, sc);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            next[r] = chosen;
            start_out[r] = (int)((unsigned int)st + (unsigned int)advance);
        }
    }
}

#define SG_SAMPLE_NEXT(sfx, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(SN_THREADS)                                                      \
        sample_next_##sfx(const T* logits, const float* sampling, const i64* seeds, const int* start_in,         \
                          int* next, int* start_out, i64 batch, i64 vocab, i64 advance) { sg_pdl_entry();                         \
        sample_rows<T>(logits, sampling, seeds, start_in, next, start_out, batch, vocab, advance);                \
    }

SG_FOR_EACH_FLOAT(SG_SAMPLE_NEXT)
