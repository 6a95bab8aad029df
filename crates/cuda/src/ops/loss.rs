//! Lowering of the cross-entropy loss and its backward to the kernels of
//! `kernels/loss.cu`: a row kernel for each row's log-sum-exp, then one
//! block that adds the per-row losses in a fixed order (so the mean is
//! deterministic); the backward is a row kernel. Integer targets are passed
//! untyped with a flag (`1` for i64, `0` for i32), so the kernel names stay
//! `<op>_<float dtype>`.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::loss::{CrossEntropy, CrossEntropyBackward};

use super::util::{n64, optional, ptr, row_grid, row_launch, row_threads, rows_cols, typed_kernel};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, DevTensor, Launch};

const LOSS: &[KernelModule] = &[KernelModule::plain("loss", include_str!("../../kernels/loss.cu"))];

/// The grid cap of the cross-entropy backward: each of its blocks recounts
/// the kept rows (the mean's divisor) before its rows, so fewer blocks than
/// rows keep that count a small part of the work.
const CE_BWD_MAX_BLOCKS: usize = 1024;
/// The single block that adds the per-row losses.
const CE_LOSS_THREADS: u32 = 1024;

/// The targets' address and their width flag (1: i64, 0: i32).
fn targets(t: &DevTensor) -> [Arg; 2] {
    [ptr(t), Arg::I32((t.ty.dtype == DType::I64) as i32)]
}

impl Lower for CrossEntropy {
    const KERNELS: &'static [KernelModule] = LOSS;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, tgt) = (&cx.inputs[0], &cx.inputs[1]);
        let (loss, lse) = (&cx.outputs[0], &cx.outputs[1]);
        let (rows, cols) = rows_cols(&x.ty);
        let dt = x.ty.dtype;
        let mut launches =
            row_launch("loss", "cross_entropy_lse", dt, rows, cols, vec![ptr(x), ptr(lse), n64(rows), n64(cols)]);
        // Launched even without rows: the mean over no row is NaN, as on the CPU.
        let mut args = vec![ptr(x)];
        args.extend(targets(tgt));
        args.extend([ptr(lse), ptr(loss), n64(rows), n64(cols), Arg::I64(self.ignore_index)]);
        launches.push(typed_kernel("loss", "cross_entropy_loss", dt, (1, 1, 1), (CE_LOSS_THREADS, 1, 1), args));
        Ok(launches)
    }
}

impl Lower for CrossEntropyBackward {
    const KERNELS: &'static [KernelModule] = LOSS;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let ins = cx.inputs;
        let (x, tgt, lse, gloss) = (&ins[0], &ins[1], &ins[2], &ins[3]);
        let dx = &cx.outputs[0];
        let (rows, cols) = rows_cols(&x.ty);
        if rows == 0 {
            return Ok(vec![]);
        }
        let mut args = vec![ptr(x)];
        args.extend(targets(tgt));
        args.extend([ptr(lse), ptr(gloss)]);
        args.extend(optional(ins.get(4)));
        args.extend([ptr(dx), n64(rows), n64(cols), Arg::I64(self.ignore_index)]);
        let grid = row_grid(rows, CE_BWD_MAX_BLOCKS);
        Ok(vec![typed_kernel("loss", "cross_entropy_backward", x.ty.dtype, grid, (row_threads(cols), 1, 1), args)])
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::TensorType;
    use stepgraph_core::ops::Op;

    use super::super::testing::{kernels, lowered};
    use super::*;

    #[test]
    fn the_loss_of_no_row_is_still_written() {
        let ce = Op::CrossEntropy(CrossEntropy { ignore_index: -100 });
        let (_, _, l) = lowered(&ce, &[TensorType::new(DType::F32, [0, 10]), TensorType::new(DType::I64, [0])]);
        let names: Vec<&str> = kernels(&l).iter().map(|k| k.function.as_str()).collect();
        assert_eq!(names, ["cross_entropy_loss_f32"], "the loss of no row is still written (NaN)");
    }
}
