//! A training run's program: the evaluation forward and the training step
//! in one trace over one memory plan, as generation's prefill and decode
//! buckets are ([`crate::models::generate`]), so validation adds only the
//! working set it needs beyond the training step's instead of a second
//! session with its own copy of the weights.
//!
//! The trace holds two segments, node ranges a session runs on its own
//! ([`crate::session::Session::run_nodes`],
//! [`crate::session::Session::replay_nodes`]):
//! 1. **the evaluation forward** ([`TrainProgram::eval`]): a compiled
//!    forward-only step whose parameters and frozen weights are the
//!    training step's own leaves, so it reads whatever the last training
//!    step left in their persistent storage. Its inputs are its own,
//!    `eval.{name}` for each input `{name}` of the forward step (token ids,
//!    targets, document positions), so writing a validation batch never
//!    touches the training batch; its loss is the output `eval.loss`
//!    ([`EVAL_LOSS_OUTPUT`]), and any other named output `{name}` becomes
//!    `eval.{name}`;
//! 2. **the training step** ([`TrainProgram::step`]), node for node as
//!    compiled, with its outputs and updates.
//!
//! The evaluation comes first because a trace's phases only go forward
//! (forward, backward, optimizer) and evaluation is all forward; the two
//! segments share no arena value, so their order in the trace says nothing
//! about when each runs.
//!
//! The plan is the whole trace's: the evaluation's activations live in arena
//! bytes that the training step's values leave free between steps. What the
//! program plans beyond the training step alone (its inputs, its loss, and
//! its working set where that exceeds the step's) is
//! [`TrainProgram::eval_extra_bytes`].

use std::ops::Range;

use crate::autodiff::StepKind;
use crate::error::{Error, Result};
use crate::ir::{Builder, OutputKind, Trace, ValueId, ValueKind};
use crate::pipeline::{compile_step, CompiledStep, StepOptions};
use crate::plan::{check_plan, plan, MemoryPlan, PlanOptions};

/// The output holding the evaluation segment's mean loss.
pub const EVAL_LOSS_OUTPUT: &str = "eval.loss";

/// Prefix of the evaluation segment's inputs and named outputs.
pub const EVAL_PREFIX: &str = "eval.";

/// The evaluation forward and the training step in one trace and one plan
/// (see the module doc).
#[derive(Clone, Debug)]
pub struct TrainProgram {
    pub trace: Trace,
    /// The plan of `trace`, proved by `check_plan`.
    pub plan: MemoryPlan,
    /// The evaluation segment's nodes.
    pub eval: Range<usize>,
    /// The training step's nodes.
    pub step: Range<usize>,
    /// The evaluation's loss ([`EVAL_LOSS_OUTPUT`]).
    pub eval_loss: ValueId,
    /// Planned bytes (persistent and arena) beyond the training step's own plan.
    pub eval_extra_bytes: u64,
}

impl TrainProgram {
    /// The input of the evaluation segment for the forward step's input `name`.
    pub fn eval_input(name: &str) -> String {
        format!("{EVAL_PREFIX}{name}")
    }
}

/// The forward-only step that evaluates beside `train`: compiled for its
/// spec, with its MLPs tiled as the step's are (so its working set stays
/// within the step's) and its frozen embedding where the step keeps it
/// (host memory under a budget).
pub fn evaluation_step(train: &CompiledStep) -> Result<CompiledStep> {
    let mut opts = StepOptions::new(StepKind::Forward);
    opts.plan.host_tables = train.plan.host_table_bytes > 0;
    opts.mlp_tiles = train.recompute().mlp_tiles;
    compile_step(&train.spec, &opts)
}

/// The program `train` runs with validation on: `step` joined by its
/// [`evaluation_step`], planned with `opts` ([`with_evaluation`]).
pub fn with_validation(step: &CompiledStep, opts: PlanOptions) -> Result<TrainProgram> {
    let eval = evaluation_step(step)?;
    with_evaluation(&step.step, &step.plan, &eval.step, opts)
}

/// Joins the forward-only step `eval` to the training step `step` (planned
/// as `step_plan`) into one program planned with `opts`, its frozen tables
/// in host memory where `step_plan` keeps them there (see the module doc).
/// Every weight `eval` reads must be a leaf of `step` of the same kind and
/// type, and `eval` may hold no optimizer state. Weights the step keeps in
/// host memory (the offload pass) come to the device for the evaluation's
/// reads as they do for forward's, one ahead.
pub fn with_evaluation(step: &Trace, step_plan: &MemoryPlan, eval: &Trace, opts: PlanOptions) -> Result<TrainProgram> {
    let refuse = |reason: String| Error::Plan(format!("joining the evaluation forward to the training step: {reason}"));
    let on_host = crate::plan::host_states(step);
    let hosted: std::collections::HashSet<ValueId> = eval
        .weights()
        .filter(|&v| {
            (eval.value(v).kind.leaf_name())
                .and_then(|name| step.leaf_by_name(name))
                .is_some_and(|own| on_host[own.index()])
        })
        .collect();
    let copied;
    let eval = match hosted.is_empty() {
        true => eval,
        false => {
            copied = crate::passes::offload::rewrite(eval, &hosted)?.0;
            &copied
        }
    };
    let mut b = Builder::new(step.name.clone());
    let mut step_map = b.copy_leaves(step)?;
    let mut eval_map: Vec<Option<ValueId>> = vec![None; eval.values.len()];
    for v in eval.leaves() {
        let value = eval.value(v);
        eval_map[v.index()] = Some(match &value.kind {
            ValueKind::Input { name } => b.input(&TrainProgram::eval_input(name), value.ty.clone())?,
            ValueKind::Param { name } | ValueKind::Frozen { name } => {
                let own = step
                    .leaf_by_name(name)
                    .ok_or_else(|| refuse(format!("the training step has no weight `{name}`")))?;
                let (theirs, ours) = (step.value(own), value);
                if std::mem::discriminant(&theirs.kind) != std::mem::discriminant(&ours.kind) || theirs.ty != ours.ty {
                    return Err(refuse(format!(
                        "weight `{name}` is {} {} in the training step and {} {} in the evaluation",
                        step.describe(own),
                        theirs.ty,
                        eval.describe(v),
                        ours.ty
                    )));
                }
                step_map[own.index()].expect("copy_leaves maps every leaf")
            }
            ValueKind::State { name } => return Err(refuse(format!("the evaluation holds optimizer state `{name}`"))),
            ValueKind::Node(_) => unreachable!("a leaf"),
        });
    }
    let push_all = |b: &mut Builder, from: &Trace, map: &mut [Option<ValueId>]| -> Result<()> {
        for node in &from.nodes {
            b.set_phase(node.phase);
            let inputs: Vec<ValueId> =
                node.inputs.iter().map(|i| map[i.index()].expect("nodes are in order: inputs first")).collect();
            let outs = b.push(node.op.clone(), &inputs)?;
            for (o, new) in node.outputs.iter().zip(outs) {
                map[o.index()] = Some(new);
            }
        }
        Ok(())
    };
    push_all(&mut b, eval, &mut eval_map)?;
    let eval_nodes = 0..b.trace().nodes.len();
    for o in &eval.outputs {
        let name = match &o.kind {
            OutputKind::Loss => EVAL_LOSS_OUTPUT.to_string(),
            OutputKind::Named(n) => format!("{EVAL_PREFIX}{n}"),
            OutputKind::Grad(_) => return Err(refuse("the evaluation outputs a gradient".into())),
        };
        b.output(OutputKind::Named(name), eval_map[o.value.index()].expect("outputs are defined"));
    }
    push_all(&mut b, step, &mut step_map)?;
    let step_nodes = eval_nodes.end..b.trace().nodes.len();
    // The step's outputs and updates, its name kept.
    let trace = b.finish_rewrite(step, &step_map, "evaluation")?;
    let eval_loss = trace
        .outputs
        .iter()
        .find(|o| o.kind == OutputKind::Named(EVAL_LOSS_OUTPUT.into()))
        .map(|o| o.value)
        .ok_or_else(|| refuse("the evaluation forward has no loss".into()))?;
    let opts = PlanOptions { host_tables: opts.host_tables || step_plan.host_table_bytes > 0, ..opts };
    let joint = plan(&trace, opts)?;
    check_plan(&trace, &joint)?;
    let eval_extra_bytes = joint.planned_peak_bytes().saturating_sub(step_plan.planned_peak_bytes());
    Ok(TrainProgram { trace, plan: joint, eval: eval_nodes, step: step_nodes, eval_loss, eval_extra_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::{LR_INPUT, STEP_INPUT};
    use crate::cpu::exec::{scalar_input, CpuSession};
    use crate::host::HostTensor;
    use crate::ir::DType;
    use crate::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
    use crate::models::hf_dir::NamedParams;
    use crate::models::{LossKind, ModelSpec};
    use crate::session::Session;
    use crate::testing::{random_batch, seeded_session};

    fn tiny(batch: usize) -> ModelSpec {
        ModelSpec::named("tiny-llama", batch, 8, DType::F32, LossKind::CrossEntropy).unwrap()
    }

    fn program(batch: usize) -> (CompiledStep, CompiledStep, TrainProgram) {
        let spec = tiny(batch);
        let train = compile_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
        let eval = evaluation_step(&train).unwrap();
        let p = with_evaluation(&train.step, &train.plan, &eval.step, PlanOptions::default()).unwrap();
        (train, eval, p)
    }

    #[test]
    fn the_evaluation_reads_the_training_weights_and_inputs_of_its_own() {
        let (train, eval, p) = program(2);
        assert_eq!(p.eval, 0..eval.step.nodes.len());
        assert_eq!(p.step, eval.step.nodes.len()..eval.step.nodes.len() + train.step.nodes.len());
        // The weights once, the step's inputs, and the evaluation's own.
        let leaves: Vec<&str> = p.trace.leaves().filter_map(|v| p.trace.value(v).kind.leaf_name()).collect();
        assert_eq!(leaves.len(), train.step.leaves().count() + eval.step.inputs().count());
        for name in [TOKENS_INPUT, TARGETS_INPUT] {
            assert!(leaves.contains(&name), "{name}");
            assert!(leaves.contains(&TrainProgram::eval_input(name).as_str()), "{name}");
        }
        // The step's loss stays the trace's loss; the evaluation's is named.
        assert_eq!(p.trace.outputs.iter().filter(|o| o.kind == OutputKind::Loss).count(), 1);
        assert!(p.trace.producer(p.eval_loss).is_some_and(|n| p.eval.contains(&n.index())));
        assert!(p.trace.producer(p.trace.loss().unwrap()).is_some_and(|n| p.step.contains(&n.index())));
        // No node of one segment reads a value a node of the other made.
        for (range, other) in [(&p.eval, &p.step), (&p.step, &p.eval)] {
            for node in &p.trace.nodes[range.clone()] {
                for &i in &node.inputs {
                    assert!(!p.trace.producer(i).is_some_and(|n| other.contains(&n.index())));
                }
            }
        }
    }

    #[test]
    fn validation_adds_only_its_inputs_when_its_working_set_fits_the_steps() {
        let (train, eval, p) = program(4);
        // A forward pass needs less arena than the step, and no weights of its own.
        assert!(eval.plan.arena_bytes < train.plan.arena_bytes);
        assert_eq!(p.plan.persistent_bytes, train.plan.persistent_bytes);
        let inputs: u64 = eval.step.inputs().map(|v| crate::plan::align_up(eval.step.ty(v).bytes())).sum();
        assert!(p.eval_extra_bytes <= inputs + crate::plan::ARENA_ALIGN, "{} > {inputs}", p.eval_extra_bytes);
        assert_eq!(p.eval_extra_bytes, p.plan.planned_peak_bytes() - train.plan.planned_peak_bytes());
    }

    /// Runs the training segment once on `batch` at step `it`.
    fn train_segment(s: &mut CpuSession, p: &TrainProgram, batch: &[(&str, HostTensor)], it: usize, replay: bool) {
        for (n, t) in batch {
            s.write_named(n, t).unwrap();
        }
        s.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
        s.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
        if replay {
            s.replay_nodes(p.step.clone()).unwrap();
        } else {
            s.run_nodes(p.step.clone()).unwrap();
        }
    }

    /// Runs the evaluation segment on `batch`; returns its loss.
    fn eval_segment(s: &mut CpuSession, p: &TrainProgram, batch: &[(&str, HostTensor)], replay: bool) -> f64 {
        for (n, t) in batch {
            s.write_named(&TrainProgram::eval_input(n), t).unwrap();
        }
        if replay {
            s.replay_nodes(p.eval.clone()).unwrap();
        } else {
            s.run_nodes(p.eval.clone()).unwrap();
        }
        Session::read(s, p.eval_loss).unwrap().to_f64()[0]
    }

    /// A step whose weights wait in host memory (the least budget of a
    /// short row): the evaluation reads them through copies of its own, the
    /// joint plan keeps them on the host, and both segments compute what
    /// the program whose weights stay on the device computes, bit for bit.
    #[test]
    fn weights_in_host_memory_come_to_the_device_for_the_evaluation_too() {
        use crate::passes::recompute::RecomputePolicy;
        use crate::plan::Region;
        let spec = tiny(2);
        let train = StepOptions::new(StepKind::Train);
        let least = match compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(1), ..train.clone() }) {
            Err(Error::MemoryBudget { least, .. }) => least,
            other => panic!("{:?}", other.map(|c| c.planned_peak_bytes())),
        };
        let offloaded =
            compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(least), ..train.clone() }).unwrap();
        assert!(offloaded.passes.offload.as_ref().is_some_and(|r| r.weights > 0));
        let kept = compile_step(&spec, &StepOptions { mlp_tiles: offloaded.recompute().mlp_tiles, ..train }).unwrap();
        let programs: Vec<(CompiledStep, TrainProgram)> = [offloaded, kept]
            .into_iter()
            .map(|c| {
                let eval = evaluation_step(&c).unwrap();
                let p = with_evaluation(&c.step, &c.plan, &eval.step, PlanOptions::default()).unwrap();
                (c, p)
            })
            .collect();
        let p = &programs[0].1;
        let hosted: Vec<ValueId> = p.trace.weights().filter(|&w| p.plan.slot(w).region == Region::Host).collect();
        assert!(!hosted.is_empty());
        for &w in &hosted {
            // Read by copies alone, the evaluation's among them.
            let readers: Vec<usize> =
                (0..p.trace.nodes.len()).filter(|&k| p.trace.nodes[k].inputs.contains(&w)).collect();
            assert!(readers.iter().all(|&k| matches!(p.trace.nodes[k].op, crate::ops::Op::HostCopy(_))));
            assert!(readers.iter().any(|k| p.eval.contains(k)), "{}", p.trace.describe(w));
        }
        let held_out = random_batch(&spec, 100);
        let run = |(c, p): &(CompiledStep, TrainProgram)| {
            let joint = CompiledStep { step: p.trace.clone(), plan: p.plan.clone(), ..c.clone() };
            let mut s = seeded_session(&joint, 7);
            let mut bits = Vec::new();
            for it in 1..=3 {
                train_segment(&mut s, p, &random_batch(&spec, it as u64), it, it > 1);
                bits.push(s.loss().unwrap().to_bits());
                bits.push(eval_segment(&mut s, p, &held_out, it > 1).to_bits());
            }
            bits
        };
        assert_eq!(run(&programs[0]), run(&programs[1]));
    }

    #[test]
    fn segments_compute_what_a_training_and_an_evaluation_session_compute_apart() {
        let spec = tiny(2);
        let (train, eval, p) = program(2);
        let joint = CompiledStep { step: p.trace.clone(), plan: p.plan.clone(), ..train.clone() };
        let mut s = seeded_session(&joint, 7);
        let mut alone = seeded_session(&train, 7);
        let held_out = random_batch(&spec, 100);
        for it in 1..=3 {
            let batch = random_batch(&spec, it as u64);
            train_segment(&mut s, &p, &batch, it, it > 1);
            for (n, t) in &batch {
                alone.write_named(n, t).unwrap();
            }
            alone.write_named(LR_INPUT, &scalar_input(1e-2)).unwrap();
            alone.write_named(STEP_INPUT, &scalar_input(it as f64)).unwrap();
            alone.run_eager().unwrap();
            // The training step is the same step, evaluation or not.
            assert_eq!(s.loss().unwrap().to_bits(), alone.loss().unwrap().to_bits(), "step {it}");
            // The evaluation of the weights the step left, as a session
            // of the forward step holding a copy of them computes it.
            let got = eval_segment(&mut s, &p, &held_out, it > 1);
            let mut fwd = seeded_session(&eval, 0);
            for v in eval.step.weights() {
                let name = eval.step.value(v).kind.leaf_name().unwrap();
                fwd.write_named(name, &alone.read_param(name).unwrap()).unwrap();
            }
            for (n, t) in &held_out {
                fwd.write_named(n, t).unwrap();
            }
            fwd.run_eager().unwrap();
            assert_eq!(got.to_bits(), fwd.loss().unwrap().to_bits(), "evaluation after step {it}");
        }
        // Evaluating changed nothing the training step keeps.
        for v in train.step.params() {
            let name = train.step.value(v).kind.leaf_name().unwrap();
            assert_eq!(s.read_param(name).unwrap(), alone.read_param(name).unwrap(), "{name}");
        }
    }

    #[test]
    fn a_forward_of_another_model_is_refused_by_name() {
        let train = compile_step(&tiny(2), &StepOptions::new(StepKind::Train)).unwrap();
        let mut wide = tiny(2);
        wide.config.intermediate_size *= 2;
        let eval = compile_step(&wide, &StepOptions::new(StepKind::Forward)).unwrap();
        let e = with_evaluation(&train.step, &train.plan, &eval.step, PlanOptions::default()).unwrap_err().to_string();
        assert!(e.contains("joining the evaluation forward to the training step: weight `"), "{e}");
    }
}
