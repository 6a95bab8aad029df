//! Lowering of the rotary embedding to the kernels of `kernels/rope.cu`.
//! Positions on axis 1 (one input): one block per position of
//! `[B, T, H, D]`, rotating that position's row of every batch row with the
//! angles it computes once. Per-row start positions (a second input, for
//! generation): one block per row `(b, t)`, since rows at different
//! positions share no angles. Either way a 2-D block whose x lanes cover
//! one chunk of a head's rotated pairs and y lanes the heads; Llama-3.x
//! frequency scaling passed as arguments. The identity in place (no rotated
//! dims, output aliasing input) launches nothing.

use stepgraph_core::ops::rope::Rope;
use stepgraph_core::ops::OpDef;

use super::util::{n64, ptr, row_grid, typed_kernel, MAX_ROW_BLOCKS};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernels::KernelModule;
use crate::launch::{Arg, Launch};

/// `ROPE_CHUNK` of rope.cu: pairs whose angles a rope block holds at once.
const ROPE_CHUNK: usize = 256;
/// Rope blocks do little per element; smaller blocks spread the B·T rows.
const ROPE_MAX_THREADS: usize = 256;

impl Lower for Rope {
    const KERNELS: &'static [KernelModule] = &[KernelModule::plain("rope", include_str!("../../kernels/rope.cu"))];

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        let [batch, seq, heads, dim] = x.ty.shape[..] else {
            return Err(CudaError::lower(self.name(), format!("x must be [B, T, H, D], got {}", x.ty)));
        };
        let row = heads * dim;
        if x.ty.numel() == 0 || (self.n_rot == 0 && x.ptr == y.ptr) {
            // Nothing to write: no element, or the identity in place.
            return Ok(vec![]);
        }
        // In-row offsets are 32-bit in the kernel (its per-element divisions are cheaper so).
        let int = |v: usize, what: &str| {
            i32::try_from(v)
                .map_err(|_| CudaError::lower(self.name(), format!("{what} = {v} exceeds the kernel's 32-bit range")))
        };
        let (heads_i, dim_i, n_rot_i) = (int(heads, "H")?, int(dim, "D")?, int(self.n_rot, "n_rot")?);
        int(row, "H·D")?;
        // A 2-D block of ROPE_MAX_THREADS: x over a chunk's pairs of one head
        // (rounded up to whole warps), y over heads; n_rot ≤ 1 walks rows flat.
        let pairs = (self.n_rot / 2).min(ROPE_CHUNK);
        let block_x = if pairs > 0 { pairs.next_multiple_of(32).min(ROPE_MAX_THREADS) } else { ROPE_MAX_THREADS };
        let block = (block_x as u32, (ROPE_MAX_THREADS / block_x) as u32, 1);
        let bt = batch * seq;
        let start = cx.inputs.get(1);
        let mut args = vec![ptr(x), ptr(y)];
        args.extend(start.map(ptr));
        args.extend([
            n64(bt),
            n64(seq),
            Arg::I32(heads_i),
            Arg::I32(dim_i),
            Arg::I32(n_rot_i),
            Arg::F64(self.base),
            Arg::I32(self.inverse as i32),
        ]);
        // Llama-3.x scaling travels as a flag and its four numbers; unscaled
        // launches pass zeros the kernel never reads.
        let scaling = self.scaling.as_ref();
        args.extend([
            Arg::I32(scaling.is_some() as i32),
            Arg::F64(scaling.map_or(0.0, |s| s.factor)),
            Arg::F64(scaling.map_or(0.0, |s| s.low_freq_factor)),
            Arg::F64(scaling.map_or(0.0, |s| s.high_freq_factor)),
            Arg::F64(scaling.map_or(0.0, |s| s.original_max_position_embeddings as f64)),
        ]);
        Ok(vec![match start {
            // One block per position: it rotates that position's row of every batch row.
            None => typed_kernel("rope", "rope", x.ty.dtype, row_grid(seq, MAX_ROW_BLOCKS), block, args),
            // One block per row, each at its own position.
            Some(_) => typed_kernel("rope", "rope_at", x.ty.dtype, row_grid(bt, MAX_ROW_BLOCKS), block, args),
        }])
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::{DType, TensorType};
    use stepgraph_core::ops::Op;

    use super::*;
    use crate::launch::DevTensor;
    use crate::ops::lower;

    #[test]
    fn rope_in_place_identity_is_free_and_out_of_place_copies() {
        let op = Op::Rope(Rope { n_rot: 0, base: 10000.0, inverse: false, scaling: None });
        let ty = TensorType::new(DType::BF16, [1, 2, 3, 4]);
        let x = DevTensor { ty: ty.clone(), ptr: 4096 };
        assert!(lower(&op, std::slice::from_ref(&x), std::slice::from_ref(&x), None).unwrap().is_empty());
        let y = DevTensor { ty, ptr: 8192 };
        assert_eq!(lower(&op, &[x], &[y], None).unwrap().len(), 1);
    }

    #[test]
    fn positioned_rope_takes_one_block_per_row() {
        let op = Op::Rope(Rope { n_rot: 100, base: 10000.0, inverse: false, scaling: None });
        let x = DevTensor { ty: TensorType::new(DType::BF16, [16, 1, 32, 100]), ptr: 4096 };
        let start = DevTensor { ty: TensorType::new(DType::I32, [16]), ptr: 1 << 20 };
        let l = lower(&op, &[x.clone(), start], std::slice::from_ref(&x), None).unwrap();
        let Launch::Kernel(k) = &l[0] else { panic!("expected a kernel, got {l:?}") };
        assert_eq!((k.function.as_str(), k.grid), ("rope_at_bf16", (16, 1, 1)));
        // 50 pairs round up to 64 lanes, four heads' worth of rows per block.
        assert_eq!(k.block, (64, 4, 1));
        assert_eq!(k.args[..4], [Arg::Ptr(4096), Arg::Ptr(4096), Arg::Ptr(1 << 20), Arg::I64(16)]);
        // Positions on axis 1: one block per position, shared by the batch rows.
        let l = lower(&op, std::slice::from_ref(&x), std::slice::from_ref(&x), None).unwrap();
        let Launch::Kernel(k) = &l[0] else { panic!("expected a kernel, got {l:?}") };
        assert_eq!((k.function.as_str(), k.grid), ("rope_bf16", (1, 1, 1)));
    }
}
