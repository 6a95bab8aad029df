//! Tests of the pointwise, reduction, movement and matmul ops beyond their
//! sample tables (which `tests/op_samples.rs` runs through the VJP,
//! in-place and narrow-dtype checks): shape-rule errors and reductions on
//! known values.

use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::elementwise::Binary;
use stepgraph_core::ops::matmul::MatMul;
use stepgraph_core::ops::movement::Reshape;
use stepgraph_core::ops::reduce::{Reduce, ReduceKind};
use stepgraph_core::ops::{BinaryFn, Op};
use stepgraph_core::testing::run_op;

#[test]
fn shape_rules_name_the_problem() {
    let t = |s: &[usize]| TensorType::new(DType::F32, s);
    let err = Op::from(MatMul::new(false, false)).infer(&[&t(&[2, 3]), &t(&[4, 5])]).unwrap_err();
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
