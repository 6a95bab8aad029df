//! Op-table tests for the pointwise, reduction, movement and matmul ops:
//! every VJP against f64 finite differences, in-place kernels against their
//! out-of-place runs, f32/bf16 kernels against f64, and shape-rule errors.

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::elementwise::{Binary, Cast, Unary};
use stepgraph_core::ops::matmul::MatMul;
use stepgraph_core::ops::movement::{Broadcast, Concat, Permute, Reshape, Slice};
use stepgraph_core::ops::reduce::{Reduce, ReduceKind};
use stepgraph_core::ops::{BinaryFn, Op, UnaryFn};
use stepgraph_core::testing::{check_vjp, draw_inputs, max_rel_diff, run_op, run_op_aliased, Arg};

fn n(s: &[usize]) -> Arg {
    Arg::Normal(s.to_vec())
}
fn pos(s: &[usize]) -> Arg {
    Arg::Positive(s.to_vec())
}

/// The op table: every case an op and the inputs to draw for it.
fn cases() -> Vec<(Op, Vec<Arg>)> {
    let unary = |f| Op::from(Unary { f });
    let binary = |f| Op::from(Binary { f });
    let mut v: Vec<(Op, Vec<Arg>)> = vec![
        (unary(UnaryFn::Neg), vec![n(&[3, 4])]),
        (unary(UnaryFn::Exp), vec![n(&[3, 4])]),
        (unary(UnaryFn::Log), vec![pos(&[3, 4])]),
        (unary(UnaryFn::Sqrt), vec![pos(&[5])]),
        (unary(UnaryFn::Rsqrt), vec![pos(&[5])]),
        (unary(UnaryFn::Tanh), vec![n(&[2, 3])]),
        (unary(UnaryFn::Sigmoid), vec![n(&[2, 3])]),
        (unary(UnaryFn::Silu), vec![n(&[2, 3])]),
        (unary(UnaryFn::GeluTanh), vec![n(&[2, 3])]),
        (unary(UnaryFn::GeluErf), vec![n(&[2, 3])]),
        (unary(UnaryFn::Pow(3.0)), vec![n(&[2, 3])]),
        (unary(UnaryFn::Pow(-0.5)), vec![pos(&[2, 3])]),
        (Cast { dtype: DType::F64 }.into(), vec![n(&[4])]),
        (Reshape { shape: vec![6, 2] }.into(), vec![n(&[3, 4])]),
        (Permute { perm: vec![2, 0, 1] }.into(), vec![n(&[2, 3, 4])]),
        (Broadcast { shape: vec![2, 3, 4] }.into(), vec![n(&[3, 1])]),
        (Slice { axis: 1, start: 1, end: 3 }.into(), vec![n(&[2, 4, 3])]),
        (Concat { axis: 1 }.into(), vec![n(&[2, 1, 3]), n(&[2, 3, 3])]),
        (Reduce { kind: ReduceKind::Sum, axes: vec![0, 2], keepdim: false }.into(), vec![n(&[2, 3, 4])]),
        (Reduce { kind: ReduceKind::Mean, axes: vec![1], keepdim: true }.into(), vec![n(&[2, 3, 4])]),
        (Reduce { kind: ReduceKind::Max, axes: vec![2], keepdim: false }.into(), vec![n(&[2, 3, 5])]),
        (Reduce { kind: ReduceKind::Sum, axes: vec![0, 1], keepdim: false }.into(), vec![n(&[3, 4])]),
    ];
    for f in [BinaryFn::Add, BinaryFn::Sub, BinaryFn::Mul] {
        v.push((binary(f), vec![n(&[2, 3]), n(&[2, 3])]));
        v.push((binary(f), vec![n(&[2, 1, 3]), n(&[4, 1])]));
        v.push((binary(f), vec![n(&[]), n(&[2, 3])]));
    }
    v.push((binary(BinaryFn::Div), vec![n(&[2, 3]), pos(&[2, 3])]));
    v.push((binary(BinaryFn::Div), vec![n(&[2, 3]), pos(&[3])]));
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let op: Op = MatMul { trans_a: ta, trans_b: tb }.into();
        let a = |m: usize, k: usize, batch: &[usize]| {
            let mut s = batch.to_vec();
            s.extend(if ta { [k, m] } else { [m, k] });
            n(&s)
        };
        let b = |k: usize, nn: usize, batch: &[usize]| {
            let mut s = batch.to_vec();
            s.extend(if tb { [nn, k] } else { [k, nn] });
            n(&s)
        };
        v.push((op.clone(), vec![a(3, 4, &[]), b(4, 5, &[])]));
        v.push((op.clone(), vec![a(3, 4, &[2]), b(4, 5, &[2])]));
        // A shared weight (the linear-layer case) and a shared left operand.
        v.push((op.clone(), vec![a(3, 4, &[2, 2]), b(4, 5, &[])]));
        v.push((op.clone(), vec![a(3, 4, &[]), b(4, 5, &[3])]));
    }
    v
}

#[test]
fn every_vjp_matches_finite_differences() {
    for (op, args) in cases() {
        for seed in 0..3 {
            let r = check_vjp(&op, &args, seed).unwrap_or_else(|e| panic!("{op:?}: {e}"));
            assert!(r.rel_err() < 1e-6, "{op:?} seed {seed}: {r:?} (rel err {:e})", r.rel_err());
        }
    }
}

#[test]
fn in_place_kernels_match_out_of_place() {
    for (op, args) in cases() {
        if op.inplace().is_empty() {
            continue;
        }
        for dt in [DType::F32, DType::BF16, DType::F64] {
            let x = draw_inputs(&args, dt, 7);
            let x = if matches!(op, Op::Cast(_)) { continue } else { x };
            let a = run_op(&op, &x).unwrap();
            let b = run_op_aliased(&op, &x).unwrap();
            assert_eq!(a, b, "{op:?} {dt}: aliased run differs");
        }
    }
}

#[test]
fn low_precision_kernels_track_f64() {
    for (op, args) in cases() {
        if matches!(op, Op::Cast(_)) {
            continue;
        }
        let reference: Vec<Vec<f64>> =
            run_op(&op, &draw_inputs(&args, DType::F64, 3)).unwrap().iter().map(HostTensor::to_f64).collect();
        for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2), (DType::F16, 5e-3)] {
            // Low-precision inputs are rounded copies of the same f64 draws.
            let x: Vec<HostTensor> = draw_inputs(&args, DType::F64, 3)
                .iter()
                .map(|t| HostTensor::from_f64(t.ty.with_dtype(dt), &t.to_f64()))
                .collect();
            let got = run_op(&op, &x).unwrap();
            for (g, r) in got.iter().zip(&reference) {
                assert_eq!(g.ty.dtype, dt);
                let err = max_rel_diff(&g.to_f64(), r);
                assert!(err < tol, "{op:?} {dt}: max rel diff {err:e} > {tol:e}");
            }
        }
    }
}

#[test]
fn shape_rules_name_the_problem() {
    let t = |s: &[usize]| TensorType::new(DType::F32, s);
    let err = Op::from(MatMul { trans_a: false, trans_b: false }).infer(&[&t(&[2, 3]), &t(&[4, 5])]).unwrap_err();
    assert!(err.contains("contraction sizes differ: 3 and 4"), "{err}");
    let err = Op::from(Binary { f: BinaryFn::Add }).infer(&[&t(&[2, 3]), &t(&[4])]).unwrap_err();
    assert!(err.contains("broadcast"), "{err}");
    let err = Op::from(Reshape { shape: vec![5] }).infer(&[&t(&[2, 3])]).unwrap_err();
    assert!(err.contains("cannot reshape 6 elements"), "{err}");
    let err = Op::from(Binary { f: BinaryFn::Add }).infer(&[&t(&[2]), &TensorType::new(DType::BF16, [2])]).unwrap_err();
    assert!(err.contains("dtypes differ"), "{err}");
}

#[test]
fn reductions_are_exact_on_known_values() {
    let x = HostTensor::from_f64(TensorType::new(DType::F64, [2, 3]), &[1.0, 5.0, 3.0, -2.0, 0.5, 4.0]);
    let sum = run_op(&Reduce { kind: ReduceKind::Sum, axes: vec![1], keepdim: false }.into(), std::slice::from_ref(&x))
        .unwrap();
    assert_eq!(sum[0].to_f64(), vec![9.0, 2.5]);
    let max = run_op(&Reduce { kind: ReduceKind::Max, axes: vec![0], keepdim: true }.into(), std::slice::from_ref(&x))
        .unwrap();
    assert_eq!(max[0].to_f64(), vec![1.0, 5.0, 4.0]);
    assert_eq!(max[0].ty.shape, vec![1, 3]);
    let mean = run_op(&Reduce { kind: ReduceKind::Mean, axes: vec![0, 1], keepdim: false }.into(), &[x]).unwrap();
    assert_eq!(mean[0].to_f64(), vec![11.5 / 6.0]);
}
