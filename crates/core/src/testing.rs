//! Test support shared by unit tests, integration tests and the CUDA tests:
//! an unplanned interpreter (every value its own buffer), drawing the
//! inputs of an op's samples ([`draw_sample`]), one-op runs on the CPU
//! (collectives included, on a local group) and the finite-difference
//! check of VJP rules.
//!
//! The VJP check tests ⟨J·u, v⟩ = ⟨u, Jᵀ·v⟩ in f64: `J·u` by central
//! differences of the op's CPU kernel, `Jᵀ·v` by running the op's VJP rule
//! (the backward ops it emits, on their CPU kernels).

use std::collections::{BTreeMap, HashMap};

use num_traits::ToPrimitive;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use crate::cpu::comm::{run_ranks, Communicator};
use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{Builder, OutputKind, TensorType, Trace, ValueId, ValueKind};
use crate::ops::collective::world_of;
use crate::ops::kernel::{Float, KernelIo, TensorView};
use crate::ops::{Input, Op, Sample, VjpArgs};

/// Runs `trace` with every value in its own buffer (no plan, no reuse), the
/// leaves taken from `leaves`. Returns every value. The reference against
/// which planned execution is compared.
pub fn interpret(trace: &Trace, leaves: &HashMap<ValueId, HostTensor>) -> Result<Vec<HostTensor>> {
    interpret_with_comm(trace, leaves, None)
}

/// The derivative of `trace`'s loss along `direction` (a vector per leaf,
/// added to that leaf's value in `leaves`) by central differences with step
/// `eps`: `(L(x + eps·u) − L(x − eps·u)) / 2·eps`, each loss interpreted.
/// Compared with `⟨∇L, u⟩` from a gradient step, it checks a whole model's
/// backward pass.
pub fn directional_derivative(
    trace: &Trace,
    leaves: &HashMap<ValueId, HostTensor>,
    direction: &[(ValueId, Vec<f64>)],
    eps: f64,
) -> Result<f64> {
    let loss = trace.loss().ok_or_else(|| Error::Input {
        name: "loss".into(),
        reason: format!("trace `{}` has no loss output", trace.name),
    })?;
    let loss_at = |sign: f64| -> Result<f64> {
        let mut moved = leaves.clone();
        for (v, u) in direction {
            let x: Vec<f64> = leaves[v].to_f64().iter().zip(u).map(|(a, b)| a + sign * eps * b).collect();
            moved.insert(*v, HostTensor::from_f64(trace.ty(*v).clone(), &x));
        }
        Ok(interpret(trace, &moved)?[loss.index()].to_f64()[0])
    };
    Ok((loss_at(1.0)? - loss_at(-1.0)?) / (2.0 * eps))
}

/// [`interpret`] with a communicator for the trace's collectives.
pub fn interpret_with_comm(
    trace: &Trace,
    leaves: &HashMap<ValueId, HostTensor>,
    comm: Option<&dyn Communicator>,
) -> Result<Vec<HostTensor>> {
    let mut vals: Vec<HostTensor> = trace.values.iter().map(|v| HostTensor::zeros(v.ty.clone())).collect();
    for v in trace.leaves() {
        let t =
            leaves.get(&v).ok_or_else(|| Error::Input { name: trace.describe(v), reason: "no value given".into() })?;
        if t.ty != *trace.ty(v) {
            return Err(Error::Input {
                name: trace.describe(v),
                reason: format!("expected {}, got {}", trace.ty(v), t.ty),
            });
        }
        vals[v.index()] = t.clone();
    }
    for node in &trace.nodes {
        let view = |t: &mut HostTensor| TensorView { ty: t.ty.clone(), ptr: t.bytes_mut().as_mut_ptr() };
        let inputs: Vec<TensorView> = node.inputs.iter().map(|i| view(&mut vals[i.index()])).collect();
        let mut outs: Vec<HostTensor> =
            node.outputs.iter().map(|o| HostTensor::garbage(trace.ty(*o).clone())).collect();
        let outputs: Vec<TensorView> = outs.iter_mut().map(view).collect();
        let mut io = KernelIo::new(&inputs, &outputs);
        io.comm = comm;
        node.op.cpu(&io)?;
        for (o, t) in node.outputs.iter().zip(outs) {
            vals[o.index()] = t;
        }
    }
    Ok(vals)
}

/// Draws `input` from `rng`: the same f64 draws for every dtype of the same
/// shape, rounded to the input's type. `earlier` holds the sample's inputs
/// drawn so far (for [`Input::Earlier`]).
fn draw(input: &Input, rng: &mut StdRng, earlier: &[HostTensor]) -> Result<HostTensor> {
    let ty = input.ty().clone();
    let n = ty.numel();
    Ok(match input {
        Input::Normal(_) => {
            let d: Vec<f64> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
            HostTensor::from_f64(ty, &d)
        }
        Input::Positive(_) => {
            let d: Vec<f64> = (0..n).map(|_| rng.gen_range(0.5..2.0)).collect();
            HostTensor::from_f64(ty, &d)
        }
        Input::Ids { max, .. } => {
            let d: Vec<f64> = (0..n).map(|_| rng.gen_range(0..*max) as f64).collect();
            HostTensor::from_f64(ty, &d)
        }
        Input::Ties(_) => {
            let d: Vec<f64> = (0..n).map(|_| rng.gen_range(-2..=2) as f64).collect();
            HostTensor::from_f64(ty, &d)
        }
        Input::Fixed(_, d) => HostTensor::from_f64(ty, d),
        Input::Earlier { index, .. } => earlier
            .get(*index)
            .cloned()
            .ok_or_else(|| Error::Input { name: format!("input {index}"), reason: "not drawn yet".into() })?,
        Input::Output { op, args, output, .. } => {
            let xs: Vec<HostTensor> = args.iter().map(|a| draw(a, rng, earlier)).collect::<Result<_>>()?;
            run_op(op, &xs)?.swap_remove(*output)
        }
    })
}

/// The inputs of `sample` drawn from `seed`. Every dtype sees the same f64
/// draws (one stream per sample, in input order) rounded to its type, so a
/// narrow sample's inputs are roundings of the f64 sample's of the same
/// seed; [`Input::Output`]s are computed on the CPU from the drawn values.
pub fn draw_sample(sample: &Sample, seed: u64) -> Result<Vec<HostTensor>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out: Vec<HostTensor> = Vec::with_capacity(sample.inputs.len());
    // Outputs of one op on the same earlier inputs (a forward's o and lse)
    // come from one run: the runs draw nothing, so this changes no value.
    let mut runs: Vec<(&Op, &[Input], Vec<HostTensor>)> = Vec::new();
    for input in &sample.inputs {
        let t = match input {
            Input::Output { op, args, output, .. } if args.iter().all(|a| matches!(a, Input::Earlier { .. })) => {
                let i = match runs.iter().position(|(o, a, _)| *o == op && *a == args.as_slice()) {
                    Some(i) => i,
                    None => {
                        let xs: Vec<HostTensor> =
                            args.iter().map(|a| draw(a, &mut rng, &out)).collect::<Result<_>>()?;
                        runs.push((op, args, run_op(op, &xs)?));
                        runs.len() - 1
                    }
                };
                runs[i].2[*output].clone()
            }
            _ => draw(input, &mut rng, &out)?,
        };
        out.push(t);
    }
    Ok(out)
}

/// One input drawn alone from `seed` (as the first input of a sample).
pub fn draw_input(input: &Input, seed: u64) -> Result<HostTensor> {
    draw(input, &mut StdRng::seed_from_u64(seed), &[])
}

/// Runs one op on host tensors through its CPU kernel, every output buffer
/// starting as garbage (0xFF bytes). A collective runs with a group of its
/// `world` ranks in threads (a world of 1 alone), every rank given the same
/// inputs; the result is rank 0's.
pub fn run_op(op: &Op, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    with_comm(op, |comm| run_op_in(op, inputs, comm))
}

/// Runs `f` with a communicator for `op`: none for ops that are not
/// collectives, else rank 0's of a local group of the op's world, the other
/// ranks running `f` in their own threads.
fn with_comm<T: Send>(op: &Op, f: impl Fn(Option<&dyn Communicator>) -> Result<T> + Sync) -> Result<T> {
    match world_of(op) {
        None => f(None),
        Some(world) => Ok(run_ranks(world, |comm| f(Some(&comm)))?.swap_remove(0)),
    }
}

fn run_op_in(op: &Op, inputs: &[HostTensor], comm: Option<&dyn Communicator>) -> Result<Vec<HostTensor>> {
    let mut b = Builder::new("op");
    let ids: Vec<ValueId> =
        inputs.iter().enumerate().map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone())).collect::<Result<_>>()?;
    let outs = b.push(op.clone(), &ids)?;
    let trace = b.finish("build")?;
    let leaves: HashMap<ValueId, HostTensor> = trace.inputs().zip(inputs.iter().cloned()).collect();
    let vals = interpret_with_comm(&trace, &leaves, comm)?;
    // `finish` renumbers: outputs follow the inputs in order.
    let first = inputs.len();
    Ok((0..outs.len()).map(|k| vals[first + k].clone()).collect())
}

/// Runs one op's kernel with every output buffer filled with `byte` first
/// (0xFF is NaN in every float type, as reused arena memory may be).
/// Collectives run as in [`run_op`]. A kernel that writes every output
/// element and reads none before writing it gives the same bits for every
/// `byte`.
pub fn run_op_filled(op: &Op, inputs: &[HostTensor], byte: u8) -> Result<Vec<HostTensor>> {
    let types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let out_types = op.infer(&types).map_err(|e| Error::op(op.name(), e))?;
    with_comm(op, |comm| {
        let mut ins = inputs.to_vec();
        let mut outs: Vec<HostTensor> = out_types
            .iter()
            .map(|t| {
                let mut h = HostTensor::zeros(t.clone());
                h.bytes_mut().fill(byte);
                h
            })
            .collect();
        let view = |t: &mut HostTensor| TensorView { ty: t.ty.clone(), ptr: t.bytes_mut().as_mut_ptr() };
        let in_views: Vec<TensorView> = ins.iter_mut().map(view).collect();
        let out_views: Vec<TensorView> = outs.iter_mut().map(view).collect();
        let mut io = KernelIo::new(&in_views, &out_views);
        io.comm = comm;
        op.cpu(&io)?;
        Ok(outs)
    })
}

/// Result of a VJP check: both sides of ⟨J·u, v⟩ = ⟨u, Jᵀ·v⟩.
#[derive(Debug, Clone, Copy)]
pub struct VjpCheck {
    pub jvp_fd: f64,
    pub vjp: f64,
}

impl VjpCheck {
    pub fn rel_err(&self) -> f64 {
        (self.jvp_fd - self.vjp).abs() / self.jvp_fd.abs().max(self.vjp.abs()).max(1e-3)
    }
}

/// The finite-difference check of a sample's VJP rule on its inputs drawn
/// with `seed` (an f64 sample: `samples(DType::F64)`). Every differentiable
/// input ([`Input::differentiable`]) gets a random direction, every float
/// output a random cotangent. An op without a VJP rule (a backward op, a
/// collective, an optimizer update) gives its error.
pub fn check_vjp(sample: &Sample, seed: u64) -> Result<VjpCheck> {
    let op = &sample.op;
    let x = draw_sample(sample, seed)?;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let u: Vec<Option<Vec<f64>>> = sample
        .inputs
        .iter()
        .zip(&x)
        .map(|(a, t)| a.differentiable().then(|| (0..t.ty.numel()).map(|_| StandardNormal.sample(&mut rng)).collect()))
        .collect();

    // Jᵀ·v through the VJP rule.
    let mut b = Builder::new("vjp_check");
    let xs: Vec<ValueId> =
        x.iter().enumerate().map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone())).collect::<Result<_>>()?;
    let ys = b.push(op.clone(), &xs)?;
    let mut vs = Vec::new();
    let mut v_data = Vec::new();
    for (j, &y) in ys.iter().enumerate() {
        let ty = b.ty(y).clone();
        if ty.dtype.is_float() {
            let d: Vec<f64> = (0..ty.numel()).map(|_| StandardNormal.sample(&mut rng)).collect();
            vs.push(Some(b.input(&format!("v{j}"), ty.clone())?));
            v_data.push(Some(HostTensor::from_f64(ty, &d)));
        } else {
            vs.push(None);
            v_data.push(None);
        }
    }
    b.set_phase(crate::ir::Phase::Backward);
    let gs = op.vjp(&mut b, &VjpArgs { inputs: &xs, outputs: &ys, cotangents: &vs })?;
    if gs.len() != xs.len() {
        return Err(Error::Autodiff(format!(
            "`{}` VJP returned {} cotangents for {} inputs",
            op.name(),
            gs.len(),
            xs.len()
        )));
    }
    for (i, g) in gs.iter().enumerate() {
        if let Some(g) = g {
            if b.ty(*g) != b.ty(xs[i]) {
                return Err(Error::Autodiff(format!(
                    "`{}` VJP gives input {i} a cotangent of type {}, expected {}",
                    op.name(),
                    b.ty(*g),
                    b.ty(xs[i])
                )));
            }
            b.output(OutputKind::Named(format!("g{i}")), *g);
        }
    }
    let trace = b.finish("vjp_check")?;
    let mut leaves = HashMap::new();
    for v in trace.leaves() {
        let name = trace.value(v).kind.leaf_name().unwrap_or_default().to_string();
        let t = if let Some(i) = name.strip_prefix('x') {
            x[i.parse::<usize>().unwrap()].clone()
        } else {
            let j: usize = name[1..].parse().unwrap();
            v_data[j].clone().unwrap()
        };
        leaves.insert(v, t);
    }
    let vals = interpret(&trace, &leaves)?;
    let mut vjp = 0.0;
    for o in &trace.outputs {
        if let OutputKind::Named(n) = &o.kind {
            let i: usize = n[1..].parse().unwrap();
            if let Some(ui) = &u[i] {
                vjp += dot(ui, &vals[o.value.index()].to_f64());
            }
        }
    }

    // J·u by central differences.
    let eps = 1e-6;
    let shifted = |sign: f64| -> Result<Vec<HostTensor>> {
        let xs: Vec<HostTensor> = x
            .iter()
            .zip(&u)
            .map(|(t, ui)| match ui {
                Some(ui) => {
                    let d: Vec<f64> = t.to_f64().iter().zip(ui).map(|(a, b)| a + sign * eps * b).collect();
                    HostTensor::from_f64(t.ty.clone(), &d)
                }
                None => t.clone(),
            })
            .collect();
        run_op(op, &xs)
    };
    let (plus, minus) = (shifted(1.0)?, shifted(-1.0)?);
    let mut jvp_fd = 0.0;
    for (j, v) in v_data.iter().enumerate() {
        if let Some(v) = v {
            let d: Vec<f64> =
                plus[j].to_f64().iter().zip(minus[j].to_f64()).map(|(p, m)| (p - m) / (2.0 * eps)).collect();
            jvp_fd += dot(&d, &v.to_f64());
        }
    }
    Ok(VjpCheck { jvp_fd, vjp })
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Every parameter gradient that `step` outputs, by parameter name, each
/// read by `read` (from a session, or an interpreter's values).
pub fn grads_by_name(step: &Trace, mut read: impl FnMut(ValueId) -> Vec<f64>) -> BTreeMap<String, Vec<f64>> {
    let mut grads = BTreeMap::new();
    for o in &step.outputs {
        if let OutputKind::Grad(p) = o.kind {
            let name = step.value(p).kind.leaf_name().expect("a parameter is a leaf").to_string();
            grads.insert(name, read(o.value));
        }
    }
    grads
}

/// Largest relative difference between two float tensors, relative to the
/// largest magnitude of `b` (so tiny entries do not dominate).
pub fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs() / scale))
}

/// Below this multiple of AdamW's ε, a gradient's running RMS `√v̂` makes
/// the element's update a function of the gradient's rounding (see
/// [`updated_param_rel_diff`]).
pub const UPDATE_SET_BY_ROUNDING: f64 = 100.0;

/// Which elements of a parameter AdamW has just updated at step `step`
/// moved by an amount the gradient's rounding decides: those whose running
/// RMS `√v̂` (from `exp_avg_sq`, the second moment after the step) is below
/// [`UPDATE_SET_BY_ROUNDING`]·ε. See [`updated_param_rel_diff`].
pub fn update_set_by_rounding(exp_avg_sq: &[f64], step: usize, adamw: &crate::ops::optim::AdamW) -> Vec<bool> {
    let correction = 1.0 - adamw.beta2.powi(step as i32);
    exp_avg_sq.iter().map(|v| (v / correction).sqrt() < UPDATE_SET_BY_ROUNDING * adamw.eps).collect()
}

/// [`max_rel_diff`] for a parameter AdamW has updated `steps` times at
/// learning rate `lr` (`got` on one backend, `want` on the reference one),
/// leaving out the elements whose update the gradient's rounding decided.
///
/// AdamW moves an element by `lr·m̂/(√v̂ + ε)`. Where the gradient is far
/// above ε that is about ±lr whatever the gradient's last bits; where its
/// running RMS is within [`UPDATE_SET_BY_ROUNDING`]·ε, the move is
/// proportional to the gradient itself. A gradient that small is rounding
/// noise of a sum that cancels (-3e-9 beside a largest 0.1 in a tiny
/// model's LM head), which two correct backends, or exact and 3xTF32
/// products on one, round differently by tens of percent, so the element
/// may move anywhere within ±lr on either, and the difference stays in the
/// weight at later steps. Elements marked in `excused` (the union of
/// [`update_set_by_rounding`] over the steps so far, on the reference) may
/// differ by up to 2·lr a step; every other element counts as in
/// [`max_rel_diff`].
pub fn updated_param_rel_diff(got: &[f64], want: &[f64], excused: &[bool], steps: usize, lr: f64) -> f64 {
    assert!(got.len() == want.len() && want.len() == excused.len(), "one element count for all three");
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    let allowance = 2.0 * lr * steps as f64 * (1.0 + 1e-2);
    let mut worst = 0.0f64;
    for ((x, y), &excused) in got.iter().zip(want).zip(excused) {
        let mut d = (x - y).abs();
        if excused {
            d = (d - allowance).max(0.0);
        }
        // NaN on either side stays the worst of all.
        if d.is_nan() || d > worst {
            worst = d;
        }
    }
    worst / scale
}

/// `T::from_f64` for callers outside the cpu module.
pub fn float_from_f64<T: Float>(x: f64) -> T {
    T::from_f64(x)
}

/// f64 of an accumulator value.
pub fn acc_to_f64<A: ToPrimitive>(a: A) -> f64 {
    a.to_f64().unwrap_or(f64::NAN)
}

/// Is `v` a leaf named `name`?
pub fn is_leaf_named(trace: &Trace, v: ValueId, name: &str) -> bool {
    matches!(&trace.value(v).kind, ValueKind::Input { name: n } | ValueKind::Param { name: n } | ValueKind::Frozen { name: n } | ValueKind::State { name: n } if n == name)
}

/// Runs one op with every declared in-place pair sharing storage (where the
/// two types match), as a planned program may. Compare with [`run_op`]: an
/// op's kernel must give the same bits either way.
/// Collectives run as in [`run_op`].
pub fn run_op_aliased(op: &Op, inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    with_comm(op, |comm| run_op_aliased_in(op, inputs, comm))
}

fn run_op_aliased_in(op: &Op, inputs: &[HostTensor], comm: Option<&dyn Communicator>) -> Result<Vec<HostTensor>> {
    let types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let out_types = op.infer(&types).map_err(|e| Error::op(op.name(), e))?;
    let mut bufs: Vec<HostTensor> = inputs.to_vec();
    let mut outs: Vec<HostTensor> = out_types.iter().map(|t| HostTensor::garbage(t.clone())).collect();
    // Output k aliases input `alias[k]`, when it does.
    let mut alias: Vec<Option<usize>> = vec![None; outs.len()];
    let mut taken = vec![false; inputs.len()];
    for (o, i) in op.inplace() {
        if alias[o].is_none() && !taken[i] && out_types[o] == inputs[i].ty {
            alias[o] = Some(i);
            taken[i] = true;
        }
    }
    let in_views: Vec<TensorView> =
        bufs.iter_mut().map(|t| TensorView { ty: t.ty.clone(), ptr: t.bytes_mut().as_mut_ptr() }).collect();
    let out_views: Vec<TensorView> = outs
        .iter_mut()
        .enumerate()
        .map(|(k, t)| match alias[k] {
            Some(i) => TensorView { ty: t.ty.clone(), ptr: in_views[i].ptr },
            None => TensorView { ty: t.ty.clone(), ptr: t.bytes_mut().as_mut_ptr() },
        })
        .collect();
    let mut io = KernelIo::new(&in_views, &out_views);
    io.comm = comm;
    op.cpu(&io)?;
    for (k, a) in alias.iter().enumerate() {
        if let Some(i) = a {
            outs[k] = bufs[*i].clone();
        }
    }
    Ok(outs)
}

/// A CPU session of a compiled step holding the weights of seed `seed`
/// (as [`crate::models::init_params`] draws them) and zeroed optimizer
/// state, as `train` starts one.
pub fn seeded_session(c: &crate::pipeline::CompiledStep, seed: u64) -> crate::cpu::exec::CpuSession {
    use crate::session::Session;
    let mut s = crate::cpu::exec::CpuSession::new(c.step.clone(), c.plan.clone()).expect("a planned step opens");
    for (v, t) in crate::models::init_params(&c.forward, seed) {
        s.write_named(c.forward.value(v).kind.leaf_name().expect("parameters are named"), &t).expect("write");
    }
    s.zero_state().expect("zero the optimizer state");
    s
}

/// A CPU session of `step` (planned with the defaults) holding `weights`
/// by leaf name and the named inputs `data`, after one eager run: a grads
/// step's gradients for a finite-difference check.
pub fn run_with_weights(
    step: &Trace,
    weights: &HashMap<String, HostTensor>,
    data: &[(&str, HostTensor)],
) -> crate::cpu::exec::CpuSession {
    let plan = crate::plan::plan(step, crate::plan::PlanOptions::default()).expect("the step plans");
    let mut s = crate::cpu::exec::CpuSession::new(step.clone(), plan).expect("a planned step opens");
    for v in step.weights() {
        let name = step.value(v).kind.leaf_name().expect("weights are named");
        s.write(v, &weights[name]).expect("write a weight");
    }
    for (n, t) in data {
        s.write_named(n, t).expect("write an input");
    }
    s.run_eager().expect("the step runs");
    s
}

/// Uniformly drawn token ids and targets for `spec`'s batch, as the named
/// inputs of its step.
pub fn random_batch(spec: &crate::models::ModelSpec, seed: u64) -> Vec<(&'static str, HostTensor)> {
    use crate::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
    let mut rng = StdRng::seed_from_u64(seed);
    let n = spec.batch * spec.seq;
    let ty = TensorType::new(crate::ir::DType::I32, [spec.batch, spec.seq]);
    let mut draw = || -> Vec<f64> { (0..n).map(|_| rng.gen_range(0..spec.config.vocab_size) as f64).collect() };
    let (ids, targets) = (draw(), draw());
    vec![(TOKENS_INPUT, HostTensor::from_f64(ty.clone(), &ids)), (TARGETS_INPUT, HostTensor::from_f64(ty, &targets))]
}
