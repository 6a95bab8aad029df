//! Lowering of the FP8 ops ([`stepgraph_core::ops::fp8`]): a scale is a
//! memset of its two words and the grid-stride amax of `kernels/fp8.cu`,
//! whose last block turns the amax into `[1 / scale, scale]`; a
//! quantization is one kernel (16 bytes of the operand per thread, or 64 ×
//! 64 tiles through shared memory when transposed, which write the plain
//! codes too where both are asked for); the product is a
//! cuBLASLt FP8 [`GemmCall`] whose inverse scales are read from the scale
//! tensors' first elements.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::fp8::{fp8_rows_cols, Fp8Quantize, Fp8Scale, MatMulFp8, FP8_CODES_PER_WORD};

use super::util::{launch, launch_1d, n64, ptr, THREADS};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;
use crate::launch::{blocks, Arg, Fp8Gemm, GemmAddend, GemmCall, GemmType, Launch};

const FP8: &[KernelModule] = &[KernelModule::plain("fp8", include_str!("../../kernels/fp8.cu"))];

/// Rows and columns of a transposing quantization's tile (`SG_FP8_TILE`).
const TILE: usize = 64;

/// Blocks of the amax: enough to fill any current GPU a few times, few
/// enough that their one atomic each stays negligible.
const AMAX_BLOCKS: usize = 1024;

/// The kernel-name suffix of an FP8 op's float input.
fn float_suffix(op: &str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 | DType::BF16 | DType::F16 => Ok(dt.name()),
        d => Err(CudaError::unsupported(op, format!("no FP8 kernel for {d} tensors"))),
    }
}

impl Lower for Fp8Scale {
    const KERNELS: &'static [KernelModule] = FP8;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, out) = (&cx.inputs[0], &cx.outputs[0]);
        let dt = float_suffix("fp8_scale", x.ty.dtype)?;
        let n = x.ty.numel();
        // Each thread reads 16 bytes per iteration where it can.
        let per_thread = 16 / x.ty.dtype.size();
        let grid = blocks(n.div_ceil(per_thread), THREADS as usize).clamp(1, AMAX_BLOCKS as u32);
        let fmt = self.format.name();
        // The amax and the count of blocks done start at zero.
        Ok(vec![
            Launch::Memset { ptr: out.ptr, bytes: 8, value: 0 },
            launch(
                "fp8",
                format!("fp8_scale_{fmt}_{dt}"),
                (grid, 1, 1),
                (THREADS, 1, 1),
                vec![ptr(x), n64(n), ptr(out)],
            ),
        ])
    }
}

impl Lower for Fp8Quantize {
    const KERNELS: &'static [KernelModule] = FP8;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, scale, out) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let plain = if self.with_plain { ptr(&cx.outputs[1]) } else { Arg::Ptr(0) };
        let dt = float_suffix("fp8_quantize", x.ty.dtype)?;
        let fmt = self.format.name();
        let (rows, cols) = fp8_rows_cols(&x.ty.shape);
        Ok(vec![if self.transpose {
            let grid = (cols.div_ceil(TILE) as u32, rows.div_ceil(TILE) as u32, 1);
            if grid.1 > 65_535 {
                return Err(CudaError::unsupported(
                    "fp8_quantize",
                    format!("{rows} rows transposed: more than 65535 tiles"),
                ));
            }
            let args = vec![ptr(x), ptr(scale), ptr(out), plain, n64(rows), n64(cols)];
            launch("fp8", format!("fp8_quantize_t_{fmt}_{dt}"), grid, (32, 8, 1), args)
        } else {
            // One thread per 16 bytes of the operand.
            let words = rows * cols / FP8_CODES_PER_WORD;
            let threads = (rows * cols).div_ceil(16 / x.ty.dtype.size());
            let args = vec![ptr(x), ptr(scale), ptr(out), n64(words)];
            launch_1d("fp8", format!("fp8_quantize_{fmt}_{dt}"), threads, args)
        }])
    }
}

impl Lower for MatMulFp8 {
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (a, b, sa, sb, c) = (&cx.inputs[0], &cx.inputs[1], &cx.inputs[2], &cx.inputs[3], &cx.outputs[0]);
        let (m, n) = (a.ty.shape[0], b.ty.shape[0]);
        let k = a.ty.shape[1] * FP8_CODES_PER_WORD;
        let addend = super::matmul::gemm_addend("matmul_fp8", c, cx.inputs.get(4))?;
        if self.out == DType::F32 && matches!(addend, GemmAddend::Bias(_)) {
            // Measured on an H100: cuBLASLt finds no FP8 algorithm for it.
            return Err(CudaError::unsupported("matmul_fp8", "cuBLASLt adds no row bias to an f32 FP8 product"));
        }
        // The inverse scale is each scale tensor's first f32, at its aligned start.
        let inverse = |s: &crate::launch::DevTensor| s.ptr;
        Ok(vec![Launch::Gemm(GemmCall {
            ty: GemmType::Fp8(Fp8Gemm { a: self.a, b: self.b, out: self.out }),
            batch: 1,
            m,
            n,
            k,
            trans_a: false,
            trans_b: true,
            a: a.ptr,
            b: b.ptr,
            c: c.ptr,
            stride_a: 0,
            stride_b: 0,
            stride_c: (m * n) as i64,
            addend,
            fp8_scales: Some([inverse(sa), inverse(sb)]),
        })])
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ops::fp8::Fp8Format;
    use stepgraph_core::ops::Op;

    use super::super::testing::{lower_types, lowered, t};
    use super::*;

    #[test]
    fn a_scale_is_a_memset_and_one_kernel() {
        let op = Op::from(Fp8Scale { format: Fp8Format::E5M2 });
        let l = lower_types(&op, &[t(DType::BF16, &[3, 1000])], 0).unwrap();
        let [Launch::Memset { bytes: 8, value: 0, .. }, Launch::Kernel(k)] = &l[..] else {
            panic!("expected a memset of the amax and the count, and one kernel, got {l:?}")
        };
        // 3000 bf16 elements, 8 per thread: two blocks.
        assert_eq!((k.function.as_str(), k.grid.0), ("fp8_scale_e5m2_bf16", 2));
        assert!(lower_types(&op, &[t(DType::F64, &[4])], 0).is_err());
    }

    #[test]
    fn a_transposed_quantization_tiles_the_matrix() {
        let op = Op::from(Fp8Quantize { format: Fp8Format::E4M3, transpose: true, with_plain: false });
        let l = lower_types(&op, &[t(DType::F16, &[2, 100, 40]), t(DType::F32, &[2])], 0).unwrap();
        let [Launch::Kernel(k)] = &l[..] else { panic!("expected one kernel, got {l:?}") };
        assert_eq!((k.function.as_str(), k.grid, k.block), ("fp8_quantize_t_e4m3_f16", (1, 4, 1), (32, 8, 1)));
        assert!(matches!(k.args[3], Arg::Ptr(0)), "no plain codes: a null pointer");
    }

    #[test]
    fn both_layouts_are_one_kernel_writing_two_outputs() {
        let op = Op::from(Fp8Quantize { format: Fp8Format::E5M2, transpose: true, with_plain: true });
        let (_, outs, l) = lowered(&op, &[t(DType::BF16, &[256, 320]), t(DType::F32, &[2])]);
        let [Launch::Kernel(k)] = &l[..] else { panic!("expected one kernel, got {l:?}") };
        assert_eq!((k.function.as_str(), k.grid), ("fp8_quantize_t_e5m2_bf16", (5, 4, 1)));
        assert_eq!((&k.args[2], &k.args[3]), (&Arg::Ptr(outs[0].ptr), &Arg::Ptr(outs[1].ptr)));
    }

    #[test]
    fn a_plain_quantization_takes_a_thread_per_16_bytes() {
        let op = Op::from(Fp8Quantize { format: Fp8Format::E4M3, transpose: false, with_plain: false });
        let l = lower_types(&op, &[t(DType::BF16, &[4, 64 * 1024]), t(DType::F32, &[2])], 0).unwrap();
        let [Launch::Kernel(k)] = &l[..] else { panic!("expected one kernel, got {l:?}") };
        assert_eq!(k.grid.0 as usize * k.block.0 as usize, 4 * 64 * 1024 / 8);
    }

    #[test]
    fn the_product_reads_the_inverse_scales() {
        let op = Op::from(MatMulFp8 { a: Fp8Format::E5M2, b: Fp8Format::E4M3, out: DType::BF16, addend: false });
        let ins_types = [t(DType::I32, &[32, 16]), t(DType::I32, &[48, 16]), t(DType::F32, &[2]), t(DType::F32, &[2])];
        let (ins, _, l) = lowered(&op, &ins_types);
        let [Launch::Gemm(g)] = &l[..] else { panic!("expected one product, got {l:?}") };
        assert_eq!((g.m, g.n, g.k, g.trans_a, g.trans_b), (32, 48, 64, false, true));
        assert_eq!(g.fp8_scales, Some([ins[2].ptr, ins[3].ptr]), "each scale tensor's first f32");
        assert_eq!(crate::launch::shape_name(g), "gemm_fp8_e5m2_e4m3_bf16_32x48x64_tb");
        // A row bias, in bf16 and (declined, as cuBLASLt does) in f32.
        let bias = |out: DType| {
            let op = Op::from(MatMulFp8 { a: Fp8Format::E4M3, b: Fp8Format::E4M3, out, addend: true });
            let mut types = ins_types.to_vec();
            types.push(t(out, &[48]));
            lower_types(&op, &types, 0)
        };
        assert!(bias(DType::BF16).is_ok());
        assert!(matches!(bias(DType::F32), Err(CudaError::Unsupported { .. })));
    }
}
