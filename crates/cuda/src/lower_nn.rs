//! Lowering of the row-wise network ops — RMSNorm, LayerNorm, rotary
//! embedding, softmax and the cross-entropy loss, forward and backward — to
//! the kernels of `kernels/{norm,rope,softmax,loss}.cu`. Data only: every
//! node becomes [`Launch::Kernel`]s with fixed addresses, no CUDA call.
//!
//! Conventions shared by these kernels (each source's header has details):
//! - row kernels run one block per row of the last axis, grid-striding over
//!   rows, with a block of a multiple of 32 threads (at most 1024) chosen
//!   from the row length; their reductions are common.cuh's fixed trees;
//! - parameter gradients of the norms (sums over every row) come from a
//!   column kernel of 32×32 blocks that adds rows in a fixed order: no
//!   float atomics and no scratch memory (a lowering cannot allocate);
//! - the optional statistic cotangents of the backward ops are present or
//!   absent by the input count; an absent one is passed as a null pointer
//!   with a 0 flag;
//! - integer targets are passed untyped with a flag (`1` for i64, `0` for
//!   i32), so the kernel names stay `<op>_<float dtype>`.
//!
//! Every lowering first checks the node's operand types against the op's
//! shape rule, so a kernel never sees a shape it was not written for.

use stepgraph_core::ir::{DType, TensorType};
use stepgraph_core::ops::loss::{CrossEntropy, CrossEntropyBackward};
use stepgraph_core::ops::norm::{LayerNorm, RmsNorm};
use stepgraph_core::ops::rope::Rope;
use stepgraph_core::ops::Op;

use crate::error::{CudaError, Result};
use crate::launch::{Arg, DevTensor, KernelLaunch, Launch};

/// Elements a row-kernel thread handles before the block grows: enough that
/// a block's reduction is not most of its work, few enough that a row of a
/// few thousand elements still fills a block.
const ROW_ELEMS_PER_THREAD: usize = 4;
/// The largest block (and the `__launch_bounds__` of every kernel here).
const MAX_THREADS: usize = 1024;
/// Row kernels grid-stride, so any grid is correct; this only keeps grid.x
/// far below its 2³¹ − 1 limit.
const MAX_ROW_BLOCKS: usize = 1 << 20;
/// `NORM_COL_TILE` × `NORM_ROW_LANES` of norm.cu: the block of the
/// parameter-gradient kernels, columns along x and row lanes along y.
const NORM_COL_TILE: usize = 32;
const NORM_ROW_LANES: usize = 32;
/// `ROPE_CHUNK` of rope.cu: pairs whose angles a rope block holds at once.
const ROPE_CHUNK: usize = 256;
/// Rope blocks do little per element; smaller blocks spread the B·T rows.
const ROPE_MAX_THREADS: usize = 256;
/// The grid cap of the cross-entropy backward: each of its blocks recounts
/// the kept rows (the mean's divisor) before its rows, so fewer blocks than
/// rows keep that count a small part of the work.
const CE_BWD_MAX_BLOCKS: usize = 1024;
/// The single block that adds the per-row losses.
const CE_LOSS_THREADS: u32 = 1024;

/// The device work of one row-wise network node.
pub fn lower(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<Vec<Launch>> {
    match op {
        Op::RmsNorm(o) => rms_norm(o, checked(op, inputs, outputs)?, inputs, outputs),
        Op::RmsNormBackward(_) => rms_norm_backward(checked(op, inputs, outputs)?, inputs, outputs),
        Op::LayerNorm(o) => layer_norm(o, checked(op, inputs, outputs)?, inputs, outputs),
        Op::LayerNormBackward(_) => layer_norm_backward(checked(op, inputs, outputs)?, inputs, outputs),
        Op::Rope(o) => rope(op, o, checked(op, inputs, outputs)?, inputs, outputs),
        Op::Softmax(_) => softmax(checked(op, inputs, outputs)?, inputs, outputs),
        Op::SoftmaxBackward(_) => softmax_backward(checked(op, inputs, outputs)?, inputs, outputs),
        Op::CrossEntropy(o) => cross_entropy(o, checked(op, inputs, outputs)?, inputs, outputs),
        Op::CrossEntropyBackward(o) => cross_entropy_backward(o, checked(op, inputs, outputs)?, inputs, outputs),
        _ => Err(crate::lower::not_routed(op)),
    }
}

/// Checks the operands against the op's shape rule and returns the float
/// dtype of input 0 (the data), which names the kernels.
fn checked(op: &Op, inputs: &[DevTensor], outputs: &[DevTensor]) -> Result<DType> {
    let tys: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
    let want = op.infer(&tys).map_err(|e| CudaError::lower(op.name(), e))?;
    let got: Vec<&TensorType> = outputs.iter().map(|t| &t.ty).collect();
    if want.iter().collect::<Vec<_>>() != got {
        return Err(CudaError::lower(op.name(), format!("outputs {got:?} do not match the shape rule's {want:?}")));
    }
    Ok(inputs[0].ty.dtype)
}

/// `(rows, cols)` of a tensor seen as rows of its last axis.
fn rows_cols(ty: &TensorType) -> (usize, usize) {
    let cols = ty.shape.last().copied().unwrap_or(1);
    (ty.numel().checked_div(cols).unwrap_or(0), cols)
}

/// Threads of a row kernel's block for rows of `cols` elements.
fn row_threads(cols: usize) -> u32 {
    cols.div_ceil(ROW_ELEMS_PER_THREAD).next_multiple_of(32).clamp(32, MAX_THREADS) as u32
}

fn row_grid(rows: usize, cap: usize) -> (u32, u32, u32) {
    (rows.clamp(1, cap) as u32, 1, 1)
}

fn kernel(
    module: &'static str,
    op: &str,
    dtype: DType,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: Vec<Arg>,
) -> Launch {
    Launch::Kernel(KernelLaunch {
        module,
        function: format!("{op}_{}", dtype.name()),
        grid,
        block,
        shared_bytes: 0,
        args,
    })
}

fn ptr(t: &DevTensor) -> Arg {
    Arg::Ptr(t.ptr)
}

fn size(n: usize) -> Arg {
    Arg::I64(n as i64)
}

/// An optional input: its address and a present flag, or null and 0.
fn optional(t: Option<&DevTensor>) -> [Arg; 2] {
    match t {
        Some(t) => [ptr(t), Arg::I32(1)],
        None => [Arg::Ptr(0), Arg::I32(0)],
    }
}

/// The column kernel's launch: one 32×32 block per 32 columns.
fn column_launch(name: &str, dtype: DType, cols: usize, args: Vec<Arg>) -> Launch {
    let grid = (cols.div_ceil(NORM_COL_TILE).max(1) as u32, 1, 1);
    kernel("norm", name, dtype, grid, (NORM_COL_TILE as u32, NORM_ROW_LANES as u32, 1), args)
}

/// Row-kernel launch over `rows` rows of `cols`, none when there is no row.
fn row_launch(module: &'static str, name: &str, dtype: DType, rows: usize, cols: usize, args: Vec<Arg>) -> Vec<Launch> {
    if rows == 0 {
        return vec![];
    }
    vec![kernel(module, name, dtype, row_grid(rows, MAX_ROW_BLOCKS), (row_threads(cols), 1, 1), args)]
}

// ---------------------------------------------------------------- norms

fn rms_norm(o: &RmsNorm, dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (x, w) = (&ins[0], &ins[1]);
    let (y, rstd) = (&outs[0], &outs[1]);
    let (rows, cols) = rows_cols(&x.ty);
    let args = vec![ptr(x), ptr(w), ptr(y), ptr(rstd), size(rows), size(cols), Arg::F64(o.eps)];
    Ok(row_launch("norm", "rms_norm", dt, rows, cols, args))
}

fn rms_norm_backward(dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (x, w, rstd, gy) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    let (gx, gw) = (&outs[0], &outs[1]);
    let (rows, cols) = rows_cols(&x.ty);
    let mut args = vec![ptr(x), ptr(w), ptr(rstd), ptr(gy)];
    args.extend(optional(ins.get(4)));
    args.extend([ptr(gx), size(rows), size(cols)]);
    let mut launches = row_launch("norm", "rms_norm_backward", dt, rows, cols, args);
    // Launched even without rows: gw is then the empty sum, zeros.
    let gw_args = vec![ptr(x), ptr(rstd), ptr(gy), ptr(gw), size(rows), size(cols)];
    launches.push(column_launch("rms_norm_backward_gw", dt, cols, gw_args));
    Ok(launches)
}

fn layer_norm(o: &LayerNorm, dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (x, w, b) = (&ins[0], &ins[1], &ins[2]);
    let (y, mean, rstd) = (&outs[0], &outs[1], &outs[2]);
    let (rows, cols) = rows_cols(&x.ty);
    let args = vec![ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd), size(rows), size(cols), Arg::F64(o.eps)];
    Ok(row_launch("norm", "layer_norm", dt, rows, cols, args))
}

fn layer_norm_backward(dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (x, w, mean, rstd, gy) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
    let (gx, gw, gb) = (&outs[0], &outs[1], &outs[2]);
    let (rows, cols) = rows_cols(&x.ty);
    // The shape rule admits 5 inputs or 7: the two statistic cotangents come together.
    let (gmean, grstd, has) = match ins.get(5..7) {
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
        ptr(gx),
        size(rows),
        size(cols),
    ];
    let mut launches = row_launch("norm", "layer_norm_backward", dt, rows, cols, args);
    // Launched even without rows: gw and gb are then the empty sums, zeros.
    let gwb_args = vec![ptr(x), ptr(mean), ptr(rstd), ptr(gy), ptr(gw), ptr(gb), size(rows), size(cols)];
    launches.push(column_launch("layer_norm_backward_gwb", dt, cols, gwb_args));
    Ok(launches)
}

// ---------------------------------------------------------------- rope

fn rope(op: &Op, o: &Rope, dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (x, y) = (&ins[0], &outs[0]);
    let [batch, seq, heads, dim] = x.ty.shape[..] else {
        return Err(CudaError::lower(op.name(), format!("x must be [B, T, H, D], got {}", x.ty)));
    };
    let row = heads * dim;
    if x.ty.numel() == 0 || (o.n_rot == 0 && x.ptr == y.ptr) {
        // Nothing to write: no element, or the identity in place.
        return Ok(vec![]);
    }
    // In-row offsets are 32-bit in the kernel (its per-element divisions are cheaper so).
    let int = |v: usize, what: &str| {
        i32::try_from(v)
            .map_err(|_| CudaError::lower(op.name(), format!("{what} = {v} exceeds the kernel's 32-bit range")))
    };
    let (heads_i, dim_i, n_rot_i) = (int(heads, "H")?, int(dim, "D")?, int(o.n_rot, "n_rot")?);
    int(row, "H·D")?;
    // Threads cover one chunk of pairs of every head (all elements for n_rot ≤ 1).
    let per_row = if o.n_rot >= 2 { heads * (o.n_rot / 2).min(ROPE_CHUNK) } else { row };
    let threads = per_row.next_multiple_of(32).clamp(32, ROPE_MAX_THREADS) as u32;
    let bt = batch * seq;
    let args = vec![
        ptr(x),
        ptr(y),
        size(bt),
        size(seq),
        Arg::I32(heads_i),
        Arg::I32(dim_i),
        Arg::I32(n_rot_i),
        Arg::F64(o.base),
        Arg::I32(o.inverse as i32),
    ];
    Ok(vec![kernel("rope", "rope", dt, row_grid(bt, MAX_ROW_BLOCKS), (threads, 1, 1), args)])
}

// ---------------------------------------------------------------- softmax

fn softmax(dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (x, y) = (&ins[0], &outs[0]);
    let (rows, cols) = rows_cols(&x.ty);
    Ok(row_launch("softmax", "softmax", dt, rows, cols, vec![ptr(x), ptr(y), size(rows), size(cols)]))
}

fn softmax_backward(dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (y, gy, gx) = (&ins[0], &ins[1], &outs[0]);
    let (rows, cols) = rows_cols(&y.ty);
    let args = vec![ptr(y), ptr(gy), ptr(gx), size(rows), size(cols)];
    Ok(row_launch("softmax", "softmax_backward", dt, rows, cols, args))
}

// ---------------------------------------------------------------- cross-entropy

/// The targets' address and their width flag (1: i64, 0: i32).
fn targets(t: &DevTensor) -> [Arg; 2] {
    [ptr(t), Arg::I32((t.ty.dtype == DType::I64) as i32)]
}

fn cross_entropy(o: &CrossEntropy, dt: DType, ins: &[DevTensor], outs: &[DevTensor]) -> Result<Vec<Launch>> {
    let (x, tgt) = (&ins[0], &ins[1]);
    let (loss, lse) = (&outs[0], &outs[1]);
    let (rows, cols) = rows_cols(&x.ty);
    let mut launches =
        row_launch("loss", "cross_entropy_lse", dt, rows, cols, vec![ptr(x), ptr(lse), size(rows), size(cols)]);
    // Launched even without rows: the mean over no row is NaN, as on the CPU.
    let mut args = vec![ptr(x)];
    args.extend(targets(tgt));
    args.extend([ptr(lse), ptr(loss), size(rows), size(cols), Arg::I64(o.ignore_index)]);
    launches.push(kernel("loss", "cross_entropy_loss", dt, (1, 1, 1), (CE_LOSS_THREADS, 1, 1), args));
    Ok(launches)
}

fn cross_entropy_backward(
    o: &CrossEntropyBackward,
    dt: DType,
    ins: &[DevTensor],
    outs: &[DevTensor],
) -> Result<Vec<Launch>> {
    let (x, tgt, lse, gloss) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    let dx = &outs[0];
    let (rows, cols) = rows_cols(&x.ty);
    if rows == 0 {
        return Ok(vec![]);
    }
    let mut args = vec![ptr(x)];
    args.extend(targets(tgt));
    args.extend([ptr(lse), ptr(gloss)]);
    args.extend(optional(ins.get(4)));
    args.extend([ptr(dx), size(rows), size(cols), Arg::I64(o.ignore_index)]);
    let grid = row_grid(rows, CE_BWD_MAX_BLOCKS);
    Ok(vec![kernel("loss", "cross_entropy_backward", dt, grid, (row_threads(cols), 1, 1), args)])
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use stepgraph_core::ops::norm::{LayerNormBackward, RmsNormBackward};
    use stepgraph_core::ops::softmax::{Softmax, SoftmaxBackward};

    use super::*;
    use crate::kernels::modules;

    const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

    /// Device tensors at made-up, distinct addresses.
    struct Addr(u64);
    impl Addr {
        fn dev(&mut self, ty: TensorType) -> DevTensor {
            self.0 += 1 << 20;
            DevTensor { ty, ptr: self.0 }
        }
    }

    fn stat(dt: DType) -> DType {
        stepgraph_core::ops::norm::stat_dtype(dt)
    }

    /// Every op of this module in `dt`, with its input types: with and
    /// without the optional inputs, empty rows, i32 and i64 targets.
    fn cases(dt: DType) -> Vec<(Op, Vec<TensorType>)> {
        let t = |s: &[usize]| TensorType::new(dt, s);
        let s = |s: &[usize]| TensorType::new(stat(dt), s);
        let rms = Op::RmsNorm(RmsNorm { eps: 1e-6 });
        let rmsb = Op::RmsNormBackward(RmsNormBackward { eps: 1e-6 });
        let ln = Op::LayerNorm(LayerNorm { eps: 1e-5 });
        let lnb = Op::LayerNormBackward(LayerNormBackward { eps: 1e-5 });
        let ce = Op::CrossEntropy(CrossEntropy { ignore_index: -100 });
        let ceb = Op::CrossEntropyBackward(CrossEntropyBackward { ignore_index: -100 });
        let rope = |n_rot, inverse| Op::Rope(Rope { n_rot, base: 10000.0, inverse });
        let ids = |ty, n| TensorType::new(ty, [n]);
        vec![
            (rms.clone(), vec![t(&[3, 5, 4096]), t(&[4096])]),
            (rms, vec![t(&[0, 7]), t(&[7])]),
            (rmsb.clone(), vec![t(&[6, 3200]), t(&[3200]), s(&[6]), t(&[6, 3200])]),
            (rmsb.clone(), vec![t(&[6, 3200]), t(&[3200]), s(&[6]), t(&[6, 3200]), s(&[6])]),
            (rmsb, vec![t(&[0, 7]), t(&[7]), s(&[0]), t(&[0, 7])]),
            (ln.clone(), vec![t(&[9, 1]), t(&[1]), t(&[1])]),
            (lnb.clone(), vec![t(&[9, 33]), t(&[33]), s(&[9]), s(&[9]), t(&[9, 33])]),
            (lnb, vec![t(&[9, 33]), t(&[33]), s(&[9]), s(&[9]), t(&[9, 33]), s(&[9]), s(&[9])]),
            (rope(128, false), vec![t(&[2, 16, 32, 128])]),
            (rope(1024, true), vec![t(&[1, 3, 2, 1024])]),
            (rope(1, false), vec![t(&[2, 5, 4, 1])]),
            (rope(0, false), vec![t(&[2, 5, 4, 8])]),
            (Op::Softmax(Softmax), vec![t(&[4, 7, 32000])]),
            (Op::Softmax(Softmax), vec![t(&[4, 0])]),
            (Op::SoftmaxBackward(SoftmaxBackward), vec![t(&[4, 7, 129]), t(&[4, 7, 129])]),
            (ce.clone(), vec![t(&[4, 152064]), ids(DType::I64, 4)]),
            (ce, vec![t(&[0, 10]), ids(DType::I32, 0)]),
            (ceb.clone(), vec![t(&[3000, 7]), ids(DType::I32, 3000), s(&[3000]), s(&[])]),
            (ceb, vec![t(&[4, 152064]), ids(DType::I64, 4), s(&[4]), s(&[]), s(&[4])]),
        ]
    }

    /// Lowers `op` on fresh addresses; returns the inputs, outputs and launches.
    fn lowered(op: &Op, in_tys: &[TensorType]) -> (Vec<DevTensor>, Vec<DevTensor>, Vec<Launch>) {
        let mut a = Addr(0);
        let ins: Vec<DevTensor> = in_tys.iter().map(|t| a.dev(t.clone())).collect();
        let out_tys = op.infer(&in_tys.iter().collect::<Vec<_>>()).unwrap();
        let outs: Vec<DevTensor> = out_tys.into_iter().map(|t| a.dev(t)).collect();
        let launches = lower(op, &ins, &outs).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        (ins, outs, launches)
    }

    fn kernels(launches: &[Launch]) -> Vec<&KernelLaunch> {
        launches
            .iter()
            .map(|l| match l {
                Launch::Kernel(k) => k,
                other => panic!("expected only kernels, got {other:?}"),
            })
            .collect()
    }

    #[test]
    fn launches_are_well_formed() {
        for dt in FLOATS {
            for (op, in_tys) in cases(dt) {
                let (ins, outs, launches) = lowered(&op, &in_tys);
                let known: Vec<u64> = ins.iter().chain(&outs).map(|t| t.ptr).chain([0]).collect();
                for k in kernels(&launches) {
                    assert!(modules().any(|m| m == k.module), "{}: unknown module", k.module);
                    assert!(k.function.starts_with(op.name()), "{} launched for {}", k.function, op.name());
                    assert!(k.function.ends_with(&format!("_{}", dt.name())), "{}", k.function);
                    let threads = k.block.0 * k.block.1 * k.block.2;
                    assert!(threads <= 1024 && k.block.0 % 32 == 0, "{}: block {:?}", k.function, k.block);
                    assert!(k.grid.0 >= 1 && k.grid.1 >= 1 && k.grid.2 >= 1, "{}: grid {:?}", k.function, k.grid);
                    for a in &k.args {
                        if let Arg::Ptr(p) = a {
                            assert!(known.contains(p), "{}: pointer {p:#x} is no operand", k.function);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn parameter_gradients_are_written_without_rows_and_nothing_else_runs() {
        let t = |s: &[usize]| TensorType::new(DType::F32, s);
        let rmsb = Op::RmsNormBackward(RmsNormBackward { eps: 1e-6 });
        let (_, _, l) = lowered(&rmsb, &[t(&[0, 7]), t(&[7]), t(&[0]), t(&[0, 7])]);
        let names: Vec<&str> = kernels(&l).iter().map(|k| k.function.as_str()).collect();
        assert_eq!(names, ["rms_norm_backward_gw_f32"]);
        let (_, _, l) = lowered(&Op::Softmax(Softmax), &[t(&[4, 0])]);
        assert!(l.is_empty());
        let ce = Op::CrossEntropy(CrossEntropy { ignore_index: -100 });
        let (_, _, l) = lowered(&ce, &[t(&[0, 10]), TensorType::new(DType::I64, [0])]);
        let names: Vec<&str> = kernels(&l).iter().map(|k| k.function.as_str()).collect();
        assert_eq!(names, ["cross_entropy_loss_f32"], "the loss of no row is still written (NaN)");
    }

    #[test]
    fn rope_in_place_identity_is_free_and_out_of_place_copies() {
        let op = Op::Rope(Rope { n_rot: 0, base: 10000.0, inverse: false });
        let ty = TensorType::new(DType::BF16, [1, 2, 3, 4]);
        let x = DevTensor { ty: ty.clone(), ptr: 4096 };
        assert!(lower(&op, std::slice::from_ref(&x), std::slice::from_ref(&x)).unwrap().is_empty());
        let y = DevTensor { ty, ptr: 8192 };
        assert_eq!(lower(&op, &[x], &[y]).unwrap().len(), 1);
    }

    #[test]
    fn optional_inputs_pass_null_and_a_flag() {
        let dt = DType::F32;
        let t = |s: &[usize]| TensorType::new(dt, s);
        let op = Op::RmsNormBackward(RmsNormBackward { eps: 1e-6 });
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
    fn wrong_operands_and_wrong_ops_are_errors() {
        let t = |s: &[usize]| TensorType::new(DType::F32, s);
        let mut a = Addr(0);
        let op = Op::RmsNorm(RmsNorm { eps: 1e-6 });
        let (x, w) = (a.dev(t(&[2, 8])), a.dev(t(&[9])));
        let outs = [a.dev(t(&[2, 8])), a.dev(t(&[2]))];
        assert!(lower(&op, &[x.clone(), w], &outs).is_err(), "weight of the wrong length");
        let w = a.dev(t(&[8]));
        assert!(lower(&op, &[x.clone(), w.clone()], &outs[..1]).is_err(), "missing rstd output");
        assert!(lower(&op, &[x.clone(), w], &outs).is_ok());
        let other = Op::Reshape(stepgraph_core::ops::movement::Reshape { shape: vec![16] });
        assert!(lower(&other, &[x], &[a.dev(t(&[16]))]).is_err());
    }

    /// `(size, offset)` of every parameter of `function`, from the CUBIN's
    /// `.nv.info.<function>` section (EIATTR_KPARAM_INFO records), in
    /// parameter order.
    fn cubin_params(cubin: &[u8], function: &str) -> Option<Vec<(usize, usize)>> {
        let u16_at = |o: usize| u16::from_le_bytes(cubin[o..o + 2].try_into().unwrap()) as usize;
        let u32_at = |o: usize| u32::from_le_bytes(cubin[o..o + 4].try_into().unwrap()) as usize;
        let u64_at = |o: usize| u64::from_le_bytes(cubin[o..o + 8].try_into().unwrap()) as usize;
        // ELF64 section headers: offset at 0x28, entry size/count/names index at 0x3a.
        let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c), u16_at(0x3e));
        let header = |i: usize| shoff + i * shentsize;
        let strtab = u64_at(header(shstrndx) + 0x18);
        let want = format!(".nv.info.{function}");
        let section = (0..shnum).find(|&i| {
            let name = strtab + u32_at(header(i));
            let end = name + cubin[name..].iter().position(|&b| b == 0).unwrap();
            cubin[name..end] == *want.as_bytes()
        })?;
        let (off, len) = (u64_at(header(section) + 0x18), u64_at(header(section) + 0x20));
        let info = &cubin[off..off + len];
        let mut params = Vec::new();
        let mut i = 0;
        while i + 2 <= info.len() {
            let (format, attr) = (info[i], info[i + 1]);
            // Formats: 1 no value, 2 one byte, 3 two bytes, 4 a u16 length then that many bytes.
            let step = match format {
                1 => 2,
                2 | 3 => 4,
                4 => 4 + (info[i + 2] as usize | (info[i + 3] as usize) << 8),
                f => panic!("{function}: unknown .nv.info format {f}"),
            };
            const KPARAM_INFO: u8 = 0x17;
            if format == 4 && attr == KPARAM_INFO {
                let d = &info[i + 4..i + step];
                let ordinal = u16::from_le_bytes([d[4], d[5]]) as usize;
                let offset = u16::from_le_bytes([d[6], d[7]]) as usize;
                let size = (u32::from_le_bytes([d[8], d[9], d[10], d[11]]) >> 18) as usize;
                params.push((ordinal, size, offset));
            }
            i += step;
        }
        params.sort();
        Some(params.into_iter().map(|(_, s, o)| (s, o)).collect())
    }

    /// Every lowered launch names a kernel that NVRTC builds, with exactly
    /// the parameters (count, sizes, C layout) its arguments fill: a wrong
    /// argument list would otherwise only show as garbage on a GPU.
    #[test]
    fn nvrtc_lowered_launches_match_the_kernel_signatures() {
        if !crate::nvrtc::available() {
            eprintln!("NVRTC not found: kernel signature check skipped");
            assert!(
                std::env::var_os("STEPGRAPH_REQUIRE_NVRTC").is_none(),
                "STEPGRAPH_REQUIRE_NVRTC is set but NVRTC is missing"
            );
            return;
        }
        let mut cubins: HashMap<&str, Vec<u8>> = HashMap::new();
        let mut checked = 0;
        for dt in FLOATS {
            for (op, in_tys) in cases(dt) {
                let (_, _, launches) = lowered(&op, &in_tys);
                for k in kernels(&launches) {
                    let cubin = cubins
                        .entry(k.module)
                        .or_insert_with(|| crate::nvrtc::compile(k.module, "sm_90").unwrap_or_else(|e| panic!("{e}")));
                    let params = cubin_params(cubin, &k.function)
                        .unwrap_or_else(|| panic!("{}: no such kernel in module {}", k.function, k.module));
                    let mut offset = 0usize;
                    let want: Vec<(usize, usize)> = k
                        .args
                        .iter()
                        .map(|a| {
                            let n = a.bytes().len();
                            offset = offset.next_multiple_of(n);
                            let at = offset;
                            offset += n;
                            (n, at)
                        })
                        .collect();
                    assert_eq!(
                        want, params,
                        "{}: arguments (size, offset) against the kernel's parameters",
                        k.function
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 50, "only {checked} launches checked");
    }
}
