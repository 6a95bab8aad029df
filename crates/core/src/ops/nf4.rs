//! 4-bit NormalFloat (NF4) weights, the frozen base weights of QLoRA
//! fine-tuning (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized
//! LLMs", 2023, section 3): the storage format, defined by its CPU
//! reference ([`quantize_nf4`], [`dequantize_nf4`]), and the op that turns
//! the packed leaves back into a float weight inside a step
//! ([`DequantizeNf4`], [`Builder::dequantize_nf4`]).
//!
//! # The format
//!
//! A weight of `numel` elements (a multiple of [`NF4_BLOCK`]; nothing is
//! padded) is read in row-major order and cut into blocks of 64 consecutive
//! elements. Block `b` keeps `absmax_b = max |w|` over its elements (f32).
//! Element `w` of block `b` becomes the 4-bit code `k` of the level
//! [`NF4_LEVELS`]`[k]` nearest to `w / absmax_b` (the quotient rounded to
//! f32, each distance `|w / absmax_b − level|` evaluated in f32, the lowest
//! code on a tie); a block whose absmax is 0 gets the code of 0.0 (7)
//! everywhere. Codes are packed 8 per i32 word: element `8k + j` sits in bits
//! `4j .. 4j + 3` of word `k` (two's complement, so a code of 8 or more in
//! the top nibble makes the word negative).
//!
//! The absmax values are kept either as they are (f32, one per block) or,
//! with double quantization, themselves quantized to 8 bits:
//! - `mean` is their mean: the sum in f64 in block order, divided by the
//!   number of blocks in f64, rounded to f32 (0 for a weight of no block);
//! - per group `g` of [`NF4_SCALE_BLOCK`] consecutive blocks (the last group
//!   may be shorter), `scale_g = max |absmax_b − mean|` in f32;
//! - each block gets `q_b = round((absmax_b − mean) / scale_g · 127)` (f32
//!   arithmetic in that order, halves away from zero, clamped to
//!   `[−127, 127]`; `q_b = 0` where `scale_g` is 0), an i8 packed 4 per i32
//!   word, block `4k + j` in byte `j` (bits `8j .. 8j + 7`) of word `k`, the
//!   unused bytes of the last word zero;
//! - the absmax a block is dequantized with is then
//!   `(q_b as f32 / 127.0) · scale_g + mean`, three f32 operations each
//!   rounded (never fused into a multiply-add).
//!
//! The element's value is `NF4_LEVELS[code] · absmax_b`: one f32 multiply,
//! then one rounding to the output dtype (exact for f32 and f64). The CUDA
//! kernel does the same operations with the same roundings, so both give
//! the same bits.
//!
//! # Leaves
//!
//! A quantized weight is stored as frozen leaves named
//! `{weight}.{suffix}` ([`Nf4Weight::leaf_types`], [`Nf4Weight::leaves`]),
//! in the op's input order: `nf4_codes` (i32 `[numel / 8]`) and
//! `nf4_absmax` (f32 `[blocks]`); or, with double quantization,
//! `nf4_codes`, `nf4_absmax_codes` (i32 `[⌈blocks / 4⌉]`) and
//! `nf4_absmax_scales` (f32 `[groups + 1]`: the scales, then the mean).
//!
//! The op is a pointwise read of half a byte per element and a write of the
//! output dtype: the recompute pass recomputes it in backward rather than
//! keep the float weight across the step. No gradient flows into the codes
//! or scales of a frozen weight.

use rayon::prelude::*;

use super::sample::fixed;
use super::{expect_inputs, Attr, Attrs, OpDef, Sample, VjpArgs};
use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{Float, KernelIo};
use crate::with_float;

/// The 16 NormalFloat4 levels (the QLoRA paper's NF4 data type: quantiles
/// of a standard normal scaled to [−1, 1], with an exact 0), ascending.
/// Written with the digits they are published with; each is the f32
/// nearest to its decimal.
#[allow(clippy::excessive_precision)]
pub const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// Elements per absmax block.
pub const NF4_BLOCK: usize = 64;
/// Absmax values per scale of double quantization.
pub const NF4_SCALE_BLOCK: usize = 256;
/// 4-bit codes per i32 word.
pub const NF4_CODES_PER_WORD: usize = 8;
/// 8-bit absmax codes per i32 word (double quantization).
pub const NF4_SCALE_CODES_PER_WORD: usize = 4;

/// The code of the level 0.0, which every element of an all-zero block gets.
const ZERO_CODE: u8 = 7;

/// Leaf name suffixes, in the op's input order.
pub const CODES_SUFFIX: &str = "nf4_codes";
pub const ABSMAX_SUFFIX: &str = "nf4_absmax";
pub const ABSMAX_CODES_SUFFIX: &str = "nf4_absmax_codes";
pub const ABSMAX_SCALES_SUFFIX: &str = "nf4_absmax_scales";

/// How a quantized weight keeps its per-block absmax values.
#[derive(Clone, PartialEq, Debug)]
pub enum Nf4Absmax {
    /// One f32 per block.
    Plain(Vec<f32>),
    /// Double quantization: one i8 per block packed 4 per word, one f32
    /// scale per group of [`NF4_SCALE_BLOCK`] blocks, and the mean.
    Double { codes: Vec<i32>, scales: Vec<f32>, mean: f32 },
}

/// A weight in the NF4 format of the module doc.
#[derive(Clone, PartialEq, Debug)]
pub struct Nf4Weight {
    /// 4-bit codes, 8 per word.
    pub codes: Vec<i32>,
    pub absmax: Nf4Absmax,
}

/// The absmax values of a weight as a kernel reads them from its leaves.
#[derive(Copy, Clone)]
enum Scales<'a> {
    Plain(&'a [f32]),
    Double { codes: &'a [i32], scales: &'a [f32], mean: f32 },
}

impl Scales<'_> {
    /// The absmax block `b` is dequantized with.
    fn absmax(self, b: usize) -> f32 {
        match self {
            Scales::Plain(a) => a[b],
            Scales::Double { codes, scales, mean } => {
                dequantize_absmax(scale_code(codes, b), scales[b / NF4_SCALE_BLOCK], mean)
            }
        }
    }
}

/// `(q / 127) · scale + mean` in f32, each operation rounded (Rust never
/// contracts these into a fused multiply-add; the CUDA kernel uses the
/// `_rn` intrinsics for the same reason).
fn dequantize_absmax(q: i8, scale: f32, mean: f32) -> f32 {
    (q as f32 / 127.0) * scale + mean
}

/// The i8 absmax code of block `b`.
fn scale_code(words: &[i32], b: usize) -> i8 {
    ((words[b / NF4_SCALE_CODES_PER_WORD] as u32) >> (8 * (b % NF4_SCALE_CODES_PER_WORD))) as u8 as i8
}

/// The 4-bit code of element `i`.
fn code(words: &[i32], i: usize) -> usize {
    (((words[i / NF4_CODES_PER_WORD] as u32) >> (4 * (i % NF4_CODES_PER_WORD))) & 0xF) as usize
}

/// The code of the level nearest to `x`, the lowest one on a tie.
pub fn nearest_level(x: f32) -> u8 {
    // The levels ascend, so the nearest is one of the two around `x`
    // (found in four halvings, not sixteen comparisons: seven billion
    // weights of an 8B base are quantized as it loads). Levels further
    // away are at least a level gap (> 0.07) further, which rounding of
    // the distances in f32 cannot close, so this picks what a scan of
    // every level would.
    let above = NF4_LEVELS.partition_point(|&level| level < x);
    if above == 0 {
        return 0;
    }
    if above == NF4_LEVELS.len() {
        return (NF4_LEVELS.len() - 1) as u8;
    }
    // Strictly closer only: a tie keeps the lower code.
    if (x - NF4_LEVELS[above]).abs() < (x - NF4_LEVELS[above - 1]).abs() {
        above as u8
    } else {
        (above - 1) as u8
    }
}

/// The error for a weight the format cannot hold.
fn format_error(reason: String) -> Error {
    Error::Input { name: "NF4 weight".into(), reason }
}

/// Leaf types of a weight of `shape`, or why it cannot be quantized.
fn leaf_types_of(shape: &[usize], double_quant: bool) -> std::result::Result<Vec<(&'static str, TensorType)>, String> {
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or("the element count overflows")?;
    if numel % NF4_BLOCK != 0 {
        return Err(format!("{numel} elements ({shape:?}) are not a multiple of the {NF4_BLOCK}-element block"));
    }
    let blocks = numel / NF4_BLOCK;
    let codes = (CODES_SUFFIX, TensorType::new(DType::I32, [numel / NF4_CODES_PER_WORD]));
    Ok(if double_quant {
        vec![
            codes,
            (ABSMAX_CODES_SUFFIX, TensorType::new(DType::I32, [blocks.div_ceil(NF4_SCALE_CODES_PER_WORD)])),
            (ABSMAX_SCALES_SUFFIX, TensorType::new(DType::F32, [blocks.div_ceil(NF4_SCALE_BLOCK) + 1])),
        ]
    } else {
        vec![codes, (ABSMAX_SUFFIX, TensorType::new(DType::F32, [blocks]))]
    })
}

impl Nf4Weight {
    /// The leaves a weight of `shape` is stored in, `(suffix, type)` in the
    /// op's input order (see the module doc); an error when its element
    /// count is not a multiple of [`NF4_BLOCK`].
    pub fn leaf_types(shape: &[usize], double_quant: bool) -> Result<Vec<(&'static str, TensorType)>> {
        leaf_types_of(shape, double_quant).map_err(format_error)
    }

    /// Whether the absmax values are double-quantized.
    pub fn double_quant(&self) -> bool {
        matches!(self.absmax, Nf4Absmax::Double { .. })
    }

    /// Elements of the weight.
    pub fn numel(&self) -> usize {
        self.codes.len() * NF4_CODES_PER_WORD
    }

    /// The leaf values, `(suffix, tensor)` in the order and of the types of
    /// [`Nf4Weight::leaf_types`].
    pub fn leaves(&self) -> Vec<(&'static str, HostTensor)> {
        fn tensor<T: bytemuck::Pod>(dtype: DType, data: &[T]) -> HostTensor {
            let mut t = HostTensor::zeros(TensorType::new(dtype, [data.len()]));
            t.bytes_mut().copy_from_slice(bytemuck::cast_slice(data));
            t
        }
        let mut out = vec![(CODES_SUFFIX, tensor(DType::I32, &self.codes))];
        match &self.absmax {
            Nf4Absmax::Plain(a) => out.push((ABSMAX_SUFFIX, tensor(DType::F32, a))),
            Nf4Absmax::Double { codes, scales, mean } => {
                let mut s = scales.clone();
                s.push(*mean);
                out.push((ABSMAX_CODES_SUFFIX, tensor(DType::I32, codes)));
                out.push((ABSMAX_SCALES_SUFFIX, tensor(DType::F32, &s)));
            }
        }
        out
    }

    /// The weight its leaves hold, in [`Nf4Weight::leaves`]' order (as a
    /// session reads them back); an error naming what does not fit.
    pub fn from_leaves(leaves: &[HostTensor]) -> Result<Nf4Weight> {
        fn words<T: bytemuck::Pod>(t: &HostTensor, dtype: DType, what: &str) -> Result<Vec<T>> {
            if t.ty.dtype != dtype || t.ty.rank() != 1 {
                return Err(format_error(format!("the {what} leaf is {}, expected a {dtype} vector", t.ty)));
            }
            // Read element by element: the host buffer's bytes need not be aligned for `T`.
            let size = std::mem::size_of::<T>();
            Ok(t.bytes().chunks_exact(size).map(bytemuck::pod_read_unaligned).collect())
        }
        let bad = |n: usize| format_error(format!("an NF4 weight has 2 or 3 leaves, got {n}"));
        let codes = words::<i32>(leaves.first().ok_or_else(|| bad(0))?, DType::I32, CODES_SUFFIX)?;
        let absmax = match leaves {
            [_, a] => Nf4Absmax::Plain(words::<f32>(a, DType::F32, ABSMAX_SUFFIX)?),
            [_, c, s] => {
                let mut scales = words::<f32>(s, DType::F32, ABSMAX_SCALES_SUFFIX)?;
                let mean = scales.pop().ok_or_else(|| format_error("the absmax scales leaf is empty".into()))?;
                Nf4Absmax::Double { codes: words::<i32>(c, DType::I32, ABSMAX_CODES_SUFFIX)?, scales, mean }
            }
            _ => return Err(bad(leaves.len())),
        };
        let w = Nf4Weight { codes, absmax };
        let blocks = w.numel() / NF4_BLOCK;
        let expected = leaf_types_of(&[w.numel()], w.double_quant()).map_err(format_error)?;
        for ((suffix, ty), t) in expected.iter().zip(leaves) {
            if ty.shape != t.ty.shape {
                return Err(format_error(format!(
                    "the {suffix} leaf of a {blocks}-block weight is {}, expected {ty}",
                    t.ty
                )));
            }
        }
        Ok(w)
    }

    fn scales(&self) -> Scales<'_> {
        match &self.absmax {
            Nf4Absmax::Plain(a) => Scales::Plain(a),
            Nf4Absmax::Double { codes, scales, mean } => Scales::Double { codes, scales, mean: *mean },
        }
    }

    /// The absmax every block is dequantized with (after double
    /// quantization's own rounding, where there is one).
    pub fn absmax_values(&self) -> Vec<f32> {
        let s = self.scales();
        (0..self.numel() / NF4_BLOCK).map(|b| s.absmax(b)).collect()
    }
}

/// Quantizes `weights` (row-major) to NF4, with double-quantized absmax
/// values when `double_quant`. Fails when the element count is not a
/// multiple of [`NF4_BLOCK`] or a weight is not finite.
pub fn quantize_nf4(weights: &[f32], double_quant: bool) -> Result<Nf4Weight> {
    leaf_types_of(&[weights.len()], double_quant).map_err(format_error)?;
    if let Some(i) = weights.iter().position(|w| !w.is_finite()) {
        return Err(format_error(format!("element {i} is {}, not a finite number", weights[i])));
    }
    // In parallel: an 8B model's base is seven billion weights, quantized
    // as it loads. Each word's code depends on its own block alone.
    let absmax: Vec<f32> =
        weights.par_chunks(NF4_BLOCK).map(|b| b.iter().fold(0.0f32, |m, w| m.max(w.abs()))).collect();
    let codes: Vec<i32> = weights
        .par_chunks(NF4_CODES_PER_WORD)
        .enumerate()
        .map(|(k, ws)| {
            let a = absmax[k * NF4_CODES_PER_WORD / NF4_BLOCK];
            ws.iter().enumerate().fold(0u32, |word, (j, &w)| {
                let c = if a == 0.0 { ZERO_CODE } else { nearest_level(w / a) };
                word | (c as u32) << (4 * j)
            }) as i32
        })
        .collect();
    let absmax = if double_quant { double_quantize(&absmax) } else { Nf4Absmax::Plain(absmax) };
    Ok(Nf4Weight { codes, absmax })
}

/// The double quantization of the absmax values (see the module doc).
fn double_quantize(absmax: &[f32]) -> Nf4Absmax {
    let mean = if absmax.is_empty() {
        0.0
    } else {
        (absmax.iter().map(|&a| a as f64).sum::<f64>() / absmax.len() as f64) as f32
    };
    let scales: Vec<f32> =
        absmax.chunks(NF4_SCALE_BLOCK).map(|g| g.iter().fold(0.0f32, |m, &a| m.max((a - mean).abs()))).collect();
    let q: Vec<i8> = absmax
        .iter()
        .enumerate()
        .map(|(b, &a)| {
            let scale = scales[b / NF4_SCALE_BLOCK];
            if scale == 0.0 {
                0
            } else {
                // f32::round rounds halves away from zero.
                ((a - mean) / scale * 127.0).round().clamp(-127.0, 127.0) as i8
            }
        })
        .collect();
    let codes = q
        .chunks(NF4_SCALE_CODES_PER_WORD)
        .map(|qs| qs.iter().enumerate().fold(0u32, |word, (j, &c)| word | (c as u8 as u32) << (8 * j)) as i32)
        .collect();
    Nf4Absmax::Double { codes, scales, mean }
}

/// The first `numel` elements of `w` in f32 (see the module doc).
pub fn dequantize_nf4(w: &Nf4Weight, numel: usize) -> Vec<f32> {
    let s = w.scales();
    (0..numel).map(|i| NF4_LEVELS[code(&w.codes, i)] * s.absmax(i / NF4_BLOCK)).collect()
}

/// The float weight `dtype[shape]` of an NF4-quantized weight (see the
/// module doc). Inputs: the leaves of [`Nf4Weight::leaf_types`] in order.
#[derive(Clone, PartialEq, Debug)]
pub struct DequantizeNf4 {
    pub shape: Vec<usize>,
    pub double_quant: bool,
    pub dtype: DType,
}

/// Blocks per parallel task of the CPU kernel.
const BLOCKS_PER_TASK: usize = 256;

/// Deterministic sample weights: per-block magnitudes spanning three
/// decades, a zero block where there are at least three, and values of
/// both signs (a fixed integer hash, so every table lists the same codes).
fn sample_weights(numel: usize, seed: u64) -> Vec<f32> {
    (0..numel)
        .map(|i| {
            let b = i / NF4_BLOCK;
            if b == 2 {
                return 0.0;
            }
            let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z ^= z >> 31;
            z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 29;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            u * u * u.signum() * 10f32.powi((b % 4) as i32 - 2)
        })
        .collect()
}

impl OpDef for DequantizeNf4 {
    fn name(&self) -> &'static str {
        "dequantize_nf4"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        if !self.dtype.is_float() {
            return Err(format!("the output dtype must be a float dtype, got {}", self.dtype));
        }
        let want = leaf_types_of(&self.shape, self.double_quant)?;
        expect_inputs(inputs, want.len())?;
        for ((suffix, ty), got) in want.iter().zip(inputs) {
            if *got != ty {
                return Err(format!("{suffix} of a {:?} weight must be {ty}, got {got}", self.shape));
            }
        }
        Ok(vec![TensorType::new(self.dtype, self.shape.clone())])
    }
    /// The inputs are the codes and scales of a frozen weight: no gradient
    /// flows into them, and none is refused either, so that a model whose
    /// base weights are frozen differentiates through the float weight's
    /// consumers (the adapters' inputs get their cotangents there).
    fn vjp(&self, _b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        Ok(vec![None; args.inputs.len()])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let codes = io.input::<i32>(0);
        let scales = if self.double_quant {
            let s = io.input::<f32>(2);
            Scales::Double { codes: io.input::<i32>(1), scales: s, mean: s[s.len() - 1] }
        } else {
            Scales::Plain(io.input::<f32>(1))
        };
        with_float!(self.dtype, T => {
            let y = io.output::<T>(0);
            y.par_chunks_mut(NF4_BLOCK * BLOCKS_PER_TASK).enumerate().for_each(|(t, part)| {
                for (j, block) in part.chunks_mut(NF4_BLOCK).enumerate() {
                    let b = t * BLOCKS_PER_TASK + j;
                    let a = scales.absmax(b);
                    for (e, out) in block.iter_mut().enumerate() {
                        // One f32 multiply, then one rounding to T (the
                        // product is an f32, exact in every wider Acc).
                        let v = NF4_LEVELS[code(codes, b * NF4_BLOCK + e)] * a;
                        *out = T::from_f64(v as f64);
                    }
                }
            });
            Ok(())
        })
    }
    /// Weights of one block, one row, several rows and a block count that
    /// fills neither an absmax word nor a group (301 blocks: two groups),
    /// with and without double quantization; a zero block from three
    /// blocks on. The leaves are the quantized sample weights.
    fn samples(d: DType) -> Vec<Sample> {
        let cases: [(&[usize], bool); 8] = [
            (&[64], false),
            (&[64], true),
            (&[2, 64], false),
            (&[3, 128], true),
            (&[5, 192], false),
            (&[5, 192], true),
            (&[301, 64], true),
            (&[128, 256], false),
        ];
        cases
            .iter()
            .enumerate()
            .map(|(i, &(shape, dq))| {
                let numel: usize = shape.iter().product();
                let w = quantize_nf4(&sample_weights(numel, i as u64), dq).expect("sample weights quantize");
                let inputs = w.leaves().into_iter().map(|(_, t)| fixed(t.ty.dtype, &t.ty.shape, &t.to_f64())).collect();
                Sample::new(DequantizeNf4 { shape: shape.to_vec(), double_quant: dq, dtype: d }, inputs)
            })
            .collect()
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![
            ("shape", Attr::Ints(self.shape.iter().map(|&d| d as i64).collect())),
            ("double_quant", Attr::Bool(self.double_quant)),
            ("dtype", Attr::DType(self.dtype)),
        ]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "dequantize_nf4").then(|| {
            Ok(DequantizeNf4 {
                shape: a.usizes("shape")?,
                double_quant: a.bool("double_quant")?,
                dtype: a.dtype("dtype")?,
            })
        })
    }
}

impl Builder {
    /// The float weight `dtype[shape]` of an NF4-quantized weight, from its
    /// leaves in the order of [`Nf4Weight::leaf_types`].
    pub fn dequantize_nf4(
        &mut self,
        inputs: &[ValueId],
        shape: &[usize],
        double_quant: bool,
        dtype: DType,
    ) -> Result<ValueId> {
        self.push1(DequantizeNf4 { shape: shape.to_vec(), double_quant, dtype }.into(), inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::run_op;

    /// Half the widest gap between adjacent levels: the largest distance
    /// from a point of [−1, 1] to its nearest level.
    fn max_half_gap() -> f32 {
        NF4_LEVELS.windows(2).map(|w| (w[1] - w[0]) / 2.0).fold(0.0, f32::max)
    }

    #[test]
    fn levels_are_ascending_with_an_exact_zero_and_ends() {
        assert!(NF4_LEVELS.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((NF4_LEVELS[0], NF4_LEVELS[ZERO_CODE as usize], NF4_LEVELS[15]), (-1.0, 0.0, 1.0));
        assert!((max_half_gap() - 0.151_903_6).abs() < 1e-6);
    }

    #[test]
    fn every_element_is_within_half_a_gap_of_its_weight() {
        for dq in [false, true] {
            let w = sample_weights(301 * 64, 9);
            let q = quantize_nf4(&w, dq).unwrap();
            let got = dequantize_nf4(&q, w.len());
            let absmax = q.absmax_values();
            for (i, (&x, &y)) in w.iter().zip(&got).enumerate() {
                let a = absmax[i / NF4_BLOCK];
                // The level's distance, scaled, plus the roundings of the
                // quotient and the product (and, with double quantization,
                // the absmax's own error, within half a step of its code).
                let true_a = w[i / NF4_BLOCK * NF4_BLOCK..][..NF4_BLOCK].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let bound = true_a * max_half_gap() * (1.0 + 1e-6) + (a - true_a).abs() + 1e-30;
                assert!((x - y).abs() <= bound, "dq {dq} element {i}: {x} became {y} (bound {bound})");
            }
        }
    }

    #[test]
    fn levels_times_the_absmax_come_back_exactly() {
        // Element 0 of each block carries the absmax (level ±1); the others
        // are levels times it, so the quotient is the level again.
        let scales = [0.5f32, 3.0, 1.0 / 64.0, 1024.0];
        let mut w = Vec::new();
        for (b, &a) in scales.iter().enumerate() {
            w.push(if b % 2 == 0 { a } else { -a });
            for k in 1..NF4_BLOCK {
                w.push(NF4_LEVELS[k % 16] * a);
            }
        }
        let q = quantize_nf4(&w, false).unwrap();
        assert_eq!(dequantize_nf4(&q, w.len()), w);
        assert_eq!(q.absmax, Nf4Absmax::Plain(scales.to_vec()));
    }

    #[test]
    fn a_zero_block_is_zero_codes_and_zero_values() {
        let mut w = vec![0.0f32; 2 * NF4_BLOCK];
        w[NF4_BLOCK + 3] = -2.0;
        let q = quantize_nf4(&w, false).unwrap();
        // Code 7 (0.0) in every nibble of the zero block's eight words.
        assert!(q.codes[..8].iter().all(|&c| c as u32 == 0x7777_7777));
        assert_eq!(q.absmax, Nf4Absmax::Plain(vec![0.0, 2.0]));
        let y = dequantize_nf4(&q, w.len());
        assert!(y[..NF4_BLOCK].iter().all(|v| v.to_bits() == 0));
        assert_eq!(y, w);
    }

    #[test]
    fn codes_pack_eight_to_a_word_low_nibble_first() {
        // Element j of the first word takes level j; element 8 + j level 15 − j.
        let mut w = vec![0.0f32; NF4_BLOCK];
        for j in 0..8 {
            w[j] = NF4_LEVELS[j];
            w[8 + j] = NF4_LEVELS[15 - j];
        }
        let q = quantize_nf4(&w, false).unwrap();
        assert_eq!(q.codes[0] as u32, 0x7654_3210);
        assert_eq!(q.codes[1] as u32, 0x89ab_cdef);
        assert!(q.codes[2..].iter().all(|&c| c as u32 == 0x7777_7777));
        assert_eq!(q.codes.len(), NF4_BLOCK / 8);
    }

    /// The nearest level by a scan of every level, as the format defines it.
    fn nearest_by_scan(x: f32) -> u8 {
        let mut best = 0;
        for (k, &level) in NF4_LEVELS.iter().enumerate().skip(1) {
            if (x - level).abs() < (x - NF4_LEVELS[best]).abs() {
                best = k;
            }
        }
        best as u8
    }

    #[test]
    fn nearest_level_agrees_with_a_scan_of_every_level() {
        let mut xs: Vec<f32> = (-2_000_000..=2_000_000).map(|i| i as f32 * 6e-7).collect();
        for w in NF4_LEVELS.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for k in -8i32..=8 {
                // The midpoint and its f32 neighbours.
                xs.push(f32::from_bits((mid.to_bits() as i32 + k) as u32));
            }
        }
        xs.extend(NF4_LEVELS);
        xs.extend([-1.0001, 1.0001, -0.0, f32::MIN_POSITIVE]);
        for x in xs {
            assert_eq!(nearest_level(x), nearest_by_scan(x), "{x:e}");
        }
    }

    #[test]
    fn nearest_level_takes_the_lower_code_on_a_tie_and_the_ends_beyond() {
        assert_eq!(nearest_level(-3.0), 0);
        assert_eq!(nearest_level(3.0), 15);
        assert_eq!(nearest_level(0.03), ZERO_CODE);
        // A point the two distances in f32 put exactly halfway.
        let (lo, hi) = (NF4_LEVELS[14], NF4_LEVELS[15]);
        let mid = (lo + hi) / 2.0;
        if (mid - lo).abs() == (mid - hi).abs() {
            assert_eq!(nearest_level(mid), 14);
        }
        assert_eq!(nearest_level(-0.5), 2);
        assert_eq!(nearest_level(0.2), 9);
    }

    #[test]
    fn double_quantization_matches_a_hand_computed_example() {
        // Four blocks with absmax 1, 2, 3, 6: mean 3, one group with scale
        // max |a − 3| = 3; q = round((a − 3) / 3 · 127) = −85 (−84.67),
        // −42 (−42.33), 0, 127.
        let mut w = vec![0.0f32; 4 * NF4_BLOCK];
        for (b, a) in [1.0f32, 2.0, 3.0, 6.0].into_iter().enumerate() {
            w[b * NF4_BLOCK + 5] = a;
        }
        let q = quantize_nf4(&w, true).unwrap();
        let bytes = [-85i8 as u8, -42i8 as u8, 0, 127];
        let Nf4Absmax::Double { codes, scales, mean } = &q.absmax else { panic!("plain") };
        assert_eq!(codes, &vec![u32::from_le_bytes(bytes) as i32]);
        assert_eq!((scales.as_slice(), *mean), (&[3.0f32][..], 3.0));
        let want: Vec<f32> = [-85i8, -42, 0, 127].iter().map(|&c| (c as f32 / 127.0) * 3.0 + 3.0).collect();
        assert_eq!(q.absmax_values(), want);
        assert_eq!(want[3], 6.0);
        // The leaves: codes, absmax codes, scales then the mean.
        let leaves = q.leaves();
        let names: Vec<&str> = leaves.iter().map(|(s, _)| *s).collect();
        assert_eq!(names, [CODES_SUFFIX, ABSMAX_CODES_SUFFIX, ABSMAX_SCALES_SUFFIX]);
        assert_eq!(leaves[2].1.to_f64(), [3.0, 3.0]);
        let types: Vec<_> = leaves.iter().map(|(s, t)| (*s, t.ty.clone())).collect();
        assert_eq!(types, Nf4Weight::leaf_types(&[4, 64], true).unwrap());
    }

    #[test]
    fn double_quantization_groups_blocks_by_256_and_leaves_a_zero_group_at_the_mean() {
        // 257 blocks: group 0 all at absmax 1, group 1 one block at 1 too,
        // so every deviation from the mean is 0 and q is 0 everywhere.
        let mut w = vec![0.0f32; 257 * NF4_BLOCK];
        for b in 0..257 {
            w[b * NF4_BLOCK] = 1.0;
        }
        let q = quantize_nf4(&w, true).unwrap();
        let Nf4Absmax::Double { codes, scales, mean } = &q.absmax else { panic!("plain") };
        assert_eq!((codes.len(), scales.as_slice(), *mean), (65, &[0.0f32, 0.0][..], 1.0));
        assert!(codes.iter().all(|&c| c == 0));
        assert_eq!(dequantize_nf4(&q, w.len()), w);
    }

    #[test]
    fn weights_the_format_cannot_hold_are_refused() {
        let e = quantize_nf4(&[1.0; 65], false).unwrap_err().to_string();
        assert!(e.contains("not a multiple of the 64-element block"), "{e}");
        let mut w = vec![0.5f32; 64];
        w[9] = f32::NAN;
        let e = quantize_nf4(&w, true).unwrap_err().to_string();
        assert!(e.contains("element 9 is NaN"), "{e}");
        assert!(Nf4Weight::leaf_types(&[3, 10], false).is_err());
    }

    #[test]
    fn the_op_gives_the_reference_values_rounded_once() {
        for dq in [false, true] {
            let w = sample_weights(5 * 192, 4);
            let q = quantize_nf4(&w, dq).unwrap();
            let want = dequantize_nf4(&q, w.len());
            let inputs: Vec<HostTensor> = q.leaves().into_iter().map(|(_, t)| t).collect();
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let op = DequantizeNf4 { shape: vec![5, 192], double_quant: dq, dtype };
                let y = run_op(&op.into(), &inputs).unwrap();
                let rounded = HostTensor::from_f64(
                    TensorType::new(dtype, [5, 192]),
                    &want.iter().map(|&v| v as f64).collect::<Vec<_>>(),
                );
                assert_eq!(y[0].bytes(), rounded.bytes(), "{dtype} dq {dq}");
            }
        }
    }

    #[test]
    fn the_shape_rule_names_the_wrong_leaf() {
        let op = DequantizeNf4 { shape: vec![4, 64], double_quant: true, dtype: DType::BF16 };
        let codes = TensorType::new(DType::I32, [32]);
        let scale_codes = TensorType::new(DType::I32, [1]);
        let scales = TensorType::new(DType::F32, [2]);
        assert_eq!(op.infer(&[&codes, &scale_codes, &scales]).unwrap(), vec![TensorType::new(DType::BF16, [4, 64])]);
        let e = op.infer(&[&codes, &scale_codes, &TensorType::new(DType::F32, [1])]).unwrap_err();
        assert!(e.contains(ABSMAX_SCALES_SUFFIX), "{e}");
        let e = op.infer(&[&codes.with_dtype(DType::F32), &scale_codes, &scales]).unwrap_err();
        assert!(e.contains(CODES_SUFFIX), "{e}");
        assert!(op.infer(&[&codes, &scale_codes]).is_err());
        let e = DequantizeNf4 { dtype: DType::I32, ..op }.infer(&[&codes, &scale_codes, &scales]).unwrap_err();
        assert!(e.contains("float dtype"), "{e}");
    }

    #[test]
    fn no_cotangent_flows_into_the_leaves_and_none_is_refused() {
        let mut b = Builder::new("q");
        let leaves: Vec<ValueId> = Nf4Weight::leaf_types(&[2, 64], false)
            .unwrap()
            .into_iter()
            .map(|(s, t)| b.input(&format!("w.{s}"), t).unwrap())
            .collect();
        let y = b.dequantize_nf4(&leaves, &[2, 64], false, DType::F32).unwrap();
        let gy = b.input("gy", TensorType::new(DType::F32, [2, 64])).unwrap();
        let op = DequantizeNf4 { shape: vec![2, 64], double_quant: false, dtype: DType::F32 };
        let nodes = b.trace().nodes.len();
        let g = op.vjp(&mut b, &VjpArgs { inputs: &leaves, outputs: &[y], cotangents: &[Some(gy)] }).unwrap();
        assert_eq!(g, vec![None, None]);
        assert_eq!(b.trace().nodes.len(), nodes, "the VJP emits no node");
    }

    #[test]
    fn a_weight_reads_back_from_its_leaves() {
        let w: Vec<f32> = (0..64 * 9).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        for dq in [false, true] {
            let q = quantize_nf4(&w, dq).unwrap();
            let leaves: Vec<HostTensor> = q.leaves().into_iter().map(|(_, t)| t).collect();
            let back = Nf4Weight::from_leaves(&leaves).unwrap();
            assert_eq!(back, q);
            assert!(Nf4Weight::from_leaves(&leaves[..1]).is_err());
        }
    }

    #[test]
    fn the_op_prints_and_parses_back() {
        let mut b = Builder::new("q");
        let leaves: Vec<ValueId> = Nf4Weight::leaf_types(&[3, 128], true)
            .unwrap()
            .into_iter()
            .map(|(s, t)| b.input(&format!("w.{s}"), t).unwrap())
            .collect();
        let y = b.dequantize_nf4(&leaves, &[3, 128], true, DType::BF16).unwrap();
        b.output(crate::ir::OutputKind::Named("w".into()), y);
        let t = b.finish("build").unwrap();
        let text = t.to_string();
        assert!(text.contains("dequantize_nf4 ") && text.contains("double_quant=true"), "{text}");
        assert_eq!(crate::ir::parse::parse(&text).unwrap(), t);
    }
}
