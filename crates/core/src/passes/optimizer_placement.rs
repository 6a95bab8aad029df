//! Optimizer in backward: a train step's updates move from after backward
//! to right after each parameter's gradient is final, so gradients are never
//! all live at once (torchtune's optimizer-in-backward, PyTorch's
//! post-accumulate-grad hooks — here a reordering of one trace, planned).
//!
//! The pass owns where the optimizer-phase nodes run. Each one moves as
//! early as its dependencies allow: after the producers of its inputs (the
//! gradient, after its bucket's all-reduce in a data-parallel step) and
//! after every other node that reads a persistent value it updates in
//! place (a parameter's last read in backward). Updates that land inside
//! backward are labelled backward, so phases stay in order; the others stay
//! in the optimizer section. Nothing else moves, and the step computes the
//! same values: only the schedule, and so the plan, changes.
//!
//! Gradient clipping by global norm reads every gradient before any update
//! may run: with it the updates cannot move, and [`PlacementReport`] says
//! so and what it costs (every gradient live at the end of backward).

use std::collections::HashMap;

use serde::Serialize;

use super::{Pass, PassContext};
use crate::error::Result;
use crate::ir::{Builder, Phase, Trace, ValueId, ValueKind};
use crate::plan::{MemoryPlan, PlanOptions};

/// Where a train step's optimizer runs.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerPlacement {
    /// In backward unless that raises the planned peak.
    #[default]
    Auto,
    /// Each update right after its gradient is final.
    InBackward,
    /// Every update after backward (the textbook order).
    AfterBackward,
}

/// What the placement did.
#[derive(Clone, Debug, Serialize)]
pub struct PlacementReport {
    /// `in backward` or `after backward`.
    pub placement: String,
    /// Optimizer nodes that run inside backward.
    pub moved: usize,
    /// Optimizer nodes that still run after backward.
    pub after_backward: usize,
    pub planned_peak_after_backward: u64,
    pub planned_peak_in_backward: u64,
    /// Why updates could not move, when some could not.
    pub note: Option<String>,
}

impl std::fmt::Display for PlacementReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Both peaks are of the step before recomputation, which the
        // placement is chosen on; the recompute report gives the final one.
        let gb = |b: u64| b as f64 / 1e9;
        let (inside, after) = (self.planned_peak_in_backward, self.planned_peak_after_backward);
        write!(
            f,
            "optimizer {}: {} updates inside backward, {} after it; peak before recomputation {:.3} GB with \
             the updates in backward, {:.3} GB after it",
            self.placement,
            self.moved,
            self.after_backward,
            gb(inside),
            gb(after)
        )?;
        if inside == after {
            write!(f, " (the step peaks outside backward, where the updates make no difference)")?;
        }
        writeln!(f)?;
        if let Some(n) = &self.note {
            writeln!(f, "    {n}")?;
        }
        Ok(())
    }
}

/// The step with every optimizer-phase node moved as early as its
/// dependencies allow (see the module doc), and how many moved.
pub fn in_backward(step: &Trace) -> Result<(Trace, usize)> {
    let fixed: Vec<usize> = (0..step.nodes.len()).filter(|&i| step.nodes[i].phase != Phase::Optimizer).collect();
    let movable: Vec<usize> = (0..step.nodes.len()).filter(|&i| step.nodes[i].phase == Phase::Optimizer).collect();
    if movable.is_empty() {
        return Ok((step.clone(), 0));
    }
    // Position of each fixed node in the fixed sequence; -1 for none.
    let mut slot_of_node: HashMap<usize, isize> = fixed.iter().enumerate().map(|(k, &n)| (n, k as isize)).collect();
    let first_backward =
        fixed.iter().position(|&n| step.nodes[n].phase == Phase::Backward).map(|k| k as isize).unwrap_or(-1);
    // Readers of each value, for the in-place updates.
    let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for (ni, node) in step.nodes.iter().enumerate() {
        for &i in &node.inputs {
            readers.entry(i).or_default().push(ni);
        }
    }
    let updated_by: HashMap<ValueId, ValueId> = step.updates.iter().map(|u| (u.new, u.state)).collect();
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); fixed.len() + 1];
    for &m in &movable {
        let node = &step.nodes[m];
        let mut ready = first_backward.max(0);
        for &i in &node.inputs {
            if let ValueKind::Node(p) = step.value(i).kind {
                ready = ready.max(*slot_of_node.get(&p.index()).unwrap_or(&-1));
            }
        }
        for o in &node.outputs {
            if let Some(state) = updated_by.get(o) {
                for &r in readers.get(state).map(Vec::as_slice).unwrap_or(&[]) {
                    if r != m {
                        ready = ready.max(*slot_of_node.get(&r).unwrap_or(&-1));
                    }
                }
            }
        }
        let ready = ready.max(0) as usize;
        after[ready].push(m);
        // Later movable nodes that read this one's outputs land no earlier.
        slot_of_node.insert(m, ready as isize);
    }
    let mut order: Vec<(usize, Phase)> = Vec::with_capacity(step.nodes.len());
    let mut moved = 0;
    for (k, &n) in fixed.iter().enumerate() {
        order.push((n, step.nodes[n].phase));
        let inside = k + 1 < fixed.len();
        for &m in &after[k] {
            if inside {
                moved += 1;
            }
            order.push((m, if inside { Phase::Backward } else { Phase::Optimizer }));
        }
    }
    if fixed.is_empty() {
        order.extend(movable.iter().map(|&m| (m, Phase::Optimizer)));
    }

    let mut b = Builder::new(step.name.clone());
    let mut map = b.copy_leaves(step)?;
    let m = |map: &[Option<ValueId>], v: ValueId| map[v.index()].expect("defined before use");
    for (n, phase) in order {
        let node = &step.nodes[n];
        let inputs: Vec<ValueId> = node.inputs.iter().map(|&v| m(&map, v)).collect();
        b.set_phase(phase);
        let outs = b.push(node.op.clone(), &inputs)?;
        for (&o, v) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(v);
        }
    }
    Ok((b.finish_rewrite(step, &map, "optimizer_in_backward")?, moved))
}

/// Applies `placement` to `step`, planning with `opts`: the step to run,
/// its plan (the pipeline checks it), and the report.
pub fn apply(
    step: &Trace,
    placement: OptimizerPlacement,
    opts: PlanOptions,
) -> Result<(Trace, MemoryPlan, PlacementReport)> {
    let mut cx = PassContext::new(opts);
    let out = cx.run(&PlaceOptimizer(placement), step)?;
    let plan = cx.take_plan(&out)?;
    let report = cx.report.placement.take().expect("the pass reports its placement");
    Ok((out, plan, report))
}

/// The placement as a pass: it plans the step both ways, takes the one the
/// placement asks for, and leaves that one's plan in the context for the
/// next pass. The report says where the optimizer runs.
#[derive(Copy, Clone, Debug, Default)]
pub struct PlaceOptimizer(pub OptimizerPlacement);

impl Pass for PlaceOptimizer {
    fn name(&self) -> &'static str {
        "optimizer_placement"
    }

    fn run(&self, step: &Trace, cx: &mut PassContext) -> Result<Trace> {
        let placement = self.0;
        let optimizer_nodes = step.nodes.iter().filter(|n| n.phase == Phase::Optimizer).count();
        if optimizer_nodes > 0 && placement != OptimizerPlacement::AfterBackward {
            // Updates move into backward, across the segments of a trace run in them.
            cx.refuse_segments(self.name())?;
        }
        let after_plan = cx.take_plan(step)?;
        let after_peak = after_plan.planned_peak_bytes();
        if optimizer_nodes == 0 || placement == OptimizerPlacement::AfterBackward {
            cx.report.placement = Some(PlacementReport {
                placement: "after backward".into(),
                moved: 0,
                after_backward: optimizer_nodes,
                planned_peak_after_backward: after_peak,
                planned_peak_in_backward: after_peak,
                note: None,
            });
            cx.set_output_plan(after_plan);
            return Ok(step.clone());
        }
        let (moved_step, moved) = in_backward(step)?;
        let in_plan = cx.plan(&moved_step)?;
        let in_peak = in_plan.planned_peak_bytes();
        let stuck = optimizer_nodes - moved;
        // One update (the first layer's, or the embedding's) always waits for
        // the last backward node; more than that means something reads every
        // gradient first.
        let note = (stuck > 1).then(|| {
            let grads: u64 = gradient_bytes(step);
            format!(
                "{stuck} optimizer nodes run after the last backward node because they read values final only \
                 there (gradient clipping by global norm reads every gradient): up to {grads} B of gradients are \
                 live together at the end of backward"
            )
        });
        // A tie still favours backward: gradients no longer all live at the
        // end leave room that recomputation can then use. (Within a MiB: the
        // few scalars the updates share, such as clipping's factor, then live
        // through backward and may add their bytes to a peak they do not set.)
        let take = placement == OptimizerPlacement::InBackward || in_peak <= after_peak + TIE_BYTES;
        cx.report.placement = Some(PlacementReport {
            placement: if take { "in backward" } else { "after backward" }.into(),
            moved: if take { moved } else { 0 },
            after_backward: if take { stuck } else { optimizer_nodes },
            planned_peak_after_backward: after_peak,
            planned_peak_in_backward: in_peak,
            note,
        });
        if take {
            cx.set_output_plan(in_plan);
            Ok(moved_step)
        } else {
            cx.set_output_plan(after_plan);
            Ok(step.clone())
        }
    }
}

/// How much more a plan with the updates in backward may peak and still
/// count as a tie with the plan without.
const TIE_BYTES: u64 = 1 << 20;

/// Bytes of the gradients the optimizer reads (its non-leaf inputs made in backward).
fn gradient_bytes(step: &Trace) -> u64 {
    let mut seen = std::collections::HashSet::new();
    step.nodes
        .iter()
        .filter(|n| n.phase == Phase::Optimizer)
        .flat_map(|n| n.inputs.iter())
        .filter(|&&i| step.producer(i).is_some_and(|p| step.node(p).phase == Phase::Backward) && seen.insert(i))
        .map(|&i| step.ty(i).bytes())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::StepKind;
    use crate::ir::DType;
    use crate::models::{LossKind, ModelSpec};
    use crate::pipeline::{trace_step, StepOptions};
    use crate::plan::check_plan;

    fn train_step(seq: usize) -> Trace {
        let spec = ModelSpec::named("tiny-llama", 2, seq, DType::F32, LossKind::CrossEntropy).unwrap();
        trace_step(&spec, &StepOptions::new(StepKind::Train)).unwrap().step
    }

    #[test]
    fn updates_move_into_backward_and_the_peak_falls() {
        let s = train_step(8);
        let (t, p, r) = apply(&s, OptimizerPlacement::InBackward, PlanOptions::default()).unwrap();
        check_plan(&t, &p).unwrap();
        let adamw = s.nodes.iter().filter(|n| matches!(n.op, crate::ops::Op::AdamW(_))).count();
        assert_eq!(r.moved + r.after_backward, adamw, "{r}");
        assert!(r.moved >= adamw - 1, "{r}");
        assert!(r.planned_peak_in_backward < r.planned_peak_after_backward, "{r}");
        assert_eq!(t.nodes.len(), s.nodes.len());
        // Every update runs after every read of the parameter it overwrites.
        for u in &t.updates {
            let writer = t.producer(u.new).unwrap().index();
            for (k, node) in t.nodes.iter().enumerate() {
                if node.inputs.contains(&u.state) && k != writer {
                    assert!(k < writer, "node {k} reads {} after its update at {writer}", t.describe(u.state));
                }
            }
        }
        let (_, _, auto) = apply(&s, OptimizerPlacement::Auto, PlanOptions::default()).unwrap();
        assert_eq!(auto.placement, "in backward");
        let (same, _, off) = apply(&s, OptimizerPlacement::AfterBackward, PlanOptions::default()).unwrap();
        assert_eq!(same, s);
        assert_eq!(off.moved, 0);
    }

    #[test]
    fn steps_without_an_optimizer_are_unchanged() {
        let spec = ModelSpec::named("tiny-llama", 1, 8, DType::F32, LossKind::CrossEntropy).unwrap();
        let s = trace_step(&spec, &StepOptions::new(StepKind::Grads)).unwrap().step;
        let (t, _, r) = apply(&s, OptimizerPlacement::InBackward, PlanOptions::default()).unwrap();
        assert_eq!(t, s);
        assert_eq!(r.moved, 0);
    }

    #[test]
    fn training_in_backward_gives_the_same_weights_bit_for_bit() {
        use crate::cpu::exec::CpuSession;
        use crate::models::gpt::{TARGETS_INPUT, TOKENS_INPUT};
        use crate::models::init_params;
        use crate::session::Session;
        let spec = ModelSpec::named("tiny-llama", 2, 16, DType::F32, LossKind::CrossEntropy).unwrap();
        let traces = trace_step(&spec, &StepOptions::new(StepKind::Train)).unwrap();
        let mut results = Vec::new();
        for placement in [OptimizerPlacement::AfterBackward, OptimizerPlacement::InBackward] {
            let (t, p, _) = apply(&traces.step, placement, PlanOptions::default()).unwrap();
            let mut s = CpuSession::new(t.clone(), p).unwrap();
            for (v, value) in init_params(&traces.forward, 5) {
                let name = traces.forward.value(v).kind.leaf_name().unwrap().to_string();
                s.write_named(&name, &value).unwrap();
            }
            Session::zero_state(&mut s).unwrap();
            let ty = t.ty(t.leaf_by_name(TOKENS_INPUT).unwrap()).clone();
            let mut losses = Vec::new();
            for it in 0..3 {
                let ids: Vec<f64> = (0..ty.numel()).map(|i| ((i * 31 + it * 7 + 3) % 200) as f64).collect();
                let tg: Vec<f64> = (0..ty.numel()).map(|i| ((i * 17 + it * 5 + 1) % 200) as f64).collect();
                s.write_named(TOKENS_INPUT, &crate::host::HostTensor::from_f64(ty.clone(), &ids)).unwrap();
                s.write_named(TARGETS_INPUT, &crate::host::HostTensor::from_f64(ty.clone(), &tg)).unwrap();
                let lr = t.leaf_by_name(crate::autodiff::LR_INPUT).unwrap();
                s.write_named(crate::autodiff::LR_INPUT, &crate::host::HostTensor::from_f64(t.ty(lr).clone(), &[1e-2]))
                    .unwrap();
                let st = t.leaf_by_name(crate::autodiff::STEP_INPUT).unwrap();
                s.write_named(
                    crate::autodiff::STEP_INPUT,
                    &crate::host::HostTensor::from_f64(t.ty(st).clone(), &[(it + 1) as f64]),
                )
                .unwrap();
                Session::run_eager(&mut s).unwrap();
                losses.push(Session::loss(&mut s).unwrap().to_bits());
            }
            let weights: Vec<Vec<f64>> = t.params().map(|p| Session::read(&mut s, p).unwrap().to_f64()).collect();
            results.push((losses, weights));
        }
        assert_ne!(results[0].0[0], results[0].0[2], "the weights trained");
        assert_eq!(results[0].0, results[1].0);
        assert_eq!(results[0].1, results[1].1);
    }
}
