//! Lowering of the basic ops: fills, pointwise maps, casts, reductions,
//! shape movement, embedding and the AdamW update, to launches of the kernels
//! in `kernels/{elementwise,reduce,movement,embedding,adamw}.cu`.
//!
//! Only data is built here (no CUDA calls): the kernel names, grids and
//! arguments for fixed addresses. Index math that depends on shapes alone
//! is done once here instead of per element: size-1 axes are dropped and
//! adjacent axes that stay contiguous are merged, so most kernels see rank 1
//! or 2; movement ops copy the widest unit (up to 16 bytes) that divides
//! every contiguous run and both addresses.
//!
//! Each node's types are checked against the op's shape rule first, so a
//! kernel is never launched on operands it was not written for. What the CPU
//! kernels check at run time from values cannot be checked here: embedding
//! ids in range and AdamW's `lr >= 0` and `step >= 1` are validated by the
//! session on the host before the step; the kernels stay memory-safe
//! regardless (an out-of-range id gathers a zero row and scatters nowhere;
//! invalid AdamW scalars leave the state unchanged). See the `.cu` files for
//! each kernel's signature.

use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::elementwise::{Binary, Cast, Full, Unary, UnaryBackward};
use stepgraph_core::ops::embedding::EmbeddingBackward;
use stepgraph_core::ops::movement::{Broadcast, Concat, Permute, Slice, SliceBackward};
use stepgraph_core::ops::optim::AdamW;
use stepgraph_core::ops::reduce::{MaxBackward, Reduce, ReduceKind};
use stepgraph_core::ops::{Op, UnaryFn};

use crate::error::{CudaError, Result};
use crate::launch::{blocks, Arg, DevTensor, KernelLaunch, Launch, StructArg};

/// The largest rank a kernel's shape struct holds (after merging axes).
pub const MAX_RANK: usize = 8;
/// Kept (and reduced) axis groups a reduction's shape struct holds: they
/// alternate after merging, so a rank-8 input has at most 4 of each.
const MAX_GROUPS: usize = 4;
/// Threads per block of the elementwise and movement kernels (their
/// `__launch_bounds__`).
const THREADS: u32 = 256;
/// Grid cap for grid-stride kernels: enough blocks to fill any current GPU
/// many times over, few enough that per-block setup stays negligible.
const MAX_GRID: usize = 1 << 16;
/// Grid cap for AdamW, whose blocks each compute the step's coefficients once.
const ADAMW_MAX_GRID: usize = 4096;
/// Columns each embedding-backward thread accumulates (`kCols` in embedding.cu).
const EMB_COLS_PER_THREAD: usize = 8;

/// A grid or block size.
type Dim3 = (u32, u32, u32);

/// The launches of one basic-op node over fixed addresses.
pub fn lower(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<Vec<Launch>> {
    if !handles(op) {
        return Err(crate::lower::not_routed(op));
    }
    check_types(op, inputs, outputs)?;
    // The copy units and the kernels' typed loads rely on aligned operands.
    if let Some(t) = inputs.iter().chain(outputs).find(|t| t.ptr % t.ty.dtype.size() as u64 != 0) {
        return Err(CudaError::lower(
            op.name(),
            format!("address {:#x} of a {} tensor is not element-aligned", t.ptr, t.ty),
        ));
    }
    // Nothing to compute for empty outputs (and every grid below is then non-empty).
    if outputs.iter().all(|o| o.ty.numel() == 0) {
        return Ok(vec![]);
    }
    match op {
        Op::Full(f) => Ok(vec![full(f, &outputs[0])?]),
        Op::Unary(u) => unary(u, &inputs[0], &outputs[0]),
        Op::UnaryBackward(u) => unary_backward(u, inputs, &outputs[0]),
        Op::Binary(b) => binary(b, inputs, &outputs[0]),
        Op::Cast(c) => cast(c, &inputs[0], &outputs[0]),
        Op::Reduce(r) => reduce(r, &inputs[0], &outputs[0]),
        Op::MaxBackward(m) => max_backward(m, inputs, &outputs[0]),
        Op::Broadcast(b) => broadcast(b, &inputs[0], &outputs[0]),
        Op::Permute(p) => permute(p, &inputs[0], &outputs[0]),
        Op::Slice(s) => slice(s, &inputs[0], &outputs[0]),
        Op::SliceBackward(s) => slice_backward(s, &inputs[0], &outputs[0]),
        Op::Concat(c) => concat(c, inputs, &outputs[0]),
        Op::Embedding(_) => embedding(inputs, &outputs[0]),
        Op::EmbeddingBackward(e) => embedding_backward(e, inputs, &outputs[0]),
        Op::AdamW(a) => adamw(a, inputs, outputs),
        _ => Err(crate::lower::not_routed(op)),
    }
}

fn handles(op: &Op) -> bool {
    matches!(
        op,
        Op::Full(_)
            | Op::Unary(_)
            | Op::UnaryBackward(_)
            | Op::Binary(_)
            | Op::Cast(_)
            | Op::Reduce(_)
            | Op::MaxBackward(_)
            | Op::Broadcast(_)
            | Op::Permute(_)
            | Op::Slice(_)
            | Op::SliceBackward(_)
            | Op::Concat(_)
            | Op::Embedding(_)
            | Op::EmbeddingBackward(_)
            | Op::AdamW(_)
    )
}

/// The operands must be exactly what the op's shape rule gives.
fn check_types(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<()> {
    let in_types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let want = op.infer(&in_types).map_err(|e| CudaError::lower(op.name(), e))?;
    let got: Vec<&TensorType> = outputs.iter().map(|t| &t.ty).collect();
    if want.iter().collect::<Vec<_>>() != got {
        let show = |v: &[&TensorType]| v.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ");
        return Err(CudaError::lower(
            op.name(),
            format!("outputs are [{}], the shape rule gives [{}]", show(&got), show(&want.iter().collect::<Vec<_>>())),
        ));
    }
    Ok(())
}

/// The kernel-name suffix of a float dtype.
fn float_name(op: &str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 | DType::BF16 | DType::F16 | DType::F64 => Ok(dt.name()),
        d => Err(CudaError::lower(op, format!("no kernel for {d} tensors"))),
    }
}

fn launch(module: &'static str, function: String, grid: Dim3, block: Dim3, args: Vec<Arg>) -> Launch {
    Launch::Kernel(KernelLaunch { module, function, grid, block, shared_bytes: 0, args })
}

/// A 1-D grid-stride launch of `THREADS`-thread blocks over `n` items.
fn launch_1d(module: &'static str, function: String, n: usize, args: Vec<Arg>) -> Launch {
    launch(module, function, (grid_1d(n), 1, 1), (THREADS, 1, 1), args)
}

fn grid_1d(n: usize) -> u32 {
    blocks(n, THREADS as usize).min(MAX_GRID as u32)
}

fn n64(n: usize) -> Arg {
    Arg::I64(n as i64)
}

// ---------------------------------------------------------------- pointwise

fn full(f: &Full, y: &DevTensor) -> Result<Launch> {
    // +0.0 is all-zero bytes in every float type: a memset, which a graph
    // runs as a memset node without a kernel.
    if f.value == 0.0 && f.value.is_sign_positive() {
        return Ok(Launch::Memset { ptr: y.ptr, bytes: y.ty.bytes(), value: 0 });
    }
    let dt = float_name("full", y.ty.dtype)?;
    let n = y.ty.numel();
    Ok(launch_1d("elementwise", format!("full_{dt}"), n, vec![Arg::Ptr(y.ptr), n64(n), Arg::F64(f.value)]))
}

/// pow's exponent; the other functions ignore the argument.
fn exponent(f: UnaryFn) -> f64 {
    match f {
        UnaryFn::Pow(p) => p,
        _ => 0.0,
    }
}

fn unary(u: &Unary, x: &DevTensor, y: &DevTensor) -> Result<Vec<Launch>> {
    let dt = float_name(u.f.name(), y.ty.dtype)?;
    let n = y.ty.numel();
    let args = vec![Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), n64(n), Arg::F64(exponent(u.f))];
    Ok(vec![launch_1d("elementwise", format!("{}_{dt}", u.f.name()), n, args)])
}

fn unary_backward(u: &UnaryBackward, inputs: &[DevTensor], y: &DevTensor) -> Result<Vec<Launch>> {
    let dt = float_name(u.f.backward_name(), y.ty.dtype)?;
    let n = y.ty.numel();
    let (x, g) = (&inputs[0], &inputs[1]);
    let args = vec![Arg::Ptr(x.ptr), Arg::Ptr(g.ptr), Arg::Ptr(y.ptr), n64(n), Arg::F64(exponent(u.f))];
    Ok(vec![launch_1d("elementwise", format!("{}_{dt}", u.f.backward_name()), n, args)])
}

fn binary(b: &Binary, inputs: &[DevTensor], y: &DevTensor) -> Result<Vec<Launch>> {
    let name = b.f.name();
    let dt = float_name(name, y.ty.dtype)?;
    let out = &y.ty.shape;
    let sa = broadcast_strides(&inputs[0].ty.shape, out);
    let sb = broadcast_strides(&inputs[1].ty.shape, out);
    let (sizes, strides) = merge_axes(out, &[sa, sb]);
    if sizes.len() > MAX_RANK {
        return Err(CudaError::lower(name, format!("{} axes after merging; the kernel holds {MAX_RANK}", sizes.len())));
    }
    let shape = StructArg::default()
        .i64(sizes.len() as i64)
        .i64s(&pad(&sizes, 1))
        .i64s(&pad(&strides[0], 0))
        .i64s(&pad(&strides[1], 0))
        .build();
    let n = y.ty.numel();
    let args = vec![Arg::Ptr(inputs[0].ptr), Arg::Ptr(inputs[1].ptr), Arg::Ptr(y.ptr), n64(n), shape];
    Ok(vec![launch_1d("elementwise", format!("{name}_{dt}"), n, args)])
}

fn cast(c: &Cast, x: &DevTensor, y: &DevTensor) -> Result<Vec<Launch>> {
    let (src, dst) = (float_name("cast", x.ty.dtype)?, float_name("cast", c.dtype)?);
    let n = y.ty.numel();
    Ok(vec![launch_1d("elementwise", format!("cast_{src}_{dst}"), n, vec![Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), n64(n)])])
}

// ---------------------------------------------------------------- axes

/// Row-major element strides of `shape`.
fn contiguous_strides(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as i64;
    }
    s
}

/// Strides of `input` seen through numpy broadcasting to `output`: one per
/// output axis, 0 where the input is broadcast (missing or of size 1).
fn broadcast_strides(input: &[usize], output: &[usize]) -> Vec<i64> {
    let lead = output.len() - input.len();
    let own = contiguous_strides(input);
    (0..output.len()).map(|i| if i < lead || input[i - lead] == 1 { 0 } else { own[i - lead] }).collect()
}

/// Drops size-1 axes and merges adjacent axes that are contiguous in every
/// operand (`outer stride = inner stride * inner size`), preserving the
/// row-major order of the walk. Returns at least one axis: a walk of one
/// element is `[1]` with strides 0.
fn merge_axes(sizes: &[usize], strides: &[Vec<i64>]) -> (Vec<i64>, Vec<Vec<i64>>) {
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
fn pad(v: &[i64], fill: i64) -> Vec<i64> {
    let mut p = v.to_vec();
    p.resize(MAX_RANK, fill);
    p
}

// ---------------------------------------------------------------- reductions

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

fn reduce(r: &Reduce, x: &DevTensor, y: &DevTensor) -> Result<Vec<Launch>> {
    // A mean is the sum kernel dividing by the count at the end (its `mean` flag).
    let (kernel, mean) = match r.kind {
        ReduceKind::Sum => ("sum", 0),
        ReduceKind::Mean => ("sum", 1),
        ReduceKind::Max => ("max", 0),
    };
    let name = Op::from(r.clone()).name();
    let dt = float_name(name, x.ty.dtype)?;
    let plan = ReducePlan::new(&x.ty.shape, &r.axes);
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

fn max_backward(m: &MaxBackward, inputs: &[DevTensor], gx: &DevTensor) -> Result<Vec<Launch>> {
    let dt = float_name("max_backward", gx.ty.dtype)?;
    let (x, y, g) = (&inputs[0], &inputs[1], &inputs[2]);
    let plan = ReducePlan::new(&x.ty.shape, &m.axes);
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

// ---------------------------------------------------------------- movement

/// Copy units of movement.cu and embedding.cu, widest first: (bytes, name).
const UNITS: [(u64, &str); 5] = [(16, "u128"), (8, "u64"), (4, "u32"), (2, "u16"), (1, "u8")];

/// The widest copy unit dividing every byte quantity in `bytes` (run
/// lengths, offsets, addresses); an offset of 0 allows any unit.
fn unit_for(bytes: &[u64]) -> (u64, &'static str) {
    *UNITS.iter().find(|(w, _)| bytes.iter().all(|b| b % w == 0)).expect("1 divides everything")
}

/// A strided gather (`broadcast` or `permute`): output axes `sizes`, input
/// element strides `strides` per output axis.
fn gather(
    kernel: &'static str,
    x: &DevTensor,
    y: &DevTensor,
    sizes: &[usize],
    strides: Vec<i64>,
) -> Result<Vec<Launch>> {
    let (mut sizes, mut strides) = {
        let (s, mut st) = merge_axes(sizes, &[strides]);
        (s, st.pop().expect("one operand"))
    };
    if sizes.len() > MAX_RANK {
        return Err(CudaError::lower(
            kernel,
            format!("{} axes after merging; the kernel holds {MAX_RANK}", sizes.len()),
        ));
    }
    let es = y.ty.dtype.size() as i64;
    let last = sizes.len() - 1;
    // The innermost axis is copied in wider units when it is contiguous in the
    // input (the output always is) and every other stride stays a whole number of units.
    let (w, unit) = if strides[last] == 1 {
        let mut q: Vec<u64> = vec![x.ptr, y.ptr, (sizes[last] * es) as u64];
        q.extend(strides[..last].iter().map(|s| (s * es) as u64));
        unit_for(&q)
    } else {
        unit_for(&[x.ptr, y.ptr, es as u64])
    };
    // Addresses are element-aligned (checked in `lower`), so w is a multiple of es.
    let w = w as i64;
    sizes[last] = sizes[last] * es / w;
    for s in &mut strides[..last] {
        *s = *s * es / w;
    }
    let n: i64 = sizes.iter().product();
    let shape = StructArg::default().i64(sizes.len() as i64).i64s(&pad(&sizes, 1)).i64s(&pad(&strides, 0)).build();
    let args = vec![Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), Arg::I64(n), shape];
    Ok(vec![launch_1d("movement", format!("{kernel}_{unit}"), n as usize, args)])
}

fn broadcast(b: &Broadcast, x: &DevTensor, y: &DevTensor) -> Result<Vec<Launch>> {
    gather("broadcast", x, y, &b.shape, broadcast_strides(&x.ty.shape, &b.shape))
}

fn permute(p: &Permute, x: &DevTensor, y: &DevTensor) -> Result<Vec<Launch>> {
    let own = contiguous_strides(&x.ty.shape);
    gather("permute", x, y, &y.ty.shape, p.perm.iter().map(|&a| own[a]).collect())
}

/// (outer count, axis size, inner count) of `shape` around `axis`.
fn split_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

/// A chunked copy (`slice`, `slice_backward`, `concat`) of `n` elements;
/// `chunk` holds the kernel's three chunk arguments in elements. All are
/// passed in the widest unit that divides their byte sizes and both addresses.
fn chunked(kernel: &'static str, x: &DevTensor, y: &DevTensor, es: usize, n: usize, chunk: [usize; 3]) -> Launch {
    let es = es as u64;
    let mut q = vec![x.ptr, y.ptr];
    q.extend(chunk.iter().map(|&c| c as u64 * es));
    let (w, unit) = unit_for(&q);
    let scale = |c: usize| Arg::I64((c as u64 * es / w) as i64);
    let n_units = (n as u64 * es / w) as usize;
    let args = vec![
        Arg::Ptr(x.ptr),
        Arg::Ptr(y.ptr),
        Arg::I64(n_units as i64),
        scale(chunk[0]),
        scale(chunk[1]),
        scale(chunk[2]),
    ];
    launch_1d("movement", format!("{kernel}_{unit}"), n_units, args)
}

fn slice(s: &Slice, x: &DevTensor, y: &DevTensor) -> Result<Vec<Launch>> {
    let (_, full, inner) = split_axis(&x.ty.shape, s.axis);
    let len = s.end - s.start;
    // y[i] = x[(i / cy) * cx + off + i % cy]
    let chunk = [len * inner, full * inner, s.start * inner];
    Ok(vec![chunked("slice", x, y, y.ty.dtype.size(), y.ty.numel(), chunk)])
}

fn slice_backward(s: &SliceBackward, g: &DevTensor, y: &DevTensor) -> Result<Vec<Launch>> {
    let (_, len, inner) = split_axis(&g.ty.shape, s.axis);
    // y[i] = x[(i / cy) * cx + j - lo] for lo <= j = i % cy < lo + cx, else 0
    let chunk = [s.size * inner, len * inner, s.start * inner];
    Ok(vec![chunked("slice_backward", g, y, y.ty.dtype.size(), y.ty.numel(), chunk)])
}

fn concat(c: &Concat, inputs: &[DevTensor], y: &DevTensor) -> Result<Vec<Launch>> {
    let (_, full, inner) = split_axis(&y.ty.shape, c.axis);
    let mut start = 0;
    let mut launches = Vec::new();
    for x in inputs {
        let len = x.ty.shape[c.axis];
        if x.ty.numel() > 0 {
            // y[(i / cx) * cy + off + i % cx] = x[i]
            let chunk = [len * inner, full * inner, start * inner];
            launches.push(chunked("concat", x, y, y.ty.dtype.size(), x.ty.numel(), chunk));
        }
        start += len;
    }
    Ok(launches)
}

// ---------------------------------------------------------------- embedding

fn id_name(op: &str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::I32 | DType::I64 => Ok(dt.name()),
        d => Err(CudaError::lower(op, format!("ids must be i32 or i64, got {d}"))),
    }
}

fn embedding(inputs: &[DevTensor], y: &DevTensor) -> Result<Vec<Launch>> {
    let (ids, table) = (&inputs[0], &inputs[1]);
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
    let args = vec![Arg::Ptr(ids.ptr), Arg::Ptr(table.ptr), Arg::Ptr(y.ptr), n64(n_ids), n64(rows), n64(wu)];
    Ok(vec![launch("embedding", format!("embedding_{unit}_{id}"), (grid, 1, 1), (tx, ty, 1), args)])
}

fn embedding_backward(e: &EmbeddingBackward, inputs: &[DevTensor], gt: &DevTensor) -> Result<Vec<Launch>> {
    let (ids, gy) = (&inputs[0], &inputs[1]);
    let id = id_name("embedding_backward", ids.ty.dtype)?;
    let dt = float_name("embedding_backward", gt.ty.dtype)?;
    let width = gt.ty.shape[1];
    // Enough threads that one pass covers the width when it can (at most
    // 512, the kernel's bound), at least 128 so the id scan is wide.
    let threads = (width.div_ceil(EMB_COLS_PER_THREAD).div_ceil(32) * 32).clamp(128, 512) as u32;
    let grid = e.num_rows.clamp(1, MAX_GRID) as u32;
    let args =
        vec![Arg::Ptr(ids.ptr), Arg::Ptr(gy.ptr), Arg::Ptr(gt.ptr), n64(ids.ty.numel()), n64(e.num_rows), n64(width)];
    Ok(vec![launch("embedding", format!("embedding_backward_{dt}_{id}"), (grid, 1, 1), (threads, 1, 1), args)])
}

// ---------------------------------------------------------------- optimizer

fn adamw(a: &AdamW, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (p, g, m, v, lr, step) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3], &inputs[4], &inputs[5]);
    let name = |t: &DevTensor| float_name("adamw", t.ty.dtype);
    let function = format!("adamw_{}_{}_{}", name(p)?, name(m)?, name(v)?);
    let is_f64 = |t: &DevTensor| Arg::I64((t.ty.dtype == DType::F64) as i64);
    let n = p.ty.numel();
    let args = vec![
        Arg::Ptr(p.ptr),
        Arg::Ptr(g.ptr),
        Arg::Ptr(m.ptr),
        Arg::Ptr(v.ptr),
        Arg::Ptr(lr.ptr),
        Arg::Ptr(step.ptr),
        Arg::Ptr(outputs[0].ptr),
        Arg::Ptr(outputs[1].ptr),
        Arg::Ptr(outputs[2].ptr),
        n64(n),
        is_f64(lr),
        is_f64(step),
        Arg::F64(a.beta1),
        Arg::F64(a.beta2),
        Arg::F64(a.eps),
        Arg::F64(a.weight_decay),
    ];
    let grid = blocks(n, THREADS as usize).min(ADAMW_MAX_GRID as u32);
    Ok(vec![launch("adamw", function, (grid, 1, 1), (THREADS, 1, 1), args)])
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use stepgraph_core::host::HostTensor;
    use stepgraph_core::ops::elementwise::{Binary, Cast, Full, Unary, UnaryBackward};
    use stepgraph_core::ops::embedding::Embedding;
    use stepgraph_core::ops::{BinaryFn, Op, UnaryFn};
    use stepgraph_core::testing::{draw_inputs, run_op, Arg as Draw};

    use super::*;

    /// Operands at distinct 256-byte-aligned fake addresses (as the planner
    /// gives), shifted by `skew` bytes.
    fn operands(types: &[TensorType], base: u64, skew: u64) -> Vec<DevTensor> {
        types
            .iter()
            .enumerate()
            .map(|(i, t)| DevTensor { ty: t.clone(), ptr: base + (i as u64) * (1 << 24) + skew })
            .collect()
    }

    /// Lowers `op` on inputs of `types`, outputs from the shape rule.
    fn lower_types(op: &Op, types: &[TensorType], skew: u64) -> Result<Vec<Launch>> {
        let refs: Vec<&TensorType> = types.iter().collect();
        let outs = op.infer(&refs).map_err(|e| CudaError::lower(op.name(), e))?;
        lower(op, &operands(types, 1 << 40, skew), &operands(&outs, 1 << 41, skew))
    }

    fn kernels(launches: &[Launch]) -> Vec<&KernelLaunch> {
        launches
            .iter()
            .map(|l| match l {
                Launch::Kernel(k) => k,
                other => panic!("expected a kernel launch, got {other:?}"),
            })
            .collect()
    }

    fn function(op: impl Into<Op>, types: &[TensorType]) -> String {
        let launches = lower_types(&op.into(), types, 0).unwrap();
        kernels(&launches)[0].function.clone()
    }

    fn t(dt: DType, shape: &[usize]) -> TensorType {
        TensorType::new(dt, shape.to_vec())
    }

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
    fn movement_copies_the_widest_unit() {
        // bf16 rows of 32 elements at 16-byte-aligned offsets: 16-byte units.
        assert_eq!(function(Slice { axis: 1, start: 16, end: 48 }, &[t(DType::BF16, &[4, 64])]), "slice_u128");
        // An odd run: element units.
        assert_eq!(function(Slice { axis: 1, start: 5, end: 12 }, &[t(DType::BF16, &[3, 17])]), "slice_u16");
        assert_eq!(function(Permute { perm: vec![0, 2, 1, 3] }, &[t(DType::F32, &[2, 16, 4, 64])]), "permute_u128");
        assert_eq!(function(Permute { perm: vec![1, 0] }, &[t(DType::F64, &[3, 5])]), "permute_u64");
        assert_eq!(function(Broadcast { shape: vec![4, 17] }, &[t(DType::F16, &[17])]), "broadcast_u16");
        assert_eq!(function(Broadcast { shape: vec![3, 64] }, &[t(DType::Bool, &[64])]), "broadcast_u128");
        assert_eq!(function(Broadcast { shape: vec![3, 64] }, &[t(DType::Bool, &[3, 1])]), "broadcast_u8");
        assert_eq!(function(Embedding, &[t(DType::I64, &[5]), t(DType::BF16, &[9, 24])]), "embedding_u128_i64");
        assert_eq!(function(Embedding, &[t(DType::I32, &[5]), t(DType::F32, &[9, 3])]), "embedding_u32_i32");
        // Addresses off a 16-byte boundary narrow the unit.
        let l = lower_types(&Slice { axis: 1, start: 16, end: 48 }.into(), &[t(DType::BF16, &[4, 64])], 4).unwrap();
        assert_eq!(kernels(&l)[0].function, "slice_u32");
    }

    #[test]
    fn names_follow_the_op_and_dtype() {
        assert_eq!(function(Unary { f: UnaryFn::GeluTanh }, &[t(DType::BF16, &[3])]), "gelu_tanh_bf16");
        let x = t(DType::F16, &[3]);
        assert_eq!(function(UnaryBackward { f: UnaryFn::Pow(2.0) }, &[x.clone(), x]), "pow_backward_f16");
        assert_eq!(function(Binary { f: BinaryFn::Div }, &[t(DType::F64, &[2, 3]), t(DType::F64, &[3])]), "div_f64");
        assert_eq!(function(Cast { dtype: DType::BF16 }, &[t(DType::F64, &[2])]), "cast_f64_bf16");
        let adamw = [
            t(DType::BF16, &[4]),
            t(DType::BF16, &[4]),
            t(DType::F32, &[4]),
            t(DType::BF16, &[4]),
            t(DType::F32, &[]),
            t(DType::F64, &[]),
        ];
        assert_eq!(function(AdamW::default(), &adamw), "adamw_bf16_f32_bf16");
    }

    #[test]
    fn zero_fills_are_memsets_and_empty_outputs_launch_nothing() {
        let op = Op::from(Full { value: 0.0, ty: t(DType::BF16, &[3, 5]) });
        assert!(matches!(lower_types(&op, &[], 0).unwrap()[..], [Launch::Memset { bytes: 30, value: 0, .. }]));
        let op = Op::from(Full { value: -0.0, ty: t(DType::F32, &[3]) });
        assert_eq!(kernels(&lower_types(&op, &[], 0).unwrap())[0].function, "full_f32");
        let op = Op::from(Slice { axis: 0, start: 2, end: 2 });
        assert!(lower_types(&op, &[t(DType::F32, &[4])], 0).unwrap().is_empty());
        // An empty part of a concat is skipped, the others copied.
        let op = Op::from(Concat { axis: 0 });
        assert_eq!(lower_types(&op, &[t(DType::F32, &[0]), t(DType::F32, &[3])], 0).unwrap().len(), 1);
        // A reduction over an empty axis still writes its (identity) outputs.
        let op = Op::from(Reduce { kind: ReduceKind::Sum, axes: vec![0], keepdim: false });
        assert_eq!(lower_types(&op, &[t(DType::F32, &[0, 3])], 0).unwrap().len(), 1);
    }

    #[test]
    fn operands_that_contradict_the_shape_rule_are_refused() {
        let op = Op::from(Unary { f: UnaryFn::Exp });
        let x = operands(&[t(DType::F32, &[3])], 1 << 40, 0);
        let wrong = operands(&[t(DType::F32, &[4])], 1 << 41, 0);
        assert!(matches!(lower(&op, &x, &wrong), Err(CudaError::Lower { .. })));
        let misaligned = operands(&[t(DType::F32, &[3])], 1 << 41, 2);
        assert!(matches!(lower(&op, &x, &misaligned), Err(CudaError::Lower { .. })));
        let mm = Op::from(stepgraph_core::ops::matmul::MatMul { trans_a: false, trans_b: false });
        assert!(lower(&mm, &[], &[]).is_err());
    }

    /// Host memory standing in for the device: one buffer per operand at its
    /// fake address.
    struct Mem(Vec<(u64, Vec<u8>)>);

    impl Mem {
        fn at(&mut self, addr: u64, len: usize) -> &mut [u8] {
            let (base, buf) =
                self.0.iter_mut().find(|(b, v)| *b <= addr && addr < *b + v.len() as u64).expect("mapped");
            let o = (addr - *base) as usize;
            &mut buf[o..o + len]
        }
        fn copy(&mut self, dst: u64, src: u64, len: usize) {
            let v = self.at(src, len).to_vec();
            self.at(dst, len).copy_from_slice(&v);
        }
        fn f64(&mut self, addr: u64) -> f64 {
            f64::from_le_bytes(self.at(addr, 8).try_into().unwrap())
        }
        fn set_f64(&mut self, addr: u64, v: f64) {
            self.at(addr, 8).copy_from_slice(&v.to_le_bytes());
        }
        fn id(&mut self, addr: u64, i32s: bool) -> i64 {
            if i32s {
                i32::from_le_bytes(self.at(addr, 4).try_into().unwrap()) as i64
            } else {
                i64::from_le_bytes(self.at(addr, 8).try_into().unwrap())
            }
        }
    }

    fn ptr(a: &Arg) -> u64 {
        match a {
            Arg::Ptr(p) => *p,
            other => panic!("expected a pointer, got {other:?}"),
        }
    }
    fn int(a: &Arg) -> i64 {
        match a {
            Arg::I64(x) => *x,
            other => panic!("expected an i64, got {other:?}"),
        }
    }
    fn words(a: &Arg) -> Vec<i64> {
        match a {
            Arg::Struct(b) => b.chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().unwrap())).collect(),
            other => panic!("expected a struct, got {other:?}"),
        }
    }

    /// Offset of `idx` in a row-major walk of axes `size` with `stride`.
    fn walk(mut idx: i64, size: &[i64], stride: &[i64]) -> i64 {
        let mut off = 0;
        for d in (0..size.len()).rev() {
            off += idx % size[d] * stride[d];
            idx /= size[d];
        }
        off
    }

    /// Runs a launch the way its kernel (see the `.cu` file) reads its
    /// arguments, sequentially, for the index-only kernels and for f64 data
    /// (whose arithmetic is the CPU's): a model of the device that checks
    /// every shape, stride, chunk and unit the lowering computes.
    fn emulate(l: &Launch, mem: &mut Mem) {
        let k = match l {
            Launch::Memset { ptr, bytes, value } => return mem.at(*ptr, *bytes as usize).fill(*value),
            Launch::Kernel(k) => k,
            other => panic!("unexpected {other:?}"),
        };
        let f = k.function.as_str();
        let a = &k.args;
        let unit = |f: &str| -> usize {
            let w = UNITS.iter().find(|(_, n)| f.ends_with(&format!("_{n}")) || f.contains(&format!("_{n}_"))).unwrap();
            w.0 as usize
        };
        if f.starts_with("broadcast_") || f.starts_with("permute_") {
            let (w, s) = (unit(f), words(&a[3]));
            let rank = s[0] as usize;
            let (size, stride) = (&s[1..1 + rank], &s[1 + MAX_RANK..1 + MAX_RANK + rank]);
            for i in 0..int(&a[2]) {
                mem.copy(ptr(&a[1]) + (i as u64) * w as u64, ptr(&a[0]) + walk(i, size, stride) as u64 * w as u64, w);
            }
        } else if f.starts_with("slice_backward_") {
            let (w, cy, cx, lo) = (unit(f) as u64, int(&a[3]), int(&a[4]), int(&a[5]));
            for i in 0..int(&a[2]) {
                let j = i % cy;
                let dst = ptr(&a[1]) + i as u64 * w;
                if j >= lo && j < lo + cx {
                    mem.copy(dst, ptr(&a[0]) + ((i / cy) * cx + j - lo) as u64 * w, w as usize);
                } else {
                    mem.at(dst, w as usize).fill(0);
                }
            }
        } else if f.starts_with("slice_") {
            let (w, cy, cx, off) = (unit(f) as u64, int(&a[3]), int(&a[4]), int(&a[5]));
            for i in 0..int(&a[2]) {
                mem.copy(ptr(&a[1]) + i as u64 * w, ptr(&a[0]) + ((i / cy) * cx + off + i % cy) as u64 * w, w as usize);
            }
        } else if f.starts_with("concat_") {
            let (w, cx, cy, off) = (unit(f) as u64, int(&a[3]), int(&a[4]), int(&a[5]));
            for i in 0..int(&a[2]) {
                mem.copy(ptr(&a[1]) + ((i / cx) * cy + off + i % cx) as u64 * w, ptr(&a[0]) + i as u64 * w, w as usize);
            }
        } else if f.starts_with("embedding_backward_f64") {
            let i32s = f.ends_with("i32");
            let (ids, gy, gt, n, rows, width) =
                (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
            let isz = if i32s { 4 } else { 8 };
            for row in 0..rows {
                let hits: Vec<i64> = (0..n).filter(|&p| mem.id(ids + (p * isz) as u64, i32s) == row).collect();
                for c in 0..width {
                    let dst = gt + ((row * width + c) * 8) as u64;
                    match hits[..] {
                        [] => mem.set_f64(dst, 0.0),
                        [p] => mem.copy(dst, gy + ((p * width + c) * 8) as u64, 8),
                        _ => {
                            let sum = hits.iter().fold(0.0, |acc, p| acc + mem.f64(gy + ((p * width + c) * 8) as u64));
                            mem.set_f64(dst, sum)
                        }
                    }
                }
            }
        } else if f.starts_with("embedding_") {
            let (w, i32s) = (unit(f) as i64, f.ends_with("i32"));
            let (ids, table, y, n, rows, wu) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
            for p in 0..n {
                let id = mem.id(ids + (p * if i32s { 4 } else { 8 }) as u64, i32s);
                assert!((0..rows).contains(&id));
                mem.copy(y + (p * wu * w) as u64, table + (id * wu * w) as u64, (wu * w) as usize);
            }
        } else if f.starts_with("sum_") || f.starts_with("max_") {
            let mb = f.starts_with("max_backward");
            let (x, nout, count) = (ptr(&a[0]), int(&a[if mb { 4 } else { 2 }]), int(&a[if mb { 5 } else { 3 }]));
            let s = words(&a[if mb { 6 } else { 5 }]);
            let g = MAX_GROUPS;
            let nk = s[0] as usize;
            let (ks, kst) = (&s[1..1 + nk], &s[1 + g..1 + g + nk]);
            let nr = s[1 + 2 * g] as usize;
            let (rs, rst) = (&s[2 + 2 * g..2 + 2 * g + nr], &s[2 + 3 * g..2 + 3 * g + nr]);
            for o in 0..nout {
                let base = walk(o, ks, kst);
                let xs: Vec<(u64, f64)> = (0..count)
                    .map(|r| {
                        let addr = x + ((base + walk(r, rs, rst)) * 8) as u64;
                        (addr, mem.f64(addr))
                    })
                    .collect();
                if mb {
                    let (y, gy, gx) = (ptr(&a[1]), ptr(&a[2]), ptr(&a[3]));
                    let m = mem.f64(y + o as u64 * 8);
                    let ties = xs.iter().filter(|v| v.1 == m).count().max(1);
                    let share = mem.f64(gy + o as u64 * 8) / ties as f64;
                    for (addr, v) in xs {
                        mem.set_f64(gx + (addr - x), if v == m { share } else { 0.0 });
                    }
                } else {
                    let v = if f.starts_with("max_") {
                        xs.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.1))
                    } else {
                        let s = xs.iter().fold(0.0, |acc, v| acc + v.1);
                        if int(&a[4]) == 1 {
                            s / count as f64
                        } else {
                            s
                        }
                    };
                    mem.set_f64(ptr(&a[1]) + o as u64 * 8, v);
                }
            }
        } else if ["add_f64", "sub_f64", "mul_f64", "div_f64"].contains(&f) {
            let s = words(&a[4]);
            let rank = s[0] as usize;
            let size = &s[1..1 + rank];
            let (sa, sb) = (&s[1 + MAX_RANK..1 + MAX_RANK + rank], &s[1 + 2 * MAX_RANK..1 + 2 * MAX_RANK + rank]);
            for i in 0..int(&a[3]) {
                let x = mem.f64(ptr(&a[0]) + walk(i, size, sa) as u64 * 8);
                let y = mem.f64(ptr(&a[1]) + walk(i, size, sb) as u64 * 8);
                let v = match &f[..3] {
                    "add" => x + y,
                    "sub" => x - y,
                    "mul" => x * y,
                    _ => x / y,
                };
                mem.set_f64(ptr(&a[2]) + i as u64 * 8, v);
            }
        } else {
            panic!("no model of `{f}`");
        }
    }

    /// Lowers `op` over `inputs` at fake addresses skewed by `skew` bytes,
    /// runs the launches on the host model and returns the outputs.
    fn run_model(op: &Op, inputs: &[HostTensor], skew: u64) -> Vec<HostTensor> {
        let types: Vec<TensorType> = inputs.iter().map(|t| t.ty.clone()).collect();
        let refs: Vec<&TensorType> = types.iter().collect();
        let out_types = op.infer(&refs).unwrap();
        let (ins, outs) = (operands(&types, 1 << 40, skew), operands(&out_types, 1 << 41, skew));
        let mut mem = Mem(Vec::new());
        for (d, t) in ins.iter().zip(inputs) {
            mem.0.push((d.ptr, t.bytes().to_vec()));
        }
        for d in &outs {
            // Garbage (NaN) where nothing writes, as the session's poisoned arena.
            mem.0.push((d.ptr, vec![0xFF; d.ty.bytes() as usize]));
        }
        for l in lower(op, &ins, &outs).unwrap_or_else(|e| panic!("{op:?}: {e}")) {
            emulate(&l, &mut mem);
        }
        outs.iter()
            .map(|d| {
                let mut t = HostTensor::zeros(d.ty.clone());
                t.bytes_mut().copy_from_slice(mem.at(d.ptr, d.ty.bytes() as usize));
                t
            })
            .collect()
    }

    fn input(shape: &[usize], dt: DType, seed: u64) -> HostTensor {
        match dt {
            DType::I32 | DType::I64 | DType::Bool => {
                let max = if dt == DType::Bool { 2 } else { 1 << 30 };
                draw_inputs(&[Draw::Ids { dtype: DType::I64, shape: shape.to_vec(), max }], DType::F64, seed)
                    .remove(0)
                    .to_f64()
                    .pipe(|v| HostTensor::from_f64(TensorType::new(dt, shape.to_vec()), &v))
            }
            _ => draw_inputs(&[Draw::Normal(shape.to_vec())], dt, seed).remove(0),
        }
    }

    trait Pipe: Sized {
        fn pipe<R>(self, f: impl FnOnce(Self) -> R) -> R {
            f(self)
        }
    }
    impl<T> Pipe for T {}

    /// The lowering's arguments, run through a host model of each kernel,
    /// give the CPU reference's bytes: movement and embedding for every
    /// dtype (bit copies), binary maps and reductions in f64 (whose
    /// arithmetic the model shares with the CPU), at aligned and skewed
    /// addresses (which change the copy units).
    #[test]
    fn lowered_arguments_reproduce_the_cpu_on_a_host_model() {
        let all = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64, DType::Bool];
        let mut cases: Vec<(Op, Vec<HostTensor>)> = Vec::new();
        for (k, dt) in all.into_iter().enumerate() {
            let seed = k as u64;
            let bc: [(&[usize], &[usize]); 6] = [
                (&[], &[5, 7]),
                (&[3, 1], &[2, 3, 4]),
                (&[64], &[3, 64]),
                (&[4, 1, 6], &[4, 5, 6]),
                (&[2, 1, 8, 1], &[2, 3, 8, 5]),
                (&[1, 16], &[9, 16]),
            ];
            for (from, to) in bc {
                cases.push((Broadcast { shape: to.to_vec() }.into(), vec![input(from, dt, seed)]));
            }
            let perms: [(&[usize], &[usize]); 6] = [
                (&[4, 8, 16], &[1, 0, 2]),
                (&[4, 8, 16], &[2, 1, 0]),
                (&[2, 16, 4, 64], &[0, 2, 1, 3]),
                (&[3, 1, 7, 2], &[3, 2, 1, 0]),
                (&[2, 3, 2, 3, 2], &[4, 0, 3, 1, 2]),
                (&[2, 3, 2, 2, 3, 2, 2, 3], &[7, 6, 5, 4, 3, 2, 1, 0]),
            ];
            for (shape, perm) in perms {
                cases.push((Permute { perm: perm.to_vec() }.into(), vec![input(shape, dt, seed)]));
            }
            let slices: [(&[usize], usize, usize, usize); 6] = [
                (&[17], 0, 3, 11),
                (&[3, 17], 1, 5, 12),
                (&[4, 64], 1, 16, 48),
                (&[4, 64], 0, 1, 3),
                (&[2, 3, 5, 8], 3, 0, 4),
                (&[5, 3, 24], 1, 2, 3),
            ];
            for (shape, axis, start, end) in slices {
                cases.push((Slice { axis, start, end }.into(), vec![input(shape, dt, seed)]));
                let mut gs = shape.to_vec();
                gs[axis] = end - start;
                cases.push((SliceBackward { axis, start, size: shape[axis] }.into(), vec![input(&gs, dt, seed)]));
            }
            let parts: [(&[&[usize]], usize); 3] = [
                (&[&[3], &[17], &[1]], 0),
                (&[&[4, 8], &[4, 24], &[4, 8]], 1),
                (&[&[2, 1, 6], &[2, 3, 6], &[2, 0, 6], &[2, 5, 6]], 1),
            ];
            for (shapes, axis) in parts {
                cases.push((Concat { axis }.into(), shapes.iter().map(|s| input(s, dt, seed)).collect()));
            }
            if dt.is_float() {
                for (ids_dt, n, rows, width) in
                    [(DType::I32, 7, 5, 3), (DType::I64, 37, 50, 24), (DType::I32, 30, 11, 64)]
                {
                    let ids = draw_inputs(&[Draw::Ids { dtype: ids_dt, shape: vec![n], max: rows as i64 }], dt, seed)
                        .remove(0);
                    cases.push((Embedding.into(), vec![ids.clone(), input(&[rows, width], dt, seed)]));
                    if dt == DType::F64 {
                        let op = stepgraph_core::ops::embedding::EmbeddingBackward { num_rows: rows };
                        cases.push((op.into(), vec![ids, input(&[n, width], dt, seed)]));
                    }
                }
            }
        }
        let f64s = |s: &[usize], seed| input(s, DType::F64, seed);
        let pairs: [(&[usize], &[usize]); 6] = [
            (&[4, 5], &[5]),
            (&[5], &[4, 5]),
            (&[4, 1], &[1, 5]),
            (&[2, 3, 17], &[]),
            (&[7, 1, 9], &[1, 8, 1]),
            (&[2, 1, 3, 4], &[1, 5, 1, 4]),
        ];
        for (sa, sb) in pairs {
            for f in [BinaryFn::Add, BinaryFn::Sub, BinaryFn::Mul, BinaryFn::Div] {
                cases.push((Binary { f }.into(), vec![f64s(sa, 1), f64s(sb, 2)]));
            }
        }
        let reductions: [(&[usize], &[usize]); 12] = [
            (&[17], &[0]),
            (&[33, 17], &[1]),
            (&[5, 1000], &[1]),
            (&[1000, 7], &[0]),
            (&[3, 5, 7], &[1]),
            (&[3, 5, 7], &[0, 2]),
            (&[2, 3, 4, 5], &[1, 3]),
            (&[4, 6, 8, 10], &[0, 2]),
            (&[3, 1, 5], &[1]),
            (&[3, 4], &[]),
            (&[], &[]),
            (&[0, 3], &[0]),
        ];
        for (shape, axes) in reductions {
            let x = f64s(shape, 3);
            for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
                cases.push((Reduce { kind, axes: axes.to_vec(), keepdim: false }.into(), vec![x.clone()]));
            }
            if !shape.contains(&0) {
                let max = Op::from(Reduce { kind: ReduceKind::Max, axes: axes.to_vec(), keepdim: true });
                // Coarse values: ties.
                let xt = HostTensor::from_f64(x.ty.clone(), &x.to_f64().iter().map(|v| v.round()).collect::<Vec<_>>());
                let y = run_op(&max, std::slice::from_ref(&xt)).unwrap().remove(0);
                let g = f64s(&y.ty.shape, 4);
                cases.push((MaxBackward { axes: axes.to_vec() }.into(), vec![xt, y, g]));
            }
        }
        for (op, inputs) in &cases {
            let want = run_op(op, inputs).unwrap();
            for skew in [0, 8] {
                let got = run_model(op, inputs, skew);
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    let same = g.ty == w.ty
                        && (g.bytes() == w.bytes()
                            || (w.ty.dtype == DType::F64
                                && g.to_f64()
                                    .iter()
                                    .zip(w.to_f64())
                                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))));
                    assert!(
                        same,
                        "{op:?} on {:?} (skew {skew}): output {j} differs from the CPU",
                        inputs.iter().map(|t| &t.ty).collect::<Vec<_>>()
                    );
                }
            }
        }
    }

    /// One representative node of every kernel family, dtype and layout.
    fn sweep() -> Vec<(Op, Vec<TensorType>)> {
        let floats = [DType::F32, DType::BF16, DType::F16, DType::F64];
        let all = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64, DType::Bool];
        let fns = [
            UnaryFn::Neg,
            UnaryFn::Exp,
            UnaryFn::Log,
            UnaryFn::Sqrt,
            UnaryFn::Rsqrt,
            UnaryFn::Tanh,
            UnaryFn::Sigmoid,
            UnaryFn::Silu,
            UnaryFn::GeluTanh,
            UnaryFn::GeluErf,
            UnaryFn::Pow(1.5),
        ];
        let mut v: Vec<(Op, Vec<TensorType>)> = Vec::new();
        for dt in floats {
            let x = t(dt, &[5, 7]);
            v.push((Full { value: 2.0, ty: x.clone() }.into(), vec![]));
            for f in fns {
                v.push((Unary { f }.into(), vec![x.clone()]));
                v.push((UnaryBackward { f }.into(), vec![x.clone(), x.clone()]));
            }
            for f in [BinaryFn::Add, BinaryFn::Sub, BinaryFn::Mul, BinaryFn::Div] {
                v.push((Binary { f }.into(), vec![x.clone(), t(dt, &[7])]));
            }
            for to in floats {
                v.push((Cast { dtype: to }.into(), vec![x.clone()]));
            }
            for (shape, axes) in [(&[3, 4100][..], &[1][..]), (&[33, 17], &[1]), (&[1000, 7], &[0]), (&[], &[])] {
                for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
                    v.push((Reduce { kind, axes: axes.to_vec(), keepdim: true }.into(), vec![t(dt, shape)]));
                }
                let kept: Vec<usize> =
                    shape.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
                v.push((MaxBackward { axes: axes.to_vec() }.into(), vec![t(dt, shape), t(dt, &kept), t(dt, &kept)]));
            }
            for ids in [DType::I32, DType::I64] {
                for width in [3, 24, 4096] {
                    v.push((Embedding.into(), vec![t(ids, &[2, 5]), t(dt, &[9, width])]));
                    let op = stepgraph_core::ops::embedding::EmbeddingBackward { num_rows: 9 };
                    v.push((op.into(), vec![t(ids, &[2, 5]), t(dt, &[2, 5, width])]));
                }
            }
            for mt in [dt, DType::F32] {
                for vt in [dt, DType::F32] {
                    for st in [DType::F32, DType::F64] {
                        let p = t(dt, &[5, 7]);
                        let types = vec![p.clone(), p, t(mt, &[5, 7]), t(vt, &[5, 7]), t(st, &[]), t(st, &[1])];
                        v.push((AdamW::default().into(), types));
                    }
                }
            }
        }
        for dt in all {
            for shape in [&[3, 5][..], &[4, 64]] {
                let x = t(dt, shape);
                v.push((Broadcast { shape: vec![2, shape[0], shape[1]] }.into(), vec![x.clone()]));
                v.push((
                    Broadcast { shape: vec![shape[0], 2, shape[1]] }.into(),
                    vec![t(dt, &[shape[0], 1, shape[1]])],
                ));
                v.push((Permute { perm: vec![1, 0] }.into(), vec![x.clone()]));
                v.push((Permute { perm: vec![1, 0, 2] }.into(), vec![t(dt, &[2, shape[0], shape[1]])]));
                v.push((Slice { axis: 1, start: 1, end: shape[1] - 1 }.into(), vec![x.clone()]));
                v.push((Slice { axis: 1, start: 0, end: shape[1] / 2 }.into(), vec![x.clone()]));
                v.push((SliceBackward { axis: 1, start: 2, size: shape[1] + 3 }.into(), vec![x.clone()]));
                v.push((SliceBackward { axis: 0, start: 0, size: shape[0] * 2 }.into(), vec![x.clone()]));
                v.push((Concat { axis: 1 }.into(), vec![x.clone(), x.clone(), t(dt, &[shape[0], 1])]));
                v.push((Concat { axis: 0 }.into(), vec![x.clone(), x]));
            }
        }
        v
    }

    /// What the CUBIN says about one kernel: parameter sizes by ordinal and
    /// the `__launch_bounds__` thread limit.
    #[derive(Debug, Default)]
    struct KernelInfo {
        params: Vec<(u16, u32)>,
        param_bytes: Option<u32>,
        max_threads: Option<u64>,
    }

    /// Reads the `.nv.info.<function>` section of an sm_90 CUBIN (ELF64):
    /// a list of attributes `(format, id, value)`; the ones used here are
    /// KPARAM_INFO (0x17: index u32, ordinal u16, offset u16, flags u32 with
    /// the size in bits 18..32), CBANK_PARAM_SIZE (0x19) and MAX_THREADS (0x05).
    fn kernel_info(cubin: &[u8], function: &str) -> Option<KernelInfo> {
        let u16_at = |o: usize| u16::from_le_bytes(cubin[o..o + 2].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(cubin[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(cubin[o..o + 8].try_into().unwrap());
        assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF file");
        let (shoff, shentsize, shnum, shstrndx) =
            (u64_at(0x28) as usize, u16_at(0x3a) as usize, u16_at(0x3c) as usize, u16_at(0x3e) as usize);
        let section = |i: usize| {
            let h = shoff + i * shentsize;
            (u32_at(h) as usize, u64_at(h + 24) as usize, u64_at(h + 32) as usize)
        };
        let strtab = section(shstrndx).1;
        let name_of = |off: usize| {
            let s = &cubin[strtab + off..];
            std::str::from_utf8(&s[..s.iter().position(|&b| b == 0).unwrap()]).unwrap()
        };
        let want = format!(".nv.info.{function}");
        let (_, off, size) = (0..shnum).map(section).find(|s| name_of(s.0) == want)?;
        let d = &cubin[off..off + size];
        let mut info = KernelInfo::default();
        let mut i = 0;
        while i + 2 <= d.len() {
            let (format, attr) = (d[i], d[i + 1]);
            let (value, next) = match format {
                // EIFMT_SVAL: u16 length, then the value.
                4 => {
                    let n = u16::from_le_bytes([d[i + 2], d[i + 3]]) as usize;
                    (&d[i + 4..i + 4 + n], i + 4 + n)
                }
                // EIFMT_BVAL and EIFMT_HVAL: a 2-byte value.
                2 | 3 => (&d[i + 2..i + 4], i + 4),
                // EIFMT_NVAL: no value.
                _ => (&d[i..i], i + 2),
            };
            match attr {
                0x17 => {
                    let ordinal = u16::from_le_bytes([value[4], value[5]]);
                    let flags = u32::from_le_bytes(value[8..12].try_into().unwrap());
                    info.params.push((ordinal, flags >> 18));
                }
                0x19 => info.param_bytes = Some(u16::from_le_bytes([value[0], value[1]]) as u32),
                0x05 => {
                    let dims: Vec<u64> =
                        value.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap()) as u64).collect();
                    info.max_threads = Some(dims.iter().product());
                }
                _ => {}
            }
            i = next;
        }
        Some(info)
    }

    /// Every kernel a lowering names exists in its module's CUBIN for sm_90
    /// with exactly the parameters the launch passes (count and byte size of
    /// each) and a `__launch_bounds__` that admits the block. This catches
    /// signature drift between the `.cu` files and this lowering without a
    /// GPU. Runs where NVRTC is installed (as `every_kernel_compiles_for_sm_90`).
    #[test]
    fn every_launch_matches_its_kernel_signature() {
        let launches: Vec<(String, KernelLaunch)> = sweep()
            .into_iter()
            .flat_map(|(op, types)| {
                let l = lower_types(&op, &types, 0).unwrap_or_else(|e| panic!("{op:?}: {e}"));
                l.into_iter().filter_map(move |l| match l {
                    Launch::Kernel(k) => Some((format!("{op:?} on {types:?}"), k)),
                    _ => None,
                })
            })
            .collect();
        for (what, k) in &launches {
            assert!(k.grid.0 >= 1 && k.grid.1 >= 1 && k.grid.2 >= 1, "{what}: empty grid");
            assert!(k.block.0 * k.block.1 * k.block.2 <= 1024, "{what}: block too large");
            assert!(k.args.iter().all(|a| a.bytes().len() % 8 == 0), "{what}: every argument is 8-byte sized");
        }
        if !crate::nvrtc::available() {
            eprintln!("NVRTC not found: kernel signature check skipped");
            assert!(
                std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
                "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
            );
            return;
        }
        let mut cubins: HashMap<&str, Vec<u8>> = HashMap::new();
        let mut seen = std::collections::BTreeSet::new();
        for (what, k) in &launches {
            let cubin = cubins
                .entry(k.module)
                .or_insert_with(|| crate::nvrtc::compile(k.module, "sm_90").unwrap_or_else(|e| panic!("{e}")));
            let info = kernel_info(cubin, &k.function)
                .unwrap_or_else(|| panic!("{what}: no kernel `{}` in module `{}`", k.function, k.module));
            let mut params = info.params.clone();
            params.sort();
            let sizes: Vec<u32> = params.iter().map(|p| p.1).collect();
            let passed: Vec<u32> = k.args.iter().map(|a| a.bytes().len() as u32).collect();
            assert_eq!(sizes, passed, "{what}: `{}` parameter sizes", k.function);
            if let Some(total) = info.param_bytes {
                assert_eq!(total, passed.iter().sum::<u32>(), "{what}: `{}` parameter bytes", k.function);
            }
            if let Some(max) = info.max_threads {
                let threads = k.block.0 as u64 * k.block.1 as u64 * k.block.2 as u64;
                assert!(threads <= max, "{what}: `{}` launched with {threads} threads, bound {max}", k.function);
            }
            seen.insert(k.function.clone());
        }
        // The sweep reaches every family and layout.
        for f in ["rows", "warps", "cols", "u8_", "u128", "embedding_backward", "adamw_f64_f32_f32", "cast_f16_bf16"] {
            assert!(seen.iter().any(|s| s.contains(f) || format!("{s}_").contains(f)), "no `{f}` kernel in the sweep");
        }
    }
}
