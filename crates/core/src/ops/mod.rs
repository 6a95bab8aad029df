//! Every op, defined once.
//!
//! Each op is a struct in one file of this module that implements [`OpDef`]:
//! its shape/dtype rule, its VJP rule (emitting backward ops through a
//! [`Builder`]), its CPU reference kernel, its sample cases (what every
//! backend's tests run it on) and its attributes for printing and parsing.
//! The same file adds a typed helper to [`Builder`]. Adding an op means one
//! struct plus one line in [`for_each_op!`](crate::for_each_op); the exhaustive matches generated
//! from that list, here and in each backend, find every place that must know
//! about it (`docs/architecture.md` lists the steps).
//!
//! The CPU kernels are written against [`kernel`] (the buffers of one call,
//! the storage types, the communicator of a collective) and matrix
//! products against [`gemm`]; both live here, so the ops depend on nothing
//! of the CPU backend ([`crate::cpu`] runs the kernels and depends on the
//! ops). The ops and the IR ([`crate::ir`]) do depend on each other, by
//! design: a node holds an [`Op`], and an op's rules (its shape rule, its
//! VJP through the [`Builder`], its printed attributes) sit next to the op
//! rather than in an IR-wide `match` over every op.

pub mod adamw8;
pub mod attention;
pub mod collective;
pub mod decode;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod fp8;
pub mod gemm;
pub mod glu;
pub mod kernel;
pub mod linear_ce;
pub mod loss;
pub mod matmul;
pub mod moe;
pub mod movement;
pub mod nf4;
pub mod norm;
pub mod offload;
pub mod optim;
pub mod reduce;
pub mod rope;
pub mod sample;
pub mod softmax;

use std::collections::BTreeMap;
use std::fmt;

use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};
use kernel::KernelIo;
pub use sample::{Input, Sample};

/// An attribute value as it appears in a printed trace: `{eps=1e-6, axes=[1,2]}`.
#[derive(Clone, PartialEq, Debug)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    DType(DType),
}

impl Attr {
    /// The attributes of a flag that is printed only when set (read back by
    /// [`Attrs::opt_bool`]): `key=true`, or nothing.
    pub fn flag(key: &'static str, on: bool) -> Vec<(&'static str, Attr)> {
        if on {
            vec![(key, Attr::Bool(true))]
        } else {
            Vec::new()
        }
    }
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(i) => write!(f, "{i}"),
            // `{:?}` prints the shortest text that parses back to the same f64
            // and always marks the number as a float ("1.0", "1e-6").
            Attr::Float(x) => write!(f, "{x:?}"),
            Attr::Bool(b) => write!(f, "{b}"),
            Attr::Ints(v) => write_list(f, v, |f, x| write!(f, "{x}")),
            // Each number as `Float` prints it, so the list never reads
            // back as integers.
            Attr::Floats(v) => write_list(f, v, |f, x| write!(f, "{x:?}")),
            Attr::DType(d) => write!(f, "{d}"),
        }
    }
}

/// `[a,b,c]`, each item written by `item`.
fn write_list<T>(
    f: &mut fmt::Formatter<'_>,
    items: &[T],
    item: impl Fn(&mut fmt::Formatter<'_>, &T) -> fmt::Result,
) -> fmt::Result {
    f.write_str("[")?;
    for (i, x) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(",")?;
        }
        item(f, x)?;
    }
    f.write_str("]")
}

/// Attributes parsed from a trace line, consumed by an op's `parse`.
/// Reading an attribute removes it, so leftovers can be reported as unknown.
#[derive(Clone, Debug, Default)]
pub struct Attrs {
    pub op: String,
    pub map: BTreeMap<String, Attr>,
}

impl Attrs {
    fn take(&mut self, key: &str) -> Result<Attr> {
        self.map.remove(key).ok_or_else(|| Error::op(&self.op, format!("missing attribute `{key}`")))
    }

    fn wrong(&self, key: &str, want: &str, got: &Attr) -> Error {
        Error::op(&self.op, format!("attribute `{key}` must be {want}, got `{got}`"))
    }

    pub fn float(&mut self, key: &str) -> Result<f64> {
        match self.take(key)? {
            Attr::Float(x) => Ok(x),
            Attr::Int(i) => Ok(i as f64),
            a => Err(self.wrong(key, "a number", &a)),
        }
    }

    pub fn int(&mut self, key: &str) -> Result<i64> {
        match self.take(key)? {
            Attr::Int(i) => Ok(i),
            a => Err(self.wrong(key, "an integer", &a)),
        }
    }

    pub fn usize(&mut self, key: &str) -> Result<usize> {
        let i = self.int(key)?;
        usize::try_from(i).map_err(|_| self.wrong(key, "non-negative", &Attr::Int(i)))
    }

    pub fn bool(&mut self, key: &str) -> Result<bool> {
        match self.take(key)? {
            Attr::Bool(b) => Ok(b),
            a => Err(self.wrong(key, "true or false", &a)),
        }
    }

    /// A flag that is printed only when set: `None` when absent.
    pub fn opt_bool(&mut self, key: &str) -> Result<Option<bool>> {
        if !self.map.contains_key(key) {
            return Ok(None);
        }
        self.bool(key).map(Some)
    }

    /// A list of integers printed only when present: `None` when absent.
    pub fn opt_ints(&mut self, key: &str) -> Result<Option<Vec<i64>>> {
        if !self.map.contains_key(key) {
            return Ok(None);
        }
        self.ints(key).map(Some)
    }

    pub fn ints(&mut self, key: &str) -> Result<Vec<i64>> {
        match self.take(key)? {
            Attr::Ints(v) => Ok(v),
            a => Err(self.wrong(key, "a list of integers", &a)),
        }
    }

    /// A list of numbers (integers read as numbers too).
    pub fn floats(&mut self, key: &str) -> Result<Vec<f64>> {
        match self.take(key)? {
            Attr::Floats(v) => Ok(v),
            Attr::Ints(v) => Ok(v.into_iter().map(|i| i as f64).collect()),
            a => Err(self.wrong(key, "a list of numbers", &a)),
        }
    }

    pub fn usizes(&mut self, key: &str) -> Result<Vec<usize>> {
        let v = self.ints(key)?;
        v.iter().map(|&i| usize::try_from(i).map_err(|_| self.wrong(key, "non-negative", &Attr::Int(i)))).collect()
    }

    pub fn dtype(&mut self, key: &str) -> Result<DType> {
        match self.take(key)? {
            Attr::DType(d) => Ok(d),
            a => Err(self.wrong(key, "a dtype", &a)),
        }
    }

    /// Fails if any attribute was not consumed by the op's parser.
    pub fn finish(&self) -> Result<()> {
        match self.map.keys().next() {
            Some(k) => Err(Error::op(&self.op, format!("unknown attribute `{k}`"))),
            None => Ok(()),
        }
    }
}

/// The values a VJP rule sees: the node's inputs and outputs and the
/// cotangents of its outputs (`None` where no gradient flows).
pub struct VjpArgs<'a> {
    pub inputs: &'a [ValueId],
    pub outputs: &'a [ValueId],
    pub cotangents: &'a [Option<ValueId>],
}

/// Pointwise functions, shared by elementwise ops and their lowering.
#[derive(Copy, Clone, PartialEq, Debug)]
pub enum UnaryFn {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Tanh,
    Sigmoid,
    Silu,
    GeluTanh,
    GeluErf,
    /// `x^p` for a constant exponent.
    Pow(f64),
}

#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum BinaryFn {
    Add,
    Sub,
    Mul,
    Div,
}

/// What every op defines. See the module doc.
pub trait OpDef: Sized + Clone + PartialEq + fmt::Debug {
    /// The name printed in traces.
    fn name(&self) -> &'static str;

    /// The shape/dtype rule: output types from input types, or why not.
    fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String>;

    /// The VJP rule: one cotangent per input (`None` for non-differentiable
    /// inputs or where none flows), built from the output cotangents.
    fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>>;

    /// The CPU reference kernel.
    fn cpu(&self, io: &KernelIo) -> Result<()>;

    /// The op's sample cases in the float dtype `dtype` (Thunder's OpInfo):
    /// every attribute and shape the op must handle, with how to draw each
    /// input. Every test of every backend iterates these; an op that returns
    /// none for every dtype fails `every_op_has_samples`. An op may return
    /// none for a dtype it does not support.
    fn samples(dtype: DType) -> Vec<Sample>;

    /// Attributes in print order.
    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        Vec::new()
    }

    /// Parse an op called `name` from its attributes, or `None` if `name` is not this op.
    fn parse(name: &str, attrs: &mut Attrs) -> Option<Result<Self>>;

    /// `(output, input)` pairs whose storage may be shared: the kernel is
    /// written so that it is correct when they alias.
    fn inplace(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }

    /// `Some(i)` when output 0 is input `i`'s storage (a view: no kernel runs).
    fn view_of(&self) -> Option<usize> {
        None
    }

    /// Whether every backend's kernels read this op's inputs at any
    /// 16-byte boundary, not only where the arena places values (256
    /// bytes): a slice at such a boundary that only ops like this read can
    /// then be a view ([`crate::passes::slice_views`]).
    fn reads_16_byte_aligned_inputs(&self) -> bool {
        false
    }

    /// Where a view's output starts in its input's storage (bytes, given the
    /// input's type); 0 for views of the whole input.
    fn view_offset(&self, _input: &TensorType) -> u64 {
        0
    }

    /// The op that also adds a tensor of type `addend` to its output
    /// `output` inside its own kernel, before that output's one rounding to
    /// storage, and the input position the addend takes (the inputs after
    /// it move up by one); `None` when it has no such form for these input
    /// types. What the epilogue pass ([`crate::passes::fusion`]) folds `add` nodes
    /// into. The op it returns must declare the addend as an in-place input
    /// of `output` when their types match, so that the result can take the
    /// addend's storage, as the `add` could.
    fn with_addend(&self, _output: usize, _inputs: &[&TensorType], _addend: &TensorType) -> Option<(Self, usize)> {
        None
    }

    /// The op that reads its input `input` multiplied by a one-element
    /// tensor of type `scale` (the product rounded to the input's storage
    /// type, exactly what a `mul` node before it would store), and the
    /// position the scale takes among the inputs; `None` when it has no such
    /// form. What the epilogue pass folds `mul` nodes into (gradient
    /// clipping's factor into AdamW).
    fn with_input_scale(&self, _input: usize, _inputs: &[&TensorType], _scale: &TensorType) -> Option<(Self, usize)> {
        None
    }

    /// Whether output 0 lives in page-locked host memory
    /// ([`crate::plan::Region::Host`]) instead of the device's: only a copy
    /// to the host ([`offload::HostCopy`]).
    fn output_on_host(&self) -> bool {
        false
    }
}

/// The op list, written once. `for_each_op!(callback)` expands to
/// `callback! { Variant(path::To::OpStruct), ... }` with every op in list
/// order, so that this crate ([`Op`] and its dispatch) and the backends
/// (their exhaustive lowering dispatch) are generated from the same list:
/// an op a backend does not lower is a compile error there.
#[macro_export]
macro_rules! for_each_op {
    ($callback:ident) => {
        $callback! {
            Full($crate::ops::elementwise::Full),
            Unary($crate::ops::elementwise::Unary),
            UnaryBackward($crate::ops::elementwise::UnaryBackward),
            Binary($crate::ops::elementwise::Binary),
            Cast($crate::ops::elementwise::Cast),
            Reduce($crate::ops::reduce::Reduce),
            MaxBackward($crate::ops::reduce::MaxBackward),
            SquaredNorms($crate::ops::reduce::SquaredNorms),
            Broadcast($crate::ops::movement::Broadcast),
            Reshape($crate::ops::movement::Reshape),
            Permute($crate::ops::movement::Permute),
            Slice($crate::ops::movement::Slice),
            SliceBackward($crate::ops::movement::SliceBackward),
            Concat($crate::ops::movement::Concat),
            MatMul($crate::ops::matmul::MatMul),
            SplitTf32($crate::ops::matmul::SplitTf32),
            // FP8 products: inserted after autodiff by `passes::fp8`, no VJP.
            Fp8Scale($crate::ops::fp8::Fp8Scale),
            Fp8Quantize($crate::ops::fp8::Fp8Quantize),
            MatMulFp8($crate::ops::fp8::MatMulFp8),
            RmsNorm($crate::ops::norm::RmsNorm),
            RmsNormBackward($crate::ops::norm::RmsNormBackward),
            LayerNorm($crate::ops::norm::LayerNorm),
            LayerNormBackward($crate::ops::norm::LayerNormBackward),
            Rope($crate::ops::rope::Rope),
            Softmax($crate::ops::softmax::Softmax),
            SoftmaxBackward($crate::ops::softmax::SoftmaxBackward),
            Attention($crate::ops::attention::Attention),
            AttentionBackward($crate::ops::attention::AttentionBackward),
            Embedding($crate::ops::embedding::Embedding),
            EmbeddingBackward($crate::ops::embedding::EmbeddingBackward),
            CrossEntropy($crate::ops::loss::CrossEntropy),
            CrossEntropyBackward($crate::ops::loss::CrossEntropyBackward),
            LinearCrossEntropy($crate::ops::linear_ce::LinearCrossEntropy),
            LinearCrossEntropyBackward($crate::ops::linear_ce::LinearCrossEntropyBackward),
            Glu($crate::ops::glu::Glu),
            GluBackward($crate::ops::glu::GluBackward),
            // Mixture-of-experts routing and grouped products.
            TopK($crate::ops::moe::TopK),
            TopKBackward($crate::ops::moe::TopKBackward),
            ExpertSort($crate::ops::moe::ExpertSort),
            GroupedMatmul($crate::ops::moe::GroupedMatmul),
            GroupedMatmulWeightGrad($crate::ops::moe::GroupedMatmulWeightGrad),
            Dropout($crate::ops::dropout::Dropout),
            // Frozen NF4 weights: no gradient flows into the codes.
            DequantizeNf4($crate::ops::nf4::DequantizeNf4),
            // Offload: inserted after autodiff by `passes::offload`.
            HostCopy($crate::ops::offload::HostCopy),
            AdamW($crate::ops::optim::AdamW),
            AdamW8bit($crate::ops::adamw8::AdamW8bit),
            // Generation: no VJP.
            KvWrite($crate::ops::decode::KvWrite),
            CachedAttention($crate::ops::decode::CachedAttention),
            SampleNext($crate::ops::decode::SampleNext),
            // Collectives: inserted after autodiff by `dist::data_parallel`, no VJP.
            AllReduce($crate::ops::collective::AllReduce),
            ReduceScatter($crate::ops::collective::ReduceScatter),
            AllGather($crate::ops::collective::AllGather),
            LocalShard($crate::ops::collective::LocalShard),
        }
    };
}

/// Declares the op list once and generates [`Op`] with its dispatch.
macro_rules! op_list {
    ($($variant:ident($ty:path)),* $(,)?) => {
        /// Every op of the IR.
        #[derive(Clone, PartialEq, Debug)]
        pub enum Op { $($variant($ty)),* }

        $(impl From<$ty> for Op {
            fn from(op: $ty) -> Op { Op::$variant(op) }
        })*

        impl Op {
            pub fn name(&self) -> &'static str {
                match self { $(Op::$variant(o) => o.name()),* }
            }
            pub fn infer(&self, inputs: &[&TensorType]) -> std::result::Result<Vec<TensorType>, String> {
                match self { $(Op::$variant(o) => o.infer(inputs)),* }
            }
            pub fn vjp(&self, b: &mut Builder, args: &VjpArgs) -> Result<Vec<Option<ValueId>>> {
                match self { $(Op::$variant(o) => o.vjp(b, args)),* }
            }
            pub fn cpu(&self, io: &KernelIo) -> Result<()> {
                match self { $(Op::$variant(o) => o.cpu(io)),* }
            }
            pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
                match self { $(Op::$variant(o) => o.attrs()),* }
            }
            pub fn inplace(&self) -> Vec<(usize, usize)> {
                match self { $(Op::$variant(o) => o.inplace()),* }
            }
            pub fn view_of(&self) -> Option<usize> {
                match self { $(Op::$variant(o) => o.view_of()),* }
            }
            pub fn reads_16_byte_aligned_inputs(&self) -> bool {
                match self { $(Op::$variant(o) => o.reads_16_byte_aligned_inputs()),* }
            }
            pub fn output_on_host(&self) -> bool {
                match self { $(Op::$variant(o) => o.output_on_host()),* }
            }
            pub fn view_offset(&self, input: &TensorType) -> u64 {
                match self { $(Op::$variant(o) => o.view_offset(input)),* }
            }
            pub fn with_input_scale(&self, input: usize, inputs: &[&TensorType], scale: &TensorType) -> Option<(Op, usize)> {
                match self { $(Op::$variant(o) => o.with_input_scale(input, inputs, scale).map(|(op, at)| (Op::from(op), at))),* }
            }
            pub fn with_addend(&self, output: usize, inputs: &[&TensorType], addend: &TensorType) -> Option<(Op, usize)> {
                match self { $(Op::$variant(o) => o.with_addend(output, inputs, addend).map(|(op, at)| (Op::from(op), at))),* }
            }
            /// Parse an op from its printed name and attributes.
            pub fn parse(name: &str, mut attrs: Attrs) -> Result<Op> {
                attrs.op = name.to_string();
                $(if let Some(r) = <$ty as OpDef>::parse(name, &mut attrs) {
                    let op = Op::$variant(r?);
                    attrs.finish()?;
                    return Ok(op);
                })*
                Err(Error::op(name, "no such op"))
            }
        }

        /// Every op's sample cases in `dtype`, op by op, each under the
        /// name of its variant in the op list (so an op without cases
        /// shows up as an empty list, not as nothing).
        pub fn samples_by_op(dtype: DType) -> Vec<(&'static str, Vec<Sample>)> {
            vec![$((stringify!($variant), <$ty as OpDef>::samples(dtype))),*]
        }

        /// The variant name of every op in the op list.
        pub const OP_VARIANTS: &[&str] = &[$(stringify!($variant)),*];
    };
}

for_each_op!(op_list);

/// The dtype of statistics kept beside float data (rstd, mean, log-sum-exp,
/// a loss): f64 for f64 data, else f32, the accumulator type of the data, so
/// kernels store statistics without another rounding and narrow data loses
/// nothing in them.
pub fn stat_dtype(data: DType) -> DType {
    if data == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Shared checks for shape rules.
pub(crate) fn expect_inputs(inputs: &[&TensorType], n: usize) -> std::result::Result<(), String> {
    if inputs.len() != n {
        return Err(format!("expects {n} inputs, got {}", inputs.len()));
    }
    Ok(())
}

pub(crate) fn expect_float(t: &TensorType, what: &str) -> std::result::Result<(), String> {
    if !t.dtype.is_float() {
        return Err(format!("{what} must be a float tensor, got {t}"));
    }
    Ok(())
}

pub(crate) fn expect_same(a: &TensorType, b: &TensorType, what: &str) -> std::result::Result<(), String> {
    if a != b {
        return Err(format!("{what}: {a} and {b} must have the same type"));
    }
    Ok(())
}

/// Errors for backward-only ops, which are never differentiated again.
pub(crate) fn no_vjp(name: &str) -> Result<Vec<Option<ValueId>>> {
    Err(Error::NotDifferentiable {
        op: name.to_string(),
        reason: "is a backward op; higher-order derivatives are not supported".into(),
    })
}
