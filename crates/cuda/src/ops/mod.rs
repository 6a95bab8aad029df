//! The CUDA lowering of every op: one [`Lower`] impl per op struct of core,
//! in files laid out like `stepgraph_core::ops` (one per family). Each node
//! of the step, with the fixed addresses of its operands, becomes a list of
//! [`Launch`]es: data only (kernel names, grids, arguments, GEMM and NCCL
//! descriptions), no CUDA call.
//!
//! The dispatch [`lower`] is generated from core's op list
//! (`stepgraph_core::for_each_op!`), so an op without a CUDA lowering is a
//! compile error here, and so is the kernel-module list
//! ([`crate::kernels::modules`]), from what each impl declares in
//! [`Lower::KERNELS`].
//!
//! **Invariants checked by [`lower`] before any op's impl runs:** the
//! output types are exactly what the op's shape rule gives for the input
//! types (so a kernel never sees operands it was not written for), and every
//! address is element-aligned (the copy units and the kernels' typed loads
//! rely on it). A node whose outputs are all empty launches nothing.
//!
//! What the CPU kernels check at run time from values cannot be checked
//! here: embedding ids in range and AdamW's `lr >= 0` and `step >= 1` are
//! validated by the session on the host before the step; the kernels stay
//! memory-safe regardless (see `embedding` and `optim`).

pub mod attention;
pub mod collective;
pub mod decode;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod fp8;
pub mod glu;
pub mod linear_ce;
pub mod loss;
pub mod matmul;
pub mod moe;
pub mod movement;
pub mod nf4;
pub mod norm;
pub mod offload;
pub mod optim;
pub mod reduce;
pub mod rope;
pub mod softmax;
mod util;

#[cfg(test)]
mod decode_model;
#[cfg(test)]
mod host_model;
#[cfg(test)]
pub(crate) mod sweep;
#[cfg(test)]
mod testing;

use stepgraph_core::ir::TensorType;
use stepgraph_core::ops::Op;

use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;
use crate::launch::{DevTensor, Launch};
use crate::switches::Switches;

/// A session's place in a data-parallel group: what the collective
/// lowerings need beyond addresses (`local_shard` copies at `rank`'s offset).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GroupRank {
    pub rank: usize,
    pub world: usize,
}

/// What an op's lowering sees: its operands, already checked against the
/// op's shape rule and for alignment (see the module doc), and the
/// session's rank (`None` for a session outside any group).
#[derive(Copy, Clone, Debug)]
pub struct LowerCx<'a> {
    pub inputs: &'a [DevTensor],
    pub outputs: &'a [DevTensor],
    pub group: Option<GroupRank>,
    pub target: Target,
}

/// What a lowering may assume of the device beyond what every supported GPU
/// has, and the run-time switches that choose among lowerings. The default
/// is the portable set (kernels that run on any of them) with every switch
/// at its default.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Target {
    /// Compute capability 9.0 (H100, H200): modules built for `sm_90a`
    /// (warpgroup MMA, [`crate::kernel_module::KernelModule::arch_specific`]) may be launched.
    pub sm90a: bool,
    /// The session's switches: decode staging ([`decode::staging`], where
    /// [`Switches::decode_staging`] asks for it), the attention kernels, the
    /// launch merges.
    pub switches: Switches,
}

impl Target {
    /// The target of a device of architecture `arch` (`sm_90`, `sm_80`, ...)
    /// under `switches`: [`Switches::portable_kernels`] keeps to the
    /// portable kernels (for comparisons).
    pub fn of_arch(arch: &str, switches: Switches) -> Target {
        Target { sm90a: arch == "sm_90" && !switches.portable_kernels, switches }
    }
}

/// The CUDA lowering of one op struct.
#[diagnostic::on_unimplemented(
    message = "op `{Self}` has no CUDA lowering",
    label = "every op of `stepgraph_core::for_each_op!` needs `impl Lower`",
    note = "add `impl Lower for {Self}` to the file of crates/cuda/src/ops/ that mirrors its core family"
)]
pub trait Lower {
    /// The kernel modules this op's launches may name (none for ops that
    /// lower to copies, products or collectives only). The module list
    /// ([`crate::kernels::modules`]) is derived from these, so a new op
    /// with a new `kernels/foo.cu` declares it here and nowhere else.
    const KERNELS: &'static [KernelModule] = &[];

    /// The device work of one node, over operands that satisfy the op's
    /// shape rule and are element-aligned, with at least one non-empty output.
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>>;
}

/// Generates the dispatch and the per-op kernel lists from the op list.
macro_rules! cuda_ops {
    ($($variant:ident($ty:path)),* $(,)?) => {
        fn dispatch(op: &Op, cx: &LowerCx) -> Result<Vec<Launch>> {
            match op {
                $(Op::$variant(o) => <$ty as Lower>::lower(o, cx),)*
            }
        }

        /// The kernel modules of every op, in op-list order (with repeats:
        /// [`crate::kernels::all`] deduplicates them).
        pub(crate) const KERNELS_BY_OP: &[&[KernelModule]] = &[$(<$ty as Lower>::KERNELS),*];

        /// The kernel modules `op`'s lowering declares.
        pub fn kernels_of(op: &Op) -> &'static [KernelModule] {
            match op {
                $(Op::$variant(_) => <$ty as Lower>::KERNELS,)*
            }
        }
    };
}

stepgraph_core::for_each_op!(cuda_ops);

/// The device work of one node with the portable kernels. `group` is the
/// session's rank, `None` for a session outside any group (which cannot run
/// collectives).
pub fn lower(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor], group: Option<GroupRank>) -> Result<Vec<Launch>> {
    lower_for(op, inputs, outputs, group, Target::default())
}

/// [`lower`] for a device of `target`.
pub fn lower_for(
    op: &Op,
    inputs: &[DevTensor],
    outputs: &[DevTensor],
    group: Option<GroupRank>,
    target: Target,
) -> Result<Vec<Launch>> {
    check_operands(op, inputs, outputs)?;
    if outputs.iter().all(|o| o.ty.numel() == 0) {
        return Ok(vec![]);
    }
    dispatch(op, &LowerCx { inputs, outputs, group, target })
}

/// The operands must be exactly what the op's shape rule gives, at
/// element-aligned addresses.
fn check_operands(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<()> {
    let in_types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let want = op.infer(&in_types).map_err(|e| CudaError::lower(op.name(), e))?;
    let got: Vec<&TensorType> = outputs.iter().map(|t| &t.ty).collect();
    if want.iter().collect::<Vec<_>>() != got {
        let show = |v: &[&TensorType]| v.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ");
        return Err(CudaError::lower(
            op.name(),
            format!("outputs are [{}], the shape rule gives [{}]", show(&got), show(&want.iter().collect::<Vec<_>>())),
        ));
    }
    if let Some(t) = inputs.iter().chain(outputs).find(|t| t.ptr % t.ty.dtype.size() as u64 != 0) {
        return Err(CudaError::lower(
            op.name(),
            format!("address {:#x} of a {} tensor is not element-aligned", t.ptr, t.ty),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::DType;
    use stepgraph_core::ops::elementwise::Unary;
    use stepgraph_core::ops::UnaryFn;

    use super::testing::{operands, t};
    use super::*;

    #[test]
    fn operands_that_contradict_the_shape_rule_are_refused() {
        let op = Op::from(Unary { f: UnaryFn::Exp });
        let x = operands(&[t(DType::F32, &[3])], 1 << 40, 0);
        let wrong = operands(&[t(DType::F32, &[4])], 1 << 41, 0);
        let e = lower(&op, &x, &wrong, None).unwrap_err();
        assert!(e.to_string().contains("the shape rule gives [f32[3]]"), "{e}");
        let misaligned = operands(&[t(DType::F32, &[3])], 1 << 41, 2);
        let e = lower(&op, &x, &misaligned, None).unwrap_err();
        assert!(e.to_string().contains("not element-aligned"), "{e}");
        let mm = Op::from(stepgraph_core::ops::matmul::MatMul::new(false, false));
        assert!(matches!(lower(&mm, &[], &[], None), Err(CudaError::Lower { .. })));
    }
}
