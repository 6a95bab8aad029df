//! Mixture-of-experts models ([`MoeConfig`]): a tiny model with a sparse
//! and a dense layer, its gradients against finite differences of its loss,
//! its experts equal to a dense MLP giving that MLP's model exactly, and the
//! planned and compiled step carrying the routing, the sort and the grouped
//! products.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions};
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, OutputKind, TensorType, Trace, ValueId};
use stepgraph_core::models::gpt::{build_forward_with_logits, LOGITS_OUTPUT};
use stepgraph_core::models::{build_forward, init_params, Config, LossKind, ModelSpec, MoeConfig};
use stepgraph_core::ops::Op;
use stepgraph_core::pipeline::{compile_step, StepOptions};
use stepgraph_core::session::Session;
use stepgraph_core::testing::{directional_derivative, interpret};
use stepgraph_core::testing::{random_batch, run_with_weights};

/// A tiny Llama-layout model whose layer 0 has 4 experts (2 per token) and
/// layer 1 the dense MLP; without renormalisation, a shared expert too (as
/// Qwen2-MoE's).
fn config(normalize_top_k: bool) -> Config {
    let mut c = Config::named("tiny-llama").unwrap();
    c.name = "tiny-moe".into();
    c.moe = Some(MoeConfig {
        experts: 4,
        experts_per_token: 2,
        expert_intermediate_size: 12,
        normalize_top_k,
        sparse_step: 1,
        dense_layers: vec![1],
        aux_loss_coef: None,
        shared_expert: (!normalize_top_k).then_some(10),
        // The router z-loss in the gradient check too.
        z_loss_coef: (!normalize_top_k).then_some(0.05),
    });
    c
}

fn spec(config: Config, dtype: DType) -> ModelSpec {
    ModelSpec { config, batch: 2, seq: 8, dtype, loss: LossKind::CrossEntropy, adapters: None, documents: false }
}

fn name(t: &Trace, v: ValueId) -> String {
    t.value(v).kind.leaf_name().unwrap().to_string()
}

/// Every weight of `fwd` by name, drawn with a spread that makes the
/// router's scores differ (the default draw is small).
fn weights(fwd: &Trace, seed: u64) -> HashMap<String, HostTensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    init_params(fwd, seed)
        .into_iter()
        .map(|(v, t)| {
            let n = name(fwd, v);
            let t = if n.contains("norm") {
                t
            } else {
                let x: Vec<f64> = (0..t.ty.numel())
                    .map(|_| {
                        let z: f64 = StandardNormal.sample(&mut rng);
                        0.3 * z
                    })
                    .collect();
                HostTensor::from_f64(t.ty.clone(), &x)
            };
            (n, t)
        })
        .collect()
}

fn ty2(t: &Trace, name: &str) -> Vec<usize> {
    t.ty(t.leaf_by_name(name).unwrap_or_else(|| panic!("no `{name}`"))).shape.clone()
}

fn leaves(fwd: &Trace, w: &HashMap<String, HostTensor>, data: &[(&str, HostTensor)]) -> HashMap<ValueId, HostTensor> {
    let mut leaves = HashMap::new();
    for v in fwd.weights() {
        leaves.insert(v, w[&name(fwd, v)].clone());
    }
    for (n, t) in data {
        leaves.insert(fwd.leaf_by_name(n).unwrap(), t.clone());
    }
    leaves
}

fn logits(fwd: &Trace, w: &HashMap<String, HostTensor>, data: &[(&str, HostTensor)]) -> Vec<f64> {
    let vals = interpret(fwd, &leaves(fwd, w, data)).unwrap();
    let out = fwd.outputs.iter().find(|o| o.kind == OutputKind::Named(LOGITS_OUTPUT.into())).unwrap();
    vals[out.value.index()].to_f64()
}

#[test]
fn the_sparse_layer_has_a_router_and_stacked_experts_and_the_dense_one_its_mlp() {
    let sp = spec(config(true), DType::F32);
    let fwd = build_forward(&sp).unwrap();
    let ty = |n: &str| fwd.ty(fwd.leaf_by_name(n).unwrap_or_else(|| panic!("no `{n}`"))).shape.clone();
    let (c, f) = (sp.config.n_embd, 12);
    assert_eq!(ty("model.layers.0.mlp.gate.weight"), [4, c]);
    assert_eq!(ty("model.layers.0.mlp.experts.gate_proj.weight"), [4, f, c]);
    assert_eq!(ty("model.layers.0.mlp.experts.up_proj.weight"), [4, f, c]);
    assert_eq!(ty("model.layers.0.mlp.experts.down_proj.weight"), [4, c, f]);
    assert_eq!(ty("model.layers.1.mlp.gate_proj.weight"), [sp.config.intermediate_size, c]);
    assert!(fwd.leaf_by_name("model.layers.0.mlp.gate_proj.weight").is_none());
    // The config counts what the trace holds, with a shared expert too.
    let held: u64 = fwd.params().map(|p| fwd.ty(p).numel() as u64).sum();
    assert_eq!(sp.config.param_count(), held);
    let shared = build_forward(&spec(config(false), DType::F32)).unwrap();
    assert_eq!(ty2(&shared, "model.layers.0.mlp.shared_expert_gate.weight"), [1, c]);
    assert_eq!(ty2(&shared, "model.layers.0.mlp.shared_expert.down_proj.weight"), [c, 10]);
    let held: u64 = shared.params().map(|p| shared.ty(p).numel() as u64).sum();
    assert_eq!(config(false).param_count(), held);
}

#[test]
fn gradients_match_finite_differences() {
    // One random direction per parameter group: the router, the experts,
    // the shared expert and its gate, and everything else, each checked on its own.
    assert_gradients_match(&spec(config(true), DType::F64), &["mlp.gate.weight", "mlp.experts."]);
    assert_gradients_match(&spec(config(false), DType::F64), &["mlp.gate.weight", "mlp.experts.", "mlp.shared_expert"]);
}

/// Checks `sp`'s gradients against finite differences of its loss along
/// one random direction per group of parameters: those whose names contain
/// each of `groups`, then all the others.
fn assert_gradients_match(sp: &ModelSpec, groups: &[&str]) {
    let fwd = build_forward(sp).unwrap();
    let grads = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
    let w = weights(&fwd, 5);
    let data = random_batch(sp, 2);
    let mut s = run_with_weights(&grads, &w, &data);

    let params: Vec<ValueId> = fwd.params().collect();
    for part in groups.iter().copied().map(Some).chain([None]) {
        let mut rng = StdRng::seed_from_u64(17);
        let chosen: Vec<ValueId> = params
            .iter()
            .copied()
            .filter(|&p| {
                let n = name(&fwd, p);
                match part {
                    Some(part) => n.contains(part),
                    None => !groups.iter().any(|g| n.contains(g)),
                }
            })
            .collect();
        let what = format!("{}, `{}`", sp.config.name, part.unwrap_or("the rest"));
        assert!(!chosen.is_empty(), "{what}: no parameters");
        let direction: Vec<(ValueId, Vec<f64>)> = chosen
            .iter()
            .map(|&p| (p, (0..fwd.ty(p).numel()).map(|_| StandardNormal.sample(&mut rng)).collect()))
            .collect();
        let mut analytic = 0.0;
        for (p, u) in &direction {
            let gp = grads.leaf_by_name(&name(&fwd, *p)).unwrap();
            let g = s.read(grads.grad_of(gp).unwrap()).to_f64();
            analytic += g.iter().zip(u).map(|(a, b)| a * b).sum::<f64>();
        }
        let fd = directional_derivative(&fwd, &leaves(&fwd, &w, &data), &direction, 1e-6).unwrap();
        let rel = (fd - analytic).abs() / fd.abs().max(analytic.abs());
        assert!(analytic.abs() > 1e-6, "{what}: zero gradient");
        assert!(rel < 1e-6, "{what}: finite differences {fd} vs gradient {analytic} ({rel:e})");
    }
}

/// Experts that are all the same MLP, with the chosen weights renormalised
/// to sum to one, make the layer that MLP, whichever experts the router
/// picks: the MoE model's logits equal the dense model's.
#[test]
fn identical_experts_make_the_dense_mlp() {
    // Experts as wide as the dense MLP.
    let mut moe_config = config(true);
    let width = moe_config.intermediate_size;
    moe_config.moe.as_mut().unwrap().expert_intermediate_size = width;
    let dense_spec = spec(Config { moe: None, ..moe_config.clone() }, DType::F64);
    let moe_spec = spec(moe_config, DType::F64);
    let dense = build_forward_with_logits(&dense_spec).unwrap();
    let moe = build_forward_with_logits(&moe_spec).unwrap();
    let w = weights(&dense, 9);
    let mut mw: HashMap<String, HostTensor> = w.clone();
    let stack = |t: &HostTensor, copies: usize| {
        let v = t.to_f64();
        let mut shape = vec![copies];
        shape.extend(&t.ty.shape);
        HostTensor::from_f64(TensorType::new(DType::F64, shape), &v.repeat(copies))
    };
    for part in ["gate_proj", "up_proj", "down_proj"] {
        let dense_w = &w[&format!("model.layers.0.mlp.{part}.weight")];
        mw.insert(format!("model.layers.0.mlp.experts.{part}.weight"), stack(dense_w, 4));
    }
    let mut rng = StdRng::seed_from_u64(3);
    let router: Vec<f64> = (0..4 * moe_spec.config.n_embd).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let router_ty = TensorType::new(DType::F64, [4, moe_spec.config.n_embd]);
    mw.insert("model.layers.0.mlp.gate.weight".into(), HostTensor::from_f64(router_ty, &router));
    let data = random_batch(&moe_spec, 4);
    let (a, b) = (logits(&dense, &w, &data), logits(&moe, &mw, &data));
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / x.abs().max(1e-3)).fold(0.0, f64::max);
    // Equal up to f64 rounding: the weights sum to one within an ulp or two.
    assert!(worst < 1e-10, "dense and identical-expert logits differ by {worst:e}");
}

/// With a load-balancing loss the training loss is the cross-entropy plus
/// its weight times that loss, which the forward trace and every step
/// (with micro-batches too) report as a named output.
#[test]
fn the_load_balancing_loss_joins_the_loss_and_is_reported() {
    use stepgraph_core::autodiff::{build_accumulated_step, ROUTER_AUX_LOSS_OUTPUT};
    let with = |coef: Option<f64>| {
        let mut c = config(true);
        c.moe.as_mut().unwrap().aux_loss_coef = coef;
        spec(c, DType::F64)
    };
    let (plain, weighted) = (build_forward(&with(None)).unwrap(), build_forward(&with(Some(0.25))).unwrap());
    let w = weights(&plain, 4);
    let data = random_batch(&with(None), 8);
    let value = |t: &Trace, v: ValueId| interpret(t, &leaves(t, &w, &data)).unwrap()[v.index()].to_f64()[0];
    let named = |t: &Trace| {
        t.outputs.iter().find(|o| o.kind == OutputKind::Named(ROUTER_AUX_LOSS_OUTPUT.into())).map(|o| o.value)
    };
    assert!(named(&plain).is_none());
    let aux = value(&weighted, named(&weighted).unwrap());
    let (l0, l1) = (value(&plain, plain.loss().unwrap()), value(&weighted, weighted.loss().unwrap()));
    // Four experts, two per token: a balanced router gives about 2.
    assert!(aux > 1.0 && aux < 4.0, "aux {aux}");
    assert!((l1 - l0 - 0.25 * aux).abs() < 1e-12 * l1, "{l1} = {l0} + 0.25 · {aux}?");
    for micro_batches in [1, 2] {
        let step = build_accumulated_step(&weighted, StepKind::Grads, &TrainOptions::default(), micro_batches).unwrap();
        assert!(named(&step).is_some(), "{micro_batches} micro-batches");
    }

    // The router z-loss: the mean squared log-sum-exp of the scores.
    use stepgraph_core::autodiff::ROUTER_Z_LOSS_OUTPUT;
    let mut c = config(true);
    c.moe.as_mut().unwrap().z_loss_coef = Some(0.5);
    let z_model = build_forward(&spec(c, DType::F64)).unwrap();
    let z_out = z_model.outputs.iter().find(|o| o.kind == OutputKind::Named(ROUTER_Z_LOSS_OUTPUT.into())).unwrap();
    let z = value(&z_model, z_out.value);
    let lz = value(&z_model, z_model.loss().unwrap());
    assert!(z > 0.0, "z {z}");
    assert!((lz - l0 - 0.5 * z).abs() < 1e-12 * lz, "{lz} = {l0} + 0.5 · {z}?");
}

/// Adapters named for the linear layers go on the attention, the dense
/// layer's MLP and the shared expert; the router and the routed experts
/// are frozen with the rest of the base.
#[test]
fn linear_adapters_leave_the_experts_frozen() {
    use stepgraph_core::models::{Adapters, LoraTarget};
    let mut sp = spec(config(false), DType::F32);
    sp.adapters = Some(Adapters::new(4, 8.0, LoraTarget::MODULES.to_vec()).unwrap());
    let fwd = build_forward(&sp).unwrap();
    let params: Vec<String> = fwd.params().map(|p| name(&fwd, p)).collect();
    assert!(params.iter().all(|p| p.contains(".lora_")), "{params:?}");
    assert!(params.iter().any(|p| p.starts_with("model.layers.1.mlp.down_proj.lora_")), "{params:?}");
    assert!(params.iter().any(|p| p.starts_with("model.layers.0.self_attn.q_proj.lora_")), "{params:?}");
    assert!(params.iter().any(|p| p.starts_with("model.layers.0.mlp.shared_expert.up_proj.lora_")), "{params:?}");
    assert!(!params.iter().any(|p| p.contains(".experts.")), "{params:?}");
    let frozen: Vec<String> = fwd.frozen().map(|v| name(&fwd, v)).collect();
    assert!(frozen.contains(&"model.layers.0.mlp.experts.gate_proj.weight".to_string()));
    assert!(frozen.contains(&"model.layers.0.mlp.gate.weight".to_string()));
    let c = compile_step(&sp, &StepOptions::new(StepKind::Train)).unwrap();
    // No weight gradient for the experts: their products' backward passes the input gradient only.
    assert_eq!(c.step.nodes.iter().filter(|n| matches!(n.op, Op::GroupedMatmulWeightGrad(_))).count(), 0);
}

/// `all-linear` on a mixture of experts adapts the routed experts too:
/// one adapter per expert over the gate and up pair (`[E, r, C]` and
/// `[E, 2F, r]`) and one over the down product, as peft's
/// `target_parameters` gives them, and `router` the router; their
/// gradients match finite differences, and the model with the adapters
/// merged into the weights (each at its own scale) computes the same logits.
#[test]
fn expert_adapters_train_and_merge_into_the_experts() {
    use stepgraph_core::models::lora::{MergedWeights, TargetRank};
    use stepgraph_core::models::{Adapters, LoraTarget};
    let (c, f, e, r) = (config(true).n_embd, 12, 4, 3);
    for normalize in [true, false] {
        let mut sp = spec(config(normalize), DType::F64);
        // With the router too, and the gate/up pair at a rank and alpha of
        // its own (as peft converts separate gate and up adapters).
        let mut targets = LoraTarget::ALL.to_vec();
        targets.push(LoraTarget::Router);
        let own = TargetRank { target: LoraTarget::ExpertsGateUp, rank: 2 * r, alpha: 5.0 };
        sp.adapters = Some(Adapters { ranks: vec![own], ..Adapters::new(r, 6.0, targets).unwrap() });
        let fwd = build_forward(&sp).unwrap();
        let expert = |n: &str| ty2(&fwd, &format!("model.layers.0.mlp.experts.{n}.weight"));
        assert_eq!(expert("gate_up_proj.lora_A"), [e, 2 * r, c]);
        assert_eq!(expert("gate_up_proj.lora_B"), [e, 2 * f, 2 * r]);
        assert_eq!(expert("down_proj.lora_A"), [e, r, f]);
        assert_eq!(expert("down_proj.lora_B"), [e, c, r]);
        assert_eq!(ty2(&fwd, "model.layers.0.mlp.gate.lora_B.weight"), [e, r]);
        assert!(fwd.frozen().any(|v| name(&fwd, v) == "model.layers.0.mlp.experts.up_proj.weight"));
        assert!(fwd.frozen().any(|v| name(&fwd, v) == "model.layers.0.mlp.gate.weight"));
        assert_gradients_match(&sp, &["experts.gate_up_proj", "experts.down_proj", "mlp.gate.lora"]);

        // Merged: the base model with every adapter folded into its weights.
        let with = build_forward_with_logits(&sp).unwrap();
        let w = weights(&with, 9);
        let data = random_batch(&sp, 4);
        let adapted = logits(&with, &w, &data);
        let mut held = HeldWeights(w.clone());
        let mut merged = MergedWeights::new(&mut held, &with, sp.adapters.as_ref().unwrap()).unwrap();
        let base_sp = ModelSpec { adapters: None, ..sp.clone() };
        let base = build_forward_with_logits(&base_sp).unwrap();
        let base_w: HashMap<String, HostTensor> = base
            .weights()
            .map(|v| {
                let n = name(&base, v);
                let t = stepgraph_core::models::hf_dir::NamedParams::read_param(&mut merged, &n).unwrap();
                (n, t)
            })
            .collect();
        assert_ne!(base_w["model.layers.0.mlp.experts.up_proj.weight"], w["model.layers.0.mlp.experts.up_proj.weight"]);
        let folded = logits(&base, &base_w, &data);
        let worst = adapted.iter().zip(&folded).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-10, "normalize {normalize}: merged logits differ by {worst}");
    }
}

/// QLoRA stores the routed experts' stacked weights as NF4 like every
/// other projection of the blocks, and the step computes with them
/// dequantized: the same logits as the base holding those dequantized
/// values in f32.
#[test]
fn an_nf4_base_quantizes_the_experts_too() {
    use stepgraph_core::models::lora::{quantized_weights, BaseStorage, MergedWeights};
    use stepgraph_core::models::{Adapters, LoraTarget};
    let mut sp = spec(config(true), DType::F32);
    let adapters = Adapters::new(2, 4.0, LoraTarget::ALL.to_vec()).unwrap();
    sp.adapters = Some(Adapters { base: BaseStorage::Nf4 { double_quant: true }, ..adapters });
    let fwd = build_forward_with_logits(&sp).unwrap();
    let quantized: Vec<String> = quantized_weights(&fwd).into_iter().map(|q| q.name).collect();
    for w in ["gate_proj", "up_proj", "down_proj"] {
        assert!(quantized.contains(&format!("model.layers.0.mlp.experts.{w}.weight")), "{quantized:?}");
    }
    assert!(!quantized.iter().any(|q| q.contains("mlp.gate.weight")), "the router stays: {quantized:?}");
    // Draw the base, quantize it into the leaves, and run: the dequantized
    // base (read back through MergedWeights with zero B) gives the same logits.
    let mut w = HeldWeights(weights(&fwd, 3).into_iter().filter(|(n, _)| !n.contains(".nf4_")).collect());
    for q in quantized_weights(&fwd) {
        let full = stepgraph_core::models::init_param(&q.name, &q.ty, 3).unwrap();
        q.write(&mut w, &full).unwrap();
    }
    for (n, t) in w.0.iter_mut() {
        if n.ends_with(".lora_B.weight") {
            *t = HostTensor::zeros(t.ty.clone());
        }
    }
    let data = random_batch(&sp, 4);
    let ours = logits(&fwd, &w.0, &data);
    let base_sp = ModelSpec { adapters: None, ..sp.clone() };
    let base = build_forward_with_logits(&base_sp).unwrap();
    let mut merged = MergedWeights::new(&mut w, &fwd, sp.adapters.as_ref().unwrap()).unwrap();
    let base_w: HashMap<String, HostTensor> = base
        .weights()
        .map(|v| {
            let n = name(&base, v);
            (n.clone(), stepgraph_core::models::hf_dir::NamedParams::read_param(&mut merged, &n).unwrap())
        })
        .collect();
    assert_eq!(ours, logits(&base, &base_w, &data));
}

/// Weights held in a map, read and written by name.
struct HeldWeights(HashMap<String, HostTensor>);

impl stepgraph_core::models::hf_dir::NamedParams for HeldWeights {
    fn params_trace_name(&self) -> &str {
        "forward"
    }
    fn has_param(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
    fn read_param(&mut self, name: &str) -> stepgraph_core::error::Result<HostTensor> {
        Ok(self.0[name].clone())
    }
    fn write_param(&mut self, name: &str, value: &HostTensor) -> stepgraph_core::error::Result<()> {
        self.0.insert(name.to_string(), value.clone());
        Ok(())
    }
}

/// Targets that match nothing are refused before any work, as is dropout
/// on the experts' adapters (peft's expert adapters take none).
#[test]
fn expert_adapter_settings_that_cannot_hold_are_refused() {
    use stepgraph_core::models::{Adapters, LoraTarget};
    let mut dense = spec(Config::named("tiny-llama").unwrap(), DType::F32);
    dense.adapters = Some(Adapters::new(2, 4.0, LoraTarget::EXPERTS.to_vec()).unwrap());
    let e = build_forward(&dense).unwrap_err().to_string();
    assert!(e.contains("experts_gate_up") && e.contains("no routed experts"), "{e}");
    // all-linear is whatever the model has: a dense model's seven layers.
    dense.adapters = Some(Adapters::new(2, 4.0, LoraTarget::ALL.to_vec()).unwrap());
    build_forward(&dense).unwrap();
    let mut sp = spec(config(true), DType::F32);
    sp.adapters = Some(Adapters { dropout: 0.1, ..Adapters::new(2, 4.0, LoraTarget::ALL.to_vec()).unwrap() });
    let e = build_forward(&sp).unwrap_err().to_string();
    assert!(e.contains("--lora-dropout") && e.contains("q,k,v,o,gate,up,down"), "{e}");
    sp.adapters.as_mut().unwrap().targets = vec![LoraTarget::Q, LoraTarget::Router];
    let e = build_forward(&sp).unwrap_err().to_string();
    assert!(e.contains("`router`") && e.contains("--lora-dropout"), "{e}");
    sp.adapters.as_mut().unwrap().targets = LoraTarget::MODULES.to_vec();
    build_forward(&sp).unwrap();
}

#[test]
fn a_compiled_train_step_routes_sorts_and_runs_grouped_products() {
    let sp = spec(config(true), DType::BF16);
    let c = compile_step(&sp, &StepOptions::new(StepKind::Train)).unwrap();
    let count = |f: fn(&Op) -> bool| c.step.nodes.iter().filter(|n| f(&n.op)).count();
    assert_eq!(count(|o| matches!(o, Op::TopK(_))), 1);
    assert_eq!(count(|o| matches!(o, Op::TopKBackward(_))), 1);
    assert_eq!(count(|o| matches!(o, Op::ExpertSort(_))), 1);
    // Forward: gate, up and down; backward: each one's input gradient.
    assert_eq!(count(|o| matches!(o, Op::GroupedMatmul(_))), 6);
    assert_eq!(count(|o| matches!(o, Op::GroupedMatmulWeightGrad(_))), 3);
    // The routed rows (tokens × k) are planned like any other value.
    let routed = 2 * 8 * 2 * sp.config.n_embd * 2;
    assert!(c.plan.planned_peak_bytes() > routed as u64);
    // And the step runs on the CPU.
    let mut s = CpuSession::new(c.step.clone(), c.plan.clone()).unwrap();
    s.init_params(1).unwrap();
    for (n, t) in random_batch(&sp, 6) {
        s.write_named(n, &t).unwrap();
    }
    s.write_named(stepgraph_core::autodiff::LR_INPUT, &stepgraph_core::cpu::exec::scalar_input(1e-3)).unwrap();
    s.write_named(stepgraph_core::autodiff::STEP_INPUT, &stepgraph_core::cpu::exec::scalar_input(1.0)).unwrap();
    s.run_eager().unwrap();
    let loss = s.read(c.step.loss().unwrap()).to_f64()[0];
    assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
}
