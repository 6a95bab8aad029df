//! Test support for the lowering tests: operands at fake addresses (the
//! lowering never dereferences them) and shorthands for reading launches.

use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::Op;

use super::{lower, GroupRank};
use crate::error::{CudaError, Result};
use crate::launch::{DevTensor, KernelLaunch, Launch};

/// Operands at distinct 256-byte-aligned fake addresses (as the planner
/// gives), 16 MiB apart from `base`, shifted by `skew` bytes.
pub(crate) fn operands(types: &[TensorType], base: u64, skew: u64) -> Vec<DevTensor> {
    types
        .iter()
        .enumerate()
        .map(|(i, t)| DevTensor { ty: t.clone(), ptr: base + (i as u64) * (1 << 24) + skew })
        .collect()
}

/// Input and output operands of `op` on inputs of `types` (outputs from the
/// shape rule), at fake addresses skewed by `skew` bytes.
pub(crate) fn operands_of(op: &Op, types: &[TensorType], skew: u64) -> Result<(Vec<DevTensor>, Vec<DevTensor>)> {
    let refs: Vec<&TensorType> = types.iter().collect();
    let outs = op.infer(&refs).map_err(|e| CudaError::lower(op.name(), e))?;
    Ok((operands(types, 1 << 40, skew), operands(&outs, 1 << 41, skew)))
}

/// Lowers `op` on inputs of `types`, outputs from the shape rule, outside any group.
pub(crate) fn lower_types(op: &Op, types: &[TensorType], skew: u64) -> Result<Vec<Launch>> {
    let (ins, outs) = operands_of(op, types, skew)?;
    lower(op, &ins, &outs, None)
}

/// Lowers `op` on fresh operands; returns the inputs, outputs and launches.
pub(crate) fn lowered(op: &Op, types: &[TensorType]) -> (Vec<DevTensor>, Vec<DevTensor>, Vec<Launch>) {
    let (ins, outs) = operands_of(op, types, 0).unwrap();
    let launches = lower(op, &ins, &outs, None).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    (ins, outs, launches)
}

/// The kernel launches of `launches`, which must all be kernels.
pub(crate) fn kernels(launches: &[Launch]) -> Vec<&KernelLaunch> {
    launches
        .iter()
        .map(|l| match l {
            Launch::Kernel(k) => k,
            other => panic!("expected a kernel launch, got {other:?}"),
        })
        .collect()
}

/// The function of the first launch of `op` on inputs of `types`.
pub(crate) fn function(op: impl Into<Op>, types: &[TensorType]) -> String {
    let launches = lower_types(&op.into(), types, 0).unwrap();
    kernels(&launches)[0].function.clone()
}

pub(crate) fn t(dt: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dt, shape.to_vec())
}

/// A group of `world` ranks seen from `rank`.
pub(crate) fn rank(rank: usize, world: usize) -> Option<GroupRank> {
    Some(GroupRank { rank, world })
}
