//! Lowering of the fused gated activations ([`Glu`], [`GluBackward`]:
//! SwiGLU and GeGLU) to the grid-stride kernels of `kernels/glu.cu`: one
//! launch each, over the flat elements (both ops are pointwise over
//! operands of one type). The kernels take the unary maps' math from
//! `kernels/activation.cuh`, as the elementwise module does.

use stepgraph_core::ops::glu::{Glu, GluBackward};

use super::elementwise::ACTIVATION_CUH;
use super::util::{float_name, n64, pointwise_launch, ptr};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::Launch;

const GLU: &[KernelModule] = &[KernelModule::with_header("glu", ACTIVATION_CUH, include_str!("../../kernels/glu.cu"))];

impl Lower for Glu {
    const KERNELS: &'static [KernelModule] = GLU;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (gate, up, h) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let name = self.act.name();
        float_name(name, h.ty.dtype)?;
        let n = h.ty.numel();
        let args = vec![ptr(gate), ptr(up), ptr(h), n64(n)];
        Ok(vec![pointwise_launch("glu", name, h.ty.dtype, n, &[gate, up, h], args)])
    }
}

impl Lower for GluBackward {
    const KERNELS: &'static [KernelModule] = GLU;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let [gate, up, gh] = [&cx.inputs[0], &cx.inputs[1], &cx.inputs[2]];
        let (dgate, dup) = (&cx.outputs[0], &cx.outputs[1]);
        let name = self.act.backward_name();
        float_name(name, gate.ty.dtype)?;
        let n = gate.ty.numel();
        let args = vec![ptr(gate), ptr(up), ptr(gh), ptr(dgate), ptr(dup), n64(n)];
        let operands = [gate, up, gh, dgate, dup];
        Ok(vec![pointwise_launch("glu", name, gate.ty.dtype, n, &operands, args)])
    }
}
