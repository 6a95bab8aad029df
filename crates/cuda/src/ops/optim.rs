//! Lowering of the AdamW update to the kernel of `kernels/adamw.cu`: one
//! grid-stride launch over the parameter, reading the learning rate and the
//! step count from device memory (so a captured graph replays with new
//! values). Invalid scalars (`lr < 0`, `step < 1`) leave the state
//! unchanged on the device; the session refuses them on the host first.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::optim::AdamW;

use super::util::{aligned16, float_name, launch, n64, THREADS};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernels::KernelModule;
use crate::launch::{blocks, Arg, DevTensor, Launch};

/// Grid cap for AdamW, whose blocks each compute the step's coefficients once.
const ADAMW_MAX_GRID: usize = 4096;

/// Elements per thread of `adamw_vec_*` (the kernel's `kVec`).
const VEC_ELEMS: usize = 8;

impl Lower for AdamW {
    const KERNELS: &'static [KernelModule] = &[KernelModule::plain("adamw", include_str!("../../kernels/adamw.cu"))];

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let ins = cx.inputs;
        let (p, g, m, v, lr, step) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4], &ins[5]);
        let name = |t: &DevTensor| float_name("adamw", t.ty.dtype);
        // Every tensor 16-byte aligned: the kernel that moves 8 elements
        // per thread with 16-byte loads (the same arithmetic per element).
        let tensors = [p, g, m, v, &cx.outputs[0], &cx.outputs[1], &cx.outputs[2]];
        let vec = p.ty.numel() >= VEC_ELEMS && aligned16(&tensors);
        let kind = if vec { "adamw_vec" } else { "adamw" };
        let function = format!("{kind}_{}_{}_{}", name(p)?, name(m)?, name(v)?);
        let is_f64 = |t: &DevTensor| Arg::I64((t.ty.dtype == DType::F64) as i64);
        let n = p.ty.numel();
        let args = vec![
            Arg::Ptr(p.ptr),
            Arg::Ptr(g.ptr),
            Arg::Ptr(m.ptr),
            Arg::Ptr(v.ptr),
            Arg::Ptr(lr.ptr),
            Arg::Ptr(step.ptr),
            Arg::Ptr(cx.outputs[0].ptr),
            Arg::Ptr(cx.outputs[1].ptr),
            Arg::Ptr(cx.outputs[2].ptr),
            n64(n),
            is_f64(lr),
            is_f64(step),
            Arg::F64(self.beta1),
            Arg::F64(self.beta2),
            Arg::F64(self.eps),
            Arg::F64(self.weight_decay),
        ];
        let threads = if vec { n.div_ceil(VEC_ELEMS) } else { n };
        let grid = blocks(threads, THREADS as usize).min(ADAMW_MAX_GRID as u32);
        Ok(vec![launch("adamw", function, (grid, 1, 1), (THREADS, 1, 1), args)])
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{function, t};
    use super::*;

    #[test]
    fn the_kernel_is_named_by_the_parameter_and_moment_dtypes() {
        let adamw = [
            t(DType::BF16, &[4]),
            t(DType::BF16, &[4]),
            t(DType::F32, &[4]),
            t(DType::BF16, &[4]),
            t(DType::F32, &[]),
            t(DType::F64, &[]),
        ];
        assert_eq!(function(AdamW::default(), &adamw), "adamw_bf16_f32_bf16");
    }

    #[test]
    fn aligned_tensors_take_the_16_byte_kernel() {
        let (w, s) = (t(DType::BF16, &[64, 8]), t(DType::F32, &[]));
        let adamw = [w.clone(), w.clone(), w.clone(), w, s.clone(), s];
        let op = stepgraph_core::ops::Op::from(AdamW::default());
        let aligned = super::super::testing::lower_types(&op, &adamw, 0).unwrap();
        let k = &super::super::testing::kernels(&aligned)[0];
        assert_eq!(k.function, "adamw_vec_bf16_bf16_bf16");
        assert_eq!(k.grid.0, 1, "512 elements, 8 per thread: one block");
        let skewed = super::super::testing::lower_types(&op, &adamw, 4).unwrap();
        assert_eq!(super::super::testing::kernels(&skewed)[0].function, "adamw_bf16_bf16_bf16");
    }
}
