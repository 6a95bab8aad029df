//! Softmax over the last axis ([`Softmax`]), its one-kernel backward
//! ([`SoftmaxBackward`]) and the [`Builder::softmax`] helper.
//!
//! Both kernels work row by row and read a row completely before writing
//! it, so both may run in place: the forward over its input, the backward
//! over the incoming cotangent (the probabilities are still needed).

use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use super::norm::ROW_SHAPES;
use super::sample::{normal, output_of, Sample};
use super::{expect_float, expect_inputs, no_vjp, Attrs, OpDef, VjpArgs};
use crate::error::Result;
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{Float, KernelIo};
use crate::with_float;

/// `y = exp(x − max) / Σ exp(x − max)` over the last axis of `x`.
#[derive(Clone, PartialEq, Debug)]
pub struct Softmax;

/// Rows of the last axis as a kernel sees them; `None` when there is no element.
fn row_len(ty: &TensorType) -> Option<usize> {
    let n = *ty.shape.last()?;
    (ty.numel() > 0).then_some(n)
}

fn check_x(inputs: &[&TensorType]) -> std::result::Result<(), String> {
    expect_float(inputs[0], "x")?;
    if inputs[0].rank() == 0 {
        return Err(format!("x must have rank >= 1 (softmax runs over the last axis), got {}", inputs[0]));
    }
    Ok(())
}

/// `y` holds x on entry and the probabilities on return.
fn softmax_rows<T: Float>(y: &mut [T], n: usize) {
    y.par_chunks_mut(n).with_min_len(16).for_each(|row| {
        let m = row.iter().fold(T::Acc::neg_infinity(), |m, v| m.max(v.acc()));
        let s: T::Acc = row.iter().map(|v| (v.acc() - m).exp()).sum();
        // exp is evaluated again rather than stored so narrow types round once.
        for v in row.iter_mut() {
            *v = T::from_acc((v.acc() - m).exp() / s);
        }
    });
}

impl OpDef for Softmax {
    /// The row shapes of the norms' samples.
    fn samples(d: DType) -> Vec<Sample> {
        ROW_SHAPES.iter().map(|s| Sample::new(Softmax, vec![normal(d, s)]).large_over(20_000)).collect()
    }
    fn name(&self) -> &'static str {
        "softmax"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        check_x(inputs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else {
            return Ok(vec![None]);
        };
        Ok(vec![Some(b.push1(SoftmaxBackward.into(), &[args.outputs[0], g])?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        with_float!(io.out_ty(0).dtype, T => {
            let y = io.inplace::<T>(0, 0);
            if let Some(n) = row_len(io.out_ty(0)) {
                softmax_rows(y, n);
            }
            Ok(())
        })
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        (name == "softmax").then_some(Ok(Softmax))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0)]
    }
}

/// The backward of [`Softmax`]: inputs `(y, gy)`, output
/// `gx = y⊙(gy − Σ gy⊙y)` per row; may overwrite `gy`.
#[derive(Clone, PartialEq, Debug)]
pub struct SoftmaxBackward;

/// `g` holds gy on entry and gx on return.
fn softmax_backward_rows<T: Float>(y: &[T], g: &mut [T], n: usize) {
    g.par_chunks_mut(n).enumerate().with_min_len(16).for_each(|(r, gr)| {
        let yr = &y[r * n..(r + 1) * n];
        let dot = gr.iter().zip(yr).fold(T::Acc::zero(), |s, (g, y)| s + g.acc() * y.acc());
        for (gv, yv) in gr.iter_mut().zip(yr) {
            *gv = T::from_acc(yv.acc() * (gv.acc() - dot));
        }
    });
}

impl OpDef for SoftmaxBackward {
    /// The row shapes of the norms' samples, on real probabilities.
    fn samples(d: DType) -> Vec<Sample> {
        ROW_SHAPES
            .iter()
            .map(|s| {
                let y = output_of(Softmax, vec![normal(d, s)], 0);
                Sample::new(SoftmaxBackward, vec![y, normal(d, s)]).large_over(20_000)
            })
            .collect()
    }
    fn name(&self) -> &'static str {
        "softmax_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        check_x(inputs)?;
        super::expect_same(inputs[0], inputs[1], "y and its cotangent")?;
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        with_float!(io.out_ty(0).dtype, T => {
            let g = io.inplace::<T>(0, 1);
            if let Some(n) = row_len(io.out_ty(0)) {
                softmax_backward_rows(io.input::<T>(0), g, n);
            }
            Ok(())
        })
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        (name == "softmax_backward").then_some(Ok(SoftmaxBackward))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 1)]
    }
}

impl Builder {
    /// Softmax over the last axis of `x`.
    pub fn softmax(&mut self, x: ValueId) -> Result<ValueId> {
        self.push1(Softmax.into(), &[x])
    }
}
