//! Lowering of the elementwise ops (`full`, unary maps and their backward,
//! binary maps with broadcasting, casts) to the grid-stride kernels of
//! `kernels/elementwise.cu`. Binary operands are walked with strides after
//! `util::merge_axes`, so most launches see rank 1 or 2. The split of an
//! f32 tensor into its TF32 part and the rest (3xTF32 products) is one too.

use stepgraph_core::ops::elementwise::{Binary, Cast, Full, Unary, UnaryBackward};
use stepgraph_core::ops::UnaryFn;

use super::util::{
    aligned16, broadcast_strides, float_name, launch_1d, merge_axes, n64, pad, pointwise_launch, ptr, MAX_RANK,
};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_args::{kernel_args, kernel_struct};
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, Launch};

/// The unary maps' math (`eval`, `derivative`), shared with the gated
/// activations' module ([`super::glu`]).
pub(crate) const ACTIVATION_CUH: &str = include_str!("../../kernels/activation.cuh");

const ELEMENTWISE: &[KernelModule] =
    &[KernelModule::with_header("elementwise", ACTIVATION_CUH, include_str!("../../kernels/elementwise.cu"))];

impl Lower for stepgraph_core::ops::matmul::SplitTf32 {
    const KERNELS: &'static [KernelModule] = ELEMENTWISE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, hi, lo) = (&cx.inputs[0], &cx.outputs[0], &cx.outputs[1]);
        let n = x.ty.numel();
        if n == 0 {
            return Ok(vec![]);
        }
        let args = vec![ptr(x), ptr(hi), ptr(lo), n64(n)];
        Ok(vec![launch_1d("elementwise", "split_tf32_f32".into(), n, args)])
    }
}

impl Lower for Full {
    const KERNELS: &'static [KernelModule] = ELEMENTWISE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let y = &cx.outputs[0];
        // +0.0 is all-zero bytes in every float type: a memset, which a graph
        // runs as a memset node without a kernel.
        if self.value == 0.0 && self.value.is_sign_positive() {
            return Ok(vec![Launch::Memset { ptr: y.ptr, bytes: y.ty.bytes(), value: 0 }]);
        }
        let dt = float_name("full", y.ty.dtype)?;
        let n = y.ty.numel();
        let args = vec![Arg::Ptr(y.ptr), n64(n), Arg::F64(self.value)];
        Ok(vec![launch_1d("elementwise", format!("full_{dt}"), n, args)])
    }
}

/// pow's exponent; the other functions ignore the argument.
fn exponent(f: UnaryFn) -> f64 {
    match f {
        UnaryFn::Pow(p) => p,
        _ => 0.0,
    }
}

impl Lower for Unary {
    const KERNELS: &'static [KernelModule] = ELEMENTWISE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        let dt = float_name(self.f.name(), y.ty.dtype)?;
        let n = y.ty.numel();
        let args = vec![Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), n64(n), Arg::F64(exponent(self.f))];
        Ok(vec![launch_1d("elementwise", format!("{}_{dt}", self.f.name()), n, args)])
    }
}

impl Lower for UnaryBackward {
    const KERNELS: &'static [KernelModule] = ELEMENTWISE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, g, y) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let name = self.f.backward_name();
        let dt = float_name(name, y.ty.dtype)?;
        let n = y.ty.numel();
        let args = vec![Arg::Ptr(x.ptr), Arg::Ptr(g.ptr), Arg::Ptr(y.ptr), n64(n), Arg::F64(exponent(self.f))];
        Ok(vec![launch_1d("elementwise", format!("{name}_{dt}"), n, args)])
    }
}

kernel_struct! {
    /// `BinaryShape` of elementwise.cu: the output's axes (`rank` of them,
    /// padded with 1) and each operand's element stride along them (0 where
    /// it broadcasts; padded with 0).
    pub(crate) struct BinaryShape {
        rank: i64,
        size: [i64; MAX_RANK],
        stride_a: [i64; MAX_RANK],
        stride_b: [i64; MAX_RANK],
    }
}

kernel_args! {
    /// The strided binary kernels `<op>_<dtype>`: `y[i] = op(a[..], b[..])`
    /// for the `n` elements of `y`.
    pub(crate) struct BinaryArgs {
        a: u64,
        b: u64,
        y: u64,
        n: i64,
        shape: BinaryShape,
    }
}

impl Lower for Binary {
    const KERNELS: &'static [KernelModule] = ELEMENTWISE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (a, b, y) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let name = self.f.name();
        let dt = float_name(name, y.ty.dtype)?;
        let out = &y.ty.shape;
        let sa = broadcast_strides(&a.ty.shape, out);
        let sb = broadcast_strides(&b.ty.shape, out);
        let (sizes, strides) = merge_axes(out, &[sa, sb]);
        if sizes.len() > MAX_RANK {
            return Err(CudaError::lower(
                name,
                format!("{} axes after merging; the kernel holds {MAX_RANK}", sizes.len()),
            ));
        }
        let n = y.ty.numel();
        // Operands of the output's shape, contiguous and 16-byte aligned:
        // the kernel that moves 16 bytes per operand per thread.
        if sizes.len() == 1 && strides.iter().all(|s| s[0] == 1) && n > 1 && aligned16(&[a, b, y]) {
            let args = vec![Arg::Ptr(a.ptr), Arg::Ptr(b.ptr), Arg::Ptr(y.ptr), n64(n)];
            return Ok(vec![pointwise_launch("elementwise", name, y.ty.dtype, n, &[a, b, y], args)]);
        }
        let shape = BinaryShape {
            rank: sizes.len() as i64,
            size: pad(&sizes, 1),
            stride_a: pad(&strides[0], 0),
            stride_b: pad(&strides[1], 0),
        };
        let args = BinaryArgs { a: a.ptr, b: b.ptr, y: y.ptr, n: n as i64, shape }.args();
        Ok(vec![launch_1d("elementwise", format!("{name}_{dt}"), n, args)])
    }
}

impl Lower for Cast {
    const KERNELS: &'static [KernelModule] = ELEMENTWISE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        let (src, dst) = (float_name("cast", x.ty.dtype)?, float_name("cast", self.dtype)?);
        let n = y.ty.numel();
        let args = vec![Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), n64(n)];
        Ok(vec![launch_1d("elementwise", format!("cast_{src}_{dst}"), n, args)])
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::DType;
    use stepgraph_core::ops::{BinaryFn, Op};

    use super::super::testing::{function, kernels, lower_types, t};
    use super::*;

    #[test]
    fn names_follow_the_op_and_dtype() {
        assert_eq!(function(Unary { f: UnaryFn::GeluTanh }, &[t(DType::BF16, &[3])]), "gelu_tanh_bf16");
        let x = t(DType::F16, &[3]);
        assert_eq!(function(UnaryBackward { f: UnaryFn::Pow(2.0) }, &[x.clone(), x]), "pow_backward_f16");
        assert_eq!(function(Binary { f: BinaryFn::Div }, &[t(DType::F64, &[2, 3]), t(DType::F64, &[3])]), "div_f64");
        assert_eq!(function(Cast { dtype: DType::BF16 }, &[t(DType::F64, &[2])]), "cast_f64_bf16");
    }

    #[test]
    fn contiguous_aligned_binaries_take_the_16_byte_kernel() {
        let add = Op::from(Binary { f: BinaryFn::Add });
        let x = t(DType::BF16, &[4, 1000]);
        let l = lower_types(&add, &[x.clone(), x.clone()], 0).unwrap();
        let k = &kernels(&l)[0];
        assert_eq!(k.function, "add_vec_bf16");
        // One thread per 8 bf16 elements.
        assert_eq!(k.grid.0 as usize * k.block.0 as usize, 4000usize.div_ceil(8).next_multiple_of(256));
        // Broadcast operands and misaligned addresses take the strided kernel.
        assert_eq!(function(Binary { f: BinaryFn::Add }, &[x.clone(), t(DType::BF16, &[1000])]), "add_bf16");
        let l = lower_types(&add, &[x.clone(), x], 2).unwrap();
        assert_eq!(kernels(&l)[0].function, "add_bf16");
    }

    #[test]
    fn zero_fills_are_memsets() {
        let op = Op::from(Full { value: 0.0, ty: t(DType::BF16, &[3, 5]) });
        assert!(matches!(lower_types(&op, &[], 0).unwrap()[..], [Launch::Memset { bytes: 30, value: 0, .. }]));
        let op = Op::from(Full { value: -0.0, ty: t(DType::F32, &[3]) });
        assert_eq!(kernels(&lower_types(&op, &[], 0).unwrap())[0].function, "full_f32");
    }
}
