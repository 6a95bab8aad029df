//! The epilogue pass (`stepgraph_core::passes::fusion`) on whole steps: which adds
//! fold, that folded steps compute what unfolded ones do (on the CPU
//! backend, every output and every updated state), that their plans are no
//! larger, and that the folded ops print and parse back.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use stepgraph_core::autodiff::{StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::{DType, TensorType, Trace};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{init_params, LossKind, ModelSpec};
use stepgraph_core::ops::elementwise::Binary;
use stepgraph_core::ops::optim::{AdamW, MasterWeights};
use stepgraph_core::ops::sample::Sample;
use stepgraph_core::ops::{BinaryFn, Op, OpDef};
use stepgraph_core::passes::fusion::{fold, Epilogues};
use stepgraph_core::pipeline::{compile_step, CompiledStep, StepOptions};
use stepgraph_core::testing::{draw_sample, run_op};

fn compile(name: &str, dtype: DType, kind: StepKind, epilogues: Epilogues, grad_accum: usize) -> CompiledStep {
    let spec = ModelSpec::named(name, 2, 8, dtype, LossKind::CrossEntropy).unwrap();
    compile_step(&spec, &StepOptions { epilogues, grad_accum, ..StepOptions::new(kind) }).unwrap()
}

fn count(step: &Trace, pred: impl Fn(&Op) -> bool) -> usize {
    step.nodes.iter().filter(|n| pred(&n.op)).count()
}

fn is_add(op: &Op) -> bool {
    matches!(op, Op::Binary(b) if b.f == BinaryFn::Add)
}

/// Runs one step of `c` from parameters of seed 7 and a fixed batch; every
/// output and every state after the step, as f64.
fn run(c: &CompiledStep, grad_accum: usize) -> Vec<Vec<f64>> {
    let mut s = CpuSession::new(c.step.clone(), c.plan.clone()).unwrap();
    for (v, t) in init_params(&c.forward, 7) {
        s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
    }
    let mut rng = StdRng::seed_from_u64(3);
    let rows = c.spec.batch * grad_accum;
    let ty = TensorType::new(DType::I32, [rows, c.spec.seq]);
    let mut draw =
        || -> Vec<f64> { (0..rows * c.spec.seq).map(|_| rng.gen_range(0..c.spec.config.vocab_size) as f64).collect() };
    let (ids, targets) = (draw(), draw());
    s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), &ids)).unwrap();
    s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty, &targets)).unwrap();
    if c.step.leaf_by_name(LR_INPUT).is_some() {
        s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
        s.write_named(STEP_INPUT, &scalar_input(1.0)).unwrap();
        for v in c.step.leaves().collect::<Vec<_>>() {
            if matches!(c.step.value(v).kind, stepgraph_core::ir::ValueKind::State { .. }) {
                s.write(v, &HostTensor::zeros(c.step.ty(v).clone())).unwrap();
            }
        }
    }
    s.run_eager().unwrap();
    let mut out: Vec<Vec<f64>> = c.step.outputs.iter().map(|o| s.read(o.value).to_f64()).collect();
    out.extend(c.step.updates.iter().map(|u| s.read(u.state).to_f64()));
    out
}

/// The largest difference between `a` and `b` relative to `b`'s largest magnitude, over every tensor.
fn worst_rel(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = y.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
            x.iter().zip(y).fold(0f64, |m, (p, q)| m.max((p - q).abs() / scale))
        })
        .fold(0.0, f64::max)
}

#[test]
fn every_add_of_a_llama_step_folds_into_a_product_or_a_norm_backward() {
    for kind in [StepKind::Grads, StepKind::Train] {
        let off = compile("tiny-llama", DType::F32, kind, Epilogues::Off, 1);
        let on = compile("tiny-llama", DType::F32, kind, Epilogues::On, 1);
        let adds = count(&off.step, is_add);
        assert!(adds > 0);
        assert_eq!(count(&on.step, is_add), 0, "{kind:?}: an add was left");
        assert_eq!(on.fusion().total(), adds);
        let into_products = count(&on.step, |op| matches!(op, Op::MatMul(m) if m.addend));
        let into_norms = count(&on.step, |op| matches!(op, Op::RmsNormBackward(n) if n.addend));
        assert_eq!(into_products + into_norms, adds);
        assert!(into_products > 0 && into_norms > 0);
        assert_eq!(on.fusion().folded.get("matmul"), Some(&into_products));
        // On the same trace, the pass removes one node per add (the
        // compiled steps may recompute differently).
        let (folded, report) = fold(&off.step).unwrap();
        assert_eq!(folded.nodes.len() + report.total(), off.step.nodes.len(), "{kind:?}: one node fewer per add");
        // The sums the adds stored are gone: no larger a plan.
        assert!(on.planned_peak_bytes() <= off.planned_peak_bytes());
    }
}

#[test]
fn biases_fold_into_their_products_and_residual_gradients_into_layer_norm_backward() {
    let on = compile("tiny-neox", DType::F32, StepKind::Grads, Epilogues::On, 1);
    let biased = on
        .step
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::MatMul(ref m) if m.addend) && on.step.ty(n.inputs[2]).rank() == 1);
    assert!(biased.count() > 0, "no bias went into a product");
    assert!(count(&on.step, |op| matches!(op, Op::LayerNormBackward(n) if n.addend)) > 0);
}

#[test]
fn folded_steps_compute_what_unfolded_steps_do() {
    // f64: only the rounding of the sums the adds stored differs.
    for (name, kind) in [
        ("tiny-llama", StepKind::Grads),
        ("tiny-llama", StepKind::Train),
        ("tiny-neox", StepKind::Grads),
        ("tiny-neox", StepKind::Train),
    ] {
        let off = compile(name, DType::F64, kind, Epilogues::Off, 1);
        let on = compile(name, DType::F64, kind, Epilogues::On, 1);
        assert!(on.fusion().total() > 0);
        let rel = worst_rel(&run(&on, 1), &run(&off, 1));
        assert!(rel < 1e-12, "{name} {kind:?}: folded and unfolded differ by {rel:e}");
    }
    // f32 and bf16: one rounding fewer per folded add, so close, not equal.
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        let off = compile("tiny-llama", dtype, StepKind::Grads, Epilogues::Off, 1);
        let on = compile("tiny-llama", dtype, StepKind::Grads, Epilogues::On, 1);
        let rel = worst_rel(&run(&on, 1), &run(&off, 1));
        assert!(rel < tol, "{dtype}: folded and unfolded differ by {rel:e}");
    }
}

#[test]
fn gradient_accumulation_sums_fold_into_the_weight_products() {
    let off = compile("tiny-llama", DType::F64, StepKind::Grads, Epilogues::Off, 2);
    let on = compile("tiny-llama", DType::F64, StepKind::Grads, Epilogues::On, 2);
    // Both micro-batches' weight gradients: the second product adds the first's.
    let weight_grads_summed =
        on.step.nodes.iter().filter(|n| matches!(n.op, Op::MatMul(ref m) if m.addend && m.trans_a));
    assert!(weight_grads_summed.count() > 0);
    let rel = worst_rel(&run(&on, 2), &run(&off, 2));
    assert!(rel < 1e-12, "accumulated: folded and unfolded differ by {rel:e}");
}

#[test]
fn a_folded_step_prints_and_parses_back() {
    let on = compile("tiny-neox", DType::F32, StepKind::Train, Epilogues::On, 1);
    let text = on.step.to_string();
    assert!(text.contains("addend=true"));
    assert_eq!(parse(&text).unwrap(), on.step);
}

#[test]
fn the_pass_leaves_adds_it_cannot_fold() {
    let off = compile("tiny-llama", DType::F32, StepKind::Grads, Epilogues::Off, 1);
    // Folding twice changes nothing more.
    let (once, report) = fold(&off.step).unwrap();
    let (twice, again) = fold(&once).unwrap();
    assert!(report.total() > 0);
    assert_eq!(again.total(), 0);
    assert_eq!(twice.to_string(), once.to_string());
}

#[test]
fn clipping_factors_fold_into_adamw_with_the_same_bits() {
    // In f32 both folds are exact (a product rounded to f32 and then added
    // is what the epilogue computes), so the whole step keeps its bits.
    for dtype in [DType::F32, DType::BF16] {
        let spec = ModelSpec::named("tiny-llama", 2, 8, dtype, LossKind::CrossEntropy).unwrap();
        let train = TrainOptions { clip_grad_norm: Some(0.05), ..TrainOptions::default() };
        let opts = |epilogues| StepOptions { train: train.clone(), epilogues, ..StepOptions::new(StepKind::Train) };
        let off = compile_step(&spec, &opts(Epilogues::Off)).unwrap();
        let on = compile_step(&spec, &opts(Epilogues::On)).unwrap();
        let updates = count(&on.step, |op| matches!(op, Op::AdamW(_)));
        // The scale follows the six operands and the master state, if any.
        let scaled = on
            .step
            .nodes
            .iter()
            .filter(
                |n| matches!(&n.op, Op::AdamW(h) if n.inputs.len() == 7 + (h.master != MasterWeights::None) as usize),
            )
            .count();
        assert_eq!(scaled, updates, "{dtype}: every update reads its gradient scaled");
        assert_eq!(on.fusion().scales.get("adamw"), Some(&updates));
        let muls = |t: &Trace| count(t, |op| matches!(op, Op::Binary(b) if b.f == BinaryFn::Mul));
        assert_eq!(muls(&on.step) + updates, muls(&off.step));
        assert!(on.fusion().to_string().contains(&format!("{updates} into adamw")), "{}", on.fusion());
        // (In bf16 an AdamW step from noise-level gradients of either sign
        // moves weights by ±lr, so only f32's whole step is compared.)
        if dtype == DType::F32 {
            let (a, b) = (run(&on, 1), run(&off, 1));
            let first = a.iter().zip(&b).position(|(x, y)| x != y);
            assert_eq!(first, None, "f32: output or state {first:?} differs");
        }
    }
    // In 16 bits the epilogue adds round once fewer, so the scale is checked
    // on its own: the folded update equals `mul` then the update, bit for bit.
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
        // The scale follows the six operands and the master state, if any.
        let scale_at = |s: &Sample| match &s.op {
            Op::AdamW(h) => 6 + (h.master != MasterWeights::None) as usize,
            _ => unreachable!("adamw samples"),
        };
        for sample in AdamW::samples(dtype).into_iter().filter(|s| s.inputs.len() == scale_at(s) + 1) {
            let at = scale_at(&sample);
            let inputs = draw_sample(&sample, 5).unwrap();
            let folded = run_op(&sample.op, &inputs).unwrap();
            let scaled =
                run_op(&Op::from(Binary { f: BinaryFn::Mul }), &[inputs[1].clone(), inputs[at].clone()]).unwrap();
            let mut plain = inputs[..at].to_vec();
            plain[1] = scaled[0].clone();
            let unfolded = run_op(&sample.op, &plain).unwrap();
            for (x, y) in folded.iter().zip(&unfolded) {
                assert_eq!(x.bytes(), y.bytes(), "{dtype}: {:?}", sample.op);
            }
        }
    }
}
