//! Rotary position embedding ([`Rope`]) on `[B, T, H, D]` activations, its
//! own transpose, and the [`Builder::rope`] helper.
//!
//! **Convention:** GPT-NeoX / Hugging Face `rotate_half`, not the
//! interleaved pairs of the original RoFormer/Meta code. With `h = n_rot/2`
//! and the position `t` (the index on axis 1), dimension `i < h` of every
//! head is paired with dimension `i + h` and rotated by
//! `θ = t · base^(−2i/n_rot)`:
//!
//! ```text
//! y[i]     = x[i]·cos θ − x[i+h]·sin θ
//! y[i + h] = x[i+h]·cos θ + x[i]·sin θ
//! ```
//!
//! Dimensions `≥ n_rot` pass through. θ, cos θ and sin θ are computed in f64
//! and converted to the accumulator type once, so every dtype sees the same
//! angles (Hugging Face computes them in f32; the difference is below f32
//! rounding for the positions a model sees). `inverse` rotates by −θ, which
//! is the transpose, so the VJP is the same op with `inverse` flipped.
//!
//! **Positions:** with a second input `start: i32[B]`, row `b`'s token `t`
//! sits at position `start[b] + t` instead of `t`: the new tokens of a
//! generation step, appended to sequences of different lengths. With
//! `positions: i32[B, T]` instead, token `(b, t)` sits at `positions[b, t]`:
//! packed documents, each counting from 0. The transpose uses the same
//! positions.
//!
//! **Llama-3.x frequency scaling:** with [`Rope::scaling`] set, each pair's
//! inverse frequency `base^(−2i/n_rot)` is replaced by
//! [`Llama3Scaling::adjust`] of it, exactly as `transformers`'
//! `_compute_llama3_parameters` (`rope_type: "llama3"`) does: long
//! wavelengths are divided by `factor`, short ones kept, and the band
//! between them interpolated. The rotation is otherwise unchanged, so the
//! transpose is still the same op with `inverse` flipped.
//!
//! **LongRoPE** (`rope_type: "longrope"`: Phi-3 128k, Phi-3.5, Phi-4-mini):
//! with [`RopeScaling::LongRope`], pair `i`'s inverse frequency is
//! `1 / (factor[i] · base^(2i/n_rot))`, as `transformers`'
//! `_compute_longrope_parameters` has it, with the long factors when the
//! call's largest position reaches the original context
//! (`max position + 1 > original_max_position_embeddings`, transformers'
//! `longrope_frequency_update`) and the short ones otherwise; cos θ and
//! sin θ are both multiplied by the attention factor. The choice is made
//! per call from its positions (0..T, each row's start + t, or the
//! per-token positions), so a generation that grows past the original
//! context switches sets as `transformers` does, keeping the keys it
//! cached. `a·R` transposes to `a·Rᵀ`: the transpose is still this op with
//! `inverse` flipped.
//!
//! **The `n_rot == 1` quirk:** a head of size 1 with full rotary (benchmark
//! workload W2). Hugging Face and litgpt build `cos`/`sin` of width 2 from
//! one frequency (`θ = t`), and `rotate_half` of a width-1 vector is `−x`;
//! broadcasting then yields a *two*-dimensional rotated head
//! `[x·(cos t − sin t), x·(cos t − sin t)]`. Its dot products are twice those
//! of the single dimension, so stepgraph computes
//! `y[0] = x[0]·(cos t − sin t)` and the model doubles the attention scale.
//! That map is a diagonal scaling: it ignores `inverse` and is its own
//! transpose. Doubling the scale is exact only when the head has no other
//! dimension (`D == 1`): with `n_rot == 1 < D` the reference models double
//! the rotated dimension's product but not the pass-through ones, which no
//! scale reproduces; this op still computes the single-dimension map there.

use num_traits::Zero;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::sample::{fixed, normal, Sample};
use super::{expect_float, Attr, Attrs, OpDef, VjpArgs};
use crate::error::Result;
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::ops::kernel::{c, Float, KernelIo};
use crate::with_float;

/// Llama-3.x RoPE frequency scaling (`rope_type: "llama3"` in a Hugging
/// Face config), with the names `transformers` gives its parameters.
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize)]
pub struct Llama3Scaling {
    /// How much longer the context is than the one the model was trained on.
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor`
    /// are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor`
    /// are kept.
    pub high_freq_factor: f64,
    /// The context length the model was trained on.
    pub original_max_position_embeddings: usize,
}

impl Llama3Scaling {
    /// Why these parameters cannot scale frequencies, if they cannot:
    /// `factor` and both frequency factors must be positive and finite,
    /// `high_freq_factor` above `low_freq_factor` (the interpolation divides
    /// by their difference), and the original context positive.
    pub fn check(&self) -> std::result::Result<(), String> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.factor) || !positive(self.low_freq_factor) || !positive(self.high_freq_factor) {
            return Err(format!(
                "llama3 RoPE scaling needs positive finite factor, low_freq_factor and high_freq_factor, got {}, {} and {}",
                self.factor, self.low_freq_factor, self.high_freq_factor
            ));
        }
        if self.high_freq_factor <= self.low_freq_factor {
            return Err(format!(
                "llama3 RoPE scaling needs high_freq_factor ({}) above low_freq_factor ({})",
                self.high_freq_factor, self.low_freq_factor
            ));
        }
        if self.original_max_position_embeddings == 0 {
            return Err("llama3 RoPE scaling needs a positive original_max_position_embeddings".into());
        }
        Ok(())
    }

    /// `inv_freq` adjusted as `transformers`' `_compute_llama3_parameters`
    /// adjusts it, operation for operation (in f64 rather than f32).
    pub fn adjust(&self, inv_freq: f64) -> f64 {
        let old_context = self.original_max_position_embeddings as f64;
        let low_freq_wavelen = old_context / self.low_freq_factor;
        let high_freq_wavelen = old_context / self.high_freq_factor;
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        let inv_freq_llama = if wavelen > low_freq_wavelen { inv_freq / self.factor } else { inv_freq };
        // transformers' `~(wavelen < high) * ~(wavelen > low)`; wavelengths are
        // positive numbers, never NaN, so the negations are these comparisons.
        let is_medium_freq = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
        if is_medium_freq {
            let smooth =
                (old_context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq_llama / self.factor + smooth * inv_freq_llama
        } else {
            inv_freq_llama
        }
    }
}

/// LongRoPE's per-pair frequency factors (`rope_type: "longrope"`), with
/// the names `transformers` gives them; see the module doc.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct LongRope {
    /// Each pair's frequency divisor while the positions stay inside the
    /// original context.
    pub short_factor: Vec<f64>,
    /// Each pair's frequency divisor once a position reaches past it.
    pub long_factor: Vec<f64>,
    /// The context length the model was pre-trained on.
    pub original_max_position_embeddings: usize,
    /// What cos θ and sin θ are multiplied by (`transformers`'
    /// `attention_scaling`), resolved from `factor` when the config leaves
    /// it out.
    pub attention_factor: f64,
}

impl LongRope {
    /// Why these factors cannot rotate `n_rot` dimensions, if they cannot:
    /// one positive finite factor of each kind per pair, a positive original
    /// context and a positive finite attention factor.
    pub fn check(&self, n_rot: usize) -> std::result::Result<(), String> {
        let pairs = n_rot / 2;
        for (name, factors) in [("short_factor", &self.short_factor), ("long_factor", &self.long_factor)] {
            if factors.len() != pairs || pairs == 0 {
                return Err(format!(
                    "longrope RoPE scaling needs one {name} per rotated pair ({pairs} for {n_rot} rotated dimensions), got {}",
                    factors.len()
                ));
            }
            if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                return Err(format!("longrope RoPE scaling's {name} must be positive finite numbers, got {bad}"));
            }
        }
        if self.original_max_position_embeddings == 0 {
            return Err("longrope RoPE scaling needs a positive original_max_position_embeddings".into());
        }
        if !(self.attention_factor.is_finite() && self.attention_factor > 0.0) {
            return Err(format!(
                "longrope RoPE scaling needs a positive finite attention_factor, got {}",
                self.attention_factor
            ));
        }
        Ok(())
    }

    /// The factors a call whose largest position is `max_position` uses.
    pub fn factors(&self, max_position: i64) -> &[f64] {
        if max_position + 1 > self.original_max_position_embeddings as i64 {
            &self.long_factor
        } else {
            &self.short_factor
        }
    }
}

/// A RoPE frequency scaling ([`Rope::scaling`]). Stored configs hold
/// either form's own fields, so the variant is told by its fields.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RopeScaling {
    /// Llama-3.x scaling (and linear scaling, written as one).
    Llama3(Llama3Scaling),
    /// LongRoPE's per-pair factors.
    LongRope(LongRope),
}

impl RopeScaling {
    /// Why this scaling cannot rotate `n_rot` dimensions, if it cannot.
    pub fn check(&self, n_rot: usize) -> std::result::Result<(), String> {
        match self {
            RopeScaling::Llama3(s) => s.check(),
            RopeScaling::LongRope(s) => s.check(n_rot),
        }
    }
}

impl From<Llama3Scaling> for RopeScaling {
    fn from(s: Llama3Scaling) -> Self {
        RopeScaling::Llama3(s)
    }
}

/// Rotates the first `n_rot` dims of each head of `x: [B, T, H, D]`; see the module doc.
#[derive(Clone, PartialEq, Debug)]
pub struct Rope {
    pub n_rot: usize,
    pub base: f64,
    pub inverse: bool,
    /// Llama-3.x or LongRoPE frequency scaling; `None` for plain RoPE.
    pub scaling: Option<RopeScaling>,
}

impl Rope {
    /// The inverse frequency of pair `i` in a call whose largest position
    /// is `max_position`: `base^(−2i/n_rot)`, scaled when [`Rope::scaling`]
    /// is set (pair 0 of `n_rot == 1` is frequency 1).
    pub fn inv_freq(&self, i: usize, max_position: i64) -> f64 {
        let exponent = if self.n_rot <= 1 { 0.0 } else { 2.0 * i as f64 / self.n_rot as f64 };
        match &self.scaling {
            None => self.base.powf(-exponent),
            Some(RopeScaling::Llama3(scaling)) => scaling.adjust(self.base.powf(-exponent)),
            // transformers' `1 / (ext_factors · base^(2i/dim))`.
            Some(RopeScaling::LongRope(long)) => 1.0 / (long.factors(max_position)[i] * self.base.powf(exponent)),
        }
    }

    /// What cos θ and sin θ are multiplied by: LongRoPE's attention
    /// factor, 1 otherwise.
    pub fn amplitude(&self) -> f64 {
        match &self.scaling {
            Some(RopeScaling::LongRope(long)) => long.attention_factor,
            _ => 1.0,
        }
    }

    /// `(cos θ, sin θ)` per position and pair, `[T, n_rot/2]`, sin negated
    /// for the inverse, for a call whose largest position is `max_position`;
    /// for `n_rot == 1`, `(cos t − sin t, 0)` per position.
    fn table<A: num_traits::FromPrimitive + Zero>(&self, first: i64, seq: usize, max_position: i64) -> Vec<(A, A)> {
        if self.n_rot == 1 {
            let freq = self.inv_freq(0, max_position);
            return (first..first + seq as i64)
                .map(|t| {
                    let theta = t as f64 * freq;
                    (c(theta.cos() - theta.sin()), A::zero())
                })
                .collect();
        }
        let half = self.n_rot / 2;
        let (amplitude, sign) = (self.amplitude(), if self.inverse { -1.0 } else { 1.0 });
        let freqs: Vec<f64> = (0..half).map(|i| self.inv_freq(i, max_position)).collect();
        let mut tab = Vec::with_capacity(seq * half);
        for t in first..first + seq as i64 {
            for &freq in &freqs {
                let theta = t as f64 * freq;
                tab.push((c(amplitude * theta.cos()), c(sign * amplitude * theta.sin())));
            }
        }
        tab
    }
}

/// Rotates `y` in place: it holds x on entry (the in-place pair), so each
/// pair is read before either element is written.
fn rope_kernel<T: Float>(op: &Rope, shape: &[usize], y: &mut [T], start: Option<&[i32]>) {
    let (seq, heads, dim) = (shape[1], shape[2], shape[3]);
    let row = heads * dim;
    if y.is_empty() || op.n_rot == 0 {
        return;
    }
    let half = op.n_rot / 2;
    match start {
        None => {
            let tab = op.table::<T::Acc>(0, seq, seq as i64 - 1);
            y.par_chunks_mut(row).enumerate().with_min_len(4).for_each(|(bt, yr)| {
                let t = bt % seq;
                rotate_row(op, dim, half, &tab[t * half.max(1)..(t + 1) * half.max(1)], yr);
            });
        }
        // Positions per batch row (each row's angles from its own start),
        // or per token.
        Some(start) => {
            // One position per (b, t) row; with T = 1 both forms agree.
            let per_token = start.len() == y.len() / row;
            let last = if per_token { 0 } else { seq as i64 - 1 };
            let max_position = start.iter().map(|&s| s as i64 + last).max().unwrap_or(0);
            y.par_chunks_mut(row).enumerate().with_min_len(4).for_each(|(bt, yr)| {
                let (b, t) = (bt / seq, bt % seq);
                let pos = if per_token { start[bt] as i64 } else { start[b] as i64 + t as i64 };
                let tab = op.table::<T::Acc>(pos, 1, max_position);
                rotate_row(op, dim, half, &tab, yr);
            });
        }
    }
}

/// Rotates the heads of one `(b, t)` row by its angles `tab` (`half` pairs,
/// or one entry for `n_rot == 1`).
fn rotate_row<T: Float>(op: &Rope, dim: usize, half: usize, tab: &[(T::Acc, T::Acc)], yr: &mut [T]) {
    for head in yr.chunks_mut(dim) {
        if op.n_rot == 1 {
            head[0] = T::from_acc(head[0].acc() * tab[0].0);
            continue;
        }
        for (i, &(cs, sn)) in tab[..half].iter().enumerate() {
            let (a, b) = (head[i].acc(), head[i + half].acc());
            head[i] = T::from_acc(a * cs - b * sn);
            head[i + half] = T::from_acc(b * cs + a * sn);
        }
    }
}

impl OpDef for Rope {
    /// Forward and inverse of: full and partial rotation, head size 1 and
    /// the n_rot == 1 quirk with pass-through dimensions, n_rot == 0, more
    /// pairs than one angle chunk of the GPU kernel (256), LLaMA-like heads
    /// at 4096 positions with both common bases; then Llama-3.x scaling
    /// with every band of wavelengths present (and the head-size-1 quirk).
    fn samples(d: DType) -> Vec<Sample> {
        let cases: [(&[usize], usize, f64); 17] = [
            (&[2, 5, 3, 8], 8, 10000.0),
            (&[2, 5, 3, 8], 4, 100.0),
            (&[2, 5, 3, 1], 1, 10000.0),
            (&[2, 5, 3, 3], 1, 10000.0),
            (&[2, 7, 3, 16], 16, 10000.0),
            (&[2, 7, 3, 16], 8, 10000.0),
            (&[2, 300, 4, 1], 1, 10000.0),
            (&[2, 9, 3, 4], 1, 10000.0),
            (&[1, 3, 2, 8], 0, 10000.0),
            (&[1, 5, 2, 1024], 1024, 10000.0),
            (&[1, 5, 3, 1024], 600, 10000.0),
            (&[1, 4096, 2, 128], 128, 10000.0),
            (&[1, 4096, 2, 128], 128, 500000.0),
            (&[3, 33, 5, 64], 32, 1e6),
            (&[2, 65, 4, 96], 64, 10000.0),
            (&[2, 65, 4, 96], 96, 10000.0),
            (&[2, 65, 4, 3], 1, 10000.0),
        ];
        let mut v = Vec::new();
        for (shape, n_rot, base) in cases {
            for inverse in [false, true] {
                let rope = Rope { n_rot, base, inverse, scaling: None };
                v.push(Sample::new(rope, vec![normal(d, shape)]).large_over(40_000));
            }
        }
        // Llama 3.1's parameters, and a short original context so that a
        // small head has pairs in all three bands (kept, interpolated,
        // divided by the factor).
        let llama31 = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let short = Llama3Scaling { original_max_position_embeddings: 32, ..llama31 };
        let scaled: [(&[usize], usize, f64, Llama3Scaling); 5] = [
            (&[2, 9, 3, 16], 16, 10000.0, short),
            (&[2, 9, 3, 20], 12, 100.0, short),
            (&[2, 9, 3, 1], 1, 10000.0, short),
            (&[1, 5, 2, 128], 128, 500000.0, llama31),
            (&[1, 4096, 2, 128], 128, 500000.0, llama31),
        ];
        for (shape, n_rot, base, scaling) in scaled {
            for inverse in [false, true] {
                let rope = Rope { n_rot, base, inverse, scaling: Some(scaling.into()) };
                v.push(Sample::new(rope, vec![normal(d, shape)]).large_over(40_000));
            }
        }
        // Per-row start positions (generation): one new token per row at
        // different positions, a few new tokens, a negative start, the
        // head-size-1 quirk, scaling, and a decode batch of a real geometry.
        type Positioned<'a> = (&'a [usize], usize, &'a [f64], Option<RopeScaling>);
        let positioned: [Positioned; 6] = [
            (&[3, 1, 2, 8], 8, &[0.0, 5.0, 700.0], None),
            (&[2, 4, 3, 16], 12, &[3.0, 0.0], None),
            (&[2, 2, 2, 4], 4, &[-1.0, 2.0], None),
            (&[2, 3, 2, 1], 1, &[1.0, 9.0], None),
            (&[2, 1, 3, 16], 16, &[9.0, 40.0], Some(short.into())),
            (
                &[16, 1, 32, 100],
                100,
                &[511.0, 600.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 767.0],
                None,
            ),
        ];
        for (shape, n_rot, start, scaling) in positioned {
            for inverse in [false, true] {
                let rope = Rope { n_rot, base: 10000.0, inverse, scaling: scaling.clone() };
                let start = fixed(DType::I32, &[shape[0]], start);
                v.push(Sample::new(rope, vec![normal(d, shape), start]).large_over(40_000));
            }
        }
        // LongRoPE: factors per pair and an attention factor, the short set
        // while the call's positions stay inside the original context (9
        // positions, original 9) and the long one past it (original 8),
        // on a partial rotation too; then with per-row starts where one
        // row alone crosses the original context (every row takes the long
        // set), where none does, and with per-token positions.
        let long_rope = |pairs: usize, original: usize| {
            RopeScaling::LongRope(LongRope {
                short_factor: (0..pairs).map(|i| 1.0 + 0.25 * i as f64).collect(),
                long_factor: (0..pairs).map(|i| 1.5 + 3.0 * i as f64).collect(),
                original_max_position_embeddings: original,
                attention_factor: 1.19,
            })
        };
        let longs: [(&[usize], usize, usize); 4] =
            [(&[2, 9, 3, 16], 16, 9), (&[2, 9, 3, 16], 16, 8), (&[2, 9, 3, 20], 12, 8), (&[1, 70, 2, 96], 96, 64)];
        for (shape, n_rot, original) in longs {
            for inverse in [false, true] {
                let rope = Rope { n_rot, base: 10000.0, inverse, scaling: Some(long_rope(n_rot / 2, original)) };
                v.push(Sample::new(rope, vec![normal(d, shape)]));
            }
        }
        let long_positioned: [(&[usize], &[usize], &[f64]); 3] = [
            (&[3, 1, 2, 8], &[3], &[0.0, 5.0, 30.0]),
            (&[2, 2, 2, 8], &[2], &[3.0, 4.0]),
            (&[2, 3, 2, 8], &[2, 3], &[0.0, 1.0, 2.0, 0.0, 1.0, 0.0]),
        ];
        for (shape, positions_shape, positions) in long_positioned {
            for inverse in [false, true] {
                let rope = Rope { n_rot: 8, base: 10000.0, inverse, scaling: Some(long_rope(4, 6)) };
                let positions = fixed(DType::I32, positions_shape, positions);
                v.push(Sample::new(rope, vec![normal(d, shape), positions]));
            }
        }
        // Positions per token (packed documents restarting at 0).
        let per_token: [(&[usize], usize, &[f64]); 2] = [
            (&[2, 4, 3, 8], 8, &[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 2.0, 3.0]),
            (&[1, 6, 2, 16], 12, &[0.0, 1.0, 2.0, 0.0, 0.0, 1.0]),
        ];
        for (shape, n_rot, positions) in per_token {
            for inverse in [false, true] {
                let rope = Rope { n_rot, base: 10000.0, inverse, scaling: None };
                let positions = fixed(DType::I32, &shape[..2], positions);
                v.push(Sample::new(rope, vec![normal(d, shape), positions]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "rope"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if inputs.is_empty() || inputs.len() > 2 {
            return Err(format!("expects x and optionally per-row start positions, got {} inputs", inputs.len()));
        }
        let x = inputs[0];
        expect_float(x, "x")?;
        if x.rank() != 4 {
            return Err(format!("x must be [B, T, H, D] (rank 4), got {x}"));
        }
        if let Some(start) = inputs.get(1) {
            let (b, t) = (x.shape[0], x.shape[1]);
            if start.dtype != DType::I32 || (start.shape != [b] && start.shape != [b, t]) {
                return Err(format!(
                    "positions must be i32[{b}] (a start per batch row) or i32[{b}, {t}] (one per token), got {start}"
                ));
            }
        }
        let d = x.shape[3];
        if self.n_rot > d {
            return Err(format!("n_rot={} exceeds the head size D={d} of x {x}", self.n_rot));
        }
        if self.n_rot % 2 == 1 && self.n_rot != 1 {
            return Err(format!("n_rot={} must be even (or 1, the head-size-1 quirk)", self.n_rot));
        }
        if !(self.base.is_finite() && self.base > 0.0) {
            return Err(format!("base={} must be a positive number", self.base));
        }
        if let Some(scaling) = &self.scaling {
            scaling.check(self.n_rot)?;
        }
        Ok(vec![x.clone()])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else {
            return Ok(vec![None]);
        };
        let transpose = if self.n_rot == 1 { self.clone() } else { Rope { inverse: !self.inverse, ..self.clone() } };
        // The same positions rotate the cotangent back; positions have none.
        let mut ins = vec![g];
        ins.extend(args.inputs.get(1));
        let gx = b.push1(transpose.into(), &ins)?;
        Ok(if args.inputs.len() == 2 { vec![Some(gx), None] } else { vec![Some(gx)] })
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let shape = io.out_ty(0).shape.clone();
        let start = (io.inputs.len() == 2).then(|| io.input::<i32>(1).to_vec());
        with_float!(io.out_ty(0).dtype, T => {
            rope_kernel::<T>(self, &shape, io.inplace(0, 0), start.as_deref());
            Ok(())
        })
    }
    /// Plain RoPE prints three attributes; Llama-3.x scaling adds its four
    /// and LongRoPE its factors, so traces of unscaled models print as
    /// they always have.
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut attrs = vec![
            ("n_rot", Attr::Int(self.n_rot as i64)),
            ("base", Attr::Float(self.base)),
            ("inverse", Attr::Bool(self.inverse)),
        ];
        match &self.scaling {
            Some(RopeScaling::Llama3(s)) => attrs.extend([
                ("llama3_factor", Attr::Float(s.factor)),
                ("low_freq_factor", Attr::Float(s.low_freq_factor)),
                ("high_freq_factor", Attr::Float(s.high_freq_factor)),
                ("original_max_pos", Attr::Int(s.original_max_position_embeddings as i64)),
            ]),
            Some(RopeScaling::LongRope(s)) => attrs.extend([
                ("short_factor", Attr::Floats(s.short_factor.clone())),
                ("long_factor", Attr::Floats(s.long_factor.clone())),
                ("original_max_pos", Attr::Int(s.original_max_position_embeddings as i64)),
                ("attention_factor", Attr::Float(s.attention_factor)),
            ]),
            None => {}
        }
        attrs
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "rope").then(|| {
            let scaling = if a.map.contains_key("llama3_factor") {
                Some(RopeScaling::Llama3(Llama3Scaling {
                    factor: a.float("llama3_factor")?,
                    low_freq_factor: a.float("low_freq_factor")?,
                    high_freq_factor: a.float("high_freq_factor")?,
                    original_max_position_embeddings: a.usize("original_max_pos")?,
                }))
            } else if a.map.contains_key("short_factor") {
                Some(RopeScaling::LongRope(LongRope {
                    short_factor: a.floats("short_factor")?,
                    long_factor: a.floats("long_factor")?,
                    original_max_position_embeddings: a.usize("original_max_pos")?,
                    attention_factor: a.float("attention_factor")?,
                }))
            } else {
                None
            };
            Ok(Rope { n_rot: a.usize("n_rot")?, base: a.float("base")?, inverse: a.bool("inverse")?, scaling })
        })
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0)]
    }
}

impl Builder {
    /// Rotary embedding of `x: [B, T, H, D]` whose row `b` starts at
    /// position `start[b]` (an `i32[B]` value) rather than 0: the positions
    /// of new tokens appended to a cache.
    pub fn rope_at(
        &mut self,
        x: ValueId,
        start: ValueId,
        n_rot: usize,
        base: f64,
        scaling: Option<RopeScaling>,
    ) -> Result<ValueId> {
        self.push1(Rope { n_rot, base, inverse: false, scaling }.into(), &[x, start])
    }

    /// Rotary embedding of `x: [B, T, H, D]` whose token `(b, t)` sits at
    /// `positions[b, t]` (an `i32[B, T]` value): packed documents.
    pub fn rope_positions(
        &mut self,
        x: ValueId,
        positions: ValueId,
        n_rot: usize,
        base: f64,
        scaling: Option<RopeScaling>,
    ) -> Result<ValueId> {
        self.push1(Rope { n_rot, base, inverse: false, scaling }.into(), &[x, positions])
    }

    /// Rotary embedding of the first `n_rot` dims of each head of `x: [B, T, H, D]`
    /// (Hugging Face `rotate_half` convention; see the module doc for `n_rot == 1`).
    /// `scaling` is a frequency scaling, `None` for plain RoPE.
    pub fn rope(&mut self, x: ValueId, n_rot: usize, base: f64, scaling: Option<RopeScaling>) -> Result<ValueId> {
        self.push1(Rope { n_rot, base, inverse: false, scaling }.into(), &[x])
    }
}
