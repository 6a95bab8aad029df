//! The optimizer update: [`AdamW`], one fused in-place kernel per parameter
//! with PyTorch `torch.optim.AdamW` semantics (non-amsgrad, non-maximize),
//! plus the [`Builder::adamw`] helper.
//!
//! The learning rate and the step count are scalar tensors, not attributes:
//! they are written before every step, so one compiled step program serves
//! every iteration of a schedule.

use num_traits::{Float as _, NumCast};
use rayon::prelude::*;

use super::sample::{normal, positive, scalar, zeros, Sample};
use super::{expect_float, expect_inputs, Attr, Attrs, OpDef, VjpArgs};
use crate::cpu::{Float, KernelIo, CHUNK};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::with_float;

/// AdamW hyperparameters that are fixed for a run. Inputs
/// `(p, g, m, v, lr, step[, scale])`, outputs `(p', m', v')` with the types
/// of `p`, `m`, `v`. With `scale` (one element of `g`'s dtype: gradient
/// clipping's factor), the update reads `g·scale` rounded to `g`'s type,
/// exactly what a `mul` node before it would store (the epilogue pass,
/// [`crate::fusion`], folds that node in).
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
#[derive(Clone, PartialEq, Debug, serde::Serialize)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamW {
    /// `torch.optim.AdamW`'s defaults.
    fn default() -> Self {
        AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
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
fn lerp<A: num_traits::Float>(a: A, b: A, w: A) -> A {
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
struct Coefs<A> {
    decay: A,
    w1: A,
    beta2: A,
    w2: A,
    neg_step_size: A,
    bc2_sqrt: A,
    eps: A,
}

impl AdamW {
    fn coefs<A: NumCast>(&self, lr: f64, step: f64) -> Coefs<A> {
        let cast = |x: f64| -> A { A::from(x).expect("every f64 converts to a float type") };
        let bias_correction1 = 1.0 - self.beta1.powf(step);
        let bias_correction2 = 1.0 - self.beta2.powf(step);
        let step_size = lr / bias_correction1;
        Coefs {
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
/// deterministic). `P`, `M`, `V` are the storage types of the parameter (and
/// gradient) and the two moments; arithmetic is in `P::Acc`, which is also
/// the moments' accumulator type except for f32 state of f64 parameters,
/// whose values are converted up and back.
fn kernel<P: Float, M: Float, V: Float>(io: &KernelIo, c: &Coefs<P::Acc>) {
    // The gradient's scale, read before any output is handed out.
    let scale = (io.inputs.len() > 6).then(|| io.input::<P>(6)[0].acc());
    // Output slices already holding p, m and v (copied unless aliased).
    let p = io.inplace::<P>(0, 0);
    let m = io.inplace::<M>(1, 2);
    let v = io.inplace::<V>(2, 3);
    let g = io.input::<P>(1);
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .for_each(|(((p, m), v), g)| {
            for i in 0..p.len() {
                // g·scale as a `mul` would store it: rounded to g's type.
                let gi = match scale {
                    Some(s) => P::from_acc(g[i].acc() * s).acc(),
                    None => g[i].acc(),
                };
                let pi = p[i].acc() * c.decay;
                let mi = lerp(conv::<M::Acc, P::Acc>(m[i].acc()), gi, c.w1);
                let vi = conv::<V::Acc, P::Acc>(v[i].acc()) * c.beta2 + c.w2 * gi * gi;
                // The moments as stored: the parameter update reads the state
                // it leaves behind, as PyTorch's in-place ops do.
                m[i] = M::from_acc(conv(mi));
                v[i] = V::from_acc(conv(vi));
                let (mi, vi) = (conv::<M::Acc, P::Acc>(m[i].acc()), conv::<V::Acc, P::Acc>(v[i].acc()));
                let denom = vi.sqrt() / c.bc2_sqrt + c.eps;
                p[i] = P::from_acc(pi + c.neg_step_size * mi / denom);
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
        let hypers = [AdamW::default(), AdamW { beta1: 0.3, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 }];
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
                }
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "adamw"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.len() == 7 {
            let (g, s) = (inputs[1], inputs[6]);
            if s.numel() != 1 || s.dtype != g.dtype {
                return Err(format!(
                    "the gradient's scale must be one element of the gradient's dtype {}, got {s}",
                    g.dtype
                ));
            }
        } else {
            expect_inputs(inputs, 6)?;
        }
        self.check_hyper()?;
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
        for (name, s) in [("lr", lr), ("step", step)] {
            if s.numel() != 1 || !matches!(s.dtype, DType::F32 | DType::F64) {
                return Err(format!("{name} must be a one-element f32 or f64 tensor, got {s}"));
            }
        }
        Ok(vec![p.clone(), m.clone(), v.clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        Err(Error::NotDifferentiable {
            op: self.name().into(),
            reason: "is an optimizer update, not differentiable: it belongs after the backward pass".into(),
        })
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let lr = scalar_input(io, 4, "lr", |x| x.is_finite() && x >= 0.0, "finite and non-negative")?;
        let step = scalar_input(io, 5, "step", |x| x.is_finite() && x >= 1.0, "at least 1 (steps count from 1)")?;
        with_float!(io.in_ty(0).dtype, P => {
            let coefs = self.coefs::<<P as Float>::Acc>(lr, step);
            with_float!(io.in_ty(2).dtype, M => {
                with_float!(io.in_ty(3).dtype, V => {
                    kernel::<P, M, V>(io, &coefs);
                    Ok(())
                })
            })
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![
            ("beta1", Attr::Float(self.beta1)),
            ("beta2", Attr::Float(self.beta2)),
            ("eps", Attr::Float(self.eps)),
            ("weight_decay", Attr::Float(self.weight_decay)),
        ]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "adamw").then(|| {
            Ok(AdamW {
                beta1: a.float("beta1")?,
                beta2: a.float("beta2")?,
                eps: a.float("eps")?,
                weight_decay: a.float("weight_decay")?,
            })
        })
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        // p' in p, m' in m, v' in v: the update runs in the persistent buffers.
        vec![(0, 0), (1, 2), (2, 3)]
    }
    fn with_input_scale(&self, input: usize, inputs: &[&TensorType], scale: &TensorType) -> Option<(Self, usize)> {
        let takes = input == 1 && inputs.len() == 6 && scale.numel() == 1 && scale.dtype == inputs[1].dtype;
        takes.then(|| (self.clone(), 6))
    }
}

impl Builder {
    /// One AdamW update of parameter `p` with gradient `g` and moments `m`,
    /// `v`; `lr` and `step` are scalar step inputs. Returns `(p', m', v')`.
    #[allow(clippy::too_many_arguments)] // the six tensors of the update plus its hyperparameters
    pub fn adamw(
        &mut self,
        p: ValueId,
        g: ValueId,
        m: ValueId,
        v: ValueId,
        lr: ValueId,
        step: ValueId,
        hyper: &AdamW,
    ) -> Result<(ValueId, ValueId, ValueId)> {
        let outs = self.push(hyper.clone().into(), &[p, g, m, v, lr, step])?;
        Ok((outs[0], outs[1], outs[2]))
    }
}
