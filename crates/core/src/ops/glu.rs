//! Gated MLP activations `h = act(gate) · up` as one op ([`Glu`]): SwiGLU
//! (`act` = SiLU, the LLaMA family's), GeGLU with the tanh approximation of
//! GELU (Gemma's) or exact GELU; their one-kernel backward
//! ([`GluBackward`]) and the [`Builder::swiglu`] and [`Builder::glu`]
//! helpers.
//!
//! Fusing the two pointwise ops removes `act(gate)` from the trace: the
//! unfused pair keeps it saved for the product's backward, so a layer held
//! four `[tokens, intermediate]` tensors (gate, up, act(gate), h) where this
//! op holds three (h stays while the down projection's backward needs it).
//! The backward needs only `gate`, `up` and the cotangent of `h`.
//!
//! Numerics: both kernels compute in the accumulator type (f32 for f32,
//! bf16 and f16; f64 for f64) and round each output once. `act(g)` and
//! `act′(g)` are [`UnaryFn::eval`] and [`UnaryFn::derivative`], written as
//! the unary op computes them, and:
//! - forward: `h = act(gate) · up`;
//! - backward: `dup = gh · act(gate)`, `dgate = (gh · up) · act′(gate)`.
//!
//! For SiLU that is `s = gate / (1 + exp(−gate))`, `h = s · up`, and
//! `σ = 1 / (1 + exp(−gate))`, `act′ = σ · (1 + gate · (1 − σ))`.
//!
//! In place: `h` may overwrite `gate` or `up`; `dgate` may overwrite `gate`
//! and `dup` may overwrite `up` (every element is read before it is written).

use super::sample::normal;
use super::{expect_float, expect_inputs, expect_same, no_vjp, Attrs, OpDef, Sample, VjpArgs};
use crate::error::Result;
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{par_chunks, Float, KernelIo, CHUNK};
use crate::ops::UnaryFn;
use crate::with_float;

/// The gate's activation of a gated MLP.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum GateFn {
    /// SwiGLU: `silu(gate) · up` (LLaMA, Qwen, Mistral, Phi, OLMo, the experts of mixtures).
    Silu,
    /// GeGLU with `gelu_pytorch_tanh` (Gemma 2 and 3).
    GeluTanh,
    /// GeGLU with exact (erf) GELU.
    GeluErf,
}

impl GateFn {
    /// Every gate function, in the order kernels are generated.
    pub const ALL: [GateFn; 3] = [GateFn::Silu, GateFn::GeluTanh, GateFn::GeluErf];

    /// The unary op computing the activation.
    pub fn unary(self) -> UnaryFn {
        match self {
            GateFn::Silu => UnaryFn::Silu,
            GateFn::GeluTanh => UnaryFn::GeluTanh,
            GateFn::GeluErf => UnaryFn::GeluErf,
        }
    }

    /// The forward op's name (`swiglu`, `geglu_tanh`, `geglu`), also its
    /// kernels' prefix; the backward's adds `_backward`.
    pub fn name(self) -> &'static str {
        match self {
            GateFn::Silu => "swiglu",
            GateFn::GeluTanh => "geglu_tanh",
            GateFn::GeluErf => "geglu",
        }
    }

    /// The backward op's name (and kernels' prefix).
    pub fn backward_name(self) -> &'static str {
        match self {
            GateFn::Silu => "swiglu_backward",
            GateFn::GeluTanh => "geglu_tanh_backward",
            GateFn::GeluErf => "geglu_backward",
        }
    }
}

/// `h = act(gate) · up`, elementwise over two tensors of one type.
#[derive(Clone, PartialEq, Debug)]
pub struct Glu {
    pub act: GateFn,
}

/// The cotangents of [`Glu`]'s inputs: `(dgate, dup)` from `(gate, up, gh)`.
#[derive(Clone, PartialEq, Debug)]
pub struct GluBackward {
    pub act: GateFn,
}

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

impl OpDef for Glu {
    fn name(&self) -> &'static str {
        self.act.name()
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        check(inputs, 2)?;
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(gh) = args.cotangents[0] else { return Ok(vec![None, None]) };
        let (gate, up) = (args.inputs[0], args.inputs[1]);
        let g = b.push(GluBackward { act: self.act }.into(), &[gate, up, gh])?;
        Ok(vec![Some(g[0]), Some(g[1])])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = io.out_ty(0).numel();
        let act = self.act.unary();
        with_float!(io.out_ty(0).dtype, T => {
            let (gate, up, h) = (io.input_ptr::<T>(0), io.input_ptr::<T>(1), io.output_ptr::<T>(0));
            par_chunks(n, CHUNK, |r| {
                for i in r {
                    // SAFETY: element i of both inputs is read before element i
                    // of the output (which may alias either) is written; chunks
                    // are disjoint.
                    unsafe {
                        let v = act.eval(gate.read(i).acc()) * up.read(i).acc();
                        h.write(i, T::from_acc(v))
                    }
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        GateFn::ALL
            .iter()
            .flat_map(|&act| {
                sample_shapes().map(move |s| Sample::new(Glu { act }, vec![normal(dtype, s), normal(dtype, s)]))
            })
            .collect()
    }
    /// Its kernels are element-wise, 16-byte packs where every operand is
    /// 16-byte aligned and single elements otherwise (generation's `up`
    /// part at one row, 8640 bf16 into its product's row, is read in place).
    fn reads_16_byte_aligned_inputs(&self) -> bool {
        true
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        GateFn::ALL.into_iter().find(|f| f.name() == name).map(|act| Ok(Glu { act }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0), (0, 1)]
    }
}

impl OpDef for GluBackward {
    fn name(&self) -> &'static str {
        self.act.backward_name()
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
        let act = self.act.unary();
        with_float!(io.out_ty(0).dtype, T => {
            let (gate, up, gh) = (io.input_ptr::<T>(0), io.input_ptr::<T>(1), io.input_ptr::<T>(2));
            let (dgate, dup) = (io.output_ptr::<T>(0), io.output_ptr::<T>(1));
            par_chunks(n, CHUNK, |r| {
                for i in r {
                    // SAFETY: element i of every input is read before element i
                    // of either output (each may alias its input) is written;
                    // chunks are disjoint.
                    unsafe {
                        let (g, u, d) = (gate.read(i).acc(), up.read(i).acc(), gh.read(i).acc());
                        dup.write(i, T::from_acc(d * act.eval(g)));
                        dgate.write(i, T::from_acc(d * u * act.derivative(g)));
                    }
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        GateFn::ALL
            .iter()
            .flat_map(|&act| {
                sample_shapes().map(move |s| {
                    Sample::new(GluBackward { act }, vec![normal(dtype, s), normal(dtype, s), normal(dtype, s)])
                })
            })
            .collect()
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        GateFn::ALL.into_iter().find(|f| f.backward_name() == name).map(|act| Ok(GluBackward { act }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0), (1, 1)]
    }
}

impl Builder {
    /// `silu(gate) · up` in one op (the LLaMA-family MLP activation).
    pub fn swiglu(&mut self, gate: ValueId, up: ValueId) -> Result<ValueId> {
        self.glu(GateFn::Silu, gate, up)
    }

    /// `act(gate) · up` in one op.
    pub fn glu(&mut self, act: GateFn, gate: ValueId, up: ValueId) -> Result<ValueId> {
        self.push1(Glu { act }.into(), &[gate, up])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{draw_sample, run_op, run_op_aliased};

    #[test]
    fn backward_over_gate_and_up_gives_the_same_bits() {
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
            for s in GluBackward::samples(dtype) {
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
            for node in c.step.nodes.iter().filter(|n| n.op == GluBackward { act: GateFn::Silu }.into()) {
                // Gate and up die here (the product's weight gradient ran
                // first), so their bytes take the two cotangents.
                assert_eq!(c.plan.slot(node.outputs[0]), c.plan.slot(node.inputs[0]));
                assert_eq!(c.plan.slot(node.outputs[1]), c.plan.slot(node.inputs[1]));
                seen += 1;
            }
            assert_eq!(seen, spec.config.n_layer);
        }
    }

    #[test]
    fn gemma_mlps_run_one_geglu_op_each_way() {
        use crate::autodiff::StepKind;
        use crate::models::{Config, LossKind, ModelSpec};
        use crate::ops::Op;
        use crate::pipeline::{compile_step, StepOptions};
        // Gemma 3's geometry cut to 2 layers and a small vocabulary.
        let config =
            Config { n_layer: 2, vocab_size: 512, padded_vocab_size: 512, ..Config::named("gemma-3-1b").unwrap() };
        let spec = ModelSpec {
            config,
            batch: 1,
            seq: 32,
            dtype: DType::BF16,
            loss: LossKind::CrossEntropy,
            adapters: None,
            documents: false,
        };
        let c = compile_step(&spec, &StepOptions::unoptimized(StepKind::Grads)).unwrap();
        let count = |op: Op| c.step.nodes.iter().filter(|n| n.op == op).count();
        assert_eq!(count(Glu { act: GateFn::GeluTanh }.into()), 2);
        assert_eq!(count(GluBackward { act: GateFn::GeluTanh }.into()), 2);
        // No unfused GELU is left to save its output for backward.
        assert!(!c.step.nodes.iter().any(|n| matches!(&n.op, Op::Unary(u) if u.f == UnaryFn::GeluTanh)));
        assert_eq!(Glu { act: GateFn::GeluTanh }.name(), "geglu_tanh");
    }
}
