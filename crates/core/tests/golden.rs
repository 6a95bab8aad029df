//! Golden printouts of a micro model's forward, grads and train traces, and
//! of the grads and ZeRO-1 train steps of one rank of two; and, as
//! cranelift's filetests, of each pass after them: `golden/passes/NAME.in.txt`
//! is the pass's input, which the test parses and runs the one pass on,
//! and `NAME.out.txt` its verified output.
//! Regenerate after an intended change with
//! `UPDATE_GOLDEN=1 cargo test -p stepgraph-core --test golden` and review the diff.

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::dist::DataParallel;
use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::{DType, Trace};
use stepgraph_core::models::{build_forward, Config, LossKind, ModelSpec, Overrides};
use stepgraph_core::passes::fusion::Fold;
use stepgraph_core::passes::optimizer_placement::{OptimizerPlacement, PlaceOptimizer};
use stepgraph_core::passes::recompute::{Recompute, RecomputePolicy};
use stepgraph_core::passes::tf32::SplitF32Products;
use stepgraph_core::passes::{run_passes, verify_after, F32Products, Pass, PassContext};
use stepgraph_core::pipeline::{build_rank_step, compile_step, trace_step, StepOptions};
use stepgraph_core::plan::PlanOptions;

fn micro() -> ModelSpec {
    let o = Overrides {
        n_layer: Some(1),
        n_embd: Some(8),
        n_head: Some(2),
        n_query_groups: Some(1),
        vocab_size: Some(16),
        intermediate_size: Some(16),
        ..Default::default()
    };
    let config = Config::named("tiny-llama").unwrap().with_overrides(&o).unwrap();
    ModelSpec {
        config,
        batch: 1,
        seq: 4,
        dtype: DType::F32,
        loss: LossKind::CrossEntropy,
        adapters: None,
        documents: false,
    }
}

fn check(name: &str, text: &str) {
    let path = format!("{}/tests/golden/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(std::path::Path::new(&path).parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}; run with UPDATE_GOLDEN=1"));
    if want != text {
        let line = want.lines().zip(text.lines()).position(|(a, b)| a != b).unwrap_or(0);
        panic!(
            "{name} trace changed at line {}:\n  golden: {:?}\n  now:    {:?}\nrun with UPDATE_GOLDEN=1 and review the diff",
            line + 1,
            want.lines().nth(line),
            text.lines().nth(line)
        );
    }
    // Golden files are also valid trace text.
    assert_eq!(parse(text).unwrap().to_string(), text);
}

#[test]
fn golden_forward_trace() {
    check("forward", &build_forward(&micro()).unwrap().to_string());
}

#[test]
fn golden_grads_trace() {
    let fwd = build_forward(&micro()).unwrap();
    check("grads", &build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap().to_string());
}

#[test]
fn golden_train_trace() {
    let fwd = build_forward(&micro()).unwrap();
    check("train", &build_step(&fwd, StepKind::Train, &TrainOptions::default()).unwrap().to_string());
}

/// One rank of two with the micro model's batch of one row each, and
/// buckets of about 1 KB so that the micro model has several.
fn rank_step(kind: StepKind, zero1: bool) -> String {
    let global = ModelSpec { batch: 2, ..micro() };
    let dp = DataParallel { world: 2, bucket_bytes: 1000, zero1 };
    build_rank_step(&global, kind, &TrainOptions::default(), &dp).unwrap().2.to_string()
}

#[test]
fn golden_data_parallel_grads_trace() {
    check("grads_dp2", &rank_step(StepKind::Grads, false));
}

#[test]
fn golden_zero1_train_trace() {
    check("train_zero1_dp2", &rank_step(StepKind::Train, true));
}

/// Between the micro train step's planned peak with the automatic policy
/// (15,136 B, the least recomputation reaches) and without recomputation
/// (17,696 B): the budget policy stops as soon as it is met, so it
/// recomputes less than the automatic one.
const BUDGET: u64 = 16_384;

/// One pass as a filetest: `input` (the previous stage's output) is the
/// golden `passes/NAME.in.txt`; the pass runs on that file parsed, and its
/// output, verified, is the golden `passes/NAME.out.txt`. The same pass on
/// the in-memory `input` must give the same output: the text holds all the
/// pass reads. The pass runs as the pipeline runs it, through
/// [`run_passes`], with the verifier on. Returns the output, the next
/// pass's input.
fn check_pass(name: &str, input: &Trace, pass: &dyn Pass) -> Trace {
    check(&format!("passes/{name}.in"), &input.to_string());
    let path = format!("{}/tests/golden/passes/{name}.in.txt", env!("CARGO_MANIFEST_DIR"));
    let parsed = parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let run = |t: &Trace| {
        let mut cx = PassContext::new(PlanOptions::default());
        cx.verify = true;
        run_passes(t, &[pass], &mut cx)
    };
    let out = run(&parsed).unwrap();
    verify_after(name, &out).unwrap();
    check(&format!("passes/{name}.out"), &out.to_string());
    assert_eq!(run(input).unwrap().to_string(), out.to_string(), "{name}: the parsed input gives another output");
    out
}

/// The micro model's train step through the passes in the pipeline's
/// order, each snapshotted, ending where [`compile_step`] ends.
#[test]
fn golden_passes() {
    let spec = micro();
    let opts = StepOptions { f32_products: F32Products::Split3xTf32, ..StepOptions::new(StepKind::Train) };
    let step = trace_step(&spec, &opts).unwrap().step;
    let step = check_pass("fusion", &step, &Fold);
    let step = check_pass("optimizer_placement", &step, &PlaceOptimizer(OptimizerPlacement::Auto));
    let budget = check_pass("recompute_budget", &step, &Recompute(RecomputePolicy::Budget(BUDGET)));
    let step = check_pass("recompute_auto", &step, &Recompute(RecomputePolicy::Auto));
    let step = check_pass("split_f32_products", &step, &SplitF32Products);
    assert_eq!(step.to_string(), compile_step(&spec, &opts).unwrap().step.to_string());
    assert_ne!(budget.to_string(), step.to_string());
}
