//! Lowering of the reductions (`sum`, `mean`, `max` over axes), of max's
//! backward and of the sum of squares over the last axis to the kernels of
//! `kernels/reduce.cu`. A `ReducePlan`
//! merges adjacent kept and reduced axes into groups once here and picks
//! the kernel layout (a block per row, a warp per row, or a thread per
//! output walking columns) from the shape.

use stepgraph_core::ops::reduce::{MaxBackward, Reduce, ReduceKind, SumSquares};
use stepgraph_core::ops::OpDef;

use super::util::{contiguous_strides, float_name, launch, Dim3, MAX_GRID};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernels::KernelModule;
use crate::launch::{blocks, Arg, Launch, StructArg};

const REDUCE: &[KernelModule] = &[KernelModule::plain("reduce", include_str!("../../kernels/reduce.cu"))];

/// Kept (and reduced) axis groups a reduction's shape struct holds: they
/// alternate after merging, so a rank-8 input has at most 4 of each.
pub(crate) const MAX_GROUPS: usize = 4;

/// (size, input element stride) of merged axis groups, outer to inner.
type Groups = Vec<(i64, i64)>;

/// Kept and reduced groups of a reduction, as the kernels' `ReduceShape`.
#[derive(Debug, PartialEq)]
struct ReducePlan {
    kept: Groups,
    /// Never empty.
    reduced: Groups,
    /// Is the innermost non-trivial axis reduced (rows) or kept (columns)?
    inner_reduced: bool,
}

impl ReducePlan {
    fn new(shape: &[usize], axes: &[usize]) -> Self {
        let strides = contiguous_strides(shape);
        let (mut kept, mut reduced): (Groups, Groups) = (Vec::new(), Vec::new());
        // Kind of the last group pushed: adjacent axes of one kind (size-1
        // axes between them do not count) are contiguous, so they merge.
        let mut last: Option<bool> = None;
        for (d, &size) in shape.iter().enumerate() {
            if size == 1 {
                continue;
            }
            let is_reduced = axes.contains(&d);
            let groups = if is_reduced { &mut reduced } else { &mut kept };
            if last == Some(is_reduced) {
                let g = groups.last_mut().expect("a group of this kind exists");
                g.0 *= size as i64;
                g.1 = strides[d];
            } else {
                groups.push((size as i64, strides[d]));
            }
            last = Some(is_reduced);
        }
        // A full reduction of nothing but size-1 axes: one element at offset 0.
        let inner_reduced = last != Some(false);
        if reduced.is_empty() {
            reduced.push((1, 0));
        }
        ReducePlan { kept, reduced, inner_reduced }
    }

    fn nout(&self) -> i64 {
        self.kept.iter().map(|g| g.0).product()
    }

    fn count(&self) -> i64 {
        self.reduced.iter().map(|g| g.0).product()
    }

    fn arg(&self, op: &str) -> Result<Arg> {
        if self.kept.len() > MAX_GROUPS || self.reduced.len() > MAX_GROUPS {
            return Err(CudaError::lower(op, format!("more than {MAX_GROUPS} kept or reduced axis groups")));
        }
        // Sizes padded with 1 and strides with 0 to the struct's fixed arrays.
        let sizes_strides = |g: &Groups| {
            let (mut s, mut t): (Vec<i64>, Vec<i64>) = g.iter().copied().unzip();
            s.resize(MAX_GROUPS, 1);
            t.resize(MAX_GROUPS, 0);
            (s, t)
        };
        let ((ks, kt), (rs, rt)) = (sizes_strides(&self.kept), sizes_strides(&self.reduced));
        Ok(StructArg::default()
            .i64(self.kept.len() as i64)
            .i64s(&ks)
            .i64s(&kt)
            .i64(self.reduced.len() as i64)
            .i64s(&rs)
            .i64s(&rt)
            .build())
    }

    /// The kernel layout (`rows`, `warps` or `cols`), grid and block; see reduce.cu.
    fn layout(&self) -> (&'static str, Dim3, Dim3) {
        let (nout, count) = (self.nout() as usize, self.count() as usize);
        // Rows of up to 16 elements go to the column layout too: a thread
        // per output walking its few contiguous elements uses whole cache
        // lines across the warp, where a warp per row would idle most lanes.
        if self.inner_reduced && count > 16 {
            if count <= 256 {
                // Short rows: a warp per output, 8 per block.
                ("warps", (blocks(nout, 8).min(MAX_GRID as u32), 1, 1), (32, 8, 1))
            } else {
                // Long rows: a block per output; few outputs get wide blocks.
                let threads = if nout < 256 { 1024 } else { 256 };
                ("rows", (nout.clamp(1, MAX_GRID) as u32, 1, 1), (threads, 1, 1))
            }
        } else {
            // 32 adjacent outputs per block; enough y threads that each
            // walks about 16 reduced elements, at most 32 (1024 threads).
            // (With 16 or fewer, one: a thread per output.)
            let by = count.div_ceil(16).next_power_of_two().clamp(1, 32) as u32;
            ("cols", (blocks(nout, 32).min(MAX_GRID as u32), 1, 1), (32, by, 1))
        }
    }
}

impl Lower for Reduce {
    const KERNELS: &'static [KernelModule] = REDUCE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        // A mean is the sum kernel dividing by the count at the end (its `mean` flag).
        let (kernel, mean) = match self.kind {
            ReduceKind::Sum => ("sum", 0),
            ReduceKind::Mean => ("sum", 1),
            ReduceKind::Max => ("max", 0),
        };
        let name = self.name();
        let dt = float_name(name, x.ty.dtype)?;
        let plan = ReducePlan::new(&x.ty.shape, &self.axes);
        let (layout, grid, block) = plan.layout();
        let args = vec![
            Arg::Ptr(x.ptr),
            Arg::Ptr(y.ptr),
            Arg::I64(plan.nout()),
            Arg::I64(plan.count()),
            Arg::I64(mean),
            plan.arg(name)?,
        ];
        Ok(vec![launch("reduce", format!("{kernel}_{layout}_{dt}"), grid, block, args)])
    }
}

impl Lower for MaxBackward {
    const KERNELS: &'static [KernelModule] = REDUCE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y, g, gx) = (&cx.inputs[0], &cx.inputs[1], &cx.inputs[2], &cx.outputs[0]);
        let dt = float_name("max_backward", gx.ty.dtype)?;
        let plan = ReducePlan::new(&x.ty.shape, &self.axes);
        let (layout, grid, block) = plan.layout();
        let args = vec![
            Arg::Ptr(x.ptr),
            Arg::Ptr(y.ptr),
            Arg::Ptr(g.ptr),
            Arg::Ptr(gx.ptr),
            Arg::I64(plan.nout()),
            Arg::I64(plan.count()),
            plan.arg("max_backward")?,
        ];
        Ok(vec![launch("reduce", format!("max_backward_{layout}_{dt}"), grid, block, args)])
    }
}

impl Lower for SumSquares {
    const KERNELS: &'static [KernelModule] = REDUCE;

    /// One 256-thread block per row, grid-stride over the rows.
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let (x, y) = (&cx.inputs[0], &cx.outputs[0]);
        let dt = float_name("sum_squares", x.ty.dtype)?;
        let len = *x.ty.shape.last().expect("the shape rule keeps an axis");
        let rows = y.ty.numel();
        let grid = (rows.min(MAX_GRID) as u32, 1, 1);
        let args = vec![Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), Arg::I64(rows as i64), Arg::I64(len as i64)];
        Ok(vec![launch("reduce", format!("sum_squares_{dt}"), grid, (256, 1, 1), args)])
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::DType;
    use stepgraph_core::ops::Op;

    use super::super::testing::{lower_types, t};
    use super::*;

    #[test]
    fn reduce_plans_group_axes_and_pick_layouts() {
        let p = ReducePlan::new(&[2, 3, 4, 5], &[1, 3]);
        assert_eq!(p.kept, vec![(2, 60), (4, 5)]);
        assert_eq!(p.reduced, vec![(3, 20), (5, 1)]);
        assert!(p.inner_reduced);
        // Rows of 15: a thread per output.
        assert_eq!(p.layout().0, "cols");
        assert_eq!(p.layout().2, (32, 1, 1));
        assert_eq!(ReducePlan::new(&[33, 17], &[1]).layout().0, "warps");
        // Size-1 axes vanish, so [3, 1, 5] over axis 1 keeps one merged group.
        let p = ReducePlan::new(&[3, 1, 5], &[1]);
        assert_eq!((p.kept.clone(), p.reduced.clone(), p.inner_reduced), (vec![(15, 1)], vec![(1, 0)], false));
        assert_eq!(p.layout().0, "cols");
        let p = ReducePlan::new(&[4, 6, 8, 10], &[0, 2]);
        assert_eq!((p.kept.clone(), p.reduced.clone()), (vec![(6, 80), (10, 1)], vec![(4, 480), (8, 10)]));
        assert_eq!(ReducePlan::new(&[3, 4100], &[1]).layout().0, "rows");
        assert_eq!(ReducePlan::new(&[3, 4100], &[1]).layout().2, (1024, 1, 1));
        assert_eq!(ReducePlan::new(&[300, 300], &[1]).layout().2, (256, 1, 1));
        assert_eq!(ReducePlan::new(&[1000, 7], &[0]).layout().2, (32, 32, 1));
        let full = ReducePlan::new(&[], &[]);
        assert_eq!((full.nout(), full.count()), (1, 1));
    }

    #[test]
    fn a_reduction_over_an_empty_axis_still_writes_its_identity() {
        let op = Op::from(Reduce { kind: ReduceKind::Sum, axes: vec![0], keepdim: false });
        assert_eq!(lower_types(&op, &[t(DType::F32, &[0, 3])], 0).unwrap().len(), 1);
    }
}
