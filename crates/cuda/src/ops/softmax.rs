//! Lowering of softmax over the last axis and its backward to the row
//! kernels of `kernels/softmax.cu` (one block per row, see `util::row_launch`).

use stepgraph_core::ops::softmax::{Softmax, SoftmaxBackward};

use super::util::{n64, ptr, row_launch, rows_cols};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::Launch;

const SOFTMAX: &[KernelModule] = &[KernelModule::plain("softmax", include_str!("../../kernels/softmax.cu"))];

impl Lower for Softmax {
    const KERNELS: &'static [KernelModule] = SOFTMAX;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        let (rows, cols) = rows_cols(&x.ty);
        let args = vec![ptr(x), ptr(y), n64(rows), n64(cols)];
        Ok(row_launch("softmax", "softmax", x.ty.dtype, rows, cols, args))
    }
}

impl Lower for SoftmaxBackward {
    const KERNELS: &'static [KernelModule] = SOFTMAX;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (y, gy, gx) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let (rows, cols) = rows_cols(&y.ty);
        let args = vec![ptr(y), ptr(gy), ptr(gx), n64(rows), n64(cols)];
        Ok(row_launch("softmax", "softmax_backward", y.ty.dtype, rows, cols, args))
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::{DType, TensorType};
    use stepgraph_core::ops::Op;

    use super::super::testing::lowered;
    use super::*;

    #[test]
    fn rows_of_nothing_launch_nothing() {
        let (_, _, l) = lowered(&Op::Softmax(Softmax), &[TensorType::new(DType::F32, [4, 0])]);
        assert!(l.is_empty());
    }
}
