//! Reverse-mode differentiation: forward trace → step trace.
//!
//! Three step kinds share one path. `forward` is the forward trace itself.
//! `grads` seeds the scalar loss with 1, walks the forward nodes in reverse
//! calling each op's VJP rule, accumulates cotangents by addition, and
//! outputs one gradient per parameter. `train` then appends an AdamW update
//! per parameter, whose moments (and, for bf16/f16 parameters, master state:
//! [`TrainOptions::master_weights`]) are optimizer state leaves and whose
//! learning rate and step count are step inputs, so one compiled step
//! serves every iteration.
//!
//! A train step may also clip the global gradient norm before its updates
//! ([`TrainOptions::clip_grad_norm`], in the optimizer phase, the norm a
//! named output), and leave norms, biases and embeddings undecayed
//! ([`DecayScope`]). [`build_accumulated_step`] runs several micro-batches'
//! forward and backward passes in one step, accumulating each gradient
//! before the one update.
//!
//! **Invariant:** gradients are step outputs computed into the arena, never
//! persistent state; under `train` they are consumed by the optimizer and die
//! there. Forward values read by backward nodes are recorded in
//! [`Trace::saved`].

use crate::error::{Error, Result};
use crate::ir::{Builder, DType, OutputKind, Phase, TensorType, Trace, ValueId, ValueKind};
use crate::ops::adamw8;
use crate::ops::optim::{AdamW, MasterWeights};
use crate::ops::reduce::ReduceKind;
use crate::ops::{Op, VjpArgs};
use crate::passes;

/// What one step computes.
#[derive(Copy, Clone, PartialEq, Eq, Debug, serde::Serialize)]
#[serde(rename_all = "snake_case")]
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
#[derive(Clone, Debug, PartialEq, Default, serde::Serialize)]
pub struct TrainOptions {
    /// The AdamW hyperparameters; their `master` is set per parameter from
    /// [`TrainOptions::master_weights`].
    pub adamw: AdamW,
    /// dtype of the AdamW moments; `None` chooses [`default_state_dtype`].
    /// Unused with [`TrainOptions::moments_8bit`].
    pub state_dtype: Option<DType>,
    /// With `clip_grad_norm`: clip by the previous step's norm
    /// ([`clip_by_previous_norm`]) rather than this step's, so that every
    /// update can run inside backward.
    pub clip_by_previous_norm: bool,
    /// Keep the moments in 8 bits with a scale per 2048 elements
    /// ([`crate::ops::adamw8::AdamW8bit`]): 2 bytes a weight instead of 8
    /// (f32 moments). f64 parameters keep dense moments.
    pub moments_8bit: bool,
    /// Clip the global gradient norm to this value before the update, as
    /// PyTorch's `clip_grad_norm_(params, max_norm)` (see [`clip_by_global_norm`]);
    /// `None` does not clip. The step then outputs the norm as [`GRAD_NORM_OUTPUT`].
    pub clip_grad_norm: Option<f64>,
    /// Which parameters `adamw.weight_decay` applies to.
    pub decay: DecayScope,
    /// What bf16 and f16 parameters keep so that updates below half a unit
    /// in their last place are not rounded away: an f32 master copy
    /// (`<param>.master`), a compensation of the parameter's dtype
    /// (`<param>.compensation`), or nothing. Both are optimizer state, saved
    /// and resumed with the moments. f32 and f64 parameters keep nothing.
    pub master_weights: MasterWeights,
}

/// A parameter's AdamW moments as state leaves: dense, or each as its
/// 8-bit codes and per-block scales.
enum Moments {
    Dense(ValueId, ValueId),
    Blockwise8((ValueId, ValueId), (ValueId, ValueId)),
}

/// Which parameters AdamW's weight decay applies to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayScope {
    /// Every parameter: `torch.optim.AdamW(model.parameters())`.
    #[default]
    All,
    /// Not the norm weights and biases (the parameters of one axis), as the
    /// Hugging Face `Trainer`, Megatron-LM and nanoGPT group them, nor the
    /// embedding tables (those an `embedding` op gathers from, a tied LM
    /// head included), as OLMo does (`decay_embeddings: false`): decay
    /// shrinks weights towards 0, which for a norm's gain or a bias is a
    /// pull towards another function, not a smaller one, and for an
    /// embedding row a pull that grows with how rarely its token is seen.
    Matrices,
}

/// The named output of a train step that clips: the global gradient norm
/// before clipping (what `clip_grad_norm_` returns).
pub const GRAD_NORM_OUTPUT: &str = "grad_norm";

/// The named output of a mixture-of-experts model whose training loss
/// includes the load-balancing loss: that loss before its weight. A step
/// keeps it (the mean over micro-batches), for the metrics.
pub const ROUTER_AUX_LOSS_OUTPUT: &str = "router_aux_loss";

/// The named output of a mixture-of-experts model trained with a router
/// z-loss: that loss before its weight, kept by steps as
/// [`ROUTER_AUX_LOSS_OUTPUT`] is.
pub const ROUTER_Z_LOSS_OUTPUT: &str = "router_z_loss";

/// Whether `kind` is an output a gradient or train step keeps from its forward trace.
fn kept_in_steps(kind: &OutputKind) -> bool {
    match kind {
        OutputKind::Loss => true,
        OutputKind::Named(n) => n == ROUTER_AUX_LOSS_OUTPUT || n == ROUTER_Z_LOSS_OUTPUT,
        _ => false,
    }
}

/// The state leaf of a step that clips by the previous step's norm
/// ([`clip_by_previous_norm`]): that norm, which the caller writes after
/// each step from the step's [`GRAD_NORM_OUTPUT`].
pub const PREVIOUS_GRAD_NORM_STATE: &str = "grad_norm.previous";

/// Added to the norm before dividing, as PyTorch's `clip_grad_norm_` does.
pub const CLIP_EPS: f64 = 1e-6;

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
    build_accumulated_step(forward, kind, opts, 1)
}

/// [`build_step`] with `micro_batches` micro-batches of gradient
/// accumulation inside the one step: every step input gets `micro_batches`
/// times the forward trace's rows (micro-batch `k` is rows
/// `[k·B, (k+1)·B)`), the forward and backward passes run once per
/// micro-batch in turn, each parameter's gradient is the sum of the
/// micro-batches' (added into one accumulator as each is final), the loss
/// is their mean, and a train step then updates once.
///
/// Each micro-batch's backward is seeded with `1/micro_batches`, so the
/// gradient is that of the mean of the micro-batches' mean losses: the
/// gradient of the whole batch when every micro-batch counts the same
/// number of targets (always, without ignored targets), and otherwise the
/// mean of per-micro-batch means, as data-parallel ranks combine theirs
/// ([`crate::dist`]). Only one micro-batch's activations are live at a time.
///
/// Phases stay in order: the first micro-batch's forward is the forward
/// phase; later micro-batches' forward nodes run inside backward and are
/// labelled backward.
pub fn build_accumulated_step(
    forward: &Trace,
    kind: StepKind,
    opts: &TrainOptions,
    micro_batches: usize,
) -> Result<Trace> {
    if micro_batches == 0 {
        return Err(Error::Autodiff("gradient accumulation needs at least 1 micro-batch, got 0".into()));
    }
    if kind == StepKind::Forward {
        if micro_batches > 1 {
            return Err(Error::Autodiff(format!(
                "a forward step accumulates no gradients: build it with 1 micro-batch, not {micro_batches}"
            )));
        }
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
    let (mut b, grads) = if micro_batches == 1 {
        let n_forward = forward.nodes.len();
        let mut fwd = forward.clone();
        fwd.name = kind.name().into();
        // Outputs other than the loss and the load-balancing loss (logits of
        // an inference trace) are not part of a training step.
        fwd.outputs.retain(|o| kept_in_steps(&o.kind));
        let mut b = Builder::from_trace(fwd);
        b.set_phase(Phase::Backward);
        let seed = b.full(1.0, b.ty(loss).clone())?;
        let nodes: Vec<usize> = (0..n_forward).collect();
        let ct = backprop(&mut b, &nodes, loss, seed)?;
        let params: Vec<ValueId> = b.trace().params().collect();
        let grads: Vec<Option<ValueId>> = params.iter().map(|p| ct.get(p.index()).copied().flatten()).collect();
        (b, grads)
    } else {
        accumulate(forward, kind, micro_batches, loss)?
    };

    let params: Vec<ValueId> = b.trace().params().collect();
    let mut grad_values = Vec::with_capacity(params.len());
    for (&p, g) in params.iter().zip(grads) {
        let g = match g {
            Some(g) => g,
            // A parameter the loss does not depend on still gets a (zero) gradient.
            None => b.full(0.0, b.ty(p).clone())?,
        };
        grad_values.push(g);
    }
    let grads = grad_values;

    match kind {
        StepKind::Grads => {
            for (&p, &g) in params.iter().zip(&grads) {
                b.output(OutputKind::Grad(p), g);
            }
        }
        StepKind::Train => {
            b.set_phase(Phase::Optimizer);
            let grads = match opts.clip_grad_norm {
                Some(max_norm) => {
                    let clip = if opts.clip_by_previous_norm { clip_by_previous_norm } else { clip_by_global_norm };
                    let (clipped, norm) = clip(&mut b, &grads, max_norm)?;
                    b.output(OutputKind::Named(GRAD_NORM_OUTPUT.into()), norm);
                    clipped
                }
                None => grads,
            };
            let no_decay = match opts.decay {
                DecayScope::All => Vec::new(),
                DecayScope::Matrices => undecayed_params(b.trace()),
            };
            let lr = b.input(LR_INPUT, TensorType::scalar(DType::F32))?;
            // The forward pass may read the step count already (adapter dropout).
            let step = match b.trace().leaf_by_name(STEP_INPUT) {
                Some(step) => step,
                None => b.input(STEP_INPUT, TensorType::scalar(DType::F32))?,
            };
            for (&p, &g) in params.iter().zip(&grads) {
                let name = b.trace().value(p).kind.leaf_name().unwrap_or_default().to_string();
                // The moments first (then the master state): dense, or
                // each as its 8-bit codes and per-block scales.
                let moments = if opts.moments_8bit && b.dtype(p) != DType::F64 {
                    let (codes, scales) = adamw8::state_types(b.ty(p));
                    let mut moment = |which: &str| -> Result<(ValueId, ValueId)> {
                        let c = b.state(&format!("{name}.{which}.{}", adamw8::CODES_SUFFIX), codes.clone())?;
                        let s = b.state(&format!("{name}.{which}.{}", adamw8::ABSMAX_SUFFIX), scales.clone())?;
                        Ok((c, s))
                    };
                    Moments::Blockwise8(moment("exp_avg")?, moment("exp_avg_sq")?)
                } else {
                    let sty = b.ty(p).with_dtype(opts.state_dtype.unwrap_or(default_state_dtype(b.dtype(p))));
                    let m = b.state(&format!("{name}.exp_avg"), sty.clone())?;
                    let v = b.state(&format!("{name}.exp_avg_sq"), sty)?;
                    Moments::Dense(m, v)
                };
                let master = opts.master_weights.for_param(b.dtype(p));
                let w = match (master.state_suffix(), master.state_dtype(b.dtype(p))) {
                    (Some(suffix), Some(dtype)) => {
                        Some(b.state(&format!("{name}.{suffix}"), b.ty(p).with_dtype(dtype))?)
                    }
                    _ => None,
                };
                let weight_decay = if no_decay.contains(&p) { 0.0 } else { opts.adamw.weight_decay };
                let hyper = AdamW { weight_decay, master, ..opts.adamw.clone() };
                let w2 = match moments {
                    Moments::Dense(m, v) => {
                        let (p2, m2, v2, w2) = b.adamw(p, g, m, v, lr, step, w, &hyper)?;
                        b.update(p, p2);
                        b.update(m, m2);
                        b.update(v, v2);
                        w2
                    }
                    Moments::Blockwise8(m, v) => {
                        let (p2, m2, v2, w2) = b.adamw_8bit(p, g, m, v, lr, step, w, &hyper)?;
                        b.update(p, p2);
                        for (old, new) in [(m.0, m2.0), (m.1, m2.1), (v.0, v2.0), (v.1, v2.1)] {
                            b.update(old, new);
                        }
                        w2
                    }
                };
                if let (Some(w), Some(w2)) = (w, w2) {
                    b.update(w, w2);
                }
            }
        }
        StepKind::Forward => unreachable!("handled above"),
    }
    let trace = b.finish("autodiff")?;
    let trace = passes::dce(&trace)?;
    // A frozen head's weight gradient is dead once nothing reads it, but
    // the fused loss's backward makes it beside the input gradient: off.
    Ok(crate::ops::linear_ce::skip_unread_weight_gradients(&trace).0)
}

/// Reverse-mode over the nodes `nodes` (indices into the builder's trace,
/// in forward order), from `loss` seeded with `seed`: the cotangent of
/// every value, indexed by value id, summed where several flow in.
fn backprop(b: &mut Builder, nodes: &[usize], loss: ValueId, seed: ValueId) -> Result<Vec<Option<ValueId>>> {
    let mut ct: Vec<Option<ValueId>> = vec![None; b.trace().values.len()];
    ct[loss.index()] = Some(seed);
    for &ni in nodes.iter().rev() {
        let node = b.trace().nodes[ni].clone();
        let cts: Vec<Option<ValueId>> = node.outputs.iter().map(|o| ct.get(o.index()).copied().flatten()).collect();
        if cts.iter().all(Option::is_none) {
            continue;
        }
        let grads = node.op.vjp(b, &VjpArgs { inputs: &node.inputs, outputs: &node.outputs, cotangents: &cts })?;
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
    Ok(ct)
}

/// The forward and backward passes of `micro_batches` micro-batches (see
/// [`build_accumulated_step`]): the builder, with the mean loss as its loss
/// output, and each parameter's accumulated gradient (in `params()` order; `None` where no
/// micro-batch's loss depends on it).
fn accumulate(
    forward: &Trace,
    kind: StepKind,
    micro_batches: usize,
    loss: ValueId,
) -> Result<(Builder, Vec<Option<ValueId>>)> {
    let mut b = Builder::new(kind.name());
    // The leaves: parameters as they are, step inputs with every micro-batch's rows.
    let mut leaf = vec![None; forward.values.len()];
    for v in forward.leaves() {
        let val = forward.value(v);
        let name = val.kind.leaf_name().expect("a leaf");
        leaf[v.index()] = Some(match &val.kind {
            // A scalar input (the step count adapter dropout reads) is
            // the step's, shared by every micro-batch.
            ValueKind::Input { .. } if val.ty.rank() == 0 => b.input(name, val.ty.clone())?,
            ValueKind::Input { .. } => {
                let mut shape = val.ty.shape.clone();
                shape[0] *= micro_batches;
                b.input(name, val.ty.with_shape(shape))?
            }
            ValueKind::Param { .. } => b.param(name, val.ty.clone())?,
            ValueKind::Frozen { .. } => b.frozen(name, val.ty.clone())?,
            ValueKind::State { .. } => b.state(name, val.ty.clone())?,
            ValueKind::Node(_) => unreachable!("leaves only"),
        });
    }
    let params: Vec<ValueId> = forward.params().collect();
    let mut acc: Vec<Option<ValueId>> = vec![None; params.len()];
    let mut total: Option<ValueId> = None;
    // The router losses a step reports, each the mean over micro-batches.
    let reported: Vec<(OutputKind, ValueId)> = forward
        .outputs
        .iter()
        .filter(|o| kept_in_steps(&o.kind) && o.kind != OutputKind::Loss)
        .map(|o| (o.kind.clone(), o.value))
        .collect();
    let mut reported_totals: Vec<Option<ValueId>> = vec![None; reported.len()];
    let weight = 1.0 / micro_batches as f64;
    for k in 0..micro_batches {
        b.set_phase(if k == 0 { Phase::Forward } else { Phase::Backward });
        let mut map = leaf.clone();
        for v in forward.inputs().filter(|&v| forward.ty(v).rank() > 0) {
            let rows = forward.ty(v).shape[0];
            let all = leaf[v.index()].expect("every leaf is mapped");
            map[v.index()] = Some(b.slice(all, 0, k * rows, (k + 1) * rows)?);
        }
        let first = b.trace().nodes.len();
        for node in &forward.nodes {
            let inputs: Vec<ValueId> =
                node.inputs.iter().map(|&v| map[v.index()].expect("defined before use")).collect();
            for (&o, n) in node.outputs.iter().zip(b.push(for_micro_batch(&node.op, k)?, &inputs)?) {
                map[o.index()] = Some(n);
            }
        }
        let nodes: Vec<usize> = (first..b.trace().nodes.len()).collect();
        let loss_k = map[loss.index()].expect("the loss is computed");
        b.set_phase(Phase::Backward);
        let seed = b.full(weight, b.ty(loss_k).clone())?;
        let ct = backprop(&mut b, &nodes, loss_k, seed)?;
        for (a, &p) in acc.iter_mut().zip(&params) {
            let p = leaf[p.index()].expect("parameters are leaves");
            if let Some(g) = ct.get(p.index()).copied().flatten() {
                *a = Some(match *a {
                    Some(prev) => b.add(prev, g)?,
                    None => g,
                });
            }
        }
        total = Some(match total {
            Some(t) => b.add(t, loss_k)?,
            None => loss_k,
        });
        for ((_, a), t) in reported.iter().zip(&mut reported_totals) {
            let a_k = map[a.index()].expect("computed with the loss");
            *t = Some(match *t {
                Some(prev) => b.add(prev, a_k)?,
                None => a_k,
            });
        }
    }
    let total = total.expect("at least one micro-batch");
    let w = b.full(weight, b.ty(total).clone())?;
    let mean = b.mul(total, w)?;
    b.output(OutputKind::Loss, mean);
    for ((kind, _), t) in reported.into_iter().zip(reported_totals) {
        let t = t.expect("every micro-batch computes it");
        let w = b.full(weight, b.ty(t).clone())?;
        let mean = b.mul(t, w)?;
        b.output(kind, mean);
    }
    // `params()` of the new trace lists the parameters in the forward's order.
    Ok((b, acc))
}

/// `op` as micro-batch `k` of [`accumulate`] runs it: a dropout draws that
/// micro-batch's own mask (its backward, built from the copy, the same one).
fn for_micro_batch(op: &Op, k: usize) -> Result<Op> {
    Ok(match op {
        Op::Dropout(d) => {
            let micro_batch = u32::try_from(k)
                .map_err(|_| Error::Autodiff(format!("dropout numbers micro-batches in 32 bits, not {k}")))?;
            Op::Dropout(crate::ops::dropout::Dropout { micro_batch, ..d.clone() })
        }
        op => op.clone(),
    })
}

/// Scales `grads` so that their global L2 norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_`: `norm = sqrt(Σ‖g‖²)` (each square
/// summed in f32, f64 for f64 gradients), `g ← g · min(1, max_norm / (norm +
/// 1e-6))`. Returns the scaled gradients (each `mul(g, scale)`, the
/// gradient as input 0, which [`crate::dist::gradient_order`] relies on)
/// and the norm before clipping. Every update now reads every gradient
/// (through the norm), so none can run before backward ends
/// ([`crate::passes::optimizer_placement`] reports it).
pub fn clip_by_global_norm(b: &mut Builder, grads: &[ValueId], max_norm: f64) -> Result<(Vec<ValueId>, ValueId)> {
    check_max_norm(max_norm)?;
    let acc_dtype = norm_dtype(b, grads);
    let mut total: Option<ValueId> = None;
    let mut dtypes: Vec<DType> = Vec::new();
    for &g in grads {
        if !dtypes.contains(&b.dtype(g)) {
            dtypes.push(b.dtype(g));
        }
    }
    for d in dtypes {
        // The squared norms of all gradients of one dtype in one op (a few
        // multi-tensor launches on the GPU, reading each gradient once in
        // the wide type, no widened copy), then their sum.
        let group: Vec<ValueId> = grads.iter().copied().filter(|&g| b.dtype(g) == d).collect();
        let s = sum_of_squares(b, &group, acc_dtype)?;
        total = Some(match total {
            Some(t) => b.add(t, s)?,
            None => s,
        });
    }
    let norm = norm_of(b, total, acc_dtype)?;
    let scaled = scale_by_clip_factor(b, grads, norm, max_norm)?;
    Ok((scaled, norm))
}

/// Clipping by the previous step's norm, an explicit approximation of
/// [`clip_by_global_norm`]: `g ← g · min(1, max_norm / (previous + 1e-6))`
/// with `previous` the state leaf [`PREVIOUS_GRAD_NORM_STATE`] (the norm of
/// the step before, which the caller writes after each step from the
/// step's [`GRAD_NORM_OUTPUT`]; zero, no clipping, before the first). No
/// update waits for this step's norm, so each can run inside backward and
/// free its gradient at once; this step's norm is summed from each
/// gradient's own squared norm as backward makes it. Returns the scaled
/// gradients and this step's norm.
pub fn clip_by_previous_norm(b: &mut Builder, grads: &[ValueId], max_norm: f64) -> Result<(Vec<ValueId>, ValueId)> {
    check_max_norm(max_norm)?;
    let acc_dtype = norm_dtype(b, grads);
    let previous = b.state(PREVIOUS_GRAD_NORM_STATE, TensorType::scalar(acc_dtype))?;
    let scaled = scale_by_clip_factor(b, grads, previous, max_norm)?;
    let mut total: Option<ValueId> = None;
    for &g in grads {
        let s = sum_of_squares(b, &[g], acc_dtype)?;
        total = Some(match total {
            Some(t) => b.add(t, s)?,
            None => s,
        });
    }
    let norm = norm_of(b, total, acc_dtype)?;
    Ok((scaled, norm))
}

fn check_max_norm(max_norm: f64) -> Result<()> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::Autodiff(format!(
            "the gradient norm to clip to must be positive and finite, got {max_norm}"
        )));
    }
    Ok(())
}

/// The dtype a gradient norm is summed in: f32, or f64 with f64 gradients.
fn norm_dtype(b: &Builder, grads: &[ValueId]) -> DType {
    let wide = |d: DType| if d == DType::F64 { DType::F64 } else { DType::F32 };
    grads.iter().map(|&g| wide(b.dtype(g))).max_by_key(|d| d.size()).unwrap_or(DType::F32)
}

/// `Σ‖g‖²` over `group` (gradients of one dtype) as a scalar of `acc_dtype`.
fn sum_of_squares(b: &mut Builder, group: &[ValueId], acc_dtype: DType) -> Result<ValueId> {
    let norms = b.squared_norms(group)?;
    let norms = if b.dtype(norms) == acc_dtype { norms } else { b.cast(norms, acc_dtype)? };
    b.sum(norms, &[0], false)
}

/// `sqrt(total)` (zero without gradients).
fn norm_of(b: &mut Builder, total: Option<ValueId>, acc_dtype: DType) -> Result<ValueId> {
    let total = match total {
        Some(t) => t,
        None => b.full(0.0, TensorType::scalar(acc_dtype))?,
    };
    b.unary(crate::ops::UnaryFn::Sqrt, total)
}

/// Each gradient times `min(1, max_norm / (norm + eps))`, the factor cast
/// once to each gradient dtype.
fn scale_by_clip_factor(b: &mut Builder, grads: &[ValueId], norm: ValueId, max_norm: f64) -> Result<Vec<ValueId>> {
    let acc_dtype = b.dtype(norm);
    // min(1, max/(norm+eps)) = max / max(norm + eps, max).
    let eps = b.full(CLIP_EPS, TensorType::scalar(acc_dtype))?;
    let shifted = b.add(norm, eps)?;
    let one = [1usize];
    let shifted = b.reshape(shifted, &one)?;
    let max = b.full(max_norm, TensorType::new(acc_dtype, one))?;
    let both = b.concat(&[shifted, max], 0)?;
    let denom = b.reduce(ReduceKind::Max, both, &[0], false)?;
    let numer = b.full(max_norm, TensorType::scalar(acc_dtype))?;
    let scale = b.div(numer, denom)?;
    let mut scaled = Vec::with_capacity(grads.len());
    let mut cast_scale: Vec<(DType, ValueId)> = Vec::new();
    for &g in grads {
        let d = b.dtype(g);
        let s = match cast_scale.iter().find(|(dt, _)| *dt == d) {
            Some(&(_, s)) => s,
            None => {
                let s = if d == acc_dtype { scale } else { b.cast(scale, d)? };
                cast_scale.push((d, s));
                s
            }
        };
        scaled.push(b.mul(g, s)?);
    }
    Ok(scaled)
}

/// The parameters [`DecayScope::Matrices`] leaves undecayed: those of one
/// axis (norm weights, biases) and the tables `embedding` ops gather from.
fn undecayed_params(trace: &Trace) -> Vec<ValueId> {
    let mut out: Vec<ValueId> = trace.params().filter(|&p| trace.ty(p).rank() <= 1).collect();
    for node in &trace.nodes {
        if let Op::Embedding(_) = node.op {
            let table = node.inputs[1];
            if matches!(trace.value(table).kind, ValueKind::Param { .. }) && !out.contains(&table) {
                out.push(table);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_micro_batch_draws_its_own_dropout_mask() {
        let mut b = Builder::new("dropout");
        let w = b.param("w", TensorType::new(DType::F32, [4, 8])).unwrap();
        let step = b.full(3.0, TensorType::scalar(DType::F32)).unwrap();
        let y = b.dropout(w, step, 0.5, 17).unwrap();
        let loss = b.sum_all(y).unwrap();
        b.output(OutputKind::Loss, loss);
        let forward = b.finish("build").unwrap();
        let t = build_accumulated_step(&forward, StepKind::Grads, &TrainOptions::default(), 3).unwrap();
        let mut seen: Vec<(Phase, u32)> = Vec::new();
        for n in &t.nodes {
            if let Op::Dropout(d) = &n.op {
                assert_eq!((d.p, d.stream), (0.5, 17));
                seen.push((n.phase, d.micro_batch));
            }
        }
        // Each micro-batch's forward dropout and the one of its backward
        // (the same mask on the cotangent), in order.
        let want = [
            (Phase::Forward, 0),
            (Phase::Backward, 0),
            (Phase::Backward, 1),
            (Phase::Backward, 1),
            (Phase::Backward, 2),
            (Phase::Backward, 2),
        ];
        assert_eq!(seen, want);
        // Without accumulation the forward's op is kept as it is.
        let t = build_step(&forward, StepKind::Grads, &TrainOptions::default()).unwrap();
        let mbs: Vec<u32> = t
            .nodes
            .iter()
            .filter_map(|n| if let Op::Dropout(d) = &n.op { Some(d.micro_batch) } else { None })
            .collect();
        assert_eq!(mbs, [0, 0]);
    }
}
