//! The row-wise network kernels (RMSNorm, LayerNorm, rope, softmax,
//! cross-entropy) on the GPU beyond their samples (which `gpu_basic.rs`'s
//! sweep runs against the CPU in every dtype): special values (−∞ logits,
//! huge logits, all-ignored targets, out-of-range targets), rope's inverse,
//! run-to-run determinism on large inputs, and rows beyond the grid caps.
//! Tolerances are relative to the largest finite magnitude of the CPU
//! output, by the output's dtype, as in the sweep (`gpu_basic.rs`'s module
//! doc). Run on a GPU machine with `scripts/gpu-test.sh`.

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::loss::{CrossEntropy, CrossEntropyBackward};
use stepgraph_core::ops::norm::{stat_dtype, LayerNorm, LayerNormBackward, RmsNorm, RmsNormBackward};
use stepgraph_core::ops::rope::Rope;
use stepgraph_core::ops::sample;
use stepgraph_core::ops::softmax::{Softmax, SoftmaxBackward};
use stepgraph_core::ops::{Op, OpDef};
use stepgraph_core::testing::{self, draw_input, draw_sample};
use stepgraph_cuda::testing as gpu;

mod common;
use common::{normal, row_tol, scalar};

const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];
const RMS_EPS: f64 = 1e-6;
const LN_EPS: f64 = 1e-5;

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
    gpu::run_op(op, inputs).unwrap_or_else(|e| panic!("{}: GPU: {e}", op.name()))
}

/// `gpu` equals `cpu` within `tol` of the largest finite |cpu|; NaN where
/// and only where the CPU has NaN, and the same infinities.
fn assert_close(what: &str, gpu: &HostTensor, cpu: &HostTensor, tol: f64) {
    assert_eq!(gpu.ty, cpu.ty, "{what}: output types");
    let (g, c) = (gpu.to_f64(), cpu.to_f64());
    let scale = c.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    let mut worst = (0.0f64, 0usize);
    for (i, (&a, &b)) in g.iter().zip(&c).enumerate() {
        if a.is_nan() || b.is_nan() {
            assert!(a.is_nan() && b.is_nan(), "{what}[{i}]: gpu {a}, cpu {b}");
        } else if a.is_infinite() || b.is_infinite() {
            assert_eq!(a, b, "{what}[{i}]: gpu {a}, cpu {b}");
        } else if (a - b).abs() > worst.0 {
            worst = ((a - b).abs(), i);
        }
    }
    let (diff, i) = worst;
    assert!(
        diff <= tol * scale,
        "{what}: difference {diff:.3e} at {i} (gpu {:?}, cpu {:?}) exceeds {tol:.1e} of the max |cpu| {scale:.3e}",
        g.get(i),
        c.get(i)
    );
}

/// Runs `op` on both backends and compares every output; `reduced` is the
/// longest reduction the op does (for the f32/f64 tolerance).
fn check(what: &str, op: &Op, inputs: &[HostTensor], reduced: usize) -> Vec<HostTensor> {
    let cpu = testing::run_op(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    warm_gpu();
    let gpu = gpu::run_op(op, inputs).unwrap_or_else(|e| panic!("{what}: GPU: {e}"));
    assert_eq!(gpu.len(), cpu.len(), "{what}: output count");
    for (k, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        assert_close(&format!("{what}: output {k}"), g, c, row_tol(c.ty.dtype, reduced));
    }
    gpu
}

/// One output of `op` on the CPU (the forward statistics the backward ops take).
fn cpu_output(op: &Op, inputs: &[HostTensor], k: usize) -> HostTensor {
    testing::run_op(op, inputs).unwrap().swap_remove(k)
}

// ---------------------------------------------------------------- rope

/// The inverse undoes the rotation (up to rounding; LongRoPE's attention
/// factor scales the rotated dimensions both ways, so their round trip is
/// x times its square), on the GPU alone.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-test.sh"]
fn rope_inverse_undoes_rope() {
    for s in Rope::samples(DType::F64) {
        let Op::Rope(rope @ Rope { inverse: false, .. }) = &s.op else { continue };
        if rope.n_rot == 1 {
            continue; // a scaling, not a rotation: it has no inverse of this form
        }
        let x = draw_sample(&s, 5).unwrap().remove(0);
        let shape = &x.ty.shape;
        let fwd = Op::Rope(rope.clone());
        let inv = Op::Rope(Rope { inverse: true, ..rope.clone() });
        let y = gpu_run(&fwd, std::slice::from_ref(&x)).remove(0);
        let back = gpu_run(&inv, &[y]).remove(0);
        let (gain, dim) = (rope.amplitude() * rope.amplitude(), shape[3]);
        let scaled: Vec<f64> =
            x.to_f64().iter().enumerate().map(|(i, v)| if i % dim < rope.n_rot { v * gain } else { *v }).collect();
        let want = HostTensor::from_f64(x.ty.clone(), &scaled);
        assert_close(&format!("rope round trip {shape:?} n_rot={}", rope.n_rot), &back, &want, 1e-12);
    }
}

// ---------------------------------------------------------------- softmax

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

/// `(logits, targets, lse)` for a cross-entropy case.
fn ce_case(dt: DType, rows: usize, classes: usize, seed: u64, tdt: DType) -> (HostTensor, HostTensor, HostTensor) {
    let x = normal(&[rows, classes], dt, seed);
    // Targets in `[0, classes)`, every third one ignored.
    let mut t = draw_input(&sample::ids(tdt, &[rows], classes as i64), seed + 1).unwrap().to_f64();
    for (i, v) in t.iter_mut().enumerate() {
        if (i + seed as usize).is_multiple_of(3) {
            *v = IGNORE as f64;
        }
    }
    let t = HostTensor::from_f64(TensorType::new(tdt, [rows]), &t);
    let lse = cpu_output(&Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE }), &[x.clone(), t.clone()], 1);
    (x, t, lse)
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

// ---------------------------------------------------------------- determinism, grid caps

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
                Op::RmsNormBackward(RmsNormBackward { eps: RMS_EPS, addend: false }),
                vec![x.clone(), w.clone(), rstd, gy.clone(), g300.clone()],
            ),
            (ln, vec![x.clone(), w.clone(), b]),
            (
                Op::LayerNormBackward(LayerNormBackward { eps: LN_EPS, addend: false }),
                vec![x.clone(), w, stats[1].clone(), stats[2].clone(), gy.clone(), g300.clone(), g300],
            ),
            (
                Op::Rope(Rope { n_rot: 128, base: 10000.0, inverse: false, scaling: None }),
                vec![normal(&[2, 50, 4, 128], dt, 7)],
            ),
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
    check(
        "rope beyond the grid cap",
        &Op::Rope(Rope { n_rot: 2, base: 10000.0, inverse: false, scaling: None }),
        &[r],
        1,
    );
    let (lx, lt, lse) = ce_case(dt, 5000, 33, 5, DType::I64);
    let ce = Op::CrossEntropy(CrossEntropy { ignore_index: IGNORE });
    check("cross_entropy 5000 rows", &ce, &[lx.clone(), lt.clone()], 5000);
    let bwd = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: IGNORE });
    check("cross_entropy_backward 5000 rows", &bwd, &[lx, lt, lse, scalar(DType::F32, 1.0)], 33);
}
