//! Autotuning of cuBLASLt algorithms (see the `blas` module doc): timing
//! each shape's candidates once per session, choosing the fastest median,
//! remembering the choice for the process, and reporting what was done.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::cublaslt::sys as ls;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use serde::Serialize;

use super::plan::{key_of, Alignment, Candidate, Plan, PlanKey};
use super::{shape_name, Blas};
use crate::error::Result;
use crate::launch::GemmCall;

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
        if self.id == super::cublas::CUBLAS_ALGO_ID {
            return write!(f, "cuBLAS GemmEx");
        }
        if self.id == super::skinny::SKINNY_ALGO_ID {
            let ring = if self.stages == 1 { " async" } else { "" };
            return write!(f, "skinny w{} u{}{ring}", self.tile, self.split_k);
        }
        if self.id == super::tiled::TILED_ALGO_ID {
            return write!(f, "tiled {}x{}", self.tile, self.stages);
        }
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

/// Split-k counts tried on top of the heuristic's candidates for a
/// product of few output tiles ([`few_tiles`]): they leave most SMs idle
/// unless the depth is split among them, and the heuristic rarely offers
/// that.
pub const SPLIT_K_TRIED: [u32; 4] = [2, 4, 8, 16];
/// How many of the heuristic's candidates get split-k variants.
const SPLIT_K_BASES: usize = 4;

/// Does a `batch` of `m × n` outputs over depth `k` have few output tiles:
/// fewer 128 × 128 tiles than two waves of an H100's or H200's 132 SMs,
/// with depth enough to split (a decode step's projections, W3's 256-wide
/// products, W2's down projection to 28 columns)?
pub fn few_tiles(batch: usize, m: usize, n: usize, k: usize) -> bool {
    k >= 256 && batch.max(1) * m.div_ceil(128) * n.div_ceil(128) < 256
}

/// A choice remembered for the process: see the module doc.
#[derive(Clone)]
struct Remembered {
    algo: Candidate,
    record: ShapeTuning,
}

type ChoiceKey = (PlanKey, Alignment, bool);

fn remembered() -> &'static Mutex<HashMap<ChoiceKey, Remembered>> {
    static CHOICES: OnceLock<Mutex<HashMap<ChoiceKey, Remembered>>> = OnceLock::new();
    CHOICES.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Blas {
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
            if let Some(r) = earlier.filter(|r| self.usable(plan, &r.algo)) {
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
            // whether the library accepts the candidate for these operands.
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

    /// Can `candidate` still run `plan`'s products: cuBLASLt accepts the
    /// algorithm for the plan's descriptors and workspace, or it is cuBLAS's
    /// GEMM or one of our own kernels and the session has them (the plan
    /// only lists them for shapes that allow them)?
    fn usable(&self, plan: &Plan, candidate: &Candidate) -> bool {
        match candidate {
            Candidate::Lt(algo) => self.check(plan, algo),
            Candidate::Cublas => self.cublas.is_some(),
            Candidate::Skinny(_) => self.skinny.is_some(),
            Candidate::Tiled(_) => self.tiled.is_some(),
        }
    }

    /// Does cuBLASLt accept `algo` for `plan`'s descriptors and workspace?
    fn check(&self, plan: &Plan, algo: &ls::cublasLtMatmulAlgo_t) -> bool {
        // SAFETY: the handle and the plan's descriptors are live (owned by
        // `self` and `plan`); `r` is a plain-data out-struct, valid zeroed.
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

    /// Split-k variants of the first [`SPLIT_K_BASES`] candidates of
    /// `plan` that do not split already: each count of [`SPLIT_K_TRIED`]
    /// with the first reduction scheme the algorithm supports (in place,
    /// else in the compute type, else in the output type; each sums the
    /// parts in a fixed order) that cuBLASLt accepts for the plan and its
    /// workspace.
    pub(super) fn split_k_variants(&self, plan: &Plan) -> Vec<ls::cublasLtMatmulAlgo_t> {
        use ls::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use ls::cublasLtMatmulAlgoConfigAttributes_t as A;
        use ls::cublasLtReductionScheme_t as R;
        let cap = |algo: &ls::cublasLtMatmulAlgo_t, attr: Cap| -> u32 {
            let (mut v, mut written) = (0u32, 0usize);
            // SAFETY: both capabilities read here are 4-byte integers.
            let ok = unsafe {
                ls::cublasLtMatmulAlgoCapGetAttribute(algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut written)
            };
            if ok.result().is_ok() {
                v
            } else {
                0
            }
        };
        let mut out: Vec<ls::cublasLtMatmulAlgo_t> = Vec::new();
        for base in plan.candidates.iter().filter_map(Candidate::lt).take(SPLIT_K_BASES) {
            if lt_config(base).split_k > 1 || cap(base, Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) == 0 {
                continue;
            }
            let schemes = cap(base, Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
            for split in SPLIT_K_TRIED {
                for scheme in [
                    R::CUBLASLT_REDUCTION_SCHEME_INPLACE,
                    R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                    R::CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE,
                ] {
                    if schemes & scheme as u32 == 0 {
                        continue;
                    }
                    let mut v = *base;
                    let scheme = scheme as u32;
                    // SAFETY: `v` is our copy of an algorithm; both
                    // attributes are 4-byte integers.
                    let set = unsafe {
                        ls::cublasLtMatmulAlgoConfigSetAttribute(
                            &mut v,
                            A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                            &split as *const u32 as *const c_void,
                            4,
                        )
                        .result()
                        .is_ok()
                            && ls::cublasLtMatmulAlgoConfigSetAttribute(
                                &mut v,
                                A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                &scheme as *const u32 as *const c_void,
                                4,
                            )
                            .result()
                            .is_ok()
                    };
                    if set && self.check(plan, &v) {
                        let lt = plan.candidates.iter().filter_map(Candidate::lt);
                        if !lt.chain(&out).any(|c| c.data == v.data) {
                            out.push(v);
                        }
                        break;
                    }
                }
            }
        }
        out
    }

    /// What a report says of `candidate`: its cuBLASLt configuration, or
    /// [`CUBLAS_ALGO_ID`](super::cublas::CUBLAS_ALGO_ID) for cuBLAS's GEMM.
    fn config(&self, candidate: &Candidate) -> AlgoConfig {
        match candidate {
            Candidate::Lt(algo) => lt_config(algo),
            Candidate::Cublas => AlgoConfig { id: super::cublas::CUBLAS_ALGO_ID, ..AlgoConfig::default() },
            Candidate::Skinny(v) => {
                // Stages 0: the register pipeline; 1: the cp.async rings.
                let (warps, unroll, ring) = super::skinny::VARIANTS[*v];
                AlgoConfig { id: super::skinny::SKINNY_ALGO_ID, tile: warps, stages: ring as u32, split_k: unroll }
            }
            Candidate::Tiled(v) => {
                let (rows, cols) = super::tiled::VARIANTS[*v];
                AlgoConfig { id: super::tiled::TILED_ALGO_ID, tile: rows, stages: cols, split_k: 0 }
            }
        }
    }

    /// What autotuning did in this session (empty when off).
    pub fn tuning(&self) -> &GemmTuning {
        &self.tuning
    }
}

/// A cuBLASLt algorithm's configuration.
fn lt_config(algo: &ls::cublasLtMatmulAlgo_t) -> AlgoConfig {
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

/// Does every byte `call` writes lie in `range`?
fn writes_within(call: &GemmCall, range: &Range<u64>) -> bool {
    let elems = (call.batch.max(1) as u64 - 1) * call.stride_c.max(0) as u64 + (call.m * call.n) as u64;
    let end = call.c.checked_add(elems * call.ty.out_bytes());
    call.c >= range.start && end.is_some_and(|e| e <= range.end)
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
    use super::super::test_call;
    use super::*;
    use crate::launch::GemmType;

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
    fn decode_and_small_products_have_few_tiles_and_training_products_do_not() {
        // W6's decode projections at batch 16: o and down, q/k/v as a batch of 3.
        assert!(few_tiles(1, 16, 3200, 3200) && few_tiles(1, 16, 3200, 8640) && few_tiles(3, 16, 3200, 3200));
        // W3's 256-wide products; W2's down projection to 28 columns.
        assert!(few_tiles(1, 256, 256, 256) && few_tiles(1, 4096, 28, 18944));
        // W5's products, Qwen's 152064-entry vocabulary head at decode, and tiny depths are left to the heuristic.
        assert!(!few_tiles(1, 8192, 3200, 3200) && !few_tiles(1, 16, 152064, 3584) && !few_tiles(1, 16, 64, 64));
    }

    #[test]
    fn timing_only_writes_inside_the_scratch_range() {
        let c = test_call(GemmType::F32, 2, 4, 8, 0x1000);
        // Two [4, 8] f32 outputs: 256 bytes from 0x1000.
        assert!(writes_within(&c, &(0x1000..0x1100)));
        assert!(!writes_within(&c, &(0x1000..0x10ff)));
        assert!(!writes_within(&c, &(0x1001..0x2000)));
        assert!(writes_within(&test_call(GemmType::BF16, 1, 4, 8, 0x1000), &(0x1000..0x1040)));
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
