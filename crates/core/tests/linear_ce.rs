//! The fused LM head and cross-entropy (`linear_cross_entropy`) beyond its
//! sample table (which `tests/op_samples.rs` runs through the f64 VJP
//! check, the narrow-dtype and the garbage-output checks): whole GPT steps
//! with the fused head against the materialised-logits step (loss and every
//! gradient, f64 to 1e-6 relative and bf16 within its rounding, untied and
//! tied heads, several chunk sizes), the sum reduction and ignored rows
//! against their definitions, what the builder records, the memory the
//! planner gives the head, and user-facing errors; and the soft-capped
//! head (Gemma 2's final logit cap) against an independent f64 reference,
//! against the capped materialised step, and what the builder and the
//! planner make of a capped model.

use std::collections::{BTreeMap, HashMap};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::{DType, TensorType, Trace};
use stepgraph_core::models::gpt::{
    build_forward_with, build_forward_with_logits, HeadLoss, TARGETS_INPUT, TOKENS_INPUT,
};
use stepgraph_core::models::{build_forward, init_params, Config, LossKind, ModelSpec};
use stepgraph_core::ops::linear_ce::{LinearCrossEntropy, LinearCrossEntropyBackward, Reduction};
use stepgraph_core::ops::loss::CrossEntropy;
use stepgraph_core::ops::Op;
use stepgraph_core::plan::{plan, PlanOptions};
use stepgraph_core::testing::{grads_by_name, interpret, run_op};
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
fn loss_and_grads(spec: &ModelSpec, head: HeadLoss, seed: u64) -> (f64, BTreeMap<String, Vec<f64>>) {
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
    (loss, grads_by_name(&step, |v| vals[v.index()].to_f64()))
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
    lce_capped(chunk, reduction, 0.0)
}

fn lce_capped(chunk: usize, reduction: Reduction, softcap: f64) -> Op {
    Op::from(LinearCrossEntropy { chunk, reduction, ignore_index: IGNORE, softcap })
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
        let op = Op::from(LinearCrossEntropyBackward {
            chunk: 4,
            reduction,
            ignore_index: IGNORE,
            softcap: 0.0,
            weight_grad: true,
        });
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

/// The planned peak of `sp`'s gradient step with its head recorded as `head`.
fn peak(sp: &ModelSpec, head: HeadLoss) -> u64 {
    let fwd = build_forward_with(sp, head).unwrap();
    let step = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
    plan(&step, PlanOptions::default()).unwrap().planned_peak_bytes()
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
    let (materialised, fused) = (peak(&sp, HeadLoss::Materialised), peak(&sp, HeadLoss::default()));
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

/// The soft-capped head by its definition, in f64 loops over the inputs
/// `x` of [`head_inputs`]: each logit `cap·tanh(h·w/cap)` (`h·w` when `cap`
/// is 0), the rows' log-sum-exps, the loss (the mean or the sum over the
/// kept rows) and, for the loss cotangent `gloss` and the lse cotangent
/// `glse`, the cotangents of the hidden states and the weight, through the
/// cap's slope `1 − tanh²`.
struct Definition {
    loss: f64,
    lse: Vec<f64>,
    dhidden: Vec<f64>,
    dweight: Vec<f64>,
}

fn definition(x: &[HostTensor], cap: f64, reduction: Reduction, gloss: f64, glse: &[f64]) -> Definition {
    let (h, w, t) = (x[0].to_f64(), x[1].to_f64(), x[2].to_f64());
    let (rows, feats, classes) = (x[0].ty.shape[0], x[0].ty.shape[1], x[1].ty.shape[0]);
    let kept = t.iter().filter(|&&t| t != IGNORE as f64).count() as f64;
    let per_row = if reduction == Reduction::Mean { gloss / kept } else { gloss };
    let (mut loss, mut lse) = (0.0, vec![0.0; rows]);
    let (mut dhidden, mut dweight) = (vec![0.0; rows * feats], vec![0.0; classes * feats]);
    for n in 0..rows {
        let hn = &h[n * feats..(n + 1) * feats];
        let z: Vec<f64> = (0..classes).map(|v| (0..feats).map(|k| hn[k] * w[v * feats + k]).sum()).collect();
        let y: Vec<f64> = z.iter().map(|&z| if cap > 0.0 { cap * (z / cap).tanh() } else { z }).collect();
        let m = y.iter().fold(f64::NEG_INFINITY, |m, &y| m.max(y));
        lse[n] = m + y.iter().map(|&y| (y - m).exp()).sum::<f64>().ln();
        let target = (t[n] != IGNORE as f64).then_some(t[n] as usize);
        if let Some(tn) = target {
            loss += lse[n] - y[tn];
        }
        let a = if target.is_some() { per_row } else { 0.0 };
        for v in 0..classes {
            let p = (y[v] - lse[n]).exp();
            let dy = a * (p - if target == Some(v) { 1.0 } else { 0.0 }) + glse[n] * p;
            let dz = if cap > 0.0 { dy * (1.0 - (z[v] / cap).tanh().powi(2)) } else { dy };
            for k in 0..feats {
                dhidden[n * feats + k] += dz * w[v * feats + k];
                dweight[v * feats + k] += dz * hn[k];
            }
        }
    }
    if reduction == Reduction::Mean {
        loss /= kept;
    }
    Definition { loss, lse, dhidden, dweight }
}

#[test]
fn soft_capped_heads_match_their_definition_in_f64() {
    // Six features of unit normals: logits of standard deviation about 2.4,
    // so a cap of 1 bites hard, 2.5 in the tails and 30 barely.
    let (rows, feats, classes) = (10, 6, 23);
    let x = head_inputs(DType::F64, rows, feats, classes, 4);
    let glse: Vec<f64> = (0..rows).map(|i| 0.1 * i as f64 - 0.4).collect();
    let uncapped = definition(&x, 0.0, Reduction::Mean, 1.0, &glse).loss;
    for cap in [0.0, 1.0, 2.5, 30.0] {
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let want = definition(&x, cap, reduction, 0.75, &glse);
            if cap > 0.0 && cap < 30.0 && reduction == Reduction::Mean {
                let moved = (want.loss - uncapped).abs() / uncapped;
                assert!(moved > 0.05, "cap {cap}: the cap moves the loss by only {moved:e} (relative)");
            }
            // One column at a time, a narrower last chunk, one chunk, wider.
            for chunk in [1, 4, 23, 64] {
                let what = format!("cap {cap} {reduction:?} chunk {chunk}");
                let fwd = run_op(&lce_capped(chunk, reduction, cap), &x).unwrap();
                let loss = fwd[0].to_f64()[0];
                assert!((loss - want.loss).abs() <= 1e-12 * want.loss.abs(), "{what}: loss {loss} vs {}", want.loss);
                assert!(rel(&fwd[1].to_f64(), &want.lse) <= 1e-12, "{what}: lse");
                let op = Op::from(LinearCrossEntropyBackward {
                    chunk,
                    reduction,
                    ignore_index: IGNORE,
                    softcap: cap,
                    weight_grad: true,
                });
                let mut ins = x.clone();
                ins.push(fwd[1].clone());
                ins.push(HostTensor::from_f64(TensorType::scalar(DType::F64), &[0.75]));
                ins.push(HostTensor::from_f64(TensorType::new(DType::F64, [rows]), &glse));
                let bwd = run_op(&op, &ins).unwrap();
                let r = rel(&bwd[0].to_f64(), &want.dhidden);
                assert!(r <= 1e-12, "{what}: dhidden differs by {r:e} (relative)");
                let r = rel(&bwd[1].to_f64(), &want.dweight);
                assert!(r <= 1e-12, "{what}: dweight differs by {r:e} (relative)");
                for w in fwd[2..].iter().chain(&bwd[2..]) {
                    assert!(w.to_f64().iter().all(|&v| v == 0.0), "{what}: a workspace came back non-zero");
                }
            }
        }
    }
}

/// [`spec`] with the logits soft-capped at `cap`.
fn capped_spec(name: &str, dtype: DType, tied: bool, cap: f64) -> ModelSpec {
    let mut sp = spec(name, dtype, tied);
    sp.config.final_softcap = Some(cap);
    sp
}

/// A cap that bites on the tiny models' logits (initialised small).
const TINY_CAP: f64 = 0.05;

#[test]
fn capped_fused_steps_equal_the_capped_materialised_step() {
    for tied in [false, true] {
        let plain = loss_and_grads(&spec("tiny-llama", DType::F64, tied), HeadLoss::Materialised, 3).0;
        let sp = capped_spec("tiny-llama", DType::F64, tied, TINY_CAP);
        let (loss, grads) = loss_and_grads(&sp, HeadLoss::Materialised, 3);
        // The cap moves the loss: the comparison below would not see a
        // fused op that ignored it otherwise.
        assert!((loss - plain).abs() > 1e-4 * plain, "tied={tied}: capped loss {loss}, plain {plain}");
        for chunk in [Some(1), Some(7), None, Some(1000)] {
            let (fl, fg) = loss_and_grads(&sp, HeadLoss::Fused { chunk }, 3);
            let what = format!("tied={tied} chunk {chunk:?}");
            assert!((fl - loss).abs() <= 1e-12 * loss.abs(), "{what}: loss {fl} vs {loss}");
            assert_eq!(fg.len(), grads.len(), "{what}");
            for (p, g) in &grads {
                let r = rel(&fg[p], g);
                assert!(r <= 1e-12, "{what}: gradient of {p} differs by {r:e} (relative)");
            }
        }
    }
    // bf16: the materialised path caps in bf16 (three roundings), the
    // fused one in f32 from the rounded product.
    let sp = capped_spec("tiny-llama", DType::BF16, false, TINY_CAP);
    let (loss, grads) = loss_and_grads(&sp, HeadLoss::Materialised, 5);
    let (fl, fg) = loss_and_grads(&sp, HeadLoss::Fused { chunk: Some(40) }, 5);
    let (wl, wg) =
        loss_and_grads(&capped_spec("tiny-llama", DType::F64, false, TINY_CAP), HeadLoss::Fused { chunk: Some(40) }, 5);
    assert!((fl - loss).abs() <= 1e-2 * loss.abs(), "bf16 loss {fl} vs materialised {loss}");
    assert!((fl - wl).abs() <= 1e-2 * wl.abs(), "bf16 loss {fl} vs f64 {wl}");
    for (p, g) in &grads {
        let r = rel(&fg[p], g);
        assert!(r <= 5e-2, "gradient of {p}: fused differs from materialised by {r:e}");
        let r = rel(&fg[p], &wg[p]);
        assert!(r <= 5e-2, "gradient of {p}: bf16 differs from f64 by {r:e}");
    }
}

#[test]
fn a_capped_model_fuses_its_head_and_the_cap_prints_only_where_set() {
    let sp = capped_spec("tiny-llama", DType::F32, false, 30.0);
    let fwd = build_forward(&sp).unwrap();
    let ops = ops_of(&fwd);
    assert!(
        ops.contains(&"linear_cross_entropy") && !ops.contains(&"cross_entropy") && !ops.contains(&"tanh"),
        "{ops:?}"
    );
    let n = fwd.nodes.iter().find(|n| n.op.name() == "linear_cross_entropy").unwrap();
    assert_eq!(n.op, lce_capped(32, Reduction::Mean, 30.0));
    let step = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
    let bwd = step.nodes.iter().find_map(|n| match &n.op {
        Op::LinearCrossEntropyBackward(b) => Some(b.softcap),
        _ => None,
    });
    assert_eq!(bwd, Some(30.0), "the backward carries the forward's cap");
    // Printed on both ops, and read back.
    let text = step.to_string();
    let capped_lines = text.lines().filter(|l| l.contains("linear_cross_entropy") && l.contains("softcap")).count();
    assert_eq!(capped_lines, 2, "{text}");
    assert_eq!(parse(&text).unwrap().to_string(), text);
    // An uncapped head prints no cap (golden files unchanged).
    let plain = build_forward(&spec("tiny-llama", DType::F32, false)).unwrap().to_string();
    assert!(plain.contains("linear_cross_entropy") && !plain.contains("softcap"), "{plain}");
    // The logits as an output: materialised and capped, as before.
    let ops = ops_of(&build_forward_with_logits(&sp).unwrap());
    assert!(ops.contains(&"tanh") && ops.contains(&"cross_entropy") && !ops.contains(&"linear_cross_entropy"));
    // A cap that is no number is refused by the shape rule and the parser.
    let x = head_inputs(DType::F32, 4, 3, 5, 3);
    let e = lce_capped(2, Reduction::Mean, -1.0).infer(&[&x[0].ty, &x[1].ty, &x[2].ty]).unwrap_err();
    assert!(e.contains("soft-cap") && e.contains("got -1"), "{e}");
    let bad = text.replacen("softcap=30", "softcap=-30", 1);
    assert_ne!(bad, text, "the cap prints as softcap=30…");
    assert!(parse(&bad).unwrap_err().to_string().contains("soft-cap"));
}

#[test]
fn a_capped_fused_head_plans_less_than_its_capped_logits() {
    // As `the_fused_head_plans_less_than_the_logits`, with the cap: the
    // materialised path holds the logits and their capped copy.
    let mut sp = capped_spec("tiny-llama", DType::BF16, false, 30.0);
    sp.config.vocab_size = 8192;
    sp.config.padded_vocab_size = 8192;
    sp.batch = 4;
    sp.seq = 64;
    let (materialised, fused) = (peak(&sp, HeadLoss::Materialised), peak(&sp, HeadLoss::default()));
    let logits = (sp.batch * sp.seq * 8192 * 2) as u64;
    assert!(
        fused + logits <= materialised,
        "fused {fused} bytes, materialised {materialised}: at least the logits ({logits}) should be gone"
    );
}
