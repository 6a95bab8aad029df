//! Lowering a whole step, without a device: each node, with the fixed
//! addresses of its operands, becomes [`Launch`]es in a [`LaunchList`],
//! which the merge rules then shorten (multi-tensor AdamW, a layer's two
//! cache writes, its q and k rotations). The dispatch, generated from
//! core's op list, and every op's lowering live in [`crate::ops`]; the
//! session binds the list to its allocation, and `plan` and `generate`
//! count launches from it before any GPU is at hand ([`step_launches`]).

use stepgraph_core::ir::{Trace, ValueId};
use stepgraph_core::plan::{MemoryPlan, Region};

use crate::error::Result;
use crate::launch::{DevTensor, Launch, LaunchList};
use crate::switches::Switches;

pub use crate::ops::{lower, lower_for, GroupRank, Target};

/// Where each region of a plan starts, as device addresses.
#[derive(Copy, Clone, Debug)]
pub struct Bases {
    pub persistent: u64,
    pub arena: u64,
    /// The device address of the page-locked host allocation (0 without one).
    pub host: u64,
}

impl Bases {
    /// Stand-in bases far apart and 2 MiB aligned, like the driver's
    /// allocations, for lowering without a device.
    pub const STAND_IN: Bases = Bases { persistent: 1 << 40, arena: 1 << 44, host: 1 << 45 };

    pub fn of(&self, region: Region) -> u64 {
        match region {
            Region::Persistent => self.persistent,
            Region::Arena => self.arena,
            Region::Host => self.host,
        }
    }
}

/// Value `v` at its planned address.
pub fn dev_tensor(trace: &Trace, plan: &MemoryPlan, bases: Bases, v: ValueId) -> DevTensor {
    let s = plan.slot(v);
    DevTensor { ty: trace.ty(v).clone(), ptr: bases.of(s.region) + s.offset }
}

/// The launch list of a whole step: every node lowered over the plan's
/// addresses (each region's slots from its base in `bases`) for `group`'s
/// rank and a device of `target`, one entry per launch with its node.
/// Data only: nothing calls the CUDA driver.
pub fn lower_step(
    trace: &Trace,
    plan: &MemoryPlan,
    bases: Bases,
    group: Option<GroupRank>,
    target: Target,
) -> Result<LaunchList> {
    let view = |v: ValueId| dev_tensor(trace, plan, bases, v);
    let mut list = LaunchList::default();
    for (n, node) in trace.nodes.iter().enumerate() {
        let ins: Vec<DevTensor> = node.inputs.iter().map(|&v| view(v)).collect();
        let outs: Vec<DevTensor> = node.outputs.iter().map(|&v| view(v)).collect();
        for l in lower_for(&node.op, &ins, &outs, group, target)? {
            list.push(l, n, n);
        }
    }
    Ok(list)
}

/// `list` with the step's AdamW updates merged into multi-tensor launches
/// where they run back to back ([`crate::ops::optim::merge_updates`]), a
/// layer's two cache writes into one launch
/// ([`crate::ops::decode::merge_kv_writes`]) and its q and k rotations into
/// one ([`crate::ops::rope::merge_ropes`]), unless the step has
/// collectives (whose joins are computed per node) or
/// [`Switches::multi_tensor`] is off (for comparisons).
pub fn merge_launches(list: LaunchList, switches: &Switches) -> LaunchList {
    if !switches.multi_tensor || list.launches.iter().any(|l| matches!(l, Launch::Collective(_))) {
        return list;
    }
    let list = crate::ops::optim::merge_updates(list);
    let list = crate::ops::decode::merge_kv_writes(list);
    crate::ops::rope::merge_ropes(list)
}

/// The launches one step of `trace` makes on a device of architecture
/// `arch` (`sm_90`, ...) under `switches`, exactly as a session lowers and
/// merges them (storage at [`Bases::STAND_IN`], without the CUDA driver):
/// how many kernels a step is, before any GPU is at hand.
pub fn step_launches(trace: &Trace, plan: &MemoryPlan, arch: &str, switches: &Switches) -> Result<LaunchList> {
    let target = Target::of_arch(arch, *switches);
    Ok(merge_launches(lower_step(trace, plan, Bases::STAND_IN, None, target)?, switches))
}

/// The device bytes `[start, end)` each node's inputs and outputs occupy.
pub fn node_ranges(trace: &Trace, plan: &MemoryPlan, bases: Bases) -> Vec<Vec<(u64, u64)>> {
    trace
        .nodes
        .iter()
        .map(|node| {
            node.inputs
                .iter()
                .chain(&node.outputs)
                .map(|&v| {
                    let t = dev_tensor(trace, plan, bases, v);
                    (t.ptr, t.ptr + t.ty.bytes())
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use stepgraph_core::autodiff::StepKind;
    use stepgraph_core::ir::DType;
    use stepgraph_core::models::{LossKind, ModelSpec};
    use stepgraph_core::pipeline::{compile_step, StepOptions};
    use stepgraph_core::plan::PlanOptions;
    use stepgraph_core::train_program::with_validation;

    /// A session runs a training program's segments as node ranges, which
    /// no merged launch may straddle: the evaluation's last launch and the
    /// step's first stay apart, with every merge on (multi-tensor AdamW
    /// under clipping, q and k rotations).
    #[test]
    fn no_launch_of_a_training_program_spans_its_two_segments() {
        let spec = ModelSpec::named("tiny-llama", 2, 16, DType::BF16, LossKind::CrossEntropy).unwrap();
        let mut opts = StepOptions::new(StepKind::Train);
        opts.train.clip_grad_norm = Some(1.0);
        let p = with_validation(&compile_step(&spec, &opts).unwrap(), PlanOptions::default()).unwrap();
        let switches = Switches::default();
        assert!(switches.multi_tensor);
        let list = step_launches(&p.trace, &p.plan, "sm_90", &switches).unwrap();
        let merged = list.first_nodes.iter().zip(&list.last_nodes).filter(|(f, l)| f != l).count();
        assert!(merged > 0, "the step merges launches");
        for (&first, &last) in list.first_nodes.iter().zip(&list.last_nodes) {
            assert!(!(first < p.step.start && last >= p.step.start), "a launch of nodes {first}..={last}");
        }
    }
}
