//! Lowering of RMSNorm and LayerNorm, forward and backward, to the kernels
//! of `kernels/norm.cu`.
//!
//! - The row kernels run one block per row of the last axis, grid-striding
//!   over rows, with a block of a multiple of 32 threads (at most 1024)
//!   chosen from the row length; their reductions are common.cuh's fixed trees.
//! - Parameter gradients (sums over every row) come from a column kernel of
//!   32×32 blocks that adds rows in a fixed order: no float atomics and no
//!   scratch memory (a lowering cannot allocate). It runs even without rows:
//!   the gradients are then the empty sums, zeros.
//! - The optional statistic cotangents of the backward ops are present or
//!   absent by the input count; an absent one is passed as a null pointer
//!   with a 0 flag.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::norm::{LayerNorm, LayerNormBackward, RmsNorm, RmsNormBackward, LN_ADDEND, RMS_ADDEND};

use super::util::{aligned16, n64, optional, ptr, row_grid, row_launch, rows_cols, typed_kernel, MAX_ROW_BLOCKS};
use super::{Lower, LowerCx};
use crate::error::Result;
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, DevTensor, Launch};

const NORM: &[KernelModule] = &[KernelModule::plain("norm", include_str!("../../kernels/norm.cu"))];

/// `NORM_COL_TILE` × `NORM_ROW_LANES` of norm.cu: the block of the
/// parameter-gradient kernels, columns along x and row lanes along y.
const NORM_COL_TILE: usize = 32;
const NORM_ROW_LANES: usize = 32;

/// The column kernel's launch: one 32×32 block per 32 columns.
fn column_launch(name: &str, dtype: DType, cols: usize, args: Vec<Arg>) -> Launch {
    let grid = (cols.div_ceil(NORM_COL_TILE).max(1) as u32, 1, 1);
    typed_kernel("norm", name, dtype, grid, (NORM_COL_TILE as u32, NORM_ROW_LANES as u32, 1), args)
}

/// `NORM_VEC_PACKS` of norm.cu: 16-byte packs of a row a vec-kernel thread holds.
const NORM_VEC_PACKS: usize = 4;

/// The RMSNorm row launch: the register-cached 16-byte kernel (`<name>_vec`)
/// when rows are whole 16-byte packs, every operand is 16-byte aligned and a
/// block of at most 1024 threads holds a row in `NORM_VEC_PACKS` packs per
/// thread; the general row kernel otherwise. f64 keeps the general kernel.
fn rms_row_launch(
    name: &str,
    dt: DType,
    rows: usize,
    cols: usize,
    operands: &[&DevTensor],
    args: Vec<Arg>,
) -> Vec<Launch> {
    let per_pack = 16 / dt.size();
    let packs = cols / per_pack;
    let vec = dt != DType::F64
        && rows > 0
        && cols.is_multiple_of(per_pack)
        && packs > 0
        && packs <= 1024 * NORM_VEC_PACKS
        && aligned16(operands);
    if !vec {
        return row_launch("norm", name, dt, rows, cols, args);
    }
    let threads = packs.div_ceil(NORM_VEC_PACKS).next_multiple_of(32).clamp(32, 1024) as u32;
    vec![typed_kernel("norm", &format!("{name}_vec"), dt, row_grid(rows, MAX_ROW_BLOCKS), (threads, 1, 1), args)]
}

impl Lower for RmsNorm {
    const KERNELS: &'static [KernelModule] = NORM;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, w) = (&cx.inputs[0], &cx.inputs[1]);
        let (y, rstd) = (&cx.outputs[0], &cx.outputs[1]);
        let (rows, cols) = rows_cols(&x.ty);
        let args = vec![ptr(x), ptr(w), ptr(y), ptr(rstd), n64(rows), n64(cols), Arg::F64(self.eps)];
        Ok(rms_row_launch("rms_norm", x.ty.dtype, rows, cols, &[x, w, y], args))
    }
}

impl Lower for RmsNormBackward {
    const KERNELS: &'static [KernelModule] = NORM;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let ins = cx.inputs;
        let (x, w, rstd, gy) = (&ins[0], &ins[1], &ins[2], &ins[3]);
        let (gx, gw) = (&cx.outputs[0], &cx.outputs[1]);
        let (rows, cols) = rows_cols(&x.ty);
        let dt = x.ty.dtype;
        // Inputs after gy: the addend (with `addend`), then grstd (when given).
        let addend = self.addend.then(|| &ins[RMS_ADDEND]);
        let grstd = ins.get(4 + self.addend as usize);
        let mut args = vec![ptr(x), ptr(w), ptr(rstd), ptr(gy)];
        args.extend(optional(grstd));
        args.extend([addend.map_or(Arg::Ptr(0), ptr), ptr(gx), n64(rows), n64(cols)]);
        let mut operands = vec![x, w, gy, gx];
        operands.extend(addend);
        let mut launches = rms_row_launch("rms_norm_backward", dt, rows, cols, &operands, args);
        let gw_args = vec![ptr(x), ptr(rstd), ptr(gy), ptr(gw), n64(rows), n64(cols)];
        launches.push(column_launch("rms_norm_backward_gw", dt, cols, gw_args));
        Ok(launches)
    }
}

impl Lower for LayerNorm {
    const KERNELS: &'static [KernelModule] = NORM;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, w, b) = (&cx.inputs[0], &cx.inputs[1], &cx.inputs[2]);
        let (y, mean, rstd) = (&cx.outputs[0], &cx.outputs[1], &cx.outputs[2]);
        let (rows, cols) = rows_cols(&x.ty);
        let args = vec![ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd), n64(rows), n64(cols), Arg::F64(self.eps)];
        Ok(row_launch("norm", "layer_norm", x.ty.dtype, rows, cols, args))
    }
}

impl Lower for LayerNormBackward {
    const KERNELS: &'static [KernelModule] = NORM;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let ins = cx.inputs;
        let (x, w, mean, rstd, gy) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
        let (gx, gw, gb) = (&cx.outputs[0], &cx.outputs[1], &cx.outputs[2]);
        let (rows, cols) = rows_cols(&x.ty);
        let dt = x.ty.dtype;
        // The shape rule admits 5 inputs or 7 (the two statistic cotangents
        // come together), and one more, the addend after gy, with `addend`.
        let extra = self.addend as usize;
        let addend = if self.addend { ptr(&ins[LN_ADDEND]) } else { Arg::Ptr(0) };
        let (gmean, grstd, has) = match ins.get(5 + extra..7 + extra) {
            Some([gm, gr]) => (ptr(gm), ptr(gr), 1),
            _ => (Arg::Ptr(0), Arg::Ptr(0), 0),
        };
        let args = vec![
            ptr(x),
            ptr(w),
            ptr(mean),
            ptr(rstd),
            ptr(gy),
            gmean,
            grstd,
            Arg::I32(has),
            addend,
            ptr(gx),
            n64(rows),
            n64(cols),
        ];
        let mut launches = row_launch("norm", "layer_norm_backward", dt, rows, cols, args);
        let gwb_args = vec![ptr(x), ptr(mean), ptr(rstd), ptr(gy), ptr(gw), ptr(gb), n64(rows), n64(cols)];
        launches.push(column_launch("layer_norm_backward_gwb", dt, cols, gwb_args));
        Ok(launches)
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::TensorType;
    use stepgraph_core::ops::Op;

    use super::super::testing::{kernels, lowered, operands};
    use super::*;

    #[test]
    fn parameter_gradients_are_written_without_rows() {
        let t = |s: &[usize]| TensorType::new(DType::F32, s);
        let rmsb = Op::RmsNormBackward(RmsNormBackward { eps: 1e-6, addend: false });
        let (_, _, l) = lowered(&rmsb, &[t(&[0, 7]), t(&[7]), t(&[0]), t(&[0, 7])]);
        let names: Vec<&str> = kernels(&l).iter().map(|k| k.function.as_str()).collect();
        assert_eq!(names, ["rms_norm_backward_gw_f32"]);
    }

    #[test]
    fn optional_inputs_pass_null_and_a_flag() {
        let t = |s: &[usize]| TensorType::new(DType::F32, s);
        let op = Op::RmsNormBackward(RmsNormBackward { eps: 1e-6, addend: false });
        for with in [false, true] {
            let mut tys = vec![t(&[2, 8]), t(&[8]), t(&[2]), t(&[2, 8])];
            if with {
                tys.push(t(&[2]));
            }
            let (ins, _, l) = lowered(&op, &tys);
            let k = kernels(&l)[0];
            let want = if with { [Arg::Ptr(ins[4].ptr), Arg::I32(1)] } else { [Arg::Ptr(0), Arg::I32(0)] };
            assert_eq!(k.args[4..6], want);
        }
    }

    #[test]
    fn wrong_operands_are_errors() {
        let t = |s: &[usize]| TensorType::new(DType::F32, s);
        let op = Op::RmsNorm(RmsNorm { eps: 1e-6 });
        let outs = operands(&[t(&[2, 8]), t(&[2])], 1 << 41, 0);
        let bad = operands(&[t(&[2, 8]), t(&[9])], 1 << 40, 0);
        assert!(super::super::lower(&op, &bad, &outs, None).is_err(), "weight of the wrong length");
        let ins = operands(&[t(&[2, 8]), t(&[8])], 1 << 40, 0);
        assert!(super::super::lower(&op, &ins, &outs[..1], None).is_err(), "missing rstd output");
        assert!(super::super::lower(&op, &ins, &outs, None).is_ok());
    }

    #[test]
    fn rms_norm_rows_of_whole_aligned_packs_take_the_register_kernel() {
        use stepgraph_core::ops::Op;
        let op = Op::from(RmsNorm { eps: 1e-6 });
        let (x, w) =
            (super::super::testing::t(DType::BF16, &[8192, 3200]), super::super::testing::t(DType::BF16, &[3200]));
        let l = super::super::testing::lower_types(&op, &[x, w.clone()], 0).unwrap();
        let k = &super::super::testing::kernels(&l)[0];
        assert_eq!(k.function, "rms_norm_vec_bf16");
        // 400 packs of 8, four per thread: 100 threads, rounded to 128.
        assert_eq!(k.block, (128, 1, 1));
        // Rows that are not whole packs take the general kernel.
        let odd = super::super::testing::t(DType::BF16, &[4, 28]);
        let l =
            super::super::testing::lower_types(&op, &[odd, super::super::testing::t(DType::BF16, &[28])], 0).unwrap();
        assert_eq!(super::super::testing::kernels(&l)[0].function, "rms_norm_bf16");
    }
}
