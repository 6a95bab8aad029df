//! The LM head and the cross-entropy loss as one op family that never holds
//! the full `[N, V]` logits: [`LinearCrossEntropy`] (forward: the loss and
//! the per-row log-sum-exp), [`LinearCrossEntropyBackward`] (the cotangents
//! of the hidden states and of the head weight) and the
//! [`Builder::linear_cross_entropy`] helper.
//!
//! `logits = hidden · weightᵀ` (`hidden: [N, C]`, `weight: [V, C]`) is
//! computed one chunk of vocabulary columns at a time into a `[N, chunk]`
//! buffer. The forward keeps a running max and a running sum per row (the
//! online log-sum-exp) and picks each row's target logit out of the chunk
//! that holds it. The backward recomputes each chunk's logits, turns them in
//! place into their cotangent `a·(softmax − onehot) + glse·softmax`, and
//! takes two products per chunk: the chunk's rows of `dweight` (written
//! once, every element one product over all `N` rows) and a partial
//! `dhidden` (written into the `dhidden` output, free until the end) added
//! into an f32 accumulator.
//!
//! **Why vocabulary chunks, not row chunks:** with row chunks every chunk
//! adds into all of `dweight` (`[V, C]`), which would need a `[V, C]` f32
//! accumulator (2.2 GB for the full Qwen2.5-7B head, 3584 features) or one
//! rounding to the param dtype per chunk. With vocabulary chunks the
//! accumulated cotangent is `dhidden` (`[N, C]`, 59 MB in f32 for 4096 ×
//! 3584), and `dweight` is rounded once, like a plain product's. The cost:
//! `dhidden` gets one rounding to the data dtype per chunk (each chunk's
//! partial product, before the f32 sum).
//!
//! **Workspace as outputs.** The buffers a kernel touches besides its
//! results are declared as extra outputs so the planner counts every byte:
//! they die at the node that makes them (nothing reads them), so they take
//! arena bytes only at that position. Kernels leave them all zero, which
//! makes them deterministic outputs whose Jacobian is zero (the VJP rule
//! ignores their cotangents, correctly); the cost is one fill of the
//! workspace per call, at most an eighth of a logits write at the default
//! chunk.
//! - forward outputs: `loss` (scalar), `lse` (`[N]`), `chunk_logits`
//!   (`[N, min(chunk, V)]`, the data dtype), `row_stats` (`[2, N]`: each
//!   row's running sum and target logit);
//! - backward outputs: `dhidden` (`[N, C]`), `dweight` (`[V, C]`),
//!   `chunk_logits`, `dhidden_acc` (`[N, C]`, the stat dtype).
//!
//! **Numerics**, the same on every backend: each chunk's logits are rounded
//! to the data dtype (as the unfused `matmul` output is), statistics and the
//! softmax are computed in the accumulator type (f32 for bf16/f16/f32, f64
//! for f64) and kept in [`stat_dtype`]; the chunk's cotangent is rounded to
//! the data dtype before its products (as the unfused cross-entropy
//! backward's output is); products accumulate in f32 inside; `dhidden` sums
//! the chunks' rounded partial products in the stat dtype in chunk order
//! and is rounded once at the end.
//!
//! Reductions: [`Reduction::Mean`] divides by the number of rows whose
//! target is not `ignore_index` (NaN when there is none, 0/0 as PyTorch),
//! [`Reduction::Sum`] does not.
//!
//! **Soft-capping** (`softcap > 0`, Gemma 2's `final_logit_softcapping`):
//! every logit `z` (the product as the chunk buffer holds it, read into the
//! accumulator type) becomes `softcap·tanh(z/softcap)` in the accumulator
//! type before anything reads it: the max, the sum, the target logit, the
//! softmax of the backward. The cotangent of `z` is the capped logit's
//! cotangent times the cap's slope `1 − (capped/softcap)²`, and is what is
//! rounded to the data dtype for the products. With `softcap` 0 no
//! instruction of the plain path changes.

use half::{bf16, f16};
use num_traits::{Float as _, Zero};
use rayon::prelude::*;

use super::loss::check_targets;
use super::sample::{fixed, ids, normal, scalar, Input, Sample};
use super::{expect_float, no_vjp, stat_dtype, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, Trace, ValueId};
use crate::ops::gemm::{gemm_bf16, gemm_f16, gemm_f32, gemm_f64, GemmDesc};
use crate::ops::kernel::{c, Float, KernelIo};
use crate::ops::Op;
use crate::with_float;

/// How the per-row losses become the loss.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Reduction {
    /// Divided by the number of rows whose target is not the ignore index.
    Mean,
    /// Summed over the rows whose target is not the ignore index.
    Sum,
}

/// The fused head and loss: `hidden [N, C]`, `weight [V, C]`, `targets [N]`
/// (i32 or i64) → `loss`, `lse [N]` and two workspaces (module doc).
#[derive(Clone, PartialEq, Debug)]
pub struct LinearCrossEntropy {
    /// Vocabulary columns per chunk (≥ 1); see [`default_chunk`].
    pub chunk: usize,
    pub reduction: Reduction,
    pub ignore_index: i64,
    /// Logit soft-capping `z ↦ softcap·tanh(z/softcap)` before the softmax
    /// (module doc); 0 for none. Printed in a trace only when set.
    pub softcap: f64,
}

/// The cotangents of [`LinearCrossEntropy`]'s hidden states and weight:
/// inputs `(hidden, weight, targets, lse, gloss[, glse])`, outputs
/// `dhidden`, `dweight` and two workspaces (module doc).
#[derive(Clone, PartialEq, Debug)]
pub struct LinearCrossEntropyBackward {
    pub chunk: usize,
    pub reduction: Reduction,
    pub ignore_index: i64,
    /// The forward's soft-cap (0: none).
    pub softcap: f64,
    /// Compute the head weight's gradient (output 1). Off when nothing reads
    /// it (a frozen head under adapters, [`skip_unread_weight_gradients`]):
    /// output 1 is then empty (`[0]`) and its products are not run.
    pub weight_grad: bool,
}

/// Turns off the head weight's gradient in every fused-loss backward whose
/// weight gradient nothing reads (the step's outputs and updates included):
/// a frozen head under adapters, whose `[vocab, width]` gradient would
/// otherwise be planned and computed for nothing (1.05 GB and a quarter of
/// the loss's backward products for Llama-3-8B). Returns the trace and how
/// many were turned off.
pub fn skip_unread_weight_gradients(trace: &Trace) -> (Trace, usize) {
    let mut read = vec![false; trace.values.len()];
    for node in &trace.nodes {
        for i in &node.inputs {
            read[i.index()] = true;
        }
    }
    for o in &trace.outputs {
        read[o.value.index()] = true;
    }
    for u in &trace.updates {
        read[u.new.index()] = true;
    }
    let mut out = trace.clone();
    let mut skipped = 0;
    for node in &mut out.nodes {
        let Op::LinearCrossEntropyBackward(op) = &mut node.op else { continue };
        // Outputs: dhidden, dweight, and two workspaces.
        let dweight = node.outputs[1];
        if !op.weight_grad || read[dweight.index()] {
            continue;
        }
        op.weight_grad = false;
        let ty = &mut out.values[dweight.index()].ty;
        *ty = TensorType::new(ty.dtype, [0]);
        skipped += 1;
    }
    (out, skipped)
}

/// The largest workspace the default chunk gives: 64 MiB of logits. The
/// chunk's logits are live at the loss's backward, next to every saved
/// activation (W2's peak), so they are kept small; 64 MiB is still thousands
/// of columns for thousands of rows, products large enough to run at speed.
pub const DEFAULT_CHUNK_BYTES_CAP: usize = 64 << 20;
/// The default chunk holds at most this fraction (1/n) of the full logits.
pub const DEFAULT_CHUNK_FRACTION: usize = 8;

/// The default vocabulary chunk for `rows` rows of `vocab` classes in
/// `dtype`: at most 1/[`DEFAULT_CHUNK_FRACTION`] of the full logits and at
/// most [`DEFAULT_CHUNK_BYTES_CAP`] bytes, rounded down to a multiple of 64
/// columns when that leaves at least 64 (aligned product operands), never
/// below one column. W2 (4096 bf16 rows of Qwen2.5's 152064 classes): the
/// cap binds, 8192 columns (19 chunks); W5 (8192 rows of 32000): an eighth,
/// 3968 columns.
pub fn default_chunk(rows: usize, vocab: usize, dtype: DType) -> usize {
    let by_fraction = vocab.div_ceil(DEFAULT_CHUNK_FRACTION);
    let by_bytes = DEFAULT_CHUNK_BYTES_CAP / (rows.max(1) * dtype.size());
    let cols = by_fraction.min(by_bytes);
    if cols >= 64 {
        cols / 64 * 64
    } else {
        cols.max(1)
    }
}

/// The resolved sizes of one op: `n` rows, `c` hidden features, `v`
/// classes and `w` columns of the chunk buffer.
struct Dims {
    n: usize,
    c: usize,
    v: usize,
    w: usize,
}

/// The shape rule shared by the forward and the backward's first three
/// inputs, and the attributes' own rule.
fn check_operands(chunk: usize, softcap: f64, inputs: &[&TensorType]) -> std::result::Result<Dims, String> {
    check_softcap(softcap)?;
    let (hidden, weight, targets) = (inputs[0], inputs[1], inputs[2]);
    expect_float(hidden, "hidden")?;
    if hidden.rank() != 2 {
        return Err(format!("hidden must be [rows, features], got {hidden}"));
    }
    if weight.rank() != 2 || weight.dtype != hidden.dtype || weight.shape[1] != hidden.shape[1] {
        return Err(format!(
            "weight must be [classes, {}] {} (the head, one row per class), got {weight}",
            hidden.shape[1], hidden.dtype
        ));
    }
    if weight.shape[0] == 0 {
        return Err(format!("weight {weight} has no classes"));
    }
    if !targets.dtype.is_int() || targets.rank() != 1 || targets.shape[0] != hidden.shape[0] {
        return Err(format!(
            "targets must be a 1-D i32 or i64 tensor with one entry per hidden row ({}), got {targets}",
            hidden.shape[0]
        ));
    }
    if chunk == 0 {
        return Err("chunk must be at least one vocabulary column, got 0".into());
    }
    let (n, c, v) = (hidden.shape[0], hidden.shape[1], weight.shape[0]);
    Ok(Dims { n, c, v, w: chunk.min(v) })
}

fn check_softcap(softcap: f64) -> std::result::Result<(), String> {
    if !(softcap.is_finite() && softcap >= 0.0) {
        return Err(format!("the logit soft-cap must be a positive number or 0 (none), got {softcap}"));
    }
    Ok(())
}

/// The attributes both ops print; the soft-cap only when set, so traces of
/// uncapped heads read (and golden files stay) as before.
fn attrs_of(chunk: usize, reduction: Reduction, ignore_index: i64, softcap: f64) -> Vec<(&'static str, Attr)> {
    let mut a = vec![
        ("chunk", Attr::Int(chunk as i64)),
        ("mean", Attr::Bool(reduction == Reduction::Mean)),
        ("ignore_index", Attr::Int(ignore_index)),
    ];
    if softcap != 0.0 {
        a.push(("softcap", Attr::Float(softcap)));
    }
    a
}

/// `(chunk, reduction, ignore_index, softcap)`, the soft-cap 0 when absent.
fn parse_attrs(a: &mut Attrs) -> Result<(usize, Reduction, i64, f64)> {
    let chunk = a.usize("chunk")?;
    let reduction = if a.bool("mean")? { Reduction::Mean } else { Reduction::Sum };
    let ignore_index = a.int("ignore_index")?;
    let softcap = if a.map.contains_key("softcap") { a.float("softcap")? } else { 0.0 };
    check_softcap(softcap).map_err(|e| Error::op(&a.op, e))?;
    Ok((chunk, reduction, ignore_index, softcap))
}

/// The soft-cap in the accumulator type `A`: `None` for none.
#[derive(Copy, Clone)]
struct Cap<A>(Option<A>);

impl<A: num_traits::Float + num_traits::FromPrimitive> Cap<A> {
    fn new(softcap: f64) -> Self {
        Cap((softcap > 0.0).then(|| c(softcap)))
    }

    /// The logit of the product `z`: `cap·tanh(z/cap)`, or `z` itself.
    #[inline]
    fn logit(self, z: A) -> A {
        match self.0 {
            Some(cap) => cap * (z / cap).tanh(),
            None => z,
        }
    }

    /// The cotangent of the product from `g`, the cotangent of its logit
    /// `capped`: `g·(1 − (capped/cap)²)`, or `g` itself.
    #[inline]
    fn chain(self, g: A, capped: A) -> A {
        match self.0 {
            Some(cap) => {
                let r = capped / cap;
                g * (A::one() - r * r)
            }
            None => g,
        }
    }
}

/// A storage type with its statistics type and its CPU product.
trait HeadFloat: Float {
    type Stat: Float<Acc = <Self as Float>::Acc>;
    fn gemm(desc: &GemmDesc, a: &[Self], b: &[Self], c: &mut [Self]);
}
impl HeadFloat for f32 {
    type Stat = f32;
    fn gemm(desc: &GemmDesc, a: &[f32], b: &[f32], c: &mut [f32]) {
        gemm_f32(desc, a, b, c)
    }
}
impl HeadFloat for f64 {
    type Stat = f64;
    fn gemm(desc: &GemmDesc, a: &[f64], b: &[f64], c: &mut [f64]) {
        gemm_f64(desc, a, b, c)
    }
}
impl HeadFloat for bf16 {
    type Stat = f32;
    fn gemm(desc: &GemmDesc, a: &[bf16], b: &[bf16], c: &mut [bf16]) {
        gemm_bf16(desc, a, b, c)
    }
}
impl HeadFloat for f16 {
    type Stat = f32;
    fn gemm(desc: &GemmDesc, a: &[f16], b: &[f16], c: &mut [f16]) {
        gemm_f16(desc, a, b, c)
    }
}

/// One plain row-major product `C[m, n] = op(A) · op(B)` (no batch).
fn plain(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> GemmDesc {
    GemmDesc { batch: 1, m, n, k, trans_a, trans_b, broadcast_b: false }
}

/// `chunk_logits[.., ..cw] = hidden · weight[v0 .. v0 + cw]ᵀ`, returned as
/// the `[n, cw]` prefix of the chunk buffer.
fn chunk_logits<'a, T: HeadFloat>(
    d: &Dims,
    hidden: &[T],
    weight: &[T],
    buf: &'a mut [T],
    v0: usize,
) -> (&'a mut [T], usize) {
    let cw = d.w.min(d.v - v0);
    let out = &mut buf[..d.n * cw];
    T::gemm(&plain(d.n, cw, d.c, false, true), hidden, &weight[v0 * d.c..(v0 + cw) * d.c], out);
    (out, cw)
}

/// The shift of the log-sum-exp: the running max, or 0 when it is infinite
/// (PyTorch's `logsumexp` rule: an all `-inf` row gives `-inf`, not NaN).
fn shift<A: num_traits::Float>(m: A) -> A {
    if m.is_finite() {
        m
    } else {
        A::zero()
    }
}

fn zero<T: Float>(buf: &mut [T]) {
    buf.par_iter_mut().for_each(|x| *x = T::from_acc(<T as Float>::Acc::zero()));
}

// ---------------------------------------------------------------- forward

impl OpDef for LinearCrossEntropy {
    /// `lce_cases`.
    fn samples(d: DType) -> Vec<Sample> {
        lce_cases(d)
            .into_iter()
            .map(|case| {
                let op = LinearCrossEntropy {
                    chunk: case.chunk,
                    reduction: case.reduction,
                    ignore_index: case.ignore,
                    softcap: case.softcap,
                };
                let s = Sample::new(op, vec![case.hidden, case.weight, case.targets]);
                if case.large {
                    s.large()
                } else {
                    s
                }
            })
            .collect()
    }
    fn name(&self) -> &'static str {
        "linear_cross_entropy"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.len() != 3 {
            return Err(format!("expects 3 inputs (hidden, weight, targets), got {}", inputs.len()));
        }
        let d = check_operands(self.chunk, self.softcap, inputs)?;
        let (dt, st) = (inputs[0].dtype, stat_dtype(inputs[0].dtype));
        Ok(vec![
            TensorType::scalar(st),
            TensorType::new(st, vec![d.n]),
            TensorType::new(dt, vec![d.n, d.w]),
            TensorType::new(st, vec![2, d.n]),
        ])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        // Outputs 2 and 3 are workspaces left all zero: a constant, so their
        // cotangents contribute nothing.
        let (gloss, glse) = (args.cotangents[0], args.cotangents[1]);
        if gloss.is_none() && glse.is_none() {
            return Ok(vec![None, None, None]);
        }
        let lse = args.outputs[1];
        let gloss = match gloss {
            Some(g) => g,
            None => b.full(0.0, TensorType::scalar(b.dtype(lse)))?,
        };
        let mut ins = vec![args.inputs[0], args.inputs[1], args.inputs[2], lse, gloss];
        ins.extend(glse);
        let op = LinearCrossEntropyBackward {
            chunk: self.chunk,
            reduction: self.reduction,
            ignore_index: self.ignore_index,
            softcap: self.softcap,
            weight_grad: true,
        };
        let g = b.push(op.into(), &ins)?;
        // Targets are integers: no cotangent.
        Ok(vec![Some(g[0]), Some(g[1]), None])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let tys = [io.in_ty(0), io.in_ty(1), io.in_ty(2)];
        let d = check_operands(self.chunk, self.softcap, &tys).map_err(|e| Error::op(self.name(), e))?;
        let targets = io.ids(2)?;
        check_targets(&targets, d.v, self.ignore_index)?;
        with_float!(io.in_ty(0).dtype, T => forward_kernel::<T>(self, &d, io, &targets))
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        attrs_of(self.chunk, self.reduction, self.ignore_index, self.softcap)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "linear_cross_entropy").then(|| {
            let (chunk, reduction, ignore_index, softcap) = parse_attrs(a)?;
            Ok(LinearCrossEntropy { chunk, reduction, ignore_index, softcap })
        })
    }
}

fn forward_kernel<T: HeadFloat>(op: &LinearCrossEntropy, d: &Dims, io: &KernelIo, targets: &[i64]) -> Result<()> {
    type A<T> = <T as Float>::Acc;
    let (hidden, weight) = (io.input::<T>(0), io.input::<T>(1));
    let (loss, lse) = (io.output::<T::Stat>(0), io.output::<T::Stat>(1));
    let buf = io.output::<T>(2);
    let (run_sum, target_logit) = io.output::<T::Stat>(3).split_at_mut(d.n);
    let cap = Cap::<A<T>>::new(op.softcap);
    let logit = |x: &T| cap.logit(x.acc());
    // `lse` holds each row's running max until the last chunk.
    lse.par_iter_mut().for_each(|m| *m = T::Stat::from_acc(A::<T>::neg_infinity()));
    zero(run_sum);
    zero(target_logit);
    for v0 in (0..d.v).step_by(d.w) {
        let (logits, cw) = chunk_logits(d, hidden, weight, buf, v0);
        logits
            .par_chunks(cw)
            .zip(lse.par_iter_mut())
            .zip(run_sum.par_iter_mut())
            .zip(target_logit.par_iter_mut())
            .enumerate()
            .for_each(|(n, (((row, m), s), tl))| {
                let old_max = m.acc();
                let new_max = row.iter().fold(old_max, |mx, x| mx.max(logit(x)));
                let sh = shift(new_max);
                // Rescaling an empty sum is skipped: 0 · exp(+huge) would be NaN.
                let old = s.acc();
                let mut sum = if old.is_zero() { old } else { old * (shift(old_max) - sh).exp() };
                for x in row {
                    sum = sum + (logit(x) - sh).exp();
                }
                *m = T::Stat::from_acc(new_max);
                *s = T::Stat::from_acc(sum);
                let t = targets[n];
                if t != op.ignore_index && (v0 as i64..(v0 + cw) as i64).contains(&t) {
                    *tl = T::Stat::from_acc(logit(&row[t as usize - v0]));
                }
            });
    }
    lse.par_iter_mut().zip(run_sum.par_iter()).for_each(|(m, s)| {
        let mx = m.acc();
        *m = T::Stat::from_acc(s.acc().ln() + shift(mx));
    });
    // Kept rows summed serially in row order: O(N) next to the products, and
    // fixed-order so the loss is bit-reproducible.
    let mut sum = A::<T>::zero();
    let mut kept = 0usize;
    for (n, &t) in targets.iter().enumerate() {
        if t != op.ignore_index {
            sum = sum + (lse[n].acc() - target_logit[n].acc());
            kept += 1;
        }
    }
    loss[0] = T::Stat::from_acc(match op.reduction {
        Reduction::Mean => sum / c::<A<T>>(kept as f64),
        Reduction::Sum => sum,
    });
    zero(buf);
    zero(run_sum);
    zero(target_logit);
    Ok(())
}

// ---------------------------------------------------------------- backward

impl OpDef for LinearCrossEntropyBackward {
    /// `lce_cases` with lse from the forward: a loss cotangent alone, with
    /// the lse cotangent, the lse cotangent alone (a zero loss cotangent),
    /// and neither (zero gradients). The single-class case is left out: its
    /// gradient is exactly zero, and a narrow run's `lse` (from logits
    /// rounded to the narrow type) against the f64 run's recomputed logits
    /// leaves only that rounding, which no relative comparison can judge.
    fn samples(d: DType) -> Vec<Sample> {
        let st = stat_dtype(d);
        let mut v = Vec::new();
        for case in lce_cases(d).into_iter().filter(|c| c.weight.ty().shape[0] > 1) {
            let n = case.hidden.ty().shape[0];
            let (chunk, reduction, ignore_index, softcap) = (case.chunk, case.reduction, case.ignore, case.softcap);
            for weight_grad in [true, false] {
                let op = LinearCrossEntropyBackward { chunk, reduction, ignore_index, softcap, weight_grad };
                let s = Sample::new(op, vec![case.hidden.clone(), case.weight.clone(), case.targets.clone()]);
                let args = vec![s.earlier(0), s.earlier(1), s.earlier(2)];
                let s = s.with_output(LinearCrossEntropy { chunk, reduction, ignore_index, softcap }, args, 1);
                let s = if case.large { s.large() } else { s };
                if !weight_grad {
                    // Without the weight gradient: one of the four cases is enough.
                    v.push(s.with(scalar(st, 0.75)).with(normal(st, &[n])));
                    continue;
                }
                v.push(s.clone().with(scalar(st, 0.75)));
                v.push(s.clone().with(scalar(st, 0.75)).with(normal(st, &[n])));
                v.push(s.clone().with(scalar(st, 0.0)).with(normal(st, &[n])));
                v.push(s.with(scalar(st, 0.0)));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "linear_cross_entropy_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.len() != 5 && inputs.len() != 6 {
            return Err(format!(
                "expects 5 or 6 inputs (hidden, weight, targets, lse, gloss[, glse]), got {}",
                inputs.len()
            ));
        }
        let d = check_operands(self.chunk, self.softcap, inputs)?;
        let (dt, st) = (inputs[0].dtype, stat_dtype(inputs[0].dtype));
        let row_stat = TensorType::new(st, vec![d.n]);
        super::expect_same(inputs[3], &row_stat, "lse")?;
        super::expect_same(inputs[4], &TensorType::scalar(st), "the loss cotangent")?;
        if let Some(glse) = inputs.get(5) {
            super::expect_same(glse, &row_stat, "the lse cotangent")?;
        }
        let dweight = if self.weight_grad { inputs[1].clone() } else { TensorType::new(dt, [0]) };
        Ok(vec![inputs[0].clone(), dweight, TensorType::new(dt, vec![d.n, d.w]), TensorType::new(st, vec![d.n, d.c])])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let tys = [io.in_ty(0), io.in_ty(1), io.in_ty(2)];
        let d = check_operands(self.chunk, self.softcap, &tys).map_err(|e| Error::op(self.name(), e))?;
        let targets = io.ids(2)?;
        check_targets(&targets, d.v, self.ignore_index)?;
        with_float!(io.in_ty(0).dtype, T => backward_kernel::<T>(self, &d, io, &targets))
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut a = attrs_of(self.chunk, self.reduction, self.ignore_index, self.softcap);
        // Printed only when off, so traces of trained heads read as before.
        if !self.weight_grad {
            a.push(("weight_grad", Attr::Bool(false)));
        }
        a
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "linear_cross_entropy_backward").then(|| {
            let (chunk, reduction, ignore_index, softcap) = parse_attrs(a)?;
            let weight_grad = a.opt_bool("weight_grad")?.unwrap_or(true);
            Ok(LinearCrossEntropyBackward { chunk, reduction, ignore_index, softcap, weight_grad })
        })
    }
}

fn backward_kernel<T: HeadFloat>(
    op: &LinearCrossEntropyBackward,
    d: &Dims,
    io: &KernelIo,
    targets: &[i64],
) -> Result<()> {
    type A<T> = <T as Float>::Acc;
    let (hidden, weight) = (io.input::<T>(0), io.input::<T>(1));
    let lse = io.input::<T::Stat>(3);
    let gloss = io.input::<T::Stat>(4)[0].acc();
    let glse = (io.inputs.len() == 6).then(|| io.input::<T::Stat>(5));
    let (dhidden, dweight, buf) = (io.output::<T>(0), io.output::<T>(1), io.output::<T>(2));
    let acc = io.output::<T::Stat>(3);
    let cap = Cap::<A<T>>::new(op.softcap);
    let kept = targets.iter().filter(|&&t| t != op.ignore_index).count();
    // One rounded scale for every row. Unused when no row is kept (every
    // `a_n` is then 0, as PyTorch's zero gradient).
    let scale = match op.reduction {
        Reduction::Mean => gloss / c::<A<T>>(kept.max(1) as f64),
        Reduction::Sum => gloss,
    };
    zero(acc);
    for v0 in (0..d.v).step_by(d.w) {
        let (g, cw) = chunk_logits(d, hidden, weight, buf, v0);
        g.par_chunks_mut(cw).enumerate().for_each(|(n, row)| {
            let t = targets[n];
            let a = if t == op.ignore_index { A::<T>::zero() } else { scale };
            let b = glse.map_or(A::<T>::zero(), |g| g[n].acc());
            if a.is_zero() && b.is_zero() {
                // Also avoids 0 · exp(...) turning into NaN for infinite logits.
                row.fill(T::from_acc(A::<T>::zero()));
                return;
            }
            let (l, coef) = (lse[n].acc(), a + b);
            for (j, x) in row.iter_mut().enumerate() {
                let onehot = if (v0 + j) as i64 == t { a } else { A::<T>::zero() };
                let z = cap.logit(x.acc());
                *x = T::from_acc(cap.chain(coef * (z - l).exp() - onehot, z));
            }
        });
        let g: &[T] = g;
        // This chunk's rows of dweight: dlogits[:, chunk]ᵀ · hidden, over all rows at once.
        if op.weight_grad {
            T::gemm(&plain(cw, d.c, d.n, true, false), g, hidden, &mut dweight[v0 * d.c..(v0 + cw) * d.c]);
        }
        // This chunk's share of dhidden, dlogits[:, chunk] · weight[chunk],
        // in dhidden's own buffer (the final value is written after the last chunk).
        T::gemm(&plain(d.n, d.c, cw, false, false), g, &weight[v0 * d.c..(v0 + cw) * d.c], dhidden);
        acc.par_iter_mut().zip(dhidden.par_iter()).for_each(|(s, p)| *s = T::Stat::from_acc(s.acc() + p.acc()));
    }
    dhidden.par_iter_mut().zip(acc.par_iter()).for_each(|(o, s)| *o = T::from_acc(s.acc()));
    zero(buf);
    zero(acc);
    Ok(())
}

impl Builder {
    /// The loss of the head `weight` (`[V, C]`, one row per class) on
    /// `hidden` (`[N, C]`) against `targets` (`[N]`), as
    /// `cross_entropy(hidden · weightᵀ)` but without the `[N, V]` logits:
    /// `chunk` vocabulary columns at a time ([`default_chunk`] is the usual
    /// choice). Returns the scalar loss, f32 (f64 for f64 data).
    pub fn linear_cross_entropy(
        &mut self,
        hidden: ValueId,
        weight: ValueId,
        targets: ValueId,
        chunk: usize,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Result<ValueId> {
        let op = LinearCrossEntropy { chunk, reduction, ignore_index, softcap: 0.0 };
        self.linear_cross_entropy_with(op, hidden, weight, targets)
    }

    /// [`Builder::linear_cross_entropy`] as the op `op` says, a soft-cap
    /// of the logits included. Returns the scalar loss.
    pub fn linear_cross_entropy_with(
        &mut self,
        op: LinearCrossEntropy,
        hidden: ValueId,
        weight: ValueId,
        targets: ValueId,
    ) -> Result<ValueId> {
        Ok(self.push(op.into(), &[hidden, weight, targets])?[0])
    }
}

/// One sample case of the family.
struct Case {
    hidden: Input,
    weight: Input,
    targets: Input,
    chunk: usize,
    reduction: Reduction,
    ignore: i64,
    softcap: f64,
    large: bool,
}

/// The cases: a single class; chunks that divide the vocabulary, one that
/// leaves a narrower last chunk, one wider than the vocabulary; mean and
/// sum; every third target ignored, i32 and i64 targets; an ignore index
/// that is a valid class; every row ignored (a NaN mean, a zero sum);
/// soft-capped logits, caps of 2 and 5 against logits of standard
/// deviation 2 to 4 (the features' square root), so the cap bites, over
/// chunks that leave a narrower last one, whole 16-byte packs and a
/// single chunk, a valid-class ignore index and every row ignored; and,
/// for the GPU sweep only, Qwen2.5's 152064 classes in the default chunk,
/// plain and capped at 5.
fn lce_cases(d: DType) -> Vec<Case> {
    const IGNORE: i64 = -100;
    use Reduction::{Mean, Sum};
    // (rows, features, classes, chunk, reduction)
    let shapes = [
        (6, 4, 1, 1, Mean),
        (9, 5, 7, 3, Mean),
        (12, 8, 33, 8, Sum),
        (7, 6, 20, 64, Mean),
        (33, 16, 130, 32, Sum),
        (16, 12, 300, 64, Mean),
    ];
    // The targets of case k: every third row ignored, the others spread over the classes.
    let spread = |rows: usize, classes: usize, k: usize| -> Vec<f64> {
        (0..rows)
            .map(|i| if (i + k).is_multiple_of(3) { IGNORE as f64 } else { ((i * 7919 + 3 * k) % classes) as f64 })
            .collect()
    };
    let mut v = Vec::new();
    for (k, (rows, feats, classes, chunk, reduction)) in shapes.into_iter().enumerate() {
        let tdt = if k % 2 == 0 { DType::I64 } else { DType::I32 };
        let t = spread(rows, classes, k);
        v.push(Case {
            hidden: normal(d, &[rows, feats]),
            weight: normal(d, &[classes, feats]),
            targets: fixed(tdt, &[rows], &t),
            chunk,
            reduction,
            ignore: IGNORE,
            softcap: 0.0,
            large: false,
        });
    }
    let case = |rows, feats, classes, chunk, reduction, ignore, targets| Case {
        hidden: normal(d, &[rows, feats]),
        weight: normal(d, &[classes, feats]),
        targets,
        chunk,
        reduction,
        ignore,
        softcap: 0.0,
        large: false,
    };
    let capped = |softcap, case: Case| Case { softcap, ..case };
    v.push(case(10, 6, 11, 4, Sum, IGNORE, ids(DType::I32, &[10], 11)));
    v.push(case(4, 5, 3, 2, Mean, 2, fixed(DType::I32, &[4], &[2.0, 0.0, 2.0, 1.0])));
    v.push(case(5, 4, 11, 4, Mean, IGNORE, fixed(DType::I64, &[5], &[IGNORE as f64; 5])));
    v.push(case(5, 4, 11, 4, Sum, IGNORE, fixed(DType::I64, &[5], &[IGNORE as f64; 5])));
    // Soft-capped: a narrower last chunk; whole packs (8 of 33 columns);
    // one chunk wider than the vocabulary; a valid-class ignore index;
    // every row ignored.
    v.push(capped(2.0, case(9, 5, 7, 3, Mean, IGNORE, fixed(DType::I64, &[9], &spread(9, 7, 1)))));
    v.push(capped(5.0, case(12, 16, 33, 8, Sum, IGNORE, fixed(DType::I32, &[12], &spread(12, 33, 2)))));
    v.push(capped(2.0, case(7, 6, 20, 64, Mean, IGNORE, ids(DType::I64, &[7], 20))));
    v.push(capped(5.0, case(33, 16, 130, 32, Mean, 2, ids(DType::I32, &[33], 130))));
    v.push(capped(2.0, case(5, 4, 11, 4, Mean, IGNORE, fixed(DType::I64, &[5], &[IGNORE as f64; 5]))));
    let (rows, classes) = (24, 152_064);
    let big = |softcap| Case {
        large: true,
        ..capped(
            softcap,
            case(rows, 16, classes, default_chunk(rows, classes, d), Mean, IGNORE, ids(DType::I32, &[rows], 152_064)),
        )
    };
    v.push(big(0.0));
    v.push(big(5.0));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_chunk_is_an_eighth_of_the_logits_under_a_cap() {
        // W2: Qwen2.5's vocabulary on 4096 bf16 rows, the 64 MiB cap binds.
        assert_eq!(default_chunk(4096, 152_064, DType::BF16), 8192);
        assert_eq!(default_chunk(65_536, 152_064, DType::F32), 256);
        // W5: 32000 / 8 = 4000, rounded down to 62 · 64.
        assert_eq!(default_chunk(8192, 32_000, DType::BF16), 3968);
        // Small vocabularies: an eighth, at least one column.
        assert_eq!(default_chunk(8, 33, DType::F64), 5);
        assert_eq!(default_chunk(8, 1, DType::F64), 1);
        // No rows does not divide by zero.
        assert_eq!(default_chunk(0, 100, DType::BF16), 13);
    }
}
