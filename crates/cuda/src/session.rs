//! (being written) The CUDA session: API contract used by the GPU tests.
use stepgraph_core::ir::{Trace, ValueId};
use stepgraph_core::ops::Op;
use stepgraph_core::plan::MemoryPlan;
use stepgraph_core::testing::HostTensor;

use crate::error::Result;

/// Backend options.
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// Let cuBLASLt use TF32 for f32 products.
    pub tf32: bool,
}

/// A planned step bound to device memory.
pub struct CudaSession {
    _trace: Trace,
}

impl CudaSession {
    pub fn new(trace: Trace, _plan: MemoryPlan, _opts: CudaOptions) -> Result<Self> {
        Ok(CudaSession { _trace: trace })
    }
    pub fn write(&mut self, _v: ValueId, _t: &HostTensor) -> Result<()> {
        Ok(())
    }
    pub fn write_named(&mut self, _name: &str, _t: &HostTensor) -> Result<()> {
        Ok(())
    }
    pub fn read(&mut self, v: ValueId) -> Result<HostTensor> {
        Ok(HostTensor::zeros(self._trace.ty(v).clone()))
    }
    pub fn run_eager(&mut self) -> Result<()> {
        Ok(())
    }
    pub fn capture(&mut self) -> Result<std::time::Duration> {
        Ok(std::time::Duration::ZERO)
    }
    pub fn replay(&mut self) -> Result<()> {
        Ok(())
    }
    pub fn loss(&mut self) -> Result<f64> {
        Ok(0.0)
    }
}

/// Is there a usable NVIDIA GPU (driver library and a device)?
pub fn gpu_available() -> bool {
    false
}

/// Runs one op on the GPU through its lowering (unplanned: every value its own bytes).
pub fn run_op(_op: &Op, _inputs: &[HostTensor]) -> Result<Vec<HostTensor>> {
    Ok(vec![])
}
