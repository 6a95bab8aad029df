//! The fused LM head and cross-entropy (`linear_cross_entropy`) beyond its
//! sample table (which `tests/op_samples.rs` runs through the f64 VJP
//! check, the narrow-dtype and the garbage-output checks): whole GPT steps
//! with the fused head against the materialised-logits step (loss and every
//! gradient, f64 to 1e-6 relative and bf16 within its rounding, untied and
//! tied heads, several chunk sizes), the sum reduction and ignored rows
//! against their definitions, what the builder records, the memory the
//! planner gives the head, and user-facing errors.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, TensorType, Trace};
use stepgraph_core::models::gpt::{build_forward_with, HeadLoss, TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{build_forward, init_params, Config, LossKind, ModelSpec};
use stepgraph_core::ops::linear_ce::{LinearCrossEntropy, LinearCrossEntropyBackward, Reduction};
use stepgraph_core::ops::loss::CrossEntropy;
use stepgraph_core::ops::Op;
use stepgraph_core::plan::{plan, PlanOptions};
use stepgraph_core::testing::{interpret, run_op};
use stepgraph_core::Error;

const IGNORE: i64 = -100;

fn spec(name: &str, dtype: DType, tied: bool) -> ModelSpec {
    let mut config = Config::named(name).unwrap();
    config.tie_embeddings = tied;
    ModelSpec { config, batch: 2, seq: 8, dtype, loss: LossKind::CrossEntropy, adapters: None, documents: false }
}

/// Random tokens and targets with every fifth target ignored.
fn batch(spec: &ModelSpec, seed: u64) -> Vec<(&'static str, HostTensor)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = spec.batch * spec.seq;
    let ty = TensorType::new(DType::I32, [spec.batch, spec.seq]);
    let v = spec.config.vocab_size;
    let ids: Vec<f64> = (0..n).map(|_| rng.gen_range(0..v) as f64).collect();
    let t: Vec<f64> = (0..n).map(|i| if i % 5 == 2 { IGNORE as f64 } else { rng.gen_range(0..v) as f64 }).collect();
    vec![(TOKENS_INPUT, HostTensor::from_f64(ty.clone(), &ids)), (TARGETS_INPUT, HostTensor::from_f64(ty, &t))]
}

/// The loss and every parameter's gradient (by parameter name) of the
/// grads step of `spec` with the head recorded as `head`, interpreted on
/// the CPU kernels from parameters initialised by `seed`.
fn loss_and_grads(spec: &ModelSpec, head: HeadLoss, seed: u64) -> (f64, HashMap<String, Vec<f64>>) {
    let fwd = build_forward_with(spec, head).unwrap();
    let step = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
    let mut leaves = HashMap::new();
    for (v, t) in init_params(&fwd, seed) {
        let name = fwd.value(v).kind.leaf_name().unwrap();
        leaves.insert(step.leaf_by_name(name).unwrap(), t);
    }
    for (name, t) in batch(spec, seed + 1) {
        leaves.insert(step.leaf_by_name(name).unwrap(), t);
    }
    let vals = interpret(&step, &leaves).unwrap();
    let loss = vals[step.loss().unwrap().index()].to_f64()[0];
    let mut grads = HashMap::new();
    for o in &step.outputs {
        if let OutputKind::Grad(p) = o.kind {
            let name = step.value(p).kind.leaf_name().unwrap().to_string();
            grads.insert(name, vals[o.value.index()].to_f64());
        }
    }
    (loss, grads)
}

/// max |a − b| over max |b|.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-300);
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn ops_of(t: &Trace) -> Vec<&'static str> {
    t.nodes.iter().map(|n| n.op.name()).collect()
}

#[test]
fn fused_steps_equal_the_materialised_step_in_f64() {
    for (name, tied) in [("tiny-llama", false), ("tiny-llama", true), ("tiny-neox", false)] {
        let sp = spec(name, DType::F64, tied);
        let (loss, grads) = loss_and_grads(&sp, HeadLoss::Materialised, 3);
        assert!(loss.is_finite() && grads.len() > 5, "{name}: loss {loss}, {} grads", grads.len());
        // One column at a time, a chunk that leaves a narrower last one, the
        // default (an eighth of 256), and one chunk wider than the vocabulary.
        for chunk in [Some(1), Some(7), None, Some(1000)] {
            let (fl, fg) = loss_and_grads(&sp, HeadLoss::Fused { chunk }, 3);
            let what = format!("{name} tied={tied} chunk {chunk:?}");
            assert!((fl - loss).abs() <= 1e-12 * loss.abs(), "{what}: loss {fl} vs {loss}");
            assert_eq!(fg.len(), grads.len(), "{what}");
            for (p, g) in &grads {
                let r = rel(&fg[p], g);
                assert!(r <= 1e-12, "{what}: gradient of {p} differs by {r:e} (relative)");
            }
        }
    }
}

#[test]
fn fused_bf16_steps_track_the_materialised_step_and_f64() {
    for tied in [false, true] {
        let sp = spec("tiny-llama", DType::BF16, tied);
        let (loss, grads) = loss_and_grads(&sp, HeadLoss::Materialised, 5);
        let (fl, fg) = loss_and_grads(&sp, HeadLoss::Fused { chunk: Some(40) }, 5);
        let (wl, wg) = loss_and_grads(&spec("tiny-llama", DType::F64, tied), HeadLoss::Fused { chunk: Some(40) }, 5);
        assert!((fl - loss).abs() <= 1e-2 * loss.abs(), "tied={tied}: bf16 loss {fl} vs materialised {loss}");
        assert!((fl - wl).abs() <= 1e-2 * wl.abs(), "tied={tied}: bf16 loss {fl} vs f64 {wl}");
        for (p, g) in &grads {
            // bf16 keeps 8 bits: both paths round the logits and their
            // cotangent once to bf16 and accumulate in f32.
            let r = rel(&fg[p], g);
            assert!(r <= 5e-2, "tied={tied}: gradient of {p}: fused differs from materialised by {r:e}");
            let r = rel(&fg[p], &wg[p]);
            assert!(r <= 5e-2, "tied={tied}: gradient of {p}: bf16 differs from f64 by {r:e}");
        }
    }
}

/// A tiny head: `[rows, feats]` hidden, `[classes, feats]` weight, targets
/// with every third row ignored (row 1 always kept).
fn head_inputs(dtype: DType, rows: usize, feats: usize, classes: usize, seed: u64) -> Vec<HostTensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut normal = |n: usize| -> Vec<f64> { (0..n).map(|_| StandardNormal.sample(&mut rng)).collect() };
    let h = HostTensor::from_f64(TensorType::new(dtype, [rows, feats]), &normal(rows * feats));
    let w = HostTensor::from_f64(TensorType::new(dtype, [classes, feats]), &normal(classes * feats));
    let t: Vec<f64> = (0..rows).map(|i| if i % 3 == 0 { IGNORE as f64 } else { ((i * 31) % classes) as f64 }).collect();
    vec![h, w, HostTensor::from_f64(TensorType::new(DType::I64, [rows]), &t)]
}

fn lce(chunk: usize, reduction: Reduction) -> Op {
    Op::from(LinearCrossEntropy { chunk, reduction, ignore_index: IGNORE })
}

#[test]
fn the_sum_is_the_mean_times_the_kept_rows_and_ignored_rows_get_no_gradient() {
    let (rows, feats, classes) = (9, 5, 13);
    let x = head_inputs(DType::F64, rows, feats, classes, 1);
    let kept = (0..rows).filter(|i| i % 3 != 0).count() as f64;
    let mean = run_op(&lce(4, Reduction::Mean), &x).unwrap();
    let sum = run_op(&lce(4, Reduction::Sum), &x).unwrap();
    let (m, s) = (mean[0].to_f64()[0], sum[0].to_f64()[0]);
    assert!((s - m * kept).abs() <= 1e-12 * s.abs(), "sum {s} vs mean {m} × {kept}");
    assert_eq!(mean[1].bytes(), sum[1].bytes(), "lse does not depend on the reduction");
    // The reference: the materialised logits through the unfused loss.
    let logits: Vec<f64> = {
        let (h, w) = (x[0].to_f64(), x[1].to_f64());
        let mut l = vec![0.0; rows * classes];
        for n in 0..rows {
            for v in 0..classes {
                l[n * classes + v] = (0..feats).map(|k| h[n * feats + k] * w[v * feats + k]).sum();
            }
        }
        l
    };
    let logits = HostTensor::from_f64(TensorType::new(DType::F64, [rows, classes]), &logits);
    let ce = run_op(&Op::from(CrossEntropy { ignore_index: IGNORE }), &[logits, x[2].clone()]).unwrap();
    assert!((m - ce[0].to_f64()[0]).abs() <= 1e-12 * m.abs(), "mean {m} vs unfused {:?}", ce[0].to_f64());
    assert!(rel(&mean[1].to_f64(), &ce[1].to_f64()) <= 1e-12);
    // The workspaces come back all zero.
    assert!(mean[2].to_f64().iter().chain(&mean[3].to_f64()).all(|&v| v == 0.0));

    // Backward with only a loss cotangent: ignored rows of dhidden are zero;
    // sum with cotangent g equals mean with cotangent g · kept.
    let backward = |reduction, g: f64| {
        let op = Op::from(LinearCrossEntropyBackward { chunk: 4, reduction, ignore_index: IGNORE, weight_grad: true });
        let mut ins = x.clone();
        ins.push(mean[1].clone());
        ins.push(HostTensor::from_f64(TensorType::scalar(DType::F64), &[g]));
        run_op(&op, &ins).unwrap()
    };
    let bs = backward(Reduction::Sum, 0.5);
    let bm = backward(Reduction::Mean, 0.5 * kept);
    let dh = bs[0].to_f64();
    for n in (0..rows).step_by(3) {
        assert!(dh[n * feats..(n + 1) * feats].iter().all(|&v| v == 0.0), "ignored row {n} got a gradient");
    }
    assert!(dh[feats..2 * feats].iter().any(|&v| v != 0.0), "kept row 1 got no gradient");
    for k in 0..2 {
        assert!(rel(&bs[k].to_f64(), &bm[k].to_f64()) <= 1e-12, "output {k}: sum and scaled mean differ");
    }
    for w in &bs[2..] {
        assert!(w.to_f64().iter().all(|&v| v == 0.0), "a workspace came back non-zero");
    }
}

#[test]
fn the_result_does_not_depend_on_the_chunk_beyond_rounding() {
    let x = head_inputs(DType::F64, 11, 6, 50, 2);
    let whole = run_op(&lce(50, Reduction::Mean), &x).unwrap();
    for chunk in [1, 3, 16, 49, 64] {
        let got = run_op(&lce(chunk, Reduction::Mean), &x).unwrap();
        for k in 0..2 {
            let r = rel(&got[k].to_f64(), &whole[k].to_f64());
            assert!(r <= 1e-14, "chunk {chunk} output {k}: {r:e}");
        }
        assert_eq!(got[2].ty.shape, [11, chunk.min(50)], "the chunk workspace is [rows, min(chunk, classes)]");
    }
}

#[test]
fn the_builder_fuses_the_head_only_for_cross_entropy_without_a_head_bias() {
    let sp = spec("tiny-llama", DType::F32, false);
    let fused = build_forward(&sp).unwrap();
    let ops = ops_of(&fused);
    assert!(ops.contains(&"linear_cross_entropy") && !ops.contains(&"cross_entropy"), "{ops:?}");
    // No computed value in the forward is as large as the logits (only the
    // parameters are).
    let logits = sp.batch * sp.seq * sp.config.padded_vocab_size;
    let params: Vec<_> = fused.params().collect();
    let largest = (0..fused.values.len())
        .filter(|&i| !params.iter().any(|p| p.index() == i))
        .map(|i| fused.values[i].ty.numel())
        .max()
        .unwrap();
    assert!(largest < logits, "a value of {largest} elements, the logits have {logits}");
    // The attributes: the default chunk (an eighth of 256) and a mean.
    let n = fused.nodes.iter().find(|n| n.op.name() == "linear_cross_entropy").unwrap();
    assert_eq!(n.op, lce(32, Reduction::Mean));

    let sum = build_forward(&ModelSpec { loss: LossKind::Sum, ..sp.clone() }).unwrap();
    let ops = ops_of(&sum);
    assert!(ops.contains(&"matmul") && !ops.contains(&"linear_cross_entropy"), "{ops:?}");

    let mut biased = sp.clone();
    biased.config.lm_head_bias = true;
    let ops = ops_of(&build_forward(&biased).unwrap()).into_iter().collect::<Vec<_>>();
    assert!(ops.contains(&"cross_entropy") && !ops.contains(&"linear_cross_entropy"), "{ops:?}");

    let e = build_forward_with(&sp, HeadLoss::Fused { chunk: Some(0) }).unwrap_err().to_string();
    assert!(e.contains("tiny-llama") && e.contains("chunk") && e.contains("got 0"), "{e}");
}

#[test]
fn the_fused_head_plans_less_than_the_logits() {
    // A vocabulary large next to the model, as in W2: the materialised step
    // holds [tokens, vocab] logits (and their cotangent), the fused one a
    // chunk of them.
    let mut sp = spec("tiny-llama", DType::BF16, false);
    sp.config.vocab_size = 8192;
    sp.config.padded_vocab_size = 8192;
    sp.batch = 4;
    sp.seq = 64;
    let peak = |head| {
        let fwd = build_forward_with(&sp, head).unwrap();
        let step = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
        plan(&step, PlanOptions::default()).unwrap().planned_peak_bytes()
    };
    let (materialised, fused) = (peak(HeadLoss::Materialised), peak(HeadLoss::default()));
    let logits = (sp.batch * sp.seq * 8192 * 2) as u64;
    // The fused head holds a chunk (an eighth of the logits) and two
    // [tokens, features] buffers at its own nodes: at least 3/4 of the
    // logits' bytes are saved.
    assert!(
        fused + logits / 4 * 3 <= materialised,
        "fused {fused} bytes, materialised {materialised}: most of the logits ({logits}) should be gone"
    );
}

#[test]
fn bad_operands_are_refused_with_what_would_be_accepted() {
    let x = head_inputs(DType::F32, 4, 3, 5, 3);
    let t = |dt, s: &[usize]| TensorType::new(dt, s.to_vec());
    let op = lce(2, Reduction::Mean);
    let e = op.infer(&[&x[0].ty, &t(DType::F32, &[5, 4]), &x[2].ty]).unwrap_err();
    assert!(e.contains("[classes, 3] f32") && e.contains("f32[5,4]"), "{e}");
    let e = op.infer(&[&x[0].ty, &x[1].ty, &t(DType::I32, &[3])]).unwrap_err();
    assert!(e.contains("one entry per hidden row (4)"), "{e}");
    let e = lce(0, Reduction::Mean).infer(&[&x[0].ty, &x[1].ty, &x[2].ty]).unwrap_err();
    assert!(e.contains("chunk") && e.contains("got 0"), "{e}");
    let bad_targets = HostTensor::from_f64(t(DType::I64, &[4]), &[0.0, 5.0, 1.0, IGNORE as f64]);
    let e = run_op(&op, &[x[0].clone(), x[1].clone(), bad_targets]).unwrap_err();
    assert!(matches!(&e, Error::Input { name, .. } if name == "targets"), "{e}");
    let e = e.to_string();
    assert!(e.contains("target 5") && e.contains("position 1") && e.contains("5 classes"), "{e}");
}
