//! Lowering of the mixture-of-experts ops ([`TopK`], [`TopKBackward`],
//! [`ExpertSort`], [`GroupedMatmul`], [`GroupedMatmulWeightGrad`]) to the
//! kernels of `kernels/moe.cu`: one launch each. The routing sort is one
//! block (a stable counting sort, its warps over segments of the pairs,
//! whose offsets stay on the device); the rest are grid-stride loops with
//! a thread per output row or element, computing in the CPU reference's
//! order, so every output is the CPU's bit for bit. The grouped products of bf16 and f16 whose widths are
//! multiples of 8 (every expert geometry published) run on tensor cores
//! instead (`grouped_mma_*`: tiles of `MMA_TILE` rows and columns, each
//! row tile inside one expert), correct to the rounding of their f32 sums;
//! every other product takes the plain kernels.

use stepgraph_core::ops::moe::{ExpertSort, GroupedMatmul, GroupedMatmulWeightGrad, TopK, TopKBackward};

use super::util::{aligned16, float_name, launch, launch_1d};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_args::kernel_args;
use crate::kernel_module::KernelModule;
use crate::launch::{DevTensor, Launch};
use stepgraph_core::ir::DType;

const MODULE: &str = "moe";
const MOE: &[KernelModule] = &[KernelModule::plain(MODULE, include_str!("../../kernels/moe.cu"))];

/// Threads of the routing sort's one block (`SG_SORT_THREADS` of moe.cu).
const SORT_THREADS: u32 = 1024;
/// The most experts the routing sort's shared counts hold (`SG_SORT_SHARED`).
pub(super) const SORT_MAX_EXPERTS: usize = 8192;

/// Rows and columns of a tensor-core tile (`GMM_BM`, `GMM_BN` of moe.cu).
const MMA_TILE: usize = 128;
/// Threads of a tensor-core block (`GMM_THREADS`).
const MMA_THREADS: u32 = 256;

/// Whether a grouped product of `dtype` with these widths (the contiguous
/// extents of its operands) over these operands runs on tensor cores:
/// 16-bit floats, widths in whole 16-byte chunks, operands 16-byte aligned.
fn on_tensor_cores(dtype: DType, widths: &[usize], operands: &[&DevTensor]) -> Option<&'static str> {
    let name = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => return None,
    };
    (widths.iter().all(|w| w % 8 == 0) && aligned16(operands)).then_some(name)
}

kernel_args! {
    /// `top_k_<dtype>`: the `k` best entries of each of `rows` rows of `width`.
    pub(crate) struct TopKArgs {
        x: u64,
        values: u64,
        indices: u64,
        rows: i64,
        width: i64,
        k: i64,
    }
}

kernel_args! {
    /// `top_k_backward_<dtype>`: each row's `k` cotangents back at the
    /// entries they were picked from, zero elsewhere.
    pub(crate) struct TopKBackwardArgs {
        indices: u64,
        g: u64,
        gx: u64,
        rows: i64,
        width: i64,
        k: i64,
    }
}

kernel_args! {
    /// `expert_sort_<ids>`: the `pairs` routed pairs (`k` per token) sorted
    /// by expert into tokens, positions, the `experts + 1` offsets and the
    /// per-expert counts (f32).
    pub(crate) struct ExpertSortArgs {
        ids: u64,
        tokens: u64,
        position: u64,
        offsets: u64,
        counts: u64,
        pairs: i64,
        k: i64,
        experts: i64,
    }
}

kernel_args! {
    /// `grouped_matmul_<dtype>`: `y [m, n]` from rows `x [m, k]` and each
    /// expert's weight (`[n, k]`, or `[k, n]` with `trans_w` = 1).
    pub(crate) struct GroupedMatmulArgs {
        x: u64,
        w: u64,
        offsets: u64,
        y: u64,
        m: i64,
        k: i64,
        n: i64,
        experts: i64,
        trans_w: i64,
    }
}

kernel_args! {
    /// `grouped_matmul_weight_grad_<dtype>`: `out [experts, na, nb]`, each
    /// expert's sum of `a[p]ᵀ b[p]` over its rows.
    pub(crate) struct GroupedMatmulWeightGradArgs {
        a: u64,
        b: u64,
        offsets: u64,
        out: u64,
        m: i64,
        na: i64,
        nb: i64,
        experts: i64,
    }
}

/// The rows of a `[..., width]` tensor and its width.
fn rows_width(shape: &[usize]) -> (usize, usize) {
    let width = shape.last().copied().unwrap_or(1);
    (shape.iter().product::<usize>() / width.max(1), width)
}

impl Lower for TopK {
    const KERNELS: &'static [KernelModule] = MOE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, vals, idx) = (&cx.inputs[0], &cx.outputs[0], &cx.outputs[1]);
        let dt = float_name("top_k", x.ty.dtype)?;
        let (rows, width) = rows_width(&x.ty.shape);
        let args = TopKArgs {
            x: x.ptr,
            values: vals.ptr,
            indices: idx.ptr,
            rows: rows as i64,
            width: width as i64,
            k: self.k as i64,
        }
        .args();
        Ok(vec![launch_1d(MODULE, format!("top_k_{dt}"), rows, args)])
    }
}

impl Lower for TopKBackward {
    const KERNELS: &'static [KernelModule] = MOE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (idx, g, gx) = (&cx.inputs[0], &cx.inputs[1], &cx.outputs[0]);
        let dt = float_name("top_k_backward", g.ty.dtype)?;
        let (rows, k) = rows_width(&g.ty.shape);
        let args = TopKBackwardArgs {
            indices: idx.ptr,
            g: g.ptr,
            gx: gx.ptr,
            rows: rows as i64,
            width: self.width as i64,
            k: k as i64,
        }
        .args();
        Ok(vec![launch_1d(MODULE, format!("top_k_backward_{dt}"), gx.ty.numel(), args)])
    }
}

impl Lower for ExpertSort {
    const KERNELS: &'static [KernelModule] = MOE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let ids = &cx.inputs[0];
        let (tokens, position, offsets, counts) = (&cx.outputs[0], &cx.outputs[1], &cx.outputs[2], &cx.outputs[3]);
        let id = match ids.ty.dtype {
            d @ (stepgraph_core::ir::DType::I32 | stepgraph_core::ir::DType::I64) => d.name(),
            d => return Err(CudaError::lower("expert_sort", format!("expert ids must be i32 or i64, got {d}"))),
        };
        if self.experts > SORT_MAX_EXPERTS {
            return Err(CudaError::lower(
                "expert_sort",
                format!("{} experts: the CUDA routing sort holds at most {SORT_MAX_EXPERTS}", self.experts),
            ));
        }
        let args = ExpertSortArgs {
            ids: ids.ptr,
            tokens: tokens.ptr,
            position: position.ptr,
            offsets: offsets.ptr,
            counts: counts.ptr,
            pairs: ids.ty.numel() as i64,
            k: ids.ty.shape[1] as i64,
            experts: self.experts as i64,
        }
        .args();
        // One block: the offsets are summed between the count and the
        // placement, and 32,768 pairs (4,096 tokens, top-8) take 32 rounds
        // of its 32 warps.
        Ok(vec![launch(MODULE, format!("expert_sort_{id}"), (1, 1, 1), (SORT_THREADS, 1, 1), args)])
    }
}

impl Lower for GroupedMatmul {
    const KERNELS: &'static [KernelModule] = MOE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, w, offsets, y) = (&cx.inputs[0], &cx.inputs[1], &cx.inputs[2], &cx.outputs[0]);
        let dt = float_name("grouped_matmul", x.ty.dtype)?;
        let (m, k, n) = (x.ty.shape[0], x.ty.shape[1], y.ty.shape[1]);
        let experts = w.ty.shape[0];
        let args = GroupedMatmulArgs {
            x: x.ptr,
            w: w.ptr,
            offsets: offsets.ptr,
            y: y.ptr,
            m: m as i64,
            k: k as i64,
            n: n as i64,
            experts: experts as i64,
            trans_w: self.trans_w as i64,
        }
        .args();
        if let Some(tc) = on_tensor_cores(x.ty.dtype, &[k, n], &[x, w, y]) {
            // Every expert's rows in tiles: at most ceil(m / tile) + experts of them.
            let grid = ((m.div_ceil(MMA_TILE) + experts).max(1) as u32, n.div_ceil(MMA_TILE).max(1) as u32, 1);
            let f = format!("grouped_mma_{}_{tc}", if self.trans_w { "nn" } else { "nt" });
            return Ok(vec![launch(MODULE, f, grid, (MMA_THREADS, 1, 1), args)]);
        }
        Ok(vec![launch_1d(MODULE, format!("grouped_matmul_{dt}"), m * n, args)])
    }
}

impl Lower for GroupedMatmulWeightGrad {
    const KERNELS: &'static [KernelModule] = MOE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (a, b, offsets, out) = (&cx.inputs[0], &cx.inputs[1], &cx.inputs[2], &cx.outputs[0]);
        let dt = float_name("grouped_matmul_weight_grad", a.ty.dtype)?;
        let (na, nb, experts) = (a.ty.shape[1], b.ty.shape[1], out.ty.shape[0]);
        let args = GroupedMatmulWeightGradArgs {
            a: a.ptr,
            b: b.ptr,
            offsets: offsets.ptr,
            out: out.ptr,
            m: a.ty.shape[0] as i64,
            na: a.ty.shape[1] as i64,
            nb: b.ty.shape[1] as i64,
            experts: experts as i64,
        }
        .args();
        if let Some(tc) = on_tensor_cores(a.ty.dtype, &[na, nb], &[a, b, out]) {
            if experts > 0 {
                let grid = (na.div_ceil(MMA_TILE).max(1) as u32, nb.div_ceil(MMA_TILE).max(1) as u32, experts as u32);
                let f = format!("grouped_mma_weight_grad_{tc}");
                return Ok(vec![launch(MODULE, f, grid, (MMA_THREADS, 1, 1), args)]);
            }
        }
        Ok(vec![launch_1d(MODULE, format!("grouped_matmul_weight_grad_{dt}"), out.ty.numel(), args)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define NAME value` in moe.cu.
    fn define(name: &str) -> usize {
        let source = include_str!("../../kernels/moe.cu");
        let line = source
            .lines()
            .find_map(|l| l.strip_prefix("#define ").and_then(|rest| rest.strip_prefix(name)))
            .unwrap_or_else(|| panic!("moe.cu defines {name}"));
        line.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{name} is a number"))
    }

    /// The launches' sizes are the kernels' own: the tensor-core tile and
    /// block, and the routing sort's block and expert limit.
    #[test]
    fn the_launch_sizes_are_the_kernels() {
        assert_eq!((define("GMM_BM"), define("GMM_BN")), (MMA_TILE, MMA_TILE));
        assert_eq!(define("GMM_THREADS"), MMA_THREADS as usize);
        assert_eq!(define("SG_SORT_THREADS"), SORT_THREADS as usize);
        assert_eq!(define("SG_SORT_SHARED"), SORT_MAX_EXPERTS);
    }
}
