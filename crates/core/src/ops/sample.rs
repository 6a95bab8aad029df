//! Sample cases: what an op is tested on, declared next to the op
//! (Thunder's OpInfo is the model). A [`Sample`] is an op with its
//! attributes and, per input, how to draw it. The VJP checks, the CPU
//! in-place checks, the backends' lowering sweeps and the GPU tests all
//! iterate `samples_by_op`, so a new op is tested everywhere by declaring
//! its cases once; an op without cases fails a test.
//!
//! Drawing the values lives with the test support
//! (`crate::testing::draw_sample`): from one seed, every dtype sees the same
//! f64 draws rounded to its type, so narrow runs compare with f64 runs.
//!
//! **Invariants of a table:** `samples(dtype)` lists the same cases in the
//! same order for every float dtype (only the float types differ), so the
//! i-th sample of a narrow dtype is the i-th of f64; integer and bool
//! variants of dtype-agnostic ops (movement copies bits) are listed once,
//! under f32, after the float cases. Inputs that a real program computes
//! (a norm's statistics, a forward's log-sum-exp) are [`Input::Output`]s,
//! so backward ops see consistent values.

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
    /// Small integers in `[-2, 2]` as floats: groups full of ties (for a max).
    Ties(TensorType),
    /// Output `output` of `op` run on the CPU on `args`, each drawn like an
    /// input (`Earlier` reads an input of this sample): the statistics and
    /// forward results a backward op takes (never differentiated).
    Output { ty: TensorType, op: Op, args: Vec<Input>, output: usize },
    /// This sample's input `index` (an earlier one); only inside `Output`'s args.
    Earlier { ty: TensorType, index: usize },
}

impl Input {
    /// The input's type.
    pub fn ty(&self) -> &TensorType {
        match self {
            Input::Normal(t) | Input::Positive(t) | Input::Fixed(t, _) | Input::Ties(t) => t,
            Input::Ids { ty, .. } | Input::Output { ty, .. } | Input::Earlier { ty, .. } => ty,
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
    /// Too big for the CPU test suite (a 2-core CI machine): run only by
    /// backends' sweeps (the GPU tests), which compare it with the CPU.
    pub large: bool,
}

impl Sample {
    pub fn new(op: impl Into<Op>, inputs: Vec<Input>) -> Self {
        Sample { op: op.into(), inputs, large: false }
    }

    /// The input types, in order.
    pub fn input_types(&self) -> Vec<TensorType> {
        self.inputs.iter().map(|i| i.ty().clone()).collect()
    }

    /// Marks the sample as too big for the CPU test suite.
    pub fn large(mut self) -> Self {
        self.large = true;
        self
    }

    /// Marks the sample large when it has more than `n` elements in all.
    pub fn large_over(self, n: usize) -> Self {
        let total: usize = self.inputs.iter().map(|i| i.ty().numel()).sum();
        if total > n {
            self.large()
        } else {
            self
        }
    }

    /// An argument for [`Sample::with_output`]: this sample's input `i`.
    pub fn earlier(&self, i: usize) -> Input {
        Input::Earlier { ty: self.inputs[i].ty().clone(), index: i }
    }

    /// Appends output `output` of `op` on `args` as the next input.
    ///
    /// # Panics
    /// If `op` rejects the argument types: a sample table is wrong.
    pub fn with_output(mut self, op: impl Into<Op>, args: Vec<Input>, output: usize) -> Self {
        self.inputs.push(output_of(op, args, output));
        self
    }

    /// Appends an input.
    pub fn with(mut self, input: Input) -> Self {
        self.inputs.push(input);
        self
    }

    /// The same case for `op`, a form of this sample's op that takes one
    /// more input, `input`, at position `at` (later inputs move up by one).
    ///
    /// # Panics
    /// If a later input reads an input at or after `at` (its index would move).
    pub fn with_input_at(mut self, at: usize, input: Input, op: impl Into<Op>) -> Self {
        for later in &self.inputs[at.min(self.inputs.len())..] {
            if let Input::Output { args, .. } = later {
                let moved = args.iter().any(|a| matches!(a, Input::Earlier { index, .. } if *index >= at));
                assert!(!moved, "sample table: an input after {at} reads one that moves");
            }
        }
        self.inputs.insert(at, input);
        self.op = op.into();
        self
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

/// A one-element tensor holding `value`.
pub fn scalar(dtype: DType, value: f64) -> Input {
    Input::Fixed(TensorType::scalar(dtype), vec![value])
}

/// Zeros of this type.
pub fn zeros(dtype: DType, shape: &[usize]) -> Input {
    let ty = TensorType::new(dtype, shape.to_vec());
    Input::Fixed(ty.clone(), vec![0.0; ty.numel()])
}

pub fn ties(dtype: DType, shape: &[usize]) -> Input {
    Input::Ties(TensorType::new(dtype, shape.to_vec()))
}

/// Output `output` of `op` on `args` (see [`Input::Output`]).
///
/// # Panics
/// If `op` rejects the argument types: a sample table is wrong.
pub fn output_of(op: impl Into<Op>, args: Vec<Input>, output: usize) -> Input {
    let op = op.into();
    let types: Vec<&TensorType> = args.iter().map(Input::ty).collect();
    let outs = op.infer(&types).unwrap_or_else(|e| panic!("sample table: `{}` on {types:?}: {e}", op.name()));
    Input::Output { ty: outs[output].clone(), op, args, output }
}
