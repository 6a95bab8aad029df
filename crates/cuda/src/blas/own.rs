//! What our own product kernels share (`skinny` for a few rows, `tiled`
//! for small f32 matrices): the switch that turns a family on, and its
//! loaded module with one function per kernel name, launched from
//! [`KernelLaunch`] data as the session launches lowered kernels.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result as dr, CudaContext, CudaModule};

use crate::error::{CudaError, Result};
use crate::kernels::KernelModule;
use crate::launch::{Arg, GemmAddend, KernelLaunch};

/// A product's addend as our kernels take it: its address (0 for none)
/// and its kind (0 none, 1 the output's layout, 2 a bias row; `*_ADD_*` in
/// the sources).
pub(super) fn addend_args(addend: GemmAddend) -> [Arg; 2] {
    let (ptr, kind) = match addend {
        GemmAddend::None => (0, 0),
        GemmAddend::Full(p) => (p, 1),
        GemmAddend::Bias(p) => (p, 2),
    };
    [Arg::Ptr(ptr), Arg::I32(kind)]
}

/// What a family's switch (`STEPGRAPH_GEMM_SKINNY`, `STEPGRAPH_GEMM_TILED`) asks for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OwnUse {
    /// Not used (unset, or any other value).
    Off,
    /// `1`: more candidates for tuning to time.
    Candidate,
    /// `only`: the family's first variant runs every product it can,
    /// untimed, so the GPU tests compare exactly that path with the CPU.
    Only,
}

/// [`OwnUse`] given the value of a family's switch.
pub fn own_setting(value: Option<&str>) -> OwnUse {
    match value.map(str::trim) {
        Some("1") => OwnUse::Candidate,
        Some("only") => OwnUse::Only,
        _ => OwnUse::Off,
    }
}

/// One family's loaded kernels.
pub(super) struct OwnKernels {
    /// Kept alive for the functions below.
    _module: Arc<CudaModule>,
    functions: HashMap<String, cudarc::driver::sys::CUfunction>,
    /// [`OwnUse::Only`]: the first variant is the sole candidate.
    pub(super) only: bool,
}

impl OwnKernels {
    /// `module` compiled for `arch` (or read from the kernel cache) and
    /// loaded, with the functions `names`, as `how` asks (`None` when off).
    pub(super) fn open(
        how: OwnUse,
        module: &KernelModule,
        names: impl IntoIterator<Item = String>,
        ctx: &Arc<CudaContext>,
        arch: &str,
    ) -> Result<Option<Self>> {
        if how == OwnUse::Off {
            return Ok(None);
        }
        let cubin = crate::nvrtc::compile(module.name, arch)?;
        let loaded = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
        let mut functions = HashMap::new();
        for name in names {
            let f = loaded
                .load_function(&name)
                .map_err(|e| CudaError::Driver(format!("kernel `{name}` in module `{}`: {e:?}", module.name)))?;
            functions.insert(name, f.cu_function());
        }
        Ok(Some(OwnKernels { _module: loaded, functions, only: how == OwnUse::Only }))
    }

    /// Enqueues `l`, a launch of one of this family's functions, on `stream`.
    pub(super) fn run(&self, l: &KernelLaunch, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        let func = *self
            .functions
            .get(&l.function)
            .ok_or_else(|| CudaError::Blas(format!("kernel `{}` is not loaded", l.function)))?;
        let args: Vec<Vec<u8>> = l.args.iter().map(Arg::bytes).collect();
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.as_ptr() as *mut c_void).collect();
        // SAFETY: `func` belongs to the module this struct keeps loaded; the
        // families build their launches to match the kernels' parameters
        // (checked against the CUBIN in their tests) for products of a
        // shape they accept, whose operands lie inside the session's
        // allocation. `args` outlives the call, which copies the values.
        unsafe { dr::launch_kernel(func, l.grid, l.block, l.shared_bytes, stream, &mut params) }
            .map_err(|e| CudaError::Driver(format!("launching `{}`: {e:?}", l.function)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switch_values() {
        assert_eq!(own_setting(None), OwnUse::Off);
        assert_eq!(own_setting(Some("0")), OwnUse::Off);
        assert_eq!(own_setting(Some("1")), OwnUse::Candidate);
        assert_eq!(own_setting(Some(" only")), OwnUse::Only);
    }
}
