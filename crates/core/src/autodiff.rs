//! Reverse-mode differentiation: forward trace → step trace.
//!
//! Three step kinds share one path. `forward` is the forward trace itself.
//! `grads` seeds the scalar loss with 1, walks the forward nodes in reverse
//! calling each op's VJP rule, accumulates cotangents by addition, and
//! outputs one gradient per parameter. `train` then appends an AdamW update
//! per parameter, whose moments are optimizer state leaves and whose learning
//! rate and step count are step inputs, so one compiled step serves every
//! iteration.
//!
//! **Invariant:** gradients are step outputs computed into the arena, never
//! persistent state; under `train` they are consumed by the optimizer and die
//! there. Forward values read by backward nodes are recorded in
//! [`Trace::saved`].

use crate::error::{Error, Result};
use crate::ir::{Builder, DType, OutputKind, Phase, TensorType, Trace, ValueId};
use crate::ops::optim::AdamW;
use crate::ops::VjpArgs;
use crate::passes;

/// What one step computes.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum StepKind {
    /// Forward only (inference), outputs the loss.
    Forward,
    /// Forward and backward; outputs the loss and one gradient per parameter.
    Grads,
    /// Forward, backward and an AdamW update of every parameter.
    Train,
}

impl StepKind {
    pub fn name(self) -> &'static str {
        match self {
            StepKind::Forward => "forward",
            StepKind::Grads => "grads",
            StepKind::Train => "train",
        }
    }

    pub fn parse(s: &str) -> Option<StepKind> {
        [StepKind::Forward, StepKind::Grads, StepKind::Train].into_iter().find(|k| k.name() == s)
    }
}

/// Optimizer settings for [`StepKind::Train`].
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TrainOptions {
    pub adamw: AdamW,
    /// dtype of the AdamW moments; `None` chooses [`default_state_dtype`].
    pub state_dtype: Option<DType>,
}

/// The dtype of the AdamW moments of a `param` parameter when none is asked
/// for: float32 for float16 parameters, the parameter's own dtype otherwise.
///
/// float16 cannot hold the second moment: `(1-β2)·g²` is below its smallest
/// subnormal (6e-8) for any gradient under about 8e-3, so `v` rounds to zero
/// and the update `m/(√v+ε)` explodes (PyTorch AMP keeps float32 master state
/// for the same reason). bfloat16 has float32's range, so its moments keep
/// the parameter dtype, as PyTorch does for bf16 parameters.
pub fn default_state_dtype(param: DType) -> DType {
    match param {
        DType::F16 => DType::F32,
        other => other,
    }
}

/// Names of the step inputs that `train` adds.
pub const LR_INPUT: &str = "lr";
pub const STEP_INPUT: &str = "step";

/// Builds the step trace of `kind` from a forward trace that outputs a scalar loss.
pub fn build_step(forward: &Trace, kind: StepKind, opts: &TrainOptions) -> Result<Trace> {
    if kind == StepKind::Forward {
        let mut t = forward.clone();
        t.name = kind.name().into();
        return Ok(t);
    }
    let loss = forward
        .loss()
        .ok_or_else(|| Error::Autodiff(format!("trace `{}` has no loss output to differentiate", forward.name)))?;
    if !forward.ty(loss).dtype.is_float() || forward.ty(loss).numel() != 1 {
        return Err(Error::Autodiff(format!("the loss must be a float scalar, got {}", forward.ty(loss))));
    }
    let n_forward = forward.nodes.len();
    let mut fwd = forward.clone();
    fwd.name = kind.name().into();
    // Outputs other than the loss (logits of an inference trace) are not part of a training step.
    fwd.outputs.retain(|o| o.kind == OutputKind::Loss);
    let mut b = Builder::from_trace(fwd);
    b.set_phase(Phase::Backward);

    let mut ct: Vec<Option<ValueId>> = vec![None; b.trace().values.len()];
    let seed = b.full(1.0, b.ty(loss).clone())?;
    ct[loss.index()] = Some(seed);
    for ni in (0..n_forward).rev() {
        let node = b.trace().nodes[ni].clone();
        let cts: Vec<Option<ValueId>> = node.outputs.iter().map(|o| ct.get(o.index()).copied().flatten()).collect();
        if cts.iter().all(Option::is_none) {
            continue;
        }
        let grads = node.op.vjp(&mut b, &VjpArgs { inputs: &node.inputs, outputs: &node.outputs, cotangents: &cts })?;
        if grads.len() != node.inputs.len() {
            return Err(Error::Autodiff(format!(
                "VJP of `{}` returned {} cotangents for {} inputs",
                node.op.name(),
                grads.len(),
                node.inputs.len()
            )));
        }
        for (&x, g) in node.inputs.iter().zip(grads) {
            let Some(g) = g else { continue };
            if b.ty(g) != b.ty(x) {
                return Err(Error::Autodiff(format!(
                    "VJP of `{}` gives {x} a cotangent of type {}, expected {}",
                    node.op.name(),
                    b.ty(g),
                    b.ty(x)
                )));
            }
            if ct.len() < b.trace().values.len() {
                ct.resize(b.trace().values.len(), None);
            }
            ct[x.index()] = Some(match ct[x.index()] {
                Some(prev) => b.add(prev, g)?,
                None => g,
            });
        }
    }
    ct.resize(b.trace().values.len(), None);

    let params: Vec<ValueId> = b.trace().params().collect();
    let mut grads = Vec::with_capacity(params.len());
    for &p in &params {
        let g = match ct[p.index()] {
            Some(g) => g,
            // A parameter the loss does not depend on still gets a (zero) gradient.
            None => b.full(0.0, b.ty(p).clone())?,
        };
        grads.push(g);
    }

    match kind {
        StepKind::Grads => {
            for (&p, &g) in params.iter().zip(&grads) {
                b.output(OutputKind::Grad(p), g);
            }
        }
        StepKind::Train => {
            b.set_phase(Phase::Optimizer);
            let lr = b.input(LR_INPUT, TensorType::scalar(DType::F32))?;
            let step = b.input(STEP_INPUT, TensorType::scalar(DType::F32))?;
            for (&p, &g) in params.iter().zip(&grads) {
                let name = b.trace().value(p).kind.leaf_name().unwrap_or_default().to_string();
                let sty = b.ty(p).with_dtype(opts.state_dtype.unwrap_or(default_state_dtype(b.dtype(p))));
                let m = b.state(&format!("{name}.exp_avg"), sty.clone())?;
                let v = b.state(&format!("{name}.exp_avg_sq"), sty)?;
                let (p2, m2, v2) = b.adamw(p, g, m, v, lr, step, &opts.adamw)?;
                b.update(p, p2);
                b.update(m, m2);
                b.update(v, v2);
            }
        }
        StepKind::Forward => unreachable!("handled above"),
    }
    let trace = b.finish("autodiff")?;
    passes::dce(&trace)
}
