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

use super::sample::{normal, Sample};
use super::{expect_float, expect_inputs, Attr, Attrs, OpDef, VjpArgs};
use crate::cpu::{c, Float, KernelIo};
use crate::error::Result;
use crate::ir::DType;
use crate::ir::{Builder, TensorType, ValueId};
use crate::with_float;

/// Rotates the first `n_rot` dims of each head of `x: [B, T, H, D]`; see the module doc.
#[derive(Clone, PartialEq, Debug)]
pub struct Rope {
    pub n_rot: usize,
    pub base: f64,
    pub inverse: bool,
}

impl Rope {
    /// `(cos θ, sin θ)` per position and pair, `[T, n_rot/2]`, sin negated
    /// for the inverse; for `n_rot == 1`, `(cos t − sin t, 0)` per position.
    fn table<A: num_traits::FromPrimitive + Zero>(&self, seq: usize) -> Vec<(A, A)> {
        if self.n_rot == 1 {
            return (0..seq)
                .map(|t| {
                    let t = t as f64;
                    (c(t.cos() - t.sin()), A::zero())
                })
                .collect();
        }
        let half = self.n_rot / 2;
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut tab = Vec::with_capacity(seq * half);
        for t in 0..seq {
            for i in 0..half {
                let theta = t as f64 * self.base.powf(-2.0 * i as f64 / self.n_rot as f64);
                tab.push((c(theta.cos()), c(sign * theta.sin())));
            }
        }
        tab
    }
}

/// Rotates `y` in place: it holds x on entry (the in-place pair), so each
/// pair is read before either element is written.
fn rope_kernel<T: Float>(op: &Rope, shape: &[usize], y: &mut [T]) {
    let (seq, heads, dim) = (shape[1], shape[2], shape[3]);
    let row = heads * dim;
    if y.is_empty() || op.n_rot == 0 {
        return;
    }
    let tab = op.table::<T::Acc>(seq);
    let half = op.n_rot / 2;
    y.par_chunks_mut(row).enumerate().with_min_len(4).for_each(|(bt, yr)| {
        let t = bt % seq;
        for head in yr.chunks_mut(dim) {
            if op.n_rot == 1 {
                head[0] = T::from_acc(head[0].acc() * tab[t].0);
                continue;
            }
            for (i, &(cs, sn)) in tab[t * half..(t + 1) * half].iter().enumerate() {
                let (a, b) = (head[i].acc(), head[i + half].acc());
                head[i] = T::from_acc(a * cs - b * sn);
                head[i + half] = T::from_acc(b * cs + a * sn);
            }
        }
    });
}

impl OpDef for Rope {
    /// Forward and inverse of: full and partial rotation, head size 1 and
    /// the n_rot == 1 quirk with pass-through dimensions, n_rot == 0, more
    /// pairs than one angle chunk of the GPU kernel (256), LLaMA-like heads
    /// at 4096 positions with both common bases.
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
                v.push(Sample::new(Rope { n_rot, base, inverse }, vec![normal(d, shape)]).large_over(40_000));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "rope"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        let x = inputs[0];
        expect_float(x, "x")?;
        if x.rank() != 4 {
            return Err(format!("x must be [B, T, H, D] (rank 4), got {x}"));
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
        Ok(vec![x.clone()])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else {
            return Ok(vec![None]);
        };
        let transpose = if self.n_rot == 1 { self.clone() } else { Rope { inverse: !self.inverse, ..self.clone() } };
        Ok(vec![Some(b.push1(transpose.into(), &[g])?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let shape = io.out_ty(0).shape.clone();
        with_float!(io.out_ty(0).dtype, T => {
            rope_kernel::<T>(self, &shape, io.inplace(0, 0));
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![
            ("n_rot", Attr::Int(self.n_rot as i64)),
            ("base", Attr::Float(self.base)),
            ("inverse", Attr::Bool(self.inverse)),
        ]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "rope")
            .then(|| Ok(Rope { n_rot: a.usize("n_rot")?, base: a.float("base")?, inverse: a.bool("inverse")? }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0)]
    }
}

impl Builder {
    /// Rotary embedding of the first `n_rot` dims of each head of `x: [B, T, H, D]`
    /// (Hugging Face `rotate_half` convention; see the module doc for `n_rot == 1`).
    pub fn rope(&mut self, x: ValueId, n_rot: usize, base: f64) -> Result<ValueId> {
        self.push1(Rope { n_rot, base, inverse: false }.into(), &[x])
    }
}
