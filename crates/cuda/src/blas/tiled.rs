//! Our own exact-f32 products of small matrices as tuning candidates:
//! `kernels/tiled.cu` computes `C = op(A)·op(B)` (+ addend) in tiles of
//! 32 × 32 to 64 × 64 on CUDA cores, every sum in increasing depth order
//! with fused multiply-adds (see the source's header). cuBLASLt's f32
//! kernels use large tiles, which leave W3's 256-wide products 4 tiles of
//! 132 SMs. This module owns which shapes the kernels run ([`eligible`])
//! and the launch of a call ([`launch`], data only); `own` loads and runs
//! them.
//!
//! Off unless [`TILED_ENV`]`=1`, until a GPU run has checked and timed it;
//! `only` makes the first variant the only candidate of every eligible
//! shape, untimed, for the GPU tests.

use super::own::OwnLaunch;
use super::plan::PlanKey;
use crate::kernel_module::KernelModule;
use crate::launch::{GemmCall, GemmType};

/// The kernel module, compiled with every other (and for sm_90 in CI).
pub const MODULE: KernelModule = KernelModule::plain("tiled", include_str!("../../kernels/tiled.cu"));

/// [`AlgoConfig::id`](super::AlgoConfig::id) of these kernels in tuning
/// reports (the tile field holds the tile's rows, stages its columns).
pub const TILED_ALGO_ID: i32 = -3;

/// The compiled tiles, `(rows, columns)`: `tiled_{rows}x{columns}_f32`.
pub const VARIANTS: [(u32, u32); 3] = [(32, 32), (64, 64), (32, 64)];

/// Threads per block (`TL_THREADS` in `tiled.cu`).
const THREADS: u32 = 256;

/// Can the kernels run the products of `key`: f32 computed in f32 (not
/// with TF32, whose rounding is another product), sizes within the
/// kernel's `int`s and the grid's limits, batch strides not negative?
pub(super) fn eligible(key: &PlanKey, tf32: bool) -> bool {
    let int = |x: usize| x <= i32::MAX as usize;
    key.ty == GemmType::F32
        && !tf32
        && key.m > 0
        && key.n > 0
        && key.k > 0
        && int(key.m)
        && int(key.n)
        && int(key.k)
        && key.m.div_ceil(32) <= 65_535
        && key.batch.max(1) <= 65_535
        && key.stride_a >= 0
        && key.stride_b >= 0
        && key.stride_c >= 0
}

/// The kernel name of variant `variant`.
pub fn kernel_name(variant: usize) -> String {
    let (rows, cols) = VARIANTS[variant];
    format!("tiled_{rows}x{cols}_f32")
}

/// Every kernel name, variant by variant (a launch's function index is its variant).
pub(super) fn kernel_names() -> impl Iterator<Item = String> {
    (0..VARIANTS.len()).map(kernel_name)
}

/// The launch running `call` (of an eligible shape) with variant `variant`.
pub(super) fn launch(call: &GemmCall, variant: usize) -> OwnLaunch {
    let (rows, cols) = VARIANTS[variant];
    let grid = (call.n.div_ceil(cols as usize) as u32, call.m.div_ceil(rows as usize) as u32, call.batch.max(1) as u32);
    OwnLaunch::new(variant, grid, (THREADS, 1, 1), call, &[call.trans_a as i32, call.trans_b as i32])
}

#[cfg(test)]
mod tests {
    use super::super::plan::Epilogue;
    use super::*;
    use crate::launch::{Arg, GemmAddend};

    fn key(ty: GemmType, m: usize, n: usize, k: usize) -> PlanKey {
        PlanKey {
            ty,
            batch: 1,
            m,
            n,
            k,
            trans_a: true,
            trans_b: false,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            epilogue: Epilogue::Accumulate,
        }
    }

    #[test]
    fn exact_f32_products_are_eligible_and_others_are_not() {
        assert!(eligible(&key(GemmType::F32, 256, 256, 256), false));
        assert!(eligible(&key(GemmType::F32, 1, 32000, 256), false));
        assert!(!eligible(&key(GemmType::F32, 256, 256, 256), true), "TF32 asked for: cuBLASLt's rounding");
        assert!(!eligible(&key(GemmType::BF16, 256, 256, 256), false));
        assert!(!eligible(&key(GemmType::F32, 256, 256, 0), false));
    }

    #[test]
    fn launches_cover_rows_columns_and_batch() {
        let call = GemmCall {
            k: 7,
            trans_a: true,
            trans_b: false,
            stride_a: 65 * 7,
            stride_b: 0,
            addend: GemmAddend::Full(0x3000),
            ..super::super::test_call(GemmType::F32, 2, 65, 33, 0x3000)
        };
        let names: Vec<String> = kernel_names().collect();
        let l = launch(&call, 0).kernel_launch(&MODULE, &names);
        assert_eq!((l.function.as_str(), l.grid, l.block), ("tiled_32x32_f32", (2, 3, 2), (256, 1, 1)));
        assert_eq!(launch(&call, 1).grid, (1, 2, 2));
        assert_eq!((&l.args[4], &l.args[8], &l.args[9]), (&Arg::I32(1), &Arg::I32(1), &Arg::I32(0)));
    }

    /// Replays `tiled.cu` for one batch entry on the host: each block's
    /// depth slices staged as `stage_slice` stages them (either stored
    /// layout), each thread's strided outputs. Returns C [m, n].
    fn replay(
        a: &[f32],
        b: &[f32],
        (m, n, k): (usize, usize, usize),
        (ta, tb): (bool, bool),
        tile: (usize, usize),
    ) -> Vec<f32> {
        const BK: usize = 16;
        let (bm, bn) = tile;
        // dst[kk][i] for outer index o0 + i and depth k0 + kk, as stage_slice.
        let stage = |src: &[f32], depth_inner: bool, outer: usize, w: usize, o0: usize, k0: usize| {
            let mut dst = vec![vec![0f32; w + 1]; BK];
            for e in 0..w * BK {
                let (i, kk) = if depth_inner { (e / BK, e % BK) } else { (e % w, e / w) };
                let (go, gk) = (o0 + i, k0 + kk);
                if go < outer && gk < k {
                    dst[kk][i] = if depth_inner { src[go * k + gk] } else { src[gk * outer + go] };
                }
            }
            dst
        };
        let mut c = vec![f32::NAN; m * n];
        for row0 in (0..m).step_by(bm) {
            for col0 in (0..n).step_by(bn) {
                let mut acc = vec![vec![0f32; bn]; bm];
                for k0 in (0..k).step_by(BK) {
                    let a_s = stage(a, !ta, m, bm, row0, k0);
                    let b_s = stage(b, tb, n, bn, col0, k0);
                    for kk in 0..BK {
                        for (r, acc_r) in acc.iter_mut().enumerate() {
                            for (cc, v) in acc_r.iter_mut().enumerate() {
                                *v = a_s[kk][r].mul_add(b_s[kk][cc], *v);
                            }
                        }
                    }
                }
                // Thread (tx, ty) owns rows ty + 16i and columns tx + 16j.
                for tid in 0..THREADS as usize {
                    let (tx, ty) = (tid % 16, tid / 16);
                    for i in 0..bm / 16 {
                        for j in 0..bn / 16 {
                            let (r, col) = (row0 + ty + 16 * i, col0 + tx + 16 * j);
                            if r < m && col < n {
                                c[r * n + col] = acc[ty + 16 * i][tx + 16 * j];
                            }
                        }
                    }
                }
            }
        }
        c
    }

    #[test]
    fn the_tiles_compute_the_product_in_every_layout() {
        let val = |i: usize| ((i * 7919 + 13) % 17) as f32 - 8.0;
        for &(m, n, k) in &[(5, 7, 3), (33, 65, 17), (64, 32, 40)] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                // Stored A: [m, k] or [k, m]; stored B: [k, n] or [n, k].
                let a: Vec<f32> = (0..m * k).map(val).collect();
                let b: Vec<f32> = (0..k * n).map(|i| val(i + 500)).collect();
                let at = |r: usize, j: usize| if ta { a[j * m + r] } else { a[r * k + j] };
                let bt = |j: usize, c: usize| if tb { b[c * k + j] } else { b[j * n + c] };
                for &(bm, bn) in &VARIANTS {
                    let c = replay(&a, &b, (m, n, k), (ta, tb), (bm as usize, bn as usize));
                    for r in 0..m {
                        for col in 0..n {
                            let want: f32 = (0..k).map(|j| at(r, j) * bt(j, col)).sum();
                            assert_eq!(c[r * n + col], want, "{m}x{n}x{k} ta {ta} tb {tb} {bm}x{bn}: c[{r}][{col}]");
                        }
                    }
                }
            }
        }
    }

    /// Where NVRTC is installed (CI), every variant is in the module's
    /// CUBIN with the parameters the launch fills.
    #[test]
    fn the_launches_fit_the_compiled_kernels() {
        let Some(cubin) = crate::nvrtc::test_cubin(&MODULE) else { return };
        let call = GemmCall {
            k: 256,
            stride_b: 0,
            stride_c: 0,
            ..super::super::test_call(GemmType::F32, 1, 256, 256, 0x3000)
        };
        let names: Vec<String> = kernel_names().collect();
        for v in 0..VARIANTS.len() {
            let l = launch(&call, v).kernel_launch(&MODULE, &names);
            crate::ops::sweep::check_signature(&format!("tiled {v}"), &cubin, &l);
        }
    }
}
