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
//! **Invariants checked here** (the shape rule is checked by
//! [`super::lower`]): the node's group size is the session's; every NCCL
//! call is in place in NCCL's sense (all-gather: `send = recv + rank·count`;
//! reduce-scatter: `recv = send + rank·count`; all-reduce: `send = recv`) or
//! its buffers do not overlap, as NCCL requires.
//!
//! A collective completes at its own position in the stream: NCCL runs on
//! the session's stream, so a reduce-scatter's full gradient may be reused
//! by the next launch, as the plan assumes.

use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::collective::{AllGather, AllReduce, LocalShard, ReduceOp, ReduceScatter};
use stepgraph_core::ops::OpDef;

use super::{GroupRank, Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::launch::{CollectiveCall, CollectiveOp, CollectivePart, DevTensor, Launch, NcclRed, NcclType};

/// The session's rank, which must be one of a group of `world`.
fn rank_in(op: &str, world: usize, group: Option<GroupRank>) -> Result<GroupRank> {
    let g = group.ok_or_else(|| {
        CudaError::lower(
            op,
            format!(
                "a collective for {world} ranks needs a session that is one rank of a group \
                 (CudaSession::new_rank with an NcclGroup)"
            ),
        )
    })?;
    if g.world != world {
        return Err(CudaError::lower(
            op,
            format!("the node is for {world} ranks, but this session is rank {} of {}", g.rank, g.world),
        ));
    }
    if g.rank >= g.world {
        return Err(CudaError::lower(op, format!("rank {} is outside a group of {}", g.rank, g.world)));
    }
    Ok(g)
}

/// One bucket: a call per `(send, recv, count)` with a non-zero count, each
/// checked against NCCL's aliasing rule; nothing when every count is 0.
fn bucket<'a>(
    op: &str,
    cop: CollectiveOp,
    g: GroupRank,
    calls: impl Iterator<Item = (&'a DevTensor, &'a DevTensor, usize)>,
) -> Result<Vec<Launch>> {
    let mut parts = Vec::new();
    for (send, recv, count) in calls.filter(|c| c.2 > 0) {
        let p = CollectivePart { send: send.ptr, recv: recv.ptr, count, ty: nccl_type(op, &send.ty)? };
        check_overlap(op, cop, &p, g.rank, g.world)?;
        parts.push(p);
    }
    Ok(if parts.is_empty() {
        vec![]
    } else {
        vec![Launch::Collective(CollectiveCall { op: cop, world: g.world, parts })]
    })
}

impl Lower for AllReduce {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let g = rank_in(self.name(), self.world, cx.group)?;
        let calls = cx.inputs.iter().zip(cx.outputs).map(|(i, o)| (i, o, i.ty.numel()));
        bucket(self.name(), CollectiveOp::AllReduce(red(self.op)), g, calls)
    }
}

impl Lower for ReduceScatter {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let g = rank_in(self.name(), self.world, cx.group)?;
        let calls = cx.inputs.iter().zip(cx.outputs).map(|(i, o)| (i, o, o.ty.numel()));
        bucket(self.name(), CollectiveOp::ReduceScatter(red(self.op)), g, calls)
    }
}

impl Lower for AllGather {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let g = rank_in(self.name(), self.world, cx.group)?;
        // Inputs: the destinations (which the outputs are), then the shards.
        let shards = &cx.inputs[self.tensors..];
        let calls = shards.iter().zip(cx.outputs).map(|(s, o)| (s, o, s.ty.numel()));
        bucket(self.name(), CollectiveOp::AllGather, g, calls)
    }
}

impl Lower for LocalShard {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let g = rank_in(self.name(), self.world, cx.group)?;
        let (src, dst) = (&cx.inputs[0], &cx.outputs[0]);
        let bytes = dst.ty.bytes();
        Ok(vec![Launch::Copy { dst: dst.ptr, src: src.ptr + g.rank as u64 * bytes, bytes }])
    }
}

fn red(op: ReduceOp) -> NcclRed {
    match op {
        ReduceOp::Sum => NcclRed::Sum,
        ReduceOp::Mean => NcclRed::Avg,
    }
}

fn nccl_type(op: &str, t: &TensorType) -> Result<NcclType> {
    Ok(match t.dtype {
        DType::F32 => NcclType::F32,
        DType::BF16 => NcclType::BF16,
        DType::F16 => NcclType::F16,
        DType::F64 => NcclType::F64,
        d => {
            return Err(CudaError::unsupported(
                op,
                format!("NCCL collectives here take f32, bf16, f16 or f64, not {d}"),
            ))
        }
    })
}

/// NCCL's rule: a call is in place (its one in-place layout) or its two
/// buffers are disjoint. The full side of a reduce-scatter or all-gather
/// holds `world · count` elements.
fn check_overlap(op: &str, cop: CollectiveOp, p: &CollectivePart, rank: usize, world: usize) -> Result<()> {
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
        op,
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
    use stepgraph_core::ops::Op;

    use super::super::lower;
    use super::super::testing::rank;
    use super::*;

    fn t(dtype: DType, shape: &[usize], ptr: u64) -> DevTensor {
        DevTensor { ty: TensorType::new(dtype, shape.to_vec()), ptr }
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
        // The backend's entry point is this dispatch.
        let l = crate::lower::lower(&node, std::slice::from_ref(&x), std::slice::from_ref(&x), rank(1, 2)).unwrap();
        assert!(matches!(l.as_slice(), [Launch::Collective(_)]));
    }
}
