//! Low-rank adapters on the CPU backend: the adapters' gradients against
//! finite differences, a zero `B` giving the base model's logits bit for
//! bit, merged and unmerged models agreeing, and a train step that updates
//! the adapters alone, with no gradient or optimizer state for the base.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, Trace, ValueId, ValueKind};
use stepgraph_core::models::gpt::{build_forward_with_logits, LOGITS_OUTPUT};
use stepgraph_core::models::lora::merged_weight;
use stepgraph_core::models::{build_forward, init_params, Adapters, LoraTarget, LossKind, ModelSpec};
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::plan::plan_report;
use stepgraph_core::session::Session;
use stepgraph_core::testing::{directional_derivative, interpret};
use stepgraph_core::testing::{random_batch, run_with_weights};

fn spec(dtype: DType, adapters: Option<Adapters>) -> ModelSpec {
    let mut s = ModelSpec::named("tiny-llama", 2, 8, dtype, LossKind::CrossEntropy).unwrap();
    s.adapters = adapters;
    s
}

fn adapters(rank: usize, targets: Vec<LoraTarget>) -> Adapters {
    Adapters::new(rank, 2.0 * rank as f64 + 1.0, targets).unwrap()
}

fn name(t: &Trace, v: ValueId) -> String {
    t.value(v).kind.leaf_name().unwrap().to_string()
}

/// Every weight of `fwd` by name: the seeded draw, with each adapter's `B`
/// random too (it starts at zero, where `A`'s gradient is zero) when `random_b`.
fn weights(fwd: &Trace, seed: u64, random_b: bool) -> HashMap<String, HostTensor> {
    let mut rng = StdRng::seed_from_u64(seed + 100);
    init_params(fwd, seed)
        .into_iter()
        .map(|(v, t)| {
            let n = name(fwd, v);
            let t = if random_b && n.ends_with("lora_B.weight") {
                let x: Vec<f64> = (0..t.ty.numel())
                    .map(|_| {
                        let z: f64 = StandardNormal.sample(&mut rng);
                        0.1 * z
                    })
                    .collect();
                HostTensor::from_f64(t.ty.clone(), &x)
            } else {
                t
            };
            (n, t)
        })
        .collect()
}

/// The logits of `fwd` (built with its logits output) on `weights` and `data`.
fn logits(fwd: &Trace, weights: &HashMap<String, HostTensor>, data: &[(&str, HostTensor)]) -> Vec<f64> {
    let mut leaves = HashMap::new();
    for v in fwd.weights() {
        leaves.insert(v, weights[&name(fwd, v)].clone());
    }
    for (n, t) in data {
        leaves.insert(fwd.leaf_by_name(n).unwrap(), t.clone());
    }
    let vals = interpret(fwd, &leaves).unwrap();
    let out = fwd.outputs.iter().find(|o| o.kind == OutputKind::Named(LOGITS_OUTPUT.into())).unwrap();
    vals[out.value.index()].to_f64()
}

#[test]
fn base_weights_are_frozen_and_only_adapters_are_parameters() {
    let sp = spec(DType::F32, Some(adapters(4, vec![LoraTarget::Q, LoraTarget::V, LoraTarget::Down])));
    let fwd = build_forward(&sp).unwrap();
    let params: Vec<String> = fwd.params().map(|p| name(&fwd, p)).collect();
    let layers = sp.config.n_layer;
    assert_eq!(params.len(), 3 * 2 * layers, "{params:?}");
    assert!(params.iter().all(|p| p.ends_with(".lora_A.weight") || p.ends_with(".lora_B.weight")), "{params:?}");
    let a = fwd.leaf_by_name("model.layers.0.self_attn.q_proj.lora_A.weight").unwrap();
    let b = fwd.leaf_by_name("model.layers.0.self_attn.q_proj.lora_B.weight").unwrap();
    assert_eq!(fwd.ty(a).shape, [4, sp.config.n_embd]);
    assert_eq!(fwd.ty(b).shape, [sp.config.n_head * sp.config.head_size, 4]);
    // Every base weight is there, frozen: the full model's parameters.
    let full = build_forward(&spec(DType::F32, None)).unwrap();
    let frozen: Vec<String> = fwd.frozen().map(|v| name(&fwd, v)).collect();
    let all: Vec<String> = full.params().map(|v| name(&full, v)).collect();
    assert_eq!(frozen, all);
}

#[test]
fn adapter_gradients_match_finite_differences() {
    for targets in [LoraTarget::ALL.to_vec(), vec![LoraTarget::K, LoraTarget::Gate]] {
        let sp = spec(DType::F64, Some(adapters(3, targets.clone())));
        let fwd = build_forward(&sp).unwrap();
        let grads = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
        // Gradients of the adapters only.
        let grad_of: Vec<String> = grads
            .outputs
            .iter()
            .filter_map(|o| match o.kind {
                OutputKind::Grad(p) => Some(name(&grads, p)),
                _ => None,
            })
            .collect();
        assert_eq!(grad_of.len(), fwd.params().count());
        assert!(grad_of.iter().all(|n| n.contains(".lora_")), "{grad_of:?}");

        let w = weights(&fwd, 3, true);
        let data = random_batch(&sp, 1);
        let mut s = run_with_weights(&grads, &w, &data);

        let mut rng = StdRng::seed_from_u64(11);
        let params: Vec<ValueId> = fwd.params().collect();
        let u: Vec<Vec<f64>> =
            params.iter().map(|p| (0..fwd.ty(*p).numel()).map(|_| StandardNormal.sample(&mut rng)).collect()).collect();
        let mut analytic = 0.0;
        for (k, &p) in params.iter().enumerate() {
            let gp = grads.leaf_by_name(&name(&fwd, p)).unwrap();
            let g = s.read(grads.grad_of(gp).unwrap()).to_f64();
            analytic += g.iter().zip(&u[k]).map(|(a, b)| a * b).sum::<f64>();
        }
        let mut leaves = HashMap::new();
        for v in fwd.weights() {
            leaves.insert(v, w[&name(&fwd, v)].clone());
        }
        for (n, t) in &data {
            leaves.insert(fwd.leaf_by_name(n).unwrap(), t.clone());
        }
        let direction: Vec<_> = params.iter().copied().zip(u.iter().cloned()).collect();
        let fd = directional_derivative(&fwd, &leaves, &direction, 1e-6).unwrap();
        let rel = (fd - analytic).abs() / fd.abs().max(analytic.abs());
        assert!(analytic.abs() > 1e-6, "{targets:?}: the adapters' gradient is zero");
        assert!(rel < 1e-6, "{targets:?}: finite differences {fd} vs gradient {analytic} (rel {rel:e})");
    }
}

#[test]
fn a_zero_b_gives_the_base_models_logits_bit_for_bit() {
    for dtype in [DType::F32, DType::BF16] {
        let with = spec(dtype, Some(adapters(4, LoraTarget::ALL.to_vec())));
        let fwd = build_forward_with_logits(&with).unwrap();
        let base = build_forward_with_logits(&spec(dtype, None)).unwrap();
        let w = weights(&fwd, 7, false);
        let data = random_batch(&with, 2);
        let (a, b) = (logits(&fwd, &w, &data), logits(&base, &w, &data));
        assert_eq!(a.len(), b.len());
        assert!(a.iter().zip(&b).all(|(x, y)| x == y), "{dtype}: adapters at B = 0 changed the logits");
    }
}

#[test]
fn merged_and_unmerged_models_agree() {
    let a = adapters(4, vec![LoraTarget::Q, LoraTarget::O, LoraTarget::Up]);
    let scale = a.scale();
    let with = spec(DType::F64, Some(a));
    let fwd = build_forward_with_logits(&with).unwrap();
    let base = build_forward_with_logits(&spec(DType::F64, None)).unwrap();
    let w = weights(&fwd, 9, true);
    let mut merged = w.clone();
    let mut count = 0;
    for (n, t) in &w {
        if let Some(prefix) = n.strip_suffix(".lora_A.weight") {
            let key = format!("{prefix}.weight");
            let m = merged_weight(&w[&key], t, &w[&format!("{prefix}.lora_B.weight")], scale).unwrap();
            merged.insert(key, m);
            count += 1;
        }
    }
    assert_eq!(count, 3 * with.config.n_layer);
    let data = random_batch(&with, 4);
    let (x, y) = (logits(&fwd, &w, &data), logits(&base, &merged, &data));
    let worst = x.iter().zip(&y).map(|(a, b)| (a - b).abs() / a.abs().max(1e-3)).fold(0.0, f64::max);
    assert!(worst < 1e-10, "merged and unmerged logits differ by {worst:e}");
    // The adapters change the model: the base alone does not give these logits.
    let plain = logits(&base, &w, &data);
    assert!(x.iter().zip(&plain).any(|(a, b)| (a - b).abs() > 1e-6));
}

#[test]
fn a_train_step_updates_the_adapters_alone_and_plans_no_base_gradient() {
    let sp = spec(DType::F32, Some(adapters(2, LoraTarget::ALL.to_vec())));
    let c = compile_step(&sp, &StepOptions::new(StepKind::Train)).unwrap();
    let step = &c.step;
    // Optimizer state for the adapters only; nothing updates a frozen weight.
    let states: Vec<String> = step
        .leaves()
        .filter(|&v| matches!(step.value(v).kind, ValueKind::State { .. }))
        .map(|v| name(step, v))
        .collect();
    assert!(!states.is_empty() && states.iter().all(|n| n.contains(".lora_")), "{states:?}");
    assert!(step.updates.iter().all(|u| !matches!(step.value(u.state).kind, ValueKind::Frozen { .. })));
    // The frozen head's weight gradient is not computed: the fused loss's
    // backward runs without it, and no value of the head's size is planned.
    let head = c.forward.leaf_by_name("lm_head.weight").unwrap();
    let loss_backward: Vec<bool> = step
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            stepgraph_core::ops::Op::LinearCrossEntropyBackward(op) => Some(op.weight_grad),
            _ => None,
        })
        .collect();
    assert_eq!(loss_backward, [false]);
    assert!(!step.value_ids().any(|v| step.ty(v) == c.forward.ty(head) && !step.value(v).kind.is_leaf()));
    let report = plan_report(step, &c.plan, 4);
    let adapters: u64 = c.forward.params().map(|p| c.forward.ty(p).bytes()).sum();
    let base: u64 = c.forward.frozen().map(|p| c.forward.ty(p).bytes()).sum();
    assert_eq!((report.param_bytes, report.frozen_bytes), (adapters, base));
    assert_eq!(report.frozen_storage.as_deref(), Some("f32"));
    assert!(report.to_string().contains("base (f32)") && report.to_string().contains("adapters"));
    // AdamW's two moments per adapter weight, nothing for the base.
    assert_eq!(report.optimizer_state_bytes, 2 * adapters);
    assert_eq!(report.persistent_bytes, base + 3 * adapters);

    // One batch, eight times.
    let (mut s, losses) = trained(&c, &sp, 8, |_| 1);
    let w = weights(&c.forward, 5, false);
    assert!(losses[7] < losses[0] - 1e-3, "the adapters did not learn one batch: {losses:?}");
    for v in step.frozen().collect::<Vec<_>>() {
        assert_eq!(s.read(v), w[&name(step, v)], "{} changed", name(step, v));
    }
    let b = step.leaf_by_name("model.layers.0.mlp.down_proj.lora_B.weight").unwrap();
    assert!(s.read(b).to_f64().iter().any(|&x| x != 0.0), "B did not move from zero");
}

#[test]
fn an_nf4_base_computes_with_its_dequantized_weights_bit_for_bit() {
    use stepgraph_core::models::lora::quantized_weights;
    use stepgraph_core::models::BaseStorage;
    use stepgraph_core::ops::nf4::{dequantize_nf4, quantize_nf4};
    for double_quant in [false, true] {
        let a =
            Adapters { base: BaseStorage::Nf4 { double_quant }, ..adapters(2, vec![LoraTarget::Q, LoraTarget::Up]) };
        let q_spec = spec(DType::F32, Some(a.clone()));
        let q = build_forward_with_logits(&q_spec).unwrap();
        let plain =
            build_forward_with_logits(&spec(DType::F32, Some(Adapters { base: BaseStorage::Model, ..a }))).unwrap();
        let quantized = quantized_weights(&q);
        // Every linear layer of the blocks is stored in 4 bits, adapted or not.
        assert_eq!(
            quantized.len(),
            7 * q.frozen().filter(|&v| name(&q, v).ends_with("input_layernorm.weight")).count()
        );
        let mut w = weights(&plain, 3, true);
        let mut leaves = w.clone();
        for qw in &quantized {
            let x: Vec<f32> = w[&qw.name].to_f64().iter().map(|&v| v as f32).collect();
            let nf4 = quantize_nf4(&x, double_quant).unwrap();
            for ((leaf, _), (_, t)) in qw.leaves.iter().zip(nf4.leaves()) {
                leaves.insert(leaf.clone(), t);
            }
            let back: Vec<f64> = dequantize_nf4(&nf4, x.len()).into_iter().map(f64::from).collect();
            w.insert(qw.name.clone(), HostTensor::from_f64(qw.ty.clone(), &back));
        }
        let data = random_batch(&spec(DType::F32, None), 6);
        assert_eq!(logits(&q, &leaves, &data), logits(&plain, &w, &data), "double quant {double_quant}");

        // The plan holds the base at about half a byte a weight.
        let c = compile_step(&q_spec, &StepOptions::new(StepKind::Train)).unwrap();
        let report = plan_report(&c.step, &c.plan, 2);
        assert_eq!(report.frozen_storage.as_deref(), Some("nf4"));
        let matrices: u64 = quantized.iter().map(|q| q.ty.numel() as u64).sum();
        let others: u64 = plain
            .frozen()
            .filter(|&v| !quantized.iter().any(|q| q.name == name(&plain, v)))
            .map(|v| plain.ty(v).bytes())
            .sum();
        let scales = if double_quant { matrices / 64 + 4 * quantized.len() as u64 * 2 } else { 4 * matrices / 64 };
        assert!(report.frozen_bytes <= others + matrices / 2 + scales, "{} bytes", report.frozen_bytes);
        assert!(report.frozen_bytes >= others + matrices / 2);
    }
}

#[test]
fn adapter_dropout_is_drawn_in_training_steps_only_and_per_micro_batch() {
    use stepgraph_core::ops::Op;
    let a = Adapters { dropout: 0.25, ..adapters(2, vec![LoraTarget::Q, LoraTarget::Down]) };
    let sp = spec(DType::F32, Some(a));
    let dropouts = |t: &Trace| t.nodes.iter().filter(|n| matches!(n.op, Op::Dropout(_))).count();
    let forward = compile_step(&sp, &StepOptions::new(StepKind::Forward)).unwrap();
    assert_eq!(dropouts(&forward.step), 0, "evaluation draws no masks");
    let mut opts = StepOptions::new(StepKind::Train);
    opts.grad_accum = 2;
    let c = compile_step(&sp, &opts).unwrap();
    // Two adapted linears a layer and two micro-batches: a mask each in
    // forward, and the same mask again in each one's backward.
    let micro: std::collections::HashSet<u32> = c
        .step
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Dropout(d) => Some(d.micro_batch),
            _ => None,
        })
        .collect();
    assert_eq!(micro.len(), 2, "each micro-batch draws its own masks");
    assert!(dropouts(&c.step) >= 2 * 2 * sp.config.n_layer, "{} dropouts", dropouts(&c.step));
    let mut s = CpuSession::new(c.step.clone(), c.plan.clone()).unwrap();
    let w = weights(&c.forward, 5, true);
    for v in c.step.weights() {
        s.write(v, &w[&name(&c.step, v)]).unwrap();
    }
    s.zero_state().unwrap();
    let mut big = spec(DType::F32, None);
    big.batch *= 2;
    let mut losses = Vec::new();
    for it in 1..=3 {
        for (n, t) in random_batch(&big, 1) {
            s.write_named(n, &t).unwrap();
        }
        s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
        s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
        s.run_eager().unwrap();
        losses.push(s.loss().unwrap());
    }
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

/// A CPU session of `c` with the seeded weights, after `steps` train
/// steps on the batches `batch_seed(step)` draws, and its losses.
fn trained(
    c: &stepgraph_core::pipeline::CompiledStep,
    sp: &ModelSpec,
    steps: usize,
    batch_seed: impl Fn(usize) -> u64,
) -> (CpuSession, Vec<f64>) {
    let step = &c.step;
    let w = weights(&c.forward, 5, false);
    let mut s = CpuSession::new(step.clone(), c.plan.clone()).unwrap();
    for v in step.weights() {
        s.write(v, &w[&name(step, v)]).unwrap();
    }
    s.zero_state().unwrap();
    let mut losses = Vec::new();
    for it in 1..=steps {
        for (n, t) in random_batch(sp, batch_seed(it)) {
            s.write_named(n, &t).unwrap();
        }
        s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
        s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
        s.run_eager().unwrap();
        losses.push(s.loss().unwrap());
    }
    (s, losses)
}

/// Loss bits and adapter weights of `steps` train steps of `c` on the CPU.
fn train_on_cpu(
    c: &stepgraph_core::pipeline::CompiledStep,
    sp: &ModelSpec,
    steps: usize,
) -> (Vec<u64>, Vec<HostTensor>) {
    let (mut s, losses) = trained(c, sp, steps, |it| it as u64);
    let adapters = c.step.params().collect::<Vec<_>>().into_iter().map(|v| s.read(v)).collect();
    (losses.iter().map(|l| l.to_bits()).collect(), adapters)
}

#[test]
fn under_a_budget_the_frozen_embedding_moves_to_host_memory_and_computes_the_same_bits() {
    use stepgraph_core::passes::recompute::RecomputePolicy;
    use stepgraph_core::plan::{check_plan, Region};
    let sp = spec(DType::F32, Some(adapters(2, LoraTarget::ALL.to_vec())));
    let plain = compile_step(&sp, &StepOptions::new(StepKind::Train)).unwrap();
    assert_eq!(plain.plan.host_bytes, 0, "no budget, no host tables");
    let budgeted =
        |budget: u64| StepOptions { recompute: RecomputePolicy::Budget(budget), ..StepOptions::new(StepKind::Train) };
    // A budget the default plan misses by a byte: moving the table meets
    // it, so nothing is recomputed.
    let budget = plain.planned_peak_bytes() - 1;
    let hosted = compile_step(&sp, &budgeted(budget)).unwrap();
    let table = hosted.step.leaf_by_name("model.embed_tokens.weight").unwrap();
    assert_eq!(hosted.plan.slot(table).region, Region::Host);
    assert_eq!(hosted.plan.host_bytes, hosted.step.ty(table).bytes());
    assert!(hosted.planned_peak_bytes() <= budget);
    assert!(hosted.recompute().recomputed.is_empty(), "{}", hosted.recompute());
    let report = plan_report(&hosted.step, &hosted.plan, 4);
    assert_eq!(report.host_bytes, hosted.plan.host_bytes);
    assert!(report.to_string().contains("host tables"), "{report}");
    // The head is on the device: a product reads it.
    let head = hosted.step.leaf_by_name("lm_head.weight").unwrap();
    assert_eq!(hosted.plan.slot(head).region, Region::Persistent);
    // The same step, bit for bit.
    assert_eq!(train_on_cpu(&plain, &sp, 3), train_on_cpu(&hosted, &sp, 3));

    // A budget met without recomputing anything keeps the table on the
    // device; so does a model whose head is its embedding.
    let kept_all = StepOptions { recompute: RecomputePolicy::Off, ..StepOptions::new(StepKind::Train) };
    let kept_all = compile_step(&sp, &kept_all).unwrap().planned_peak_bytes();
    let met = compile_step(&sp, &budgeted(kept_all)).unwrap();
    assert_eq!(met.plan.host_bytes, 0);
    let mut tied = sp.clone();
    tied.config.tie_embeddings = true;
    let tied_plain = compile_step(&tied, &StepOptions::new(StepKind::Train)).unwrap();
    let tied = compile_step(&tied, &budgeted(tied_plain.planned_peak_bytes() - 1)).unwrap();
    assert_eq!(tied.plan.host_bytes, 0);
    // Full fine-tuning has nothing frozen to move.
    let full = spec(DType::F32, None);
    let full_plain = compile_step(&full, &StepOptions::new(StepKind::Train)).unwrap();
    let full = compile_step(&full, &budgeted(full_plain.planned_peak_bytes() - 1)).unwrap();
    assert_eq!(full.plan.host_bytes, 0);

    // The checker refuses a trained weight placed on the host.
    let mut bad = hosted.plan.clone();
    let adapter = hosted.step.params().next().unwrap();
    bad.slots[adapter.index()].region = Region::Host;
    let err = check_plan(&hosted.step, &bad).unwrap_err().to_string();
    assert!(err.contains("wrong region") || err.contains("does not fit"), "{err}");
}
