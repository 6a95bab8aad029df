//! Helpers shared by the op lowerings of several families: launch
//! builders, grid and block sizes, the dtype suffixes of kernel names,
//! axis merging for strided walks and copy units for byte moves. Data only,
//! like everything under `ops`.

use stepgraph_core::ir::{DType, TensorType};

use crate::error::{CudaError, Result};
use crate::launch::{blocks, Arg, DevTensor, KernelLaunch, Launch};

/// A grid or block size.
pub(crate) type Dim3 = (u32, u32, u32);

/// Threads per block of the grid-stride kernels (elementwise, movement,
/// embedding, AdamW: their `__launch_bounds__`).
pub(crate) const THREADS: u32 = 256;
/// Grid cap for grid-stride kernels: enough blocks to fill any current GPU
/// many times over, few enough that per-block setup stays negligible.
pub(crate) const MAX_GRID: usize = 1 << 16;
/// The largest rank a kernel's shape struct holds (after merging axes).
pub(crate) const MAX_RANK: usize = 8;

/// Elements a row-kernel thread handles before the block grows: enough that
/// a block's reduction is not most of its work and that rows of a few
/// thousand elements make blocks of a few hundred threads, so several rows
/// are in flight per SM (a 1024-thread block per 4096-element row left two
/// rows per SM and made W5's RMSNorm latency-bound), few enough that a
/// row of a few thousand elements still fills a block.
const ROW_ELEMS_PER_THREAD: usize = 16;
/// The largest block (and the `__launch_bounds__` of every row kernel).
const MAX_THREADS: usize = 1024;
/// Row kernels grid-stride, so any grid is correct; this only keeps grid.x
/// far below its 2³¹ − 1 limit.
pub(crate) const MAX_ROW_BLOCKS: usize = 1 << 20;

/// The kernel-name suffix of a float dtype.
pub(crate) fn float_name(op: &str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 | DType::BF16 | DType::F16 | DType::F64 => Ok(dt.name()),
        d => Err(CudaError::unsupported(op, format!("no kernel for {d} tensors"))),
    }
}

/// A kernel launch without dynamic shared memory.
pub(crate) fn launch(module: &'static str, function: String, grid: Dim3, block: Dim3, args: Vec<Arg>) -> Launch {
    Launch::Kernel(KernelLaunch { module, function, grid, block, shared_bytes: 0, args })
}

/// A 1-D grid-stride launch of `THREADS`-thread blocks over `n` items.
pub(crate) fn launch_1d(module: &'static str, function: String, n: usize, args: Vec<Arg>) -> Launch {
    launch(module, function, (grid_1d(n), 1, 1), (THREADS, 1, 1), args)
}

/// Does every operand start on a 16-byte boundary (one `uint4` access)?
pub(crate) fn aligned16(operands: &[&DevTensor]) -> bool {
    operands.iter().all(|t| t.ptr % 16 == 0)
}

/// A 1-D launch of `<base>_<dt>` over `n` elements, or of its 16-byte
/// variant `<base>_vec_<dt>` (each thread moves 16 bytes of every operand per
/// iteration, one thread per 16 bytes of output) when every operand in
/// `operands` starts 16-byte aligned. Both kernels take `args` and compute
/// the same bits.
pub(crate) fn pointwise_launch(
    module: &'static str,
    base: &str,
    dt: DType,
    n: usize,
    operands: &[&DevTensor],
    args: Vec<Arg>,
) -> Launch {
    if n > 1 && aligned16(operands) {
        let per_thread = 16 / dt.size();
        launch_1d(module, format!("{base}_vec_{}", dt.name()), n.div_ceil(per_thread), args)
    } else {
        launch_1d(module, format!("{base}_{}", dt.name()), n, args)
    }
}

pub(crate) fn grid_1d(n: usize) -> u32 {
    blocks(n, THREADS as usize).min(MAX_GRID as u32)
}

/// A count or size as the kernels' `long long`.
pub(crate) fn n64(n: usize) -> Arg {
    Arg::I64(n as i64)
}

/// A tensor's address as a pointer argument.
pub(crate) fn ptr(t: &DevTensor) -> Arg {
    Arg::Ptr(t.ptr)
}

/// An optional input: its address and a present flag, or null and 0.
pub(crate) fn optional(t: Option<&DevTensor>) -> [Arg; 2] {
    match t {
        Some(t) => [ptr(t), Arg::I32(1)],
        None => [Arg::Ptr(0), Arg::I32(0)],
    }
}

// ---------------------------------------------------------------- row kernels

/// `(rows, cols)` of a tensor seen as rows of its last axis.
pub(crate) fn rows_cols(ty: &TensorType) -> (usize, usize) {
    let cols = ty.shape.last().copied().unwrap_or(1);
    (ty.numel().checked_div(cols).unwrap_or(0), cols)
}

/// Threads of a row kernel's block for rows of `cols` elements.
pub(crate) fn row_threads(cols: usize) -> u32 {
    cols.div_ceil(ROW_ELEMS_PER_THREAD).next_multiple_of(32).clamp(32, MAX_THREADS) as u32
}

pub(crate) fn row_grid(rows: usize, cap: usize) -> Dim3 {
    (rows.clamp(1, cap) as u32, 1, 1)
}

/// A launch of `<op>_<dtype>` in `module`.
pub(crate) fn typed_kernel(
    module: &'static str,
    op: &str,
    dtype: DType,
    grid: Dim3,
    block: Dim3,
    args: Vec<Arg>,
) -> Launch {
    launch(module, format!("{op}_{}", dtype.name()), grid, block, args)
}

/// Row-kernel launch over `rows` rows of `cols`, none when there is no row.
pub(crate) fn row_launch(
    module: &'static str,
    name: &str,
    dtype: DType,
    rows: usize,
    cols: usize,
    args: Vec<Arg>,
) -> Vec<Launch> {
    if rows == 0 {
        return vec![];
    }
    vec![typed_kernel(module, name, dtype, row_grid(rows, MAX_ROW_BLOCKS), (row_threads(cols), 1, 1), args)]
}

// ---------------------------------------------------------------- axes

/// Row-major element strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as i64;
    }
    s
}

/// Strides of `input` seen through numpy broadcasting to `output`: one per
/// output axis, 0 where the input is broadcast (missing or of size 1).
pub(crate) fn broadcast_strides(input: &[usize], output: &[usize]) -> Vec<i64> {
    let lead = output.len() - input.len();
    let own = contiguous_strides(input);
    (0..output.len()).map(|i| if i < lead || input[i - lead] == 1 { 0 } else { own[i - lead] }).collect()
}

/// Drops size-1 axes and merges adjacent axes that are contiguous in every
/// operand (`outer stride = inner stride * inner size`), preserving the
/// row-major order of the walk. Returns at least one axis: a walk of one
/// element is `[1]` with strides 0.
pub(crate) fn merge_axes(sizes: &[usize], strides: &[Vec<i64>]) -> (Vec<i64>, Vec<Vec<i64>>) {
    let mut out_sizes: Vec<i64> = Vec::new();
    let mut out_strides: Vec<Vec<i64>> = vec![Vec::new(); strides.len()];
    for (d, &size) in sizes.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let size = size as i64;
        let mergeable = !out_sizes.is_empty()
            && strides.iter().zip(&out_strides).all(|(s, o)| *o.last().expect("same length") == s[d] * size);
        if mergeable {
            *out_sizes.last_mut().expect("non-empty") *= size;
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                *o.last_mut().expect("non-empty") = s[d];
            }
        } else {
            out_sizes.push(size);
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                o.push(s[d]);
            }
        }
    }
    if out_sizes.is_empty() {
        out_sizes.push(1);
        for o in out_strides.iter_mut() {
            o.push(0);
        }
    }
    (out_sizes, out_strides)
}

/// `v` padded with `fill` to `MAX_RANK` entries (the kernels' fixed arrays).
pub(crate) fn pad(v: &[i64], fill: i64) -> [i64; MAX_RANK] {
    let mut p = [fill; MAX_RANK];
    p[..v.len()].copy_from_slice(v);
    p
}

// ---------------------------------------------------------------- copy units

/// Copy units of movement.cu and embedding.cu, widest first: (bytes, name).
pub(crate) const UNITS: [(u64, &str); 5] = [(16, "u128"), (8, "u64"), (4, "u32"), (2, "u16"), (1, "u8")];

/// The widest copy unit dividing every byte quantity in `bytes` (run
/// lengths, offsets, addresses); an offset of 0 allows any unit.
pub(crate) fn unit_for(bytes: &[u64]) -> (u64, &'static str) {
    *UNITS.iter().find(|(w, _)| bytes.iter().all(|b| b % w == 0)).expect("1 divides everything")
}

/// Do byte ranges `[a.0, a.1)` and `[b.0, b.1)` share a byte?
fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// `a` and `b` as launches of one kernel function, grid and block that may
/// run as one: neither writes bytes the other reads or writes, by
/// `ranges` (the `[read, written]` bytes of a launch, `None` for a launch
/// of another kind).
pub(crate) fn independent_pair<'l>(
    a: &'l Launch,
    b: &'l Launch,
    ranges: impl Fn(&KernelLaunch) -> Option<[(u64, u64); 2]>,
) -> Option<(&'l KernelLaunch, &'l KernelLaunch)> {
    let (Launch::Kernel(ka), Launch::Kernel(kb)) = (a, b) else { return None };
    let ([ra, wa], [rb, wb]) = (ranges(ka)?, ranges(kb)?);
    let same = ka.function == kb.function && ka.grid == kb.grid && ka.block == kb.block && ka.grid.1 == 1;
    (same && !overlap(wa, wb) && !overlap(wa, rb) && !overlap(wb, ra)).then_some((ka, kb))
}

/// The launch of `function` on `args` over two rows of `first`'s grid (its
/// blocks with `blockIdx.y` 0 doing the first launch's work, 1 the second's).
pub(crate) fn two_row_launch(first: &KernelLaunch, function: String, args: Vec<Arg>) -> Launch {
    Launch::Kernel(KernelLaunch { function, grid: (first.grid.0, 2, 1), args, ..first.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_axes_drops_ones_and_merges_contiguous_axes() {
        // A bias add: [8, 1, 4, 6] + [6] merges to [32, 6] with b's stride 0 outside.
        let out = [8, 1, 4, 6];
        let (s, st) = merge_axes(&out, &[contiguous_strides(&out), broadcast_strides(&[6], &out)]);
        assert_eq!(s, vec![32, 6]);
        assert_eq!(st, vec![vec![6, 1], vec![0, 1]]);
        // Same shapes merge to one axis; a scalar walk is one element.
        let (s, st) = merge_axes(&[2, 3, 4], &[contiguous_strides(&[2, 3, 4])]);
        assert_eq!((s, st), (vec![24], vec![vec![1]]));
        let (s, st) = merge_axes(&[1, 1], &[vec![0, 0]]);
        assert_eq!((s, st), (vec![1], vec![vec![0]]));
        // A transpose of the last two axes of [2, 3, 4] keeps three axes.
        let (s, _) = merge_axes(&[2, 4, 3], &[vec![12, 1, 4]]);
        assert_eq!(s, vec![2, 4, 3]);
    }
}
