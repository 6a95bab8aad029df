//! Normalisations over the last axis: RMSNorm (LLaMA) and LayerNorm, each
//! with one fused backward op, plus the [`Builder::rms_norm`] and
//! [`Builder::layer_norm`] helpers.
//!
//! The forward ops also output their per-row statistics (`rstd`, and `mean`
//! for LayerNorm) in the stat dtype ([`stat_dtype`]), so the backward reads
//! them instead of reducing the rows again, and narrow data loses nothing in
//! them. Weight and bias gradients are sums over rows, added in a fixed
//! block order so they do not depend on the thread count.
//!
//! The statistics are real outputs and may receive cotangents (a finite
//! difference check gives every output one); the backward ops take them as
//! optional trailing inputs so the VJP stays exact. Models never
//! differentiate through the statistics, and then those inputs are absent.

use std::ops::Range;

use num_traits::{Float as _, One, Zero};
use rayon::prelude::*;

use super::sample::{normal, positive, Sample};
use super::{expect_float, expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::Result;
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{c, Float, KernelIo};
use crate::with_float;

pub use super::stat_dtype;

/// Checks `x: [..., C]` (float, C > 0) and that every parameter is `[C]` of
/// x's dtype. Returns C.
fn check_rows(x: &TensorType, params: &[(&TensorType, &str)]) -> std::result::Result<usize, String> {
    expect_float(x, "x")?;
    let Some(&cdim) = x.shape.last() else {
        return Err(format!("x must have rank >= 1 (the normalised axis is the last), got {x}"));
    };
    if cdim == 0 {
        return Err(format!("the normalised (last) axis of x {x} is empty"));
    }
    let want = TensorType::new(x.dtype, [cdim]);
    for (p, what) in params {
        if **p != want {
            return Err(format!("{what} must be {want} to match x {x}, got {p}"));
        }
    }
    Ok(cdim)
}

/// The type of a per-row statistic of `x: [..., C]`: `[...]` in the stat dtype.
fn stat_type(x: &TensorType) -> TensorType {
    TensorType::new(stat_dtype(x.dtype), &x.shape[..x.rank() - 1])
}

fn expect_type(got: &TensorType, want: &TensorType, what: &str) -> std::result::Result<(), String> {
    if got != want {
        return Err(format!("{what} must be {want}, got {got}"));
    }
    Ok(())
}

/// Row-block size for the parameter-gradient sums. It depends only on the
/// row count, so the partial sums and the order they are added in are fixed;
/// at most `MAX_BLOCKS` partials of `width` accumulators exist at once.
fn row_block(rows: usize) -> usize {
    const MIN_ROWS: usize = 16;
    const MAX_BLOCKS: usize = 256;
    rows.div_ceil(MAX_BLOCKS).max(MIN_ROWS)
}

/// Runs `row(r, gx_row, partial)` for every row of `gx` (rows of `cdim`),
/// blocks of rows in parallel, each block accumulating into its own `width`
/// partial sums; returns the partials added in block order.
fn rows_with_sums<T: Float>(
    gx: &mut [T],
    cdim: usize,
    width: usize,
    row: impl Fn(usize, &mut [T], &mut [T::Acc]) + Sync,
) -> Vec<T::Acc> {
    let rows = gx.len() / cdim;
    let block = row_block(rows);
    let nblocks = rows.div_ceil(block);
    let mut partial = vec![T::Acc::zero(); nblocks * width];
    gx.par_chunks_mut(block * cdim).zip(partial.par_chunks_mut(width)).enumerate().for_each(|(bi, (gx_blk, part))| {
        for (k, gx_row) in gx_blk.chunks_mut(cdim).enumerate() {
            row(bi * block + k, gx_row, part);
        }
    });
    let mut sums = vec![T::Acc::zero(); width];
    sums.par_iter_mut().enumerate().with_min_len(256).for_each(|(k, s)| {
        *s = (0..nblocks).fold(T::Acc::zero(), |a, bi| a + partial[bi * width + k]);
    });
    sums
}

fn row_range(r: usize, cdim: usize) -> Range<usize> {
    r * cdim..(r + 1) * cdim
}

fn eps_attr(eps: f64) -> Vec<(&'static str, Attr)> {
    vec![("eps", Attr::Float(eps))]
}

/// Zeros of `like`'s type, for a missing cotangent of y when only a
/// statistic's cotangent flows.
fn or_zeros(b: &mut Builder, g: Option<ValueId>, like: ValueId) -> Result<ValueId> {
    match g {
        Some(g) => Ok(g),
        None => {
            let ty = b.ty(like).clone();
            b.full(0.0, ty)
        }
    }
}

// ---------------------------------------------------------------- rms_norm

/// `y = x · rstd · w` with `rstd = 1/sqrt(mean(x²) + eps)` over the last axis.
/// Inputs `x: [..., C]`, `w: [C]`; outputs `y` (x's type) and `rstd: [...]`.
#[derive(Clone, PartialEq, Debug)]
pub struct RmsNorm {
    pub eps: f64,
}

fn rms_norm_fwd<T: Float>(x: &[T], w: &[T], eps: f64, y: &mut [T], rstd: &mut [T::Acc]) {
    let cdim = w.len();
    let wa: Vec<T::Acc> = w.iter().map(|v| v.acc()).collect();
    let (eps, n): (T::Acc, T::Acc) = (c(eps), c(cdim as f64));
    y.par_chunks_mut(cdim).zip(rstd.par_iter_mut()).enumerate().with_min_len(16).for_each(|(r, (yr, rs))| {
        let xr = &x[row_range(r, cdim)];
        let ss: T::Acc = xr.iter().map(|v| v.acc() * v.acc()).sum();
        let inv = T::Acc::one() / (ss / n + eps).sqrt();
        *rs = inv;
        for ((o, xv), &wv) in yr.iter_mut().zip(xr).zip(&wa) {
            *o = T::from_acc(xv.acc() * inv * wv);
        }
    });
}

impl OpDef for RmsNorm {
    /// `ROW_SHAPES`, and a model-like `[2, 3, 8]` with eps 1e-5.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = vec![Sample::new(RmsNorm { eps: 1e-5 }, vec![normal(d, &[2, 3, 8]), normal(d, &[8])])];
        for shape in ROW_SHAPES {
            let c = shape[shape.len() - 1];
            v.push(Sample::new(RmsNorm { eps: 1e-6 }, vec![normal(d, shape), normal(d, &[c])]).large_over(20_000));
        }
        v
    }
    fn name(&self) -> &'static str {
        "rms_norm"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        check_rows(inputs[0], &[(inputs[1], "weight")])?;
        Ok(vec![inputs[0].clone(), stat_type(inputs[0])])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let (gy, grstd) = (args.cotangents[0], args.cotangents[1]);
        if gy.is_none() && grstd.is_none() {
            return Ok(vec![None, None]);
        }
        let gy = or_zeros(b, gy, args.outputs[0])?;
        let mut ins = vec![args.inputs[0], args.inputs[1], args.outputs[1], gy];
        ins.extend(grstd);
        let g = b.push(RmsNormBackward { eps: self.eps, addend: false }.into(), &ins)?;
        Ok(vec![Some(g[0]), Some(g[1])])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        with_float!(io.in_ty(0).dtype, T => {
            rms_norm_fwd::<T>(io.input(0), io.input(1), self.eps, io.output(0), io.output(1));
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        eps_attr(self.eps)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "rms_norm").then(|| Ok(RmsNorm { eps: a.float("eps")? }))
    }
}

/// The backward of [`RmsNorm`]: inputs `(x, w, rstd, gy[, grstd])`, outputs
/// `(gx, gw)` with, per row, `gx = rstd·(w⊙gy − x·rstd²·mean(x⊙w⊙gy))` (plus
/// `−grstd·rstd³·x/C` when rstd has a cotangent) and `gw = Σ_rows gy⊙x·rstd`.
/// `eps` is carried so the node prints like its forward and a backend may
/// recompute rstd instead of saving it. With `addend`, input 4 (before
/// grstd) has x's type and is added to gx before its rounding (the residual
/// stream's gradient, folded in by [`crate::passes::fusion`]); gx may take its storage.
/// The addend's input position in [`RmsNormBackward`]: after gy, before grstd.
pub const RMS_ADDEND: usize = 4;

#[derive(Clone, PartialEq, Debug)]
pub struct RmsNormBackward {
    pub eps: f64,
    pub addend: bool,
}

struct RmsGrads<'a, T: Float> {
    x: &'a [T],
    w: &'a [T],
    rstd: &'a [T::Acc],
    gy: &'a [T],
    grstd: Option<&'a [T::Acc]>,
    /// gx holds the addend on entry, to be added before rounding.
    accumulate: bool,
}

fn rms_norm_bwd<T: Float>(a: RmsGrads<T>, gx: &mut [T], gw: &mut [T]) {
    let cdim = a.w.len();
    let wa: Vec<T::Acc> = a.w.iter().map(|v| v.acc()).collect();
    let n: T::Acc = c(cdim as f64);
    let sums = rows_with_sums(gx, cdim, cdim, |r, gxr, part| {
        let (xr, gyr) = (&a.x[row_range(r, cdim)], &a.gy[row_range(r, cdim)]);
        let rs = a.rstd[r];
        let dot: T::Acc = xr.iter().zip(gyr).zip(&wa).map(|((x, g), &w)| x.acc() * w * g.acc()).sum();
        let gs = a.grstd.map_or(T::Acc::zero(), |g| g[r]);
        let coef = rs * rs * rs * (dot + gs) / n;
        for k in 0..cdim {
            let (x, g) = (xr[k].acc(), gyr[k].acc());
            let v = rs * wa[k] * g - x * coef;
            gxr[k] = T::from_acc(if a.accumulate { v + gxr[k].acc() } else { v });
            part[k] = part[k] + g * x * rs;
        }
    });
    for (o, s) in gw.iter_mut().zip(sums) {
        *o = T::from_acc(s);
    }
}

impl OpDef for RmsNormBackward {
    /// `ROW_SHAPES` without and with the rstd cotangent, rstd from the
    /// forward, except for rows of one element: there the input gradient of
    /// the forward's own rstd cancels to rounding noise, which no tolerance
    /// relative to the result bounds, so rstd is drawn independently.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for shape in ROW_SHAPES {
            let (rows, c) = (&shape[..shape.len() - 1], shape[shape.len() - 1]);
            let s = Sample::new(RmsNormBackward { eps: 1e-6, addend: false }, vec![normal(d, shape), normal(d, &[c])]);
            let s = if c == 1 {
                s.with(positive(stat_dtype(d), rows))
            } else {
                let args = vec![s.earlier(0), s.earlier(1)];
                s.with_output(RmsNorm { eps: 1e-6 }, args, 1)
            };
            let s = s.with(normal(d, shape)).large_over(40_000);
            v.push(s.clone());
            let with_grstd = s.clone().with(normal(stat_dtype(d), rows));
            v.push(with_grstd.clone());
            // The residual gradient folded in, without and with grstd.
            for s in [s, with_grstd] {
                v.push(s.with_input_at(RMS_ADDEND, normal(d, shape), RmsNormBackward { eps: 1e-6, addend: true }));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "rms_norm_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        let extra = self.addend as usize;
        if inputs.len() != 4 + extra && inputs.len() != 5 + extra {
            let add = if self.addend { " and the addend of gx" } else { "" };
            return Err(format!(
                "expects 4 inputs (x, w, rstd, gy) or 5 (.., grstd){add}, {} in all, got {}",
                if self.addend { "5 or 6" } else { "4 or 5" },
                inputs.len()
            ));
        }
        let x = inputs[0];
        check_rows(x, &[(inputs[1], "weight")])?;
        expect_type(inputs[2], &stat_type(x), "rstd")?;
        expect_type(inputs[3], x, "the cotangent of y")?;
        if self.addend {
            expect_type(inputs[RMS_ADDEND], x, "the addend of gx")?;
        }
        if inputs.len() == 5 + extra {
            expect_type(inputs[4 + extra], &stat_type(x), "the cotangent of rstd")?;
        }
        Ok(vec![x.clone(), inputs[1].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        with_float!(io.in_ty(0).dtype, T => {
            let n = io.inputs.len();
            let a = RmsGrads::<T> {
                x: io.input(0),
                w: io.input(1),
                rstd: io.input(2),
                gy: io.input(3),
                grstd: (n > 4 + self.addend as usize).then(|| io.input(n - 1)),
                accumulate: self.addend,
            };
            // With an addend, gx starts as the addend (and may be its storage).
            let gx = if self.addend { io.inplace(0, RMS_ADDEND) } else { io.output(0) };
            rms_norm_bwd(a, gx, io.output(1));
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        addend_attrs(self.eps, self.addend)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "rms_norm_backward")
            .then(|| Ok(RmsNormBackward { eps: a.float("eps")?, addend: a.opt_bool("addend")?.unwrap_or(false) }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        gx_takes_addend(self.addend, RMS_ADDEND)
    }
    fn with_addend(&self, output: usize, inputs: &[&TensorType], addend: &TensorType) -> Option<(Self, usize)> {
        (!self.addend && output == 0 && addend == inputs[0])
            .then(|| (RmsNormBackward { addend: true, ..self.clone() }, RMS_ADDEND))
    }
}

/// A norm backward's in-place pair: gx in the addend's storage, when there is one.
fn gx_takes_addend(addend: bool, at: usize) -> Vec<(usize, usize)> {
    if addend {
        vec![(0, at)]
    } else {
        Vec::new()
    }
}

/// The attributes of a norm backward: eps, and the addend flag when set.
fn addend_attrs(eps: f64, addend: bool) -> Vec<(&'static str, Attr)> {
    let mut v = eps_attr(eps);
    if addend {
        v.push(("addend", Attr::Bool(true)));
    }
    v
}

// ---------------------------------------------------------------- layer_norm

/// `y = (x − mean)·rstd·w + b` with `rstd = 1/sqrt(var + eps)` (biased
/// variance) over the last axis. Inputs `x: [..., C]`, `w: [C]`, `b: [C]`;
/// outputs `y`, `mean: [...]`, `rstd: [...]`.
#[derive(Clone, PartialEq, Debug)]
pub struct LayerNorm {
    pub eps: f64,
}

fn layer_norm_fwd<T: Float>(
    x: &[T],
    w: &[T],
    b: &[T],
    eps: f64,
    y: &mut [T],
    mean: &mut [T::Acc],
    rstd: &mut [T::Acc],
) {
    let cdim = w.len();
    let wa: Vec<T::Acc> = w.iter().map(|v| v.acc()).collect();
    let ba: Vec<T::Acc> = b.iter().map(|v| v.acc()).collect();
    let (eps, n): (T::Acc, T::Acc) = (c(eps), c(cdim as f64));
    y.par_chunks_mut(cdim).zip(mean.par_iter_mut().zip(rstd.par_iter_mut())).enumerate().with_min_len(16).for_each(
        |(r, (yr, (mu, rs)))| {
            let xr = &x[row_range(r, cdim)];
            let m = xr.iter().map(|v| v.acc()).sum::<T::Acc>() / n;
            // Two passes: the variance of the centred values does not cancel.
            let var = xr.iter().map(|v| (v.acc() - m) * (v.acc() - m)).sum::<T::Acc>() / n;
            let inv = T::Acc::one() / (var + eps).sqrt();
            (*mu, *rs) = (m, inv);
            for k in 0..cdim {
                yr[k] = T::from_acc((xr[k].acc() - m) * inv * wa[k] + ba[k]);
            }
        },
    );
}

impl OpDef for LayerNorm {
    /// `ROW_SHAPES`, and a model-like `[2, 3, 8]`.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for shape in [&[2, 3, 8][..]].into_iter().chain(ROW_SHAPES) {
            let c = shape[shape.len() - 1];
            let s = Sample::new(LayerNorm { eps: 1e-5 }, vec![normal(d, shape), normal(d, &[c]), normal(d, &[c])]);
            v.push(s.large_over(20_000));
        }
        v
    }
    fn name(&self) -> &'static str {
        "layer_norm"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 3)?;
        check_rows(inputs[0], &[(inputs[1], "weight"), (inputs[2], "bias")])?;
        let st = stat_type(inputs[0]);
        Ok(vec![inputs[0].clone(), st.clone(), st])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let (gy, gmean, grstd) = (args.cotangents[0], args.cotangents[1], args.cotangents[2]);
        if gy.is_none() && gmean.is_none() && grstd.is_none() {
            return Ok(vec![None, None, None]);
        }
        let gy = or_zeros(b, gy, args.outputs[0])?;
        let mut ins = vec![args.inputs[0], args.inputs[1], args.outputs[1], args.outputs[2], gy];
        if gmean.is_some() || grstd.is_some() {
            ins.push(or_zeros(b, gmean, args.outputs[1])?);
            ins.push(or_zeros(b, grstd, args.outputs[2])?);
        }
        let g = b.push(LayerNormBackward { eps: self.eps, addend: false }.into(), &ins)?;
        Ok(vec![Some(g[0]), Some(g[1]), Some(g[2])])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        with_float!(io.in_ty(0).dtype, T => {
            layer_norm_fwd::<T>(
                io.input(0),
                io.input(1),
                io.input(2),
                self.eps,
                io.output(0),
                io.output(1),
                io.output(2),
            );
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        eps_attr(self.eps)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "layer_norm").then(|| Ok(LayerNorm { eps: a.float("eps")? }))
    }
}

/// The backward of [`LayerNorm`]: inputs `(x, w, mean, rstd, gy[, gmean,
/// grstd])`, outputs `(gx, gw, gb)`. With `x̂ = (x − mean)·rstd` and
/// `g = gy⊙w`, per row `gx = rstd·(g − mean(g) − x̂·mean(g⊙x̂))` (plus
/// `gmean/C − grstd·rstd²·x̂/C` when the statistics have cotangents),
/// `gw = Σ_rows gy⊙x̂`, `gb = Σ_rows gy`. With `addend`, input 5 (before
/// the statistics' cotangents) has x's type and is added to gx before its
/// rounding, as [`RmsNormBackward`]'s.
#[derive(Clone, PartialEq, Debug)]
pub struct LayerNormBackward {
    pub eps: f64,
    pub addend: bool,
}

/// The addend's input position in [`LayerNormBackward`]: after gy.
pub const LN_ADDEND: usize = 5;

/// Per-row slices of (mean, rstd) or of their cotangents.
type StatPair<'a, A> = (&'a [A], &'a [A]);

struct LnGrads<'a, T: Float> {
    x: &'a [T],
    w: &'a [T],
    mean: &'a [T::Acc],
    rstd: &'a [T::Acc],
    gy: &'a [T],
    gstats: Option<StatPair<'a, T::Acc>>,
    /// gx holds the addend on entry, to be added before rounding.
    accumulate: bool,
}

fn layer_norm_bwd<T: Float>(a: LnGrads<T>, gx: &mut [T], gw: &mut [T], gb: &mut [T]) {
    let cdim = a.w.len();
    let wa: Vec<T::Acc> = a.w.iter().map(|v| v.acc()).collect();
    let n: T::Acc = c(cdim as f64);
    let sums = rows_with_sums(gx, cdim, 2 * cdim, |r, gxr, part| {
        let (xr, gyr) = (&a.x[row_range(r, cdim)], &a.gy[row_range(r, cdim)]);
        let (m, rs) = (a.mean[r], a.rstd[r]);
        let (mut sg, mut sgx) = (T::Acc::zero(), T::Acc::zero());
        for k in 0..cdim {
            let g = gyr[k].acc() * wa[k];
            sg = sg + g;
            sgx = sgx + g * (xr[k].acc() - m) * rs;
        }
        let (mg, mgx) = (sg / n, sgx / n);
        let (gm, gr) = a.gstats.map_or((T::Acc::zero(), T::Acc::zero()), |(gm, gr)| (gm[r], gr[r]));
        let (shift, stat_coef) = (gm / n, gr * rs * rs / n);
        for k in 0..cdim {
            let (gyk, xh) = (gyr[k].acc(), (xr[k].acc() - m) * rs);
            let v = rs * (gyk * wa[k] - mg - xh * mgx) + shift - stat_coef * xh;
            gxr[k] = T::from_acc(if a.accumulate { v + gxr[k].acc() } else { v });
            part[k] = part[k] + gyk * xh;
            part[cdim + k] = part[cdim + k] + gyk;
        }
    });
    for k in 0..cdim {
        gw[k] = T::from_acc(sums[k]);
        gb[k] = T::from_acc(sums[cdim + k]);
    }
}

impl OpDef for LayerNormBackward {
    /// `ROW_SHAPES` without and with the statistics' cotangents, mean and
    /// rstd from the forward except for rows of one element (see
    /// [`RmsNormBackward`]'s samples).
    fn samples(d: DType) -> Vec<Sample> {
        let st = stat_dtype(d);
        let mut v = Vec::new();
        for shape in ROW_SHAPES {
            let (rows, c) = (&shape[..shape.len() - 1], shape[shape.len() - 1]);
            let s =
                Sample::new(LayerNormBackward { eps: 1e-5, addend: false }, vec![normal(d, shape), normal(d, &[c])]);
            let s = if c == 1 {
                s.with(normal(st, rows)).with(positive(st, rows))
            } else {
                let fwd = |s: &Sample| vec![s.earlier(0), s.earlier(1), normal(d, &[c])];
                let (m, r) = (fwd(&s), fwd(&s));
                s.with_output(LayerNorm { eps: 1e-5 }, m, 1).with_output(LayerNorm { eps: 1e-5 }, r, 2)
            };
            let s = s.with(normal(d, shape)).large_over(40_000);
            v.push(s.clone());
            let with_stats = s.clone().with(normal(st, rows)).with(normal(st, rows));
            v.push(with_stats.clone());
            // The residual gradient folded in, without and with the statistics' cotangents.
            for s in [s, with_stats] {
                v.push(s.with_input_at(LN_ADDEND, normal(d, shape), LayerNormBackward { eps: 1e-5, addend: true }));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "layer_norm_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        let extra = self.addend as usize;
        if inputs.len() != 5 + extra && inputs.len() != 7 + extra {
            let add = if self.addend { ", with the addend of gx after gy," } else { "" };
            return Err(format!(
                "expects 5 inputs (x, w, mean, rstd, gy) or 7 (.., gmean, grstd){add} {} in all, got {}",
                if self.addend { "6 or 8" } else { "5 or 7" },
                inputs.len()
            ));
        }
        let x = inputs[0];
        check_rows(x, &[(inputs[1], "weight")])?;
        let st = stat_type(x);
        expect_type(inputs[2], &st, "mean")?;
        expect_type(inputs[3], &st, "rstd")?;
        expect_type(inputs[4], x, "the cotangent of y")?;
        if self.addend {
            expect_type(inputs[LN_ADDEND], x, "the addend of gx")?;
        }
        if inputs.len() == 7 + extra {
            expect_type(inputs[5 + extra], &st, "the cotangent of mean")?;
            expect_type(inputs[6 + extra], &st, "the cotangent of rstd")?;
        }
        Ok(vec![x.clone(), inputs[1].clone(), inputs[1].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let extra = self.addend as usize;
        with_float!(io.in_ty(0).dtype, T => {
            let a = LnGrads::<T> {
                x: io.input(0),
                w: io.input(1),
                mean: io.input(2),
                rstd: io.input(3),
                gy: io.input(4),
                gstats: (io.inputs.len() > 5 + extra).then(|| (io.input(5 + extra), io.input(6 + extra))),
                accumulate: self.addend,
            };
            // With an addend, gx starts as the addend (and may be its storage).
            let gx = if self.addend { io.inplace(0, LN_ADDEND) } else { io.output(0) };
            layer_norm_bwd(a, gx, io.output(1), io.output(2));
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        addend_attrs(self.eps, self.addend)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "layer_norm_backward")
            .then(|| Ok(LayerNormBackward { eps: a.float("eps")?, addend: a.opt_bool("addend")?.unwrap_or(false) }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        gx_takes_addend(self.addend, LN_ADDEND)
    }
    fn with_addend(&self, output: usize, inputs: &[&TensorType], addend: &TensorType) -> Option<(Self, usize)> {
        (!self.addend && output == 0 && addend == inputs[0])
            .then(|| (LayerNormBackward { addend: true, ..self.clone() }, LN_ADDEND))
    }
}

// ---------------------------------------------------------------- builder helpers

impl Builder {
    /// RMSNorm of `x: [..., C]` with weight `w: [C]`; returns y (rstd stays in the trace for backward).
    pub fn rms_norm(&mut self, x: ValueId, w: ValueId, eps: f64) -> Result<ValueId> {
        Ok(self.push(RmsNorm { eps }.into(), &[x, w])?[0])
    }

    /// LayerNorm of `x: [..., C]` with weight and bias `[C]`; returns y.
    pub fn layer_norm(&mut self, x: ValueId, w: ValueId, b: ValueId, eps: f64) -> Result<ValueId> {
        Ok(self.push(LayerNorm { eps }.into(), &[x, w, b])?[0])
    }
}

/// The shapes of the row-wise samples (norms, softmax): rows of 1, 7, 33,
/// 45, 128, 3200 and 32000 (LLaMA widths and vocabularies) elements, one
/// row, row counts that are not multiples of 32, a 3-D input.
pub(crate) const ROW_SHAPES: [&[usize]; 8] =
    [&[5, 1], &[3, 7], &[300, 7], &[1, 33], &[37, 45], &[2, 3, 128], &[64, 3200], &[4, 32000]];
