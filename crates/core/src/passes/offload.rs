//! Offload as a trace transform: forward values that backward reads wait
//! in page-locked host memory instead of device memory, between their
//! last forward reader and their first backward one.
//!
//! The pass owns *which* values go to the host and the rewrite that moves
//! them. For each chosen value `v` the rewrite emits `h = to_host(v)` right
//! after `v`'s producer and `v' = to_device(h)` one offloaded value ahead of
//! backward's first read of `v` (the first value at the start of
//! backward), and every backward reader of `v` reads `v'`. The copies are
//! ordinary nodes ([`crate::ops::offload::HostCopy`]): they print, are
//! planned (`h` in [`crate::plan::Region::Host`], with a lifetime),
//! checked by `check_plan` and captured like every other node; the CUDA
//! backend issues them on a copy stream, so they overlap the compute
//! around them. A value being copied out keeps its device bytes for
//! [`crate::plan::COPY_OUT_NODES`] nodes after the copy starts
//! ([`crate::plan::lifetimes`]), so the compute stream rarely waits for a
//! copy before writing over them.
//!
//! [`Offload`] runs after recomputation under a memory budget that
//! recomputation and MLP tiling cannot meet, and in place of the
//! recomputations that take longer than a round trip over the host link
//! (attention at long sequences; [`crate::pipeline`]): plan,
//! take the forward values live at the peak that backward reads, the kind
//! (op and type) with the most bytes there first, the earlier half of that
//! kind at a time (they live longest), and plan again, until the budget is
//! met; the half that meets it is then cut, by bisection, to the fewest of
//! its values that still do, as every value offloaded costs bus time on
//! every step. A kind whose offload does not lower the peak is put back and left
//! on the device. What cannot be met is refused
//! ([`Error::MemoryBudget`]) with the least planned peak reached.
//!
//! Optimizer states are candidates too (moments, 8-bit codes and scales,
//! master weights or compensations of a parameter): a state kept in host
//! memory is copied to the device one offloaded value ahead of its update
//! (`to_device`), updated there in place, and its new value copied back
//! over its host bytes (`to_host` into the state), which is the state's
//! update. The planner puts such a state in [`crate::plan::Region::Host`].
//! With the optimizer after backward (exact clipping), every update waits
//! for its copies, so the bus sets the optimizer's time; with the updates
//! in backward, the copies overlap backward's products.
//!
//! Weights are candidates last (parameters, and frozen weights under
//! adapters): such a weight lives in host memory and is copied to the
//! device twice per step, one offloaded weight ahead of forward's first
//! read of it and again ahead of backward's, so a layer's weights are on
//! the device only while forward or backward is in that layer; a
//! parameter's update runs on the backward copy, and its new value goes
//! back over its host bytes as a state's does. Views of a weight (a fused
//! projection's parts) are made again on each copy.
//!
//! Bytes move twice per offloaded value and step (out and back; a frozen
//! weight in twice), three times per offloaded parameter (in twice, out
//! once): the report gives that traffic, and the host bytes the plan
//! holds. Kinds that move fewer bytes per byte saved go first: values and
//! states before weights.
//!
//! **Invariant:** the transformed step computes the same values as the
//! original, bit for bit: a copy moves bytes and nothing else.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use super::{Pass, PassContext};
use crate::error::{Error, Result};
use crate::ir::{Builder, Phase, Trace, ValueId, ValueKind};
use crate::plan::Region;

/// What the pass moved.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OffloadReport {
    /// Values kept in host memory (the optimizer states and weights among
    /// them).
    pub values: usize,
    pub states: usize,
    pub weights: usize,
    /// Bytes copied per step, both directions together.
    pub bytes_moved: u64,
    /// The planned peak (device) before and after.
    pub planned_peak_before: u64,
    pub planned_peak_after: u64,
    /// Page-locked host bytes of the plan after the pass (tables included).
    pub host_bytes: u64,
    /// The offloaded values by kind: `(op -> type, count, bytes each)`.
    pub kinds: Vec<(String, usize, u64)>,
}

impl std::fmt::Display for OffloadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.values == 0 {
            return Ok(());
        }
        writeln!(
            f,
            "offload: {} values ({} of them optimizer states, {} weights) to page-locked host memory and back, {:.3} GB copied per step; planned peak {} -> {} B, host {} B",
            self.values,
            self.states,
            self.weights,
            self.bytes_moved as f64 / 1e9,
            self.planned_peak_before,
            self.planned_peak_after,
            self.host_bytes
        )?;
        for (kind, count, bytes) in &self.kinds {
            writeln!(f, "    {count:>4} × {kind}  ({bytes} B each)")?;
        }
        Ok(())
    }
}

/// Rewrites `step` so that each value of `offloaded` (forward values that
/// backward reads, never leaves; optimizer states; weights) waits on the
/// host (see the module doc). Returns the new step and, for each node of
/// `step`, its index in the new one.
pub fn rewrite(step: &Trace, offloaded: &HashSet<ValueId>) -> Result<(Trace, Vec<usize>)> {
    // Forward reads a weight through its forward copy; everything after
    // forward reads an offloaded value through its backward copy.
    let weights: HashSet<ValueId> = offloaded.iter().copied().filter(|&v| is_weight(step, v)).collect();
    let forward_first = first_reads(step, true, &weights);
    let backward_first = first_reads(step, false, offloaded);
    let backward_start = step.nodes.iter().position(|n| n.phase != Phase::Forward).unwrap_or(step.nodes.len());
    let forward_reload = one_ahead(step, &forward_first, 0);
    let backward_reload = one_ahead(step, &backward_first, backward_start);

    // The new value of each offloaded state or parameter, and the leaf.
    let updated_state: HashMap<ValueId, ValueId> = step
        .updates
        .iter()
        .filter(|u| offloaded.contains(&u.state) && backward_first.contains_key(&u.state))
        .map(|u| (u.new, u.state))
        .collect();
    let mut b = Builder::new(step.name.clone());
    let mut map = b.copy_leaves(step)?;
    let mut on_host: HashMap<ValueId, ValueId> = HashMap::new();
    // Original value -> what forward (for weights) and what backward read
    // for it: the copy of an offloaded value, and views of it made again on
    // that copy.
    let (mut forward_copy, mut back): (HashMap<ValueId, ValueId>, HashMap<ValueId, ValueId>) = Default::default();
    let mut moved = Vec::with_capacity(step.nodes.len());
    for (pos, node) in step.nodes.iter().enumerate() {
        b.set_phase(node.phase);
        for &v in forward_reload.get(&pos).into_iter().flatten() {
            forward_copy.insert(v, b.host_copy(map[v.index()].expect("leaves are copied first"), false)?);
        }
        for &v in backward_reload.get(&pos).into_iter().flatten() {
            // A leaf is its own host copy; a forward value was copied out.
            let src = match step.value(v).kind.is_leaf() {
                true => map[v.index()].expect("leaves are copied first"),
                false => on_host[&v],
            };
            back.insert(v, b.host_copy(src, false)?);
        }
        let forward = node.phase == Phase::Forward;
        let (reads, copies) = if forward { (&weights, &mut forward_copy) } else { (offloaded, &mut back) };
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &i in &node.inputs {
            let read = match forward && !weights.contains(&storage_root(step, i)) {
                true => map[i.index()].expect("defined before use"),
                false => reread(step, i, reads, &mut b, &map, copies)?,
            };
            inputs.push(read);
        }
        moved.push(b.trace().nodes.len());
        let outs = b.push(node.op.clone(), &inputs)?;
        for (&o, n) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(n);
            // A view of a copy, made here, serves the later readers too.
            if node.op.view_of().is_some() && reads.contains(&storage_root(step, o)) {
                copies.insert(o, n);
            }
            if offloaded.contains(&o) && backward_first.contains_key(&o) {
                on_host.insert(o, b.host_copy(n, true)?);
            }
            // An offloaded state's (or parameter's) new value goes back over its host bytes.
            if let Some(&state) = updated_state.get(&o) {
                let into = b.host_copy_into(map[state.index()].expect("leaves are copied first"), n)?;
                map[o.index()] = Some(into);
            }
        }
    }
    Ok((b.finish_rewrite(step, &map, "offload")?, moved))
}

/// Whether `v` is a weight: a parameter or a frozen weight.
fn is_weight(step: &Trace, v: ValueId) -> bool {
    matches!(step.value(v).kind, ValueKind::Param { .. } | ValueKind::Frozen { .. })
}

/// The first read of each value of `of`, directly or through a view, by a
/// forward node (`forward`) or by a node after forward.
fn first_reads(step: &Trace, forward: bool, of: &HashSet<ValueId>) -> HashMap<ValueId, usize> {
    let mut first: HashMap<ValueId, usize> = HashMap::new();
    for (pos, node) in step.nodes.iter().enumerate().filter(|(_, n)| (n.phase == Phase::Forward) == forward) {
        for &i in &node.inputs {
            let root = storage_root(step, i);
            if of.contains(&root) {
                first.entry(root).or_insert(pos);
            }
        }
    }
    first
}

/// Where each value comes back, one ahead: when the one read before it is
/// first read, the first at `start`; never before it was written.
fn one_ahead(step: &Trace, first: &HashMap<ValueId, usize>, start: usize) -> HashMap<usize, Vec<ValueId>> {
    let mut order: Vec<(usize, ValueId)> = first.iter().map(|(&v, &p)| (p, v)).collect();
    order.sort();
    let mut reload_at: HashMap<usize, Vec<ValueId>> = HashMap::new();
    for (k, &(_, v)) in order.iter().enumerate() {
        let ahead = if k == 0 { start } else { order[k - 1].0 };
        let written = step.producer(v).map_or(0, |p| p.index() + 1);
        reload_at.entry(ahead.max(written)).or_default().push(v);
    }
    reload_at
}

/// The value whose bytes `v` is: `v`, or the source of the views it is made by.
fn storage_root(step: &Trace, mut v: ValueId) -> ValueId {
    while let Some(p) = step.producer(v) {
        match step.node(p).op.view_of() {
            Some(k) => v = step.node(p).inputs[k],
            None => break,
        }
    }
    v
}

/// What backward reads for the original value `v`: the copy back of an
/// offloaded value, a view of such a copy made again (the same view op on
/// the copy), or the forward value itself.
fn reread(
    step: &Trace,
    v: ValueId,
    offloaded: &HashSet<ValueId>,
    b: &mut Builder,
    map: &[Option<ValueId>],
    back: &mut HashMap<ValueId, ValueId>,
) -> Result<ValueId> {
    if let Some(&r) = back.get(&v) {
        return Ok(r);
    }
    if !offloaded.contains(&storage_root(step, v)) {
        return Ok(map[v.index()].expect("defined before use"));
    }
    let p = step.producer(v).expect("an offloaded value's view has a producer");
    let node = step.node(p);
    let source = node.op.view_of().expect("a value over offloaded bytes is a view");
    let mut inputs = Vec::with_capacity(node.inputs.len());
    for (k, &i) in node.inputs.iter().enumerate() {
        inputs.push(if k == source {
            reread(step, i, offloaded, b, map, back)?
        } else {
            map[i.index()].expect("defined before use")
        });
    }
    let outs = b.push(node.op.clone(), &inputs)?;
    for (&o, n) in node.outputs.iter().zip(outs) {
        back.insert(o, n);
    }
    Ok(back[&v])
}

/// Values of `step` the pass may offload: written by a forward node that
/// is not a view, read by backward (directly or through views), no step
/// output and no update; optimizer states that only backward or the
/// optimizer read, whose new value nothing reads; and weights that some
/// node reads, a parameter's new value read by nothing and written after
/// forward.
fn candidates(step: &Trace) -> Vec<ValueId> {
    let mut read_forward: HashSet<ValueId> = HashSet::new();
    let mut read: HashSet<ValueId> = HashSet::new();
    for node in &step.nodes {
        read.extend(node.inputs.iter().copied());
        if node.phase == Phase::Forward {
            read_forward.extend(node.inputs.iter().copied());
        }
    }
    let update_runs_after_forward = |u: &crate::ir::Update| {
        !read.contains(&u.new) && step.producer(u.new).is_some_and(|p| step.node(p).phase != Phase::Forward)
    };
    let states = step.updates.iter().filter(|u| {
        matches!(step.value(u.state).kind, ValueKind::State { .. })
            && read.contains(&u.state)
            && !read_forward.contains(&u.state)
            && update_runs_after_forward(u)
    });
    let mut all: Vec<ValueId> = states.map(|u| u.state).collect();
    all.extend(forward_candidates(step));
    let outputs: HashSet<ValueId> = step.outputs.iter().map(|o| storage_root(step, o.value)).collect();
    all.extend(step.leaves().filter(|&v| {
        is_weight(step, v)
            && read.contains(&v)
            && step.ty(v).bytes() > 0
            && !outputs.contains(&v)
            && step.updates.iter().filter(|u| u.state == v).all(update_runs_after_forward)
    }));
    all
}

/// Bytes copied per step for each byte of `v` kept in host memory: out and
/// back for a forward value or a state, in twice for a frozen weight, in
/// twice and out once for a parameter.
fn copies_per_step(step: &Trace, v: ValueId) -> u64 {
    match step.value(v).kind {
        ValueKind::Param { .. } => 3,
        _ => 2,
    }
}

/// The forward values among [`candidates`].
fn forward_candidates(step: &Trace) -> Vec<ValueId> {
    let mut read_back: HashSet<ValueId> = HashSet::new();
    for node in step.nodes.iter().filter(|n| n.phase != Phase::Forward) {
        read_back.extend(node.inputs.iter().map(|&i| storage_root(step, i)));
    }
    let pinned: HashSet<ValueId> = step
        .outputs
        .iter()
        .map(|o| storage_root(step, o.value))
        .chain(step.updates.iter().map(|u| storage_root(step, u.new)))
        .collect();
    step.value_ids()
        .filter(|v| read_back.contains(v) && !pinned.contains(v) && step.ty(*v).bytes() > 0)
        .filter(|&v| {
            step.producer(v).is_some_and(|p| {
                let node = step.node(p);
                node.phase == Phase::Forward && node.op.view_of().is_none() && !node.op.output_on_host()
            })
        })
        .collect()
}

/// Op and type: what makes two layers' values "the same"; for a state,
/// its kind (`exp_avg`, ...) and type; for a weight, its module and name
/// within the layer (`mlp.down_proj.weight`) and type.
fn kind(step: &Trace, v: ValueId) -> String {
    match step.producer(v) {
        Some(p) => format!("{} -> {}", step.node(p).op.name(), step.ty(v)),
        None => {
            let name = step.value(v).kind.leaf_name().unwrap_or_default();
            let mut parts = name.rsplit('.');
            match step.value(v).kind {
                ValueKind::State { .. } => format!("state {} -> {}", parts.next().unwrap_or(name), step.ty(v)),
                _ => {
                    // The last three name parts: `self_attn.q_proj.weight`, and for
                    // one-off weights (`model.embed_tokens.weight`) the whole.
                    let tail: Vec<&str> = parts.by_ref().take(3).collect();
                    let within = tail.into_iter().rev().collect::<Vec<_>>().join(".");
                    format!("weight {within} -> {}", step.ty(v))
                }
            }
        }
    }
}

/// Offloads until the planned peak is at most `budget` (see the module doc).
#[derive(Copy, Clone, Debug)]
pub struct Offload(pub u64);

impl Pass for Offload {
    fn name(&self) -> &'static str {
        "offload"
    }

    fn run(&self, step: &Trace, cx: &mut PassContext) -> Result<Trace> {
        let budget = self.0;
        let base_plan = cx.take_plan(step)?;
        let before = base_plan.planned_peak_bytes();
        if before <= budget {
            cx.report.offload = Some(OffloadReport {
                planned_peak_before: before,
                planned_peak_after: before,
                host_bytes: base_plan.host_bytes,
                ..Default::default()
            });
            cx.set_output_plan(base_plan);
            return Ok(step.clone());
        }
        cx.refuse_segments(self.name())?;
        // Frozen tables the plan already keeps in host memory stay there.
        let all: Vec<ValueId> =
            candidates(step).into_iter().filter(|&v| base_plan.slot(v).region != Region::Host).collect();
        let mut chosen: HashSet<ValueId> = HashSet::new();
        let mut rejected: HashSet<String> = HashSet::new();
        let mut current = (step.clone(), base_plan, (0..step.nodes.len()).collect::<Vec<usize>>());
        loop {
            let (_, ref p, ref moved) = current;
            if p.planned_peak_bytes() <= budget {
                break;
            }
            // Candidates (original ids) live at the current peak, found
            // through the node each original node became in the rewrite.
            let peak = p.peak_position;
            let live: Vec<ValueId> = all
                .iter()
                .copied()
                .filter(|v| !chosen.contains(v) && !rejected.contains(&kind(step, *v)))
                .filter(|&v| {
                    // A state on the device is live throughout.
                    if step.value(v).kind.is_leaf() {
                        return true;
                    }
                    let cv = current_value(step, &current.0, moved, v);
                    let g = &p.groups[p.group_of[cv.index()]];
                    g.region == Region::Arena && g.start <= peak && peak <= g.end
                })
                .collect();
            let mut by_kind: HashMap<String, (u64, Vec<ValueId>)> = HashMap::new();
            for &v in &live {
                let e = by_kind.entry(kind(step, v)).or_default();
                e.0 += step.ty(v).bytes();
                e.1.push(v);
            }
            // Fewest copies per byte saved first, then the most bytes at the peak.
            let cost = |same: &[ValueId]| copies_per_step(step, same[0]);
            let Some((key, (_, mut same))) = by_kind
                .into_iter()
                .max_by(|a, b| cost(&b.1 .1).cmp(&cost(&a.1 .1)).then(a.1 .0.cmp(&b.1 .0)).then_with(|| b.0.cmp(&a.0)))
            else {
                return Err(Error::MemoryBudget {
                    budget,
                    least: current.1.planned_peak_bytes(),
                    mlp_tiles: 1,
                    hint: None,
                });
            };
            // Forward values by producer; leaves in trace order.
            same.sort_by_key(|&v| (step.producer(v), v));
            let previous = chosen.clone();
            let half = same.len().div_ceil(2);
            chosen.extend(same.iter().take(half).copied());
            let (new, new_moved) = rewrite(step, &chosen)?;
            let new_plan = cx.plan(&new)?;
            if new_plan.planned_peak_bytes() >= current.1.planned_peak_bytes() {
                chosen = previous;
                rejected.insert(key);
                continue;
            }
            current = (new, new_plan, new_moved);
            if current.1.planned_peak_bytes() <= budget && half > 1 {
                // The half met the budget: the fewest of it that still do
                // (each moves bytes every step), by bisection. Fewer of
                // them never lower the peak more, so the search is exact
                // up to the plan's placement.
                let (mut lo, mut hi) = (1, half);
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    let mut fewer = previous.clone();
                    fewer.extend(same.iter().take(mid).copied());
                    let (t, moved) = rewrite(step, &fewer)?;
                    let plan = cx.plan(&t)?;
                    if plan.planned_peak_bytes() <= budget {
                        (hi, chosen, current) = (mid, fewer, (t, plan, moved));
                    } else {
                        lo = mid + 1;
                    }
                }
            }
        }
        let (t, p, moved) = current;
        // Reports of earlier passes name nodes of the step they left.
        if let Some(r) = cx.report.recompute.as_mut() {
            for n in &mut r.recomputed {
                n.node = moved[n.node];
            }
        }
        let mut kinds: Vec<(String, usize, u64)> = Vec::new();
        let mut sorted: Vec<ValueId> = chosen.iter().copied().collect();
        sorted.sort();
        for v in &sorted {
            let (k, bytes) = (kind(step, *v), step.ty(*v).bytes());
            match kinds.iter_mut().find(|e| e.0 == k) {
                Some(e) => e.1 += 1,
                None => kinds.push((k, 1, bytes)),
            }
        }
        cx.report.offload = Some(OffloadReport {
            values: chosen.len(),
            states: chosen.iter().filter(|&&v| matches!(step.value(v).kind, ValueKind::State { .. })).count(),
            weights: chosen.iter().filter(|&&v| is_weight(step, v)).count(),
            bytes_moved: chosen.iter().map(|&v| copies_per_step(step, v) * step.ty(v).bytes()).sum::<u64>(),
            planned_peak_before: before,
            planned_peak_after: p.planned_peak_bytes(),
            host_bytes: p.host_bytes,
            kinds,
        });
        cx.set_output_plan(p);
        Ok(t)
    }
}

/// The value of `current` (a rewrite of `step` whose node `k` became node
/// `moved[k]`) that holds original value `v`.
fn current_value(step: &Trace, current: &Trace, moved: &[usize], v: ValueId) -> ValueId {
    let p = step.producer(v).expect("candidates have producers");
    let out = step.node(p).outputs.iter().position(|&o| o == v).expect("an output of its producer");
    current.nodes[moved[p.index()]].outputs[out]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::StepKind;
    use crate::ir::DType;
    use crate::models::{LossKind, ModelSpec};
    use crate::passes::recompute::RecomputePolicy;
    use crate::pipeline::{compile_step, StepOptions};
    use crate::plan::check_plan;
    use crate::session::Session;

    /// A tiny model over a long row: per-layer checkpoints, not weights,
    /// make the least peak, as at long context.
    fn spec() -> ModelSpec {
        let o = crate::models::Overrides { n_layer: Some(8), block_size: Some(2048), ..Default::default() };
        let config = crate::models::Config::named("tiny-llama").unwrap().with_overrides(&o).unwrap();
        ModelSpec {
            config,
            batch: 1,
            seq: 2048,
            dtype: DType::F32,
            loss: LossKind::CrossEntropy,
            adapters: None,
            documents: false,
        }
    }

    /// The least planned peak of `opts` for [`spec`].
    fn least(opts: &StepOptions) -> u64 {
        least_of(&spec(), opts)
    }

    /// Three training steps of `c` from seeded weights on seeded batches
    /// (eager, then replayed): each loss, then every updated state and
    /// parameter.
    fn trained(c: &crate::pipeline::CompiledStep) -> Vec<Vec<f64>> {
        let mut s = crate::testing::seeded_session(c, 5);
        let mut out = Vec::new();
        for step in 0..3u64 {
            for (n, t) in crate::testing::random_batch(&c.spec, 10 + step) {
                s.write_named(n, &t).unwrap();
            }
            s.write_named(crate::autodiff::LR_INPUT, &crate::cpu::exec::scalar_input(1e-2)).unwrap();
            s.write_named(crate::autodiff::STEP_INPUT, &crate::cpu::exec::scalar_input((step + 1) as f64)).unwrap();
            if step == 0 {
                Session::run_eager(&mut s).unwrap();
            } else {
                Session::replay(&mut s).unwrap();
            }
            out.push(vec![Session::loss(&mut s).unwrap()]);
        }
        for u in &c.step.updates {
            out.push(Session::read(&mut s, u.state).unwrap().to_f64());
        }
        out
    }

    /// The least planned peak of `opts` for `spec` under an impossible budget.
    fn least_of(spec: &ModelSpec, opts: &StepOptions) -> u64 {
        match compile_step(spec, &StepOptions { recompute: RecomputePolicy::Budget(1), ..opts.clone() }) {
            Err(Error::MemoryBudget { least, .. }) => least,
            other => panic!("no step fits in 1 byte: {:?}", other.map(|c| c.planned_peak_bytes())),
        }
    }

    #[test]
    fn a_budget_recomputation_cannot_meet_is_met_by_offload_and_refused_without_it() {
        let train = StepOptions::new(StepKind::Grads);
        let kept = least(&StepOptions { offload: false, ..train.clone() });
        let offloaded = least(&train);
        assert!(offloaded < kept, "offload lowers the least peak: {offloaded} vs {kept}");
        let c = compile_step(&spec(), &StepOptions { recompute: RecomputePolicy::Budget(offloaded), ..train.clone() })
            .unwrap();
        check_plan(&c.step, &c.plan).unwrap();
        assert!(c.planned_peak_bytes() <= offloaded);
        let r = c.passes.offload.as_ref().expect("the offload pass ran");
        assert!(r.values > 0 && r.bytes_moved > 0 && r.host_bytes > 0, "{r}");
        assert_eq!(r.host_bytes, c.plan.host_bytes);
        let copies = |to_host: bool| {
            c.step.nodes.iter().filter(|n| matches!(&n.op, crate::ops::Op::HostCopy(h) if h.to_host == to_host)).count()
        };
        // Out once and back once per value, into nothing (no update in a
        // gradient step); a weight comes in for forward and for backward.
        assert_eq!((copies(true), copies(false)), (r.values - r.weights, r.values + r.weights));
        // The recomputation's report names nodes of the offloaded step.
        assert!(!c.recompute().recomputed.is_empty());
        for n in &c.recompute().recomputed {
            let node = &c.step.nodes[n.node];
            assert!(node.op.name() == n.op && node.phase == Phase::Backward, "{}", c.recompute());
        }
        // Every copy's output sits where its direction says.
        for node in &c.step.nodes {
            if let crate::ops::Op::HostCopy(h) = &node.op {
                let region = c.plan.slot(node.outputs[0]).region;
                assert_eq!(region == Region::Host, h.to_host, "{}", c.step.describe(node.outputs[0]));
            }
        }
        let refused = compile_step(
            &spec(),
            &StepOptions { recompute: RecomputePolicy::Budget(offloaded), offload: false, ..train },
        );
        assert!(matches!(refused, Err(Error::MemoryBudget { .. })), "{:?}", refused.map(|c| c.planned_peak_bytes()));
    }

    #[test]
    fn offloaded_steps_compute_bit_for_bit_what_steps_that_keep_their_values_compute() {
        let grads = StepOptions::new(StepKind::Grads);
        let offloaded =
            compile_step(&spec(), &StepOptions { recompute: RecomputePolicy::Budget(least(&grads)), ..grads.clone() })
                .unwrap();
        assert!(offloaded.passes.offload.as_ref().is_some_and(|r| r.values > 0));
        // The same MLP tiling (tiles sum their weight gradients in their
        // own order), every value kept on the device.
        let tiles = offloaded.recompute().mlp_tiles;
        let kept = compile_step(&spec(), &StepOptions { mlp_tiles: tiles, ..grads }).unwrap();
        assert!(kept.passes.offload.is_none());
        assert_same_gradients(&kept, &offloaded);
    }

    /// Three gradient steps of `a` and of `b` from the same seeded weights
    /// on the same batches (eager, then the recorded launch list, "replay")
    /// give the same losses and gradients, bit for bit.
    fn assert_same_gradients(a: &crate::pipeline::CompiledStep, b: &crate::pipeline::CompiledStep) {
        let run = |c: &crate::pipeline::CompiledStep| {
            let mut s = crate::testing::seeded_session(c, 5);
            let mut losses = Vec::new();
            for step in 0..3 {
                for (n, t) in crate::testing::random_batch(&c.spec, 10 + step) {
                    s.write_named(n, &t).unwrap();
                }
                if step == 0 {
                    Session::run_eager(&mut s).unwrap();
                } else {
                    Session::replay(&mut s).unwrap();
                }
                losses.push(Session::loss(&mut s).unwrap().to_bits());
            }
            (losses, crate::testing::grads_by_name(&c.step, |v| Session::read(&mut s, v).unwrap().to_f64()))
        };
        let (a, b) = (run(a), run(b));
        assert_eq!(a.0, b.0, "losses");
        assert_eq!(a.1.keys().collect::<Vec<_>>(), b.1.keys().collect::<Vec<_>>());
        for (name, g) in &a.1 {
            assert!(g == &b.1[name], "the gradient of {name} differs");
        }
    }

    /// Whether `c` recomputes attention, and whether it keeps attention
    /// outputs in host memory.
    fn attention_recomputed_and_offloaded(c: &crate::pipeline::CompiledStep) -> (bool, bool) {
        let recomputed = c.recompute().recomputed.iter().any(|r| r.op == "attention");
        let offloaded = c.passes.offload.as_ref().is_some_and(|o| o.kinds.iter().any(|k| k.0.starts_with("attention")));
        (recomputed, offloaded)
    }

    /// With a bus faster than recomputing attention (and slower than
    /// recomputing the rest), attention's outputs wait in host memory while
    /// the cheaper values are still recomputed; the step computes the same
    /// bits as one that keeps every value.
    #[test]
    fn what_recomputes_slower_than_the_bus_is_offloaded_instead_and_computes_the_same_bits() {
        // f32 at 2048 tokens: attention's recomputation takes about 2e-11 s
        // per byte it frees at the roofline, the tiny model's products and
        // pointwise ops under 2e-12; a round trip at 400 GB/s takes 5e-12.
        let grads = StepOptions { bus_bytes_per_s: 400_000_000_000, ..StepOptions::new(StepKind::Grads) };
        let least = least_of(&spec(), &grads);
        let budget = StepOptions { recompute: RecomputePolicy::Budget(least), ..grads.clone() };
        let c = compile_step(&spec(), &budget).unwrap();
        check_plan(&c.step, &c.plan).unwrap();
        assert!(c.planned_peak_bytes() <= least);
        assert_eq!(attention_recomputed_and_offloaded(&c), (false, true), "{}", c.recompute());
        assert!(!c.recompute().recomputed.is_empty(), "the cheaper values are still recomputed");
        // At a slower bus the same budget recomputes attention.
        let slow = StepOptions { bus_bytes_per_s: 1_000_000_000, ..budget };
        let first = compile_step(&spec(), &slow).unwrap();
        assert!(attention_recomputed_and_offloaded(&first).0, "{}", first.recompute());
        let kept = compile_step(&spec(), &StepOptions { mlp_tiles: c.recompute().mlp_tiles, ..grads }).unwrap();
        assert_same_gradients(&kept, &c);
    }

    /// At a sequence where recomputing attention takes longer than a round
    /// trip at the planner's bus speed, a budget makes `compile_step` keep
    /// attention's outputs in host memory rather than recompute them, within
    /// the host budget; below what that needs, it recomputes them.
    #[test]
    fn long_sequences_offload_attention_rather_than_recompute_it_within_the_host_budget() {
        // f32 at 8192 tokens: recomputing attention takes 8e-11 s per byte
        // it frees, a round trip at 50 GB/s 4e-11.
        let o = crate::models::Overrides { n_layer: Some(4), block_size: Some(8192), ..Default::default() };
        let config = crate::models::Config::named("tiny-llama").unwrap().with_overrides(&o).unwrap();
        let long = ModelSpec { config, seq: 8192, ..spec() };
        let grads = StepOptions::new(StepKind::Grads);
        let budget = StepOptions { recompute: RecomputePolicy::Budget(least_of(&long, &grads)), ..grads };
        let chosen = compile_step(&long, &budget).unwrap();
        assert_eq!(attention_recomputed_and_offloaded(&chosen), (false, true), "{}", chosen.recompute());
        let tight = StepOptions { host_budget: Some(chosen.plan.host_bytes - 1), ..budget };
        let recomputing = compile_step(&long, &tight).unwrap();
        assert!(attention_recomputed_and_offloaded(&recomputing).0, "{}", recomputing.recompute());
        assert!(recomputing.plan.host_bytes < chosen.plan.host_bytes);
        let why = recomputing.recompute().not_offloaded.as_deref().unwrap_or_default();
        assert!(why.contains("page-locked host memory") && why.contains("STEPGRAPH_HOST_MEMORY_LIMIT"), "{why}");
        assert!(recomputing.recompute().to_string().contains(why));
        assert!(chosen.recompute().not_offloaded.is_none());
    }

    /// A short row of a tiny model: its weights and optimizer state, not
    /// its activations, make the least peak, so the states go to the host.
    #[test]
    fn optimizer_states_wait_in_host_memory_and_train_bit_for_bit() {
        let spec = ModelSpec::named("tiny-llama", 2, 16, DType::F32, LossKind::CrossEntropy).unwrap();
        let train = StepOptions::new(StepKind::Train);
        let kept_least = least_of(&spec, &StepOptions { offload: false, ..train.clone() });
        let least = least_of(&spec, &train);
        assert!(least < kept_least, "{least} vs {kept_least}");
        let c =
            compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(least), ..train.clone() }).unwrap();
        let r = c.passes.offload.as_ref().unwrap();
        assert!(r.states > 0, "{r}");
        let states: Vec<ValueId> = (c.step.updates.iter().map(|u| u.state))
            .filter(|&s| c.plan.slot(s).region == Region::Host && !is_weight(&c.step, s))
            .collect();
        assert_eq!(states.len(), r.states);
        for &s in &states {
            // Read by its copy to the device, written back over by the copy of its new value.
            let readers: Vec<&crate::ir::Node> = c.step.nodes.iter().filter(|n| n.inputs.contains(&s)).collect();
            assert!(readers.iter().all(|n| matches!(n.op, crate::ops::Op::HostCopy(_))));
            let u = c.step.updates.iter().find(|u| u.state == s).unwrap();
            assert_eq!(c.plan.slot(u.new), c.plan.slot(s));
        }
        assert!(
            c.plan.persistent_bytes
                < compile_step(
                    &spec,
                    &StepOptions { recompute: RecomputePolicy::Budget(kept_least), offload: false, ..train.clone() }
                )
                .unwrap()
                .plan
                .persistent_bytes
        );
        // The same step with every state on the device, as the budget
        // tiled it: the same losses and weights, bit for bit.
        let kept = compile_step(&spec, &StepOptions { mlp_tiles: c.recompute().mlp_tiles, ..train }).unwrap();
        assert!(trained(&kept) == trained(&c), "an offloaded state trains otherwise");
    }

    /// A budget a little under what recomputation reaches offloads a few
    /// states, not the half of their kind that the search starts from:
    /// every value offloaded costs bus time on every step.
    #[test]
    fn a_budget_just_under_the_plan_offloads_only_what_it_needs() {
        // 16 layers: each kind of state has 16 or 32 members, so the half
        // the search starts from is 8 or 16 of them.
        let o = crate::models::Overrides { n_layer: Some(16), ..Default::default() };
        let config = crate::models::Config::named("tiny-llama").unwrap().with_overrides(&o).unwrap();
        let spec =
            ModelSpec { config, ..ModelSpec::named("tiny-llama", 2, 16, DType::F32, LossKind::CrossEntropy).unwrap() };
        let train = StepOptions::new(StepKind::Train);
        let recomputed = least_of(&spec, &StepOptions { offload: false, ..train.clone() });
        let c =
            compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(recomputed - 1), ..train }).unwrap();
        let r = c.passes.offload.as_ref().unwrap();
        // The states of a tiny model are a few kB each: one or two free a byte.
        assert!((1..=2).contains(&r.values), "{r}");
        assert!(c.planned_peak_bytes() < recomputed);
    }

    /// The least budget of a short row of a tiny model keeps weights in
    /// host memory too: each comes to the device before forward's first
    /// read and again before backward's, its update runs on the second
    /// copy, and the new value goes back over its host bytes.
    #[test]
    fn weights_wait_in_host_memory_and_come_in_for_forward_and_for_backward() {
        let spec = ModelSpec::named("tiny-llama", 2, 16, DType::F32, LossKind::CrossEntropy).unwrap();
        let train = StepOptions::new(StepKind::Train);
        let least = least_of(&spec, &train);
        let c = compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(least), ..train }).unwrap();
        check_plan(&c.step, &c.plan).unwrap();
        let r = c.passes.offload.as_ref().unwrap();
        assert!(r.weights > 0 && r.states > 0, "{r}");
        let t = &c.step;
        let hosted: Vec<ValueId> = t.params().filter(|&w| c.plan.slot(w).region == Region::Host).collect();
        assert_eq!(hosted.len(), r.weights);
        for &w in &hosted {
            let copies: Vec<(usize, &crate::ops::offload::HostCopy)> = (t.nodes.iter().enumerate())
                .filter(|(_, n)| n.inputs.contains(&w))
                .map(|(k, n)| match &n.op {
                    crate::ops::Op::HostCopy(h) => (k, h),
                    other => panic!("{} is read by {}", t.describe(w), other.name()),
                })
                .collect();
            // In for forward, in for backward, and its new value back over it.
            let ins: Vec<usize> = copies.iter().filter(|(_, h)| !h.to_host).map(|(k, _)| *k).collect();
            assert_eq!(ins.len(), 2, "{}", t.describe(w));
            assert_eq!(copies.iter().filter(|(_, h)| h.into_state).count(), 1);
            let first_reader = |k: usize| {
                let v = t.nodes[k].outputs[0];
                t.nodes.iter().find(|n| n.inputs.contains(&v)).map(|n| n.phase).unwrap()
            };
            assert_eq!(first_reader(ins[0]), Phase::Forward);
            assert_ne!(first_reader(ins[1]), Phase::Forward);
            let u = t.updates.iter().find(|u| u.state == w).unwrap();
            assert_eq!(c.plan.slot(u.new), c.plan.slot(w));
        }
        // Parameters are counted where they live, and so is their traffic.
        let report = crate::plan::plan_report(t, &c.plan, 0);
        let hosted_bytes: u64 = hosted.iter().map(|&w| t.ty(w).bytes()).sum();
        assert_eq!(report.param_host_bytes, hosted_bytes);
        assert_eq!(report.offloaded_weights, r.weights);
        assert!(report.to_string().contains("weights, copied to the device for forward and again for backward"));
        assert!(r.to_string().contains(&format!("{} weights", r.weights)));
    }

    /// Under adapters the frozen base is a candidate too: at the least
    /// budget its matrices wait in host memory, come in for forward and
    /// for backward with nothing copied back, and the adapters train bit
    /// for bit as with the base on the device.
    #[test]
    fn a_frozen_base_waits_in_host_memory_and_the_adapters_train_bit_for_bit() {
        use crate::models::lora::{Adapters, LoraTarget};
        let mut spec = ModelSpec::named("tiny-llama", 2, 16, DType::F32, LossKind::CrossEntropy).unwrap();
        spec.adapters = Some(Adapters::new(2, 4.0, LoraTarget::ALL.to_vec()).unwrap());
        let train = StepOptions::new(StepKind::Train);
        let least = least_of(&spec, &train);
        let c =
            compile_step(&spec, &StepOptions { recompute: RecomputePolicy::Budget(least), ..train.clone() }).unwrap();
        check_plan(&c.step, &c.plan).unwrap();
        let t = &c.step;
        let frozen: Vec<ValueId> = t.frozen().filter(|&w| c.plan.slot(w).region == Region::Host).collect();
        let copied: Vec<ValueId> = frozen
            .iter()
            .copied()
            .filter(|&w| t.nodes.iter().any(|n| n.inputs.contains(&w) && matches!(n.op, crate::ops::Op::HostCopy(_))))
            .collect();
        assert!(!copied.is_empty(), "{}", c.passes.offload.as_ref().unwrap());
        for &w in &copied {
            let readers: Vec<&crate::ir::Node> = t.nodes.iter().filter(|n| n.inputs.contains(&w)).collect();
            assert!(readers.iter().all(|n| matches!(&n.op, crate::ops::Op::HostCopy(h) if !h.to_host)));
            assert!(readers.len() <= 2, "{}: {} copies", t.describe(w), readers.len());
        }
        let report = crate::plan::plan_report(t, &c.plan, 0);
        assert_eq!(report.frozen_host_bytes, copied.iter().map(|&w| t.ty(w).bytes()).sum::<u64>());
        let kept = compile_step(&spec, &StepOptions { mlp_tiles: c.recompute().mlp_tiles, ..train }).unwrap();
        assert!(trained(&kept) == trained(&c), "adapters over a base in host memory train otherwise");
    }

    /// A step accumulating two micro-batches, every forward value that
    /// backward reads offloaded: the plan holds and the gradients are the
    /// kept step's, bit for bit.
    #[test]
    fn accumulated_micro_batches_offload_and_compute_the_same_gradients() {
        let spec = ModelSpec::named("tiny-llama", 1, 64, DType::F32, LossKind::CrossEntropy).unwrap();
        let opts = StepOptions { grad_accum: 2, ..StepOptions::new(StepKind::Grads) };
        let traces = crate::pipeline::trace_step(&spec, &opts).unwrap();
        let step = traces.step;
        let chosen: HashSet<ValueId> = forward_candidates(&step).into_iter().collect();
        assert!(!chosen.is_empty());
        let (offloaded, _) = rewrite(&step, &chosen).unwrap();
        for (trace, name) in [(&offloaded, "offloaded"), (&step, "kept")] {
            let p = crate::plan::plan(trace, crate::plan::PlanOptions::default()).unwrap();
            check_plan(trace, &p).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let weights: HashMap<String, crate::host::HostTensor> = crate::models::init_params(&traces.forward, 5)
            .into_iter()
            .map(|(v, t)| (traces.forward.value(v).kind.leaf_name().unwrap().to_string(), t))
            .collect();
        let ty = step.ty(step.leaf_by_name(crate::models::gpt::TOKENS_INPUT).unwrap()).clone();
        let ids: Vec<f64> = (0..ty.numel()).map(|i| ((i * 37 + 11) % 200) as f64).collect();
        let batch = crate::host::HostTensor::from_f64(ty, &ids);
        let data = [(crate::models::gpt::TOKENS_INPUT, batch.clone()), (crate::models::gpt::TARGETS_INPUT, batch)];
        let grads = |t: &Trace| {
            let mut s = crate::testing::run_with_weights(t, &weights, &data);
            crate::testing::grads_by_name(t, |v| Session::read(&mut s, v).unwrap().to_f64())
        };
        assert!(grads(&step) == grads(&offloaded), "accumulated offloaded gradients differ");
    }

    #[test]
    fn each_value_comes_back_one_offloaded_value_ahead_of_its_first_backward_reader() {
        let c = compile_step(
            &spec(),
            &StepOptions {
                recompute: RecomputePolicy::Budget(least(&StepOptions::new(StepKind::Grads))),
                ..StepOptions::new(StepKind::Grads)
            },
        )
        .unwrap();
        let t = &c.step;
        let pos = |v: ValueId| t.producer(v).unwrap().index();
        // Copies to the device for forward's reads (of weights) and for backward's.
        let (mut forward, mut backward) = (Vec::<(usize, usize)>::new(), Vec::<(usize, usize)>::new());
        for (k, node) in t.nodes.iter().enumerate() {
            let crate::ops::Op::HostCopy(h) = &node.op else { continue };
            if h.to_host {
                // Right after the value's producer.
                assert_eq!(pos(node.inputs[0]) + 1, k);
                assert_eq!(node.phase, Phase::Forward);
            } else {
                let v = node.outputs[0];
                let first = t.nodes.iter().position(|n| n.inputs.contains(&v)).expect("a reloaded value is read");
                assert!(first > k);
                if t.nodes[first].phase == Phase::Forward {
                    assert!(is_weight(t, node.inputs[0]), "only weights come to the device for forward");
                    forward.push((k, first));
                } else {
                    backward.push((k, first));
                }
            }
        }
        assert!(backward.len() > 1);
        // After the first, each comes back no later than the previous value's first reader.
        for reloads in [forward, backward] {
            for w in reloads.windows(2) {
                assert!(w[1].0 <= w[0].1, "{reloads:?}");
            }
        }
    }
}
