//! The row-wise network kernels (RMSNorm, LayerNorm, rope, softmax,
//! cross-entropy; forward and backward) on the GPU against the CPU
//! reference (`stepgraph_core::testing::run_op`), on fresh random inputs of
//! several seeds, in every float dtype; plus in-place runs equal to
//! out-of-place ones bit for bit, run-to-run determinism, rows beyond the
//! grid caps, and the special values (−∞ logits, ignored and all-ignored
//! targets, out-of-range targets). Run on a GPU machine with
//! `scripts/gpu-test.sh`.
//!
//! Tolerances are relative to the largest finite magnitude of the CPU
//! output, by the output's dtype: bf16 1e-2 and f16 2e-3 cover one rounding
//! flip of the narrow result (the arithmetic is f32 on both sides); f32
//! 1e-5 and f64 1e-11 cover the different summation orders, widened by
//! √(n/1024) for reductions over n > 1024 elements, since the CPU adds rows
//! serially and its own rounding error grows with the row.
//!
//! An output that is a difference of terms that (nearly) cancel has a
//! rounding error set by the terms, not by the result: the norms' input
//! gradient on rows of one element is exactly or almost zero (RMSNorm:
//! `rstd·w·gy·eps/(x² + eps)`; LayerNorm: `rstd·(g − mean(g))` with `g`
//! its own mean), computed from terms of size one or larger (`rstd` is
//! 316 for a LayerNorm row of one element). For those outputs each element
//! may also differ by [`TERM_ROUNDINGS`] roundings of the arithmetic's unit
//! roundoff times the sum of the magnitudes of its terms, computed in f64
//! from the inputs ([`rms_gx_terms`], [`ln_gx_terms`]). Where nothing
//! cancels, that floor adds at most about 15% to the f32 tolerance (rows
//! of 7 elements), about 5% for rows of 33 to 128 and under 3% for longer
//! rows; in the other dtypes it adds about 1e-4 of the tolerance.

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::loss::{CrossEntropy, CrossEntropyBackward};
use stepgraph_core::ops::norm::{stat_dtype, LayerNorm, LayerNormBackward, RmsNorm, RmsNormBackward};
use stepgraph_core::ops::rope::Rope;
use stepgraph_core::ops::softmax::{Softmax, SoftmaxBackward};
use stepgraph_core::ops::Op;
use stepgraph_core::testing::{self, draw_inputs, Arg};
use stepgraph_cuda::session;

const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// Row lengths of the norm and softmax tests: 1, 7, 128, 3200 and 32000
/// (LLaMA widths and vocabularies), several row counts (one row, rows not a
/// multiple of the 32 lanes of the norms' column kernels, a 3-D input).
const ROW_SHAPES: [&[usize]; 8] =
    [&[5, 1], &[3, 7], &[300, 7], &[1, 33], &[37, 45], &[2, 3, 128], &[64, 3200], &[4, 32000]];

/// Two seeds for small inputs, one for large ones: the shapes already vary,
/// and every GPU run is a session of its own (`scripts/gpu-test.sh` runs the
/// tests one at a time).
fn seeds(numel: usize) -> &'static [u64] {
    if numel > 20_000 {
        &[21]
    } else {
        &[11, 12]
    }
}

/// Keeps the GPU's primary context alive for the whole test binary: every
/// one-op session retains and releases it, and the release of the last
/// reference tears it down, so without this each run would pay for a fresh
/// context. Nothing is allocated through this handle.
fn warm_gpu() {
    static CTX: OnceLock<Option<Arc<CudaContext>>> = OnceLock::new();
    CTX.get_or_init(|| CudaContext::new(0).ok());
}

fn gpu_run(op: &Op, inputs: &[HostTensor]) -> Vec<HostTensor> {
    warm_gpu();
    session::run_op(op, inputs).unwrap_or_else(|e| panic!("{}: GPU: {e}", op.name()))
}

fn gpu_run_aliased(op: &Op, inputs: &[HostTensor]) -> Vec<HostTensor> {
    warm_gpu();
    session::run_op_aliased(op, inputs).unwrap_or_else(|e| panic!("{} in place: GPU: {e}", op.name()))
}

fn tol(dtype: DType, reduced: usize) -> f64 {
    let widen = (reduced as f64 / 1024.0).sqrt().max(1.0);
    match dtype {
        DType::F32 => 1e-5 * widen,
        DType::F64 => 1e-11 * widen,
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        d => panic!("no tolerance for {d}"),
    }
}

/// `gpu` equals `cpu` within `tol` of the largest finite |cpu|; NaN where
/// and only where the CPU has NaN, and the same infinities.
fn assert_close(what: &str, gpu: &HostTensor, cpu: &HostTensor, tol: f64) {
    assert_close_with_floor(what, gpu, cpu, tol, &[]);
}

/// [`assert_close`], where element `i` may also differ by `floor[i]`
/// (absolute; an empty `floor` is all zeros): for outputs whose terms
/// cancel (see the module doc).
fn assert_close_with_floor(what: &str, gpu: &HostTensor, cpu: &HostTensor, tol: f64, floor: &[f64]) {
    assert_eq!(gpu.ty, cpu.ty, "{what}: output types");
    let (g, c) = (gpu.to_f64(), cpu.to_f64());
    assert!(floor.is_empty() || floor.len() == c.len(), "{what}: {} floors for {} elements", floor.len(), c.len());
    let scale = c.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    // The worst difference as a fraction of what element i is allowed.
    let mut worst = (0.0f64, 0usize);
    for (i, (&a, &b)) in g.iter().zip(&c).enumerate() {
        if a.is_nan() || b.is_nan() {
            assert!(a.is_nan() && b.is_nan(), "{what}[{i}]: gpu {a}, cpu {b}");
        } else if a.is_infinite() || b.is_infinite() {
            assert_eq!(a, b, "{what}[{i}]: gpu {a}, cpu {b}");
        } else {
            let allowed = tol * scale + floor.get(i).copied().unwrap_or(0.0);
            if (a - b).abs() / allowed > worst.0 {
                worst = ((a - b).abs() / allowed, i);
            }
        }
    }
    let (ratio, i) = worst;
    let f = floor.get(i).copied().unwrap_or(0.0);
    let (a, b) = (g.get(i).copied().unwrap_or(f64::NAN), c.get(i).copied().unwrap_or(f64::NAN));
    assert!(
        ratio <= 1.0,
        "{what}: difference {:.3e} at {i} (gpu {a}, cpu {b}) exceeds {tol:.1e} of the max |cpu| {scale:.3e}{}",
        (a - b).abs(),
        if floor.is_empty() { String::new() } else { format!(" plus the term floor {f:.3e}") },
    );
}

/// Runs `op` on both backends and compares every output; `reduced` is the
/// longest reduction the op does (for the f32/f64 tolerance).
fn check(what: &str, op: &Op, inputs: &[HostTensor], reduced: usize) -> Vec<HostTensor> {
    check_with_floor(what, op, inputs, reduced, &[])
}

/// [`check`], with output 0 allowed an absolute `floor` per element (see
/// [`assert_close_with_floor`]; empty for none).
fn check_with_floor(what: &str, op: &Op, inputs: &[HostTensor], reduced: usize, floor: &[f64]) -> Vec<HostTensor> {
    let cpu = testing::run_op(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    warm_gpu();
    let gpu = session::run_op(op, inputs).unwrap_or_else(|e| panic!("{what}: GPU: {e}"));
    assert_eq!(gpu.len(), cpu.len(), "{what}: output count");
    for (k, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        let floor = if k == 0 { floor } else { &[] };
        assert_close_with_floor(&format!("{what}: output {k}"), g, c, tol(c.ty.dtype, reduced), floor);
    }
    gpu
}

/// How many roundings of the sum of its terms' magnitudes a cancelling
/// result may differ by between the backends: each side rounds every
/// product and partial sum of the terms and the two order (and fuse) them
/// differently. The CPU's f32 result on rows of one element is within 1.5
/// such roundings of its f64 result; 8 leaves room for both sides' errors.
const TERM_ROUNDINGS: f64 = 8.0;

/// The unit roundoff of the arithmetic of `dtype`'s kernels: f32 for the
/// 16-bit types and f32 (their statistics' dtype), f64 for f64.
fn unit_roundoff(dtype: DType) -> f64 {
    if stat_dtype(dtype) == DType::F64 {
        f64::EPSILON / 2.0
    } else {
        f64::from(f32::EPSILON) / 2.0
    }
}

/// The absolute floor of a cancelling output of `dtype` whose elements sum
/// terms of magnitudes `terms` (per element, summed).
fn term_floor(dtype: DType, terms: Vec<f64>) -> Vec<f64> {
    let unit = TERM_ROUNDINGS * unit_roundoff(dtype);
    terms.into_iter().map(|t| unit * t).collect()
}

fn normal(shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    draw_inputs(&[Arg::Normal(shape.to_vec())], dtype, seed).remove(0)
}

fn rows_of(shape: &[usize]) -> &[usize] {
    &shape[..shape.len() - 1]
}

fn cols_of(shape: &[usize]) -> usize {
    *shape.last().unwrap()
}

/// One output of `op` on the CPU (the forward statistics the backward ops take).
fn cpu_output(op: &Op, inputs: &[HostTensor], k: usize) -> HostTensor {
    testing::run_op(op, inputs).unwrap().swap_remove(k)
}

// ---------------------------------------------------------------- norms

const RMS_EPS: f64 = 1e-6;
const LN_EPS: f64 = 1e-5;

/// Per element of the RMSNorm backward's `gx` (inputs `x, w, rstd, gy[,
/// grstd]`), the sum of the magnitudes of the terms it adds up:
/// `rstd·|w·gy| + |x|·rstd³·(Σ_row |x·w·gy| + |grstd|)/C`.
fn rms_gx_terms(ins: &[HostTensor]) -> Vec<f64> {
    let (x, w, rstd, gy) = (ins[0].to_f64(), ins[1].to_f64(), ins[2].to_f64(), ins[3].to_f64());
    let grstd = ins.get(4).map(HostTensor::to_f64);
    let c = w.len();
    let mut terms = Vec::with_capacity(x.len());
    for (r, (xr, gyr)) in x.chunks(c).zip(gy.chunks(c)).enumerate() {
        let rs = rstd[r];
        let dot: f64 = xr.iter().zip(&w).zip(gyr).map(|((x, w), g)| (x * w * g).abs()).sum();
        let gs = grstd.as_ref().map_or(0.0, |g| g[r].abs());
        let coef = rs.powi(3) * (dot + gs) / c as f64;
        terms.extend(xr.iter().zip(&w).zip(gyr).map(|((x, w), g)| rs * (w * g).abs() + x.abs() * coef));
    }
    terms
}

/// Per element of the LayerNorm backward's `gx` (inputs `x, w, mean, rstd,
/// gy[, gmean, grstd]`), the sum of the magnitudes of the terms it adds up:
/// with `g = gy·w` and `x̂ = (x − mean)·rstd`,
/// `rstd·(|g| + mean|g| + |x̂|·mean|g·x̂|) + |gmean|/C + |grstd|·rstd²·|x̂|/C`.
fn ln_gx_terms(ins: &[HostTensor]) -> Vec<f64> {
    let (x, w, mean, rstd, gy) = (ins[0].to_f64(), ins[1].to_f64(), ins[2].to_f64(), ins[3].to_f64(), ins[4].to_f64());
    let (gmean, grstd) = (ins.get(5).map(HostTensor::to_f64), ins.get(6).map(HostTensor::to_f64));
    let c = w.len();
    let n = c as f64;
    let mut terms = Vec::with_capacity(x.len());
    for (r, (xr, gyr)) in x.chunks(c).zip(gy.chunks(c)).enumerate() {
        let (m, rs) = (mean[r], rstd[r]);
        let g: Vec<f64> = gyr.iter().zip(&w).map(|(gy, w)| (gy * w).abs()).collect();
        let xh: Vec<f64> = xr.iter().map(|x| (x - m).abs() * rs).collect();
        let mean_g = g.iter().sum::<f64>() / n;
        let mean_gx = g.iter().zip(&xh).map(|(g, xh)| g * xh).sum::<f64>() / n;
        let shift = gmean.as_ref().map_or(0.0, |v| v[r].abs()) / n;
        let stat_coef = grstd.as_ref().map_or(0.0, |v| v[r].abs()) * rs * rs / n;
        terms.extend(g.iter().zip(&xh).map(|(g, xh)| rs * (g + mean_g + xh * mean_gx) + shift + stat_coef * xh));
    }
    terms
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn rms_norm_matches_cpu() {
    let op = Op::RmsNorm(RmsNorm { eps: RMS_EPS });
    for dt in FLOATS {
        for shape in ROW_SHAPES {
            let c = cols_of(shape);
            for &seed in seeds(shape.iter().product()) {
                let ins = vec![normal(shape, dt, seed), normal(&[c], dt, seed + 100)];
                check(&format!("rms_norm {dt} {shape:?} seed {seed}"), &op, &ins, c);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn rms_norm_backward_matches_cpu_with_and_without_grstd() {
    let fwd = Op::RmsNorm(RmsNorm { eps: RMS_EPS });
    let op = Op::RmsNormBackward(RmsNormBackward { eps: RMS_EPS });
    for dt in FLOATS {
        for shape in ROW_SHAPES {
            let (c, rows) = (cols_of(shape), rows_of(shape));
            let n_rows: usize = rows.iter().product();
            for &seed in seeds(shape.iter().product()) {
                let (x, w) = (normal(shape, dt, seed), normal(&[c], dt, seed + 100));
                let rstd = cpu_output(&fwd, &[x.clone(), w.clone()], 1);
                let gy = normal(shape, dt, seed + 200);
                let mut ins = vec![x, w, rstd, gy];
                // gw sums over every row: the longest reduction of the op.
                let reduced = c.max(n_rows);
                let what = format!("rms_norm_backward {dt} {shape:?} seed {seed}");
                check_with_floor(&what, &op, &ins, reduced, &term_floor(dt, rms_gx_terms(&ins)));
                ins.push(normal(rows, stat_dtype(dt), seed + 300));
                let what = format!("rms_norm_backward+grstd {dt} {shape:?} seed {seed}");
                check_with_floor(&what, &op, &ins, reduced, &term_floor(dt, rms_gx_terms(&ins)));
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn layer_norm_matches_cpu() {
    let op = Op::LayerNorm(LayerNorm { eps: LN_EPS });
    for dt in FLOATS {
        for shape in ROW_SHAPES {
            let c = cols_of(shape);
            for &seed in seeds(shape.iter().product()) {
                let ins = vec![normal(shape, dt, seed), normal(&[c], dt, seed + 100), normal(&[c], dt, seed + 101)];
                check(&format!("layer_norm {dt} {shape:?} seed {seed}"), &op, &ins, c);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn layer_norm_backward_matches_cpu_with_and_without_stat_cotangents() {
    let fwd = Op::LayerNorm(LayerNorm { eps: LN_EPS });
    let op = Op::LayerNormBackward(LayerNormBackward { eps: LN_EPS });
    for dt in FLOATS {
        for shape in ROW_SHAPES {
            let (c, rows) = (cols_of(shape), rows_of(shape));
            let n_rows: usize = rows.iter().product();
            for &seed in seeds(shape.iter().product()) {
                let (x, w, b) = (normal(shape, dt, seed), normal(&[c], dt, seed + 100), normal(&[c], dt, seed + 101));
                let stats = testing::run_op(&fwd, &[x.clone(), w.clone(), b]).unwrap();
                let gy = normal(shape, dt, seed + 200);
                let mut ins = vec![x, w, stats[1].clone(), stats[2].clone(), gy];
                let reduced = c.max(n_rows);
                let what = format!("layer_norm_backward {dt} {shape:?} seed {seed}");
                check_with_floor(&what, &op, &ins, reduced, &term_floor(dt, ln_gx_terms(&ins)));
                let st = stat_dtype(dt);
                ins.push(normal(rows, st, seed + 300));
                ins.push(normal(rows, st, seed + 301));
                let what = format!("layer_norm_backward+gstats {dt} {shape:?} seed {seed}");
                check_with_floor(&what, &op, &ins, reduced, &term_floor(dt, ln_gx_terms(&ins)));
            }
        }
    }
}

// ---------------------------------------------------------------- rope

/// `(shape [B, T, H, D], n_rot, base)`: full and partial rotation, the
/// n_rot == 1 quirk alone (D == 1) and with pass-through dims, n_rot == 0,
/// more pairs than one angle chunk of the kernel (256), and LLaMA-like
/// heads at 4096 positions with both common bases.
const ROPE_CASES: [(&[usize], usize, f64); 10] = [
    (&[2, 7, 3, 16], 16, 10000.0),
    (&[2, 7, 3, 16], 8, 10000.0),
    (&[2, 300, 4, 1], 1, 10000.0),
    (&[2, 9, 3, 4], 1, 10000.0),
    (&[1, 3, 2, 8], 0, 10000.0),
    (&[1, 5, 2, 1024], 1024, 10000.0),
    (&[1, 5, 3, 1024], 600, 10000.0),
    (&[1, 4096, 2, 128], 128, 10000.0),
    (&[1, 4096, 2, 128], 128, 500000.0),
    (&[3, 33, 5, 64], 32, 1e6),
];

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn rope_matches_cpu_forward_and_inverse() {
    for dt in FLOATS {
        for (shape, n_rot, base) in ROPE_CASES {
            for inverse in [false, true] {
                let op = Op::Rope(Rope { n_rot, base, inverse });
                for &seed in &seeds(shape.iter().product())[..1] {
                    let ins = vec![normal(shape, dt, seed)];
                    check(
                        &format!("rope n_rot={n_rot} base={base} inverse={inverse} {dt} {shape:?} seed {seed}"),
                        &op,
                        &ins,
                        1,
                    );
                }
            }
        }
    }
}

/// The inverse undoes the rotation (up to rounding), on the GPU alone.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn rope_inverse_undoes_rope() {
    for (shape, n_rot, base) in ROPE_CASES {
        if n_rot == 1 {
            continue; // a scaling, not a rotation: it has no inverse of this form
        }
        let x = normal(shape, DType::F64, 5);
        let fwd = Op::Rope(Rope { n_rot, base, inverse: false });
        let inv = Op::Rope(Rope { n_rot, base, inverse: true });
        let y = gpu_run(&fwd, std::slice::from_ref(&x)).remove(0);
        let back = gpu_run(&inv, &[y]).remove(0);
        assert_close(&format!("rope round trip {shape:?} n_rot={n_rot}"), &back, &x, 1e-12);
    }
}

// ---------------------------------------------------------------- softmax

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn softmax_matches_cpu() {
    let op = Op::Softmax(Softmax);
    for dt in FLOATS {
        for shape in ROW_SHAPES {
            for &seed in seeds(shape.iter().product()) {
                check(&format!("softmax {dt} {shape:?} seed {seed}"), &op, &[normal(shape, dt, seed)], cols_of(shape));
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn softmax_backward_matches_cpu() {
    let op = Op::SoftmaxBackward(SoftmaxBackward);
    for dt in FLOATS {
        for shape in ROW_SHAPES {
            for &seed in seeds(shape.iter().product()) {
                // Real probabilities, as the backward sees them.
                let y = cpu_output(&Op::Softmax(Softmax), &[normal(shape, dt, seed)], 0);
                let gy = normal(shape, dt, seed + 100);
                check(&format!("softmax_backward {dt} {shape:?} seed {seed}"), &op, &[y, gy], cols_of(shape));
            }
        }
    }
}

/// Masked (−∞) entries, a fully masked row (NaN on both backends) and huge
/// logits that overflow exp without the max shift.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn softmax_special_values_match_cpu() {
    let (rows, cols) = (4, 37);
    let mut d: Vec<f64> = normal(&[rows, cols], DType::F64, 3).to_f64();
    for (k, v) in d[..cols].iter_mut().enumerate() {
        if k % 3 != 0 {
            *v = f64::NEG_INFINITY;
        }
    }
    d[cols..2 * cols].fill(f64::NEG_INFINITY);
    for v in &mut d[2 * cols..3 * cols] {
        *v *= 1000.0;
    }
    for dt in FLOATS {
        let x = HostTensor::from_f64(TensorType::new(dt, [rows, cols]), &d);
        check(&format!("softmax special values {dt}"), &Op::Softmax(Softmax), &[x], cols);
    }
}

// ---------------------------------------------------------------- cross-entropy

const IGNORE: i64 = -100;

/// `(rows, classes)`: a single class, small rows, vocabularies of 3200 and
/// 32000, and Qwen's 152064 with few rows.
const CE_SHAPES: [(usize, usize); 7] = [(6, 1), (9, 7), (33, 128), (300, 7), (16, 3200), (8, 32000), (3, 152064)];

/// Targets in `[0, classes)` of `dtype`, every third one (from `phase`) set to `ignore`.
fn targets(rows: usize, classes: usize, dtype: DType, seed: u64, ignore: i64, phase: usize) -> HostTensor {
    let ids = draw_inputs(&[Arg::Ids { dtype, shape: vec![rows], max: classes as i64 }], dtype, seed).remove(0);
    let mut v = ids.to_f64();
    for (i, t) in v.iter_mut().enumerate() {
        if (i + phase).is_multiple_of(3) {
            *t = ignore as f64;
        }
    }
    HostTensor::from_f64(TensorType::new(dtype, [rows]), &v)
}

fn scalar(dtype: DType, v: f64) -> HostTensor {
    HostTensor::from_f64(TensorType::scalar(dtype), &[v])
}

/// `(logits, targets, lse)` for a cross-entropy case.
fn ce_case(dt: DType, rows: usize, classes: usize, seed: u64, tdt: DType) -> (HostTensor, HostTensor, HostTensor) {
    let x = normal(&[rows, classes], dt, seed);
    let t = targets(rows, classes, tdt, seed + 1, IGNORE, seed as usize);
    let lse = cpu_output(&Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE }), &[x.clone(), t.clone()], 1);
    (x, t, lse)
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn cross_entropy_matches_cpu_with_ignored_rows() {
    let op = Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE });
    for dt in FLOATS {
        for (i, (rows, classes)) in CE_SHAPES.into_iter().enumerate() {
            let tdt = if i % 2 == 0 { DType::I64 } else { DType::I32 };
            for &seed in seeds(rows * classes) {
                let x = normal(&[rows, classes], dt, seed);
                let t = targets(rows, classes, tdt, seed + 1, IGNORE, seed as usize);
                let what = format!("cross_entropy {dt} [{rows}, {classes}] {tdt} targets seed {seed}");
                check(&what, &op, &[x, t], classes.max(rows));
            }
        }
    }
}

/// An ignore index that is also a valid class: rows targeting it are left out.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn cross_entropy_ignore_index_inside_the_classes() {
    let (rows, classes) = (40, 5);
    let fwd = Op::CrossEntropy(CrossEntropy { ignore_index: 2 });
    let bwd = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: 2 });
    for dt in FLOATS {
        let x = normal(&[rows, classes], dt, 8);
        let t = draw_inputs(&[Arg::Ids { dtype: DType::I32, shape: vec![rows], max: classes as i64 }], dt, 9).remove(0);
        let outs = check(&format!("cross_entropy ignore_index=2 {dt}"), &fwd, &[x.clone(), t.clone()], rows);
        let lse = outs[1].clone();
        let ins = [x, t, lse, scalar(stat_dtype(dt), 1.0)];
        check(&format!("cross_entropy_backward ignore_index=2 {dt}"), &bwd, &ins, classes);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn cross_entropy_backward_matches_cpu_with_and_without_glse() {
    let op = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE });
    for dt in FLOATS {
        let st = stat_dtype(dt);
        for (i, (rows, classes)) in CE_SHAPES.into_iter().enumerate() {
            let tdt = if i % 2 == 0 { DType::I32 } else { DType::I64 };
            for &seed in seeds(rows * classes) {
                let (x, t, lse) = ce_case(dt, rows, classes, seed, tdt);
                let what = format!("cross_entropy_backward {dt} [{rows}, {classes}] {tdt} seed {seed}");
                let mut ins = vec![x, t, lse, scalar(st, 0.75)];
                check(&what, &op, &ins, classes);
                ins.push(normal(&[rows], st, seed + 7));
                check(&format!("{what} +glse"), &op, &ins, classes);
                // A zero loss cotangent: only glse flows.
                ins[3] = scalar(st, 0.0);
                check(&format!("{what} +glse, gloss=0"), &op, &ins, classes);
                if rows * classes <= 20_000 {
                    ins.pop();
                    check(&format!("{what} gloss=0 (all zero)"), &op, &ins, classes);
                }
            }
        }
    }
}

/// No row kept: the loss is NaN (0/0) on both backends; the backward is
/// zero without glse and glse·softmax with it.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn cross_entropy_all_ignored() {
    let (rows, classes) = (5, 11);
    let fwd = Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE });
    let bwd = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE });
    for dt in FLOATS {
        let st = stat_dtype(dt);
        let x = normal(&[rows, classes], dt, 4);
        let t = HostTensor::from_f64(TensorType::new(DType::I64, [rows]), &[IGNORE as f64; 5]);
        let outs = check(&format!("cross_entropy all ignored {dt}"), &fwd, &[x.clone(), t.clone()], classes);
        assert!(outs[0].to_f64()[0].is_nan(), "{dt}: the loss over no row must be NaN");
        let mut ins = vec![x, t, outs[1].clone(), scalar(st, 1.0)];
        let g = check(&format!("cross_entropy_backward all ignored {dt}"), &bwd, &ins, classes);
        assert!(g[0].to_f64().iter().all(|&v| v == 0.0), "{dt}: no kept row and no glse: zero gradient");
        ins.push(normal(&[rows], st, 6));
        check(&format!("cross_entropy_backward all ignored +glse {dt}"), &bwd, &ins, classes);
    }
}

/// −∞ logits (masked classes), one fully masked ignored row (lse −∞ on both
/// backends) and large logits that need the max shift.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn cross_entropy_special_values_match_cpu() {
    let (rows, classes) = (4, 50);
    let mut d = normal(&[rows, classes], DType::F64, 13).to_f64();
    for v in d[..classes].iter_mut().skip(1).step_by(2) {
        *v = f64::NEG_INFINITY;
    }
    d[classes..2 * classes].fill(f64::NEG_INFINITY);
    for v in &mut d[2 * classes..3 * classes] {
        *v = *v * 100.0 + 200.0;
    }
    // Row 0 targets an unmasked class; row 1 (all −∞) is ignored.
    let t = HostTensor::from_f64(TensorType::new(DType::I64, [rows]), &[0.0, IGNORE as f64, 3.0, 7.0]);
    let fwd = Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE });
    let bwd = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE });
    for dt in FLOATS {
        let x = HostTensor::from_f64(TensorType::new(dt, [rows, classes]), &d);
        let outs = check(&format!("cross_entropy special values {dt}"), &fwd, &[x.clone(), t.clone()], classes);
        assert_eq!(outs[1].to_f64()[1], f64::NEG_INFINITY, "{dt}: lse of an all −∞ row");
        let mut ins = vec![x, t.clone(), outs[1].clone(), scalar(stat_dtype(dt), 1.0)];
        check(&format!("cross_entropy_backward special values {dt}"), &bwd, &ins, classes);
        ins.push(normal(&[rows], stat_dtype(dt), 14));
        check(&format!("cross_entropy_backward special values +glse {dt}"), &bwd, &ins, classes);
    }
}

/// The CPU rejects a target outside the classes; the GPU cannot, and must
/// neither read out of bounds nor hide it: the loss and that row's gradient
/// turn NaN, the other rows stay finite.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn out_of_range_targets_poison_the_loss_without_reading_out_of_bounds() {
    let (rows, classes) = (3, 10);
    let fwd = Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE });
    let bwd = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE });
    for bad in [10.0, -1.0, 1e9] {
        let x = normal(&[rows, classes], DType::F32, 1);
        let t = HostTensor::from_f64(TensorType::new(DType::I64, [rows]), &[1.0, bad, 2.0]);
        let outs = gpu_run(&fwd, &[x.clone(), t.clone()]);
        assert!(outs[0].to_f64()[0].is_nan(), "target {bad}: loss must be NaN");
        assert!(outs[1].to_f64().iter().all(|v| v.is_finite()), "target {bad}: lse does not depend on targets");
        let g = gpu_run(&bwd, &[x, t, outs[1].clone(), scalar(DType::F32, 1.0)]).remove(0).to_f64();
        assert!(g[classes..2 * classes].iter().all(|v| v.is_nan()), "target {bad}: its row must be NaN");
        assert!(g[..classes].iter().chain(&g[2 * classes..]).all(|v| v.is_finite()), "target {bad}: other rows");
    }
}

// ---------------------------------------------------------------- in place, determinism, grid caps

/// The ops with in-place pairs, with inputs: softmax (y over x), its
/// backward (gx over gy), rope (y over x, partial and n_rot == 1) and the
/// cross-entropy backward (dlogits over the logits, with and without glse).
fn in_place_cases(dt: DType, seed: u64) -> Vec<(String, Op, Vec<HostTensor>)> {
    let st = stat_dtype(dt);
    let x = normal(&[7, 3200], dt, seed);
    let y = cpu_output(&Op::Softmax(Softmax), std::slice::from_ref(&x), 0);
    let (lx, lt, lse) = ce_case(dt, 12, 32000, seed, DType::I64);
    let ce_b = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE });
    vec![
        ("softmax".into(), Op::Softmax(Softmax), vec![x]),
        ("softmax_backward".into(), Op::SoftmaxBackward(SoftmaxBackward), vec![y, normal(&[7, 3200], dt, seed + 1)]),
        (
            "rope partial".into(),
            Op::Rope(Rope { n_rot: 64, base: 10000.0, inverse: false }),
            vec![normal(&[2, 65, 4, 96], dt, seed + 2)],
        ),
        (
            "rope inverse".into(),
            Op::Rope(Rope { n_rot: 96, base: 10000.0, inverse: true }),
            vec![normal(&[2, 65, 4, 96], dt, seed + 3)],
        ),
        (
            "rope n_rot=1".into(),
            Op::Rope(Rope { n_rot: 1, base: 10000.0, inverse: false }),
            vec![normal(&[2, 65, 4, 3], dt, seed + 4)],
        ),
        ("cross_entropy_backward".into(), ce_b.clone(), vec![lx.clone(), lt.clone(), lse.clone(), scalar(st, 1.0)]),
        ("cross_entropy_backward+glse".into(), ce_b, vec![lx, lt, lse, scalar(st, 1.0), normal(&[12], st, seed + 5)]),
    ]
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn in_place_runs_equal_out_of_place_bit_for_bit() {
    for dt in FLOATS {
        for seed in [31] {
            for (name, op, ins) in in_place_cases(dt, seed) {
                let what = format!("{name} {dt} seed {seed}");
                let plain = gpu_run(&op, &ins);
                let aliased = gpu_run_aliased(&op, &ins);
                assert!(plain == aliased, "{what}: in place differs from out of place");
                // And both agree with the CPU's in-place run.
                let cpu = testing::run_op_aliased(&op, &ins).unwrap();
                assert_close(&what, &aliased[0], &cpu[0], tol(dt, 32000));
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn every_kernel_is_deterministic() {
    for dt in [DType::F32, DType::BF16] {
        let st = stat_dtype(dt);
        let shape = [300, 3200];
        let (x, w, b, gy) =
            (normal(&shape, dt, 1), normal(&[3200], dt, 2), normal(&[3200], dt, 3), normal(&shape, dt, 4));
        let rms = Op::RmsNorm(RmsNorm { eps: RMS_EPS });
        let rstd = cpu_output(&rms, &[x.clone(), w.clone()], 1);
        let ln = Op::LayerNorm(LayerNorm { eps: LN_EPS });
        let stats = testing::run_op(&ln, &[x.clone(), w.clone(), b.clone()]).unwrap();
        let g300 = normal(&[300], st, 5);
        let (lx, lt, lse) = ce_case(dt, 64, 32000, 6, DType::I32);
        let mut cases: Vec<(Op, Vec<HostTensor>)> = vec![
            (rms, vec![x.clone(), w.clone()]),
            (
                Op::RmsNormBackward(RmsNormBackward { eps: RMS_EPS }),
                vec![x.clone(), w.clone(), rstd, gy.clone(), g300.clone()],
            ),
            (ln, vec![x.clone(), w.clone(), b]),
            (
                Op::LayerNormBackward(LayerNormBackward { eps: LN_EPS }),
                vec![x.clone(), w, stats[1].clone(), stats[2].clone(), gy.clone(), g300.clone(), g300],
            ),
            (Op::Rope(Rope { n_rot: 128, base: 10000.0, inverse: false }), vec![normal(&[2, 50, 4, 128], dt, 7)]),
            (Op::Softmax(Softmax), vec![x.clone()]),
            (Op::SoftmaxBackward(SoftmaxBackward), vec![x, gy]),
            (Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE }), vec![lx.clone(), lt.clone()]),
        ];
        cases.push((
            Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE }),
            vec![lx, lt, lse, scalar(st, 1.0), normal(&[64], st, 8)],
        ));
        for (op, ins) in cases {
            let a = gpu_run(&op, &ins);
            let b = gpu_run(&op, &ins);
            assert!(a == b, "{} {dt}: two runs differ", op.name());
        }
    }
}

/// More rows than the row kernels' grid cap (2²⁰ blocks, grid-striding)
/// and than the cross-entropy backward's (1024 blocks).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn rows_beyond_the_grid_caps() {
    let rows = (1 << 20) + 37;
    let dt = DType::F32;
    let x = normal(&[rows, 2], dt, 1);
    let w = normal(&[2], dt, 2);
    check("rms_norm beyond the grid cap", &Op::RmsNorm(RmsNorm { eps: RMS_EPS }), &[x.clone(), w.clone()], 2);
    let b = normal(&[2], dt, 3);
    check("layer_norm beyond the grid cap", &Op::LayerNorm(LayerNorm { eps: LN_EPS }), &[x.clone(), w, b], 2);
    check("softmax beyond the grid cap", &Op::Softmax(Softmax), &[x], 2);
    let r = normal(&[1, rows, 1, 2], dt, 4);
    check("rope beyond the grid cap", &Op::Rope(Rope { n_rot: 2, base: 10000.0, inverse: false }), &[r], 1);
    let (lx, lt, lse) = ce_case(dt, 5000, 33, 5, DType::I64);
    let ce = Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE });
    check("cross_entropy 5000 rows", &ce, &[lx.clone(), lt.clone()], 5000);
    let bwd = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE });
    check("cross_entropy_backward 5000 rows", &bwd, &[lx, lt, lse, scalar(DType::F32, 1.0)], 33);
}
