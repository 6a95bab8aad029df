//! Matrix products through cuBLASLt.
//!
//! [`lower_matmul`] turns a `matmul` node into a [`GemmCall`] (data);
//! [`Blas`] executes calls, with one cached cuBLASLt plan (descriptors and
//! the heuristic's algorithm) per distinct shape, so nothing is re-planned
//! per step and the calls capture into a graph. Row-major products are run
//! as the column-major product `Cᵀ = op(B)ᵀ · op(A)ᵀ`, which needs no copies.
//! f32 is computed in full f32 unless TF32 is asked for; bf16/f16 multiply
//! with f32 accumulation.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::matmul::MatMul;

use crate::error::{CudaError, Result};
use crate::launch::{DevTensor, GemmCall, GemmType, Launch};

/// The [`GemmCall`] of a matmul node over fixed addresses.
pub fn lower_matmul(op: &MatMul, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<Launch> {
    let (a, b, c) = (&inputs[0], &inputs[1], &outputs[0]);
    let ty = match c.ty.dtype {
        DType::F32 => GemmType::F32,
        DType::BF16 => GemmType::BF16,
        DType::F16 => GemmType::F16,
        d => return Err(CudaError::lower("matmul", format!("no cuBLASLt product for {d}"))),
    };
    let (sa, sb, sc) = (&a.ty.shape, &b.ty.shape, &c.ty.shape);
    let (m, n) = (sc[sc.len() - 2], sc[sc.len() - 1]);
    let k = if op.trans_a { sa[sa.len() - 2] } else { sa[sa.len() - 1] };
    let batch: usize = sc[..sc.len() - 2].iter().product();
    let batched = |s: &[usize]| s.len() > 2;
    Ok(Launch::Gemm(GemmCall {
        ty,
        batch,
        m,
        n,
        k,
        trans_a: op.trans_a,
        trans_b: op.trans_b,
        a: a.ptr,
        b: b.ptr,
        c: c.ptr,
        stride_a: if batched(sa) { (m * k) as i64 } else { 0 },
        stride_b: if batched(sb) { (k * n) as i64 } else { 0 },
        stride_c: (m * n) as i64,
    }))
}

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result as lr;
use cudarc::cublaslt::sys as ls;

/// What makes two products share one cuBLASLt plan (addresses do not).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct PlanKey {
    ty: GemmType,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    stride_a: i64,
    stride_b: i64,
    stride_c: i64,
}

/// Descriptors and the chosen algorithm for one product shape.
struct Plan {
    desc: ls::cublasLtMatmulDesc_t,
    // In cuBLAS's column-major terms the first operand is our B and the second our A.
    first: ls::cublasLtMatrixLayout_t,
    second: ls::cublasLtMatrixLayout_t,
    out: ls::cublasLtMatrixLayout_t,
    algo: ls::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: the descriptors were created by this plan and are used by no one else.
        unsafe {
            lr::destroy_matrix_layout(self.first).ok();
            lr::destroy_matrix_layout(self.second).ok();
            lr::destroy_matrix_layout(self.out).ok();
            lr::destroy_matmul_desc(self.desc).ok();
        }
    }
}

fn blas_err(what: &str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Blas(format!("{what}: {e:?}"))
}

/// A cuBLASLt handle, its workspace (inside the session's allocation) and
/// the plans of every product shape the step uses.
pub struct Blas {
    handle: ls::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    tf32: bool,
    plans: HashMap<PlanKey, Plan>,
}

impl Blas {
    /// Workspace cuBLASLt may use per call: what NVIDIA recommends for Hopper.
    pub const WORKSPACE_BYTES: usize = 32 << 20;

    pub fn new(workspace: u64, workspace_bytes: usize, tf32: bool) -> Result<Self> {
        // SAFETY: dlopen check only.
        if !unsafe { ls::is_culib_present() } {
            return Err(CudaError::Missing { lib: "cublasLt", hint: "install the CUDA toolkit's cuBLAS".into() });
        }
        let handle = lr::create_handle().map_err(|e| blas_err("cublasLtCreate", e))?;
        Ok(Blas { handle, workspace, workspace_bytes, tf32, plans: HashMap::new() })
    }

    /// Plans `call`'s shape (once per shape).
    pub fn prepare(&mut self, call: &GemmCall) -> Result<()> {
        let key = key_of(call);
        if self.plans.contains_key(&key) {
            return Ok(());
        }
        let plan = self.plan(&key)?;
        self.plans.insert(key, plan);
        Ok(())
    }

    fn plan(&self, k: &PlanKey) -> Result<Plan> {
        let dt = match k.ty {
            GemmType::F32 => ls::cudaDataType_t::CUDA_R_32F,
            GemmType::BF16 => ls::cudaDataType_t::CUDA_R_16BF,
            GemmType::F16 => ls::cudaDataType_t::CUDA_R_16F,
        };
        let compute = if k.ty == GemmType::F32 && self.tf32 {
            ls::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            ls::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let (m, n, kk) = (k.m as u64, k.n as u64, k.k as u64);
        // Row-major C[m,n] = opA(A)·opB(B) is column-major Cᵀ[n,m] = opB(B)ᵀ·opA(A)ᵀ.
        // Stored row-major B ([k,n], or [n,k] transposed) is column-major [n,k] (or [k,n]).
        let (fr, fc) = if k.trans_b { (kk, n) } else { (n, kk) };
        let (sr, sc) = if k.trans_a { (m, kk) } else { (kk, m) };
        let layout = |rows: u64, cols: u64, stride: i64| -> Result<ls::cublasLtMatrixLayout_t> {
            let l = lr::create_matrix_layout(dt, rows, cols, rows as i64).map_err(|e| blas_err("layout", e))?;
            if k.batch > 1 {
                let count = k.batch as i32;
                // SAFETY: attributes of a layout we own, with values of the documented types.
                unsafe {
                    lr::set_matrix_layout_attribute(
                        l,
                        ls::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &count as *const i32 as *const c_void,
                        4,
                    )
                    .map_err(|e| blas_err("batch count", e))?;
                    lr::set_matrix_layout_attribute(
                        l,
                        ls::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        &stride as *const i64 as *const c_void,
                        8,
                    )
                    .map_err(|e| blas_err("batch stride", e))?;
                }
            }
            Ok(l)
        };
        let first = layout(fr, fc, k.stride_b)?;
        let second = layout(sr, sc, k.stride_a)?;
        let out = layout(n, m, k.stride_c)?;
        let desc = lr::create_matmul_desc(compute, ls::cudaDataType_t::CUDA_R_32F).map_err(|e| blas_err("desc", e))?;
        let (ta, tb) = (k.trans_b as i32, k.trans_a as i32);
        // SAFETY: attributes of a descriptor we own.
        unsafe {
            lr::set_matmul_desc_attribute(
                desc,
                ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &ta as *const i32 as *const c_void,
                4,
            )
            .map_err(|e| blas_err("transa", e))?;
            lr::set_matmul_desc_attribute(
                desc,
                ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &tb as *const i32 as *const c_void,
                4,
            )
            .map_err(|e| blas_err("transb", e))?;
        }
        let pref = lr::create_matmul_pref().map_err(|e| blas_err("preference", e))?;
        let ws = self.workspace_bytes;
        // SAFETY: a preference we own; the heuristic reads the descriptors above.
        let heur = unsafe {
            lr::set_matmul_pref_attribute(
                pref,
                ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(|e| blas_err("workspace preference", e))?;
            let h = lr::get_matmul_algo_heuristic(self.handle, desc, first, second, out, out, pref);
            lr::destroy_matmul_pref(pref).ok();
            h.map_err(|e| blas_err(&format!("no cuBLASLt algorithm for {k:?}"), e))?
        };
        Ok(Plan { desc, first, second, out, algo: heur.algo })
    }

    /// Enqueues `call` on `stream` (prepared earlier). Captures into a graph as is.
    pub fn run(&self, call: &GemmCall, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        let plan = self.plans.get(&key_of(call)).ok_or_else(|| CudaError::Blas("product was not prepared".into()))?;
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: addresses come from the plan and lie inside the session's
        // allocation; the plan's descriptors match the call's shape.
        unsafe {
            lr::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                call.b as *const c_void,
                plan.first,
                call.a as *const c_void,
                plan.second,
                call.c as *const c_void,
                plan.out,
                call.c as *mut c_void,
                plan.out,
                &plan.algo,
                self.workspace as *mut c_void,
                self.workspace_bytes,
                stream as _,
            )
        }
        .map_err(|e| blas_err("cublasLtMatmul", e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle is ours and no call is in flight (the session synchronises first).
        unsafe { lr::destroy_handle(self.handle) }.ok();
    }
}

fn key_of(c: &GemmCall) -> PlanKey {
    PlanKey {
        ty: c.ty,
        batch: c.batch,
        m: c.m,
        n: c.n,
        k: c.k,
        trans_a: c.trans_a,
        trans_b: c.trans_b,
        stride_a: c.stride_a,
        stride_b: c.stride_b,
        stride_c: c.stride_c,
    }
}
