//! cuBLAS's own GEMM as one more tuning candidate: `cublasGemmStridedBatchedEx`
//! with cuBLAS's internal heuristics, which pick kernels of their own for a
//! shape (PyTorch's matmuls go this way; on an H200 they ran W5's product
//! shapes 7% faster than the cuBLASLt algorithms our tuning chose).
//! Off unless [`CUBLAS_ENV`]`=1`, until a GPU run has checked it;
//! `STEPGRAPH_GEMM_CUBLAS=only` runs every product that can through cuBLAS,
//! untimed, so the GPU tests compare exactly that path with the CPU.
//!
//! The row-major product `C[m, n] = op(A) · op(B)` runs as the column-major
//! `Cᵀ = op(B)ᵀ · op(A)ᵀ`, as the cuBLASLt plans do: B first, with the
//! leading dimensions of its stored layout. cuBLAS adds only C to itself
//! (`beta = 1` in place) and has no bias epilogue, so a shape is a
//! candidate only when every call's addend is none or its own output
//! ([`eligible`]).

use std::ffi::{c_int, c_void};

use cudarc::cublas::result as cr;
use cudarc::cublas::sys as cs;

use super::own::CandidateUse;
use super::plan::{Epilogue, PlanKey};
use crate::error::{CudaError, Result};
use crate::launch::{GemmAddend, GemmCall, GemmType};

/// [`AlgoConfig::id`](super::AlgoConfig::id) of the cuBLAS candidate in tuning reports.
pub const CUBLAS_ALGO_ID: i32 = -1;

/// Can the products of `key` run as `cublasGemmStridedBatchedEx`: no bias
/// epilogue, every addend its call's own output (`in_place`), and sizes,
/// leading dimensions and batch within cuBLAS's `int`s?
pub(super) fn eligible(key: &PlanKey, in_place: bool) -> bool {
    let fits = |x: usize| x <= c_int::MAX as usize;
    !matches!(key.ty, GemmType::Fp8(_))
        && key.epilogue != Epilogue::Bias
        && (key.epilogue == Epilogue::None || in_place)
        && [key.m, key.n, key.k, key.batch.max(1)].into_iter().all(fits)
}

/// A cuBLAS handle working in the session's cuBLASLt workspace (the two run
/// on one stream, never at once).
pub(super) struct Cublas {
    handle: cs::cublasHandle_t,
    tf32: bool,
    /// [`CandidateUse::Only`]: the sole candidate of every shape it can run.
    pub(super) only: bool,
}

impl Cublas {
    /// cuBLAS as `how` asks for it: `None` when [`CandidateUse::Off`].
    pub(super) fn open(how: CandidateUse, workspace: u64, workspace_bytes: usize, tf32: bool) -> Result<Option<Self>> {
        match how {
            CandidateUse::Off => Ok(None),
            CandidateUse::Candidate | CandidateUse::Only => {
                Self::new(workspace, workspace_bytes, tf32, how == CandidateUse::Only).map(Some)
            }
        }
    }

    fn new(workspace: u64, workspace_bytes: usize, tf32: bool, only: bool) -> Result<Self> {
        // SAFETY: dlopen check only.
        if !unsafe { cs::is_culib_present() } {
            return Err(CudaError::Missing { lib: "cublas", hint: "install the CUDA toolkit's cuBLAS".into() });
        }
        let err = |what: &str, e: cr::CublasError| CudaError::Blas(format!("{what}: {e:?}"));
        let handle = cr::create_handle().map_err(|e| err("cublasCreate", e))?;
        let cublas = Cublas { handle, tf32, only };
        // SAFETY: a live handle, and a workspace inside the session's
        // allocation that outlives it (the session drops Blas first).
        unsafe {
            cs::cublasSetWorkspace_v2(handle, workspace as *mut c_void, workspace_bytes)
                .result()
                .map_err(|e| err("cublasSetWorkspace", e))?;
        }
        Ok(cublas)
    }

    /// Enqueues `call` on `stream` (an eligible shape: see [`eligible`]).
    pub(super) fn gemm(&self, call: &GemmCall, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        use cs::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let beta = match call.addend {
            GemmAddend::None => 0f32,
            GemmAddend::Full(p) if p == call.c => 1f32,
            other => return Err(CudaError::Blas(format!("cuBLAS's GEMM adds only its own output, not {other:?}"))),
        };
        let alpha = 1f32;
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let dt = match call.ty {
            GemmType::F32 | GemmType::Tf32 => cs::cudaDataType_t::CUDA_R_32F,
            GemmType::BF16 => cs::cudaDataType_t::CUDA_R_16BF,
            GemmType::F16 => cs::cudaDataType_t::CUDA_R_16F,
            GemmType::Fp8(_) => return Err(CudaError::Blas("cuBLAS's GEMM runs no FP8 product".into())),
        };
        let compute = if call.ty == GemmType::Tf32 || (call.ty == GemmType::F32 && self.tf32) {
            cs::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            cs::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        // Column-major: B (ours) is the first operand, stored [k, n] (or
        // [n, k] transposed), then A, stored [m, k] (or [k, m]); C is [m, n].
        let (lda, ldb) = (if call.trans_b { call.k } else { call.n }, if call.trans_a { call.m } else { call.k });
        let int = |x: usize| x as c_int;
        // SAFETY: a live handle; the operands lie inside the session's
        // allocation with the call's shape (an eligible one, whose sizes
        // fit an int); alpha and beta are host values read during the call.
        unsafe {
            cr::set_stream(self.handle, stream as cs::cudaStream_t)
                .map_err(|e| CudaError::Blas(format!("cublasSetStream: {e:?}")))?;
            cs::cublasGemmStridedBatchedEx(
                self.handle,
                op(call.trans_b),
                op(call.trans_a),
                int(call.n),
                int(call.m),
                int(call.k),
                &alpha as *const f32 as *const c_void,
                call.b as *const c_void,
                dt,
                int(lda),
                call.stride_b,
                call.a as *const c_void,
                dt,
                int(ldb),
                call.stride_a,
                &beta as *const f32 as *const c_void,
                call.c as *mut c_void,
                dt,
                int(call.n),
                call.stride_c,
                int(call.batch.max(1)),
                compute,
                cs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .result()
            .map_err(|e| CudaError::Blas(format!("cublasGemmStridedBatchedEx: {e:?}")))
        }
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and no call is in flight (the session synchronises first).
        unsafe { cr::destroy_handle(self.handle) }.ok();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(epilogue: Epilogue, m: usize) -> PlanKey {
        PlanKey {
            ty: GemmType::BF16,
            batch: 1,
            m,
            n: 3200,
            k: 8640,
            trans_a: false,
            trans_b: true,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            epilogue,
        }
    }

    #[test]
    fn cublas_runs_plain_and_in_place_products_only() {
        assert!(eligible(&key(Epilogue::None, 8192), false));
        assert!(eligible(&key(Epilogue::Accumulate, 8192), true));
        // An addend elsewhere, or a bias, needs cuBLASLt's epilogues.
        assert!(!eligible(&key(Epilogue::Accumulate, 8192), false));
        assert!(!eligible(&key(Epilogue::Bias, 8192), true));
        assert!(!eligible(&key(Epilogue::None, 1 << 31), false));
    }
}
