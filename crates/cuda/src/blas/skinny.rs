//! Our own products for decode shapes as tuning candidates: `kernels/skinny.cu`
//! multiplies a few rows (m ≤ [`MAX_ROWS`]) by a row-major weight matrix on
//! tensor cores, a block's warps splitting one 8-column tile's depth so
//! that many weight bytes are in flight (see the source's header for the
//! layout). This module owns which shapes it can run ([`eligible`]) and
//! the launch of a call ([`launch`], data only); `own` loads and runs them.
//!
//! Off unless [`SKINNY_ENV`]`=1`, until a GPU run has checked and timed it:
//! then tuning times [`VARIANTS`] next to cuBLASLt's algorithms, and the
//! fastest wins as usual. `STEPGRAPH_GEMM_SKINNY=only` makes the first
//! variant the only candidate of every eligible shape, untimed, so the GPU
//! tests compare exactly this path with the CPU.

use super::own::OwnLaunch;
use super::plan::{Alignment, PlanKey};
use crate::kernel_module::KernelModule;
use crate::launch::{GemmCall, GemmType};

/// The kernel module, compiled with every other (and for sm_90 in CI).
pub const MODULE: KernelModule = KernelModule::plain("skinny", include_str!("../../kernels/skinny.cu"));

/// [`AlgoConfig::id`](super::AlgoConfig::id) of these kernels in tuning
/// reports (the tile field holds the warps per block, split-k the chunks
/// per group, stages 1 for the cp.async rings).
pub const SKINNY_ALGO_ID: i32 = -2;

/// Most rows of x: one m16n8k16 tile's rows.
pub const MAX_ROWS: usize = 16;

/// The compiled variants, `(warps per block, chunks per group, async)`:
/// `skinny_w{warps}_u{unroll}[_a]_r{8|16}_{dtype}` in `skinny.cu`. The
/// register pipeline keeps one group of weight packs in flight per lane
/// (ptxas gives `(8, 4)` 96 registers at up to 8 rows, two blocks per SM;
/// 128 at 16); the asynchronous ones (`_a`) keep up to 7 groups in flight
/// in shared-memory rings instead (up to 46 KiB per block).
pub const VARIANTS: [(u32, u32, bool); 6] =
    [(8, 4, false), (16, 4, false), (4, 4, false), (16, 2, false), (4, 2, true), (2, 4, true)];

/// Columns of one block's tile.
const TILE_COLS: usize = 8;
/// Depth elements of one 16-byte pack of a 16-bit type.
const PACK: usize = 8;

/// Can the kernels run every call of `key` whose operands are aligned as
/// `align`: a 16-bit type, x untransposed with at most [`MAX_ROWS`] rows, w
/// stored `[n, k]` (`trans_b`), a depth of whole 16-byte packs, x and w
/// 16-byte aligned in every batch entry, and sizes within the kernel's
/// `int`s and the grid's limits?
pub(super) fn eligible(key: &PlanKey, align: Alignment) -> bool {
    let int = |x: usize| x <= i32::MAX as usize;
    matches!(key.ty, GemmType::BF16 | GemmType::F16)
        && !key.trans_a
        && key.trans_b
        && (1..=MAX_ROWS).contains(&key.m)
        && key.n > 0
        && key.k > 0
        && key.k.is_multiple_of(PACK)
        && align.first >= 16
        && align.second >= 16
        && int(key.n)
        && int(key.k)
        && int(key.m * key.n)
        && key.batch.max(1) <= 65_535
        && key.stride_a >= 0
        && key.stride_b >= 0
        && key.stride_c >= 0
}

/// The 16-bit types the kernels are built for, in [`kernel_names`]'s order.
const TYPES: [GemmType; 2] = [GemmType::BF16, GemmType::F16];

/// The kernel name of variant `variant` for `ty` and `m` rows: the
/// 8-row build up to 8 rows (it never loads rows 8–15), else the 16-row one.
pub fn kernel_name(ty: GemmType, variant: usize, m: usize) -> String {
    let (warps, unroll, ring) = VARIANTS[variant];
    let rows = if m <= 8 { 8 } else { 16 };
    let ring = if ring { "_a" } else { "" };
    let dt = match ty {
        GemmType::BF16 => "bf16",
        GemmType::F16 => "f16",
        GemmType::F32 | GemmType::Tf32 | GemmType::Fp8(_) => {
            unreachable!("the few-row kernels take 16-bit operands only")
        }
    };
    format!("skinny_w{warps}_u{unroll}{ring}_r{rows}_{dt}")
}

/// Every kernel name, in the order [`kernel_index`] counts them.
pub(super) fn kernel_names() -> impl Iterator<Item = String> {
    TYPES.into_iter().flat_map(|ty| (0..VARIANTS.len()).flat_map(move |v| [1, MAX_ROWS].map(|m| kernel_name(ty, v, m))))
}

/// The position of [`kernel_name`]`(ty, variant, m)` in [`kernel_names`].
fn kernel_index(ty: GemmType, variant: usize, m: usize) -> usize {
    let t = TYPES.iter().position(|&x| x == ty).expect("an eligible shape has a 16-bit type");
    (t * VARIANTS.len() + variant) * 2 + usize::from(m > 8)
}

/// The launch running `call` (of an eligible shape) with variant `variant`.
pub(super) fn launch(call: &GemmCall, variant: usize) -> OwnLaunch {
    let (warps, _, _) = VARIANTS[variant];
    let grid = (call.n.div_ceil(TILE_COLS) as u32, call.batch.max(1) as u32, 1);
    OwnLaunch::new(kernel_index(call.ty, variant, call.m), grid, (32 * warps, 1, 1), call, &[])
}

#[cfg(test)]
mod tests {
    use super::super::plan::Epilogue;
    use super::*;
    use crate::launch::{Arg, GemmAddend};

    fn key(m: usize, n: usize, k: usize) -> PlanKey {
        PlanKey {
            ty: GemmType::BF16,
            batch: 1,
            m,
            n,
            k,
            trans_a: false,
            trans_b: true,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            epilogue: Epilogue::None,
        }
    }

    const ALIGNED: Alignment = Alignment { first: 256, second: 256, out: 256, addend: 256 };

    #[test]
    fn decode_shapes_are_eligible_and_others_are_not() {
        for (m, n, k) in [(1, 3200, 3200), (16, 9600, 3200), (1, 32000, 3200), (7, 3200, 8640), (1, 1, 8)] {
            assert!(eligible(&key(m, n, k), ALIGNED), "{m}x{n}x{k}");
        }
        assert!(!eligible(&key(17, 3200, 3200), ALIGNED), "more rows than a tile");
        assert!(!eligible(&key(1, 3200, 3204), ALIGNED), "depth not whole packs");
        assert!(!eligible(&key(1, 3200, 3200), Alignment { first: 8, ..ALIGNED }), "w packs unaligned");
        assert!(!eligible(&key(1, 3200, 3200), Alignment { second: 8, ..ALIGNED }), "x packs unaligned");
        assert!(!eligible(&PlanKey { ty: GemmType::F32, ..key(1, 3200, 3200) }, ALIGNED), "f32 stays exact");
        assert!(!eligible(&PlanKey { trans_b: false, ..key(1, 3200, 3200) }, ALIGNED));
        assert!(!eligible(&PlanKey { trans_a: true, ..key(1, 3200, 3200) }, ALIGNED));
        assert_eq!(kernel_names().count(), 2 * VARIANTS.len() * 2);
    }

    /// A 16-bit value as the kernel's operands hold it: here f32 values
    /// that bf16 represents exactly, so products are exact too.
    fn val(seed: usize) -> f32 {
        ((seed * 7919 + 13) % 17) as f32 - 8.0
    }

    /// Replays `skinny.cu` for one call on the host, lane by lane: the
    /// chunk split among warps, each lane's 16-byte packs, and each
    /// m16n8k16 product through the fragment layouts PTX documents
    /// (A: a0–a7 at rows g, g+8 and columns 2t, 2t+1, 2t+8, 2t+9 in
    /// registers {a0,a1}, {a2,a3}, {a4,a5}, {a6,a7}; B: b0–b3 at rows 2t,
    /// 2t+1, 2t+8, 2t+9 of column g; C: c0–c3 at rows g, g+8 and columns
    /// 2t, 2t+1). Returns y [m, n].
    fn replay(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, warps: usize, unroll: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * n];
        let chunks = k.div_ceil(32);
        let per = chunks.div_ceil(warps);
        for n0 in (0..n).step_by(TILE_COLS) {
            // acc[warp][lane][i]
            let mut acc = vec![[[0f32; 4]; 32]; warps];
            for (warp, acc_w) in acc.iter_mut().enumerate() {
                let (c_begin, c_end) = (warp * per, chunks.min(warp * per + per));
                let mut c0 = c_begin;
                while c0 < c_end {
                    for u in 0..unroll {
                        // Each lane's packs: 8 elements as 4 words of 2.
                        let pack = |lane: usize, row_of: &dyn Fn(usize) -> Option<usize>, src: &[f32]| {
                            let (g, t) = (lane / 4, lane % 4);
                            let kk = (c0 + u) * 32 + 8 * t;
                            let mut p = [0f32; 8];
                            if c0 + u < c_end && kk < k {
                                if let Some(r) = row_of(g) {
                                    p.copy_from_slice(&src[r * k + kk..r * k + kk + 8]);
                                }
                            }
                            p
                        };
                        let wp: Vec<[f32; 8]> =
                            (0..32).map(|l| pack(l, &|g| (n0 + g < n).then_some(n0 + g), w)).collect();
                        let x0: Vec<[f32; 8]> = (0..32).map(|l| pack(l, &|g| (g < m).then_some(g), x)).collect();
                        let x1: Vec<[f32; 8]> =
                            (0..32).map(|l| pack(l, &|g| (g + 8 < m).then_some(g + 8), x)).collect();
                        // Two products: words 0–1 (elements 0–3), then words 2–3 (4–7).
                        for half in 0..2 {
                            let word = |p: &[f32; 8], j: usize| [p[4 * half + 2 * j], p[4 * half + 2 * j + 1]];
                            // Dense A [16][16] and B [16][8] from the fragments.
                            let mut a = [[0f32; 16]; 16];
                            let mut b = [[0f32; 8]; 16];
                            for lane in 0..32 {
                                let (g, t) = (lane / 4, lane % 4);
                                // Registers {a0,a1} {a2,a3} {a4,a5} {a6,a7} = X0 Y0 X1 Y1.
                                let regs =
                                    [word(&x0[lane], 0), word(&x1[lane], 0), word(&x0[lane], 1), word(&x1[lane], 1)];
                                for (ri, reg) in regs.iter().enumerate() {
                                    let row = g + if ri % 2 == 1 { 8 } else { 0 };
                                    let col = 2 * t + if ri >= 2 { 8 } else { 0 };
                                    a[row][col] = reg[0];
                                    a[row][col + 1] = reg[1];
                                }
                                for (ri, reg) in [word(&wp[lane], 0), word(&wp[lane], 1)].iter().enumerate() {
                                    let krow = 2 * t + if ri == 1 { 8 } else { 0 };
                                    b[krow][g] = reg[0];
                                    b[krow + 1][g] = reg[1];
                                }
                            }
                            for (lane, acc_l) in acc_w.iter_mut().enumerate() {
                                let (g, t) = (lane / 4, lane % 4);
                                for (i, c) in acc_l.iter_mut().enumerate() {
                                    let row = if i < 2 { g } else { g + 8 };
                                    let col = 2 * t + i % 2;
                                    *c += (0..16).map(|l| a[row][l] * b[l][col]).sum::<f32>();
                                }
                            }
                        }
                    }
                    c0 += unroll;
                }
            }
            // Warps summed in warp order, as the kernel's shared-memory pass.
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for i in 0..4 {
                    let s: f32 = acc.iter().map(|acc_w| acc_w[lane][i]).sum();
                    let (r, col) = (if i < 2 { g } else { g + 8 }, n0 + 2 * t + i % 2);
                    if r < m && col < n {
                        y[r * n + col] = s;
                    }
                }
            }
        }
        y
    }

    #[test]
    fn the_fragment_mapping_computes_the_product() {
        // Tails of every kind: columns not a multiple of 8, depths not a
        // multiple of 32, warps left without chunks, rows past 8.
        for &(m, n, k) in &[(1, 8, 32), (1, 13, 40), (3, 20, 96), (9, 16, 64), (16, 11, 200), (5, 3, 8)] {
            let x: Vec<f32> = (0..m * k).map(val).collect();
            let w: Vec<f32> = (0..n * k).map(|i| val(i + 1000)).collect();
            // The rings change when packs arrive, not which: one replay.
            for &(warps, unroll, _) in &VARIANTS {
                let y = replay(&x, &w, m, n, k, warps as usize, unroll as usize);
                for r in 0..m {
                    for c in 0..n {
                        let want: f32 = (0..k).map(|j| x[r * k + j] * w[c * k + j]).sum();
                        assert_eq!(y[r * n + c], want, "{m}x{n}x{k} w{warps} u{unroll}: y[{r}][{c}]");
                    }
                }
            }
        }
    }

    /// A decode-shaped call: `m` rows of x times a `[n, k]` weight.
    fn decode_call(ty: GemmType, m: usize, n: usize, k: usize) -> GemmCall {
        GemmCall { k, stride_b: 0, stride_c: 0, ..super::super::test_call(ty, 1, m, n, 0x3000) }
    }

    #[test]
    fn launches_cover_the_columns_and_the_batch() {
        let call = GemmCall {
            batch: 3,
            stride_b: 9601 * 3200,
            stride_c: 16 * 9601,
            addend: GemmAddend::Bias(0x4000),
            ..decode_call(GemmType::F16, 16, 9601, 3200)
        };
        let names: Vec<String> = kernel_names().collect();
        let named = |call: &GemmCall, v| launch(call, v).kernel_launch(&MODULE, &names);
        let l = named(&call, 1);
        assert_eq!((l.function.as_str(), l.grid, l.block), ("skinny_w16_u4_r16_f16", (1201, 3, 1), (512, 1, 1)));
        assert_eq!(named(&GemmCall { m: 8, ..call }, 2).function, "skinny_w4_u4_r8_f16");
        assert_eq!(named(&GemmCall { m: 1, ..call }, 5).function, "skinny_w2_u4_a_r8_f16");
        assert_eq!((&l.args[3], &l.args[4]), (&Arg::Ptr(0x4000), &Arg::I32(2)));
        // Every name is where its index says.
        for ty in TYPES {
            for v in 0..VARIANTS.len() {
                for m in [1, 8, 9, MAX_ROWS] {
                    assert_eq!(names[kernel_index(ty, v, m)], kernel_name(ty, v, m));
                }
            }
        }
    }

    /// Where NVRTC is installed (CI), every variant of both types is in the
    /// module's CUBIN with the parameters the launch fills.
    #[test]
    fn the_launches_fit_the_compiled_kernels() {
        let Some(cubin) = crate::nvrtc::test_cubin(&MODULE) else { return };
        let names: Vec<String> = kernel_names().collect();
        for ty in TYPES {
            for (v, m) in (0..VARIANTS.len()).flat_map(|v| [(v, 1), (v, 9)]) {
                let call = decode_call(ty, m, 3200, 3200);
                let l = launch(&call, v).kernel_launch(&MODULE, &names);
                crate::ops::sweep::check_signature(&format!("skinny {ty:?} {v}"), &cubin, &l);
            }
        }
    }
}
