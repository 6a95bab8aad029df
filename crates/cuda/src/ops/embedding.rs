//! Lowering of the embedding gather and its backward to the kernels of
//! `kernels/embedding.cu`. The gather copies table rows in the widest unit
//! dividing the row's bytes and both addresses; the backward gives each
//! table row to one block, which scans the ids in order and adds the rows of
//! the cotangent that hit it (no float atomics, a fixed order). An id out of
//! range gathers a zero row and scatters nowhere, so the kernels stay
//! memory-safe when the session's host-side check is bypassed.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::embedding::{Embedding, EmbeddingBackward};

use super::util::{float_name, launch, unit_for, MAX_GRID, THREADS};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_args::kernel_args;
use crate::kernel_module::KernelModule;
use crate::launch::{blocks, Launch};

const EMBEDDING: &[KernelModule] = &[KernelModule::plain("embedding", include_str!("../../kernels/embedding.cu"))];

/// Columns each embedding-backward thread accumulates (`kCols` in embedding.cu).
const EMB_COLS_PER_THREAD: usize = 8;

kernel_args! {
    /// `embedding_<unit>_<ids>`: row `ids[p]` of the `rows`-row table to
    /// row `p` of `y`, for the `n` ids, rows of `row_units` copy units.
    pub(crate) struct EmbeddingArgs {
        ids: u64,
        table: u64,
        y: u64,
        n: i64,
        rows: i64,
        row_units: i64,
    }
}

kernel_args! {
    /// `embedding_backward_<dtype>_<ids>`: row r of `gt` (of `rows`, each
    /// `width` elements) is the sum of the rows of `gy` whose id is r.
    pub(crate) struct EmbeddingBackwardArgs {
        ids: u64,
        gy: u64,
        gt: u64,
        n: i64,
        rows: i64,
        width: i64,
    }
}

fn id_name(op: &str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::I32 | DType::I64 => Ok(dt.name()),
        d => Err(CudaError::lower(op, format!("ids must be i32 or i64, got {d}"))),
    }
}

impl Lower for Embedding {
    const KERNELS: &'static [KernelModule] = EMBEDDING;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (ids, table, y) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let id = id_name("embedding", ids.ty.dtype)?;
        let (rows, width) = (table.ty.shape[0], table.ty.shape[1]);
        let es = table.ty.dtype.size() as u64;
        let (w, unit) = unit_for(&[table.ptr, y.ptr, width as u64 * es]);
        let wu = (width as u64 * es / w) as usize;
        // Threads over a row's units (a power of two up to 256), the rest of the
        // 256 over positions.
        let tx = wu.next_power_of_two().min(THREADS as usize) as u32;
        let ty = THREADS / tx;
        let n_ids = ids.ty.numel();
        let grid = blocks(n_ids, ty as usize).min(MAX_GRID as u32);
        let args = EmbeddingArgs {
            ids: ids.ptr,
            table: table.ptr,
            y: y.ptr,
            n: n_ids as i64,
            rows: rows as i64,
            row_units: wu as i64,
        }
        .args();
        Ok(vec![launch("embedding", format!("embedding_{unit}_{id}"), (grid, 1, 1), (tx, ty, 1), args)])
    }
}

impl Lower for EmbeddingBackward {
    const KERNELS: &'static [KernelModule] = EMBEDDING;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (ids, gy, gt) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let id = id_name("embedding_backward", ids.ty.dtype)?;
        let dt = float_name("embedding_backward", gt.ty.dtype)?;
        let width = gt.ty.shape[1];
        // Enough threads that one pass covers the width when it can (at most
        // 512, the kernel's bound), at least 128 so the id scan is wide.
        let threads = (width.div_ceil(EMB_COLS_PER_THREAD).div_ceil(32) * 32).clamp(128, 512) as u32;
        let grid = self.num_rows.clamp(1, MAX_GRID) as u32;
        let args = EmbeddingBackwardArgs {
            ids: ids.ptr,
            gy: gy.ptr,
            gt: gt.ptr,
            n: ids.ty.numel() as i64,
            rows: self.num_rows as i64,
            width: width as i64,
        }
        .args();
        Ok(vec![launch("embedding", format!("embedding_backward_{dt}_{id}"), (grid, 1, 1), (threads, 1, 1), args)])
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{function, t};
    use super::*;

    #[test]
    fn rows_are_copied_in_the_widest_unit() {
        assert_eq!(function(Embedding, &[t(DType::I64, &[5]), t(DType::BF16, &[9, 24])]), "embedding_u128_i64");
        assert_eq!(function(Embedding, &[t(DType::I32, &[5]), t(DType::F32, &[9, 3])]), "embedding_u32_i32");
        let op = EmbeddingBackward { num_rows: 9 };
        assert_eq!(function(op, &[t(DType::I32, &[5]), t(DType::BF16, &[5, 24])]), "embedding_backward_bf16_i32");
    }
}
