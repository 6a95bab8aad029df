//! cuBLASLt plans: one set of descriptors and candidate algorithms per
//! product shape (what [`PlanKey`] holds: addresses do not count), planned
//! for the weakest operand alignment any call of that shape has, so every
//! call of the shape can use the plan. Row-major `C = op(A)·op(B)` is
//! planned as the column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`.

use std::ffi::c_void;

use cudarc::cublaslt::result as lr;
use cudarc::cublaslt::sys as ls;

use super::{blas_err, Blas};
use crate::error::{CudaError, Result};
use stepgraph_core::ir::DType;
use stepgraph_core::ops::fp8::Fp8Format;

use crate::launch::{GemmAddend, GemmCall, GemmType};

/// What makes two products share one cuBLASLt plan (addresses do not).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct PlanKey {
    pub(super) ty: GemmType,
    pub(super) batch: usize,
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) trans_a: bool,
    pub(super) trans_b: bool,
    pub(super) stride_a: i64,
    pub(super) stride_b: i64,
    pub(super) stride_c: i64,
    pub(super) epilogue: Epilogue,
}

/// What a plan's descriptors add to the product (the addend's kind, not its address).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) enum Epilogue {
    /// `beta = 0`.
    None,
    /// `beta = 1`, C the addend.
    Accumulate,
    /// The bias epilogue; its pointer is set per call.
    Bias,
}

impl Epilogue {
    pub(super) fn of(a: GemmAddend) -> Epilogue {
        match a {
            GemmAddend::None => Epilogue::None,
            GemmAddend::Full(_) => Epilogue::Accumulate,
            GemmAddend::Bias(_) => Epilogue::Bias,
        }
    }
}

/// Byte alignment every call of a shape guarantees for each operand
/// (cuBLASLt's A, B, C, D: our B, A, the addend and C), at most 256.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct Alignment {
    pub(super) first: u32,
    pub(super) second: u32,
    pub(super) out: u32,
    /// cuBLASLt's C: the addend when the product accumulates, else the output.
    pub(super) addend: u32,
}

impl Alignment {
    /// The weakest of two alignments, operand by operand.
    pub(super) fn min(self, o: Alignment) -> Alignment {
        Alignment {
            first: self.first.min(o.first),
            second: self.second.min(o.second),
            out: self.out.min(o.out),
            addend: self.addend.min(o.addend),
        }
    }

    /// Whether a plan made for `self` suits calls of alignment `need`.
    pub(super) fn suits(self, need: Alignment) -> bool {
        self.min(need) == self
    }
}

/// One way to run a plan's products.
#[derive(Clone, Copy, Debug)]
pub(super) enum Candidate {
    /// A cuBLASLt algorithm for the plan's descriptors.
    Lt(ls::cublasLtMatmulAlgo_t),
    /// cuBLAS's `cublasGemmStridedBatchedEx` with its own heuristics
    /// (`super::cublas`), where the shape allows it.
    Cublas,
    /// Variant `.0` of our few-row kernels (`super::skinny::VARIANTS`),
    /// where the shape allows them.
    Skinny(usize),
    /// Variant `.0` of our small-f32 kernels (`super::tiled::VARIANTS`),
    /// where the shape allows them.
    Tiled(usize),
}

impl Candidate {
    /// The cuBLASLt algorithm, if this is one.
    pub(super) fn lt(&self) -> Option<&ls::cublasLtMatmulAlgo_t> {
        match self {
            Candidate::Lt(a) => Some(a),
            Candidate::Cublas | Candidate::Skinny(_) | Candidate::Tiled(_) => None,
        }
    }
}

/// Descriptors, the candidate algorithms and the chosen one for one shape.
pub(super) struct Plan {
    pub(super) desc: ls::cublasLtMatmulDesc_t,
    // In cuBLAS's column-major terms the first operand is our B and the second our A.
    pub(super) first: ls::cublasLtMatrixLayout_t,
    pub(super) second: ls::cublasLtMatrixLayout_t,
    pub(super) out: ls::cublasLtMatrixLayout_t,
    pub(super) align: Alignment,
    /// The heuristic's algorithms, best first (one when tuning is off),
    /// then any split-k variants, cuBLAS's GEMM and our own kernels that
    /// tuning adds.
    pub(super) candidates: Vec<Candidate>,
    /// The candidate every run uses: `candidates[0]` until tuned.
    pub(super) algo: Candidate,
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

impl Blas {
    /// The plan of shape `k` for operands of alignment `align`; `in_place`:
    /// every call of the shape that adds a tensor adds its own output.
    pub(super) fn plan(&self, k: &PlanKey, align: Alignment, in_place: bool) -> Result<Plan> {
        let dt = |t: GemmType| match t {
            GemmType::F32 | GemmType::Tf32 => ls::cudaDataType_t::CUDA_R_32F,
            GemmType::BF16 => ls::cudaDataType_t::CUDA_R_16BF,
            GemmType::F16 => ls::cudaDataType_t::CUDA_R_16F,
            GemmType::Fp8(_) => unreachable!("an FP8 product's types are its operands'"),
        };
        let fp8 = |f: Fp8Format| match f {
            Fp8Format::E4M3 => ls::cudaDataType_t::CUDA_R_8F_E4M3,
            Fp8Format::E5M2 => ls::cudaDataType_t::CUDA_R_8F_E5M2,
        };
        // In cuBLAS's terms: the first operand (our B), the second (our A),
        // and the output (and addend, and bias).
        let (first_dt, second_dt, out_dt) = match k.ty {
            GemmType::Fp8(f) => {
                let out = match f.out {
                    DType::F32 => GemmType::F32,
                    DType::F16 => GemmType::F16,
                    _ => GemmType::BF16,
                };
                (fp8(f.b), fp8(f.a), dt(out))
            }
            t => (dt(t), dt(t), dt(t)),
        };
        let compute = if k.ty == GemmType::Tf32 || (k.ty == GemmType::F32 && self.tf32) {
            ls::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            ls::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let (m, n, kk) = (k.m as u64, k.n as u64, k.k as u64);
        // Row-major C[m,n] = opA(A)·opB(B) is column-major Cᵀ[n,m] = opB(B)ᵀ·opA(A)ᵀ.
        // Stored row-major B ([k,n], or [n,k] transposed) is column-major [n,k] (or [k,n]).
        let (fr, fc) = if k.trans_b { (kk, n) } else { (n, kk) };
        let (sr, sc) = if k.trans_a { (m, kk) } else { (kk, m) };
        let layout = |dt, rows: u64, cols: u64, stride: i64| -> Result<ls::cublasLtMatrixLayout_t> {
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
        let first = layout(first_dt, fr, fc, k.stride_b)?;
        let second = layout(second_dt, sr, sc, k.stride_a)?;
        let out = layout(out_dt, n, m, k.stride_c)?;
        let desc = lr::create_matmul_desc(compute, ls::cudaDataType_t::CUDA_R_32F).map_err(|e| blas_err("desc", e))?;
        // From here on the plan owns the descriptors: an error below frees them.
        let mut plan = Plan {
            desc,
            first,
            second,
            out,
            align,
            candidates: Vec::new(),
            algo: Candidate::Lt(ls::cublasLtMatmulAlgo_t { data: [0; 8] }),
        };
        let (ta, tb) = (k.trans_b as i32, k.trans_a as i32);
        set_desc(desc, ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &ta, "transa")?;
        set_desc(desc, ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &tb, "transb")?;
        if k.epilogue == Epilogue::Bias {
            // Row-major rows of n are the column-major D's columns of n
            // rows: cuBLASLt's bias (one value per row of D) is our row
            // vector, of the output's type, the same for every batch entry.
            use ls::cublasLtMatmulDescAttributes_t as A;
            set_desc(
                desc,
                A::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                "epilogue",
            )?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &out_dt, "bias type")?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &0i64, "bias batch stride")?;
        }
        if let GemmType::Fp8(f) = k.ty {
            // The forward's e4m3 products accumulate fast, as Transformer
            // Engine's do; the gradient products (an e5m2 operand) keep the
            // tensor cores' partial sums promoted to full f32, which long
            // reductions over tokens need.
            let fast = i8::from(f.a == Fp8Format::E4M3 && f.b == Fp8Format::E4M3);
            use ls::cublasLtMatmulDescAttributes_t as A;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, "fast accumulation")?;
            // Scale pointers on the descriptor before the heuristic is asked,
            // as NVIDIA's FP8 sample sets them: the workspace's aligned
            // address stands in for the calls' own, which each call sets
            // (`Blas::enqueue`).
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &self.workspace, "scale")?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &self.workspace, "scale")?;
        }
        let ws = self.workspace_bytes;
        let wanted = if self.autotune { self.candidates } else { 1 };
        let found = self.heuristic(&plan, wanted).map_err(|e| match e {
            CudaError::Blas(msg) => CudaError::Blas(format!("no cuBLASLt algorithm for {k:?}: {msg}")),
            e => e,
        })?;
        plan.candidates = found
            .iter()
            .filter(|r| r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= ws)
            .map(|r| Candidate::Lt(r.algo))
            .collect();
        if self.autotune && self.split_k && super::autotune::few_tiles(k.batch, k.m, k.n, k.k) {
            let variants = self.split_k_variants(&plan);
            plan.candidates.extend(variants.into_iter().map(Candidate::Lt));
        }
        // Candidates beyond cuBLASLt's, each where it can run the shape: a
        // family's `only` (tests) makes its first the sole candidate, so
        // every run takes that path; otherwise tuning times them all.
        let mut offer = |only: bool, extra: &mut dyn Iterator<Item = Candidate>| {
            if only {
                plan.candidates = extra.take(1).collect();
            } else if self.autotune && !plan.candidates.is_empty() {
                plan.candidates.extend(extra);
            }
        };
        if let Some(cublas) = self.cublas.as_ref().filter(|_| super::cublas::eligible(k, in_place)) {
            offer(cublas.only, &mut std::iter::once(Candidate::Cublas));
        }
        if let Some(skinny) = self.skinny.as_ref().filter(|_| super::skinny::eligible(k, align)) {
            offer(skinny.only, &mut (0..super::skinny::VARIANTS.len()).map(Candidate::Skinny));
        }
        if let Some(tiled) = self.tiled.as_ref().filter(|_| super::tiled::eligible(k, self.tf32)) {
            offer(tiled.only, &mut (0..super::tiled::VARIANTS.len()).map(Candidate::Tiled));
        }
        plan.algo = *plan
            .candidates
            .first()
            .ok_or_else(|| CudaError::Blas(format!("no cuBLASLt algorithm for {k:?} ({align:?})")))?;
        Ok(plan)
    }

    /// Up to `wanted` of the heuristic's algorithms for `plan`'s
    /// descriptors, its workspace and its operands' alignment, best first.
    fn heuristic(&self, plan: &Plan, wanted: usize) -> Result<Vec<ls::cublasLtMatmulHeuristicResult_t>> {
        use ls::cublasLtMatmulPreferenceAttributes_t as P;
        let pref = lr::create_matmul_pref().map_err(|e| blas_err("preference", e))?;
        let ws = self.workspace_bytes;
        let a = plan.align;
        // SAFETY: a preference we own, given values of the documented types
        // (size_t workspace, uint32 alignments); the heuristic reads the
        // plan's descriptors and writes at most `wanted` results into a
        // buffer of that many (all-zero bytes are a valid result).
        unsafe {
            let set = |attr: P, value: *const c_void, size: usize| {
                lr::set_matmul_pref_attribute(pref, attr, value, size).map_err(|e| blas_err("preference", e))
            };
            let mut results: Vec<ls::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); wanted];
            let mut count = 0i32;
            let asked = (|| -> Result<()> {
                set(
                    P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const usize as _,
                    std::mem::size_of::<usize>(),
                )?;
                // The heuristic assumes 256-byte aligned operands unless told otherwise.
                for (attr, bytes) in [
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a.first),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a.second),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, a.addend),
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, a.out),
                ] {
                    set(attr, &bytes as *const u32 as _, 4)?;
                }
                ls::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.first,
                    plan.second,
                    plan.out,
                    plan.out,
                    pref,
                    wanted as i32,
                    results.as_mut_ptr(),
                    &mut count,
                )
                .result()
                .map_err(|e| blas_err("cublasLtMatmulAlgoGetHeuristic", e))
            })();
            lr::destroy_matmul_pref(pref).ok();
            asked?;
            results.truncate(count.clamp(0, wanted as i32) as usize);
            Ok(results)
        }
    }
}

/// Sets one attribute of a matmul descriptor to `value`, whose type must be
/// the one cuBLASLt documents for `attr` (int32 flags and enums, int64
/// strides, pointers as u64).
pub(super) fn set_desc<T>(
    desc: ls::cublasLtMatmulDesc_t,
    attr: ls::cublasLtMatmulDescAttributes_t,
    value: &T,
    what: &str,
) -> Result<()> {
    // SAFETY: `value` is a live T of size_of::<T>() bytes, which cuBLASLt
    // copies; the callers pass the attribute's documented type.
    unsafe { lr::set_matmul_desc_attribute(desc, attr, value as *const T as *const c_void, std::mem::size_of::<T>()) }
        .map_err(|e| blas_err(what, e))
}

pub(super) fn key_of(c: &GemmCall) -> PlanKey {
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
        epilogue: Epilogue::of(c.addend),
    }
}

/// The largest power of two, at most 256, dividing the address of every
/// batch entry of a matrix at `ptr` with `stride` elements between entries.
fn operand_alignment(ptr: u64, stride: i64, batch: usize, elem: u64) -> u32 {
    let mut x = ptr;
    if batch > 1 {
        x |= stride.unsigned_abs() * elem;
    }
    if x == 0 {
        return 256;
    }
    (1u64 << x.trailing_zeros().min(8)) as u32
}

pub(super) fn call_alignment(c: &GemmCall) -> Alignment {
    let (e, eo) = (c.ty.operand_bytes(), c.ty.out_bytes());
    let out = operand_alignment(c.c, c.stride_c, c.batch, eo);
    Alignment {
        first: operand_alignment(c.b, c.stride_b, c.batch, e),
        second: operand_alignment(c.a, c.stride_a, c.batch, e),
        out,
        addend: match c.addend {
            GemmAddend::Full(p) => operand_alignment(p, c.stride_c, c.batch, eo),
            GemmAddend::None | GemmAddend::Bias(_) => out,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_call;
    use super::*;

    #[test]
    fn alignment_covers_every_batch_entry() {
        assert_eq!(operand_alignment(0x1_0000, 0, 1, 4), 256);
        assert_eq!(operand_alignment(0x1_0010, 0, 1, 4), 16);
        assert_eq!(operand_alignment(0x1_0000, 6, 3, 4), 8);
        // A stride shared by no entry (batch 1) does not count.
        assert_eq!(operand_alignment(0x1_0000, 6, 1, 4), 256);
        let mut call = test_call(GemmType::BF16, 2, 4, 3, 0x3000);
        let a = call_alignment(&call);
        assert_eq!(a, Alignment { first: 16, second: 256, out: 8, addend: 8 });
        call.addend = GemmAddend::Full(0x2002);
        assert_eq!(call_alignment(&call).addend, 2);
        assert!(a.suits(call_alignment(&test_call(GemmType::BF16, 2, 4, 3, 0x3000))));
        assert!(!a.suits(call_alignment(&call)));
    }
}
