//! Lowering of the collective ops ([`stepgraph_core::ops::collective`]) to
//! NCCL calls at the plan's addresses. Data only: a bucket node becomes one
//! [`Launch::Collective`] (one NCCL group, one call per tensor), which the
//! session issues on its stream, eagerly or under graph capture.
//!
//! | op | NCCL, per tensor `i` of the bucket |
//! | --- | --- |
//! | `all_reduce_sum/mean` | `ncclAllReduce(in i → out i, numel, ncclSum/ncclAvg)`, in place when planned so |
//! | `reduce_scatter_sum/mean` | `ncclReduceScatter(in i → out i, recvcount = numel / world)` |
//! | `all_gather` | `ncclAllGather(in k+i (shard) → out i (full), sendcount = shard numel)` |
//! | `local_shard` | no NCCL: a device copy of bytes `[rank·s, (rank+1)·s)` of the input |
//!
//! Shards are the IR's flat equal element ranges, rank `r` owning elements
//! `[r·n/world, (r+1)·n/world)`: exactly NCCL's layout for reduce-scatter
//! output and all-gather input, so no packing is needed.
//!
//! **Invariants checked here:** the operands match the op's shape rule; the
//! node's group size is the session's; every NCCL call is in place in
//! NCCL's sense (all-gather: `send = recv + rank·count`; reduce-scatter:
//! `recv = send + rank·count`; all-reduce: `send = recv`) or its buffers do
//! not overlap, as NCCL requires.
//!
//! A collective completes at its own position in the stream: NCCL runs on
//! the session's stream, so a reduce-scatter's full gradient may be reused
//! by the next launch, as the plan assumes.

use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::collective::ReduceOp;
use stepgraph_core::ops::Op;

use crate::error::{CudaError, Result};
use crate::launch::{CollectiveCall, CollectiveOp, CollectivePart, DevTensor, Launch, NcclRed, NcclType};
use crate::lower::GroupRank;

/// The device work of one collective node for `group`'s rank.
pub fn lower(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor], group: Option<GroupRank>) -> Result<Vec<Launch>> {
    let world = stepgraph_core::ops::collective::world_of(op).ok_or_else(|| crate::lower::not_routed(op))?;
    let g = group.ok_or_else(|| {
        CudaError::lower(
            op.name(),
            format!(
                "a collective for {world} ranks needs a session that is one rank of a group \
                 (CudaSession::new_rank with an NcclGroup)"
            ),
        )
    })?;
    if g.world != world {
        return Err(CudaError::lower(
            op.name(),
            format!("the node is for {world} ranks, but this session is rank {} of {}", g.rank, g.world),
        ));
    }
    if g.rank >= g.world {
        return Err(CudaError::lower(op.name(), format!("rank {} is outside a group of {}", g.rank, g.world)));
    }
    check_types(op, inputs, outputs)?;
    let part = |send: &DevTensor, recv: &DevTensor, count: usize| -> Result<CollectivePart> {
        Ok(CollectivePart { send: send.ptr, recv: recv.ptr, count, ty: nccl_type(op, &send.ty)? })
    };
    let (cop, parts) = match op {
        Op::AllReduce(o) => {
            let parts =
                inputs.iter().zip(outputs).map(|(i, o)| part(i, o, i.ty.numel())).collect::<Result<Vec<_>>>()?;
            (CollectiveOp::AllReduce(red(o.op)), parts)
        }
        Op::ReduceScatter(o) => {
            let parts =
                inputs.iter().zip(outputs).map(|(i, o)| part(i, o, o.ty.numel())).collect::<Result<Vec<_>>>()?;
            (CollectiveOp::ReduceScatter(red(o.op)), parts)
        }
        Op::AllGather(o) => {
            let shards = &inputs[o.tensors..];
            let parts =
                shards.iter().zip(outputs).map(|(s, o)| part(s, o, s.ty.numel())).collect::<Result<Vec<_>>>()?;
            (CollectiveOp::AllGather, parts)
        }
        Op::LocalShard(_) => {
            let (src, dst) = (&inputs[0], &outputs[0]);
            let bytes = dst.ty.bytes();
            return Ok(if bytes == 0 {
                vec![]
            } else {
                vec![Launch::Copy { dst: dst.ptr, src: src.ptr + g.rank as u64 * bytes, bytes }]
            });
        }
        _ => return Err(crate::lower::not_routed(op)),
    };
    let parts: Vec<CollectivePart> = parts.into_iter().filter(|p| p.count > 0).collect();
    for p in &parts {
        check_overlap(op, cop, p, g.rank, world)?;
    }
    Ok(if parts.is_empty() { vec![] } else { vec![Launch::Collective(CollectiveCall { op: cop, world, parts })] })
}

fn red(op: ReduceOp) -> NcclRed {
    match op {
        ReduceOp::Sum => NcclRed::Sum,
        ReduceOp::Mean => NcclRed::Avg,
    }
}

fn nccl_type(op: &Op, t: &TensorType) -> Result<NcclType> {
    Ok(match t.dtype {
        DType::F32 => NcclType::F32,
        DType::BF16 => NcclType::BF16,
        DType::F16 => NcclType::F16,
        DType::F64 => NcclType::F64,
        d => {
            return Err(CudaError::lower(
                op.name(),
                format!("NCCL collectives here take f32, bf16, f16 or f64, not {d}"),
            ))
        }
    })
}

fn check_types(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<()> {
    let tys: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let want = op.infer(&tys).map_err(|e| CudaError::lower(op.name(), e))?;
    let got: Vec<&TensorType> = outputs.iter().map(|t| &t.ty).collect();
    if want.iter().collect::<Vec<_>>() != got {
        return Err(CudaError::lower(op.name(), format!("outputs {got:?} do not match the shape rule's {want:?}")));
    }
    Ok(())
}

/// NCCL's rule: a call is in place (its one in-place layout) or its two
/// buffers are disjoint. The full side of a reduce-scatter or all-gather
/// holds `world · count` elements.
fn check_overlap(op: &Op, cop: CollectiveOp, p: &CollectivePart, rank: usize, world: usize) -> Result<()> {
    let n = p.count as u64 * p.ty.size();
    let (rank, world) = (rank as u64, world as u64);
    let (send_bytes, recv_bytes, in_place) = match cop {
        CollectiveOp::AllReduce(_) => (n, n, p.send == p.recv),
        CollectiveOp::ReduceScatter(_) => (world * n, n, p.recv == p.send + rank * n),
        CollectiveOp::AllGather => (n, world * n, p.send == p.recv + rank * n),
    };
    let disjoint = p.send + send_bytes <= p.recv || p.recv + recv_bytes <= p.send;
    if in_place || disjoint {
        return Ok(());
    }
    Err(CudaError::lower(
        op.name(),
        format!(
            "{}: send buffer 0x{:x} ({send_bytes} bytes) and receive buffer 0x{:x} ({recv_bytes} bytes) overlap \
             without being NCCL's in-place layout",
            cop.nccl_name(),
            p.send,
            p.recv
        ),
    ))
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ops::collective::{AllGather, AllReduce, LocalShard, ReduceScatter};

    use super::*;

    fn t(dtype: DType, shape: &[usize], ptr: u64) -> DevTensor {
        DevTensor { ty: TensorType::new(dtype, shape.to_vec()), ptr }
    }

    fn rank(rank: usize, world: usize) -> Option<GroupRank> {
        Some(GroupRank { rank, world })
    }

    fn one_call(l: Vec<Launch>) -> CollectiveCall {
        match <[Launch; 1]>::try_from(l) {
            Ok([Launch::Collective(c)]) => c,
            Ok(other) => panic!("expected one collective, got {other:?}"),
            Err(l) => panic!("expected one launch, got {l:?}"),
        }
    }

    #[test]
    fn all_reduce_is_one_group_with_a_call_per_tensor_in_place() {
        let a = t(DType::F32, &[4, 8], 0x1000);
        let b = t(DType::BF16, &[3], 0x2000);
        let c = t(DType::F16, &[5], 0x3000);
        let d = t(DType::F64, &[2, 2], 0x4000);
        let ins = [a.clone(), b.clone(), c.clone(), d.clone()];
        for (op, want) in [(ReduceOp::Mean, NcclRed::Avg), (ReduceOp::Sum, NcclRed::Sum)] {
            let node = Op::from(AllReduce { op, world: 2, tensors: 4 });
            let call = one_call(lower(&node, &ins, &ins, rank(1, 2)).unwrap());
            assert_eq!(
                call,
                CollectiveCall {
                    op: CollectiveOp::AllReduce(want),
                    world: 2,
                    parts: vec![
                        CollectivePart { send: 0x1000, recv: 0x1000, count: 32, ty: NcclType::F32 },
                        CollectivePart { send: 0x2000, recv: 0x2000, count: 3, ty: NcclType::BF16 },
                        CollectivePart { send: 0x3000, recv: 0x3000, count: 5, ty: NcclType::F16 },
                        CollectivePart { send: 0x4000, recv: 0x4000, count: 4, ty: NcclType::F64 },
                    ],
                }
            );
        }
        // Out of place when the plan did not alias: disjoint buffers are fine.
        let node = Op::from(AllReduce { op: ReduceOp::Mean, world: 1, tensors: 1 });
        let call =
            one_call(lower(&node, std::slice::from_ref(&a), &[t(DType::F32, &[4, 8], 0x9000)], rank(0, 1)).unwrap());
        assert_eq!(call.parts[0], CollectivePart { send: 0x1000, recv: 0x9000, count: 32, ty: NcclType::F32 });
        // Overlapping but not the same buffer: NCCL's behaviour is undefined.
        let e = lower(&node, &[a], &[t(DType::F32, &[4, 8], 0x1004)], rank(0, 1)).unwrap_err().to_string();
        assert!(e.contains("overlap") && e.contains("ncclAllReduce"), "{e}");
    }

    #[test]
    fn reduce_scatter_receives_the_ranks_shard_count() {
        let g = t(DType::BF16, &[8, 4], 0x10000);
        let h = t(DType::F32, &[12], 0x20000);
        let outs = [t(DType::BF16, &[8], 0x30000), t(DType::F32, &[3], 0x40000)];
        let node = Op::from(ReduceScatter { op: ReduceOp::Mean, world: 4, tensors: 2 });
        let call = one_call(lower(&node, &[g.clone(), h], &outs, rank(2, 4)).unwrap());
        assert_eq!(call.op, CollectiveOp::ReduceScatter(NcclRed::Avg));
        assert_eq!(
            call.parts,
            vec![
                CollectivePart { send: 0x10000, recv: 0x30000, count: 8, ty: NcclType::BF16 },
                CollectivePart { send: 0x20000, recv: 0x40000, count: 3, ty: NcclType::F32 },
            ]
        );
        let sum = Op::from(ReduceScatter { op: ReduceOp::Sum, world: 4, tensors: 1 });
        // NCCL's in-place layout: the shard sits at the rank's offset of the full buffer.
        let inside = t(DType::BF16, &[8], 0x10000 + 2 * 16);
        let call = one_call(lower(&sum, std::slice::from_ref(&g), &[inside], rank(2, 4)).unwrap());
        assert_eq!(call.op, CollectiveOp::ReduceScatter(NcclRed::Sum));
        let elsewhere = t(DType::BF16, &[8], 0x10000 + 16);
        let e = lower(&sum, &[g], &[elsewhere], rank(2, 4)).unwrap_err().to_string();
        assert!(e.contains("ncclReduceScatter") && e.contains("overlap"), "{e}");
    }

    #[test]
    fn all_gather_sends_shards_into_the_destinations() {
        // Inputs: destinations (parameters), then shards; outputs live in the destinations.
        let dests = [t(DType::F32, &[4, 4], 0x1_0000), t(DType::BF16, &[6], 0x2_0000)];
        let shards = [t(DType::F32, &[8], 0x8_0000), t(DType::BF16, &[3], 0x9_0000)];
        let ins: Vec<DevTensor> = dests.iter().chain(&shards).cloned().collect();
        let node = Op::from(AllGather { world: 2, tensors: 2 });
        let call = one_call(lower(&node, &ins, &dests, rank(1, 2)).unwrap());
        assert_eq!(
            call,
            CollectiveCall {
                op: CollectiveOp::AllGather,
                world: 2,
                parts: vec![
                    CollectivePart { send: 0x8_0000, recv: 0x1_0000, count: 8, ty: NcclType::F32 },
                    CollectivePart { send: 0x9_0000, recv: 0x2_0000, count: 3, ty: NcclType::BF16 },
                ],
            }
        );
        // A shard already at the rank's offset of its destination is NCCL's in-place form.
        let in_place = [dests[0].clone(), t(DType::F32, &[8], 0x1_0000 + 32)];
        assert!(lower(&Op::from(AllGather { world: 2, tensors: 1 }), &in_place, &dests[..1], rank(1, 2)).is_ok());
        let wrong = [dests[0].clone(), t(DType::F32, &[8], 0x1_0000)];
        let e = lower(&Op::from(AllGather { world: 2, tensors: 1 }), &wrong, &dests[..1], rank(1, 2)).unwrap_err();
        assert!(e.to_string().contains("ncclAllGather"), "{e}");
    }

    #[test]
    fn local_shard_copies_the_ranks_range() {
        let x = t(DType::BF16, &[4, 6], 0x5000);
        let y = t(DType::BF16, &[6], 0x9000);
        let node = Op::from(LocalShard { world: 4 });
        for r in 0..4 {
            let l = lower(&node, std::slice::from_ref(&x), std::slice::from_ref(&y), rank(r, 4)).unwrap();
            assert_eq!(l, vec![Launch::Copy { dst: 0x9000, src: 0x5000 + 12 * r as u64, bytes: 12 }]);
        }
        let one = Op::from(LocalShard { world: 1 });
        let whole = t(DType::BF16, &[24], 0x9000);
        let l = lower(&one, &[x], &[whole], rank(0, 1)).unwrap();
        assert_eq!(l, vec![Launch::Copy { dst: 0x9000, src: 0x5000, bytes: 48 }]);
    }

    #[test]
    fn collectives_need_a_matching_group_and_the_shape_rule() {
        let x = t(DType::F32, &[8], 0x1000);
        let node = Op::from(AllReduce { op: ReduceOp::Mean, world: 2, tensors: 1 });
        let e = lower(&node, std::slice::from_ref(&x), std::slice::from_ref(&x), None).unwrap_err().to_string();
        assert!(e.contains("all_reduce_mean") && e.contains("one rank of a group"), "{e}");
        let e = lower(&node, std::slice::from_ref(&x), std::slice::from_ref(&x), rank(0, 4)).unwrap_err().to_string();
        assert!(e.contains("for 2 ranks") && e.contains("rank 0 of 4"), "{e}");
        let e = lower(&node, std::slice::from_ref(&x), std::slice::from_ref(&x), rank(2, 2)).unwrap_err().to_string();
        assert!(e.contains("outside a group of 2"), "{e}");
        let rs = Op::from(ReduceScatter { op: ReduceOp::Sum, world: 2, tensors: 1 });
        let e = lower(&rs, std::slice::from_ref(&x), &[t(DType::F32, &[8], 0x9000)], rank(0, 2)).unwrap_err();
        assert!(e.to_string().contains("shape rule"), "{e}");
        // Every collective routes here from the backend's lowering entry point.
        let l = crate::lower::lower(&node, std::slice::from_ref(&x), std::slice::from_ref(&x), rank(1, 2)).unwrap();
        assert!(matches!(l.as_slice(), [Launch::Collective(_)]));
    }
}
