//! Reductions over axes (sum, mean, max) and the max reduction's backward.

use num_traits::{Float as _, ToPrimitive, Zero};

use super::sample::{normal, ties, Sample};
use super::{expect_float, expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{c, Float, KernelIo};
use crate::with_float;
use rayon::prelude::*;

#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
}

/// Reduces `axes` (sorted, unique) of the input.
#[derive(Clone, PartialEq, Debug)]
pub struct Reduce {
    pub kind: ReduceKind,
    pub axes: Vec<usize>,
    pub keepdim: bool,
}

/// The reduced shape: `axes` removed, or kept as 1 with `keepdim`.
fn reduced_shape(shape: &[usize], axes: &[usize], keepdim: bool) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, &d) in shape.iter().enumerate() {
        if axes.contains(&i) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(d);
        }
    }
    out
}

fn check_axes(axes: &[usize], rank: usize) -> std::result::Result<(), String> {
    if axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("axes {axes:?} must be sorted and unique"));
    }
    if let Some(&a) = axes.iter().find(|&&a| a >= rank) {
        return Err(format!("axis {a} out of range for rank {rank}"));
    }
    Ok(())
}

/// Iteration plan for a reduction: for every output element, the input
/// offsets of the reduced elements, walked with an odometer so no offset
/// table proportional to the input is ever built.
struct ReducePlan {
    kept: Vec<(usize, usize)>,    // (size, input stride), outer to inner
    reduced: Vec<(usize, usize)>, // (size, input stride), outer to inner
    count: usize,
}

impl ReducePlan {
    fn new(shape: &[usize], axes: &[usize]) -> Self {
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        let (mut kept, mut reduced) = (Vec::new(), Vec::new());
        for i in 0..shape.len() {
            if axes.contains(&i) {
                reduced.push((shape[i], strides[i]));
            } else {
                kept.push((shape[i], strides[i]));
            }
        }
        let count = reduced.iter().map(|r| r.0).product();
        ReducePlan { kept, reduced, count }
    }

    fn base(&self, mut o: usize) -> usize {
        let mut off = 0;
        for &(size, stride) in self.kept.iter().rev() {
            off += (o % size) * stride;
            o /= size;
        }
        off
    }

    /// Calls `f` with the input offset of every reduced element, in row-major order.
    fn for_each(&self, base: usize, mut f: impl FnMut(usize)) {
        if self.count == 0 {
            return;
        }
        let mut idx = vec![0usize; self.reduced.len()];
        let mut off = base;
        loop {
            f(off);
            let mut ax = self.reduced.len();
            loop {
                if ax == 0 {
                    return;
                }
                ax -= 1;
                let (size, stride) = self.reduced[ax];
                idx[ax] += 1;
                off += stride;
                if idx[ax] < size {
                    break;
                }
                off -= stride * size;
                idx[ax] = 0;
            }
        }
    }
}

impl OpDef for Reduce {
    /// Sum, mean and max, with and without kept axes, over `reduce_cases`.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for (shape, axes) in reduce_cases() {
            for keepdim in [false, true] {
                for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
                    let op = Reduce { kind, axes: axes.clone(), keepdim };
                    v.push(Sample::new(op, vec![normal(d, &shape)]).large_over(2000));
                }
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        match self.kind {
            ReduceKind::Sum => "sum",
            ReduceKind::Mean => "mean",
            ReduceKind::Max => "max",
        }
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        expect_float(inputs[0], "x")?;
        check_axes(&self.axes, inputs[0].rank())?;
        Ok(vec![inputs[0].with_shape(reduced_shape(&inputs[0].shape, &self.axes, self.keepdim))])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        let x = args.inputs[0];
        let shape = b.shape(x).to_vec();
        let kept = reduced_shape(&shape, &self.axes, true);
        let gk = b.reshape(g, &kept)?;
        let gx = match self.kind {
            ReduceKind::Sum => b.broadcast(gk, &shape)?,
            ReduceKind::Mean => {
                let n: usize = self.axes.iter().map(|&a| shape[a]).product();
                let scale = b.full(1.0 / n as f64, TensorType::scalar(b.dtype(g)))?;
                let gs = b.mul(gk, scale)?;
                b.broadcast(gs, &shape)?
            }
            ReduceKind::Max => {
                let yk = b.reshape(args.outputs[0], &kept)?;
                b.push1(MaxBackward { axes: self.axes.clone() }.into(), &[x, yk, gk])?
            }
        };
        Ok(vec![Some(gx)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let plan = ReducePlan::new(&io.in_ty(0).shape, &self.axes);
        let kind = self.kind;
        with_float!(io.in_ty(0).dtype, T => {
            let x = io.input::<T>(0);
            let y = io.output::<T>(0);
            let count = plan.count;
            let reduce_one = |o: usize| -> T {
                let base = plan.base(o);
                let v = match kind {
                    ReduceKind::Max => {
                        let mut m = <T as Float>::Acc::neg_infinity();
                        plan.for_each(base, |i| m = m.max(x[i].acc()));
                        m
                    }
                    _ => {
                        let mut s = <T as Float>::Acc::zero();
                        plan.for_each(base, |i| s += x[i].acc());
                        if kind == ReduceKind::Mean { s / c::<<T as Float>::Acc>(count as f64) } else { s }
                    }
                };
                T::from_acc(v)
            };
            if y.len() == 1 && kind != ReduceKind::Max && x.len() >= 1 << 16 {
                // A full reduction: fixed blocks summed in parallel, then the
                // block sums in order, so the result does not depend on threads.
                let partial: Vec<<T as Float>::Acc> = x
                    .par_chunks(1 << 14)
                    .map(|ch| ch.iter().map(|v| v.acc()).sum())
                    .collect();
                let s: <T as Float>::Acc = partial.into_iter().sum();
                y[0] = T::from_acc(if kind == ReduceKind::Mean { s / c::<<T as Float>::Acc>(count as f64) } else { s });
            } else {
                y.par_iter_mut().enumerate().with_min_len(64).for_each(|(o, v)| *v = reduce_one(o));
            }
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("axes", Attr::Ints(self.axes.iter().map(|&a| a as i64).collect())), ("keepdim", Attr::Bool(self.keepdim))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        let kind = match name {
            "sum" => ReduceKind::Sum,
            "mean" => ReduceKind::Mean,
            "max" => ReduceKind::Max,
            _ => return None,
        };
        let mut build =
            || -> Result<Self> { Ok(Reduce { kind, axes: a.usizes("axes")?, keepdim: a.bool("keepdim")? }) };
        Some(build())
    }
}

/// `gx = g` at the positions where `x` equals the max `y` (split evenly among ties), else 0.
/// Inputs: x, y and g, with y and g in keepdim shape.
#[derive(Clone, PartialEq, Debug)]
pub struct MaxBackward {
    pub axes: Vec<usize>,
}

impl OpDef for MaxBackward {
    /// `reduce_cases` on random values and on values full of ties (which
    /// share the cotangent), with the max from the forward.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for (shape, axes) in reduce_cases() {
            for tied in [false, true] {
                let x = if tied { ties(d, &shape) } else { normal(d, &shape) };
                let s = Sample::new(MaxBackward { axes: axes.clone() }, vec![x]);
                let max = Reduce { kind: ReduceKind::Max, axes: axes.clone(), keepdim: true };
                let s = s.clone().with_output(max, vec![s.earlier(0)], 0);
                let g = normal(d, &s.inputs[1].ty().shape);
                v.push(s.with(g).large_over(4000));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "max_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 3)?;
        check_axes(&self.axes, inputs[0].rank())?;
        let kept = inputs[0].with_shape(reduced_shape(&inputs[0].shape, &self.axes, true));
        super::expect_same(inputs[1], &kept, "max")?;
        super::expect_same(inputs[2], &kept, "cotangent")?;
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let plan = ReducePlan::new(&io.in_ty(0).shape, &self.axes);
        with_float!(io.in_ty(0).dtype, T => {
            let (x, y, g) = (io.input::<T>(0), io.input::<T>(1), io.input::<T>(2));
            let out = crate::ops::kernel::SendPtr(io.output::<T>(0).as_mut_ptr());
            (0..y.len()).into_par_iter().for_each(|o| {
                let base = plan.base(o);
                let m = y[o];
                let mut ties = 0usize;
                plan.for_each(base, |i| ties += (x[i] == m) as usize);
                let share = g[o].acc() / c::<<T as Float>::Acc>(ties.max(1) as f64);
                plan.for_each(base, |i| {
                    let v = if x[i] == m { share } else { <T as Float>::Acc::zero() };
                    // SAFETY: each output element belongs to exactly one reduced group.
                    unsafe { out.write(i, T::from_acc(v)) }
                });
            });
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("axes", Attr::Ints(self.axes.iter().map(|&a| a as i64).collect()))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "max_backward").then(|| Ok(MaxBackward { axes: a.usizes("axes")? }))
    }
}

// ---------------------------------------------------------- squared_norms

/// Elements per partial sum of [`SquaredNorms`]: a backend sums each run of
/// this many elements of a tensor in one place, then each tensor's runs in
/// order. The count of runs sizes the op's workspace output.
pub const SQUARED_NORM_CHUNK: usize = 16384;

/// The squared L2 norm of each input, `y[i] = Σ x_i²` over every element of
/// `x_i`, in the wide float type (f32; f64 for f64 inputs; the CPU
/// reference sums in f64 and rounds once, a backend sums in the wide type
/// in its own fixed order): what clipping by global norm needs of all the
/// gradients, in a few multi-tensor launches where a row sum of squares, a
/// sum and an add per gradient were three each
/// ([`crate::autodiff::clip_by_global_norm`]).
///
/// Inputs: one or more float tensors of one dtype, any shapes. Outputs:
/// the norms `[N]`, and a workspace of one wide value per
/// [`SQUARED_NORM_CHUNK`]-element run of each input (empty inputs have
/// none) that a backend may use for its partial sums and leaves all zero,
/// as the CPU writes it: a constant, so it has no cotangent.
#[derive(Clone, PartialEq, Debug)]
pub struct SquaredNorms;

impl SquaredNorms {
    /// The workspace's length for inputs of these element counts.
    pub fn chunks(numels: impl IntoIterator<Item = usize>) -> usize {
        numels.into_iter().map(|n| n.div_ceil(SQUARED_NORM_CHUNK)).sum()
    }
}

impl OpDef for SquaredNorms {
    /// One tensor, several of mixed ranks and sizes: a scalar, short rows,
    /// one element past a chunk, a long vector and a matrix of many chunks.
    fn samples(d: DType) -> Vec<Sample> {
        let sets: [&[&[usize]]; 4] = [
            &[&[7]],
            &[&[], &[3, 5], &[1]],
            &[&[64, 3200], &[3200], &[SQUARED_NORM_CHUNK + 1], &[2, 3, 17]],
            &[&[40_000], &[4, 1000], &[SQUARED_NORM_CHUNK]],
        ];
        sets.iter()
            .map(|shapes| Sample::new(SquaredNorms, shapes.iter().map(|s| normal(d, s)).collect()).large_over(100_000))
            .collect()
    }
    fn name(&self) -> &'static str {
        "squared_norms"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        let first = inputs.first().ok_or("needs at least one input")?;
        for (i, t) in inputs.iter().enumerate() {
            expect_float(t, &format!("input {i}"))?;
            if t.dtype != first.dtype {
                return Err(format!("input {i} is {t}, input 0 is {first}: the inputs must share one dtype"));
            }
        }
        let wide = super::stat_dtype(first.dtype);
        let chunks = SquaredNorms::chunks(inputs.iter().map(|t| t.numel()));
        Ok(vec![TensorType::new(wide, [inputs.len()]), TensorType::new(wide, [chunks])])
    }
    /// `gx_i = 2·x_i·g[i]`, `g[i]` rounded to the inputs' dtype.
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None; args.inputs.len()]) };
        let mut out = Vec::with_capacity(args.inputs.len());
        for (i, &x) in args.inputs.iter().enumerate() {
            let (shape, dtype) = (b.shape(x).to_vec(), b.dtype(x));
            let gi = b.slice(g, 0, i, i + 1)?;
            let gi = b.reshape(gi, &[])?;
            let gi = if b.dtype(gi) == dtype { gi } else { b.cast(gi, dtype)? };
            let gb = b.broadcast(gi, &shape)?;
            let two = b.full(2.0, TensorType::scalar(dtype))?;
            let x2 = b.mul(x, two)?;
            out.push(Some(b.mul(x2, gb)?));
        }
        Ok(out)
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        with_float!(io.in_ty(0).dtype, T => {
            // Runs summed in parallel, then in order: the same f64 bits on
            // any number of threads (rayon's own `sum` splits by load).
            let square = |v: &T| {
                let a = v.acc().to_f64().expect("a float");
                a * a
            };
            let norms: Vec<f64> = (0..io.inputs.len())
                .map(|i| {
                    let runs: Vec<f64> =
                        io.input::<T>(i).par_chunks(SQUARED_NORM_CHUNK).map(|run| run.iter().map(square).sum()).collect();
                    runs.iter().sum()
                })
                .collect();
            let y = io.output::<<T as Float>::Acc>(0);
            for (out, s) in y.iter_mut().zip(norms) {
                *out = c::<<T as Float>::Acc>(s);
            }
            io.output::<<T as Float>::Acc>(1).iter_mut().for_each(|v| *v = <T as Float>::Acc::zero());
            Ok(())
        })
    }
    fn parse(name: &str, _: &mut Attrs) -> Option<Result<Self>> {
        (name == "squared_norms").then_some(Ok(SquaredNorms))
    }
}

impl Builder {
    /// The squared L2 norm of each of `xs` (one dtype), as `[N]` in the
    /// wide float type ([`SquaredNorms`]).
    pub fn squared_norms(&mut self, xs: &[ValueId]) -> Result<ValueId> {
        Ok(self.push(SquaredNorms.into(), xs)?[0])
    }

    pub fn reduce(&mut self, kind: ReduceKind, x: ValueId, axes: &[usize], keepdim: bool) -> Result<ValueId> {
        self.push1(Reduce { kind, axes: axes.to_vec(), keepdim }.into(), &[x])
    }

    pub fn sum(&mut self, x: ValueId, axes: &[usize], keepdim: bool) -> Result<ValueId> {
        self.reduce(ReduceKind::Sum, x, axes, keepdim)
    }

    /// Sum of every element: a scalar. Reduces the last axis first, then
    /// the rest: two reductions that each spread over the whole machine
    /// (one output per row, then a short vector), where a single full
    /// reduction of a large tensor would leave all its work to one place.
    pub fn sum_all(&mut self, x: ValueId) -> Result<ValueId> {
        let rank = self.shape(x).len();
        let x = if rank > 1 { self.sum(x, &[rank - 1], false)? } else { x };
        let axes: Vec<usize> = (0..self.shape(x).len()).collect();
        self.sum(x, &axes, false)
    }

    /// Sums `x` down to `shape` (the inverse of broadcasting `shape` up to `x`'s shape).
    pub fn sum_to(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId> {
        let xs = self.shape(x).to_vec();
        if xs == shape {
            return Ok(x);
        }
        if shape.len() > xs.len() {
            return Err(Error::op("sum_to", format!("cannot sum {xs:?} to a larger rank {shape:?}")));
        }
        let lead = xs.len() - shape.len();
        let axes: Vec<usize> = (0..xs.len()).filter(|&i| i < lead || (shape[i - lead] == 1 && xs[i] != 1)).collect();
        let s = if axes.is_empty() { x } else { self.sum(x, &axes, true)? };
        self.reshape(s, shape)
    }
}

/// (shape, axes) of the reduction samples: the innermost axis reduced with
/// short rows (a warp per output on the GPU) and long rows (a block per
/// output), the innermost kept (column layout), first, middle, last, all
/// and non-adjacent axes, size-1 axes, no axes at all, and a scalar.
fn reduce_cases() -> Vec<(Vec<usize>, Vec<usize>)> {
    let c = |s: &[usize], a: &[usize]| (s.to_vec(), a.to_vec());
    vec![
        c(&[1], &[0]),
        c(&[17], &[0]),
        c(&[1031], &[0]),
        c(&[5000], &[0]),
        c(&[3, 4], &[0, 1]),
        c(&[33, 17], &[1]),
        c(&[1000, 3], &[1]),
        c(&[5, 1000], &[1]),
        c(&[300, 300], &[1]),
        c(&[3, 4100], &[1]),
        c(&[1000, 7], &[0]),
        c(&[3, 700], &[0]),
        c(&[2, 3, 4], &[0, 2]),
        c(&[2, 3, 5], &[2]),
        c(&[3, 5, 7], &[0]),
        c(&[3, 5, 7], &[1]),
        c(&[3, 5, 7], &[2]),
        c(&[3, 5, 7], &[0, 2]),
        c(&[8, 9, 10], &[0, 1, 2]),
        c(&[2, 3, 4, 5], &[1, 3]),
        c(&[4, 6, 8, 10], &[0, 2]),
        c(&[2, 3, 4, 5], &[0, 1, 2]),
        c(&[3, 1, 5], &[1]),
        c(&[3, 1, 5], &[0, 1]),
        c(&[3, 4], &[]),
        c(&[], &[]),
    ]
}
