//! Recomputation as a trace transform: forward values that backward reads
//! are recomputed inside backward instead of being kept alive across the
//! forward/backward boundary, trading added work for a lower planned peak.
//!
//! The pass owns *which* saved values are recomputed and the rewrite that
//! does it. The rewrite copies the step and, before the first non-forward
//! node that reads a marked value, emits a copy of the value's producer in
//! the backward phase (its inputs themselves recomputed when marked, the
//! original forward values otherwise); every later non-forward read uses
//! that copy. The recomputation is ordinary nodes: it prints, is planned,
//! checked by `check_plan` and captured like every other node. Forward
//! nodes keep computing what the forward pass needs.
//!
//! Policies ([`RecomputePolicy`]):
//! - **`Auto`** (the default of [`crate::pipeline::StepOptions`]): recompute
//!   the *cheap* saved values whose every input stays alive into backward
//!   anyway (a leaf or another saved value), so no lifetime grows: e.g. the
//!   SwiGLU product from the saved gate and up projections, a norm's output
//!   from its saved input. Cheap means memory-bound by an H200 roofline
//!   ([`roofline`]): moving the node's bytes takes longer than its
//!   arithmetic. Every pointwise op, RoPE, cast and norm is; so is a
//!   product with a short reduction (a model 28 wide projecting to 18944),
//!   which costs what a pointwise op writing the same bytes costs; products
//!   and attention of real widths are compute-bound and stay kept. It is
//!   kept only when the planned peak falls. The added work is one memory
//!   pass per recomputed value, a fraction of a percent of a step that
//!   multiplies matrices.
//! - **`Budget(bytes)`**: go on until the planned peak is within the
//!   budget, greedily: plan, take the saved values live at the peak that
//!   can be recomputed (their non-leaf inputs saved or themselves marked),
//!   cheapest first — memory-bound before compute-bound, and within each
//!   pointwise, then norms, then products and attention; within a class
//!   the fewest added FLOPs per freed byte — mark the best
//!   one and every value of the same op and type live at the peak (the same
//!   layer's value in the other layers, the same MLP row tile's in the
//!   other tiles), and plan again. A budget that recomputing every
//!   candidate cannot meet is refused ([`Error::MemoryBudget`]), naming the
//!   smallest planned peak the pass reached: no budget below it works with
//!   this pass on this step (the pipeline then tries tiling the MLP).
//!   Greedy is not an exact knapsack; it is exact in the common case where
//!   the peak's saved values are per-layer copies of one kind. No value is
//!   recomputed from a recomputed value of its own kind: the residual
//!   stream's sums after attention and after the MLP are one kind, and a
//!   chain of them would recompute every earlier layer at the first
//!   layer's backward; marking alternate members keeps one stream value
//!   per layer (each layer's input) and recomputes the other from it.
//! - **`Least(bytes)`**: as `Budget`, but the least planned peak instead
//!   of a refusal, for the offload pass to go on from; and
//!   **`LeastBeforeOffload`**, which also leaves kept the candidates whose
//!   recomputation takes longer than a round trip of their bytes over the
//!   host link (attention at long sequences), for the offload pass to move
//!   instead ([`crate::pipeline`] says when it is tried).
//! - **`Off`**: the step unchanged.
//!
//! **Invariant:** the transformed step computes the same values as the
//! original (the same ops on the same inputs), so losses and gradients are
//! equal bit for bit on a deterministic backend.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use super::{Pass, PassContext};
use crate::error::{Error, Result};
use crate::ir::{Builder, NodeId, Phase, Trace, ValueId};
use crate::ops::Op;
use crate::plan::{MemoryPlan, PlanOptions, Region};

/// How much to recompute.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputePolicy {
    /// Keep every saved value.
    Off,
    /// Recompute cheap values whose inputs are kept anyway, when that lowers the peak.
    #[default]
    Auto,
    /// Recompute until the planned peak (persistent + arena) is at most this many bytes.
    Budget(u64),
    /// As `Budget`, but when no candidate is left above the budget, the
    /// step with the least planned peak instead of a refusal: what the
    /// offload pass ([`crate::passes::offload`]) then starts from.
    Least(u64),
    /// As `Least`, for a step that the offload pass finishes: a candidate
    /// whose recomputation (by the [`roofline`]) takes longer than copying
    /// its bytes to host memory and back at `bus_bytes_per_s` is left
    /// kept, for the offload pass to move instead. Attention is the one
    /// such value at long sequences: its recomputation grows with the
    /// square of the length, its output with the length, so past about
    /// 30k tokens (a 50 GB/s bus) the round trip is the cheaper way to
    /// free its bytes, and the copies overlap compute besides.
    LeastBeforeOffload { budget: u64, bus_bytes_per_s: u64 },
}

impl RecomputePolicy {
    /// The budget of the budgeted policies.
    pub fn budget(self) -> Option<u64> {
        match self {
            RecomputePolicy::Budget(b) | RecomputePolicy::Least(b) => Some(b),
            RecomputePolicy::LeastBeforeOffload { budget, .. } => Some(budget),
            RecomputePolicy::Off | RecomputePolicy::Auto => None,
        }
    }
}

/// Seconds a round trip of `bytes` over a bus of `bus_bytes_per_s` takes:
/// to host memory after forward and back before backward.
pub fn round_trip_seconds(bytes: u64, bus_bytes_per_s: u64) -> f64 {
    2.0 * bytes as f64 / bus_bytes_per_s.max(1) as f64
}

/// How expensive a recomputation is, in the order the budget takes them.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CostClass {
    /// Views, casts, element-wise arithmetic, SwiGLU, RoPE, dropout, NF4
    /// dequantization, embedding lookups.
    Pointwise,
    /// RMSNorm, LayerNorm, softmax: one row reduction and a pointwise pass.
    Norm,
    /// Matrix products and attention.
    Product,
}

/// The recomputation class of `op`, or `None` when the pass must not
/// recompute it (losses, optimizer, collectives, backward ops).
pub fn cost_class(op: &Op) -> Option<CostClass> {
    match op {
        Op::Full(_)
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Cast(_)
        | Op::Broadcast(_)
        | Op::Reshape(_)
        | Op::Permute(_)
        | Op::Slice(_)
        | Op::Concat(_)
        | Op::Rope(_)
        | Op::Glu(_)
        | Op::Dropout(_)
        // Reads half a byte per element and writes the float weight: the
        // float weight of a frozen NF4 layer is recomputed, not kept.
        | Op::DequantizeNf4(_)
        | Op::Embedding(_) => Some(CostClass::Pointwise),
        Op::RmsNorm(_) | Op::LayerNorm(_) | Op::Softmax(_) | Op::Reduce(_) => Some(CostClass::Norm),
        Op::MatMul(_) | Op::Attention(_) => Some(CostClass::Product),
        _ => None,
    }
}

/// FLOPs of one run of node `n` (what recomputing it adds), estimated from
/// its types: 2·M·N·K for products, 2·(elements of q)·T for causal
/// attention, a few per element for everything else. Each factor is at
/// most 2^60 (a value's size), but a product of two can pass `u64`: the
/// count saturates at `u64::MAX` (1.8e19) rather than wrap, and so do the
/// sums of counts made with [`u64::saturating_add`].
pub fn node_flops(trace: &Trace, n: NodeId) -> u64 {
    let node = trace.node(n);
    let out_elems: u64 = node.outputs.iter().fold(0, |acc, &o| acc.saturating_add(trace.ty(o).numel() as u64));
    match &node.op {
        Op::MatMul(m) => {
            let a = &trace.ty(node.inputs[0]).shape;
            let k = if m.trans_a { a[a.len() - 2] } else { a[a.len() - 1] };
            (trace.ty(node.outputs[0]).numel() as u64).saturating_mul(k as u64).saturating_mul(2)
        }
        Op::Attention(_) => {
            let q = trace.ty(node.inputs[0]);
            (q.numel() as u64).saturating_mul(q.shape[1] as u64).saturating_mul(2)
        }
        op if op.view_of().is_some() => 0,
        Op::RmsNorm(_) | Op::LayerNorm(_) | Op::Softmax(_) => out_elems.saturating_mul(8),
        Op::Glu(_) | Op::Rope(_) | Op::Unary(_) => out_elems.saturating_mul(6),
        _ => out_elems,
    }
}

/// Bytes of the outputs of node `n`.
fn output_bytes(trace: &Trace, n: NodeId) -> u64 {
    trace.node(n).outputs.iter().fold(0u64, |acc, &o| acc.saturating_add(trace.ty(o).bytes()))
}

/// Bytes node `n` reads and writes (for the time estimate of memory-bound ops).
fn node_traffic(trace: &Trace, n: NodeId) -> u64 {
    let node = trace.node(n);
    if node.op.view_of().is_some() {
        return 0;
    }
    node.inputs.iter().chain(&node.outputs).fold(0, |acc, &v| acc.saturating_add(trace.ty(v).bytes()))
}

/// Rates for the time estimate: the matrix-product ceiling and the copy
/// bandwidth measured on the H200 (cuBLAS bf16
/// 769 TFLOP/s, f32 50.6, copy 4176 GB/s).
const PRODUCT_FLOPS_PER_S_BF16: f64 = 769e12;
const PRODUCT_FLOPS_PER_S_F32: f64 = 50.6e12;
const COPY_BYTES_PER_S: f64 = 4176e9;

/// A roofline estimate of one run of a node on an H200: the time its
/// arithmetic takes at the product ceiling of its dtype and the time its
/// memory traffic takes at copy bandwidth. The node runs in about the
/// larger of the two.
#[derive(Copy, Clone, PartialEq, Debug)]
pub struct Roofline {
    pub compute_seconds: f64,
    pub memory_seconds: f64,
}

impl Roofline {
    /// The estimated time of the node: the slower of its two ceilings.
    pub fn seconds(&self) -> f64 {
        self.compute_seconds.max(self.memory_seconds)
    }

    /// Whether moving the node's bytes takes at least as long as its
    /// arithmetic (its arithmetic intensity is at most the machine
    /// balance): recomputing it then costs about what a pointwise op
    /// writing the same bytes costs, whatever its op.
    pub fn memory_bound(&self) -> bool {
        self.compute_seconds <= self.memory_seconds
    }
}

/// The [`Roofline`] of node `n`. Its arithmetic runs at the product rate
/// of its operands' dtype (f32 and f64 at the f32 rate, the 16-bit types
/// at the bf16 rate); for pointwise ops and norms that term is negligible.
pub fn roofline(trace: &Trace, n: NodeId) -> Roofline {
    let node = trace.node(n);
    let dtype = node.inputs.first().or(node.outputs.first()).map(|&v| trace.ty(v).dtype);
    let rate = match dtype {
        Some(crate::ir::DType::BF16 | crate::ir::DType::F16) => PRODUCT_FLOPS_PER_S_BF16,
        _ => PRODUCT_FLOPS_PER_S_F32,
    };
    Roofline {
        compute_seconds: node_flops(trace, n) as f64 / rate,
        memory_seconds: node_traffic(trace, n) as f64 / COPY_BYTES_PER_S,
    }
}

/// One recomputed node, as `plan` reports it.
#[derive(Clone, Debug, Serialize)]
pub struct RecomputedNode {
    /// The node in the transformed step.
    pub node: usize,
    pub op: String,
    /// The recomputed values' types.
    pub types: Vec<String>,
    pub class: CostClass,
    pub flops: u64,
    /// Bytes of the recomputed values (what keeping them would cost).
    pub bytes: u64,
    /// The node's [`roofline`] time, in seconds.
    pub seconds: f64,
}

/// What the pass did.
#[derive(Clone, Debug, Serialize)]
pub struct RecomputeReport {
    /// `off`, `auto`, or `budget <bytes>`.
    pub policy: String,
    pub recomputed: Vec<RecomputedNode>,
    /// FLOPs the recomputation adds per step.
    pub added_flops: u64,
    /// Estimated time the recomputation adds per step on an H200, in
    /// seconds: each node at the slower of its product rate and its memory
    /// traffic at copy bandwidth.
    pub estimated_seconds: f64,
    pub planned_peak_before: u64,
    pub planned_peak_after: u64,
    /// Row tiles of every MLP of the step (1: untiled). The pass leaves it
    /// at 1; [`crate::pipeline::compile_step`] sets what it built the step with.
    pub mlp_tiles: usize,
    /// Why values that recompute slower than a round trip over the bus are
    /// recomputed all the same (the step that offloads them instead did
    /// not fit the host memory or the budget); set by
    /// [`crate::pipeline::compile_step`].
    pub not_offloaded: Option<String>,
}

impl RecomputeReport {
    /// Nodes of the transformed step that recompute a value.
    pub fn nodes(&self) -> Vec<NodeId> {
        self.recomputed.iter().map(|r| NodeId(r.node as u32)).collect()
    }
}

impl std::fmt::Display for RecomputeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.mlp_tiles > 1 {
            writeln!(f, "mlp tiling: every MLP in {} row tiles", self.mlp_tiles)?;
        }
        if self.recomputed.is_empty() {
            return writeln!(f, "recompute ({}): nothing recomputed", self.policy);
        }
        let mut by_kind: Vec<(String, usize, u64)> = Vec::new();
        for r in &self.recomputed {
            let key = format!("{} -> {}", r.op, r.types.join(", "));
            match by_kind.iter_mut().find(|(k, _, _)| *k == key) {
                Some(e) => {
                    e.1 += 1;
                    e.2 = e.2.saturating_add(r.flops);
                }
                None => by_kind.push((key, 1, r.flops)),
            }
        }
        writeln!(
            f,
            "recompute ({}): {} nodes, +{:.3} GFLOP, about {:.2} ms per step on an H200; planned peak {} -> {} B",
            self.policy,
            self.recomputed.len(),
            self.added_flops as f64 / 1e9,
            self.estimated_seconds * 1e3,
            self.planned_peak_before,
            self.planned_peak_after
        )?;
        for (kind, count, flops) in by_kind {
            writeln!(f, "    {count:>4} × {kind}  (+{:.3} GFLOP)", flops as f64 / 1e9)?;
        }
        if let Some(why) = &self.not_offloaded {
            writeln!(f, "    {why}")?;
        }
        Ok(())
    }
}

/// Rewrites `step` so that the forward nodes in `marked` are recomputed in
/// backward (see the module doc). Returns the new step and the nodes of it
/// that recompute.
pub fn rewrite(step: &Trace, marked: &HashSet<NodeId>) -> Result<(Trace, Vec<(NodeId, NodeId)>)> {
    let mut b = Builder::new(step.name.clone());
    let mut map = b.copy_leaves(step)?;
    // Original value -> its recomputed copy, once emitted.
    let mut again: HashMap<ValueId, ValueId> = HashMap::new();
    let mut emitted: Vec<(NodeId, NodeId)> = Vec::new();
    for node in &step.nodes {
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &i in &node.inputs {
            let v = if node.phase == Phase::Forward {
                map[i.index()].expect("defined before use")
            } else {
                available(step, marked, i, &mut b, &map, &mut again, &mut emitted)?
            };
            inputs.push(v);
        }
        b.set_phase(node.phase);
        let outs = b.push(node.op.clone(), &inputs)?;
        for (&o, n) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(n);
        }
    }
    Ok((b.finish_rewrite(step, &map, "recompute")?, emitted))
}

/// The value backward should read for the original value `v`: its
/// recomputed copy when its producer is marked (emitted now if needed),
/// the original otherwise.
fn available(
    step: &Trace,
    marked: &HashSet<NodeId>,
    v: ValueId,
    b: &mut Builder,
    map: &[Option<ValueId>],
    again: &mut HashMap<ValueId, ValueId>,
    emitted: &mut Vec<(NodeId, NodeId)>,
) -> Result<ValueId> {
    let Some(p) = step.producer(v).filter(|p| marked.contains(p)) else {
        return Ok(map[v.index()].expect("defined before use"));
    };
    if let Some(&r) = again.get(&v) {
        return Ok(r);
    }
    let node = step.node(p);
    let mut inputs = Vec::with_capacity(node.inputs.len());
    for &i in &node.inputs {
        inputs.push(available(step, marked, i, b, map, again, emitted)?);
    }
    let new_id = NodeId(b.trace().nodes.len() as u32);
    b.set_phase(Phase::Backward);
    let outs = b.push(node.op.clone(), &inputs)?;
    for (&o, n) in node.outputs.iter().zip(outs) {
        again.insert(o, n);
    }
    emitted.push((p, new_id));
    Ok(again[&v])
}

/// Values alive into backward: the saved ones and the sources of saved views.
fn kept_values(step: &Trace) -> HashSet<ValueId> {
    let mut kept = HashSet::new();
    for &v in &step.saved {
        let mut v = v;
        while kept.insert(v) {
            match step.producer(v).and_then(|p| step.node(p).op.view_of().map(|i| step.node(p).inputs[i])) {
                Some(src) => v = src,
                None => break,
            }
        }
    }
    kept
}

/// Forward nodes whose outputs backward reads, directly or through views
/// (a projection's output that backward reads reshaped into heads).
fn saved_producers(step: &Trace) -> HashSet<NodeId> {
    let mut nodes: HashSet<NodeId> = HashSet::new();
    for &v in &step.saved {
        let mut v = v;
        while let Some(p) = step.producer(v) {
            if !nodes.insert(p) {
                break;
            }
            match step.node(p).op.view_of() {
                Some(i) => v = step.node(p).inputs[i],
                None => break,
            }
        }
    }
    nodes
}

/// Whether recomputing forward node `n` needs nothing kept alive that is
/// not kept already: each non-leaf input saved or itself marked.
fn inputs_kept(step: &Trace, n: NodeId, saved: &HashSet<ValueId>, marked: &HashSet<NodeId>) -> bool {
    step.node(n).inputs.iter().all(|&i| match step.producer(i) {
        None => true,
        Some(p) => marked.contains(&p) || saved.contains(&i),
    })
}

/// The most nodes one candidate may bring along to recompute its inputs.
const MAX_CLOSURE: usize = 6;

/// The nodes to recompute so that forward node `n` can be recomputed:
/// `n` and, for each non-leaf input neither kept nor marked, its producer
/// (through views), recursively — or `None` when that reaches a node the
/// pass must not recompute or more than [`MAX_CLOSURE`] nodes.
fn closure(step: &Trace, n: NodeId, kept: &HashSet<ValueId>, marked: &HashSet<NodeId>) -> Option<Vec<NodeId>> {
    let mut nodes = vec![n];
    let mut work = vec![n];
    while let Some(m) = work.pop() {
        cost_class(&step.node(m).op)?;
        for &i in &step.node(m).inputs {
            let Some(p) = step.producer(i) else { continue };
            if kept.contains(&i) || marked.contains(&p) || nodes.contains(&p) {
                continue;
            }
            nodes.push(p);
            if nodes.len() > MAX_CLOSURE {
                return None;
            }
            work.push(p);
        }
    }
    Some(nodes)
}

/// The forward view nodes of `step` that read each value as their
/// source, indexed by value: what [`mark_with_views`] follows, built once
/// so that marking stays linear in the nodes marked.
fn forward_views(step: &Trace) -> Vec<Vec<NodeId>> {
    let mut views = vec![Vec::new(); step.values.len()];
    for (k, node) in step.nodes.iter().enumerate() {
        if node.phase == Phase::Forward {
            if let Some(i) = node.op.view_of() {
                views[node.inputs[i].index()].push(NodeId(k as u32));
            }
        }
    }
    views
}

/// Marks `n` and the views of its outputs that backward reads (those in
/// `saved_nodes`; `views` is [`forward_views`] of `step`): a view shares
/// its source's bytes, so the source is freed only when they go too.
fn mark_with_views(
    step: &Trace,
    views: &[Vec<NodeId>],
    n: NodeId,
    saved_nodes: &HashSet<NodeId>,
    marked: &mut HashSet<NodeId>,
) {
    let mut work = vec![n];
    while let Some(n) = work.pop() {
        if !marked.insert(n) {
            continue;
        }
        for o in &step.node(n).outputs {
            work.extend(views[o.index()].iter().filter(|v| saved_nodes.contains(v)));
        }
    }
}

fn report(
    policy: &str,
    step: &Trace,
    new: &Trace,
    emitted: &[(NodeId, NodeId)],
    before: u64,
    after: u64,
) -> RecomputeReport {
    let mut recomputed = Vec::new();
    let (mut flops, mut seconds) = (0u64, 0f64);
    for &(orig, n) in emitted {
        let node = new.node(n);
        let f = node_flops(new, n);
        let s = roofline(new, n).seconds();
        flops = flops.saturating_add(f);
        seconds += s;
        recomputed.push(RecomputedNode {
            node: n.index(),
            op: node.op.name().to_string(),
            types: node.outputs.iter().map(|&o| new.ty(o).to_string()).collect(),
            class: cost_class(&step.node(orig).op).unwrap_or(CostClass::Product),
            flops: f,
            bytes: output_bytes(new, n),
            seconds: s,
        });
    }
    RecomputeReport {
        policy: policy.to_string(),
        recomputed,
        added_flops: flops,
        estimated_seconds: seconds,
        planned_peak_before: before,
        planned_peak_after: after,
        mlp_tiles: 1,
        not_offloaded: None,
    }
}

/// Applies `policy` to `step`, planning with `opts`: the step to run, its
/// plan (not yet checked: the pipeline checks it), and what was recomputed.
pub fn apply(step: &Trace, policy: RecomputePolicy, opts: PlanOptions) -> Result<(Trace, MemoryPlan, RecomputeReport)> {
    let mut cx = PassContext::new(opts);
    let out = cx.run(&Recompute(policy), step)?;
    let plan = cx.take_plan(&out)?;
    let report = cx.report.recompute.take().expect("the pass reports what it recomputed");
    Ok((out, plan, report))
}

/// Recomputation as a pass: it starts from the plan of its input that the
/// context holds (planning it only when no pass before did), plans each
/// candidate through the context, and leaves the plan of the step it
/// returns there. The report says what is recomputed.
#[derive(Copy, Clone, Debug, Default)]
pub struct Recompute(pub RecomputePolicy);

impl Pass for Recompute {
    fn name(&self) -> &'static str {
        "recompute"
    }

    fn run(&self, step: &Trace, cx: &mut PassContext) -> Result<Trace> {
        if self.0 != RecomputePolicy::Off {
            // Recomputed copies are emitted into backward, across segments.
            cx.refuse_segments(self.name())?;
        }
        let (out, plan, report) = apply_in(step, self.0, cx)?;
        cx.report.recompute = Some(report);
        cx.set_output_plan(plan);
        Ok(out)
    }
}

/// [`apply`] over the plans of `cx`.
fn apply_in(
    step: &Trace,
    policy: RecomputePolicy,
    cx: &mut PassContext,
) -> Result<(Trace, MemoryPlan, RecomputeReport)> {
    let base_plan = cx.take_plan(step)?;
    let before = base_plan.planned_peak_bytes();
    let unchanged = |name: &str, plan: MemoryPlan| {
        let r = report(name, step, step, &[], before, before);
        Ok((step.clone(), plan, r))
    };
    match policy {
        RecomputePolicy::Off => unchanged("off", base_plan),
        RecomputePolicy::Auto => {
            let saved = kept_values(step);
            let saved_nodes = saved_producers(step);
            let views = forward_views(step);
            let mut marked = HashSet::new();
            for &n in &saved_nodes {
                // Cheap by the roofline, not by op: every pointwise op and
                // norm is memory-bound, and so is a product with a short
                // reduction (W2's `[4096, 28] · [28, 18944]` gate and up
                // projections write 155 MB each for 4 GFLOP), while the
                // products and attention of real widths are compute-bound
                // and stay kept.
                let cheap = cost_class(&step.node(n).op).is_some() && roofline(step, n).memory_bound();
                // Views free nothing on their own: they go with their source.
                if cheap && step.node(n).op.view_of().is_none() && inputs_kept(step, n, &saved, &HashSet::new()) {
                    mark_with_views(step, &views, n, &saved_nodes, &mut marked);
                }
            }
            // Every marked value; those but the products that add a tensor
            // in their epilogue; those of pointwise ops and norms only.
            // Recomputing a memory-bound product (a narrow model's, or one
            // that adds the residual stream in its epilogue, whose addend
            // must then stay alive) can cost more than it frees while the
            // rest still pays. The lowest peak wins.
            let without = |drop: &dyn Fn(&Op) -> bool| -> HashSet<NodeId> {
                marked.iter().copied().filter(|&n| !drop(&step.node(n).op)).collect()
            };
            let no_addends = without(&|op| matches!(op, Op::MatMul(m) if m.addend));
            let light = without(&|op| cost_class(op) == Some(CostClass::Product));
            let mut sets: Vec<&HashSet<NodeId>> = Vec::new();
            for set in [&marked, &no_addends, &light] {
                if !set.is_empty() && !sets.iter().any(|s| s.len() == set.len()) {
                    sets.push(set);
                }
            }
            // The rewritten step, its plan and what it recomputes (as `rewrite` gives them).
            type Candidate = (Trace, MemoryPlan, Vec<(NodeId, NodeId)>);
            let mut best: Option<Candidate> = None;
            for set in sets {
                let (new, emitted) = rewrite(step, set)?;
                let new_plan = cx.plan(&new)?;
                let lowest = best.as_ref().map_or(before, |b| b.1.planned_peak_bytes());
                if new_plan.planned_peak_bytes() < lowest {
                    best = Some((new, new_plan, emitted));
                }
            }
            match best {
                Some((new, new_plan, emitted)) => {
                    let after = new_plan.planned_peak_bytes();
                    let r = report("auto", step, &new, &emitted, before, after);
                    Ok((new, new_plan, r))
                }
                None => unchanged("auto", base_plan),
            }
        }
        RecomputePolicy::Budget(_) | RecomputePolicy::Least(_) | RecomputePolicy::LeastBeforeOffload { .. } => {
            let budget = policy.budget().expect("a budgeted policy");
            let bus = match policy {
                RecomputePolicy::LeastBeforeOffload { bus_bytes_per_s, .. } => Some(bus_bytes_per_s),
                _ => None,
            };
            let name = match bus {
                Some(bus) => format!(
                    "budget {budget} B, what recomputes slower than a {:.0} GB/s bus offloaded",
                    bus as f64 / 1e9
                ),
                None => format!("budget {budget} B"),
            };
            if before <= budget {
                return unchanged(&name, base_plan);
            }
            let saved = kept_values(step);
            let saved_nodes = saved_producers(step);
            let views = forward_views(step);
            let mut marked: HashSet<NodeId> = HashSet::new();
            let mut current = (step.clone(), base_plan, Vec::new());
            let mut best_peak = before;
            let mut rejected: HashSet<String> = HashSet::new();
            let mut kinds = MarkedKinds::default();
            loop {
                let (ref t, ref p, _) = current;
                if p.planned_peak_bytes() <= budget {
                    break;
                }
                // Saved originals live at the peak of the current step,
                // found through the values of the current step that are
                // still the originals (same producer position, forward).
                let live_at_peak = live_forward_nodes_at_peak(step, t, p);
                // Kept for backward now: the saved values, and the inputs the
                // marked recomputations read (with the sources of views).
                let mut kept = saved.clone();
                let mut needed = saved_nodes.clone();
                for &n in &marked {
                    for &i in &step.node(n).inputs {
                        let mut v = i;
                        while let Some(p) = step.producer(v) {
                            kept.insert(v);
                            needed.insert(p);
                            match step.node(p).op.view_of() {
                                Some(k) => v = step.node(p).inputs[k],
                                None => break,
                            }
                        }
                    }
                }
                let mut candidates: Vec<Candidate> = needed
                    .iter()
                    .copied()
                    .filter(|n| !marked.contains(n) && live_at_peak.contains(n))
                    .filter(|&n| step.node(n).op.view_of().is_none() && !rejected.contains(&signature(step, n)))
                    .filter_map(|n| closure(step, n, &kept, &marked).map(|c| (n, c)))
                    .filter(|(n, nodes)| !kinds.chains(step, &signature(step, *n), nodes))
                    .filter(|(n, nodes)| {
                        bus.is_none_or(|bus| {
                            let seconds: f64 = nodes.iter().map(|&m| roofline(step, m).seconds()).sum();
                            seconds <= round_trip_seconds(output_bytes(step, *n), bus)
                        })
                    })
                    .map(|(n, nodes)| {
                        let class = nodes
                            .iter()
                            .filter_map(|&m| cost_class(&step.node(m).op))
                            .max()
                            .unwrap_or(CostClass::Product);
                        let compute_bound = nodes.iter().any(|&m| !roofline(step, m).memory_bound());
                        let flops = nodes.iter().fold(0u64, |acc, &m| acc.saturating_add(node_flops(step, m)));
                        let bytes = output_bytes(step, n);
                        Candidate {
                            compute_bound,
                            class,
                            flops_per_byte: flops as f64 / bytes.max(1) as f64,
                            node: n,
                            nodes,
                        }
                    })
                    .collect();
                candidates.sort_by(|a, b| {
                    (a.compute_bound, a.class)
                        .cmp(&(b.compute_bound, b.class))
                        .then(a.flops_per_byte.total_cmp(&b.flops_per_byte))
                        .then(a.node.cmp(&b.node))
                });
                let Some(best) = candidates.first().map(|c| c.node) else {
                    if let RecomputePolicy::Least(_) | RecomputePolicy::LeastBeforeOffload { .. } = policy {
                        break;
                    }
                    return Err(Error::MemoryBudget { budget, least: best_peak, mlp_tiles: 1, hint: None });
                };
                // The same value in the other layers live at the peak, half
                // of them at a time (earliest first: they live longest), so
                // the budget is met without recomputing every layer's copy
                // when fewer suffice, in a logarithmic number of plans.
                let key = signature(step, best);
                let previous = marked.clone();
                let mut same: Vec<&Candidate> = candidates.iter().filter(|c| signature(step, c.node) == key).collect();
                same.sort_by_key(|c| c.node);
                let mut batch = MarkedKinds::default();
                for c in same.iter().take(same.len().div_ceil(2)) {
                    // Candidates were chosen before this batch: one may
                    // now read another's output.
                    if batch.chains(step, &key, &c.nodes) {
                        continue;
                    }
                    let before_mark = marked.clone();
                    for &m in &c.nodes {
                        mark_with_views(step, &views, m, &needed, &mut marked);
                    }
                    batch.add(step, &key, marked.difference(&before_mark).copied());
                }
                let undo = kinds.clone();
                kinds.extend(batch);
                let (new, emitted) = rewrite(step, &marked)?;
                let new_plan = cx.plan(&new)?;
                if new_plan.planned_peak_bytes() > current.1.planned_peak_bytes() {
                    // Worse: recomputed copies outlive what they replace
                    // (a residual stream recomputed far from its use). Undo,
                    // and leave values of this kind kept.
                    marked = previous;
                    kinds = undo;
                    rejected.insert(key);
                    continue;
                }
                best_peak = best_peak.min(new_plan.planned_peak_bytes());
                current = (new, new_plan, emitted);
            }
            let (t, p, emitted) = current;
            let after = p.planned_peak_bytes();
            let r = report(&name, step, &t, &emitted, before, after);
            Ok((t, p, r))
        }
    }
}

/// The nodes the budget policy has marked, by the kind (signature) of
/// the candidate that marked them, and the producers their inputs come
/// from. A value of one kind is not recomputed from another value of the
/// same kind that is itself recomputed: along the residual stream (the
/// sums after attention and after the MLP are one kind) such a chain would
/// recompute every earlier layer's stream at the first layer's backward
/// and keep the copies alive to the end. Marking alternate members keeps
/// one stream value per layer and recomputes the other from it.
#[derive(Clone, Default)]
struct MarkedKinds {
    nodes: HashMap<String, HashSet<NodeId>>,
    read: HashMap<String, HashSet<NodeId>>,
}

impl MarkedKinds {
    fn add(&mut self, step: &Trace, key: &str, nodes: impl Iterator<Item = NodeId>) {
        for n in nodes {
            self.nodes.entry(key.to_string()).or_default().insert(n);
            let read = self.read.entry(key.to_string()).or_default();
            read.extend(step.node(n).inputs.iter().filter_map(|&i| source_producer(step, i)));
        }
    }

    fn extend(&mut self, other: MarkedKinds) {
        for (k, v) in other.nodes {
            self.nodes.entry(k).or_default().extend(v);
        }
        for (k, v) in other.read {
            self.read.entry(k).or_default().extend(v);
        }
    }

    /// Whether recomputing `closure` (for a candidate of kind `key`) reads
    /// a value recomputed for the same kind, or is read by one.
    fn chains(&self, step: &Trace, key: &str, closure: &[NodeId]) -> bool {
        let (Some(nodes), Some(read)) = (self.nodes.get(key), self.read.get(key)) else {
            return false;
        };
        closure.iter().any(|&m| {
            read.contains(&m)
                || step
                    .node(m)
                    .inputs
                    .iter()
                    .any(|&i| source_producer(step, i).is_some_and(|p| !closure.contains(&p) && nodes.contains(&p)))
        })
    }
}

/// The node that computes the bytes of `v`: its producer, through views.
fn source_producer(step: &Trace, v: ValueId) -> Option<NodeId> {
    let mut p = step.producer(v)?;
    while let Some(i) = step.node(p).op.view_of() {
        match step.producer(step.node(p).inputs[i]) {
            Some(q) => p = q,
            None => break,
        }
    }
    Some(p)
}

/// A value the budget policy may recompute next, with what it costs.
struct Candidate {
    /// Some node of the closure runs at the product ceiling: such values
    /// go after every memory-bound one.
    compute_bound: bool,
    /// The dearest class in the closure.
    class: CostClass,
    /// Added FLOPs per byte freed: the order within a class.
    flops_per_byte: f64,
    /// The saved forward node.
    node: NodeId,
    /// It and the nodes recomputed to feed it.
    nodes: Vec<NodeId>,
}

/// Op and output types: what makes two layers' values "the same". Where
/// a slice starts is left out, so the row tiles of a tiled MLP
/// ([`crate::models::ForwardOptions::mlp_tiles`]) are one kind too, and
/// taken a half at a time like the layers.
fn signature(step: &Trace, n: NodeId) -> String {
    let node = step.node(n);
    let types: Vec<String> = node.outputs.iter().map(|&o| step.ty(o).to_string()).collect();
    match &node.op {
        Op::Slice(s) => format!("Slice {{ axis: {} }} {}", s.axis, types.join(",")),
        op => format!("{op:?} {}", types.join(",")),
    }
}

/// Forward nodes of the original `step` whose outputs are live (in the
/// arena) at the peak of `plan`, the plan of the rewritten `current` step.
/// The rewrite keeps forward nodes in place, so forward node `k` of
/// `current` is forward node `k` of `step`.
fn live_forward_nodes_at_peak(step: &Trace, current: &Trace, plan: &MemoryPlan) -> HashSet<NodeId> {
    let forward = step.nodes.iter().take_while(|n| n.phase == Phase::Forward).count();
    let mut live = HashSet::new();
    for g in plan.groups.iter().filter(|g| g.region == Region::Arena) {
        if !(g.start <= plan.peak_position && plan.peak_position <= g.end) {
            continue;
        }
        for &v in &g.members {
            if let Some(p) = current.producer(v) {
                if p.index() < forward && current.node(p).phase == Phase::Forward {
                    live.insert(p);
                }
            }
        }
    }
    live
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::StepKind;
    use crate::ir::DType;
    use crate::models::{LossKind, ModelSpec};
    use crate::pipeline::{trace_step, StepOptions};
    use crate::plan::{check_plan, plan};

    fn step(kind: StepKind, dtype: DType) -> Trace {
        let spec = ModelSpec::named("tiny-llama", 2, 64, dtype, LossKind::CrossEntropy).unwrap();
        trace_step(&spec, &StepOptions::new(kind)).unwrap().step
    }

    #[test]
    fn off_keeps_the_step() {
        let s = step(StepKind::Grads, DType::F32);
        let (t, _, r) = apply(&s, RecomputePolicy::Off, PlanOptions::default()).unwrap();
        assert_eq!(t, s);
        assert!(r.recomputed.is_empty());
    }

    #[test]
    fn auto_recomputes_cheap_values_and_lowers_the_peak() {
        let s = step(StepKind::Grads, DType::F32);
        let (t, p, r) = apply(&s, RecomputePolicy::Auto, PlanOptions::default()).unwrap();
        check_plan(&t, &p).unwrap();
        assert!(!r.recomputed.is_empty(), "{r}");
        assert!(r.planned_peak_after < r.planned_peak_before, "{r}");
        assert!(r.recomputed.iter().any(|n| n.op == "swiglu"), "{r}");
        for n in r.nodes() {
            assert_eq!(t.node(n).phase, Phase::Backward);
            // Only memory-bound work is recomputed without a budget (the
            // tiny model's narrow products may be, see the roofline test).
            assert!(roofline(&t, n).memory_bound(), "{r}");
        }
        // The step still computes the same outputs, in the same order.
        assert_eq!(t.outputs.len(), s.outputs.len());
        assert_eq!(t.params().count(), s.params().count());
    }

    /// A grads step of `layers` layers of the named model with `overrides`,
    /// one row of `seq` tokens in bf16.
    fn wide_step(name: &str, o: crate::models::Overrides, seq: usize) -> Trace {
        let config = crate::models::Config::named(name).unwrap().with_overrides(&o).unwrap();
        let spec = ModelSpec {
            config,
            batch: 1,
            seq,
            dtype: DType::BF16,
            loss: LossKind::CrossEntropy,
            adapters: None,
            documents: false,
        };
        trace_step(&spec, &StepOptions::new(StepKind::Grads)).unwrap().step
    }

    #[test]
    fn the_roofline_finds_products_with_a_short_reduction_memory_bound() {
        let product = |m: usize, k: usize, n: usize| {
            let mut b = Builder::new("p");
            let x = b.input("x", crate::ir::TensorType::new(DType::BF16, [m, k])).unwrap();
            let w = b.param("w", crate::ir::TensorType::new(DType::BF16, [n, k])).unwrap();
            b.matmul(x, w, false, true).unwrap();
            let t = b.finish("test").unwrap();
            roofline(&t, NodeId(0))
        };
        // W2's gate projection: 4.3 GFLOP (5.7 µs at the bf16 ceiling)
        // writing 155 MB (37 µs at copy bandwidth).
        let w2 = product(4096, 28, 18944);
        assert!(w2.memory_bound(), "{w2:?}");
        assert!((w2.memory_seconds - 156.5e6 / COPY_BYTES_PER_S).abs() < 1e-6, "{w2:?}");
        // open_llama_3b's, at W5's 8192 rows: 453 GFLOP over 213 MB.
        let w5 = product(8192, 3200, 8640);
        assert!(!w5.memory_bound(), "{w5:?}");
        assert_eq!(w5.seconds(), w5.compute_seconds);
    }

    #[test]
    fn auto_recomputes_memory_bound_products_only() {
        // W2's geometry at two layers: the gate and up projections (K = 28)
        // are recomputed from the kept norm output, and the peak holds no
        // layer's `[4096, 18944]` projections but the one in backward.
        let o = crate::models::Overrides { n_layer: Some(2), n_embd: Some(28), ..Default::default() };
        let s = wide_step("Qwen2.5-7B", o, 4096);
        let (t, p, r) = apply(&s, RecomputePolicy::Auto, PlanOptions::default()).unwrap();
        check_plan(&t, &p).unwrap();
        assert_eq!(r.recomputed.iter().filter(|n| n.op == "matmul").count(), 4, "{r}");
        assert!(r.planned_peak_after < 4 * 155_189_248, "{r}");
        // open_llama_3b's widths: no product or attention is memory-bound.
        let o = crate::models::Overrides { n_layer: Some(1), ..Default::default() };
        let s = wide_step("open_llama_3b", o, 2048);
        let (_, _, r) = apply(&s, RecomputePolicy::Auto, PlanOptions::default()).unwrap();
        assert!(!r.recomputed.is_empty(), "{r}");
        assert!(r.recomputed.iter().all(|n| n.class != CostClass::Product), "{r}");
    }

    #[test]
    fn auto_recomputes_nf4_weights_in_backward_instead_of_keeping_them() {
        use crate::autodiff::{build_step, TrainOptions};
        use crate::ir::{OutputKind, TensorType};
        use crate::ops::nf4::Nf4Weight;
        // Two frozen NF4 layers over a trained input: backward needs each
        // float weight for the input's cotangent, and the leaves they are
        // dequantized from stay alive anyway.
        let mut b = Builder::new("qlora");
        let x = b.param("x", TensorType::new(DType::F32, [4, 256])).unwrap();
        let mut h = x;
        for layer in 0..2 {
            let leaves: Vec<ValueId> = Nf4Weight::leaf_types(&[256, 256], layer == 1)
                .unwrap()
                .into_iter()
                .map(|(suffix, ty)| b.frozen(&format!("w{layer}.{suffix}"), ty).unwrap())
                .collect();
            let w = b.dequantize_nf4(&leaves, &[256, 256], layer == 1, DType::F32).unwrap();
            h = b.matmul(h, w, false, true).unwrap();
        }
        let loss = b.sum_all(h).unwrap();
        b.output(OutputKind::Loss, loss);
        let forward = b.finish("build").unwrap();
        let s = build_step(&forward, StepKind::Grads, &TrainOptions::default()).unwrap();
        let (t, p, r) = apply(&s, RecomputePolicy::Auto, PlanOptions::default()).unwrap();
        check_plan(&t, &p).unwrap();
        assert_eq!(r.recomputed.iter().filter(|n| n.op == "dequantize_nf4").count(), 2, "{r}");
        assert!(r.planned_peak_after < r.planned_peak_before, "{r}");
        // The forward's float weights die in forward: no later node reads them.
        let weights: HashSet<ValueId> = t
            .nodes
            .iter()
            .filter(|n| n.phase == Phase::Forward && matches!(n.op, Op::DequantizeNf4(_)))
            .map(|n| n.outputs[0])
            .collect();
        assert_eq!(weights.len(), 2);
        for n in t.nodes.iter().filter(|n| n.phase != Phase::Forward) {
            assert!(n.inputs.iter().all(|v| !weights.contains(v)), "{} reads a forward weight\n{t}", n.op.name());
        }
    }

    #[test]
    fn a_budget_is_met_by_recomputing_more_and_an_impossible_one_names_the_least() {
        let s = step(StepKind::Train, DType::F32);
        let (_, auto_plan, _) = apply(&s, RecomputePolicy::Auto, PlanOptions::default()).unwrap();
        let auto_peak = auto_plan.planned_peak_bytes();
        let persistent = auto_plan.persistent_bytes;
        // Below the persistent bytes nothing can work; the error names the least that does.
        let err = apply(&s, RecomputePolicy::Budget(persistent / 2), PlanOptions::default()).unwrap_err().to_string();
        assert!(err.contains("cannot be met") && err.contains("ask for at least"), "{err}");
        let least: u64 = err.split("plans ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!(least < auto_peak, "the budget goes beyond auto: {least} vs {auto_peak}");
        for budget in [least, (least + auto_peak) / 2] {
            let (t, p, r) = apply(&s, RecomputePolicy::Budget(budget), PlanOptions::default()).unwrap();
            check_plan(&t, &p).unwrap();
            assert!(p.planned_peak_bytes() <= budget, "{r}");
            assert!(r.planned_peak_after <= budget && r.planned_peak_before > budget, "{r}");
        }
        let (_, _, r) = apply(&s, RecomputePolicy::Budget(least), PlanOptions::default()).unwrap();
        assert!(r.recomputed.iter().any(|n| n.class != CostClass::Pointwise), "{r}");
        assert!(r.added_flops > 0 && r.estimated_seconds > 0.0, "{r}");
    }

    /// Forward values of the residual stream's type that backward reads:
    /// what the step keeps of the stream across forward and backward.
    fn stream_values_kept(t: &Trace, stream: &crate::ir::TensorType) -> usize {
        let read_in_backward: HashSet<ValueId> =
            t.nodes.iter().filter(|n| n.phase != Phase::Forward).flat_map(|n| n.inputs.iter().copied()).collect();
        t.nodes
            .iter()
            .filter(|n| n.phase == Phase::Forward && matches!(n.op, Op::Binary(_) | Op::MatMul(_)))
            .flat_map(|n| n.outputs.iter().copied())
            .filter(|v| t.ty(*v) == stream && read_in_backward.contains(v))
            .count()
    }

    #[test]
    fn the_least_budget_keeps_one_residual_stream_value_per_layer() {
        let layers = 8;
        let s = wide_step(
            "tiny-llama",
            crate::models::Overrides { n_layer: Some(layers), block_size: Some(512), ..Default::default() },
            512,
        );
        let stream = crate::ir::TensorType::new(DType::BF16, vec![1, 512, 64]);
        let err = apply(&s, RecomputePolicy::Budget(1), PlanOptions::default()).unwrap_err().to_string();
        let least: u64 = err.split("plans ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        let (t, p, r) = apply(&s, RecomputePolicy::Budget(least), PlanOptions::default()).unwrap();
        check_plan(&t, &p).unwrap();
        // Each layer's input, or the sum after its attention: not both,
        // and never a chain of recomputed sums reaching back over layers.
        let kept = stream_values_kept(&t, &stream);
        assert!(kept <= layers + 1, "{kept} stream values kept for {layers} layers\n{r}");
    }

    #[test]
    fn recomputed_steps_compute_the_same_loss_and_gradients_bit_for_bit() {
        use crate::cpu::exec::CpuSession;
        use crate::models::init_params;
        use crate::session::Session;
        let spec = ModelSpec::named("tiny-llama", 2, 64, DType::F32, LossKind::CrossEntropy).unwrap();
        let traces = trace_step(&spec, &StepOptions::new(StepKind::Grads)).unwrap();
        let s = traces.step;
        let base = plan(&s, PlanOptions::default()).unwrap();
        let mut runs = Vec::new();
        let least = match apply(&s, RecomputePolicy::Budget(0), PlanOptions::default()) {
            Err(e) => e.to_string().split("plans ").nth(1).unwrap().split(' ').next().unwrap().parse::<u64>().unwrap(),
            Ok(_) => unreachable!("no step fits in 0 bytes"),
        };
        assert!(least < base.planned_peak_bytes());
        for policy in [RecomputePolicy::Off, RecomputePolicy::Auto, RecomputePolicy::Budget(least)] {
            let (t, p, _) = apply(&s, policy, PlanOptions::default()).unwrap();
            check_plan(&t, &p).unwrap();
            let mut session = CpuSession::new(t.clone(), p).unwrap();
            for (v, value) in init_params(&traces.forward, 3) {
                let name = traces.forward.value(v).kind.leaf_name().unwrap().to_string();
                session.write_named(&name, &value).unwrap();
            }
            let ty = t.ty(t.leaf_by_name(crate::models::gpt::TOKENS_INPUT).unwrap()).clone();
            let ids: Vec<f64> = (0..ty.numel()).map(|i| ((i * 37 + 11) % 200) as f64).collect();
            let tokens = crate::host::HostTensor::from_f64(ty.clone(), &ids);
            session.write_named(crate::models::gpt::TOKENS_INPUT, &tokens).unwrap();
            let targets: Vec<f64> = (0..ty.numel()).map(|i| ((i * 53 + 7) % 200) as f64).collect();
            session
                .write_named(crate::models::gpt::TARGETS_INPUT, &crate::host::HostTensor::from_f64(ty, &targets))
                .unwrap();
            Session::run_eager(&mut session).unwrap();
            let loss = Session::loss(&mut session).unwrap();
            let grads: Vec<Vec<f64>> = t
                .outputs
                .iter()
                .filter(|o| matches!(o.kind, crate::ir::OutputKind::Grad(_)))
                .map(|o| Session::read(&mut session, o.value).unwrap().to_f64())
                .collect();
            runs.push((loss, grads));
        }
        for r in &runs[1..] {
            assert_eq!(r.0.to_bits(), runs[0].0.to_bits());
            assert_eq!(r.1, runs[0].1);
        }
    }
}
