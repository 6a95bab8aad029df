//! Lowering of the NF4 weight dequantization ([`DequantizeNf4`]) to the
//! grid-stride kernels of `kernels/nf4.cu`: one launch, one thread per
//! packed code word (8 elements of one 64-element block), the plain or the
//! double-quantized form of the absmax values.

use stepgraph_core::ops::nf4::{DequantizeNf4, NF4_CODES_PER_WORD};

use super::util::{float_name, launch_1d, n64, ptr};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::Launch;

const NF4: &[KernelModule] = &[KernelModule::plain("nf4", include_str!("../../kernels/nf4.cu"))];

impl Lower for DequantizeNf4 {
    const KERNELS: &'static [KernelModule] = NF4;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (codes, out) = (&cx.inputs[0], &cx.outputs[0]);
        let dt = float_name("dequantize_nf4", out.ty.dtype)?;
        let words = out.ty.numel() / NF4_CODES_PER_WORD;
        Ok(vec![if self.double_quant {
            let (absmax_codes, scales) = (&cx.inputs[1], &cx.inputs[2]);
            // The scales' last element is the mean; the kernel reads it at `groups`.
            let groups = scales.ty.numel() - 1;
            let args = vec![ptr(codes), ptr(absmax_codes), ptr(scales), n64(groups), ptr(out), n64(words)];
            launch_1d("nf4", format!("nf4_dequantize_dq_{dt}"), words, args)
        } else {
            let args = vec![ptr(codes), ptr(&cx.inputs[1]), ptr(out), n64(words)];
            launch_1d("nf4", format!("nf4_dequantize_{dt}"), words, args)
        }])
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ops::nf4::NF4_LEVELS;

    /// The kernel's level table is the CPU's, bit for bit.
    #[test]
    fn the_kernel_levels_are_the_reference_levels() {
        let src = include_str!("../../kernels/nf4.cu");
        let table = src.split("LEVEL_BITS[16] = {").nth(1).unwrap().split("};").next().unwrap();
        let bits: Vec<u32> = table
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| u32::from_str_radix(s.trim_start_matches("0x").trim_end_matches('u'), 16).unwrap())
            .collect();
        assert_eq!(bits, NF4_LEVELS.map(f32::to_bits));
    }
}
