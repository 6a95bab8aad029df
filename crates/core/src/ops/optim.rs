//! The optimizer update: [`AdamW`], one fused in-place kernel per parameter
//! with PyTorch `torch.optim.AdamW` semantics (non-amsgrad, non-maximize),
//! plus the [`Builder::adamw`] helper, and [`MasterWeights`]: the state that
//! keeps a 16-bit parameter's updates from being rounded away.
//!
//! The learning rate and the step count are scalar tensors, not attributes:
//! they are written before every step, so one compiled step program serves
//! every iteration of a schedule.

use num_traits::{Float as _, NumCast};
use rayon::prelude::*;

use super::sample::{normal, positive, scalar, zeros, Sample};
use super::{expect_float, expect_inputs, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{Float, KernelIo, CHUNK};
use crate::with_float;

/// AdamW hyperparameters that are fixed for a run. Inputs
/// `(p, g, m, v, lr, step[, w][, scale])`, outputs `(p', m', v'[, w'])` with
/// the types of `p`, `m`, `v`, `w`; `w` is the master state
/// ([`AdamW::master`]), present unless that is [`MasterWeights::None`].
/// With `scale` (one element of `g`'s dtype: gradient
/// clipping's factor), the update reads `g·scale` rounded to `g`'s type,
/// exactly what a `mul` node before it would store (the epilogue pass,
/// [`crate::passes::fusion`], folds that node in).
///
/// `p` and `g` have one type; `m` and `v` have `p`'s shape and either `p`'s
/// dtype or f32 (float32 optimizer state for narrow parameters); `lr` and
/// `step` are one-element f32 or f64 tensors, `step` counting from 1.
///
/// The update follows PyTorch's `_single_tensor_adamw` operation by
/// operation: the scalar coefficients are computed in f64 (Python floats
/// there) and each element in f32 (f64 for f64 parameters):
///
/// ```text
/// p  ← p · (1 − lr·wd)
/// m  ← lerp(m, g, 1 − β1)                 (= β1·m + (1 − β1)·g)
/// v  ← v·β2 + (1 − β2)·g·g
/// step_size = lr / (1 − β1^t)
/// denom     = sqrt(v) / sqrt(1 − β2^t) + eps
/// p  ← p + (−step_size · m) / denom
/// ```
///
/// The moments are rounded to their storage type and the parameter update
/// reads them as stored (PyTorch's in-place ops do the same); the parameter
/// stays in the compute type between its decay and its update and is rounded
/// once. For f32 and f64 storage every intermediate PyTorch rounds is already
/// in the compute type, so this is the same sequence of operations and
/// roundings as PyTorch's f32 (f64) tensor ops (up to the last bit where a
/// backend fuses a multiply-add, as PyTorch's vectorised `lerp` does); for
/// bf16/f16 parameters it rounds less often.
///
/// **Master weights.** A 16-bit parameter rounded to nearest after every
/// update keeps no change below half its unit in the last place: a bf16
/// weight of 0.02 (spacing 1.2e-4) never moves under steps of 2e-5. With
/// [`MasterWeights::F32`] or [`MasterWeights::Kahan`] the update runs on a
/// wider weight `w` and the parameter is `w` rounded to its dtype:
///
/// ```text
/// w  = master                 (F32; the parameter itself at step 1)
///    = p + compensation       (Kahan)
///    = p                      (None)
/// w' = w · (1 − lr·wd) + (−step_size · m) / denom
/// p' = round(w')
/// master' = w'                (F32)
/// compensation' = round(w' − p')   (Kahan; w' − p' is exact in the compute type)
/// ```
///
/// with every operation in the compute type (f32 for 16-bit parameters).
/// `None` is the update above, unchanged. The f32 master starts from the
/// parameter at the first update (`step == 1`), as `torch.optim` creates
/// its state at the first `step()`: whatever wrote the parameters (a seeded
/// draw, a Hugging Face folder, a user), the master needs no writing of its
/// own, and zeroed state is a valid start for every mode.
#[derive(Clone, PartialEq, Debug, serde::Serialize)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// The state this update carries beside the moments (input 6 and output
    /// 3 when not [`MasterWeights::None`]). Any float parameter takes it;
    /// a train step gives it to bf16/f16 ones ([`MasterWeights::for_param`]).
    pub master: MasterWeights,
}

impl Default for AdamW {
    /// `torch.optim.AdamW`'s defaults, with no master state.
    fn default() -> Self {
        AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, master: MasterWeights::None }
    }
}

/// How a bf16/f16 parameter keeps the updates its own precision would round
/// away (see [`AdamW`]); f32 and f64 parameters need none of these.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MasterWeights {
    /// An f32 copy of the parameter as optimizer state (`<param>.master`,
    /// 4 bytes a weight): the update is that of an f32 weight, as Megatron-LM
    /// and FSDP mixed precision keep it.
    F32,
    /// A compensation of the parameter's dtype (`<param>.compensation`, 2
    /// bytes a weight) holding what rounding the parameter lost, added back
    /// at the next update (compensated summation, as Kahan's): the pair
    /// holds about 16 significant bits.
    #[default]
    Kahan,
    /// No extra state: the parameter is rounded to nearest after each
    /// update, and a change below half a unit in its last place is lost.
    None,
}

impl MasterWeights {
    /// Every mode, in the order they are listed to users.
    pub const ALL: [MasterWeights; 3] = [MasterWeights::F32, MasterWeights::Kahan, MasterWeights::None];

    /// The mode's name, as `--master-weights` takes it.
    pub fn name(self) -> &'static str {
        match self {
            MasterWeights::F32 => "f32",
            MasterWeights::Kahan => "kahan",
            MasterWeights::None => "none",
        }
    }

    /// What a parameter of dtype `param` carries under this mode: the mode
    /// itself for bf16 and f16, [`MasterWeights::None`] for wider
    /// parameters, which are their own master.
    pub fn for_param(self, param: DType) -> MasterWeights {
        if matches!(param, DType::BF16 | DType::F16) {
            self
        } else {
            MasterWeights::None
        }
    }

    /// The dtype of the state this mode keeps for a parameter of dtype
    /// `param`, `None` when it keeps none.
    pub fn state_dtype(self, param: DType) -> Option<DType> {
        match self {
            MasterWeights::F32 => Some(DType::F32),
            MasterWeights::Kahan => Some(param),
            MasterWeights::None => None,
        }
    }

    /// The suffix of its state leaf's name (`<param>.<suffix>`), next to
    /// the moments' `exp_avg` and `exp_avg_sq`.
    pub fn state_suffix(self) -> Option<&'static str> {
        match self {
            MasterWeights::F32 => Some("master"),
            MasterWeights::Kahan => Some("compensation"),
            MasterWeights::None => None,
        }
    }

    /// Inputs (and outputs) it adds to an update: the state, or nothing.
    fn extra(self) -> usize {
        (self != MasterWeights::None) as usize
    }

    /// The type of the master state output of an update of `p` whose
    /// master input is `w` (checked against this mode), or `None` when the
    /// mode keeps none.
    pub(crate) fn infer_state(
        self,
        p: &TensorType,
        w: Option<&TensorType>,
    ) -> std::result::Result<Option<TensorType>, String> {
        let Some(dtype) = self.state_dtype(p.dtype) else { return Ok(None) };
        match w {
            Some(w) if w.shape == p.shape && w.dtype == dtype => Ok(Some(w.clone())),
            w => Err(format!(
                "the {} master state must be {}, got {} (parameter {p})",
                self.name(),
                p.with_dtype(dtype),
                w.map_or("none".to_string(), |w| w.to_string())
            )),
        }
    }
}

impl AdamW {
    /// Checks an update's input count (`at` of them, or one more: the
    /// gradient's scale, one element of its dtype) and the hyperparameters.
    pub(crate) fn check_update_inputs(&self, inputs: &[&TensorType], at: usize) -> std::result::Result<(), String> {
        if inputs.len() == at + 1 {
            let (g, s) = (inputs[1], inputs[at]);
            if s.numel() != 1 || s.dtype != g.dtype {
                return Err(format!(
                    "the gradient's scale must be one element of the gradient's dtype {}, got {s}",
                    g.dtype
                ));
            }
        } else {
            expect_inputs(inputs, at)?;
        }
        self.check_hyper()
    }
}

/// Whether an update of `at` inputs takes a scale of type `scale` for
/// its input `input` (the gradient, input 1) as one more input.
pub(crate) fn takes_gradient_scale(input: usize, inputs: &[&TensorType], scale: &TensorType, at: usize) -> bool {
    input == 1 && inputs.len() == at && scale.numel() == 1 && scale.dtype == inputs[1].dtype
}

/// Checks the types of an update's learning rate and step count.
pub(crate) fn check_lr_step_types(lr: &TensorType, step: &TensorType) -> std::result::Result<(), String> {
    for (name, s) in [("lr", lr), ("step", step)] {
        if s.numel() != 1 || !matches!(s.dtype, DType::F32 | DType::F64) {
            return Err(format!("{name} must be a one-element f32 or f64 tensor, got {s}"));
        }
    }
    Ok(())
}

/// The error of differentiating the optimizer update `op`.
pub(crate) fn not_differentiable(op: &str) -> Error {
    Error::NotDifferentiable {
        op: op.into(),
        reason: "is an optimizer update, not differentiable: it belongs after the backward pass".into(),
    }
}

impl AdamW {
    /// The ranges PyTorch's constructor accepts.
    fn check_hyper(&self) -> std::result::Result<(), String> {
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(format!("{name} must be in [0, 1), got {b}"));
            }
        }
        if !(self.eps >= 0.0 && self.eps.is_finite()) {
            return Err(format!("eps must be finite and non-negative, got {}", self.eps));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(format!("weight_decay must be finite and non-negative, got {}", self.weight_decay));
        }
        Ok(())
    }
}

/// PyTorch's `lerp`: `a + w·(b − a)` for `|w| < 0.5`, else
/// `b − (b − a)·(1 − w)`, the branch keeping the result exact at both ends.
#[inline]
pub(crate) fn lerp<A: num_traits::Float>(a: A, b: A, w: A) -> A {
    let one = A::one();
    let half = one / (one + one);
    if w.abs() < half {
        a + w * (b - a)
    } else {
        b - (b - a) * (one - w)
    }
}

/// Per-step coefficients, in f64 as PyTorch's Python floats, then rounded
/// once to the compute type, as PyTorch does when a Python scalar meets a tensor.
pub(crate) struct Coefs<A> {
    /// The first update (`step == 1`): an f32 master starts from the parameter.
    pub(crate) first: bool,
    pub(crate) decay: A,
    pub(crate) w1: A,
    pub(crate) beta2: A,
    pub(crate) w2: A,
    pub(crate) neg_step_size: A,
    pub(crate) bc2_sqrt: A,
    pub(crate) eps: A,
}

impl AdamW {
    pub(crate) fn coefs<A: NumCast>(&self, lr: f64, step: f64) -> Coefs<A> {
        let cast = |x: f64| -> A { A::from(x).expect("every f64 converts to a float type") };
        let bias_correction1 = 1.0 - self.beta1.powf(step);
        let bias_correction2 = 1.0 - self.beta2.powf(step);
        let step_size = lr / bias_correction1;
        Coefs {
            first: step == 1.0,
            decay: cast(1.0 - lr * self.weight_decay),
            w1: cast(1.0 - self.beta1),
            beta2: cast(self.beta2),
            w2: cast(1.0 - self.beta2),
            neg_step_size: cast(-step_size),
            bc2_sqrt: cast(bias_correction2.sqrt()),
            eps: cast(self.eps),
        }
    }
}

/// The learning rate and step count, inputs `at` and `at + 1`, checked as
/// PyTorch's constructor and step counter would have them.
pub(crate) fn checked_lr_step(io: &KernelIo, at: usize) -> Result<(f64, f64)> {
    let lr = scalar_input(io, at, "lr", |x| x.is_finite() && x >= 0.0, "finite and non-negative")?;
    let step = scalar_input(io, at + 1, "step", |x| x.is_finite() && x >= 1.0, "at least 1 (steps count from 1)")?;
    Ok((lr, step))
}

/// Reads a one-element scalar input and checks it with `ok`; these are values
/// written by the host before each step, so a bad one is an input error.
fn scalar_input(io: &KernelIo, i: usize, name: &str, ok: impl Fn(f64) -> bool, want: &str) -> Result<f64> {
    let x = io.scalar(i)?;
    if !ok(x) {
        return Err(Error::Input { name: name.into(), reason: format!("AdamW {name} must be {want}, got {x}") });
    }
    Ok(x)
}

/// The update over all elements, in fixed chunks (elementwise, so trivially
/// deterministic). `P`, `M`, `V`, `W` are the storage types of the parameter
/// (and gradient), the two moments and the master state (`W` unused without
/// one); arithmetic is in `P::Acc`, which is also the moments' accumulator
/// type except for f32 state of f64 parameters, whose values are converted
/// up and back.
fn kernel<P: Float, M: Float, V: Float, W: Float>(io: &KernelIo, c: &Coefs<P::Acc>, master: MasterWeights) {
    // The gradient's scale, read before any output is handed out.
    let at = 6 + master.extra();
    let scale = (io.inputs.len() > at).then(|| io.input::<P>(at)[0].acc());
    // Output slices already holding p, m, v and w (copied unless aliased).
    let p = io.inplace::<P>(0, 0);
    let m = io.inplace::<M>(1, 2);
    let v = io.inplace::<V>(2, 3);
    let g = io.input::<P>(1);
    let chunks = p.len().div_ceil(CHUNK);
    let w: Vec<Option<&mut [W]>> = match master {
        MasterWeights::None => (0..chunks).map(|_| None).collect(),
        _ => io.inplace::<W>(3, 6).chunks_mut(CHUNK).map(Some).collect(),
    };
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .zip(w.into_par_iter())
        .for_each(|((((p, m), v), g), mut w)| {
            for i in 0..p.len() {
                // g·scale as a `mul` would store it: rounded to g's type.
                let gi = match scale {
                    Some(s) => P::from_acc(g[i].acc() * s).acc(),
                    None => g[i].acc(),
                };
                // The weight the update starts from (see `AdamW`).
                let p0 = p[i].acc();
                let w0 = match (master, w.as_deref()) {
                    (MasterWeights::F32, Some(w)) if !c.first => conv::<W::Acc, P::Acc>(w[i].acc()),
                    (MasterWeights::Kahan, Some(w)) => p0 + conv::<W::Acc, P::Acc>(w[i].acc()),
                    _ => p0,
                };
                let wi = w0 * c.decay;
                let mi = lerp(conv::<M::Acc, P::Acc>(m[i].acc()), gi, c.w1);
                let vi = conv::<V::Acc, P::Acc>(v[i].acc()) * c.beta2 + c.w2 * gi * gi;
                // The moments as stored: the parameter update reads the state
                // it leaves behind, as PyTorch's in-place ops do.
                m[i] = M::from_acc(conv(mi));
                v[i] = V::from_acc(conv(vi));
                let (mi, vi) = (conv::<M::Acc, P::Acc>(m[i].acc()), conv::<V::Acc, P::Acc>(v[i].acc()));
                let denom = vi.sqrt() / c.bc2_sqrt + c.eps;
                let w_new = wi + c.neg_step_size * mi / denom;
                p[i] = P::from_acc(w_new);
                if let Some(w) = w.as_deref_mut() {
                    // The master as computed, or what rounding the parameter lost.
                    let kept = match master {
                        MasterWeights::Kahan => w_new - p[i].acc(),
                        _ => w_new,
                    };
                    w[i] = W::from_acc(conv(kept));
                }
            }
        });
}

/// Converts between accumulator types (f32 ↔ f64; the identity when equal).
#[inline]
fn conv<A: num_traits::Float, B: num_traits::Float>(x: A) -> B {
    B::from(x).unwrap_or_else(B::nan)
}

impl OpDef for AdamW {
    /// Parameters of dtype `d` with moments of `d`, f32 (the mixed-precision
    /// default: bf16 parameters with f32 moments) or one of each (but f16's
    /// second moment always f32), lr and
    /// step in f32 or f64; a first step from zero moments with PyTorch's
    /// defaults and a third step from random moments with
    /// `1 - beta1 >= 0.5` (lerp's other branch), decay and a larger eps;
    /// scalars, odd lengths, a matrix and a tensor of several CPU chunks.
    fn samples(d: DType) -> Vec<Sample> {
        let hypers =
            [AdamW::default(), AdamW { beta1: 0.3, beta2: 0.95, eps: 1e-6, weight_decay: 0.1, ..AdamW::default() }];
        // f16's range cannot hold the second moment ((1 - beta2)·g² underflows
        // for |g| below about 0.008), so f16 parameters keep it in f32.
        let sq = if d == DType::F16 { DType::F32 } else { d };
        let types = [
            (d, sq, DType::F32),
            (DType::F32, DType::F32, DType::F32),
            (DType::F32, sq, DType::F32),
            (d, sq, DType::F64),
            (DType::F32, DType::F32, DType::F64),
        ];
        let mut v = Vec::new();
        for (ti, (mt, vt, st)) in types.into_iter().enumerate() {
            for (h, hyper) in hypers.iter().enumerate() {
                for shape in [&[][..], &[1], &[17], &[33, 65], &[40_000]] {
                    let (m, sq, lr, step) = if h == 0 {
                        (zeros(mt, shape), zeros(vt, shape), 1e-3, 1.0)
                    } else {
                        (normal(mt, shape), positive(vt, shape), 2e-2, 3.0)
                    };
                    let inputs = vec![normal(d, shape), normal(d, shape), m, sq, scalar(st, lr), scalar(st, step)];
                    v.push(Sample::new(hyper.clone(), inputs.clone()));
                    // With clipping's factor folded in (a typical one, and 1).
                    // (The first state types only: every dtype lists the same cases.)
                    if ti == 0 && shape.len() == 1 {
                        for factor in [0.37, 1.0] {
                            let mut scaled = inputs.clone();
                            scaled.push(scalar(d, factor));
                            v.push(Sample::new(hyper.clone(), scaled));
                        }
                    }
                    // With an f32 master: at the first step (the master
                    // read from the parameter, the state's values ignored)
                    // and a later one, with and without clipping's factor,
                    // with moments of either dtype. (Not a compensation:
                    // it holds the rounding residual of the narrow dtype,
                    // which no f64 run has to be checked against; its
                    // tests are its own.)
                    if ti > 1 {
                        continue;
                    }
                    let hyper = AdamW { master: MasterWeights::F32, ..hyper.clone() };
                    let mut with = inputs.clone();
                    with.push(normal(DType::F32, shape));
                    v.push(Sample::new(hyper.clone(), with.clone()));
                    if shape.len() == 1 {
                        with.push(scalar(d, 0.37));
                        v.push(Sample::new(hyper, with));
                    }
                }
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "adamw"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        self.check_update_inputs(inputs, 6 + self.master.extra())?;
        let (p, g, m, v, lr, step) = (inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5]);
        expect_float(p, "the parameter")?;
        super::expect_same(p, g, "the parameter and its gradient")?;
        for (name, s) in [("the first moment", m), ("the second moment", v)] {
            if s.shape != p.shape || (s.dtype != p.dtype && s.dtype != DType::F32) {
                return Err(format!(
                    "{name} {s} must have the parameter's shape and the parameter's dtype or f32 (parameter {p})"
                ));
            }
        }
        check_lr_step_types(lr, step)?;
        let mut out = vec![p.clone(), m.clone(), v.clone()];
        out.extend(self.master.infer_state(p, inputs.get(6).copied())?);
        Ok(out)
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        Err(not_differentiable(self.name()))
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (lr, step) = checked_lr_step(io, 4)?;
        with_float!(io.in_ty(0).dtype, P => {
            let coefs = self.coefs::<<P as Float>::Acc>(lr, step);
            with_float!(io.in_ty(2).dtype, M => {
                with_float!(io.in_ty(3).dtype, V => {
                    match self.master {
                        MasterWeights::F32 => kernel::<P, M, V, f32>(io, &coefs, self.master),
                        _ => kernel::<P, M, V, P>(io, &coefs, self.master),
                    }
                    Ok(())
                })
            })
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut a = vec![
            ("beta1", Attr::Float(self.beta1)),
            ("beta2", Attr::Float(self.beta2)),
            ("eps", Attr::Float(self.eps)),
            ("weight_decay", Attr::Float(self.weight_decay)),
        ];
        // Printed only when there is master state, so that traces without it read as before.
        match self.master {
            MasterWeights::F32 => a.push(("master", Attr::DType(DType::F32))),
            MasterWeights::Kahan => a.push(("kahan", Attr::Bool(true))),
            MasterWeights::None => {}
        }
        a
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "adamw").then(|| AdamW::parse_attrs("adamw", a))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        // p' in p, m' in m, v' in v, w' in w: the update runs in the persistent buffers.
        let mut pairs = vec![(0, 0), (1, 2), (2, 3)];
        if self.master != MasterWeights::None {
            pairs.push((3, 6));
        }
        pairs
    }
    fn with_input_scale(&self, input: usize, inputs: &[&TensorType], scale: &TensorType) -> Option<(Self, usize)> {
        let at = 6 + self.master.extra();
        takes_gradient_scale(input, inputs, scale, at).then(|| (self.clone(), at))
    }
}

impl AdamW {
    /// The hyperparameters and master state from the attributes of the op
    /// `op` (`adamw`, `adamw_8bit`), as [`OpDef::attrs`] prints them.
    pub(crate) fn parse_attrs(op: &str, a: &mut Attrs) -> Result<AdamW> {
        let master = match (a.map.contains_key("master"), a.opt_bool("kahan")?.unwrap_or(false)) {
            (true, true) => return Err(Error::op(op, "`master` and `kahan` exclude each other: keep one".to_string())),
            (true, false) => match a.dtype("master")? {
                DType::F32 => MasterWeights::F32,
                d => return Err(Error::op(op, format!("master weights are f32, got `master={d}`"))),
            },
            (false, true) => MasterWeights::Kahan,
            (false, false) => MasterWeights::None,
        };
        Ok(AdamW {
            beta1: a.float("beta1")?,
            beta2: a.float("beta2")?,
            eps: a.float("eps")?,
            weight_decay: a.float("weight_decay")?,
            master,
        })
    }
}

impl Builder {
    /// One AdamW update of parameter `p` with gradient `g` and moments `m`,
    /// `v`; `lr` and `step` are scalar step inputs; `w` is the master state
    /// when `hyper.master` keeps one. Returns `(p', m', v', w')`.
    #[allow(clippy::too_many_arguments)] // the seven tensors of the update plus its hyperparameters
    pub fn adamw(
        &mut self,
        p: ValueId,
        g: ValueId,
        m: ValueId,
        v: ValueId,
        lr: ValueId,
        step: ValueId,
        w: Option<ValueId>,
        hyper: &AdamW,
    ) -> Result<(ValueId, ValueId, ValueId, Option<ValueId>)> {
        let mut inputs = vec![p, g, m, v, lr, step];
        inputs.extend(w);
        let outs = self.push(hyper.clone().into(), &inputs)?;
        Ok((outs[0], outs[1], outs[2], outs.get(3).copied()))
    }
}
