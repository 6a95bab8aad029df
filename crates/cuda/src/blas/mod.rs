//! Matrix products through cuBLASLt: this module owns the handle, its
//! workspace and the execution of [`GemmCall`]s; `plan` owns the per-shape
//! descriptors and algorithm candidates, `autotune` the timing that picks
//! among them.
//!
//! `matmul` nodes lower to [`GemmCall`]s (data, `crate::ops::matmul`);
//! [`Blas`] executes calls, with one cached cuBLASLt plan (descriptors and
//! one algorithm) per distinct shape, so nothing is re-planned per step and
//! the calls capture into a graph. Row-major products are run as the
//! column-major product `Cᵀ = op(B)ᵀ · op(A)ᵀ`, which needs no copies.
//! f32 is computed in full f32 unless TF32 is asked for; bf16/f16 multiply
//! with f32 accumulation.
//!
//! **Autotuning.** cuBLASLt's heuristic ranks algorithms without running
//! them, and its first pick is not always the fastest (f32 on Hopper in
//! particular). With autotuning on (the default; `STEPGRAPH_GEMM_AUTOTUNE=0`
//! turns it off), [`Blas::plan_all`] asks the heuristic for up to
//! [`MAX_CANDIDATES`] algorithms per shape ([`CANDIDATES_ENV`] changes how
//! many; [`SPLIT_K_ENV`]`=1` adds split-k variants of the first ones for
//! products of few output tiles, [`CUBLAS_ENV`]`=1` cuBLAS's own GEMM,
//! [`SKINNY_ENV`]`=1` our kernels for products of a few rows,
//! [`TILED_ENV`]`=1` our exact-f32 kernels in small tiles) and
//! [`Blas::autotune`] times each
//! one, once, while the session is being built: a warm-up run, then a few
//! runs between CUDA events on the real operand addresses of one call of
//! that shape; the fastest median wins, and candidates within
//! [`TIE_TOLERANCE`] of it count as ties, which keep the heuristic's order.
//! The winner is stored in the plan, so every later eager run and the
//! captured graph use the same algorithm: within a session the choice is
//! fixed, and graph replay equals eager bit for bit.
//!
//! Invariants of tuning:
//! - It only writes product outputs, and only where the caller says memory
//!   holds no data (the session passes its arena before any step ran; a
//!   shape with no call whose output lies entirely in that range keeps the
//!   heuristic's first algorithm untimed). Every product overwrites its
//!   output (`beta = 0`), so repeated runs accumulate nothing.
//! - A choice is remembered for the life of the process (keyed by shape,
//!   operand alignment and TF32), so all sessions of one process multiply
//!   a given shape the same way. Separate processes time separately and may
//!   pick different algorithms (timing noise decides near-ties), hence
//!   differently rounded products; each algorithm on its own is
//!   deterministic run to run (cuBLASLt's split-K reductions are ordered).
//! - Timing sees the arena's poison and whatever the persistent buffer
//!   holds before weights are written, not real data. GEMM time does not
//!   depend on values except through power draw, which affects every
//!   candidate alike.

mod autotune;
mod cublas;
mod own;
mod plan;
mod skinny;
mod tiled;

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result as lr;
use cudarc::cublaslt::sys as ls;

pub use autotune::{few_tiles, AlgoConfig, GemmTuning, ShapeTuning, SPLIT_K_TRIED, TIE_TOLERANCE};
pub use cublas::CUBLAS_ALGO_ID;
pub use own::CandidateUse;
use plan::{call_alignment, key_of, Alignment, Candidate, Plan, PlanKey};
pub use skinny::SKINNY_ALGO_ID;
pub use tiled::TILED_ALGO_ID;
// The tuning switches' names, kept with the other switches.
pub use crate::switches::{
    AUTOTUNE_ENV, CANDIDATES_ENV, CANDIDATES_LIMIT, CUBLAS_ENV, MAX_CANDIDATES, SKINNY_ENV, SPLIT_K_ENV, TILED_ENV,
};

use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;
pub use crate::launch::shape_name;
use crate::launch::{GemmAddend, GemmCall};
use crate::switches::Switches;

/// The kernel modules products may launch outside cuBLAS (compiled with
/// every other module, and for sm_90 in CI).
pub(crate) const KERNELS: &[KernelModule] = &[skinny::MODULE, tiled::MODULE];

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
    autotune: bool,
    /// Algorithms asked of the heuristic per shape when tuning.
    candidates: usize,
    /// Whether tuning also times split-k variants of products of few tiles.
    split_k: bool,
    /// cuBLAS, when its GEMM is used ([`CUBLAS_ENV`]).
    cublas: Option<cublas::Cublas>,
    /// Our few-row kernels, when used ([`SKINNY_ENV`]).
    skinny: Option<own::OwnKernels>,
    /// Our small-f32 kernels, when used ([`TILED_ENV`]).
    tiled: Option<own::OwnKernels>,
    plans: HashMap<PlanKey, Plan>,
    /// The GPU's architecture (`sm_90`), which says whether it multiplies FP8.
    arch: String,
    /// Shapes in the order the step first uses them, with their call counts.
    order: Vec<(PlanKey, usize)>,
    tuning: GemmTuning,
}

impl Blas {
    /// Workspace cuBLASLt may use per call: what NVIDIA recommends for Hopper.
    pub const WORKSPACE_BYTES: usize = 32 << 20;

    /// With `switches.gemm_autotune` off, every shape uses the heuristic's
    /// first algorithm; the other `gemm_*` switches say how many candidates
    /// are timed and which. `ctx` and `arch` load our own kernels when
    /// [`SKINNY_ENV`] or [`TILED_ENV`] asks for them.
    pub fn new(
        workspace: u64,
        workspace_bytes: usize,
        tf32: bool,
        switches: &Switches,
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        arch: &str,
    ) -> Result<Self> {
        // SAFETY: dlopen check only.
        if !unsafe { ls::is_culib_present() } {
            return Err(CudaError::Missing { lib: "cublasLt", hint: "install the CUDA toolkit's cuBLAS".into() });
        }
        let (autotune, candidates, split_k) =
            (switches.gemm_autotune, switches.gemm_candidates.0, switches.gemm_split_k);
        let pdl = crate::switches::pdl_on(arch, switches);
        let cublas = cublas::Cublas::open(switches.gemm_cublas, workspace, workspace_bytes, tf32)?;
        let skinny =
            own::OwnKernels::open(switches.gemm_skinny, &skinny::MODULE, skinny::kernel_names(), ctx, arch, pdl)?;
        let tiled = own::OwnKernels::open(switches.gemm_tiled, &tiled::MODULE, tiled::kernel_names(), ctx, arch, pdl)?;
        let handle = lr::create_handle().map_err(|e| blas_err("cublasLtCreate", e))?;
        Ok(Blas {
            handle,
            workspace,
            workspace_bytes,
            tf32,
            autotune,
            candidates,
            split_k,
            cublas,
            skinny,
            tiled,
            plans: HashMap::new(),
            arch: arch.to_string(),
            order: Vec::new(),
            tuning: GemmTuning { enabled: autotune, ..GemmTuning::default() },
        })
    }

    /// Plans every shape of `calls` (all products of the step, at once: a
    /// shape's plan must suit the operand alignment of each of its calls).
    pub fn plan_all(&mut self, calls: &[GemmCall]) -> Result<()> {
        let mut align: HashMap<PlanKey, Alignment> = HashMap::new();
        // Whether every call of a shape that adds a tensor adds its own output.
        let mut in_place: HashMap<PlanKey, bool> = HashMap::new();
        if calls.iter().any(|c| matches!(c.ty, crate::launch::GemmType::Fp8(_))) && !fp8_capable(&self.arch) {
            return Err(CudaError::unsupported(
                "matmul_fp8",
                format!(
                    "FP8 products need a GPU of compute capability 8.9 or later (Ada, Hopper), and this one is {}: \
                     run without --fp8",
                    self.arch
                ),
            ));
        }
        for c in calls {
            let key = key_of(c);
            let a = call_alignment(c);
            align.entry(key).and_modify(|x| *x = x.min(a)).or_insert(a);
            let own = !matches!(c.addend, GemmAddend::Full(p) if p != c.c);
            in_place.entry(key).and_modify(|x| *x &= own).or_insert(own);
            match self.order.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += 1,
                None => self.order.push((key, 1)),
            }
        }
        for (key, _) in self.order.clone() {
            let Some(&a) = align.get(&key) else { continue };
            let suits = self.plans.get(&key).is_some_and(|p| p.align.suits(a));
            if !suits {
                let plan = self.plan(&key, a, in_place[&key])?;
                self.plans.insert(key, plan);
            }
        }
        Ok(())
    }

    /// Enqueues `call` on `stream` (prepared earlier). Captures into a graph as is.
    pub fn run(&self, call: &GemmCall, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        let plan = self.plans.get(&key_of(call)).ok_or_else(|| CudaError::Blas("product was not prepared".into()))?;
        self.enqueue(plan, &plan.algo, call, stream)
    }

    fn enqueue(
        &self,
        plan: &Plan,
        candidate: &Candidate,
        call: &GemmCall,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let algo = match candidate {
            Candidate::Lt(algo) => algo,
            Candidate::Cublas => {
                let cublas = self.cublas.as_ref().ok_or_else(|| CudaError::Blas("cuBLAS is not open".into()))?;
                return cublas.gemm(call, stream);
            }
            Candidate::Skinny(variant) => {
                let kernels =
                    self.skinny.as_ref().ok_or_else(|| CudaError::Blas("skinny kernels not loaded".into()))?;
                return kernels.run(&skinny::launch(call, *variant), stream);
            }
            Candidate::Tiled(variant) => {
                let kernels = self.tiled.as_ref().ok_or_else(|| CudaError::Blas("tiled kernels not loaded".into()))?;
                return kernels.run(&tiled::launch(call, *variant), stream);
            }
        };
        // beta = 0 overwrites the output; an addend of the output's layout
        // is C with beta = 1 (C may be the output itself: cuBLASLt reads
        // each element of C before it writes that element of D, and the
        // plan gives C and D one layout); a bias is the epilogue's pointer.
        let (beta, addend) = match call.addend {
            GemmAddend::None => (0f32, call.c),
            GemmAddend::Full(p) => (1f32, p),
            GemmAddend::Bias(p) => {
                // Read by the next cublasLtMatmul on this descriptor: this one.
                let attr = ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER;
                plan::set_desc(plan.desc, attr, &p, "bias pointer")?;
                (0f32, call.c)
            }
        };
        if let Some([scale_a, scale_b]) = call.fp8_scales {
            // cuBLAS's A is our B and its B our A. Read by the next
            // cublasLtMatmul on this descriptor: this one.
            use ls::cublasLtMatmulDescAttributes_t as A;
            plan::set_desc(plan.desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, "B's scale")?;
            plan::set_desc(plan.desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, "A's scale")?;
        }
        let alpha = 1f32;
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
                addend as *const c_void,
                plan.out,
                call.c as *mut c_void,
                plan.out,
                algo,
                self.workspace as *mut c_void,
                self.workspace_bytes,
                stream as _,
            )
        }
        .map_err(|e| blas_err(&format!("cublasLtMatmul of {}", shape_name(call)), e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle is ours and no call is in flight (the session synchronises first).
        unsafe { lr::destroy_handle(self.handle) }.ok();
    }
}

/// Whether a GPU of architecture `arch` (`sm_89`, `sm_90a`) has FP8 tensor cores.
fn fp8_capable(arch: &str) -> bool {
    let digits: String = arch.trim_start_matches("sm_").chars().take_while(char::is_ascii_digit).collect();
    digits.parse::<u32>().is_ok_and(|cc| cc >= 89)
}

/// A product of `batch` `[m, n]` outputs at `c`, for tests.
#[cfg(test)]
fn test_call(ty: crate::launch::GemmType, batch: usize, m: usize, n: usize, c: u64) -> GemmCall {
    GemmCall {
        ty,
        batch,
        m,
        n,
        k: 8,
        trans_a: false,
        trans_b: true,
        a: 0x1000,
        b: 0x2000,
        c,
        stride_a: 0,
        stride_b: (n * 8) as i64,
        stride_c: (m * n) as i64,
        addend: GemmAddend::None,
        fp8_scales: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::GemmType;

    #[test]
    fn fp8_products_need_ada_or_later() {
        assert!(fp8_capable("sm_90") && fp8_capable("sm_89") && fp8_capable("sm_90a") && fp8_capable("sm_100"));
        assert!(!fp8_capable("sm_80") && !fp8_capable("sm_86") && !fp8_capable("compute"));
    }

    #[test]
    fn shape_names_match_the_profile() {
        let mut c = test_call(GemmType::F32, 1, 2048, 3200, 0);
        c.k = 8640;
        assert_eq!(shape_name(&c), "gemm_f32_2048x3200x8640_tb");
        c.batch = 4;
        c.trans_a = true;
        c.trans_b = false;
        assert_eq!(shape_name(&c), "gemm_f32_2048x3200x8640_ta_b4");
        c.addend = GemmAddend::Bias(0x4000);
        assert_eq!(shape_name(&c), "gemm_f32_2048x3200x8640_ta_b4_bias");
    }
}
