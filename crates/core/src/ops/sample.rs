//! Sample cases: what an op is tested on, declared next to the op
//! (Thunder's OpInfo is the model). A [`Sample`] is an op with its
//! attributes and, per input, how to draw it. The VJP checks, the CPU
//! in-place checks, the backends' lowering sweeps and the GPU tests all
//! iterate `Op::samples_by_op`, so a new op is tested everywhere by
//! declaring its cases once; an op without cases fails a test.
//!
//! Drawing the values lives with the test support
//! (`crate::testing::draw_sample`): from one seed, every dtype sees the same
//! f64 draws rounded to its type, so narrow runs compare with f64 runs.

use crate::ir::{DType, TensorType};

use super::Op;

/// How to draw one input of a sample.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// Standard normal floats of this type (differentiated in VJP checks).
    Normal(TensorType),
    /// Floats in [0.5, 2): for inputs defined on positive numbers (log,
    /// sqrt, a norm's rstd).
    Positive(TensorType),
    /// Integer ids in `[0, max)` (never differentiated).
    Ids { ty: TensorType, max: i64 },
    /// Fixed values (never differentiated): learning rates, step counts.
    Fixed(TensorType, Vec<f64>),
}

impl Input {
    /// The input's type.
    pub fn ty(&self) -> &TensorType {
        match self {
            Input::Normal(t) | Input::Positive(t) | Input::Fixed(t, _) => t,
            Input::Ids { ty, .. } => ty,
        }
    }

    /// Does a VJP check perturb this input?
    pub fn differentiable(&self) -> bool {
        matches!(self, Input::Normal(t) | Input::Positive(t) if t.dtype.is_float())
    }
}

/// One case of an op: the op (with its attributes) and its inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub op: Op,
    pub inputs: Vec<Input>,
}

impl Sample {
    pub fn new(op: impl Into<Op>, inputs: Vec<Input>) -> Self {
        Sample { op: op.into(), inputs }
    }

    /// The input types, in order.
    pub fn input_types(&self) -> Vec<TensorType> {
        self.inputs.iter().map(|i| i.ty().clone()).collect()
    }
}

/// The float dtypes samples are drawn in.
pub const FLOAT_DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// Shorthands for sample tables.
pub fn normal(dtype: DType, shape: &[usize]) -> Input {
    Input::Normal(TensorType::new(dtype, shape.to_vec()))
}

pub fn positive(dtype: DType, shape: &[usize]) -> Input {
    Input::Positive(TensorType::new(dtype, shape.to_vec()))
}

pub fn ids(dtype: DType, shape: &[usize], max: i64) -> Input {
    Input::Ids { ty: TensorType::new(dtype, shape.to_vec()), max }
}

pub fn fixed(dtype: DType, shape: &[usize], values: &[f64]) -> Input {
    Input::Fixed(TensorType::new(dtype, shape.to_vec()), values.to_vec())
}
