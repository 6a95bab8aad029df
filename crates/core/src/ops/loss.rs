//! The training loss: mean token cross-entropy over `[N, V]` logits
//! ([`CrossEntropy`], PyTorch's `F.cross_entropy(reduction="mean",
//! ignore_index=...)`) and its one-kernel backward producing the logits'
//! cotangent directly ([`CrossEntropyBackward`]), plus the
//! [`Builder::cross_entropy`] helper.
//!
//! Memory is the point of the design: the forward keeps only the per-row
//! log-sum-exp (`[N]`, never a `[N, V]` log-softmax), and the backward may
//! overwrite the logits with their cotangent row by row, so a large-vocabulary
//! model holds one `[N, V]` buffer through the loss instead of three.

use half::{bf16, f16};
use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use super::sample::{fixed, ids, normal, scalar, Input, Sample};
use super::{expect_float, expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{c, Float, KernelIo};
use crate::with_float;

pub use super::stat_dtype;

/// Ties a logits storage type to the storage type of its statistics, whose
/// accumulator is the same, so kernels read and write both without conversions.
trait WithStat: Float {
    type Stat: Float<Acc = <Self as Float>::Acc>;
}
impl WithStat for f32 {
    type Stat = f32;
}
impl WithStat for bf16 {
    type Stat = f32;
}
impl WithStat for f16 {
    type Stat = f32;
}
impl WithStat for f64 {
    type Stat = f64;
}

/// Checks that every target is `ignore_index` or a class in `[0, classes)`;
/// targets are user data, so a bad one is an input error naming it.
pub(super) fn check_targets(targets: &[i64], classes: usize, ignore_index: i64) -> Result<()> {
    let bad = targets.iter().position(|&t| t != ignore_index && (t < 0 || t as u64 >= classes as u64));
    match bad {
        None => Ok(()),
        Some(pos) => Err(Error::Input {
            name: "targets".into(),
            reason: format!(
                "target {} at position {pos} is out of range for {classes} classes \
                 (and is not the ignore index {ignore_index})",
                targets[pos]
            ),
        }),
    }
}

/// Shared shape rule of the forward and backward: `[N, V]` float logits
/// (V ≥ 1) and `[N]` integer targets. Returns `N`.
fn check_logits_targets(logits: &TensorType, targets: &TensorType) -> std::result::Result<usize, String> {
    expect_float(logits, "logits")?;
    if logits.rank() != 2 {
        return Err(format!("logits must be [rows, classes], got {logits}"));
    }
    if logits.shape[1] == 0 {
        return Err(format!("logits {logits} have no classes"));
    }
    if !targets.dtype.is_int() || targets.rank() != 1 {
        return Err(format!("targets must be a 1-D i32 or i64 tensor, got {targets}"));
    }
    if targets.shape[0] != logits.shape[0] {
        return Err(format!(
            "targets {targets} must have one entry per logits row, but logits {logits} have {} rows",
            logits.shape[0]
        ));
    }
    Ok(logits.shape[0])
}

/// Independent partial sums per row: the fixed lane split keeps the sum
/// order a function of the index alone (deterministic) while shortening the
/// serial rounding chain of a 100k-class row and letting the compiler vectorise.
const LANES: usize = 8;

/// `log Σ_j exp(x_j)` of one row in the accumulator type, shifted by the row
/// max. An infinite max is not subtracted (PyTorch's `logsumexp` rule), so an
/// all `-inf` row gives `-inf` rather than NaN.
fn row_lse<T: Float>(row: &[T]) -> T::Acc {
    let mut mx = <T as Float>::Acc::neg_infinity();
    for x in row {
        mx = mx.max(x.acc());
    }
    let shift = if mx.is_finite() { mx } else { <T as Float>::Acc::zero() };
    let mut lanes = [<T as Float>::Acc::zero(); LANES];
    let mut chunks = row.chunks_exact(LANES);
    for ch in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(ch) {
            *l = *l + (x.acc() - shift).exp();
        }
    }
    let mut tail = <T as Float>::Acc::zero();
    for x in chunks.remainder() {
        tail = tail + (x.acc() - shift).exp();
    }
    let s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])) + tail;
    s.ln() + shift
}

/// Rows handled per parallel task get at least this many logits.
const MIN_ELEMS_PER_TASK: usize = 1 << 14;

// ---------------------------------------------------------------- forward

/// Mean cross-entropy of `[N, V]` logits against `[N]` class targets.
///
/// Outputs: the loss (a scalar) and the per-row log-sum-exp `lse` (`[N]`),
/// both in [`stat_dtype`]. `loss = Σ_{n kept} (lse_n − logits[n, t_n]) / #kept`
/// where rows whose target equals `ignore_index` are not kept; with no row
/// kept the loss is NaN (0/0, as in PyTorch). `lse` is computed for every row.
#[derive(Clone, PartialEq, Debug)]
pub struct CrossEntropy {
    pub ignore_index: i64,
}

impl OpDef for CrossEntropy {
    /// `ce_cases`.
    fn samples(d: DType) -> Vec<Sample> {
        ce_cases(d)
            .into_iter()
            .map(|(ignore_index, logits, targets)| {
                Sample::new(CrossEntropy { ignore_index }, vec![logits, targets]).large_over(20_000)
            })
            .collect()
    }
    fn name(&self) -> &'static str {
        "cross_entropy"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        let n = check_logits_targets(inputs[0], inputs[1])?;
        let st = stat_dtype(inputs[0].dtype);
        Ok(vec![TensorType::scalar(st), TensorType::new(st, vec![n])])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let (gloss, glse) = (args.cotangents[0], args.cotangents[1]);
        if gloss.is_none() && glse.is_none() {
            return Ok(vec![None, None]);
        }
        let (logits, targets) = (args.inputs[0], args.inputs[1]);
        let lse = args.outputs[1];
        // The backward always takes a loss cotangent; when only `lse` is used
        // downstream (a z-loss, say) the loss contributes a zero.
        let gloss = match gloss {
            Some(g) => g,
            None => b.full(0.0, TensorType::scalar(b.dtype(lse)))?,
        };
        let mut ins = vec![logits, targets, lse, gloss];
        ins.extend(glse);
        let dlogits = b.push1(CrossEntropyBackward { ignore_index: self.ignore_index }.into(), &ins)?;
        // Targets are integers: no cotangent.
        Ok(vec![Some(dlogits), None])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let targets = io.ids(1)?;
        let classes = io.in_ty(0).shape[1];
        check_targets(&targets, classes, self.ignore_index)?;
        with_float!(io.in_ty(0).dtype, T => forward_kernel::<T>(io, &targets, self.ignore_index))
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("ignore_index", Attr::Int(self.ignore_index))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "cross_entropy").then(|| Ok(CrossEntropy { ignore_index: a.int("ignore_index")? }))
    }
}

fn forward_kernel<T: WithStat>(io: &KernelIo, targets: &[i64], ignore_index: i64) -> Result<()> {
    let classes = io.in_ty(0).shape[1];
    let x = io.input::<T>(0);
    let loss = io.output::<T::Stat>(0);
    let lse = io.output::<T::Stat>(1);
    lse.par_iter_mut()
        .zip(x.par_chunks(classes))
        .with_min_len((MIN_ELEMS_PER_TASK / classes).max(1))
        .for_each(|(l, row)| *l = T::Stat::from_acc(row_lse(row)));
    // The mean over kept rows, summed serially in row order: O(N) next to the
    // O(N·V) above, and fixed-order so the loss is bit-reproducible.
    let mut sum = <T as Float>::Acc::zero();
    let mut kept = 0usize;
    for (n, &t) in targets.iter().enumerate() {
        if t != ignore_index {
            sum = sum + (lse[n].acc() - x[n * classes + t as usize].acc());
            kept += 1;
        }
    }
    loss[0] = T::Stat::from_acc(sum / c::<<T as Float>::Acc>(kept as f64));
    Ok(())
}

// ---------------------------------------------------------------- backward

/// The logits' cotangent of [`CrossEntropy`], in one pass over the logits:
///
/// `dlogits[n, j] = a_n · (softmax_nj − [j = t_n]) + glse_n · softmax_nj`,
/// with `softmax_nj = exp(logits[n, j] − lse_n)`, `a_n = gloss / #kept` for
/// kept rows and 0 for ignored ones.
///
/// Inputs: `(logits, targets, lse, gloss)` and, when the forward's `lse`
/// output has a cotangent of its own, `glse` (`[N]`) as a fifth input.
/// Output 0 may share the logits' storage (their last use): the kernel
/// reads each row before it overwrites it.
#[derive(Clone, PartialEq, Debug)]
pub struct CrossEntropyBackward {
    pub ignore_index: i64,
}

impl OpDef for CrossEntropyBackward {
    /// `ce_cases` with lse from the forward: a loss cotangent alone, with
    /// the lse cotangent, the lse cotangent alone (a zero loss cotangent),
    /// and neither (a zero gradient).
    fn samples(d: DType) -> Vec<Sample> {
        let st = stat_dtype(d);
        let mut v = Vec::new();
        for (ignore_index, logits, targets) in ce_cases(d) {
            let n = logits.ty().shape[0];
            let s = Sample::new(CrossEntropyBackward { ignore_index }, vec![logits, targets]);
            let args = vec![s.earlier(0), s.earlier(1)];
            let s = s.with_output(CrossEntropy { ignore_index }, args, 1).large_over(20_000);
            v.push(s.clone().with(scalar(st, 0.75)));
            v.push(s.clone().with(scalar(st, 0.75)).with(normal(st, &[n])));
            v.push(s.clone().with(scalar(st, 0.0)).with(normal(st, &[n])));
            v.push(s.with(scalar(st, 0.0)));
        }
        v
    }
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.len() != 4 && inputs.len() != 5 {
            return Err(format!("expects 4 or 5 inputs (logits, targets, lse, gloss[, glse]), got {}", inputs.len()));
        }
        let n = check_logits_targets(inputs[0], inputs[1])?;
        let st = stat_dtype(inputs[0].dtype);
        let row_stat = TensorType::new(st, vec![n]);
        super::expect_same(inputs[2], &row_stat, "lse")?;
        super::expect_same(inputs[3], &TensorType::scalar(st), "the loss cotangent")?;
        if let Some(glse) = inputs.get(4) {
            super::expect_same(glse, &row_stat, "the lse cotangent")?;
        }
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let targets = io.ids(1)?;
        let classes = io.in_ty(0).shape[1];
        check_targets(&targets, classes, self.ignore_index)?;
        with_float!(io.in_ty(0).dtype, T => backward_kernel::<T>(io, &targets, self.ignore_index))
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("ignore_index", Attr::Int(self.ignore_index))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "cross_entropy_backward").then(|| Ok(CrossEntropyBackward { ignore_index: a.int("ignore_index")? }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0)]
    }
}

fn backward_kernel<T: WithStat>(io: &KernelIo, targets: &[i64], ignore_index: i64) -> Result<()> {
    let classes = io.in_ty(0).shape[1];
    let lse = io.input::<T::Stat>(2);
    let gloss = io.input::<T::Stat>(3)[0].acc();
    let glse = (io.inputs.len() == 5).then(|| io.input::<T::Stat>(4));
    let kept = targets.iter().filter(|&&t| t != ignore_index).count();
    // Computed once so every row scales by the same rounded value. Unused when
    // no row is kept (then every `a_n` is 0, as PyTorch's zero gradient).
    let scale = gloss / c::<<T as Float>::Acc>(kept.max(1) as f64);
    // The logits, in the output's storage (copied there unless aliased):
    // each element is read just before it is overwritten and rows are
    // independent, so sharing the logits' buffer is safe.
    let d = io.inplace::<T>(0, 0);
    d.par_chunks_mut(classes).enumerate().with_min_len((MIN_ELEMS_PER_TASK / classes).max(1)).for_each(|(n, row)| {
        let t = targets[n];
        let a = if t == ignore_index { <T as Float>::Acc::zero() } else { scale };
        let b = glse.map_or(<T as Float>::Acc::zero(), |g| g[n].acc());
        let l = lse[n].acc();
        if a.is_zero() && b.is_zero() {
            // Also avoids 0 · exp(...) turning into NaN for infinite logits.
            row.fill(T::from_acc(<T as Float>::Acc::zero()));
            return;
        }
        let coef = a + b;
        for (j, x) in row.iter_mut().enumerate() {
            let p = (x.acc() - l).exp();
            let onehot = if j as i64 == t { a } else { <T as Float>::Acc::zero() };
            *x = T::from_acc(coef * p - onehot);
        }
    });
    Ok(())
}

impl Builder {
    /// Mean cross-entropy of `[N, V]` logits against `[N]` targets, rows whose
    /// target is `ignore_index` left out (PyTorch uses -100). Returns the
    /// scalar loss, f32 (f64 for f64 logits).
    pub fn cross_entropy(&mut self, logits: ValueId, targets: ValueId, ignore_index: i64) -> Result<ValueId> {
        let outs = self.push(CrossEntropy { ignore_index }.into(), &[logits, targets])?;
        Ok(outs[0])
    }
}

/// (ignore index, logits, targets) of the cross-entropy samples: a single
/// class, small rows, rows wide enough for several parallel CPU tasks, vocabularies of 3200 and 32000 and Qwen's 152064 with
/// few rows, every third target ignored, i32 and i64 targets; random
/// targets with nothing ignored; an ignore index that is a valid class;
/// every row ignored (a NaN loss, 0/0 as in PyTorch).
fn ce_cases(d: DType) -> Vec<(i64, Input, Input)> {
    const IGNORE: i64 = -100;
    let shapes = [(6, 1), (9, 7), (6, 11), (33, 128), (300, 7), (24, 700), (16, 3200), (8, 32000), (3, 152064)];
    let mut v = Vec::new();
    for (k, (rows, classes)) in shapes.into_iter().enumerate() {
        let tdt = if k % 2 == 0 { DType::I64 } else { DType::I32 };
        let t: Vec<f64> = (0..rows)
            .map(|i| if (i + k) % 3 == 0 { IGNORE as f64 } else { ((i * 7919 + 3 * k) % classes) as f64 })
            .collect();
        v.push((IGNORE, normal(d, &[rows, classes]), fixed(tdt, &[rows], &t)));
    }
    v.push((IGNORE, normal(d, &[6, 11]), ids(DType::I32, &[6], 11)));
    v.push((2, normal(d, &[4, 3]), fixed(DType::I32, &[4], &[2.0, 0.0, 2.0, 1.0])));
    v.push((2, normal(d, &[40, 5]), ids(DType::I32, &[40], 5)));
    v.push((IGNORE, normal(d, &[5, 11]), fixed(DType::I64, &[5], &[IGNORE as f64; 5])));
    v
}
