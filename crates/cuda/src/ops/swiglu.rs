//! Lowering of the fused SwiGLU ([`SwiGlu`], [`SwiGluBackward`]) to the
//! grid-stride kernels of `kernels/swiglu.cu`: one launch each, over the
//! flat elements (both ops are pointwise over operands of one type).

use stepgraph_core::ops::swiglu::{SwiGlu, SwiGluBackward};

use super::util::{float_name, n64, pointwise_launch, ptr};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::Launch;

const SWIGLU: &[KernelModule] = &[KernelModule::plain("swiglu", include_str!("../../kernels/swiglu.cu"))];

impl Lower for SwiGlu {
    const KERNELS: &'static [KernelModule] = SWIGLU;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (gate, up, h) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        float_name("swiglu", h.ty.dtype)?;
        let n = h.ty.numel();
        let args = vec![ptr(gate), ptr(up), ptr(h), n64(n)];
        Ok(vec![pointwise_launch("swiglu", "swiglu", h.ty.dtype, n, &[gate, up, h], args)])
    }
}

impl Lower for SwiGluBackward {
    const KERNELS: &'static [KernelModule] = SWIGLU;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let [gate, up, gh] = [&cx.inputs[0], &cx.inputs[1], &cx.inputs[2]];
        let (dgate, dup) = (&cx.outputs[0], &cx.outputs[1]);
        float_name("swiglu_backward", gate.ty.dtype)?;
        let n = gate.ty.numel();
        let args = vec![ptr(gate), ptr(up), ptr(gh), ptr(dgate), ptr(dup), n64(n)];
        let operands = [gate, up, gh, dgate, dup];
        Ok(vec![pointwise_launch("swiglu", "swiglu_backward", gate.ty.dtype, n, &operands, args)])
    }
}
