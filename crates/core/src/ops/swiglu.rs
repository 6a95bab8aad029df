//! The LLaMA-family MLP activation `h = silu(gate) · up` as one op
//! ([`SwiGlu`]), its one-kernel backward ([`SwiGluBackward`]) and the
//! [`Builder::swiglu`] helper.
//!
//! Fusing the two pointwise ops removes `silu(gate)` from the trace: the
//! unfused pair keeps it saved for the product's backward, so a layer held
//! four `[tokens, intermediate]` tensors (gate, up, silu(gate), h) where this
//! op holds three (h stays while the down projection's backward needs it).
//! The backward needs only `gate`, `up` and the cotangent of `h`.
//!
//! Numerics: both kernels compute in the accumulator type (f32 for f32,
//! bf16 and f16; f64 for f64) and round each output once, in this order:
//! - forward: `s = gate / (1 + exp(−gate))`, `h = s · up`;
//! - backward: `σ = 1 / (1 + exp(−gate))`, `s = gate / (1 + exp(−gate))`,
//!   `d = σ · (1 + gate · (1 − σ))` (silu′), `dup = gh · s`,
//!   `dgate = (gh · up) · d`.
//!
//! In place: `h` may overwrite `gate` or `up`; `dgate` may overwrite `gate`
//! and `dup` may overwrite `up` (every element is read before it is written).

use super::sample::normal;
use super::{expect_float, expect_inputs, expect_same, no_vjp, Attrs, OpDef, Sample, VjpArgs};
use crate::error::Result;
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{c, par_chunks, Float, KernelIo, CHUNK};
use crate::with_float;

/// `h = silu(gate) · up`, elementwise over two tensors of one type.
#[derive(Clone, PartialEq, Debug)]
pub struct SwiGlu;

/// The cotangents of [`SwiGlu`]'s inputs: `(dgate, dup)` from `(gate, up, gh)`.
#[derive(Clone, PartialEq, Debug)]
pub struct SwiGluBackward;

fn check(inputs: &[&TensorType], n: usize) -> std::result::Result<(), String> {
    expect_inputs(inputs, n)?;
    expect_float(inputs[0], "gate")?;
    expect_same(inputs[0], inputs[1], "gate and up")?;
    if n == 3 {
        expect_same(inputs[0], inputs[2], "gate and the cotangent of h")?;
    }
    Ok(())
}

/// Sample shapes: a scalar, odd lengths, and the `[batch, tokens, width]` of a model.
fn sample_shapes() -> [&'static [usize]; 5] {
    [&[], &[1], &[17], &[3, 5, 7], &[2, 4, 64]]
}

/// `silu(g)` written as the forward computes it.
fn silu<A: num_traits::Float + num_traits::FromPrimitive>(g: A) -> A {
    g / (A::one() + (-g).exp())
}

impl OpDef for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        check(inputs, 2)?;
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(gh) = args.cotangents[0] else { return Ok(vec![None, None]) };
        let (gate, up) = (args.inputs[0], args.inputs[1]);
        let g = b.push(SwiGluBackward.into(), &[gate, up, gh])?;
        Ok(vec![Some(g[0]), Some(g[1])])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = io.out_ty(0).numel();
        with_float!(io.out_ty(0).dtype, T => {
            let (gate, up, h) = (io.input_ptr::<T>(0), io.input_ptr::<T>(1), io.output_ptr::<T>(0));
            par_chunks(n, CHUNK, |r| {
                for i in r {
                    // SAFETY: element i of both inputs is read before element i
                    // of the output (which may alias either) is written; chunks
                    // are disjoint.
                    unsafe {
                        let v = silu(gate.read(i).acc()) * up.read(i).acc();
                        h.write(i, T::from_acc(v))
                    }
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        sample_shapes().iter().map(|s| Sample::new(SwiGlu, vec![normal(dtype, s), normal(dtype, s)])).collect()
    }
    /// Its kernels are element-wise, 16-byte packs where every operand is
    /// 16-byte aligned and single elements otherwise (generation's `up`
    /// part at one row, 8640 bf16 into its product's row, is read in place).
    fn reads_16_byte_aligned_inputs(&self) -> bool {
        true
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        (name == "swiglu").then_some(Ok(SwiGlu))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0), (0, 1)]
    }
}

impl OpDef for SwiGluBackward {
    fn name(&self) -> &'static str {
        "swiglu_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        check(inputs, 3)?;
        Ok(vec![inputs[0].clone(), inputs[0].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = io.out_ty(0).numel();
        with_float!(io.out_ty(0).dtype, T => {
            let (gate, up, gh) = (io.input_ptr::<T>(0), io.input_ptr::<T>(1), io.input_ptr::<T>(2));
            let (dgate, dup) = (io.output_ptr::<T>(0), io.output_ptr::<T>(1));
            par_chunks(n, CHUNK, |r| {
                let one: <T as Float>::Acc = c(1.0);
                for i in r {
                    // SAFETY: element i of every input is read before element i
                    // of either output (each may alias its input) is written;
                    // chunks are disjoint.
                    unsafe {
                        let (g, u, d) = (gate.read(i).acc(), up.read(i).acc(), gh.read(i).acc());
                        let sig = one / (one + (-g).exp());
                        let dsilu = sig * (one + g * (one - sig));
                        dup.write(i, T::from_acc(d * silu(g)));
                        dgate.write(i, T::from_acc(d * u * dsilu));
                    }
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        sample_shapes()
            .iter()
            .map(|s| Sample::new(SwiGluBackward, vec![normal(dtype, s), normal(dtype, s), normal(dtype, s)]))
            .collect()
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        (name == "swiglu_backward").then_some(Ok(SwiGluBackward))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0), (1, 1)]
    }
}

impl Builder {
    /// `silu(gate) · up` in one op (the LLaMA-family MLP activation).
    pub fn swiglu(&mut self, gate: ValueId, up: ValueId) -> Result<ValueId> {
        self.push1(SwiGlu.into(), &[gate, up])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{draw_sample, run_op, run_op_aliased};

    #[test]
    fn backward_over_gate_and_up_gives_the_same_bits() {
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
            for s in SwiGluBackward::samples(dtype) {
                let x = draw_sample(&s, 5).unwrap();
                let plain = run_op(&s.op, &x).unwrap();
                // dgate written over gate and dup over up, element by element.
                let aliased = run_op_aliased(&s.op, &x).unwrap();
                for (k, (p, a)) in plain.iter().zip(&aliased).enumerate() {
                    assert_eq!(p.bytes(), a.bytes(), "{dtype} {:?}: output {k}", x[0].ty);
                }
            }
        }
    }

    #[test]
    fn a_planned_step_runs_the_backward_over_gate_and_up() {
        use crate::autodiff::StepKind;
        use crate::models::{LossKind, ModelSpec};
        use crate::pipeline::{compile_step, StepOptions};
        let spec = ModelSpec::named("tiny-llama", 2, 64, DType::BF16, LossKind::CrossEntropy).unwrap();
        for opts in [StepOptions::new(StepKind::Grads), StepOptions::unoptimized(StepKind::Grads)] {
            let c = compile_step(&spec, &opts).unwrap();
            let mut seen = 0;
            for node in c.step.nodes.iter().filter(|n| n.op == SwiGluBackward.into()) {
                // Gate and up die here (the product's weight gradient ran
                // first), so their bytes take the two cotangents.
                assert_eq!(c.plan.slot(node.outputs[0]), c.plan.slot(node.inputs[0]));
                assert_eq!(c.plan.slot(node.outputs[1]), c.plan.slot(node.inputs[1]));
                seen += 1;
            }
            assert_eq!(seen, spec.config.n_layer);
        }
    }
}
