//! MLP row tiling (`ForwardOptions::mlp_tiles`, `StepOptions::mlp_tiles`):
//! one tile records the untiled model op for op; any tiling, with or
//! without recomputation, computes the untiled step's loss and gradients on
//! the CPU backend; and a memory budget that recomputation alone cannot
//! meet makes `compile_step` tile the MLP until it is met, or refuse naming
//! the least peak any tiling reached.

use std::collections::BTreeMap;

use stepgraph_core::autodiff::StepKind;
use stepgraph_core::cpu::exec::CpuSession;
use stepgraph_core::error::Error;
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{
    build_forward, build_forward_opts, init_params, Config, ForwardOptions, LossKind, ModelSpec, Overrides,
};
use stepgraph_core::ops::Op;
use stepgraph_core::passes::recompute::{self, RecomputePolicy};
use stepgraph_core::pipeline::{compile_step, trace_step, CompiledStep, StepOptions};
use stepgraph_core::plan::PlanOptions;
use stepgraph_core::session::Session;
use stepgraph_core::testing::{grads_by_name, max_rel_diff};

fn spec(name: &str, o: Overrides, batch: usize, seq: usize, dtype: DType) -> ModelSpec {
    let config = Config::named(name).unwrap().with_overrides(&o).unwrap();
    ModelSpec { config, batch, seq, dtype, loss: LossKind::CrossEntropy, adapters: None, documents: false }
}

/// The loss and every gradient (by parameter name) of one CPU run of `c`.
fn run(c: &CompiledStep) -> (f64, BTreeMap<String, Vec<f64>>) {
    let mut s = CpuSession::new(c.step.clone(), c.plan.clone()).unwrap();
    for (v, value) in init_params(&c.forward, 5) {
        s.write_named(c.forward.value(v).kind.leaf_name().unwrap(), &value).unwrap();
    }
    let (batch, seq, vocab) = (c.spec.batch, c.spec.seq, c.spec.config.vocab_size);
    let ty = TensorType::new(DType::I32, [batch, seq]);
    let ids: Vec<f64> = (0..batch * seq).map(|i| ((i * 37 + 11) % vocab) as f64).collect();
    let targets: Vec<f64> = (0..batch * seq).map(|i| ((i * 53 + 7) % vocab) as f64).collect();
    s.write_named(TOKENS_INPUT, &HostTensor::from_f64(ty.clone(), &ids)).unwrap();
    s.write_named(TARGETS_INPUT, &HostTensor::from_f64(ty, &targets)).unwrap();
    Session::run_eager(&mut s).unwrap();
    let loss = Session::loss(&mut s).unwrap();
    (loss, grads_by_name(&c.step, |v| Session::read(&mut s, v).unwrap().to_f64()))
}

fn count(c: &CompiledStep, name: &str) -> usize {
    c.step.nodes.iter().filter(|n| n.op.name() == name).count()
}

#[test]
fn one_tile_records_the_untiled_model() {
    for name in ["tiny-llama", "tiny-neox"] {
        let sp = spec(name, Overrides::default(), 2, 8, DType::F32);
        let one = build_forward_opts(&sp, &ForwardOptions { mlp_tiles: 1, ..ForwardOptions::default() }).unwrap();
        assert_eq!(one.to_string(), build_forward(&sp).unwrap().to_string());
        let e = build_forward_opts(&sp, &ForwardOptions { mlp_tiles: 0, ..ForwardOptions::default() }).unwrap_err();
        assert!(e.to_string().contains("at least one row tile"), "{e}");
    }
}

#[test]
fn tiled_steps_compute_the_untiled_loss_and_gradients() {
    // 2×8 = 16 rows: even tiles, uneven ones (3, 5) and one row per tile.
    for (name, dtype, tol) in
        [("tiny-llama", DType::F64, 1e-12), ("tiny-llama", DType::F32, 1e-5), ("tiny-neox", DType::F32, 1e-5)]
    {
        let sp = spec(name, Overrides::default(), 2, 8, dtype);
        let plain = compile_step(&sp, &StepOptions::unoptimized(StepKind::Grads)).unwrap();
        let (loss, grads) = run(&plain);
        for tiles in [2, 3, 5, 16, 40] {
            for recompute in [RecomputePolicy::Off, RecomputePolicy::Auto] {
                let opts = StepOptions { recompute, mlp_tiles: tiles, ..StepOptions::unoptimized(StepKind::Grads) };
                let c = compile_step(&sp, &opts).unwrap();
                // At most one tile per row; a tile per layer's MLP each.
                let effective = tiles.min(16);
                assert_eq!(c.recompute().mlp_tiles, effective);
                assert_eq!(count(&c, "concat"), sp.config.n_layer, "{name} {tiles}");
                let down = c.step.nodes.iter().filter(|n| matches!(n.op, Op::MatMul(_))).count();
                let plain_down = plain.step.nodes.iter().filter(|n| matches!(n.op, Op::MatMul(_))).count();
                assert!(down > plain_down, "{name} {tiles}: the tiles' products");
                let (l, g) = run(&c);
                let what = format!("{name} {dtype} {tiles} tiles {recompute:?}");
                assert!(((l - loss) / loss).abs() <= tol, "{what}: loss {l} vs {loss}");
                assert_eq!(g.keys().collect::<Vec<_>>(), grads.keys().collect::<Vec<_>>(), "{what}");
                for (p, want) in &grads {
                    let d = max_rel_diff(&g[p], want);
                    assert!(d <= tol, "{what}: gradient of {p} differs by {d:e}");
                }
            }
        }
    }
}

/// A model whose MLP dominates the step untiled (16 wide, 2048
/// intermediate, on 64 rows) while its loss head (8192 words) bounds what
/// tiling can save, so the budget's search stops after a few doublings.
fn mlp_heavy() -> ModelSpec {
    let o = Overrides {
        n_embd: Some(16),
        n_head: Some(2),
        intermediate_size: Some(2048),
        vocab_size: Some(8192),
        ..Default::default()
    };
    spec("tiny-llama", o, 1, 64, DType::F32)
}

/// The least planned peak recomputation reaches on `sp` with the MLP in
/// `tiles` tiles, without trying other tilings (the pipeline's stages up to
/// recomputation, by hand).
fn least_with(sp: &ModelSpec, tiles: usize) -> u64 {
    let opts = StepOptions { mlp_tiles: tiles, ..StepOptions::new(StepKind::Grads) };
    // As the pipeline builds it: the adds folded before recomputation.
    let (step, _) = stepgraph_core::passes::fusion::fold(&trace_step(sp, &opts).unwrap().step).unwrap();
    match recompute::apply(&step, RecomputePolicy::Budget(1), PlanOptions::default()) {
        Err(Error::MemoryBudget { least, mlp_tiles: 1, .. }) => least,
        Err(other) => panic!("expected a budget refusal, got {other}"),
        Ok(_) => panic!("no step fits in one byte"),
    }
}

#[test]
fn a_budget_that_recomputation_cannot_meet_tiles_the_mlp() {
    let sp = mlp_heavy();
    // Tiling alone: offload, which comes after it, would lower the least further.
    let budget = |bytes: u64| StepOptions {
        recompute: RecomputePolicy::Budget(bytes),
        offload: false,
        ..StepOptions::new(StepKind::Grads)
    };
    let untiled = least_with(&sp, 1);
    // A budget no tiling meets is refused naming the least peak over the
    // tilings tried, and the tiling that reached it.
    let refusal = compile_step(&sp, &budget(1)).unwrap_err();
    let e = refusal.to_string();
    let Error::MemoryBudget { least, mlp_tiles: tiles, .. } = refusal else { panic!("not a budget refusal: {e}") };
    assert!(tiles > 1 && least < untiled, "{least} in {tiles} tiles vs {untiled} untiled");
    assert_eq!(least, least_with(&sp, tiles));
    assert!(e.contains(&format!("plans {least} B")) && e.contains(&format!("in {tiles} row tiles")), "{e}");
    // Between the two, tiling meets the budget, with the fewest tiles of
    // the doubling that do.
    let target = (least + untiled) / 2;
    let c = compile_step(&sp, &budget(target)).unwrap();
    let t = c.recompute().mlp_tiles;
    assert!(c.planned_peak_bytes() <= target, "{}", c.recompute());
    assert!(t > 1 && t.is_power_of_two() && t <= tiles, "{}", c.recompute());
    assert!(least_with(&sp, t / 2) > target, "{} tiles would do", t / 2);
    assert!(c.recompute().to_string().contains(&format!("every MLP in {t} row tiles")), "{}", c.recompute());
    // A budget one tile meets is met untiled.
    let c1 = compile_step(&sp, &budget(untiled)).unwrap();
    assert_eq!(c1.recompute().mlp_tiles, 1);
    // And the tiled step computes the plain step's loss and gradients.
    let plain = compile_step(&sp, &StepOptions::unoptimized(StepKind::Grads)).unwrap();
    let (l0, g0) = run(&plain);
    let (l, g) = run(&c);
    assert!(((l - l0) / l0).abs() <= 1e-5, "{l} vs {l0}");
    for (p, want) in &g0 {
        assert!(max_rel_diff(&g[p], want) <= 1e-5, "{p}");
    }
}
