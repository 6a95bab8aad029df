//! AdamW with 8-bit moments ([`AdamW8bit`]): the update of
//! [`super::optim::AdamW`] with each moment stored as one byte per element
//! and one f32 scale per block of [`BLOCK`] elements, dynamically
//! quantized as the 8-bit optimizers of Dettmers et al. (2022) store
//! theirs. The moments of a parameter take 2 bytes per element and 8 bytes
//! per 2048 elements instead of 8 (f32 moments) or 4 (16-bit moments).
//!
//! **Codes.** A moment's block is divided by its largest magnitude (the
//! block's `absmax`), and each quotient is stored as the index of the
//! nearest of 256 values ([`dynamic_map`]) in the code's byte: 0, 1 and,
//! for each decade 10⁻⁶ … 10⁻¹ … 1, values spread evenly over `[0.1, 1)` of
//! that decade, more of them in the larger decades. The first moment uses
//! the signed map (127 values of each sign), the second, never negative,
//! the unsigned one (254 positive values). A value halfway between two
//! codes takes the lower one, except that a positive second moment never
//! takes the code of zero ([`second_moment_code`]). Dequantization is `map[code] · absmax`, so a
//! block of zeros (any code, absmax 0) reads as zeros: zeroed state is a
//! valid start.
//!
//! **The update**, per element, as `AdamW`'s in the parameter's compute type
//! (f32): the moments read dequantized, `m ← lerp(m, g, 1 − β1)`,
//! `v ← v·β2 + (1 − β2)·g²`, and the parameter (or its master) updated with
//! these new moments before they are quantized, as the 8-bit optimizers do;
//! then each block's new absmax and codes are stored. Everything is one
//! correctly rounded operation at a time and the map is built in f64 from
//! exact constants, so the CUDA kernel gives the CPU's bytes.
//!
//! Inputs `(p, g, m_codes, m_absmax, v_codes, v_absmax, lr, step[, w][, scale])`,
//! outputs `(p', m_codes', m_absmax', v_codes', v_absmax'[, w'])`: the codes
//! are `i32 [⌈n/4⌉]` words holding four codes each (element `i`'s in byte
//! `i` of the buffer, little-endian), the scales `f32 [⌈n/2048⌉]`. f64
//! parameters are not taken (they exist for finite-difference checks).

use rayon::prelude::*;

use super::optim::{AdamW, MasterWeights};
use super::sample::{ids, normal, positive, scalar, zeros, Sample};
use super::{expect_float, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{Float, KernelIo};

/// Elements per quantization block (one f32 scale each).
pub const BLOCK: usize = 2048;

/// Codes per i32 word of a code buffer.
pub const CODES_PER_WORD: usize = 4;

/// Suffixes of a parameter's 8-bit state leaves (`<param>.exp_avg.codes`, ...).
pub const CODES_SUFFIX: &str = "codes";
pub const ABSMAX_SUFFIX: &str = "absmax";

/// The 256 code values of the signed (first moment) or unsigned (second
/// moment) map, ascending; see the module doc. Decade `d` (0..7, values
/// `10^(d−6)·[0.1, 1)`) holds `2^d` values (signed, each sign) or
/// `2^(d+1)` (unsigned), the `j`-th at `10^(d−6)·(0.1 + 0.9·(2j+1)/(2n))`,
/// computed in f64 one correctly rounded operation at a time and rounded
/// once to f32.
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    const DECADES: [f64; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];
    let mut values = Vec::with_capacity(256);
    for (d, scale) in DECADES.into_iter().enumerate() {
        let n = if signed { 1usize << d } else { 1usize << (d + 1) };
        for j in 0..n {
            let frac = (2 * j + 1) as f64 / (2 * n) as f64;
            let v = ((0.1 + 0.9 * frac) * scale) as f32;
            values.push(v);
            if signed {
                values.push(-v);
            }
        }
    }
    values.extend([0.0, 1.0]);
    values.sort_by(f32::total_cmp);
    values.try_into().expect("127 + 127 + 2 or 254 + 2 values")
}

/// The code of `x` (a quotient by the block's absmax, in `[-1, 1]`): the
/// index of the nearest map value, the lower one on a tie, the end codes
/// beyond the map.
pub fn quantize(x: f32, map: &[f32; 256]) -> u8 {
    // The first index whose value is at least x.
    let (mut lo, mut hi) = (0usize, 256usize);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if map[mid] < x {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        return 0;
    }
    if lo == 256 {
        return 255;
    }
    let (below, above) = (x - map[lo - 1], map[lo] - x);
    if above < below {
        lo as u8
    } else {
        (lo - 1) as u8
    }
}

/// The code of a second moment `v` of a block whose largest is `v_max`:
/// the nearest, but never zero for a positive `v`. A positive moment read
/// back as zero would leave only `eps` under the first moment, and a
/// parameter whose gradient is zero for a while (an embedding row no token
/// of the batch uses) would take a step of `lr·m/eps`; at the smallest
/// positive code its step is smaller than with the true moment, never larger.
pub fn second_moment_code(v: f32, v_max: f32, map: &[f32; 256]) -> u8 {
    // Zero (or NaN) as the block's largest: every code reads as zero.
    if v_max.is_nan() || v_max <= 0.0 {
        return 0;
    }
    let code = quantize(v / v_max, map);
    if code == 0 && v > 0.0 {
        1
    } else {
        code
    }
}

/// AdamW with 8-bit block-quantized moments; its hyperparameters and master
/// state are [`AdamW`]'s. See the module doc.
#[derive(Clone, PartialEq, Debug, serde::Serialize)]
pub struct AdamW8bit {
    pub hyper: AdamW,
}

/// The types of a parameter's 8-bit moment: its codes and its scales.
pub fn state_types(param: &TensorType) -> (TensorType, TensorType) {
    let n = param.numel();
    (TensorType::new(DType::I32, [n.div_ceil(CODES_PER_WORD)]), TensorType::new(DType::F32, [n.div_ceil(BLOCK)]))
}

impl AdamW8bit {
    fn extra(&self) -> usize {
        (self.hyper.master != MasterWeights::None) as usize
    }
}

/// One block's update (see the module doc) over its `p`, `g`, codes and
/// master slice, given the scales it starts from; returns the new scales.
#[allow(clippy::too_many_arguments)]
fn update_block<P: Float<Acc = f32>, W: Float<Acc = f32>>(
    hyper: &AdamW,
    c: &super::optim::Coefs<f32>,
    maps: (&[f32; 256], &[f32; 256]),
    p: &mut [P],
    g: &[P],
    scale: Option<f32>,
    mq: &mut [u8],
    vq: &mut [u8],
    absmax: (f32, f32),
    mut w: Option<&mut [W]>,
) -> (f32, f32) {
    let (signed, unsigned) = maps;
    let mut m_new = [0f32; BLOCK];
    let mut v_new = [0f32; BLOCK];
    for i in 0..p.len() {
        let gi = match scale {
            Some(s) => P::from_acc(g[i].acc() * s).acc(),
            None => g[i].acc(),
        };
        let p0 = p[i].acc();
        let w0 = match (hyper.master, w.as_deref()) {
            (MasterWeights::F32, Some(w)) if !c.first => w[i].acc(),
            (MasterWeights::Kahan, Some(w)) => p0 + w[i].acc(),
            _ => p0,
        };
        let wi = w0 * c.decay;
        let m0 = signed[mq[i] as usize] * absmax.0;
        let v0 = unsigned[vq[i] as usize] * absmax.1;
        let mi = super::optim::lerp(m0, gi, c.w1);
        let vi = v0 * c.beta2 + c.w2 * gi * gi;
        let denom = vi.sqrt() / c.bc2_sqrt + c.eps;
        let w_new = wi + c.neg_step_size * mi / denom;
        p[i] = P::from_acc(w_new);
        if let Some(w) = w.as_deref_mut() {
            let kept = match hyper.master {
                MasterWeights::Kahan => w_new - p[i].acc(),
                _ => w_new,
            };
            w[i] = W::from_acc(kept);
        }
        m_new[i] = mi;
        v_new[i] = vi;
    }
    let n = p.len();
    let m_max = m_new[..n].iter().fold(0f32, |a, x| a.max(x.abs()));
    let v_max = v_new[..n].iter().fold(0f32, |a, x| a.max(x.abs()));
    for i in 0..n {
        mq[i] = if m_max > 0.0 { quantize(m_new[i] / m_max, signed) } else { quantize(0.0, signed) };
        vq[i] = second_moment_code(v_new[i], v_max, unsigned);
    }
    (m_max, v_max)
}

fn kernel<P: Float<Acc = f32>, W: Float<Acc = f32>>(op: &AdamW8bit, io: &KernelIo, c: &super::optim::Coefs<f32>) {
    let at = 8 + op.extra();
    let scale = (io.inputs.len() > at).then(|| io.input::<P>(at)[0].acc());
    let p = io.inplace::<P>(0, 0);
    let mq: &mut [u8] = bytemuck::cast_slice_mut(io.inplace::<i32>(1, 2));
    let ms = io.inplace::<f32>(2, 3);
    let vq: &mut [u8] = bytemuck::cast_slice_mut(io.inplace::<i32>(3, 4));
    let vs = io.inplace::<f32>(4, 5);
    let g = io.input::<P>(1);
    let n = p.len();
    // The codes past the last element (the last word's padding) are zero.
    mq[n..].fill(0);
    vq[n..].fill(0);
    let (signed, unsigned) = (dynamic_map(true), dynamic_map(false));
    let w: Vec<Option<&mut [W]>> = match op.hyper.master {
        MasterWeights::None => (0..ms.len()).map(|_| None).collect(),
        _ => io.inplace::<W>(5, 8).chunks_mut(BLOCK).map(Some).collect(),
    };
    p.par_chunks_mut(BLOCK)
        .zip(g.par_chunks(BLOCK))
        .zip(mq[..n].par_chunks_mut(BLOCK))
        .zip(vq[..n].par_chunks_mut(BLOCK))
        .zip(ms.par_iter_mut().zip(vs.par_iter_mut()))
        .zip(w.into_par_iter())
        .for_each(|(((((p, g), mq), vq), (ms, vs)), w)| {
            let (m_max, v_max) =
                update_block::<P, W>(&op.hyper, c, (&signed, &unsigned), p, g, scale, mq, vq, (*ms, *vs), w);
            (*ms, *vs) = (m_max, v_max);
        });
}

impl OpDef for AdamW8bit {
    fn name(&self) -> &'static str {
        "adamw_8bit"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        self.hyper.check_update_inputs(inputs, 8 + self.extra())?;
        let p = inputs[0];
        expect_float(p, "the parameter")?;
        if p.dtype == DType::F64 {
            return Err("8-bit moments serve f32, bf16 and f16 parameters, not f64".into());
        }
        super::expect_same(p, inputs[1], "the parameter and its gradient")?;
        let (codes, scales) = state_types(p);
        for (name, got, want) in [
            ("first moment's codes", inputs[2], &codes),
            ("first moment's scales", inputs[3], &scales),
            ("second moment's codes", inputs[4], &codes),
            ("second moment's scales", inputs[5], &scales),
        ] {
            if got != want {
                return Err(format!("the {name} must be {want} for the parameter {p}, got {got}"));
            }
        }
        super::optim::check_lr_step_types(inputs[6], inputs[7])?;
        let mut out = vec![p.clone(), codes.clone(), scales.clone(), codes, scales];
        out.extend(self.hyper.master.infer_state(p, inputs.get(8).copied())?);
        Ok(out)
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        Err(super::optim::not_differentiable(self.name()))
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (lr, step) = super::optim::checked_lr_step(io, 6)?;
        let c = self.hyper.coefs::<f32>(lr, step);
        let f32_master = self.hyper.master == MasterWeights::F32;
        match (io.in_ty(0).dtype, f32_master) {
            (DType::F32, _) => kernel::<f32, f32>(self, io, &c),
            (DType::BF16, true) => kernel::<half::bf16, f32>(self, io, &c),
            (DType::BF16, false) => kernel::<half::bf16, half::bf16>(self, io, &c),
            (DType::F16, true) => kernel::<half::f16, f32>(self, io, &c),
            (DType::F16, false) => kernel::<half::f16, half::f16>(self, io, &c),
            (d, _) => return Err(Error::op("adamw_8bit", format!("8-bit moments serve f32, bf16 and f16, not {d}"))),
        }
        Ok(())
    }
    /// Every parameter dtype but f64: from zeroed state (step 1) and from
    /// random codes and scales (step 3), with the second set of
    /// hyperparameters, an f32 master and clipping's factor; lengths of one
    /// element, of part of a block, of a block and a part, of several blocks.
    fn samples(d: DType) -> Vec<Sample> {
        if d == DType::F64 {
            return Vec::new();
        }
        let hypers =
            [AdamW::default(), AdamW { beta1: 0.3, beta2: 0.95, eps: 1e-6, weight_decay: 0.1, ..AdamW::default() }];
        let mut v = Vec::new();
        for (h, hyper) in hypers.into_iter().enumerate() {
            for n in [1usize, 17, 2048 + 33, 3 * 2048] {
                let ty = TensorType::new(d, [n]);
                let (codes, scales) = state_types(&ty);
                let state = |c: &TensorType, s: &TensorType| {
                    if h == 0 {
                        [zeros(DType::I32, &c.shape), zeros(DType::F32, &s.shape)]
                    } else {
                        [ids(DType::I32, &c.shape, i32::MAX as i64), positive(DType::F32, &s.shape)]
                    }
                };
                let [mq, ms] = state(&codes, &scales);
                let [vq, vs] = state(&codes, &scales);
                let (lr, step) = if h == 0 { (1e-3, 1.0) } else { (2e-2, 3.0) };
                let inputs = vec![
                    normal(d, &[n]),
                    normal(d, &[n]),
                    mq,
                    ms,
                    vq,
                    vs,
                    scalar(DType::F32, lr),
                    scalar(DType::F32, step),
                ];
                v.push(Sample::new(AdamW8bit { hyper: hyper.clone() }, inputs.clone()));
                if n == 17 {
                    let mut scaled = inputs.clone();
                    scaled.push(scalar(d, 0.37));
                    v.push(Sample::new(AdamW8bit { hyper: hyper.clone() }, scaled));
                    let master = AdamW8bit { hyper: AdamW { master: MasterWeights::F32, ..hyper.clone() } };
                    let mut with = inputs;
                    with.push(normal(DType::F32, &[n]));
                    v.push(Sample::new(master, with));
                }
            }
        }
        v
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        self.hyper.attrs()
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "adamw_8bit").then(|| AdamW::parse_attrs("adamw_8bit", a).map(|hyper| AdamW8bit { hyper }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        let mut pairs = vec![(0, 0), (1, 2), (2, 3), (3, 4), (4, 5)];
        if self.hyper.master != MasterWeights::None {
            pairs.push((5, 8));
        }
        pairs
    }
    fn with_input_scale(&self, input: usize, inputs: &[&TensorType], scale: &TensorType) -> Option<(Self, usize)> {
        let at = 8 + self.extra();
        super::optim::takes_gradient_scale(input, inputs, scale, at).then(|| (self.clone(), at))
    }
}

impl Builder {
    /// One AdamW update of `p` with gradient `g` and 8-bit moments
    /// `(codes, absmax)` each ([`AdamW8bit`]); returns `(p', m', v', w')`
    /// with each moment's `(codes, absmax)`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn adamw_8bit(
        &mut self,
        p: ValueId,
        g: ValueId,
        m: (ValueId, ValueId),
        v: (ValueId, ValueId),
        lr: ValueId,
        step: ValueId,
        w: Option<ValueId>,
        hyper: &AdamW,
    ) -> Result<(ValueId, (ValueId, ValueId), (ValueId, ValueId), Option<ValueId>)> {
        let mut inputs = vec![p, g, m.0, m.1, v.0, v.1, lr, step];
        inputs.extend(w);
        let outs = self.push(AdamW8bit { hyper: hyper.clone() }.into(), &inputs)?;
        Ok((outs[0], (outs[1], outs[2]), (outs[3], outs[4]), outs.get(5).copied()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_maps_hold_256_sorted_values_with_zero_and_one() {
        for signed in [true, false] {
            let m = dynamic_map(signed);
            assert!(m.windows(2).all(|w| w[0] < w[1]), "strictly ascending");
            assert!(m.contains(&0.0) && m[255] == 1.0);
            assert_eq!(m.iter().filter(|x| **x < 0.0).count(), if signed { 127 } else { 0 });
            // The smallest positive value sits in the lowest decade.
            let smallest = m.iter().copied().filter(|x| *x > 0.0).fold(1.0f32, f32::min);
            assert!((3e-7..6e-7).contains(&smallest), "{smallest}");
        }
    }

    /// The hyperparameters are checked as dense AdamW's are.
    #[test]
    fn bad_hyperparameters_are_refused_by_the_shape_rule() {
        let p = TensorType::new(DType::BF16, [17]);
        let (codes, scales) = state_types(&p);
        let s = TensorType::scalar(DType::F32);
        let inputs = [&p, &p, &codes, &scales, &codes, &scales, &s, &s];
        let good = AdamW8bit { hyper: AdamW::default() };
        assert!(good.infer(&inputs).is_ok());
        let bad = AdamW8bit { hyper: AdamW { beta1: 1.5, ..AdamW::default() } };
        assert!(bad.infer(&inputs).unwrap_err().contains("beta1"));
    }

    #[test]
    fn quantizing_picks_the_nearest_code_and_the_lower_on_a_tie() {
        let m = dynamic_map(true);
        for (i, &x) in m.iter().enumerate() {
            assert_eq!(quantize(x, &m) as usize, i);
        }
        let zero = m.iter().position(|x| *x == 0.0).unwrap();
        assert_eq!(quantize(1e-9, &m) as usize, zero);
        assert_eq!(quantize(2.0, &m), 255);
        assert_eq!(quantize(-2.0, &m), 0);
        // Halfway between two codes (exactly representable here): the lower.
        let (a, b) = (m[250], m[251]);
        let mid = a + (b - a) / 2.0;
        if mid - a == b - mid {
            assert_eq!(quantize(mid, &m), 250);
        }
        // Every quotient lands within half a gap of its code.
        for k in 0..1000 {
            let x = -1.0 + 2.0 * k as f32 / 999.0;
            let q = m[quantize(x, &m) as usize];
            let gap = m.windows(2).map(|w| w[1] - w[0]).fold(0.0f32, f32::max);
            assert!((q - x).abs() <= gap / 2.0 + 1e-7, "{x} -> {q}");
        }
    }
}
