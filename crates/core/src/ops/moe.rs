//! The ops of a mixture-of-experts layer with dropless routing: every token
//! goes to its `k` best experts, so a step routes exactly `tokens × k` rows
//! and every buffer has a static size; only how those rows split among the
//! experts is a device value (the offsets).
//!
//! - [`TopK`]: the `k` largest entries of each row of the router's scores,
//!   largest first, with their indices; its backward [`TopKBackward`]
//!   scatters the values' cotangents back to their positions.
//! - [`ExpertSort`]: a stable sort of the `(token, slot)` pairs by expert:
//!   each sorted row's token (what gathers the routed rows), where each pair
//!   landed (what gathers the experts' outputs back), and the per-expert
//!   offsets of the sorted rows.
//! - [`GroupedMatmul`]: one product per expert over its run of the sorted
//!   rows, with the expert's own weight; [`GroupedMatmulWeightGrad`] is the
//!   weight gradient, each expert's sum over its rows.
//!
//! The gathers themselves are [`crate::ops::embedding::Embedding`] (rows of
//! a table by index), whose backward already sums what several slots of one
//! token send back.
//!
//! **Ties** (equal scores) go to the lower index, and a NaN counts as larger
//! than every number (as `torch.topk` orders them), so every backend routes
//! the same rows. **Numerics:** products sum in the accumulator type (f32
//! for f32, bf16 and f16; f64 for f64) in index order and round once.

use num_traits::{ToPrimitive, Zero};
use rayon::prelude::*;

use super::sample::{fixed, ids, normal, output_of, ties, Sample};
use super::{expect_float, expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{Float, KernelIo};
use crate::with_float;

/// Is score `a` (at index `i`) ranked before score `b` (at index `j`)?
/// Larger first, NaN above every number, the lower index among equals.
pub fn ranks_before(a: f64, i: usize, b: f64, j: usize) -> bool {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => i < j,
        (true, false) => true,
        (false, true) => false,
        (false, false) => a > b || (a == b && i < j),
    }
}

/// The rows of a `[..., width]` type and its width.
fn rows_width(t: &TensorType) -> (usize, usize) {
    let width = t.shape.last().copied().unwrap_or(1);
    (t.numel() / width.max(1), width)
}

// ---------------------------------------------------------------- top-k

/// The `k` largest entries of each row of `x: [..., E]` (values
/// `[..., k]`, largest first, and their indices as i32 `[..., k]`).
#[derive(Clone, PartialEq, Debug)]
pub struct TopK {
    pub k: usize,
}

/// The cotangent of [`TopK`]'s input from its indices and the values'
/// cotangent: `gx[..., idx[..., j]] = g[..., j]`, zero elsewhere.
#[derive(Clone, PartialEq, Debug)]
pub struct TopKBackward {
    /// The input's last axis (`E`).
    pub width: usize,
}

impl OpDef for TopK {
    fn name(&self) -> &'static str {
        "top_k"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        let x = inputs[0];
        expect_float(x, "the scores")?;
        let Some(&width) = x.shape.last() else {
            return Err(format!("the scores must have an axis to pick from, got {x}"));
        };
        if self.k == 0 || self.k > width {
            return Err(format!("k = {} must be in 1..={width}, the scores' last axis", self.k));
        }
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("rank >= 1") = self.k;
        Ok(vec![x.with_shape(shape.clone()), TensorType::new(DType::I32, shape)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        let width = *b.shape(args.inputs[0]).last().expect("rank >= 1");
        let gx = b.push1(TopKBackward { width }.into(), &[args.outputs[1], g])?;
        Ok(vec![Some(gx)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (_, width) = rows_width(io.in_ty(0));
        let k = self.k;
        with_float!(io.in_ty(0).dtype, T => {
            let x = io.input::<T>(0);
            let (vals, idx) = (io.output::<T>(0), io.output::<i32>(1));
            vals.par_chunks_mut(k).zip(idx.par_chunks_mut(k)).enumerate().for_each(|(r, (v, ix))| {
                let row = &x[r * width..(r + 1) * width];
                let score = |i: usize| row[i].acc().to_f64().unwrap_or(f64::NAN);
                // k passes, each taking the best entry not yet taken: the
                // order the CUDA kernel's selection follows.
                let mut taken = vec![false; width];
                for j in 0..k {
                    let best = (0..width)
                        .filter(|&i| !taken[i])
                        .reduce(|a, b| if ranks_before(score(b), b, score(a), a) { b } else { a })
                        .expect("k <= width");
                    taken[best] = true;
                    v[j] = row[best];
                    ix[j] = best as i32;
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        let mut v: Vec<Sample> = [(&[8][..], 1), (&[5, 8], 2), (&[2, 3, 16], 4), (&[7, 6], 6), (&[4, 128], 8)]
            .into_iter()
            .map(|(shape, k)| Sample::new(TopK { k }, vec![normal(dtype, shape)]))
            .collect();
        // Rows full of equal scores: the lower index wins every tie.
        v.push(Sample::new(TopK { k: 3 }, vec![ties(dtype, &[6, 10])]));
        v
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("k", Attr::Int(self.k as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "top_k").then(|| Ok(TopK { k: a.usize("k")? }))
    }
}

impl OpDef for TopKBackward {
    fn name(&self) -> &'static str {
        "top_k_backward"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        let (idx, g) = (inputs[0], inputs[1]);
        if idx.dtype != DType::I32 || idx.shape != g.shape || idx.rank() == 0 {
            return Err(format!("indices {idx} must be i32 of the cotangent {g}'s shape"));
        }
        expect_float(g, "the values' cotangent")?;
        if g.shape.last().is_some_and(|&k| k > self.width) {
            return Err(format!("{g} picks more entries than the width {}", self.width));
        }
        let mut shape = g.shape.clone();
        *shape.last_mut().expect("rank >= 1") = self.width;
        Ok(vec![g.with_shape(shape)])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (_, k) = rows_width(io.in_ty(1));
        let width = self.width;
        let idx = io.input::<i32>(0);
        if let Some(bad) = idx.iter().find(|&&i| i < 0 || i as usize >= width) {
            return Err(Error::Cpu(format!("top_k_backward: index {bad} is outside the width {width}")));
        }
        with_float!(io.out_ty(0).dtype, T => {
            let g = io.input::<T>(1);
            let gx = io.output::<T>(0);
            gx.par_chunks_mut(width.max(1)).enumerate().for_each(|(r, out)| {
                out.fill(T::from_acc(<T as Float>::Acc::zero()));
                for j in 0..k {
                    out[idx[r * k + j] as usize] = g[r * k + j];
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        [(&[5, 8][..], 2), (&[2, 3, 16], 4), (&[4, 128], 8)]
            .into_iter()
            .map(|(shape, k)| {
                let width = *shape.last().unwrap();
                let mut out = shape.to_vec();
                *out.last_mut().unwrap() = k;
                let picked = output_of(TopK { k }, vec![normal(dtype, shape)], 1);
                Sample::new(TopKBackward { width }, vec![picked, normal(dtype, &out)])
            })
            .collect()
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "top_k_backward").then(|| Ok(TopKBackward { width: a.usize("width")? }))
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("width", Attr::Int(self.width as i64))]
    }
}

// ---------------------------------------------------------------- routing

/// A stable sort of the `(token, slot)` pairs of `experts: [N, k]` (each
/// token's chosen experts, i32 or i64 in `[0, E)`) by expert. Outputs:
/// `tokens` i32 `[N·k]`, the token of each sorted row; `position` i32
/// `[N·k]`, where pair `n·k + j` landed; `offsets` i32 `[E + 1]`, expert
/// `e`'s rows being `offsets[e]..offsets[e + 1]`; `counts` f32 `[E]`, each
/// expert's rows as a number (what a load-balancing loss weighs; exact
/// below 2^24 pairs). Pairs of one expert keep their order.
#[derive(Clone, PartialEq, Debug)]
pub struct ExpertSort {
    pub experts: usize,
}

/// [`ExpertSort`]'s three outputs, computed on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutedPairs {
    /// The token of each sorted row.
    pub tokens: Vec<i32>,
    /// Where each pair `n·k + j` landed among the sorted rows.
    pub position: Vec<i32>,
    /// Expert `e`'s rows are `offsets[e]..offsets[e + 1]`.
    pub offsets: Vec<i32>,
}

impl ExpertSort {
    /// The sort on the host, or the first expert id out of range.
    pub fn sort(&self, ids: &[i64], k: usize) -> std::result::Result<RoutedPairs, String> {
        let e = self.experts;
        if let Some((at, bad)) = ids.iter().enumerate().find(|(_, &x)| x < 0 || x as u64 >= e as u64) {
            return Err(format!("expert id {bad} at pair {at} is outside the {e} experts"));
        }
        let mut offsets = vec![0i32; e + 1];
        for &x in ids {
            offsets[x as usize + 1] += 1;
        }
        for i in 0..e {
            offsets[i + 1] += offsets[i];
        }
        let mut next = offsets.clone();
        let (mut tokens, mut position) = (vec![0i32; ids.len()], vec![0i32; ids.len()]);
        for (pair, &x) in ids.iter().enumerate() {
            let p = next[x as usize] as usize;
            next[x as usize] += 1;
            tokens[p] = (pair / k.max(1)) as i32;
            position[pair] = p as i32;
        }
        Ok(RoutedPairs { tokens, position, offsets })
    }
}

impl OpDef for ExpertSort {
    fn name(&self) -> &'static str {
        "expert_sort"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        let ids = inputs[0];
        if !ids.dtype.is_int() || ids.rank() != 2 {
            return Err(format!("the experts must be i32 or i64 [tokens, k], got {ids}"));
        }
        if self.experts == 0 || self.experts >= i32::MAX as usize || ids.numel() >= i32::MAX as usize {
            return Err(format!("{} experts and {} pairs must fit i32", self.experts, ids.numel()));
        }
        let n = ids.numel();
        Ok(vec![
            TensorType::new(DType::I32, [n]),
            TensorType::new(DType::I32, [n]),
            TensorType::new(DType::I32, [self.experts + 1]),
            TensorType::new(DType::F32, [self.experts]),
        ])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        // The counts are piecewise constant in the routing and the input is
        // integer: nothing flows.
        Ok(vec![None])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let k = io.in_ty(0).shape[1];
        let ids = io.ids(0)?;
        let sorted = self.sort(&ids, k).map_err(|reason| Error::Input { name: "routed experts".into(), reason })?;
        io.output::<i32>(0).copy_from_slice(&sorted.tokens);
        io.output::<i32>(1).copy_from_slice(&sorted.position);
        io.output::<i32>(2).copy_from_slice(&sorted.offsets);
        for (c, w) in io.output::<f32>(3).iter_mut().zip(sorted.offsets.windows(2)) {
            *c = (w[1] - w[0]) as f32;
        }
        Ok(())
    }
    /// No float input: listed once, under f32.
    fn samples(dtype: DType) -> Vec<Sample> {
        if dtype != DType::F32 {
            return Vec::new();
        }
        // Beyond the small cases, the shapes of the CUDA sort's paths: many
        // 32-pair rounds per warp with a partial last segment; long runs of
        // one expert (whole warps alike); more experts than its block has
        // threads (fewer segments); and the most experts it holds (one).
        let mut v: Vec<Sample> = [
            (&[6, 2][..], 4),
            (&[16, 8], 128),
            (&[1, 1], 1),
            (&[9, 3], 5),
            (&[1000, 8], 128),
            (&[700, 3], 3),
            (&[300, 4], 1500),
            (&[50, 2], 8192),
        ]
        .into_iter()
        .map(|(shape, e)| Sample::new(ExpertSort { experts: e }, vec![ids(DType::I32, shape, e as i64)]))
        .collect();
        // Experts no token chose (empty runs), and i64 ids.
        v.push(Sample::new(
            ExpertSort { experts: 6 },
            vec![fixed(DType::I64, &[4, 2], &[5.0, 1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 3.0])],
        ));
        v
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("experts", Attr::Int(self.experts as i64))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "expert_sort").then(|| Ok(ExpertSort { experts: a.usize("experts")? }))
    }
}

// ---------------------------------------------------------------- grouped products

/// One product per expert over its rows: `x: [M, K]` sorted by expert,
/// `w: [E, N, K]` (each expert's weight as a linear layer stores it) and
/// `offsets: i32 [E + 1]` give `y: [M, N]` with `y[p] = x[p] · w[e]ᵀ` for
/// the expert `e` whose rows hold `p`. With `trans_w`, `w: [E, K, N]` and
/// `y[p] = x[p] · w[e]`.
#[derive(Clone, PartialEq, Debug)]
pub struct GroupedMatmul {
    pub trans_w: bool,
}

/// The weight gradient of a grouped product: `a: [M, A]`, `b: [M, B]` and
/// the offsets give `[E, A, B]`, expert `e`'s `Σ_p a[p]ᵀ · b[p]` over its
/// rows (zero for an expert without rows).
#[derive(Clone, PartialEq, Debug)]
pub struct GroupedMatmulWeightGrad;

/// Checks `offsets` (i32 `[E + 1]`) for `rows` sorted rows: from 0 to
/// `rows`, never decreasing.
fn check_offsets(offsets: &[i32], rows: usize) -> Result<()> {
    let ok = offsets.first() == Some(&0)
        && offsets.last().is_some_and(|&l| l as usize == rows)
        && offsets.windows(2).all(|w| w[0] <= w[1]);
    if ok {
        Ok(())
    } else {
        Err(Error::Cpu(format!("expert offsets {offsets:?} must rise from 0 to the {rows} routed rows")))
    }
}

/// The expert of each of `rows` sorted rows.
fn expert_of_rows(offsets: &[i32], rows: usize) -> Vec<usize> {
    let mut out = vec![0; rows];
    for e in 0..offsets.len() - 1 {
        for slot in &mut out[offsets[e] as usize..offsets[e + 1] as usize] {
            *slot = e;
        }
    }
    out
}

fn offsets_type(t: &TensorType, experts: usize) -> std::result::Result<(), String> {
    if t.dtype != DType::I32 || t.shape != [experts + 1] {
        return Err(format!("the offsets must be i32 [{}], got {t}", experts + 1));
    }
    Ok(())
}

impl OpDef for GroupedMatmul {
    fn name(&self) -> &'static str {
        "grouped_matmul"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 3)?;
        let (x, w, off) = (inputs[0], inputs[1], inputs[2]);
        expect_float(x, "the rows")?;
        if x.rank() != 2 || w.rank() != 3 || w.dtype != x.dtype {
            return Err(format!("rows {x} must be [M, K] and weights {w} [E, N, K] of the same dtype"));
        }
        let (kw, n) = if self.trans_w { (w.shape[1], w.shape[2]) } else { (w.shape[2], w.shape[1]) };
        if kw != x.shape[1] {
            return Err(format!("rows {x} and weights {w} disagree on the inner size"));
        }
        offsets_type(off, w.shape[0])?;
        Ok(vec![x.with_shape([x.shape[0], n])])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None, None, None]) };
        let (x, w, off) = (args.inputs[0], args.inputs[1], args.inputs[2]);
        let gx = b.push1(GroupedMatmul { trans_w: !self.trans_w }.into(), &[g, w, off])?;
        let gw = if self.trans_w {
            b.push1(GroupedMatmulWeightGrad.into(), &[x, g, off])?
        } else {
            b.push1(GroupedMatmulWeightGrad.into(), &[g, x, off])?
        };
        Ok(vec![Some(gx), Some(gw), None])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (m, k) = (io.in_ty(0).shape[0], io.in_ty(0).shape[1]);
        let w_ty = io.in_ty(1);
        let n = io.out_ty(0).shape[1];
        let offsets = io.input::<i32>(2);
        check_offsets(offsets, m)?;
        let expert = expert_of_rows(offsets, m);
        let trans_w = self.trans_w;
        let expert_size = w_ty.shape[1] * w_ty.shape[2];
        with_float!(io.in_ty(0).dtype, T => {
            let (x, w) = (io.input::<T>(0), io.input::<T>(1));
            let y = io.output::<T>(0);
            y.par_chunks_mut(n.max(1)).enumerate().for_each(|(p, out)| {
                let we = &w[expert[p] * expert_size..(expert[p] + 1) * expert_size];
                let row = &x[p * k..(p + 1) * k];
                for (j, o) in out.iter_mut().enumerate() {
                    let mut acc = <T as Float>::Acc::zero();
                    for (i, xi) in row.iter().enumerate() {
                        let wv = if trans_w { we[i * n + j] } else { we[j * k + i] };
                        acc += xi.acc() * wv.acc();
                    }
                    *o = T::from_acc(acc);
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        // (tokens, k, experts, inner, outer): Mixtral-like top-2 of 4, a
        // top-1 router, a case with experts left empty, and one expert;
        // then widths in 16-byte chunks (the CUDA backend's tensor-core
        // tiles for 16-bit floats): several row tiles per expert with a
        // partial last one and a partial column tile, and many small or
        // empty experts.
        let cases = [
            (6, 2, 4, 8, 5),
            (5, 1, 3, 16, 7),
            (3, 2, 8, 4, 6),
            (4, 1, 1, 3, 2),
            (160, 2, 2, 64, 136),
            (20, 2, 16, 32, 40),
        ];
        for (tokens, k, e, inner, outer) in cases {
            let offsets = output_of(ExpertSort { experts: e }, vec![ids(DType::I32, &[tokens, k], e as i64)], 2);
            let rows = tokens * k;
            for trans_w in [false, true] {
                let w = if trans_w { [e, inner, outer] } else { [e, outer, inner] };
                v.push(Sample::new(
                    GroupedMatmul { trans_w },
                    vec![normal(dtype, &[rows, inner]), normal(dtype, &w), offsets.clone()],
                ));
            }
        }
        v
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        Attr::flag("trans_w", self.trans_w)
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "grouped_matmul").then(|| Ok(GroupedMatmul { trans_w: a.opt_bool("trans_w")?.unwrap_or(false) }))
    }
}

impl OpDef for GroupedMatmulWeightGrad {
    fn name(&self) -> &'static str {
        "grouped_matmul_weight_grad"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 3)?;
        let (a, b, off) = (inputs[0], inputs[1], inputs[2]);
        expect_float(a, "the rows")?;
        if a.rank() != 2 || b.rank() != 2 || a.shape[0] != b.shape[0] || a.dtype != b.dtype {
            return Err(format!("{a} and {b} must be [M, A] and [M, B] of one dtype"));
        }
        if off.dtype != DType::I32 || off.rank() != 1 || off.shape[0] == 0 {
            return Err(format!("the offsets must be i32 [E + 1], got {off}"));
        }
        Ok(vec![a.with_shape([off.shape[0] - 1, a.shape[1], b.shape[1]])])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (m, na) = (io.in_ty(0).shape[0], io.in_ty(0).shape[1]);
        let nb = io.in_ty(1).shape[1];
        let offsets = io.input::<i32>(2);
        check_offsets(offsets, m)?;
        with_float!(io.in_ty(0).dtype, T => {
            let (a, b) = (io.input::<T>(0), io.input::<T>(1));
            let out = io.output::<T>(0);
            out.par_chunks_mut(nb.max(1)).enumerate().for_each(|(r, o)| {
                let (e, i) = (r / na.max(1), r % na.max(1));
                let rows = offsets[e] as usize..offsets[e + 1] as usize;
                for (j, v) in o.iter_mut().enumerate() {
                    let mut acc = <T as Float>::Acc::zero();
                    for p in rows.clone() {
                        acc += a[p * na + i].acc() * b[p * nb + j].acc();
                    }
                    *v = T::from_acc(acc);
                }
            });
            Ok(())
        })
    }
    fn samples(dtype: DType) -> Vec<Sample> {
        // As the product's: then widths in 16-byte chunks, with rows past a
        // 32-row step and partial tiles, and many small or empty experts.
        [(6, 2, 4, 5, 8), (3, 2, 8, 6, 4), (4, 1, 1, 2, 3), (90, 2, 2, 136, 72), (20, 2, 16, 40, 32)]
            .into_iter()
            .map(|(tokens, k, e, na, nb)| {
                let offsets = output_of(ExpertSort { experts: e }, vec![ids(DType::I32, &[tokens, k], e as i64)], 2);
                let rows = tokens * k;
                Sample::new(
                    GroupedMatmulWeightGrad,
                    vec![normal(dtype, &[rows, na]), normal(dtype, &[rows, nb]), offsets],
                )
            })
            .collect()
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        (name == "grouped_matmul_weight_grad").then_some(Ok(GroupedMatmulWeightGrad))
    }
}

impl Builder {
    /// The `k` largest scores of each row and their indices (i32).
    pub fn top_k(&mut self, x: ValueId, k: usize) -> Result<(ValueId, ValueId)> {
        let y = self.push(TopK { k }.into(), &[x])?;
        Ok((y[0], y[1]))
    }

    /// The routed pairs of `experts: [N, k]` sorted by expert:
    /// `[tokens, position, offsets, counts]` ([`ExpertSort`]).
    pub fn expert_sort(&mut self, experts: ValueId, num_experts: usize) -> Result<[ValueId; 4]> {
        let y = self.push(ExpertSort { experts: num_experts }.into(), &[experts])?;
        Ok([y[0], y[1], y[2], y[3]])
    }

    /// Each sorted row times its expert's weight ([`GroupedMatmul`]).
    pub fn grouped_matmul(&mut self, x: ValueId, w: ValueId, offsets: ValueId, trans_w: bool) -> Result<ValueId> {
        self.push1(GroupedMatmul { trans_w }.into(), &[x, w, offsets])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::HostTensor;
    use crate::testing::run_op;

    #[test]
    fn top_k_ranks_ties_by_index_and_nan_first() {
        let x = HostTensor::from_f64(
            TensorType::new(DType::F32, [2, 5]),
            &[1.0, 3.0, 3.0, f64::NAN, 2.0, 0.5, 0.5, 0.5, 0.5, 0.5],
        );
        let y = run_op(&TopK { k: 3 }.into(), &[x]).unwrap();
        let idx: Vec<i64> = y[1].to_f64().iter().map(|&v| v as i64).collect();
        assert_eq!(idx, [3, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn expert_sort_is_stable_and_counts_every_expert() {
        let sorted = ExpertSort { experts: 4 }.sort(&[2, 0, 2, 3, 0, 2], 2).unwrap();
        // Pairs (token, slot): (0,0)→2 (0,1)→0 (1,0)→2 (1,1)→3 (2,0)→0 (2,1)→2.
        assert_eq!(sorted.offsets, [0, 2, 2, 5, 6]);
        assert_eq!(sorted.tokens, [0, 2, 0, 1, 2, 1]);
        assert_eq!(sorted.position, [2, 0, 3, 5, 1, 4]);
        let err = ExpertSort { experts: 4 }.sort(&[1, 4], 1).unwrap_err();
        assert!(err.contains("expert id 4 at pair 1"), "{err}");
    }

    #[test]
    fn grouped_matmul_is_one_product_per_expert() {
        // Two experts, rows 0..1 to expert 0 and 1..3 to expert 1.
        let x = HostTensor::from_f64(TensorType::new(DType::F64, [3, 2]), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let w = HostTensor::from_f64(TensorType::new(DType::F64, [2, 1, 2]), &[1.0, 10.0, 100.0, 1000.0]);
        let off = HostTensor::from_f64(TensorType::new(DType::I32, [3]), &[0.0, 1.0, 3.0]);
        let y = run_op(&GroupedMatmul { trans_w: false }.into(), &[x.clone(), w, off.clone()]).unwrap();
        assert_eq!(y[0].to_f64(), [21.0, 4300.0, 6500.0]);
        let gw = run_op(&GroupedMatmulWeightGrad.into(), &[x.clone(), x, off]).unwrap();
        // Expert 0: [1,2]ᵀ[1,2]; expert 1: [3,4]ᵀ[3,4] + [5,6]ᵀ[5,6].
        assert_eq!(gw[0].to_f64(), [1.0, 2.0, 2.0, 4.0, 34.0, 42.0, 42.0, 52.0]);
    }

    #[test]
    fn bad_offsets_are_refused() {
        let x = HostTensor::from_f64(TensorType::new(DType::F32, [3, 2]), &[0.0; 6]);
        let w = HostTensor::from_f64(TensorType::new(DType::F32, [2, 1, 2]), &[0.0; 4]);
        let off = HostTensor::from_f64(TensorType::new(DType::I32, [3]), &[0.0, 2.0, 1.0]);
        let e = run_op(&GroupedMatmul { trans_w: false }.into(), &[x, w, off]).unwrap_err();
        assert!(e.to_string().contains("must rise from 0"), "{e}");
    }
}
