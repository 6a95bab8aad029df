//! Lowering: each node of the step, with the fixed addresses of its
//! operands, becomes a list of [`Launch`]es. The op families live in their
//! own modules; this file only routes.

use stepgraph_core::ops::Op;

use crate::error::{CudaError, Result};
use crate::launch::{DevTensor, Launch};

/// A session's place in a data-parallel group: what the collective
/// lowerings need beyond addresses (`local_shard` copies at `rank`'s offset).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GroupRank {
    pub rank: usize,
    pub world: usize,
}

/// The device work of one node. `group` is the session's rank, `None` for a
/// session outside any group (which cannot run collectives).
pub fn lower(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor], group: Option<GroupRank>) -> Result<Vec<Launch>> {
    match op {
        Op::MatMul(m) => Ok(vec![crate::blas::lower_matmul(m, inputs, outputs)?]),
        Op::Reshape(_) => {
            // Planned programs alias a view with its source; copy only when they do not.
            let (src, dst) = (&inputs[0], &outputs[0]);
            Ok(if src.ptr == dst.ptr {
                vec![]
            } else {
                vec![Launch::Copy { dst: dst.ptr, src: src.ptr, bytes: src.ty.bytes() }]
            })
        }
        Op::Attention(_) | Op::AttentionBackward(_) => crate::attention::lower(op, inputs, outputs),
        Op::RmsNorm(_)
        | Op::RmsNormBackward(_)
        | Op::LayerNorm(_)
        | Op::LayerNormBackward(_)
        | Op::Rope(_)
        | Op::Softmax(_)
        | Op::SoftmaxBackward(_)
        | Op::CrossEntropy(_)
        | Op::CrossEntropyBackward(_) => crate::lower_nn::lower(op, inputs, outputs),
        Op::Full(_)
        | Op::Unary(_)
        | Op::UnaryBackward(_)
        | Op::Binary(_)
        | Op::Cast(_)
        | Op::Reduce(_)
        | Op::MaxBackward(_)
        | Op::Broadcast(_)
        | Op::Permute(_)
        | Op::Slice(_)
        | Op::SliceBackward(_)
        | Op::Concat(_)
        | Op::Embedding(_)
        | Op::EmbeddingBackward(_)
        | Op::AdamW(_) => crate::lower_basic::lower(op, inputs, outputs),
        Op::AllReduce(_) | Op::ReduceScatter(_) | Op::AllGather(_) | Op::LocalShard(_) => {
            crate::lower_dist::lower(op, inputs, outputs, group)
        }
    }
}

/// The error for an op routed to a family module that does not handle it.
pub(crate) fn not_routed(op: &Op) -> CudaError {
    CudaError::lower(op.name(), "routed to the wrong lowering module")
}
