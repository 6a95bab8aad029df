//! Every op, defined once.
//!
//! Each op is a struct in one file of this module that implements [`OpDef`]:
//! its shape/dtype rule, its VJP rule (emitting backward ops through a
//! [`Builder`]), its CPU reference kernel, its lowering description (data for
//! later backends, never backend calls) and its attributes for printing and
//! parsing. The same file adds a typed helper to [`Builder`]. Adding an op
//! means one struct plus one line in [`op_list!`]; the exhaustive matches the
//! macro generates find every place that must know about it.

pub mod attention;
pub mod collective;
pub mod elementwise;
pub mod embedding;
pub mod loss;
pub mod matmul;
pub mod movement;
pub mod norm;
pub mod optim;
pub mod reduce;
pub mod rope;
pub mod softmax;

use std::collections::BTreeMap;
use std::fmt;

use crate::cpu::KernelIo;
use crate::error::{Error, Result};
use crate::ir::{Builder, DType, TensorType, ValueId};

/// An attribute value as it appears in a printed trace: `{eps=1e-6, axes=[1,2]}`.
#[derive(Clone, PartialEq, Debug)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    DType(DType),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(i) => write!(f, "{i}"),
            // `{:?}` prints the shortest text that parses back to the same f64
            // and always marks the number as a float ("1.0", "1e-6").
            Attr::Float(x) => write!(f, "{x:?}"),
            Attr::Bool(b) => write!(f, "{b}"),
            Attr::Ints(v) => {
                f.write_str("[")?;
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("]")
            }
            Attr::DType(d) => write!(f, "{d}"),
        }
    }
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

    pub fn ints(&mut self, key: &str) -> Result<Vec<i64>> {
        match self.take(key)? {
            Attr::Ints(v) => Ok(v),
            a => Err(self.wrong(key, "a list of integers", &a)),
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

/// How a backend realises an op. Data only: backends interpret it.
#[derive(Clone, PartialEq, Debug)]
pub enum Lowering {
    /// No kernel: the output is the input's storage seen with another shape.
    View,
    /// A constant fill of the output.
    Fill,
    /// A pointwise map with numpy broadcasting of the inputs to the output shape.
    Unary(UnaryFn),
    Binary(BinaryFn),
    /// A type conversion.
    Cast,
    /// A (batched) matrix product for the BLAS library.
    Gemm {
        trans_a: bool,
        trans_b: bool,
    },
    /// A hand-written kernel family, named by template.
    Kernel(&'static str),
    /// Communication between the ranks of a data-parallel step: one grouped
    /// call of the collective library (NCCL) over every tensor of the node,
    /// for a group of `world` ranks.
    Collective {
        kind: collective::CollectiveKind,
        world: usize,
    },
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

    fn lowering(&self) -> Lowering;

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
            pub fn lowering(&self) -> Lowering {
                match self { $(Op::$variant(o) => o.lowering()),* }
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
    };
}

op_list! {
    Full(elementwise::Full),
    Unary(elementwise::Unary),
    UnaryBackward(elementwise::UnaryBackward),
    Binary(elementwise::Binary),
    Cast(elementwise::Cast),
    Reduce(reduce::Reduce),
    MaxBackward(reduce::MaxBackward),
    Broadcast(movement::Broadcast),
    Reshape(movement::Reshape),
    Permute(movement::Permute),
    Slice(movement::Slice),
    SliceBackward(movement::SliceBackward),
    Concat(movement::Concat),
    MatMul(matmul::MatMul),
    RmsNorm(norm::RmsNorm),
    RmsNormBackward(norm::RmsNormBackward),
    LayerNorm(norm::LayerNorm),
    LayerNormBackward(norm::LayerNormBackward),
    Rope(rope::Rope),
    Softmax(softmax::Softmax),
    SoftmaxBackward(softmax::SoftmaxBackward),
    Attention(attention::Attention),
    AttentionBackward(attention::AttentionBackward),
    Embedding(embedding::Embedding),
    EmbeddingBackward(embedding::EmbeddingBackward),
    CrossEntropy(loss::CrossEntropy),
    CrossEntropyBackward(loss::CrossEntropyBackward),
    AdamW(optim::AdamW),
    // Collectives: inserted after autodiff by `dist::data_parallel`, no VJP.
    AllReduce(collective::AllReduce),
    ReduceScatter(collective::ReduceScatter),
    AllGather(collective::AllGather),
    LocalShard(collective::LocalShard),
}

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
    Err(Error::Autodiff(format!("`{name}` is a backward op; higher-order derivatives are not supported")))
}
