//! FP8 matrix products (`--fp8 products`): the two 8-bit float formats, the
//! per-tensor scale of an operand, its quantization, and the product of
//! two quantized operands. `passes::fp8` makes these from the products
//! the model marked ([`crate::ops::matmul::MatMul::fp8`]) after autodiff,
//! so none of them has a VJP.
//!
//! # The formats
//!
//! [`Fp8Format::E4M3`] (4 exponent bits, bias 7, 3 fraction bits; largest
//! finite 448, no infinities, `S.1111.111` is NaN) holds activations and
//! weights; [`Fp8Format::E5M2`] (5 exponent bits, bias 15, 2 fraction bits;
//! largest finite 57344, IEEE-like infinities and NaNs) holds gradients,
//! whose range is wider and precision matters less (the OCP 8-bit float
//! specification; NVIDIA's Hopper tensor cores multiply both). Both have
//! subnormals. [`Fp8Format::encode`] rounds an f32 to the nearest code,
//! ties to the even code, and saturates: a finite value beyond the largest
//! finite (after rounding) and an infinity become the largest finite of
//! their sign, NaN becomes the NaN code `0x7f`. That is PTX's
//! `cvt.rn.satfinite` (CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE,
//! ...)`), so the CUDA kernels store the same bytes.
//!
//! # Current scaling
//!
//! Each operand gets its own scale from its own values in the same step
//! ([`Fp8Scale`]): `amax = max |x|` over the whole tensor (f32), and
//! `scale = fmax / amax` (one f32 division; capped at 2^100 so that a tiny
//! amax gives a finite scale; 1 where amax is 0; NaN where amax is not
//! finite, so that a step whose values already overflowed ends in a NaN
//! loss rather than in quietly clamped products). Its output is
//! `[1 / scale, scale]` (f32, the inverse one f32 division; first, where
//! the tensor starts, because cuBLASLt reads the products' scales only
//! from aligned addresses). The largest
//! element maps to the format's largest finite, so nothing saturates.
//! [`Fp8Quantize`] stores `encode(x · scale)` (one f32 multiply, then the
//! rounding above).
//!
//! # Codes
//!
//! A quantized operand is a 2-D matrix of codes packed 4 per i32 word:
//! element `4w + j` of a row sits in byte `j` (bits `8j .. 8j + 7`) of word
//! `w`, so the words' bytes in memory are the codes in row order, as
//! cuBLASLt reads an FP8 matrix. [`Fp8Quantize`] writes `x` viewed as
//! `[rows, cols]` (its last axis the columns) either as it is, `[rows,
//! cols / 4]` words, or transposed, `[cols, rows / 4]`: Hopper's FP8
//! products read both operands with the contracted axis contiguous, so the
//! backward products read transposed copies.
//!
//! # The product
//!
//! [`MatMulFp8`] is `c[m, n] = (Σ_k a[m, k] · b[n, k]) · sa⁻¹ · sb⁻¹ (+ r)`
//! for codes `a: [m, k / 4]`, `b: [n, k / 4]` and their scales: both
//! operands k-contiguous (cuBLASLt's only FP8 layout). Each product of two
//! codes is exact in f32; the sum is f32 in the CPU's order (a tensor core
//! sums in its own order, so backends agree to f32 rounding, not bit for
//! bit); then the two inverse scales, the addend (the output's type or a
//! row, as [`crate::ops::matmul::MatMul`]'s), and one rounding to the
//! output type.

use rayon::prelude::*;

use super::sample::{fixed, normal, Sample};
use super::{expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::gemm::{gemm_f32, GemmDesc};
use crate::ops::kernel::{Float, KernelIo};
use crate::ops::matmul::{add_addend, MatMul};

/// Codes per i32 word.
pub const FP8_CODES_PER_WORD: usize = 4;

/// The largest scale [`Fp8Scale`] gives (2^100): what a tiny amax gets.
pub const FP8_MAX_SCALE: f32 = 1.2676506e30;

/// One of the two 8-bit float formats (see the module doc).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, serde::Serialize)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 fraction bits: activations and weights.
    E4M3,
    /// 5 exponent bits, 2 fraction bits: gradients.
    E5M2,
}

impl Fp8Format {
    /// Exponent bits: how the format is printed in a trace (`fp8=[4,5]`).
    pub fn exponent_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 4,
            Fp8Format::E5M2 => 5,
        }
    }

    /// The format with `bits` exponent bits.
    pub fn from_exponent_bits(bits: i64) -> Option<Self> {
        match bits {
            4 => Some(Fp8Format::E4M3),
            5 => Some(Fp8Format::E5M2),
            _ => None,
        }
    }

    /// The kernels' and profiles' name: `e4m3` or `e5m2`.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    fn fraction_bits(self) -> u32 {
        8 - 1 - self.exponent_bits()
    }

    fn bias(self) -> i32 {
        (1 << (self.exponent_bits() - 1)) - 1
    }

    /// The largest finite value: 448 or 57344.
    pub fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// The code of `x`: nearest, ties to even, saturating (module doc).
    pub fn encode(self, x: f32) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let max = self.max_finite();
        let mag = x.abs().min(f32::MAX) as f64;
        let (fb, bias) = (self.fraction_bits() as i32, self.bias());
        // The spacing of the grid around `mag`: that of its binade, or of
        // the subnormals below the smallest normal binade.
        let exp = if mag == 0.0 { 1 - bias } else { binade(mag).max(1 - bias) };
        let step = 2f64.powi(exp - fb);
        // Exact: dividing by a power of two, in f64.
        let rounded = ((mag / step).round_ties_even() * step).min(max as f64);
        sign | self.magnitude_code(rounded)
    }

    /// The code of a non-negative grid value `v` (at most the largest finite).
    fn magnitude_code(self, v: f64) -> u8 {
        let (fb, bias) = (self.fraction_bits() as i32, self.bias());
        let min_normal = 2f64.powi(1 - bias);
        if v < min_normal {
            // Subnormal: the fraction counts steps of 2^(1 − bias − fb).
            return (v / 2f64.powi(1 - bias - fb)) as u8;
        }
        let exp = binade(v);
        let fraction = (v / 2f64.powi(exp - fb)) as u32 - (1 << fb);
        (((exp + bias) as u32) << fb | fraction) as u8
    }

    /// The value of `code` (exact in f32).
    pub fn decode(self, code: u8) -> f32 {
        let negative = code & 0x80 != 0;
        let (fb, bias) = (self.fraction_bits(), self.bias());
        let exp = ((code & 0x7f) >> fb) as i32;
        let fraction = (code & ((1 << fb) - 1)) as i32;
        let top = (1 << self.exponent_bits()) - 1;
        let magnitude = match self {
            Fp8Format::E4M3 if exp == top && fraction == (1 << fb) - 1 => f32::NAN,
            Fp8Format::E5M2 if exp == top && fraction == 0 => f32::INFINITY,
            Fp8Format::E5M2 if exp == top => f32::NAN,
            _ if exp == 0 => fraction as f32 * 2f32.powi(1 - bias - fb as i32),
            _ => (1.0 + fraction as f32 / (1 << fb) as f32) * 2f32.powi(exp - bias),
        };
        if negative {
            -magnitude
        } else {
            magnitude
        }
    }
}

/// `e` with `2^e <= v < 2^(e + 1)`, exactly, for a positive normal `v`
/// (every nonzero f32 is one as an f64): its biased exponent bits.
fn binade(v: f64) -> i32 {
    ((v.to_bits() >> 52) & 0x7ff) as i32 - 1023
}

/// `[1 / scale, scale]` of an amax for `format` (module doc).
pub fn fp8_scale_of(format: Fp8Format, amax: f32) -> [f32; 2] {
    let scale = if !amax.is_finite() {
        f32::NAN
    } else if amax == 0.0 {
        1.0
    } else {
        (format.max_finite() / amax).min(FP8_MAX_SCALE)
    };
    [1.0 / scale, scale]
}

/// The code of `x · scale` (one f32 multiply, then [`Fp8Format::encode`]).
pub fn fp8_quantize_one(format: Fp8Format, x: f32, scale: f32) -> u8 {
    format.encode(x * scale)
}

/// Whether the FP8 ops take (and write) tensors of `d`: f64 has no FP8 product.
fn fp8_dtype_ok(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

fn expect_fp8_input(t: &TensorType, what: &str) -> std::result::Result<(), String> {
    if !fp8_dtype_ok(t.dtype) {
        return Err(format!("{what} must be f32, bf16 or f16, not {}", t.dtype));
    }
    Ok(())
}

fn expect_scale(t: &TensorType, what: &str) -> std::result::Result<(), String> {
    if t.dtype != DType::F32 || t.shape != [2] {
        return Err(format!("{what} must be f32 [2] (the inverse scale, then the scale), not {t}"));
    }
    Ok(())
}

/// The attribute list of a format.
fn format_attr(format: Fp8Format) -> (&'static str, Attr) {
    ("format", Attr::Int(format.exponent_bits() as i64))
}

fn parse_format(a: &mut Attrs, key: &str) -> Result<Fp8Format> {
    let bits = a.int(key)?;
    Fp8Format::from_exponent_bits(bits)
        .ok_or_else(|| Error::op(&a.op, format!("`{key}` must be 4 (e4m3) or 5 (e5m2), got {bits}")))
}

/// `x` viewed as `[rows, cols]`: its last axis the columns (a scalar is 1 × 1).
pub fn fp8_rows_cols(shape: &[usize]) -> (usize, usize) {
    let cols = shape.last().copied().unwrap_or(1);
    (shape.iter().product::<usize>() / cols.max(1), cols)
}

// ---------------------------------------------------------------- fp8_scale

/// `[1 / scale, scale]` (f32 `[2]`) of a tensor for `format`: current
/// scaling from its own amax (module doc).
#[derive(Clone, PartialEq, Debug)]
pub struct Fp8Scale {
    pub format: Fp8Format,
}

impl OpDef for Fp8Scale {
    /// f32, bf16 and f16 only (f64 has no FP8 product): odd sizes, a
    /// scalar, a tensor of zeros and one of a product operand's size.
    fn samples(d: DType) -> Vec<Sample> {
        if !fp8_dtype_ok(d) {
            return Vec::new();
        }
        let mut v = Vec::new();
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for s in [&[][..], &[7], &[3, 5], &[64, 100]] {
                v.push(Sample::new(Fp8Scale { format }, vec![normal(d, s)]));
            }
            v.push(Sample::new(Fp8Scale { format }, vec![fixed(d, &[4], &[0.0; 4])]));
            v.push(Sample::new(Fp8Scale { format }, vec![normal(d, &[512, 384])]).large());
        }
        v
    }
    fn name(&self) -> &'static str {
        "fp8_scale"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        expect_fp8_input(inputs[0], "the scaled tensor")?;
        Ok(vec![TensorType::new(DType::F32, [2])])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        fn amax<T: Float<Acc = f32>>(x: &[T]) -> f32 {
            // NaN wins, as the kernel's integer max of |x|'s bits lets it.
            x.par_iter()
                .map(|v| v.acc().abs())
                .reduce(|| 0.0, |a, b| if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) })
        }
        let a = match io.in_ty(0).dtype {
            DType::F32 => amax(io.input::<f32>(0)),
            DType::BF16 => amax(io.input::<half::bf16>(0)),
            DType::F16 => amax(io.input::<half::f16>(0)),
            d => return Err(Error::op("fp8_scale", format!("no CPU kernel for {d}"))),
        };
        io.output::<f32>(0).copy_from_slice(&fp8_scale_of(self.format, a));
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![format_attr(self.format)]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "fp8_scale").then(|| Ok(Fp8Scale { format: parse_format(a, "format")? }))
    }
}

// ---------------------------------------------------------------- fp8_quantize

/// The codes of `x · scale` (inputs `x` and an [`Fp8Scale`] output), packed
/// 4 per i32 word: `[rows, cols / 4]`, or of `xᵀ`, `[cols, rows / 4]`,
/// with `transpose` (module doc). With `with_plain` (transposed only) a
/// second output holds the plain codes too: one pass over `x` for a value
/// that two products read in both layouts (a gradient, in `g·W` and `gᵀ·x`).
#[derive(Clone, PartialEq, Debug)]
pub struct Fp8Quantize {
    pub format: Fp8Format,
    pub transpose: bool,
    pub with_plain: bool,
}

impl OpDef for Fp8Quantize {
    /// f32, bf16 and f16 only: both formats, plain and transposed, small
    /// and odd row counts, and a product operand's size.
    fn samples(d: DType) -> Vec<Sample> {
        if !fp8_dtype_ok(d) {
            return Vec::new();
        }
        let mut v = Vec::new();
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for (transpose, with_plain) in [(false, false), (true, false), (true, true)] {
                let op = Fp8Quantize { format, transpose, with_plain };
                // Shapes for the kernels' paths: 16-byte rows or not, a partial tile of
                // rows that are (48) or are not (40, 68) a multiple of 16.
                for s in [&[4, 8][..], &[2, 12, 20], &[68, 132], &[72, 36], &[40, 72], &[48, 136]] {
                    let x = normal(d, s);
                    v.push(Sample::new(op.clone(), vec![x.clone()]).with_output(Fp8Scale { format }, vec![x], 0));
                }
                // A scale that saturates some elements and flushes others to subnormals.
                v.push(Sample::new(
                    op.clone(),
                    vec![normal(d, &[8, 16]), fixed(DType::F32, &[2], &[1.0 / 300.0, 300.0])],
                ));
                v.push(Sample::new(op.clone(), vec![normal(d, &[8, 16]), fixed(DType::F32, &[2], &[1e3, 1e-3])]));
                let x = normal(d, &[256, 320]);
                v.push(Sample::new(op, vec![x.clone()]).with_output(Fp8Scale { format }, vec![x], 0).large());
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "fp8_quantize"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        expect_fp8_input(inputs[0], "the quantized tensor")?;
        expect_scale(inputs[1], "the scale")?;
        if inputs[0].shape.is_empty() {
            return Err("quantizes a matrix (at least one axis), not a scalar".into());
        }
        if self.with_plain && !self.transpose {
            return Err("writes the plain codes beside the transposed ones: `with_plain` needs `transpose`".into());
        }
        let (rows, cols) = fp8_rows_cols(&inputs[0].shape);
        let codes = |transpose: bool| {
            let (out_rows, along) = if transpose { (cols, rows) } else { (rows, cols) };
            if along % FP8_CODES_PER_WORD != 0 {
                let what = if transpose { "rows" } else { "columns" };
                return Err(format!("packs 4 codes per word along the {what}, and {along} is not a multiple of 4"));
            }
            Ok(TensorType::new(DType::I32, [out_rows, along / FP8_CODES_PER_WORD]))
        };
        let mut out = vec![codes(self.transpose)?];
        if self.with_plain {
            out.push(codes(false)?);
        }
        Ok(out)
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let scale = io.input::<f32>(1)[1];
        let (rows, cols) = fp8_rows_cols(&io.in_ty(0).shape);
        let x: Vec<f32> = match io.in_ty(0).dtype {
            DType::F32 => io.input::<f32>(0).to_vec(),
            DType::BF16 => io.input::<half::bf16>(0).iter().map(|v| v.to_f32()).collect(),
            DType::F16 => io.input::<half::f16>(0).iter().map(|v| v.to_f32()).collect(),
            d => return Err(Error::op("fp8_quantize", format!("no CPU kernel for {d}"))),
        };
        let format = self.format;
        let layouts = if self.with_plain { &[true, false][..] } else { std::slice::from_ref(&self.transpose) };
        for (i, &transpose) in layouts.iter().enumerate() {
            // Output row `r`, element `e` of it: x[r][e], or x[e][r] transposed.
            let at = |r: usize, e: usize| if transpose { x[e * cols + r] } else { x[r * cols + e] };
            let per_row = if transpose { rows } else { cols } / FP8_CODES_PER_WORD;
            io.output::<i32>(i).par_chunks_mut(per_row.max(1)).enumerate().for_each(|(r, words)| {
                for (w, word) in words.iter_mut().enumerate() {
                    let mut bytes = [0u8; FP8_CODES_PER_WORD];
                    for (j, b) in bytes.iter_mut().enumerate() {
                        *b = fp8_quantize_one(format, at(r, w * FP8_CODES_PER_WORD + j), scale);
                    }
                    *word = i32::from_le_bytes(bytes);
                }
            });
        }
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut v = vec![format_attr(self.format)];
        v.extend(Attr::flag("transpose", self.transpose));
        v.extend(Attr::flag("with_plain", self.with_plain));
        v
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "fp8_quantize").then(|| {
            Ok(Fp8Quantize {
                format: parse_format(a, "format")?,
                transpose: a.opt_bool("transpose")?.unwrap_or(false),
                with_plain: a.opt_bool("with_plain")?.unwrap_or(false),
            })
        })
    }
}

// ---------------------------------------------------------------- matmul_fp8

/// `c[m, n] = a · bᵀ · sa⁻¹ · sb⁻¹ (+ r)` of two quantized operands (inputs
/// `a` codes `[m, k / 4]`, `b` codes `[n, k / 4]`, their [`Fp8Scale`]
/// outputs, and with `addend` a tensor `[m, n]` or a row `[n]` of the
/// output's type), rounded once to `out` (module doc).
#[derive(Clone, PartialEq, Debug)]
pub struct MatMulFp8 {
    pub a: Fp8Format,
    pub b: Fp8Format,
    pub out: DType,
    pub addend: bool,
}

impl OpDef for MatMulFp8 {
    /// f32, bf16 and f16 outputs: the three format pairs Hopper multiplies,
    /// odd row counts, both addends and a product of W5's depth.
    fn samples(d: DType) -> Vec<Sample> {
        if !fp8_dtype_ok(d) {
            return Vec::new();
        }
        use Fp8Format::{E4M3, E5M2};
        // Codes of a standard normal operand at a scale that uses the range.
        let codes = |format: Fp8Format, rows: usize, k: usize| {
            let scale = format.max_finite() / 8.0;
            super::sample::output_of(
                Fp8Quantize { format, transpose: false, with_plain: false },
                vec![normal(DType::F32, &[rows, k]), fixed(DType::F32, &[2], &[1.0 / scale as f64, scale as f64])],
                0,
            )
        };
        let scale = |s: f64| fixed(DType::F32, &[2], &[1.0 / s, s]);
        let mut v = Vec::new();
        for (fa, fb) in [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)] {
            for (m, n, k) in [(16, 16, 32), (5, 24, 48), (33, 16, 64)] {
                let op = MatMulFp8 { a: fa, b: fb, out: d, addend: false };
                let ins = vec![codes(fa, m, k), codes(fb, n, k), scale(fa.max_finite() as f64 / 8.0), scale(2.0)];
                v.push(Sample::new(op.clone(), ins.clone()));
                let added = MatMulFp8 { addend: true, ..op };
                v.push(Sample::new(added.clone(), ins.clone()).with(normal(d, &[m, n])));
                v.push(Sample::new(added, ins).with(normal(d, &[n])));
            }
        }
        let op = MatMulFp8 { a: E4M3, b: E4M3, out: d, addend: false };
        let ins = vec![codes(E4M3, 128, 3200), codes(E4M3, 96, 3200), scale(56.0), scale(56.0)];
        v.push(Sample::new(op, ins).large());
        v
    }
    fn name(&self) -> &'static str {
        "matmul_fp8"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, if self.addend { 5 } else { 4 })?;
        if !fp8_dtype_ok(self.out) {
            return Err(format!("writes f32, bf16 or f16, not {}", self.out));
        }
        if (self.a, self.b) == (Fp8Format::E5M2, Fp8Format::E5M2) {
            return Err("multiplies e5m2 by e4m3 at most once: two e5m2 operands have no tensor-core product".into());
        }
        let (a, b) = (inputs[0], inputs[1]);
        for (t, what) in [(a, "a"), (b, "b")] {
            if t.dtype != DType::I32 || t.shape.len() != 2 {
                return Err(format!("`{what}` must be packed codes, i32 [rows, k / 4], not {t}"));
            }
        }
        if a.shape[1] != b.shape[1] {
            return Err(format!("the operands' depths differ: {a} and {b}"));
        }
        expect_scale(inputs[2], "a's scale")?;
        expect_scale(inputs[3], "b's scale")?;
        let out = TensorType::new(self.out, [a.shape[0], b.shape[0]]);
        if self.addend && MatMul::addend_kind(&out, inputs[4]).is_none() {
            return Err(format!(
                "the addend {} is neither the product's type {out} nor a row of {}",
                inputs[4], b.shape[0]
            ));
        }
        Ok(vec![out])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let (m, n) = (io.in_ty(0).shape[0], io.in_ty(1).shape[0]);
        let k = io.in_ty(0).shape[1] * FP8_CODES_PER_WORD;
        let decode = |format: Fp8Format, words: &[i32]| -> Vec<f32> {
            words.par_iter().flat_map_iter(|w| w.to_le_bytes().map(|c| format.decode(c))).collect()
        };
        let (a, b) = (decode(self.a, io.input::<i32>(0)), decode(self.b, io.input::<i32>(1)));
        let mut wide = vec![0f32; m * n];
        let desc = GemmDesc { batch: 1, m, n, k, trans_a: false, trans_b: true, broadcast_b: false };
        gemm_f32(&desc, &a, &b, &mut wide);
        let unscale = io.input::<f32>(2)[0] * io.input::<f32>(3)[0];
        wide.par_iter_mut().for_each(|w| *w *= unscale);
        match self.out {
            DType::F32 => self.store::<f32>(io, &wide),
            DType::BF16 => self.store::<half::bf16>(io, &wide),
            DType::F16 => self.store::<half::f16>(io, &wide),
            d => return Err(Error::op("matmul_fp8", format!("no CPU kernel for {d} outputs"))),
        }
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut v = vec![
            ("a", Attr::Int(self.a.exponent_bits() as i64)),
            ("b", Attr::Int(self.b.exponent_bits() as i64)),
            ("out", Attr::DType(self.out)),
        ];
        v.extend(Attr::flag("addend", self.addend));
        v
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "matmul_fp8").then(|| {
            Ok(MatMulFp8 {
                a: parse_format(a, "a")?,
                b: parse_format(a, "b")?,
                out: a.dtype("out")?,
                addend: a.opt_bool("addend")?.unwrap_or(false),
            })
        })
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        // As `matmul`'s: cuBLASLt reads C before it writes D, element by element.
        if self.addend {
            vec![(0, 4)]
        } else {
            Vec::new()
        }
    }
    fn reads_16_byte_aligned_inputs(&self) -> bool {
        // cuBLASLt's FP8 products take 16-byte aligned operands only.
        true
    }
}

impl MatMulFp8 {
    /// Output 0 as the unrounded `wide` plus the addend (input 4), rounded once.
    fn store<T: Float<Acc = f32>>(&self, io: &KernelIo, wide: &[f32]) {
        if self.addend {
            add_addend::<T>(io, wide, 4);
        } else {
            io.output::<T>(0).par_iter_mut().zip(wide).for_each(|(o, &w)| *o = T::from_acc(w));
        }
    }
}

impl Builder {
    /// `[1 / scale, scale]` of `x` for `format` ([`Fp8Scale`]).
    pub fn fp8_scale(&mut self, x: ValueId, format: Fp8Format) -> Result<ValueId> {
        self.push1(Fp8Scale { format }.into(), &[x])
    }

    /// The packed codes of `x · scale`, or of its transpose ([`Fp8Quantize`]).
    pub fn fp8_quantize(&mut self, x: ValueId, scale: ValueId, format: Fp8Format, transpose: bool) -> Result<ValueId> {
        self.push1(Fp8Quantize { format, transpose, with_plain: false }.into(), &[x, scale])
    }

    /// The packed codes of `xᵀ · scale` and of `x · scale`, in one pass
    /// ([`Fp8Quantize::with_plain`]): `(transposed, plain)`.
    pub fn fp8_quantize_both(&mut self, x: ValueId, scale: ValueId, format: Fp8Format) -> Result<(ValueId, ValueId)> {
        let out = self.push(Fp8Quantize { format, transpose: true, with_plain: true }.into(), &[x, scale])?;
        Ok((out[0], out[1]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code's value, found by brute force: the reference `encode` must meet.
    fn nearest_by_search(format: Fp8Format, x: f32) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let max = format.max_finite();
        let x = x.clamp(-max, max);
        let finite: Vec<u8> = (0..=255u8).filter(|&c| format.decode(c).is_finite()).collect();
        let mut best = finite[0];
        for &c in &finite {
            let (d, db) = ((format.decode(c) as f64 - x as f64).abs(), (format.decode(best) as f64 - x as f64).abs());
            // Ties go to the even code (its lowest fraction bit clear); the
            // two zeros tie only with each other: keep x's sign.
            let even = c & 1 == 0 && best & 1 == 1;
            if d < db
                || (d == db && even)
                || (d == db && format.decode(c) == 0.0 && (c & 0x80 != 0) == x.is_sign_negative())
            {
                best = c;
            }
        }
        best
    }

    #[test]
    fn both_layouts_at_once_are_the_two_quantizations() {
        use crate::host::HostTensor;
        use crate::ir::TensorType;
        use crate::testing::run_op;
        let values: Vec<f64> = (0..24 * 20).map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0).collect();
        let x = HostTensor::from_f64(TensorType::new(DType::BF16, [2, 12, 20]), &values);
        let scale = HostTensor::from_f64(TensorType::new(DType::F32, [2]), &[1.0 / 40.0, 40.0]);
        let run = |transpose, with_plain| {
            run_op(&Fp8Quantize { format: Fp8Format::E5M2, transpose, with_plain }.into(), &[x.clone(), scale.clone()])
                .unwrap()
        };
        let both = run(true, true);
        assert_eq!(both.len(), 2);
        assert_eq!((&both[0].ty.shape[..], &both[1].ty.shape[..]), (&[20, 6][..], &[24, 5][..]));
        assert_eq!(both[0], run(true, false)[0], "the transposed codes");
        assert_eq!(both[1], run(false, false)[0], "the plain codes");
        let ty = TensorType::new(DType::BF16, [8, 8]);
        let e = crate::ops::Op::from(Fp8Quantize { format: Fp8Format::E4M3, transpose: false, with_plain: true })
            .infer(&[&ty, &TensorType::new(DType::F32, [2])])
            .unwrap_err();
        assert!(e.contains("needs `transpose`"), "{e}");
    }

    #[test]
    fn every_finite_code_decodes_and_encodes_back() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let mut finite = 0;
            for c in 0..=255u8 {
                let v = format.decode(c);
                if v.is_finite() {
                    assert_eq!(format.encode(v), c, "{format:?} code {c:#04x} = {v}");
                    finite += 1;
                }
            }
            // E4M3: 256 − 2 NaNs; E5M2: 256 − 2 infinities − 6 NaNs.
            assert_eq!(finite, if format == Fp8Format::E4M3 { 254 } else { 248 });
            assert_eq!(format.decode(format.encode(format.max_finite())), format.max_finite());
        }
        assert_eq!(Fp8Format::E4M3.decode(0x01), 2f32.powi(-9));
        assert_eq!(Fp8Format::E5M2.decode(0x01), 2f32.powi(-16));
        assert_eq!(Fp8Format::E4M3.decode(0x7e), 448.0);
        assert_eq!(Fp8Format::E5M2.decode(0x7b), 57344.0);
        assert!(Fp8Format::E4M3.decode(0x7f).is_nan() && Fp8Format::E5M2.decode(0x7c).is_infinite());
    }

    #[test]
    fn encoding_rounds_to_nearest_ties_to_even_and_saturates() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            // Midpoints between neighbouring codes, and points just off them.
            for c in 0..0x7eu8 {
                let (lo, hi) = (format.decode(c), format.decode(c + 1));
                if !hi.is_finite() {
                    continue;
                }
                let mid = (lo + hi) / 2.0;
                for x in [mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits().max(1) - 1), -mid] {
                    assert_eq!(format.encode(x), nearest_by_search(format, x), "{format:?} {x:e} near {c:#04x}");
                }
            }
            // A spread of magnitudes, random-ish bits, beyond the range and special values.
            let mut bits = 0x1234_5678u32;
            for _ in 0..20_000 {
                bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let x = f32::from_bits(bits);
                let x = if x.is_finite() { x } else { 1.0 };
                let x = x.signum() * (x.abs().log2().rem_euclid(40.0) - 24.0).exp2();
                assert_eq!(format.encode(x), nearest_by_search(format, x), "{format:?} {x:e}");
            }
            let max = format.max_finite();
            assert_eq!(format.decode(format.encode(f32::INFINITY)), max);
            assert_eq!(format.decode(format.encode(-1e30)), -max);
            assert_eq!(format.encode(f32::NAN), 0x7f);
            assert_eq!(format.encode(-0.0), 0x80);
            assert_eq!(format.encode(1e-30), 0);
        }
    }

    #[test]
    fn a_nan_anywhere_makes_the_scale_nan() {
        use crate::host::HostTensor;
        use crate::ir::TensorType;
        for at in [0, 5, 9] {
            let mut v = vec![1.0; 10];
            v[at] = f64::NAN;
            let x = HostTensor::from_f64(TensorType::new(DType::F32, [10]), &v);
            let out = crate::testing::run_op(&Fp8Scale { format: Fp8Format::E4M3 }.into(), &[x]).unwrap();
            assert!(out[0].to_f64().iter().all(|s| s.is_nan()), "NaN at {at}: {:?}", out[0].to_f64());
        }
    }

    #[test]
    fn scales_map_the_amax_to_the_largest_finite() {
        let [inv, s] = fp8_scale_of(Fp8Format::E4M3, 3.5);
        assert_eq!((s, inv), (128.0, 1.0 / 128.0));
        assert_eq!(Fp8Format::E4M3.decode(fp8_quantize_one(Fp8Format::E4M3, -3.5, s)), -448.0);
        assert_eq!(fp8_scale_of(Fp8Format::E5M2, 0.0), [1.0, 1.0]);
        assert_eq!(fp8_scale_of(Fp8Format::E4M3, 1e-38)[1], FP8_MAX_SCALE);
        let [inv, s] = fp8_scale_of(Fp8Format::E4M3, f32::INFINITY);
        assert!(s.is_nan() && inv.is_nan());
        assert!(fp8_scale_of(Fp8Format::E4M3, f32::NAN)[0].is_nan());
    }
}
