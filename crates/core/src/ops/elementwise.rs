//! Pointwise ops: constant fills, unary maps (and their one-kernel
//! backward), binary maps with numpy broadcasting, and dtype casts.

use num_traits::ToPrimitive;

use super::sample::{fixed, normal, positive, Sample, FLOAT_DTYPES};
use super::{expect_float, expect_inputs, no_vjp, Attr, Attrs, BinaryFn, OpDef, UnaryFn, VjpArgs};
use crate::error::Result;
use crate::ir::{Builder, DType, TensorType, ValueId};
use crate::ops::kernel::{c, par_chunks, Float, KernelIo, CHUNK};
use crate::with_float;

// ---------------------------------------------------------------- full

/// A tensor filled with one constant.
#[derive(Clone, PartialEq, Debug)]
pub struct Full {
    pub value: f64,
    pub ty: TensorType,
}

impl OpDef for Full {
    /// Every shape from a scalar to a multi-block fill, with signed zeros
    /// (+0.0 lowers to a memset, the rest to a fill kernel), values that
    /// round through f32 to the narrow types, infinity and NaN.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for value in [0.0, -0.0, 1.5, 1e-3, 0.1, -7.25e3, f64::INFINITY, f64::NAN] {
            for shape in [&[][..], &[1], &[17], &[3, 1031]] {
                v.push(Sample::new(Full { value, ty: TensorType::new(d, shape.to_vec()) }, vec![]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "full"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 0)?;
        expect_float(&self.ty, "full")?;
        Ok(vec![self.ty.clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        Ok(vec![])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        with_float!(self.ty.dtype, T => {
            io.output::<T>(0).fill(T::from_f64(self.value));
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![
            ("value", Attr::Float(self.value)),
            ("dtype", Attr::DType(self.ty.dtype)),
            ("shape", Attr::Ints(self.ty.shape.iter().map(|&d| d as i64).collect())),
        ]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "full")
            .then(|| Ok(Full { value: a.float("value")?, ty: TensorType::new(a.dtype("dtype")?, a.usizes("shape")?) }))
    }
}

// ---------------------------------------------------------------- unary

impl UnaryFn {
    pub fn name(self) -> &'static str {
        match self {
            UnaryFn::Neg => "neg",
            UnaryFn::Exp => "exp",
            UnaryFn::Log => "log",
            UnaryFn::Sqrt => "sqrt",
            UnaryFn::Rsqrt => "rsqrt",
            UnaryFn::Tanh => "tanh",
            UnaryFn::Sigmoid => "sigmoid",
            UnaryFn::Silu => "silu",
            UnaryFn::GeluTanh => "gelu_tanh",
            UnaryFn::GeluErf => "gelu_erf",
            UnaryFn::Pow(_) => "pow",
        }
    }

    /// The name of the op computing `g * f'(x)`.
    pub fn backward_name(self) -> &'static str {
        match self {
            UnaryFn::Neg => "neg_backward",
            UnaryFn::Exp => "exp_backward",
            UnaryFn::Log => "log_backward",
            UnaryFn::Sqrt => "sqrt_backward",
            UnaryFn::Rsqrt => "rsqrt_backward",
            UnaryFn::Tanh => "tanh_backward",
            UnaryFn::Sigmoid => "sigmoid_backward",
            UnaryFn::Silu => "silu_backward",
            UnaryFn::GeluTanh => "gelu_tanh_backward",
            UnaryFn::GeluErf => "gelu_erf_backward",
            UnaryFn::Pow(_) => "pow_backward",
        }
    }

    fn parse(name: &str, a: &mut Attrs) -> Option<Result<UnaryFn>> {
        Some(Ok(match name {
            "neg" => UnaryFn::Neg,
            "exp" => UnaryFn::Exp,
            "log" => UnaryFn::Log,
            "sqrt" => UnaryFn::Sqrt,
            "rsqrt" => UnaryFn::Rsqrt,
            "tanh" => UnaryFn::Tanh,
            "sigmoid" => UnaryFn::Sigmoid,
            "silu" => UnaryFn::Silu,
            "gelu_tanh" => UnaryFn::GeluTanh,
            "gelu_erf" => UnaryFn::GeluErf,
            "pow" => return Some(a.float("exponent").map(UnaryFn::Pow)),
            _ => return None,
        }))
    }

    fn attrs(self) -> Vec<(&'static str, Attr)> {
        match self {
            UnaryFn::Pow(p) => vec![("exponent", Attr::Float(p))],
            _ => vec![],
        }
    }

    /// f(x).
    pub fn eval<A: num_traits::Float + num_traits::FromPrimitive>(self, x: A) -> A {
        let one = A::one();
        let half: A = c(0.5);
        match self {
            UnaryFn::Neg => -x,
            UnaryFn::Exp => x.exp(),
            UnaryFn::Log => x.ln(),
            UnaryFn::Sqrt => x.sqrt(),
            UnaryFn::Rsqrt => one / x.sqrt(),
            UnaryFn::Tanh => x.tanh(),
            UnaryFn::Sigmoid => one / (one + (-x).exp()),
            UnaryFn::Silu => x / (one + (-x).exp()),
            UnaryFn::GeluTanh => half * x * (one + gelu_tanh_inner(x).tanh()),
            UnaryFn::GeluErf => half * x * (one + erf(x * c(std::f64::consts::FRAC_1_SQRT_2))),
            UnaryFn::Pow(p) => x.powf(c(p)),
        }
    }

    /// f'(x).
    pub fn derivative<A: num_traits::Float + num_traits::FromPrimitive>(self, x: A) -> A {
        let one = A::one();
        let half: A = c(0.5);
        match self {
            UnaryFn::Neg => -one,
            UnaryFn::Exp => x.exp(),
            UnaryFn::Log => one / x,
            UnaryFn::Sqrt => half / x.sqrt(),
            UnaryFn::Rsqrt => -half / (x * x.sqrt()),
            UnaryFn::Tanh => {
                let t = x.tanh();
                one - t * t
            }
            UnaryFn::Sigmoid => {
                let s = one / (one + (-x).exp());
                s * (one - s)
            }
            UnaryFn::Silu => {
                let s = one / (one + (-x).exp());
                s * (one + x * (one - s))
            }
            UnaryFn::GeluTanh => {
                let k: A = c((2.0 / std::f64::consts::PI).sqrt());
                let t = gelu_tanh_inner(x).tanh();
                let dinner = k * (one + c::<A>(3.0 * 0.044715) * x * x);
                half * (one + t) + half * x * (one - t * t) * dinner
            }
            UnaryFn::GeluErf => {
                let cdf = half * (one + erf(x * c(std::f64::consts::FRAC_1_SQRT_2)));
                let pdf = (-half * x * x).exp() * c(1.0 / (2.0 * std::f64::consts::PI).sqrt());
                cdf + x * pdf
            }
            UnaryFn::Pow(p) => c::<A>(p) * x.powf(c(p - 1.0)),
        }
    }
}

fn gelu_tanh_inner<A: num_traits::Float + num_traits::FromPrimitive>(x: A) -> A {
    c::<A>((2.0 / std::f64::consts::PI).sqrt()) * (x + c::<A>(0.044715) * x * x * x)
}

/// erf in the accumulator type (libm, computed in f64 so f32 and f64 agree to f32 rounding).
fn erf<A: num_traits::Float + num_traits::FromPrimitive>(x: A) -> A {
    c(libm::erf(x.to_f64().unwrap_or(f64::NAN)))
}

/// `y = f(x)` pointwise.
#[derive(Clone, PartialEq, Debug)]
pub struct Unary {
    pub f: UnaryFn,
}

impl OpDef for Unary {
    /// Every [`UnaryFn`] (positive inputs where the function needs them)
    /// on scalars, single elements, odd lengths and a multi-block tensor.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for (f, pos) in unary_fns() {
            for shape in POINTWISE_SHAPES {
                let x = if pos { positive(d, shape) } else { normal(d, shape) };
                v.push(Sample::new(Unary { f }, vec![x]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        self.f.name()
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        expect_float(inputs[0], "x")?;
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        Ok(vec![Some(b.push1(UnaryBackward { f: self.f }.into(), &[args.inputs[0], g])?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = io.out_ty(0).numel();
        let f = self.f;
        with_float!(io.out_ty(0).dtype, T => {
            let (x, y) = (io.input_ptr::<T>(0), io.output_ptr::<T>(0));
            par_chunks(n, CHUNK, |r| {
                for i in r {
                    // SAFETY: element i is read before it is written; chunks are disjoint.
                    unsafe { y.write(i, T::from_acc(f.eval(x.read(i).acc()))) }
                }
            });
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        self.f.attrs()
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        UnaryFn::parse(name, a).map(|r| r.map(|f| Unary { f }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0)]
    }
}

/// `gx = g * f'(x)` for a [`Unary`] op, in one kernel.
#[derive(Clone, PartialEq, Debug)]
pub struct UnaryBackward {
    pub f: UnaryFn,
}

impl OpDef for UnaryBackward {
    /// The shapes and functions of [`Unary`]'s samples, with a cotangent.
    fn samples(d: DType) -> Vec<Sample> {
        let mut v = Vec::new();
        for (f, pos) in unary_fns() {
            for shape in POINTWISE_SHAPES {
                let x = if pos { positive(d, shape) } else { normal(d, shape) };
                v.push(Sample::new(UnaryBackward { f }, vec![x, normal(d, shape)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        self.f.backward_name()
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        expect_float(inputs[0], "x")?;
        super::expect_same(inputs[0], inputs[1], "x and its cotangent")?;
        Ok(vec![inputs[0].clone()])
    }
    fn vjp(&self, _b: &mut Builder, _args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        no_vjp(self.name())
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = io.out_ty(0).numel();
        let f = self.f;
        with_float!(io.out_ty(0).dtype, T => {
            let (x, g, y) = (io.input_ptr::<T>(0), io.input_ptr::<T>(1), io.output_ptr::<T>(0));
            par_chunks(n, CHUNK, |r| {
                for i in r {
                    // SAFETY: element i of both inputs is read before element i is written.
                    unsafe {
                        let v = g.read(i).acc() * f.derivative(x.read(i).acc());
                        y.write(i, T::from_acc(v))
                    }
                }
            });
            Ok(())
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        self.f.attrs()
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        let f = UnaryFn::parse(name.strip_suffix("_backward")?, a)?;
        Some(f.map(|f| UnaryBackward { f }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 1)]
    }
}

// ---------------------------------------------------------------- binary

impl BinaryFn {
    pub fn name(self) -> &'static str {
        match self {
            BinaryFn::Add => "add",
            BinaryFn::Sub => "sub",
            BinaryFn::Mul => "mul",
            BinaryFn::Div => "div",
        }
    }

    #[inline]
    pub fn eval<A: num_traits::Float>(self, a: A, b: A) -> A {
        match self {
            BinaryFn::Add => a + b,
            BinaryFn::Sub => a - b,
            BinaryFn::Mul => a * b,
            BinaryFn::Div => a / b,
        }
    }
}

/// The numpy broadcast of two shapes, or `None` if they are incompatible.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Maps a flat index of the broadcast output to a flat index of one input.
pub(crate) struct BroadcastIndex {
    /// (output dim size, output stride, input stride) per output axis; input stride 0 where broadcast.
    axes: Vec<(usize, usize, usize)>,
    identity: bool,
    scalar: bool,
}

impl BroadcastIndex {
    pub(crate) fn new(input: &[usize], output: &[usize]) -> Self {
        let n = output.len();
        let mut axes = Vec::with_capacity(n);
        let (mut out_stride, mut in_stride) = (1usize, 1usize);
        for i in (0..n).rev() {
            let d_in = if i + input.len() >= n { input[i + input.len() - n] } else { 1 };
            axes.push((output[i], out_stride, if d_in == 1 { 0 } else { in_stride }));
            out_stride *= output[i];
            in_stride *= d_in;
        }
        BroadcastIndex { axes, identity: input == output, scalar: input.iter().product::<usize>() == 1 }
    }

    #[inline]
    pub(crate) fn map(&self, i: usize) -> usize {
        if self.identity {
            return i;
        }
        if self.scalar {
            return 0;
        }
        self.axes.iter().map(|&(size, os, is)| (i / os) % size * is).sum()
    }
}

/// `y = f(a, b)` with numpy broadcasting.
#[derive(Clone, PartialEq, Debug)]
pub struct Binary {
    pub f: BinaryFn,
}

impl OpDef for Binary {
    /// Every [`BinaryFn`] on equal shapes, trailing broadcasts either way,
    /// outer products, scalars against tensors, and rank 3 and 4 with
    /// broadcasts in the middle; divisors are positive.
    fn samples(d: DType) -> Vec<Sample> {
        let shapes: [(&[usize], &[usize]); 15] = [
            (&[], &[]),
            (&[2, 3], &[2, 3]),
            (&[1031], &[1031]),
            (&[4, 5], &[5]),
            (&[2, 3], &[3]),
            (&[5], &[4, 5]),
            (&[4, 1], &[1, 5]),
            (&[2, 3, 17], &[]),
            (&[], &[3]),
            (&[], &[2, 3]),
            (&[2, 1, 3], &[4, 1]),
            (&[7, 1, 9], &[1, 8, 1]),
            (&[2, 1, 3, 4], &[1, 5, 1, 4]),
            (&[6, 1, 33], &[6, 16, 33]),
            (&[5, 3], &[5, 3]),
        ];
        let mut v = Vec::new();
        for f in [BinaryFn::Add, BinaryFn::Sub, BinaryFn::Mul, BinaryFn::Div] {
            for (a, b) in shapes {
                let b = if f == BinaryFn::Div { positive(d, b) } else { normal(d, b) };
                v.push(Sample::new(Binary { f }, vec![normal(d, a), b]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        self.f.name()
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 2)?;
        expect_float(inputs[0], "a")?;
        if inputs[0].dtype != inputs[1].dtype {
            return Err(format!("dtypes differ: {} and {}", inputs[0].dtype, inputs[1].dtype));
        }
        let shape = broadcast_shapes(&inputs[0].shape, &inputs[1].shape)
            .ok_or_else(|| "shapes do not broadcast".to_string())?;
        Ok(vec![inputs[0].with_shape(shape)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None, None]) };
        let (x, y) = (args.inputs[0], args.inputs[1]);
        let (sx, sy) = (b.shape(x).to_vec(), b.shape(y).to_vec());
        let (gx, gy) = match self.f {
            BinaryFn::Add => (g, g),
            BinaryFn::Sub => (g, b.neg(g)?),
            BinaryFn::Mul => (b.mul(g, y)?, b.mul(g, x)?),
            BinaryFn::Div => {
                let gx = b.div(g, y)?;
                // d(x/y)/dy = -x/y² = -(x/y)/y, using the saved output.
                let q = b.div(args.outputs[0], y)?;
                let gq = b.mul(g, q)?;
                (gx, b.neg(gq)?)
            }
        };
        Ok(vec![Some(b.sum_to(gx, &sx)?), Some(b.sum_to(gy, &sy)?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let out = io.out_ty(0).shape.clone();
        let ia = BroadcastIndex::new(&io.in_ty(0).shape, &out);
        let ib = BroadcastIndex::new(&io.in_ty(1).shape, &out);
        let n = io.out_ty(0).numel();
        let f = self.f;
        with_float!(io.out_ty(0).dtype, T => {
            let (a, b, y) = (io.input_ptr::<T>(0), io.input_ptr::<T>(1), io.output_ptr::<T>(0));
            par_chunks(n, CHUNK, |r| {
                for i in r {
                    // SAFETY: an aliased input has the output's shape, so element i
                    // is read before element i is written; chunks are disjoint.
                    unsafe {
                        let v = f.eval(a.read(ia.map(i)).acc(), b.read(ib.map(i)).acc());
                        y.write(i, T::from_acc(v))
                    }
                }
            });
            Ok(())
        })
    }
    fn parse(name: &str, _a: &mut Attrs) -> Option<Result<Self>> {
        let f = match name {
            "add" => BinaryFn::Add,
            "sub" => BinaryFn::Sub,
            "mul" => BinaryFn::Mul,
            "div" => BinaryFn::Div,
            _ => return None,
        };
        Some(Ok(Binary { f }))
    }
    fn inplace(&self) -> Vec<(usize, usize)> {
        vec![(0, 0), (0, 1)]
    }
}

// ---------------------------------------------------------------- cast

/// Converts between float dtypes (round to nearest even when narrowing).
#[derive(Clone, PartialEq, Debug)]
pub struct Cast {
    pub dtype: DType,
}

impl OpDef for Cast {
    /// From `d` to every float dtype: random values of a few shapes, and
    /// special values: rounding ties of bf16 and f16 (and f64 values just
    /// off an f32 tie, which f64 -> f32 -> bf16 rounds twice), f16 overflow
    /// and subnormals, f32 overflow, signed zero, infinities and NaN.
    fn samples(d: DType) -> Vec<Sample> {
        let special = [
            0.0,
            -0.0,
            1.0,
            1.00390625,
            1.01171875,
            1.0 + 2f64.powi(-11),
            1.0 + 3.0 * 2f64.powi(-11),
            1.0 + 2f64.powi(-24),
            1.0 + 2f64.powi(-24) + 2f64.powi(-40),
            1.00390625 + 2f64.powi(-30),
            65504.0,
            65520.0,
            1e5,
            6e-8,
            1e-8,
            1e-40,
            3.4e38,
            1e39,
            -2.5e-3,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
        ];
        let mut v = Vec::new();
        for to in FLOAT_DTYPES {
            v.push(Sample::new(Cast { dtype: to }, vec![fixed(d, &[special.len()], &special)]));
            for shape in [&[][..], &[3], &[4], &[17, 61]] {
                v.push(Sample::new(Cast { dtype: to }, vec![normal(d, shape)]));
            }
        }
        v
    }
    fn name(&self) -> &'static str {
        "cast"
    }
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
        expect_inputs(inputs, 1)?;
        expect_float(inputs[0], "x")?;
        if !self.dtype.is_float() {
            return Err(format!("can only cast to a float dtype, not {}", self.dtype));
        }
        Ok(vec![inputs[0].with_dtype(self.dtype)])
    }
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
        let Some(g) = args.cotangents[0] else { return Ok(vec![None]) };
        let dt = b.dtype(args.inputs[0]);
        Ok(vec![Some(b.cast(g, dt)?)])
    }
    fn cpu(&self, io: &KernelIo) -> Result<()> {
        let n = io.out_ty(0).numel();
        with_float!(io.in_ty(0).dtype, S => {
            let x = io.input::<S>(0);
            with_float!(self.dtype, D => {
                let y = io.output::<D>(0);
                for i in 0..n {
                    // Through f64: exact for every source type, one rounding to the target.
                    let v = x[i].acc().to_f64().unwrap_or(f64::NAN);
                    y[i] = D::from_f64(v);
                }
                Ok(())
            })
        })
    }
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        vec![("dtype", Attr::DType(self.dtype))]
    }
    fn parse(name: &str, a: &mut Attrs) -> Option<Result<Self>> {
        (name == "cast").then(|| Ok(Cast { dtype: a.dtype("dtype")? }))
    }
}

// ---------------------------------------------------------------- builder helpers

impl Builder {
    pub fn full(&mut self, value: f64, ty: TensorType) -> Result<ValueId> {
        self.push1(Full { value, ty }.into(), &[])
    }
    pub fn unary(&mut self, f: UnaryFn, x: ValueId) -> Result<ValueId> {
        self.push1(Unary { f }.into(), &[x])
    }
    pub fn neg(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryFn::Neg, x)
    }
    pub fn binary(&mut self, f: BinaryFn, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.push1(Binary { f }.into(), &[a, b])
    }
    pub fn add(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryFn::Add, a, b)
    }
    pub fn sub(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryFn::Sub, a, b)
    }
    pub fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryFn::Mul, a, b)
    }
    pub fn div(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryFn::Div, a, b)
    }
    pub fn cast(&mut self, x: ValueId, dtype: DType) -> Result<ValueId> {
        if self.dtype(x) == dtype {
            return Ok(x);
        }
        self.push1(Cast { dtype }.into(), &[x])
    }
}

/// The shapes of the pointwise samples: a scalar, one element, odd
/// lengths, a matrix and a tensor of several blocks.
const POINTWISE_SHAPES: [&[usize]; 6] = [&[], &[1], &[3], &[3, 4], &[17], &[5, 211]];

/// Every [`UnaryFn`] sampled, with whether it needs positive inputs.
fn unary_fns() -> [(UnaryFn, bool); 15] {
    [
        (UnaryFn::Neg, false),
        (UnaryFn::Exp, false),
        (UnaryFn::Log, true),
        (UnaryFn::Sqrt, true),
        (UnaryFn::Rsqrt, true),
        (UnaryFn::Tanh, false),
        (UnaryFn::Sigmoid, false),
        (UnaryFn::Silu, false),
        (UnaryFn::GeluTanh, false),
        (UnaryFn::GeluErf, false),
        (UnaryFn::Pow(2.0), false),
        (UnaryFn::Pow(3.0), false),
        (UnaryFn::Pow(0.5), true),
        (UnaryFn::Pow(-0.5), true),
        (UnaryFn::Pow(-1.5), true),
    ]
}
