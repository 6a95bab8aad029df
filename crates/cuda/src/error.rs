//! The CUDA backend's error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CudaError {
    /// A CUDA library is not installed or not found by the dynamic loader.
    #[error("CUDA library `{lib}` not found: {hint}")]
    Missing { lib: &'static str, hint: String },
    /// A kernel source failed to compile; the NVRTC log names the line.
    #[error("NVRTC could not compile `{source_name}` for {arch}:\n{log}")]
    Compile { source_name: String, arch: String, log: String },
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("cuBLASLt: {0}")]
    Blas(String),
    /// The step does not fit the device: nothing was allocated.
    #[error(
        "the planned step needs {needed} bytes ({needed_gb:.2} GB) but the GPU has {free} bytes ({free_gb:.2} GB) free"
    )]
    DoesNotFit { needed: u64, needed_gb: f64, free: u64, free_gb: f64 },
    /// A node this backend cannot lower (with the reason): operands that
    /// contradict the op's shape rule, or a size past a kernel's limits.
    #[error("cannot lower `{op}` to CUDA: {reason}")]
    Lower { op: String, reason: String },
    /// A dtype an op has no CUDA kernel for: a known gap of this backend
    /// (f64 products, say), not a malformed node.
    #[error("`{op}` has no CUDA kernel for this case: {reason}")]
    Unsupported { op: String, reason: String },
    /// An NCCL call failed (with NCCL's description).
    #[error("NCCL: {0}")]
    Nccl(String),
    /// A session's rank or group does not fit the step's collectives.
    #[error("data-parallel rank: {0}")]
    Rank(String),
    /// A run-time switch ([`crate::switches`]) set to a value it does not take.
    #[error("{var}={value:?}: expected {expected}")]
    Switch { var: String, value: String, expected: String },
    #[error(transparent)]
    Core(#[from] stepgraph_core::Error),
    #[error("io error on `{path}`: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

impl CudaError {
    pub fn lower(op: &str, reason: impl Into<String>) -> Self {
        CudaError::Lower { op: op.into(), reason: reason.into() }
    }

    pub fn unsupported(op: &str, reason: impl Into<String>) -> Self {
        CudaError::Unsupported { op: op.into(), reason: reason.into() }
    }
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(format!("{e:?}"))
    }
}
