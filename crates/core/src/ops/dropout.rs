//! Dropout with a counter-based mask ([`Dropout`], [`Builder::dropout`]):
//! `y = x · mask / (1 − p)`, the mask a pure function of the op's stream,
//! its micro-batch, the step count and the element's index, so it needs no
//! random state, is the same in forward, backward and any recomputation,
//! and is the same bits on the CPU and on CUDA (`kernels/dropout.cu`
//! computes the same integer hash).
//!
//! The mask ([`keep`]): with `mix(z)` SplitMix64's finalizer
//! (`z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27;
//! z *= 0x94d049bb133111eb; z ^= z >> 31`, wrapping u64 arithmetic) and
//! `γ = 0x9e3779b97f4a7c15`, the key is
//! `mix(mix(mix(γ ^ stream) ^ step) ^ micro_batch)` and element `i`'s draw
//! is `r = mix(key + (i + 1) · γ) >> 32` (output `i` of a SplitMix64
//! generator seeded with the key), a u32. The element is kept when
//! `r ≥ threshold`, `threshold = round(p · 2³²)` (halves away from zero,
//! as a u64 in `[0, 2³²]`), so it is kept with probability
//! `(2³² − threshold) / 2³²`. `step` is the step-count tensor's f32 value
//! converted to u64 as Rust's `as` does (toward zero, saturating, NaN to
//! 0); `i` is the flat row-major index.
//!
//! Numerics: a kept element is `x · s` in the accumulator type (f32 for
//! f32, bf16 and f16; f64 for f64) with `s = 1 / (1 − p)` computed in f64
//! and rounded once to the accumulator type, the product rounded once to
//! storage; a dropped element is +0 whatever `x` is. `p = 0` keeps every
//! element and multiplies by 1: a copy.
//!
//! Dropout is linear in `x` with the same mask, so its VJP is the same op
//! on the cotangent. In place: `y` may overwrite `x`.

use super::sample::{normal, scalar};
use super::{expect_float, expect_inputs, Attr, Attrs, OpDef, Sample, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{c, par_chunks, Float, KernelIo, CHUNK};
use crate::with_float;

/// `y = x · keep / (1 − p)`; inputs `(x, step)`, `step` the one-element f32
/// step count of a train step (1, 2, 3, …).
#[derive(Clone, PartialEq, Debug)]
pub struct Dropout {
    /// The probability of dropping an element, in `[0, 1)`.
    pub p: f64,
    /// Which dropout of the model this is: each site draws its own masks.
    pub stream: u64,
    /// The micro-batch of gradient accumulation (0 without): each
    /// micro-batch of a step draws its own masks.
    pub micro_batch: u32,
}

/// SplitMix64's increment, the golden ratio in 64 bits.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: a bijection of u64 that mixes every input
/// bit into every output bit.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of one mask: every element's draw derives from it.
pub fn mask_key(stream: u64, micro_batch: u32, step: u64) -> u64 {
    mix64(mix64(mix64(GAMMA ^ stream) ^ step) ^ micro_batch as u64)
}

/// Element `i`'s draw under `key`.
pub fn draw(key: u64, i: u64) -> u32 {
    (mix64(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA))) >> 32) as u32
}

/// The draws below which an element is dropped: `round(p · 2³²)`.
pub fn threshold(p: f64) -> u64 {
    (p * 4_294_967_296.0).round() as u64
}

/// Whether element `i` is kept (see the module doc).
pub fn keep(stream: u64, micro_batch: u32, step: u64, i: u64, p: f64) -> bool {
    draw(mask_key(stream, micro_batch, step), i) as u64 >= threshold(p)
}

impl Dropout {
    /// `1 / (1 − p)` in f64: the kernels round it once to their accumulator type.
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - self.p)
    }
}

impl OpDef for Dropout {
    fn name(&self) -> &'static str {
        "dropout"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if !(self.p >= 0.0 && self.p < 1.0) {
            return Err(format!("the drop probability must be in [0, 1), got {}", self.p));
        }
        expect_inputs(inputs, 2)?;
        expect_float(inputs[0], "x")?;
        let step = inputs[1];
        if step.dtype != DType::F32 || step.numel() != 1 {
            return Err(format!("the step count must be a one-element f32 tensor, got {step}"));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(gy) = args.cotangents[0] else { return Ok(vec![None, None]) };
        // The same mask on the cotangent; the step count gets none.
        let gx = b.push1(self.clone().into(), &[gy, args.inputs[1]])?;
        Ok(vec![Some(gx), None])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = io.out_ty(0).numel();
        // Rust's `as`: toward zero, saturating, NaN to 0, as the CUDA kernel.
        let step = io.scalar(1)? as u64;
        let key = mask_key(self.stream, self.micro_batch, step);
        let threshold = threshold(self.p);
        let scale = self.scale();
        with_float!(io.out_ty(0).dtype, T => {
            let (x, y) = (io.input_ptr::<T>(0), io.output_ptr::<T>(0));
            let s: <T as Float>::Acc = c(scale);
            let zero = T::from_acc(c(0.0));
            par_chunks(n, CHUNK, |r| {
                for i in r {
                    // SAFETY: element i of x is read before element i of y
                    // (which may alias x) is written; chunks are disjoint.
                    unsafe {
                        let v = if draw(key, i as u64) as u64 >= threshold { T::from_acc(x.read(i).acc() * s) } else { zero };
                        y.write(i, v);
                    }
                }
            });
            Ok(())
        })
    }
    /// Pointwise shapes from a scalar to a model's `[batch, tokens, width]`,
    /// probabilities from 0 (a copy) to 0.9, streams including one past
    /// 2⁶³, several micro-batches and steps.
    fn samples(d: DType) -> Vec<Sample> {
        let cases: [(&[usize], f64, u64, u32, f64); 8] = [
            (&[], 0.5, 1, 0, 1.0),
            (&[1], 0.1, 7, 0, 3.0),
            (&[17], 0.5, 1, 1, 3.0),
            (&[3, 5, 7], 0.25, 2, 0, 3.0),
            (&[2, 4, 64], 0.5, 3, 2, 3.0),
            (&[2, 4, 64], 0.0, 3, 0, 3.0),
            (&[4096], 0.9, (1 << 63) + 5, 3, 2.0),
            (&[33, 65], 0.05, 11, 0, 1000.0),
        ];
        cases
            .iter()
            .map(|&(shape, p, stream, micro_batch, step)| {
                Sample::new(Dropout { p, stream, micro_batch }, vec![normal(d, shape), scalar(DType::F32, step)])
            })
            .collect()
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![
            ("p", Attr::Float(self.p)),
            // Printed as the i64 of the same bits (attributes are i64).
            ("stream", Attr::Int(self.stream as i64)),
            ("micro_batch", Attr::Int(self.micro_batch as i64)),
        ]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "dropout").then(|| {
            let p = a.float("p")?;
            let stream = a.int("stream")? as u64;
            let mb = a.usize("micro_batch")?;
            let micro_batch =
                u32::try_from(mb).map_err(|_| Error::op("dropout", format!("micro_batch {mb} is too large")))?;
            Ok(Dropout { p, stream, micro_batch })
        })
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0)]
    }
}

impl Builder {
    /// Dropout of `x` with probability `p` under the mask stream `stream`
    /// (one per dropout site), `step` the train step's step count; `x`
    /// itself when `p` is 0.
    pub fn dropout(&mut self, x: ValueId, step: ValueId, p: f64, stream: u64) -> Result<ValueId> {
        if p == 0.0 {
            return Ok(x);
        }
        self.push1(Dropout { p, stream, micro_batch: 0 }.into(), &[x, step])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::HostTensor;
    use crate::testing::{draw_sample, run_op};

    #[test]
    fn splitmix_matches_its_published_outputs() {
        // The first outputs of SplitMix64 seeded with 0 (Vigna's reference
        // implementation): the state advances by γ before each output.
        assert_eq!(draw(0, 0) as u64, 0xe220_a839_7b1d_cdaf >> 32);
        assert_eq!(draw(0, 1) as u64, 0x6e78_9e6a_a1b9_65f4 >> 32);
        assert_eq!(mix64(0), 0);
    }

    #[test]
    fn the_threshold_spans_every_draw() {
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(0.5), 1 << 31);
        assert_eq!(threshold(0.25), 1 << 30);
        assert_eq!(threshold(1.0 - 1e-12), 1 << 32);
        // p = 0 keeps every draw, even 0.
        assert!(keep(1, 0, 1, 0, 0.0));
    }

    #[test]
    fn masks_keep_about_one_minus_p_and_differ_by_every_coordinate() {
        let n = 1 << 16;
        let mask = |stream, mb, step| (0..n).map(|i| keep(stream, mb, step, i, 0.3)).collect::<Vec<bool>>();
        let base = mask(5, 0, 1);
        let kept = base.iter().filter(|&&k| k).count() as f64 / n as f64;
        assert!((kept - 0.7).abs() < 0.01, "{kept}");
        for other in [mask(6, 0, 1), mask(5, 1, 1), mask(5, 0, 2)] {
            let same = base.iter().zip(&other).filter(|(a, b)| a == b).count() as f64 / n as f64;
            // Independent masks agree on 0.7² + 0.3² = 58% of elements.
            assert!((same - 0.58).abs() < 0.02, "{same}");
        }
    }

    #[test]
    fn dropout_scales_kept_elements_and_zeroes_the_rest() {
        let op = Dropout { p: 0.25, stream: 9, micro_batch: 1 };
        let xs: Vec<f64> = (0..1000).map(|i| i as f64 * 0.37 - 100.0).collect();
        let x = HostTensor::from_f64(TensorType::new(DType::F32, [1000]), &xs);
        let step = HostTensor::from_f64(TensorType::scalar(DType::F32), &[4.0]);
        let y = run_op(&op.clone().into(), &[x, step]).unwrap()[0].to_f64();
        let s = (1.0 / 0.75f64) as f32;
        let key = mask_key(9, 1, 4);
        for (i, (&a, &b)) in xs.iter().zip(&y).enumerate() {
            let want = if draw(key, i as u64) as u64 >= 1 << 30 { (a as f32 * s) as f64 } else { 0.0 };
            assert_eq!(b.to_bits(), want.to_bits(), "element {i}");
        }
    }

    #[test]
    fn zero_probability_is_a_copy_and_the_builder_emits_nothing() {
        for s in Dropout::samples(DType::BF16)
            .into_iter()
            .filter(|s| matches!(&s.op, crate::ops::Op::Dropout(d) if d.p == 0.0))
        {
            let x = draw_sample(&s, 1).unwrap();
            assert_eq!(run_op(&s.op, &x).unwrap()[0].bytes(), x[0].bytes());
        }
        let mut b = Builder::new("d");
        let x = b.input("x", TensorType::new(DType::F32, [4])).unwrap();
        let step = b.input("step", TensorType::scalar(DType::F32)).unwrap();
        assert_eq!(b.dropout(x, step, 0.0, 3).unwrap(), x);
        assert!(b.dropout(x, step, 1.0, 3).is_err());
        assert!(b.dropout(x, step, -0.1, 3).is_err());
        assert!(b.dropout(x, step, f64::NAN, 3).is_err());
    }

    #[test]
    fn every_sample_keeps_an_element_and_the_larger_ones_drop_one() {
        // The finite-difference check needs a kept element in every sample.
        for s in Dropout::samples(DType::F64) {
            let x = draw_sample(&s, 0).unwrap();
            let y = run_op(&s.op, &x).unwrap()[0].to_f64();
            assert!(y.iter().any(|&v| v != 0.0), "{:?}", s.op);
            let p = match &s.op {
                crate::ops::Op::Dropout(d) => d.p,
                _ => unreachable!(),
            };
            if p > 0.0 && y.len() > 16 {
                assert!(y.contains(&0.0), "{:?}", s.op);
            }
        }
    }

    #[test]
    fn the_op_prints_and_parses_back() {
        let mut b = Builder::new("d");
        let x = b.input("x", TensorType::new(DType::BF16, [2, 8])).unwrap();
        let step = b.input("step", TensorType::scalar(DType::F32)).unwrap();
        let y = b.push1(Dropout { p: 0.1, stream: u64::MAX - 2, micro_batch: 4 }.into(), &[x, step]).unwrap();
        b.output(crate::ir::OutputKind::Named("y".into()), y);
        let t = b.finish("build").unwrap();
        let text = t.to_string();
        assert!(text.contains("dropout ") && text.contains("micro_batch=4"), "{text}");
        assert_eq!(crate::ir::parse::parse(&text).unwrap(), t);
    }
}
