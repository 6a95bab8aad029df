//! Whole-step tests on the CPU backend: the tiny models' gradients against
//! finite differences, planned against unplanned and replay against eager
//! bit for bit, training lowering the loss, and bad step inputs refused.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, TensorType, Trace, ValueKind};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{build_forward, init_params, Config, LossKind, ModelSpec, Overrides, QkNorm};
use stepgraph_core::plan::{check_plan, plan, PlanOptions};
use stepgraph_core::testing::directional_derivative;

fn spec(name: &str, dtype: DType, loss: LossKind) -> ModelSpec {
    let config = Config::named(name).unwrap();
    ModelSpec { config, batch: 2, seq: 8, dtype, loss, adapters: None, documents: false }
}

/// Random token ids (and targets with one ignored position) for `spec`.
fn batch(spec: &ModelSpec, seed: u64) -> Vec<(&'static str, HostTensor)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = spec.batch * spec.seq;
    let ty = TensorType::new(DType::I32, [spec.batch, spec.seq]);
    let ids: Vec<f64> = (0..n).map(|_| rng.gen_range(0..spec.config.vocab_size) as f64).collect();
    let mut out = vec![(TOKENS_INPUT, HostTensor::from_f64(ty.clone(), &ids))];
    if spec.loss == LossKind::CrossEntropy {
        let mut t: Vec<f64> = (0..n).map(|_| rng.gen_range(0..spec.config.vocab_size) as f64).collect();
        t[n - 1] = -100.0;
        out.push((TARGETS_INPUT, HostTensor::from_f64(ty, &t)));
    }
    out
}

/// A session for `step` with parameters initialised from `seed` (and zero optimizer state).
fn session(step: &Trace, forward: &Trace, reuse: bool, seed: u64) -> CpuSession {
    let p = plan(step, PlanOptions { reuse, ..PlanOptions::default() }).unwrap();
    check_plan(step, &p).unwrap();
    let mut s = CpuSession::new(step.clone(), p).unwrap();
    for (v, t) in init_params(forward, seed) {
        let name = forward.value(v).kind.leaf_name().unwrap().to_string();
        s.write_named(&name, &t).unwrap();
    }
    for v in step.leaves().collect::<Vec<_>>() {
        if matches!(step.value(v).kind, ValueKind::State { .. }) {
            s.write(v, &HostTensor::zeros(step.ty(v).clone())).unwrap();
        }
    }
    s
}

fn write_batch(s: &mut CpuSession, b: &[(&str, HostTensor)]) {
    for (name, t) in b {
        s.write_named(name, t).unwrap();
    }
}

#[test]
fn tiny_model_gradients_match_finite_differences() {
    // And Qwen3's layout: per-head q/k norms, heads wider than the width
    // over the heads, a tied head.
    let llama = Config::named("tiny-llama").unwrap();
    let qwen3 = Config {
        name: "tiny-qwen3".into(),
        qk_norm: QkNorm::PerHead,
        head_size: 2 * llama.head_size,
        tie_embeddings: true,
        ..llama.clone()
    };
    // And OLMo 2's: norms over all of q and k, norms after the sublayers.
    let olmo2 = Config { name: "tiny-olmo2".into(), qk_norm: QkNorm::Whole, post_norms: true, ..llama };
    for (name, loss) in [
        ("tiny-llama", LossKind::CrossEntropy),
        ("tiny-neox", LossKind::CrossEntropy),
        ("tiny-llama", LossKind::Sum),
        ("tiny-qwen3", LossKind::CrossEntropy),
        ("tiny-olmo2", LossKind::CrossEntropy),
    ] {
        let sp = match name {
            "tiny-qwen3" => ModelSpec { config: qwen3.clone(), ..spec("tiny-llama", DType::F64, loss) },
            "tiny-olmo2" => ModelSpec { config: olmo2.clone(), ..spec("tiny-llama", DType::F64, loss) },
            _ => spec(name, DType::F64, loss),
        };
        let fwd = build_forward(&sp).unwrap();
        assert_eq!(fwd.leaf_by_name("model.layers.0.self_attn.k_norm.weight").is_some(), !sp.config.qk_norm.is_none());
        assert_eq!(
            fwd.leaf_by_name("model.layers.1.post_feedforward_layernorm.weight").is_some(),
            sp.config.post_norms
        );
        assert_eq!(fwd.leaf_by_name("model.layers.1.input_layernorm.weight").is_none(), sp.config.post_norms);
        let grads = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
        let data = batch(&sp, 1);
        let mut gs = session(&grads, &fwd, true, 3);
        write_batch(&mut gs, &data);
        gs.run_eager().unwrap();

        // A random direction u over every parameter; compare ⟨∇L, u⟩ with central differences.
        let mut rng = StdRng::seed_from_u64(11);
        let params: Vec<_> = fwd.params().collect();
        let init: HashMap<_, _> = init_params(&fwd, 3).into_iter().collect();
        let u: Vec<Vec<f64>> =
            params.iter().map(|p| (0..fwd.ty(*p).numel()).map(|_| StandardNormal.sample(&mut rng)).collect()).collect();
        let mut analytic = 0.0;
        for (k, p) in params.iter().enumerate() {
            let name = fwd.value(*p).kind.leaf_name().unwrap();
            let gp = grads.leaf_by_name(name).unwrap();
            let g = gs.read(grads.grad_of(gp).unwrap()).to_f64();
            analytic += g.iter().zip(&u[k]).map(|(a, b)| a * b).sum::<f64>();
        }
        let mut leaves: HashMap<_, _> = init.clone();
        for (n, t) in &data {
            leaves.insert(fwd.leaf_by_name(n).unwrap(), t.clone());
        }
        let direction: Vec<_> = params.iter().copied().zip(u.iter().cloned()).collect();
        let fd = directional_derivative(&fwd, &leaves, &direction, 1e-6).unwrap();
        let rel = (fd - analytic).abs() / fd.abs().max(analytic.abs());
        assert!(rel < 1e-6, "{name} {loss:?}: finite differences {fd} vs gradient {analytic} (rel {rel:e})");
    }
}

/// Loss and every output or updated leaf after `steps` training steps.
fn run(step: &Trace, fwd: &Trace, sp: &ModelSpec, reuse: bool, replay: bool, steps: usize) -> Vec<Vec<u8>> {
    let mut s = session(step, fwd, reuse, 5);
    let mut out = Vec::new();
    for it in 1..=steps {
        write_batch(&mut s, &batch(sp, it as u64));
        if step.leaf_by_name(LR_INPUT).is_some() {
            s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
            s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
        }
        if replay {
            s.replay().unwrap();
        } else {
            s.run_eager().unwrap();
        }
        for o in &step.outputs {
            out.push(s.read(o.value).bytes().to_vec());
        }
    }
    for u in &step.updates {
        out.push(s.read(u.state).bytes().to_vec());
    }
    out
}

#[test]
fn planned_equals_unplanned_and_replay_equals_eager_bit_for_bit() {
    for (name, dtype, kind) in [
        ("tiny-llama", DType::F32, StepKind::Grads),
        ("tiny-llama", DType::BF16, StepKind::Train),
        ("tiny-neox", DType::F32, StepKind::Train),
    ] {
        let sp = spec(name, dtype, LossKind::CrossEntropy);
        let fwd = build_forward(&sp).unwrap();
        let step = build_step(&fwd, kind, &TrainOptions::default()).unwrap();
        let steps = if kind == StepKind::Train { 3 } else { 1 };
        let unplanned_eager = run(&step, &fwd, &sp, false, false, steps);
        let planned_eager = run(&step, &fwd, &sp, true, false, steps);
        let planned_replay = run(&step, &fwd, &sp, true, true, steps);
        assert!(!unplanned_eager.is_empty());
        assert_eq!(unplanned_eager, planned_eager, "{name} {dtype}: planned differs from unplanned");
        assert_eq!(planned_eager, planned_replay, "{name} {dtype}: replay differs from eager");
    }
}

#[test]
fn planning_reuses_memory() {
    let sp = spec("tiny-llama", DType::F32, LossKind::CrossEntropy);
    let fwd = build_forward(&sp).unwrap();
    let step = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
    let planned = plan(&step, PlanOptions::default()).unwrap();
    let unplanned = plan(&step, PlanOptions { reuse: false, ..PlanOptions::default() }).unwrap();
    assert!(
        planned.arena_bytes * 10 < unplanned.arena_bytes * 6,
        "{} vs {}",
        planned.arena_bytes,
        unplanned.arena_bytes
    );
    assert_eq!(planned.persistent_bytes, fwd.leaf_bytes(|k| matches!(k, ValueKind::Param { .. })));
    // Every gradient is an arena output alive to the end of the step.
    for o in step.outputs.iter().filter(|o| matches!(o.kind, OutputKind::Grad(_))) {
        assert_eq!(planned.slot(o.value).region, stepgraph_core::plan::Region::Arena);
    }
}

#[test]
fn out_of_range_tokens_are_refused_before_the_step() {
    let sp = spec("tiny-llama", DType::F32, LossKind::CrossEntropy);
    let fwd = build_forward(&sp).unwrap();
    let step = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
    let mut s = session(&step, &fwd, true, 0);
    let ty = TensorType::new(DType::I32, [2, 8]);
    let mut ids = vec![1.0; 16];
    ids[5] = 300.0;
    let err = s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), &ids)).unwrap_err().to_string();
    assert!(err.contains("token id 300 at position 5 is out of range [0, 256)"), "{err}");
    let mut t = vec![1.0; 16];
    t[3] = -7.0;
    let err = s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty.clone(), &t)).unwrap_err().to_string();
    assert!(err.contains("target -7 at position 3"), "{err}");
    // The ignore index is allowed.
    t[3] = -100.0;
    s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty, &t)).unwrap();
    let err = s
        .write_named(TOKENS_INPUT, &HostTensor::from_f64(TensorType::new(DType::I32, [2, 7]), &[0.0; 14]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected i32[2,8], got i32[2,7]"), "{err}");
}

#[test]
fn training_lowers_the_loss() {
    let mut sp = spec("tiny-llama", DType::F32, LossKind::CrossEntropy);
    sp.config = sp.config.with_overrides(&Overrides { n_layer: Some(1), ..Overrides::default() }).unwrap();
    let fwd = build_forward(&sp).unwrap();
    let step = build_step(&fwd, StepKind::Train, &TrainOptions::default()).unwrap();
    let mut s = session(&step, &fwd, true, 0);
    // One fixed batch: the model must be able to memorise it.
    let data = batch(&sp, 42);
    let mut losses = Vec::new();
    for it in 1..=60 {
        write_batch(&mut s, &data);
        s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
        s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
        s.replay().unwrap();
        losses.push(s.loss().unwrap());
    }
    assert!((losses[0] - (256f64).ln()).abs() < 0.1, "initial loss {} should be near ln(256)", losses[0]);
    assert!(losses[59] < 0.5 * losses[0], "loss went from {} to {}", losses[0], losses[59]);
}

/// A step run a second time without rewriting its inputs computes the same
/// outputs: what a CUDA graph replay right after the eager step that
/// preceded its capture does. Inputs keep their slots for the whole step,
/// so no value planned after an input's last read may overwrite it — with
/// recomputation and a tight budget the planner reuses memory hardest.
#[test]
fn a_step_run_again_without_new_inputs_computes_the_same() {
    use stepgraph_core::passes::recompute::RecomputePolicy;
    use stepgraph_core::pipeline::{compile_step, StepOptions};
    for (name, policy) in [
        ("tiny-llama", RecomputePolicy::Off),
        ("tiny-llama", RecomputePolicy::Auto),
        ("tiny-llama", RecomputePolicy::Budget(1)),
        ("tiny-neox", RecomputePolicy::Budget(1)),
    ] {
        let sp = spec(name, DType::F32, LossKind::CrossEntropy);
        let mut opts = StepOptions::new(StepKind::Grads);
        opts.recompute = policy;
        // A budget of one byte cannot be met: take the smallest plan that can.
        let c = match compile_step(&sp, &opts) {
            Ok(c) => c,
            Err(stepgraph_core::Error::MemoryBudget { least, .. }) => {
                opts.recompute = RecomputePolicy::Budget(least);
                compile_step(&sp, &opts).unwrap()
            }
            Err(e) => panic!("{name}: {e}"),
        };
        let mut s = session(&c.step, &c.forward, true, 3);
        write_batch(&mut s, &batch(&sp, 1));
        let outputs = |s: &mut CpuSession| -> Vec<Vec<u8>> {
            c.step.outputs.iter().map(|o| s.read(o.value).bytes().to_vec()).collect()
        };
        s.run_eager().unwrap();
        let first = outputs(&mut s);
        s.run_eager().unwrap();
        assert_eq!(first, outputs(&mut s), "{name} {policy:?}: the second run differs (eager)");
        s.replay().unwrap();
        assert_eq!(first, outputs(&mut s), "{name} {policy:?}: the replay differs");
    }
}
