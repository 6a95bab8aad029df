//! Trace-to-trace passes, all of one shape: a [`Pass`] has a name and a
//! `run` from the trace it is given to a new trace, over one shared
//! [`PassContext`]; [`run_passes`] runs a list of them, verifying each
//! output, for training steps ([`crate::pipeline`]) and for generation
//! ([`crate::models::generate`]) alike.
//!
//! The context owns what passes share:
//! - **the memory plan** of the trace a pass receives, when the pass before
//!   planned its own output ([`PassContext::take_plan`],
//!   [`PassContext::set_output_plan`]): a pass that chooses by planned peak
//!   (the optimizer's placement, recomputation) plans its candidates, and
//!   the next one starts from the plan of the candidate that was taken
//!   instead of planning the same trace again;
//! - **the report** ([`PassReport`]): what each pass folded, placed,
//!   recomputed, split or turned into views, read by whoever ran them;
//! - **segments**: node ranges a session runs on their own (generation's
//!   prefill and decode buckets). A pass that moves nodes keeps them current
//!   and moves nothing across a boundary; one that cannot refuses such a
//!   trace ([`PassContext::refuse_segments`]).
//!
//! The passes: [`fusion`] (adds and scales folded into the kernels that
//! produce or read them), [`optimizer_placement`] (the optimizer moved into
//! backward), [`recompute`] (values recomputed in backward instead of
//! kept), [`offload`] (values kept in host memory between forward and
//! backward), [`fp8`] (marked products as FP8 products), [`tf32`] (f32
//! products as three TF32 products), [`views`] (slices as views); [`crate::dist::DataParallelRewrite`] (a step made one rank's)
//! sits with the rest of data parallelism. [`dce()`] is the cleanup autodiff
//! runs on the traces it builds.
//!
//! **Invariants:** a pass never mutates its input; the trace it returns
//! passes the verifier (checked after every pass in debug builds, which
//! tests are, and wherever [`PassContext::verify`] is set); a plan the
//! context holds is the plan of the trace the next pass receives.

pub mod dce;
pub mod fp8;
pub mod fusion;
pub mod offload;
pub mod optimizer_placement;
pub mod recompute;
pub mod tf32;
pub mod views;

use std::ops::Range;

use serde::Serialize;

pub use dce::{compact, dce};
pub use tf32::{split_f32_products, F32Products};
pub use views::slice_views;

use crate::error::{Error, Result};
use crate::ir::{verify::verify, Trace};
use crate::plan::{plan, MemoryPlan, PlanOptions};
use fusion::FusionReport;
use optimizer_placement::PlacementReport;
use recompute::RecomputeReport;

/// One trace-to-trace pass.
pub trait Pass {
    /// The name reports and errors use (and a trace's `# after:` header,
    /// where the pass sets it).
    fn name(&self) -> &'static str;

    /// The pass applied to `trace`. It records what it did in
    /// `cx.report`, may take the plan of `trace` from the context
    /// ([`PassContext::take_plan`]) and leave the plan of its output
    /// ([`PassContext::set_output_plan`]).
    fn run(&self, trace: &Trace, cx: &mut PassContext) -> Result<Trace>;
}

/// What the passes of one [`run_passes`] did, each in its own field (empty
/// or `None` where that pass did not run).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PassReport {
    /// The passes that ran, in order.
    pub ran: Vec<&'static str>,
    /// The adds and scales folded ([`fusion::Fold`]).
    pub fusion: FusionReport,
    /// Where the optimizer runs ([`optimizer_placement::PlaceOptimizer`]).
    pub placement: Option<PlacementReport>,
    /// What is recomputed in backward ([`recompute::Recompute`]).
    pub recompute: Option<RecomputeReport>,
    /// What waits in host memory between forward and backward ([`offload::Offload`]).
    pub offload: Option<offload::OffloadReport>,
    /// Marked products made FP8 products ([`fp8::Fp8Products`]).
    pub fp8: Option<fp8::Fp8Report>,
    /// f32 products split into three TF32 products ([`tf32::SplitF32Products`]).
    pub split_products: Option<usize>,
    /// Slices that became views ([`views::SliceViews`]).
    pub slice_views: Option<usize>,
    /// Bytes of each gradient bucket a rank reduces per step, in order
    /// ([`crate::dist::DataParallelRewrite`]).
    pub buckets: Option<Vec<u64>>,
}

/// What the passes of one run share (see the module doc).
#[derive(Clone, Debug)]
pub struct PassContext {
    /// Planner settings of every plan the passes make.
    pub plan_options: PlanOptions,
    /// Node ranges a session runs on their own, when the trace has them.
    pub segments: Option<Vec<Range<usize>>>,
    /// Verify every pass's output (default: in debug builds).
    pub verify: bool,
    pub report: PassReport,
    /// The plan of the trace the running pass received (of the last
    /// output, between passes), when a pass left it.
    plan: Option<MemoryPlan>,
    /// The plan of the running pass's output, when it set one.
    output_plan: Option<MemoryPlan>,
    plans_made: usize,
}

impl PassContext {
    /// A context planning with `plan_options`, with no segments and an empty report.
    pub fn new(plan_options: PlanOptions) -> Self {
        PassContext {
            plan_options,
            segments: None,
            verify: cfg!(debug_assertions),
            report: PassReport::default(),
            plan: None,
            output_plan: None,
            plans_made: 0,
        }
    }

    /// A context for a trace run in `segments` (see the module doc).
    pub fn with_segments(plan_options: PlanOptions, segments: Vec<Range<usize>>) -> Self {
        PassContext { segments: Some(segments), ..Self::new(plan_options) }
    }

    /// Plans `trace` with the context's options (and counts it).
    pub fn plan(&mut self, trace: &Trace) -> Result<MemoryPlan> {
        self.plans_made += 1;
        plan(trace, self.plan_options)
    }

    /// The plan of `trace`, the trace the passes so far produced (inside a
    /// pass: the trace it received): the one the pass before left, or
    /// planned now. The caller owns it; a pass that returns `trace`
    /// unchanged hands it on with [`PassContext::set_output_plan`].
    pub fn take_plan(&mut self, trace: &Trace) -> Result<MemoryPlan> {
        match self.plan.take() {
            Some(p) => {
                // A plan has one slot per value: a cheap guard against a
                // plan of another trace.
                debug_assert_eq!(p.slots.len(), trace.values.len(), "the context's plan is of another trace");
                Ok(p)
            }
            None => self.plan(trace),
        }
    }

    /// Records `plan` as the plan of the trace the running pass returns.
    pub fn set_output_plan(&mut self, plan: MemoryPlan) {
        self.output_plan = Some(plan);
    }

    /// Plans made through this context so far.
    pub fn plans_made(&self) -> usize {
        self.plans_made
    }

    /// An error for a pass that cannot keep segments, when the trace has them.
    pub fn refuse_segments(&self, pass: &str) -> Result<()> {
        match &self.segments {
            Some(s) => Err(Error::Pass {
                pass: pass.into(),
                reason: format!("the trace runs in {} segments, which this pass does not keep", s.len()),
            }),
            _ => Ok(()),
        }
    }

    /// Runs one pass on `trace`: the pass, then the verifier (when
    /// [`PassContext::verify`] is set), naming the pass if its output
    /// breaks an invariant.
    pub fn run(&mut self, pass: &dyn Pass, trace: &Trace) -> Result<Trace> {
        self.output_plan = None;
        let out = pass.run(trace, self)?;
        if self.verify {
            verify_after(pass.name(), &out)?;
        }
        // A plan of the input the pass did not hand on belongs to no trace now.
        self.plan = self.output_plan.take();
        self.report.ran.push(pass.name());
        Ok(out)
    }
}

/// Runs `passes` in order, starting from `trace`, each on the last one's
/// output, with the verifier after each (see [`PassContext::run`]).
pub fn run_passes(trace: &Trace, passes: &[&dyn Pass], cx: &mut PassContext) -> Result<Trace> {
    let mut t = trace.clone();
    for pass in passes {
        t = cx.run(*pass, &t)?;
    }
    Ok(t)
}

/// Verifies `trace`, the output of `pass`: the error names the pass and
/// the broken invariant.
pub fn verify_after(pass: &str, trace: &Trace) -> Result<()> {
    verify(trace).map_err(|e| Error::PassOutput { pass: pass.into(), source: Box::new(e) })
}

#[cfg(test)]
mod tests {
    use super::fusion::Fold;
    use super::optimizer_placement::{OptimizerPlacement, PlaceOptimizer};
    use super::recompute::{Recompute, RecomputePolicy};
    use super::views::SliceViews;
    use super::*;
    use crate::autodiff::StepKind;
    use crate::ir::DType;
    use crate::models::generate::{build_generation, GenerationSpec};
    use crate::models::{Config, LossKind, ModelSpec};
    use crate::pipeline::{trace_step, StepOptions};

    fn train_step() -> Trace {
        let spec = ModelSpec::named("tiny-llama", 2, 16, DType::F32, LossKind::CrossEntropy).unwrap();
        trace_step(&spec, &StepOptions::new(StepKind::Train)).unwrap().step
    }

    #[test]
    fn a_plan_one_pass_made_is_not_made_again_by_the_next() {
        let step = run_passes(&train_step(), &[&Fold], &mut PassContext::new(PlanOptions::default())).unwrap();
        for policy in [RecomputePolicy::Off, RecomputePolicy::Auto] {
            let mut cx = PassContext::new(PlanOptions::default());
            let placed = cx.run(&PlaceOptimizer(OptimizerPlacement::Auto), &step).unwrap();
            // The step after backward and in backward, once each.
            assert_eq!(cx.plans_made(), 2);
            let out = cx.run(&Recompute(policy), &placed).unwrap();
            let after_recompute = cx.plans_made();
            let p = cx.take_plan(&out).unwrap();
            // The recompute pass started from the placement's plan and left its own.
            assert_eq!(cx.plans_made(), after_recompute);
            if policy == RecomputePolicy::Off {
                assert_eq!(after_recompute, 2, "recompute (off) planned the placed step again");
            }
            let fresh = plan(&out, PlanOptions::default()).unwrap();
            assert_eq!(p.slots, fresh.slots, "{policy:?}: the context's plan is not the plan of the step");
            assert_eq!(p.planned_peak_bytes(), cx.report.recompute.as_ref().unwrap().planned_peak_after);
            assert_eq!(cx.report.ran, ["optimizer_placement", "recompute"]);
            assert!(cx.report.placement.is_some());
        }
    }

    #[test]
    fn a_pass_that_changes_the_trace_without_a_plan_leaves_none() {
        let step = train_step();
        let mut cx = PassContext::new(PlanOptions::default());
        let placed = cx.run(&PlaceOptimizer(OptimizerPlacement::InBackward), &step).unwrap();
        let folded = cx.run(&Fold, &placed).unwrap();
        let made = cx.plans_made();
        let p = cx.take_plan(&folded).unwrap();
        assert_eq!(cx.plans_made(), made + 1, "the folded step was planned anew");
        assert_eq!(p.slots, plan(&folded, PlanOptions::default()).unwrap().slots);
    }

    /// Moves the last node first: its inputs are then used before they are made.
    struct Misorder;

    impl Pass for Misorder {
        fn name(&self) -> &'static str {
            "misorder"
        }

        fn run(&self, trace: &Trace, _: &mut PassContext) -> Result<Trace> {
            let mut out = trace.clone();
            let last = out.nodes.pop().expect("a node");
            out.nodes.insert(0, last);
            Ok(out)
        }
    }

    #[test]
    fn the_verifier_names_the_pass_that_broke_the_trace() {
        let step = train_step();
        let mut cx = PassContext::new(PlanOptions::default());
        cx.verify = true;
        let e = run_passes(&step, &[&Fold, &Misorder, &SliceViews], &mut cx).unwrap_err();
        assert!(matches!(&e, Error::PassOutput { pass, .. } if pass == "misorder"), "{e:?}");
        assert_eq!(cx.report.ran, ["epilogues"], "the passes after the broken one did not run");
        // Unverified, the broken trace goes through.
        let mut cx = PassContext::new(PlanOptions::default());
        cx.verify = false;
        run_passes(&step, &[&Misorder], &mut cx).unwrap();
    }

    #[test]
    fn a_pass_that_moves_nodes_across_segments_refuses_a_trace_run_in_them() {
        let step = train_step();
        let n = step.nodes.len();
        let mut cx = PassContext::with_segments(PlanOptions::default(), vec![0..n / 2, n / 2..n]);
        let e = cx.run(&Recompute(RecomputePolicy::Auto), &step).unwrap_err().to_string();
        assert!(e.starts_with("pass `recompute`: the trace runs in 2 segments"), "{e}");
        let e = cx.run(&PlaceOptimizer(OptimizerPlacement::Auto), &step).unwrap_err().to_string();
        assert!(e.starts_with("pass `optimizer_placement`"), "{e}");
        // Those that keep segments run, and keep them covering the trace.
        let out = run_passes(&step, &[&Fold, &SliceViews], &mut cx).unwrap();
        let segments = cx.segments.as_ref().unwrap();
        assert_eq!((segments[0].start, segments[1].end), (0, out.nodes.len()));
        assert_eq!(segments[0].end, segments[1].start);
    }

    #[test]
    fn generation_runs_its_passes_through_run_passes() {
        let spec = GenerationSpec {
            config: Config::named("tiny-llama").unwrap(),
            dtype: DType::F32,
            buckets: vec![1, 2],
            context: 16,
            prompt_len: 8,
            logits: false,
        };
        let p = build_generation(&spec).unwrap();
        assert_eq!(p.report.ran, ["epilogues", "slice_views"]);
        assert!(p.report.fusion.total() > 0, "the residual adds fold into their products");
        assert!(p.report.slice_views.unwrap() > 0, "decode's parts of fused products are views");
        assert!(p.report.recompute.is_none() && p.report.placement.is_none());
    }
}
