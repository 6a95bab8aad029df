//! The training-step options a real run uses, on the CPU: gradient
//! accumulation inside the step (two micro-batches of B rows equal one batch
//! of 2B), global gradient-norm clipping computed in the graph (PyTorch's
//! `clip_grad_norm_`, with the norm as a step output, the same under data
//! parallelism, and a plan that keeps every gradient until the norm is
//! known), and weight decay that skips norms, biases and embeddings.

use std::sync::Arc;

use stepgraph_core::autodiff::{
    DecayScope, StepKind, TrainOptions, CLIP_EPS, GRAD_NORM_OUTPUT, LR_INPUT, PREVIOUS_GRAD_NORM_STATE, STEP_INPUT,
};
use stepgraph_core::cpu::comm::{run_ranks, Communicator};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::dist::{shard_rows, DataParallel};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, Phase, TensorType, Trace};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{LossKind, ModelSpec};
use stepgraph_core::ops::Op;
use stepgraph_core::passes::recompute::RecomputePolicy;
use stepgraph_core::pipeline::{compile_step, CompiledStep, StepOptions};
use stepgraph_core::testing::seeded_session;

const SEQ: usize = 16;

fn spec(batch: usize) -> ModelSpec {
    ModelSpec::named("tiny-llama", batch, SEQ, DType::F32, LossKind::CrossEntropy).unwrap()
}

/// `rows` rows of token ids and next-token targets, every target counted.
fn batch(rows: usize, seed: usize) -> (HostTensor, HostTensor) {
    let ty = TensorType::new(DType::I32, [rows, SEQ]);
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for r in 0..rows {
        let row: Vec<f64> = (0..=SEQ).map(|i| ((seed * 31 + r * 17 + i * (r % 3 + 1)) % 256) as f64).collect();
        ids.extend_from_slice(&row[..SEQ]);
        tg.extend_from_slice(&row[1..]);
    }
    (HostTensor::from_f64(ty.clone(), &ids), HostTensor::from_f64(ty, &tg))
}

/// Runs one step of `c` on `(ids, targets)` (rows `rank` of `world`); its loss.
fn step(s: &mut CpuSession, c: &CompiledStep, ids: &HostTensor, tg: &HostTensor, it: usize) -> f64 {
    s.write_named(TOKENS_INPUT, ids).unwrap();
    s.write_named(TARGETS_INPUT, tg).unwrap();
    if c.step.leaf_by_name(LR_INPUT).is_some() {
        s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
        s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
    }
    s.run_eager().unwrap();
    s.loss().unwrap()
}

/// The gradients of a grads step, by parameter name.
fn grads(s: &mut CpuSession, t: &Trace) -> Vec<(String, Vec<f64>)> {
    t.outputs
        .iter()
        .filter_map(|o| match o.kind {
            OutputKind::Grad(p) => Some((t.value(p).kind.leaf_name().unwrap().to_string(), o.value)),
            _ => None,
        })
        .map(|(name, g)| (name, s.read(g).to_f64()))
        .collect()
}

fn state(s: &mut CpuSession, t: &Trace, name: &str) -> Vec<f64> {
    s.read(t.leaf_by_name(name).unwrap()).to_f64()
}

/// max |a - b| / max |b|.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    d / b.iter().map(|y| y.abs()).fold(1e-30, f64::max)
}

fn train_opts(train: TrainOptions) -> StepOptions {
    StepOptions { train, ..StepOptions::new(StepKind::Train) }
}

#[test]
fn two_micro_batches_of_b_rows_equal_one_batch_of_2b() {
    let (ids, tg) = batch(4, 1);
    // Gradients: a grads step of 2 x 2 rows against one of 4 rows.
    let whole = compile_step(&spec(4), &StepOptions::new(StepKind::Grads)).unwrap();
    let accum = compile_step(&spec(2), &StepOptions { grad_accum: 2, ..StepOptions::new(StepKind::Grads) }).unwrap();
    assert_eq!(accum.step.ty(accum.step.leaf_by_name(TOKENS_INPUT).unwrap()).shape, [4, SEQ]);
    let (mut a, mut b) = (seeded_session(&whole, 7), seeded_session(&accum, 7));
    let (la, lb) = (step(&mut a, &whole, &ids, &tg, 1), step(&mut b, &accum, &ids, &tg, 1));
    assert!((la - lb).abs() <= 1e-6 * la.abs(), "loss {la} vs {lb}");
    let (ga, gb) = (grads(&mut a, &whole.step), grads(&mut b, &accum.step));
    assert_eq!(ga.len(), gb.len());
    for ((name, x), (_, y)) in ga.iter().zip(&gb) {
        assert!(rel(y, x) < 1e-5, "{name}: rel {}", rel(y, x));
    }
    // Training: three updates of the accumulated step follow the whole batch's.
    let whole = compile_step(&spec(4), &StepOptions::new(StepKind::Train)).unwrap();
    let accum = compile_step(&spec(2), &StepOptions { grad_accum: 2, ..StepOptions::new(StepKind::Train) }).unwrap();
    assert_eq!(
        accum.step.nodes.iter().filter(|n| matches!(n.op, Op::AdamW(_))).count(),
        whole.forward.params().count()
    );
    let (mut a, mut b) = (seeded_session(&whole, 7), seeded_session(&accum, 7));
    for it in 1..=3 {
        let (ids, tg) = batch(4, it);
        let (la, lb) = (step(&mut a, &whole, &ids, &tg, it), step(&mut b, &accum, &ids, &tg, it));
        assert!((la - lb).abs() <= 1e-5 * la.abs(), "step {it}: loss {la} vs {lb}");
    }
    for p in whole.forward.params() {
        let name = whole.forward.value(p).kind.leaf_name().unwrap();
        let (x, y) = (state(&mut a, &whole.step, name), state(&mut b, &accum.step, name));
        assert!(rel(&y, &x) < 1e-4, "{name}: rel {}", rel(&y, &x));
    }
}

/// Only one micro-batch's activations are live at a time, besides the
/// accumulated gradients, which live from the first micro-batch to the
/// update: where activations dominate (256 tokens a row) two micro-batches
/// of 4 rows plan less than one batch of 8, and one micro-batch's plan
/// plus the gradients when nothing is recomputed. (Recomputation
/// reaches the first micro-batch's forward only: later ones run in the
/// backward phase, and the peak is theirs.)
#[test]
fn micro_batches_plan_one_micro_batch_of_activations() {
    let sp = |batch| ModelSpec::named("tiny-llama", batch, 256, DType::F32, LossKind::CrossEntropy).unwrap();
    let peak = |batch, grad_accum, recompute| {
        let opts = StepOptions { grad_accum, recompute, ..StepOptions::new(StepKind::Train) };
        compile_step(&sp(batch), &opts).unwrap().planned_peak_bytes()
    };
    let grad_bytes: u64 = {
        let c = compile_step(&sp(4), &StepOptions::new(StepKind::Grads)).unwrap();
        c.forward.params().map(|p| c.forward.ty(p).bytes()).sum()
    };
    let (auto, off) = (RecomputePolicy::Auto, RecomputePolicy::Off);
    let (whole, accum) = (peak(8, 1, auto), peak(4, 2, auto));
    assert!(accum < whole * 9 / 10, "{accum} vs {whole}");
    let (whole, accum, one) = (peak(8, 1, off), peak(4, 2, off), peak(4, 1, off));
    assert!(accum < whole * 6 / 10, "{accum} vs {whole}");
    // Plus the micro-batches' inputs (an input keeps its slot for the whole
    // step, so each micro-batch's token ids and targets stay), a few
    // scalars (the micro-batches' losses) and alignment.
    let input_bytes: u64 = {
        let opts = StepOptions { grad_accum: 2, recompute: off, ..StepOptions::new(StepKind::Train) };
        let c = compile_step(&sp(4), &opts).unwrap();
        c.step.inputs().map(|v| c.step.ty(v).bytes()).sum()
    };
    assert!(
        accum.abs_diff(one + grad_bytes) <= input_bytes + 1024,
        "{accum}: one micro-batch {one}, gradients {grad_bytes}, inputs {input_bytes}"
    );
    let e = compile_step(&sp(4), &StepOptions { grad_accum: 0, ..StepOptions::new(StepKind::Train) }).unwrap_err();
    assert!(e.to_string().contains("at least 1 micro-batch, got 0"), "{e}");
}

#[test]
fn clipping_scales_every_gradient_by_the_global_norm() {
    let (ids, tg) = batch(2, 3);
    // The global norm of the step's gradients, from a grads step.
    let g = compile_step(&spec(2), &StepOptions::new(StepKind::Grads)).unwrap();
    let mut gs = seeded_session(&g, 7);
    step(&mut gs, &g, &ids, &tg, 1);
    let gradients = grads(&mut gs, &g.step);
    let norm = gradients.iter().flat_map(|(_, v)| v.iter()).map(|x| x * x).sum::<f64>().sqrt();

    // A bound far above the norm changes nothing, bit for bit.
    let plain = compile_step(&spec(2), &StepOptions::new(StepKind::Train)).unwrap();
    let loose =
        compile_step(&spec(2), &train_opts(TrainOptions { clip_grad_norm: Some(1e9), ..TrainOptions::default() }))
            .unwrap();
    let (mut a, mut b) = (seeded_session(&plain, 7), seeded_session(&loose, 7));
    for it in 1..=2 {
        assert_eq!(step(&mut a, &plain, &ids, &tg, it).to_bits(), step(&mut b, &loose, &ids, &tg, it).to_bits());
    }
    for p in plain.forward.params() {
        let name = plain.forward.value(p).kind.leaf_name().unwrap();
        assert_eq!(state(&mut a, &plain.step, name), state(&mut b, &loose.step, name), "{name}");
    }

    // A bound of a quarter of the norm: the norm is an output, and the first
    // moment after one step is (1 - β1) times the scaled gradient.
    let max = norm / 4.0;
    let tight =
        compile_step(&spec(2), &train_opts(TrainOptions { clip_grad_norm: Some(max), ..TrainOptions::default() }))
            .unwrap();
    let mut t = seeded_session(&tight, 7);
    step(&mut t, &tight, &ids, &tg, 1);
    let out = tight.step.outputs.iter().find(|o| o.kind == OutputKind::Named(GRAD_NORM_OUTPUT.into())).unwrap();
    let reported = t.read(out.value).to_f64()[0];
    assert!((reported - norm).abs() < 1e-5 * norm, "grad_norm {reported}, the gradients' norm {norm}");
    let scale = max / (norm + CLIP_EPS);
    for (name, g) in &gradients {
        let m = state(&mut t, &tight.step, &format!("{name}.exp_avg"));
        let want: Vec<f64> = g.iter().map(|x| 0.1 * x * scale).collect();
        assert!(rel(&m, &want) < 1e-5, "{name}: rel {}", rel(&m, &want));
    }
}

/// With clipping, no update can run before backward ends (each reads the
/// norm of every gradient): the placement says so, the plan holds every
/// gradient at once, and it is proved by `check_plan` like any other.
#[test]
fn plans_with_clipping_keep_every_gradient_until_the_norm() {
    let sp = ModelSpec::named("tiny-llama", 2, 64, DType::F32, LossKind::CrossEntropy).unwrap();
    let plain = compile_step(&sp, &StepOptions::new(StepKind::Train)).unwrap();
    let clip = TrainOptions { clip_grad_norm: Some(1.0), ..TrainOptions::default() };
    let clipped = compile_step(&sp, &train_opts(clip)).unwrap();
    let params = clipped.forward.params().count();
    let r = clipped.placement().unwrap();
    assert!(r.after_backward >= params, "{r}");
    assert!(r.note.as_deref().unwrap_or("").contains("gradient clipping"), "{r}");
    // Every AdamW update comes after the last node that makes a gradient's square.
    let last_backward = clipped.step.nodes.iter().rposition(|n| n.phase == Phase::Backward).unwrap();
    let first_update = clipped.step.nodes.iter().position(|n| matches!(n.op, Op::AdamW(_))).unwrap();
    assert!(first_update > last_backward);
    // All gradients live at once: the arena holds at least their bytes.
    let grad_bytes: u64 = clipped.forward.params().map(|p| clipped.forward.ty(p).bytes()).sum();
    assert!(clipped.plan.planned_peak_bytes() >= clipped.plan.persistent_bytes + grad_bytes);
    assert!(clipped.planned_peak_bytes() > plain.planned_peak_bytes(), "clipping costs the gradients' memory");
}

/// Clipping by the previous step's norm: the factor reads only the state
/// the caller writes, so the updates run inside backward (and free each
/// gradient at once), the plan is that of a step without clipping within a
/// MiB, and the step still outputs its own norm, as exact clipping does.
#[test]
fn clipping_by_the_previous_norm_lets_the_updates_run_in_backward() {
    let sp = ModelSpec::named("tiny-llama", 2, 64, DType::F32, LossKind::CrossEntropy).unwrap();
    let plain = compile_step(&sp, &StepOptions::new(StepKind::Train)).unwrap();
    let previous = TrainOptions { clip_grad_norm: Some(1.0), clip_by_previous_norm: true, ..TrainOptions::default() };
    let c = compile_step(&sp, &train_opts(previous)).unwrap();
    assert!(c.step.leaf_by_name(PREVIOUS_GRAD_NORM_STATE).is_some());
    let params = c.forward.params().count();
    let updates_in_backward =
        c.step.nodes.iter().filter(|n| n.phase == Phase::Backward && matches!(n.op, Op::AdamW(_))).count();
    assert!(updates_in_backward + 1 >= params, "{updates_in_backward} of {params} updates in backward");
    assert!(c.planned_peak_bytes() <= plain.planned_peak_bytes() + (1 << 20));
    let exact =
        compile_step(&sp, &train_opts(TrainOptions { clip_grad_norm: Some(1.0), ..TrainOptions::default() })).unwrap();
    assert!(c.planned_peak_bytes() < exact.planned_peak_bytes());
}

/// The factor is min(1, max / (previous + eps)) of the state as written:
/// from zero (the first step) no clipping, bit for bit the step without
/// it; from a previous norm ten times the bound, a tenth of the gradient
/// in the first moment. The step's own norm is exact clipping's, summed in
/// another order.
#[test]
fn clipping_by_the_previous_norm_scales_by_the_state_as_written() {
    let (ids, tg) = batch(2, 1);
    let unclipped = compile_step(&spec(2), &StepOptions::new(StepKind::Train)).unwrap();
    let opts = TrainOptions { clip_grad_norm: Some(0.5), clip_by_previous_norm: true, ..TrainOptions::default() };
    let previous = compile_step(&spec(2), &train_opts(opts)).unwrap();
    let exact =
        compile_step(&spec(2), &train_opts(TrainOptions { clip_grad_norm: Some(0.5), ..TrainOptions::default() }))
            .unwrap();
    let (mut u, mut p, mut e) =
        (seeded_session(&unclipped, 7), seeded_session(&previous, 7), seeded_session(&exact, 7));
    step(&mut u, &unclipped, &ids, &tg, 1);
    step(&mut p, &previous, &ids, &tg, 1);
    step(&mut e, &exact, &ids, &tg, 1);
    for name in ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"] {
        assert_eq!(state(&mut u, &unclipped.step, name), state(&mut p, &previous.step, name), "{name}");
    }
    let norm = |s: &mut CpuSession, c: &CompiledStep| {
        let o = c.step.outputs.iter().find(|o| o.kind == OutputKind::Named(GRAD_NORM_OUTPUT.into())).unwrap();
        s.read(o.value).to_f64()[0]
    };
    let (np, ne) = (norm(&mut p, &previous), norm(&mut e, &exact));
    assert!((np - ne).abs() <= 1e-6 * ne, "{np} vs {ne}");
    // A fresh run whose state says the previous norm was 5 (ten times 0.5).
    let mut q = seeded_session(&previous, 7);
    let leaf = previous.step.leaf_by_name(PREVIOUS_GRAD_NORM_STATE).unwrap();
    q.write(leaf, &HostTensor::from_f64(previous.step.ty(leaf).clone(), &[5.0])).unwrap();
    step(&mut q, &previous, &ids, &tg, 1);
    let name = "model.layers.0.mlp.up_proj.weight.exp_avg";
    let (full, tenth) = (state(&mut u, &unclipped.step, name), state(&mut q, &previous.step, name));
    let scaled: Vec<f64> = full.iter().map(|m| m * 0.5 / (5.0 + 1e-6)).collect();
    assert!(rel(&tenth, &scaled) < 1e-6, "rel {}", rel(&tenth, &scaled));
}

/// Data-parallel ranks clip by the norm of the all-reduced gradients: two
/// ranks of a clipped step train like one process with the whole batch.
#[test]
fn data_parallel_ranks_clip_by_the_global_batch_norm() {
    let clip = TrainOptions { clip_grad_norm: Some(0.05), ..TrainOptions::default() };
    let single = compile_step(&spec(4), &train_opts(clip.clone())).unwrap();
    let mut s = seeded_session(&single, 7);
    let mut want = Vec::new();
    for it in 1..=3 {
        let (ids, tg) = batch(4, it);
        want.push(step(&mut s, &single, &ids, &tg, it));
    }
    let dp = StepOptions { data_parallel: Some(DataParallel::new(2)), ..train_opts(clip) };
    let rank_step = compile_step(&spec(4), &dp).unwrap();
    let runs = run_ranks(2, |comm| {
        let rank = comm.rank();
        let mut s = seeded_session(&rank_step, 7);
        s.set_comm(Arc::new(comm))?;
        let mut losses = Vec::new();
        for it in 1..=3 {
            let (ids, tg) = batch(4, it);
            let (ids, tg) = (shard_rows(&ids, rank, 2).unwrap(), shard_rows(&tg, rank, 2).unwrap());
            losses.push(step(&mut s, &rank_step, &ids, &tg, it));
        }
        Ok(losses)
    })
    .unwrap();
    for losses in runs {
        for (l, w) in losses.iter().zip(&want) {
            assert!((l - w).abs() < 1e-5 * w.abs(), "{losses:?} vs {want:?}");
        }
    }
}

#[test]
fn norms_biases_and_embeddings_are_not_decayed_unless_asked() {
    let sp = ModelSpec::named("tiny-neox", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
    let decay_of = |scope: DecayScope| -> Vec<(String, f64)> {
        let mut opts = TrainOptions { decay: scope, ..TrainOptions::default() };
        opts.adamw.weight_decay = 0.1;
        let c = compile_step(&sp, &train_opts(opts)).unwrap();
        c.step
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::AdamW(h) => Some((c.step.value(n.inputs[0]).kind.leaf_name().unwrap().to_string(), h.weight_decay)),
                _ => None,
            })
            .collect()
    };
    assert!(decay_of(DecayScope::All).iter().all(|(_, wd)| *wd == 0.1));
    let scoped = decay_of(DecayScope::Matrices);
    for (name, wd) in &scoped {
        let undecayed = name.contains("norm") || name.ends_with(".bias") || name.contains("embed_tokens");
        assert_eq!(*wd, if undecayed { 0.0 } else { 0.1 }, "{name}");
    }
    assert!(scoped.iter().any(|(n, wd)| n.ends_with("q_proj.weight") && *wd == 0.1), "{scoped:?}");
    assert!(scoped.iter().any(|(n, wd)| n.ends_with(".bias") && *wd == 0.0), "{scoped:?}");
}
