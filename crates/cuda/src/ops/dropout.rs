//! Lowering of counter-based dropout ([`Dropout`]) to the grid-stride
//! kernel of `kernels/dropout.cu`: one launch over the flat elements, the
//! step count read from device memory (so a captured graph replays with
//! each step's value), the mask's threshold and the scale computed here as
//! the CPU reference computes them.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::dropout::{threshold, Dropout};

use super::util::{float_name, launch_1d, n64, ptr};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, Launch};

const DROPOUT: &[KernelModule] = &[KernelModule::plain("dropout", include_str!("../../kernels/dropout.cu"))];

impl Lower for Dropout {
    const KERNELS: &'static [KernelModule] = DROPOUT;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, step, y) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let dt = float_name("dropout", y.ty.dtype)?;
        let n = y.ty.numel();
        // `1 / (1 − p)` in f64, rounded once to the kernel's acc_t.
        let scale = match y.ty.dtype {
            DType::F64 => Arg::F64(self.scale()),
            _ => Arg::F32(self.scale() as f32),
        };
        let args = vec![
            ptr(x),
            ptr(step),
            ptr(y),
            n64(n),
            // The u64 stream's bits.
            Arg::I64(self.stream as i64),
            Arg::I64(self.micro_batch as i64),
            Arg::I64(threshold(self.p) as i64),
            scale,
        ];
        Ok(vec![launch_1d("dropout", format!("dropout_{dt}"), n, args)])
    }
}
