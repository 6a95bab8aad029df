//! Data parallelism on the CPU: N rank sessions in N threads with the
//! in-memory communicator. N ranks with the same global batch train like one
//! rank (within reduction-order rounding), every rank ends with identical
//! parameters, ZeRO-1 equals plain data parallelism bit for bit, and the
//! traces print, parse and plan.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use stepgraph_core::autodiff::{build_step, StepKind, TrainOptions, LR_INPUT, STEP_INPUT};
use stepgraph_core::cpu::comm::{run_ranks, Communicator};
use stepgraph_core::cpu::exec::{scalar_input, CpuSession};
use stepgraph_core::dist::{self, data_parallel, shard_rows, DataParallel};
use stepgraph_core::host::HostTensor;
use stepgraph_core::ir::parse::parse;
use stepgraph_core::ir::{Builder, DType, OutputKind, Phase, TensorType, Trace, ValueId, ValueKind};
use stepgraph_core::models::gpt::{IGNORE_INDEX, TARGETS_INPUT, TOKENS_INPUT};
use stepgraph_core::models::{build_forward, init_params, LossKind, ModelSpec};
use stepgraph_core::ops::collective::{AllGather, AllReduce, LocalShard, ReduceOp, ReduceScatter};
use stepgraph_core::ops::optim::MasterWeights;
use stepgraph_core::ops::{Op, VjpArgs};
use stepgraph_core::pipeline::build_rank_step;
use stepgraph_core::plan::{check_plan, plan, plan_report, PlanOptions};

const STEPS: usize = 20;
/// A learning rate at which 20 steps lower the loss steadily (5.5 to 2.6).
/// At 1e-2 the loss spikes, and along such a trajectory AdamW amplifies any
/// perturbation, rounding included, about 1e4-fold in 20 steps (measured in
/// f64: 1e-15 to 1e-11): the tolerance would then measure the trajectory,
/// not the reduction.
const LR: f64 = 3e-3;
const GLOBAL_BATCH: usize = 4;
const SEQ: usize = 16;

fn spec(dtype: DType) -> ModelSpec {
    ModelSpec::named("tiny-llama", GLOBAL_BATCH, SEQ, dtype, LossKind::CrossEntropy).unwrap()
}

/// The global batch of step `it`: rows of arithmetic sequences mod 256 (a
/// pattern the model can learn), targets shifted by one, the last position
/// of every row ignored (so every rank counts the same number of targets).
fn global_batch(it: usize) -> (HostTensor, HostTensor) {
    let mut rng = StdRng::seed_from_u64(1000 + it as u64);
    let ty = TensorType::new(DType::I32, [GLOBAL_BATCH, SEQ]);
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..GLOBAL_BATCH {
        let (start, stride) = (rng.gen_range(0..16), rng.gen_range(1..3));
        let row: Vec<f64> = (0..=SEQ).map(|i| ((start + i * stride) % 256) as f64).collect();
        ids.extend_from_slice(&row[..SEQ]);
        tg.extend_from_slice(&row[1..]);
        *tg.last_mut().unwrap() = IGNORE_INDEX as f64;
    }
    (HostTensor::from_f64(ty.clone(), &ids), HostTensor::from_f64(ty, &tg))
}

/// What one rank ends with.
struct RankRun {
    losses: Vec<f64>,
    /// Every updated leaf (parameters and optimizer state) by name, as bytes.
    finals: Vec<(String, HostTensor)>,
}

/// A session of `step` with the weights of `forward` (seed 7) and zero optimizer state.
fn session(step: &Trace, forward: &Trace) -> CpuSession {
    let p = plan(step, PlanOptions::default()).unwrap();
    check_plan(step, &p).unwrap();
    let mut s = CpuSession::new(step.clone(), p).unwrap();
    for (v, t) in init_params(forward, 7) {
        s.write_named(forward.value(v).kind.leaf_name().unwrap(), &t).unwrap();
    }
    for v in step.leaves().collect::<Vec<_>>() {
        if matches!(step.value(v).kind, ValueKind::State { .. }) {
            s.write(v, &HostTensor::zeros(step.ty(v).clone())).unwrap();
        }
    }
    s
}

/// Trains `STEPS` steps of `step` on rank `rank` of `world`.
fn train(s: &mut CpuSession, kind: StepKind, rank: usize, world: usize) -> RankRun {
    let mut losses = Vec::new();
    for it in 1..=STEPS {
        let (ids, tg) = global_batch(it);
        s.write_named(TOKENS_INPUT, &shard_rows(&ids, rank, world).unwrap()).unwrap();
        s.write_named(TARGETS_INPUT, &shard_rows(&tg, rank, world).unwrap()).unwrap();
        if kind == StepKind::Train {
            s.write_named(LR_INPUT, &scalar_input(LR)).unwrap();
            s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
        }
        s.replay().unwrap();
        losses.push(s.loss().unwrap());
        if kind == StepKind::Grads {
            break;
        }
    }
    let trace = s.trace().clone();
    let finals = trace
        .updates
        .iter()
        .map(|u| (trace.value(u.state).kind.leaf_name().unwrap().to_string(), s.read(u.state)))
        .collect();
    RankRun { losses, finals }
}

/// One process, the global batch, no collectives.
fn single(dtype: DType) -> RankRun {
    let sp = spec(dtype);
    let fwd = build_forward(&sp).unwrap();
    let step = build_step(&fwd, StepKind::Train, &TrainOptions::default()).unwrap();
    train(&mut session(&step, &fwd), StepKind::Train, 0, 1)
}

/// `world` ranks in threads; returns every rank's run.
fn ranks(dtype: DType, dp: &DataParallel) -> Vec<RankRun> {
    let (_, fwd, step) = build_rank_step(&spec(dtype), StepKind::Train, &TrainOptions::default(), dp).unwrap();
    run_ranks(dp.world, |comm| {
        let rank = comm.rank();
        let mut s = session(&step, &fwd);
        s.set_comm(Arc::new(comm))?;
        Ok(train(&mut s, StepKind::Train, rank, dp.world))
    })
    .unwrap()
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs()).fold(0.0, f64::max)
}

/// An AdamW moment or master state: what ZeRO-1 shards over the ranks.
fn is_optimizer_state(name: &str) -> bool {
    name.contains("exp_avg") || name.ends_with(".master") || name.ends_with(".compensation")
}

fn assert_ranks_identical(runs: &[RankRun], what: &str) {
    for (r, run) in runs.iter().enumerate() {
        assert_eq!(run.losses, runs[0].losses, "{what}: rank {r} reports other losses than rank 0");
        for ((name, t), (_, t0)) in run.finals.iter().zip(&runs[0].finals) {
            if !is_optimizer_state(name) {
                assert_eq!(t, t0, "{what}: rank {r} ends with another `{name}` than rank 0");
            }
        }
    }
}

/// Relative loss tolerance against one rank, per step over 20 steps. Each
/// step sums every gradient in another order (each rank's rows, then the
/// ranks in order) and averages the loss as a mean of rank means; those
/// roundings are all that differs. Measured: at most 5e-7 in f32 and 1.2e-15
/// in f64, for 2 and 4 ranks. In bf16 each rank also rounds its partial
/// gradients to bf16 (8 significant bits) before the ranks are summed, where
/// one rank rounds the full sum once: measured at most 7e-4.
const F32_LOSS_TOL: f64 = 2e-6;
const F64_LOSS_TOL: f64 = 1e-13;
const BF16_LOSS_TOL: f64 = 5e-3;

#[test]
fn n_ranks_train_like_one_rank_and_stay_identical() {
    for (dtype, tol) in [(DType::F32, F32_LOSS_TOL), (DType::F64, F64_LOSS_TOL), (DType::BF16, BF16_LOSS_TOL)] {
        let one = single(dtype);
        assert!(one.losses[STEPS - 1] < one.losses[0] - 1.0, "{dtype}: training must lower the loss: {:?}", one.losses);
        for world in [1, 2, 4] {
            let plain = ranks(dtype, &DataParallel::new(world));
            let zero = ranks(dtype, &DataParallel { zero1: true, ..DataParallel::new(world) });
            assert_ranks_identical(&plain, &format!("{dtype} DP {world}"));
            assert_ranks_identical(&zero, &format!("{dtype} ZeRO-1 {world}"));
            let rel = max_rel(&plain[0].losses, &one.losses);
            assert!(rel <= tol, "{dtype}, {world} ranks: losses differ from one rank by {rel:e} > {tol:e}");
            if world == 1 {
                // One rank of a group is the plain step: the mean over one rank is exact.
                assert_eq!(plain[0].losses, one.losses, "{dtype}: DP over 1 rank must equal the plain step");
            }
            // ZeRO-1 reduces and updates every element exactly as plain data
            // parallelism does, only on a shard: same bits.
            assert_eq!(zero[0].losses, plain[0].losses, "{dtype}, {world} ranks: ZeRO-1 losses differ from DP");
            for (name, t) in &plain[0].finals {
                if is_optimizer_state(name) {
                    // The full moment (or master state) is every rank's shard in rank order.
                    let mut gathered = Vec::new();
                    for run in &zero {
                        let (_, s) = run.finals.iter().find(|(n, _)| n == name).unwrap();
                        assert_eq!(s.ty.numel() * world, t.ty.numel(), "{name}: a ZeRO-1 shard is 1/{world}");
                        gathered.extend_from_slice(s.bytes());
                    }
                    assert_eq!(gathered, t.bytes(), "{dtype}, {world} ranks: ZeRO-1 `{name}` shards differ from DP");
                } else {
                    let (_, z) = zero[0].finals.iter().find(|(n, _)| n == name).unwrap();
                    assert_eq!(z, t, "{dtype}, {world} ranks: ZeRO-1 `{name}` differs from DP");
                }
            }
        }
    }
}

#[test]
fn gradients_of_n_ranks_are_the_global_batch_gradients() {
    let sp = spec(DType::F64);
    let fwd = build_forward(&sp).unwrap();
    let grads = build_step(&fwd, StepKind::Grads, &TrainOptions::default()).unwrap();
    let mut s = session(&grads, &fwd);
    let (ids, tg) = global_batch(1);
    s.write_named(TOKENS_INPUT, &ids).unwrap();
    s.write_named(TARGETS_INPUT, &tg).unwrap();
    s.run_eager().unwrap();
    let want: Vec<(String, Vec<f64>)> = grads
        .outputs
        .iter()
        .filter_map(|o| match o.kind {
            stepgraph_core::ir::OutputKind::Grad(p) => {
                Some((grads.value(p).kind.leaf_name().unwrap().to_string(), s.read(o.value).to_f64()))
            }
            _ => None,
        })
        .collect();
    let want_loss = s.loss().unwrap();
    let dp = DataParallel { bucket_bytes: 30_000, ..DataParallel::new(4) };
    let (_, rfwd, step) = build_rank_step(&sp, StepKind::Grads, &TrainOptions::default(), &dp).unwrap();
    let got = run_ranks(4, |comm| {
        let rank = comm.rank();
        let mut s = session(&step, &rfwd);
        s.set_comm(Arc::new(comm))?;
        s.write_named(TOKENS_INPUT, &shard_rows(&ids, rank, 4)?)?;
        s.write_named(TARGETS_INPUT, &shard_rows(&tg, rank, 4)?)?;
        s.run_eager()?;
        let loss = s.loss()?;
        let g: Vec<(String, Vec<f64>)> = want
            .iter()
            .map(|(name, _)| {
                let p = step.leaf_by_name(name).unwrap();
                (name.clone(), s.read(step.grad_of(p).unwrap()).to_f64())
            })
            .collect();
        Ok((loss, g))
    })
    .unwrap();
    for (loss, g) in &got {
        assert!((loss - want_loss).abs() <= 1e-13 * want_loss.abs(), "loss {loss} vs {want_loss}");
        for ((name, a), (_, b)) in g.iter().zip(&want) {
            let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let err = a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= 1e-12 * scale.max(1e-30), "{name}: gradient differs by {err:e} (scale {scale:e})");
        }
        assert_eq!(g, &got[0].1, "every rank gets the same reduced gradients");
    }
}

#[test]
fn buckets_follow_backward_and_sit_right_after_their_last_gradient() {
    let sp = spec(DType::F32);
    let fwd = build_forward(&dist::rank_spec(&sp, 2).unwrap()).unwrap();
    for kind in [StepKind::Grads, StepKind::Train] {
        let step = build_step(&fwd, kind, &TrainOptions::default()).unwrap();
        let budget = 20_000;
        let bks = dist::buckets(&step, budget).unwrap();
        let order = dist::gradient_order(&step).unwrap();
        assert_eq!(bks.iter().flat_map(|b| b.grads.clone()).collect::<Vec<_>>(), order);
        let n_params = step.params().count();
        assert_eq!(order.len(), n_params, "tiny-llama has one distinct gradient per parameter");
        let pos = |v| step.producer(v).unwrap().index();
        assert!(order.windows(2).all(|w| pos(w[0]) <= pos(w[1])), "gradients in production order");
        for (k, b) in bks.iter().enumerate() {
            let last = *b.grads.last().unwrap();
            assert_eq!(b.after, step.producer(last).unwrap());
            assert_eq!(b.bytes, b.grads.iter().map(|&g| step.ty(g).bytes()).sum::<u64>());
            assert!(b.bytes - step.ty(last).bytes() < budget, "bucket {k} closed late");
            if k + 1 < bks.len() {
                assert!(b.bytes >= budget, "bucket {k} closed early");
            }
        }
        assert!(bks.len() >= 4, "{} buckets", bks.len());

        for zero1 in [false, true] {
            if zero1 && kind == StepKind::Grads {
                continue;
            }
            let dp = DataParallel { world: 2, bucket_bytes: budget, zero1 };
            let t = data_parallel(&step, &dp).unwrap();
            let coll = if zero1 { "reduce_scatter_mean" } else { "all_reduce_mean" };
            let grad_nodes: Vec<usize> = (0..t.nodes.len())
                .filter(|&i| t.nodes[i].op.name() == coll && t.nodes[i].phase == Phase::Backward)
                .collect();
            assert_eq!(grad_nodes.len(), bks.len(), "one collective per bucket");
            for (&i, b) in grad_nodes.iter().zip(&bks) {
                assert_eq!(t.nodes[i].inputs.len(), b.grads.len());
                // The node right before (skipping other collectives) makes the bucket's last gradient.
                let mut j = i - 1;
                while stepgraph_core::ops::collective::world_of(&t.nodes[j].op).is_some() {
                    j -= 1;
                }
                let last = *t.nodes[i].inputs.last().unwrap();
                assert_eq!(
                    t.producer(last).unwrap().index(),
                    j,
                    "bucket collective at {i} is not right after its gradient"
                );
            }
            // The loss is averaged right after it is computed.
            let loss = t.loss().unwrap();
            let ln = t.producer(loss).unwrap().index();
            assert_eq!(t.nodes[ln].op.name(), "all_reduce_mean");
            assert_eq!(t.nodes[ln].phase, Phase::Forward);
            assert_eq!(t.nodes[ln - 1].op.name(), "linear_cross_entropy");
            if zero1 {
                let gathers = t.nodes.iter().filter(|n| n.op.name() == "all_gather").count();
                assert_eq!(gathers, bks.len(), "one all-gather per bucket");
                assert_eq!(t.nodes.iter().filter(|n| n.op.name() == "local_shard").count(), n_params);
            }
            // Every plan of a transformed step is safe, with reuse and without.
            for reuse in [true, false] {
                let p = plan(&t, PlanOptions { reuse, ..PlanOptions::default() }).unwrap();
                check_plan(&t, &p).unwrap();
            }
            // The planner runs the collectives in place: each gradient is
            // reduced where backward left it, each parameter gathered into itself.
            let p = plan(&t, PlanOptions::default()).unwrap();
            for node in t.nodes.iter().filter(|n| matches!(n.op, Op::AllReduce(_) | Op::AllGather(_))) {
                for (&i, &o) in node.inputs.iter().zip(&node.outputs) {
                    assert_eq!(p.slot(i), p.slot(o), "{} of {} is not in place", node.op.name(), t.describe(i));
                }
            }
        }
    }
}

#[test]
fn collective_traces_print_parse_and_lower() {
    let sp = spec(DType::BF16);
    for zero1 in [false, true] {
        let dp = DataParallel { world: 4, bucket_bytes: 50_000, zero1 };
        let (_, _, t) = build_rank_step(&sp, StepKind::Train, &TrainOptions::default(), &dp).unwrap();
        let text = t.to_string();
        assert!(text.starts_with("# after: data_parallel\ntrace train\n"), "{text}");
        let needles: &[&str] = if zero1 {
            &["= reduce_scatter_mean %", "= all_gather %", "= local_shard %", "{world=4}", "{world=4, tensors="]
        } else {
            &["= all_reduce_mean %", "{world=4, tensors=1}"]
        };
        for n in needles {
            assert!(text.contains(n), "no `{n}` in\n{text}");
        }
        let parsed = parse(&text).unwrap();
        assert_eq!(parsed, t);
        assert_eq!(parsed.to_string(), text);
        for node in t.nodes.iter().filter(|n| stepgraph_core::ops::collective::world_of(&n.op).is_some()) {
            assert_eq!(stepgraph_core::ops::collective::world_of(&node.op), Some(4), "{}", node.op.name());
        }
        if zero1 {
            // Optimizer state is sharded: a quarter of every parameter's
            // moments (2) and compensation (1, bf16 master weights).
            let r = plan_report(&t, &plan(&t, PlanOptions::default()).unwrap(), 1);
            let per_param = 2 + (TrainOptions::default().master_weights == MasterWeights::Kahan) as u64;
            assert_eq!(r.optimizer_state_bytes * 4, per_param * r.param_bytes);
        }
    }
}

#[test]
fn data_parallel_errors_name_the_problem() {
    let err = |r: stepgraph_core::Result<(ModelSpec, Trace, Trace)>| r.unwrap_err().to_string();
    let opts = TrainOptions::default();
    let mut sp = spec(DType::F32);
    let e = err(build_rank_step(&sp, StepKind::Train, &opts, &DataParallel::new(3)));
    assert!(e.contains("global batch of 4 rows does not split over 3 ranks"), "{e}");
    sp.batch = 3;
    let e = err(build_rank_step(&sp, StepKind::Train, &opts, &DataParallel { zero1: true, ..DataParallel::new(3) }));
    assert!(
        e.contains("ZeRO-1 over 3 ranks cannot shard param model.embed_tokens.weight")
            && e.contains("f32[256,64] has 16384 elements, which do not split into 3 equal shards"),
        "{e}"
    );
    // Plain data parallelism does not shard, so the same shapes are fine.
    build_rank_step(&sp, StepKind::Train, &opts, &DataParallel::new(3)).unwrap();
    sp.batch = 4;
    let e = err(build_rank_step(&sp, StepKind::Grads, &opts, &DataParallel { zero1: true, ..DataParallel::new(2) }));
    assert!(e.contains("ZeRO-1 shards optimizer state, and the step `grads` has no optimizer"), "{e}");
    let e = err(build_rank_step(&sp, StepKind::Forward, &opts, &DataParallel::new(2)));
    assert!(e.contains("the step `forward` has no gradients to reduce"), "{e}");
    let e =
        err(build_rank_step(&sp, StepKind::Train, &opts, &DataParallel { bucket_bytes: 0, ..DataParallel::new(2) }));
    assert!(e.contains("bucket size must be at least 1 byte"), "{e}");
    let e = err(build_rank_step(&sp, StepKind::Train, &opts, &DataParallel::new(0)));
    assert!(e.contains("at least 1"), "{e}");

    // A rank session must match the program's group, and needs a communicator at all.
    let (_, fwd, step) = build_rank_step(&sp, StepKind::Train, &opts, &DataParallel::new(2)).unwrap();
    let e = run_ranks(4, |comm| {
        let mut s = session(&step, &fwd);
        s.set_comm(Arc::new(comm))
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("`all_reduce_mean` is for 2 ranks, but the communicator has 4"), "{e}");
    let mut s = session(&step, &fwd);
    let (ids, tg) = global_batch(1);
    s.write_named(TOKENS_INPUT, &shard_rows(&ids, 0, 2).unwrap()).unwrap();
    s.write_named(TARGETS_INPUT, &shard_rows(&tg, 0, 2).unwrap()).unwrap();
    s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
    s.write_named(STEP_INPUT, &scalar_input(1.0)).unwrap();
    let e = s.run_eager().unwrap_err().to_string();
    assert!(e.contains("`all_reduce_mean` needs a communicator"), "{e}");
    let e = shard_rows(&ids, 0, 3).unwrap_err().to_string();
    assert!(e.contains("does not split over 3 ranks"), "{e}");
}

#[test]
fn a_rank_that_fails_stops_the_group_with_its_error() {
    let sp = spec(DType::F32);
    let dp = DataParallel { zero1: true, ..DataParallel::new(2) };
    let (_, fwd, step) = build_rank_step(&sp, StepKind::Train, &TrainOptions::default(), &dp).unwrap();
    let e = run_ranks(2, |comm| {
        let rank = comm.rank();
        let mut s = session(&step, &fwd);
        s.set_comm(Arc::new(comm))?;
        let (ids, tg) = global_batch(1);
        s.write_named(TOKENS_INPUT, &shard_rows(&ids, rank, 2)?)?;
        s.write_named(TARGETS_INPUT, &shard_rows(&tg, rank, 2)?)?;
        s.write_named(LR_INPUT, &scalar_input(1e-2))?;
        // Rank 1 hands the optimizer a step count of 0: its first AdamW
        // fails while rank 0 waits for it at the first all-gather.
        s.write_named(STEP_INPUT, &scalar_input(if rank == 1 { 0.0 } else { 1.0 }))?;
        s.run_eager()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("rank 1") && e.contains("AdamW step must be at least 1"), "{e}");
}

// ---------------------------------------------------------------- the ops one by one

/// Runs `op` on every rank, rank `r` with inputs `per_rank[r]`; returns every rank's outputs.
fn run_op_on_ranks(op: Op, per_rank: &[Vec<HostTensor>]) -> Vec<Vec<HostTensor>> {
    let mut b = Builder::new("op");
    let ids: Vec<ValueId> =
        per_rank[0].iter().enumerate().map(|(i, t)| b.input(&format!("x{i}"), t.ty.clone()).unwrap()).collect();
    let outs = b.push(op, &ids).unwrap();
    for (k, o) in outs.into_iter().enumerate() {
        b.output(OutputKind::Named(format!("y{k}")), o);
    }
    let t = b.finish("build").unwrap();
    run_ranks(per_rank.len(), |comm| {
        let rank = comm.rank();
        let p = plan(&t, PlanOptions::default())?;
        check_plan(&t, &p)?;
        let mut s = CpuSession::new(t.clone(), p)?;
        s.set_comm(Arc::new(comm))?;
        for (i, x) in per_rank[rank].iter().enumerate() {
            s.write_named(&format!("x{i}"), x)?;
        }
        s.run_eager()?;
        Ok(t.outputs.iter().map(|o| s.read(o.value)).collect())
    })
    .unwrap()
}

fn tensor(dtype: DType, shape: &[usize], data: &[f64]) -> HostTensor {
    HostTensor::from_f64(TensorType::new(dtype, shape), data)
}

#[test]
fn collective_kernels_reduce_in_rank_order_and_gather_shards() {
    let f = |shape: &[usize], data: &[f64]| tensor(DType::F32, shape, data);
    // Three ranks, two tensors (one bf16) in one bucket.
    let per_rank: Vec<Vec<HostTensor>> = (0..3)
        .map(|r| {
            let r = r as f64;
            vec![f(&[2, 2], &[1.0 + r, 0.1 * r, -r, 1e8]), tensor(DType::BF16, &[3], &[r, 0.5, 1.0 / 3.0])]
        })
        .collect();
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let outs = run_op_on_ranks(AllReduce { op, world: 3, tensors: 2 }.into(), &per_rank);
        // The reference: f32 sums in rank order, then 1/3 in f32, rounded once to the storage type.
        for k in 0..2 {
            let want: Vec<f64> = (0..per_rank[0][k].ty.numel())
                .map(|i| {
                    let mut acc = per_rank[0][k].to_f64()[i] as f32;
                    for rank in &per_rank[1..] {
                        acc += rank[k].to_f64()[i] as f32;
                    }
                    if op == ReduceOp::Mean {
                        acc *= (1.0f64 / 3.0) as f32;
                    }
                    acc as f64
                })
                .collect();
            let want = HostTensor::from_f64(per_rank[0][k].ty.clone(), &want);
            for (r, o) in outs.iter().enumerate() {
                assert_eq!(o[k], want, "{op:?} tensor {k} on rank {r}");
            }
        }
    }

    let per_rank: Vec<Vec<HostTensor>> = (0..2)
        .map(|r| {
            let r = r as f64;
            vec![f(&[4], &[1.0, 2.0, 3.0, 4.0 + r]), f(&[2, 3], &[r, 1.0, 2.0, 3.0, 4.0, 5.0])]
        })
        .collect();
    let outs = run_op_on_ranks(ReduceScatter { op: ReduceOp::Mean, world: 2, tensors: 2 }.into(), &per_rank);
    assert_eq!(outs[0], vec![f(&[2], &[1.0, 2.0]), f(&[3], &[0.5, 1.0, 2.0])]);
    assert_eq!(outs[1], vec![f(&[2], &[3.0, 4.5]), f(&[3], &[3.0, 4.0, 5.0])]);

    // All-gather: the destination's contents are never read.
    let per_rank: Vec<Vec<HostTensor>> = (0..2)
        .map(|r| {
            let r = r as f64;
            vec![f(&[2, 2], &[f64::NAN; 4]), f(&[2], &[10.0 * r, 10.0 * r + 1.0])]
        })
        .collect();
    let outs = run_op_on_ranks(AllGather { world: 2, tensors: 1 }.into(), &per_rank);
    for o in &outs {
        assert_eq!(o[0], f(&[2, 2], &[0.0, 1.0, 10.0, 11.0]));
    }

    let x = f(&[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let outs = run_op_on_ranks(LocalShard { world: 3 }.into(), &[vec![x.clone()], vec![x.clone()], vec![x]]);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o[0], f(&[2], &[2.0 * r as f64, 2.0 * r as f64 + 1.0]), "rank {r}");
    }
}

#[test]
fn collective_shape_rules_vjp_and_parse_errors() {
    let f = |s: &[usize]| TensorType::new(DType::F32, s);
    let cases: Vec<(Op, Vec<TensorType>, &str)> = vec![
        (
            AllReduce { op: ReduceOp::Sum, world: 2, tensors: 2 }.into(),
            vec![f(&[3])],
            "expects 2 inputs for a bucket of 2 tensors, got 1",
        ),
        (AllReduce { op: ReduceOp::Sum, world: 2, tensors: 0 }.into(), vec![], "a bucket needs at least one tensor"),
        (AllReduce { op: ReduceOp::Mean, world: 0, tensors: 1 }.into(), vec![f(&[3])], "world must be at least 1 rank"),
        (
            AllReduce { op: ReduceOp::Mean, world: 2, tensors: 1 }.into(),
            vec![TensorType::new(DType::I32, [3])],
            "tensor 0 must be a float tensor",
        ),
        (
            ReduceScatter { op: ReduceOp::Mean, world: 2, tensors: 2 }.into(),
            vec![f(&[4]), f(&[3, 1])],
            "tensor 1: f32[3,1] has 3 elements, which do not split into 2 equal shards",
        ),
        (
            AllGather { world: 2, tensors: 1 }.into(),
            vec![f(&[4]), f(&[3])],
            "shard 0 is f32[3], but destination 0 f32[4] over 2 ranks needs f32[2]",
        ),
        (AllGather { world: 2, tensors: 1 }.into(), vec![f(&[4])], "expects 2 inputs for a bucket of 1 tensors"),
        (
            LocalShard { world: 4 }.into(),
            vec![f(&[6])],
            "f32[6] has 6 elements, which do not split into 4 equal shards",
        ),
    ];
    for (op, types, want) in cases {
        let mut b = Builder::new("errors");
        let ids: Vec<ValueId> =
            types.iter().enumerate().map(|(i, t)| b.input(&format!("x{i}"), t.clone()).unwrap()).collect();
        let e = b.push(op.clone(), &ids).expect_err(op.name()).to_string();
        assert!(e.contains(op.name()) && e.contains(want), "{}: expected `{want}` in: {e}", op.name());
    }

    // Collectives come after autodiff: no VJP rule.
    let mut b = Builder::new("vjp");
    let x = b.input("x", f(&[4])).unwrap();
    let ys = b.all_reduce(ReduceOp::Mean, 2, &[x]).unwrap();
    let e = Op::from(AllReduce { op: ReduceOp::Mean, world: 2, tensors: 1 })
        .vjp(&mut b, &VjpArgs { inputs: &[x], outputs: &ys, cotangents: &[Some(x)] })
        .unwrap_err()
        .to_string();
    assert!(e.contains("`all_reduce_mean` is a collective") && e.contains("no VJP rule"), "{e}");
    let e = build_step(&b.finish("build").unwrap(), StepKind::Grads, &TrainOptions::default()).unwrap_err();
    assert!(e.to_string().contains("no loss"), "{e}");

    let good = "trace t\ninput %0: f32[4] x\n== forward ==\n%1: f32[4] = all_reduce_mean %0 {world=2, tensors=1}\n";
    parse(good).unwrap();
    for (bad, want) in [
        (good.replace(", tensors=1", ""), "missing attribute `tensors`"),
        (good.replace("world=2", "world=-2"), "attribute `world` must be non-negative"),
        (good.replace("tensors=1", "tensors=2"), "expects 2 inputs"),
        (good.replace("all_reduce_mean", "all_reduce_max"), "no such op"),
    ] {
        let e = parse(&bad).unwrap_err().to_string();
        assert!(e.contains(want), "expected `{want}` in: {e}");
    }
}

#[test]
fn rank_steps_run_the_same_planned_and_unplanned_eager_and_replayed() {
    // bf16 parameters with f32 AdamW moments: shards of two dtypes.
    let sp = spec(DType::BF16);
    let dp = DataParallel { zero1: true, bucket_bytes: 40_000, ..DataParallel::new(2) };
    let opts = TrainOptions { state_dtype: Some(DType::F32), ..TrainOptions::default() };
    let (_, fwd, step) = build_rank_step(&sp, StepKind::Train, &opts, &dp).unwrap();
    let m = step.leaf_by_name("lm_head.weight.exp_avg").unwrap();
    assert_eq!(step.ty(m).to_string(), "f32[8192]", "a half of f32[256,64]");
    let run = |reuse: bool, replay: bool| {
        run_ranks(2, |comm| {
            let rank = comm.rank();
            let p = plan(&step, PlanOptions { reuse, ..PlanOptions::default() })?;
            check_plan(&step, &p)?;
            let mut s = CpuSession::new(step.clone(), p)?;
            for (v, t) in init_params(&fwd, 7) {
                s.write_named(fwd.value(v).kind.leaf_name().unwrap(), &t)?;
            }
            for v in step.leaves().collect::<Vec<_>>() {
                if matches!(step.value(v).kind, ValueKind::State { .. }) {
                    s.write(v, &HostTensor::zeros(step.ty(v).clone()))?;
                }
            }
            s.set_comm(Arc::new(comm))?;
            let mut out = Vec::new();
            for it in 1..=3 {
                let (ids, tg) = global_batch(it);
                s.write_named(TOKENS_INPUT, &shard_rows(&ids, rank, 2)?)?;
                s.write_named(TARGETS_INPUT, &shard_rows(&tg, rank, 2)?)?;
                s.write_named(LR_INPUT, &scalar_input(LR))?;
                s.write_named(STEP_INPUT, &scalar_input(it as f64))?;
                if replay {
                    s.replay()?;
                } else {
                    s.run_eager()?;
                }
                out.push(s.read(step.loss().unwrap()));
            }
            for u in &step.updates {
                out.push(s.read(u.state));
            }
            Ok(out)
        })
        .unwrap()
    };
    let unplanned = run(false, false);
    assert_eq!(run(true, false), unplanned, "planned (in-place collectives) differs from unplanned");
    assert_eq!(run(true, true), unplanned, "replay differs from eager");
}
