//! f16 and bf16 training track f32: 50 AdamW steps of the tiny models on
//! the CPU backend, with the default optimizer state (float32 moments for
//! f16 parameters, bf16 moments for bf16 ones), on the same batches and
//! the same initial weights. Also pins the failure the default avoids:
//! f16 moments underflow and the run turns non-finite.

use stepgraph_core::autodiff::{StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{init_params, LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::session::Session;

const STEPS: usize = 50;
const BATCH: usize = 2;
const SEQ: usize = 16;

/// The losses of `STEPS` steps at `lr` (constant) on deterministic batches.
fn losses(model: &str, dtype: DType, train: TrainOptions, lr: f64) -> Vec<f64> {
    let spec = ModelSpec::named(model, BATCH, SEQ, dtype, LossKind::CrossEntropy).unwrap();
    let c = compile_step(&spec, &StepOptions { train, ..StepOptions::new(StepKind::Train) }).unwrap();
    let mut s = CpuSession::new(c.step, c.plan).unwrap();
    for (v, t) in init_params(&c.forward, 0) {
        s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
    }
    s.zero_state().unwrap();
    let ty = TensorType::new(DType::I32, [BATCH, SEQ]);
    // A repeating byte pattern the model can learn, so the loss falls far.
    let text: Vec<f64> = (0..4096).map(|i| ((i * 7 + i / 5) % 61 + 32) as f64).collect();
    (1..=STEPS)
        .map(|it| {
            let o = (it * 37) % (text.len() - BATCH * SEQ - 1);
            let tokens = &text[o..o + BATCH * SEQ];
            let targets = &text[o + 1..o + BATCH * SEQ + 1];
            s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), tokens)).unwrap();
            s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty.clone(), targets)).unwrap();
            s.write_named(LR_INPUT, &scalar_input(lr)).unwrap();
            s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
            s.run_eager().unwrap();
            s.loss().unwrap()
        })
        .collect()
}

/// The largest per-step gap between `low` and `f32` losses.
fn max_gap(low: &[f64], f32: &[f64]) -> f64 {
    low.iter().zip(f32).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
}

#[test]
fn f16_and_bf16_training_track_f32_on_the_tiny_models() {
    // Tolerances on the loss (≈5.5 at the start). Measured max gaps: f16
    // 0.024 (llama) and 0.004 (neox); bf16 0.265 and 0.247, which come from
    // rounding bf16 parameters (8-bit mantissa), not from the moments: with
    // float32 moments bf16 strays 0.268 and 0.247.
    for model in ["tiny-llama", "tiny-neox"] {
        let reference = losses(model, DType::F32, TrainOptions::default(), 3e-3);
        assert!(reference[STEPS - 1] < reference[0] - 1.0, "{model} f32 did not learn: {reference:?}");
        for (dtype, tol) in [(DType::F16, 0.1), (DType::BF16, 0.4)] {
            let low = losses(model, dtype, TrainOptions::default(), 3e-3);
            let gap = max_gap(&low, &reference);
            eprintln!(
                "{model} {dtype:?}: max |loss - f32 loss| over {STEPS} steps {gap:.4}, final {:.4} vs {:.4}",
                low[STEPS - 1],
                reference[STEPS - 1]
            );
            assert!(gap < tol, "{model} {dtype:?} strays {gap} from f32 (tolerance {tol}):\n{low:?}\n{reference:?}");
        }
    }
}

#[test]
fn a_tiny_learning_rate_leaves_f16_training_where_f32_is() {
    // With f16 moments this moved the loss at lr 1e-9; with the default float32 moments it does not.
    let reference = losses("tiny-llama", DType::F32, TrainOptions::default(), 1e-9);
    let f16 = losses("tiny-llama", DType::F16, TrainOptions::default(), 1e-9);
    let gap = max_gap(&f16, &reference);
    assert!(gap < 0.01, "f16 at lr 1e-9 strays {gap} from f32:\n{f16:?}\n{reference:?}");
    let f16_state = TrainOptions { state_dtype: Some(DType::F16), ..TrainOptions::default() };
    let broken = losses("tiny-llama", DType::F16, f16_state, 1e-9);
    assert!(max_gap(&broken, &reference) > 0.1, "f16 moments no longer break training: {broken:?}");
}
