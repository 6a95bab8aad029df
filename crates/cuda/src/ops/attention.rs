//! Fused causal attention on the GPU: the lowering of `attention` and
//! `attention_backward` to the kernels of `kernels/attention.cu` and
//! `kernels/attention_mma.cu` (whose variant modules are declared here).
//!
//! # Algorithm
//!
//! Flash-attention style: nothing `T×T` is stored anywhere. Scores are
//! computed tile by tile into registers, turned into probabilities and
//! consumed at once; each query row keeps O(1) state (running max and sum)
//! and the forward saves only its log-sum-exp. Softmax runs in base 2
//! (`exp2(s·scale·log2 e − m)`), in `float` for f32/bf16/f16 storage and in
//! `double` for f64; storage is rounded once.
//!
//! One launch for the forward and two for the backward (query side first):
//!
//! * `attention_fwd`: a block owns a tile of query rows of one (batch,
//!   query head) and walks the key tiles from the one holding its first
//!   row's first key to the diagonal, in order, with an online softmax; it
//!   writes `o` and `lse`.
//! * `attention_bwd_q`: a block owns a tile of query rows of one (batch,
//!   query head), computes its rows' `D_i = go_i·o_i − glse_i` (stored in
//!   the op's `delta` output) and walks the key tiles in order: `gq += ds·k`.
//! * `attention_bwd_kv`: a block owns a tile of key rows of one (batch, kv
//!   head) and walks, in order, the query heads of its group and their query
//!   tiles from the diagonal to the one holding the last query that sees
//!   its last key. It recomputes `p = exp(s − lse)` and
//!   `ds = p·(go·v − D_i)` per tile (the tensor-core kernel reads `D_i` from
//!   `delta`; the CUDA-core one recomputes it) and accumulates `gv += pᵀ·go`
//!   and `gk += dsᵀ·q` in registers.
//!
//! Which keys a query sees follows the op's [`Scores`] and positions (see
//! `stepgraph_core::ops::attention`): query `i` sees keys `first(i)..=i`,
//! which is causal, sliding-window and packed-document masking at once, so
//! every pass masks entries outside that range and skips the tiles wholly
//! outside it: a windowed or packed step does less work. Soft-capped
//! scores are capped in natural units before they go to base 2, and the
//! score gradients take the cap's slope. Every pass takes the positions
//! pointer (null for none), the window (0) and the soft-cap (0) after the
//! scale (`SgKeys` in `kernels/common.cuh`).
//!
//! Head sizes are bucketed (`D ≤ 1, 4, 16, 32, 64, 128, 256`), one kernel per
//! bucket and dtype, zero-padded to the bucket. Buckets up to 16 use one
//! thread per query row (the backward's key side: one thread per key and
//! query slice, slices summed in a fixed order at the end); larger buckets
//! are register-tiled: 256 threads, each owning 4 rows × a few columns of a
//! score tile and 4 rows × `bucket/NX` dims of the accumulator, with the
//! score reduction over `D` staged through shared memory in slices and the
//! probability-times-rows products staged a few rows at a time (global loads
//! for the next slice are in flight while the current one is used). All
//! shared memory is static and under 48 KB, so no launch attribute is needed.
//!
//! # Tensor-core kernels
//!
//! For head sizes 17..=128 in bf16, f16 and f32, and 129..=256 in bf16 and
//! f16, the three passes run on tensor cores instead
//! (`kernels/attention_mma.cu`, one module per dtype and padded head size,
//! e.g. `attention_mma_d112_bf16`, see [`KERNELS`]): the same walks over
//! tiles, with every product a `mma.sync` on fragments read from tiles that
//! `cp.async` brings into shared memory. Head sizes are padded to a multiple
//! of 16, or to 256 above 128 ([`mma_width`]). A block is four warps over 64
//! rows (query rows, or key rows for `bwd_kv`); a warp owns 16 of them and
//! keeps its scores, probabilities and accumulators in registers: the f32
//! result fragment of `q·kᵀ` is the A fragment of `p·v` without leaving its
//! lane. The 16-bit forward at padded widths over 64 (and `bwd_q` at 80..=112)
//! gives a warp 32 rows (128 per block) so that each fragment read from
//! shared memory feeds two products ([`mma_rows`]); `scripts/attention-variants`
//! times such choices against each other and PyTorch on the GPU machine.
//! At 256 (Gemma) a warp's output rows alone take 128 registers, so every
//! pass keeps one row tile per warp and streams 32 columns per step, and
//! the key side runs two blocks per key tile, each recomputing the scores
//! and accumulating half the columns of `gk` and `gv`: half again as many
//! products on that side (both blocks compute the two score products),
//! against spilling both halves.
//!
//! * bf16/f16: `m16n8k16` with f32 accumulation, fragments by `ldmatrix`,
//!   tiles double-buffered. Probabilities and score gradients are rounded to
//!   the storage type as product inputs, as in FlashAttention-2.
//! * f32: `m16n8k8` on TF32 in three products per product (3xTF32: each
//!   operand split into a TF32 head and a TF32 remainder, the remainder
//!   product dropped), which keeps f32's accuracy (checked against the CPU
//!   at the f32 tolerance) at tensor-core speed. This is not the TF32 that
//!   `--tf32` allows for matmuls: no operand loses bits beyond ~2⁻²².
//!
//! * Hopper (`sm_90`, [`Target::sm90a`]): 16-bit attention at padded widths
//!   80..=128 runs on warpgroup MMA (`wgmma.mma_async`, modules
//!   `attention_mma_d<dp>_<dtype>_wg` built for `sm_90a`,
//!   [`wgmma_attention`]). A block is two warpgroups (256 threads) owning 64
//!   rows each (query rows; key rows for `bwd_kv`) that share every
//!   streamed tile, handed over by mbarriers (full / free per stage) rather
//!   than block barriers, so the warpgroups drift apart by up to a tile.
//!   The forward streams 128-key tiles in three stages, brought by the
//!   tensor copy engine (TMA) on the orders of a third, producer warpgroup
//!   that gives its registers to the other two; the tensor maps
//!   ([`TensorMap`], encoded by the driver when the session loads the
//!   launch) need k and v on 16-byte-aligned bases with rows of a multiple
//!   of 16 bytes, else the `mma.sync` passes run. The backward passes
//!   stream 64-row tiles in three stages, also by TMA, ordered by the
//!   block's first thread (k and v on the query side, q and go on the key
//!   side; the key side also needs the query heads of a kv group to start
//!   alike against 16-byte boundaries). Tiles sit in shared memory as
//!   wgmma's 8×16-byte core matrices (the forward's k tiles as
//!   128-byte-swizzled rows), so one tile is read K-major (as the B of the
//!   scores) and, transposed, MN-major (as the B of the value and gradient
//!   products); probabilities and score gradients stay in registers as A
//!   operands.
//!   Each warpgroup overlaps its products across steps: the forward runs
//!   one tile's softmax while the tensor cores multiply the previous
//!   tile's probabilities by its values; the backward issues a step's
//!   scores while the previous step's gradient products still run. Same
//!   arguments and determinism as the `mma.sync` passes (every output
//!   element accumulated by one thread in a fixed order). They need an even
//!   head size and 4-byte-aligned bases ([`wgmma_fits`]), else the
//!   `mma.sync` passes run; `STEPGRAPH_PORTABLE_KERNELS=1` turns them off.
//!
//! Shared memory is dynamic, up to ~100 KB (~133 KB at 256,
//! [`mma_shared_bytes`]; the warpgroup passes up to ~225 KB,
//! [`wgmma_shared_bytes`]).
//! `STEPGRAPH_ATTENTION=simt` selects the CUDA-core kernels for every dtype
//! (for comparisons).
//!
//! # Determinism
//!
//! There are no atomics and no split reductions whose order depends on
//! scheduling. Every output element is written by exactly one thread, which
//! accumulates its terms in an order fixed by the code: key tiles in order
//! for `o` and `gq`; query heads, then query tiles, then rows for `gk` and
//! `gv`. Cross-thread sums (row max and sum in the forward, `D_i`, the slice
//! sum of the small backward) use fixed butterfly or sequential orders, and
//! the butterfly gives every lane the same bits. So the same inputs give the
//! same bits on every run, eagerly or in a CUDA graph.

use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::attention::{Attention, AttentionBackward, Scores};

use super::{Lower, LowerCx, Target};
use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, DevTensor, KernelLaunch, Launch, TensorMap};
use crate::switches::{AttentionKernels, Switches};

/// The CUDA-core kernel source module.
pub const MODULE: &str = "attention";

const ATTENTION_SRC: &str = include_str!("../../kernels/attention.cu");
const ATTENTION_MMA_SRC: &str = include_str!("../../kernels/attention_mma.cu");

/// The attention modules: the CUDA-core source, then each tensor-core
/// variant (`attention_mma.cu` with its dtype and padded head size defined),
/// then the warpgroup-MMA variants (the same with `SGM_WGMMA`, built for
/// `sm_90a`).
macro_rules! attention_modules {
    (
        mma: [$(($name:literal, $sfx:literal, $ty:literal, $dp:literal)),* $(,)?],
        wgmma: [$(($wname:literal, $wsfx:literal, $wty:literal, $wdp:literal)),* $(,)?] $(,)?
    ) => {
        &[
            KernelModule::plain(MODULE, ATTENTION_SRC),
            $(attention_modules!(@variant $name, "", $sfx, $ty, $dp, false),)*
            $(attention_modules!(@variant $wname, "#define SGM_WGMMA 1\n", $wsfx, $wty, $wdp, true),)*
        ]
    };
    (@variant $name:literal, $extra:literal, $sfx:literal, $ty:literal, $dp:literal, $specific:literal) => {
        KernelModule {
            name: $name,
            source: ATTENTION_MMA_SRC,
            defines: concat!($extra, "#define SGM_SFX ", $sfx, "\n#define SGM_TYPE ", $ty, "\n#define SGM_DP ", $dp, "\n"),
            arch_specific: $specific,
        }
    };
}

/// Every module the attention ops launch: the CUDA-core source, one
/// tensor-core variant per dtype and padded head size ([`mma_width`]), and
/// the warpgroup-MMA passes of 16-bit storage at padded widths 80..=128
/// ([`wgmma_attention`]).
pub const KERNELS: &[KernelModule] = attention_modules![
    mma: [
        ("attention_mma_d32_bf16", "bf16", "__nv_bfloat16", "32"),
        ("attention_mma_d48_bf16", "bf16", "__nv_bfloat16", "48"),
        ("attention_mma_d64_bf16", "bf16", "__nv_bfloat16", "64"),
        ("attention_mma_d80_bf16", "bf16", "__nv_bfloat16", "80"),
        ("attention_mma_d96_bf16", "bf16", "__nv_bfloat16", "96"),
        ("attention_mma_d112_bf16", "bf16", "__nv_bfloat16", "112"),
        ("attention_mma_d128_bf16", "bf16", "__nv_bfloat16", "128"),
        ("attention_mma_d256_bf16", "bf16", "__nv_bfloat16", "256"),
        ("attention_mma_d32_f16", "f16", "__half", "32"),
        ("attention_mma_d48_f16", "f16", "__half", "48"),
        ("attention_mma_d64_f16", "f16", "__half", "64"),
        ("attention_mma_d80_f16", "f16", "__half", "80"),
        ("attention_mma_d96_f16", "f16", "__half", "96"),
        ("attention_mma_d112_f16", "f16", "__half", "112"),
        ("attention_mma_d128_f16", "f16", "__half", "128"),
        ("attention_mma_d256_f16", "f16", "__half", "256"),
        ("attention_mma_d32_f32", "f32", "float", "32"),
        ("attention_mma_d48_f32", "f32", "float", "48"),
        ("attention_mma_d64_f32", "f32", "float", "64"),
        ("attention_mma_d80_f32", "f32", "float", "80"),
        ("attention_mma_d96_f32", "f32", "float", "96"),
        ("attention_mma_d112_f32", "f32", "float", "112"),
        ("attention_mma_d128_f32", "f32", "float", "128"),
    ],
    wgmma: [
        ("attention_mma_d80_bf16_wg", "bf16", "__nv_bfloat16", "80"),
        ("attention_mma_d96_bf16_wg", "bf16", "__nv_bfloat16", "96"),
        ("attention_mma_d112_bf16_wg", "bf16", "__nv_bfloat16", "112"),
        ("attention_mma_d128_bf16_wg", "bf16", "__nv_bfloat16", "128"),
        ("attention_mma_d80_f16_wg", "f16", "__half", "80"),
        ("attention_mma_d96_f16_wg", "f16", "__half", "96"),
        ("attention_mma_d112_f16_wg", "f16", "__half", "112"),
        ("attention_mma_d128_f16_wg", "f16", "__half", "128"),
    ],
];

/// Whether the passes of `dtype` at padded head size `dp` run the
/// warpgroup-MMA kernels on a device of `target`: 16-bit storage at widths
/// 80..=128 on `sm_90` (see docs/benchmarks.md for what they measured
/// against the `mma.sync` ones), where the problem also fits them
/// ([`wgmma_fits`]).
pub fn wgmma_attention(target: Target, dtype: DType, dp: usize) -> bool {
    target.sm90a && matches!(dtype, DType::BF16 | DType::F16) && (80..=128).contains(&dp)
}

/// Whether the warpgroup kernels can take a problem of head size `d` whose
/// tensors start at `bases`: their tiles arrive by `cp.async` of at least 4
/// bytes (completion tracked by mbarriers, which a 2-byte copy, done as a
/// plain store, would escape), so rows of an even number of elements on
/// 4-byte-aligned bases.
pub fn wgmma_fits(d: usize, bases: &[u64]) -> bool {
    d.is_multiple_of(2) && bases.iter().all(|p| p.is_multiple_of(4))
}

/// A warpgroup-MMA block: two warpgroups of 64 rows each (query rows; key
/// rows for `bwd_kv`); the forward adds a producer warpgroup.
const WG_ROWS: usize = 128;
const WG_THREADS: u32 = 256;
const WG_FWD_THREADS: u32 = 384;

/// The warpgroup forward's key tile and stages (`WgFwd<DP>::{BN, NST}`).
const WG_FWD_KEYS: usize = 128;
const WG_FWD_STAGES: usize = 3;

/// The rows of the tiles the warpgroup backward passes stream (k and v on
/// the query side, q and go on the key side; `WgBwd<DP>::BS`).
const WG_BWD_TILE: usize = 64;

/// Whether every kv head's columns fit its tiles: the copy engine reads
/// boxes from 16-byte boundaries only, so a head starting `(head · D) mod 8`
/// columns past one is read from that boundary on and holds its D columns
/// from that shift on, within the padded width `dp`.
fn wg_shifts_fit(n: &Dims, dp: usize) -> bool {
    let shift = (0..n.hkv.min(8)).map(|h| h * n.d % 8).max().unwrap_or(0);
    n.d + shift <= dp
}

/// The tensor maps a warpgroup pass streams tiles by, over `[B][T][heads·D]`
/// (innermost first: the `heads·D` columns of a row, the rows of a
/// sequence, the sequences), one per `(base, box columns, 128-byte
/// swizzle)`, `rows` deep. `None` where the driver would refuse them (a
/// base off 16 bytes, or rows whose bytes are not a multiple of 16).
fn wg_tensor_maps(n: &Dims, heads: usize, rows: usize, tiles: &[(u64, u32, bool)]) -> Option<Vec<Arg>> {
    let (cols, t, b) = ((heads * n.d) as u64, n.t as u64, n.b as u64);
    let maps: Vec<TensorMap> = tiles
        .iter()
        .map(|&(ptr, box_cols, swizzle_128)| TensorMap {
            ptr,
            dims: vec![cols, t, b],
            strides: vec![cols * 2, cols * 2 * t],
            boxes: vec![box_cols, rows as u32, 1],
            swizzle_128,
            f16: n.dtype == DType::F16,
        })
        .collect();
    maps.iter().all(TensorMap::check).then(|| maps.into_iter().map(Arg::TensorMap).collect())
}

/// Dynamic shared memory of a warpgroup-MMA pass at padded width `dp`;
/// mirrors `WgFwd<DP>::SMEM` and `WgBwd<DP>::{BQ_SMEM, BKV_SMEM}` (16-bit
/// tiles of `dp` columns):
/// * forward: up to 1024 bytes to align the swizzled k tiles, three stages
///   each of a 128-row k tile (64-column boxes, so `dp` rounded up to 64)
///   and v tile, the block's 128-row q tile, thirteen mbarriers;
/// * `bwd_q`: up to 128 bytes to align the copy engine's tiles, the block's
///   q and go (128 rows), three stages of a 64-row k and v tile, the 128
///   rows' two f32 row terms, six mbarriers;
/// * `bwd_kv`: the same alignment, the block's k and v (128 rows), three
///   stages of a 64-row q and go tile with those rows' lse and delta, six
///   mbarriers, the 128 keys' document starts.
pub fn wgmma_shared_bytes(pass: Pass, dp: usize) -> usize {
    let (own, tile) = (WG_ROWS * dp * 2, 64 * dp * 2);
    match pass {
        Pass::Forward => {
            let (k, v) = (dp.div_ceil(64) * WG_FWD_KEYS * 128, WG_FWD_KEYS * dp * 2);
            1024 + WG_FWD_STAGES * (k + v) + own + (4 * WG_FWD_STAGES + 1) * 8
        }
        Pass::BackwardQ => 128 + 2 * own + 3 * 2 * tile + 2 * WG_ROWS * 4 + 6 * 8,
        Pass::BackwardKv => 128 + 2 * own + 3 * (2 * tile + 2 * 64 * 4) + 6 * 8 + WG_ROWS * 4,
    }
}

/// Rows of a tensor-core block with one tile of 16 per warp, and its threads.
const MMA_ROWS: usize = 64;
const MMA_THREADS: u32 = 128;

/// Padded head sizes above this one are wide (`Geo::WIDE`): 16-bit storage
/// padded to 256, one row tile per warp in every pass, 32 columns per step,
/// and the key side split over [`MMA_WIDE_KV_SPLIT`] blocks per key tile.
const MMA_NARROW_MAX: usize = 128;
const MMA_WIDE: usize = 256;

/// Blocks sharing one key tile of a wide `bwd_kv`, each accumulating its
/// own columns of `gk` and `gv` (mirrors `Geo::KV_SPLIT`).
const MMA_WIDE_KV_SPLIT: usize = 2;

/// Rows a tensor-core block of `pass` owns (query rows; key rows for
/// `bwd_kv`); mirrors `Geo::FWD_ROWS` and `Geo::BQ_ROWS`: two tiles of 16
/// per warp for 16-bit storage in the forward at padded widths 80..=128 and
/// in `bwd_q` at 80..=112 (at 128 one measured faster), else one.
pub fn mma_rows(pass: Pass, dtype: DType, dp: usize) -> usize {
    let two = dtype != DType::F32
        && match pass {
            Pass::Forward => dp > 64 && dp <= MMA_NARROW_MAX,
            Pass::BackwardQ => dp > 64 && dp < 128,
            Pass::BackwardKv => false,
        };
    if two {
        2 * MMA_ROWS
    } else {
        MMA_ROWS
    }
}

/// The padded head size of the tensor-core kernels for `dtype` and head
/// size `d`, or `None` when the CUDA-core kernels serve it: bf16, f16 and
/// f32 with `16 < d <= 128`, rounded up to a multiple of 16, and bf16 and
/// f16 with `128 < d <= 256` (Gemma's 256), padded to 256, unless
/// `switches` asks for the CUDA-core kernels ([`AttentionKernels::Simt`]).
pub fn mma_width(switches: &Switches, dtype: DType, d: usize) -> Option<usize> {
    if switches.attention == AttentionKernels::Simt || d <= 16 {
        return None;
    }
    match dtype {
        DType::BF16 | DType::F16 | DType::F32 if d <= MMA_NARROW_MAX => Some(d.div_ceil(16) * 16),
        DType::BF16 | DType::F16 if d <= MMA_WIDE => Some(MMA_WIDE),
        _ => None,
    }
}

/// Blocks per key tile and kv head of a tensor-core `bwd_kv` at padded
/// width `dp` (grid y is kv heads times this).
fn mma_kv_split(dp: usize) -> usize {
    if dp > MMA_NARROW_MAX {
        MMA_WIDE_KV_SPLIT
    } else {
        1
    }
}

/// The variant module holding the tensor-core kernels for `dtype` at padded
/// head size `dp` (one of [`KERNELS`]; `wg`: its warpgroup-MMA variant).
fn mma_module(dtype: DType, dp: usize, wg: bool) -> &'static str {
    let name = format!("attention_mma_d{dp}_{}{}", dtype_suffix(dtype).unwrap_or("?"), if wg { "_wg" } else { "" });
    KERNELS
        .iter()
        .map(|m| m.name)
        .find(|m| *m == name)
        .unwrap_or_else(|| panic!("no kernel module {name}: mma_width and attention::KERNELS disagree"))
}

/// Dynamic shared memory of a tensor-core pass for storage `dtype` at padded
/// head size `dp`; mirrors `Geo<T, DP>` in `attention_mma.cu`: rows of
/// `dp + pad` elements, `buffers` copies of each streamed tile, and f32 row
/// statistics for the backward.
pub fn mma_shared_bytes(pass: Pass, dtype: DType, dp: usize) -> usize {
    let f32 = dtype == DType::F32;
    let (elem, pad, buffers) = if f32 { (4, 4, 1) } else { (2, 8, 2) };
    let row = (dp + pad) * elem;
    let rows = mma_rows(pass, dtype, dp);
    let fwd_cols = if !f32 && rows == MMA_ROWS && dp <= MMA_NARROW_MAX { 64 } else { 32 };
    let bwd_cols = if !f32 && dp <= 64 { 64 } else { 32 };
    match pass {
        Pass::Forward => (rows + 2 * buffers * fwd_cols) * row,
        Pass::BackwardQ => (2 * rows + 2 * buffers * bwd_cols) * row + 2 * rows * 4,
        // q and go tiles stream (D_i comes from bwd_q); one set of row terms.
        Pass::BackwardKv => (2 * rows + 2 * buffers * bwd_cols) * row + 2 * bwd_cols * 4,
    }
}

/// Largest head size the kernels handle.
pub const MAX_HEAD_SIZE: usize = 256;

/// Head-size buckets, one kernel each: bucket `b` serves every `D <= b`.
pub const BUCKETS: [usize; 7] = [1, 4, 16, 32, 64, 128, 256];

/// Buckets up to this one use the one-thread-per-row kernels.
const SMALL_MAX: usize = 16;

/// Threads per block of the register-tiled kernels.
const TILED_THREADS: u32 = 256;

/// The three kernels of the op pair.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Pass {
    /// `o`, `lse` from `q, k, v`; grid over query tiles.
    Forward,
    /// `gk`, `gv`; grid over key tiles of each kv head.
    BackwardKv,
    /// `gq`; grid over query tiles.
    BackwardQ,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Forward => "fwd",
            Pass::BackwardKv => "bwd_kv",
            Pass::BackwardQ => "bwd_q",
        }
    }
}

/// The bucket of head size `d` (`None` past [`MAX_HEAD_SIZE`]).
pub fn bucket(d: usize) -> Option<usize> {
    BUCKETS.iter().copied().find(|&b| d <= b)
}

/// Rows of T each block owns and threads per block, for a pass, the storage
/// dtype and a bucket. Mirrors the tile sizes in `attention.cu` (`SMALL_NT`,
/// `SKV_KB`, `Cfg<..>::{fwd, bq, bkv}`); a kernel launched with another
/// geometry traps.
pub fn geometry(pass: Pass, dtype: DType, bucket: usize) -> (usize, u32) {
    let f64 = dtype == DType::F64;
    if bucket <= SMALL_MAX {
        return match pass {
            Pass::Forward | Pass::BackwardQ => (128, 128),
            Pass::BackwardKv => (32, 256),
        };
    }
    let rows = match pass {
        Pass::Forward | Pass::BackwardQ => {
            if f64 {
                32
            } else {
                64
            }
        }
        Pass::BackwardKv => match (f64, bucket <= 64, bucket <= 128) {
            (false, true, _) => 64,
            (false, false, _) => 32,
            (true, _, true) => 32,
            (true, _, false) => 16,
        },
    };
    (rows, TILED_THREADS)
}

/// The kernel's name: `attention_<pass>_d<bucket>_<dtype>`.
pub fn kernel_name(pass: Pass, dtype: DType, bucket: usize) -> String {
    format!("attention_{}_d{bucket}_{}", pass.name(), dtype_suffix(dtype).unwrap_or("?"))
}

fn dtype_suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        DType::F64 => Some("f64"),
        _ => None,
    }
}

/// Sizes of one attention problem, checked against what the kernels take.
#[derive(Copy, Clone, Debug)]
struct Dims {
    dtype: DType,
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    bucket: usize,
    /// `Some(padded head size)` when the tensor-core kernels run it.
    mma: Option<usize>,
    /// The passes run the warpgroup-MMA kernels ([`wgmma_attention`]).
    wg: bool,
}

impl Dims {
    fn of(op: &str, q: &TensorType, k: &TensorType, target: Target) -> Result<Dims> {
        let fail = |why: String| CudaError::lower(op, why);
        if q.rank() != 4 || k.rank() != 4 {
            return Err(fail(format!("q {q} and k {k} must be [B, T, heads, D]")));
        }
        dtype_suffix(q.dtype)
            .ok_or_else(|| CudaError::unsupported(op, format!("no attention kernel for {}", q.dtype)))?;
        let (b, t, hq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
        let hkv = k.shape[2];
        if hkv == 0 || hq % hkv != 0 {
            return Err(fail(format!("query heads {hq} must be a positive multiple of kv heads {hkv}")));
        }
        let bucket = bucket(d).ok_or_else(|| fail(format!("head size {d} is above the kernels' {MAX_HEAD_SIZE}")))?;
        // Grid y and z are heads and batch; T, heads and D are passed as int.
        if hq > 65535 || hkv * MMA_WIDE_KV_SPLIT > 65535 || b > 65535 {
            return Err(fail(format!("{hq} query heads or batch {b} exceed the grid limit 65535")));
        }
        if t > i32::MAX as usize || hq * d > i32::MAX as usize {
            return Err(fail(format!("sequence length {t} or row size {hq}×{d} does not fit the kernels' int")));
        }
        let mma = mma_width(&target.switches, q.dtype, d);
        let wg = mma.is_some_and(|dp| wgmma_attention(target, q.dtype, dp));
        Ok(Dims { dtype: q.dtype, b, t, hq, hkv, d, bucket, mma, wg })
    }

    /// No work: every output is empty (or, for D = 0, only lse is not).
    fn empty(&self) -> bool {
        self.b == 0 || self.t == 0 || self.hq == 0
    }

    /// The launch of `pass`: `args`, then the sizes, scale and keys every pass
    /// takes, then `tail` (the warpgroup forward's tensor maps).
    fn launch(&self, pass: Pass, mut args: Vec<Arg>, scale: f64, keys: &Keys, tail: Vec<Arg>) -> Launch {
        let (module, function, rows, threads, shared_bytes) = match self.mma {
            Some(dp) if self.wg => (
                mma_module(self.dtype, dp, true),
                format!("attention_mma_{}_d{dp}_{}", pass.name(), dtype_suffix(self.dtype).unwrap_or("?")),
                WG_ROWS,
                if pass == Pass::Forward { WG_FWD_THREADS } else { WG_THREADS },
                wgmma_shared_bytes(pass, dp) as u32,
            ),
            Some(dp) => (
                mma_module(self.dtype, dp, false),
                format!("attention_mma_{}_d{dp}_{}", pass.name(), dtype_suffix(self.dtype).unwrap_or("?")),
                mma_rows(pass, self.dtype, dp),
                MMA_THREADS,
                mma_shared_bytes(pass, self.dtype, dp) as u32,
            ),
            None => {
                let (rows, threads) = geometry(pass, self.dtype, self.bucket);
                (MODULE, kernel_name(pass, self.dtype, self.bucket), rows, threads, 0)
            }
        };
        let heads = match (pass, self.mma) {
            (Pass::BackwardKv, Some(dp)) if !self.wg => self.hkv * mma_kv_split(dp),
            (Pass::BackwardKv, _) => self.hkv,
            _ => self.hq,
        };
        args.extend([
            Arg::I32(self.t as i32),
            Arg::I32(self.hq as i32),
            Arg::I32(self.hkv as i32),
            Arg::I32(self.d as i32),
            Arg::F64(scale),
            Arg::Ptr(keys.positions),
            Arg::I32(keys.scores.window.min(i32::MAX as usize) as i32),
            Arg::F64(keys.scores.softcap),
        ]);
        args.extend(tail);
        Launch::Kernel(KernelLaunch {
            module,
            function,
            grid: (self.t.div_ceil(rows) as u32, heads as u32, self.b as u32),
            block: (threads, 1, 1),
            shared_bytes,
            args,
        })
    }
}

/// What every pass of the op takes after the scale: which keys each query
/// sees and the soft-cap (`SgKeys` in `kernels/common.cuh`).
struct Keys {
    /// The `positions` input (`i32[B, T]`), or 0 for none.
    positions: u64,
    scores: Scores,
}

impl Lower for Attention {
    const KERNELS: &'static [KernelModule] = KERNELS;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let positions = cx.inputs.get(3).map_or(0, |p| p.ptr);
        forward(self.scale, &Keys { positions, scores: self.scores }, cx)
    }
}

impl Lower for AttentionBackward {
    const KERNELS: &'static [KernelModule] = KERNELS;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let positions = if self.documents { cx.inputs[3].ptr } else { 0 };
        backward(self.scale, &Keys { positions, scores: self.scores }, self.saved(), cx)
    }
}

/// `attention_fwd(q, k, v, o, lse, T, Hq, Hkv, D, scale, pos, window, softcap)`.
fn forward(scale: f64, keys: &Keys, cx: &LowerCx) -> Result<Vec<Launch>> {
    let (inputs, outputs) = (cx.inputs, cx.outputs);
    let mut n = Dims::of("attention", &inputs[0].ty, &inputs[1].ty, cx.target)?;
    if n.empty() {
        return Ok(vec![]);
    }
    let ptrs = [&inputs[0], &inputs[1], &inputs[2], &outputs[0], &outputs[1]];
    n.wg &= wgmma_fits(n.d, &[ptrs[0].ptr, ptrs[3].ptr]) && n.mma.is_some_and(|dp| wg_shifts_fit(&n, dp));
    // k in 128-byte-swizzled boxes of 64 columns, v in plain ones of 8.
    let maps =
        n.wg.then(|| wg_tensor_maps(&n, n.hkv, WG_FWD_KEYS, &[(ptrs[1].ptr, 64, true), (ptrs[2].ptr, 8, false)]));
    let tail = maps.flatten().unwrap_or_default();
    n.wg &= !tail.is_empty();
    Ok(vec![n.launch(Pass::Forward, ptrs.iter().map(|t| Arg::Ptr(t.ptr)).collect(), scale, keys, tail)])
}

/// `attention_bwd_q(q, k, v, o, lse, go, glse, gq, delta, T, Hq, Hkv, D, scale, pos, window, softcap)`,
/// then `attention_bwd_kv(q, k, v, o, lse, go, glse, [delta,] gk, gv, T, Hq,
/// Hkv, D, scale, pos, window, softcap)` (the tensor-core key side reads the
/// query side's `delta`; the CUDA-core one recomputes the row terms); `glse`
/// is a null pointer when the node has no lse cotangent. `saved` is the
/// index of `o` among the inputs (after the positions, when given).
fn backward(scale: f64, keys: &Keys, saved: usize, cx: &LowerCx) -> Result<Vec<Launch>> {
    let (inputs, outputs) = (cx.inputs, cx.outputs);
    let mut n = Dims::of("attention_backward", &inputs[0].ty, &inputs[1].ty, cx.target)?;
    if n.empty() {
        return Ok(vec![]);
    }
    let (o, go) = (&inputs[saved], &inputs[saved + 2]);
    // q, k, v, o, go (tiles of q, k, v and go are copied; o is read for
    // D_i); the key side's block shifts its k and v by one shift for all
    // the query heads of its group, so they must share it.
    n.wg &= wgmma_fits(n.d, &[inputs[0].ptr, inputs[1].ptr, inputs[2].ptr, o.ptr, go.ptr])
        && n.mma.is_some_and(|dp| wg_shifts_fit(&n, dp))
        && (n.hq == n.hkv || n.d.is_multiple_of(8));
    // Both sides stream tiles in plain boxes of 8 columns.
    let plain = |a: &DevTensor, b: &DevTensor| [(a.ptr, 8, false), (b.ptr, 8, false)];
    let maps = n.wg.then(|| {
        let q_side = wg_tensor_maps(&n, n.hkv, WG_BWD_TILE, &plain(&inputs[1], &inputs[2]))?;
        let kv_side = wg_tensor_maps(&n, n.hq, WG_BWD_TILE, &plain(&inputs[0], go))?;
        Some((q_side, kv_side))
    });
    let (q_maps, kv_maps) = maps.flatten().unwrap_or_default();
    n.wg &= !q_maps.is_empty();
    let mut common: Vec<Arg> = inputs[..3].iter().chain(&inputs[saved..saved + 3]).map(|t| Arg::Ptr(t.ptr)).collect();
    common.push(Arg::Ptr(inputs.get(saved + 3).map_or(0, |t| t.ptr)));
    let (gq, gk, gv, delta) = (&outputs[0], &outputs[1], &outputs[2], &outputs[3]);
    let mut q = common.clone();
    q.extend([Arg::Ptr(gq.ptr), Arg::Ptr(delta.ptr)]);
    if n.d == 0 {
        // Only the row terms (−glse) to write: the gradients are empty.
        return Ok(vec![n.launch(Pass::BackwardQ, q, scale, keys, q_maps)]);
    }
    let mut kv = common;
    if n.mma.is_some() {
        kv.push(Arg::Ptr(delta.ptr));
    }
    kv.extend([Arg::Ptr(gk.ptr), Arg::Ptr(gv.ptr)]);
    Ok(vec![n.launch(Pass::BackwardQ, q, scale, keys, q_maps), n.launch(Pass::BackwardKv, kv, scale, keys, kv_maps)])
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ops::Op;

    use super::*;

    /// Lowers outside any group (attention needs none).
    fn lower(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<Vec<Launch>> {
        crate::ops::lower(op, inputs, outputs, None)
    }

    /// The fake address of operand `i`: 256-byte aligned, as the plan's.
    fn at(i: u64) -> u64 {
        i << 8
    }

    fn dev(dtype: DType, shape: &[usize], ptr: u64) -> DevTensor {
        DevTensor { ty: TensorType::new(dtype, shape), ptr }
    }

    fn stat(dtype: DType) -> DType {
        if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    fn kernel(l: &Launch) -> &KernelLaunch {
        match l {
            Launch::Kernel(k) => k,
            other => panic!("expected a kernel launch, got {other:?}"),
        }
    }

    #[test]
    fn buckets_cover_every_head_size() {
        assert_eq!(bucket(0), Some(1));
        assert_eq!(bucket(1), Some(1));
        assert_eq!(bucket(3), Some(4));
        assert_eq!(bucket(16), Some(16));
        assert_eq!(bucket(17), Some(32));
        assert_eq!(bucket(100), Some(128));
        assert_eq!(bucket(256), Some(256));
        assert_eq!(bucket(257), None);
        for d in 1..=MAX_HEAD_SIZE {
            let b = bucket(d).unwrap();
            assert!(d <= b && (b == 1 || d > BUCKETS[BUCKETS.iter().position(|&x| x == b).unwrap() - 1]));
        }
    }

    #[test]
    fn forward_lowers_to_one_launch() {
        // B=1, T=2048, 32 heads of 256, f32 (above the tensor-core kernels' 128).
        let q = dev(DType::F32, &[1, 2048, 32, 256], 0x1000);
        let k = dev(DType::F32, &[1, 2048, 32, 256], 0x2000);
        let v = dev(DType::F32, &[1, 2048, 32, 256], 0x3000);
        let o = dev(DType::F32, &[1, 2048, 32, 256], 0x4000);
        let lse = dev(DType::F32, &[1, 32, 2048], 0x5000);
        let op = Op::from(Attention::causal(0.1));
        let l = lower(&op, &[q, k, v], &[o, lse]).unwrap();
        assert_eq!(l.len(), 1);
        let k = kernel(&l[0]);
        assert_eq!(k.module, "attention");
        assert_eq!(k.function, "attention_fwd_d256_f32");
        assert_eq!(k.grid, (32, 32, 1));
        assert_eq!(k.block, (256, 1, 1));
        assert_eq!(k.shared_bytes, 0);
        assert_eq!(
            k.args,
            vec![
                Arg::Ptr(0x1000),
                Arg::Ptr(0x2000),
                Arg::Ptr(0x3000),
                Arg::Ptr(0x4000),
                Arg::Ptr(0x5000),
                Arg::I32(2048),
                Arg::I32(32),
                Arg::I32(32),
                Arg::I32(256),
                Arg::F64(0.1),
                // No positions, window or soft-cap.
                Arg::Ptr(0),
                Arg::I32(0),
                Arg::F64(0.0),
            ]
        );
    }

    fn backward_launches(dtype: DType, b: usize, t: usize, hq: usize, hkv: usize, d: usize, glse: bool) -> Vec<Launch> {
        let mut ins = vec![
            dev(dtype, &[b, t, hq, d], at(1)),
            dev(dtype, &[b, t, hkv, d], at(2)),
            dev(dtype, &[b, t, hkv, d], at(3)),
            dev(dtype, &[b, t, hq, d], at(4)),
            dev(stat(dtype), &[b, hq, t], at(5)),
            dev(dtype, &[b, t, hq, d], at(6)),
        ];
        if glse {
            ins.push(dev(stat(dtype), &[b, hq, t], at(7)));
        }
        let outs = [
            dev(dtype, &[b, t, hq, d], at(8)),
            dev(dtype, &[b, t, hkv, d], at(9)),
            dev(dtype, &[b, t, hkv, d], at(10)),
            dev(stat(dtype), &[b, hq, t], at(11)),
        ];
        lower(&Op::from(AttentionBackward { scale: 1.0, scores: Scores::default(), documents: false }), &ins, &outs)
            .unwrap()
    }

    #[test]
    fn backward_lowers_to_query_then_key_side() {
        // W2: T=4096, 28 query heads on 4 kv heads of size 1.
        let l = backward_launches(DType::BF16, 2, 4096, 28, 4, 1, false);
        assert_eq!(l.len(), 2);
        let (q, kv) = (kernel(&l[0]), kernel(&l[1]));
        assert_eq!(kv.function, "attention_bwd_kv_d1_bf16");
        assert_eq!(kv.grid, (128, 4, 2));
        assert_eq!(kv.block, (256, 1, 1));
        assert_eq!(q.function, "attention_bwd_q_d1_bf16");
        assert_eq!(q.grid, (32, 28, 2));
        assert_eq!(q.block, (128, 1, 1));
        let ptrs = |k: &KernelLaunch| -> Vec<u64> {
            k.args.iter().filter_map(|a| if let Arg::Ptr(p) = a { Some(*p >> 8) } else { None }).collect()
        };
        // The CUDA-core key side recomputes the row terms: no delta for it.
        // The last pointer is the (absent) positions.
        assert_eq!(ptrs(kv), vec![1, 2, 3, 4, 5, 6, 0, 9, 10, 0]);
        assert_eq!(ptrs(q), vec![1, 2, 3, 4, 5, 6, 0, 8, 11, 0]);
        assert_eq!(kv.args.len(), 17);
        assert_eq!(q.args.len(), 17);
        assert_eq!(
            kv.args[9..],
            [
                Arg::I32(4096),
                Arg::I32(28),
                Arg::I32(4),
                Arg::I32(1),
                Arg::F64(1.0),
                Arg::Ptr(0),
                Arg::I32(0),
                Arg::F64(0.0)
            ]
        );

        let l = backward_launches(DType::F64, 1, 257, 8, 1, 256, true);
        let (q, kv) = (kernel(&l[0]), kernel(&l[1]));
        assert_eq!(kv.function, "attention_bwd_kv_d256_f64");
        assert_eq!(kv.grid, (17, 1, 1));
        assert_eq!(q.function, "attention_bwd_q_d256_f64");
        assert_eq!(q.grid, (9, 8, 1));
        assert_eq!(ptrs(kv), vec![1, 2, 3, 4, 5, 6, 7, 9, 10, 0]);
        assert_eq!(ptrs(q), vec![1, 2, 3, 4, 5, 6, 7, 8, 11, 0]);
    }

    #[test]
    fn positions_window_and_soft_cap_are_the_last_three_arguments() {
        let scores = Scores { window: 17, softcap: 30.0 };
        let (b, t, h) = (2, 200, 4);
        for (dtype, d, function) in
            [(DType::F64, 8, "attention_fwd_d16_f64"), (DType::BF16, 64, "attention_mma_fwd_d64_bf16")]
        {
            let x = |p| dev(dtype, &[b, t, h, d], at(p));
            let (pos, lse) = (dev(DType::I32, &[b, t], at(4)), dev(stat(dtype), &[b, h, t], at(6)));
            // The forward: q, k, v, o, lse, sizes, scale, then positions, window, soft-cap.
            let fwd = Op::from(Attention { scale: 0.25, scores });
            let l = lower(&fwd, &[x(1), x(2), x(3), pos.clone()], &[x(5), lse.clone()]).unwrap();
            let k = kernel(&l[0]);
            assert_eq!(k.function, function);
            assert_eq!(k.args.len(), 13);
            assert_eq!(k.args[..5], [1, 2, 3, 5, 6].map(|p| Arg::Ptr(at(p))));
            assert_eq!(k.args[9..], [Arg::F64(0.25), Arg::Ptr(at(4)), Arg::I32(17), Arg::F64(30.0)]);
            // Without positions the window and soft-cap still come, after a null pointer.
            let l = lower(&fwd, &[x(1), x(2), x(3)], &[x(5), lse.clone()]).unwrap();
            assert_eq!(kernel(&l[0]).args[10..], [Arg::Ptr(0), Arg::I32(17), Arg::F64(30.0)]);
            // The backward reads o, lse and go after the positions and passes them last on both sides.
            let bwd = Op::from(AttentionBackward { scale: 0.25, scores, documents: true });
            let ins = [x(1), x(2), x(3), pos.clone(), x(5), lse.clone(), x(7)];
            let outs = [x(8), x(9), x(10), dev(stat(dtype), &[b, h, t], at(11))];
            let l = lower(&bwd, &ins, &outs).unwrap();
            assert_eq!(l.len(), 2);
            for k in l.iter().map(kernel) {
                let n = k.args.len();
                assert_eq!(k.args[..6], [1, 2, 3, 5, 6, 7].map(|p| Arg::Ptr(at(p))), "{}", k.function);
                assert_eq!(k.args[n - 4..], [Arg::F64(0.25), Arg::Ptr(at(4)), Arg::I32(17), Arg::F64(30.0)]);
            }
        }
    }

    #[test]
    fn heads_of_17_to_256_run_on_tensor_cores() {
        // W1-bf16: 32 heads of 100 → the d112 variant, 128 rows per forward block.
        let t = |dtype, shape: &[usize], p| dev(dtype, shape, p);
        let q = t(DType::BF16, &[1, 2048, 32, 100], at(1));
        let lse = t(DType::F32, &[1, 32, 2048], at(5));
        let l = lower(&Op::from(Attention::causal(0.1)), &[q.clone(), q.clone(), q.clone()], &[q, lse]).unwrap();
        let k = kernel(&l[0]);
        assert_eq!((k.module, k.function.as_str()), ("attention_mma_d112_bf16", "attention_mma_fwd_d112_bf16"));
        assert_eq!((k.grid, k.block), ((16, 32, 1), (128, 1, 1)));
        assert_eq!(k.shared_bytes as usize, (128 + 4 * 32) * 120 * 2);
        assert!(k.shared_bytes <= 227 * 1024);
        // Its backward: 128 query rows per bwd_q block (d112), 64 key rows per bwd_kv block.
        let l = backward_launches(DType::BF16, 1, 2048, 32, 32, 100, false);
        let (q, kv) = (kernel(&l[0]), kernel(&l[1]));
        assert_eq!((q.function.as_str(), q.grid), ("attention_mma_bwd_q_d112_bf16", (16, 32, 1)));
        assert_eq!(q.shared_bytes as usize, (2 * 128 + 4 * 32) * 120 * 2 + 2 * 128 * 4);
        assert_eq!((kv.function.as_str(), kv.grid), ("attention_mma_bwd_kv_d112_bf16", (32, 32, 1)));
        assert_eq!(kv.shared_bytes as usize, (2 * 64 + 4 * 32) * 120 * 2 + 2 * 32 * 4);

        let l = backward_launches(DType::F16, 2, 100, 8, 2, 64, true);
        let (q, kv) = (kernel(&l[0]), kernel(&l[1]));
        assert_eq!((kv.module, kv.function.as_str()), ("attention_mma_d64_f16", "attention_mma_bwd_kv_d64_f16"));
        assert_eq!((kv.grid, kv.block), ((2, 2, 2), (128, 1, 1)));
        assert_eq!(q.function, "attention_mma_bwd_q_d64_f16");
        assert_eq!(q.grid, (2, 8, 2));
        // The tensor-core key side reads the query side's delta.
        let ptrs = |k: &KernelLaunch| -> Vec<u64> {
            k.args.iter().filter_map(|a| if let Arg::Ptr(p) = a { Some(*p >> 8) } else { None }).collect()
        };
        assert_eq!(ptrs(q), vec![1, 2, 3, 4, 5, 6, 7, 8, 11, 0]);
        assert_eq!(ptrs(kv), vec![1, 2, 3, 4, 5, 6, 7, 11, 9, 10, 0]);
        assert_eq!(kv.args.len(), 18);

        // Outside 17..=128 (17..=256 for 16-bit storage), and for f64, the CUDA-core kernels.
        for (dtype, d) in [(DType::BF16, 16), (DType::F32, 129), (DType::F32, 1), (DType::F64, 100)] {
            assert_eq!(mma_width(&Switches::default(), dtype, d), None);
        }
        for dtype in [DType::BF16, DType::F16] {
            for d in 129..=256 {
                assert_eq!(mma_width(&Switches::default(), dtype, d), Some(256));
            }
            assert_eq!(mma_width(&Switches::default(), dtype, 257), None);
            for pass in [Pass::Forward, Pass::BackwardKv, Pass::BackwardQ] {
                assert_eq!(mma_rows(pass, dtype, 256), 64);
                // One block of four warps per SM in the backward, two in the forward.
                let limit = if pass == Pass::Forward { 113 } else { 227 };
                assert!(mma_shared_bytes(pass, dtype, 256) <= limit * 1024, "{dtype} {pass:?}");
            }
            assert!(mma_module(dtype, 256, false).ends_with(dtype_suffix(dtype).unwrap()));
            assert!(!wgmma_attention(Target { sm90a: true, ..Target::default() }, dtype, 256));
        }
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for d in 17..=128 {
                let dp = mma_width(&Switches::default(), dtype, d).unwrap();
                assert!(dp >= d && dp.is_multiple_of(16) && dp - d < 16);
                for pass in [Pass::Forward, Pass::BackwardKv, Pass::BackwardQ] {
                    // Two blocks of four warps fit an SM (228 KB), but for f32 at 128.
                    let limit = if dtype == DType::F32 && dp == 128 { 227 } else { 113 };
                    assert!(mma_shared_bytes(pass, dtype, dp) <= limit * 1024, "{dtype} {dp} {pass:?}");
                }
                assert!(mma_module(dtype, dp, false).ends_with(dtype_suffix(dtype).unwrap()));
                if wgmma_attention(Target { sm90a: true, ..Target::default() }, dtype, dp) {
                    assert!(mma_module(dtype, dp, true).ends_with("_wg"));
                    for pass in [Pass::Forward, Pass::BackwardKv, Pass::BackwardQ] {
                        // One block per SM (its registers allow no more), within the 227 KB.
                        assert!(wgmma_shared_bytes(pass, dp) <= 227 * 1024, "{dtype} {dp} {pass:?}");
                    }
                }
            }
        }
        // W1 (f32, 100 → 112): 3xTF32 kernels, single-buffered 32-key tiles.
        let q = t(DType::F32, &[1, 2048, 32, 100], at(1));
        let lse = t(DType::F32, &[1, 32, 2048], at(5));
        let l = lower(&Op::from(Attention::causal(0.1)), &[q.clone(), q.clone(), q.clone()], &[q, lse]).unwrap();
        let k = kernel(&l[0]);
        assert_eq!((k.module, k.function.as_str()), ("attention_mma_d112_f32", "attention_mma_fwd_d112_f32"));
        assert_eq!(k.shared_bytes as usize, (64 + 2 * 32) * 116 * 4);
    }

    #[test]
    fn gemma_heads_of_256_run_on_tensor_cores_with_the_key_side_split() {
        // Gemma-3-1B: 4 query heads on one kv head of 256, 1 × 8192, bf16,
        // on an sm_90 device (no warpgroup kernel at 256: mma.sync).
        let hopper = Target { sm90a: true, ..Target::default() };
        let x = |h: usize, p| dev(DType::BF16, &[1, 8192, h, 256], at(p));
        let lse = dev(DType::F32, &[1, 4, 8192], at(5));
        let fwd = crate::ops::lower_for(
            &Op::from(Attention::causal(0.0625)),
            &[x(4, 1), x(1, 2), x(1, 3)],
            &[x(4, 4), lse.clone()],
            None,
            hopper,
        )
        .unwrap();
        let f = kernel(&fwd[0]);
        assert_eq!((f.module, f.function.as_str()), ("attention_mma_d256_bf16", "attention_mma_fwd_d256_bf16"));
        assert_eq!((f.grid, f.block), ((128, 4, 1), (128, 1, 1)));
        assert_eq!(f.shared_bytes as usize, (64 + 2 * 2 * 32) * 264 * 2);
        let bwd = AttentionBackward { scale: 0.0625, scores: Scores::default(), documents: false };
        let ins = [x(4, 1), x(1, 2), x(1, 3), x(4, 4), lse.clone(), x(4, 6)];
        let outs = [x(4, 8), x(1, 9), x(1, 10), dev(DType::F32, &[1, 4, 8192], at(11))];
        let l = crate::ops::lower_for(&Op::from(bwd), &ins, &outs, None, hopper).unwrap();
        let (q, kv) = (kernel(&l[0]), kernel(&l[1]));
        assert_eq!((q.function.as_str(), q.grid), ("attention_mma_bwd_q_d256_bf16", (128, 4, 1)));
        assert_eq!(q.shared_bytes as usize, (2 * 64 + 2 * 2 * 32) * 264 * 2 + 2 * 64 * 4);
        // Two blocks per key tile of the one kv head, each owning 128 columns of gk and gv.
        assert_eq!((kv.function.as_str(), kv.grid), ("attention_mma_bwd_kv_d256_bf16", (128, 2, 1)));
        assert_eq!(kv.shared_bytes as usize, (2 * 64 + 2 * 2 * 32) * 264 * 2 + 2 * 32 * 4);
        // f32 at 256 stays on the CUDA-core kernels.
        let y = |h: usize, p| dev(DType::F32, &[1, 64, h, 256], at(p));
        let small_lse = dev(DType::F32, &[1, 4, 64], at(5));
        let l =
            lower(&Op::from(Attention::causal(0.0625)), &[y(4, 1), y(1, 2), y(1, 3)], &[y(4, 4), small_lse]).unwrap();
        assert_eq!(kernel(&l[0]).function, "attention_fwd_d256_f32");
    }

    #[test]
    fn hopper_runs_sixteen_bit_attention_on_warpgroup_mma() {
        // W5's attention (4 × 2048, 32 heads of 100 → 112) on an sm_90 device.
        let hopper = Target { sm90a: true, ..Target::default() };
        let (b, t, h, d) = (4, 2048, 32, 100);
        let ins = [
            dev(DType::BF16, &[b, t, h, d], at(1)),
            dev(DType::BF16, &[b, t, h, d], at(2)),
            dev(DType::BF16, &[b, t, h, d], at(3)),
            dev(DType::BF16, &[b, t, h, d], at(4)),
            dev(DType::F32, &[b, h, t], at(5)),
            dev(DType::BF16, &[b, t, h, d], at(6)),
        ];
        let outs = [
            dev(DType::BF16, &[b, t, h, d], at(8)),
            dev(DType::BF16, &[b, t, h, d], at(9)),
            dev(DType::BF16, &[b, t, h, d], at(10)),
            dev(DType::F32, &[b, h, t], at(11)),
        ];
        let op = Op::from(AttentionBackward { scale: 0.1, scores: Scores::default(), documents: false });
        let l = crate::ops::lower_for(&op, &ins, &outs, None, hopper).unwrap();
        let (q, kv) = (kernel(&l[0]), kernel(&l[1]));
        assert_eq!((q.module, q.function.as_str()), ("attention_mma_d112_bf16_wg", "attention_mma_bwd_q_d112_bf16"));
        assert_eq!((kv.module, kv.function.as_str()), ("attention_mma_d112_bf16_wg", "attention_mma_bwd_kv_d112_bf16"));
        // Two warpgroups per 128 rows on both sides.
        assert_eq!((q.grid, q.block), ((16, 32, 4), (256, 1, 1)));
        assert_eq!((kv.grid, kv.block), ((16, 32, 4), (256, 1, 1)));
        // Alignment, q, go (128 rows) and three stages of 64-row k and v
        // tiles; row terms, mbarriers.
        assert_eq!(q.shared_bytes as usize, 128 + 2 * 128 * 224 + 6 * 64 * 224 + 1024 + 48);
        // Alignment, k, v (128 rows) and three stages of 64-row q and go
        // tiles with their lse and delta; mbarriers, the keys' document starts.
        assert_eq!(kv.shared_bytes as usize, 128 + 2 * 128 * 224 + 3 * (2 * 64 * 224 + 512) + 48 + 512);
        // The arguments of the mma.sync passes (the key side reads delta),
        // then the tensor maps of the tiles each side streams, in plain
        // boxes of 8 columns by 64 rows: k and v over [B][T][Hkv·D] on the
        // query side, q and go over [B][T][Hq·D] on the key side.
        let portable = lower(&op, &ins, &outs).unwrap();
        let plain = |ptr| {
            Arg::TensorMap(TensorMap {
                ptr,
                dims: vec![3200, 2048, 4],
                strides: vec![6400, 6400 * 2048],
                boxes: vec![8, 64, 1],
                swizzle_128: false,
                f16: false,
            })
        };
        for (wg, (mma, maps)) in
            l.iter().zip(portable.iter().zip([[plain(at(2)), plain(at(3))], [plain(at(1)), plain(at(6))]]))
        {
            let (wg, mma) = (kernel(wg), kernel(mma));
            assert_eq!(wg.args[..mma.args.len()], mma.args[..]);
            assert_eq!(wg.args[mma.args.len()..], maps);
            assert!(!mma.module.ends_with("_wg"));
        }
        // The forward: a producer warpgroup beside the two consumers; up to
        // 1024 bytes of alignment, three stages of a k tile (two 64-column
        // swizzled boxes of 128 rows) and a v tile, the q tile, 13 mbarriers.
        let fwd_op = Op::from(Attention::causal(0.1));
        let fwd_outs = [outs[0].clone(), outs[3].clone()];
        let fwd = crate::ops::lower_for(&fwd_op, &ins[..3], &fwd_outs, None, hopper).unwrap();
        let f = kernel(&fwd[0]);
        assert_eq!((f.module, f.function.as_str()), ("attention_mma_d112_bf16_wg", "attention_mma_fwd_d112_bf16"));
        assert_eq!((f.grid, f.block), ((16, 32, 4), (384, 1, 1)));
        assert_eq!(f.shared_bytes as usize, 1024 + 3 * (2 * 128 * 128 + 128 * 112 * 2) + 128 * 112 * 2 + 13 * 8);
        // The mma.sync forward's arguments, then the tensor maps of k and v
        // over [B][T][Hkv·D]: 64-column swizzled boxes and 8-column plain ones.
        let portable = kernel(&lower(&fwd_op, &ins[..3], &fwd_outs).unwrap()[0]).args.clone();
        assert_eq!(f.args[..portable.len()], portable[..]);
        let map = |ptr, cols, swizzle_128| TensorMap {
            ptr,
            dims: vec![3200, 2048, 4],
            strides: vec![6400, 6400 * 2048],
            boxes: vec![cols, 128, 1],
            swizzle_128,
            f16: false,
        };
        assert_eq!(
            f.args[portable.len()..],
            [Arg::TensorMap(map(at(2), 64, true)), Arg::TensorMap(map(at(3), 8, false))]
        );
        // The three launches fill their kernels' parameters (the maps as
        // 128-byte, 64-byte-aligned values) within their launch bounds.
        if crate::nvrtc::available() {
            let cubin = crate::kernels::compile(f.module, "sm_90").unwrap();
            for k in [f, q, kv] {
                crate::ops::sweep::check_signature("warpgroup attention", &cubin, k);
            }
        }
        // Rows of a byte count off 16 (one kv head of 100: 200 bytes) or k and
        // v bases off 16 bytes leave the passes on mma.sync (the driver
        // encodes no map of them).
        let kv1 = |p| dev(DType::BF16, &[b, t, 1, d], p);
        let l =
            crate::ops::lower_for(&fwd_op, &[ins[0].clone(), kv1(at(2)), kv1(at(3))], &fwd_outs, None, hopper).unwrap();
        assert_eq!(kernel(&l[0]).module, "attention_mma_d112_bf16");
        // A head size whose kv heads start up to 6 columns past a 16-byte
        // boundary (110: 0, 6, 4, 2) leaves no room for the shift within 112.
        let kv110 = |p| dev(DType::BF16, &[b, t, 4, 110], p);
        let (q110, o110) = (dev(DType::BF16, &[b, t, h, 110], at(1)), dev(DType::BF16, &[b, t, h, 110], at(8)));
        let l =
            crate::ops::lower_for(&fwd_op, &[q110, kv110(at(2)), kv110(at(3))], &[o110, outs[3].clone()], None, hopper)
                .unwrap();
        assert_eq!(kernel(&l[0]).module, "attention_mma_d112_bf16");
        let k8 = dev(DType::BF16, &[b, t, h, d], at(2) + 8);
        let l = crate::ops::lower_for(&fwd_op, &[ins[0].clone(), k8.clone(), ins[2].clone()], &fwd_outs, None, hopper)
            .unwrap();
        assert_eq!(kernel(&l[0]).module, "attention_mma_d112_bf16");
        let mut k8_bwd = ins.clone();
        k8_bwd[1] = k8;
        let l = crate::ops::lower_for(&op, &k8_bwd, &outs, None, hopper).unwrap();
        assert!(l.iter().all(|l| kernel(l).module == "attention_mma_d112_bf16"));
        // Grouped heads of 100 columns start 0 and 4 columns past a 16-byte
        // boundary within one group: the key side's block, shifting its k
        // and v once for the group, cannot, so the backward stays on
        // mma.sync (the forward shifts by kv head and takes them).
        let kv16 = |p| dev(DType::BF16, &[b, t, 16, d], p);
        let mut grouped = ins.clone();
        grouped[1] = kv16(at(2));
        grouped[2] = kv16(at(3));
        let mut grouped_outs = outs.clone();
        grouped_outs[1] = kv16(at(9));
        grouped_outs[2] = kv16(at(10));
        let l = crate::ops::lower_for(&op, &grouped, &grouped_outs, None, hopper).unwrap();
        assert!(l.iter().all(|l| kernel(l).module == "attention_mma_d112_bf16"));
        let l = crate::ops::lower_for(&fwd_op, &grouped[..3], &fwd_outs, None, hopper).unwrap();
        assert_eq!(kernel(&l[0]).module, "attention_mma_d112_bf16_wg");
        // An odd head size, or a base only 2-byte aligned, keeps the mma.sync
        // passes (their copies could not all be cp.async of 4 bytes or more).
        let odd = |shape: &[usize], p| dev(DType::BF16, shape, p);
        let (q99, lse) = (odd(&[b, t, h, 99], at(1)), dev(DType::F32, &[b, h, t], at(5)));
        let l =
            crate::ops::lower_for(&fwd_op, &[q99.clone(), q99.clone(), q99.clone()], &[q99, lse.clone()], None, hopper)
                .unwrap();
        assert_eq!(kernel(&l[0]).module, "attention_mma_d112_bf16");
        let shifted = odd(&[b, t, h, d], at(2) + 2);
        let l =
            crate::ops::lower_for(&fwd_op, &[ins[0].clone(), shifted.clone(), ins[2].clone()], &fwd_outs, None, hopper)
                .unwrap();
        assert_eq!(kernel(&l[0]).module, "attention_mma_d112_bf16");
        let mut go_shifted = ins.clone();
        go_shifted[5] = shifted;
        let l = crate::ops::lower_for(&op, &go_shifted, &outs, None, hopper).unwrap();
        assert!(l.iter().all(|l| kernel(l).module == "attention_mma_d112_bf16"));
        // f32, widths 64 and below, and other devices: no warpgroup kernels.
        assert!(!wgmma_attention(hopper, DType::F32, 112));
        assert!(!wgmma_attention(hopper, DType::BF16, 64));
        assert!(!wgmma_attention(Target::default(), DType::BF16, 112));
        assert!(!wgmma_attention(Target::of_arch("sm_80", Switches::default()), DType::BF16, 112));
        // Every warpgroup module is declared arch-specific (built for sm_90a).
        for m in KERNELS {
            assert_eq!(m.arch_specific, m.name.ends_with("_wg"), "{}", m.name);
            assert_eq!(m.arch_specific, m.defines.contains("SGM_WGMMA"), "{}", m.name);
        }
    }

    #[test]
    fn every_bucket_and_dtype_has_its_geometry() {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            for &bk in &BUCKETS {
                for pass in [Pass::Forward, Pass::BackwardKv, Pass::BackwardQ] {
                    let (rows, threads) = geometry(pass, dtype, bk);
                    assert!(rows > 0 && threads % 32 == 0 && threads <= 1024);
                    let name = kernel_name(pass, dtype, bk);
                    assert!(name.starts_with("attention_") && !name.contains('?'), "{name}");
                }
            }
        }
    }

    #[test]
    fn empty_problems_launch_nothing_and_bad_ones_fail() {
        assert!(backward_launches(DType::F32, 0, 5, 4, 2, 8, false).is_empty());
        assert!(backward_launches(DType::F32, 1, 0, 4, 2, 8, true).is_empty());
        // D = 0: the gradients are empty but the row terms (delta) are not.
        let l = backward_launches(DType::F32, 1, 5, 4, 2, 0, true);
        assert_eq!(l.len(), 1);
        assert_eq!(kernel(&l[0]).function, "attention_bwd_q_d1_f32");
        // D = 0 still has an lse to write.
        let t = |s: &[usize]| dev(DType::F32, s, at(1));
        let l = lower(
            &Op::from(Attention::causal(1.0)),
            &[t(&[1, 3, 2, 0]), t(&[1, 3, 1, 0]), t(&[1, 3, 1, 0])],
            &[t(&[1, 3, 2, 0]), t(&[1, 2, 3])],
        )
        .unwrap();
        assert_eq!(kernel(&l[0]).function, "attention_fwd_d1_f32");
        let big = lower(
            &Op::from(Attention::causal(1.0)),
            &[t(&[1, 3, 2, 257]), t(&[1, 3, 1, 257]), t(&[1, 3, 1, 257])],
            &[t(&[1, 3, 2, 257]), t(&[1, 2, 3])],
        );
        assert!(big.unwrap_err().to_string().contains("head size 257"));
        let ints = TensorType::new(DType::I32, [1, 3, 2, 4]);
        let i = DevTensor { ty: ints, ptr: at(1) };
        assert!(lower(&Op::from(Attention::causal(1.0)), &[i.clone(), i.clone(), i.clone()], &[i.clone(), i]).is_err());
    }

    /// The names the lowering asks for are the ones the source instantiates.
    #[test]
    fn source_instantiates_every_bucket() {
        let src = ATTENTION_SRC;
        for &bk in &BUCKETS {
            let inst =
                if bk <= SMALL_MAX { format!("SGA_SMALL(sfx, T, {bk})") } else { format!("SGA_TILED(sfx, T, {bk})") };
            assert!(src.contains(&inst), "attention.cu does not instantiate {inst}");
        }
        for pass in [Pass::Forward, Pass::BackwardKv, Pass::BackwardQ] {
            for macro_arg in ["DS", "DM"] {
                let pattern = format!("attention_{}_d##{macro_arg}##_##sfx(", pass.name());
                assert!(src.contains(&pattern), "attention.cu has no entry point {pattern}");
            }
        }
        assert!(src.contains("SG_FOR_EACH_FLOAT(SGA_ALL)"));
    }
}
