//! Golden printouts of a micro model's forward, grads and train traces, and
//! of the grads and ZeRO-1 train steps of one rank of two.
//! Regenerate after an intended change with
//! `UPDATE_GOLDEN=1 cargo test -p stepgraph-core --test golden` and review the diff.

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::dist::{build_rank_step, DataParallel};
use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::DType;
use stepgraph_core::models::{build_forward, Config, LossKind, ModelSpec, Overrides};

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
    ModelSpec { config, batch: 1, seq: 4, dtype: DType::F32, loss: LossKind::CrossEntropy }
}

fn check(name: &str, text: &str) {
    let path = format!("{}/tests/golden/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
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
