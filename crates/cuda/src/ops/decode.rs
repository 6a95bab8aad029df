//! TEMPORARY (replaced by the helper's lowering at merge).
use stepgraph_core::ops::decode::{CachedAttention, KvWrite, SampleNext};

use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernels::KernelModule;
use crate::launch::Launch;

impl Lower for KvWrite {
    const KERNELS: &'static [KernelModule] = &[];
    fn lower(&self, _cx: &LowerCx) -> Result<Vec<Launch>> {
        Err(CudaError::lower("kv_write", "not yet"))
    }
}
impl Lower for CachedAttention {
    const KERNELS: &'static [KernelModule] = &[];
    fn lower(&self, _cx: &LowerCx) -> Result<Vec<Launch>> {
        Err(CudaError::lower("cached_attention", "not yet"))
    }
}
impl Lower for SampleNext {
    const KERNELS: &'static [KernelModule] = &[];
    fn lower(&self, _cx: &LowerCx) -> Result<Vec<Launch>> {
        Err(CudaError::lower("sample_next", "not yet"))
    }
}
