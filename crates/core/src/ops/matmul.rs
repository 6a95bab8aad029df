//! Matrix products `op(a) · op(b)` with optional transposes and batch dims.
//!
//! `a` is `[..., m, k]` (`[..., k, m]` with `trans_a`), `b` is `[..., k, n]`
//! (`[..., n, k]` with `trans_b`). Either operand may be 2-D while the other
//! carries batch dims (a linear layer: activations `[B, T, in]` times a
//! weight `[out, in]` with `trans_b`); otherwise batch dims must be equal.
//!
//! With `addend`, a third input is added to the product before its one
//! rounding to storage: a tensor of the output's type (the residual add, a
//! gradient summed from two products: cuBLASLt's `beta = 1`) or a row
//! vector `[n]` broadcast over the rows (a bias: cuBLASLt's bias epilogue).
//! The epilogue pass ([`crate::passes::fusion`]) makes these from `add` nodes.
//!
//! With `tf32` (f32 operands only), each operand element is first rounded
//! to TF32 (10 fraction bits, [`tf32_round`]) and the products summed in
//! f32. A tensor core reading f32 data drops the 13 low bits instead (and
//! a cuBLASLt kernel may round first), so for operands that are not TF32
//! values already this is a model within a TF32 unit, not the GPU's bits.
//! [`SplitTf32`] splits an f32 tensor into two TF32 values, so that three
//! such products (`a_lo·b_hi + a_hi·b_lo + a_hi·b_hi`) give an f32 product
//! to about f32 accuracy at tensor-core speed
//! (`passes::split_f32_products`): their operands are exact TF32 values,
//! which every way of reading them leaves as they are, so the CPU computes
//! the products the GPU computes.

use rayon::prelude::*;

use super::sample::{normal, Sample};
use super::{expect_float, expect_inputs, no_vjp, Attr, Attrs, OpDef, VjpArgs};
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::fp8::Fp8Format;
use crate::ops::gemm::{gemm_bf16, gemm_bf16_wide, gemm_f16, gemm_f16_wide, gemm_f32, gemm_f64, GemmDesc};
use crate::ops::kernel::{Float, KernelIo};

#[derive(Clone, PartialEq, Debug)]
pub struct MatMul {
    pub trans_a: bool,
    pub trans_b: bool,
    /// A third input is added to the product (see the module doc).
    pub addend: bool,
    /// The operands are rounded to TF32 first (f32 only; see the module doc).
    pub tf32: bool,
    /// Marked for an FP8 product, with the formats of `a` and `b`
    /// (`--fp8 products`, [`crate::ops::fp8`]): `passes::fp8` replaces it
    /// after autodiff, where its operands allow; until then, and where
    /// they do not, it is the plain product. Its VJP marks the two
    /// cotangent products alike, the cotangent an e5m2 operand.
    pub fp8: Option<(Fp8Format, Fp8Format)>,
}

/// How a [`MatMul`]'s addend meets the product.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum AddendKind {
    /// The output's own type: added element by element.
    Full,
    /// `[n]`, the output's last dimension: added to every row.
    Bias,
}

impl MatMul {
    /// The plain product `op(a) · op(b)`.
    pub fn new(trans_a: bool, trans_b: bool) -> Self {
        MatMul { trans_a, trans_b, addend: false, tf32: false, fp8: None }
    }

    /// How an addend of type `addend` meets an output of type `out`, or
    /// `None` when it cannot be a [`MatMul`] addend.
    pub fn addend_kind(out: &TensorType, addend: &TensorType) -> Option<AddendKind> {
        if addend.dtype != out.dtype {
            return None;
        }
        if addend == out {
            Some(AddendKind::Full)
        } else if addend.shape.len() == 1 && out.shape.last() == Some(&addend.shape[0]) {
            Some(AddendKind::Bias)
        } else {
            None
        }
    }
}

/// Resolved dimensions of one product.
struct Dims {
    batch_shape: Vec<usize>,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a_batched: bool,
    b_batched: bool,
}

impl MatMul {
    fn dims(&self, a: &[usize], b: &[usize]) -> std::result::Result<Dims, String> {
        if a.len() < 2 || b.len() < 2 {
            return Err("operands must have rank >= 2".into());
        }
        let (ab, am) = a.split_at(a.len() - 2);
        let (bb, bm) = b.split_at(b.len() - 2);
        let (m, ka) = if self.trans_a { (am[1], am[0]) } else { (am[0], am[1]) };
        let (kb, n) = if self.trans_b { (bm[1], bm[0]) } else { (bm[0], bm[1]) };
        if ka != kb {
            return Err(format!("contraction sizes differ: {ka} and {kb}"));
        }
        let batch_shape = match (ab.is_empty(), bb.is_empty()) {
            (_, true) => ab.to_vec(),
            (true, false) => bb.to_vec(),
            (false, false) if ab == bb => ab.to_vec(),
            _ => return Err(format!("batch dims differ: {ab:?} and {bb:?}")),
        };
        Ok(Dims {
            batch: batch_shape.iter().product(),
            batch_shape,
            m,
            n,
            k: ka,
            a_batched: !ab.is_empty(),
            b_batched: !bb.is_empty(),
        })
    }
}

impl OpDef for MatMul {
    /// Every transposition, unbatched and batched, a weight shared by a
    /// batch (the linear layer) and a shared left operand, one-element
    /// matrices and odd sizes.
    fn samples(d: DType) -> Vec<Sample> {
        // ((m, k, n), batch of a, batch of b)
        type Case = ((usize, usize, usize), &'static [usize], &'static [usize]);
        let cases: [Case; 6] = [
            ((3, 4, 5), &[], &[]),
            ((3, 4, 5), &[2], &[2]),
            ((3, 4, 5), &[2, 2], &[]),
            ((3, 4, 5), &[], &[3]),
            ((1, 1, 1), &[], &[]),
            ((17, 9, 33), &[2], &[2]),
        ];
        let mut v = Vec::new();
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for ((m, k, n), ba, bb) in cases {
                let mut a = ba.to_vec();
                a.extend(if ta { [k, m] } else { [m, k] });
                let mut b = bb.to_vec();
                b.extend(if tb { [n, k] } else { [k, n] });
                v.push(Sample::new(MatMul::new(ta, tb), vec![normal(d, &a), normal(d, &b)]));
            }
        }
        // With an addend of the output's type and with a bias, unbatched,
        // batched and a batch of row blocks times a shared weight.
        for (ta, tb) in [(false, false), (false, true), (true, false)] {
            for ((m, k, n), ba, bb) in [cases[0], cases[1], cases[2], cases[5]] {
                let mut a = ba.to_vec();
                a.extend(if ta { [k, m] } else { [m, k] });
                let mut b = bb.to_vec();
                b.extend(if tb { [n, k] } else { [k, n] });
                let mut out = if ba.is_empty() { bb.to_vec() } else { ba.to_vec() };
                out.extend([m, n]);
                let op = MatMul { trans_a: ta, trans_b: tb, addend: true, tf32: false, fp8: None };
                for c in [&out[..], &[n]] {
                    v.push(Sample::new(op.clone(), vec![normal(d, &a), normal(d, &b), normal(d, c)]));
                }
            }
        }
        // Decode shapes: a few rows times a weight stored [n, k], with a
        // depth of whole 16-byte packs (what the CUDA backend's few-row
        // kernels take): depths past a 32-element chunk, widths past an
        // 8-column tile, more than 8 rows, batched, and with both addends.
        let decode: [Case; 4] =
            [((1, 40, 20), &[], &[]), ((11, 64, 19), &[], &[]), ((3, 48, 10), &[2], &[2]), ((2, 16, 6), &[2], &[])];
        for ((m, k, n), ba, bb) in decode {
            let (mut a, mut b) = (ba.to_vec(), bb.to_vec());
            a.extend([m, k]);
            b.extend([n, k]);
            v.push(Sample::new(MatMul::new(false, true), vec![normal(d, &a), normal(d, &b)]));
            let mut out = if ba.is_empty() { bb.to_vec() } else { ba.to_vec() };
            out.extend([m, n]);
            let op = MatMul { trans_a: false, trans_b: true, addend: true, tf32: false, fp8: None };
            for c in [&out[..], &[n]] {
                v.push(Sample::new(op.clone(), vec![normal(d, &a), normal(d, &b), normal(d, c)]));
            }
        }
        // TF32 products (f32 only): transposed, batched, with both addends.
        if d == DType::F32 {
            let tf32 = |ta, tb, addend| MatMul { trans_a: ta, trans_b: tb, addend, tf32: true, fp8: None };
            v.push(Sample::new(tf32(false, true, false), vec![normal(d, &[17, 40]), normal(d, &[33, 40])]));
            v.push(Sample::new(tf32(true, false, false), vec![normal(d, &[2, 40, 17]), normal(d, &[2, 40, 9])]));
            for c in [&[17, 33][..], &[33]] {
                let ins = vec![normal(d, &[17, 40]), normal(d, &[33, 40]), normal(d, c)];
                v.push(Sample::new(tf32(false, true, true), ins));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, if self.addend { 3 } else { 2 })?;
        expect_float(inputs[0], "a")?;
        if self.tf32 && inputs[0].dtype != DType::F32 {
            return Err(format!("TF32 products take f32 operands, not {}", inputs[0].dtype));
        }
        if inputs[0].dtype != inputs[1].dtype {
            return Err(format!("dtypes differ: {} and {}", inputs[0].dtype, inputs[1].dtype));
        }
        let d = self.dims(&inputs[0].shape, &inputs[1].shape)?;
        let mut shape = d.batch_shape;
        shape.extend([d.m, d.n]);
        let out = inputs[0].with_shape(shape);
        if self.addend && MatMul::addend_kind(&out, inputs[2]).is_none() {
            return Err(format!("the addend {} is neither the product's type {out} nor a row of {}", inputs[2], d.n));
        }
        Ok(vec![out])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None, None]) };
        let (x, w) = (args.inputs[0], args.inputs[1]);
        let (ta, tb) = (self.trans_a, self.trans_b);
        // C = opA(A)·opB(B): dopA = G·opB(B)ᵀ and dopB = opA(A)ᵀ·G, transposed
        // back where the operand is stored transposed.
        // `b`'s cotangent comes first: in a linear layer it is the weight
        // gradient, the last reader of the saved activation `a`, so `a` is
        // freed before the activation-sized cotangent of `a` is allocated
        // (the other order holds both at once, and the weight never dies).
        // Marked FP8 products mark their cotangent products, the cotangent
        // (a gradient) in e5m2 and the other operand in its own format.
        let (fx, fw) = self.fp8.unzip();
        let grad = Some(Fp8Format::E5M2);
        let gb = if tb {
            b.matmul_into(g, x, true, ta, w, grad.zip(fx))?
        } else {
            b.matmul_into(x, g, !ta, false, w, fx.zip(grad))?
        };
        let ga = if ta {
            b.matmul_into(w, g, tb, true, x, fw.zip(grad))?
        } else {
            b.matmul_into(g, w, false, !tb, x, grad.zip(fw))?
        };
        let mut grads = vec![Some(ga), Some(gb)];
        if self.addend {
            let shape = b.shape(args.inputs[2]).to_vec();
            grads.push(Some(b.sum_to(g, &shape)?));
        }
        Ok(grads)
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let d = self.dims(&io.in_ty(0).shape, &io.in_ty(1).shape).map_err(|e| Error::op("matmul", e))?;
        let desc = GemmDesc {
            batch: if d.a_batched { d.batch } else { 1 },
            m: d.m,
            n: d.n,
            k: d.k,
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            broadcast_b: !d.b_batched,
        };
        // Without an addend the product goes straight to storage; with one,
        // it is kept in the accumulator type (f32 for 16-bit storage), the
        // addend added, and rounded once.
        macro_rules! run {
            ($T:ty, $plain:ident, $wide:ident) => {{
                let (a, bm) = (io.input::<$T>(0), io.input::<$T>(1));
                if self.addend {
                    let mut wide = vec![<$T as Float>::Acc::default(); io.out_ty(0).numel()];
                    product(&d, &desc, a, bm, &mut wide, $wide);
                    add_addend::<$T>(io, &wide, 2);
                } else {
                    product(&d, &desc, a, bm, io.output::<$T>(0), $plain);
                }
            }};
        }
        match io.out_ty(0).dtype {
            DType::F32 if self.tf32 => {
                // The operands as a tensor core reads f32 data in TF32 mode.
                let round = |x: &[f32]| -> Vec<f32> { x.par_iter().map(|&v| tf32_round(v)).collect() };
                let (a, bm) = (round(io.input::<f32>(0)), round(io.input::<f32>(1)));
                if self.addend {
                    let mut wide = vec![0f32; io.out_ty(0).numel()];
                    product(&d, &desc, &a, &bm, &mut wide, gemm_f32);
                    add_addend::<f32>(io, &wide, 2);
                } else {
                    product(&d, &desc, &a, &bm, io.output::<f32>(0), gemm_f32);
                }
            }
            DType::F32 => run!(f32, gemm_f32, gemm_f32),
            DType::F64 => run!(f64, gemm_f64, gemm_f64),
            DType::BF16 => run!(half::bf16, gemm_bf16, gemm_bf16_wide),
            DType::F16 => run!(half::f16, gemm_f16, gemm_f16_wide),
            dt => return Err(Error::op("matmul", format!("no CPU kernel for {dt}"))),
        }
        Ok(())
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut v = vec![("trans_a", Attr::Bool(self.trans_a)), ("trans_b", Attr::Bool(self.trans_b))];
        if self.addend {
            v.push(("addend", Attr::Bool(true)));
        }
        if self.tf32 {
            v.push(("tf32", Attr::Bool(true)));
        }
        if let Some((fa, fb)) = self.fp8 {
            v.push(("fp8", Attr::Ints(vec![fa.exponent_bits() as i64, fb.exponent_bits() as i64])));
        }
        v
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "matmul").then(|| {
            Ok(MatMul {
                trans_a: a.bool("trans_a")?,
                trans_b: a.bool("trans_b")?,
                addend: a.opt_bool("addend")?.unwrap_or(false),
                tf32: a.opt_bool("tf32")?.unwrap_or(false),
                fp8: match a.opt_ints("fp8")? {
                    None => None,
                    Some(bits) => {
                        let format = |i: usize| bits.get(i).and_then(|&b| Fp8Format::from_exponent_bits(b));
                        match (format(0), format(1), bits.len()) {
                            (Some(fa), Some(fb), 2) => Some((fa, fb)),
                            _ => {
                                return Err(Error::op("matmul", format!("`fp8` must be two of 4 and 5, got {bits:?}")))
                            }
                        }
                    }
                },
            })
        })
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        // An addend of the output's type may be overwritten by the result
        // (cuBLASLt reads C before writing D element by element when C = D).
        if self.addend {
            vec![(0, 2)]
        } else {
            Vec::new()
        }
    }
    fn with_addend(&self, output: usize, inputs: &[&TensorType], addend: &TensorType) -> Option<(Self, usize)> {
        if self.addend || output != 0 {
            return None;
        }
        let out = self.infer(inputs).ok()?.pop()?;
        MatMul::addend_kind(&out, addend).map(|_| (MatMul { addend: true, ..self.clone() }, 2))
    }
}

/// `c = op(a) · op(b)` by `gemm` (one of the CPU products), for a batch
/// whose `a` is shared while `b` is batched too (one product per entry).
fn product<S, D>(d: &Dims, desc: &GemmDesc, a: &[S], b: &[S], c: &mut [D], gemm: fn(&GemmDesc, &[S], &[S], &mut [D])) {
    if d.a_batched || !d.b_batched {
        gemm(desc, a, b, c);
    } else {
        let one = GemmDesc { batch: 1, broadcast_b: false, ..*desc };
        let (bs, cs) = (d.k * d.n, d.m * d.n);
        for i in 0..d.batch {
            gemm(&one, a, &b[i * bs..(i + 1) * bs], &mut c[i * cs..(i + 1) * cs]);
        }
    }
}

/// Writes output 0 as the unrounded product `wide` plus the addend (input
/// `at`: 2 for `matmul`), rounded once to storage. An addend of the
/// output's type may share the output's storage, so it is read through
/// [`KernelIo::inplace`], which hands over the output holding the addend.
pub(crate) fn add_addend<T: Float>(io: &KernelIo, wide: &[T::Acc], at: usize) {
    let n = io.out_ty(0).shape.last().copied().unwrap_or(1).max(1);
    match MatMul::addend_kind(io.out_ty(0), io.in_ty(at)) {
        Some(AddendKind::Full) => {
            io.inplace::<T>(0, at)
                .par_iter_mut()
                .zip(wide.par_iter())
                .for_each(|(o, &w)| *o = T::from_acc(w + o.acc()));
        }
        Some(AddendKind::Bias) => {
            let bias = io.input::<T>(at);
            io.output::<T>(0).par_chunks_mut(n).zip(wide.par_chunks(n)).for_each(|(row, w)| {
                for ((o, &w), b) in row.iter_mut().zip(w).zip(bias) {
                    *o = T::from_acc(w + b.acc());
                }
            });
        }
        None => unreachable!("the shape rule admits a full or a row addend only"),
    }
}

/// `x` rounded to TF32, the nearest value with 10 fraction bits, ties away
/// from zero (PTX's `cvt.rna.tf32.f32`); infinities and NaN as they are.
pub fn tf32_round(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    // Sign and magnitude: adding half a unit of the 13 dropped bits to the
    // magnitude rounds half away from zero; a carry into the exponent is
    // the next binade's value (or infinity), as it should be.
    f32::from_bits((x.to_bits() + 0x1000) & !0x1fff)
}

// ---------------------------------------------------------------- split_tf32

/// `x` (f32) as `hi + lo`, both TF32 values: `hi` is [`tf32_round`]`(x)`
/// and `lo` is [`tf32_round`]`(x − hi)` (the difference is exact in f32),
/// so `x − hi − lo` is at most half a TF32 unit of `lo`, about 2^-22 of
/// `x`. The operands of 3xTF32 products: being TF32 values, a tensor core
/// reads both without error whether it truncates f32 data or a kernel
/// rounds it first (`x − hi` itself has up to 13 significant bits, which
/// truncation and rounding would read differently), so `a_lo·b_hi +
/// a_hi·b_lo + a_hi·b_hi` misses `a·b` by about 2^-21 relative on every
/// backend alike, where one TF32 product misses it by about 2^-11. Made by
/// `passes::split_f32_products` after autodiff: no VJP.
#[derive(Clone, PartialEq, Debug)]
pub struct SplitTf32;

impl OpDef for SplitTf32 {
    /// f32 only: a scalar, odd sizes, rows of a product operand.
    fn samples(d: DType) -> Vec<Sample> {
        if d != DType::F32 {
            return Vec::new();
        }
        [&[][..], &[7], &[3, 5], &[64, 100]].iter().map(|s| Sample::new(SplitTf32, vec![normal(d, s)])).collect()
    }
    fn name(&self) -> &'static str {
        "split_tf32"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        if inputs[0].dtype != DType::F32 {
            return Err(format!("splits f32 tensors, not {}", inputs[0].dtype));
        }
        Ok(vec![inputs[0].clone(), inputs[0].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let x = io.input::<f32>(0);
        let hi = io.output::<f32>(0);
        hi.par_iter_mut().zip(x.par_iter()).for_each(|(h, &v)| *h = tf32_round(v));
        let lo = io.output::<f32>(1);
        lo.par_iter_mut().zip(x.par_iter()).for_each(|(l, &v)| *l = tf32_round(v - tf32_round(v)));
        Ok(())
    }
    fn parse(name: &str, _: &mut Attrs) -> Option<Result<Self>> {
        (name == "split_tf32").then_some(Ok(SplitTf32))
    }
}

impl Builder {
    /// `x` (f32) as its TF32 part and the rest ([`SplitTf32`]).
    pub fn split_tf32(&mut self, x: ValueId) -> Result<(ValueId, ValueId)> {
        let out = self.push(SplitTf32.into(), &[x])?;
        Ok((out[0], out[1]))
    }

    pub fn matmul(&mut self, a: ValueId, b: ValueId, trans_a: bool, trans_b: bool) -> Result<ValueId> {
        self.push1(MatMul::new(trans_a, trans_b).into(), &[a, b])
    }

    /// [`Builder::matmul`], marked for an FP8 product with these formats of
    /// `a` and `b` when `fp8` is given ([`MatMul::fp8`]).
    pub fn matmul_marked(
        &mut self,
        a: ValueId,
        b: ValueId,
        trans_a: bool,
        trans_b: bool,
        fp8: Option<(Fp8Format, Fp8Format)>,
    ) -> Result<ValueId> {
        self.push1(MatMul { fp8, ..MatMul::new(trans_a, trans_b) }.into(), &[a, b])
    }

    /// `x · Wᵀ (+ bias)` for `x: [..., in]` and a weight stored `[out, in]`, as PyTorch's `Linear`.
    pub fn linear(&mut self, x: ValueId, weight: ValueId, bias: Option<ValueId>) -> Result<ValueId> {
        self.linear_marked(x, weight, bias, false)
    }

    /// [`Builder::linear`], its product marked for FP8 (e4m3 operands)
    /// when `fp8` is set ([`MatMul::fp8`]).
    pub fn linear_marked(&mut self, x: ValueId, weight: ValueId, bias: Option<ValueId>, fp8: bool) -> Result<ValueId> {
        let formats = fp8.then_some((Fp8Format::E4M3, Fp8Format::E4M3));
        let xs = self.shape(x).to_vec();
        // Rank-2 `x` still goes through a batch-free product.
        let y = if xs.len() == 1 {
            let x2 = self.reshape(x, &[1, xs[0]])?;
            let y = self.matmul_marked(x2, weight, false, true, formats)?;
            let out = self.shape(y)[1];
            self.reshape(y, &[out])?
        } else {
            self.matmul_marked(x, weight, false, true, formats)?
        };
        match bias {
            Some(b) => self.add(y, b),
            None => Ok(y),
        }
    }

    /// A product whose result must have `like`'s shape: the cotangent of an
    /// operand. When `like` has fewer batch dims than the product (a shared
    /// weight), the batch is summed away: by folding it into the contraction
    /// when the layout allows, else by a reduction.
    fn matmul_into(
        &mut self,
        a: ValueId,
        b: ValueId,
        ta: bool,
        tb: bool,
        like: ValueId,
        fp8: Option<(Fp8Format, Fp8Format)>,
    ) -> Result<ValueId> {
        let target = self.shape(like).to_vec();
        let (sa, sb) = (self.shape(a).to_vec(), self.shape(b).to_vec());
        let rank = sa.len().max(sb.len());
        if target.len() == rank {
            return self.matmul_marked(a, b, ta, tb, fp8);
        }
        // Both operands batched, result wanted 2-D. With the batch adjacent to
        // the contracted axis (`a` stored [.., k, m] and `b` [.., k, n]),
        // flattening the batch into k gives the sum directly.
        if ta && !tb && sa.len() == rank && sb.len() == rank {
            let fold = |s: &[usize]| -> Vec<usize> {
                let rows: usize = s[..s.len() - 1].iter().product();
                vec![rows, s[s.len() - 1]]
            };
            let a2 = self.reshape(a, &fold(&sa))?;
            let b2 = self.reshape(b, &fold(&sb))?;
            return self.matmul_marked(a2, b2, true, false, fp8);
        }
        let full = self.matmul_marked(a, b, ta, tb, fp8)?;
        self.sum_to(full, &target)
    }
}
