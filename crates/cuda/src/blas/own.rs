//! What our own product kernels share (`skinny` for a few rows, `tiled`
//! for small f32 matrices): the switch that turns a family on (cuBLAS's
//! GEMM reads its switch the same way), the
//! parameter layout every family's kernels take ([`OwnLaunch`]), and the
//! loaded module with its functions. A product's launch is built per call
//! (eager runs enqueue every product each step) on the stack: no name to
//! look up, no argument vectors to allocate.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule};

use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, GemmAddend, GemmCall};

/// Most parameters of our product kernels: the common eleven plus the
/// family's own (`tiled`'s two transposition flags).
const MAX_ARGS: usize = 13;

/// One product on one of our kernels: the function (an index into the
/// family's kernel names), grid, block and arguments. The arguments are
/// `a, b, c, addend, add_kind, m, n, k`, the family's own ints, then the
/// three batch strides; `add_kind` is 0 for no addend, 1 for one of the
/// output's layout, 2 for a bias row (`*_ADD_*` in the sources).
pub(super) struct OwnLaunch {
    pub(super) function: usize,
    pub(super) grid: (u32, u32, u32),
    pub(super) block: (u32, u32, u32),
    args: [Arg; MAX_ARGS],
    len: usize,
}

impl OwnLaunch {
    /// The launch of `call` on function `function`, with the family's own
    /// int parameters `own` after the common ones.
    pub(super) fn new(
        function: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        call: &GemmCall,
        own: &[i32],
    ) -> Self {
        let (addend, kind) = match call.addend {
            GemmAddend::None => (0, 0),
            GemmAddend::Full(p) => (p, 1),
            GemmAddend::Bias(p) => (p, 2),
        };
        let mut args = std::array::from_fn(|_| Arg::I32(0));
        let common = [
            Arg::Ptr(call.a),
            Arg::Ptr(call.b),
            Arg::Ptr(call.c),
            Arg::Ptr(addend),
            Arg::I32(kind),
            Arg::I32(call.m as i32),
            Arg::I32(call.n as i32),
            Arg::I32(call.k as i32),
        ];
        let strides = [Arg::I64(call.stride_a), Arg::I64(call.stride_b), Arg::I64(call.stride_c)];
        let all = common.into_iter().chain(own.iter().map(|&x| Arg::I32(x))).chain(strides);
        let mut len = 0;
        for (slot, a) in args.iter_mut().zip(all) {
            *slot = a;
            len += 1;
        }
        assert_eq!(len, 11 + own.len(), "at most {MAX_ARGS} arguments");
        OwnLaunch { function, grid, block, args, len }
    }

    pub(super) fn args(&self) -> &[Arg] {
        &self.args[..self.len]
    }

    /// As the session's launch data, named from the family's `names`
    /// (for the tests' checks against the compiled kernels).
    #[cfg(test)]
    pub(super) fn kernel_launch(&self, module: &KernelModule, names: &[String]) -> crate::launch::KernelLaunch {
        crate::launch::KernelLaunch {
            module: module.name,
            function: names[self.function].clone(),
            grid: self.grid,
            block: self.block,
            shared_bytes: 0,
            args: self.args().to_vec(),
        }
    }
}

pub use crate::switches::CandidateUse;

/// One family's loaded kernels.
pub(super) struct OwnKernels {
    /// Kept alive for the functions below.
    _module: Arc<CudaModule>,
    /// By index, as the family names them; `names` for errors.
    functions: Vec<cudarc::driver::sys::CUfunction>,
    names: Vec<String>,
    /// [`CandidateUse::Only`]: the first variant is the sole candidate.
    pub(super) only: bool,
    /// Launch with programmatic dependent launch ([`crate::launch::pdl_on`]).
    pdl: bool,
}

impl OwnKernels {
    /// `module` compiled for `arch` (or read from the kernel cache) and
    /// loaded, with the functions `names` (an [`OwnLaunch`]'s function
    /// indexes them), as `how` asks (`None` when off).
    pub(super) fn open(
        how: CandidateUse,
        module: &KernelModule,
        names: impl IntoIterator<Item = String>,
        ctx: &Arc<CudaContext>,
        arch: &str,
        pdl: bool,
    ) -> Result<Option<Self>> {
        if how == CandidateUse::Off {
            return Ok(None);
        }
        let cubin = crate::nvrtc::compile(module, arch)?;
        let loaded = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
        let names: Vec<String> = names.into_iter().collect();
        let functions = names
            .iter()
            .map(|name| {
                loaded
                    .load_function(name)
                    .map(|f| f.cu_function())
                    .map_err(|e| CudaError::Driver(format!("kernel `{name}` in module `{}`: {e:?}", module.name)))
            })
            .collect::<Result<_>>()?;
        Ok(Some(OwnKernels { _module: loaded, functions, names, only: how == CandidateUse::Only, pdl }))
    }

    /// Enqueues `l` on `stream`.
    pub(super) fn run(&self, l: &OwnLaunch, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        // Each argument in an 8-byte slot: a 4-byte int in its first bytes
        // (little-endian, as every CUDA host is), which is all the driver
        // reads of it.
        let mut values = [0u64; MAX_ARGS];
        for (v, a) in values.iter_mut().zip(l.args()) {
            *v = match *a {
                Arg::Ptr(p) => p,
                Arg::I32(x) => x as u32 as u64,
                Arg::I64(x) => x as u64,
                ref other => unreachable!("our product kernels take pointers and ints, not {other:?}"),
            };
        }
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, v) in params.iter_mut().zip(values.iter_mut()) {
            *p = v as *mut u64 as *mut c_void;
        }
        let f = self.functions[l.function];
        // SAFETY: the function belongs to the module this struct keeps
        // loaded; the families build their launches to match the kernels'
        // parameters (checked against the CUBIN in their tests) for
        // products of a shape they accept, whose operands lie inside the
        // session's allocation. `values` outlives the call, which copies
        // the argument values.
        unsafe { crate::launch::launch_kernel(f, l.grid, l.block, 0, stream, &mut params[..l.len], self.pdl) }
            .map_err(|e| CudaError::Driver(format!("launching `{}`: {e:?}", self.names[l.function])))
    }
}
