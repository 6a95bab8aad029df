//! Lowering of the reductions (`sum`, `mean`, `max` over axes), of max's
//! backward and of the squared norms of many tensors to the kernels of `kernels/reduce.cu`. A `ReducePlan`
//! merges adjacent kept and reduced axes into groups once here and picks
//! the kernel layout (a block per row, a warp per row, or a thread per
//! output walking columns) from the shape.

use stepgraph_core::ops::reduce::{MaxBackward, Reduce, ReduceKind, SquaredNorms, SQUARED_NORM_CHUNK};
use stepgraph_core::ops::OpDef;

use super::util::{contiguous_strides, float_name, launch, Dim3, MAX_GRID};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_args::{kernel_args, kernel_struct};
use crate::kernel_module::KernelModule;
use crate::launch::{blocks, Arg, DevTensor, Launch, StructArg};

const REDUCE: &[KernelModule] = &[KernelModule::plain("reduce", include_str!("../../kernels/reduce.cu"))];

/// Kept (and reduced) axis groups a reduction's shape struct holds: they
/// alternate after merging, so a rank-8 input has at most 4 of each.
pub(crate) const MAX_GROUPS: usize = 4;

/// (size, input element stride) of merged axis groups, outer to inner.
type Groups = Vec<(i64, i64)>;

kernel_struct! {
    /// `sg_red::ReduceShape` of reduce.cu: the kept and the reduced axis
    /// groups (a count of each, then sizes padded with 1 and input element
    /// strides padded with 0), outer to inner.
    pub(crate) struct ReduceShape {
        kept: i64,
        kept_size: [i64; MAX_GROUPS],
        kept_stride: [i64; MAX_GROUPS],
        reduced: i64,
        reduced_size: [i64; MAX_GROUPS],
        reduced_stride: [i64; MAX_GROUPS],
    }
}

kernel_args! {
    /// `sum_<layout>_<dtype>` and `max_<layout>_<dtype>`: `nout` outputs,
    /// each over `count` elements; with `mean` = 1 the sum is divided by
    /// the count.
    pub(crate) struct ReduceArgs {
        x: u64,
        y: u64,
        nout: i64,
        count: i64,
        mean: i64,
        shape: ReduceShape,
    }
}

kernel_args! {
    /// `max_backward_<layout>_<dtype>`: `gy` shared among the elements of
    /// `x` equal to their maximum `y`, zero elsewhere.
    pub(crate) struct MaxBackwardArgs {
        x: u64,
        y: u64,
        gy: u64,
        gx: u64,
        nout: i64,
        count: i64,
        shape: ReduceShape,
    }
}

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

    fn shape(&self, op: &str) -> Result<ReduceShape> {
        if self.kept.len() > MAX_GROUPS || self.reduced.len() > MAX_GROUPS {
            return Err(CudaError::lower(op, format!("more than {MAX_GROUPS} kept or reduced axis groups")));
        }
        // Sizes padded with 1 and strides with 0 to the struct's fixed arrays.
        let sizes_strides = |g: &Groups| {
            let (mut sizes, mut strides) = ([1; MAX_GROUPS], [0; MAX_GROUPS]);
            for (i, &(size, stride)) in g.iter().enumerate() {
                (sizes[i], strides[i]) = (size, stride);
            }
            (sizes, strides)
        };
        let ((kept_size, kept_stride), (reduced_size, reduced_stride)) =
            (sizes_strides(&self.kept), sizes_strides(&self.reduced));
        Ok(ReduceShape {
            kept: self.kept.len() as i64,
            kept_size,
            kept_stride,
            reduced: self.reduced.len() as i64,
            reduced_size,
            reduced_stride,
        })
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
        let args =
            ReduceArgs { x: x.ptr, y: y.ptr, nout: plan.nout(), count: plan.count(), mean, shape: plan.shape(name)? }
                .args();
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
        let args = MaxBackwardArgs {
            x: x.ptr,
            y: y.ptr,
            gy: g.ptr,
            gx: gx.ptr,
            nout: plan.nout(),
            count: plan.count(),
            shape: plan.shape("max_backward")?,
        }
        .args();
        Ok(vec![launch("reduce", format!("max_backward_{layout}_{dt}"), grid, block, args)])
    }
}

/// Tensors per pair of squared-norm launches (the kernels' `kNormTensors`):
/// their table is the kernels' argument, within the 4 KB every GPU takes.
pub const NORM_TENSORS: usize = 96;

/// Grid cap of the partial-sum launch (grid-stride over the runs).
const NORM_MAX_GRID: usize = 1 << 20;

/// One squared-norm launch pair's table (`sg_red::NormTable`): each
/// tensor's elements and address, the running count of its runs of
/// [`SQUARED_NORM_CHUNK`] elements, and where its runs and norms go.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct NormTable {
    pub n: Vec<i64>,
    pub ptr: Vec<u64>,
    pub chunk_end: Vec<i64>,
    pub partial_base: i64,
    pub norm_base: i64,
}

impl NormTable {
    fn new(tensors: &[DevTensor], partial_base: usize, norm_base: usize) -> Self {
        let mut end = 0;
        let chunk_end = tensors
            .iter()
            .map(|t| {
                end += t.ty.numel().div_ceil(SQUARED_NORM_CHUNK) as i64;
                end
            })
            .collect();
        NormTable {
            n: tensors.iter().map(|t| t.ty.numel() as i64).collect(),
            ptr: tensors.iter().map(|t| t.ptr).collect(),
            chunk_end,
            partial_base: partial_base as i64,
            norm_base: norm_base as i64,
        }
    }

    /// Runs of all the table's tensors.
    fn runs(&self) -> usize {
        self.chunk_end.last().copied().unwrap_or(0) as usize
    }

    /// The kernels' argument: each array padded to [`NORM_TENSORS`].
    fn arg(&self) -> Arg {
        let padded = |v: &[i64]| {
            let mut v = v.to_vec();
            v.resize(NORM_TENSORS, 0);
            v
        };
        let ptrs: Vec<i64> = self.ptr.iter().map(|&p| p as i64).collect();
        StructArg::default()
            .i64s(&padded(&self.n))
            .i64s(&padded(&ptrs))
            .i64s(&padded(&self.chunk_end))
            .i64(self.partial_base)
            .i64(self.norm_base)
            .i64(self.n.len() as i64)
            .build()
    }
}

/// The tables of `inputs`, [`NORM_TENSORS`] at a time, in order.
pub(crate) fn norm_tables(inputs: &[DevTensor]) -> Vec<NormTable> {
    let (mut partial_base, mut norm_base) = (0, 0);
    inputs
        .chunks(NORM_TENSORS)
        .map(|group| {
            let t = NormTable::new(group, partial_base, norm_base);
            partial_base += t.runs();
            norm_base += group.len();
            t
        })
        .collect()
}

impl Lower for SquaredNorms {
    const KERNELS: &'static [KernelModule] = REDUCE;

    /// Per table of up to [`NORM_TENSORS`] inputs: the runs' partial sums
    /// (skipped when every tensor is empty), then each tensor's sum of them.
    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let dt = float_name("squared_norms", cx.inputs[0].ty.dtype)?;
        let (norms, partials) = (&cx.outputs[0], &cx.outputs[1]);
        let threads = (256, 1, 1);
        let mut out = Vec::new();
        for table in norm_tables(cx.inputs) {
            let arg = table.arg();
            if table.runs() > 0 {
                let grid = (table.runs().min(NORM_MAX_GRID) as u32, 1, 1);
                let args = vec![arg.clone(), Arg::Ptr(partials.ptr)];
                out.push(launch("reduce", format!("squared_norms_partial_{dt}"), grid, threads, args));
            }
            let grid = (table.n.len() as u32, 1, 1);
            let args = vec![arg, Arg::Ptr(partials.ptr), Arg::Ptr(norms.ptr)];
            out.push(launch("reduce", format!("squared_norms_finish_{dt}"), grid, threads, args));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::DType;
    use stepgraph_core::ops::Op;

    use super::super::testing::{lower_types, t};
    use super::*;

    /// The squared-norm kernels replayed on the host from the tables the
    /// lowering builds: every element of every tensor lands in exactly one
    /// run, each run in exactly one partial slot, each tensor's runs summed
    /// into its own norm; tables of 96 tensors at most, their bases running
    /// on; an all-empty table launches its finish only.
    #[test]
    fn squared_norm_tables_cover_every_element_once() {
        let mut shapes: Vec<Vec<usize>> =
            vec![vec![], vec![0], vec![3, 5], vec![SQUARED_NORM_CHUNK], vec![2, SQUARED_NORM_CHUNK + 3]];
        shapes.extend((0..200).map(|i| vec![(i * 977) % 40_000]));
        let types: Vec<_> = shapes.iter().map(|s| t(DType::BF16, s)).collect();
        let (ins, outs, launches) = super::super::testing::lowered(&Op::from(SquaredNorms), &types);
        let tables = norm_tables(&ins);
        assert_eq!(tables.len(), shapes.len().div_ceil(NORM_TENSORS));
        let expect: usize = tables.iter().map(|t| if t.runs() > 0 { 2 } else { 1 }).sum();
        assert_eq!(launches.len(), expect);
        let ks = super::super::testing::kernels(&launches);
        assert!(ks[0].function == "squared_norms_partial_bf16" && ks[1].function == "squared_norms_finish_bf16");
        assert_eq!(ks[0].args[0], tables[0].arg(), "the launch carries the table");
        // Each element's value is its tensor index + 1 times a unit per
        // element, so a norm is (k + 1)·n and any double count shows.
        let runs = outs[1].ty.numel();
        let mut partials = vec![0.0f64; runs];
        let mut written = vec![0u32; runs];
        let mut norms = vec![f64::NAN; ins.len()];
        for table in &tables {
            let count = table.n.len();
            assert!((1..=NORM_TENSORS).contains(&count));
            for run in 0..table.runs() as i64 {
                // The kernel's binary search.
                let (mut lo, mut hi) = (0, count - 1);
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if table.chunk_end[mid] > run {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                let k = table.norm_base as usize + lo;
                assert_eq!(table.ptr[lo], ins[k].ptr);
                let start = (run - if lo > 0 { table.chunk_end[lo - 1] } else { 0 }) * SQUARED_NORM_CHUNK as i64;
                let end = table.n[lo].min(start + SQUARED_NORM_CHUNK as i64);
                assert!(start < end, "run {run} of tensor {k} is empty");
                let slot = (table.partial_base + run) as usize;
                partials[slot] += (end - start) as f64 * (k + 1) as f64;
                written[slot] += 1;
            }
            for k in 0..count {
                let first = table.partial_base + if k > 0 { table.chunk_end[k - 1] } else { 0 };
                let last = table.partial_base + table.chunk_end[k];
                norms[table.norm_base as usize + k] =
                    (first..last).map(|j| std::mem::take(&mut partials[j as usize])).sum();
            }
        }
        assert!(written.iter().all(|&w| w == 1), "every partial slot written once");
        assert!(partials.iter().all(|&p| p == 0.0), "the finish leaves the workspace zero");
        for (k, x) in ins.iter().enumerate() {
            assert_eq!(norms[k], (x.ty.numel() * (k + 1)) as f64, "tensor {k} of {:?}", x.ty.shape);
        }
        // Only empty tensors: no runs, the finish alone writes zeros.
        let empty = lower_types(&Op::from(SquaredNorms), &[t(DType::F32, &[0]), t(DType::F32, &[4, 0])], 0).unwrap();
        assert_eq!(empty.len(), 1);
    }

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
