//! AdamW with 8-bit moments (`TrainOptions::moments_8bit`) on the CPU:
//! the state it plans (2 bytes a weight and a scale per 2048), its first
//! update equal to dense AdamW's with f32 moments bit for bit (the moments
//! start at zero either way), the codes holding the new moments to half a
//! code's gap, and 300 steps of a tiny model whose loss curve stays within
//! a stated band of dense f32 AdamW's.

use stepgraph_core::autodiff::{StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType, ValueKind};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{LossKind, ModelSpec};
use stepgraph_core::ops::adamw8::{dynamic_map, BLOCK};
use stepgraph_core::ops::Op;
use stepgraph_core::pipeline::{compile_step, CompiledStep, StepOptions};
use stepgraph_core::testing::seeded_session;

const SEQ: usize = 16;

fn spec(dtype: DType) -> ModelSpec {
    ModelSpec::named("tiny-llama", 2, SEQ, dtype, LossKind::CrossEntropy).unwrap()
}

fn compiled(dtype: DType, moments_8bit: bool) -> CompiledStep {
    let train = TrainOptions { moments_8bit, state_dtype: Some(DType::F32), ..TrainOptions::default() };
    compile_step(&spec(dtype), &StepOptions { train, ..StepOptions::new(StepKind::Train) }).unwrap()
}

/// Two rows of a fixed token pattern and their next tokens.
fn batch(seed: usize) -> (HostTensor, HostTensor) {
    let ty = TensorType::new(DType::I32, [2, SEQ]);
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for r in 0..2 {
        let row: Vec<f64> = (0..=SEQ).map(|i| ((seed * 31 + r * 17 + i * (r + 2)) % 251) as f64).collect();
        ids.extend_from_slice(&row[..SEQ]);
        tg.extend_from_slice(&row[1..]);
    }
    (HostTensor::from_f64(ty.clone(), &ids), HostTensor::from_f64(ty, &tg))
}

/// The leaf `name` of the session's step, as it holds it now.
fn named(s: &mut CpuSession, name: &str) -> HostTensor {
    let v = s.trace().leaf_by_name(name).unwrap_or_else(|| panic!("no `{name}`"));
    s.read(v)
}

fn step(s: &mut CpuSession, it: usize, lr: f64) -> f64 {
    let (ids, tg) = batch(it % 4);
    s.write_named(TOKENS_INPUT, &ids).unwrap();
    s.write_named(TARGETS_INPUT, &tg).unwrap();
    s.write_named(LR_INPUT, &scalar_input(lr)).unwrap();
    s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
    s.run_eager().unwrap();
    s.loss().unwrap()
}

#[test]
fn eight_bit_moments_take_two_bytes_a_weight_and_a_scale_per_block() {
    let (dense, q) = (compiled(DType::BF16, false), compiled(DType::BF16, true));
    let state_bytes = |c: &CompiledStep| -> u64 {
        c.step
            .leaves()
            .filter(|&v| matches!(c.step.value(v).kind, ValueKind::State { .. }))
            .map(|v| c.step.ty(v).bytes())
            .sum()
    };
    let mut want = 0u64;
    for p in q.forward.params() {
        let n = q.forward.ty(p).numel() as u64;
        // Codes in whole 4-byte words, an f32 scale per block; and the
        // master state, which is the same either way.
        want += 2 * (n.div_ceil(4) * 4 + 4 * n.div_ceil(BLOCK as u64));
    }
    let master = state_bytes(&dense) - 8 * q.forward.params().map(|p| q.forward.ty(p).numel() as u64).sum::<u64>();
    assert_eq!(state_bytes(&q), want + master);
    assert!(q.step.nodes.iter().any(|n| matches!(n.op, Op::AdamW8bit(_))));
    assert!(!q.step.nodes.iter().any(|n| matches!(n.op, Op::AdamW(_))));
    // The step holds less: the moments are a quarter of f32 moments.
    assert!(q.plan.planned_peak_bytes() < dense.plan.planned_peak_bytes());
}

/// From zeroed state the first update reads zero moments either way and
/// updates the parameter from the unquantized new moments: dense f32
/// AdamW's parameters, bit for bit. The stored codes then hold each new
/// moment to half a gap of the map, times the block's scale.
#[test]
fn the_first_update_is_dense_adamws_and_the_codes_hold_the_moments() {
    for dtype in [DType::F32, DType::BF16] {
        let (dense, q) = (compiled(dtype, false), compiled(dtype, true));
        let (mut sd, mut sq) = (seeded_session(&dense, 7), seeded_session(&q, 7));
        step(&mut sd, 1, 1e-2);
        step(&mut sq, 1, 1e-2);
        for p in q.forward.params() {
            let name = q.forward.value(p).kind.leaf_name().unwrap();
            assert_eq!(named(&mut sd, name), named(&mut sq, name), "{dtype} `{name}`");
        }
        let signed = dynamic_map(true);
        let gap = signed.windows(2).map(|w| w[1] - w[0]).fold(0.0f32, f32::max) as f64;
        let name = "model.layers.0.mlp.down_proj.weight";
        let m = named(&mut sd, &format!("{name}.exp_avg")).to_f64();
        let codes = named(&mut sq, &format!("{name}.exp_avg.codes"));
        let scales = named(&mut sq, &format!("{name}.exp_avg.absmax")).to_f64();
        let codes = codes.bytes();
        for (i, &want) in m.iter().enumerate() {
            let scale = scales[i / BLOCK];
            let got = signed[codes[i] as usize] as f64 * scale;
            assert!((got - want).abs() <= gap / 2.0 * scale * 1.0001, "{dtype} element {i}: {got} for {want}");
        }
        // Each block's scale is its largest |m|.
        let block0 = m[..BLOCK.min(m.len())].iter().fold(0.0f64, |a, x| a.max(x.abs()));
        assert_eq!(scales[0], block0);
    }
}

/// 300 steps of a tiny f32 model on four repeated batches (it learns them
/// by heart): at every step the loss with 8-bit moments is within 1% of
/// the starting loss from the loss with f32 moments, and both fall below a
/// hundredth of where they started.
#[test]
fn three_hundred_steps_stay_within_a_band_of_f32_moments() {
    let (dense, q) = (compiled(DType::F32, false), compiled(DType::F32, true));
    let (mut sd, mut sq) = (seeded_session(&dense, 7), seeded_session(&q, 7));
    let (mut first, mut worst, mut last) = ((0.0, 0.0), 0.0f64, (0.0, 0.0));
    for it in 1..=300 {
        let (ld, lq) = (step(&mut sd, it, 3e-3), step(&mut sq, it, 3e-3));
        assert!(lq.is_finite(), "step {it}: loss {lq}");
        if it == 1 {
            first = (ld, lq);
        }
        worst = worst.max((lq - ld).abs());
        last = (ld, lq);
    }
    eprintln!(
        "8-bit moments: loss {:.4} -> {:.4}, f32 {:.4} -> {:.4}, worst gap {:.3e}",
        first.1, last.1, first.0, last.0, worst
    );
    assert!(worst <= 0.01 * first.0, "the 8-bit loss strays {worst:.3e} from f32's (start {:.4})", first.0);
    assert!(last.0 < 0.01 * first.0 && last.1 < 0.01 * first.1, "{first:?} -> {last:?}");
}
