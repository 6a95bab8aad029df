//! Matrix products through cuBLASLt.
//!
//! [`lower_matmul`] turns a `matmul` node into a [`GemmCall`] (data);
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
//! [`MAX_CANDIDATES`] algorithms per shape and [`Blas::autotune`] times each
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
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::cublaslt::result as lr;
use cudarc::cublaslt::sys as ls;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use serde::Serialize;

/// How many algorithms the heuristic is asked for per shape when tuning.
pub const MAX_CANDIDATES: usize = 8;
/// Candidates whose median is within this fraction of the fastest count as
/// ties; the earliest in the heuristic's order wins a tie. Keeps the
/// heuristic's pick unless another is measurably faster, and makes the
/// choice less sensitive to noise between processes.
pub const TIE_TOLERANCE: f64 = 0.01;
/// Timed runs per candidate: at least this many...
const MIN_RUNS: usize = 3;
/// ...at most this many...
const MAX_RUNS: usize = 10;
/// ...and otherwise as many as fit in about this much GPU time.
const RUN_BUDGET_MS: f64 = 20.0;
/// A candidate whose first timed run takes longer than this multiple of the
/// best median so far is not timed further: it cannot win.
const PRUNE_FACTOR: f64 = 2.0;
/// The environment variable that turns tuning off (`0`, `off`, `false`, `no`).
pub const AUTOTUNE_ENV: &str = "STEPGRAPH_GEMM_AUTOTUNE";

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

/// Byte alignment every call of a shape guarantees for each operand
/// (cuBLASLt's A, B, C/D: our B, A and C), at most 256.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Alignment {
    first: u32,
    second: u32,
    out: u32,
}

/// Descriptors, the candidate algorithms and the chosen one for one shape.
struct Plan {
    desc: ls::cublasLtMatmulDesc_t,
    // In cuBLAS's column-major terms the first operand is our B and the second our A.
    first: ls::cublasLtMatrixLayout_t,
    second: ls::cublasLtMatrixLayout_t,
    out: ls::cublasLtMatrixLayout_t,
    align: Alignment,
    /// The heuristic's algorithms, best first (one when tuning is off).
    candidates: Vec<ls::cublasLtMatmulAlgo_t>,
    /// The algorithm every run uses: `candidates[0]` until tuned.
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

/// A cuBLASLt algorithm's configuration, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AlgoConfig {
    pub id: i32,
    pub tile: u32,
    pub stages: u32,
    pub split_k: u32,
}

impl std::fmt::Display for AlgoConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "algo {} tile {} stages {} split-k {}", self.id, self.tile, self.stages, self.split_k)
    }
}

/// The tuning of one product shape.
#[derive(Clone, Debug, Serialize)]
pub struct ShapeTuning {
    /// The shape as `CudaSession::profile` names it, e.g. `gemm_f32_2048x3200x8640_tb`.
    pub name: String,
    /// Products of this shape in one step.
    pub calls: usize,
    /// Algorithms the heuristic offered.
    pub candidates: usize,
    /// Index of the chosen one among them (0: the heuristic's first).
    pub chosen: usize,
    /// Median milliseconds per candidate, in the heuristic's order (`None`:
    /// not timed, or cuBLASLt refused to run it). Candidates cut short by
    /// pruning show their one timed run.
    pub candidate_ms: Vec<Option<f64>>,
    /// The chosen algorithm's median (`None` when nothing was timed).
    pub chosen_ms: Option<f64>,
    /// The heuristic's first algorithm's median.
    pub heuristic_ms: Option<f64>,
    pub chosen_algo: AlgoConfig,
    pub heuristic_algo: AlgoConfig,
    /// Wall milliseconds spent timing this shape in this session (0 when reused).
    pub tune_ms: f64,
    /// The choice came from an earlier session of this process.
    pub reused: bool,
    /// Why the shape was not timed, if it was not.
    pub skipped: Option<String>,
}

impl ShapeTuning {
    /// Milliseconds per step the choice saves over the heuristic's first pick.
    pub fn saved_ms_per_step(&self) -> f64 {
        match (self.heuristic_ms, self.chosen_ms) {
            (Some(h), Some(c)) => self.calls as f64 * (h - c),
            _ => 0.0,
        }
    }
}

/// What autotuning did in one session.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GemmTuning {
    pub enabled: bool,
    /// Wall milliseconds of [`Blas::autotune`], everything included.
    pub wall_ms: f64,
    /// One entry per product shape, in the order the step first uses them.
    pub shapes: Vec<ShapeTuning>,
}

impl GemmTuning {
    /// Milliseconds per step saved over the heuristic's first picks.
    pub fn saved_ms_per_step(&self) -> f64 {
        self.shapes.iter().map(ShapeTuning::saved_ms_per_step).sum()
    }
}

/// A choice remembered for the process: see the module doc.
#[derive(Clone)]
struct Remembered {
    algo: ls::cublasLtMatmulAlgo_t,
    record: ShapeTuning,
}

type ChoiceKey = (PlanKey, Alignment, bool);

fn remembered() -> &'static Mutex<HashMap<ChoiceKey, Remembered>> {
    static CHOICES: OnceLock<Mutex<HashMap<ChoiceKey, Remembered>>> = OnceLock::new();
    CHOICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Is tuning on, given the value of [`AUTOTUNE_ENV`]? On unless it says off.
pub fn autotune_setting(value: Option<&str>) -> bool {
    !matches!(value.map(|v| v.trim().to_ascii_lowercase()).as_deref(), Some("0" | "off" | "false" | "no"))
}

/// [`autotune_setting`] of the process environment.
pub fn autotune_from_env() -> bool {
    autotune_setting(std::env::var(AUTOTUNE_ENV).ok().as_deref())
}

/// A cuBLASLt handle, its workspace (inside the session's allocation) and
/// the plans of every product shape the step uses.
pub struct Blas {
    handle: ls::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    tf32: bool,
    autotune: bool,
    plans: HashMap<PlanKey, Plan>,
    /// Shapes in the order the step first uses them, with their call counts.
    order: Vec<(PlanKey, usize)>,
    tuning: GemmTuning,
}

impl Blas {
    /// Workspace cuBLASLt may use per call: what NVIDIA recommends for Hopper.
    pub const WORKSPACE_BYTES: usize = 32 << 20;

    /// With `autotune` off, every shape uses the heuristic's first algorithm.
    pub fn new(workspace: u64, workspace_bytes: usize, tf32: bool, autotune: bool) -> Result<Self> {
        // SAFETY: dlopen check only.
        if !unsafe { ls::is_culib_present() } {
            return Err(CudaError::Missing { lib: "cublasLt", hint: "install the CUDA toolkit's cuBLAS".into() });
        }
        let handle = lr::create_handle().map_err(|e| blas_err("cublasLtCreate", e))?;
        Ok(Blas {
            handle,
            workspace,
            workspace_bytes,
            tf32,
            autotune,
            plans: HashMap::new(),
            order: Vec::new(),
            tuning: GemmTuning { enabled: autotune, ..GemmTuning::default() },
        })
    }

    /// Plans every shape of `calls` (all products of the step, at once: a
    /// shape's plan must suit the operand alignment of each of its calls).
    pub fn plan_all(&mut self, calls: &[GemmCall]) -> Result<()> {
        let mut align: HashMap<PlanKey, Alignment> = HashMap::new();
        for c in calls {
            let key = key_of(c);
            let a = call_alignment(c);
            align
                .entry(key)
                .and_modify(|x| {
                    x.first = x.first.min(a.first);
                    x.second = x.second.min(a.second);
                    x.out = x.out.min(a.out);
                })
                .or_insert(a);
            match self.order.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += 1,
                None => self.order.push((key, 1)),
            }
        }
        for (key, _) in self.order.clone() {
            let Some(&a) = align.get(&key) else { continue };
            let suits = self
                .plans
                .get(&key)
                .is_some_and(|p| p.align.first <= a.first && p.align.second <= a.second && p.align.out <= a.out);
            if !suits {
                let plan = self.plan(&key, a)?;
                self.plans.insert(key, plan);
            }
        }
        Ok(())
    }

    fn plan(&self, k: &PlanKey, align: Alignment) -> Result<Plan> {
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
        // From here on the plan owns the descriptors: an error below frees them.
        let mut plan = Plan {
            desc,
            first,
            second,
            out,
            align,
            candidates: Vec::new(),
            algo: ls::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
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
        let ws = self.workspace_bytes;
        let wanted = if self.autotune { MAX_CANDIDATES } else { 1 };
        let found = self.heuristic(&plan, wanted).map_err(|e| match e {
            CudaError::Blas(msg) => CudaError::Blas(format!("no cuBLASLt algorithm for {k:?}: {msg}")),
            e => e,
        })?;
        plan.candidates = found
            .iter()
            .filter(|r| r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= ws)
            .map(|r| r.algo)
            .collect();
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
                    (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, a.out),
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

    /// Times each shape's candidates on one of its calls and keeps the
    /// fastest (see the module doc). Only calls whose whole output lies in
    /// `writable` are run, so memory outside it is never written; the caller
    /// vouches that `writable` holds no data yet. Runs on `stream` and
    /// waits for it. Does nothing when tuning is off.
    pub fn autotune(&mut self, calls: &[GemmCall], writable: Range<u64>, stream: &Arc<CudaStream>) -> Result<()> {
        if !self.autotune {
            return Ok(());
        }
        let t0 = Instant::now();
        let ctx = stream.context();
        let events: Vec<CudaEvent> =
            (0..=MAX_RUNS).map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))).collect::<Result<_, _>>()?;
        let mut shapes = Vec::with_capacity(self.order.len());
        for (key, n_calls) in self.order.clone() {
            let t_shape = Instant::now();
            let plan = &self.plans[&key];
            let call = calls.iter().find(|c| key_of(c) == key).expect("every ordered shape has a call");
            let choice_key = (key, plan.align, self.tf32);
            let heuristic_algo = self.config(&plan.candidates[0]);
            let mut record = ShapeTuning {
                name: shape_name(call),
                calls: n_calls,
                candidates: plan.candidates.len(),
                chosen: 0,
                candidate_ms: vec![None; plan.candidates.len()],
                chosen_ms: None,
                heuristic_ms: None,
                chosen_algo: heuristic_algo,
                heuristic_algo,
                tune_ms: 0.0,
                reused: false,
                skipped: None,
            };
            let earlier = remembered().lock().expect("choice cache").get(&choice_key).cloned();
            if let Some(r) = earlier.filter(|r| self.check(plan, &r.algo)) {
                self.plans.get_mut(&key).expect("planned").algo = r.algo;
                shapes.push(ShapeTuning { calls: n_calls, tune_ms: 0.0, reused: true, ..r.record });
                continue;
            }
            let target = calls.iter().find(|c| key_of(c) == key && writes_within(c, &writable));
            match (target, plan.candidates.len()) {
                (None, _) => record.skipped = Some("no call of this shape writes only to scratch memory".into()),
                (Some(_), 1) => record.skipped = Some("the heuristic offered one algorithm".into()),
                (Some(target), _) => {
                    let ms = self.time_candidates(plan, target, stream, &events)?;
                    let chosen = choose_fastest(&ms, TIE_TOLERANCE);
                    record.chosen = chosen.unwrap_or(0);
                    record.heuristic_ms = ms[0];
                    record.chosen_ms = ms[record.chosen];
                    record.chosen_algo = self.config(&plan.candidates[record.chosen]);
                    record.candidate_ms = ms;
                    if chosen.is_none() {
                        record.skipped = Some("cuBLASLt ran no candidate".into());
                    }
                }
            }
            record.tune_ms = t_shape.elapsed().as_secs_f64() * 1e3;
            let plan = self.plans.get_mut(&key).expect("planned");
            plan.algo = plan.candidates[record.chosen];
            if record.skipped.is_none() {
                let r = Remembered { algo: plan.algo, record: record.clone() };
                remembered().lock().expect("choice cache").insert(choice_key, r);
            }
            shapes.push(record);
        }
        stream.synchronize()?;
        self.tuning = GemmTuning { enabled: true, wall_ms: t0.elapsed().as_secs_f64() * 1e3, shapes };
        Ok(())
    }

    /// Median milliseconds of each candidate of `plan` on `call` (`None`:
    /// cuBLASLt refused it). `events` holds `MAX_RUNS + 1` timing events.
    fn time_candidates(
        &self,
        plan: &Plan,
        call: &GemmCall,
        stream: &Arc<CudaStream>,
        events: &[CudaEvent],
    ) -> Result<Vec<Option<f64>>> {
        let s = stream.cu_stream();
        let mut out = Vec::with_capacity(plan.candidates.len());
        let mut best = f64::INFINITY;
        for algo in &plan.candidates {
            // The warm-up loads the kernel (lazily loaded modules) and shows
            // whether cuBLASLt accepts the algorithm for these operands.
            if self.enqueue(plan, algo, call, s).is_err() {
                out.push(None);
                continue;
            }
            events[0].record(stream)?;
            self.enqueue(plan, algo, call, s)?;
            events[1].record(stream)?;
            let probe = events[0].elapsed_ms(&events[1])? as f64;
            if probe > PRUNE_FACTOR * best {
                out.push(Some(probe));
                continue;
            }
            let runs = timed_runs(probe);
            let mut times = vec![probe];
            for i in 1..runs {
                self.enqueue(plan, algo, call, s)?;
                events[i + 1].record(stream)?;
            }
            for i in 1..runs {
                times.push(events[i].elapsed_ms(&events[i + 1])? as f64);
            }
            let m = median(&mut times);
            best = best.min(m);
            out.push(Some(m));
        }
        Ok(out)
    }

    /// Does cuBLASLt accept `algo` for `plan`'s descriptors and workspace?
    fn check(&self, plan: &Plan, algo: &ls::cublasLtMatmulAlgo_t) -> bool {
        // SAFETY: descriptors we own; the result is plain data.
        unsafe {
            let mut r: ls::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
            ls::cublasLtMatmulAlgoCheck(
                self.handle,
                plan.desc,
                plan.first,
                plan.second,
                plan.out,
                plan.out,
                algo,
                &mut r,
            )
            .result()
            .is_ok()
                && r.workspaceSize <= self.workspace_bytes
        }
    }

    fn config(&self, algo: &ls::cublasLtMatmulAlgo_t) -> AlgoConfig {
        use ls::cublasLtMatmulAlgoConfigAttributes_t as A;
        let get = |attr: A| -> u32 {
            let (mut v, mut written) = (0u32, 0usize);
            // SAFETY: every attribute read here is a 4-byte integer.
            unsafe {
                ls::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut written)
            };
            v
        };
        AlgoConfig {
            id: get(A::CUBLASLT_ALGO_CONFIG_ID) as i32,
            tile: get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
            stages: get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            split_k: get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        }
    }

    /// What autotuning did in this session (empty when off).
    pub fn tuning(&self) -> &GemmTuning {
        &self.tuning
    }

    /// Enqueues `call` on `stream` (prepared earlier). Captures into a graph as is.
    pub fn run(&self, call: &GemmCall, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        let plan = self.plans.get(&key_of(call)).ok_or_else(|| CudaError::Blas("product was not prepared".into()))?;
        self.enqueue(plan, &plan.algo, call, stream)
    }

    fn enqueue(
        &self,
        plan: &Plan,
        algo: &ls::cublasLtMatmulAlgo_t,
        call: &GemmCall,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        // beta = 0: the output is overwritten, never accumulated into.
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
                algo,
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

fn elem_bytes(ty: GemmType) -> u64 {
    match ty {
        GemmType::F32 => 4,
        GemmType::BF16 | GemmType::F16 => 2,
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

fn call_alignment(c: &GemmCall) -> Alignment {
    let e = elem_bytes(c.ty);
    Alignment {
        first: operand_alignment(c.b, c.stride_b, c.batch, e),
        second: operand_alignment(c.a, c.stride_a, c.batch, e),
        out: operand_alignment(c.c, c.stride_c, c.batch, e),
    }
}

/// Does every byte `call` writes lie in `range`?
fn writes_within(call: &GemmCall, range: &Range<u64>) -> bool {
    let elems = (call.batch.max(1) as u64 - 1) * call.stride_c.max(0) as u64 + (call.m * call.n) as u64;
    let end = call.c.checked_add(elems * elem_bytes(call.ty));
    call.c >= range.start && end.is_some_and(|e| e <= range.end)
}

/// A product's shape as the session's profile names it:
/// `gemm_{dtype}_{m}x{n}x{k}` with `_ta`, `_tb` for transposed operands and
/// `_b{batch}` when batched.
pub fn shape_name(g: &GemmCall) -> String {
    format!(
        "gemm_{}_{}x{}x{}{}{}{}",
        format!("{:?}", g.ty).to_lowercase(),
        g.m,
        g.n,
        g.k,
        if g.trans_a { "_ta" } else { "" },
        if g.trans_b { "_tb" } else { "" },
        if g.batch > 1 { format!("_b{}", g.batch) } else { String::new() }
    )
}

/// The median of `xs` (the mean of the middle two for an even count).
fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Timed runs for a candidate whose first run took `probe_ms`.
fn timed_runs(probe_ms: f64) -> usize {
    if probe_ms.is_nan() || probe_ms <= 0.0 {
        return MAX_RUNS;
    }
    ((RUN_BUDGET_MS / probe_ms) as usize).clamp(MIN_RUNS, MAX_RUNS)
}

/// Index of the fastest candidate by median time: the earliest (in the
/// heuristic's order) of those within `tolerance` of the minimum. `None`
/// when no candidate has a time.
fn choose_fastest(medians: &[Option<f64>], tolerance: f64) -> Option<usize> {
    let best = medians.iter().flatten().copied().filter(|t| t.is_finite()).min_by(|a, b| a.total_cmp(b))?;
    medians.iter().position(|t| t.is_some_and(|t| t.is_finite() && t <= best * (1.0 + tolerance)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(ty: GemmType, batch: usize, m: usize, n: usize, c: u64) -> GemmCall {
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
        }
    }

    #[test]
    fn the_fastest_median_wins_and_ties_keep_heuristic_order() {
        assert_eq!(choose_fastest(&[Some(2.0), Some(1.0), Some(1.5)], 0.01), Some(1));
        // Within 1% of the best: the heuristic's earlier candidate wins.
        assert_eq!(choose_fastest(&[Some(1.005), Some(1.0), Some(0.999)], 0.01), Some(0));
        assert_eq!(choose_fastest(&[Some(1.0), Some(1.0)], 0.0), Some(0));
        assert_eq!(choose_fastest(&[Some(3.0), Some(2.0), Some(2.0)], 0.0), Some(1));
        // Refused or broken candidates never win.
        assert_eq!(choose_fastest(&[None, Some(2.0), Some(f64::NAN)], 0.01), Some(1));
        assert_eq!(choose_fastest(&[None, None], 0.01), None);
        assert_eq!(choose_fastest(&[], 0.01), None);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut [5.0, 0.1, 0.2, 9.0, 0.3]), 0.3);
    }

    #[test]
    fn timed_runs_fit_the_budget_within_bounds() {
        assert_eq!(timed_runs(0.01), MAX_RUNS);
        assert_eq!(timed_runs(5.0), 4);
        assert_eq!(timed_runs(100.0), MIN_RUNS);
        assert_eq!(timed_runs(0.0), MAX_RUNS);
    }

    #[test]
    fn the_env_setting_is_on_unless_it_says_off() {
        assert!(autotune_setting(None));
        assert!(autotune_setting(Some("1")));
        assert!(autotune_setting(Some("on")));
        for off in ["0", "off", "OFF", "false", " no "] {
            assert!(!autotune_setting(Some(off)), "{off}");
        }
    }

    #[test]
    fn alignment_covers_every_batch_entry() {
        assert_eq!(operand_alignment(0x1_0000, 0, 1, 4), 256);
        assert_eq!(operand_alignment(0x1_0010, 0, 1, 4), 16);
        assert_eq!(operand_alignment(0x1_0000, 6, 3, 4), 8);
        // A stride shared by no entry (batch 1) does not count.
        assert_eq!(operand_alignment(0x1_0000, 6, 1, 4), 256);
        let a = call_alignment(&call(GemmType::BF16, 2, 4, 3, 0x3000));
        assert_eq!(a, Alignment { first: 16, second: 256, out: 8 });
    }

    #[test]
    fn timing_only_writes_inside_the_scratch_range() {
        let c = call(GemmType::F32, 2, 4, 8, 0x1000);
        // Two [4, 8] f32 outputs: 256 bytes from 0x1000.
        assert!(writes_within(&c, &(0x1000..0x1100)));
        assert!(!writes_within(&c, &(0x1000..0x10ff)));
        assert!(!writes_within(&c, &(0x1001..0x2000)));
        assert!(writes_within(&call(GemmType::BF16, 1, 4, 8, 0x1000), &(0x1000..0x1040)));
    }

    #[test]
    fn shape_names_match_the_profile() {
        let mut c = call(GemmType::F32, 1, 2048, 3200, 0);
        c.k = 8640;
        assert_eq!(shape_name(&c), "gemm_f32_2048x3200x8640_tb");
        c.batch = 4;
        c.trans_a = true;
        c.trans_b = false;
        assert_eq!(shape_name(&c), "gemm_f32_2048x3200x8640_ta_b4");
    }

    #[test]
    fn savings_count_every_call_of_a_shape() {
        let t = ShapeTuning {
            name: "g".into(),
            calls: 10,
            candidates: 3,
            chosen: 2,
            candidate_ms: vec![Some(2.0), None, Some(1.5)],
            chosen_ms: Some(1.5),
            heuristic_ms: Some(2.0),
            chosen_algo: AlgoConfig::default(),
            heuristic_algo: AlgoConfig::default(),
            tune_ms: 1.0,
            reused: false,
            skipped: None,
        };
        assert_eq!(t.saved_ms_per_step(), 5.0);
    }
}
