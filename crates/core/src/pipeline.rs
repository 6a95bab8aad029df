//! The step pipeline, assembled in one place: model spec → forward trace →
//! step trace (autodiff, with its micro-batches of gradient accumulation)
//! → the step of one data-parallel rank (optional,
//! [`crate::dist::DataParallelRewrite`]) → the passes ([`crate::passes`],
//! through [`run_passes`]): adds folded into the products and norms that
//! produce their operands ([`crate::passes::fusion`]), the optimizer moved
//! into backward ([`crate::passes::optimizer_placement`], train steps),
//! recomputation ([`crate::passes::recompute`]), the 3xTF32 split
//! (optional, [`crate::passes::tf32`]) → memory plan (the one the passes
//! left, not planned again) → `check_plan`.
//!
//! [`trace_step`] runs the stages up to the step trace; [`compile_step`]
//! runs them all and returns a [`CompiledStep`]: the step with a plan that
//! `check_plan` has proved, ready to bind to a backend session
//! ([`crate::session::Session`]). Every command and the data-parallel
//! builders go through these two functions, so a stage added here reaches
//! all of them.
//!
//! Under a memory budget that a step of adapters misses without
//! recomputing, [`compile_step`] builds it with its frozen embedding table
//! in host memory ([`PlanOptions::host_tables`]) before anything is
//! recomputed, and keeps that step when a table moved.
//!
//! A memory budget that recomputation cannot meet makes [`compile_step`]
//! build the step again with every MLP in 2, 4, 8, … row tiles
//! ([`crate::models::ForwardOptions::mlp_tiles`]; tiles of at least
//! `n_embd` rows): each tile's
//! intermediates then live only while backward works on that tile. It
//! stops at the first tiling that meets the budget, or refuses once a
//! doubling (after the first) no longer lowers the least planned peak,
//! naming the least it reached and its tiling.
//!
//! Recomputation comes before offload, as the bus is slower than
//! recomputing most values; but not all: recomputing attention grows with
//! the square of the sequence, and at long sequences it takes longer than
//! a round trip of its output over the bus. When the step [`compile_step`]
//! chose recomputes such a value, it builds the step again with those
//! values left to the offload pass ([`RecomputePolicy::LeastBeforeOffload`]
//! at [`StepOptions::bus_bytes_per_s`]) and keeps that step when it fits the
//! budget and [`StepOptions::host_budget`] and its estimated added time
//! (recomputation at the roofline, copies at that bus speed, not counting
//! their overlap) is lower.
//!
//! [`build_rank_step`] and [`plan_data_parallel`] build and plan the step
//! of one data-parallel rank through the same two functions.
//!
//! In debug builds (tests) the verifier runs after every stage
//! ([`verify_after`]), so a pass that breaks an IR invariant is named by
//! its error instead of surfacing later as a bad plan or a wrong number.
//!
//! **Invariant:** a [`CompiledStep`]'s plan belongs to its step and has
//! passed `check_plan`.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::autodiff::{build_accumulated_step, StepKind, TrainOptions};
use crate::dist::{rank_spec, DataParallel, DataParallelRewrite};
use crate::error::{Error, Result};
use crate::ir::{Trace, ValueId};
use crate::models::{build_forward_opts, ForwardOptions, ModelSpec};
use crate::passes::fp8::Fp8Products;
use crate::passes::fusion::{Epilogues, Fold, FusionReport};
use crate::passes::offload::Offload;
use crate::passes::optimizer_placement::{OptimizerPlacement, PlaceOptimizer, PlacementReport};
use crate::passes::recompute::{Recompute, RecomputePolicy, RecomputeReport};
use crate::passes::tf32::SplitF32Products;
use crate::passes::{run_passes, verify_after, F32Products, Pass, PassContext, PassReport};
use crate::plan::{check_plan, plan_report, MemoryPlan, PlanOptions, PlanReport};

/// What one step computes and how it is built, besides the model spec.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StepOptions {
    /// Forward only, gradients out, or gradients consumed by AdamW.
    pub kind: StepKind,
    /// Optimizer settings and the dtype of its state (train steps).
    pub train: TrainOptions,
    /// Build the step of one rank of a data-parallel group: the spec's batch
    /// is the global batch, and each rank takes its rows.
    pub data_parallel: Option<DataParallel>,
    /// Planner settings.
    pub plan: PlanOptions,
    /// What to recompute in backward instead of keeping (default: cheap
    /// values, when that lowers the peak; or down to a memory budget).
    pub recompute: RecomputePolicy,
    /// Where a train step's optimizer runs (default: in backward unless
    /// that raises the planned peak).
    pub optimizer: OptimizerPlacement,
    /// Row tiles of every MLP (default 1: untiled); under a memory budget
    /// [`compile_step`] tries more when these do not suffice.
    pub mlp_tiles: usize,
    /// Micro-batches of gradient accumulation inside the step (default 1):
    /// the step inputs hold this many micro-batches of the spec's batch,
    /// and a train step updates once ([`build_accumulated_step`]).
    pub grad_accum: usize,
    /// Fold adds into the kernels that produce their operands (default on).
    pub epilogues: Epilogues,
    /// Exact f32 products (default), or each as three TF32 products of
    /// split operands ([`crate::passes::split_f32_products`]).
    pub f32_products: F32Products,
    /// Products in the model's dtype (default), or the decoder layers'
    /// linear layers as FP8 products ([`crate::passes::fp8`]).
    pub fp8: Fp8Mode,
    /// Under a memory budget that recomputation and MLP tiling cannot
    /// meet, keep values backward reads in page-locked host memory between
    /// forward and backward ([`crate::passes::offload`]; default on). Not
    /// serialized: where a value waits changes no value, so it is no part
    /// of a run's resume identity.
    #[serde(skip)]
    pub offload: bool,
    /// Page-locked host memory the step may plan (`None`: no limit).
    /// Offloading a value instead of recomputing it is chosen only within
    /// it ([`compile_step`]); not serialized, as `offload`.
    #[serde(skip)]
    pub host_budget: Option<u64>,
    /// The host link speed the planner assumes when it weighs a round trip
    /// to host memory against recomputation (default
    /// [`PLANNING_BUS_BYTES_PER_S`]); not serialized, as `offload`.
    #[serde(skip)]
    pub bus_bytes_per_s: u64,
}

impl StepOptions {
    /// A step of `kind` with default optimizer and planner settings, on one device.
    pub fn new(kind: StepKind) -> Self {
        StepOptions {
            kind,
            train: TrainOptions::default(),
            data_parallel: None,
            plan: PlanOptions::default(),
            recompute: RecomputePolicy::default(),
            optimizer: OptimizerPlacement::default(),
            mlp_tiles: 1,
            grad_accum: 1,
            epilogues: Epilogues::default(),
            f32_products: F32Products::default(),
            fp8: Fp8Mode::default(),
            offload: true,
            host_budget: None,
            bus_bytes_per_s: PLANNING_BUS_BYTES_PER_S,
        }
    }

    /// The step exactly as autodiff (and the data-parallel rewrite) built
    /// it: no folded adds, no recomputation, the optimizer after backward.
    pub fn unoptimized(kind: StepKind) -> Self {
        StepOptions {
            recompute: RecomputePolicy::Off,
            optimizer: OptimizerPlacement::AfterBackward,
            epilogues: Epilogues::Off,
            ..Self::new(kind)
        }
    }
}

/// Which products a step computes in FP8 (`--fp8`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Mode {
    /// Every product in the model's dtype.
    #[default]
    Off,
    /// The linear layers of the decoder layers (forward, input gradients
    /// and weight gradients) as FP8 products with current per-tensor
    /// scaling; the output head, the router, attention, the experts of a
    /// mixture and the adapters of a LoRA run stay in the model's dtype
    /// ([`crate::passes::fp8`]).
    Products,
}

/// The traces of one step, before planning.
#[derive(Clone, Debug)]
pub struct StepTraces {
    /// The spec the traces were built for: with data parallelism, one rank's rows.
    pub spec: ModelSpec,
    /// The model's forward trace (parameter names, initial weights, printing).
    pub forward: Trace,
    /// The step trace: a rank's step under data parallelism.
    pub step: Trace,
    /// Bytes of each gradient bucket a rank reduces per step, in order
    /// (empty without data parallelism).
    pub buckets: Vec<u64>,
}

/// A step and its checked memory plan.
#[derive(Clone, Debug)]
pub struct CompiledStep {
    /// The spec the step was built for: with data parallelism, one rank's rows.
    pub spec: ModelSpec,
    pub forward: Trace,
    pub step: Trace,
    /// The plan of `step`, proved by `check_plan`.
    pub plan: MemoryPlan,
    /// As [`StepTraces::buckets`].
    pub buckets: Vec<u64>,
    /// What each pass did ([`run_passes`]'s report): read through
    /// [`CompiledStep::placement`], [`CompiledStep::recompute`] and
    /// [`CompiledStep::fusion`].
    pub passes: PassReport,
}

impl CompiledStep {
    /// Where the optimizer runs (train steps).
    pub fn placement(&self) -> Option<&PlacementReport> {
        self.passes.placement.as_ref()
    }

    /// What is recomputed in backward, and the MLP tiling the step was built with.
    pub fn recompute(&self) -> &RecomputeReport {
        self.passes.recompute.as_ref().expect("every step runs the recompute pass")
    }

    /// The adds folded into the kernels that produce their operands.
    pub fn fusion(&self) -> &FusionReport {
        &self.passes.fusion
    }

    /// Persistent buffer plus arena.
    pub fn planned_peak_bytes(&self) -> u64 {
        self.plan.planned_peak_bytes()
    }

    /// The step inputs (token ids, targets, learning rate, step count) by name.
    pub fn input_names(&self) -> Vec<(&str, ValueId)> {
        self.step.inputs().map(|v| (self.step.value(v).kind.leaf_name().expect("an input is a leaf"), v)).collect()
    }

    /// Elements of every parameter.
    pub fn param_count(&self) -> usize {
        self.step.params().map(|p| self.step.ty(p).numel()).sum()
    }
}

/// [`verify_after`] in debug builds only (tests build with debug
/// assertions): what the pipeline runs after each stage.
fn debug_verify_after(pass: &str, trace: &Trace) -> Result<()> {
    if cfg!(debug_assertions) {
        verify_after(pass, trace)
    } else {
        Ok(())
    }
}

/// Builds the traces of a step: the forward trace of `spec` (of one rank's
/// rows under data parallelism), autodiff to `opts.kind`, and the
/// data-parallel rewrite. Checks the data-parallel settings and the batch
/// split before building anything.
pub fn trace_step(spec: &ModelSpec, opts: &StepOptions) -> Result<StepTraces> {
    if opts.fp8 == Fp8Mode::Products && !matches!(spec.dtype, crate::ir::DType::BF16 | crate::ir::DType::F16) {
        return Err(Error::Config {
            model: spec.config.name.clone(),
            reason: format!(
                "--fp8 products runs the products of a bf16 or f16 model, and this one is {} (use --dtype bf16)",
                spec.dtype
            ),
        });
    }
    let spec = match &opts.data_parallel {
        Some(dp) => {
            dp.check()?;
            rank_spec(spec, dp.world)?
        }
        None => spec.clone(),
    };
    let forward = build_forward_opts(
        &spec,
        &ForwardOptions {
            mlp_tiles: opts.mlp_tiles,
            training: opts.kind == StepKind::Train,
            fp8_products: opts.fp8 == Fp8Mode::Products,
            ..ForwardOptions::default()
        },
    )?;
    debug_verify_after("forward", &forward)?;
    let step = build_accumulated_step(&forward, opts.kind, &opts.train, opts.grad_accum)?;
    debug_verify_after("autodiff", &step)?;
    let (step, buckets) = match &opts.data_parallel {
        Some(dp) => {
            let mut cx = PassContext::new(opts.plan);
            let step = run_passes(&step, &[&DataParallelRewrite(dp.clone())], &mut cx)?;
            (step, cx.report.buckets.unwrap_or_default())
        }
        None => (step, Vec::new()),
    };
    Ok(StepTraces { spec, forward, step, buckets })
}

/// The most row tiles [`compile_step`] tries for a memory budget, however
/// narrow the model (it also keeps `n_embd` rows per tile).
pub const MAX_MLP_TILES: usize = 256;

/// The whole pipeline: [`trace_step`], then the memory plan, proved by
/// `check_plan` before it is returned. Under a memory budget that
/// `opts.mlp_tiles` cannot meet, tries twice the tiles, and again, as the
/// module doc says.
pub fn compile_step(spec: &ModelSpec, opts: &StepOptions) -> Result<CompiledStep> {
    compile_step_timed(spec, opts).map(|(c, _)| c)
}

/// Wall time of the two halves of [`compile_step`], for start-up reports
/// ([`crate::session::StartupTimes`]).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct CompileTimes {
    /// [`trace_step`]: the model builder, autodiff, the data-parallel rewrite.
    pub build: Duration,
    /// The passes (their time is mostly the plans they choose by), the
    /// memory plan and `check_plan`.
    pub plan: Duration,
}

/// [`compile_step`], timing its halves (of the tiling that is returned).
pub fn compile_step_timed(spec: &ModelSpec, opts: &StepOptions) -> Result<(CompiledStep, CompileTimes)> {
    let first = compile_budgeted(spec, opts);
    // Under a budget that the step misses without recomputing, frozen
    // embedding tables (a base under adapters) move to host memory first:
    // a step reads one row per token of them over the bus, far cheaper
    // than any recomputation. Only adapters make frozen weights.
    let RecomputePolicy::Budget(_) = opts.recompute else { return first };
    if opts.plan.host_tables || spec.adapters.is_none() {
        return first;
    }
    let misses = match &first {
        Ok((c, _)) => !c.recompute().recomputed.is_empty() || c.recompute().mlp_tiles > opts.mlp_tiles.max(1),
        Err(Error::MemoryBudget { .. }) => true,
        Err(_) => false,
    };
    if !misses {
        return first;
    }
    let hosted = StepOptions { plan: PlanOptions { host_tables: true, ..opts.plan }, ..opts.clone() };
    let second = compile_budgeted(spec, &hosted);
    let hosted_is_better = match (&first, &second) {
        // No table moved (the head reads the embedding): the same step.
        (_, Ok((c, _))) => c.plan.host_table_bytes > 0,
        (Err(Error::MemoryBudget { least: a, .. }), Err(Error::MemoryBudget { least: b, .. })) => b < a,
        _ => false,
    };
    if hosted_is_better {
        second
    } else {
        first
    }
}

/// The bus speed the planner assumes when it weighs a round trip to host
/// memory against recomputation: what a PCIe 5.0 ×16 link moves each way
/// in practice (the CUDA session measures the real one when it opens).
pub const PLANNING_BUS_BYTES_PER_S: u64 = 50_000_000_000;

/// [`compile_step_timed`] without host tables: recomputation, then MLP
/// tiles, then offload, and offload instead of the recomputations that
/// take longer than the bus, as the module doc says.
fn compile_budgeted(spec: &ModelSpec, opts: &StepOptions) -> Result<(CompiledStep, CompileTimes)> {
    let chosen = compile_recomputing_first(spec, opts)?;
    let (Some(budget), true) = (opts.recompute.budget(), opts.offload) else { return Ok(chosen) };
    let (c, bus) = (&chosen.0, opts.bus_bytes_per_s);
    let slow = |r: &crate::passes::recompute::RecomputedNode| {
        r.seconds > crate::passes::recompute::round_trip_seconds(r.bytes, bus)
    };
    if !c.recompute().recomputed.iter().any(slow) {
        return Ok(chosen);
    }
    let offloading = StepOptions {
        mlp_tiles: c.recompute().mlp_tiles,
        recompute: RecomputePolicy::LeastBeforeOffload { budget, bus_bytes_per_s: bus },
        ..opts.clone()
    };
    let added_seconds = |c: &CompiledStep| {
        let moved = c.passes.offload.as_ref().map_or(0, |o| o.bytes_moved);
        c.recompute().estimated_seconds + moved as f64 / bus as f64
    };
    let why_not = match compile_tiled(spec, &offloading) {
        Err(Error::MemoryBudget { least, .. }) => Some(format!(
            "offloading them instead would plan at least {least} B ({:.3} GB), over the budget",
            least as f64 / 1e9
        )),
        // Any other refusal leaves the step chosen first as it is.
        Err(_) => None,
        Ok(other) => match opts.host_budget {
            Some(h) if other.0.plan.host_bytes > h => Some(format!(
                "offloading them instead needs {:.3} GB of page-locked host memory, over the {:.3} GB allowed \
                 (the command line allows three quarters of what the host has available; \
                 STEPGRAPH_HOST_MEMORY_LIMIT sets that)",
                other.0.plan.host_bytes as f64 / 1e9,
                h as f64 / 1e9
            )),
            _ if added_seconds(&other.0) < added_seconds(c) => return Ok(other),
            _ => None,
        },
    };
    let mut chosen = chosen;
    if let (Some(why), Some(r)) = (why_not, chosen.0.passes.recompute.as_mut()) {
        r.not_offloaded = Some(format!("recomputed although slower than a round trip to host memory: {why}"));
    }
    Ok(chosen)
}

/// [`compile_budgeted`] before the offload of slow recomputations.
fn compile_recomputing_first(spec: &ModelSpec, opts: &StepOptions) -> Result<(CompiledStep, CompileTimes)> {
    let first = compile_tiled(spec, opts);
    let Err(Error::MemoryBudget { budget, mut least, .. }) = first else { return first };
    // Rows of one rank's MLP. As Arctic Long-Sequence Training sizes its
    // tiles, a tile keeps at least `n_embd` rows: below that, each tile's
    // products read more weight bytes than activation bytes, and the
    // search (one budget pass per tiling) grows with no end in sight.
    let world = opts.data_parallel.as_ref().map_or(1, |dp| dp.world.max(1));
    let rows = (spec.batch / world).max(1) * spec.seq;
    let most = (rows / spec.config.n_embd.max(1)).clamp(1, MAX_MLP_TILES);
    let (mut tiles, mut best_tiles) = (opts.mlp_tiles.max(1), opts.mlp_tiles.max(1));
    // Tiling costs a fixed amount once (each tile's weight gradients live
    // until they are summed) and saves a share of the intermediates that
    // halves with each doubling. So the first doubling may not pay on a
    // narrow model while the second does; after that, a doubling that does
    // not lower the least peak ends the search: later ones save less.
    let mut first = true;
    while tiles * 2 <= most {
        tiles *= 2;
        match compile_tiled(spec, &StepOptions { mlp_tiles: tiles, ..opts.clone() }) {
            Err(Error::MemoryBudget { least: l, .. }) if l < least => (least, best_tiles) = (l, tiles),
            Err(Error::MemoryBudget { .. }) if first => {}
            Err(Error::MemoryBudget { .. }) => break,
            other => return other,
        }
        first = false;
    }
    // Last, values backward reads wait in host memory between forward and
    // backward, at the best tiling: copies cost bus time, which overlaps
    // compute, but the bus is slower than recomputing what can be.
    if opts.offload {
        let offloading =
            StepOptions { mlp_tiles: best_tiles, recompute: RecomputePolicy::Least(budget), ..opts.clone() };
        match compile_tiled(spec, &offloading) {
            Err(Error::MemoryBudget { least: l, .. }) if l < least => least = l,
            Err(Error::MemoryBudget { .. }) => {}
            other => return other,
        }
    }
    Err(Error::MemoryBudget { budget, least, mlp_tiles: best_tiles, hint: clipping_hint(spec, opts, least) })
}

/// For a train step that clips the global gradient norm and misses its
/// budget: clipping reads every gradient before any update, so no update can
/// run inside backward and all gradients are live at its end. Says what the
/// same step plans without clipping when that is less than `least`, what it
/// reached with clipping (the whole search again, tilings included: the
/// unclipped step may reach its least at another tiling).
fn clipping_hint(spec: &ModelSpec, opts: &StepOptions, least: u64) -> Option<String> {
    opts.train.clip_grad_norm?;
    if opts.kind != StepKind::Train || opts.train.clip_by_previous_norm {
        return None;
    }
    let unclipped = StepOptions { train: TrainOptions { clip_grad_norm: None, ..opts.train.clone() }, ..opts.clone() };
    const WHY: &str = "clipping reads every gradient before any update, so all of them are live at the end of backward";
    match compile_step_timed(spec, &unclipped) {
        Ok((c, _)) => {
            let peak = c.planned_peak_bytes();
            Some(format!(
                "or --clip-grad-norm 0: {WHY}; without it this step plans {peak} B ({:.3} GB), within the budget \
                 (as does --clip-by-previous-norm, which clips by the step before's norm)",
                peak as f64 / 1e9
            ))
        }
        Err(Error::MemoryBudget { least: unclipped, .. }) if unclipped < least => Some(format!(
            "--clip-grad-norm: {WHY}; without it the least is {unclipped} B ({:.3} GB)",
            unclipped as f64 / 1e9
        )),
        _ => None,
    }
}

/// The passes a step of `opts` runs after [`trace_step`], in order: the
/// epilogue pass, the optimizer's placement (train steps), recomputation,
/// and last the FP8 products and the 3xTF32 split, so that recomputation
/// and the placement see the products as the model has them.
fn step_passes(opts: &StepOptions) -> Vec<Box<dyn Pass>> {
    let mut passes: Vec<Box<dyn Pass>> = Vec::new();
    if opts.epilogues == Epilogues::On {
        passes.push(Box::new(Fold));
    }
    if opts.kind == StepKind::Train {
        passes.push(Box::new(PlaceOptimizer(opts.optimizer)));
    }
    passes.push(Box::new(Recompute(opts.recompute)));
    if let RecomputePolicy::Least(budget) | RecomputePolicy::LeastBeforeOffload { budget, .. } = opts.recompute {
        passes.push(Box::new(Offload(budget)));
    }
    if opts.fp8 == Fp8Mode::Products {
        passes.push(Box::new(Fp8Products));
    }
    if opts.f32_products == F32Products::Split3xTf32 {
        passes.push(Box::new(SplitF32Products));
    }
    passes
}

/// The pipeline with the MLP tiling of `opts`, once.
fn compile_tiled(spec: &ModelSpec, opts: &StepOptions) -> Result<(CompiledStep, CompileTimes)> {
    let start = Instant::now();
    let StepTraces { spec, forward, step, buckets } = trace_step(spec, opts)?;
    let traced = Instant::now();
    let mut cx = PassContext::new(opts.plan);
    let passes = step_passes(opts);
    let step = run_passes(&step, &passes.iter().map(|p| &**p).collect::<Vec<_>>(), &mut cx)?;
    // The plan the last pass left (recomputation's), or, after the split,
    // whose parts live for a few nodes each, the plan of the split step.
    let plan = cx.take_plan(&step)?;
    let mut passes = cx.report;
    let recompute = passes.recompute.as_mut().expect("every step runs the recompute pass");
    // As the builder tiles: at most one tile per row.
    recompute.mlp_tiles = opts.mlp_tiles.clamp(1, spec.batch * spec.seq);
    let mlp_tiles = recompute.mlp_tiles;
    // The passes after recomputation add bytes its budget search did not see.
    let late = [
        (
            opts.f32_products == F32Products::Split3xTf32,
            "or --f32-products exact: the split operands of the 3xTF32 products need their own bytes",
        ),
        (
            opts.fp8 == Fp8Mode::Products,
            "or without --fp8: the quantized operands of the FP8 products need their own bytes",
        ),
    ];
    if let (Some((_, hint)), Some(budget)) = (late.iter().find(|l| l.0), opts.recompute.budget()) {
        let peak = plan.planned_peak_bytes();
        if peak > budget {
            return Err(Error::MemoryBudget { budget, least: peak, mlp_tiles, hint: Some((*hint).into()) });
        }
    }
    check_plan(&step, &plan)?;
    let times = CompileTimes { build: traced - start, plan: traced.elapsed() };
    Ok((CompiledStep { spec, forward, step, plan, buckets, passes }, times))
}

/// Builds one rank's step for the global batch of `spec`: the rank's rows
/// ([`rank_spec`]), autodiff, then [`crate::dist::data_parallel`], through
/// [`trace_step`]. Returns the rank's spec, its forward trace and its step.
pub fn build_rank_step(
    spec: &ModelSpec,
    kind: StepKind,
    opts: &TrainOptions,
    dp: &DataParallel,
) -> Result<(ModelSpec, Trace, Trace)> {
    let step_opts = StepOptions { train: opts.clone(), data_parallel: Some(dp.clone()), ..StepOptions::new(kind) };
    let t = trace_step(spec, &step_opts)?;
    Ok((t.spec, t.forward, t.step))
}

/// The per-rank memory plan of a data-parallel step next to the plan of the
/// same global batch on one device: what `stepgraph plan --gpus N` reports.
#[derive(Clone, Debug, Serialize)]
pub struct DataParallelReport {
    pub gpus: usize,
    pub zero1: bool,
    pub global_batch: usize,
    pub rank_batch: usize,
    pub seq: usize,
    pub bucket_bytes: u64,
    /// Gradient buckets, each one collective call per step.
    pub buckets: usize,
    /// The largest bucket.
    pub largest_bucket_bytes: u64,
    /// Gradient bytes each rank hands to the collectives per step.
    pub reduced_bytes: u64,
    /// The whole global batch on one device, no collectives.
    pub single: PlanReport,
    /// One rank's step (every rank has the same plan).
    pub per_rank: PlanReport,
}

/// Plans `spec` (global batch) on one device and as one rank of `dp`, both
/// built with `opts` (its optimizer, placement, recompute and planner
/// settings; its own `data_parallel` is replaced), checks both plans, and
/// reports them side by side, listing the `top` largest values live at
/// each peak.
pub fn plan_data_parallel(
    spec: &ModelSpec,
    opts: &StepOptions,
    dp: &DataParallel,
    top: usize,
) -> Result<DataParallelReport> {
    let step_opts = StepOptions { data_parallel: Some(dp.clone()), ..opts.clone() };
    let rank = compile_step(spec, &step_opts)?;
    let per_rank = plan_report(&rank.step, &rank.plan, top);
    let one = compile_step(spec, &StepOptions { data_parallel: None, ..step_opts })?;
    let single = plan_report(&one.step, &one.plan, top);

    Ok(DataParallelReport {
        gpus: dp.world,
        zero1: dp.zero1,
        global_batch: spec.batch,
        rank_batch: rank.spec.batch,
        seq: spec.seq,
        bucket_bytes: dp.bucket_bytes,
        buckets: rank.buckets.len(),
        largest_bucket_bytes: rank.buckets.iter().copied().max().unwrap_or(0),
        reduced_bytes: rank.buckets.iter().sum(),
        single,
        per_rank,
    })
}

impl std::fmt::Display for DataParallelReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| format!("{:.3} GB", b as f64 / 1e9);
        let both = |b: u64| format!("{b:>14} B {:>10}", gb(b));
        let (s, r) = (&self.single, &self.per_rank);
        writeln!(
            f,
            "data parallel over {} GPUs{}: global batch {} = {} x {} rows of {} tokens",
            self.gpus,
            if self.zero1 { " with ZeRO-1 (optimizer state sharded)" } else { "" },
            self.global_batch,
            self.gpus,
            self.rank_batch,
            self.seq
        )?;
        writeln!(
            f,
            "gradients: {} {} per step in {} bucket{} (budget {:.1} MiB, largest {}), each right after its last gradient",
            gb(self.reduced_bytes),
            if self.zero1 { "reduce-scattered" } else { "all-reduced" },
            self.buckets,
            if self.buckets == 1 { "" } else { "s" },
            self.bucket_bytes as f64 / (1024.0 * 1024.0),
            gb(self.largest_bucket_bytes),
        )?;
        let one = format!("1 GPU (batch {})", self.global_batch);
        let each = format!("per rank (batch {})", self.rank_batch);
        writeln!(f, "  {:<16} {:>27} {:>27}", "", one, each)?;
        let rows: [(&str, u64, u64); 7] = [
            ("persistent", s.persistent_bytes, r.persistent_bytes),
            ("  parameters", s.param_bytes, r.param_bytes),
            ("  optimizer", s.optimizer_state_bytes, r.optimizer_state_bytes),
            ("arena", s.arena_bytes, r.arena_bytes),
            ("  gradients out", s.gradient_bytes, r.gradient_bytes),
            ("planned peak", s.planned_peak_bytes, r.planned_peak_bytes),
            ("floor", s.floor_bytes, r.floor_bytes),
        ];
        for (name, a, b) in rows {
            // A train step consumes its gradients: no gradient outputs to list.
            if name == "  gradients out" && a == 0 && b == 0 {
                continue;
            }
            writeln!(f, "  {name:<16} {:>27} {:>27}", both(a), both(b))?;
        }
        writeln!(f, "  {:<16} {:>27} {:>27}", "nodes", s.nodes, r.nodes)?;
        writeln!(f, "largest values live at the per-rank peak (node {}):", r.peak_position)?;
        for l in &r.largest_at_peak {
            writeln!(f, "  {:>12} B  {:<22} {}", l.bytes, l.ty, l.value)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::{build_step, LR_INPUT, STEP_INPUT};
    use crate::dist::{buckets, data_parallel};
    use crate::ir::DType;
    use crate::models::build_forward;
    use crate::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
    use crate::models::LossKind;
    use crate::plan::{plan, plan_report};

    fn tiny(batch: usize, loss: LossKind) -> ModelSpec {
        ModelSpec::named("tiny-llama", batch, 8, DType::F32, loss).unwrap()
    }

    /// The stages as every command used to assemble them by hand.
    fn by_hand(spec: &ModelSpec, kind: StepKind, opts: &TrainOptions) -> (Trace, Trace, MemoryPlan) {
        let forward = build_forward(spec).unwrap();
        let step = build_step(&forward, kind, opts).unwrap();
        let p = plan(&step, PlanOptions::default()).unwrap();
        check_plan(&step, &p).unwrap();
        (forward, step, p)
    }

    #[test]
    fn the_pipeline_gives_the_hand_assembled_step_of_every_kind() {
        let f32_state = TrainOptions { state_dtype: Some(DType::F32), ..TrainOptions::default() };
        for kind in [StepKind::Forward, StepKind::Grads, StepKind::Train] {
            for loss in [LossKind::Sum, LossKind::CrossEntropy] {
                for train in [TrainOptions::default(), f32_state.clone()] {
                    let spec = tiny(2, loss);
                    let (forward, step, p) = by_hand(&spec, kind, &train);
                    let opts = StepOptions { train, ..StepOptions::unoptimized(kind) };
                    let c = compile_step(&spec, &opts).unwrap();
                    assert_eq!((c.spec.batch, c.spec.seq, &c.spec.config), (spec.batch, spec.seq, &spec.config));
                    assert_eq!(c.forward.to_string(), forward.to_string());
                    assert_eq!(c.step.to_string(), step.to_string(), "{kind:?} {loss:?}");
                    assert_eq!(c.plan.slots, p.slots);
                    assert_eq!(c.planned_peak_bytes(), p.planned_peak_bytes());
                    assert_eq!(plan_report(&c.step, &c.plan, 3).planned_peak_bytes, p.planned_peak_bytes());
                    assert!(c.buckets.is_empty());
                    let traced = trace_step(&spec, &opts).unwrap();
                    assert_eq!(traced.step.to_string(), step.to_string());
                }
            }
        }
    }

    #[test]
    fn the_pipeline_names_the_inputs_and_counts_the_parameters() {
        let c = compile_step(&tiny(1, LossKind::CrossEntropy), &StepOptions::new(StepKind::Train)).unwrap();
        let mut names: Vec<&str> = c.input_names().into_iter().map(|(n, _)| n).collect();
        names.sort();
        let mut expected = [LR_INPUT, STEP_INPUT, TARGETS_INPUT, TOKENS_INPUT];
        expected.sort();
        assert_eq!(names, expected);
        for (name, v) in c.input_names() {
            assert_eq!(c.step.leaf_by_name(name), Some(v));
        }
        assert_eq!(c.param_count(), c.forward.params().map(|p| c.forward.ty(p).numel()).sum::<usize>());
        assert!(c.param_count() > 0);
    }

    #[test]
    fn a_data_parallel_step_is_a_ranks_step_with_its_buckets() {
        let spec = tiny(4, LossKind::CrossEntropy);
        for zero1 in [false, true] {
            let dp = DataParallel { zero1, bucket_bytes: 16 << 10, ..DataParallel::new(2) };
            let opts = StepOptions { data_parallel: Some(dp.clone()), ..StepOptions::unoptimized(StepKind::Train) };
            let c = compile_step(&spec, &opts).unwrap();
            assert_eq!(c.spec.batch, 2, "each rank takes its rows");
            let local = build_step(&build_forward(&c.spec).unwrap(), StepKind::Train, &opts.train).unwrap();
            let by_hand = data_parallel(&local, &dp).unwrap();
            assert_eq!(c.step.to_string(), by_hand.to_string());
            let sizes: Vec<u64> = buckets(&local, dp.bucket_bytes).unwrap().iter().map(|b| b.bytes).collect();
            assert!(sizes.len() > 1);
            assert_eq!(c.buckets, sizes);
            check_plan(&c.step, &c.plan).unwrap();
        }
        // The split is checked before anything is built.
        let dp = DataParallel::new(3);
        let opts = StepOptions { data_parallel: Some(dp), ..StepOptions::new(StepKind::Train) };
        let e = compile_step(&spec, &opts).unwrap_err().to_string();
        assert!(e.contains("does not split over 3 ranks"), "{e}");
    }

    #[test]
    fn by_default_train_steps_update_in_backward_and_recompute_cheap_values() {
        let spec = ModelSpec::named("tiny-llama", 2, 64, DType::F32, LossKind::CrossEntropy).unwrap();
        let plain = compile_step(&spec, &StepOptions::unoptimized(StepKind::Train)).unwrap();
        let c = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
        assert!(c.planned_peak_bytes() < plain.planned_peak_bytes());
        let placement = c.placement().unwrap();
        assert_eq!(placement.placement, "in backward", "{placement}");
        assert!(!c.recompute().recomputed.is_empty(), "{}", c.recompute());
        assert_eq!(c.recompute().planned_peak_after, c.planned_peak_bytes());
        // A budget below the default's peak recomputes more and is met; one
        // below what recomputation and offload reach (the weights alone:
        // optimizer state may go to host memory, weights stay) is refused
        // before anything runs.
        let least = plain.step.leaf_bytes(|k| matches!(k, crate::ir::ValueKind::Param { .. }));
        let opts = StepOptions { recompute: RecomputePolicy::Budget(least), ..StepOptions::new(StepKind::Train) };
        let e = compile_step(&spec, &opts).unwrap_err().to_string();
        assert!(e.contains("cannot be met"), "{e}");
        // Grads steps have no optimizer to place.
        assert!(compile_step(&spec, &StepOptions::new(StepKind::Grads)).unwrap().placement().is_none());
    }

    #[test]
    fn a_budget_missed_because_of_clipping_says_what_the_step_plans_without_it() {
        let spec = ModelSpec::named("tiny-llama", 2, 64, DType::F32, LossKind::CrossEntropy).unwrap();
        let clipped = |clip: Option<f64>, budget: u64| StepOptions {
            train: TrainOptions { clip_grad_norm: clip, ..TrainOptions::default() },
            recompute: RecomputePolicy::Budget(budget),
            ..StepOptions::new(StepKind::Train)
        };
        // The least each reaches: a budget of one byte is refused with it.
        let least = |clip| match compile_step(&spec, &clipped(clip, 1)) {
            Err(Error::MemoryBudget { least, .. }) => least,
            other => panic!("a one-byte budget was not refused: {:?}", other.map(|c| c.planned_peak_bytes())),
        };
        let (with_clip, without) = (least(Some(1.0)), least(None));
        assert!(without < with_clip, "clipping keeps every gradient live: {without} vs {with_clip}");
        // A budget only the unclipped step meets: refused, naming the way out.
        let e = compile_step(&spec, &clipped(Some(1.0), without)).unwrap_err().to_string();
        assert!(e.contains("--clip-grad-norm 0") && e.contains(&format!("plans {without} B")), "{e}");
        assert!(compile_step(&spec, &clipped(None, without)).is_ok());
        // Without clipping there is nothing to suggest.
        let e = compile_step(&spec, &clipped(None, 1)).unwrap_err().to_string();
        assert!(!e.contains("clip"), "{e}");
    }

    #[test]
    fn a_pass_whose_output_breaks_an_invariant_is_named() {
        let c = compile_step(&tiny(1, LossKind::Sum), &StepOptions::new(StepKind::Train)).unwrap();
        verify_after("recompute", &c.step).unwrap();
        // A node moved before the producer of its input, as a scheduling
        // pass with a wrong dependency would leave it.
        let mut broken = c.step.clone();
        let last = broken.nodes.pop().unwrap();
        broken.nodes.insert(0, last);
        let e = verify_after("recompute", &broken).unwrap_err();
        assert!(
            matches!(&e, Error::PassOutput { pass, source } if pass == "recompute"
            && matches!(**source, Error::Verify { .. })),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(e.starts_with("pass `recompute` produced a trace that fails verification: trace"), "{e}");
    }

    #[test]
    fn the_plan_the_passes_hand_on_is_the_plan_of_the_compiled_step() {
        let spec = ModelSpec::named("tiny-llama", 2, 32, DType::F32, LossKind::CrossEntropy).unwrap();
        let budget = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap().planned_peak_bytes() - 1;
        let variants = [
            StepOptions::new(StepKind::Train),
            StepOptions::new(StepKind::Grads),
            StepOptions { recompute: RecomputePolicy::Off, ..StepOptions::new(StepKind::Train) },
            StepOptions { recompute: RecomputePolicy::Budget(budget), ..StepOptions::new(StepKind::Train) },
            StepOptions { f32_products: F32Products::Split3xTf32, ..StepOptions::new(StepKind::Train) },
            StepOptions {
                plan: PlanOptions { reuse: false, ..PlanOptions::default() },
                ..StepOptions::new(StepKind::Train)
            },
        ];
        for opts in variants {
            let c = compile_step(&spec, &opts).unwrap();
            let fresh = plan(&c.step, opts.plan).unwrap();
            assert_eq!(c.plan.slots, fresh.slots, "{opts:?}");
            assert_eq!(c.planned_peak_bytes(), fresh.planned_peak_bytes(), "{opts:?}");
        }
    }

    #[test]
    fn the_planner_options_reach_the_plan() {
        let spec = tiny(1, LossKind::Sum);
        let reuse = compile_step(&spec, &StepOptions::unoptimized(StepKind::Grads)).unwrap();
        let opts = StepOptions {
            plan: PlanOptions { reuse: false, ..PlanOptions::default() },
            ..StepOptions::unoptimized(StepKind::Grads)
        };
        let unplanned = compile_step(&spec, &opts).unwrap();
        assert!(unplanned.planned_peak_bytes() > reuse.planned_peak_bytes());
    }
}
