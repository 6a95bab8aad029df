//! Data parallelism: the step trace of one rank of `world`, the same trace
//! on every rank.
//!
//! [`data_parallel`] (as a pass: [`DataParallelRewrite`]) rewrites a
//! finished `grads` or `train` step (after autodiff) for a group of ranks
//! that each run the step on their own rows of the global batch. Building
//! and planning a rank's step from a model spec belongs to
//! [`crate::pipeline`] (`build_rank_step`, `plan_data_parallel`), which
//! uses this module; this module does not use the pipeline.
//!
//! The rewrite:
//!
//! 1. **Buckets.** The gradients, in the order backward produces them, are
//!    cut into buckets of at least [`DataParallel::bucket_bytes`] (the last
//!    may be smaller), as PyTorch DDP does with `bucket_cap_mb` (25 MiB by
//!    default). A gradient larger than the budget is a bucket of its own.
//! 2. **Overlap.** Each bucket becomes one collective node (one grouped
//!    NCCL call on the GPU) placed right after the node that produces the
//!    bucket's last gradient, so its communication overlaps the rest of
//!    backward. Plain data parallelism all-reduces the bucket in place
//!    (`all_reduce_mean`: every rank gets the mean gradient of the global
//!    batch); ZeRO-1 reduce-scatters it (`reduce_scatter_mean`: each rank
//!    keeps its shard of every gradient, and the full gradients die there).
//! 3. **Loss.** The loss is averaged over the ranks right after it is
//!    computed (`all_reduce_mean`), so every rank reports the global loss.
//! 4. **ZeRO-1** (train steps only): each rank keeps its shard of every
//!    parameter's AdamW moments and master state (persistent state of
//!    `1/world` the size).
//!    The optimizer runs bucket by bucket: per parameter `local_shard` (this
//!    rank's shard of the parameter), AdamW on the shard, then one
//!    `all_gather` per bucket writes every rank's updated shards back into
//!    the parameters, in place. Parameters stay replicated (forward needs
//!    them); gradients and optimizer state are sharded.
//!
//! Shards are flat element ranges ([`crate::ops::collective::shard_type`]):
//! a parameter of `n` elements splits into `world` shards of `n / world`, so
//! every collective moves equal-sized buffers. A parameter whose element
//! count `world` does not divide is refused with its name and shape.
//!
//! **Global batch semantics.** Rank `r` of `world` takes rows
//! `[r·B/world, (r+1)·B/world)` of the global batch `B` ([`rank_batch`],
//! [`shard_rows`]); `B` must divide evenly. The loss is a mean over each
//! rank's tokens and the gradients are averaged over ranks, so `world` ranks
//! compute the loss and gradients of the global batch, up to reduction
//! order, when every rank has the same number of counted targets (as with
//! no ignored targets, or one ignored position per row). With unequal
//! counts the result is the mean of per-rank means, as in DDP.

use std::collections::HashMap;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::host::HostTensor;
use crate::ir::{Builder, NodeId, OutputKind, Phase, Trace, ValueId, ValueKind};
use crate::models::ModelSpec;
use crate::ops::collective::{shard_type, ReduceOp};
use crate::ops::optim::MasterWeights;
use crate::ops::{BinaryFn, Op};
use crate::passes::{Pass, PassContext};

/// PyTorch DDP's default bucket size (`bucket_cap_mb=25`, in MiB).
pub const DEFAULT_BUCKET_BYTES: u64 = 25 * 1024 * 1024;

/// How to split a step over ranks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DataParallel {
    /// Number of ranks (GPUs).
    pub world: usize,
    /// A bucket closes once its gradients hold at least this many bytes.
    pub bucket_bytes: u64,
    /// Shard the optimizer state (ZeRO stage 1); train steps only.
    pub zero1: bool,
}

impl DataParallel {
    /// `world` ranks, DDP's bucket size, no ZeRO.
    pub fn new(world: usize) -> Self {
        DataParallel { world, bucket_bytes: DEFAULT_BUCKET_BYTES, zero1: false }
    }

    /// At least one rank and a positive bucket size.
    pub(crate) fn check(&self) -> Result<()> {
        if self.world == 0 {
            return Err(Error::Parallel("the number of ranks must be at least 1".into()));
        }
        if self.bucket_bytes == 0 {
            return Err(Error::Parallel("the gradient bucket size must be at least 1 byte".into()));
        }
        Ok(())
    }
}

/// The rows of the global batch each rank takes.
pub fn rank_batch(global: usize, world: usize) -> Result<usize> {
    if world == 0 || !global.is_multiple_of(world) {
        return Err(Error::Parallel(format!(
            "the global batch of {global} rows does not split over {world} ranks: \
             each rank takes batch/ranks rows, so the batch must be a multiple of the number of ranks"
        )));
    }
    Ok(global / world)
}

/// `spec` with the global batch replaced by one rank's rows.
pub fn rank_spec(spec: &ModelSpec, world: usize) -> Result<ModelSpec> {
    Ok(ModelSpec { batch: rank_batch(spec.batch, world)?, ..spec.clone() })
}

/// Rank `rank`'s rows (dim 0) of a global-batch step input.
pub fn shard_rows(t: &HostTensor, rank: usize, world: usize) -> Result<HostTensor> {
    let rows = *t.ty.shape.first().ok_or_else(|| Error::Input {
        name: t.ty.to_string(),
        reason: "a scalar has no batch rows to split over ranks".into(),
    })?;
    let per = rank_batch(rows, world)?;
    if rank >= world {
        return Err(Error::Parallel(format!("rank {rank} is outside a group of {world}")));
    }
    let mut shape = t.ty.shape.clone();
    shape[0] = per;
    let mut out = HostTensor::zeros(t.ty.with_shape(shape));
    let n = out.bytes().len();
    out.bytes_mut().copy_from_slice(&t.bytes()[rank * n..(rank + 1) * n]);
    Ok(out)
}

/// One bucket of gradients (values of the source trace), in production order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub grads: Vec<ValueId>,
    pub bytes: u64,
    /// The node that produces the bucket's last gradient: its collective goes right after it.
    pub after: NodeId,
}

/// Every parameter gradient of a step (the `grad` outputs of a grads step,
/// the gradient operands of a train step's AdamW updates), each once, in the
/// order backward produces them.
pub fn gradient_order(step: &Trace) -> Result<Vec<ValueId>> {
    let mut grads: Vec<ValueId> = Vec::new();
    for o in &step.outputs {
        if let OutputKind::Grad(_) = o.kind {
            grads.push(o.value);
        }
    }
    for node in step.nodes.iter().filter(|n| n.phase == Phase::Optimizer) {
        if let Op::AdamW(_) = node.op {
            grads.push(unscaled(step, node.inputs[1]));
        }
    }
    let mut keyed = Vec::with_capacity(grads.len());
    for g in grads {
        let Some(n) = step.producer(g) else {
            return Err(Error::Parallel(format!("gradient {} is a leaf, not computed by backward", step.describe(g))));
        };
        let k = step.node(n).outputs.iter().position(|&o| o == g).expect("a node defines its outputs");
        keyed.push(((n.index(), k), g));
    }
    keyed.sort();
    keyed.dedup();
    if keyed.is_empty() {
        return Err(Error::Parallel(format!(
            "the step `{}` has no gradients to reduce: data parallelism applies to grads and train steps",
            step.name
        )));
    }
    Ok(keyed.into_iter().map(|(_, g)| g).collect())
}

/// The gradient backward made, behind the optimizer-phase rescaling an
/// update may read instead: gradient clipping's `mul(g, scale)`
/// ([`crate::autodiff::clip_by_global_norm`]) is looked through to `g`, so
/// the buckets reduce the gradients themselves and the clipping (in the
/// optimizer phase) reads the reduced ones.
fn unscaled(step: &Trace, mut g: ValueId) -> ValueId {
    while let Some(n) = step.producer(g) {
        let node = step.node(n);
        match &node.op {
            Op::Binary(b) if node.phase == Phase::Optimizer && b.f == BinaryFn::Mul => g = node.inputs[0],
            _ => break,
        }
    }
    g
}

/// The buckets of `step`'s gradients for a budget of `bucket_bytes`.
pub fn buckets(step: &Trace, bucket_bytes: u64) -> Result<Vec<Bucket>> {
    let mut out: Vec<Bucket> = Vec::new();
    let mut open: Option<Bucket> = None;
    for g in gradient_order(step)? {
        let after = step.producer(g).expect("gradient_order checked");
        let b = open.get_or_insert_with(|| Bucket { grads: vec![], bytes: 0, after });
        b.grads.push(g);
        b.bytes += step.ty(g).bytes();
        b.after = after;
        if b.bytes >= bucket_bytes {
            out.extend(open.take());
        }
    }
    out.extend(open);
    Ok(out)
}

/// The positions of a step's AdamW updates (inputs `p, g, m, v, lr, step[, w]`).
fn adamw_nodes(step: &Trace) -> Vec<usize> {
    (0..step.nodes.len()).filter(|&i| matches!(step.nodes[i].op, Op::AdamW(_))).collect()
}

/// Rewrites `step` (a grads or train step) as the step of one rank of
/// `dp.world`; see the module doc.
pub fn data_parallel(step: &Trace, dp: &DataParallel) -> Result<Trace> {
    dp.check()?;
    let world = dp.world;
    let buckets = buckets(step, dp.bucket_bytes)?;
    let adamws = adamw_nodes(step);
    if dp.zero1 && adamws.is_empty() {
        return Err(Error::Parallel(format!(
            "ZeRO-1 shards optimizer state, and the step `{}` has no optimizer: use it with a train step",
            step.name
        )));
    }

    // ZeRO-1: which state leaves are AdamW moments, and every parameter must shard.
    let mut sharded_state = vec![false; step.values.len()];
    if dp.zero1 {
        for &ni in &adamws {
            let node = &step.nodes[ni];
            let p = node.inputs[0];
            shard_type(step.ty(p), world).map_err(|e| {
                Error::Parallel(format!(
                    "ZeRO-1 over {world} ranks cannot shard {}: {e}; choose a number of ranks that divides \
                     every parameter's element count",
                    step.describe(p)
                ))
            })?;
            let Op::AdamW(hyper) = &node.op else { unreachable!("adamw nodes only") };
            let master = (hyper.master != MasterWeights::None).then(|| node.inputs[6]);
            for s in node.inputs[2..4].iter().copied().chain(master) {
                if !matches!(step.value(s).kind, ValueKind::State { .. }) {
                    return Err(Error::Parallel(format!(
                        "ZeRO-1 expects AdamW moments to be optimizer state, got {}",
                        step.describe(s)
                    )));
                }
                sharded_state[s.index()] = true;
            }
        }
        if let Some(n) = step.nodes.iter().find(|n| n.phase == Phase::Optimizer && !matches!(n.op, Op::AdamW(_))) {
            return Err(Error::Parallel(format!(
                "ZeRO-1 shards `adamw` updates only, and the optimizer also runs `{}`",
                n.op.name()
            )));
        }
        // Every update must be one of the AdamW nodes' rebuilt below.
        let outputs: usize = adamws.iter().map(|&ni| step.nodes[ni].outputs.len()).sum();
        if step.updates.len() != outputs {
            return Err(Error::Parallel(format!(
                "ZeRO-1 rewrites the {outputs} updates of {} AdamW nodes, but the step has {} state updates",
                adamws.len(),
                step.updates.len()
            )));
        }
    }

    let mut b = Builder::new(step.name.clone());
    let mut map: Vec<Option<ValueId>> = vec![None; step.values.len()];
    for v in step.leaves() {
        let val = step.value(v);
        let name = val.kind.leaf_name().expect("a leaf");
        let nv = match &val.kind {
            ValueKind::Input { .. } => b.input(name, val.ty.clone())?,
            ValueKind::Param { .. } => b.param(name, val.ty.clone())?,
            ValueKind::Frozen { .. } => b.frozen(name, val.ty.clone())?,
            ValueKind::State { .. } if sharded_state[v.index()] => {
                b.state(name, shard_type(&val.ty, world).map_err(Error::Parallel)?)?
            }
            ValueKind::State { .. } => b.state(name, val.ty.clone())?,
            ValueKind::Node(_) => unreachable!("leaves only"),
        };
        map[v.index()] = Some(nv);
    }

    let mut closes: HashMap<usize, Vec<usize>> = HashMap::new();
    for (k, bk) in buckets.iter().enumerate() {
        closes.entry(bk.after.index()).or_default().push(k);
    }
    let loss = step.loss();
    let loss_node = loss.and_then(|l| step.producer(l));
    let mut reduced: HashMap<ValueId, ValueId> = HashMap::new();
    let mut new_loss = loss.map(|l| map[l.index()]).unwrap_or(None);
    let m = |map: &[Option<ValueId>], v: ValueId| map[v.index()].expect("defined before use");

    for (ni, node) in step.nodes.iter().enumerate() {
        if dp.zero1 && node.phase == Phase::Optimizer {
            break;
        }
        b.set_phase(node.phase);
        // The optimizer reads the reduced gradients; backward keeps reading
        // its local values (a gradient that is also another cotangent).
        let inputs: Vec<ValueId> = node
            .inputs
            .iter()
            .map(|&v| match (node.phase, reduced.get(&v)) {
                (Phase::Optimizer, Some(&r)) => r,
                _ => m(&map, v),
            })
            .collect();
        let outs = b.push(node.op.clone(), &inputs)?;
        for (&o, n) in node.outputs.iter().zip(outs) {
            map[o.index()] = Some(n);
        }
        if loss_node == Some(NodeId(ni as u32)) {
            let l = loss.expect("a loss node has a loss");
            new_loss = Some(b.all_reduce(ReduceOp::Mean, world, &[m(&map, l)])?[0]);
        }
        for &k in closes.get(&ni).map(Vec::as_slice).unwrap_or(&[]) {
            let grads: Vec<ValueId> = buckets[k].grads.iter().map(|&g| m(&map, g)).collect();
            let outs = if dp.zero1 {
                b.reduce_scatter(ReduceOp::Mean, world, &grads)?
            } else {
                b.all_reduce(ReduceOp::Mean, world, &grads)?
            };
            for (&g, r) in buckets[k].grads.iter().zip(outs) {
                reduced.insert(g, r);
            }
        }
    }

    let mut updates: Vec<(ValueId, ValueId)> = Vec::new();
    if dp.zero1 {
        b.set_phase(Phase::Optimizer);
        let bucket_of: HashMap<ValueId, usize> =
            buckets.iter().enumerate().flat_map(|(k, bk)| bk.grads.iter().map(move |&g| (g, k))).collect();
        for k in 0..buckets.len() {
            let (mut params, mut shards) = (Vec::new(), Vec::new());
            for &ni in adamws.iter().filter(|&&ni| bucket_of[&step.nodes[ni].inputs[1]] == k) {
                let node = &step.nodes[ni];
                let Op::AdamW(hyper) = &node.op else { unreachable!("adamw nodes only") };
                let i: Vec<ValueId> = node.inputs.iter().map(|&v| m(&map, v)).collect();
                let p_shard = b.local_shard(world, i[0])?;
                // The master state's shard starts from the parameter's shard (see `AdamW`).
                let w = (hyper.master != MasterWeights::None).then(|| i[6]);
                let (p2, m2, v2, w2) = b.adamw(p_shard, reduced[&node.inputs[1]], i[2], i[3], i[4], i[5], w, hyper)?;
                updates.push((i[2], m2));
                updates.push((i[3], v2));
                if let (Some(w), Some(w2)) = (w, w2) {
                    updates.push((w, w2));
                }
                params.push(i[0]);
                shards.push(p2);
            }
            if !params.is_empty() {
                let gathered = b.all_gather(world, &params, &shards)?;
                updates.extend(params.into_iter().zip(gathered));
            }
        }
    } else {
        updates.extend(step.updates.iter().map(|u| (m(&map, u.state), m(&map, u.new))));
    }

    for o in &step.outputs {
        let (kind, value) = match &o.kind {
            OutputKind::Loss => (OutputKind::Loss, new_loss.expect("the loss was rebuilt")),
            OutputKind::Grad(p) => (OutputKind::Grad(m(&map, *p)), reduced[&o.value]),
            OutputKind::Named(n) => (OutputKind::Named(n.clone()), m(&map, o.value)),
        };
        b.output(kind, value);
    }
    for (s, n) in updates {
        b.update(s, n);
    }
    b.finish("data_parallel")
}

/// [`data_parallel`] as a pass, on a step built for one rank's rows
/// ([`rank_spec`]); the report holds the bytes of each gradient bucket
/// ([`buckets`] of the step it receives).
#[derive(Clone, Debug)]
pub struct DataParallelRewrite(pub DataParallel);

impl Pass for DataParallelRewrite {
    fn name(&self) -> &'static str {
        "data_parallel"
    }

    fn run(&self, step: &Trace, cx: &mut PassContext) -> Result<Trace> {
        cx.refuse_segments(self.name())?;
        let sizes = buckets(step, self.0.bucket_bytes)?.iter().map(|b| b.bytes).collect();
        let out = data_parallel(step, &self.0)?;
        cx.report.buckets = Some(sizes);
        Ok(out)
    }
}
