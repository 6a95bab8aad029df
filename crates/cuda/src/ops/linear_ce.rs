//! Lowering of the fused LM head and cross-entropy
//! ([`LinearCrossEntropy`], [`LinearCrossEntropyBackward`]): per chunk of
//! vocabulary columns, cuBLASLt products ([`GemmCall`], f32 accumulation
//! inside) between the small kernels of `kernels/linear_ce.cu` (online
//! log-sum-exp, the chunk's softmax cotangent, the `dhidden` accumulation),
//! in a fixed order on one stream: deterministic, no atomics. The workspace
//! outputs are cleared by memsets at the end (core's module doc says why).
//! The soft-cap (0: none) is the last argument of both chunk kernels, which
//! branch on it uniformly, so an uncapped head runs the plain code.
//! f64 has no cuBLASLt product and is declined as unsupported, as `matmul`.

use stepgraph_core::ir::DType;
use stepgraph_core::ops::linear_ce::{LinearCrossEntropy, LinearCrossEntropyBackward, Reduction};

use super::util::{launch_1d, n64, optional, ptr, row_grid, row_launch, row_threads, typed_kernel};
use super::{Lower, LowerCx};
use crate::error::{CudaError, Result};
use crate::kernel_module::KernelModule;
use crate::launch::{Arg, DevTensor, GemmAddend, GemmCall, GemmType, Launch};

const LINEAR_CE: &[KernelModule] = &[KernelModule::plain("linear_ce", include_str!("../../kernels/linear_ce.cu"))];

/// The single block that adds the per-row losses.
const LCE_FINISH_THREADS: u32 = 1024;
/// The grid cap of the backward's chunk kernel: each block recounts the kept
/// rows (the mean's divisor) before its rows.
const LCE_BWD_MAX_BLOCKS: usize = 1024;

/// The targets' address and their width flag (1: i64, 0: i32).
fn targets(t: &DevTensor) -> [Arg; 2] {
    [ptr(t), Arg::I32((t.ty.dtype == DType::I64) as i32)]
}

fn gemm_type(op: &str, dt: DType) -> Result<GemmType> {
    match dt {
        DType::F32 => Ok(GemmType::F32),
        DType::BF16 => Ok(GemmType::BF16),
        DType::F16 => Ok(GemmType::F16),
        d => Err(CudaError::unsupported(op, format!("no cuBLASLt product for {d}"))),
    }
}

/// The sizes of one node and its data type.
struct Geometry {
    ty: GemmType,
    dt: DType,
    elem: u64,
    rows: usize,
    feats: usize,
    classes: usize,
    chunk: usize,
}

impl Geometry {
    fn of(op: &str, chunk: usize, cx: &LowerCx) -> Result<Self> {
        let (hidden, weight) = (&cx.inputs[0].ty, &cx.inputs[1].ty);
        let dt = hidden.dtype;
        Ok(Geometry {
            ty: gemm_type(op, dt)?,
            dt,
            elem: dt.size() as u64,
            rows: hidden.shape[0],
            feats: hidden.shape[1],
            classes: weight.shape[0],
            chunk: chunk.min(weight.shape[0]),
        })
    }

    /// `(v0, cw)` of every chunk, in order.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.classes).step_by(self.chunk).map(|v0| (v0, self.chunk.min(self.classes - v0)))
    }

    /// The address of weight row `v0` (rows of `dweight` alike).
    fn row_of(&self, base: u64, v0: usize) -> u64 {
        base + (v0 * self.feats) as u64 * self.elem
    }

    /// `c[m, n] = op(a) · op(b)`: nothing for an empty result, a zero fill
    /// for an empty contraction (no library call depends on k = 0).
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        m: usize,
        n: usize,
        k: usize,
        trans_a: bool,
        trans_b: bool,
        a: u64,
        b: u64,
        c: u64,
    ) -> Vec<Launch> {
        if m == 0 || n == 0 {
            return vec![];
        }
        if k == 0 {
            return vec![Launch::Memset { ptr: c, bytes: (m * n) as u64 * self.elem, value: 0 }];
        }
        let (stride_a, stride_b, stride_c) = (0, 0, 0);
        vec![Launch::Gemm(GemmCall {
            ty: self.ty,
            batch: 1,
            m,
            n,
            k,
            trans_a,
            trans_b,
            a,
            b,
            c,
            stride_a,
            stride_b,
            stride_c,
            addend: GemmAddend::None,
            fp8_scales: None,
        })]
    }

    /// The chunk's logits `hidden · weight[v0 .. v0 + cw]ᵀ` into `buf`.
    fn chunk_logits(&self, cx: &LowerCx, buf: &DevTensor, v0: usize, cw: usize) -> Vec<Launch> {
        let (hidden, weight) = (&cx.inputs[0], &cx.inputs[1]);
        self.product(self.rows, cw, self.feats, false, true, hidden.ptr, self.row_of(weight.ptr, v0), buf.ptr)
    }
}

/// Zeroes a workspace on the way out; nothing for an empty one (no
/// zero-byte memset node in a graph).
fn clear(ts: &[&DevTensor]) -> Vec<Launch> {
    ts.iter()
        .filter(|t| t.ty.bytes() > 0)
        .map(|t| Launch::Memset { ptr: t.ptr, bytes: t.ty.bytes(), value: 0 })
        .collect()
}

fn mean_flag(r: Reduction) -> Arg {
    Arg::I32((r == Reduction::Mean) as i32)
}

impl Lower for LinearCrossEntropy {
    const KERNELS: &'static [KernelModule] = LINEAR_CE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let g = Geometry::of("linear_cross_entropy", self.chunk, cx)?;
        let tgt = &cx.inputs[2];
        let (loss, lse, buf, stats) = (&cx.outputs[0], &cx.outputs[1], &cx.outputs[2], &cx.outputs[3]);
        let st_elem = stats.ty.dtype.size() as u64;
        let (run_sum, tlogit) = (Arg::Ptr(stats.ptr), Arg::Ptr(stats.ptr + g.rows as u64 * st_elem));
        let mut l = Vec::new();
        if g.rows > 0 {
            let args = vec![ptr(lse), run_sum.clone(), tlogit.clone(), n64(g.rows)];
            l.push(launch_1d("linear_ce", format!("linear_ce_init_{}", g.dt.name()), g.rows, args));
            for (v0, cw) in g.chunks() {
                l.extend(g.chunk_logits(cx, buf, v0, cw));
                let mut args = vec![ptr(buf)];
                args.extend(targets(tgt));
                args.extend([ptr(lse), run_sum.clone(), tlogit.clone(), n64(g.rows), n64(cw), n64(v0)]);
                args.extend([Arg::I64(self.ignore_index), Arg::F64(self.softcap)]);
                l.extend(row_launch("linear_ce", "linear_ce_chunk_stats", g.dt, g.rows, cw, args));
            }
        }
        // Launched even without rows: the mean over no row is NaN, as on the CPU.
        let mut args = targets(tgt).to_vec();
        args.extend([ptr(lse), run_sum, tlogit, ptr(loss), n64(g.rows), n64(g.classes)]);
        args.extend([Arg::I64(self.ignore_index), mean_flag(self.reduction)]);
        l.push(typed_kernel("linear_ce", "linear_ce_finish", g.dt, (1, 1, 1), (LCE_FINISH_THREADS, 1, 1), args));
        l.extend(clear(&[buf, stats]));
        Ok(l)
    }
}

impl Lower for LinearCrossEntropyBackward {
    const KERNELS: &'static [KernelModule] = LINEAR_CE;

    fn lower(&self, cx: &LowerCx) -> Result<Vec<Launch>> {
        let g = Geometry::of("linear_cross_entropy_backward", self.chunk, cx)?;
        let ins = cx.inputs;
        let (hidden, weight, tgt, lse, gloss) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4]);
        let outs = cx.outputs;
        let (dhidden, dweight, buf, acc) = (&outs[0], &outs[1], &outs[2], &outs[3]);
        let hidden_elems = g.rows * g.feats;
        let mut l = Vec::new();
        for (i, (v0, cw)) in g.chunks().enumerate() {
            l.extend(g.chunk_logits(cx, buf, v0, cw));
            if g.rows > 0 {
                let mut args = vec![ptr(buf)];
                args.extend(targets(tgt));
                args.extend([ptr(lse), ptr(gloss)]);
                args.extend(optional(ins.get(5)));
                args.extend([n64(g.rows), n64(cw), n64(v0), n64(g.classes), Arg::I64(self.ignore_index)]);
                args.extend([mean_flag(self.reduction), Arg::F64(self.softcap)]);
                let grid = row_grid(g.rows, LCE_BWD_MAX_BLOCKS);
                let block = (row_threads(cw), 1, 1);
                l.push(typed_kernel("linear_ce", "linear_ce_backward_chunk", g.dt, grid, block, args));
            }
            // This chunk's rows of dweight: dlogits[:, chunk]ᵀ · hidden, over
            // all rows (none when nothing reads the weight's gradient).
            if self.weight_grad {
                let dw = g.row_of(dweight.ptr, v0);
                l.extend(g.product(cw, g.feats, g.rows, true, false, buf.ptr, hidden.ptr, dw));
            }
            if hidden_elems > 0 {
                // This chunk's share of dhidden, dlogits[:, chunk] · weight[chunk],
                // in dhidden's buffer, added to the f32 sum in chunk order.
                let w = g.row_of(weight.ptr, v0);
                l.extend(g.product(g.rows, g.feats, cw, false, false, buf.ptr, w, dhidden.ptr));
                let args = vec![ptr(dhidden), ptr(acc), n64(hidden_elems), Arg::I32((i == 0) as i32)];
                l.push(launch_1d("linear_ce", format!("linear_ce_accumulate_{}", g.dt.name()), hidden_elems, args));
            }
        }
        if hidden_elems > 0 {
            let args = vec![ptr(acc), ptr(dhidden), n64(hidden_elems)];
            l.push(launch_1d("linear_ce", format!("linear_ce_round_{}", g.dt.name()), hidden_elems, args));
        }
        l.extend(clear(&[buf, acc]));
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use stepgraph_core::ir::TensorType;
    use stepgraph_core::ops::Op;

    use super::super::testing::{lower_types, t};
    use super::*;

    fn names(l: &[Launch]) -> Vec<String> {
        l.iter()
            .map(|l| match l {
                Launch::Kernel(k) => k.function.clone(),
                Launch::Gemm(g) => format!("gemm {}x{}x{}", g.m, g.n, g.k),
                Launch::Memset { .. } => "memset".into(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn operands(rows: usize, feats: usize, classes: usize) -> Vec<TensorType> {
        vec![t(DType::BF16, &[rows, feats]), t(DType::BF16, &[classes, feats]), t(DType::I32, &[rows])]
    }

    #[test]
    fn the_forward_walks_the_chunks_in_order_with_a_narrower_last_one() {
        let op =
            Op::from(LinearCrossEntropy { chunk: 4, reduction: Reduction::Mean, ignore_index: -100, softcap: 0.0 });
        let l = lower_types(&op, &operands(6, 8, 10), 0).unwrap();
        assert_eq!(
            names(&l),
            [
                "linear_ce_init_bf16",
                "gemm 6x4x8",
                "linear_ce_chunk_stats_bf16",
                "gemm 6x4x8",
                "linear_ce_chunk_stats_bf16",
                "gemm 6x2x8",
                "linear_ce_chunk_stats_bf16",
                "linear_ce_finish_bf16",
                "memset",
                "memset",
            ]
        );
        // The third chunk's product reads weight rows 8.. (8 features of 2 bytes each).
        let Launch::Gemm(third) = &l[5] else { unreachable!() };
        let Launch::Gemm(first) = &l[1] else { unreachable!() };
        assert_eq!(third.b - first.b, 8 * 8 * 2);
        assert!(third.trans_b && !third.trans_a);
    }

    #[test]
    fn the_backward_writes_each_chunk_of_dweight_once_and_adds_dhidden_in_order() {
        let op = Op::from(LinearCrossEntropyBackward {
            chunk: 4,
            reduction: Reduction::Sum,
            ignore_index: -100,
            softcap: 0.0,
            weight_grad: true,
        });
        let mut types = operands(6, 8, 6);
        types.extend([t(DType::F32, &[6]), t(DType::F32, &[])]);
        let l = lower_types(&op, &types, 0).unwrap();
        assert_eq!(
            names(&l),
            [
                "gemm 6x4x8",
                "linear_ce_backward_chunk_bf16",
                "gemm 4x8x6",
                "gemm 6x8x4",
                "linear_ce_accumulate_bf16",
                "gemm 6x2x8",
                "linear_ce_backward_chunk_bf16",
                "gemm 2x8x6",
                "gemm 6x8x2",
                "linear_ce_accumulate_bf16",
                "linear_ce_round_bf16",
                "memset",
                "memset",
            ]
        );
        let first_flag = |i: usize| match &l[i] {
            Launch::Kernel(k) => k.args[3].clone(),
            _ => unreachable!(),
        };
        assert_eq!((first_flag(4), first_flag(9)), (Arg::I32(1), Arg::I32(0)));
    }

    #[test]
    fn no_rows_still_write_the_loss_and_a_zero_dweight() {
        let fwd =
            Op::from(LinearCrossEntropy { chunk: 4, reduction: Reduction::Mean, ignore_index: -100, softcap: 0.0 });
        let l = lower_types(&fwd, &operands(0, 8, 6), 0).unwrap();
        assert_eq!(names(&l), ["linear_ce_finish_bf16"], "the mean over no row is still written (NaN)");
        let bwd = Op::from(LinearCrossEntropyBackward {
            chunk: 4,
            reduction: Reduction::Mean,
            ignore_index: -100,
            softcap: 0.0,
            weight_grad: true,
        });
        let mut types = operands(0, 8, 6);
        types.extend([t(DType::F32, &[0]), t(DType::F32, &[])]);
        let l = lower_types(&bwd, &types, 0).unwrap();
        // dweight, chunk by chunk (an empty sum over rows), and no zero-byte memset.
        let fills: Vec<u64> = l
            .iter()
            .map(|l| match l {
                Launch::Memset { bytes, .. } => *bytes,
                other => panic!("expected memsets only, got {other:?}"),
            })
            .collect();
        assert_eq!(fills, [4 * 8 * 2, 2 * 8 * 2]);
    }

    /// The parameters of kernel `name` (`..._##sfx`) in `linear_ce.cu`, by
    /// their declarations.
    fn kernel_params(name: &str) -> Vec<String> {
        let src = include_str!("../../kernels/linear_ce.cu");
        let at = src.find(&format!("{name}_##sfx(")).unwrap_or_else(|| panic!("no kernel {name}"));
        let open = at + src[at..].find('(').unwrap() + 1;
        let close = open + src[open..].find(')').unwrap();
        src[open..close]
            .replace('\\', " ")
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect()
    }

    /// The arguments of every launch of `function`.
    fn args_of<'a>(l: &'a [Launch], function: &str) -> Vec<&'a [Arg]> {
        l.iter()
            .filter_map(|l| match l {
                Launch::Kernel(k) if k.function == function => Some(k.args.as_slice()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_soft_cap_is_the_last_argument_of_both_chunk_kernels() {
        for softcap in [0.0, 30.0] {
            let fwd =
                Op::from(LinearCrossEntropy { chunk: 4, reduction: Reduction::Mean, ignore_index: -100, softcap });
            let l = lower_types(&fwd, &operands(6, 8, 10), 0).unwrap();
            let stats = args_of(&l, "linear_ce_chunk_stats_bf16");
            assert_eq!(stats.len(), 3, "one per chunk");
            let params = kernel_params("linear_ce_chunk_stats");
            assert_eq!(params.last().map(String::as_str), Some("double softcap"));
            for a in stats {
                assert_eq!(a.len(), params.len(), "{params:?}");
                assert_eq!(a.last(), Some(&Arg::F64(softcap)));
            }

            let bwd = Op::from(LinearCrossEntropyBackward {
                chunk: 4,
                reduction: Reduction::Mean,
                ignore_index: -100,
                softcap,
                weight_grad: true,
            });
            let params = kernel_params("linear_ce_backward_chunk");
            assert_eq!(params.last().map(String::as_str), Some("double softcap"));
            // Without and with the lse cotangent.
            for extra in [0, 1] {
                let mut types = operands(6, 8, 10);
                types.extend([t(DType::F32, &[6]), t(DType::F32, &[])]);
                types.extend((0..extra).map(|_| t(DType::F32, &[6])));
                let l = lower_types(&bwd, &types, 0).unwrap();
                let chunks = args_of(&l, "linear_ce_backward_chunk_bf16");
                assert_eq!(chunks.len(), 3, "one per chunk");
                for a in chunks {
                    assert_eq!(a.len(), params.len(), "{params:?}");
                    assert_eq!(a.last(), Some(&Arg::F64(softcap)));
                }
            }
        }
    }

    #[test]
    fn f64_is_declined_as_unsupported() {
        let op =
            Op::from(LinearCrossEntropy { chunk: 4, reduction: Reduction::Mean, ignore_index: -100, softcap: 0.0 });
        let types = [t(DType::F64, &[2, 3]), t(DType::F64, &[5, 3]), t(DType::I64, &[2])];
        assert!(matches!(lower_types(&op, &types, 0), Err(CudaError::Unsupported { .. })));
    }
}
