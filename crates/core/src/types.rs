//! Element types and tensor types: the vocabulary the IR, the ops and host
//! tensors share. It depends on nothing else in the crate, so host tensors
//! ([`crate::host`]) can use it without the IR; [`crate::ir`] re-exports it.

use std::fmt;

/// Element types. `F64` exists for finite-difference checks on the CPU backend.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, serde::Serialize)]
pub enum DType {
    F32,
    BF16,
    F16,
    F64,
    I32,
    I64,
    Bool,
}

impl DType {
    pub const ALL: [DType; 7] = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64, DType::Bool];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16 | DType::F64)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The most bytes one value may span (1 EiB, 2^60): what one memory plan
/// can hold in all ([`crate::plan::MAX_PLAN_BYTES`]). The builder and the
/// verifier refuse larger values, so sizes derived from a value's
/// dimensions never overflow.
pub const MAX_VALUE_BYTES: u64 = 1 << 60;

/// A dtype and a static shape. A scalar has an empty shape.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Vec<usize>>) -> Self {
        TensorType { dtype, shape: shape.into() }
    }

    pub fn scalar(dtype: DType) -> Self {
        TensorType { dtype, shape: vec![] }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The element count, or `None` when it passes `usize` (a shape with a
    /// zero dimension has 0 elements, whatever the others are).
    pub fn checked_numel(&self) -> Option<usize> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        self.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// The bytes, or `None` when they pass `u64`.
    pub fn checked_bytes(&self) -> Option<u64> {
        u64::try_from(self.checked_numel()?).ok()?.checked_mul(self.dtype.size() as u64)
    }

    /// The element count. Exact for every value of a trace (see
    /// [`TensorType::check_size`]); for a type that no trace can hold it
    /// saturates at `usize::MAX` instead of wrapping.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }

    /// The bytes. Exact for every value of a trace; for a type that no
    /// trace can hold it saturates at `u64::MAX` instead of wrapping.
    pub fn bytes(&self) -> u64 {
        self.checked_bytes().unwrap_or(u64::MAX)
    }

    /// Whether a value may have this type: its dimensions, each zero
    /// counted as one, times the element size, are at most
    /// [`MAX_VALUE_BYTES`]. Every partial product of the dimensions (a row,
    /// a stride, a kernel's loop bound) is then at most that too. The error
    /// says by how much it is too large.
    pub fn check_size(&self) -> std::result::Result<(), String> {
        let extent = self
            .shape
            .iter()
            .try_fold(self.dtype.size() as u64, |acc, &d| acc.checked_mul(u64::try_from(d.max(1)).ok()?));
        match extent {
            Some(bytes) if bytes <= MAX_VALUE_BYTES => Ok(()),
            _ if self.checked_numel() == Some(0) => Err(format!(
                "{self}: its nonzero dimensions multiply past {MAX_VALUE_BYTES} bytes (2^60), the most one value may span"
            )),
            Some(bytes) => Err(format!(
                "{self} has {bytes} bytes, more than {MAX_VALUE_BYTES} (2^60), the most one plan can hold"
            )),
            None => Err(format!("{self} has more than 2^64 bytes; one plan holds at most {MAX_VALUE_BYTES} (2^60)")),
        }
    }

    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType { dtype, shape: self.shape.clone() }
    }

    pub fn with_shape(&self, shape: impl Into<Vec<usize>>) -> Self {
        TensorType { dtype: self.dtype, shape: shape.into() }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}
